//! The CPU's attention step for one layer: every query row of the step
//! against the live K/V rows of each KV head, causal by position, with the
//! optional export of attention probabilities into a per-slot mass.
//!
//! - Prefill chunks (n > 1, or any prompt chunk, so that a prompt's
//!   result never depends on its chunking): each KV head's live rows are converted to f32
//!   once per layer (keys transposed), then (token, KV head) pairs are
//!   interleaved over the threads and run the register-tiled prefill
//!   kernel (`prefill_attn_kernels`).
//! - One decoded token: each KV head's keys, in memory order, are cut into
//!   parts of `DECODE_PART` keys that run in parallel (flash-decoding) and
//!   are merged exactly by their softmax statistics (`decode_attn`).
//! - In-cache positions (StreamingLLM pos-shift), computed exactly without
//!   moving or re-rotating stored keys: live entry j (position order) has
//!   in-cache index j and stored key R(p_j)k; the query of a token at
//!   position p with in-cache index c must score R(c)q · R(j)k, which by
//!   RoPE's relative property equals R(a)q · R(p_j)k with a = c + (p_j − j).
//!   The offset p_j − j is constant over runs of the live list (it only
//!   grows where tokens were evicted), so each run gets one query rotated at
//!   a = c + offset; with no eviction there is one run and the pass is the
//!   absolute one, bit for bit.

use super::decode_attn::attend_group_probs_seg;
use super::kv_store::{CpuKv, LayerKv};
use super::pool::{split, Chunks, SharedMut, ThreadPool};
use super::prefill_attn_kernels::attend_prefill_group_seg;
use crate::backend::{AttnStep, KvAccess, MassMode, Rope, MAX_GROUP};

/// Attention scratch of one sequence (grown on demand, never per token).
#[derive(Debug, Default)]
pub struct AttnScratch {
    /// (n_threads, group, n_slots) per-thread attention scores
    att: Vec<f32>,
    /// (n_seg,) end (exclusive, in the live list) of each run of live
    /// entries sharing one offset position − in-cache index
    seg_end: Vec<usize>,
    /// (n_seg,) that offset, nondecreasing
    seg_off: Vec<i64>,
    /// per KV head g: (n_g, hd) f32 copies of its live values for a prefill chunk
    vf: Vec<f32>,
    /// per KV head g: (hd, n_g) transposed f32 keys for a prefill chunk
    kt: Vec<f32>,
    /// (n_kv_heads + 1,) start of each KV head's block in `kt` and `vf`
    koff: Vec<usize>,
    /// (n_parts, group, head_dim) normalized outputs of decode key parts
    part_out: Vec<f32>,
    /// (n_parts, group) (max, sum) softmax statistics of decode key parts
    part_stats: Vec<(f32, f32)>,
    /// (n_parts,) (KV head, first key, end key, offset in `att`) of each part
    items: Vec<(usize, usize, usize, usize)>,
    /// (n_threads, n_slots) per-thread attention-mass accumulators
    mass_thr: Vec<f32>,
    /// Whether this step exports probabilities.
    export: bool,
}

impl LayerKv<'_> {
    /// Values per storage unit.
    fn block_len(&self) -> usize {
        match self {
            LayerKv::Q8(..) => crate::backend::kvstore::QK8_0,
            _ => 1,
        }
    }
}

/// The CPU store behind a cache (the CPU backend only attends over its own).
fn cpu_store(kv: &dyn KvAccess) -> &CpuKv {
    match kv.store().as_any().downcast_ref::<CpuKv>() {
        Some(s) => s,
        None => panic!("the CPU backend was handed a K/V store it did not allocate"),
    }
}

/// Before the first layer of a step: the in-cache position runs, the score
/// scratch, the mass accumulators.
pub fn begin(pool: &ThreadPool, sc: &mut AttnScratch, kv: &dyn KvAccess, st: &AttnStep) {
    let n_threads = pool.n_threads();
    let n_slots = kv.n_slots();
    let group = st.n_heads / st.n_kv_heads;
    sc.seg_end.clear();
    sc.seg_off.clear();
    let live_pos = kv.live_positions();
    if st.cache_positions {
        for (j, &p) in live_pos.iter().enumerate() {
            let off = p - j as i64;
            if sc.seg_off.last() != Some(&off) {
                if !sc.seg_off.is_empty() {
                    sc.seg_end.push(j);
                }
                sc.seg_off.push(off);
            }
        }
    } else {
        sc.seg_off.push(0);
    }
    sc.seg_end.push(live_pos.len());
    if sc.att.len() < n_threads * group * n_slots {
        sc.att.resize(n_threads * group * n_slots, 0.0);
    }
    // per-thread attention-mass accumulators, only when a scorer asks
    sc.export = st.mass != MassMode::None;
    if sc.export {
        sc.mass_thr.clear();
        sc.mass_thr.resize(n_threads * n_slots, 0.0);
    }
}

/// After the last layer: reduce the per-thread mass into `out` (n_slots,).
pub fn end(pool: &ThreadPool, sc: &mut AttnScratch, n_slots: usize, out: &mut [f32]) {
    if !sc.export {
        return;
    }
    out[..n_slots].fill(0.0);
    for t in 0..pool.n_threads() {
        for (o, &x) in out[..n_slots]
            .iter_mut()
            .zip(&sc.mass_thr[t * n_slots..(t + 1) * n_slots])
        {
            *o += x;
        }
    }
}

/// One layer's attention: q (n, n_heads·hd) → out (n, n_heads·hd).
#[allow(clippy::too_many_arguments)]
pub fn layer(
    pool: &ThreadPool,
    sc: &mut AttnScratch,
    kv: &dyn KvAccess,
    st: &AttnStep,
    l: usize,
    rope: &Rope,
    q: &[f32],
    q_raw: &[f32],
    out: &mut [f32],
) {
    let (n, pos0, hd, nkv) = (st.n, st.pos0, st.head_dim, st.n_kv_heads);
    let q_dim = st.n_heads * hd;
    let group = st.n_heads / nkv;
    let n_threads = pool.n_threads();
    let n_slots = kv.n_slots();
    let cache_pos = st.cache_positions;
    let export = sc.export;
    let mass_w = st.mass_w;
    let scale = st.scale;
    let store = cpu_store(kv);
    let base = kv.layer_base(l);
    let lkv = store.rows(base, n_slots);
    let bl = store_block_len(store);
    // value offset of a head inside its store row
    let voff = |off_units: usize| off_units * bl;

    // prefill chunks: convert each KV head's live K/V rows to f32 once
    // per layer, O(n) memory, instead of once per query: head g's keys
    // transposed (hd, n_g) at kt[koff[g]..], values (n_g, hd) at
    // vf[koff[g]..] (n_g = that head's live entries; every head has the
    // shared list in the token-uniform layout)
    let prefill = n > 1 || st.prompt;
    if prefill {
        sc.koff.clear();
        sc.koff.push(0);
        for g in 0..nkv {
            let n_g = kv.head(l, g, false).slots.len();
            sc.koff.push(sc.koff[g] + n_g * hd);
        }
        let total = sc.koff[nkv];
        sc.kt.resize(total, 0.0);
        sc.vf.resize(total, 0.0);
        let koff = &sc.koff;
        let vfo = SharedMut::new(&mut sc.vf[..]);
        let kto = SharedMut::new(&mut sc.kt[..]);
        pool.run(|ti| {
            let mut krow = [0f32; 256];
            for g in 0..nkv {
                let view = kv.head(l, g, false);
                let n_g = view.slots.len();
                let (j0, j1) = split(n_g, ti, n_threads);
                for j in j0..j1 {
                    let sl = view.slots[j] as usize;
                    // SAFETY: rows j0..j1 of head g belong to this thread.
                    let vd = unsafe { vfo.slice(koff[g] + j * hd, hd) };
                    store.read_one(false, base + sl, voff(view.off), vd);
                    // keys transposed: (hd, n_g), column j
                    store.read_one(true, base + sl, voff(view.off), &mut krow[..hd]);
                    for (d, &x) in krow[..hd].iter().enumerate() {
                        // SAFETY: column j of head g belongs to this thread.
                        unsafe { kto.write(koff[g] + d * n_g + j, x) };
                    }
                }
            }
        });
    }

    // multi-head attention over live slots, causal by position:
    // att_out[i, h] = softmax(q[i,h]·K[j] * scale, pos_j ≤ pos_i) @ V[j]
    if !prefill && !cache_pos {
        // one decoded token: every KV head's keys in parts, in parallel
        // (flash-decoding), merged by their softmax statistics
        let mass = if export && st.mass != MassMode::None {
            Some((&mut sc.mass_thr[..n_slots], mass_w))
        } else {
            None
        };
        let dec = DecodeScratch {
            att: &mut sc.att,
            part_out: &mut sc.part_out,
            part_stats: &mut sc.part_stats,
            items: &mut sc.items,
        };
        attend_decode_split(
            kv,
            lkv,
            l,
            hd,
            &q[..q_dim],
            group,
            scale,
            pool,
            dec,
            &mut out[..q_dim],
            mass,
        );
    } else {
        // decoding sees every live token: walk them in memory order
        // (in-cache positions need position order for their key runs)
        let memory_order = !(prefill || cache_pos);
        let (seg_end, seg_off) = (&sc.seg_end, &sc.seg_off);

        let (vf, kt, koff) = (&sc.vf, &sc.kt, &sc.koff);
        let out = SharedMut::new(&mut out[..n * q_dim]);
        let att = SharedMut::new(&mut sc.att[..n_threads * group * n_slots]);
        let mthr = SharedMut::new(&mut sc.mass_thr[..]);
        let mass_mode = if export { st.mass } else { MassMode::None };
        let n_work = n * nkv;
        pool.run(|ti| {
            // SAFETY: each thread uses its own rows of the score scratch.
            let sc = unsafe { att.slice(ti * group * n_slots, group * n_slots) };
            let mut stats = [(0f32, 0f32); MAX_GROUP];
            // (n_seg, group, hd) per-run queries and (n_seg,) run ends,
            // only filled for in-cache positions (no allocation otherwise)
            let mut qsegs: Vec<f32> = Vec::new();
            let mut ends: Vec<usize> = Vec::new();
            // interleaved, not contiguous: causal rows grow with i, so a
            // contiguous split would leave the last thread most of the work
            for work in (ti..n_work).step_by(n_threads) {
                // token i, KV head g, serving query heads g*group .. (g+1)*group
                let (i, g) = (work / nkv, work % nkv);
                let view = kv.head(l, g, memory_order);
                let (live_slots, live_pos) = (view.slots, view.pos);
                let qg = &q[i * q_dim + g * group * hd..i * q_dim + (g + 1) * group * hd];
                let pos = (pos0 + i) as i64;
                let n_vis = if prefill || cache_pos {
                    live_pos.partition_point(|&p| p <= pos)
                } else {
                    live_pos.len()
                };
                // a sliding window hides keys at or before pos − window
                // (prefill only: a windowed cache holds just the window
                // when decoding)
                let lo = if prefill && st.window > 0 {
                    live_pos.partition_point(|&p| p <= pos - st.window as i64)
                } else {
                    0
                };
                // the query of each run of keys (one run unless in-cache positions)
                let one_run = [n_vis];
                let (qs, es): (&[f32], &[usize]) = if cache_pos {
                    qsegs.clear();
                    ends.clear();
                    // the query's own offset: position − in-cache index
                    let off_q = pos - (n_vis as i64 - 1);
                    let mut start = 0;
                    for (&e, &off) in seg_end.iter().zip(seg_off) {
                        if start >= n_vis {
                            break;
                        }
                        let q0 = qsegs.len();
                        if off == off_q {
                            qsegs.extend_from_slice(qg);
                        } else {
                            qsegs.extend_from_slice(
                                &q_raw
                                    [i * q_dim + g * group * hd..i * q_dim + (g + 1) * group * hd],
                            );
                            // a = c + off, c = n_vis − 1
                            let a = (n_vis as i64 - 1 + off) as usize;
                            rope.apply(&mut qsegs[q0..], group, hd, a);
                        }
                        ends.push(e.min(n_vis));
                        start = e;
                    }
                    (&qsegs, &ends)
                } else {
                    (qg, &one_run)
                };
                // SAFETY: (i, g) pairs are disjoint between threads.
                let o = unsafe { out.slice(i * q_dim + g * group * hd, group * hd) };
                let export_row = match mass_mode {
                    MassMode::None => false,
                    MassMode::LastRow => i + 1 == n,
                    MassMode::AllRows => true,
                };
                if prefill {
                    // rows pre-converted for this chunk (j indexes the head's
                    // live list): keys transposed, values row-major
                    // (the window's keys start at column lo)
                    let n_live = live_slots.len();
                    let kt_g = &kt[koff[g] + lo..];
                    let vf_g = &vf[koff[g] + lo * hd..];
                    let val = |j: usize| &vf_g[j * hd..(j + 1) * hd];
                    let win = [n_vis - lo];
                    let es = if lo > 0 { &win[..] } else { es };
                    attend_prefill_group_seg(
                        qs,
                        es,
                        group,
                        n_vis - lo,
                        kt_g,
                        n_live,
                        val,
                        scale,
                        &mut sc[..group * (n_vis - lo)],
                        o,
                        &mut stats[..group],
                    );
                } else {
                    // one kernel whether or not probabilities are exported, so a
                    // policy that never evicts reproduces the full cache bit for bit;
                    // one monomorphized loop per cache type, chosen here per (token,
                    // head), never per element. Head g is units g*hu..(g+1)*hu of a
                    // row of rl units (hu = hd values, or hd/32 q8_0 blocks).
                    let (rl, off, hu) = (view.stride, view.off, hd / bl);
                    macro_rules! run {
                        ($k:expr, $v:expr) => {{
                            let (k, v) = ($k, $v);
                            let at = |j: usize| live_slots[j] as usize * rl + off;
                            attend_group_probs_seg(
                                qs,
                                es,
                                group,
                                n_vis,
                                |j: usize| &k[at(j)..at(j) + hu],
                                |j: usize| &v[at(j)..at(j) + hu],
                                scale,
                                &mut sc[..group * n_vis],
                                o,
                                &mut stats[..group],
                            )
                        }};
                    }
                    match lkv {
                        LayerKv::F32(k, v) => run!(k, v),
                        LayerKv::F16(k, v) => run!(k, v),
                        LayerKv::Q8(k, v) => run!(k, v),
                    }
                }
                if export_row {
                    // SAFETY: each thread accumulates into its own row.
                    let acc = unsafe { mthr.slice(ti * n_slots, n_slots) };
                    // sc holds each head's normalized probabilities
                    let m = n_vis - lo;
                    for h in 0..group {
                        for j in 0..m {
                            acc[live_slots[lo + j] as usize] += sc[h * m + j] * mass_w;
                        }
                    }
                }
            }
        });
    }
}

fn store_block_len(s: &CpuKv) -> usize {
    use crate::backend::KvStore;
    s.ty().block_len()
}

/// Keys per part when one decoded token's attention is split.
pub const DECODE_PART: usize = 256;

/// Scratch of `attend_decode_split` (borrowed from `CpuScratch`).
struct DecodeScratch<'a> {
    att: &'a mut Vec<f32>,
    part_out: &'a mut Vec<f32>,
    part_stats: &'a mut Vec<(f32, f32)>,
    items: &'a mut Vec<(usize, usize, usize, usize)>,
}

/// Attention of one decoded token at `layer`: q (n_heads · hd) against
/// every live key of each KV head, into `out` (n_heads · hd). Each KV
/// head's keys (memory order) are cut into parts of `DECODE_PART` keys; the
/// parts run in parallel through the fused kernel, each yielding normalized
/// outputs and probabilities plus its (max, sum), and are merged exactly:
/// with M = max_p m_p and w_p = s_p · e^(m_p − M), out = Σ w_p out_p / Σ w_p
/// and part p's probabilities scale by w_p / Σ w_p. The cut depends only on
/// the number of keys, never on the thread count, so results are the same
/// for any -t. With `mass`, every probability times its weight is added to
/// the (n_slots,) accumulator.
#[allow(clippy::too_many_arguments)]
fn attend_decode_split(
    kv: &dyn KvAccess,
    lkv: LayerKv<'_>,
    layer: usize,
    hd: usize,
    q: &[f32],
    group: usize,
    scale: f32,
    pool: &ThreadPool,
    d: DecodeScratch<'_>,
    out: &mut [f32],
    mass: Option<(&mut [f32], f32)>,
) {
    let nkv = q.len() / (group * hd);
    // the parts: (KV head, keys j0..j1 of its memory-order list, offset of
    // their (group, j1 − j0) probabilities in `att`)
    d.items.clear();
    let mut at = 0;
    for g in 0..nkv {
        let nv = kv.head(layer, g, true).slots.len();
        let np = nv.div_ceil(DECODE_PART).max(1);
        for p in 0..np {
            let (j0, j1) = (p * nv / np, (p + 1) * nv / np);
            d.items.push((g, j0, j1, at));
            at += group * (j1 - j0);
        }
    }
    let n_items = d.items.len();
    if d.att.len() < at {
        d.att.resize(at, 0.0);
    }
    d.part_out.resize(n_items * group * hd, 0.0);
    d.part_stats.resize(n_items * group, (0.0, 0.0));
    {
        let items = &*d.items;
        let att = SharedMut::new(&mut d.att[..at]);
        let po = SharedMut::new(&mut d.part_out[..]);
        let ps = SharedMut::new(&mut d.part_stats[..]);
        let hu = hd / lkv.block_len();
        // parts go to whichever thread asks next: with per-head streams
        // of uneven lengths a fixed deal leaves one thread the long heads
        let parts = Chunks::new(n_items);
        pool.run(|_| {
            while let Some(it) = parts.next() {
                let (g, j0, j1, off) = items[it];
                let view = kv.head(layer, g, true);
                let (slots, stride, hoff) = (&view.slots[j0..j1], view.stride, view.off);
                let m = j1 - j0;
                let qg = &q[g * group * hd..(g + 1) * group * hd];
                // SAFETY: item `it` owns its probabilities, output and statistics.
                let (sc, o, st) = unsafe {
                    (
                        att.slice(off, group * m),
                        po.slice(it * group * hd, group * hd),
                        ps.slice(it * group, group),
                    )
                };
                if m == 0 {
                    o.fill(0.0);
                    st.fill((f32::NEG_INFINITY, 0.0));
                    continue;
                }
                macro_rules! run {
                    ($k:expr, $v:expr) => {{
                        let (k, v) = ($k, $v);
                        let at = |j: usize| slots[j] as usize * stride + hoff;
                        attend_group_probs_seg(
                            qg,
                            &[m],
                            group,
                            m,
                            |j: usize| &k[at(j)..at(j) + hu],
                            |j: usize| &v[at(j)..at(j) + hu],
                            scale,
                            sc,
                            o,
                            st,
                        )
                    }};
                }
                match lkv {
                    LayerKv::F32(k, v) => run!(k, v),
                    LayerKv::F16(k, v) => run!(k, v),
                    LayerKv::Q8(k, v) => run!(k, v),
                }
            }
        });
    }
    // merge the parts of each KV head (a single part is copied as is)
    let mut mass = mass;
    let mut first = 0;
    while first < n_items {
        let g = d.items[first].0;
        let last = (first..n_items)
            .find(|&i| d.items[i].0 != g)
            .unwrap_or(n_items);
        let o = &mut out[g * group * hd..(g + 1) * group * hd];
        for h in 0..group {
            let mx = (first..last)
                .map(|i| d.part_stats[i * group + h].0)
                .fold(f32::NEG_INFINITY, f32::max);
            let total: f32 = (first..last)
                .map(|i| {
                    let (m, s) = d.part_stats[i * group + h];
                    if s > 0.0 {
                        s * (m - mx).exp()
                    } else {
                        0.0
                    }
                })
                .sum();
            let oh = &mut o[h * hd..(h + 1) * hd];
            oh.fill(0.0);
            for i in first..last {
                let (m, s) = d.part_stats[i * group + h];
                let wgt = if last - first == 1 {
                    1.0
                } else if s > 0.0 && total > 0.0 {
                    s * (m - mx).exp() / total
                } else {
                    0.0
                };
                let src = &d.part_out[(i * group + h) * hd..(i * group + h + 1) * hd];
                if last - first == 1 {
                    oh.copy_from_slice(src);
                } else {
                    for (y, &x) in oh.iter_mut().zip(src) {
                        *y += wgt * x;
                    }
                }
                if let Some((acc, mw)) = mass.as_mut() {
                    let (_, j0, j1, off) = d.items[i];
                    let slots = &kv.head(layer, g, true).slots[j0..j1];
                    let m = j1 - j0;
                    let p = &d.att[off + h * m..off + (h + 1) * m];
                    for (&sl, &x) in slots.iter().zip(p) {
                        acc[sl as usize] += x * wgt * *mw;
                    }
                }
            }
        }
        first = last;
    }
}
