//! The decode loop: a `Session` owns the run state, KV cache and thread pool
//! for one sequence; `generate` prefills a prompt and samples tokens until an
//! end-of-generation token or the `-n` limit, streaming text as it goes.

use crate::backend::cpu::Cpu;
use crate::backend::{Backend, Host};
use crate::error::{Error, Result};
use crate::kv::{KvCache, KvType, Layout, PosMode, StoreShape};
use crate::model::llama::{forward, HiddenTaps, Logits, MassMode, QueryWindow, RunState, StepIo};
use crate::model::Weights;
use crate::policy::streams::{stream_offsets, StreamPlan};
use crate::policy::{Evictor, Scorer};
use crate::sample::Sampler;
use crate::tokenizer::Tokenizer;
use std::time::Instant;

/// A budgeted KV cache: the scorer that ranks tokens and the evictor that
/// enforces the budget and protection.
#[derive(Debug)]
pub struct KvPolicy {
    pub scorer: Box<dyn Scorer>,
    pub evictor: Evictor,
    /// A different policy for the prompt (`--prompt-policy`).
    pub prompt: Option<PromptPhase>,
    /// Per-(layer, KV-head) budgets of a stream scorer (set by the session).
    pub plan: Option<StreamPlan>,
}

impl KvPolicy {
    /// One scorer for prompt and generation.
    pub fn new(scorer: Box<dyn Scorer>, evictor: Evictor) -> KvPolicy {
        KvPolicy {
            scorer,
            evictor,
            prompt: None,
            plan: None,
        }
    }
}

/// The prompt phase of a two-phase policy: while the prompt is prefilled,
/// `scorer` ranks and `evictor` (its own, smaller budget, prompt not
/// protected) trims; the prompt tokens that survive are then kept, and the
/// main policy works in the rest of the budget.
#[derive(Debug)]
pub struct PromptPhase {
    pub scorer: Box<dyn Scorer>,
    pub evictor: Evictor,
}

/// Tokens the evictor always keeps per stream (sinks + recent window).
fn e_protected(e: &Evictor) -> usize {
    e.n_sink + e.n_recent
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
    /// Residual-stream taps the scorer asked for (None = no cost).
    taps: Option<HiddenTaps>,
    /// Recent query rows the scorer asked for (None = no cost).
    queries: Option<QueryWindow>,
    /// (n_streams + 1,) score offsets of the streams (stream policies).
    offsets: Vec<usize>,
    /// (n_streams,) streams whose group must evict this step.
    want: Vec<bool>,
    /// Entries evicted so far (all streams; `n_evicted` is this / streams).
    evicted_entries: usize,
    /// Step-level attention mass export buffer, (n_slots,).
    mass: Vec<f32>,
    scores: Vec<f32>,
    victims: Vec<u32>,
    logits: Vec<f32>,
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
}

impl<'w, B: Backend> Session<'w, B> {
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
        let e = &policy.evictor;
        if e.budget == 0 {
            return Err(Error::arg("--kv-budget", "must be at least 1"));
        }
        if e.n_sink + e.n_recent >= e.budget {
            return Err(Error::arg(
                "--kv-budget",
                format!("budget {} cannot hold the protected tokens (sinks {} + recent {}) plus one new token", e.budget, e.n_sink, e.n_recent),
            ));
        }
        // A prefill chunk must fit next to the protected tokens, and since
        // the cache is trimmed to budget - chunk before each chunk, a small
        // chunk (1/8 of the budget) keeps the cache nearly full throughout.
        let room = e.budget - e.n_sink - e.n_recent;
        let mut n_batch = n_batch.min(room).min((e.budget / 8).max(1)).max(1);
        let budget = e.budget;
        let mut policy = policy;
        policy.scorer.prepare(&w.config)?;
        policy.scorer.set_budget(budget);
        if let Some(pp) = &mut policy.prompt {
            let pe = &pp.evictor;
            if pe.budget > budget || pe.n_sink + pe.n_recent >= pe.budget {
                return Err(Error::arg(
                    "--prompt-budget",
                    format!(
                        "prompt budget {} must be at most --kv-budget {budget} and hold sinks {} + recent {} plus one token",
                        pe.budget, pe.n_sink, pe.n_recent
                    ),
                ));
            }
            let room = pe.budget - pe.n_sink - pe.n_recent;
            n_batch = n_batch.min(room).min((pe.budget / 8).max(1)).max(1);
            pp.scorer.prepare(&w.config)?;
            pp.scorer.set_budget(pe.budget);
        }
        let taps = policy.scorer.tap_layers();
        let qwin = policy.scorer.query_window();
        let c = &w.config;
        // per-(layer, KV-head) policies: a pool of head rows sized by the plan
        let plan = policy.scorer.stream_plan(c, budget)?;
        if let Some(plan) = &plan {
            if policy.prompt.is_some() {
                return Err(Error::arg(
                    "--prompt-policy",
                    format!(
                        "{} keeps per-head streams; a prompt phase works with token-uniform policies only",
                        policy.scorer.name()
                    ),
                ));
            }
            let mb = plan.min_stream_budget();
            if mb <= e_protected(&policy.evictor) {
                return Err(Error::arg(
                    "--kv-budget",
                    format!(
                        "{}: the smallest per-head budget {mb} cannot hold the protected tokens (sinks {} + recent {}) plus one new token",
                        policy.scorer.name(),
                        policy.evictor.n_sink,
                        policy.evictor.n_recent
                    ),
                ));
            }
            n_batch = n_batch.min(mb - e_protected(&policy.evictor)).max(1);
        }
        policy.plan = plan;
        let regions = policy.plan.as_ref().map(|p| p.regions());
        let mut s = Self::build(backend, w, n_ctx, budget, n_batch, Some(policy));
        if let Some(r) = regions {
            let b = &s.backend;
            let make = |sh: StoreShape| b.kv_store(sh.ty, sh.n_rows, sh.row_vals);
            s.kv = KvCache::streams_on(&make, c.n_layers, c.kv_dim(), c.head_dim, &r, KvType::F16)?;
        }
        if !taps.is_empty() {
            s.taps = Some(HiddenTaps::new(taps, c.dim));
        }
        if qwin > 0 {
            s.queries = Some(QueryWindow::new(qwin, c.n_layers, c.q_dim()));
        }
        Ok(s)
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
        let make = |sh: StoreShape| backend.kv_store(sh.ty, sh.n_rows, sh.row_vals);
        let kv = match KvCache::uniform_on(
            &make,
            c.n_layers,
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
            state: RunState::new(&backend, w, n_batch),
            kv,
            backend,
            n_past: 0,
            n_ctx,
            policy,
            n_evicted: 0,
            prompt_end: 0,
            pos_mode: PosMode::Absolute,
            taps: None,
            queries: None,
            offsets: Vec::new(),
            want: Vec::new(),
            evicted_entries: 0,
            mass: vec![0.0; n_slots],
            scores: Vec::new(),
            victims: Vec::new(),
            logits: Vec::new(),
        }
    }

    /// Store K and V as `ty` (`--cache-type`). Only before any token is
    /// fed: the cache is reallocated.
    pub fn set_cache_type(&mut self, ty: KvType) -> Result<()> {
        if ty == self.kv.ty {
            return Ok(());
        }
        if self.kv.cells.n_live() > 0 {
            return Err(Error::arg(
                "--cache-type",
                "the cache type can only change while the cache is empty",
            ));
        }
        let c = &self.w.config;
        let n = self.kv.cells.n_slots();
        let b = &self.backend;
        let make = |sh: StoreShape| b.kv_store(sh.ty, sh.n_rows, sh.row_vals);
        self.kv = match self.kv.layout() {
            Layout::Uniform => {
                KvCache::uniform_on(&make, c.n_layers, c.kv_dim(), c.head_dim, n, ty)?
            }
            Layout::Streams => {
                let r = self
                    .kv
                    .streams()
                    .map(|st| st.regions().to_vec())
                    .unwrap_or_default();
                KvCache::streams_on(&make, c.n_layers, c.kv_dim(), c.head_dim, &r, ty)?
            }
        };
        Ok(())
    }

    /// RoPE positions (`--pos-mode`). `Cache` (StreamingLLM's in-cache
    /// positions) needs the `window` policy, whose resident set is sinks +
    /// a contiguous recent window, as in the paper; only while the cache is
    /// empty.
    pub fn set_pos_mode(&mut self, mode: PosMode) -> Result<()> {
        if mode == self.pos_mode {
            return Ok(());
        }
        if mode == PosMode::Cache {
            let ok = self
                .policy
                .as_ref()
                .is_some_and(|p| p.scorer.name() == "window" && p.prompt.is_none());
            if !ok {
                return Err(Error::arg(
                    "--pos-mode",
                    "cache (StreamingLLM in-cache positions) needs --policy window (and no --prompt-policy)",
                ));
            }
        }
        if self.kv.cells.n_live() > 0 {
            return Err(Error::arg(
                "--pos-mode",
                "the position mode can only change while the cache is empty",
            ));
        }
        self.pos_mode = mode;
        Ok(())
    }

    /// The recent query rows kept for the scorer (stream policies), if any.
    pub fn queries(&self) -> Option<&QueryWindow> {
        self.queries.as_ref()
    }

    /// Forget the sequence.
    pub fn reset(&mut self) {
        self.kv.clear();
        self.n_past = 0;
        self.n_evicted = 0;
        self.evicted_entries = 0;
        if let Some(t) = &mut self.taps {
            t.reset();
        }
        if let Some(q) = &mut self.queries {
            q.reset();
        }
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
        self.evict_range(n, self.n_past)?;
        self.n_past = n;
        // the previous token's hidden state (and recent queries) are gone with it
        if let Some(t) = &mut self.taps {
            t.reset();
        }
        if let Some(q) = &mut self.queries {
            q.reset();
        }
        Ok(())
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
            p.scorer.set_prompt_end(n);
        }
    }

    /// Feed `tokens` at the current position (in chunks of at most
    /// `n_batch`, evicting between chunks); returns the requested logits.
    pub fn feed(&mut self, tokens: &[u32], want: Logits) -> Result<&[f32]> {
        if self.n_past + tokens.len() > self.n_ctx {
            return Err(Error::ContextTooSmall {
                n_prompt: self.n_past + tokens.len(),
                n_ctx: self.n_ctx,
            });
        }
        self.logits.clear();
        let nb = self.state.n_batch;
        let mut done = 0;
        while done < tokens.len() {
            let n = (tokens.len() - done).min(nb);
            let chunk = &tokens[done..done + n];
            let last = done + n == tokens.len();
            let n_out = match want {
                Logits::All => n,
                Logits::Last if last => 1,
                Logits::Last => 0,
            };
            let pos0 = self.n_past;
            // choose victims so that resident + n stays within the budget;
            // prompt chunks go to the prompt-phase policy when there is one
            let prompt_chunk = pos0 < self.prompt_end;
            self.victims.clear();
            let mass_mode = match &mut self.policy {
                Some(p) => {
                    let (scorer, evictor) = match (&mut p.prompt, prompt_chunk) {
                        (Some(pp), true) => (&mut pp.scorer, &pp.evictor),
                        _ => (&mut p.scorer, &p.evictor),
                    };
                    let newest = (pos0 + n - 1) as i64;
                    if let (Some(plan), Some(qw)) = (&p.plan, &self.queries) {
                        // per-(layer, KV-head) streams: score every entry,
                        // evict per group
                        if plan.over(&self.kv, n, &mut self.want) {
                            stream_offsets(&self.kv, &mut self.offsets);
                            let total = self.offsets.last().copied().unwrap_or(0);
                            self.scores.resize(total, 0.0);
                            scorer.score_streams(
                                &self.kv,
                                qw,
                                self.backend.host_pool(),
                                &self.want,
                                &self.offsets,
                                &mut self.scores,
                            );
                            evictor.select_streams(
                                plan,
                                &self.kv,
                                &self.scores,
                                &self.offsets,
                                n,
                                newest,
                                &mut self.victims,
                            )?;
                        }
                    } else if self.kv.live().0.len() + n > evictor.budget {
                        let (slots, pos) = self.kv.live();
                        self.scores.resize(slots.len(), 0.0);
                        scorer.score(&self.kv, slots, pos, &mut self.scores);
                        evictor.select(slots, pos, &self.scores, n, newest, &mut self.victims)?;
                    }
                    scorer.mass_mode()
                }
                None => MassMode::None,
            };
            let io = StepIo {
                victims: &self.victims,
                mass_mode,
                mass: if mass_mode != MassMode::None {
                    Some(&mut self.mass)
                } else {
                    None
                },
                taps: self.taps.as_mut(),
                queries: self.queries.as_mut(),
                pos_mode: self.pos_mode,
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
            if let Some(p) = &mut self.policy {
                let (new_slots, new_pos) = (self.state.step_slots(), self.state.step_positions());
                if let Some(t) = &self.taps {
                    p.scorer.on_hidden(t, new_slots, new_pos);
                }
                p.scorer.on_write(&self.kv, new_slots, new_pos);
                match (&mut p.prompt, prompt_chunk) {
                    (Some(pp), true) => {
                        pp.scorer.on_write(&self.kv, new_slots, new_pos);
                        if mass_mode != MassMode::None {
                            pp.scorer.observe(&self.mass);
                        }
                    }
                    _ => {
                        if mass_mode != MassMode::None {
                            p.scorer.observe(&self.mass);
                        }
                    }
                }
            }
            done += n;
        }
        Ok(&self.logits)
    }
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
#[derive(Debug, Default)]
pub struct Utf8Stream {
    pending: Vec<u8>,
}

impl Utf8Stream {
    /// Add bytes; returns the text that is complete so far.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        match std::str::from_utf8(&self.pending) {
            Ok(s) => {
                let out = s.to_owned();
                self.pending.clear();
                out
            }
            Err(e) => {
                let good = e.valid_up_to();
                // An invalid (not merely incomplete) sequence is emitted lossily.
                let cut = if e.error_len().is_some() {
                    self.pending.len()
                } else {
                    good
                };
                let out = String::from_utf8_lossy(&self.pending[..cut]).into_owned();
                self.pending.drain(..cut);
                out
            }
        }
    }
    /// Whatever is left (lossy).
    pub fn flush(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
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
    loop {
        if opts.n_predict >= 0 && stats.n_gen as i64 >= opts.n_predict {
            stats.stop = StopReason::Length;
            break;
        }
        let ts = Instant::now();
        let next = sampler.sample(&mut logits);
        stats.sample_ms += ts.elapsed().as_secs_f64() * 1e3;
        if !opts.ignore_eos && tok.is_eog(next) {
            stats.stop = StopReason::Eog;
            break;
        }
        sampler.accept(next);
        stats.tokens.push(next);
        let text = stream.push(&tok.token_bytes(next, false));
        if !text.is_empty() && !on_text(&text) {
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
    let rest = stream.flush();
    if !rest.is_empty() {
        on_text(&rest);
    }
    stats.total_ms = t_start.elapsed().as_secs_f64() * 1e3;
    Ok(stats)
}
