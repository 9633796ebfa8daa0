//! `lagkv`, `lagkv-causal`: lag-relative K/V statistics (Liang et al.,
//! 2025, "LagKV: Lag-Relative Information of the KV Cache Tells Which Tokens
//! Are Important", arXiv 2504.04704; reference code
//! AI-Lab-China-Merchants-Bank/LagKV, and kvpress's LagKVPress).
//!
//! Idea: a token whose keys and values stand out against their
//! neighbourhood carries information; no query and no attention is needed.
//! Per (layer, KV head) stream, the live entries after the sinks are cut, in
//! position order, into partitions of `lag` entries. Each partition p is
//! normalized per channel by a reference partition's min and max,
//! x' = (x − min) / (max − min + 1e-9); a token's statistic is the standard
//! deviation over head_dim of x'; the statistics of the partition's tokens
//! go through a softmax (so every partition's scores sum to 1 and compare
//! across partitions), for K and for V, and score = softmax(std K') +
//! softmax(std V') (`score_v_ratio` 1).
//!
//! The two forms:
//! - `lagkv` (the original): the reference of partition p is the NEXT
//!   partition p + 1, so only partitions with a full successor are scored;
//!   the last full partition and the remainder are not (score +∞, kept as
//!   the original keeps them uncompressed). Below sinks + 2·lag entries
//!   nothing is scored and the evictor's tie rule (older first) makes it a
//!   sliding window, as kvpress's LagKVPress does.
//! - `lagkv-causal`: the reference is the PREVIOUS partition (what a token
//!   could have seen when it was written), so every partition, the partial
//!   last one included, is scored; partition 0 has no predecessor and is
//!   normalized by its own min/max (choice: keeps its softmax on the same
//!   scale as the others; EPIKV's token-uniform `epikv-lag` uses the raw
//!   std there instead, which is on another scale).
//!
//! The statistic itself is EPIKV's lag statistic (`epikv::lag::chunk_stat`),
//! applied here per stream to the stored keys/values of one KV head.
//!
//! Choices (the original compresses a partition once, keeping ratio·lag of
//! it; kvrun keeps a fixed budget at every moment):
//! - every eviction event rescores the stream's live list from scratch:
//!   partitions are consecutive runs of `lag` live entries, so after an
//!   eviction they are re-cut (the compressed prefix is not frozen);
//! - `lag` = `--lag-size`, default budget/8 clamped to 16..=128 (kvpress
//!   uses 128, the original 1024 or 64; at kvrun's budgets a lag of 128 would
//!   leave most of a 256-entry stream unscored), and eviction happens in
//!   batches of budget/8 (`--evict-every`), about one partition at a time,
//!   as the original compresses one partition per step;
//! - sinks: the evictor's (`--kv-sink`, 4; the original 16); recent window
//!   min(128, budget/4).

use super::epikv::lag::chunk_stat;
use super::rkv::softmax;
use super::streams::for_each_wanted;
use super::{CacheShape, Entries, ModelView, ScoreCtx, Scorer};
use crate::error::{Error, Field, Result};

/// Which partition normalizes partition p.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reference {
    /// p + 1 (the original; the last partition and the remainder are kept).
    Next,
    /// p − 1 (causal; partition 0 normalizes itself).
    Prev,
}

/// Lag-relative statistics per (layer, KV head) stream entry.
#[derive(Debug)]
pub struct LagKv {
    pub reference: Reference,
    /// Partition length (None: budget/8 clamped to 16..=128).
    pub lag: Option<usize>,
    /// The length in use (set at `prepare`).
    lag_used: usize,
}

/// The default partition length for a budget.
pub fn default_lag(budget: usize) -> usize {
    (budget / 8).clamp(16, 128)
}

impl LagKv {
    /// Scorer with the given reference; `lag` None picks the default at
    /// `prepare`. A lag of 0 or 1 is an error (a one-token partition has no
    /// spread).
    pub fn new(reference: Reference, lag: Option<usize>) -> Result<LagKv> {
        if let Some(l) = lag {
            if l < 2 {
                return Err(Error::config(
                    Field::LagSize,
                    format!("must be at least 2, got {l}"),
                ));
            }
        }
        Ok(LagKv {
            reference,
            lag,
            lag_used: lag.unwrap_or(16),
        })
    }

    /// The partition length in use.
    pub fn lag(&self) -> usize {
        self.lag_used
    }
}

/// Per-thread scratch of one stream.
#[derive(Default)]
struct Scratch {
    /// (n, hd) keys, then values, of the stream.
    rows: Vec<f32>,
    /// 0..n.
    idx: Vec<u32>,
    /// (n,) one statistic.
    stat: Vec<f32>,
}

/// Score the `n` entries (rows of `rows`, (n, hd)) of one stream whose first
/// `n_sink` are sinks: add each scored entry's softmaxed statistic to `out`
/// (out must be zeroed by the caller for the first call); entries that are
/// not scored get +∞. `idx` and `stat` are scratch.
pub fn lag_scores(
    rows: &[f32],
    hd: usize,
    n_sink: usize,
    lag: usize,
    reference: Reference,
    idx: &mut Vec<u32>,
    stat: &mut Vec<f32>,
    out: &mut [f32],
) {
    let n = out.len();
    idx.clear();
    idx.extend(0..n as u32);
    stat.clear();
    stat.resize(n, 0.0);
    let s0 = n_sink.min(n);
    out[..s0].fill(f32::INFINITY);
    let body = n - s0;
    // a partition longer than the stream is the whole stream (the same
    // scores; a huge --lag-size must not overflow the bounds below)
    let lag = lag.clamp(1, body.max(1));
    let n_full = body / lag;
    let n_parts = body.div_ceil(lag);
    for p in 0..n_parts {
        let (i0, i1) = (s0 + p * lag, (s0 + (p + 1) * lag).min(n));
        let reference = match reference {
            // a full successor is needed
            Reference::Next if p + 1 < n_full => s0 + (p + 1) * lag..s0 + (p + 2) * lag,
            Reference::Next => {
                out[i0..i1].fill(f32::INFINITY);
                continue;
            }
            Reference::Prev if p == 0 => i0..i1,
            Reference::Prev => i0 - lag..i0,
        };
        let st = &mut stat[i0..i1];
        st.fill(0.0);
        chunk_stat(rows, hd, hd, Some(&idx[reference]), &idx[i0..i1], st);
        softmax(st);
        for (o, &v) in out[i0..i1].iter_mut().zip(st.iter()) {
            *o += v;
        }
    }
}

impl Scorer for LagKv {
    fn per_stream(&self) -> bool {
        true
    }
    fn prepare(&mut self, _m: &ModelView<'_>, cache: CacheShape) -> Result<()> {
        self.lag_used = self.lag.unwrap_or_else(|| default_lag(cache.budget));
        Ok(())
    }
    fn score(&mut self, ctx: &ScoreCtx<'_>, out: &mut [f32]) {
        let Entries::Streams { want, off, plan } = ctx.entries else {
            return;
        };
        let Some(st) = ctx.kv.streams() else {
            return;
        };
        let (hd, nkv) = (ctx.kv.head_dim, plan.n_kv_heads);
        let (lag, reference, n_sink) = (self.lag_used, self.reference, ctx.rules.n_sink);
        let kv = ctx.kv;
        for_each_wanted(ctx.pool, want, off, out, |s, o, sc: &mut Scratch| {
            let (l, g) = (s / nkv, s % nkv);
            let (slots, pos) = st.stream(s);
            let n = slots.len();
            o.fill(0.0);
            // sinks by position (the evictor protects them too)
            let sinks = pos.partition_point(|&p| (p as usize) < n_sink);
            sc.rows.resize(n * hd, 0.0);
            for key in [true, false] {
                kv.read_heads(key, l, g, slots, &mut sc.rows);
                lag_scores(
                    &sc.rows,
                    hd,
                    sinks,
                    lag,
                    reference,
                    &mut sc.idx,
                    &mut sc.stat,
                    o,
                );
            }
        });
    }
}
