//! `epikv-seg` (EpiKV-Seg; the reference code's `KVSegHSEviction`): segment
//! caps by key variance, Flat ranking inside segments.
//!
//! The evictable decode tokens (after the prompt, before the recent window)
//! are cut into segments of 128 in position order. A segment's statistic is
//! the mean over its tokens of the key variance over head_dim (averaged over
//! layers and KV heads, computed once per token at write time). Segments are
//! split into tertiles by descending statistic: R (top third), E, T, with
//! keep caps 64 / 32 / 8 tokens per segment, spent left to right until the
//! decode budget runs out; inside a segment the tokens with the highest
//! `epikv` (Flat) score are the ones kept.
//!
//! kvrun's evictor keeps the cache full, so the caps order eviction rather
//! than forcing the cache below budget: tokens outside every cap go first
//! (lowest Flat score first), then capped tokens. The reference code keeps
//! fewer tokens than the budget when the caps bind.

use super::flat::Flat;
use crate::kv::KvCache;

/// Segment length.
pub const SEGMENT: usize = 128;
/// Keep caps of the R, E, T tertiles.
pub const CAPS: [usize; 3] = [64, 32, 8];
/// Added to the score of a token inside its segment's cap.
const KEPT: f32 = 1.0e6;

/// What `score` needs to know about protection.
#[derive(Debug, Clone, Copy)]
pub struct SegContext {
    /// First non-prompt position.
    pub prompt_end: i64,
    /// Newest live position.
    pub newest: i64,
    pub n_recent: usize,
    pub budget: usize,
}

/// Flat scores plus per-slot key variance.
#[derive(Debug)]
pub struct Seg {
    pub flat: Flat,
    /// (n_slots,) key variance over head_dim, mean over layers and heads.
    kvar: Vec<f32>,
}

impl Seg {
    /// Flat scorer `flat`, `n_slots` slots.
    pub fn new(flat: Flat, n_slots: usize) -> Seg {
        Seg {
            flat,
            kvar: vec![0.0; n_slots],
        }
    }

    /// Follow a cache re-layout (see `Scorer::relocate`).
    pub fn relocate(&mut self, map: &[(u32, u32)], n_slots: usize) {
        crate::policy::relocate_slots(&mut self.kvar, 1, map, n_slots);
    }

    /// Key variance of the new tokens.
    pub fn on_write(&mut self, kv: &KvCache, slots: &[u32]) {
        let hd = kv.head_dim;
        let mut row = vec![0f32; kv.kv_dim];
        for &s in slots {
            let (mut total, mut n) = (0f32, 0usize);
            for l in 0..kv.n_layers {
                kv.k_f32(l, s as usize, &mut row);
                for k in row.chunks_exact(hd) {
                    let m = k.iter().sum::<f32>() / hd as f32;
                    total += k.iter().map(|x| (x - m).powi(2)).sum::<f32>() / hd as f32;
                    n += 1;
                }
            }
            self.kvar[s as usize] = total / n.max(1) as f32;
        }
    }

    /// Scores of the live `slots` (position order, `pos`) given each slot's
    /// frozen Flat score `flat`.
    pub fn score(
        &self,
        flat: &[f32],
        slots: &[u32],
        pos: &[i64],
        ctx: &SegContext,
        out: &mut [f32],
    ) {
        for (o, &s) in out.iter_mut().zip(slots) {
            *o = flat[s as usize];
        }
        // evictable decode tokens, position order
        let lo = pos.partition_point(|&p| p < ctx.prompt_end);
        let hi = pos
            .partition_point(|&p| p <= ctx.newest - ctx.n_recent as i64)
            .max(lo);
        let n_protected = slots.len() - (hi - lo);
        let mut room = ctx.budget.saturating_sub(n_protected + 1);
        let segs: Vec<(usize, usize)> = (lo..hi)
            .step_by(SEGMENT)
            .map(|a| (a, (a + SEGMENT).min(hi)))
            .collect();
        // tertile of each segment by descending mean key variance
        let stat: Vec<f32> = segs
            .iter()
            .map(|&(a, b)| {
                slots[a..b]
                    .iter()
                    .map(|&s| self.kvar[s as usize])
                    .sum::<f32>()
                    / (b - a) as f32
            })
            .collect();
        let mut order: Vec<usize> = (0..segs.len()).collect();
        order.sort_by(|&x, &y| stat[y].total_cmp(&stat[x]).then(x.cmp(&y)));
        let mut tier = vec![2usize; segs.len()];
        for (rank, &si) in order.iter().enumerate() {
            tier[si] = (rank * 3 / segs.len().max(1)).min(2);
        }
        let mut idx: Vec<usize> = Vec::with_capacity(SEGMENT);
        for (si, &(a, b)) in segs.iter().enumerate() {
            let keep = CAPS[tier[si]].min(b - a).min(room);
            room -= keep;
            idx.clear();
            idx.extend(a..b);
            idx.sort_by(|&x, &y| out[y].total_cmp(&out[x]).then(x.cmp(&y)));
            for &i in &idx[..keep] {
                out[i] += KEPT;
            }
        }
    }
}
