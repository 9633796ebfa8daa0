//! Chat: the model's template and the streaming filters applied to what it
//! generates.
//!
//! - [`template`]: the Jinja chat template (`tokenizer.chat_template`),
//!   rendered the way Hugging Face `apply_chat_template` does.
//! - [`think`]: the `<think>…</think>` splitter shared by `kvrun chat` and
//!   `kvrun serve`.
//! - [`stop`]: the stop-string matcher (`kvrun serve`'s `stop` field).

pub mod stop;
pub mod template;
pub mod think;

pub use stop::StopMatch;
pub use template::{ChatTemplate, Message};
pub use think::{ThinkEvent, ThinkSplit};
