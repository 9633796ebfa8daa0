//! Q4_K and Q5_K repacked eight rows at a time (`Q4_K×8`, `Q5_K×8`, stored
//! in an [`super::x8::X8`]), and their decoding kernels for AVX-512 VNNI
//! and for AVX2: one token against 8 rows per call. Q5_K×8 is Q4_K×8 plus
//! the fifth bits (see Layout); the kernels take both (`Q5`).
//!
//! Why repack: the row-major decoding kernels (`qgemm_k_decode`) multiply
//! a run of 32 weights by its activations with `maddubs` and then by the
//! run's scale with a `madd` (`vpdpwssd`): two multiplies per 64 weights,
//! plus a scale shuffle per pair of runs and a reduction of every row's
//! lanes per superblock. On a Zen 4 core that reached about 23 GB/s of
//! weights, about what one core can read, so one or two threads decoded a
//! 7B model at what the arithmetic allowed rather than at what memory did.
//! With the 8 rows interleaved 8 bytes at a time, a 64-byte load holds 8
//! quants of each of the 8 rows (two dwords per row after the nibbles are
//! split), so `vpdpbusd` against the 8 activations broadcast to every row
//! sums 4 products per 32-bit lane, *rows in lanes*: four of them cover a
//! run of 32 weights of all 8 rows, and only then is the run's scale
//! applied (one `vpdpwssd` per run per 8 rows). That is 1.25 multiplies per
//! 64 weights, scales decoded for 8 rows at once, and no per-row reduction:
//! the rows already sit in lanes for the float step.
//!
//! AVX2 ([`decode_avx2`]) reads the same layout as two 32-byte halves (rows
//! 0..4, 4..8): `maddubs` of a half's nibbles with the 8 activations
//! broadcast gives 4 pair sums per row in i16, the 4 loads of a run add up
//! in i16 (|sum| ≤ 4·2·15·128 = 15360), then one `madd` per run and half
//! applies the run's scale. Against the row-major AVX2 kernel
//! (`qgemm_lanes::rows`: per row and superblock its own scale decoding,
//! a `madd` per 32 weights and a reduction of its lanes) that is, by
//! count, about a quarter fewer vector operations per weight, which is
//! what decoding at AVX2 is bound by on a core that reads memory faster
//! than it multiplies (one Zen 4 core, `kernels::x8_speed` at avx2:
//! 29.6–33.1 against 14.2–16.8 GB/s from L2, 27.8–31.1 against 16.3–16.6
//! streamed; the 7B's tg64 in an x86-64-v3 build went from 0.96–1.06× to
//! 1.30× llama.cpp's, README, Speed).
//!
//! # Layout
//! Rows `8R..8R + 8`, superblock `b`: a group of [`group_bytes`] = 8 × 144
//! (Q4_K) or 8 × 176 (Q5_K) bytes (the same bytes as the 8 rows'
//! superblocks, rearranged; groups of a row block follow each other by
//! superblock, row blocks by row):
//!
//! | bytes | holds |
//! |---|---|
//! | 0..16 | `d` of rows 0..7 (f16) |
//! | 16..32 | `dmin` of rows 0..7 (f16) |
//! | 32..96 | per 128-bit lane L: bytes 0..4 and 8..12 of the packed scales of rows 2L and 2L + 1 (`A₂L A₂L₊₁ C₂L C₂L₊₁`) |
//! | 96..128 | bytes 4..8 of the packed scales of rows 0..7 (`B₀..B₇`) |
//! | 128..384 | Q5_K only: for h < 4, 64 bytes at 128 + 64·h: byte 8r + j is `qh[8h + j]` of row r |
//! | Q (128 for Q4_K, 384 for Q5_K) .. Q + 1024 | for chunk c < 4 and h < 4, 64 bytes at Q + 64·(4c + h): byte 8r + j is `qs[32c + 8h + j]` of row r |
//!
//! Q5_K's fifth bits: the low nibbles of load (c, h) are weights
//! 64c + 8h + j, whose fifth bit is bit 2c of `qh[8h + j]`, and the high
//! nibbles weights 64c + 32 + 8h + j (bit 2c + 1), so the four `qh` loads
//! of a group serve all 16 quant loads: a shift and a masked OR per nibble
//! register. They lie before the quants so that a group is read front to
//! back; a first Q5_K×8 (2026-12-06 morning) kept them after the quants,
//! re-read them per chunk, and decoded the 1.5B Q5_K_M 11% slower than the
//! row-major kernel, although it ran 2× as fast from L2. This layout
//! decodes it 8–11% faster (README, Speed).
//!
//! So the scales of rows 2L, 2L + 1 unpack inside 128-bit lane L, where
//! the `vpdpbusd` sums of those two rows are (row r in 32-bit lanes 2r and
//! 2r + 1), and one in-lane byte shuffle per run spreads them.
//!
//! # Arithmetic
//! The integer sums and the float steps are `qgemm_lanes`'s (its module
//! doc and `dot_scalar`): per row and superblock the exact `isum` and
//! `msum`, then `fma(dy·d, isum, acc)` and `fma(−dy·dmin, msum, acc_m)`;
//! so a matrix gives the same logits bit for bit repacked or not, on any
//! kernel. Overflow: a lane sums 16 products of a run (4 `vpdpbusd`),
//! |sum| ≤ 16·15·128 = 30720, which `vpdpwssd` reads as an exact i16 (the
//! sign-extended upper half is multiplied by 0). Q5_K's quants reach 31,
//! so at VNNI its lanes sum 8 products (two `vpdpbusd`), |sum| ≤ 8·31·128
//! = 31744, before each `vpdpwssd`: two per run; at AVX2 the 4 loads of a
//! run still add up in i16 (|sum| ≤ 4·2·31·128 = 31744). The kernels
//! test reaches those bounds.

use super::qgemm_lanes::{Q4_K_BYTES, Q5_K_BYTES, Q8_K_BYTES, ROWS};

/// Bytes of one group (8 rows × one superblock) of Q4_K (`Q5`: of Q5_K).
pub const fn group_bytes(q5: bool) -> usize {
    ROWS * if q5 { Q5_K_BYTES } else { Q4_K_BYTES }
}

/// Offsets in a group.
const G_DMIN: usize = 16;
const G_AC: usize = 32;
const G_B: usize = 96;
/// Q5_K's fifth bits (after the scales, before the quants).
const G_QH: usize = 128;

/// Where the quants start: after the scales (Q4_K), after the fifth bits
/// (Q5_K).
const fn g_q(q5: bool) -> usize {
    if q5 {
        G_QH + 4 * 64
    } else {
        128
    }
}

/// Where row `r`'s bytes of one superblock lie in its group (see the
/// module doc; `q5`: Q5_K): `(offset in the superblock, offset in the
/// group, length)`. Packing and unpacking both copy along this one list.
pub(super) fn segments(q5: bool, r: usize) -> impl Iterator<Item = (usize, usize, usize)> {
    // packed scales: A (bytes 0..4) and C (8..12) in 128-bit lane r / 2
    let ac = G_AC + 16 * (r / 2) + 4 * (r % 2);
    let heads = [
        (0, 2 * r, 2),
        (2, G_DMIN + 2 * r, 2),
        (4, ac, 4),
        (12, ac + 8, 4),
        (8, G_B + 4 * r, 4),
    ];
    // Q5_K's fifth bits: qh[8h..8h + 8] in load h
    let n_qh = if q5 { 4 } else { 0 };
    let qh = (0..n_qh).map(move |h| (16 + 8 * h, G_QH + 64 * h + 8 * r, 8));
    // quants: 8 bytes of chunk c at 8h, in load 4c + h
    let (qs, gq) = (if q5 { 48 } else { 16 }, g_q(q5));
    let quants = (0..16).map(move |i| (qs + 8 * i, gq + 64 * i + 8 * r, 8));
    heads.into_iter().chain(qh).chain(quants)
}

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Byte-shuffle masks that spread the scales (unpacked in place, see
/// `decode_vnni`): for run s, every `elem`-byte lane of the 8 bytes of row
/// 2L + m (bytes 8m..8m + 8 of 128-bit lane L) gets the scale of run s of
/// that row (byte 4m + s for s < 4, 8 + 4m + s − 4 above) in its low byte,
/// zeros above.
#[cfg(target_arch = "x86_64")]
const fn run_scales<const N: usize>(elem: usize) -> [[u8; N]; 8] {
    let mut t = [[0x80u8; N]; 8];
    let mut s = 0;
    while s < 8 {
        let mut i = 0;
        while i < N {
            let m = (i % 16) / 8;
            if i % elem == 0 {
                t[s][i] = if s < 4 {
                    (4 * m + s) as u8
                } else {
                    (8 + 4 * m + s - 4) as u8
                };
            }
            i += 1;
        }
        s += 1;
    }
    t
}

/// VNNI: each 32-bit lane (a row's `vpdpbusd` sums) gets its scale.
#[cfg(target_arch = "x86_64")]
static RUN_SCALE: [[u8; 64]; 8] = run_scales::<64>(4);

/// AVX2: each i16 lane (a row's `maddubs` pair sums) gets its scale.
#[cfg(target_arch = "x86_64")]
static RUN_SCALE16: [[u8; 32]; 8] = run_scales::<32>(2);

/// Per 128-bit lane: bytes 0..8 keep 6 bits (scales 0..3), bytes 8..16 keep
/// 4 (the low bits of scales 4..7).
#[cfg(target_arch = "x86_64")]
static SC_LOW: [u8; 64] = {
    let mut t = [0u8; 64];
    let mut i = 0;
    while i < 64 {
        t[i] = if i % 16 < 8 { 0x3f } else { 0x0f };
        i += 1;
    }
    t
};

/// A group's mins and the activation's 32-value sums, for both kernels:
/// the 8 rows' mins as bytes (dword r = row r; mins 0..3 from B_r, 4..7
/// from C_r's high nibbles and B_r's top bits), `cv` holding C_r in dword
/// r; the sums j = 0..3 and 4..7 as i16, each twice in its 128 bits.
///
/// # Safety
/// AVX2; `g` is a whole group, `yb` a whole Q8_K block.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn mins_and_sums(g: *const u8, cv: __m256i, yb: *const u8) -> ([__m256i; 2], [__m128i; 2]) {
    // SAFETY: the function's contract (B at G_B, bsums at byte 260).
    unsafe {
        let bv = _mm256_loadu_si256(g.add(G_B).cast());
        let m_lo = _mm256_and_si256(bv, _mm256_set1_epi8(0x3f));
        let m_hi = _mm256_or_si256(
            _mm256_and_si256(_mm256_srli_epi16(cv, 4), _mm256_set1_epi8(0x0f)),
            _mm256_and_si256(_mm256_srli_epi16(bv, 2), _mm256_set1_epi8(0x30)),
        );
        let bs = _mm256_loadu_si256(yb.add(260).cast());
        let b32 = _mm256_madd_epi16(bs, _mm256_set1_epi16(1));
        let b16 = _mm256_packs_epi32(b32, b32);
        (
            [m_lo, m_hi],
            [
                _mm256_castsi256_si128(b16),
                _mm256_extracti128_si256::<1>(b16),
            ],
        )
    }
}

/// Q5_K's fifth bits of a load: bit `b` of each byte of `qh` moved to
/// bit 4 (the other bits are left over, for the caller to mask).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn bit_to_4(qh: __m512i, b: usize) -> __m512i {
    // SAFETY: register-only AVX-512 BW shifts (the caller's features); a
    // word shift moves bits between the bytes of a word, but never into
    // or out of bit 4 of either byte for these counts.
    unsafe {
        match b {
            0 => _mm512_slli_epi16::<4>(qh),
            1 => _mm512_slli_epi16::<3>(qh),
            2 => _mm512_slli_epi16::<2>(qh),
            3 => _mm512_slli_epi16::<1>(qh),
            4 => qh,
            5 => _mm512_srli_epi16::<1>(qh),
            6 => _mm512_srli_epi16::<2>(qh),
            _ => _mm512_srli_epi16::<3>(qh),
        }
    }
}

/// Two halves' integer sums (row 4k + j of half k in 32-bit lanes 2j,
/// 2j + 1) as one sum per row, lane r = row r (exact, integer).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn fold_halves(h0: __m256i, h1: __m256i) -> __m256i {
    // SAFETY: register-only AVX2 ops (the caller's features).
    unsafe {
        // rows 0 1 4 5 | 2 3 6 7, then the 64-bit pairs in order
        _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_hadd_epi32(h0, h1))
    }
}

/// One token against 8 repacked rows at AVX2: the same sums and float
/// steps as [`decode_vnni`], 4 rows per 256-bit register.
///
/// # Safety
/// AVX2, FMA, F16C; `x` holds `nb` groups, `y` `nb` Q8_K blocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn decode_avx2<const Q5: bool>(
    nb: usize,
    x: *const u8,
    y: *const u8,
) -> [f32; ROWS] {
    use super::qgemm_lanes::float_step;
    // SAFETY: the function's contract: the features are enabled, every
    // load is inside the nb groups / blocks.
    unsafe {
        let (gb, gq) = (group_bytes(Q5), g_q(Q5));
        let bit4 = _mm256_set1_epi8(0x10);
        let nib = _mm256_set1_epi8(0x0f);
        let sc_low = _mm256_loadu_si256(SC_LOW.as_ptr().cast());
        let sc_high = _mm256_set1_epi8(0x30);
        let mut acc = _mm256_setzero_ps();
        let mut acc_m = _mm256_setzero_ps();
        for b in 0..nb {
            let g = x.add(b * gb);
            super::mem::prefetch_ahead(g, gb);
            let yb = y.add(b * Q8_K_BYTES);
            // per half k (rows 4k..4k + 4): the packed scales of rows
            // 4k + 2l, 4k + 2l + 1 in 128-bit lane l, unpacked in place
            let ac: [__m256i; 2] =
                std::array::from_fn(|k| _mm256_loadu_si256(g.add(G_AC + 32 * k).cast()));
            let sc = ac.map(|a| {
                let low = _mm256_and_si256(a, sc_low);
                let high =
                    _mm256_and_si256(_mm256_srli_epi16(_mm256_bslli_epi128(a, 8), 2), sc_high);
                _mm256_or_si256(low, high)
            });
            // the integer sums per half, row 4k + j in lanes 2j, 2j + 1
            let mut isum = [_mm256_setzero_si256(); 2];
            for c in 0..4 {
                // Q5_K: bit 2c of each byte of qh moved to bit 0 by one word
                // shift (its count in a register: no branch on c)
                let cnt = _mm_cvtsi32_si128(2 * c as i32);
                let mut sl = [_mm256_setzero_si256(); 2];
                let mut sh = [_mm256_setzero_si256(); 2];
                for h in 0..4 {
                    let ya = _mm256_set1_epi64x(
                        yb.add(4 + 64 * c + 8 * h).cast::<i64>().read_unaligned(),
                    );
                    let yh = _mm256_set1_epi64x(
                        yb.add(36 + 64 * c + 8 * h).cast::<i64>().read_unaligned(),
                    );
                    for k in 0..2 {
                        let v = _mm256_loadu_si256(g.add(gq + 64 * (4 * c + h) + 32 * k).cast());
                        let mut lo = _mm256_and_si256(v, nib);
                        let mut hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
                        if Q5 {
                            // the fifth bits: bit 2c (low nibbles) and 2c + 1
                            // (high) of each byte, at bit 0 and 1 after the
                            // shift, then at bit 4 (a word shift by 2c ≤ 6
                            // moves a byte's bit 2c to its own bit 0, and the
                            // shifts by 4 and 3 put nothing else at bit 4)
                            let qh = _mm256_loadu_si256(g.add(G_QH + 64 * h + 32 * k).cast());
                            let t = _mm256_srl_epi16(qh, cnt);
                            lo = _mm256_or_si256(
                                lo,
                                _mm256_and_si256(_mm256_slli_epi16(t, 4), bit4),
                            );
                            hi = _mm256_or_si256(
                                hi,
                                _mm256_and_si256(_mm256_slli_epi16(t, 3), bit4),
                            );
                        }
                        sl[k] = _mm256_add_epi16(sl[k], _mm256_maddubs_epi16(lo, ya));
                        sh[k] = _mm256_add_epi16(sh[k], _mm256_maddubs_epi16(hi, yh));
                    }
                }
                let m_lo = _mm256_loadu_si256(RUN_SCALE16[2 * c].as_ptr().cast());
                let m_hi = _mm256_loadu_si256(RUN_SCALE16[2 * c + 1].as_ptr().cast());
                for k in 0..2 {
                    let s_lo = _mm256_shuffle_epi8(sc[k], m_lo);
                    let s_hi = _mm256_shuffle_epi8(sc[k], m_hi);
                    isum[k] = _mm256_add_epi32(
                        isum[k],
                        _mm256_add_epi32(
                            _mm256_madd_epi16(sl[k], s_lo),
                            _mm256_madd_epi16(sh[k], s_hi),
                        ),
                    );
                }
            }
            // mins: row r's 0..3 from B_r, 4..7 from C_r's high nibbles and
            // B_r's top bits; C_r gathered from both halves (rows 0 1 4 5 |
            // 2 3 6 7, then in order)
            let cv = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_unpackhi_epi64(ac[0], ac[1]));
            let ([m_lo, m_hi], [p_lo, p_hi]) = mins_and_sums(g, cv, yb);
            // the sums repeated over a row's 4 i16 lanes
            let (p_lo, p_hi) = (
                _mm256_broadcastsi128_si256(p_lo),
                _mm256_broadcastsi128_si256(p_hi),
            );
            // per half: row 4k + j's mins (4 + 4 bytes) against them
            let half = |v: __m256i, k: usize| {
                let v = if k == 0 {
                    _mm256_castsi256_si128(v)
                } else {
                    _mm256_extracti128_si256::<1>(v)
                };
                _mm256_cvtepu8_epi16(v)
            };
            let msum: [__m256i; 2] = std::array::from_fn(|k| {
                _mm256_add_epi32(
                    _mm256_madd_epi16(half(m_lo, k), p_lo),
                    _mm256_madd_epi16(half(m_hi, k), p_hi),
                )
            });
            let d = _mm256_cvtph_ps(_mm_loadu_si128(g.cast()));
            let dmin = _mm256_cvtph_ps(_mm_loadu_si128(g.add(G_DMIN).cast()));
            let dy = yb.cast::<f32>().read_unaligned();
            acc_m = float_step(-dy, dmin, fold_halves(msum[0], msum[1]), acc_m);
            acc = float_step(dy, d, fold_halves(isum[0], isum[1]), acc);
        }
        let mut out = [0f32; ROWS];
        // SAFETY: out holds 8 floats.
        _mm256_storeu_ps(out.as_mut_ptr(), _mm256_add_ps(acc, acc_m));
        out
    }
}

/// Sum the two 32-bit lanes of each row: lane r of the result is lanes 2r
/// + 2r + 1 of `x` (exact, integer).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn fold_pairs(x: __m512i) -> __m256i {
    // SAFETY: register-only AVX-512 F ops (the caller's features).
    unsafe { _mm512_cvtepi64_epi32(_mm512_add_epi32(x, _mm512_srli_epi64(x, 32))) }
}

/// One token against 8 repacked rows.
///
/// # Safety
/// AVX-512 F/BW/VL and VNNI; `x` holds `nb` groups, `y` `nb` Q8_K blocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn decode_vnni<const Q5: bool>(
    nb: usize,
    x: *const u8,
    y: *const u8,
) -> [f32; ROWS] {
    use super::qgemm_lanes::float_step;
    // SAFETY: the function's contract: the features are enabled, every
    // load is inside the nb groups / blocks.
    unsafe {
        let (gb, gq) = (group_bytes(Q5), g_q(Q5));
        let bit4 = _mm512_set1_epi8(0x10);
        let nib = _mm512_set1_epi8(0x0f);
        let sc_low = _mm512_loadu_si512(SC_LOW.as_ptr().cast());
        let sc_high = _mm512_set1_epi8(0x30);
        let c_rows = _mm256_setr_epi32(2, 3, 6, 7, 10, 11, 14, 15);
        let mut acc = _mm256_setzero_ps();
        let mut acc_m = _mm256_setzero_ps();
        for b in 0..nb {
            let g = x.add(b * gb);
            super::mem::prefetch_ahead(g, gb);
            let yb = y.add(b * Q8_K_BYTES);
            // Q5_K's fifth bits, read once per group (before the quants)
            let qh: [__m512i; 4] = std::array::from_fn(|h| {
                if Q5 {
                    _mm512_loadu_si512(g.add(G_QH + 64 * h).cast())
                } else {
                    _mm512_setzero_si512()
                }
            });
            // scales of rows 2L, 2L + 1 in 128-bit lane L: bytes 0..4 and
            // 4..8 scales 0..3, bytes 8..12 and 12..16 scales 4..7 (low 4
            // bits from C, high 2 from A's top bits)
            let ac = _mm512_loadu_si512(g.add(G_AC).cast());
            let low = _mm512_and_si512(ac, sc_low);
            let high = _mm512_and_si512(_mm512_srli_epi16(_mm512_bslli_epi128(ac, 8), 2), sc_high);
            let sc = _mm512_or_si512(low, high);
            // the integer sums, row r in lanes 2r and 2r + 1
            let mut isum = _mm512_setzero_si512();
            for c in 0..4 {
                // a run's lane sums: [0] of loads h < 2, [1] of h ≥ 2 for
                // Q5_K (8 products a lane, within i16); Q4_K sums all four
                // loads in [0]
                let mut sl = [_mm512_setzero_si512(); 2];
                let mut sh = [_mm512_setzero_si512(); 2];
                for h in 0..4 {
                    let v = _mm512_loadu_si512(g.add(gq + 64 * (4 * c + h)).cast());
                    let mut lo = _mm512_and_si512(v, nib);
                    let mut hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
                    if Q5 {
                        // | (bit 2c or 2c + 1 of qh, at bit 4): ternary
                        // logic 0xF8 is a | (b & c)
                        lo = _mm512_ternarylogic_epi32::<0xF8>(lo, bit_to_4(qh[h], 2 * c), bit4);
                        hi =
                            _mm512_ternarylogic_epi32::<0xF8>(hi, bit_to_4(qh[h], 2 * c + 1), bit4);
                    }
                    let ya = _mm512_set1_epi64(
                        yb.add(4 + 64 * c + 8 * h).cast::<i64>().read_unaligned(),
                    );
                    let yh = _mm512_set1_epi64(
                        yb.add(36 + 64 * c + 8 * h).cast::<i64>().read_unaligned(),
                    );
                    let k = if Q5 { h / 2 } else { 0 };
                    sl[k] = _mm512_dpbusd_epi32(sl[k], lo, ya);
                    sh[k] = _mm512_dpbusd_epi32(sh[k], hi, yh);
                }
                let s_lo =
                    _mm512_shuffle_epi8(sc, _mm512_loadu_si512(RUN_SCALE[2 * c].as_ptr().cast()));
                let s_hi = _mm512_shuffle_epi8(
                    sc,
                    _mm512_loadu_si512(RUN_SCALE[2 * c + 1].as_ptr().cast()),
                );
                isum = _mm512_dpwssd_epi32(isum, sl[0], s_lo);
                isum = _mm512_dpwssd_epi32(isum, sh[0], s_hi);
                if Q5 {
                    isum = _mm512_dpwssd_epi32(isum, sl[1], s_lo);
                    isum = _mm512_dpwssd_epi32(isum, sh[1], s_hi);
                }
            }
            // mins: row r's 0..3 from B_r, 4..7 from C_r's high nibbles and
            // B_r's top bits; against the activation's 32-value sums
            let cv = _mm512_castsi512_si256(_mm512_permutexvar_epi32(
                _mm512_castsi256_si512(c_rows),
                ac,
            ));
            let ([m_lo, m_hi], [p_lo, p_hi]) = mins_and_sums(g, cv, yb);
            let (p_lo, p_hi) = (_mm512_broadcast_i32x4(p_lo), _mm512_broadcast_i32x4(p_hi));
            let msum = _mm512_madd_epi16(_mm512_cvtepu8_epi16(m_lo), p_lo);
            let msum = _mm512_dpwssd_epi32(msum, _mm512_cvtepu8_epi16(m_hi), p_hi);
            let d = _mm256_cvtph_ps(_mm_loadu_si128(g.cast()));
            let dmin = _mm256_cvtph_ps(_mm_loadu_si128(g.add(G_DMIN).cast()));
            let dy = yb.cast::<f32>().read_unaligned();
            acc_m = float_step(-dy, dmin, fold_pairs(msum), acc_m);
            acc = float_step(dy, d, fold_pairs(isum), acc);
        }
        let mut out = [0f32; ROWS];
        // SAFETY: out holds 8 floats.
        _mm256_storeu_ps(out.as_mut_ptr(), _mm256_add_ps(acc, acc_m));
        out
    }
}
