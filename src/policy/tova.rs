//! `tova`: Token Omission Via Attention (Oren et al., 2024, "Transformers
//! are Multi-State RNNs", arXiv 2401.06104).
//!
//! Idea: keep the tokens the current query attends to most. Score = the last
//! query row's attention probability, averaged over every head and layer
//! (the official code averages heads per layer; kvrun's cache is
//! token-uniform, so layers are averaged too). No sinks in the paper: use
//! `--kv-sink 0` to match it exactly.

use super::{CacheShape, Entries, ModelView, ScoreCtx, Scorer, Step};
use crate::error::Result;
use crate::signals::{MassMode, Needs};

/// Last-row attention per slot.
#[derive(Debug, Default)]
pub struct Tova {
    /// (n_slots,) attention of the most recent query row.
    last: Vec<f32>,
}

impl Scorer for Tova {
    fn needs(&self) -> Needs {
        Needs::mass(MassMode::LastRow)
    }
    fn prepare(&mut self, _m: &ModelView<'_>, cache: CacheShape) -> Result<()> {
        self.last = vec![0.0; cache.n_slots];
        Ok(())
    }
    fn observe(&mut self, step: &Step<'_>) {
        if let Some(mass) = step.mass {
            let n = self.last.len();
            self.last.copy_from_slice(&mass[..n]);
        }
    }
    fn relocate(&mut self, map: &[(u32, u32)], n_slots: usize) {
        super::relocate_slots(&mut self.last, 1, map, n_slots);
    }
    fn score(&mut self, ctx: &ScoreCtx<'_>, out: &mut [f32]) {
        if let Entries::Tokens { slots, .. } = ctx.entries {
            for (o, &s) in out.iter_mut().zip(slots) {
                *o = self.last[s as usize];
            }
        }
    }
    fn reset(&mut self) {
        self.last.fill(0.0);
    }
}
