//! `random`: uniform random scores (seeded with `-s`), drawn once per token
//! when it is written. A floor for comparisons; with sinks and a recent
//! window it is a surprisingly strong sanity baseline (kvpress RandomPress).

use super::{CacheShape, Entries, ModelView, ScoreCtx, Scorer, Step};
use crate::error::Result;
use crate::sample::Rng;

/// Seeded random score per slot.
#[derive(Debug)]
pub struct Random {
    score: Vec<f32>,
    rng: Rng,
    seed: u64,
}

impl Random {
    /// Scores drawn from a generator seeded with `seed`.
    pub fn new(seed: u64) -> Random {
        Random {
            score: Vec::new(),
            rng: Rng::new(seed),
            seed,
        }
    }
}

impl Scorer for Random {
    fn prepare(&mut self, _m: &ModelView<'_>, cache: CacheShape) -> Result<()> {
        self.score = vec![0.0; cache.n_slots];
        Ok(())
    }
    fn observe(&mut self, step: &Step<'_>) {
        for &s in step.slots {
            self.score[s as usize] = self.rng.next_f64() as f32;
        }
    }
    fn relocate(&mut self, map: &[(u32, u32)], n_slots: usize) {
        super::relocate_slots(&mut self.score, 1, map, n_slots);
    }
    fn score(&mut self, ctx: &ScoreCtx<'_>, out: &mut [f32]) {
        if let Entries::Tokens { slots, .. } = ctx.entries {
            for (o, &s) in out.iter_mut().zip(slots) {
                *o = self.score[s as usize];
            }
        }
    }
    fn reset(&mut self) {
        self.rng = Rng::new(self.seed);
    }
}
