//! The 32-weight block types Q8_0, Q4_0, Q5_0 and IQ4_NL repacked eight
//! rows at a time (Q8_0×8, Q4_0×8, Q5_0×8, IQ4_NL×8; the container is
//! [`super::x8::X8`]), their decoding kernels, and the one arithmetic every
//! SIMD kernel of the four types follows.
//!
//! ## Arithmetic
//! A Q4_0 or Q5_0 block is a Q8_0 block in fewer bits: weight i is
//! d·(q_i − o), o = 8 (Q4_0) or 16 (Q5_0), so [`to_q8_0`] turns it into the
//! Q8_0 block (d, q_i − o) exactly. An IQ4_NL block is one too: weight i is
//! d·v(q_i), v the 16-value grid (`quant::IQ4_VALUES`, −127..113), so its
//! Q8_0 form is (d, v(q_i)). Every SIMD kernel of the four types
//! computes what `qgemm_q8_0_tokens::dot_scalar` computes on that Q8_0 form
//! (per row and token, `w`, `y` the signed quants, `dx`, `dy` the scales):
//!
//! ```text
//! isum_b = Σ_{i<32} w_i · y_i                                   (exact i32)
//! acc    = fma(dx·dy, f32(isum_b), acc)       (acc from 0, blocks in order)
//! ```
//!
//! Prefill runs `qgemm_q8_0_tokens`' tiles on rows expanded once per row
//! block (to the Q8_0 form, or at AVX2 for Q4_0 and Q5_0 to the unsigned
//! quants, [`row_to_unsigned_at`], whose tile adds the offset back as
//! −o·Σy: the same integer; IQ4_NL always to the Q8_0 form), decoding runs
//! the kernels below, so a prompt's
//! logits do not depend on its chunking. (ggml keeps 8 float lanes per row and adds
//! them at the end; the two differ by float rounding only.)
//!
//! ## Layout
//! A row block's `nb` groups, one per block column, each holding exactly
//! the bytes of the 8 rows' blocks (a Q8_0 group is 272 bytes, Q4_0 144,
//! Q5_0 176), rearranged so that one 32-byte load holds 4 quants of every
//! row (row r in dword lane r):
//! - bytes 0..16: the rows' scales d (f16), row r at 2r;
//! - Q5_0 only, bytes 16..48: the rows' `qh` words (bit i: the fifth bit
//!   of weight i), row r at 16 + 4r;
//! - then the quants. Q8_0: for k in 0..8 the rows' quants 4k..4k+4 (32
//!   bytes). Q4_0, Q5_0 and IQ4_NL (whose block is laid out as Q4_0's):
//!   for j in 0..4 the rows' nibble bytes 4j..4j+4 (32 bytes), whose low
//!   nibbles are weights 4j..4j+4 and high nibbles weights 16+4j..20+4j.
//!
//! [`segments`] lists the copies; packing and unpacking both follow it.
//!
//! ## Decoding
//! Per group: the weights as unsigned bytes u = w + o (Q8_0: the sign bit
//! flipped, o = 128; Q4_0: the nibble; Q5_0: nibble + 16·fifth bit;
//! IQ4_NL: v(nibble) + 128, o = 128, one byte shuffle from the nibble),
//! one `vpdpbusd` per 4 quants with the token's 4 quants broadcast, started
//! from −o·Σ_block y ([`block_sums`], once per token), so the lanes end as
//! the 8 rows' exact `isum_b`; then one `cvt` and one `fma` for the 8 rows.
//! At AVX2 (Q4_0, Q5_0 and IQ4_NL; Q8_0's u reaches 255, too large for
//! `maddubs`' i16 pairs) each Q4_0/Q5_0 `maddubs` pair is within 2·31·128,
//! so four of them add up in i16 exactly (4·2·31·128 < 2¹⁵) before one
//! `madd` widens them. IQ4_NL's u reaches 241, so there each `maddubs`
//! takes the signed grid value by ggml's sign trick, `|v| · sign(y, v)`
//! (exact: ggml's Q8_0 quantizer never writes −128, and the pairs stay
//! within 2·127·127 < 2¹⁵), and is widened by a `madd` at once.

use crate::tensor::DType;
use half::f16;

/// Rows per group (the `x8` container's row block).
pub const ROWS: usize = super::qgemm_lanes::ROWS;
pub use super::qgemm_q8_0_tokens::Q8_0_BYTES;

/// A decoding kernel: `(nb, one row block's groups, one token's Q8_0 row,
/// that row's block sums (`block_sums`)) -> the 8 rows' dot products`.
pub type B32Fn = fn(usize, &[u8], &[u8], &[i32]) -> [f32; ROWS];

/// Whether `dtype` is one of the four types.
pub fn is_b32(dtype: DType) -> bool {
    matches!(
        dtype,
        DType::Q8_0 | DType::Q4_0 | DType::Q5_0 | DType::IQ4NL
    )
}

/// The unsigned offset o of a stored weight (u = w + o).
const fn offset(dtype: DType) -> i32 {
    match dtype {
        DType::Q4_0 => 8,
        DType::Q5_0 => 16,
        _ => 128,
    }
}

/// Where the quants start in a group.
const fn quants_at(dtype: DType) -> usize {
    match dtype {
        DType::Q5_0 => 48,
        _ => 16,
    }
}

/// Row `r`'s copies between one block and its group, `(offset in the
/// block, offset in the group, length)` (see the module doc).
pub fn segments(dtype: DType, r: usize) -> impl Iterator<Item = (usize, usize, usize)> {
    assert!(is_b32(dtype) && r < ROWS, "b32×8: no layout for {dtype}");
    let (first, quads, at) = match dtype {
        DType::Q8_0 => (2, 8, 16),
        DType::Q4_0 | DType::IQ4NL => (2, 4, 16),
        _ => (6, 4, 48),
    };
    let scale = std::iter::once((0, 2 * r, 2));
    let qh = (dtype == DType::Q5_0).then_some((2, 16 + 4 * r, 4));
    let quants = (0..quads).map(move |k| (first + 4 * k, at + 32 * k + 4 * r, 4));
    scale.chain(qh).chain(quants)
}

/// The Q8_0 block equal to one block of `dtype` (Q8_0: itself), exactly.
pub fn to_q8_0(dtype: DType, x: &[u8], out: &mut [u8]) {
    expand_block(dtype, x, out, true);
}

/// One block of `dtype` as a Q8_0-shaped block (scale, then its 32 quants
/// one byte each, in weight order): the signed quants `q − o` (`signed`,
/// the exact Q8_0 form; IQ4_NL: the grid values) or the unsigned `q`
/// themselves (Q4_0 and Q5_0).
fn expand_block(dtype: DType, x: &[u8], out: &mut [u8], signed: bool) {
    assert!(is_b32(dtype), "to_q8_0: {dtype}");
    out[..2].copy_from_slice(&x[..2]);
    match dtype {
        DType::Q8_0 => out[2..Q8_0_BYTES].copy_from_slice(&x[2..Q8_0_BYTES]),
        DType::IQ4NL => {
            assert!(signed, "IQ4_NL has no unsigned form");
            for (o, v) in out[2..Q8_0_BYTES]
                .iter_mut()
                .zip(crate::quant::iq4_values(&x[2..18]))
            {
                *o = v as u8;
            }
        }
        _ => {
            let q5 = dtype == DType::Q5_0;
            let (qs, qh) = if q5 {
                (&x[6..22], u32::from_le_bytes([x[2], x[3], x[4], x[5]]))
            } else {
                (&x[2..18], 0)
            };
            let o = if signed { offset(dtype) } else { 0 };
            for i in 0..32 {
                let b = qs[i % 16];
                let q = if i < 16 { b & 0x0f } else { b >> 4 } | (((qh >> i) & 1) as u8) << 4;
                out[2 + i] = (q as i32 - o) as i8 as u8;
            }
        }
    }
}

/// `nb` blocks of a `dtype` row as Q8_0 (`nb · 34` bytes in `out`), with
/// the SIMD expansion where the process's kernel level has AVX2 (prefill
/// expands every row block this way: scalar, it took a third of a 1.5B
/// Q4_0's matrix products).
pub fn row_to_q8_0(dtype: DType, nb: usize, row: &[u8], out: &mut [u8]) {
    row_to_q8_0_at(super::isa::level(), dtype, nb, row, out);
}

/// [`row_to_q8_0`] at kernel level `level` (the scalar [`to_q8_0`] below
/// AVX2 or above what the CPU runs); every level gives the same bytes.
pub fn row_to_q8_0_at(
    level: super::isa::Level,
    dtype: DType,
    nb: usize,
    row: &[u8],
    out: &mut [u8],
) {
    expand_row_at(level, dtype, nb, row, out, true);
}

/// `nb` blocks of a Q4_0 or Q5_0 row in the unsigned form: per block the
/// scale, then the 32 quants `q` (0..16 or 0..32, no offset taken off) one
/// byte each, in weight order (the AVX2 prefill tile's rows,
/// `qgemm_q8_0_tokens::tile_unsigned`). Same levels as [`row_to_q8_0_at`].
pub fn row_to_unsigned_at(
    level: super::isa::Level,
    dtype: DType,
    nb: usize,
    row: &[u8],
    out: &mut [u8],
) {
    assert!(
        matches!(dtype, DType::Q4_0 | DType::Q5_0),
        "row_to_unsigned: {dtype}"
    );
    expand_row_at(level, dtype, nb, row, out, false);
}

fn expand_row_at(
    level: super::isa::Level,
    dtype: DType,
    nb: usize,
    row: &[u8],
    out: &mut [u8],
    signed: bool,
) {
    let bb = dtype.block_bytes();
    assert!(
        is_b32(dtype) && row.len() >= nb * bb && out.len() >= nb * Q8_0_BYTES,
        "row_to_q8_0: short operands"
    );
    #[cfg(target_arch = "x86_64")]
    if dtype != DType::Q8_0 && level >= super::isa::Level::Avx2 && level <= super::isa::detected() {
        let nibbles = Nibbles::of(dtype, signed);
        // SAFETY: the CPU has AVX2 (checked just above); `row` holds nb
        // blocks of `dtype` and `out` nb Q8_0 blocks (asserted above).
        unsafe { expand_avx2(nibbles, nb, row.as_ptr(), out.as_mut_ptr()) };
        return;
    }
    let _ = level;
    for b in 0..nb {
        expand_block(
            dtype,
            &row[b * bb..(b + 1) * bb],
            &mut out[b * Q8_0_BYTES..(b + 1) * Q8_0_BYTES],
            signed,
        );
    }
}

/// A repacked Q4_0 or Q5_0 row block (`nb` groups) as its 8 rows of
/// Q8_0-shaped blocks, row `r` at `out[r · stride..]`: the signed Q8_0
/// form (`signed`) or the unsigned quants, the same bytes as
/// [`row_to_q8_0_at`] / [`row_to_unsigned_at`] on the rows as GGUF stores
/// them, a group at a time (its 8 nibble runs transposed to the rows in one
/// 8 × 8 dword transpose, which leaves each row's 32 quants in weight
/// order). A repacked Q8_0 row block (`signed` only) comes back as GGUF's
/// rows the same way, its 8 runs of quants transposed. AVX2 only: at a
/// level below it (or above what the CPU runs), `false` and nothing
/// written (`x8::X8::block_to_q8_0_at` then goes row by row). Prefill
/// expands a repacked matrix this way: gathering each row
/// back first cost Gemma 3 270M's prefill in chunks of 32 tokens (a
/// budgeted cache) a fifth.
pub fn block_to_q8_0_at(
    level: super::isa::Level,
    dtype: DType,
    nb: usize,
    groups: &[u8],
    out: &mut [u8],
    stride: usize,
    signed: bool,
) -> bool {
    assert!(
        matches!(dtype, DType::Q4_0 | DType::Q5_0)
            || (matches!(dtype, DType::Q8_0 | DType::IQ4NL) && signed),
        "block_to_q8_0: {dtype} (signed {signed})"
    );
    let qrb = nb * Q8_0_BYTES;
    assert!(
        groups.len() >= nb * ROWS * dtype.block_bytes()
            && stride >= qrb
            && out.len() >= (ROWS - 1) * stride + qrb,
        "block_to_q8_0: short operands"
    );
    #[cfg(target_arch = "x86_64")]
    if level >= super::isa::Level::Avx2 && level <= super::isa::detected() {
        if dtype == DType::Q8_0 {
            // SAFETY: as below.
            unsafe { block_q8_0_avx2(nb, groups.as_ptr(), out.as_mut_ptr(), stride) };
            return true;
        }
        let nibbles = Nibbles::of(dtype, signed);
        // SAFETY: the CPU has AVX2 (checked just above); `groups` holds nb
        // groups and `out` 8 rows of nb Q8_0 blocks, `stride` apart
        // (asserted above).
        unsafe { block_expand_avx2(nibbles, nb, groups.as_ptr(), out.as_mut_ptr(), stride) };
        return true;
    }
    let _ = (level, signed);
    false
}

/// [`block_to_q8_0_at`]'s AVX2 body for Q8_0: per group, its 8 runs of
/// quants (run k: row r's quants 4k..4k + 4 in dword lane r) transposed to
/// the 8 rows, each written after its scale.
///
/// # Safety
/// The CPU has AVX2; `g` holds `nb` Q8_0 groups, `out` 8 rows of `nb`
/// Q8_0 blocks `stride` bytes apart.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn block_q8_0_avx2(nb: usize, g: *const u8, out: *mut u8, stride: usize) {
    use std::arch::x86_64::*;
    let gb = ROWS * Q8_0_BYTES;
    let q_at = quants_at(DType::Q8_0);
    // SAFETY (every access below): b < nb and r < 8, inside the buffers
    // (the function's contract).
    unsafe {
        for b in 0..nb {
            let p = g.add(b * gb);
            let runs: [__m256i; 8] =
                std::array::from_fn(|k| _mm256_loadu_si256(p.add(q_at + 32 * k).cast()));
            // t[r]: row r's 32 quants in order
            let t = super::qgemm_lanes::transpose8(runs);
            for (r, t) in t.iter().enumerate() {
                let dst = out.add(r * stride + b * Q8_0_BYTES);
                dst.cast::<u16>()
                    .write_unaligned(p.add(2 * r).cast::<u16>().read_unaligned());
                _mm256_storeu_si256(dst.add(2).cast(), *t);
            }
        }
    }
}

/// What the AVX2 expansions make of a nibble type's quants (Q4_0, Q5_0,
/// IQ4_NL): the byte of each weight, in weight order.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy, Debug)]
struct Nibbles {
    /// Q5_0: 16 · the fifth bit (from `qh`) added to the nibble.
    q5: bool,
    /// IQ4_NL: the nibble looked up in the grid (its Q8_0 form).
    grid: bool,
    /// Taken off the nibble (Q4_0, Q5_0): the type's offset for the Q8_0
    /// form, 0 for the unsigned one.
    off: i8,
}

#[cfg(target_arch = "x86_64")]
impl Nibbles {
    fn of(dtype: DType, signed: bool) -> Nibbles {
        let grid = dtype == DType::IQ4NL;
        Nibbles {
            q5: dtype == DType::Q5_0,
            grid,
            off: if signed && !grid {
                offset(dtype) as i8
            } else {
                0
            },
        }
    }

    /// Bytes of one block of the type.
    fn block_bytes(self) -> usize {
        if self.q5 {
            22
        } else {
            18
        }
    }

    /// The weights' bytes from their nibbles `u` (Q5_0's fifth bits
    /// already in): the grid values, or `u − off`.
    ///
    /// # Safety
    /// AVX2 must be available.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn finish(self, u: std::arch::x86_64::__m256i) -> std::arch::x86_64::__m256i {
        use std::arch::x86_64::*;
        // SAFETY: AVX2 is available (the caller's contract).
        unsafe {
            if self.grid {
                _mm256_shuffle_epi8(super::qgemm_lanes::iq4_grid(false), u)
            } else {
                _mm256_sub_epi8(u, _mm256_set1_epi8(self.off))
            }
        }
    }
}

/// [`block_to_q8_0_at`]'s AVX2 body.
///
/// # Safety
/// The CPU has AVX2; `g` holds `nb` groups of the type, `out` 8 rows of
/// `nb` Q8_0 blocks `stride` bytes apart.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn block_expand_avx2(n: Nibbles, nb: usize, g: *const u8, out: *mut u8, stride: usize) {
    use std::arch::x86_64::*;
    let q5 = n.q5;
    let gb = ROWS * n.block_bytes();
    let q_at = if q5 { 48 } else { 16 };
    let nib = _mm256_set1_epi8(0x0f);
    // SAFETY (every access below): b < nb and r < 8, inside the buffers
    // (the function's contract).
    unsafe {
        for b in 0..nb {
            let p = g.add(b * gb);
            // run j: lane r = row r's nibble bytes 4j..4j + 4, whose low
            // nibbles are weights 4j.. and high nibbles 16 + 4j..
            let runs: [__m256i; 4] =
                std::array::from_fn(|j| _mm256_loadu_si256(p.add(q_at + 32 * j).cast()));
            let nibbles: [__m256i; 8] = std::array::from_fn(|i| {
                if i < 4 {
                    _mm256_and_si256(runs[i], nib)
                } else {
                    _mm256_and_si256(_mm256_srli_epi16::<4>(runs[i - 4]), nib)
                }
            });
            // t[r]: row r's 32 quants in weight order
            let t = super::qgemm_lanes::transpose8(nibbles);
            for (r, t) in t.iter().enumerate() {
                let mut u = *t;
                if q5 {
                    u = _mm256_or_si256(
                        u,
                        fifth_avx2(p.add(16 + 4 * r).cast::<u32>().read_unaligned()),
                    );
                }
                let dst = out.add(r * stride + b * Q8_0_BYTES);
                dst.cast::<u16>()
                    .write_unaligned(p.add(2 * r).cast::<u16>().read_unaligned());
                _mm256_storeu_si256(dst.add(2).cast(), n.finish(u));
            }
        }
    }
}

/// Q4_0, Q5_0 or IQ4_NL blocks to Q8_0-shaped blocks with AVX2: the
/// nibbles in weight order, Q5_0's fifth bits spread from `qh` by a byte
/// shuffle and compare (as ggml's AVX2 code does), then [`Nibbles::finish`]
/// (the offset subtracted, or the grid looked up).
///
/// # Safety
/// The CPU has AVX2; `x` holds `nb` blocks of the type, `out` room for
/// `nb` Q8_0 blocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn expand_avx2(n: Nibbles, nb: usize, x: *const u8, out: *mut u8) {
    use std::arch::x86_64::*;
    let q5 = n.q5;
    let (bb, qs_at) = (n.block_bytes(), if q5 { 6 } else { 2 });
    let nib = _mm256_set1_epi8(0x0f);
    // SAFETY (every access below): b < nb, so block b of `x` and of `out`
    // is inside the buffers (the function's contract).
    unsafe {
        for b in 0..nb {
            let (src, dst) = (x.add(b * bb), out.add(b * Q8_0_BYTES));
            let q = _mm_loadu_si128(src.add(qs_at).cast());
            let mut u = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16::<4>(q), q), nib);
            if q5 {
                u = _mm256_or_si256(u, fifth_avx2(src.add(2).cast::<u32>().read_unaligned()));
            }
            dst.cast::<u16>()
                .write_unaligned(src.cast::<u16>().read_unaligned());
            _mm256_storeu_si256(dst.add(2).cast(), n.finish(u));
        }
    }
}

/// One Q5_0 block's fifth bits as 16 in the bytes of its 32 weights, in
/// weight order, with AVX2: byte i is byte i / 8 of `qh` (a shuffle),
/// tested against bit i % 8 (as ggml's AVX2 code does).
///
/// # Safety
/// AVX2 must be available.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn fifth_avx2(qh: u32) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    // SAFETY: AVX2 is available (the caller's contract); registers only.
    unsafe {
        let pick = _mm256_set_epi64x(
            0x0303_0303_0303_0303,
            0x0202_0202_0202_0202,
            0x0101_0101_0101_0101,
            0,
        );
        let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(qh as i32), pick);
        let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201_u64 as i64);
        let set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);
        _mm256_and_si256(set, _mm256_set1_epi8(16))
    }
}

/// The scalar model: one `dtype` row · one token's Q8_0 row, `nb` blocks
/// (the module doc's arithmetic).
pub fn dot_scalar(dtype: DType, nb: usize, row: &[u8], y: &[u8]) -> f32 {
    let mut q8 = vec![0u8; nb * Q8_0_BYTES];
    row_to_q8_0(dtype, nb, row, &mut q8);
    super::qgemm_q8_0_tokens::dot_scalar(nb, &q8, y)
}

/// Σ of each block's 32 quants of a token's Q8_0 row (`nb` blocks), into
/// `out`.
pub fn block_sums(nb: usize, y: &[u8], out: &mut [i32]) {
    assert!(y.len() >= nb * Q8_0_BYTES && out.len() >= nb);
    for (b, s) in out[..nb].iter_mut().enumerate() {
        *s = y[b * Q8_0_BYTES + 2..(b + 1) * Q8_0_BYTES]
            .iter()
            .map(|&q| q as i8 as i32)
            .sum();
    }
}

/// The kernels' const parameter per type.
#[cfg(target_arch = "x86_64")]
const Q8: u8 = 0;
#[cfg(target_arch = "x86_64")]
const Q4: u8 = 1;
#[cfg(target_arch = "x86_64")]
const Q5: u8 = 2;
#[cfg(target_arch = "x86_64")]
const NL: u8 = 3;

/// The decoding kernel of `dtype`'s layout at kernel level `level`, where
/// this CPU runs it: Q4_0, Q5_0 and IQ4_NL from avx2 (VNNI's from
/// avx512vnni), Q8_0 from avx512vnni.
pub fn decode_for(dtype: DType, level: super::isa::Level) -> Option<B32Fn> {
    #[cfg(target_arch = "x86_64")]
    {
        use super::isa::vnni_or_avx2;
        match dtype {
            DType::Q8_0 if level.vnni() => {
                vnni_or_avx2(level, decode::<Q8, true>, decode::<Q8, false>)
            }
            DType::Q4_0 => vnni_or_avx2(level, decode::<Q4, true>, decode::<Q4, false>),
            DType::Q5_0 => vnni_or_avx2(level, decode::<Q5, true>, decode::<Q5, false>),
            DType::IQ4NL => vnni_or_avx2(level, decode::<NL, true>, decode::<NL, false>),
            _ => None,
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (dtype, level);
        None
    }
}

#[cfg(target_arch = "x86_64")]
use super::qgemm_q8_0_tokens::signed_dot_avx2;

/// The type of the kernels' const parameter.
#[cfg(target_arch = "x86_64")]
const fn dtype_of(t: u8) -> DType {
    match t {
        Q8 => DType::Q8_0,
        Q4 => DType::Q4_0,
        Q5 => DType::Q5_0,
        _ => DType::IQ4NL,
    }
}

/// The checked entry of the kernels (what `decode_for` hands out).
#[cfg(target_arch = "x86_64")]
fn decode<const T: u8, const VNNI: bool>(
    nb: usize,
    groups: &[u8],
    y: &[u8],
    ysum: &[i32],
) -> [f32; ROWS] {
    let dtype = dtype_of(T);
    assert!(
        groups.len() >= nb * ROWS * dtype.block_bytes()
            && y.len() >= nb * Q8_0_BYTES
            && ysum.len() >= nb,
        "b32×8 decode: short operands"
    );
    // SAFETY: handed out by `decode_for` only where `vnni_or_avx2` found
    // the CPU has the kernel's features (AVX2, FMA, F16C; AVX-512 F/BW/VL
    // and VNNI for the VNNI one; Q8_0 only with VNNI); the lengths (checked
    // above) bound every load.
    unsafe {
        if VNNI {
            decode_vnni::<T>(nb, groups.as_ptr(), y.as_ptr(), ysum.as_ptr())
        } else {
            decode_avx2::<T>(nb, groups.as_ptr(), y.as_ptr(), ysum.as_ptr())
        }
    }
}

/// The fifth bits of Q5_0's quad `k` (weights 4k..4k+4) as 16 in the
/// bytes of an unsigned quad: byte m of lane r is bit 4k + m of row r's
/// `qh`. `bytes[c]` holds byte c of each lane's `qh` in all four bytes of
/// the lane.
///
/// # Safety
/// AVX-512 BW and VL must be available.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn fifth_vnni(
    bytes: &[std::arch::x86_64::__m256i; 4],
    k: usize,
) -> std::arch::x86_64::__mmask32 {
    use std::arch::x86_64::*;
    // bit (4k + m) % 8 of byte m
    let sh = 4 * (k % 2) as u32;
    // SAFETY: AVX-512 BW and VL are available (the caller's contract);
    // registers only.
    unsafe {
        let bits = _mm256_set1_epi32(0x0804_0201u32.wrapping_shl(sh) as i32);
        _mm256_test_epi8_mask(bytes[k / 2], bits)
    }
}

/// Byte c of every lane of `qh` copied into all four bytes of its lane,
/// for c in 0..4.
///
/// # Safety
/// AVX2 must be available.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn qh_bytes(qh: std::arch::x86_64::__m256i) -> [std::arch::x86_64::__m256i; 4] {
    use std::arch::x86_64::*;
    std::array::from_fn(|c| {
        // shuffles stay in 128-bit halves: lane p of a half starts at 4p
        let at = |p: i32| (4 * p + c as i32) * 0x0101_0101;
        // SAFETY: AVX2 is available (the caller's contract); registers only.
        unsafe {
            let pick = _mm256_setr_epi32(at(0), at(1), at(2), at(3), at(0), at(1), at(2), at(3));
            _mm256_shuffle_epi8(qh, pick)
        }
    })
}

/// The rows' scales times the token's: `dx·dy`, lane r = row r.
///
/// # Safety
/// `g` must point to a readable group, `yb` to a readable Q8_0 block;
/// AVX2 and F16C must be available.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn scales(g: *const u8, yb: *const u8) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    // SAFETY: the caller's contract: 16 bytes of scales, 2 of the token's.
    unsafe {
        let dx = _mm256_cvtph_ps(_mm_loadu_si128(g.cast()));
        let dy = f16::from_bits(yb.cast::<u16>().read_unaligned()).to_f32();
        _mm256_mul_ps(dx, _mm256_set1_ps(dy))
    }
}

/// The VNNI kernel.
///
/// # Safety
/// The CPU has AVX2, FMA, F16C and AVX-512 F/BW/VL/VNNI; `x` holds `nb`
/// groups of `T`'s type, `y` `nb` Q8_0 blocks and `ysum` `nb` sums.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn decode_vnni<const T: u8>(
    nb: usize,
    x: *const u8,
    y: *const u8,
    ysum: *const i32,
) -> [f32; ROWS] {
    use std::arch::x86_64::*;
    let dtype = dtype_of(T);
    let (gb, o, qa) = (ROWS * dtype.block_bytes(), offset(dtype), quants_at(dtype));
    let (nib, sixteen, flip) = (
        _mm256_set1_epi8(0x0f),
        _mm256_set1_epi8(16),
        _mm256_set1_epi8(-128),
    );
    // IQ4_NL: the grid + 128 (u), taken back by −128·Σy
    // SAFETY: the function's features include AVX2.
    let grid = unsafe { super::qgemm_lanes::iq4_grid(true) };
    let mut acc = _mm256_setzero_ps();
    // SAFETY (every load below): b < nb, so group b, block b of y and
    // ysum[b] are readable (the function's contract).
    unsafe {
        for b in 0..nb {
            let g = x.add(b * gb);
            super::mem::prefetch_ahead(g, gb);
            let yb = y.add(b * Q8_0_BYTES);
            let yq = |k: usize| _mm256_set1_epi32(yb.add(2 + 4 * k).cast::<i32>().read_unaligned());
            // two chains of 4 products each, one started at −o·Σy
            let mut s0 = _mm256_set1_epi32(-o * *ysum.add(b));
            let mut s1 = _mm256_setzero_si256();
            if T == Q8 {
                for k in 0..4 {
                    let w0 = _mm256_loadu_si256(g.add(qa + 64 * k).cast());
                    let w1 = _mm256_loadu_si256(g.add(qa + 64 * k + 32).cast());
                    s0 = _mm256_dpbusd_epi32(s0, _mm256_xor_si256(w0, flip), yq(2 * k));
                    s1 = _mm256_dpbusd_epi32(s1, _mm256_xor_si256(w1, flip), yq(2 * k + 1));
                }
            } else {
                let bytes = if T == Q5 {
                    qh_bytes(_mm256_loadu_si256(g.add(16).cast()))
                } else {
                    [_mm256_setzero_si256(); 4]
                };
                for j in 0..4 {
                    let q = _mm256_loadu_si256(g.add(qa + 32 * j).cast());
                    let mut lo = _mm256_and_si256(q, nib);
                    let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), nib);
                    if T == Q5 {
                        lo = _mm256_mask_add_epi8(lo, fifth_vnni(&bytes, j), lo, sixteen);
                        hi = _mm256_mask_add_epi8(hi, fifth_vnni(&bytes, 4 + j), hi, sixteen);
                    }
                    if T == NL {
                        lo = _mm256_shuffle_epi8(grid, lo);
                        hi = _mm256_shuffle_epi8(grid, hi);
                    }
                    s0 = _mm256_dpbusd_epi32(s0, lo, yq(j));
                    s1 = _mm256_dpbusd_epi32(s1, hi, yq(4 + j));
                }
            }
            let isum = _mm256_add_epi32(s0, s1);
            acc = _mm256_fmadd_ps(scales(g, yb), _mm256_cvtepi32_ps(isum), acc);
        }
        let mut out = [0f32; ROWS];
        _mm256_storeu_ps(out.as_mut_ptr(), acc);
        out
    }
}

/// The AVX2 kernel (Q4_0, Q5_0 and IQ4_NL).
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `x` holds `nb` groups of `T`'s type
/// (not Q8_0), `y` `nb` Q8_0 blocks and `ysum` `nb` sums.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn decode_avx2<const T: u8>(
    nb: usize,
    x: *const u8,
    y: *const u8,
    ysum: *const i32,
) -> [f32; ROWS] {
    use std::arch::x86_64::*;
    assert!(T != Q8, "b32×8: no AVX2 kernel for Q8_0");
    let dtype = dtype_of(T);
    let (gb, qa) = (ROWS * dtype.block_bytes(), quants_at(dtype));
    // IQ4_NL: the signed grid values, no offset
    let o = if T == NL { 0 } else { offset(dtype) };
    let (nib, sixteen, ones) = (
        _mm256_set1_epi8(0x0f),
        _mm256_set1_epi8(16),
        _mm256_set1_epi16(1),
    );
    // SAFETY: the function's features include AVX2.
    let grid = unsafe { super::qgemm_lanes::iq4_grid(false) };
    let mut acc = _mm256_setzero_ps();
    // SAFETY (every load below): b < nb, so group b, block b of y and
    // ysum[b] are readable (the function's contract).
    unsafe {
        for b in 0..nb {
            let g = x.add(b * gb);
            super::mem::prefetch_ahead(g, gb);
            let yb = y.add(b * Q8_0_BYTES);
            let yq = |k: usize| _mm256_set1_epi32(yb.add(2 + 4 * k).cast::<i32>().read_unaligned());
            let bytes = if T == Q5 {
                qh_bytes(_mm256_loadu_si256(g.add(16).cast()))
            } else {
                [_mm256_setzero_si256(); 4]
            };
            // byte m of a quad k's fifth bits: bit (4k + m) % 8 of byte k / 2
            let fifth = |k: usize| {
                let bits =
                    _mm256_set1_epi32(0x0804_0201u32.wrapping_shl(4 * (k % 2) as u32) as i32);
                let set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes[k / 2], bits), bits);
                _mm256_and_si256(set, sixteen)
            };
            // Q4_0, Q5_0: per row, pairs of u·y in i16, the low and high
            // nibbles' quads apart, 4 quads each (|sum| ≤ 4·2·31·128 <
            // 2¹⁵); IQ4_NL: each quad's products widened at once
            let mut p0 = _mm256_setzero_si256();
            let mut p1 = _mm256_setzero_si256();
            for j in 0..4 {
                let q = _mm256_loadu_si256(g.add(qa + 32 * j).cast());
                let mut lo = _mm256_and_si256(q, nib);
                let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), nib);
                if T == Q5 {
                    lo = _mm256_or_si256(lo, fifth(j));
                    hi = _mm256_or_si256(hi, fifth(4 + j));
                }
                if T == NL {
                    let (lo, hi) = (_mm256_shuffle_epi8(grid, lo), _mm256_shuffle_epi8(grid, hi));
                    p0 = _mm256_add_epi32(p0, signed_dot_avx2(lo, yq(j)));
                    p1 = _mm256_add_epi32(p1, signed_dot_avx2(hi, yq(4 + j)));
                } else {
                    p0 = _mm256_add_epi16(p0, _mm256_maddubs_epi16(lo, yq(j)));
                    p1 = _mm256_add_epi16(p1, _mm256_maddubs_epi16(hi, yq(4 + j)));
                }
            }
            if T != NL {
                (p0, p1) = (_mm256_madd_epi16(p0, ones), _mm256_madd_epi16(p1, ones));
            }
            let isum = _mm256_add_epi32(
                _mm256_add_epi32(p0, p1),
                _mm256_set1_epi32(-o * *ysum.add(b)),
            );
            acc = _mm256_fmadd_ps(scales(g, yb), _mm256_cvtepi32_ps(isum), acc);
        }
        let mut out = [0f32; ROWS];
        _mm256_storeu_ps(out.as_mut_ptr(), acc);
        out
    }
}

/// A decoding kernel over 8 rows as GGUF stores them (a matrix that is not
/// repacked): `(nb, the rows, one token's Q8_0 row, its block sums) -> the
/// 8 rows' dot products`, the module doc's arithmetic.
pub type RowsFn = fn(usize, &[&[u8]; ROWS], &[u8], &[i32]) -> [f32; ROWS];

/// The kernel over rows as GGUF stores them of `dtype` (Q4_0, Q5_0 or
/// IQ4_NL; Q8_0 has `qgemm_q8_0_tokens::decode_for`) at kernel level
/// `level`, where this CPU runs it (from avx2; VNNI's from avx512vnni).
pub fn decode_rows_for(dtype: DType, level: super::isa::Level) -> Option<RowsFn> {
    #[cfg(target_arch = "x86_64")]
    {
        use super::isa::vnni_or_avx2;
        match dtype {
            DType::Q4_0 => vnni_or_avx2(level, rows_entry::<Q4, true>, rows_entry::<Q4, false>),
            DType::Q5_0 => vnni_or_avx2(level, rows_entry::<Q5, true>, rows_entry::<Q5, false>),
            DType::IQ4NL => vnni_or_avx2(level, rows_entry::<NL, true>, rows_entry::<NL, false>),
            _ => None,
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (dtype, level);
        None
    }
}

/// The checked entry of the row kernels (what `decode_rows_for` hands out).
#[cfg(target_arch = "x86_64")]
fn rows_entry<const T: u8, const VNNI: bool>(
    nb: usize,
    rows: &[&[u8]; ROWS],
    y: &[u8],
    ysum: &[i32],
) -> [f32; ROWS] {
    let bb = dtype_of(T).block_bytes();
    assert!(
        rows.iter().all(|r| r.len() >= nb * bb) && y.len() >= nb * Q8_0_BYTES && ysum.len() >= nb,
        "b32 decode: short operands"
    );
    let wp: [*const u8; ROWS] = std::array::from_fn(|r| rows[r].as_ptr());
    // SAFETY: handed out by `decode_rows_for` only where the CPU has the
    // kernel's features (AVX2, FMA, F16C; AVX-512 F/BW/VL and VNNI for the
    // VNNI one); the lengths (checked above) bound every load.
    unsafe {
        if VNNI {
            rows_vnni::<T>(nb, &wp, y.as_ptr(), ysum.as_ptr())
        } else {
            rows_avx2::<T>(nb, &wp, y.as_ptr(), ysum.as_ptr())
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn rows_vnni<const T: u8>(
    nb: usize,
    wp: &[*const u8; ROWS],
    y: *const u8,
    ysum: *const i32,
) -> [f32; ROWS] {
    // SAFETY: the caller's contract (rows_entry).
    unsafe { rows_body::<T, true>(nb, wp, y, ysum) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_avx2<const T: u8>(
    nb: usize,
    wp: &[*const u8; ROWS],
    y: *const u8,
    ysum: *const i32,
) -> [f32; ROWS] {
    // SAFETY: the caller's contract (rows_entry).
    unsafe { rows_body::<T, false>(nb, wp, y, ysum) }
}

/// Micro tiles ahead that the row kernels prefetch (into L2): rows read in
/// place from a file's map are too short for the hardware prefetcher to
/// get going (as in `qgemm_q8_0_tokens`).
#[cfg(target_arch = "x86_64")]
const PREFETCH_TILES: usize = 2;

/// The row kernels' body: per row and block the 32 weights unpacked to
/// unsigned bytes (Q5_0's fifth bits added under a mask with VNNI, spread
/// by a shuffle and compare at AVX2; IQ4_NL's grid + 128 looked up), 8
/// lanes of 4 products each, the 8 rows' lanes reduced to one register
/// (lane r = row r), −o·Σy added. IQ4_NL at AVX2 takes the signed grid
/// values by the sign trick instead ([`signed_dot_avx2`], no offset).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn rows_body<const T: u8, const VNNI: bool>(
    nb: usize,
    wp: &[*const u8; ROWS],
    y: *const u8,
    ysum: *const i32,
) -> [f32; ROWS] {
    use std::arch::x86_64::*;
    let dtype = dtype_of(T);
    let bb = dtype.block_bytes();
    let o = if T == NL && !VNNI { 0 } else { offset(dtype) };
    let qs_at = if T == Q5 { 6 } else { 2 };
    // SAFETY: the function's contract: every intrinsic below has its
    // features where this is inlined (mask ops and dpbusd only with VNNI);
    // every load is inside nb blocks (b < nb and every row holds nb blocks).
    unsafe {
        let nib = _mm256_set1_epi8(0x0f);
        let grid = super::qgemm_lanes::iq4_grid(VNNI);
        let mut acc = _mm256_setzero_ps();
        for b in 0..nb {
            let off = b * bb;
            for p in wp {
                // a prefetch never faults and reads nothing the program
                // sees; wrapping_add keeps the pointer's provenance
                _mm_prefetch::<_MM_HINT_T1>(
                    p.wrapping_add(PREFETCH_TILES * ROWS * nb * bb + off).cast(),
                );
            }
            let yb = y.add(b * Q8_0_BYTES);
            let yq = _mm256_loadu_si256(yb.add(2).cast());
            let part: [__m256i; ROWS] = std::array::from_fn(|r| {
                let x = wp[r].add(off);
                let q = _mm_loadu_si128(x.add(qs_at).cast());
                let mut u = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16::<4>(q), q), nib);
                if T == Q5 {
                    let qh = x.add(2).cast::<u32>().read_unaligned();
                    if VNNI {
                        u = _mm256_mask_add_epi8(u, qh, u, _mm256_set1_epi8(16));
                    } else {
                        u = _mm256_or_si256(u, fifth_avx2(qh));
                    }
                }
                if T == NL {
                    u = _mm256_shuffle_epi8(grid, u);
                    if !VNNI {
                        return signed_dot_avx2(u, yq);
                    }
                }
                if VNNI {
                    _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, yq)
                } else {
                    _mm256_madd_epi16(_mm256_maddubs_epi16(u, yq), _mm256_set1_epi16(1))
                }
            });
            // the rows' exact sums (lane r = row r), the offset taken back
            let isum = _mm256_add_epi32(
                super::qgemm_q8_0_tokens::rows_into_lanes(&part),
                _mm256_set1_epi32(-o * *ysum.add(b)),
            );
            let dx: [u16; ROWS] =
                std::array::from_fn(|r| wp[r].add(off).cast::<u16>().read_unaligned());
            let dx = _mm256_cvtph_ps(_mm_loadu_si128(dx.as_ptr().cast()));
            let dy = f16::from_bits(yb.cast::<u16>().read_unaligned()).to_f32();
            let d = _mm256_mul_ps(dx, _mm256_set1_ps(dy));
            acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(isum), acc);
        }
        let mut out = [0f32; ROWS];
        _mm256_storeu_ps(out.as_mut_ptr(), acc);
        out
    }
}
