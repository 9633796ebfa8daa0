//! The evictor: budget and protection rules shared by every policy, and
//! the one routine that picks victims.
//!
//! Guarantees:
//! - A victim is never protected: not among the first `n_sink` positions,
//!   not a kept prompt token, not among the newest `n_recent` positions,
//!   and (streams) not among its stream's top `safeguard` entries.
//! - Victims are the lowest-scored candidates of a group over budget, in a
//!   total order (score, then older position, then lower stream), so the
//!   choice never depends on how scores were laid out or on thread count.
//! - Exactly as many as needed: a group over budget by k entries loses k,
//!   plus `evict_every − 1` entries per stream (batched eviction), capped
//!   by its candidates; a group within budget loses nothing.
//!
//! The token-uniform cache is the special case of one group holding one
//! stream (every slot shared by all layers and heads); both layouts gather
//! their candidates and call the same [`Evictor::pick`].

use super::streams::StreamPlan;
use crate::error::{Error, Field, Msg, Result};
use crate::kv::KvCache;

/// Budget and protection rules shared by every policy.
#[derive(Debug, Clone)]
pub struct Evictor {
    /// Most tokens resident at any moment (per layer per KV head).
    pub budget: usize,
    /// The first `n_sink` positions are never evicted.
    pub n_sink: usize,
    /// The newest `n_recent` positions are never evicted.
    pub n_recent: usize,
    /// Positions below this are prompt tokens, never evicted (0 = prompt evictable).
    pub keep_prompt_until: usize,
    /// Evict in batches: when over budget, free `evict_every - 1` extra
    /// entries per stream so the next steps need no scoring.
    pub evict_every: usize,
}

/// A candidate victim: (score, position, stream, slot).
pub type Cand = (f32, i64, u32, u32);

/// Scratch of the selection, reused between steps (no allocation per step
/// once warm).
#[derive(Debug, Default, Clone)]
pub struct EvictScratch {
    cand: Vec<Cand>,
    rank: Vec<usize>,
}

impl Evictor {
    /// Whether the token at `pos` is protected when the newest position after
    /// the step will be `newest`.
    #[inline]
    pub fn protected(&self, pos: i64, newest: i64) -> bool {
        (pos as usize) < self.n_sink
            || (pos as usize) < self.keep_prompt_until
            || pos > newest.saturating_sub(i64::try_from(self.n_recent).unwrap_or(i64::MAX))
    }

    /// How many protected tokens there can be at most (for feasibility checks).
    pub fn max_protected(&self) -> usize {
        self.n_sink
            .max(self.keep_prompt_until)
            .saturating_add(self.n_recent)
    }

    /// The selection routine of every layout: of a group of `len` streams
    /// over budget by `need` entries, move the `need` (rounded up by
    /// `evict_every` per stream, capped by the candidates) lowest of `cand`
    /// in (score, position, stream) order onto `victims`, in that order.
    fn pick(&self, cand: &mut [Cand], need: usize, len: usize, victims: &mut Vec<u32>) {
        let extra = (self.evict_every.max(1) - 1).saturating_mul(len);
        let need = need.saturating_add(extra).min(cand.len());
        // a total order: partition out the `need` lowest in O(n) instead
        // of sorting every candidate each step
        let order =
            |a: &Cand, b: &Cand| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2));
        if need < cand.len() {
            cand.select_nth_unstable_by(need, order);
        }
        cand[..need].sort_unstable_by(order);
        victims.extend(cand[..need].iter().map(|c| c.3));
    }

    /// Token-uniform victims to free before writing `n_new` tokens whose
    /// last position is `newest`: the lowest-scored unprotected live slots
    /// (ties: older first). `scores[i]` belongs to `live_slots[i]`.
    pub fn select(
        &self,
        live_slots: &[u32],
        live_pos: &[i64],
        scores: &[f32],
        n_new: usize,
        newest: i64,
        victims: &mut Vec<u32>,
    ) -> Result<()> {
        self.select_with(
            &mut EvictScratch::default(),
            live_slots,
            live_pos,
            scores,
            n_new,
            newest,
            victims,
        )
    }

    /// `select` with caller-owned scratch.
    pub fn select_with(
        &self,
        scratch: &mut EvictScratch,
        live_slots: &[u32],
        live_pos: &[i64],
        scores: &[f32],
        n_new: usize,
        newest: i64,
        victims: &mut Vec<u32>,
    ) -> Result<()> {
        victims.clear();
        let n_live = live_slots.len();
        if n_live + n_new <= self.budget {
            return Ok(());
        }
        let need = n_live + n_new - self.budget;
        let cand = &mut scratch.cand;
        cand.clear();
        cand.extend(
            (0..n_live)
                .filter(|&i| !self.protected(live_pos[i], newest))
                .map(|i| (scores[i], live_pos[i], 0, live_slots[i])),
        );
        if cand.len() < need {
            let kept = if self.keep_prompt_until == usize::MAX {
                "all".to_string()
            } else {
                self.keep_prompt_until.to_string()
            };
            let mut m = Msg::default().t(format!(
                "budget {} cannot hold the protected tokens: {} live, {} new, only {} evictable (sinks {}, recent {}, prompt {kept})",
                self.budget,
                n_live,
                n_new,
                cand.len(),
                self.n_sink,
                self.n_recent,
            ));
            if self.keep_prompt_until > 0 {
                m = m
                    .t("; the prompt is kept: raise ")
                    .f(Field::Budget)
                    .t(", or choose a prompt-phase policy with ")
                    .f(Field::PromptPolicy)
                    .t(" (or ")
                    .f(Field::EpikvScorePrompt)
                    .t(")");
            }
            return Err(Error::config(Field::Budget, m));
        }
        self.pick(cand, need, 1, victims);
        Ok(())
    }

    /// Stream victims (pool slots) to free before writing `n_new` tokens
    /// whose last position is `newest`, so that every group of `plan` stays
    /// within its budget: per group over budget, its lowest-scored entries
    /// (ties: older first, then the lower stream) that are neither
    /// protected by position nor among their stream's top `safeguard`.
    /// `scores` is flat, laid out by `off` (`streams::stream_offsets`).
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
        self.select_streams_with(
            &mut EvictScratch::default(),
            plan,
            kv,
            scores,
            off,
            n_new,
            newest,
            victims,
        )
    }

    /// `select_streams` with caller-owned scratch.
    pub fn select_streams_with(
        &self,
        scratch: &mut EvictScratch,
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
        let EvictScratch { cand, rank } = scratch;
        for g in &plan.groups {
            let live: usize = (g.first..g.first + g.len).map(|s| st.len(s)).sum();
            if live + n_new * g.len <= g.budget {
                continue;
            }
            let need = live + n_new * g.len - g.budget;
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
                return Err(Error::config(
                    Field::Budget,
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
            self.pick(cand, need, g.len, victims);
        }
        Ok(())
    }
}
