//! Hugging Face model directories: `config.json`, `tokenizer.json`,
//! `tokenizer_config.json` and one or more `*.safetensors` files (the
//! tokenizer itself is read by [`crate::load::hf_tokenizer`]).
//!
//! A safetensors file is an 8-byte little-endian header length, a JSON header
//! (`{"name": {"dtype", "shape", "data_offsets": [start, end]}, ...}`, with an
//! optional `__metadata__` entry) and the raw tensor bytes; offsets are
//! relative to the end of the header. Every file is memory-mapped and every
//! tensor is bounds-checked when the directory is opened, so a truncated or
//! corrupt file fails once, up front, with a message naming the file.
//!
//! Tensors in F32, F16 and BF16 are handed to [`Weights::load`] without a
//! copy. HF names are mapped to the GGUF names kvrun's loader asks for, and
//! shapes flip order (HF `[out, in]` row-major is byte-identical to ggml's
//! `[n_in, n_out]`).
//!
//! RoPE: llama.cpp's converter permutes the Q/K rows of llama models so that
//! GGUF llama uses ggml's "normal" (adjacent pairs) rotation. HF checkpoints
//! are not permuted; their rotation pairs dimension `i` with `i + d/2`, which
//! is the NeoX style. So HF llama (and qwen2, NeoX in both) load with
//! [`RopeStyle::Neox`].

use crate::backend::RopeStyle;
use crate::chat::ChatTemplate;
use crate::error::{Error, Result};
use crate::format::mmap::Mapped;
use crate::load::hf_tokenizer;
use crate::load::json::{bad, read_json};
use crate::model::{Arch, Config, TensorSource, Weights};
use crate::tensor::DType;
use crate::tokenizer::Tokenizer;
use serde_json::Value as Json;
use std::borrow::Cow;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Largest JSON header accepted (the format's reference reader uses 100 MB).
const MAX_HEADER: u64 = 100 << 20;

/// Where one tensor lives.
#[derive(Clone, Debug)]
struct Entry {
    file: usize,
    /// None for a dtype kvrun cannot compute with (kept for the error message).
    dtype: Option<DType>,
    dtype_name: String,
    /// HF order (outermost first).
    shape: Vec<u64>,
    /// Absolute byte range in the file.
    start: usize,
    end: usize,
}

/// An opened Hugging Face model directory; [`Weights`] borrow its maps.
#[derive(Debug)]
pub struct HfCheckpoint {
    pub dir: PathBuf,
    /// Parsed `config.json`.
    pub config_json: Json,
    files: Vec<PathBuf>,
    maps: Vec<Mapped>,
    index: HashMap<String, Entry>,
}

fn dtype_of(name: &str) -> Option<DType> {
    match name {
        "F32" => Some(DType::F32),
        "F16" => Some(DType::F16),
        "BF16" => Some(DType::BF16),
        _ => None,
    }
}

fn elem_size(name: &str) -> Option<u64> {
    Some(match name {
        "F64" | "I64" | "U64" => 8,
        "F32" | "I32" | "U32" => 4,
        "F16" | "BF16" | "I16" | "U16" => 2,
        "I8" | "U8" | "BOOL" | "F8_E4M3" | "F8_E5M2" => 1,
        _ => return None,
    })
}

/// Parse one safetensors header; entries get absolute, bounds-checked ranges.
fn parse_file(
    path: &Path,
    bytes: &[u8],
    file: usize,
    index: &mut HashMap<String, Entry>,
) -> Result<()> {
    let len = bytes.len() as u64;
    if len < 8 {
        return Err(bad(
            path,
            format!("not a safetensors file: {len} bytes, need at least 8 for the header length"),
        ));
    }
    let hlen = u64::from_le_bytes(bytes[..8].try_into().unwrap_or([0; 8]));
    if hlen > MAX_HEADER || hlen > len - 8 {
        return Err(bad(
            path,
            format!("safetensors header length {hlen} does not fit the {len}-byte file (truncated or not safetensors)"),
        ));
    }
    let base = 8 + hlen;
    let header: Json = serde_json::from_slice(&bytes[8..base as usize])
        .map_err(|e| bad(path, format!("safetensors header is not valid JSON: {e}")))?;
    let obj = header
        .as_object()
        .ok_or_else(|| bad(path, "safetensors header is not a JSON object"))?;
    for (name, v) in obj {
        if name == "__metadata__" {
            continue;
        }
        let terr = |what: String| bad(path, format!("tensor '{name}': {what}"));
        let dtype_name = v
            .get("dtype")
            .and_then(Json::as_str)
            .ok_or_else(|| terr("missing or non-string 'dtype'".into()))?
            .to_owned();
        let shape: Vec<u64> = v
            .get("shape")
            .and_then(Json::as_array)
            .and_then(|a| a.iter().map(Json::as_u64).collect::<Option<Vec<u64>>>())
            .ok_or_else(|| terr("missing or invalid 'shape'".into()))?;
        let offs: Vec<u64> = v
            .get("data_offsets")
            .and_then(Json::as_array)
            .and_then(|a| a.iter().map(Json::as_u64).collect::<Option<Vec<u64>>>())
            .filter(|o| o.len() == 2)
            .ok_or_else(|| terr("missing or invalid 'data_offsets'".into()))?;
        let (s, e) = (offs[0], offs[1]);
        if s > e {
            return Err(terr(format!("data_offsets [{s}, {e}] are reversed")));
        }
        let es =
            elem_size(&dtype_name).ok_or_else(|| terr(format!("unknown dtype '{dtype_name}'")))?;
        let want = shape
            .iter()
            .try_fold(es, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| terr(format!("shape {shape:?} overflows")))?;
        if e - s != want {
            return Err(terr(format!(
                "data_offsets [{s}, {e}] hold {} bytes but {dtype_name} {shape:?} needs {want}",
                e - s
            )));
        }
        let (start, end) = (base.saturating_add(s), base.saturating_add(e));
        if end > len {
            return Err(terr(format!(
                "needs bytes {start}..{end} but the file has {len} bytes (truncated file?)"
            )));
        }
        let entry = Entry {
            file,
            dtype: dtype_of(&dtype_name),
            dtype_name,
            shape,
            start: start as usize,
            end: end as usize,
        };
        if index.insert(name.clone(), entry).is_some() {
            return Err(terr("appears in more than one safetensors file".into()));
        }
    }
    Ok(())
}

/// The HF name of a GGUF tensor name kvrun's loader asks for.
pub fn hf_name(gguf: &str) -> Option<String> {
    Some(match gguf {
        "token_embd.weight" => "model.embed_tokens.weight".into(),
        "output_norm.weight" => "model.norm.weight".into(),
        "output.weight" => "lm_head.weight".into(),
        _ => {
            let rest = gguf.strip_prefix("blk.")?;
            let (layer, rest) = rest.split_once('.')?;
            let layer: usize = layer.parse().ok()?;
            let (base, suffix) = rest.rsplit_once('.')?;
            let hf = match base {
                "attn_norm" => "input_layernorm",
                "attn_q" => "self_attn.q_proj",
                "attn_k" => "self_attn.k_proj",
                "attn_v" => "self_attn.v_proj",
                "attn_output" => "self_attn.o_proj",
                "ffn_norm" => "post_attention_layernorm",
                "ffn_gate" => "mlp.gate_proj",
                "ffn_up" => "mlp.up_proj",
                "ffn_down" => "mlp.down_proj",
                _ => return None,
            };
            format!("model.layers.{layer}.{hf}.{suffix}")
        }
    })
}

fn get_u(cfg: &Json, key: &str) -> Option<usize> {
    cfg.get(key).and_then(Json::as_u64).map(|v| v as usize)
}

fn get_f(cfg: &Json, key: &str) -> Option<f64> {
    cfg.get(key).and_then(Json::as_f64)
}

impl HfCheckpoint {
    /// Open a model directory: read `config.json`, map and index every
    /// safetensors file (from `model.safetensors.index.json` when present,
    /// else every `*.safetensors` in the directory).
    pub fn open(dir: &Path) -> Result<HfCheckpoint> {
        if !dir.is_dir() {
            return Err(bad(
                dir,
                "not a directory (expected a Hugging Face model directory)",
            ));
        }
        let config_json = read_json(&dir.join("config.json"))?;
        let idx_path = dir.join("model.safetensors.index.json");
        let mut files: Vec<PathBuf> = Vec::new();
        if idx_path.exists() {
            let idx = read_json(&idx_path)?;
            let map = idx
                .get("weight_map")
                .and_then(Json::as_object)
                .ok_or_else(|| bad(&idx_path, "missing 'weight_map' object"))?;
            for v in map.values() {
                let f = v
                    .as_str()
                    .ok_or_else(|| bad(&idx_path, "weight_map values must be file names"))?;
                let p = dir.join(f);
                if !files.contains(&p) {
                    files.push(p);
                }
            }
            files.sort();
        } else {
            let rd = std::fs::read_dir(dir).map_err(|source| Error::Io {
                path: dir.to_owned(),
                source,
            })?;
            for e in rd {
                let e = e.map_err(|source| Error::Io {
                    path: dir.to_owned(),
                    source,
                })?;
                let p = e.path();
                if p.extension().is_some_and(|x| x == "safetensors") {
                    files.push(p);
                }
            }
            files.sort();
        }
        if files.is_empty() {
            return Err(bad(dir, "no *.safetensors files in the directory"));
        }
        let mut maps = Vec::with_capacity(files.len());
        let mut index = HashMap::new();
        for (i, f) in files.iter().enumerate() {
            let m = Mapped::open(f)?;
            parse_file(f, m.bytes(), i, &mut index)?;
            maps.push(m);
        }
        Ok(HfCheckpoint {
            dir: dir.to_owned(),
            config_json,
            files,
            maps,
            index,
        })
    }

    /// Bytes of all the directory's safetensors files.
    pub fn n_bytes(&self) -> u64 {
        self.maps.iter().map(|m| m.bytes().len() as u64).sum()
    }

    /// Names of all tensors (HF names).
    pub fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.index.keys().map(String::as_str)
    }

    fn cfg_path(&self) -> PathBuf {
        self.dir.join("config.json")
    }

    /// Hyperparameters from `config.json` (vocab size from the embedding).
    pub fn config(&self) -> Result<Config> {
        let c = &self.config_json;
        let path = self.cfg_path();
        let key_err = |key: &str, what: &str| bad(&path, format!("'{key}': {what}"));
        let model_type = c.get("model_type").and_then(Json::as_str).unwrap_or("");
        let arch = match model_type {
            "llama" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            other => {
                return Err(Error::UnknownArchitecture {
                    path,
                    arch: if other.is_empty() {
                        "<missing model_type>".into()
                    } else {
                        other.to_owned()
                    },
                })
            }
        };
        let req = |key: &str| {
            get_u(c, key).ok_or_else(|| key_err(key, "missing or not a non-negative integer"))
        };
        let dim = req("hidden_size")?;
        let ffn_dim = req("intermediate_size")?;
        let n_layers = req("num_hidden_layers")?;
        let n_heads = req("num_attention_heads")?;
        let n_kv_heads = get_u(c, "num_key_value_heads").unwrap_or(n_heads);
        if n_layers == 0
            || dim == 0
            || ffn_dim == 0
            || n_heads == 0
            || n_kv_heads == 0
            || n_heads % n_kv_heads != 0
        {
            return Err(key_err(
                "num_attention_heads",
                &format!("inconsistent shape: layers {n_layers}, dim {dim}, heads {n_heads}/{n_kv_heads}"),
            ));
        }
        let head_dim = match c.get("head_dim") {
            Some(Json::Null) | None => dim / n_heads,
            Some(v) => {
                v.as_u64()
                    .ok_or_else(|| key_err("head_dim", "not an integer"))? as usize
            }
        };
        if head_dim == 0 || head_dim > 256 || head_dim % 2 != 0 {
            return Err(key_err(
                "head_dim",
                &format!("head_dim {head_dim} unsupported"),
            ));
        }
        let rope_base = get_f(c, "rope_theta").unwrap_or(10000.0) as f32;
        let mut rope_pos_scale = 1.0f32;
        if let Some(rs) = c.get("rope_scaling").filter(|v| !v.is_null()) {
            let ty = rs
                .get("rope_type")
                .or_else(|| rs.get("type"))
                .and_then(Json::as_str)
                .unwrap_or("");
            let factor = get_f(rs, "factor").unwrap_or(1.0);
            match ty {
                "linear" => {
                    if factor > 0.0 {
                        rope_pos_scale = (1.0 / factor) as f32;
                    }
                }
                // Frequency factors come through the synthetic `rope_freqs.weight`.
                "llama3" | "default" | "" => {}
                other => {
                    return Err(key_err(
                        "rope_scaling",
                        &format!("RoPE scaling '{other}' is not supported"),
                    ))
                }
            }
        }
        let embd =
            self.index
                .get("model.embed_tokens.weight")
                .ok_or_else(|| Error::MissingTensor {
                    path: self.dir.clone(),
                    tensor: "model.embed_tokens.weight".into(),
                })?;
        let vocab = match embd.shape.as_slice() {
            [v, d] if *d as usize == dim => *v as usize,
            s => {
                return Err(Error::ShapeMismatch {
                    path: self.files[embd.file].clone(),
                    tensor: "model.embed_tokens.weight".into(),
                    got: s.to_vec(),
                    want: vec![get_u(c, "vocab_size").unwrap_or(0) as u64, dim as u64],
                })
            }
        };
        let tie = c
            .get("tie_word_embeddings")
            .and_then(Json::as_bool)
            .unwrap_or(false);
        Ok(Config {
            arch,
            n_layers,
            dim,
            ffn_dim,
            n_heads,
            n_kv_heads,
            head_dim,
            vocab,
            n_ctx_train: get_u(c, "max_position_embeddings").unwrap_or(2048),
            norm_eps: get_f(c, "rms_norm_eps").unwrap_or(1e-6) as f32,
            rope_base,
            n_rot: head_dim,
            // HF Q/K rows are not permuted: rotate halves (see module docs).
            rope_style: RopeStyle::Neox,
            rope_pos_scale,
            tied_output: tie || !self.index.contains_key("lm_head.weight"),
            features: crate::model::Features::plain(head_dim),
        })
    }

    /// Llama-3 style per-pair RoPE frequency divisors (as llama.cpp's converter
    /// writes into `rope_freqs.weight`), when `rope_scaling.rope_type` is `llama3`.
    fn llama3_freq_factors(&self) -> Option<Vec<f32>> {
        let c = &self.config_json;
        let rs = c.get("rope_scaling").filter(|v| !v.is_null())?;
        let ty = rs
            .get("rope_type")
            .or_else(|| rs.get("type"))
            .and_then(Json::as_str)?;
        if ty != "llama3" {
            return None;
        }
        let dim = get_u(c, "hidden_size")?;
        let heads = get_u(c, "num_attention_heads")?.max(1);
        let hd = match c.get("head_dim").and_then(Json::as_u64) {
            Some(h) => h as usize,
            None => dim / heads,
        };
        let base = get_f(c, "rope_theta").unwrap_or(10000.0);
        let factor = get_f(rs, "factor").unwrap_or(8.0);
        let low = get_f(rs, "low_freq_factor").unwrap_or(1.0);
        let high = get_f(rs, "high_freq_factor").unwrap_or(4.0);
        let old = get_f(rs, "original_max_position_embeddings").unwrap_or(8192.0);
        let (low_wl, high_wl) = (old / low, old / high);
        Some(
            (0..hd / 2)
                .map(|i| {
                    let freq = 1.0 / base.powf((2 * i) as f64 / hd as f64);
                    let wl = 2.0 * std::f64::consts::PI / freq;
                    let f = if wl < high_wl {
                        1.0
                    } else if wl > low_wl {
                        factor
                    } else {
                        let smooth = (old / wl - low) / (high - low);
                        1.0 / ((1.0 - smooth) / factor + smooth)
                    };
                    f as f32
                })
                .collect(),
        )
    }

    /// The tensor source kvrun's loader reads (GGUF names, ggml shapes).
    pub fn source(&self) -> HfSource<'_> {
        HfSource {
            ck: self,
            rope_freqs: self.llama3_freq_factors(),
        }
    }

    /// Load the weights (zero-copy for F32/F16/BF16).
    pub fn weights(&self) -> Result<Weights<'_>> {
        self.weights_with(self.config()?)
    }

    /// Load the weights through `loader`.
    pub fn weights_on(&self, loader: &crate::backend::HostLoader) -> Result<Weights<'_>> {
        Weights::load_on(loader, self.config()?, &self.source())
    }

    /// Load the weights with an adjusted config (e.g. another RoPE style).
    pub fn weights_with(&self, cfg: Config) -> Result<Weights<'_>> {
        Weights::load(cfg, &self.source())
    }

    /// `tokenizer_config.json`, if the directory has one.
    pub fn tokenizer_config(&self) -> Result<Option<Json>> {
        let p = self.dir.join("tokenizer_config.json");
        if p.exists() {
            read_json(&p).map(Some)
        } else {
            Ok(None)
        }
    }

    /// The tokenizer from `tokenizer.json` (+ `tokenizer_config.json`).
    pub fn tokenizer(&self) -> Result<Tokenizer> {
        hf_tokenizer::from_dir(&self.dir)
    }

    /// The chat template from `tokenizer_config.json` (None when absent).
    pub fn chat_template(&self) -> Result<Option<ChatTemplate>> {
        let Some(tc) = self.tokenizer_config()? else {
            return Ok(None);
        };
        let src = match tc.get("chat_template") {
            Some(Json::String(s)) => s.clone(),
            // A list of named templates: take "default" (else the first).
            Some(Json::Array(list)) => {
                let pick = list
                    .iter()
                    .find(|t| t.get("name").and_then(Json::as_str) == Some("default"))
                    .or_else(|| list.first());
                match pick.and_then(|t| t.get("template")).and_then(Json::as_str) {
                    Some(s) => s.to_owned(),
                    None => return Ok(None),
                }
            }
            _ => return Ok(None),
        };
        let tok_text = |key: &str| -> String {
            match tc.get(key) {
                Some(Json::String(s)) => s.clone(),
                Some(v) => v
                    .get("content")
                    .and_then(Json::as_str)
                    .unwrap_or("")
                    .to_owned(),
                None => String::new(),
            }
        };
        ChatTemplate::from_source(&src, &tok_text("bos_token"), &tok_text("eos_token")).map(Some)
    }
}

/// [`TensorSource`] over an [`HfCheckpoint`]: GGUF names in, HF tensors out.
#[derive(Debug)]
pub struct HfSource<'a> {
    ck: &'a HfCheckpoint,
    rope_freqs: Option<Vec<f32>>,
}

impl<'a> TensorSource<'a> for HfSource<'a> {
    fn has(&self, name: &str) -> bool {
        if name == "rope_freqs.weight" {
            return self.rope_freqs.is_some();
        }
        hf_name(name).is_some_and(|n| self.ck.index.contains_key(&n))
    }

    fn tensor(&self, name: &str, shape: &[u64]) -> Result<(DType, Cow<'a, [u8]>)> {
        if name == "rope_freqs.weight" {
            if let Some(f) = &self.rope_freqs {
                if shape != [f.len() as u64] {
                    return Err(Error::ShapeMismatch {
                        path: self.ck.cfg_path(),
                        tensor: name.to_owned(),
                        got: vec![f.len() as u64],
                        want: shape.to_vec(),
                    });
                }
                return Ok((DType::F32, Cow::Owned(bytemuck::cast_slice(f).to_vec())));
            }
        }
        let missing = || Error::MissingTensor {
            path: self.ck.dir.clone(),
            tensor: name.to_owned(),
        };
        let hf = hf_name(name).ok_or_else(missing)?;
        let e = self.ck.index.get(&hf).ok_or_else(|| Error::MissingTensor {
            path: self.ck.dir.clone(),
            tensor: hf.clone(),
        })?;
        let path = &self.ck.files[e.file];
        let got: Vec<u64> = e.shape.iter().rev().copied().collect();
        if got != shape {
            return Err(Error::ShapeMismatch {
                path: path.clone(),
                tensor: hf,
                got,
                want: shape.to_vec(),
            });
        }
        let dtype = e.dtype.ok_or_else(|| Error::UnsupportedTensorType {
            path: path.clone(),
            tensor: hf.clone(),
            ty: e.dtype_name.clone(),
        })?;
        let bytes: &'a [u8] = &self.ck.maps[e.file].bytes()[e.start..e.end];
        // ggml's CPU kernels expect element-aligned data; safetensors writers
        // pad the header to 8 bytes, but copy if a file does not.
        let align = match dtype {
            DType::F32 => 4,
            _ => 2,
        };
        if !(bytes.as_ptr() as usize).is_multiple_of(align) {
            return Ok((dtype, Cow::Owned(bytes.to_vec())));
        }
        Ok((dtype, Cow::Borrowed(bytes)))
    }
}
