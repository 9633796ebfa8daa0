//! `epikv-lag` (the reference code's `LagKVEviction`, "37% on AIME-2024 at
//! 8192"): lag-normalized K/V statistics, a causal adaptation of LagKV.
//!
//! At each eviction event, over the current cache in position order: K̄, V̄ =
//! keys / values averaged over layers, (n_kv_heads, n, head_dim). Positions
//! are cut into chunks of 128; chunk c ≥ 1 is normalized per head and
//! channel by the min/max of chunk c−1, x' = (x − min)/(max − min + 1e-9);
//! a token's statistic is the std over head_dim of x', averaged over heads
//! (chunk 0 uses the raw std). Score = stat(K̄) + stat(V̄). Attention-free.
//!
//! Speed (exact, incremental): K̄ and V̄ of a token never change, so they are
//! computed once at write time (removing the layer factor from every
//! eviction), and chunks that lie wholly before the first change of the
//! live order since the last event keep their scores.

use crate::kv::KvCache;

/// Chunk length.
pub const CHUNK: usize = 128;
const NORM_EPS: f32 = 1e-9;

/// Per-slot layer-mean keys/values and the last event's scores.
#[derive(Debug)]
pub struct Lag {
    kv_dim: usize,
    head_dim: usize,
    /// (n_slots, kv_dim) keys averaged over layers.
    kbar: Vec<f32>,
    /// (n_slots, kv_dim) values averaged over layers.
    vbar: Vec<f32>,
    /// Live slots (position order) at the last event, and their scores.
    last_live: Vec<u32>,
    last_score: Vec<f32>,
}

impl Lag {
    /// State for `n_slots` slots of width `kv_dim`.
    pub fn new(n_slots: usize, kv_dim: usize) -> Lag {
        Lag {
            kv_dim,
            head_dim: kv_dim,
            kbar: vec![0.0; n_slots * kv_dim],
            vbar: vec![0.0; n_slots * kv_dim],
            last_live: Vec::new(),
            last_score: Vec::new(),
        }
    }

    /// Follow a cache re-layout (see `Scorer::relocate`); the last event's
    /// scores are dropped (recomputed at the next event).
    pub fn relocate(&mut self, map: &[(u32, u32)], n_slots: usize) {
        crate::policy::relocate_slots(&mut self.kbar, self.kv_dim, map, n_slots);
        crate::policy::relocate_slots(&mut self.vbar, self.kv_dim, map, n_slots);
        self.clear();
    }

    /// Forget the sequence.
    pub fn clear(&mut self) {
        self.last_live.clear();
        self.last_score.clear();
    }

    /// Average the new tokens' keys and values over layers.
    pub fn on_write(&mut self, kv: &KvCache, slots: &[u32]) {
        let d = self.kv_dim;
        self.head_dim = kv.head_dim;
        let inv = 1.0 / kv.n_layers as f32;
        let (mut kr, mut vr) = (vec![0f32; d], vec![0f32; d]);
        for &s in slots {
            let s = s as usize;
            let (kb, vb) = (
                &mut self.kbar[s * d..(s + 1) * d],
                &mut self.vbar[s * d..(s + 1) * d],
            );
            kb.fill(0.0);
            vb.fill(0.0);
            for l in 0..kv.n_layers {
                kv.k_f32(l, s, &mut kr);
                kv.v_f32(l, s, &mut vr);
                for ((a, b), (k, v)) in kb.iter_mut().zip(vb.iter_mut()).zip(kr.iter().zip(&vr)) {
                    *a += k;
                    *b += v;
                }
            }
            kb.iter_mut().chain(vb.iter_mut()).for_each(|x| *x *= inv);
        }
    }

    /// Scores of `slots` (live, position order) into `out`.
    pub fn score(&mut self, slots: &[u32], out: &mut [f32]) {
        let n = slots.len();
        // first index where the live order changed since the last event
        let same = self
            .last_live
            .iter()
            .zip(slots)
            .take_while(|(a, b)| a == b)
            .count()
            .min(self.last_score.len());
        let c0 = same / CHUNK;
        out[..c0 * CHUNK].copy_from_slice(&self.last_score[..c0 * CHUNK]);
        for c in c0..n.div_ceil(CHUNK) {
            let (i0, i1) = (c * CHUNK, ((c + 1) * CHUNK).min(n));
            let prev = if c == 0 {
                None
            } else {
                Some(&slots[(c - 1) * CHUNK..c * CHUNK])
            };
            for o in &mut out[i0..i1] {
                *o = 0.0;
            }
            for bar in [&self.kbar, &self.vbar] {
                chunk_stat(
                    bar,
                    self.kv_dim,
                    self.head_dim,
                    prev,
                    &slots[i0..i1],
                    &mut out[i0..i1],
                );
            }
        }
        self.last_live.clear();
        self.last_live.extend_from_slice(slots);
        self.last_score.clear();
        self.last_score.extend_from_slice(&out[..n]);
    }
}

/// Add to `out[j]` the statistic of token `slots[j]`: std over head_dim of
/// its (normalized by `prev`'s per-channel min/max, when given) vector,
/// averaged over heads. `bar` is (n_slots, kv_dim).
pub fn chunk_stat(
    bar: &[f32],
    kv_dim: usize,
    head_dim: usize,
    prev: Option<&[u32]>,
    slots: &[u32],
    out: &mut [f32],
) {
    let row = |s: u32| &bar[s as usize * kv_dim..(s as usize + 1) * kv_dim];
    // per-channel min and 1/(max − min + ε) of the reference chunk
    let (mut lo, mut inv) = (vec![0f32; kv_dim], vec![1f32; kv_dim]);
    if let Some(p) = prev {
        let mut hi = vec![f32::NEG_INFINITY; kv_dim];
        lo.fill(f32::INFINITY);
        for &s in p {
            for ((l, h), &x) in lo.iter_mut().zip(hi.iter_mut()).zip(row(s)) {
                *l = l.min(x);
                *h = h.max(x);
            }
        }
        for ((i, &l), &h) in inv.iter_mut().zip(&lo).zip(&hi) {
            *i = 1.0 / (h - l + NORM_EPS);
        }
    }
    let n_heads = kv_dim / head_dim;
    for (o, &s) in out.iter_mut().zip(slots) {
        let x = row(s);
        let mut total = 0f32;
        for h in 0..n_heads {
            let r = h * head_dim..(h + 1) * head_dim;
            let (mut sum, mut sumsq) = (0f32, 0f32);
            for ((&x, &l), &i) in x[r.clone()].iter().zip(&lo[r.clone()]).zip(&inv[r]) {
                let y = (x - l) * i;
                sum += y;
                sumsq += y * y;
            }
            let m = sum / head_dim as f32;
            total += (sumsq / head_dim as f32 - m * m).max(0.0).sqrt();
        }
        *o += total / n_heads as f32;
    }
}
