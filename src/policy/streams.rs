//! Budgets and victim choice for per-(layer, KV-head) stream policies.
//!
//! A stream policy ranks every entry of every stream (higher = keep); how
//! its budget is shared is a `StreamPlan`: streams are grouped, each group
//! has a budget in entries, and a group over budget evicts its lowest-scored
//! unprotected entries, whichever of its streams they are in. One stream
//! per group with an equal budget is SnapKV; one group per layer with a
//! per-head safeguard is AdaKV; layer-dependent single-stream budgets are
//! PyramidKV; one group of all streams is a global budget. Protection
//! (sinks, recent window, prompt) is the shared `Evictor`'s, applied per
//! entry by position.

use super::Evictor;
use crate::error::{Error, Result};
use crate::kv::KvCache;

/// A set of consecutive streams sharing one budget.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Group {
    /// First stream (l · n_kv_heads + h).
    pub first: usize,
    /// Streams in the group.
    pub len: usize,
    /// Entries the group may hold at any moment.
    pub budget: usize,
    /// Each stream of the group keeps at least its top `safeguard` entries by score.
    pub safeguard: usize,
}

/// How a stream policy shares its budget.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StreamPlan {
    pub n_layers: usize,
    pub n_kv_heads: usize,
    pub groups: Vec<Group>,
}

impl StreamPlan {
    /// Every stream keeps at most `budget[l]` entries (layer l's budget).
    pub fn per_stream(n_layers: usize, n_kv_heads: usize, budget: &[usize]) -> StreamPlan {
        let groups = (0..n_layers * n_kv_heads)
            .map(|s| Group {
                first: s,
                len: 1,
                budget: budget[s / n_kv_heads],
                safeguard: 0,
            })
            .collect();
        StreamPlan {
            n_layers,
            n_kv_heads,
            groups,
        }
    }

    /// The streams of each layer share n_kv_heads · `budget` entries; each
    /// keeps at least its top `safeguard`.
    pub fn per_layer(
        n_layers: usize,
        n_kv_heads: usize,
        budget: usize,
        safeguard: usize,
    ) -> StreamPlan {
        let groups = (0..n_layers)
            .map(|l| Group {
                first: l * n_kv_heads,
                len: n_kv_heads,
                budget: n_kv_heads * budget,
                safeguard,
            })
            .collect();
        StreamPlan {
            n_layers,
            n_kv_heads,
            groups,
        }
    }

    /// One pool region per group, sized by its budget.
    pub fn regions(&self) -> Vec<crate::kv::streams::Region> {
        self.groups
            .iter()
            .map(|g| crate::kv::streams::Region {
                first_stream: g.first,
                n_streams: g.len,
                rows: g.budget,
            })
            .collect()
    }

    /// Pool rows needed: the sum of the group budgets (resident entries
    /// never exceed it).
    pub fn pool(&self) -> usize {
        self.groups.iter().map(|g| g.budget).sum()
    }

    /// The smallest budget one stream can count on (its group's budget per
    /// stream): what protection and prefill chunks must fit in.
    pub fn min_stream_budget(&self) -> usize {
        self.groups
            .iter()
            .map(|g| g.budget / g.len.max(1))
            .min()
            .unwrap_or(0)
    }

    /// Whether writing `n_new` tokens (one entry per stream each) would put
    /// any group over its budget; `want[s]` says whether stream s is in such
    /// a group (only those need scores).
    pub fn over(&self, kv: &KvCache, n_new: usize, want: &mut Vec<bool>) -> bool {
        want.clear();
        let Some(st) = kv.streams() else {
            return false;
        };
        want.resize(st.n_streams(), false);
        let mut any = false;
        for g in &self.groups {
            let live: usize = (g.first..g.first + g.len).map(|s| st.len(s)).sum();
            if live + n_new * g.len > g.budget {
                want[g.first..g.first + g.len].fill(true);
                any = true;
            }
        }
        any
    }
}

/// Offsets of each stream's scores in a flat score array aligned with the
/// streams' live lists: stream s owns `off[s]..off[s + 1]`.
pub fn stream_offsets(kv: &KvCache, off: &mut Vec<usize>) {
    off.clear();
    off.push(0);
    if let Some(st) = kv.streams() {
        for s in 0..st.n_streams() {
            off.push(off[s] + st.len(s));
        }
    }
}

impl Evictor {
    /// Victims (pool slots) to free before writing `n_new` tokens whose last
    /// position is `newest`, so that every group of `plan` stays within its
    /// budget: per group over budget, its lowest-scored entries (ties: older
    /// first, then the lower stream) that are neither protected by position nor among their
    /// stream's top `safeguard`. `scores` is flat, laid out by `off`
    /// (`stream_offsets`). Groups under budget lose nothing.
    pub fn select_streams(
        &self,
        plan: &StreamPlan,
        kv: &KvCache,
        scores: &[f32],
        off: &[usize],
        n_new: usize,
        newest: i64,
        victims: &mut Vec<u32>,
    ) -> Result<()> {
        victims.clear();
        let Some(st) = kv.streams() else {
            return Ok(());
        };
        // (score, position, stream, slot) of a group's candidates
        let mut cand: Vec<(f32, i64, u32, u32)> = Vec::new();
        let mut rank: Vec<usize> = Vec::new();
        for g in &plan.groups {
            let live: usize = (g.first..g.first + g.len).map(|s| st.len(s)).sum();
            if live + n_new * g.len <= g.budget {
                continue;
            }
            let mut need = live + n_new * g.len - g.budget;
            cand.clear();
            for s in g.first..g.first + g.len {
                let (slots, pos) = st.stream(s);
                let sc = &scores[off[s]..off[s + 1]];
                // the stream's top `safeguard` by (score, position) are kept
                let mut keep_from = f32::INFINITY;
                let mut keep_pos = i64::MAX;
                if g.safeguard > 0 && !slots.is_empty() {
                    rank.clear();
                    rank.extend(0..slots.len());
                    let k = g.safeguard.min(slots.len());
                    let desc =
                        |&a: &usize, &b: &usize| sc[b].total_cmp(&sc[a]).then(pos[b].cmp(&pos[a]));
                    rank.select_nth_unstable_by(k - 1, desc);
                    let t = rank[k - 1];
                    (keep_from, keep_pos) = (sc[t], pos[t]);
                }
                for j in 0..slots.len() {
                    let c = sc[j].total_cmp(&keep_from);
                    let guarded =
                        g.safeguard > 0 && (c.is_gt() || (c.is_eq() && pos[j] >= keep_pos));
                    if !guarded && !self.protected(pos[j], newest) {
                        cand.push((sc[j], pos[j], s as u32, slots[j]));
                    }
                }
            }
            if cand.len() < need {
                return Err(Error::arg(
                    "--kv-budget",
                    format!(
                        "budget {} entries of streams {}..{} cannot hold the protected tokens: {} live, {} new each, only {} evictable (sinks {}, recent {}, safeguard {} per stream{})",
                        g.budget,
                        g.first,
                        g.first + g.len,
                        live,
                        n_new,
                        cand.len(),
                        self.n_sink,
                        self.n_recent,
                        g.safeguard,
                        if self.keep_prompt_until > 0 { ", prompt kept" } else { "" }
                    ),
                ));
            }
            need = (need + (self.evict_every.max(1) - 1) * g.len).min(cand.len());
            // a total order: score, then older position, then lower stream
            let order = |a: &(f32, i64, u32, u32), b: &(f32, i64, u32, u32)| {
                a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2))
            };
            if need < cand.len() {
                cand.select_nth_unstable_by(need, order);
            }
            victims.extend(cand[..need].iter().map(|c| c.3));
        }
        Ok(())
    }
}
