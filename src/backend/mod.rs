//! Compute backends: *how* the forward pass is computed.
//!
//! The model code (`crate::model`) says *what* is computed, step by step,
//! and calls the operations of the [`Backend`] trait on buffers it does not
//! look inside: embed, RMSNorm, quantized matmul, bias, RoPE, K/V write,
//! attention (with the optional probability export), SwiGLU, residual adds,
//! and an explicit read-back to the host. Weights are backend tensors
//! (`Backend::Mat`, `Backend::Vector`), activations `Backend::Act`, K/V rows
//! a backend-owned [`KvStore`] that the cache's metadata (`crate::kv`)
//! addresses through [`KvAccess`].
//!
//! - [`cpu`]: the CPU backend (thread pool, quantized GEMM for x86, decode
//!   and prefill attention kernels, the scalar reference kernels).
//! - [`cuda`]: the NVIDIA backend (feature `cuda`): kvrun's own kernels
//!   (kernels/*.cu) through the driver API; without the feature, a stub
//!   that can never be constructed.
//!
//! Nothing here imports the model, the policies or the cache: those layers
//! sit above and depend on this one.

pub mod cpu;
pub mod cuda;
pub mod kvstore;
pub mod rope;

pub use cpu::pool;
pub use kvstore::{HeadView, KvAccess, KvStore, KvType};
pub use rope::{Rope, RopeStyle};

use crate::error::{Error, Result};
use crate::tensor::DType;
use std::borrow::Cow;

/// The backend that runs on the host: weights loaded without naming a
/// device land here.
pub type Host = cpu::Cpu;
/// Loads weights for the host backend without starting it.
pub type HostLoader = cpu::Loader;
/// The host loader: matrices it does not repack are read in place from
/// the file's map (see [`cpu::WeightPages`]).
pub const HOST_LOADER: HostLoader = cpu::Loader {
    pages: cpu::WeightPages::Mapped,
    repack: cpu::Repack::ALL,
};

/// Most query heads sharing one KV head that the attention kernels handle.
pub const MAX_GROUP: usize = 16;

/// Which attention probabilities a forward step exports (for scorers that
/// rank by received attention).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Default)]
pub enum MassMode {
    /// Nothing (no cost).
    #[default]
    None,
    /// The last query row of the step.
    LastRow,
    /// The sum over every query row of the step.
    AllRows,
}

/// The attention problem of one forward step (shared by every layer).
#[derive(Clone, Copy, Debug)]
pub struct AttnStep {
    /// Tokens in the step (1 = decoding).
    pub n: usize,
    /// Absolute position of the step's first token.
    pub pos0: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Keys meet queries at in-cache positions (StreamingLLM pos-shift)
    /// instead of absolute ones.
    pub cache_positions: bool,
    /// Probabilities to export into the per-slot mass (None = no cost).
    pub mass: MassMode,
    /// Weight of one (layer, head) row in the exported mass.
    pub mass_w: f32,
    /// Softmax scale of the scores (usually 1/√head_dim).
    pub scale: f32,
    /// Sliding window: a query at position p sees keys at positions
    /// p − window < pos ≤ p only (0 = no window).
    pub window: usize,
    /// Prompt tokens: run the batch (prefill) kernel even for a single
    /// token, so a prompt's K/V and logits never depend on how it was cut
    /// into chunks (a 1-token remainder, or the last token re-fed after a
    /// prompt-cache hit, matches a whole prefill bit for bit).
    pub prompt: bool,
}

/// Where a compute backend runs (`--device`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Device {
    #[default]
    Cpu,
    /// NVIDIA GPU by ordinal.
    Cuda(usize),
}

impl Device {
    /// Parse `cpu`, `cuda` or `cuda:N`.
    pub fn parse(s: &str) -> Result<Device> {
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            _ => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => Ok(Device::Cuda(n)),
                _ => Err(Error::arg(
                    "--device",
                    format!("unknown device '{s}' (known: cpu, cuda, cuda:N)"),
                )),
            },
        }
    }

    /// Check that this build and machine can run on the device (the CPU
    /// always can; CUDA needs the `cuda` feature and a driver).
    pub fn check(self) -> Result<()> {
        match self {
            Device::Cpu => Ok(()),
            Device::Cuda(n) => cuda::Cuda::new(n, 1).map(|_| ()),
        }
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// The operations the model code needs, on buffers the backend owns.
///
/// Row counts: activations hold up to `n_batch` rows; each op names the
/// rows it touches (`n`) and takes widths from its weights or arguments.
/// Every op must give the same result for any thread count.
pub trait Backend: std::fmt::Debug + Send + Sync + Sized + 'static {
    /// A weight matrix (n_out rows of n_in weights) as this backend holds it.
    type Mat<'w>: std::fmt::Debug + Send + Sync;
    /// A weight vector (norm scales, biases).
    type Vector: std::fmt::Debug + Send + Sync;
    /// An f32 activation buffer.
    type Act: std::fmt::Debug + Send;
    /// Per-sequence scratch of the matmul and attention ops.
    type Scratch: std::fmt::Debug + Send;

    /// Short name (`cpu`, `cuda:0`).
    fn name(&self) -> String;
    /// Worker threads (CPU) or 1.
    fn n_threads(&self) -> usize;
    /// Host threads for the work around the forward pass (scorers ranking
    /// cache entries run on the host whatever device computes the model).
    fn host_pool(&self) -> &cpu::pool::ThreadPool;
    /// The first failure of an operation since the backend was made (a
    /// device backend's launches and copies cannot return errors through
    /// the ops below; the forward pass asks here once per step). The CPU
    /// cannot fail this way.
    fn check(&self) -> Result<()> {
        Ok(())
    }

    // ---- weights and buffers
    /// Take a matrix of `dtype` rows (raw GGUF blocks, usually mapped).
    fn matrix<'w>(
        &self,
        dtype: DType,
        n_in: usize,
        n_out: usize,
        bytes: Cow<'w, [u8]>,
    ) -> Result<Self::Mat<'w>>;
    /// Take a matrix that is only read by rows (`embed`, `mat_row`), never
    /// multiplied: the embedding table of a model with its own output
    /// matrix. A backend that rearranges its matrices for the products
    /// keeps this one as it is.
    fn table<'w>(
        &self,
        dtype: DType,
        n_in: usize,
        n_out: usize,
        bytes: Cow<'w, [u8]>,
    ) -> Result<Self::Mat<'w>> {
        self.matrix(dtype, n_in, n_out, bytes)
    }
    /// Take a vector of weights.
    fn vector(&self, v: Vec<f32>) -> Result<Self::Vector>;
    /// A zeroed activation buffer of `len` floats.
    fn act(&self, len: usize) -> Self::Act;
    /// Fresh scratch.
    fn scratch(&self) -> Self::Scratch;
    /// A K/V store of `n_rows` rows of `row_vals` values each, in `ty`.
    fn kv_store(&self, ty: KvType, n_rows: usize, row_vals: usize) -> Result<Box<dyn KvStore>>;
    /// Append floats `r` of `a` to a host vector (the explicit read-back).
    fn read(&self, a: &Self::Act, r: std::ops::Range<usize>, out: &mut Vec<f32>);
    /// Floats `r` of `a` on the host: borrowed where the buffer already is
    /// host memory, else read back.
    fn host<'a>(&self, a: &'a Self::Act, r: std::ops::Range<usize>) -> Cow<'a, [f32]>;
    /// Row `r` of a matrix as f32 on the host (n_in floats).
    fn mat_row(&self, m: &Self::Mat<'_>, r: usize, out: &mut [f32]);
    /// Shape (n_out, n_in) of a matrix.
    fn mat_shape(&self, m: &Self::Mat<'_>) -> (usize, usize);
    /// A matrix's rows as the file stores them (n_out rows in its type's
    /// block layout) into `out`, and that type; `None` where the backend
    /// does not hand them out (then `mat_row` is the way to read it).
    fn mat_bytes(&self, m: &Self::Mat<'_>, out: &mut Vec<u8>) -> Option<DType> {
        let _ = (m, out);
        None
    }

    // ---- the forward pass
    /// x[i] = table[tokens[i]]                                  (n, dim)
    fn embed(&self, table: &Self::Mat<'_>, tokens: &[u32], x: &mut Self::Act);
    /// out[i] = x[first + i] / rms(x[first + i]) · w for i < n.
    fn rmsnorm(
        &self,
        x: &Self::Act,
        first: usize,
        w: &Self::Vector,
        eps: f32,
        n: usize,
        out: &mut Self::Act,
    );
    /// outs[m] (n, n_out_m) = x (n, n_in) @ ws[m]ᵀ for matrices sharing the
    /// input (converted once where their formats agree).
    fn matmul(
        &self,
        sc: &mut Self::Scratch,
        ws: &[&Self::Mat<'_>],
        x: &Self::Act,
        n: usize,
        outs: &mut [&mut Self::Act],
    );
    /// out (n, n_out) = x (n, n_in) @ wᵀ, written to host memory (the
    /// classifier: its logits are read back anyway).
    fn matmul_host(
        &self,
        sc: &mut Self::Scratch,
        w: &Self::Mat<'_>,
        x: &Self::Act,
        n: usize,
        out: &mut [f32],
    );
    /// x[i] += b for the first `n` rows (row width b's length).
    fn add_bias(&self, x: &mut Self::Act, b: &Self::Vector, n: usize);
    /// dst[..len] = src[..len].
    fn copy(&self, dst: &mut Self::Act, src: &Self::Act, len: usize);
    /// Rotate the `n` rows of q (n_heads heads) and k (n_kv_heads heads)
    /// at positions pos0.. .
    fn rope(&self, rope: &Rope, q: &mut Self::Act, k: &mut Self::Act, st: &AttnStep);
    /// Store the step's K and V rows (n, kv_dim) of `layer` in the slots the
    /// cache assigned (`slots`, as `KvAccess::write_token` reads them).
    fn kv_write(
        &self,
        kv: &mut dyn KvAccess,
        layer: usize,
        slots: &[u32],
        k: &Self::Act,
        v: &Self::Act,
        n: usize,
        kv_dim: usize,
    );
    /// Before the first layer of a step: size the scratch for the cache's
    /// live entries and clear the exported mass.
    fn begin_attention(&self, sc: &mut Self::Scratch, kv: &dyn KvAccess, st: &AttnStep);
    /// Causal multi-head attention of the step's queries over `layer`'s
    /// live entries: out[i, h] = softmax(q[i,h]·K[j]·scale, pos_j ≤ pos_i) V[j],
    /// exporting probabilities into the scratch's mass as `st.mass` says.
    /// `q_raw` holds the queries before RoPE (used for in-cache positions).
    fn attention(
        &self,
        sc: &mut Self::Scratch,
        kv: &dyn KvAccess,
        st: &AttnStep,
        layer: usize,
        rope: &Rope,
        q: &Self::Act,
        q_raw: &Self::Act,
        out: &mut Self::Act,
    );
    /// After the last layer: the exported mass, (n_slots,), into `mass`.
    fn end_attention(&self, sc: &mut Self::Scratch, n_slots: usize, mass: &mut [f32]);
    /// x += b; b = rmsnorm(x) · w, for the first `n` rows (the residual
    /// add, then the next block's norm).
    fn add_rmsnorm(
        &self,
        x: &mut Self::Act,
        b: &mut Self::Act,
        w: &Self::Vector,
        eps: f32,
        n: usize,
    );
    /// gate = silu(gate) · up for the first `n` rows of `width`.
    fn swiglu(&self, gate: &mut Self::Act, up: &Self::Act, n: usize, width: usize);
    /// gate = gelu_tanh(gate) · up for the first `n` rows of `width`.
    fn geglu(&self, gate: &mut Self::Act, up: &Self::Act, n: usize, width: usize);
    /// RMSNorm in place of each of the first `rows` rows of `w.len()`
    /// values (the per-head query / key norm: rows = tokens · heads).
    fn rmsnorm_rows(&self, x: &mut Self::Act, w: &Self::Vector, eps: f32, rows: usize);
    /// x[..len] *= s.
    fn scale(&self, x: &mut Self::Act, s: f32, len: usize);
    /// dst row i = src row rows[i], rows of `width` (mixture-of-experts:
    /// the tokens routed to one expert, packed).
    fn gather_rows(&self, src: &Self::Act, rows: &[u32], width: usize, dst: &mut Self::Act);
    /// dst row rows[i] = src row i · weights[i], rows of `width`.
    fn scatter_rows(
        &self,
        dst: &mut Self::Act,
        src: &Self::Act,
        rows: &[u32],
        weights: &[f32],
        width: usize,
    );
    /// dst row t = Σ_{j<k} src row t·k + j, in order of j, for t < n.
    fn sum_groups(&self, src: &Self::Act, k: usize, n: usize, width: usize, dst: &mut Self::Act);
    /// x += y for the first `n` rows of `width`.
    fn add(&self, x: &mut Self::Act, y: &Self::Act, n: usize, width: usize);
}

/// How weights reach a backend: a running backend takes them itself; the
/// host backend takes mapped bytes as they are, so loading for it needs no
/// running backend (`HostLoader`, no thread pool).
pub trait WeightSink<B: Backend> {
    /// A matrix of `dtype` rows.
    fn matrix<'w>(
        &self,
        dtype: DType,
        n_in: usize,
        n_out: usize,
        bytes: Cow<'w, [u8]>,
    ) -> Result<B::Mat<'w>>;
    /// A matrix only read by rows (see [`Backend::table`]).
    fn table<'w>(
        &self,
        dtype: DType,
        n_in: usize,
        n_out: usize,
        bytes: Cow<'w, [u8]>,
    ) -> Result<B::Mat<'w>> {
        self.matrix(dtype, n_in, n_out, bytes)
    }
    /// A vector.
    fn vector(&self, v: Vec<f32>) -> Result<B::Vector>;
}

impl<B: Backend> WeightSink<B> for B {
    fn matrix<'w>(
        &self,
        dtype: DType,
        n_in: usize,
        n_out: usize,
        bytes: Cow<'w, [u8]>,
    ) -> Result<B::Mat<'w>> {
        Backend::matrix(self, dtype, n_in, n_out, bytes)
    }
    fn table<'w>(
        &self,
        dtype: DType,
        n_in: usize,
        n_out: usize,
        bytes: Cow<'w, [u8]>,
    ) -> Result<B::Mat<'w>> {
        Backend::table(self, dtype, n_in, n_out, bytes)
    }
    fn vector(&self, v: Vec<f32>) -> Result<B::Vector> {
        Backend::vector(self, v)
    }
}
