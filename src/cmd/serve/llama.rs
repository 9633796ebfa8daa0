//! The llama-server endpoints local clients use beside the OpenAI ones,
//! in llama-server's shapes, with kvrun's KV fields added:
//!
//! - `POST /tokenize` `{content, add_special=false, parse_special=true,
//!   with_pieces=false}` → `{tokens: [id…]}` or, with pieces,
//!   `{tokens: [{id, piece}…]}` (a piece that is not UTF-8 on its own is
//!   its byte array, as llama-server gives it);
//! - `POST /detokenize` `{tokens: [id…]}` → `{content}` (control tokens
//!   rendered as their text);
//! - `GET /props`: the defaults every request starts from (context,
//!   sampling, max tokens), slot count, model, chat template, build, and the
//!   KV defaults with the policy table;
//! - `GET /slots`: per slot, whether it is generating, its policy and budget,
//!   what its KV cache holds (as in `/metrics`) and its prompt cache (tokens
//!   cached for reuse, whether they are intact, what the last request reused
//!   or why it reused nothing); `GET /slots?cached=1` adds, per slot,
//!   `cache_view`: the pieces of the tokens its cache was fed (the last
//!   conversation) and per position the share still cached (1 cached, 0
//!   evicted; per-head stream policies give fractions): the web chat's live
//!   view of what the cache kept.
//!
//! Tokenizing runs on the blocking pool, never on the async workers; its
//! input is bounded by the request body limit.

use super::api::{parse_body, ApiError};
use super::App;
use axum::body::Bytes;
use axum::extract::{FromRequest, RawQuery, Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// The most bytes a request body may have (axum's default limit, set on
/// the router explicitly so the early check below agrees with it).
pub(super) const BODY_LIMIT: usize = 2 << 20;

/// The JSON object of a request body, waiting at most `--timeout` for it.
/// A body whose `Content-Length` is over [`BODY_LIMIT`] is refused (413)
/// at once, before any of it is read: waiting for bytes it would refuse
/// anyway would only end in a timeout.
pub(super) async fn read_json(app: &App, req: Request) -> Result<Value, ApiError> {
    let declared = req
        .headers()
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|h| h.to_str().ok())
        .and_then(|h| h.trim().parse::<u128>().ok());
    if let Some(n) = declared.filter(|&n| n > BODY_LIMIT as u128) {
        return Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "body_too_large",
            format!("the request body ({n} bytes) is larger than the limit of {BODY_LIMIT} bytes"),
        ));
    }
    let secs = app.defaults.timeout;
    match tokio::time::timeout(
        std::time::Duration::from_secs(secs),
        Bytes::from_request(req, &()),
    )
    .await
    {
        Ok(b) => parse_body(b),
        Err(_) => Err(ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            "request_timeout",
            format!("the request body did not arrive within {secs} s (--timeout)"),
        )),
    }
}

fn flag(v: &Value, field: &str, default: bool) -> Result<bool, ApiError> {
    match v.get(field) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(ApiError::bad(format!("'{field}' must be a boolean"))),
    }
}

/// Run a tokenizer job off the async workers.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f).await.map_err(|_| {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal_error",
            "the tokenizer stopped",
        )
    })?
}

fn answer(r: Result<Value, ApiError>) -> Response {
    match r {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `POST /tokenize`.
pub(super) async fn tokenize(State(app): State<Arc<App>>, req: Request) -> Response {
    answer(tokenize_inner(app, req).await)
}

async fn tokenize_inner(app: Arc<App>, req: Request) -> Result<Value, ApiError> {
    let v = read_json(&app, req).await?;
    let content = match v.get("content") {
        Some(Value::String(s)) => s.clone(),
        Some(_) => return Err(ApiError::bad("'content' must be a string")),
        None => return Err(ApiError::bad("'content' is required")),
    };
    let add_special = flag(&v, "add_special", false)?;
    let parse_special = flag(&v, "parse_special", true)?;
    let with_pieces = flag(&v, "with_pieces", false)?;
    let model = app.model.clone();
    blocking(move || {
        let tok = &model.tokenizer;
        let ids = tok.encode(&content, add_special, parse_special)?;
        let tokens: Vec<Value> = if with_pieces {
            ids.iter()
                .map(|&id| {
                    let b = tok.token_bytes(id, true);
                    let piece = match String::from_utf8(b) {
                        Ok(s) => json!(s),
                        Err(e) => json!(e.into_bytes()),
                    };
                    json!({"id": id, "piece": piece})
                })
                .collect()
        } else {
            ids.iter().map(|&id| json!(id)).collect()
        };
        Ok(json!({ "tokens": tokens }))
    })
    .await
}

/// `POST /detokenize`.
pub(super) async fn detokenize(State(app): State<Arc<App>>, req: Request) -> Response {
    answer(detokenize_inner(app, req).await)
}

async fn detokenize_inner(app: Arc<App>, req: Request) -> Result<Value, ApiError> {
    let v = read_json(&app, req).await?;
    let Some(Value::Array(items)) = v.get("tokens") else {
        return Err(ApiError::bad("'tokens' must be an array of token ids"));
    };
    let n_vocab = app.n_vocab;
    let mut ids = Vec::with_capacity(items.len());
    for (i, t) in items.iter().enumerate() {
        match t.as_u64() {
            Some(id) if (id as usize) < n_vocab => ids.push(id as u32),
            _ => {
                return Err(ApiError::bad(format!(
                    "tokens[{i}] is not a token id (0..{n_vocab})"
                )))
            }
        }
    }
    let model = app.model.clone();
    blocking(move || Ok(json!({ "content": model.tokenizer.decode(&ids, true) }))).await
}

/// `GET /props`.
pub(super) async fn props(State(app): State<Arc<App>>) -> Json<Value> {
    let d = &app.defaults;
    let s = &d.sampling;
    let policies: Vec<Value> = crate::policy::POLICIES
        .iter()
        .map(|p| json!({"name": p.name, "about": p.about, "budgeted": p.budgeted()}))
        .collect();
    Json(json!({
        "default_generation_settings": {
            "n_ctx": app.n_ctx,
            "params": {
                "n_predict": d.n_predict,
                "seed": d.seed,
                "temperature": s.temp.unwrap_or(0.8),
                "top_k": s.top_k,
                "top_p": s.top_p,
                "min_p": s.min_p,
                "repeat_penalty": s.repeat_penalty,
                "repeat_last_n": s.repeat_last_n,
            },
        },
        "total_slots": d.parallel,
        "model_alias": app.model_id,
        "model_path": app.model_path,
        "chat_template": app.chat_template.clone().unwrap_or_default(),
        "build_info": format!("kvrun {}", env!("CARGO_PKG_VERSION")),
        "modalities": {"vision": false, "audio": false},
        "kv": {
            "policy": d.kv.policy,
            "kv_budget": d.kv.kv_budget,
            "kv_sink": d.kv.kv_sink,
            "kv_recent": d.kv.kv_recent,
            "cache_type": d.kv.cache_type,
            "prompt_compress": d.kv.prompt_compress,
            "policies": policies,
        },
    }))
}

/// Whether the query string asks for `cached` (`cached`, `cached=1`, `cached=true`).
fn wants_cached(q: Option<&str>) -> bool {
    q.unwrap_or("").split('&').any(|kv| {
        let (k, v) = kv.split_once('=').unwrap_or((kv, "1"));
        k == "cached" && matches!(v, "1" | "true" | "")
    })
}

/// `GET /slots[?cached=1]`.
pub(super) async fn slots(State(app): State<Arc<App>>, RawQuery(q): RawQuery) -> Json<Value> {
    let cached = wants_cached(q.as_deref());
    let out: Vec<Value> = app
        .slots
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let (policy, budget) = s
                .policy
                .lock()
                .map(|p| p.clone())
                .unwrap_or_else(|p| p.into_inner().clone());
            let pc = s
                .prompt_cache
                .lock()
                .map(|p| p.clone())
                .unwrap_or_else(|p| p.into_inner().clone());
            let mut v = json!({
                "id": i,
                "n_ctx": app.n_ctx,
                "is_processing": s.busy.load(Ordering::Relaxed),
                "n_requests": s.requests.load(Ordering::Relaxed),
                "kv": {
                    "policy": policy,
                    "kv_budget": budget,
                    "live_tokens": s.live_tokens.load(Ordering::Relaxed),
                    "live_entries": s.live_entries.load(Ordering::Relaxed),
                    "capacity_tokens": s.capacity_tokens.load(Ordering::Relaxed),
                    "capacity_entries": s.capacity_entries.load(Ordering::Relaxed),
                    "peak_tokens": s.peak_tokens.load(Ordering::Relaxed),
                    "peak_entries": s.peak_entries.load(Ordering::Relaxed),
                    "evicted_last": s.evicted_last.load(Ordering::Relaxed),
                },
                "prompt_cache": {
                    "cached_tokens": pc.cached,
                    "intact": pc.intact,
                    "reused_last": pc.reused,
                    "miss_reason": pc.miss,
                },
            });
            if cached {
                let r = s
                    .residency
                    .lock()
                    .map(|r| r.clone())
                    .unwrap_or_else(|p| p.into_inner().clone());
                let tok = &app.model.tokenizer;
                // a character split over tokens shows on the one completing it
                let mut utf8 = crate::generate::Utf8Stream::default();
                let pieces: Vec<String> = r
                    .tokens
                    .iter()
                    .map(|&t| utf8.push(&tok.token_bytes(t, true)))
                    .collect();
                // 3 decimals are plenty for a colour
                let kept: Vec<f64> = r
                    .kept
                    .iter()
                    .map(|&k| (k as f64 * 1e3).round() / 1e3)
                    .collect();
                v["cache_view"] = json!({"pieces": pieces, "kept": kept});
            }
            v
        })
        .collect();
    Json(Value::Array(out))
}
