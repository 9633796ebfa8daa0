//! `thinkv`: thought-adaptive KV compression (Ramachandran et al., 2025,
//! "ThinKV: Thought-Adaptive KV Cache Compression for Efficient Reasoning
//! Models", arXiv 2510.01290), as the EPIKV harness re-implements it
//! (POLICIES.md §5.12; no official code is public).
//!
//! Idea: a reasoning trace is a sequence of thoughts of different kinds —
//! reasoning (R), execution (E), transition (T) — that deserve different
//! shares of the cache. Positions are cut into segments of 128 tokens;
//! each segment is classified by the entropy of the current query's
//! attention over its tokens (normalized within the segment), by tertiles
//! over the live segments; each class has a keep cap per segment (R 64,
//! E 32, T 8), and inside a segment tokens are ranked by the attention they
//! accumulated (column sums, as H2O).
//!
//! Signals: attention mass summed over each step's rows and averaged over
//! every head and layer (`MassMode::AllRows`, from the fused attention; no
//! attention matrix): accumulated per slot (the within-segment ranking)
//! and kept as the last step's row (for a decode step, exactly the current
//! query's attention: the classification).
//!
//! Selection as scores for the shared evictor (lowest first):
//! - a token beyond its segment's cap: class + t(acc), in [0, 3);
//! - a token within its cap: 4 + class + t(acc), in [4, 7);
//!
//! with class T = 0, E = 1, R = 2 and t(x) = x / (1 + x) (monotone, below
//! 1). So overflow beyond the caps goes first (T segments' first), then, if
//! the budget still demands it, capped tokens of T, E and R segments in
//! that order, each by accumulated attention.
//!
//! Choices (the harness is not public in full):
//! - low entropy → R, middle → E, high → T: a segment on which the current
//!   query's attention concentrates holds tokens still in use and gets the
//!   largest cap; a segment attended diffusely is a transition. Ties
//!   between equal entropies: the later segment ranks as lower entropy.
//! - the harness reads the last 4 layers; kvrun's mass export averages
//!   every layer (one signal for every mass-based policy; a per-layer
//!   export would be a new signal).
//! - classes are recomputed at every eviction event from the last step's
//!   attention (the harness's simple variant; its "faithful" KDE variant
//!   refreshing every 128 steps is not reproduced);
//! - a prefill chunk's mass is the sum over its rows (the classification
//!   uses that distribution until the first decode step).
//!
//! Protection: sinks 4, recent window min(128, budget/4) (the harness's 128).

use super::{CacheShape, Entries, ModelView, ScoreCtx, Scorer, Step};
use crate::error::Result;
use crate::signals::{MassMode, Needs};

/// Segment length.
pub const SEGMENT: i64 = 128;
/// Keep caps per segment of the classes T, E, R.
pub const CAPS: [usize; 3] = [8, 32, 64];

/// Accumulated and last-step attention per slot.
#[derive(Debug, Default)]
pub struct ThinKv {
    /// (n_slots,) attention received since written.
    acc: Vec<f32>,
    /// (n_slots,) attention of the last step.
    last: Vec<f32>,
    /// Scratch: (segment start index, entropy) and ranks.
    segs: Vec<(usize, f32)>,
    order: Vec<usize>,
}

/// Entropy of `w` normalized to sum 1 (0 for an all-zero `w`).
pub fn entropy(w: impl Iterator<Item = f32> + Clone) -> f32 {
    let sum: f32 = w.clone().sum();
    if sum <= 0.0 {
        return 0.0;
    }
    -w.filter(|&x| x > 0.0)
        .map(|x| {
            let p = x / sum;
            p * p.ln()
        })
        .sum::<f32>()
}

/// The classes (0 = T, 1 = E, 2 = R) of segments with entropies `h`:
/// tertiles of the entropy, the lowest third R, the highest T. Ties: the
/// later segment ranks lower.
pub fn classes(h: &[f32], out: &mut Vec<u8>) {
    let n = h.len();
    let mut idx: Vec<usize> = (0..n).collect();
    // ascending entropy; equal: later first
    idx.sort_by(|&a, &b| h[a].total_cmp(&h[b]).then(b.cmp(&a)));
    out.clear();
    out.resize(n, 0);
    for (rank, &i) in idx.iter().enumerate() {
        // rank 0..n/3 → R, .. 2n/3 → E, rest → T
        out[i] = match rank * 3 / n.max(1) {
            0 => 2,
            1 => 1,
            _ => 0,
        };
    }
}

impl Scorer for ThinKv {
    fn needs(&self) -> Needs {
        Needs::mass(MassMode::AllRows)
    }
    fn prepare(&mut self, _m: &ModelView<'_>, cache: CacheShape) -> Result<()> {
        self.acc = vec![0.0; cache.n_slots];
        self.last = vec![0.0; cache.n_slots];
        Ok(())
    }
    fn observe(&mut self, step: &Step<'_>) {
        for &s in step.slots {
            self.acc[s as usize] = 0.0;
        }
        if let Some(mass) = step.mass {
            for ((a, l), &m) in self.acc.iter_mut().zip(self.last.iter_mut()).zip(mass) {
                *a += m;
                *l = m;
            }
        }
    }
    fn score(&mut self, ctx: &ScoreCtx<'_>, out: &mut [f32]) {
        let Entries::Tokens { slots, pos } = ctx.entries else {
            return;
        };
        let n = slots.len();
        // segments: runs of live tokens sharing pos / SEGMENT
        self.segs.clear();
        let mut i = 0;
        while i < n {
            let seg = pos[i] / SEGMENT;
            let j = i + pos[i..].partition_point(|&p| p / SEGMENT == seg);
            let h = entropy(slots[i..j].iter().map(|&s| self.last[s as usize]));
            self.segs.push((i, h));
            i = j;
        }
        let h: Vec<f32> = self.segs.iter().map(|s| s.1).collect();
        let mut cls = Vec::new();
        classes(&h, &mut cls);
        for (k, &(i0, _)) in self.segs.iter().enumerate() {
            let i1 = self.segs.get(k + 1).map_or(n, |s| s.0);
            let c = cls[k];
            let cap = CAPS[c as usize];
            // rank inside the segment by accumulated attention (desc; ties: newer first)
            self.order.clear();
            self.order.extend(i0..i1);
            let acc = &self.acc;
            self.order.sort_by(|&a, &b| {
                acc[slots[b] as usize]
                    .total_cmp(&acc[slots[a] as usize])
                    .then(b.cmp(&a))
            });
            for (r, &j) in self.order.iter().enumerate() {
                let a = acc[slots[j] as usize].max(0.0);
                let t = a / (1.0 + a);
                let base = if r < cap { 4.0 } else { 0.0 };
                out[j] = base + c as f32 + t;
            }
        }
    }
    fn relocate(&mut self, map: &[(u32, u32)], n_slots: usize) {
        super::relocate_slots(&mut self.acc, 1, map, n_slots);
        super::relocate_slots(&mut self.last, 1, map, n_slots);
    }
    fn reset(&mut self) {
        self.acc.fill(0.0);
        self.last.fill(0.0);
    }
}
