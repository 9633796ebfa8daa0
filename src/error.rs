//! Typed errors of the kvrun library.
//!
//! Every variant carries what a user needs to act on it (file, flag, offset,
//! sizes). The binary prints `error: {e}` on one line and exits non-zero; the
//! library never panics on bad input.

use std::path::PathBuf;

/// Result alias used throughout the library.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in kvrun, with enough context to act on it.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An OS-level I/O failure on a named file.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },

    /// The file is not a GGUF file or its structure is corrupt.
    #[error("{path}: invalid GGUF at byte {offset}: {what}")]
    BadGguf {
        path: PathBuf,
        offset: u64,
        what: String,
    },

    /// The tensor table points past the end of the file.
    #[error("{path}: tensor data missing: tensor '{tensor}' needs bytes {start}..{end} but the file has {file_len} bytes (truncated or header-only file)")]
    TensorDataMissing {
        path: PathBuf,
        tensor: String,
        start: u64,
        end: u64,
        file_len: u64,
    },

    /// A tensor type id kvrun cannot compute with.
    #[error("{path}: tensor '{tensor}' has unsupported type {ty}")]
    UnsupportedTensorType {
        path: PathBuf,
        tensor: String,
        ty: String,
    },

    /// `general.architecture` names a model family kvrun does not implement.
    #[error("{path}: unknown architecture '{arch}' (supported: llama, qwen2)")]
    UnknownArchitecture { path: PathBuf, arch: String },

    /// A required metadata key is absent or has the wrong type.
    #[error("{path}: metadata key '{key}': {what}")]
    BadMetadata {
        path: PathBuf,
        key: String,
        what: String,
    },

    /// A tensor the architecture needs is not in the file.
    #[error("{path}: missing tensor '{tensor}'")]
    MissingTensor { path: PathBuf, tensor: String },

    /// A tensor has a shape that disagrees with the hyperparameters.
    #[error("{path}: tensor '{tensor}' has shape {got:?}, expected {want:?}")]
    ShapeMismatch {
        path: PathBuf,
        tensor: String,
        got: Vec<u64>,
        want: Vec<u64>,
    },

    /// The tokenizer described by the file cannot be built faithfully.
    #[error("tokenizer: {0}")]
    Tokenizer(String),

    /// The chat template failed to parse or render.
    #[error("chat template: {0}")]
    Template(String),

    /// A command-line value is out of range or inconsistent.
    #[error("{flag}: {what}")]
    BadArg { flag: String, what: String },

    /// The prompt does not fit into the context window.
    #[error("-c/--ctx-size: prompt has {n_prompt} tokens but the context holds {n_ctx}")]
    ContextTooSmall { n_prompt: usize, n_ctx: usize },

    /// A safetensors / Hugging Face directory problem.
    #[error("{path}: {what}")]
    BadCheckpoint { path: PathBuf, what: String },

    /// Any other failure with a message.
    #[error("{0}")]
    Other(String),
}

impl Error {
    /// Shorthand for a command-line argument error.
    pub fn arg(flag: &str, what: impl Into<String>) -> Self {
        Error::BadArg {
            flag: flag.to_owned(),
            what: what.into(),
        }
    }
}
