//! The measurement shared by `kvrun eval ppl` and `kvrun eval sweep`:
//! teacher-forced fidelity of eviction policies against the full cache.
//!
//! The text is fed through the full-cache model and through the model under
//! each policy point (`--policy` / `--kv-budget`), in the same process, with
//! eviction applied exactly as in generation (chunks of `--chunk` tokens,
//! eviction between chunks). At every position both predict the next token;
//! a [`Fidelity`] holds perplexity, mean ΔNLL (policy − full, nats/token),
//! mean KL(full ‖ policy) and top-1 agreement with the full cache, on the
//! whole text and on a chosen segment (`--segment-after MARKER`,
//! `--segment-last N`): whole-text fidelity is dominated by recency, while
//! the answer after the reasoning is what eviction has to preserve.
//!
//! The machinery is [`eval_points`], which evaluates any number of
//! (policy, budget) points against ONE full-cache reference pass, in
//! lockstep; `eval ppl` is its one-point case and `eval sweep` feeds it
//! every point of the sweep at once. Also here: the text input flags
//! ([`TextArgs`]) and the progress line ([`Progress`]).

use crate::cmd::args::KvArgs;
use crate::error::{Error, Result};
use crate::generate::{EvictionLog, Session};
use crate::model::llama::Logits;
use crate::model::Weights;
use crate::tokenizer::Tokenizer;
use clap::Args;
use serde::Serialize;
use std::io::{IsTerminal, Write as _};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

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
    /// Predicted tokens per second of the policy session's own forward
    /// passes: time is measured around its `feed` calls only (one thread;
    /// eviction included; the reference model, the comparison and waiting
    /// for the other points excluded). Points of one run are comparable with
    /// each other; it is not the wall-clock throughput of the run.
    pub tokens_per_second: f64,
    /// Resident entries per (layer, KV head) stream at the end, [layer][head]
    /// (stream policies; empty for token-uniform caches): how the budget
    /// ended up shared.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub stream_lengths: Vec<Vec<usize>>,
}

/// log-softmax of `l` into `out` (same length).
fn log_softmax(l: &[f32], out: &mut [f64]) {
    let m = l.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let s: f64 = l.iter().map(|&x| (x as f64 - m).exp()).sum();
    let ls = m + s.ln();
    for (o, &x) in out.iter_mut().zip(l) {
        *o = x as f64 - ls;
    }
}

/// Index of the first maximum.
fn argmax(v: &[f64]) -> usize {
    v.iter()
        .enumerate()
        .fold(0, |b, (j, &x)| if x > v[b] { j } else { b })
}

/// A tokenized text ready for evaluation.
#[derive(Debug, Clone)]
pub struct EvalText {
    /// Token ids (BOS first when the model adds one); at least 2.
    pub ids: Vec<u32>,
    /// Index of the first predicted token inside the segment, if any.
    pub seg_start: Option<usize>,
}

impl EvalText {
    /// Tokenize `text`, keep its first `ctx` tokens (0 = all) and locate the
    /// segment: the tokens after the first `segment_after` marker and/or the
    /// last `segment_last` tokens (the later start wins when both are given).
    pub fn new(
        tok: &Tokenizer,
        text: &str,
        ctx: usize,
        segment_after: Option<&str>,
        segment_last: Option<usize>,
    ) -> Result<EvalText> {
        if ctx == 1 {
            // one token predicts nothing
            return Err(Error::arg(
                "--ctx",
                "must be 0 (the whole text) or at least 2, got 1",
            ));
        }
        let mut ids = tok.encode(text, true, false)?;
        let n_text = ids.len();
        if ctx > 0 && ids.len() > ctx {
            ids.truncate(ctx);
        }
        if ids.len() < 2 {
            return Err(Error::arg("-f/--jsonl", "the text has fewer than 2 tokens"));
        }
        let n = ids.len();
        let mut seg_start = None;
        if let Some(m) = segment_after {
            let at = text.find(m).ok_or_else(|| {
                Error::arg("--segment-after", format!("marker {m:?} not in the text"))
            })?;
            let prefix = tok.encode(&text[..at + m.len()], true, false)?;
            // the segment is the tokens after the marker: none of them may
            // lie past the cut
            if prefix.len() >= n {
                let why = if n < n_text {
                    format!(
                        "marker {m:?} ends at token {} of the text, beyond --ctx {ctx} (raise --ctx, or 0 for the whole text)",
                        prefix.len()
                    )
                } else {
                    format!("marker {m:?} ends the text: no token follows it")
                };
                return Err(Error::arg("--segment-after", why));
            }
            seg_start = Some(prefix.len());
        }
        if let Some(k) = segment_last {
            let s = n.saturating_sub(k).max(1);
            seg_start = Some(seg_start.map_or(s, |x: usize| x.max(s)));
        }
        Ok(EvalText { ids, seg_start })
    }

    /// Number of predicted positions (tokens − 1).
    pub fn n_predicted(&self) -> usize {
        self.ids.len() - 1
    }
}

/// Settings shared by every point of one lockstep pass.
#[derive(Debug, Clone, Copy)]
pub struct Lockstep<'a> {
    /// The model file (policies may read side files next to it, e.g. EPIKV's config).
    pub model: &'a Path,
    /// Tokens fed per step.
    pub chunk: usize,
    /// Threads in all (`-t`).
    pub n_threads: usize,
    /// Seed for seeded policies.
    pub seed: u64,
}

/// The full-cache model's view of one chunk: per row, its log-softmax, the
/// probabilities and the top-1 token. Computed once per chunk and shared,
/// read-only, by every point.
#[derive(Default)]
struct Reference {
    /// (rows, vocab) log-probabilities.
    logp: Vec<f64>,
    /// (rows, vocab) probabilities, exp(logp).
    p: Vec<f64>,
    /// (rows,) arg max.
    top: Vec<usize>,
}

impl Reference {
    /// Fill from `rows` rows of logits.
    fn fill(&mut self, logits: &[f32], rows: usize, vocab: usize) {
        self.logp.resize(rows * vocab, 0.0);
        self.p.resize(rows * vocab, 0.0);
        self.top.clear();
        for i in 0..rows {
            let r = i * vocab..(i + 1) * vocab;
            log_softmax(&logits[r.clone()], &mut self.logp[r.clone()]);
            for (p, &x) in self.p[r.clone()].iter_mut().zip(&self.logp[r.clone()]) {
                *p = x.exp();
            }
            self.top.push(argmax(&self.logp[r]));
        }
    }
}

/// One (policy, budget) point of a lockstep pass: its session (one-thread
/// pool), its accumulators and scratch.
struct Point<'w> {
    s: Session<'w>,
    all: Acc,
    seg: Acc,
    /// (vocab,) log-softmax scratch.
    logp: Vec<f64>,
    /// Time spent in `s.feed`.
    busy: Duration,
    /// (n_predicted,) KL(full ‖ policy) of every prediction, when traced.
    kl: Option<Vec<f32>>,
}

/// What a traced point saw token by token (`kvrun viz`): the KL of each
/// prediction and every eviction.
#[derive(Debug, Clone, Default)]
pub struct PointTrace {
    /// (n_predicted,) KL(full ‖ policy) of the prediction made at position
    /// i (of token i + 1), nats; the mean is the report's `all.kl`.
    pub kl: Vec<f32>,
    /// Every eviction, in order.
    pub log: EvictionLog,
}

impl Point<'_> {
    /// Feed `ids[pos0..pos0 + c]` and score its predictions of
    /// `ids[pos0 + 1..=pos0 + c]` against the reference of that chunk.
    fn step(
        &mut self,
        ids: &[u32],
        pos0: usize,
        c: usize,
        r: &Reference,
        seg_start: Option<usize>,
        vocab: usize,
    ) -> Result<()> {
        let t0 = Instant::now();
        let logits = self.s.feed(&ids[pos0..pos0 + c], Logits::All)?;
        self.busy += t0.elapsed();
        for i in 0..c {
            let pos = pos0 + i; // predicts ids[pos + 1]
            let next = ids[pos + 1] as usize;
            let row = i * vocab..(i + 1) * vocab;
            log_softmax(&logits[row.clone()], &mut self.logp);
            let (lf, pf) = (&r.logp[row.clone()], &r.p[row]);
            let kl: f64 = lf
                .iter()
                .zip(pf)
                .zip(&self.logp)
                .map(|((&x, &px), &y)| px * (x - y))
                .sum();
            let agree = r.top[i] == argmax(&self.logp);
            let (nll, nll_full) = (-self.logp[next], -lf[next]);
            if let Some(t) = &mut self.kl {
                t.push(kl.max(0.0) as f32);
            }
            self.all.add(nll, nll_full, kl.max(0.0), agree);
            if seg_start.is_some_and(|s| pos + 1 >= s) {
                self.seg.add(nll, nll_full, kl.max(0.0), agree);
            }
        }
        Ok(())
    }

    fn report(&self, kv: &KvArgs, text: &EvalText) -> PplReport {
        let n = text.ids.len();
        let secs = self.busy.as_secs_f64();
        PplReport {
            policy: kv.policy.clone(),
            budget: kv.kv_budget,
            n_tokens: n,
            all: self.all.finish(),
            segment: text.seg_start.map(|_| self.seg.finish()),
            segment_start: text.seg_start,
            peak_kv_entries: self.s.kv.peak_live,
            peak_kv_bytes: self.s.kv.peak_bytes(),
            evicted: self.s.n_evicted,
            tokens_per_second: if secs > 0.0 {
                (n - 1) as f64 / secs
            } else {
                0.0
            },
            stream_lengths: match self.s.kv.streams() {
                Some(st) => (0..st.n_streams() / st.n_kv_heads.max(1))
                    .map(|l| {
                        (0..st.n_kv_heads)
                            .map(|h| st.len(l * st.n_kv_heads + h))
                            .collect()
                    })
                    .collect(),
                None => Vec::new(),
            },
        }
    }
}

/// One unit of work of a lockstep round.
enum Job<'a, 'w> {
    /// The reference feeds a chunk and fills the next round's `Reference`.
    Full {
        s: &'a mut Session<'w>,
        out: &'a mut Reference,
        pos0: usize,
        c: usize,
    },
    /// A point feeds the chunk the current `Reference` describes.
    Point(&'a mut Point<'w>),
}

/// Evaluate every point in `points` (one [`KvArgs`] each: policy, budget,
/// cache settings) on `text` in ONE pass: a full-cache reference session and
/// one session per point are fed the same chunks of `lk.chunk` tokens; the
/// reference's log-softmax of each chunk is computed once and every point's
/// logits are compared with it. Each point's figures are exactly those of
/// `kvrun eval ppl` for that point alone: sessions share nothing but the
/// weights, and each sees the same chunks and evicts as it would alone.
///
/// Threads: point sessions always run on one-thread pools, so a point's
/// eviction (attention-mass sums included) does not depend on `-t`; rounds
/// are pipelined: while the points process chunk k, the reference already
/// computes chunk k+1, and these jobs are shared dynamically by at most
/// `lk.n_threads` OS threads (`std::thread::scope`). When there are fewer
/// points than threads, the reference gets the spare threads as its own pool
/// (its logits are split by rows, identical for any thread count).
///
/// `progress(k)` is called after each round with the k tokens every point
/// has just finished. Returns one report per point, in order.
pub fn eval_points<'w>(
    w: &'w Weights<'w>,
    text: &EvalText,
    points: &[KvArgs],
    lk: Lockstep<'_>,
    progress: &mut dyn FnMut(usize),
) -> Result<Vec<PplReport>> {
    eval_points_inner(w, text, points, lk, progress, false).map(|(r, _)| r)
}

/// [`eval_points`], also returning each point's [`PointTrace`] (per-token
/// KL, every eviction). The reports are the same as without the trace:
/// recording only reads what the session already decided.
pub fn eval_points_traced<'w>(
    w: &'w Weights<'w>,
    text: &EvalText,
    points: &[KvArgs],
    lk: Lockstep<'_>,
    progress: &mut dyn FnMut(usize),
) -> Result<(Vec<PplReport>, Vec<PointTrace>)> {
    eval_points_inner(w, text, points, lk, progress, true)
}

fn eval_points_inner<'w>(
    w: &'w Weights<'w>,
    text: &EvalText,
    points: &[KvArgs],
    lk: Lockstep<'_>,
    progress: &mut dyn FnMut(usize),
    traced: bool,
) -> Result<(Vec<PplReport>, Vec<PointTrace>)> {
    if lk.chunk == 0 {
        return Err(Error::arg("--chunk", "must be at least 1"));
    }
    if points.is_empty() {
        return Err(Error::arg("--policies", "no point to evaluate"));
    }
    let ids = &text.ids;
    let n = ids.len();
    if n < 2 {
        return Err(Error::arg("-f/--jsonl", "the text has fewer than 2 tokens"));
    }
    let vocab = w.config.vocab;
    let n_threads = lk.n_threads.max(1);
    let full_threads = n_threads.saturating_sub(points.len()).max(1);
    let n_workers = (n_threads + 1 - full_threads).min(points.len() + 1);
    let mut full = Session::new(w, n, full_threads, lk.chunk);
    let mut pts = Vec::with_capacity(points.len());
    for kv in points {
        let mut s = match kv.build(lk.seed, lk.model)? {
            None => Session::new(w, n, 1, lk.chunk),
            Some(p) => Session::with_policy(w, n, 1, lk.chunk, p)?,
        };
        // the reference stays a full f16 cache: --cache-type applies to the point
        kv.configure(&mut s)?;
        // teacher forcing has no prompt: --keep-prompt protects nothing here
        s.protect_prompt(0);
        if traced {
            s.record_evictions();
        }
        pts.push(Point {
            s,
            all: Acc::default(),
            seg: Acc::default(),
            logp: vec![0.0; vocab],
            busy: Duration::ZERO,
            kl: traced.then(|| Vec::with_capacity(n - 1)),
        });
    }
    let starts: Vec<usize> = (0..n - 1).step_by(lk.chunk).collect();
    let len = |k: usize| lk.chunk.min(n - 1 - starts[k]);
    let (mut cur, mut next) = (Reference::default(), Reference::default());
    // round k: the reference feeds chunk k, the points feed chunk k − 1
    for k in 0..=starts.len() {
        let mut jobs: Vec<Job<'_, '_>> = Vec::with_capacity(pts.len() + 1);
        if k < starts.len() {
            jobs.push(Job::Full {
                s: &mut full,
                out: &mut next,
                pos0: starts[k],
                c: len(k),
            });
        }
        let prev = k.checked_sub(1).map(|j| (starts[j], len(j)));
        if prev.is_some() {
            jobs.extend(pts.iter_mut().map(Job::Point));
        }
        let cur_ref = &cur;
        let run = |job: Job<'_, '_>| -> Result<()> {
            match job {
                Job::Full { s, out, pos0, c } => {
                    let l = s.feed(&ids[pos0..pos0 + c], Logits::All)?;
                    out.fill(l, c, vocab);
                    Ok(())
                }
                Job::Point(p) => {
                    let (pos0, c) = prev.expect("points run from the second round on");
                    p.step(ids, pos0, c, cur_ref, text.seg_start, vocab)
                }
            }
        };
        run_jobs(jobs, n_workers, &run)?;
        std::mem::swap(&mut cur, &mut next);
        if let Some((_, c)) = prev {
            progress(c);
        }
    }
    let reports = pts
        .iter()
        .zip(points)
        .map(|(p, kv)| p.report(kv, text))
        .collect();
    let traces = pts
        .iter_mut()
        .filter(|p| p.kl.is_some())
        .map(|p| PointTrace {
            kl: p.kl.take().unwrap_or_default(),
            log: p.s.eviction_log().cloned().unwrap_or_default(),
        })
        .collect();
    Ok((reports, traces))
}

/// Run `jobs` on up to `n_workers` threads (the caller included), each
/// taking the next job as it becomes free; the first error wins.
fn run_jobs<'a, 'w>(
    jobs: Vec<Job<'a, 'w>>,
    n_workers: usize,
    run: &(dyn Fn(Job<'a, 'w>) -> Result<()> + Sync),
) -> Result<()> {
    let n_workers = n_workers.min(jobs.len());
    if n_workers <= 1 {
        return jobs.into_iter().try_for_each(run);
    }
    let slots: Vec<Mutex<Option<Job<'a, 'w>>>> =
        jobs.into_iter().map(|j| Mutex::new(Some(j))).collect();
    let next = AtomicUsize::new(0);
    let first_err: Mutex<Option<Error>> = Mutex::new(None);
    let work = || loop {
        let i = next.fetch_add(1, Ordering::Relaxed);
        let Some(slot) = slots.get(i) else { break };
        let job = slot.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(Err(e)) = job.map(run) {
            first_err
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get_or_insert(e);
        }
    };
    std::thread::scope(|sc| {
        for _ in 1..n_workers {
            sc.spawn(work);
        }
        work();
    });
    match first_err.into_inner().unwrap_or_else(|e| e.into_inner()) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Progress of a long evaluation on stderr: redrawn in place (tokens done /
/// total, tok/s, ETA) when stderr is a terminal; otherwise, if `lines`, one
/// plain line per 10 % so a redirected log stays readable; else silent.
#[derive(Debug)]
pub struct Progress {
    total: usize,
    done: usize,
    t0: Instant,
    tty: bool,
    lines: bool,
    drawn: bool,
    last_draw: Option<Instant>,
    next_decile: usize,
}

impl Progress {
    /// Progress over `total` tokens; `lines` enables the plain lines when
    /// stderr is not a terminal, `enabled = false` silences it altogether.
    pub fn new(total: usize, enabled: bool, lines: bool) -> Progress {
        let tty = enabled && std::io::stderr().is_terminal();
        Progress {
            total,
            done: 0,
            t0: Instant::now(),
            tty,
            lines: enabled && lines && !tty,
            drawn: false,
            last_draw: None,
            next_decile: 1,
        }
    }

    fn status(&self) -> String {
        let secs = self.t0.elapsed().as_secs_f64();
        let rate = self.done as f64 / secs.max(1e-9);
        let eta = if self.done > 0 && self.done < self.total {
            format!(
                ", ETA {}",
                fmt_secs((self.total - self.done) as f64 / rate.max(1e-9))
            )
        } else {
            String::new()
        };
        format!(
            "{}/{} tokens ({:.0}%), {rate:.1} tok/s, {} elapsed{eta}",
            self.done,
            self.total,
            100.0 * self.done as f64 / self.total.max(1) as f64,
            fmt_secs(secs)
        )
    }

    /// `k` more tokens are done.
    pub fn advance(&mut self, k: usize) {
        self.done = (self.done + k).min(self.total);
        if self.tty {
            let now = Instant::now();
            let due = self
                .last_draw
                .is_none_or(|t| now.duration_since(t).as_millis() >= 200);
            if due || self.done == self.total {
                self.last_draw = Some(now);
                self.drawn = true;
                let mut e = std::io::stderr().lock();
                let _ = write!(e, "\r\x1b[2K[{}]", self.status());
                let _ = e.flush();
            }
        } else if self.lines && self.total > 0 {
            let mut line = None;
            while self.next_decile <= 10 && self.done * 10 >= self.next_decile * self.total {
                self.next_decile += 1;
                line = Some(self.status());
            }
            if let Some(l) = line {
                eprintln!("kvrun: {l}");
            }
        }
    }

    /// Clear the in-place line (also done on drop, e.g. after an error).
    pub fn clear(&mut self) {
        if self.drawn {
            let mut e = std::io::stderr().lock();
            let _ = write!(e, "\r\x1b[2K");
            let _ = e.flush();
            self.drawn = false;
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.clear();
    }
}

/// "42s", "3m05s", "1h02m".
pub fn fmt_secs(s: f64) -> String {
    let s = s.max(0.0).round() as u64;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, (s % 3600) / 60),
    }
}
