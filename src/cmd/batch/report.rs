//! `kvrun batch merge` and `kvrun batch report`: put the outputs of a
//! sharded (or interrupted and resumed) run back together, and tabulate
//! accuracy per (policy, budget) point.
//!
//! Records are keyed by (line, id, policy, budget) ([`record_key`]); the
//! first record of a key wins, and a later one with a different `output`
//! is counted as a conflict (two runs of one point disagreed: a changed
//! model, seed or sampling). Records are ordered by input line, and within
//! a line in reading order, which for shard files is grid order: the merge
//! of a sharded run lists its records exactly as the unsharded run does.
//!
//! `report` also says which points lack lines the others have (a shard
//! missing, failed or still running), so a table over unequal problem sets
//! is never mistaken for a comparison.

use super::{io_err, is_std, point_name, record_key, Key, PointKey};
use crate::cmd::plot::{with_ext, Line, LinePlot, PALETTE};
use crate::error::{Error, Result};
use clap::Args;
use serde_json::Value;
use std::collections::{BTreeSet, HashMap};
use std::fmt::Write as _;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Flags of `kvrun batch merge`.
#[derive(Args, Debug, Clone)]
pub struct MergeArgs {
    /// Output files of `kvrun batch` (e.g. one per shard).
    #[arg(required = true)]
    pub inputs: Vec<PathBuf>,
    /// Merged output (`-` = stdout).
    #[arg(short = 'o', long = "output", default_value = "-")]
    pub output: PathBuf,
}

/// Flags of `kvrun batch report`.
#[derive(Args, Debug, Clone)]
pub struct ReportArgs {
    /// Output files of `kvrun batch` (e.g. one per shard; a glob expanded by the shell).
    #[arg(required = true)]
    pub inputs: Vec<PathBuf>,
    /// Also write PREFIX.md, PREFIX.csv and PREFIX.svg (accuracy vs budget per policy).
    #[arg(long = "out", value_name = "PREFIX")]
    pub out: Option<PathBuf>,
    /// Also write the merged records (as `batch merge` does) to this file.
    #[arg(long = "merged", value_name = "FILE")]
    pub merged: Option<PathBuf>,
}

/// The records of several output files, merged.
#[derive(Debug, Default)]
pub struct Merged {
    /// One record per key, ordered by line.
    pub records: Vec<Value>,
    /// Records dropped because an earlier one had their key and output.
    pub duplicates: usize,
    /// Records dropped because an earlier one had their key but another output.
    pub conflicts: usize,
}

/// Lines that are not records said one by one, at most; a file whose first
/// this many lines are all not records is refused as a whole.
const SHOWN_SKIPS: usize = 5;

/// Read and merge output files. Lines that are not records (not JSON, or
/// JSON without a record's `line` and `id`) are reported and skipped, the
/// first few of a file one by one; a file that starts with
/// [`SHOWN_SKIPS`] of them is not an output of `kvrun batch` and is an
/// error.
pub fn merge_files(paths: &[PathBuf]) -> Result<Merged> {
    let mut recs: Vec<(usize, usize, Value)> = Vec::new();
    for p in paths {
        let bytes = std::fs::read(p).map_err(|e| io_err(p, e))?;
        let (mut good, mut bad) = (0usize, 0usize);
        // the skips before the first record wait: they may be the file's
        // whole story, told in one line
        let mut held: Vec<String> = Vec::new();
        for (i, l) in bytes.split(|&b| b == b'\n').enumerate() {
            if l.iter().all(|b| b.is_ascii_whitespace()) {
                continue;
            }
            let why = match serde_json::from_slice::<Value>(l) {
                Ok(v) if record_key(&v).is_some() => {
                    let line = v
                        .get("line")
                        .and_then(Value::as_u64)
                        .map_or(usize::MAX, |x| x as usize);
                    let n = recs.len();
                    recs.push((line, n, v));
                    good += 1;
                    held.drain(..).for_each(|m| eprintln!("{m}"));
                    continue;
                }
                Ok(_) => "not a batch record (no line and id)".to_owned(),
                Err(e) => e.to_string(),
            };
            bad += 1;
            if good == 0 && bad >= SHOWN_SKIPS {
                return Err(Error::Other(format!(
                    "{}: not a JSONL file of batch records (its first {SHOWN_SKIPS} lines are not records)",
                    p.display()
                )));
            }
            if bad <= SHOWN_SKIPS {
                let m = format!("{}: line {}: skipped ({why})", p.display(), i + 1);
                if good == 0 {
                    held.push(m);
                } else {
                    eprintln!("{m}");
                }
            }
        }
        held.drain(..).for_each(|m| eprintln!("{m}"));
        if bad > SHOWN_SKIPS {
            eprintln!(
                "{}: {} more lines skipped (not batch records)",
                p.display(),
                bad - SHOWN_SKIPS
            );
        }
    }
    recs.sort_by_key(|r| (r.0, r.1));
    let mut first: HashMap<Key, usize> = HashMap::new();
    let mut m = Merged::default();
    for (_, _, v) in recs {
        if let Some(k) = record_key(&v) {
            if let Some(&at) = first.get(&k) {
                if m.records[at].get("output") == v.get("output") {
                    m.duplicates += 1;
                } else {
                    m.conflicts += 1;
                    eprintln!(
                        "kvrun batch: line {} id {} ({}): two records disagree; the first is kept",
                        k.0,
                        k.1,
                        point_name(&k.2)
                    );
                }
                continue;
            }
            first.insert(k, m.records.len());
        }
        m.records.push(v);
    }
    Ok(m)
}

fn write_out(path: &Path, text: &str) -> Result<()> {
    if is_std(path) {
        let so = std::io::stdout();
        let mut o = so.lock();
        o.write_all(text.as_bytes())
            .and_then(|_| o.flush())
            .map_err(|e| io_err("<stdout>", e))
    } else {
        std::fs::write(path, text).map_err(|e| io_err(path, e))
    }
}

fn jsonl(records: &[Value]) -> Result<String> {
    let mut text = String::new();
    for v in records {
        text.push_str(&serde_json::to_string(v).map_err(|e| Error::Other(e.to_string()))?);
        text.push('\n');
    }
    Ok(text)
}

/// The error for input files without a single record.
fn no_records(paths: &[PathBuf]) -> Error {
    Error::Other(format!(
        "no batch records in {}",
        paths
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    ))
}

/// `kvrun batch merge`.
pub fn run_merge(a: &MergeArgs) -> Result<()> {
    let m = merge_files(&a.inputs)?;
    if m.records.is_empty() {
        return Err(no_records(&a.inputs));
    }
    write_out(&a.output, &jsonl(&m.records)?)?;
    eprintln!(
        "kvrun batch merge: {} records ({} duplicates dropped{})",
        m.records.len(),
        m.duplicates,
        if m.conflicts > 0 {
            format!(", {} conflicting records dropped", m.conflicts)
        } else {
            String::new()
        }
    );
    Ok(())
}

/// The figures of one (policy, budget) point.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PointRow {
    pub policy: String,
    pub budget: Option<usize>,
    pub records: usize,
    pub graded: usize,
    pub correct: usize,
    /// correct / graded (0 when nothing was graded).
    pub accuracy: f64,
    pub mean_gen_tokens: f64,
    /// Records that stopped at the token limit (`stop: length`).
    pub truncated: usize,
    /// Generated tokens over generation time.
    pub tok_s: f64,
    pub peak_kv_bytes: u64,
    pub mean_evicted: f64,
    /// Input lines other points have and this one lacks.
    pub missing: Vec<usize>,
}

/// One row per point, in order of first appearance (policies), budgets
/// ascending within a policy.
pub fn tabulate(records: &[Value]) -> Vec<PointRow> {
    let mut order: Vec<String> = Vec::new();
    let mut rows: HashMap<PointKey, (PointRow, f64, f64, BTreeSet<usize>)> = HashMap::new();
    let mut all_lines: BTreeSet<usize> = BTreeSet::new();
    for v in records {
        let Some((line, _, key)) = record_key(v) else {
            continue;
        };
        if !order.contains(&key.0) {
            order.push(key.0.clone());
        }
        all_lines.insert(line);
        let num = |f: &str| v.get(f).and_then(Value::as_f64).unwrap_or(0.0);
        let e = rows.entry(key.clone()).or_insert_with(|| {
            (
                PointRow {
                    policy: key.0.clone(),
                    budget: key.1,
                    ..PointRow::default()
                },
                0.0,
                0.0,
                BTreeSet::new(),
            )
        });
        let (row, gen_s, evicted, lines) = e;
        row.records += 1;
        if let Some(c) = v.get("correct").and_then(Value::as_bool) {
            row.graded += 1;
            row.correct += c as usize;
        }
        row.mean_gen_tokens += num("gen_tokens");
        row.truncated += (v.get("stop").and_then(Value::as_str) == Some("length")) as usize;
        if num("tok_s") > 0.0 {
            *gen_s += num("gen_tokens") / num("tok_s");
        }
        row.peak_kv_bytes = row.peak_kv_bytes.max(num("peak_kv_bytes") as u64);
        *evicted += num("evicted");
        lines.insert(line);
    }
    let mut out: Vec<PointRow> = rows
        .into_values()
        .map(|(mut row, gen_s, evicted, lines)| {
            let n = row.records.max(1) as f64;
            row.tok_s = if gen_s > 0.0 {
                row.mean_gen_tokens / gen_s
            } else {
                0.0
            };
            row.mean_gen_tokens /= n;
            row.mean_evicted = evicted / n;
            row.accuracy = if row.graded > 0 {
                row.correct as f64 / row.graded as f64
            } else {
                0.0
            };
            row.missing = all_lines.difference(&lines).copied().collect();
            row
        })
        .collect();
    out.sort_by(|a, b| {
        let pa = order.iter().position(|p| *p == a.policy);
        let pb = order.iter().position(|p| *p == b.policy);
        (pa, a.budget).cmp(&(pb, b.budget))
    });
    out
}

fn budget_text(b: Option<usize>) -> String {
    b.map_or_else(|| "-".into(), |b| b.to_string())
}

/// The report as a Markdown table.
pub fn to_markdown(rows: &[PointRow]) -> String {
    let mut s = String::from(
        "| policy | budget | records | correct | accuracy | mean gen tokens | truncated | tok/s | peak KV MiB | mean evicted |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in rows {
        let _ = writeln!(
            s,
            "| {} | {} | {}{} | {}/{} | {:.1}% | {:.1} | {} | {:.2} | {:.2} | {:.1} |",
            r.policy,
            budget_text(r.budget),
            r.records,
            if r.missing.is_empty() { "" } else { " ⚠" },
            r.correct,
            r.graded,
            100.0 * r.accuracy,
            r.mean_gen_tokens,
            r.truncated,
            r.tok_s,
            r.peak_kv_bytes as f64 / (1 << 20) as f64,
            r.mean_evicted
        );
    }
    s
}

/// The CSV header of [`to_csv`].
pub const CSV_HEADER: &str = "policy,budget,records,graded,correct,accuracy,mean_gen_tokens,truncated,tok_s,peak_kv_bytes,mean_evicted,missing_lines";

/// The report as CSV (budget empty for `full`).
pub fn to_csv(rows: &[PointRow]) -> String {
    let mut s = format!("{CSV_HEADER}\n");
    for r in rows {
        let _ = writeln!(
            s,
            "{},{},{},{},{},{:.6},{:.3},{},{:.3},{},{:.3},{}",
            r.policy,
            r.budget.map_or_else(String::new, |b| b.to_string()),
            r.records,
            r.graded,
            r.correct,
            r.accuracy,
            r.mean_gen_tokens,
            r.truncated,
            r.tok_s,
            r.peak_kv_bytes,
            r.mean_evicted,
            r.missing.len()
        );
    }
    s
}

/// Accuracy vs budget, one line per policy; a policy without a budget
/// (`full`) is a dashed reference line across the budgets.
pub fn to_svg(rows: &[PointRow], source: &str) -> String {
    let budgets: BTreeSet<usize> = rows.iter().filter_map(|r| r.budget).collect();
    let mut policies: Vec<&str> = Vec::new();
    for r in rows {
        if !policies.contains(&r.policy.as_str()) {
            policies.push(&r.policy);
        }
    }
    let lines = policies
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let mine: Vec<&PointRow> = rows.iter().filter(|r| r.policy == *p).collect();
            let unbudgeted = mine.iter().find(|r| r.budget.is_none());
            let (pts, dashed) = match unbudgeted {
                Some(r) => (
                    budgets.iter().map(|&b| (b, 100.0 * r.accuracy)).collect(),
                    true,
                ),
                None => (
                    mine.iter()
                        .filter_map(|r| r.budget.map(|b| (b, 100.0 * r.accuracy)))
                        .collect(),
                    false,
                ),
            };
            Line {
                label: p.to_string(),
                group: p.to_string(),
                color: PALETTE[i % PALETTE.len()],
                dashed,
                pts,
            }
        })
        .collect();
    let n_records: usize = rows.iter().map(|r| r.records).sum();
    LinePlot {
        title: format!("accuracy vs KV budget — {source}"),
        subtitle: Some(format!(
            "{} points, {n_records} records; a policy without a budget is dashed",
            rows.len()
        )),
        y_label: "accuracy (%)".into(),
        y_short: "accuracy %".into(),
        // the whole scale: a few points of difference look like what they are
        y_include: vec![0.0, 100.0],
        x_marker: None,
        lines,
        log_y: false,
    }
    .svg()
}

/// `kvrun batch report`.
pub fn run_report(a: &ReportArgs) -> Result<()> {
    let m = merge_files(&a.inputs)?;
    let rows = tabulate(&m.records);
    if rows.is_empty() {
        return Err(no_records(&a.inputs));
    }
    let md = to_markdown(&rows);
    write_out(Path::new("-"), &md)?;
    let n_lines: BTreeSet<usize> = m
        .records
        .iter()
        .filter_map(|v| record_key(v).map(|k| k.0))
        .collect();
    eprintln!(
        "kvrun batch report: {} records, {} lines, {} points from {} file(s); {} duplicates dropped{}",
        m.records.len(),
        n_lines.len(),
        rows.len(),
        a.inputs.len(),
        m.duplicates,
        if m.conflicts > 0 {
            format!(", {} conflicting records dropped", m.conflicts)
        } else {
            String::new()
        }
    );
    for r in rows.iter().filter(|r| !r.missing.is_empty()) {
        let mut list: Vec<String> = r.missing.iter().take(10).map(|l| l.to_string()).collect();
        if r.missing.len() > 10 {
            list.push("…".into());
        }
        eprintln!(
            "kvrun batch report: ⚠ {} lacks {} line(s) the other points have (line {}): a shard missing, failed or still running",
            point_name(&(r.policy.clone(), r.budget)),
            r.missing.len(),
            list.join(", ")
        );
    }
    if let Some(p) = &a.merged {
        write_out(p, &jsonl(&m.records)?)?;
    }
    if let Some(prefix) = &a.out {
        let source = match a.inputs.as_slice() {
            [one] => one
                .file_name()
                .map_or_else(|| one.display().to_string(), |s| s.to_string_lossy().into()),
            many => format!("{} files", many.len()),
        };
        let paths = [
            with_ext(prefix, "md"),
            with_ext(prefix, "csv"),
            with_ext(prefix, "svg"),
        ];
        write_out(&paths[0], &md)?;
        write_out(&paths[1], &to_csv(&rows))?;
        write_out(&paths[2], &to_svg(&rows, &source))?;
        eprintln!(
            "kvrun batch report: wrote {}",
            paths
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn rec(line: usize, policy: &str, budget: Option<usize>, correct: bool, out: &str) -> Value {
        json!({"id": format!("q{line}"), "line": line, "gen_tokens": 10, "tok_s": 5.0,
               "output": out, "correct": correct, "stop": "length", "peak_kv_bytes": 1024,
               "evicted": 3, "policy": policy, "budget": budget})
    }

    #[test]
    fn tabulate_groups_points_and_flags_missing_lines() {
        let recs = vec![
            rec(1, "window", Some(256), true, "a"),
            rec(1, "window", Some(128), false, "b"),
            rec(1, "full", None, true, "c"),
            rec(2, "window", Some(128), true, "d"),
            rec(2, "full", None, true, "e"),
            rec(2, "window", Some(256), true, "f"),
            rec(3, "window", Some(128), true, "g"),
            rec(3, "full", None, false, "h"),
        ];
        let rows = tabulate(&recs);
        let pts: Vec<(String, Option<usize>)> =
            rows.iter().map(|r| (r.policy.clone(), r.budget)).collect();
        assert_eq!(
            pts,
            vec![
                ("window".into(), Some(128)),
                ("window".into(), Some(256)),
                ("full".into(), None)
            ]
        );
        assert_eq!((rows[0].correct, rows[0].graded), (2, 3));
        assert!((rows[0].accuracy - 2.0 / 3.0).abs() < 1e-12);
        assert_eq!(rows[1].missing, vec![3]);
        assert!(rows[0].missing.is_empty() && rows[2].missing.is_empty());
        assert_eq!(rows[2].truncated, 3);
        assert!((rows[2].tok_s - 5.0).abs() < 1e-9);
        let md = to_markdown(&rows);
        assert!(md.contains("| window | 256 | 2 ⚠ | 2/2 | 100.0% |"), "{md}");
        assert!(md.contains("| full | - | 3 | 2/3 | 66.7% |"), "{md}");
        let csv = to_csv(&rows);
        assert_eq!(csv.lines().count(), 4);
        assert!(csv.lines().nth(3).unwrap().starts_with("full,,3,3,2,"));
        let svg = to_svg(&rows, "x.jsonl");
        assert!(svg.contains(r#"data-policy="window""#) && svg.contains(r#"data-policy="full""#));
        // the full line is drawn at both budgets of the grid
        let full = svg.split(r#"data-policy="full""#).nth(1).unwrap();
        assert_eq!(
            full.split("</g>")
                .next()
                .unwrap()
                .matches("<circle")
                .count(),
            2
        );
    }

    #[test]
    fn merge_orders_by_line_and_drops_duplicates() {
        let d = std::env::temp_dir().join(format!("kvrun-report-unit-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let a = d.join("a.jsonl");
        let b = d.join("b.jsonl");
        let lines = |v: &[Value]| jsonl(v).unwrap();
        std::fs::write(
            &a,
            lines(&[
                rec(1, "h2o", Some(64), true, "x"),
                rec(3, "h2o", Some(64), true, "y"),
            ]),
        )
        .unwrap();
        std::fs::write(
            &b,
            lines(&[
                rec(2, "h2o", Some(64), true, "z"),
                rec(3, "h2o", Some(64), true, "y"),
                rec(1, "h2o", Some(64), true, "other"),
                rec(1, "h2o", Some(32), true, "w"),
            ]) + "not json\n",
        )
        .unwrap();
        let m = merge_files(&[a, b]).unwrap();
        let got: Vec<(u64, String)> = m
            .records
            .iter()
            .map(|v| {
                (
                    v["line"].as_u64().unwrap(),
                    v["output"].as_str().unwrap().into(),
                )
            })
            .collect();
        assert_eq!(
            got,
            vec![
                (1, "x".into()),
                (1, "w".into()),
                (2, "z".into()),
                (3, "y".into())
            ]
        );
        assert_eq!((m.duplicates, m.conflicts), (1, 1));
        let _ = std::fs::remove_dir_all(&d);
    }
}
