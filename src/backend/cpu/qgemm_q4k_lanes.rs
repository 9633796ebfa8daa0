//! Q4_K × Q8_K with the weight rows in the SIMD lanes (AVX2): 8 rows × `N`
//! tokens per call (`N` = [`TOKS`] for prefill, 1 for decoding), for CPUs
//! without VNNI.
//!
//! The row-major tiles of [`super::qgemm_q4k`] keep ggml's lane layout (8
//! lanes per row, each summing bytes 4k..4k+3 of every sub-block), so per
//! (row, token) they pay a `madd` by the sub-block scale per 32 weights and
//! a float reduction per superblock. Here each 32-bit lane holds one of 8
//! rows instead: the 8 rows' 32-byte nibble chunks are transposed in
//! registers (8 × 8 dwords, no repacked copy of the weights, so nothing
//! but the memory map is resident), every activation dword is broadcast to
//! all 8 rows, and:
//!
//! - `maddubs` of one 4-weight group of 8 rows with its 4 activations
//!   gives 32 products; the 8 groups of a sub-block are summed in i16
//!   (|sum| ≤ 8·2·15·128 = 30720, no overflow), then one `madd` by the
//!   rows' scales of that sub-block widens to i32: two multiplies per 32
//!   products become ~9 per 256;
//! - the mins are 4 `madd`s per token per superblock (pairs of 6-bit mins
//!   against pairs of the activation's 32-value sums, which fit i16);
//! - the float steps are one `fma` per superblock for 8 rows at once.
//!
//! The arithmetic (per row, token and superblock `b`) is therefore *not*
//! ggml's `vec_dot` lane for lane but this, which [`dot_scalar`] models and
//! every kernel here reproduces bit for bit:
//!
//! ```text
//! isum_b = Σ_s scale[s] · Σ_{j in s} q_j · y_j            (exact i32)
//! msum_b = Σ_s min[s] · (bsum[2s] + bsum[2s+1])          (exact i32)
//! acc    = fma(dy·d,     f32(isum_b), acc)
//! acc_m  = fma((−dy)·dmin, f32(msum_b), acc_m)
//! result = acc + acc_m
//! ```
//!
//! It differs from ggml's (8 float lanes per row summed at the end) by
//! float rounding only: tests/engine/kernels.rs bounds it against an f64
//! dot product of the same quantized data and against `vec_dot`.

use super::qgemm_q4k::{Q4_K_BYTES, Q8_K_BYTES};
use half::f16;

/// Weight rows per call.
pub const ROWS: usize = 8;
/// Tokens per prefill call: each transposed weight chunk serves 8 tokens
/// (measured on a Zen 3 core, one 8-row × 8-token call runs ~1.4× the
/// multiply-adds per second of 8 × 4).
pub const TOKS: usize = 8;

/// A kernel: `(nb, 8 weight rows, N token rows) -> out[r][t]`.
pub type LanesFn<const N: usize> = fn(usize, &[&[u8]; ROWS], &[&[u8]; N]) -> [[f32; N]; ROWS];

fn check<const N: usize>(nb: usize, w: &[&[u8]; ROWS], a: &[&[u8]; N]) {
    assert!(
        w.iter().all(|r| r.len() >= nb * Q4_K_BYTES),
        "q4_K lanes: weight row too short"
    );
    assert!(
        a.iter().all(|r| r.len() >= nb * Q8_K_BYTES),
        "q4_K lanes: activation row too short"
    );
}

/// Scalar model of one (row, token) dot product of `nb` superblocks (see the
/// module doc).
pub fn dot_scalar(nb: usize, x: &[u8], y: &[u8]) -> f32 {
    assert!(x.len() >= nb * Q4_K_BYTES && y.len() >= nb * Q8_K_BYTES);
    let (mut acc, mut acc_m) = (0f32, 0f32);
    for b in 0..nb {
        let x = &x[b * Q4_K_BYTES..(b + 1) * Q4_K_BYTES];
        let y = &y[b * Q8_K_BYTES..(b + 1) * Q8_K_BYTES];
        let dy = f32::from_le_bytes([y[0], y[1], y[2], y[3]]);
        let f16_at = |i: usize| f16::from_bits(u16::from_le_bytes([x[i], x[i + 1]])).to_f32();
        let (d, dmin) = (f16_at(0), f16_at(2));
        let (sc, mn) = crate::quant::k_scales_mins(&x[4..16]);
        let bsum = |i: usize| i16::from_le_bytes([y[260 + 2 * i], y[261 + 2 * i]]) as i32;
        let (mut isum, mut msum) = (0i32, 0i32);
        for s in 0..8 {
            // sub-block s: chunk s / 2, low nibbles when s is even
            let (c, hi) = (s / 2, s % 2 == 1);
            let mut p = 0i32;
            for j in 0..32 {
                let byte = x[16 + 32 * c + j];
                let q = if hi { byte >> 4 } else { byte & 0x0f };
                p += q as i32 * y[4 + 32 * s + j] as i8 as i32;
            }
            isum += sc[s] as i32 * p;
            msum += mn[s] as i32 * (bsum(2 * s) + bsum(2 * s + 1));
        }
        acc = (dy * d).mul_add(isum as f32, acc);
        acc_m = (-dy * dmin).mul_add(msum as f32, acc_m);
    }
    acc + acc_m
}

/// Scalar model of a whole call.
pub fn lanes_scalar<const N: usize>(
    nb: usize,
    w: &[&[u8]; ROWS],
    a: &[&[u8]; N],
) -> [[f32; N]; ROWS] {
    check(nb, w, a);
    std::array::from_fn(|r| std::array::from_fn(|t| dot_scalar(nb, w[r], a[t])))
}

/// The kernel of `N` tokens for SIMD level `level`, where this arithmetic
/// is the level's Q4_K path (AVX2, and AVX-512 without VNNI) and the CPU
/// runs it.
pub fn lanes_for<const N: usize>(level: super::isa::Level) -> Option<LanesFn<N>> {
    use super::isa::{detected, Level};
    if level > detected() {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    if matches!(level, Level::Avx2 | Level::Avx512) {
        return Some(lanes_avx2::<N>);
    }
    None
}

#[cfg(target_arch = "x86_64")]
fn lanes_avx2<const N: usize>(nb: usize, w: &[&[u8]; ROWS], a: &[&[u8]; N]) -> [[f32; N]; ROWS] {
    check(nb, w, a);
    // SAFETY: handed out (lanes_for) only where the CPU has AVX2, FMA and
    // F16C; every row holds nb superblocks (checked just above), which
    // bounds all loads.
    unsafe { lanes_avx2_impl::<N>(nb, w, a) }
}

/// 8 × 8 transpose of 32-bit lanes: lane r of output g = lane g of input r.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn transpose8(v: [std::arch::x86_64::__m256i; 8]) -> [std::arch::x86_64::__m256i; 8] {
    use std::arch::x86_64::*;
    // SAFETY: register-only AVX2 ops; callers are AVX2 target-feature
    // functions this is inlined into.
    unsafe {
        let t: [__m256i; 8] = std::array::from_fn(|i| {
            let (p, q) = (v[2 * (i / 2)], v[2 * (i / 2) + 1]);
            if i % 2 == 0 {
                _mm256_unpacklo_epi32(p, q)
            } else {
                _mm256_unpackhi_epi32(p, q)
            }
        });
        // u[k]: dword k (and k + 4) of rows 0-3 (k < 4) or 4-7
        let u: [__m256i; 8] = std::array::from_fn(|i| {
            let base = 4 * (i / 4);
            let (p, q) = (t[base + (i % 4) / 2], t[base + 2 + (i % 4) / 2]);
            if i % 2 == 0 {
                _mm256_unpacklo_epi64(p, q)
            } else {
                _mm256_unpackhi_epi64(p, q)
            }
        });
        std::array::from_fn(|g| {
            let (p, q) = (u[g % 4], u[4 + g % 4]);
            if g < 4 {
                _mm256_permute2x128_si256(p, q, 0x20)
            } else {
                _mm256_permute2x128_si256(p, q, 0x31)
            }
        })
    }
}

/// 8 × 8 transpose of bytes: byte r of output row s = byte s of `m[r]`;
/// returned as 4 vectors holding output rows (0, 1), (2, 3), (4, 5), (6, 7).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn transpose8x8_bytes(m: [u64; 8]) -> [std::arch::x86_64::__m128i; 4] {
    use std::arch::x86_64::*;
    // SAFETY: register-only SSE2 ops.
    unsafe {
        let r = |i: usize| _mm_cvtsi64_si128(m[i] as i64);
        let t0 = _mm_unpacklo_epi8(r(0), r(1));
        let t1 = _mm_unpacklo_epi8(r(2), r(3));
        let t2 = _mm_unpacklo_epi8(r(4), r(5));
        let t3 = _mm_unpacklo_epi8(r(6), r(7));
        let u0 = _mm_unpacklo_epi16(t0, t1);
        let u1 = _mm_unpackhi_epi16(t0, t1);
        let u2 = _mm_unpacklo_epi16(t2, t3);
        let u3 = _mm_unpackhi_epi16(t2, t3);
        [
            _mm_unpacklo_epi32(u0, u2),
            _mm_unpackhi_epi32(u0, u2),
            _mm_unpacklo_epi32(u1, u3),
            _mm_unpackhi_epi32(u1, u3),
        ]
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn lanes_avx2_impl<const N: usize>(
    nb: usize,
    w: &[&[u8]; ROWS],
    a: &[&[u8]; N],
) -> [[f32; N]; ROWS] {
    use std::arch::x86_64::*;
    let wp: [*const u8; ROWS] = std::array::from_fn(|r| w[r].as_ptr());
    let ap: [*const u8; N] = std::array::from_fn(|t| a[t].as_ptr());
    let low = _mm256_set1_epi8(0x0f);
    // lanes = rows, per token
    let mut acc = [_mm256_setzero_ps(); N];
    let mut acc_m = [_mm256_setzero_ps(); N];
    for b in 0..nb {
        // SAFETY (all pointer arithmetic and loads below): b < nb and every
        // weight / activation row holds nb blocks.
        let x: [*const u8; ROWS] = std::array::from_fn(|r| unsafe { wp[r].add(b * Q4_K_BYTES) });
        let y: [*const u8; N] = std::array::from_fn(|t| unsafe { ap[t].add(b * Q8_K_BYTES) });
        if N == 1 {
            // decoding: fetch this block of the next call's 8 rows (the
            // rows after these in a contiguous matrix) one call ahead; only
            // a hint, never a read (see `qgemm_q4k::prefetch_next_tile`)
            let ahead = ROWS * nb * Q4_K_BYTES;
            for p in x {
                for line in [0, 64, 128] {
                    // a prefetch never faults and reads nothing the program
                    // sees; wrapping_add keeps `p`'s provenance
                    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(ahead + line).cast());
                }
            }
        }
        // the rows' d and dmin as 8 float lanes
        let f16s = |off: usize| {
            let h: [i16; ROWS] =
                std::array::from_fn(|r| unsafe { x[r].add(off).cast::<i16>().read_unaligned() });
            // SAFETY: h holds 8 i16.
            _mm256_cvtph_ps(unsafe { _mm_loadu_si128(h.as_ptr().cast()) })
        };
        let (xd, xm) = (f16s(0), f16s(2));
        // per row the 8 scales and 8 mins (bytes), transposed to per
        // sub-block × 8 rows
        let mut scb = [0u64; ROWS];
        let mut mnb = [0u64; ROWS];
        for r in 0..ROWS {
            // SAFETY: x[r] + 4 is the block's 12 scale bytes.
            let u = unsafe { super::qgemm_q4k::unpack16(x[r].add(4)) };
            scb[r] = u[0] as u64 | (u[1] as u64) << 32;
            mnb[r] = u[2] as u64 | (u[3] as u64) << 32;
        }
        let sct = transpose8x8_bytes(scb);
        let mnt = transpose8x8_bytes(mnb);
        // scale of sub-block s for the 8 rows as (i16, i16) pairs
        let scp: [__m256i; 8] = std::array::from_fn(|s| {
            let v = if s % 2 == 0 {
                sct[s / 2]
            } else {
                _mm_srli_si128(sct[s / 2], 8)
            };
            let v = _mm256_cvtepu8_epi32(v);
            _mm256_or_si256(v, _mm256_slli_epi32(v, 16))
        });
        // mins of sub-blocks (2i, 2i + 1) for the 8 rows as i16 pairs
        let mnp: [__m256i; 4] = std::array::from_fn(|i| {
            _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mnt[i], _mm_srli_si128(mnt[i], 8)))
        });
        let mut isum = [_mm256_setzero_si256(); N];
        for c in 0..4 {
            let raw: [__m256i; ROWS] = std::array::from_fn(|r| unsafe {
                _mm256_loadu_si256(x[r].add(16 + 32 * c).cast())
            });
            // group g (4 weights) of both sub-blocks of the chunk, rows in
            // lanes; the nibbles are split after the (bytewise) transpose
            let tr = transpose8(raw);
            for half in 0..2 {
                let s = 2 * c + half;
                let q: [__m256i; 8] = std::array::from_fn(|g| {
                    if half == 0 {
                        _mm256_and_si256(tr[g], low)
                    } else {
                        _mm256_and_si256(_mm256_srli_epi16(tr[g], 4), low)
                    }
                });
                for t in 0..N {
                    let ys = unsafe { y[t].add(4 + 32 * s) };
                    let mut p16 = _mm256_setzero_si256();
                    for (g, qg) in q.iter().enumerate() {
                        let yg = _mm256_set1_epi32(unsafe {
                            ys.add(4 * g).cast::<i32>().read_unaligned()
                        });
                        p16 = _mm256_add_epi16(p16, _mm256_maddubs_epi16(*qg, yg));
                    }
                    isum[t] = _mm256_add_epi32(isum[t], _mm256_madd_epi16(p16, scp[s]));
                }
            }
        }
        for t in 0..N {
            let yd = unsafe { y[t].cast::<f32>().read_unaligned() };
            // the activation's 32-value sums, as pairs (2i, 2i + 1)
            let bs = unsafe { _mm256_loadu_si256(y[t].add(260).cast()) };
            let bs32 = _mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256(bs, 1));
            let pair = |i: i32| {
                _mm256_set1_epi32(match i {
                    0 => _mm_extract_epi32(bs32, 0),
                    1 => _mm_extract_epi32(bs32, 1),
                    2 => _mm_extract_epi32(bs32, 2),
                    _ => _mm_extract_epi32(bs32, 3),
                })
            };
            let msum = _mm256_add_epi32(
                _mm256_add_epi32(
                    _mm256_madd_epi16(mnp[0], pair(0)),
                    _mm256_madd_epi16(mnp[1], pair(1)),
                ),
                _mm256_add_epi32(
                    _mm256_madd_epi16(mnp[2], pair(2)),
                    _mm256_madd_epi16(mnp[3], pair(3)),
                ),
            );
            let d = _mm256_mul_ps(_mm256_set1_ps(yd), xd);
            acc[t] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(isum[t]), acc[t]);
            let dm = _mm256_mul_ps(_mm256_set1_ps(-yd), xm);
            acc_m[t] = _mm256_fmadd_ps(dm, _mm256_cvtepi32_ps(msum), acc_m[t]);
        }
    }
    let mut out = [[0f32; N]; ROWS];
    for t in 0..N {
        let mut v = [0f32; ROWS];
        // SAFETY: v holds 8 floats.
        unsafe { _mm256_storeu_ps(v.as_mut_ptr(), _mm256_add_ps(acc[t], acc_m[t])) };
        for r in 0..ROWS {
            out[r][t] = v[r];
        }
    }
    out
}
