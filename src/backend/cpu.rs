//! CPU kernels of the forward pass.
//!
//! Matrix-vector and matrix-matrix products run ggml's quantized dot products
//! (SIMD, per weight type) through `ggml-sys`, parallelized over output rows by
//! our own thread pool, with cache blocking for batched prefill. Everything
//! elementwise (RMSNorm, RoPE, SwiGLU) is plain Rust written to
//! auto-vectorize. Each kernel has a scalar reference in `crate::quant` or in
//! the tests (`tests/kernels.rs`).

use crate::backend::attn512;
use crate::backend::pool::{split, SharedMut, ThreadPool};
use crate::backend::qgemm::{self, MR, NT};
use crate::error::{Error, Result};
use crate::tensor::{DType, TensorView};
use ggml_sys::CpuTraits;
use half::f16;
use half::slice::HalfFloatSliceExt;
use std::borrow::Cow;

/// A weight matrix (n_out rows of n_in weights) in its storage type.
pub struct QMat<'a> {
    pub dtype: DType,
    /// Row length (input features).
    pub n_in: usize,
    /// Number of rows (output features).
    pub n_out: usize,
    /// (n_out, row_bytes(n_in)) raw blocks, usually borrowed from the mmap.
    pub bytes: Cow<'a, [u8]>,
    traits: CpuTraits,
}

impl std::fmt::Debug for QMat<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "QMat({}, {}x{})", self.dtype, self.n_out, self.n_in)
    }
}

impl<'a> QMat<'a> {
    /// Wrap raw row-major blocks.
    pub fn new(dtype: DType, n_in: usize, n_out: usize, bytes: Cow<'a, [u8]>) -> Result<QMat<'a>> {
        let traits = CpuTraits::of(dtype.ggml_id())
            .ok_or_else(|| Error::Other(format!("no CPU dot product for {dtype}")))?;
        if !n_in.is_multiple_of(dtype.block_len()) || bytes.len() != dtype.row_bytes(n_in) * n_out {
            return Err(Error::Other(format!(
                "matrix {n_out}x{n_in} of {dtype} does not match its {} bytes",
                bytes.len()
            )));
        }
        // The activation partner's block must divide the row too.
        let (pbl, _) = ggml_sys::block_geometry(traits.vec_dot_type);
        if !n_in.is_multiple_of(pbl) {
            return Err(Error::Other(format!(
                "row length {n_in} not a multiple of {pbl}"
            )));
        }
        Ok(QMat {
            dtype,
            n_in,
            n_out,
            bytes,
            traits,
        })
    }

    /// From a 2-D tensor view (ggml order: dims[0] = n_in).
    pub fn from_view(v: TensorView<'a>) -> Result<QMat<'a>> {
        QMat::new(v.dtype, v.n_cols(), v.n_rows(), Cow::Borrowed(v.bytes))
    }

    /// Bytes of one row.
    #[inline]
    pub fn row(&self, r: usize) -> &[u8] {
        let rb = self.dtype.row_bytes(self.n_in);
        &self.bytes[r * rb..(r + 1) * rb]
    }

    /// Bytes one activation row takes in the dot partner format.
    pub fn act_bytes(&self) -> usize {
        self.traits.act_bytes(self.n_in)
    }

    /// Dequantize row `r` into `out` (n_in floats).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        crate::quant::dequantize_row(self.dtype, self.row(r), out);
    }
}

/// Rows of weights processed per tile in batched matmul: the tile's bytes
/// stay in L1/L2 while every token's activation streams past it.
const ROW_TILE: usize = 16;

/// out (n_tok, n_out) = x (n_tok, n_in) @ W^T, W = `w` (n_out, n_in).
///
/// `act` is scratch for the quantized activations, grown as needed.
pub fn matmul(
    pool: &ThreadPool,
    w: &QMat<'_>,
    x: &[f32],
    n_tok: usize,
    out: &mut [f32],
    act: &mut Vec<u8>,
) {
    quantize_acts(pool, w, x, n_tok, act);
    matmul_q(pool, w, act, n_tok, out);
}

/// Whether matrices take their activations in the same format (so one
/// `quantize_acts` can feed all of them, e.g. Q, K and V).
pub fn same_act_format(a: &QMat<'_>, b: &QMat<'_>) -> bool {
    a.traits.vec_dot_type == b.traits.vec_dot_type && a.n_in == b.n_in
}

/// Convert x (n_tok, n_in) to `w`'s dot-partner format into `act`, split by token.
pub fn quantize_acts(pool: &ThreadPool, w: &QMat<'_>, x: &[f32], n_tok: usize, act: &mut Vec<u8>) {
    let n_in = w.n_in;
    assert_eq!(
        x.len(),
        n_tok * n_in,
        "matmul: x has {} floats, want {n_tok}x{n_in}",
        x.len()
    );
    let ab = w.act_bytes();
    if act.len() < n_tok * ab {
        act.resize(n_tok * ab, 0);
    }
    let nt = pool.n_threads();
    let acts = SharedMut::new(&mut act[..n_tok * ab]);
    let quant = |i: usize| {
        let (t0, t1) = split(n_tok, i, nt);
        for t in t0..t1 {
            // SAFETY: token rows are disjoint between threads.
            let dst = unsafe { acts.slice(t * ab, ab) };
            w.traits.quantize_act(&x[t * n_in..(t + 1) * n_in], dst);
        }
    };
    if n_tok > 1 {
        pool.run(quant);
    } else {
        quant(0);
    }
}

/// out (n_tok, n_out) = act @ W^T with activations already converted by
/// `quantize_acts` for a matrix of the same format; split by output rows
/// (tiles of ROW_TILE rows, each tile swept over every token).
pub fn matmul_q(pool: &ThreadPool, w: &QMat<'_>, act: &[u8], n_tok: usize, out: &mut [f32]) {
    if n_tok >= NT && w.dtype == DType::Q4_1 {
        if let Some(tile) = qgemm::q4_1_q8_1_tile() {
            return matmul_q_tiled(pool, w, act, n_tok, out, tile);
        }
    }
    let (n_in, n_out) = (w.n_in, w.n_out);
    assert!(out.len() >= n_tok * n_out, "matmul: out too small");
    let ab = w.act_bytes();
    let act = &act[..n_tok * ab];
    let nt = pool.n_threads();
    let o = SharedMut::new(&mut out[..n_tok * n_out]);
    pool.run(|i| {
        let n_tiles = n_out.div_ceil(ROW_TILE);
        let (tile0, tile1) = split(n_tiles, i, nt);
        for tile in tile0..tile1 {
            let r0 = tile * ROW_TILE;
            let r1 = (r0 + ROW_TILE).min(n_out);
            for t in 0..n_tok {
                let a = &act[t * ab..(t + 1) * ab];
                for r in r0..r1 {
                    let s = w.traits.dot(n_in, w.row(r), a);
                    // SAFETY: row r belongs to this thread's tiles only.
                    unsafe { o.write(t * n_out + r, s) };
                }
            }
        }
    });
}

/// `matmul_q` with a tile microkernel (MR rows × NT tokens per call): each
/// thread takes ROW_TILE-row blocks; per block, token tiles stream past its
/// MR-row micro tiles (block weights and one token tile stay in L1).
/// Ragged edges repeat the last row / token and drop the extra results.
fn matmul_q_tiled(
    pool: &ThreadPool,
    w: &QMat<'_>,
    act: &[u8],
    n_tok: usize,
    out: &mut [f32],
    tile: qgemm::TileFn,
) {
    let (n_in, n_out) = (w.n_in, w.n_out);
    assert!(out.len() >= n_tok * n_out, "matmul: out too small");
    let ab = w.act_bytes();
    let act = &act[..n_tok * ab];
    let nb = n_in / w.dtype.block_len();
    let n_tt = n_tok.div_ceil(NT);
    // token rows of tile tt (the last one padded with its last token)
    let toks = |tt: usize| -> [&[u8]; NT] {
        std::array::from_fn(|k| {
            let t = (tt * NT + k).min(n_tok - 1);
            &act[t * ab..(t + 1) * ab]
        })
    };
    // activation scales of every token tile, gathered once              (n_tt,)
    let mut a_sc = vec![qgemm::TileScales::default(); n_tt];
    {
        let nt = pool.n_threads();
        let sc = SharedMut::new(&mut a_sc[..]);
        pool.run(|i| {
            let (t0, t1) = split(n_tt, i, nt);
            // SAFETY: token tiles t0..t1 belong to this thread.
            let mine = unsafe { sc.slice(t0, t1 - t0) };
            for (tt, s) in (t0..t1).zip(mine) {
                s.q8_1(&toks(tt), nb);
            }
        });
    }
    let nt = pool.n_threads();
    let o = SharedMut::new(&mut out[..n_tok * n_out]);
    pool.run(|i| {
        let n_blocks = n_out.div_ceil(ROW_TILE);
        let (blk0, blk1) = split(n_blocks, i, nt);
        let mut w_sc = vec![qgemm::TileScales::default(); ROW_TILE / MR];
        for blk in blk0..blk1 {
            let r0 = blk * ROW_TILE;
            let r1 = (r0 + ROW_TILE).min(n_out);
            let n_micro = (r1 - r0).div_ceil(MR);
            let mut rows = [[&[] as &[u8]; MR]; ROW_TILE / MR];
            for m in 0..n_micro {
                rows[m] = std::array::from_fn(|k| w.row((r0 + m * MR + k).min(r1 - 1)));
                w_sc[m].q4_1(&rows[m], nb);
            }
            for tt in 0..n_tt {
                let a = toks(tt);
                let n_t = NT.min(n_tok - tt * NT);
                for m in 0..n_micro {
                    let res = tile(nb, &rows[m], &w_sc[m], &a, &a_sc[tt]);
                    let (rm, n_r) = (r0 + m * MR, MR.min(r1 - r0 - m * MR));
                    for j in 0..n_t {
                        let t = tt * NT + j;
                        // SAFETY: rows r0..r1 belong to this thread only.
                        let dst = unsafe { o.slice(t * n_out + rm, n_r) };
                        for (k, d) in dst.iter_mut().enumerate() {
                            *d = res[k][j];
                        }
                    }
                }
            }
        }
    });
}

/// out = x / rms(x) * w, for each of the rows of x (row length w.len()).
pub fn rmsnorm(out: &mut [f32], x: &[f32], w: &[f32], eps: f32) {
    let d = w.len();
    for (o, xr) in out.chunks_exact_mut(d).zip(x.chunks_exact(d)) {
        // Sum of squares in f64, as ggml does, so long rows lose nothing.
        let ss = (xr.iter().map(|&v| (v * v) as f64).sum::<f64>() / d as f64) as f32;
        let scale = 1.0 / (ss + eps).sqrt();
        for ((o, &xv), &wv) in o.iter_mut().zip(xr).zip(w) {
            *o = xv * scale * wv;
        }
    }
}

/// How RoPE pairs the dimensions of a head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Adjacent pairs (x0,x1),(x2,x3),... (GGUF llama: Q/K rows pre-permuted).
    Normal,
    /// Halves (x_i, x_{i+d/2}) (Qwen2 GGUF, and HF safetensors llama).
    Neox,
}

/// Precomputed RoPE parameters.
#[derive(Clone, Debug)]
pub struct Rope {
    pub style: RopeStyle,
    /// Rotated dimensions per head (≤ head_dim).
    pub n_rot: usize,
    /// base^(-2/n_rot): ratio between the angles of consecutive pairs.
    pub theta_scale: f32,
    /// Optional per-pair frequency divisors (`rope_freqs.weight`, Llama 3.1).
    pub freq_factors: Option<Vec<f32>>,
    /// Linear position scale (1 / rope scaling factor).
    pub pos_scale: f32,
}

impl Rope {
    /// Build from base frequency, rotated dims, optional per-dim factors
    /// (`rope_freqs.weight`, Llama-3.1 style) and a linear scale.
    pub fn new(
        style: RopeStyle,
        n_rot: usize,
        base: f32,
        freq_factors: Option<&[f32]>,
        pos_scale: f32,
    ) -> Rope {
        assert!(n_rot <= 256, "at most 256 rotated dims");
        Rope {
            style,
            n_rot,
            theta_scale: base.powf(-2.0 / n_rot as f32),
            freq_factors: freq_factors.map(|f| f.to_vec()),
            pos_scale,
        }
    }

    /// Rotate `n_heads` heads of `head_dim` in `x` (n_heads*head_dim) at `pos`.
    ///
    /// The angle of pair i is built as ggml builds it (theta_0 = pos, then
    /// repeated multiplication by base^(-2/n_rot)) rather than with powf per
    /// pair: the two differ in the last bits, and this model family turns
    /// last-bit differences into visible logit differences.
    pub fn apply(&self, x: &mut [f32], n_heads: usize, head_dim: usize, pos: usize) {
        self.apply_at(x, n_heads, head_dim, pos as f32)
    }

    /// `apply` at any real position, negative included (R(-p) undoes R(p);
    /// rotations compose: R(a)R(b) = R(a+b)).
    pub fn apply_at(&self, x: &mut [f32], n_heads: usize, head_dim: usize, pos: f32) {
        let half = self.n_rot / 2;
        let mut cs = [(0f32, 0f32); 128];
        let mut theta = pos;
        for i in 0..half {
            let t = match &self.freq_factors {
                Some(ff) => theta / ff[i],
                None => theta,
            } * self.pos_scale;
            cs[i] = (t.cos(), t.sin());
            theta *= self.theta_scale;
        }
        for h in 0..n_heads {
            let hx = &mut x[h * head_dim..(h + 1) * head_dim];
            for i in 0..half {
                let (c, s) = cs[i];
                let (a, b) = match self.style {
                    RopeStyle::Normal => (2 * i, 2 * i + 1),
                    RopeStyle::Neox => (i, i + half),
                };
                let (x0, x1) = (hx[a], hx[b]);
                hx[a] = x0 * c - x1 * s;
                hx[b] = x0 * s + x1 * c;
            }
        }
    }
}

/// gate = silu(gate) * up, elementwise.
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        let x = *g;
        *g = x / (1.0 + (-x).exp()) * u;
    }
}

/// x += y, elementwise.
pub fn add(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// Attention of one query head over `n` cached entries: online softmax
/// (running max M and sum S) over scores q·k_j·scale, values accumulated in
/// f32. As in llama.cpp's CPU flash attention, the query is rounded to f16
/// and scores use ggml's f16 SIMD dot product against the f16 keys.
///
/// `key(j)` / `val(j)` return entry j's head slice (head_dim f16 values);
/// `scores`, if given, receives the scaled raw scores (n,). Writes out
/// (head_dim,) and returns the row's (max, sum of exp(s - max)), from which
/// probabilities are exp(s_j - max) / sum. Memory is O(head_dim) whatever n
/// is: no score matrix is ever built.
pub fn attend_head<'k>(
    f16dot: &CpuTraits,
    q: &[f32],
    n: usize,
    key: impl Fn(usize) -> &'k [f16],
    val: impl Fn(usize) -> &'k [f16],
    scale: f32,
    out: &mut [f32],
    mut scores: Option<&mut [f32]>,
) -> (f32, f32) {
    let hd = q.len();
    let mut q16 = [f16::ZERO; 256];
    let q16 = &mut q16[..hd];
    q16.convert_from_f32_slice(q);
    let q16b: &[u8] = bytemuck::cast_slice(q16);
    out.fill(0.0);
    let (mut m, mut sum) = (f32::NEG_INFINITY, 0f32);
    for j in 0..n {
        let s = f16dot.dot(hd, bytemuck::cast_slice(key(j)), q16b) * scale;
        if let Some(sc) = scores.as_deref_mut() {
            sc[j] = s;
        }
        let mut vs = 1f32;
        if s > m {
            // new maximum: rescale what was accumulated so far
            let ms = (m - s).exp();
            m = s;
            for o in out.iter_mut() {
                *o *= ms;
            }
            sum *= ms;
        } else {
            vs = (s - m).exp();
        }
        axpy_f16(out, vs, val(j));
        sum += vs;
    }
    let inv = if sum == 0.0 { 0.0 } else { 1.0 / sum };
    for o in out.iter_mut() {
        *o *= inv;
    }
    (m, sum)
}

/// A cached K or V head row as stored (f32, f16 or q8_0 blocks; f32 also
/// for rows pre-converted for a prefill chunk). Kernels are generic over it,
/// so each cache type gets its own monomorphized loop.
pub trait KvRow {
    /// The row as f32: converted into `buf`, or borrowed as is.
    fn as_f32<'a>(&'a self, buf: &'a mut [f32]) -> &'a [f32];

    /// The row itself if it is stored as f16 (SIMD kernels widen it in
    /// registers instead of converting through a buffer).
    #[inline]
    fn as_f16(&self) -> Option<&[f16]> {
        None
    }
}

impl KvRow for [f16] {
    #[inline]
    fn as_f32<'a>(&'a self, buf: &'a mut [f32]) -> &'a [f32] {
        let b = &mut buf[..self.len()];
        self.convert_to_f32_slice(b);
        b
    }

    #[inline]
    fn as_f16(&self) -> Option<&[f16]> {
        Some(self)
    }
}

impl KvRow for [crate::kv::BlockQ8_0] {
    #[inline]
    fn as_f32<'a>(&'a self, buf: &'a mut [f32]) -> &'a [f32] {
        let b = &mut buf[..self.len() * crate::kv::QK8_0];
        crate::kv::dequantize_q8_0(self, b);
        b
    }
}

impl KvRow for [f32] {
    #[inline]
    fn as_f32<'a>(&'a self, _buf: &'a mut [f32]) -> &'a [f32] {
        self
    }
}

/// Most query heads sharing one KV head that `attend_group` handles.
pub const MAX_GROUP: usize = 16;

/// Grouped-query attention for the `g` query heads that share one KV head:
/// each cached key and value row is converted from f16 once and used by all
/// of them (the decode hot loop; `attend_head` is its per-head reference).
/// Numerics as `attend_head`: query rounded to f16, scores accumulated in
/// f32, online softmax, f32 value accumulator.
///
/// q: (g, head_dim); out: (g, head_dim); `scores`, if given: (g, n) raw
/// scaled scores. Returns each head's (max, sum of exp(s - max)) in `stats`.
pub fn attend_group<'k, R: KvRow + ?Sized + 'k>(
    q: &[f32],
    g: usize,
    n: usize,
    key: impl Fn(usize) -> &'k R,
    val: impl Fn(usize) -> &'k R,
    scale: f32,
    out: &mut [f32],
    mut scores: Option<&mut [f32]>,
    stats: &mut [(f32, f32)],
) {
    let hd = q.len() / g;
    assert!(g <= MAX_GROUP && hd <= 256 && q.len() == g * hd && out.len() == g * hd);
    // query rounded to f16, as llama.cpp's kernel does, kept in f32
    let mut qr = [0f32; MAX_GROUP * 256];
    for (d, &x) in qr.iter_mut().zip(q) {
        *d = f16::from_f32(x).to_f32();
    }
    let mut m = [f32::NEG_INFINITY; MAX_GROUP];
    let mut sum = [0f32; MAX_GROUP];
    out.fill(0.0);
    let mut k32 = [0f32; 256];
    let mut v32 = [0f32; 256];
    for j in 0..n {
        let kr = key(j).as_f32(&mut k32[..hd]);
        let vr = val(j).as_f32(&mut v32[..hd]);
        for h in 0..g {
            let qh = &qr[h * hd..(h + 1) * hd];
            let s = dot_f32(qh, kr) * scale;
            if let Some(sc) = scores.as_deref_mut() {
                sc[h * n + j] = s;
            }
            let o = &mut out[h * hd..(h + 1) * hd];
            let mut vs = 1f32;
            if s > m[h] {
                // new maximum: rescale what was accumulated so far
                let ms = (m[h] - s).exp();
                m[h] = s;
                for x in o.iter_mut() {
                    *x *= ms;
                }
                sum[h] *= ms;
            } else {
                vs = (s - m[h]).exp();
            }
            for (x, &v) in o.iter_mut().zip(vr) {
                *x += vs * v;
            }
            sum[h] += vs;
        }
    }
    for h in 0..g {
        let inv = if sum[h] == 0.0 { 0.0 } else { 1.0 / sum[h] };
        for x in out[h * hd..(h + 1) * hd].iter_mut() {
            *x *= inv;
        }
        stats[h] = (m[h], sum[h]);
    }
}

/// Prefill attention for the `g` query heads of one KV head over `n` keys,
/// two-pass instead of online: scores for all keys at once from keys stored
/// transposed (`kt`: (head_dim, stride), key j's dimension d at
/// `kt[d * stride + j]`), so the score loop vectorizes across keys with no
/// horizontal sums; then max, exp and the value sum. Same outputs as
/// `attend_group` (up to float summation order; tested in tests/kernels.rs).
///
/// q: (g, head_dim); v(j): value row j (head_dim); `sc`: (g, n) scratch that
/// holds the normalized attention probabilities on return; out: (g,
/// head_dim); stats: (g,) (max score, sum of exp(s - max)).
pub fn attend_prefill_group<'k>(
    q: &[f32],
    g: usize,
    n: usize,
    kt: &[f32],
    stride: usize,
    val: impl Fn(usize) -> &'k [f32],
    scale: f32,
    sc: &mut [f32],
    out: &mut [f32],
    stats: &mut [(f32, f32)],
) {
    attend_prefill_group_seg(q, &[n], g, n, kt, stride, val, scale, sc, out, stats)
}

/// `attend_prefill_group` with one query per key segment: keys
/// `seg_end[s-1]..seg_end[s]` are scored against query `s` (q: (n_seg, g,
/// head_dim)). Used by `--pos-mode cache`, where keys stored at absolute
/// RoPE positions meet a query rotated per segment (see `model::llama`).
/// With one segment it is `attend_prefill_group`, operation for operation.
pub fn attend_prefill_group_seg<'k>(
    q: &[f32],
    seg_end: &[usize],
    g: usize,
    n: usize,
    kt: &[f32],
    stride: usize,
    val: impl Fn(usize) -> &'k [f32],
    scale: f32,
    sc: &mut [f32],
    out: &mut [f32],
    stats: &mut [(f32, f32)],
) {
    let ns = seg_end.len();
    let hd = q.len() / (g * ns);
    assert!(hd <= 256 && q.len() == ns * g * hd && out.len() == g * hd && sc.len() >= g * n);
    assert!(
        seg_end.last().is_some_and(|&e| e >= n),
        "segments must cover the keys"
    );
    assert!(n == 0 || kt.len() >= (hd - 1) * stride + n);
    if ns == 1 && hd.is_multiple_of(LANES) {
        type F<'k, V> =
            fn(&[f32], usize, &[f32], usize, &V, f32, &mut [f32], &mut [f32], &mut [(f32, f32)]);
        let f: F<'_, _> = match g {
            1 => prefill_group::<1, _>,
            2 => prefill_group::<2, _>,
            3 => prefill_group::<3, _>,
            4 => prefill_group::<4, _>,
            5 => prefill_group::<5, _>,
            6 => prefill_group::<6, _>,
            7 => prefill_group::<7, _>,
            8 => prefill_group::<8, _>,
            _ => {
                return prefill_group_dyn(
                    q,
                    seg_end,
                    n,
                    kt,
                    stride,
                    &val,
                    scale,
                    sc,
                    out,
                    &mut stats[..g],
                )
            }
        };
        return f(q, n, kt, stride, &val, scale, sc, out, &mut stats[..g]);
    }
    prefill_group_dyn(
        q,
        seg_end,
        n,
        kt,
        stride,
        &val,
        scale,
        sc,
        out,
        &mut stats[..g],
    );
}

/// Lanes of the register tiles of `prefill_group` (one 512-bit vector).
const LANES: usize = 16;

/// `attend_prefill_group` for a group of G heads (head_dim a multiple of
/// LANES): scores for LANES keys at a time with all G heads' accumulators
/// in registers (each key row loaded once for the group), then the value
/// sum LANES dimensions at a time over all keys. Every score and output
/// element is summed in the same order as `prefill_group_dyn`, so the two
/// agree bit for bit.
fn prefill_group<'k, const G: usize, V: Fn(usize) -> &'k [f32]>(
    q: &[f32],
    n: usize,
    kt: &[f32],
    stride: usize,
    val: &V,
    scale: f32,
    sc: &mut [f32],
    out: &mut [f32],
    stats: &mut [(f32, f32)],
) {
    let hd = q.len() / G;
    // queries rounded to f16, as elsewhere                       (G, hd)
    let mut qr = [[0f32; 256]; G];
    for h in 0..G {
        for d in 0..hd {
            qr[h][d] = f16::from_f32(q[h * hd + d]).to_f32();
        }
    }
    // scores s[h][j] = Σ_d q[h][d] * K[j][d], attn512::TILE keys at a
    // time where the CPU has the tiles, then LANES at a time
    let simd = attn512::available();
    let mut j0 = 0;
    while simd && j0 + attn512::TILE <= n {
        attn512::score_tile::<G>(&qr, hd, kt, stride, j0, scale, n, sc);
        j0 += attn512::TILE;
    }
    while j0 < n {
        let w = (n - j0).min(LANES);
        let mut acc = [[0f32; LANES]; G];
        if w == LANES {
            for d in 0..hd {
                let k: &[f32; LANES] = kt[d * stride + j0..][..LANES].try_into().unwrap();
                for h in 0..G {
                    let qd = qr[h][d];
                    for l in 0..LANES {
                        acc[h][l] += qd * k[l];
                    }
                }
            }
        } else {
            for d in 0..hd {
                let k = &kt[d * stride + j0..d * stride + j0 + w];
                for h in 0..G {
                    let qd = qr[h][d];
                    for l in 0..w {
                        acc[h][l] += qd * k[l];
                    }
                }
            }
        }
        for h in 0..G {
            for l in 0..w {
                sc[h * n + j0 + l] = acc[h][l] * scale;
            }
        }
        j0 += w;
    }
    // softmax weights
    let mut sum = [0f32; G];
    for h in 0..G {
        let s = &mut sc[h * n..(h + 1) * n];
        let m = s.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        for x in s.iter_mut() {
            *x = (*x - m).exp();
            sum[h] += *x;
        }
        stats[h] = (m, sum[h]);
    }
    // value sum o[h][d] = Σ_j p[h][j] * V[j][d], attn512::TILE dimensions
    // at a time where the CPU has the tiles, then LANES at a time
    let mut c0 = 0;
    while simd && (c0 * LANES) + attn512::TILE <= hd {
        attn512::value_tile::<G, V>(val, n, c0 * LANES, hd, sc, out);
        c0 += attn512::TILE / LANES;
    }
    for c in c0..hd / LANES {
        let mut acc = [[0f32; LANES]; G];
        for j in 0..n {
            let v: &[f32; LANES] = val(j)[c * LANES..(c + 1) * LANES].try_into().unwrap();
            for h in 0..G {
                let p = sc[h * n + j];
                for l in 0..LANES {
                    acc[h][l] += p * v[l];
                }
            }
        }
        for h in 0..G {
            out[h * hd + c * LANES..h * hd + (c + 1) * LANES].copy_from_slice(&acc[h]);
        }
    }
    for h in 0..G {
        let inv = if sum[h] == 0.0 { 0.0 } else { 1.0 / sum[h] };
        for a in out[h * hd..(h + 1) * hd].iter_mut() {
            *a *= inv;
        }
        // leave the normalized probabilities for scorers that asked for them
        for x in sc[h * n..(h + 1) * n].iter_mut() {
            *x *= inv;
        }
    }
}

/// `attend_prefill_group_seg` for any group size and any key segments, one
/// head at a time (the reference of the register-tiled `prefill_group`,
/// which it equals bit for bit with one segment; q: (n_seg, g, head_dim),
/// stats: (g,)).
pub fn prefill_group_dyn<'k, V: Fn(usize) -> &'k [f32]>(
    q: &[f32],
    seg_end: &[usize],
    n: usize,
    kt: &[f32],
    stride: usize,
    val: &V,
    scale: f32,
    sc: &mut [f32],
    out: &mut [f32],
    stats: &mut [(f32, f32)],
) {
    let g = stats.len();
    let hd = q.len() / (g * seg_end.len());
    for h in 0..g {
        let s = &mut sc[h * n..(h + 1) * n];
        s.fill(0.0);
        // scores: s[j] = Σ_d q[d] * K[j][d], query rounded to f16 as elsewhere
        let mut j0 = 0;
        for (si, &j1) in seg_end.iter().enumerate() {
            let j1 = j1.min(n);
            if j1 <= j0 {
                continue;
            }
            let qs = &q[si * g * hd..(si + 1) * g * hd];
            let ss = &mut s[j0..j1];
            for d in 0..hd {
                let qd = f16::from_f32(qs[h * hd + d]).to_f32();
                let row = &kt[d * stride + j0..d * stride + j1];
                for (x, &k) in ss.iter_mut().zip(row) {
                    *x += qd * k;
                }
            }
            j0 = j1;
        }
        let mut m = f32::NEG_INFINITY;
        for x in s.iter_mut() {
            *x *= scale;
            m = m.max(*x);
        }
        // softmax weights and the value sum
        let o = &mut out[h * hd..(h + 1) * hd];
        o.fill(0.0);
        let mut sum = 0f32;
        for (j, x) in s.iter_mut().enumerate() {
            let p = (*x - m).exp();
            *x = p;
            sum += p;
            for (a, &v) in o.iter_mut().zip(val(j)) {
                *a += p * v;
            }
        }
        let inv = if sum == 0.0 { 0.0 } else { 1.0 / sum };
        for a in o.iter_mut() {
            *a *= inv;
        }
        // leave the normalized probabilities for scorers that asked for them
        for x in s.iter_mut() {
            *x *= inv;
        }
        stats[h] = (m, sum);
    }
}

/// Decode attention for the `g` query heads of one KV head when a scorer
/// wants the probabilities: two passes over the stored rows (scores, then one
/// exp per score shared by the value sum and the export) instead of the
/// online pass plus a second exp per score. `sc` (g, n) holds the
/// normalized probabilities on return. Same outputs as `attend_group`.
/// Generic over the row type (f32, f16, q8_0): one loop per cache type.
pub fn attend_group_probs<'k, R: KvRow + ?Sized + 'k>(
    q: &[f32],
    g: usize,
    n: usize,
    key: impl Fn(usize) -> &'k R,
    val: impl Fn(usize) -> &'k R,
    scale: f32,
    sc: &mut [f32],
    out: &mut [f32],
    stats: &mut [(f32, f32)],
) {
    attend_group_probs_seg(q, &[n], g, n, key, val, scale, sc, out, stats)
}

/// `attend_group_probs` with one query per key segment: keys
/// `seg_end[s-1]..seg_end[s]` are scored against query `s` (q: (n_seg, g,
/// head_dim)); see `attend_prefill_group_seg`. One segment is
/// `attend_group_probs`, operation for operation.
///
/// Runs the AVX-512 kernel (`decode512`) where the CPU has it and the shape
/// is supported, else the portable `attend_group_probs_seg_ref`. The choice
/// depends only on the CPU and (g, head_dim), never on whether a scorer
/// reads the probabilities.
pub fn attend_group_probs_seg<'k, R: KvRow + ?Sized + 'k>(
    q: &[f32],
    seg_end: &[usize],
    g: usize,
    n: usize,
    key: impl Fn(usize) -> &'k R,
    val: impl Fn(usize) -> &'k R,
    scale: f32,
    sc: &mut [f32],
    out: &mut [f32],
    stats: &mut [(f32, f32)],
) {
    let hd = out.len() / g.max(1);
    if super::decode512::supports(g, hd) && super::decode512::available() {
        super::decode512::attend(q, seg_end, g, n, key, val, scale, sc, out, stats)
    } else {
        attend_group_probs_seg_ref(q, seg_end, g, n, key, val, scale, sc, out, stats)
    }
}

/// The portable decode kernel (scalar libm `exp`, rows converted to f32
/// through a buffer): the fallback of `attend_group_probs_seg` and the
/// reference its SIMD path is tested against.
pub fn attend_group_probs_seg_ref<'k, R: KvRow + ?Sized + 'k>(
    q: &[f32],
    seg_end: &[usize],
    g: usize,
    n: usize,
    key: impl Fn(usize) -> &'k R,
    val: impl Fn(usize) -> &'k R,
    scale: f32,
    sc: &mut [f32],
    out: &mut [f32],
    stats: &mut [(f32, f32)],
) {
    let ns = seg_end.len();
    let hd = q.len() / (g * ns);
    assert!(
        g <= MAX_GROUP
            && hd <= 256
            && q.len() == ns * g * hd
            && out.len() == g * hd
            && sc.len() >= g * n
            && seg_end.last().is_some_and(|&e| e >= n)
    );
    let mut qr = [0f32; MAX_GROUP * 256];
    let mut k32 = [0f32; 256];
    let mut m = [f32::NEG_INFINITY; MAX_GROUP];
    // pass 1: scores (each key row converted once for the whole group)
    let mut j0 = 0;
    for (si, &j1) in seg_end.iter().enumerate() {
        let j1 = j1.min(n);
        if j1 <= j0 {
            continue;
        }
        for (d, &x) in qr.iter_mut().zip(&q[si * g * hd..(si + 1) * g * hd]) {
            *d = f16::from_f32(x).to_f32();
        }
        for j in j0..j1 {
            let kr = key(j).as_f32(&mut k32[..hd]);
            for h in 0..g {
                let x = dot_f32(&qr[h * hd..(h + 1) * hd], kr) * scale;
                sc[h * n + j] = x;
                m[h] = m[h].max(x);
            }
        }
        j0 = j1;
    }
    // pass 2: weights
    let mut sum = [0f32; MAX_GROUP];
    for h in 0..g {
        for x in sc[h * n..(h + 1) * n].iter_mut() {
            *x = (*x - m[h]).exp();
            sum[h] += *x;
        }
    }
    // pass 3: value sum (each value row converted once)
    out.fill(0.0);
    let mut v32 = [0f32; 256];
    for j in 0..n {
        let vr = val(j).as_f32(&mut v32[..hd]);
        for h in 0..g {
            let p = sc[h * n + j];
            for (a, &v) in out[h * hd..(h + 1) * hd].iter_mut().zip(vr) {
                *a += p * v;
            }
        }
    }
    for h in 0..g {
        let inv = if sum[h] == 0.0 { 0.0 } else { 1.0 / sum[h] };
        for a in out[h * hd..(h + 1) * hd].iter_mut() {
            *a *= inv;
        }
        for x in sc[h * n..(h + 1) * n].iter_mut() {
            *x *= inv;
        }
        stats[h] = (m[h], sum[h]);
    }
}

/// f32 dot product with 8 independent partial sums (vectorizes).
#[inline(always)]
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let mut s = [0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        for j in 0..8 {
            s[j] += a[c * 8 + j] * b[c * 8 + j];
        }
    }
    let mut tail = 0f32;
    for j in chunks * 8..a.len() {
        tail += a[j] * b[j];
    }
    s.iter().sum::<f32>() + tail
}

/// Dot product of an f32 query with an f16 key (head_dim ≤ 256).
#[inline]
pub fn dot_f16(q: &[f32], k: &[f16]) -> f32 {
    let mut buf = [0f32; 256];
    let kf = &mut buf[..k.len()];
    k.convert_to_f32_slice(kf);
    let mut s = [0f32; 8];
    let chunks = q.len() / 8;
    for c in 0..chunks {
        for j in 0..8 {
            s[j] += q[c * 8 + j] * kf[c * 8 + j];
        }
    }
    let mut tail = 0f32;
    for j in chunks * 8..q.len() {
        tail += q[j] * kf[j];
    }
    s.iter().sum::<f32>() + tail
}

/// out += a * v (v in f16).
#[inline]
pub fn axpy_f16(out: &mut [f32], a: f32, v: &[f16]) {
    let mut buf = [0f32; 256];
    let vf = &mut buf[..v.len()];
    v.convert_to_f32_slice(vf);
    for (o, &x) in out.iter_mut().zip(vf.iter()) {
        *o += a * x;
    }
}
