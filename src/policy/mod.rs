//! Eviction policies: scorers rank cached tokens, one shared `Evictor`
//! chooses the victims.
//!
//! A scorer never mutates the cache: it sees what the engine already has
//! (slot positions, stored keys and values, attention probabilities exported
//! by the fused attention pass when it asks for them) and returns one score
//! per live slot, higher = keep. The `Evictor` applies the protection rules
//! (sinks, recent window, prompt) that every policy shares, and picks exactly
//! the lowest-scored unprotected slots (ties: older position first).
//!
//! `POLICIES` is the single registry: the CLI's `--policy` values, `--help`
//! and the tests all read it.

pub mod epikv;
pub mod h2o;
pub mod knorm;
pub mod random;
pub mod tova;
pub mod window;

use crate::error::{Error, Result};
use crate::kv::KvCache;
use crate::model::llama::{HiddenTaps, MassMode};
use crate::model::Config;

/// Ranks cached tokens (token-uniform: one score per slot shared by every
/// layer and head). Per-slot state lives in the scorer, indexed by slot.
pub trait Scorer: std::fmt::Debug + Send {
    /// Name accepted by `--policy`.
    fn name(&self) -> &'static str;
    /// Which attention probabilities the forward pass must export (default: none, zero cost).
    fn mass_mode(&self) -> MassMode {
        MassMode::None
    }
    /// Resolve model-dependent settings (layers, widths) once the model is known.
    fn prepare(&mut self, _c: &Config) -> Result<()> {
        Ok(())
    }
    /// Decoder layers whose residual-stream change the scorer reads (default: none).
    fn tap_layers(&self) -> Vec<usize> {
        Vec::new()
    }
    /// Positions below `n` are the prompt.
    fn set_prompt_end(&mut self, _n: usize) {}
    /// The cache budget the scorer works under.
    fn set_budget(&mut self, _budget: usize) {}
    /// Hidden-state change of the step's tokens (`taps.g`, one row per token
    /// of `slots`/`positions`), delivered before `on_write`.
    fn on_hidden(&mut self, _taps: &HiddenTaps, _slots: &[u32], _positions: &[i64]) {}
    /// New tokens were written into `slots` at `positions` (K/V already stored).
    fn on_write(&mut self, _kv: &KvCache, _slots: &[u32], _positions: &[i64]) {}
    /// Attention mass of the last step, (n_slots,), averaged over layers and heads.
    fn observe(&mut self, _mass: &[f32]) {}
    /// Fill `out[i]` with the score of live slot `live_slots[i]`; higher = keep.
    fn score(&mut self, kv: &KvCache, live_slots: &[u32], live_pos: &[i64], out: &mut [f32]);
    /// Forget per-sequence state.
    fn reset(&mut self) {}
}

/// One registry entry.
#[derive(Debug, Clone, Copy)]
pub struct PolicyInfo {
    pub name: &'static str,
    pub about: &'static str,
}

/// Every policy `--policy` accepts, with its one-line description.
pub const POLICIES: &[PolicyInfo] = &[
    PolicyInfo {
        name: "full",
        about: "no eviction: the whole context stays cached (the baseline)",
    },
    PolicyInfo {
        name: "window",
        about: "StreamingLLM: attention sinks + the most recent tokens",
    },
    PolicyInfo {
        name: "h2o",
        about: "H2O: heavy hitters by accumulated attention + recent window",
    },
    PolicyInfo {
        name: "tova",
        about: "TOVA: keep what the current query attends to (mean over heads and layers)",
    },
    PolicyInfo {
        name: "knorm",
        about: "K-norm: keep tokens whose keys have the lowest L2 norm",
    },
    PolicyInfo {
        name: "random",
        about: "random scores (seeded), a floor for comparisons",
    },
    PolicyInfo {
        name: "epikv",
        about: "EPIKV-Flat: rolling z-score of hidden-state change, layer A minus layer B (attention-free)",
    },
    PolicyInfo {
        name: "epikv-raw",
        about: "EPIKV raw: rolling mean of hidden-state change, layer A minus layer B",
    },
    PolicyInfo {
        name: "epikv-band",
        about: "EPIKV band: z-scores of band-mean hidden-state change, 1.29·A − 1.0·B",
    },
    PolicyInfo {
        name: "epikv-lag",
        about: "EPIKV lag: K/V spread normalized by the previous 128-token chunk",
    },
    PolicyInfo {
        name: "epikv-seg",
        about: "EPIKV-Seg: key-variance tertile caps per 128-token segment, Flat ranking inside",
    },
];

/// Names of every policy.
pub fn names() -> Vec<&'static str> {
    POLICIES.iter().map(|p| p.name).collect()
}

/// Options shared by the scorers.
#[derive(Debug, Clone, Default)]
pub struct PolicyArgs {
    pub seed: u64,
    /// The evictor's recent window (scorers that cap per segment need it).
    pub n_recent: usize,
    /// EPIKV layer/window choices.
    pub epikv: epikv::EpikvOptions,
}

/// Build a scorer by name (`Ok(None)` for `full`).
pub fn by_name(name: &str, n_slots: usize, args: &PolicyArgs) -> Result<Option<Box<dyn Scorer>>> {
    Ok(Some(match name {
        "full" => return Ok(None),
        "window" => Box::new(window::Window),
        "h2o" => Box::new(h2o::H2o::new(n_slots)),
        "tova" => Box::new(tova::Tova::new(n_slots)),
        "knorm" => Box::new(knorm::KNorm::new(n_slots)),
        "random" => Box::new(random::Random::new(n_slots, args.seed)),
        name if epikv::Variant::from_name(name).is_some() => Box::new(epikv::Epikv::new(
            epikv::Variant::from_name(name).unwrap_or(epikv::Variant::Flat),
            n_slots,
            args.epikv.clone(),
            args.n_recent,
        )),
        other => {
            return Err(Error::arg(
                "--policy",
                format!("unknown policy '{other}' (known: {})", names().join(", ")),
            ))
        }
    }))
}

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
    /// Evict in batches: when over budget, free `evict_every - 1` extra slots
    /// so the next steps need no scoring.
    pub evict_every: usize,
}

impl Evictor {
    /// Whether the token at `pos` is protected when the newest position after
    /// the step will be `newest`.
    #[inline]
    pub fn protected(&self, pos: i64, newest: i64) -> bool {
        (pos as usize) < self.n_sink
            || (pos as usize) < self.keep_prompt_until
            || pos > newest - self.n_recent as i64
    }

    /// How many protected tokens there can be at most (for feasibility checks).
    pub fn max_protected(&self) -> usize {
        self.n_sink.max(self.keep_prompt_until) + self.n_recent
    }

    /// Victims to free before writing `n_new` tokens whose last position is
    /// `newest`: the lowest-scored unprotected live slots (ties: older first).
    /// `scores[i]` belongs to `live_slots[i]`.
    pub fn select(
        &self,
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
        let mut need = n_live + n_new - self.budget;
        let mut cand: Vec<usize> = (0..n_live)
            .filter(|&i| !self.protected(live_pos[i], newest))
            .collect();
        if cand.len() < need {
            return Err(Error::arg(
                "--kv-budget",
                format!(
                    "budget {} cannot hold the protected tokens: {} live, {} new, only {} evictable (sinks {}, recent {}, prompt {}){}",
                    self.budget,
                    n_live,
                    n_new,
                    cand.len(),
                    self.n_sink,
                    self.n_recent,
                    if self.keep_prompt_until == usize::MAX { "all".to_string() } else { self.keep_prompt_until.to_string() },
                    if self.keep_prompt_until > 0 {
                        "; the prompt is kept: raise --kv-budget, or choose a prompt-phase policy with --prompt-policy (or --epikv-score-prompt)"
                    } else {
                        ""
                    }
                ),
            ));
        }
        need = (need + self.evict_every.max(1) - 1).min(cand.len());
        // (score, position) is a total order: partition out the `need`
        // lowest in O(n) instead of sorting every candidate each step.
        let order = |&a: &usize, &b: &usize| {
            scores[a]
                .total_cmp(&scores[b])
                .then(live_pos[a].cmp(&live_pos[b]))
        };
        if need < cand.len() {
            cand.select_nth_unstable_by(need, order);
        }
        cand[..need].sort_unstable_by(order);
        victims.extend(cand[..need].iter().map(|&i| live_slots[i]));
        Ok(())
    }
}
