//! CriticalKV: output-perturbation-aware two-stage selection (Feng et al.,
//! 2025, "Identify Critical KV Cache in LLM Inference from an Output
//! Perturbation Perspective", arXiv 2502.03805), as a wrapper of any
//! attention-based scorer (snapkv, adakv, pyramidkv, h2o, tova).
//!
//! Idea: evicting entry i changes the attention output by at most its
//! attention weight A_i times the size of what it contributes, and what it
//! contributes to the residual stream is v_i pushed through the output
//! projection. Attention alone (stage 1) bounds the worst case; the tighter
//! bound A_i · ‖v_i · W_O‖₁ (stage 2) ranks the rest. Per KV head h of layer
//! l the projected value norm is
//!
//!   N_{l,h,i} = (1/g) Σ_{q ∈ group(h)} ‖v_{l,h,i} · W_O^(q)‖₁,
//!
//! W_O^(q) the (head_dim × dim) block of the output projection that reads
//! query head q's output (GQA: the g query heads sharing KV head h each get
//! their own block). N depends on v_i and fixed weights only, so it is
//! computed once per entry (lazily: the entries written since the last
//! eviction event, as one batched product per (layer, KV head), so a
//! decode step that does not evict pays nothing) and stored per (layer, KV
//! head, slot) beside the entry, freed with it.
//!
//! Selection, per budget group keeping K entries at this event:
//! 1. stage 1 keeps the top ⌊α·K⌋ entries by the inner score A;
//! 2. stage 2 ranks the rest by (A + ε) · N.
//!
//! Groups of one stream (snapkv, pyramidkv) and the token-uniform layout
//! (h2o, tova: N averaged over every layer and KV head, like A) select this
//! way directly. A group of several streams (adakv) first splits its budget
//! as Ada-KV does on the inner scores alone: every head's top ⌊safeguard ·
//! B⌋ by A is forced in, and head h's budget B_h is how many of its entries
//! are among the group's top K by those safeguarded scores; then the two
//! stages run inside each head with B_h (CriticalAdaKV).
//!
//! The wrapper writes scores in tiers so that the shared evictor, which
//! drops the lowest first, keeps exactly that selection: stage-1 picks
//! score 4 + t(A), stage-2 picks of a shared group 2 + t((A+ε)N), everything
//! else t((A+ε)N), with t(x) = x / (1 + |x|) (monotone, bounded).
//!
//! Parameters: `--critical-alpha` α = 0.5 (first_stage_ratio), `--critical-eps`
//! ε = 1e-4; the base scorer's own (`--obs-window`, `--adakv-safeguard`, ...).
//! Cost: W_O is read once at `prepare` into per-head blocks packed in
//! column panels for the kernel. A quantized W_O (every type kvrun reads
//! but the float ones) is kept in its exact affine form, a byte per weight
//! and two floats per group of 16 or 32 (1.25–1.5 bytes a weight; see
//! [`Form`]); a float one as f32 (4 bytes). Each entry costs q_dim · dim
//! multiply-adds once, done by the register-blocked kernels of
//! `backend::cpu::proj_norm` (AVX2 / AVX-512, per `KVRUN_CPU`). With
//! eviction at every step those read the layer's blocks once per token, so
//! the bytes a weight set that cost (README, "W_O in a byte a weight").

use super::wrap::Rescorer;
use super::{CacheShape, Entries, ModelView, ScoreCtx, Step};
use crate::backend::cpu::proj_norm;
use crate::backend::pool::{SharedMut, ThreadPool};
use crate::error::{Error, Field, Result};
use crate::kv::KvCache;

/// CriticalKV's two parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CriticalOptions {
    /// Fraction of a head's kept entries chosen by attention alone (stage 1).
    pub alpha: f32,
    /// Added to the attention score before weighting by the value norm.
    pub eps: f32,
}

impl Default for CriticalOptions {
    fn default() -> Self {
        CriticalOptions {
            alpha: 0.5,
            eps: 1e-4,
        }
    }
}

impl CriticalOptions {
    /// Check the ranges (α in 0..=1, ε finite and ≥ 0).
    pub fn check(&self) -> Result<()> {
        if !(0.0..=1.0).contains(&self.alpha) {
            return Err(Error::config(
                Field::CriticalAlpha,
                format!("must be in 0..1, got {}", self.alpha),
            ));
        }
        if !self.eps.is_finite() || self.eps < 0.0 {
            return Err(Error::config(
                Field::CriticalEps,
                format!("must be a finite number ≥ 0, got {}", self.eps),
            ));
        }
        Ok(())
    }
}

/// A monotone map of the reals into (−1, 1] (∞ → 1), so that tiers added
/// to it never overlap.
#[inline]
fn squash(x: f32) -> f32 {
    if x.is_nan() {
        0.0
    } else if x.is_infinite() {
        x.signum()
    } else {
        x / (1.0 + x.abs())
    }
}

/// The top `k` of `idx` by `key` (ties: the later index, i.e. the newer
/// entry, wins, as the evictor drops older entries first), moved to the
/// front of `idx` (order inside unspecified).
fn top_k(idx: &mut [usize], k: usize, key: impl Fn(usize) -> f32) {
    if k == 0 || k >= idx.len() {
        return;
    }
    idx.select_nth_unstable_by(k - 1, |&a, &b| key(b).total_cmp(&key(a)).then(b.cmp(&a)));
}

/// Two-stage selection inside one head: of the entries with inner scores
/// `a` and value norms `n` (position order), keep `keep`: stage 1 the top
/// ⌊α·keep⌋ by A, stage 2 the best of the rest by (A+ε)·N. Writes tiered
/// scores into `out` (stage-1 picks 4 + t(A); with `tier2`, stage-2 picks
/// 2 + t((A+ε)N); the rest t((A+ε)N)).
pub fn two_stage(
    a: &[f32],
    n: &[f32],
    keep: usize,
    o: &CriticalOptions,
    tier2: bool,
    idx: &mut Vec<usize>,
    out: &mut [f32],
) {
    let len = a.len();
    let keep = keep.min(len);
    let k1 = ((o.alpha * keep as f32).floor() as usize).min(keep);
    let prod = |i: usize| (a[i] + o.eps) * n[i];
    idx.clear();
    idx.extend(0..len);
    top_k(idx, k1, |i| a[i]);
    for (i, o) in out[..len].iter_mut().enumerate() {
        *o = squash(prod(i));
    }
    for &i in &idx[..k1] {
        out[i] = 4.0 + squash(a[i]);
    }
    if tier2 {
        let rest = &mut idx[k1..];
        top_k(rest, keep - k1, prod);
        for &i in &rest[..keep - k1] {
            out[i] = 2.0 + squash(prod(i));
        }
    }
}

/// CriticalAdaKV inside one group of streams sharing `budget` entries:
/// stream s owns `a[off[s]..off[s+1]]` (and `n`, `out` alike). Every
/// stream's top `safeguard` by A is forced into the allocation; stream s's
/// budget is its count among the group's top `keep` by those safeguarded
/// scores; then `two_stage` inside each stream with that budget.
pub fn two_stage_shared(
    a: &[f32],
    n: &[f32],
    off: &[usize],
    keep: usize,
    safeguard: usize,
    o: &CriticalOptions,
    idx: &mut Vec<usize>,
    out: &mut [f32],
) {
    let ns = off.len() - 1;
    // safeguarded base scores: each stream's top `safeguard` by A forced
    let mut guarded = a.to_vec();
    for s in 0..ns {
        let r = off[s]..off[s + 1];
        idx.clear();
        idx.extend(r.clone());
        let k = safeguard.min(r.len());
        top_k(idx, k, |i| a[i]);
        for &i in &idx[..k] {
            guarded[i] = f32::INFINITY;
        }
    }
    // per-stream budgets from the group's top `keep`
    idx.clear();
    idx.extend(0..a.len());
    let keep = keep.min(a.len());
    top_k(idx, keep, |i| guarded[i]);
    let mut per = vec![0usize; ns];
    for &i in &idx[..keep] {
        per[off.partition_point(|&x| x <= i) - 1] += 1;
    }
    for s in 0..ns {
        let r = off[s]..off[s + 1];
        two_stage(
            &a[r.clone()],
            &n[r.clone()],
            per[s],
            o,
            true,
            idx,
            &mut out[r],
        );
    }
}

/// The CriticalKV rescorer (see the module doc).
#[derive(Debug)]
pub struct Critical {
    pub opts: CriticalOptions,
    n_layers: usize,
    n_kv: usize,
    group: usize,
    hd: usize,
    dim: usize,
    /// Per layer, where its W_O blocks are and in which form.
    forms: Vec<Form>,
    /// The f32 layers' blocks: per layer n_heads blocks of `blk` floats,
    /// head q's (hd, dim) block, whose row j is column q·hd + j of W_O
    /// (what head q's output dimension j adds to the stream), packed by
    /// `proj_norm::pack`.
    wt: Vec<f32>,
    /// Floats of one packed f32 block.
    blk: usize,
    /// The affine layers' blocks (`proj_norm::pack_affine`): quants and
    /// steps, per layer n_heads blocks each.
    wq: Vec<i8>,
    wab: Vec<f32>,
    /// Whether `prepare` may keep a layer in the affine form.
    compact: bool,
    /// Token-uniform: (n_slots, n_layers · n_kv) N per slot and stream;
    /// streams: (n_slots,) N per pool row.
    norm: Vec<f32>,
    /// Token-uniform: (n_slots,) N averaged over layers and KV heads.
    tok: Vec<f32>,
    /// Slots written since N was last computed.
    pending: Vec<u32>,
    /// Whether the cache is a stream cache (seen at the first step).
    streams: bool,
    /// Scratch: gathered scores and norms of the entries being ranked.
    a: Vec<f32>,
    n: Vec<f32>,
    idx: Vec<usize>,
    res: Vec<f32>,
}

/// One layer's W_O blocks: f32 panels, or the affine form of a quantized
/// W_O (`quant::affine_row`: a byte per weight and two floats per group of
/// g, 1.25–1.5 bytes a weight instead of 4), which gives the same N bit for
/// bit (`prepare` checks every weight against the dequantized W_O and keeps
/// the f32 panels for a layer where any differs). Computing N reads a
/// layer's blocks once per batch of entries; with eviction at every step
/// that is once per token, so the smaller form is also the faster one.
#[derive(Debug, Clone, Copy)]
enum Form {
    /// Head q's block at `wt[off + q·blk..]`.
    F32 { off: usize },
    /// Head q's quants at `wq[q0 + q·nq..]`, its steps at `wab[a0 +
    /// q·nab..]`, (nq, nab) = `proj_norm::affine_len(hd, dim, g)`.
    Affine { g: usize, q0: usize, a0: usize },
}

/// W_O of one layer in the affine form (integers (dim, q_dim) row-major,
/// steps a and b (dim, q_dim / g)) where the source hands out its bytes,
/// its type has that form, and the form rebuilds every weight of `wo` (the
/// dequantized W_O) exactly; `None` otherwise.
#[allow(clippy::type_complexity)]
fn affine_wo(
    model: &ModelView<'_>,
    l: usize,
    wo: &[f32],
    (dim, q_dim, hd): (usize, usize, usize),
    raw: &mut Vec<u8>,
) -> Result<Option<(usize, Vec<i8>, Vec<f32>, Vec<f32>)>> {
    let Some(dtype) = model.wo_bytes(l, raw)? else {
        return Ok(None);
    };
    let Some(g) = crate::quant::affine_group(dtype) else {
        return Ok(None);
    };
    if !hd.is_multiple_of(g)
        || !q_dim.is_multiple_of(dtype.block_len())
        || raw.len() != dim * dtype.row_bytes(q_dim)
        || wo.len() != dim * q_dim
    {
        return Ok(None);
    }
    let (rb, ng) = (dtype.row_bytes(q_dim), q_dim / g);
    let mut q = vec![0i8; dim * q_dim];
    let (mut a, mut b) = (vec![0f32; dim * ng], vec![0f32; dim * ng]);
    for d in 0..dim {
        crate::quant::affine_row(
            dtype,
            &raw[d * rb..(d + 1) * rb],
            &mut q[d * q_dim..(d + 1) * q_dim],
            &mut a[d * ng..(d + 1) * ng],
            &mut b[d * ng..(d + 1) * ng],
        );
    }
    // every weight rebuilt exactly, or this layer stays f32 (q_dim is a
    // multiple of g, so element i's group is i / g)
    let exact = wo
        .iter()
        .zip(&q)
        .enumerate()
        .all(|(i, (&w, &x))| (x as f32).mul_add(a[i / g], b[i / g]) == w);
    Ok(exact.then_some((g, q, a, b)))
}

impl Critical {
    /// A rescorer with `opts` (weights read at `prepare`).
    pub fn new(opts: CriticalOptions) -> Critical {
        Critical {
            opts,
            n_layers: 0,
            n_kv: 0,
            group: 1,
            hd: 0,
            dim: 0,
            forms: Vec::new(),
            wt: Vec::new(),
            blk: 0,
            wq: Vec::new(),
            wab: Vec::new(),
            compact: true,
            norm: Vec::new(),
            tok: Vec::new(),
            pending: Vec::new(),
            streams: false,
            a: Vec::new(),
            n: Vec::new(),
            idx: Vec::new(),
            res: Vec::new(),
        }
    }

    /// A rescorer that keeps every layer's W_O as f32 panels (the form
    /// before the affine one: for comparisons; N is the same).
    pub fn with_f32_weights(opts: CriticalOptions) -> Critical {
        Critical {
            compact: false,
            ..Critical::new(opts)
        }
    }

    /// Layers whose W_O `prepare` kept in the affine form.
    pub fn affine_layers(&self) -> usize {
        self.forms
            .iter()
            .filter(|f| matches!(f, Form::Affine { .. }))
            .count()
    }

    /// Bytes of the W_O copies `prepare` made.
    pub fn weight_bytes(&self) -> usize {
        4 * (self.wt.len() + self.wab.len()) + self.wq.len()
    }

    /// N of layer `l`, KV head `h`, for value rows `v` ((t, hd)), into `out` (t).
    pub fn norms_of(&self, l: usize, h: usize, v: &[f32], out: &mut [f32]) {
        out.fill(0.0);
        let blk = self.blk;
        let scale = 1.0 / self.group as f32;
        for q in h * self.group..(h + 1) * self.group {
            match self.forms[l] {
                Form::F32 { off } => {
                    let o = off + q * blk;
                    proj_norm::projected_l1(v, self.hd, &self.wt[o..o + blk], self.dim, scale, out);
                }
                Form::Affine { g, q0, a0 } => {
                    let (nq, nab) = proj_norm::affine_len(self.hd, self.dim, g);
                    let w = proj_norm::Affine {
                        g,
                        q: &self.wq[q0 + q * nq..q0 + (q + 1) * nq],
                        ab: &self.wab[a0 + q * nab..a0 + (q + 1) * nab],
                    };
                    proj_norm::projected_l1_affine(v, self.hd, &w, self.dim, scale, out);
                }
            }
        }
    }

    /// The stored N of pool row `slot` (stream caches) or of (slot, layer,
    /// KV head) (token-uniform), computing pending entries first.
    pub fn norm(&mut self, kv: &KvCache, pool: &ThreadPool, slot: u32, l: usize, h: usize) -> f32 {
        self.flush(kv, pool);
        if self.streams {
            self.norm[slot as usize]
        } else {
            self.norm[slot as usize * self.n_layers * self.n_kv + l * self.n_kv + h]
        }
    }

    /// Compute N for every pending entry: one batched product per (layer,
    /// KV head), the units dealt out over the pool's threads.
    fn flush(&mut self, kv: &KvCache, pool: &ThreadPool) {
        if self.pending.is_empty() {
            return;
        }
        self.pending.sort_unstable();
        self.pending.dedup();
        let (nl, nkv, hd) = (self.n_layers, self.n_kv, self.hd);
        // units: (layer, KV head, range of `slots`); stream caches group the
        // live pending rows by owning stream, token-uniform caches share one
        // list across every (layer, KV head)
        let mut slots: Vec<u32> = Vec::with_capacity(self.pending.len());
        let mut units: Vec<(usize, usize, std::ops::Range<usize>)> = Vec::new();
        let live = |s: &u32| kv.cells.pos(*s as usize).is_some();
        match kv.streams() {
            Some(st) => {
                slots.extend(self.pending.iter().filter(|s| live(s)));
                slots.sort_by_key(|&s| (st.owner(s as usize), s));
                let mut i = 0;
                while i < slots.len() {
                    let s = st.owner(slots[i] as usize);
                    let j = i + slots[i..].partition_point(|&x| st.owner(x as usize) == s);
                    units.push((s / nkv, s % nkv, i..j));
                    i = j;
                }
            }
            None => {
                slots.extend(self.pending.iter().filter(|s| live(s)));
                for l in 0..nl {
                    for h in 0..nkv {
                        units.push((l, h, 0..slots.len()));
                    }
                }
            }
        }
        self.pending.clear();
        let mut off = vec![0usize];
        for u in &units {
            off.push(off.last().copied().unwrap_or(0) + u.2.len());
        }
        let total = off.last().copied().unwrap_or(0);
        let mut res = std::mem::take(&mut self.res);
        res.clear();
        res.resize(total, 0.0);
        {
            let outs = SharedMut::new(&mut res);
            let nt = pool.n_threads();
            let me = &*self;
            let (units, off, slots) = (&units, &off, &slots);
            pool.run(|ti| {
                let mut v = Vec::new();
                for (ui, (l, h, r)) in units.iter().enumerate().skip(ti).step_by(nt) {
                    let slots = &slots[r.clone()];
                    v.resize(slots.len() * hd, 0.0);
                    kv.read_heads(false, *l, *h, slots, &mut v);
                    // SAFETY: unit ui's range of `res` is written by this thread only.
                    let o = unsafe { outs.slice(off[ui], off[ui + 1] - off[ui]) };
                    me.norms_of(*l, *h, &v, o);
                }
            });
        }
        let w = nl * nkv;
        for (ui, (l, h, r)) in units.iter().enumerate() {
            for (k, &sl) in slots[r.clone()].iter().enumerate() {
                let x = res[off[ui] + k];
                if self.streams {
                    self.norm[sl as usize] = x;
                } else {
                    self.norm[sl as usize * w + l * nkv + h] = x;
                }
            }
        }
        if !self.streams && !units.is_empty() {
            for &sl in &slots {
                let r = &self.norm[sl as usize * w..(sl as usize + 1) * w];
                self.tok[sl as usize] = r.iter().sum::<f32>() / w as f32;
            }
        }
        self.res = res;
    }
}

impl Rescorer for Critical {
    fn prepare(&mut self, model: &ModelView<'_>, cache: CacheShape) -> Result<()> {
        self.opts.check()?;
        let c = model.config();
        let (nl, dim, hd, nh, nkv) = (
            c.n_cache_layers(),
            c.dim,
            c.head_dim,
            c.n_heads,
            c.n_kv_heads,
        );
        let q_dim = nh * hd;
        self.n_layers = nl;
        self.n_kv = nkv;
        self.group = (nh / nkv.max(1)).max(1);
        self.hd = hd;
        self.dim = dim;
        self.blk = proj_norm::packed_len(hd, dim);
        (self.forms, self.wt, self.wq, self.wab) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let (mut wo, mut raw, mut wt) = (Vec::new(), Vec::new(), Vec::new());
        for l in 0..nl {
            model.wo_f32(l, &mut wo)?;
            if wo.len() != dim * q_dim {
                return Err(Error::Other(format!(
                    "layer {l}: W_O has {} values, expected dim {dim} × q_dim {q_dim}",
                    wo.len()
                )));
            }
            let affine = match self.compact {
                true => affine_wo(model, l, &wo, (dim, q_dim, hd), &mut raw)?,
                false => None,
            };
            if let Some((g, q, a, b)) = affine {
                // head h's block: row j is column h·hd + j of W_O, and rows
                // jg·g .. of column d share step (d, (h·hd)/g + jg)
                let (nq, nab) = proj_norm::affine_len(hd, dim, g);
                let (q0, a0, ng) = (self.wq.len(), self.wab.len(), q_dim / g);
                self.wq.resize(q0 + nh * nq, 0);
                self.wab.resize(a0 + nh * nab, 0.0);
                for h in 0..nh {
                    proj_norm::pack_affine(
                        hd,
                        dim,
                        g,
                        |j, d| q[d * q_dim + h * hd + j],
                        |jg, d| {
                            let s = d * ng + h * hd / g + jg;
                            (a[s], b[s])
                        },
                        &mut self.wq[q0 + h * nq..q0 + (h + 1) * nq],
                        &mut self.wab[a0 + h * nab..a0 + (h + 1) * nab],
                    );
                }
                self.forms.push(Form::Affine { g, q0, a0 });
                continue;
            }
            // transpose (dim, q_dim) into (q_dim, dim): row q·hd + j is head
            // q's output dimension j; then pack each head's (hd, dim) block
            wt.resize(q_dim * dim, 0.0);
            for (i, row) in wo.chunks_exact(q_dim).enumerate() {
                for (c, &x) in row.iter().enumerate() {
                    wt[c * dim + i] = x;
                }
            }
            let off = self.wt.len();
            self.wt.resize(off + nh * self.blk, 0.0);
            for (src, d) in wt
                .chunks_exact(hd * dim)
                .zip(self.wt[off..].chunks_exact_mut(self.blk))
            {
                proj_norm::pack(src, hd, dim, d);
            }
            self.forms.push(Form::F32 { off });
        }
        self.norm = vec![0.0; cache.n_slots * nl * nkv];
        self.tok = vec![0.0; cache.n_slots];
        self.pending.clear();
        Ok(())
    }

    fn observe(&mut self, step: &Step<'_>) {
        let streams = step.kv.streams().is_some();
        if streams != self.streams {
            self.streams = streams;
            let n = step.kv.cells.n_slots();
            let w = if streams {
                1
            } else {
                self.n_layers * self.n_kv
            };
            self.norm = vec![0.0; n * w];
            self.tok = vec![0.0; n];
        }
        self.pending.extend_from_slice(step.slots);
    }

    fn rescore(&mut self, ctx: &ScoreCtx<'_>, out: &mut [f32]) {
        self.flush(ctx.kv, ctx.pool);
        let e = ctx.rules;
        let extra = e.evict_every.max(1) - 1;
        let o = self.opts;
        match ctx.entries {
            Entries::Tokens { slots, .. } => {
                let keep = e.budget.saturating_sub(ctx.n_new.saturating_add(extra));
                self.a.clear();
                self.a.extend_from_slice(&out[..slots.len()]);
                self.n.clear();
                self.n.extend(slots.iter().map(|&s| self.tok[s as usize]));
                two_stage(&self.a, &self.n, keep, &o, false, &mut self.idx, out);
            }
            Entries::Streams { plan, want, off } => {
                for g in &plan.groups {
                    if !want[g.first] {
                        continue;
                    }
                    let r = off[g.first]..off[g.first + g.len];
                    let keep = g
                        .budget
                        .saturating_sub(ctx.n_new.saturating_add(extra).saturating_mul(g.len));
                    self.a.clear();
                    self.a.extend_from_slice(&out[r.clone()]);
                    self.n.clear();
                    if let Some(st) = ctx.kv.streams() {
                        for s in g.first..g.first + g.len {
                            self.n
                                .extend(st.stream(s).0.iter().map(|&sl| self.norm[sl as usize]));
                        }
                    }
                    if g.len == 1 {
                        two_stage(
                            &self.a,
                            &self.n,
                            keep,
                            &o,
                            false,
                            &mut self.idx,
                            &mut out[r],
                        );
                    } else {
                        let base = off[g.first];
                        let goff: Vec<usize> = off[g.first..=g.first + g.len]
                            .iter()
                            .map(|&x| x - base)
                            .collect();
                        two_stage_shared(
                            &self.a,
                            &self.n,
                            &goff,
                            keep,
                            g.safeguard,
                            &o,
                            &mut self.idx,
                            &mut out[r],
                        );
                    }
                }
            }
        }
    }

    fn reset(&mut self) {
        self.pending.clear();
    }

    fn relocate(&mut self, map: &[(u32, u32)], n_slots: usize) {
        let w = if self.streams {
            1
        } else {
            self.n_layers * self.n_kv
        };
        super::relocate_slots(&mut self.norm, w, map, n_slots);
        super::relocate_slots(&mut self.tok, 1, map, n_slots);
        // pending entries follow their slots (the others were evicted)
        let mut to = vec![u32::MAX; map.iter().map(|m| m.0 as usize + 1).max().unwrap_or(0)];
        for &(f, t) in map {
            to[f as usize] = t;
        }
        self.pending = self
            .pending
            .iter()
            .filter_map(|&s| to.get(s as usize).copied().filter(|&t| t != u32::MAX))
            .collect();
    }
}
