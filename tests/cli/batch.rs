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
    let mut cmd = Command::new(util::kvrun_bin());
    cmd.arg("batch")
        .args([
            "-m",
            model.to_str().unwrap(),
            "-t",
            "2",
            "--max-tokens",
            "8",
        ])
        .args(args);
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

    // full run: 3 results in order, the bad line named, exit 0
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

    // shards 0/2 and 1/2, merged, equal the unsharded run
    let s0 = d.join("s0.jsonl");
    let s1 = d.join("s1.jsonl");
    let o = kvrun(
        &["-i", inp, "-o", s0.to_str().unwrap(), "--shard", "0/2"],
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
    let o = kvrun(&["-i", "-", "-o", "-"], Some(INPUT));
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
