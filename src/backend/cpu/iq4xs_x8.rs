//! IQ4_XS repacked eight rows at a time (`IQ4_XS×8`, stored in an
//! [`super::x8::X8`]), and its decoding kernels for AVX-512 VNNI and for
//! AVX2: one token against 8 rows per call.
//!
//! Why repack: the row-major decoding kernels (`qgemm_k_decode` with
//! 512-bit registers, `qgemm_lanes::rows_iq4xs` at AVX2) read each of the
//! 8 rows as its own stream and pay per row what 8 rows in lanes share:
//! the spreading of the 6-bit scales, a multiply by the scale per 32
//! weights, and the reduction of the row's lanes at the end of every
//! superblock. A synthetic R1-Distill-Qwen-1.5B IQ4_XS decoded at 34% of
//! the measured read bandwidth that way, against 66% for the same model
//! in IQ4_NL (whose block is the same nibbles with an f16 scale per 32
//! weights) through the repacked IQ4_NL×8 (README, Speed).
//!
//! # Layout
//! Rows `8R..8R + 8`, superblock `b`: a group of [`GROUP_BYTES`] = 8 × 136
//! bytes (the 8 rows' superblocks rearranged, read front to back):
//!
//! | bytes | holds |
//! |---|---|
//! | 0..16 | `d` of rows 0..7 (f16) |
//! | 16..32 | `scales_h` of rows 0..7 (u16) |
//! | 32..64 | `scales_l` of rows 0..7 (4 bytes each) |
//! | 64..1088 | for line l < 16, 64 bytes at 64 + 64·l: byte 8r + j is `qs[8l + j]` of row r |
//!
//! Line l holds 8 bytes of block `l / 2` (32 weights) of every row: their
//! low nibbles are the block's weights `8·(l % 2) + j`, the high nibbles
//! weights `16 + 8·(l % 2) + j`. A 64-byte load is therefore 8 indices of
//! each row in each nibble half, row r in qword r (32-bit lanes 2r and
//! 2r + 1), and AVX2 reads it as two halves (rows 0..4, 4..8). The quants
//! are laid out as Q4_K×8's (`q4k_x8`), so prefill packs its micro tiles
//! straight from a row block through the same [`super::x8::group_map`]
//! machinery.
//!
//! # Arithmetic
//! Weight i of block k is `d · (ls_k − 32) · v(q_i)`, v the 16-value grid
//! (−127..113), `ls_k` 6 bits (4 in `scales_l`, 2 in `scales_h`). Every
//! kernel here computes `qgemm_lanes::dot_scalar`'s exact integer per row
//! and superblock, `Σ_k (ls_k − 32) · Σ_i v(q_i) · y_i`, then its float
//! step `fma(dy·d, f32(isum), acc)`, so a matrix gives the same logits
//! repacked or not, at every level:
//! - VNNI ([`decode_vnni`]): `vpdpbusd` of the unsigned quants v + 128
//!   (one byte shuffle per 64 indices) against the activations broadcast
//!   to the 8 rows, each block's chain started from −128·Σ_block y (the
//!   Q8_K block sums) in one lane of each row, then one `vpmulld` by the
//!   block's scale for the 8 rows;
//! - AVX2 ([`decode_avx2`]): ggml's sign trick with the roles swapped, as
//!   `rows_iq4xs`: |y| (computed once for the 8 rows) against the signed
//!   grid value with y's sign, each `maddubs` pair y·v exact within
//!   2·128·127 < 2¹⁵, and one `madd` by the block's scale, spread to the
//!   row's 16-bit lanes.
//!
//! The scales of the 8 rows are decoded once per group
//! (`qgemm_lanes::iq4_scale_fields`) and spread to a block's lanes by
//! one byte shuffle and one arithmetic shift.

use super::qgemm_lanes::{IQ4_XS_BYTES, Q8_K_BYTES, ROWS};

/// Bytes of one group (8 rows × one superblock).
pub const GROUP_BYTES: usize = ROWS * IQ4_XS_BYTES;

/// Offsets in a group.
const G_SH: usize = 16;
const G_SL: usize = 32;
const G_Q: usize = 64;

/// Where row `r`'s bytes of one superblock lie in its group (see the
/// module doc): `(offset in the superblock, offset in the group, length)`.
pub(super) fn segments(r: usize) -> impl Iterator<Item = (usize, usize, usize)> {
    let d = std::iter::once((0, 2 * r, 2));
    let sh = std::iter::once((2, G_SH + 2 * r, 2));
    let sl = std::iter::once((4, G_SL + 4 * r, 4));
    let qs = (0..16).map(move |l| (8 + 8 * l, G_Q + 64 * l + 8 * r, 8));
    d.chain(sh).chain(sl).chain(qs)
}

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// The 8 rows' scales `ls − 32` (−32..31) of a group, row r's 8 at byte
/// 8r (block k at byte 8r + k).
///
/// # Safety
/// `g` points to a readable group.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn row_scales(g: *const u8) -> [u64; ROWS] {
    use super::qgemm_lanes::iq4_scale_fields;
    std::array::from_fn(|r| {
        // SAFETY: the fields lie in the group (the caller's contract).
        let (h, l) = unsafe {
            (
                g.add(G_SH + 2 * r).cast::<u16>().read_unaligned(),
                g.add(G_SL + 4 * r).cast::<u32>().read_unaligned(),
            )
        };
        // ls − 32 byte by byte (a u64 subtraction would borrow across)
        let ls = iq4_scale_fields(u16::from_le(h), u32::from_le(l));
        u64::from_le_bytes(ls.to_le_bytes().map(|b| b.wrapping_sub(32)))
    })
}

/// Byte-shuffle masks that spread block k's scale (byte 8m + k of a
/// 128-bit lane holding two rows' scale bytes, m < 2) to the top byte of
/// each 16-bit lane of row m's half of the lane (AVX2, `madd`), zeros
/// elsewhere: an arithmetic shift by 8 then sign-extends it.
#[cfg(target_arch = "x86_64")]
static SPREAD16: [[u8; 16]; 8] = spread(2);

/// As [`SPREAD16`], to the top byte of each 32-bit lane (VNNI, `vpmulld`),
/// shifted down by 24.
#[cfg(target_arch = "x86_64")]
static SPREAD32: [[u8; 16]; 8] = spread(4);

#[cfg(target_arch = "x86_64")]
const fn spread(width: usize) -> [[u8; 16]; 8] {
    let mut t = [[0x80u8; 16]; 8];
    let mut k = 0;
    while k < 8 {
        let mut b = 0;
        while b < 16 {
            if b % width == width - 1 {
                t[k][b] = (8 * (b / 8) + k) as u8;
            }
            b += 1;
        }
        k += 1;
    }
    t
}

/// One token against 8 repacked rows at AVX2, the rows in two halves of 4
/// (row 4h + j's sums in 32-bit lanes 2j, 2j + 1 of half h).
///
/// # Safety
/// AVX2, FMA, F16C; `x` holds `nb` groups, `y` `nb` Q8_K blocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn decode_avx2(nb: usize, x: *const u8, y: *const u8) -> [f32; ROWS] {
    use super::q4k_x8::fold_halves;
    use super::qgemm_lanes::{float_step, iq4_grid};
    // SAFETY: the function's contract: the features are enabled, every
    // load is inside the nb groups / blocks.
    unsafe {
        let nib = _mm256_set1_epi8(0x0f);
        let grid = iq4_grid(false);
        let mut acc = _mm256_setzero_ps();
        for b in 0..nb {
            let g = x.add(b * GROUP_BYTES);
            super::mem::prefetch_ahead(g, GROUP_BYTES);
            let yb = y.add(b * Q8_K_BYTES);
            let ls = row_scales(g);
            let sc = [0, 4].map(|r| {
                let q = |i: usize| ls[r + i] as i64;
                _mm256_setr_epi64x(q(0), q(1), q(2), q(3))
            });
            let mut isum = [_mm256_setzero_si256(); 2];
            for k in 0..8 {
                let m = _mm256_broadcastsi128_si256(_mm_loadu_si128(SPREAD16[k].as_ptr().cast()));
                let s = sc.map(|v| _mm256_srai_epi16::<8>(_mm256_shuffle_epi8(v, m)));
                for e in 0..2 {
                    // the 8 activations of the low nibbles, then of the high ones
                    let ya = |at: usize| {
                        _mm256_set1_epi64x(yb.add(4 + 32 * k + at).cast::<i64>().read_unaligned())
                    };
                    let (ylo, yhi) = (ya(8 * e), ya(16 + 8 * e));
                    let (alo, ahi) = (_mm256_abs_epi8(ylo), _mm256_abs_epi8(yhi));
                    for (h, isum) in isum.iter_mut().enumerate() {
                        let q = _mm256_loadu_si256(g.add(G_Q + 64 * (2 * k + e) + 32 * h).cast());
                        let lo = _mm256_shuffle_epi8(grid, _mm256_and_si256(q, nib));
                        let hi = _mm256_shuffle_epi8(
                            grid,
                            _mm256_and_si256(_mm256_srli_epi16::<4>(q), nib),
                        );
                        let plo = _mm256_maddubs_epi16(alo, _mm256_sign_epi8(lo, ylo));
                        let phi = _mm256_maddubs_epi16(ahi, _mm256_sign_epi8(hi, yhi));
                        *isum = _mm256_add_epi32(*isum, _mm256_madd_epi16(plo, s[h]));
                        *isum = _mm256_add_epi32(*isum, _mm256_madd_epi16(phi, s[h]));
                    }
                }
            }
            let d = _mm256_cvtph_ps(_mm_loadu_si128(g.cast()));
            let dy = yb.cast::<f32>().read_unaligned();
            acc = float_step(dy, d, fold_halves(isum[0], isum[1]), acc);
        }
        let mut out = [0f32; ROWS];
        // SAFETY: out holds 8 floats. (+ 0.0 as dot_scalar's acc + acc_m)
        _mm256_storeu_ps(out.as_mut_ptr(), _mm256_add_ps(acc, _mm256_setzero_ps()));
        out
    }
}

/// One token against 8 repacked rows with 512-bit registers (all 8 rows in
/// one): row r's sums in 32-bit lanes 2r, 2r + 1.
///
/// # Safety
/// AVX-512 F/BW/VL and VNNI; `x` holds `nb` groups, `y` `nb` Q8_K blocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn decode_vnni(nb: usize, x: *const u8, y: *const u8) -> [f32; ROWS] {
    use super::q4k_x8::fold_pairs;
    use super::qgemm_lanes::{float_step, iq4_grid_bytes};
    // SAFETY: the function's contract: the features are enabled, every
    // load is inside the nb groups / blocks.
    unsafe {
        let nib = _mm512_set1_epi8(0x0f);
        let table = iq4_grid_bytes(true);
        let grid = _mm512_broadcast_i32x4(_mm_loadu_si128(table.as_ptr().cast()));
        let mut acc = _mm256_setzero_ps();
        for b in 0..nb {
            let g = x.add(b * GROUP_BYTES);
            super::mem::prefetch_ahead(g, GROUP_BYTES);
            let yb = y.add(b * Q8_K_BYTES);
            let ls = row_scales(g).map(|v| v as i64);
            let sc = _mm512_setr_epi64(ls[0], ls[1], ls[2], ls[3], ls[4], ls[5], ls[6], ls[7]);
            let mut isum = _mm512_setzero_si512();
            for k in 0..8 {
                // −128·Σ y of the block (Q8_K's 16-value sums 2k, 2k + 1),
                // in one lane of each row
                let bs = |j: usize| yb.add(260 + 2 * j).cast::<i16>().read_unaligned() as i32;
                let mut s0 = _mm512_maskz_set1_epi32(0x5555, -128 * (bs(2 * k) + bs(2 * k + 1)));
                let mut s1 = _mm512_setzero_si512();
                for e in 0..2 {
                    let ya = |at: usize| {
                        _mm512_set1_epi64(yb.add(4 + 32 * k + at).cast::<i64>().read_unaligned())
                    };
                    let q = _mm512_loadu_si512(g.add(G_Q + 64 * (2 * k + e)).cast());
                    let lo = _mm512_shuffle_epi8(grid, _mm512_and_si512(q, nib));
                    let hi =
                        _mm512_shuffle_epi8(grid, _mm512_and_si512(_mm512_srli_epi16::<4>(q), nib));
                    s0 = _mm512_dpbusd_epi32(s0, lo, ya(8 * e));
                    s1 = _mm512_dpbusd_epi32(s1, hi, ya(16 + 8 * e));
                }
                let m = _mm512_broadcast_i32x4(_mm_loadu_si128(SPREAD32[k].as_ptr().cast()));
                let s = _mm512_srai_epi32::<24>(_mm512_shuffle_epi8(sc, m));
                isum = _mm512_add_epi32(isum, _mm512_mullo_epi32(_mm512_add_epi32(s0, s1), s));
            }
            let d = _mm256_cvtph_ps(_mm_loadu_si128(g.cast()));
            let dy = yb.cast::<f32>().read_unaligned();
            acc = float_step(dy, d, fold_pairs(isum), acc);
        }
        let mut out = [0f32; ROWS];
        // SAFETY: out holds 8 floats. (+ 0.0 as dot_scalar's acc + acc_m)
        _mm256_storeu_ps(out.as_mut_ptr(), _mm256_add_ps(acc, _mm256_setzero_ps()));
        out
    }
}
