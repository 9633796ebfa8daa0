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

use super::Scorer;
use crate::kv::KvCache;
use crate::model::llama::MassMode;

/// Accumulated attention per slot.
#[derive(Debug)]
pub struct H2o {
    /// (n_slots,) attention received since the slot was written.
    acc: Vec<f32>,
}

impl H2o {
    /// State for `n_slots` slots.
    pub fn new(n_slots: usize) -> H2o {
        H2o {
            acc: vec![0.0; n_slots],
        }
    }
}

impl Scorer for H2o {
    fn name(&self) -> &'static str {
        "h2o"
    }
    fn mass_mode(&self) -> MassMode {
        MassMode::AllRows
    }
    fn on_write(&mut self, _kv: &KvCache, slots: &[u32], _pos: &[i64]) {
        // The step's mass (observed next) already includes the new rows' own
        // attention to the new slots; start them from zero before it arrives.
        for &s in slots {
            self.acc[s as usize] = 0.0;
        }
    }
    fn observe(&mut self, mass: &[f32]) {
        for (a, &m) in self.acc.iter_mut().zip(mass) {
            *a += m;
        }
    }
    fn score(&mut self, _kv: &KvCache, slots: &[u32], _pos: &[i64], out: &mut [f32]) {
        for (o, &s) in out.iter_mut().zip(slots) {
            *o = self.acc[s as usize];
        }
    }
    fn reset(&mut self) {
        self.acc.fill(0.0);
    }
}
