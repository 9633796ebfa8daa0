//! Eviction policies: the registry, the shared `Evictor` against a brute-force
//! reference, and every scorer driving the real engine (SmolLM2-135M) under a
//! budget: resident tokens never exceed the budget at any step (prefill
//! included), protected tokens survive, evicted tokens are the lowest-scored,
//! seeded scorers are deterministic, attention-mass exports are normalized,
//! a budget that is never reached changes no logit bit, and a wrapper
//! around a scorer drives the engine.

use crate::util;

use kvrun::error::Field;
use kvrun::format::gguf::Gguf;
use kvrun::generate::StepObserver;
use kvrun::generate::{KvPolicy, Session};
use kvrun::model::llama::Logits;
use kvrun::model::Config;
use kvrun::model::ModelView;
use kvrun::model::Weights;
use kvrun::policy::table::{lookup, ScorerOptions};
use kvrun::policy::wrap::{Rescorer, Wrapped};
use kvrun::policy::{find, names, CacheShape, Evictor, Policy, ScoreCtx, POLICIES};
use kvrun::policy::{PolicyConfig, Step};
use kvrun::sample::Rng;
use kvrun::signals::{MassMode, Needs, Signals};
use kvrun::tokenizer::Tokenizer;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// One thread per session: the test harness runs two tests at once on a
/// 2-core machine, and the spinning thread pool degrades badly when its
/// threads compete for cores (measured under load: 2 threads 50 ms/token,
/// 1 thread 16 ms/token).
const THREADS: usize = 1;

/// The first `n` tokens of WikiText-2.
fn wiki_tokens(g: &Gguf, n: usize) -> Vec<u32> {
    let tok = Tokenizer::from_gguf(g).unwrap();
    let ids = tok.encode(&util::wikitext(n * 8), false, false).unwrap();
    assert!(ids.len() >= n, "only {} tokens of wikitext", ids.len());
    ids[..n].to_vec()
}

pub(crate) fn evictor(
    budget: usize,
    n_sink: usize,
    n_recent: usize,
    evict_every: usize,
) -> Evictor {
    Evictor {
        budget,
        n_sink,
        n_recent,
        keep_prompt_until: 0,
        evict_every,
    }
}

/// Retention gates of the default model's shape (β ≈ 1: remember
/// everything), for the learned-retention rows.
fn test_gates() -> std::sync::Arc<kvrun::policy::gates::Gates> {
    std::sync::Arc::new(kvrun::policy::gates::Gates::init(
        kvrun::policy::gates::GateArch::Rg10,
        576,
        8,
        30,
        3,
        10.0,
        1,
    ))
}

/// Uniform head-importance scores of the default model's shape (headkv).
fn test_head_scores() -> std::sync::Arc<kvrun::policy::headkv::HeadScores> {
    std::sync::Arc::new(kvrun::policy::headkv::HeadScores {
        n_layers: 30,
        n_kv_heads: 3,
        scores: vec![1.0; 90],
        procedure: String::new(),
    })
}

fn policy(name: &str, seed: u64, e: Evictor) -> KvPolicy {
    let p = find(name)
        .unwrap()
        .build(&ScorerOptions {
            seed,
            gates: Some(test_gates()),
            head_scores: Some(test_head_scores()),
            ..Default::default()
        })
        .unwrap()
        .expect("a scorer");
    KvPolicy::new(p, e)
}

// ------------------------------------------------------------ 1. registry

#[test]
fn registry_names_construct_and_describe() {
    let ns = names();
    assert_eq!(ns.len(), POLICIES.len());
    for (i, p) in POLICIES.iter().enumerate() {
        assert_eq!(ns[i], p.name);
        assert!(
            !p.about.trim().is_empty(),
            "policy {} has no description",
            p.name
        );
        assert!(
            POLICIES.iter().filter(|q| q.name == p.name).count() == 1,
            "duplicate {}",
            p.name
        );
        // learned-retention rows need gates: any of the model's shape
        let opts = ScorerOptions {
            gates: Some(test_gates()),
            head_scores: Some(test_head_scores()),
            ..Default::default()
        };
        if p.caps.gates || p.caps.head_scores {
            assert!(
                p.build(&ScorerOptions::default()).is_err(),
                "{}: no gates",
                p.name
            );
        }
        let s = p.build(&opts).unwrap_or_else(|e| panic!("{}: {e}", p.name));
        assert_eq!(p.budgeted(), p.name != "full");
        match p.name {
            "full" => assert!(s.is_none(), "full has no scorer"),
            _ => {
                let s = s.unwrap_or_else(|| panic!("{} built no scorer", p.name));
                assert_eq!(s.name, p.name);
                assert_eq!(s.caps, p.caps);
                assert_eq!(
                    p.caps.streams,
                    s.rule.streams(),
                    "{}: layout capability vs budget rule",
                    p.name
                );
                assert_eq!(s.scorer.per_stream(), s.rule.streams(), "{}", p.name);
                let want = match p.name {
                    "h2o" | "critical-h2o" => MassMode::AllRows,
                    "tova" | "critical-tova" | "scissorhands" | "raas" => MassMode::LastRow,
                    "thinkv" => MassMode::AllRows,
                    _ => MassMode::None,
                };
                assert_eq!(s.scorer.needs().mass, want, "{}", p.name);
            }
        }
    }
    for must in ["full", "window", "h2o", "tova", "knorm", "random"] {
        assert!(ns.contains(&must), "{must} missing from POLICIES");
    }
    let e = lookup("lru", Field::Policy).unwrap_err().to_string();
    assert!(e.contains("--policy") && e.contains("'lru'"), "{e}");
    for n in &ns {
        assert!(e.contains(n), "error does not list {n}: {e}");
    }
}

// ------------------------------------------------------------ 2. Evictor::select

/// Brute force: sort every unprotected live entry by (score, position), take
/// the `need` (rounded up by evict_every, capped) first.
fn reference(
    e: &Evictor,
    slots: &[u32],
    pos: &[i64],
    scores: &[f32],
    n_new: usize,
    newest: i64,
) -> Option<Vec<u32>> {
    let n_live = slots.len();
    if n_live + n_new <= e.budget {
        return Some(vec![]);
    }
    let need = n_live + n_new - e.budget;
    let is_protected = |p: i64| {
        let p = p as usize;
        p < e.n_sink || p < e.keep_prompt_until || (newest as usize) - p < e.n_recent
    };
    let mut cand: Vec<(f32, i64, u32)> = (0..n_live)
        .filter(|&i| !is_protected(pos[i]))
        .map(|i| (scores[i], pos[i], slots[i]))
        .collect();
    if cand.len() < need {
        return None;
    }
    cand.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let take = (need + e.evict_every.max(1) - 1).min(cand.len());
    Some(cand[..take].iter().map(|c| c.2).collect())
}

#[test]
fn select_exact_cases() {
    let mut v = vec![99u32, 98]; // stale content must be cleared
                                 // 8 live, slots reversed, positions 0..8
    let slots: Vec<u32> = (0..8).rev().collect();
    let pos: Vec<i64> = (0..8).collect();
    let scores = [9.0, 9.0, 5.0, 1.0, 3.0, 0.5, 7.0, -100.0];

    // under budget: nothing
    let e = evictor(9, 2, 2, 1);
    e.select(&slots, &pos, &scores, 1, 8, &mut v).unwrap();
    assert!(v.is_empty());

    // one over: lowest unprotected; pos 7 (-100) is recent (newest 8, recent 2 → 7, 8)
    let e = evictor(8, 2, 2, 1);
    e.select(&slots, &pos, &scores, 1, 8, &mut v).unwrap();
    assert_eq!(v, vec![slots[5]]); // pos 5, score 0.5

    // three over (3 new tokens, newest 10 → recent 9, 10; pos 7 now evictable)
    e.select(&slots, &pos, &scores, 3, 10, &mut v).unwrap();
    assert_eq!(v, vec![slots[7], slots[5], slots[3]]);

    // sinks: pos 0/1 score lowest but protected
    let low_sinks = [-9.0, -9.0, 5.0, 1.0, 3.0, 0.5, 7.0, 8.0];
    e.select(&slots, &pos, &low_sinks, 1, 8, &mut v).unwrap();
    assert_eq!(v, vec![slots[5]]);

    // keep_prompt_until 5: positions 0..5 protected
    let kp = Evictor {
        keep_prompt_until: 5,
        ..evictor(8, 2, 2, 1)
    };
    kp.select(
        &slots,
        &pos,
        &[0.0, 0.0, 0.0, 0.0, 0.0, 4.0, 3.0, 0.0],
        2,
        9,
        &mut v,
    )
    .unwrap();
    assert_eq!(v, vec![slots[7], slots[6]]);

    // ties: older position first
    let flat = [1.0f32; 8];
    e.select(&slots, &pos, &flat, 2, 9, &mut v).unwrap();
    assert_eq!(v, vec![slots[2], slots[3]]);

    // evict_every 4: one needed, four freed; capped at the evictable count
    let b = evictor(8, 2, 2, 4);
    b.select(&slots, &pos, &scores, 1, 8, &mut v).unwrap();
    assert_eq!(v, vec![slots[5], slots[3], slots[4], slots[2]]);
    let b = evictor(8, 2, 2, 100);
    b.select(&slots, &pos, &scores, 1, 8, &mut v).unwrap();
    assert_eq!(v.len(), 5, "positions 2..=6 are the only evictable ones");

    // infeasible: everything protected
    let all = Evictor {
        keep_prompt_until: 8,
        ..evictor(8, 2, 2, 1)
    };
    let err = all
        .select(&slots, &pos, &scores, 1, 8, &mut v)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("--kv-budget") && err.contains("budget 8"),
        "{err}"
    );
    let recent_all = evictor(8, 0, 100, 1);
    assert!(recent_all
        .select(&slots, &pos, &scores, 1, 8, &mut v)
        .is_err());
    // not enough evictable for a big chunk
    let e = evictor(8, 2, 2, 1);
    assert!(e.select(&slots, &pos, &scores, 7, 14, &mut v).is_err());
}

#[test]
fn select_matches_brute_force_on_random_cases() {
    let mut rng = Rng::new(42);
    let mut r = |n: u64| rng.next_u64() % n;
    let mut n_err = 0;
    let mut n_evict = 0;
    for case in 0..20_000 {
        let n_live = r(40) as usize;
        // distinct random positions below some horizon
        let horizon = n_live as i64 + r(40) as i64;
        let mut pos: Vec<i64> = (0..horizon).collect();
        for i in (1..pos.len()).rev() {
            let j = r(i as u64 + 1) as usize;
            pos.swap(i, j);
        }
        pos.truncate(n_live);
        pos.sort();
        let mut slots: Vec<u32> = (0..(n_live as u32 + r(8) as u32)).collect();
        for i in (1..slots.len()).rev() {
            let j = r(i as u64 + 1) as usize;
            slots.swap(i, j);
        }
        slots.truncate(n_live);
        // few distinct values half the time, to force ties
        let ties = r(2) == 0;
        let scores: Vec<f32> = (0..n_live)
            .map(|_| {
                if ties {
                    r(4) as f32
                } else {
                    r(1 << 20) as f32 / 1024.0 - 512.0
                }
            })
            .collect();
        let n_new = 1 + r(8) as usize;
        let newest = horizon + n_new as i64 - 1 + r(3) as i64;
        let e = Evictor {
            budget: 1 + r(40) as usize,
            n_sink: r(6) as usize,
            n_recent: r(12) as usize,
            keep_prompt_until: if r(3) == 0 { r(20) as usize } else { 0 },
            evict_every: 1 + r(4) as usize * (r(2) as usize),
        };
        let mut v = vec![12345];
        let got = e.select(&slots, &pos, &scores, n_new, newest, &mut v);
        let want = reference(&e, &slots, &pos, &scores, n_new, newest);
        match (got, want) {
            (Ok(()), Some(w)) => {
                assert_eq!(v, w, "case {case}: {e:?} n_new {n_new} newest {newest}");
                n_evict += (!w.is_empty()) as usize;
                // properties, stated independently of the sort
                let need = (n_live + n_new).saturating_sub(e.budget);
                assert!(v.len() >= need);
                for &s in &v {
                    let i = slots.iter().position(|&x| x == s).unwrap();
                    assert!(
                        !e.protected(pos[i], newest),
                        "case {case}: protected victim"
                    );
                }
            }
            (Err(_), None) => n_err += 1,
            (g, w) => panic!("case {case}: got {g:?} want {w:?} for {e:?}"),
        }
    }
    // the generator must exercise all three outcomes
    assert!(n_err > 100, "{n_err} infeasible cases");
    assert!(n_evict > 1000, "{n_evict} evicting cases");
}

// ------------------------------------------------------------ 3. budget on the real model

/// What must hold after every `feed` of a budgeted session.
fn check_step(s: &Session, keep_prompt: usize, what: &str) {
    let e = &s.policy.as_ref().unwrap().evictor;
    let (budget, sink, recent) = (e.budget, e.n_sink, e.n_recent);
    let n_past = s.n_past;
    let n_live = s.kv.cells.n_live();
    assert!(
        n_live <= budget,
        "{what}: {n_live} resident > budget {budget} at n_past {n_past}"
    );
    assert!(
        s.kv.peak_live <= budget,
        "{what}: peak {} > budget {budget} at n_past {n_past}",
        s.kv.peak_live
    );
    let (slots, pos) = s.kv.live();
    assert_eq!(slots.len(), n_live, "{what}");
    assert!(
        pos.windows(2).all(|w| w[0] < w[1]),
        "{what}: live() not sorted by position"
    );
    for (&sl, &p) in slots.iter().zip(pos) {
        assert_eq!(
            s.kv.cells.pos(sl as usize),
            Some(p),
            "{what}: live() disagrees with cells"
        );
    }
    assert_eq!(
        s.n_evicted + n_live,
        n_past,
        "{what}: evicted + resident != processed"
    );
    assert_eq!(
        pos.last().copied(),
        Some(n_past as i64 - 1),
        "{what}: newest token not resident"
    );
    let live = |p: usize| pos.binary_search(&(p as i64)).is_ok();
    for p in 0..sink.min(n_past) {
        assert!(live(p), "{what}: sink {p} evicted at n_past {n_past}");
    }
    for p in n_past.saturating_sub(recent)..n_past {
        assert!(
            live(p),
            "{what}: recent position {p} evicted at n_past {n_past}"
        );
    }
    for p in 0..keep_prompt.min(n_past) {
        assert!(
            live(p),
            "{what}: prompt position {p} evicted at n_past {n_past}"
        );
    }
    // eviction only as needed: at most evict_every-1 below the budget
    let floor = n_past.min(budget + 1 - e.evict_every.max(1));
    assert!(
        n_live >= floor,
        "{what}: {n_live} resident, expected at least {floor} (n_past {n_past})"
    );
    if e.evict_every <= 1 {
        assert_eq!(
            n_live,
            n_past.min(budget),
            "{what}: evicted more than needed"
        );
    }
}

/// Feed `toks` as a 300-token prompt (several prefill chunks: the budget
/// caps n_batch to at most budget - sink - recent = 220), then decode in a
/// repeating mix of single tokens and small chunks, with one 400-token
/// chunked feed in the middle (when `big`); checks after every feed.
/// Returns the number of feeds.
fn run_budgeted(
    s: &mut Session,
    toks: &[u32],
    keep_prompt: usize,
    big: bool,
    what: &str,
    mut each: impl FnMut(&Session),
) -> usize {
    let prompt = if keep_prompt > 0 { keep_prompt } else { 300 };
    s.feed(&toks[..prompt], Logits::Last).unwrap();
    check_step(s, keep_prompt, what);
    each(s);
    let pattern = [1usize, 1, 16, 3, 16, 1, 7, 16, 16, 1, 16, 2];
    let mut i = prompt;
    let mut k = 0;
    let mut feeds = 1;
    let big_at = (toks.len() / 2).max(prompt + 100);
    while i < toks.len() {
        let n = if big && i >= big_at && i < big_at + 16 {
            400
        } else {
            pattern[k % pattern.len()]
        };
        let n = n.min(toks.len() - i);
        let vocab = s.w.config.vocab;
        let out = s
            .feed(&toks[i..i + n], Logits::Last)
            .unwrap_or_else(|e| panic!("{what}: feed at {i}: {e}"));
        assert_eq!(out.len(), vocab);
        assert!(
            out.iter().all(|x| x.is_finite()),
            "{what}: non-finite logits at {i}"
        );
        i += n;
        k += 1;
        feeds += 1;
        check_step(s, keep_prompt, what);
        each(s);
    }
    feeds
}

fn budget_run(name: &str, n_tokens: usize, evict_every: usize) {
    let t0 = Instant::now();
    let g = Gguf::open(&util::default_model()).unwrap();
    let w = Weights::from_gguf(&g).unwrap();
    assert_eq!(w.config.n_layers, 30);
    let toks = wiki_tokens(&g, n_tokens);
    let p = policy(name, 3, evictor(256, 4, 32, evict_every));
    let mut s = Session::with_policy(&w, n_tokens, THREADS, 512, p).unwrap();
    let nb = s.state.n_batch;
    assert!(
        (1..=256 - 4 - 32).contains(&nb),
        "prefill chunk {nb} must fit next to the protected tokens"
    );
    assert!(nb < 300, "the 300-token prompt must take several chunks");
    let feeds = run_budgeted(&mut s, &toks, 0, true, name, |s| {
        if name == "window" && s.n_past > 256 {
            // StreamingLLM: exactly the sinks plus the newest budget - sinks
            let want: Vec<i64> = (0..4)
                .chain((s.n_past - 252) as i64..s.n_past as i64)
                .collect();
            assert_eq!(
                s.kv.live().1,
                want.as_slice(),
                "window at n_past {}",
                s.n_past
            );
        }
    });
    assert_eq!(s.n_past, n_tokens);
    if evict_every == 1 {
        assert_eq!(s.kv.peak_live, 256);
    } else {
        assert!(
            s.kv.peak_live > 256 - evict_every,
            "peak {}",
            s.kv.peak_live
        );
    }
    assert!(s.n_evicted >= n_tokens - 256);
    // some prompt token (past the sinks) was evicted: prompt is not protected by default
    let pos = s.kv.live().1;
    assert!((4..300).any(|p| pos.binary_search(&p).is_err()));
    eprintln!(
        "{name}: {n_tokens} tokens, {feeds} feeds, {} evicted, {:.1}s",
        s.n_evicted,
        t0.elapsed().as_secs_f64()
    );
}

#[test]
fn budget_4096_window() {
    budget_run("window", 4096, 1);
}

#[test]
fn budget_holds_h2o() {
    budget_run("h2o", 4096, 1);
}

#[test]
fn budget_holds_h2o_evict_every_8() {
    budget_run("h2o", 600, 8);
}

#[test]
fn budget_holds_tova() {
    budget_run("tova", 4096, 1);
}

#[test]
fn budget_holds_knorm() {
    budget_run("knorm", 4096, 1);
}

#[test]
fn budget_holds_random() {
    budget_run("random", 4096, 1);
}

#[test]
fn budget_holds_epikv_variants() {
    for name in ["epikv", "epikv-raw", "epikv-band", "epikv-lag", "epikv-seg"] {
        budget_run(name, 4096, 1);
    }
}

#[test]
fn budget_holds_scissorhands() {
    budget_run("scissorhands", 4096, 1);
}

#[test]
fn budget_holds_scissorhands_evict_every_32() {
    budget_run("scissorhands", 4096, 32);
}

#[test]
fn budget_holds_thinkv() {
    budget_run("thinkv", 4096, 1);
}

#[test]
fn budget_holds_raas() {
    budget_run("raas", 4096, 1);
}

#[test]
fn every_policy_has_a_budget_test() {
    // the list above must cover the registry
    let covered = [
        "full",
        "window",
        "h2o",
        "tova",
        "knorm",
        "random",
        "epikv",
        "epikv-raw",
        "epikv-band",
        "epikv-lag",
        "epikv-seg",
        // per-(layer, KV-head) streams: tests/streams.rs
        // (stream_budgets_hold_and_lengths_vary_per_head)
        "snapkv",
        "adakv",
        "pyramidkv",
        // CriticalKV over each: tests/policies/critical.rs
        // (critical_budgets_hold_over_4096_tokens)
        "critical-snapkv",
        "critical-adakv",
        "critical-pyramidkv",
        "critical-h2o",
        "critical-tova",
        // learned retention: tests/policies/trimkv.rs
        // (trimkv_and_dbtrimkv_budgets_hold_while_streaming)
        "trimkv",
        "dbtrimkv",
        // the comparison set: tests/policies/baselines.rs (streams,
        // budget_holds_*) and below (token-uniform)
        "lagkv",
        "lagkv-causal",
        "rkv",
        "expected-attention",
        "headkv",
        "scissorhands",
        "thinkv",
        "raas",
    ];
    for n in names() {
        assert!(
            covered.contains(&n),
            "policy {n} has no budget test in tests/policy.rs"
        );
    }
}

/// keep-prompt: prompt tokens are never evicted (random scores would evict
/// them otherwise, see `budget_holds_random`).
#[test]
fn keep_prompt_is_never_evicted() {
    let g = Gguf::open(&util::default_model()).unwrap();
    let w = Weights::from_gguf(&g).unwrap();
    let toks = wiki_tokens(&g, 500);
    let n_prompt = 150;
    let e = Evictor {
        keep_prompt_until: usize::MAX,
        ..evictor(256, 4, 32, 1)
    };
    let mut s = Session::with_policy(&w, 500, THREADS, 512, policy("random", 5, e)).unwrap();
    s.protect_prompt(n_prompt);
    assert_eq!(
        s.policy.as_ref().unwrap().evictor.keep_prompt_until,
        n_prompt
    );
    run_budgeted(&mut s, &toks, n_prompt, false, "random+keep-prompt", |_| {});
    assert!(s.n_evicted >= 500 - 256);
    let pos = s.kv.live().1;
    assert!((0..n_prompt as i64).all(|p| pos.binary_search(&p).is_ok()));

    // protect_prompt is a no-op when the policy does not keep the prompt
    let mut s = Session::with_policy(
        &w,
        500,
        THREADS,
        512,
        policy("random", 5, evictor(256, 4, 32, 1)),
    )
    .unwrap();
    s.protect_prompt(n_prompt);
    assert_eq!(s.policy.as_ref().unwrap().evictor.keep_prompt_until, 0);
}

/// A prompt too long to keep under the budget is an error, not a panic or
/// an overflow of the cache.
#[test]
fn keep_prompt_infeasible_is_an_error() {
    let g = Gguf::open(&util::default_model()).unwrap();
    let w = Weights::from_gguf(&g).unwrap();
    let toks = wiki_tokens(&g, 80);
    let e = Evictor {
        keep_prompt_until: usize::MAX,
        ..evictor(64, 4, 16, 1)
    };
    let mut s = Session::with_policy(&w, 128, THREADS, 512, policy("knorm", 0, e)).unwrap();
    s.protect_prompt(60);
    s.feed(&toks[..60], Logits::Last).unwrap();
    for i in 60..64 {
        s.feed(&toks[i..i + 1], Logits::Last).unwrap();
    }
    assert_eq!(s.kv.cells.n_live(), 64);
    let err = s.feed(&toks[64..65], Logits::Last).unwrap_err().to_string();
    assert!(err.contains("--kv-budget"), "{err}");
    assert_eq!(s.kv.cells.n_live(), 64);
    assert_eq!(s.kv.peak_live, 64);
}

#[test]
fn with_policy_rejects_impossible_budgets() {
    let g = Gguf::open(&util::default_model()).unwrap();
    let w = Weights::from_gguf(&g).unwrap();
    let err = Session::with_policy(&w, 64, 1, 8, policy("window", 0, evictor(0, 0, 0, 1)))
        .unwrap_err()
        .to_string();
    assert!(err.contains("--kv-budget"), "{err}");
    let err = Session::with_policy(&w, 64, 1, 8, policy("window", 0, evictor(36, 4, 32, 1)))
        .unwrap_err()
        .to_string();
    assert!(err.contains("--kv-budget"), "{err}");
    let s = Session::with_policy(&w, 64, 1, 8, policy("window", 0, evictor(37, 4, 32, 1))).unwrap();
    assert_eq!(s.state.n_batch, 1);
}

// ------------------------------------------------------------ 4. no eviction = no change

/// 150 tokens prefilled (chunks of 64, all logits) then 50 decoded one by one.
fn logits_200(s: &mut Session, toks: &[u32]) -> Vec<u32> {
    let mut out: Vec<f32> = s.feed(&toks[..150], Logits::All).unwrap().to_vec();
    for t in &toks[150..200] {
        out.extend_from_slice(s.feed(&[*t], Logits::Last).unwrap());
    }
    assert_eq!(out.len(), 200 * s.w.config.vocab);
    out.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn budget_never_reached_is_bit_identical_to_full() {
    let g = Gguf::open(&util::default_model()).unwrap();
    let w = Weights::from_gguf(&g).unwrap();
    let toks = wiki_tokens(&g, 200);
    // the full-cache reference at each prefill chunk size the budgeted
    // sessions use (with_policy caps n_batch; chunking is not under test here)
    let mut refs: Vec<(usize, Vec<u32>)> = Vec::new();
    let mut reference = |nb: usize| -> Vec<u32> {
        if let Some((_, r)) = refs.iter().find(|(b, _)| *b == nb) {
            return r.clone();
        }
        let r = logits_200(&mut Session::new(&w, 256, THREADS, nb), &toks);
        refs.push((nb, r.clone()));
        r
    };
    let first = reference(64);
    let again = logits_200(&mut Session::new(&w, 256, THREADS, 64), &toks);
    assert!(first == again, "Session::new is not deterministic");
    for name in names().into_iter().filter(|&n| n != "full") {
        // budget exactly the text length (boundary: resident + new == budget) and a larger one
        // (pyramidkv's smallest layer budget is w + (B − w)/20: a budget
        // whose top layer holds 200 tokens)
        let budgets: &[usize] = match name {
            "window" => &[200, 1024],
            // headkv's per-head budgets are shares of B − window: a
            // budget whose smallest head holds 200 tokens
            "pyramidkv" | "critical-pyramidkv" | "headkv" => &[3400],
            _ => &[200],
        };
        for &budget in budgets {
            let mut s = Session::with_policy(
                &w,
                256,
                THREADS,
                64,
                policy(name, 1, evictor(budget, 4, 32, 1)),
            )
            .unwrap();
            let full = reference(s.state.n_batch);
            let got = logits_200(&mut s, &toks);
            assert_eq!(s.n_evicted, 0, "{name} budget {budget}");
            assert_eq!(s.kv.peak_live, 200);
            if let Some(i) = got.iter().zip(&full).position(|(a, b)| a != b) {
                panic!(
                    "{name} budget {budget}: logits differ from the full cache at token {} ({} vs {})",
                    i / w.config.vocab,
                    f32::from_bits(got[i]),
                    f32::from_bits(full[i])
                );
            }
        }
    }
}

// ------------------------------------------------------------ 5. lowest-scored are evicted

/// −mean over layers and KV heads of ‖k‖₂, recomputed from the stored keys.
fn knorm_score(kv: &kvrun::kv::KvCache, slot: usize) -> f32 {
    let mut total = 0f64;
    let mut n = 0;
    for l in 0..kv.n_layers {
        let mut row = vec![0f32; kv.kv_dim];
        kv.k_f32(l, slot, &mut row);
        for k in row.chunks_exact(kv.head_dim) {
            total += k.iter().map(|&x| (x as f64).powi(2)).sum::<f64>().sqrt();
            n += 1;
        }
    }
    assert_eq!(n, kv.n_layers * kv.kv_dim / kv.head_dim);
    (-total / n as f64) as f32
}

#[test]
fn knorm_evicts_the_lowest_scored() {
    let g = Gguf::open(&util::default_model()).unwrap();
    let w = Weights::from_gguf(&g).unwrap();
    let toks = wiki_tokens(&g, 300);
    let (budget, sink, recent) = (128, 4, 16);
    let mut s = Session::with_policy(
        &w,
        300,
        THREADS,
        512,
        policy("knorm", 0, evictor(budget, sink, recent, 1)),
    )
    .unwrap();
    s.feed(&toks[..200], Logits::Last).unwrap();
    let mut checked = 0;
    for (i, &t) in toks.iter().enumerate().skip(200) {
        let (slots, pos) = {
            let (a, b) = s.kv.live();
            (a.to_vec(), b.to_vec())
        };
        let mut scores = Vec::new();
        s.live_scores(&mut scores).unwrap();
        assert_eq!(scores.len(), slots.len());
        for (j, &sl) in slots.iter().enumerate() {
            let want = knorm_score(&s.kv, sl as usize);
            assert!(
                (scores[j] - want).abs() <= 1e-4 * want.abs().max(1.0),
                "knorm score {} vs recomputed {want}",
                scores[j]
            );
            assert!(scores[j] < 0.0);
        }
        s.feed(&[t], Logits::Last).unwrap();
        let after = s.kv.live().1;
        let victims: Vec<usize> = (0..pos.len())
            .filter(|&j| after.binary_search(&pos[j]).is_err())
            .collect();
        assert_eq!(
            victims.len(),
            1,
            "exactly one eviction per decode step at the budget (token {i})"
        );
        let v = victims[0];
        let newest = i as i64;
        let protected = |p: i64| (p as usize) < sink || newest - p < recent as i64;
        assert!(!protected(pos[v]), "protected position {} evicted", pos[v]);
        for j in (0..pos.len()).filter(|&j| j != v && !protected(pos[j])) {
            assert!(
                scores[v] < scores[j] || (scores[v] == scores[j] && pos[v] < pos[j]),
                "token {i}: evicted pos {} (score {}) but kept pos {} (score {})",
                pos[v],
                scores[v],
                pos[j],
                scores[j]
            );
        }
        // the freed slot is the one the new token takes (ring search, single hole)
        assert_eq!(s.kv.cells.pos(slots[v] as usize), Some(newest));
        checked += 1;
    }
    assert_eq!(checked, 100);
}

// ------------------------------------------------------------ 6. random is seeded

/// Live positions after every feed.
fn random_history<'w>(w: &'w Weights<'w>, toks: &[u32], seed: u64) -> Vec<Vec<i64>> {
    let mut s = Session::with_policy(
        w,
        toks.len(),
        THREADS,
        512,
        policy("random", seed, evictor(96, 4, 16, 1)),
    )
    .unwrap();
    let mut h = Vec::new();
    s.feed(&toks[..120], Logits::Last).unwrap();
    h.push(s.kv.live().1.to_vec());
    for t in &toks[120..] {
        s.feed(&[*t], Logits::Last).unwrap();
        h.push(s.kv.live().1.to_vec());
    }
    h
}

#[test]
fn random_is_deterministic_per_seed() {
    let g = Gguf::open(&util::default_model()).unwrap();
    let w = Weights::from_gguf(&g).unwrap();
    let toks = wiki_tokens(&g, 180);
    let a = random_history(&w, &toks, 7);
    let b = random_history(&w, &toks, 7);
    let c = random_history(&w, &toks, 8);
    assert_eq!(a, b, "same seed, different evictions");
    assert_ne!(
        a.last(),
        c.last(),
        "different seeds evicted the same positions"
    );
}

// ------------------------------------------------------------ 7. attention mass

#[test]
fn tova_scores_are_a_probability_row() {
    let g = Gguf::open(&util::default_model()).unwrap();
    let w = Weights::from_gguf(&g).unwrap();
    let toks = wiki_tokens(&g, 230);
    let mut s = Session::with_policy(
        &w,
        230,
        THREADS,
        512,
        policy("tova", 0, evictor(96, 4, 32, 1)),
    )
    .unwrap();
    assert!(s.state.n_batch < 150, "prompt must be chunked");
    let sum_live = |s: &mut Session| {
        let n_live = s.kv.live().0.len();
        let mut sc = Vec::new();
        s.live_scores(&mut sc).unwrap();
        assert_eq!(sc.len(), n_live);
        assert!(
            sc.iter().all(|&x| (0.0..=1.0).contains(&x)),
            "scores outside [0, 1]: {sc:?}"
        );
        sc.iter().map(|&x| x as f64).sum::<f64>()
    };
    // after a chunked prefill: the last row of the last chunk
    s.feed(&toks[..150], Logits::Last).unwrap();
    let t = sum_live(&mut s);
    assert!((t - 1.0).abs() < 1e-3, "prefill: tova scores sum to {t}");
    for (i, tk) in toks.iter().enumerate().skip(150) {
        s.feed(&[*tk], Logits::Last).unwrap();
        let t = sum_live(&mut s);
        assert!((t - 1.0).abs() < 1e-3, "token {i}: tova scores sum to {t}");
    }
    assert!(s.n_evicted > 0);
}

/// h2o accumulates one probability row per query row: the resident total
/// grows by n_new per forward step and loses exactly the victims' scores
/// (checked per feed of at most n_batch tokens, i.e. one forward step).
#[test]
fn h2o_accumulated_mass_is_conserved() {
    let g = Gguf::open(&util::default_model()).unwrap();
    let w = Weights::from_gguf(&g).unwrap();
    let toks = wiki_tokens(&g, 230);
    let mut s = Session::with_policy(
        &w,
        230,
        THREADS,
        512,
        policy("h2o", 0, evictor(96, 4, 32, 3)),
    )
    .unwrap();
    let scores = |s: &mut Session| {
        let (slots, pos) = {
            let (a, b) = s.kv.live();
            (a.to_vec(), b.to_vec())
        };
        let mut sc = Vec::new();
        s.live_scores(&mut sc).unwrap();
        assert_eq!(sc.len(), slots.len());
        (pos, sc)
    };
    let nb = s.state.n_batch;
    // 60 tokens, no eviction yet: 60 rows of mass
    s.feed(&toks[..60], Logits::Last).unwrap();
    let (_, sc) = scores(&mut s);
    let total: f64 = sc.iter().map(|&x| x as f64).sum();
    assert!(
        (total - 60.0).abs() < 60.0 * 1e-4,
        "h2o after 60 rows: {total}"
    );
    let mut i = 60;
    let steps = [1usize, 1, 7, 1, 60, 1, 1, 20, 1, 1, 1, 1, 16, 1, 1];
    let mut k = 0;
    while i < toks.len() {
        let n = steps[k % steps.len()].min(nb).min(toks.len() - i);
        k += 1;
        let (pos0, sc0) = scores(&mut s);
        s.feed(&toks[i..i + n], Logits::Last).unwrap();
        i += n;
        let (pos1, sc1) = scores(&mut s);
        let before: f64 = sc0.iter().map(|&x| x as f64).sum();
        let lost: f64 = pos0
            .iter()
            .zip(&sc0)
            .filter(|(p, _)| pos1.binary_search(p).is_err())
            .map(|(_, &x)| x as f64)
            .sum();
        let after: f64 = sc1.iter().map(|&x| x as f64).sum();
        let want = before - lost + n as f64;
        assert!(
            (after - want).abs() < 1e-4 * want.max(1.0),
            "at {i}: h2o total {after}, expected {want}"
        );
        assert!(sc1.iter().all(|&x| x >= 0.0));
    }
    assert!(s.n_evicted > 0);
}

// ------------------------------------------------------------ 8. wrappers

/// A test-only wrapper: negates the inner scores, remembering the budgets
/// it was told and the W_O row it read at prepare.
#[derive(Debug)]
struct Negate {
    budgets: Arc<Mutex<Vec<usize>>>,
    wo_row: Arc<Mutex<Vec<f32>>>,
}

impl Rescorer for Negate {
    fn prepare(&mut self, m: &ModelView<'_>, cache: CacheShape) -> kvrun::Result<()> {
        let mut wo = Vec::new();
        m.wo_f32(3, &mut wo)?;
        let c = m.config();
        assert_eq!(wo.len(), c.dim * c.q_dim());
        assert_eq!(cache.budget, 128);
        // row 5: output channel 5's weights over the concatenated heads
        *self.wo_row.lock().unwrap() = wo[5 * c.q_dim()..6 * c.q_dim()].to_vec();
        Ok(())
    }
    fn rescore(&mut self, ctx: &ScoreCtx<'_>, out: &mut [f32]) {
        self.budgets.lock().unwrap().push(ctx.group_budget(0));
        for x in out.iter_mut() {
            *x = -*x;
        }
    }
}

/// A wrapper around any token scorer drives the real engine: knorm's
/// scores negated evict the highest-knorm token every step (ties: older
/// first), the wrapper sees the budget, and W_O reads back as the weights.
#[test]
fn a_wrapper_rescores_through_the_engine() {
    let g = Gguf::open(&util::default_model()).unwrap();
    let w = Weights::from_gguf(&g).unwrap();
    let toks = wiki_tokens(&g, 260);
    let (budget, sink, recent) = (128, 4, 16);
    let budgets = Arc::new(Mutex::new(Vec::new()));
    let wo_row = Arc::new(Mutex::new(Vec::new()));
    let inner = find("knorm")
        .unwrap()
        .build(&ScorerOptions::default())
        .unwrap()
        .unwrap();
    let wrapped = Wrapped::new(
        inner.scorer,
        Negate {
            budgets: budgets.clone(),
            wo_row: wo_row.clone(),
        },
    );
    let p = Policy::new("neg-knorm", inner.caps, Box::new(wrapped), inner.rule).unwrap();
    let mut s = Session::with_policy(
        &w,
        260,
        THREADS,
        512,
        KvPolicy::new(p, evictor(budget, sink, recent, 1)),
    )
    .unwrap();
    let mut direct = vec![0f32; w.config.q_dim()];
    w.layers[3].wo.dequantize_row(5, &mut direct);
    assert_eq!(*wo_row.lock().unwrap(), direct);
    s.feed(&toks[..200], Logits::Last).unwrap();
    let mut scores = Vec::new();
    for (i, &t) in toks.iter().enumerate().skip(200) {
        let (slots, pos) = {
            let (a, b) = s.kv.live();
            (a.to_vec(), b.to_vec())
        };
        // what the evictor sees: the negated knorm score
        s.live_scores(&mut scores).unwrap();
        for (j, &sl) in slots.iter().enumerate() {
            let want = -knorm_score(&s.kv, sl as usize);
            assert!(
                (scores[j] - want).abs() <= 1e-4 * want.abs().max(1.0),
                "wrapped score {} vs negated knorm {want}",
                scores[j]
            );
            assert!(scores[j] > 0.0);
        }
        s.feed(&[t], Logits::Last).unwrap();
        let after = s.kv.live().1;
        let v: Vec<usize> = (0..pos.len())
            .filter(|&j| after.binary_search(&pos[j]).is_err())
            .collect();
        assert_eq!(v.len(), 1, "token {i}");
        let v = v[0];
        let newest = i as i64;
        let protected = |p: i64| (p as usize) < sink || newest - p < recent as i64;
        assert!(!protected(pos[v]), "protected position {} evicted", pos[v]);
        // the highest-knorm unprotected token went (ties: older first)
        for j in (0..pos.len()).filter(|&j| j != v && !protected(pos[j])) {
            assert!(
                scores[v] < scores[j] || (scores[v] == scores[j] && pos[v] < pos[j]),
                "token {i}: evicted pos {} but kept pos {}",
                pos[v],
                pos[j]
            );
        }
    }
    let b = budgets.lock().unwrap();
    assert!(b.len() >= 60 && b.iter().all(|&x| x == budget), "{b:?}");
}

// ------------------------------------------------------------ 9. signals as data

#[test]
fn needs_union_and_settings_named_per_front_end() {
    let a = Needs::taps(vec![21, 10, 10]);
    assert_eq!(a.tap_layers, vec![10, 21]);
    let b = Needs {
        query_window: 32,
        mass: MassMode::LastRow,
        ..Needs::taps(vec![10, 7])
    };
    let u = a.union(&b);
    assert_eq!(u.tap_layers, vec![7, 10, 21]);
    assert_eq!(
        (u.query_window, u.mass, u.attn_inputs),
        (32, MassMode::LastRow, false)
    );
    assert!(a.covered_by(&u) && b.covered_by(&u) && !u.covered_by(&a));
    assert_eq!(
        u.union(&Needs::mass(MassMode::AllRows)).mass,
        MassMode::AllRows
    );
    assert!(Needs::none().is_none() && !u.is_none());
    // nothing needed, nothing allocated
    let c = Config::from_gguf(&Gguf::open(&util::default_model()).unwrap()).unwrap();
    let s = Signals::for_needs(&Needs::none(), (&c).into(), 64, 8);
    assert!(s.taps.is_none() && s.queries.is_none() && s.mass.is_none() && s.attn_inputs.is_none());
    let s = Signals::for_needs(&u, (&c).into(), 64, 8);
    assert_eq!(s.taps.as_ref().unwrap().layers, vec![7, 10, 21]);
    assert_eq!(s.queries.as_ref().unwrap().w, 32);
    assert_eq!(s.mass.as_ref().unwrap().len(), 64);
    assert!(s.attn_inputs.is_none());

    // an error names the settings the way each front end spells them
    let e = PolicyConfig {
        policy: "h2o".into(),
        ..Default::default()
    }
    .build(0, std::path::Path::new(""))
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "--kv-budget: --policy h2o needs --kv-budget N"
    );
    let kvrun::Error::Config(c) = e else {
        panic!("not a settings error: {e}")
    };
    assert_eq!(
        c.render(|f| f.json().unwrap_or(f.flag())),
        "kv_budget: policy h2o needs kv_budget N"
    );
    let e = PolicyConfig {
        policy: "window".into(),
        budget: Some(64),
        prompt_policy: Some("lru".into()),
        ..Default::default()
    }
    .build(0, std::path::Path::new(""))
    .unwrap_err()
    .to_string();
    assert!(
        e.starts_with("--prompt-policy: unknown policy 'lru'"),
        "{e}"
    );
}

/// Records layer 0's attention inputs and counts steps.
#[derive(Debug, Default)]
struct InputsSeen {
    layer0: Vec<f32>,
    steps: usize,
}

impl StepObserver for InputsSeen {
    fn needs(&self) -> Needs {
        Needs {
            attn_inputs: true,
            ..Needs::none()
        }
    }
    fn on_step(&mut self, step: &Step<'_>) {
        let a = step.signals.attn_inputs.as_ref().unwrap();
        assert_eq!(a.n_tokens(), step.positions.len());
        self.layer0.extend_from_slice(a.layer(0));
        self.steps += 1;
    }
}

/// The attention block's inputs are recorded only when asked: layer 0's
/// is RMSNorm(token embedding) · attn_norm, and asking for them exports no
/// attention probabilities and changes no logit.
#[test]
fn attention_inputs_are_recorded_when_asked() {
    let g = Gguf::open(&util::default_model()).unwrap();
    let w = Weights::from_gguf(&g).unwrap();
    let toks = wiki_tokens(&g, 40);
    let c = &w.config;
    let mut plain = Session::new(&w, 64, THREADS, 16);
    let want: Vec<u32> = plain
        .feed(&toks, Logits::All)
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect();
    let mut s = Session::new(&w, 64, THREADS, 16);
    let mut seen = InputsSeen::default();
    let got: Vec<u32> = s
        .feed_observed(&toks, Logits::All, &mut seen)
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect();
    assert!(got == want, "recording attention inputs changed the logits");
    assert_eq!(s.state.prob_exports, 0);
    assert_eq!(seen.steps, 3, "40 tokens in chunks of 16");
    assert_eq!(seen.layer0.len(), 40 * c.dim);
    let mut e = vec![0f32; c.dim];
    for (i, &t) in toks.iter().enumerate() {
        w.token_embd.dequantize_row(t as usize, &mut e);
        let ss = e.iter().map(|&x| (x as f64).powi(2)).sum::<f64>() / c.dim as f64;
        let scale = 1.0 / (ss + c.norm_eps as f64).sqrt();
        for d in 0..c.dim {
            let want = e[d] as f64 * scale * w.layers[0].attn_norm[d] as f64;
            let got = seen.layer0[i * c.dim + d] as f64;
            assert!(
                (got - want).abs() <= 1e-4 * want.abs().max(1.0),
                "token {i} dim {d}: {got} vs {want}"
            );
        }
    }
}
