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

pub mod adakv;
pub mod epikv;
pub mod h2o;
pub mod knorm;
pub mod pyramidkv;
pub mod random;
pub mod snapkv;
pub mod streams;
pub mod tova;
pub mod window;

use crate::backend::pool::ThreadPool;
use crate::error::{Error, Result};
use crate::kv::KvCache;
use crate::model::llama::{HiddenTaps, MassMode, QueryWindow};
use crate::model::Config;
use streams::StreamPlan;

/// Ranks cached entries. Token-uniform scorers (the default) give one score
/// per slot shared by every layer and head (`score`); per-(layer, KV-head)
/// scorers return a `stream_plan` and score every stream's entries
/// (`score_streams`). Per-slot state lives in the scorer, indexed by slot.
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
    /// (Token-uniform scorers; stream scorers rank with `score_streams`.)
    fn score(&mut self, _kv: &KvCache, _live_slots: &[u32], _live_pos: &[i64], out: &mut [f32]) {
        out.fill(0.0);
    }
    /// Per-(layer, KV-head) scorers: how the budget is shared among streams
    /// (None: token-uniform, the default).
    fn stream_plan(&self, _c: &Config, _budget: usize) -> Result<Option<StreamPlan>> {
        Ok(None)
    }
    /// Query rows per layer the scorer reads when ranking (default: none, no cost).
    fn query_window(&self) -> usize {
        0
    }
    /// Stream scorers: fill `out` (stream s at `off[s]..off[s + 1]`, in the
    /// order of its live list) with the score of every entry of each stream
    /// s with `want[s]` (others may be left stale); higher = keep.
    fn score_streams(
        &mut self,
        _kv: &KvCache,
        _qw: &QueryWindow,
        _pool: &ThreadPool,
        _want: &[bool],
        _off: &[usize],
        _out: &mut [f32],
    ) {
    }
    /// Forget per-sequence state.
    fn reset(&mut self) {}
}

/// One registry entry.
#[derive(Debug, Clone, Copy)]
pub struct PolicyInfo {
    pub name: &'static str,
    pub about: &'static str,
    /// Per-(layer, KV-head) streams (else token-uniform).
    pub streams: bool,
}

/// Every policy `--policy` accepts, with its one-line description.
pub const POLICIES: &[PolicyInfo] = &[
    PolicyInfo {
        name: "full",
        about: "no eviction: the whole context stays cached (the baseline)",
        streams: false,
    },
    PolicyInfo {
        name: "window",
        about: "StreamingLLM: attention sinks + the most recent tokens",
        streams: false,
    },
    PolicyInfo {
        name: "h2o",
        about: "H2O: heavy hitters by accumulated attention + recent window",
        streams: false,
    },
    PolicyInfo {
        name: "tova",
        about: "TOVA: keep what the current query attends to (mean over heads and layers)",
        streams: false,
    },
    PolicyInfo {
        name: "snapkv",
        about: "SnapKV: per-head votes of the last 32 queries (pooled), equal budget per (layer, KV head)",
        streams: true,
    },
    PolicyInfo {
        name: "adakv",
        about: "Ada-KV: SnapKV scores, a layer's heads share its budget adaptively (20% safeguard per head)",
        streams: true,
    },
    PolicyInfo {
        name: "pyramidkv",
        about: "PyramidKV: SnapKV scores, per-layer budgets shrinking with depth (beta 20)",
        streams: true,
    },
    PolicyInfo {
        name: "knorm",
        about: "K-norm: keep tokens whose keys have the lowest L2 norm",
        streams: false,
    },
    PolicyInfo {
        name: "random",
        about: "random scores (seeded), a floor for comparisons",
        streams: false,
    },
    PolicyInfo {
        name: "epikv",
        about: "EPIKV-Flat: rolling z-score of hidden-state change, layer A minus layer B (attention-free)",
        streams: false,
    },
    PolicyInfo {
        name: "epikv-raw",
        about: "EPIKV raw: rolling mean of hidden-state change, layer A minus layer B",
        streams: false,
    },
    PolicyInfo {
        name: "epikv-band",
        about: "EPIKV band: z-scores of band-mean hidden-state change, 1.29·A − 1.0·B",
        streams: false,
    },
    PolicyInfo {
        name: "epikv-lag",
        about: "EPIKV lag: K/V spread normalized by the previous 128-token chunk",
        streams: false,
    },
    PolicyInfo {
        name: "epikv-seg",
        about: "EPIKV-Seg: key-variance tertile caps per 128-token segment, Flat ranking inside",
        streams: false,
    },
];

/// Whether `name` is a per-(layer, KV-head) stream policy.
pub fn is_stream_policy(name: &str) -> bool {
    POLICIES.iter().any(|p| p.name == name && p.streams)
}

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
    /// Observation-window options (snapkv, adakv, pyramidkv).
    pub snap: snapkv::SnapOptions,
}

/// Build a scorer by name (`Ok(None)` for `full`).
pub fn by_name(name: &str, n_slots: usize, args: &PolicyArgs) -> Result<Option<Box<dyn Scorer>>> {
    Ok(Some(match name {
        "full" => return Ok(None),
        "window" => Box::new(window::Window),
        "h2o" => Box::new(h2o::H2o::new(n_slots)),
        "tova" => Box::new(tova::Tova::new(n_slots)),
        "knorm" => Box::new(knorm::KNorm::new(n_slots)),
        "snapkv" => Box::new(snapkv::SnapKv { opts: args.snap }),
        "adakv" => Box::new(adakv::AdaKv { opts: args.snap }),
        "pyramidkv" => Box::new(pyramidkv::PyramidKv { opts: args.snap }),
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
