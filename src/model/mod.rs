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
}

impl Arch {
    /// The GGUF `general.architecture` string.
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
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

    /// Read hyperparameters from GGUF metadata.
    pub fn from_gguf(g: &Gguf) -> Result<Config> {
        let arch_s = g.get_str("general.architecture")?;
        let arch = match arch_s {
            "llama" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            other => {
                return Err(Error::UnknownArchitecture {
                    path: g.path.clone(),
                    arch: other.to_owned(),
                })
            }
        };
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
                Arch::Qwen2 => RopeStyle::Neox,
            },
            rope_pos_scale,
            tied_output: g.info("output.weight").is_none(),
        })
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
    /// (dim, q_dim)
    pub wo: B::Mat<'a>,
    /// (dim,)
    pub ffn_norm: B::Vector,
    /// (ffn_dim, dim)
    pub w_gate: B::Mat<'a>,
    /// (ffn_dim, dim)
    pub w_up: B::Mat<'a>,
    /// (dim, ffn_dim)
    pub w_down: B::Mat<'a>,
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
            layers.push(LayerWeights {
                attn_norm: vecf(&p("attn_norm.weight"), d)?,
                wq: mat(&p("attn_q.weight"), [d, q])?,
                wk: mat(&p("attn_k.weight"), [d, kv])?,
                wv: mat(&p("attn_v.weight"), [d, kv])?,
                bq: optf(&p("attn_q.bias"), q)?,
                bk: optf(&p("attn_k.bias"), kv)?,
                bv: optf(&p("attn_v.bias"), kv)?,
                wo: mat(&p("attn_output.weight"), [q, d])?,
                ffn_norm: vecf(&p("ffn_norm.weight"), d)?,
                w_gate: mat(&p("ffn_gate.weight"), [d, f])?,
                w_up: mat(&p("ffn_up.weight"), [d, f])?,
                w_down: mat(&p("ffn_down.weight"), [f, d])?,
            });
        }
        let freq_factors = if src.has("rope_freqs.weight") {
            Some(host("rope_freqs.weight", (cfg.n_rot / 2) as u64)?)
        } else {
            None
        };
        let rope = Rope::new(
            cfg.rope_style,
            cfg.n_rot,
            cfg.rope_base,
            freq_factors.as_deref(),
            cfg.rope_pos_scale,
        );
        Ok(Weights {
            token_embd: mat("token_embd.weight", [d, v])?,
            output: if src.has("output.weight") {
                Some(mat("output.weight", [d, v])?)
            } else {
                None
            },
            output_norm: vecf("output_norm.weight", d)?,
            layers,
            rope,
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
