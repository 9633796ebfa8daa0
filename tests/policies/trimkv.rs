//! TRIM-KV / DBTrimKV: the gate forward against a direct computation, the
//! shared scoring head as one parameter, gate files (round trip, shape
//! mismatch, corrupt files), the global top-k on hand-built streams (exact
//! per-head lengths, total L·Hkv·M, the floor), budgets held while
//! decoding, and (feature `train`) the trainer: its model against kvrun's
//! own logits, gradients against finite differences, a short run that
//! lowers the loss and resumes from its checkpoint.

use crate::util;

use crate::policy::evictor;
use kvrun::format::gguf::Gguf;
use kvrun::generate::{KvPolicy, Session};
use kvrun::model::llama::Logits;
use kvrun::model::Weights;
use kvrun::policy::find;
use kvrun::policy::gates::{log_sigmoid, GateArch, GateNet, Gates};
use kvrun::policy::table::ScorerOptions;
use kvrun::policy::trimkv::{log1mexp, retention_score};
use kvrun::sample::Rng;
use kvrun::tokenizer::Tokenizer;
use std::sync::Arc;

fn wiki_tokens(g: &Gguf, n: usize) -> Vec<u32> {
    let tok = Tokenizer::from_gguf(g).unwrap();
    let ids = tok.encode(&util::wikitext(n * 8), false, false).unwrap();
    ids[..n].to_vec()
}

/// Gates with every weight drawn N(0, std) and biases N(bias, 1).
fn random_gates(
    arch: GateArch,
    dim: usize,
    inter: usize,
    nl: usize,
    nkv: usize,
    std: f32,
    bias: f32,
    seed: u64,
) -> Gates {
    let mut g = Gates::init(arch, dim, inter, nl, nkv, bias, seed);
    let mut rng = Rng::new(seed + 7);
    for t in g.tensors_mut() {
        for v in t.iter_mut() {
            *v = if *v == bias {
                bias + rng.normal()
            } else {
                std * rng.normal()
            };
        }
    }
    g
}

/// The gate MLP computed directly in f64 from its tensors.
fn direct(g: &Gates, l: usize, x: &[f32]) -> Vec<f64> {
    let silu = |v: f64| v / (1.0 + (-v).exp());
    let mut a: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    for d in &g.hidden[l] {
        a = (0..d.n_out)
            .map(|r| {
                silu(
                    (0..d.n_in)
                        .map(|c| d.w[r * d.n_in + c] as f64 * a[c])
                        .sum::<f64>()
                        + d.b[r] as f64,
                )
            })
            .collect();
    }
    let h = g.head(l);
    (0..h.n_out)
        .map(|r| {
            let z = (0..h.n_in)
                .map(|c| h.w[r * h.n_in + c] as f64 * a[c])
                .sum::<f64>()
                + h.b[r] as f64;
            // log σ(z)
            -(1.0 + (-z).exp()).ln()
        })
        .collect()
}

#[test]
fn gate_forward_matches_a_direct_computation() {
    // (width, hidden width), whole vectors and ragged
    for (arch, d, i) in [
        (GateArch::Rg, 72, 24),
        (GateArch::Rg10, 72, 21),
        (GateArch::Rg, 64, 32),
        (GateArch::Rg10, 96, 64),
    ] {
        let (nl, nkv) = (3, 2);
        let g = Arc::new(random_gates(arch, d, i, nl, nkv, 0.3, 2.0, 11));
        let n = 5;
        let mut rng = Rng::new(3);
        let x: Vec<f32> = (0..n * d).map(|_| rng.normal()).collect();
        let pool = kvrun::backend::pool::ThreadPool::new(2);
        // the f32 reference against f64
        let reference: Vec<Vec<f32>> = (0..nl)
            .map(|l| {
                let mut out = vec![0f32; n * nkv];
                g.log_beta(l, &x, n, &mut out);
                out
            })
            .collect();
        let close = |have: &[f32], tol: f64, what: &str| {
            let mut worst = 0f64;
            for l in 0..nl {
                for t in 0..n {
                    let want = direct(&g, l, &x[t * d..(t + 1) * d]);
                    for h in 0..nkv {
                        let v = have[(l * n + t) * nkv + h] as f64;
                        assert!(v <= 0.0);
                        worst = worst.max((v - want[h]).abs() / (1.0 + want[h].abs()));
                    }
                }
            }
            assert!(
                worst <= tol,
                "{arch:?} {d}x{i} {what}: worst {worst:e} > {tol:e}"
            );
        };
        close(&reference.concat(), 1e-5, "f32 reference");
        // the decoding net (f16 weights) within their rounding (measured
        // worst over the four shapes: 1.6e-3); the threads and the
        // one-layer entry point change nothing
        let net = GateNet::new(g.clone());
        let mut all = vec![0f32; nl * n * nkv];
        net.log_beta_all(&pool, |_| &x[..], n, &mut all, &mut Vec::new());
        for l in 0..nl {
            let mut one = vec![0f32; n * nkv];
            net.log_beta(l, &x, n, &mut one, &mut vec![0.0; 2 * i]);
            assert_eq!(
                &one[..],
                &all[l * n * nkv..(l + 1) * n * nkv],
                "threads change nothing"
            );
        }
        assert_ne!(all, reference.concat(), "f16 weights round");
        close(&all, 5e-3, "f16 net");
    }
    // log-sigmoid is stable at both ends
    assert_eq!(log_sigmoid(0.0), -std::f32::consts::LN_2);
    assert!((log_sigmoid(-200.0) + 200.0).abs() < 1e-3);
    assert!(log_sigmoid(40.0) <= 0.0 && log_sigmoid(40.0) > -1e-12);
    // the lookahead score is log Σ_{k<n} β^(a+k)
    for (lb, a, n) in [
        (-0.01f32, 7.0f32, 4usize),
        (-2.0, 3.0, 3),
        (-1e-4, 100.0, 16),
    ] {
        let want: f64 = (0..n)
            .map(|k| ((a as f64 + k as f64) * lb as f64).exp())
            .sum::<f64>()
            .ln();
        let have = retention_score(lb, a, n) as f64;
        assert!(
            (have - want).abs() < 1e-3 * (1.0 + want.abs()),
            "{lb} {a} {n}: {have} vs {want}"
        );
    }
    assert_eq!(retention_score(-0.5, 4.0, 1), -2.0);
    assert!((log1mexp(-1e-3) - (1.0f64 - (-1e-3f64).exp()).ln() as f32).abs() < 1e-3);
}

#[test]
fn the_shared_head_is_one_parameter() {
    let (d, i, nl, nkv) = (40, 16, 4, 3);
    let mut g = random_gates(GateArch::Rg10, d, i, nl, nkv, 0.3, 1.0, 5);
    assert_eq!(g.heads.len(), 1, "rg10: one scoring head for every layer");
    let names: Vec<String> = g.tensors().into_iter().map(|t| t.0).collect();
    assert_eq!(names.iter().filter(|n| n.starts_with("head.")).count(), 2);
    assert!(!names.iter().any(|n| n.contains(".head.")));
    let mut rng = Rng::new(9);
    let x: Vec<f32> = (0..d).map(|_| rng.normal()).collect();
    let before: Vec<Vec<f32>> = (0..nl)
        .map(|l| {
            let mut o = vec![0f32; nkv];
            g.log_beta(l, &x, 1, &mut o);
            o
        })
        .collect();
    // one change to the shared head moves every layer's scores
    g.heads[0].b[1] -= 1.5;
    g.heads[0].w[5] += 0.7;
    for l in 0..nl {
        let mut o = vec![0f32; nkv];
        g.log_beta(l, &x, 1, &mut o);
        assert!(
            o[1] < before[l][1],
            "layer {l} did not follow the shared head"
        );
    }
    // rg keeps one head per layer: changing layer 0's leaves layer 1 alone
    let mut r = random_gates(GateArch::Rg, d, i, nl, nkv, 0.3, 1.0, 5);
    assert_eq!(r.heads.len(), nl);
    let mut o1 = vec![0f32; nkv];
    r.log_beta(1, &x, 1, &mut o1);
    r.heads[0].b.iter_mut().for_each(|b| *b -= 3.0);
    let mut o2 = vec![0f32; nkv];
    r.log_beta(1, &x, 1, &mut o2);
    assert_eq!(o1, o2);
}

#[test]
fn gate_files_round_trip_and_mismatches_are_one_line_errors() {
    let dir = std::env::temp_dir().join(format!("kvrun-gates-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for arch in [GateArch::Rg, GateArch::Rg10] {
        let mut g = random_gates(arch, 48, 8, 3, 2, 0.2, 3.0, 1);
        g.meta = serde_json::json!({"model": "tiny", "budget": 17});
        let p = dir.join(format!("{}.gates.safetensors", arch.name()));
        g.save(&p).unwrap();
        let back = Gates::load(&p).unwrap();
        assert_eq!(back, g, "{arch:?} round trip");
        assert_eq!(back.meta["budget"], 17);
        // a model of another shape is refused, naming what differs
        let e = back.check_model(30, 576, 3).unwrap_err().to_string();
        assert!(
            e.contains("tiny") && e.contains("layers 3 (model: 30)"),
            "{e}"
        );
        assert!(!e.contains('\n'), "{e}");
        back.check_model(3, 48, 2).unwrap();
    }
    // corrupt and foreign files
    let p = dir.join("bad.safetensors");
    for bytes in [
        vec![1u8, 2, 3],
        {
            let mut b = (1u64 << 40).to_le_bytes().to_vec();
            b.extend_from_slice(b"{}");
            b
        },
        {
            let h = br#"{"__metadata__":{"format":"pt"}}"#;
            let mut b = (h.len() as u64).to_le_bytes().to_vec();
            b.extend_from_slice(h);
            b
        },
    ] {
        std::fs::write(&p, &bytes).unwrap();
        let e = Gates::load(&p).unwrap_err().to_string();
        assert!(e.contains("not a kvrun gate file"), "{e}");
        assert!(!e.contains('\n'), "{e}");
    }
    // truncated data
    let g = random_gates(GateArch::Rg10, 48, 8, 3, 2, 0.2, 3.0, 1);
    let good = dir.join("good.safetensors");
    g.save(&good).unwrap();
    let b = std::fs::read(&good).unwrap();
    std::fs::write(&p, &b[..b.len() - 10]).unwrap();
    let e = Gates::load(&p).unwrap_err().to_string();
    assert!(e.contains("data offsets"), "{e}");
    // the policy refuses gates of another model at prepare
    let gg = Gguf::open(&util::default_model()).unwrap();
    let w = Weights::from_gguf(&gg).unwrap();
    let opts = ScorerOptions {
        gates: Some(Arc::new(g)),
        ..Default::default()
    };
    let pol = find("dbtrimkv").unwrap().build(&opts).unwrap().unwrap();
    let e = Session::with_policy(&w, 256, 1, 64, KvPolicy::new(pol, evictor(64, 0, 0, 1)))
        .err()
        .expect("mismatched gates must be refused")
        .to_string();
    assert!(e.contains("retention gates were trained for"), "{e}");
    std::fs::remove_dir_all(&dir).ok();
}

/// Gates whose log β is a constant per (layer, KV head): zero weights, the
/// head biases set to `z[l][h]` (rg: one head per layer).
fn constant_gates(nl: usize, nkv: usize, dim: usize, z: impl Fn(usize, usize) -> f32) -> Gates {
    let mut g = Gates::init(GateArch::Rg, dim, 4, nl, nkv, 0.0, 1);
    for hid in g.hidden.iter_mut() {
        for d in hid.iter_mut() {
            d.w.fill(0.0);
        }
    }
    for (l, d) in g.heads.iter_mut().enumerate() {
        d.w.fill(0.0);
        for h in 0..nkv {
            d.b[h] = z(l, h);
        }
    }
    g
}

#[test]
fn global_top_k_on_hand_built_streams() {
    let gg = Gguf::open(&util::default_model()).unwrap();
    let w = Weights::from_gguf(&gg).unwrap();
    let (nl, nkv, dim) = (w.config.n_layers, w.config.n_kv_heads, w.config.dim);
    let n = 600;
    let toks = wiki_tokens(&gg, n);
    let m = 64;
    // rates spread from β ≈ 0.88 to β ≈ 0.9975 over the streams
    let z = |l: usize, h: usize| 2.0 + 4.0 * (((l * nkv + h) as f32 * 0.618_034) % 1.0);
    let g = constant_gates(nl, nkv, dim, z);
    let lb: Vec<f32> = (0..nl * nkv)
        .map(|s| {
            let mut o = vec![0f32; nkv];
            g.log_beta(s / nkv, &vec![0.0; dim], 1, &mut o);
            o[s % nkv]
        })
        .collect();
    for floor in [0usize, 40] {
        let opts = ScorerOptions {
            gates: Some(Arc::new(g.clone())),
            min_per_head: floor,
            trim_lookahead: 1,
            ..Default::default()
        };
        let pol = find("dbtrimkv").unwrap().build(&opts).unwrap().unwrap();
        let mut kp = KvPolicy::new(pol, evictor(m, 0, 0, 1));
        kp.compress_once = true;
        let mut s = Session::with_policy(&w, n + 32, 1, 64, kp).unwrap();
        s.protect_prompt(n);
        s.feed(&toks, Logits::Last).unwrap();
        // expected: every (stream, position) scored (n − pos)·log β; each
        // stream's top `floor` guarded; the rest ranked (score, position,
        // stream) ascending and the lowest evicted down to L·Hkv·M
        let ns = nl * nkv;
        let mut cand: Vec<(f32, i64, usize)> = Vec::new();
        let mut kept = vec![floor.min(n); ns];
        for st in 0..ns {
            let mut sc: Vec<(f32, i64)> = (0..n as i64)
                .map(|p| ((n as i64 - p) as f32 * lb[st], p))
                .collect();
            // guarded: the top `floor` by (score, position) descending
            sc.sort_by(|a, b| b.0.total_cmp(&a.0).then(b.1.cmp(&a.1)));
            for &(v, p) in &sc[floor.min(n)..] {
                cand.push((v, p, st));
            }
        }
        cand.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
        let evict = ns * n - ns * m;
        for c in &cand[evict..] {
            kept[c.2] += 1;
        }
        let st = s.kv.streams().unwrap();
        let have: Vec<usize> = (0..ns).map(|x| st.len(x)).collect();
        assert_eq!(
            have.iter().sum::<usize>(),
            ns * m,
            "floor {floor}: total = L·Hkv·M"
        );
        assert_eq!(have, kept, "floor {floor}: per-stream lengths");
        assert!(have.iter().all(|&k| k >= floor), "floor {floor} respected");
        // lengths really vary: slow-decaying heads keep far more
        let (lo, hi) = (have.iter().min().unwrap(), have.iter().max().unwrap());
        assert!(hi > &(2 * m) && lo < &(m / 2).max(floor + 1), "{have:?}");
        // the memory went back to the pool: the cache holds L·Hkv·M rows
        assert_eq!(s.kv.cells.n_slots(), ns * m);
        // decoding continues within the global budget
        for t in 0..20 {
            s.feed(&toks[t..t + 1], Logits::Last).unwrap();
            let st = s.kv.streams().unwrap();
            let total: usize = (0..ns).map(|x| st.len(x)).sum();
            assert!(total <= ns * m, "decode step {t}: {total} > {}", ns * m);
            assert!((0..ns).all(|x| st.len(x) >= floor.min(st.len(x))));
        }
    }
}

#[test]
fn trimkv_and_dbtrimkv_budgets_hold_while_streaming() {
    let gg = Gguf::open(&util::default_model()).unwrap();
    let w = Weights::from_gguf(&gg).unwrap();
    let c = &w.config;
    let n = 1500;
    let toks = wiki_tokens(&gg, n);
    let g = Arc::new(random_gates(
        GateArch::Rg10,
        c.dim,
        16,
        c.n_layers,
        c.n_kv_heads,
        0.05,
        4.0,
        2,
    ));
    for name in ["trimkv", "dbtrimkv"] {
        let opts = ScorerOptions {
            gates: Some(g.clone()),
            min_per_head: 8,
            trim_lookahead: 1,
            ..Default::default()
        };
        let pol = find(name).unwrap().build(&opts).unwrap().unwrap();
        let m = 128;
        let mut s =
            Session::with_policy(&w, n, 1, 512, KvPolicy::new(pol, evictor(m, 4, 0, 8))).unwrap();
        let ns = c.n_layers * c.n_kv_heads;
        let mut i = 0;
        let pattern = [1usize, 3, 16, 1, 7];
        let mut k = 0;
        let mut varied = false;
        while i < n {
            let step = pattern[k % pattern.len()].min(n - i);
            s.feed(&toks[i..i + step], Logits::Last).unwrap();
            i += step;
            k += 1;
            let st = s.kv.streams().unwrap();
            let lens: Vec<usize> = (0..ns).map(|x| st.len(x)).collect();
            assert!(lens.iter().sum::<usize>() <= ns * m, "{name} at {i}");
            match name {
                "trimkv" => assert!(lens.iter().all(|&l| l <= m), "{name} at {i}: {lens:?}"),
                _ => {
                    if i > 4 * m {
                        assert!(lens.iter().all(|&l| l >= 8), "{name}: floor at {i}");
                    }
                    varied |= lens.iter().max() != lens.iter().min();
                }
            }
            assert!(s.kv.peak_live <= ns * m);
        }
        if name == "dbtrimkv" {
            assert!(varied, "global budget: per-head lengths differ");
            // the one global region is packed again after evictions, so a
            // stream's rows are nearly one run (scattered over the pool,
            // hardly any neighbours would be adjacent rows)
            let st = s.kv.streams().unwrap();
            let (mut adjacent, mut pairs) = (0, 0);
            for x in 0..ns {
                let sl = st.stream_by_slot(x).0;
                pairs += sl.len().saturating_sub(1);
                adjacent += sl.windows(2).filter(|w| w[1] == w[0] + 1).count();
            }
            let frac = adjacent as f64 / pairs as f64;
            eprintln!("dbtrimkv: {adjacent} of {pairs} neighbouring rows adjacent ({frac:.3})");
            assert!(frac > 0.8, "streams stay packed: {frac:.3}");
        }
        assert!(s.n_evicted > 0);
    }
}

#[cfg(feature = "train")]
mod train {
    use super::*;
    use candle_core::{DType, Device, Tensor};
    use kvrun::backend::{Rope, RopeStyle};
    use kvrun::model::{Arch, Config};
    use kvrun::train::model::{Base, Decay, GateVars, Layer, Span};
    use kvrun::train::{
        log_softmax, loss, loss_grads_by_layer, train, EnginePrefix, Objective, TrainConfig,
    };

    fn randn(rng: &mut Rng, shape: &[usize], std: f64) -> Tensor {
        let n: usize = shape.iter().product();
        let v: Vec<f64> = (0..n).map(|_| std * rng.normal() as f64).collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    /// A tiny random llama in f64 (2 layers, GQA 4/2, partial nothing).
    fn tiny_base() -> Base {
        let c = Config {
            arch: Arch::Llama,
            n_layers: 2,
            dim: 16,
            ffn_dim: 24,
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 4,
            vocab: 23,
            n_ctx_train: 64,
            norm_eps: 1e-5,
            rope_base: 10000.0,
            n_rot: 4,
            rope_style: RopeStyle::Normal,
            rope_pos_scale: 1.0,
            tied_output: false,
            features: kvrun::model::Features::plain(4),
        };
        let mut rng = Rng::new(42);
        let r = &mut rng;
        let ones = |n: usize, r: &mut Rng| {
            let v: Vec<f64> = (0..n).map(|_| 1.0 + 0.1 * r.normal() as f64).collect();
            Tensor::from_vec(v, n, &Device::Cpu).unwrap()
        };
        let layers = (0..2)
            .map(|_| Layer {
                attn_norm: ones(16, r),
                wq: randn(r, &[16, 16], 0.4),
                wk: randn(r, &[8, 16], 0.4),
                wv: randn(r, &[8, 16], 0.4),
                bq: None,
                bk: Some(randn(r, &[8], 0.1)),
                bv: None,
                wo: randn(r, &[16, 16], 0.3),
                ffn_norm: ones(16, r),
                w_gate: randn(r, &[24, 16], 0.3),
                w_up: randn(r, &[24, 16], 0.3),
                w_down: randn(r, &[16, 24], 0.3),
            })
            .collect();
        let rope = Rope::new(RopeStyle::Normal, 4, 10000.0, None, 1.0);
        let embd = randn(r, &[23, 16], 1.0);
        let out = randn(r, &[23, 16], 0.5);
        let norm = ones(16, r);
        Base::from_parts(c, &rope, embd, layers, norm, out, 16, DType::F64).unwrap()
    }

    /// The tiny model's teacher on `span`, the objective (M = 3, CE 0.5,
    /// λ = `cap_weight`) and random f64 gates of `arch` (seed `seed`).
    fn gated_problem(
        base: &Base,
        span: &Span<'_>,
        arch: GateArch,
        cap_weight: f64,
        seed: u64,
    ) -> (Tensor, Objective, GateVars) {
        let teacher = log_softmax(&base.forward_span(span, None).unwrap().logits).unwrap();
        let obj = Objective {
            budget: 3,
            ce_weight: 0.5,
            cap_weight,
        };
        let g = random_gates(arch, 16, 6, 2, 2, 0.5, 1.5, seed);
        (teacher, obj, GateVars::from_gates(&g, DType::F64).unwrap())
    }

    /// `toks` whole, and its tokens from `p0` on after the ungated prefix
    /// (computed in chunks of 3 queries): the two kinds of span a step
    /// takes its loss on.
    fn with_spans(base: &Base, toks: &[u32], p0: usize, f: impl Fn(&str, &Span<'_>)) {
        let (pre, _) = base.ungated_prefixes(&toks[..p0], 3).unwrap();
        f("whole", &Span::whole(toks));
        let span = Span {
            tokens: &toks[p0..],
            p0,
            prefixes: &pre,
        };
        f("window", &span);
    }

    #[test]
    fn gate_gradients_match_finite_differences() {
        let base = tiny_base();
        let toks: Vec<u32> = vec![3, 17, 5, 5, 22, 0, 9, 14, 2, 11];
        with_spans(&base, &toks, 6, |kind, span| {
            for (arch, decay) in [
                (GateArch::Rg10, Decay::Logit),
                (GateArch::Rg, Decay::Logit),
                (GateArch::Rg10, Decay::Weight),
            ] {
                let (teacher, obj, mut vars) = gated_problem(&base, span, arch, 1.0, 3);
                vars.decay = decay;
                let (l, terms) = loss(&base, &vars, span, &teacher, &obj).unwrap();
                assert!(terms.kl > 0.0 && terms.cap > 0.0, "{kind}: {terms:?}");
                let grads = l.backward().unwrap();
                let all = vars.all();
                for (vi, var) in all.iter().enumerate() {
                    let gt = grads
                        .get(var.as_tensor())
                        .expect("every gate tensor has a gradient");
                    let gv: Vec<f64> = gt.flatten_all().unwrap().to_vec1().unwrap();
                    let base_v: Vec<f64> =
                        var.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
                    // a few entries of every tensor
                    for &j in &[0usize, base_v.len() / 2, base_v.len() - 1] {
                        let h = 1e-6;
                        let at = |d: f64| {
                            let mut v = base_v.clone();
                            v[j] += d;
                            var.set(
                                &Tensor::from_vec(v, var.as_tensor().dims(), &Device::Cpu).unwrap(),
                            )
                            .unwrap();
                            let (l, _) = loss(&base, &vars, span, &teacher, &obj).unwrap();
                            l.to_scalar::<f64>().unwrap()
                        };
                        let fd = (at(h) - at(-h)) / (2.0 * h);
                        at(0.0);
                        let err = (fd - gv[j]).abs();
                        assert!(
                        err <= 1e-6 + 1e-4 * fd.abs().max(gv[j].abs()),
                        "{kind} {arch:?} {decay:?} tensor {vi} entry {j}: backprop {} vs finite difference {fd}",
                        gv[j]
                    );
                    }
                }
            }
        });
    }

    /// Gradient checkpointing changes where the gradients are computed, not
    /// what they are: layer by layer, every gate tensor's gradient and every
    /// loss term equal the whole graph's (f64, both gate architectures, CE
    /// and the capacity hinge active).
    #[test]
    fn layer_by_layer_gradients_equal_the_whole_graph() {
        let base = tiny_base();
        let toks: Vec<u32> = vec![3, 17, 5, 5, 22, 0, 9, 14, 2, 11, 8, 1];
        with_spans(&base, &toks, 7, |kind, span| {
            for (arch, decay) in [
                (GateArch::Rg10, Decay::Logit),
                (GateArch::Rg, Decay::Logit),
                (GateArch::Rg, Decay::Weight),
            ] {
                let (teacher, obj, mut vars) = gated_problem(&base, span, arch, 1.7, 5);
                vars.decay = decay;
                let (l, whole) = loss(&base, &vars, span, &teacher, &obj).unwrap();
                assert!(
                    whole.kl > 0.0 && whole.ce > 0.0 && whole.cap > 0.0,
                    "{kind}: {whole:?}"
                );
                let grads = l.backward().unwrap();
                let (terms, by_layer) =
                    loss_grads_by_layer(&base, &vars, span, &teacher, &obj).unwrap();
                for (a, b) in [
                    (whole.total, terms.total),
                    (whole.kl, terms.kl),
                    (whole.ce, terms.ce),
                    (whole.cap, terms.cap),
                    (whole.occupancy, terms.occupancy),
                ] {
                    assert!(
                        (a - b).abs() <= 1e-12 * (1.0 + a.abs()),
                        "{arch:?}: {whole:?} vs {terms:?}"
                    );
                }
                let all = vars.all();
                assert_eq!(by_layer.len(), all.len());
                for (vi, (var, gl)) in all.iter().zip(&by_layer).enumerate() {
                    let gw: Vec<f64> = grads
                        .get(var.as_tensor())
                        .unwrap()
                        .flatten_all()
                        .unwrap()
                        .to_vec1()
                        .unwrap();
                    let gl: Vec<f64> = gl
                        .as_ref()
                        .expect("every gate tensor has a gradient")
                        .flatten_all()
                        .unwrap()
                        .to_vec1()
                        .unwrap();
                    let scale = gw.iter().fold(0f64, |m, x| m.max(x.abs()));
                    assert!(scale > 0.0, "{arch:?} tensor {vi}: zero gradient");
                    for (j, (a, b)) in gw.iter().zip(&gl).enumerate() {
                        assert!(
                        (a - b).abs() <= 1e-10 * scale,
                        "{kind} {arch:?} {decay:?} tensor {vi} entry {j}: whole graph {a} vs layer by layer {b}"
                    );
                    }
                }
            }
        });
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
        (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap()
            .to_scalar::<f64>()
            .unwrap()
    }

    /// A windowed span is the whole sequence seen from its last tokens: the
    /// ungated pass in chunks of any size is the whole forward pass, the
    /// span's ungated logits are the whole pass's last rows, and gates at
    /// β → 1 change nothing (the teacher is still the gated model's limit).
    #[test]
    fn a_windowed_span_sees_the_whole_sequence() {
        let base = tiny_base();
        let toks: Vec<u32> = vec![3, 17, 5, 5, 22, 0, 9, 14, 2, 11, 8, 1];
        let whole = base.forward(&toks, None).unwrap().logits;
        for chunk in [1, 5, 12] {
            let (pre, top) = base.ungated_prefixes(&toks, chunk).unwrap();
            assert_eq!(pre.len(), 2);
            let d = max_diff(&base.logits(&top).unwrap(), &whole);
            assert!(d < 1e-10, "chunks of {chunk}: {d}");
        }
        let p0 = 7;
        let (pre, _) = base.ungated_prefixes(&toks[..p0], 4).unwrap();
        let span = Span {
            tokens: &toks[p0..],
            p0,
            prefixes: &pre,
        };
        let teacher = base.forward_span(&span, None).unwrap().logits;
        let d = max_diff(&teacher, &whole.narrow(0, p0, toks.len() - p0).unwrap());
        assert!(d < 1e-10, "span vs whole: {d}");
        let g = Gates::init(GateArch::Rg10, 16, 6, 2, 2, 30.0, 1);
        let mut vars = GateVars::from_gates(&g, DType::F64).unwrap();
        for decay in [Decay::Logit, Decay::Weight] {
            vars.decay = decay;
            let f = base.forward_span(&span, Some(&vars)).unwrap();
            // log β of all 12 keys, per layer
            assert_eq!(f.log_beta[0].dims(), &[12, 2]);
            let d = max_diff(&f.logits, &teacher);
            assert!(d < 1e-9, "{decay:?}: β → 1 vs ungated: {d}");
        }
        // the two decays differ where β is not 1
        let g = Gates::init(GateArch::Rg10, 16, 6, 2, 2, 0.0, 1);
        let mut vars = GateVars::from_gates(&g, DType::F64).unwrap();
        let logit = base.forward_span(&span, Some(&vars)).unwrap().logits;
        vars.decay = Decay::Weight;
        let weight = base.forward_span(&span, Some(&vars)).unwrap().logits;
        assert!(max_diff(&logit, &weight) > 1e-3);
        // and a prefix of the wrong length is an error, not a silent mix
        let short = Span {
            tokens: &toks[p0..],
            p0: p0 + 1,
            prefixes: &pre,
        };
        assert!(base.forward_span(&short, None).is_err());
    }

    /// kvrun's engine computes the prefix the training model would (its
    /// 8-bit activation products against the training model's f32): the
    /// gate inputs, keys and values of every layer, and the teacher over
    /// either prefix.
    #[test]
    fn the_engine_prefix_matches_the_training_model() {
        let gg = Gguf::open(&util::default_model()).unwrap();
        let w = Weights::from_gguf(&gg).unwrap();
        let toks = wiki_tokens(&gg, 64);
        let base = Base::from_weights(&w, 64, DType::F32).unwrap();
        let p0 = 48;
        let (ours, _) = base.ungated_prefixes(&toks[..p0], 16).unwrap();
        let mut e = EnginePrefix::new(&w, p0, 2);
        let eng = e.prefixes(&base, &toks[..p0]).unwrap();
        assert_eq!(eng.len(), w.config.n_layers);
        // worst over layers and tensors: largest |Δ| over the largest |x|,
        // and ‖Δ‖ over ‖x‖
        let (mut worst, mut worst_l2) = (0f64, 0f64);
        let norm = |t: &Tensor| -> f64 {
            t.sqr()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_dtype(DType::F64)
                .unwrap()
                .to_scalar::<f64>()
                .unwrap()
                .sqrt()
        };
        for (a, b) in ours.iter().zip(&eng) {
            for (x, y) in [(&a.h, &b.h), (&a.k, &b.k), (&a.v, &b.v)] {
                assert_eq!(x.dims(), y.dims());
                let range = max_diff(x, &x.zeros_like().unwrap());
                worst = worst.max(max_diff(x, y) / range);
                worst_l2 = worst_l2.max(norm(&(x - y).unwrap()) / norm(x));
            }
        }
        let span = |pre| Span {
            tokens: &toks[p0..],
            p0,
            prefixes: pre,
        };
        let t1 = base.forward_span(&span(&ours), None).unwrap().logits;
        let t2 = base.forward_span(&span(&eng), None).unwrap().logits;
        let (a1, a2): (Vec<u32>, Vec<u32>) = (
            t1.argmax(1).unwrap().to_vec1().unwrap(),
            t2.argmax(1).unwrap().to_vec1().unwrap(),
        );
        let agree = a1.iter().zip(&a2).filter(|(x, y)| x == y).count();
        eprintln!(
            "worst |Δ|/max {worst:.4}, ‖Δ‖/‖x‖ {worst_l2:.4}, teacher argmax agrees {agree}/16"
        );
        assert!(worst < 0.1 && worst_l2 < 0.05, "{worst} {worst_l2}");
        assert!(agree >= 14, "{agree}/16");
    }

    #[test]
    fn the_training_model_matches_kvrun_logits() {
        let gg = Gguf::open(&util::default_model()).unwrap();
        let w = Weights::from_gguf(&gg).unwrap();
        let toks = wiki_tokens(&gg, 48);
        let base = Base::from_weights(&w, 64, DType::F32).unwrap();
        let f = base.forward(&toks, None).unwrap();
        let ours: Vec<Vec<f32>> = f.logits.to_vec2().unwrap();
        let mut s = Session::new(&w, 64, 2, 64);
        let kv: Vec<f32> = s.feed(&toks, Logits::All).unwrap().to_vec();
        let v = w.config.vocab;
        let (mut agree, mut worst) = (0, 0f32);
        for (t, row) in ours.iter().enumerate() {
            let k = &kv[t * v..(t + 1) * v];
            let am = |x: &[f32]| kvrun::sample::argmax(x);
            agree += (am(row) == am(k)) as usize;
            let range = k.iter().cloned().fold(f32::MIN, f32::max)
                - k.iter().cloned().fold(f32::MAX, f32::min);
            let d = row
                .iter()
                .zip(k)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max)
                / range;
            worst = worst.max(d);
        }
        // kvrun quantizes activations to 8 bits for the Q4_1 products; the
        // training model multiplies in f32: close, not bit-equal
        eprintln!("argmax agree {agree}/48, worst |Δ|/range {worst:.4}");
        assert!(agree >= 44, "argmax agrees at {agree}/48");
        assert!(worst < 0.05, "worst relative logit difference {worst}");
        // gates at β → 1 change nothing: the teacher is the gated model's limit
        let g = Gates::init(
            GateArch::Rg10,
            w.config.dim,
            8,
            w.config.n_layers,
            w.config.n_kv_heads,
            30.0,
            1,
        );
        let vars = GateVars::from_gates(&g, DType::F32).unwrap();
        let fg = base.forward(&toks, Some(&vars)).unwrap();
        let d = (fg.logits - f.logits)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(d < 1e-3, "{d}");
    }

    #[test]
    fn a_short_training_run_lowers_the_loss_and_resumes() {
        let gg = Gguf::open(&util::default_model()).unwrap();
        let w = Weights::from_gguf(&gg).unwrap();
        let stream = wiki_tokens(&gg, 32 * 8);
        let base = Base::from_weights(&w, 64, DType::F32).unwrap();
        let dir = std::env::temp_dir().join(format!("kvrun-train-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let out = dir.join("t.gates.safetensors");
        let mut cfg = TrainConfig {
            arch: GateArch::Rg10,
            inter: 16,
            bias_init: 4.0,
            objective: Objective {
                budget: 6,
                ce_weight: 0.0,
                cap_weight: 1.0,
            },
            seq_len: 32,
            loss_window: 0,
            decay: Decay::Logit,
            steps: 6,
            lr: 5e-2,
            warmup: 1,
            weight_decay: 0.0,
            seed: 1,
            save_every: 3,
            out: out.clone(),
            resume: false,
            init: None,
            model_name: "smollm2".into(),
            data_desc: vec!["wikitext".into()],
            progress: false,
        };
        let (g, h) = train(&base, &stream, &cfg, None).unwrap();
        assert_eq!(h.len(), 6);
        let first = h[0].total;
        let last = h[5].total;
        eprintln!("losses {:?}", h.iter().map(|l| l.total).collect::<Vec<_>>());
        assert!(last < first, "loss {first} → {last}");
        assert!(h[5].occupancy < h[0].occupancy);
        // the checkpoint is the result, with its record
        let saved = Gates::load(&out).unwrap();
        assert_eq!(saved.hidden, g.hidden);
        assert_eq!(saved.meta["steps"], 6);
        assert_eq!(saved.meta["model"], "smollm2");
        // resume: two more steps continue the same history
        cfg.steps = 8;
        cfg.resume = true;
        let (_, h2) = train(&base, &stream, &cfg, None).unwrap();
        assert_eq!(h2.len(), 8);
        assert!(h2[7].total < first, "{} vs {first}", h2[7].total);
        for (a, b) in h.iter().zip(&h2) {
            assert!((a.total - b.total).abs() < 1e-9);
        }
        assert!(dir.join("t.gates.log.csv").is_file() && dir.join("t.gates.curve.svg").is_file());
        assert!(dir.join("t.gates.opt.safetensors").is_file());
        // a second stage from those gates: a fresh history and optimizer,
        // starting where the first stage ended, recorded in the metadata
        let stage2 = dir.join("t2.gates.safetensors");
        let cfg2 = TrainConfig {
            steps: 2,
            resume: false,
            init: Some(out.clone()),
            out: stage2.clone(),
            objective: Objective {
                budget: 3,
                ..cfg.objective
            },
            ..cfg.clone()
        };
        let (g2, h3) = train(&base, &stream, &cfg2, None).unwrap();
        assert_eq!(h3.len(), 2);
        assert!(
            h3[0].occupancy < h[0].occupancy,
            "{} vs {}",
            h3[0].occupancy,
            h[0].occupancy
        );
        assert_eq!(g2.meta["budget"], 3);
        assert_eq!(g2.meta["init"]["file"], "t.gates.safetensors");
        assert_eq!(g2.meta["init"]["meta"]["steps"], 8);
        assert_eq!(
            Gates::load(&stage2).unwrap().meta["init"]["meta"]["budget"],
            6
        );
        // the loss on the last 16 of 64 tokens, the 48 before them from
        // kvrun's engine: it learns too (the capacity hinge now at ages up
        // to 64), and the file records the window
        let windowed = dir.join("w.gates.safetensors");
        let cfg3 = TrainConfig {
            seq_len: 64,
            loss_window: 16,
            decay: Decay::Weight,
            steps: 4,
            resume: false,
            out: windowed.clone(),
            ..cfg.clone()
        };
        let mut e = EnginePrefix::new(&w, 48, 2);
        let (g3, h4) = train(&base, &stream, &cfg3, Some(&mut e)).unwrap();
        eprintln!(
            "windowed losses {:?}",
            h4.iter()
                .map(|l| (l.total, l.occupancy))
                .collect::<Vec<_>>()
        );
        assert_eq!(h4.len(), 4);
        assert!(
            h4[3].total < h4[0].total,
            "{} → {}",
            h4[0].total,
            h4[3].total
        );
        assert!(h4[3].occupancy < h4[0].occupancy);
        assert_eq!(g3.meta["loss_window"], 16);
        assert_eq!(g3.meta["decay"], "weight");
        std::fs::remove_dir_all(&dir).ok();
    }
}

/// The gates shipped next to the default model load, describe their
/// training run, and drive both policies from the command line (found
/// without `--gates`), the budget held.
#[test]
fn shipped_gates_run_from_the_cli() {
    let model = util::default_model();
    let path = kvrun::policy::gates::gates_path_for(&model);
    let g = Gates::load(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let gg = Gguf::open(&model).unwrap();
    let w = Weights::from_gguf(&gg).unwrap();
    g.check_model(w.config.n_layers, w.config.dim, w.config.n_kv_heads)
        .unwrap();
    assert_eq!(g.arch, GateArch::Rg10);
    for k in ["budget", "steps", "seq_len", "data", "final"] {
        assert!(!g.meta[k].is_null(), "metadata lacks {k}: {}", g.meta);
    }
    assert!(g.meta["final"]["kl"].as_f64().unwrap() > 0.0);
    for policy in ["trimkv", "dbtrimkv"] {
        let out = std::process::Command::new(util::kvrun_bin())
            .args(["-m"])
            .arg(&model)
            .args([
                "-p",
                "The history of Rome is long and",
                "-n",
                "24",
                "-t",
                "1",
            ])
            .args(["--temp", "0", "--policy", policy, "--kv-budget", "16"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{policy}: {err}");
        assert!(
            err.contains(&format!("policy={policy}")) && err.contains("peak=16"),
            "{policy}: {err}"
        );
    }
}

/// Regression: the trainer's plain-block check compared the whole feature
/// set, so a llama file's context length (kept for LongRoPE) made it refuse
/// every llama model. A llama file is accepted; a gemma3 block is refused.
#[test]
fn train_gates_accepts_llama_files_and_refuses_other_blocks() {
    use kvrun::format::synth::{self, Mix, Recipe, Spec};
    use kvrun::train::model::Base;
    let gg = Gguf::open(&util::default_model()).unwrap();
    let w = Weights::from_gguf(&gg).unwrap();
    assert!(
        w.config.features.n_ctx_orig > 0,
        "the file names its context"
    );
    assert!(w.config.features.is_plain(w.config.head_dim));
    Base::from_weights(&w, 16, candle_core::DType::F32).unwrap();

    let f = util::TempFile::new("train-gemma3.gguf");
    let recipe = Recipe {
        shape: synth::shape("tiny"),
        mix: Some(Mix::Q8_0),
        arch: Some("gemma3"),
    };
    let header = util::shared("r1-distill-qwen-7b.header.gguf");
    synth::write_file(&header, &recipe, &f.0, &Spec::default()).unwrap();
    let g = Gguf::open(&f.0).unwrap();
    let w = Weights::from_gguf(&g).unwrap();
    let e = Base::from_weights(&w, 16, candle_core::DType::F32)
        .err()
        .expect("gemma3 refused");
    assert!(e.to_string().contains("gemma3"), "{e}");
}
