//! Q8_0 × Q8_0 at the AVX-512 VNNI level: a prefill tile with the tokens
//! in the SIMD lanes and a decoding kernel, both following one arithmetic
//! (below), so a prompt's logits do not depend on how it is chunked.
//!
//! Why not ggml's arithmetic (`qgemm_q8_0`, which keeps it lane for lane):
//! ggml's per-block step costs a `vpdpbusd`, a scale product, an int → float
//! conversion and an `fma` for each (row, token, 32-weight block), so with
//! VNNI most of the work is float bookkeeping. Here one 256-bit register
//! holds 8 *tokens*, 4 activations each (the token tile is rearranged once
//! per matrix product, [`pack_acts`]: block by block, dword group `g` of the
//! 8 tokens side by side, each byte + 128 so `vpdpbusd` can take it as
//! unsigned), and each weight dword is broadcast from the row as it lies in
//! the memory map (no repacked copy). Per (row, block) that is 8 `vpdpbusd`
//! for 8 tokens and one float step for all 8 (`mul`, `cvt`, `fma`). The +128
//! is taken back exactly by starting each block's integer sum at
//! −128·Σ_block w ([`pack_side`], once per row block and product, with the
//! rows' f32 scales).
//!
//! The arithmetic (per row, token and block `b`; `w`, `y` the signed
//! quants, `dx`, `dy` the f16 scales as f32):
//!
//! ```text
//! isum_b = Σ_{i<32} w_i · y_i                                   (exact i32)
//! acc    = fma(dx·dy, f32(isum_b), acc)       (acc from 0, blocks in order)
//! ```
//!
//! [`dot_scalar`] models it; both kernels reproduce it bit for bit (the
//! integer sums are exact whichever way they are added; |isum| ≤ 32·128·127
//! < 2²⁴, so its conversion is exact too). It differs from ggml's (8 float
//! lanes per row summed at the end) by float rounding only.
//!
//! Decoding ([`decode_for`]): one token, 8 rows per call; per row and block
//! `vpdpbusd(|w|, sign(y, w))` (ggml's sign trick: exact, no correction),
//! the 8 rows' partial sums reduced into one register (lane = row) for the
//! same float steps.

use super::isa::{detected, Level};
use half::f16;

/// Weight rows per call (both kernels).
pub const ROWS: usize = 8;
/// Tokens per prefill call (the lanes of a register).
pub const TOKS: usize = 8;
/// Bytes of a Q8_0 block: `d` (f16), `qs[32]` (i8).
pub const Q8_0_BYTES: usize = 34;
/// Bytes of one block of a packed token tile ([`pack_acts`]): 8 dword
/// groups × 8 tokens (32 B each), then the 8 tokens' scales (f32).
pub const PACKED_ACT_BYTES: usize = 8 * 32 + 32;
/// Bytes of one block of a packed micro tile's side data ([`pack_side`]):
/// the 8 rows' scales (f32), then their corrections −128·Σw (i32).
pub const SIDE_BYTES: usize = 64;

/// A prefill tile: `(nb, 8 weight rows, their side data (nb ·
/// SIDE_BYTES), a packed token tile (nb · PACKED_ACT_BYTES)) ->
/// out[row][token]`.
pub type TileFn = fn(usize, &[&[u8]; ROWS], &[u8], &[u8]) -> [[f32; TOKS]; ROWS];

/// A decoding kernel: `(nb, 8 weight rows, one token's Q8_0 row) ->
/// out[row][0]` (the call shape of the other 1-token kernels).
pub type DecodeFn = fn(usize, &[&[u8]; ROWS], &[&[u8]; 1]) -> [[f32; 1]; ROWS];

#[inline]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

/// The scalar model: one weight row · one token's Q8_0 row, `nb` blocks.
pub fn dot_scalar(nb: usize, w: &[u8], y: &[u8]) -> f32 {
    assert!(
        w.len() >= nb * Q8_0_BYTES && y.len() >= nb * Q8_0_BYTES,
        "q8_0: row too short"
    );
    let mut acc = 0f32;
    for b in 0..nb {
        let (x, a) = (&w[b * Q8_0_BYTES..], &y[b * Q8_0_BYTES..]);
        let isum: i32 = (2..Q8_0_BYTES)
            .map(|i| x[i] as i8 as i32 * a[i] as i8 as i32)
            .sum();
        acc = (f16_at(x, 0) * f16_at(a, 0)).mul_add(isum as f32, acc);
    }
    acc
}

/// Rearrange 8 tokens' Q8_0 rows (`nb` blocks; repeat a token to pad) into
/// the prefill tile's form, `nb · PACKED_ACT_BYTES` bytes in `out`: per
/// block, for g in 0..8 the dwords `g` of tokens 0..8 (each byte + 128,
/// i.e. its sign bit flipped), then the tokens' scales as f32.
pub fn pack_acts(nb: usize, toks: &[&[u8]; TOKS], out: &mut [u8]) {
    assert!(
        toks.iter().all(|t| t.len() >= nb * Q8_0_BYTES),
        "q8_0: activation row too short"
    );
    assert!(
        out.len() >= nb * PACKED_ACT_BYTES,
        "q8_0: packed tile too short"
    );
    for b in 0..nb {
        let o = &mut out[b * PACKED_ACT_BYTES..(b + 1) * PACKED_ACT_BYTES];
        for (t, tok) in toks.iter().enumerate() {
            let y = &tok[b * Q8_0_BYTES..(b + 1) * Q8_0_BYTES];
            for g in 0..8 {
                let q = u32::from_le_bytes(y[2 + 4 * g..6 + 4 * g].try_into().unwrap());
                let at = g * 32 + t * 4;
                o[at..at + 4].copy_from_slice(&(q ^ 0x8080_8080).to_le_bytes());
            }
            let at = 256 + t * 4;
            o[at..at + 4].copy_from_slice(&f16_at(y, 0).to_le_bytes());
        }
    }
}

/// The side data of 8 weight rows (`nb` blocks), `nb · SIDE_BYTES` bytes in
/// `out`: per block the rows' scales as f32, then −128·Σ of each row's
/// block (the +128 of [`pack_acts`] taken back).
pub fn pack_side(nb: usize, rows: &[&[u8]; ROWS], out: &mut [u8]) {
    assert!(
        rows.iter().all(|r| r.len() >= nb * Q8_0_BYTES),
        "q8_0: weight row too short"
    );
    assert!(out.len() >= nb * SIDE_BYTES, "q8_0: side data too short");
    for b in 0..nb {
        let o = &mut out[b * SIDE_BYTES..(b + 1) * SIDE_BYTES];
        for (r, row) in rows.iter().enumerate() {
            let x = &row[b * Q8_0_BYTES..(b + 1) * Q8_0_BYTES];
            let s: i32 = x[2..].iter().map(|&q| q as i8 as i32).sum();
            o[4 * r..4 * r + 4].copy_from_slice(&f16_at(x, 0).to_le_bytes());
            o[32 + 4 * r..36 + 4 * r].copy_from_slice(&(-128 * s).to_le_bytes());
        }
    }
}

/// The prefill tile where the CPU runs it (level avx512vnni).
pub fn tile_for(level: Level) -> Option<TileFn> {
    #[cfg(target_arch = "x86_64")]
    if level.vnni() && level <= detected() {
        return Some(tile);
    }
    let _ = level;
    None
}

/// The decoding kernel where the CPU runs it (level avx512vnni).
pub fn decode_for(level: Level) -> Option<DecodeFn> {
    #[cfg(target_arch = "x86_64")]
    if level.vnni() && level <= detected() {
        return Some(decode);
    }
    let _ = level;
    None
}

#[cfg(target_arch = "x86_64")]
fn tile(nb: usize, rows: &[&[u8]; ROWS], side: &[u8], acts: &[u8]) -> [[f32; TOKS]; ROWS] {
    assert!(
        rows.iter().all(|r| r.len() >= nb * Q8_0_BYTES),
        "q8_0: weight row too short"
    );
    assert!(side.len() >= nb * SIDE_BYTES, "q8_0: side data too short");
    assert!(
        acts.len() >= nb * PACKED_ACT_BYTES,
        "q8_0: packed tile too short"
    );
    // SAFETY: handed out (tile_for) only where the CPU has AVX-512
    // F/BW/VL/VNNI (and AVX2, FMA); every buffer holds nb blocks (checked
    // just above), which bounds all loads.
    unsafe { tile_impl(nb, rows, side, acts) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn tile_impl(
    nb: usize,
    rows: &[&[u8]; ROWS],
    side: &[u8],
    acts: &[u8],
) -> [[f32; TOKS]; ROWS] {
    use std::arch::x86_64::*;
    let wp: [*const u8; ROWS] = std::array::from_fn(|r| rows[r].as_ptr());
    // per row: 8 tokens' float sums in the lanes
    let mut acc = [_mm256_setzero_ps(); ROWS];
    for b in 0..nb {
        // SAFETY (all loads below): b < nb and every buffer holds nb blocks.
        let a = unsafe { acts.as_ptr().add(b * PACKED_ACT_BYTES) };
        let s = unsafe { side.as_ptr().add(b * SIDE_BYTES) };
        // the token tile's 8 dword groups (unsigned) and scales
        let y: [__m256i; 8] =
            std::array::from_fn(|g| unsafe { _mm256_loadu_si256(a.add(32 * g).cast()) });
        let dy = unsafe { _mm256_loadu_ps(a.add(256).cast()) };
        // each row's sum starts at its correction −128·Σw
        let mut isum: [__m256i; ROWS] = std::array::from_fn(|r| unsafe {
            _mm256_set1_epi32(s.add(32 + 4 * r).cast::<i32>().read_unaligned())
        });
        // group by group, rows innermost: 8 independent chains
        for (g, yg) in y.iter().enumerate() {
            for r in 0..ROWS {
                let w = unsafe {
                    wp[r]
                        .add(b * Q8_0_BYTES + 2 + 4 * g)
                        .cast::<i32>()
                        .read_unaligned()
                };
                isum[r] = _mm256_dpbusd_epi32(isum[r], *yg, _mm256_set1_epi32(w));
            }
        }
        // acc = fma(dx·dy, f32(isum), acc) for 8 tokens at once
        for r in 0..ROWS {
            let dx = unsafe { s.add(4 * r).cast::<f32>().read_unaligned() };
            let d = _mm256_mul_ps(_mm256_set1_ps(dx), dy);
            acc[r] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(isum[r]), acc[r]);
        }
    }
    let mut out = [[0f32; TOKS]; ROWS];
    for r in 0..ROWS {
        // SAFETY: out[r] holds 8 floats.
        unsafe { _mm256_storeu_ps(out[r].as_mut_ptr(), acc[r]) };
    }
    out
}

#[cfg(target_arch = "x86_64")]
fn decode(nb: usize, rows: &[&[u8]; ROWS], y: &[&[u8]; 1]) -> [[f32; 1]; ROWS] {
    let y = y[0];
    assert!(
        rows.iter().all(|r| r.len() >= nb * Q8_0_BYTES),
        "q8_0: weight row too short"
    );
    assert!(y.len() >= nb * Q8_0_BYTES, "q8_0: activation row too short");
    // SAFETY: handed out (decode_for) only where the CPU has AVX-512
    // F/BW/VL/VNNI (and AVX2, FMA, F16C); every row holds nb blocks
    // (checked just above), which bounds all loads.
    unsafe { decode_impl(nb, rows, y) }.map(|v| [v])
}

/// Micro tiles ahead that decoding prefetches (into L2; `matvec_k` takes
/// them from a contiguous matrix): the rows are too short for the hardware
/// prefetcher to get going.
const PREFETCH_TILES: usize = 2;

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn decode_impl(nb: usize, rows: &[&[u8]; ROWS], y: &[u8]) -> [f32; ROWS] {
    use std::arch::x86_64::*;
    let wp: [*const u8; ROWS] = std::array::from_fn(|r| rows[r].as_ptr());
    let yp = y.as_ptr();
    let mut acc = _mm256_setzero_ps();
    for b in 0..nb {
        let off = b * Q8_0_BYTES;
        for p in &wp {
            // a prefetch never faults and reads nothing the program sees;
            // wrapping_add keeps the pointer's provenance
            _mm_prefetch::<_MM_HINT_T1>(
                p.wrapping_add(PREFETCH_TILES * ROWS * nb * Q8_0_BYTES + off)
                    .cast(),
            );
        }
        // SAFETY (all loads below): b < nb and every row holds nb blocks.
        let yq = unsafe { _mm256_loadu_si256(yp.add(off + 2).cast()) };
        let dy = f16::from_bits(unsafe { yp.add(off).cast::<u16>().read_unaligned() }).to_f32();
        // per row: 8 partial sums of 4 products, |w| · (y signed like w)
        let part: [__m256i; ROWS] = std::array::from_fn(|r| {
            let x = unsafe { _mm256_loadu_si256(wp[r].add(off + 2).cast()) };
            _mm256_dpbusd_epi32(
                _mm256_setzero_si256(),
                _mm256_abs_epi8(x),
                _mm256_sign_epi8(yq, x),
            )
        });
        // the rows' exact sums, lane r = row r: pairs, quads, halves
        let pair = |a: __m256i, b: __m256i| {
            _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b))
        };
        let quad = |a: __m256i, b: __m256i| {
            _mm256_add_epi32(_mm256_unpacklo_epi64(a, b), _mm256_unpackhi_epi64(a, b))
        };
        let q0 = quad(pair(part[0], part[1]), pair(part[2], part[3]));
        let q1 = quad(pair(part[4], part[5]), pair(part[6], part[7]));
        let isum = _mm256_add_epi32(
            _mm256_permute2x128_si256::<0x20>(q0, q1),
            _mm256_permute2x128_si256::<0x31>(q0, q1),
        );
        // the rows' scales in their lanes
        let dx: [u16; ROWS] =
            std::array::from_fn(|r| unsafe { wp[r].add(off).cast::<u16>().read_unaligned() });
        let dx = _mm256_cvtph_ps(unsafe { _mm_loadu_si128(dx.as_ptr().cast()) });
        let d = _mm256_mul_ps(dx, _mm256_set1_ps(dy));
        acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(isum), acc);
    }
    let mut out = [0f32; ROWS];
    // SAFETY: out holds 8 floats.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), acc) };
    out
}
