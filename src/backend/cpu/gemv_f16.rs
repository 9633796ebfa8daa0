//! y = W x + b for a small matrix W (n_out, n_in) of f16 weights, an f32
//! input x and f32 biases b: the retention gates' MLP, run once per layer
//! for every decoded token. Such a matrix is too small for the matmul
//! machinery (no activation quantization, no tiles, no threads) and the
//! time goes into reading the weights, so each kernel streams four rows at
//! once against one load of x and reduces each row once at its end.
//!
//! Weights widen to f32 exactly and every product and sum is in f32; the
//! kernels differ only in the order of the sums: the portable loop adds
//! each row front to back, AVX2 in 8 lanes and AVX-512 in 16 lanes, each
//! then summed across its lanes (the tail past the last whole vector goes
//! into the lanes too, masked at AVX-512, after the reduction at AVX2).

use super::isa::{self, Level};
use half::f16;

/// y (n_out,) = W x + b with W (n_out, n_in) row-major, at this process's
/// SIMD level (`isa::level()`).
pub fn gemv_f16(w: &[f16], n_in: usize, x: &[f32], b: &[f32], y: &mut [f32]) {
    gemv_f16_at(isa::level(), w, n_in, x, b, y)
}

/// [`gemv_f16`] with the kernel of SIMD level `level` (a level the CPU
/// lacks falls back to the best below it).
pub fn gemv_f16_at(level: Level, w: &[f16], n_in: usize, x: &[f32], b: &[f32], y: &mut [f32]) {
    let n_out = y.len();
    assert!(
        w.len() >= n_out * n_in && x.len() >= n_in && b.len() >= n_out,
        "gemv_f16: {} weights, {} inputs, {} biases for {n_out}x{n_in}",
        w.len(),
        x.len(),
        b.len()
    );
    #[cfg(target_arch = "x86_64")]
    {
        let level = level.min(isa::detected());
        if level >= Level::Avx512 {
            // SAFETY (both): the CPU has AVX-512 F/BW/VL (detected); the
            // kernel checks its slices.
            let four = |r: &[f16]| unsafe { rows_avx512::<ROWS>(r, n_in, x) };
            let one = |r: &[f16]| unsafe { rows_avx512::<1>(r, n_in, x) };
            return by_blocks(w, n_in, b, y, four, one);
        }
        if level >= Level::Avx2 {
            // SAFETY (both): the CPU has AVX2, FMA and F16C (the Avx2
            // level requires all three); the kernel checks its slices.
            let four = |r: &[f16]| unsafe { rows_avx2::<ROWS>(r, n_in, x) };
            let one = |r: &[f16]| unsafe { rows_avx2::<1>(r, n_in, x) };
            return by_blocks(w, n_in, b, y, four, one);
        }
    }
    let _ = level;
    gemv_f16_scalar(w, n_in, x, b, y)
}

/// The scalar reference: each row summed front to back in f32.
pub fn gemv_f16_scalar(w: &[f16], n_in: usize, x: &[f32], b: &[f32], y: &mut [f32]) {
    for (r, (o, &bias)) in y.iter_mut().zip(b).enumerate() {
        let row = &w[r * n_in..(r + 1) * n_in];
        let mut s = 0f32;
        for (&wv, &xv) in row.iter().zip(&x[..n_in]) {
            s += widen(wv) * xv;
        }
        *o = s + bias;
    }
}

/// f16 → f32, exactly, in plain integer and float steps the compiler can
/// inline and vectorize (`half`'s conversion asks at every call whether
/// the CPU has F16C, which made the loop above 70 times slower than the
/// SIMD kernels): a normal number moves its exponent from bias 15 to bias
/// 127 and its mantissa into the top of f32's; a subnormal is its
/// mantissa times 2⁻²⁴ (both exact in f32); infinities and NaNs keep an
/// all-ones exponent and their mantissa.
#[inline(always)]
fn widen(h: f16) -> f32 {
    let bits = h.to_bits() as u32;
    let (sign, e, m) = ((bits & 0x8000) << 16, (bits >> 10) & 0x1f, bits & 0x3ff);
    let magnitude = match e {
        0 => m as f32 * f32::from_bits((127 - 24) << 23),
        // a NaN comes out quiet, as F16C's conversion makes it
        0x1f if m != 0 => f32::from_bits(0x7fc0_0000 | m << 13),
        0x1f => f32::INFINITY,
        _ => f32::from_bits((e + 127 - 15) << 23 | m << 13),
    };
    f32::from_bits(magnitude.to_bits() | sign)
}

/// Rows streamed together.
const ROWS: usize = 4;

/// Blocks of `ROWS` rows ahead of the one being summed whose weights are
/// prefetched. The gates' weights are cold at every decoded token (the
/// model's own weights have streamed through the caches since), and the
/// hardware prefetcher alone left the SmolLM2 gates at 395 µs a token on
/// one thread (62 µs when hot); asking for the next blocks brought that
/// to 226 µs (2 blocks ahead; 1: 249, 4: 236).
const AHEAD: usize = 2;

/// Prefetch the cache lines of rows `r0..r1` (clamped to the matrix) of
/// `w` (rows of `n_in` values).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_rows(w: &[f16], n_in: usize, r0: usize, r1: usize) {
    use std::arch::x86_64::*;
    let (a, b) = ((r0 * n_in).min(w.len()), (r1 * n_in).min(w.len()));
    let p = w.as_ptr().cast::<u8>();
    let mut o = a * 2;
    while o < b * 2 {
        // SAFETY: a prefetch is a hint: it never faults and writes nothing;
        // the address is inside w (o < 2 · w.len() bytes).
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p.add(o).cast()) };
        o += 64;
    }
}

/// y = W x + b by blocks of `ROWS` rows (`four` sums a block's rows, `one`
/// a single row for the last n_out mod 4), the blocks `AHEAD` of the one
/// being summed prefetched.
#[cfg(target_arch = "x86_64")]
fn by_blocks(
    w: &[f16],
    n_in: usize,
    b: &[f32],
    y: &mut [f32],
    four: impl Fn(&[f16]) -> [f32; ROWS],
    one: impl Fn(&[f16]) -> [f32; 1],
) {
    let n_out = y.len();
    let mut r = 0;
    prefetch_rows(w, n_in, 0, AHEAD * ROWS);
    while r + ROWS <= n_out {
        prefetch_rows(w, n_in, r + AHEAD * ROWS, r + (AHEAD + 1) * ROWS);
        let s = four(&w[r * n_in..(r + ROWS) * n_in]);
        for k in 0..ROWS {
            y[r + k] = s[k] + b[r + k];
        }
        r += ROWS;
    }
    for r in r..n_out {
        y[r] = one(&w[r * n_in..(r + 1) * n_in])[0] + b[r];
    }
}

/// Σ_c w[k, c] · x[c] for the R rows of `w` (R, n_in), 16 lanes each.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn rows_avx512<const R: usize>(w: &[f16], n_in: usize, x: &[f32]) -> [f32; R] {
    use std::arch::x86_64::*;
    assert!(w.len() >= R * n_in && x.len() >= n_in);
    let (wp, xp) = (w.as_ptr().cast::<u16>(), x.as_ptr());
    let mut acc = [_mm512_setzero_ps(); R];
    let full = n_in / 16 * 16;
    let mut c = 0;
    while c < full {
        // SAFETY: c + 16 ≤ n_in, so the 16 values at c of x and of each
        // row are inside the slices (asserted above).
        unsafe {
            let xv = _mm512_loadu_ps(xp.add(c));
            for (k, a) in acc.iter_mut().enumerate() {
                let wv = _mm512_cvtph_ps(_mm256_loadu_si256(wp.add(k * n_in + c).cast()));
                *a = _mm512_fmadd_ps(wv, xv, *a);
            }
        }
        c += 16;
    }
    if c < n_in {
        let m: __mmask16 = (1u16 << (n_in - c)) - 1;
        // SAFETY: the mask covers the n_in − c < 16 values left, all inside
        // the slices; masked-off lanes are not read.
        unsafe {
            let xv = _mm512_maskz_loadu_ps(m, xp.add(c));
            for (k, a) in acc.iter_mut().enumerate() {
                let wv = _mm256_maskz_loadu_epi16(m, wp.add(k * n_in + c).cast());
                *a = _mm512_fmadd_ps(_mm512_cvtph_ps(wv), xv, *a);
            }
        }
    }
    acc.map(|a| _mm512_reduce_add_ps(a))
}

/// Σ_c w[k, c] · x[c] for the R rows of `w` (R, n_in), 8 lanes each; the
/// values past the last whole 8 are added after the lanes are summed.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_avx2<const R: usize>(w: &[f16], n_in: usize, x: &[f32]) -> [f32; R] {
    use std::arch::x86_64::*;
    assert!(w.len() >= R * n_in && x.len() >= n_in);
    let (wp, xp) = (w.as_ptr().cast::<u16>(), x.as_ptr());
    let mut acc = [_mm256_setzero_ps(); R];
    let full = n_in / 8 * 8;
    let mut c = 0;
    while c < full {
        // SAFETY: c + 8 ≤ n_in, so the 8 values at c of x and of each row
        // are inside the slices (asserted above).
        unsafe {
            let xv = _mm256_loadu_ps(xp.add(c));
            for (k, a) in acc.iter_mut().enumerate() {
                let wv = _mm256_cvtph_ps(_mm_loadu_si128(wp.add(k * n_in + c).cast()));
                *a = _mm256_fmadd_ps(wv, xv, *a);
            }
        }
        c += 8;
    }
    let mut out = [0f32; R];
    for (k, (o, a)) in out.iter_mut().zip(acc).enumerate() {
        // lanes: (0+4, 1+5, 2+6, 3+7), then pairs, then the last two
        let q = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
        let q = _mm_add_ps(q, _mm_movehl_ps(q, q));
        let q = _mm_add_ss(q, _mm_shuffle_ps::<1>(q, q));
        let mut s = _mm_cvtss_f32(q);
        for cc in full..n_in {
            s += widen(w[k * n_in + cc]) * x[cc];
        }
        *o = s;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `widen` equals `half`'s conversion on every f16 bit pattern.
    #[test]
    fn widen_is_exact_on_every_f16() {
        for bits in 0..=u16::MAX {
            let h = f16::from_bits(bits);
            assert_eq!(widen(h).to_bits(), h.to_f32().to_bits(), "{bits:#06x}");
        }
    }
}
