//! `kvrun chat`: a multi-turn REPL over the model's chat template.
//!
//! The KV cache carries over between turns: each turn renders the whole
//! conversation, tokenizes it, keeps the longest common token prefix with
//! what the cache already holds, truncates the cache to it (freeing only the
//! slots past the divergence, typically none) and feeds just the new tokens.
//! With a budgeted policy, `--keep-prompt` protects the system prompt and
//! earlier turns. `<think>…</think>` is shown dimmed (or hidden with
//! `--hide-thinking`), split by [`crate::chat::ThinkSplit`] as in the
//! server. Works with stdin from a pipe, for scripting.
//!
//! Commands: /exit, /clear, /regen, /save FILE, /stats.

use crate::chat::{ChatTemplate, Message, ThinkEvent, ThinkSplit};
use crate::cmd::args::{check_ctx_alloc, context_notes, resolve_model, resolve_threads, RunArgs};
use crate::cmd::interrupt::{self, Mode};
use crate::cmd::load_model;
use crate::cmd::prompt::encode_rendered;
use crate::error::{Error, Result};
use crate::generate::{generate, GenOptions, Session};
use crate::sample::Sampler;
use crate::tokenizer::Tokenizer;
use clap::Args;
use std::io::{BufRead, IsTerminal, Write};

/// The position limit of a budgeted chat: none that a conversation reaches
/// (the budget bounds the memory).
const UNBOUNDED_POSITIONS: usize = 1 << 40;

/// Flags of `kvrun chat`.
#[derive(Args, Debug, Clone)]
pub struct ChatArgs {
    #[command(flatten)]
    pub run: RunArgs,
    /// Do not print the model's <think>…</think> reasoning.
    #[arg(long = "hide-thinking")]
    pub hide_thinking: bool,
}

/// Streams a reply, rendering the reasoning part dimmed or hidden.
struct ThinkFilter {
    hide: bool,
    color: bool,
    split: ThinkSplit,
    events: Vec<ThinkEvent>,
}

impl ThinkFilter {
    fn push(&mut self, piece: &str, out: &mut impl Write) {
        self.split.push(piece, &mut self.events);
        self.write_events(out);
        let _ = out.flush();
    }
    fn write_events(&mut self, out: &mut impl Write) {
        for ev in self.events.drain(..) {
            match ev {
                ThinkEvent::Text { reasoning, text } => {
                    if !(reasoning && self.hide) {
                        let _ = write!(out, "{text}");
                    }
                }
                ThinkEvent::Tag { reasoning } => {
                    if self.color && !self.hide {
                        let _ = write!(out, "{}", if reasoning { "\x1b[2m" } else { "\x1b[0m" });
                    }
                }
            }
        }
    }
    fn finish(&mut self, out: &mut impl Write) {
        self.split.finish(&mut self.events);
        self.write_events(out);
        if self.color {
            let _ = write!(out, "\x1b[0m");
        }
        let _ = out.flush();
    }
}

/// Render `msgs` and tokenize (BOS added when the template does not emit it).
fn conversation_tokens(tok: &Tokenizer, tmpl: &ChatTemplate, msgs: &[Message]) -> Result<Vec<u32>> {
    encode_rendered(tok, &tmpl.render(msgs, true)?)
}

/// One line of stdin without its line ending: `None` at end of input,
/// `Some(Err(byte))` when it is not UTF-8 (the first bad byte).
fn read_line(
    input: &mut impl BufRead,
) -> std::io::Result<Option<std::result::Result<String, usize>>> {
    let mut buf = Vec::new();
    if input.read_until(b'\n', &mut buf)? == 0 {
        return Ok(None);
    }
    while matches!(buf.last(), Some(b'\n' | b'\r')) {
        buf.pop();
    }
    Ok(Some(
        String::from_utf8(buf).map_err(|e| e.utf8_error().valid_up_to()),
    ))
}

/// Tokens kept free for the reply when fitting a conversation into the
/// context: `-n` when given, else a quarter of the context (at most half).
fn reply_reserve(n_predict: i64, n_ctx: usize) -> usize {
    let want = if n_predict > 0 {
        n_predict as usize
    } else {
        n_ctx / 4
    };
    want.min(n_ctx / 2)
}

/// How a conversation meets a full-cache context.
#[derive(Debug, PartialEq)]
pub enum Fit {
    /// It fits as it is.
    Whole(Vec<u32>),
    /// It fits after dropping this many of the oldest messages (never the
    /// system prompt, never the newest message).
    Shifted(Vec<u32>, usize),
    /// Even the system prompt and the newest message alone need this many
    /// tokens, more than the context holds.
    TooLong(usize),
}

/// Fit `msgs` into `n_ctx` tokens with `reserve` left for the reply, by
/// dropping the oldest turns (llama.cpp's context shift, done on messages so
/// the template stays well-formed): the system prompt and the newest
/// message are always kept.
pub fn fit_context(
    tok: &Tokenizer,
    tmpl: &ChatTemplate,
    msgs: &mut Vec<Message>,
    n_ctx: usize,
    reserve: usize,
) -> Result<Fit> {
    let limit = n_ctx.saturating_sub(reserve).max(1);
    let mut dropped = 0;
    loop {
        let ids = conversation_tokens(tok, tmpl, msgs)?;
        if ids.len() <= limit {
            return Ok(if dropped == 0 {
                Fit::Whole(ids)
            } else {
                Fit::Shifted(ids, dropped)
            });
        }
        // the oldest message that is neither the system prompt nor the newest
        let first = msgs.iter().position(|m| m.role != "system");
        match first {
            Some(i) if i + 1 < msgs.len() => {
                msgs.remove(i);
                dropped += 1;
                // a reply without its question reads oddly: drop it as well
                if msgs.get(i).is_some_and(|m| m.role == "assistant") && i + 1 < msgs.len() {
                    msgs.remove(i);
                    dropped += 1;
                }
            }
            _ => {
                // only the system prompt and the newest message are left:
                // fits without a full reserve, or does not fit at all
                return Ok(if ids.len() < n_ctx {
                    if dropped == 0 {
                        Fit::Whole(ids)
                    } else {
                        Fit::Shifted(ids, dropped)
                    }
                } else {
                    Fit::TooLong(ids.len())
                });
            }
        }
    }
}

/// `kvrun chat`.
pub fn run_chat(a: &ChatArgs) -> Result<()> {
    let r = &a.run;
    let path = resolve_model(&r.model.model)?;
    let n_threads = resolve_threads(r.model.threads)?;
    r.kv.check()?;
    r.sampling.check()?;
    // a Ctrl-C while the model loads ends the process (nothing is lost yet)
    interrupt::install();
    interrupt::set_mode(Mode::Idle);
    let m = load_model(&r.model)?;
    let (w, tok) = (m.weights(), &m.tokenizer);
    let tmpl = r.model.chat_template(&m)?.ok_or_else(|| {
        Error::arg(
            "-m/--model",
            format!(
                "{}: the model has no chat template (a base model?); choose one with --chat-template chatml|gemma|JINJA",
                path.display()
            ),
        )
    })?;
    let n_ctx = if r.ctx_size <= 0 {
        w.config.n_ctx_train
    } else {
        r.ctx_size as usize
    };
    let seed = if r.seed < 0 { 0 } else { r.seed as u64 };
    // With a policy the budgeted cache holds the conversation however long
    // it grows: positions are not limited by -c, which only caps the budget.
    // Without one, the oldest turns are dropped when the context fills
    // (llama.cpp's context shift; see `fit_context`).
    let mut kv = r.kv.clone();
    kv.kv_budget = kv.kv_budget.map(|b| b.min(n_ctx.max(1)));
    let mut sess = match kv.build(seed, &path)? {
        None => {
            check_ctx_alloc(&w.config, n_ctx, n_threads)?;
            Session::new(w, n_ctx, n_threads, r.batch_size.max(1))
        }
        Some(p) => Session::with_policy(w, UNBOUNDED_POSITIONS, n_threads, r.batch_size.max(1), p)?,
    };
    let budgeted = sess.policy.is_some();
    kv.configure(&mut sess)?;
    // (said once the context is known to fit, so an error stays one line;
    // chat clamps every policy's budget, above)
    context_notes(&w.config, n_ctx, &r.kv, true);
    let mut sampler = Sampler::new(r.sampling.config(0.8, seed));
    let mut msgs: Vec<Message> = Vec::new();
    if let Some(s) = &r.system {
        msgs.push(Message {
            role: "system".into(),
            content: s.clone(),
        });
    }
    // tokens currently in the cache, in position order
    let mut cached: Vec<u32> = Vec::new();
    let interactive = std::io::stdin().is_terminal();
    let color = std::io::stdout().is_terminal();
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let mut gen_tokens = 0usize;
    let mut gen_ms = 0f64;
    let stdin = std::io::stdin();
    let mut input = stdin.lock();
    let mut first = r.prompt.clone();
    let mut shifted = false;
    loop {
        if interactive {
            let _ = write!(out, "\n> ");
            let _ = out.flush();
        }
        // at the prompt a Ctrl-C ends the session (Ctrl-D too)
        interrupt::set_mode(Mode::Idle);
        let line = match first.take() {
            Some(p) => p,
            None => match read_line(&mut input) {
                Ok(Some(Ok(l))) => l,
                Ok(Some(Err(at))) => {
                    let _ = writeln!(out, "[input is not valid UTF-8 (byte {at}); line skipped]");
                    continue;
                }
                Ok(None) => break,
                Err(e) => return Err(Error::Other(format!("stdin: {e}"))),
            },
        };
        interrupt::set_mode(Mode::Busy);
        interrupt::clear();
        let cmd = line.trim();
        if cmd.is_empty() {
            continue;
        }
        let mut regen = false;
        if let Some(rest) = cmd.strip_prefix('/') {
            let (name, arg) = rest.split_once(' ').unwrap_or((rest, ""));
            match name {
                "exit" | "quit" => break,
                "clear" => {
                    msgs.retain(|m| m.role == "system");
                    sess.reset();
                    cached.clear();
                    let _ = writeln!(out, "[conversation cleared]");
                    continue;
                }
                "stats" => {
                    let _ = writeln!(
                        out,
                        "[kv: {} resident / {} slots, peak {}, evicted {}, position {} | generated {} tokens, {:.1} tok/s]",
                        sess.kv.cells.n_live(),
                        sess.kv.cells.n_slots(),
                        sess.kv.peak_live,
                        sess.n_evicted,
                        sess.n_past,
                        gen_tokens,
                        if gen_ms > 0.0 { 1e3 * gen_tokens as f64 / gen_ms } else { 0.0 }
                    );
                    continue;
                }
                "save" => {
                    let arg = arg.trim();
                    if arg.is_empty() {
                        let _ = writeln!(out, "[usage: /save FILE]");
                        continue;
                    }
                    let json = serde_json::to_string_pretty(&msgs)
                        .map_err(|e| Error::Other(e.to_string()))?;
                    match std::fs::write(arg, json) {
                        Ok(()) => {
                            let _ = writeln!(out, "[saved {} messages to {arg}]", msgs.len());
                        }
                        Err(e) => {
                            let _ = writeln!(out, "[cannot save to {arg}: {e}]");
                        }
                    }
                    continue;
                }
                "regen" => {
                    if msgs.last().map(|m| m.role.as_str()) != Some("assistant") {
                        let _ = writeln!(out, "[nothing to regenerate]");
                        continue;
                    }
                    msgs.pop();
                    regen = true;
                }
                other => {
                    let _ = writeln!(out, "[unknown command /{other}; commands: /exit /clear /regen /save FILE /stats]");
                    continue;
                }
            }
        }
        if !regen {
            msgs.push(Message {
                role: "user".into(),
                content: line.clone(),
            });
        }
        let reserve = reply_reserve(r.n_predict, n_ctx);
        let ids = if budgeted {
            conversation_tokens(tok, &tmpl, &msgs)?
        } else {
            match fit_context(tok, &tmpl, &mut msgs, n_ctx, reserve)? {
                Fit::Whole(ids) => ids,
                Fit::Shifted(ids, n) => {
                    if !shifted {
                        let _ = writeln!(
                            out,
                            "[context full (-c {n_ctx}): dropped the oldest {n} message(s), keeping the system prompt; this happens again as needed]"
                        );
                        shifted = true;
                    }
                    ids
                }
                Fit::TooLong(n) => {
                    let _ = writeln!(
                        out,
                        "[message too long: the conversation needs {n} tokens but the context holds {n_ctx} (raise -c/--ctx-size or use --policy with --kv-budget); skipped]"
                    );
                    msgs.pop();
                    continue;
                }
            }
        };
        // keep the common prefix in the cache, feed the rest
        let common = cached
            .iter()
            .zip(&ids)
            .take_while(|(a, b)| a == b)
            .count()
            .min(ids.len().saturating_sub(1));
        let common = sess.rewind_point(common);
        sess.truncate(common)?;
        cached.truncate(common);
        let mut filter = ThinkFilter {
            hide: a.hide_thinking,
            color,
            split: ThinkSplit::new(false),
            events: Vec::new(),
        };
        let mut reply = String::new();
        let opts = GenOptions {
            n_predict: r.n_predict,
            ignore_eos: false,
        };
        let stats = generate(
            &mut sess,
            tok,
            &mut sampler,
            &ids[common..],
            &opts,
            |piece| {
                reply.push_str(piece);
                filter.push(piece, &mut out);
                // Ctrl-C stops this reply, not the session
                !interrupt::requested()
            },
        );
        let stats = match stats {
            Ok(s) => s,
            Err(e) => {
                // the turn failed (e.g. a kept prompt outgrew the budget):
                // say so, forget the message and start the cache afresh
                let _ = writeln!(out, "[error: {e}; message skipped]");
                if !regen {
                    msgs.pop();
                }
                sess.reset();
                cached.clear();
                continue;
            }
        };
        if interrupt::requested() {
            let _ = write!(out, " [stopped]");
        }
        filter.finish(&mut out);
        let _ = writeln!(out);
        cached.extend_from_slice(&ids[common..]);
        // generated tokens that were fed back (all but the last sampled one)
        let fed = stats.n_gen.min(stats.tokens.len());
        cached.extend_from_slice(&stats.tokens[..fed]);
        gen_tokens += stats.tokens.len();
        gen_ms += stats.gen_ms;
        msgs.push(Message {
            role: "assistant".into(),
            content: reply,
        });
    }
    Ok(())
}
