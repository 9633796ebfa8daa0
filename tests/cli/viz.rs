//! `kvrun viz`: the page's embedded data agrees with `kvrun eval sweep` run
//! on the same text, policies and budget (same evicted count, same KL, same
//! top-1 agreement), its per-token arrays agree with those totals, the page
//! loads nothing from the network, and bad flags are one-line errors.

use crate::util;

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

/// A scratch directory, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(case: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("kvrun-viz-{}-{case}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn kvrun(args: &[&str]) -> Output {
    Command::new(util::kvrun_bin())
        .args(args)
        .env_remove("KVRUN_MODEL")
        .stdin(Stdio::null())
        .output()
        .expect("spawn kvrun")
}

fn ok(args: &[&str]) -> Output {
    let out = kvrun(args);
    assert!(
        out.status.success(),
        "kvrun {args:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// The JSON object a viz page embeds.
pub(crate) fn page_data(html: &str) -> Value {
    let open = r#"<script id="kvrun-data" type="application/json">"#;
    let at = html.find(open).expect("no data script in the page") + open.len();
    let end = at + html[at..].find("</script>").expect("unclosed data script");
    serde_json::from_str(&html[at..end]).expect("the page data is JSON")
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn viz_page_matches_eval_sweep() {
    let dir = Scratch::new("sweep");
    let text = dir.0.join("text.txt");
    // a short text with an answer segment, as a reasoning trace has
    let body = util::wikitext(700);
    std::fs::write(&text, format!("{body}\n</think>\nThe answer is 42.")).unwrap();
    let model = util::default_model();
    let (budget, policies) = ("48", "window,snapkv,h2o");
    let page = dir.0.join("viz.html");
    let prefix = dir.0.join("sweep");
    let common = [
        "-m",
        s(&model),
        "-t",
        "2",
        "-f",
        s(&text),
        "--ctx",
        "0",
        "--policies",
        policies,
    ];
    let mut viz = vec!["viz"];
    viz.extend_from_slice(&common);
    viz.extend_from_slice(&["--kv-budget", budget, "-o", s(&page)]);
    ok(&viz);
    let mut sweep = vec!["eval", "sweep"];
    sweep.extend_from_slice(&common);
    sweep.extend_from_slice(&[
        "--budgets",
        budget,
        "--segment-after",
        "</think>",
        "--out",
        s(&prefix),
    ]);
    ok(&sweep);

    let html = std::fs::read_to_string(&page).unwrap();
    assert!(
        !html.contains("http://") && !html.contains("https://"),
        "the page must not load anything from the network"
    );
    let d = page_data(&html);
    let reports: Value =
        serde_json::from_str(&std::fs::read_to_string(prefix.with_extension("json")).unwrap())
            .unwrap();
    let reports = reports.as_array().unwrap();
    let pols = d["policies"].as_array().unwrap();
    assert_eq!(pols.len(), 3);
    let n = d["n_tokens"].as_u64().unwrap() as usize;
    assert_eq!(d["pieces"].as_array().unwrap().len(), n);
    assert!(d["seg_start"].as_u64().is_some(), "the answer is marked");
    for (p, r) in pols.iter().zip(reports) {
        let name = p["name"].as_str().unwrap();
        assert_eq!(name, r["policy"].as_str().unwrap());
        assert_eq!(r["n_tokens"].as_u64().unwrap() as usize, n, "{name}");
        assert_eq!(p["evicted"], r["evicted"], "{name}: evicted count");
        assert!(p["evicted"].as_u64().unwrap() > 0, "{name} evicted nothing");
        for k in ["kl", "top1"] {
            let rk = if k == "top1" { "top1_agree" } else { k };
            let (a, b) = (p[k].as_f64().unwrap(), r["all"][rk].as_f64().unwrap());
            assert!(
                (a - b).abs() <= 1e-12 * b.abs().max(1.0),
                "{name}: {k} {a} vs eval's {b}"
            );
        }
        let (a, b) = (
            p["seg_kl"].as_f64().unwrap(),
            r["segment"]["kl"].as_f64().unwrap(),
        );
        assert!((a - b).abs() <= 1e-12, "{name}: answer KL {a} vs {b}");
        // the per-token strip averages to the reported KL (4 digits each)
        let kl_tok: Vec<f64> = p["kl_tok"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        assert_eq!(kl_tok.len(), n - 1, "{name}: one KL per prediction");
        let mean = kl_tok.iter().sum::<f64>() / kl_tok.len() as f64;
        let kl = p["kl"].as_f64().unwrap();
        assert!(
            (mean - kl).abs() <= 1e-3 * kl.max(1e-6),
            "{name}: mean token KL {mean} vs {kl}"
        );
        // the eviction log holds every evicted entry
        let ev = p["ev"].as_array().unwrap();
        let gone = ev.iter().filter(|x| x.as_i64().unwrap() >= 0).count();
        let entries = p["evicted_entries"].as_u64().unwrap() as usize;
        let evicted = p["evicted"].as_u64().unwrap() as usize;
        if p["streams"].as_bool().unwrap() {
            let h = &p["heat"];
            let rows = h["rows"].as_array().unwrap();
            let n_streams = h["n_layers"].as_u64().unwrap() * h["n_kv_heads"].as_u64().unwrap();
            assert_eq!(
                rows.len() as u64,
                n_streams,
                "{name}: one heat row per stream"
            );
            assert_eq!(entries / n_streams as usize, evicted, "{name}");
        } else {
            assert_eq!(entries, evicted, "{name}");
            assert_eq!(gone, evicted, "{name}: one eviction step per evicted token");
            // a token-uniform cache ends holding exactly the budget (the
            // last token is only predicted, never fed)
            assert_eq!(d["n_fed"].as_u64().unwrap() as usize, n - 1);
            let kept = ev[..n - 1]
                .iter()
                .filter(|x| x.as_i64().unwrap() < 0)
                .count();
            assert_eq!(kept, 48, "{name}: the budget is full at the end");
        }
        // every evicted token was evicted after it arrived
        for (i, x) in ev.iter().enumerate() {
            let e = x.as_i64().unwrap();
            assert!(e < 0 || e as usize > i, "{name}: token {i} evicted at {e}");
        }
    }
}

#[test]
fn viz_bad_flags_are_one_line_errors() {
    let model = util::default_model();
    let m = s(&model);
    for (args, want) in [
        (
            vec!["viz", "-m", m, "-f", "/nonexistent/text.txt"],
            "--kv-budget",
        ),
        (
            vec!["viz", "-m", m, "--kv-budget", "64", "--policies", "nope"],
            "unknown policy 'nope'",
        ),
        (
            vec!["viz", "-m", m, "--kv-budget", "64", "--policies", "full"],
            "'full' evicts nothing",
        ),
        (
            vec!["viz", "-m", m, "--kv-budget", "4", "--policies", "h2o"],
            "cannot hold",
        ),
        (vec!["viz", "-m", m, "--kv-budget", "64"], "-f/--jsonl"),
    ] {
        let out = kvrun(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}
