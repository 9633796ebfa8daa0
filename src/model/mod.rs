//! Model hyperparameters (`Config`) and immutable weights (`Weights`).
//!
//! Two architectures share one forward pass: `llama` (Llama 2/3.x,
//! SmolLM2, DeepSeek-R1-Distill-Llama) and `qwen2` (DeepSeek-R1-Distill-Qwen:
//! Q/K/V biases, NeoX RoPE). Weights borrow the memory map; nothing in them
//! changes after loading. Run state lives in `llama::RunState`, the KV cache
//! in `crate::kv::KvCache`.

pub mod llama;
pub mod view;

pub use view::{BackendWeights, ModelView, WeightSource};

use crate::backend::{Backend, Host, Rope, RopeStyle, WeightSink, HOST_LOADER, MAX_GROUP};
use crate::error::{Error, Result};
use crate::format::gguf::Gguf;
use crate::tensor::{DType, TensorView};
use std::borrow::Cow;
use std::path::PathBuf;

/// Supported model families.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen2,
    Qwen3,
    Qwen3Moe,
    Gemma3,
    Phi3,
}

impl Arch {
    /// Every supported family, as GGUF names them.
    pub const ALL: [Arch; 6] = [
        Arch::Llama,
        Arch::Qwen2,
        Arch::Qwen3,
        Arch::Qwen3Moe,
        Arch::Gemma3,
        Arch::Phi3,
    ];

    /// The GGUF `general.architecture` string.
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Qwen3Moe => "qwen3moe",
            Arch::Gemma3 => "gemma3",
            Arch::Phi3 => "phi3",
        }
    }

    /// The family a GGUF `general.architecture` string names.
    pub fn parse(s: &str) -> Option<Arch> {
        Arch::ALL.into_iter().find(|a| a.name() == s)
    }

    /// "llama, qwen2, ..." for error messages.
    pub fn supported() -> String {
        Arch::ALL.map(Arch::name).join(", ")
    }
}

/// The feed-forward activation of a gated FFN: act(gate(x)) · up(x).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum FfnAct {
    /// SwiGLU (llama, qwen, phi3).
    #[default]
    Silu,
    /// GeGLU with the tanh approximation of GELU (gemma).
    GeluTanh,
}

/// Interleaved sliding-window attention (gemma3): local layers attend to
/// the last `window` positions only (their own RoPE base), global layers to
/// everything. Local layers keep exactly their window in a cache of their
/// own; the budgeted cache (and every policy) sees the global layers only.
#[derive(Clone, Debug, PartialEq)]
pub struct Swa {
    /// Positions a local layer's query sees, itself included.
    pub window: usize,
    /// (n_layers,) whether layer l is local.
    pub local: Vec<bool>,
    /// RoPE base of the local layers.
    pub rope_base: f32,
}

/// A mixture-of-experts FFN (qwen3moe): a router picks `n_used` of
/// `n_expert` SwiGLU experts per token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Moe {
    pub n_expert: usize,
    pub n_used: usize,
    /// Hidden width of one expert.
    pub expert_ffn: usize,
    /// Renormalize the chosen experts' softmax weights to sum to 1.
    pub norm_weights: bool,
}

/// What a family adds to the llama block (all off for llama / qwen2).
#[derive(Clone, Debug, PartialEq)]
pub struct Features {
    /// RMSNorm of every query and key head (weights (head_dim,)) before RoPE.
    pub qk_norm: bool,
    /// RMSNorm of the attention and FFN outputs before their residual adds.
    pub post_norms: bool,
    pub ffn_act: FfnAct,
    /// Token embeddings are multiplied by this (gemma: √dim).
    pub embed_scale: f32,
    /// Softmax scale of attention scores (1/√head_dim unless the model says).
    pub attn_scale: f32,
    /// Final logits become c·tanh(logit / c) when c > 0.
    pub logit_softcap: f32,
    pub swa: Option<Swa>,
    pub moe: Option<Moe>,
    /// LongRoPE (phi3): cos/sin scale, and the context length up to which
    /// the short frequency factors apply (0: no long factors).
    pub rope_mscale: f32,
    pub n_ctx_orig: usize,
}

impl Features {
    /// The plain llama block for heads of `head_dim`.
    pub fn plain(head_dim: usize) -> Features {
        Features {
            qk_norm: false,
            post_norms: false,
            ffn_act: FfnAct::Silu,
            embed_scale: 1.0,
            attn_scale: 1.0 / (head_dim as f32).sqrt(),
            logit_softcap: 0.0,
            swa: None,
            moe: None,
            rope_mscale: 1.0,
            n_ctx_orig: 0,
        }
    }

    /// Whether the block is the plain llama block. The original context
    /// length is ignored: it only matters with LongRoPE factors, which a
    /// plain block has none of.
    pub fn is_plain(&self, head_dim: usize) -> bool {
        *self
            == Features {
                n_ctx_orig: self.n_ctx_orig,
                ..Features::plain(head_dim)
            }
    }
}

/// Hyperparameters of a decoder-only transformer.
#[derive(Clone, Debug)]
pub struct Config {
    pub arch: Arch,
    pub n_layers: usize,
    /// Residual stream width.
    pub dim: usize,
    /// FFN hidden width.
    pub ffn_dim: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    /// Context length the model was trained for.
    pub n_ctx_train: usize,
    pub norm_eps: f32,
    pub rope_base: f32,
    /// Rotated dimensions per head.
    pub n_rot: usize,
    pub rope_style: RopeStyle,
    /// 1 / linear RoPE scaling factor (1.0 = none).
    pub rope_pos_scale: f32,
    /// Output head is the embedding matrix.
    pub tied_output: bool,
    /// What the family adds to the llama block.
    pub features: Features,
}

impl Config {
    /// n_kv_heads * head_dim.
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
    /// n_heads * head_dim.
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }

    /// Whether layer `l` is a sliding-window (local) layer.
    pub fn is_local(&self, l: usize) -> bool {
        self.features
            .swa
            .as_ref()
            .is_some_and(|s| s.local.get(l).copied().unwrap_or(false))
    }

    /// The layers whose K/V live in the budgeted cache, in order: every
    /// layer but the local ones. Cache layer i is model layer
    /// `cache_layers()[i]`; policies, signals and budgets count these.
    pub fn cache_layers(&self) -> Vec<usize> {
        (0..self.n_layers).filter(|&l| !self.is_local(l)).collect()
    }

    /// How many layers the budgeted cache holds.
    pub fn n_cache_layers(&self) -> usize {
        self.n_layers - (0..self.n_layers).filter(|&l| self.is_local(l)).count()
    }

    /// FFN hidden width of one token's pass (the routed experts' width for
    /// a mixture of experts).
    pub fn ffn_width(&self) -> usize {
        match &self.features.moe {
            Some(m) => m.expert_ffn,
            None => self.ffn_dim,
        }
    }

    /// Read hyperparameters from GGUF metadata.
    pub fn from_gguf(g: &Gguf) -> Result<Config> {
        let arch_s = g.get_str("general.architecture")?;
        let arch = Arch::parse(arch_s).ok_or_else(|| Error::UnknownArchitecture {
            path: g.path.clone(),
            arch: arch_s.to_owned(),
        })?;
        let k = |s: &str| format!("{arch_s}.{s}");
        let n_layers = g.get_usize(&k("block_count"))?;
        let dim = g.get_usize(&k("embedding_length"))?;
        let ffn_dim = g.get_usize(&k("feed_forward_length"))?;
        let n_heads = g.get_usize(&k("attention.head_count"))?;
        let n_kv_heads = match g.get(&k("attention.head_count_kv")) {
            Some(_) => g.get_usize(&k("attention.head_count_kv"))?,
            None => n_heads,
        };
        let bad = |key: String, what: String| Error::BadMetadata {
            path: g.path.clone(),
            key,
            what,
        };
        if n_layers == 0 || dim == 0 || n_heads == 0 || n_kv_heads == 0 || n_heads % n_kv_heads != 0
        {
            return Err(bad(
                k("attention.head_count"),
                format!("inconsistent shape: layers {n_layers}, dim {dim}, heads {n_heads}/{n_kv_heads}"),
            ));
        }
        let head_dim = match g.get(&k("attention.key_length")) {
            Some(_) => g.get_usize(&k("attention.key_length"))?,
            None => dim / n_heads,
        };
        if n_heads / n_kv_heads > MAX_GROUP {
            return Err(bad(
                k("attention.head_count_kv"),
                format!(
                    "{} query heads per KV head (at most {})",
                    n_heads / n_kv_heads,
                    MAX_GROUP
                ),
            ));
        }
        if head_dim == 0 || head_dim > 256 || head_dim % 2 != 0 {
            return Err(bad(
                k("attention.key_length"),
                format!("head_dim {head_dim} unsupported"),
            ));
        }
        let n_rot = match g.get(&k("rope.dimension_count")) {
            Some(_) => g.get_usize(&k("rope.dimension_count"))?,
            None => head_dim,
        };
        if n_rot > head_dim || n_rot % 2 != 0 {
            return Err(bad(
                k("rope.dimension_count"),
                format!("{n_rot} rotated dims with head_dim {head_dim}"),
            ));
        }
        let mut rope_pos_scale = 1.0;
        if let Some(v) = g.get(&k("rope.scaling.type")) {
            match v.as_str() {
                Some("none") | None => {}
                // LongRoPE: per-dimension factors come as tensors
                // (rope_factors_short / _long), the attention factor below
                Some("longrope") => {}
                Some("linear") => {
                    let f = g.get_f32_opt(&k("rope.scaling.factor"))?.unwrap_or(1.0);
                    if !(f.is_finite() && f > 0.0) {
                        return Err(bad(
                            k("rope.scaling.factor"),
                            format!("{f} is not a usable scaling factor (finite, above 0)"),
                        ));
                    }
                    rope_pos_scale = 1.0 / f;
                }
                Some(other) => {
                    return Err(bad(
                        k("rope.scaling.type"),
                        format!("RoPE scaling '{other}' is not supported"),
                    ))
                }
            }
        }
        // numbers the math divides by or exponentiates: finite and in range,
        // or the file is corrupt (never silent NaN logits)
        let norm_eps = g
            .get_f32_opt(&k("attention.layer_norm_rms_epsilon"))?
            .unwrap_or(1e-5);
        if !(norm_eps.is_finite() && (0.0..1.0).contains(&norm_eps)) {
            return Err(bad(
                k("attention.layer_norm_rms_epsilon"),
                format!("{norm_eps} is not a usable epsilon (finite, in [0, 1))"),
            ));
        }
        let rope_base = g.get_f32_opt(&k("rope.freq_base"))?.unwrap_or(10000.0);
        if !(rope_base.is_finite() && rope_base > 1.0) {
            return Err(bad(
                k("rope.freq_base"),
                format!("{rope_base} is not a usable RoPE base (finite, above 1)"),
            ));
        }
        let features = Self::features_from_gguf(g, arch, n_layers, head_dim, dim)?;
        let vocab = g
            .info("token_embd.weight")
            .map(|t| t.dims.get(1).copied().unwrap_or(0) as usize)
            .ok_or_else(|| Error::MissingTensor {
                path: g.path.clone(),
                tensor: "token_embd.weight".into(),
            })?;
        Ok(Config {
            arch,
            n_layers,
            dim,
            ffn_dim,
            n_heads,
            n_kv_heads,
            head_dim,
            vocab,
            n_ctx_train: g.get_usize(&k("context_length")).unwrap_or(2048),
            norm_eps,
            rope_base,
            n_rot,
            rope_style: match arch {
                Arch::Llama => RopeStyle::Normal,
                Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen3Moe | Arch::Gemma3 | Arch::Phi3 => {
                    RopeStyle::Neox
                }
            },
            rope_pos_scale,
            tied_output: g.info("output.weight").is_none(),
            features,
        })
    }

    /// What `arch` adds to the llama block, from its metadata.
    fn features_from_gguf(
        g: &Gguf,
        arch: Arch,
        n_layers: usize,
        head_dim: usize,
        dim: usize,
    ) -> Result<Features> {
        let k = |s: &str| format!("{}.{s}", arch.name());
        let bad = |key: String, what: String| Error::BadMetadata {
            path: g.path.clone(),
            key,
            what,
        };
        let mut f = Features::plain(head_dim);
        match arch {
            Arch::Llama | Arch::Qwen2 | Arch::Phi3 => {}
            Arch::Qwen3 => f.qk_norm = true,
            Arch::Qwen3Moe => {
                f.qk_norm = true;
                let n_expert = g.get_usize(&k("expert_count"))?;
                let n_used = g.get_usize(&k("expert_used_count"))?;
                if n_expert == 0 || n_used == 0 || n_used > n_expert || n_expert > 1024 {
                    return Err(bad(
                        k("expert_used_count"),
                        format!("{n_used} of {n_expert} experts per token is not a usable router"),
                    ));
                }
                let expert_ffn = match g.get(&k("expert_feed_forward_length")) {
                    Some(_) => g.get_usize(&k("expert_feed_forward_length"))?,
                    None => g.get_usize(&k("feed_forward_length"))? / n_used,
                };
                f.moe = Some(Moe {
                    n_expert,
                    n_used,
                    expert_ffn,
                    norm_weights: true,
                });
            }
            Arch::Gemma3 => {
                f.qk_norm = true;
                f.post_norms = true;
                f.ffn_act = FfnAct::GeluTanh;
                f.embed_scale = (dim as f32).sqrt();
                f.logit_softcap = g.get_f32_opt(&k("final_logit_softcapping"))?.unwrap_or(0.0);
                if !(f.logit_softcap.is_finite() && f.logit_softcap >= 0.0) {
                    return Err(bad(
                        k("final_logit_softcapping"),
                        format!("{} is not a usable soft cap", f.logit_softcap),
                    ));
                }
                // the 27B model scales by its width per head, not head_dim
                if n_layers == 62 {
                    let n_heads = g.get_usize(&k("attention.head_count"))?;
                    f.attn_scale = 1.0 / ((dim / n_heads) as f32).sqrt();
                }
                let window = match g.get(&k("attention.sliding_window")) {
                    Some(_) => g.get_usize(&k("attention.sliding_window"))?,
                    None => 0,
                };
                if window > 0 {
                    // every sixth layer is global unless the file says otherwise
                    let pattern = match g.get(&k("attention.sliding_window_pattern")) {
                        Some(_) => g.get_usize(&k("attention.sliding_window_pattern"))?,
                        None => 6,
                    };
                    let local = (0..n_layers)
                        .map(|l| pattern == 0 || l % pattern < pattern - 1)
                        .collect();
                    let swa_base = g.get_f32_opt(&k("rope.freq_base_swa"))?.unwrap_or(10000.0);
                    if !(swa_base.is_finite() && swa_base > 1.0) {
                        return Err(bad(
                            k("rope.freq_base_swa"),
                            format!("{swa_base} is not a usable RoPE base (finite, above 1)"),
                        ));
                    }
                    f.swa = Some(Swa {
                        window,
                        local,
                        rope_base: swa_base,
                    });
                }
            }
        }
        if let Some(a) = g.get_f32_opt(&k("rope.scaling.attn_factor"))? {
            if !(a.is_finite() && a > 0.0) {
                return Err(bad(
                    k("rope.scaling.attn_factor"),
                    format!("{a} is not a usable attention factor"),
                ));
            }
            f.rope_mscale = a;
        }
        f.n_ctx_orig = match g.get(&k("rope.scaling.original_context_length")) {
            Some(_) => g.get_usize(&k("rope.scaling.original_context_length"))?,
            None => g.get_usize(&k("context_length")).unwrap_or(0),
        };
        Ok(f)
    }
}

/// Weights of one decoder layer, as backend `B` holds them.
#[derive(Debug)]
pub struct LayerWeights<'a, B: Backend = Host> {
    /// (dim,)
    pub attn_norm: B::Vector,
    /// (q_dim, dim)
    pub wq: B::Mat<'a>,
    /// (kv_dim, dim)
    pub wk: B::Mat<'a>,
    /// (kv_dim, dim)
    pub wv: B::Mat<'a>,
    /// Optional biases (qwen2): (q_dim,), (kv_dim,), (kv_dim,)
    pub bq: Option<B::Vector>,
    pub bk: Option<B::Vector>,
    pub bv: Option<B::Vector>,
    /// Per-head RMSNorm weights of queries and keys, (head_dim,) each
    /// (qwen3, gemma3).
    pub q_norm: Option<B::Vector>,
    pub k_norm: Option<B::Vector>,
    /// (dim, q_dim)
    pub wo: B::Mat<'a>,
    /// RMSNorm of the attention output before its residual add, (dim,) (gemma3).
    pub post_attn_norm: Option<B::Vector>,
    /// (dim,)
    pub ffn_norm: B::Vector,
    /// RMSNorm of the FFN output before its residual add, (dim,) (gemma3).
    pub post_ffn_norm: Option<B::Vector>,
    pub ffn: Ffn<'a, B>,
}

/// A layer's feed-forward weights.
#[derive(Debug)]
pub enum Ffn<'a, B: Backend = Host> {
    /// One gated FFN: gate, up (ffn_dim, dim) and down (dim, ffn_dim).
    Dense {
        gate: B::Mat<'a>,
        up: B::Mat<'a>,
        down: B::Mat<'a>,
    },
    /// A router (n_expert, dim) and the experts, each a gated FFN of
    /// width expert_ffn (views of rows of the 3-D expert tensors).
    Moe {
        router: B::Mat<'a>,
        experts: Vec<Expert<'a, B>>,
    },
}

/// One expert of a mixture: gate, up (expert_ffn, dim), down (dim, expert_ffn).
#[derive(Debug)]
pub struct Expert<'a, B: Backend = Host> {
    pub gate: B::Mat<'a>,
    pub up: B::Mat<'a>,
    pub down: B::Mat<'a>,
}

impl<'a, B: Backend> Ffn<'a, B> {
    /// (gate, up, down) of a dense FFN; None for a mixture of experts.
    pub fn dense(&self) -> Option<(&B::Mat<'a>, &B::Mat<'a>, &B::Mat<'a>)> {
        match self {
            Ffn::Dense { gate, up, down } => Some((gate, up, down)),
            Ffn::Moe { .. } => None,
        }
    }
}

/// All weights of a model on backend `B` (the CPU by default: matrices
/// borrow the memory map), immutable after loading.
#[derive(Debug)]
pub struct Weights<'a, B: Backend = Host> {
    pub config: Config,
    /// (vocab, dim)
    pub token_embd: B::Mat<'a>,
    pub layers: Vec<LayerWeights<'a, B>>,
    /// (dim,)
    pub output_norm: B::Vector,
    /// (vocab, dim); None when tied to `token_embd`.
    pub output: Option<B::Mat<'a>>,
    pub rope: Rope,
    /// RoPE of the sliding-window layers (their own base), if any.
    pub rope_local: Option<Rope>,
    /// LongRoPE's long factors (phi3): used by sessions whose context
    /// exceeds `features.n_ctx_orig`, as llama.cpp chooses.
    pub rope_long: Option<Rope>,
}

impl<'a> Weights<'a, Host> {
    /// The same weights seen with a shorter borrow of their maps. Host
    /// weights are covariant in that borrow (matrices are `QMat<'a>`, a
    /// `Cow<'a, [u8]>`), but the compiler cannot see it through the
    /// backend's associated type, so this is the explicit coercion.
    pub fn shorten<'b>(&'b self) -> &'b Weights<'b, Host>
    where
        'a: 'b,
    {
        // SAFETY: Weights<'a, Host> and Weights<'b, Host> are the same type
        // up to the lifetime (same layout); every field that carries 'a
        // (QMat<'a>: a Cow<'a, [u8]> and plain data) is covariant in it, so
        // reading them as borrowed for 'b ≤ 'a is a valid subtyping
        // coercion, and the result's borrow of `self` keeps 'b alive.
        unsafe { std::mem::transmute::<&'b Weights<'a, Host>, &'b Weights<'b, Host>>(self) }
    }

    /// Load from a GGUF file for the host backend (checks every shape against the config).
    pub fn from_gguf(g: &'a Gguf) -> Result<Weights<'a, Host>> {
        Self::from_gguf_on(&HOST_LOADER, g)
    }

    /// Load through any tensor source, for the host backend.
    pub fn load(cfg: Config, src: &dyn TensorSource<'a>) -> Result<Weights<'a, Host>> {
        Self::load_on(&HOST_LOADER, cfg, src)
    }
}

impl<'a, B: Backend + 'a> Weights<'a, B> {
    /// The output projection (the embedding matrix when tied).
    pub fn output(&self) -> &B::Mat<'a> {
        self.output.as_ref().unwrap_or(&self.token_embd)
    }

    /// Load from a GGUF file onto a backend.
    pub fn from_gguf_on(sink: &dyn WeightSink<B>, g: &'a Gguf) -> Result<Weights<'a, B>> {
        let cfg = Config::from_gguf(g)?;
        g.check_data()?;
        let src = GgufSource(g);
        Weights::load_on(sink, cfg, &src)
    }

    /// Load through any tensor source onto a backend.
    pub fn load_on(
        sink: &dyn WeightSink<B>,
        cfg: Config,
        src: &dyn TensorSource<'a>,
    ) -> Result<Weights<'a, B>> {
        let (d, q, kv, f, v) = (
            cfg.dim as u64,
            cfg.q_dim() as u64,
            cfg.kv_dim() as u64,
            cfg.ffn_dim as u64,
            cfg.vocab as u64,
        );
        let mat = |name: &str, shape: [u64; 2]| -> Result<B::Mat<'a>> {
            let t = src.tensor(name, &shape)?;
            sink.matrix(t.0, shape[0] as usize, shape[1] as usize, t.1)
        };
        // rows r0..r1 of a fused (n_in, n_rows) matrix as a matrix of its
        // own (rows are contiguous, so this is a view of the same bytes)
        let rows = |name: &str, n_in: u64, n_rows: u64, r0: u64, r1: u64| -> Result<B::Mat<'a>> {
            let (dt, bytes) = src.tensor(name, &[n_in, n_rows])?;
            let rb = dt.row_bytes(n_in as usize);
            let (a, b) = (r0 as usize * rb, r1 as usize * rb);
            let part = match bytes {
                Cow::Borrowed(all) => Cow::Borrowed(&all[a..b]),
                Cow::Owned(all) => Cow::Owned(all[a..b].to_vec()),
            };
            sink.matrix(dt, n_in as usize, (r1 - r0) as usize, part)
        };
        let hd = cfg.head_dim as u64;
        let host = |name: &str, n: u64| -> Result<Vec<f32>> {
            let (dt, bytes) = src.tensor(name, &[n])?;
            let mut out = vec![0f32; n as usize];
            crate::quant::dequantize_row(dt, &bytes, &mut out);
            Ok(out)
        };
        let vecf = |name: &str, n: u64| -> Result<B::Vector> { sink.vector(host(name, n)?) };
        let optf = |name: &str, n: u64| -> Result<Option<B::Vector>> {
            if src.has(name) {
                vecf(name, n).map(Some)
            } else {
                Ok(None)
            }
        };
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for l in 0..cfg.n_layers {
            let p = |s: &str| format!("blk.{l}.{s}");
            let fx = &cfg.features;
            let need = |on: bool, name: &str, n: u64| -> Result<Option<B::Vector>> {
                if on {
                    vecf(name, n).map(Some)
                } else {
                    Ok(None)
                }
            };
            // in block order, so a missing tensor is named in that order
            let attn_norm = vecf(&p("attn_norm.weight"), d)?;
            // phi3 fuses q, k, v into one matrix and gate, up into another
            let (wq, wk, wv) = if src.has(&p("attn_qkv.weight")) {
                let fused = p("attn_qkv.weight");
                let all = q + 2 * kv;
                (
                    rows(&fused, d, all, 0, q)?,
                    rows(&fused, d, all, q, q + kv)?,
                    rows(&fused, d, all, q + kv, all)?,
                )
            } else {
                (
                    mat(&p("attn_q.weight"), [d, q])?,
                    mat(&p("attn_k.weight"), [d, kv])?,
                    mat(&p("attn_v.weight"), [d, kv])?,
                )
            };
            let ffn = if let Some(m) = &fx.moe {
                // expert e is rows e·fe..(e+1)·fe of the (dim, fe, n_exp)
                // gate/up tensors and rows e·dim.. of the (fe, dim, n_exp) down
                let (e, fe) = (m.n_expert as u64, m.expert_ffn as u64);
                let (g3, u3, d3) = (
                    p("ffn_gate_exps.weight"),
                    p("ffn_up_exps.weight"),
                    p("ffn_down_exps.weight"),
                );
                let part = |name: &str, n_in: u64, n_out: u64, i: u64| -> Result<B::Mat<'a>> {
                    let (dt, bytes) = src.tensor(name, &[n_in, n_out, e])?;
                    let rb = dt.row_bytes(n_in as usize);
                    let (a, b) = ((i * n_out) as usize * rb, ((i + 1) * n_out) as usize * rb);
                    let view = match bytes {
                        Cow::Borrowed(all) => Cow::Borrowed(&all[a..b]),
                        Cow::Owned(all) => Cow::Owned(all[a..b].to_vec()),
                    };
                    sink.matrix(dt, n_in as usize, n_out as usize, view)
                };
                Ffn::Moe {
                    router: mat(&p("ffn_gate_inp.weight"), [d, e])?,
                    experts: (0..e)
                        .map(|i| {
                            Ok(Expert {
                                gate: part(&g3, d, fe, i)?,
                                up: part(&u3, d, fe, i)?,
                                down: part(&d3, fe, d, i)?,
                            })
                        })
                        .collect::<Result<Vec<_>>>()?,
                }
            } else if src.has(&p("ffn_gate.weight")) {
                Ffn::Dense {
                    gate: mat(&p("ffn_gate.weight"), [d, f])?,
                    up: mat(&p("ffn_up.weight"), [d, f])?,
                    down: mat(&p("ffn_down.weight"), [f, d])?,
                }
            } else {
                // phi3: gate and up fused, gate first
                let fused = p("ffn_up.weight");
                Ffn::Dense {
                    gate: rows(&fused, d, 2 * f, 0, f)?,
                    up: rows(&fused, d, 2 * f, f, 2 * f)?,
                    down: mat(&p("ffn_down.weight"), [f, d])?,
                }
            };
            layers.push(LayerWeights {
                attn_norm,
                wq,
                wk,
                wv,
                bq: optf(&p("attn_q.bias"), q)?,
                bk: optf(&p("attn_k.bias"), kv)?,
                bv: optf(&p("attn_v.bias"), kv)?,
                q_norm: need(fx.qk_norm, &p("attn_q_norm.weight"), hd)?,
                k_norm: need(fx.qk_norm, &p("attn_k_norm.weight"), hd)?,
                wo: mat(&p("attn_output.weight"), [q, d])?,
                post_attn_norm: need(fx.post_norms, &p("post_attention_norm.weight"), d)?,
                ffn_norm: vecf(&p("ffn_norm.weight"), d)?,
                post_ffn_norm: need(fx.post_norms, &p("post_ffw_norm.weight"), d)?,
                ffn,
            });
        }
        // frequency factors: rope_freqs (llama 3), or LongRoPE's short
        // factors (phi3; its long ones serve contexts past n_ctx_orig)
        let half = (cfg.n_rot / 2) as u64;
        let freq_factors = if src.has("rope_freqs.weight") {
            Some(host("rope_freqs.weight", half)?)
        } else if src.has("rope_factors_short.weight") {
            Some(host("rope_factors_short.weight", half)?)
        } else {
            None
        };
        let mut rope = Rope::new(
            cfg.rope_style,
            cfg.n_rot,
            cfg.rope_base,
            freq_factors.as_deref(),
            cfg.rope_pos_scale,
        );
        rope.mscale = cfg.features.rope_mscale;
        let rope_long = if src.has("rope_factors_long.weight") {
            let long = host("rope_factors_long.weight", half)?;
            let mut r = Rope::new(
                cfg.rope_style,
                cfg.n_rot,
                cfg.rope_base,
                Some(&long),
                cfg.rope_pos_scale,
            );
            r.mscale = cfg.features.rope_mscale;
            Some(r)
        } else {
            None
        };
        // local (sliding-window) layers rotate with their own base
        let rope_local = cfg.features.swa.as_ref().map(|s| {
            Rope::new(
                cfg.rope_style,
                cfg.n_rot,
                s.rope_base,
                freq_factors.as_deref(),
                1.0,
            )
        });
        let untied = src.has("output.weight");
        Ok(Weights {
            // only read by rows unless it is also the output matrix
            token_embd: if untied {
                let (dt, bytes) = src.tensor("token_embd.weight", &[d, v])?;
                sink.table(dt, d as usize, v as usize, bytes)?
            } else {
                mat("token_embd.weight", [d, v])?
            },
            output: if untied {
                Some(mat("output.weight", [d, v])?)
            } else {
                None
            },
            output_norm: vecf("output_norm.weight", d)?,
            layers,
            rope,
            rope_local,
            rope_long,
            config: cfg,
        })
    }
}

/// Where weights come from: a GGUF map or converted safetensors.
pub trait TensorSource<'a> {
    /// Whether the tensor exists.
    fn has(&self, name: &str) -> bool;
    /// The tensor's type and bytes, checked against the expected ggml-order shape.
    fn tensor(&self, name: &str, shape: &[u64]) -> Result<(DType, Cow<'a, [u8]>)>;
}

struct GgufSource<'a>(&'a Gguf);

impl<'a> TensorSource<'a> for GgufSource<'a> {
    fn has(&self, name: &str) -> bool {
        self.0.info(name).is_some()
    }
    fn tensor(&self, name: &str, shape: &[u64]) -> Result<(DType, Cow<'a, [u8]>)> {
        let t: TensorView<'a> = self.0.tensor(name)?;
        let mut got: Vec<u64> = t.dims.to_vec();
        while got.len() > shape.len() && got.last() == Some(&1) {
            got.pop();
        }
        if got != shape {
            return Err(Error::ShapeMismatch {
                path: PathBuf::from(&self.0.path),
                tensor: name.to_owned(),
                got: t.dims.to_vec(),
                want: shape.to_vec(),
            });
        }
        Ok((t.dtype, Cow::Borrowed(t.bytes)))
    }
}
