//! `--cache-type f32|f16|q8_0` on the real model (SmolLM2-135M): memory per
//! token follows the type, an f32 cache gives the f16 cache's logits up to
//! f16 rounding, and a q8_0 cache mostly keeps the greedy continuation.

use crate::util;

use kvrun::format::gguf::Gguf;
use kvrun::generate::Session;
use kvrun::kv::KvType;
use kvrun::model::llama::Logits;
use kvrun::model::Weights;
use kvrun::tokenizer::Tokenizer;

const THREADS: usize = 1;

fn wiki_tokens(g: &Gguf, n: usize) -> Vec<u32> {
    let tok = Tokenizer::from_gguf(g).unwrap();
    let ids = tok.encode(&util::wikitext(n * 8), false, false).unwrap();
    ids[..n].to_vec()
}

fn argmax(x: &[f32]) -> u32 {
    let mut b = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[b] {
            b = i;
        }
    }
    b as u32
}

fn session<'w>(w: &'w Weights<'w>, n: usize, ty: KvType) -> Session<'w> {
    let mut s = Session::new(w, n, THREADS, 64);
    s.set_cache_type(ty).unwrap();
    assert_eq!(s.kv.ty, ty);
    s
}

#[test]
fn memory_per_token_follows_the_type() {
    let g = Gguf::open(&util::default_model()).unwrap();
    let w = Weights::from_gguf(&g).unwrap();
    let (l, d) = (w.config.n_layers, w.config.kv_dim());
    for (ty, num, den) in [
        (KvType::F32, 4, 1),
        (KvType::F16, 2, 1),
        (KvType::Q8_0, 34, 32),
    ] {
        let s = session(&w, 128, ty);
        assert_eq!(s.kv.bytes_per_token(), 2 * l * d * num / den, "{ty}");
        assert_eq!(s.kv.bytes_allocated(), 128 * s.kv.bytes_per_token());
        eprintln!(
            "{ty}: {} bytes per token (L {l}, kv_dim {d})",
            s.kv.bytes_per_token()
        );
    }
    // changing the type once tokens are cached is refused
    let mut s = session(&w, 64, KvType::F16);
    s.feed(&[1, 2, 3], Logits::Last).unwrap();
    let e = s.set_cache_type(KvType::Q8_0).unwrap_err().to_string();
    assert!(e.contains("--cache-type"), "{e}");
}

#[test]
fn f32_cache_logits_match_f16_cache() {
    let g = Gguf::open(&util::default_model()).unwrap();
    let w = Weights::from_gguf(&g).unwrap();
    let toks = wiki_tokens(&g, 160);
    // 128-token prefill in two chunks, then 32 single-token decode steps
    let run = |ty| {
        let mut s = session(&w, 160, ty);
        let mut out = s.feed(&toks[..128], Logits::All).unwrap().to_vec();
        for &t in &toks[128..] {
            out.extend_from_slice(s.feed(&[t], Logits::Last).unwrap());
        }
        out
    };
    let (a, b) = (run(KvType::F32), run(KvType::F16));
    let vocab = w.config.vocab;
    let (mut max_d, mut sum_d, mut same) = (0f32, 0f32, 0);
    for (ra, rb) in a.chunks(vocab).zip(b.chunks(vocab)) {
        let spread = ra.iter().cloned().fold(f32::MIN, f32::max)
            - ra.iter().cloned().fold(f32::MAX, f32::min);
        let d = ra
            .iter()
            .zip(rb)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        max_d = max_d.max(d / spread);
        sum_d += d / spread;
        same += usize::from(argmax(ra) == argmax(rb));
    }
    let rows = a.len() / vocab;
    let mean_d = sum_d / rows as f32;
    eprintln!("f32 vs f16 cache: |Δlogit| / logit range max {max_d:.2e} mean {mean_d:.2e}, top-1 same {same}/{rows}");
    // Measured: max 7.7e-2, 154/160 same top-1. The f32 kernel path itself
    // is exact (storing f16-rounded values in the f32 cache reproduced the
    // f16 logits bit for bit, checked while writing this test); the spread
    // is f16 rounding of K/V amplified through 30 layers, which this model
    // family is known to do.
    assert!(
        max_d < 0.15,
        "f32 and f16 cache logits differ by {max_d} of the range"
    );
    assert!(mean_d < 0.03, "mean difference {mean_d} of the range");
    assert!(same * 100 >= rows * 93, "top-1 agreement {same}/{rows}");
}

#[test]
fn q8_0_cache_mostly_keeps_the_greedy_continuation() {
    let g = Gguf::open(&util::default_model()).unwrap();
    let w = Weights::from_gguf(&g).unwrap();
    let toks = wiki_tokens(&g, 96);
    let n_gen = 64;
    let greedy = |ty| {
        let mut s = session(&w, 96 + n_gen + 1, ty);
        let mut next = argmax(s.feed(&toks, Logits::Last).unwrap());
        let mut out = vec![next];
        for _ in 1..n_gen {
            next = argmax(s.feed(&[next], Logits::Last).unwrap());
            out.push(next);
        }
        out
    };
    let (a, b) = (greedy(KvType::F16), greedy(KvType::Q8_0));
    let prefix = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
    // teacher-forced: the q8_0 cache fed the f16 continuation, top-1 per step
    let mut s = session(&w, 96 + n_gen + 1, KvType::Q8_0);
    let mut agree = usize::from(argmax(s.feed(&toks, Logits::Last).unwrap()) == a[0]);
    for i in 1..n_gen {
        agree += usize::from(argmax(s.feed(&[a[i - 1]], Logits::Last).unwrap()) == a[i]);
    }
    eprintln!(
        "q8_0 vs f16 cache, {n_gen} greedy tokens: common prefix {prefix}, teacher-forced top-1 agreement {agree}/{n_gen}"
    );
    assert!(
        agree * 100 >= n_gen * 85,
        "q8_0 top-1 agreement {agree}/{n_gen}"
    );
    assert!(prefix >= 8, "q8_0 diverged after {prefix} tokens");
}
