//! Model loading: a GGUF file or a Hugging Face safetensors directory, opened
//! as a [`Checkpoint`] and turned into weights, tokenizer and chat template.
//!
//! - [`Checkpoint`]: either kind of model on disk, memory-mapped.
//! - [`Loaded`]: a checkpoint together with the weights that borrow its maps
//!   and the tokenizer, checked against each other; it owns everything, so
//!   commands and server threads share one without leaking it.
//! - [`safetensors`]: Hugging Face directories (`config.json`, tensors);
//!   [`hf_tokenizer`]: their `tokenizer.json`.
//!
//! The file formats themselves (GGUF, the memory map) are in
//! [`crate::format`], below the model; this module sits above the model,
//! the tokenizer and the chat template.

pub mod hf_tokenizer;
mod json;
pub mod safetensors;

/// The GGUF reader and the memory map live in [`crate::format`]; these
/// aliases keep `kvrun::load::gguf` / `kvrun::load::mmap` working for code
/// written against the old paths.
pub use crate::format::{gguf, mmap};

use crate::backend::{HostLoader, HOST_LOADER};
use crate::chat::ChatTemplate;
use crate::error::{Error, Result};
use crate::format::gguf::Gguf;
use crate::model::Weights;
use crate::tokenizer::Tokenizer;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// A model on disk: a GGUF file or a Hugging Face safetensors directory.
#[derive(Debug)]
pub enum Checkpoint {
    Gguf(Box<Gguf>),
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
    /// Open a GGUF file, a directory holding config.json + *.safetensors, or
    /// `synth:HEADER[:SHAPE][:TYPE]` (the synthetic-weight model of a GGUF header,
    /// generated in memory: [`crate::format::synth`]).
    pub fn open(path: &Path) -> Result<Checkpoint> {
        if let Some(name) = crate::format::synth::parse_name(path) {
            let (header, recipe) = name?;
            let spec = crate::format::synth::Spec::default();
            Ok(Checkpoint::Gguf(Box::new(crate::format::synth::in_memory(
                &header, &recipe, path, &spec,
            )?)))
        } else if path.is_dir() {
            if !path.join("config.json").is_file() {
                return Err(Error::BadCheckpoint {
                    path: path.to_owned(),
                    what: "a directory, but not a Hugging Face model directory (no config.json); give a GGUF file or a directory with config.json, *.safetensors and tokenizer.json".into(),
                });
            }
            Ok(Checkpoint::Hf(Box::new(safetensors::HfCheckpoint::open(
                path,
            )?)))
        } else {
            Ok(Checkpoint::Gguf(Box::new(Gguf::open(path)?)))
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
        self.weights_on(&HOST_LOADER)
    }
    /// The model's weights, taken by `loader` (which says where the
    /// matrices are read from).
    pub fn weights_on(&self, loader: &HostLoader) -> Result<Weights<'_>> {
        match self {
            Checkpoint::Gguf(g) => Weights::from_gguf_on(loader, g),
            Checkpoint::Hf(h) => h.weights_on(loader),
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
    /// Size on disk in bytes (the GGUF file, or the safetensors files).
    pub fn n_bytes(&self) -> u64 {
        match self {
            Checkpoint::Gguf(g) => g.bytes().len() as u64,
            Checkpoint::Hf(h) => h.n_bytes(),
        }
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

/// A model ready for inference: the checkpoint, the weights built from it
/// and its tokenizer, with the tokenizer checked to fit the embedding.
///
/// The weights borrow the checkpoint's maps; `Loaded` owns both (the
/// checkpoint behind an [`Arc`], so it never moves), which makes it a plain
/// owned value: put it in an `Arc` to share it between threads.
#[derive(Debug)]
pub struct Loaded {
    /// Where the model was read from (a GGUF file or an HF directory).
    pub path: PathBuf,
    /// The model's tokenizer.
    pub tokenizer: Tokenizer,
    // Declared before `ck`, so dropped before it: these weights borrow the
    // data `ck` owns (see `Loaded::open`).
    weights: Weights<'static>,
    ck: Arc<Checkpoint>,
}

impl Loaded {
    /// Open `path` (a GGUF file or an HF directory), build the weights and
    /// the tokenizer, and fail with one line when the tokenizer has more
    /// tokens than the embedding has rows.
    pub fn open(path: &Path) -> Result<Loaded> {
        Self::open_with(path, &HOST_LOADER)
    }

    /// `open`, the weights taken by `loader`.
    pub fn open_with(path: &Path, loader: &HostLoader) -> Result<Loaded> {
        let ck = Arc::new(Checkpoint::open(path)?);
        let w: Weights<'_> = ck.weights_on(loader)?;
        // SAFETY: `w` borrows only from `*ck` (the checkpoint's maps and
        // headers): `Checkpoint::weights` ties its result to `&self` and
        // nothing else. That data lives in the Arc's heap allocation and in
        // what it owns, so it neither moves when `ck` (the pointer) moves
        // into the struct nor is ever mutated (no `&mut Checkpoint` is ever
        // made: the Arc is private and never passed to `get_mut`). `Loaded`
        // keeps `ck` alive at least as long as the weights: the field is
        // dropped after `weights` (declaration order), and on the error
        // paths below the local `weights` is dropped before the local `ck`
        // (reverse declaration order). The `'static` is never exposed:
        // `weights()` hands out `&'a Weights<'a>` for a borrow `'a` of
        // `self` (sound because `Weights` is covariant in its lifetime,
        // which the compiler checks at that coercion).
        let weights = unsafe { std::mem::transmute::<Weights<'_>, Weights<'static>>(w) };
        let tokenizer = ck.tokenizer()?;
        if tokenizer.n_vocab() > weights.config.vocab {
            return Err(Error::Other(format!(
                "{}: the tokenizer has {} tokens but token_embd.weight has only {} rows",
                path.display(),
                tokenizer.n_vocab(),
                weights.config.vocab
            )));
        }
        Ok(Loaded {
            path: path.to_owned(),
            tokenizer,
            weights,
            ck,
        })
    }

    /// The weights (borrowing this model's maps).
    pub fn weights(&self) -> &Weights<'_> {
        self.weights.shorten()
    }

    /// The checkpoint the weights come from.
    pub fn checkpoint(&self) -> &Checkpoint {
        &self.ck
    }

    /// The chat template, if the model has one (compiled on each call).
    pub fn chat_template(&self) -> Result<Option<ChatTemplate>> {
        self.ck.chat_template()
    }

    /// A display name (GGUF `general.name`, or the directory name).
    pub fn name(&self) -> String {
        self.ck.name()
    }
}
