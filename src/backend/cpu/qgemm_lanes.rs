//! K-quant (Q4_K, Q5_K, Q6_K, Q3_K, Q2_K) and IQ4_XS × Q8_K with the
//! weight rows in the SIMD lanes (AVX2, and AVX-512 VNNI where present): 8 rows × `N`
//! tokens per call (`N` = [`TOKS`] for prefill, 1 for decoding), the
//! K-quant kernels of every x86 SIMD level.
//!
//! ggml's `vec_dot` (and the row-major 4 × 4 tiles that followed it lane
//! for lane, retired once this was faster at every level) keeps 8 lanes per
//! row, each summing bytes 4k..4k+3 of every sub-block, so per (row,
//! token) it pays a `madd` by the scale per 16 or 32 weights and a float
//! reduction per superblock. Here each 32-bit lane
//! holds one of 8 rows instead: the 8 rows' 32-byte chunks of quants are
//! transposed in registers (8 × 8 dwords; no repacked copy of the weights,
//! so nothing but the memory map is resident) and unpacked once per
//! superblock into 8 runs of 32 weights × 8 groups of 4 (unsigned quants,
//! rows in lanes); every activation dword is broadcast to the 8 rows, and:
//!
//! - `maddubs` of one group of 8 rows with its 4 activations gives 32
//!   products (pairs in i16); `G` groups are summed in i16, then one `madd`
//!   by the rows' scales widens to i32. `G` is the most groups whose sum
//!   cannot overflow: |sum| ≤ G·2·qmax·128 < 32768, so G = 8 for Q4_K
//!   (qmax 15), 4 for Q5_K (31), 2 for Q6_K (63), and 4 (one scale's
//!   groups) for Q3_K (7) and Q2_K (3). IQ4_XS's quants (grid + 128) reach
//!   241, so these kernels take each as its two nibbles (two `maddubs`,
//!   the high one's `madd` by 16·scale; G = 8);
//! - the offsets are `madd`s per token per superblock against the
//!   activation's block sums (Q8_K's `bsums`): the mins of Q4_K and Q5_K
//!   (pairs of 6-bit mins against 32-value sums, 4 `madd`s) and of Q2_K
//!   (4-bit mins against 16-value sums, 8 `madd`s), and Q6_K's −32,
//!   Q3_K's −4 and IQ4_XS's −128 (which make their quants unsigned:
//!   −32·scale, −4·scale or −128·scale against 16-value sums, 8 `madd`s,
//!   folded into the integer sum);
//! - the float steps are one `fma` per superblock for 8 rows at once (two
//!   with mins).
//!
//! The arithmetic (per row, token and superblock `b`) is therefore *not*
//! ggml's `vec_dot` lane for lane but this, which [`dot_scalar`] models and
//! every kernel here reproduces bit for bit (`q` the unsigned quants, `sc16`
//! the scale of each 16 weights, `bsum` the 16-value activation sums):
//!
//! ```text
//! isum_b = Σ_j sc16[j] · Σ_{i in j} q_i · y_i                    (exact i32)
//!   Q6_K:  isum_b −= 32 · Σ_j sc16[j] · bsum[j]                  (exact)
//!   Q3_K:  isum_b −=  4 · Σ_j sc16[j] · bsum[j]                  (exact)
//!   IQ4_XS: isum_b −= 128 · Σ_j sc16[j] · bsum[j]                (exact)
//!   Q4/5_K: msum_b = Σ_s min[s] · (bsum[2s] + bsum[2s+1])         (exact)
//!   Q2_K:   msum_b = Σ_j min[j] · bsum[j]                         (exact)
//! acc    = fma(dy·d,        f32(isum_b), acc)
//! acc_m  = fma((−dy)·dmin,  f32(msum_b), acc_m)                  (Q2/4/5_K)
//! result = acc + acc_m
//! ```
//!
//! Decoding (one token) reads the rows as they are instead (at the AVX-512
//! levels with 512-bit registers, in [`super::qgemm_k_decode`]; [`rows`]:
//! ggml's unpacking, a row's integer lanes summed exactly, then the 8 rows'
//! sums moved into lanes for the same float steps): with one token the
//! transposes cost more than they save, and the result is the same bit for
//! bit, so a prompt's logits still do not depend on how it is chunked.
//! (Q4_K matrices are repacked at load instead, from AVX2 up,
//! [`super::q4k_x8`], and decoded by that module's kernels with the same
//! sums and float steps.)
//!
//! The engine's prefill runs over packed micro tiles instead
//! ([`packed_for`], every level from AVX2 up): [`PackFn`] writes a micro
//! tile's transposed, unpacked quants and decoded scales once per row block
//! (the caller keeps a block's tiles in L2), and [`PackedFn`] streams token
//! tiles past them with the same integer sums and float steps, so it equals
//! the unpacked kernel bit for bit while paying the unpacking once per
//! block instead of once per token tile. At AVX2 that also keeps the inner
//! loop in 16 registers (the unpacked kernel holds a unit's runs, 16–32
//! registers, and spills where AVX-512's 32 are missing): on a Zen 4 build
//! for x86-64-v3, the 7B's prefill went from 1.34× to 1.85× llama.cpp's
//! AVX2 build, the 1.5B Q5_K_M's from 1.16× to 1.82× (README, Speed).
//!
//! It differs from ggml's (8 float lanes per row summed at the end) by
//! float rounding only: tests/engine/kernels.rs bounds it against an f64
//! dot product of the same quantized data and against `vec_dot`.

use crate::tensor::DType;
use half::f16;

/// Bytes of a Q4_K superblock: `d`, `dmin` (f16), `scales[12]`, `qs[128]`.
pub const Q4_K_BYTES: usize = 144;
/// Bytes of a Q5_K superblock: `d`, `dmin` (f16), `scales[12]`, `qh[32]`,
/// `qs[128]`.
pub const Q5_K_BYTES: usize = 176;
/// Bytes of a Q6_K superblock: `ql[128]`, `qh[64]`, `scales[16]` (i8),
/// `d` (f16).
pub const Q6_K_BYTES: usize = 210;
/// Bytes of a Q3_K superblock: `hmask[32]`, `qs[64]`, `scales[12]`, `d`.
pub const Q3_K_BYTES: usize = 110;
/// Bytes of a Q2_K superblock: `scales[16]`, `qs[64]`, `d`, `dmin`.
pub const Q2_K_BYTES: usize = 84;
/// Bytes of an IQ4_XS superblock: `d`, `scales_h`, `scales_l[4]`, `qs[128]`.
pub const IQ4_XS_BYTES: usize = 136;
/// Bytes of a Q8_K block: `d` (f32), `qs[256]` (i8), `bsums[16]` (i16).
pub const Q8_K_BYTES: usize = 292;

/// The packed `scales[12]` of a Q4_K / Q5_K superblock as 16 bytes, the 8
/// scales then the 8 mins (the same values as
/// [`crate::quant::k_scales_mins`], by 32-bit masks and shifts on
/// little-endian words).
///
/// # Safety
/// `q` must point to 12 readable bytes.
#[cfg(target_arch = "x86_64")]
#[inline]
pub(super) unsafe fn unpack16(q: *const u8) -> [u32; 4] {
    // SAFETY: q points to 12 readable bytes (the caller's contract).
    unpack16_bytes(unsafe { q.cast::<[u8; 12]>().read_unaligned() })
}

/// [`unpack16`] of the 12 bytes themselves.
#[inline(always)]
pub(super) fn unpack16_bytes(q: [u8; 12]) -> [u32; 4] {
    const KMASK1: u32 = 0x3f3f_3f3f;
    const KMASK2: u32 = 0x0f0f_0f0f;
    const KMASK3: u32 = 0x0303_0303;
    let w = |i: usize| u32::from_le_bytes([q[4 * i], q[4 * i + 1], q[4 * i + 2], q[4 * i + 3]]);
    let mut u = [w(0), w(1), w(2), 0];
    u[3] = ((u[2] >> 4) & KMASK2) | (((u[1] >> 6) & KMASK3) << 4);
    let aux = u[1] & KMASK1;
    u[1] = (u[2] & KMASK2) | (((u[0] >> 6) & KMASK3) << 4);
    u[2] = aux;
    u[0] &= KMASK1;
    u
}

/// How many calls ahead the decoding kernel prefetches its rows (into L2:
/// measured on a Zen 4 VM, 2 threads, synthetic R1-Distill-Qwen-1.5B
/// Q5_K_M decode, `_MM_HINT_T1` 2 calls ahead ran 19–23 t/s where
/// `_MM_HINT_T0` 1 or 2 calls ahead ran 11–12 and no prefetch 8.5; the
/// 7B Q4_K_M 4.8–5.1 against 3.7–4.2).
const PREFETCH_CALLS: usize = 2;

/// Weight rows per call.
pub const ROWS: usize = 8;
/// Tokens per prefill call: each unpacked weight superblock serves 8 tokens
/// (measured on a Zen 3 core, one 8-row × 8-token Q4_K call runs ~1.4× the
/// multiply-adds per second of 8 × 4).
pub const TOKS: usize = 8;

/// A kernel: `(nb, 8 weight rows, N token rows) -> out[r][t]`.
pub type LanesFn<const N: usize> = fn(usize, &[&[u8]; ROWS], &[&[u8]; N]) -> [[f32; N]; ROWS];

/// Bytes of one superblock of `dtype`, for the formats this module runs.
pub(super) fn block_bytes(dtype: DType) -> usize {
    match dtype {
        DType::Q4K => Q4_K_BYTES,
        DType::Q5K => Q5_K_BYTES,
        DType::Q6K => Q6_K_BYTES,
        DType::Q3K => Q3_K_BYTES,
        DType::Q2K => Q2_K_BYTES,
        DType::IQ4XS => IQ4_XS_BYTES,
        other => panic!("qgemm_lanes: {other} is not a K-quant with lanes"),
    }
}

pub(super) fn check<const N: usize>(dtype: DType, nb: usize, w: &[&[u8]; ROWS], a: &[&[u8]; N]) {
    assert!(
        w.iter().all(|r| r.len() >= nb * block_bytes(dtype)),
        "{dtype} lanes: weight row too short"
    );
    assert!(
        a.iter().all(|r| r.len() >= nb * Q8_K_BYTES),
        "{dtype} lanes: activation row too short"
    );
}

/// Scalar model of one (row, token) dot product of `nb` superblocks of
/// `dtype` (Q4_K, Q5_K, Q6_K, Q3_K or Q2_K; see the module doc).
pub fn dot_scalar(dtype: DType, nb: usize, x: &[u8], y: &[u8]) -> f32 {
    let xb = block_bytes(dtype);
    assert!(x.len() >= nb * xb && y.len() >= nb * Q8_K_BYTES);
    let (mut acc, mut acc_m) = (0f32, 0f32);
    for b in 0..nb {
        let x = &x[b * xb..(b + 1) * xb];
        let y = &y[b * Q8_K_BYTES..(b + 1) * Q8_K_BYTES];
        let dy = f32::from_le_bytes([y[0], y[1], y[2], y[3]]);
        let f16_at = |i: usize| f16::from_bits(u16::from_le_bytes([x[i], x[i + 1]])).to_f32();
        let bsum = |j: usize| i16::from_le_bytes([y[260 + 2 * j], y[261 + 2 * j]]) as i32;
        // unsigned quants, the scale of each 16 weights, d and dmin
        // mins: the min of each 16 weights
        let (q, sc16, d, dmin, mins): ([i32; 256], [i32; 16], f32, f32, [i32; 16]) = match dtype {
            DType::Q4K | DType::Q5K => {
                let q = if dtype == DType::Q4K {
                    crate::quant::q4_k_values(&x[16..144])
                } else {
                    crate::quant::q5_k_values(&x[16..48], &x[48..176])
                };
                let (sc, mn) = crate::quant::k_scales_mins(&x[4..16]);
                (
                    std::array::from_fn(|i| q[i] as i32),
                    std::array::from_fn(|j| sc[j / 2] as i32),
                    f16_at(0),
                    f16_at(2),
                    std::array::from_fn(|j| mn[j / 2] as i32),
                )
            }
            DType::Q2K => {
                let q = crate::quant::q2_k_values(&x[16..80]);
                (
                    std::array::from_fn(|i| q[i] as i32),
                    std::array::from_fn(|j| (x[j] & 0x0f) as i32),
                    f16_at(80),
                    f16_at(82),
                    std::array::from_fn(|j| (x[j] >> 4) as i32),
                )
            }
            DType::IQ4XS => {
                let ls = crate::quant::iq4_xs_scales(x);
                (
                    std::array::from_fn(|i| {
                        let v = crate::quant::iq4_values(&x[8 + 16 * (i / 32)..24 + 16 * (i / 32)]);
                        v[i % 32] as i32 + 128
                    }),
                    std::array::from_fn(|j| ls[j / 2] as i32 - 32),
                    f16_at(0),
                    0.0,
                    [0; 16],
                )
            }
            DType::Q3K => {
                let q = crate::quant::q3_k_values(&x[0..32], &x[32..96]);
                let sc = crate::quant::q3_k_scales(&x[96..108]);
                (
                    std::array::from_fn(|i| q[i] as i32 + 4),
                    std::array::from_fn(|j| sc[j] as i32 - 32),
                    f16_at(108),
                    0.0,
                    [0; 16],
                )
            }
            _ => {
                let q = crate::quant::q6_k_values(&x[0..128], &x[128..192]);
                (
                    std::array::from_fn(|i| q[i] as i32 + 32),
                    std::array::from_fn(|j| x[192 + j] as i8 as i32),
                    f16_at(208),
                    0.0,
                    [0; 16],
                )
            }
        };
        let offset = match dtype {
            DType::Q6K => 32,
            DType::Q3K => 4,
            DType::IQ4XS => 128,
            _ => 0,
        };
        let mut isum = 0i32;
        for (j, s) in sc16.iter().enumerate() {
            let p: i32 = (16 * j..16 * j + 16)
                .map(|i| q[i] * y[4 + i] as i8 as i32)
                .sum();
            isum += s * p - offset * s * bsum(j);
        }
        let msum: i32 = (0..16).map(|j| mins[j] * bsum(j)).sum();
        acc = (dy * d).mul_add(isum as f32, acc);
        if offset == 0 {
            acc_m = (-dy * dmin).mul_add(msum as f32, acc_m);
        }
    }
    acc + acc_m
}

/// Scalar model of a whole call.
pub fn lanes_scalar<const N: usize>(
    dtype: DType,
    nb: usize,
    w: &[&[u8]; ROWS],
    a: &[&[u8]; N],
) -> [[f32; N]; ROWS] {
    check(dtype, nb, w, a);
    std::array::from_fn(|r| std::array::from_fn(|t| dot_scalar(dtype, nb, w[r], a[t])))
}

/// The kernel of `N` tokens for `dtype` (Q4_K, Q5_K, Q6_K, Q3_K, Q2_K) at SIMD level
/// `level` (AVX2 and above) where the CPU runs it, from this file: prefill
/// (with `vpdpbusd` at avx512vnni) and 256-bit decoding; `None` for other
/// types and levels. The engine's choice, which takes the 512-bit decoding
/// kernels of `qgemm_k_decode` at the AVX-512 levels, is
/// `matmul::k_quant_kernel`.
pub fn lanes_for<const N: usize>(dtype: DType, level: super::isa::Level) -> Option<LanesFn<N>> {
    use super::isa::{detected, Level};
    if level > detected() || level == Level::Portable {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    if level.vnni() {
        match dtype {
            DType::Q4K => return Some(lanes::<N, Q4k, true>),
            DType::Q5K => return Some(lanes::<N, Q5k, true>),
            DType::Q6K => return Some(lanes::<N, Q6k, true>),
            // Q3_K, Q2_K one token: row-major (the engine's decoding at
            // these levels is `qgemm_k_decode`'s 512-bit kernel)
            DType::Q3K if N == 1 => return Some(rows::<N, Q3k>),
            DType::Q3K => return Some(lanes::<N, Q3k, true>),
            DType::Q2K if N == 1 => return Some(rows::<N, Q2k>),
            DType::Q2K => return Some(lanes::<N, Q2k, true>),
            // IQ4_XS: every token count, decoding included
            DType::IQ4XS => return Some(lanes::<N, Iq4xs, true>),
            _ => return None,
        }
    }
    #[cfg(target_arch = "x86_64")]
    match dtype {
        DType::Q4K if N == 1 => return Some(rows::<N, Q4k>),
        DType::Q5K if N == 1 => return Some(rows::<N, Q5k>),
        DType::Q6K if N == 1 => return Some(rows::<N, Q6k>),
        DType::Q3K if N == 1 => return Some(rows::<N, Q3k>),
        DType::Q2K if N == 1 => return Some(rows::<N, Q2k>),
        DType::IQ4XS if N == 1 => return Some(rows_iq4xs::<N>),
        DType::Q4K => return Some(lanes::<N, Q4k, false>),
        DType::Q5K => return Some(lanes::<N, Q5k, false>),
        DType::Q6K => return Some(lanes::<N, Q6k, false>),
        DType::Q3K => return Some(lanes::<N, Q3k, false>),
        DType::Q2K => return Some(lanes::<N, Q2k, false>),
        DType::IQ4XS => return Some(lanes::<N, Iq4xs, false>),
        _ => {}
    }
    None
}

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::{__m128i, __m256, __m256i};

/// Up to 4 runs of 32 weights of 8 rows, 8 groups of 4 weights each (see
/// [`Format::unit`]).
#[cfg(target_arch = "x86_64")]
type Runs = [[__m256i; 8]; 4];

/// What the kernel needs of a format: where its quants, scales and offsets
/// are and how they combine (see the module doc).
#[cfg(target_arch = "x86_64")]
pub(super) trait Format {
    const DTYPE: DType;
    const BYTES: usize;
    /// Groups of 4 weights summed in i16 before the `madd` by the scale.
    const G: usize;
    /// Q4_K / Q5_K: a min per 32 weights with its own float scale (dmin);
    /// otherwise (Q6_K, Q3_K) a −2^OFFSET_SHIFT offset folded into the
    /// integer sum.
    const MINS: bool;
    /// Without mins: log2 of the offset that makes the quants unsigned
    /// (Q6_K: 32, Q3_K: 4).
    const OFFSET_SHIFT: i32 = 0;
    /// With mins: weights per min (Q4_K, Q5_K: 32; Q2_K: 16).
    const MIN_LEN: usize = 32;
    /// Quants that reach past 127 (IQ4_XS: up to 241), on which two
    /// `maddubs` products could saturate their i16 pair: the `maddubs`
    /// prefill kernels split each quant into its nibbles, u = 16·hi + lo,
    /// and add 16·scale·Σ hi·y + scale·Σ lo·y, the same integer
    /// ([`split_u`]; `G` then counts groups of nibbles). (Such a format
    /// has no [`Rows`]: IQ4_XS decodes at AVX2 by [`rows_iq4xs`].)
    const SPLIT: bool = false;

    /// d and dmin of the 8 rows (dmin unused without mins).
    ///
    /// # Safety
    /// AVX2 + F16C; every pointer is a whole superblock.
    unsafe fn heads<S: Src>(x: &S) -> (__m256, __m256);

    /// Byte offsets in a superblock that touch each of its cache lines,
    /// wherever it starts (at most 64 apart, the last byte included).
    const LINES: &'static [usize];
    /// Weights per scale (32 for Q4_K and Q5_K, 16 for Q6_K and Q3_K).
    const SCALE_LEN: usize;

    /// `sc[j]`: the scale of weights `SCALE_LEN`·j.. of the 8 rows as (i16,
    /// i16) pairs; `off[i]`: the offset factors that multiply the pair `i`
    /// of activation sums (mins: pairs of 32-sums (min[2i], min[2i+1]), i <
    /// 4; Q6_K: pairs of 16-sums (−32·sc16[2i], −32·sc16[2i+1]), i < 8).
    ///
    /// # Safety
    /// As [`Format::heads`].
    unsafe fn scales<S: Src>(x: &S) -> ([__m256i; 16], [__m256i; 8]);

    /// Units of runs unpacked together (the runs that share transposed
    /// chunks), and runs per unit (`UNITS · RUNS` = 8).
    const UNITS: usize;
    const RUNS: usize;

    /// What every unit of the superblock reads (Q5_K: its transposed fifth
    /// bits; Q3_K: its high bits); nothing (zeros) by default.
    ///
    /// # Safety
    /// As [`Format::heads`].
    #[inline(always)]
    unsafe fn begin<S: Src>(_: &S) -> [__m256i; 8] {
        // SAFETY: AVX2 (the trait's contract).
        unsafe { [std::arch::x86_64::_mm256_setzero_si256(); 8] }
    }

    /// The quants of unit `u`: `q[k][g]` = group `g` (weights 4g..4g+3) of
    /// the 32-weight run `RUNS·u + k` (k < RUNS), unsigned, row r in 32-bit
    /// lane r.
    ///
    /// # Safety
    /// As [`Format::heads`].
    unsafe fn unit<S: Src>(x: &S, u: usize, state: &[__m256i; 8]) -> Runs;
}

/// What the row-major AVX2 decoding kernel ([`rows`]) needs of a format
/// beyond [`Format`] (every K-quant; IQ4_XS decodes by its own kernel,
/// [`rows_iq4xs`]).
#[cfg(target_arch = "x86_64")]
pub(super) trait Rows: Format {
    /// One row's superblock, row-major (the decoding kernel, [`rows`]):
    /// its 8 runs of 32 unsigned quants in weight order; per run the i16
    /// multipliers of its 16 `maddubs` pairs (bytes 0..16 and 16..32: the
    /// scale of the run's weights there); and the 16 i16 factors of the
    /// activation's 16-value sums (mins: `min[j / 2]`; Q6_K: `sc16[j]`,
    /// multiplied by −32 by the kernel).
    ///
    /// # Safety
    /// AVX2; `x` is a whole superblock.
    unsafe fn row(x: *const u8) -> ([__m256i; 8], [__m256i; 8], __m256i);
}

/// Q4_K and Q5_K, row-major: the run scales (one per 32 weights) and the
/// mins, spread to the 16-value sums.
///
/// # Safety
/// AVX2; `x` is a whole Q4_K or Q5_K superblock.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn row_scales_mins(x: *const u8) -> ([__m256i; 8], __m256i) {
    use std::arch::x86_64::*;
    // SAFETY: x + 4 is the block's 12 scale bytes.
    let u = unsafe { unpack16(x.add(4)) };
    // SAFETY (intrinsics): AVX2, the caller's contract.
    unsafe {
        // the 8 scales as i16 in both 128-bit halves, then scale s spread
        // over all 16 i16 lanes by one byte shuffle
        let sc = _mm_cvtsi64_si128((u[0] as u64 | (u[1] as u64) << 32) as i64);
        let sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sc));
        let scv = std::array::from_fn(|s| {
            let pick = (((2 * s + 1) << 8) | (2 * s)) as i16;
            _mm256_shuffle_epi8(sc16, _mm256_set1_epi16(pick))
        });
        let mins = _mm_cvtsi64_si128((u[2] as u64 | (u[3] as u64) << 32) as i64);
        (scv, _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mins, mins)))
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) struct Q4k;
#[cfg(target_arch = "x86_64")]
pub(super) struct Q5k;
#[cfg(target_arch = "x86_64")]
pub(super) struct Q6k;
#[cfg(target_arch = "x86_64")]
pub(super) struct Q3k;
#[cfg(target_arch = "x86_64")]
pub(super) struct Q2k;
#[cfg(target_arch = "x86_64")]
pub(super) struct Iq4xs;

/// Where a kernel reads the superblocks of its 8 rows from: GGUF's rows
/// (`[*const u8; ROWS]`, one pointer per row's superblock) or a repacked
/// group ([`X8Group`]). [`Format`]'s methods read through this alone, so
/// packing a micro tile ([`pack_rows`], [`pack_x8`]) gives the same bytes
/// from either.
#[cfg(target_arch = "x86_64")]
pub(super) trait Src {
    /// Row `r`'s `N` bytes at byte `off` of its superblock (`off` and `N`
    /// even).
    ///
    /// # Safety
    /// Bytes `off..off + N` lie in the superblock.
    unsafe fn bytes<const N: usize>(&self, r: usize, off: usize) -> [u8; N];

    /// The 32-byte chunk at byte `off` of the 8 rows' superblocks,
    /// transposed: dword g of lane r = bytes 4g..4g+3 of row r's chunk.
    ///
    /// # Safety
    /// AVX2; bytes `off..off + 32` lie in the superblock.
    unsafe fn chunk(&self, off: usize) -> [__m256i; 8];

    /// The rows' f16 at byte `off` of their superblocks, as 8 float lanes.
    ///
    /// # Safety
    /// AVX2 + F16C; bytes `off..off + 2` lie in the superblock.
    #[inline(always)]
    unsafe fn f16_lanes(&self, off: usize) -> __m256 {
        use std::arch::x86_64::*;
        // SAFETY: the caller's contract.
        let h: [i16; ROWS] =
            std::array::from_fn(|r| i16::from_le_bytes(unsafe { self.bytes::<2>(r, off) }));
        // SAFETY: h holds 8 i16.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(h.as_ptr().cast())) }
    }
}

/// GGUF's layout: row `r`'s superblock at `self[r]`.
#[cfg(target_arch = "x86_64")]
impl Src for [*const u8; ROWS] {
    #[inline(always)]
    unsafe fn bytes<const N: usize>(&self, r: usize, off: usize) -> [u8; N] {
        // SAFETY: the caller's contract.
        unsafe { self[r].add(off).cast::<[u8; N]>().read_unaligned() }
    }

    #[inline(always)]
    unsafe fn chunk(&self, off: usize) -> [__m256i; 8] {
        use std::arch::x86_64::*;
        // SAFETY: the caller's contract.
        transpose8(std::array::from_fn(|r| unsafe {
            _mm256_loadu_si256(self[r].add(off).cast())
        }))
    }
}

/// Where a repacked layout (`x8::X8`) keeps each row's superblock bytes
/// in a group: `at[r][i]` is the group offset of bytes 2i, 2i + 1 of row
/// r's superblock, and `chunks[i]` the `(start, stride)` of the 32-byte
/// chunk at superblock byte 2i where the layout stores it as four 64-byte
/// loads `start + stride·h` (byte 8r + j = the chunk's byte 8h + j of row
/// r), 0 stride where it does not. Built by `x8::group_map` from the
/// layout's own copy list, and checked there, so every offset lies in the
/// group.
#[derive(Clone, Debug)]
pub struct GroupMap {
    dtype: DType,
    at: [[u16; MAP_LEN]; ROWS],
    chunks: [(u16, u16); MAP_LEN],
    /// A cover of the superblock for [`GroupMap::unpack`]: `(offset,
    /// chunk)`, a 32-byte chunk where the layout has one there, a byte
    /// pair otherwise.
    cover: Vec<(u16, bool)>,
}

/// Entries of a [`GroupMap`] row: 2-byte steps over the largest
/// superblock (Q6_K: 210 bytes).
const MAP_LEN: usize = 128;

impl GroupMap {
    /// The map of a `dtype` group whose row `r`'s superblock byte `b` lies
    /// at `at(r, b)`: panics unless every byte of every row maps into the
    /// group (`8 ×` the superblock), one to one, in even-aligned pairs.
    pub fn new(dtype: DType, at: impl Fn(usize, usize) -> usize) -> GroupMap {
        let sb = block_bytes(dtype);
        let gb = ROWS * sb;
        assert!(sb <= 2 * MAP_LEN && sb.is_multiple_of(2));
        let mut seen = vec![false; gb];
        let mut map = [[0u16; MAP_LEN]; ROWS];
        for (r, row) in map.iter_mut().enumerate() {
            for b in 0..sb {
                let g = at(r, b);
                assert!(g < gb && !seen[g], "{dtype} group map: byte {b} of row {r}");
                seen[g] = true;
                if b % 2 == 0 {
                    row[b / 2] = g as u16;
                } else {
                    assert_eq!(g, row[b / 2] as usize + 1, "{dtype} group map: pair {b}");
                }
            }
        }
        // the chunks stored as four 64-byte loads of 8 bytes per row
        let mut chunks = [(0u16, 0u16); MAP_LEN];
        for off in (0..sb.saturating_sub(31)).step_by(2) {
            let start = map[0][off / 2] as usize;
            let stride = (map[0][(off + 8) / 2] as usize).wrapping_sub(start);
            let fits = (0..4).all(|h| {
                (0..ROWS).all(|r| {
                    (0..8).all(|j| at(r, off + 8 * h + j) == start + stride * h + 8 * r + j)
                })
            });
            if fits && stride > 0 {
                chunks[off / 2] = (start as u16, stride as u16);
            }
        }
        let mut cover = Vec::new();
        let mut off = 0;
        while off < sb {
            let chunk = off + 32 <= sb && chunks[off / 2].1 > 0;
            cover.push((off as u16, chunk));
            off += if chunk { 32 } else { 2 };
        }
        GroupMap {
            dtype,
            at: map,
            chunks,
            cover,
        }
    }

    /// Writes group `g`'s 8 superblocks as GGUF stores them, row r's at
    /// `out[r]`: each chunk from its four 64-byte loads by a 4 × 8 qword
    /// transpose per half of the rows, every other byte pair on its own.
    ///
    /// # Safety
    /// AVX2; `g` holds a whole group of this map's type and each `out[r]`
    /// a superblock's bytes, apart from `g` and from each other.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    pub unsafe fn unpack(&self, g: *const u8, out: [*mut u8; ROWS]) {
        use std::arch::x86_64::*;
        // SAFETY (every access): the map's offsets lie in the group
        // (GroupMap::new checked every byte), the cover's in a superblock;
        // the contract.
        unsafe {
            for &(off, chunk) in &self.cover {
                let off = off as usize;
                if !chunk {
                    let src = X8Group { g, map: self };
                    for (r, o) in out.iter().enumerate() {
                        o.add(off)
                            .cast::<[u8; 2]>()
                            .write_unaligned(src.bytes::<2>(r, off));
                    }
                    continue;
                }
                let (start, stride) = self.chunks[off / 2];
                let (start, stride) = (start as usize, stride as usize);
                // load h, half k: qword j = bytes 8h..8h + 8 of row 4k + j
                for k in 0..2 {
                    let q: [__m256i; 4] = std::array::from_fn(|h| {
                        _mm256_loadu_si256(g.add(start + stride * h + 32 * k).cast())
                    });
                    let t0 = _mm256_unpacklo_epi64(q[0], q[1]);
                    let t1 = _mm256_unpackhi_epi64(q[0], q[1]);
                    let t2 = _mm256_unpacklo_epi64(q[2], q[3]);
                    let t3 = _mm256_unpackhi_epi64(q[2], q[3]);
                    let rows = [
                        _mm256_permute2x128_si256::<0x20>(t0, t2),
                        _mm256_permute2x128_si256::<0x20>(t1, t3),
                        _mm256_permute2x128_si256::<0x31>(t0, t2),
                        _mm256_permute2x128_si256::<0x31>(t1, t3),
                    ];
                    for (j, v) in rows.into_iter().enumerate() {
                        _mm256_storeu_si256(out[4 * k + j].add(off).cast(), v);
                    }
                }
            }
        }
    }
}

/// One repacked group (8 rows × one superblock) read through its
/// [`GroupMap`].
#[cfg(target_arch = "x86_64")]
struct X8Group<'a> {
    g: *const u8,
    map: &'a GroupMap,
}

#[cfg(target_arch = "x86_64")]
impl Src for X8Group<'_> {
    #[inline(always)]
    unsafe fn bytes<const N: usize>(&self, r: usize, off: usize) -> [u8; N] {
        let mut out = [0u8; N];
        for i in (0..N).step_by(2) {
            let at = self.map.at[r][(off + i) / 2] as usize;
            // SAFETY: `g` is a whole group and the map's offsets lie in it
            // (GroupMap::new); `out` holds i + 2 bytes.
            unsafe { std::ptr::copy_nonoverlapping(self.g.add(at), out.as_mut_ptr().add(i), 2) };
        }
        out
    }

    #[inline(always)]
    unsafe fn chunk(&self, off: usize) -> [__m256i; 8] {
        use std::arch::x86_64::*;
        let (start, stride) = self.map.chunks[off / 2];
        assert!(stride > 0, "{}: no chunk at {off}", self.map.dtype);
        let (start, stride) = (start as usize, stride as usize);
        // SAFETY (intrinsics): AVX2, the caller's contract; the four loads
        // lie in the group (GroupMap::new checked every byte).
        unsafe {
            // dwords 0, 2, 4, 6 then 1, 3, 5, 7: bytes 0..4 of rows 0..3 of a
            // half, then bytes 4..8
            let split = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
            let mut t = [_mm256_setzero_si256(); 8];
            for h in 0..4 {
                let p = self.g.add(start + stride * h);
                let lo = _mm256_permutevar8x32_epi32(_mm256_loadu_si256(p.cast()), split);
                let hi = _mm256_permutevar8x32_epi32(_mm256_loadu_si256(p.add(32).cast()), split);
                t[2 * h] = _mm256_permute2x128_si256::<0x20>(lo, hi);
                t[2 * h + 1] = _mm256_permute2x128_si256::<0x31>(lo, hi);
            }
            t
        }
    }
}

/// Q4_K and Q5_K: 6-bit scales and mins packed in 12 bytes at byte 4.
///
/// # Safety
/// As [`Format::scales`].
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn scales_mins<S: Src>(x: &S) -> ([__m256i; 16], [__m256i; 8]) {
    use std::arch::x86_64::*;
    // per row the 8 scales and 8 mins (bytes), transposed to per sub-block
    // × 8 rows
    let mut scb = [0u64; ROWS];
    let mut mnb = [0u64; ROWS];
    for r in 0..ROWS {
        // SAFETY: bytes 4..16 are the block's 12 scale bytes.
        let u = unpack16_bytes(unsafe { x.bytes::<12>(r, 4) });
        scb[r] = u[0] as u64 | (u[1] as u64) << 32;
        mnb[r] = u[2] as u64 | (u[3] as u64) << 32;
    }
    let sct = transpose8x8_bytes(scb);
    let mnt = transpose8x8_bytes(mnb);
    // SAFETY (intrinsics): AVX2, the caller's contract.
    unsafe {
        // the scale of sub-block s for the 8 rows as (i16, i16) pairs
        let mut sc = [_mm256_setzero_si256(); 16];
        for (s, sc) in sc.iter_mut().take(8).enumerate() {
            let v = if s % 2 == 0 {
                sct[s / 2]
            } else {
                _mm_srli_si128(sct[s / 2], 8)
            };
            let v = _mm256_cvtepu8_epi32(v);
            *sc = _mm256_or_si256(v, _mm256_slli_epi32(v, 16));
        }
        // mins of sub-blocks (2i, 2i + 1) for the 8 rows as i16 pairs
        let off = std::array::from_fn(|i| {
            if i < 4 {
                _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mnt[i], _mm_srli_si128(mnt[i], 8)))
            } else {
                _mm256_setzero_si256()
            }
        });
        (sc, off)
    }
}

#[cfg(target_arch = "x86_64")]
impl Format for Q4k {
    const LINES: &'static [usize] = &[0, 64, 128, Q4_K_BYTES - 1];
    const SCALE_LEN: usize = 32;
    const DTYPE: DType = DType::Q4K;
    const BYTES: usize = Q4_K_BYTES;
    // 8·2·15·128 = 30720
    const G: usize = 8;
    const MINS: bool = true;

    #[inline(always)]
    unsafe fn heads<S: Src>(x: &S) -> (__m256, __m256) {
        // SAFETY: the trait's contract; d at byte 0, dmin at 2.
        unsafe { (x.f16_lanes(0), x.f16_lanes(2)) }
    }

    #[inline(always)]
    unsafe fn scales<S: Src>(x: &S) -> ([__m256i; 16], [__m256i; 8]) {
        // SAFETY: the trait's contract.
        unsafe { scales_mins(x) }
    }

    const UNITS: usize = 4;
    const RUNS: usize = 2;

    #[inline(always)]
    unsafe fn unit<S: Src>(x: &S, c: usize, _: &[__m256i; 8]) -> Runs {
        use std::arch::x86_64::*;
        // SAFETY (intrinsics): the trait's contract; the 128 quant bytes
        // are at 16..144: chunk c holds run 2c in its low nibbles and run
        // 2c + 1 in its high nibbles.
        unsafe {
            let low = _mm256_set1_epi8(0x0f);
            let t = x.chunk(16 + 32 * c);
            let mut q = [[_mm256_setzero_si256(); 8]; 4];
            for g in 0..8 {
                q[0][g] = _mm256_and_si256(t[g], low);
                q[1][g] = _mm256_and_si256(_mm256_srli_epi16(t[g], 4), low);
            }
            q
        }
    }
}

#[cfg(target_arch = "x86_64")]
impl Rows for Q4k {
    #[inline(always)]
    unsafe fn row(x: *const u8) -> ([__m256i; 8], [__m256i; 8], __m256i) {
        use std::arch::x86_64::*;
        // SAFETY (intrinsics, loads): the trait's contract; the 128 quant
        // bytes at 16..144, chunk c: run 2c in the low nibbles, 2c + 1 high.
        unsafe {
            let low = _mm256_set1_epi8(0x0f);
            let mut q = [_mm256_setzero_si256(); 8];
            for c in 0..4 {
                let v = _mm256_loadu_si256(x.add(16 + 32 * c).cast());
                q[2 * c] = _mm256_and_si256(v, low);
                q[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            }
            let (scv, mins) = row_scales_mins(x);
            (q, scv, mins)
        }
    }
}

#[cfg(target_arch = "x86_64")]
impl Format for Q5k {
    const LINES: &'static [usize] = &[0, 64, 128, Q5_K_BYTES - 1];
    const SCALE_LEN: usize = 32;
    const DTYPE: DType = DType::Q5K;
    const BYTES: usize = Q5_K_BYTES;
    // 4·2·31·128 = 31744
    const G: usize = 4;
    const MINS: bool = true;

    #[inline(always)]
    unsafe fn heads<S: Src>(x: &S) -> (__m256, __m256) {
        // SAFETY: the trait's contract; d at byte 0, dmin at 2.
        unsafe { (x.f16_lanes(0), x.f16_lanes(2)) }
    }

    #[inline(always)]
    unsafe fn scales<S: Src>(x: &S) -> ([__m256i; 16], [__m256i; 8]) {
        // SAFETY: the trait's contract.
        unsafe { scales_mins(x) }
    }

    const UNITS: usize = 4;
    const RUNS: usize = 2;

    #[inline(always)]
    unsafe fn begin<S: Src>(x: &S) -> [__m256i; 8] {
        // SAFETY: the trait's contract; the fifth bits are at 16..48.
        unsafe { x.chunk(16) }
    }

    #[inline(always)]
    unsafe fn unit<S: Src>(x: &S, c: usize, h: &[__m256i; 8]) -> Runs {
        use std::arch::x86_64::*;
        // SAFETY (intrinsics): the trait's contract; the low nibbles are
        // laid out as Q4_K's at 48..176, the fifth bit of run s is bit s of
        // the 32 bytes at 16..48 (`h`): bits 2c and 2c + 1 move to bit 4
        // (16-bit shifts by at most 4 that keep bit 4 of each byte in the
        // byte).
        unsafe {
            let (low, bit4) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi8(0x10));
            let t = x.chunk(48 + 32 * c);
            let at4 = |v: __m256i, bit: i32| {
                let v = if bit < 4 {
                    _mm256_sll_epi16(v, _mm_cvtsi32_si128(4 - bit))
                } else {
                    _mm256_srl_epi16(v, _mm_cvtsi32_si128(bit - 4))
                };
                _mm256_and_si256(v, bit4)
            };
            let mut q = [[_mm256_setzero_si256(); 8]; 4];
            for g in 0..8 {
                let bit = 2 * c as i32;
                q[0][g] = _mm256_or_si256(_mm256_and_si256(t[g], low), at4(h[g], bit));
                q[1][g] = _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16(t[g], 4), low),
                    at4(h[g], bit + 1),
                );
            }
            q
        }
    }
}

#[cfg(target_arch = "x86_64")]
impl Rows for Q5k {
    #[inline(always)]
    unsafe fn row(x: *const u8) -> ([__m256i; 8], [__m256i; 8], __m256i) {
        use std::arch::x86_64::*;
        // SAFETY (intrinsics, loads): the trait's contract; low nibbles as
        // Q4_K's at 48..176, the fifth bit of run s is bit s of the 32
        // bytes at 16..48 (moved to bit 4 by 16-bit shifts that keep it in
        // its byte).
        unsafe {
            let low = _mm256_set1_epi8(0x0f);
            let h = _mm256_loadu_si256(x.add(16).cast());
            let fifth = |s: i32| {
                let v = _mm256_and_si256(h, _mm256_set1_epi8(1 << s));
                if s < 4 {
                    _mm256_sll_epi16(v, _mm_cvtsi32_si128(4 - s))
                } else {
                    _mm256_srl_epi16(v, _mm_cvtsi32_si128(s - 4))
                }
            };
            let mut q = [_mm256_setzero_si256(); 8];
            for c in 0..4 {
                let v = _mm256_loadu_si256(x.add(48 + 32 * c).cast());
                let s = 2 * c as i32;
                q[2 * c] = _mm256_or_si256(_mm256_and_si256(v, low), fifth(s));
                q[2 * c + 1] =
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low), fifth(s + 1));
            }
            let (scv, mins) = row_scales_mins(x);
            (q, scv, mins)
        }
    }
}

#[cfg(target_arch = "x86_64")]
impl Format for Q6k {
    const LINES: &'static [usize] = &[0, 64, 128, 192, Q6_K_BYTES - 1];
    const SCALE_LEN: usize = 16;
    const DTYPE: DType = DType::Q6K;
    const BYTES: usize = Q6_K_BYTES;
    // 2·2·63·128 = 32256
    const G: usize = 2;
    const MINS: bool = false;
    const OFFSET_SHIFT: i32 = 5;

    #[inline(always)]
    unsafe fn heads<S: Src>(x: &S) -> (__m256, __m256) {
        // SAFETY: the trait's contract; d is the last 2 bytes.
        unsafe {
            let d = x.f16_lanes(208);
            (d, d)
        }
    }

    #[inline(always)]
    unsafe fn scales<S: Src>(x: &S) -> ([__m256i; 16], [__m256i; 8]) {
        // 16 signed scales per row at 192..208, transposed (8 × 8 bytes
        // twice): st[h][k] holds scales 8h + 2k, 8h + 2k + 1 of the 8 rows
        let half = |h: usize| {
            // SAFETY: bytes 192 + 8h.. + 8 lie in the superblock.
            transpose8x8_bytes(std::array::from_fn(|r| {
                u64::from_le_bytes(unsafe { x.bytes::<8>(r, 192 + 8 * h) })
            }))
        };
        // SAFETY: AVX2, the trait's contract.
        unsafe { signed_scales16([half(0), half(1)], -32) }
    }

    const UNITS: usize = 2;
    const RUNS: usize = 4;

    #[inline(always)]
    unsafe fn unit<S: Src>(x: &S, n: usize, _: &[__m256i; 8]) -> Runs {
        use std::arch::x86_64::*;
        // SAFETY (intrinsics): the trait's contract. Half n of the block
        // (runs 4n..4n+3) takes low-bit chunks a = ql[64n..], b = ql[64n +
        // 32..] and high-bit chunk h = qh[32n..] (qh at 128): run 4n + k is
        // the low (k < 2) or high nibble of a (k even) or b, with bits 2k,
        // 2k + 1 of h as bits 4-5.
        unsafe {
            let (low, two) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi8(0x30));
            let a = x.chunk(64 * n);
            let b = x.chunk(64 * n + 32);
            let h = x.chunk(128 + 32 * n);
            let mut q = [[_mm256_setzero_si256(); 8]; 4];
            for g in 0..8 {
                let hi = |v: __m256i| _mm256_and_si256(v, two);
                q[0][g] =
                    _mm256_or_si256(_mm256_and_si256(a[g], low), hi(_mm256_slli_epi16(h[g], 4)));
                q[1][g] =
                    _mm256_or_si256(_mm256_and_si256(b[g], low), hi(_mm256_slli_epi16(h[g], 2)));
                q[2][g] =
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a[g], 4), low), hi(h[g]));
                q[3][g] = _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16(b[g], 4), low),
                    hi(_mm256_srli_epi16(h[g], 2)),
                );
            }
            q
        }
    }
}

#[cfg(target_arch = "x86_64")]
impl Rows for Q6k {
    #[inline(always)]
    unsafe fn row(x: *const u8) -> ([__m256i; 8], [__m256i; 8], __m256i) {
        use std::arch::x86_64::*;
        // SAFETY (intrinsics, loads): the trait's contract. Half n (runs
        // 4n..4n+3): low-bit chunks a = ql[64n..], b = ql[64n + 32..], high
        // bits h = qh[32n..] (qh at 128); run 4n + k is the low (k < 2) or
        // high nibble of a (k even) or b, with bits 2k, 2k + 1 of h as bits
        // 4-5. Scales: 16 i8 at 192, two per run.
        unsafe {
            let (low, two) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi8(0x30));
            let mut q = [_mm256_setzero_si256(); 8];
            for n in 0..2 {
                let a = _mm256_loadu_si256(x.add(64 * n).cast());
                let b = _mm256_loadu_si256(x.add(64 * n + 32).cast());
                let h = _mm256_loadu_si256(x.add(128 + 32 * n).cast());
                let hi = |v: __m256i| _mm256_and_si256(v, two);
                q[4 * n] = _mm256_or_si256(_mm256_and_si256(a, low), hi(_mm256_slli_epi16(h, 4)));
                q[4 * n + 1] =
                    _mm256_or_si256(_mm256_and_si256(b, low), hi(_mm256_slli_epi16(h, 2)));
                q[4 * n + 2] =
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), low), hi(h));
                q[4 * n + 3] = _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16(b, 4), low),
                    hi(_mm256_srli_epi16(h, 2)),
                );
            }
            let sc8 = _mm_loadu_si128(x.add(192).cast());
            let scv = run_scales16(sc8);
            (q, scv, _mm256_cvtepi8_epi16(sc8))
        }
    }
}

/// The 16 signed scales of 8 rows (one per 16 weights; Q6_K, Q3_K) in the
/// kernels' forms, from their transposed bytes: `st[h][k]` holds scales
/// 8h + 2k (bytes 0..8) and 8h + 2k + 1 (bytes 8..16) of rows 0..8. Returns
/// the (i16, i16) scale pairs per scale and the offset factors
/// `offset·scale` per pair of 16-value sums (see [`Format::scales`]).
///
/// # Safety
/// AVX2.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn signed_scales16(st: [[__m128i; 4]; 2], offset: i16) -> ([__m256i; 16], [__m256i; 8]) {
    use std::arch::x86_64::*;
    // SAFETY (intrinsics): AVX2, the caller's contract; registers only.
    unsafe {
        let sc = std::array::from_fn(|j| {
            let v = st[j / 8][(j % 8) / 2];
            let v = if j % 2 == 0 { v } else { _mm_srli_si128(v, 8) };
            let v = _mm256_cvtepi8_epi32(v);
            _mm256_or_si256(
                _mm256_and_si256(v, _mm256_set1_epi32(0xffff)),
                _mm256_slli_epi32(v, 16),
            )
        });
        let off = std::array::from_fn(|i| {
            let v = st[i / 4][i % 4];
            let pairs = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(v, _mm_srli_si128(v, 8)));
            _mm256_mullo_epi16(pairs, _mm256_set1_epi16(offset))
        });
        (sc, off)
    }
}

/// A Q3_K superblock's 12 scale bytes as its 16 unsigned 6-bit scales, 8
/// per word (byte k of word h: scale 8h + k; `crate::quant::q3_k_scales`
/// before the −32).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) fn q3_scale_words(b: [u8; 12]) -> [u64; 2] {
    let lo = u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]);
    let w = u32::from_le_bytes([b[8], b[9], b[10], b[11]]);
    // the top two bits: scales 0..4 from bits 0-1 of bytes 8..12, 4..8
    // from bits 2-3, 8..12 from bits 4-5, 12..16 from bits 6-7
    let top = |s: u32| ((w >> s) & 0x0303_0303) as u64;
    let nib = 0x0f0f_0f0f_0f0f_0f0fu64;
    [
        (lo & nib) | (top(0) | top(2) << 32) << 4,
        ((lo >> 4) & nib) | (top(4) | top(6) << 32) << 4,
    ]
}

/// The four 2-bit fields of every byte of `a`: field k (bits 2k, 2k + 1)
/// in the low bits of each byte of output k (Q2_K's quants, Q3_K's low
/// bits). 16-bit shifts: the bits that cross a byte are masked off.
///
/// # Safety
/// AVX2.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn two_bit_fields(a: __m256i) -> [__m256i; 4] {
    use std::arch::x86_64::*;
    // SAFETY (intrinsics): AVX2, the caller's contract; registers only.
    unsafe {
        let three = _mm256_set1_epi8(3);
        [
            _mm256_and_si256(a, three),
            _mm256_and_si256(_mm256_srli_epi16::<2>(a), three),
            _mm256_and_si256(_mm256_srli_epi16::<4>(a), three),
            _mm256_and_si256(_mm256_srli_epi16::<6>(a), three),
        ]
    }
}

/// One row's 16 signed scales (one per 16 weights, `sc8`) as the row-major
/// kernels' per-run multipliers: run s's i16 lanes 0..8 take scale 2s, lanes
/// 8..16 scale 2s + 1 (see [`Format::row`]).
///
/// # Safety
/// AVX2.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn run_scales16(sc8: __m128i) -> [__m256i; 8] {
    use std::arch::x86_64::*;
    std::array::from_fn(|s| {
        let (lo, hi) = (2 * s as i8, 2 * s as i8 + 1);
        // SAFETY (intrinsics): AVX2, the caller's contract; registers only.
        unsafe {
            let pick = _mm_set_epi8(
                hi, hi, hi, hi, hi, hi, hi, hi, lo, lo, lo, lo, lo, lo, lo, lo,
            );
            _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc8, pick))
        }
    })
}

/// Bit `s` (0..8) of every byte of `h` moved to bit 2 (the rest zero): the
/// third bit of a Q3_K quant from its `hmask` byte.
///
/// # Safety
/// AVX2.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn q3_high(h: __m256i, s: usize) -> __m256i {
    use std::arch::x86_64::*;
    // SAFETY (intrinsics): AVX2, the caller's contract. 16-bit shifts: the
    // bits that cross into a neighbouring byte never land on bit 2.
    unsafe {
        let v = if s >= 2 {
            _mm256_srl_epi16(h, _mm_cvtsi32_si128(s as i32 - 2))
        } else {
            _mm256_sll_epi16(h, _mm_cvtsi32_si128(2 - s as i32))
        };
        _mm256_and_si256(v, _mm256_set1_epi8(4))
    }
}

/// The IQ4 grid ([`crate::quant::IQ4_VALUES`], IQ4_XS's and IQ4_NL's) as
/// the 16 bytes a `vpshufb` looks 4-bit indices up in: the signed values,
/// or (`unsigned`) the values + 128 (1..241), the unsigned quants the
/// `vpdpbusd` and nibble-split kernels take.
#[cfg(target_arch = "x86_64")]
pub(super) fn iq4_grid_bytes(unsigned: bool) -> [u8; 16] {
    let o = if unsigned { 128 } else { 0 };
    crate::quant::IQ4_VALUES.map(|v| (v as u8).wrapping_add(o))
}

/// [`iq4_grid_bytes`] in both 128-bit lanes (a `vpshufb` table).
///
/// # Safety
/// AVX2.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn iq4_grid(unsigned: bool) -> __m256i {
    use std::arch::x86_64::*;
    let t = iq4_grid_bytes(unsigned);
    // SAFETY: AVX2 (the caller's contract); `t` holds 16 bytes.
    unsafe { _mm256_broadcastsi128_si256(_mm_loadu_si128(t.as_ptr().cast())) }
}

/// IQ4_XS's 8 six-bit scales of one superblock (`ls`, 0..64) as bytes:
/// `[once, twice]`: scale k at byte k of `once` (bytes 8.. zero), and at
/// bytes 2k, 2k + 1 of `twice` (one per 16 weights).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn iq4_scale_words(b: [u8; 8]) -> [[u64; 2]; 2] {
    let ls = iq4_scale_bytes(b).to_le_bytes();
    let once = u64::from_le_bytes(ls);
    let twice = |h: usize| u64::from_le_bytes(std::array::from_fn(|i| ls[4 * h + i / 2]));
    [[once, 0], [twice(0), twice(1)]]
}

/// IQ4_XS: a 4-bit index per weight into a signed grid (−127..113), a
/// 6-bit scale `ls − 32` per 32 weights, `d`, no mins. The grid value + 128
/// (1..241) is the unsigned quant, and −128·scale goes against the 16-value
/// sums (folded into the integer sum, as Q6_K's −32). A `maddubs` of two
/// such quants against activations can reach 2·241·128 and saturate, so
/// the `maddubs` kernels (AVX2) take each quant as its two nibbles
/// ([`Format::SPLIT`]: two `maddubs` per group, each pair within
/// 2·15·128, 8 groups summed in i16), while `vpdpbusd` (VNNI) takes it
/// whole; both give the same exact integers.
#[cfg(target_arch = "x86_64")]
impl Format for Iq4xs {
    const LINES: &'static [usize] = &[0, 64, 128, IQ4_XS_BYTES - 1];
    const SCALE_LEN: usize = 32;
    const DTYPE: DType = DType::IQ4XS;
    const BYTES: usize = IQ4_XS_BYTES;
    // nibbles (0..16): 8 groups' pairs within 8·2·15·128 < 2^15
    const G: usize = 8;
    const MINS: bool = false;
    const OFFSET_SHIFT: i32 = 7;
    const SPLIT: bool = true;

    #[inline(always)]
    unsafe fn heads<S: Src>(x: &S) -> (__m256, __m256) {
        // SAFETY: the trait's contract; d is the first 2 bytes.
        unsafe {
            let d = x.f16_lanes(0);
            (d, d)
        }
    }

    #[inline(always)]
    unsafe fn scales<S: Src>(x: &S) -> ([__m256i; 16], [__m256i; 8]) {
        use std::arch::x86_64::*;
        // SAFETY: bytes 0..8 (d and the scales) lie in the superblock.
        let words: [[[u64; 2]; 2]; ROWS] =
            std::array::from_fn(|r| iq4_scale_words(unsafe { x.bytes::<8>(r, 0) }));
        // SAFETY (intrinsics): AVX2, the trait's contract.
        unsafe {
            let st = |w: usize| {
                let half = |h: usize| {
                    let t = transpose8x8_bytes(std::array::from_fn(|r| words[r][w][h]));
                    t.map(|v| _mm_sub_epi8(v, _mm_set1_epi8(32)))
                };
                [half(0), half(1)]
            };
            // one scale per 32 weights (sc[0..8]); −128·scale per 16-value sum
            (signed_scales16(st(0), 1).0, signed_scales16(st(1), -128).1)
        }
    }

    // unit c: the 32-byte chunk at 8 + 32c, sub-blocks 2c and 2c + 1
    const UNITS: usize = 4;
    const RUNS: usize = 2;

    #[inline(always)]
    unsafe fn unit<S: Src>(x: &S, c: usize, _: &[__m256i; 8]) -> Runs {
        use std::arch::x86_64::*;
        // SAFETY (intrinsics): the trait's contract. Chunk groups 0..4 are
        // sub-block 2c's 16 bytes, 4..8 sub-block 2c + 1's; a sub-block's
        // weights 0..16 are its bytes' low nibbles, 16..32 the high ones.
        unsafe {
            let (table, nib) = (iq4_grid(true), _mm256_set1_epi8(0x0f));
            let a = x.chunk(8 + 32 * c);
            let lo = |v: __m256i| _mm256_shuffle_epi8(table, _mm256_and_si256(v, nib));
            let hi = |v: __m256i| {
                _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16::<4>(v), nib))
            };
            let mut q = [[_mm256_setzero_si256(); 8]; 4];
            for g in 0..4 {
                q[0][g] = lo(a[g]);
                q[0][g + 4] = hi(a[g]);
                q[1][g] = lo(a[g + 4]);
                q[1][g + 4] = hi(a[g + 4]);
            }
            q
        }
    }
}

/// Q2_K: quants 0..4, an unsigned 4-bit scale and min per 16 weights
/// (`scales[j]`: scale in the low nibble, min in the high one), `d` and
/// `dmin`: Q4_K's arithmetic with the mins against 16-value sums.
#[cfg(target_arch = "x86_64")]
impl Format for Q2k {
    const LINES: &'static [usize] = &[0, 64, Q2_K_BYTES - 1];
    const SCALE_LEN: usize = 16;
    const DTYPE: DType = DType::Q2K;
    const BYTES: usize = Q2_K_BYTES;
    // one scale's 4 groups: 4·2·3·128 = 3072
    const G: usize = 4;
    const MINS: bool = true;
    const MIN_LEN: usize = 16;

    #[inline(always)]
    unsafe fn heads<S: Src>(x: &S) -> (__m256, __m256) {
        // SAFETY: the trait's contract; d, dmin are the last 4 bytes.
        unsafe { (x.f16_lanes(80), x.f16_lanes(82)) }
    }

    #[inline(always)]
    unsafe fn scales<S: Src>(x: &S) -> ([__m256i; 16], [__m256i; 8]) {
        use std::arch::x86_64::*;
        // SAFETY (intrinsics, bytes 0..16 of the superblock): AVX2, the
        // trait's contract. The 16 scale bytes of the 8 rows transposed,
        // then split into scales (low nibbles) and mins (high ones).
        unsafe {
            let nib = _mm_set1_epi8(0x0f);
            let half = |h: usize| {
                transpose8x8_bytes(std::array::from_fn(|r| {
                    u64::from_le_bytes(x.bytes::<8>(r, 8 * h))
                }))
            };
            let st = [half(0), half(1)];
            let sc = st.map(|h| h.map(|v| _mm_and_si128(v, nib)));
            let mn = st.map(|h| h.map(|v| _mm_and_si128(_mm_srli_epi16(v, 4), nib)));
            (signed_scales16(sc, 1).0, signed_scales16(mn, 1).1)
        }
    }

    const UNITS: usize = 2;
    const RUNS: usize = 4;

    #[inline(always)]
    unsafe fn unit<S: Src>(x: &S, n: usize, _: &[__m256i; 8]) -> Runs {
        use std::arch::x86_64::*;
        // SAFETY (intrinsics): the trait's contract. Half n (runs
        // 4n..4n+3) takes chunk a = qs[32n..] (qs at 16): run 4n + k is
        // bits 2k, 2k + 1 of a.
        unsafe {
            let a = x.chunk(16 + 32 * n);
            let mut q = [[_mm256_setzero_si256(); 8]; 4];
            for g in 0..8 {
                for (k, f) in two_bit_fields(a[g]).into_iter().enumerate() {
                    q[k][g] = f;
                }
            }
            q
        }
    }
}

#[cfg(target_arch = "x86_64")]
impl Rows for Q2k {
    #[inline(always)]
    unsafe fn row(x: *const u8) -> ([__m256i; 8], [__m256i; 8], __m256i) {
        use std::arch::x86_64::*;
        // SAFETY (intrinsics, loads): the trait's contract. Half n (runs
        // 4n..4n+3): chunk a = qs[32n..] (qs at 16); run 4n + k is bits 2k,
        // 2k + 1 of a. Scales and mins: the 16 bytes at 0.
        unsafe {
            let mut q = [_mm256_setzero_si256(); 8];
            for n in 0..2 {
                let a = _mm256_loadu_si256(x.add(16 + 32 * n).cast());
                q[4 * n..4 * n + 4].copy_from_slice(&two_bit_fields(a));
            }
            let b = _mm_loadu_si128(x.cast());
            let nib = _mm_set1_epi8(0x0f);
            let sc8 = _mm_and_si128(b, nib);
            let mn8 = _mm_and_si128(_mm_srli_epi16(b, 4), nib);
            // (scales 0..16: sign extension is zero extension)
            let scv = run_scales16(sc8);
            (q, scv, _mm256_cvtepu8_epi16(mn8))
        }
    }
}

/// Q3_K: quants `u = low2 + 4·high` (0..8), value `u − 4`, one signed
/// 6-bit scale (−32..32) per 16 weights, no mins: Q6_K's arithmetic with a
/// −4 offset (`−4·sc16` against the 16-value sums).
#[cfg(target_arch = "x86_64")]
impl Format for Q3k {
    const LINES: &'static [usize] = &[0, 64, Q3_K_BYTES - 1];
    const SCALE_LEN: usize = 16;
    const DTYPE: DType = DType::Q3K;
    const BYTES: usize = Q3_K_BYTES;
    // one scale's 4 groups: 4·2·7·128 = 7168
    const G: usize = 4;
    const MINS: bool = false;
    const OFFSET_SHIFT: i32 = 2;

    #[inline(always)]
    unsafe fn heads<S: Src>(x: &S) -> (__m256, __m256) {
        // SAFETY: the trait's contract; d is the last 2 bytes.
        unsafe {
            let d = x.f16_lanes(108);
            (d, d)
        }
    }

    #[inline(always)]
    unsafe fn scales<S: Src>(x: &S) -> ([__m256i; 16], [__m256i; 8]) {
        use std::arch::x86_64::*;
        // SAFETY: bytes 96..108 lie in the superblock.
        let words: [[u64; 2]; ROWS] =
            std::array::from_fn(|r| q3_scale_words(unsafe { x.bytes::<12>(r, 96) }));
        // SAFETY (intrinsics): AVX2, the trait's contract.
        unsafe {
            let half = |h: usize| {
                let t = transpose8x8_bytes(std::array::from_fn(|r| words[r][h]));
                t.map(|v| _mm_sub_epi8(v, _mm_set1_epi8(32)))
            };
            signed_scales16([half(0), half(1)], -4)
        }
    }

    const UNITS: usize = 2;
    const RUNS: usize = 4;

    #[inline(always)]
    unsafe fn begin<S: Src>(x: &S) -> [__m256i; 8] {
        // SAFETY: the trait's contract: hmask, the first 32 bytes.
        unsafe { x.chunk(0) }
    }

    #[inline(always)]
    unsafe fn unit<S: Src>(x: &S, n: usize, hm: &[__m256i; 8]) -> Runs {
        use std::arch::x86_64::*;
        // SAFETY (intrinsics): the trait's contract. Half n (runs
        // 4n..4n+3) takes chunk a = qs[32n..] (qs at 32): run 4n + k is bits
        // 2k, 2k + 1 of a, with bit 4n + k of hmask as bit 2.
        unsafe {
            let a = x.chunk(32 + 32 * n);
            let mut q = [[_mm256_setzero_si256(); 8]; 4];
            for g in 0..8 {
                for (k, l) in two_bit_fields(a[g]).into_iter().enumerate() {
                    q[k][g] = _mm256_or_si256(l, q3_high(hm[g], 4 * n + k));
                }
            }
            q
        }
    }
}

#[cfg(target_arch = "x86_64")]
impl Rows for Q3k {
    #[inline(always)]
    unsafe fn row(x: *const u8) -> ([__m256i; 8], [__m256i; 8], __m256i) {
        use std::arch::x86_64::*;
        // SAFETY (intrinsics, loads): the trait's contract. Half n (runs
        // 4n..4n+3): chunk a = qs[32n..] (qs at 32), hmask h at 0; run
        // 4n + k is bits 2k, 2k + 1 of a with bit 4n + k of h as bit 2.
        // Scales: 16 of 6 bits at 96, less 32, one per 16 weights.
        unsafe {
            let h = _mm256_loadu_si256(x.cast());
            let mut q = [_mm256_setzero_si256(); 8];
            for n in 0..2 {
                let a = _mm256_loadu_si256(x.add(32 + 32 * n).cast());
                for (k, l) in two_bit_fields(a).into_iter().enumerate() {
                    q[4 * n + k] = _mm256_or_si256(l, q3_high(h, 4 * n + k));
                }
            }
            let w = q3_scale_words(x.add(96).cast::<[u8; 12]>().read_unaligned());
            let sc8 = _mm_sub_epi8(_mm_set_epi64x(w[1] as i64, w[0] as i64), _mm_set1_epi8(32));
            let scv = run_scales16(sc8);
            (q, scv, _mm256_cvtepi8_epi16(sc8))
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn lanes<const N: usize, F: Format, const VNNI: bool>(
    nb: usize,
    w: &[&[u8]; ROWS],
    a: &[&[u8]; N],
) -> [[f32; N]; ROWS] {
    check(F::DTYPE, nb, w, a);
    // SAFETY: handed out (lanes_for) only where the CPU has AVX2, FMA and
    // F16C, and with VNNI only at level avx512vnni (AVX-512 F/BW/VL/VNNI);
    // every row holds nb superblocks (checked just above), which bounds all
    // loads.
    unsafe {
        if VNNI {
            lanes_vnni_impl::<N, F>(nb, w, a)
        } else {
            lanes_avx2_impl::<N, F>(nb, w, a)
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn lanes_avx2_impl<const N: usize, F: Format>(
    nb: usize,
    w: &[&[u8]; ROWS],
    a: &[&[u8]; N],
) -> [[f32; N]; ROWS] {
    // SAFETY: the caller's contract (lanes).
    unsafe { lanes_body::<N, F, false>(nb, w, a) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn lanes_vnni_impl<const N: usize, F: Format>(
    nb: usize,
    w: &[&[u8]; ROWS],
    a: &[&[u8]; N],
) -> [[f32; N]; ROWS] {
    // SAFETY: the caller's contract (lanes).
    unsafe { lanes_body::<N, F, true>(nb, w, a) }
}

/// 8 × 8 transpose of 32-bit lanes: lane r of output g = lane g of input r.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) fn transpose8(v: [__m256i; 8]) -> [__m256i; 8] {
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
fn transpose8x8_bytes(m: [u64; 8]) -> [__m128i; 4] {
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

/// The prefill kernel's body, inlined into its AVX2 and VNNI functions.
/// With `VNNI` the groups of a scale are summed by `vpdpbusd` straight into
/// 32 bits and multiplied by the scale there (`vpmulld`), instead of
/// `maddubs` + 16-bit adds + `madd`: the same exact integers.
///
/// # Safety
/// AVX2, FMA, F16C (and AVX-512 VL/VNNI with `VNNI`) enabled in the
/// function this is inlined into; every row holds `nb` superblocks.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn lanes_body<const N: usize, F: Format, const VNNI: bool>(
    nb: usize,
    w: &[&[u8]; ROWS],
    a: &[&[u8]; N],
) -> [[f32; N]; ROWS] {
    use std::arch::x86_64::*;
    // SAFETY: the function's contract: every intrinsic below has its
    // features where this is inlined; every load is inside nb blocks.
    unsafe {
        let wp: [*const u8; ROWS] = std::array::from_fn(|r| w[r].as_ptr());
        let ap: [*const u8; N] = std::array::from_fn(|t| a[t].as_ptr());
        // lanes = rows, per token
        let mut acc = [_mm256_setzero_ps(); N];
        let mut acc_m = [_mm256_setzero_ps(); N];
        for b in 0..nb {
            // SAFETY (all pointer arithmetic and loads below): b < nb and every
            // weight / activation row holds nb blocks.
            let x: [*const u8; ROWS] = std::array::from_fn(|r| wp[r].add(b * F::BYTES));
            let y: [*const u8; N] = std::array::from_fn(|t| ap[t].add(b * Q8_K_BYTES));
            // SAFETY: x[r] are whole superblocks of F; AVX2, FMA, F16C enabled.
            let (xd, xm) = F::heads(&x);
            let (sc, off) = F::scales(&x);
            // VNNI: the scales as i32 (the high half of each pair, sign kept)
            let sc32: [__m256i; 16] = std::array::from_fn(|j| {
                if VNNI {
                    _mm256_srai_epi32(sc[j], 16)
                } else {
                    sc[j]
                }
            });
            let state = F::begin(&x);
            let mut isum = [_mm256_setzero_si256(); N];
            for u in 0..F::UNITS {
                let q = F::unit(&x, u, &state);
                if VNNI {
                    // per scale: its groups' 4-products summed in i32, the
                    // tokens innermost (N independent `vpdpbusd` chains),
                    // then multiplied by the scale
                    let per = F::SCALE_LEN / 4;
                    for (k, run) in q.iter().take(F::RUNS).enumerate() {
                        let s = F::RUNS * u + k;
                        for j in 0..8 / per {
                            let mut p32 = [_mm256_setzero_si256(); N];
                            for g in j * per..(j + 1) * per {
                                for (t, p32) in p32.iter_mut().enumerate() {
                                    let yt = y[t].add(4 + 32 * s + 4 * g).cast::<i32>();
                                    let yv = _mm256_set1_epi32(yt.read_unaligned());
                                    *p32 = _mm256_dpbusd_epi32(*p32, run[g], yv);
                                }
                            }
                            let scale = sc32[(32 * s + 4 * per * j) / F::SCALE_LEN];
                            for (isum, p32) in isum.iter_mut().zip(p32) {
                                *isum = _mm256_add_epi32(*isum, _mm256_mullo_epi32(p32, scale));
                            }
                        }
                    }
                    continue;
                }
                for (t, isum) in isum.iter_mut().enumerate() {
                    for (k, run) in q.iter().take(F::RUNS).enumerate() {
                        let s = F::RUNS * u + k;
                        let ys = y[t].add(4 + 32 * s);
                        let yg = |g: usize| {
                            _mm256_set1_epi32(ys.add(4 * g).cast::<i32>().read_unaligned())
                        };
                        for j in 0..8 / F::G {
                            let (mut p16, mut p16h) =
                                (_mm256_setzero_si256(), _mm256_setzero_si256());
                            for g in j * F::G..(j + 1) * F::G {
                                maddubs_step::<F>(run[g], yg(g), &mut p16, &mut p16h);
                            }
                            // the scale of weights 32s + 4·G·j..
                            let scale = sc[(32 * s + 4 * F::G * j) / F::SCALE_LEN];
                            *isum = _mm256_add_epi32(*isum, madd_scale::<F>(p16, p16h, scale));
                        }
                    }
                }
            }
            for t in 0..N {
                superblock_end::<F>(y[t], isum[t], xd, xm, &off, &mut acc[t], &mut acc_m[t]);
            }
        }
        lanes_out(&acc, &acc_m)
    }
}

/// A `SPLIT` format's quants `u` as their nibbles `(hi, lo)`, u = 16·hi +
/// lo, each 0..16 in its byte.
///
/// # Safety
/// AVX2 enabled where this is inlined.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn split_u(u: __m256i) -> (__m256i, __m256i) {
    use std::arch::x86_64::*;
    // SAFETY: register-only AVX2 ops (the caller's contract).
    unsafe {
        let nib = _mm256_set1_epi8(0x0f);
        (
            _mm256_and_si256(_mm256_srli_epi16::<4>(u), nib),
            _mm256_and_si256(u, nib),
        )
    }
}

/// One step of the `maddubs` kernels: the i16 pair sums `p16` (and, for a
/// `SPLIT` format, `p16h` of the high nibbles) take a group of weights `w`
/// against 4 activations broadcast `y`.
///
/// # Safety
/// AVX2 enabled where this is inlined.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn maddubs_step<F: Format>(w: __m256i, y: __m256i, p16: &mut __m256i, p16h: &mut __m256i) {
    use std::arch::x86_64::*;
    // SAFETY: register-only AVX2 ops (the caller's contract).
    unsafe {
        if F::SPLIT {
            let (hi, lo) = split_u(w);
            *p16h = _mm256_add_epi16(*p16h, _mm256_maddubs_epi16(hi, y));
            *p16 = _mm256_add_epi16(*p16, _mm256_maddubs_epi16(lo, y));
        } else {
            *p16 = _mm256_add_epi16(*p16, _mm256_maddubs_epi16(w, y));
        }
    }
}

/// The `maddubs` kernels' widening: `p16` (and a `SPLIT` format's `p16h`,
/// at 16 times the scale) `madd`ed by the scale pair into i32.
///
/// # Safety
/// AVX2 enabled where this is inlined.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn madd_scale<F: Format>(p16: __m256i, p16h: __m256i, scale: __m256i) -> __m256i {
    use std::arch::x86_64::*;
    // SAFETY: register-only AVX2 ops (the caller's contract).
    unsafe {
        let s = _mm256_madd_epi16(p16, scale);
        if F::SPLIT {
            // |16·scale| ≤ 512: still an i16
            _mm256_add_epi32(s, _mm256_madd_epi16(p16h, _mm256_slli_epi16::<4>(scale)))
        } else {
            s
        }
    }
}

/// A call's result: per token, the 8 rows' `acc + acc_m` (lane r = row r)
/// as `out[r][t]`.
///
/// # Safety
/// AVX enabled where this is inlined.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn lanes_out<const N: usize>(acc: &[__m256; N], acc_m: &[__m256; N]) -> [[f32; N]; ROWS] {
    use std::arch::x86_64::*;
    let mut out = [[0f32; N]; ROWS];
    for t in 0..N {
        let mut v = [0f32; ROWS];
        // SAFETY: v holds 8 floats; AVX is the caller's contract.
        unsafe { _mm256_storeu_ps(v.as_mut_ptr(), _mm256_add_ps(acc[t], acc_m[t])) };
        for r in 0..ROWS {
            out[r][t] = v[r];
        }
    }
    out
}

/// The end of one superblock for one token (8 rows in the lanes): the
/// offsets against the activation's 16-value sums (Q4_K/Q5_K: the mins into
/// `acc_m`; Q6_K: −32·scale folded into `isum`), then the float steps.
///
/// # Safety
/// AVX2 and FMA enabled where this is inlined; `y` is a whole Q8_K block.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn superblock_end<F: Format>(
    y: *const u8,
    mut isum: __m256i,
    xd: __m256,
    xm: __m256,
    off: &[__m256i; 8],
    acc: &mut __m256,
    acc_m: &mut __m256,
) {
    use std::arch::x86_64::*;
    // SAFETY: the function's contract (features; y + 260 holds the 16
    // bsums).
    unsafe {
        let yd = y.cast::<f32>().read_unaligned();
        // the activation's 16-value sums
        let bs = _mm256_loadu_si256(y.add(260).cast());
        let pair = |v: __m128i, i: usize| {
            _mm256_set1_epi32(match i {
                0 => _mm_extract_epi32(v, 0),
                1 => _mm_extract_epi32(v, 1),
                2 => _mm_extract_epi32(v, 2),
                _ => _mm_extract_epi32(v, 3),
            })
        };
        let (lo, hi) = (_mm256_castsi256_si128(bs), _mm256_extracti128_si256(bs, 1));
        // pairs (2i, 2i + 1) of 16-value sums against the factors
        let pairs16 = || {
            let o = |i: usize| {
                let v = if i < 4 { lo } else { hi };
                _mm256_madd_epi16(off[i], pair(v, i % 4))
            };
            _mm256_add_epi32(
                _mm256_add_epi32(_mm256_add_epi32(o(0), o(1)), _mm256_add_epi32(o(2), o(3))),
                _mm256_add_epi32(_mm256_add_epi32(o(4), o(5)), _mm256_add_epi32(o(6), o(7))),
            )
        };
        if F::MINS && F::MIN_LEN == 16 {
            // Q2_K: a min per 16 weights
            *acc_m = float_step(-yd, xm, pairs16(), *acc_m);
        } else if F::MINS {
            // pairs (2i, 2i + 1) of 32-value sums against the mins
            let bs32 = _mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256(bs, 1));
            let m = |i: usize| _mm256_madd_epi16(off[i], pair(bs32, i));
            let msum = _mm256_add_epi32(_mm256_add_epi32(m(0), m(1)), _mm256_add_epi32(m(2), m(3)));
            *acc_m = float_step(-yd, xm, msum, *acc_m);
        } else {
            // pairs (2i, 2i + 1) of 16-value sums against −32·scale
            isum = _mm256_add_epi32(isum, pairs16());
        }
        *acc = float_step(yd, xd, isum, *acc);
    }
}

/// Bytes of one superblock of a packed micro tile ([`pack_rows`]): the 8
/// rows' `d` and `dmin` (f32 lanes), 16 scale vectors (i32, the VNNI
/// kernel's form), 8 offset vectors (the mins or −32·scale pairs, i16), then
/// the unsigned quants of the 8 runs of 32, group by group, rows in lanes.
pub const PACKED_BYTES: usize = 64 + 16 * 32 + 8 * 32 + 64 * 32;
const PACKED_SC: usize = 64;
const PACKED_OFF: usize = PACKED_SC + 16 * 32;
const PACKED_Q: usize = PACKED_OFF + 8 * 32;

/// Packs 8 rows (`nb` superblocks) once, so every token tile after the
/// first skips their transposes and unpacking.
pub type PackFn = fn(usize, &[&[u8]; ROWS], &mut [u8]);
/// Packs the 8 rows of one repacked row block (`x8::X8::block`: `nb`
/// groups, read through their [`GroupMap`]) into the same bytes as
/// [`PackFn`] from the rows themselves, without gathering them back first.
pub type PackX8Fn = fn(usize, &[u8], &GroupMap, &mut [u8]);
/// A prefill kernel over a packed micro tile: `(nb, packed rows (nb ·
/// PACKED_BYTES), 8 token rows) -> out[r][t]`, bit for bit [`lanes_for`]'s.
pub type PackedFn = fn(usize, &[u8], &[&[u8]; TOKS]) -> [[f32; TOKS]; ROWS];

/// A type's packing prefill: the packing from GGUF's rows, the one from a
/// repacked row block, and the kernel over what both write.
#[derive(Clone, Copy, Debug)]
pub struct Packed {
    pub pack: PackFn,
    pub pack_x8: PackX8Fn,
    pub kernel: PackedFn,
}

/// The packing prefill for `dtype` at SIMD level `level` where the CPU
/// runs it: `vpdpbusd` at avx512vnni, `maddubs` + `madd` at avx2 and
/// avx512 (one packed layout for both); `None` for other types and levels.
pub fn packed_for(dtype: DType, level: super::isa::Level) -> Option<Packed> {
    let vnni = super::isa::vnni_or_avx2(level, true, false)?;
    #[cfg(target_arch = "x86_64")]
    match dtype {
        DType::Q4K => return Some(packed_pair::<Q4k>(vnni)),
        DType::Q5K => return Some(packed_pair::<Q5k>(vnni)),
        DType::Q6K => return Some(packed_pair::<Q6k>(vnni)),
        DType::Q3K => return Some(packed_pair::<Q3k>(vnni)),
        DType::Q2K => return Some(packed_pair::<Q2k>(vnni)),
        DType::IQ4XS => return Some(packed_pair::<Iq4xs>(vnni)),
        _ => {}
    }
    let _ = (dtype, vnni);
    None
}

/// Format `F`'s packings and packed kernel, with `vpdpbusd` or without.
#[cfg(target_arch = "x86_64")]
fn packed_pair<F: Format>(vnni: bool) -> Packed {
    if vnni {
        Packed {
            pack: pack_rows::<F, true>,
            pack_x8: pack_x8::<F, true>,
            kernel: lanes_packed::<F, true>,
        }
    } else {
        Packed {
            pack: pack_rows::<F, false>,
            pack_x8: pack_x8::<F, false>,
            kernel: lanes_packed::<F, false>,
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn pack_rows<F: Format, const VNNI: bool>(nb: usize, w: &[&[u8]; ROWS], out: &mut [u8]) {
    check::<0>(F::DTYPE, nb, w, &[]);
    let src = |b: usize| -> [*const u8; ROWS] {
        std::array::from_fn(|r| w[r].as_ptr().wrapping_add(b * F::BYTES))
    };
    // SAFETY: every row holds nb superblocks (checked just above).
    unsafe { pack_from::<F, _, VNNI>(nb, src, out) }
}

#[cfg(target_arch = "x86_64")]
fn pack_x8<F: Format, const VNNI: bool>(nb: usize, g: &[u8], map: &GroupMap, out: &mut [u8]) {
    let gb = ROWS * F::BYTES;
    assert!(
        map.dtype == F::DTYPE && g.len() >= nb * gb,
        "{} pack: a row block of {} groups of {} expected",
        F::DTYPE,
        nb,
        map.dtype
    );
    let src = |b: usize| X8Group {
        g: g.as_ptr().wrapping_add(b * gb),
        map,
    };
    // SAFETY: `g` holds nb whole groups (checked just above) and the map's
    // offsets lie in a group (GroupMap::new).
    unsafe { pack_from::<F, _, VNNI>(nb, src, out) }
}

/// Packs `nb` superblocks of 8 rows from `src(b)` into `out`, at VNNI's
/// level or AVX2's.
///
/// # Safety
/// `src(b)` reads whole superblocks for every b < `nb`.
#[cfg(target_arch = "x86_64")]
unsafe fn pack_from<F: Format, S: Src, const VNNI: bool>(
    nb: usize,
    src: impl Fn(usize) -> S,
    out: &mut [u8],
) {
    assert!(
        out.len() >= nb * PACKED_BYTES,
        "{} pack: buffer too short",
        F::DTYPE
    );
    // SAFETY: handed out (packed_for) only where the CPU has AVX2, FMA and
    // F16C, and with VNNI only at level avx512vnni (AVX-512 F/BW/VL/VNNI);
    // `out` holds nb packed superblocks (checked just above) and `src`
    // whole superblocks (the caller's contract).
    unsafe {
        if VNNI {
            pack_vnni::<F, S>(nb, src, out)
        } else {
            pack_avx2::<F, S>(nb, src, out)
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn pack_vnni<F: Format, S: Src>(nb: usize, src: impl Fn(usize) -> S, out: &mut [u8]) {
    // SAFETY: the caller's contract (pack_from).
    unsafe { pack_body::<F, S>(nb, src, out) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pack_avx2<F: Format, S: Src>(nb: usize, src: impl Fn(usize) -> S, out: &mut [u8]) {
    // SAFETY: the caller's contract (pack_from).
    unsafe { pack_body::<F, S>(nb, src, out) }
}

/// [`PACKED_BYTES`] per superblock, written from the rows' superblocks
/// `src(b)` as [`lanes_body`] unpacks them (so both packed kernels
/// reproduce it).
///
/// # Safety
/// AVX2, FMA and F16C enabled where this is inlined; `src(b)` reads whole
/// superblocks for every b < `nb`, and `out` holds `nb` packed ones.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn pack_body<F: Format, S: Src>(nb: usize, src: impl Fn(usize) -> S, out: &mut [u8]) {
    use std::arch::x86_64::*;
    // SAFETY (all loads and stores): b < nb; the caller's contract.
    unsafe {
        for b in 0..nb {
            let x = src(b);
            let o = out.as_mut_ptr().add(b * PACKED_BYTES);
            let (xd, xm) = F::heads(&x);
            _mm256_storeu_ps(o.cast(), xd);
            _mm256_storeu_ps(o.add(32).cast(), xm);
            let (sc, off) = F::scales(&x);
            for (j, v) in sc.iter().enumerate() {
                // the high half of each pair, sign kept (lanes_body's sc32)
                _mm256_storeu_si256(o.add(PACKED_SC + 32 * j).cast(), _mm256_srai_epi32(*v, 16));
            }
            for (i, v) in off.iter().enumerate() {
                _mm256_storeu_si256(o.add(PACKED_OFF + 32 * i).cast(), *v);
            }
            let state = F::begin(&x);
            for u in 0..F::UNITS {
                let q = F::unit(&x, u, &state);
                for (k, run) in q.iter().take(F::RUNS).enumerate() {
                    let s = F::RUNS * u + k;
                    for (g, v) in run.iter().enumerate() {
                        _mm256_storeu_si256(o.add(PACKED_Q + 32 * (8 * s + g)).cast(), *v);
                    }
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn lanes_packed<F: Format, const VNNI: bool>(
    nb: usize,
    p: &[u8],
    a: &[&[u8]; TOKS],
) -> [[f32; TOKS]; ROWS] {
    assert!(
        p.len() >= nb * PACKED_BYTES,
        "{} lanes: packed tile too short",
        F::DTYPE
    );
    assert!(
        a.iter().all(|r| r.len() >= nb * Q8_K_BYTES),
        "{} lanes: activation row too short",
        F::DTYPE
    );
    // SAFETY: handed out (packed_for) only where the CPU has AVX2, FMA and
    // F16C, and with VNNI only at level avx512vnni (AVX-512 F/BW/VL/VNNI);
    // the packed tile and every activation row hold nb superblocks
    // (checked just above).
    unsafe {
        if VNNI {
            lanes_packed_vnni::<F>(nb, p, a)
        } else {
            lanes_packed_avx2::<F>(nb, p, a)
        }
    }
}

/// Superblock `b` of a packed micro tile: its start, the tokens' Q8_K
/// blocks, and the rows' `d`, `dmin` and offset factors.
///
/// # Safety
/// AVX enabled where this is inlined; `p` holds more than `b` packed
/// superblocks and every token row more than `b` Q8_K blocks.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(clippy::type_complexity)]
unsafe fn packed_block(
    p: &[u8],
    ap: &[*const u8; TOKS],
    b: usize,
) -> (*const u8, [*const u8; TOKS], __m256, __m256, [__m256i; 8]) {
    use std::arch::x86_64::*;
    // SAFETY (all pointer arithmetic and loads): the caller's contract.
    unsafe {
        let o = p.as_ptr().add(b * PACKED_BYTES);
        let y: [*const u8; TOKS] = std::array::from_fn(|t| ap[t].add(b * Q8_K_BYTES));
        let (xd, xm) = (_mm256_loadu_ps(o.cast()), _mm256_loadu_ps(o.add(32).cast()));
        let off: [__m256i; 8] =
            std::array::from_fn(|i| _mm256_loadu_si256(o.add(PACKED_OFF + 32 * i).cast()));
        (o, y, xd, xm, off)
    }
}

/// `lanes_body`'s VNNI path over a packed micro tile (the same integer
/// sums in the same order, the same float steps).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn lanes_packed_vnni<F: Format>(
    nb: usize,
    p: &[u8],
    a: &[&[u8]; TOKS],
) -> [[f32; TOKS]; ROWS] {
    use std::arch::x86_64::*;
    // SAFETY (all loads): b < nb; the caller's contract.
    unsafe {
        let ap: [*const u8; TOKS] = std::array::from_fn(|t| a[t].as_ptr());
        let mut acc = [_mm256_setzero_ps(); TOKS];
        let mut acc_m = [_mm256_setzero_ps(); TOKS];
        let per = F::SCALE_LEN / 4;
        for b in 0..nb {
            let (o, y, xd, xm, off) = packed_block(p, &ap, b);
            let mut isum = [_mm256_setzero_si256(); TOKS];
            for s in 0..8 {
                for j in 0..8 / per {
                    let mut p32 = [_mm256_setzero_si256(); TOKS];
                    for g in j * per..(j + 1) * per {
                        let wv = _mm256_loadu_si256(o.add(PACKED_Q + 32 * (8 * s + g)).cast());
                        for (t, p32) in p32.iter_mut().enumerate() {
                            let yt = y[t].add(4 + 32 * s + 4 * g).cast::<i32>();
                            *p32 = _mm256_dpbusd_epi32(
                                *p32,
                                wv,
                                _mm256_set1_epi32(yt.read_unaligned()),
                            );
                        }
                    }
                    let k = (32 * s + 4 * per * j) / F::SCALE_LEN;
                    let scale = _mm256_loadu_si256(o.add(PACKED_SC + 32 * k).cast());
                    for (isum, p32) in isum.iter_mut().zip(p32) {
                        *isum = _mm256_add_epi32(*isum, _mm256_mullo_epi32(p32, scale));
                    }
                }
            }
            for t in 0..TOKS {
                superblock_end::<F>(y[t], isum[t], xd, xm, &off, &mut acc[t], &mut acc_m[t]);
            }
        }
        lanes_out(&acc, &acc_m)
    }
}

/// `lanes_body`'s AVX2 path over a packed micro tile: per token, the same
/// exact integer sum (`maddubs` pairs summed in i16 over `G` groups, then a
/// `madd` by the scale pair; integer adds, so their order does not change
/// it) and the same float steps. Tokens go four at a time, so each 32-byte
/// load of packed quants (from L1) feeds four `maddubs`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn lanes_packed_avx2<F: Format>(
    nb: usize,
    p: &[u8],
    a: &[&[u8]; TOKS],
) -> [[f32; TOKS]; ROWS] {
    use std::arch::x86_64::*;
    const T4: usize = 4;
    // SAFETY (all loads): b < nb; the caller's contract.
    unsafe {
        let ap: [*const u8; TOKS] = std::array::from_fn(|t| a[t].as_ptr());
        let mut acc = [_mm256_setzero_ps(); TOKS];
        let mut acc_m = [_mm256_setzero_ps(); TOKS];
        // the packed i32 scale back into the (i16, i16) pair `madd` takes:
        // bytes 0, 1 of each dword copied to 2, 3 (|scale| < 2^15; the
        // indices are into each 128-bit lane)
        let dup = _mm256_setr_epi8(
            0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13, 0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9,
            12, 13, 12, 13,
        );
        for b in 0..nb {
            let (o, y, xd, xm, off) = packed_block(p, &ap, b);
            for t0 in (0..TOKS).step_by(T4) {
                let mut isum = [_mm256_setzero_si256(); T4];
                for s in 0..8 {
                    for j in 0..8 / F::G {
                        let mut p16 = [_mm256_setzero_si256(); T4];
                        let mut p16h = [_mm256_setzero_si256(); T4];
                        for g in j * F::G..(j + 1) * F::G {
                            let wv = _mm256_loadu_si256(o.add(PACKED_Q + 32 * (8 * s + g)).cast());
                            for (k, (p16, p16h)) in p16.iter_mut().zip(&mut p16h).enumerate() {
                                let yt = y[t0 + k].add(4 + 32 * s + 4 * g).cast::<i32>();
                                let yv = _mm256_set1_epi32(yt.read_unaligned());
                                maddubs_step::<F>(wv, yv, p16, p16h);
                            }
                        }
                        // the scale of weights 32s + 4·G·j..
                        let k = (32 * s + 4 * F::G * j) / F::SCALE_LEN;
                        let sc32 = _mm256_loadu_si256(o.add(PACKED_SC + 32 * k).cast());
                        let scale = _mm256_shuffle_epi8(sc32, dup);
                        for ((isum, p16), p16h) in isum.iter_mut().zip(p16).zip(p16h) {
                            *isum = _mm256_add_epi32(*isum, madd_scale::<F>(p16, p16h, scale));
                        }
                    }
                }
                for (k, isum) in isum.into_iter().enumerate() {
                    let t = t0 + k;
                    superblock_end::<F>(y[t], isum, xd, xm, &off, &mut acc[t], &mut acc_m[t]);
                }
            }
        }
        lanes_out(&acc, &acc_m)
    }
}

/// The AVX2 decoding kernel (the AVX-512 levels have their own,
/// [`super::qgemm_k_decode`]).
#[cfg(target_arch = "x86_64")]
fn rows<const N: usize, F: Rows>(nb: usize, w: &[&[u8]; ROWS], a: &[&[u8]; N]) -> [[f32; N]; ROWS] {
    check(F::DTYPE, nb, w, a);
    // SAFETY: handed out (lanes_for) only where the CPU has AVX2, FMA and
    // F16C; every row holds nb superblocks (checked just above), which
    // bounds all loads.
    unsafe { rows_avx2_impl::<N, F>(nb, w, a) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_avx2_impl<const N: usize, F: Rows>(
    nb: usize,
    w: &[&[u8]; ROWS],
    a: &[&[u8]; N],
) -> [[f32; N]; ROWS] {
    // SAFETY: the caller's contract (rows).
    unsafe { rows_body::<N, F>(nb, w, a) }
}

/// IQ4_XS's 8 six-bit scales `ls` (0..64) of one superblock, byte k =
/// `ls[k]` (the values of [`crate::quant::iq4_xs_scales`], which the
/// scalar model reads): the low nibbles of `scales_l` and the 2-bit fields
/// of `scales_h` spread to one byte each by masked shifts. Every IQ4_XS
/// kernel takes its scales from here.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) fn iq4_scale_bytes(b: [u8; 8]) -> u64 {
    iq4_scale_fields(
        u16::from_le_bytes([b[2], b[3]]),
        u32::from_le_bytes([b[4], b[5], b[6], b[7]]),
    )
}

/// [`iq4_scale_bytes`] of the two fields themselves, `scales_h` and
/// `scales_l` (IQ4_XS×8 keeps them apart).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) fn iq4_scale_fields(h: u16, l: u32) -> u64 {
    let (h, l) = (h as u64, l as u64);
    // nibble k of `scales_l` to byte k: halves, bytes, nibbles apart
    let mut lo = (l | (l << 16)) & 0x0000_ffff_0000_ffff;
    lo = (lo | (lo << 8)) & 0x00ff_00ff_00ff_00ff;
    lo = (lo | (lo << 4)) & 0x0f0f_0f0f_0f0f_0f0f;
    // field k (bits 2k, 2k + 1) of `scales_h` to byte k: bytes, nibbles,
    // fields apart
    let mut hi = (h | (h << 24)) & 0x0000_00ff_0000_00ff;
    hi = (hi | (hi << 12)) & 0x000f_000f_000f_000f;
    hi = (hi | (hi << 6)) & 0x0303_0303_0303_0303;
    lo | (hi << 4)
}

/// The IQ4_XS decoding kernel at AVX2 (one token per pass; 8 rows as GGUF
/// stores them): the module's integers by ggml's sign trick with the
/// roles swapped: per run, the signed grid values `w` (|w| ≤ 127, one
/// byte shuffle from the indices) against |y| (unsigned, computed once
/// for the 8 rows), `w`'s sign set by `y`'s, so each `maddubs` product is
/// y·w and its pairs stay within 2·128·127 < 2¹⁵ for any Q8_K byte, −128
/// included (the quantizers write ±127 at most); one `madd` by the run's
/// scale `ls − 32`. That is Σ scale·Σ w·y,
/// the lanes kernel's Σ scale·Σ (w + 128)·y − 128·Σ scale·bsum, exactly,
/// and the same float step ends each superblock. The rows-in-lanes
/// arithmetic of [`rows`] would need a quant's two nibbles apart
/// (`Format::SPLIT`): it decoded a synthetic 1.5B IQ4_XS at 0.78–0.91×
/// llama.cpp's AVX2 build, where this kernel keeps 16 registers' worth.
#[cfg(target_arch = "x86_64")]
fn rows_iq4xs<const N: usize>(nb: usize, w: &[&[u8]; ROWS], a: &[&[u8]; N]) -> [[f32; N]; ROWS] {
    check(DType::IQ4XS, nb, w, a);
    // SAFETY: handed out (lanes_for) only where the CPU has AVX2, FMA and
    // F16C; every row holds nb superblocks and every token nb Q8_K blocks
    // (checked just above), which bounds all loads.
    unsafe { rows_iq4xs_avx2::<N>(nb, w, a) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_iq4xs_avx2<const N: usize>(
    nb: usize,
    w: &[&[u8]; ROWS],
    a: &[&[u8]; N],
) -> [[f32; N]; ROWS] {
    use std::arch::x86_64::*;
    // SAFETY (all pointer arithmetic and loads below): b < nb, and every
    // weight / activation row holds nb blocks (the caller's contract);
    // the intrinsics' features are this function's.
    unsafe {
        let wp: [*const u8; ROWS] = std::array::from_fn(|r| w[r].as_ptr());
        let grid = iq4_grid(false);
        let nib = _mm256_set1_epi8(0x0f);
        let mut acc = [_mm256_setzero_ps(); N];
        for b in 0..nb {
            let x: [*const u8; ROWS] = std::array::from_fn(|r| wp[r].add(b * IQ4_XS_BYTES));
            prefetch_ahead::<Iq4xs>(&x, nb);
            let ls: [u64; ROWS] =
                std::array::from_fn(|r| iq4_scale_bytes(x[r].cast::<[u8; 8]>().read_unaligned()));
            let (xd, _) = Iq4xs::heads(&x);
            for (t, acc) in acc.iter_mut().enumerate() {
                let y = a[t].as_ptr().add(b * Q8_K_BYTES);
                // per row, 8 lanes of its exact integer sum
                let mut isum = [_mm256_setzero_si256(); ROWS];
                for k in 0..8 {
                    let y8 = _mm256_loadu_si256(y.add(4 + 32 * k).cast());
                    let ya = _mm256_abs_epi8(y8);
                    for (r, isum) in isum.iter_mut().enumerate() {
                        // run k: weights 0..16 the low nibbles of its 16
                        // bytes, 16..32 the high ones
                        let q = _mm_loadu_si128(x[r].add(8 + 16 * k).cast());
                        let v = _mm256_inserti128_si256::<1>(
                            _mm256_castsi128_si256(q),
                            _mm_srli_epi16::<4>(q),
                        );
                        let wv = _mm256_shuffle_epi8(grid, _mm256_and_si256(v, nib));
                        let prod = _mm256_maddubs_epi16(ya, _mm256_sign_epi8(wv, y8));
                        let sc = ((ls[r] >> (8 * k)) & 0xff) as i16 - 32;
                        *isum =
                            _mm256_add_epi32(*isum, _mm256_madd_epi16(prod, _mm256_set1_epi16(sc)));
                    }
                }
                let h: [__m256i; 4] =
                    std::array::from_fn(|p| _mm256_hadd_epi32(isum[2 * p], isum[2 * p + 1]));
                let yd = y.cast::<f32>().read_unaligned();
                *acc = float_step(yd, xd, sum_rows(h), *acc);
            }
        }
        lanes_out(&acc, &[_mm256_setzero_ps(); N])
    }
}

/// One float step of the module's arithmetic (see the module doc):
/// `fma(s·x, f32(i), acc)` for 8 rows, with `s` the activation's scale (or
/// its negation, for the mins), `x` the rows' d (or dmin) and `i` their
/// exact integer sums. Every kernel here and in `qgemm_k_decode` ends a
/// superblock through this, so they agree bit for bit.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) fn float_step(s: f32, x: __m256, i: __m256i, acc: __m256) -> __m256 {
    use std::arch::x86_64::*;
    // SAFETY: register-only AVX + FMA ops, inlined into the kernels'
    // target-feature functions (all enable AVX2 and FMA).
    unsafe {
        _mm256_fmadd_ps(
            _mm256_mul_ps(_mm256_set1_ps(s), x),
            _mm256_cvtepi32_ps(i),
            acc,
        )
    }
}

/// The decoding kernels' prefetch: superblock `x[r]` of the rows
/// [`PREFETCH_CALLS`] calls on (the rows after these in a contiguous
/// matrix), into L2.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) fn prefetch_ahead<F: Format>(x: &[*const u8; ROWS], nb: usize) {
    use std::arch::x86_64::*;
    let ahead = PREFETCH_CALLS * ROWS * nb * F::BYTES;
    for p in x {
        for &line in F::LINES {
            // SAFETY: a prefetch (SSE, always present on x86_64) never
            // faults and reads nothing the program sees; wrapping_add keeps
            // `p`'s provenance
            unsafe { _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(ahead + line).cast()) };
        }
    }
}

/// Integer lanes of 8 rows reduced to one sum per row: `h[p]` is
/// `hadd(v[2p], v[2p + 1])` of the rows' 8-lane vectors; lane r of the
/// result is the sum of row r's 8 lanes (exact: integer adds).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) fn sum_rows(h: [__m256i; 4]) -> __m256i {
    use std::arch::x86_64::*;
    // SAFETY: register-only AVX2 ops, inlined into AVX2 functions.
    unsafe {
        // rows 0-3 (4-7): lanes 0-3 sum lanes 0-3 of each row, 4-7 its 4-7
        let a = _mm256_hadd_epi32(h[0], h[1]);
        let b = _mm256_hadd_epi32(h[2], h[3]);
        _mm256_add_epi32(
            _mm256_permute2x128_si256(a, b, 0x20),
            _mm256_permute2x128_si256(a, b, 0x31),
        )
    }
}

/// The decoding kernel (one token; any `N` works): rows in the usual
/// layout, as ggml's `vec_dot` reads them, for a row's integer sums, then
/// those of the 8 rows moved into lanes for the float steps, so the
/// arithmetic is the module's (bit for bit the lanes kernel's). With one
/// token the lanes kernel's in-register transposes cost more than they
/// save.
///
/// # Safety
/// As [`lanes_body`].
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn rows_body<const N: usize, F: Rows>(
    nb: usize,
    w: &[&[u8]; ROWS],
    a: &[&[u8]; N],
) -> [[f32; N]; ROWS] {
    use std::arch::x86_64::*;
    // SAFETY: the function's contract: every intrinsic below has its
    // features where this is inlined; every load is inside nb blocks.
    unsafe {
        let wp: [*const u8; ROWS] = std::array::from_fn(|r| w[r].as_ptr());
        let ap: [*const u8; N] = std::array::from_fn(|t| a[t].as_ptr());
        let mut acc = [_mm256_setzero_ps(); N];
        let mut acc_m = [_mm256_setzero_ps(); N];
        for b in 0..nb {
            // SAFETY (all pointer arithmetic and loads below): b < nb and every
            // weight / activation row holds nb blocks.
            let x: [*const u8; ROWS] = std::array::from_fn(|r| wp[r].add(b * F::BYTES));
            let y: [*const u8; N] = std::array::from_fn(|t| ap[t].add(b * Q8_K_BYTES));
            prefetch_ahead::<F>(&x, nb);
            let bs: [__m256i; N] =
                std::array::from_fn(|t| _mm256_loadu_si256(y[t].add(260).cast()));
            // per token, pairs of rows' integer lanes (hadd), then per row
            let mut h = [[_mm256_setzero_si256(); 4]; N];
            let mut hm = [[_mm256_setzero_si256(); 4]; N];
            for p in 0..4 {
                let mut v = [[_mm256_setzero_si256(); 2]; N];
                let mut vm = [[_mm256_setzero_si256(); 2]; N];
                for i in 0..2 {
                    // SAFETY: x[2p + i] is a whole superblock of F.
                    let (q, scv, off) = F::row(x[2 * p + i]);
                    for t in 0..N {
                        let mut s = _mm256_setzero_si256();
                        for k in 0..8 {
                            let y8 = _mm256_loadu_si256(y[t].add(4 + 32 * k).cast());
                            // |2·63·128| < 2^15: maddubs cannot saturate
                            let prod = _mm256_maddubs_epi16(q[k], y8);
                            s = _mm256_add_epi32(s, _mm256_madd_epi16(prod, scv[k]));
                        }
                        let o = _mm256_madd_epi16(bs[t], off);
                        if F::MINS {
                            v[t][i] = s;
                            vm[t][i] = o;
                        } else {
                            // the −32 (−4) offset of every weight
                            let sh = _mm_cvtsi32_si128(F::OFFSET_SHIFT);
                            v[t][i] = _mm256_sub_epi32(s, _mm256_sll_epi32(o, sh));
                        }
                    }
                }
                for t in 0..N {
                    h[t][p] = _mm256_hadd_epi32(v[t][0], v[t][1]);
                    if F::MINS {
                        hm[t][p] = _mm256_hadd_epi32(vm[t][0], vm[t][1]);
                    }
                }
            }
            // SAFETY: x[r] are whole superblocks of F.
            let (xd, xm) = F::heads(&x);
            for t in 0..N {
                let yd = y[t].cast::<f32>().read_unaligned();
                if F::MINS {
                    acc_m[t] = float_step(-yd, xm, sum_rows(hm[t]), acc_m[t]);
                }
                acc[t] = float_step(yd, xd, sum_rows(h[t]), acc[t]);
            }
        }
        lanes_out(&acc, &acc_m)
    }
}
