//! Q4_0 and Q5_0 × Q8_0 tile kernels (AVX-512 VNNI and AVX2): `MR`
//! weight rows × `N` tokens per call ([`TileFn`]; `N` = 4 for batched
//! prefill, 1 for decoding), so each weight block is loaded and unpacked
//! once for `N` tokens and each activation block (and its block sums) once
//! for `MR` rows.
//!
//! The weight types are 32-weight blocks with an f16 scale `d` in front:
//! Q4_0 holds 16 bytes of nibbles (weight i < 16 is the low nibble of byte
//! i, weight i ≥ 16 the high nibble of byte i − 16), each nibble q standing
//! for q − 8. Q5_0 holds a little-endian u32 `qh` (bit i: the 5th bit of
//! weight i), then Q4_0's 16 bytes of nibbles; each 5-bit q stands for
//! q − 16. Activations are Q8_0 (ggml's format for both). (Q8_0 weights
//! have kernels of their own, `qgemm_q8_0_tokens`, since 2026-12-06 at
//! every level; they ran here before, in ggml's arithmetic.)
//!
//! Per (row, token) the arithmetic is that of ggml's x86
//! `ggml_vec_dot_q4_0_q8_0` / `_q5_0_q8_0` (AVX2 branch) lane
//! for lane, so results agree with it bit for bit (tests/engine/kernels.rs):
//! per block, 8 i32 lanes, lane k = Σ of the 4 products of weights
//! 4k..4k+3 with their activations (exact integers), then
//! `acc = fma(dx·dy, lanes, acc)` with `dx·dy` one f32 product; result
//! ggml's `hsum_float_8(acc)`.
//!
//! How the lanes are formed (any exact way gives the same integers):
//! - VNNI: weights as unsigned bytes u = w + o (o = 8 for Q4_0, the raw
//!   nibble; o = 16 for Q5_0, the raw 5-bit value, its high bits added
//!   under a byte mask), so one `vpdpbusd` of u with the activation,
//!   started from −o·(the activation's 4-byte group sums), is Σ w·y. The
//!   group sums are made once per token and block.
//! - AVX2: `maddubs(u, y)` + the same −o·sums (Q5_0's high bits spread
//!   from `qh` to bytes by a shuffle and compare).
//!
//! [`tile_scalar`] is the scalar model of that arithmetic. The weight type
//! is a const parameter, [`W_Q4_0`] or [`W_Q5_0`].

use super::isa::{detected, Level};
use super::qgemm_x86::MR;
use half::f16;

/// A tile kernel: `(nb, MR weight rows, N token rows) -> out[r][t]`.
pub type TileFn<const N: usize> = fn(usize, &[&[u8]; MR], &[&[u8]; N]) -> [[f32; N]; MR];

/// ggml's `hsum_float_8`.
#[inline]
fn hsum8(acc: &[f32; 8]) -> f32 {
    let h: [f32; 4] = std::array::from_fn(|i| acc[4 + i] + acc[i]);
    (h[0] + h[2]) + (h[1] + h[3])
}

/// The const parameter of a Q4_0 weight matrix.
pub const W_Q4_0: u8 = 1;
/// The const parameter of a Q5_0 weight matrix.
pub const W_Q5_0: u8 = 2;

/// Bytes of a Q8_0 block: `d` (f16), `qs[32]` (i8).
pub const Q8_0_BYTES: usize = 34;
/// Bytes of a Q4_0 block: `d` (f16), `qs[16]` (nibbles).
pub const Q4_0_BYTES: usize = 18;
/// Bytes of a Q5_0 block: `d` (f16), `qh` (u32), `qs[16]` (nibbles).
pub const Q5_0_BYTES: usize = 22;

/// Bytes of one weight block of type `W`.
const fn block_bytes(w: u8) -> usize {
    if w == W_Q5_0 {
        Q5_0_BYTES
    } else {
        Q4_0_BYTES
    }
}

/// The unsigned offset o of a weight of type `W` (its stored value is w + o).
const fn offset(w: u8) -> i32 {
    if w == W_Q5_0 {
        16
    } else {
        8
    }
}

#[inline]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

fn check<const W: u8, const N: usize>(nb: usize, w: &[&[u8]; MR], a: &[&[u8]; N]) {
    assert!(W == W_Q4_0 || W == W_Q5_0, "q8_0 tile: unknown weight type");
    assert!(
        w.iter().all(|r| r.len() >= nb * block_bytes(W)),
        "q8_0 tile: weight row too short"
    );
    assert!(
        a.iter().all(|r| r.len() >= nb * Q8_0_BYTES),
        "q8_0 tile: activation row too short"
    );
}

/// Weight `i` (0..32) of the block `x` of type `W`, as its integer value.
#[inline]
fn weight<const W: u8>(x: &[u8], i: usize) -> i32 {
    // the nibbles follow the scale (Q4_0) or the scale and qh (Q5_0)
    let qs = if W == W_Q5_0 { 6 } else { 2 };
    let b = x[qs + i % 16];
    let mut q = if i < 16 { b & 0x0f } else { b >> 4 };
    if W == W_Q5_0 {
        let qh = u32::from_le_bytes([x[2], x[3], x[4], x[5]]);
        q |= (((qh >> i) & 1) as u8) << 4;
    }
    q as i32 - offset(W)
}

/// Scalar model of the tile (see the module doc).
pub fn tile_scalar<const W: u8, const N: usize>(
    nb: usize,
    w: &[&[u8]; MR],
    a: &[&[u8]; N],
) -> [[f32; N]; MR] {
    check::<W, N>(nb, w, a);
    let bw = block_bytes(W);
    let mut out = [[0f32; N]; MR];
    for r in 0..MR {
        for t in 0..N {
            let mut acc = [0f32; 8];
            for b in 0..nb {
                let x = &w[r][b * bw..(b + 1) * bw];
                let y = &a[t][b * Q8_0_BYTES..(b + 1) * Q8_0_BYTES];
                let d = f16_at(x, 0) * f16_at(y, 0);
                for (k, s) in acc.iter_mut().enumerate() {
                    let lane: i32 = (4 * k..4 * k + 4)
                        .map(|i| weight::<W>(x, i) * y[2 + i] as i8 as i32)
                        .sum();
                    *s = d.mul_add(lane as f32, *s);
                }
            }
            out[r][t] = hsum8(&acc);
        }
    }
    out
}

/// The SIMD tile of `N` tokens for weight type `W` at kernel level
/// `level` (AVX-512 VNNI, or AVX2 for the avx2 and avx512 levels), if this
/// CPU runs it.
pub fn tile_for<const W: u8, const N: usize>(level: Level) -> Option<TileFn<N>> {
    if level > detected() {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    {
        match level {
            Level::Avx512Vnni | Level::Amx => return Some(tile_simd::<W, N, true>),
            Level::Avx2 | Level::Avx512 => return Some(tile_simd::<W, N, false>),
            Level::Portable => {}
        }
    }
    None
}

/// The SIMD tile (`VNNI`: the AVX-512 VNNI one, else AVX2).
#[cfg(target_arch = "x86_64")]
fn tile_simd<const W: u8, const N: usize, const VNNI: bool>(
    nb: usize,
    w: &[&[u8]; MR],
    a: &[&[u8]; N],
) -> [[f32; N]; MR] {
    check::<W, N>(nb, w, a);
    // SAFETY: handed out (tile_for) only where the CPU has AVX2, FMA and
    // F16C (isa level avx2 or above), and with VNNI only where it also has
    // AVX-512 F/BW/VL/VNNI (level avx512vnni); every row holds nb blocks
    // (checked just above), which bounds all loads.
    unsafe {
        if VNNI {
            tile_vnni_impl::<W, N>(nb, w, a)
        } else {
            tile_avx2_impl::<W, N>(nb, w, a)
        }
    }
}

/// Decoding (`N` = 1) reads each weight once, from rows too short for the
/// hardware prefetcher to get going: fetch block `b` (`bw` bytes) of the
/// micro tile after next (the `MR` rows 2 tiles on, which `matvec_k`
/// takes from a contiguous `QMat`) into L2 (`_MM_HINT_T1`: into L1 it was
/// slower on Zen 4; see `qgemm_lanes::PREFETCH_CALLS`). Only a hint (it
/// doubles one thread's decoding speed on a 1.5B Q8_0 model): an address
/// outside the matrix is never read, just not usefully prefetched. Used by
/// every tile here.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_next_tile<const N: usize>(wp: &[*const u8; MR], nb: usize, bw: usize, b: usize) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
    if N == 1 {
        let ahead = (2 * MR * nb + b) * bw;
        for p in wp {
            for line in (0..bw).step_by(64) {
                // SAFETY: a prefetch never faults and reads nothing the
                // program sees; the address keeps `p`'s provenance
                // (wrapping_add).
                unsafe { _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(ahead + line).cast()) };
            }
        }
    }
}

/// The f32 scale of block `b` of every row in `p` (`bytes` per block).
///
/// # Safety
/// Every pointer must have block `b` (`bytes` each) readable.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn scales<const K: usize>(p: &[*const u8; K], b: usize, bytes: usize) -> [f32; K] {
    std::array::from_fn(|k| {
        // SAFETY: block b of row k is readable (the caller's contract).
        let bits = unsafe { p[k].add(b * bytes).cast::<u16>().read_unaligned() };
        f16::from_bits(bits).to_f32()
    })
}

/// What every tile takes from block `b` before its products: pointers to
/// the weight rows' blocks, their scales, the tokens' scales and quants
/// (and the prefetch of the next tile when decoding).
///
/// # Safety
/// Block `b` (`bw` bytes per weight block) of every row must be readable;
/// AVX must be available.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(clippy::type_complexity)]
unsafe fn block_start<const N: usize>(
    w: &[&[u8]; MR],
    a: &[&[u8]; N],
    nb: usize,
    bw: usize,
    b: usize,
) -> (
    [*const u8; MR],
    [f32; MR],
    [f32; N],
    [std::arch::x86_64::__m256i; N],
) {
    let wp: [*const u8; MR] = std::array::from_fn(|r| w[r].as_ptr());
    let ap: [*const u8; N] = std::array::from_fn(|t| a[t].as_ptr());
    // SAFETY: block b of every row is readable (the caller's contract).
    let (xd, yd) = unsafe { (scales(&wp, b, bw), scales(&ap, b, Q8_0_BYTES)) };
    prefetch_next_tile::<N>(&wp, nb, bw, b);
    // SAFETY: as above; a block's quants follow its 2-byte scale; AVX is the
    // caller's contract.
    let xs = std::array::from_fn(|r| unsafe { wp[r].add(b * bw) });
    let ys = std::array::from_fn(|t| unsafe {
        std::arch::x86_64::_mm256_loadu_si256(ap[t].add(b * Q8_0_BYTES + 2).cast())
    });
    (xs, xd, yd, ys)
}

/// The 32 nibbles at `qs` (16 bytes: Q4_0's weights + 8, or Q5_0's low 4
/// bits), in weight order.
///
/// # Safety
/// `qs` must point to 16 readable bytes; AVX2 must be available.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn nibbles(qs: *const u8) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    // SAFETY: qs points to 16 readable bytes and AVX2 is available (the
    // caller's contract).
    unsafe {
        let q = _mm_loadu_si128(qs.cast());
        let qq = _mm256_set_m128i(_mm_srli_epi16(q, 4), q);
        _mm256_and_si256(qq, _mm256_set1_epi8(0x0f))
    }
}

/// The `qh` word of the Q5_0 block at `x`: bit i is the 5th bit of weight i.
///
/// # Safety
/// `x` must point to a readable Q5_0 block.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn q5_0_high(x: *const u8) -> u32 {
    // SAFETY: qh is bytes 2..6 of the block (the caller's contract).
    unsafe { x.add(2).cast::<u32>().read_unaligned() }
}

/// The 32 unsigned weights (weight + 16, 0..32) of the Q5_0 block at `x`
/// with AVX2 only: byte i of `qh` broadcast to the 8 bytes of its weights,
/// each tested against its own bit, 16 where it is set.
///
/// # Safety
/// `x` must point to a readable Q5_0 block; AVX2 must be available.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn q5_0_avx2(x: *const u8) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    // SAFETY: the block's nibbles are bytes 6..22 of it (the caller's
    // contract), as is AVX2.
    let (lo, qh) = unsafe { (nibbles(x.add(6)), q5_0_high(x)) };
    // byte i of the vector: byte i / 8 of qh (shuffles stay in 128-bit
    // halves; the broadcast puts all 4 bytes in both)
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
        _mm256_or_si256(lo, _mm256_and_si256(set, _mm256_set1_epi8(16)))
    }
}

/// The tile's 8-lane accumulators reduced by ggml's `hsum_float_8`.
///
/// # Safety
/// AVX must be available.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn reduce<const N: usize>(acc: &[[std::arch::x86_64::__m256; N]; MR]) -> [[f32; N]; MR] {
    let mut out = [[0f32; N]; MR];
    for r in 0..MR {
        for t in 0..N {
            let mut x = [0f32; 8];
            // SAFETY: x holds 8 floats; AVX is the caller's contract.
            unsafe { std::arch::x86_64::_mm256_storeu_ps(x.as_mut_ptr(), acc[r][t]) };
            out[r][t] = hsum8(&x);
        }
    }
    out
}

/// AVX2 tile: lanes by `maddubs` + `madd` (see the module doc).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_avx2_impl<const W: u8, const N: usize>(
    nb: usize,
    w: &[&[u8]; MR],
    a: &[&[u8]; N],
) -> [[f32; N]; MR] {
    use std::arch::x86_64::*;
    let bw = block_bytes(W);
    let ones16 = _mm256_set1_epi16(1);
    let ones8 = _mm256_set1_epi8(1);
    let mut acc = [[_mm256_setzero_ps(); N]; MR];
    for b in 0..nb {
        // SAFETY (all loads): b < nb and each row holds nb blocks.
        let (xs, xd, yd, ys) = unsafe { block_start::<N>(w, a, nb, bw, b) };
        // −o · the 4-byte group sums of each token's block (o = 8 or 16, a
        // shift by 3 or 4)
        let corr: [__m256i; N] = std::array::from_fn(|t| {
            let s = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, ys[t]), ones16);
            let os = if W == W_Q5_0 {
                _mm256_slli_epi32(s, 4)
            } else {
                _mm256_slli_epi32(s, 3)
            };
            _mm256_sub_epi32(_mm256_setzero_si256(), os)
        });
        for r in 0..MR {
            let x = xs[r];
            // the unsigned weights
            let q = if W == W_Q5_0 {
                // SAFETY: x is a whole Q5_0 block (as for all loads above).
                unsafe { q5_0_avx2(x) }
            } else {
                unsafe { nibbles(x.add(2)) }
            };
            for t in 0..N {
                let p = _mm256_madd_epi16(_mm256_maddubs_epi16(q, ys[t]), ones16);
                let lanes = _mm256_add_epi32(p, corr[t]);
                let d = _mm256_set1_ps(xd[r] * yd[t]);
                acc[r][t] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(lanes), acc[r][t]);
            }
        }
    }
    // SAFETY: AVX is enabled in this function.
    unsafe { reduce(&acc) }
}

/// AVX-512 VNNI tile: one `vpdpbusd` per (row, token, block) on unsigned
/// weights, started from the token's offset correction (see the module doc).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn tile_vnni_impl<const W: u8, const N: usize>(
    nb: usize,
    w: &[&[u8]; MR],
    a: &[&[u8]; N],
) -> [[f32; N]; MR] {
    use std::arch::x86_64::*;
    let bw = block_bytes(W);
    // o: the unsigned offset of a weight byte (as a u8 for vpdpbusd)
    let off = _mm256_set1_epi8(offset(W) as i8);
    let sixteen = _mm256_set1_epi8(16);
    let mut acc = [[_mm256_setzero_ps(); N]; MR];
    for b in 0..nb {
        // SAFETY (all loads): b < nb and each row holds nb blocks.
        let (xs, xd, yd, ys) = unsafe { block_start::<N>(w, a, nb, bw, b) };
        // −o · the 4-byte group sums of each token's block
        let corr: [__m256i; N] = std::array::from_fn(|t| {
            let s = _mm256_dpbusd_epi32(_mm256_setzero_si256(), off, ys[t]);
            _mm256_sub_epi32(_mm256_setzero_si256(), s)
        });
        for r in 0..MR {
            let x = xs[r];
            let u = if W == W_Q5_0 {
                // 16 added to the nibbles whose bit in qh is set
                // SAFETY: x is a whole Q5_0 block (as for all loads above).
                let (lo, qh) = unsafe { (nibbles(x.add(6)), q5_0_high(x)) };
                _mm256_mask_add_epi8(lo, qh, lo, sixteen)
            } else {
                unsafe { nibbles(x.add(2)) }
            };
            for t in 0..N {
                let lanes = _mm256_dpbusd_epi32(corr[t], u, ys[t]);
                let d = _mm256_set1_ps(xd[r] * yd[t]);
                acc[r][t] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(lanes), acc[r][t]);
            }
        }
    }
    // SAFETY: AVX is enabled in this function.
    unsafe { reduce(&acc) }
}
