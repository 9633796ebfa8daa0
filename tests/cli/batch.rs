//! `kvrun batch` end to end with the real default model (8 tokens per record):
//! malformed lines, resume, shards + merge, stdin input.

use crate::util;

use serde_json::Value;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

const INPUT: &str = concat!(
    r#"{"id": "a", "question": "What is 2+3?", "answer": "5"}"#,
    "\n",
    r#"{"unique_id": "b", "problem": "Compute 7*6.", "answer": "42"}"#,
    "\n",
    r#"{"id": "c", "question": "broken"#,
    "\n",
    r#"{"id": "d", "prompt": "Say hi."}"#,
    "\n",
);

fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kvrun-batch-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn kvrun(args: &[&str], stdin: Option<&str>) -> Output {
    let model = util::default_model();
    let m = model.to_str().unwrap();
    let base = ["batch", "-m", m, "-t", "2", "--max-tokens", "8"];
    run(&[&base[..], args].concat(), stdin)
}

/// kvrun with exactly `args`, `stdin` written to it (or none).
fn run(args: &[&str], stdin: Option<&str>) -> Output {
    let mut cmd = Command::new(util::kvrun_bin());
    cmd.args(args);
    cmd.stdin(if stdin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    })
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("run kvrun");
    if let Some(s) = stdin {
        child.stdin.take().unwrap().write_all(s.as_bytes()).unwrap();
    }
    child.wait_with_output().unwrap()
}

fn records(text: &str) -> Vec<Value> {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).expect("JSON record"))
        .collect()
}

fn read_records(p: &Path) -> Vec<Value> {
    records(&std::fs::read_to_string(p).unwrap())
}

/// (id, line, output) of each record.
fn key(recs: &[Value]) -> Vec<(String, u64, String)> {
    recs.iter()
        .map(|r| {
            (
                r["id"].as_str().unwrap().to_owned(),
                r["line"].as_u64().unwrap(),
                r["output"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn malformed_line_resume_shards_merge() {
    let d = tmpdir("main");
    let input = d.join("in.jsonl");
    std::fs::write(&input, INPUT).unwrap();
    let inp = input.to_str().unwrap();

    // without --allow-errors the bad line makes the exit status 1, after
    // the other records were written
    let strict = d.join("strict.jsonl");
    let o = kvrun(&["-i", inp, "-o", strict.to_str().unwrap()], None);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("1 line(s) failed (line 3)"), "{err}");
    assert_eq!(read_records(&strict).len(), 3);

    // full run with --allow-errors: 3 results in order, the bad line named, exit 0
    let full = d.join("full.jsonl");
    let summary = d.join("summary.json");
    let o = kvrun(
        &[
            "-i",
            inp,
            "-o",
            full.to_str().unwrap(),
            "--summary",
            summary.to_str().unwrap(),
            "--allow-errors",
        ],
        None,
    );
    let err = stderr(&o);
    assert!(o.status.success(), "exit {:?}: {err}", o.status);
    assert!(err.contains("line 3:"), "stderr should name line 3: {err}");
    assert!(
        !err.contains("line 1:") && !err.contains("line 4:"),
        "{err}"
    );
    let recs = read_records(&full);
    let ids: Vec<&str> = recs.iter().map(|r| r["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["a", "b", "d"]);
    let lines: Vec<u64> = recs.iter().map(|r| r["line"].as_u64().unwrap()).collect();
    assert_eq!(lines, [1, 2, 4]);
    for r in &recs {
        for f in [
            "prompt_tokens",
            "gen_tokens",
            "output",
            "pred",
            "gold",
            "correct",
            "stop",
            "time_s",
            "tok_s",
            "peak_kv_bytes",
            "evicted",
            "policy",
            "budget",
        ] {
            assert!(r.get(f).is_some(), "record lacks {f}: {r}");
        }
        assert!(r["gen_tokens"].as_u64().unwrap() <= 8);
        assert!(r["peak_kv_bytes"].as_u64().unwrap() > 0);
    }
    assert_eq!(recs[0]["gold"], "5");
    assert!(recs[0]["correct"].is_boolean());
    assert!(recs[2]["correct"].is_null(), "no gold, no grade");
    let s: Value = serde_json::from_str(&std::fs::read_to_string(&summary).unwrap()).unwrap();
    assert_eq!(s["processed"], 3);
    assert_eq!(s["errors"], 1);
    assert_eq!(s["error_lines"], serde_json::json!([3]));
    assert_eq!(s["graded"], 2);

    // resume: a partial output with record "a" only → only b and d are run
    let part = d.join("part.jsonl");
    let first = std::fs::read_to_string(&full)
        .unwrap()
        .lines()
        .next()
        .unwrap()
        .to_owned()
        + "\n";
    std::fs::write(&part, first).unwrap();
    let s2 = d.join("summary2.json");
    let o = kvrun(
        &[
            "-i",
            inp,
            "-o",
            part.to_str().unwrap(),
            "--resume",
            "--summary",
            s2.to_str().unwrap(),
            "--allow-errors",
        ],
        None,
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let s: Value = serde_json::from_str(&std::fs::read_to_string(&s2).unwrap()).unwrap();
    assert_eq!(
        s["processed"], 2,
        "resume should run only the missing ids: {s}"
    );
    assert_eq!(s["skipped_resume"], 1);
    assert_eq!(key(&read_records(&part)), key(&recs));
    // the totals cover the whole output file, not only this run's records
    let whole = read_records(&part);
    assert_eq!(s["records"], 3, "{s}");
    let gen: u64 = whole
        .iter()
        .map(|r| r["gen_tokens"].as_u64().unwrap())
        .sum();
    assert_eq!(s["gen_tokens"].as_u64().unwrap(), gen, "{s}");
    let graded = whole.iter().filter(|r| r["correct"].is_boolean()).count();
    assert_eq!(s["graded"].as_u64().unwrap(), graded as u64, "{s}");

    // shards 0/2 and 1/2, merged, equal the unsharded run
    let s0 = d.join("s0.jsonl");
    let s1 = d.join("s1.jsonl");
    let o = kvrun(
        &[
            "-i",
            inp,
            "-o",
            s0.to_str().unwrap(),
            "--shard",
            "0/2",
            "--allow-errors",
        ],
        None,
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("line 3:"),
        "line 3 (index 2) belongs to shard 0"
    );
    let o = kvrun(
        &["-i", inp, "-o", s1.to_str().unwrap(), "--shard", "1/2"],
        None,
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(
        key(&read_records(&s0))
            .iter()
            .map(|k| k.1)
            .collect::<Vec<_>>(),
        [1]
    );
    assert_eq!(
        key(&read_records(&s1))
            .iter()
            .map(|k| k.1)
            .collect::<Vec<_>>(),
        [2, 4]
    );
    let merged = d.join("merged.jsonl");
    // s0 twice: duplicates are dropped
    let o = Command::new(util::kvrun_bin())
        .args([
            "batch",
            "merge",
            s1.to_str().unwrap(),
            s0.to_str().unwrap(),
            s0.to_str().unwrap(),
            "-o",
            merged.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(key(&read_records(&merged)), key(&recs));

    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn stdin_input_and_stdout_output() {
    let o = kvrun(&["-i", "-", "-o", "-", "--allow-errors"], Some(INPUT));
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("line 3:"), "{err}");
    let recs = records(&String::from_utf8(o.stdout).unwrap());
    let ids: Vec<&str> = recs.iter().map(|r| r["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["a", "b", "d"]);
    // --limit 1 stops after the first record
    let o = kvrun(&["-i", "-", "-o", "-", "--limit", "1"], Some(INPUT));
    assert!(o.status.success());
    assert_eq!(records(&String::from_utf8(o.stdout).unwrap()).len(), 1);
}

#[test]
fn nothing_processable_fails() {
    let o = kvrun(
        &["-i", "-", "-o", "-"],
        Some("{\"id\": \"x\", \"text\": \"no prompt field\"}\nnot json\n"),
    );
    let err = stderr(&o);
    assert!(
        !o.status.success(),
        "all lines bad must exit non-zero: {err}"
    );
    assert!(err.contains("line 1:") && err.contains("line 2:"), "{err}");
    assert!(o.stdout.is_empty());
}

/// Two input lines sharing an id: a warning, and `--resume` after `--limit 1`
/// runs the second one (records are keyed by line number and id); merge
/// keeps both.
#[test]
fn duplicate_ids_are_kept_apart_by_line() {
    let d = tmpdir("dup");
    let input = d.join("in.jsonl");
    std::fs::write(
        &input,
        concat!(
            r#"{"id": "dup", "question": "What is 2+3?"}"#,
            "\n",
            r#"{"id": "dup", "question": "What is 4+4?"}"#,
            "\n",
            r#"{"id": "z", "question": "Say hi."}"#,
            "\n",
        ),
    )
    .unwrap();
    let inp = input.to_str().unwrap();
    let out = d.join("out.jsonl");
    let outp = out.to_str().unwrap();
    let o = kvrun(&["-i", inp, "-o", outp, "--limit", "1"], None);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("line 2: warning: id \"dup\" is also on line 1"),
        "{err}"
    );
    assert_eq!(read_records(&out).len(), 1);
    let o = kvrun(&["-i", inp, "-o", outp, "--resume"], None);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("2 done, 0 errors, 1 skipped"), "{err}");
    let recs = read_records(&out);
    let got: Vec<(String, u64)> = key(&recs).into_iter().map(|k| (k.0, k.1)).collect();
    assert_eq!(got, [("dup".into(), 1), ("dup".into(), 2), ("z".into(), 3)]);
    // merging the file with itself keeps both "dup" records once
    let merged = d.join("merged.jsonl");
    let o = Command::new(util::kvrun_bin())
        .args(["batch", "merge", outp, outp, "-o", merged.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(key(&read_records(&merged)), key(&recs));
    let _ = std::fs::remove_dir_all(&d);
}

/// A torn last line (a crash in the middle of a write) is reported and cut
/// off by `--resume`, which then reruns that record: whole lines, each once.
#[test]
fn resume_cuts_a_torn_last_line() {
    let d = tmpdir("torn");
    let input = d.join("in.jsonl");
    std::fs::write(
        &input,
        concat!(
            r#"{"id": "a", "question": "What is 2+3?"}"#,
            "\n",
            r#"{"id": "b", "question": "Say hi."}"#,
            "\n",
        ),
    )
    .unwrap();
    let inp = input.to_str().unwrap();
    let out = d.join("out.jsonl");
    let outp = out.to_str().unwrap();
    let o = kvrun(&["-i", inp, "-o", outp], None);
    assert!(o.status.success(), "{}", stderr(&o));
    let full = std::fs::read_to_string(&out).unwrap();
    let want = key(&records(&full));
    let cut = full.find('\n').unwrap() + 1 + 25;
    std::fs::write(&out, &full.as_bytes()[..cut]).unwrap();
    let o = kvrun(&["-i", inp, "-o", outp, "--resume"], None);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("removed a truncated last line (25 bytes"),
        "{err}"
    );
    let text = std::fs::read_to_string(&out).unwrap();
    assert!(text.ends_with('\n'));
    assert_eq!(key(&records(&text)), want);
    let _ = std::fs::remove_dir_all(&d);
}

/// `-i X -o X`, also through a symlink, is refused before anything is
/// written; the input is untouched.
#[test]
fn same_input_and_output_is_refused() {
    let d = tmpdir("same");
    let input = d.join("in.jsonl");
    std::fs::write(&input, INPUT).unwrap();
    let link = d.join("link.jsonl");
    std::os::unix::fs::symlink(&input, &link).unwrap();
    for out in [&input, &link] {
        for extra in [&[][..], &["--resume"][..]] {
            let mut args = vec!["-i", input.to_str().unwrap(), "-o", out.to_str().unwrap()];
            args.extend_from_slice(extra);
            let o = kvrun(&args, None);
            let err = stderr(&o);
            assert_eq!(o.status.code(), Some(1), "{err}");
            assert_eq!(err.lines().count(), 1, "{err}");
            assert!(err.contains("is the input file"), "{err}");
        }
    }
    assert_eq!(std::fs::read_to_string(&input).unwrap(), INPUT);
    let _ = std::fs::remove_dir_all(&d);
}

/// Ctrl-C (SIGINT) while a batch runs: exit 130, the output is whole JSONL
/// lines, the summary file says what was done; `--resume` finishes and every
/// record appears exactly once.
#[test]
fn ctrl_c_stops_cleanly_and_resume_finishes() {
    let d = tmpdir("sigint");
    let input = d.join("in.jsonl");
    let n = 8;
    let text: String = (0..n)
        .map(|i| {
            format!(
                "{{\"id\": \"q{i}\", \"question\": \"Count from {i} to {}.\"}}\n",
                i + 50
            )
        })
        .collect();
    std::fs::write(&input, &text).unwrap();
    let out = d.join("out.jsonl");
    let summary = d.join("summary.json");
    let model = util::default_model();
    let args = |extra: &[&str]| {
        let mut c = Command::new(util::kvrun_bin());
        c.arg("batch")
            .args(["-m", model.to_str().unwrap(), "-t", "2"])
            .args(["--max-tokens", "48", "--ignore-eos"])
            .args(["-i", input.to_str().unwrap(), "-o", out.to_str().unwrap()])
            .args(["--summary", summary.to_str().unwrap()])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        c
    };
    let child = args(&[]).spawn().unwrap();
    // wait for the first record, then press Ctrl-C
    let t0 = std::time::Instant::now();
    while std::fs::read_to_string(&out)
        .map(|t| t.lines().count())
        .unwrap_or(0)
        == 0
    {
        assert!(t0.elapsed().as_secs() < 120, "no record written");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // SAFETY: kill(2) on the pid of a child we spawned and have not reaped.
    let rc = unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGINT) };
    assert_eq!(rc, 0);
    let o = child.wait_with_output().unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(130), "{err}");
    assert!(err.contains("interrupted"), "{err}");
    let part = std::fs::read_to_string(&out).unwrap();
    assert!(part.ends_with('\n'), "torn output: {part:?}");
    let done = records(&part);
    assert!(
        !done.is_empty() && done.len() < n,
        "{} records after Ctrl-C",
        done.len()
    );
    let s: Value = serde_json::from_str(&std::fs::read_to_string(&summary).unwrap()).unwrap();
    assert_eq!(s["interrupted"], true, "{s}");
    assert_eq!(s["processed"].as_u64().unwrap(), done.len() as u64, "{s}");
    assert_eq!(s["errors"], 0, "{s}");
    // every written record is whole (the interrupted one was not written)
    for r in &done {
        assert_eq!(r["gen_tokens"], 48, "{r}");
    }

    let o = args(&["--resume"]).output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let all = read_records(&out);
    let keys: Vec<(String, u64)> = key(&all).into_iter().map(|k| (k.0, k.1)).collect();
    let want: Vec<(String, u64)> = (0..n).map(|i| (format!("q{i}"), i as u64 + 1)).collect();
    assert_eq!(keys, want);
    let s: Value = serde_json::from_str(&std::fs::read_to_string(&summary).unwrap()).unwrap();
    assert_eq!(s["records"], n, "{s}");
    assert_eq!(s["skipped_resume"].as_u64().unwrap(), done.len() as u64);
    assert_eq!(s["interrupted"], false);
    let _ = std::fs::remove_dir_all(&d);
}

/// A budget grid without a budgeted policy (`--budgets` alone was silently
/// run as `full`) and a zero budget (every line failed the same way) are
/// refused up front; `-sys` with `--raw` is refused as in one-shot; an
/// empty prompt and a prompt field that is not a string are reported per
/// line, by what is wrong with them.
#[test]
fn grid_and_prompt_fields_are_checked() {
    let d = tmpdir("checks");
    let input = d.join("in.jsonl");
    std::fs::write(&input, INPUT).unwrap();
    let inp = input.to_str().unwrap();
    let out = d.join("out.jsonl");
    let outp = out.to_str().unwrap();
    for (extra, want) in [
        (&["--budgets", "64"][..], "--budgets"),
        (&["--policies", "full", "--budgets", "64"], "--budgets"),
        (&["--policies", "h2o", "--budgets", "0"], "at least 1"),
        (&["-sys", "be brief", "--raw"], "--raw"),
    ] {
        let mut args = vec!["-i", inp, "-o", outp];
        args.extend_from_slice(extra);
        let o = kvrun(&args, None);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{extra:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{extra:?}: {err}");
        assert!(err.contains(want), "{extra:?}: {err}");
        assert!(!out.exists(), "{extra:?}: output written");
    }
    std::fs::write(
        &input,
        concat!(
            r#"{"id": "e", "question": "  "}"#,
            "\n",
            r#"{"id": "f", "question": 5}"#,
            "\n",
            r#"{"id": "g", "problem": null, "question": "Say hi."}"#,
            "\n",
        ),
    )
    .unwrap();
    let o = kvrun(&["-i", inp, "-o", outp, "--allow-errors"], None);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("line 1: the prompt is empty"), "{err}");
    assert!(
        err.contains(r#"line 2: field "question" is not a string"#),
        "{err}"
    );
    let recs = read_records(&out);
    assert_eq!(recs.len(), 1, "{recs:?}");
    assert_eq!(recs[0]["id"], "g");
    let _ = std::fs::remove_dir_all(&d);
}

/// `batch merge` took any JSON line for a record (and wrote them out), and
/// `batch report` on a file that is not JSONL printed one error per line:
/// lines that are not records are skipped, a file of them is one error.
#[test]
fn merge_and_report_refuse_non_records() {
    let d = tmpdir("nonrec");
    let bad = d.join("bad.jsonl");
    std::fs::write(&bad, "{\"foo\":1}\n[1,2]\n").unwrap();
    let merged = d.join("m.jsonl");
    let o = Command::new(util::kvrun_bin())
        .args(["batch", "merge", bad.to_str().unwrap()])
        .args(["-o", merged.to_str().unwrap()])
        .output()
        .unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("no batch records"), "{err}");
    assert!(err.contains("line 1: skipped (not a batch record"), "{err}");
    assert!(!merged.exists(), "merge wrote {merged:?}");
    // a binary file: one line
    let model = util::default_model();
    let o = Command::new(util::kvrun_bin())
        .args(["batch", "report", model.to_str().unwrap()])
        .output()
        .unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("not a JSONL file of batch records"), "{err}");
    let _ = std::fs::remove_dir_all(&d);
}

/// `-n -1` / `--max-tokens -1` generate until end of generation or a full
/// context, as one-shot `-n -1` (batch refused it); below -1 is a one-line error.
#[test]
fn max_tokens_minus_one_runs_to_the_context() {
    let model = util::default_model();
    let m = model.to_str().unwrap();
    let input = "{\"id\": \"a\", \"prompt\": \"Say hi.\"}\n";
    for flag in ["-n", "--max-tokens"] {
        let args = ["batch", "-m", m, "-t", "2", "-c", "64", "--ignore-eos"];
        let o = run(
            &[&args[..], &[flag, "-1", "-i", "-", "-o", "-"]].concat(),
            Some(input),
        );
        assert!(o.status.success(), "{flag} -1: {}", stderr(&o));
        let recs = records(&String::from_utf8(o.stdout).unwrap());
        assert_eq!(recs.len(), 1);
        let r = &recs[0];
        assert_eq!(r["stop"], "context_full", "{r}");
        let used = r["prompt_tokens"].as_u64().unwrap() + r["gen_tokens"].as_u64().unwrap();
        assert_eq!(used, 64, "{r}");
    }
    let o = Command::new(util::kvrun_bin())
        .args(["batch", "-m", m, "-n", "-2", "-i", "-", "-o", "-"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = stderr(&o);
    assert!(!o.status.success());
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(
        err.contains(
            "-n/--max-tokens: must be -1 (until done or the context is full) or ≥ 0, got -2"
        ),
        "{err}"
    );
}
