//! The worker slots of `kvrun serve`: `--parallel` std threads, each owning
//! a `Session` (KV cache, thread pool), taking [`Job`]s from the bounded
//! queue and streaming [`Ev`]s back. Generation runs only here, never on the
//! async runtime. A slot keeps its session between requests with the same
//! KV settings (reset, not reallocated).
//!
//! Prompt-prefix reuse (`cache_prompt`, on by default as in llama-server):
//! a slot remembers the tokens its cache holds (the last prompt and the
//! generated tokens fed back). A request with the same KV settings keeps
//! the longest common prefix (at least one token is always fed, for the
//! logits), truncates the rest and prefills only the new tokens. Reuse
//! needs the cached prefix to be intact: once the previous request evicted
//! anything, some prefix entries may be gone, so the slot starts afresh
//! (`/slots` says why). What a scorer accumulated for the kept entries
//! stays, as in `kvrun chat`; `cache_prompt: false` gives a fresh run.

use super::api::{ApiError, Done, Ev, Input, Job, Logprob, TokenPiece};
use super::{App, ReasoningFormat};
use crate::chat::{ChatTemplate, StopMatch, ThinkEvent, ThinkSplit};
use crate::cmd::prompt::encode_chat;
use crate::error::Error;
use crate::generate::{
    check_kept_prompt, generate_steps, GenOptions, GenStep, Session, StopReason,
};
use crate::load::Loaded;
use crate::policy::PolicyConfig;
use crate::sample::Sampler;
use crate::tokenizer::Tokenizer;
use axum::http::StatusCode;
use std::sync::atomic::Ordering;
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex};

/// The model, shared read-only by every worker.
#[derive(Debug)]
pub(super) struct Engine {
    /// Weights, tokenizer and model path (one copy, shared with `run_serve`).
    pub(super) model: Arc<Loaded>,
    pub(super) tmpl: Option<ChatTemplate>,
    pub(super) n_ctx: usize,
    pub(super) n_batch: usize,
    pub(super) n_threads: usize,
    pub(super) reasoning: ReasoningFormat,
    /// Parse control-token text inside chat messages (`--parse-special`).
    pub(super) parse_special: bool,
}

/// What identifies a reusable session: the whole policy configuration.
type KvKey = PolicyConfig;

/// A slot's session and what its cache holds.
pub(super) struct Cached<'e> {
    key: KvKey,
    sess: Session<'e>,
    /// The tokens at positions 0.. of the cache (empty: nothing reusable).
    tokens: Vec<u32>,
    /// Nothing was evicted since `tokens` started: every prefix entry is there.
    intact: bool,
}

/// One slot's thread: take jobs until the queue closes.
pub(super) fn worker(idx: usize, eng: Arc<Engine>, app: Arc<App>, rx: Arc<Mutex<Receiver<Job>>>) {
    let eng: &Engine = &eng;
    // the slot's session borrows the shared weights for as long as it runs
    let mut cache: Option<Cached<'_>> = None;
    loop {
        let job = {
            let Ok(r) = rx.lock() else { return };
            match r.recv() {
                Ok(j) => j,
                Err(_) => return,
            }
        };
        app.queued.fetch_sub(1, Ordering::SeqCst);
        if app.stopping.load(Ordering::SeqCst) {
            // the shutdown grace period is over: queued work is turned away
            let _ = job.tx.send(Ev::Error(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "shutting_down",
                "the server is shutting down",
            )));
            continue;
        }
        if job.tx.is_closed() {
            // the client left while the request was queued
            if let Ok(mut m) = app.metrics.lock() {
                m.cancelled += 1;
            }
            continue;
        }
        app.processing.fetch_add(1, Ordering::SeqCst);
        let slot = &app.slots[idx];
        slot.busy.store(true, Ordering::SeqCst);
        slot.requests.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut p) = slot.policy.lock() {
            *p = (Some(job.kv.policy.clone()), job.kv.budget);
        }
        let tx = job.tx.clone();
        let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            run_job(idx, eng, &app, &job, &mut cache)
        }));
        match run {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                let _ = tx.send(Ev::Error(e));
            }
            Err(_) => {
                cache = None;
                let _ = tx.send(Ev::Error(ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "internal_error",
                    "internal error while generating (see the server log)",
                )));
            }
        }
        slot.busy.store(false, Ordering::SeqCst);
        app.processing.fetch_sub(1, Ordering::SeqCst);
    }
}

fn run_job<'e>(
    idx: usize,
    eng: &'e Engine,
    app: &App,
    job: &Job,
    cache: &mut Option<Cached<'e>>,
) -> std::result::Result<(), ApiError> {
    let tok = &eng.model.tokenizer;
    let w = eng.model.weights();
    let mut think = ThinkSplit::disabled();
    let ids = match &job.input {
        Input::Chat(msgs) => {
            let tmpl = eng.tmpl.as_ref().ok_or_else(|| {
                ApiError::bad("the model has no chat template; use /v1/completions")
            })?;
            // the request may switch thinking for its own rendering
            let own;
            let tmpl = match job.enable_thinking {
                Some(on) if tmpl.enable_thinking != Some(on) => {
                    own = tmpl.with_thinking(Some(on));
                    &own
                }
                _ => tmpl,
            };
            // message contents are plain text unless --parse-special
            let (text, ids) = encode_chat(tok, tmpl, msgs, eng.parse_special)?;
            if eng.reasoning == ReasoningFormat::Deepseek {
                // a template that opens the think block itself starts in reasoning
                think = ThinkSplit::new(text.trim_end().ends_with("<think>")).trim_after_tags();
            }
            ids
        }
        Input::Text(p) => tok.encode(p, true, true)?,
        Input::Tokens(t) => t.clone(),
    };
    if ids.is_empty() {
        return Err(ApiError::bad("the prompt is empty (no tokens)"));
    }
    if ids.len() > eng.n_ctx {
        return Err(Error::ContextTooSmall {
            n_prompt: ids.len(),
            n_ctx: eng.n_ctx,
        }
        .into());
    }
    // a slot keeps its session while the policy stays the same
    let key: KvKey = job.kv.clone();
    let reusable = job.kv.def().is_ok_and(|d| d.caps.reusable_session);
    let reuse = reusable && cache.as_ref().is_some_and(|c| c.key == key);
    let slot = &app.slots[idx];
    let rebuilt = !reuse && cache.is_some();
    if !reuse {
        *cache = None;
        let mut sess = match job.kv.build(job.sampler.seed, &eng.model.path)? {
            None => Session::new(w, eng.n_ctx, eng.n_threads, eng.n_batch),
            Some(p) => Session::with_policy(w, eng.n_ctx, eng.n_threads, eng.n_batch, p)?,
        };
        sess.configure(&job.kv)?;
        *cache = Some(Cached {
            key,
            sess,
            tokens: Vec::new(),
            intact: true,
        });
    }
    let Some(c) = cache.as_mut() else {
        return Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal_error",
            "no session",
        ));
    };
    // keep the common prefix while it is intact, else start afresh
    let common = c
        .tokens
        .iter()
        .zip(&ids)
        .take_while(|(a, b)| a == b)
        .count()
        .min(ids.len() - 1);
    let miss = if !job.cache_prompt {
        Some("cache_prompt is false")
    } else if rebuilt {
        Some("the slot's session was rebuilt (other KV settings, or a policy that depends on the request)")
    } else if c.tokens.is_empty() {
        Some("nothing cached")
    } else if !c.intact {
        Some("the previous request evicted entries, so the cached prefix is not intact")
    } else if common == 0 {
        Some("no common prefix")
    } else {
        None
    };
    let sess = &mut c.sess;
    let reused = if miss.is_none() {
        let common = sess.rewind_point(common);
        sess.truncate(common)?;
        common
    } else {
        sess.reset();
        0
    };
    // this request's peak: the kept prefix and what it adds
    sess.kv.restart_peak();
    // pessimistic until the request finishes: a failed one leaves nothing reusable
    c.tokens.clear();
    c.intact = false;
    if let Ok(mut pc) = slot.prompt_cache.lock() {
        pc.reused = reused;
        pc.miss = miss.map(str::to_owned);
        pc.cached = 0;
        pc.intact = false;
    }
    if let Some(p) = &sess.policy {
        // a kept prompt (keep_prompt, or epikv's and raas's default) must
        // fit its budget: the message names the request fields that help
        check_kept_prompt(&job.kv, p, ids.len())?;
    }
    let (n_slots, n_streams) = (sess.kv.cells.n_slots(), sess.kv.n_streams());
    slot.capacity_entries.store(n_slots, Ordering::Relaxed);
    slot.capacity_tokens
        .store(n_slots.div_ceil(n_streams), Ordering::Relaxed);
    if job.tx.send(Ev::Started).is_err() {
        // the client left while its prompt was being prepared: a cancellation
        if let Ok(mut m) = app.metrics.lock() {
            m.cancelled += 1;
        }
        return Ok(());
    }
    let mut sampler = Sampler::new(job.sampler.clone());
    // the repeat-penalty history holds the whole prompt, reused part too
    for &t in &ids[..reused] {
        sampler.accept(t);
    }
    let opts = GenOptions {
        n_predict: job.max_tokens,
        ignore_eos: job.ignore_eos,
    };
    let mut stop = StopMatch::new(job.stop.clone());
    let mut hit_stop = false;
    let mut gone = false;
    let mut out: Vec<ThinkEvent> = Vec::new();
    let tx = &job.tx;
    // log-probabilities of the tokens whose text no delta carried yet (a
    // stop string or a split character holds text back): the next delta
    // takes them
    let mut pending: Vec<Logprob> = Vec::new();
    let mut n_chars = 0;
    let send_all = |out: &mut Vec<ThinkEvent>, pending: &mut Vec<Logprob>| -> bool {
        for ev in out.drain(..) {
            if let ThinkEvent::Text { reasoning, text } = ev {
                let logprobs = std::mem::take(pending);
                if tx
                    .send(Ev::Delta {
                        reasoning,
                        text,
                        logprobs,
                    })
                    .is_err()
                {
                    return false;
                }
            }
        }
        true
    };
    let mut shut = false;
    let want_logits = job.logprobs.is_some();
    let prompt = &ids[reused..];
    let stats = generate_steps(
        sess,
        tok,
        &mut sampler,
        prompt,
        &opts,
        want_logits,
        |step| {
            if let Some(k) = job.logprobs {
                pending.push(step_logprobs(tok, step, k, &mut n_chars));
            }
            if step.text.is_empty() {
                return true;
            }
            let (text, hit) = stop.push(step.text);
            think.push(&text, &mut out);
            if hit {
                hit_stop = true;
                think.finish(&mut out);
            }
            if !send_all(&mut out, &mut pending) {
                gone = true;
                return false;
            }
            // the server's shutdown grace period is over: end this response
            shut = !hit && app.stopping.load(Ordering::SeqCst);
            !hit && !shut
        },
    )?;
    if !hit_stop && !gone {
        let rest = stop.finish();
        think.push(&rest, &mut out);
        think.finish(&mut out);
        gone = !send_all(&mut out, &mut pending);
        // tokens whose text never came (a character cut off at the end)
        // still get their entries; after a stop string, the tokens past
        // the returned text are left out
        if !gone && !pending.is_empty() {
            let logprobs = std::mem::take(&mut pending);
            gone = tx
                .send(Ev::Delta {
                    reasoning: false,
                    text: String::new(),
                    logprobs,
                })
                .is_err();
        }
    }
    slot.live_tokens
        .store(sess.kv.resident_tokens(), Ordering::Relaxed);
    slot.live_entries
        .store(sess.kv.cells.n_live(), Ordering::Relaxed);
    slot.peak_tokens
        .fetch_max(sess.kv.peak_live, Ordering::Relaxed);
    slot.peak_entries
        .fetch_max(sess.kv.peak_entries, Ordering::Relaxed);
    slot.evicted_last.store(sess.n_evicted, Ordering::Relaxed);
    let finish = match stats.stop {
        StopReason::Eog => "stop",
        StopReason::Cancelled if hit_stop => "stop",
        // cut short by the shutdown: truncated output, as with max_tokens
        StopReason::Cancelled if shut => "length",
        StopReason::Cancelled => "cancelled",
        StopReason::Length | StopReason::ContextFull => "length",
    };
    // the cache now holds the prompt and the generated tokens fed back
    let fed = stats.n_gen.min(stats.tokens.len());
    c.tokens = ids.clone();
    c.tokens.extend_from_slice(&stats.tokens[..fed]);
    c.intact = sess.evicted_entries() == 0;
    if let Ok(mut pc) = slot.prompt_cache.lock() {
        pc.cached = c.tokens.len();
        pc.intact = c.intact;
    }
    if let Ok(mut r) = slot.residency.lock() {
        // per position, the share of its (layer, KV-head) entries resident
        let share = 1.0 / sess.kv.n_streams() as f32;
        r.kept.clear();
        r.kept.resize(c.tokens.len(), 0.0);
        for (_, pos) in sess.kv.cells.live() {
            if let Some(k) = r.kept.get_mut(pos as usize) {
                *k += share;
            }
        }
        r.tokens.clone_from(&c.tokens);
    }
    let done = Done {
        finish,
        prompt_tokens: ids.len(),
        cached_tokens: reused,
        completion_tokens: stats.tokens.len(),
        prompt_ms: stats.prompt_ms,
        gen_ms: stats.gen_ms,
        evicted: sess.n_evicted,
        peak_kv: sess.kv.peak_live,
        slot: idx,
        live_kv: sess.kv.resident_tokens(),
        capacity_kv: slot.capacity_tokens.load(Ordering::Relaxed),
        policy: job.kv.policy.clone(),
        budget: job.kv.budget,
    };
    if let Ok(mut m) = app.metrics.lock() {
        m.prompt_tokens += done.prompt_tokens as u64;
        m.gen_tokens += done.completion_tokens as u64;
        m.prompt_s += done.prompt_ms / 1e3;
        m.gen_s += done.gen_ms / 1e3;
        m.evictions += done.evicted as u64;
        if gone || finish == "cancelled" {
            m.cancelled += 1;
        }
    }
    if app.defaults.verbose {
        eprintln!(
            "kvrun serve: slot {idx}: {} prompt + {} generated tokens, {:.1} ms, finish {finish}, evicted {}",
            done.prompt_tokens,
            done.completion_tokens,
            stats.total_ms,
            done.evicted
        );
    }
    // the slot is free before the client hears the request is done
    slot.busy.store(false, Ordering::SeqCst);
    let _ = job.tx.send(Ev::Done(done));
    Ok(())
}

/// A step's log-probabilities (`k` alternatives) with the tokens' text and
/// bytes; `n_chars` counts the characters generated so far (the token's
/// `text_offset`), by the UTF-8 lead bytes, so a character split between
/// tokens counts once.
fn step_logprobs(tok: &Tokenizer, step: &GenStep<'_>, k: usize, n_chars: &mut usize) -> Logprob {
    let r = crate::sample::logprobs(step.logits, step.token, k);
    let piece = |t: u32| {
        let bytes = tok.token_bytes(t, false);
        TokenPiece {
            text: String::from_utf8_lossy(&bytes).into_owned(),
            bytes,
        }
    };
    let token = piece(step.token);
    let offset = *n_chars;
    *n_chars += token.bytes.iter().filter(|&&b| b & 0xC0 != 0x80).count();
    Logprob {
        token,
        logprob: r.logprob,
        top: r.top.into_iter().map(|(t, l)| (piece(t), l)).collect(),
        offset,
    }
}
