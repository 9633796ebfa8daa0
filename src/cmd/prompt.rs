//! Prompt tokens: the chat template applied (unless raw) and BOS added the
//! way the model wants it.

use crate::chat::{ChatTemplate, Message};
use crate::error::{Error, Result};
use crate::tokenizer::Tokenizer;

/// Tokenize a rendered chat: special tokens parsed, and BOS added only when
/// the model wants one and the template did not already emit it.
pub fn encode_rendered(tok: &Tokenizer, text: &str) -> Result<Vec<u32>> {
    let mut ids = tok.encode(text, false, true)?;
    add_bos_once(tok, &mut ids);
    Ok(ids)
}

/// Put BOS first when the model wants one and the template did not emit it.
fn add_bos_once(tok: &Tokenizer, ids: &mut Vec<u32>) {
    if let Some(b) = tok.bos().filter(|_| tok.add_bos()) {
        if ids.first() != Some(&b) {
            ids.insert(0, b);
        }
    }
}

/// Render and tokenize a chat for a client that may not inject control
/// tokens: template markup is parsed as control tokens, message contents
/// are plain text (`<|im_start|>` typed by a user stays those characters).
/// With `parse_special` the whole rendering is parsed, as the command line
/// does. Returns the rendered text and the tokens.
pub fn encode_chat(
    tok: &Tokenizer,
    tmpl: &ChatTemplate,
    msgs: &[Message],
    parse_special: bool,
) -> Result<(String, Vec<u32>)> {
    if parse_special || !msgs.iter().any(|m| tok.has_control_text(&m.content)) {
        // no control text in the contents: every control token is the template's
        let text = tmpl.render(msgs, true)?;
        let ids = encode_rendered(tok, &text)?;
        return Ok((text, ids));
    }
    let (text, spans) = tmpl.render_with_content_spans(msgs, true)?;
    let spans = spans.ok_or_else(|| {
        Error::Template("a message holds control-token text and the template rewrites message contents, so it cannot be kept as plain text (remove it, or start the server with --parse-special)".into())
    })?;
    let mut ids = tok.encode_with_plain(&text, false, &spans)?;
    add_bos_once(tok, &mut ids);
    Ok((text, ids))
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
