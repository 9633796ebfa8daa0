//! `knorm`: keep low-norm keys (Devoto et al., 2024, "A Simple and Effective
//! L2 Norm-Based Strategy for KV Cache Compression", arXiv 2406.11430).
//!
//! Idea: keys with a low L2 norm tend to receive high attention. Score =
//! −‖k‖₂ of the stored (post-RoPE) key, averaged over layers and KV heads,
//! computed once when the token is written. Attention-free.

use super::Scorer;
use crate::kv::KvCache;

/// −mean‖k‖ per slot.
#[derive(Debug)]
pub struct KNorm {
    /// (n_slots,) score computed at write time.
    score: Vec<f32>,
}

impl KNorm {
    /// State for `n_slots` slots.
    pub fn new(n_slots: usize) -> KNorm {
        KNorm {
            score: vec![0.0; n_slots],
        }
    }
}

impl Scorer for KNorm {
    fn name(&self) -> &'static str {
        "knorm"
    }
    fn on_write(&mut self, kv: &KvCache, slots: &[u32], _pos: &[i64]) {
        let hd = kv.head_dim;
        let mut row = vec![0f32; kv.kv_dim];
        for &s in slots {
            let mut total = 0f32;
            let mut n = 0;
            for l in 0..kv.n_layers {
                kv.k_f32(l, s as usize, &mut row);
                for k in row.chunks_exact(hd) {
                    total += k.iter().map(|x| x * x).sum::<f32>().sqrt();
                    n += 1;
                }
            }
            self.score[s as usize] = -total / n as f32;
        }
    }
    fn score(&mut self, _kv: &KvCache, slots: &[u32], _pos: &[i64], out: &mut [f32]) {
        for (o, &s) in out.iter_mut().zip(slots) {
            *o = self.score[s as usize];
        }
    }
}
