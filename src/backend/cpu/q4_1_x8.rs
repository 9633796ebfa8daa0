//! Q4_1 repacked eight rows at a time (Q4_1×8; the container is
//! [`super::x8::X8`]) and its decoding kernel, which keeps ggml's Q4_1 ×
//! Q8_1 arithmetic lane for lane, so a repacked matrix gives the same
//! logits as ggml's `vec_dot` and as the row-major kernels of
//! `qgemm_x86` (the prefill tile included: a prompt's logits still do not
//! depend on its chunking).
//!
//! ## Arithmetic (ggml's, per row and token)
//! A Q4_1 weight is d·q + m (q a nibble), a Q8_1 activation d_y·y with
//! s = d_y·Σy stored. Per block, eight i32 lanes: lane j the sum of the 4
//! products of quants 4j..4j + 4 (low nibbles of bytes 0..16 are quants
//! 0..16, high nibbles 16..32), converted and accumulated as
//! `acc[j] = fma(d·d_y, f32(lane j), acc[j])`; the offsets as `summs =
//! fma(m, s, summs)`; the result `hsum(acc) + summs`, the lanes added as
//! ggml's `hsum_float_8` adds them ([`dot_scalar`]).
//!
//! ## Layout
//! A row block's `nb` groups of 160 bytes, one per block column:
//! - bytes 0..32: the 8 rows' `(d, m)` (f16 pairs), row r at 4r;
//! - then for k in 0..4 the rows' nibble bytes 4k..4k + 4 (32 bytes, row r
//!   at 32 + 32k + 4r): their low nibbles are quant dword k, their high
//!   nibbles quant dword 4 + k, for all 8 rows in one load.
//!
//! ## Decoding
//! Per group, with rows in the lanes: one 512-bit load holds quads k and
//! k + 1 of all 8 rows, so a `vpdpbusd` against the token's dwords j and
//! j + 1 (each broadcast over its half) gives lanes j and j + 1 of the 8
//! rows at once: 4 `vpdpbusd`, 4 conversions and 4 `fma` per group
//! instead of per row, one (d, m) load and conversion for the 8 rows, and
//! a single stream of memory instead of 8 (the row-major kernel needed
//! software prefetch to keep ahead of its 8 streams). At AVX2 (where the
//! row-major decoding is ggml's `vec_dot`, row by row) each lane j of the
//! 8 rows is one `maddubs` and one `madd`, as ggml's AVX2 code forms it.

use crate::tensor::DType;
use half::f16;

/// Rows per group.
pub const ROWS: usize = super::qgemm_lanes::ROWS;
/// Bytes of a Q4_1 block: `d`, `m` (f16), `qs[16]`.
const Q4_1_BYTES: usize = 20;
/// Bytes of a Q8_1 block: `d`, `s` (f16), `qs[32]` (i8).
const Q8_1_BYTES: usize = 36;
/// Bytes of a group.
pub const GROUP_BYTES: usize = ROWS * Q4_1_BYTES;

/// A decoding kernel: `(nb, one row block's groups, one token's Q8_1 row)
/// -> the 8 rows' dot products` (the shape of `x8::X8Fn`).
pub type DecodeFn = fn(usize, &[u8], &[u8]) -> [f32; ROWS];

/// Row `r`'s copies between one block and its group, `(offset in the
/// block, offset in the group, length)`.
pub fn segments(r: usize) -> impl Iterator<Item = (usize, usize, usize)> {
    assert!(r < ROWS, "q4_1×8: row {r}");
    let head = std::iter::once((0, 4 * r, 4));
    head.chain((0..4).map(move |k| (4 + 4 * k, 32 + 32 * k + 4 * r, 4)))
}

#[inline]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

/// The scalar model: one Q4_1 row · one token's Q8_1 row, `nb` blocks, in
/// ggml's lanes and order (the module doc).
pub fn dot_scalar(nb: usize, row: &[u8], y: &[u8]) -> f32 {
    assert!(
        row.len() >= nb * Q4_1_BYTES && y.len() >= nb * Q8_1_BYTES,
        "q4_1: row too short"
    );
    let mut acc = [0f32; 8];
    let mut summs = 0f32;
    for b in 0..nb {
        let (x, a) = (&row[b * Q4_1_BYTES..], &y[b * Q8_1_BYTES..]);
        let d = f16_at(x, 0) * f16_at(a, 0);
        summs = f16_at(x, 2).mul_add(f16_at(a, 2), summs);
        for (j, lane) in acc.iter_mut().enumerate() {
            let p: i32 = (4 * j..4 * j + 4)
                .map(|i| {
                    let q = if i < 16 {
                        x[4 + i] & 0x0f
                    } else {
                        x[4 + i - 16] >> 4
                    };
                    q as i32 * a[4 + i] as i8 as i32
                })
                .sum();
            *lane = d.mul_add(p as f32, *lane);
        }
    }
    let h: [f32; 4] = std::array::from_fn(|i| acc[4 + i] + acc[i]);
    ((h[0] + h[2]) + (h[1] + h[3])) + summs
}

/// The decoding kernel at kernel level `level`, where this CPU runs it:
/// VNNI's from avx512vnni, AVX2's at avx2 and avx512; none below.
pub fn decode_for(level: super::isa::Level) -> Option<DecodeFn> {
    #[cfg(target_arch = "x86_64")]
    return super::isa::vnni_or_avx2(level, decode::<true>, decode::<false>);
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = level;
        None
    }
}

#[cfg(target_arch = "x86_64")]
fn decode<const VNNI: bool>(nb: usize, groups: &[u8], y: &[u8]) -> [f32; ROWS] {
    assert!(
        groups.len() >= nb * GROUP_BYTES && y.len() >= nb * Q8_1_BYTES,
        "q4_1×8 decode: short operands"
    );
    // SAFETY: handed out by `decode_for` only where the CPU has AVX2, FMA
    // and F16C, and for VNNI's AVX-512 F/BW/VL/VNNI; the lengths checked
    // above bound every load.
    unsafe {
        if VNNI {
            decode_vnni(nb, groups.as_ptr(), y.as_ptr())
        } else {
            decode_avx2(nb, groups.as_ptr(), y.as_ptr())
        }
    }
}

/// A Q8_1 block's `d` and `s` as f32.
///
/// # Safety
/// `yb` points at 4 readable bytes.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn token_scales(yb: *const u8) -> (f32, f32) {
    // SAFETY: the caller's contract.
    let (d, s) = unsafe {
        (
            yb.cast::<u16>().read_unaligned(),
            yb.add(2).cast::<u16>().read_unaligned(),
        )
    };
    (f16::from_bits(d).to_f32(), f16::from_bits(s).to_f32())
}

/// The AVX2 kernel: per group and quant dword j, one `maddubs` of the 8
/// rows' nibbles with the token's dword j broadcast (pairs within
/// 2·15·128, exact) and one `madd` by 1 give lane j of the 8 rows, as
/// ggml's AVX2 `vec_dot` forms it; 8 accumulators, one per lane j.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `x` holds `nb` groups, `y` `nb` Q8_1
/// blocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn decode_avx2(nb: usize, x: *const u8, y: *const u8) -> [f32; ROWS] {
    use std::arch::x86_64::*;
    let nib = _mm256_set1_epi8(0x0f);
    let ones = _mm256_set1_epi16(1);
    // acc[j]: lane j of the 8 rows
    let mut acc = [_mm256_setzero_ps(); 8];
    let mut summs = _mm256_setzero_ps();
    // SAFETY (every load below): b < nb, so group b and block b of y are
    // readable (the function's contract).
    unsafe {
        for b in 0..nb {
            let g = x.add(b * GROUP_BYTES);
            super::mem::prefetch_ahead(g, GROUP_BYTES);
            let yb = y.add(b * Q8_1_BYTES);
            let (dy, sy) = token_scales(yb);
            let heads = _mm256_loadu_si256(g.cast());
            // the 8 rows' d and m: the low and high halves of each dword
            let d16 = _mm256_packus_epi32(
                _mm256_and_si256(heads, _mm256_set1_epi32(0xffff)),
                _mm256_srli_epi32::<16>(heads),
            );
            // (packus works per 128-bit lane: d of rows 0-3, m of 0-3, d of
            // 4-7, m of 4-7 as 64-bit quarters; put the d's, then the m's)
            let d16 = _mm256_permute4x64_epi64::<0b11_01_10_00>(d16);
            let dx = _mm256_cvtph_ps(_mm256_castsi256_si128(d16));
            let mx = _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(d16));
            summs = _mm256_fmadd_ps(mx, _mm256_set1_ps(sy), summs);
            let dd = _mm256_mul_ps(dx, _mm256_set1_ps(dy));
            for k in 0..4 {
                let q = _mm256_loadu_si256(g.add(32 + 32 * k).cast());
                let halves = [
                    (k, _mm256_and_si256(q, nib)),
                    (4 + k, _mm256_and_si256(_mm256_srli_epi16::<4>(q), nib)),
                ];
                for (j, w) in halves {
                    let yj = _mm256_set1_epi32(yb.add(4 + 4 * j).cast::<i32>().read_unaligned());
                    let lanes = _mm256_madd_epi16(_mm256_maddubs_epi16(w, yj), ones);
                    acc[j] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(lanes), acc[j]);
                }
            }
        }
        // ggml's hsum_float_8 over each row's lanes
        let h: [__m256; 4] = std::array::from_fn(|i| _mm256_add_ps(acc[4 + i], acc[i]));
        let total = _mm256_add_ps(_mm256_add_ps(h[0], h[2]), _mm256_add_ps(h[1], h[3]));
        let mut out = [0f32; ROWS];
        _mm256_storeu_ps(out.as_mut_ptr(), _mm256_add_ps(total, summs));
        out
    }
}

/// The VNNI kernel (the module doc's decoding).
///
/// # Safety
/// The CPU has AVX2, FMA, F16C and AVX-512 F/BW/VL/VNNI; `x` holds `nb`
/// groups, `y` `nb` Q8_1 blocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn decode_vnni(nb: usize, x: *const u8, y: *const u8) -> [f32; ROWS] {
    use std::arch::x86_64::*;
    let nib = _mm512_set1_epi8(0x0f);
    // dwords j (lower half) and j + 1 (upper half) of the token's quants
    let pair = |j: i32| _mm512_inserti64x4::<1>(_mm512_set1_epi32(j), _mm256_set1_epi32(j + 1));
    let pick = [pair(0), pair(2), pair(4), pair(6)];
    // lanes (j, j + 1) of the 8 rows: acc[0] j = 0, 1; acc[1] 2, 3; acc[2]
    // 4, 5; acc[3] 6, 7
    let mut acc = [_mm512_setzero_ps(); 4];
    let mut summs = _mm256_setzero_ps();
    // SAFETY (every load below): b < nb, so group b and block b of y are
    // readable (the function's contract).
    unsafe {
        for b in 0..nb {
            let g = x.add(b * GROUP_BYTES);
            super::mem::prefetch_ahead(g, GROUP_BYTES);
            let yb = y.add(b * Q8_1_BYTES);
            let (dy, sy) = token_scales(yb);
            // the 8 rows' (d, m): d·d_y per row, and summs = fma(m, s, summs)
            let heads = _mm256_loadu_si256(g.cast());
            let dx = _mm256_cvtph_ps(_mm256_cvtepi32_epi16(heads));
            let mx = _mm256_cvtph_ps(_mm256_cvtepi32_epi16(_mm256_srli_epi32::<16>(heads)));
            summs = _mm256_fmadd_ps(mx, _mm256_set1_ps(sy), summs);
            let dd = _mm256_mul_ps(dx, _mm256_set1_ps(dy));
            let dd = _mm512_insertf32x8::<1>(_mm512_castps256_ps512(dd), dd);
            // the token's 8 quant dwords, and pairs of them broadcast
            let yq = _mm512_broadcast_i64x4(_mm256_loadu_si256(yb.add(4).cast()));
            let ys = pick.map(|p| _mm512_permutexvar_epi32(p, yq));
            // quads 0, 1 and 2, 3 of the 8 rows: low nibbles are quant
            // dwords (0, 1) and (2, 3), high nibbles (4, 5) and (6, 7)
            let q01 = _mm512_loadu_si512(g.add(32).cast());
            let q23 = _mm512_loadu_si512(g.add(96).cast());
            let w = [
                _mm512_and_si512(q01, nib),
                _mm512_and_si512(q23, nib),
                _mm512_and_si512(_mm512_srli_epi16::<4>(q01), nib),
                _mm512_and_si512(_mm512_srli_epi16::<4>(q23), nib),
            ];
            for i in 0..4 {
                let lanes = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[i], ys[i]);
                acc[i] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(lanes), acc[i]);
            }
        }
        // ggml's hsum_float_8 over each row's lanes: h_i = lane 4 + i +
        // lane i, then (h0 + h2) + (h1 + h3)
        let h01 = _mm512_add_ps(acc[2], acc[0]);
        let h23 = _mm512_add_ps(acc[3], acc[1]);
        let p = _mm512_add_ps(h01, h23);
        let total = _mm256_add_ps(_mm512_castps512_ps256(p), _mm512_extractf32x8_ps::<1>(p));
        let mut out = [0f32; ROWS];
        _mm256_storeu_ps(out.as_mut_ptr(), _mm256_add_ps(total, summs));
        out
    }
}

/// The 8 rows of a row block's `nb` groups as GGUF stores them: row `r`'s
/// blocks at `out[r · stride..]`, a whole group at a time (one 8 × 8
/// dword transpose: the 8 rows' `(d, m)` and their 4 quant dwords are 5
/// vectors with the rows in lanes); where the CPU lacks AVX2, `false` and
/// nothing written. Q4_1 prefill gathers its row blocks back this way
/// (`matmul_q_tiled`); row by row along the layout's copy list, that cost
/// SmolLM2's prefill in chunks of 32 tokens (a budgeted cache) a fifth.
pub fn unpack_rows(nb: usize, groups: &[u8], out: &mut [u8], stride: usize) -> bool {
    let rb = nb * Q4_1_BYTES;
    assert!(
        groups.len() >= nb * GROUP_BYTES && stride >= rb && out.len() >= (ROWS - 1) * stride + rb,
        "q4_1×8 unpack: short operands"
    );
    #[cfg(target_arch = "x86_64")]
    if super::isa::detected() >= super::isa::Level::Avx2 {
        // SAFETY: the CPU has AVX2 (just checked); the lengths checked
        // above bound every load and store.
        unsafe { unpack_rows_avx2(nb, groups.as_ptr(), out.as_mut_ptr(), stride) };
        return true;
    }
    false
}

/// [`unpack_rows`]'s body.
///
/// # Safety
/// The CPU has AVX2; `g` holds `nb` groups and `out` 8 rows of `nb` blocks
/// `stride` bytes apart.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn unpack_rows_avx2(nb: usize, g: *const u8, out: *mut u8, stride: usize) {
    use std::arch::x86_64::*;
    // SAFETY (every load and store): b < nb and r < 8, inside the caller's
    // bounds.
    unsafe {
        for b in 0..nb {
            let p = g.add(b * GROUP_BYTES);
            // (d, m) of the 8 rows, then quant dwords 0..4 (Layout)
            let v: [__m256i; 8] = std::array::from_fn(|i| {
                if i < 5 {
                    _mm256_loadu_si256(p.add(32 * i).cast())
                } else {
                    _mm256_setzero_si256()
                }
            });
            // t[r]: row r's block in dwords 0..5
            let t = super::qgemm_lanes::transpose8(v);
            for (r, t) in t.iter().enumerate() {
                let o = out.add(r * stride + b * Q4_1_BYTES);
                _mm_storeu_si128(o.cast(), _mm256_castsi256_si128(*t));
                _mm_storeu_si32(o.add(16), _mm256_extracti128_si256::<1>(*t));
            }
        }
    }
}

/// Whether `dtype` is Q4_1 (the type of this layout).
pub fn is_q4_1(dtype: DType) -> bool {
    dtype == DType::Q4_1
}
