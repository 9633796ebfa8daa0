//! Per-(layer, KV-head) streams: the pool's slot bookkeeping as exact
//! vectors, the stream evictor against a brute-force reference, SnapKV's
//! window scores against a direct computation on the real model, the stream
//! attention path against the token-uniform one, and real per-head
//! variable-length storage for adakv/pyramidkv, the global budget rule and
//! a wrapper rescoring stream scores.

use crate::util;

use kvrun::backend::pool::ThreadPool;
use kvrun::format::gguf::Gguf;
use kvrun::generate::{KvPolicy, Session};
use kvrun::kv::streams::Region;
use kvrun::kv::{KvCache, KvType, Layout};
use kvrun::model::llama::Logits;
use kvrun::model::ModelView;
use kvrun::model::Weights;
use kvrun::policy::budget::layer_budgets;
use kvrun::policy::snapkv::window_scores;
use kvrun::policy::snapkv::{SnapKv, SnapOptions};
use kvrun::policy::streams::{stream_offsets, Group, StreamPlan};
use kvrun::policy::table::ScorerOptions;
use kvrun::policy::wrap::{Rescorer, Wrapped};
use kvrun::policy::{
    find, BudgetRule, CacheShape, Caps, Entries, Evictor, Policy, ScoreCtx, Scorer,
};
use kvrun::sample::Rng;
use kvrun::tokenizer::Tokenizer;
use std::sync::{Arc, Mutex};

const THREADS: usize = 1;

fn region(first_stream: usize, n_streams: usize, rows: usize) -> Region {
    Region {
        first_stream,
        n_streams,
        rows,
    }
}

fn wiki_tokens(g: &Gguf, n: usize) -> Vec<u32> {
    let tok = Tokenizer::from_gguf(g).unwrap();
    let ids = tok.encode(&util::wikitext(n * 8), false, false).unwrap();
    ids[..n].to_vec()
}

fn evictor(budget: usize, n_sink: usize, n_recent: usize, evict_every: usize) -> Evictor {
    Evictor {
        budget,
        n_sink,
        n_recent,
        keep_prompt_until: 0,
        evict_every,
    }
}

fn policy(name: &str, e: Evictor) -> KvPolicy {
    let p = find(name)
        .unwrap()
        .build(&ScorerOptions::default())
        .unwrap()
        .unwrap();
    KvPolicy::new(p, e)
}

/// (slots, positions) of every stream.
fn lists(kv: &KvCache) -> Vec<(Vec<u32>, Vec<i64>)> {
    let st = kv.streams().unwrap();
    (0..st.n_streams())
        .map(|s| {
            let (a, b) = st.stream(s);
            (a.to_vec(), b.to_vec())
        })
        .collect()
}

// ------------------------------------------------------------ 1. pool bookkeeping

#[test]
fn stream_pool_exact_vectors() {
    // 2 layers × 2 KV heads (head_dim 4): 4 streams over a pool of 10 rows
    let mut kv = KvCache::with_streams(2, 8, 4, &[region(0, 4, 10)], KvType::F16).unwrap();
    assert_eq!(kv.layout(), Layout::Streams);
    assert_eq!(kv.n_streams(), 4);
    assert_eq!(
        kv.bytes_allocated(),
        10 * 2 * 4 * 2,
        "10 rows of K+V, 4 f16 each"
    );
    let mut slots = Vec::new();
    // two tokens: every stream gets one entry per token, stream-major
    kv.apply(&[], &[0, 1], &mut slots).unwrap();
    assert_eq!(slots, vec![0, 1, 2, 3, 4, 5, 6, 7]);
    assert_eq!(
        lists(&kv),
        vec![
            (vec![0, 1], vec![0, 1]),
            (vec![2, 3], vec![0, 1]),
            (vec![4, 5], vec![0, 1]),
            (vec![6, 7], vec![0, 1]),
        ]
    );
    assert_eq!(
        (kv.cells.n_live(), kv.peak_entries, kv.peak_live),
        (8, 8, 2)
    );
    assert_eq!(kv.resident_tokens(), 2);
    // a third token does not fit (12 > 10): an error, nothing changes
    assert!(kv.apply(&[], &[2], &mut slots).is_err());
    assert_eq!(kv.cells.n_live(), 8);
    // evict position 0 from stream 1 only and position 1 from stream 2:
    // the streams now differ; the freed rows serve whoever comes next
    kv.apply(&[2, 5], &[2], &mut slots).unwrap();
    // ring search from the head (8): 8, 9, then the holes 2 and 5, wrapping
    assert_eq!(slots, vec![8, 9, 2, 5]);
    assert_eq!(
        lists(&kv),
        vec![
            (vec![0, 1, 8], vec![0, 1, 2]),
            (vec![3, 9], vec![1, 2]),
            (vec![4, 2], vec![0, 2]),
            (vec![6, 7, 5], vec![0, 1, 2]),
        ]
    );
    let st = kv.streams().unwrap();
    assert_eq!((st.owner(2), st.owner(5), st.owner(9)), (2, 3, 1));
    assert_eq!(
        (kv.cells.n_live(), kv.peak_entries, kv.peak_live),
        (10, 10, 3)
    );
    // head views: each (layer, head) sees its own list, rows of head_dim
    let v = kv.head(0, 1, true);
    assert_eq!(
        (v.slots, v.pos, v.stride, v.off),
        (&[3u32, 9][..], &[1i64, 2][..], 4, 0)
    );
    let v = kv.head(1, 0, false);
    assert_eq!((v.slots, v.pos), (&[4u32, 2][..], &[0i64, 2][..]));
    // positions in a range leave every stream
    let mut victims = kv.entries_in(1, 2);
    victims.sort_unstable();
    assert_eq!(victims, vec![1, 3, 7]);
    kv.apply(&victims, &[], &mut slots).unwrap();
    assert_eq!(
        lists(&kv)
            .iter()
            .map(|(_, p)| p.clone())
            .collect::<Vec<_>>(),
        vec![vec![0, 2], vec![2], vec![0, 2], vec![0, 2]]
    );
    kv.clear();
    assert!(kv.streams().unwrap().is_empty());
    assert_eq!((kv.cells.n_live(), kv.peak_entries), (0, 0));
}

#[test]
fn stream_rows_round_trip_per_head() {
    // each stream stores its own head's slice of the token's K/V row
    let mut kv = KvCache::with_streams(1, 6, 3, &[region(0, 2, 4)], KvType::F32).unwrap();
    let mut slots = Vec::new();
    kv.apply(&[], &[7], &mut slots).unwrap();
    let (k, v) = ([1., 2., 3., 4., 5., 6.], [-1., -2., -3., -4., -5., -6.]);
    kv.write_token(0, 0, 1, &slots, &k, &v);
    let mut out = [0f32; 3];
    kv.head_f32(true, 0, 1, slots[1] as usize, &mut out);
    assert_eq!(out, [4., 5., 6.]);
    kv.head_f32(false, 0, 0, slots[0] as usize, &mut out);
    assert_eq!(out, [-1., -2., -3.]);
}

// ------------------------------------------------------------ 2. the stream evictor

/// Brute force: per group over budget, sort its unprotected, unguarded
/// entries by (score, position) and take the `need` lowest.
fn reference(
    e: &Evictor,
    plan: &StreamPlan,
    kv: &KvCache,
    scores: &[f32],
    off: &[usize],
    n_new: usize,
    newest: i64,
) -> Result<Vec<u32>, ()> {
    let st = kv.streams().unwrap();
    let mut out = Vec::new();
    for g in &plan.groups {
        let live: usize = (g.first..g.first + g.len).map(|s| st.len(s)).sum();
        if live + n_new * g.len <= g.budget {
            continue;
        }
        let need = live + n_new * g.len - g.budget;
        let mut cand = Vec::new();
        for s in g.first..g.first + g.len {
            let (slots, pos) = st.stream(s);
            let sc = &scores[off[s]..off[s + 1]];
            let mut idx: Vec<usize> = (0..slots.len()).collect();
            idx.sort_by(|&a, &b| sc[b].total_cmp(&sc[a]).then(pos[b].cmp(&pos[a])));
            let guarded = &idx[..g.safeguard.min(idx.len())];
            for j in 0..slots.len() {
                if !guarded.contains(&j) && !e.protected(pos[j], newest) {
                    cand.push((sc[j], pos[j], slots[j]));
                }
            }
        }
        if cand.len() < need {
            return Err(());
        }
        cand.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        let need = (need + (e.evict_every - 1) * g.len).min(cand.len());
        out.extend(cand[..need].iter().map(|c| c.2));
    }
    Ok(out)
}

#[test]
fn stream_evictor_matches_brute_force() {
    let mut rng = Rng::new(11);
    let mut r = |n: u64| rng.next_u64() % n;
    let (mut n_evict, mut n_err) = (0, 0);
    for case in 0..3000 {
        let (nl, nh) = (1 + r(3) as usize, 1 + r(3) as usize);
        let ns = nl * nh;
        let pool = ns * 24;
        let mut kv =
            KvCache::with_streams(nl, nh * 4, 4, &[region(0, ns, pool)], KvType::F16).unwrap();
        let mut slots = Vec::new();
        // a history: feed tokens, randomly drop entries of random streams
        let n_tok = 1 + r(20) as usize;
        for p in 0..n_tok as i64 {
            let mut victims = Vec::new();
            if p > 0 && r(2) == 0 {
                for (sl, q) in kv.cells.live().collect::<Vec<_>>() {
                    if q > 0 && r(4) == 0 {
                        victims.push(sl as u32);
                        let _ = q;
                    }
                }
            }
            kv.apply(&victims, &[p], &mut slots).unwrap();
        }
        let mut off = Vec::new();
        stream_offsets(&kv, &mut off);
        let total = *off.last().unwrap();
        // coarse scores force ties
        let scores: Vec<f32> = (0..total).map(|_| r(6) as f32 * 0.5).collect();
        let budget = 2 + r(14) as usize;
        let plan = match case % 3 {
            0 => StreamPlan::per_stream(nl, nh, &vec![budget; nl]),
            1 => StreamPlan::per_layer(nl, nh, budget, r(4) as usize),
            _ => StreamPlan {
                n_layers: nl,
                n_kv_heads: nh,
                groups: vec![Group {
                    first: 0,
                    len: ns,
                    budget: budget * ns,
                    safeguard: r(3) as usize,
                }],
            },
        };
        let e = evictor(budget, r(3) as usize, r(4) as usize, 1 + r(3) as usize);
        let n_new = 1 + r(3) as usize;
        let newest = n_tok as i64 - 1 + n_new as i64;
        let mut got = Vec::new();
        let res = e.select_streams(&plan, &kv, &scores, &off, n_new, newest, &mut got);
        match reference(&e, &plan, &kv, &scores, &off, n_new, newest) {
            Ok(mut want) => {
                res.unwrap_or_else(|err| panic!("case {case}: {err}"));
                got.sort_unstable();
                want.sort_unstable();
                assert_eq!(got, want, "case {case}");
                if !want.is_empty() {
                    n_evict += 1;
                }
            }
            Err(()) => {
                let msg = res.expect_err("infeasible case must fail").to_string();
                assert!(!msg.contains('\n') && msg.contains("protected"), "{msg}");
                n_err += 1;
            }
        }
    }
    assert!(
        n_evict > 500 && n_err > 20,
        "{n_evict} evicting, {n_err} infeasible"
    );
}

#[test]
fn pyramid_budgets_follow_the_formula() {
    // B = 256, w = 32, β = 20, L = 30: min = 224/20 = 11.2, max = 448 − 11.2 = 436.8
    let b = layer_budgets(30, 256, 32, 20.0).unwrap();
    assert_eq!(b[0], 32 + 437);
    assert_eq!(b[29], 32 + 11);
    assert!(b.windows(2).all(|w| w[0] >= w[1]), "{b:?}");
    assert!(b.iter().sum::<usize>() <= 30 * 256);
    assert!(b.iter().sum::<usize>() >= 30 * 256 - 15);
    // layer 15 of 30: 436.8 − 15·425.6/29 = 216.66 → 217
    assert_eq!(b[15], 32 + 217);
    assert!(layer_budgets(30, 32, 32, 20.0).is_err());
    assert!(layer_budgets(30, 256, 32, 0.5).is_err());
}

// ------------------------------------------------------------ 3. on the real model

/// SnapKV's score of every entry recomputed directly (f64, no pooling
/// shortcut): mean over window rows and group heads of the causal softmax,
/// 5-wide average pooling with zero padding, window tokens infinite.
fn direct_scores(s: &Session, kernel: usize) -> Vec<Vec<f64>> {
    let kv = &s.kv;
    let qw = s.queries().unwrap();
    let c = &s.w.config;
    let (hd, nkv) = (c.head_dim, c.n_kv_heads);
    let group = c.n_heads / nkv;
    let st = kv.streams().unwrap();
    let first = (0..qw.len()).map(|r| qw.row(0, r).1).min().unwrap();
    let mut all = Vec::new();
    for sidx in 0..st.n_streams() {
        let (l, g) = (sidx / nkv, sidx % nkv);
        let (slots, pos) = st.stream(sidx);
        let n = slots.len();
        let keys: Vec<Vec<f32>> = slots
            .iter()
            .map(|&sl| {
                let mut k = vec![0f32; hd];
                kv.head_f32(true, l, g, sl as usize, &mut k);
                k
            })
            .collect();
        let mut a = vec![0f64; n];
        for r in 0..qw.len() {
            let (q, qp) = qw.row(l, r);
            for h in 0..group {
                let qh = &q[(g * group + h) * hd..(g * group + h + 1) * hd];
                let vis: Vec<usize> = (0..n).filter(|&j| pos[j] <= qp).collect();
                let lg: Vec<f64> = vis
                    .iter()
                    .map(|&j| {
                        qh.iter()
                            .zip(&keys[j])
                            .map(|(&x, &y)| x as f64 * y as f64)
                            .sum::<f64>()
                            / (hd as f64).sqrt()
                    })
                    .collect();
                let m = lg.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = lg.iter().map(|x| (x - m).exp()).sum();
                for (t, &j) in vis.iter().enumerate() {
                    a[j] += (lg[t] - m).exp() / z / (qw.len() * group) as f64;
                }
            }
        }
        let half = kernel / 2;
        let mut b: Vec<f64> = (0..n)
            .map(|j| {
                let (lo, hi) = (j.saturating_sub(half), (j + half + 1).min(n));
                a[lo..hi].iter().sum::<f64>() / kernel as f64
            })
            .collect();
        for j in 0..n {
            if pos[j] >= first {
                b[j] = f64::INFINITY;
            }
        }
        all.push(b);
    }
    all
}

#[test]
fn snapkv_scores_match_a_direct_computation() {
    let g = Gguf::open(&util::default_model()).unwrap();
    let w = Weights::from_gguf(&g).unwrap();
    let toks = wiki_tokens(&g, 300);
    // a budget never reached: the window and cache are just recorded
    let mut s = Session::with_policy(
        &w,
        512,
        THREADS,
        64,
        policy("snapkv", evictor(400, 4, 32, 1)),
    )
    .unwrap();
    s.feed(&toks[..250], Logits::Last).unwrap();
    for &t in &toks[250..270] {
        s.feed(&[t], Logits::Last).unwrap();
    }
    let qw = s.queries().unwrap();
    assert_eq!(qw.len(), 32);
    let mut qpos: Vec<i64> = (0..32).map(|r| qw.row(0, r).1).collect();
    qpos.sort_unstable();
    assert_eq!(
        qpos,
        (238..270).collect::<Vec<i64>>(),
        "the last 32 positions"
    );
    let mut off = Vec::new();
    stream_offsets(&s.kv, &mut off);
    let mut got = vec![f32::NAN; *off.last().unwrap()];
    let want_all = vec![true; s.kv.n_streams()];
    let pool = ThreadPool::new(2);
    window_scores(&s.kv, qw, &pool, 5, &want_all, &off, &mut got);
    let want = direct_scores(&s, 5);
    let mut worst = 0f64;
    for (si, w) in want.iter().enumerate() {
        let gs = &got[off[si]..off[si + 1]];
        assert_eq!(gs.len(), 270);
        for (j, (&x, &y)) in gs.iter().zip(w).enumerate() {
            if y.is_infinite() {
                assert!(
                    x.is_infinite(),
                    "stream {si} entry {j}: window token not forced"
                );
            } else {
                let err = (x as f64 - y).abs() / y.abs().max(1e-6);
                worst = worst.max(err);
                assert!(err < 1e-3, "stream {si} entry {j}: {x} vs {y}");
            }
        }
    }
    eprintln!("worst relative error {worst:.2e}");
    // only wanted streams are written
    let mut part = vec![-7f32; got.len()];
    let mut want_one = vec![false; s.kv.n_streams()];
    want_one[5] = true;
    window_scores(
        &s.kv,
        s.queries().unwrap(),
        &pool,
        5,
        &want_one,
        &off,
        &mut part,
    );
    assert!(part[..off[5]].iter().all(|&x| x == -7.0));
    assert!(part[off[6]..].iter().all(|&x| x == -7.0));
    assert_eq!(&part[off[5]..off[6]], &got[off[5]..off[6]]);
}

/// Logits (bits) of feeding `toks[150..]` after `toks[..150]` and dropping
/// positions 20..60 from every head.
fn with_hole(s: &mut Session, toks: &[u32]) -> Vec<u32> {
    s.feed(&toks[..150], Logits::Last).unwrap();
    s.evict_range(20, 60).unwrap();
    let mut out = Vec::new();
    // a prefill chunk, then single tokens (both attention paths)
    out.extend(
        s.feed(&toks[150..170], Logits::All)
            .unwrap()
            .iter()
            .map(|x| x.to_bits()),
    );
    for &t in &toks[170..190] {
        out.extend(
            s.feed(&[t], Logits::Last)
                .unwrap()
                .iter()
                .map(|x| x.to_bits()),
        );
    }
    out
}

#[test]
fn streams_attend_exactly_like_the_uniform_cache() {
    let g = Gguf::open(&util::default_model()).unwrap();
    let w = Weights::from_gguf(&g).unwrap();
    let toks = wiki_tokens(&g, 190);
    let mut uni = Session::new(&w, 256, THREADS, 32);
    let a = with_hole(&mut uni, &toks);
    for name in ["snapkv", "adakv", "pyramidkv"] {
        let mut st =
            Session::with_policy(&w, 256, THREADS, 32, policy(name, evictor(4096, 4, 32, 1)))
                .unwrap();
        assert_eq!(st.kv.layout(), Layout::Streams);
        assert_eq!(st.state.n_batch, 32);
        let b = with_hole(&mut st, &toks);
        let lists = st.kv.streams().unwrap();
        for x in 0..lists.n_streams() {
            let pos = lists.stream(x).1;
            assert_eq!(pos.len(), 190 - 40, "{name}: stream {x}");
            assert!(
                !pos.iter().any(|p| (20..60).contains(p)),
                "{name}: stream {x}"
            );
        }
        assert!(
            a == b,
            "{name}: stream attention differs from the uniform cache"
        );
    }
}

/// Every group within its budget, protected positions in every stream,
/// streams in position order, pool rows never above the plan's total.
fn check_streams(s: &Session, what: &str) {
    let p = s.policy.as_ref().unwrap();
    let (e, plan) = (&p.evictor, p.plan.as_ref().unwrap());
    let st = s.kv.streams().unwrap();
    let n_past = s.n_past;
    for g in &plan.groups {
        let live: usize = (g.first..g.first + g.len).map(|x| st.len(x)).sum();
        assert!(
            live <= g.budget,
            "{what}: group {g:?} holds {live} at {n_past}"
        );
    }
    assert!(
        s.kv.peak_entries <= plan.pool(),
        "{what}: peak {}",
        s.kv.peak_entries
    );
    for x in 0..st.n_streams() {
        let (slots, pos) = st.stream(x);
        assert!(
            pos.windows(2).all(|w| w[0] < w[1]),
            "{what}: stream {x} order"
        );
        for (&sl, &q) in slots.iter().zip(pos) {
            assert_eq!(s.kv.cells.pos(sl as usize), Some(q));
            assert_eq!(st.owner(sl as usize), x);
        }
        let has = |q: usize| pos.binary_search(&(q as i64)).is_ok();
        for q in (0..e.n_sink.min(n_past)).chain(n_past.saturating_sub(e.n_recent)..n_past) {
            assert!(
                has(q),
                "{what}: protected {q} missing from stream {x} at {n_past}"
            );
        }
    }
}

#[test]
fn stream_budgets_hold_and_lengths_vary_per_head() {
    let g = Gguf::open(&util::default_model()).unwrap();
    let w = Weights::from_gguf(&g).unwrap();
    let n = 4096;
    let toks = wiki_tokens(&g, n);
    for name in ["snapkv", "adakv", "pyramidkv"] {
        let mut s = Session::with_policy(&w, n, THREADS, 512, policy(name, evictor(128, 4, 32, 8)))
            .unwrap();
        let nb = s.state.n_batch;
        assert!(nb >= 1 && nb <= 16, "{name}: prefill chunk {nb}");
        // real memory: the pool holds exactly the plan's rows
        let plan = s.policy.as_ref().unwrap().plan.clone().unwrap();
        assert_eq!(s.kv.cells.n_slots(), plan.pool());
        assert_eq!(s.kv.bytes_allocated(), plan.pool() * 2 * 64 * 2);
        assert!(plan.pool() <= 30 * 3 * 128);
        s.feed(&toks[..200], Logits::Last).unwrap();
        check_streams(&s, name);
        let pattern = [1usize, 1, 16, 3, 1, 7, 1];
        let mut i = 200;
        let mut k = 0;
        while i < n {
            let m = pattern[k % pattern.len()].min(n - i);
            s.feed(&toks[i..i + m], Logits::Last).unwrap();
            i += m;
            k += 1;
            check_streams(&s, name);
        }
        let st = s.kv.streams().unwrap();
        let sets: Vec<&[i64]> = (0..st.n_streams()).map(|x| st.stream(x).1).collect();
        let distinct = sets.iter().filter(|p| **p != sets[0]).count();
        assert!(
            distinct > 30,
            "{name}: heads keep different tokens ({distinct})"
        );
        let lens: Vec<usize> = (0..st.n_streams()).map(|x| st.len(x)).collect();
        match name {
            "adakv" => {
                // heads of one layer hold different numbers of tokens, the
                // layer total stays within 3 × 128, each head ≥ its safeguard
                let varied = (0..30)
                    .filter(|l| lens[l * 3] != lens[l * 3 + 1] || lens[l * 3] != lens[l * 3 + 2])
                    .count();
                assert!(
                    varied > 10,
                    "adakv: {varied} layers with unequal heads: {lens:?}"
                );
                assert!(lens.iter().all(|&x| x >= 25 + 1), "{lens:?}");
            }
            "pyramidkv" => {
                assert!(lens[0] > 2 * lens[87], "pyramid shape: {lens:?}");
            }
            _ => assert!(lens.iter().all(|&x| x <= 128 && x > 100), "{lens:?}"),
        }
        eprintln!(
            "{name}: evicted {} tokens, lengths {:?}",
            s.n_evicted,
            &lens[..9]
        );
    }
}

// ------------------------------------------------------------ 4. the command line

#[test]
fn stream_policy_cli_runs_and_errors_are_one_line() {
    use std::process::Command;
    let run = |extra: &[&str]| {
        Command::new(util::kvrun_bin())
            .args([
                "-p",
                "Count from one to twenty: one, two,",
                "-n",
                "80",
                "--ignore-eos",
                "-t",
                "1",
                "--temp",
                "0",
            ])
            .args(extra)
            .output()
            .unwrap()
    };
    // a real run: budget 64 forces evictions in every stream while decoding
    for (p, budget) in [("snapkv", "64"), ("adakv", "64"), ("pyramidkv", "160")] {
        // (pyramidkv: the top layer keeps 32 + (160 − 32)/20 = 38 entries)
        let o = run(&["--policy", p, "--kv-budget", budget, "--cache-type", "q8_0"]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "{p}: {err}");
        assert!(err.contains("streams=90"), "{p}: {err}");
        let line = err.lines().find(|l| l.contains("kv: policy=")).unwrap();
        let evicted: usize = line
            .split("evicted=")
            .nth(1)
            .unwrap()
            .split(' ')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        assert!(evicted > 0, "{p}: {line}");
    }
    for (args, want) in [
        (
            vec![
                "--policy",
                "snapkv",
                "--kv-budget",
                "64",
                "--pool-kernel",
                "4",
            ],
            "--pool-kernel",
        ),
        (
            vec![
                "--policy",
                "snapkv",
                "--kv-budget",
                "64",
                "--obs-window",
                "0",
            ],
            "--obs-window",
        ),
        (
            vec![
                "--policy",
                "adakv",
                "--kv-budget",
                "64",
                "--adakv-safeguard",
                "1.5",
            ],
            "--adakv-safeguard",
        ),
        (
            vec![
                "--policy",
                "pyramidkv",
                "--kv-budget",
                "30",
                "--kv-recent",
                "8",
            ],
            "observation window",
        ),
        (
            vec![
                "--policy",
                "pyramidkv",
                "--kv-budget",
                "64",
                "--pyramid-beta",
                "0",
            ],
            "--pyramid-beta",
        ),
        (vec!["--policy", "snapkv", "--kv-budget", "36"], "protected"),
        (
            vec![
                "--policy",
                "snapkv",
                "--kv-budget",
                "64",
                "--prompt-policy",
                "window",
            ],
            "token-uniform",
        ),
        (
            vec![
                "--policy",
                "snapkv",
                "--kv-budget",
                "64",
                "--pos-mode",
                "cache",
            ],
            "window",
        ),
    ] {
        let o = run(&args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{args:?} should fail");
        assert_eq!(err.trim().lines().count(), 1, "{args:?}: {err}");
        assert!(
            err.contains(want) && !err.contains("panicked"),
            "{args:?}: {err}"
        );
    }
}

#[test]
fn regions_keep_each_stream_in_its_rows() {
    // 1 layer × 2 KV heads, one 3-row region per stream
    let mut kv =
        KvCache::with_streams(1, 8, 4, &[region(0, 1, 3), region(1, 1, 3)], KvType::F16).unwrap();
    let mut slots = Vec::new();
    kv.apply(&[], &[0, 1, 2], &mut slots).unwrap();
    assert_eq!(slots, vec![0, 1, 2, 3, 4, 5]);
    // a region is full: a fourth token needs room in both
    assert!(
        kv.apply(&[1], &[3], &mut slots).is_err(),
        "stream 1 has no room"
    );
    assert_eq!(kv.cells.n_live(), 6, "a failed step changes nothing");
    kv.apply(&[1, 3], &[3], &mut slots).unwrap();
    assert_eq!(slots, vec![1, 3], "each stream reuses its own hole");
    let st = kv.streams().unwrap();
    assert_eq!(st.stream(0), (&[0u32, 2, 1][..], &[0i64, 2, 3][..]));
    assert_eq!(st.stream_by_slot(0), (&[0u32, 1, 2][..], &[0i64, 3, 2][..]));
    assert_eq!(st.stream(1), (&[4u32, 5, 3][..], &[1i64, 2, 3][..]));
    assert_eq!(st.stream_by_slot(1), (&[3u32, 4, 5][..], &[3i64, 1, 2][..]));
    // decoding walks memory order, prefill position order
    assert_eq!(kv.head(0, 0, true).slots, &[0, 1, 2]);
    assert_eq!(kv.head(0, 0, false).slots, &[0, 2, 1]);
}

// ------------------------------------------------------------ 5. budget rules and wrappers

/// SnapKV's scorer under the global rule (one budget group over every
/// stream of every layer; no shipped policy uses it yet): the pool holds
/// exactly L·H·B rows, the group total never exceeds it, and streams end
/// up with very different lengths.
#[test]
fn global_rule_shares_one_budget_across_every_stream() {
    let g = Gguf::open(&util::default_model()).unwrap();
    let w = Weights::from_gguf(&g).unwrap();
    let n = 1200;
    let toks = wiki_tokens(&g, n);
    let scorer = SnapKv {
        opts: SnapOptions::default(),
    };
    let caps = Caps {
        streams: true,
        ..Caps::default()
    };
    let p = Policy::new(
        "snapkv-global",
        caps,
        Box::new(scorer),
        BudgetRule::Global { min_per_head: 6 },
    )
    .unwrap();
    let mut s =
        Session::with_policy(&w, n, THREADS, 512, KvPolicy::new(p, evictor(64, 4, 32, 8))).unwrap();
    let plan = s.policy.as_ref().unwrap().plan.clone().unwrap();
    assert_eq!(plan.groups.len(), 1);
    assert_eq!(plan.groups[0].len, 90);
    assert_eq!(plan.groups[0].safeguard, 6);
    assert_eq!(plan.pool(), 90 * 64);
    assert_eq!(s.kv.cells.n_slots(), 90 * 64);
    s.feed(&toks[..200], Logits::Last).unwrap();
    check_streams(&s, "global");
    let pattern = [1usize, 1, 16, 3, 1, 7, 1];
    let (mut i, mut k) = (200, 0);
    while i < n {
        let m = pattern[k % pattern.len()].min(n - i);
        s.feed(&toks[i..i + m], Logits::Last).unwrap();
        i += m;
        k += 1;
        check_streams(&s, "global");
    }
    assert!(s.n_evicted > 0);
    let st = s.kv.streams().unwrap();
    let lens: Vec<usize> = (0..st.n_streams()).map(|x| st.len(x)).collect();
    assert!(lens.iter().sum::<usize>() <= 90 * 64);
    let (lo, hi) = (*lens.iter().min().unwrap(), *lens.iter().max().unwrap());
    assert!(
        hi > 64 && (6..64).contains(&lo),
        "one global budget: lengths should spread around 64 ({lo}..{hi})"
    );
    // a rule the scorer cannot rank under is refused
    let tokens = Policy::new(
        "snapkv-tokens",
        Caps::default(),
        Box::new(SnapKv {
            opts: SnapOptions::default(),
        }),
        BudgetRule::Tokens,
    );
    assert!(tokens.is_err());
}

/// What the test wrapper saw.
#[derive(Debug, Default)]
struct Seen {
    calls: usize,
    /// Group budgets of the wanted streams, at every scoring.
    budgets: Vec<usize>,
    /// (length of the dequantized W_O of layer 0, dim · q_dim).
    wo: Option<(usize, usize)>,
}

/// A test-only wrapper: negates the inner scores of the wanted streams.
#[derive(Debug)]
struct Negate(Arc<Mutex<Seen>>);

impl Rescorer for Negate {
    fn prepare(&mut self, m: &ModelView<'_>, _cache: CacheShape) -> kvrun::Result<()> {
        let mut wo = Vec::new();
        m.wo_f32(0, &mut wo)?;
        let c = m.config();
        self.0.lock().unwrap().wo = Some((wo.len(), c.dim * c.q_dim()));
        Ok(())
    }
    fn rescore(&mut self, ctx: &ScoreCtx<'_>, out: &mut [f32]) {
        let mut seen = self.0.lock().unwrap();
        seen.calls += 1;
        if let Entries::Streams { want, off, .. } = ctx.entries {
            for s in (0..want.len()).filter(|&s| want[s]) {
                seen.budgets.push(ctx.group_budget(s));
                for x in &mut out[off[s]..off[s + 1]] {
                    *x = -*x;
                }
            }
        }
    }
}

/// A wrapper around the observation-window scorer under Ada-KV's rule
/// runs through the real engine: it reads W_O at prepare, sees the group
/// budget (a layer's heads share 3 × 64) and the inner scores, and its
/// rescoring decides what is kept.
#[test]
fn a_wrapper_rescores_stream_scores_with_the_group_budget() {
    let g = Gguf::open(&util::default_model()).unwrap();
    let w = Weights::from_gguf(&g).unwrap();
    let n = 500;
    let toks = wiki_tokens(&g, n);
    let run = |wrap: Option<Arc<Mutex<Seen>>>| {
        let inner: Box<dyn Scorer> = Box::new(SnapKv {
            opts: SnapOptions::default(),
        });
        let scorer: Box<dyn Scorer> = match &wrap {
            Some(seen) => Box::new(Wrapped::new(inner, Negate(seen.clone()))),
            None => inner,
        };
        let def = find("adakv").unwrap();
        let p = Policy::new(
            "adakv",
            def.caps,
            scorer,
            BudgetRule::PerLayer { safeguard: 0.2 },
        )
        .unwrap();
        let mut s =
            Session::with_policy(&w, n, THREADS, 512, KvPolicy::new(p, evictor(64, 4, 32, 8)))
                .unwrap();
        s.feed(&toks[..100], Logits::Last).unwrap();
        for &t in &toks[100..] {
            s.feed(&[t], Logits::Last).unwrap();
            check_streams(&s, "wrapped adakv");
        }
        lists(&s.kv)
    };
    let seen = Arc::new(Mutex::new(Seen::default()));
    let plain = run(None);
    let negated = run(Some(seen.clone()));
    let seen = seen.lock().unwrap();
    assert!(seen.calls > 10, "{} rescorings", seen.calls);
    assert!(
        seen.budgets.iter().all(|&b| b == 3 * 64),
        "{:?}",
        &seen.budgets[..9]
    );
    let (got, want) = seen.wo.unwrap();
    assert_eq!(got, want);
    assert_ne!(plain, negated, "the wrapper's scores decided nothing");
}
