//! `snapkv`, `adakv`, `pyramidkv`: the observation-window scorer of SnapKV
//! (Li et al., 2024, "SnapKV: LLM Knows What You are Looking for Before
//! Generation", arXiv 2404.14469), per (layer, KV head), under three budget
//! rules (`budget.rs`): equal per stream (SnapKV), shared per layer with a
//! safeguard (Ada-KV), shrinking with depth (PyramidKV).
//!
//! Idea: the last few queries (the observation window) already attend to
//! what later queries will need. Each KV head keeps the tokens that the
//! window's queries vote for: score = softmax attention of every window row
//! (causal: a row sees keys at or before its position) averaged over the
//! rows and over the query heads of the GQA group (kvpress's mean reduction:
//! keys are never repeated per query head), smoothed by 1-D average pooling
//! along the stream (kernel 5, zero padding); the window's own tokens are
//! forced kept. Every (layer, KV head) stream keeps its tokens in its own
//! storage rows; scores are comparable across the heads of a layer
//! (softmax probabilities averaged the same way), which the shared budget
//! rules rely on.
//!
//! Cadence: the original compresses once after the prompt. kvrun keeps the
//! budget at every moment, so it scores whenever a stream is over budget,
//! with the window's queries at that time: between prefill chunks (the
//! prompt's last w queries so far) and during decoding (SnapKV-D: the last w
//! generated queries, as R-KV re-runs SnapKV while decoding). Each event
//! frees `--evict-every` tokens' worth per stream (default budget/8, at most
//! 128), so scoring is amortized.
//!
//! Parameters: `--obs-window` w = 32 (the original's window; kvpress uses
//! 64), `--pool-kernel` 5, `--adakv-safeguard` 0.2, `--pyramid-beta` 20;
//! the recent window defaults to w (`--kv-recent`), sinks 4. The queries
//! come from the forward pass (`QueryWindow`, declared in `needs`); no
//! attention matrix is stored: per stream the scratch is O(n).

use super::{Entries, ScoreCtx, Scorer};
use crate::backend::pool::{SharedMut, ThreadPool};
use crate::kv::KvCache;
use crate::signals::{Needs, QueryWindow};

/// Observation-window options shared by snapkv, adakv and pyramidkv.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SnapOptions {
    /// Query rows voting (w).
    pub window: usize,
    /// Average-pooling kernel (odd; 1 = none).
    pub kernel: usize,
    /// AdaKV: fraction of the per-head budget each head always keeps.
    pub safeguard: f32,
    /// PyramidKV: ratio of the largest to the smallest layer budget term.
    pub beta: f32,
}

impl Default for SnapOptions {
    fn default() -> Self {
        SnapOptions {
            window: 32,
            kernel: 5,
            safeguard: 0.2,
            beta: 20.0,
        }
    }
}

/// Fill `out` (laid out by `off`, see `streams::stream_offsets`) with the
/// observation-window score of every entry of every stream s with
/// `want[s]` (the others are left as they are), every row of `qw` voting.
pub fn window_scores(
    kv: &KvCache,
    qw: &QueryWindow,
    pool: &ThreadPool,
    kernel: usize,
    want: &[bool],
    off: &[usize],
    out: &mut [f32],
) {
    window_scores_last(kv, qw, qw.w, pool, kernel, want, off, out)
}

/// The first position of a window of `w` positions ending at `last`
/// (`last − w + 1`, saturating: any window longer than the text starts
/// before it).
pub fn window_start(last: i64, w: usize) -> i64 {
    last.saturating_sub(i64::try_from(w).unwrap_or(i64::MAX))
        .saturating_add(1)
}

/// `window_scores` with only the rows of the last `w` positions voting (a
/// window kept longer for another scorer holds more).
pub fn window_scores_last(
    kv: &KvCache,
    qw: &QueryWindow,
    w: usize,
    pool: &ThreadPool,
    kernel: usize,
    want: &[bool],
    off: &[usize],
    out: &mut [f32],
) {
    let Some(st) = kv.streams() else {
        return;
    };
    let (hd, nkv) = (kv.head_dim, st.n_kv_heads);
    let n_heads = qw.q_dim / hd;
    let group = n_heads / nkv;
    let ns = st.n_streams();
    let rows = qw.len();
    // the voting rows: positions lo..=last (all of them when the ring is w long)
    let lo = qw.last_pos().map_or(i64::MIN, |p| window_start(p, w));
    let n_votes = (0..rows).filter(|&r| qw.row_pos(r) >= lo).count();
    let scale = 1.0 / (hd as f32).sqrt();
    let first = qw.first_pos().map_or(i64::MAX, |p| p.max(lo));
    let nt = pool.n_threads();
    let outs = SharedMut::new(out);
    pool.run(|ti| {
        // per-thread scratch: (n, hd) f32 keys, (n,) logits, (n,) pooled
        let (mut kf, mut lg, mut tmp) = (Vec::new(), Vec::new(), Vec::new());
        // deal the wanted streams out round-robin
        for s in (0..ns).filter(|&s| want[s]).skip(ti).step_by(nt) {
            let (l, g) = (s / nkv, s % nkv);
            let (slots, pos) = st.stream(s);
            let n = slots.len();
            // SAFETY: stream s's range of `out` belongs to this thread.
            let a = unsafe { outs.slice(off[s], off[s + 1] - off[s]) };
            a.fill(0.0);
            if n == 0 {
                continue;
            }
            // keys transposed, (hd, n): each query's logits are then hd
            // vectorizable axpy passes over contiguous rows
            kf.resize(n * hd, 0.0);
            let mut row = [0f32; 256];
            for (j, &sl) in slots.iter().enumerate() {
                kv.head_f32(true, l, g, sl as usize, &mut row[..hd]);
                for (d, &x) in row[..hd].iter().enumerate() {
                    kf[d * n + j] = x;
                }
            }
            lg.resize(n, 0.0);
            let norm = 1.0 / (n_votes.max(1) * group) as f32;
            // a[j] = mean over window rows and group heads of softmax(q·k)[j]
            for r in 0..rows {
                let (q, qp) = qw.row(l, r);
                if qp < lo {
                    continue;
                }
                let nv = pos.partition_point(|&p| p <= qp);
                if nv == 0 {
                    continue;
                }
                for h in 0..group {
                    let qh = &q[(g * group + h) * hd..(g * group + h + 1) * hd];
                    let x = &mut lg[..nv];
                    x.fill(0.0);
                    for (d, &qd) in qh.iter().enumerate() {
                        let qd = qd * scale;
                        for (y, &k) in x.iter_mut().zip(&kf[d * n..d * n + nv]) {
                            *y += qd * k;
                        }
                    }
                    let m = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
                    let mut sum = 0f32;
                    for v in x.iter_mut() {
                        *v = (*v - m).exp();
                        sum += *v;
                    }
                    let w = norm / sum;
                    for (y, &v) in a[..nv].iter_mut().zip(x.iter()) {
                        *y += v * w;
                    }
                }
            }
            // average pooling along the stream (zero padding, divide by k)
            if kernel > 1 {
                let half = kernel / 2;
                tmp.clear();
                tmp.extend_from_slice(a);
                let inv = 1.0 / kernel as f32;
                for j in 0..n {
                    let (lo, hi) = (j.saturating_sub(half), (j + half + 1).min(n));
                    a[j] = tmp[lo..hi].iter().sum::<f32>() * inv;
                }
            }
            // the observation window's own tokens are kept
            for (y, &p) in a.iter_mut().zip(pos) {
                if p >= first {
                    *y = f32::INFINITY;
                }
            }
        }
    });
}

/// Observation-window votes per (layer, KV head) stream entry.
#[derive(Debug)]
pub struct SnapKv {
    pub opts: SnapOptions,
}

impl Scorer for SnapKv {
    fn needs(&self) -> Needs {
        Needs::queries(self.opts.window)
    }
    fn per_stream(&self) -> bool {
        true
    }
    fn score(&mut self, ctx: &ScoreCtx<'_>, out: &mut [f32]) {
        let (Entries::Streams { want, off, .. }, Some(qw)) =
            (ctx.entries, ctx.signals.queries.as_ref())
        else {
            return;
        };
        window_scores_last(
            ctx.kv,
            qw,
            self.opts.window,
            ctx.pool,
            self.opts.kernel,
            want,
            off,
            out,
        )
    }
}
