//! Decode attention kernels: the query heads of one KV head over the live
//! rows of a stream, three passes (scores, weights, value sum) with the
//! normalized probabilities left for scorers that export attention. The
//! AVX-512 path (`decode_avx512`) or the AVX2 one (`decode_avx2`) runs
//! where the CPU's level is that and the shape is supported;
//! `reference::attend_group_probs_seg_ref` elsewhere.

use super::kv_store::KvRow;
use super::reference::attend_group_probs_seg_ref;
use super::{decode_avx2, decode_avx512};

/// Decode attention for the `g` query heads of one KV head when a scorer
/// wants the probabilities: two passes over the stored rows (scores, then one
/// exp per score shared by the value sum and the export) instead of the
/// online pass plus a second exp per score. `sc` (g, n) holds the
/// normalized probabilities on return. Same outputs as `attend_group`.
/// Generic over the row type (f32, f16, q8_0): one loop per cache type.
pub fn attend_group_probs<'k, R: KvRow + ?Sized + 'k>(
    q: &[f32],
    g: usize,
    n: usize,
    key: impl Fn(usize) -> &'k R,
    val: impl Fn(usize) -> &'k R,
    scale: f32,
    sc: &mut [f32],
    out: &mut [f32],
    stats: &mut [(f32, f32)],
) {
    attend_group_probs_seg(q, &[n], g, n, key, val, scale, sc, out, stats)
}

/// `attend_group_probs` with one query per key segment: keys
/// `seg_end[s-1]..seg_end[s]` are scored against query `s` (q: (n_seg, g,
/// head_dim)); see `attend_prefill_group_seg`. One segment is
/// `attend_group_probs`, operation for operation.
///
/// Runs the AVX-512 kernel (`decode_avx512`) or the AVX2 one
/// (`decode_avx2`) at those levels where the shape is supported, else the
/// portable `attend_group_probs_seg_ref`. The choice depends only on the
/// kernel level and (g, head_dim), never on whether a scorer reads the
/// probabilities.
pub fn attend_group_probs_seg<'k, R: KvRow + ?Sized + 'k>(
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
    if decode_avx512::supports(g, hd) && decode_avx512::enabled() {
        decode_avx512::attend(q, seg_end, g, n, key, val, scale, sc, out, stats)
    } else if decode_avx2::supports(g, hd) && decode_avx2::enabled() {
        decode_avx2::attend(q, seg_end, g, n, key, val, scale, sc, out, stats)
    } else {
        attend_group_probs_seg_ref(q, seg_end, g, n, key, val, scale, sc, out, stats)
    }
}
