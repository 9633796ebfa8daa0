//! Budget groups of per-(layer, KV-head) stream policies.
//!
//! A stream policy ranks every entry of every stream (higher = keep); how
//! its budget is shared is a `StreamPlan` (made by a `BudgetRule`): streams
//! are grouped, each group has a budget in entries, and a group over budget
//! evicts its lowest-scored unprotected entries, whichever of its streams
//! they are in (`Evictor::select_streams`). One stream per group with an
//! equal budget is SnapKV; one group per layer with a per-head safeguard is
//! AdaKV; layer-dependent single-stream budgets are PyramidKV; one group of
//! all streams is a global budget. Protection (sinks, recent window,
//! prompt) is the shared `Evictor`'s, applied per entry by position.

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

    /// Stream s keeps at most `budget[s]` entries (one budget per stream).
    pub fn per_head(n_layers: usize, n_kv_heads: usize, budget: &[usize]) -> StreamPlan {
        let groups = (0..n_layers * n_kv_heads)
            .map(|s| Group {
                first: s,
                len: 1,
                budget: budget[s],
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

    /// Every stream of every layer shares n_layers · n_kv_heads · `budget`
    /// entries (one global group); each keeps at least its top `safeguard`.
    pub fn global(
        n_layers: usize,
        n_kv_heads: usize,
        budget: usize,
        safeguard: usize,
    ) -> StreamPlan {
        let ns = n_layers * n_kv_heads;
        StreamPlan {
            n_layers,
            n_kv_heads,
            groups: vec![Group {
                first: 0,
                len: ns,
                budget: ns * budget,
                safeguard,
            }],
        }
    }

    /// The group stream `s` belongs to (groups are consecutive, ascending).
    pub fn group_of(&self, s: usize) -> Option<&Group> {
        let i = self.groups.partition_point(|g| g.first <= s);
        self.groups[..i].last().filter(|g| s < g.first + g.len)
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

/// Run `f(s, out_s, scratch)` for every stream `s` with `want[s]`, where
/// `out_s` is stream s's range of `out` (laid out by `off`); streams are
/// dealt round-robin over the threads of `pool`, each thread with its own
/// `S::default()` scratch (reused across its streams).
pub fn for_each_wanted<S: Default>(
    pool: &crate::backend::pool::ThreadPool,
    want: &[bool],
    off: &[usize],
    out: &mut [f32],
    f: impl Fn(usize, &mut [f32], &mut S) + Sync,
) {
    let nt = pool.n_threads();
    let ns = want.len().min(off.len().saturating_sub(1));
    let outs = crate::backend::pool::SharedMut::new(out);
    pool.run(|ti| {
        let mut scratch = S::default();
        for s in (0..ns).filter(|&s| want[s]).skip(ti).step_by(nt) {
            // SAFETY: stream s's range `off[s]..off[s + 1]` is disjoint from
            // every other stream's, and each stream goes to one thread only.
            let o = unsafe { outs.slice(off[s], off[s + 1] - off[s]) };
            f(s, o, &mut scratch);
        }
    });
}
