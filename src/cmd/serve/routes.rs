//! The HTTP side of `kvrun serve`: the axum router, the endpoint handlers,
//! API-key auth and per-endpoint request counting. A handler parses the
//! request, queues a [`Job`](super::api::Job) for a worker slot and answers
//! from the events the worker sends back (streamed or collected).

use super::api::{parse_job, parse_messages, parse_prompt, ApiError, Endpoint, Ev, Input, RespCtx};
use super::llama::{self, read_json, BODY_LIMIT};
use super::metrics::metrics;
use super::sse::stream_response;
use super::web;
use super::{now_s, App};
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use std::sync::atomic::Ordering;
use std::sync::mpsc::TrySendError;
use std::sync::Arc;
use tokio::sync::mpsc::unbounded_channel;

/// Every endpoint, with auth and request counting.
pub(super) fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/models", get(models))
        .route("/health", get(health))
        .route("/tokenize", post(llama::tokenize))
        .route("/detokenize", post(llama::detokenize))
        .route("/props", get(llama::props))
        .route("/slots", get(llama::slots))
        .route("/metrics", get(metrics))
        .route("/", get(web::index))
        .route("/index.html", get(web::index))
        .route("/app.js", get(web::app_js))
        .route("/style.css", get(web::style))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .layer(middleware::from_fn_with_state(app.clone(), auth))
        .layer(middleware::from_fn_with_state(app.clone(), track))
        .with_state(app)
}

async fn chat(State(app): State<Arc<App>>, req: Request) -> Response {
    handle(app, req, Endpoint::Chat).await
}

async fn completions(State(app): State<Arc<App>>, req: Request) -> Response {
    handle(app, req, Endpoint::Completion).await
}

async fn handle(app: Arc<App>, req: Request, ep: Endpoint) -> Response {
    // a client that sends its headers and then stalls on the body is cut
    // off after --timeout seconds, like one that stalls on its headers
    match handle_inner(app, req, ep).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn handle_inner(
    app: Arc<App>,
    req: Request,
    ep: Endpoint,
) -> std::result::Result<Response, ApiError> {
    let v = read_json(&app, req).await?;
    let input = match ep {
        Endpoint::Chat => Input::Chat(parse_messages(&v)?),
        Endpoint::Completion => parse_prompt(&v, app.n_vocab)?,
    };
    let (tx, mut rx) = unbounded_channel();
    let (job, stream, include_usage) = parse_job(&app, &v, input, tx)?;
    let logprobs = job.logprobs.is_some();
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
        logprobs,
    });
    if stream {
        return Ok(stream_response(ctx, rx));
    }
    let (mut reasoning, mut content) = (String::new(), String::new());
    let mut lp = Vec::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            Ev::Delta {
                reasoning: r,
                text,
                logprobs,
            } => {
                if r { &mut reasoning } else { &mut content }.push_str(&text);
                lp.extend(logprobs);
            }
            Ev::Done(d) => return Ok(Json(ctx.full(&reasoning, &content, &lp, &d)).into_response()),
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

/// The credentials of an `Authorization: Bearer KEY` header. The scheme is
/// case-insensitive (RFC 9110 §11.1), so `bearer KEY` works too.
fn bearer_token(h: &str) -> Option<&str> {
    let (scheme, key) = h.trim_start().split_once(|c: char| c == ' ' || c == '\t')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| key.trim())
}

async fn auth(State(app): State<Arc<App>>, req: Request, next: Next) -> Response {
    if let Some(key) = &app.api_key {
        let path = req.uri().path();
        if path != "/health" && !web::PATHS.contains(&path) {
            let got = req
                .headers()
                .get(header::AUTHORIZATION)
                .and_then(|h| h.to_str().ok())
                .and_then(bearer_token);
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
        "/tokenize" => "/tokenize",
        "/detokenize" => "/detokenize",
        "/props" => "/props",
        "/slots" => "/slots",
        "/" | "/index.html" | "/app.js" | "/style.css" => "/ (web chat)",
        _ => "other",
    };
    let resp = next.run(req).await;
    if let Ok(mut m) = app.metrics.lock() {
        *m.requests.entry((ep, resp.status().as_u16())).or_default() += 1;
    }
    resp
}
