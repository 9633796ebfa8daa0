//! Fuzz the GGUF reader and what is built from a parsed header.
//!
//! Every input goes through `parse_bytes`. One that parses is also written to
//! a scratch file and opened with `Gguf::open`, then the model config, the
//! tensor table (`check_data`, every `tensor()` view), the weights (small
//! files only) and the tokenizer (small vocabularies only, plus an
//! encode/decode round) are built from it. Weights and tokenizer cost ~20 ms
//! an input, so they run for a fixed 1 in `DEEP_EVERY` of the parsed inputs
//! (chosen by a hash of the bytes, so a crash reproduces). Errors are fine;
//! a panic, an abort or a huge allocation is a finding.
#![no_main]

use kvrun::format::gguf::{parse_bytes, Gguf};
use libfuzzer_sys::fuzz_target;
use std::path::PathBuf;
use std::sync::OnceLock;

/// Tokenizers with more tokens than this are skipped (building SmolLM2's or
/// R1's full vocabulary takes far longer than one execution should).
const MAX_VOCAB: usize = 2048;
/// Weights are only loaded from files at most this large.
const MAX_WEIGHTS_FILE: usize = 1 << 20;
/// One parsed input in this many also goes through weights and tokenizer.
const DEEP_EVERY: u64 = 8;

/// FNV-1a of the input: picks the inputs that take the slow, deep path.
fn fnv(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
}

fn scratch() -> &'static PathBuf {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| {
        let dir = if std::path::Path::new("/dev/shm").is_dir() { "/dev/shm".into() } else { std::env::temp_dir() };
        dir.join(format!("kvrun-fuzz-{}.gguf", std::process::id()))
    })
}

fuzz_target!(|data: &[u8]| {
    if parse_bytes(data).is_err() {
        return;
    }
    let path = scratch();
    if std::fs::write(path, data).is_err() {
        return;
    }
    let Ok(g) = Gguf::open(path) else {
        panic!("parse_bytes accepted a file that Gguf::open rejects");
    };
    let _ = kvrun::model::Config::from_gguf(&g);
    let _ = g.check_data();
    for t in &g.tensors {
        let _ = t.n_bytes();
        let _ = g.tensor(&t.name);
    }
    if fnv(data) % DEEP_EVERY != 0 {
        return;
    }
    if data.len() <= MAX_WEIGHTS_FILE {
        let _ = kvrun::model::Weights::from_gguf(&g);
    }
    let n_vocab = g.get("tokenizer.ggml.tokens").and_then(|v| v.as_array()).map_or(0, |a| a.len());
    if n_vocab <= MAX_VOCAB {
        if let Ok(tok) = kvrun::tokenizer::Tokenizer::from_gguf(&g) {
            if let Ok(ids) = tok.encode("Hello world! 123 <|im_start|>é\n", true, true) {
                let _ = tok.decode(&ids, true);
            }
        }
    }
});
