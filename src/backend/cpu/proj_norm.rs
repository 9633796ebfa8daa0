//! The projected value norm CriticalKV ranks entries by
//! (`policy::critical`): for value rows `v` (n, hd) and one query head's
//! block `W` (hd, dim) of the output projection,
//!
//!   out[t] += scale · Σ_d |Σ_j v[t][j] · W[j][d]|.
//!
//! `W` is packed once ([`pack`]) into panels of [`PANEL`] columns: panel p
//! holds columns PANEL·p .. PANEL·(p+1) as hd contiguous rows of PANEL
//! floats, zero past `dim` (a zero column adds |0| = 0, so no kernel needs
//! a column tail).
//!
//! A quantized W_O has a second, smaller form ([`Affine`], packed by
//! [`pack_affine`]): the same panels with a signed byte per weight and,
//! per group of g rows, a step pair (a, b) per column, the weight being
//! `fma(q, a, b)` (`quant::affine_row` gives that form exactly). The
//! kernels are generic over where a weight vector comes from: an f32 load,
//! or a byte load, a conversion and that `fma`, the steps held in
//! registers for the group. Everything after is the same code, so on the
//! same weights the two forms give the same bits.
//!
//! The SIMD kernels are register-blocked: a block of T tokens × one column
//! block is accumulated in registers over the whole reduction over j (each
//! weight vector loaded once per T tokens, each value broadcast once per
//! column block), then |acc| is added, still in registers, into per-token
//! vector sums; the (n, dim) product is never stored. AVX2 + FMA: 6 tokens
//! × 16 columns (12 ymm accumulators); AVX-512: 8 tokens × 32 columns (16
//! zmm). A ragged last block of tokens runs the same code with fewer
//! tokens. Both are one generic kernel over a small lane trait, so the
//! AVX2 tests exercise the blocking logic the AVX-512 one shares.
//!
//! The portable loop does the same on the packed layout with arrays;
//! [`projected_l1_ref`] is the plain loop over the unpacked block that the
//! parity tests hold every level to. Summation order differs between them,
//! so results agree to float rounding (relative ~1e-6), not bit for bit.
//! The level is chosen per process ([`super::isa::level`]), never per call.

use super::isa::{detected, Level};

/// Columns per packed panel (one AVX-512 column block, two AVX2 ones).
pub const PANEL: usize = 32;

/// A kernel: `(v, hd, packed, dim, scale, out)`, `out.len()` tokens.
pub type KernelFn = fn(&[f32], usize, &[f32], usize, f32, &mut [f32]);

/// Floats of a packed (hd, dim) block.
pub fn packed_len(hd: usize, dim: usize) -> usize {
    dim.div_ceil(PANEL) * PANEL * hd
}

/// Pack the row-major (hd, dim) block `w` into `out` (`packed_len` floats;
/// see the module doc).
pub fn pack(w: &[f32], hd: usize, dim: usize, out: &mut [f32]) {
    assert_eq!(w.len(), hd * dim, "proj_norm::pack: block is not hd × dim");
    assert_eq!(
        out.len(),
        packed_len(hd, dim),
        "proj_norm::pack: bad output length"
    );
    out.fill(0.0);
    for (j, row) in w.chunks_exact(dim).enumerate() {
        for (d, &x) in row.iter().enumerate() {
            out[(d / PANEL) * hd * PANEL + j * PANEL + d % PANEL] = x;
        }
    }
}

/// The reference: `out[t] += scale · Σ_d |Σ_j v[t][j]·w[j][d]|` for the
/// row-major (hd, dim) block `w`, in blocks of 4 tokens through a (4, dim)
/// buffer (the loop CriticalKV ran before the packed kernels).
pub fn projected_l1_ref(v: &[f32], hd: usize, w: &[f32], dim: usize, scale: f32, out: &mut [f32]) {
    const TB: usize = 4;
    let nt = out.len();
    assert!(v.len() >= nt * hd && w.len() >= hd * dim);
    let mut acc = vec![0f32; TB * dim];
    let mut t0 = 0;
    while t0 < nt {
        let tb = (nt - t0).min(TB);
        let acc = &mut acc[..tb * dim];
        acc.fill(0.0);
        // each weight row is read once per TB tokens
        for j in 0..hd {
            let wr = &w[j * dim..(j + 1) * dim];
            for t in 0..tb {
                let x = v[(t0 + t) * hd + j];
                for (y, &wv) in acc[t * dim..(t + 1) * dim].iter_mut().zip(wr) {
                    *y = x.mul_add(wv, *y);
                }
            }
        }
        for t in 0..tb {
            let l1: f32 = acc[t * dim..(t + 1) * dim].iter().map(|y| y.abs()).sum();
            out[t0 + t] += l1 * scale;
        }
        t0 += tb;
    }
}

fn check(v: &[f32], hd: usize, packed: &[f32], dim: usize, out: &[f32]) {
    assert!(
        v.len() >= out.len() * hd,
        "proj_norm: {} value floats for {} rows of {hd}",
        v.len(),
        out.len()
    );
    assert_eq!(
        packed.len(),
        packed_len(hd, dim),
        "proj_norm: packed block of the wrong size"
    );
}

/// The portable loop: 4 tokens × one panel in arrays over the reduction,
/// row j of panel p's weights (PANEL floats) written by `row(p, j, ..)`.
fn portable_loop(
    v: &[f32],
    hd: usize,
    np: usize,
    scale: f32,
    out: &mut [f32],
    row: impl Fn(usize, usize, &mut [f32; PANEL]),
) {
    const TB: usize = 4;
    let nt = out.len();
    let mut t0 = 0;
    let mut wr = [0f32; PANEL];
    while t0 < nt {
        let tb = (nt - t0).min(TB);
        let mut sums = [0f32; TB];
        for p in 0..np {
            let mut acc = [[0f32; PANEL]; TB];
            for j in 0..hd {
                row(p, j, &mut wr);
                for (t, a) in acc.iter_mut().enumerate().take(tb) {
                    let x = v[(t0 + t) * hd + j];
                    for (y, &w) in a.iter_mut().zip(&wr) {
                        *y = x.mul_add(w, *y);
                    }
                }
            }
            for (s, a) in sums.iter_mut().zip(&acc).take(tb) {
                *s += a.iter().map(|y| y.abs()).sum::<f32>();
            }
        }
        for (o, s) in out[t0..t0 + tb].iter_mut().zip(sums) {
            *o += s * scale;
        }
        t0 += tb;
    }
}

/// The portable kernel on the packed layout ([`portable_loop`]).
pub fn projected_l1_portable(
    v: &[f32],
    hd: usize,
    packed: &[f32],
    dim: usize,
    scale: f32,
    out: &mut [f32],
) {
    check(v, hd, packed, dim, out);
    let np = packed.len() / (hd * PANEL).max(1);
    portable_loop(v, hd, np, scale, out, |p, j, wr| {
        wr.copy_from_slice(&packed[(p * hd + j) * PANEL..(p * hd + j + 1) * PANEL]);
    });
}

#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
/// The kernel of `level` among the three (`None` where this CPU lacks it;
/// AVX-512 serves both AVX-512 levels and AMX).
fn pick<K>(level: Level, portable: K, avx2: K, avx512: K) -> Option<K> {
    if level > detected() {
        return None;
    }
    match level {
        Level::Portable => Some(portable),
        Level::Avx2 => Some(avx2),
        Level::Avx512 | Level::Avx512Vnni | Level::Amx => Some(avx512),
    }
}

/// The kernel for SIMD level `level`, if this CPU runs it (the portable
/// loop for `Portable`; AVX-512 serves both AVX-512 levels).
pub fn kernel_for(level: Level) -> Option<KernelFn> {
    #[cfg(target_arch = "x86_64")]
    return pick::<KernelFn>(
        level,
        projected_l1_portable,
        x86::projected_l1_avx2,
        x86::projected_l1_avx512,
    );
    #[cfg(not(target_arch = "x86_64"))]
    return (level == Level::Portable).then_some(projected_l1_portable as KernelFn);
}

/// `out[t] += scale · Σ_d |Σ_j v[t][j]·W[j][d]|` for the packed block
/// `packed` of the (hd, dim) block W, at this process's SIMD level.
pub fn projected_l1(v: &[f32], hd: usize, packed: &[f32], dim: usize, scale: f32, out: &mut [f32]) {
    let k = kernel_for(super::isa::level()).unwrap_or(projected_l1_portable);
    k(v, hd, packed, dim, scale, out)
}

/// A (hd, dim) block in the affine form, packed by [`pack_affine`]: the
/// weight at (j, d) is `fma(q, a, b)` with q a signed byte and (a, b) the
/// steps of column d for rows j in groups of `g`. A quantized W_O gives
/// this form exactly (`quant::affine_row`), in 1 + 8/g bytes a weight
/// instead of 4, and the kernels rebuild each weight vector in registers
/// (a byte load, a conversion, one `fma`) before the same steps as on the
/// f32 panels: on the same weights both forms give the same bits.
///
/// Layout, per panel p of [`PANEL`] columns (zero past `dim`):
/// - `q`: hd rows of PANEL bytes (`affine_len`'s first count);
/// - `ab`: per group of g rows, PANEL floats a then PANEL floats b.
#[derive(Clone, Copy, Debug)]
pub struct Affine<'a> {
    pub g: usize,
    pub q: &'a [i8],
    pub ab: &'a [f32],
}

/// Sizes of a packed affine (hd, dim) block with groups of `g` rows:
/// (quant bytes, step floats).
pub fn affine_len(hd: usize, dim: usize, g: usize) -> (usize, usize) {
    let np = dim.div_ceil(PANEL);
    (np * PANEL * hd, np * (hd / g.max(1)) * 2 * PANEL)
}

/// Pack an affine (hd, dim) block: `q(j, d)` the integer of row j, column
/// d; `ab(jg, d)` the steps of rows jg·g .. (jg + 1)·g, column d. `hd`
/// must be a multiple of `g`.
pub fn pack_affine(
    hd: usize,
    dim: usize,
    g: usize,
    q: impl Fn(usize, usize) -> i8,
    ab: impl Fn(usize, usize) -> (f32, f32),
    out_q: &mut [i8],
    out_ab: &mut [f32],
) {
    assert!(
        g > 0 && hd.is_multiple_of(g),
        "proj_norm::pack_affine: hd {hd} is not a multiple of g {g}"
    );
    let (nq, nab) = affine_len(hd, dim, g);
    assert!(
        out_q.len() == nq && out_ab.len() == nab,
        "proj_norm::pack_affine: bad output lengths"
    );
    out_q.fill(0);
    out_ab.fill(0.0);
    let ng = hd / g;
    for d in 0..dim {
        let (p, c) = (d / PANEL, d % PANEL);
        for j in 0..hd {
            out_q[(p * hd + j) * PANEL + c] = q(j, d);
        }
        for jg in 0..ng {
            let (a, b) = ab(jg, d);
            let base = (p * ng + jg) * 2 * PANEL + c;
            out_ab[base] = a;
            out_ab[base + PANEL] = b;
        }
    }
}

/// The weights of a packed affine block as a row-major (hd, dim) f32 block
/// (what `pack` would take), each `fma(q, a, b)`.
pub fn expand_affine(w: &Affine<'_>, hd: usize, dim: usize) -> Vec<f32> {
    let ng = hd / w.g;
    let mut out = vec![0f32; hd * dim];
    for j in 0..hd {
        for d in 0..dim {
            let (p, c) = (d / PANEL, d % PANEL);
            let base = (p * ng + j / w.g) * 2 * PANEL + c;
            let q = w.q[(p * hd + j) * PANEL + c] as f32;
            out[j * dim + d] = q.mul_add(w.ab[base], w.ab[base + PANEL]);
        }
    }
    out
}

fn check_affine(v: &[f32], hd: usize, w: &Affine<'_>, dim: usize, out: &[f32]) {
    assert!(
        v.len() >= out.len() * hd,
        "proj_norm: {} value floats for {} rows of {hd}",
        v.len(),
        out.len()
    );
    assert!(
        w.g > 0 && hd.is_multiple_of(w.g),
        "proj_norm: hd {hd} is not a multiple of the group {}",
        w.g
    );
    let (nq, nab) = affine_len(hd, dim, w.g);
    assert!(
        w.q.len() == nq && w.ab.len() == nab,
        "proj_norm: affine block of the wrong size"
    );
}

/// A kernel on the affine panels: `(v, hd, block, dim, scale, out)`.
pub type AffineFn = fn(&[f32], usize, &Affine<'_>, usize, f32, &mut [f32]);

/// The portable kernel on the affine panels: [`portable_loop`] with each
/// weight row of a panel rebuilt first.
pub fn projected_l1_affine_portable(
    v: &[f32],
    hd: usize,
    w: &Affine<'_>,
    dim: usize,
    scale: f32,
    out: &mut [f32],
) {
    check_affine(v, hd, w, dim, out);
    let ng = hd / w.g;
    let np = w.q.len() / (hd * PANEL).max(1);
    portable_loop(v, hd, np, scale, out, |p, j, wr| {
        let base = (p * ng + j / w.g) * 2 * PANEL;
        let (a, b) = (
            &w.ab[base..base + PANEL],
            &w.ab[base + PANEL..base + 2 * PANEL],
        );
        let qr = &w.q[(p * hd + j) * PANEL..(p * hd + j + 1) * PANEL];
        for c in 0..PANEL {
            wr[c] = (qr[c] as f32).mul_add(a[c], b[c]);
        }
    });
}

/// The affine kernel for SIMD level `level`, if this CPU runs it.
pub fn affine_kernel_for(level: Level) -> Option<AffineFn> {
    #[cfg(target_arch = "x86_64")]
    return pick::<AffineFn>(
        level,
        projected_l1_affine_portable,
        x86::projected_l1_affine_avx2,
        x86::projected_l1_affine_avx512,
    );
    #[cfg(not(target_arch = "x86_64"))]
    return (level == Level::Portable).then_some(projected_l1_affine_portable as AffineFn);
}

/// [`projected_l1`] on an affine block, at this process's SIMD level.
pub fn projected_l1_affine(
    v: &[f32],
    hd: usize,
    w: &Affine<'_>,
    dim: usize,
    scale: f32,
    out: &mut [f32],
) {
    let k = affine_kernel_for(super::isa::level()).unwrap_or(projected_l1_affine_portable);
    k(v, hd, w, dim, scale, out)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{check, check_affine, Affine, PANEL};
    use std::arch::x86_64::*;

    /// The few vector operations the kernel needs, on `W` f32 lanes.
    ///
    /// # Safety
    /// Every method needs the CPU features of its implementation (callers
    /// are `target_feature` functions handed out only where the CPU has
    /// them); `load` reads `W` floats at `p`, `splat` one.
    trait Lanes {
        type V: Copy;
        const W: usize;
        unsafe fn zero() -> Self::V;
        unsafe fn load(p: *const f32) -> Self::V;
        unsafe fn splat(p: *const f32) -> Self::V;
        /// `W` signed bytes at `p` as floats (exact).
        unsafe fn load_i8(p: *const i8) -> Self::V;
        /// a · b + c
        unsafe fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
        /// s + |x|
        unsafe fn add_abs(s: Self::V, x: Self::V) -> Self::V;
        unsafe fn hsum(s: Self::V) -> f32;
    }

    /// AVX2 + FMA: 8 lanes.
    struct Avx2;

    impl Lanes for Avx2 {
        type V = __m256;
        const W: usize = 8;
        #[inline(always)]
        unsafe fn zero() -> __m256 {
            // SAFETY: AVX available (the trait's contract).
            unsafe { _mm256_setzero_ps() }
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> __m256 {
            // SAFETY: 8 floats readable at p, AVX available (the contract).
            unsafe { _mm256_loadu_ps(p) }
        }
        #[inline(always)]
        unsafe fn splat(p: *const f32) -> __m256 {
            // SAFETY: one float readable at p, AVX available (the contract).
            unsafe { _mm256_broadcast_ss(&*p) }
        }
        #[inline(always)]
        unsafe fn load_i8(p: *const i8) -> __m256 {
            // SAFETY: 8 bytes readable at p, AVX2 available (the contract).
            unsafe { _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p.cast()))) }
        }
        #[inline(always)]
        unsafe fn fma(a: __m256, b: __m256, c: __m256) -> __m256 {
            // SAFETY: FMA available (the contract).
            unsafe { _mm256_fmadd_ps(a, b, c) }
        }
        #[inline(always)]
        unsafe fn add_abs(s: __m256, x: __m256) -> __m256 {
            // SAFETY: AVX available (the contract).
            unsafe { _mm256_add_ps(s, _mm256_andnot_ps(_mm256_set1_ps(-0.0), x)) }
        }
        #[inline(always)]
        unsafe fn hsum(s: __m256) -> f32 {
            // SAFETY: AVX available (the contract).
            unsafe {
                let h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
                let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
                let h = _mm_add_ss(h, _mm_movehdup_ps(h));
                _mm_cvtss_f32(h)
            }
        }
    }

    /// AVX-512 F: 16 lanes.
    struct Avx512;

    impl Lanes for Avx512 {
        type V = __m512;
        const W: usize = 16;
        #[inline(always)]
        unsafe fn zero() -> __m512 {
            // SAFETY: avx512f available (the trait's contract).
            unsafe { _mm512_setzero_ps() }
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> __m512 {
            // SAFETY: 16 floats readable at p, avx512f available (the contract).
            unsafe { _mm512_loadu_ps(p) }
        }
        #[inline(always)]
        unsafe fn splat(p: *const f32) -> __m512 {
            // SAFETY: one float readable at p, avx512f available (the contract).
            unsafe { _mm512_set1_ps(p.read()) }
        }
        #[inline(always)]
        unsafe fn load_i8(p: *const i8) -> __m512 {
            // SAFETY: 16 bytes readable at p, avx512f available (the contract).
            unsafe { _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p.cast()))) }
        }
        #[inline(always)]
        unsafe fn fma(a: __m512, b: __m512, c: __m512) -> __m512 {
            // SAFETY: avx512f available (the contract).
            unsafe { _mm512_fmadd_ps(a, b, c) }
        }
        #[inline(always)]
        unsafe fn add_abs(s: __m512, x: __m512) -> __m512 {
            // SAFETY: avx512f available (the contract).
            unsafe { _mm512_add_ps(s, _mm512_abs_ps(x)) }
        }
        #[inline(always)]
        unsafe fn hsum(s: __m512) -> f32 {
            // SAFETY: avx512f available (the contract).
            unsafe { _mm512_reduce_add_ps(s) }
        }
    }

    /// Where the weight vectors of a column block come from: row j of
    /// W in `group()`-row groups, each group opening a state (`Copy`
    /// registers) its rows are read with.
    ///
    /// # Safety
    /// The methods need L's features; `p < np`, `c0 + NV·W ≤ PANEL`,
    /// `jg < hd / group()`, `j < hd` (the packed block's bounds).
    trait Src<L: Lanes> {
        type S: Copy;
        fn group(&self) -> usize;
        unsafe fn state(&self, p: usize, c0: usize, jg: usize) -> Self::S;
        /// Vector k (W lanes from column c0 + k·W) of row j of panel p.
        unsafe fn load(&self, s: &Self::S, p: usize, c0: usize, j: usize, k: usize) -> L::V;
    }

    /// The f32 panels (`pack`): one group of hd rows, no state.
    struct F32Src {
        w: *const f32,
        hd: usize,
    }

    impl<L: Lanes> Src<L> for F32Src {
        type S = ();
        fn group(&self) -> usize {
            self.hd
        }
        #[inline(always)]
        unsafe fn state(&self, _: usize, _: usize, _: usize) {}
        #[inline(always)]
        unsafe fn load(&self, _: &(), p: usize, c0: usize, j: usize, k: usize) -> L::V {
            // SAFETY: in bounds of the packed block (the trait's contract).
            unsafe { L::load(self.w.add((p * self.hd + j) * PANEL + c0 + k * L::W)) }
        }
    }

    /// The affine panels (`pack_affine`): groups of g rows sharing the
    /// steps (a, b) of every column, loaded into registers once a group.
    struct AffineSrc {
        q: *const i8,
        ab: *const f32,
        hd: usize,
        g: usize,
    }

    /// Column vectors per block of the kernels (both levels use 2).
    const NV_MAX: usize = 2;

    impl<L: Lanes> Src<L> for AffineSrc {
        type S = [[L::V; NV_MAX]; 2];
        fn group(&self) -> usize {
            self.g
        }
        #[inline(always)]
        unsafe fn state(&self, p: usize, c0: usize, jg: usize) -> Self::S {
            let base = ((p * (self.hd / self.g) + jg) * 2) * PANEL + c0;
            // SAFETY: in bounds of the packed steps (the trait's contract;
            // a kernel reads at most NV_MAX vectors from c0).
            std::array::from_fn(|ab| {
                std::array::from_fn(|k| unsafe {
                    L::load(self.ab.add(base + ab * PANEL + k * L::W))
                })
            })
        }
        #[inline(always)]
        unsafe fn load(&self, s: &Self::S, p: usize, c0: usize, j: usize, k: usize) -> L::V {
            // SAFETY: in bounds of the packed quants (the trait's contract).
            unsafe {
                let q = L::load_i8(self.q.add((p * self.hd + j) * PANEL + c0 + k * L::W));
                L::fma(q, s[0][k], s[1][k])
            }
        }
    }

    /// T tokens (rows of `v`, hd apart) against every column block of the
    /// packed block `w` (`np` panels); adds scale · Σ|acc| to `out[0..T]`.
    /// A column block is NV vectors of L::W lanes, PANEL / (NV·W) per panel.
    ///
    /// # Safety
    /// `v` must hold T · hd floats, `w` np panels of hd rows, `out` T; the
    /// CPU must have L's features; NV ≤ NV_MAX.
    #[inline(always)]
    unsafe fn tokens<L: Lanes, W: Src<L>, const T: usize, const NV: usize>(
        v: *const f32,
        hd: usize,
        w: &W,
        np: usize,
        scale: f32,
        out: *mut f32,
    ) {
        let cb = NV * L::W;
        let per = PANEL / cb;
        let grp = w.group();
        // SAFETY: L's features are present (the caller's contract); every
        // load stays inside v (rows t < T, columns j < hd) or w (panel
        // b / per < np, group jg < hd / grp, row j < hd, columns
        // (b % per)·cb + k·W + W ≤ PANEL); out holds T floats.
        unsafe {
            let mut sums = [L::zero(); T];
            for b in 0..np * per {
                let (p, c0) = (b / per, (b % per) * cb);
                let mut acc = [[L::zero(); NV]; T];
                for jg in 0..hd / grp {
                    let st = w.state(p, c0, jg);
                    for j in jg * grp..(jg + 1) * grp {
                        let wv: [L::V; NV] = std::array::from_fn(|k| w.load(&st, p, c0, j, k));
                        for (t, a) in acc.iter_mut().enumerate() {
                            let x = L::splat(v.add(t * hd + j));
                            for (y, &wk) in a.iter_mut().zip(&wv) {
                                *y = L::fma(x, wk, *y);
                            }
                        }
                    }
                }
                for (s, a) in sums.iter_mut().zip(&acc) {
                    for &y in a {
                        *s = L::add_abs(*s, y);
                    }
                }
            }
            for (t, &s) in sums.iter().enumerate() {
                *out.add(t) += L::hsum(s) * scale;
            }
        }
    }

    /// Every token of `out` in blocks of TB (then one ragged block).
    ///
    /// # Safety
    /// As [`tokens`], for `out.len()` tokens; TB ≤ 8.
    #[inline(always)]
    unsafe fn all_tokens<L: Lanes, W: Src<L>, const TB: usize, const NV: usize>(
        v: &[f32],
        hd: usize,
        w: &W,
        np: usize,
        scale: f32,
        out: &mut [f32],
    ) {
        let n = out.len();
        let (vp, op) = (v.as_ptr(), out.as_mut_ptr());
        // SAFETY: v holds n · hd floats and w np panels (the caller's
        // contract), out n: each call covers tokens t0 .. t0 + its T ≤ n.
        unsafe {
            let mut t0 = 0;
            while t0 + TB <= n {
                tokens::<L, W, TB, NV>(vp.add(t0 * hd), hd, w, np, scale, op.add(t0));
                t0 += TB;
            }
            let (vp, op) = (vp.add(t0 * hd), op.add(t0));
            match n - t0 {
                0 => {}
                1 => tokens::<L, W, 1, NV>(vp, hd, w, np, scale, op),
                2 => tokens::<L, W, 2, NV>(vp, hd, w, np, scale, op),
                3 => tokens::<L, W, 3, NV>(vp, hd, w, np, scale, op),
                4 => tokens::<L, W, 4, NV>(vp, hd, w, np, scale, op),
                5 => tokens::<L, W, 5, NV>(vp, hd, w, np, scale, op),
                6 => tokens::<L, W, 6, NV>(vp, hd, w, np, scale, op),
                7 => tokens::<L, W, 7, NV>(vp, hd, w, np, scale, op),
                r => unreachable!("ragged block of {r} ≥ 8 tokens"),
            }
        }
    }

    /// Every token through the AVX2 kernel on the weights of `w`.
    ///
    /// # Safety
    /// `v` holds `out.len()` · hd floats and `w` np panels of hd rows.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn avx2_run<W: Src<Avx2>>(
        v: &[f32],
        hd: usize,
        w: &W,
        np: usize,
        scale: f32,
        out: &mut [f32],
    ) {
        // SAFETY: this function's features are AVX2 + FMA, Avx2's; the
        // lengths are the caller's contract.
        unsafe { all_tokens::<Avx2, W, 6, 2>(v, hd, w, np, scale, out) }
    }

    /// Every token through the AVX-512 kernel on the weights of `w`.
    ///
    /// # Safety
    /// As [`avx2_run`].
    #[target_feature(enable = "avx2,fma,avx512f")]
    unsafe fn avx512_run<W: Src<Avx512>>(
        v: &[f32],
        hd: usize,
        w: &W,
        np: usize,
        scale: f32,
        out: &mut [f32],
    ) {
        // SAFETY: this function's features include avx512f, Avx512's; the
        // lengths are the caller's contract.
        unsafe { all_tokens::<Avx512, W, 8, 2>(v, hd, w, np, scale, out) }
    }

    /// The f32 panels of `w` as a kernel source, and their count.
    fn f32_src(w: &[f32], hd: usize) -> (F32Src, usize) {
        (F32Src { w: w.as_ptr(), hd }, w.len() / (hd * PANEL).max(1))
    }

    /// The affine panels of `w` as a kernel source, and their count.
    fn affine_src(w: &Affine<'_>, hd: usize) -> (AffineSrc, usize) {
        let src = AffineSrc {
            q: w.q.as_ptr(),
            ab: w.ab.as_ptr(),
            hd,
            g: w.g,
        };
        (src, w.q.len() / (hd * PANEL).max(1))
    }

    /// The AVX2 + FMA kernel on the affine panels.
    pub(super) fn projected_l1_affine_avx2(
        v: &[f32],
        hd: usize,
        w: &Affine<'_>,
        dim: usize,
        scale: f32,
        out: &mut [f32],
    ) {
        check_affine(v, hd, w, dim, out);
        assert!(super::detected() >= super::Level::Avx2);
        let (src, np) = affine_src(w, hd);
        // SAFETY: the CPU has AVX2 and FMA (level avx2 or above, asserted);
        // the block's lengths were checked.
        unsafe { avx2_run(v, hd, &src, np, scale, out) }
    }

    /// The AVX-512 kernel on the affine panels.
    pub(super) fn projected_l1_affine_avx512(
        v: &[f32],
        hd: usize,
        w: &Affine<'_>,
        dim: usize,
        scale: f32,
        out: &mut [f32],
    ) {
        check_affine(v, hd, w, dim, out);
        assert!(super::detected() >= super::Level::Avx512);
        let (src, np) = affine_src(w, hd);
        // SAFETY: the CPU has AVX2, FMA and AVX-512 F (level avx512 or
        // above, asserted); the block's lengths were checked.
        unsafe { avx512_run(v, hd, &src, np, scale, out) }
    }

    /// The AVX2 + FMA kernel (handed out by `kernel_for` only where the
    /// CPU has them).
    pub(super) fn projected_l1_avx2(
        v: &[f32],
        hd: usize,
        w: &[f32],
        dim: usize,
        scale: f32,
        out: &mut [f32],
    ) {
        check(v, hd, w, dim, out);
        assert!(super::detected() >= super::Level::Avx2);
        let (src, np) = f32_src(w, hd);
        // SAFETY: the CPU has AVX2 and FMA (level avx2 or above, asserted);
        // the lengths were checked.
        unsafe { avx2_run(v, hd, &src, np, scale, out) }
    }

    /// The AVX-512 kernel (handed out by `kernel_for` only where the CPU
    /// has AVX-512 F).
    pub(super) fn projected_l1_avx512(
        v: &[f32],
        hd: usize,
        w: &[f32],
        dim: usize,
        scale: f32,
        out: &mut [f32],
    ) {
        check(v, hd, w, dim, out);
        assert!(super::detected() >= super::Level::Avx512);
        let (src, np) = f32_src(w, hd);
        // SAFETY: the CPU has AVX2, FMA and AVX-512 F (level avx512 or
        // above, asserted); the lengths were checked.
        unsafe { avx512_run(v, hd, &src, np, scale, out) }
    }
}
