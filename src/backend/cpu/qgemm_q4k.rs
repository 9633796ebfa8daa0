//! Q4_K × Q8_K tile kernels (AVX-512 VNNI; AVX2 has [`super::qgemm_q4k_lanes`]): `MR` weight rows × `N` tokens per call, so each
//! unpacked Q4_K superblock (nibbles, 6-bit scales and mins) serves `N`
//! tokens and each Q8_K activation block `MR` rows. `N` = 4 for batched
//! prefill, 1 for decoding (the 4 rows still share one activation load).
//!
//! Per (row, token) the arithmetic is that of ggml's x86
//! `ggml_vec_dot_q4_K_q8_K` (AVX2) lane for lane, so results agree with it
//! bit for bit (tests/engine/kernels.rs):
//!
//! - per superblock, 8 i32 lanes: lane k sums, over the 8 sub-blocks s,
//!   scale[s] · Σ of the 4 products of bytes 4k..4k+3 of s's 32 weights
//!   with their activations (exact integers, so any summation order);
//!   `acc = fma(dy·dx, lanes, acc)`;
//! - the mins: 4 lanes, lane i = min[2i]·(bsum[4i]+bsum[4i+1]) +
//!   min[2i+1]·(bsum[4i+2]+bsum[4i+3]); `acc_m = fma(−dy·dmin, lanes, acc_m)`;
//! - result: ggml's `hsum_float_8(acc)` + ((acc_m0+acc_m2) + (acc_m1+acc_m3)).
//!
//! [`tile_scalar`] is the scalar model of that arithmetic.

use half::f16;

/// Weight rows per tile.
pub const MR: usize = 4;

/// Bytes of a Q4_K superblock: `d`, `dmin` (f16), `scales[12]`, `qs[128]`.
pub const Q4_K_BYTES: usize = 144;
/// Bytes of a Q8_K block: `d` (f32), `qs[256]` (i8), `bsums[16]` (i16).
pub const Q8_K_BYTES: usize = 292;

/// A tile kernel: `(nb, weight rows, token rows) -> out[r][t]`.
pub type TileFn<const N: usize> = fn(usize, &[&[u8]; MR], &[&[u8]; N]) -> [[f32; N]; MR];

#[inline]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

/// The packed `scales[12]` as 16 bytes, the 8 scales then the 8 mins
/// (the same values as [`crate::quant::k_scales_mins`], by 32-bit masks and shifts on
/// little-endian words).
///
/// # Safety
/// `q` must point to 12 readable bytes.
#[cfg(target_arch = "x86_64")]
#[inline]
pub(super) unsafe fn unpack16(q: *const u8) -> [u32; 4] {
    const KMASK1: u32 = 0x3f3f_3f3f;
    const KMASK2: u32 = 0x0f0f_0f0f;
    const KMASK3: u32 = 0x0303_0303;
    let mut u = [0u32; 4];
    // SAFETY: q points to 12 readable bytes (the caller's contract); u
    // holds 16.
    unsafe { std::ptr::copy_nonoverlapping(q, u.as_mut_ptr().cast::<u8>(), 12) };
    u[3] = ((u[2] >> 4) & KMASK2) | (((u[1] >> 6) & KMASK3) << 4);
    let aux = u[1] & KMASK1;
    u[1] = (u[2] & KMASK2) | (((u[0] >> 6) & KMASK3) << 4);
    u[2] = aux;
    u[0] &= KMASK1;
    u
}

fn check<const N: usize>(nb: usize, w: &[&[u8]; MR], a: &[&[u8]; N]) {
    assert!(
        w.iter().all(|r| r.len() >= nb * Q4_K_BYTES),
        "q4_K tile: weight row too short"
    );
    assert!(
        a.iter().all(|r| r.len() >= nb * Q8_K_BYTES),
        "q4_K tile: activation row too short"
    );
}

/// ggml's `hsum_float_8` of `acc` plus its two-step sum of `acc_m`.
#[inline]
fn finish(acc: &[f32; 8], m: &[f32; 4]) -> f32 {
    let h: [f32; 4] = std::array::from_fn(|i| acc[4 + i] + acc[i]);
    let s = (h[0] + h[2]) + (h[1] + h[3]);
    s + ((m[0] + m[2]) + (m[1] + m[3]))
}

/// Scalar model of the tile (see the module doc).
pub fn tile_scalar<const N: usize>(nb: usize, w: &[&[u8]; MR], a: &[&[u8]; N]) -> [[f32; N]; MR] {
    check(nb, w, a);
    let mut out = [[0f32; N]; MR];
    for r in 0..MR {
        for t in 0..N {
            let mut acc = [0f32; 8];
            let mut acc_m = [0f32; 4];
            for b in 0..nb {
                let x = &w[r][b * Q4_K_BYTES..(b + 1) * Q4_K_BYTES];
                let y = &a[t][b * Q8_K_BYTES..(b + 1) * Q8_K_BYTES];
                let yd = f32::from_le_bytes([y[0], y[1], y[2], y[3]]);
                let d = yd * f16_at(x, 0);
                let dmin = -yd * f16_at(x, 2);
                let (sc, mn) = crate::quant::k_scales_mins(&x[4..16]);
                let qs = &x[16..];
                let q8 = &y[4..260];
                let bsum = |i: usize| i16::from_le_bytes([y[260 + 2 * i], y[261 + 2 * i]]) as i32;
                for (i, m) in acc_m.iter_mut().enumerate() {
                    let p = mn[2 * i] as i32 * (bsum(4 * i) + bsum(4 * i + 1))
                        + mn[2 * i + 1] as i32 * (bsum(4 * i + 2) + bsum(4 * i + 3));
                    *m = dmin.mul_add(p as f32, *m);
                }
                let mut lanes = [0i32; 8];
                for s in 0..8 {
                    // sub-block s: chunk s/2, low nibbles if s even
                    let (c, hi) = (s / 2, s % 2 == 1);
                    for (k, lane) in lanes.iter_mut().enumerate() {
                        let mut p = 0i32;
                        for e in 4 * k..4 * k + 4 {
                            let byte = qs[32 * c + e];
                            let q = if hi { byte >> 4 } else { byte & 0x0f };
                            p += q as i32 * q8[64 * c + 32 * hi as usize + e] as i8 as i32;
                        }
                        *lane += sc[s] as i32 * p;
                    }
                }
                for (x, &l) in acc.iter_mut().zip(&lanes) {
                    *x = d.mul_add(l as f32, *x);
                }
            }
            out[r][t] = finish(&acc, &acc_m);
        }
    }
    out
}

/// The SIMD tile of `N` tokens for kernel level `level` (AVX-512 VNNI), if
/// this CPU runs it.
pub fn tile_for<const N: usize>(level: super::isa::Level) -> Option<TileFn<N>> {
    use super::isa::{detected, Level};
    if level > detected() {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    {
        match level {
            Level::Avx512Vnni => return Some(tile_avx512::<N>),
            // AVX2 (and AVX-512 without VNNI) run `qgemm_q4k_lanes`
            Level::Avx2 | Level::Avx512 | Level::Portable => {}
        }
    }
    None
}

/// Decoding (`N` = 1) reads each weight once, from rows too short for the
/// hardware prefetcher to get going: fetch block `b` (`bw` bytes) of the
/// micro tile after next (the `MR` rows 2 tiles on, which `matvec_k`
/// takes from a contiguous `QMat`) into L2 (`_MM_HINT_T1`: into L1 it was
/// slower on Zen 4; see `qgemm_lanes::PREFETCH_CALLS`). Only a hint (it
/// doubles one thread's decoding speed on a 1.5B Q8_0 model): an address
/// outside the matrix is never read, just not usefully prefetched. Used by
/// every tile of this call shape (`qgemm_q4k`, `qgemm_q5k`, `qgemm_q6k`,
/// `qgemm_q8_0`).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) fn prefetch_next_tile<const N: usize>(
    wp: &[*const u8; MR],
    nb: usize,
    bw: usize,
    b: usize,
) {
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

#[cfg(target_arch = "x86_64")]
fn tile_avx512<const N: usize>(nb: usize, w: &[&[u8]; MR], a: &[&[u8]; N]) -> [[f32; N]; MR] {
    check(nb, w, a);
    // SAFETY: handed out (tile_for) only where the CPU has AVX-512
    // F/BW/VL/VNNI (isa level avx512vnni, which includes AVX2, FMA, F16C:
    // isa::detect checks those first); every row
    // holds nb superblocks (checked just above), which bounds all loads.
    unsafe { tile_avx512_impl::<N>(nb, w, a) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn tile_avx512_impl<const N: usize>(
    nb: usize,
    w: &[&[u8]; MR],
    a: &[&[u8]; N],
) -> [[f32; N]; MR] {
    use std::arch::x86_64::*;
    let wp: [*const u8; MR] = std::array::from_fn(|r| w[r].as_ptr());
    let ap: [*const u8; N] = std::array::from_fn(|t| a[t].as_ptr());
    let low = _mm512_set1_epi8(0x0f);
    let mut acc = [[_mm256_setzero_ps(); N]; MR];
    let mut acc_m = [[_mm_setzero_ps(); N]; MR];
    for b in 0..nb {
        prefetch_next_tile::<N>(&wp, nb, Q4_K_BYTES, b);
        // per token: dy, the 8 pair sums of bsums (i16), the 4 q8 chunks
        let mut yd = [0f32; N];
        let mut q8s = [_mm_setzero_si128(); N];
        for t in 0..N {
            // SAFETY (all loads): b < nb and each row holds nb blocks.
            let y = unsafe { ap[t].add(b * Q8_K_BYTES) };
            yd[t] = unsafe { y.cast::<f32>().read_unaligned() };
            let bs = unsafe { _mm256_loadu_si256(y.add(260).cast()) };
            q8s[t] = _mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256(bs, 1));
        }
        for r in 0..MR {
            let x = unsafe { wp[r].add(b * Q4_K_BYTES) };
            let xd = f16::from_bits(unsafe { x.cast::<u16>().read_unaligned() }).to_f32();
            let xm = f16::from_bits(unsafe { x.add(2).cast::<u16>().read_unaligned() }).to_f32();
            // [8 scales, 8 mins] as 16 i16
            // SAFETY: x + 4 is the block's 12 scale bytes.
            let u = unsafe { unpack16(x.add(4)) };
            let sm = _mm256_cvtepu8_epi16(_mm_set_epi32(
                u[3] as i32,
                u[2] as i32,
                u[1] as i32,
                u[0] as i32,
            ));
            let mins = _mm256_extracti128_si256(sm, 1);
            let sm512 = _mm512_castsi256_si512(sm);
            // per chunk c: scale of sub-block 2c in the low 256 bits, 2c+1 high
            let scv: [__m512i; 4] = std::array::from_fn(|c| {
                let idx = _mm512_inserti64x4(
                    _mm512_castsi256_si512(_mm256_set1_epi16(2 * c as i16)),
                    _mm256_set1_epi16(2 * c as i16 + 1),
                    1,
                );
                _mm512_permutexvar_epi16(idx, sm512)
            });
            // nibbles of chunk c: low nibbles (sub-block 2c), then high (2c+1)
            let q4: [__m512i; 4] = std::array::from_fn(|c| {
                let v = unsafe { _mm256_loadu_si256(x.add(16 + 32 * c).cast()) };
                let vv = _mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1);
                _mm512_and_si512(vv, low)
            });
            for t in 0..N {
                let y = unsafe { ap[t].add(b * Q8_K_BYTES + 4) };
                let mut sumi = _mm512_setzero_si512();
                for c in 0..4 {
                    let q8 = unsafe { _mm512_loadu_si512(y.add(64 * c).cast()) };
                    let p16 = _mm512_maddubs_epi16(q4[c], q8);
                    sumi = _mm512_dpwssd_epi32(sumi, p16, scv[c]);
                }
                // ggml's lane k = low half's lane k + high half's (exact)
                let s8 = _mm256_add_epi32(
                    _mm512_castsi512_si256(sumi),
                    _mm512_extracti64x4_epi64(sumi, 1),
                );
                let d = _mm256_set1_ps(yd[t] * xd);
                acc[r][t] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(s8), acc[r][t]);
                let prod = _mm_madd_epi16(mins, q8s[t]);
                let dmin = _mm_set1_ps(-yd[t] * xm);
                acc_m[r][t] = _mm_fmadd_ps(dmin, _mm_cvtepi32_ps(prod), acc_m[r][t]);
            }
        }
    }
    let mut out = [[0f32; N]; MR];
    for r in 0..MR {
        for t in 0..N {
            let mut x = [0f32; 8];
            let mut m = [0f32; 4];
            // SAFETY: x holds 8 floats, m 4.
            unsafe {
                _mm256_storeu_ps(x.as_mut_ptr(), acc[r][t]);
                _mm_storeu_ps(m.as_mut_ptr(), acc_m[r][t]);
            }
            out[r][t] = finish(&x, &m);
        }
    }
    out
}
