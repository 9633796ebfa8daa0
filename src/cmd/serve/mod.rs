//! `kvrun serve`: an OpenAI-compatible HTTP server (axum + tokio).
//!
//! ```text
//! POST /v1/chat/completions   chat (SSE streaming or not); <think>…</think> → reasoning_content
//! POST /v1/completions        raw prompt (SSE streaming or not)
//! GET  /v1/models             the loaded model
//! GET  /health                {"status":"ok", …} (open even with --api-key)
//! GET  /metrics               Prometheus text format
//! GET  /tokenize, /detokenize, /props, /slots[?cached=1]   llama-server's (see `llama`)
//! GET  /                      the web chat (see `web`)
//! ```
//!
//! - The weights are memory-mapped once and shared; `--parallel N` worker
//!   threads each own a `Session` (KV cache, thread pool) and take jobs from
//!   a bounded queue (`--queue N`); a full queue answers 503. Generation runs
//!   only on these std threads, never on the async runtime.
//! - Per request, the extra fields `policy`, `kv_budget`, `kv_sink`,
//!   `kv_recent`, `keep_prompt`, `evict_every`, `prompt_policy`,
//!   `prompt_budget` and `epikv_score_prompt` override the server's KV
//!   flags (a `kv_budget` beyond the context is clamped to it, as on the
//!   command line). A slot keeps its session between requests with the
//!   same policy (reset, not reallocated).
//! - `logprobs` (chat: `logprobs` + `top_logprobs`; completions: the
//!   legacy `logprobs: N`) are the log-softmax of the raw logits of each
//!   step, before any sampling transform; computed only when asked.
//! - Tokens travel from the worker to the handler over a channel; when the
//!   client goes away the handler (or the SSE body) is dropped, the channel's
//!   send fails and the worker stops at the next token.
//! - Every error is an OpenAI-shaped body `{"error":{"message","type","param","code"}}`.
//! - Start-up builds one session with the server's own KV flags, so a
//!   default no request could run with is a one-line error at once.
//! - Connections are served by our own hyper loop: `--timeout` bounds the
//!   wait for a request's headers (idle keep-alive time included) and then
//!   for its body. SIGINT / SIGTERM close the listener, give requests in
//!   flight `--shutdown-timeout` seconds, then stop the remaining
//!   generations at their next token (streams still end with a final chunk
//!   and `data: [DONE]`), and the process exits 0.
//! - Chat message contents are tokenized as plain text: control-token text
//!   a client typed stays text unless `--parse-special`.
//!
//! Files: `routes` (router, handlers, auth), `api` (request parsing,
//! response JSON, errors), `slots` (worker threads and job running), `sse`
//! (streaming), `metrics` (Prometheus), `llama` (llama-server's
//! endpoints), `web` (the chat page's static files). The model is loaded once as a
//! [`Loaded`](crate::load::Loaded) and shared by the workers through an
//! [`Arc`].

mod api;
mod llama;
mod metrics;
mod routes;
mod slots;
mod sse;
mod web;

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
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

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
    /// Seconds a connection may take to send a request's headers, idle
    /// keep-alive time included, and then its body; slower ones are closed.
    #[arg(long = "timeout", default_value_t = 30)]
    pub timeout: u64,
    /// On SIGINT / SIGTERM: seconds in-flight requests may take to finish
    /// before their generations are cut short (streams still end properly).
    #[arg(long = "shutdown-timeout", default_value_t = 10)]
    pub shutdown_timeout: u64,
    /// Let control-token text inside chat messages (e.g. `<|im_start|>`)
    /// become control tokens; by default it is tokenized as plain text, so a
    /// user cannot open a system turn.
    #[arg(long = "parse-special")]
    pub parse_special: bool,
}

/// Everything the handlers share.
#[derive(Debug)]
struct App {
    model_id: String,
    /// The model (the tokenizer endpoints read its tokenizer).
    model: Arc<crate::load::Loaded>,
    /// The chat template's source, for /props.
    chat_template: Option<String>,
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
    /// Set when the shutdown grace period is over: generations stop at the
    /// next token and queued jobs are turned away.
    stopping: AtomicBool,
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

/// The server's own KV flags are what every request starts from: build one
/// session with them now, so a setting no request could run with (say
/// `--policy h2o --kv-budget 1`) stops the server at start-up with the same
/// one-line error a request would get, instead of failing every request.
fn check_default_policy<'w>(
    a: &ServeArgs,
    w: &'w crate::model::Weights<'w>,
    path: &std::path::Path,
    n_ctx: usize,
) -> Result<()> {
    a.kv.check()?;
    let cfg = a.kv.config()?;
    if let Some(b) = cfg.budget {
        if cfg.def()?.budgeted() && b > n_ctx {
            return Err(Error::config(
                crate::error::Field::Budget,
                format!("{b} is larger than the context ({n_ctx} tokens, -c/--ctx-size)"),
            ));
        }
    }
    // a budgeted cache is the budget's size; the full cache has nothing to
    // check but its type and positions, so a short one does
    let n = if cfg.budget.is_some() {
        n_ctx
    } else {
        n_ctx.min(256)
    };
    drop(a.kv.session(w, 0, path, n, 1, a.batch_size, 0)?);
    Ok(())
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
    if a.timeout == 0 {
        return Err(Error::arg("--timeout", "must be at least 1 second"));
    }
    if a.api_key.as_deref().is_some_and(|k| k.trim().is_empty()) {
        return Err(Error::arg("--api-key", "must not be empty"));
    }
    // the id every response and /v1/models report: clients match on it
    if a.alias.as_deref().is_some_and(|m| m.trim().is_empty()) {
        return Err(Error::arg(
            "-a/--alias",
            "must not be empty (leave it out for the model's file name)",
        ));
    }
    let path = resolve_model(&a.model.model)?;
    a.kv.build(0, &path)?;
    let n_threads = resolve_threads(a.model.threads)?;
    // until the server watches for signals itself (`shutdown_signal`), a
    // Ctrl-C ends the start-up at once: nothing is served yet
    crate::cmd::interrupt::install();
    crate::cmd::interrupt::set_mode(crate::cmd::interrupt::Mode::Idle);
    let per_slot_threads = (n_threads / a.parallel).max(1);
    // One model, owned here and by the worker threads (an Arc each).
    let model = Arc::new(load_model(&a.model)?);
    let tmpl: Option<ChatTemplate> = a.model.chat_template(&model)?;
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
    check_default_policy(a, w, &path, n_ctx)?;
    let model_id = a.alias.clone().unwrap_or_else(|| {
        path.file_name()
            .map(|s| s.to_string_lossy().trim_end_matches(".gguf").to_owned())
            .unwrap_or_else(|| model.name())
    });
    let (jobs, rx) = sync_channel::<Job>(a.queue);
    let app = Arc::new(App {
        model_id,
        model: model.clone(),
        chat_template: tmpl.as_ref().map(|t| t.source().to_owned()),
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
        stopping: AtomicBool::new(false),
    });
    let eng = Arc::new(Engine {
        model: model.clone(),
        tmpl,
        n_ctx,
        n_batch: a.batch_size,
        n_threads: per_slot_threads,
        reasoning: a.reasoning_format,
        parse_special: a.parse_special,
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
    let res = rt.block_on(serve_until_signal(a, app, router, per_slot_threads, n_ctx));
    // connections still open after the grace period are dropped here
    rt.shutdown_timeout(Duration::from_secs(1));
    res
}

/// A future that resolves on SIGINT or SIGTERM. The handlers are in place
/// when this returns (before the start-up line is printed), so a signal
/// sent right after start-up is never the default, fatal one.
fn shutdown_signal() -> Result<impl std::future::Future<Output = ()>> {
    use tokio::signal::unix::{signal, SignalKind};
    let sig = |k: SignalKind| {
        signal(k).map_err(|e| Error::Other(format!("cannot watch for signals: {e}")))
    };
    let (mut int, mut term) = (sig(SignalKind::interrupt())?, sig(SignalKind::terminate())?);
    // tokio's handler calls the start-up one before it: from now on that
    // one must do nothing
    crate::cmd::interrupt::set_mode(crate::cmd::interrupt::Mode::Passive);
    Ok(async move {
        tokio::select! {
            _ = int.recv() => {}
            _ = term.recv() => {}
        }
    })
}

/// Accept connections until SIGINT / SIGTERM, then shut down gracefully:
/// stop accepting, let in-flight requests finish for `--shutdown-timeout`
/// seconds, then cut the remaining generations short (each stream still
/// gets its final chunk with `finish_reason` and `data: [DONE]`).
async fn serve_until_signal(
    a: &ServeArgs,
    app: Arc<App>,
    router: axum::Router,
    per_slot_threads: usize,
    n_ctx: usize,
) -> Result<()> {
    use hyper_util::rt::{TokioIo, TokioTimer};
    use hyper_util::service::TowerToHyperService;
    let addr = format!("{}:{}", a.host, a.port);
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .map_err(|e| Error::arg("--host/--port", format!("cannot listen on {addr}: {e}")))?;
    let local = listener
        .local_addr()
        .map_err(|e| Error::Other(format!("listener: {e}")))?;
    let signal = shutdown_signal()?;
    tokio::pin!(signal);
    eprintln!(
        "kvrun serve: {} on http://{local} ({} slot(s) × {per_slot_threads} thread(s), context {n_ctx}, queue {}, policy {})",
        app.model_id, a.parallel, a.queue, a.kv.policy
    );
    let mut http = hyper::server::conn::http1::Builder::new();
    // the header timer runs from the moment a connection waits for a
    // request, so it closes idle keep-alive connections too
    http.timer(TokioTimer::new())
        .header_read_timeout(Duration::from_secs(a.timeout))
        .keep_alive(true);
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut conns = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            acc = listener.accept() => {
                let stream = match acc {
                    Ok((s, _)) => s,
                    Err(e) => {
                        // e.g. out of file descriptors: keep serving the open ones
                        eprintln!("kvrun serve: accept: {e}");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let conn = http.serve_connection(
                    TokioIo::new(stream),
                    TowerToHyperService::new(router.clone()),
                );
                let mut stop = stop_rx.clone();
                conns.spawn(async move {
                    let mut conn = std::pin::pin!(conn);
                    tokio::select! {
                        _ = conn.as_mut() => return,
                        _ = stop.changed() => conn.as_mut().graceful_shutdown(),
                    }
                    let _ = conn.await;
                });
            }
            _ = &mut signal => break,
            // reap finished connections so the set stays small
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
    drop(listener);
    let busy = app.processing.load(Ordering::SeqCst) + app.queued.load(Ordering::SeqCst);
    eprintln!(
        "kvrun serve: shutting down: no new connections; {busy} request(s) in flight, up to {} s to finish (--shutdown-timeout)",
        a.shutdown_timeout
    );
    // idle connections close now, busy ones after their response
    let _ = stop_tx.send(true);
    let grace = Duration::from_secs(a.shutdown_timeout);
    let drained = tokio::time::timeout(grace, async { while conns.join_next().await.is_some() {} })
        .await
        .is_ok();
    if !drained {
        // cut the rest short: workers stop at the next token and each
        // response ends normally (finish_reason "length", then [DONE])
        app.stopping.store(true, Ordering::SeqCst);
        eprintln!(
            "kvrun serve: grace period over: stopping {} open connection(s)",
            conns.len()
        );
        let _ = tokio::time::timeout(Duration::from_secs(5), async {
            while conns.join_next().await.is_some() {}
        })
        .await;
        conns.abort_all();
    }
    eprintln!("kvrun serve: stopped");
    Ok(())
}
