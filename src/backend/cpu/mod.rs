//! The CPU backend: host buffers, a persistent thread pool, ggml's
//! quantized dot products plus our own tiled kernels.
//!
//! Files by job:
//! - `pool`: the spinning thread pool every parallel op runs on;
//! - `isa`: the SIMD level kernels run at (CPU detection, `KVRUN_CPU`);
//! - `matmul`: `QMat` and the row-parallel quantized matrix products;
//! - `qgemm_x86`: the Q4_1 × Q8_1 tile kernel (AVX-512 VNNI) for prefill;
//! - `qgemm_lanes`: Q4_K, Q5_K, Q6_K, Q3_K, Q2_K and IQ4_XS × Q8_K with 8 weight rows in the
//!   SIMD lanes (AVX2; AVX-512 VNNI), prefill and decode;
//! - `qgemm_k_decode`: their decoding kernels with 512-bit registers (the
//!   AVX-512 levels), the same arithmetic bit for bit;
//! - `x8`: matrices repacked 8 rows at a time at load: the container and
//!   the choice of kernel; `q4k_x8` (Q4_K and Q5_K), `q6k_x8` (Q6_K,
//!   Q3_K and Q2_K), `iq4xs_x8` (IQ4_XS), `q4_1_x8` (Q4_1) and `b32_x8`
//!   (Q8_0, Q4_0, Q5_0, IQ4_NL): the layouts and their decoding kernels
//!   (AVX-512 VNNI, AVX2);
//! - `qgemm_q8_0_tokens`: Q8_0 × Q8_0 with the tokens in the lanes
//!   (prefill; VNNI, and AVX2 over nibble planes) and its decoding
//!   kernels, one arithmetic of its own at every level, which Q4_0,
//!   Q5_0 and IQ4_NL share through their exact Q8_0 form (`b32_x8`);
//! - `elementwise`: RMSNorm, SwiGLU, residual adds;
//! - `attention`: one layer's attention step (prefill and decode paths,
//!   in-cache positions, the probability export);
//! - `prefill_attn_kernels` (+ `prefill_avx512` tiles) and `decode_attn`
//!   (+ `decode_avx512`, `decode_avx2`): the per-KV-head kernels;
//! - `kv_store`: K/V rows in host memory;
//! - `proj_norm`: CriticalKV's projected value norm (register-blocked
//!   AVX2 / AVX-512 kernels over a packed W_O block);
//! - `reference`: the scalar reference kernels the parity tests use.
//!
//! Every op gives the same result for any thread count: work is split by
//! rows whose arithmetic does not depend on the split.

pub mod amx_emu;
pub mod attention;
pub mod b32_x8;
pub mod decode_attn;
pub mod decode_avx2;
pub mod decode_avx512;
pub mod elementwise;
pub mod gemv_f16;
pub mod iq4xs_x8;
pub mod isa;
pub mod kv_store;
pub mod matmul;
pub mod mem;
pub mod pool;
pub mod prefill_attn_kernels;
pub mod prefill_avx512;
pub mod proj_norm;
pub mod q4_1_x8;
pub mod q4k_x8;
pub mod q6k_x8;
pub mod qgemm_amx;
#[cfg(target_arch = "x86_64")]
mod qgemm_k_decode;
pub mod qgemm_lanes;
pub mod qgemm_q8_0_tokens;
pub mod qgemm_x86;
pub mod reference;
pub mod x8;

pub use matmul::QMat;

use crate::backend::{AttnStep, Backend, KvAccess, KvStore, KvType, Rope, WeightSink, HOST_LOADER};
use crate::error::Result;
use crate::tensor::DType;
use elementwise::{add, geglu, rmsnorm, rmsnorm_inplace, swiglu};
use matmul::{matmul_q, quantize_acts, same_act_format};
use pool::{split, SharedMut, ThreadPool};
use std::borrow::Cow;

/// The CPU backend: `n_threads` threads (the caller included).
#[derive(Debug)]
pub struct Cpu {
    pub pool: ThreadPool,
}

impl Cpu {
    /// A backend running on `n_threads` threads.
    pub fn new(n_threads: usize) -> Cpu {
        Cpu {
            pool: ThreadPool::new(n_threads),
        }
    }

    /// This machine's read bandwidth in GB/s with the pool's threads: a
    /// 512 MiB buffer in transparent huge pages (first written, so every
    /// page is resident; from 4 KiB pages the same loop read a third less
    /// on a VM where the decoding itself then read more than that) summed
    /// after a warm-up pass, each thread streaming its own contiguous part,
    /// pass after pass for about a second (at least 8 passes), every other
    /// pass asking for the lines [`mem::INTEL_AHEAD`] bytes on as the decoding
    /// kernels do on Intel (on a Xeon VM that read more; on other machines it may
    /// not); the fastest pass is the figure (`kvrun bench`'s roofline). A
    /// pass takes 10-20 ms, so on a shared machine a mean over a few of
    /// them swings with whoever else reads memory at that moment (a 3-pass
    /// mean read 25-60 GB/s on one VM within an hour, below what the
    /// decoding itself then read); the best pass is what the machine can
    /// deliver to these threads.
    pub fn read_bandwidth(&self) -> f64 {
        use std::sync::atomic::{AtomicU64, Ordering};
        let n = 64usize << 20; // u64 words
                               // in huge pages, as the repacked weights are (see `mem`)
        let mut buf: Vec<u64> = mem::huge_capacity(n);
        buf.extend(0..n as u64);
        let nt = self.pool.n_threads();
        let sink = AtomicU64::new(0);
        let pass = |ahead: bool| {
            self.pool.run(|t| {
                let (a, b) = pool::split(n, t, nt);
                sink.fetch_add(stream_sum(&buf[a..b], ahead), Ordering::Relaxed);
            })
        };
        pass(false);
        let start = std::time::Instant::now();
        let mut best = f64::INFINITY;
        let mut passes = 0;
        while passes < 8 || start.elapsed().as_secs_f64() < 1.0 {
            let t = std::time::Instant::now();
            pass(passes % 2 == 1);
            best = best.min(t.elapsed().as_secs_f64());
            passes += 1;
        }
        std::hint::black_box(sink.load(Ordering::Relaxed));
        (8 * n) as f64 / best / 1e9
    }
}

/// The wrapping sum of `words`, read front to back at the memory's pace
/// (the bandwidth probe's loop). Explicit 32-byte loads on x86: left to
/// the auto-vectorizer, a target-cpu=native build for AVX-512 Zen 4 turned
/// the plain loop into gathers that read 5× slower than the memory (a 4.4
/// GB/s "roofline" on a 26 GB/s core). With `ahead`, each 64 bytes read
/// also asks for the line [`mem::INTEL_AHEAD`] bytes on ([`mem::prefetch_at`]).
fn stream_sum(words: &[u64], ahead: bool) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (detected just above; not the kernel
        // level, which `KVRUN_CPU` may cap: this is a probe of the memory).
        return unsafe {
            if ahead {
                stream_sum_avx2::<true>(words)
            } else {
                stream_sum_avx2::<false>(words)
            }
        };
    }
    let _ = ahead;
    stream_sum_ref(words)
}

/// [`stream_sum`] in plain Rust (eight independent sums).
fn stream_sum_ref(words: &[u64]) -> u64 {
    let mut acc = [0u64; 8];
    let chunks = words.chunks_exact(8);
    let tail = chunks
        .remainder()
        .iter()
        .fold(0u64, |s, &x| s.wrapping_add(x));
    for c in chunks {
        for (x, &y) in acc.iter_mut().zip(c) {
            *x = x.wrapping_add(y);
        }
    }
    acc.iter().fold(tail, |s, &x| s.wrapping_add(x))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn stream_sum_avx2<const AHEAD: bool>(words: &[u64]) -> u64 {
    use std::arch::x86_64::*;
    let chunks = words.chunks_exact(8);
    let tail = chunks
        .remainder()
        .iter()
        .fold(0u64, |s, &x| s.wrapping_add(x));
    let (mut a0, mut a1) = (_mm256_setzero_si256(), _mm256_setzero_si256());
    for c in chunks {
        if AHEAD {
            mem::prefetch_at(c.as_ptr().cast(), 64, mem::INTEL_AHEAD);
        }
        // SAFETY: c holds 8 u64 (64 bytes); unaligned loads.
        unsafe {
            a0 = _mm256_add_epi64(a0, _mm256_loadu_si256(c.as_ptr().cast()));
            a1 = _mm256_add_epi64(a1, _mm256_loadu_si256(c.as_ptr().add(4).cast()));
        }
    }
    let mut lanes = [0u64; 4];
    // SAFETY: lanes holds 32 bytes.
    unsafe { _mm256_storeu_si256(lanes.as_mut_ptr().cast(), _mm256_add_epi64(a0, a1)) };
    lanes.iter().fold(tail, |s, &x| s.wrapping_add(x))
}

/// Where the CPU reads the weight matrices it does not repack from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightPages {
    /// In place, from the file's memory map: nothing is copied and the
    /// pages are the page cache's (shared with other processes mapping
    /// the same file), but they are 4 KiB pages.
    Mapped,
    /// Copied at load into memory asked to be 2 MiB transparent huge
    /// pages, the map's own pages released (so the RSS still counts each
    /// weight once). Decoding streams every weight once per token, and on
    /// the VMs measured a streaming read ran faster from huge pages (see
    /// [`mem`]).
    Huge,
}

/// Which matrices the CPU loader may repack for its kernels (`--repack`):
/// one flag per repacked layout ([`x8::LAYOUTS`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Repack([bool; x8::LAYOUTS.len()]);

impl Repack {
    /// Every layout the kernel level has a kernel for (the default).
    pub const ALL: Repack = Repack([true; x8::LAYOUTS.len()]);
    /// None: every matrix is read as GGUF stores it.
    pub const NONE: Repack = Repack([false; x8::LAYOUTS.len()]);

    /// Whether matrices of `dtype` may be repacked.
    pub fn allows(self, dtype: DType) -> bool {
        x8::LAYOUTS
            .iter()
            .position(|&d| d == dtype)
            .is_some_and(|i| self.0[i])
    }

    /// `on`, `off`, or the types to repack joined with `+` (`q4_k`,
    /// `q4_k+q6_k`; any case).
    pub fn parse(s: &str) -> std::result::Result<Repack, String> {
        match s.trim() {
            "on" | "1" | "true" => return Ok(Repack::ALL),
            "off" | "0" | "false" => return Ok(Repack::NONE),
            _ => {}
        }
        let mut r = Repack::NONE;
        for name in s.split('+').map(str::trim) {
            let i = x8::LAYOUTS
                .iter()
                .position(|d| d.to_string().eq_ignore_ascii_case(name))
                .ok_or_else(|| {
                    let names: Vec<String> = x8::LAYOUTS.iter().map(|d| d.to_string()).collect();
                    format!(
                        "'{name}' is not on, off or a repacked type ({})",
                        names.join(", ")
                    )
                })?;
            r.0[i] = true;
        }
        Ok(r)
    }
}

impl std::fmt::Display for Repack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if *self == Repack::ALL {
            return f.write_str("on");
        }
        if *self == Repack::NONE {
            return f.write_str("off");
        }
        let on: Vec<String> = x8::LAYOUTS
            .iter()
            .filter(|&&d| self.allows(d))
            .map(|d| d.to_string())
            .collect();
        f.write_str(&on.join("+"))
    }
}

/// Takes weights for the CPU without a running backend: matrices are
/// repacked where the kernel level has a layout for them and `repack`
/// allows it ([`QMat::repack_for`]), and the others are read where
/// `pages` says.
#[derive(Debug, Clone, Copy)]
pub struct Loader {
    pub pages: WeightPages,
    pub repack: Repack,
}

impl crate::backend::WeightSink<Cpu> for Loader {
    fn matrix<'w>(
        &self,
        dtype: DType,
        n_in: usize,
        n_out: usize,
        bytes: Cow<'w, [u8]>,
    ) -> Result<QMat<'w>> {
        // rearranged for this level's products where it has a layout for
        // them (Q4_K×8 and Q6_K×8 from AVX2 up), else copied into huge pages if asked
        let m = QMat::new(dtype, n_in, n_out, bytes)?;
        let m = if self.repack.allows(dtype) {
            m.repack_for(isa::level())
        } else {
            m
        };
        Ok(match self.pages {
            WeightPages::Huge => m.into_huge_pages(),
            WeightPages::Mapped => m,
        })
    }
    fn table<'w>(
        &self,
        dtype: DType,
        n_in: usize,
        n_out: usize,
        bytes: Cow<'w, [u8]>,
    ) -> Result<QMat<'w>> {
        QMat::new(dtype, n_in, n_out, bytes)
    }
    fn vector(&self, v: Vec<f32>) -> Result<Vec<f32>> {
        Ok(v)
    }
}

/// Matmul and attention scratch of one sequence.
#[derive(Debug, Default)]
pub struct CpuScratch {
    /// activations in the weights' dot-partner format
    act: Vec<u8>,
    /// attention scratch
    attn: attention::AttnScratch,
}

/// Run `f(t0, t1)` over the token rows `0..n` split across the pool's
/// threads (inline when there is one row, as in decoding: no sync cost).
fn par_rows(pool: &ThreadPool, n: usize, f: impl Fn(usize, usize) + Sync) {
    if n < 2 {
        f(0, n);
        return;
    }
    let nt = pool.n_threads();
    pool.run(|i| {
        let (t0, t1) = split(n, i, nt);
        if t0 < t1 {
            f(t0, t1);
        }
    });
}

impl Backend for Cpu {
    type Mat<'w> = QMat<'w>;
    type Vector = Vec<f32>;
    type Act = Vec<f32>;
    type Scratch = CpuScratch;

    fn name(&self) -> String {
        "cpu".into()
    }

    fn n_threads(&self) -> usize {
        self.pool.n_threads()
    }

    fn host_pool(&self) -> &ThreadPool {
        &self.pool
    }

    fn matrix<'w>(
        &self,
        dtype: DType,
        n_in: usize,
        n_out: usize,
        bytes: Cow<'w, [u8]>,
    ) -> Result<QMat<'w>> {
        // as the host loader takes them (repacked where the level has a
        // layout for its products)
        WeightSink::<Cpu>::matrix(&HOST_LOADER, dtype, n_in, n_out, bytes)
    }

    fn table<'w>(
        &self,
        dtype: DType,
        n_in: usize,
        n_out: usize,
        bytes: Cow<'w, [u8]>,
    ) -> Result<QMat<'w>> {
        WeightSink::<Cpu>::table(&HOST_LOADER, dtype, n_in, n_out, bytes)
    }

    fn vector(&self, v: Vec<f32>) -> Result<Vec<f32>> {
        Ok(v)
    }

    fn act(&self, len: usize) -> Vec<f32> {
        vec![0.0; len]
    }

    fn scratch(&self) -> CpuScratch {
        CpuScratch::default()
    }

    fn kv_store(&self, ty: KvType, n_rows: usize, row_vals: usize) -> Result<Box<dyn KvStore>> {
        Ok(Box::new(kv_store::CpuKv::new(ty, n_rows, row_vals)))
    }

    fn read(&self, a: &Vec<f32>, r: std::ops::Range<usize>, out: &mut Vec<f32>) {
        out.extend_from_slice(&a[r]);
    }

    fn host<'a>(&self, a: &'a Vec<f32>, r: std::ops::Range<usize>) -> Cow<'a, [f32]> {
        Cow::Borrowed(&a[r])
    }

    fn mat_row(&self, m: &QMat<'_>, r: usize, out: &mut [f32]) {
        m.dequantize_row(r, out);
    }

    fn mat_shape(&self, m: &QMat<'_>) -> (usize, usize) {
        (m.n_out, m.n_in)
    }

    fn mat_bytes(&self, m: &QMat<'_>, out: &mut Vec<u8>) -> Option<DType> {
        out.clear();
        out.extend_from_slice(&m.gguf_bytes());
        Some(m.dtype)
    }

    fn embed(&self, table: &QMat<'_>, tokens: &[u32], x: &mut Vec<f32>) {
        let dim = table.n_in;
        for (i, &t) in tokens.iter().enumerate() {
            table.dequantize_row(t as usize, &mut x[i * dim..(i + 1) * dim]);
        }
    }

    fn rmsnorm(
        &self,
        x: &Vec<f32>,
        first: usize,
        w: &Vec<f32>,
        eps: f32,
        n: usize,
        out: &mut Vec<f32>,
    ) {
        let dim = w.len();
        let x = &x[first * dim..(first + n) * dim];
        let xb = SharedMut::new(&mut out[..n * dim]);
        par_rows(&self.pool, n, |t0, t1| {
            // SAFETY: token rows t0..t1 belong to this thread.
            let o = unsafe { xb.slice(t0 * dim, (t1 - t0) * dim) };
            rmsnorm(o, &x[t0 * dim..t1 * dim], w, eps);
        });
    }

    fn matmul(
        &self,
        sc: &mut CpuScratch,
        ws: &[&QMat<'_>],
        x: &Vec<f32>,
        n: usize,
        outs: &mut [&mut Vec<f32>],
    ) {
        let pool = &self.pool;
        let x = &x[..n * ws[0].n_in];
        if ws.iter().all(|w| same_act_format(ws[0], w)) {
            // one activation conversion feeds all of them
            quantize_acts(pool, ws[0], x, n, &mut sc.act);
            for (w, o) in ws.iter().zip(outs.iter_mut()) {
                matmul_q(pool, w, &sc.act, n, o);
            }
        } else {
            for (w, o) in ws.iter().zip(outs.iter_mut()) {
                quantize_acts(pool, w, x, n, &mut sc.act);
                matmul_q(pool, w, &sc.act, n, o);
            }
        }
    }

    fn matmul_host(
        &self,
        sc: &mut CpuScratch,
        w: &QMat<'_>,
        x: &Vec<f32>,
        n: usize,
        out: &mut [f32],
    ) {
        let pool = &self.pool;
        quantize_acts(pool, w, &x[..n * w.n_in], n, &mut sc.act);
        matmul_q(pool, w, &sc.act, n, out);
    }

    fn add_bias(&self, x: &mut Vec<f32>, b: &Vec<f32>, n: usize) {
        let d = b.len();
        for row in x[..n * d].chunks_exact_mut(d) {
            add(row, b);
        }
    }

    fn copy(&self, dst: &mut Vec<f32>, src: &Vec<f32>, len: usize) {
        dst.clear();
        dst.extend_from_slice(&src[..len]);
    }

    fn rope(&self, rope: &Rope, q: &mut Vec<f32>, k: &mut Vec<f32>, st: &AttnStep) {
        let (n, hd) = (st.n, st.head_dim);
        let (q_dim, kv_dim) = (st.n_heads * hd, st.n_kv_heads * hd);
        let qs = SharedMut::new(&mut q[..n * q_dim]);
        let ks = SharedMut::new(&mut k[..n * kv_dim]);
        par_rows(&self.pool, n, |t0, t1| {
            for i in t0..t1 {
                let pos = st.pos0 + i;
                // SAFETY: token rows t0..t1 belong to this thread.
                let (q, k) = unsafe { (qs.slice(i * q_dim, q_dim), ks.slice(i * kv_dim, kv_dim)) };
                rope.apply(q, st.n_heads, hd, pos);
                rope.apply(k, st.n_kv_heads, hd, pos);
            }
        });
    }

    fn kv_write(
        &self,
        kv: &mut dyn KvAccess,
        layer: usize,
        slots: &[u32],
        k: &Vec<f32>,
        v: &Vec<f32>,
        n: usize,
        kv_dim: usize,
    ) {
        for i in 0..n {
            let r = i * kv_dim..(i + 1) * kv_dim;
            kv.write_token(layer, i, n, slots, &k[r.clone()], &v[r]);
        }
    }

    fn begin_attention(&self, sc: &mut CpuScratch, kv: &dyn KvAccess, st: &AttnStep) {
        attention::begin(&self.pool, &mut sc.attn, kv, st)
    }

    fn attention(
        &self,
        sc: &mut CpuScratch,
        kv: &dyn KvAccess,
        st: &AttnStep,
        layer: usize,
        rope: &Rope,
        q: &Vec<f32>,
        q_raw: &Vec<f32>,
        out: &mut Vec<f32>,
    ) {
        attention::layer(&self.pool, &mut sc.attn, kv, st, layer, rope, q, q_raw, out)
    }

    fn end_attention(&self, sc: &mut CpuScratch, n_slots: usize, mass: &mut [f32]) {
        attention::end(&self.pool, &mut sc.attn, n_slots, mass)
    }

    fn add_rmsnorm(&self, x: &mut Vec<f32>, b: &mut Vec<f32>, w: &Vec<f32>, eps: f32, n: usize) {
        let dim = w.len();
        let xs = SharedMut::new(&mut x[..n * dim]);
        let xb = SharedMut::new(&mut b[..n * dim]);
        par_rows(&self.pool, n, |t0, t1| {
            // SAFETY: token rows t0..t1 belong to this thread.
            let (x, b) = unsafe {
                (
                    xs.slice(t0 * dim, (t1 - t0) * dim),
                    xb.slice(t0 * dim, (t1 - t0) * dim),
                )
            };
            add(x, b);
            rmsnorm(b, x, w, eps);
        });
    }

    fn swiglu(&self, gate: &mut Vec<f32>, up: &Vec<f32>, n: usize, width: usize) {
        let hb = SharedMut::new(&mut gate[..n * width]);
        let hb2 = &up[..n * width];
        par_rows(&self.pool, n, |t0, t1| {
            // SAFETY: token rows t0..t1 belong to this thread.
            let g = unsafe { hb.slice(t0 * width, (t1 - t0) * width) };
            swiglu(g, &hb2[t0 * width..t1 * width]);
        });
    }

    fn geglu(&self, gate: &mut Vec<f32>, up: &Vec<f32>, n: usize, width: usize) {
        let hb = SharedMut::new(&mut gate[..n * width]);
        let hb2 = &up[..n * width];
        par_rows(&self.pool, n, |t0, t1| {
            // SAFETY: token rows t0..t1 belong to this thread.
            let g = unsafe { hb.slice(t0 * width, (t1 - t0) * width) };
            geglu(g, &hb2[t0 * width..t1 * width]);
        });
    }

    fn rmsnorm_rows(&self, x: &mut Vec<f32>, w: &Vec<f32>, eps: f32, rows: usize) {
        let d = w.len();
        let xs = SharedMut::new(&mut x[..rows * d]);
        par_rows(&self.pool, rows, |r0, r1| {
            // SAFETY: rows r0..r1 belong to this thread.
            let x = unsafe { xs.slice(r0 * d, (r1 - r0) * d) };
            rmsnorm_inplace(x, w, eps);
        });
    }

    fn scale(&self, x: &mut Vec<f32>, s: f32, len: usize) {
        elementwise::scale(&mut x[..len], s);
    }

    fn gather_rows(&self, src: &Vec<f32>, rows: &[u32], width: usize, dst: &mut Vec<f32>) {
        for (i, &r) in rows.iter().enumerate() {
            let r = r as usize;
            dst[i * width..(i + 1) * width].copy_from_slice(&src[r * width..(r + 1) * width]);
        }
    }

    fn scatter_rows(
        &self,
        dst: &mut Vec<f32>,
        src: &Vec<f32>,
        rows: &[u32],
        weights: &[f32],
        width: usize,
    ) {
        for (i, (&r, &w)) in rows.iter().zip(weights).enumerate() {
            let r = r as usize;
            let (d, x) = (
                &mut dst[r * width..(r + 1) * width],
                &src[i * width..(i + 1) * width],
            );
            for (d, &x) in d.iter_mut().zip(x) {
                *d = x * w;
            }
        }
    }

    fn sum_groups(&self, src: &Vec<f32>, k: usize, n: usize, width: usize, dst: &mut Vec<f32>) {
        for t in 0..n {
            let d = &mut dst[t * width..(t + 1) * width];
            d.copy_from_slice(&src[t * k * width..(t * k + 1) * width]);
            for j in 1..k {
                add(d, &src[(t * k + j) * width..(t * k + j + 1) * width]);
            }
        }
    }

    fn add(&self, x: &mut Vec<f32>, y: &Vec<f32>, n: usize, width: usize) {
        let xs = SharedMut::new(&mut x[..n * width]);
        let y = &y[..n * width];
        par_rows(&self.pool, n, |t0, t1| {
            // SAFETY: token rows t0..t1 belong to this thread.
            let x = unsafe { xs.slice(t0 * width, (t1 - t0) * width) };
            add(x, &y[t0 * width..t1 * width]);
        });
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn stream_sum_matches_its_reference() {
        let words: Vec<u64> = (0..1003u64)
            .map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15))
            .collect();
        for n in [0, 1, 7, 8, 9, 64, 1003] {
            for ahead in [false, true] {
                assert_eq!(
                    super::stream_sum(&words[..n], ahead),
                    super::stream_sum_ref(&words[..n])
                );
            }
        }
    }
}
