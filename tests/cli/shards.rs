//! Sharded batch runs add up to the single run: 12 GSM8K problems over a
//! two-point grid (window@64, full), once unsharded and once as 3 shards
//! started as separate processes at the same time — through GNU parallel's
//! variables, through a Slurm array's variables set by hand, and (where
//! Slurm is installed and this is root) through a real one-node Slurm
//! cluster running the committed array script. `batch report --merged` of
//! the shards must equal the unsharded records, record for record (greedy),
//! and the report tables must agree.

use crate::util;

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;

/// Flags every run of these tests shares (the grid and the token limit).
const RUN_FLAGS: &[&str] = &[
    "-t",
    "1",
    "-n",
    "8",
    "--policies",
    "window,full",
    "--budgets",
    "64",
];

fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kvrun-shards-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The first 12 problems of GSM8K, once per test binary.
fn problems() -> &'static Path {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| {
        let text = std::fs::read_to_string(util::shared("gsm8k_test.jsonl")).expect("gsm8k");
        let twelve: String = text.lines().take(12).map(|l| format!("{l}\n")).collect();
        let p = tmpdir("problems").join("gsm8k12.jsonl");
        std::fs::write(&p, twelve).unwrap();
        p
    })
}

fn batch_cmd(out: &Path, env: &[(&str, String)], extra: &[&str]) -> Command {
    let mut cmd = Command::new(util::kvrun_bin());
    cmd.arg("batch")
        .args(["-m", util::default_model().to_str().unwrap()])
        .args(["-i", problems().to_str().unwrap()])
        .args(["-o", out.to_str().unwrap()])
        .args(RUN_FLAGS)
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // no scheduler variables leak in from the machine running the tests
    for k in [
        "SLURM_ARRAY_TASK_ID",
        "SLURM_ARRAY_TASK_MIN",
        "SLURM_ARRAY_TASK_STEP",
        "SLURM_ARRAY_TASK_COUNT",
        "JOB_COMPLETION_INDEX",
        "PARALLEL_SEQ",
        "KVRUN_SHARDS",
    ] {
        cmd.env_remove(k);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd
}

fn check_ok(o: &Output, what: &str) {
    assert!(
        o.status.success(),
        "{what}: exit {:?}\n{}",
        o.status,
        String::from_utf8_lossy(&o.stderr)
    );
}

fn read_records(p: &Path) -> Vec<Value> {
    std::fs::read_to_string(p)
        .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).expect("JSON record"))
        .collect()
}

/// A record without its timings (the only fields that may differ between runs).
fn untimed(v: &Value) -> Value {
    let mut v = v.clone();
    let o = v.as_object_mut().unwrap();
    o.remove("time_s");
    o.remove("tok_s");
    v
}

/// The unsharded run's records, once per test binary.
fn unsharded() -> &'static [Value] {
    static R: OnceLock<Vec<Value>> = OnceLock::new();
    R.get_or_init(|| {
        let out = tmpdir("unsharded").join("all.jsonl");
        let o = batch_cmd(&out, &[], &[]).output().unwrap();
        check_ok(&o, "unsharded run");
        let recs = read_records(&out);
        assert_eq!(recs.len(), 24, "12 problems × 2 points");
        recs
    })
}

/// The report's table without the timing column, and the merged records.
fn report(files: &[PathBuf], dir: &Path) -> (Vec<String>, Vec<Value>) {
    let merged = dir.join("merged.jsonl");
    let prefix = dir.join("report");
    let o = Command::new(util::kvrun_bin())
        .args(["batch", "report"])
        .args(files)
        .args(["--merged", merged.to_str().unwrap()])
        .args(["--out", prefix.to_str().unwrap()])
        .output()
        .unwrap();
    check_ok(&o, "batch report");
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!stderr.contains('⚠'), "a point lacks lines: {stderr}");
    let csv = std::fs::read_to_string(prefix.with_extension("csv")).unwrap();
    // drop tok_s (column 9), the one figure that depends on timing
    let rows = csv
        .lines()
        .map(|l| {
            let mut c: Vec<&str> = l.split(',').collect();
            c.remove(8);
            c.join(",")
        })
        .collect();
    (rows, read_records(&merged))
}

/// Compare shard outputs with the unsharded run, record for record.
fn assert_same_as_unsharded(files: &[PathBuf], dir: &Path) {
    for f in files {
        let n = read_records(f).len();
        assert_eq!(n, 8, "{}: 4 problems × 2 points per shard", f.display());
    }
    let (rows, merged) = report(files, dir);
    let all = unsharded();
    assert_eq!(merged.len(), all.len());
    for (i, (a, b)) in all.iter().zip(&merged).enumerate() {
        assert_eq!(untimed(a), untimed(b), "record {i} differs");
    }
    let whole = dir.join("whole");
    std::fs::create_dir_all(&whole).unwrap();
    let all_path = whole.join("all.jsonl");
    let text: String = all.iter().map(|v| format!("{v}\n")).collect();
    std::fs::write(&all_path, text).unwrap();
    let (rows_all, _) = report(&[all_path], &whole);
    assert_eq!(rows, rows_all, "report of the shards vs the single run");
    assert_eq!(rows.len(), 3, "header + 2 points: {rows:?}");
}

/// Start one process per shard at once, each with its own scheduler
/// variables, and wait for them all.
fn run_shards(dir: &Path, envs: Vec<Vec<(&str, String)>>, extra: &[&str]) -> Vec<PathBuf> {
    let pattern = dir.join("records.{shard}.jsonl");
    let children: Vec<_> = envs
        .iter()
        .map(|env| batch_cmd(&pattern, env, extra).spawn().unwrap())
        .collect();
    for (i, c) in children.into_iter().enumerate() {
        let o = c.wait_with_output().unwrap();
        check_ok(&o, &format!("shard process {i}"));
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains("kvrun batch: shard "), "{err}");
    }
    (0..envs.len())
        .map(|i| dir.join(format!("records.{i}.jsonl")))
        .collect()
}

#[test]
fn gnu_parallel_shards_equal_the_unsharded_run() {
    let dir = tmpdir("parallel");
    let envs = (1..=3)
        .map(|seq| vec![("PARALLEL_SEQ", seq.to_string())])
        .collect();
    let files = run_shards(&dir, envs, &["--shard", "auto", "--shards", "3"]);
    assert_same_as_unsharded(&files, &dir);
}

#[test]
fn slurm_array_variables_shards_equal_the_unsharded_run() {
    // as Slurm sets them for `sbatch --array=1-3`
    let dir = tmpdir("slurm-vars");
    let envs = (1..=3)
        .map(|id| {
            vec![
                ("SLURM_ARRAY_TASK_ID", id.to_string()),
                ("SLURM_ARRAY_TASK_MIN", "1".to_string()),
                ("SLURM_ARRAY_TASK_COUNT", "3".to_string()),
            ]
        })
        .collect();
    let files = run_shards(&dir, envs, &["--shard", "auto"]);
    assert_same_as_unsharded(&files, &dir);
}

/// Stops the local Slurm cluster however the test ends.
struct Cluster(PathBuf);

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = Command::new("bash")
            .arg(util::root().join("examples/slurm/local-cluster.sh"))
            .arg("stop")
            .arg(&self.0)
            .status();
    }
}

fn have(cmd: &str) -> bool {
    Command::new("sh")
        .args([
            "-c",
            &format!("command -v {cmd} || test -x /usr/sbin/{cmd}"),
        ])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// The committed array script on a real one-node Slurm cluster. It needs
/// root and Debian's slurm-wlm and munge; `.ci/run` installs them, checks
/// that a cluster starts on the CI machine and then sets
/// KVRUN_REQUIRE_SLURM=1, which turns a missing Slurm into a failure
/// instead of a skip.
#[test]
fn slurm_array_script_on_a_real_cluster() {
    let required = std::env::var("KVRUN_REQUIRE_SLURM").is_ok_and(|v| v == "1");
    let root = Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0");
    if !(have("sbatch") && have("slurmctld") && have("munged") && root) {
        assert!(
            !required,
            "KVRUN_REQUIRE_SLURM=1 but slurm-wlm/munge are missing or this is not root"
        );
        eprintln!("skipped: no Slurm here (apt-get install slurm-wlm munge, as root)");
        return;
    }
    let dir = tmpdir("slurm-cluster");
    let state = dir.join("cluster");
    let script = util::root().join("examples/slurm/local-cluster.sh");
    let o = Command::new("bash")
        .arg(&script)
        .arg("start")
        .arg(&state)
        .output()
        .unwrap();
    let _guard = Cluster(state.clone());
    check_ok(&o, "local-cluster.sh start");
    let out = dir.join("results");
    let conf = state.join("slurm.conf");
    let extra = RUN_FLAGS[2..].join(" ");
    let o = Command::new("sbatch")
        .env("SLURM_CONF", &conf)
        .env(
            "PATH",
            format!("{}:/usr/sbin", std::env::var("PATH").unwrap_or_default()),
        )
        .env("MODEL", util::default_model())
        .env("INPUT", problems())
        .env("OUT", &out)
        .env("KVRUN", util::kvrun_bin())
        .env("KVRUN_ARGS", extra)
        .args(["--wait", "--array=0-2", "--cpus-per-task=1", "-D"])
        .arg(&dir)
        .arg(util::root().join("examples/slurm/kvrun-array.sbatch"))
        .output()
        .unwrap();
    let logs: String = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".log"))
        .map(|e| std::fs::read_to_string(e.path()).unwrap_or_default())
        .collect();
    assert!(
        o.status.success(),
        "sbatch --wait: {:?}\n{}{}\ntask logs:\n{logs}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(logs.contains("(from slurm)"), "task logs:\n{logs}");
    let files: Vec<PathBuf> = (0..3)
        .map(|i| out.join(format!("records.{i}.jsonl")))
        .collect();
    assert_same_as_unsharded(&files, &dir);
    for i in 0..3 {
        let s: Value = serde_json::from_str(
            &std::fs::read_to_string(out.join(format!("summary.{i}.json"))).unwrap(),
        )
        .unwrap();
        assert_eq!(s["shard"]["index"], i);
        assert_eq!(s["shard"]["source"], "slurm");
    }
}

#[test]
fn kubernetes_manifest_count_matches_completions() {
    let y =
        std::fs::read_to_string(util::root().join("examples/kubernetes/kvrun-indexed-job.yaml"))
            .unwrap();
    let field = |k: &str| {
        y.lines()
            .find_map(|l| l.trim().strip_prefix(k))
            .map(|v| v.trim().trim_matches('"').to_owned())
            .unwrap_or_else(|| panic!("no {k}"))
    };
    assert_eq!(field("completionMode:"), "Indexed");
    let completions = field("completions:");
    // KVRUN_SHARDS's value is the line after its name
    let lines: Vec<&str> = y.lines().map(str::trim).collect();
    let at = lines
        .iter()
        .position(|l| *l == "- name: KVRUN_SHARDS")
        .expect("KVRUN_SHARDS in env");
    let shards = lines[at + 1]
        .strip_prefix("value:")
        .unwrap()
        .trim()
        .trim_matches('"');
    assert_eq!(shards, completions, "KVRUN_SHARDS must equal completions");
    // the container's command: the list under `command:`
    let start = lines
        .iter()
        .position(|l| *l == "command:")
        .expect("command:")
        + 1;
    let cmd: Vec<&str> = lines[start..]
        .iter()
        .map_while(|l| l.strip_prefix("- "))
        .map(|s| s.trim_matches('"'))
        .collect();
    let pos = |f: &str| {
        cmd.iter()
            .position(|c| *c == f)
            .unwrap_or_else(|| panic!("{f}"))
    };
    assert_eq!(cmd[pos("--shard") + 1], "auto");
    assert!(cmd[pos("-o") + 1].contains("{shard}"));
    assert!(cmd.contains(&"--resume"));
    // and the flags parse: the same command with a missing scheduler index
    // fails on the index, not on a flag
    let flags: Vec<&str> = cmd[pos("batch") + 1..].to_vec();
    let o = Command::new(util::kvrun_bin())
        .arg("batch")
        .args(&flags)
        .env_remove("JOB_COMPLETION_INDEX")
        .env_remove("SLURM_ARRAY_TASK_ID")
        .env_remove("PARALLEL_SEQ")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("no scheduler index found"), "{err}");
}

#[test]
fn grid_and_shard_flag_errors() {
    let out = tmpdir("errors").join("x.jsonl");
    let cases: &[(&[&str], &str)] = &[
        (&["--shard", "auto"], "no scheduler index found"),
        (&["--shard", "3/3"], "expected i/n"),
        (&["--shards", "0"], "--shards: must be at least 1"),
        (
            &["--policies", "windo", "--budgets", "8"],
            "--policies: unknown policy 'windo'",
        ),
        (
            &["--policies", "h2o"],
            "--budgets: --policies h2o needs a budget",
        ),
        (
            &["--policies", "h2o", "--policy", "tova"],
            "cannot be used with",
        ),
    ];
    for (args, want) in cases {
        let mut cmd = Command::new(util::kvrun_bin());
        cmd.arg("batch")
            .args(["-m", util::default_model().to_str().unwrap()])
            .args([
                "-i",
                problems().to_str().unwrap(),
                "-o",
                out.to_str().unwrap(),
            ])
            .args(*args)
            .env_remove("SLURM_ARRAY_TASK_ID")
            .env_remove("JOB_COMPLETION_INDEX")
            .env_remove("PARALLEL_SEQ")
            .env_remove("KVRUN_SHARDS");
        let o = cmd.output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            matches!(o.status.code(), Some(1 | 2)),
            "{args:?}: exit {:?}: {err}",
            o.status
        );
        assert!(err.contains(want), "{args:?}: want {want:?} in {err}");
        assert_eq!(err.trim().lines().count(), 1, "{args:?}: one line: {err}");
    }
    // {shard} without sharding
    let o = Command::new(util::kvrun_bin())
        .arg("batch")
        .args(["-m", util::default_model().to_str().unwrap()])
        .args(["-i", problems().to_str().unwrap()])
        .args(["-o", "r.{shard}.jsonl"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("names a {shard} but the run is not sharded"),
        "{err}"
    );
}
