//! The decode loop: a `Session` owns the run state, KV cache and thread pool
//! for one sequence; `generate` prefills a prompt and samples tokens until an
//! end-of-generation token or the `-n` limit, streaming text as it goes.

use crate::backend::cpu::Cpu;
use crate::backend::{Backend, Host};
use crate::error::{Error, Field, Msg, Result};
use crate::kv::{KvCache, KvType, Layout, PosMode, StoreShape};
use crate::model::llama::{forward, Logits, RunState, StepIo};
use crate::model::Weights;
use crate::model::{BackendWeights, ModelView};
use crate::policy::evict::EvictScratch;
use crate::policy::streams::stream_offsets;
use crate::policy::{CacheShape, Entries, Evictor, PolicyConfig, ScoreCtx, Step};
pub use crate::policy::{KvPolicy, PromptPhase};
use crate::sample::Sampler;
use crate::signals::{MassMode, Needs, QueryWindow, Signals};
use crate::tokenizer::Tokenizer;
use std::time::Instant;

/// Tokens the evictor always keeps per stream (sinks + recent window).
/// How far beyond the context a budget that is split unevenly across
/// streams (per-layer, pyramid, global) may go.
const UNEVEN_BUDGET_LIMIT: usize = 16;

fn e_protected(e: &Evictor) -> usize {
    e.n_sink.saturating_add(e.n_recent)
}

/// Watches every forward step without ranking anything (calibration,
/// tracing): it declares the signals it reads like a scorer does, and the
/// session records them for it.
pub trait StepObserver {
    /// Signals to record.
    fn needs(&self) -> Needs;
    /// A forward step wrote new tokens (`step.mass`: this step's attention
    /// mass, when the observer asked for it).
    fn on_step(&mut self, step: &Step<'_>);
}

/// One evicted entry, as an [`EvictionLog`] records it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EvictionEvent {
    /// `n_past` when it was evicted: the first position the evicting step
    /// wrote (the entry lived through positions `pos..step`).
    pub step: u32,
    /// The (layer · n_kv_heads + head) stream it left, or
    /// [`EvictionEvent::ALL_STREAMS`] for a token-uniform cache (every
    /// layer and head at once).
    pub stream: u32,
    /// Its position.
    pub pos: u32,
    /// The score the evictor ranked it by (lower = evicted first).
    pub score: f32,
}

impl EvictionEvent {
    /// `stream` of a token-uniform eviction.
    pub const ALL_STREAMS: u32 = u32::MAX;
}

/// Every eviction of a session, in order (`Session::record_evictions`):
/// what `kvrun viz` draws. Off by default; a session without one pays one
/// branch per step.
#[derive(Clone, Debug, Default)]
pub struct EvictionLog {
    pub events: Vec<EvictionEvent>,
}

/// The one attention-mass export a step can make for everyone who asked
/// (None when two kinds are asked for).
fn mass_for(a: MassMode, b: MassMode) -> Option<MassMode> {
    match (a, b) {
        (MassMode::None, m) | (m, MassMode::None) => Some(m),
        (x, y) if x == y => Some(x),
        _ => None,
    }
}

/// One sequence being decoded: weights (shared, immutable), the backend
/// that computes, run state and KV cache (owned, mutable), and the optional
/// eviction policy.
#[derive(Debug)]
pub struct Session<'w, B: Backend = Host> {
    pub w: &'w Weights<'w, B>,
    pub backend: B,
    pub state: RunState<B>,
    pub kv: KvCache,
    /// Tokens processed so far (the next token's position).
    pub n_past: usize,
    /// Largest position + 1 the session accepts.
    pub n_ctx: usize,
    /// None = full cache.
    pub policy: Option<KvPolicy>,
    /// Tokens evicted so far.
    pub n_evicted: usize,
    /// Positions below this are the prompt (set by `protect_prompt`).
    pub prompt_end: usize,
    /// RoPE positions of cached tokens (`--pos-mode`).
    pub pos_mode: PosMode,
    /// What the forward pass records for the scorers: the union of their
    /// needs (nothing for a full cache or attention-free policies).
    signals: Signals,
    /// Attention mass the main and the prompt-phase scorers observe.
    mass_main: MassMode,
    mass_prompt: MassMode,
    /// (n_streams + 1,) score offsets of the streams (stream policies).
    offsets: Vec<usize>,
    /// (n_streams,) streams whose group must evict this step.
    want: Vec<bool>,
    /// Entries evicted so far (all streams; `n_evicted` is this / streams).
    evicted_entries: usize,
    scores: Vec<f32>,
    victims: Vec<u32>,
    scratch: EvictScratch,
    logits: Vec<f32>,
    /// Most tokens per forward step under the budget (prefill chunks of
    /// budget/8; `state.n_batch` may be larger for a prompt prefilled whole).
    chunk: usize,
    /// (old slot, new slot) of the last cache re-layout.
    moved: Vec<(u32, u32)>,
    /// Every eviction, when asked for (`record_evictions`).
    log: Option<Box<EvictionLog>>,
    /// Asked before each forward step of a multi-chunk feed: true stops
    /// the feed with `Error::Interrupted` (`stop_between_chunks`).
    stop: Option<fn() -> bool>,
}

impl<'w> Session<'w, Cpu> {
    /// A full-cache CPU session with a context of `n_ctx` tokens, `n_threads`
    /// threads and prefill chunks of `n_batch` tokens.
    pub fn new(w: &'w Weights<'w>, n_ctx: usize, n_threads: usize, n_batch: usize) -> Session<'w> {
        Self::on(Cpu::new(n_threads), w, n_ctx, n_batch)
    }

    /// A CPU session whose cache holds at most `policy.evictor.budget`
    /// tokens (see `with_policy_on`).
    pub fn with_policy(
        w: &'w Weights<'w>,
        n_ctx: usize,
        n_threads: usize,
        n_batch: usize,
        policy: KvPolicy,
    ) -> Result<Session<'w>> {
        Self::with_policy_on(Cpu::new(n_threads), w, n_ctx, n_batch, policy)
    }

    /// A CPU session for one generation from an `n_prompt`-token prompt
    /// under `cfg` (see `for_config_on`).
    #[allow(clippy::too_many_arguments)]
    pub fn for_config(
        w: &'w Weights<'w>,
        cfg: &PolicyConfig,
        seed: u64,
        model: &std::path::Path,
        n_ctx: usize,
        n_threads: usize,
        n_batch: usize,
        n_prompt: usize,
    ) -> Result<Session<'w>> {
        Session::for_config_on(
            Cpu::new(n_threads),
            w,
            cfg,
            seed,
            model,
            n_ctx,
            n_batch,
            n_prompt,
        )
    }
}

impl<'w, B: Backend> Session<'w, B> {
    /// A session on `backend` for one generation from an `n_prompt`-token
    /// prompt under `cfg`: the policy built for `model`, a clear error when a kept
    /// prompt cannot fit next to the recent window, the prompt marked,
    /// cache type and position mode applied.
    #[allow(clippy::too_many_arguments)]
    pub fn for_config_on(
        backend: B,
        w: &'w Weights<'w, B>,
        cfg: &PolicyConfig,
        seed: u64,
        model: &std::path::Path,
        n_ctx: usize,
        n_batch: usize,
        n_prompt: usize,
    ) -> Result<Session<'w, B>> {
        // a budget beyond the context is the context (defaults that depend
        // on the budget, like the recent window, follow the clamped value)
        // (only where the budget caps each stream: a pyramid's or a shared
        // group's budget is a parameter of its split, kept as given)
        let mut clamped = cfg.clone();
        clamped.budget = cfg.budget.map(|b| b.min(n_ctx.max(1)));
        let mut built = clamped.build(seed, model)?;
        if built.as_ref().is_some_and(|p| !p.rule.caps_each_stream()) {
            built = cfg.build(seed, model)?;
        }
        let mut s = match built {
            None => Session::on(backend, w, n_ctx, n_batch),
            Some(p) => {
                check_kept_prompt(cfg, &p, n_prompt)?;
                let mut s = Session::with_policy_on(backend, w, n_ctx, n_batch, p)?;
                s.protect_prompt(n_prompt);
                s
            }
        };
        s.configure(cfg)?;
        Ok(s)
    }

    /// A full-cache session on `backend`.
    pub fn on(backend: B, w: &'w Weights<'w, B>, n_ctx: usize, n_batch: usize) -> Session<'w, B> {
        Self::build(backend, w, n_ctx, n_ctx, n_batch, None)
    }

    /// The host thread pool (scorers rank entries on it).
    pub fn pool(&self) -> &crate::backend::pool::ThreadPool {
        self.backend.host_pool()
    }

    /// A session whose cache holds at most `policy.evictor.budget` tokens,
    /// for positions up to `n_ctx`. Prefill chunks are capped so that the
    /// budget holds during prefill too.
    pub fn with_policy_on(
        backend: B,
        w: &'w Weights<'w, B>,
        n_ctx: usize,
        n_batch: usize,
        policy: KvPolicy,
    ) -> Result<Session<'w, B>> {
        let mut policy = policy;
        // a budget beyond the context never evicts: hold the context only
        // (the front ends say so), so no slot is allocated that can't be used
        if policy.rule.caps_each_stream() {
            let cap = n_ctx.max(1);
            policy.evictor.budget = policy.evictor.budget.min(cap);
            if let Some(pp) = &mut policy.prompt {
                pp.evictor.budget = pp.evictor.budget.min(cap);
            }
        } else if policy.evictor.budget > n_ctx.max(1).saturating_mul(UNEVEN_BUDGET_LIMIT) {
            // an uneven split cannot be clamped, only bounded (its rows are
            // allocated up front)
            return Err(Error::config(
                Field::Budget,
                format!(
                    "{}: budget {} is far beyond the context of {n_ctx} tokens (this policy splits its budget unevenly, so it may be up to {UNEVEN_BUDGET_LIMIT}× the context)",
                    policy.name, policy.evictor.budget
                ),
            ));
        }
        let e = &policy.evictor;
        if e.budget == 0 {
            return Err(Error::config(Field::Budget, "must be at least 1"));
        }
        if e_protected(e) >= e.budget {
            return Err(Error::config(
                Field::Budget,
                Msg::default()
                    .t(format!(
                        "budget {} cannot hold the protected tokens (",
                        e.budget
                    ))
                    .f(Field::Sink)
                    .t(format!(" {} + ", e.n_sink))
                    .f(Field::Recent)
                    .t(format!(" {}) plus one new token", e.n_recent)),
            ));
        }
        // A prefill chunk must fit next to the protected tokens, and since
        // the cache is trimmed to budget - chunk before each chunk, a small
        // chunk (1/8 of the budget) keeps the cache nearly full throughout.
        let room = e.budget - e.n_sink - e.n_recent;
        let user_batch = n_batch.max(1);
        let mut n_batch = n_batch.min(room).min((e.budget / 8).max(1)).max(1);
        let budget = e.budget;
        let c = &w.config;
        let weights = BackendWeights::new(&backend, w);
        let model = ModelView::new(c, &weights);
        // per-(layer, KV-head) rules: a pool of head rows sized by the plan
        let plan = policy.rule.plan(c, budget)?;
        if let Some(plan) = &plan {
            if policy.prompt.is_some() {
                return Err(Error::config(
                    Field::PromptPolicy,
                    format!(
                        "{} keeps per-head streams; a prompt phase works with token-uniform policies only",
                        policy.name
                    ),
                ));
            }
            let mb = plan.min_stream_budget();
            if mb <= e_protected(&policy.evictor) {
                return Err(Error::config(
                    Field::Budget,
                    format!(
                        "{}: the smallest per-head budget {mb} cannot hold the protected tokens (sinks {} + recent {}) plus one new token",
                        policy.name,
                        policy.evictor.n_sink,
                        policy.evictor.n_recent
                    ),
                ));
            }
            n_batch = n_batch.min(mb - e_protected(&policy.evictor)).max(1);
        }
        if policy.compress_once && policy.prompt.is_some() {
            return Err(Error::config(
                Field::PromptCompress,
                Msg::default()
                    .t("once compresses the prompt with the policy itself; leave ")
                    .f(Field::PromptPolicy)
                    .t(" out"),
            ));
        }
        let n_slots = plan.as_ref().map_or(budget, |p| p.pool());
        policy
            .scorer
            .prepare(&model, CacheShape { n_slots, budget })?;
        let mut needs = policy.scorer.needs();
        let mass_main = needs.mass;
        let mut mass_prompt = MassMode::None;
        if let Some(pp) = &mut policy.prompt {
            let pe = &pp.evictor;
            if pe.budget > budget || e_protected(pe) >= pe.budget {
                return Err(Error::config(
                    Field::PromptBudget,
                    Msg::default()
                        .t(format!("prompt budget {} must be at most ", pe.budget))
                        .f(Field::Budget)
                        .t(format!(
                            " {budget} and hold sinks {} + recent {} plus one token",
                            pe.n_sink, pe.n_recent
                        )),
                ));
            }
            let room = pe.budget - pe.n_sink - pe.n_recent;
            n_batch = n_batch.min(room).min((pe.budget / 8).max(1)).max(1);
            pp.scorer.prepare(
                &model,
                CacheShape {
                    n_slots,
                    budget: pe.budget,
                },
            )?;
            // the prompt phase's signals are recorded too (whatever the
            // main policy reads)
            let pn = pp.scorer.needs();
            mass_prompt = pn.mass;
            needs = needs.union(&pn);
        }
        policy.plan = plan;
        let regions = policy.plan.as_ref().map(|p| p.regions());
        // a prompt prefilled whole runs in the caller's chunks; every other
        // multi-token feed stays in budget-sized chunks
        let chunk = n_batch;
        let alloc_batch = if policy.compress_once {
            user_batch.max(chunk).min(n_ctx.max(1))
        } else {
            chunk
        };
        let mut s = Self::build(backend, w, n_ctx, budget, alloc_batch, Some(policy));
        if let Some(r) = regions {
            let b = &s.backend;
            let make = |sh: StoreShape| b.kv_store(sh.ty, sh.n_rows, sh.row_vals);
            s.kv = KvCache::streams_on(
                &make,
                c.n_cache_layers(),
                c.kv_dim(),
                c.head_dim,
                &r,
                KvType::F16,
            )?;
        }
        s.signals = Signals::for_needs(&needs, c.into(), s.kv.cells.n_slots(), s.state.n_batch);
        s.chunk = chunk;
        s.mass_main = mass_main;
        s.mass_prompt = mass_prompt;
        Ok(s)
    }

    /// Apply the cache settings of `cfg` that hold with and without a
    /// policy (cache type, position mode); only while the cache is empty.
    pub fn configure(&mut self, cfg: &PolicyConfig) -> Result<()> {
        self.set_cache_type(cfg.cache_type)?;
        self.set_pos_mode(cfg.pos_mode)
    }

    fn build(
        backend: B,
        w: &'w Weights<'w, B>,
        n_ctx: usize,
        n_slots: usize,
        n_batch: usize,
        policy: Option<KvPolicy>,
    ) -> Session<'w, B> {
        let c = &w.config;
        // no chunk is longer than the context (a huge -b allocates nothing)
        let n_batch = n_batch.clamp(1, n_ctx.max(1));
        let make = |sh: StoreShape| backend.kv_store(sh.ty, sh.n_rows, sh.row_vals);
        let kv = match KvCache::uniform_on(
            &make,
            c.n_cache_layers(),
            c.kv_dim(),
            c.head_dim,
            n_slots,
            KvType::F16,
        ) {
            Ok(kv) => kv,
            Err(_) => unreachable!("f16 caches accept any shape"),
        };
        Session {
            w,
            state: {
                let mut st = RunState::new(&backend, w, n_batch);
                let orig = c.features.n_ctx_orig;
                st.long_rope = orig > 0 && n_ctx > orig;
                st
            },
            kv,
            backend,
            n_past: 0,
            n_ctx,
            policy,
            n_evicted: 0,
            prompt_end: 0,
            pos_mode: PosMode::Absolute,
            signals: Signals::default(),
            mass_main: MassMode::None,
            mass_prompt: MassMode::None,
            offsets: Vec::new(),
            want: Vec::new(),
            evicted_entries: 0,
            scores: Vec::new(),
            victims: Vec::new(),
            scratch: EvictScratch::default(),
            logits: Vec::new(),
            chunk: n_batch,
            moved: Vec::new(),
            log: None,
            stop: None,
        }
    }

    /// Ask `stop` before every chunk of a feed after its first (a prompt is
    /// fed in `-b`-sized chunks): when it says true the feed ends with
    /// `Error::Interrupted` and the session is left mid-prompt, so only a
    /// run that ends on it should ask (one-shot generation's Ctrl-C).
    pub fn stop_between_chunks(&mut self, stop: fn() -> bool) {
        self.stop = Some(stop);
    }

    /// Store K and V as `ty` (`--cache-type`). Only before any token is
    /// fed: the cache is reallocated.
    pub fn set_cache_type(&mut self, ty: KvType) -> Result<()> {
        if ty == self.kv.ty {
            return Ok(());
        }
        if self.kv.cells.n_live() > 0 {
            return Err(Error::config(
                Field::CacheType,
                "the cache type can only change while the cache is empty",
            ));
        }
        let c = &self.w.config;
        let n = self.kv.cells.n_slots();
        let b = &self.backend;
        let make = |sh: StoreShape| b.kv_store(sh.ty, sh.n_rows, sh.row_vals);
        self.kv = match self.kv.layout() {
            Layout::Uniform => {
                KvCache::uniform_on(&make, c.n_cache_layers(), c.kv_dim(), c.head_dim, n, ty)?
            }
            Layout::Streams => {
                let r = self
                    .kv
                    .streams()
                    .map(|st| st.regions().to_vec())
                    .unwrap_or_default();
                KvCache::streams_on(&make, c.n_cache_layers(), c.kv_dim(), c.head_dim, &r, ty)?
            }
        };
        Ok(())
    }

    /// RoPE positions (`--pos-mode`). `Cache` (StreamingLLM's in-cache
    /// positions) needs a policy whose resident set is sinks + a contiguous
    /// recent window, as in the paper (`Caps::cache_positions`: `window`),
    /// and no prompt phase; only while the cache is empty.
    pub fn set_pos_mode(&mut self, mode: PosMode) -> Result<()> {
        if mode == self.pos_mode {
            return Ok(());
        }
        if mode == PosMode::Cache {
            let ok = self
                .policy
                .as_ref()
                .is_some_and(|p| p.caps.cache_positions && p.prompt.is_none());
            if !ok {
                return Err(Error::config(
                    Field::PosMode,
                    Msg::default()
                        .t("cache (StreamingLLM in-cache positions) needs ")
                        .f(Field::Policy)
                        .t(" window (and no ")
                        .f(Field::PromptPolicy)
                        .t(")"),
                ));
            }
        }
        if self.kv.cells.n_live() > 0 {
            return Err(Error::config(
                Field::PosMode,
                "the position mode can only change while the cache is empty",
            ));
        }
        self.pos_mode = mode;
        Ok(())
    }

    /// The signals the forward pass records for this session's scorers.
    pub fn signals(&self) -> &Signals {
        &self.signals
    }

    /// The recent query rows kept for the scorer (stream policies), if any.
    pub fn queries(&self) -> Option<&QueryWindow> {
        self.signals.queries.as_ref()
    }

    /// Entries evicted since the last reset (every stream; `n_evicted` is
    /// this over the stream count, rounded down).
    pub fn evicted_entries(&self) -> usize {
        self.evicted_entries
    }

    /// Record every eviction from now on (see [`EvictionLog`]).
    pub fn record_evictions(&mut self) {
        self.log.get_or_insert_with(Box::default);
    }

    /// The evictions recorded so far (None unless `record_evictions`).
    pub fn eviction_log(&self) -> Option<&EvictionLog> {
        self.log.as_deref()
    }

    /// Append this step's victims (still resident: `self.victims`, ranked
    /// by `self.scores`) to the log.
    fn log_victims(&mut self, step: usize) {
        let Some(log) = self.log.as_deref_mut() else {
            return;
        };
        let score_at = |i: usize| self.scores.get(i).copied().unwrap_or(f32::NAN);
        for &v in &self.victims {
            let Some(pos) = self.kv.cells.pos(v as usize) else {
                continue;
            };
            let (stream, score) = match self.kv.streams() {
                // scores are laid out per stream, in its position order
                Some(st) => {
                    let s = st.owner(v as usize);
                    let i = st.stream(s).1.binary_search(&pos).ok();
                    let base = self.offsets.get(s).copied();
                    let score = match (i, base) {
                        (Some(i), Some(b)) => score_at(b + i),
                        _ => f32::NAN,
                    };
                    (s as u32, score)
                }
                // one score per live token, in position order
                None => {
                    let i = self.kv.live().1.binary_search(&pos).ok();
                    (EvictionEvent::ALL_STREAMS, i.map_or(f32::NAN, score_at))
                }
            };
            log.events.push(EvictionEvent {
                step: step as u32,
                stream,
                pos: pos as u32,
                score,
            });
        }
    }

    /// Forget the sequence.
    pub fn reset(&mut self) {
        if let Some(log) = &mut self.log {
            log.events.clear();
        }
        self.kv.clear();
        self.state.reset_local();
        self.n_past = 0;
        self.n_evicted = 0;
        self.evicted_entries = 0;
        self.signals.reset();
        if let Some(p) = &mut self.policy {
            p.scorer.reset();
            if let Some(pp) = &mut p.prompt {
                pp.scorer.reset();
            }
        }
    }

    /// Drop every cached token at position ≥ `n` and continue from `n`
    /// (used by chat to rewind to the longest prefix shared with a new
    /// rendering of the conversation). Frees slots through the cache's
    /// single mutation point.
    pub fn truncate(&mut self, n: usize) -> Result<()> {
        if n >= self.n_past {
            return Ok(());
        }
        if !self.state.can_rewind_to(self.w, n) {
            return Err(Error::Other(format!(
                "cannot rewind to position {n}: the sliding-window layers no longer hold the window before it (use Session::rewind_point)"
            )));
        }
        self.kv.rewind(n)?;
        self.n_past = n;
        // the previous token's hidden state (and recent queries) are gone with it
        self.signals.reset();
        Ok(())
    }

    /// The longest prefix of the sequence, at most `n` tokens, that
    /// `truncate` can rewind to: `n`, unless sliding-window layers have
    /// already dropped the window before it (then 0: start over).
    pub fn rewind_point(&self, n: usize) -> usize {
        let n = n.min(self.n_past);
        if self.state.can_rewind_to(self.w, n) {
            n
        } else {
            0
        }
    }

    /// Evict every cached token with a position in `lo..hi` (the rest of the
    /// cache and `n_past` stay as they are).
    pub fn evict_range(&mut self, lo: usize, hi: usize) -> Result<()> {
        let victims = self.kv.entries_in(lo, hi);
        let mut none = Vec::new();
        self.kv.apply(&victims, &[], &mut none)
    }

    /// Mark positions below `n` as prompt (protected when the policy keeps the prompt).
    pub fn protect_prompt(&mut self, n: usize) {
        self.prompt_end = n;
        if let Some(p) = &mut self.policy {
            if p.evictor.keep_prompt_until > 0 {
                p.evictor.keep_prompt_until = n;
            }
        }
    }

    /// The main scorer's scores of the live tokens (token-uniform layout),
    /// `out[i]` for `kv.live()`'s slot i, as the evictor would see them now.
    pub fn live_scores(&mut self, out: &mut Vec<f32>) -> Result<()> {
        let Some(p) = &mut self.policy else {
            return Err(Error::Other("live_scores: no policy".into()));
        };
        if p.plan.is_some() {
            return Err(Error::Other("live_scores: a stream layout".into()));
        }
        let (slots, pos) = self.kv.live();
        out.clear();
        out.resize(slots.len(), 0.0);
        let ctx = ScoreCtx {
            kv: &self.kv,
            signals: &self.signals,
            pool: self.backend.host_pool(),
            rules: &p.evictor,
            newest: self.n_past as i64,
            n_new: 0,
            prompt_end: self.prompt_end as i64,
            entries: Entries::Tokens { slots, pos },
        };
        p.scorer.score(&ctx, out);
        Ok(())
    }

    /// Feed `tokens` at the current position (in chunks of at most
    /// `n_batch`, evicting between chunks); returns the requested logits.
    pub fn feed(&mut self, tokens: &[u32], want: Logits) -> Result<&[f32]> {
        self.feed_inner(tokens, want, None)
    }

    /// `feed`, with `obs` watching every forward step (its signals are
    /// allocated on first use; the attention mass it asks for must agree
    /// with the policy's).
    pub fn feed_observed(
        &mut self,
        tokens: &[u32],
        want: Logits,
        obs: &mut dyn StepObserver,
    ) -> Result<&[f32]> {
        let needs = obs.needs();
        for policy_mass in [self.mass_main, self.mass_prompt] {
            if mass_for(needs.mass, policy_mass).is_none() {
                return Err(Error::Other(format!(
                    "an observer asking for {:?} attention mass cannot share a step with a policy observing {policy_mass:?}",
                    needs.mass
                )));
            }
        }
        let c = &self.w.config;
        self.signals.grow(
            &needs,
            c.into(),
            self.kv.cells.n_slots(),
            self.state.n_batch,
        );
        self.feed_inner(tokens, want, Some(obs))
    }

    fn feed_inner(
        &mut self,
        tokens: &[u32],
        want: Logits,
        mut obs: Option<&mut dyn StepObserver>,
    ) -> Result<&[f32]> {
        if self.n_past + tokens.len() > self.n_ctx {
            return Err(Error::ContextTooSmall {
                n_prompt: self.n_past + tokens.len(),
                n_ctx: self.n_ctx,
            });
        }
        let obs_mass = obs.as_ref().map_or(MassMode::None, |o| o.needs().mass);
        self.logits.clear();
        let once = self.policy.as_ref().is_some_and(|p| p.compress_once);
        let mut done = 0;
        while done < tokens.len() {
            if done > 0 && self.stop.is_some_and(|f| f()) {
                return Err(Error::Interrupted);
            }
            let pos0 = self.n_past;
            let prompt_chunk = pos0 < self.prompt_end;
            // a prompt compressed once is prefilled whole, in the caller's
            // chunks (never past its end); everything else in chunks that
            // fit the budget
            let whole = once && prompt_chunk;
            let nb = if whole {
                self.state.n_batch.min(self.prompt_end - pos0)
            } else {
                self.chunk
            };
            let n = (tokens.len() - done).min(nb);
            let chunk = &tokens[done..done + n];
            let last = done + n == tokens.len();
            let n_out = match want {
                Logits::All => n,
                Logits::Last if last => 1,
                Logits::Last => 0,
            };
            self.victims.clear();
            let mut in_prompt_phase = false;
            if whole {
                // room for the rest of the prompt, nothing evicted
                self.grow_for(self.prompt_end - pos0)?;
            } else if self.policy.is_some() {
                // choose victims so that resident + n stays within the
                // budget; prompt chunks go to the prompt-phase policy when
                // there is one
                in_prompt_phase =
                    prompt_chunk && self.policy.as_ref().is_some_and(|p| p.prompt.is_some());
                self.pick_victims(n, (pos0 + n - 1) as i64, in_prompt_phase, false)?;
                if self.log.is_some() {
                    self.log_victims(pos0);
                }
            }
            // the attention mass of this step: the ranking phase's scorer's
            // (and the observer's; they agree, see `feed_observed`)
            let scorer_mass = if in_prompt_phase {
                self.mass_prompt
            } else {
                self.mass_main
            };
            let mass_mode = mass_for(scorer_mass, obs_mass).unwrap_or(scorer_mass);
            let io = StepIo {
                victims: &self.victims,
                signals: self.signals.step(mass_mode),
                pos_mode: self.pos_mode,
                prompt: prompt_chunk,
            };
            let out = forward(
                &self.backend,
                self.w,
                &mut self.state,
                &mut self.kv,
                chunk,
                pos0,
                n_out,
                io,
            )?;
            self.logits.extend_from_slice(out);
            // tokens evicted (stream caches: entries over streams, i.e.
            // token equivalents)
            self.evicted_entries += self.victims.len();
            self.n_evicted = self.evicted_entries / self.kv.n_streams();
            self.n_past += n;
            let exported = match (&self.signals.mass, mass_mode) {
                (Some(m), mode) if mode != MassMode::None => Some(&m[..]),
                _ => None,
            };
            let step = |mass, prompt_end: i64| Step {
                kv: &self.kv,
                slots: self.state.step_slots(),
                positions: self.state.step_positions(),
                signals: &self.signals,
                mass,
                prompt_end,
                pool: self.backend.host_pool(),
            };
            if let Some(p) = &mut self.policy {
                // the main scorer sees every step (its per-slot state
                // follows every write); the mass is its own only outside
                // a prompt phase
                let main_mass = if in_prompt_phase || scorer_mass == MassMode::None {
                    None
                } else {
                    exported
                };
                p.scorer.observe(&step(main_mass, self.prompt_end as i64));
                if let (Some(pp), true) = (&mut p.prompt, in_prompt_phase) {
                    let pmass = if scorer_mass == MassMode::None {
                        None
                    } else {
                        exported
                    };
                    pp.scorer.observe(&step(pmass, 0));
                }
            }
            if let Some(o) = obs.as_deref_mut() {
                let omass = if obs_mass == MassMode::None {
                    None
                } else {
                    exported
                };
                o.on_step(&step(omass, self.prompt_end as i64));
            }
            // evictions under a budget shared by many streams scatter each
            // stream's rows over the pool: pack them again once enough
            // entries landed in holes (`KvCache::defragment`), per-slot
            // state following
            if !self.victims.is_empty() && self.kv.defragment(&mut self.moved)? {
                self.relocated();
            }
            done += n;
            if whole && self.n_past == self.prompt_end {
                self.compress_prompt()?;
            }
        }
        Ok(&self.logits)
    }

    /// Victims (into `self.victims`) so that writing `n_new` tokens whose
    /// last position is `newest` keeps every budget group within budget:
    /// the lowest-scored unprotected entries of each group over it, ranked
    /// by the prompt phase's scorer (`prompt_phase`) or the main one.
    /// `exact`: compressing a prompt once (no batched extra evictions).
    fn pick_victims(
        &mut self,
        n_new: usize,
        newest: i64,
        prompt_phase: bool,
        exact: bool,
    ) -> Result<()> {
        self.victims.clear();
        let Some(p) = &mut self.policy else {
            return Ok(());
        };
        let (scorer, evictor, prompt_end) = match (&mut p.prompt, prompt_phase) {
            (Some(pp), true) => (&mut pp.scorer, &pp.evictor, 0),
            _ => (&mut p.scorer, &p.evictor, self.prompt_end as i64),
        };
        let exact_rules;
        let evictor = if exact {
            exact_rules = Evictor {
                evict_every: 1,
                ..evictor.clone()
            };
            &exact_rules
        } else {
            evictor
        };
        let pool = self.backend.host_pool();
        if let Some(plan) = &p.plan {
            // per-(layer, KV-head) streams: score every entry of the groups
            // over budget, evict per group
            if plan.over(&self.kv, n_new, &mut self.want) {
                stream_offsets(&self.kv, &mut self.offsets);
                let total = self.offsets.last().copied().unwrap_or(0);
                self.scores.resize(total, 0.0);
                let ctx = ScoreCtx {
                    kv: &self.kv,
                    signals: &self.signals,
                    pool,
                    rules: evictor,
                    newest,
                    n_new,
                    prompt_end,
                    entries: Entries::Streams {
                        plan,
                        want: &self.want,
                        off: &self.offsets,
                    },
                };
                scorer.score(&ctx, &mut self.scores);
                evictor.select_streams_with(
                    &mut self.scratch,
                    plan,
                    &self.kv,
                    &self.scores,
                    &self.offsets,
                    n_new,
                    newest,
                    &mut self.victims,
                )?;
            }
        } else if self.kv.live().0.len() + n_new > evictor.budget {
            let (slots, pos) = self.kv.live();
            self.scores.resize(slots.len(), 0.0);
            let ctx = ScoreCtx {
                kv: &self.kv,
                signals: &self.signals,
                pool,
                rules: evictor,
                newest,
                n_new,
                prompt_end,
                entries: Entries::Tokens { slots, pos },
            };
            scorer.score(&ctx, &mut self.scores);
            evictor.select_with(
                &mut self.scratch,
                slots,
                pos,
                &self.scores,
                n_new,
                newest,
                &mut self.victims,
            )?;
        }
        Ok(())
    }

    /// Grow the cache (`--prompt-compress once`) so that `n_more` more
    /// tokens fit next to what is resident, without evicting: every stream
    /// region (or the slot map) gets room for them. Per-slot state follows.
    fn grow_for(&mut self, n_more: usize) -> Result<()> {
        let need = |live: usize, len: usize| live + len * n_more;
        match self.kv.streams() {
            None => {
                let want = need(self.kv.cells.n_live(), 1);
                if want > self.kv.cells.n_slots() {
                    self.kv.resize_slots(want, &mut self.moved)?;
                    self.relocated();
                }
            }
            Some(st) => {
                let mut grow = false;
                let regions: Vec<_> = st
                    .regions()
                    .iter()
                    .map(|r| {
                        let live: usize = (r.first_stream..r.first_stream + r.n_streams)
                            .map(|s| st.len(s))
                            .sum();
                        let rows = need(live, r.n_streams);
                        grow |= rows > r.rows;
                        crate::kv::streams::Region {
                            rows: rows.max(r.rows),
                            ..*r
                        }
                    })
                    .collect();
                if grow {
                    self.kv.resize_regions(&regions, &mut self.moved)?;
                    self.relocated();
                }
            }
        }
        Ok(())
    }

    /// The prompt (prefilled whole) is complete: evict down to the budget
    /// once, ranked with the prompt's last queries, then give the memory
    /// back (the cache shrinks to its budgeted size).
    fn compress_prompt(&mut self) -> Result<()> {
        let newest = self.n_past as i64 - 1;
        self.pick_victims(0, newest, false, true)?;
        if self.log.is_some() {
            self.log_victims(self.n_past);
        }
        if !self.victims.is_empty() {
            let victims = std::mem::take(&mut self.victims);
            self.kv.apply(&victims, &[], &mut Vec::new())?;
            self.evicted_entries += victims.len();
            self.n_evicted = self.evicted_entries / self.kv.n_streams();
            self.victims = victims;
            self.victims.clear();
        }
        let Some(p) = &self.policy else {
            return Ok(());
        };
        match &p.plan {
            Some(plan) => {
                let regions = plan.regions();
                if self.kv.streams().is_some_and(|st| st.regions() != regions) {
                    self.kv.resize_regions(&regions, &mut self.moved)?;
                    self.relocated();
                }
            }
            None => {
                let b = p.evictor.budget;
                if self.kv.cells.n_slots() != b {
                    self.kv.resize_slots(b, &mut self.moved)?;
                    self.relocated();
                }
            }
        }
        Ok(())
    }

    /// After a cache re-layout: scorers' per-slot state and the attention
    /// mass buffer follow the new slots.
    fn relocated(&mut self) {
        let n = self.kv.cells.n_slots();
        if let Some(p) = &mut self.policy {
            p.scorer.relocate(&self.moved, n);
            if let Some(pp) = &mut p.prompt {
                pp.scorer.relocate(&self.moved, n);
            }
        }
        self.signals.resize_slots(n);
    }
}

/// A policy `p` (built from `cfg`) that keeps the whole prompt
/// (`keep_prompt`, or the EPIKV-style default) and has no prompt phase
/// cannot take an `n_prompt`-token prompt that fills its budget next to
/// the recent window: a one-line error before anything runs, naming what
/// helps (a prompt policy, or scored prompt tokens where the prompt is
/// kept by the policy's default).
pub fn check_kept_prompt(cfg: &PolicyConfig, p: &KvPolicy, n_prompt: usize) -> Result<()> {
    let e = &p.evictor;
    if e.keep_prompt_until == 0
        || p.prompt.is_some()
        || n_prompt.saturating_add(e.n_recent) < e.budget
    {
        return Ok(());
    }
    let mut m = Msg::default()
        .t(format!(
            "budget {} cannot hold the {n_prompt}-token prompt (kept) plus the recent window {}; raise it or use ",
            e.budget, e.n_recent
        ))
        .f(Field::PromptPolicy);
    if !cfg.keep_prompt && cfg.def().is_ok_and(|d| d.defaults.keep_prompt) {
        m = m.t(" (or ").f(Field::EpikvScorePrompt).t(")");
    }
    Err(Error::config(Field::Budget, m))
}

/// Options of one generation.
#[derive(Clone, Debug)]
pub struct GenOptions {
    /// Tokens to generate; -1 = until end of generation or context full.
    pub n_predict: i64,
    /// Keep going past end-of-generation tokens.
    pub ignore_eos: bool,
}

/// Why generation stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    Eog,
    Length,
    ContextFull,
    Cancelled,
}

/// Timings and counts of one generation (llama.cpp's perf lines).
#[derive(Clone, Debug)]
pub struct GenStats {
    pub n_prompt: usize,
    pub prompt_ms: f64,
    pub n_gen: usize,
    pub gen_ms: f64,
    pub sample_ms: f64,
    pub total_ms: f64,
    pub stop: StopReason,
    pub tokens: Vec<u32>,
}

impl GenStats {
    /// The three llama.cpp-shaped timing lines.
    pub fn timing_lines(&self, prefix: &str) -> String {
        let per = |ms: f64, n: usize| if n > 0 { ms / n as f64 } else { 0.0 };
        let tps = |ms: f64, n: usize| if ms > 0.0 { 1e3 * n as f64 / ms } else { 0.0 };
        format!(
            "{prefix}: prompt eval time = {:10.2} ms / {:5} tokens ({:8.2} ms per token, {:8.2} tokens per second)\n\
             {prefix}:        eval time = {:10.2} ms / {:5} runs   ({:8.2} ms per token, {:8.2} tokens per second)\n\
             {prefix}:       total time = {:10.2} ms / {:5} tokens\n",
            self.prompt_ms,
            self.n_prompt,
            per(self.prompt_ms, self.n_prompt),
            tps(self.prompt_ms, self.n_prompt),
            self.gen_ms,
            self.n_gen,
            per(self.gen_ms, self.n_gen),
            tps(self.gen_ms, self.n_gen),
            self.total_ms,
            self.n_prompt + self.n_gen,
        )
    }
}

/// Turns token bytes into valid UTF-8 text pieces as soon as they complete.
/// A character split between tokens is held back until its last byte
/// comes; one still incomplete when the output ends is dropped (a token
/// limit cut it), never shown as U+FFFD. Bytes that can never be UTF-8
/// become U+FFFD where they stand.
#[derive(Debug, Default)]
pub struct Utf8Stream {
    pending: Vec<u8>,
}

impl Utf8Stream {
    /// Add bytes; returns the text that is complete so far.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        let mut at = 0;
        while at < self.pending.len() {
            match std::str::from_utf8(&self.pending[at..]) {
                Ok(s) => {
                    out.push_str(s);
                    at = self.pending.len();
                }
                Err(e) => {
                    let good = at + e.valid_up_to();
                    out.push_str(&String::from_utf8_lossy(&self.pending[at..good]));
                    match e.error_len() {
                        // an invalid sequence: replaced, and go on after it
                        Some(n) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            at = good + n;
                        }
                        // a character not finished yet: wait for its bytes
                        None => {
                            at = good;
                            break;
                        }
                    }
                }
            }
        }
        self.pending.drain(..at);
        out
    }
    /// The end of the output: what is left is an unfinished character
    /// (`push` emits everything else), which is dropped.
    pub fn finish(&mut self) {
        self.pending.clear();
    }
}

/// Prefill `prompt` then sample until EOG / `n_predict` / context full.
/// `on_text` receives each completed piece of text and returns false to stop.
pub fn generate<B: Backend>(
    sess: &mut Session<'_, B>,
    tok: &Tokenizer,
    sampler: &mut Sampler,
    prompt: &[u32],
    opts: &GenOptions,
    mut on_text: impl FnMut(&str) -> bool,
) -> Result<GenStats> {
    generate_steps(sess, tok, sampler, prompt, opts, false, |s| {
        s.text.is_empty() || on_text(s.text)
    })
}

/// One generated token, as [`generate_steps`] hands it over.
#[derive(Debug)]
pub struct GenStep<'a> {
    /// The token drawn (end-of-generation tokens that stop the run are not steps).
    pub token: u32,
    /// The raw logits (vocab,) it was drawn from, before the sampler's
    /// penalties; empty unless asked for.
    pub logits: &'a [f32],
    /// The text this token completes (empty while a character is split
    /// between tokens).
    pub text: &'a str,
}

/// `generate`, calling `on_step` once per generated token with the token,
/// the text it completes and, when `want_logits`, the raw logits it was
/// drawn from (a copy per token, so only when asked). `on_step` returns
/// false to stop.
pub fn generate_steps<B: Backend>(
    sess: &mut Session<'_, B>,
    tok: &Tokenizer,
    sampler: &mut Sampler,
    prompt: &[u32],
    opts: &GenOptions,
    want_logits: bool,
    mut on_step: impl FnMut(&GenStep<'_>) -> bool,
) -> Result<GenStats> {
    let t_start = Instant::now();
    if prompt.is_empty() {
        return Err(Error::arg("-p/--prompt", "the prompt is empty (no tokens)"));
    }
    if sess.n_past + prompt.len() > sess.n_ctx {
        return Err(Error::ContextTooSmall {
            n_prompt: sess.n_past + prompt.len(),
            n_ctx: sess.n_ctx,
        });
    }
    for &t in prompt {
        sampler.accept(t);
    }
    // --keep-prompt protects everything fed before generation starts
    sess.protect_prompt(sess.n_past + prompt.len());
    let mut logits = sess.feed(prompt, Logits::Last)?.to_vec();
    let prompt_ms = t_start.elapsed().as_secs_f64() * 1e3;

    let mut stats = GenStats {
        n_prompt: prompt.len(),
        prompt_ms,
        n_gen: 0,
        gen_ms: 0.0,
        sample_ms: 0.0,
        total_ms: 0.0,
        stop: StopReason::Length,
        tokens: Vec::new(),
    };
    let mut stream = Utf8Stream::default();
    // the logits before the sampler's penalties change them (want_logits)
    let mut raw: Vec<f32> = Vec::new();
    loop {
        if opts.n_predict >= 0 && stats.n_gen as i64 >= opts.n_predict {
            stats.stop = StopReason::Length;
            break;
        }
        let ts = Instant::now();
        if want_logits {
            raw.clone_from(&logits);
        }
        let next = sampler.sample(&mut logits);
        stats.sample_ms += ts.elapsed().as_secs_f64() * 1e3;
        if !opts.ignore_eos && tok.is_eog(next) {
            stats.stop = StopReason::Eog;
            break;
        }
        sampler.accept(next);
        stats.tokens.push(next);
        let text = stream.push(&tok.token_bytes(next, false));
        let step = GenStep {
            token: next,
            logits: &raw,
            text: &text,
        };
        if !on_step(&step) {
            stats.stop = StopReason::Cancelled;
            break;
        }
        if sess.n_past >= sess.n_ctx {
            // sampled but not fed: `tokens` has one more entry than `n_gen`
            stats.stop = StopReason::ContextFull;
            break;
        }
        let te = Instant::now();
        logits.clear();
        logits.extend_from_slice(sess.feed(&[next], Logits::Last)?);
        stats.gen_ms += te.elapsed().as_secs_f64() * 1e3;
        stats.n_gen += 1;
    }
    // a character cut off by the stop is dropped, not shown as U+FFFD
    stream.finish();
    stats.total_ms = t_start.elapsed().as_secs_f64() * 1e3;
    Ok(stats)
}
