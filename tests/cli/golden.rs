//! Golden and CLI behaviour tests on the default model, through the binary.

use crate::util;

use std::process::{Command, Stdio};

fn kvrun(args: &[&str]) -> (String, String, bool) {
    let out = Command::new(util::kvrun_bin())
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run kvrun");
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
        out.status.success(),
    )
}

/// Fixed prompt, greedy, 64 tokens: exact expected text (chat template on).
///
/// Greedy text flips at a close call when the kernels sum in another order,
/// so the text is recorded per kernel profile (tests/data/golden_sky.<profile>.txt;
/// the AVX2 one was produced by the engine before the device-seam redesign,
/// commit 00f5acf, as well). On a profile with no record the test still
/// checks what does not depend on summation order: the answer's opening
/// words, and that 1 and 2 threads give the same text.
#[test]
fn golden_greedy_64_tokens() {
    let model = util::default_model();
    let m = model.to_str().unwrap();
    let run = |threads: &str, level: &str| {
        let out = Command::new(util::kvrun_bin())
            .args([
                "-m",
                m,
                "-p",
                "Explain why the sky is blue in two sentences.",
                "-n",
                "64",
                "--temp",
                "0",
                "-t",
                threads,
                "--no-perf",
            ])
            .env("KVRUN_CPU", level)
            .stdin(Stdio::null())
            .output()
            .expect("run kvrun");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "kvrun failed: {err}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    // this process's level, then every lower one the CPU runs
    let levels = std::iter::once(kvrun::backend::cpu::isa::level()).chain(util::lower_levels());
    for level in levels {
        let out = run("2", level.name());
        let profile = util::profile_of(level);
        let path = util::root().join(format!("tests/data/golden_sky.{profile}.txt"));
        match std::fs::read_to_string(&path) {
            Ok(want) => assert_eq!(out, want, "golden output changed (profile {profile})"),
            Err(_) => {
                eprintln!("no golden text for kernel profile {profile}; got:\n{out}");
                assert!(
                    out.starts_with(
                        "The sky is blue in two sentences because of a process called Rayleigh scattering,"
                    ),
                    "golden opening changed: {out}"
                );
                assert_eq!(
                    out,
                    run("1", level.name()),
                    "1 and 2 threads gave different text"
                );
            }
        }
    }
}

/// Same seed, same output; another seed, another output; thread count does not matter.
#[test]
fn seeded_sampling_is_reproducible() {
    let model = util::default_model();
    let m = model.to_str().unwrap();
    let run = |seed: &str, t: &str| {
        kvrun(&[
            "-m",
            m,
            "-p",
            "Write a short poem about rivers.",
            "-n",
            "48",
            "-s",
            seed,
            "-t",
            t,
            "--no-perf",
        ])
        .0
    };
    let a = run("7", "2");
    assert!(!a.trim().is_empty());
    assert_eq!(
        a,
        run("7", "1"),
        "same seed, different thread count, different text"
    );
    assert_eq!(a, run("7", "2"), "same seed, different text");
    assert_ne!(a, run("8", "2"), "different seeds gave identical text");
}

/// llama.cpp-shaped timing lines on stderr; -n limits the generated tokens.
#[test]
fn timing_lines_and_token_limit() {
    let model = util::default_model();
    let (_out, err, ok) = kvrun(&[
        "-m",
        model.to_str().unwrap(),
        "-p",
        "Count: 1, 2, 3,",
        "--raw",
        "-n",
        "10",
        "--temp",
        "0",
        "--ignore-eos",
    ]);
    assert!(ok, "{err}");
    let eval = err
        .lines()
        .find(|l| l.contains("        eval time ="))
        .expect("eval time line");
    assert!(
        eval.contains("/    10 runs"),
        "expected 10 decode runs: {eval}"
    );
    assert!(err
        .lines()
        .any(|l| l.starts_with("kvrun: prompt eval time =") && l.contains("tokens per second")));
    assert!(err
        .lines()
        .any(|l| l.starts_with("kvrun:       total time =")));
}

/// `--chat-template NAME|JINJA` and `--chat-template-file` replace the
/// model's template: greedy text equals `--raw` over the same rendering; a
/// model without a template of its own (Gemma 3 270M, a base model) runs
/// the prompt as plain text with a note; an unknown name is one line.
#[test]
fn chat_template_flags_replace_the_models_template() {
    let m = util::default_model();
    let m = m.to_str().unwrap();
    let q = "Name a prime number.";
    let rendered = format!("<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n");
    let gen = |extra: &[&str]| {
        let mut args = vec!["-m", m, "-n", "12", "--temp", "0", "-t", "1"];
        args.extend_from_slice(extra);
        let (out, err, ok) = kvrun(&args);
        assert!(ok, "{extra:?}: {err}");
        out
    };
    let raw = gen(&["--raw", "-p", &rendered]);
    assert_eq!(gen(&["--chat-template", "chatml", "-p", q]), raw);
    // (Jinja drops a template's one trailing newline, so the generation
    // prompt's newline is written as a string)
    let f = util::TempFile::new("tmpl.jinja");
    std::fs::write(
        &f.0,
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{{ '<|im_start|>assistant\\n' }}\n",
    )
    .unwrap();
    let fp = f.0.to_str().unwrap();
    assert_eq!(gen(&["--chat-template-file", fp, "-p", q]), raw);
    // the model's own template (a default system prompt) differs
    assert_ne!(gen(&["-p", q]), raw);

    let (_, err, ok) = kvrun(&["-m", m, "--chat-template", "nope", "-p", q, "-n", "1"]);
    assert!(!ok);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(
        err.contains("--chat-template") && err.contains("chatml, gemma"),
        "{err}"
    );

    let g = util::gemma_model();
    let (_, err, ok) = kvrun(&[
        "-m",
        g.to_str().unwrap(),
        "-p",
        "Hello",
        "-n",
        "1",
        "-t",
        "1",
    ]);
    assert!(ok, "{err}");
    assert!(err.contains("no chat template"), "{err}");
}

/// `kvrun bench -m A,B` benchmarks each file in one table (llama-bench's
/// model list): one row per model and test, the notes marked with their
/// model; a missing file in the list is a one-line error before any run.
#[test]
fn bench_takes_a_list_of_models() {
    let (a, b) = (util::default_model(), util::gemma_model());
    let list = format!("{},{}", a.display(), b.display());
    let args = |m: &str| {
        kvrun(&[
            "bench",
            "-m",
            m,
            "-p",
            "8",
            "-n",
            "2",
            "-r",
            "1",
            "-t",
            "2",
            "--no-llama",
        ])
    };
    let (out, err, ok) = args(&list);
    assert!(ok, "{err}");
    assert_eq!(
        out.lines().filter(|l| l.starts_with("| model")).count(),
        1,
        "one table: {out}"
    );
    let rows: Vec<&str> = out.lines().filter(|l| l.contains("| kvrun |")).collect();
    assert_eq!(rows.len(), 4, "2 models × pp8, tg2: {out}");
    // the two models' rows differ in size
    let size = |r: &str| r.split('|').nth(2).unwrap().trim().to_owned();
    assert_ne!(size(rows[0]), size(rows[2]), "{out}");
    // two probes per model; every row is compared with the fastest
    let mut probes = Vec::new();
    for m in [&a, &b] {
        let who = format!("{}: roofline:", m.display());
        let line = out
            .lines()
            .find(|l| l.starts_with(&who))
            .unwrap_or_else(|| panic!("{who} in {out}"));
        assert!(line.contains("the best of 4 probes"), "{line}");
        let figure = |l: &str, after: &str| -> f64 {
            let rest =
                &l[l.find(after).unwrap_or_else(|| panic!("{after} in {l}")) + after.len()..];
            let num: String = rest
                .trim_start()
                .chars()
                .take_while(|c| c.is_ascii_digit() || *c == '.')
                .collect();
            num.parse().unwrap_or_else(|_| panic!("{after} in {l}"))
        };
        probes.push((figure(line, "roofline:"), figure(line, "this model's best")));
    }
    let best = probes.iter().map(|p| p.1).fold(0.0, f64::max);
    for (shown, own) in &probes {
        assert_eq!(*shown, best, "{out}");
        assert!(own <= shown, "{out}");
    }
    let (_, err, ok) = args(&format!("{},/no/such.gguf", a.display()));
    assert!(!ok);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("/no/such.gguf"), "{err}");
}

/// `kvrun bench` on the default model, pp8 and tg4 on 2 threads, plus
/// `extra`: stdout, stderr, success.
fn small_bench(extra: &[&str]) -> (String, String, bool) {
    let m = util::default_model();
    let mut args = vec![
        "bench",
        "-m",
        m.to_str().unwrap(),
        "-p",
        "8",
        "-n",
        "4",
        "-t",
        "2",
    ];
    args.extend_from_slice(extra);
    kvrun(&args)
}

/// Each of `runs` fails with a one-line error naming `flag`.
fn one_line_errors(flag: &str, runs: &[&[&str]]) {
    for bad in runs {
        let (_, err, ok) = kvrun(bad);
        assert!(!ok, "{bad:?}");
        assert_eq!(err.trim().lines().count(), 1, "{bad:?}: {err}");
        assert!(err.contains(flag), "{bad:?}: {err}");
    }
}

/// `kvrun bench --mmap 0,1` (llama-bench's flag) loads the model once per
/// setting and measures both in the same run: a row per setting and test,
/// the second compared with the first, and a KV line each. Bad settings,
/// or a list where one run takes one setting, are one-line errors.
#[test]
fn bench_measures_each_mmap_setting() {
    let (out, err, ok) = small_bench(&["-r", "1", "--no-llama", "--mmap", "0,1"]);
    assert!(ok, "{err}");
    assert!(out.contains("| vs full mmap=0 |"), "{out}");
    for test in ["pp8", "tg4"] {
        for (setting, vs) in [("mmap=0", Some("100.0%")), ("mmap=1", None)] {
            let row = out
                .lines()
                .find(|l| l.contains(&format!("| kvrun {setting} | {test} |")))
                .unwrap_or_else(|| panic!("no {setting} {test} row in {out}"));
            let cell = row.split('|').nth(8).unwrap().trim();
            match vs {
                Some(v) => assert_eq!(cell, v, "{row}"),
                None => assert!(cell.ends_with('%') && cell != "-", "{row}"),
            }
        }
        assert_eq!(out.matches(&format!("| {test} |")).count(), 2, "{out}");
    }
    for setting in ["mmap=0", "mmap=1"] {
        assert!(
            out.contains(&format!("kvrun KV {setting}: policy full")),
            "{out}"
        );
    }
    assert!(
        out.contains("every --mmap and --repack setting's weights loaded at once"),
        "{out}"
    );
    one_line_errors(
        "--mmap",
        &[
            &["bench", "--mmap", "maybe", "-p", "8", "-n", "0"][..],
            &["-p", "hi", "-n", "1", "--mmap", "0,1"][..],
        ],
    );
    // one setting: the usual table, no label
    let (out, err, ok) = small_bench(&["-r", "1", "--no-llama", "--mmap", "off"]);
    assert!(ok, "{err}");
    assert!(
        out.contains("| kvrun | tg4 |") && !out.contains("mmap="),
        "{out}"
    );
}

/// `kvrun bench --repack on,off,q6_k` loads the model once per setting
/// (crossed with `--mmap`'s) and labels each row; bad settings, or a list
/// where one run takes one setting, are one-line errors.
#[test]
fn bench_measures_each_repack_setting() {
    let (out, err, ok) = small_bench(&[
        "-r",
        "1",
        "--no-llama",
        "--repack",
        "on,off,Q6_K",
        "--mmap",
        "0,1",
    ]);
    assert!(ok, "{err}");
    assert!(out.contains("| vs full mmap=0 repack=on |"), "{out}");
    for mmap in ["mmap=0", "mmap=1"] {
        for repack in ["repack=on", "repack=off", "repack=Q6_K"] {
            let engine = format!("| kvrun {mmap} {repack} | pp8 |");
            assert!(out.contains(&engine), "no {engine} in {out}");
        }
    }
    assert_eq!(out.matches("| pp8 |").count(), 6, "{out}");
    one_line_errors(
        "--repack",
        &[
            &["bench", "--repack", "f16", "-p", "8", "-n", "0"][..],
            &["bench", "--repack", "on,", "-p", "8", "-n", "0"][..],
            &["-p", "hi", "-n", "1", "--repack", "on,off"][..],
        ],
    );
    let (out, err, ok) = small_bench(&["-r", "1", "--no-llama", "--repack", "off"]);
    assert!(ok, "{err}");
    assert!(
        out.contains("| kvrun | pp8 |") && !out.contains("repack="),
        "{out}"
    );
}

/// Regression: in a `kvrun bench -m` list each model's peak RSS starts from
/// what is live, not from what the allocator kept of the models before it
/// (the default model after Gemma 3 270M twice read 198 MiB against 144
/// MiB after it once, until the heaps were trimmed before each reset).
#[test]
fn bench_peak_rss_is_each_models_own() {
    let d = util::default_model();
    let g = util::gemma_model();
    let (d, g) = (d.to_str().unwrap(), g.to_str().unwrap());
    let list = format!("{g},{d},{g},{d}");
    let (out, err, ok) = kvrun(&[
        "bench",
        "-m",
        &list,
        "--no-llama",
        "-t",
        "2",
        "-r",
        "1",
        "-p",
        "64",
        "-n",
        "8",
    ]);
    assert!(ok, "{err}");
    let peaks: Vec<f64> = out
        .lines()
        .filter(|l| l.starts_with(d) && l.contains("peak RSS after the kvrun runs"))
        .map(|l| {
            let mib = l.rsplit(": ").next().unwrap().trim_end_matches(" MiB");
            mib.parse().unwrap_or_else(|_| panic!("{l}"))
        })
        .collect();
    assert_eq!(peaks.len(), 2, "{out}");
    assert!(
        (peaks[1] - peaks[0]).abs() <= 16.0,
        "the default model's peak RSS moved from {} to {} MiB after Gemma ran again: {out}",
        peaks[0],
        peaks[1]
    );
}

/// `kvrun bench --prefetch off,8k,auto` runs the one loaded model with
/// each decoding prefetch distance in turn and labels each row; the one
/// setting of a plain bench is named in a note; a bad distance, or a list
/// where one run takes one setting, is a one-line error. The distance
/// changes no result: the same greedy text with each.
#[test]
fn bench_measures_each_prefetch_setting() {
    let (out, err, ok) = small_bench(&["-r", "1", "--no-llama", "--prefetch", "off,8k,auto"]);
    assert!(ok, "{err}");
    assert!(out.contains("| vs full prefetch=off |"), "{out}");
    for setting in ["prefetch=off", "prefetch=8192", "prefetch=auto ("] {
        for test in ["pp8", "tg4"] {
            let engine = format!("| kvrun {setting}");
            assert!(
                out.lines()
                    .any(|l| l.contains(&engine) && l.contains(&format!("| {test} |"))),
                "no {engine} {test} row in {out}"
            );
        }
    }
    assert_eq!(out.matches("| tg4 |").count(), 3, "{out}");
    assert!(
        !out.contains("every --mmap and --repack setting's weights loaded at once"),
        "a prefetch list must not load the model again: {out}"
    );
    one_line_errors(
        "--prefetch",
        &[
            &["bench", "--prefetch", "100", "-p", "8", "-n", "0"][..],
            &["bench", "--prefetch", "soon", "-p", "8", "-n", "0"][..],
            &["-p", "hi", "-n", "1", "--prefetch", "off,auto"][..],
        ],
    );
    let (out, err, ok) = small_bench(&["-r", "1", "--no-llama", "--prefetch", "4096"]);
    assert!(ok, "{err}");
    assert!(
        out.contains("| kvrun | tg4 |") && !out.contains("prefetch="),
        "{out}"
    );
    assert!(
        out.contains("kvrun decoding prefetch (--prefetch): 4096"),
        "{out}"
    );
    let m = util::default_model();
    let text = |p: &str| {
        let (out, err, ok) = kvrun(&[
            "-m",
            m.to_str().unwrap(),
            "-p",
            "The capital of France is",
            "-n",
            "24",
            "--temp",
            "0",
            "--prefetch",
            p,
        ]);
        assert!(ok, "{err}");
        out
    };
    assert_eq!(text("off"), text("16k"));
}

/// `kvrun bench --interleave` measures llama.cpp repetition by repetition
/// beside kvrun: both engines get a row per test with their own number of
/// repetitions behind it, the table says the run was interleaved, and no
/// kvrun-only peak RSS is claimed (both models were resident).
#[test]
fn bench_interleaves_the_engines() {
    let (out, err, ok) = small_bench(&["-r", "2", "--interleave"]);
    assert!(ok, "{err}");
    for test in ["pp8", "tg4"] {
        for engine in ["kvrun", "llama.cpp"] {
            let row = out
                .lines()
                .find(|l| l.contains(&format!("| {engine} | {test} |")))
                .unwrap_or_else(|| panic!("no {engine} {test} row in {out}"));
            // "t/s" is "mean ± sd" of measured repetitions
            let rate: f64 = row
                .split('|')
                .nth(6)
                .unwrap()
                .split('±')
                .next()
                .unwrap()
                .trim()
                .parse()
                .unwrap();
            assert!(rate > 0.0, "{row}");
            let ratio = row.split('|').nth(7).unwrap().trim();
            let r: f64 = ratio.strip_suffix('x').unwrap().parse().unwrap();
            if engine == "llama.cpp" {
                assert_eq!(ratio, "1.00x", "{row}");
            } else {
                assert!(r > 0.0, "a ratio against llama.cpp: {row}");
            }
        }
    }
    assert!(out.lines().any(|l| l.starts_with("interleaved:")), "{out}");
    assert!(!out.contains("before llama.cpp loads"), "{out}");
}

/// `kvrun bench` measures the machine's read bandwidth and prints, for
/// decoding rows, the bytes a token reads and the fraction of that
/// roofline reached (prefill rows are bound by compute: none).
#[test]
fn bench_prints_the_read_per_token_and_the_roofline() {
    let (out, err, ok) = small_bench(&["-r", "1", "--no-llama"]);
    assert!(ok, "{err}");
    let header = out
        .lines()
        .find(|l| l.starts_with("| model"))
        .expect("table header");
    assert!(header.ends_with("| read/token | roofline |"), "{header}");
    let cells = |test: &str| -> Vec<String> {
        let row = out
            .lines()
            .find(|l| l.contains(&format!("| {test} |")))
            .unwrap_or_else(|| panic!("no {test} row in {out}"));
        row.split('|')
            .map(|c| c.trim().to_owned())
            .filter(|c| !c.is_empty())
            .collect()
    };
    let pp = cells("pp8");
    assert_eq!(&pp[pp.len() - 2..], ["-", "-"], "{pp:?}");
    let tg = cells("tg4");
    let mb: f64 = tg[tg.len() - 2]
        .strip_suffix(" MB")
        .unwrap()
        .parse()
        .unwrap();
    // SmolLM2's weights (tied embedding: all of them) plus a few tokens of KV
    assert!((90.0..110.0).contains(&mb), "{tg:?}");
    let pct: f64 = tg[tg.len() - 1].strip_suffix('%').unwrap().parse().unwrap();
    assert!(pct > 0.0, "{tg:?}");
    let line = out
        .lines()
        .find(|l| l.starts_with("roofline:"))
        .expect("roofline line");
    let gbs: f64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{line}"));
    assert!(gbs > 0.5, "{line}");
}

/// `kvrun bench` names the CPU kernel level it ran at (the CPU's, capped
/// by `KVRUN_CPU`), and warns where the AMX tiles were emulated
/// (`KVRUN_AMX_EMULATE=1`): those rows time the emulator, not the CPU.
#[test]
fn bench_names_the_kernel_level() {
    use kvrun::backend::cpu::isa::{detected, level, Level};
    let m = util::default_model();
    let run = |env: &[(&str, &str)]| -> (String, String) {
        let out = Command::new(util::kvrun_bin())
            .args(["bench", "-m", m.to_str().unwrap(), "-p", "8", "-n", "0"])
            .args(["-t", "1", "-r", "1", "--no-llama"])
            .env_remove("KVRUN_AMX_EMULATE")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .output()
            .expect("run kvrun");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{env:?}: {err}");
        let line = text
            .lines()
            .find(|l| l.starts_with("kvrun CPU kernels (KVRUN_CPU): "))
            .unwrap_or_else(|| panic!("{env:?}: no kernel line in {text}"))
            .to_owned();
        (line, err)
    };
    let warning = "kvrun: warning: the AMX tiles are emulated in software";
    let (native, err) = run(&[]);
    assert_eq!(
        native,
        format!("kvrun CPU kernels (KVRUN_CPU): {}", level())
    );
    assert!(!err.contains(warning), "{err}");
    assert_eq!(
        run(&[("KVRUN_CPU", "portable")]).0,
        "kvrun CPU kernels (KVRUN_CPU): portable"
    );
    if detected() >= Level::Avx512Vnni {
        let (emu, err) = run(&[("KVRUN_CPU", "amx"), ("KVRUN_AMX_EMULATE", "1")]);
        assert!(
            emu.starts_with("kvrun CPU kernels (KVRUN_CPU): amx, AMX tiles emulated"),
            "{emu}"
        );
        // and stderr says so before anything runs
        assert!(err.starts_with(warning), "{err}");
    } else {
        eprintln!("no AVX-512 VNNI here: the emulated-tiles line goes unchecked");
    }
}
