//! `window`: StreamingLLM (Xiao et al., 2023, "Efficient Streaming Language
//! Models with Attention Sinks", arXiv 2309.17453).
//!
//! Idea: a few initial tokens absorb attention mass ("sinks"); keeping them
//! plus the most recent tokens keeps a model fluent over unbounded streams.
//! Score = position, so the evictor drops the oldest token outside the
//! protected sinks (`--kv-sink`, default 4). Keys keep their absolute RoPE
//! positions by default (as kvpress does); `--pos-mode cache` applies the
//! paper's in-cache positions (see `model::llama::forward`).

use super::{Entries, ScoreCtx, Scorer};

/// Sinks + recent window.
#[derive(Debug, Default)]
pub struct Window;

impl Scorer for Window {
    fn score(&mut self, ctx: &ScoreCtx<'_>, out: &mut [f32]) {
        if let Entries::Tokens { pos, .. } = ctx.entries {
            for (o, &p) in out.iter_mut().zip(pos) {
                *o = p as f32;
            }
        }
    }
}
