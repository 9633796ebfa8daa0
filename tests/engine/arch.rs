//! Architectures beyond llama/qwen2 against llama.cpp's own library:
//! Gemma 3 270M (real weights: q/k norms, post-norms, GeGLU, √dim
//! embedding scale, five sliding-window layers in every six with their own
//! RoPE base and a window cache of their own).
//!
//! Criteria as for the default model (tests/engine/parity.rs): every
//! checked position within twice the spread llama.cpp shows between its own
//! batched prefill and its token-by-token decode (or 1e-2), the same argmax
//! wherever llama.cpp's top-2 margin exceeds 0.1; greedy continuations.

#![cfg(feature = "oracle")]

use crate::util;
use crate::util::{rel_err, top2_margin};

use kvrun::format::gguf::Gguf;
use kvrun::generate::Session;
use kvrun::model::llama::Logits;
use kvrun::model::Weights;
use kvrun::sample::argmax;
use std::path::Path;
use std::sync::{Mutex, MutexGuard};

/// One of these tests at a time: each runs kvrun's and llama.cpp's
/// spinning thread pools (2 threads each), and two of them side by side on
/// a 2-core machine starve each other's pools (measured: the two Gemma
/// tests took over 15 minutes together, about a minute one after the other).
fn one_at_a_time() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// Logit rows of `ids` at the positions `keep` selects, three ways:
/// kvrun (prefill in chunks of `chunk`), llama.cpp batched, llama.cpp one
/// token at a time. Returns (kvrun, batch, sequential), row-major.
pub fn three_ways(
    path: &Path,
    ids: &[i32],
    chunk: usize,
    keep: &dyn Fn(usize) -> bool,
) -> (Vec<Vec<f32>>, Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let g = Gguf::open(path).unwrap();
    let w = Weights::from_gguf(&g).unwrap();
    let vocab = w.config.vocab;
    let lm = ggml_sys::LlamaModel::load_plain(path.to_str().unwrap()).unwrap();
    let n_ctx = (ids.len() + 16).next_power_of_two();
    let rows = |v: &[f32], p0: usize, out: &mut Vec<Vec<f32>>| {
        for (i, r) in v.chunks_exact(vocab).enumerate() {
            if keep(p0 + i) {
                out.push(r.to_vec());
            }
        }
    };
    let mut seq = Vec::new();
    {
        let mut ctx = ggml_sys::LlamaContext::new(&lm, n_ctx as u32, 2).unwrap();
        for (i, &t) in ids.iter().enumerate() {
            let l = ctx.decode(&[t], i as i32, true).unwrap();
            rows(&l, i, &mut seq);
        }
    }
    let mut batch = Vec::new();
    {
        let mut ctx = ggml_sys::LlamaContext::new(&lm, n_ctx as u32, 2).unwrap();
        let l = ctx.decode(ids, 0, true).unwrap();
        rows(&l, 0, &mut batch);
    }
    let mut ours = Vec::new();
    let mut sess = Session::new(&w, n_ctx, 2, chunk);
    let toks: Vec<u32> = ids.iter().map(|&t| t as u32).collect();
    for (c, part) in toks.chunks(chunk).enumerate() {
        let l = sess.feed(part, Logits::All).unwrap().to_vec();
        rows(&l, c * chunk, &mut ours);
    }
    (ours, batch, seq)
}

/// The parity criteria over rows from `three_ways`; `first_exact` asks
/// position 0 (no attention mixing) within 1e-3. Returns how many rows
/// had a decisive argmax.
pub fn assert_parity(
    label: &str,
    ours: &[Vec<f32>],
    batch: &[Vec<f32>],
    seq: &[Vec<f32>],
    first_exact: bool,
) -> usize {
    assert_eq!(ours.len(), seq.len());
    let (mut worst, mut worst_self, mut sum, mut sum_self) = (0f32, 0f32, 0f32, 0f32);
    let (mut strong, mut agree, mut agree_self) = (0, 0, 0);
    for (p, ((a, b), c)) in ours.iter().zip(seq).zip(batch).enumerate() {
        let (e, e_self) = (rel_err(a, b), rel_err(c, b));
        if p == 0 && first_exact {
            assert!(e <= 1e-3, "{label}: first row differs by {e:.3e}");
        }
        worst = worst.max(e);
        worst_self = worst_self.max(e_self);
        sum += e;
        sum_self += e_self;
        if top2_margin(b) > 0.1 {
            strong += 1;
            agree += (argmax(a) == argmax(b)) as usize;
            agree_self += (argmax(c) == argmax(b)) as usize;
        }
    }
    let n = ours.len() as f32;
    eprintln!(
        "{label}: kvrun vs llama.cpp worst {worst:.4} mean {:.4}; llama.cpp batch vs decode worst {worst_self:.4} mean {:.4}; argmax {agree}/{strong} where margin > 0.1 (llama.cpp batch: {agree_self})",
        sum / n,
        sum_self / n
    );
    assert!(
        worst <= (2.0 * worst_self).max(1e-2),
        "{label}: worst error {worst} beyond twice llama.cpp's own spread {worst_self}"
    );
    assert!(
        sum / n <= (1.5 * sum_self / n).max(1e-2),
        "{label}: mean error {} beyond llama.cpp's own spread {}",
        sum / n,
        sum_self / n
    );
    // 95%, or within one row of how often llama.cpp's own batch path
    // agrees with its decoding (on Gemma 3 their logits differ by as much
    // as ours do: 4% mean relative error, so near-ties flip either way;
    // regression: the K-quant lanes arithmetic gave 80/83 where llama.cpp's
    // batch gave 81/83, at the same mean error). 95% since an Intel AVX-512
    // + AMX VM, where llama.cpp's decoding (the reference) comes out of
    // other ggml kernels: Gemma 3 positions 512..600 agreed 79/82 (96.3%)
    // at a mean error of 0.0407 against llama.cpp's own batch-vs-decode
    // 0.0392, identically at kvrun's avx512vnni and amx levels.
    assert!(
        agree * 100 >= strong * 95 || agree + 1 >= agree_self,
        "{label}: argmax agreement {agree}/{strong} below 95% and below llama.cpp batch's {agree_self} - 1"
    );
    strong
}

/// Gemma 3 270M: every position of a 128-token prompt (the default
/// model's criteria), and positions 512..600 of a 600-token prompt, where
/// the sliding-window layers no longer see the start (chunks of 48 cross
/// the window's edge mid-chunk).
#[test]
fn gemma3_logits_match_llama_cpp() {
    let _one = one_at_a_time();
    let path = util::gemma_model();
    let lm = ggml_sys::LlamaModel::load_plain(path.to_str().unwrap()).unwrap();
    let text = util::wikitext(20000);
    let ids = lm.tokenize(&text, true, false);
    drop(lm);
    let (ours, batch, seq) = three_ways(&path, &ids[..128], 48, &|_| true);
    let strong = assert_parity("gemma3 128", &ours, &batch, &seq, true);
    assert!(strong > 64, "too few decisive positions");
    let (ours, batch, seq) = three_ways(&path, &ids[..600], 48, &|p| p >= 512);
    assert_eq!(ours.len(), 88);
    assert_parity("gemma3 512..600", &ours, &batch, &seq, false);
}

/// Gemma 3 270M: greedy 64-token continuations of 5 prompts: every fork
/// from llama.cpp's path at a close call (top-2 margin < 1 logit), and,
/// teacher-forced along llama.cpp's path, its token at ≥ 95% of the steps
/// and at every step that is not a close call. How many of the 5 paths stay
/// identical is printed beside how many llama.cpp keeps against itself (its
/// batched vs its token-by-token prefill): near-ties come every few dozen
/// tokens on this model, and two summation orders fork at them.
#[test]
fn gemma3_greedy_64_tokens() {
    let _one = one_at_a_time();
    let path = util::gemma_model();
    let g = Gguf::open(&path).unwrap();
    let w = Weights::from_gguf(&g).unwrap();
    let lm = ggml_sys::LlamaModel::load_plain(path.to_str().unwrap()).unwrap();
    let prompts = [
        "The capital of France is",
        "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
        "<start_of_turn>user\nWhat is 17 * 23? Think step by step.<end_of_turn>\n<start_of_turn>model\n",
        "Once upon a time, in a small village by the sea,",
        "The mitochondria is the powerhouse of the cell. In this essay I will explain",
    ];
    let n_gen = 64;
    let greedy = |ids: &[i32], sequential: bool| {
        let mut ctx = ggml_sys::LlamaContext::new(&lm, 256, 2).unwrap();
        let mut l = if sequential {
            let mut l = Vec::new();
            for (i, &t) in ids.iter().enumerate() {
                l = ctx.decode(&[t], i as i32, false).unwrap();
            }
            l
        } else {
            ctx.decode(ids, 0, false).unwrap()
        };
        let (mut toks, mut margins) = (Vec::new(), Vec::new());
        for i in 0..n_gen {
            let t = argmax(&l) as i32;
            margins.push(top2_margin(&l));
            toks.push(t);
            l = ctx.decode(&[t], (ids.len() + i) as i32, false).unwrap();
        }
        (toks, margins)
    };
    let (mut identical, mut identical_self, mut forced, mut forced_ok) = (0, 0, 0, 0);
    for p in prompts {
        let ids = lm.tokenize(p, true, true);
        let (theirs, margins) = greedy(&ids, false);
        identical_self += (greedy(&ids, true).0 == theirs) as usize;
        // teacher-forced along llama.cpp's path: the same token wherever
        // its choice is not a near-tie
        {
            let toks: Vec<u32> = ids.iter().map(|&t| t as u32).collect();
            let mut sess = Session::new(&w, 256, 2, 64);
            let mut l = sess.feed(&toks, Logits::Last).unwrap().to_vec();
            for (i, &t) in theirs.iter().enumerate() {
                let ok = argmax(&l) as i32 == t;
                forced += 1;
                forced_ok += ok as usize;
                assert!(
                    ok || margins[i] < 1.0,
                    "{p:?} step {i}: other token at margin {}",
                    margins[i]
                );
                l = sess.feed(&[t as u32], Logits::Last).unwrap().to_vec();
            }
        }
        let toks: Vec<u32> = ids.iter().map(|&t| t as u32).collect();
        let mut sess = Session::new(&w, 256, 2, 64);
        let mut l = sess.feed(&toks, Logits::Last).unwrap().to_vec();
        let mut ours = Vec::new();
        for _ in 0..n_gen {
            let t = argmax(&l);
            ours.push(t as i32);
            l = sess.feed(&[t], Logits::Last).unwrap().to_vec();
        }
        match ours.iter().zip(&theirs).position(|(a, b)| a != b) {
            None => identical += 1,
            Some(i) => {
                eprintln!("{p:?}: forks at token {i}, margin {:.4}", margins[i]);
                assert!(margins[i] < 1.0, "fork at token {i} is not a close call");
            }
        }
    }
    eprintln!(
        "gemma3 greedy: {identical}/5 identical for {n_gen} tokens (llama.cpp against itself: {identical_self}/5); teacher-forced {forced_ok}/{forced}"
    );
    // Free-running identity is not asserted beyond the close-call rule:
    // llama.cpp keeps only 3/5 against itself (measured), so "4 of 5"
    // measures where near-ties fall, not correctness.
    assert!(
        forced_ok * 100 >= forced * 95,
        "teacher-forced agreement {forced_ok}/{forced} < 95%"
    );
}

/// A synthetic model of `arch` at the tiny shape (`kvrun synth --arch`,
/// the R1 header's Qwen tokenizer), written to a temporary file.
pub fn synth_model(arch: &'static str, shape: &str) -> util::TempFile {
    use kvrun::format::synth::{self, Mix, Recipe, Spec};
    let f = util::TempFile::new(&format!("arch-{arch}-{shape}.gguf"));
    let recipe = Recipe {
        shape: synth::shape(shape),
        mix: Some(Mix::Q8_0),
        arch: Some(arch),
    };
    // sigma 0.06: logits spread enough that the argmax is decided
    let spec = Spec {
        sigma: 0.06,
        ..Spec::default()
    };
    let header = util::shared("r1-distill-qwen-7b.header.gguf");
    synth::write_file(&header, &recipe, &f.0, &spec).unwrap();
    f
}

/// Synthetic qwen3 / qwen3moe / phi3 / gemma3 (window 16, every other
/// layer global) against llama.cpp: logits at every position of a 64-token
/// prompt (prefill chunks of 10, crossing the window mid-chunk) and greedy
/// 32-token continuations of 5 prompts: forks only at close calls (top-2
/// margin < 0.5), and teacher-forced along llama.cpp's path its token at ≥
/// 90% of the steps. (Random weights spread probability over the whole
/// vocabulary, so near-ties with margins of 0.01–0.05 come every few
/// tokens, and free-running paths of two engines that differ by rounding
/// fork at one of them: measured 1/5 identical for qwen3 and qwen3moe,
/// 5/5 for gemma3; how many stay identical is printed, not asserted.)
fn synth_matches(arch: &'static str, shape: &str) {
    let _one = one_at_a_time();
    let f = synth_model(arch, shape);
    let lm = ggml_sys::LlamaModel::load_plain(f.0.to_str().unwrap()).unwrap();
    let text = util::wikitext(2000);
    let ids = lm.tokenize(&text, false, false)[..64].to_vec();
    let (ours, batch, seq) = three_ways(&f.0, &ids, 10, &|_| true);
    assert_parity(arch, &ours, &batch, &seq, true);

    let g = Gguf::open(&f.0).unwrap();
    let w = Weights::from_gguf(&g).unwrap();
    let (mut identical, mut identical_self, mut forced, mut forced_ok) = (0, 0, 0, 0);
    for (k, p) in [0usize, 300, 600, 900, 1200].iter().enumerate() {
        let ids = lm.tokenize(&text[*p..*p + 60], false, false);
        let run = |sequential: bool| {
            let mut ctx = ggml_sys::LlamaContext::new(&lm, 256, 2).unwrap();
            let mut l = if sequential {
                let mut l = Vec::new();
                for (i, &t) in ids.iter().enumerate() {
                    l = ctx.decode(&[t], i as i32, false).unwrap();
                }
                l
            } else {
                ctx.decode(&ids, 0, false).unwrap()
            };
            let (mut toks, mut margins) = (Vec::new(), Vec::new());
            for i in 0..32 {
                let t = argmax(&l) as i32;
                margins.push(top2_margin(&l));
                toks.push(t);
                l = ctx.decode(&[t], (ids.len() + i) as i32, false).unwrap();
            }
            (toks, margins)
        };
        let (theirs, margins) = run(false);
        identical_self += (run(true).0 == theirs) as usize;
        let mut sess = Session::new(&w, 256, 2, 64);
        let toks: Vec<u32> = ids.iter().map(|&t| t as u32).collect();
        let mut l = sess.feed(&toks, Logits::Last).unwrap().to_vec();
        let mut ours = Vec::new();
        for _ in 0..32 {
            let t = argmax(&l);
            ours.push(t as i32);
            l = sess.feed(&[t], Logits::Last).unwrap().to_vec();
        }
        match ours.iter().zip(&theirs).position(|(a, b)| a != b) {
            None => identical += 1,
            Some(i) => {
                eprintln!(
                    "{arch} prompt {k}: forks at token {i}, margin {:.4}",
                    margins[i]
                );
                assert!(
                    margins[i] < 0.5,
                    "{arch}: fork at token {i} is not a close call"
                );
            }
        }
        sess.reset();
        let mut l = sess.feed(&toks, Logits::Last).unwrap().to_vec();
        for (i, &t) in theirs.iter().enumerate() {
            let ok = argmax(&l) as i32 == t;
            forced += 1;
            forced_ok += ok as usize;
            assert!(
                ok || margins[i] < 0.5,
                "{arch} prompt {k} step {i}: margin {}",
                margins[i]
            );
            l = sess.feed(&[t as u32], Logits::Last).unwrap().to_vec();
        }
    }
    eprintln!(
        "{arch}: greedy {identical}/5 identical (llama.cpp against itself {identical_self}/5); teacher-forced {forced_ok}/{forced}"
    );
    assert!(
        forced_ok * 100 >= forced * 90,
        "{arch}: teacher-forced {forced_ok}/{forced}"
    );
}

#[test]
fn synth_qwen3_matches_llama_cpp() {
    synth_matches("qwen3", "tiny");
}

#[test]
fn synth_gemma3_sliding_window_matches_llama_cpp() {
    synth_matches("gemma3", "tiny");
}

#[test]
fn synth_phi3_matches_llama_cpp() {
    synth_matches("phi3", "tiny");
}

/// Memory: a gemma3 window cache holds exactly the window when decoding,
/// whatever the budget; the budgeted cache holds only the global layers.
#[test]
fn gemma3_window_cache_holds_exactly_the_window() {
    let _one = one_at_a_time();
    let f = synth_model("gemma3", "tiny");
    let g = Gguf::open(&f.0).unwrap();
    let w = Weights::from_gguf(&g).unwrap();
    let c = &w.config;
    let window = c.features.swa.as_ref().unwrap().window;
    assert_eq!(c.cache_layers(), vec![1]);
    let mut sess = Session::new(&w, 256, 2, 8);
    assert_eq!(
        sess.kv.n_layers, 1,
        "the budgeted cache holds the global layer only"
    );
    let toks: Vec<u32> = (0..100).map(|i| 100 + i).collect();
    sess.feed(&toks[..40], Logits::Last).unwrap();
    for &t in &toks[40..] {
        sess.feed(&[t], Logits::Last).unwrap();
        assert_eq!(sess.state.local_resident(), window);
    }
    // the window cache holds positions 100 − window ..= 99: a rewind to
    // 99 finds the window − 1 positions before it; to 98 it would need
    // one that is gone, so it starts over
    assert_eq!(sess.rewind_point(99), 99);
    assert_eq!(sess.rewind_point(98), 0);
    assert!(sess.truncate(98).is_err());
    sess.truncate(99).unwrap();
    sess.feed(&[5], Logits::Last).unwrap();
    assert_eq!(sess.state.local_resident(), window);
}

/// Synthetic qwen3moe (8 experts, 2 per token): router, top-k, renormalized
/// weights and packed expert products against llama.cpp.
#[test]
fn synth_qwen3moe_matches_llama_cpp() {
    synth_matches("qwen3moe", "tiny-moe");
}

/// The Gemma 3 270M file is the base model and carries no chat template;
/// the built-in Gemma turn format (`--chat-template gemma`) renders (system
/// text opens the first user turn), and its markers are single control
/// tokens.
#[test]
fn gemma3_builtin_chat_template_renders() {
    use kvrun::chat::{ChatTemplate, Message};
    let g = Gguf::open(&util::gemma_model()).unwrap();
    assert!(ChatTemplate::from_gguf(&g).unwrap().is_none());
    let tok = kvrun::tokenizer::Tokenizer::from_gguf(&g).unwrap();
    let t = ChatTemplate::from_arg("gemma", &tok).unwrap();
    let msgs = [
        Message::new("system", "Be brief."),
        Message::new("user", "Hi"),
        Message::new("assistant", "Hello!"),
        Message::new("user", "2+2?"),
    ];
    assert_eq!(
        t.render(&msgs, true).unwrap(),
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n<start_of_turn>user\n2+2?<end_of_turn>\n<start_of_turn>model\n"
    );
    let ids = tok.encode("<start_of_turn>model\n", false, true).unwrap();
    assert_eq!(ids.len(), 3, "{ids:?}: <start_of_turn> model \\n");
}

/// `enable_thinking` reaches the template (`--reasoning`, and a server
/// request's `chat_template_kwargs`): Qwen3's switch renders an empty think
/// block when it is false and leaves the default alone when unset.
#[test]
fn enable_thinking_reaches_the_template() {
    use kvrun::chat::{ChatTemplate, Message};
    let src = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}";
    let t = ChatTemplate::from_source(src, "", "").unwrap();
    let msgs = [Message::new("user", "hi")];
    let plain = t.render(&msgs, true).unwrap();
    assert!(plain.ends_with("<|im_start|>assistant\n"), "{plain:?}");
    let off = t.with_thinking(Some(false)).render(&msgs, true).unwrap();
    assert!(
        off.ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n"),
        "{off:?}"
    );
    let on = t.with_thinking(Some(true)).render(&msgs, true).unwrap();
    assert_eq!(on, plain);
}
