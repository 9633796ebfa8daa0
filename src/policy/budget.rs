//! Budget rules: how a policy's budget is shared among the cache's entries.
//!
//! - `Tokens`: one slot map shared by every layer and head; one score per
//!   token (window, H2O, TOVA, K-norm, random, EPIKV).
//! - `PerStream`: every (layer, KV head) stream keeps its own top `budget`
//!   entries in its own storage rows (SnapKV; Li et al., 2024, arXiv
//!   2404.14469).
//! - `PerLayer`: Ada-KV (Feng et al., 2024, "Ada-KV: Optimizing KV Cache
//!   Eviction by Adaptive Budget Allocation for Efficient LLM Inference",
//!   arXiv 2407.11550). Heads differ in how concentrated their attention is,
//!   so a layer's budget is not split evenly: its KV heads share
//!   n_kv_heads × budget entries, and whenever the layer is over budget it
//!   evicts its globally lowest-scored entries, whichever head holds them.
//!   Safeguard (kvpress's AdaKVPress): each head always keeps its top
//!   ⌊safeguard · budget⌋ entries (`--adakv-safeguard`, default 0.2).
//! - `Pyramid`: PyramidKV (Cai et al., 2024, "PyramidKV: Dynamic KV Cache
//!   Compression based on Pyramidal Information Funneling", arXiv
//!   2406.02069). Lower layers spread attention widely, upper layers funnel
//!   it onto few tokens, so budgets shrink with depth (`layer_budgets`;
//!   `--pyramid-beta`, default 20).
//! - `Global`: one group over every stream of every layer (n_layers ·
//!   n_kv_heads · budget entries overall), each stream keeping at least its
//!   top `min_per_head` (DBTrimKV; `--min-per-head`). Per-stream lengths
//!   become whatever survives the global ranking.
//! - `Heads`: HeadKV (`headkv.rs`): a fixed budget per (layer, KV head)
//!   stream from offline per-head importance scores, summing to
//!   n_layers · n_kv_heads · budget (per-stream lengths differ for good).
//!
//! Scores must be comparable across the streams of a group (e.g.
//! probabilities averaged the same way) for the shared rules to be fair.

use super::headkv::{head_budgets, HeadScores, BETA};
use super::streams::StreamPlan;
use crate::error::{Error, Field, Msg, Result};
use crate::model::Config;
use std::sync::Arc;

/// How a policy shares its budget.
#[derive(Debug, Clone, PartialEq)]
pub enum BudgetRule {
    /// Token-uniform: one keep/evict decision per token for every layer and head.
    Tokens,
    /// Equal budget per (layer, KV head) stream.
    PerStream,
    /// A layer's KV heads share its budget; each keeps ⌊safeguard · budget⌋.
    PerLayer { safeguard: f32 },
    /// Per-layer stream budgets shrinking with depth, above the observation window `window`.
    Pyramid { window: usize, beta: f32 },
    /// One group of every stream; each keeps at least its top `min_per_head`.
    Global { min_per_head: usize },
    /// A fixed budget per stream from per-head scores, every stream keeping
    /// at least the observation window `window` (HeadKV).
    Heads {
        scores: Arc<HeadScores>,
        window: usize,
    },
}

impl BudgetRule {
    /// Whether the budget is the most any one stream (or the token-uniform
    /// cache) holds, so that a budget beyond the context can be clamped to
    /// it without changing what is kept. Per-layer, pyramid and global
    /// budgets are split unevenly and are kept as given.
    pub fn caps_each_stream(&self) -> bool {
        matches!(self, BudgetRule::Tokens | BudgetRule::PerStream)
    }

    /// Whether the rule keeps per-(layer, KV-head) streams.
    pub fn streams(&self) -> bool {
        !matches!(self, BudgetRule::Tokens)
    }

    /// The stream groups for a model `c` and a per-head average `budget`
    /// (None: token-uniform).
    pub fn plan(&self, c: &Config, budget: usize) -> Result<Option<StreamPlan>> {
        let (nl, nh) = (c.n_cache_layers(), c.n_kv_heads);
        let guard = |f: f32| (f * budget as f32).floor() as usize;
        Ok(Some(match self {
            BudgetRule::Tokens => return Ok(None),
            BudgetRule::PerStream => StreamPlan::per_stream(nl, nh, &vec![budget; nl]),
            BudgetRule::PerLayer { safeguard } => {
                StreamPlan::per_layer(nl, nh, budget, guard(*safeguard))
            }
            BudgetRule::Pyramid { window, beta } => {
                StreamPlan::per_stream(nl, nh, &layer_budgets(nl, budget, *window, *beta)?)
            }
            BudgetRule::Heads { scores, window } => {
                if scores.n_layers != nl || scores.n_kv_heads != nh {
                    return Err(Error::config(
                        Field::HeadScores,
                        format!(
                            "scores for {} layers × {} KV heads, the model has {nl} × {nh}",
                            scores.n_layers, scores.n_kv_heads
                        ),
                    ));
                }
                StreamPlan::per_head(
                    nl,
                    nh,
                    &head_budgets(&scores.scores, budget, *window, BETA)?,
                )
            }
            BudgetRule::Global { min_per_head } => {
                let min_per_head = *min_per_head;
                if min_per_head > budget {
                    return Err(Error::config(
                        Field::MinPerHead,
                        format!("{min_per_head} exceeds the per-head budget {budget}"),
                    ));
                }
                StreamPlan::global(nl, nh, budget, min_per_head)
            }
        }))
    }
}

/// PyramidKV's per-KV-head budget of each of `n_layers` layers for an
/// average of `budget` with observation window `w` and ratio `beta`:
/// layer l keeps w + round(max − l · (max − min) / (L − 1)) entries, with
/// min = (B − w) / β and max = 2 (B − w) − min (kvpress/KVCache-Factory's
/// formula), so the layers sum to L · B: the same total memory as SnapKV
/// at budget B, shifted to the bottom. Rounding is corrected so the total
/// never exceeds L · B. The top layer's budget must still hold the
/// protected tokens (the session says so when it cannot).
pub fn layer_budgets(n_layers: usize, budget: usize, w: usize, beta: f32) -> Result<Vec<usize>> {
    if budget <= w {
        return Err(Error::config(
            Field::Budget,
            format!("pyramidkv needs a budget above the observation window ({w}), got {budget}"),
        ));
    }
    if beta.is_nan() || beta < 1.0 {
        return Err(Error::config(
            Field::PyramidBeta,
            Msg::from(format!("must be at least 1, got {beta}")),
        ));
    }
    let room = (budget - w) as f64;
    let min = room / beta as f64;
    let max = 2.0 * room - min;
    let steps = (n_layers.max(2) - 1) as f64;
    let mut b: Vec<usize> = (0..n_layers)
        .map(|l| w + (max - l as f64 * (max - min) / steps).round().max(0.0) as usize)
        .collect();
    // rounding may overshoot the total by a few entries: take them back
    // from the largest budgets
    let total = n_layers * budget;
    while b.iter().sum::<usize>() > total {
        let i = (0..n_layers)
            .max_by_key(|&i| (b[i], usize::MAX - i))
            .unwrap_or(0);
        b[i] -= 1;
    }
    Ok(b)
}
