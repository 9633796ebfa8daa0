//! Quantized matrix products on the CPU: `QMat` (a weight matrix in its
//! GGUF storage type, usually borrowed from the memory map; Q4_K, Q5_K,
//! Q6_K, Q3_K, Q2_K, IQ4_XS, Q4_0, Q5_0, IQ4_NL and Q4_1 repacked 8 rows at a time from AVX2
//! up, Q8_0 from AVX-512 VNNI up, [`X8`]) and the row-parallel products
//! that run ggml's per-type `vec_dot` (SIMD) through `ggml-sys`, with cache
//! blocking for batched prefill, and our own tile kernels where the CPU has
//! them: Q4_1 (`qgemm_x86`), the K-quants (`qgemm_lanes`, the `x8`
//! layouts), Q8_0, Q4_0, Q5_0 and IQ4_NL (`qgemm_q8_0_tokens` for prefill,
//! on rows expanded to Q8_0; `b32_x8` for decoding).

use super::isa::{self, Level};
use super::pool::{split, Chunks, Runs, SharedMut, ThreadPool};
use super::qgemm_x86::{self, MR, NT};
use super::x8::{self, X8};
use super::{b32_x8, q4_1_x8, qgemm_amx, qgemm_lanes, qgemm_q8_0_tokens};
use crate::error::{Error, Result};
use crate::tensor::{DType, TensorView};
use ggml_sys::CpuTraits;
use std::borrow::Cow;

/// A weight matrix (n_out rows of n_in weights) in its storage type.
pub struct QMat<'a> {
    pub dtype: DType,
    /// Row length (input features).
    pub n_in: usize,
    /// Number of rows (output features).
    pub n_out: usize,
    /// (n_out, row_bytes(n_in)) raw blocks, usually borrowed from the mmap;
    /// empty once repacked.
    bytes: Cow<'a, [u8]>,
    /// The same rows repacked for this machine's kernels (`repack_for`).
    x8: Option<X8>,
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
            x8: None,
            traits,
        })
    }

    /// The matrix in the layout the kernels of SIMD level `level` read
    /// fastest: Q4_K, Q5_K, Q6_K, Q4_0, Q5_0, IQ4_NL and Q4_1 with a multiple of 8 rows
    /// are repacked 8 rows at a time from AVX2 up, Q8_0 from AVX-512 VNNI
    /// up ([`X8`], the same bytes rearranged; mapped pages of the original
    /// are released, so the weights are not resident twice); anything else
    /// stays as it is. Results are the same bit for bit.
    pub fn repack_for(self, level: Level) -> QMat<'a> {
        if !self.n_out.is_multiple_of(qgemm_lanes::ROWS)
            || !x8::has_kernel(self.dtype, level)
            || self.x8.is_some()
        {
            return self;
        }
        let nb = self.n_in / self.dtype.block_len();
        let x8 = X8::new(self.dtype, &self.bytes, self.n_out, nb);
        if let Cow::Borrowed(b) = self.bytes {
            crate::format::mmap::release(b);
        }
        QMat {
            bytes: Cow::Borrowed(&[]),
            x8: Some(x8),
            ..self
        }
    }

    /// The matrix read from a copy in memory asked to be huge pages
    /// ([`super::mem::huge_capacity`]) when it reads its rows in place
    /// from a file's map; the copied pages of the map are released (see
    /// `crate::format::mmap::release`). Anything else (repacked, owned,
    /// or in an anonymous map, which has no file to fault the pages back
    /// from) is returned as it is. The bytes are the same.
    pub fn into_huge_pages(self) -> QMat<'a> {
        let Cow::Borrowed(b) = self.bytes else {
            return self;
        };
        if self.x8.is_some() || b.is_empty() || !crate::format::mmap::in_file_map(b) {
            return self;
        }
        let mut v: Vec<u8> = super::mem::huge_capacity(b.len());
        // 2 MiB at a time, each part's map pages released once copied, so
        // the weights are resident about once even during the copy (an
        // output matrix can be half a GiB); parts end on 2 MiB addresses,
        // so only the matrix's own first and last partial pages stay
        const PART: usize = 2 << 20;
        let mut i = 0;
        while i < b.len() {
            let end =
                (((b.as_ptr() as usize + i) / PART + 1) * PART - b.as_ptr() as usize).min(b.len());
            v.extend_from_slice(&b[i..end]);
            crate::format::mmap::release(&b[i..end]);
            i = end;
        }
        QMat {
            bytes: Cow::Owned(v),
            ..self
        }
    }

    /// Whether the matrix reads its rows in place from the source it was
    /// made from (usually the memory map), not from a copy.
    pub fn is_borrowed(&self) -> bool {
        self.x8.is_none() && matches!(self.bytes, Cow::Borrowed(_))
    }

    /// Whether the rows are repacked (`repack_for`).
    pub fn is_repacked(&self) -> bool {
        self.x8.is_some()
    }

    /// All rows as GGUF stores them, (n_out, row bytes): borrowed, or
    /// gathered when repacked.
    pub fn gguf_bytes(&self) -> Cow<'_, [u8]> {
        let Some(x8) = &self.x8 else {
            return Cow::Borrowed(&self.bytes);
        };
        let rb = self.dtype.row_bytes(self.n_in);
        let mut bytes = vec![0u8; self.n_out * rb];
        for (r, row) in bytes.chunks_exact_mut(rb).enumerate() {
            x8.row_into(r, row);
        }
        Cow::Owned(bytes)
    }

    /// A copy in the GGUF row layout (the fallback of a kernel level
    /// without a kernel for the repacked layout).
    fn unpacked(&self) -> QMat<'static> {
        QMat {
            dtype: self.dtype,
            n_in: self.n_in,
            n_out: self.n_out,
            bytes: Cow::Owned(self.gguf_bytes().into_owned()),
            x8: None,
            traits: self.traits,
        }
    }

    /// From a 2-D tensor view (ggml order: dims[0] = n_in).
    pub fn from_view(v: TensorView<'a>) -> Result<QMat<'a>> {
        QMat::new(v.dtype, v.n_cols(), v.n_rows(), Cow::Borrowed(v.bytes))
    }

    /// Bytes of one row as GGUF stores it (gathered when repacked).
    pub fn row(&self, r: usize) -> Cow<'_, [u8]> {
        match &self.x8 {
            Some(x8) => {
                let mut out = vec![0u8; self.dtype.row_bytes(self.n_in)];
                x8.row_into(r, &mut out);
                Cow::Owned(out)
            }
            None => Cow::Borrowed(self.plain_row(r)),
        }
    }

    /// Bytes of one row of a matrix that is not repacked (the kernels'
    /// drivers, after `matmul_q_at` has taken the repacked ones).
    #[inline]
    fn plain_row(&self, r: usize) -> &[u8] {
        debug_assert!(self.x8.is_none());
        let rb = self.dtype.row_bytes(self.n_in);
        &self.bytes[r * rb..(r + 1) * rb]
    }

    /// Bytes one activation row takes in the dot partner format.
    pub fn act_bytes(&self) -> usize {
        self.traits.act_bytes(self.n_in)
    }

    /// Dequantize row `r` into `out` (n_in floats).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        crate::quant::dequantize_row(self.dtype, &self.row(r), out);
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
/// (tiles of ROW_TILE rows, each tile swept over every token). Runs the
/// kernels of this process's SIMD level (`isa::level()`).
pub fn matmul_q(pool: &ThreadPool, w: &QMat<'_>, act: &[u8], n_tok: usize, out: &mut [f32]) {
    matmul_q_at(pool, w, act, n_tok, out, isa::level());
}

/// The K-quant kernel (Q4_K, Q5_K, Q6_K, Q3_K, Q2_K) of `N` tokens the engine runs at
/// SIMD level `level` where the CPU has it: decoding (`N` = 1) at the
/// AVX-512 levels takes the 512-bit kernels of `qgemm_k_decode` (two runs
/// per instruction), everything else `qgemm_lanes`'s; `None` for other types
/// and for levels without a kernel. Every choice follows
/// `qgemm_lanes::lanes_scalar` bit for bit.
pub fn k_quant_kernel<const N: usize>(
    dtype: DType,
    level: Level,
) -> Option<qgemm_lanes::LanesFn<N>> {
    #[cfg(target_arch = "x86_64")]
    if N == 1 && level >= Level::Avx512 && level <= isa::detected() {
        if let Some(k) = super::qgemm_k_decode::kernel::<N>(dtype, level.vnni()) {
            return Some(k);
        }
    }
    qgemm_lanes::lanes_for::<N>(dtype, level)
}

/// [`matmul_q`] with the kernels of SIMD level `level` (those above what
/// the CPU runs are skipped), so one process can run every path.
pub fn matmul_q_at(
    pool: &ThreadPool,
    w: &QMat<'_>,
    act: &[u8],
    n_tok: usize,
    out: &mut [f32],
    level: Level,
) {
    // K-quant prefill on AMX tiles (the same sums and float steps as every
    // kernel below, bit for bit)
    if n_tok >= 2 && level >= Level::Amx && level <= isa::detected() && qgemm_amx::supports(w.dtype)
    {
        return matmul_k_amx(pool, w, act, n_tok, out);
    }
    if let Some(x8) = &w.x8 {
        if w.dtype == DType::Q4_1 {
            // Q4_1×8: its own decoding kernel; prefill runs the row-major
            // tile on each row block gathered back (both ggml's lanes)
            if n_tok == 1 {
                if let Some(one) = q4_1_x8::decode_for(level) {
                    return matvec_x8(pool, w, x8, act, out, one);
                }
            } else if let Some(tile) = qgemm_x86::q4_1_tile_for(level) {
                return matmul_q_tiled(pool, w, act, n_tok, out, Tile::Q4_1(tile));
            }
            return matmul_q_at(pool, &w.unpacked(), act, n_tok, out, level);
        }
        if b32_x8::is_b32(w.dtype) {
            // Q8_0×8, Q4_0×8, Q5_0×8, IQ4_NL×8: their own decoding
            // kernels; prefill expands each row block to Q8_0 rows
            if let (Some(one), Some(prefill)) = (
                b32_x8::decode_for(w.dtype, level),
                qgemm_q8_0_tokens::prefill_for(w.dtype, level),
            ) {
                if n_tok == 1 {
                    return matvec_b32(pool, w, act, out, B32Kernel::Packed(one));
                }
                if level >= Level::Amx && level <= isa::detected() {
                    return matmul_b32_amx(pool, w, act, n_tok, out, level);
                }
                return matmul_q8_0_tokens(pool, w, act, n_tok, out, prefill);
            }
            return matmul_q_at(pool, &w.unpacked(), act, n_tok, out, level);
        }
        // Q4_K×8, Q5_K×8, Q6_K×8, Q3_K×8, Q2_K×8, IQ4_XS×8: their own decoding kernels;
        // prefill packs micro tiles from them
        if let (Some(one), Some(packed)) = (
            x8::decode_for(w.dtype, level),
            qgemm_lanes::packed_for(w.dtype, level),
        ) {
            if n_tok == 1 {
                return matvec_x8(pool, w, x8, act, out, one);
            }
            return matmul_k_packed(pool, w, act, n_tok, out, packed);
        }
        // a level without kernels for the layout (a test asking for it)
        return matmul_q_at(pool, &w.unpacked(), act, n_tok, out, level);
    }
    if n_tok == 1 && w.dtype == DType::Q4_1 {
        if let Some(one) = qgemm_x86::q4_1_decode_for(level) {
            return matvec_k(pool, w, act, out, one);
        }
    }
    if n_tok >= NT && w.dtype == DType::Q4_1 {
        if let Some(tile) = qgemm_x86::q4_1_tile_for(level) {
            return matmul_q_tiled(pool, w, act, n_tok, out, Tile::Q4_1(tile));
        }
    }
    // K-quants with the rows in the lanes (AVX2 without VNNI): every token
    // count takes this arithmetic, so a prompt's result does not depend on
    // its chunking
    if let (Some(tile), Some(one)) = (
        k_quant_kernel::<{ qgemm_lanes::TOKS }>(w.dtype, level),
        k_quant_kernel::<1>(w.dtype, level),
    ) {
        if n_tok == 1 {
            return matvec_k(pool, w, act, out, one);
        }
        // the rows unpacked once per row block (sized for L2) instead of
        // once per token tile
        if let Some(packed) = qgemm_lanes::packed_for(w.dtype, level) {
            return matmul_k_packed(pool, w, act, n_tok, out, packed);
        }
        return matmul_q_tiled(pool, w, act, n_tok, out, Tile::Lanes(tile));
    }
    // Q8_0 from AVX2 up: tokens in the lanes (prefill) and its own
    // decoding, one arithmetic for every token count and level
    if w.dtype == DType::Q8_0 {
        if n_tok >= 2 && level >= Level::Amx && level <= isa::detected() {
            return matmul_b32_amx(pool, w, act, n_tok, out, level);
        }
        if let (Some(prefill), Some(one)) = (
            qgemm_q8_0_tokens::prefill_for(w.dtype, level),
            qgemm_q8_0_tokens::decode_for(level),
        ) {
            return if n_tok == 1 {
                matvec_k(pool, w, act, out, one)
            } else {
                matmul_q8_0_tokens(pool, w, act, n_tok, out, prefill)
            };
        }
    }
    // Q4_0, Q5_0 and IQ4_NL (not repacked) from AVX2 up: Q8_0's
    // arithmetic on their exact Q8_0 form, prefill through Q8_0's tiles
    if matches!(w.dtype, DType::Q4_0 | DType::Q5_0 | DType::IQ4NL) {
        if let (Some(one), Some(prefill)) = (
            b32_x8::decode_rows_for(w.dtype, level),
            qgemm_q8_0_tokens::prefill_for(w.dtype, level),
        ) {
            return if n_tok == 1 {
                matvec_b32(pool, w, act, out, B32Kernel::Rows(one))
            } else if level >= Level::Amx && level <= isa::detected() {
                matmul_b32_amx(pool, w, act, n_tok, out, level)
            } else {
                matmul_q8_0_tokens(pool, w, act, n_tok, out, prefill)
            };
        }
    }
    let (n_in, n_out) = (w.n_in, w.n_out);
    assert!(out.len() >= n_tok * n_out, "matmul: out too small");
    let ab = w.act_bytes();
    let act = &act[..n_tok * ab];
    // one run of 16-row tiles per thread, the back half of a run stolen by
    // a thread that is done ([`Runs`]): this path is mostly decoding (one
    // token, ggml's `vec_dot` row by row), where handing out tiles one at a
    // time from a shared counter cost more than it saved (SmolLM2 Q4_1:
    // 110 against 140 t/s), while stealing gained 2.5% over a fixed split
    // (10.7 against 10.4 GB/s, measured within one run)
    let nt = pool.n_threads();
    let o = SharedMut::new(&mut out[..n_tok * n_out]);
    let n_tiles = n_out.div_ceil(ROW_TILE);
    let runs = Runs::new(n_tiles, nt);
    pool.run(|i| {
        while let Some(tile) = runs.next(i) {
            let r0 = tile * ROW_TILE;
            let r1 = (r0 + ROW_TILE).min(n_out);
            for t in 0..n_tok {
                let a = &act[t * ab..(t + 1) * ab];
                for r in r0..r1 {
                    let s = w.traits.dot(n_in, w.plain_row(r), a);
                    // SAFETY: `runs` hands tile `tile` (rows r0..r1) to one thread only.
                    unsafe { o.write(t * n_out + r, s) };
                }
            }
        }
    });
}

/// Q8_0 × Q8_0 (`n_tok` ≥ 2) with a `qgemm_q8_0_tokens` prefill tile: the
/// token tiles are packed once, in the form that tile reads (threads split
/// them; the last one padded with its last token), then the threads take
/// `LANES_ROW_TILE`-row blocks as they come free, pack their micro tiles'
/// side data (scales, corrections) and stream every packed token tile past
/// them (weights from L2). Q8_0×8 row blocks are read in place by the
/// VNNI tile's Q8_0×8 form; Q4_0 and Q5_0 rows (repacked or not) are first
/// expanded (gathered) into Q8_0 rows, once per row block.
fn matmul_q8_0_tokens(
    pool: &ThreadPool,
    w: &QMat<'_>,
    act: &[u8],
    n_tok: usize,
    out: &mut [f32],
    prefill: qgemm_q8_0_tokens::Prefill,
) {
    use qgemm_q8_0_tokens::{pack_side, Rows, ROWS, SIDE_BYTES, TOKS};
    let qgemm_q8_0_tokens::Prefill {
        rows: form,
        pack,
        act_bytes,
        tile,
    } = prefill;
    let level = isa::level();
    let (n_in, n_out) = (w.n_in, w.n_out);
    assert!(out.len() >= n_tok * n_out, "matmul: out too small");
    let ab = w.act_bytes();
    let act = &act[..n_tok * ab];
    let nb = n_in / w.dtype.block_len();
    let nt = pool.n_threads();
    let n_tt = n_tok.div_ceil(TOKS);
    let tile_bytes = nb * act_bytes;
    // the packed token tiles  (n_tt, nb, act_bytes)
    let mut packed = vec![0u8; n_tt * tile_bytes];
    let p = SharedMut::new(&mut packed[..]);
    pool.run(|i| {
        let (t0, t1) = split(n_tt, i, nt);
        for tt in t0..t1 {
            let toks: [&[u8]; TOKS] = token_tile(act, ab, n_tok, TOKS, tt);
            // SAFETY: token tile tt belongs to this thread only.
            pack(nb, &toks, unsafe { p.slice(tt * tile_bytes, tile_bytes) });
        }
    });
    let packed = &packed[..];
    let o = SharedMut::new(&mut out[..n_tok * n_out]);
    let blocks = Chunks::new(n_out.div_ceil(LANES_ROW_TILE));
    // a Q8_0×8 matrix is read in place by the VNNI tile's Q8_0×8 form
    let direct = match (&w.x8, w.dtype, form) {
        (Some(x8), DType::Q8_0, Rows::Signed) => {
            qgemm_q8_0_tokens::tile_x8_for(level).map(|t| (x8, t))
        }
        _ => None,
    };
    let in_place = (w.dtype == DType::Q8_0 && w.x8.is_none()) || direct.is_some();
    let qrb = nb * b32_x8::Q8_0_BYTES;
    pool.run(|_| {
        let side_bytes = nb * SIDE_BYTES;
        // the side data of a block's micro tiles  (LANES_ROW_TILE / ROWS, nb, SIDE_BYTES)
        let mut side = vec![0u8; LANES_ROW_TILE / ROWS * side_bytes];
        // a block's rows as Q8_0 where they are not in place  (LANES_ROW_TILE, qrb)
        let mut q8 = vec![0u8; if in_place { 0 } else { LANES_ROW_TILE * qrb }];
        while let Some(blk) = blocks.next() {
            let r0 = blk * LANES_ROW_TILE;
            let r1 = (r0 + LANES_ROW_TILE).min(n_out);
            let n_micro = (r1 - r0).div_ceil(ROWS);
            if let Some((x8, tile_x8)) = direct {
                // micro tile m: row block r0 / ROWS + m of the repacked
                // matrix (whose rows are a multiple of ROWS)
                let groups = |m: usize| x8.block(r0 / ROWS + m);
                for m in 0..n_micro {
                    let sd = &mut side[m * side_bytes..(m + 1) * side_bytes];
                    qgemm_q8_0_tokens::pack_side_x8(nb, groups(m), sd);
                }
                for tt in 0..n_tt {
                    let a = &packed[tt * tile_bytes..(tt + 1) * tile_bytes];
                    let n_t = TOKS.min(n_tok - tt * TOKS);
                    for m in 0..n_micro {
                        let sd = &side[m * side_bytes..(m + 1) * side_bytes];
                        let res = tile_x8(nb, groups(m), sd, a);
                        let rm = r0 + m * ROWS;
                        // SAFETY: block blk (rows r0..r1) was handed to this thread only.
                        unsafe { store_tile(o, n_out, &res, (rm, ROWS), (tt * TOKS, n_t)) };
                    }
                }
                continue;
            }
            if !in_place {
                // Q4_0/Q5_0 rows to the tile's form
                let expand = |dt, row: &[u8], dst: &mut [u8]| match form {
                    Rows::Signed => b32_x8::row_to_q8_0_at(level, dt, nb, row, dst),
                    Rows::Unsigned => b32_x8::row_to_unsigned_at(level, dt, nb, row, dst),
                };
                match &w.x8 {
                    // whole row blocks (LANES_ROW_TILE and a repacked
                    // matrix's rows are multiples of 8), expanded straight
                    // from their groups
                    Some(x8) => {
                        let rows = &mut q8[..(r1 - r0) * qrb];
                        for (i, dst) in rows.chunks_exact_mut(b32_x8::ROWS * qrb).enumerate() {
                            let blk = r0 / b32_x8::ROWS + i;
                            if w.dtype == DType::Q8_0 {
                                x8.block_rows_into(blk, dst, qrb);
                            } else {
                                let signed = matches!(form, Rows::Signed);
                                x8.block_to_q8_0_at(blk, level, dst, qrb, signed);
                            }
                        }
                    }
                    None => {
                        for (r, dst) in (r0..r1).zip(q8.chunks_exact_mut(qrb)) {
                            expand(w.dtype, w.plain_row(r), dst);
                        }
                    }
                }
            }
            let q8 = &q8[..];
            let row = |r: usize| -> &[u8] {
                if in_place {
                    w.plain_row(r)
                } else {
                    &q8[(r - r0) * qrb..(r - r0 + 1) * qrb]
                }
            };
            // micro tile m: rows r0 + m·ROWS .. (the last row repeated)
            let mut rows = [[&[] as &[u8]; ROWS]; LANES_ROW_TILE / ROWS];
            for m in 0..n_micro {
                rows[m] = std::array::from_fn(|k| row((r0 + m * ROWS + k).min(r1 - 1)));
                pack_side(
                    nb,
                    &rows[m],
                    &mut side[m * side_bytes..(m + 1) * side_bytes],
                );
            }
            for tt in 0..n_tt {
                let a = &packed[tt * tile_bytes..(tt + 1) * tile_bytes];
                let n_t = TOKS.min(n_tok - tt * TOKS);
                for m in 0..n_micro {
                    let res = tile(nb, &rows[m], &side[m * side_bytes..(m + 1) * side_bytes], a);
                    let rm = r0 + m * ROWS;
                    // SAFETY: block blk (rows r0..r1) was handed to this thread only.
                    unsafe {
                        store_tile(o, n_out, &res, (rm, ROWS.min(r1 - rm)), (tt * TOKS, n_t))
                    };
                }
            }
        }
    });
}

/// The most bytes of packed K-quant rows a thread keeps (in L2) per row
/// block (at least one micro tile): wider rows take fewer rows per block.
/// On Zen 4 with 128 tokens, packing beat the unpacked kernel at every width
/// tried, 16-row blocks of 18944-wide rows included (Q4_K 124-138 against
/// 111-113 GMAC/s, Q6_K 138-141 against 91-103).
const PACKED_BLOCK_BYTES: usize = 512 << 10;

/// K-quant × Q8_K (`n_tok` ≥ 2) over packed micro tiles
/// (`qgemm_lanes::packed_for`): the threads take blocks of `micro` micro
/// tiles (8 rows each) as they come free, pack them once (transposed,
/// unpacked, scales decoded) and stream every token tile past them; the
/// same arithmetic as the unpacked kernels, bit for bit.
fn matmul_k_packed(
    pool: &ThreadPool,
    w: &QMat<'_>,
    act: &[u8],
    n_tok: usize,
    out: &mut [f32],
    packed_fns: qgemm_lanes::Packed,
) {
    use qgemm_lanes::{PACKED_BYTES, ROWS, TOKS};
    let (n_in, n_out) = (w.n_in, w.n_out);
    assert!(out.len() >= n_tok * n_out, "matmul: out too small");
    let ab = w.act_bytes();
    let act = &act[..n_tok * ab];
    let nb = n_in / w.dtype.block_len();
    let n_tt = n_tok.div_ceil(TOKS);
    let toks = |tt: usize| -> [&[u8]; TOKS] { token_tile(act, ab, n_tok, TOKS, tt) };
    // micro tiles per row block: as many as fit PACKED_BLOCK_BYTES
    let micro = (PACKED_BLOCK_BYTES / (nb * PACKED_BYTES)).clamp(1, MAX_MICRO);
    let block_rows = micro * ROWS;
    let blocks = Chunks::new(n_out.div_ceil(block_rows));
    let qgemm_lanes::Packed {
        pack,
        pack_x8,
        kernel,
    } = packed_fns;
    // a repacked matrix's micro tiles are its row blocks (8 rows, and
    // block_rows is a multiple of 8), packed straight from their groups:
    // gathering the rows back first cost the 7B's prefill in chunks of 32
    // tokens (a budgeted cache) 19% (22.5 against 27.8 t/s row-major)
    let map = w.x8.as_ref().map(|x8| x8::group_map(x8.dtype));
    let o = SharedMut::new(&mut out[..n_tok * n_out]);
    pool.run(|_| {
        let pb = nb * PACKED_BYTES;
        // this thread's packed micro tiles  (micro, nb, PACKED_BYTES)
        let mut packed = vec![0u8; micro * pb];
        while let Some(blk) = blocks.next() {
            let r0 = blk * block_rows;
            let r1 = (r0 + block_rows).min(n_out);
            let n_micro = (r1 - r0).div_ceil(ROWS);
            for m in 0..n_micro {
                let dst = &mut packed[m * pb..(m + 1) * pb];
                match (&w.x8, &map) {
                    (Some(x8), Some(map)) => pack_x8(nb, x8.block(r0 / ROWS + m), map, dst),
                    _ => {
                        // micro tile m: rows r0 + m·ROWS .. (the last row repeated)
                        let pick = |k: usize| (r0 + m * ROWS + k).min(r1 - 1);
                        let rows: [&[u8]; ROWS] = std::array::from_fn(|k| w.plain_row(pick(k)));
                        pack(nb, &rows, dst);
                    }
                }
            }
            for tt in 0..n_tt {
                let a = toks(tt);
                let n_t = TOKS.min(n_tok - tt * TOKS);
                for m in 0..n_micro {
                    let res = kernel(nb, &packed[m * pb..(m + 1) * pb], &a);
                    let rm = r0 + m * ROWS;
                    // SAFETY: block blk (rows r0..r1) was handed to this thread only.
                    unsafe {
                        store_tile(o, n_out, &res, (rm, ROWS.min(r1 - rm)), (tt * TOKS, n_t))
                    };
                }
            }
        }
    });
}

/// Panels (16 rows each) of a row block of [`matmul_k_amx`].
const AMX_PANELS: usize = 4;
/// The most superblocks per row of a K slice of [`matmul_k_amx`]: a block's
/// expanded slice is `AMX_PANELS · AMX_SLICE · 8 KiB` = 512 KiB (in L2).
const AMX_SLICE: usize = 16;

/// A zeroed byte buffer whose slice starts on a 64-byte boundary.
struct Aligned {
    buf: Vec<u8>,
    off: usize,
    len: usize,
}

impl Aligned {
    fn new(len: usize) -> Aligned {
        let buf = vec![0u8; len + 63];
        let off = buf.as_ptr().align_offset(64);
        Aligned { buf, off, len }
    }
    fn get(&self) -> &[u8] {
        &self.buf[self.off..self.off + self.len]
    }
    fn get_mut(&mut self) -> &mut [u8] {
        &mut self.buf[self.off..self.off + self.len]
    }
}

/// `n_tt` token tiles of `tile_bytes` each, packed by `pack(tt, dst)` into
/// one 64-byte aligned buffer, the threads splitting the tiles.
fn pack_token_tiles(
    pool: &ThreadPool,
    n_tt: usize,
    tile_bytes: usize,
    pack: impl Fn(usize, &mut [u8]) + Sync,
) -> Aligned {
    let nt = pool.n_threads();
    let mut packed = Aligned::new(n_tt * tile_bytes);
    let p = SharedMut::new(packed.get_mut());
    pool.run(|i| {
        let (t0, t1) = split(n_tt, i, nt);
        for tt in t0..t1 {
            // SAFETY: token tile tt belongs to this thread only.
            pack(tt, unsafe { p.slice(tt * tile_bytes, tile_bytes) });
        }
    });
    packed
}

/// K-quant × Q8_K (`n_tok` ≥ 2) on AMX tiles ([`qgemm_amx`]): the token
/// tiles (16 tokens) are packed once (threads split them); the threads
/// take blocks of [`AMX_PANELS`] panels of 16 rows as they come free and
/// walk a block's superblocks in slices of at most [`AMX_SLICE`]: each
/// slice's rows are expanded once (scaled 16-bit weights split into byte
/// tiles, in L2) and every pair of token tiles runs past them, the float
/// accumulators of the whole block (`AMX_PANELS × n_tok × 2` floats) kept
/// between slices. Each (row, token) sees its superblocks in order through
/// the same float steps as the other kernels: the result is theirs bit for
/// bit.
fn matmul_k_amx(pool: &ThreadPool, w: &QMat<'_>, act: &[u8], n_tok: usize, out: &mut [f32]) {
    use qgemm_amx::{ACT_SB, A_SB, SIDE_SB, TILE};
    let (n_in, n_out) = (w.n_in, w.n_out);
    assert!(out.len() >= n_tok * n_out, "matmul: out too small");
    let ab = w.act_bytes();
    let act = &act[..n_tok * ab];
    let nb = n_in / w.dtype.block_len();
    let sb_bytes = w.dtype.block_bytes();
    let n_tt = n_tok.div_ceil(TILE);
    let tile_bytes = nb * ACT_SB;
    // the packed token tiles  (n_tt, nb, ACT_SB)
    let packed = pack_token_tiles(pool, n_tt, tile_bytes, |tt, dst| {
        qgemm_amx::pack_acts(act, ab, n_tok, nb, tt, dst)
    });
    let packed = packed.get();
    let kb = AMX_SLICE.min(nb);
    let block_rows = AMX_PANELS * TILE;
    let blocks = Chunks::new(n_out.div_ceil(block_rows));
    let mins = w.dtype != DType::Q6K;
    let o = SharedMut::new(&mut out[..n_tok * n_out]);
    pool.run(|_| {
        let _tiles = qgemm_amx::TileScope::new();
        // a block's expanded slice  (AMX_PANELS, kb, A_SB) and its side data
        let mut a = Aligned::new(AMX_PANELS * kb * A_SB);
        let mut side = Aligned::new(AMX_PANELS * kb * SIDE_SB);
        // the block's accumulators  (AMX_PANELS, n_tt, 16 rows, 16 tokens)
        let mut acc = vec![0f32; AMX_PANELS * n_tt * TILE * TILE];
        let mut acc_m = vec![0f32; acc.len()];
        // a panel's slice of rows gathered from a repacked matrix  (TILE, kb superblocks)
        let mut gathered = vec![
            0u8;
            if w.x8.is_some() {
                TILE * kb * sb_bytes
            } else {
                0
            }
        ];
        while let Some(blk) = blocks.next() {
            let r0 = blk * block_rows;
            let r1 = (r0 + block_rows).min(n_out);
            let n_p = (r1 - r0).div_ceil(TILE);
            acc.fill(0.0);
            acc_m.fill(0.0);
            for s0 in (0..nb).step_by(kb) {
                let k = kb.min(nb - s0);
                for pn in 0..n_p {
                    // panel pn: rows r0 + 16·pn .. (the last row repeated)
                    let pick = |j: usize| (r0 + pn * TILE + j).min(r1 - 1);
                    let rows: [&[u8]; TILE] = match &w.x8 {
                        Some(x8) => {
                            // a repacked matrix has 8k rows: the panel is
                            // one or two row blocks
                            let len = k * sb_bytes;
                            let rp = r0 + pn * TILE;
                            let n_r = TILE.min(r1 - rp);
                            for h in 0..n_r / 8 {
                                let dst = &mut gathered[8 * h * len..];
                                x8.block_superblocks_into(rp / 8 + h, s0, k, dst, len);
                            }
                            std::array::from_fn(|j| {
                                let j = j.min(n_r - 1);
                                &gathered[j * len..(j + 1) * len]
                            })
                        }
                        None => std::array::from_fn(|j| &w.plain_row(pick(j))[s0 * sb_bytes..]),
                    };
                    let (a_at, s_at) = (pn * kb * A_SB, pn * kb * SIDE_SB);
                    qgemm_amx::expand(
                        w.dtype,
                        &rows,
                        k,
                        &mut a.get_mut()[a_at..a_at + k * A_SB],
                        &mut side.get_mut()[s_at..s_at + k * SIDE_SB],
                    );
                }
                let mut tt = 0;
                while tt < n_tt {
                    let pair = if n_tt - tt >= 2 { 2 } else { 1 };
                    let b = [
                        packed[tt * tile_bytes + s0 * ACT_SB..].as_ptr(),
                        packed[(tt + pair - 1) * tile_bytes + s0 * ACT_SB..].as_ptr(),
                    ];
                    for pn in 0..n_p {
                        let at = (pn * n_tt + tt) * TILE * TILE;
                        // SAFETY: the level is amx (checked by the caller)
                        // and this thread's tiles are configured (_tiles);
                        // the panel's slice holds k expanded superblocks,
                        // each token tile nb - s0 ≥ k packed ones, and the
                        // accumulators pair · 256 floats from `at`.
                        #[cfg(target_arch = "x86_64")]
                        unsafe {
                            qgemm_amx::panel(
                                mins,
                                k,
                                a.get()[pn * kb * A_SB..].as_ptr(),
                                side.get()[pn * kb * SIDE_SB..].as_ptr(),
                                b,
                                pair,
                                acc[at..at + pair * TILE * TILE].as_mut_ptr(),
                                acc_m[at..at + pair * TILE * TILE].as_mut_ptr(),
                            )
                        };
                    }
                    tt += pair;
                }
            }
            // the results: acc + acc_m, token-major
            for pn in 0..n_p {
                let rp = r0 + pn * TILE;
                let n_r = TILE.min(r1 - rp);
                for tt in 0..n_tt {
                    let base = (pn * n_tt + tt) * TILE * TILE;
                    for j in 0..TILE.min(n_tok - tt * TILE) {
                        let t = tt * TILE + j;
                        // SAFETY: block blk (rows r0..r1) was handed to this thread only.
                        let dst = unsafe { o.slice(t * n_out + rp, n_r) };
                        for (r, d) in dst.iter_mut().enumerate() {
                            let at = base + TILE * r + j;
                            *d = acc[at] + acc_m[at];
                        }
                    }
                }
            }
        }
    });
}

/// Q8_0, Q4_0, Q5_0 and IQ4_NL × Q8_0 (`n_tok` ≥ 2) on AMX tiles
/// ([`qgemm_amx::panel_q8_0`]): the token tiles (16 tokens) are packed
/// once (threads split them); the threads take blocks of [`AMX_PANELS`]
/// panels of 16 rows as they come free and run every token tile past
/// each panel. A plain Q8_0 matrix's rows are loaded by the tiles in place
/// (a ragged last panel from a copy, its last row repeated); every other
/// block is first written as Q8_0 rows, once per block: Q4_0, Q5_0 and
/// IQ4_NL blocks expanded to their exact Q8_0 form, a repacked Q8_0 block
/// transposed back (`b32_x8`, a group at a time, at kernel level `level`),
/// the last row repeated past the matrix. Bit for bit the VNNI kernels'
/// arithmetic, which is Q8_0's for all four.
fn matmul_b32_amx(
    pool: &ThreadPool,
    w: &QMat<'_>,
    act: &[u8],
    n_tok: usize,
    out: &mut [f32],
    level: Level,
) {
    use qgemm_amx::{ACT8_BLK, Q8_0_BYTES, TILE};
    let (n_in, n_out, dt) = (w.n_in, w.n_out, w.dtype);
    assert!(out.len() >= n_tok * n_out, "matmul: out too small");
    assert!(b32_x8::is_b32(dt), "matmul_b32_amx: {dt}");
    let ab = w.act_bytes();
    let act = &act[..n_tok * ab];
    let nb = n_in / dt.block_len();
    // a row as Q8_0 blocks
    let rb = nb * Q8_0_BYTES;
    let in_place = dt == DType::Q8_0 && w.x8.is_none();
    let n_tt = n_tok.div_ceil(TILE);
    let tile_bytes = nb * ACT8_BLK;
    // the packed token tiles  (n_tt, nb, ACT8_BLK)
    let packed = pack_token_tiles(pool, n_tt, tile_bytes, |tt, dst| {
        qgemm_amx::pack_acts_q8_0(act, ab, n_tok, nb, tt, dst)
    });
    let packed = packed.get();
    let block_rows = AMX_PANELS * TILE;
    let blocks = Chunks::new(n_out.div_ceil(block_rows));
    let o = SharedMut::new(&mut out[..n_tok * n_out]);
    pool.run(|_| {
        let _tiles = qgemm_amx::TileScope::q8_0();
        // the block's row scales  (AMX_PANELS, nb, 16) as f32
        let mut dx = vec![0f32; AMX_PANELS * nb * TILE];
        // the block as Q8_0 rows, the last one repeated  (n_p · 16, rb);
        // in place: a ragged last panel's rows only  (16, rb)
        let mut rows = Vec::new();
        while let Some(blk) = blocks.next() {
            let r0 = blk * block_rows;
            let r1 = (r0 + block_rows).min(n_out);
            let n_p = (r1 - r0).div_ceil(TILE);
            let whole = (r1 - r0) / TILE;
            if in_place {
                if whole < n_p {
                    rows.clear();
                    for j in 0..TILE {
                        rows.extend_from_slice(w.plain_row((r0 + whole * TILE + j).min(r1 - 1)));
                    }
                }
            } else {
                rows.resize(n_p * TILE * rb, 0);
                match &w.x8 {
                    // repacked: n_out and r0 are multiples of 8
                    Some(x8) => {
                        for b8 in r0 / 8..r1 / 8 {
                            x8.block_to_q8_0_at(
                                b8,
                                level,
                                &mut rows[(8 * b8 - r0) * rb..],
                                rb,
                                true,
                            );
                        }
                    }
                    None => {
                        for (j, dst) in rows.chunks_exact_mut(rb).take(r1 - r0).enumerate() {
                            b32_x8::row_to_q8_0_at(level, dt, nb, w.plain_row(r0 + j), dst);
                        }
                    }
                }
                let last = (r1 - r0 - 1) * rb;
                for j in r1 - r0..n_p * TILE {
                    rows.copy_within(last..last + rb, j * rb);
                }
            }
            let rows = &rows[..];
            // panel pn's 16 rows, rb bytes apart (the last one repeated)
            let panel = |pn: usize| -> &[u8] {
                let rp = r0 + pn * TILE;
                if !in_place {
                    &rows[pn * TILE * rb..(pn + 1) * TILE * rb]
                } else if pn < whole {
                    &w.bytes[rp * rb..(rp + TILE) * rb]
                } else {
                    rows
                }
            };
            for pn in 0..n_p {
                let p = panel(pn);
                for j in 0..TILE {
                    let row = &p[j * rb..(j + 1) * rb];
                    for b in 0..nb {
                        let at = b * Q8_0_BYTES;
                        dx[(pn * nb + b) * TILE + j] =
                            half::f16::from_le_bytes([row[at], row[at + 1]]).to_f32();
                    }
                }
            }
            for tt in 0..n_tt {
                let b = &packed[tt * tile_bytes..(tt + 1) * tile_bytes];
                let n_t = TILE.min(n_tok - tt * TILE);
                for pn in 0..n_p {
                    let rp = r0 + pn * TILE;
                    let p = panel(pn);
                    let dxp = &dx[pn * nb * TILE..(pn + 1) * nb * TILE];
                    // SAFETY: the level is amx (checked by the caller) and
                    // this thread's tiles are configured for Q8_0 (_tiles);
                    // `p` holds 16 Q8_0 rows of nb blocks, `dxp` 16·nb
                    // scales, `b` nb packed blocks.
                    #[cfg(target_arch = "x86_64")]
                    let res = unsafe {
                        qgemm_amx::panel_q8_0(nb, p.as_ptr(), rb, dxp.as_ptr(), b.as_ptr())
                    };
                    #[cfg(not(target_arch = "x86_64"))]
                    let res = [[0f32; TILE]; TILE];
                    let n_r = TILE.min(r1 - rp);
                    for j in 0..n_t {
                        // SAFETY: block blk (rows r0..r1) was handed to this thread only.
                        let dst = unsafe { o.slice((tt * TILE + j) * n_out + rp, n_r) };
                        for (r, d) in dst.iter_mut().enumerate() {
                            *d = res[r][j];
                        }
                    }
                }
            }
        }
    });
}

/// Write a tile's results `res[row][token]` to `o` (token-major, `n_out`
/// per token): rows `rm..rm + n_r`, tokens `t0..t0 + n_t`.
///
/// # Safety
/// No other thread writes those rows of `o` meanwhile.
unsafe fn store_tile(
    o: SharedMut<'_, f32>,
    n_out: usize,
    res: &[[f32; WIDE]; WIDE],
    (rm, n_r): (usize, usize),
    (t0, n_t): (usize, usize),
) {
    for j in 0..n_t {
        // SAFETY: the caller's contract; the slice is inside `o`.
        let dst = unsafe { o.slice((t0 + j) * n_out + rm, n_r) };
        for (k, d) in dst.iter_mut().enumerate() {
            *d = res[k][j];
        }
    }
}

/// A tile microkernel and the operand formats it takes.
#[derive(Clone, Copy)]
enum Tile {
    /// Q4_1 × Q8_1, with the block scales gathered per tile beforehand.
    Q4_1(qgemm_x86::TileFn),
    /// K-quant × Q8_K with 8 rows in the SIMD lanes (`qgemm_lanes`).
    Lanes(qgemm_lanes::LanesFn<{ qgemm_lanes::TOKS }>),
}

impl Tile {
    /// Weight rows per call.
    fn rows(self) -> usize {
        match self {
            Tile::Lanes(_) => qgemm_lanes::ROWS,
            Tile::Q4_1(_) => MR,
        }
    }

    /// Rows of a thread's block: the lanes kernel's 8-token activation tile
    /// (32 KB at a 3584-wide row) stays in L1 while 8 micro tiles of
    /// weights (from L2) pass it.
    fn row_tile(self) -> usize {
        match self {
            Tile::Lanes(_) => LANES_ROW_TILE,
            Tile::Q4_1(_) => ROW_TILE,
        }
    }

    /// Tokens per call.
    fn toks(self) -> usize {
        match self {
            Tile::Lanes(_) => qgemm_lanes::TOKS,
            Tile::Q4_1(_) => NT,
        }
    }
}

/// `matmul_q` with a tile microkernel (`tile.rows()` × `tile.toks()` per
/// call): the threads take `tile.row_tile()`-row blocks as they come free
/// ([`Chunks`]); per block, token
/// tiles stream past its micro tiles (one token tile stays in L1).
/// Ragged edges repeat the last row / token and drop the extra results.
fn matmul_q_tiled(
    pool: &ThreadPool,
    w: &QMat<'_>,
    act: &[u8],
    n_tok: usize,
    out: &mut [f32],
    tile: Tile,
) {
    let (n_in, n_out) = (w.n_in, w.n_out);
    assert!(out.len() >= n_tok * n_out, "matmul: out too small");
    let ab = w.act_bytes();
    let act = &act[..n_tok * ab];
    let nb = n_in / w.dtype.block_len();
    let ntok = tile.toks();
    let n_tt = n_tok.div_ceil(ntok);
    // (the first `ntok` entries used)
    let toks = |tt: usize| -> [&[u8]; WIDE] { token_tile(act, ab, n_tok, ntok, tt) };
    // activation scales of every token tile, gathered once (Q4_1 only)  (n_tt,)
    let mut a_sc = vec![qgemm_x86::TileScales::default(); n_tt];
    if let Tile::Q4_1(_) = tile {
        let nt = pool.n_threads();
        let sc = SharedMut::new(&mut a_sc[..]);
        pool.run(|i| {
            let (t0, t1) = split(n_tt, i, nt);
            // SAFETY: token tiles t0..t1 belong to this thread.
            let mine = unsafe { sc.slice(t0, t1 - t0) };
            for (tt, s) in (t0..t1).zip(mine) {
                s.q8_1(first_nt(&toks(tt)), nb);
            }
        });
    }
    let o = SharedMut::new(&mut out[..n_tok * n_out]);
    let row_tile = tile.row_tile();
    let blocks = Chunks::new(n_out.div_ceil(row_tile));
    let rb = w.dtype.row_bytes(n_in);
    pool.run(|_| {
        let mut w_sc = vec![qgemm_x86::TileScales::default(); ROW_TILE / MR];
        // a repacked matrix's row block gathered back  (row_tile, rb)
        let mut gathered = vec![0u8; if w.x8.is_some() { row_tile * rb } else { 0 }];
        let mr = tile.rows();
        while let Some(blk) = blocks.next() {
            let r0 = blk * row_tile;
            let r1 = (r0 + row_tile).min(n_out);
            let n_micro = (r1 - r0).div_ceil(mr);
            if let Some(x8) = &w.x8 {
                // whole row blocks (row_tile and n_out are multiples of 8)
                for (i, dst) in gathered[..(r1 - r0) * rb]
                    .chunks_exact_mut(qgemm_lanes::ROWS * rb)
                    .enumerate()
                {
                    x8.block_rows_into(r0 / qgemm_lanes::ROWS + i, dst, rb);
                }
            }
            let gathered = &gathered[..];
            let row = |r: usize| -> &[u8] {
                if w.x8.is_some() {
                    &gathered[(r - r0) * rb..(r - r0 + 1) * rb]
                } else {
                    w.plain_row(r)
                }
            };
            // micro tile m: rows r0 + m·mr .. (the first `mr` entries used)
            let mut rows = [[&[] as &[u8]; WIDE]; MAX_MICRO];
            for m in 0..n_micro {
                rows[m] = std::array::from_fn(|k| row((r0 + m * mr + k.min(mr - 1)).min(r1 - 1)));
                if let Tile::Q4_1(_) = tile {
                    w_sc[m].q4_1(first_mr(&rows[m]), nb);
                }
            }
            for tt in 0..n_tt {
                let a = toks(tt);
                let n_t = ntok.min(n_tok - tt * ntok);
                for m in 0..n_micro {
                    let mut res = [[0f32; WIDE]; WIDE];
                    let narrow = match tile {
                        Tile::Q4_1(f) => {
                            f(nb, first_mr(&rows[m]), &w_sc[m], first_nt(&a), &a_sc[tt])
                        }
                        Tile::Lanes(f) => {
                            res = f(nb, &rows[m], &a);
                            [[0f32; NT]; MR]
                        }
                    };
                    if tile.rows() == MR {
                        for (wide, n) in res.iter_mut().zip(&narrow) {
                            wide[..NT].copy_from_slice(n);
                        }
                    }
                    let rm = r0 + m * mr;
                    // SAFETY: block blk (rows r0..r1) was handed to this thread only.
                    unsafe { store_tile(o, n_out, &res, (rm, mr.min(r1 - rm)), (tt * ntok, n_t)) };
                }
            }
        }
    });
}

/// Rows or tokens of the widest tile (`qgemm_lanes`: 8 × 8).
const WIDE: usize = 8;
/// Row block of the lanes kernel.
const LANES_ROW_TILE: usize = 64;
/// Micro tiles per row block, at most.
const MAX_MICRO: usize = if LANES_ROW_TILE / WIDE > ROW_TILE / MR {
    LANES_ROW_TILE / WIDE
} else {
    ROW_TILE / MR
};
const _: () =
    assert!(qgemm_lanes::ROWS == WIDE && qgemm_lanes::TOKS == WIDE && MR <= WIDE && NT <= WIDE);

/// The first `MR` rows of a wide micro tile.
fn first_mr<'r, 'a>(rows: &'r [&'a [u8]; WIDE]) -> &'r [&'a [u8]; MR] {
    rows[..MR].try_into().expect("MR <= WIDE")
}

/// The first `NT` tokens of a wide token tile.
fn first_nt<'r, 'a>(toks: &'r [&'a [u8]; WIDE]) -> &'r [&'a [u8]; NT] {
    toks[..NT].try_into().expect("NT <= WIDE")
}

/// The activation rows (`ab` bytes each, `n_tok` of them in `act`) of
/// token tile `tt`, `per` tokens a tile: entry k is token tt·per + k;
/// entries past the last token or past `per` repeat the tile's last token,
/// whose results the callers drop.
fn token_tile<const K: usize>(
    act: &[u8],
    ab: usize,
    n_tok: usize,
    per: usize,
    tt: usize,
) -> [&[u8]; K] {
    std::array::from_fn(|k| {
        let t = (tt * per + k.min(per - 1)).min(n_tok - 1);
        &act[t * ab..(t + 1) * ab]
    })
}

/// One token through a matrix with an `R`-row kernel of the 1-token tile
/// call shape (Q4_1's 4-row tile, the 8-row `qgemm_lanes` and Q8_0 ones): the rows
/// split between threads in blocks of `R`, the activation shared by all.
/// Each thread streams one run of rows ([`Runs`], not [`Chunks`]: the
/// kernels' prefetch of the tiles ahead relies on consecutive rows); one
/// that finishes early steals the back half of another's run, which read
/// the 7B's decoding weights at 38.3 against 36.4 GB/s for a fixed split
/// (the two alternated every 37 ms within one run).
fn matvec_k<const R: usize>(
    pool: &ThreadPool,
    w: &QMat<'_>,
    act: &[u8],
    out: &mut [f32],
    tile: fn(usize, &[&[u8]; R], &[&[u8]; 1]) -> [[f32; 1]; R],
) {
    let n_out = w.n_out;
    let nb = w.n_in / w.dtype.block_len();
    let a = [&act[..w.act_bytes()]];
    let n_micro = n_out.div_ceil(R);
    let nt = pool.n_threads();
    let o = SharedMut::new(&mut out[..n_out]);
    let runs = Runs::new(n_micro, nt);
    pool.run(|i| {
        while let Some(m) = runs.next(i) {
            let r0 = m * R;
            let rows: [&[u8]; R] = std::array::from_fn(|k| w.plain_row((r0 + k).min(n_out - 1)));
            let res = tile(nb, &rows, &a);
            let n_r = R.min(n_out - r0);
            // SAFETY: `runs` hands micro tile m (rows r0..r0+n_r) to one thread only.
            let dst = unsafe { o.slice(r0, n_r) };
            for (k, d) in dst.iter_mut().enumerate() {
                *d = res[k][0];
            }
        }
    });
}

/// One token through a repacked matrix ([`X8`]): the row blocks split between
/// threads as in [`matvec_k`] (a run each, stolen from by threads that are
/// done), each block one call of the repacked kernel.
fn matvec_x8(
    pool: &ThreadPool,
    w: &QMat<'_>,
    x8: &X8,
    act: &[u8],
    out: &mut [f32],
    kernel: x8::X8Fn,
) {
    use qgemm_lanes::ROWS;
    let n_out = w.n_out;
    let a = &act[..w.act_bytes()];
    let nt = pool.n_threads();
    let o = SharedMut::new(&mut out[..n_out]);
    let runs = Runs::new(n_out / ROWS, nt);
    pool.run(|i| {
        while let Some(blk) = runs.next(i) {
            let res = kernel(x8.nb, x8.block(blk), a);
            // SAFETY: `runs` hands row block blk to one thread only.
            unsafe { o.slice(blk * ROWS, ROWS) }.copy_from_slice(&res);
        }
    });
}

/// The decoding kernel `matvec_b32` runs: over a repacked matrix's row
/// blocks, or over rows as GGUF stores them.
#[derive(Clone, Copy)]
enum B32Kernel {
    Packed(b32_x8::B32Fn),
    Rows(b32_x8::RowsFn),
}

/// One token through a Q8_0, Q4_0, Q5_0 or IQ4_NL matrix with a `b32_x8` decoding
/// kernel: the token's block sums made once, the row blocks split between
/// threads as in [`matvec_k`] (the last rows repeated to fill a block).
fn matvec_b32(pool: &ThreadPool, w: &QMat<'_>, act: &[u8], out: &mut [f32], kernel: B32Kernel) {
    use b32_x8::ROWS;
    let n_out = w.n_out;
    let nb = w.n_in / w.dtype.block_len();
    let a = &act[..w.act_bytes()];
    // the block sums on the stack up to 32768-wide rows (no allocation per
    // matrix and token)
    let mut stack = [0i32; 1024];
    let mut heap = Vec::new();
    let ysum: &mut [i32] = if nb <= stack.len() {
        &mut stack[..nb]
    } else {
        heap.resize(nb, 0);
        &mut heap
    };
    b32_x8::block_sums(nb, a, ysum);
    let ysum = &*ysum;
    let nt = pool.n_threads();
    let o = SharedMut::new(&mut out[..n_out]);
    let runs = Runs::new(n_out.div_ceil(ROWS), nt);
    pool.run(|i| {
        while let Some(blk) = runs.next(i) {
            let r0 = blk * ROWS;
            let res = match (kernel, &w.x8) {
                (B32Kernel::Packed(f), Some(x8)) => f(nb, x8.block(blk), a, ysum),
                (B32Kernel::Rows(f), None) => {
                    let rows: [&[u8]; ROWS] =
                        std::array::from_fn(|k| w.plain_row((r0 + k).min(n_out - 1)));
                    f(nb, &rows, a, ysum)
                }
                _ => unreachable!("matvec_b32: the kernel does not read this layout"),
            };
            let n_r = ROWS.min(n_out - r0);
            // SAFETY: `runs` hands row block blk (rows r0..r0 + n_r) to one thread only.
            unsafe { o.slice(r0, n_r) }.copy_from_slice(&res[..n_r]);
        }
    });
}
