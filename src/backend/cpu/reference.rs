//! Scalar reference kernels. The parity tests hold every SIMD or tiled
//! kernel of the CPU backend to these; where a fast path is missing (no
//! AVX-512, an unsupported shape) the backend runs them in production too.
//!
//! - `attend_head`: one query head, online softmax, ggml's f16 dot product
//!   (the reference of the grouped kernels);
//! - `attend_group`: one KV head's query group, online softmax;
//! - `attend_group_probs_seg_ref`: the portable decode kernel (three
//!   passes, probabilities exported), fallback of `decode_attn`;
//! - `prefill_group_dyn`: the portable prefill kernel, fallback and
//!   reference of `prefill_attn_kernels`;
//! - `exp_ref` (in `decode_avx512`) and `tile_q4_1_q8_1_scalar` (in
//!   `qgemm_x86`) sit next to the vector code they model lane for lane.

use super::kv_store::KvRow;
use crate::backend::MAX_GROUP;
use ggml_sys::CpuTraits;
use half::f16;
use half::slice::HalfFloatSliceExt;

/// Attention of one query head over `n` cached entries: online softmax
/// (running max M and sum S) over scores q·k_j·scale, values accumulated in
/// f32. As in llama.cpp's CPU flash attention, the query is rounded to f16
/// and scores use ggml's f16 SIMD dot product against the f16 keys.
///
/// `key(j)` / `val(j)` return entry j's head slice (head_dim f16 values);
/// `scores`, if given, receives the scaled raw scores (n,). Writes out
/// (head_dim,) and returns the row's (max, sum of exp(s - max)), from which
/// probabilities are exp(s_j - max) / sum. Memory is O(head_dim) whatever n
/// is: no score matrix is ever built.
pub fn attend_head<'k>(
    f16dot: &CpuTraits,
    q: &[f32],
    n: usize,
    key: impl Fn(usize) -> &'k [f16],
    val: impl Fn(usize) -> &'k [f16],
    scale: f32,
    out: &mut [f32],
    mut scores: Option<&mut [f32]>,
) -> (f32, f32) {
    let hd = q.len();
    let mut q16 = [f16::ZERO; 256];
    let q16 = &mut q16[..hd];
    q16.convert_from_f32_slice(q);
    let q16b: &[u8] = bytemuck::cast_slice(q16);
    out.fill(0.0);
    let (mut m, mut sum) = (f32::NEG_INFINITY, 0f32);
    for j in 0..n {
        let s = f16dot.dot(hd, bytemuck::cast_slice(key(j)), q16b) * scale;
        if let Some(sc) = scores.as_deref_mut() {
            sc[j] = s;
        }
        let mut vs = 1f32;
        if s > m {
            // new maximum: rescale what was accumulated so far
            let ms = (m - s).exp();
            m = s;
            for o in out.iter_mut() {
                *o *= ms;
            }
            sum *= ms;
        } else {
            vs = (s - m).exp();
        }
        axpy_f16(out, vs, val(j));
        sum += vs;
    }
    let inv = if sum == 0.0 { 0.0 } else { 1.0 / sum };
    for o in out.iter_mut() {
        *o *= inv;
    }
    (m, sum)
}

/// Grouped-query attention for the `g` query heads that share one KV head:
/// each cached key and value row is converted from f16 once and used by all
/// of them (the decode hot loop; `attend_head` is its per-head reference).
/// Numerics as `attend_head`: query rounded to f16, scores accumulated in
/// f32, online softmax, f32 value accumulator.
///
/// q: (g, head_dim); out: (g, head_dim); `scores`, if given: (g, n) raw
/// scaled scores. Returns each head's (max, sum of exp(s - max)) in `stats`.
pub fn attend_group<'k, R: KvRow + ?Sized + 'k>(
    q: &[f32],
    g: usize,
    n: usize,
    key: impl Fn(usize) -> &'k R,
    val: impl Fn(usize) -> &'k R,
    scale: f32,
    out: &mut [f32],
    mut scores: Option<&mut [f32]>,
    stats: &mut [(f32, f32)],
) {
    let hd = q.len() / g;
    assert!(g <= MAX_GROUP && hd <= 256 && q.len() == g * hd && out.len() == g * hd);
    // query rounded to f16, as llama.cpp's kernel does, kept in f32
    let mut qr = [0f32; MAX_GROUP * 256];
    for (d, &x) in qr.iter_mut().zip(q) {
        *d = f16::from_f32(x).to_f32();
    }
    let mut m = [f32::NEG_INFINITY; MAX_GROUP];
    let mut sum = [0f32; MAX_GROUP];
    out.fill(0.0);
    let mut k32 = [0f32; 256];
    let mut v32 = [0f32; 256];
    for j in 0..n {
        let kr = key(j).as_f32(&mut k32[..hd]);
        let vr = val(j).as_f32(&mut v32[..hd]);
        for h in 0..g {
            let qh = &qr[h * hd..(h + 1) * hd];
            let s = dot_f32(qh, kr) * scale;
            if let Some(sc) = scores.as_deref_mut() {
                sc[h * n + j] = s;
            }
            let o = &mut out[h * hd..(h + 1) * hd];
            let mut vs = 1f32;
            if s > m[h] {
                // new maximum: rescale what was accumulated so far
                let ms = (m[h] - s).exp();
                m[h] = s;
                for x in o.iter_mut() {
                    *x *= ms;
                }
                sum[h] *= ms;
            } else {
                vs = (s - m[h]).exp();
            }
            for (x, &v) in o.iter_mut().zip(vr) {
                *x += vs * v;
            }
            sum[h] += vs;
        }
    }
    for h in 0..g {
        let inv = if sum[h] == 0.0 { 0.0 } else { 1.0 / sum[h] };
        for x in out[h * hd..(h + 1) * hd].iter_mut() {
            *x *= inv;
        }
        stats[h] = (m[h], sum[h]);
    }
}

/// `attend_prefill_group_seg` for any group size and any key segments, one
/// head at a time (the reference of the register-tiled `prefill_group`,
/// which it equals bit for bit with one segment; q: (n_seg, g, head_dim),
/// stats: (g,)).
pub fn prefill_group_dyn<'k, V: Fn(usize) -> &'k [f32]>(
    q: &[f32],
    seg_end: &[usize],
    n: usize,
    kt: &[f32],
    stride: usize,
    val: &V,
    scale: f32,
    sc: &mut [f32],
    out: &mut [f32],
    stats: &mut [(f32, f32)],
) {
    let g = stats.len();
    let hd = q.len() / (g * seg_end.len());
    for h in 0..g {
        let s = &mut sc[h * n..(h + 1) * n];
        s.fill(0.0);
        // scores: s[j] = Σ_d q[d] * K[j][d], query rounded to f16 as elsewhere
        let mut j0 = 0;
        for (si, &j1) in seg_end.iter().enumerate() {
            let j1 = j1.min(n);
            if j1 <= j0 {
                continue;
            }
            let qs = &q[si * g * hd..(si + 1) * g * hd];
            let ss = &mut s[j0..j1];
            for d in 0..hd {
                let qd = f16::from_f32(qs[h * hd + d]).to_f32();
                let row = &kt[d * stride + j0..d * stride + j1];
                for (x, &k) in ss.iter_mut().zip(row) {
                    *x += qd * k;
                }
            }
            j0 = j1;
        }
        let mut m = f32::NEG_INFINITY;
        for x in s.iter_mut() {
            *x *= scale;
            m = m.max(*x);
        }
        // softmax weights and the value sum
        let o = &mut out[h * hd..(h + 1) * hd];
        o.fill(0.0);
        let mut sum = 0f32;
        for (j, x) in s.iter_mut().enumerate() {
            let p = (*x - m).exp();
            *x = p;
            sum += p;
            for (a, &v) in o.iter_mut().zip(val(j)) {
                *a += p * v;
            }
        }
        let inv = if sum == 0.0 { 0.0 } else { 1.0 / sum };
        for a in o.iter_mut() {
            *a *= inv;
        }
        // leave the normalized probabilities for scorers that asked for them
        for x in s.iter_mut() {
            *x *= inv;
        }
        stats[h] = (m, sum);
    }
}

/// The portable decode kernel (scalar libm `exp`, rows converted to f32
/// through a buffer): the fallback of `attend_group_probs_seg` and the
/// reference its SIMD path is tested against.
pub fn attend_group_probs_seg_ref<'k, R: KvRow + ?Sized + 'k>(
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
    let ns = seg_end.len();
    let hd = q.len() / (g * ns);
    assert!(
        g <= MAX_GROUP
            && hd <= 256
            && q.len() == ns * g * hd
            && out.len() == g * hd
            && sc.len() >= g * n
            && seg_end.last().is_some_and(|&e| e >= n)
    );
    let mut qr = [0f32; MAX_GROUP * 256];
    let mut k32 = [0f32; 256];
    let mut m = [f32::NEG_INFINITY; MAX_GROUP];
    // pass 1: scores (each key row converted once for the whole group)
    let mut j0 = 0;
    for (si, &j1) in seg_end.iter().enumerate() {
        let j1 = j1.min(n);
        if j1 <= j0 {
            continue;
        }
        for (d, &x) in qr.iter_mut().zip(&q[si * g * hd..(si + 1) * g * hd]) {
            *d = f16::from_f32(x).to_f32();
        }
        for j in j0..j1 {
            let kr = key(j).as_f32(&mut k32[..hd]);
            for h in 0..g {
                let x = dot_f32(&qr[h * hd..(h + 1) * hd], kr) * scale;
                sc[h * n + j] = x;
                m[h] = m[h].max(x);
            }
        }
        j0 = j1;
    }
    // pass 2: weights
    let mut sum = [0f32; MAX_GROUP];
    for h in 0..g {
        for x in sc[h * n..(h + 1) * n].iter_mut() {
            *x = (*x - m[h]).exp();
            sum[h] += *x;
        }
    }
    // pass 3: value sum (each value row converted once)
    out.fill(0.0);
    let mut v32 = [0f32; 256];
    for j in 0..n {
        let vr = val(j).as_f32(&mut v32[..hd]);
        for h in 0..g {
            let p = sc[h * n + j];
            for (a, &v) in out[h * hd..(h + 1) * hd].iter_mut().zip(vr) {
                *a += p * v;
            }
        }
    }
    for h in 0..g {
        let inv = if sum[h] == 0.0 { 0.0 } else { 1.0 / sum[h] };
        for a in out[h * hd..(h + 1) * hd].iter_mut() {
            *a *= inv;
        }
        for x in sc[h * n..(h + 1) * n].iter_mut() {
            *x *= inv;
        }
        stats[h] = (m[h], sum[h]);
    }
}

/// f32 dot product with 8 independent partial sums (vectorizes).
#[inline(always)]
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let mut s = [0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        for j in 0..8 {
            s[j] += a[c * 8 + j] * b[c * 8 + j];
        }
    }
    let mut tail = 0f32;
    for j in chunks * 8..a.len() {
        tail += a[j] * b[j];
    }
    s.iter().sum::<f32>() + tail
}

/// out += a * v (v in f16).
#[inline]
pub fn axpy_f16(out: &mut [f32], a: f32, v: &[f16]) {
    let mut buf = [0f32; 256];
    let vf = &mut buf[..v.len()];
    v.convert_to_f32_slice(vf);
    for (o, &x) in out.iter_mut().zip(vf.iter()) {
        *o += a * x;
    }
}
