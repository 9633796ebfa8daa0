//! `h2o`: Heavy-Hitter Oracle (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle
//! for Efficient Generative Inference of Large Language Models", arXiv 2306.14048).
//!
//! Idea: a few tokens receive most of the attention over time; keep those
//! "heavy hitters" plus a recent window. Score = attention probability the
//! token has received, accumulated over every query row since it was written
//! (prefill rows included), averaged over heads and layers (the token-uniform
//! form used by the EPIKV harness). Parameters: protection via the shared
//! evictor (`--kv-sink` 4, `--kv-recent`). The probabilities come out of the
//! fused attention pass; no attention matrix is stored.

use super::{CacheShape, Entries, ModelView, ScoreCtx, Scorer, Step};
use crate::error::Result;
use crate::signals::{MassMode, Needs};

/// Accumulated attention per slot.
#[derive(Debug, Default)]
pub struct H2o {
    /// (n_slots,) attention received since the slot was written.
    acc: Vec<f32>,
}

impl Scorer for H2o {
    fn needs(&self) -> Needs {
        Needs::mass(MassMode::AllRows)
    }
    fn prepare(&mut self, _m: &ModelView<'_>, cache: CacheShape) -> Result<()> {
        self.acc = vec![0.0; cache.n_slots];
        Ok(())
    }
    fn observe(&mut self, step: &Step<'_>) {
        // The step's mass already includes the new rows' own attention to
        // the new slots; start them from zero before adding it.
        for &s in step.slots {
            self.acc[s as usize] = 0.0;
        }
        if let Some(mass) = step.mass {
            for (a, &m) in self.acc.iter_mut().zip(mass) {
                *a += m;
            }
        }
    }
    fn relocate(&mut self, map: &[(u32, u32)], n_slots: usize) {
        super::relocate_slots(&mut self.acc, 1, map, n_slots);
    }
    fn score(&mut self, ctx: &ScoreCtx<'_>, out: &mut [f32]) {
        if let Entries::Tokens { slots, .. } = ctx.entries {
            for (o, &s) in out.iter_mut().zip(slots) {
                *o = self.acc[s as usize];
            }
        }
    }
    fn reset(&mut self) {
        self.acc.fill(0.0);
    }
}
