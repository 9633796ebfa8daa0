//! Learned retention gates (TRIM-KV / DBTrimKV): per layer, a small MLP on
//! the attention block's input (the hidden state after the layer's input
//! RMSNorm) giving log β per KV head, β ∈ (0, 1) the rate at which the new
//! token's retention decays: r_{t,i} = β_i^(t−i).
//!
//! Two architectures (POLICIES.md §2.2):
//! - `rg` (TRIM-KV): z = W2 · silu(W1 x + b1) + b, W1: D → I, W2: I → Hkv,
//!   all per layer.
//! - `rg10` (DBTrimKV): z = W3 · silu(W2 · silu(W1 x + b1) + b2) + b, with
//!   W3: I → Hkv and b one parameter shared by every layer, so every layer's
//!   scores are on one scale and can compete for one global budget.
//!
//! In both, log β = logsigmoid(z) = min(z, 0) − ln(1 + e^−|z|).
//!
//! A gate file is a safetensors file (F32 tensors, `[out, in]` row-major as
//! PyTorch's `Linear`) whose `__metadata__` holds `kvrun.gates`, a JSON
//! object naming the architecture, the model it was trained for and how
//! (data, steps, budget M, final losses). Tensor names: `blk.{l}.fc1.weight`
//! / `.bias`, `blk.{l}.fc2.weight` / `.bias` (`rg10`), and the scoring head
//! `blk.{l}.head.weight` / `.bias` (`rg`) or `head.weight` / `head.bias`
//! (`rg10`, shared).

use crate::backend::cpu::gemv_f16::gemv_f16;
use crate::backend::pool::{Chunks, SharedMut, ThreadPool};
use crate::error::{Error, Result};
use half::f16;
use serde_json::{json, Value as Json};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Largest gate-file header accepted.
const MAX_HEADER: usize = 16 << 20;

/// Which gate MLP.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GateArch {
    /// TRIM-KV: one hidden layer, every parameter per layer.
    Rg,
    /// DBTrimKV: two hidden layers, the scoring head shared by all layers.
    Rg10,
}

impl GateArch {
    /// The name in gate files and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            GateArch::Rg => "rg",
            GateArch::Rg10 => "rg10",
        }
    }

    /// `rg` or `rg10`.
    pub fn parse(s: &str) -> Option<GateArch> {
        match s {
            "rg" | "trimkv" => Some(GateArch::Rg),
            "rg10" | "dbtrimkv" => Some(GateArch::Rg10),
            _ => None,
        }
    }

    /// Hidden layers of the MLP before the scoring head.
    pub fn depth(self) -> usize {
        match self {
            GateArch::Rg => 1,
            GateArch::Rg10 => 2,
        }
    }
}

/// One affine map, y = W x + b, W (n_out, n_in) row-major.
#[derive(Clone, Debug, PartialEq)]
pub struct Dense {
    pub n_in: usize,
    pub n_out: usize,
    /// (n_out, n_in)
    pub w: Vec<f32>,
    /// (n_out,)
    pub b: Vec<f32>,
}

impl Dense {
    /// All-zero weights and biases.
    pub fn zeros(n_in: usize, n_out: usize) -> Dense {
        Dense {
            n_in,
            n_out,
            w: vec![0.0; n_in * n_out],
            b: vec![0.0; n_out],
        }
    }

    /// y (n_out,) = W x + b for one input x (n_in,).
    fn apply(&self, dot: &Dot, x: &[f32], y: &mut [f32]) {
        for (r, (o, &b)) in y.iter_mut().zip(&self.b).enumerate() {
            *o = dot.f32(&self.w[r * self.n_in..(r + 1) * self.n_in], x) + b;
        }
    }
}

/// One affine map of the gates: layer l's k-th hidden layer, or the
/// scoring head layer l uses.
#[derive(Clone, Copy, Debug)]
enum Map {
    Hidden(usize, usize),
    Head(usize),
}

/// f32 dot product through ggml's runtime-dispatched SIMD kernel.
struct Dot(ggml_sys::CpuTraits);

impl Dot {
    fn new() -> Dot {
        // type 0 = F32, always present
        Dot(ggml_sys::CpuTraits::of(0).expect("ggml has an f32 dot product"))
    }
    #[inline]
    fn f32(&self, a: &[f32], b: &[f32]) -> f32 {
        self.0
            .dot(a.len(), bytemuck::cast_slice(a), bytemuck::cast_slice(b))
    }
}

/// SiLU in place.
fn silu(x: &mut [f32]) {
    for v in x {
        *v /= 1.0 + (-*v).exp();
    }
}

/// log σ(z), stable for any z.
#[inline]
pub fn log_sigmoid(z: f32) -> f32 {
    z.min(0.0) - (-z.abs()).exp().ln_1p()
}

/// The retention gates of every layer of one model.
#[derive(Clone, Debug, PartialEq)]
pub struct Gates {
    pub arch: GateArch,
    /// Model width D (the gate input).
    pub dim: usize,
    /// Hidden width I.
    pub inter: usize,
    pub n_layers: usize,
    pub n_kv_heads: usize,
    /// Per layer, the hidden layers (`arch.depth()` of them).
    pub hidden: Vec<Vec<Dense>>,
    /// The scoring heads I → Hkv: one per layer (`rg`) or one shared (`rg10`).
    pub heads: Vec<Dense>,
    /// The `kvrun.gates` metadata (architecture, model, training run).
    pub meta: Json,
}

impl Gates {
    /// Gates of architecture `arch` initialised as the papers do: weights
    /// N(0, 0.02) from a seeded generator, hidden biases 0, head bias
    /// `bias_init` (10: β ≈ 0.99995, "remember everything").
    pub fn init(
        arch: GateArch,
        dim: usize,
        inter: usize,
        n_layers: usize,
        n_kv_heads: usize,
        bias_init: f32,
        seed: u64,
    ) -> Gates {
        let mut rng = crate::sample::Rng::new(seed);
        let mut normal = |d: &mut Dense| {
            for w in d.w.iter_mut() {
                *w = 0.02 * rng.normal();
            }
        };
        let hidden = (0..n_layers)
            .map(|_| {
                (0..arch.depth())
                    .map(|k| {
                        let mut d = Dense::zeros(if k == 0 { dim } else { inter }, inter);
                        normal(&mut d);
                        d
                    })
                    .collect()
            })
            .collect();
        let n_heads = match arch {
            GateArch::Rg => n_layers,
            GateArch::Rg10 => 1,
        };
        let heads = (0..n_heads)
            .map(|_| {
                let mut d = Dense::zeros(inter, n_kv_heads);
                normal(&mut d);
                d.b.fill(bias_init);
                d
            })
            .collect();
        Gates {
            arch,
            dim,
            inter,
            n_layers,
            n_kv_heads,
            hidden,
            heads,
            meta: json!({}),
        }
    }

    /// Layer `l`'s scoring head.
    pub fn head(&self, l: usize) -> &Dense {
        &self.heads[self.head_of(l)]
    }

    /// Which of `heads` layer `l` uses: its own (`rg`) or the shared one
    /// (`rg10`).
    fn head_of(&self, l: usize) -> usize {
        match self.arch {
            GateArch::Rg => l,
            GateArch::Rg10 => 0,
        }
    }

    /// Whether these gates fit a model of `n_layers` layers, width `dim`
    /// and `n_kv_heads` KV heads; the error names what differs.
    pub fn check_model(&self, n_layers: usize, dim: usize, n_kv_heads: usize) -> Result<()> {
        let mut bad = Vec::new();
        for (what, have, want) in [
            ("layers", self.n_layers, n_layers),
            ("width", self.dim, dim),
            ("KV heads", self.n_kv_heads, n_kv_heads),
        ] {
            if have != want {
                bad.push(format!("{what} {have} (model: {want})"));
            }
        }
        if bad.is_empty() {
            Ok(())
        } else {
            let of = self.meta["model"].as_str().unwrap_or("another model");
            Err(Error::Other(format!(
                "retention gates were trained for {of}: {}",
                bad.join(", ")
            )))
        }
    }

    /// Affine map `m` of the gates.
    fn map(&self, m: Map) -> &Dense {
        match m {
            Map::Hidden(l, k) => &self.hidden[l][k],
            Map::Head(l) => self.head(l),
        }
    }

    /// log β (n, n_kv_heads) of layer `l` for `n` inputs `x` (n, dim), in
    /// f32 (the reference of [`GateNet`]).
    pub fn log_beta(&self, l: usize, x: &[f32], n: usize, out: &mut [f32]) {
        let mut scratch = vec![0.0; 2 * self.inter];
        let dot = Dot::new();
        self.forward(l, x, n, out, &mut scratch, &mut |m, x, y| {
            self.map(m).apply(&dot, x, y)
        })
    }

    /// The gate MLP of layer `l` for `n` inputs `x` (n, dim) into `out`
    /// (n, n_kv_heads), each affine map computed by `affine(map, x, y)`;
    /// `scratch` holds 2 · inter floats.
    fn forward(
        &self,
        l: usize,
        x: &[f32],
        n: usize,
        out: &mut [f32],
        scratch: &mut [f32],
        affine: &mut impl FnMut(Map, &[f32], &mut [f32]),
    ) {
        let (d, i, nh) = (self.dim, self.inter, self.n_kv_heads);
        let (a, b) = scratch[..2 * i].split_at_mut(i);
        for t in 0..n {
            // first hidden layer: a = silu(W1 x + b1)                  (I,)
            affine(Map::Hidden(l, 0), &x[t * d..(t + 1) * d], a);
            silu(a);
            // rg10's second: a = silu(W2 a + b2)                        (I,)
            for k in 1..self.arch.depth() {
                affine(Map::Hidden(l, k), a, b);
                silu(b);
                a.copy_from_slice(b);
            }
            // scoring head and log-sigmoid: log β = logσ(W a + b)    (Hkv,)
            let o = &mut out[t * nh..(t + 1) * nh];
            affine(Map::Head(l), a, o);
            for v in o.iter_mut() {
                *v = log_sigmoid(*v);
            }
        }
    }

    /// Every tensor by its file name.
    pub fn tensors(&self) -> Vec<(String, Vec<usize>, &[f32])> {
        let mut t: Vec<(String, Vec<usize>, &[f32])> = Vec::new();
        for (l, hid) in self.hidden.iter().enumerate() {
            for (k, d) in hid.iter().enumerate() {
                let n = format!("blk.{l}.fc{}", k + 1);
                t.push((format!("{n}.weight"), vec![d.n_out, d.n_in], &d.w));
                t.push((format!("{n}.bias"), vec![d.n_out], &d.b));
            }
        }
        for (l, d) in self.heads.iter().enumerate() {
            let n = match self.arch {
                GateArch::Rg => format!("blk.{l}.head"),
                GateArch::Rg10 => "head".to_string(),
            };
            t.push((format!("{n}.weight"), vec![d.n_out, d.n_in], &d.w));
            t.push((format!("{n}.bias"), vec![d.n_out], &d.b));
        }
        t
    }

    /// Every tensor, mutable, in the order of `tensors`.
    pub fn tensors_mut(&mut self) -> Vec<&mut Vec<f32>> {
        let mut t = Vec::new();
        for hid in self.hidden.iter_mut() {
            for d in hid.iter_mut() {
                t.push(&mut d.w);
                t.push(&mut d.b);
            }
        }
        for d in self.heads.iter_mut() {
            t.push(&mut d.w);
            t.push(&mut d.b);
        }
        t
    }

    /// Number of parameters.
    pub fn n_params(&self) -> usize {
        self.tensors().iter().map(|t| t.2.len()).sum()
    }

    /// The metadata written to a file: `meta` plus the shape fields.
    fn full_meta(&self) -> Json {
        let mut m = match &self.meta {
            Json::Object(o) => o.clone(),
            _ => Default::default(),
        };
        m.insert("arch".into(), json!(self.arch.name()));
        m.insert("dim".into(), json!(self.dim));
        m.insert("inter".into(), json!(self.inter));
        m.insert("n_layers".into(), json!(self.n_layers));
        m.insert("n_kv_heads".into(), json!(self.n_kv_heads));
        Json::Object(m)
    }

    /// Write a gate file (safetensors, F32).
    pub fn save(&self, path: &Path) -> Result<()> {
        let io = |e: std::io::Error| Error::Io {
            path: path.to_path_buf(),
            source: e,
        };
        let mut header = serde_json::Map::new();
        let mut meta = serde_json::Map::new();
        meta.insert("kvrun.gates".into(), json!(self.full_meta().to_string()));
        header.insert("__metadata__".into(), Json::Object(meta));
        let mut off = 0usize;
        let tensors = self.tensors();
        for (name, shape, data) in &tensors {
            let end = off + data.len() * 4;
            header.insert(
                name.clone(),
                json!({"dtype": "F32", "shape": shape, "data_offsets": [off, end]}),
            );
            off = end;
        }
        let mut h = Json::Object(header).to_string().into_bytes();
        // pad the header so the data starts 8-byte aligned
        while !h.len().is_multiple_of(8) {
            h.push(b' ');
        }
        let mut bytes = Vec::with_capacity(8 + h.len() + off);
        bytes.extend_from_slice(&(h.len() as u64).to_le_bytes());
        bytes.extend_from_slice(&h);
        for (_, _, data) in &tensors {
            for v in data.iter() {
                bytes.extend_from_slice(&v.to_le_bytes());
            }
        }
        // write then rename, so an interrupted save never leaves a torn file
        let tmp = path.with_extension("safetensors.tmp");
        std::fs::write(&tmp, &bytes).map_err(io)?;
        std::fs::rename(&tmp, path).map_err(io)
    }

    /// Read a gate file; every inconsistency is a one-line error naming it.
    pub fn load(path: &Path) -> Result<Gates> {
        let bytes = std::fs::read(path).map_err(|e| Error::Io {
            path: path.to_path_buf(),
            source: e,
        })?;
        let bad = |what: String| {
            Error::Other(format!("{}: not a kvrun gate file: {what}", path.display()))
        };
        if bytes.len() < 8 {
            return Err(bad("shorter than its header length".into()));
        }
        let hl = u64::from_le_bytes(bytes[..8].try_into().unwrap_or([0; 8]));
        if hl > MAX_HEADER as u64 || 8 + hl as usize > bytes.len() {
            return Err(bad(format!("header length {hl} out of range")));
        }
        let hl = hl as usize;
        let header: Json =
            serde_json::from_slice(&bytes[8..8 + hl]).map_err(|e| bad(format!("header: {e}")))?;
        let data = &bytes[8 + hl..];
        let meta_s = header["__metadata__"]["kvrun.gates"]
            .as_str()
            .ok_or_else(|| bad("no kvrun.gates metadata".into()))?;
        let meta: Json =
            serde_json::from_str(meta_s).map_err(|e| bad(format!("kvrun.gates: {e}")))?;
        let num = |k: &str| {
            meta[k]
                .as_u64()
                .filter(|&v| v > 0 && v < 1 << 24)
                .map(|v| v as usize)
                .ok_or_else(|| bad(format!("metadata field '{k}' missing or out of range")))
        };
        let arch_s = meta["arch"].as_str().unwrap_or("");
        let arch = GateArch::parse(arch_s)
            .ok_or_else(|| bad(format!("unknown gate architecture '{arch_s}'")))?;
        let (dim, inter, n_layers, n_kv) = (
            num("dim")?,
            num("inter")?,
            num("n_layers")?,
            num("n_kv_heads")?,
        );
        let mut g = Gates::init(arch, dim, inter, n_layers, n_kv, 0.0, 0);
        let mut seen = BTreeMap::new();
        let names: Vec<(String, Vec<usize>)> =
            g.tensors().into_iter().map(|(n, s, _)| (n, s)).collect();
        for ((name, shape), dst) in names.iter().zip(g.tensors_mut()) {
            let t = &header[name.as_str()];
            if t.is_null() {
                return Err(bad(format!("tensor {name} missing")));
            }
            if t["dtype"].as_str() != Some("F32") {
                return Err(bad(format!("tensor {name} is not F32")));
            }
            let have = usizes(&t["shape"]);
            if &have != shape {
                return Err(bad(format!(
                    "tensor {name} has shape {have:?}, the metadata implies {shape:?}"
                )));
            }
            let off = usizes(&t["data_offsets"]);
            let n = dst.len();
            if off.len() != 2 || off[1] < off[0] || off[1] - off[0] != n * 4 || off[1] > data.len()
            {
                return Err(bad(format!("tensor {name}: bad data offsets {off:?}")));
            }
            for (v, c) in dst.iter_mut().zip(data[off[0]..off[1]].chunks_exact(4)) {
                *v = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
            if dst.iter().any(|v| !v.is_finite()) {
                return Err(bad(format!("tensor {name} holds a non-finite value")));
            }
            seen.insert(name.clone(), ());
        }
        let mut meta = meta;
        if let Json::Object(o) = &mut meta {
            for k in ["arch", "dim", "inter", "n_layers", "n_kv_heads"] {
                o.remove(k);
            }
        }
        g.meta = meta;
        Ok(g)
    }
}

/// A JSON array of non-negative integers (anything else: empty or shorter).
fn usizes(v: &Json) -> Vec<usize> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|x| x.as_u64())
                .map(|x| x as usize)
                .collect()
        })
        .unwrap_or_default()
}

/// The gates as the decode loop runs them: every weight matrix converted
/// once to f16, each affine map one [`gemv_f16`] (inputs, products, sums,
/// biases, SiLU and the log-sigmoid in f32). A decoded token runs the MLP
/// of every layer once, with weights gone cold since the last token (the
/// model's own weights have streamed through the caches), so its cost is
/// fetching them: the shipped SmolLM2 gates hold 4.4 MB in f32, 2.2 MB in
/// f16, and took 237 µs a token in f32 (ggml's dot, row by row) against
/// 152 µs here (2 threads, the two alternating in one process).
/// [`Gates::log_beta`] is the f32 reference; the difference is the f16
/// rounding of the weights (a relative 2⁻¹¹ each; KL on WikiText-2 at
/// B = 128 / 256 moved from 0.4038 / 0.1100 to 0.4051 / 0.1091).
pub struct GateNet {
    pub gates: Arc<Gates>,
    /// Per layer, the f16 rows of each hidden layer.
    hidden: Vec<Vec<Vec<f16>>>,
    /// The f16 rows of each scoring head.
    heads: Vec<Vec<f16>>,
}

impl std::fmt::Debug for GateNet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GateNet")
            .field("arch", &self.gates.arch)
            .field("weights", &"f16")
            .finish()
    }
}

impl GateNet {
    /// `gates` with f16 weights.
    pub fn new(gates: Arc<Gates>) -> GateNet {
        let half = |d: &Dense| d.w.iter().map(|&v| f16::from_f32(v)).collect::<Vec<_>>();
        let hidden = gates
            .hidden
            .iter()
            .map(|hid| hid.iter().map(half).collect())
            .collect();
        let heads = gates.heads.iter().map(half).collect();
        GateNet {
            gates,
            hidden,
            heads,
        }
    }

    /// The f16 rows of affine map `m`.
    fn rows(&self, m: Map) -> &[f16] {
        match m {
            Map::Hidden(l, k) => &self.hidden[l][k],
            Map::Head(l) => &self.heads[self.gates.head_of(l)],
        }
    }

    /// log β (n, n_kv_heads) of layer `l` for `n` inputs `x` (n, dim);
    /// `scratch` has 2 · inter floats.
    pub fn log_beta(&self, l: usize, x: &[f32], n: usize, out: &mut [f32], scratch: &mut [f32]) {
        let g = &*self.gates;
        g.forward(l, x, n, out, scratch, &mut |m, x, y| {
            let d = g.map(m);
            gemv_f16(self.rows(m), d.n_in, x, &d.b, y)
        })
    }

    /// log β of every layer for one step: `input(l)` gives layer l's
    /// inputs (n, dim); `out` receives (n_layers, n, n_kv_heads). Layers
    /// go to whichever pool thread asks next; `scratch` (grown once to
    /// 2 · inter per thread) is the caller's, so a decode step allocates
    /// nothing.
    pub fn log_beta_all<'a>(
        &self,
        pool: &ThreadPool,
        input: impl Fn(usize) -> &'a [f32] + Sync,
        n: usize,
        out: &mut [f32],
        scratch: &mut Vec<f32>,
    ) {
        let g = &*self.gates;
        let per = n * g.n_kv_heads;
        let nt = pool.n_threads();
        let nl = g.n_layers;
        let w = 2 * g.inter;
        if scratch.len() < nt * w {
            scratch.resize(nt * w, 0.0);
        }
        let o = SharedMut::new(&mut out[..nl * per]);
        let sc = SharedMut::new(&mut scratch[..nt * w]);
        let layers = Chunks::new(nl);
        let run = |ti: usize| {
            // SAFETY: thread ti's scratch is its own.
            let mine = unsafe { sc.slice(ti * w, w) };
            while let Some(l) = layers.next() {
                // SAFETY: layer l is handed to one thread only.
                let dst = unsafe { o.slice(l * per, per) };
                self.log_beta(l, input(l), n, dst, mine);
            }
        };
        if nl > 1 && nt > 1 {
            pool.run(run);
        } else {
            run(0);
        }
    }
}

/// Where a model's gates live by default: `<model stem>.gates.safetensors`
/// next to the model file (or inside a model directory).
pub fn gates_path_for(model: &Path) -> PathBuf {
    if model.is_dir() {
        return model.join("gates.safetensors");
    }
    let stem = model
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    model.with_file_name(format!("{stem}.gates.safetensors"))
}
