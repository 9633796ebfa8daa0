//! Quantized matrix-matrix microkernels for batched prefill: a tile of
//! `MR` weight rows × `NT` tokens per call, so each unpacked weight block is
//! used by `NT` tokens and each activation block by `MR` rows (ggml's
//! `vec_dot` does one row × one token per call and repeats both).
//!
//! Q4_1 × Q8_1 (ggml block layouts, unchanged): per (row, token) the
//! arithmetic is exactly that of ggml's x86 `ggml_vec_dot_q4_1_q8_1`, lane
//! for lane: per block, 8 i32 lanes of 4 adjacent u8·i8 products, converted
//! to f32 and accumulated as `acc = fma(dw·da, xy, acc)`; the offsets as a
//! sequential f32 `summs = fma(m, s, summs)`; result `hsum(acc) + summs`.
//! So the tile reproduces `vec_dot` bit for bit (tests/engine/kernels.rs).
//! [`tile_q4_1_q8_1_scalar`] is the scalar model of that arithmetic.

use half::f16;

/// Weight rows per tile.
pub const MR: usize = 4;
/// Tokens per tile.
pub const NT: usize = 4;

/// Bytes of a Q4_1 block: `d: f16`, `m: f16`, `qs[16]`.
const Q4_1_BYTES: usize = 20;
/// Bytes of a Q8_1 block: `d: f16`, `s: f16`, `qs[32]: i8`.
const Q8_1_BYTES: usize = 36;

#[inline]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

/// The f32 block scales of a tile: `d[b * 4 + k]` and `o[b * 4 + k]` are
/// block b's scale and offset term of member k (row or token) of the tile;
/// (n_blocks * 4,) each. For Q4_1 rows `o` is `m`; for Q8_1 tokens it is `s`.
#[derive(Debug, Clone, Default)]
pub struct TileScales {
    pub d: Vec<f32>,
    pub o: Vec<f32>,
}

impl TileScales {
    /// Gather the scales of up to 4 rows of `nb` blocks of `block` bytes
    /// each (`d` at byte 0, the offset term at byte 2); missing members
    /// (fewer than 4 rows) get zeros.
    pub fn fill(&mut self, rows: &[&[u8]], nb: usize, block: usize) {
        assert!(rows.len() <= 4);
        self.d.clear();
        self.d.resize(nb * 4, 0.0);
        self.o.clear();
        self.o.resize(nb * 4, 0.0);
        for (k, r) in rows.iter().enumerate() {
            assert!(r.len() >= nb * block, "tile row too short");
            for b in 0..nb {
                self.d[b * 4 + k] = f16_at(r, b * block);
                self.o[b * 4 + k] = f16_at(r, b * block + 2);
            }
        }
    }

    /// Scales of up to 4 Q4_1 weight rows (`d`, `m`).
    pub fn q4_1(&mut self, rows: &[&[u8]], nb: usize) {
        self.fill(rows, nb, Q4_1_BYTES);
    }

    /// Scales of up to 4 Q8_1 activation rows (`d`, `s`).
    pub fn q8_1(&mut self, rows: &[&[u8]], nb: usize) {
        self.fill(rows, nb, Q8_1_BYTES);
    }
}

/// A tile kernel: `(nb, w rows, w scales, act rows, act scales) -> out[r][t]`.
pub type TileFn =
    fn(usize, &[&[u8]; MR], &TileScales, &[&[u8]; NT], &TileScales) -> [[f32; NT]; MR];

/// Weight rows of the Q4_1 decoding kernel.
pub const DECODE_ROWS: usize = 8;

/// A Q4_1 decoding kernel: `(nb, 8 weight rows, one Q8_1 token) ->
/// out[r][0]`, [`super::matmul`]'s `matvec_k` shape.
pub type DecodeFn = fn(usize, &[&[u8]; DECODE_ROWS], &[&[u8]; 1]) -> [[f32; 1]; DECODE_ROWS];

/// The Q4_1 × Q8_1 decoding kernel (one token, 8 rows) at the AVX-512
/// VNNI levels where this CPU runs them; elsewhere decoding runs ggml's
/// `vec_dot` row by row, which this equals bit for bit.
pub fn q4_1_decode_for(level: super::isa::Level) -> Option<DecodeFn> {
    #[cfg(target_arch = "x86_64")]
    if level.vnni() && level <= super::isa::detected() {
        return Some(decode_q4_1_vnni);
    }
    let _ = level;
    None
}

#[cfg(target_arch = "x86_64")]
fn decode_q4_1_vnni(
    nb: usize,
    w: &[&[u8]; DECODE_ROWS],
    a: &[&[u8]; 1],
) -> [[f32; 1]; DECODE_ROWS] {
    assert!(
        w.iter().all(|r| r.len() >= nb * Q4_1_BYTES) && a[0].len() >= nb * Q8_1_BYTES,
        "q4_1 decode: short rows"
    );
    // SAFETY: handed out (q4_1_decode_for) only where the CPU has AVX-512
    // F/BW/VL/VNNI, AVX2 and FMA; the lengths checked above bound every load.
    unsafe { decode_q4_1_impl(nb, w, a[0]) }
}

/// One token against 8 Q4_1 rows, ggml's `vec_dot` lane for lane: a 512-bit
/// register holds rows 2k and 2k + 1, each in 8 lanes of 4 adjacent
/// products (`vpdpbusd`, the same exact lane sums as ggml's `maddubs` +
/// `madd`), converted and accumulated by `fma(dw·da, xy, acc)` block after
/// block; the offsets `fma(m, s, summs)` with the 8 rows in lanes; then
/// ggml's `hsum_float_8` per row and `+ summs`.
///
/// Per block, the 8 rows' `(d, m)` come in one gather and one conversion
/// (not 16 scalar ones), and each row's 16 bytes of nibbles are unpacked
/// by one variable shift of a doubled copy. The rows are 8 separate
/// streams of 20-byte blocks, which the hardware prefetcher does not keep
/// ahead of: each block prefetches the same block of the rows two calls
/// on into L2, as the K-quant decoding kernels do. On a 2-core Zen 4 VM
/// that took SmolLM2-135M's decoding from 130 t/s (distance 0: the block
/// being read) to 218 (`kvrun bench --no-llama -t 2 -r 3 -p 0 -n 128`;
/// one call ahead 216, four 224).
///
/// # Safety
/// AVX-512 F/BW/VL/VNNI, AVX2, FMA; every row holds `nb` Q4_1 blocks and
/// `y` `nb` Q8_1 blocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn decode_q4_1_impl(
    nb: usize,
    w: &[&[u8]; DECODE_ROWS],
    y: &[u8],
) -> [[f32; 1]; DECODE_ROWS] {
    use std::arch::x86_64::*;
    const PAIRS: usize = DECODE_ROWS / 2;
    // SAFETY (every load): b < nb; the contract.
    unsafe {
        let wp: [*const u8; DECODE_ROWS] = std::array::from_fn(|r| w[r].as_ptr());
        // the rows' byte offsets from row 0, for one gather of the 8 rows'
        // block heads (d, m) per block (rows of one matrix: far below 2 GiB
        // apart; checked, else the scalar heads)
        let offs: [isize; DECODE_ROWS] = std::array::from_fn(|r| wp[r] as isize - wp[0] as isize);
        let gather = offs.iter().all(|&o| i32::try_from(o).is_ok());
        let idx = _mm256_loadu_si256(offs.map(|o| o as i32).as_ptr().cast());
        let low = _mm512_set1_epi8(0x0f);
        // 16-bit shift counts: 128-bit lanes 1 and 3 (a row's second copy)
        // take the high nibbles
        let nib_shift = _mm512_setr_epi64(
            0,
            0,
            0x0004_0004_0004_0004,
            0x0004_0004_0004_0004,
            0,
            0,
            0x0004_0004_0004_0004,
            0x0004_0004_0004_0004,
        );
        // rows 2k, 2k + 1 of the 8 per-row scales, each across a 256-bit half
        let pick: [__m512i; PAIRS] = std::array::from_fn(|k| {
            _mm512_inserti64x4(
                _mm512_set1_epi32(2 * k as i32),
                _mm256_set1_epi32(2 * k as i32 + 1),
                1,
            )
        });
        let f16 = |p: *const u8| {
            _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(
                p.cast::<u16>().read_unaligned() as i32,
            )))
        };
        let mut acc = [_mm512_setzero_ps(); PAIRS];
        let mut summs = _mm256_setzero_ps();
        // the same block of the rows two calls on (a contiguous matrix's
        // next rows), into L2, as the K-quant decoding kernels do
        let ahead = 2 * DECODE_ROWS * nb * Q4_1_BYTES;
        for b in 0..nb {
            let yb = y.as_ptr().add(b * Q8_1_BYTES);
            let (dy, sy) = (f16(yb), f16(yb.add(2)));
            let qa = _mm512_broadcast_i64x4(_mm256_loadu_si256(yb.add(4).cast()));
            let x: [*const u8; DECODE_ROWS] = std::array::from_fn(|r| wp[r].add(b * Q4_1_BYTES));
            for p in x {
                // every line holds a block's start, so this touches each
                _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(ahead).cast());
            }
            // the 8 rows' (d, m) as f16 pairs, row r in dword r
            let heads = if gather {
                _mm256_i32gather_epi32::<1>(x[0].cast(), idx)
            } else {
                _mm256_setr_epi32(
                    x[0].cast::<i32>().read_unaligned(),
                    x[1].cast::<i32>().read_unaligned(),
                    x[2].cast::<i32>().read_unaligned(),
                    x[3].cast::<i32>().read_unaligned(),
                    x[4].cast::<i32>().read_unaligned(),
                    x[5].cast::<i32>().read_unaligned(),
                    x[6].cast::<i32>().read_unaligned(),
                    x[7].cast::<i32>().read_unaligned(),
                )
            };
            let dx = _mm256_cvtph_ps(_mm256_cvtepi32_epi16(heads));
            let mx = _mm256_cvtph_ps(_mm256_cvtepi32_epi16(_mm256_srli_epi32(heads, 16)));
            summs = _mm256_fmadd_ps(mx, _mm256_set1_ps(sy), summs);
            // dx·dy per row, as ggml's scalar product
            let dd = _mm512_castps256_ps512(_mm256_mul_ps(dx, _mm256_set1_ps(dy)));
            for (k, acc) in acc.iter_mut().enumerate() {
                // rows 2k, 2k + 1: 16 bytes of nibbles each, copied to both
                // 128-bit lanes of its half; the second copy shifted -> low
                // nibbles, then high nibbles, as ggml unpacks them
                let q = |r: usize| _mm256_broadcastsi128_si256(_mm_loadu_si128(x[r].add(4).cast()));
                let qw = _mm512_and_si512(
                    _mm512_srlv_epi16(
                        _mm512_inserti64x4(_mm512_castsi256_si512(q(2 * k)), q(2 * k + 1), 1),
                        nib_shift,
                    ),
                    low,
                );
                let xy = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), qw, qa));
                let d = _mm512_permutexvar_ps(pick[k], dd);
                *acc = _mm512_fmadd_ps(d, xy, *acc);
            }
        }
        let mut sm = [0f32; DECODE_ROWS];
        _mm256_storeu_ps(sm.as_mut_ptr(), summs);
        let mut out = [[0f32; 1]; DECODE_ROWS];
        for r in 0..DECODE_ROWS {
            let v = acc[r / 2];
            let x = if r % 2 == 0 {
                _mm512_castps512_ps256(v)
            } else {
                _mm512_extractf32x8_ps(v, 1)
            };
            // ggml's hsum_float_8
            let mut h = _mm_add_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
            h = _mm_add_ps(h, _mm_movehl_ps(h, h));
            h = _mm_add_ss(h, _mm_movehdup_ps(h));
            out[r][0] = _mm_cvtss_f32(h) + sm[r];
        }
        out
    }
}

/// The Q4_1 × Q8_1 tile kernel of SIMD level `level`, if this CPU runs it
/// (AVX-512 VNNI: `vpdpbusd`; AVX2 and plain AVX-512: `vpmaddubsw` +
/// `vpmaddwd`, as ggml's AVX2 `vec_dot`). Both produce the same integer
/// block sums, so both are bit-identical to ggml. `None` below AVX2, where
/// ggml's row-by-row `vec_dot` runs.
pub fn q4_1_tile_for(level: super::isa::Level) -> Option<TileFn> {
    #[cfg(target_arch = "x86_64")]
    {
        use super::isa::{detected, Level};
        if level <= detected() {
            match level {
                Level::Avx512Vnni | Level::Amx => return Some(tile_q4_1_q8_1_vnni),
                Level::Avx2 | Level::Avx512 => return Some(tile_q4_1_q8_1_avx2),
                Level::Portable => {}
            }
        }
    }
    let _ = level;
    None
}

fn check_tile(nb: usize, w: &[&[u8]; MR], ws: &TileScales, a: &[&[u8]; NT], as_: &TileScales) {
    assert!(
        w.iter().all(|r| r.len() >= nb * Q4_1_BYTES),
        "tile: weight row too short"
    );
    assert!(
        a.iter().all(|r| r.len() >= nb * Q8_1_BYTES),
        "tile: activation row too short"
    );
    assert!(
        ws.d.len() >= nb * 4 && ws.o.len() >= nb * 4,
        "tile: weight scales too short"
    );
    assert!(
        as_.d.len() >= nb * 4 && as_.o.len() >= nb * 4,
        "tile: act scales too short"
    );
}

/// Scalar model of the tile: out[r][t] = Σ_b (dw·da)·Σ qw·qa + m·s with
/// ggml's lane structure and summation order (see the module doc).
pub fn tile_q4_1_q8_1_scalar(
    nb: usize,
    w: &[&[u8]; MR],
    ws: &TileScales,
    a: &[&[u8]; NT],
    as_: &TileScales,
) -> [[f32; NT]; MR] {
    check_tile(nb, w, ws, a, as_);
    let mut out = [[0f32; NT]; MR];
    for r in 0..MR {
        for t in 0..NT {
            let mut acc = [0f32; 8];
            let mut summs = 0f32;
            for b in 0..nb {
                let qs = &w[r][b * Q4_1_BYTES + 4..b * Q4_1_BYTES + 20];
                let qa = &a[t][b * Q8_1_BYTES + 4..b * Q8_1_BYTES + 36];
                let d = ws.d[b * 4 + r] * as_.d[b * 4 + t];
                summs = ws.o[b * 4 + r].mul_add(as_.o[b * 4 + t], summs);
                for (l, x) in acc.iter_mut().enumerate() {
                    let mut p = 0i32;
                    for j in 4 * l..4 * l + 4 {
                        let q = if j < 16 {
                            qs[j] & 0x0f
                        } else {
                            qs[j - 16] >> 4
                        };
                        p += q as i32 * qa[j] as i8 as i32;
                    }
                    *x = d.mul_add(p as f32, *x);
                }
            }
            // ggml's hsum_float_8: halves, then pairs, then the last two
            let h: [f32; 4] = std::array::from_fn(|i| acc[4 + i] + acc[i]);
            let (p0, p1) = (h[0] + h[2], h[1] + h[3]);
            out[r][t] = (p0 + p1) + summs;
        }
    }
    out
}

/// AVX-512 VNNI tile (256-bit lanes, as ggml's kernel, 32 registers).
#[cfg(target_arch = "x86_64")]
fn tile_q4_1_q8_1_vnni(
    nb: usize,
    w: &[&[u8]; MR],
    ws: &TileScales,
    a: &[&[u8]; NT],
    as_: &TileScales,
) -> [[f32; NT]; MR] {
    check_tile(nb, w, ws, a, as_);
    // SAFETY: q4_1_q8_1_tile hands this function out only after detecting
    // avx512f/vl/vnni and fma; every row and scale array holds nb blocks
    // (checked just above), which bounds all loads of the kernel.
    unsafe { tile_vnni_impl(nb, w, ws, a, as_) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,avx512f,avx512vl,avx512vnni")]
unsafe fn tile_vnni_impl(
    nb: usize,
    w: &[&[u8]; MR],
    ws: &TileScales,
    a: &[&[u8]; NT],
    as_: &TileScales,
) -> [[f32; NT]; MR] {
    use std::arch::x86_64::*;
    let wp: [*const u8; MR] = std::array::from_fn(|r| w[r].as_ptr());
    let ap: [*const u8; NT] = std::array::from_fn(|t| a[t].as_ptr());
    let (wd, wm, ad, asum) = (ws.d.as_ptr(), ws.o.as_ptr(), as_.d.as_ptr(), as_.o.as_ptr());
    let mut acc = [[_mm256_setzero_ps(); NT]; MR];
    // summs of (r, t) in lane r*4 + t
    let mut summs = _mm512_setzero_ps();
    let ridx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    let low = _mm256_set1_epi8(0x0f);
    // dw·da of (r, t) in lane r*4 + t, for CHUNK blocks at a time
    const CHUNK: usize = 32;
    // (uninitialized: every lane read below was written first in its chunk)
    let mut dd = std::mem::MaybeUninit::<[f32; CHUNK * 16]>::uninit();
    let ddp = dd.as_mut_ptr().cast::<f32>();
    for b0 in (0..nb).step_by(CHUNK) {
        let nc = CHUNK.min(nb - b0);
        for c in 0..nc {
            let b = b0 + c;
            // SAFETY (all loads below): b < nb, and every row holds nb blocks and
            // every scale array nb * 4 floats (check_tile); c < CHUNK.
            let (d4, a4) = unsafe { (_mm_loadu_ps(wd.add(b * 4)), _mm_loadu_ps(ad.add(b * 4))) };
            let dv = _mm512_permutexvar_ps(ridx, _mm512_castps128_ps512(d4));
            let prod = _mm512_mul_ps(dv, _mm512_broadcast_f32x4(a4));
            // offsets: m[r] in lanes r*4.., s[t] in lanes ..+t
            let (m4, s4) = unsafe { (_mm_loadu_ps(wm.add(b * 4)), _mm_loadu_ps(asum.add(b * 4))) };
            let mv = _mm512_permutexvar_ps(ridx, _mm512_castps128_ps512(m4));
            summs = _mm512_fmadd_ps(mv, _mm512_broadcast_f32x4(s4), summs);
            unsafe { _mm512_storeu_ps(ddp.add(c * 16), prod) };
        }
        for c in 0..nc {
            let b = b0 + c;
            // weights: 16 bytes of nibbles -> 32 u8 (low nibbles, then high)
            let qw: [__m256i; MR] = std::array::from_fn(|r| {
                let x = unsafe { _mm_loadu_si128(wp[r].add(b * Q4_1_BYTES + 4).cast()) };
                let xx = _mm256_set_m128i(_mm_srli_epi16(x, 4), x);
                _mm256_and_si256(xx, low)
            });
            for t in 0..NT {
                let qa = unsafe { _mm256_loadu_si256(ap[t].add(b * Q8_1_BYTES + 4).cast()) };
                for r in 0..MR {
                    let p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), qw[r], qa);
                    let xy = _mm256_cvtepi32_ps(p);
                    let d = unsafe { _mm256_set1_ps(*ddp.add(c * 16 + r * 4 + t)) };
                    acc[r][t] = _mm256_fmadd_ps(d, xy, acc[r][t]);
                }
            }
        }
    }
    let mut sm = [0f32; 16];
    // SAFETY: sm holds 16 floats.
    unsafe { _mm512_storeu_ps(sm.as_mut_ptr(), summs) };
    let mut out = [[0f32; NT]; MR];
    for r in 0..MR {
        for t in 0..NT {
            // ggml's hsum_float_8
            let x = acc[r][t];
            let mut h = _mm_add_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
            h = _mm_add_ps(h, _mm_movehl_ps(h, h));
            h = _mm_add_ss(h, _mm_movehdup_ps(h));
            out[r][t] = _mm_cvtss_f32(h) + sm[r * 4 + t];
        }
    }
    out
}

/// AVX2 tile (16 registers): the 4 × 4 tile as two passes of 2 weight rows ×
/// 4 tokens, so a pass's 8 accumulators stay in registers; the activations
/// are read once per pass (from L1).
#[cfg(target_arch = "x86_64")]
fn tile_q4_1_q8_1_avx2(
    nb: usize,
    w: &[&[u8]; MR],
    ws: &TileScales,
    a: &[&[u8]; NT],
    as_: &TileScales,
) -> [[f32; NT]; MR] {
    check_tile(nb, w, ws, a, as_);
    // SAFETY: q4_1_tile_for hands this function out only after detecting
    // avx2, fma and f16c; every row and scale array holds nb blocks
    // (checked just above), which bounds all loads of the kernel.
    unsafe { tile_avx2_impl(nb, w, ws, a, as_) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile_avx2_impl(
    nb: usize,
    w: &[&[u8]; MR],
    ws: &TileScales,
    a: &[&[u8]; NT],
    as_: &TileScales,
) -> [[f32; NT]; MR] {
    use std::arch::x86_64::*;
    let ap: [*const u8; NT] = std::array::from_fn(|t| a[t].as_ptr());
    let (wd, wm, ad, asum) = (ws.d.as_ptr(), ws.o.as_ptr(), as_.d.as_ptr(), as_.o.as_ptr());
    let low = _mm256_set1_epi8(0x0f);
    let ones = _mm256_set1_epi16(1);
    // lanes 0-3 take row r0's scale, lanes 4-7 row r0 + 1's
    let (pick0, pick1) = (
        _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0),
        _mm256_set_epi32(3, 3, 3, 3, 2, 2, 2, 2),
    );
    let mut out = [[0f32; NT]; MR];
    for (rp, pick) in [(0usize, pick0), (2, pick1)] {
        let wp = [w[rp].as_ptr(), w[rp + 1].as_ptr()];
        let mut acc = [[_mm256_setzero_ps(); NT]; 2];
        // m·s of (r, t) in lane (r - rp)*4 + t: one fma per block, as ggml
        let mut summs = _mm256_setzero_ps();
        let mut dd = [0f32; 8];
        for b in 0..nb {
            // SAFETY (all loads below): b < nb, and every row holds nb blocks
            // and every scale array nb * 4 floats (check_tile).
            let (d4, a4, m4, s4) = unsafe {
                (
                    _mm_loadu_ps(wd.add(b * 4)),
                    _mm_loadu_ps(ad.add(b * 4)),
                    _mm_loadu_ps(wm.add(b * 4)),
                    _mm_loadu_ps(asum.add(b * 4)),
                )
            };
            let dv = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(d4), pick);
            let mv = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(m4), pick);
            let av = _mm256_set_m128(a4, a4);
            let sv = _mm256_set_m128(s4, s4);
            summs = _mm256_fmadd_ps(mv, sv, summs);
            // SAFETY: dd holds 8 floats.
            unsafe { _mm256_storeu_ps(dd.as_mut_ptr(), _mm256_mul_ps(dv, av)) };
            // weights: 16 bytes of nibbles -> 32 u8 (low nibbles, then high)
            let qw: [__m256i; 2] = std::array::from_fn(|r| {
                let x = unsafe { _mm_loadu_si128(wp[r].add(b * Q4_1_BYTES + 4).cast()) };
                let xx = _mm256_set_m128i(_mm_srli_epi16(x, 4), x);
                _mm256_and_si256(xx, low)
            });
            for t in 0..NT {
                let qa = unsafe { _mm256_loadu_si256(ap[t].add(b * Q8_1_BYTES + 4).cast()) };
                for r in 0..2 {
                    // u8·i8 pairs to i16 (no saturation: |15·128·2| < 2^15),
                    // then pairs of those to i32: ggml's 4-product lanes
                    let p = _mm256_madd_epi16(_mm256_maddubs_epi16(qw[r], qa), ones);
                    let xy = _mm256_cvtepi32_ps(p);
                    let d = _mm256_set1_ps(dd[r * 4 + t]);
                    acc[r][t] = _mm256_fmadd_ps(d, xy, acc[r][t]);
                }
            }
        }
        let mut sm = [0f32; 8];
        // SAFETY: sm holds 8 floats.
        unsafe { _mm256_storeu_ps(sm.as_mut_ptr(), summs) };
        for r in 0..2 {
            for t in 0..NT {
                // ggml's hsum_float_8
                let x = acc[r][t];
                let mut h = _mm_add_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
                h = _mm_add_ps(h, _mm_movehl_ps(h, h));
                h = _mm_add_ss(h, _mm_movehdup_ps(h));
                out[rp + r][t] = _mm_cvtss_f32(h) + sm[r * 4 + t];
            }
        }
    }
    out
}
