//! Model file loading: GGUF (memory-mapped) and Hugging Face safetensors directories.

pub mod gguf;
pub mod mmap;
pub mod safetensors;

use crate::chat::ChatTemplate;
use crate::error::{Error, Result};
use crate::model::Weights;
use crate::tokenizer::Tokenizer;
use std::path::Path;

/// A model on disk: a GGUF file or a Hugging Face safetensors directory.
#[derive(Debug)]
pub enum Checkpoint {
    Gguf(Box<gguf::Gguf>),
    Hf(Box<safetensors::HfCheckpoint>),
}

fn in_file(path: &Path, e: Error) -> Error {
    match e {
        Error::Tokenizer(m) => Error::Tokenizer(format!("{}: {m}", path.display())),
        Error::Template(m) => Error::Template(format!("{}: {m}", path.display())),
        other => other,
    }
}

impl Checkpoint {
    /// Open a GGUF file, or a directory holding config.json + *.safetensors.
    pub fn open(path: &Path) -> Result<Checkpoint> {
        if path.is_dir() {
            Ok(Checkpoint::Hf(Box::new(safetensors::HfCheckpoint::open(
                path,
            )?)))
        } else {
            Ok(Checkpoint::Gguf(Box::new(gguf::Gguf::open(path)?)))
        }
    }
    fn path(&self) -> &Path {
        match self {
            Checkpoint::Gguf(g) => &g.path,
            Checkpoint::Hf(h) => &h.dir,
        }
    }
    /// The model's weights (borrowing the maps).
    pub fn weights(&self) -> Result<Weights<'_>> {
        match self {
            Checkpoint::Gguf(g) => Weights::from_gguf(g),
            Checkpoint::Hf(h) => h.weights(),
        }
    }
    /// The tokenizer.
    pub fn tokenizer(&self) -> Result<Tokenizer> {
        let t = match self {
            Checkpoint::Gguf(g) => Tokenizer::from_gguf(g),
            Checkpoint::Hf(h) => h.tokenizer(),
        };
        t.map_err(|e| in_file(self.path(), e))
    }
    /// The chat template, if the model has one.
    pub fn chat_template(&self) -> Result<Option<ChatTemplate>> {
        let t = match self {
            Checkpoint::Gguf(g) => ChatTemplate::from_gguf(g),
            Checkpoint::Hf(h) => h.chat_template(),
        };
        t.map_err(|e| in_file(self.path(), e))
    }
    /// A display name.
    pub fn name(&self) -> String {
        match self {
            Checkpoint::Gguf(g) => g
                .get("general.name")
                .and_then(|v| v.as_str())
                .unwrap_or("model")
                .to_owned(),
            Checkpoint::Hf(h) => h
                .dir
                .file_name()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| "model".into()),
        }
    }
}
