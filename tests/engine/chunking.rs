//! A prompt's result never depends on how it is cut into chunks: whole,
//! in batches of 4 or 11 (remainders of 1 token included), or as all but
//! its last token followed by that token alone (what the server's prompt
//! cache does when the same prompt comes again), the last logits and the
//! greedy continuation's logits are the same bit for bit. Regression: a
//! 1-token prompt chunk used to run the decode attention kernel, whose
//! summation order differs from the prefill kernel's, so a re-fed last
//! token wrote slightly different K/V and, with an f16 cache, changed a
//! later answer (`server::prompt_prefix_reuse` on AVX2 machines).

use crate::util;

use kvrun::format::gguf::Gguf;
use kvrun::generate::Session;
use kvrun::model::llama::Logits;
use kvrun::model::Weights;
use kvrun::sample::argmax;
use kvrun::tokenizer::Tokenizer;

const N_PROMPT: usize = 45;
const N_GEN: usize = 6;

/// Feed `ids` as a prompt in pieces of `cuts` (sizes, summing to the
/// prompt) with batch `n_batch`, then decode greedily: every logit row.
/// With `rewind` > 0, first run the prompt and a short continuation, then
/// rewind to `rewind` tokens before the prompt's end and re-feed them as
/// the server's prompt cache does (`cuts` then covers just those).
fn run<'w>(
    w: &'w Weights<'w>,
    ids: &[u32],
    cuts: &[usize],
    n_batch: usize,
    threads: usize,
    rewind: usize,
) -> Vec<f32> {
    let mut s = Session::new(w, ids.len() + N_GEN + 1, threads, n_batch);
    let mut at = 0;
    if rewind > 0 {
        s.protect_prompt(ids.len());
        let mut last = s.feed(ids, Logits::Last).unwrap().to_vec();
        for _ in 0..3 {
            last = s.feed(&[argmax(&last)], Logits::Last).unwrap().to_vec();
        }
        at = ids.len() - rewind;
        s.truncate(at).unwrap();
    }
    assert_eq!(at + cuts.iter().sum::<usize>(), ids.len());
    s.protect_prompt(ids.len());
    let mut last = Vec::new();
    for &c in cuts {
        last = s.feed(&ids[at..at + c], Logits::Last).unwrap().to_vec();
        at += c;
    }
    let mut all = last.clone();
    for _ in 0..N_GEN {
        let t = argmax(&last);
        last = s.feed(&[t], Logits::Last).unwrap().to_vec();
        all.extend_from_slice(&last);
    }
    all
}

#[test]
fn prompt_chunking_never_changes_the_logits() {
    util::rerun_at_lower_levels("chunking::prompt_chunking_never_changes_the_logits");
    // SmolLM2 (Q4_1, one cache), Gemma 3 (Q4_K/Q6_K, sliding-window layers
    // with their own window cache)
    for path in [util::default_model(), util::gemma_model()] {
        check_model(&path);
    }
}

fn check_model(path: &std::path::Path) {
    let name = path.file_name().unwrap().to_string_lossy().into_owned();
    let g = Gguf::open(path).unwrap();
    let w = Weights::from_gguf(&g).unwrap();
    let tok = Tokenizer::from_gguf(&g).unwrap();
    let ids = tok
        .encode(&util::wikitext(N_PROMPT * 8), true, false)
        .unwrap()[..N_PROMPT]
        .to_vec();
    let whole = run(&w, &ids, &[N_PROMPT], 64, 1, 0);
    let cases = [
        ("batches of 4 (last chunk 1 token)", vec![N_PROMPT], 4, 1, 0),
        (
            "batches of 11 (last chunk 1), 2 threads",
            vec![N_PROMPT],
            11,
            2,
            0,
        ),
        (
            "all but the last token, then the last",
            vec![N_PROMPT - 1, 1],
            64,
            1,
            0,
        ),
        ("one token at a time", vec![1; N_PROMPT], 64, 2, 0),
        ("rewound to the last token, re-fed", vec![1], 64, 1, 1),
        ("rewound 5 tokens, re-fed as one chunk", vec![5], 64, 2, 5),
    ];
    for (what, cuts, nb, threads, rewind) in cases {
        let got = run(&w, &ids, &cuts, nb, threads, rewind);
        let diff = got
            .iter()
            .zip(&whole)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(
            diff,
            0,
            "{name}, {what}: {diff} of {} logits differ from the whole prefill",
            whole.len()
        );
    }
}
