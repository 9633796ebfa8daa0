//! `random`: uniform random scores (seeded with `-s`), drawn once per token
//! when it is written. A floor for comparisons; with sinks and a recent
//! window it is a surprisingly strong sanity baseline (kvpress RandomPress).

use super::Scorer;
use crate::kv::KvCache;
use crate::sample::Rng;

/// Seeded random score per slot.
#[derive(Debug)]
pub struct Random {
    score: Vec<f32>,
    rng: Rng,
    seed: u64,
}

impl Random {
    /// State for `n_slots` slots.
    pub fn new(n_slots: usize, seed: u64) -> Random {
        Random {
            score: vec![0.0; n_slots],
            rng: Rng::new(seed),
            seed,
        }
    }
}

impl Scorer for Random {
    fn name(&self) -> &'static str {
        "random"
    }
    fn on_write(&mut self, _kv: &KvCache, slots: &[u32], _pos: &[i64]) {
        for &s in slots {
            self.score[s as usize] = self.rng.next_f64() as f32;
        }
    }
    fn score(&mut self, _kv: &KvCache, slots: &[u32], _pos: &[i64], out: &mut [f32]) {
        for (o, &s) in out.iter_mut().zip(slots) {
            *o = self.score[s as usize];
        }
    }
    fn reset(&mut self) {
        self.rng = Rng::new(self.seed);
    }
}
