//! `headkv`: head-level budgets from offline head importance (Fu et al.,
//! 2024, "Not All Heads Matter: A Head-Level KV Cache Compression Method
//! with Integrated Retrieval and Reasoning", arXiv 2410.19258; budget rule
//! as in the HeadKV port of ngocbh/trimkv, POLICIES.md §5.12).
//!
//! Idea: some attention heads retrieve from far back in the context and
//! need many entries, others attend locally and need few; the split is a
//! property of the model, measured once. Every (layer, KV head) stream gets
//! a fixed budget of its own (`BudgetRule::Heads`), in its own storage
//! rows (the stream layout: per-stream variable lengths):
//!
//!   b_s = w + round(s_s · P + (B − w) − ⌊(B − w)/β⌋),  P = ⌊(B − w)/β⌋ · L·Hkv,
//!
//! with s normalized to sum 1 over the L·Hkv streams, B the average budget,
//! w the observation window (every head keeps it) and β = 1.2 (the port's):
//! every stream keeps at least w + (B − w) − ⌊(B − w)/β⌋ and the pool
//! P is shared in proportion to the scores, so the streams sum to L·Hkv·B
//! (the memory of SnapKV at budget B; rounding is corrected down).
//! Inside a stream, entries are ranked by kvrun's SnapKV observation-window
//! votes (choice: the port ranks with window 8, kernel 7 and max pooling;
//! reusing snapkv's scorer makes the budget split the only difference from
//! `snapkv`, which is what the comparison is about).
//!
//! Scores: per KV head, from `--head-scores FILE`, by default
//! `<model stem>.headkv.json` next to the model; `kvrun calibrate headkv`
//! computes them (`retrieval_hits`): the retrieval score of Wu et al.
//! (2024, "Retrieval Head Mechanistically Explains Long-Context Factuality",
//! arXiv 2404.15574), which HeadKV builds on: a needle sentence is hidden
//! at several depths of a long text and copied back after a question,
//! teacher-forced; at every copied token, a query head scores a hit when
//! its most attended key is a needle token equal to the token being copied;
//! a head's score is its hit rate, and a KV head's the mean over the query
//! heads of its GQA group (the port's reduction). Choice: HeadKV's
//! retrieval-reasoning variant also rewards heads attending to the needle
//! when reasoning about it; the plain retrieval score needs no task design
//! beyond copying and is the one its ablations start from.

use crate::error::{Error, Field, Result};
use crate::kv::KvCache;
use crate::signals::QueryWindow;
use serde::{Deserialize, Serialize};
use std::ops::Range;
use std::path::{Path, PathBuf};

/// β of the budget rule.
pub const BETA: f32 = 1.2;

/// Per-(layer, KV head) importance scores of one model, as stored next to it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HeadScores {
    pub n_layers: usize,
    pub n_kv_heads: usize,
    /// (n_layers · n_kv_heads) scores, stream order (l · n_kv_heads + h), ≥ 0.
    pub scores: Vec<f32>,
    /// How they were computed (the command line).
    #[serde(default)]
    pub procedure: String,
}

impl HeadScores {
    /// Read a per-model JSON file and check it.
    pub fn load(path: &Path) -> Result<HeadScores> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::Io {
            path: path.to_path_buf(),
            source: e,
        })?;
        let h: HeadScores = serde_json::from_str(&text)
            .map_err(|e| Error::config(Field::HeadScores, format!("{}: {e}", path.display())))?;
        h.check()
            .map_err(|e| Error::config(Field::HeadScores, format!("{}: {e}", path.display())))?;
        Ok(h)
    }

    /// Every score finite and ≥ 0, one per stream, not all zero.
    pub fn check(&self) -> std::result::Result<(), String> {
        if self.scores.len() != self.n_layers * self.n_kv_heads {
            return Err(format!(
                "{} scores for {} layers × {} KV heads",
                self.scores.len(),
                self.n_layers,
                self.n_kv_heads
            ));
        }
        if let Some(x) = self.scores.iter().find(|x| !x.is_finite() || **x < 0.0) {
            return Err(format!("score {x} is not a finite value ≥ 0"));
        }
        if self.scores.iter().sum::<f32>() <= 0.0 {
            return Err("every score is 0".into());
        }
        Ok(())
    }
}

/// Where the per-model scores live by default: `<stem>.headkv.json` next to
/// the model file.
pub fn scores_path_for(model: &Path) -> PathBuf {
    let stem = model
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    model.with_file_name(format!("{stem}.headkv.json"))
}

/// The budget of each stream for scores `s` (one per stream), an average
/// budget `budget` and an observation window `w` (see the module doc).
pub fn head_budgets(s: &[f32], budget: usize, w: usize, beta: f32) -> Result<Vec<usize>> {
    if budget <= w {
        return Err(Error::config(
            Field::Budget,
            format!("headkv needs a budget above the observation window ({w}), got {budget}"),
        ));
    }
    let ns = s.len();
    let total: f64 = s.iter().map(|&x| x as f64).sum();
    // (a NaN total fails `is_finite`)
    if ns == 0 || !total.is_finite() || total <= 0.0 {
        return Err(Error::config(Field::HeadScores, "no usable head scores"));
    }
    let room = budget - w;
    let floor = (room as f64 / beta as f64).floor() as usize;
    let pool = (floor * ns) as f64;
    let mut b: Vec<usize> = s
        .iter()
        .map(|&x| w + ((x as f64 / total) * pool + (room - floor) as f64).round() as usize)
        .collect();
    let cap = ns * budget;
    while b.iter().sum::<usize>() > cap {
        let i = (0..ns).max_by_key(|&i| (b[i], usize::MAX - i)).unwrap_or(0);
        b[i] -= 1;
    }
    Ok(b)
}

/// Retrieval hits of every query head: for each query row of `qw` at a
/// position p with p + 1 in `targets` (the copied tokens), the head's
/// most attended key among the cached positions ≤ p (every token cached:
/// a cache without eviction) is a hit when its position lies in `needle`
/// and its token equals `tokens[p + 1]`. Returns (n_layers · n_heads) hit
/// counts (layer-major) and the number of rows that counted.
pub fn retrieval_hits(
    kv: &KvCache,
    qw: &QueryWindow,
    tokens: &[u32],
    needle: Range<usize>,
    targets: Range<usize>,
) -> (Vec<u32>, usize) {
    let hd = kv.head_dim;
    let n_heads = qw.q_dim / hd;
    let nkv = kv.kv_dim / hd;
    let group = n_heads / nkv;
    let (slots, pos) = kv.live();
    let n = slots.len();
    let mut hits = vec![0u32; kv.n_layers * n_heads];
    let rows: Vec<usize> = (0..qw.len())
        .filter(|&r| {
            let p = qw.row_pos(r) + 1;
            p >= 0 && targets.contains(&(p as usize)) && (p as usize) < tokens.len()
        })
        .collect();
    let mut keys = vec![0f32; n * hd];
    for l in 0..kv.n_layers {
        for g in 0..nkv {
            kv.read_heads(true, l, g, slots, &mut keys);
            for &r in &rows {
                let (q, qp) = qw.row(l, r);
                let want = tokens[qp as usize + 1];
                let nv = pos.partition_point(|&p| p <= qp);
                for h in g * group..(g + 1) * group {
                    let qh = &q[h * hd..(h + 1) * hd];
                    let mut best = (f32::NEG_INFINITY, 0usize);
                    for (j, k) in keys[..nv * hd].chunks_exact(hd).enumerate() {
                        let d: f32 = qh.iter().zip(k).map(|(a, b)| a * b).sum();
                        if d > best.0 {
                            best = (d, j);
                        }
                    }
                    let p = pos[best.1] as usize;
                    if needle.contains(&p) && tokens[p] == want {
                        hits[l * n_heads + h] += 1;
                    }
                }
            }
        }
    }
    (hits, rows.len())
}
