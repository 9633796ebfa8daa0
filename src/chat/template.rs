//! Chat templates: the model's Jinja template (`tokenizer.chat_template`)
//! rendered with minijinja the way Hugging Face `apply_chat_template` does.
//!
//! The environment mirrors transformers' sandbox: `trim_blocks` and
//! `lstrip_blocks` on, Python string/dict methods (`.strip()`, `.split()`,
//! `.startswith()`, `.items()`, ...) through `minijinja-contrib`'s pycompat
//! callback, `raise_exception(msg)` and `strftime_now(fmt)` as globals, and
//! `messages`, `bos_token`, `eos_token` and `add_generation_prompt` in the
//! context. A template that fails to parse is reported when it is loaded; one
//! that fails while rendering (including `raise_exception`) becomes
//! `Error::Template` with minijinja's message.
//!
//! A template comes from the model file, i.e. from whoever made it, so a
//! render is bounded: at most [`FUEL`] minijinja instructions (an endless or
//! quadratic template fails instead of hanging) and [`MAX_RENDER`] bytes of
//! output (a template that repeats text fails instead of exhausting memory).

use crate::error::{Error, Result};
use crate::format::gguf::Gguf;
use minijinja::{context, Environment, ErrorKind};
use serde::{Deserialize, Serialize};
use std::fmt;

/// Template name inside the environment.
const NAME: &str = "chat";

/// Instructions one render may execute. Real templates spend a few hundred
/// per message, so this holds conversations of tens of thousands of turns.
pub const FUEL: u64 = 20_000_000;

/// Bytes one render may produce (far beyond any context window's text).
pub const MAX_RENDER: usize = 64 << 20;

/// A `String` sink that refuses to grow past [`MAX_RENDER`].
struct Capped(Vec<u8>);

impl std::io::Write for Capped {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.0.len() + buf.len() > MAX_RENDER {
            return Err(std::io::Error::other(format!(
                "the rendered prompt exceeds {} MiB",
                MAX_RENDER >> 20
            )));
        }
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// One chat turn.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    /// `system`, `user`, `assistant`, ...
    pub role: String,
    /// The turn's text.
    pub content: String,
}

impl Message {
    /// Shorthand constructor.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Message {
        Message {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A compiled chat template plus the special-token texts it may reference.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos: String,
    eos: String,
    /// `enable_thinking` as templates with a thinking switch read it
    /// (Qwen3: false renders an empty `<think></think>` block, so the model
    /// answers directly); None leaves it to the template's default.
    pub enable_thinking: Option<bool>,
}

impl fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source_len", &self.source.len())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .finish_non_exhaustive()
    }
}

fn tmpl_err(e: minijinja::Error) -> Error {
    // Include the chain of causes (e.g. the error behind a failed call).
    let mut msg = e.to_string();
    let mut src = std::error::Error::source(&e);
    while let Some(s) = src {
        msg.push_str(&format!(": {s}"));
        src = s.source();
    }
    Error::Template(msg)
}

/// Text of token `key`'s id in the file's vocabulary, or "" if absent.
fn token_text(g: &Gguf, key: &str) -> String {
    let id = g.get(key).and_then(|v| v.as_i64());
    let tokens = g.get("tokenizer.ggml.tokens").and_then(|v| v.as_array());
    match (id, tokens) {
        (Some(id), Some(toks)) if id >= 0 => toks
            .get(id as usize)
            .and_then(|v| v.as_str())
            .unwrap_or("")
            .to_owned(),
        _ => String::new(),
    }
}

/// The Gemma turn format (`--chat-template gemma`):
/// `<start_of_turn>user` / `<start_of_turn>model` turns closed by
/// `<end_of_turn>`; Gemma has no system role, so system text opens the
/// next user turn.
pub const GEMMA_TEMPLATE: &str = "{{ bos_token }}\
{%- set pending = namespace(text='') -%}
{%- for m in messages -%}
{%- if m.role == 'system' -%}
{%- set pending.text = pending.text + m.content + '\n\n' -%}
{%- else -%}
{{ '<start_of_turn>' + ('model' if m.role == 'assistant' else 'user') + '\n' }}
{%- if m.role == 'user' %}{{ pending.text }}{% set pending.text = '' %}{% endif -%}
{{ m.content | trim }}{{ '<end_of_turn>\n' }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif -%}";

/// ChatML (`--chat-template chatml`): `<|im_start|>ROLE` … `<|im_end|>`.
pub const CHATML_TEMPLATE: &str = "{%- for m in messages -%}
{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}
{%- endfor -%}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif -%}";

/// The built-in templates `--chat-template` names, by name.
pub const BUILTIN_TEMPLATES: &[(&str, &str)] =
    &[("chatml", CHATML_TEMPLATE), ("gemma", GEMMA_TEMPLATE)];

impl ChatTemplate {
    /// The same template with `enable_thinking` set to `on`.
    pub fn with_thinking(&self, on: Option<bool>) -> ChatTemplate {
        ChatTemplate {
            env: self.env.clone(),
            source: self.source.clone(),
            bos: self.bos.clone(),
            eos: self.eos.clone(),
            enable_thinking: on,
        }
    }

    /// A template chosen on the command line: a built-in name
    /// ([`BUILTIN_TEMPLATES`]) or Jinja source, with `bos_token` /
    /// `eos_token` taken from `tok`.
    pub fn from_arg(arg: &str, tok: &crate::tokenizer::Tokenizer) -> Result<ChatTemplate> {
        let src = match BUILTIN_TEMPLATES.iter().find(|(n, _)| *n == arg) {
            Some((_, src)) => *src,
            None if arg.contains("{{") || arg.contains("{%") => arg,
            None => {
                let names: Vec<&str> = BUILTIN_TEMPLATES.iter().map(|(n, _)| *n).collect();
                return Err(Error::Template(format!(
                    "'{arg}' is neither a built-in template ({}) nor Jinja source",
                    names.join(", ")
                )));
            }
        };
        Self::for_tokenizer(src, tok)
    }

    /// Compile `src` with `bos_token` / `eos_token` taken from `tok`.
    pub fn for_tokenizer(src: &str, tok: &crate::tokenizer::Tokenizer) -> Result<ChatTemplate> {
        let text = |id: Option<u32>| {
            id.map(|i| tok.token_text(i).to_string())
                .unwrap_or_default()
        };
        Self::from_source(src, &text(tok.bos()), &text(tok.eos()))
    }

    /// The template stored in a GGUF file (`tokenizer.chat_template`), with
    /// `bos_token` / `eos_token` taken from the vocabulary. `Ok(None)` when the
    /// file has no template.
    pub fn from_gguf(g: &Gguf) -> Result<Option<ChatTemplate>> {
        let src = match g.get("tokenizer.chat_template") {
            None => return Ok(None),
            Some(v) => v.as_str().ok_or_else(|| {
                Error::Template(format!(
                    "metadata key 'tokenizer.chat_template' must be a string, found {}",
                    v.type_name()
                ))
            })?,
        };
        let bos = token_text(g, "tokenizer.ggml.bos_token_id");
        let eos = token_text(g, "tokenizer.ggml.eos_token_id");
        Self::from_source(src, &bos, &eos).map(Some)
    }

    /// Compile a Jinja chat template; `bos` / `eos` are the texts the template
    /// sees as `bos_token` / `eos_token`.
    pub fn from_source(src: &str, bos: &str, eos: &str) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        env.set_fuel(Some(FUEL));
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    format!("template raised: {msg}"),
                ))
            },
        );
        env.add_function("strftime_now", |fmt: String| -> String {
            strftime_now(&fmt)
        });
        env.add_template_owned(NAME, src.to_owned())
            .map_err(tmpl_err)?;
        Ok(ChatTemplate {
            env,
            source: src.to_owned(),
            bos: bos.to_owned(),
            eos: eos.to_owned(),
            enable_thinking: None,
        })
    }

    /// Render a conversation. With `add_generation_prompt` the template
    /// appends the opening of the assistant's turn.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        let tmpl = self.env.get_template(NAME).map_err(tmpl_err)?;
        let mut out = Capped(Vec::new());
        tmpl.render_captured_to(
            context! {
                messages => messages,
                bos_token => &self.bos,
                eos_token => &self.eos,
                add_generation_prompt => add_generation_prompt,
                enable_thinking => self.enable_thinking,
            },
            &mut out,
        )
        .map_err(tmpl_err)?;
        // minijinja writes whole UTF-8 strings, so the bytes are text
        String::from_utf8(out.0).map_err(|e| Error::Template(e.to_string()))
    }

    /// Render a conversation and say where each message's content landed:
    /// the byte ranges (in order) of the rendered text that came from
    /// message contents, not from the template. Found by rendering once more
    /// with a marker in place of each content; None when the template
    /// rewrites contents beyond trimming them (the markers then do not map
    /// back onto the real rendering).
    pub fn render_with_content_spans(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<(String, Option<Vec<std::ops::Range<usize>>>)> {
        let real = self.render(messages, add_generation_prompt)?;
        // private-use characters: no template emits them on its own
        let (open, close) = ('\u{F8F0}', '\u{F8F1}');
        let marked: Vec<Message> = messages
            .iter()
            .enumerate()
            .map(|(i, m)| Message::new(m.role.clone(), format!("{open}{i}{close}")))
            .collect();
        let Ok(marked) = self.render(&marked, add_generation_prompt) else {
            return Ok((real, None));
        };
        for trim in [false, true] {
            let mut out = String::with_capacity(real.len());
            let mut spans = Vec::new();
            let mut rest = marked.as_str();
            let mut ok = true;
            while let Some(p) = rest.find(open) {
                out.push_str(&rest[..p]);
                let after = &rest[p + open.len_utf8()..];
                let Some(q) = after.find(close) else {
                    ok = false;
                    break;
                };
                let Some(m) = after[..q]
                    .parse::<usize>()
                    .ok()
                    .and_then(|i| messages.get(i))
                else {
                    ok = false;
                    break;
                };
                let c = if trim { m.content.trim() } else { &m.content };
                let start = out.len();
                out.push_str(c);
                if !c.is_empty() {
                    spans.push(start..out.len());
                }
                rest = &after[q + close.len_utf8()..];
            }
            out.push_str(rest);
            if ok && out == real {
                return Ok((real, Some(spans)));
            }
        }
        Ok((real, None))
    }

    /// The template's Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }
}

/// Format the current UTC time with a subset of C `strftime` (`%Y %y %m %d %e
/// %H %M %S %B %b %A %a %j %p %%`); other directives are copied through.
fn strftime_now(fmt: &str) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    strftime_utc(secs, fmt)
}

/// `strftime` for a Unix time in UTC (see [`strftime_now`]).
fn strftime_utc(secs: i64, fmt: &str) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    let (h, mi, s) = (rem / 3600, rem % 3600 / 60, rem % 60);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday.
    let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let cum = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cum[(m - 1) as usize] + d + i64::from(leap && m > 2);
    let month = MONTHS[(m - 1) as usize];
    let day = DAYS[weekday];

    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&format!("{:02}", y.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('e') => out.push_str(&format!("{d:2}")),
            Some('H') => out.push_str(&format!("{h:02}")),
            Some('M') => out.push_str(&format!("{mi:02}")),
            Some('S') => out.push_str(&format!("{s:02}")),
            Some('B') => out.push_str(month),
            Some('b') => out.push_str(&month[..3]),
            Some('A') => out.push_str(day),
            Some('a') => out.push_str(&day[..3]),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('p') => out.push_str(if h < 12 { "AM" } else { "PM" }),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::strftime_utc;

    #[test]
    fn strftime_known_dates() {
        // 2024-02-29 13:05:09 UTC, a Thursday.
        assert_eq!(
            strftime_utc(1_709_211_909, "%Y-%m-%d %H:%M:%S %a %b %j"),
            "2024-02-29 13:05:09 Thu Feb 060"
        );
        assert_eq!(strftime_utc(0, "%d %B %Y, %A"), "01 January 1970, Thursday");
        assert_eq!(strftime_utc(0, "100%% %q"), "100% %q");
    }
}
