//! Q6_K, Q3_K and Q2_K repacked eight rows at a time (`Q6_K×8`,
//! `Q3_K×8`, `Q2_K×8`, stored in an [`super::x8::X8`]): the K-quants
//! with a scale per 16 weights, whose quants are read in the same order
//! (weights 128n + 32p + 8h + j from 8-byte chunk h of half n, field p),
//! so one pair of decoding kernels ([`decode_vnni`], [`decode_avx2`]: one
//! token against 8 rows per call) serves all three through [`Sub16`]:
//! how a load's quants are assembled, where the scales lie, and whether
//! the offset is a constant (Q6_K −32, Q3_K −4) or a min per 16 weights
//! (Q2_K).
//!
//! Why repack: Q4_K_M files keep the output head and half of the FFN down
//! projections in Q6_K, about 28% of a 7B's bytes, and the row-major
//! decoding kernels (`qgemm_lanes::rows` at AVX2, `qgemm_k_decode` at
//! AVX-512) pay per row what 8 rows in lanes share: the spreading of each
//! 16-weight scale, the −32 offset, and the reduction of the row's lanes
//! at the end of every superblock. In a perf profile of the 7B's decoding
//! in an x86-64-v3 build, the row-major AVX2 kernel read Q6_K at about
//! two thirds of the speed per byte of the Q4_K×8 kernel. Measured on a
//! Zen 4 VM (README, Speed): one core from L2, 32.7–33.6 against 25.7–28.0
//! GB/s at AVX2 and 46.2–52.7 against 31.6–33.0 at AVX-512 VNNI; the 7B
//! Q4_K_M's decoding with 2 threads 5.6% (AVX2) and 9.6% (VNNI) faster
//! than with Q4_K×8 alone, in one process (`kvrun bench --repack
//! on,q4_k`).
//!
//! A first layout stored all `ql` chunks, then all `qh` chunks: a group
//! was read in three places at once and streamed from memory at half the
//! row-major kernel's speed. The kernels now read a group front to back.
//!
//! # Layout
//! Rows `8R..8R + 8`, superblock `b`: a group of [`GROUP_BYTES`] = 8 × 210
//! bytes (the 8 rows' superblocks rearranged):
//!
//! | bytes | holds |
//! |---|---|
//! | 0..16 | `d` of rows 0..7 (f16) |
//! | 16..144 | for q < 4, 32 bytes at 16 + 32q: byte 4r + i is `scales[4q + i]` of row r |
//! | 144..1680 | for n < 2 and h < 4, 192 bytes at 144 + 192·(4n + h): the 8-byte chunks 8n + h and 8n + 4 + h of `ql`, then chunk 4n + h of `qh`, each as 64 bytes where byte 8r + j is the chunk's byte j of row r |
//!
//! A 64-byte load therefore holds 8 bytes of each row (AVX2 reads it as
//! two 32-byte halves, rows 0..4 and 4..8), and sign-extending 16 (AVX2)
//! or 32 (AVX-512) bytes of scales puts rows 2L and 2L + 1 in 128-bit lane
//! L, 4 scales each: the lane that holds those rows' sums, so one in-lane
//! byte shuffle spreads a scale to its row.
//!
//! # Arithmetic
//! GGUF's Q6_K: 256 weights per superblock, 16 scales (one per 16
//! weights), value = d · scale · (q − 32) with q = 6 bits, the low 4 from
//! `ql`, the high 2 from `qh`. For the 128 weights of half n (< 2) and the
//! 8 bytes h (< 4) of a 32-weight quarter, `ql` chunks 8n + h and
//! 8n + 4 + h and `qh` chunk 4n + h give the unsigned quants of weights
//! 128n + 32p + 8h + j for p = 0..4 (low nibbles, then high; `qh` bits
//! 2p, 2p + 1). `maddubs` of those with the 8 activations (broadcast to
//! the rows) gives pair sums in i16, |sum| ≤ 2·63·128; the two loads h,
//! h + 1 of a 16-weight sub-block add up in i16 (≤ 32256), then one
//! `madd` by the sub-block's scales widens to i32. The −32 offset is
//! `32 · Σ_j scale[j] · bsum[j]` against the activation's 16-value sums,
//! 4 `madd`s per superblock for 8 rows. Both are exact integers, so the
//! per-row integer sum and the float step (`fma(dy·d, isum, acc)`) are
//! `qgemm_lanes::dot_scalar`'s, bit for bit, as every Q6_K kernel is.
//!
//! # Q3_K×8 and Q2_K×8
//! Why: Q3_K_M and Q2_K files decoded at 37–39% of the measured read
//! bandwidth through the row-major kernels (a synthetic 1.5B; README,
//! Speed), which unpack 2-bit fields and scales per row.
//!
//! Q3_K×8, a group of 8 × 110 bytes:
//!
//! | bytes | holds |
//! |---|---|
//! | 0..16 | `d` of rows 0..7 (f16) |
//! | 16..112 | for w < 3, 32 bytes at 16 + 32w: bytes 4w..4w + 4 of the packed `scales` of row r at 4r |
//! | 112..368 | for h < 4, 64 bytes at 112 + 64h: byte 8r + j is `hmask[8h + j]` of row r |
//! | 368..880 | for n < 2 and h < 4, 64 bytes at 368 + 64·(4n + h): byte 8r + j is `qs[32n + 8h + j]` of row r |
//!
//! The 16 six-bit scales are unpacked once per group for the 8 rows at
//! once (ggml's masks and shifts on the three words, one row per 32-bit
//! lane), which gives them in Q6_K×8's layout. A quant is bits 2p of its
//! `qs` byte plus 4 × bit 4n + p of its `hmask` byte (0..8), −4 taken back
//! as `4 · Σ scale·bsum`.
//!
//! Q2_K×8, a group of 8 × 84 bytes:
//!
//! | bytes | holds |
//! |---|---|
//! | 0..16 | `d` of rows 0..7 (f16) |
//! | 16..32 | `dmin` of rows 0..7 (f16) |
//! | 32..160 | for q < 4, 32 bytes at 32 + 32q: `scales[4q..4q + 4]` of row r at 4r (scale in the low nibble, min in the high one) |
//! | 160..672 | `qs` as Q3_K×8's (at 160) |
//!
//! A quant is bits 2p of its `qs` byte (0..4); the mins give
//! `msum = Σ min·bsum` for the second float step
//! (`fma(−dy·dmin, msum, acc_m)`), as `qgemm_lanes::dot_scalar` has it.

use super::qgemm_lanes::{Q2_K_BYTES, Q3_K_BYTES, Q6_K_BYTES, Q8_K_BYTES, ROWS};

/// Bytes of one group (8 rows × one superblock).
pub const GROUP_BYTES: usize = ROWS * Q6_K_BYTES;

/// Offsets in a group.
const G_SC: usize = 16;
const G_Q: usize = 144;

/// Where the quants of (half n, chunk h) start in a group: `ql` chunks
/// 8n + h and 8n + 4 + h, then `qh` chunk 4n + h, 64 bytes each (in the
/// order the kernels read them, so a group is read front to back).
const fn quants_at(n: usize, h: usize) -> usize {
    G_Q + 192 * (4 * n + h)
}

/// Where row `r`'s bytes of one superblock lie in its group (see the
/// module doc): `(offset in the superblock, offset in the group, length)`.
pub(super) fn segments(r: usize) -> impl Iterator<Item = (usize, usize, usize)> {
    let d = std::iter::once((208, 2 * r, 2));
    let scales = (0..4).map(move |q| (192 + 4 * q, G_SC + 32 * q + 4 * r, 4));
    let ql = (0..16).map(move |c| (8 * c, quants_at(c / 8, c % 4) + 64 * (c % 8 / 4) + 8 * r, 8));
    let qh = (0..8).map(move |c| (128 + 8 * c, quants_at(c / 4, c % 4) + 128 + 8 * r, 8));
    d.chain(scales).chain(ql).chain(qh)
}

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Byte-shuffle masks that spread a scale: per 128-bit lane (rows 2L + m,
/// m < 2, 4 sign-extended scales each), every i16 lane of row 2L + m (the
/// row's 4 pair sums, i16 lanes 4m..4m + 4) gets the row's scale i.
#[cfg(target_arch = "x86_64")]
static SPREAD: [[u8; 64]; 4] = {
    let mut t = [[0u8; 64]; 4];
    let mut i = 0;
    while i < 4 {
        let mut b = 0;
        while b < 64 {
            let m = (b % 16) / 8;
            t[i][b] = (2 * (4 * m + i) + b % 2) as u8;
            b += 1;
        }
        i += 1;
    }
    t
};

/// The 4 unsigned 6-bit quant vectors of quarter-chunk h: from the low
/// nibbles of `ql0` (p = 0) and `ql1` (p = 1), then their high nibbles
/// (p = 2, 3), each with its 2 bits of `qh` on top.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn quants_avx2(ql0: __m256i, ql1: __m256i, qh: __m256i) -> [__m256i; 4] {
    // SAFETY: register-only AVX2 ops (the caller's features).
    unsafe {
        let nib = _mm256_set1_epi8(0x0f);
        let top = _mm256_set1_epi8(0x30);
        let hi = |v: __m256i| _mm256_and_si256(v, top);
        [
            _mm256_or_si256(_mm256_and_si256(ql0, nib), hi(_mm256_slli_epi16(qh, 4))),
            _mm256_or_si256(_mm256_and_si256(ql1, nib), hi(_mm256_slli_epi16(qh, 2))),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), nib), hi(qh)),
            _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16(ql1, 4), nib),
                hi(_mm256_srli_epi16(qh, 2)),
            ),
        ]
    }
}

/// A K-quant with a scale per 16 weights laid out as Q6_K×8 reads it:
/// Q6_K×8, Q3_K×8 and Q2_K×8 share the decoding kernels below, which
/// differ per type only in how a load's quants are assembled, where the
/// scales come from, and whether the offset is a constant (Q6_K −32, Q3_K
/// −4) or a min per 16 weights (Q2_K).
#[cfg(target_arch = "x86_64")]
pub(super) trait Sub16 {
    /// Bytes of a group.
    const GROUP_BYTES: usize;
    /// The unsigned quants are `w + 2^SHIFT` (Q6_K 5, Q3_K 2), taken back
    /// as `2^SHIFT · Σ scale·bsum`; 0: no offset but mins (Q2_K), whose
    /// `dmin` follows `d` (bytes 16..32) and whose float step is apart.
    const SHIFT: i32;
    /// The group's scales as Q6_K×8 stores them (for q < 4, 32 bytes at
    /// 32q: byte 4r + i is scale 4q + i of row r, signed) and, for mins,
    /// the mins the same way at 128: in the group itself, or decoded into
    /// `buf`.
    ///
    /// # Safety
    /// `g` points to a readable group; AVX2.
    unsafe fn scales(g: *const u8, buf: &mut Scratch) -> *const u8;
    /// The unsigned quants of load (n, h) (weights 128n + 32p + 8h + j,
    /// p < 4), rows 4k..4k + 4 (256-bit half k).
    ///
    /// # Safety
    /// `g` points to a readable group; AVX2.
    unsafe fn quants_avx2(g: *const u8, n: usize, h: usize, k: usize) -> [__m256i; 4];
    /// As [`Sub16::quants_avx2`], all 8 rows.
    ///
    /// # Safety
    /// `g` points to a readable group; AVX-512 F/BW.
    unsafe fn quants_512(g: *const u8, n: usize, h: usize) -> [__m512i; 4];
}

/// Scales (and mins) decoded once per group, for the kernels' loads.
#[cfg(target_arch = "x86_64")]
#[repr(C, align(64))]
pub(super) struct Scratch([u8; 256]);

#[cfg(target_arch = "x86_64")]
pub(super) struct Q6k;

#[cfg(target_arch = "x86_64")]
impl Sub16 for Q6k {
    const GROUP_BYTES: usize = GROUP_BYTES;
    const SHIFT: i32 = 5;

    #[inline(always)]
    unsafe fn scales(g: *const u8, _: &mut Scratch) -> *const u8 {
        // SAFETY: the scales lie in the group (the caller's contract).
        unsafe { g.add(G_SC) }
    }

    #[inline(always)]
    unsafe fn quants_avx2(g: *const u8, n: usize, h: usize, k: usize) -> [__m256i; 4] {
        // SAFETY: the loads lie in the group; AVX2 (the caller's contract).
        unsafe {
            let ld = |at: usize| _mm256_loadu_si256(g.add(at + 32 * k).cast());
            let at = quants_at(n, h);
            quants_avx2(ld(at), ld(at + 64), ld(at + 128))
        }
    }

    #[inline(always)]
    unsafe fn quants_512(g: *const u8, n: usize, h: usize) -> [__m512i; 4] {
        // SAFETY: the loads lie in the group; AVX-512 F/BW (the caller's
        // contract).
        unsafe {
            let nib = _mm512_set1_epi8(0x0f);
            let top = _mm512_set1_epi8(0x30);
            let hi = |v: __m512i| _mm512_and_si512(v, top);
            let ld = |at: usize| _mm512_loadu_si512(g.add(at).cast());
            let at = quants_at(n, h);
            let (ql0, ql1, qh) = (ld(at), ld(at + 64), ld(at + 128));
            [
                _mm512_or_si512(_mm512_and_si512(ql0, nib), hi(_mm512_slli_epi16(qh, 4))),
                _mm512_or_si512(_mm512_and_si512(ql1, nib), hi(_mm512_slli_epi16(qh, 2))),
                _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql0, 4), nib), hi(qh)),
                _mm512_or_si512(
                    _mm512_and_si512(_mm512_srli_epi16(ql1, 4), nib),
                    hi(_mm512_srli_epi16(qh, 2)),
                ),
            ]
        }
    }
}

/// One token against 8 repacked rows at AVX2, one half (4 rows) at a time.
///
/// # Safety
/// AVX2, FMA, F16C; `x` holds `nb` groups of `T`, `y` `nb` Q8_K blocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn decode_avx2<T: Sub16>(nb: usize, x: *const u8, y: *const u8) -> [f32; ROWS] {
    use super::q4k_x8::fold_halves;
    use super::qgemm_lanes::float_step;
    // SAFETY: the function's contract: the features are enabled, every
    // load is inside the nb groups / blocks.
    unsafe {
        let mut buf = Scratch([0; 256]);
        let mut acc = _mm256_setzero_ps();
        let mut acc_m = _mm256_setzero_ps();
        for b in 0..nb {
            let g = x.add(b * T::GROUP_BYTES);
            super::mem::prefetch_ahead(g, T::GROUP_BYTES);
            let yb = y.add(b * Q8_K_BYTES);
            let scp = T::scales(g, &mut buf);
            // per half k: row 4k + j's sum in 32-bit lanes 2j, 2j + 1
            let half = |k: usize| {
                // the scales (at 128: mins) of sub-blocks 4q..4q + 4, sign-extended
                let sc = |q: usize| {
                    _mm256_cvtepi8_epi16(_mm_loadu_si128(scp.add(32 * q + 16 * k).cast()))
                };
                // the offset or the mins: Σ_j scale[j] (min[j]) · bsum[j]
                let mut off = _mm256_setzero_si256();
                for q in 0..4 {
                    let bq = _mm256_set1_epi64x(yb.add(260 + 8 * q).cast::<i64>().read_unaligned());
                    let m = if T::SHIFT == 0 { sc(4 + q) } else { sc(q) };
                    off = _mm256_add_epi32(off, _mm256_madd_epi16(m, bq));
                }
                let mut isum = _mm256_setzero_si256();
                for n in 0..2 {
                    for hp in 0..2 {
                        // sub-blocks 8n + 2p + hp, p < 4: two loads each
                        let mut s16 = [_mm256_setzero_si256(); 4];
                        for h in 2 * hp..2 * hp + 2 {
                            let v = T::quants_avx2(g, n, h, k);
                            for p in 0..4 {
                                let ya = _mm256_set1_epi64x(
                                    yb.add(4 + 128 * n + 32 * p + 8 * h)
                                        .cast::<i64>()
                                        .read_unaligned(),
                                );
                                s16[p] = _mm256_add_epi16(s16[p], _mm256_maddubs_epi16(v[p], ya));
                            }
                        }
                        for p in 0..4 {
                            // sub-block 8n + 2p + hp = 4q + i
                            let (q, i) = (2 * n + p / 2, 2 * (p % 2) + hp);
                            let m = _mm256_loadu_si256(SPREAD[i].as_ptr().cast());
                            let s = _mm256_shuffle_epi8(sc(q), m);
                            isum = _mm256_add_epi32(isum, _mm256_madd_epi16(s16[p], s));
                        }
                    }
                }
                if T::SHIFT == 0 {
                    (isum, off)
                } else {
                    (
                        _mm256_sub_epi32(isum, _mm256_sll_epi32(off, _mm_cvtsi32_si128(T::SHIFT))),
                        off,
                    )
                }
            };
            let ((h0, m0), (h1, m1)) = (half(0), half(1));
            let d = _mm256_cvtph_ps(_mm_loadu_si128(g.cast()));
            let dy = yb.cast::<f32>().read_unaligned();
            acc = float_step(dy, d, fold_halves(h0, h1), acc);
            if T::SHIFT == 0 {
                let dmin = _mm256_cvtph_ps(_mm_loadu_si128(g.add(16).cast()));
                acc_m = float_step(-dy, dmin, fold_halves(m0, m1), acc_m);
            }
        }
        let mut out = [0f32; ROWS];
        // SAFETY: out holds 8 floats. (dot_scalar's acc + acc_m)
        _mm256_storeu_ps(out.as_mut_ptr(), _mm256_add_ps(acc, acc_m));
        out
    }
}

/// One token against 8 repacked rows with 512-bit registers (all 8 rows in
/// one): row r's sums in 32-bit lanes 2r, 2r + 1.
///
/// # Safety
/// AVX-512 F/BW/VL and VNNI; `x` holds `nb` groups of `T`, `y` `nb` Q8_K
/// blocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn decode_vnni<T: Sub16>(nb: usize, x: *const u8, y: *const u8) -> [f32; ROWS] {
    use super::q4k_x8::fold_pairs;
    use super::qgemm_lanes::float_step;
    // SAFETY: the function's contract: the features are enabled, every
    // load is inside the nb groups / blocks.
    unsafe {
        let mut buf = Scratch([0; 256]);
        let mut acc = _mm256_setzero_ps();
        let mut acc_m = _mm256_setzero_ps();
        for b in 0..nb {
            let g = x.add(b * T::GROUP_BYTES);
            super::mem::prefetch_ahead(g, T::GROUP_BYTES);
            let yb = y.add(b * Q8_K_BYTES);
            let scp = T::scales(g, &mut buf);
            let sc = |q: usize| _mm512_cvtepi8_epi16(_mm256_loadu_si256(scp.add(32 * q).cast()));
            // the offset or the mins: Σ_j scale[j] (min[j]) · bsum[j]
            let mut off = _mm512_setzero_si512();
            for q in 0..4 {
                let bq = _mm512_set1_epi64(yb.add(260 + 8 * q).cast::<i64>().read_unaligned());
                let m = if T::SHIFT == 0 { sc(4 + q) } else { sc(q) };
                off = _mm512_dpwssd_epi32(off, m, bq);
            }
            let mut isum = _mm512_setzero_si512();
            for n in 0..2 {
                for hp in 0..2 {
                    let mut s16 = [_mm512_setzero_si512(); 4];
                    for h in 2 * hp..2 * hp + 2 {
                        let v = T::quants_512(g, n, h);
                        for p in 0..4 {
                            let ya = _mm512_set1_epi64(
                                yb.add(4 + 128 * n + 32 * p + 8 * h)
                                    .cast::<i64>()
                                    .read_unaligned(),
                            );
                            s16[p] = _mm512_add_epi16(s16[p], _mm512_maddubs_epi16(v[p], ya));
                        }
                    }
                    for p in 0..4 {
                        let (q, i) = (2 * n + p / 2, 2 * (p % 2) + hp);
                        let m = _mm512_loadu_si512(SPREAD[i].as_ptr().cast());
                        isum = _mm512_dpwssd_epi32(isum, s16[p], _mm512_shuffle_epi8(sc(q), m));
                    }
                }
            }
            let d = _mm256_cvtph_ps(_mm_loadu_si128(g.cast()));
            let dy = yb.cast::<f32>().read_unaligned();
            if T::SHIFT == 0 {
                acc = float_step(dy, d, fold_pairs(isum), acc);
                let dmin = _mm256_cvtph_ps(_mm_loadu_si128(g.add(16).cast()));
                acc_m = float_step(-dy, dmin, fold_pairs(off), acc_m);
            } else {
                let off = _mm512_sll_epi32(off, _mm_cvtsi32_si128(T::SHIFT));
                acc = float_step(dy, d, fold_pairs(_mm512_sub_epi32(isum, off)), acc);
            }
        }
        let mut out = [0f32; ROWS];
        // SAFETY: out holds 8 floats. (dot_scalar's acc + acc_m)
        _mm256_storeu_ps(out.as_mut_ptr(), _mm256_add_ps(acc, acc_m));
        out
    }
}

/// Bytes of a Q3_K×8 group.
pub const Q3_GROUP_BYTES: usize = ROWS * Q3_K_BYTES;
/// Bytes of a Q2_K×8 group.
pub const Q2_GROUP_BYTES: usize = ROWS * Q2_K_BYTES;

/// Offsets in a Q3_K×8 group: the scale words, `hmask`, `qs`.
const Q3_SC: usize = 16;
const Q3_H: usize = 112;
const Q3_Q: usize = 368;
/// Offsets in a Q2_K×8 group: the scales (and mins), `qs`.
const Q2_SC: usize = 32;
const Q2_Q: usize = 160;

/// Row `r`'s copies between a Q3_K superblock and its Q3_K×8 group (see
/// the module doc).
pub(super) fn q3_segments(r: usize) -> impl Iterator<Item = (usize, usize, usize)> {
    let d = std::iter::once((108, 2 * r, 2));
    let words = (0..3).map(move |w| (96 + 4 * w, Q3_SC + 32 * w + 4 * r, 4));
    let hmask = (0..4).map(move |h| (8 * h, Q3_H + 64 * h + 8 * r, 8));
    let qs = (0..8).map(move |l| (32 + 8 * l, Q3_Q + 64 * l + 8 * r, 8));
    d.chain(words).chain(hmask).chain(qs)
}

/// Row `r`'s copies between a Q2_K superblock and its Q2_K×8 group.
pub(super) fn q2_segments(r: usize) -> impl Iterator<Item = (usize, usize, usize)> {
    let d = std::iter::once((80, 2 * r, 2));
    let dmin = std::iter::once((82, 16 + 2 * r, 2));
    let scales = (0..4).map(move |q| (4 * q, Q2_SC + 32 * q + 4 * r, 4));
    let qs = (0..8).map(move |l| (16 + 8 * l, Q2_Q + 64 * l + 8 * r, 8));
    d.chain(dmin).chain(scales).chain(qs)
}

/// The four 2-bit fields of every byte of `a` (field p in the low bits of
/// output p), 512-bit.
///
/// # Safety
/// AVX-512 F/BW.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn two_bit_fields_512(a: __m512i) -> [__m512i; 4] {
    // SAFETY: register-only AVX-512 F/BW ops (the caller's features); the
    // 16-bit shifts' bits that cross a byte are masked off.
    unsafe {
        let three = _mm512_set1_epi8(3);
        [
            _mm512_and_si512(a, three),
            _mm512_and_si512(_mm512_srli_epi16::<2>(a), three),
            _mm512_and_si512(_mm512_srli_epi16::<4>(a), three),
            _mm512_and_si512(_mm512_srli_epi16::<6>(a), three),
        ]
    }
}

/// Q3_K×8 (see the module doc).
#[cfg(target_arch = "x86_64")]
pub(super) struct Q3k;

#[cfg(target_arch = "x86_64")]
impl Sub16 for Q3k {
    const GROUP_BYTES: usize = Q3_GROUP_BYTES;
    const SHIFT: i32 = 2;

    #[inline(always)]
    unsafe fn scales(g: *const u8, buf: &mut Scratch) -> *const u8 {
        // SAFETY: the three scale words lie in the group; AVX2; `buf` holds
        // 128 bytes (the caller's contract).
        unsafe {
            // ggml's unpacking of the 12 bytes, 8 rows per 32-bit lane:
            // scales 4q..4q + 4 of row r in dword r of output q
            let w = |i: usize| _mm256_loadu_si256(g.add(Q3_SC + 32 * i).cast());
            let (a0, a1, t) = (w(0), w(1), w(2));
            let (nib, two) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi8(3));
            let top = |s: i32| {
                let v = _mm256_and_si256(_mm256_srl_epi32(t, _mm_cvtsi32_si128(s)), two);
                _mm256_slli_epi32::<4>(v)
            };
            let low = |a: __m256i, s: i32| {
                _mm256_and_si256(_mm256_srl_epi32(a, _mm_cvtsi32_si128(s)), nib)
            };
            let m32 = _mm256_set1_epi8(32);
            let out = [
                _mm256_or_si256(low(a0, 0), top(0)),
                _mm256_or_si256(low(a1, 0), top(2)),
                _mm256_or_si256(low(a0, 4), top(4)),
                _mm256_or_si256(low(a1, 4), top(6)),
            ];
            for (q, v) in out.into_iter().enumerate() {
                let p = buf.0.as_mut_ptr().add(32 * q).cast();
                _mm256_store_si256(p, _mm256_sub_epi8(v, m32));
            }
            buf.0.as_ptr()
        }
    }

    #[inline(always)]
    unsafe fn quants_avx2(g: *const u8, n: usize, h: usize, k: usize) -> [__m256i; 4] {
        use super::qgemm_lanes::{q3_high, two_bit_fields};
        // SAFETY: the loads lie in the group; AVX2 (the caller's contract).
        unsafe {
            let q = _mm256_loadu_si256(g.add(Q3_Q + 64 * (4 * n + h) + 32 * k).cast());
            let hm = _mm256_loadu_si256(g.add(Q3_H + 64 * h + 32 * k).cast());
            let f = two_bit_fields(q);
            std::array::from_fn(|p| _mm256_or_si256(f[p], q3_high(hm, 4 * n + p)))
        }
    }

    #[inline(always)]
    unsafe fn quants_512(g: *const u8, n: usize, h: usize) -> [__m512i; 4] {
        // SAFETY: the loads lie in the group; AVX-512 F/BW (the caller's
        // contract).
        unsafe {
            let q = _mm512_loadu_si512(g.add(Q3_Q + 64 * (4 * n + h)).cast());
            let hm = _mm512_loadu_si512(g.add(Q3_H + 64 * h).cast());
            let f = two_bit_fields_512(q);
            let four = _mm512_set1_epi8(4);
            std::array::from_fn(|p| {
                // bit 4n + p of the hmask byte as bit 2 (16-bit shifts: the
                // bits crossing into a neighbour never land on bit 2)
                let s = (4 * n + p) as i32;
                let v = if s >= 2 {
                    _mm512_srl_epi16(hm, _mm_cvtsi32_si128(s - 2))
                } else {
                    _mm512_sll_epi16(hm, _mm_cvtsi32_si128(2 - s))
                };
                _mm512_or_si512(f[p], _mm512_and_si512(v, four))
            })
        }
    }
}

/// Q2_K×8 (see the module doc).
#[cfg(target_arch = "x86_64")]
pub(super) struct Q2k;

#[cfg(target_arch = "x86_64")]
impl Sub16 for Q2k {
    const GROUP_BYTES: usize = Q2_GROUP_BYTES;
    const SHIFT: i32 = 0;

    #[inline(always)]
    unsafe fn scales(g: *const u8, buf: &mut Scratch) -> *const u8 {
        // SAFETY: the scale bytes lie in the group; AVX2; `buf` holds 256
        // bytes (the caller's contract).
        unsafe {
            // scale in the low nibble, min in the high one
            let nib = _mm256_set1_epi8(0x0f);
            for q in 0..4 {
                let v = _mm256_loadu_si256(g.add(Q2_SC + 32 * q).cast());
                let p = buf.0.as_mut_ptr();
                _mm256_store_si256(p.add(32 * q).cast(), _mm256_and_si256(v, nib));
                let m = _mm256_and_si256(_mm256_srli_epi16::<4>(v), nib);
                _mm256_store_si256(p.add(128 + 32 * q).cast(), m);
            }
            buf.0.as_ptr()
        }
    }

    #[inline(always)]
    unsafe fn quants_avx2(g: *const u8, n: usize, h: usize, k: usize) -> [__m256i; 4] {
        use super::qgemm_lanes::two_bit_fields;
        // SAFETY: the load lies in the group; AVX2 (the caller's contract).
        unsafe {
            two_bit_fields(_mm256_loadu_si256(
                g.add(Q2_Q + 64 * (4 * n + h) + 32 * k).cast(),
            ))
        }
    }

    #[inline(always)]
    unsafe fn quants_512(g: *const u8, n: usize, h: usize) -> [__m512i; 4] {
        // SAFETY: the load lies in the group; AVX-512 F/BW (the caller's
        // contract).
        unsafe { two_bit_fields_512(_mm512_loadu_si512(g.add(Q2_Q + 64 * (4 * n + h)).cast())) }
    }
}
