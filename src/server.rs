//! `kvrun serve`: an OpenAI-compatible HTTP server (axum + tokio).
//!
//! ```text
//! POST /v1/chat/completions   chat (SSE streaming or not); <think>…</think> → reasoning_content
//! POST /v1/completions        raw prompt (SSE streaming or not)
//! GET  /v1/models             the loaded model
//! GET  /health                {"status":"ok", …} (open even with --api-key)
//! GET  /metrics               Prometheus text format
//! ```
//!
//! - The weights are memory-mapped once and shared; `--parallel N` worker
//!   threads each own a `Session` (KV cache, thread pool) and take jobs from
//!   a bounded queue (`--queue N`); a full queue answers 503. Generation runs
//!   only on these std threads, never on the async runtime.
//! - Per request, the extra fields `policy`, `kv_budget`, `kv_sink`,
//!   `kv_recent`, `keep_prompt` and `evict_every` override the server's KV
//!   flags. A slot keeps its session between requests with the same policy
//!   (reset, not reallocated).
//! - Tokens travel from the worker to the handler over a channel; when the
//!   client goes away the handler (or the SSE body) is dropped, the channel's
//!   send fails and the worker stops at the next token.
//! - Every error is an OpenAI-shaped body `{"error":{"message","type","param","code"}}`.

use crate::chat::{ChatTemplate, Message};
use crate::cli::{encode_rendered, resolve_model, resolve_threads, KvArgs, ModelArgs};
use crate::error::{Error, Result};
use crate::generate::{generate, GenOptions, Session, StopReason};
use crate::load::Checkpoint;
use crate::model::Weights;
use crate::policy::PolicyConfig;
use crate::sample::{Sampler, SamplerConfig};
use crate::tokenizer::Tokenizer;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use clap::{Args, ValueEnum};
use futures_util::stream::{self, StreamExt};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc::{unbounded_channel, UnboundedSender};
use tokio_stream::wrappers::UnboundedReceiverStream;

/// How `<think>…</think>` is returned.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReasoningFormat {
    /// Text inside <think>…</think> goes to `reasoning_content`.
    Deepseek,
    /// Everything goes to `content`.
    None,
}

/// Flags of `kvrun serve`.
#[derive(Args, Debug, Clone)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Default KV policy of every request (requests may override it).
    #[command(flatten)]
    pub kv: KvArgs,
    /// Address to listen on.
    #[arg(long = "host", default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0 = any free port; the chosen one is printed).
    #[arg(long = "port", default_value_t = 8080)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` (all endpoints but /health).
    #[arg(long = "api-key", env = "KVRUN_API_KEY")]
    pub api_key: Option<String>,
    /// Requests decoded at the same time (one session and KV cache each).
    #[arg(long = "parallel", default_value_t = 1)]
    pub parallel: usize,
    /// Requests that may wait for a free slot; beyond that the server answers 503.
    #[arg(long = "queue", default_value_t = 16)]
    pub queue: usize,
    /// Context size per slot in tokens (0 = the model's training context).
    #[arg(short = 'c', long = "ctx-size", default_value_t = 4096)]
    pub ctx_size: usize,
    /// Prompt processing chunk size.
    #[arg(short = 'b', long = "batch-size", default_value_t = 512)]
    pub batch_size: usize,
    /// Default max_tokens (-1 = until end of generation or context full).
    #[arg(short = 'n', long = "n-predict", default_value_t = -1, allow_negative_numbers = true)]
    pub n_predict: i64,
    /// Default seed (-1 = random per request).
    #[arg(short = 's', long = "seed", default_value_t = -1, allow_negative_numbers = true)]
    pub seed: i64,
    #[command(flatten)]
    pub sampling: crate::cli::SamplingArgs,
    /// Model id reported by /v1/models and in responses (default: the file name).
    #[arg(short = 'a', long = "alias")]
    pub alias: Option<String>,
    /// How reasoning (<think>…</think>) is returned in chat responses.
    #[arg(long = "reasoning-format", value_enum, default_value_t = ReasoningFormat::Deepseek)]
    pub reasoning_format: ReasoningFormat,
    /// Log one line per request on stderr.
    #[arg(short = 'v', long = "verbose")]
    pub verbose: bool,
}

// ---------------------------------------------------------------------------
// Errors

/// An error answered as an OpenAI-shaped JSON body.
#[derive(Debug, Clone)]
pub struct ApiError {
    status: StatusCode,
    message: String,
    code: &'static str,
}

impl ApiError {
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            code,
        }
    }
    fn bad(message: impl Into<String>) -> ApiError {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request", message)
    }
    fn kind(&self) -> &'static str {
        match self.status.as_u16() {
            401 => "authentication_error",
            404 => "not_found_error",
            503 => "unavailable_error",
            s if s >= 500 => "server_error",
            _ => "invalid_request_error",
        }
    }
    fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind(), "param": null, "code": self.code}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body())).into_response()
    }
}

impl From<Error> for ApiError {
    fn from(e: Error) -> ApiError {
        match e {
            // settings a request can override are named by their request
            // fields, the others by the server's flags
            Error::Config(c) => ApiError::bad(c.render(|f| f.json().unwrap_or(f.flag()))),
            Error::BadArg { .. } => ApiError::bad(e.to_string()),
            Error::ContextTooSmall { n_prompt, n_ctx } => ApiError::new(
                StatusCode::BAD_REQUEST,
                "context_length_exceeded",
                format!("the prompt has {n_prompt} tokens but the context holds {n_ctx}"),
            ),
            Error::Template(m) => ApiError::bad(format!("chat template: {m}")),
            other => ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal_error",
                other.to_string(),
            ),
        }
    }
}

// ---------------------------------------------------------------------------
// Metrics

#[derive(Debug, Default)]
struct Metrics {
    requests: BTreeMap<(&'static str, u16), u64>,
    prompt_tokens: u64,
    gen_tokens: u64,
    prompt_s: f64,
    gen_s: f64,
    evictions: u64,
    cancelled: u64,
}

/// What a slot's KV cache holds now (updated by its worker).
#[derive(Debug, Default)]
struct SlotKv {
    live: AtomicUsize,
    capacity: AtomicUsize,
    peak: AtomicUsize,
}

// ---------------------------------------------------------------------------
// Jobs: handler → worker → handler

#[derive(Debug)]
enum Input {
    Chat(Vec<Message>),
    Text(String),
    Tokens(Vec<u32>),
}

#[derive(Debug)]
struct Job {
    input: Input,
    max_tokens: i64,
    sampler: SamplerConfig,
    stop: Vec<String>,
    ignore_eos: bool,
    kv: PolicyConfig,
    tx: UnboundedSender<Ev>,
}

/// Per-request results of generation.
#[derive(Debug, Clone)]
struct Done {
    finish: &'static str,
    prompt_tokens: usize,
    completion_tokens: usize,
    prompt_ms: f64,
    gen_ms: f64,
    evicted: usize,
    peak_kv: usize,
}

#[derive(Debug)]
enum Ev {
    Started,
    /// `reasoning` = the text belongs to `reasoning_content`.
    Delta {
        reasoning: bool,
        text: String,
    },
    Done(Done),
    Error(ApiError),
}

/// Everything the handlers share.
#[derive(Debug)]
struct App {
    model_id: String,
    /// The model file (policies may read a per-model config next to it).
    model_path: std::path::PathBuf,
    created: u64,
    n_ctx: usize,
    n_vocab: usize,
    defaults: ServeArgs,
    api_key: Option<String>,
    jobs: SyncSender<Job>,
    queued: AtomicUsize,
    processing: AtomicUsize,
    metrics: Mutex<Metrics>,
    slots: Vec<SlotKv>,
    next_id: AtomicU64,
}

impl App {
    fn new_id(&self, prefix: &str) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        let t = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        format!("{prefix}-{:012x}{n:06x}", t & 0xffff_ffff_ffff)
    }
}

fn now_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

// ---------------------------------------------------------------------------
// Streaming text filters (shared by streaming and non-streaming responses)

/// Cuts the text at the first stop string, holding back a possible prefix of one.
#[derive(Debug, Default)]
struct StopMatch {
    stops: Vec<String>,
    pending: String,
}

impl StopMatch {
    /// Returns the text that is safe to emit and whether a stop string was hit.
    fn push(&mut self, piece: &str) -> (String, bool) {
        if self.stops.is_empty() {
            return (piece.to_owned(), false);
        }
        self.pending.push_str(piece);
        if let Some(at) = self.stops.iter().filter_map(|s| self.pending.find(s)).min() {
            let out = self.pending[..at].to_owned();
            self.pending.clear();
            return (out, true);
        }
        let keep = self
            .stops
            .iter()
            .flat_map(|s| s.char_indices().skip(1).map(move |(i, _)| &s[..i]))
            .filter(|p| self.pending.ends_with(p))
            .map(str::len)
            .max()
            .unwrap_or(0);
        let cut = self.pending.len() - keep;
        let out = self.pending[..cut].to_owned();
        self.pending.drain(..cut);
        (out, false)
    }
    fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

/// Splits generated text into reasoning (inside `<think>…</think>`) and content.
#[derive(Debug, Default)]
struct ThinkSplit {
    enabled: bool,
    in_think: bool,
    /// Drop whitespace right after a tag.
    strip: bool,
    pending: String,
}

impl ThinkSplit {
    fn push(&mut self, piece: &str, out: &mut Vec<(bool, String)>) {
        if !self.enabled {
            if !piece.is_empty() {
                out.push((false, piece.to_owned()));
            }
            return;
        }
        self.pending.push_str(piece);
        loop {
            let tag = if self.in_think { "</think>" } else { "<think>" };
            if let Some(at) = self.pending.find(tag) {
                let before = self.pending[..at].to_owned();
                self.emit(&before, out);
                self.pending.drain(..at + tag.len());
                self.in_think = !self.in_think;
                self.strip = true;
                continue;
            }
            let keep = crate::chat::partial_tag_suffix(&self.pending, tag);
            let cut = self.pending.len() - keep;
            let text = self.pending[..cut].to_owned();
            self.emit(&text, out);
            self.pending.drain(..cut);
            break;
        }
    }
    fn emit(&mut self, s: &str, out: &mut Vec<(bool, String)>) {
        let s = if self.strip { s.trim_start() } else { s };
        if s.is_empty() {
            return;
        }
        self.strip = false;
        out.push((self.in_think, s.to_owned()));
    }
    fn finish(&mut self, out: &mut Vec<(bool, String)>) {
        let rest = std::mem::take(&mut self.pending);
        self.emit(&rest, out);
    }
}

// ---------------------------------------------------------------------------
// Workers

/// The model, shared read-only by every worker.
#[derive(Debug)]
struct Engine {
    w: &'static Weights<'static>,
    tok: &'static Tokenizer,
    tmpl: Option<&'static ChatTemplate>,
    n_ctx: usize,
    n_batch: usize,
    n_threads: usize,
    reasoning: ReasoningFormat,
    model_path: std::path::PathBuf,
}

/// What identifies a reusable session: the whole policy configuration.
type KvKey = PolicyConfig;

fn worker(idx: usize, eng: Arc<Engine>, app: Arc<App>, rx: Arc<Mutex<Receiver<Job>>>) {
    let mut cache: Option<(KvKey, Session<'static>)> = None;
    loop {
        let job = {
            let Ok(r) = rx.lock() else { return };
            match r.recv() {
                Ok(j) => j,
                Err(_) => return,
            }
        };
        app.queued.fetch_sub(1, Ordering::SeqCst);
        if job.tx.is_closed() {
            // the client left while the request was queued
            if let Ok(mut m) = app.metrics.lock() {
                m.cancelled += 1;
            }
            continue;
        }
        app.processing.fetch_add(1, Ordering::SeqCst);
        let tx = job.tx.clone();
        let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            run_job(idx, &eng, &app, &job, &mut cache)
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
        app.processing.fetch_sub(1, Ordering::SeqCst);
    }
}

fn run_job(
    idx: usize,
    eng: &Engine,
    app: &App,
    job: &Job,
    cache: &mut Option<(KvKey, Session<'static>)>,
) -> std::result::Result<(), ApiError> {
    let mut think = ThinkSplit::default();
    let ids = match &job.input {
        Input::Chat(msgs) => {
            let tmpl = eng.tmpl.ok_or_else(|| {
                ApiError::bad("the model has no chat template; use /v1/completions")
            })?;
            let text = tmpl.render(msgs, true)?;
            think.enabled = eng.reasoning == ReasoningFormat::Deepseek;
            // a template that opens the think block itself starts in reasoning
            think.in_think = think.enabled && text.trim_end().ends_with("<think>");
            encode_rendered(eng.tok, &text)?
        }
        Input::Text(p) => eng.tok.encode(p, true, true)?,
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
    let reuse = reusable && cache.as_ref().is_some_and(|(k, _)| *k == key);
    if !reuse {
        *cache = None;
        let mut sess = match job.kv.build(job.sampler.seed, &eng.model_path)? {
            None => Session::new(eng.w, eng.n_ctx, eng.n_threads, eng.n_batch),
            Some(p) => Session::with_policy(eng.w, eng.n_ctx, eng.n_threads, eng.n_batch, p)?,
        };
        sess.configure(&job.kv)?;
        *cache = Some((key, sess));
    }
    let Some((_, sess)) = cache.as_mut() else {
        return Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal_error",
            "no session",
        ));
    };
    sess.reset();
    if let Some(p) = &sess.policy {
        if job.kv.keep_prompt && ids.len() + p.evictor.n_recent >= p.evictor.budget {
            return Err(ApiError::bad(format!(
                "kv_budget: budget {} cannot hold the {}-token prompt (keep_prompt) plus the recent window {}",
                p.evictor.budget,
                ids.len(),
                p.evictor.n_recent
            )));
        }
    }
    let slot = &app.slots[idx];
    slot.capacity
        .store(sess.kv.cells.n_slots(), Ordering::Relaxed);
    if job.tx.send(Ev::Started).is_err() {
        return Ok(());
    }
    let mut sampler = Sampler::new(job.sampler.clone());
    let opts = GenOptions {
        n_predict: job.max_tokens,
        ignore_eos: job.ignore_eos,
    };
    let mut stop = StopMatch {
        stops: job.stop.clone(),
        pending: String::new(),
    };
    let mut hit_stop = false;
    let mut gone = false;
    let mut out: Vec<(bool, String)> = Vec::new();
    let tx = &job.tx;
    let send_all = |out: &mut Vec<(bool, String)>| -> bool {
        for (reasoning, text) in out.drain(..) {
            if tx.send(Ev::Delta { reasoning, text }).is_err() {
                return false;
            }
        }
        true
    };
    let stats = generate(sess, eng.tok, &mut sampler, &ids, &opts, |piece| {
        let (text, hit) = stop.push(piece);
        think.push(&text, &mut out);
        if hit {
            hit_stop = true;
            think.finish(&mut out);
        }
        if !send_all(&mut out) {
            gone = true;
            return false;
        }
        !hit
    })?;
    if !hit_stop && !gone {
        let rest = stop.finish();
        think.push(&rest, &mut out);
        think.finish(&mut out);
        gone = !send_all(&mut out);
    }
    let live = sess.kv.cells.n_live();
    slot.live.store(live, Ordering::Relaxed);
    slot.peak.fetch_max(sess.kv.peak_live, Ordering::Relaxed);
    let finish = match stats.stop {
        StopReason::Eog => "stop",
        StopReason::Cancelled if hit_stop => "stop",
        StopReason::Cancelled => "cancelled",
        StopReason::Length | StopReason::ContextFull => "length",
    };
    let done = Done {
        finish,
        prompt_tokens: ids.len(),
        completion_tokens: stats.tokens.len(),
        prompt_ms: stats.prompt_ms,
        gen_ms: stats.gen_ms,
        evicted: sess.n_evicted,
        peak_kv: sess.kv.peak_live,
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
    let _ = job.tx.send(Ev::Done(done));
    Ok(())
}

// ---------------------------------------------------------------------------
// Request parsing

fn parse_body(
    body: std::result::Result<Bytes, BytesRejection>,
) -> std::result::Result<Value, ApiError> {
    let bytes = body.map_err(|r| ApiError::new(r.status(), "invalid_body", r.body_text()))?;
    let v: Value = serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::bad(format!("the body is not valid JSON: {e}")))?;
    if !v.is_object() {
        return Err(ApiError::bad("the body must be a JSON object"));
    }
    Ok(v)
}

fn type_err(field: &str, want: &str, got: &Value) -> ApiError {
    let got = match got {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    };
    ApiError::bad(format!("'{field}' must be {want}, got {got}"))
}

/// Optional field: absent and null are None.
fn opt<'v>(v: &'v Value, field: &str) -> Option<&'v Value> {
    v.get(field).filter(|x| !x.is_null())
}

fn opt_f32(v: &Value, field: &str) -> std::result::Result<Option<f32>, ApiError> {
    match opt(v, field) {
        None => Ok(None),
        Some(x) => match x.as_f64() {
            Some(f) if f.is_finite() => Ok(Some(f as f32)),
            _ => Err(type_err(field, "a number", x)),
        },
    }
}

fn opt_i64(v: &Value, field: &str) -> std::result::Result<Option<i64>, ApiError> {
    match opt(v, field) {
        None => Ok(None),
        Some(x) => x
            .as_i64()
            .map(Some)
            .ok_or_else(|| type_err(field, "an integer", x)),
    }
}

fn opt_usize(v: &Value, field: &str, max: usize) -> std::result::Result<Option<usize>, ApiError> {
    match opt_i64(v, field)? {
        None => Ok(None),
        Some(n) if n >= 0 && (n as u64) <= max as u64 => Ok(Some(n as usize)),
        Some(n) => Err(ApiError::bad(format!(
            "'{field}' must be between 0 and {max}, got {n}"
        ))),
    }
}

fn opt_bool(v: &Value, field: &str) -> std::result::Result<Option<bool>, ApiError> {
    match opt(v, field) {
        None => Ok(None),
        Some(x) => x
            .as_bool()
            .map(Some)
            .ok_or_else(|| type_err(field, "a boolean", x)),
    }
}

fn opt_str<'v>(v: &'v Value, field: &str) -> std::result::Result<Option<&'v str>, ApiError> {
    match opt(v, field) {
        None => Ok(None),
        Some(x) => x
            .as_str()
            .map(Some)
            .ok_or_else(|| type_err(field, "a string", x)),
    }
}

/// Message content: a string, or an array of `{type:"text", text}` parts.
fn content_text(i: usize, c: Option<&Value>) -> std::result::Result<String, ApiError> {
    match c {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut s = String::new();
            for p in parts {
                match (p.get("type").and_then(Value::as_str), p.get("text")) {
                    (Some("text"), Some(Value::String(t))) => s.push_str(t),
                    _ => {
                        return Err(ApiError::bad(format!(
                            "messages[{i}].content: only text parts ({{\"type\":\"text\",\"text\":…}}) are supported"
                        )))
                    }
                }
            }
            Ok(s)
        }
        Some(other) => Err(type_err(
            &format!("messages[{i}].content"),
            "a string or an array of text parts",
            other,
        )),
    }
}

fn parse_messages(v: &Value) -> std::result::Result<Vec<Message>, ApiError> {
    let msgs = match v.get("messages") {
        None | Some(Value::Null) => return Err(ApiError::bad("missing field 'messages'")),
        Some(Value::Array(a)) => a,
        Some(other) => return Err(type_err("messages", "an array of messages", other)),
    };
    if msgs.is_empty() {
        return Err(ApiError::bad("'messages' must not be empty"));
    }
    msgs.iter()
        .enumerate()
        .map(|(i, m)| {
            if !m.is_object() {
                return Err(type_err(&format!("messages[{i}]"), "an object", m));
            }
            let role = match m.get("role") {
                Some(Value::String(r)) => r.clone(),
                None | Some(Value::Null) => {
                    return Err(ApiError::bad(format!(
                        "messages[{i}]: missing field 'role'"
                    )))
                }
                Some(other) => {
                    return Err(type_err(&format!("messages[{i}].role"), "a string", other))
                }
            };
            Ok(Message {
                role,
                content: content_text(i, m.get("content"))?,
            })
        })
        .collect()
}

fn parse_prompt(v: &Value, n_vocab: usize) -> std::result::Result<Input, ApiError> {
    let want = "a string, an array of one string, or an array of token ids";
    match v.get("prompt") {
        None | Some(Value::Null) => Err(ApiError::bad("missing field 'prompt'")),
        Some(Value::String(s)) => Ok(Input::Text(s.clone())),
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
            Ok(Input::Text(a[0].as_str().unwrap_or_default().to_owned()))
        }
        Some(Value::Array(a)) if !a.is_empty() && a.iter().all(Value::is_u64) => {
            let ids: Vec<u32> = a
                .iter()
                .filter_map(Value::as_u64)
                .filter(|&t| t < n_vocab as u64)
                .map(|t| t as u32)
                .collect();
            if ids.len() != a.len() {
                return Err(ApiError::bad(format!(
                    "'prompt': token ids must be below the vocabulary size {n_vocab}"
                )));
            }
            Ok(Input::Tokens(ids))
        }
        Some(other) => Err(type_err("prompt", want, other)),
    }
}

/// Everything but the input: sampling, limits, stop strings, KV policy, streaming.
fn parse_job(
    app: &App,
    v: &Value,
    input: Input,
    tx: UnboundedSender<Ev>,
) -> std::result::Result<(Job, bool, bool), ApiError> {
    let d = &app.defaults;
    if let Some(n) = opt_i64(v, "n")? {
        if n != 1 {
            return Err(ApiError::bad("'n': only n = 1 is supported"));
        }
    }
    let max_tokens = match (
        opt_i64(v, "max_completion_tokens")?,
        opt_i64(v, "max_tokens")?,
    ) {
        (Some(n), _) | (None, Some(n)) => {
            if n < 0 {
                return Err(ApiError::bad(format!("'max_tokens' must be ≥ 0, got {n}")));
            }
            n
        }
        (None, None) => d.n_predict,
    };
    let temp = opt_f32(v, "temperature")?.unwrap_or(d.sampling.temp.unwrap_or(0.8));
    let top_p = opt_f32(v, "top_p")?.unwrap_or(d.sampling.top_p);
    if !(0.0..=1.0).contains(&top_p) {
        return Err(ApiError::bad(format!(
            "'top_p' must be between 0 and 1, got {top_p}"
        )));
    }
    let min_p = opt_f32(v, "min_p")?.unwrap_or(d.sampling.min_p);
    if !(0.0..=1.0).contains(&min_p) {
        return Err(ApiError::bad(format!(
            "'min_p' must be between 0 and 1, got {min_p}"
        )));
    }
    let top_k = opt_usize(v, "top_k", usize::MAX >> 1)?.unwrap_or(d.sampling.top_k);
    let repeat_penalty = opt_f32(v, "repeat_penalty")?.unwrap_or(d.sampling.repeat_penalty);
    let seed = match opt_i64(v, "seed")?.unwrap_or(d.seed) {
        s if s < 0 => SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0),
        s => s as u64,
    };
    let stop = match opt(v, "stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|s| {
                s.as_str()
                    .map(str::to_owned)
                    .ok_or_else(|| type_err("stop", "a string or an array of strings", s))
            })
            .collect::<std::result::Result<_, _>>()?,
        Some(other) => return Err(type_err("stop", "a string or an array of strings", other)),
    };
    let stop: Vec<String> = stop.into_iter().filter(|s| !s.is_empty()).collect();
    let stream = opt_bool(v, "stream")?.unwrap_or(false);
    let include_usage = match opt(v, "stream_options") {
        None => false,
        Some(o @ Value::Object(_)) => opt_bool(o, "include_usage")?.unwrap_or(false),
        Some(other) => return Err(type_err("stream_options", "an object", other)),
    };
    let ignore_eos = opt_bool(v, "ignore_eos")?.unwrap_or(false);
    // KV policy: the server's flags, overridden per request
    let mut kv = d.kv.config()?;
    if let Some(p) = opt_str(v, "policy")? {
        kv.policy = p.to_owned();
    }
    let budget = opt_usize(v, "kv_budget", app.n_ctx)?;
    if budget.is_some() {
        kv.budget = budget;
    }
    if let Some(s) = opt_usize(v, "kv_sink", app.n_ctx)? {
        kv.sinks = s;
    }
    if let Some(r) = opt_usize(v, "kv_recent", app.n_ctx)? {
        kv.recent = Some(r);
    }
    if let Some(k) = opt_bool(v, "keep_prompt")? {
        kv.keep_prompt = k;
    }
    if let Some(e) = opt_usize(v, "evict_every", app.n_ctx)? {
        kv.evict_every = Some(e);
    }
    let budgeted = kv.def()?.budgeted();
    if !budgeted && budget.is_some() {
        return Err(ApiError::bad(
            "'kv_budget' needs an eviction policy: set 'policy' (e.g. \"window\", \"h2o\")",
        ));
    }
    if let Some(b) = kv.budget {
        if budgeted && b > app.n_ctx {
            return Err(ApiError::bad(format!(
                "'kv_budget' {b} is larger than the context ({} tokens)",
                app.n_ctx
            )));
        }
    }
    // unknown policy names and missing budgets fail here, before queueing
    kv.build(0, &app.model_path).map_err(ApiError::from)?;
    let job = Job {
        input,
        max_tokens,
        sampler: SamplerConfig {
            temp,
            top_k,
            top_p,
            min_p,
            repeat_penalty,
            repeat_last_n: d.sampling.repeat_last_n,
            seed,
        },
        stop,
        ignore_eos,
        kv,
        tx,
    };
    Ok((job, stream, include_usage))
}

// ---------------------------------------------------------------------------
// Handlers

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Endpoint {
    Chat,
    Completion,
}

async fn chat(
    State(app): State<Arc<App>>,
    body: std::result::Result<Bytes, BytesRejection>,
) -> Response {
    handle(app, body, Endpoint::Chat).await
}

async fn completions(
    State(app): State<Arc<App>>,
    body: std::result::Result<Bytes, BytesRejection>,
) -> Response {
    handle(app, body, Endpoint::Completion).await
}

async fn handle(
    app: Arc<App>,
    body: std::result::Result<Bytes, BytesRejection>,
    ep: Endpoint,
) -> Response {
    match handle_inner(app, body, ep).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn handle_inner(
    app: Arc<App>,
    body: std::result::Result<Bytes, BytesRejection>,
    ep: Endpoint,
) -> std::result::Result<Response, ApiError> {
    let v = parse_body(body)?;
    let input = match ep {
        Endpoint::Chat => Input::Chat(parse_messages(&v)?),
        Endpoint::Completion => parse_prompt(&v, app.n_vocab)?,
    };
    let (tx, mut rx) = unbounded_channel();
    let (job, stream, include_usage) = parse_job(&app, &v, input, tx)?;
    app.queued.fetch_add(1, Ordering::SeqCst);
    if let Err(e) = app.jobs.try_send(job) {
        app.queued.fetch_sub(1, Ordering::SeqCst);
        return Err(match e {
            TrySendError::Full(_) => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_busy",
                format!(
                    "the server is busy: {} requests running and {} queued (--parallel, --queue)",
                    app.defaults.parallel, app.defaults.queue
                ),
            ),
            TrySendError::Disconnected(_) => ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal_error",
                "no worker is running",
            ),
        });
    }
    // wait for the worker to accept (or reject) the request
    match rx.recv().await {
        Some(Ev::Started) => {}
        Some(Ev::Error(e)) => return Err(e),
        _ => {
            return Err(ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal_error",
                "the worker stopped",
            ))
        }
    }
    let ctx = Arc::new(RespCtx {
        id: app.new_id(if ep == Endpoint::Chat {
            "chatcmpl"
        } else {
            "cmpl"
        }),
        created: now_s(),
        model: app.model_id.clone(),
        ep,
        include_usage,
    });
    if stream {
        let head = if ep == Endpoint::Chat {
            vec![ctx.chunk(json!({"role": "assistant", "content": ""}), None)]
        } else {
            Vec::new()
        };
        let c2 = ctx.clone();
        let body = stream::iter(head)
            .chain(UnboundedReceiverStream::new(rx).flat_map(move |ev| stream::iter(c2.events(ev))))
            .map(|data| Ok::<Event, Infallible>(Event::default().data(data)));
        return Ok(Sse::new(body).into_response());
    }
    let (mut reasoning, mut content) = (String::new(), String::new());
    while let Some(ev) = rx.recv().await {
        match ev {
            Ev::Delta {
                reasoning: true,
                text,
            } => reasoning.push_str(&text),
            Ev::Delta { text, .. } => content.push_str(&text),
            Ev::Done(d) => return Ok(Json(ctx.full(&reasoning, &content, &d)).into_response()),
            Ev::Error(e) => return Err(e),
            Ev::Started => {}
        }
    }
    Err(ApiError::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "internal_error",
        "the worker stopped",
    ))
}

/// What every chunk / response of one request repeats.
#[derive(Debug)]
struct RespCtx {
    id: String,
    created: u64,
    model: String,
    ep: Endpoint,
    include_usage: bool,
}

fn usage(d: &Done) -> Value {
    json!({
        "prompt_tokens": d.prompt_tokens,
        "completion_tokens": d.completion_tokens,
        "total_tokens": d.prompt_tokens + d.completion_tokens,
    })
}

fn extras(d: &Done) -> (Value, Value) {
    let per_s = |n: usize, ms: f64| if ms > 0.0 { n as f64 * 1e3 / ms } else { 0.0 };
    (
        json!({
            "prompt_n": d.prompt_tokens,
            "prompt_ms": d.prompt_ms,
            "prompt_per_second": per_s(d.prompt_tokens, d.prompt_ms),
            "predicted_n": d.completion_tokens,
            "predicted_ms": d.gen_ms,
            "predicted_per_second": per_s(d.completion_tokens, d.gen_ms),
        }),
        json!({"evicted": d.evicted, "peak_tokens": d.peak_kv}),
    )
}

impl RespCtx {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.ep, chunk) {
            (Endpoint::Chat, true) => "chat.completion.chunk",
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Completion, _) => "text_completion",
        }
    }
    /// One streaming chunk (chat: `delta`; completions: `text`).
    fn chunk(&self, delta: Value, finish: Option<&str>) -> String {
        let choice = match self.ep {
            Endpoint::Chat => {
                json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish})
            }
            Endpoint::Completion => json!({
                "index": 0,
                "text": delta.get("content").and_then(Value::as_str).unwrap_or(""),
                "logprobs": null,
                "finish_reason": finish,
            }),
        };
        let mut c = json!({
            "id": self.id,
            "object": self.object(true),
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        });
        if self.include_usage {
            c["usage"] = Value::Null;
        }
        c.to_string()
    }
    /// SSE data lines for one worker event.
    fn events(&self, ev: Ev) -> Vec<String> {
        match ev {
            Ev::Started => Vec::new(),
            Ev::Delta { reasoning, text } => {
                let key = if reasoning {
                    "reasoning_content"
                } else {
                    "content"
                };
                vec![self.chunk(json!({ key: text }), None)]
            }
            Ev::Done(d) => {
                let mut out = vec![self.chunk(json!({}), Some(d.finish))];
                if self.include_usage {
                    let (timings, kv) = extras(&d);
                    out.push(
                        json!({
                            "id": self.id,
                            "object": self.object(true),
                            "created": self.created,
                            "model": self.model,
                            "choices": [],
                            "usage": usage(&d),
                            "timings": timings,
                            "kv": kv,
                        })
                        .to_string(),
                    );
                }
                out.push("[DONE]".into());
                out
            }
            Ev::Error(e) => vec![e.body().to_string()],
        }
    }
    /// The non-streaming response.
    fn full(&self, reasoning: &str, content: &str, d: &Done) -> Value {
        let choice = match self.ep {
            Endpoint::Chat => {
                let mut msg = json!({"role": "assistant", "content": content});
                if !reasoning.is_empty() {
                    msg["reasoning_content"] = json!(reasoning);
                }
                json!({"index": 0, "message": msg, "logprobs": null, "finish_reason": d.finish})
            }
            Endpoint::Completion => {
                json!({"index": 0, "text": content, "logprobs": null, "finish_reason": d.finish})
            }
        };
        let (timings, kv) = extras(d);
        json!({
            "id": self.id,
            "object": self.object(false),
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage(d),
            "timings": timings,
            "kv": kv,
        })
    }
}

async fn models(State(app): State<Arc<App>>) -> Json<Value> {
    Json(json!({
        "object": "list",
        "data": [{
            "id": app.model_id,
            "object": "model",
            "created": app.created,
            "owned_by": "kvrun",
            "meta": {"n_ctx": app.n_ctx, "n_vocab": app.n_vocab},
        }],
    }))
}

async fn health(State(app): State<Arc<App>>) -> Json<Value> {
    let busy = app.processing.load(Ordering::SeqCst);
    Json(json!({
        "status": "ok",
        "slots_idle": app.defaults.parallel.saturating_sub(busy),
        "slots_processing": busy,
        "queued": app.queued.load(Ordering::SeqCst),
    }))
}

async fn metrics(State(app): State<Arc<App>>) -> Response {
    use std::fmt::Write as _;
    let mut o = String::new();
    let m = match app.metrics.lock() {
        Ok(m) => m,
        Err(p) => p.into_inner(),
    };
    let mut metric = |name: &str, kind: &str, help: &str, lines: Vec<(String, String)>| {
        let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for (labels, v) in lines {
            let _ = writeln!(o, "{name}{labels} {v}");
        }
    };
    let one = |v: String| vec![(String::new(), v)];
    metric(
        "kvrun_requests_total",
        "counter",
        "HTTP requests by endpoint and status code.",
        m.requests
            .iter()
            .map(|((ep, st), n)| {
                (
                    format!("{{endpoint=\"{ep}\",status=\"{st}\"}}"),
                    n.to_string(),
                )
            })
            .collect(),
    );
    metric(
        "kvrun_prompt_tokens_total",
        "counter",
        "Prompt tokens processed.",
        one(m.prompt_tokens.to_string()),
    );
    metric(
        "kvrun_generated_tokens_total",
        "counter",
        "Tokens generated.",
        one(m.gen_tokens.to_string()),
    );
    metric(
        "kvrun_prompt_seconds_total",
        "counter",
        "Time spent on prompt processing.",
        one(format!("{:.6}", m.prompt_s)),
    );
    metric(
        "kvrun_generation_seconds_total",
        "counter",
        "Time spent generating tokens.",
        one(format!("{:.6}", m.gen_s)),
    );
    let rate = |n: u64, s: f64| if s > 0.0 { n as f64 / s } else { 0.0 };
    metric(
        "kvrun_prompt_tokens_per_second",
        "gauge",
        "Average prompt processing throughput (per slot).",
        one(format!("{:.3}", rate(m.prompt_tokens, m.prompt_s))),
    );
    metric(
        "kvrun_tokens_per_second",
        "gauge",
        "Average generation throughput (per slot).",
        one(format!("{:.3}", rate(m.gen_tokens, m.gen_s))),
    );
    metric(
        "kvrun_kv_evictions_total",
        "counter",
        "Tokens evicted from KV caches.",
        one(m.evictions.to_string()),
    );
    metric(
        "kvrun_requests_cancelled_total",
        "counter",
        "Generations stopped because the client went away.",
        one(m.cancelled.to_string()),
    );
    drop(m);
    let per_slot = |f: &dyn Fn(&SlotKv) -> usize| -> Vec<(String, String)> {
        app.slots
            .iter()
            .enumerate()
            .map(|(i, s)| (format!("{{slot=\"{i}\"}}"), f(s).to_string()))
            .collect()
    };
    metric(
        "kvrun_kv_occupancy_tokens",
        "gauge",
        "Tokens resident in each slot's KV cache.",
        per_slot(&|s| s.live.load(Ordering::Relaxed)),
    );
    metric(
        "kvrun_kv_capacity_tokens",
        "gauge",
        "KV cache slots allocated per slot (the budget, or the context).",
        per_slot(&|s| s.capacity.load(Ordering::Relaxed)),
    );
    metric(
        "kvrun_kv_peak_tokens",
        "gauge",
        "Most tokens resident at once in each slot's KV cache.",
        per_slot(&|s| s.peak.load(Ordering::Relaxed)),
    );
    metric(
        "kvrun_requests_processing",
        "gauge",
        "Requests being generated.",
        one(app.processing.load(Ordering::SeqCst).to_string()),
    );
    metric(
        "kvrun_requests_queued",
        "gauge",
        "Requests waiting for a slot.",
        one(app.queued.load(Ordering::SeqCst).to_string()),
    );
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
        )],
        o,
    )
        .into_response()
}

async fn not_found() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such endpoint")
}

async fn method_not_allowed() -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        "method not allowed on this endpoint",
    )
}

/// Constant-time comparison of the presented key.
fn key_matches(got: &[u8], want: &[u8]) -> bool {
    got.len() == want.len() && got.iter().zip(want).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
}

async fn auth(State(app): State<Arc<App>>, req: Request, next: Next) -> Response {
    if let Some(key) = &app.api_key {
        if req.uri().path() != "/health" {
            let got = req
                .headers()
                .get(header::AUTHORIZATION)
                .and_then(|h| h.to_str().ok())
                .and_then(|h| h.strip_prefix("Bearer "))
                .map(str::trim);
            let ok = got.is_some_and(|g| key_matches(g.as_bytes(), key.as_bytes()));
            if !ok {
                let msg = if got.is_none() {
                    "missing API key (send Authorization: Bearer KEY)"
                } else {
                    "invalid API key"
                };
                return ApiError::new(StatusCode::UNAUTHORIZED, "invalid_api_key", msg)
                    .into_response();
            }
        }
    }
    next.run(req).await
}

/// Counts responses by endpoint and status.
async fn track(State(app): State<Arc<App>>, req: Request, next: Next) -> Response {
    let ep = match req.uri().path() {
        "/v1/chat/completions" => "/v1/chat/completions",
        "/v1/completions" => "/v1/completions",
        "/v1/models" => "/v1/models",
        "/health" => "/health",
        "/metrics" => "/metrics",
        _ => "other",
    };
    let resp = next.run(req).await;
    if let Ok(mut m) = app.metrics.lock() {
        *m.requests.entry((ep, resp.status().as_u16())).or_default() += 1;
    }
    resp
}

/// `kvrun serve`.
pub fn run_serve(a: &ServeArgs) -> Result<()> {
    if a.parallel == 0 || a.parallel > 256 {
        return Err(Error::arg("--parallel", "must be between 1 and 256"));
    }
    if a.batch_size == 0 {
        return Err(Error::arg("-b/--batch-size", "must be at least 1"));
    }
    if a.n_predict < -1 {
        return Err(Error::arg(
            "-n/--n-predict",
            "must be -1 (unlimited) or ≥ 0",
        ));
    }
    a.sampling.check()?;
    if a.api_key.as_deref().is_some_and(|k| k.trim().is_empty()) {
        return Err(Error::arg("--api-key", "must not be empty"));
    }
    let path = resolve_model(&a.model.model)?;
    a.kv.build(0, &path)?;
    let n_threads = resolve_threads(a.model.threads)?;
    let per_slot_threads = (n_threads / a.parallel).max(1);
    // The model lives as long as the process: leak it to share it as 'static.
    let ck: &'static Checkpoint = Box::leak(Box::new(Checkpoint::open(&path)?));
    let w: &'static Weights<'static> = Box::leak(Box::new(ck.weights()?));
    let tok: &'static Tokenizer = Box::leak(Box::new(ck.tokenizer()?));
    if tok.n_vocab() > w.config.vocab {
        return Err(Error::Other(format!(
            "{}: the tokenizer has {} tokens but token_embd.weight has only {} rows",
            path.display(),
            tok.n_vocab(),
            w.config.vocab
        )));
    }
    let tmpl: Option<&'static ChatTemplate> = ck.chat_template()?.map(|t| &*Box::leak(Box::new(t)));
    let n_ctx = if a.ctx_size == 0 {
        w.config.n_ctx_train
    } else {
        a.ctx_size
    };
    crate::cli::check_ctx_alloc(
        &w.config,
        n_ctx.saturating_mul(a.parallel),
        per_slot_threads,
    )?;
    let model_id = a.alias.clone().unwrap_or_else(|| {
        path.file_name()
            .map(|s| s.to_string_lossy().trim_end_matches(".gguf").to_owned())
            .unwrap_or_else(|| ck.name())
    });
    let (jobs, rx) = sync_channel::<Job>(a.queue);
    let app = Arc::new(App {
        model_id,
        model_path: path.clone(),
        created: now_s(),
        n_ctx,
        n_vocab: tok.n_vocab(),
        defaults: a.clone(),
        api_key: a.api_key.clone(),
        jobs,
        queued: AtomicUsize::new(0),
        processing: AtomicUsize::new(0),
        metrics: Mutex::new(Metrics::default()),
        slots: (0..a.parallel).map(|_| SlotKv::default()).collect(),
        next_id: AtomicU64::new(0),
    });
    let eng = Arc::new(Engine {
        w,
        tok,
        tmpl,
        n_ctx,
        n_batch: a.batch_size,
        n_threads: per_slot_threads,
        reasoning: a.reasoning_format,
        model_path: path.clone(),
    });
    let rx = Arc::new(Mutex::new(rx));
    for i in 0..a.parallel {
        let (eng, app, rx) = (eng.clone(), app.clone(), rx.clone());
        std::thread::Builder::new()
            .name(format!("kvrun-slot-{i}"))
            .spawn(move || worker(i, eng, app, rx))
            .map_err(|e| Error::Other(format!("cannot start a worker thread: {e}")))?;
    }
    let router = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(app.clone(), auth))
        .layer(middleware::from_fn_with_state(app.clone(), track))
        .with_state(app.clone());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| Error::Other(format!("cannot start the async runtime: {e}")))?;
    rt.block_on(async move {
        let addr = format!("{}:{}", a.host, a.port);
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .map_err(|e| Error::arg("--host/--port", format!("cannot listen on {addr}: {e}")))?;
        let local = listener
            .local_addr()
            .map_err(|e| Error::Other(format!("listener: {e}")))?;
        eprintln!(
            "kvrun serve: {} on http://{local} ({} slot(s) × {per_slot_threads} thread(s), context {n_ctx}, queue {}, policy {})",
            app.model_id, a.parallel, a.queue, a.kv.policy
        );
        tokio::select! {
            r = axum::serve(listener, router) => r.map_err(|e| Error::Other(format!("server: {e}"))),
            _ = tokio::signal::ctrl_c() => Ok(()),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::{Field, Msg};

    fn split(start_in_think: bool, pieces: &[&str]) -> (String, String) {
        let mut t = ThinkSplit {
            enabled: true,
            in_think: start_in_think,
            ..Default::default()
        };
        let mut out = Vec::new();
        for p in pieces {
            t.push(p, &mut out);
        }
        t.finish(&mut out);
        let pick = |r: bool| -> String {
            out.iter()
                .filter(|(x, _)| *x == r)
                .map(|(_, s)| s.as_str())
                .collect()
        };
        (pick(true), pick(false))
    }

    #[test]
    fn think_tags_split_across_pieces() {
        let (r, c) = split(
            false,
            &[
                "<th",
                "ink>\nLet me",
                " think.</th",
                "ink>",
                "\n\nThe answer",
                " is 4.",
            ],
        );
        assert_eq!(r, "Let me think.");
        assert_eq!(c, "The answer is 4.");
        // the template opened the block: generation starts inside it
        let (r, c) = split(true, &["step 1\n", "</think>\n", "done"]);
        assert_eq!((r.as_str(), c.as_str()), ("step 1\n", "done"));
        // no tags: all content, a lone '<' is not swallowed
        let (r, c) = split(false, &["a <", "b"]);
        assert_eq!((r.as_str(), c.as_str()), ("", "a <b"));
        // disabled: tags stay in the content
        let mut t = ThinkSplit::default();
        let mut out = Vec::new();
        t.push("<think>x</think>y", &mut out);
        assert_eq!(out, vec![(false, "<think>x</think>y".to_owned())]);
    }

    #[test]
    fn stop_strings_across_pieces() {
        let mut m = StopMatch {
            stops: vec!["END".into(), "ü!".into()],
            pending: String::new(),
        };
        assert_eq!(m.push("abc E"), ("abc ".to_owned(), false));
        assert_eq!(m.push("N"), (String::new(), false));
        assert_eq!(m.push("X"), ("ENX".to_owned(), false));
        assert_eq!(m.push("xx ü"), ("xx ".to_owned(), false));
        assert_eq!(m.push("! tail"), (String::new(), true));
        let mut m = StopMatch {
            stops: vec!["\n\n".into()],
            pending: String::new(),
        };
        assert_eq!(m.push("a\n"), ("a".to_owned(), false));
        assert_eq!(m.finish(), "\n");
    }

    #[test]
    fn api_errors_are_openai_shaped() {
        let e: ApiError = Error::config(
            Field::Budget,
            Msg::default()
                .f(Field::Policy)
                .t(" h2o needs ")
                .f(Field::Budget)
                .t(" N"),
        )
        .into();
        let b = e.body();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(b["error"]["type"], "invalid_request_error");
        assert_eq!(
            b["error"]["message"],
            "kv_budget: policy h2o needs kv_budget N"
        );
        let e: ApiError = Error::ContextTooSmall {
            n_prompt: 10,
            n_ctx: 5,
        }
        .into();
        assert_eq!(e.body()["error"]["code"], "context_length_exceeded");
    }
}
