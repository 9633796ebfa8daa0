//! `raas`: Reasoning-Aware Attention Sparsity (Hu et al., 2025, "Efficient
//! Long-Decoding Inference with Reasoning-Aware Attention Sparsity", arXiv
//! 2502.11147), as the EPIKV harness re-implements it (POLICIES.md §5.12;
//! no official code is public).
//!
//! Idea: in a reasoning trace some decode tokens ("milestones") are used
//! for a while and then never again; keep a token as long as it keeps
//! being attended to, like an LRU cache. Every decode token carries a
//! timestamp, its own position when written; at every step the tokens
//! whose attention from the step's last query row (averaged over every
//! head and layer, exported by the fused attention: `MassMode::LastRow`)
//! is at least the median attention of the live decode tokens get the
//! newest position as their timestamp. Score = timestamp: the least
//! recently used token goes first. O(n) per step (one median by selection).
//!
//! Token-uniform (the harness's granularity). Protection as the paper:
//! every prompt (prefill) token is kept (the decode budget is the budget
//! minus the prompt), sinks 4, recent window min(128, budget/4). When the
//! prompt is not kept (`--prompt-policy`, `--prompt-compress once`, or a
//! session without a prompt), prompt tokens are ranked like decode tokens:
//! they join the median and are refreshed the same way.
//!
//! Choice: "at least the median" counts ties as refreshed (with a single
//! live decode token, it refreshes itself); the median of an even count is
//! the upper middle element (a selection, no averaging).

use super::{CacheShape, Entries, ModelView, ScoreCtx, Scorer, Step};
use crate::error::Result;
use crate::signals::{MassMode, Needs};

/// LRU timestamps per slot.
#[derive(Debug, Default)]
pub struct Raas {
    /// (n_slots,) position at which the slot was last used (written or
    /// attended at least as much as the median).
    stamp: Vec<f32>,
    /// Scratch: the attention of the live ranked tokens.
    vals: Vec<f32>,
}

impl Raas {
    /// The timestamp of `slot`.
    pub fn stamp(&self, slot: usize) -> f32 {
        self.stamp[slot]
    }
}

impl Scorer for Raas {
    fn needs(&self) -> Needs {
        Needs::mass(MassMode::LastRow)
    }
    fn prepare(&mut self, _m: &ModelView<'_>, cache: CacheShape) -> Result<()> {
        self.stamp = vec![0.0; cache.n_slots];
        Ok(())
    }
    fn observe(&mut self, step: &Step<'_>) {
        for (&s, &p) in step.slots.iter().zip(step.positions) {
            self.stamp[s as usize] = p as f32;
        }
        let (Some(mass), Some(&newest)) = (step.mass, step.positions.last()) else {
            return;
        };
        // the ranked tokens: decode tokens (every token when the prompt is
        // not kept: prompt_end 0)
        let (slots, pos) = step.kv.live();
        let from = pos.partition_point(|&p| p < step.prompt_end);
        let ranked = &slots[from..];
        if ranked.is_empty() {
            return;
        }
        self.vals.clear();
        self.vals.extend(
            ranked
                .iter()
                .map(|&s| mass.get(s as usize).copied().unwrap_or(0.0)),
        );
        let mid = self.vals.len() / 2;
        let (_, &mut median, _) = self.vals.select_nth_unstable_by(mid, f32::total_cmp);
        for &s in ranked {
            if mass.get(s as usize).copied().unwrap_or(0.0) >= median {
                self.stamp[s as usize] = newest as f32;
            }
        }
    }
    fn score(&mut self, ctx: &ScoreCtx<'_>, out: &mut [f32]) {
        if let Entries::Tokens { slots, .. } = ctx.entries {
            for (o, &s) in out.iter_mut().zip(slots) {
                *o = self.stamp[s as usize];
            }
        }
    }
    fn relocate(&mut self, map: &[(u32, u32)], n_slots: usize) {
        super::relocate_slots(&mut self.stamp, 1, map, n_slots);
    }
    fn reset(&mut self) {
        self.stamp.fill(0.0);
    }
}
