//! Every eviction policy on every architecture kvrun added after llama and
//! qwen2 (synthetic tiny models written by `kvrun synth --arch`): the
//! resident entries never exceed the budget, and gemma3's sliding-window
//! layers keep exactly their window beside the budgeted global layers.

use crate::util;

use kvrun::format::gguf::Gguf;
use kvrun::format::synth::{self, Mix, Recipe, Spec};
use kvrun::generate::{KvPolicy, Session};
use kvrun::model::llama::Logits;
use kvrun::model::Weights;
use kvrun::policy::gates::{GateArch, Gates};
use kvrun::policy::headkv::HeadScores;
use kvrun::policy::table::ScorerOptions;
use kvrun::policy::{find, names, Evictor};
use std::sync::Arc;

fn every_policy_within_budget(arch: &'static str, shape: &str) {
    let f = util::TempFile::new(&format!("pol-{arch}.gguf"));
    let recipe = Recipe {
        shape: synth::shape(shape),
        mix: Some(Mix::Q8_0),
        arch: Some(arch),
    };
    let header = util::shared("r1-distill-qwen-7b.header.gguf");
    synth::write_file(&header, &recipe, &f.0, &Spec::default()).unwrap();
    let g = Gguf::open(&f.0).unwrap();
    let w = Weights::from_gguf(&g).unwrap();
    let c = &w.config;
    let (nl, nkv) = (c.n_cache_layers(), c.n_kv_heads);
    let budget = 48;
    let toks: Vec<u32> = (0..220u32).map(|i| 1000 + (i * 7919) % 20000).collect();
    let mut ran = 0;
    for name in names() {
        if name == "full" {
            continue;
        }
        let opts = ScorerOptions {
            seed: 1,
            gates: Some(Arc::new(Gates::init(
                GateArch::Rg10,
                c.dim,
                8,
                nl,
                nkv,
                10.0,
                1,
            ))),
            head_scores: Some(Arc::new(HeadScores {
                n_layers: nl,
                n_kv_heads: nkv,
                scores: vec![1.0; nl * nkv],
                procedure: String::new(),
            })),
            ..Default::default()
        };
        let p = find(name).unwrap().build(&opts).unwrap().expect("a scorer");
        let e = Evictor {
            budget,
            n_sink: 4,
            n_recent: 8,
            keep_prompt_until: 0,
            evict_every: 4,
        };
        let mut s = Session::with_policy(&w, 256, 1, 64, KvPolicy::new(p, e))
            .unwrap_or_else(|e| panic!("{arch} {name}: {e}"));
        s.feed(&toks[..60], Logits::Last)
            .unwrap_or_else(|e| panic!("{arch} {name}: prompt: {e}"));
        let mut i = 60;
        for n in [1usize, 1, 5, 1, 16, 1, 3].iter().cycle() {
            if i >= toks.len() {
                break;
            }
            let n = (*n).min(toks.len() - i);
            let out = s
                .feed(&toks[i..i + n], Logits::Last)
                .unwrap_or_else(|e| panic!("{arch} {name}: feed at {i}: {e}"));
            assert!(out.iter().all(|x| x.is_finite()), "{arch} {name}: logits");
            i += n;
            assert!(
                s.kv.peak_entries <= budget * nl * nkv,
                "{arch} {name}: {} entries resident at the peak > budget {budget} × {} streams",
                s.kv.peak_entries,
                nl * nkv
            );
            if let Some(swa) = &c.features.swa {
                assert!(s.state.local_resident() <= swa.window - 1 + n);
            }
        }
        assert!(
            s.n_evicted > 0 || s.evicted_entries() > 0,
            "{arch} {name}: nothing evicted"
        );
        ran += 1;
    }
    eprintln!("{arch}: {ran} policies held budget {budget}");
    assert!(ran >= 20);
}

#[test]
fn every_policy_within_budget_qwen3() {
    every_policy_within_budget("qwen3", "tiny");
}

#[test]
fn every_policy_within_budget_qwen3moe() {
    every_policy_within_budget("qwen3moe", "tiny-moe");
}

#[test]
fn every_policy_within_budget_gemma3() {
    every_policy_within_budget("gemma3", "tiny");
}

#[test]
fn every_policy_within_budget_phi3() {
    every_policy_within_budget("phi3", "tiny");
}
