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

/// What a slot's KV cache holds now (updated by its worker).
#[derive(Debug, Default)]
pub(super) struct SlotKv {
    pub(super) live: AtomicUsize,
    pub(super) capacity: AtomicUsize,
    pub(super) peak: AtomicUsize,
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
