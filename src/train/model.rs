//! The frozen base model and the retention gates as a differentiable
//! computation (candle), for training the gates. Same math as
//! `model/llama.rs`, over one whole sequence at a time, with the
//! retention-gated attention of TRIM-KV (POLICIES.md §2.3): the scaled
//! logit of query t on key i is multiplied by β_i^(t−i) before the causal
//! mask and the softmax, so a token whose retention has decayed fades to a
//! zero logit (soft eviction). Gates off (`None`) is the plain model: the
//! teacher.
//!
//! Only the gates are `Var`s; the base weights are constants (dequantized
//! to f32 once), so backpropagation computes activation gradients through
//! the frozen model and weight gradients for the gates alone.

use crate::backend::RopeStyle;
use crate::model::{Config, Weights};
use crate::policy::gates::{Dense, GateArch, Gates};
use candle_core::{DType, Device, Result, Tensor, Var, D};

/// One decoder layer's frozen weights, f32, `[out, in]` row-major.
#[derive(Debug)]
pub struct Layer {
    pub attn_norm: Tensor,
    pub wq: Tensor,
    pub wk: Tensor,
    pub wv: Tensor,
    pub bq: Option<Tensor>,
    pub bk: Option<Tensor>,
    pub bv: Option<Tensor>,
    pub wo: Tensor,
    pub ffn_norm: Tensor,
    pub w_gate: Tensor,
    pub w_up: Tensor,
    pub w_down: Tensor,
}

/// The frozen base model.
#[derive(Debug)]
pub struct Base {
    pub config: Config,
    /// (vocab, dim)
    pub embd: Tensor,
    pub layers: Vec<Layer>,
    pub out_norm: Tensor,
    /// (vocab, dim)
    pub output: Tensor,
    /// (hd, hd) signed permutation: x·rot pairs each rotated coordinate
    /// with its partner as RoPE does (x_b → −x_a side).
    rot: Tensor,
    /// RoPE cos/sin per position, (max_pos, hd), built with the engine's
    /// own `Rope` (same angles, same pairing).
    cos: Tensor,
    sin: Tensor,
    pub dtype: DType,
}

fn mat(rows: usize, cols: usize, f: impl Fn(usize, &mut [f32]), dt: DType) -> Result<Tensor> {
    let mut v = vec![0f32; rows * cols];
    for (r, row) in v.chunks_exact_mut(cols).enumerate() {
        f(r, row);
    }
    Tensor::from_vec(v, (rows, cols), &Device::Cpu)?.to_dtype(dt)
}

fn vector(v: &[f32], dt: DType) -> Result<Tensor> {
    Tensor::from_slice(v, v.len(), &Device::Cpu)?.to_dtype(dt)
}

impl Base {
    /// Dequantize `w` (every matrix to f32, then `dt`), with RoPE tables
    /// for sequences of up to `max_pos` tokens.
    pub fn from_weights(w: &Weights<'_>, max_pos: usize, dt: DType) -> Result<Base> {
        let c = w.config.clone();
        // the trainer's forward pass is the plain llama block
        if !c.features.is_plain(c.head_dim) {
            return Err(candle_core::Error::Msg(format!(
                "train gates: the {} architecture is not supported (llama and qwen2 models only)",
                c.arch.name()
            )));
        }
        let m = |q: &crate::backend::cpu::matmul::QMat<'_>| {
            mat(q.n_out, q.n_in, |r, row| q.dequantize_row(r, row), dt)
        };
        let moe = || {
            candle_core::Error::Msg(
                "train gates: mixture-of-experts layers are not supported".into(),
            )
        };
        let layers = w
            .layers
            .iter()
            .map(|lw| {
                Ok(Layer {
                    attn_norm: vector(&lw.attn_norm, dt)?,
                    wq: m(&lw.wq)?,
                    wk: m(&lw.wk)?,
                    wv: m(&lw.wv)?,
                    bq: lw.bq.as_deref().map(|b| vector(b, dt)).transpose()?,
                    bk: lw.bk.as_deref().map(|b| vector(b, dt)).transpose()?,
                    bv: lw.bv.as_deref().map(|b| vector(b, dt)).transpose()?,
                    wo: m(&lw.wo)?,
                    ffn_norm: vector(&lw.ffn_norm, dt)?,
                    w_gate: m(lw.ffn.dense().ok_or_else(moe)?.0)?,
                    w_up: m(lw.ffn.dense().ok_or_else(moe)?.1)?,
                    w_down: m(lw.ffn.dense().ok_or_else(moe)?.2)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let embd = m(&w.token_embd)?;
        let output = match &w.output {
            Some(o) => m(o)?,
            None => embd.clone(),
        };
        let (rot, cos, sin) = rope_tables(&w.rope, &c, max_pos, dt)?;
        Ok(Base {
            embd,
            layers,
            out_norm: vector(&w.output_norm, dt)?,
            output,
            rot,
            cos,
            sin,
            dtype: dt,
            config: c,
        })
    }

    /// A base model from explicit tensors (tests: tiny random models).
    #[allow(clippy::too_many_arguments)]
    pub fn from_parts(
        config: Config,
        rope: &crate::backend::rope::Rope,
        embd: Tensor,
        layers: Vec<Layer>,
        out_norm: Tensor,
        output: Tensor,
        max_pos: usize,
        dt: DType,
    ) -> Result<Base> {
        let (rot, cos, sin) = rope_tables(rope, &config, max_pos, dt)?;
        Ok(Base {
            config,
            embd,
            layers,
            out_norm,
            output,
            rot,
            cos,
            sin,
            dtype: dt,
        })
    }

    /// Positions the RoPE tables cover.
    pub fn max_pos(&self) -> usize {
        self.cos.dims()[0]
    }
}

/// RoPE as out = x ⊙ cos + (x · rot) ⊙ sin, with cos/sin read off the
/// engine's own rotation (rotating unit pairs), so the pairing and the
/// angles are exactly `Rope::apply`'s.
fn rope_tables(
    rope: &crate::backend::rope::Rope,
    c: &Config,
    max_pos: usize,
    dt: DType,
) -> Result<(Tensor, Tensor, Tensor)> {
    let hd = c.head_dim;
    let half = rope.n_rot / 2;
    let pair = |i: usize| match rope.style {
        RopeStyle::Normal => (2 * i, 2 * i + 1),
        RopeStyle::Neox => (i, i + half),
    };
    // rot: (x·rot)[a] = −x[b], (x·rot)[b] = x[a]
    let mut r = vec![0f32; hd * hd];
    for i in 0..half {
        let (a, b) = pair(i);
        r[b * hd + a] = -1.0;
        r[a * hd + b] = 1.0;
    }
    let mut cos = vec![0f32; max_pos * hd];
    let mut sin = vec![0f32; max_pos * hd];
    let mut unit = vec![0f32; hd];
    for p in 0..max_pos {
        unit.fill(0.0);
        for i in 0..half {
            unit[pair(i).0] = 1.0;
        }
        rope.apply(&mut unit, 1, hd, p);
        let (cr, sr) = (
            &mut cos[p * hd..(p + 1) * hd],
            &mut sin[p * hd..(p + 1) * hd],
        );
        cr.fill(1.0);
        for i in 0..half {
            let (a, b) = pair(i);
            // R(p)·e_a = (cos, sin) at (a, b)
            cr[a] = unit[a];
            cr[b] = unit[a];
            sr[a] = unit[b];
            sr[b] = unit[b];
        }
    }
    let dev = Device::Cpu;
    Ok((
        Tensor::from_vec(r, (hd, hd), &dev)?.to_dtype(dt)?,
        Tensor::from_vec(cos, (max_pos, hd), &dev)?.to_dtype(dt)?,
        Tensor::from_vec(sin, (max_pos, hd), &dev)?.to_dtype(dt)?,
    ))
}

/// How retention acts on the gated attention during training.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Decay {
    /// The paper's (POLICIES.md §2.3): the scaled logit is multiplied by
    /// β_i^(t−i), so a decayed entry's logit goes to 0 (it still takes
    /// weight e^0 in the softmax).
    #[default]
    Logit,
    /// The attention weight is multiplied by β_i^(t−i) (log β·age added to
    /// the logit), so a decayed entry's weight goes to 0: the soft form of
    /// what eviction does at inference, where the soft occupancy
    /// Σ β^(t−i) is the expected number of entries kept.
    Weight,
}

impl Decay {
    /// `logit` or `weight`.
    pub fn parse(s: &str) -> Option<Decay> {
        match s {
            "logit" => Some(Decay::Logit),
            "weight" => Some(Decay::Weight),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Decay::Logit => "logit",
            Decay::Weight => "weight",
        }
    }
}

/// The gates as trainable variables, mirroring `Gates` (same tensor order).
#[derive(Debug)]
pub struct GateVars {
    pub arch: GateArch,
    /// How their retention enters the attention (set after `from_gates`).
    pub decay: Decay,
    /// Per layer: (W, b) of each hidden layer.
    pub hidden: Vec<Vec<(Var, Var)>>,
    /// Scoring heads: per layer (`rg`) or one shared (`rg10`).
    pub heads: Vec<(Var, Var)>,
}

fn dense_vars(d: &Dense, dt: DType) -> Result<(Var, Var)> {
    let dev = Device::Cpu;
    Ok((
        Var::from_tensor(&Tensor::from_slice(&d.w, (d.n_out, d.n_in), &dev)?.to_dtype(dt)?)?,
        Var::from_tensor(&Tensor::from_slice(&d.b, d.n_out, &dev)?.to_dtype(dt)?)?,
    ))
}

fn to_dense(w: &Var, b: &Var, d: &mut Dense) -> Result<()> {
    d.w = w
        .as_tensor()
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1()?;
    d.b = b.as_tensor().to_dtype(DType::F32)?.to_vec1()?;
    Ok(())
}

impl GateVars {
    /// Variables holding `g`'s values.
    pub fn from_gates(g: &Gates, dt: DType) -> Result<GateVars> {
        Ok(GateVars {
            arch: g.arch,
            decay: Decay::Logit,
            hidden: g
                .hidden
                .iter()
                .map(|h| h.iter().map(|d| dense_vars(d, dt)).collect())
                .collect::<Result<_>>()?,
            heads: g
                .heads
                .iter()
                .map(|d| dense_vars(d, dt))
                .collect::<Result<_>>()?,
        })
    }

    /// Write the variables' values back into `g`.
    pub fn store(&self, g: &mut Gates) -> Result<()> {
        for (hv, hd) in self.hidden.iter().zip(g.hidden.iter_mut()) {
            for ((w, b), d) in hv.iter().zip(hd.iter_mut()) {
                to_dense(w, b, d)?;
            }
        }
        for ((w, b), d) in self.heads.iter().zip(g.heads.iter_mut()) {
            to_dense(w, b, d)?;
        }
        Ok(())
    }

    /// Every variable, in `Gates::tensors` order.
    pub fn all(&self) -> Vec<&Var> {
        let mut v = Vec::new();
        for h in &self.hidden {
            for (w, b) in h {
                v.push(w);
                v.push(b);
            }
        }
        for (w, b) in &self.heads {
            v.push(w);
            v.push(b);
        }
        v
    }

    /// log β (T, Hkv) of layer `l` for inputs x (T, D).
    pub fn log_beta(&self, l: usize, x: &Tensor) -> Result<Tensor> {
        let mut a = x.clone();
        for (w, b) in &self.hidden[l] {
            a = a
                .matmul(&w.as_tensor().t()?)?
                .broadcast_add(b.as_tensor())?
                .silu()?;
        }
        let (w, b) = match self.arch {
            GateArch::Rg => &self.heads[l],
            GateArch::Rg10 => &self.heads[0],
        };
        let z = a
            .matmul(&w.as_tensor().t()?)?
            .broadcast_add(b.as_tensor())?;
        log_sigmoid(&z)
    }
}

/// log σ(z) = min(z, 0) − ln(1 + e^−|z|).
pub fn log_sigmoid(z: &Tensor) -> Result<Tensor> {
    z.minimum(0.0)? - ((z.abs()?.neg()?.exp()? + 1.0)?.log()?)
}

fn rmsnorm(x: &Tensor, w: &Tensor, eps: f32) -> Result<Tensor> {
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    x.broadcast_div(&(ms + eps as f64)?.sqrt()?)?
        .broadcast_mul(w)
}

fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    let y = x.matmul(&w.t()?)?;
    match b {
        Some(b) => y.broadcast_add(b),
        None => Ok(y),
    }
}

/// What one forward pass returns.
#[derive(Debug)]
pub struct Forward {
    /// (T, vocab)
    pub logits: Tensor,
    /// Per layer, log β (T, Hkv) (empty without gates).
    pub log_beta: Vec<Tensor>,
}

impl Base {
    /// RoPE on x (T, H, hd) at positions p0..p0+T.
    fn rope(&self, x: &Tensor, p0: usize) -> Result<Tensor> {
        let (t, h, hd) = x.dims3()?;
        let cos = self.cos.narrow(0, p0, t)?.unsqueeze(1)?;
        let sin = self.sin.narrow(0, p0, t)?.unsqueeze(1)?;
        let xr = x
            .reshape((t * h, hd))?
            .matmul(&self.rot)?
            .reshape((t, h, hd))?;
        x.broadcast_mul(&cos)? + xr.broadcast_mul(&sin)?
    }

    /// The model over `tokens` (T ≤ max_pos), retention-gated by `gates`
    /// when given.
    pub fn forward(&self, tokens: &[u32], gates: Option<&GateVars>) -> Result<Forward> {
        self.forward_span(&Span::whole(tokens), gates)
    }

    /// The model over a span's tokens after its prefix (logits of the
    /// span's positions only), retention-gated by `gates` when given (the
    /// prefix's entries too: their log β come from its kept inputs).
    pub fn forward_span(&self, span: &Span<'_>, gates: Option<&GateVars>) -> Result<Forward> {
        let seq = self.span_consts(span.p0, span.tokens.len())?;
        let mut x = self.embed(span.tokens)?;
        let mut log_beta = Vec::new();
        for l in 0..self.layers.len() {
            let pre = span.prefix(l)?;
            let (y, lb) = self.layer(l, &x, pre.as_ref(), gates, &seq)?;
            log_beta.extend(lb);
            x = y;
        }
        Ok(Forward {
            logits: self.logits(&x)?,
            log_beta,
        })
    }

    /// The ungated model over `tokens`, attention taken `chunk` queries at
    /// a time (chunks end at the last token; each sees only the keys up to
    /// its own end), so no T × T tensor is built: every layer's
    /// [`Prefix`] over all T positions, then the final residual stream
    /// (T, D).
    pub fn ungated_prefixes(&self, tokens: &[u32], chunk: usize) -> Result<(Vec<Prefix>, Tensor)> {
        let t = tokens.len();
        let chunk = chunk.clamp(1, t.max(1));
        // chunk starts, last chunk [t − chunk, t)
        let mut starts = Vec::new();
        let mut end = t;
        while end > 0 {
            end = end.saturating_sub(chunk);
            starts.push(end);
        }
        starts.reverse();
        let mut prefixes = Vec::with_capacity(self.layers.len());
        let mut x = self.embed(tokens)?;
        for l in 0..self.layers.len() {
            let h = rmsnorm(&x, &self.layers[l].attn_norm, self.config.norm_eps)?;
            let all = self.prefix(l, h)?;
            let mut outs = Vec::with_capacity(starts.len());
            for (i, &c0) in starts.iter().enumerate() {
                let end = starts.get(i + 1).copied().unwrap_or(t);
                let pre = (c0 > 0).then(|| all.narrow(c0)).transpose()?;
                let seq = self.span_consts(c0, end - c0)?;
                let (y, _) =
                    self.layer(l, &x.narrow(0, c0, end - c0)?, pre.as_ref(), None, &seq)?;
                outs.push(y);
            }
            prefixes.push(all);
            x = Tensor::cat(&outs, 0)?;
        }
        Ok((prefixes, x))
    }

    /// The residual stream's start: the tokens' embeddings (T, D).
    pub fn embed(&self, tokens: &[u32]) -> Result<Tensor> {
        let ids = Tensor::from_slice(tokens, tokens.len(), &Device::Cpu)?;
        self.embd.index_select(&ids, 0)
    }

    /// What every layer of a T-token sequence shares: the causal mask and
    /// the ages.
    pub fn seq_consts(&self, t: usize) -> Result<SeqConsts> {
        self.span_consts(0, t)
    }

    /// The same for n queries at positions p0..p0+n over the keys 0..p0+n.
    pub fn span_consts(&self, p0: usize, n: usize) -> Result<SeqConsts> {
        let dev = Device::Cpu;
        let p = p0 + n;
        // causal mask (n, P): 0 at or before the query's position, −inf
        // after; ages pos − i (0 after, masked anyway)
        let mut mask = vec![0f32; n * p];
        let mut age = vec![0f32; n * p];
        for q in 0..n {
            for k in 0..p {
                if k > p0 + q {
                    mask[q * p + k] = f32::NEG_INFINITY;
                } else {
                    age[q * p + k] = (p0 + q - k) as f32;
                }
            }
        }
        Ok(SeqConsts {
            p0,
            mask: Tensor::from_vec(mask, (n, p), &dev)?.to_dtype(self.dtype)?,
            age: Tensor::from_vec(age, (1, n, p), &dev)?.to_dtype(self.dtype)?,
        })
    }

    /// Layer `l`'s keys and values for the first positions of a sequence,
    /// from its normed inputs h (p0, D) there (the attention RMSNorm's
    /// output: what kvrun's engine records for the gates, or what
    /// [`Base::ungated_prefixes`] computes).
    pub fn prefix(&self, l: usize, h: Tensor) -> Result<Prefix> {
        let (k, v) = self.keys_values(l, &h, 0)?;
        Ok(Prefix { h, k, v })
    }

    /// Keys after RoPE and values (Hkv, T, hd) of layer `l` from its
    /// normed input h (T, D) at positions p0..p0+T.
    fn keys_values(&self, l: usize, h: &Tensor, p0: usize) -> Result<(Tensor, Tensor)> {
        let c = &self.config;
        let lw = &self.layers[l];
        let t = h.dims()[0];
        let (hkv, hd) = (c.n_kv_heads, c.head_dim);
        let k = linear(h, &lw.wk, lw.bk.as_ref())?.reshape((t, hkv, hd))?;
        let v = linear(h, &lw.wv, lw.bv.as_ref())?.reshape((t, hkv, hd))?;
        let k = self.rope(&k, p0)?.transpose(0, 1)?.contiguous()?;
        Ok((k, v.transpose(0, 1)?.contiguous()?))
    }

    /// Decoder layer `l` over the residual stream x (T, D) of the queries
    /// at positions p0..p0+T (`seq.p0`; the keys, values and gate inputs of
    /// positions 0..p0 in `prefix`, none when p0 = 0): the new stream and,
    /// with gates, the layer's log β (P, Hkv) of all P = p0 + T keys.
    pub fn layer(
        &self,
        l: usize,
        x: &Tensor,
        prefix: Option<&Prefix>,
        gates: Option<&GateVars>,
        seq: &SeqConsts,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let c = &self.config;
        let lw = &self.layers[l];
        let t = x.dims()[0];
        let p0 = prefix.map_or(0, |p| p.h.dims()[0]);
        if p0 != seq.p0 {
            return Err(candle_core::Error::Msg(format!(
                "a prefix of {p0} positions for queries from position {}",
                seq.p0
            )));
        }
        let p = p0 + t;
        let (hq, hkv, hd) = (c.n_heads, c.n_kv_heads, c.head_dim);
        let group = hq / hkv;
        let scale = 1.0 / (hd as f64).sqrt();
        // attention rmsnorm: the gate's input too                   (T, D)
        let h = rmsnorm(x, &lw.attn_norm, c.norm_eps)?;
        // projections and RoPE at p0..              (T, H, hd) / (Hkv, T, hd)
        let q = linear(&h, &lw.wq, lw.bq.as_ref())?.reshape((t, hq, hd))?;
        let q = self.rope(&q, p0)?;
        let (k, v) = self.keys_values(l, &h, p0)?;
        // the prefix's keys and values first                     (Hkv, P, hd)
        let (k, v) = match prefix {
            Some(pre) => (
                Tensor::cat(&[&pre.k, &k], 1)?,
                Tensor::cat(&[&pre.v, &v], 1)?,
            ),
            None => (k, v),
        };
        // grouped heads: q as (Hkv, g·T, hd) against k (Hkv, P, hd)
        let q = q
            .reshape((t, hkv, group, hd))?
            .permute((1, 2, 0, 3))?
            .contiguous()?
            .reshape((hkv, group * t, hd))?;

        // scaled logits                                       (Hkv, g, T, P)
        let mut s = (q.matmul(&k.t()?)? * scale)?.reshape((hkv, group, t, p))?;
        let mut log_beta = None;
        if let Some(g) = gates {
            // retention: logits × β_i^(pos−i), or weights × β_i^(pos−i)
            let lb = g.log_beta(l, &h)?; // (T, Hkv)
            let lb = match prefix {
                Some(pre) => Tensor::cat(&[&g.log_beta(l, &pre.h)?, &lb], 0)?, // (P, Hkv)
                None => lb,
            };
            // (pos − i)·log β_i                                (Hkv, 1, T, P)
            let log_decay = seq
                .age
                .broadcast_mul(&lb.t()?.unsqueeze(1)?)?
                .unsqueeze(1)?;
            s = match g.decay {
                Decay::Logit => s.broadcast_mul(&log_decay.exp()?)?,
                Decay::Weight => s.broadcast_add(&log_decay)?,
            };
            log_beta = Some(lb);
        }
        let s = s.broadcast_add(&seq.mask)?;
        let e = candle_core::Tensor::exp(&s.broadcast_sub(&s.max_keepdim(D::Minus1)?)?)?;
        let probs = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
        // weighted values, heads back in place                  (T, Hq·hd)
        let o = probs
            .reshape((hkv, group * t, p))?
            .matmul(&v)?
            .reshape((hkv, group, t, hd))?
            .permute((2, 0, 1, 3))?
            .contiguous()?
            .reshape((t, hq * hd))?;
        let x = (x + linear(&o, &lw.wo, None)?)?;
        // SwiGLU feed-forward                                        (T, D)
        let h2 = rmsnorm(&x, &lw.ffn_norm, c.norm_eps)?;
        let f = (linear(&h2, &lw.w_gate, None)?.silu()? * linear(&h2, &lw.w_up, None)?)?;
        Ok(((&x + linear(&f, &lw.w_down, None)?)?, log_beta))
    }

    /// Next-token logits (T, vocab) from the final residual stream.
    pub fn logits(&self, x: &Tensor) -> Result<Tensor> {
        let h = rmsnorm(x, &self.out_norm, self.config.norm_eps)?;
        linear(&h, &self.output, None)
    }
}

/// The causal mask (n, P) and the ages pos − i (1, n, P) of n queries at
/// positions p0..p0+n over the keys 0..P, P = p0 + n.
#[derive(Debug)]
pub struct SeqConsts {
    p0: usize,
    mask: Tensor,
    age: Tensor,
}

/// One layer's view of a sequence's first p0 positions, constants to the
/// queries after them (computed ungated).
#[derive(Debug)]
pub struct Prefix {
    /// normed layer inputs, the gate's input                     (p0, D)
    pub h: Tensor,
    /// keys after RoPE                                       (Hkv, p0, hd)
    pub k: Tensor,
    /// values                                                (Hkv, p0, hd)
    pub v: Tensor,
}

impl Prefix {
    /// The first `n` positions.
    fn narrow(&self, n: usize) -> Result<Prefix> {
        Ok(Prefix {
            h: self.h.narrow(0, 0, n)?,
            k: self.k.narrow(1, 0, n)?,
            v: self.v.narrow(1, 0, n)?,
        })
    }
}

/// Where a loss is taken: `tokens` at positions p0..p0+n of a sequence
/// whose positions 0..p0 are a prefix run ungated, given per layer as a
/// [`Prefix`] (at least p0 positions; from `Base::ungated_prefixes` or
/// kvrun's engine). The queries see the prefix's keys, and with gates its
/// entries decay by their own log β (from the prefix's normed inputs, so
/// the gates learn ages up to p0 + n at n × (p0 + n) attention cost);
/// gradients flow through the span's positions and the prefix's gate
/// scores, not through the prefix's residual stream (its attention is
/// ungated: the context a long sequence reached before the span).
#[derive(Clone, Copy, Debug)]
pub struct Span<'a> {
    pub tokens: &'a [u32],
    pub p0: usize,
    pub prefixes: &'a [Prefix],
}

impl<'a> Span<'a> {
    /// A whole sequence: no prefix.
    pub fn whole(tokens: &'a [u32]) -> Span<'a> {
        Span {
            tokens,
            p0: 0,
            prefixes: &[],
        }
    }

    /// Layer `l`'s prefix (none when p0 = 0).
    pub fn prefix(&self, l: usize) -> Result<Option<Prefix>> {
        if self.p0 == 0 {
            return Ok(None);
        }
        let pre = self
            .prefixes
            .get(l)
            .ok_or_else(|| candle_core::Error::Msg(format!("a span's prefix lacks layer {l}")))?;
        if pre.h.dims()[0] < self.p0 {
            return Err(candle_core::Error::Msg(format!(
                "a prefix of {} positions for a span at {}",
                pre.h.dims()[0],
                self.p0
            )));
        }
        Ok(Some(pre.narrow(self.p0)?))
    }
}

/// Soft occupancy S_t = Σ_{i≤t} β_i^(t−i) of every (layer, KV head) at
/// every query t, (L, Hkv, T), from per-layer log β (T, Hkv).
pub fn occupancy(log_beta: &[Tensor]) -> Result<Tensor> {
    occupancy_at(log_beta, 0)
}

/// The same at the queries p0..P only, from per-layer log β (P, Hkv) of
/// every key: (L, Hkv, P − p0).
pub fn occupancy_at(log_beta: &[Tensor], p0: usize) -> Result<Tensor> {
    let p = log_beta[0].dims()[0];
    let n = p - p0;
    let dt = log_beta[0].dtype();
    let dev = Device::Cpu;
    let mut age = vec![0f32; n * p];
    let mut tri = vec![0f32; n * p];
    for q in 0..n {
        for k in 0..=p0 + q {
            age[q * p + k] = (p0 + q - k) as f32;
            tri[q * p + k] = 1.0;
        }
    }
    let age = Tensor::from_vec(age, (1, n, p), &dev)?.to_dtype(dt)?;
    let tri = Tensor::from_vec(tri, (1, n, p), &dev)?.to_dtype(dt)?;
    let per_layer = log_beta
        .iter()
        .map(|lb| {
            age.broadcast_mul(&lb.t()?.unsqueeze(1)?)?
                .exp()?
                .broadcast_mul(&tri)?
                .sum(D::Minus1) // (Hkv, T)
        })
        .collect::<Result<Vec<_>>>()?;
    Tensor::stack(&per_layer, 0)
}
