//! EPIKV: rolling statistics against a direct O(W) computation, depth
//! scaling, every variant's score on hand-built inputs, the attention-free
//! guarantee on the real engine, prompt protection and prompt phases,
//! per-model configs and `kvrun calibrate epikv`.

use crate::util;

use kvrun::backend::pool::ThreadPool;
use kvrun::cmd::args::KvArgs;
use kvrun::cmd::calibrate::{propose, spearman};
use kvrun::format::gguf::Gguf;
use kvrun::generate::Session;
use kvrun::kv::KvCache;
use kvrun::model::llama::Logits;
use kvrun::model::ModelView;
use kvrun::model::{Config, Weights};
use kvrun::policy::epikv::{
    band, config_path_for, lag, parse_bands, parse_layers, seg, Epikv, EpikvLayers, EpikvOptions,
    Rolling, Variant, Z_EPS,
};
use kvrun::policy::{CacheShape, Entries, Evictor, ScoreCtx, Scorer, Step};
use kvrun::sample::Rng;
use kvrun::signals::{Needs, Signals};
use kvrun::tokenizer::Tokenizer;
use std::process::Command;

const THREADS: usize = 1;

fn model_config() -> Config {
    let g = Gguf::open(&util::default_model()).unwrap();
    Config::from_gguf(&g).unwrap()
}

/// Direct mean / population std / z over the last `w` values of `xs` (ending at the last one).
fn direct(xs: &[f64], w: usize) -> (f64, f64, f64) {
    let win = &xs[xs.len().saturating_sub(w)..];
    let n = win.len() as f64;
    let m = win.iter().sum::<f64>() / n;
    let sd = (win.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / n).sqrt();
    let z = if win.len() < 2 {
        0.0
    } else {
        (xs[xs.len() - 1] - m) / (sd + Z_EPS)
    };
    (m, sd, z)
}

// ------------------------------------------------------- rolling statistics

#[test]
fn rolling_statistics_match_a_direct_computation() {
    let mut rng = Rng::new(7);
    for &w in &[1usize, 2, 3, 5, 17, 64, 100] {
        for trial in 0..3 {
            let mut r = Rolling::new(w);
            let mut xs = Vec::new();
            // long enough to pass several exact recomputations (every 64·w pushes)
            let n = if trial == 0 { 64 * w * 3 + 11 } else { 300 };
            for i in 0..n {
                // heavy-tailed, with drift, like g on long traces
                let x = ((rng.next_f64() as f32) as f64).powi(3) * 50.0 + i as f64 * 0.01;
                xs.push(x);
                let z = r.push_z(x);
                let (m, sd, zd) = direct(&xs, w);
                assert!(
                    (r.mean() - m).abs() <= 1e-9 * (1.0 + m.abs()),
                    "w={w} i={i}: mean {} vs {m}",
                    r.mean()
                );
                assert!(
                    (r.std() - sd).abs() <= 1e-6 * (1.0 + sd),
                    "w={w} i={i}: std {} vs {sd}",
                    r.std()
                );
                assert!(
                    (z - zd).abs() <= 1e-5 * (1.0 + zd.abs()),
                    "w={w} i={i}: z {z} vs {zd}"
                );
                assert_eq!(r.count(), (i + 1).min(w));
            }
        }
    }
}

#[test]
fn z_is_zero_until_two_values_exist() {
    let mut r = Rolling::new(64);
    assert_eq!(r.push_z(5.0), 0.0);
    let z = r.push_z(7.0);
    // two values: mean 6, population std 1 → z = 1/(1+ε)
    assert!((z - 1.0 / (1.0 + Z_EPS)).abs() < 1e-12, "{z}");
    // a constant sequence has σ = 0 and z = 0, not NaN
    let mut c = Rolling::new(8);
    for _ in 0..20 {
        let z = c.push_z(3.0);
        assert!(z.abs() < 1e-6 && z.is_finite());
    }
    r.clear();
    assert_eq!(r.count(), 0);
    assert_eq!(r.push_z(1.0), 0.0);
}

// ------------------------------------------------------------ depth scaling

#[test]
fn depth_scaling_reproduces_the_reference_table() {
    // POLICIES.md §1.4: L, band A, rep A, band B, rep B
    let table = [
        (24, (5, 10), 8, (13, 19), 16),
        (28, (6, 11), 9, (16, 22), 18),
        (32, (7, 13), 10, (18, 25), 21),
        (36, (8, 15), 11, (20, 28), 24),
        (40, (9, 16), 13, (22, 31), 26),
        (48, (11, 20), 15, (27, 37), 31),
        (64, (14, 26), 20, (36, 50), 42),
    ];
    for (l, ba, ra, bb, rb) in table {
        let x = EpikvLayers::for_depth(l);
        assert_eq!(
            (x.band_a, x.layer_a, x.band_b, x.layer_b),
            (ba, ra, bb, rb),
            "L = {l}"
        );
        assert_eq!(x.window, 64);
        x.validate(l).unwrap();
    }
    // the default model (30 layers)
    let x = EpikvLayers::for_depth(30);
    assert_eq!((x.layer_a, x.layer_b), (9, 20));
}

#[test]
fn overrides_beat_config_beat_scaling() {
    let cfg = EpikvLayers {
        n_layers: 30,
        layer_a: 5,
        layer_b: 25,
        band_a: (3, 7),
        band_b: (20, 27),
        window: 32,
    };
    let mut o = EpikvOptions {
        config: Some(cfg.clone()),
        ..Default::default()
    };
    assert_eq!(o.resolve(30).unwrap(), cfg);
    o.layers = Some(parse_layers("4,22").unwrap());
    o.bands = Some(parse_bands("2-6,18-24").unwrap());
    o.window = Some(16);
    let r = o.resolve(30).unwrap();
    assert_eq!(
        (r.layer_a, r.layer_b, r.band_a, r.band_b, r.window),
        (4, 22, (2, 6), (18, 24), 16)
    );
    // a config made for another depth is refused, as are out-of-range layers
    assert!(o.resolve(32).is_err());
    let bad = EpikvOptions {
        layers: Some((3, 30)),
        ..Default::default()
    };
    assert!(bad.resolve(30).is_err());
    assert!(
        parse_layers("3").is_err()
            && parse_bands("1-2").is_err()
            && parse_bands("a-b,c-d").is_err()
    );
    assert!(EpikvOptions {
        bands: Some(((9, 3), (10, 12))),
        ..Default::default()
    }
    .resolve(30)
    .is_err());
}

// ------------------------------------------------- variants on hand-built g

/// A scorer prepared for a model `c` and `n_slots` slots.
fn prepared(variant: Variant, c: &Config, n_slots: usize) -> Epikv {
    let mut e = Epikv::new(variant, EpikvOptions::default());
    e.prepare(
        &ModelView::config_only(c),
        CacheShape {
            n_slots,
            budget: n_slots,
        },
    )
    .unwrap();
    e
}

/// Signals holding taps at `layers`.
fn tap_signals(layers: &[usize], c: &Config) -> Signals {
    let s = Signals::for_needs(&Needs::taps(layers.to_vec()), c.into(), 1, 1);
    assert_eq!(s.taps.as_ref().unwrap().layers, layers);
    s
}

/// `e` observes a step that wrote `slots` at `positions`.
fn observe(
    e: &mut Epikv,
    kv: &KvCache,
    sig: &Signals,
    slots: &[u32],
    positions: &[i64],
    prompt_end: i64,
) {
    e.observe(&Step {
        kv,
        slots,
        positions,
        signals: sig,
        mass: None,
        prompt_end,
        pool: &ThreadPool::new(1),
    });
}

/// `e`'s scores of `kv`'s live tokens under `budget`, recent window
/// `n_recent` and prompt end `prompt_end`.
fn score_live(
    e: &mut Epikv,
    kv: &KvCache,
    sig: &Signals,
    budget: usize,
    n_recent: usize,
    prompt_end: i64,
) -> Vec<f32> {
    let (slots, pos) = kv.live();
    let rules = Evictor {
        budget,
        n_sink: 0,
        n_recent,
        keep_prompt_until: 0,
        evict_every: 1,
    };
    let pool = ThreadPool::new(1);
    let ctx = ScoreCtx {
        kv,
        signals: sig,
        pool: &pool,
        rules: &rules,
        newest: pos.last().copied().unwrap_or(0),
        n_new: 1,
        prompt_end,
        entries: Entries::Tokens { slots, pos },
    };
    let mut out = vec![0f32; slots.len()];
    e.score(&ctx, &mut out);
    out
}

/// Feed one token per step with per-layer g given by `g(t, layer)`; return
/// the frozen score of each token.
fn scores_for(
    variant: Variant,
    n_layers: usize,
    n: usize,
    g: impl Fn(usize, usize) -> f32,
) -> (Vec<f32>, Vec<usize>) {
    let mut c = model_config();
    c.n_layers = n_layers;
    let mut e = prepared(variant, &c, n);
    let layers = e.needs().tap_layers;
    let mut sig = tap_signals(&layers, &c);
    let mut kv = KvCache::new(1, 8, 8, n);
    let mut slot = Vec::new();
    for t in 0..n {
        kv.apply(&[], &[t as i64], &mut slot).unwrap();
        assert_eq!(slot, [t as u32]);
        let taps = sig.taps.as_mut().unwrap();
        taps.g = layers.iter().map(|&l| g(t, l)).collect();
        taps.first_valid = 0;
        observe(&mut e, &kv, &sig, &[t as u32], &[t as i64], 0);
    }
    let out = score_live(&mut e, &kv, &sig, n, 8, 0);
    (out, layers)
}

fn hand_g(t: usize, l: usize) -> f32 {
    // layer-dependent level, a slow trend, a periodic component, one spike
    let base = 1.0 + l as f32 * 0.1 + t as f32 * 0.002 + ((t * (l + 3)) % 7) as f32 * 0.05;
    if t == 90 && l == 10 {
        base + 5.0
    } else {
        base
    }
}

#[test]
fn flat_score_is_z_a_minus_z_b() {
    let n = 200;
    let (s, layers) = scores_for(Variant::Flat, 32, n, hand_g);
    assert_eq!(layers, vec![10, 21]);
    let (mut ga, mut gb) = (Vec::new(), Vec::new());
    for t in 0..n {
        ga.push(hand_g(t, 10) as f64);
        gb.push(hand_g(t, 21) as f64);
        let want = direct(&ga, 64).2 - direct(&gb, 64).2;
        assert!(
            (s[t] as f64 - want).abs() < 1e-4 * (1.0 + want.abs()),
            "t={t}: {} vs {want}",
            s[t]
        );
    }
    // the spike in layer A makes token 90 the best-scored one
    let best = (0..n).max_by(|&a, &b| s[a].total_cmp(&s[b])).unwrap();
    assert_eq!(best, 90);
}

#[test]
fn raw_score_is_a_difference_of_rolling_means() {
    let n = 150;
    let (s, _) = scores_for(Variant::Raw, 32, n, hand_g);
    let (mut ga, mut gb) = (Vec::new(), Vec::new());
    for t in 0..n {
        ga.push(hand_g(t, 10) as f64);
        gb.push(hand_g(t, 21) as f64);
        let want = direct(&ga, 64).0 - direct(&gb, 64).0;
        assert!(
            (s[t] as f64 - want).abs() < 1e-4,
            "t={t}: {} vs {want}",
            s[t]
        );
    }
}

#[test]
fn band_score_weights_band_mean_z_scores() {
    let n = 150;
    let (s, layers) = scores_for(Variant::Band, 32, n, hand_g);
    assert_eq!(layers, (7..=13).chain(18..=25).collect::<Vec<_>>());
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for t in 0..n {
        a.push((7..=13).map(|l| hand_g(t, l) as f64).sum::<f64>() / 7.0);
        b.push((18..=25).map(|l| hand_g(t, l) as f64).sum::<f64>() / 8.0);
        let want = band::W_A * direct(&a, 64).2 - band::W_B * direct(&b, 64).2;
        assert!(
            (s[t] as f64 - want).abs() < 1e-4 * (1.0 + want.abs()),
            "t={t}: {} vs {want}",
            s[t]
        );
    }
}

/// A cache of `n_layers` layers, 2 KV heads of 4 dims, with `n` tokens whose
/// K/V come from `kf(l, t, d)` / `vf(l, t, d)`; returns it and the slots.
fn hand_cache(
    n_layers: usize,
    n: usize,
    n_slots: usize,
    kf: impl Fn(usize, usize, usize) -> f32,
) -> (KvCache, Vec<u32>) {
    let mut kv = KvCache::new(n_layers, 8, 4, n_slots);
    let pos: Vec<i64> = (0..n as i64).collect();
    let mut slots = Vec::new();
    kv.apply(&[], &pos, &mut slots).unwrap();
    for (t, &s) in slots.iter().enumerate() {
        for l in 0..n_layers {
            let k: Vec<f32> = (0..8).map(|d| kf(l, t, d)).collect();
            let v: Vec<f32> = (0..8).map(|d| kf(l, t, d + 8) * 0.5).collect();
            kv.write(l, s as usize, &k, &v);
        }
    }
    (kv, slots)
}

/// Direct EPIKV-lag scores of the live tokens (position order).
fn lag_direct(kv: &KvCache) -> Vec<f32> {
    let (slots, _) = kv.live();
    let mean = |row: &dyn Fn(usize, usize) -> Vec<f32>, s: usize| -> Vec<f32> {
        let mut m = vec![0f32; kv.kv_dim];
        for l in 0..kv.n_layers {
            for (a, b) in m.iter_mut().zip(row(l, s)) {
                *a += b;
            }
        }
        m.iter().map(|x| x / kv.n_layers as f32).collect()
    };
    let krow = |l: usize, s: usize| {
        let mut r = vec![0f32; kv.kv_dim];
        kv.k_f32(l, s, &mut r);
        r
    };
    let vrow = |l: usize, s: usize| {
        let mut r = vec![0f32; kv.kv_dim];
        kv.v_f32(l, s, &mut r);
        r
    };
    let mut out = vec![0f32; slots.len()];
    for bar in [&krow as &dyn Fn(usize, usize) -> Vec<f32>, &vrow] {
        let rows: Vec<Vec<f32>> = slots.iter().map(|&s| mean(bar, s as usize)).collect();
        for (i, o) in out.iter_mut().enumerate() {
            let c = i / lag::CHUNK;
            let x: Vec<f32> = if c == 0 {
                rows[i].clone()
            } else {
                let prev = &rows[(c - 1) * lag::CHUNK..c * lag::CHUNK];
                (0..kv.kv_dim)
                    .map(|d| {
                        let lo = prev.iter().map(|r| r[d]).fold(f32::INFINITY, f32::min);
                        let hi = prev.iter().map(|r| r[d]).fold(f32::NEG_INFINITY, f32::max);
                        (rows[i][d] - lo) / (hi - lo + 1e-9)
                    })
                    .collect()
            };
            let mut total = 0.0;
            for h in x.chunks(kv.head_dim) {
                let m = h.iter().sum::<f32>() / h.len() as f32;
                total += (h.iter().map(|y| (y - m) * (y - m)).sum::<f32>() / h.len() as f32).sqrt();
            }
            *o += total / (kv.kv_dim / kv.head_dim) as f32;
        }
    }
    out
}

#[test]
fn lag_score_matches_a_direct_computation_incrementally() {
    let mut rng = Rng::new(3);
    let noise: Vec<f32> = (0..3 * 600 * 16)
        .map(|_| (rng.next_f64() as f32) * 2.0 - 1.0)
        .collect();
    let kf =
        |l: usize, t: usize, d: usize| noise[(l * 600 + t) * 16 + d] * (1.0 + (t / 100) as f32);
    let n_slots = 600;
    let (mut kv, slots) = hand_cache(3, 450, n_slots, kf);
    let mut c = model_config();
    c.n_kv_heads = 2;
    c.head_dim = 4;
    let mut e = prepared(Variant::Lag, &c, n_slots);
    assert!(
        e.needs().tap_layers.is_empty(),
        "epikv-lag reads no hidden states"
    );
    let none = Signals::default();
    observe(
        &mut e,
        &kv,
        &none,
        &slots,
        &(0..450).collect::<Vec<i64>>(),
        0,
    );
    let check = |e: &mut Epikv, kv: &KvCache| {
        let out = score_live(e, kv, &none, n_slots, 8, 0);
        let want = lag_direct(kv);
        for (i, (a, b)) in out.iter().zip(&want).enumerate() {
            assert!(
                (a - b).abs() < 1e-3 * (1.0 + b.abs()),
                "token {i}: {a} vs {b}"
            );
        }
    };
    check(&mut e, &kv);
    // evict a few tokens at different depths, append new ones, re-score:
    // the incremental path must still equal a from-scratch computation
    for round in 0..4 {
        let (s, _) = kv.live();
        let victims = vec![s[300 - round * 70], s[10 + round]];
        let newest = *kv.live().1.last().unwrap();
        let pos = vec![newest + 1, newest + 2];
        let mut new_slots = Vec::new();
        kv.apply(&victims, &pos, &mut new_slots).unwrap();
        for (j, &sl) in new_slots.iter().enumerate() {
            for l in 0..3 {
                let t = (pos[j] as usize) % 600;
                let k: Vec<f32> = (0..8).map(|d| kf(l, t, d)).collect();
                let v: Vec<f32> = (0..8).map(|d| kf(l, t, d + 8)).collect();
                kv.write(l, sl as usize, &k, &v);
            }
        }
        observe(&mut e, &kv, &none, &new_slots, &pos, 0);
        check(&mut e, &kv);
    }
}

#[test]
fn seg_caps_follow_key_variance_tertiles() {
    // 3 segments of 128 evictable tokens after a 10-token prompt; segment 0
    // has high key variance (R: cap 64), segment 1 medium (E: 32), segment 2
    // low (T: 8); budget large enough for every cap
    let n = 10 + 3 * 128 + 16;
    let spread = |t: usize| -> f32 {
        match t {
            t if t < 10 => 1.0,
            t if t < 138 => 4.0,
            t if t < 266 => 2.0,
            t if t < 394 => 0.5,
            _ => 1.0,
        }
    };
    let (kv, slots) = hand_cache(
        2,
        n,
        n,
        |_, t, d| if d % 2 == 0 { spread(t) } else { -spread(t) },
    );
    let mut c = model_config();
    c.n_layers = 32;
    let mut e = prepared(Variant::Seg, &c, n);
    let layers = e.needs().tap_layers;
    let mut sig = tap_signals(&layers, &c);
    for t in 0..n {
        let taps = sig.taps.as_mut().unwrap();
        taps.g = layers.iter().map(|&l| hand_g(t, l)).collect();
        taps.first_valid = 0;
        observe(&mut e, &kv, &sig, &[slots[t]], &[t as i64], 10);
    }
    let s = kv.live().0;
    let mut out = score_live(&mut e, &kv, &sig, n, 16, 10);
    let kept = |out: &[f32], a: usize, b: usize| out[a..b].iter().filter(|&&x| x > 1e5).count();
    assert_eq!(kept(&out, 10, 138), seg::CAPS[0]);
    assert_eq!(kept(&out, 138, 266), seg::CAPS[1]);
    assert_eq!(kept(&out, 266, 394), seg::CAPS[2]);
    assert_eq!(
        kept(&out, 0, 10) + kept(&out, 394, n),
        0,
        "prompt and recent tokens are not segmented"
    );
    // inside a segment, the kept tokens are the best by the Flat score
    let mut flat: Vec<(f32, usize)> = (138..266).map(|i| (e.slot_score(s[i]), i)).collect();
    flat.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    for &(_, i) in &flat[..32] {
        assert!(
            out[i] > 1e5,
            "token {i} is among the 32 best of its segment"
        );
    }
    // a tight budget spends the caps left to right
    out = score_live(&mut e, &kv, &sig, 10 + 16 + 1 + 70, 16, 10);
    assert_eq!(
        (
            kept(&out, 10, 138),
            kept(&out, 138, 266),
            kept(&out, 266, 394)
        ),
        (64, 6, 0)
    );
}

// ---------------------------------------------------- on the real engine

fn wiki_ids(n: usize) -> Vec<u32> {
    let g = Gguf::open(&util::default_model()).unwrap();
    let tok = Tokenizer::from_gguf(&g).unwrap();
    let ids = tok.encode(&util::wikitext(n * 8), true, false).unwrap();
    ids[..n].to_vec()
}

fn kv_args(policy: &str, budget: usize) -> KvArgs {
    KvArgs {
        policy: policy.into(),
        kv_budget: Some(budget),
        kv_sink: 4,
        evict_every: Some(1),
        ..Default::default()
    }
}

/// Prefill `prompt` tokens then decode the rest one token at a time,
/// checking the budget at every step; returns the session.
fn run<'w>(w: &'w Weights<'w>, a: &KvArgs, ids: &[u32], n_prompt: usize) -> Session<'w> {
    let p = a.build(0, &util::default_model()).unwrap().unwrap();
    let budget = p.evictor.budget;
    let mut s = Session::with_policy(w, ids.len(), THREADS, 64, p).unwrap();
    s.protect_prompt(n_prompt);
    s.feed(&ids[..n_prompt], Logits::Last).unwrap();
    assert!(s.kv.live().0.len() <= budget);
    for &t in &ids[n_prompt..] {
        s.feed(&[t], Logits::Last).unwrap();
        assert!(s.kv.live().0.len() <= budget);
    }
    s
}

#[test]
fn epikv_is_attention_free_and_keeps_the_prompt() {
    let g = Gguf::open(&util::default_model()).unwrap();
    let w = Weights::from_gguf(&g).unwrap();
    let ids = wiki_ids(360);
    for name in ["epikv", "epikv-raw", "epikv-band", "epikv-lag", "epikv-seg"] {
        let s = run(&w, &kv_args(name, 128), &ids, 40);
        assert_eq!(
            s.state.prob_exports, 0,
            "{name} made the attention pass export probabilities"
        );
        assert!(
            s.n_evicted >= 360 - 128,
            "{name}: only {} evictions",
            s.n_evicted
        );
        let (_, pos) = s.kv.live();
        for p in 0..40 {
            assert!(pos.contains(&p), "{name}: prompt position {p} was evicted");
        }
        // the recent window (min(128, budget/4) = 32) is intact
        for p in 360 - 32..360 {
            assert!(
                pos.contains(&(p as i64)),
                "{name}: recent position {p} was evicted"
            );
        }
    }
    // the counter does count: an attention policy exports at every step
    let s = run(&w, &kv_args("h2o", 128), &ids[..200], 40);
    assert!(s.state.prob_exports >= 160);
}

#[test]
fn long_prompts_need_a_prompt_phase_and_get_one() {
    let g = Gguf::open(&util::default_model()).unwrap();
    let w = Weights::from_gguf(&g).unwrap();
    let ids = wiki_ids(420);
    // the prompt (300) cannot be kept inside a budget of 128: a clear error
    let a = kv_args("epikv", 128);
    let p = a.build(0, &util::default_model()).unwrap().unwrap();
    let mut s = Session::with_policy(&w, ids.len(), THREADS, 64, p).unwrap();
    s.protect_prompt(300);
    let e = s.feed(&ids[..300], Logits::Last).unwrap_err().to_string();
    assert!(e.contains("--prompt-policy"), "{e}");

    // --epikv-score-prompt: prompt tokens compete with their own scores
    let mut a = kv_args("epikv", 128);
    a.epikv_score_prompt = true;
    let s = run(&w, &a, &ids, 300);
    assert_eq!(s.state.prob_exports, 0);
    assert!(s.kv.live().1.iter().filter(|&&p| p < 300).count() < 100);

    // --prompt-policy window: the prompt is trimmed to the prompt budget,
    // its survivors are then kept through decoding
    let mut a = kv_args("epikv", 128);
    a.prompt_policy = Some("window".into());
    a.prompt_budget = Some(64);
    let p = a.build(0, &util::default_model()).unwrap().unwrap();
    let mut s = Session::with_policy(&w, ids.len(), THREADS, 64, p).unwrap();
    s.protect_prompt(300);
    s.feed(&ids[..300], Logits::Last).unwrap();
    let survivors: Vec<i64> = s.kv.live().1.to_vec();
    assert!(
        survivors.len() <= 64,
        "{} prompt tokens after the prompt phase",
        survivors.len()
    );
    assert!(
        survivors.contains(&0) && survivors.contains(&299),
        "window keeps sinks and the newest"
    );
    for &t in &ids[300..] {
        s.feed(&[t], Logits::Last).unwrap();
        assert!(s.kv.live().0.len() <= 128);
    }
    for p in &survivors {
        assert!(
            s.kv.live().1.contains(p),
            "prompt survivor {p} evicted during decoding"
        );
    }
    assert_eq!(s.state.prob_exports, 0, "window and epikv export nothing");
}

// ------------------------------------------------------- configs and calibration

#[test]
fn spearman_and_proposal() {
    assert!(
        (spearman(&[1.0, 2.0, 3.0, 4.0, 5.0], &[5.0, 6.0, 7.0, 8.0, 7.0])
            - 0.820_782_681_668_123_3)
            .abs()
            < 1e-12
    );
    assert!((spearman(&[1.0, 2.0, 3.0], &[3.0, 2.0, 1.0]) + 1.0).abs() < 1e-12);
    assert_eq!(spearman(&[1.0, 1.0, 1.0], &[1.0, 2.0, 3.0]), 0.0);
    let mut rho = vec![0.01; 30];
    for (l, r) in rho.iter_mut().enumerate() {
        if (6..=12).contains(&l) {
            *r = 0.1 + if l == 9 { 0.1 } else { 0.0 };
        } else if (16..=23).contains(&l) {
            *r = -0.1 - if l == 19 { 0.1 } else { 0.0 };
        } else if l < 5 {
            *r = if l % 2 == 0 { 0.01 } else { -0.01 };
        } else {
            *r = 0.0;
        }
    }
    let (l, _) = propose(&rho, 48);
    assert_eq!(
        (l.band_a, l.layer_a, l.band_b, l.layer_b, l.window),
        ((6, 12), 9, (16, 23), 19, 48)
    );
    // nothing negative: band B falls back to depth scaling
    let (l, note) = propose(&[0.1; 30], 64);
    assert_eq!(l.band_b, EpikvLayers::for_depth(30).band_b);
    assert!(note.contains("band B kept"));
}

#[test]
fn calibrate_writes_a_config_that_kvrun_reads() {
    let dir = std::env::temp_dir().join(format!("kvrun-cal-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let text = dir.join("trace.txt");
    std::fs::write(&text, util::wikitext(3000)).unwrap();
    for label in ["occlusion", "attention"] {
        let out = dir.join(format!("{label}.json"));
        let o = Command::new(util::kvrun_bin())
            .args([
                "calibrate",
                "epikv",
                "-t",
                "1",
                "--max-tokens",
                "256",
                "--occlusion",
                "16",
            ])
            .args([
                "--continuation",
                "16",
                "--window",
                "16",
                "--label",
                label,
                "-f",
            ])
            .arg(&text)
            .arg("-o")
            .arg(&out)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&o.stdout);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        assert_eq!(
            stdout
                .lines()
                .filter(|l| l.trim_start().starts_with(char::is_numeric))
                .count(),
            30,
            "{stdout}"
        );
        assert!(stdout.contains("proposal: band A"), "{stdout}");
        let cfg = EpikvLayers::load(&out).unwrap();
        assert_eq!((cfg.n_layers, cfg.window), (30, 16));
        cfg.validate(30).unwrap();
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
        let rho = v["rho"].as_array().unwrap();
        assert_eq!(rho.len(), 30);
        assert!(rho.iter().all(|r| r.as_f64().unwrap().abs() <= 1.0));
        assert!(rho.iter().any(|r| r.as_f64().unwrap() != 0.0));
        // kvrun uses it
        let o = Command::new(util::kvrun_bin())
            .args([
                "-p",
                "Hello",
                "-n",
                "4",
                "-t",
                "1",
                "--policy",
                "epikv",
                "--kv-budget",
                "64",
                "--epikv-config",
            ])
            .arg(&out)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    // a config for another depth is a one-line error
    let other = dir.join("other.json");
    std::fs::write(
        &other,
        serde_json::to_string(&EpikvLayers::for_depth(32)).unwrap(),
    )
    .unwrap();
    let o = Command::new(util::kvrun_bin())
        .args([
            "-p",
            "Hello",
            "-n",
            "4",
            "--policy",
            "epikv",
            "--kv-budget",
            "64",
            "--epikv-config",
        ])
        .arg(&other)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("32 layers") && err.trim().lines().count() == 1,
        "{err}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn the_shipped_config_is_found_next_to_the_model() {
    let p = config_path_for(&util::default_model());
    assert_eq!(
        p.file_name().unwrap().to_str().unwrap(),
        "SmolLM2-135M-Instruct.Q4_1.epikv.json"
    );
    let cfg = EpikvLayers::load(&p)
        .expect("models/ ships the calibrated EPIKV config of the default model");
    assert_eq!(cfg.n_layers, 30);
    cfg.validate(30).unwrap();
    let resolved = EpikvOptions {
        config: Some(cfg.clone()),
        ..Default::default()
    }
    .resolve(30)
    .unwrap();
    assert_eq!(resolved, cfg);
}

#[test]
fn cli_errors_are_one_line() {
    let long = util::shared("README.md");
    for (args, want) in [
        (
            vec![
                "-f",
                long.to_str().unwrap(),
                "-n",
                "4",
                "--policy",
                "epikv",
                "--kv-budget",
                "256",
            ],
            "--prompt-policy",
        ),
        (
            vec![
                "-p",
                "Hi",
                "-n",
                "4",
                "--policy",
                "epikv",
                "--kv-budget",
                "64",
                "--epikv-layers",
                "3,30",
            ],
            "out of range",
        ),
        (
            vec![
                "-p",
                "Hi",
                "-n",
                "4",
                "--policy",
                "epikv",
                "--kv-budget",
                "64",
                "--epikv-bands",
                "9-3,10-12",
            ],
            "band",
        ),
        (
            vec![
                "-p",
                "Hi",
                "-n",
                "4",
                "--policy",
                "epikv",
                "--kv-budget",
                "64",
                "--prompt-budget",
                "32",
            ],
            "--prompt-policy",
        ),
        (
            vec!["-p", "Hi", "-n", "4", "--prompt-policy", "window"],
            "budgeted",
        ),
    ] {
        let o = Command::new(util::kvrun_bin())
            .args(&args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{args:?} succeeded");
        assert_eq!(err.trim().lines().count(), 1, "{args:?}: {err}");
        assert!(
            err.contains(want) && !err.contains("panicked"),
            "{args:?}: {err}"
        );
    }
    // and with a prompt phase the same long prompt runs inside the budget
    let o = Command::new(util::kvrun_bin())
        .args([
            "-f",
            long.to_str().unwrap(),
            "-n",
            "4",
            "-t",
            "1",
            "--policy",
            "epikv",
            "--kv-budget",
            "256",
        ])
        .args(["--prompt-policy", "window"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("policy=epikv") && err.contains("peak=") && !err.contains("peak=257"),
        "{err}"
    );
}

/// Regression: a prompt-phase policy gets the signals it declares, whatever
/// the main policy reads. The session used to record only the main scorer's
/// hidden-state taps and never hand them to the prompt scorer, so
/// `--prompt-policy epikv` silently ranked the prompt by position (its
/// survivors were exactly `--prompt-policy window`'s).
#[test]
fn prompt_phase_scorer_gets_its_own_signals() {
    let g = Gguf::open(&util::default_model()).unwrap();
    let w = Weights::from_gguf(&g).unwrap();
    let ids = wiki_ids(330);
    // (prompt survivors, attention exports during the prompt, after decoding)
    let run_phase = |main: &str, prompt: &str| -> (Vec<i64>, u64, u64) {
        let mut a = kv_args(main, 128);
        a.prompt_policy = Some(prompt.into());
        a.prompt_budget = Some(64);
        let p = a.build(0, &util::default_model()).unwrap().unwrap();
        let mut s = Session::with_policy(&w, ids.len(), THREADS, 64, p).unwrap();
        s.protect_prompt(300);
        s.feed(&ids[..300], Logits::Last).unwrap();
        let survivors = s.kv.live().1.to_vec();
        let in_prompt = s.state.prob_exports;
        for &t in &ids[300..] {
            s.feed(&[t], Logits::Last).unwrap();
        }
        (survivors, in_prompt, s.state.prob_exports)
    };
    // ranking by position alone: sinks + the newest prompt tokens
    let (by_pos, _, _) = run_phase("window", "window");
    let (a, ea, ea_end) = run_phase("window", "epikv");
    assert!(a.len() <= 64 && a.len() > 32, "{} survivors", a.len());
    assert_ne!(
        a, by_pos,
        "--prompt-policy epikv ranked the prompt by position: it got no hidden-state taps"
    );
    // the same survivors whatever the main policy taps (none, other layers, the same)
    for main in ["epikv-band", "epikv", "h2o"] {
        let (b, _, _) = run_phase(main, "epikv");
        assert_eq!(a, b, "--policy {main} --prompt-policy epikv");
    }
    assert_eq!((ea, ea_end), (0, 0), "window + epikv read no attention");
    // a prompt scorer that reads attention gets it during the prompt only
    let (_, eh, eh_end) = run_phase("window", "h2o");
    assert!(eh > 0, "--prompt-policy h2o exported no attention");
    assert_eq!(eh, eh_end, "attention exported after the prompt phase");
    // a prompt scorer that needs per-head streams (recent queries) cannot
    // work under a token-uniform main policy: a clear error, not a silent
    // ranking by position
    let mut a = kv_args("window", 128);
    a.prompt_policy = Some("snapkv".into());
    let e = a.build(0, &util::default_model()).unwrap_err().to_string();
    assert!(
        e.contains("--prompt-policy") && e.contains("token-uniform") && !e.contains('\n'),
        "{e}"
    );
}
