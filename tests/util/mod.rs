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

/// Which of kvrun's kernels run in this process (the CPU's level capped
/// by `KVRUN_CPU`): the float summation orders differ between them (the
/// AVX2 and AVX-512 decode attention and the VNNI GEMM paths sum in
/// another order than the portable loops), so exact golden outputs are
/// recorded per profile.
pub fn kernel_profile() -> &'static str {
    profile_of(kvrun::backend::cpu::isa::level())
}

/// The golden-output profile of kernel level `l`.
pub fn profile_of(l: kvrun::backend::cpu::isa::Level) -> &'static str {
    use kvrun::backend::cpu::isa::Level;
    match l {
        Level::Portable => "portable",
        Level::Avx2 => "avx2",
        Level::Avx512 => "avx512",
        // the AMX prefill equals the VNNI kernels bit for bit
        Level::Avx512Vnni | Level::Amx => "avx512-vnni",
    }
}

/// The kernel levels below this process's that the CPU can also run (none
/// when `KVRUN_CPU` already caps it): tests that pin exact outputs rerun
/// themselves at each (see [`rerun_at_lower_levels`]), so every path is
/// covered on whatever machine runs them.
pub fn lower_levels() -> Vec<kvrun::backend::cpu::isa::Level> {
    use kvrun::backend::cpu::isa::{level, Level};
    if std::env::var_os("KVRUN_CPU").is_some() {
        return Vec::new();
    }
    [
        Level::Portable,
        Level::Avx2,
        Level::Avx512,
        Level::Avx512Vnni,
    ]
    .into_iter()
    .filter(|&l| l < level())
    .collect()
}

/// Run the test `name` (its full path in this test binary) again in a
/// child process at each of [`lower_levels`], and fail if any fails. On a
/// CPU with AVX-512 VNNI it also runs at `amx` on emulated tiles
/// (`KVRUN_AMX_EMULATE=1`): where the CPU has no AMX that covers the
/// level's kernels end to end, and where it has, it checks the emulator
/// against the hardware (the outputs pinned for the two are the same).
pub fn rerun_at_lower_levels(name: &str) {
    use kvrun::backend::cpu::isa::{level, Level};
    let emulated = level() >= Level::Avx512Vnni
        && std::env::var_os("KVRUN_CPU").is_none()
        && std::env::var_os("KVRUN_AMX_EMULATE").is_none();
    let runs = lower_levels().into_iter().map(|l| (l, false));
    let runs = runs.chain(emulated.then_some((Level::Amx, true)));
    for (l, emulate) in runs {
        let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
        cmd.args(["--exact", name, "--nocapture", "--test-threads", "1"])
            .env("KVRUN_CPU", l.name());
        if emulate {
            cmd.env("KVRUN_AMX_EMULATE", "1");
        }
        let out = cmd.output().expect("rerun the test binary");
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        let what = if emulate { " (emulated tiles)" } else { "" };
        assert!(
            out.status.success() && text.contains("1 passed"),
            "{name} at KVRUN_CPU={l}{what} failed:\n{text}"
        );
        eprintln!("{name}: passed at KVRUN_CPU={l}{what} too");
    }
}

/// Max |a-b| / max |b| of two rows of logits.
pub fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    let maxb = b.iter().fold(0f32, |m, x| m.max(x.abs()));
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / maxb
}

/// The gap between the two largest logits.
pub fn top2_margin(l: &[f32]) -> f32 {
    let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &x in l {
        if x > a {
            b = a;
            a = x;
        } else if x > b {
            b = x;
        }
    }
    a - b
}

/// Gemma 3 270M (instruction-tuned) Q4_K_M, fetched by `models/fetch.sh
/// gemma3` when missing (once per test process; the CI script fetches it
/// beforehand).
pub fn gemma_model() -> PathBuf {
    static FETCH: std::sync::Once = std::sync::Once::new();
    let p = root().join("models").join("gemma-3-270m.Q4_K_M.gguf");
    FETCH.call_once(|| {
        if !p.exists() {
            let _ = std::process::Command::new("bash")
                .arg(root().join("models").join("fetch.sh"))
                .arg("gemma3")
                .status();
        }
    });
    assert!(
        p.exists(),
        "Gemma 3 270M missing: run `bash models/fetch.sh gemma3` first ({})",
        p.display()
    );
    p
}

/// A file under the temporary directory, removed on drop.
pub struct TempFile(pub PathBuf);

impl TempFile {
    /// `<tmp>/kvrun-<pid>-<name>`.
    pub fn new(name: &str) -> TempFile {
        TempFile(std::env::temp_dir().join(format!("kvrun-{}-{name}", std::process::id())))
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}
