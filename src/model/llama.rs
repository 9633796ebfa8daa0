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
use crate::model::{LayerWeights, Weights};
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
    /// matmul and attention scratch
    scratch: B::Scratch,
    /// (n_out, vocab) logits of the requested rows, on the host
    pub logits: Vec<f32>,
    /// (n,) slots reserved for the tokens of the current step
    slots: Vec<u32>,
    /// (n,) positions of the tokens of the current step
    positions: Vec<i64>,
    /// Forward steps that exported attention probabilities (a test asserts
    /// attention-free policies never make one).
    pub prob_exports: u64,
}

impl<B: Backend> RunState<B> {
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
        RunState {
            n_batch,
            x: b.act(n_batch * c.dim),
            xb: b.act(n_batch * c.dim.max(c.q_dim())),
            q: b.act(n_batch * c.q_dim()),
            q_raw: b.act(0),
            k: b.act(n_batch * c.kv_dim()),
            v: b.act(n_batch * c.kv_dim()),
            att_out: b.act(n_batch * c.q_dim()),
            hb: b.act(n_batch * c.ffn_dim),
            hb2: b.act(n_batch * c.ffn_dim),
            scratch: b.scratch(),
            logits: Vec::new(),
            slots: Vec::new(),
            positions: Vec::new(),
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
        mass_w: 1.0 / (c.n_heads * c.n_layers) as f32,
    };
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

    // token embeddings: x[i] = token_embd[tokens[i]]           (n, dim)
    b.embed(&w.token_embd, tokens, &mut s.x);

    for (l, lw) in w.layers.iter().enumerate() {
        // attention rmsnorm                                     (n, dim)
        b.rmsnorm(&s.x, 0, &lw.attn_norm, c.norm_eps, n, &mut s.xb);
        // keep the attention block's input for scorers that read it
        if let Some(a) = attn_inputs.as_deref_mut() {
            a.record(l, &b.host(&s.xb, 0..n * dim));
        }
        attention_block(b, w, s, kv, lw, l, &st, queries.as_deref_mut());
        // residual, then the ffn rmsnorm                         (n, dim)
        b.add_rmsnorm(&mut s.x, &mut s.xb, &lw.ffn_norm, c.norm_eps, n);
        ffn_block(b, s, lw, c.ffn_dim, n);
        // residual                                               (n, dim)
        b.add(&mut s.x, &s.xb, n, dim);

        // hidden-state taps: g_l(t) = ‖x_l(t) − x_l(t−1)‖       (n, n_taps)
        if let Some(t) = taps.as_deref_mut() {
            if let Ok(ti) = t.layers.binary_search(&l) {
                t.record(ti, &b.host(&s.x, 0..n * dim), n, dim);
            }
        }
    }
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
    Ok(())
}

/// Attention block of layer `l`: from the normed input `s.xb` (n, dim) to
/// the attention output projected back into `s.xb` (n, dim).
#[allow(clippy::too_many_arguments)]
fn attention_block<B: Backend>(
    b: &B,
    w: &Weights<'_, B>,
    s: &mut RunState<B>,
    kv: &mut KvCache,
    lw: &LayerWeights<'_, B>,
    l: usize,
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

    // RoPE on q and k at each token's absolute position (in-cache
    // positions are applied in attention, from the unrotated queries)
    if st.cache_positions {
        b.copy(&mut s.q_raw, &s.q, n * q_dim);
    }
    b.rope(&w.rope, &mut s.q, &mut s.k, st);

    // keep the newest queries for scorers that vote with them
    if let Some(qw) = queries {
        qw.record(l, &b.host(&s.q, 0..n * q_dim), n, pos0);
    }

    // store k (post-RoPE) and v in the new tokens' slots
    b.kv_write(&mut *kv, l, &s.slots, &s.k, &s.v, n, kv_dim);

    // multi-head attention over the live entries, causal by position:
    // att_out[i, h] = softmax(q[i,h]·K[j] / √hd, pos_j ≤ pos_i) @ V[j]
    b.attention(
        &mut s.scratch,
        &*kv,
        st,
        l,
        &w.rope,
        &s.q,
        &s.q_raw,
        &mut s.att_out,
    );

    // output projection                                      (n, dim)
    b.matmul(&mut s.scratch, &[&lw.wo], &s.att_out, n, &mut [&mut s.xb]);
}

/// SwiGLU feed-forward block: s.xb (n, dim) → down(silu(gate(x)) · up(x))
/// into s.xb (n, dim).
fn ffn_block<B: Backend>(
    b: &B,
    s: &mut RunState<B>,
    lw: &LayerWeights<'_, B>,
    ffn: usize,
    n: usize,
) {
    //                                                        (n, ffn) x2
    b.matmul(
        &mut s.scratch,
        &[&lw.w_gate, &lw.w_up],
        &s.xb,
        n,
        &mut [&mut s.hb, &mut s.hb2],
    );
    b.swiglu(&mut s.hb, &s.hb2, n, ffn);
    //                                                        (n, dim)
    b.matmul(&mut s.scratch, &[&lw.w_down], &s.hb, n, &mut [&mut s.xb]);
}
