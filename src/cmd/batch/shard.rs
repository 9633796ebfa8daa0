//! Which slice of the input this process runs: `--shard i/n` by hand, or
//! `--shard auto`, read from the scheduler that started the process.
//!
//! Line index `k` (0-based) belongs to shard `k % n`, so any shard count
//! splits any input, every shard gets lines from the whole file, and a
//! record's output does not depend on the shard it ran in.
//!
//! `--shard auto` looks, in this order, for:
//!
//! | scheduler | index | count |
//! |---|---|---|
//! | Slurm job array | (`SLURM_ARRAY_TASK_ID` − `SLURM_ARRAY_TASK_MIN`) / `SLURM_ARRAY_TASK_STEP` | `SLURM_ARRAY_TASK_COUNT` |
//! | Kubernetes Indexed Job | `JOB_COMPLETION_INDEX` | `--shards N` or `KVRUN_SHARDS` |
//! | GNU parallel | `PARALLEL_SEQ` − 1 | `--shards N` or `KVRUN_SHARDS` |
//!
//! `--shards N` (or `KVRUN_SHARDS`) overrides Slurm's count too. An array
//! must be a range (`--array=0-9`, `--array=1-20:2`): a list such as
//! `--array=1,5,7` has no index arithmetic and is refused with a message.

use crate::error::{Error, Result};

/// The environment variable that gives the shard count to `--shard auto`
/// where the scheduler does not (Kubernetes, GNU parallel).
pub const SHARDS_ENV: &str = "KVRUN_SHARDS";

/// The placeholder in `-o` / `--summary` names replaced by the shard index.
pub const PLACEHOLDER: &str = "{shard}";

/// One shard of a sharded run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    /// 0-based index, < count.
    pub index: usize,
    /// Number of shards, ≥ 1.
    pub count: usize,
    /// Where the index came from (`--shard`, `slurm`, `kubernetes`, `gnu parallel`).
    pub source: &'static str,
}

impl Shard {
    /// Whether 0-based input line `idx` is this shard's.
    pub fn owns(&self, idx: usize) -> bool {
        idx % self.count == self.index
    }
}

/// Parse `i/n` (0 ≤ i < n).
pub fn parse_fixed(s: &str) -> Result<(usize, usize)> {
    let bad = || {
        Error::arg(
            "--shard",
            format!("expected i/n with 0 <= i < n, or auto; got {s:?}"),
        )
    };
    let (i, n) = s.split_once('/').ok_or_else(bad)?;
    let (i, n): (usize, usize) = (
        i.trim().parse().map_err(|_| bad())?,
        n.trim().parse().map_err(|_| bad())?,
    );
    if n == 0 || i >= n {
        return Err(bad());
    }
    Ok((i, n))
}

/// A non-negative integer from variable `name` (None when unset or empty).
fn env_num(env: &dyn Fn(&str) -> Option<String>, name: &str) -> Result<Option<usize>> {
    match env(name) {
        None => Ok(None),
        Some(v) if v.trim().is_empty() => Ok(None),
        Some(v) => v.trim().parse().map(Some).map_err(|_| {
            Error::arg(
                "--shard",
                format!("auto: {name}={v:?} is not a non-negative integer"),
            )
        }),
    }
}

/// Resolve `--shard` / `--shards` against the environment (`env` looks a
/// variable up; the real one is [`std::env::var`]). None: no sharding.
pub fn resolve(
    shard: Option<&str>,
    shards: Option<usize>,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Option<Shard>> {
    if shards == Some(0) {
        return Err(Error::arg("--shards", "must be at least 1"));
    }
    let spec = match (shard, shards) {
        (None, None) => return Ok(None),
        // --shards alone means: the index comes from the scheduler
        (None, Some(_)) => "auto",
        (Some(s), _) => s.trim(),
    };
    if spec != "auto" {
        let (index, count) = parse_fixed(spec)?;
        if shards.is_some_and(|n| n != count) {
            return Err(Error::arg(
                "--shards",
                format!("{} disagrees with --shard {spec}", shards.unwrap_or(0)),
            ));
        }
        return Ok(Some(Shard {
            index,
            count,
            source: "--shard",
        }));
    }
    // the count given by hand (flag, then variable) wins over the scheduler's
    let given = match shards {
        Some(n) => Some(n),
        None => env_num(env, SHARDS_ENV)?,
    };
    if given == Some(0) {
        return Err(Error::arg(
            "--shard",
            format!("auto: {SHARDS_ENV} must be at least 1"),
        ));
    }
    let need_count = |who: &str| {
        Error::arg(
            "--shard",
            format!("auto: {who} gives the shard index but not the count; pass --shards N or set {SHARDS_ENV}=N"),
        )
    };
    let (index, count, source) = if let Some(id) = env_num(env, "SLURM_ARRAY_TASK_ID")? {
        let min = env_num(env, "SLURM_ARRAY_TASK_MIN")?.unwrap_or(0);
        let step = env_num(env, "SLURM_ARRAY_TASK_STEP")?.unwrap_or(1).max(1);
        let count = match given {
            Some(n) => n,
            None => env_num(env, "SLURM_ARRAY_TASK_COUNT")?
                .ok_or_else(|| need_count("SLURM_ARRAY_TASK_ID"))?,
        };
        if id < min || (id - min) % step != 0 {
            return Err(Error::arg(
                "--shard",
                format!("auto: SLURM_ARRAY_TASK_ID {id} is not min {min} + a multiple of step {step}; submit the array as a range (--array=0-N)"),
            ));
        }
        (((id - min) / step), count, "slurm")
    } else if let Some(i) = env_num(env, "JOB_COMPLETION_INDEX")? {
        let count = given.ok_or_else(|| need_count("JOB_COMPLETION_INDEX (Kubernetes)"))?;
        (i, count, "kubernetes")
    } else if let Some(seq) = env_num(env, "PARALLEL_SEQ")? {
        let count = given.ok_or_else(|| need_count("PARALLEL_SEQ (GNU parallel)"))?;
        if seq == 0 {
            return Err(Error::arg(
                "--shard",
                "auto: PARALLEL_SEQ is 1-based, got 0",
            ));
        }
        (seq - 1, count, "gnu parallel")
    } else {
        return Err(Error::arg(
            "--shard",
            "auto: no scheduler index found (SLURM_ARRAY_TASK_ID, JOB_COMPLETION_INDEX or PARALLEL_SEQ); give --shard i/n",
        ));
    };
    if count == 0 || index >= count {
        return Err(Error::arg(
            "--shard",
            format!("auto: {source} shard index {index} is not below the shard count {count}"),
        ));
    }
    Ok(Some(Shard {
        index,
        count,
        source,
    }))
}

/// `path` with `{shard}` replaced by the shard index; a placeholder without
/// sharding is an error about `flag` (every shard would write one file).
pub fn fill_path(
    path: &std::path::Path,
    shard: Option<&Shard>,
    flag: &str,
) -> Result<std::path::PathBuf> {
    let Some(s) = path.to_str() else {
        return Ok(path.to_path_buf());
    };
    if !s.contains(PLACEHOLDER) {
        return Ok(path.to_path_buf());
    }
    match shard {
        Some(sh) => Ok(s.replace(PLACEHOLDER, &sh.index.to_string()).into()),
        None => Err(Error::arg(
            flag,
            format!("{s} names a {PLACEHOLDER} but the run is not sharded (--shard)"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env_of<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }

    fn auto(vars: &[(&str, &str)], shards: Option<usize>) -> Result<Option<Shard>> {
        resolve(Some("auto"), shards, &env_of(vars))
    }

    #[test]
    fn fixed_and_none() {
        let none = env_of(&[]);
        assert_eq!(resolve(None, None, &none).unwrap(), None);
        let s = resolve(Some("2/5"), None, &none).unwrap().unwrap();
        assert_eq!((s.index, s.count), (2, 5));
        assert!(s.owns(7) && !s.owns(8));
        for bad in ["5/5", "1/0", "x", "1-3", "-1/3"] {
            assert!(resolve(Some(bad), None, &none).is_err(), "{bad}");
        }
        assert!(resolve(Some("1/3"), Some(4), &none).is_err());
        assert!(resolve(Some("1/3"), Some(3), &none).is_ok());
    }

    #[test]
    fn slurm_arrays() {
        let v = [
            ("SLURM_ARRAY_TASK_ID", "2"),
            ("SLURM_ARRAY_TASK_MIN", "0"),
            ("SLURM_ARRAY_TASK_COUNT", "3"),
        ];
        let s = auto(&v, None).unwrap().unwrap();
        assert_eq!((s.index, s.count, s.source), (2, 3, "slurm"));
        // --array=1-3: ids 1..=3 are shards 0..=2
        let v = [
            ("SLURM_ARRAY_TASK_ID", "1"),
            ("SLURM_ARRAY_TASK_MIN", "1"),
            ("SLURM_ARRAY_TASK_COUNT", "3"),
        ];
        assert_eq!(auto(&v, None).unwrap().unwrap().index, 0);
        // --array=10-18:4 → ids 10, 14, 18
        let v = [
            ("SLURM_ARRAY_TASK_ID", "18"),
            ("SLURM_ARRAY_TASK_MIN", "10"),
            ("SLURM_ARRAY_TASK_STEP", "4"),
            ("SLURM_ARRAY_TASK_COUNT", "3"),
        ];
        assert_eq!(auto(&v, None).unwrap().unwrap().index, 2);
        // a list (--array=1,5,7): 5 is not min + k·step with index < count
        let v = [
            ("SLURM_ARRAY_TASK_ID", "7"),
            ("SLURM_ARRAY_TASK_MIN", "1"),
            ("SLURM_ARRAY_TASK_COUNT", "3"),
        ];
        assert!(auto(&v, None).is_err());
        // --shards overrides the count (more shards submitted as two arrays)
        let v = [
            ("SLURM_ARRAY_TASK_ID", "4"),
            ("SLURM_ARRAY_TASK_COUNT", "3"),
        ];
        assert_eq!(auto(&v, Some(6)).unwrap().unwrap().count, 6);
        assert!(auto(&v, None).is_err());
        // Slurm wins over the others when several are set
        let v = [
            ("SLURM_ARRAY_TASK_ID", "0"),
            ("SLURM_ARRAY_TASK_COUNT", "2"),
            ("PARALLEL_SEQ", "2"),
        ];
        assert_eq!(auto(&v, None).unwrap().unwrap().source, "slurm");
    }

    #[test]
    fn kubernetes_and_parallel_need_a_count() {
        let v = [("JOB_COMPLETION_INDEX", "1")];
        assert!(auto(&v, None).is_err());
        let s = auto(&v, Some(4)).unwrap().unwrap();
        assert_eq!((s.index, s.count, s.source), (1, 4, "kubernetes"));
        let v = [("JOB_COMPLETION_INDEX", "1"), (SHARDS_ENV, "2")];
        assert_eq!(auto(&v, None).unwrap().unwrap().count, 2);
        let v = [("PARALLEL_SEQ", "3"), (SHARDS_ENV, "3")];
        let s = auto(&v, None).unwrap().unwrap();
        assert_eq!((s.index, s.count, s.source), (2, 3, "gnu parallel"));
        assert!(auto(&[("PARALLEL_SEQ", "4"), (SHARDS_ENV, "3")], None).is_err());
        assert!(auto(&[("PARALLEL_SEQ", "0"), (SHARDS_ENV, "3")], None).is_err());
        // --shards alone means auto
        let s = resolve(None, Some(3), &env_of(&[("PARALLEL_SEQ", "1")]))
            .unwrap()
            .unwrap();
        assert_eq!(s.index, 0);
    }

    #[test]
    fn auto_without_a_scheduler_or_with_garbage() {
        assert!(auto(&[], None).is_err());
        assert!(auto(&[("JOB_COMPLETION_INDEX", "x")], Some(2)).is_err());
        assert!(auto(&[("JOB_COMPLETION_INDEX", "0"), (SHARDS_ENV, "0")], None).is_err());
        assert!(resolve(None, Some(0), &env_of(&[])).is_err());
    }

    #[test]
    fn placeholders() {
        use std::path::Path;
        let sh = Shard {
            index: 3,
            count: 4,
            source: "--shard",
        };
        assert_eq!(
            fill_path(Path::new("out/r.{shard}.jsonl"), Some(&sh), "-o").unwrap(),
            Path::new("out/r.3.jsonl")
        );
        assert_eq!(
            fill_path(Path::new("r.jsonl"), None, "-o").unwrap(),
            Path::new("r.jsonl")
        );
        assert!(fill_path(Path::new("r.{shard}.jsonl"), None, "-o").is_err());
    }
}
