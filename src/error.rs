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
    #[error("{path}: unknown architecture '{arch}' (supported: llama, qwen2, qwen3, qwen3moe, gemma3, phi3)")]
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

    /// A KV-policy or sampling setting is out of range or inconsistent; each front end
    /// names the fields its own way (flags here, JSON fields in the server).
    #[error("{0}")]
    Config(ConfigError),

    /// The prompt does not fit into the context window.
    #[error("-c/--ctx-size: prompt has {n_prompt} tokens but the context holds {n_ctx} (raise it, e.g. -c {})", n_prompt.saturating_add(256).next_power_of_two())]
    ContextTooSmall { n_prompt: usize, n_ctx: usize },

    /// A safetensors / Hugging Face directory problem.
    #[error("{path}: {what}")]
    BadCheckpoint { path: PathBuf, what: String },

    /// The user pressed Ctrl-C: the command stopped early after saving and
    /// reporting what it finished; the binary exits with status 130.
    #[error("interrupted")]
    Interrupted,

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

    /// A KV-policy setting error about `field`.
    pub fn config(field: Field, msg: impl Into<Msg>) -> Self {
        Error::Config(ConfigError {
            field,
            msg: msg.into(),
        })
    }
}

/// A KV-policy or sampling setting, whatever front end set it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Field {
    Temp,
    TopK,
    TopP,
    MinP,
    RepeatPenalty,
    Policy,
    Budget,
    Sink,
    Recent,
    KeepPrompt,
    EvictEvery,
    PromptPolicy,
    PromptBudget,
    EpikvLayers,
    EpikvBands,
    EpikvWindow,
    EpikvConfig,
    EpikvScorePrompt,
    ObsWindow,
    PoolKernel,
    AdakvSafeguard,
    PyramidBeta,
    CriticalAlpha,
    CriticalEps,
    Gates,
    MinPerHead,
    TrimLookahead,
    LagSize,
    RkvLambda,
    HistoryWindow,
    HeadScores,
    PromptCompress,
    CacheType,
    PosMode,
}

impl Field {
    /// The command-line flag.
    pub fn flag(self) -> &'static str {
        match self {
            Field::Temp => "--temp",
            Field::TopK => "--top-k",
            Field::TopP => "--top-p",
            Field::MinP => "--min-p",
            Field::RepeatPenalty => "--repeat-penalty",
            Field::Policy => "--policy",
            Field::Budget => "--kv-budget",
            Field::Sink => "--kv-sink",
            Field::Recent => "--kv-recent",
            Field::KeepPrompt => "--keep-prompt",
            Field::EvictEvery => "--evict-every",
            Field::PromptPolicy => "--prompt-policy",
            Field::PromptBudget => "--prompt-budget",
            Field::EpikvLayers => "--epikv-layers",
            Field::EpikvBands => "--epikv-bands",
            Field::EpikvWindow => "--epikv-window",
            Field::EpikvConfig => "--epikv-config",
            Field::EpikvScorePrompt => "--epikv-score-prompt",
            Field::ObsWindow => "--obs-window",
            Field::PoolKernel => "--pool-kernel",
            Field::AdakvSafeguard => "--adakv-safeguard",
            Field::PyramidBeta => "--pyramid-beta",
            Field::CriticalAlpha => "--critical-alpha",
            Field::CriticalEps => "--critical-eps",
            Field::Gates => "--gates",
            Field::MinPerHead => "--min-per-head",
            Field::TrimLookahead => "--trim-lookahead",
            Field::LagSize => "--lag-size",
            Field::RkvLambda => "--rkv-lambda",
            Field::HistoryWindow => "--history-window",
            Field::HeadScores => "--head-scores",
            Field::PromptCompress => "--prompt-compress",
            Field::CacheType => "--cache-type",
            Field::PosMode => "--pos-mode",
        }
    }

    /// The request field of the HTTP server, for the settings a request
    /// may override (the others come from the server's flags).
    pub fn json(self) -> Option<&'static str> {
        Some(match self {
            Field::Temp => "temperature",
            Field::TopK => "top_k",
            Field::TopP => "top_p",
            Field::MinP => "min_p",
            Field::RepeatPenalty => "repeat_penalty",
            Field::Policy => "policy",
            Field::Budget => "kv_budget",
            Field::Sink => "kv_sink",
            Field::Recent => "kv_recent",
            Field::KeepPrompt => "keep_prompt",
            Field::EvictEvery => "evict_every",
            Field::PromptPolicy => "prompt_policy",
            Field::PromptBudget => "prompt_budget",
            Field::EpikvScorePrompt => "epikv_score_prompt",
            _ => return None,
        })
    }
}

/// One piece of a message: text, or a reference to a setting that the
/// front end names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Piece {
    Text(String),
    Field(Field),
}

/// A message that may name settings (`Msg::from("needs ").f(Field::Budget)`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Msg(pub Vec<Piece>);

impl Msg {
    /// Append text.
    pub fn t(mut self, s: impl Into<String>) -> Msg {
        self.0.push(Piece::Text(s.into()));
        self
    }
    /// Append a setting's name.
    pub fn f(mut self, f: Field) -> Msg {
        self.0.push(Piece::Field(f));
        self
    }
    /// The text with each setting named by `name`.
    pub fn render(&self, name: impl Fn(Field) -> &'static str) -> String {
        self.0
            .iter()
            .map(|p| match p {
                Piece::Text(t) => t.as_str(),
                Piece::Field(f) => name(*f),
            })
            .collect()
    }
}

impl From<String> for Msg {
    fn from(s: String) -> Msg {
        Msg(vec![Piece::Text(s)])
    }
}

impl From<&str> for Msg {
    fn from(s: &str) -> Msg {
        Msg(vec![Piece::Text(s.to_owned())])
    }
}

/// A KV-policy setting error: the setting at fault and what is wrong.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    pub field: Field,
    pub msg: Msg,
}

impl ConfigError {
    /// "name: message", every setting named by `name`.
    pub fn render(&self, name: impl Fn(Field) -> &'static str + Copy) -> String {
        format!("{}: {}", name(self.field), self.msg.render(name))
    }
}

impl std::fmt::Display for ConfigError {
    /// Named by command-line flags.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.render(Field::flag))
    }
}
