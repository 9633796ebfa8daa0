//! The policy registry: one row per `--policy` value, with its one-line
//! help, its constructor (scorer × budget rule), its default recent window
//! and eviction cadence, and its capabilities. The CLI's `--policy` values
//! and `--help`, the server and the tests read this table; nothing else
//! compares policy names.

use super::budget::BudgetRule;
use super::critical::{Critical, CriticalOptions};
use super::epikv::{Epikv, EpikvOptions, Variant};
use super::expected::ExpectedAttention;
use super::gates::Gates;
use super::headkv::HeadScores;
use super::lagkv::{LagKv, Reference};
use super::rkv::{Rkv, RkvOptions};
use super::scissorhands::Scissorhands;
use super::snapkv::{SnapKv, SnapOptions};
use super::trimkv::Retention;
use super::wrap::Wrapped;
use super::{h2o, knorm, raas, random, thinkv, tova, window, Policy, Scorer};
use crate::error::{Error, Field, Msg, Result};
use std::sync::Arc;

/// What a policy can be combined with.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Caps {
    /// `--pos-mode cache` (StreamingLLM's in-cache positions) applies: the
    /// resident set is sinks + a contiguous recent window, as in the paper.
    pub cache_positions: bool,
    /// A server slot may keep the session between requests (reset, not
    /// rebuilt): nothing in the policy depends on the request (a seed does).
    pub reusable_session: bool,
    /// Per-(layer, KV-head) streams (else token-uniform).
    pub streams: bool,
    /// Reads EPIKV's per-model layer config (`<model stem>.epikv.json`
    /// next to the model) when no `--epikv-config` is given.
    pub epikv_config: bool,
    /// Reads learned retention gates (`--gates`, default
    /// `<model stem>.gates.safetensors` next to the model).
    pub gates: bool,
    /// Reads per-head importance scores (`--head-scores`, default
    /// `<model stem>.headkv.json` next to the model).
    pub head_scores: bool,
}

/// Default recent window (`--kv-recent`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecentDefault {
    /// min(128, budget / 4).
    QuarterBudget,
    /// The observation window (`--obs-window`).
    ObsWindow,
    /// None (learned retention finds its own recency).
    Zero,
    /// R-KV's observation window α (`--obs-window`, default 8).
    RkvWindow,
}

/// Default eviction cadence (`--evict-every`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CadenceDefault {
    /// One token per step once full.
    EveryStep,
    /// budget / 8 at a time, clamped to 1..=128 (scoring is amortized).
    EighthBudget,
}

/// A policy's defaults.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Defaults {
    pub recent: RecentDefault,
    pub evict_every: CadenceDefault,
    /// The prompt is kept (decode budget = budget − prompt) unless its
    /// tokens are scored (`--epikv-score-prompt`) or go to a prompt policy.
    pub keep_prompt: bool,
}

/// Options the constructors read.
#[derive(Debug, Clone)]
pub struct ScorerOptions {
    /// Seed of seeded scorers (`random`).
    pub seed: u64,
    /// EPIKV layer/window choices.
    pub epikv: EpikvOptions,
    /// Observation-window options (snapkv, adakv, pyramidkv).
    pub snap: SnapOptions,
    /// CriticalKV's α and ε (critical-*).
    pub critical: CriticalOptions,
    /// Retention gates (trimkv, dbtrimkv).
    pub gates: Option<Arc<Gates>>,
    /// dbtrimkv: entries each stream keeps whatever the global ranking says.
    pub min_per_head: usize,
    /// trimkv/dbtrimkv: queries the retention score sums over.
    pub trim_lookahead: usize,
    /// lagkv/lagkv-causal: partition length (None: budget/8 in 16..=128).
    pub lag_size: Option<usize>,
    /// rkv: window, pooling kernel and λ.
    pub rkv: RkvOptions,
    /// scissorhands: history window (steps).
    pub history: usize,
    /// expected-attention: query rows of the statistics.
    pub ea_window: usize,
    /// headkv: per-(layer, KV head) importance scores.
    pub head_scores: Option<Arc<HeadScores>>,
}

impl Default for ScorerOptions {
    fn default() -> Self {
        ScorerOptions {
            seed: 0,
            epikv: EpikvOptions::default(),
            snap: SnapOptions::default(),
            critical: CriticalOptions::default(),
            gates: None,
            min_per_head: 0,
            trim_lookahead: 0,
            lag_size: None,
            rkv: RkvOptions::default(),
            history: super::scissorhands::MAX_HISTORY,
            ea_window: super::expected::DEFAULT_WINDOW,
            head_scores: None,
        }
    }
}

/// Builds a policy's scorer and budget rule.
pub type Make = fn(&ScorerOptions) -> Result<(Box<dyn Scorer>, BudgetRule)>;

/// One registry row.
#[derive(Debug, Clone, Copy)]
pub struct PolicyDef {
    pub name: &'static str,
    pub about: &'static str,
    /// The constructor (None: `full`, no eviction).
    pub make: Option<Make>,
    pub defaults: Defaults,
    pub caps: Caps,
}

impl PolicyDef {
    /// Whether the policy evicts (everything but `full`); it then needs a budget.
    pub fn budgeted(&self) -> bool {
        self.make.is_some()
    }

    /// The scorer × budget rule (None for `full`).
    pub fn build(&self, o: &ScorerOptions) -> Result<Option<Policy>> {
        let Some(make) = self.make else {
            return Ok(None);
        };
        let (scorer, rule) = make(o)?;
        Policy::new(self.name, self.caps, scorer, rule).map(Some)
    }

    /// The recent window when `--kv-recent` is not given.
    pub fn default_recent(&self, budget: usize, snap: &SnapOptions, rkv: &RkvOptions) -> usize {
        match self.defaults.recent {
            RecentDefault::QuarterBudget => (budget / 4).min(128),
            RecentDefault::ObsWindow => snap.window,
            RecentDefault::Zero => 0,
            RecentDefault::RkvWindow => rkv.window,
        }
    }

    /// The eviction cadence when `--evict-every` is not given.
    pub fn default_evict_every(&self, budget: usize) -> usize {
        match self.defaults.evict_every {
            CadenceDefault::EveryStep => 1,
            CadenceDefault::EighthBudget => (budget / 8).clamp(1, 128),
        }
    }
}

const TOKEN: Defaults = Defaults {
    recent: RecentDefault::QuarterBudget,
    evict_every: CadenceDefault::EveryStep,
    keep_prompt: false,
};
const STREAM: Defaults = Defaults {
    recent: RecentDefault::ObsWindow,
    evict_every: CadenceDefault::EighthBudget,
    keep_prompt: false,
};
const EPIKV: Defaults = Defaults {
    keep_prompt: true,
    ..TOKEN
};
const PLAIN: Caps = Caps {
    cache_positions: false,
    reusable_session: true,
    streams: false,
    epikv_config: false,
    gates: false,
    head_scores: false,
};
/// Token-uniform, scoring amortized over batches of budget/8.
const BATCHED: Defaults = Defaults {
    evict_every: CadenceDefault::EighthBudget,
    ..TOKEN
};
/// Per-stream, attention-free: recent window min(128, budget/4).
const LAG: Defaults = Defaults {
    recent: RecentDefault::QuarterBudget,
    ..STREAM
};
const RKV: Defaults = Defaults {
    recent: RecentDefault::RkvWindow,
    ..STREAM
};
const TRIM: Defaults = Defaults {
    recent: RecentDefault::Zero,
    ..STREAM
};
const GATED: Caps = Caps {
    streams: true,
    gates: true,
    ..PLAIN
};
const STREAMS: Caps = Caps {
    streams: true,
    ..PLAIN
};
const EPIKV_CAPS: Caps = Caps {
    epikv_config: true,
    ..PLAIN
};

fn tokens(s: impl Scorer + 'static) -> Result<(Box<dyn Scorer>, BudgetRule)> {
    Ok((Box::new(s), BudgetRule::Tokens))
}

fn obs(o: &ScorerOptions, rule: BudgetRule) -> Result<(Box<dyn Scorer>, BudgetRule)> {
    Ok((Box::new(SnapKv { opts: o.snap }), rule))
}

/// `base`'s scorer rescored by CriticalKV, under `base`'s budget rule.
fn critical(
    o: &ScorerOptions,
    base: (Box<dyn Scorer>, BudgetRule),
) -> Result<(Box<dyn Scorer>, BudgetRule)> {
    let (inner, rule) = base;
    Ok((
        Box::new(Wrapped::new(inner, Critical::new(o.critical))),
        rule,
    ))
}

fn adakv(o: &ScorerOptions) -> Result<(Box<dyn Scorer>, BudgetRule)> {
    obs(
        o,
        BudgetRule::PerLayer {
            safeguard: o.snap.safeguard,
        },
    )
}

fn pyramid(o: &ScorerOptions) -> Result<(Box<dyn Scorer>, BudgetRule)> {
    obs(
        o,
        BudgetRule::Pyramid {
            window: o.snap.window,
            beta: o.snap.beta,
        },
    )
}

/// Learned retention under `rule`.
fn retention(o: &ScorerOptions, rule: BudgetRule) -> Result<(Box<dyn Scorer>, BudgetRule)> {
    let gates = o
        .gates
        .clone()
        .ok_or_else(|| Error::config(Field::Gates, "no retention gates loaded"))?;
    Ok((Box::new(Retention::new(gates, o.trim_lookahead)), rule))
}

fn epikv(o: &ScorerOptions, v: Variant) -> Result<(Box<dyn Scorer>, BudgetRule)> {
    tokens(Epikv::new(v, o.epikv.clone()))
}

fn lagkv(o: &ScorerOptions, r: Reference) -> Result<(Box<dyn Scorer>, BudgetRule)> {
    Ok((Box::new(LagKv::new(r, o.lag_size)?), BudgetRule::PerStream))
}

fn rkv(o: &ScorerOptions) -> Result<(Box<dyn Scorer>, BudgetRule)> {
    o.rkv.check()?;
    Ok((Box::new(Rkv { opts: o.rkv }), BudgetRule::PerStream))
}

/// HeadKV: SnapKV votes under fixed per-head budgets from the scores.
fn headkv(o: &ScorerOptions) -> Result<(Box<dyn Scorer>, BudgetRule)> {
    let scores = o
        .head_scores
        .clone()
        .ok_or_else(|| Error::config(Field::HeadScores, "no head scores loaded"))?;
    Ok((
        Box::new(SnapKv { opts: o.snap }),
        BudgetRule::Heads {
            scores,
            window: o.snap.window,
        },
    ))
}

/// Every policy `--policy` accepts.
pub const POLICIES: &[PolicyDef] = &[
    PolicyDef {
        name: "full",
        about: "no eviction: the whole context stays cached (the baseline)",
        make: None,
        defaults: TOKEN,
        caps: PLAIN,
    },
    PolicyDef {
        name: "window",
        about: "StreamingLLM: attention sinks + the most recent tokens",
        make: Some(|_| tokens(window::Window)),
        defaults: TOKEN,
        caps: Caps {
            cache_positions: true,
            ..PLAIN
        },
    },
    PolicyDef {
        name: "h2o",
        about: "H2O: heavy hitters by accumulated attention + recent window",
        make: Some(|_| tokens(h2o::H2o::default())),
        defaults: TOKEN,
        caps: PLAIN,
    },
    PolicyDef {
        name: "tova",
        about: "TOVA: keep what the current query attends to (mean over heads and layers)",
        make: Some(|_| tokens(tova::Tova::default())),
        defaults: TOKEN,
        caps: PLAIN,
    },
    PolicyDef {
        name: "snapkv",
        about: "SnapKV: per-head votes of the last 32 queries (pooled), equal budget per (layer, KV head)",
        make: Some(|o| obs(o, BudgetRule::PerStream)),
        defaults: STREAM,
        caps: STREAMS,
    },
    PolicyDef {
        name: "adakv",
        about: "Ada-KV: SnapKV scores, a layer's heads share its budget adaptively (20% safeguard per head)",
        make: Some(adakv),
        defaults: STREAM,
        caps: STREAMS,
    },
    PolicyDef {
        name: "pyramidkv",
        about: "PyramidKV: SnapKV scores, per-layer budgets shrinking with depth (beta 20)",
        make: Some(pyramid),
        defaults: STREAM,
        caps: STREAMS,
    },
    PolicyDef {
        name: "critical-snapkv",
        about: "CriticalKV over SnapKV: half of each head's budget by attention, the rest by attention × ‖V·W_O‖₁",
        make: Some(|o| critical(o, obs(o, BudgetRule::PerStream)?)),
        defaults: STREAM,
        caps: STREAMS,
    },
    PolicyDef {
        name: "critical-adakv",
        about: "CriticalKV over Ada-KV: head budgets from SnapKV scores, two-stage selection inside each head",
        make: Some(|o| critical(o, adakv(o)?)),
        defaults: STREAM,
        caps: STREAMS,
    },
    PolicyDef {
        name: "critical-pyramidkv",
        about: "CriticalKV over PyramidKV: per-layer budgets shrinking with depth, two-stage selection per head",
        make: Some(|o| critical(o, pyramid(o)?)),
        defaults: STREAM,
        caps: STREAMS,
    },
    PolicyDef {
        name: "critical-h2o",
        about: "CriticalKV over H2O: half the budget by accumulated attention, the rest by attention × ‖V·W_O‖₁",
        make: Some(|o| critical(o, tokens(h2o::H2o::default())?)),
        defaults: TOKEN,
        caps: PLAIN,
    },
    PolicyDef {
        name: "critical-tova",
        about: "CriticalKV over TOVA: half the budget by the current query's attention, the rest weighted by ‖V·W_O‖₁",
        make: Some(|o| critical(o, tokens(tova::Tova::default())?)),
        defaults: TOKEN,
        caps: PLAIN,
    },
    PolicyDef {
        name: "trimkv",
        about: "TRIM-KV: learned retention gates score (age · log β), equal budget per (layer, KV head)",
        make: Some(|o| retention(o, BudgetRule::PerStream)),
        defaults: TRIM,
        caps: GATED,
    },
    PolicyDef {
        name: "dbtrimkv",
        about: "DBTrimKV: learned retention, one global budget over all layers and heads (lengths vary per head)",
        make: Some(|o| {
            retention(
                o,
                BudgetRule::Global {
                    min_per_head: o.min_per_head,
                },
            )
        }),
        defaults: TRIM,
        caps: GATED,
    },
    PolicyDef {
        name: "knorm",
        about: "K-norm: keep tokens whose keys have the lowest L2 norm",
        make: Some(|_| tokens(knorm::KNorm::default())),
        defaults: TOKEN,
        caps: PLAIN,
    },
    PolicyDef {
        name: "lagkv",
        about: "LagKV: per-head K/V spread normalized by the NEXT partition's min/max (attention-free; last partition kept)",
        make: Some(|o| lagkv(o, Reference::Next)),
        defaults: LAG,
        caps: STREAMS,
    },
    PolicyDef {
        name: "lagkv-causal",
        about: "LagKV, causal: per-head K/V spread normalized by the PREVIOUS partition (attention-free)",
        make: Some(|o| lagkv(o, Reference::Prev)),
        defaults: LAG,
        caps: STREAMS,
    },
    PolicyDef {
        name: "rkv",
        about: "R-KV: per-head importance from the last 8 queries minus key redundancy (mean cosine), λ 0.1",
        make: Some(rkv),
        defaults: RKV,
        caps: STREAMS,
    },
    PolicyDef {
        name: "expected-attention",
        about: "Expected Attention: attention expected from future queries' statistics (mean, covariance) × ‖v‖, per head",
        make: Some(|o| {
            Ok((
                Box::new(ExpectedAttention::new(o.ea_window)?),
                BudgetRule::PerStream,
            ))
        }),
        defaults: STREAM,
        caps: STREAMS,
    },
    PolicyDef {
        name: "headkv",
        about: "HeadKV: SnapKV votes under fixed per-head budgets from offline head-importance scores",
        make: Some(headkv),
        defaults: STREAM,
        caps: Caps {
            head_scores: true,
            ..STREAMS
        },
    },
    PolicyDef {
        name: "scissorhands",
        about: "Scissorhands: evict tokens most often below-average attention over the last 64 steps",
        make: Some(|o| tokens(Scissorhands::new(o.history)?)),
        defaults: BATCHED,
        caps: PLAIN,
    },
    PolicyDef {
        name: "thinkv",
        about: "ThinKV: 128-token segments classed by attention entropy (caps R 64, E 32, T 8), accumulated attention inside",
        make: Some(|_| tokens(thinkv::ThinKv::default())),
        defaults: TOKEN,
        caps: PLAIN,
    },
    PolicyDef {
        name: "raas",
        about: "RaaS: prompt kept, decode tokens evicted least-recently-attended first (LRU on median attention)",
        make: Some(|_| tokens(raas::Raas::default())),
        defaults: EPIKV,
        caps: PLAIN,
    },
    PolicyDef {
        name: "random",
        about: "random scores (seeded), a floor for comparisons",
        make: Some(|o| tokens(random::Random::new(o.seed))),
        defaults: TOKEN,
        caps: Caps {
            reusable_session: false,
            ..PLAIN
        },
    },
    PolicyDef {
        name: "epikv",
        about: "EPIKV-Flat: rolling z-score of hidden-state change, layer A minus layer B (attention-free)",
        make: Some(|o| epikv(o, Variant::Flat)),
        defaults: EPIKV,
        caps: EPIKV_CAPS,
    },
    PolicyDef {
        name: "epikv-raw",
        about: "EPIKV raw: rolling mean of hidden-state change, layer A minus layer B",
        make: Some(|o| epikv(o, Variant::Raw)),
        defaults: EPIKV,
        caps: EPIKV_CAPS,
    },
    PolicyDef {
        name: "epikv-band",
        about: "EPIKV band: z-scores of band-mean hidden-state change, 1.29·A − 1.0·B",
        make: Some(|o| epikv(o, Variant::Band)),
        defaults: EPIKV,
        caps: EPIKV_CAPS,
    },
    PolicyDef {
        name: "epikv-lag",
        about: "EPIKV lag: K/V spread normalized by the previous 128-token chunk",
        make: Some(|o| epikv(o, Variant::Lag)),
        defaults: EPIKV,
        caps: EPIKV_CAPS,
    },
    PolicyDef {
        name: "epikv-seg",
        about: "EPIKV-Seg: key-variance tertile caps per 128-token segment, Flat ranking inside",
        make: Some(|o| epikv(o, Variant::Seg)),
        defaults: EPIKV,
        caps: EPIKV_CAPS,
    },
];

/// The row named `name`, if any.
pub fn find(name: &str) -> Option<&'static PolicyDef> {
    POLICIES.iter().find(|p| p.name == name)
}

/// The row named `name`; an unknown name is an error about `field`
/// listing every policy.
pub fn lookup(name: &str, field: Field) -> Result<&'static PolicyDef> {
    find(name).ok_or_else(|| {
        Error::config(
            field,
            Msg::from(format!(
                "unknown policy '{name}' (known: {})",
                names().join(", ")
            )),
        )
    })
}

/// Names of every policy.
pub fn names() -> Vec<&'static str> {
    POLICIES.iter().map(|p| p.name).collect()
}
