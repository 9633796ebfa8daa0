//! AVX-512 decode attention (`cpu::attend_group_probs_seg`'s fast path):
//! the `G` query heads of one KV head over `n` cached rows, in three passes
//! like the portable kernel, with
//!
//! - scores: each key row loaded once (f16 rows widened in registers with
//!   `vcvtph2ps`, no temp buffer) and dotted with all G queries held in
//!   registers; 16 keys' partial-sum vectors are reduced together by a
//!   transpose-add tree, so a score costs no horizontal sum of its own;
//! - weights: a 16-lane `exp` ([`exp16`]: range reduction to |r| ≤ ln2/2, a
//!   degree-7 polynomial, `vscalefps` for the power of two) instead of
//!   libm's scalar `expf`;
//! - value sum: each value row loaded once, G × head_dim/16 accumulators in
//!   registers.
//!
//! Summation order differs from the portable loops (fma, 16 lanes), so the
//! results agree to float rounding, not bit for bit (tests/engine/kernels.rs). The
//! choice between the two is made per CPU, never per call site, so every
//! run on one machine uses one kernel.

use super::kv_store::KvRow;

/// Whether this CPU can run the fast path (whatever `KVRUN_CPU` says: the
/// kernel tests run it wherever it can run).
pub fn available() -> bool {
    super::isa::detected() >= super::isa::Level::Avx512
}

/// Whether decoding takes the fast path in this process (the CPU has it and
/// `KVRUN_CPU` allows it).
pub fn enabled() -> bool {
    super::isa::at_least(super::isa::Level::Avx512)
}

/// Whether the fast path handles `g` heads of `hd` dimensions.
pub fn supports(g: usize, hd: usize) -> bool {
    (1..=8).contains(&g) && matches!(hd, 32 | 64 | 128 | 256)
}

// exp(x) = 2^k · exp(r), k = round(x / ln2), r = x − k·ln2 (ln2 split in a
// high part with trailing zero bits and the remainder, so k·LN2_HI is exact).
pub(super) const LOG2E: f32 = std::f32::consts::LOG2_E;
pub(super) const LN2_HI: f32 = f32::from_bits(0x3f31_7200); // 0.693145751953125
pub(super) const LN2_LO: f32 = (std::f64::consts::LN_2 - 0.693_145_751_953_125) as f32;
/// Below this exp underflows to 0 (the smallest subnormal is 2^-149).
pub(super) const X_MIN: f32 = -104.0;
/// Above this exp overflows to +inf.
pub(super) const X_MAX: f32 = 128.0;
/// Taylor coefficients 1/i! of exp(r), i = 7 down to 2: on |r| ≤ ln2/2 the
/// truncation error r^8/8! is below 6e-9, far under half an ulp.
pub(super) const EXP_C: [f32; 6] = [
    1.0 / 5040.0,
    1.0 / 720.0,
    1.0 / 120.0,
    1.0 / 24.0,
    1.0 / 6.0,
    0.5,
];

/// Scalar reference of [`exp16`]: the same operations in the same order
/// (fma where the vector code fuses), so the two agree bit for bit wherever
/// the result is a normal float.
pub fn exp_ref(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    let x = x.clamp(X_MIN, X_MAX);
    let k = (x * LOG2E).round_ties_even();
    let r = (-k).mul_add(LN2_HI, x);
    let r = (-k).mul_add(LN2_LO, r);
    let mut p = EXP_C[0];
    for &c in &EXP_C[1..] {
        p = p.mul_add(r, c);
    }
    let p = p.mul_add(r, 1.0);
    let p = p.mul_add(r, 1.0);
    // p · 2^k in two steps so that neither power over- or underflows
    let k = k as i32;
    let (a, b) = (k / 2, k - k / 2);
    p * f32::from_bits(((a + 127) as u32) << 23) * f32::from_bits(((b + 127) as u32) << 23)
}

/// exp of 16 lanes: relative error ≈ 1 ulp on the normal range, 0 below
/// `X_MIN`, +inf above `X_MAX`, NaN stays NaN.
///
/// # Safety
/// The CPU must have avx512f.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub unsafe fn exp16(x: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    // max/min return their second operand when one is NaN: keep x there
    let x = _mm512_min_ps(_mm512_set1_ps(X_MAX), x);
    let x = _mm512_max_ps(_mm512_set1_ps(X_MIN), x);
    let k = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
        _mm512_mul_ps(x, _mm512_set1_ps(LOG2E)),
    );
    let r = _mm512_fnmadd_ps(k, _mm512_set1_ps(LN2_HI), x);
    let r = _mm512_fnmadd_ps(k, _mm512_set1_ps(LN2_LO), r);
    let mut p = _mm512_set1_ps(EXP_C[0]);
    for &c in &EXP_C[1..] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    }
    let one = _mm512_set1_ps(1.0);
    let p = _mm512_fmadd_ps(p, r, one);
    let p = _mm512_fmadd_ps(p, r, one);
    _mm512_scalef_ps(p, k)
}

/// [`exp16`] over a slice, for tests (falls back to [`exp_ref`] without
/// avx512f).
pub fn exp_slice(x: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if available() {
        use std::arch::x86_64::*;
        for c in x.chunks_mut(16) {
            let m: __mmask16 = if c.len() == 16 {
                0xffff
            } else {
                (1u16 << c.len()) - 1
            };
            // SAFETY: avx512f detected; the masked load and store touch the
            // c.len() lanes of the chunk only.
            unsafe {
                let v = _mm512_maskz_loadu_ps(m, c.as_ptr());
                _mm512_mask_storeu_ps(c.as_mut_ptr(), m, exp16(v));
            }
        }
        return;
    }
    for v in x.iter_mut() {
        *v = exp_ref(*v);
    }
}

/// Decode attention, as `cpu::attend_group_probs_seg` (same arguments and
/// outputs; q: (n_seg, g, hd), sc: (g, n) normalized probabilities on
/// return, out: (g, hd), stats: (g,) (max, sum)). Panics unless
/// `available()` and `supports(g, hd)`.
pub fn attend<'k, R: KvRow + ?Sized + 'k>(
    q: &[f32],
    seg_end: &[usize],
    g: usize,
    n: usize,
    key: impl Fn(usize) -> &'k R,
    val: impl Fn(usize) -> &'k R,
    scale: f32,
    sc: &mut [f32],
    out: &mut [f32],
    stats: &mut [(f32, f32)],
) {
    let hd = out.len() / g.max(1);
    assert!(available() && supports(g, hd));
    assert!(q.len() == seg_end.len() * g * hd && out.len() == g * hd);
    assert!(sc.len() >= g * n && stats.len() >= g);
    assert!(seg_end.last().is_some_and(|&e| e >= n));
    #[cfg(target_arch = "x86_64")]
    {
        macro_rules! go {
            ($g:literal, $c:literal) => {
                // SAFETY: avx512f was detected (asserted above); rows are
                // sliced to hd values (bounds-checked) before any load, and
                // every store is to a bounds-checked slice of sc or out.
                unsafe {
                    kernel::<$g, $c, R, _, _>(q, seg_end, n, &key, &val, scale, sc, out, stats)
                }
            };
        }
        macro_rules! by_c {
            ($g:literal) => {
                match hd {
                    32 => go!($g, 2),
                    64 => go!($g, 4),
                    128 => go!($g, 8),
                    _ => go!($g, 16),
                }
            };
        }
        match g {
            1 => by_c!(1),
            2 => by_c!(2),
            3 => by_c!(3),
            4 => by_c!(4),
            5 => by_c!(5),
            6 => by_c!(6),
            7 => by_c!(7),
            _ => by_c!(8),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (key, val, scale);
        unreachable!("decode512 without x86_64");
    }
}

/// Sum each of the 16 vectors across its lanes: lane t of the result is
/// Σ lanes of v[t]. Four levels, each adding the two halves of a pair of
/// vectors that `vpermt2ps` lines up (no horizontal adds).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn reduce16(v: &[std::arch::x86_64::__m512; 16]) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    // level L: pairs (a, b) of vectors holding w = 16 >> L partial sums of
    // each of their keys; lo/hi gather the first/second half of every
    // key's partials from a (indices 0..15) and b (16..31)
    const fn idx(w: usize, hi: bool) -> [i32; 16] {
        let mut ix = [0i32; 16];
        let h = w / 2;
        let mut i = 0;
        while i < 16 {
            // output lane i: key i / h of the pair's 32 / w keys, partial i % h
            let key = i / h;
            let src = key * w + i % h + if hi { h } else { 0 };
            ix[i] = src as i32;
            i += 1;
        }
        ix
    }
    const I: [[[i32; 16]; 2]; 4] = [
        [idx(16, false), idx(16, true)],
        [idx(8, false), idx(8, true)],
        [idx(4, false), idx(4, true)],
        [idx(2, false), idx(2, true)],
    ];
    // SAFETY (all loads below): each index table is 16 i32s.
    let ld = |t: &[i32; 16]| unsafe { _mm512_loadu_si512(t.as_ptr().cast()) };
    let pair = |a: __m512, b: __m512, l: usize| {
        let (lo, hi) = (ld(&I[l][0]), ld(&I[l][1]));
        _mm512_add_ps(
            _mm512_permutex2var_ps(a, lo, b),
            _mm512_permutex2var_ps(a, hi, b),
        )
    };
    let l1: [__m512; 8] = std::array::from_fn(|i| pair(v[2 * i], v[2 * i + 1], 0));
    let l2: [__m512; 4] = std::array::from_fn(|i| pair(l1[2 * i], l1[2 * i + 1], 1));
    let l3: [__m512; 2] = std::array::from_fn(|i| pair(l2[2 * i], l2[2 * i + 1], 2));
    pair(l3[0], l3[1], 3)
}

/// Rows ahead of the one being read that the kernel asks the cache to fetch.
pub(super) const PREFETCH: usize = 8;

/// Prefetch the cache lines of one row into L1.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) fn prefetch_row<R: KvRow + ?Sized>(r: &R) {
    use std::arch::x86_64::*;
    let (p, len) = (r as *const R as *const u8, std::mem::size_of_val(r));
    let mut o = 0;
    while o < len {
        // SAFETY: a prefetch is a hint: it never faults and writes nothing;
        // the address is inside the row.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p.add(o).cast()) };
        o += 64;
    }
}

/// One row of C·16 values as C vectors: f16 rows widened in registers,
/// f32 rows loaded, others (q8_0) converted through `buf`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn load_row<const C: usize, R: KvRow + ?Sized>(
    r: &R,
    buf: &mut [f32; 256],
) -> [std::arch::x86_64::__m512; C] {
    use std::arch::x86_64::*;
    if let Some(h) = r.as_f16() {
        let h = &h[..C * 16];
        // SAFETY: h holds C · 16 f16 values; 16 of them are 256 bits; the
        // caller (a target_feature(avx512f) kernel) guarantees the CPU.
        std::array::from_fn(|c| unsafe {
            _mm512_cvtph_ps(_mm256_loadu_si256(h.as_ptr().add(c * 16).cast()))
        })
    } else {
        let f = &r.as_f32(&mut buf[..C * 16])[..C * 16];
        // SAFETY: f holds C · 16 floats; CPU as above.
        std::array::from_fn(|c| unsafe { _mm512_loadu_ps(f.as_ptr().add(c * 16)) })
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn kernel<'k, const G: usize, const C: usize, R, K, V>(
    q: &[f32],
    seg_end: &[usize],
    n: usize,
    key: &K,
    val: &V,
    scale: f32,
    sc: &mut [f32],
    out: &mut [f32],
    stats: &mut [(f32, f32)],
) where
    R: KvRow + ?Sized + 'k,
    K: Fn(usize) -> &'k R,
    V: Fn(usize) -> &'k R,
{
    use half::f16;
    use std::arch::x86_64::*;
    let hd = C * 16;
    let sc = &mut sc[..G * n];
    let mut buf = [0f32; 256];
    let zero = _mm512_setzero_ps();
    let mask = |w: usize| -> __mmask16 {
        if w >= 16 {
            0xffff
        } else {
            (1u16 << w) - 1
        }
    };

    // pass 1: scores, 16 keys at a time
    let mut mx = [_mm512_set1_ps(f32::NEG_INFINITY); G];
    let vscale = _mm512_set1_ps(scale);
    let mut j0 = 0;
    for (si, &j1) in seg_end.iter().enumerate() {
        let j1 = j1.min(n);
        if j1 <= j0 {
            continue;
        }
        // this segment's queries, rounded to f16 as the portable kernel does
        let qs = &q[si * G * hd..(si + 1) * G * hd];
        let mut qr = [0f32; 16 * 16];
        let mut qv = [[zero; C]; G];
        for h in 0..G {
            for (d, x) in qr[..hd].iter_mut().enumerate() {
                *x = f16::from_f32(qs[h * hd + d]).to_f32();
            }
            for c in 0..C {
                // SAFETY: qr holds hd = C · 16 floats.
                qv[h][c] = unsafe { _mm512_loadu_ps(qr.as_ptr().add(c * 16)) };
            }
        }
        let mut j = j0;
        while j < j1 {
            let w = (j1 - j).min(16);
            let mut acc = [[zero; 16]; G];
            for t in 0..16 {
                if t < w {
                    if j + t + PREFETCH < j1 {
                        prefetch_row(key(j + t + PREFETCH));
                    }
                    // SAFETY: CPU as this function's.
                    let k = unsafe { load_row::<C, R>(key(j + t), &mut buf) };
                    for h in 0..G {
                        let mut a = _mm512_mul_ps(qv[h][0], k[0]);
                        for c in 1..C {
                            a = _mm512_fmadd_ps(qv[h][c], k[c], a);
                        }
                        acc[h][t] = a;
                    }
                }
            }
            let m = mask(w);
            let dst = &mut sc[..];
            for h in 0..G {
                // SAFETY: CPU as this function's.
                let s = _mm512_mul_ps(unsafe { reduce16(&acc[h]) }, vscale);
                let row = &mut dst[h * n + j..h * n + j + w];
                // SAFETY: the mask covers row's w lanes only.
                unsafe { _mm512_mask_storeu_ps(row.as_mut_ptr(), m, s) };
                mx[h] = _mm512_mask_max_ps(mx[h], m, mx[h], s);
            }
            j += w;
        }
        j0 = j1;
    }

    // pass 2: weights exp(s − max) and their sums
    let mut sum = [0f32; G];
    let mut m = [0f32; G];
    for h in 0..G {
        m[h] = _mm512_reduce_max_ps(mx[h]);
        let vm = _mm512_set1_ps(m[h]);
        let mut vs = zero;
        for row in sc[h * n..(h + 1) * n].chunks_mut(16) {
            let k = mask(row.len());
            // SAFETY: the mask covers row's lanes only; CPU as this function's.
            unsafe {
                let x = _mm512_maskz_loadu_ps(k, row.as_ptr());
                let e = exp16(_mm512_sub_ps(x, vm));
                _mm512_mask_storeu_ps(row.as_mut_ptr(), k, e);
                vs = _mm512_mask_add_ps(vs, k, vs, e);
            }
        }
        sum[h] = _mm512_reduce_add_ps(vs);
    }

    // pass 3: value sum
    let mut acc = [[zero; C]; G];
    for j in 0..n {
        if j + PREFETCH < n {
            prefetch_row(val(j + PREFETCH));
        }
        // SAFETY: CPU as this function's.
        let v = unsafe { load_row::<C, R>(val(j), &mut buf) };
        for h in 0..G {
            let p = _mm512_set1_ps(sc[h * n + j]);
            for c in 0..C {
                acc[h][c] = _mm512_fmadd_ps(p, v[c], acc[h][c]);
            }
        }
    }
    for h in 0..G {
        let inv = if sum[h] == 0.0 { 0.0 } else { 1.0 / sum[h] };
        let vi = _mm512_set1_ps(inv);
        let o = &mut out[h * hd..(h + 1) * hd];
        for c in 0..C {
            // SAFETY: o holds C · 16 floats.
            unsafe { _mm512_storeu_ps(o.as_mut_ptr().add(c * 16), _mm512_mul_ps(acc[h][c], vi)) };
        }
        for row in sc[h * n..(h + 1) * n].chunks_mut(16) {
            let k = mask(row.len());
            // SAFETY: the mask covers row's lanes only.
            unsafe {
                let x = _mm512_maskz_loadu_ps(k, row.as_ptr());
                _mm512_mask_storeu_ps(row.as_mut_ptr(), k, _mm512_mul_ps(x, vi));
            }
        }
        stats[h] = (m[h], sum[h]);
    }
}
