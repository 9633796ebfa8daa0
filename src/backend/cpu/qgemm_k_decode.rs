//! K-quant (Q4_K, Q5_K, Q6_K, Q3_K, Q2_K) decoding kernels with 512-bit
//! registers: one token against 8 weight rows per call, for the AVX-512
//! levels (with VNNI's `vpdpwssd` where present).
//!
//! The arithmetic is [`super::qgemm_lanes`]'s, bit for bit (one exact
//! integer sum per row and superblock, then one `fma` per superblock for the
//! 8 rows at once; see that module's doc and its `dot_scalar`), so a
//! prompt's logits do not depend on which kernel ran a token. What changes
//! is how the integer sum is reached. The 256-bit decoding kernel multiplies
//! one run of 32 weights per instruction and spreads each run's scale from a
//! general register; here every instruction covers two runs:
//!
//! - a 64-byte load of quants holds two runs in each nibble half (Q4_K,
//!   Q5_K: runs 2c and 2c + 2 in the low nibbles of chunks c, c + 1), so two
//!   `and`s and a shift give two registers of two runs each; the
//!   activations are rearranged once per superblock (shared by the 8 rows)
//!   into the same pairs;
//! - the scales of a pair are spread to their 128-bit lanes by one in-lane
//!   byte shuffle (Q4_K / Q5_K: the 8 unpacked scales are copied to every
//!   lane first) or one word permute (Q6_K, a scale per 16 weights: one per
//!   lane);
//! - `maddubs` (unsigned quants × signed activations, pairs in i16), then
//!   `madd` by the scales into i32 and the add (one `vpdpwssd` with VNNI);
//!   the four pair products are summed in two chains, the two halves of the
//!   512-bit sum folded, and the 8 rows' lanes reduced as the 256-bit
//!   kernel does.
//!
//! Overflow: `maddubs` sums two products, at most 2·63·128 = 16128 (Q6_K's
//! quants are below 64) in i16; everything after is i32 far from its range.
//!
//! On a 2-core Zen 4 VM (AVX-512 executed in 256-bit halves), one core
//! looping over 8-row calls (the 7B's 3584-wide rows, kernels interleaved in
//! one process, best of 7, three runs) ran 1.14–1.23× the multiply-adds per
//! second of the 256-bit kernel for Q4_K and Q6_K, from L2 and streaming
//! from memory alike (Q4_K in the fastest run: 45 against 37 GMAC/s from L2,
//! 34 against 29 from memory), and 1.0–1.13× for Q5_K.

use super::qgemm_lanes::{Format, Iq4xs, LanesFn, Q2k, Q3k, Q4k, Q5k, Q6k, Q8_K_BYTES, ROWS};
use crate::tensor::DType;
use std::arch::x86_64::*;

/// The decoding kernel of `dtype` with 512-bit registers (`vnni`: fuse the
/// `madd` by the scales with its add); `None` for other types. The caller
/// checks that the CPU has AVX-512 F/BW/VL (and VNNI with `vnni`).
pub(super) fn kernel<const N: usize>(dtype: DType, vnni: bool) -> Option<LanesFn<N>> {
    Some(match (dtype, vnni) {
        (DType::Q4K, true) => decode::<N, Q4k, true>,
        (DType::Q4K, false) => decode::<N, Q4k, false>,
        (DType::Q5K, true) => decode::<N, Q5k, true>,
        (DType::Q5K, false) => decode::<N, Q5k, false>,
        (DType::Q6K, true) => decode::<N, Q6k, true>,
        (DType::Q6K, false) => decode::<N, Q6k, false>,
        (DType::Q3K, true) => decode::<N, Q3k, true>,
        (DType::Q3K, false) => decode::<N, Q3k, false>,
        (DType::Q2K, true) => decode::<N, Q2k, true>,
        (DType::Q2K, false) => decode::<N, Q2k, false>,
        // IQ4_XS: VNNI only (without it, `qgemm_lanes::rows_iq4xs`, the
        // signed grid value against |y|)
        (DType::IQ4XS, true) => decode_iq4xs::<N>,
        _ => return None,
    })
}

/// What the 512-bit kernel needs of a format beyond [`Format`].
pub(super) trait Wide: Format {
    /// The superblock's 256 activations (Q8_K `qs` at `y + 4`) as four
    /// registers in the order of [`Wide::row_wide`]'s quant pairs.
    ///
    /// # Safety
    /// AVX-512 F/BW; `y` is a whole Q8_K block.
    #[inline(always)]
    unsafe fn acts(y: *const u8) -> [__m512i; 4] {
        // SAFETY: the trait's contract; runs (0, 2), (1, 3), (4, 6), (5, 7),
        // the pairs of Q4_K's and Q5_K's quant loads (Q6_K has its own).
        unsafe { pairs_2apart(y) }
    }

    /// One row's superblock: four registers of unsigned quants (two runs of
    /// 32 each, in the order of [`Wide::acts`]), the i16 scale of each of
    /// their weights' pairs, and the i16 factors of the activation's 16
    /// block sums (as [`Format::row`]: the mins, or Q6_K's scales).
    ///
    /// # Safety
    /// AVX-512 F/BW; `x` is a whole superblock.
    unsafe fn row_wide(x: *const u8) -> ([__m512i; 4], [__m512i; 4], __m256i);
}

/// The activations of runs (0, 2), (1, 3), (4, 6), (5, 7), the pairs of
/// Q4_K's and Q5_K's 64-byte quant loads.
///
/// # Safety
/// AVX-512 F; `y` is a whole Q8_K block.
#[inline(always)]
unsafe fn pairs_2apart(y: *const u8) -> [__m512i; 4] {
    // SAFETY: the caller's contract: 256 activation bytes at y + 4.
    unsafe {
        let ya = _mm512_loadu_si512(y.add(4).cast());
        let yb = _mm512_loadu_si512(y.add(68).cast());
        let yc = _mm512_loadu_si512(y.add(132).cast());
        let yd = _mm512_loadu_si512(y.add(196).cast());
        // (runs 0, 2), (1, 3), (4, 6), (5, 7)
        [
            _mm512_shuffle_i64x2(ya, yb, 0x44),
            _mm512_shuffle_i64x2(ya, yb, 0xee),
            _mm512_shuffle_i64x2(yc, yd, 0x44),
            _mm512_shuffle_i64x2(yc, yd, 0xee),
        ]
    }
}

/// The activations of runs (0, 1), (2, 3), (4, 5), (6, 7): the Q8_K order,
/// the pairs of Q6_K's, Q3_K's and Q2_K's quant registers.
///
/// # Safety
/// AVX-512 F; `y` is a whole Q8_K block.
#[inline(always)]
unsafe fn pairs_in_order(y: *const u8) -> [__m512i; 4] {
    // SAFETY: the caller's contract: 256 activation bytes at y + 4.
    unsafe { std::array::from_fn(|p| _mm512_loadu_si512(y.add(4 + 64 * p).cast())) }
}

/// Byte-shuffle masks spreading i16 scale `a` over 128-bit lanes 0-1 and
/// `b` over lanes 2-3, from 8 i16 scales copied to every lane; for the run
/// pairs (0, 2), (1, 3), (4, 6), (5, 7).
static PICK_K: [[u8; 64]; 4] = {
    let pairs = [(0u8, 2u8), (1, 3), (4, 6), (5, 7)];
    let mut t = [[0u8; 64]; 4];
    let mut p = 0;
    while p < 4 {
        let mut i = 0;
        while i < 64 {
            let s = if i < 32 { pairs[p].0 } else { pairs[p].1 };
            t[p][i] = 2 * s + (i % 2) as u8;
            i += 1;
        }
        p += 1;
    }
    t
};

/// Q4_K / Q5_K: the run-pair scale registers and the mins' factors.
///
/// # Safety
/// AVX-512 F/BW; `x` is a whole Q4_K or Q5_K superblock.
#[inline(always)]
unsafe fn k_scales(x: *const u8) -> ([__m512i; 4], __m256i) {
    // SAFETY: x + 4 holds the 12 scale bytes (the caller's contract).
    let u = unsafe { super::qgemm_lanes::unpack16(x.add(4)) };
    // SAFETY (intrinsics, loads of the static masks): AVX-512 F/BW.
    unsafe {
        let sc = _mm_cvtsi64_si128((u[0] as u64 | (u[1] as u64) << 32) as i64);
        let sc16 = _mm512_broadcast_i32x4(_mm_cvtepu8_epi16(sc));
        let scv = std::array::from_fn(|p| {
            _mm512_shuffle_epi8(sc16, _mm512_loadu_si512(PICK_K[p].as_ptr().cast()))
        });
        let mins = _mm_cvtsi64_si128((u[2] as u64 | (u[3] as u64) << 32) as i64);
        (scv, _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mins, mins)))
    }
}

/// Low and high nibbles of 64 quant bytes.
///
/// # Safety
/// AVX-512 F/BW.
#[inline(always)]
unsafe fn nibbles(v: __m512i) -> (__m512i, __m512i) {
    // SAFETY: register-only AVX-512 F/BW ops (the caller's contract).
    unsafe {
        let low = _mm512_set1_epi8(0x0f);
        (
            _mm512_and_si512(v, low),
            _mm512_and_si512(_mm512_srli_epi16(v, 4), low),
        )
    }
}

/// The 128 nibble-packed quant bytes at `qs` (chunk c: run 2c low, 2c + 1
/// high) as the run pairs (0, 2), (1, 3), (4, 6), (5, 7).
///
/// # Safety
/// AVX-512 F/BW; `qs` points to 128 readable bytes.
#[inline(always)]
unsafe fn run_pairs(qs: *const u8) -> [__m512i; 4] {
    // SAFETY: the caller's contract.
    unsafe {
        let (l0, h0) = nibbles(_mm512_loadu_si512(qs.cast()));
        let (l1, h1) = nibbles(_mm512_loadu_si512(qs.add(64).cast()));
        [l0, h0, l1, h1]
    }
}

impl Wide for Q4k {
    #[inline(always)]
    unsafe fn row_wide(x: *const u8) -> ([__m512i; 4], [__m512i; 4], __m256i) {
        // SAFETY (loads, intrinsics): the trait's contract; quants at
        // 16..144, chunk c holding run 2c low and 2c + 1 high.
        unsafe {
            let (scv, off) = k_scales(x);
            (run_pairs(x.add(16)), scv, off)
        }
    }
}

/// Q5_K: for each run pair, the bits of `qh` holding the pair's fifth bits
/// (one per 256-bit half) and the shift that moves them to bit 4 (left for
/// the pairs (0, 2) and (1, 3), right for (4, 6) and (5, 7)).
const Q5_FIFTH: [(u8, u8, u16, u16); 4] = [(0, 2, 4, 2), (1, 3, 3, 1), (4, 6, 0, 2), (5, 7, 1, 3)];

impl Wide for Q5k {
    #[inline(always)]
    unsafe fn row_wide(x: *const u8) -> ([__m512i; 4], [__m512i; 4], __m256i) {
        // SAFETY (loads, intrinsics): the trait's contract; low nibbles as
        // Q4_K's at 48..176; the fifth bit of run s is bit s of the 32 bytes
        // at 16..48 (copied to both halves); 16-bit shifts keep each bit in
        // its byte.
        unsafe {
            let q = run_pairs(x.add(48));
            let qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(x.add(16).cast()));
            let fifth = |p: usize| {
                let (a, b, sa, sb) = Q5_FIFTH[p];
                let m = _mm512_inserti64x4(
                    _mm512_set1_epi8((1u8 << a) as i8),
                    _mm256_set1_epi8((1u8 << b) as i8),
                    1,
                );
                let m = _mm512_and_si512(qh, m);
                let n = _mm512_inserti64x4(
                    _mm512_set1_epi16(sa as i16),
                    _mm256_set1_epi16(sb as i16),
                    1,
                );
                if p < 2 {
                    _mm512_sllv_epi16(m, n)
                } else {
                    _mm512_srlv_epi16(m, n)
                }
            };
            let q = std::array::from_fn(|p| _mm512_or_si512(q[p], fifth(p)));
            let (scv, off) = k_scales(x);
            (q, scv, off)
        }
    }
}

/// Q6_K: word indices spreading scale 4p + lane of the 16 i16 scales over
/// each 128-bit lane of run pair p.
static PICK_Q6: [[u16; 32]; 4] = {
    let mut t = [[0u16; 32]; 4];
    let mut p = 0;
    while p < 4 {
        let mut i = 0;
        while i < 32 {
            t[p][i] = (4 * p + i / 8) as u16;
            i += 1;
        }
        p += 1;
    }
    t
};

/// An i16 count per 256-bit half: `lo` in the low half, `hi` in the high.
///
/// # Safety
/// AVX-512 F.
#[inline(always)]
unsafe fn halves16(lo: i16, hi: i16) -> __m512i {
    // SAFETY: register-only AVX-512 F ops (the caller's contract).
    unsafe { _mm512_inserti64x4(_mm512_set1_epi16(lo), _mm256_set1_epi16(hi), 1) }
}

/// The 64 bytes of 2-bit fields at `qs` (Q2_K's quants, Q3_K's low bits;
/// run 4n + k is bits 2k, 2k + 1 of bytes 32n..32n + 32) as the run pairs
/// (0, 1), (2, 3), (4, 5), (6, 7), each field in the low bits of its byte.
/// 16-bit shifts: the bits that cross a byte are masked off.
///
/// # Safety
/// AVX-512 F/BW; `qs` points to 64 readable bytes.
#[inline(always)]
unsafe fn two_bit_pairs(qs: *const u8) -> [__m512i; 4] {
    // SAFETY: the caller's contract.
    unsafe {
        let three = _mm512_set1_epi8(3);
        std::array::from_fn(|p| {
            let a = _mm512_broadcast_i64x4(_mm256_loadu_si256(qs.add(32 * (p / 2)).cast()));
            let k = 2 * (p % 2) as i16;
            _mm512_and_si512(_mm512_srlv_epi16(a, halves16(2 * k, 2 * k + 2)), three)
        })
    }
}

/// 16 i16 scales, one per 16 weights (in the low 256 bits of `sc16`), spread
/// over the run pairs (0, 1), (2, 3), (4, 5), (6, 7): each scale over the 8
/// i16 lanes of its weights' `maddubs` pairs (Q6_K, Q3_K, Q2_K).
///
/// # Safety
/// AVX-512 F/BW.
#[inline(always)]
unsafe fn spread_scales16(sc16: __m512i) -> [__m512i; 4] {
    // SAFETY: AVX-512 BW (the caller's contract); PICK_Q6 rows are 64 bytes.
    std::array::from_fn(|p| unsafe {
        _mm512_permutexvar_epi16(_mm512_loadu_si512(PICK_Q6[p].as_ptr().cast()), sc16)
    })
}

impl Wide for Q6k {
    #[inline(always)]
    unsafe fn acts(y: *const u8) -> [__m512i; 4] {
        // SAFETY: the trait's contract.
        unsafe { pairs_in_order(y) }
    }
    #[inline(always)]
    unsafe fn row_wide(x: *const u8) -> ([__m512i; 4], [__m512i; 4], __m256i) {
        // SAFETY (loads, intrinsics): the trait's contract. Half n (runs
        // 4n..4n+3): ql bytes 64n.. hold runs 4n, 4n + 1 in their low
        // nibbles and 4n + 2, 4n + 3 in their high ones; qh bytes 32n..
        // (at 128) give bits 4-5 of run 4n + k from their bits 2k, 2k + 1.
        // Scales: 16 i8 at 192, one per 16 weights.
        unsafe {
            let two = _mm512_set1_epi8(0x30);
            let h = _mm512_loadu_si512(x.add(128).cast());
            let mut q = [_mm512_setzero_si512(); 4];
            for n in 0..2 {
                let (lo, hi) = nibbles(_mm512_loadu_si512(x.add(64 * n).cast()));
                // qh half n in both 256-bit halves
                let hn = if n == 0 {
                    _mm512_shuffle_i64x2(h, h, 0x44)
                } else {
                    _mm512_shuffle_i64x2(h, h, 0xee)
                };
                // runs 4n, 4n + 1: bits 0-1 and 2-3 up to 4-5
                let up = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
                // runs 4n + 2, 4n + 3: bits 4-5 and 6-7 down to 4-5
                let down = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1);
                let hu = _mm512_and_si512(_mm512_sllv_epi16(hn, up), two);
                let hd = _mm512_and_si512(_mm512_srlv_epi16(hn, down), two);
                q[2 * n] = _mm512_or_si512(lo, hu);
                q[2 * n + 1] = _mm512_or_si512(hi, hd);
            }
            let sc8 = _mm_loadu_si128(x.add(192).cast());
            let sc16 = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(sc8));
            let scv = spread_scales16(sc16);
            (q, scv, _mm256_cvtepi8_epi16(sc8))
        }
    }
}

impl Wide for Q2k {
    #[inline(always)]
    unsafe fn acts(y: *const u8) -> [__m512i; 4] {
        // SAFETY: the trait's contract.
        unsafe { pairs_in_order(y) }
    }
    #[inline(always)]
    unsafe fn row_wide(x: *const u8) -> ([__m512i; 4], [__m512i; 4], __m256i) {
        // SAFETY (loads, intrinsics): the trait's contract. Run 4n + k is
        // bits 2k, 2k + 1 of qs bytes 32n.. (qs at 16); pair p holds runs
        // 2p (low half) and 2p + 1. Scales (low nibbles) and mins (high)
        // at 0, one per 16 weights.
        unsafe {
            let q = two_bit_pairs(x.add(16));
            let b = _mm_loadu_si128(x.cast());
            let nib = _mm_set1_epi8(0x0f);
            let sc16 = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(_mm_and_si128(b, nib)));
            let scv = spread_scales16(sc16);
            let mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(b, 4), nib));
            (q, scv, mins)
        }
    }
}

impl Wide for Q3k {
    #[inline(always)]
    unsafe fn acts(y: *const u8) -> [__m512i; 4] {
        // SAFETY: the trait's contract.
        unsafe { pairs_in_order(y) }
    }
    #[inline(always)]
    unsafe fn row_wide(x: *const u8) -> ([__m512i; 4], [__m512i; 4], __m256i) {
        // SAFETY (loads, intrinsics): the trait's contract. Run s = 4n + k
        // is bits 2k, 2k + 1 of qs bytes 32n.. (qs at 32) with bit s of
        // hmask (at 0) as its bit 2; pair p holds runs 2p (low half) and
        // 2p + 1. 16-bit shifts keep each kept bit in its byte.
        unsafe {
            let four = _mm512_set1_epi8(4);
            let hm = _mm512_broadcast_i64x4(_mm256_loadu_si256(x.cast()));
            let low = two_bit_pairs(x.add(32));
            let q = std::array::from_fn(|p| {
                let (s0, s1) = (2 * p as i16, 2 * p as i16 + 1);
                // bit s to bit 2: left for runs 0 and 1, right after
                let high = if p == 0 {
                    _mm512_sllv_epi16(hm, halves16(2, 1))
                } else {
                    _mm512_srlv_epi16(hm, halves16(s0 - 2, s1 - 2))
                };
                _mm512_or_si512(low[p], _mm512_and_si512(high, four))
            });
            let w =
                super::qgemm_lanes::q3_scale_words(x.add(96).cast::<[u8; 12]>().read_unaligned());
            let sc8 = _mm_sub_epi8(_mm_set_epi64x(w[1] as i64, w[0] as i64), _mm_set1_epi8(32));
            let sc16 = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(sc8));
            let scv = spread_scales16(sc16);
            (q, scv, _mm256_cvtepi8_epi16(sc8))
        }
    }
}

fn decode<const N: usize, F: Wide, const VNNI: bool>(
    nb: usize,
    w: &[&[u8]; ROWS],
    a: &[&[u8]; N],
) -> [[f32; N]; ROWS] {
    super::qgemm_lanes::check(F::DTYPE, nb, w, a);
    let mut out = [[0f32; N]; ROWS];
    for t in 0..N {
        // SAFETY: handed out (`kernel`, through matmul::k_quant_kernel) only where the
        // CPU has AVX-512 F/BW/VL (and VNNI for VNNI); every row holds nb
        // superblocks and every activation row nb Q8_K blocks (checked just
        // above), which bounds all loads.
        let o = unsafe {
            if VNNI {
                decode_vnni::<F>(nb, w, a[t])
            } else {
                decode_avx512::<F>(nb, w, a[t])
            }
        };
        for r in 0..ROWS {
            out[r][t] = o[r];
        }
    }
    out
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
unsafe fn decode_avx512<F: Wide>(nb: usize, w: &[&[u8]; ROWS], y: &[u8]) -> [f32; ROWS] {
    // SAFETY: the caller's contract (decode).
    unsafe { body::<F, false>(nb, w, y) }
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn decode_vnni<F: Wide>(nb: usize, w: &[&[u8]; ROWS], y: &[u8]) -> [f32; ROWS] {
    // SAFETY: the caller's contract (decode).
    unsafe { body::<F, true>(nb, w, y) }
}

/// One token against 8 rows.
///
/// # Safety
/// AVX-512 F/BW/VL, F16C, FMA (and VNNI with `VNNI`) where this is inlined;
/// every row of `w` holds `nb` superblocks of `F`, `y` holds `nb` Q8_K
/// blocks.
#[inline(always)]
unsafe fn body<F: Wide, const VNNI: bool>(nb: usize, w: &[&[u8]; ROWS], y: &[u8]) -> [f32; ROWS] {
    use super::qgemm_lanes::{float_step, prefetch_ahead, sum_rows};
    // SAFETY: the function's contract: every intrinsic has its features
    // where this is inlined; every load is inside nb blocks.
    unsafe {
        let wp: [*const u8; ROWS] = std::array::from_fn(|r| w[r].as_ptr());
        let mut acc = _mm256_setzero_ps();
        let mut acc_m = _mm256_setzero_ps();
        for b in 0..nb {
            // SAFETY (pointer arithmetic, loads): b < nb.
            let x: [*const u8; ROWS] = std::array::from_fn(|r| wp[r].add(b * F::BYTES));
            let yb = y.as_ptr().add(b * Q8_K_BYTES);
            prefetch_ahead::<F>(&x, nb);
            let ys = F::acts(yb);
            let bs = _mm256_loadu_si256(yb.add(260).cast());
            // per row: 8 i32 lanes summing to the integer sum (v) and to the
            // block sums' term (vm)
            let mut v = [_mm256_setzero_si256(); ROWS];
            let mut vm = [_mm256_setzero_si256(); ROWS];
            for r in 0..ROWS {
                let (q, scv, off) = F::row_wide(x[r]);
                let mut s = [_mm512_setzero_si512(); 2];
                for p in 0..4 {
                    let prod = _mm512_maddubs_epi16(q[p], ys[p]);
                    s[p % 2] = if VNNI {
                        _mm512_dpwssd_epi32(s[p % 2], prod, scv[p])
                    } else {
                        _mm512_add_epi32(s[p % 2], _mm512_madd_epi16(prod, scv[p]))
                    };
                }
                let s = _mm512_add_epi32(s[0], s[1]);
                let s =
                    _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64::<1>(s));
                let o = _mm256_madd_epi16(bs, off);
                if F::MINS {
                    v[r] = s;
                    vm[r] = o;
                } else {
                    // the −32 (Q3_K: −4) offset of every weight
                    let sh = _mm_cvtsi32_si128(F::OFFSET_SHIFT);
                    v[r] = _mm256_sub_epi32(s, _mm256_sll_epi32(o, sh));
                }
            }
            let h = std::array::from_fn(|p| _mm256_hadd_epi32(v[2 * p], v[2 * p + 1]));
            let (xd, xm) = F::heads(&x);
            let dy = yb.cast::<f32>().read_unaligned();
            if F::MINS {
                let hm = std::array::from_fn(|p| _mm256_hadd_epi32(vm[2 * p], vm[2 * p + 1]));
                acc_m = float_step(-dy, xm, sum_rows(hm), acc_m);
            }
            acc = float_step(dy, xd, sum_rows(h), acc);
        }
        let mut out = [0f32; ROWS];
        // SAFETY: out holds 8 floats.
        _mm256_storeu_ps(out.as_mut_ptr(), _mm256_add_ps(acc, acc_m));
        out
    }
}

/// IQ4_XS decoding (the VNNI levels only): its unsigned quants (grid + 128)
/// reach 241, so a `maddubs` could saturate; each dword's 4 products are
/// summed into 32 bits by `vpdpbusd` and the run's scale multiplies those
/// (`vpmulld`), the lanes kernel's integers, then the module's offset and
/// float steps.
fn decode_iq4xs<const N: usize>(nb: usize, w: &[&[u8]; ROWS], a: &[&[u8]; N]) -> [[f32; N]; ROWS] {
    super::qgemm_lanes::check(DType::IQ4XS, nb, w, a);
    let mut out = [[0f32; N]; ROWS];
    for t in 0..N {
        // SAFETY: handed out (`kernel`) only with VNNI, where the CPU has
        // AVX-512 F/BW/VL/VNNI; the lengths (checked above) bound all loads.
        let o = unsafe { decode_iq4xs_vnni(nb, w, a[t]) };
        for r in 0..ROWS {
            out[r][t] = o[r];
        }
    }
    out
}

/// One token against 8 IQ4_XS rows.
///
/// # Safety
/// AVX-512 F/BW/VL/VNNI, F16C, FMA; every row of `w` holds `nb`
/// superblocks, `y` `nb` Q8_K blocks.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn decode_iq4xs_vnni(nb: usize, w: &[&[u8]; ROWS], y: &[u8]) -> [f32; ROWS] {
    use super::qgemm_lanes::{float_step, prefetch_ahead, sum_rows, IQ4_XS_BYTES};
    // SAFETY: the function's contract: every intrinsic has its features;
    // every load is inside nb blocks.
    unsafe {
        let grid = super::qgemm_lanes::iq4_grid_bytes(true);
        let table = _mm512_broadcast_i32x4(_mm_loadu_si128(grid.as_ptr().cast()));
        let nib = _mm512_set1_epi8(0x0f);
        // dword lanes 0..8 take the scale of run 2p, 8..16 that of 2p + 1
        let pick: [__m512i; 4] = std::array::from_fn(|p| {
            _mm512_inserti64x4(
                _mm512_set1_epi32(2 * p as i32),
                _mm256_set1_epi32(2 * p as i32 + 1),
                1,
            )
        });
        let wp: [*const u8; ROWS] = std::array::from_fn(|r| w[r].as_ptr());
        let mut acc = _mm256_setzero_ps();
        for b in 0..nb {
            // SAFETY (pointer arithmetic, loads): b < nb.
            let x: [*const u8; ROWS] = std::array::from_fn(|r| wp[r].add(b * IQ4_XS_BYTES));
            let yb = y.as_ptr().add(b * Q8_K_BYTES);
            prefetch_ahead::<Iq4xs>(&x, nb);
            // runs (0, 1), (2, 3), (4, 5), (6, 7): the Q8_K order
            let ys = pairs_in_order(yb);
            let bs = _mm256_loadu_si256(yb.add(260).cast());
            let mut v = [_mm256_setzero_si256(); ROWS];
            for r in 0..ROWS {
                let ls =
                    super::qgemm_lanes::iq4_scale_bytes(x[r].cast::<[u8; 8]>().read_unaligned())
                        .to_le_bytes();
                let sc: [i32; 8] = ls.map(|l| l as i32 - 32);
                let sc16: [i16; 16] = std::array::from_fn(|j| sc[j / 2] as i16);
                let sc512 = _mm512_castsi256_si512(_mm256_loadu_si256(sc.as_ptr().cast()));
                let mut s = _mm512_setzero_si512();
                for (p, (yv, pk)) in ys.iter().zip(&pick).enumerate() {
                    // runs 2p, 2p + 1: 16 bytes each at 8 + 32p; a run's
                    // weights 0..16 are its low nibbles, 16..32 its high ones
                    let raw = _mm256_loadu_si256(x[r].add(8 + 32 * p).cast());
                    let both = _mm512_inserti64x4::<1>(
                        _mm512_castsi256_si512(raw),
                        _mm256_srli_epi16::<4>(raw),
                    );
                    // 128-bit lanes (run 2p low, 2p + 1 low, 2p high, 2p + 1
                    // high) to (2p low, 2p high, 2p + 1 low, 2p + 1 high)
                    let idx = _mm512_shuffle_i64x2::<0xd8>(both, both);
                    let q = _mm512_shuffle_epi8(table, _mm512_and_si512(idx, nib));
                    let p32 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, *yv);
                    let scale = _mm512_permutexvar_epi32(*pk, sc512);
                    s = _mm512_add_epi32(s, _mm512_mullo_epi32(p32, scale));
                }
                let s =
                    _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64::<1>(s));
                // the −128 offset of every quant, against the 16-value sums
                let o = _mm256_madd_epi16(bs, _mm256_loadu_si256(sc16.as_ptr().cast()));
                v[r] = _mm256_sub_epi32(s, _mm256_slli_epi32::<7>(o));
            }
            let h = std::array::from_fn(|p| _mm256_hadd_epi32(v[2 * p], v[2 * p + 1]));
            let (xd, _) = Iq4xs::heads(&x);
            let dy = yb.cast::<f32>().read_unaligned();
            acc = float_step(dy, xd, sum_rows(h), acc);
        }
        let mut out = [0f32; ROWS];
        // SAFETY: out holds 8 floats.
        _mm256_storeu_ps(out.as_mut_ptr(), _mm256_add_ps(acc, _mm256_setzero_ps()));
        out
    }
}
