//! AVX-512 register tiles of the prefill attention kernel
//! (`cpu::attend_prefill_group`): G heads × 64 keys of scores, and G heads ×
//! 64 dimensions of the value sum, all accumulators in registers. Each
//! element is summed in the same order and with the same roundings (a
//! multiply, then an add; no fma) as the portable loops in `cpu.rs`, so the
//! results agree bit for bit (tests/engine/kernels.rs).

/// Keys per score tile and dimensions per value tile.
pub const TILE: usize = 64;

/// Whether this CPU can run the tiles (whatever `KVRUN_CPU` says).
pub fn available() -> bool {
    super::isa::detected() >= super::isa::Level::Avx512
}

/// Whether prefill takes the tiles in this process (the CPU has them and
/// `KVRUN_CPU` allows them).
pub fn enabled() -> bool {
    super::isa::at_least(super::isa::Level::Avx512)
}

/// sc[h * n + j0 + j] = scale · Σ_d qr[h][d] · kt[d * stride + j0 + j] for
/// j < TILE, summed over d in order. Panics unless `available()`.
pub fn score_tile<const G: usize>(
    qr: &[[f32; 256]; G],
    hd: usize,
    kt: &[f32],
    stride: usize,
    j0: usize,
    scale: f32,
    n: usize,
    sc: &mut [f32],
) {
    assert!(available() && hd <= 256 && hd > 0);
    assert!(kt.len() >= (hd - 1) * stride + j0 + TILE && j0 + TILE <= n);
    assert!(sc.len() >= (G - 1) * n + j0 + TILE);
    #[cfg(target_arch = "x86_64")]
    // SAFETY: avx512f was detected (asserted); the asserts above bound every
    // load (rows d < hd of kt at j0..j0+TILE) and store (sc rows h < G).
    unsafe {
        score_tile_impl::<G>(
            qr,
            hd,
            kt.as_ptr().add(j0),
            stride,
            scale,
            sc.as_mut_ptr().add(j0),
            n,
        )
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn score_tile_impl<const G: usize>(
    qr: &[[f32; 256]; G],
    hd: usize,
    k: *const f32,
    stride: usize,
    scale: f32,
    sc: *mut f32,
    n: usize,
) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm512_setzero_ps(); 4]; G];
    for d in 0..hd {
        // SAFETY: row d < hd holds TILE floats from k (score_tile's asserts).
        let kv: [__m512; 4] =
            std::array::from_fn(|c| unsafe { _mm512_loadu_ps(k.add(d * stride + c * 16)) });
        for h in 0..G {
            let q = _mm512_set1_ps(qr[h][d]);
            for c in 0..4 {
                acc[h][c] = _mm512_add_ps(acc[h][c], _mm512_mul_ps(q, kv[c]));
            }
        }
    }
    let s = _mm512_set1_ps(scale);
    for h in 0..G {
        for c in 0..4 {
            // SAFETY: row h < G of sc holds TILE floats from sc.
            unsafe { _mm512_storeu_ps(sc.add(h * n + c * 16), _mm512_mul_ps(acc[h][c], s)) };
        }
    }
}

/// out[h * hd + d0 + d] = Σ_j sc[h * n + j] · val(j)[d0 + d] for d < TILE,
/// summed over j in order. Panics unless `available()`.
pub fn value_tile<'k, const G: usize, V: Fn(usize) -> &'k [f32]>(
    val: &V,
    n: usize,
    d0: usize,
    hd: usize,
    sc: &[f32],
    out: &mut [f32],
) {
    assert!(available() && d0 + TILE <= hd);
    assert!(sc.len() >= G * n && out.len() >= G * hd);
    #[cfg(target_arch = "x86_64")]
    // SAFETY: avx512f was detected (asserted); the value rows are sliced
    // (bounds-checked) to TILE floats before loading; stores stay in out.
    unsafe {
        value_tile_impl::<G, V>(val, n, d0, hd, sc, out)
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn value_tile_impl<'k, const G: usize, V: Fn(usize) -> &'k [f32]>(
    val: &V,
    n: usize,
    d0: usize,
    hd: usize,
    sc: &[f32],
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm512_setzero_ps(); 4]; G];
    for j in 0..n {
        let row = &val(j)[d0..d0 + TILE];
        // SAFETY: row holds TILE = 4 · 16 floats.
        let v: [__m512; 4] =
            std::array::from_fn(|c| unsafe { _mm512_loadu_ps(row.as_ptr().add(c * 16)) });
        for h in 0..G {
            let p = _mm512_set1_ps(sc[h * n + j]);
            for c in 0..4 {
                acc[h][c] = _mm512_add_ps(acc[h][c], _mm512_mul_ps(p, v[c]));
            }
        }
    }
    for h in 0..G {
        let o = &mut out[h * hd + d0..h * hd + d0 + TILE];
        for c in 0..4 {
            // SAFETY: o holds TILE floats.
            unsafe { _mm512_storeu_ps(o.as_mut_ptr().add(c * 16), acc[h][c]) };
        }
    }
}
