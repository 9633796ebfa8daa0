//! `kvrun eval ppl`: teacher-forced fidelity of an eviction policy.
//!
//! The text is fed through two sessions in the same process: the full-cache
//! model and the model under `--policy` / `--kv-budget`, with eviction
//! applied exactly as in generation (chunks of `--chunk` tokens, eviction
//! between chunks). At every position both predict the next token; we
//! report perplexity, mean ΔNLL (policy − full, nats/token), mean
//! KL(full ‖ policy), top-1 agreement with the full cache, on the whole text
//! and on a chosen segment (`--segment-after MARKER`, `--segment-last N`):
//! whole-text fidelity is dominated by recency, while the answer after the
//! reasoning is what eviction has to preserve.

use crate::cli::{resolve_model, resolve_threads, KvArgs, ModelArgs};
use crate::error::{Error, Result};
use crate::generate::Session;
use crate::load::Checkpoint;
use crate::model::llama::Logits;
use clap::{Args, Subcommand};
use serde::Serialize;
use std::path::PathBuf;
use std::time::Instant;

/// `kvrun eval ...`
#[derive(Subcommand, Debug)]
pub enum EvalCmd {
    /// Teacher-forced perplexity / KL / top-1 agreement of a policy vs the full cache.
    Ppl(PplArgs),
    /// Sweep policies × KV budgets: CSV, JSON, an SVG plot and a markdown table.
    Sweep(crate::sweep::SweepArgs),
    /// Pass-key retrieval at several depths of a long haystack (filler or a reasoning trace).
    Passkey(crate::passkey::PasskeyArgs),
}

/// Text input shared by the evaluators.
#[derive(Args, Debug, Clone)]
pub struct TextArgs {
    /// Plain-text file.
    #[arg(short = 'f', long = "file")]
    pub file: Option<PathBuf>,
    /// JSONL file (e.g. ../shared/data/r1_traces.jsonl); see --field and --record.
    #[arg(long = "jsonl")]
    pub jsonl: Option<PathBuf>,
    /// JSONL field holding the text.
    #[arg(long = "field", default_value = "output")]
    pub field: String,
    /// Which JSONL record (0-based).
    #[arg(long = "record", default_value_t = 0)]
    pub record: usize,
}

impl TextArgs {
    /// Load the text.
    pub fn load(&self) -> Result<String> {
        match (&self.file, &self.jsonl) {
            (Some(f), None) => {
                let b = std::fs::read(f).map_err(|source| Error::Io {
                    path: f.clone(),
                    source,
                })?;
                String::from_utf8(b).map_err(|_| {
                    Error::arg("-f/--file", format!("{}: not valid UTF-8", f.display()))
                })
            }
            (None, Some(j)) => {
                let s = std::fs::read_to_string(j).map_err(|source| Error::Io {
                    path: j.clone(),
                    source,
                })?;
                let line = s
                    .lines()
                    .filter(|l| !l.trim().is_empty())
                    .nth(self.record)
                    .ok_or_else(|| {
                        Error::arg(
                            "--record",
                            format!("{} has no record {}", j.display(), self.record),
                        )
                    })?;
                let v: serde_json::Value = serde_json::from_str(line).map_err(|e| {
                    Error::arg(
                        "--jsonl",
                        format!("{} record {}: {e}", j.display(), self.record),
                    )
                })?;
                v.get(&self.field)
                    .and_then(|x| x.as_str())
                    .map(str::to_owned)
                    .ok_or_else(|| {
                        Error::arg(
                            "--field",
                            format!(
                                "{} record {} has no string field '{}'",
                                j.display(),
                                self.record,
                                self.field
                            ),
                        )
                    })
            }
            _ => Err(Error::arg(
                "-f/--jsonl",
                "give exactly one of -f TEXT or --jsonl FILE",
            )),
        }
    }
}

/// Flags of `kvrun eval ppl`.
#[derive(Args, Debug, Clone)]
pub struct PplArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub kv: KvArgs,
    #[command(flatten)]
    pub text: TextArgs,
    /// Tokens of the text to evaluate (0 = all).
    #[arg(long = "ctx", default_value_t = 2048)]
    pub ctx: usize,
    /// Tokens fed per step (1 = token by token, exactly as in decoding).
    #[arg(long = "chunk", default_value_t = 1)]
    pub chunk: usize,
    /// Also report fidelity on the tokens after the first occurrence of MARKER.
    #[arg(long = "segment-after")]
    pub segment_after: Option<String>,
    /// Also report fidelity on the last N tokens.
    #[arg(long = "segment-last")]
    pub segment_last: Option<usize>,
    /// Print one JSON object instead of text.
    #[arg(long = "json")]
    pub json: bool,
    /// Seed for seeded policies.
    #[arg(short = 's', long = "seed", default_value_t = 0)]
    pub seed: u64,
}

/// Fidelity over a set of positions.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Fidelity {
    pub n: usize,
    pub ppl: f64,
    pub ppl_full: f64,
    /// Standard error of PPL (delta method, as llama-perplexity).
    pub ppl_err: f64,
    pub delta_nll: f64,
    pub kl: f64,
    pub top1_agree: f64,
}

#[derive(Default)]
struct Acc {
    n: usize,
    nll: f64,
    nll2: f64,
    nll_full: f64,
    kl: f64,
    agree: usize,
}

impl Acc {
    fn add(&mut self, nll: f64, nll_full: f64, kl: f64, agree: bool) {
        self.n += 1;
        self.nll += nll;
        self.nll2 += nll * nll;
        self.nll_full += nll_full;
        self.kl += kl;
        self.agree += agree as usize;
    }
    fn finish(&self) -> Fidelity {
        if self.n == 0 {
            return Fidelity::default();
        }
        let n = self.n as f64;
        let mean = self.nll / n;
        let var = (self.nll2 / n - mean * mean).max(0.0);
        let ppl = mean.exp();
        Fidelity {
            n: self.n,
            ppl,
            ppl_full: (self.nll_full / n).exp(),
            ppl_err: ppl * (var / (n - 1.0).max(1.0)).sqrt(),
            delta_nll: (self.nll - self.nll_full) / n,
            kl: self.kl / n,
            top1_agree: self.agree as f64 / n,
        }
    }
}

/// Full result of one evaluation.
#[derive(Debug, Clone, Serialize)]
pub struct PplReport {
    pub policy: String,
    pub budget: Option<usize>,
    pub n_tokens: usize,
    pub all: Fidelity,
    pub segment: Option<Fidelity>,
    pub segment_start: Option<usize>,
    pub peak_kv_entries: usize,
    pub peak_kv_bytes: usize,
    pub evicted: usize,
    pub tokens_per_second: f64,
}

/// log-softmax of `l` into `out`.
fn log_softmax(l: &[f32], out: &mut Vec<f64>) {
    let m = l.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let s: f64 = l.iter().map(|&x| (x as f64 - m).exp()).sum();
    let ls = m + s.ln();
    out.clear();
    out.extend(l.iter().map(|&x| x as f64 - ls));
}

/// Run the evaluation.
pub fn eval_ppl(a: &PplArgs) -> Result<PplReport> {
    let path = resolve_model(&a.model.model)?;
    let n_threads = resolve_threads(a.model.threads)?;
    if a.chunk == 0 {
        return Err(Error::arg("--chunk", "must be at least 1"));
    }
    let text = a.text.load()?;
    let ck = Checkpoint::open(&path)?;
    let w = ck.weights()?;
    let tok = ck.tokenizer()?;
    let mut ids = tok.encode(&text, true, false)?;
    if a.ctx > 0 && ids.len() > a.ctx {
        ids.truncate(a.ctx);
    }
    if ids.len() < 2 {
        return Err(Error::arg("-f/--jsonl", "the text has fewer than 2 tokens"));
    }
    let n = ids.len();
    // segment start (index of the first predicted token inside the segment)
    let mut seg_start = None;
    if let Some(m) = &a.segment_after {
        let at = text.find(m.as_str()).ok_or_else(|| {
            Error::arg("--segment-after", format!("marker {m:?} not in the text"))
        })?;
        let prefix = tok.encode(&text[..at + m.len()], true, false)?;
        seg_start = Some(prefix.len().min(n - 1));
    }
    if let Some(k) = a.segment_last {
        let s = n.saturating_sub(k).max(1);
        seg_start = Some(seg_start.map_or(s, |x: usize| x.max(s)));
    }
    let mut full = Session::new(&w, n, n_threads, a.chunk);
    let mut pol = match a.kv.build(a.seed, &path)? {
        None => Session::new(&w, n, n_threads, a.chunk),
        Some(p) => Session::with_policy(&w, n, n_threads, a.chunk, p)?,
    };
    // the reference stays a full f16 cache: --cache-type applies to the policy run
    a.kv.configure(&mut pol)?;
    // teacher forcing has no prompt: --keep-prompt protects nothing here
    pol.protect_prompt(0);
    let vocab = w.config.vocab;
    let (mut all, mut seg) = (Acc::default(), Acc::default());
    let (mut lf, mut lp) = (Vec::new(), Vec::new());
    let t0 = Instant::now();
    let mut done = 0;
    let progress = std::io::IsTerminal::is_terminal(&std::io::stderr()) && !a.json;
    while done < n - 1 {
        let c = a.chunk.min(n - 1 - done);
        let chunk = &ids[done..done + c];
        let f = full.feed(chunk, Logits::All)?.to_vec();
        let p = pol.feed(chunk, Logits::All)?;
        for i in 0..c {
            let pos = done + i; // predicts ids[pos + 1]
            let next = ids[pos + 1] as usize;
            log_softmax(&f[i * vocab..(i + 1) * vocab], &mut lf);
            log_softmax(&p[i * vocab..(i + 1) * vocab], &mut lp);
            let kl: f64 = lf.iter().zip(&lp).map(|(&x, &y)| x.exp() * (x - y)).sum();
            let am = |v: &[f64]| {
                v.iter()
                    .enumerate()
                    .fold(0, |b, (j, &x)| if x > v[b] { j } else { b })
            };
            let agree = am(&lf) == am(&lp);
            all.add(-lp[next], -lf[next], kl.max(0.0), agree);
            if seg_start.is_some_and(|s| pos + 1 >= s) {
                seg.add(-lp[next], -lf[next], kl.max(0.0), agree);
            }
        }
        done += c;
        if progress && (done % 64 < c || done == n - 1) {
            eprint!(
                "\r[{done}/{}] {:.1} tok/s",
                n - 1,
                done as f64 / t0.elapsed().as_secs_f64()
            );
        }
    }
    if progress {
        eprintln!();
    }
    let secs = t0.elapsed().as_secs_f64();
    Ok(PplReport {
        policy: a.kv.policy.clone(),
        budget: a.kv.kv_budget,
        n_tokens: n,
        all: all.finish(),
        segment: seg_start.map(|_| seg.finish()),
        segment_start: seg_start,
        peak_kv_entries: pol.kv.peak_live,
        peak_kv_bytes: pol.kv.peak_bytes(),
        evicted: pol.n_evicted,
        tokens_per_second: (n - 1) as f64 / secs,
    })
}

/// `kvrun eval ppl` printing.
pub fn run_ppl(a: &PplArgs) -> Result<()> {
    let r = eval_ppl(a)?;
    if a.json {
        println!(
            "{}",
            serde_json::to_string(&r).map_err(|e| Error::Other(e.to_string()))?
        );
        return Ok(());
    }
    let row = |name: &str, f: &Fidelity| {
        println!(
            "{name:8} n={:6}  ppl {:9.4} (full {:9.4})  dNLL {:+.5} nats/tok  KL {:.5}  top1 {:6.2}%",
            f.n, f.ppl, f.ppl_full, f.delta_nll, f.kl, 100.0 * f.top1_agree
        )
    };
    println!(
        "policy {} budget {} | {} tokens | peak KV {} entries ({:.2} MiB) | evicted {} | {:.1} tok/s (both models)",
        r.policy,
        r.budget.map(|b| b.to_string()).unwrap_or_else(|| "none".into()),
        r.n_tokens,
        r.peak_kv_entries,
        r.peak_kv_bytes as f64 / (1 << 20) as f64,
        r.evicted,
        r.tokens_per_second
    );
    row("all", &r.all);
    if let (Some(s), Some(st)) = (&r.segment, r.segment_start) {
        row(&format!("seg@{st}"), s);
    }
    println!(
        "Final estimate: PPL = {:.4} +/- {:.5}",
        r.all.ppl, r.all.ppl_err
    );
    Ok(())
}
