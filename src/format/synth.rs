//! Synthetic-weight models: a GGUF whose metadata and tensor table are
//! another GGUF's, byte for byte (a header-only file such as
//! `../shared/data/r1-distill-qwen-7b.header.gguf`, or any model), and whose
//! tensor data is random, finite and well scaled. Real shapes and real
//! per-tensor quantization types without the real weights: speed is honest
//! at the real shape, and llama.cpp reads the same file, so logits can be
//! compared against it too.
//!
//! Values, per tensor:
//! - norm weights and RoPE frequency factors: 1;
//! - everything else (matrices, embeddings, biases): N(0, σ²), σ = 0.02 by
//!   default (the usual initialization scale), rounded into the tensor's
//!   type by ggml's reference quantizer, so every block is one a real
//!   quantizer could have written.
//!
//! The data are a function of the seed alone: tensors are cut into fixed
//! chunks of rows, each with its own generator seeded from (seed, tensor,
//! chunk), and the chunks are dealt to threads in any order.
//!
//! The same generator fills a file ([`write_file`]) or an anonymous memory
//! map ([`in_memory`], `-m synth:HEADER`), for a machine that cannot be sent
//! gigabytes of weights.

use crate::error::{Error, Result};
use crate::format::gguf::{Gguf, Value};
use crate::format::mmap::Mapped;
use crate::rng::Rng;
use crate::tensor::DType;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// What to generate.
#[derive(Debug, Clone, Copy)]
pub struct Spec {
    /// Seed of every value.
    pub seed: u64,
    /// Standard deviation of the random tensors.
    pub sigma: f32,
    /// Worker threads.
    pub threads: usize,
    /// Asked before every chunk of values: true stops the work with
    /// `Error::Interrupted` (Ctrl-C; a file being written is removed).
    pub stop: Option<fn() -> bool>,
}

impl Default for Spec {
    fn default() -> Spec {
        Spec {
            seed: 0,
            sigma: 0.02,
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            stop: None,
        }
    }
}

/// The prefix that names an in-memory synthetic model on `-m`.
pub const PREFIX: &str = "synth:";

/// Elements generated per chunk (one generator each).
const CHUNK_ELEMS: usize = 1 << 20;

/// One tensor of the plan: where its bytes go and how to make them.
#[derive(Debug)]
struct Item {
    index: usize,
    name: String,
    dtype: DType,
    n_in: usize,
    n_rows: usize,
    /// offset from the start of the data section
    offset: usize,
    bytes: usize,
}

/// The tensors of `g` in data order, checked: known types, block-aligned
/// rows, no overlaps. Returns them and the data section's length.
fn plan(g: &Gguf) -> Result<(Vec<Item>, usize)> {
    let bad = |msg: String| Error::Other(format!("{}: cannot synthesize: {msg}", g.path.display()));
    let mut items = Vec::with_capacity(g.tensors.len());
    for (index, t) in g.tensors.iter().enumerate() {
        let dtype = DType::from_ggml_id(t.type_id).ok_or_else(|| {
            bad(format!(
                "tensor '{}' has ggml type {}, which kvrun does not know",
                t.name, t.type_id
            ))
        })?;
        let bytes = t.n_bytes().ok_or_else(|| {
            bad(format!(
                "tensor '{}' {:?} is not whole {dtype} blocks",
                t.name, t.dims
            ))
        })?;
        let n_in = t.dims[0] as usize;
        let n_rows = (t.n_elements() / t.dims[0].max(1)) as usize;
        items.push(Item {
            index,
            name: t.name.clone(),
            dtype,
            n_in,
            n_rows,
            offset: usize::try_from(t.offset).map_err(|_| bad("offset too large".into()))?,
            bytes: usize::try_from(bytes).map_err(|_| bad("tensor too large".into()))?,
        });
    }
    items.sort_by_key(|i| i.offset);
    let mut end = 0usize;
    for i in &items {
        if i.offset < end {
            return Err(bad(format!(
                "tensor '{}' overlaps the one before it",
                i.name
            )));
        }
        end = i
            .offset
            .checked_add(i.bytes)
            .ok_or_else(|| bad("data size overflows".into()))?;
    }
    Ok((items, end))
}

/// Total bytes of the synthetic file made from `g`'s header.
pub fn file_len(g: &Gguf) -> Result<u64> {
    Ok(g.data_offset + plan(g)?.1 as u64)
}

/// The value every element of tensor `name` takes, if constant.
fn constant(name: &str, n_dims: usize) -> Option<f32> {
    let one_d_norm = n_dims == 1 && name.contains("norm");
    if name.contains("rope_factors_short") {
        // LongRoPE factors: constant, unlike 1, so using them shows
        return Some(1.25);
    }
    if name.contains("rope_factors_long") {
        return Some(4.0);
    }
    (one_d_norm || name.contains("rope_freqs")).then_some(1.0)
}

/// Write `g`'s header and random tensor data into `out` (exactly
/// [`file_len`] bytes, zeroed).
pub fn fill(g: &Gguf, spec: &Spec, out: &mut [u8]) -> Result<()> {
    let (items, data_len) = plan(g)?;
    let hdr_len = g.data_offset as usize;
    assert_eq!(out.len(), hdr_len + data_len, "synth: output size");
    if !(spec.sigma.is_finite() && spec.sigma > 0.0) {
        return Err(Error::Other(format!(
            "synth: sigma {} must be finite and positive",
            spec.sigma
        )));
    }
    let src = g.bytes();
    let n = src.len().min(hdr_len);
    out[..n].copy_from_slice(&src[..n]);
    // cut the data section into disjoint chunks of whole rows
    let mut jobs = Vec::new();
    let mut rest = &mut out[hdr_len..];
    let mut at = 0usize;
    for it in &items {
        let (_, tail) = rest.split_at_mut(it.offset - at);
        let (mut tensor, tail) = tail.split_at_mut(it.bytes);
        rest = tail;
        at = it.offset + it.bytes;
        let row_bytes = it.dtype.row_bytes(it.n_in);
        let rows_per = (CHUNK_ELEMS / it.n_in.max(1)).max(1);
        let mut r0 = 0;
        let mut chunk = 0u64;
        while r0 < it.n_rows {
            let r1 = (r0 + rows_per).min(it.n_rows);
            let (part, tail) = tensor.split_at_mut((r1 - r0) * row_bytes);
            tensor = tail;
            jobs.push((it, chunk, r1 - r0, part));
            r0 = r1;
            chunk += 1;
        }
    }
    let n_dims = |i: usize| g.tensors[i].dims.len();
    let jobs = Mutex::new(jobs);
    let failed: Mutex<Option<Error>> = Mutex::new(None);
    std::thread::scope(|s| {
        for _ in 0..spec.threads.max(1) {
            s.spawn(|| {
                let mut x = Vec::new();
                loop {
                    {
                        let mut f = failed.lock().unwrap_or_else(|e| e.into_inner());
                        if f.is_none() && spec.stop.is_some_and(|stop| stop()) {
                            *f = Some(Error::Interrupted);
                        }
                        // one thread's failure (or a stop) ends every thread's work
                        if f.is_some() {
                            break;
                        }
                    }
                    let job = jobs.lock().unwrap_or_else(|e| e.into_inner()).pop();
                    let Some((it, chunk, rows, part)) = job else {
                        break;
                    };
                    x.clear();
                    x.resize(rows * it.n_in, 0.0);
                    match constant(&it.name, n_dims(it.index)) {
                        Some(c) => x.fill(c),
                        None => {
                            let mut rng = Rng::new(
                                spec.seed
                                    ^ (it.index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
                                    ^ chunk.wrapping_mul(0xD1B5_4A32_D192_ED03),
                            );
                            for v in x.iter_mut() {
                                *v = rng.normal() * spec.sigma;
                            }
                        }
                    }
                    if let Err(e) = encode(it.dtype, &x, part) {
                        *failed.lock().unwrap_or_else(|e| e.into_inner()) = Some(e);
                        break;
                    }
                }
            });
        }
    });
    match failed.into_inner().unwrap_or_else(|e| e.into_inner()) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Store f32 values `x` as `dtype` into `out` (exactly their bytes).
fn encode(dtype: DType, x: &[f32], out: &mut [u8]) -> Result<()> {
    if dtype == DType::F32 {
        for (o, v) in out.chunks_exact_mut(4).zip(x) {
            o.copy_from_slice(&v.to_le_bytes());
        }
        return Ok(());
    }
    ggml_sys::quantize_ref_into(dtype.ggml_id(), x, out)
        .map_err(|e| Error::Other(format!("synth: {dtype}: {e}")))
}

/// Make the synthetic model of `header` at `out` (written to a temporary
/// file beside it, then renamed). Returns its size in bytes.
pub fn write_file(header: &Path, recipe: &Recipe, out: &Path, spec: &Spec) -> Result<u64> {
    let g = derive(&Gguf::open(header)?, recipe)?;
    let len = file_len(&g)?;
    let io = |path: &Path| {
        let path = path.to_owned();
        move |source| Error::Io { path, source }
    };
    let tmp = PathBuf::from(format!("{}.tmp", out.display()));
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&tmp)
        .map_err(io(&tmp))?;
    let done = (|| {
        file.set_len(len).map_err(io(&tmp))?;
        // SAFETY: the file was just created by this process and is not
        // shared; nothing else maps or truncates it while the map lives.
        let mut map = unsafe { memmap2::MmapMut::map_mut(&file) }.map_err(io(&tmp))?;
        fill(&g, spec, &mut map)?;
        map.flush().map_err(io(&tmp))?;
        drop(map);
        std::fs::rename(&tmp, out).map_err(io(out))
    })();
    if done.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    done.map(|()| len)
}

/// The synthetic model of `header` after `recipe`, generated into memory;
/// its path reads `label`.
pub fn in_memory(header: &Path, recipe: &Recipe, label: &Path, spec: &Spec) -> Result<Gguf> {
    let g = derive(&Gguf::open(header)?, recipe)?;
    let len = usize::try_from(file_len(&g)?)
        .map_err(|_| Error::Other("synth: model larger than the address space".into()))?;
    let mut map = memmap2::MmapMut::map_anon(len).map_err(|source| Error::Io {
        path: header.to_owned(),
        source,
    })?;
    // the weights are read in place from this map, so they get the huge
    // pages a file's weights are copied into (a hint, given before the
    // first write; failing it changes nothing but speed)
    #[cfg(target_os = "linux")]
    let _ = map.advise(memmap2::Advice::HugePage);
    fill(&g, spec, &mut map)?;
    Gguf::from_mapped(label, Mapped::from_anon(map)?)
}

/// A `synth:HEADER[:ARCH][:SHAPE][:TYPE]` model name: `None` if `name` is not
/// one, else the header path and the recipe (an unknown SHAPE or TYPE is
/// an error naming the known ones).
pub fn parse_name(name: &Path) -> Option<Result<(PathBuf, Recipe)>> {
    let rest = name.to_str()?.strip_prefix(PREFIX)?;
    let mut parts = rest.split(':');
    let header = PathBuf::from(parts.next().unwrap_or(""));
    let mut recipe = Recipe::default();
    for p in parts {
        if let Some(s) = shape(p) {
            recipe.shape = Some(s);
        } else if let Some(a) = ARCHS.iter().find(|&&a| a == p) {
            recipe.arch = Some(a);
        } else if let Some(m) = Mix::parse(p) {
            recipe.mix = Some(m);
        } else {
            return Some(Err(Error::arg(
                "-m/--model",
                format!(
                    "{p:?} in {}: not a shape ({}), an architecture ({}) or a type ({})",
                    name.display(),
                    SHAPES.map(|(n, _)| n).join(", "),
                    ARCHS.join(", "),
                    Mix::ALL.map(|(n, _)| n).join(", ")
                ),
            )));
        }
    }
    Some(Ok((header, recipe)))
}

/// A llama.cpp quantization mix: the per-tensor types its quantizer picks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mix {
    Q4KM,
    Q5KM,
    Q8_0,
    Q4_0,
    Q6K,
    Q3KM,
    Q2K,
    IQ4XS,
    IQ4NL,
}

/// What a mix's choices depend on besides a tensor's name and layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MixModel {
    /// Transformer blocks.
    pub n_layers: usize,
    /// Query heads per KV head (grouped-query attention).
    pub gqa: usize,
    /// Whether the output head is the embedding table (no `output.weight`):
    /// then the table takes the output head's type.
    pub tied: bool,
}

impl Mix {
    /// Every mix, as `--type` names them.
    pub const ALL: [(&'static str, Mix); 9] = [
        ("Q4_K_M", Mix::Q4KM),
        ("Q5_K_M", Mix::Q5KM),
        ("Q8_0", Mix::Q8_0),
        ("Q4_0", Mix::Q4_0),
        ("Q6_K", Mix::Q6K),
        ("Q3_K_M", Mix::Q3KM),
        ("Q2_K", Mix::Q2K),
        ("IQ4_XS", Mix::IQ4XS),
        ("IQ4_NL", Mix::IQ4NL),
    ];

    /// The mix named `s` (case-insensitive).
    pub fn parse(s: &str) -> Option<Mix> {
        Mix::ALL
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(s))
            .map(|&(_, m)| m)
    }

    /// llama.cpp's `general.file_type` of the mix (its `llama_ftype`).
    pub fn file_type(self) -> u32 {
        match self {
            Mix::Q4_0 => 2,
            Mix::Q8_0 => 7,
            Mix::Q2K => 10,
            Mix::Q3KM => 12,
            Mix::Q4KM => 15,
            Mix::Q5KM => 17,
            Mix::Q6K => 18,
            Mix::IQ4NL => 25,
            Mix::IQ4XS => 30,
        }
    }

    /// The type llama.cpp's quantizer gives matrix `name` (layer `layer`,
    /// rows of `n_in`) of model `m` under this mix: the mix's base type,
    /// except
    /// - the output head (or the embedding table when it is tied): Q6_K
    ///   (Q8_0 in the Q8_0 mix);
    /// - `attn_v`: Q6_K in the Q4_K_M / Q5_K_M layers that get more bits
    ///   (the first and last eighth, every third in between); Q3_K_M: Q5_K
    ///   in the first two layers, Q4_K after; Q2_K: Q4_K with 4+ query heads
    ///   per KV head, else Q3_K; IQ4_XS, IQ4_NL: Q5_K with 4+ query heads
    ///   per KV head;
    /// - `ffn_down`: Q6_K in the K_M mixes' more-bits layers; Q3_K_M: Q5_K
    ///   in the first sixteenth, Q4_K after; Q2_K: Q3_K; IQ4_XS, IQ4_NL:
    ///   Q5_K in the first eighth (llama.cpp's choice without an importance
    ///   matrix);
    /// - `attn_output`: Q3_K_M: Q4_K; Q2_K: Q3_K;
    ///
    /// and where a row is not whole 256-value superblocks, the legacy type
    /// llama.cpp falls back to (Q2_K, Q3_K: Q4_0; IQ4_XS: IQ4_NL; Q4_K:
    /// Q5_0; Q5_K: Q5_1; Q6_K: Q8_0). The test
    /// `synth_mixes_type_tensors_as_llama_cpp_does` holds every mix to
    /// llama.cpp's own quantizer.
    pub fn type_of(self, name: &str, layer: Option<usize>, m: MixModel, n_in: u64) -> DType {
        let n = m.n_layers;
        // (past the first eighth: the third clause cannot underflow)
        let more_bits = |i: usize| i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2;
        let base = match self {
            Mix::Q4_0 => DType::Q4_0,
            Mix::Q8_0 => DType::Q8_0,
            Mix::Q4KM => DType::Q4K,
            Mix::Q5KM => DType::Q5K,
            Mix::Q6K => DType::Q6K,
            Mix::Q3KM => DType::Q3K,
            Mix::Q2K => DType::Q2K,
            Mix::IQ4XS => DType::IQ4XS,
            Mix::IQ4NL => DType::IQ4NL,
        };
        let iq4 = matches!(self, Mix::IQ4XS | Mix::IQ4NL);
        let k_m = matches!(self, Mix::Q4KM | Mix::Q5KM);
        let is = |role: &str| name.ends_with(&format!("{role}.weight"));
        let i = layer.unwrap_or(0);
        let t = if name == "output.weight" || (m.tied && name == "token_embd.weight") {
            if self == Mix::Q8_0 {
                DType::Q8_0
            } else {
                DType::Q6K
            }
        } else if is("attn_v") {
            match self {
                _ if k_m && more_bits(i) => DType::Q6K,
                Mix::Q3KM if i < 2 => DType::Q5K,
                Mix::Q3KM => DType::Q4K,
                Mix::Q2K if m.gqa >= 4 => DType::Q4K,
                Mix::Q2K => DType::Q3K,
                _ if iq4 && m.gqa >= 4 => DType::Q5K,
                _ => base,
            }
        } else if is("ffn_down") {
            match self {
                _ if k_m && more_bits(i) => DType::Q6K,
                Mix::Q3KM if i < n / 16 => DType::Q5K,
                Mix::Q3KM => DType::Q4K,
                Mix::Q2K => DType::Q3K,
                // (llama.cpp: without an importance matrix)
                _ if iq4 && i < n / 8 => DType::Q5K,
                _ => base,
            }
        } else if is("attn_output") {
            match self {
                Mix::Q3KM => DType::Q4K,
                Mix::Q2K => DType::Q3K,
                _ => base,
            }
        } else {
            base
        };
        if n_in.is_multiple_of(t.block_len() as u64) {
            return t;
        }
        match t {
            DType::Q2K | DType::Q3K => DType::Q4_0,
            DType::IQ4XS => DType::IQ4NL,
            DType::Q4K => DType::Q5_0,
            DType::Q5K => DType::Q5_1,
            DType::Q6K => DType::Q8_0,
            other => other,
        }
    }
}

/// Dimensions of a decoder-only transformer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    pub layers: usize,
    pub dim: usize,
    pub ffn: usize,
    pub heads: usize,
    pub kv_heads: usize,
    /// Width of one head (0: dim / heads).
    pub head_dim: usize,
    /// Mixture of experts: (experts, used per token, hidden width of one);
    /// (0, 0, 0) for a dense FFN.
    pub experts: (usize, usize, usize),
}

impl Shape {
    const fn dense(layers: usize, dim: usize, ffn: usize, heads: usize, kv_heads: usize) -> Shape {
        Shape {
            layers,
            dim,
            ffn,
            heads,
            kv_heads,
            head_dim: 0,
            experts: (0, 0, 0),
        }
    }

    /// Width of one head.
    pub fn hd(&self) -> usize {
        if self.head_dim > 0 {
            self.head_dim
        } else {
            self.dim / self.heads.max(1)
        }
    }
}

/// Named shapes (`--shape`), applied to a header of the same architecture
/// family (its tokenizer and vocabulary are kept), or to any header with
/// `--arch` (a new tensor table): the DeepSeek-R1 distills, Qwen3 8B and
/// 30B-A3B (128 experts, 8 per token), Phi-4-mini, and `tiny` / `tiny-moe`
/// (two small layers) for fast tests.
pub const SHAPES: [(&str, Shape); 10] = [
    ("r1-distill-qwen-1.5b", Shape::dense(28, 1536, 8960, 12, 2)),
    ("r1-distill-qwen-7b", Shape::dense(28, 3584, 18944, 28, 4)),
    ("r1-distill-qwen-14b", Shape::dense(48, 5120, 13824, 40, 8)),
    ("r1-distill-llama-8b", Shape::dense(32, 4096, 14336, 32, 8)),
    (
        "qwen3-8b",
        Shape {
            head_dim: 128,
            ..Shape::dense(36, 4096, 12288, 32, 8)
        },
    ),
    (
        "qwen3-30b-a3b",
        Shape {
            head_dim: 128,
            experts: (128, 8, 768),
            ..Shape::dense(48, 2048, 6144, 32, 4)
        },
    ),
    (
        // the 30B-A3B layer, 8 of its 48 layers: per-token speed of the
        // real expert shapes in a file that fits a small machine
        "qwen3-30b-a3b-8l",
        Shape {
            head_dim: 128,
            experts: (128, 8, 768),
            ..Shape::dense(8, 2048, 6144, 32, 4)
        },
    ),
    ("phi4-mini", Shape::dense(32, 3072, 8192, 24, 8)),
    ("tiny", Shape::dense(2, 256, 768, 2, 1)),
    (
        "tiny-moe",
        Shape {
            experts: (8, 2, 128),
            ..Shape::dense(2, 256, 768, 2, 1)
        },
    ),
];

/// The shape named `s`.
pub fn shape(s: &str) -> Option<Shape> {
    SHAPES.iter().find(|(n, _)| *n == s).map(|&(_, sh)| sh)
}

/// How to turn a header into the synthetic model's header.
#[derive(Debug, Clone, Copy, Default)]
pub struct Recipe {
    pub shape: Option<Shape>,
    pub mix: Option<Mix>,
    /// Build the tensor table of this architecture from scratch (the
    /// header gives only its tokenizer): one of [`ARCHS`].
    pub arch: Option<&'static str>,
}

/// Architectures `--arch` builds from scratch.
pub const ARCHS: [&str; 6] = ["llama", "qwen2", "qwen3", "qwen3moe", "gemma3", "phi3"];

/// Sliding window and local:global pattern of a synthetic gemma3: small,
/// so short prompts cross the window, and every other layer global.
pub const SYNTH_SWA: (usize, usize) = (16, 2);

fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("blk.")?.split('.').next()?.parse().ok()
}

/// The metadata and tensor table of `g` after `recipe`: reshaped (block
/// count, widths, heads; tensors of dropped layers left out; every tensor's
/// dims recomputed from its role) and retyped (the mix's choices; 1-D
/// tensors stay as they are).
pub fn apply(
    g: &Gguf,
    recipe: &Recipe,
) -> Result<(Vec<(String, Value)>, Vec<super::gguf_write::TensorSpec>)> {
    let bad = |m: String| Error::Other(format!("{}: cannot synthesize: {m}", g.path.display()));
    if let Some(a) = recipe.arch {
        let s = recipe
            .shape
            .ok_or_else(|| bad("building an architecture needs a shape".into()))?;
        return build_arch(g, a, &s, recipe.mix.unwrap_or(Mix::Q8_0));
    }
    let arch = g.get_str("general.architecture")?.to_owned();
    let key = |k: &str| format!("{arch}.{k}");
    let n_layers = match recipe.shape {
        Some(s) => s.layers,
        None => g.get_usize(&key("block_count"))?,
    };
    let mut meta = g.metadata.clone();
    let mut set = |k: String, v: Value| match meta.iter_mut().find(|(n, _)| *n == k) {
        Some(e) => e.1 = v,
        None => meta.push((k, v)),
    };
    if let Some(s) = recipe.shape {
        if s.heads == 0 || s.kv_heads == 0 || s.dim % s.heads != 0 || s.heads % s.kv_heads != 0 {
            return Err(bad(format!("inconsistent shape {s:?}")));
        }
        set(key("block_count"), Value::U32(s.layers as u32));
        set(key("embedding_length"), Value::U32(s.dim as u32));
        set(key("feed_forward_length"), Value::U32(s.ffn as u32));
        set(key("attention.head_count"), Value::U32(s.heads as u32));
        set(
            key("attention.head_count_kv"),
            Value::U32(s.kv_heads as u32),
        );
        if g.get(&key("rope.dimension_count")).is_some() {
            set(key("rope.dimension_count"), Value::U32(s.hd() as u32));
        }
        // the header's name belongs to its own shape (a "7B" reshaped to
        // 1.5B must not be listed as the 7B in bench tables)
        set(
            "general.name".into(),
            Value::Str(format!("synthetic {arch} {}L x {}", s.layers, s.dim)),
        );
    }
    if let Some(m) = recipe.mix {
        set("general.file_type".into(), Value::U32(m.file_type()));
    }
    let heads = match recipe.shape {
        Some(s) => (s.heads, s.kv_heads),
        None => {
            let h = g.get_usize(&key("attention.head_count")).unwrap_or(1);
            (h, g.get_usize(&key("attention.head_count_kv")).unwrap_or(h))
        }
    };
    let mix_model = MixModel {
        n_layers,
        gqa: heads.0 / heads.1.max(1),
        tied: !g.tensors.iter().any(|t| t.name == "output.weight"),
    };
    let mut tensors = Vec::new();
    for t in &g.tensors {
        let layer = layer_of(&t.name);
        if layer.is_some_and(|l| l >= n_layers) {
            continue;
        }
        let mut dims = t.dims.clone();
        if let Some(s) = recipe.shape {
            let hd = s.hd() as u64;
            let (d, f, q, kv) = (
                s.dim as u64,
                s.ffn as u64,
                s.heads as u64 * hd,
                s.kv_heads as u64 * hd,
            );
            let role = t.name.rsplit_once('.').map_or("", |(stem, _)| stem);
            let role = role.rsplit('.').next().unwrap_or("");
            let suffix = t.name.rsplit('.').next().unwrap_or("");
            dims = match (role, suffix) {
                ("token_embd" | "output", "weight") => vec![d, t.dims[1]],
                ("output_norm" | "attn_norm" | "ffn_norm", _) => vec![d],
                ("attn_q", "weight") => vec![d, q],
                ("attn_q", "bias") => vec![q],
                ("attn_k" | "attn_v", "weight") => vec![d, kv],
                ("attn_k" | "attn_v", "bias") => vec![kv],
                ("attn_output", "weight") => vec![q, d],
                ("ffn_gate" | "ffn_up", "weight") => vec![d, f],
                ("ffn_down", "weight") => vec![f, d],
                ("rope_freqs", _) => vec![hd / 2],
                _ => return Err(bad(format!("no rule to reshape tensor '{}'", t.name))),
            };
        }
        let dtype = DType::from_ggml_id(t.type_id).ok_or_else(|| {
            bad(format!(
                "tensor '{}' has ggml type {}, which kvrun does not know",
                t.name, t.type_id
            ))
        })?;
        let dtype = match recipe.mix {
            Some(m) if dims.len() >= 2 => m.type_of(&t.name, layer, mix_model, dims[0]),
            _ => dtype,
        };
        tensors.push(super::gguf_write::TensorSpec {
            name: t.name.clone(),
            dims,
            dtype,
        });
    }
    Ok((meta, tensors))
}

/// The header of `g` after `recipe`, parsed (an anonymous map holding only
/// the header; its path reads like `g`'s).
pub fn derive(g: &Gguf, recipe: &Recipe) -> Result<Gguf> {
    let (meta, tensors) = apply(g, recipe)?;
    let (bytes, _) = super::gguf_write::header(&meta, &tensors, g.alignment)?;
    let mut map = memmap2::MmapMut::map_anon(bytes.len()).map_err(|source| Error::Io {
        path: g.path.clone(),
        source,
    })?;
    map.copy_from_slice(&bytes);
    Gguf::from_mapped(&g.path, Mapped::from_anon(map)?)
}

/// Metadata and tensor table of architecture `arch` at shape `s`, typed
/// by `mix`, with the tokenizer (every `tokenizer.*` key) of `g`: what a
/// llama.cpp conversion of such a model holds, for the families kvrun
/// runs (q/k norms for qwen3 / qwen3moe / gemma3, gemma3's post-norms and
/// sliding window, the router and 3-D expert tensors of qwen3moe, phi3's
/// fused QKV and gate/up). Small models tie the output to the embedding
/// (gemma3, qwen3); the others have their own.
fn build_arch(
    g: &Gguf,
    arch: &str,
    s: &Shape,
    mix: Mix,
) -> Result<(Vec<(String, Value)>, Vec<super::gguf_write::TensorSpec>)> {
    let bad = |m: String| Error::Other(format!("{}: cannot synthesize: {m}", g.path.display()));
    if !ARCHS.contains(&arch) {
        return Err(bad(format!(
            "unknown architecture {arch:?} (known: {})",
            ARCHS.join(", ")
        )));
    }
    let (n_exp, n_used, f_exp) = s.experts;
    let moe = arch == "qwen3moe";
    if s.heads == 0 || s.kv_heads == 0 || s.heads % s.kv_heads != 0 || (moe && n_exp == 0) {
        return Err(bad(format!("shape {s:?} does not fit {arch}")));
    }
    let vocab = g
        .get("tokenizer.ggml.tokens")
        .and_then(|v| v.as_array())
        .map(|a| a.len())
        .filter(|&n| n > 0)
        .ok_or_else(|| bad("the header has no tokenizer vocabulary".into()))?;
    let hd = s.hd();
    let key = |k: &str| format!("{arch}.{k}");
    let u = |v: usize| Value::U32(v as u32);
    let mut meta: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::Str(arch.into())),
        // named for its shape, as a reshaped header is; but not "phi3":
        // a name with that in it would make llama.cpp look up Phi-3's own
        // special tokens, which another tokenizer lacks
        (
            "general.name".into(),
            Value::Str(if arch == "phi3" {
                format!("synthetic {}L x {}", s.layers, s.dim)
            } else {
                format!("synthetic {arch} {}L x {}", s.layers, s.dim)
            }),
        ),
        ("general.file_type".into(), Value::U32(mix.file_type())),
        (key("context_length"), u(4096)),
        (key("embedding_length"), u(s.dim)),
        (key("feed_forward_length"), u(s.ffn)),
        (key("block_count"), u(s.layers)),
        (key("attention.head_count"), u(s.heads)),
        (key("attention.head_count_kv"), u(s.kv_heads)),
        (key("attention.key_length"), u(hd)),
        (key("attention.value_length"), u(hd)),
        (key("rope.dimension_count"), u(hd)),
        (
            key("rope.freq_base"),
            Value::F32(if arch == "phi3" || arch == "llama" {
                10000.0
            } else {
                1_000_000.0
            }),
        ),
        (key("attention.layer_norm_rms_epsilon"), Value::F32(1e-6)),
    ];
    if moe {
        meta.push((key("expert_count"), u(n_exp)));
        meta.push((key("expert_used_count"), u(n_used)));
        meta.push((key("expert_feed_forward_length"), u(f_exp)));
    }
    if arch == "phi3" {
        // Phi-4-mini's LongRoPE: short factors up to 4096, an attention factor
        meta.push((key("rope.scaling.type"), Value::Str("longrope".into())));
        meta.push((key("rope.scaling.attn_factor"), Value::F32(1.19)));
        meta.push((key("rope.scaling.original_context_length"), u(4096)));
    }
    if arch == "gemma3" {
        meta.push((key("attention.sliding_window"), u(SYNTH_SWA.0)));
        meta.push((key("attention.sliding_window_pattern"), u(SYNTH_SWA.1)));
    }
    meta.push(("general.quantization_version".into(), Value::U32(2)));
    meta.extend(
        g.metadata
            .iter()
            .filter(|(k, _)| k.starts_with("tokenizer."))
            .cloned(),
    );

    let (d, f, q, kv, v) = (
        s.dim as u64,
        s.ffn as u64,
        (s.heads * hd) as u64,
        (s.kv_heads * hd) as u64,
        vocab as u64,
    );
    let mix_model = MixModel {
        n_layers: s.layers,
        gqa: s.heads / s.kv_heads,
        tied: matches!(arch, "gemma3" | "qwen3"),
    };
    let mut tensors = Vec::new();
    let mut push = |name: String, dims: Vec<u64>, layer: Option<usize>| {
        let dtype = if dims.len() < 2 || name.ends_with("ffn_gate_inp.weight") {
            DType::F32
        } else {
            mix.type_of(&name, layer, mix_model, dims[0])
        };
        tensors.push(super::gguf_write::TensorSpec { name, dims, dtype });
    };
    push("token_embd.weight".into(), vec![d, v], None);
    if arch == "phi3" {
        push(
            "rope_factors_short.weight".into(),
            vec![hd as u64 / 2],
            None,
        );
        push("rope_factors_long.weight".into(), vec![hd as u64 / 2], None);
    }
    push("output_norm.weight".into(), vec![d], None);
    if !matches!(arch, "gemma3" | "qwen3") {
        push("output.weight".into(), vec![d, v], None);
    }
    for l in 0..s.layers {
        let p = |t: &str| format!("blk.{l}.{t}.weight");
        let ly = Some(l);
        push(p("attn_norm"), vec![d], ly);
        if arch == "phi3" {
            push(p("attn_qkv"), vec![d, q + 2 * kv], ly);
        } else {
            push(p("attn_q"), vec![d, q], ly);
            push(p("attn_k"), vec![d, kv], ly);
            push(p("attn_v"), vec![d, kv], ly);
        }
        if matches!(arch, "qwen2") {
            push(format!("blk.{l}.attn_q.bias"), vec![q], ly);
            push(format!("blk.{l}.attn_k.bias"), vec![kv], ly);
            push(format!("blk.{l}.attn_v.bias"), vec![kv], ly);
        }
        if matches!(arch, "qwen3" | "qwen3moe" | "gemma3") {
            push(p("attn_q_norm"), vec![hd as u64], ly);
            push(p("attn_k_norm"), vec![hd as u64], ly);
        }
        push(p("attn_output"), vec![q, d], ly);
        if arch == "gemma3" {
            push(p("post_attention_norm"), vec![d], ly);
        }
        push(p("ffn_norm"), vec![d], ly);
        if moe {
            let (e, fe) = (n_exp as u64, f_exp as u64);
            push(p("ffn_gate_inp"), vec![d, e], ly);
            push(p("ffn_gate_exps"), vec![d, fe, e], ly);
            push(p("ffn_up_exps"), vec![d, fe, e], ly);
            push(p("ffn_down_exps"), vec![fe, d, e], ly);
        } else if arch == "phi3" {
            push(p("ffn_up"), vec![d, 2 * f], ly);
            push(p("ffn_down"), vec![f, d], ly);
        } else {
            push(p("ffn_gate"), vec![d, f], ly);
            push(p("ffn_up"), vec![d, f], ly);
            push(p("ffn_down"), vec![f, d], ly);
        }
        if arch == "gemma3" {
            push(p("post_ffw_norm"), vec![d], ly);
        }
    }
    Ok((meta, tensors))
}
