//! `pyramidkv`: PyramidKV (Cai et al., 2024, "PyramidKV: Dynamic KV Cache
//! Compression based on Pyramidal Information Funneling", arXiv 2406.02069),
//! on SnapKV scores.
//!
//! Idea: lower layers spread attention widely, upper layers funnel it onto
//! few tokens, so budgets should shrink with depth. With a per-head average
//! budget B and observation window w, layer l (of L) keeps
//!   w + round(max − l · (max − min) / (L − 1)),
//!   min = (B − w) / β, max = 2 (B − w) − min          (β = 20)
//! entries per KV head (kvpress/KVCache-Factory's formula), so the layers
//! sum to L · B: the same total memory as SnapKV at budget B, shifted to the
//! bottom. Rounding is corrected so the total never exceeds L · B. Inside
//! each (layer, KV head) stream, tokens are ranked by SnapKV's
//! observation-window votes (see `snapkv`).
//!
//! Parameters: `--pyramid-beta` 20, SnapKV's `--obs-window` 32 and
//! `--pool-kernel` 5; recent window w, sinks 4. The top layer's budget must
//! still hold the protected tokens (an error says so when it cannot).

use super::snapkv::{window_scores, SnapOptions};
use super::streams::StreamPlan;
use super::Scorer;
use crate::backend::pool::ThreadPool;
use crate::error::{Error, Result};
use crate::kv::KvCache;
use crate::model::llama::QueryWindow;
use crate::model::Config;

/// Per-KV-head budget of each of `n_layers` layers for an average of
/// `budget` with window `w` and ratio `beta`; sums to at most n_layers · budget.
pub fn layer_budgets(n_layers: usize, budget: usize, w: usize, beta: f32) -> Result<Vec<usize>> {
    if budget <= w {
        return Err(Error::arg(
            "--kv-budget",
            format!("pyramidkv needs a budget above the observation window ({w}), got {budget}"),
        ));
    }
    if !(beta >= 1.0) {
        return Err(Error::arg(
            "--pyramid-beta",
            format!("must be at least 1, got {beta}"),
        ));
    }
    let room = (budget - w) as f64;
    let min = room / beta as f64;
    let max = 2.0 * room - min;
    let steps = (n_layers.max(2) - 1) as f64;
    let mut b: Vec<usize> = (0..n_layers)
        .map(|l| w + (max - l as f64 * (max - min) / steps).round().max(0.0) as usize)
        .collect();
    // rounding may overshoot the total by a few entries: take them back
    // from the largest budgets
    let total = n_layers * budget;
    while b.iter().sum::<usize>() > total {
        let i = (0..n_layers)
            .max_by_key(|&i| (b[i], usize::MAX - i))
            .unwrap_or(0);
        b[i] -= 1;
    }
    Ok(b)
}

/// Depth-decreasing per-layer budgets, SnapKV scores.
#[derive(Debug)]
pub struct PyramidKv {
    pub opts: SnapOptions,
}

impl Scorer for PyramidKv {
    fn name(&self) -> &'static str {
        "pyramidkv"
    }
    fn stream_plan(&self, c: &Config, budget: usize) -> Result<Option<StreamPlan>> {
        let b = layer_budgets(c.n_layers, budget, self.opts.window, self.opts.beta)?;
        Ok(Some(StreamPlan::per_stream(c.n_layers, c.n_kv_heads, &b)))
    }
    fn query_window(&self) -> usize {
        self.opts.window
    }
    fn score_streams(
        &mut self,
        kv: &KvCache,
        qw: &QueryWindow,
        pool: &ThreadPool,
        want: &[bool],
        off: &[usize],
        out: &mut [f32],
    ) {
        window_scores(kv, qw, pool, self.opts.kernel, want, off, out)
    }
}
