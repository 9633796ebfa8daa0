//! `kvrun batch`: run a JSONL file of problems through the model and grade
//! the answers; `kvrun batch merge`: combine shard outputs; `kvrun batch
//! report`: merge and tabulate accuracy per (policy, budget) point.
//!
//! ```text
//! kvrun batch -i IN.jsonl|- -o OUT.jsonl|- [model, KV, sampling flags]
//!             [--policies a,b --budgets x,y] [--template plain|boxed|r1]
//!             [--grade auto|math|gsm8k|aime|none] [--resume] [--limit N]
//!             [--shard i/n|auto [--shards N]] [--summary FILE] [--allow-errors]
//! kvrun batch merge OUT1 OUT2 ... -o MERGED
//! kvrun batch report OUT1 OUT2 ... [--out PREFIX] [--merged FILE]
//! ```
//!
//! - One output record per processed input line, in input order, each
//!   written and flushed as soon as it finishes:
//!   `{id, line, prompt_tokens, gen_tokens, output, pred, gold, correct,
//!   stop, time_s, tok_s, peak_kv_bytes, evicted, policy, budget}`.
//!   `line` is the 1-based input line number; `gold` is the answer field
//!   (for GSM8K references, the number after `####`); `pred` the extracted
//!   answer and `correct` the grade (null when not graded); `id` is the `--id-field`
//!   value (auto: `id`, `unique_id`), else the line number.
//! - A malformed line (bad JSON, no prompt field, a prompt that does not fit
//!   the context) is reported on stderr as `line N: …`, NO record is written
//!   for it, and the rest of the batch runs. The exit code is then 1 (after
//!   the rest ran) unless `--allow-errors` is given.
//! - Blank lines are skipped silently (they still count for line numbers).
//! - `--policies a,b --budgets x,y` runs every (policy, budget) point of
//!   the grid on every line (`full` once, without a budget); a missing list
//!   is `--policy` / `--kv-budget`. Each record carries its point (`policy`,
//!   `budget`); the lines are the outer loop, so an interrupted grid has
//!   every point on the same problems.
//! - `--shard i/n` keeps the lines whose 0-based line index % n == i;
//!   `--shard auto` reads i and n from Slurm, Kubernetes or GNU parallel
//!   (`shard.rs`). `{shard}` in `-o` / `--summary` becomes the index.
//!   `--limit N` processes at most N lines (after sharding and resume).
//! - Each record gets a fresh session and a sampler seeded with
//!   seed + line index, so a record's output does not depend on which
//!   other records run, or in which shard (greedy is the default).
//! - Records are keyed by (line number, id, policy, budget): two input lines
//!   that share an id are both run (with a warning). `--resume` reads the
//!   keys already in the output file and appends only the missing records. A last line
//!   without its newline (a crash mid-write) is reported and cut off first,
//!   so the file is whole JSONL lines again. Each record is one write of a
//!   whole line, flushed at once.
//! - `-i X -o X` (the same file, after resolving links) is refused.
//! - Ctrl-C stops the record being generated at the next token; that record
//!   is not written, the summary (and `--summary`) covers what was done, and
//!   the exit status is 130. `--resume` continues with that record.
//! - Progress goes to stderr only when stderr is a terminal; a summary line
//!   always goes to stderr, and `--summary FILE` writes it as JSON. After
//!   `--resume` the summary's totals cover the whole output file;
//!   `processed` counts the records of this run.

pub mod report;
pub mod shard;

use crate::cmd::args::{resolve_model, resolve_threads, KvArgs, ModelArgs};
use crate::cmd::grade::{extract_answer, grade, Kind};
use crate::cmd::prompt::prompt_tokens;
use crate::cmd::{interrupt, load_model};
use crate::error::{Error, Result};
use crate::generate::{generate, GenOptions, StopReason};
use crate::sample::Sampler;
use clap::{Args, Subcommand, ValueEnum};
use serde::Serialize;
use serde_json::{json, Map, Value};
use std::collections::{HashMap, HashSet};
use std::io::{IsTerminal, Read, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// The R1 prompt of ../shared/data/README.md (raw text, no chat template).
pub const R1_TEMPLATE: &str = "<｜begin▁of▁sentence｜><｜User｜>You are given a math problem.\n\nProblem: {problem}\n\n You need to solve the problem step by step. First, you need to provide the chain-of-thought, then provide the final answer.\n\n Provide the final answer in the format: Final answer:  \\boxed{}<｜Assistant｜><think>\n";

/// The `boxed` instruction (through the chat template).
pub const BOXED_TEMPLATE: &str =
    "Solve the following problem step by step. Put the final answer in \\boxed{}.\n\n{problem}";

/// `kvrun batch ...`: run (the flags) or `merge`.
#[derive(Args, Debug)]
#[command(args_conflicts_with_subcommands = true)]
pub struct BatchCmd {
    #[command(subcommand)]
    pub sub: Option<BatchSub>,
    #[command(flatten)]
    pub run: BatchArgs,
}

/// Subcommands of `kvrun batch`.
#[derive(Subcommand, Debug)]
pub enum BatchSub {
    /// Combine shard outputs, ordered by line number, dropping duplicate records.
    Merge(report::MergeArgs),
    /// Merge shard outputs and tabulate accuracy per (policy, budget) point
    /// (Markdown on stdout; --out PREFIX also writes .md, .csv and .svg).
    Report(report::ReportArgs),
}

/// Prompt wrapping.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Template {
    /// The prompt as is, through the model's chat template.
    Plain,
    /// "Solve … Put the final answer in \boxed{}." + the prompt, through the chat template.
    Boxed,
    /// The DeepSeek-R1 prompt (raw, ends in `<think>\n`).
    R1,
}

/// Grading mode.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum GradeMode {
    /// gsm8k if the gold answer contains ####, aime if it is all digits, else math.
    Auto,
    Math,
    Gsm8k,
    Aime,
    /// No grading (pred and correct are null).
    None,
}

/// Flags of `kvrun batch` (run mode).
#[derive(Args, Debug, Clone)]
pub struct BatchArgs {
    /// Input JSONL (`-` = stdin).
    #[arg(short = 'i', long = "input")]
    pub input: Option<PathBuf>,
    /// Output JSONL (`-` = stdout).
    #[arg(short = 'o', long = "output")]
    pub output: Option<PathBuf>,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub kv: KvArgs,
    /// Field holding the prompt (default: the first of problem, question, prompt).
    #[arg(long = "prompt-field")]
    pub prompt_field: Option<String>,
    /// Field holding the record id (default: id, unique_id; else the line number).
    #[arg(long = "id-field")]
    pub id_field: Option<String>,
    /// Field holding the gold answer (default: answer).
    #[arg(long = "answer-field")]
    pub answer_field: Option<String>,
    /// Prompt wrapping.
    #[arg(long = "template", value_enum, default_value_t = Template::Plain)]
    pub template: Template,
    /// Grading of the extracted answer against the gold answer.
    #[arg(long = "grade", value_enum, default_value_t = GradeMode::Auto)]
    pub grade: GradeMode,
    /// Tokens to generate per record at most (-1 = until end of generation
    /// or the context is full, as one-shot `-n -1`).
    #[arg(
        short = 'n',
        long = "max-tokens",
        alias = "n-predict",
        default_value_t = 1024,
        allow_negative_numbers = true
    )]
    pub max_tokens: i64,
    /// Context size in tokens (0 = the model's training context).
    #[arg(short = 'c', long = "ctx-size", default_value_t = 4096)]
    pub ctx_size: usize,
    /// Prompt processing chunk size.
    #[arg(short = 'b', long = "batch-size", default_value_t = 512)]
    pub batch_size: usize,
    /// RNG seed (-1 = random); record k uses seed + its line index.
    #[arg(
        short = 's',
        long = "seed",
        default_value_t = 0,
        allow_negative_numbers = true
    )]
    pub seed: i64,
    #[command(flatten)]
    pub sampling: crate::cmd::args::SamplingArgs,
    /// System prompt (through the chat template).
    #[arg(long = "system-prompt")]
    pub system: Option<String>,
    /// Do not use the chat template (plain / boxed templates).
    #[arg(long = "raw")]
    pub raw: bool,
    /// Keep generating past end-of-generation tokens.
    #[arg(long = "ignore-eos")]
    pub ignore_eos: bool,
    /// Skip records (line number + id) already in the output file and append the rest.
    #[arg(long = "resume")]
    pub resume: bool,
    /// Exit 0 even when some lines failed (they are still reported).
    #[arg(long = "allow-errors")]
    pub allow_errors: bool,
    /// Process at most N lines.
    #[arg(long = "limit")]
    pub limit: Option<usize>,
    /// Process only lines with index % n == i: `i/n`, or `auto` (from
    /// Slurm array, Kubernetes Indexed Job or GNU parallel variables).
    #[arg(long = "shard", value_name = "i/n|auto")]
    pub shard: Option<String>,
    /// Shard count for --shard auto where the scheduler does not give it
    /// (Kubernetes, GNU parallel; env KVRUN_SHARDS); alone, implies --shard auto.
    #[arg(long = "shards", value_name = "N")]
    pub shards: Option<usize>,
    /// Run a grid: every policy of this list (comma-separated) at every budget of --budgets.
    #[arg(long = "policies", value_delimiter = ',', conflicts_with = "policy")]
    pub policies: Vec<String>,
    /// Run a grid: every budget of this list (comma-separated) for every policy of --policies.
    #[arg(long = "budgets", value_delimiter = ',', conflicts_with = "kv_budget")]
    pub budgets: Vec<usize>,
    /// Write the summary as JSON to this file.
    #[arg(long = "summary")]
    pub summary: Option<PathBuf>,
}

/// Run `kvrun batch` (or its `merge`).
pub fn run_batch(cmd: &BatchCmd) -> Result<()> {
    match &cmd.sub {
        Some(BatchSub::Merge(m)) => report::run_merge(m),
        Some(BatchSub::Report(r)) => report::run_report(r),
        None => run_records(&cmd.run),
    }
}

fn io_err(path: impl AsRef<Path>, source: std::io::Error) -> Error {
    Error::Io {
        path: path.as_ref().to_path_buf(),
        source,
    }
}

/// The id of a record as a comparable key (strings as is, other JSON as text).
pub fn id_key(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Auto grading kind from the gold answer.
pub fn auto_kind(gold: &str) -> Kind {
    let g = gold.trim();
    if g.contains("####") {
        Kind::Gsm8k
    } else if !g.is_empty() && g.chars().all(|c| c.is_ascii_digit()) {
        Kind::Aime
    } else {
        Kind::Math
    }
}

fn stop_name(s: StopReason) -> &'static str {
    match s {
        StopReason::Eog => "eog",
        StopReason::Length => "length",
        StopReason::ContextFull => "context_full",
        StopReason::Cancelled => "cancelled",
    }
}

/// Read all of a file (or stdin for `-`) as raw lines.
/// `-`: stdin or stdout rather than a file.
fn is_std(p: &Path) -> bool {
    p.as_os_str() == "-"
}

fn read_lines(path: &Path) -> Result<Vec<Vec<u8>>> {
    let mut buf = Vec::new();
    if is_std(path) {
        std::io::stdin()
            .lock()
            .read_to_end(&mut buf)
            .map_err(|e| io_err("<stdin>", e))?;
    } else {
        buf = std::fs::read(path).map_err(|e| io_err(path, e))?;
    }
    let mut lines: Vec<Vec<u8>> = buf
        .split(|&b| b == b'\n')
        .map(|l| l.strip_suffix(b"\r").unwrap_or(l).to_vec())
        .collect();
    if lines.last().is_some_and(|l| l.is_empty()) {
        lines.pop();
    }
    Ok(lines)
}

fn str_field(obj: &Map<String, Value>, k: &str) -> Option<String> {
    match obj.get(k)? {
        Value::String(s) => Some(s.clone()),
        Value::Null => None,
        Value::Number(n) => Some(n.to_string()),
        Value::Bool(b) => Some(b.to_string()),
        other => Some(other.to_string()),
    }
}

/// One output record (field order as written).
#[derive(Serialize, Debug)]
pub struct Record {
    pub id: Value,
    pub line: usize,
    pub prompt_tokens: usize,
    pub gen_tokens: usize,
    pub output: String,
    pub pred: Option<String>,
    pub gold: Option<String>,
    pub correct: Option<bool>,
    pub stop: &'static str,
    pub time_s: f64,
    pub tok_s: f64,
    pub peak_kv_bytes: usize,
    pub evicted: usize,
    pub policy: String,
    pub budget: Option<usize>,
}

/// One parsed input record.
#[derive(Debug)]
pub struct Item {
    /// Input line, 0-based.
    pub idx: usize,
    /// The record's id (the line number when it has none).
    pub id: Value,
    /// The prompt text.
    pub prompt: String,
    /// The reference answer, when the record has one.
    pub gold: Option<String>,
}

/// Parse one input line (its bytes, `idx` 0-based) into a record, or say in
/// a few words why it is not one (the line is then reported and skipped).
pub fn parse_item(a: &BatchArgs, idx: usize, raw: &[u8]) -> std::result::Result<Item, String> {
    let text = std::str::from_utf8(raw)
        .map_err(|e| format!("not valid UTF-8 (byte {})", e.valid_up_to()))?;
    let v: Value = serde_json::from_str(text).map_err(|e| format!("bad JSON: {e}"))?;
    let Value::Object(obj) = v else {
        return Err("not a JSON object".into());
    };
    let prompt =
        match &a.prompt_field {
            Some(f) => match obj.get(f) {
                Some(Value::String(s)) => s.clone(),
                Some(_) => return Err(format!("field {f:?} is not a string")),
                None => return Err(format!("no prompt field {f:?}")),
            },
            // the first of these fields the record has (not null) is its prompt
            None => match ["problem", "question", "prompt"]
                .iter()
                .find_map(|k| obj.get(*k).filter(|v| !v.is_null()).map(|v| (k, v)))
            {
                Some((_, Value::String(s))) => s.clone(),
                Some((k, _)) => return Err(format!("field {k:?} is not a string")),
                None => return Err(
                    "no prompt field (looked for problem, question, prompt; use --prompt-field)"
                        .to_string(),
                ),
            },
        };
    // as one-shot refuses `-p ""`
    if prompt.trim().is_empty() {
        return Err("the prompt is empty".into());
    }
    let id = match &a.id_field {
        Some(f) => obj
            .get(f)
            .filter(|v| !v.is_null())
            .cloned()
            .ok_or_else(|| format!("no id field {f:?}"))?,
        None => ["id", "unique_id"]
            .iter()
            .find_map(|k| obj.get(*k).filter(|v| !v.is_null()).cloned())
            .unwrap_or_else(|| json!(idx + 1)),
    };
    let gold = str_field(&obj, a.answer_field.as_deref().unwrap_or("answer"));
    Ok(Item {
        idx,
        id,
        prompt,
        gold,
    })
}

/// What one batch run (or an earlier run's output file) adds up to.
#[derive(Debug, Default, Clone, Copy)]
struct Totals {
    records: usize,
    graded: usize,
    correct: usize,
    prompt_tokens: usize,
    gen_tokens: usize,
    time_s: f64,
    gen_s: f64,
    peak_kv: usize,
    evicted: usize,
}

impl Totals {
    fn add(&mut self, o: &Totals) {
        self.records += o.records;
        self.graded += o.graded;
        self.correct += o.correct;
        self.prompt_tokens += o.prompt_tokens;
        self.gen_tokens += o.gen_tokens;
        self.time_s += o.time_s;
        self.gen_s += o.gen_s;
        self.peak_kv = self.peak_kv.max(o.peak_kv);
        self.evicted += o.evicted;
    }
}

/// A (policy, budget) point of a run; the budget as applied (None: `full`).
pub type PointKey = (String, Option<usize>);

/// The key a record is known by: its 1-based input line, its id and its point.
pub type Key = (usize, String, PointKey);

/// The key of an output record (None when it lacks `line` or `id`); a
/// record without `policy` / `budget` (an older file) is `full` / none.
pub fn record_key(v: &Value) -> Option<Key> {
    let line = v.get("line")?.as_u64()? as usize;
    let id = id_key(v.get("id")?);
    let policy = v
        .get("policy")
        .and_then(Value::as_str)
        .unwrap_or("full")
        .to_owned();
    let budget = v.get("budget").and_then(Value::as_u64).map(|b| b as usize);
    Some((line, id, (policy, budget)))
}

/// "snapkv@512", or "full".
pub fn point_name(p: &PointKey) -> String {
    match p.1 {
        Some(b) => format!("{}@{b}", p.0),
        None => p.0.clone(),
    }
}

/// An existing output file, as `--resume` finds it.
#[derive(Debug, Default)]
struct Existing {
    /// Keys of the records already written.
    keys: HashSet<Key>,
    /// Their totals per point (for a summary over the whole file).
    totals: HashMap<PointKey, Totals>,
    /// Length of the whole lines; bytes after it are a torn last line.
    whole_len: u64,
    /// Length of the file.
    file_len: u64,
}

/// Read an output file for `--resume`: the keys and totals of its records.
/// Complete lines that are not records are reported and ignored; an
/// unterminated last line is left for [`cut_torn_tail`] to remove.
fn scan_output(path: &Path) -> Result<Existing> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Existing::default()),
        Err(e) => return Err(io_err(path, e)),
    };
    let whole_len = bytes.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
    let mut ex = Existing {
        whole_len: whole_len as u64,
        file_len: bytes.len() as u64,
        ..Existing::default()
    };
    for (i, l) in bytes[..whole_len].split(|&b| b == b'\n').enumerate() {
        if l.iter().all(|b| b.is_ascii_whitespace()) {
            continue;
        }
        let rec = serde_json::from_slice::<Value>(l).ok();
        let key = rec.as_ref().and_then(record_key);
        let (Some(v), Some(key)) = (rec, key) else {
            eprintln!(
                "kvrun batch: {}: line {} is not a batch record (ignored)",
                path.display(),
                i + 1
            );
            continue;
        };
        let t = ex.totals.entry(key.2.clone()).or_default();
        let num = |f: &str| v.get(f).and_then(Value::as_f64).unwrap_or(0.0);
        t.records += 1;
        if let Some(c) = v.get("correct").and_then(Value::as_bool) {
            t.graded += 1;
            t.correct += c as usize;
        }
        t.prompt_tokens += num("prompt_tokens") as usize;
        t.gen_tokens += num("gen_tokens") as usize;
        t.time_s += num("time_s");
        let tok_s = num("tok_s");
        if tok_s > 0.0 {
            t.gen_s += num("gen_tokens") / tok_s;
        }
        t.peak_kv = t.peak_kv.max(num("peak_kv_bytes") as usize);
        t.evicted += num("evicted") as usize;
        ex.keys.insert(key);
    }
    Ok(ex)
}

/// Cut an unterminated last line (a write torn by a crash) off the output,
/// so the file is whole JSONL lines before records are appended.
fn cut_torn_tail(path: &Path, ex: &Existing) -> Result<()> {
    if ex.file_len == ex.whole_len {
        return Ok(());
    }
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(|e| io_err(path, e))?;
    f.set_len(ex.whole_len).map_err(|e| io_err(path, e))?;
    eprintln!(
        "kvrun batch: {}: removed a truncated last line ({} bytes, an interrupted write); its record runs again",
        path.display(),
        ex.file_len - ex.whole_len
    );
    Ok(())
}

/// Refuse `-i X -o X`: the output would overwrite (or append to) the input.
fn check_distinct(input: &Path, output: &Path) -> Result<()> {
    if is_std(input) || is_std(output) {
        return Ok(());
    }
    let (Ok(i), Ok(o)) = (std::fs::canonicalize(input), std::fs::canonicalize(output)) else {
        // a missing output cannot be the input; a missing input fails later
        return Ok(());
    };
    if i == o {
        return Err(Error::arg(
            "-o/--output",
            format!(
                "{} is the input file; write the records to another file",
                output.display()
            ),
        ));
    }
    Ok(())
}

/// "3, 7, 9" (at most 10 numbers, then "…").
fn line_list(lines: &[usize]) -> String {
    let mut s: Vec<String> = lines.iter().take(10).map(|l| l.to_string()).collect();
    if lines.len() > 10 {
        s.push("…".into());
    }
    s.join(", ")
}

/// The KV settings of every grid point, in grid order (policies outer,
/// budgets inner; `full` once, without a budget). Without `--policies` /
/// `--budgets` the grid is the one point `--policy` / `--kv-budget`.
pub fn grid(a: &BatchArgs) -> Result<Vec<KvArgs>> {
    let policies: Vec<String> = if a.policies.is_empty() {
        vec![a.kv.policy.clone()]
    } else {
        a.policies
            .iter()
            .map(|p| p.trim().to_owned())
            .filter(|p| !p.is_empty())
            .collect()
    };
    if policies.is_empty() {
        return Err(Error::arg("--policies", "no policy given"));
    }
    let budgets: Vec<Option<usize>> = if a.budgets.is_empty() {
        vec![a.kv.kv_budget]
    } else {
        a.budgets.iter().map(|&b| Some(b)).collect()
    };
    if !a.budgets.is_empty() {
        // `full` keeps every token: a budget grid over it alone would be
        // silently ignored (as --kv-budget with --policy full is refused)
        if policies.iter().all(|p| p == "full") {
            return Err(Error::arg(
                "--budgets",
                "a budget applies to an eviction policy, and only full was given: add --policies a,b (or --policy P)",
            ));
        }
        if a.budgets.contains(&0) {
            return Err(Error::arg(
                "--budgets",
                "every budget must be at least 1, got 0",
            ));
        }
    }
    let mut out: Vec<KvArgs> = Vec::new();
    let known = crate::policy::names();
    for p in &policies {
        if !a.policies.is_empty() {
            if !known.contains(&p.as_str()) {
                return Err(Error::arg(
                    "--policies",
                    format!("unknown policy '{p}' (known: {})", known.join(", ")),
                ));
            }
            if p != "full" && budgets == [None] {
                return Err(Error::arg(
                    "--budgets",
                    format!("--policies {p} needs a budget: --budgets N[,M...] (or --kv-budget N)"),
                ));
            }
        }
        for &b in &budgets {
            let budget = if p == "full" { None } else { b };
            if out.iter().any(|k| k.policy == *p && k.kv_budget == budget) {
                continue;
            }
            out.push(KvArgs {
                policy: p.clone(),
                kv_budget: budget,
                ..a.kv.clone()
            });
        }
    }
    Ok(out)
}

/// What a record's generation needs besides its item and its point.
struct RunCtx<'a, 'w> {
    a: &'a BatchArgs,
    w: &'w crate::model::Weights<'w>,
    tok: &'a crate::tokenizer::Tokenizer,
    tmpl: Option<&'a crate::chat::ChatTemplate>,
    path: &'a Path,
    n_ctx: usize,
    n_threads: usize,
}

/// Generate and grade one record at one point.
fn run_one(
    c: &RunCtx<'_, '_>,
    item: &Item,
    kv: &KvArgs,
    budget: Option<usize>,
    seed: u64,
) -> Result<Record> {
    let a = c.a;
    let tok = c.tok;
    let ids = match a.template {
        Template::R1 => tok.encode(&R1_TEMPLATE.replace("{problem}", &item.prompt), false, true)?,
        Template::Plain => prompt_tokens(tok, c.tmpl, &item.prompt, a.system.as_deref(), a.raw)?,
        Template::Boxed => {
            let p = BOXED_TEMPLATE.replace("{problem}", &item.prompt);
            prompt_tokens(tok, c.tmpl, &p, a.system.as_deref(), a.raw)?
        }
    };
    if ids.len() >= c.n_ctx {
        return Err(Error::ContextTooSmall {
            n_prompt: ids.len(),
            n_ctx: c.n_ctx,
        });
    }
    let mut sampler = Sampler::new(a.sampling.config(0.0, seed));
    let mut sess = kv.session(
        c.w,
        seed,
        c.path,
        c.n_ctx,
        c.n_threads,
        a.batch_size,
        ids.len(),
    )?;
    let mut text = String::new();
    let opts = GenOptions {
        n_predict: a.max_tokens,
        ignore_eos: a.ignore_eos,
    };
    // Ctrl-C stops this record at the next token
    let st = generate(&mut sess, tok, &mut sampler, &ids, &opts, |piece| {
        text.push_str(piece);
        !interrupt::requested()
    })?;
    // a record cut short by Ctrl-C is not written: --resume reruns it
    interrupt::check()?;
    let kind = match (a.grade, item.gold.as_deref()) {
        (GradeMode::None, _) | (_, None) => None,
        (GradeMode::Auto, Some(g)) => Some(auto_kind(g)),
        (GradeMode::Math, _) => Some(Kind::Math),
        (GradeMode::Gsm8k, _) => Some(Kind::Gsm8k),
        (GradeMode::Aime, _) => Some(Kind::Aime),
    };
    let pred = kind.and_then(|k| extract_answer(&text, k));
    // GSM8K references are reduced to their final number
    let gold = match (kind, &item.gold) {
        (Some(Kind::Gsm8k), Some(g)) if g.contains("####") => {
            crate::cmd::grade::extract_gsm8k(g).or_else(|| item.gold.clone())
        }
        _ => item.gold.clone(),
    };
    let correct = match (kind, &item.gold) {
        (Some(k), Some(g)) => Some(pred.as_deref().is_some_and(|p| grade(p, g, k))),
        _ => None,
    };
    let tok_s = if st.gen_ms > 0.0 {
        st.n_gen as f64 * 1e3 / st.gen_ms
    } else {
        0.0
    };
    Ok(Record {
        id: item.id.clone(),
        line: item.idx + 1,
        prompt_tokens: st.n_prompt,
        gen_tokens: st.n_gen,
        output: text,
        pred,
        gold,
        correct,
        stop: stop_name(st.stop),
        time_s: st.total_ms / 1e3,
        tok_s,
        peak_kv_bytes: sess.kv.peak_bytes(),
        evicted: sess.n_evicted,
        policy: kv.policy.clone(),
        budget,
    })
}

impl Totals {
    fn add_record(&mut self, rec: &Record) {
        self.records += 1;
        if let Some(c) = rec.correct {
            self.graded += 1;
            self.correct += c as usize;
        }
        self.prompt_tokens += rec.prompt_tokens;
        self.gen_tokens += rec.gen_tokens;
        self.time_s += rec.time_s;
        if rec.tok_s > 0.0 {
            self.gen_s += rec.gen_tokens as f64 / rec.tok_s;
        }
        self.peak_kv = self.peak_kv.max(rec.peak_kv_bytes);
        self.evicted += rec.evicted;
    }

    fn accuracy(&self) -> f64 {
        if self.graded > 0 {
            self.correct as f64 / self.graded as f64
        } else {
            0.0
        }
    }

    fn tok_s(&self) -> f64 {
        if self.gen_s > 0.0 {
            self.gen_tokens as f64 / self.gen_s
        } else {
            0.0
        }
    }
}

fn run_records(a: &BatchArgs) -> Result<()> {
    let shard = shard::resolve(a.shard.as_deref(), a.shards, &|k| std::env::var(k).ok())?;
    let input = a
        .input
        .as_deref()
        .ok_or_else(|| Error::arg("-i/--input", "no input given (-i FILE.jsonl or -i -)"))?;
    let output = a
        .output
        .as_deref()
        .ok_or_else(|| Error::arg("-o/--output", "no output given (-o FILE.jsonl or -o -)"))?;
    let output = &shard::fill_path(output, shard.as_ref(), "-o/--output")?;
    let summary_path = a
        .summary
        .as_deref()
        .map(|p| shard::fill_path(p, shard.as_ref(), "--summary"))
        .transpose()?;
    if a.resume && is_std(output) {
        return Err(Error::arg("--resume", "needs an output file, not stdout"));
    }
    check_distinct(input, output)?;
    if a.raw && a.system.is_some() {
        // as one-shot refuses it: the system prompt would be dropped
        return Err(Error::arg(
            "-sys/--system-prompt",
            "a system prompt goes through the chat template, which --raw turns off (drop one of them)",
        ));
    }
    // from here on Ctrl-C asks the loop to stop (while the model loads too)
    interrupt::install();
    interrupt::set_mode(interrupt::Mode::Busy);
    if a.batch_size == 0 {
        return Err(Error::arg("-b/--batch-size", "must be at least 1"));
    }
    if a.max_tokens < -1 {
        return Err(Error::arg(
            "-n/--max-tokens",
            format!(
                "must be -1 (until done or the context is full) or ≥ 0, got {}",
                a.max_tokens
            ),
        ));
    }
    a.sampling.check()?;
    let grid = grid(a)?;
    let n_threads = resolve_threads(a.model.threads)?;
    let seed = crate::cmd::args::resolve_seed(a.seed);
    // validate every point's KV flags before loading anything
    let path = resolve_model(&a.model.model)?;
    for kv in &grid {
        kv.check()?;
        kv.build(seed, &path)?;
    }
    if let Some(sh) = &shard {
        if sh.source != "--shard" {
            eprintln!(
                "kvrun batch: shard {}/{} (from {})",
                sh.index, sh.count, sh.source
            );
        }
    }
    let lines = read_lines(input)?;
    let existing = if a.resume {
        scan_output(output)?
    } else {
        Existing::default()
    };

    let t_wall = Instant::now();
    let model = load_model(&a.model)?;
    let (w, tok) = (model.weights(), &model.tokenizer);
    let tmpl = if a.raw {
        None
    } else {
        a.model.chat_template(&model)?
    };
    let n_ctx = if a.ctx_size == 0 {
        w.config.n_ctx_train
    } else {
        a.ctx_size
    };
    crate::cmd::args::check_ctx_alloc(&w.config, n_ctx, n_threads)?;
    // the points as applied: a budget beyond the context is the context
    let mut points: Vec<(KvArgs, PointKey)> = Vec::new();
    for kv in grid {
        crate::cmd::args::context_notes(&w.config, n_ctx, &kv, true);
        let key = (kv.policy.clone(), kv.kv_budget.map(|b| b.min(n_ctx.max(1))));
        if points.iter().any(|(_, k)| *k == key) {
            eprintln!(
                "kvrun batch: {} is the same point as an earlier one once clamped to the context (-c {n_ctx}); run once",
                point_name(&(kv.policy.clone(), kv.kv_budget))
            );
            continue;
        }
        points.push((kv, key));
    }

    let mut out: Box<dyn Write> = if is_std(output) {
        Box::new(std::io::stdout())
    } else {
        if a.resume {
            cut_torn_tail(output, &existing)?;
        }
        let f = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .append(a.resume)
            .truncate(!a.resume)
            .open(output)
            .map_err(|e| io_err(output, e))?;
        Box::new(f)
    };

    // select the lines: shard, blank, resume, limit (parse errors are
    // counted when reached); each line keeps the points it still lacks
    type Todo = (usize, std::result::Result<Item, String>, Vec<usize>);
    let mut todo: Vec<Todo> = Vec::new();
    let mut n_resumed = 0usize;
    let mut first_line_of: HashMap<String, usize> = HashMap::new();
    for (idx, raw) in lines.iter().enumerate() {
        if shard.is_some_and(|sh| !sh.owns(idx)) {
            continue;
        }
        if raw.iter().all(|b| b.is_ascii_whitespace()) {
            continue;
        }
        let item = parse_item(a, idx, raw);
        let mut want: Vec<usize> = (0..points.len()).collect();
        if let Ok(it) = &item {
            let id = id_key(&it.id);
            match first_line_of.get(&id) {
                Some(first) => eprintln!(
                    "line {}: warning: id {id:?} is also on line {first}; records are kept apart by line number",
                    idx + 1
                ),
                None => {
                    first_line_of.insert(id.clone(), idx + 1);
                }
            }
            want.retain(|&p| {
                let done = existing
                    .keys
                    .contains(&(idx + 1, id.clone(), points[p].1.clone()));
                n_resumed += done as usize;
                !done
            });
            if want.is_empty() {
                continue;
            }
        }
        if a.limit.is_some_and(|l| todo.len() >= l) {
            continue;
        }
        todo.push((idx, item, want));
    }

    let ctx = RunCtx {
        a,
        w,
        tok,
        tmpl: tmpl.as_ref(),
        path: &path,
        n_ctx,
        n_threads,
    };
    let progress = std::io::stderr().is_terminal();
    let mut run: HashMap<PointKey, Totals> = HashMap::new();
    let mut err_lines: Vec<usize> = Vec::new();
    let mut interrupted = false;
    let n_todo = todo.len();
    'lines: for (k, (idx, item, want)) in todo.into_iter().enumerate() {
        let line_no = idx + 1;
        let item = match item {
            Ok(it) => it,
            Err(msg) => {
                eprintln!("line {line_no}: {msg}");
                err_lines.push(line_no);
                continue;
            }
        };
        for p in want {
            if interrupt::requested() {
                interrupted = true;
                break 'lines;
            }
            let (kv, key) = &points[p];
            if progress {
                eprint!(
                    "\r[{}/{}] line {} id {} {} ...",
                    k + 1,
                    n_todo,
                    line_no,
                    id_key(&item.id),
                    point_name(key)
                );
            }
            match run_one(&ctx, &item, kv, key.1, seed.wrapping_add(item.idx as u64)) {
                Ok(rec) => {
                    // one write of the whole line, flushed: a crash leaves at
                    // most one torn last line, which --resume cuts off
                    let mut s =
                        serde_json::to_string(&rec).map_err(|e| Error::Other(e.to_string()))?;
                    s.push('\n');
                    out.write_all(s.as_bytes())
                        .and_then(|_| out.flush())
                        .map_err(|e| io_err(output, e))?;
                    run.entry(key.clone()).or_default().add_record(&rec);
                }
                Err(Error::Interrupted) => {
                    interrupted = true;
                    break 'lines;
                }
                Err(e) => {
                    if progress {
                        eprint!("\r\x1b[K");
                    }
                    let at = if points.len() > 1 {
                        format!(" ({})", point_name(key))
                    } else {
                        String::new()
                    };
                    eprintln!("line {line_no}{at}: {e}");
                    // a line fails once however many points it fails at
                    if err_lines.last() != Some(&line_no) {
                        err_lines.push(line_no);
                    }
                }
            }
        }
    }
    if progress {
        eprint!("\r\x1b[K");
    }
    // the summary covers the whole output file: earlier runs and this one
    let keys: Vec<&PointKey> = points.iter().map(|(_, k)| k).collect();
    let per_point: Vec<(PointKey, Totals)> = keys
        .iter()
        .map(|&k| {
            let mut t = existing.totals.get(k).copied().unwrap_or_default();
            if let Some(r) = run.get(k) {
                t.add(r);
            }
            (k.clone(), t)
        })
        .collect();
    let mut all = Totals::default();
    for (_, t) in &per_point {
        all.add(t);
    }
    let mut this_run = Totals::default();
    for t in run.values() {
        this_run.add(t);
    }
    let wall_s = t_wall.elapsed().as_secs_f64();
    let what = if points.len() == 1 {
        let (kv, key) = &points[0];
        format!(
            "policy {} budget {}",
            kv.policy,
            key.1.map_or_else(|| "none".to_string(), |b| b.to_string())
        )
    } else {
        format!("grid of {} points", points.len())
    };
    eprintln!(
        "kvrun batch: {} done, {} errors, {n_resumed} skipped (resume){} | output {} records | accuracy {}/{} ({:.1}%) | tokens {} prompt + {} gen | time {:.2} s (wall {wall_s:.2} s) | {:.2} tok/s | peak KV {} bytes | evicted {} | {what}",
        this_run.records,
        err_lines.len(),
        if interrupted { " | interrupted" } else { "" },
        all.records,
        all.correct,
        all.graded,
        100.0 * all.accuracy(),
        all.prompt_tokens,
        all.gen_tokens,
        all.time_s,
        all.tok_s(),
        all.peak_kv,
        all.evicted,
    );
    if points.len() > 1 {
        for (k, t) in &per_point {
            eprintln!(
                "  {:<24} {:>4} records | accuracy {}/{} ({:.1}%) | {:.2} tok/s | peak KV {} bytes",
                point_name(k),
                t.records,
                t.correct,
                t.graded,
                100.0 * t.accuracy(),
                t.tok_s(),
                t.peak_kv
            );
        }
    }
    if let Some(p) = &summary_path {
        let point_json: Vec<Value> = per_point
            .iter()
            .map(|(k, t)| {
                json!({
                    "policy": k.0,
                    "budget": k.1,
                    "records": t.records,
                    "graded": t.graded,
                    "correct": t.correct,
                    "accuracy": t.accuracy(),
                    "gen_tokens": t.gen_tokens,
                    "tok_s": t.tok_s(),
                    "peak_kv_bytes": t.peak_kv,
                    "evicted": t.evicted,
                })
            })
            .collect();
        let (policy, budget) = match points.as_slice() {
            [(kv, key)] => (json!(kv.policy), json!(key.1)),
            _ => (Value::Null, Value::Null),
        };
        let s = json!({
            "input": input,
            "output": output,
            "shard": shard.map(|s| json!({"index": s.index, "count": s.count, "source": s.source})),
            "processed": this_run.records,
            "errors": err_lines.len(),
            "error_lines": err_lines,
            "skipped_resume": n_resumed,
            "interrupted": interrupted,
            "records": all.records,
            "graded": all.graded,
            "correct": all.correct,
            "accuracy": all.accuracy(),
            "prompt_tokens": all.prompt_tokens,
            "gen_tokens": all.gen_tokens,
            "time_s": all.time_s,
            "wall_s": wall_s,
            "tok_s": all.tok_s(),
            "peak_kv_bytes": all.peak_kv,
            "evicted": all.evicted,
            "policy": policy,
            "budget": budget,
            "points": point_json,
            "peak_rss_bytes": crate::cmd::bench::peak_rss_bytes(),
        });
        let text =
            serde_json::to_string_pretty(&s).map_err(|e| Error::Other(e.to_string()))? + "\n";
        std::fs::write(p, text).map_err(|source| Error::Io {
            path: p.clone(),
            source,
        })?;
    }
    if interrupted {
        return Err(Error::Interrupted);
    }
    if !err_lines.is_empty() && !a.allow_errors {
        return Err(Error::Other(format!(
            "{} line(s) failed (line {}); the other records were written (--allow-errors exits 0)",
            err_lines.len(),
            line_list(&err_lines)
        )));
    }
    Ok(())
}
