//! Training retention gates (TRIM-KV / DBTrimKV, POLICIES.md §2.3) for a
//! frozen model: `kvrun train gates` (Cargo feature `train`).
//!
//! Gradients come from candle's reverse-mode autodiff on its CPU backend:
//! the base model is rebuilt as a candle computation (`model.rs`, the same
//! math as `model/llama.rs`, checked against kvrun's own logits by a test)
//! with the gates as the only variables. The objective per sequence:
//!
//! - quality: forward KL(teacher ‖ gated) of the next-token distributions,
//!   averaged over positions (teacher = the same model, ungated), plus
//!   `ce_weight` × the gated model's next-token cross-entropy;
//! - capacity: a hinge on the soft occupancy S_t = Σ_{i≤t} β_i^(t−i).
//!   Global (`rg10`, DBTrimKV): S_t summed over every layer and KV head
//!   against M·L·Hkv, ℓ_t = max(0, (S_t − M·L·Hkv) / max(t·L·Hkv − M·L·Hkv,
//!   1)); per head (`rg`): ℓ_{t,l,h} = max(0, (S − M) / max(t − M, 1)).
//!   The mean over the violating entries only (0 when none);
//! - total = quality + λ · capacity, minimised with AdamW.
//!
//! Checkpoints (the gate file plus `<out>.opt.safetensors` with the
//! optimizer moments and `<out>.log.csv` with every step's losses) are
//! written every `--save-every` steps and at the end; `--resume` continues
//! from them. The learning curve is drawn to `<out>.curve.svg`.

pub mod model;

use crate::error::{Error, Result};
use crate::policy::gates::{GateArch, Gates};
use crate::tokenizer::Tokenizer;
use candle_core::{DType, Device, Tensor, Var, D};
use model::{occupancy_at, Base, GateVars, Span};
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Keep freed memory in the process: candle allocates every op's result
/// afresh, and glibc otherwise maps blocks above its (adaptive) threshold
/// anew and returns the heap's top to the system, so each op paid page
/// faults and the kernel's zeroing (a third of a 1024-token step's time).
/// Blocks up to 32 MiB (glibc's largest threshold) now come from the heap
/// and stay there: at 4096 tokens and a 256-position loss window a step
/// took 30–34 s instead of 41–44 s (two steps each), though that window's
/// attention tensors (37.7 MB) still exceed 32 MiB; a 128 window's
/// (18.9 MB) fit.
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets two glibc allocator parameters; it is
    // called before the training step's allocations and takes no pointers.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
    }
}

/// Use `n` threads for candle's CPU kernels (its rayon pool reads
/// RAYON_NUM_THREADS when first used; an explicit setting wins).
pub fn set_threads(n: usize) {
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    }
}

fn ce(e: candle_core::Error) -> Error {
    Error::Other(format!("training: {e}"))
}

/// Loss weights and the capacity target.
#[derive(Clone, Copy, Debug)]
pub struct Objective {
    /// Capacity M: entries per (layer, KV head) the gates must fit in.
    pub budget: usize,
    /// Weight of the next-token cross-entropy next to the KL.
    pub ce_weight: f64,
    /// λ: weight of the capacity hinge.
    pub cap_weight: f64,
}

/// One step's loss terms.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Losses {
    pub total: f64,
    pub kl: f64,
    pub ce: f64,
    pub cap: f64,
    /// Mean soft occupancy per (layer, KV head) at the last position.
    pub occupancy: f64,
}

/// The loss of `gates` on a span's tokens (the teacher's log-probabilities
/// `teacher` (n, vocab) there given) as a differentiable scalar, and its
/// terms.
/// One autodiff graph over the whole model: the reference that
/// [`loss_grads_by_layer`] (what the trainer runs) is tested against.
pub fn loss(
    base: &Base,
    gates: &GateVars,
    span: &Span<'_>,
    teacher: &Tensor,
    obj: &Objective,
) -> candle_core::Result<(Tensor, Losses)> {
    let f = base.forward_span(span, Some(gates))?;
    let (quality, kl, ce_v) = quality(&f.logits, span.tokens, teacher, obj)?;
    let occ = occupancy_at(&f.log_beta, span.p0)?; // (L, Hkv, n)
    let cap = capacity(&occ, gates.arch, obj.budget, span.p0)?;
    let total = (quality + (&cap * obj.cap_weight)?)?;
    let terms = terms(&total, kl, ce_v, &cap, &occ)?;
    Ok((total, terms))
}

/// The quality term from the gated model's logits (T, vocab): forward
/// KL(teacher ‖ student), mean over positions, + `ce_weight` × the
/// next-token cross-entropy; also the KL and CE values.
fn quality(
    logits: &Tensor,
    tokens: &[u32],
    teacher: &Tensor,
    obj: &Objective,
) -> candle_core::Result<(Tensor, f64, f64)> {
    let t = tokens.len();
    let logp = log_softmax(logits)?; // (T, V)
    let kl = (teacher.exp()? * (teacher - &logp)?)?
        .sum(D::Minus1)?
        .mean_all()?;
    let kl_v = kl.to_dtype(DType::F64)?.to_scalar::<f64>()?;
    let mut total = kl;
    let mut ce_v = 0.0;
    if obj.ce_weight > 0.0 && t > 1 {
        let next = Tensor::from_slice(&tokens[1..], (t - 1, 1), &Device::Cpu)?;
        let lp = logp.narrow(0, 0, t - 1)?.gather(&next, 1)?;
        let ce_t = lp.mean_all()?.neg()?;
        ce_v = ce_t.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        total = (total + (ce_t * obj.ce_weight)?)?;
    }
    Ok((total, kl_v, ce_v))
}

/// The capacity hinge on the soft occupancy `occ` (L, Hkv, n) of the
/// queries at positions p0..p0+n against the capacity M = `budget` (global
/// for `rg10`, per head for `rg`): the mean over the violating entries (0
/// when none).
fn capacity(occ: &Tensor, arch: GateArch, budget: usize, p0: usize) -> candle_core::Result<Tensor> {
    let (nl, nkv, t) = occ.dims3()?;
    let m = budget as f64;
    let pos: Vec<f32> = (p0..p0 + t).map(|i| i as f32).collect();
    let pos = Tensor::from_vec(pos, t, &Device::Cpu)?.to_dtype(occ.dtype())?;
    let hinge = match arch {
        GateArch::Rg10 => {
            let n = (nl * nkv) as f64;
            let s = occ.sum(0)?.sum(0)?; // (T,)
            let denom = ((pos * n)? - m * n)?.maximum(1.0)?;
            ((s - m * n)? / denom)?.relu()?
        }
        GateArch::Rg => {
            let denom = (pos - m)?.maximum(1.0)?;
            (occ - m)?.broadcast_div(&denom)?.relu()?
        }
    };
    let n_pos = hinge
        .gt(0.0)?
        .to_dtype(DType::F64)?
        .sum_all()?
        .to_scalar::<f64>()?;
    if n_pos > 0.0 {
        hinge.sum_all()? / n_pos
    } else {
        hinge.sum_all()?.zeros_like()
    }
}

/// One step's terms from the total, the KL and CE values, the capacity
/// term and the occupancy (L, Hkv, T).
fn terms(
    total: &Tensor,
    kl: f64,
    ce: f64,
    cap: &Tensor,
    occ: &Tensor,
) -> candle_core::Result<Losses> {
    let t = occ.dims()[2];
    let s = |x: &Tensor| -> candle_core::Result<f64> { x.to_dtype(DType::F64)?.to_scalar::<f64>() };
    Ok(Losses {
        total: s(total)?,
        kl,
        ce,
        cap: s(cap)?,
        occupancy: s(&occ.narrow(2, t - 1, 1)?.mean_all()?)?,
    })
}

/// The loss's terms and the gradient of its total for every gate variable
/// (`GateVars::all` order; `None` where a variable has none), the same
/// numbers as `loss(..).backward()` (to float rounding), computed layer by
/// layer so that only one layer's autodiff graph lives at a time:
///
/// 1. a forward pass keeping each layer's input and log β, no graph;
/// 2. the quality term on the last layer's output, differentiated by
///    that output alone; the capacity term differentiated by the
///    occupancy (L, Hkv, T) alone;
/// 3. from the last layer down, the layer recomputed from its kept input
///    with its graph, and differentiated through ⟨output, gradient from
///    above⟩ + λ·⟨its occupancy, the capacity term's gradient⟩: that gives
///    the gradient for the layer below and this layer's gate gradients
///    (summed over layers for the shared `rg10` head).
///
/// The T² attention graph is then held for one layer instead of all of
/// them: every layer runs twice, yet on SmolLM2 at 512 tokens a step took
/// 14.1 s against the whole graph's 15.0 s (which allocates 3.5× the
/// memory), so the trainer always works this way.
pub fn loss_grads_by_layer(
    base: &Base,
    gates: &GateVars,
    span: &Span<'_>,
    teacher: &Tensor,
    obj: &Objective,
) -> candle_core::Result<(Losses, Vec<Option<Tensor>>)> {
    let n_layers = base.layers.len();
    let (tokens, p0) = (span.tokens, span.p0);
    let seq = base.span_consts(p0, tokens.len())?;
    // 1. each layer's input and log β, no graphs kept
    let mut inputs = Vec::with_capacity(n_layers);
    let mut occ = Vec::with_capacity(n_layers);
    let mut x = base.embed(tokens)?;
    for l in 0..n_layers {
        let pre = span.prefix(l)?;
        let (y, lb) = base.layer(l, &x, pre.as_ref(), Some(gates), &seq)?;
        let lb = lb.expect("a gated layer returns its log β").detach();
        occ.push(occupancy_at(std::slice::from_ref(&lb), p0)?.squeeze(0)?); // (Hkv, n)
        inputs.push(x);
        x = y.detach();
    }
    // 2. the quality term's gradient by the last output
    let top = Var::from_tensor(&x)?;
    let (qual, kl, ce_v) = quality(&base.logits(top.as_tensor())?, tokens, teacher, obj)?;
    let mut g_x = qual
        .backward()?
        .get(top.as_tensor())
        .cloned()
        .unwrap_or(x.zeros_like()?);
    //    and the capacity term's by the occupancy          (L, Hkv, T)
    let occ = Var::from_tensor(&Tensor::stack(&occ, 0)?)?;
    let cap = capacity(occ.as_tensor(), gates.arch, obj.budget, p0)?;
    let g_occ = match cap.backward()?.get(occ.as_tensor()) {
        Some(g) => (g * obj.cap_weight)?,
        None => occ.as_tensor().zeros_like()?,
    };
    let total = (qual + (&cap * obj.cap_weight)?)?;
    let terms = terms(&total, kl, ce_v, &cap, occ.as_tensor())?;
    // 3. the layers again, last first, each with its own graph
    let vars = gates.all();
    let mut grads: Vec<Option<Tensor>> = vec![None; vars.len()];
    for l in (0..n_layers).rev() {
        let x_in = Var::from_tensor(&inputs[l])?;
        let pre = span.prefix(l)?;
        let (y, lb) = base.layer(l, x_in.as_tensor(), pre.as_ref(), Some(gates), &seq)?;
        let lb = lb.expect("a gated layer returns its log β");
        let occ_l = occupancy_at(std::slice::from_ref(&lb), p0)?.squeeze(0)?;
        let surrogate = ((y * &g_x)?.sum_all()? + (occ_l * g_occ.get(l)?)?.sum_all()?)?;
        let g = surrogate.backward()?;
        for (acc, var) in grads.iter_mut().zip(&vars) {
            if let Some(gv) = g.get(var.as_tensor()) {
                *acc = Some(match acc.take() {
                    Some(a) => (a + gv)?,
                    None => gv.clone(),
                });
            }
        }
        g_x = match g.get(x_in.as_tensor()) {
            Some(gx) => gx.clone(),
            None => inputs[l].zeros_like()?,
        };
    }
    Ok((terms, grads))
}

/// log softmax over the last dimension.
pub fn log_softmax(x: &Tensor) -> candle_core::Result<Tensor> {
    let m = x.max_keepdim(D::Minus1)?;
    let z = x.broadcast_sub(&m)?;
    let lse = z.exp()?.sum_keepdim(D::Minus1)?.log()?;
    z.broadcast_sub(&lse)
}

/// AdamW over a set of variables.
#[derive(Debug)]
pub struct AdamW {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    pub step: usize,
    m: Vec<Tensor>,
    v: Vec<Tensor>,
}

impl AdamW {
    /// Zero moments for `vars`.
    pub fn new(vars: &[&Var], lr: f64, weight_decay: f64) -> candle_core::Result<AdamW> {
        let z = |v: &&Var| v.as_tensor().zeros_like();
        Ok(AdamW {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay,
            step: 0,
            m: vars.iter().map(z).collect::<candle_core::Result<_>>()?,
            v: vars.iter().map(z).collect::<candle_core::Result<_>>()?,
        })
    }

    /// One update of `vars` from their gradients `grads` (same order; a
    /// variable without one keeps its value and moments), at learning rate
    /// `lr` (warm-up and schedule are the caller's).
    pub fn apply(
        &mut self,
        vars: &[&Var],
        grads: &[Option<Tensor>],
        lr: f64,
    ) -> candle_core::Result<()> {
        self.step += 1;
        let (b1, b2) = (self.beta1, self.beta2);
        let c1 = 1.0 - b1.powi(self.step as i32);
        let c2 = 1.0 - b2.powi(self.step as i32);
        for (i, (var, g)) in vars.iter().zip(grads).enumerate() {
            let Some(g) = g else {
                continue;
            };
            self.m[i] = ((&self.m[i] * b1)? + (g * (1.0 - b1))?)?;
            self.v[i] = ((&self.v[i] * b2)? + (g.sqr()? * (1.0 - b2))?)?;
            let mhat = (&self.m[i] / c1)?;
            let vhat = (&self.v[i] / c2)?;
            let upd = (mhat / (vhat.sqrt()? + self.eps)?)?;
            let w = var.as_tensor();
            let decayed = (w * (1.0 - lr * self.weight_decay))?;
            var.set(&(decayed - (upd * lr)?)?)?;
        }
        Ok(())
    }

    /// The moments as named tensors (checkpoints).
    pub fn state(&self) -> HashMap<String, Tensor> {
        let mut h = HashMap::new();
        for (i, (m, v)) in self.m.iter().zip(&self.v).enumerate() {
            h.insert(format!("m.{i}"), m.clone());
            h.insert(format!("v.{i}"), v.clone());
        }
        h
    }

    /// Restore moments saved by `state`.
    pub fn restore(&mut self, h: &HashMap<String, Tensor>, step: usize) -> Result<()> {
        for i in 0..self.m.len() {
            let (Some(m), Some(v)) = (h.get(&format!("m.{i}")), h.get(&format!("v.{i}"))) else {
                return Err(Error::Other(format!(
                    "optimizer checkpoint lacks tensor {i}"
                )));
            };
            if m.dims() != self.m[i].dims() || v.dims() != self.v[i].dims() {
                return Err(Error::Other(format!(
                    "optimizer checkpoint tensor {i} has the wrong shape"
                )));
            }
            self.m[i] = m.to_dtype(self.m[i].dtype()).map_err(ce)?;
            self.v[i] = v.to_dtype(self.v[i].dtype()).map_err(ce)?;
        }
        self.step = step;
        Ok(())
    }
}

/// Where training text comes from.
#[derive(Clone, Debug)]
pub struct DataSpec {
    pub path: PathBuf,
    /// Plain text: tokens skipped at the start (held out for evaluation).
    pub skip_tokens: usize,
    /// JSONL: records skipped at the start.
    pub skip_records: usize,
}

/// The training token stream: every file's text, held-out parts skipped,
/// JSONL records as "question/problem + solution/answer/output" each
/// followed by the end-of-sequence token. Each file gives at most an equal
/// share of `max_tokens` (a mix, not the first file alone).
pub fn load_tokens(tok: &Tokenizer, specs: &[DataSpec], max_tokens: usize) -> Result<Vec<u32>> {
    let mut all = Vec::new();
    let share = max_tokens.div_ceil(specs.len().max(1));
    for d in specs {
        let mut out = Vec::new();
        let max_tokens = share;
        let text = std::fs::read_to_string(&d.path).map_err(|e| Error::Io {
            path: d.path.clone(),
            source: e,
        })?;
        let is_jsonl = d.path.extension().is_some_and(|e| e == "jsonl");
        if is_jsonl {
            for (i, line) in text.lines().enumerate() {
                if i < d.skip_records || line.trim().is_empty() {
                    continue;
                }
                let j: serde_json::Value = serde_json::from_str(line).map_err(|e| {
                    Error::Other(format!("{} line {}: {e}", d.path.display(), i + 1))
                })?;
                let mut s = String::new();
                for k in ["question", "problem", "prompt"] {
                    if let Some(v) = j[k].as_str() {
                        s.push_str(v);
                        s.push_str("\n\n");
                        break;
                    }
                }
                for k in ["solution", "output", "answer", "text"] {
                    if let Some(v) = j[k].as_str() {
                        s.push_str(v);
                        break;
                    }
                }
                out.extend(tok.encode(&s, false, false)?);
                out.extend(tok.eos());
                if out.len() >= max_tokens {
                    break;
                }
            }
        } else {
            let ids = tok.encode(&text, false, false)?;
            out.extend(ids.into_iter().skip(d.skip_tokens));
        }
        out.truncate(max_tokens);
        all.extend(out);
    }
    Ok(all)
}

/// kvrun's own engine as the source of a windowed step's prefix: it runs
/// the model over the prefix tokens (full cache, the model's own quantized
/// weights: the context inference itself computes) and records every
/// layer's normed attention input; the prefix's keys and values are then
/// computed from those by the training model. Several times faster than
/// the f32 candle pass (`Base::ungated_prefixes`), which stays the
/// reference the tests use.
pub struct EnginePrefix<'w> {
    session: crate::generate::Session<'w>,
}

impl std::fmt::Debug for EnginePrefix<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EnginePrefix")
    }
}

/// Records every layer's attention input of every step.
struct AllInputs(Vec<Vec<f32>>);

impl crate::generate::StepObserver for AllInputs {
    fn needs(&self) -> crate::signals::Needs {
        crate::signals::Needs {
            attn_inputs: true,
            ..crate::signals::Needs::none()
        }
    }
    fn on_step(&mut self, st: &crate::policy::Step<'_>) {
        if let Some(a) = &st.signals.attn_inputs {
            for (l, rows) in self.0.iter_mut().enumerate() {
                rows.extend_from_slice(a.layer(l));
            }
        }
    }
}

impl<'w> EnginePrefix<'w> {
    /// A full-cache session over `w` for prefixes of up to `max_tokens`.
    pub fn new(w: &'w crate::model::Weights<'w>, max_tokens: usize, threads: usize) -> Self {
        EnginePrefix {
            session: crate::generate::Session::new(w, max_tokens.max(1), threads, 512),
        }
    }

    /// Every layer's [`model::Prefix`] over `tokens`.
    pub fn prefixes(&mut self, base: &Base, tokens: &[u32]) -> Result<Vec<model::Prefix>> {
        let (nl, d, t) = (base.layers.len(), base.config.dim, tokens.len());
        self.session.reset();
        let mut obs = AllInputs(vec![Vec::with_capacity(t * d); nl]);
        self.session
            .feed_observed(tokens, crate::model::llama::Logits::Last, &mut obs)?;
        obs.0
            .into_iter()
            .enumerate()
            .map(|(l, rows)| {
                let h = Tensor::from_vec(rows, (t, d), &Device::Cpu)?.to_dtype(base.dtype)?;
                base.prefix(l, h)
            })
            .collect::<candle_core::Result<_>>()
            .map_err(ce)
    }
}

/// About how many bytes one training step of `seq_len` tokens holds at
/// its peak, gradients layer by layer ([`loss_grads_by_layer`]): one
/// layer's autodiff graph, which keeps per query head a handful of T × T
/// tensors (logits, retention decay, softmax and their gradients: 16 f32
/// values per element), that layer's activations and every layer's kept
/// input per token, a few vocabulary-wide rows per token (teacher,
/// student, softmax), and the frozen model's own f32 copy. On
/// SmolLM2-135M, 2 threads: 3.0 / 5.2 / 10.5 GB estimated at 512 / 1024 /
/// 2048 tokens, 2.8 / 4.7 / 8.5 GB peak RSS measured. (One graph over the
/// whole model, as [`loss`] builds, keeps the T² term of every layer:
/// 9.7 GB measured at 512 tokens; 1024 tokens, estimated at 26.5 GB, was
/// killed at 22 GB.)
///
/// With a loss window of n < T positions (`TrainConfig::loss_window`) the
/// graph's attention term is n × T instead of T², the vocabulary-wide rows
/// are the window's, and the ungated pass over the whole sequence (its
/// chunks of n queries hold fewer values per element than the graph) fits
/// in the same bound.
pub fn graph_bytes(c: &crate::model::Config, seq_len: usize, loss_window: usize) -> u64 {
    let t = seq_len as u64;
    let n = loss_positions(seq_len, loss_window) as u64;
    let quad = 64 * c.n_heads as u64 * n * t;
    let layer_tok = 4 * (24 * c.dim + 12 * c.ffn_dim) as u64;
    let kept = 4 * (c.n_layers * c.dim) as u64;
    let params =
        (c.n_layers * (4 * c.dim * c.dim + 3 * c.dim * c.ffn_dim) + c.vocab * c.dim) as u64;
    quad + (layer_tok + kept) * t + 4 * 16 * c.vocab as u64 * n + 8 * params
}

/// Positions a step takes its loss on: the last `loss_window` of a
/// `seq_len`-token sequence, or all of them (window 0 or ≥ `seq_len`).
pub fn loss_positions(seq_len: usize, loss_window: usize) -> usize {
    if loss_window == 0 || loss_window >= seq_len {
        seq_len
    } else {
        loss_window
    }
}

/// What a training run needs.
#[derive(Clone, Debug)]
pub struct TrainConfig {
    pub arch: GateArch,
    pub inter: usize,
    pub bias_init: f32,
    pub objective: Objective,
    pub seq_len: usize,
    /// Take the loss on the last `loss_window` positions of each sequence
    /// only, the positions before them an ungated prefix (`model::Span`);
    /// 0 (or ≥ `seq_len`): the whole sequence.
    pub loss_window: usize,
    /// How retention enters the training attention.
    pub decay: model::Decay,
    pub steps: usize,
    pub lr: f64,
    pub warmup: usize,
    pub weight_decay: f64,
    pub seed: u64,
    pub save_every: usize,
    pub out: PathBuf,
    pub resume: bool,
    /// Start from this gate file (fresh optimizer, step 0).
    pub init: Option<PathBuf>,
    /// Recorded in the gate file's metadata.
    pub model_name: String,
    pub data_desc: Vec<String>,
    /// Progress on stderr.
    pub progress: bool,
}

/// Sibling files of the gate file `out`.
pub fn sibling(out: &Path, suffix: &str) -> PathBuf {
    let name = out
        .file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let stem = name.strip_suffix(".safetensors").unwrap_or(&name);
    out.with_file_name(format!("{stem}.{suffix}"))
}

/// Train gates for `base` on `stream`; returns the gates and every step's
/// losses. With a loss window, `engine` (when given) computes each
/// sequence's prefix; otherwise the training model does.
pub fn train(
    base: &Base,
    stream: &[u32],
    cfg: &TrainConfig,
    mut engine: Option<&mut EnginePrefix<'_>>,
) -> Result<(Gates, Vec<Losses>)> {
    let c = &base.config;
    let t = cfg.seq_len;
    keep_freed_memory();
    if t < 2 || t > base.max_pos() {
        return Err(Error::Other(format!(
            "--seq-len must be in 2..={}, got {t}",
            base.max_pos()
        )));
    }
    let n_seq = stream.len() / t;
    if n_seq == 0 {
        return Err(Error::Other(format!(
            "the training data holds {} tokens, fewer than one sequence of {t}",
            stream.len()
        )));
    }
    let mut gates = Gates::init(
        cfg.arch,
        c.dim,
        cfg.inter,
        c.n_layers,
        c.n_kv_heads,
        cfg.bias_init,
        cfg.seed,
    );
    let log_path = sibling(&cfg.out, "log.csv");
    let opt_path = sibling(&cfg.out, "opt.safetensors");
    let mut history: Vec<Losses> = Vec::new();
    let start = if cfg.resume {
        Some((&cfg.out, "--resume"))
    } else {
        cfg.init.as_ref().map(|p| (p, "--init"))
    };
    let mut first_stage = serde_json::Value::Null;
    if let Some((from, flag)) = start {
        gates = Gates::load(from)?;
        if gates.arch != cfg.arch || gates.inter != cfg.inter {
            return Err(Error::Other(format!(
                "{}: {flag} with another architecture ({} I={}, asked {} I={})",
                from.display(),
                gates.arch.name(),
                gates.inter,
                cfg.arch.name(),
                cfg.inter
            )));
        }
        gates.check_model(c.n_layers, c.dim, c.n_kv_heads)?;
        if cfg.resume {
            history = read_log(&log_path)?;
            first_stage = gates.meta.get("init").cloned().unwrap_or_default();
        } else {
            first_stage = serde_json::json!({
                "file": from.file_name().map(|s| s.to_string_lossy().into_owned()),
                "meta": gates.meta.clone(),
            });
        }
    }
    let mut vars = GateVars::from_gates(&gates, base.dtype).map_err(ce)?;
    vars.decay = cfg.decay;
    let all = vars.all();
    let mut opt = AdamW::new(&all, cfg.lr, cfg.weight_decay).map_err(ce)?;
    if cfg.resume && !history.is_empty() {
        let h = candle_core::safetensors::load(&opt_path, &Device::Cpu)
            .map_err(|e| Error::Other(format!("{}: {e}", opt_path.display())))?;
        opt.restore(&h, history.len())?;
    }
    // sequence order: a seeded shuffle of the non-overlapping windows
    let mut order: Vec<usize> = (0..n_seq).collect();
    let mut rng = crate::sample::Rng::new(cfg.seed ^ 0x5eed);
    for i in (1..n_seq).rev() {
        let j = (rng.next_u64() % (i as u64 + 1)) as usize;
        order.swap(i, j);
    }
    let t0 = std::time::Instant::now();
    let first = history.len();
    for step in first..cfg.steps {
        let s = order[step % n_seq];
        let toks = &stream[s * t..(s + 1) * t];
        let lr = if step < cfg.warmup {
            cfg.lr * (step + 1) as f64 / cfg.warmup as f64
        } else {
            cfg.lr
        };
        let n = loss_positions(t, cfg.loss_window);
        let (l, grads) = if n == t {
            // the teacher: the same model, ungated, no gradients
            let teacher = base
                .forward(toks, None)
                .and_then(|f| log_softmax(&f.logits))
                .map_err(ce)?
                .detach();
            loss_grads_by_layer(base, &vars, &Span::whole(toks), &teacher, &cfg.objective)
        } else {
            // the prefix ungated, then the teacher on the window over it
            let prefixes = match engine.as_mut() {
                Some(e) => e.prefixes(base, &toks[..t - n])?,
                None => base.ungated_prefixes(&toks[..t - n], n).map_err(ce)?.0,
            };
            let span = Span {
                tokens: &toks[t - n..],
                p0: t - n,
                prefixes: &prefixes,
            };
            let teacher = base
                .forward_span(&span, None)
                .and_then(|f| log_softmax(&f.logits))
                .map_err(ce)?;
            loss_grads_by_layer(base, &vars, &span, &teacher, &cfg.objective)
        }
        .map_err(ce)?;
        if !l.total.is_finite() {
            return Err(Error::Other(format!(
                "training diverged at step {} (loss {})",
                step + 1,
                l.total
            )));
        }
        opt.apply(&all, &grads, lr).map_err(ce)?;
        history.push(l);
        if cfg.progress {
            let done = step + 1 - first;
            let per = t0.elapsed().as_secs_f64() / done as f64;
            let eta = per * (cfg.steps - step - 1) as f64;
            eprint!(
                "\rstep {}/{} loss {:.4} (kl {:.4} ce {:.3} cap {:.4}) occupancy {:.1}/{} | {:.1} s/step, {:.0} min left   ",
                step + 1,
                cfg.steps,
                l.total,
                l.kl,
                l.ce,
                l.cap,
                l.occupancy,
                cfg.objective.budget,
                per,
                eta / 60.0
            );
        }
        let last = step + 1 == cfg.steps;
        if last || (cfg.save_every > 0 && (step + 1) % cfg.save_every == 0) {
            vars.store(&mut gates).map_err(ce)?;
            gates.meta = metadata(cfg, &history, &first_stage);
            gates.save(&cfg.out)?;
            candle_core::safetensors::save(&opt.state(), &opt_path)
                .map_err(|e| Error::Other(format!("{}: {e}", opt_path.display())))?;
            write_log(&log_path, &history)?;
            std::fs::write(sibling(&cfg.out, "curve.svg"), curve_svg(&history)).map_err(|e| {
                Error::Io {
                    path: sibling(&cfg.out, "curve.svg"),
                    source: e,
                }
            })?;
        }
    }
    if cfg.progress {
        eprintln!();
    }
    vars.store(&mut gates).map_err(ce)?;
    gates.meta = metadata(cfg, &history, &first_stage);
    Ok((gates, history))
}

/// The gate file's record of how it was made.
fn metadata(cfg: &TrainConfig, h: &[Losses], init: &serde_json::Value) -> serde_json::Value {
    let tail = &h[h.len().saturating_sub(20)..];
    let mean = |f: fn(&Losses) -> f64| tail.iter().map(f).sum::<f64>() / tail.len().max(1) as f64;
    serde_json::json!({
        "model": cfg.model_name,
        "trainer": format!("kvrun {} train gates", env!("CARGO_PKG_VERSION")),
        "budget": cfg.objective.budget,
        "seq_len": cfg.seq_len,
        "loss_window": cfg.loss_window,
        "decay": cfg.decay.name(),
        "steps": h.len(),
        "lr": cfg.lr,
        "ce_weight": cfg.objective.ce_weight,
        "cap_weight": cfg.objective.cap_weight,
        "bias_init": cfg.bias_init,
        "seed": cfg.seed,
        "data": cfg.data_desc,
        "final": {
            "total": mean(|l| l.total),
            "kl": mean(|l| l.kl),
            "ce": mean(|l| l.ce),
            "cap": mean(|l| l.cap),
            "occupancy": mean(|l| l.occupancy),
            "over_last_steps": tail.len(),
        },
        "init": init,
    })
}

const LOG_HEADER: &str = "step,total,kl,ce,cap,occupancy";

fn write_log(path: &Path, h: &[Losses]) -> Result<()> {
    let mut s = String::from(LOG_HEADER);
    s.push('\n');
    for (i, l) in h.iter().enumerate() {
        s.push_str(&format!(
            "{},{},{},{},{},{}\n",
            i + 1,
            l.total,
            l.kl,
            l.ce,
            l.cap,
            l.occupancy
        ));
    }
    let mut f = std::fs::File::create(path).map_err(|e| Error::Io {
        path: path.to_path_buf(),
        source: e,
    })?;
    f.write_all(s.as_bytes()).map_err(|e| Error::Io {
        path: path.to_path_buf(),
        source: e,
    })
}

fn read_log(path: &Path) -> Result<Vec<Losses>> {
    let s = std::fs::read_to_string(path).map_err(|e| Error::Io {
        path: path.to_path_buf(),
        source: e,
    })?;
    let mut out = Vec::new();
    for (i, line) in s.lines().enumerate().skip(1) {
        let v: Vec<f64> = line.split(',').filter_map(|x| x.parse().ok()).collect();
        if v.len() != 6 {
            return Err(Error::Other(format!(
                "{} line {}: expected 6 numbers",
                path.display(),
                i + 1
            )));
        }
        out.push(Losses {
            total: v[1],
            kl: v[2],
            ce: v[3],
            cap: v[4],
            occupancy: v[5],
        });
    }
    Ok(out)
}

/// The learning curve: total, KL and λ·capacity per step (log scale), and
/// a 10-step running mean of the total.
pub fn curve_svg(h: &[Losses]) -> String {
    let (w, ht, l, r, t, b) = (720.0, 380.0, 70.0, 20.0, 40.0, 50.0);
    let n = h.len().max(2) as f64;
    let vals: Vec<f64> = h
        .iter()
        .flat_map(|x| [x.total, x.kl, x.cap])
        .filter(|v| *v > 0.0 && v.is_finite())
        .collect();
    let lo = vals
        .iter()
        .cloned()
        .fold(f64::INFINITY, f64::min)
        .max(1e-6)
        .log10()
        .floor();
    let hi = vals
        .iter()
        .cloned()
        .fold(f64::NEG_INFINITY, f64::max)
        .max(1e-5)
        .log10()
        .ceil();
    let hi = if hi <= lo { lo + 1.0 } else { hi };
    let x = |i: usize| l + (w - l - r) * i as f64 / (n - 1.0);
    let y = |v: f64| {
        let v = v.max(10f64.powf(lo)).log10();
        t + (ht - t - b) * (hi - v) / (hi - lo)
    };
    let mut s = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{ht}" font-family="sans-serif" font-size="12">
<rect width="100%" height="100%" fill="white"/>
<text x="{}" y="22" text-anchor="middle" font-size="15" font-weight="bold">retention-gate training: loss per step</text>
"#,
        w / 2.0
    );
    let mut e = lo;
    while e <= hi {
        let yy = y(10f64.powf(e));
        s.push_str(&format!(
            r##"<line x1="{l}" x2="{}" y1="{yy:.1}" y2="{yy:.1}" stroke="#ddd"/><text x="{}" y="{:.1}" text-anchor="end">1e{e}</text>
"##,
            w - r,
            l - 6.0,
            yy + 4.0
        ));
        e += 1.0;
    }
    let series: [(&str, &str, Box<dyn Fn(&Losses) -> f64>); 3] = [
        ("total", "#222", Box::new(|x: &Losses| x.total)),
        ("KL", "#1f77b4", Box::new(|x: &Losses| x.kl)),
        ("capacity", "#d62728", Box::new(|x: &Losses| x.cap)),
    ];
    for (k, (name, color, f)) in series.iter().enumerate() {
        let pts: Vec<String> = h
            .iter()
            .enumerate()
            .map(|(i, v)| format!("{:.1},{:.1}", x(i), y(f(v))))
            .collect();
        s.push_str(&format!(
            r#"<polyline fill="none" stroke="{color}" stroke-width="1" opacity="0.6" points="{}"/>
<text x="{}" y="{}" fill="{color}">{name}</text>
"#,
            pts.join(" "),
            l + 10.0 + 90.0 * k as f64,
            t + 14.0
        ));
    }
    // running mean of the total
    let mut pts = Vec::new();
    for i in 0..h.len() {
        let a = i.saturating_sub(9);
        let m = h[a..=i].iter().map(|v| v.total).sum::<f64>() / (i + 1 - a) as f64;
        pts.push(format!("{:.1},{:.1}", x(i), y(m)));
    }
    s.push_str(&format!(
        r#"<polyline fill="none" stroke="black" stroke-width="2.5" points="{}"/>
<text x="{}" y="{}" text-anchor="middle">step ({} in all)</text>
</svg>
"#,
        pts.join(" "),
        w / 2.0,
        ht - 12.0,
        h.len()
    ));
    s
}
