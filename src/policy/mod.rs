//! Eviction policies: a policy is a **scorer** × a **budget rule**, with
//! optional **wrappers** around the scorer (kvpress's presses are the
//! model).
//!
//! - A [`Scorer`] ranks cached entries, higher = keep, and never mutates
//!   the cache. It declares once, as data ([`Needs`]), which signals of the
//!   forward pass it reads (hidden-state taps, recent queries, attention
//!   mass, attention inputs); it is prepared with a [`ModelView`] (config
//!   and weights), observes every forward step ([`Step`]) and scores the
//!   entries of a [`ScoreCtx`], which says which entries (one per token, or
//!   every entry of the per-(layer, KV-head) streams over budget) and under
//!   which budget and protection rules.
//! - A [`BudgetRule`] (`budget.rs`) says how the budget is shared:
//!   token-uniform (one slot map), per stream (SnapKV), per layer with a
//!   safeguard (Ada-KV), pyramid (PyramidKV), or global across every layer
//!   and head.
//! - A wrapper ([`wrap::Rescorer`]) takes any scorer and rescores its
//!   output, seeing the inner scores, the model and the group budget.
//! - One [`Evictor`] (`evict.rs`) applies the protection rules shared by
//!   every policy (sinks, recent window, prompt) and picks the
//!   lowest-scored unprotected entries of every group over budget (ties:
//!   older position first, then the lower stream), for the token-uniform
//!   and the stream layouts alike.
//!
//! [`POLICIES`] (`table.rs`) is the single registry: one row per policy
//! (name, help, constructor, defaults, capabilities); the CLI's `--policy`
//! values, `--help`, the server and the tests all read it. A new scorer is
//! one file plus one row; a new budget rule is one `BudgetRule` variant; a
//! new wrapper is one `Rescorer` implementation plus the rows that use it.
//! [`PolicyConfig`] (`config.rs`) is the clap-free configuration the CLI
//! flags and the server's request fields both resolve to.

pub mod budget;
pub mod config;
pub mod critical;
pub mod epikv;
pub mod evict;
pub mod expected;
pub mod gates;
pub mod h2o;
pub mod headkv;
pub mod knorm;
pub mod lagkv;
pub mod raas;
pub mod random;
pub mod rkv;
pub mod scissorhands;
pub mod snapkv;
pub mod streams;
pub mod table;
pub mod thinkv;
pub mod tova;
pub mod trimkv;
pub mod window;
pub mod wrap;

use crate::backend::pool::ThreadPool;
use crate::error::{Error, Field, Msg, Result};
use crate::kv::KvCache;
pub use crate::model::ModelView;
pub use crate::signals::{MassMode, Needs, Signals};
pub use budget::BudgetRule;
pub use config::PolicyConfig;
pub use evict::Evictor;
use streams::StreamPlan;
pub use table::{find, names, Caps, PolicyDef, POLICIES};

/// How a budgeted policy meets a prompt longer than its budget.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PromptCompress {
    /// Prefill in chunks of budget/8, evicting between chunks: memory
    /// never exceeds the budget (prompts of any length).
    #[default]
    Stream,
    /// Prefill the whole prompt with the fused attention (the cache grows
    /// to hold it: transient memory = the prompt), then compress it to the
    /// budget once with the policy's scores, the observation window being
    /// the prompt's last queries (the question): the setting SnapKV,
    /// AdaKV, PyramidKV, CriticalKV and kvpress were published in.
    /// Decoding then keeps the budget with the policy's decode-time rule.
    Once,
}

impl PromptCompress {
    /// `stream` or `once`.
    pub fn parse(s: &str) -> Result<PromptCompress> {
        match s {
            "stream" | "" => Ok(PromptCompress::Stream),
            "once" => Ok(PromptCompress::Once),
            _ => Err(Error::config(
                Field::PromptCompress,
                format!("unknown mode '{s}' (known: stream, once)"),
            )),
        }
    }

    /// The flag's spelling.
    pub fn name(self) -> &'static str {
        match self {
            PromptCompress::Stream => "stream",
            PromptCompress::Once => "once",
        }
    }
}

/// The cache a scorer's per-slot state indexes, given at `prepare`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheShape {
    /// Slots (token-uniform) or pool rows (streams) of the cache.
    pub n_slots: usize,
    /// The budget the scorer's phase works under (tokens per layer per KV head).
    pub budget: usize,
}

/// One forward step, as a scorer observes it after the step's K/V were
/// written.
#[derive(Debug)]
pub struct Step<'a> {
    pub kv: &'a KvCache,
    /// Slots the step's tokens were written to, (n,) (stream caches:
    /// (n_streams, n), stream-major).
    pub slots: &'a [u32],
    /// Positions of the step's tokens, (n,).
    pub positions: &'a [i64],
    /// Everything the session's forward pass recorded (the union of what
    /// its scorers need; taps are looked up by layer).
    pub signals: &'a Signals,
    /// (n_slots,) attention mass exported for this scorer this step (None
    /// when the step exported none for it).
    pub mass: Option<&'a [f32]>,
    /// First position after the prompt (0 in a prompt phase: every token
    /// is ranked).
    pub prompt_end: i64,
    /// The host thread pool (for scorers that compute per written entry).
    pub pool: &'a ThreadPool,
}

/// The entries a scorer ranks.
#[derive(Debug, Clone, Copy)]
pub enum Entries<'a> {
    /// One score per live token: `out[i]` belongs to `slots[i]` at
    /// `pos[i]` (position order).
    Tokens { slots: &'a [u32], pos: &'a [i64] },
    /// Per-(layer, KV-head) streams: stream s (l · n_kv_heads + h) owns
    /// `out[off[s]..off[s + 1]]`, in the order of its live list; only
    /// streams with `want[s]` (their group is over budget) need scores, the
    /// others may be left stale.
    Streams {
        plan: &'a StreamPlan,
        want: &'a [bool],
        off: &'a [usize],
    },
}

/// What a scorer ranks and under which rules.
#[derive(Debug, Clone, Copy)]
pub struct ScoreCtx<'a> {
    pub kv: &'a KvCache,
    pub signals: &'a Signals,
    pub pool: &'a ThreadPool,
    /// The phase's protection rules and token budget.
    pub rules: &'a Evictor,
    /// Position of the newest token once the step is written.
    pub newest: i64,
    /// Tokens the step about to be written adds (per stream; 0 when
    /// compressing a prompt): the evictor keeps budget − n_new − (evict_every
    /// − 1) entries per stream of a group.
    pub n_new: usize,
    /// First position after the prompt (0 in a prompt phase).
    pub prompt_end: i64,
    pub entries: Entries<'a>,
}

impl ScoreCtx<'_> {
    /// The budget of the group stream `s` belongs to (token-uniform: the
    /// cache budget, `s` ignored).
    pub fn group_budget(&self, s: usize) -> usize {
        match self.entries {
            Entries::Tokens { .. } => self.rules.budget,
            Entries::Streams { plan, .. } => plan.group_of(s).map_or(0, |g| g.budget),
        }
    }
}

/// Ranks cached entries; higher = keep. Token-uniform scorers give one
/// score per live token (`Entries::Tokens`), per-stream scorers one per
/// entry of each (layer, KV-head) stream (`Entries::Streams`). Per-slot
/// state lives in the scorer, indexed by slot.
pub trait Scorer: std::fmt::Debug + Send {
    /// The signals the forward pass must produce (asked once, after
    /// `prepare`; default: none, zero cost).
    fn needs(&self) -> Needs {
        Needs::none()
    }
    /// Whether the scorer ranks per-(layer, KV-head) stream entries (it
    /// then needs a stream budget rule); default: one score per token.
    fn per_stream(&self) -> bool {
        false
    }
    /// Resolve model-dependent settings and size per-slot state, once the
    /// model and the cache are known.
    fn prepare(&mut self, _model: &ModelView<'_>, _cache: CacheShape) -> Result<()> {
        Ok(())
    }
    /// A forward step wrote new tokens (K/V stored, signals recorded).
    fn observe(&mut self, _step: &Step<'_>) {}
    /// Fill `out` with the score of every entry of `ctx.entries`.
    fn score(&mut self, ctx: &ScoreCtx<'_>, out: &mut [f32]);
    /// Forget per-sequence state.
    fn reset(&mut self) {}
    /// The cache was re-laid out (`KvCache::resize_slots` /
    /// `resize_regions`: grown for a prompt prefilled whole, shrunk back
    /// to the budget after compressing it): it now has `n_slots` slots and
    /// the entry of slot `from` lives in slot `to`, for every `(from, to)`
    /// of `map` (every live entry). A scorer with per-slot state must move
    /// it ([`relocate_slots`]); the default, for scorers without any, does
    /// nothing.
    fn relocate(&mut self, _map: &[(u32, u32)], _n_slots: usize) {}
}

/// Move per-slot state after a cache re-layout: `v` holds `width` values
/// per slot; afterwards it holds `n_slots` slots, slot `to` carrying what
/// slot `from` held for every `(from, to)` of `map`, the others zeroed.
pub fn relocate_slots<T: Copy + Default>(
    v: &mut Vec<T>,
    width: usize,
    map: &[(u32, u32)],
    n_slots: usize,
) {
    let mut out = vec![T::default(); n_slots * width];
    for &(f, t) in map {
        let (f, t) = (f as usize * width, t as usize * width);
        if f + width <= v.len() && t + width <= out.len() {
            out[t..t + width].copy_from_slice(&v[f..f + width]);
        }
    }
    *v = out;
}

/// A scorer and the budget rule it ranks under, with the registry row's
/// name and capabilities.
#[derive(Debug)]
pub struct Policy {
    pub name: &'static str,
    pub caps: Caps,
    pub scorer: Box<dyn Scorer>,
    pub rule: BudgetRule,
}

impl Policy {
    /// Pair `scorer` with `rule` (a per-stream scorer needs a stream rule,
    /// a token scorer the token-uniform one).
    pub fn new(
        name: &'static str,
        caps: Caps,
        scorer: Box<dyn Scorer>,
        rule: BudgetRule,
    ) -> Result<Policy> {
        if scorer.per_stream() != rule.streams() {
            return Err(Error::config(
                Field::Policy,
                Msg::default().t(format!(
                    "{name}: its scorer ranks {} but its budget rule is {:?}",
                    if scorer.per_stream() {
                        "per-(layer, KV-head) streams"
                    } else {
                        "tokens"
                    },
                    rule
                )),
            ));
        }
        Ok(Policy {
            name,
            caps,
            scorer,
            rule,
        })
    }
}

/// A budgeted KV cache: the policy (scorer × budget rule), the evictor
/// that enforces the budget and protection, and an optional prompt phase.
#[derive(Debug)]
pub struct KvPolicy {
    pub name: &'static str,
    pub caps: Caps,
    pub scorer: Box<dyn Scorer>,
    pub rule: BudgetRule,
    pub evictor: Evictor,
    /// A different policy for the prompt (`--prompt-policy`).
    pub prompt: Option<PromptPhase>,
    /// Per-(layer, KV-head) budgets of a stream rule (set by the session).
    pub plan: Option<StreamPlan>,
    /// `--prompt-compress once`: the prompt is prefilled whole (the cache
    /// grows to hold it) and compressed to the budget once at its end.
    pub compress_once: bool,
}

impl KvPolicy {
    /// One policy for prompt and generation.
    pub fn new(p: Policy, evictor: Evictor) -> KvPolicy {
        KvPolicy {
            name: p.name,
            caps: p.caps,
            scorer: p.scorer,
            rule: p.rule,
            evictor,
            prompt: None,
            plan: None,
            compress_once: false,
        }
    }
}

/// The prompt phase of a two-phase policy: while the prompt is prefilled,
/// `scorer` ranks and `evictor` (its own, smaller budget, prompt not
/// protected) trims; the prompt tokens that survive are then kept, and the
/// main policy works in the rest of the budget. Token-uniform only.
#[derive(Debug)]
pub struct PromptPhase {
    pub name: &'static str,
    pub scorer: Box<dyn Scorer>,
    pub evictor: Evictor,
}

impl PromptPhase {
    /// `p` (token-uniform) trimming the prompt under `evictor`.
    pub fn new(p: Policy, evictor: Evictor) -> Result<PromptPhase> {
        if p.rule.streams() {
            return Err(Error::config(
                Field::PromptPolicy,
                Msg::default().t(format!(
                    "{} keeps per-head streams; a prompt phase works with token-uniform policies only",
                    p.name
                )),
            ));
        }
        Ok(PromptPhase {
            name: p.name,
            scorer: p.scorer,
            evictor,
        })
    }
}
