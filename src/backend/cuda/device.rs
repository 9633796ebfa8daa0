//! The NVIDIA backend (feature `cuda`): kvrun's own kernels (kernels/*.cu,
//! embedded as PTX by build.rs and JIT-compiled by the driver) launched
//! through the CUDA driver API on one stream.
//!
//! - Weights are uploaded once, as their raw GGUF blocks; the matmul
//!   kernels dequantize them on the fly (kernels/matmul.cu).
//! - Activations, K/V rows and the attention mass live on the device; the
//!   host sees them only through the explicit read-backs of the `Backend`
//!   trait (logits, hidden-state taps, the exported mass) and the K/V
//!   store's batched reads (scorers that rank by keys or values).
//! - The cache's metadata stays on the host. Each step uploads, in one
//!   copy per cache, the head records and entry lists attention reads in
//!   every layer (`plan::StepTables`); eviction frees slots in the metadata
//!   and never moves K/V.
//! - An operation that fails (a launch, an allocation) cannot return an
//!   error through the trait, so the first failure is kept and `check`,
//!   called at the end of every forward step, returns it as a one-line
//!   error.

use super::plan::{self, MatKernel, StepTables};
use crate::backend::cpu::pool::ThreadPool;
use crate::backend::kvstore::{quantize_q8_0, BlockQ8_0};
use crate::backend::{AttnStep, Backend, KvAccess, KvStore, KvType, MassMode, Rope, RopeStyle};
use crate::error::{Error, Result};
use crate::tensor::DType;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DeviceRepr,
    DriverError, LaunchConfig, PushKernelArg, ValidAsZeroBits,
};
use std::borrow::Cow;
use std::sync::{Arc, Mutex};

mod ptx {
    include!(concat!(env!("OUT_DIR"), "/ptx.rs"));
}

/// Whether this binary carries its CUDA kernels (nvcc was found at build
/// time).
pub fn has_kernels() -> bool {
    !ptx::PTX.is_empty()
}

/// The embedded PTX modules: (name, text).
pub fn ptx_modules() -> &'static [(&'static str, &'static str)] {
    ptx::PTX
}

/// Whether the NVIDIA driver library can be loaded (cudarc's loader panics
/// when it cannot, so this is asked first).
pub fn driver_present() -> bool {
    // SAFETY: only tries to open the driver library by its known names;
    // nothing from it is called.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

fn drv(what: &str, e: DriverError) -> Error {
    Error::Other(format!("cuda: {what}: {e}"))
}

/// Every kernel, looked up once.
#[derive(Debug)]
struct Funcs {
    mmv: [CudaFunction; 4],
    tile: CudaFunction,
    embed: CudaFunction,
    rmsnorm: CudaFunction,
    rmsnorm_inplace: CudaFunction,
    add_rmsnorm: CudaFunction,
    add_bias: CudaFunction,
    add_vec: CudaFunction,
    scale_vec: CudaFunction,
    swiglu: CudaFunction,
    geglu: CudaFunction,
    rope: CudaFunction,
    gather: CudaFunction,
    scatter: CudaFunction,
    sum_groups: CudaFunction,
    attn_part: CudaFunction,
    attn_combine: CudaFunction,
    attn_mass: CudaFunction,
    kv_store_rows: CudaFunction,
    kv_read_rows: CudaFunction,
    kv_move_rows: CudaFunction,
    read_sum: CudaFunction,
}

/// Device buffers for the small host arrays some operations carry (token
/// ids, row lists, storage units), reused from call to call: the stream
/// orders each upload after the launches that read the previous one.
#[derive(Debug, Default)]
struct Uploads {
    u32s: Option<CudaSlice<u32>>,
    f32s: Option<CudaSlice<f32>>,
    u64s: Option<CudaSlice<u64>>,
    tmp: Option<CudaSlice<f32>>,
    /// Host staging of `kv_write`'s storage units (kept, so a decoded
    /// token allocates nothing).
    units: Vec<u64>,
    /// RoPE frequency factors, uploaded once per distinct table.
    freq: Vec<(Vec<f32>, CudaSlice<f32>)>,
}

/// The device: context, stream, kernels.
#[derive(Debug)]
pub(super) struct Dev {
    ordinal: usize,
    stream: Arc<CudaStream>,
    f: Funcs,
    /// The first failure of an operation that cannot return one.
    err: Mutex<Option<String>>,
    up: Mutex<Uploads>,
    _modules: Vec<Arc<CudaModule>>,
    _ctx: Arc<CudaContext>,
}

/// A device pointer as a kernel argument.
fn dp<T>(s: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    // event tracking is off (one stream), so the guard has nothing to do
    let (p, _guard) = s.device_ptr(stream);
    p
}

impl Dev {
    fn open(ordinal: usize) -> Result<Dev> {
        let n = CudaContext::device_count().map_err(|e| drv("counting GPUs", e))?;
        if ordinal >= n.max(0) as usize {
            return Err(Error::arg(
                "--device",
                format!("cuda:{ordinal}: this machine has {n} NVIDIA GPU(s)"),
            ));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| drv("opening the GPU", e))?;
        // SAFETY: kvrun issues all its work on one stream, so cudarc's
        // cross-stream event tracking is not needed; buffers are freed in
        // stream order.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.default_stream();
        let mut modules = Vec::new();
        for (name, text) in ptx::PTX {
            let m = ctx
                .load_module(cudarc::nvrtc::Ptx::from_src(*text))
                .map_err(|e| drv(&format!("loading kernels/{name}.cu"), e))?;
            modules.push(m);
        }
        let find = |name: &str| -> Result<CudaFunction> {
            for m in &modules {
                if let Ok(f) = m.load_function(name) {
                    return Ok(f);
                }
            }
            Err(Error::Other(format!(
                "cuda: kernel {name} missing from the embedded PTX"
            )))
        };
        let f = Funcs {
            mmv: [
                find("mmv_1")?,
                find("mmv_2")?,
                find("mmv_4")?,
                find("mmv_8")?,
            ],
            tile: find("mm_tile")?,
            embed: find("embed_rows")?,
            rmsnorm: find("rmsnorm")?,
            rmsnorm_inplace: find("rmsnorm_inplace")?,
            add_rmsnorm: find("add_rmsnorm")?,
            add_bias: find("add_bias")?,
            add_vec: find("add_vec")?,
            scale_vec: find("scale_vec")?,
            swiglu: find("swiglu")?,
            geglu: find("geglu")?,
            rope: find("rope")?,
            gather: find("gather_rows")?,
            scatter: find("scatter_rows")?,
            sum_groups: find("sum_groups")?,
            attn_part: find("attn_part")?,
            attn_combine: find("attn_combine")?,
            attn_mass: find("attn_mass")?,
            kv_store_rows: find("kv_store_rows")?,
            kv_read_rows: find("kv_read_rows")?,
            kv_move_rows: find("kv_move_rows")?,
            read_sum: find("read_sum")?,
        };
        Ok(Dev {
            ordinal,
            stream,
            f,
            err: Mutex::new(None),
            up: Mutex::new(Uploads::default()),
            _modules: modules,
            _ctx: ctx,
        })
    }

    /// Keep the first failure.
    fn note<T>(&self, what: &str, r: std::result::Result<T, DriverError>) -> Option<T> {
        match r {
            Ok(v) => Some(v),
            Err(e) => {
                let mut g = self.err.lock().unwrap_or_else(|p| p.into_inner());
                g.get_or_insert_with(|| format!("cuda:{}: {what}: {e}", self.ordinal));
                None
            }
        }
    }

    fn fail(&self, msg: String) {
        let mut g = self.err.lock().unwrap_or_else(|p| p.into_inner());
        g.get_or_insert(msg);
    }

    fn alloc<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> Option<CudaSlice<T>> {
        self.note(
            "allocating device memory",
            self.stream.alloc_zeros::<T>(n.max(1)),
        )
    }

    /// `buf` with room for at least `n` values (grown, zeroed, when short).
    fn ensure<'a, T: DeviceRepr + ValidAsZeroBits>(
        &self,
        buf: &'a mut Option<CudaSlice<T>>,
        n: usize,
    ) -> Option<&'a mut CudaSlice<T>> {
        if buf.as_ref().is_none_or(|b| b.len() < n) {
            *buf = self.alloc::<T>(n.max(64).next_power_of_two());
        }
        buf.as_mut()
    }

    /// Upload `v` into `buf` (grown when short); the device pointer.
    fn upload<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        buf: &mut Option<CudaSlice<T>>,
        v: &[T],
    ) -> u64 {
        let Some(b) = self.ensure(buf, v.len()) else {
            return 0;
        };
        if !v.is_empty() {
            self.note(
                "copying to the device",
                self.stream.memcpy_htod(v, &mut b.slice_mut(0..v.len())),
            );
        }
        dp(b, &self.stream)
    }

    fn ptr<T>(&self, s: &CudaSlice<T>) -> u64 {
        dp(s, &self.stream)
    }

    /// Launch `f` with the arguments `args` pushes.
    fn launch<'a>(
        &'a self,
        name: &str,
        f: &'a CudaFunction,
        l: plan::Launch,
        args: impl FnOnce(&mut cudarc::driver::LaunchArgs<'a>),
    ) {
        if l.grid.0 == 0 || l.grid.1 == 0 || l.grid.2 == 0 {
            return;
        }
        let mut b = self.stream.launch_builder(f);
        args(&mut b);
        let cfg = LaunchConfig {
            grid_dim: l.grid,
            block_dim: l.block,
            shared_mem_bytes: 0,
        };
        // SAFETY: every kernel's parameters are pushed in the order and with
        // the types of its signature in kernels/*.cu (pointers as u64
        // device addresses of live buffers sized by the caller for the
        // launch shape, counts as i32/i64/u64, scalars as f32); the
        // buffers outlive the launch because they are freed in stream
        // order.
        let r = unsafe { b.launch(cfg) };
        self.note(name, r);
    }
}

/// A weight matrix on the device: `n_out` rows of raw GGUF blocks.
#[derive(Debug)]
pub struct DevMat {
    dtype: DType,
    n_in: usize,
    n_out: usize,
    row_bytes: usize,
    data: CudaSlice<u8>,
}

/// An f32 buffer on the device (weights vectors and activations).
#[derive(Debug)]
pub struct DevBuf {
    len: usize,
    data: Option<CudaSlice<f32>>,
}

/// Per-sequence scratch: attention partials, the exported mass, the step's
/// entry lists and head records, the classifier's output.
#[derive(Debug, Default)]
pub struct CudaScratch {
    logits: Option<CudaSlice<f32>>,
    part_out: Option<CudaSlice<f32>>,
    part_ml: Option<CudaSlice<f32>>,
    row_ml: Option<CudaSlice<f32>>,
    mass: Option<CudaSlice<f32>>,
    exported: bool,
    /// This step's attention records of the budgeted cache ([0]) and of the
    /// sliding-window layers' cache ([1]), and their device copies.
    tables: [StepTables; 2],
    tables_dev: [Option<CudaSlice<u32>>; 2],
}

/// Which of a scratch's two caches a step attends over: the sliding-window
/// layers' own (`window > 0`) or the budgeted one.
fn cache_index(st: &AttnStep) -> usize {
    usize::from(st.window > 0)
}

/// An NVIDIA GPU.
#[derive(Debug)]
pub struct Cuda {
    dev: Arc<Dev>,
    pool: ThreadPool,
}

impl Cuda {
    /// Open GPU `ordinal`, with `n_host_threads` host threads for the work
    /// around the forward pass (scorers). A build without kernels or a
    /// machine without the driver is a one-line error.
    pub fn new(ordinal: usize, n_host_threads: usize) -> Result<Cuda> {
        if !has_kernels() {
            return Err(Error::arg(
                "--device",
                format!("cuda:{ordinal}: this kvrun was built without nvcc, so it has no CUDA kernels (install the CUDA toolkit or set KVRUN_NVCC, then rebuild)"),
            ));
        }
        if !driver_present() {
            return Err(Error::arg(
                "--device",
                format!("cuda:{ordinal}: no NVIDIA driver on this machine (libcuda could not be loaded); use --device cpu"),
            ));
        }
        Ok(Cuda {
            dev: Arc::new(Dev::open(ordinal)?),
            pool: ThreadPool::new(n_host_threads.max(1)),
        })
    }

    /// Another handle on the same GPU (shared kernels and stream), with its
    /// own host threads: one per session.
    pub fn sibling(&self, n_host_threads: usize) -> Cuda {
        Cuda {
            dev: self.dev.clone(),
            pool: ThreadPool::new(n_host_threads.max(1)),
        }
    }

    /// The device's read bandwidth in GB/s: a 1 GiB streaming read, timed
    /// over 5 passes after a warm-up.
    pub fn read_bandwidth(&self) -> Result<f64> {
        let d = self.dev();
        let n = 1usize << 28; // floats: 1 GiB
        let buf = d
            .stream
            .alloc_zeros::<f32>(n)
            .map_err(|e| drv("allocating the bandwidth probe", e))?;
        let blocks = 4096usize;
        let out = d
            .stream
            .alloc_zeros::<f32>(blocks)
            .map_err(|e| drv("allocating the bandwidth probe", e))?;
        let (xp, op, n4) = (d.ptr(&buf), d.ptr(&out), (n / 4) as i64);
        let l = plan::Launch {
            grid: (blocks as u32, 1, 1),
            block: (256, 1, 1),
        };
        let pass = || {
            d.launch("read_sum", &d.f.read_sum, l, |a| {
                a.arg(&xp).arg(&n4).arg(&op);
            })
        };
        pass();
        d.stream
            .synchronize()
            .map_err(|e| drv("bandwidth probe", e))?;
        let t = std::time::Instant::now();
        for _ in 0..5 {
            pass();
        }
        d.stream
            .synchronize()
            .map_err(|e| drv("bandwidth probe", e))?;
        self.check()?;
        Ok(5.0 * (4 * n) as f64 / t.elapsed().as_secs_f64() / 1e9)
    }

    /// A device buffer holding `v` (weight vectors; tests feed the ops
    /// through it).
    pub fn act_from(&self, v: &[f32]) -> Result<DevBuf> {
        let data = self
            .dev
            .stream
            .clone_htod(v)
            .map_err(|e| drv("uploading", e))?;
        Ok(DevBuf {
            len: v.len(),
            data: Some(data),
        })
    }

    fn dev(&self) -> &Dev {
        &self.dev
    }

    fn ptr(b: &DevBuf, s: &CudaStream) -> u64 {
        b.data.as_ref().map_or(0, |d| dp(d, s))
    }

    fn elementwise<'a>(
        &'a self,
        name: &str,
        f: &'a CudaFunction,
        len: usize,
        args: impl FnOnce(&mut cudarc::driver::LaunchArgs<'a>),
    ) {
        if len > 0 {
            self.dev()
                .launch(name, f, plan::elementwise_launch(len), args);
        }
    }

    /// x[i] = f(x[i], y[i]) for i < len (kernels taking (x, y, len)).
    fn pairwise(&self, name: &str, f: &CudaFunction, x: &mut DevBuf, y: &DevBuf, len: usize) {
        let d = self.dev();
        let (xp, yp, l64) = (Self::ptr(x, &d.stream), Self::ptr(y, &d.stream), len as i64);
        self.elementwise(name, f, len, |a| {
            a.arg(&xp).arg(&yp).arg(&l64);
        });
    }

    /// y (n, n_out) = x (n, n_in) · wᵀ into device memory at `y`.
    fn matmul_into(&self, w: &DevMat, x: u64, n: usize, y: u64) {
        let d = self.dev();
        let (k, l) = plan::matmul_launch(n, w.n_out);
        let f = match k {
            MatKernel::Mmv(1) => &d.f.mmv[0],
            MatKernel::Mmv(2) => &d.f.mmv[1],
            MatKernel::Mmv(4) => &d.f.mmv[2],
            MatKernel::Mmv(_) => &d.f.mmv[3],
            MatKernel::Tile => &d.f.tile,
        };
        let wp = d.ptr(&w.data);
        let (ty, rb) = (plan::type_code(w.dtype), w.row_bytes as u64);
        let (n_in, n_out, n_tok) = (w.n_in as i32, w.n_out as i32, n as i32);
        d.launch(k.name(), f, l, |b| {
            b.arg(&ty)
                .arg(&wp)
                .arg(&rb)
                .arg(&x)
                .arg(&y)
                .arg(&n_in)
                .arg(&n_out)
                .arg(&n_tok);
        });
    }
}

impl Backend for Cuda {
    type Mat<'w> = DevMat;
    type Vector = DevBuf;
    type Act = DevBuf;
    type Scratch = CudaScratch;

    fn name(&self) -> String {
        format!("cuda:{}", self.dev.ordinal)
    }
    fn n_threads(&self) -> usize {
        1
    }
    fn host_pool(&self) -> &ThreadPool {
        &self.pool
    }
    fn check(&self) -> Result<()> {
        let g = self.dev.err.lock().unwrap_or_else(|p| p.into_inner());
        match &*g {
            Some(m) => Err(Error::Other(m.clone())),
            None => Ok(()),
        }
    }

    fn matrix<'w>(
        &self,
        dtype: DType,
        n_in: usize,
        n_out: usize,
        bytes: Cow<'w, [u8]>,
    ) -> Result<DevMat> {
        plan::check_matrix(dtype, n_in)?;
        let row_bytes = dtype.row_bytes(n_in);
        if bytes.len() != row_bytes * n_out {
            return Err(Error::Other(format!(
                "cuda: a {n_out}×{n_in} {dtype:?} matrix needs {} bytes, got {}",
                row_bytes * n_out,
                bytes.len()
            )));
        }
        let data = self
            .dev
            .stream
            .clone_htod(&bytes[..])
            .map_err(|e| drv("uploading weights", e))?;
        Ok(DevMat {
            dtype,
            n_in,
            n_out,
            row_bytes,
            data,
        })
    }
    fn vector(&self, v: Vec<f32>) -> Result<DevBuf> {
        self.act_from(&v)
    }
    fn act(&self, len: usize) -> DevBuf {
        DevBuf {
            len,
            data: self.dev.alloc::<f32>(len),
        }
    }
    fn scratch(&self) -> CudaScratch {
        CudaScratch::default()
    }
    fn kv_store(&self, ty: KvType, n_rows: usize, row_vals: usize) -> Result<Box<dyn KvStore>> {
        Ok(Box::new(CudaKv::new(
            self.dev.clone(),
            ty,
            n_rows,
            row_vals,
        )?))
    }
    fn read(&self, a: &DevBuf, r: std::ops::Range<usize>, out: &mut Vec<f32>) {
        let base = out.len();
        out.resize(base + r.len(), 0.0);
        match &a.data {
            Some(d) if r.end <= d.len() && !r.is_empty() => {
                self.dev.note(
                    "reading back",
                    self.dev.stream.memcpy_dtoh(&d.slice(r), &mut out[base..]),
                );
            }
            _ if r.is_empty() => {}
            _ => self.dev.fail(format!(
                "cuda: read-back of {r:?} past a buffer of {}",
                a.len
            )),
        }
    }
    fn host<'a>(&self, a: &'a DevBuf, r: std::ops::Range<usize>) -> Cow<'a, [f32]> {
        let mut v = Vec::with_capacity(r.len());
        self.read(a, r, &mut v);
        Cow::Owned(v)
    }
    fn mat_row(&self, m: &DevMat, r: usize, out: &mut [f32]) {
        let mut bytes = vec![0u8; m.row_bytes];
        self.dev.note(
            "reading back a weight row",
            self.dev.stream.memcpy_dtoh(
                &m.data.slice(r * m.row_bytes..(r + 1) * m.row_bytes),
                &mut bytes[..],
            ),
        );
        crate::quant::dequantize_row(m.dtype, &bytes, &mut out[..m.n_in]);
    }
    fn mat_shape(&self, m: &DevMat) -> (usize, usize) {
        (m.n_out, m.n_in)
    }
    fn mat_bytes(&self, m: &DevMat, out: &mut Vec<u8>) -> Option<DType> {
        out.clear();
        out.resize(m.n_out * m.row_bytes, 0);
        self.dev.note(
            "reading back a weight matrix",
            self.dev
                .stream
                .memcpy_dtoh(&m.data.slice(0..m.n_out * m.row_bytes), &mut out[..]),
        );
        Some(m.dtype)
    }

    fn embed(&self, table: &DevMat, tokens: &[u32], x: &mut DevBuf) {
        let d = self.dev();
        let mut up = d.up.lock().unwrap_or_else(|p| p.into_inner());
        let tp = d.upload(&mut up.u32s, tokens);
        let (ty, rb, dim) = (
            plan::type_code(table.dtype),
            table.row_bytes as u64,
            table.n_in as i32,
        );
        let wp = d.ptr(&table.data);
        let xp = Self::ptr(x, &d.stream);
        let l = plan::Launch {
            grid: (tokens.len() as u32, 1, 1),
            block: (128, 1, 1),
        };
        d.launch("embed_rows", &d.f.embed, l, |b| {
            b.arg(&ty).arg(&wp).arg(&rb).arg(&tp).arg(&xp).arg(&dim);
        });
    }
    fn rmsnorm(&self, x: &DevBuf, first: usize, w: &DevBuf, eps: f32, n: usize, out: &mut DevBuf) {
        let d = self.dev();
        let dim = w.len;
        let xp = Self::ptr(x, &d.stream) + (first * dim * 4) as u64;
        let (wp, op, dim) = (
            Self::ptr(w, &d.stream),
            Self::ptr(out, &d.stream),
            dim as i32,
        );
        let l = plan::Launch {
            grid: (n as u32, 1, 1),
            block: (256, 1, 1),
        };
        d.launch("rmsnorm", &d.f.rmsnorm, l, |b| {
            b.arg(&xp).arg(&wp).arg(&op).arg(&dim).arg(&eps);
        });
    }
    fn matmul(
        &self,
        _sc: &mut CudaScratch,
        ws: &[&DevMat],
        x: &DevBuf,
        n: usize,
        outs: &mut [&mut DevBuf],
    ) {
        let xp = Self::ptr(x, &self.dev.stream);
        for (w, o) in ws.iter().zip(outs.iter()) {
            self.matmul_into(w, xp, n, Self::ptr(o, &self.dev.stream));
        }
    }
    fn matmul_host(&self, sc: &mut CudaScratch, w: &DevMat, x: &DevBuf, n: usize, out: &mut [f32]) {
        let d = self.dev();
        let len = n * w.n_out;
        let Some(buf) = d.ensure(&mut sc.logits, len) else {
            return;
        };
        let yp = d.ptr(buf);
        self.matmul_into(w, Self::ptr(x, &d.stream), n, yp);
        d.note(
            "reading back logits",
            d.stream.memcpy_dtoh(&buf.slice(0..len), &mut out[..len]),
        );
    }
    fn add_bias(&self, x: &mut DevBuf, b: &DevBuf, n: usize) {
        let d = self.dev();
        let (xp, bp, width, len) = (
            Self::ptr(x, &d.stream),
            Self::ptr(b, &d.stream),
            b.len as i32,
            (n * b.len) as i64,
        );
        self.elementwise("add_bias", &d.f.add_bias, len as usize, |a| {
            a.arg(&xp).arg(&bp).arg(&width).arg(&len);
        });
    }
    fn copy(&self, dst: &mut DevBuf, src: &DevBuf, len: usize) {
        let d = self.dev();
        if let (Some(s), Some(t)) = (&src.data, &mut dst.data) {
            if len > 0 {
                d.note(
                    "copying on the device",
                    d.stream
                        .memcpy_dtod(&s.slice(0..len), &mut t.slice_mut(0..len)),
                );
            }
        }
    }
    fn rope(&self, rope: &Rope, q: &mut DevBuf, k: &mut DevBuf, st: &AttnStep) {
        let d = self.dev();
        let ff = match &rope.freq_factors {
            None => 0u64,
            Some(f) => {
                let mut up = d.up.lock().unwrap_or_else(|p| p.into_inner());
                match up.freq.iter().find(|(v, _)| v == f) {
                    Some((_, b)) => d.ptr(b),
                    None => match d.note("uploading RoPE factors", d.stream.clone_htod(&f[..])) {
                        Some(b) => {
                            let p = d.ptr(&b);
                            up.freq.push((f.clone(), b));
                            p
                        }
                        None => return,
                    },
                }
            }
        };
        let neox = i32::from(rope.style == RopeStyle::Neox);
        let (n_tok, hd, pos0, n_rot) = (
            st.n as i32,
            st.head_dim as i32,
            st.pos0 as i32,
            rope.n_rot as i32,
        );
        let (ts, ps, ms) = (rope.theta_scale, rope.pos_scale, rope.mscale);
        for (buf, heads) in [
            (Self::ptr(q, &d.stream), st.n_heads),
            (Self::ptr(k, &d.stream), st.n_kv_heads),
        ] {
            let nh = heads as i32;
            let total = st.n * heads * rope.n_rot / 2;
            self.elementwise("rope", &d.f.rope, total, |a| {
                a.arg(&buf)
                    .arg(&n_tok)
                    .arg(&nh)
                    .arg(&hd)
                    .arg(&pos0)
                    .arg(&n_rot)
                    .arg(&ts)
                    .arg(&ff)
                    .arg(&ps)
                    .arg(&ms)
                    .arg(&neox);
            });
        }
    }
    fn kv_write(
        &self,
        kv: &mut dyn KvAccess,
        layer: usize,
        slots: &[u32],
        k: &DevBuf,
        v: &DevBuf,
        n: usize,
        kv_dim: usize,
    ) {
        let d = self.dev();
        let Some(store) = kv.store().as_any().downcast_ref::<CudaKv>() else {
            d.fail("cuda: the cache's K/V store is not on this device".into());
            return;
        };
        let (kp, vp, ty) = (store.kp(), store.vp(), plan::kv_code(store.ty));
        let mut up = d.up.lock().unwrap_or_else(|p| p.into_inner());
        let mut units = std::mem::take(&mut up.units);
        kv.write_units(layer, n, slots, &mut units);
        let n_kv = units.len() / n.max(1);
        let hd = kv_dim / n_kv.max(1);
        let up_p = d.upload(&mut up.u64s, &units);
        let (kxp, vxp) = (Self::ptr(k, &d.stream), Self::ptr(v, &d.stream));
        let (kd, nk, hdi) = (kv_dim as i32, n_kv as i32, hd as i32);
        let l = plan::Launch {
            grid: (units.len() as u32, 1, 1),
            block: (128, 1, 1),
        };
        d.launch("kv_store_rows", &d.f.kv_store_rows, l, |a| {
            a.arg(&kxp)
                .arg(&vxp)
                .arg(&kd)
                .arg(&nk)
                .arg(&hdi)
                .arg(&up_p)
                .arg(&ty)
                .arg(&kp)
                .arg(&vp);
        });
        up.units = units;
    }
    fn begin_attention(&self, sc: &mut CudaScratch, kv: &dyn KvAccess, st: &AttnStep) {
        // every layer's records in one copy
        let c = cache_index(st);
        sc.tables[c].build(kv, st.n_kv_heads);
        self.dev()
            .upload(&mut sc.tables_dev[c], &sc.tables[c].words);
        if st.mass != MassMode::None {
            let n = kv.n_slots();
            let d = self.dev();
            if let Some(m) = d.ensure(&mut sc.mass, n) {
                d.note("clearing the attention mass", d.stream.memset_zeros(m));
                sc.exported = true;
            }
        }
    }
    fn attention(
        &self,
        sc: &mut CudaScratch,
        kv: &dyn KvAccess,
        st: &AttnStep,
        layer: usize,
        _rope: &Rope,
        q: &DevBuf,
        _q_raw: &DevBuf,
        out: &mut DevBuf,
    ) {
        let d = self.dev();
        if st.cache_positions {
            d.fail("cuda: --pos-mode cache is not supported on the GPU yet".into());
            return;
        }
        let Some(store) = kv.store().as_any().downcast_ref::<CudaKv>() else {
            d.fail("cuda: the cache's K/V store is not on this device".into());
            return;
        };
        // the layer's head records and the entry lists, uploaded at
        // begin_attention
        let c = cache_index(st);
        let (t, Some(buf)) = (&sc.tables[c], &sc.tables_dev[c]) else {
            return;
        };
        let Some(&max_entries) = t.max_entries.get(layer) else {
            d.fail(format!(
                "cuda: attention for layer {layer} before its records were built"
            ));
            return;
        };
        let base = d.ptr(buf);
        let hp = base + 4 * t.heads_offset(layer) as u64;
        let ep = base + 4 * t.entries_offset() as u64;
        let n_split = plan::n_splits(max_entries);
        let (n, nh, hd) = (st.n, st.n_heads, st.head_dim);
        let group = nh / st.n_kv_heads;
        let parts = n * nh * n_split;
        let (Some(po), Some(pm), Some(rm)) = (
            d.ensure(&mut sc.part_out, parts * hd)
                .map(|b| dp(b, &d.stream)),
            d.ensure(&mut sc.part_ml, 2 * parts)
                .map(|b| dp(b, &d.stream)),
            d.ensure(&mut sc.row_ml, 2 * n * nh)
                .map(|b| dp(b, &d.stream)),
        ) else {
            return;
        };
        let (qp, op) = (Self::ptr(q, &d.stream), Self::ptr(out, &d.stream));
        let (kp, vp, ty) = (store.kp(), store.vp(), plan::kv_code(store.ty));
        let (nhi, hdi, gi, pos0, win, ns) = (
            nh as i32,
            hd as i32,
            group as i32,
            st.pos0 as i32,
            st.window as i32,
            n_split as i32,
        );
        let scale = st.scale;
        let block = (plan::ATT_THREADS, 1, 1);
        let l = plan::Launch {
            grid: (n_split as u32, n as u32, st.n_kv_heads as u32),
            block,
        };
        d.launch("attn_part", &d.f.attn_part, l, |a| {
            a.arg(&qp)
                .arg(&nhi)
                .arg(&hdi)
                .arg(&gi)
                .arg(&ty)
                .arg(&kp)
                .arg(&vp)
                .arg(&hp)
                .arg(&ep)
                .arg(&pos0)
                .arg(&win)
                .arg(&scale)
                .arg(&ns)
                .arg(&po)
                .arg(&pm);
        });
        let l = plan::Launch {
            grid: (nh as u32, n as u32, 1),
            block: (128, 1, 1),
        };
        d.launch("attn_combine", &d.f.attn_combine, l, |a| {
            a.arg(&po)
                .arg(&pm)
                .arg(&nhi)
                .arg(&hdi)
                .arg(&ns)
                .arg(&op)
                .arg(&rm);
        });
        // the exported probabilities of the asked rows
        let rows = match st.mass {
            MassMode::None => None,
            MassMode::LastRow => Some((n - 1, 1)),
            MassMode::AllRows => Some((0, n)),
        };
        if let (Some((first, count)), Some(m)) = (rows, sc.mass.as_ref()) {
            if max_entries > 0 {
                let (mp, fr, w) = (d.ptr(m), first as i32, st.mass_w);
                let l = plan::Launch {
                    grid: (n_split as u32, count as u32, st.n_kv_heads as u32),
                    block,
                };
                d.launch("attn_mass", &d.f.attn_mass, l, |a| {
                    a.arg(&qp)
                        .arg(&nhi)
                        .arg(&hdi)
                        .arg(&gi)
                        .arg(&ty)
                        .arg(&kp)
                        .arg(&hp)
                        .arg(&ep)
                        .arg(&pos0)
                        .arg(&win)
                        .arg(&scale)
                        .arg(&fr)
                        .arg(&rm)
                        .arg(&w)
                        .arg(&mp);
                });
            }
        }
    }
    fn end_attention(&self, sc: &mut CudaScratch, n_slots: usize, mass: &mut [f32]) {
        if !std::mem::take(&mut sc.exported) {
            return;
        }
        let d = self.dev();
        if let Some(m) = &sc.mass {
            let n = n_slots.min(m.len()).min(mass.len());
            if n > 0 {
                d.note(
                    "reading back the attention mass",
                    d.stream.memcpy_dtoh(&m.slice(0..n), &mut mass[..n]),
                );
            }
        }
    }
    fn add_rmsnorm(&self, x: &mut DevBuf, b: &mut DevBuf, w: &DevBuf, eps: f32, n: usize) {
        let d = self.dev();
        let (xp, bp, wp, dim) = (
            Self::ptr(x, &d.stream),
            Self::ptr(b, &d.stream),
            Self::ptr(w, &d.stream),
            w.len as i32,
        );
        let l = plan::Launch {
            grid: (n as u32, 1, 1),
            block: (256, 1, 1),
        };
        d.launch("add_rmsnorm", &d.f.add_rmsnorm, l, |a| {
            a.arg(&xp).arg(&bp).arg(&wp).arg(&dim).arg(&eps);
        });
    }
    fn swiglu(&self, gate: &mut DevBuf, up: &DevBuf, n: usize, width: usize) {
        self.pairwise("swiglu", &self.dev.f.swiglu, gate, up, n * width);
    }
    fn geglu(&self, gate: &mut DevBuf, up: &DevBuf, n: usize, width: usize) {
        self.pairwise("geglu", &self.dev.f.geglu, gate, up, n * width);
    }
    fn rmsnorm_rows(&self, x: &mut DevBuf, w: &DevBuf, eps: f32, rows: usize) {
        let d = self.dev();
        let (xp, wp, dim) = (
            Self::ptr(x, &d.stream),
            Self::ptr(w, &d.stream),
            w.len as i32,
        );
        let l = plan::Launch {
            grid: (rows as u32, 1, 1),
            block: (if w.len >= 256 { 256 } else { 64 }, 1, 1),
        };
        d.launch("rmsnorm_inplace", &d.f.rmsnorm_inplace, l, |a| {
            a.arg(&xp).arg(&wp).arg(&dim).arg(&eps);
        });
    }
    fn scale(&self, x: &mut DevBuf, s: f32, len: usize) {
        let d = self.dev();
        let (xp, l64) = (Self::ptr(x, &d.stream), len as i64);
        self.elementwise("scale_vec", &d.f.scale_vec, len, |a| {
            a.arg(&xp).arg(&s).arg(&l64);
        });
    }
    fn gather_rows(&self, src: &DevBuf, rows: &[u32], width: usize, dst: &mut DevBuf) {
        let d = self.dev();
        let mut up = d.up.lock().unwrap_or_else(|p| p.into_inner());
        let rp = d.upload(&mut up.u32s, rows);
        let (sp, dpp, w) = (
            Self::ptr(src, &d.stream),
            Self::ptr(dst, &d.stream),
            width as i32,
        );
        let l = plan::Launch {
            grid: (rows.len() as u32, 1, 1),
            block: (256, 1, 1),
        };
        d.launch("gather_rows", &d.f.gather, l, |a| {
            a.arg(&sp).arg(&rp).arg(&dpp).arg(&w);
        });
    }
    fn scatter_rows(
        &self,
        dst: &mut DevBuf,
        src: &DevBuf,
        rows: &[u32],
        weights: &[f32],
        width: usize,
    ) {
        let d = self.dev();
        let mut up = d.up.lock().unwrap_or_else(|p| p.into_inner());
        let rp = d.upload(&mut up.u32s, rows);
        let wp = d.upload(&mut up.f32s, &weights[..rows.len()]);
        let (sp, dpp, w) = (
            Self::ptr(src, &d.stream),
            Self::ptr(dst, &d.stream),
            width as i32,
        );
        let l = plan::Launch {
            grid: (rows.len() as u32, 1, 1),
            block: (256, 1, 1),
        };
        d.launch("scatter_rows", &d.f.scatter, l, |a| {
            a.arg(&dpp).arg(&sp).arg(&rp).arg(&wp).arg(&w);
        });
    }
    fn sum_groups(&self, src: &DevBuf, k: usize, n: usize, width: usize, dst: &mut DevBuf) {
        let d = self.dev();
        let (sp, dpp, ki, w) = (
            Self::ptr(src, &d.stream),
            Self::ptr(dst, &d.stream),
            k as i32,
            width as i32,
        );
        let l = plan::Launch {
            grid: (n as u32, 1, 1),
            block: (256, 1, 1),
        };
        d.launch("sum_groups", &d.f.sum_groups, l, |a| {
            a.arg(&sp).arg(&dpp).arg(&ki).arg(&w);
        });
    }
    fn add(&self, x: &mut DevBuf, y: &DevBuf, n: usize, width: usize) {
        self.pairwise("add_vec", &self.dev.f.add_vec, x, y, n * width);
    }
}

/// K and V rows in device memory: `n_rows` rows of `row_vals` values each,
/// stored as `ty` (f32, f16 or ggml q8_0 blocks).
#[derive(Debug)]
pub struct CudaKv {
    dev: Arc<Dev>,
    ty: KvType,
    n_rows: usize,
    row_vals: usize,
    row_bytes: usize,
    /// None only after a failed allocation (the error is kept for `check`).
    k: Option<CudaSlice<u8>>,
    v: Option<CudaSlice<u8>>,
}

impl CudaKv {
    fn new(dev: Arc<Dev>, ty: KvType, n_rows: usize, row_vals: usize) -> Result<CudaKv> {
        let row_bytes = ty.row_bytes(row_vals);
        let bytes = (row_bytes * n_rows).max(1);
        let alloc = || {
            dev.stream.alloc_zeros::<u8>(bytes).map_err(|e| {
                drv(
                    &format!(
                        "allocating {:.1} MiB of K/V",
                        bytes as f64 / (1 << 20) as f64
                    ),
                    e,
                )
            })
        };
        let (k, v) = (Some(alloc()?), Some(alloc()?));
        Ok(CudaKv {
            dev,
            ty,
            n_rows,
            row_vals,
            row_bytes,
            k,
            v,
        })
    }

    /// An empty store standing in for one that could not be allocated.
    fn failed(&self, e: Error) -> CudaKv {
        self.dev.fail(e.to_string());
        CudaKv {
            dev: self.dev.clone(),
            ty: self.ty,
            n_rows: 0,
            row_vals: self.row_vals,
            row_bytes: self.row_bytes,
            k: None,
            v: None,
        }
    }

    fn kp(&self) -> u64 {
        self.k.as_ref().map_or(0, |b| self.dev.ptr(b))
    }
    fn vp(&self) -> u64 {
        self.v.as_ref().map_or(0, |b| self.dev.ptr(b))
    }

    /// Storage units per row.
    fn row_units(&self) -> usize {
        self.row_vals / self.ty.block_len()
    }

    /// `vals` as stored bytes.
    fn encode(&self, vals: &[f32]) -> Vec<u8> {
        match self.ty {
            KvType::F32 => bytemuck::cast_slice(vals).to_vec(),
            KvType::F16 => vals
                .iter()
                .flat_map(|&x| half::f16::from_f32(x).to_bits().to_le_bytes())
                .collect(),
            KvType::Q8_0 => {
                let mut blocks =
                    vec![BlockQ8_0::default(); vals.len() / crate::backend::kvstore::QK8_0];
                quantize_q8_0(vals, &mut blocks);
                blocks
                    .iter()
                    .flat_map(|b| {
                        let mut v = b.d.to_bits().to_le_bytes().to_vec();
                        v.extend(b.qs.iter().map(|&q| q as u8));
                        v
                    })
                    .collect()
            }
        }
    }
}

impl KvStore for CudaKv {
    fn ty(&self) -> KvType {
        self.ty
    }
    fn n_rows(&self) -> usize {
        self.n_rows
    }
    fn row_vals(&self) -> usize {
        self.row_vals
    }
    fn write(&mut self, row: usize, off: usize, k: &[f32], v: &[f32]) {
        let at = row * self.row_bytes + self.ty.row_bytes(off);
        let (kb, vb) = (self.encode(k), self.encode(v));
        let d = &self.dev;
        for (bytes, buf) in [(&kb, &mut self.k), (&vb, &mut self.v)] {
            match buf {
                Some(b) if at + bytes.len() <= b.len() => {
                    d.note(
                        "writing K/V",
                        d.stream
                            .memcpy_htod(&bytes[..], &mut b.slice_mut(at..at + bytes.len())),
                    );
                }
                _ => d.fail(format!(
                    "cuda: K/V write past row {} of {}",
                    row, self.n_rows
                )),
            }
        }
    }
    fn read(&self, key: bool, base: usize, rows: &[u32], off: usize, len: usize, out: &mut [f32]) {
        if rows.is_empty() || len == 0 {
            return;
        }
        let d = &self.dev;
        let ru = self.row_units() as u64;
        let o = (off / self.ty.block_len()) as u64;
        let units: Vec<u64> = rows
            .iter()
            .map(|&r| (base as u64 + r as u64) * ru + o)
            .collect();
        let mut up = d.up.lock().unwrap_or_else(|p| p.into_inner());
        let up_p = d.upload(&mut up.u64s, &units);
        let n = rows.len() * len;
        let Some(tmp) = d.ensure(&mut up.tmp, n) else {
            return;
        };
        let tp = dp(tmp, &d.stream);
        let sp = if key { self.kp() } else { self.vp() };
        let (ty, li) = (plan::kv_code(self.ty), len as i32);
        let l = plan::Launch {
            grid: (rows.len() as u32, 1, 1),
            block: (128, 1, 1),
        };
        d.launch("kv_read_rows", &d.f.kv_read_rows, l, |a| {
            a.arg(&sp).arg(&ty).arg(&up_p).arg(&li).arg(&tp);
        });
        let tmp = up.tmp.as_ref().expect("allocated above");
        d.note(
            "reading K/V",
            d.stream.memcpy_dtoh(&tmp.slice(0..n), &mut out[..n]),
        );
    }
    fn clone_box(&self) -> Box<dyn KvStore> {
        let d = &self.dev;
        let mut c = match CudaKv::new(d.clone(), self.ty, self.n_rows, self.row_vals) {
            Ok(c) => c,
            Err(e) => return Box::new(self.failed(e)),
        };
        for (src, dst) in [(&self.k, &mut c.k), (&self.v, &mut c.v)] {
            if let (Some(s), Some(t)) = (src, dst) {
                d.note("copying K/V", d.stream.memcpy_dtod(s, t));
            }
        }
        Box::new(c)
    }
    fn resized(&self, n_rows: usize, moves: &[(u32, u32)]) -> Box<dyn KvStore> {
        let d = &self.dev;
        let c = match CudaKv::new(d.clone(), self.ty, n_rows, self.row_vals) {
            Ok(c) => c,
            Err(e) => return Box::new(self.failed(e)),
        };
        if !moves.is_empty() {
            let flat: Vec<u32> = moves.iter().flat_map(|&(a, b)| [a, b]).collect();
            let mut up = d.up.lock().unwrap_or_else(|p| p.into_inner());
            let mp = d.upload(&mut up.u32s, &flat);
            let rb = self.row_bytes as u64;
            let l = plan::Launch {
                grid: (moves.len() as u32, 1, 1),
                block: (256, 1, 1),
            };
            for (sp, dpp) in [(self.kp(), c.kp()), (self.vp(), c.vp())] {
                d.launch("kv_move_rows", &d.f.kv_move_rows, l, |a| {
                    a.arg(&sp).arg(&dpp).arg(&mp).arg(&rb);
                });
            }
        }
        Box::new(c)
    }
    fn permute(&mut self, moves: &[(u32, u32)]) {
        let moves: Vec<(u32, u32)> = moves.iter().copied().filter(|(f, t)| f != t).collect();
        if moves.is_empty() || self.k.is_none() {
            return;
        }
        // gather every source row into a scratch store (row i holds move
        // i's source), then scatter the scratch rows to their targets: two
        // launches on one stream, so the scatter reads finished rows and no
        // row is overwritten before it is read
        let d = self.dev.clone();
        let tmp = match CudaKv::new(d.clone(), self.ty, moves.len(), self.row_vals) {
            Ok(c) => c,
            Err(e) => {
                d.fail(e.to_string());
                return;
            }
        };
        // (from, to) pairs: the gather's, then the scatter's, one upload
        let n = moves.len();
        let pairs: Vec<u32> = (0..n as u32)
            .flat_map(|i| [moves[i as usize].0, i])
            .chain((0..n as u32).flat_map(|i| [i, moves[i as usize].1]))
            .collect();
        let rb = self.row_bytes as u64;
        let l = plan::Launch {
            grid: (n as u32, 1, 1),
            block: (256, 1, 1),
        };
        let mut up = d.up.lock().unwrap_or_else(|p| p.into_inner());
        let mp = d.upload(&mut up.u32s, &pairs);
        if mp == 0 {
            // the upload failed and the device noted it
            return;
        }
        for (pp, gather) in [(mp, true), (mp + 8 * n as u64, false)] {
            for (mine, theirs) in [(self.kp(), tmp.kp()), (self.vp(), tmp.vp())] {
                let (sp, dp) = if gather {
                    (mine, theirs)
                } else {
                    (theirs, mine)
                };
                d.launch("kv_move_rows", &d.f.kv_move_rows, l, |a| {
                    a.arg(&sp).arg(&dp).arg(&pp).arg(&rb);
                });
            }
        }
        drop(up);
        // the scratch is freed once the stream has run both launches
        d.note("permuting K/V rows", d.stream.synchronize());
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}
