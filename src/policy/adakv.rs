//! `adakv`: Ada-KV (Feng et al., 2024, "Ada-KV: Optimizing KV Cache Eviction
//! by Adaptive Budget Allocation for Efficient LLM Inference", arXiv
//! 2407.11550), on SnapKV scores.
//!
//! Idea: heads differ in how concentrated their attention is, so a layer's
//! budget should not be split evenly. The KV heads of a layer share
//! n_kv_heads × budget entries: whenever the layer is over budget it evicts
//! its globally lowest-scored entries, whichever head holds them, so heads
//! with flat attention give room to heads with peaked attention. Safeguard
//! (kvpress's AdaKVPress): each head always keeps its top ⌊0.2 · budget⌋
//! entries. Each head's tokens live in its own stream of pool rows, so the
//! per-head lengths really differ in memory.
//!
//! Scores are SnapKV's observation-window votes (see `snapkv`), comparable
//! across the heads of a layer (softmax probabilities averaged the same
//! way). Parameters: `--adakv-safeguard` 0.2, plus SnapKV's `--obs-window`
//! 32 and `--pool-kernel` 5; recent window w, sinks 4.

use super::snapkv::{window_scores, SnapOptions};
use super::streams::StreamPlan;
use super::Scorer;
use crate::backend::pool::ThreadPool;
use crate::kv::KvCache;
use crate::model::llama::QueryWindow;
use crate::model::Config;

/// Head-adaptive budgets inside each layer, SnapKV scores.
#[derive(Debug)]
pub struct AdaKv {
    pub opts: SnapOptions,
}

impl Scorer for AdaKv {
    fn name(&self) -> &'static str {
        "adakv"
    }
    fn stream_plan(&self, c: &Config, budget: usize) -> crate::error::Result<Option<StreamPlan>> {
        let safeguard = (self.opts.safeguard * budget as f32).floor() as usize;
        Ok(Some(StreamPlan::per_layer(
            c.n_layers,
            c.n_kv_heads,
            budget,
            safeguard,
        )))
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
