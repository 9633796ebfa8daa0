//! The forward pass of llama-family decoders (llama, qwen2), shaped like
//! llama2.c's `forward()`: one function per block, one comment per step,
//! shapes on every buffer. It processes a batch of `n` consecutive tokens (a
//! prefill chunk, or one token when decoding) against the KV cache.
//!
//! This file says *what* is computed; every step is an operation of the
//! [`Backend`] the weights live on (CPU today), so the same code runs on any
//! backend. It never names a device type.

use crate::backend::{AttnStep, Backend, Host};
use crate::error::{Error, Result};
use crate::kv::{KvCache, PosMode};
use crate::model::{Expert, Ffn, FfnAct, LayerWeights, Weights};
use crate::signals::{MassMode, QueryWindow, StepSignals};

/// Which rows of logits the caller wants.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// Only the last token's (generation).
    Last,
    /// Every token's (evaluation, parity tests).
    All,
}

/// Activations and scratch for one sequence, sized for `n_batch` tokens at
/// a time, on backend `B`.
#[derive(Debug)]
pub struct RunState<B: Backend = Host> {
    pub n_batch: usize,
    /// (n_batch, dim) residual stream
    x: B::Act,
    /// (n_batch, max(dim, q_dim)) normed input / branch output
    xb: B::Act,
    /// (n_batch, q_dim) queries
    q: B::Act,
    /// (n_batch, q_dim) queries before RoPE (in-cache positions only)
    q_raw: B::Act,
    /// (n_batch, kv_dim) keys of the new tokens
    k: B::Act,
    /// (n_batch, kv_dim) values of the new tokens
    v: B::Act,
    /// (n_batch, q_dim) attention output, heads concatenated
    att_out: B::Act,
    /// (n_batch, ffn_dim) gate branch
    hb: B::Act,
    /// (n_batch, ffn_dim) up branch
    hb2: B::Act,
    /// mixture of experts: (n_batch, n_expert) router logits, (n_batch,
    /// dim) tokens packed for one expert and that expert's output,
    /// (n_batch · n_used, dim) weighted expert outputs in routing order
    router: B::Act,
    moe_in: B::Act,
    moe_tmp: B::Act,
    moe_y: B::Act,
    /// per expert: the (token · n_used + k) rows routed to it, their tokens
    /// and weights (host; filled per step, allocated once)
    moe_slots: Vec<Vec<u32>>,
    moe_toks: Vec<Vec<u32>>,
    moe_w: Vec<Vec<f32>>,
    /// (n_expert,) one token's routing probabilities and expert order
    moe_p: Vec<f32>,
    moe_order: Vec<u32>,
    /// matmul and attention scratch
    scratch: B::Scratch,
    /// (n_out, vocab) logits of the requested rows, on the host
    pub logits: Vec<f32>,
    /// (n,) slots reserved for the tokens of the current step
    slots: Vec<u32>,
    /// (n,) positions of the tokens of the current step
    positions: Vec<i64>,
    /// The sliding-window layers' own cache (None until the first step of
    /// a model that has such layers): exactly the window, ring-indexed.
    local_kv: Option<KvCache>,
    /// (n,) slots of the current step in `local_kv`, and the window's victims
    local_slots: Vec<u32>,
    local_victims: Vec<u32>,
    /// Rotate with LongRoPE's long factors (a context past the model's
    /// original one; set by the session).
    pub long_rope: bool,
    /// Forward steps that exported attention probabilities (a test asserts
    /// attention-free policies never make one).
    pub prob_exports: u64,
}

impl<B: Backend> RunState<B> {
    /// Forget the sliding-window layers' cache (a new sequence).
    pub fn reset_local(&mut self) {
        if let Some(k) = &mut self.local_kv {
            k.clear();
        }
    }

    /// Whether the sliding-window layers still hold what a step at position
    /// `n` needs (the `window − 1` positions before it), so the sequence
    /// can be rewound to `n`. Always true without such layers.
    pub fn can_rewind_to(&self, w: &Weights<'_, B>, n: usize) -> bool {
        let (Some(swa), Some(k)) = (&w.config.features.swa, &self.local_kv) else {
            return true;
        };
        let need = n.saturating_sub(swa.window - 1) as i64;
        // the window cache holds one run of positions, oldest first
        let (_, pos) = k.live();
        n == 0 || pos.first().is_some_and(|&p| p <= need)
    }

    /// Entries resident in the sliding-window layers' cache (tokens).
    pub fn local_resident(&self) -> usize {
        self.local_kv.as_ref().map_or(0, |k| k.cells.n_live())
    }

    /// Slots the last forward step wrote its tokens into.
    pub fn step_slots(&self) -> &[u32] {
        &self.slots
    }
    /// Positions of the last forward step's tokens.
    pub fn step_positions(&self) -> &[i64] {
        &self.positions
    }

    /// Buffers on `b` for `n_batch` tokens per call.
    pub fn new(b: &B, w: &Weights<'_, B>, n_batch: usize) -> RunState<B> {
        let c = &w.config;
        let n_batch = n_batch.max(1);
        let (ne, nu) = c.features.moe.map_or((0, 0), |m| (m.n_expert, m.n_used));
        RunState {
            n_batch,
            x: b.act(n_batch * c.dim),
            xb: b.act(n_batch * c.dim.max(c.q_dim())),
            q: b.act(n_batch * c.q_dim()),
            q_raw: b.act(0),
            k: b.act(n_batch * c.kv_dim()),
            v: b.act(n_batch * c.kv_dim()),
            att_out: b.act(n_batch * c.q_dim()),
            hb: b.act(n_batch * c.ffn_width()),
            hb2: b.act(n_batch * c.ffn_width()),
            router: b.act(n_batch * ne),
            moe_in: b.act(if ne > 0 { n_batch * c.dim } else { 0 }),
            moe_tmp: b.act(if ne > 0 { n_batch * c.dim } else { 0 }),
            moe_y: b.act(n_batch * nu * c.dim),
            moe_slots: vec![Vec::new(); ne],
            moe_toks: vec![Vec::new(); ne],
            moe_w: vec![Vec::new(); ne],
            moe_p: vec![0.0; ne],
            moe_order: Vec::with_capacity(ne),
            scratch: b.scratch(),
            logits: Vec::new(),
            slots: Vec::new(),
            positions: Vec::new(),
            local_kv: None,
            long_rope: false,
            local_slots: Vec::new(),
            local_victims: Vec::new(),
            prob_exports: 0,
        }
    }
}

/// What one forward step reads and exports besides logits.
#[derive(Debug, Default)]
pub struct StepIo<'a> {
    /// Slots to free before the new tokens are written (chosen by the evictor).
    pub victims: &'a [u32],
    /// Signals to record for the scorers (each None = not recorded, no cost).
    pub signals: StepSignals<'a>,
    /// RoPE positions: absolute (default) or in-cache (StreamingLLM pos-shift).
    pub pos_mode: PosMode,
    /// The tokens are (part of) a prompt: attention runs the batch kernel
    /// even for one token (see `AttnStep::prompt`).
    pub prompt: bool,
}

/// Run `tokens` (at absolute positions `pos0..pos0+n`, n ≤ `s.n_batch`)
/// through the model after freeing `io.victims`, appending their K/V to `kv`;
/// returns the logits of the last `n_out` tokens, row-major (n_out, vocab).
#[allow(clippy::too_many_arguments)]
pub fn forward<'s, B: Backend>(
    b: &B,
    w: &Weights<'_, B>,
    s: &'s mut RunState<B>,
    kv: &mut KvCache,
    tokens: &[u32],
    pos0: usize,
    n_out: usize,
    io: StepIo<'_>,
) -> Result<&'s [f32]> {
    let vocab = w.config.vocab;
    if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(Error::Other(format!(
            "token id {bad} out of range (vocab {vocab})"
        )));
    }
    if tokens.len() > s.n_batch || n_out > tokens.len() {
        return Err(Error::Other(format!(
            "forward: {} tokens / {n_out} outputs exceed batch {}",
            tokens.len(),
            s.n_batch
        )));
    }
    s.logits.clear();
    forward_chunk(b, w, s, kv, tokens, pos0, n_out, io)?;
    // a device backend reports here what failed during the step
    b.check()?;
    Ok(&s.logits)
}

/// One chunk of n ≤ n_batch tokens; appends logits of its last `n_out` rows.
#[allow(clippy::too_many_arguments)]
fn forward_chunk<B: Backend>(
    b: &B,
    w: &Weights<'_, B>,
    s: &mut RunState<B>,
    kv: &mut KvCache,
    tokens: &[u32],
    pos0: usize,
    n_out: usize,
    io: StepIo<'_>,
) -> Result<()> {
    let c = &w.config;
    let n = tokens.len();
    let dim = c.dim;

    // free the victims and take one cache slot per new token (the cache's
    // single mutation point)
    s.positions.clear();
    s.positions.extend((0..n).map(|i| (pos0 + i) as i64));
    kv.apply(io.victims, &s.positions, &mut s.slots)?;
    let n_slots = kv.cells.n_slots();

    // what attention must do this step: causal over the live entries, at
    // absolute or in-cache positions, exporting probabilities if asked
    let export = io.signals.mass.is_some() && io.signals.mass_mode != MassMode::None;
    if export {
        s.prob_exports += 1;
    }
    let fx = &c.features;
    let st = AttnStep {
        n,
        pos0,
        n_heads: c.n_heads,
        n_kv_heads: c.n_kv_heads,
        head_dim: c.head_dim,
        cache_positions: io.pos_mode == PosMode::Cache,
        mass: if export {
            io.signals.mass_mode
        } else {
            MassMode::None
        },
        mass_w: 1.0 / (c.n_heads * c.n_cache_layers()) as f32,
        scale: fx.attn_scale,
        window: 0,
        prompt: io.prompt,
    };
    // sliding-window layers: their own cache drops what left the window
    // (and anything past pos0 from an earlier sequence), then takes the
    // new tokens; they attend at absolute positions and export nothing
    let mut local_kv = match &fx.swa {
        Some(swa) => Some(window_step(b, s, kv.ty, c, swa.window, n)?),
        None => None,
    };
    let st_local = AttnStep {
        cache_positions: false,
        mass: MassMode::None,
        window: fx.swa.as_ref().map_or(0, |w| w.window),
        ..st
    };
    if let Some(lk) = &local_kv {
        b.begin_attention(&mut s.scratch, lk, &st_local);
    }
    b.begin_attention(&mut s.scratch, &*kv, &st);
    let mut taps = io.signals.taps;
    let mut queries = io.signals.queries;
    let mut attn_inputs = io.signals.attn_inputs;
    if let Some(t) = taps.as_deref_mut() {
        t.begin_step(n);
    }
    if let Some(a) = attn_inputs.as_deref_mut() {
        a.begin_step(n);
    }

    // token embeddings: x[i] = token_embd[tokens[i]] · embed_scale  (n, dim)
    b.embed(&w.token_embd, tokens, &mut s.x);
    if fx.embed_scale != 1.0 {
        b.scale(&mut s.x, fx.embed_scale, n * dim);
    }

    // cache layer (budgeted cache) and local layer (window cache) counters
    let (mut ci, mut li) = (0usize, 0usize);
    let rope = match (&w.rope_long, s.long_rope) {
        (Some(r), true) => r,
        _ => &w.rope,
    };
    for (l, lw) in w.layers.iter().enumerate() {
        let local = c.is_local(l);
        // attention rmsnorm                                     (n, dim)
        b.rmsnorm(&s.x, 0, &lw.attn_norm, c.norm_eps, n, &mut s.xb);
        if local {
            let (lk, rope) = (
                local_kv
                    .as_mut()
                    .expect("window cache of a model with local layers"),
                w.rope_local.as_ref().unwrap_or(&w.rope),
            );
            attention_block(b, w, s, lk, lw, li, true, rope, &st_local, None);
            li += 1;
        } else {
            // keep the attention block's input for scorers that read it
            if let Some(a) = attn_inputs.as_deref_mut() {
                a.record(ci, &b.host(&s.xb, 0..n * dim));
            }
            let q = queries.as_deref_mut();
            attention_block(b, w, s, kv, lw, ci, false, rope, &st, q);
            ci += 1;
        }
        // post-attention norm (gemma3)                           (n, dim)
        if let Some(pn) = &lw.post_attn_norm {
            b.rmsnorm_rows(&mut s.xb, pn, c.norm_eps, n);
        }
        // residual, then the ffn rmsnorm                         (n, dim)
        b.add_rmsnorm(&mut s.x, &mut s.xb, &lw.ffn_norm, c.norm_eps, n);
        ffn_block(b, s, lw, c, n);
        // post-ffn norm (gemma3)                                 (n, dim)
        if let Some(pn) = &lw.post_ffn_norm {
            b.rmsnorm_rows(&mut s.xb, pn, c.norm_eps, n);
        }
        // residual                                               (n, dim)
        b.add(&mut s.x, &s.xb, n, dim);

        // hidden-state taps: g_l(t) = ‖x_l(t) − x_l(t−1)‖       (n, n_taps)
        if let Some(t) = taps.as_deref_mut() {
            if let Ok(ti) = t.layers.binary_search(&l) {
                t.record(ti, &b.host(&s.x, 0..n * dim), n, dim);
            }
        }
    }
    s.local_kv = local_kv;
    if let Some(t) = taps {
        t.end_step();
    }
    if let Some(qw) = queries {
        qw.advance(n);
    }

    // the exported attention mass into the caller's (n_slots,) buffer
    if let (true, Some(out)) = (export, io.signals.mass) {
        b.end_attention(&mut s.scratch, n_slots, out);
    }

    if n_out == 0 {
        return Ok(());
    }
    // final rmsnorm of the requested rows                        (n_out, dim)
    let first = n - n_out;
    b.rmsnorm(&s.x, first, &w.output_norm, c.norm_eps, n_out, &mut s.xb);

    // classifier into logits, read back to the host             (n_out, vocab)
    let base = s.logits.len();
    s.logits.resize(base + n_out * c.vocab, 0.0);
    b.matmul_host(
        &mut s.scratch,
        w.output(),
        &s.xb,
        n_out,
        &mut s.logits[base..],
    );
    // final soft cap: logit = cap · tanh(logit / cap)
    let cap = fx.logit_softcap;
    if cap > 0.0 {
        for v in &mut s.logits[base..] {
            *v = cap * (*v / cap).tanh();
        }
    }
    Ok(())
}

/// Before a step of `n` tokens (positions `s.positions`): the window
/// cache of the sliding-window layers frees every entry a query of this
/// step cannot see (at or before pos0 − window) or that belongs to an
/// earlier sequence (at or after pos0), then takes the new tokens. It
/// holds window − 1 + n entries at most, `window` when decoding. Created
/// at the first step (as the budgeted cache's type), grown when a step is
/// longer than any before.
fn window_step<B: Backend>(
    b: &B,
    s: &mut RunState<B>,
    ty: crate::kv::KvType,
    c: &crate::model::Config,
    window: usize,
    n: usize,
) -> Result<KvCache> {
    let n_local = c.n_layers - c.n_cache_layers();
    let need = window - 1 + n.max(s.n_batch);
    let make = |sh: crate::kv::StoreShape| b.kv_store(sh.ty, sh.n_rows, sh.row_vals);
    let mut lk = match s.local_kv.take() {
        Some(k) if k.ty == ty => k,
        _ => KvCache::uniform_on(&make, n_local, c.kv_dim(), c.head_dim, need, ty)?,
    };
    let pos0 = s.positions.first().copied().unwrap_or(0);
    let lo = pos0 - window as i64 + 1;
    // anything at or past pos0 is from before a rewind: dropped as the
    // budgeted cache drops it (ring head back, the fresh run's layout)
    if lk.live().1.last().is_some_and(|&p| p >= pos0) {
        lk.rewind(pos0.max(0) as usize)?;
    }
    // what left the window
    s.local_victims.clear();
    let (slots, pos) = lk.live();
    s.local_victims.extend(
        slots
            .iter()
            .zip(pos)
            .filter(|&(_, &p)| p < lo)
            .map(|(&sl, _)| sl),
    );
    if lk.cells.n_slots() < window - 1 + n {
        let mut map = Vec::new();
        lk.apply(&s.local_victims, &[], &mut s.local_slots)?;
        s.local_victims.clear();
        lk.resize_slots(window - 1 + n, &mut map)?;
    }
    lk.apply(&s.local_victims, &s.positions, &mut s.local_slots)?;
    Ok(lk)
}

/// Attention block of layer `l`: from the normed input `s.xb` (n, dim) to
/// the attention output projected back into `s.xb` (n, dim).
/// `kv` is the budgeted cache (layer `l` counts cache layers) or, for a
/// sliding-window layer (`local`), the window cache (`l` counts local
/// layers); `rope` is that layer's rotation.
#[allow(clippy::too_many_arguments)]
fn attention_block<B: Backend>(
    b: &B,
    w: &Weights<'_, B>,
    s: &mut RunState<B>,
    kv: &mut KvCache,
    lw: &LayerWeights<'_, B>,
    l: usize,
    local: bool,
    rope: &crate::backend::Rope,
    st: &AttnStep,
    queries: Option<&mut QueryWindow>,
) {
    let c = &w.config;
    let (n, pos0) = (st.n, st.pos0);
    let (q_dim, kv_dim) = (c.q_dim(), c.kv_dim());

    // q, k, v projections (+ biases for qwen2)             (n, q_dim), (n, kv_dim) x2
    b.matmul(
        &mut s.scratch,
        &[&lw.wq, &lw.wk, &lw.wv],
        &s.xb,
        n,
        &mut [&mut s.q, &mut s.k, &mut s.v],
    );
    for (buf, bias) in [(&mut s.q, &lw.bq), (&mut s.k, &lw.bk), (&mut s.v, &lw.bv)] {
        if let Some(bias) = bias {
            b.add_bias(buf, bias, n);
        }
    }

    // per-head RMSNorm of queries and keys (qwen3, gemma3)  (n·heads, head_dim)
    if let (Some(qn), Some(kn)) = (&lw.q_norm, &lw.k_norm) {
        b.rmsnorm_rows(&mut s.q, qn, c.norm_eps, n * c.n_heads);
        b.rmsnorm_rows(&mut s.k, kn, c.norm_eps, n * c.n_kv_heads);
    }

    // RoPE on q and k at each token's absolute position (in-cache
    // positions are applied in attention, from the unrotated queries)
    if st.cache_positions {
        b.copy(&mut s.q_raw, &s.q, n * q_dim);
    }
    b.rope(rope, &mut s.q, &mut s.k, st);

    // keep the newest queries for scorers that vote with them
    if let Some(qw) = queries {
        qw.record(l, &b.host(&s.q, 0..n * q_dim), n, pos0);
    }

    // store k (post-RoPE) and v in the new tokens' slots
    let slots = if local { &s.local_slots } else { &s.slots };
    b.kv_write(&mut *kv, l, slots, &s.k, &s.v, n, kv_dim);

    // multi-head attention over the live entries, causal by position:
    // att_out[i, h] = softmax(q[i,h]·K[j] / √hd, pos_j ≤ pos_i) @ V[j]
    b.attention(
        &mut s.scratch,
        &*kv,
        st,
        l,
        rope,
        &s.q,
        &s.q_raw,
        &mut s.att_out,
    );

    // output projection                                      (n, dim)
    b.matmul(&mut s.scratch, &[&lw.wo], &s.att_out, n, &mut [&mut s.xb]);
}

/// Gated feed-forward block: s.xb (n, dim) → down(act(gate(x)) · up(x))
/// into s.xb (n, dim), act = SiLU (SwiGLU) or GELU (GeGLU).
fn ffn_block<B: Backend>(
    b: &B,
    s: &mut RunState<B>,
    lw: &LayerWeights<'_, B>,
    c: &crate::model::Config,
    n: usize,
) {
    let (gate, up, down) = match &lw.ffn {
        Ffn::Dense { gate, up, down } => (gate, up, down),
        Ffn::Moe { router, experts } => return moe_block(b, s, router, experts, c, n),
    };
    let ffn = c.ffn_dim;
    //                                                        (n, ffn) x2
    b.matmul(
        &mut s.scratch,
        &[gate, up],
        &s.xb,
        n,
        &mut [&mut s.hb, &mut s.hb2],
    );
    match c.features.ffn_act {
        FfnAct::Silu => b.swiglu(&mut s.hb, &s.hb2, n, ffn),
        FfnAct::GeluTanh => b.geglu(&mut s.hb, &s.hb2, n, ffn),
    }
    //                                                        (n, dim)
    b.matmul(&mut s.scratch, &[down], &s.hb, n, &mut [&mut s.xb]);
}

/// Mixture-of-experts block (qwen3moe): s.xb (n, dim) → Σ_k w_k ·
/// expert_k(x) into s.xb (n, dim). Per token the router's softmax picks
/// the `n_used` most probable experts (ties: lower index), their
/// probabilities renormalized to sum to 1; each expert runs once per step
/// on the tokens routed to it (packed), so only the chosen experts'
/// weights are read; outputs are summed per token in routing order.
fn moe_block<B: Backend>(
    b: &B,
    s: &mut RunState<B>,
    router: &B::Mat<'_>,
    experts: &[Expert<'_, B>],
    c: &crate::model::Config,
    n: usize,
) {
    let Some(m) = c.features.moe else { return };
    let (ne, k, fe, dim) = (m.n_expert, m.n_used, m.expert_ffn, c.dim);
    // router logits                                         (n, n_expert)
    b.matmul(&mut s.scratch, &[router], &s.xb, n, &mut [&mut s.router]);
    let logits = b.host(&s.router, 0..n * ne);
    for e in 0..ne {
        s.moe_slots[e].clear();
        s.moe_toks[e].clear();
        s.moe_w[e].clear();
    }
    for t in 0..n {
        // softmax over the experts, then the top n_used
        let row = &logits[t * ne..(t + 1) * ne];
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0f64;
        for (p, &x) in s.moe_p.iter_mut().zip(row) {
            *p = (x - max).exp();
            sum += *p as f64;
        }
        let inv = (1.0 / sum) as f32;
        for p in s.moe_p.iter_mut() {
            *p *= inv;
        }
        s.moe_order.clear();
        s.moe_order.extend(0..ne as u32);
        let p = &s.moe_p;
        s.moe_order.select_nth_unstable_by(k - 1, |&x, &y| {
            p[y as usize].total_cmp(&p[x as usize]).then(x.cmp(&y))
        });
        s.moe_order[..k]
            .sort_unstable_by(|&x, &y| p[y as usize].total_cmp(&p[x as usize]).then(x.cmp(&y)));
        let norm = if m.norm_weights {
            1.0 / s.moe_order[..k].iter().map(|&e| p[e as usize]).sum::<f32>()
        } else {
            1.0
        };
        for (j, &e) in s.moe_order[..k].iter().enumerate() {
            s.moe_slots[e as usize].push((t * k + j) as u32);
            s.moe_toks[e as usize].push(t as u32);
            s.moe_w[e as usize].push(p[e as usize] * norm);
        }
    }
    drop(logits);
    // each chosen expert on its tokens: w · down(silu(gate(x)) · up(x))
    for (e, ex) in experts.iter().enumerate() {
        let ne_t = s.moe_toks[e].len();
        if ne_t == 0 {
            continue;
        }
        b.gather_rows(&s.xb, &s.moe_toks[e], dim, &mut s.moe_in); //  (n_e, dim)
        b.matmul(
            &mut s.scratch,
            &[&ex.gate, &ex.up],
            &s.moe_in,
            ne_t,
            &mut [&mut s.hb, &mut s.hb2],
        ); //                                                     (n_e, fe) x2
        b.swiglu(&mut s.hb, &s.hb2, ne_t, fe);
        b.matmul(
            &mut s.scratch,
            &[&ex.down],
            &s.hb,
            ne_t,
            &mut [&mut s.moe_tmp],
        );
        b.scatter_rows(&mut s.moe_y, &s.moe_tmp, &s.moe_slots[e], &s.moe_w[e], dim);
    }
    // sum the n_used weighted outputs of each token            (n, dim)
    b.sum_groups(&s.moe_y, k, n, dim, &mut s.xb);
}
