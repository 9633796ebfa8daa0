//! `tova`: Token Omission Via Attention (Oren et al., 2024, "Transformers
//! are Multi-State RNNs", arXiv 2401.06104).
//!
//! Idea: keep the tokens the current query attends to most. Score = the last
//! query row's attention probability, averaged over every head and layer
//! (the official code averages heads per layer; kvrun's cache is
//! token-uniform, so layers are averaged too). No sinks in the paper: use
//! `--kv-sink 0` to match it exactly.

use super::Scorer;
use crate::kv::KvCache;
use crate::model::llama::MassMode;

/// Last-row attention per slot.
#[derive(Debug)]
pub struct Tova {
    /// (n_slots,) attention of the most recent query row.
    last: Vec<f32>,
}

impl Tova {
    /// State for `n_slots` slots.
    pub fn new(n_slots: usize) -> Tova {
        Tova {
            last: vec![0.0; n_slots],
        }
    }
}

impl Scorer for Tova {
    fn name(&self) -> &'static str {
        "tova"
    }
    fn mass_mode(&self) -> MassMode {
        MassMode::LastRow
    }
    fn observe(&mut self, mass: &[f32]) {
        let n = self.last.len();
        self.last.copy_from_slice(&mass[..n]);
    }
    fn score(&mut self, _kv: &KvCache, slots: &[u32], _pos: &[i64], out: &mut [f32]) {
        for (o, &s) in out.iter_mut().zip(slots) {
            *o = self.last[s as usize];
        }
    }
    fn reset(&mut self) {
        self.last.fill(0.0);
    }
}
