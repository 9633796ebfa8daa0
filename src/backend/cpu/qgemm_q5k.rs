//! Q5_K × Q8_K tile kernels (AVX-512 VNNI; AVX2 has [`super::qgemm_lanes`]): `MR` weight rows × `N`
//! tokens per call, with the call shape of [`super::qgemm_q4k`] (`N` = 4 for
//! batched prefill, 1 for decoding). Each superblock's 5-bit weights
//! (nibble | high bit) and its scales are unpacked once per row for all `N`
//! tokens.
//!
//! A Q5_K superblock is a Q4_K one with 32 more bytes: `d`, `dmin` (f16),
//! `scales[12]` (6-bit scales and mins, packed as for Q4_K), `qh[32]`,
//! `qs[128]`. Weight `l` (0..32) of sub-block `s` (0..8) has its low 4 bits
//! in `qs[32·(s/2) + l]` (low nibble for even `s`, high for odd) and its
//! 5th bit in bit `s` of `qh[l]`, so it is 0..32.
//!
//! Per (row, token) the arithmetic is that of ggml's x86
//! `ggml_vec_dot_q5_K_q8_K` (AVX2) lane for lane, so results agree with it
//! bit for bit (tests/engine/kernels.rs):
//!
//! - per superblock, 8 i32 lanes: lane k sums, over the 8 sub-blocks s,
//!   scale[s] · Σ of the 4 products of bytes 4k..4k+3 of s's 32 weights
//!   with their activations (exact integers, so any summation order);
//!   `acc = fma(dy·dx, lanes, acc)`;
//! - the mins, unlike Q4_K's, as one exact integer per superblock,
//!   Σ_j min[j]·(bsum[2j] + bsum[2j+1]), accumulated in a single float:
//!   `summs = fma(−dy·dmin, that, summs)`;
//! - result: ggml's `hsum_float_8(acc)` + `summs`.
//!
//! [`tile_scalar`] is the scalar model of that arithmetic.

use super::isa::{detected, Level};
#[cfg(target_arch = "x86_64")]
use super::qgemm_q4k::{prefetch_next_tile, unpack16};
use super::qgemm_q4k::{TileFn, MR, Q8_K_BYTES};
use super::qgemm_q6k::hsum8;
use half::f16;

/// Bytes of a Q5_K superblock: `d`, `dmin` (f16), `scales[12]`, `qh[32]`,
/// `qs[128]`.
pub const Q5_K_BYTES: usize = 176;

#[inline]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

fn check<const N: usize>(nb: usize, w: &[&[u8]; MR], a: &[&[u8]; N]) {
    assert!(
        w.iter().all(|r| r.len() >= nb * Q5_K_BYTES),
        "q5_K tile: weight row too short"
    );
    assert!(
        a.iter().all(|r| r.len() >= nb * Q8_K_BYTES),
        "q5_K tile: activation row too short"
    );
}

/// Scalar model of the tile (see the module doc).
pub fn tile_scalar<const N: usize>(nb: usize, w: &[&[u8]; MR], a: &[&[u8]; N]) -> [[f32; N]; MR] {
    check(nb, w, a);
    let mut out = [[0f32; N]; MR];
    for r in 0..MR {
        for t in 0..N {
            let mut acc = [0f32; 8];
            let mut summs = 0f32;
            for b in 0..nb {
                let x = &w[r][b * Q5_K_BYTES..(b + 1) * Q5_K_BYTES];
                let y = &a[t][b * Q8_K_BYTES..(b + 1) * Q8_K_BYTES];
                let yd = f32::from_le_bytes([y[0], y[1], y[2], y[3]]);
                let d = yd * f16_at(x, 0);
                let dmin = -yd * f16_at(x, 2);
                let (sc, mn) = crate::quant::k_scales_mins(&x[4..16]);
                let (qh, qs) = (&x[16..48], &x[48..176]);
                let q8 = &y[4..260];
                let bsum = |i: usize| i16::from_le_bytes([y[260 + 2 * i], y[261 + 2 * i]]) as i32;
                let m: i32 = (0..8)
                    .map(|j| mn[j] as i32 * (bsum(2 * j) + bsum(2 * j + 1)))
                    .sum();
                summs = dmin.mul_add(m as f32, summs);
                let mut lanes = [0i32; 8];
                for s in 0..8 {
                    // sub-block s: nibbles of chunk s/2 (low if s even), bit s of qh
                    let (c, hi) = (s / 2, s % 2 == 1);
                    for (k, lane) in lanes.iter_mut().enumerate() {
                        let mut p = 0i32;
                        for l in 4 * k..4 * k + 4 {
                            let byte = qs[32 * c + l];
                            let lo = if hi { byte >> 4 } else { byte & 0x0f };
                            let q = lo | (((qh[l] >> s) & 1) << 4);
                            p += q as i32 * q8[32 * s + l] as i8 as i32;
                        }
                        *lane += sc[s] as i32 * p;
                    }
                }
                for (x, &l) in acc.iter_mut().zip(&lanes) {
                    *x = d.mul_add(l as f32, *x);
                }
            }
            out[r][t] = hsum8(&acc) + summs;
        }
    }
    out
}

/// The SIMD tile of `N` tokens for kernel level `level` (AVX-512 VNNI), if
/// this CPU runs it; AVX2 has `qgemm_lanes`, below it ggml's `vec_dot`.
pub fn tile_for<const N: usize>(level: Level) -> Option<TileFn<N>> {
    if level > detected() {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    {
        match level {
            Level::Avx512Vnni => return Some(tile_vnni::<N>),
            // AVX2 (and AVX-512 without VNNI) run `qgemm_lanes`
            Level::Avx2 | Level::Avx512 | Level::Portable => {}
        }
    }
    None
}

/// The AVX-512 VNNI tile.
#[cfg(target_arch = "x86_64")]
fn tile_vnni<const N: usize>(nb: usize, w: &[&[u8]; MR], a: &[&[u8]; N]) -> [[f32; N]; MR] {
    check(nb, w, a);
    // SAFETY: handed out (tile_for) only where the CPU has AVX-512
    // F/BW/VL/VNNI, AVX2, FMA and F16C (level avx512vnni); every row holds
    // nb superblocks (checked just above), which bounds all loads.
    unsafe { tile_avx512_impl::<N>(nb, w, a) }
}

/// Per token of block `b`: `dy` and the 8 pair sums of its block sums
/// (bsum[2j] + bsum[2j+1], i16).
///
/// # Safety
/// Block `b` of every token row must be readable; AVX2 must be available.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn token_block<const N: usize>(
    ap: &[*const u8; N],
    b: usize,
) -> ([f32; N], [std::arch::x86_64::__m128i; N]) {
    use std::arch::x86_64::*;
    let mut yd = [0f32; N];
    // SAFETY: AVX2 is available (the caller's contract).
    let mut q8s = [unsafe { _mm_setzero_si128() }; N];
    for t in 0..N {
        // SAFETY: block b of token row t is readable (the caller's contract):
        // d at 0, bsums[16] at 260; AVX2 likewise.
        unsafe {
            let y = ap[t].add(b * Q8_K_BYTES);
            yd[t] = y.cast::<f32>().read_unaligned();
            let bs = _mm256_loadu_si256(y.add(260).cast());
            q8s[t] = _mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256(bs, 1));
        }
    }
    (yd, q8s)
}

/// The superblock's `d`, `dmin` and its scales and mins as 16 i16
/// (8 scales, then 8 mins).
///
/// # Safety
/// `x` must point to a readable Q5_K superblock; AVX2 must be available.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn weight_head(x: *const u8) -> (f32, f32, std::arch::x86_64::__m256i) {
    use std::arch::x86_64::*;
    // SAFETY: d, dmin and the 12 scale bytes are the superblock's first 16
    // bytes (the caller's contract), as is AVX2.
    unsafe {
        let xd = f16::from_bits(x.cast::<u16>().read_unaligned()).to_f32();
        let xm = f16::from_bits(x.add(2).cast::<u16>().read_unaligned()).to_f32();
        let u = unpack16(x.add(4));
        let sm = _mm256_cvtepu8_epi16(_mm_set_epi32(
            u[3] as i32,
            u[2] as i32,
            u[1] as i32,
            u[0] as i32,
        ));
        (xd, xm, sm)
    }
}

/// `summs = fma(−dy·dmin, Σ min·pair sums, summs)` for one (row, token):
/// the 4 i32 of `madd(mins, q8s)` summed exactly.
///
/// # Safety
/// AVX2 must be available.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn mins_step(
    mins: std::arch::x86_64::__m128i,
    q8s: std::arch::x86_64::__m128i,
    dmin: f32,
    summs: f32,
) -> f32 {
    use std::arch::x86_64::*;
    // SAFETY: AVX2 is available (the caller's contract); registers only.
    let m = unsafe {
        let p = _mm_madd_epi16(mins, q8s);
        let p = _mm_add_epi32(p, _mm_unpackhi_epi64(p, p));
        let p = _mm_add_epi32(p, _mm_shuffle_epi32(p, 0b01));
        _mm_cvtsi128_si32(p)
    };
    dmin.mul_add(m as f32, summs)
}

/// The tile's accumulators reduced as ggml does: `hsum_float_8(acc)` + `summs`.
///
/// # Safety
/// AVX must be available.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn reduce<const N: usize>(
    acc: &[[std::arch::x86_64::__m256; N]; MR],
    summs: &[[f32; N]; MR],
) -> [[f32; N]; MR] {
    let mut out = [[0f32; N]; MR];
    for r in 0..MR {
        for t in 0..N {
            let mut x = [0f32; 8];
            // SAFETY: x holds 8 floats; AVX is the caller's contract.
            unsafe { std::arch::x86_64::_mm256_storeu_ps(x.as_mut_ptr(), acc[r][t]) };
            out[r][t] = hsum8(&x) + summs[r][t];
        }
    }
    out
}

/// AVX-512 VNNI tile: two sub-blocks per 512-bit vector, `maddubs` then
/// `vpdpwssd` by their scales; the two 256-bit halves added give ggml's
/// lanes exactly.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn tile_avx512_impl<const N: usize>(
    nb: usize,
    w: &[&[u8]; MR],
    a: &[&[u8]; N],
) -> [[f32; N]; MR] {
    use std::arch::x86_64::*;
    let wp: [*const u8; MR] = std::array::from_fn(|r| w[r].as_ptr());
    let ap: [*const u8; N] = std::array::from_fn(|t| a[t].as_ptr());
    let low = _mm512_set1_epi8(0x0f);
    let one = _mm512_set1_epi8(1);
    // per chunk c: the i16 index of scale 2c in the low 256 bits, 2c+1 high
    let sidx: [__m512i; 4] = std::array::from_fn(|c| {
        _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_set1_epi16(2 * c as i16)),
            _mm256_set1_epi16(2 * c as i16 + 1),
            1,
        )
    });
    let mut acc = [[_mm256_setzero_ps(); N]; MR];
    let mut summs = [[0f32; N]; MR];
    for b in 0..nb {
        prefetch_next_tile::<N>(&wp, nb, Q5_K_BYTES, b);
        // SAFETY (all loads): b < nb and each row holds nb blocks; AVX2 is
        // enabled in this function.
        let (yd, q8s) = unsafe { token_block::<N>(&ap, b) };
        for r in 0..MR {
            let x = unsafe { wp[r].add(b * Q5_K_BYTES) };
            let (xd, xm, sm) = unsafe { weight_head(x) };
            let mins = _mm256_extracti128_si256(sm, 1);
            let sm512 = _mm512_castsi256_si512(sm);
            let scv: [__m512i; 4] =
                std::array::from_fn(|c| _mm512_permutexvar_epi16(sidx[c], sm512));
            // chunk c: sub-blocks 2c (low nibbles, qh bit 2c) in the low
            // half, 2c+1 (high nibbles, qh bit 2c+1) in the high half
            let h = unsafe { _mm256_loadu_si256(x.add(16).cast()) };
            let mut hh = _mm512_inserti64x4(_mm512_castsi256_si512(h), _mm256_srli_epi16(h, 1), 1);
            let mut q5 = [_mm512_setzero_si512(); 4];
            for (c, q) in q5.iter_mut().enumerate() {
                let v = unsafe { _mm256_loadu_si256(x.add(48 + 32 * c).cast()) };
                let vv = _mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1);
                let hi = _mm512_slli_epi16(_mm512_and_si512(hh, one), 4);
                *q = _mm512_or_si512(_mm512_and_si512(vv, low), hi);
                hh = _mm512_srli_epi16(hh, 2);
            }
            for t in 0..N {
                let y = unsafe { ap[t].add(b * Q8_K_BYTES + 4) };
                let mut sumi = _mm512_setzero_si512();
                for c in 0..4 {
                    let q8 = unsafe { _mm512_loadu_si512(y.add(64 * c).cast()) };
                    let p16 = _mm512_maddubs_epi16(q5[c], q8);
                    sumi = _mm512_dpwssd_epi32(sumi, p16, scv[c]);
                }
                let s8 = _mm256_add_epi32(
                    _mm512_castsi512_si256(sumi),
                    _mm512_extracti64x4_epi64(sumi, 1),
                );
                let d = _mm256_set1_ps(yd[t] * xd);
                acc[r][t] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(s8), acc[r][t]);
                summs[r][t] = unsafe { mins_step(mins, q8s[t], -yd[t] * xm, summs[r][t]) };
            }
        }
    }
    // SAFETY: AVX is enabled in this function.
    unsafe { reduce(&acc, &summs) }
}
