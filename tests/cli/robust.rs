//! Robustness of the foreground commands, through the binary as users hit
//! them: arguments that are not UTF-8, sizes that would overflow or exhaust
//! memory, Ctrl-C in one-shot generation and in chat, chat conversations that
//! outgrow the context, and the flag labels of error messages. Each case is
//! the reproduction of a reported failure.

use crate::util;

use std::ffi::{OsStr, OsString};
use std::io::{Read, Write};
use std::os::unix::ffi::OsStringExt;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

fn model() -> String {
    util::default_model().to_string_lossy().into_owned()
}

fn kvrun() -> Command {
    let mut c = Command::new(util::kvrun_bin());
    c.env_remove("KVRUN_MODEL").env_remove("RUST_BACKTRACE");
    c
}

fn run<S: AsRef<OsStr>>(args: &[S]) -> Output {
    kvrun()
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("spawn kvrun")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// A clean one-line failure (no panic, no backtrace) whose line has `want`.
fn one_line_error<S: AsRef<OsStr> + std::fmt::Debug>(args: &[S], want: &[&str]) {
    let out = run(args);
    let err = text(&out.stderr);
    let ctx = format!("kvrun {args:?}\nstatus {:?}\nstderr:\n{err}", out.status);
    assert!(!out.status.success(), "expected a failure: {ctx}");
    assert!(out.status.code().is_some(), "killed by a signal: {ctx}");
    assert!(
        !err.contains("panicked") && !err.contains("backtrace"),
        "{ctx}"
    );
    let lines: Vec<&str> = err.trim().lines().collect();
    assert_eq!(lines.len(), 1, "expected one stderr line: {ctx}");
    assert!(lines[0].starts_with("error: "), "{ctx}");
    for w in want {
        assert!(lines[0].contains(w), "error line lacks {w:?}: {ctx}");
    }
}

/// A run that succeeds; returns (stdout, stderr).
fn ok<S: AsRef<OsStr> + std::fmt::Debug>(args: &[S]) -> (String, String) {
    let out = run(args);
    let (o, e) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "kvrun {args:?} failed: {e}");
    assert!(!e.contains("panicked"), "{e}");
    (o, e)
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kvrun-robust-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn os(b: &[u8]) -> OsString {
    OsString::from_vec(b.to_vec())
}

fn sigint(child: &Child) {
    // SAFETY: kill(2) with a pid this test spawned and has not reaped.
    let rc = unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGINT) };
    assert_eq!(rc, 0, "kill failed");
}

/// Read from `r` until `done(all bytes so far)` or the deadline.
fn read_until(r: &mut impl Read, all: &mut Vec<u8>, done: impl Fn(&[u8]) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut buf = [0u8; 256];
    while !done(all) {
        assert!(Instant::now() < deadline, "timed out; got:\n{}", text(all));
        match r.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => all.extend_from_slice(&buf[..n]),
            Err(e) => panic!("read: {e}"),
        }
    }
}

// ------------------------------------------------------------ 1: non-UTF-8

/// Arguments are OS strings: file names may be any bytes (`-f`, `-m`),
/// prompt text that is not UTF-8 is a one-line error naming its flag
/// (both panicked in `std::env::args`).
#[test]
fn r01_non_utf8_arguments() {
    let m = model();
    for flag in ["-p", "-sys", "--system-prompt"] {
        let mut args: Vec<OsString> = vec!["-m".into(), m.clone().into(), "-n".into(), "2".into()];
        if flag != "-p" {
            args.extend(["-p".into(), "hi".into()]);
        }
        args.push(flag.into());
        args.push(os(b"hi \xff\xfe"));
        one_line_error(&args, &[flag, "not valid UTF-8"]);
    }
    let dir = scratch("r01");
    let mut prompt = dir.clone().into_os_string();
    prompt.push(os(b"/prompt-\xff.txt"));
    std::fs::write(&prompt, "Say hello.").unwrap();
    let mut link = dir.clone().into_os_string();
    link.push(os(b"/model-\xfe.gguf"));
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(util::default_model(), &link).unwrap();
    let args: Vec<OsString> = vec![
        "-m".into(),
        link,
        "-f".into(),
        prompt,
        "-n".into(),
        "3".into(),
        "--temp".into(),
        "0".into(),
        "--no-perf".into(),
    ];
    let (out, _) = ok(&args);
    assert!(!out.trim().is_empty(), "no text generated");
    // batch: input and output files with non-UTF-8 names, a huge budget
    let mut input = dir.clone().into_os_string();
    input.push(os(b"/in-\xff.jsonl"));
    std::fs::write(&input, "{\"id\":\"a\",\"prompt\":\"hi\"}\n").unwrap();
    let mut output = dir.clone().into_os_string();
    output.push(os(b"/out-\xff.jsonl"));
    let args: Vec<OsString> = [
        "batch",
        "-m",
        &m,
        "--max-tokens",
        "3",
        "-c",
        "256",
        "--policy",
        "window",
        "--kv-budget",
        "18446744073709551615",
        "-b",
        "18446744073709551615",
        "-i",
    ]
    .iter()
    .map(OsString::from)
    .chain([input, "-o".into(), output.clone()])
    .collect();
    let (_, err) = ok(&args);
    assert!(err.contains("clamped to 256"), "{err}");
    let rec = std::fs::read_to_string(&output).unwrap();
    assert!(rec.contains("\"budget\":256"), "{rec}");
    let _ = std::fs::remove_dir_all(dir);
}

// ------------------------------------------------------------ 2-4: sizes

/// Sizes that overflowed or exhausted memory: a budget of 2^64−1 or 2^40 is
/// clamped to the context (said on stderr, reported as the budget), a huge
/// `-b` is clamped, and sinks/recent that wrap the protection sum are
/// refused naming the flags.
#[test]
fn r02_huge_sizes_are_clamped_or_refused() {
    let m = model();
    // (regression: pyramidkv splits its budget unevenly, keeps it as given,
    // and the note no longer says it was clamped)
    for (policy, b, clamped) in [
        ("window", "18446744073709551615", true),
        ("window", "1099511627776", true),
        ("pyramidkv", "300", false),
    ] {
        let (_, err) = ok(&[
            "-m",
            &m,
            "-p",
            "hi",
            "-n",
            "2",
            "-c",
            "256",
            "--policy",
            policy,
            "--kv-budget",
            b,
        ]);
        if clamped {
            assert!(err.contains("clamped to 256"), "{err}");
            assert!(err.contains("budget=256"), "{err}");
        } else {
            assert!(!err.contains("clamped"), "{policy}: {err}");
        }
    }
    ok(&[
        "-m",
        &m,
        "-p",
        "hi",
        "-n",
        "2",
        "-b",
        "18446744073709551615",
    ]);
    // chat takes the same flags
    let mut child = kvrun()
        .args(["chat", "-m", &m, "-n", "4", "-c", "256", "--temp", "0"])
        .args(["--policy", "window", "--kv-budget", "18446744073709551615"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(b"hi\n").unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    // the budget becomes the context: defaults follow the clamped value
    ok(&[
        "-m",
        &m,
        "-p",
        "hi",
        "-n",
        "2",
        "-c",
        "64",
        "--policy",
        "h2o",
        "--kv-budget",
        "100000",
    ]);
    for (flag, want) in [("--kv-recent", "--kv-recent"), ("--kv-sink", "--kv-sink")] {
        one_line_error(
            &[
                "-m",
                &m,
                "-p",
                "hi",
                "-n",
                "2",
                "--policy",
                "window",
                "--kv-budget",
                "32",
                flag,
                "18446744073709551615",
            ],
            &["--kv-budget", want, "protected"],
        );
    }
}

/// `-c` beyond the trained context is allowed with a warning; a budget with
/// `--policy full` is refused rather than reported and ignored.
#[test]
fn r03_context_and_full_budget() {
    let m = model();
    let (_, err) = ok(&["-m", &m, "-p", "hi", "-n", "1", "-c", "9000"]);
    assert!(err.contains("beyond the model's trained context"), "{err}");
    one_line_error(
        &[
            "-m",
            &m,
            "-p",
            "hi",
            "--policy",
            "full",
            "--kv-budget",
            "48",
        ],
        &["--kv-budget", "--policy full"],
    );
}

// ------------------------------------------------------------ 5: Ctrl-C

/// One-shot generation: Ctrl-C stops at the next token, the text so far and
/// the timing and kv lines are printed, the exit status is 130.
#[test]
fn r05_ctrl_c_one_shot() {
    let mut child = kvrun()
        .args([
            "-m",
            &model(),
            "-p",
            "Write a very long story about a dragon.",
        ])
        .args([
            "-n",
            "2000",
            "--ignore-eos",
            "-c",
            "4096",
            "--temp",
            "0",
            "-t",
            "2",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut so = child.stdout.take().unwrap();
    let mut got = Vec::new();
    read_until(&mut so, &mut got, |b| b.len() >= 40);
    sigint(&child);
    so.read_to_end(&mut got).unwrap();
    let out = child.wait_with_output().unwrap();
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "stderr:\n{err}");
    assert!(err.contains("eval time"), "no timing lines:\n{err}");
    assert!(err.contains("kv: policy="), "no kv line:\n{err}");
    assert!(!err.contains("panicked"), "{err}");
    // it stopped early, not at -n
    let n: usize = err
        .lines()
        .find(|l| l.contains("eval time") && !l.contains("prompt"))
        .and_then(|l| l.split('/').nth(1))
        .and_then(|r| r.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("eval runs");
    assert!(n < 1990, "generation was not stopped ({n} runs)");
}

/// Chat: the first Ctrl-C stops the reply and the session goes on (the next
/// line is answered); a Ctrl-C at the prompt ends the process with 130.
#[test]
fn r05_ctrl_c_chat() {
    let mut child = kvrun()
        .args([
            "chat",
            "-m",
            &model(),
            "-n",
            "3000",
            "--temp",
            "0",
            "-t",
            "2",
        ])
        .args(["-c", "4096", "--ignore-eos"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut si = child.stdin.take().unwrap();
    let mut so = child.stdout.take().unwrap();
    si.write_all(b"Write a very long story about a dragon.\n")
        .unwrap();
    si.flush().unwrap();
    let mut got = Vec::new();
    read_until(&mut so, &mut got, |b| b.len() >= 40);
    sigint(&child);
    read_until(&mut so, &mut got, |b| text(b).contains("[stopped]"));
    si.write_all(b"/stats\n").unwrap();
    si.flush().unwrap();
    read_until(&mut so, &mut got, |b| text(b).contains("[kv:"));
    // now idle at the prompt: Ctrl-C exits
    std::thread::sleep(Duration::from_millis(200));
    sigint(&child);
    drop(si);
    so.read_to_end(&mut got).unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(
        out.status.code(),
        Some(130),
        "stdout:\n{}\nstderr:\n{}",
        text(&got),
        text(&out.stderr)
    );
}

// ------------------------------------------------------------ 6-7: chat

fn chat(args: &[&str], input: &[u8]) -> (String, String, bool) {
    let mut child = kvrun()
        .args(["chat", "-m", &model(), "--temp", "0", "-t", "2"])
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(input).unwrap();
    let out = child.wait_with_output().unwrap();
    (text(&out.stdout), text(&out.stderr), out.status.success())
}

/// A conversation that outgrows `-c` goes on: with a policy the budgeted
/// cache holds it (no shift, three answers); without one the oldest turns
/// are dropped once, said once, and every question is answered.
#[test]
fn r06_chat_outgrows_the_context() {
    let input = b"Tell me about cats.\nTell me about dogs.\nTell me about birds.\n";
    let (out, err, okay) = chat(
        &[
            "-n",
            "32",
            "-c",
            "120",
            "--policy",
            "window",
            "--kv-budget",
            "64",
        ],
        input,
    );
    assert!(okay, "budgeted chat failed: {err}\n{out}");
    assert_eq!(
        out.lines().filter(|l| !l.trim().is_empty()).count(),
        3,
        "{out}"
    );
    assert!(!out.contains("context full"), "{out}");
    let (out, err, okay) = chat(&["-n", "32", "-c", "120"], input);
    assert!(okay, "full-cache chat failed: {err}\n{out}");
    assert_eq!(out.matches("[context full").count(), 1, "{out}");
    let answers = out
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with('['))
        .count();
    assert_eq!(answers, 3, "{out}");
}

/// An over-long message and a non-UTF-8 line are reported and skipped; the
/// next line is answered and the exit status is 0.
#[test]
fn r07_chat_skips_bad_lines() {
    let mut input = b"\xff\xfe not text\n".to_vec();
    input.extend("word ".repeat(400).as_bytes());
    input.extend(b"\nSay hello.\n");
    let (out, err, okay) = chat(&["-n", "8", "-c", "128"], &input);
    assert!(okay, "chat failed: {err}\n{out}");
    assert!(out.contains("not valid UTF-8"), "{out}");
    assert!(out.contains("[message too long"), "{out}");
    let last = out.lines().rfind(|l| !l.trim().is_empty()).unwrap_or("");
    assert!(
        !last.starts_with('['),
        "the last line was not answered:\n{out}"
    );
}

// ------------------------------------------------------------ 16: labels

/// Error messages name the right flag and say what to do; negative numbers
/// name their flag; global flags may precede the subcommand; `inspect`
/// without a file inspects the default model.
#[test]
fn r16_flags_and_labels() {
    let m = model();
    let dir = scratch("r16");
    one_line_error(
        &[
            "-m",
            &m,
            "-p",
            "hi",
            "--policy",
            "epikv-band",
            "--kv-budget",
            "64",
        ]
        .into_iter()
        .chain(["--epikv-bands", "3-2,9-1"])
        .collect::<Vec<_>>(),
        &["--epikv-bands"],
    );
    let empty = dir.join("empty.txt");
    std::fs::write(&empty, "").unwrap();
    one_line_error(&["-m", &m, "-f", empty.to_str().unwrap()], &["-f", "empty"]);
    one_line_error(
        &["-m", dir.to_str().unwrap(), "-p", "hi"],
        &["not a Hugging Face model directory"],
    );
    one_line_error(
        &[
            "-m",
            &m,
            "-c",
            "8",
            "-p",
            "hello there, how are you doing today?",
        ],
        &["-c/--ctx-size", "raise it, e.g. -c "],
    );
    one_line_error(
        &["-m", &m, "-p", "hi", "-sys", "be brief", "--raw"],
        &["--raw"],
    );
    for (flag, v) in [
        ("-c", "-1"),
        ("--kv-budget", "-1"),
        ("-b", "-5"),
        ("-n", "-2"),
        ("--temp", "-1"),
    ] {
        let long = match flag {
            "-c" => "ctx-size",
            "-b" => "batch-size",
            "-n" => "n-predict",
            f => f.trim_start_matches('-'),
        };
        one_line_error(&["-m", &m, "-p", "hi", flag, v], &[long, v]);
    }
    one_line_error(&["-m", &m, "--polcy", "x"], &["--polcy", "--policy"]);
    let (_, err) = ok(&[
        "-m",
        &m,
        "-p",
        "Count from one to one hundred.",
        "-c",
        "40",
        "-n",
        "100",
        "--ignore-eos",
    ]);
    assert!(err.contains("the context is full (40 tokens)"), "{err}");
    let (out, _) = ok(&["inspect"]);
    assert!(out.contains("general.architecture"), "{out}");
    let (out, _) = ok(&["-m", &m, "inspect"]);
    assert!(out.contains("general.architecture"), "{out}");
    let (out, _) = ok(&["-m", &m, "-t", "1", "eval", "ppl", "--help"]);
    assert!(out.contains("Usage: kvrun eval ppl"), "{out}");
    let mut child = kvrun()
        .args(["-m", &m, "-t", "1", "chat", "-n", "2", "--temp", "0"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(b"hi\n").unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let _ = std::fs::remove_dir_all(dir);
}

// ------------------------------------------------- 20-29: the 2026-12 probe

/// A prompt file of about 370 tokens (25 numbered sentences) in `dir`.
fn sentences(dir: &std::path::Path) -> String {
    let f = dir.join("p200.txt");
    let text: String = (1..=25)
        .map(|i| format!("The quick brown fox jumps over the lazy dog, number {i}. "))
        .collect();
    std::fs::write(&f, text).unwrap();
    f.to_string_lossy().into_owned()
}

/// `bench` sizes its context from -p, -n and -d and repeats -r times: huge
/// values are one-line errors naming the flag, before any allocation (they
/// aborted in the allocator).
#[test]
fn r20_bench_sizes_are_checked() {
    let m = model();
    let bench = ["bench", "-m", &m, "-t", "1", "--no-llama"];
    for (flag, name) in [
        ("-p", "-p/--n-prompt"),
        ("-n", "-n/--n-gen"),
        ("-d", "-d/--depth"),
    ] {
        let args: Vec<&str> = bench.iter().copied().chain([flag, "99999999999"]).collect();
        one_line_error(&args, &[name, "cannot be allocated"]);
    }
    let args: Vec<&str> = bench.iter().copied().chain(["-r", "99999999999"]).collect();
    one_line_error(&args, &["-r/--repetitions", "between 1 and"]);
}

/// `eval passkey --ctx` is checked like -c: a haystack whose cache cannot be
/// allocated is a one-line error (it grew memory without bound).
#[test]
fn r21_passkey_ctx_is_checked() {
    let m = model();
    one_line_error(
        &[
            "eval",
            "passkey",
            "-m",
            &m,
            "-t",
            "1",
            "--ctx",
            "99999999999",
            "--depths",
            "0.5",
            "--policy",
            "h2o",
            "--kv-budget",
            "64",
        ],
        &["--ctx", "cannot be allocated"],
    );
}

/// Window and cadence flags beyond the text: `--obs-window` and
/// `--epikv-window` allocated their whole length up front (an abort, or a
/// capacity-overflow panic), `--lag-size` overflowed a slice bound (panic),
/// `--evict-every` near u64::MAX wrapped (a false "KV cache full"). Each now
/// runs, and as the same flag at a value merely longer than the text.
#[test]
fn r22_huge_policy_windows_are_bounded() {
    let m = model();
    let dir = scratch("r22");
    let f = sentences(&dir);
    let max = "18446744073709551615";
    let run = |extra: &[&str]| -> String {
        let mut args = vec![
            "-m",
            &m,
            "-f",
            &f,
            "-n",
            "16",
            "-t",
            "1",
            "--temp",
            "0",
            "--kv-budget",
            "64",
        ];
        args.extend_from_slice(extra);
        ok(&args).0
    };
    for (policy, flag, huge, long, more) in [
        (
            "snapkv",
            "--obs-window",
            "1000000000",
            "4096",
            &["--kv-recent", "8"][..],
        ),
        ("rkv", "--obs-window", max, "4096", &["--kv-recent", "8"]),
        (
            "expected-attention",
            "--obs-window",
            max,
            "4096",
            &["--kv-recent", "8"],
        ),
        (
            "epikv",
            "--epikv-window",
            "4294967296",
            "4096",
            &["--epikv-score-prompt"],
        ),
        (
            "epikv",
            "--epikv-window",
            max,
            "4096",
            &["--epikv-score-prompt"],
        ),
        ("lagkv", "--lag-size", max, "4096", &[]),
        ("h2o", "--evict-every", max, "4096", &[]),
    ] {
        let mut a = vec!["--policy", policy, flag, huge];
        a.extend_from_slice(more);
        let got = run(&a);
        a[3] = long;
        assert_eq!(got, run(&a), "{policy} {flag} {huge} vs {long}");
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// Wait up to `limit` for `child` to exit, then kill it and fail.
fn wait_within(mut child: Child, limit: Duration, what: &str) -> Output {
    let t0 = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t0.elapsed() > limit {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "{what}: still running after {limit:?}: {}",
                text(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

/// A `kvrun` started the way a shell starts a background job (SIGINT
/// ignored) and sent SIGINT while its model loads, `serve` too: the signal
/// was lost and the run went on to the end; now it ends with 130 and
/// nothing generated. (A 1.5B synthetic model is generated in memory at
/// load, which takes many seconds; the run stops long before.)
#[test]
fn r23_ctrl_c_while_loading() {
    use std::os::unix::process::CommandExt;
    let synth = format!("synth:{}:r1-distill-qwen-1.5b", model());
    for serve in [false, true] {
        let mut cmd = kvrun();
        if serve {
            cmd.args(["serve", "-m", &synth, "-t", "1", "--port", "0"]);
        } else {
            cmd.args(["-m", &synth, "-p", "Write a long story.", "-n", "300"])
                .args(["--ignore-eos", "-t", "1", "--temp", "0"]);
        }
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // SAFETY: between fork and exec the child only calls signal(2),
        // which is async-signal-safe, and touches no memory of the parent.
        unsafe {
            cmd.pre_exec(|| {
                libc::signal(libc::SIGINT, libc::SIG_IGN);
                Ok(())
            });
        }
        let child = cmd.spawn().unwrap();
        std::thread::sleep(Duration::from_millis(300));
        sigint(&child);
        let out = wait_within(child, Duration::from_secs(10), "after SIGINT");
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(130), "serve={serve}: {err}");
        assert!(out.stdout.is_empty(), "generated: {}", text(&out.stdout));
        assert!(!err.contains("http://"), "the server started: {err}");
    }
}

/// Ctrl-C during a long prefill stops at the next chunk (-b), not after the
/// whole prompt.
#[test]
fn r24_ctrl_c_during_prefill() {
    let dir = scratch("r24");
    let f = dir.join("long.txt");
    std::fs::write(&f, util::wikitext(14000)).unwrap();
    let child = kvrun()
        .args(["-m", &model(), "-f", f.to_str().unwrap(), "--raw"])
        .args(["-c", "8192", "-b", "32", "-n", "4", "-t", "1"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    sigint(&child);
    let t = Instant::now();
    let out = wait_within(child, Duration::from_secs(60), "after the Ctrl-C");
    let waited = t.elapsed();
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{err}");
    assert!(
        waited < Duration::from_secs(4),
        "took {waited:?} after the Ctrl-C (the prefill of ~3000 tokens takes over 10 s): {err}"
    );
    assert!(out.stdout.is_empty(), "{}", text(&out.stdout));
    let _ = std::fs::remove_dir_all(dir);
}

/// `synth`: SIGINT and SIGTERM stop the run and remove the unfinished
/// `.tmp` (exit 130 / 143; SIGINT was ignored, SIGTERM left a model-sized
/// file behind), and `-o` naming the header itself is refused.
#[test]
fn r25_synth_signals_and_output() {
    let dir = scratch("r25");
    let hdr = dir.join("hdr.gguf");
    std::fs::copy(model(), &hdr).unwrap();
    let before = std::fs::read(&hdr).unwrap();
    let h = hdr.to_str().unwrap();
    one_line_error(
        &["synth", h, "-o", h, "--shape", "tiny"],
        &["-o/--out", "header file itself"],
    );
    // also through another spelling of the same path
    let other = format!("{}/./hdr.gguf", dir.display());
    one_line_error(&["synth", h, "-o", &other], &["-o/--out"]);
    assert!(std::fs::read(&hdr).unwrap() == before, "the header changed");
    for (sig, code) in [(libc::SIGINT, 130), (libc::SIGTERM, 143)] {
        let out = dir.join(format!("out{sig}.gguf"));
        let tmp = dir.join(format!("out{sig}.gguf.tmp"));
        let child = kvrun()
            .args(["synth", h, "-o", out.to_str().unwrap()])
            .args(["--shape", "r1-distill-qwen-1.5b", "-t", "1"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let t0 = Instant::now();
        while !tmp.exists() {
            assert!(t0.elapsed() < Duration::from_secs(60), "no {tmp:?}");
            std::thread::sleep(Duration::from_millis(10));
        }
        // SAFETY: kill(2) with a pid this test spawned and has not reaped.
        assert_eq!(unsafe { libc::kill(child.id() as libc::pid_t, sig) }, 0);
        let o = wait_within(child, Duration::from_secs(10), "synth after the signal");
        let err = text(&o.stderr);
        assert_eq!(o.status.code(), Some(code), "signal {sig}: {err}");
        assert!(!tmp.exists(), "signal {sig}: {tmp:?} left behind");
        assert!(!out.exists(), "signal {sig}: {out:?} written");
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// A character whose bytes are split over tokens, cut off by -n: the
/// output held back its first bytes and then printed them as U+FFFD.
#[test]
fn r26_split_character_at_the_end() {
    let m = model();
    let mut seen = false;
    for n in 1..=7 {
        let n = n.to_string();
        let (out, _) = ok(&[
            "-m",
            &m,
            "-p",
            "Reply with only emojis: 🌟🎉🐉🍕",
            "-n",
            &n,
            "--temp",
            "0",
            "-t",
            "1",
        ]);
        assert!(!out.contains('\u{FFFD}'), "-n {n}: {out:?}");
        seen |= out.contains('🌟');
    }
    assert!(
        seen,
        "the model no longer answers with emojis: the case is not exercised"
    );
}

/// `eval ppl`: a --segment-after marker that lies past --ctx is an error
/// like a missing marker (it reported a bogus one-token segment), and
/// --ctx 1 names --ctx (it said the text had fewer than 2 tokens).
#[test]
fn r27_eval_segment_beyond_ctx() {
    let m = model();
    let dir = scratch("r27");
    let f = dir.join("t.txt");
    let words = "the cat sat on the mat and then it slept ".repeat(30);
    std::fs::write(&f, format!("{words}</think> the answer is four.")).unwrap();
    let base = [
        "eval",
        "ppl",
        "-m",
        &m,
        "-t",
        "1",
        "-f",
        f.to_str().unwrap(),
        "--policy",
        "h2o",
        "--kv-budget",
        "32",
    ];
    let with = |extra: &[&'static str]| -> Vec<String> {
        base.iter().chain(extra).map(|s| s.to_string()).collect()
    };
    one_line_error(
        &with(&["--ctx", "64", "--segment-after", "</think>"]),
        &["--segment-after", "beyond --ctx 64"],
    );
    one_line_error(&with(&["--ctx", "1"]), &["--ctx", "at least 2"]);
    // the whole text: the segment is there
    ok(&with(&["--ctx", "0", "--segment-after", "</think>"]));
    let _ = std::fs::remove_dir_all(dir);
}

/// The context-full hint: one-shot stops at -c with a policy too, so the
/// hint no longer advises --policy with --kv-budget for longer output.
#[test]
fn r28_context_full_hint() {
    let m = model();
    for policy in [&[][..], &["--policy", "window", "--kv-budget", "32"]] {
        let mut args = vec!["-m", &m, "-p", "hi", "-c", "64", "-n", "300"];
        args.extend_from_slice(&["--ignore-eos", "-t", "1"]);
        args.extend_from_slice(policy);
        let (_, err) = ok(&args);
        let hint = err
            .lines()
            .find(|l| l.contains("the context is full (64 tokens)"))
            .unwrap_or_else(|| panic!("no hint: {err}"));
        assert!(!hint.contains("use --policy"), "{hint}");
        assert!(hint.contains("raise -c/--ctx-size"), "{hint}");
    }
}

/// Small messages: `inspect DIR` says it is a directory (it said "No such
/// device"), `chat -c HUGE` is one line (a warning came first), and
/// `--min-per-head` shows an integer metavar.
#[test]
fn r29_messages() {
    let dir = scratch("r29");
    one_line_error(&["inspect", dir.to_str().unwrap()], &["a directory"]);
    let m = model();
    one_line_error(
        &["chat", "-m", &m, "-c", "99999999999"],
        &["-c/--ctx-size", "cannot be allocated"],
    );
    let (out, _) = ok(&["--help"]);
    assert!(out.contains("--min-per-head <N>"), "{out}");
    let _ = std::fs::remove_dir_all(dir);
}
