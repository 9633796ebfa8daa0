//! `rkv`: R-KV, redundancy-aware KV compression for reasoning traces (Cai
//! et al., 2025, "R-KV: Redundancy-aware KV Cache Compression for
//! Reasoning Models", arXiv 2505.24133; reference code Zefan-Cai/R-KV).
//!
//! Idea: a reasoning trace repeats itself; an entry that is both little
//! attended to and similar to many other cached keys can go. Per (layer,
//! KV head) stream, at every eviction event:
//!
//! - importance I_j: the last α query rows (the observation window,
//!   post-RoPE, from the forward pass) against every visible key j outside
//!   the window; the g query heads of the GQA group are reduced by the MAX of
//!   their raw logits (R-KV's `pooling="max"`), softmax over the non-window
//!   keys a row can see, mean over the rows, then 1-D max pooling (kernel 7)
//!   along the stream;
//! - redundancy R_j: the mean cosine similarity of key j with the other
//!   cached keys of the stream, m_j = (k̂_j · Σ_i k̂_i − 1) / n (k̂ = the
//!   L2-normalized key; the −1 removes j's own term, the zeroed diagonal of
//!   the original's similarity matrix), then R = softmax_j(m) over the stream;
//! - score Z_j = λ·I_j − (1 − λ)·R_j; the window's own entries are kept
//!   (+∞).
//!
//! Approximation (documented, deliberate): the original builds the n×n
//! cosine matrix S and, for every row i, zeroes S_ij of the most recent j
//! with S_ij > τ = 0.5 (so the newest near-duplicate of i is not penalized
//! by i). kvrun never builds an n×n matrix: the identity above gives the
//! row means in O(n·d) from one sum of normalized keys, but cannot apply
//! the "most recent duplicate" rule, so the newest copy of a repeated
//! passage is penalized like the older copies (R-KV's own ablation shows
//! the mean similarity carries the signal; the rule only re-ranks
//! duplicates among themselves).
//!
//! Parameters: `--obs-window` α (default 8, the README's), `--pool-kernel`
//! (default 7, max pooling), `--rkv-lambda` λ (default 0.1, the README's;
//! run_math.py uses 0.07). Cadence: R-KV compresses every 128 generated
//! tokens back to the budget; kvrun keeps the budget at every moment and
//! frees `--evict-every` entries per stream at each event (default
//! budget/8, at most 128: the same buffer at budgets ≥ 1024). Recent window
//! default: the observation window α (the original keeps the last α).

use super::streams::for_each_wanted;
use super::{Entries, ScoreCtx, Scorer};
use crate::error::{Error, Field, Result};
use crate::signals::Needs;

/// R-KV's options.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RkvOptions {
    /// Observation-window rows α.
    pub window: usize,
    /// Max-pooling kernel over the importance (odd; 1 = none).
    pub kernel: usize,
    /// Weight λ of importance against redundancy.
    pub lambda: f32,
}

impl Default for RkvOptions {
    fn default() -> Self {
        RkvOptions {
            window: 8,
            kernel: 7,
            lambda: 0.1,
        }
    }
}

impl RkvOptions {
    /// Check the ranges (window ≥ 1, kernel odd, λ in 0..=1).
    pub fn check(&self) -> Result<()> {
        if self.window == 0 {
            return Err(Error::config(Field::ObsWindow, "must be at least 1"));
        }
        if self.kernel.is_multiple_of(2) {
            return Err(Error::config(
                Field::PoolKernel,
                format!("must be odd (1 = no pooling), got {}", self.kernel),
            ));
        }
        if !(0.0..=1.0).contains(&self.lambda) {
            return Err(Error::config(
                Field::RkvLambda,
                format!("must be in 0..1, got {}", self.lambda),
            ));
        }
        Ok(())
    }
}

/// Per-thread scratch of one stream.
#[derive(Default)]
struct Scratch {
    /// (hd, n) keys, transposed.
    kt: Vec<f32>,
    /// (n, hd) keys.
    rows: Vec<f32>,
    /// (n,) logits of one query head, and their group max.
    lg: Vec<f32>,
    mx: Vec<f32>,
    /// (n,) importance and redundancy.
    imp: Vec<f32>,
    red: Vec<f32>,
}

/// The mean cosine similarity of each key of `rows` ((n, hd)) with the
/// others, m_j = (k̂_j · Σ_i k̂_i − 1) / n, into `m` (n,). Exact for
/// non-zero keys (a zero key counts as orthogonal to everything).
pub fn mean_cosine(rows: &[f32], hd: usize, m: &mut Vec<f32>) {
    let n = rows.len() / hd;
    let mut sum = vec![0f64; hd];
    let inv_norm = |k: &[f32]| {
        let s: f32 = k.iter().map(|x| x * x).sum();
        if s > 0.0 {
            1.0 / s.sqrt()
        } else {
            0.0
        }
    };
    for k in rows.chunks_exact(hd) {
        let r = inv_norm(k);
        for (a, &x) in sum.iter_mut().zip(k) {
            *a += (x * r) as f64;
        }
    }
    m.clear();
    for k in rows.chunks_exact(hd) {
        let r = inv_norm(k);
        let dot: f64 = k.iter().zip(&sum).map(|(&x, &s)| (x * r) as f64 * s).sum();
        // j's own term is 1 for a non-zero key, 0 for a zero key
        let own = if r > 0.0 { 1.0 } else { 0.0 };
        m.push(((dot - own) / n as f64) as f32);
    }
}

/// In-place softmax of `x` (empty: nothing).
pub fn softmax(x: &mut [f32]) {
    let m = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let mut sum = 0f32;
    for v in x.iter_mut() {
        *v = (*v - m).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    x.iter_mut().for_each(|v| *v *= inv);
}

/// 1-D max pooling of `x` with an odd `kernel` (window clipped at the ends).
pub fn max_pool(x: &mut [f32], kernel: usize, tmp: &mut Vec<f32>) {
    if kernel <= 1 {
        return;
    }
    let half = kernel / 2;
    tmp.clear();
    tmp.extend_from_slice(x);
    let n = x.len();
    for (j, y) in x.iter_mut().enumerate() {
        let (lo, hi) = (j.saturating_sub(half), (j + half + 1).min(n));
        *y = tmp[lo..hi].iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    }
}

/// R-KV scores per (layer, KV head) stream entry.
#[derive(Debug)]
pub struct Rkv {
    pub opts: RkvOptions,
}

impl Scorer for Rkv {
    fn needs(&self) -> Needs {
        Needs::queries(self.opts.window)
    }
    fn per_stream(&self) -> bool {
        true
    }
    fn score(&mut self, ctx: &ScoreCtx<'_>, out: &mut [f32]) {
        let (Entries::Streams { want, off, plan }, Some(qw)) =
            (ctx.entries, ctx.signals.queries.as_ref())
        else {
            return;
        };
        let Some(st) = ctx.kv.streams() else {
            return;
        };
        let (hd, nkv) = (ctx.kv.head_dim, plan.n_kv_heads);
        let group = qw.q_dim / hd / nkv;
        let o = self.opts;
        // the voting rows: the last α positions the window holds
        let lo = qw
            .last_pos()
            .map_or(i64::MIN, |p| super::snapkv::window_start(p, o.window));
        let rows: Vec<usize> = (0..qw.len()).filter(|&r| qw.row_pos(r) >= lo).collect();
        let first = rows
            .iter()
            .map(|&r| qw.row_pos(r))
            .min()
            .unwrap_or(i64::MAX);
        let scale = 1.0 / (hd as f32).sqrt();
        let kv = ctx.kv;
        for_each_wanted(ctx.pool, want, off, out, |s, a, sc: &mut Scratch| {
            let (l, g) = (s / nkv, s % nkv);
            let (slots, pos) = st.stream(s);
            let n = slots.len();
            if n == 0 {
                return;
            }
            // entries before the window are ranked; the window's are kept
            let nw = pos.partition_point(|&p| p < first);
            sc.rows.resize(n * hd, 0.0);
            kv.read_heads(true, l, g, slots, &mut sc.rows);
            sc.kt.resize(n * hd, 0.0);
            for (j, k) in sc.rows.chunks_exact(hd).enumerate() {
                for (d, &x) in k.iter().enumerate() {
                    sc.kt[d * n + j] = x;
                }
            }
            // importance: mean over rows of softmax(max over the group of the logits)
            sc.imp.clear();
            sc.imp.resize(nw, 0.0);
            let inv_rows = 1.0 / rows.len().max(1) as f32;
            for &r in &rows {
                let (q, qp) = qw.row(l, r);
                let nv = pos[..nw].partition_point(|&p| p <= qp);
                if nv == 0 {
                    continue;
                }
                sc.mx.clear();
                sc.mx.resize(nv, f32::NEG_INFINITY);
                sc.lg.resize(nv, 0.0);
                for h in 0..group {
                    let qh = &q[(g * group + h) * hd..(g * group + h + 1) * hd];
                    let x = &mut sc.lg[..nv];
                    x.fill(0.0);
                    for (d, &qd) in qh.iter().enumerate() {
                        let qd = qd * scale;
                        for (y, &k) in x.iter_mut().zip(&sc.kt[d * n..d * n + nv]) {
                            *y += qd * k;
                        }
                    }
                    for (m, &v) in sc.mx.iter_mut().zip(x.iter()) {
                        *m = m.max(v);
                    }
                }
                softmax(&mut sc.mx);
                for (y, &p) in sc.imp.iter_mut().zip(&sc.mx) {
                    *y += p * inv_rows;
                }
            }
            max_pool(&mut sc.imp, o.kernel, &mut sc.lg);
            // redundancy: softmax over the stream of the mean cosine similarity
            mean_cosine(&sc.rows, hd, &mut sc.red);
            softmax(&mut sc.red);
            for j in 0..n {
                a[j] = if j < nw {
                    o.lambda * sc.imp[j] - (1.0 - o.lambda) * sc.red[j]
                } else {
                    f32::INFINITY
                };
            }
        });
    }
}
