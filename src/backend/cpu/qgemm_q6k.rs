//! Q6_K × Q8_K tile kernels (AVX-512 VNNI; AVX2 has [`super::qgemm_lanes`]): `MR` weight rows × `N` tokens
//! per call, like [`super::qgemm_q4k`]; each superblock's 6-bit weights
//! are assembled (low nibbles | high 2 bits) once per row for all `N`
//! tokens.
//!
//! Per (row, token) the arithmetic is that of ggml's x86
//! `ggml_vec_dot_q6_K_q8_K` (AVX2) lane for lane, so results agree with it
//! bit for bit (tests/engine/kernels.rs): per superblock, 8 i32 lanes, lane
//! k summing over the 16 groups g of 16 weights scale[g] · Σ q·q8 of the
//! group's bytes at positions 4k..4k+3 of their 32-byte run (q in 0..64),
//! minus 32·(bsum[2k]·scale[2k] + bsum[2k+1]·scale[2k+1]) (the −32 offset
//! of every weight, through the activation's block sums); exact integers;
//! `acc = fma(dy·dx, lanes, acc)`; result ggml's `hsum_float_8(acc)`.
//! [`tile_scalar`] is the scalar model.

use half::f16;

/// Weight rows per tile.
pub const MR: usize = 4;

/// Bytes of a Q6_K superblock: `ql[128]`, `qh[64]`, `scales[16]` (i8), `d` (f16).
pub const Q6_K_BYTES: usize = 210;
/// Bytes of a Q8_K block: `d` (f32), `qs[256]` (i8), `bsums[16]` (i16).
pub const Q8_K_BYTES: usize = 292;

/// A tile kernel: `(nb, weight rows, token rows) -> out[r][t]`.
pub type TileFn<const N: usize> = fn(usize, &[&[u8]; MR], &[&[u8]; N]) -> [[f32; N]; MR];

fn check<const N: usize>(nb: usize, w: &[&[u8]; MR], a: &[&[u8]; N]) {
    assert!(
        w.iter().all(|r| r.len() >= nb * Q6_K_BYTES),
        "q6_K tile: weight row too short"
    );
    assert!(
        a.iter().all(|r| r.len() >= nb * Q8_K_BYTES),
        "q6_K tile: activation row too short"
    );
}

/// Weight `e` (0..256) of a superblock, 0..64 (subtract 32 for its value).
#[inline]
fn q6(x: &[u8], e: usize) -> i32 {
    // elements 128j + 32i + l: ql byte 64j + l (+32 for i odd), low nibble
    // for i < 2; qh byte 32j + l, bits 2i..2i+2
    let (j, i, l) = (e / 128, (e % 128) / 32, e % 32);
    let ql = x[64 * j + l + 32 * (i % 2)];
    let lo = if i < 2 { ql & 0x0f } else { ql >> 4 };
    let hi = (x[128 + 32 * j + l] >> (2 * i)) & 3;
    (lo | (hi << 4)) as i32
}

/// ggml's `hsum_float_8`.
#[inline]
pub(crate) fn hsum8(acc: &[f32; 8]) -> f32 {
    let h: [f32; 4] = std::array::from_fn(|i| acc[4 + i] + acc[i]);
    (h[0] + h[2]) + (h[1] + h[3])
}

/// Scalar model of the tile (see the module doc).
pub fn tile_scalar<const N: usize>(nb: usize, w: &[&[u8]; MR], a: &[&[u8]; N]) -> [[f32; N]; MR] {
    check(nb, w, a);
    let mut out = [[0f32; N]; MR];
    for r in 0..MR {
        for t in 0..N {
            let mut acc = [0f32; 8];
            for b in 0..nb {
                let x = &w[r][b * Q6_K_BYTES..(b + 1) * Q6_K_BYTES];
                let y = &a[t][b * Q8_K_BYTES..(b + 1) * Q8_K_BYTES];
                let yd = f32::from_le_bytes([y[0], y[1], y[2], y[3]]);
                let xd = f16::from_bits(u16::from_le_bytes([x[208], x[209]])).to_f32();
                let d = yd * xd;
                let mut lanes = [0i32; 8];
                // runs of 32 weights; group g = e / 16 has scale[g]
                for run in 0..8 {
                    for (k, lane) in lanes.iter_mut().enumerate() {
                        let mut p = 0i32;
                        for e in run * 32 + 4 * k..run * 32 + 4 * k + 4 {
                            p += q6(x, e) * y[4 + e] as i8 as i32;
                        }
                        *lane += x[192 + (run * 32 + 4 * k) / 16] as i8 as i32 * p;
                    }
                }
                let bsum = |g: usize| i16::from_le_bytes([y[260 + 2 * g], y[261 + 2 * g]]) as i32;
                let sc = |g: usize| x[192 + g] as i8 as i32;
                for (k, lane) in lanes.iter_mut().enumerate() {
                    *lane -= 32 * (bsum(2 * k) * sc(2 * k) + bsum(2 * k + 1) * sc(2 * k + 1));
                }
                for (x, &l) in acc.iter_mut().zip(&lanes) {
                    *x = d.mul_add(l as f32, *x);
                }
            }
            out[r][t] = hsum8(&acc);
        }
    }
    out
}

/// The SIMD tile of `N` tokens for kernel level `level` (AVX-512 VNNI), if
/// this CPU runs it; AVX2 has `qgemm_lanes`, below it ggml's `vec_dot`.
pub fn tile_for<const N: usize>(level: super::isa::Level) -> Option<TileFn<N>> {
    use super::isa::{detected, Level};
    if level > detected() {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    {
        match level {
            Level::Avx512Vnni => return Some(tile_avx512::<N>),
            // AVX2 (and AVX-512 without VNNI) run `qgemm_lanes`
            Level::Avx2 | Level::Avx512 | Level::Portable => {}
        }
    }
    None
}

#[cfg(target_arch = "x86_64")]
fn tile_avx512<const N: usize>(nb: usize, w: &[&[u8]; MR], a: &[&[u8]; N]) -> [[f32; N]; MR] {
    check(nb, w, a);
    // SAFETY: handed out (tile_for) only where the CPU has AVX-512
    // F/BW/VL/VNNI (isa level avx512vnni, which includes AVX2 and FMA);
    // every row holds nb superblocks (checked just above), which bounds all
    // loads.
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
    let m4 = _mm512_set1_epi8(0x0f);
    let m2 = _mm512_set1_epi8(3);
    // scale index vectors: pair p of a half j covers runs 2p, 2p+1 = groups
    // 4p..4p+4 (8 i16 lanes each)
    let idx: [__m512i; 4] = std::array::from_fn(|p| {
        let g = 4 * p as i16;
        let lo = _mm256_set_m128i(_mm_set1_epi16(g + 1), _mm_set1_epi16(g));
        let hi = _mm256_set_m128i(_mm_set1_epi16(g + 3), _mm_set1_epi16(g + 2));
        _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1)
    });
    let mut acc = [[_mm256_setzero_ps(); N]; MR];
    for b in 0..nb {
        super::qgemm_q4k::prefetch_next_tile::<N>(&wp, nb, Q6_K_BYTES, b);
        // per token: dy and its 16 block sums (its q8 is loaded where used)
        let mut yd = [0f32; N];
        let mut bsums = [_mm256_setzero_si256(); N];
        for t in 0..N {
            // SAFETY (all loads): b < nb and each row holds nb blocks.
            let y = unsafe { ap[t].add(b * Q8_K_BYTES) };
            yd[t] = unsafe { y.cast::<f32>().read_unaligned() };
            bsums[t] = unsafe { _mm256_loadu_si256(y.add(260).cast()) };
        }
        for r in 0..MR {
            let x = unsafe { wp[r].add(b * Q6_K_BYTES) };
            let xd = f16::from_bits(unsafe { x.add(208).cast::<u16>().read_unaligned() }).to_f32();
            let sc16 = _mm256_cvtepi8_epi16(unsafe { _mm_loadu_si128(x.add(192).cast()) });
            let sc512 = _mm512_castsi256_si512(sc16);
            // the 6-bit weights of runs 2p, 2p+1 (p = 2j + h) as 64 bytes
            let mut q6v = [_mm512_setzero_si512(); 4];
            for j in 0..2 {
                let ql1 = unsafe { _mm256_loadu_si256(x.add(64 * j).cast()) };
                let ql2 = unsafe { _mm256_loadu_si256(x.add(64 * j + 32).cast()) };
                let qh = unsafe { _mm256_loadu_si256(x.add(128 + 32 * j).cast()) };
                // runs 4j+0, 4j+1: low nibbles of ql1, ql2; qh bits 0-1, 2-3
                let ql01 = _mm512_inserti64x4(_mm512_castsi256_si512(ql1), ql2, 1);
                // qh shifted per half: run 4j (bits 0-1), run 4j+1 (bits 2-3)
                let qh01 =
                    _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
                let qh23 = _mm512_inserti64x4(
                    _mm512_castsi256_si512(_mm256_srli_epi16(qh, 4)),
                    _mm256_srli_epi16(qh, 6),
                    1,
                );
                let lo = _mm512_and_si512(ql01, m4);
                let hi = _mm512_and_si512(_mm512_srli_epi16(ql01, 4), m4);
                q6v[2 * j] = _mm512_or_si512(lo, _mm512_slli_epi16(_mm512_and_si512(qh01, m2), 4));
                q6v[2 * j + 1] =
                    _mm512_or_si512(hi, _mm512_slli_epi16(_mm512_and_si512(qh23, m2), 4));
            }
            let scv: [__m512i; 4] = std::array::from_fn(|p| {
                // groups of pair p: half j = p / 2 starts at group 8j
                let base = _mm512_set1_epi16(8 * (p / 2) as i16);
                let i = _mm512_add_epi16(idx[p % 2], base);
                _mm512_permutexvar_epi16(i, sc512)
            });
            for t in 0..N {
                let mut sumi = _mm512_setzero_si512();
                let y = unsafe { ap[t].add(b * Q8_K_BYTES + 4) };
                for p in 0..4 {
                    let q8 = unsafe { _mm512_loadu_si512(y.add(64 * p).cast()) };
                    let prod = _mm512_maddubs_epi16(q6v[p], q8);
                    sumi = _mm512_dpwssd_epi32(sumi, prod, scv[p]);
                }
                let s8 = _mm256_add_epi32(
                    _mm512_castsi512_si256(sumi),
                    _mm512_extracti64x4_epi64(sumi, 1),
                );
                // the −32 offsets, per lane as ggml groups them
                let off = _mm256_slli_epi32(_mm256_madd_epi16(bsums[t], sc16), 5);
                let s8 = _mm256_sub_epi32(s8, off);
                let d = _mm256_set1_ps(yd[t] * xd);
                acc[r][t] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(s8), acc[r][t]);
            }
        }
    }
    let mut out = [[0f32; N]; MR];
    for r in 0..MR {
        for t in 0..N {
            let mut x = [0f32; 8];
            // SAFETY: x holds 8 floats.
            unsafe { _mm256_storeu_ps(x.as_mut_ptr(), acc[r][t]) };
            out[r][t] = hsum8(&x);
        }
    }
    out
}
