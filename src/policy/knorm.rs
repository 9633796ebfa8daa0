//! `knorm`: keep low-norm keys (Devoto et al., 2024, "A Simple and Effective
//! L2 Norm-Based Strategy for KV Cache Compression", arXiv 2406.11430).
//!
//! Idea: keys with a low L2 norm tend to receive high attention. Score =
//! −‖k‖₂ of the stored (post-RoPE) key, averaged over layers and KV heads,
//! computed once when the token is written. Attention-free.

use super::{CacheShape, Entries, ModelView, ScoreCtx, Scorer, Step};
use crate::error::Result;

/// −mean‖k‖ per slot.
#[derive(Debug, Default)]
pub struct KNorm {
    /// (n_slots,) score computed at write time.
    score: Vec<f32>,
    /// (kv_dim,) one key row.
    row: Vec<f32>,
}

impl Scorer for KNorm {
    fn prepare(&mut self, m: &ModelView<'_>, cache: CacheShape) -> Result<()> {
        self.score = vec![0.0; cache.n_slots];
        self.row = vec![0.0; m.config().kv_dim()];
        Ok(())
    }
    fn observe(&mut self, step: &Step<'_>) {
        let kv = step.kv;
        let hd = kv.head_dim;
        let row = &mut self.row;
        row.resize(kv.kv_dim, 0.0);
        for &s in step.slots {
            let mut total = 0f32;
            let mut n = 0;
            for l in 0..kv.n_layers {
                kv.k_f32(l, s as usize, row);
                for k in row.chunks_exact(hd) {
                    total += k.iter().map(|x| x * x).sum::<f32>().sqrt();
                    n += 1;
                }
            }
            self.score[s as usize] = -total / n as f32;
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
}
