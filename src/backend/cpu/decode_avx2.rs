//! AVX2 decode attention (`cpu::attend_group_probs_seg`'s path on CPUs
//! with AVX2 + FMA + F16C but no AVX-512): the `G` query heads of one KV
//! head over `n` cached rows in the three passes of `decode_avx512`, at
//! 8 lanes:
//!
//! - scores: each key row loaded once (f16 rows widened in registers with
//!   `vcvtph2ps`) and dotted with all G queries; 8 keys' partial-sum
//!   vectors are reduced together by a transpose-add tree (`vhaddps`
//!   twice, then the two 128-bit halves), so a score costs no horizontal
//!   sum of its own;
//! - weights: an 8-lane `exp` ([`exp8`]) with the same range reduction and
//!   polynomial as `decode_avx512::exp16`, so it is bit for bit the scalar
//!   `exp_ref` (the power of two is applied in two exact steps instead of
//!   `vscalefps`, one rounding either way);
//! - value sum: each value row loaded once, G × head_dim/8 accumulators.
//!
//! The summation order differs from the portable loops (fma, 8 lanes), so
//! results agree to float rounding, not bit for bit (tests/engine/
//! kernels.rs runs every level's kernel against the reference).

#[cfg(target_arch = "x86_64")]
use super::decode_avx512::{prefetch_row, PREFETCH};
use super::decode_avx512::{EXP_C, LN2_HI, LN2_LO, LOG2E, X_MAX, X_MIN};
use super::kv_store::KvRow;

/// Whether this CPU can run this kernel (whatever `KVRUN_CPU` says).
pub fn available() -> bool {
    super::isa::detected() >= super::isa::Level::Avx2
}

/// Whether decoding takes this path in this process: AVX2 allowed by
/// `KVRUN_CPU`, and AVX-512 not (that level has its own kernel).
pub fn enabled() -> bool {
    super::isa::level() == super::isa::Level::Avx2
}

/// Whether this kernel handles `g` heads of `hd` dimensions (as AVX-512's).
pub fn supports(g: usize, hd: usize) -> bool {
    super::decode_avx512::supports(g, hd)
}

/// exp of 8 lanes, bit for bit `decode_avx512::exp_ref` (0 below
/// `X_MIN`, +inf above `X_MAX`, NaN stays NaN).
///
/// # Safety
/// The CPU must have avx2 and fma.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub unsafe fn exp8(x: std::arch::x86_64::__m256) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    // min/max return their second operand when one is NaN: keep x there
    let x = _mm256_min_ps(_mm256_set1_ps(X_MAX), x);
    let x = _mm256_max_ps(_mm256_set1_ps(X_MIN), x);
    let k = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        x,
        _mm256_set1_ps(LOG2E),
    ));
    let r = _mm256_fnmadd_ps(k, _mm256_set1_ps(LN2_HI), x);
    let r = _mm256_fnmadd_ps(k, _mm256_set1_ps(LN2_LO), r);
    let mut p = _mm256_set1_ps(EXP_C[0]);
    for &c in &EXP_C[1..] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
    }
    let one = _mm256_set1_ps(1.0);
    let p = _mm256_fmadd_ps(p, r, one);
    let p = _mm256_fmadd_ps(p, r, one);
    // p · 2^a · 2^b with a = ⌊k/2⌋, b = k − a: both powers are normal
    // floats (k ∈ [−150, 185]) and p · 2^a is exact, so the only rounding
    // is the last product's, as in one scaling by 2^k (NaN lanes: k's
    // conversion gives i32::MIN, p is NaN and stays NaN)
    let ki = _mm256_cvtps_epi32(k);
    let a = _mm256_srai_epi32::<1>(ki);
    let b = _mm256_sub_epi32(ki, a);
    let bias = _mm256_set1_epi32(127);
    let pow = |e: __m256i| _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(e, bias)));
    _mm256_mul_ps(_mm256_mul_ps(p, pow(a)), pow(b))
}

/// [`exp8`] over a slice, for tests (falls back to `exp_ref` without
/// avx2).
pub fn exp_slice(x: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if available() {
        use std::arch::x86_64::*;
        let mut c8 = x.chunks_exact_mut(8);
        for c in &mut c8 {
            // SAFETY: avx2 + fma detected; c holds 8 floats.
            unsafe { _mm256_storeu_ps(c.as_mut_ptr(), exp8(_mm256_loadu_ps(c.as_ptr()))) };
        }
        let rest = c8.into_remainder();
        let mut t = [0f32; 8];
        t[..rest.len()].copy_from_slice(rest);
        // SAFETY: as above; t holds 8 floats.
        unsafe { _mm256_storeu_ps(t.as_mut_ptr(), exp8(_mm256_loadu_ps(t.as_ptr()))) };
        rest.copy_from_slice(&t[..rest.len()]);
        return;
    }
    for v in x.iter_mut() {
        *v = super::decode_avx512::exp_ref(*v);
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
                // SAFETY: avx2, fma and f16c were detected (asserted
                // above); rows are sliced to hd values (bounds-checked)
                // before any load, and every store is to a bounds-checked
                // slice of sc or out.
                unsafe {
                    kernel::<$g, $c, R, _, _>(q, seg_end, n, &key, &val, scale, sc, out, stats)
                }
            };
        }
        macro_rules! by_c {
            ($g:literal) => {
                match hd {
                    32 => go!($g, 4),
                    64 => go!($g, 8),
                    128 => go!($g, 16),
                    _ => go!($g, 32),
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
        unreachable!("decode_avx2 without x86_64");
    }
}

/// Lane t of the result is the sum of the lanes of v[t]: two `vhaddps`
/// levels pair up neighbours within each 128-bit half, then the halves
/// are added across.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn reduce8(v: &[std::arch::x86_64::__m256; 8]) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    // per 128-bit half: [a0+a1, a2+a3, b0+b1, b2+b3]
    let h01 = _mm256_hadd_ps(v[0], v[1]);
    let h23 = _mm256_hadd_ps(v[2], v[3]);
    let h45 = _mm256_hadd_ps(v[4], v[5]);
    let h67 = _mm256_hadd_ps(v[6], v[7]);
    // per half: [Σa, Σb, Σc, Σd] of that half's four lanes
    let q0 = _mm256_hadd_ps(h01, h23);
    let q1 = _mm256_hadd_ps(h45, h67);
    // low halves of keys 0-3 | 4-7 plus their high halves
    let lo = _mm256_permute2f128_ps::<0x20>(q0, q1);
    let hi = _mm256_permute2f128_ps::<0x31>(q0, q1);
    _mm256_add_ps(lo, hi)
}

/// One row of C·8 values as C vectors: f16 rows widened in registers, f32
/// rows loaded, others (q8_0) converted through `buf`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn load_row<const C: usize, R: KvRow + ?Sized>(
    r: &R,
    buf: &mut [f32; 256],
) -> [std::arch::x86_64::__m256; C] {
    use std::arch::x86_64::*;
    if let Some(h) = r.as_f16() {
        let h = &h[..C * 8];
        // SAFETY: h holds C · 8 f16 values; 8 of them are 128 bits; the
        // caller (a target_feature(avx2,fma,f16c) kernel) guarantees the CPU.
        std::array::from_fn(|c| unsafe {
            _mm256_cvtph_ps(_mm_loadu_si128(h.as_ptr().add(c * 8).cast()))
        })
    } else {
        let f = &r.as_f32(&mut buf[..C * 8])[..C * 8];
        // SAFETY: f holds C · 8 floats; CPU as above.
        std::array::from_fn(|c| unsafe { _mm256_loadu_ps(f.as_ptr().add(c * 8)) })
    }
}

/// Store the first `w` lanes of `v` at `dst` (w ≤ 8).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn store_first(dst: &mut [f32], v: std::arch::x86_64::__m256) {
    use std::arch::x86_64::*;
    if dst.len() >= 8 {
        // SAFETY: dst holds at least 8 floats.
        unsafe { _mm256_storeu_ps(dst.as_mut_ptr(), v) };
    } else {
        let mut t = [0f32; 8];
        // SAFETY: t holds 8 floats.
        unsafe { _mm256_storeu_ps(t.as_mut_ptr(), v) };
        dst.copy_from_slice(&t[..dst.len()]);
    }
}

/// The first `w` lanes of `src` (w ≤ 8), the rest `fill`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn load_first(src: &[f32], fill: f32) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    if src.len() >= 8 {
        // SAFETY: src holds at least 8 floats.
        unsafe { _mm256_loadu_ps(src.as_ptr()) }
    } else {
        let mut t = [fill; 8];
        t[..src.len()].copy_from_slice(src);
        // SAFETY: t holds 8 floats.
        unsafe { _mm256_loadu_ps(t.as_ptr()) }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
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
    let hd = C * 8;
    let sc = &mut sc[..G * n];
    let mut buf = [0f32; 256];
    let zero = _mm256_setzero_ps();
    let ninf = _mm256_set1_ps(f32::NEG_INFINITY);

    // pass 1: scores, 8 keys at a time
    let mut mx = [ninf; G];
    let vscale = _mm256_set1_ps(scale);
    let mut j0 = 0;
    for (si, &j1) in seg_end.iter().enumerate() {
        let j1 = j1.min(n);
        if j1 <= j0 {
            continue;
        }
        // this segment's queries, rounded to f16 as the portable kernel does
        let qs = &q[si * G * hd..(si + 1) * G * hd];
        let mut qr = [0f32; 256];
        let mut qv = [[zero; C]; G];
        for h in 0..G {
            for (d, x) in qr[..hd].iter_mut().enumerate() {
                *x = f16::from_f32(qs[h * hd + d]).to_f32();
            }
            for c in 0..C {
                // SAFETY: qr holds hd = C · 8 floats.
                qv[h][c] = unsafe { _mm256_loadu_ps(qr.as_ptr().add(c * 8)) };
            }
        }
        let mut j = j0;
        while j < j1 {
            let w = (j1 - j).min(8);
            let mut acc = [[zero; 8]; G];
            for t in 0..w {
                if j + t + PREFETCH < j1 {
                    prefetch_row(key(j + t + PREFETCH));
                }
                // SAFETY: CPU as this function's.
                let k = unsafe { load_row::<C, R>(key(j + t), &mut buf) };
                for h in 0..G {
                    let mut a = _mm256_mul_ps(qv[h][0], k[0]);
                    for c in 1..C {
                        a = _mm256_fmadd_ps(qv[h][c], k[c], a);
                    }
                    acc[h][t] = a;
                }
            }
            for h in 0..G {
                // SAFETY: CPU as this function's.
                let s = _mm256_mul_ps(unsafe { reduce8(&acc[h]) }, vscale);
                let row = &mut sc[h * n + j..h * n + j + w];
                // SAFETY: store_first writes row's w lanes only.
                unsafe { store_first(row, s) };
                mx[h] = if w == 8 {
                    _mm256_max_ps(mx[h], s)
                } else {
                    // lanes past w hold 0 (empty accumulators): keep them out
                    // SAFETY: row holds w floats.
                    _mm256_max_ps(mx[h], unsafe { load_first(row, f32::NEG_INFINITY) })
                };
            }
            j += w;
        }
        j0 = j1;
    }

    // pass 2: weights exp(s − max) and their sums
    let mut sum = [0f32; G];
    let mut m = [0f32; G];
    for h in 0..G {
        let mut t = [0f32; 8];
        // SAFETY: t holds 8 floats.
        unsafe { _mm256_storeu_ps(t.as_mut_ptr(), mx[h]) };
        m[h] = t.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let vm = _mm256_set1_ps(m[h]);
        let mut vs = zero;
        for row in sc[h * n..(h + 1) * n].chunks_mut(8) {
            // SAFETY: load_first/store_first touch row's lanes only; CPU as
            // this function's. Lanes past the row are exp(−inf) = 0.
            unsafe {
                let x = load_first(row, f32::NEG_INFINITY);
                let e = exp8(_mm256_sub_ps(x, vm));
                store_first(row, e);
                vs = _mm256_add_ps(vs, e);
            }
        }
        // SAFETY: t holds 8 floats.
        unsafe { _mm256_storeu_ps(t.as_mut_ptr(), vs) };
        sum[h] = ((t[0] + t[4]) + (t[1] + t[5])) + ((t[2] + t[6]) + (t[3] + t[7]));
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
            let p = _mm256_set1_ps(sc[h * n + j]);
            for c in 0..C {
                acc[h][c] = _mm256_fmadd_ps(p, v[c], acc[h][c]);
            }
        }
    }
    for h in 0..G {
        let inv = if sum[h] == 0.0 { 0.0 } else { 1.0 / sum[h] };
        let vi = _mm256_set1_ps(inv);
        let o = &mut out[h * hd..(h + 1) * hd];
        for c in 0..C {
            // SAFETY: o holds C · 8 floats.
            unsafe { _mm256_storeu_ps(o.as_mut_ptr().add(c * 8), _mm256_mul_ps(acc[h][c], vi)) };
        }
        for x in sc[h * n..(h + 1) * n].iter_mut() {
            *x *= inv;
        }
        stats[h] = (m[h], sum[h]);
    }
}
