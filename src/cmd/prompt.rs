//! Prompt tokens: the chat template applied (unless raw) and BOS added the
//! way the model wants it.

use crate::chat::{ChatTemplate, Message};
use crate::error::Result;
use crate::tokenizer::Tokenizer;

/// Tokenize a rendered chat: special tokens parsed, and BOS added only when
/// the model wants one and the template did not already emit it.
pub fn encode_rendered(tok: &Tokenizer, text: &str) -> Result<Vec<u32>> {
    let mut ids = tok.encode(text, false, true)?;
    if tok.add_bos() {
        if let Some(b) = tok.bos() {
            if ids.first() != Some(&b) {
                ids.insert(0, b);
            }
        }
    }
    Ok(ids)
}

/// Build the prompt tokens: chat template unless `raw`, BOS per the model.
pub fn prompt_tokens(
    tok: &Tokenizer,
    tmpl: Option<&ChatTemplate>,
    prompt: &str,
    system: Option<&str>,
    raw: bool,
) -> Result<Vec<u32>> {
    match (raw, tmpl) {
        (false, Some(t)) => {
            let mut msgs = Vec::new();
            if let Some(s) = system {
                msgs.push(Message {
                    role: "system".into(),
                    content: s.into(),
                });
            }
            msgs.push(Message {
                role: "user".into(),
                content: prompt.into(),
            });
            encode_rendered(tok, &t.render(&msgs, true)?)
        }
        _ => tok.encode(prompt, true, true),
    }
}
