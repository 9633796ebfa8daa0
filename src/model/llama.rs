//! The forward pass of llama-family decoders (llama, qwen2), shaped like
//! llama2.c's `forward()`: one function, one comment per step, shapes on
//! every buffer. It processes a batch of `n` consecutive tokens (a prefill
//! chunk, or one token when decoding) against the KV cache.

use crate::backend::cpu::{
    add, attend_group_probs_seg, attend_prefill_group_seg, matmul, matmul_q, quantize_acts,
    rmsnorm, same_act_format, swiglu, MAX_GROUP,
};
use crate::backend::pool::{split, SharedMut, ThreadPool};
use crate::error::{Error, Result};
use crate::kv::{KvCache, LayerKv, PosMode};
use crate::model::Weights;
use crate::signals::{MassMode, StepSignals};

/// Which rows of logits the caller wants.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// Only the last token's (generation).
    Last,
    /// Every token's (evaluation, parity tests).
    All,
}

/// Scratch buffers for one sequence, sized for `n_batch` tokens at a time.
#[derive(Debug)]
pub struct RunState {
    pub n_batch: usize,
    /// (n_batch, dim) residual stream
    pub x: Vec<f32>,
    /// (n_batch, dim) normed input / branch output
    xb: Vec<f32>,
    /// (n_batch, q_dim) queries
    q: Vec<f32>,
    /// (n_batch, q_dim) queries before RoPE (`PosMode::Cache` only)
    q_raw: Vec<f32>,
    /// (n_seg,) end (exclusive, in the live list) of each run of live
    /// entries sharing one offset position − in-cache index
    seg_end: Vec<usize>,
    /// (n_seg,) that offset, nondecreasing
    seg_off: Vec<i64>,
    /// (n_batch, kv_dim) keys of the new tokens
    k: Vec<f32>,
    /// (n_batch, kv_dim) values of the new tokens
    v: Vec<f32>,
    /// (n_batch, q_dim) attention output, heads concatenated
    att_out: Vec<f32>,
    /// (n_batch, ffn_dim) gate branch
    hb: Vec<f32>,
    /// (n_batch, ffn_dim) up branch
    hb2: Vec<f32>,
    /// (n_threads, n_slots) per-thread attention scores
    att: Vec<f32>,
    /// (n_out, vocab) logits of the requested rows
    pub logits: Vec<f32>,
    /// per KV head g: (n_g, hd) f32 copies of its live values for a prefill chunk
    vf: Vec<f32>,
    /// per KV head g: (hd, n_g) transposed f32 keys for a prefill chunk
    kt: Vec<f32>,
    /// (n_kv_heads + 1,) start of each KV head's block in `kt` and `vf`
    koff: Vec<usize>,
    /// (n_parts, group, head_dim) normalized outputs of decode key parts
    part_out: Vec<f32>,
    /// (n_parts, group) (max, sum) softmax statistics of decode key parts
    part_stats: Vec<(f32, f32)>,
    /// (n_parts,) (KV head, first key, end key, offset in `att`) of each part
    items: Vec<(usize, usize, usize, usize)>,
    /// (n_threads, n_slots) per-thread attention-mass accumulators
    mass_thr: Vec<f32>,
    /// quantized activations scratch
    act: Vec<u8>,
    /// (n,) slots reserved for the tokens of the current step
    slots: Vec<u32>,
    /// (n,) positions of the tokens of the current step
    positions: Vec<i64>,
    /// Forward steps that exported attention probabilities (a test asserts
    /// attention-free policies never make one).
    pub prob_exports: u64,
}

impl RunState {
    /// Slots the last forward step wrote its tokens into.
    pub fn step_slots(&self) -> &[u32] {
        &self.slots
    }
    /// Positions of the last forward step's tokens.
    pub fn step_positions(&self) -> &[i64] {
        &self.positions
    }

    /// Buffers for `n_batch` tokens per call, `n_threads` attention workers
    /// and a cache of `n_slots` slots.
    pub fn new(w: &Weights<'_>, n_batch: usize, n_threads: usize, n_slots: usize) -> RunState {
        let c = &w.config;
        let n_batch = n_batch.max(1);
        RunState {
            n_batch,
            x: vec![0.0; n_batch * c.dim],
            xb: vec![0.0; n_batch * c.dim.max(c.q_dim())],
            q: vec![0.0; n_batch * c.q_dim()],
            q_raw: Vec::new(),
            seg_end: Vec::new(),
            seg_off: Vec::new(),
            k: vec![0.0; n_batch * c.kv_dim()],
            v: vec![0.0; n_batch * c.kv_dim()],
            att_out: vec![0.0; n_batch * c.q_dim()],
            hb: vec![0.0; n_batch * c.ffn_dim],
            hb2: vec![0.0; n_batch * c.ffn_dim],
            att: vec![0.0; n_threads.max(1) * n_slots],
            logits: Vec::new(),
            vf: Vec::new(),
            kt: Vec::new(),
            koff: Vec::new(),
            part_out: Vec::new(),
            part_stats: Vec::new(),
            items: Vec::new(),
            mass_thr: Vec::new(),
            act: Vec::new(),
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
pub fn forward<'s>(
    w: &Weights<'_>,
    s: &'s mut RunState,
    kv: &mut KvCache,
    pool: &ThreadPool,
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
    forward_chunk(w, s, kv, pool, tokens, pos0, n_out, io)?;
    Ok(&s.logits)
}

/// One chunk of n ≤ n_batch tokens; appends logits of its last `n_out` rows.
fn forward_chunk(
    w: &Weights<'_>,
    s: &mut RunState,
    kv: &mut KvCache,
    pool: &ThreadPool,
    tokens: &[u32],
    pos0: usize,
    n_out: usize,
    io: StepIo<'_>,
) -> Result<()> {
    let c = &w.config;
    let n = tokens.len();
    let (dim, q_dim, kv_dim, hd, ffn) = (c.dim, c.q_dim(), c.kv_dim(), c.head_dim, c.ffn_dim);
    let n_threads = pool.n_threads();

    // free the victims and take one cache slot per new token (the cache's
    // single mutation point)
    s.positions.clear();
    s.positions.extend((0..n).map(|i| (pos0 + i) as i64));
    kv.apply(io.victims, &s.positions, &mut s.slots)?;
    let n_slots = kv.cells.n_slots();
    let group = c.n_heads / c.n_kv_heads;
    // In-cache positions (StreamingLLM pos-shift), computed exactly without
    // moving or re-rotating stored keys. Live entry j (position order) has
    // in-cache index j and stored key R(p_j)k; the query of a token at
    // position p with in-cache index c must score R(c)q · R(j)k. By RoPE's
    // relative property that equals R(a)q · R(p_j)k with a = c + (p_j − j).
    // The offset p_j − j is constant over runs of the live list (it only
    // grows where tokens were evicted), so each run gets one query rotated
    // at a = c + offset: a handful of runs (two for sinks + window), one
    // extra query rotation per run, and the run holding the query itself
    // uses the query rotated at its absolute position as usual. With no
    // eviction there is one run and the pass is the absolute one, bit for bit.
    let cache_pos = io.pos_mode == PosMode::Cache;
    s.seg_end.clear();
    s.seg_off.clear();
    {
        let (_, live_pos) = kv.live();
        if cache_pos {
            for (j, &p) in live_pos.iter().enumerate() {
                let off = p - j as i64;
                if s.seg_off.last() != Some(&off) {
                    if !s.seg_off.is_empty() {
                        s.seg_end.push(j);
                    }
                    s.seg_off.push(off);
                }
            }
        } else {
            s.seg_off.push(0);
        }
        s.seg_end.push(live_pos.len());
    }
    if s.att.len() < n_threads * group * n_slots {
        s.att.resize(n_threads * group * n_slots, 0.0);
    }
    // per-thread attention-mass accumulators, only when a scorer asks
    let export = io.signals.mass.is_some() && io.signals.mass_mode != MassMode::None;
    if export {
        s.mass_thr.clear();
        s.mass_thr.resize(n_threads * n_slots, 0.0);
        s.prob_exports += 1;
    }
    let mut taps = io.signals.taps;
    let mut queries = io.signals.queries;
    let mut attn_inputs = io.signals.attn_inputs;
    if let Some(t) = taps.as_deref_mut() {
        t.begin_step(n);
    }
    if let Some(a) = attn_inputs.as_deref_mut() {
        a.begin_step(n);
    }
    let mass_w = 1.0 / (c.n_heads * c.n_layers) as f32;

    // token embeddings: x[i] = token_embd[tokens[i]]           (n, dim)
    for (i, &t) in tokens.iter().enumerate() {
        w.token_embd
            .dequantize_row(t as usize, &mut s.x[i * dim..(i + 1) * dim]);
    }

    let scale = 1.0 / (hd as f32).sqrt();
    for (l, lw) in w.layers.iter().enumerate() {
        // attention rmsnorm                                     (n, dim)
        {
            let x = &s.x[..n * dim];
            let xb = SharedMut::new(&mut s.xb[..n * dim]);
            par_rows(pool, n, |t0, t1| {
                // SAFETY: token rows t0..t1 belong to this thread.
                let o = unsafe { xb.slice(t0 * dim, (t1 - t0) * dim) };
                rmsnorm(o, &x[t0 * dim..t1 * dim], &lw.attn_norm, c.norm_eps);
            });
        }
        // keep the attention inputs for scorers that read them
        if let Some(a) = attn_inputs.as_deref_mut() {
            a.record(l, &s.xb[..n * dim]);
        }

        // qkv matmuls (+ biases for qwen2)                      (n, q_dim), (n, kv_dim) x2
        let xb = &s.xb[..n * dim];
        if same_act_format(&lw.wq, &lw.wk) && same_act_format(&lw.wq, &lw.wv) {
            // one activation conversion feeds all three
            quantize_acts(pool, &lw.wq, xb, n, &mut s.act);
            matmul_q(pool, &lw.wq, &s.act, n, &mut s.q);
            matmul_q(pool, &lw.wk, &s.act, n, &mut s.k);
            matmul_q(pool, &lw.wv, &s.act, n, &mut s.v);
        } else {
            matmul(pool, &lw.wq, xb, n, &mut s.q, &mut s.act);
            matmul(pool, &lw.wk, xb, n, &mut s.k, &mut s.act);
            matmul(pool, &lw.wv, xb, n, &mut s.v, &mut s.act);
        }
        for (buf, b, d) in [
            (&mut s.q, &lw.bq, q_dim),
            (&mut s.k, &lw.bk, kv_dim),
            (&mut s.v, &lw.bv, kv_dim),
        ] {
            if let Some(b) = b {
                for row in buf[..n * d].chunks_exact_mut(d) {
                    add(row, b);
                }
            }
        }

        // RoPE on q and k at each token's absolute position (in-cache
        // positions are applied in attention, from the unrotated queries)
        if cache_pos {
            s.q_raw.clear();
            s.q_raw.extend_from_slice(&s.q[..n * q_dim]);
        }
        {
            let qs = SharedMut::new(&mut s.q[..n * q_dim]);
            let ks = SharedMut::new(&mut s.k[..n * kv_dim]);
            par_rows(pool, n, |t0, t1| {
                for i in t0..t1 {
                    let pos = pos0 + i;
                    // SAFETY: token rows t0..t1 belong to this thread.
                    let (q, k) =
                        unsafe { (qs.slice(i * q_dim, q_dim), ks.slice(i * kv_dim, kv_dim)) };
                    w.rope.apply(q, c.n_heads, hd, pos);
                    w.rope.apply(k, c.n_kv_heads, hd, pos);
                }
            });
        }

        // keep the newest queries for scorers that vote with them
        if let Some(qw) = queries.as_deref_mut() {
            qw.record(l, &s.q[..n * q_dim], n, pos0);
        }

        // store k (post-RoPE) and v in the new tokens' slots
        for i in 0..n {
            kv.write_token(
                l,
                i,
                n,
                &s.slots,
                &s.k[i * kv_dim..(i + 1) * kv_dim],
                &s.v[i * kv_dim..(i + 1) * kv_dim],
            );
        }

        // prefill chunks: convert each KV head's live K/V rows to f32 once
        // per layer, O(n) memory, instead of once per query: head g's keys
        // transposed (hd, n_g) at kt[koff[g]..], values (n_g, hd) at
        // vf[koff[g]..] (n_g = that head's live entries; every head has the
        // shared list in the token-uniform layout)
        let prefill = n > 1;
        if prefill {
            s.koff.clear();
            s.koff.push(0);
            for g in 0..c.n_kv_heads {
                let n_g = kv.head(l, g, false).slots.len();
                s.koff.push(s.koff[g] + n_g * hd);
            }
            let total = s.koff[c.n_kv_heads];
            s.kt.resize(total, 0.0);
            s.vf.resize(total, 0.0);
            let kvr = &*kv;
            let koff = &s.koff;
            let vfo = SharedMut::new(&mut s.vf[..]);
            let kto = SharedMut::new(&mut s.kt[..]);
            pool.run(|ti| {
                let mut krow = [0f32; 256];
                for g in 0..c.n_kv_heads {
                    let view = kvr.head(l, g, false);
                    let n_g = view.slots.len();
                    let (j0, j1) = split(n_g, ti, n_threads);
                    for j in j0..j1 {
                        let sl = view.slots[j] as usize;
                        // SAFETY: rows j0..j1 of head g belong to this thread.
                        let vd = unsafe { vfo.slice(koff[g] + j * hd, hd) };
                        kvr.head_f32(false, l, g, sl, vd);
                        // keys transposed: (hd, n_g), column j
                        kvr.head_f32(true, l, g, sl, &mut krow[..hd]);
                        for (d, &x) in krow[..hd].iter().enumerate() {
                            // SAFETY: column j of head g belongs to this thread.
                            unsafe { kto.write(koff[g] + d * n_g + j, x) };
                        }
                    }
                }
            });
        }

        // multi-head attention over live slots, causal by position:
        // att_out[i, h] = softmax(q[i,h]·K[j] * scale, pos_j ≤ pos_i) @ V[j]
        if n == 1 && !cache_pos {
            // one decoded token: every KV head's keys in parts, in parallel
            // (flash-decoding), merged by their softmax statistics
            let mass = if export && io.signals.mass_mode != MassMode::None {
                Some((&mut s.mass_thr[..n_slots], mass_w))
            } else {
                None
            };
            let dec = DecodeScratch {
                att: &mut s.att,
                part_out: &mut s.part_out,
                part_stats: &mut s.part_stats,
                items: &mut s.items,
            };
            attend_decode_split(
                kv,
                l,
                &s.q[..q_dim],
                group,
                scale,
                pool,
                dec,
                &mut s.att_out[..q_dim],
                mass,
            );
        } else {
            // decoding sees every live token: walk them in memory order
            // (in-cache positions need position order for their key runs)
            let memory_order = !(prefill || cache_pos);
            let kvr = &*kv;
            let q = &s.q;
            let (q_raw, seg_end, seg_off) = (&s.q_raw, &s.seg_end, &s.seg_off);
            let rope = &w.rope;
            let (vf, kt, koff) = (&s.vf, &s.kt, &s.koff);
            let out = SharedMut::new(&mut s.att_out[..n * q_dim]);
            let att = SharedMut::new(&mut s.att[..n_threads * group * n_slots]);
            let mthr = SharedMut::new(&mut s.mass_thr[..]);
            let mass_mode = if export {
                io.signals.mass_mode
            } else {
                MassMode::None
            };
            let n_work = n * c.n_kv_heads;
            pool.run(|ti| {
                // SAFETY: each thread uses its own rows of the score scratch.
                let sc = unsafe { att.slice(ti * group * n_slots, group * n_slots) };
                let mut stats = [(0f32, 0f32); MAX_GROUP];
                // (n_seg, group, hd) per-run queries and (n_seg,) run ends,
                // only filled for in-cache positions (no allocation otherwise)
                let mut qsegs: Vec<f32> = Vec::new();
                let mut ends: Vec<usize> = Vec::new();
                // interleaved, not contiguous: causal rows grow with i, so a
                // contiguous split would leave the last thread most of the work
                for work in (ti..n_work).step_by(n_threads) {
                    // token i, KV head g, serving query heads g*group .. (g+1)*group
                    let (i, g) = (work / c.n_kv_heads, work % c.n_kv_heads);
                    let view = kvr.head(l, g, memory_order);
                    let (live_slots, live_pos) = (view.slots, view.pos);
                    let qg = &q[i * q_dim + g * group * hd..i * q_dim + (g + 1) * group * hd];
                    let pos = (pos0 + i) as i64;
                    let n_vis = if prefill || cache_pos {
                        live_pos.partition_point(|&p| p <= pos)
                    } else {
                        live_pos.len()
                    };
                    // the query of each run of keys (one run unless in-cache positions)
                    let one_run = [n_vis];
                    let (qs, es): (&[f32], &[usize]) = if cache_pos {
                        qsegs.clear();
                        ends.clear();
                        // the query's own offset: position − in-cache index
                        let off_q = pos - (n_vis as i64 - 1);
                        let mut start = 0;
                        for (&e, &off) in seg_end.iter().zip(seg_off) {
                            if start >= n_vis {
                                break;
                            }
                            let q0 = qsegs.len();
                            if off == off_q {
                                qsegs.extend_from_slice(qg);
                            } else {
                                qsegs.extend_from_slice(
                                    &q_raw[i * q_dim + g * group * hd
                                        ..i * q_dim + (g + 1) * group * hd],
                                );
                                // a = c + off, c = n_vis − 1
                                let a = (n_vis as i64 - 1 + off) as usize;
                                rope.apply(&mut qsegs[q0..], group, hd, a);
                            }
                            ends.push(e.min(n_vis));
                            start = e;
                        }
                        (&qsegs, &ends)
                    } else {
                        (qg, &one_run)
                    };
                    // SAFETY: (i, g) pairs are disjoint between threads.
                    let o = unsafe { out.slice(i * q_dim + g * group * hd, group * hd) };
                    let export_row = match mass_mode {
                        MassMode::None => false,
                        MassMode::LastRow => i + 1 == n,
                        MassMode::AllRows => true,
                    };
                    if prefill {
                        // rows pre-converted for this chunk (j indexes the head's
                        // live list): keys transposed, values row-major
                        let n_live = live_slots.len();
                        let kt_g = &kt[koff[g]..];
                        let vf_g = &vf[koff[g]..];
                        let val = |j: usize| &vf_g[j * hd..(j + 1) * hd];
                        attend_prefill_group_seg(
                            qs,
                            es,
                            group,
                            n_vis,
                            kt_g,
                            n_live,
                            val,
                            scale,
                            &mut sc[..group * n_vis],
                            o,
                            &mut stats[..group],
                        );
                    } else {
                        // one kernel whether or not probabilities are exported, so a
                        // policy that never evicts reproduces the full cache bit for bit;
                        // one monomorphized loop per cache type, chosen here per (token,
                        // head), never per element. Head g is units g*hu..(g+1)*hu of a
                        // row of rl units (hu = hd values, or hd/32 q8_0 blocks).
                        let (rl, off, hu) = (view.stride, view.off, hd / kvr.ty.block_len());
                        macro_rules! run {
                            ($k:expr, $v:expr) => {{
                                let (k, v) = ($k, $v);
                                let at = |j: usize| live_slots[j] as usize * rl + off;
                                attend_group_probs_seg(
                                    qs,
                                    es,
                                    group,
                                    n_vis,
                                    |j: usize| &k[at(j)..at(j) + hu],
                                    |j: usize| &v[at(j)..at(j) + hu],
                                    scale,
                                    &mut sc[..group * n_vis],
                                    o,
                                    &mut stats[..group],
                                )
                            }};
                        }
                        match kvr.layer(l) {
                            LayerKv::F32(k, v) => run!(k, v),
                            LayerKv::F16(k, v) => run!(k, v),
                            LayerKv::Q8(k, v) => run!(k, v),
                        }
                    }
                    if export_row {
                        // SAFETY: each thread accumulates into its own row.
                        let acc = unsafe { mthr.slice(ti * n_slots, n_slots) };
                        // sc holds each head's normalized probabilities
                        for h in 0..group {
                            for j in 0..n_vis {
                                acc[live_slots[j] as usize] += sc[h * n_vis + j] * mass_w;
                            }
                        }
                    }
                }
            });
        }

        // output projection and residual                      (n, dim)
        matmul(
            pool,
            &lw.wo,
            &s.att_out[..n * q_dim],
            n,
            &mut s.xb,
            &mut s.act,
        );
        // residual, then the ffn rmsnorm                         (n, dim)
        {
            let xs = SharedMut::new(&mut s.x[..n * dim]);
            let xb = SharedMut::new(&mut s.xb[..n * dim]);
            par_rows(pool, n, |t0, t1| {
                // SAFETY: token rows t0..t1 belong to this thread.
                let (x, b) = unsafe {
                    (
                        xs.slice(t0 * dim, (t1 - t0) * dim),
                        xb.slice(t0 * dim, (t1 - t0) * dim),
                    )
                };
                add(x, b);
                rmsnorm(b, x, &lw.ffn_norm, c.norm_eps);
            });
        }

        // SwiGLU ffn: down(silu(gate(x)) * up(x))                (n, ffn) -> (n, dim)
        let xb = &s.xb[..n * dim];
        if same_act_format(&lw.w_gate, &lw.w_up) {
            quantize_acts(pool, &lw.w_gate, xb, n, &mut s.act);
            matmul_q(pool, &lw.w_gate, &s.act, n, &mut s.hb);
            matmul_q(pool, &lw.w_up, &s.act, n, &mut s.hb2);
        } else {
            matmul(pool, &lw.w_gate, xb, n, &mut s.hb, &mut s.act);
            matmul(pool, &lw.w_up, xb, n, &mut s.hb2, &mut s.act);
        }
        {
            let hb = SharedMut::new(&mut s.hb[..n * ffn]);
            let hb2 = &s.hb2[..n * ffn];
            par_rows(pool, n, |t0, t1| {
                // SAFETY: token rows t0..t1 belong to this thread.
                let g = unsafe { hb.slice(t0 * ffn, (t1 - t0) * ffn) };
                swiglu(g, &hb2[t0 * ffn..t1 * ffn]);
            });
        }
        matmul(pool, &lw.w_down, &s.hb[..n * ffn], n, &mut s.xb, &mut s.act);

        // residual                                               (n, dim)
        {
            let xs = SharedMut::new(&mut s.x[..n * dim]);
            let xb = &s.xb[..n * dim];
            par_rows(pool, n, |t0, t1| {
                // SAFETY: token rows t0..t1 belong to this thread.
                let x = unsafe { xs.slice(t0 * dim, (t1 - t0) * dim) };
                add(x, &xb[t0 * dim..t1 * dim]);
            });
        }

        // hidden-state taps: g_l(t) = ‖x_l(t) − x_l(t−1)‖       (n, n_taps)
        if let Some(t) = taps.as_deref_mut() {
            if let Ok(ti) = t.layers.binary_search(&l) {
                t.record(ti, &s.x[..n * dim], n, dim);
            }
        }
    }
    if let Some(t) = taps {
        t.end_step();
    }
    if let Some(qw) = queries {
        qw.advance(n);
    }

    // reduce the per-thread attention mass into the caller's (n_slots,) buffer
    if export {
        if let Some(out) = io.signals.mass {
            out[..n_slots].fill(0.0);
            for t in 0..n_threads {
                for (o, &x) in out[..n_slots]
                    .iter_mut()
                    .zip(&s.mass_thr[t * n_slots..(t + 1) * n_slots])
                {
                    *o += x;
                }
            }
        }
    }

    if n_out == 0 {
        return Ok(());
    }
    // final rmsnorm of the requested rows                        (n_out, dim)
    let first = n - n_out;
    rmsnorm(
        &mut s.xb[..n_out * dim],
        &s.x[first * dim..n * dim],
        &w.output_norm,
        c.norm_eps,
    );

    // classifier into logits                                     (n_out, vocab)
    let base = s.logits.len();
    s.logits.resize(base + n_out * c.vocab, 0.0);
    matmul(
        pool,
        w.output(),
        &s.xb[..n_out * dim],
        n_out,
        &mut s.logits[base..],
        &mut s.act,
    );
    Ok(())
}

/// Keys per part when one decoded token's attention is split.
pub const DECODE_PART: usize = 256;

/// Scratch of `attend_decode_split`.
struct DecodeScratch<'a> {
    att: &'a mut Vec<f32>,
    part_out: &'a mut Vec<f32>,
    part_stats: &'a mut Vec<(f32, f32)>,
    items: &'a mut Vec<(usize, usize, usize, usize)>,
}

/// Attention of one decoded token at `layer`: q (n_heads · hd) against
/// every live key of each KV head, into `out` (n_heads · hd). Each KV
/// head's keys (memory order) are cut into parts of `DECODE_PART` keys; the
/// parts run in parallel through the fused kernel, each yielding normalized
/// outputs and probabilities plus its (max, sum), and are merged exactly:
/// with M = max_p m_p and w_p = s_p · e^(m_p − M), out = Σ w_p out_p / Σ w_p
/// and part p's probabilities scale by w_p / Σ w_p. The cut depends only on
/// the number of keys, never on the thread count, so results are the same
/// for any -t. With `mass`, every probability times its weight is added to
/// the (n_slots,) accumulator.
#[allow(clippy::too_many_arguments)]
fn attend_decode_split(
    kv: &KvCache,
    layer: usize,
    q: &[f32],
    group: usize,
    scale: f32,
    pool: &ThreadPool,
    d: DecodeScratch<'_>,
    out: &mut [f32],
    mass: Option<(&mut [f32], f32)>,
) {
    let hd = kv.head_dim;
    let nkv = q.len() / (group * hd);
    // the parts: (KV head, keys j0..j1 of its memory-order list, offset of
    // their (group, j1 − j0) probabilities in `att`)
    d.items.clear();
    let mut at = 0;
    for g in 0..nkv {
        let nv = kv.head(layer, g, true).slots.len();
        let np = nv.div_ceil(DECODE_PART).max(1);
        for p in 0..np {
            let (j0, j1) = (p * nv / np, (p + 1) * nv / np);
            d.items.push((g, j0, j1, at));
            at += group * (j1 - j0);
        }
    }
    let n_items = d.items.len();
    if d.att.len() < at {
        d.att.resize(at, 0.0);
    }
    d.part_out.resize(n_items * group * hd, 0.0);
    d.part_stats.resize(n_items * group, (0.0, 0.0));
    {
        let items = &*d.items;
        let att = SharedMut::new(&mut d.att[..at]);
        let po = SharedMut::new(&mut d.part_out[..]);
        let ps = SharedMut::new(&mut d.part_stats[..]);
        let nt = pool.n_threads();
        let hu = hd / kv.ty.block_len();
        pool.run(|ti| {
            for it in (ti..n_items).step_by(nt) {
                let (g, j0, j1, off) = items[it];
                let view = kv.head(layer, g, true);
                let (slots, stride, hoff) = (&view.slots[j0..j1], view.stride, view.off);
                let m = j1 - j0;
                let qg = &q[g * group * hd..(g + 1) * group * hd];
                // SAFETY: item `it` owns its probabilities, output and statistics.
                let (sc, o, st) = unsafe {
                    (
                        att.slice(off, group * m),
                        po.slice(it * group * hd, group * hd),
                        ps.slice(it * group, group),
                    )
                };
                if m == 0 {
                    o.fill(0.0);
                    st.fill((f32::NEG_INFINITY, 0.0));
                    continue;
                }
                macro_rules! run {
                    ($k:expr, $v:expr) => {{
                        let (k, v) = ($k, $v);
                        let at = |j: usize| slots[j] as usize * stride + hoff;
                        attend_group_probs_seg(
                            qg,
                            &[m],
                            group,
                            m,
                            |j: usize| &k[at(j)..at(j) + hu],
                            |j: usize| &v[at(j)..at(j) + hu],
                            scale,
                            sc,
                            o,
                            st,
                        )
                    }};
                }
                match kv.layer(layer) {
                    LayerKv::F32(k, v) => run!(k, v),
                    LayerKv::F16(k, v) => run!(k, v),
                    LayerKv::Q8(k, v) => run!(k, v),
                }
            }
        });
    }
    // merge the parts of each KV head (a single part is copied as is)
    let mut mass = mass;
    let mut first = 0;
    while first < n_items {
        let g = d.items[first].0;
        let last = (first..n_items)
            .find(|&i| d.items[i].0 != g)
            .unwrap_or(n_items);
        let o = &mut out[g * group * hd..(g + 1) * group * hd];
        for h in 0..group {
            let mx = (first..last)
                .map(|i| d.part_stats[i * group + h].0)
                .fold(f32::NEG_INFINITY, f32::max);
            let total: f32 = (first..last)
                .map(|i| {
                    let (m, s) = d.part_stats[i * group + h];
                    if s > 0.0 {
                        s * (m - mx).exp()
                    } else {
                        0.0
                    }
                })
                .sum();
            let oh = &mut o[h * hd..(h + 1) * hd];
            oh.fill(0.0);
            for i in first..last {
                let (m, s) = d.part_stats[i * group + h];
                let wgt = if last - first == 1 {
                    1.0
                } else if s > 0.0 && total > 0.0 {
                    s * (m - mx).exp() / total
                } else {
                    0.0
                };
                let src = &d.part_out[(i * group + h) * hd..(i * group + h + 1) * hd];
                if last - first == 1 {
                    oh.copy_from_slice(src);
                } else {
                    for (y, &x) in oh.iter_mut().zip(src) {
                        *y += wgt * x;
                    }
                }
                if let Some((acc, mw)) = mass.as_mut() {
                    let (_, j0, j1, off) = d.items[i];
                    let slots = &kv.head(layer, g, true).slots[j0..j1];
                    let m = j1 - j0;
                    let p = &d.att[off + h * m..off + (h + 1) * m];
                    for (&sl, &x) in slots.iter().zip(p) {
                        acc[sl as usize] += x * wgt * *mw;
                    }
                }
            }
        }
        first = last;
    }
}

/// Run `f(t0, t1)` over the token rows `0..n` split across the pool's
/// threads (inline when there is one row, as in decoding: no sync cost).
fn par_rows(pool: &ThreadPool, n: usize, f: impl Fn(usize, usize) + Sync) {
    if n < 2 {
        f(0, n);
        return;
    }
    let nt = pool.n_threads();
    pool.run(|i| {
        let (t0, t1) = split(n, i, nt);
        if t0 < t1 {
            f(t0, t1);
        }
    });
}
