//! The OpenAI API surface of `kvrun serve`: request parsing (bodies,
//! messages, prompts, sampling and per-request KV fields), the messages
//! between a handler and its worker ([`Job`] in, [`Ev`] out), the response
//! JSON ([`RespCtx`]) and [`ApiError`], the OpenAI-shaped error body
//! `{"error":{"message","type","param","code"}}` every failure becomes.

use super::App;
use crate::chat::Message;
use crate::error::Error;
use crate::policy::PolicyConfig;
use crate::sample::SamplerConfig;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use std::time::{SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc::UnboundedSender;

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
    pub(super) fn new(
        status: StatusCode,
        code: &'static str,
        message: impl Into<String>,
    ) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            code,
        }
    }
    pub(super) fn bad(message: impl Into<String>) -> ApiError {
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
    pub(super) fn body(&self) -> Value {
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
// Jobs: handler → worker → handler

#[derive(Debug)]
pub(super) enum Input {
    Chat(Vec<Message>),
    Text(String),
    Tokens(Vec<u32>),
}

#[derive(Debug)]
pub(super) struct Job {
    pub(super) input: Input,
    pub(super) max_tokens: i64,
    pub(super) sampler: SamplerConfig,
    pub(super) stop: Vec<String>,
    pub(super) ignore_eos: bool,
    pub(super) kv: PolicyConfig,
    /// Reuse the slot's cached prompt prefix (llama-server's
    /// `cache_prompt`, on by default) while it is intact.
    pub(super) cache_prompt: bool,
    /// `enable_thinking` for this request's chat template (llama-server's
    /// `chat_template_kwargs`, or a top-level field); None: the server's.
    pub(super) enable_thinking: Option<bool>,
    /// Log-probabilities asked for: the number of alternatives per token
    /// (chat's `top_logprobs`, completions' `logprobs`); None: not asked.
    pub(super) logprobs: Option<usize>,
    pub(super) tx: UnboundedSender<Ev>,
}

/// A token's text and raw bytes (a piece may be part of a UTF-8
/// character; its text then holds U+FFFD).
#[derive(Debug, Clone, PartialEq)]
pub(super) struct TokenPiece {
    pub(super) text: String,
    pub(super) bytes: Vec<u8>,
}

/// One generated token's log-probabilities: the log-softmax of the
/// model's raw logits at that step, before temperature, top-k/top-p/min-p
/// and penalties (vLLM's default), so they do not depend on the sampling
/// settings.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Logprob {
    pub(super) token: TokenPiece,
    pub(super) logprob: f32,
    /// The most likely tokens, most likely first (the drawn one may be absent).
    pub(super) top: Vec<(TokenPiece, f32)>,
    /// Characters of generated text before this token (`text_offset`).
    pub(super) offset: usize,
}

/// Per-request results of generation.
#[derive(Debug, Clone)]
pub(super) struct Done {
    pub(super) finish: &'static str,
    pub(super) prompt_tokens: usize,
    /// Prompt tokens reused from the slot's cache (not prefilled again).
    pub(super) cached_tokens: usize,
    pub(super) completion_tokens: usize,
    pub(super) prompt_ms: f64,
    pub(super) gen_ms: f64,
    pub(super) evicted: usize,
    pub(super) peak_kv: usize,
    /// The slot that ran it.
    pub(super) slot: usize,
    /// Tokens resident at the end, and the most the cache holds.
    pub(super) live_kv: usize,
    pub(super) capacity_kv: usize,
    /// The policy and budget it ran with.
    pub(super) policy: String,
    pub(super) budget: Option<usize>,
}

#[derive(Debug)]
pub(super) enum Ev {
    Started,
    /// `reasoning` = the text belongs to `reasoning_content`; `logprobs`:
    /// the entries of the tokens whose text this delta is the first to
    /// carry (empty unless the request asked for them).
    Delta {
        reasoning: bool,
        text: String,
        logprobs: Vec<Logprob>,
    },
    Done(Done),
    Error(ApiError),
}

// ---------------------------------------------------------------------------
// Request parsing

pub(super) fn parse_body(
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

/// Optional integer field in `lo..=hi`; `range` says what is accepted.
/// A number beyond 64 bits (`1e30`, `99999999999999999999999`, which JSON
/// parsers hold as floats) is out of range, not "not an integer"; a
/// negative one where only non-negative values are accepted says so.
fn opt_int(
    v: &Value,
    field: &str,
    lo: i128,
    hi: i128,
    range: &str,
) -> std::result::Result<Option<i128>, ApiError> {
    let Some(x) = opt(v, field) else {
        return Ok(None);
    };
    let n = if let Some(i) = x.as_i64() {
        i as i128
    } else if let Some(u) = x.as_u64() {
        u as i128
    } else {
        match x.as_f64() {
            // a whole number written as a float: its value decides (the
            // cast saturates far beyond any range here)
            Some(f) if f.is_finite() && f.fract() == 0.0 => f as i128,
            _ => return Err(type_err(field, "an integer", x)),
        }
    };
    if n < 0 && lo >= 0 {
        return Err(ApiError::bad(format!(
            "'{field}' must not be negative ({range}), got {x}"
        )));
    }
    if n < lo || n > hi {
        return Err(ApiError::bad(format!(
            "'{field}' is out of range ({range}), got {x}"
        )));
    }
    Ok(Some(n))
}

/// Optional non-negative count up to `max`.
fn opt_usize(v: &Value, field: &str, max: usize) -> std::result::Result<Option<usize>, ApiError> {
    Ok(opt_int(v, field, 0, max as i128, &format!("0..={max}"))?.map(|n| n as usize))
}

/// Optional integer that fits an i64 (`range` says which values mean what).
fn opt_i64(v: &Value, field: &str, range: &str) -> std::result::Result<Option<i64>, ApiError> {
    Ok(opt_int(v, field, i64::MIN as i128, i64::MAX as i128, range)?.map(|n| n as i64))
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

pub(super) fn parse_messages(v: &Value) -> std::result::Result<Vec<Message>, ApiError> {
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

pub(super) fn parse_prompt(v: &Value, n_vocab: usize) -> std::result::Result<Input, ApiError> {
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

/// Chat's `top_logprobs` goes up to 20, as OpenAI's.
const MAX_TOP_LOGPROBS: usize = 20;
/// Completions' `logprobs` goes up to 5, as OpenAI's legacy API.
const MAX_LEGACY_LOGPROBS: usize = 5;

/// Everything but the input: sampling, limits, stop strings, KV policy,
/// log-probabilities, streaming.
pub(super) fn parse_job(
    app: &App,
    v: &Value,
    input: Input,
    tx: UnboundedSender<Ev>,
) -> std::result::Result<(Job, bool, bool), ApiError> {
    let d = &app.defaults;
    if let Some(n) = opt_i64(v, "n", "only 1 is supported")? {
        if n != 1 {
            return Err(ApiError::bad("'n': only n = 1 is supported"));
        }
    }
    let max_range = format!("-1 for no limit, or 0..={}", i64::MAX);
    let max_tokens = match (
        opt_i64(v, "max_completion_tokens", &max_range)?,
        opt_i64(v, "max_tokens", &max_range)?,
    ) {
        (Some(n), _) | (None, Some(n)) => {
            // -1: until end of generation or a full context, as -n -1
            if n < -1 {
                return Err(ApiError::bad(format!(
                    "'max_tokens' must be -1 (until done or the context is full) or ≥ 0, got {n}"
                )));
            }
            n
        }
        (None, None) => d.n_predict,
    };
    let temp = opt_f32(v, "temperature")?.unwrap_or(d.sampling.temp.unwrap_or(0.8));
    let top_p = opt_f32(v, "top_p")?.unwrap_or(d.sampling.top_p);
    let min_p = opt_f32(v, "min_p")?.unwrap_or(d.sampling.min_p);
    let top_k = opt_usize(v, "top_k", usize::MAX >> 1)?.unwrap_or(d.sampling.top_k);
    let repeat_penalty = opt_f32(v, "repeat_penalty")?.unwrap_or(d.sampling.repeat_penalty);
    // a seed is any u64; a negative one asks for a random seed
    let seed_range = format!("0..={}, or negative for a random seed", u64::MAX);
    let seed = match opt_int(v, "seed", i64::MIN as i128, u64::MAX as i128, &seed_range)?
        .unwrap_or(d.seed as i128)
    {
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
    let cache_prompt = opt_bool(v, "cache_prompt")?.unwrap_or(true);
    let enable_thinking = match opt(v, "chat_template_kwargs") {
        None => None,
        Some(o @ Value::Object(_)) => opt_bool(o, "enable_thinking")?,
        Some(other) => return Err(type_err("chat_template_kwargs", "an object", other)),
    }
    .or(opt_bool(v, "enable_thinking")?);
    // KV policy: the server's flags, overridden per request
    let mut kv = d.kv.config()?;
    if let Some(p) = opt_str(v, "policy")? {
        kv.policy = p.to_owned();
    }
    // a budget of 0 holds nothing: the accepted range starts at 1; one
    // beyond the context is clamped to it below, as on the command line
    let budget = opt_int(
        v,
        "kv_budget",
        1,
        i64::MAX as i128,
        &format!(
            "1..={}; above the context size {} it is clamped to it",
            i64::MAX,
            app.n_ctx
        ),
    )?
    .map(|b| usize::try_from(b).unwrap_or(usize::MAX));
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
    // policies that keep the whole prompt (epikv, raas, …) run on prompts
    // longer than their budget with a prompt phase or scored prompt tokens,
    // as --prompt-policy / --prompt-budget / --epikv-score-prompt
    if let Some(p) = opt_str(v, "prompt_policy")? {
        kv.prompt_policy = Some(p.to_owned());
    }
    if let Some(b) = opt_usize(v, "prompt_budget", app.n_ctx)? {
        kv.prompt_budget = Some(b);
    }
    if let Some(e) = opt_bool(v, "epikv_score_prompt")? {
        kv.epikv_score_prompt = e;
    }
    let budgeted = kv.def()?.budgeted();
    if !budgeted && budget.is_some() {
        return Err(ApiError::bad(
            "'kv_budget' needs an eviction policy: set 'policy' (e.g. \"window\", \"h2o\")",
        ));
    }
    if !budgeted {
        // `"policy": "full"` over a server started with a budget: that
        // budget does not apply (and is not reported)
        kv.budget = None;
    }
    // unknown policy names and missing budgets fail here, before queueing
    let built = kv.build(0, &app.model_path).map_err(ApiError::from)?;
    // a budget beyond the context could never evict: it is the context
    // (reported so in `kv.kv_budget`), as the command line clamps
    // --kv-budget to -c; a policy that splits its budget unevenly keeps
    // it as given (Session::for_config_on)
    if let (Some(b), Some(p)) = (kv.budget, &built) {
        if b > app.n_ctx && p.rule.caps_each_stream() {
            kv.budget = Some(app.n_ctx);
        }
    }
    let logprobs = match &input {
        Input::Chat(_) => {
            let on = opt_bool(v, "logprobs")?.unwrap_or(false);
            match (on, opt_usize(v, "top_logprobs", MAX_TOP_LOGPROBS)?) {
                (false, Some(_)) => {
                    return Err(ApiError::bad("'top_logprobs' needs \"logprobs\": true"))
                }
                (true, k) => Some(k.unwrap_or(0)),
                (false, None) => None,
            }
        }
        // the legacy API: `logprobs` is the number of alternatives
        _ => opt_usize(v, "logprobs", MAX_LEGACY_LOGPROBS)?,
    };
    let sampler = SamplerConfig {
        temp,
        top_k,
        top_p,
        min_p,
        repeat_penalty,
        repeat_last_n: d.sampling.repeat_last_n,
        seed,
    };
    // the same range check as the command line's
    sampler.validate()?;
    let job = Job {
        input,
        max_tokens,
        sampler,
        stop,
        ignore_eos,
        kv,
        cache_prompt,
        enable_thinking,
        logprobs,
        tx,
    };
    Ok((job, stream, include_usage))
}

// ---------------------------------------------------------------------------
// Responses

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Endpoint {
    Chat,
    Completion,
}

/// What every chunk / response of one request repeats.
#[derive(Debug)]
pub(super) struct RespCtx {
    pub(super) id: String,
    pub(super) created: u64,
    pub(super) model: String,
    pub(super) ep: Endpoint,
    pub(super) include_usage: bool,
    /// The request asked for log-probabilities.
    pub(super) logprobs: bool,
}

fn piece_bytes(p: &TokenPiece) -> Value {
    Value::from(p.bytes.iter().map(|&b| u64::from(b)).collect::<Vec<_>>())
}

/// A chat entry: `{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}`.
fn chat_logprob(e: &Logprob) -> Value {
    let top: Vec<Value> = e
        .top
        .iter()
        .map(|(p, lp)| json!({"token": p.text, "logprob": lp, "bytes": piece_bytes(p)}))
        .collect();
    json!({
        "token": e.token.text,
        "logprob": e.logprob,
        "bytes": piece_bytes(&e.token),
        "top_logprobs": top,
    })
}

/// The legacy completions shape: parallel arrays, each `top_logprobs`
/// entry a `{token: logprob}` map that also holds the drawn token (so up to
/// `logprobs` + 1 entries, as OpenAI's).
fn legacy_logprobs(lp: &[Logprob]) -> Value {
    let top: Vec<Value> = lp
        .iter()
        .map(|e| {
            let mut m = serde_json::Map::new();
            for (p, l) in e.top.iter().chain([(e.token.clone(), e.logprob)].iter()) {
                // two tokens with the same text: the likelier one stays
                m.entry(p.text.clone()).or_insert(json!(l));
            }
            Value::Object(m)
        })
        .collect();
    json!({
        "tokens": lp.iter().map(|e| e.token.text.as_str()).collect::<Vec<_>>(),
        "token_logprobs": lp.iter().map(|e| e.logprob).collect::<Vec<_>>(),
        "top_logprobs": top,
        "text_offset": lp.iter().map(|e| e.offset).collect::<Vec<_>>(),
    })
}

pub(super) fn usage(d: &Done) -> Value {
    json!({
        "prompt_tokens": d.prompt_tokens,
        "completion_tokens": d.completion_tokens,
        "total_tokens": d.prompt_tokens + d.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": d.cached_tokens},
    })
}

pub(super) fn extras(d: &Done) -> (Value, Value) {
    let per_s = |n: usize, ms: f64| if ms > 0.0 { n as f64 * 1e3 / ms } else { 0.0 };
    (
        json!({
            "cache_n": d.cached_tokens,
            "prompt_n": d.prompt_tokens - d.cached_tokens,
            "prompt_ms": d.prompt_ms,
            "prompt_per_second": per_s(d.prompt_tokens - d.cached_tokens, d.prompt_ms),
            "predicted_n": d.completion_tokens,
            "predicted_ms": d.gen_ms,
            "predicted_per_second": per_s(d.completion_tokens, d.gen_ms),
        }),
        json!({
            "evicted": d.evicted,
            "peak_tokens": d.peak_kv,
            "live_tokens": d.live_kv,
            "capacity_tokens": d.capacity_kv,
            "policy": d.policy,
            "kv_budget": d.budget,
            "slot": d.slot,
        }),
    )
}

impl RespCtx {
    pub(super) fn object(&self, chunk: bool) -> &'static str {
        match (self.ep, chunk) {
            (Endpoint::Chat, true) => "chat.completion.chunk",
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Completion, _) => "text_completion",
        }
    }
    /// A choice's `logprobs`: null unless the request asked for them
    /// (chat: `{content: [entry…], refusal: null}`; completions: the
    /// legacy arrays).
    pub(super) fn logprobs_json(&self, lp: &[Logprob]) -> Value {
        match (self.logprobs, self.ep) {
            (false, _) => Value::Null,
            (true, Endpoint::Chat) => json!({
                "content": lp.iter().map(chat_logprob).collect::<Vec<_>>(),
                "refusal": null,
            }),
            (true, Endpoint::Completion) => legacy_logprobs(lp),
        }
    }
    /// One streaming chunk (chat: `delta`; completions: `text`) with the
    /// log-probabilities of the tokens it carries (None: `null`, for the
    /// chunks that carry no tokens).
    pub(super) fn chunk(
        &self,
        delta: Value,
        lp: Option<&[Logprob]>,
        finish: Option<&str>,
    ) -> String {
        let logprobs = lp.map_or(Value::Null, |lp| self.logprobs_json(lp));
        let choice = match self.ep {
            Endpoint::Chat => {
                json!({"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish})
            }
            Endpoint::Completion => json!({
                "index": 0,
                "text": delta.get("content").and_then(Value::as_str).unwrap_or(""),
                "logprobs": logprobs,
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
    /// The non-streaming response; `lp`: every token's log-probabilities.
    pub(super) fn full(&self, reasoning: &str, content: &str, lp: &[Logprob], d: &Done) -> Value {
        let logprobs = self.logprobs_json(lp);
        let choice = match self.ep {
            Endpoint::Chat => {
                let mut msg = json!({"role": "assistant", "content": content});
                if !reasoning.is_empty() {
                    msg["reasoning_content"] = json!(reasoning);
                }
                json!({"index": 0, "message": msg, "logprobs": logprobs, "finish_reason": d.finish})
            }
            Endpoint::Completion => {
                json!({"index": 0, "text": content, "logprobs": logprobs, "finish_reason": d.finish})
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::{Field, Msg};

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
