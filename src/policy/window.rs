//! `window`: StreamingLLM (Xiao et al., 2023, "Efficient Streaming Language
//! Models with Attention Sinks", arXiv 2309.17453).
//!
//! Idea: a few initial tokens absorb attention mass ("sinks"); keeping them
//! plus the most recent tokens keeps a model fluent over unbounded streams.
//! Score = position, so the evictor drops the oldest token outside the
//! protected sinks (`--kv-sink`, default 4). Keys keep their absolute RoPE
//! positions by default (as kvpress does); `--pos-mode cache` applies the
//! paper's in-cache positions (see `model::llama::forward`).

use super::Scorer;
use crate::kv::KvCache;

/// Sinks + recent window.
#[derive(Debug, Default)]
pub struct Window;

impl Scorer for Window {
    fn name(&self) -> &'static str {
        "window"
    }
    fn score(&mut self, _kv: &KvCache, _slots: &[u32], pos: &[i64], out: &mut [f32]) {
        for (o, &p) in out.iter_mut().zip(pos) {
            *o = p as f32;
        }
    }
}
