//! `GET /metrics` of `kvrun serve`: request, token, time and eviction
//! counters and per-slot KV occupancy in the Prometheus text format.

use super::App;
use axum::extract::State;
use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Counters since the server started.
#[derive(Debug, Default)]
pub(super) struct Metrics {
    pub(super) requests: BTreeMap<(&'static str, u16), u64>,
    pub(super) prompt_tokens: u64,
    pub(super) gen_tokens: u64,
    pub(super) prompt_s: f64,
    pub(super) gen_s: f64,
    pub(super) evictions: u64,
    pub(super) cancelled: u64,
}

/// What a slot's KV cache holds now (updated by its worker), in two units:
/// tokens, and entries, one per (layer, KV head, token) row kept. With a
/// token-uniform cache they are the same number; with per-head streams
/// (snapkv, adakv, …) a token is several entries and tokens are entries /
/// streams, rounded up.
#[derive(Debug, Default)]
pub(super) struct SlotKv {
    pub(super) live_tokens: AtomicUsize,
    pub(super) live_entries: AtomicUsize,
    pub(super) capacity_tokens: AtomicUsize,
    pub(super) capacity_entries: AtomicUsize,
    pub(super) peak_tokens: AtomicUsize,
    pub(super) peak_entries: AtomicUsize,
    /// Generating now.
    pub(super) busy: std::sync::atomic::AtomicBool,
    /// Requests the slot has run.
    pub(super) requests: std::sync::atomic::AtomicU64,
    /// Entries its last request evicted.
    pub(super) evicted_last: AtomicUsize,
    /// The policy and budget of its last request (None before any).
    pub(super) policy: std::sync::Mutex<(Option<String>, Option<usize>)>,
    /// Prompt-prefix reuse of its last request.
    pub(super) prompt_cache: std::sync::Mutex<PromptCache>,
    /// Which tokens of its last conversation are still cached (`/slots?cached=1`).
    pub(super) residency: std::sync::Mutex<Residency>,
}

/// The tokens a slot's cache was fed (prompt + generated, positions 0..)
/// and, per position, the share of its (layer, KV-head) entries still
/// resident: 1 = cached, 0 = evicted (token-uniform caches give only these).
#[derive(Debug, Default, Clone)]
pub(super) struct Residency {
    pub(super) tokens: Vec<u32>,
    pub(super) kept: Vec<f32>,
}

/// A slot's prompt cache, as `/slots` reports it.
#[derive(Debug, Default, Clone)]
pub(super) struct PromptCache {
    /// Prompt tokens the last request reused.
    pub(super) reused: usize,
    /// Why it reused nothing (None when it reused a prefix).
    pub(super) miss: Option<String>,
    /// Tokens the cache holds for the next request to reuse.
    pub(super) cached: usize,
    /// Whether they are all still there (no eviction since).
    pub(super) intact: bool,
}

pub(super) async fn metrics(State(app): State<Arc<App>>) -> Response {
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
    let gauges: [(&str, &str, fn(&SlotKv) -> &AtomicUsize); 6] = [
        (
            "kvrun_kv_occupancy_tokens",
            "Tokens resident in each slot's KV cache after its last request (per-head streams: entries / streams, rounded up).",
            |s| &s.live_tokens,
        ),
        (
            "kvrun_kv_occupancy_entries",
            "(layer, KV head, token) entries resident in each slot's KV cache after its last request (token-uniform caches: equal to tokens).",
            |s| &s.live_entries,
        ),
        (
            "kvrun_kv_capacity_tokens",
            "KV cache size of each slot in tokens (the budget, or the context).",
            |s| &s.capacity_tokens,
        ),
        (
            "kvrun_kv_capacity_entries",
            "KV cache size of each slot in (layer, KV head, token) entries (token-uniform caches: equal to tokens).",
            |s| &s.capacity_entries,
        ),
        (
            "kvrun_kv_peak_tokens",
            "Most tokens resident at once in each slot's KV cache (per-head streams: entries / streams, rounded up).",
            |s| &s.peak_tokens,
        ),
        (
            "kvrun_kv_peak_entries",
            "Most (layer, KV head, token) entries resident at once in each slot's KV cache.",
            |s| &s.peak_entries,
        ),
    ];
    for (name, help, field) in gauges {
        metric(
            name,
            "gauge",
            help,
            per_slot(&|s| field(s).load(Ordering::Relaxed)),
        );
    }
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
