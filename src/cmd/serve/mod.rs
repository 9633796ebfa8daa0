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
//!
//! Files: `routes` (router, handlers, auth), `api` (request parsing,
//! response JSON, errors), `slots` (worker threads and job running), `sse`
//! (streaming), `metrics` (Prometheus). The model is loaded once as a
//! [`Loaded`](crate::load::Loaded) and shared by the workers through an
//! [`Arc`].

mod api;
mod metrics;
mod routes;
mod slots;
mod sse;

pub use api::ApiError;

use crate::chat::ChatTemplate;
use crate::cmd::args::{
    check_ctx_alloc, resolve_model, resolve_threads, KvArgs, ModelArgs, SamplingArgs,
};
use crate::cmd::load_model;
use crate::error::{Error, Result};
use api::Job;
use clap::{Args, ValueEnum};
use metrics::{Metrics, SlotKv};
use slots::{worker, Engine};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

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
    pub sampling: SamplingArgs,
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
    // One model, owned here and by the worker threads (an Arc each).
    let model = Arc::new(load_model(&a.model)?);
    let tmpl: Option<ChatTemplate> = model.chat_template()?;
    let w = model.weights();
    let n_ctx = if a.ctx_size == 0 {
        w.config.n_ctx_train
    } else {
        a.ctx_size
    };
    check_ctx_alloc(
        &w.config,
        n_ctx.saturating_mul(a.parallel),
        per_slot_threads,
    )?;
    let model_id = a.alias.clone().unwrap_or_else(|| {
        path.file_name()
            .map(|s| s.to_string_lossy().trim_end_matches(".gguf").to_owned())
            .unwrap_or_else(|| model.name())
    });
    let (jobs, rx) = sync_channel::<Job>(a.queue);
    let app = Arc::new(App {
        model_id,
        model_path: path.clone(),
        created: now_s(),
        n_ctx,
        n_vocab: model.tokenizer.n_vocab(),
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
        model: model.clone(),
        tmpl,
        n_ctx,
        n_batch: a.batch_size,
        n_threads: per_slot_threads,
        reasoning: a.reasoning_format,
    });
    let rx = Arc::new(Mutex::new(rx));
    for i in 0..a.parallel {
        let (eng, app, rx) = (eng.clone(), app.clone(), rx.clone());
        std::thread::Builder::new()
            .name(format!("kvrun-slot-{i}"))
            .spawn(move || worker(i, eng, app, rx))
            .map_err(|e| Error::Other(format!("cannot start a worker thread: {e}")))?;
    }
    let router = routes::router(app.clone());
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
