//! Shared test fixtures: paths to the default model and the shared data.
#![allow(dead_code)]

use std::path::PathBuf;

/// The repository root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// ../shared/data/<name>
pub fn shared(name: &str) -> PathBuf {
    root().join("..").join("shared").join("data").join(name)
}

/// The default model; fetched by models/fetch.sh (the CI script runs it).
pub fn default_model() -> PathBuf {
    let p = root()
        .join("models")
        .join("SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.exists(),
        "default model missing: run `bash models/fetch.sh` first ({})",
        p.display()
    );
    p
}

/// The first `n_chars` characters of the WikiText-2 test text.
pub fn wikitext(n_chars: usize) -> String {
    let s = std::fs::read_to_string(shared("wikitext2_test_lf.txt")).expect("wikitext2 text");
    s.chars().take(n_chars).collect()
}

/// Path of the kvrun binary built for integration tests.
pub fn kvrun_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_kvrun"))
}

/// Which kernels this CPU runs: the float summation orders that differ
/// (the AVX-512 attention and VNNI GEMM paths sum in another order than the
/// AVX2/scalar ones), so exact golden outputs are recorded per profile.
pub fn kernel_profile() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        let f = std::arch::is_x86_feature_detected!("avx512f");
        let vnni = std::arch::is_x86_feature_detected!("avx512vnni")
            && std::arch::is_x86_feature_detected!("avx512vl");
        match (f, vnni) {
            (true, true) => "avx512-vnni",
            (true, false) => "avx512",
            _ => "avx2",
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        "other"
    }
}
