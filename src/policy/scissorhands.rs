//! `scissorhands`: persistence of importance (Liu et al., 2023,
//! "Scissorhands: Exploiting the Persistence of Importance Hypothesis for
//! LLM KV Cache Compression at Test Time", arXiv 2305.17118).
//!
//! Idea (the paper's hypothesis): only pivotal tokens — those that received
//! high attention at one step — keep receiving high attention later, so a
//! token's recent history predicts its future importance. The paper's
//! algorithm keeps, over a history window of the last w_h decode steps, a
//! counter per token of the steps at which its attention was BELOW the
//! average (1/t for t visible tokens: "unimportant" at that step); when the
//! cache is full, the tokens with the highest counters go, the most recent
//! r tokens excepted; a batch of m tokens is dropped at once, then the
//! cache refills.
//!
//! Here: the attention of each step's last query row per slot (averaged
//! over every head and layer, exported by the fused attention:
//! `MassMode::LastRow`, no attention matrix) is compared with 1/n_live, the
//! uniform share; a 64-bit history per slot records, for the last w_h
//! steps, whether the slot was unimportant. Score =
//! −(unimportant steps within the window) (higher = keep). A token younger
//! than the window has fewer chances to be counted unimportant, which is
//! the paper's behaviour too (its counters start at zero). Ties (equal
//! counts): the older token goes first (the evictor's rule). O(n) per step.
//!
//! Choices: token-uniform (one slot map for every layer and head, averaged
//! attention; the paper keeps per-head counters: with the cache shared by
//! every head, one decision per token is what the layout allows); the
//! threshold is the mean share 1/n_live of the averaged row (the paper's
//! 1/t); prefill chunks contribute their last row only (the paper counts
//! decode steps). Parameters: `--history-window` w_h (1..=64, default 64,
//! a window the 64-bit history holds exactly), `--kv-recent` r (default
//! min(128, budget/4)), `--evict-every` m (default budget/8, at most 128:
//! the paper drops a batch at once).

use super::{CacheShape, Entries, ModelView, ScoreCtx, Scorer, Step};
use crate::error::{Error, Field, Result};
use crate::signals::{MassMode, Needs};

/// Longest history window the per-slot bit histories hold.
pub const MAX_HISTORY: usize = 64;

/// Per-slot histories of importance.
#[derive(Debug)]
pub struct Scissorhands {
    /// History window w_h (steps).
    pub history: usize,
    /// (n_slots,) bit t set: the slot was unimportant t steps ago.
    low: Vec<u64>,
}

impl Scissorhands {
    /// Counters over the last `history` steps (1..=64).
    pub fn new(history: usize) -> Result<Scissorhands> {
        if !(1..=MAX_HISTORY).contains(&history) {
            return Err(Error::config(
                Field::HistoryWindow,
                format!("must be in 1..={MAX_HISTORY}, got {history}"),
            ));
        }
        Ok(Scissorhands {
            history,
            low: Vec::new(),
        })
    }

    fn mask(&self) -> u64 {
        if self.history >= 64 {
            u64::MAX
        } else {
            (1u64 << self.history) - 1
        }
    }

    /// Steps within the window at which `slot` was unimportant.
    pub fn unimportant(&self, slot: usize) -> u32 {
        (self.low[slot] & self.mask()).count_ones()
    }
}

impl Scorer for Scissorhands {
    fn needs(&self) -> Needs {
        Needs::mass(MassMode::LastRow)
    }
    fn prepare(&mut self, _m: &ModelView<'_>, cache: CacheShape) -> Result<()> {
        self.low = vec![0; cache.n_slots];
        Ok(())
    }
    fn observe(&mut self, step: &Step<'_>) {
        // new tokens start with an empty history
        for &s in step.slots {
            self.low[s as usize] = 0;
        }
        let Some(mass) = step.mass else {
            return;
        };
        let (slots, _) = step.kv.live();
        if slots.is_empty() {
            return;
        }
        let avg = 1.0 / slots.len() as f32;
        for &s in slots {
            let s = s as usize;
            let m = mass.get(s).copied().unwrap_or(0.0);
            self.low[s] = (self.low[s] << 1) | u64::from(m < avg);
        }
    }
    fn score(&mut self, ctx: &ScoreCtx<'_>, out: &mut [f32]) {
        if let Entries::Tokens { slots, .. } = ctx.entries {
            for (o, &s) in out.iter_mut().zip(slots) {
                *o = -(self.unimportant(s as usize) as f32);
            }
        }
    }
    fn relocate(&mut self, map: &[(u32, u32)], n_slots: usize) {
        super::relocate_slots(&mut self.low, 1, map, n_slots);
    }
    fn reset(&mut self) {
        self.low.fill(0);
    }
}
