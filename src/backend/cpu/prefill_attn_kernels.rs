//! Prefill attention kernels: the query heads of one KV head over a chunk's
//! visible keys, two-pass (scores for all keys from transposed keys, then
//! softmax and the value sum), register-tiled per group size, with
//! AVX-512 tiles where the CPU has them. `reference::prefill_group_dyn` is
//! the portable form (any group size, key segments) they equal bit for bit.

use super::prefill_avx512 as attn512;
use super::reference::prefill_group_dyn;
use half::f16;

/// Prefill attention for the `g` query heads of one KV head over `n` keys,
/// two-pass instead of online: scores for all keys at once from keys stored
/// transposed (`kt`: (head_dim, stride), key j's dimension d at
/// `kt[d * stride + j]`), so the score loop vectorizes across keys with no
/// horizontal sums; then max, exp and the value sum. Same outputs as
/// `attend_group` (up to float summation order; tested in tests/engine/kernels.rs).
///
/// q: (g, head_dim); v(j): value row j (head_dim); `sc`: (g, n) scratch that
/// holds the normalized attention probabilities on return; out: (g,
/// head_dim); stats: (g,) (max score, sum of exp(s - max)).
pub fn attend_prefill_group<'k>(
    q: &[f32],
    g: usize,
    n: usize,
    kt: &[f32],
    stride: usize,
    val: impl Fn(usize) -> &'k [f32],
    scale: f32,
    sc: &mut [f32],
    out: &mut [f32],
    stats: &mut [(f32, f32)],
) {
    attend_prefill_group_seg(q, &[n], g, n, kt, stride, val, scale, sc, out, stats)
}

/// `attend_prefill_group` with one query per key segment: keys
/// `seg_end[s-1]..seg_end[s]` are scored against query `s` (q: (n_seg, g,
/// head_dim)). Used by `--pos-mode cache`, where keys stored at absolute
/// RoPE positions meet a query rotated per segment (see `model::llama`).
/// With one segment it is `attend_prefill_group`, operation for operation.
pub fn attend_prefill_group_seg<'k>(
    q: &[f32],
    seg_end: &[usize],
    g: usize,
    n: usize,
    kt: &[f32],
    stride: usize,
    val: impl Fn(usize) -> &'k [f32],
    scale: f32,
    sc: &mut [f32],
    out: &mut [f32],
    stats: &mut [(f32, f32)],
) {
    let ns = seg_end.len();
    let hd = q.len() / (g * ns);
    assert!(hd <= 256 && q.len() == ns * g * hd && out.len() == g * hd && sc.len() >= g * n);
    assert!(
        seg_end.last().is_some_and(|&e| e >= n),
        "segments must cover the keys"
    );
    assert!(n == 0 || kt.len() >= (hd - 1) * stride + n);
    if ns == 1 && hd.is_multiple_of(LANES) {
        type F<'k, V> =
            fn(&[f32], usize, &[f32], usize, &V, f32, &mut [f32], &mut [f32], &mut [(f32, f32)]);
        let f: F<'_, _> = match g {
            1 => prefill_group::<1, _>,
            2 => prefill_group::<2, _>,
            3 => prefill_group::<3, _>,
            4 => prefill_group::<4, _>,
            5 => prefill_group::<5, _>,
            6 => prefill_group::<6, _>,
            7 => prefill_group::<7, _>,
            8 => prefill_group::<8, _>,
            _ => {
                return prefill_group_dyn(
                    q,
                    seg_end,
                    n,
                    kt,
                    stride,
                    &val,
                    scale,
                    sc,
                    out,
                    &mut stats[..g],
                )
            }
        };
        return f(q, n, kt, stride, &val, scale, sc, out, &mut stats[..g]);
    }
    prefill_group_dyn(
        q,
        seg_end,
        n,
        kt,
        stride,
        &val,
        scale,
        sc,
        out,
        &mut stats[..g],
    );
}

/// Lanes of the register tiles of `prefill_group` (one 512-bit vector).
const LANES: usize = 16;

/// `attend_prefill_group` for a group of G heads (head_dim a multiple of
/// LANES): scores for LANES keys at a time with all G heads' accumulators
/// in registers (each key row loaded once for the group), then the value
/// sum LANES dimensions at a time over all keys. Every score and output
/// element is summed in the same order as `prefill_group_dyn`, so the two
/// agree bit for bit.
fn prefill_group<'k, const G: usize, V: Fn(usize) -> &'k [f32]>(
    q: &[f32],
    n: usize,
    kt: &[f32],
    stride: usize,
    val: &V,
    scale: f32,
    sc: &mut [f32],
    out: &mut [f32],
    stats: &mut [(f32, f32)],
) {
    let hd = q.len() / G;
    // queries rounded to f16, as elsewhere                       (G, hd)
    let mut qr = [[0f32; 256]; G];
    for h in 0..G {
        for d in 0..hd {
            qr[h][d] = f16::from_f32(q[h * hd + d]).to_f32();
        }
    }
    // scores s[h][j] = Σ_d q[h][d] * K[j][d], attn512::TILE keys at a
    // time where the CPU has the tiles, then LANES at a time
    let simd = attn512::enabled();
    let mut j0 = 0;
    while simd && j0 + attn512::TILE <= n {
        attn512::score_tile::<G>(&qr, hd, kt, stride, j0, scale, n, sc);
        j0 += attn512::TILE;
    }
    while j0 < n {
        let w = (n - j0).min(LANES);
        let mut acc = [[0f32; LANES]; G];
        if w == LANES {
            for d in 0..hd {
                let k: &[f32; LANES] = kt[d * stride + j0..][..LANES].try_into().unwrap();
                for h in 0..G {
                    let qd = qr[h][d];
                    for l in 0..LANES {
                        acc[h][l] += qd * k[l];
                    }
                }
            }
        } else {
            for d in 0..hd {
                let k = &kt[d * stride + j0..d * stride + j0 + w];
                for h in 0..G {
                    let qd = qr[h][d];
                    for l in 0..w {
                        acc[h][l] += qd * k[l];
                    }
                }
            }
        }
        for h in 0..G {
            for l in 0..w {
                sc[h * n + j0 + l] = acc[h][l] * scale;
            }
        }
        j0 += w;
    }
    // softmax weights
    let mut sum = [0f32; G];
    for h in 0..G {
        let s = &mut sc[h * n..(h + 1) * n];
        let m = s.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        for x in s.iter_mut() {
            *x = (*x - m).exp();
            sum[h] += *x;
        }
        stats[h] = (m, sum[h]);
    }
    // value sum o[h][d] = Σ_j p[h][j] * V[j][d], attn512::TILE dimensions
    // at a time where the CPU has the tiles, then LANES at a time
    let mut c0 = 0;
    while simd && (c0 * LANES) + attn512::TILE <= hd {
        attn512::value_tile::<G, V>(val, n, c0 * LANES, hd, sc, out);
        c0 += attn512::TILE / LANES;
    }
    for c in c0..hd / LANES {
        let mut acc = [[0f32; LANES]; G];
        for j in 0..n {
            let v: &[f32; LANES] = val(j)[c * LANES..(c + 1) * LANES].try_into().unwrap();
            for h in 0..G {
                let p = sc[h * n + j];
                for l in 0..LANES {
                    acc[h][l] += p * v[l];
                }
            }
        }
        for h in 0..G {
            out[h * hd + c * LANES..h * hd + (c + 1) * LANES].copy_from_slice(&acc[h]);
        }
    }
    for h in 0..G {
        let inv = if sum[h] == 0.0 { 0.0 } else { 1.0 / sum[h] };
        for a in out[h * hd..(h + 1) * hd].iter_mut() {
            *a *= inv;
        }
        // leave the normalized probabilities for scorers that asked for them
        for x in sc[h * n..(h + 1) * n].iter_mut() {
            *x *= inv;
        }
    }
}
