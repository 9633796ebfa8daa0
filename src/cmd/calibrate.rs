//! `kvrun calibrate epikv`: choose EPIKV's layers for a model.
//!
//! For every decoder layer l it computes the Spearman correlation between
//! the rolling-W mean of g_l(t) = ‖h_l(t) − h_l(t−1)‖ and a per-token
//! importance label over one or more traces, then proposes band A (the
//! widest contiguous run of positive ρ), band B (of negative ρ) and their
//! representative layers (largest |ρ| in each run), skipping the first and
//! last two layers. Labels:
//!
//! - `occlusion` (default): every `--occlusion`-token window is removed from
//!   the cache (evicted, the rest untouched) and the next `--continuation`
//!   tokens are re-scored teacher-forced; the label is the increase of their
//!   mean negative log-likelihood. A copy of the cache at the window's end is
//!   reused, so the prefix is never recomputed.
//! - `attention`: future attention mass received (averaged over heads and
//!   layers, divided by the number of later queries), a cheaper proxy that
//!   only calibration computes.
//!
//! Writes the per-layer table and a JSON config that `--epikv-config` reads
//! (and that kvrun finds by itself as `<model stem>.epikv.json` next to the
//! model).

use crate::cmd::args::{resolve_model, resolve_threads, ModelArgs};
use crate::cmd::load_model;
use crate::error::{Error, Result};
use crate::generate::{Session, StepObserver};
use crate::model::llama::Logits;
use crate::model::Config;
use crate::policy::epikv::{EpikvLayers, Rolling};
use crate::policy::Step;
use crate::signals::{MassMode, Needs};
use clap::{Args, Subcommand, ValueEnum};
use serde::Serialize;
use std::path::PathBuf;

/// `kvrun calibrate ...`
#[derive(Subcommand, Debug)]
pub enum CalibrateCmd {
    /// Per-layer Spearman ρ of hidden-state change vs token importance; proposes EPIKV bands.
    Epikv(CalibrateArgs),
    /// Per-head retrieval scores (needle copying) for HeadKV's head budgets.
    Headkv(crate::cmd::calibrate_headkv::HeadkvArgs),
}

/// Importance label.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Label {
    /// Counterfactual: remove a window from the cache, measure the continuation's NLL change.
    Occlusion,
    /// Proxy: future attention mass received.
    Attention,
}

/// `kvrun calibrate epikv` flags.
#[derive(Args, Debug, Clone)]
pub struct CalibrateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Traces: a text file, or a .jsonl file with one trace per record (see --field).
    #[arg(short = 'f', long = "file")]
    pub file: PathBuf,
    /// JSONL field holding each trace.
    #[arg(long = "field", default_value = "output")]
    pub field: String,
    /// Use at most this many JSONL records.
    #[arg(long = "records")]
    pub records: Option<usize>,
    /// Tokens of each trace to use.
    #[arg(long = "max-tokens", default_value_t = 2048)]
    pub max_tokens: usize,
    /// Rolling window W of the g features.
    #[arg(long = "window", default_value_t = 64)]
    pub window: usize,
    /// Importance label.
    #[arg(long = "label", value_enum, default_value_t = Label::Occlusion)]
    pub label: Label,
    /// Occlusion window length.
    #[arg(long = "occlusion", default_value_t = 32)]
    pub occlusion: usize,
    /// Continuation tokens scored after each occluded window.
    #[arg(long = "continuation", default_value_t = 64)]
    pub continuation: usize,
    /// Write the JSON config here.
    #[arg(short = 'o', long = "out")]
    pub out: Option<PathBuf>,
    /// Print the JSON report instead of the table.
    #[arg(long = "json")]
    pub json: bool,
}

/// What a calibration run found.
#[derive(Debug, Clone, Serialize)]
pub struct Calibration {
    #[serde(flatten)]
    pub layers: EpikvLayers,
    pub label: Label,
    pub traces: usize,
    /// Labeled tokens in all.
    pub tokens: usize,
    /// Per-layer Spearman ρ (weighted mean over traces).
    pub rho: Vec<f64>,
    /// How the proposal was made.
    pub note: String,
}

/// What the recorder collects over one trace.
#[derive(Debug, Default)]
struct Record {
    /// (n, n_layers) g by position.
    g: Vec<f32>,
    /// (n,) whether g is defined (position has a predecessor).
    valid: Vec<bool>,
    /// (n,) attention mass received, by position.
    mass: Vec<f64>,
    /// slot → position.
    slot_pos: Vec<i64>,
}

/// A step observer (no policy: the cache keeps everything) that taps every
/// layer and, for attention labels, records attention mass.
#[derive(Debug)]
struct Recorder {
    n_layers: usize,
    attention: bool,
    rec: Record,
}

impl StepObserver for Recorder {
    fn needs(&self) -> Needs {
        Needs {
            mass: if self.attention {
                MassMode::AllRows
            } else {
                MassMode::None
            },
            ..Needs::taps((0..self.n_layers).collect())
        }
    }
    fn on_step(&mut self, step: &Step<'_>) {
        let nl = self.n_layers;
        let r = &mut self.rec;
        if let Some(taps) = &step.signals.taps {
            for (i, &p) in step.positions.iter().enumerate() {
                let p = p as usize;
                r.g[p * nl..(p + 1) * nl].copy_from_slice(taps.row(i));
                r.valid[p] = i >= taps.first_valid;
            }
        }
        for (&s, &p) in step.slots.iter().zip(step.positions) {
            r.slot_pos[s as usize] = p;
        }
        if let Some(mass) = step.mass {
            for (s, &x) in mass.iter().enumerate() {
                if let Some(&p) = r.slot_pos.get(s) {
                    if p >= 0 {
                        r.mass[p as usize] += x as f64;
                    }
                }
            }
        }
    }
}

/// Ranks (average rank for ties), 0-based.
pub fn ranks(x: &[f64]) -> Vec<f64> {
    let mut idx: Vec<usize> = (0..x.len()).collect();
    idx.sort_by(|&a, &b| x[a].total_cmp(&x[b]));
    let mut r = vec![0.0; x.len()];
    let mut i = 0;
    while i < idx.len() {
        let mut j = i;
        while j + 1 < idx.len() && x[idx[j + 1]] == x[idx[i]] {
            j += 1;
        }
        let avg = (i + j) as f64 / 2.0;
        for &k in &idx[i..=j] {
            r[k] = avg;
        }
        i = j + 1;
    }
    r
}

/// Spearman rank correlation (0 when either side is constant).
pub fn spearman(x: &[f64], y: &[f64]) -> f64 {
    let (rx, ry) = (ranks(x), ranks(y));
    let n = rx.len() as f64;
    if n < 2.0 {
        return 0.0;
    }
    let (mx, my) = (rx.iter().sum::<f64>() / n, ry.iter().sum::<f64>() / n);
    let (mut sxy, mut sxx, mut syy) = (0.0, 0.0, 0.0);
    for (a, b) in rx.iter().zip(&ry) {
        sxy += (a - mx) * (b - my);
        sxx += (a - mx) * (a - mx);
        syy += (b - my) * (b - my);
    }
    if sxx == 0.0 || syy == 0.0 {
        0.0
    } else {
        sxy / (sxx * syy).sqrt()
    }
}

/// Propose bands and representatives from per-layer ρ: the widest run of
/// positive (A) ρ among layers 2..L−2 (ties: larger |Σρ|), then the widest
/// run of negative (B) ρ above band A (EPIKV's B is the upper-middle band;
/// anywhere in 2..L−2 only if nothing negative lies above A);
/// representative = largest |ρ| in the run. A side without any run keeps
/// the depth-scaled default.
pub fn propose(rho: &[f64], window: usize) -> (EpikvLayers, String) {
    let nl = rho.len();
    let mut l = EpikvLayers::for_depth(nl);
    l.window = window;
    let (lo, hi) = (2.min(nl), nl.saturating_sub(2));
    let run = |sign: f64, from: usize| -> Option<(usize, usize)> {
        let mut best: Option<(usize, usize, f64)> = None;
        let mut i = from.max(lo);
        while i < hi {
            if rho[i] * sign > 0.0 {
                let mut j = i;
                while j + 1 < hi && rho[j + 1] * sign > 0.0 {
                    j += 1;
                }
                let mass: f64 = rho[i..=j].iter().map(|r| r.abs()).sum();
                let better = match best {
                    None => true,
                    Some((a, b, m)) => (j - i) > (b - a) || ((j - i) == (b - a) && mass > m),
                };
                if better {
                    best = Some((i, j, mass));
                }
                i = j + 1;
            } else {
                i += 1;
            }
        }
        best.map(|(a, b, _)| (a, b))
    };
    let rep = |(a, b): (usize, usize)| {
        (a..=b)
            .max_by(|&x, &y| rho[x].abs().total_cmp(&rho[y].abs()))
            .unwrap_or(a)
    };
    let mut notes = Vec::new();
    let a = run(1.0, lo);
    match a {
        Some(r) => {
            l.band_a = r;
            l.layer_a = rep(r);
        }
        None => notes.push("no positive run: band A kept at the depth-scaled default"),
    }
    let above_a = a.map_or(lo, |(_, end)| end + 1);
    match run(-1.0, above_a).or_else(|| run(-1.0, lo)) {
        Some(r) => {
            l.band_b = r;
            l.layer_b = rep(r);
        }
        None => notes.push("no negative run: band B kept at the depth-scaled default"),
    }
    let note = if notes.is_empty() {
        "band A = widest positive run of rho (layers 2..L-2), band B = widest negative run above it, representatives = largest |rho|".to_owned()
    } else {
        notes.join("; ")
    };
    (l, note)
}

/// Load the traces.
fn load_traces(a: &CalibrateArgs) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(&a.file).map_err(|source| Error::Io {
        path: a.file.clone(),
        source,
    })?;
    if a.file.extension().is_some_and(|e| e == "jsonl") {
        let mut out = Vec::new();
        for (i, line) in text
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
        {
            if a.records.is_some_and(|r| out.len() >= r) {
                break;
            }
            let v: serde_json::Value = serde_json::from_str(line).map_err(|e| {
                Error::arg(
                    "-f/--file",
                    format!("{} line {}: {e}", a.file.display(), i + 1),
                )
            })?;
            let s = v.get(&a.field).and_then(|x| x.as_str()).ok_or_else(|| {
                Error::arg(
                    "--field",
                    format!(
                        "{} line {}: no string field '{}'",
                        a.file.display(),
                        i + 1,
                        a.field
                    ),
                )
            })?;
            out.push(s.to_owned());
        }
        Ok(out)
    } else {
        Ok(vec![text])
    }
}

/// Per-token labels and rolling-W g features of one trace.
struct TraceData {
    /// (n_labeled, n_layers) features.
    feat: Vec<Vec<f64>>,
    /// (n_labeled,) labels.
    label: Vec<f64>,
}

/// Negative log-likelihood of `target` under `logits`.
fn nll(logits: &[f32], target: u32) -> f64 {
    let m = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let lse = m + logits
        .iter()
        .map(|&x| (x as f64 - m).exp())
        .sum::<f64>()
        .ln();
    lse - logits[target as usize] as f64
}

fn run_trace<'w>(
    a: &CalibrateArgs,
    w: &'w crate::model::Weights<'w>,
    ids: &[u32],
    n_threads: usize,
) -> Result<TraceData> {
    let c: &Config = &w.config;
    let (n, nl, vocab) = (ids.len(), c.n_layers, c.vocab);
    let mut recorder = Recorder {
        n_layers: nl,
        attention: a.label == Label::Attention,
        rec: Record {
            g: vec![0.0; n * nl],
            valid: vec![false; n],
            mass: vec![0.0; n],
            slot_pos: vec![-1; n],
        },
    };
    let step = a.occlusion;
    // every token stays (no policy); prefill chunks of at most n/8 tokens,
    // as the never-reached budget of earlier versions had them
    let mut base = Session::new(w, n, n_threads, step.min((n / 8).max(1)).max(1));
    let mut scratch = Session::new(w, n, n_threads, a.continuation.max(1));
    // full-cache NLL of each token given its prefix, (n,)
    let mut full_nll = vec![f64::NAN; n];
    // per window start: masked mean NLL of its continuation
    let mut masked: Vec<(usize, f64)> = Vec::new();
    let mut done = 0;
    while done < n {
        let k = step.min(n - done);
        let logits = base.feed_observed(&ids[done..done + k], Logits::All, &mut recorder)?;
        for j in 0..k {
            if done + j + 1 < n {
                full_nll[done + j + 1] =
                    nll(&logits[j * vocab..(j + 1) * vocab], ids[done + j + 1]);
            }
        }
        done += k;
        // occlude [done - occlusion, done) and re-score the continuation
        let w0 = done.saturating_sub(a.occlusion);
        if a.label == Label::Occlusion && w0 >= a.occlusion && done + a.continuation < n {
            scratch.kv.clone_from(&base.kv);
            scratch.n_past = done;
            scratch.evict_range(w0, done)?;
            let cont = &ids[done..done + a.continuation];
            let lg = scratch.feed(cont, Logits::All)?;
            let mut s = 0.0;
            for j in 0..a.continuation - 1 {
                s += nll(&lg[j * vocab..(j + 1) * vocab], cont[j + 1]);
            }
            masked.push((w0, s / (a.continuation - 1) as f64));
        }
    }
    let r = &recorder.rec;
    // per-token labels
    let mut lab = vec![f64::NAN; n];
    match a.label {
        Label::Occlusion => {
            for &(w0, m) in &masked {
                let e = w0 + a.occlusion;
                let full: f64 = full_nll[e + 1..e + a.continuation].iter().sum::<f64>()
                    / (a.continuation - 1) as f64;
                for x in &mut lab[w0..e] {
                    *x = m - full;
                }
            }
        }
        Label::Attention => {
            for (t, x) in lab.iter_mut().enumerate() {
                *x = r.mass[t] / (n - t) as f64;
            }
            // the last tokens have too few later queries to say anything
            for x in lab.iter_mut().skip(n.saturating_sub(a.window)) {
                *x = f64::NAN;
            }
        }
    }
    // rolling-W mean of g per layer (causal, defined positions only)
    let mut roll: Vec<Rolling> = (0..nl).map(|_| Rolling::new(a.window)).collect();
    let mut out = TraceData {
        feat: Vec::new(),
        label: Vec::new(),
    };
    for t in 0..n {
        if !r.valid[t] {
            continue;
        }
        for (l, rl) in roll.iter_mut().enumerate() {
            rl.push(r.g[t * nl + l] as f64);
        }
        if lab[t].is_finite() && roll[0].count() >= 2 {
            out.feat.push(roll.iter().map(|x| x.mean()).collect());
            out.label.push(lab[t]);
        }
    }
    Ok(out)
}

/// Run the calibration.
pub fn calibrate(a: &CalibrateArgs) -> Result<Calibration> {
    // a missing model is reported before the other flags
    resolve_model(&a.model.model)?;
    let n_threads = resolve_threads(a.model.threads)?;
    if a.window < 2 || a.occlusion == 0 || a.continuation < 2 {
        return Err(Error::arg(
            "--window/--occlusion/--continuation",
            "need window ≥ 2, occlusion ≥ 1, continuation ≥ 2",
        ));
    }
    let traces = load_traces(a)?;
    if traces.is_empty() {
        return Err(Error::arg("-f/--file", "no traces"));
    }
    let model = load_model(&a.model)?;
    let (w, tok) = (model.weights(), &model.tokenizer);
    let nl = w.config.n_layers;
    let mut rho_sum = vec![0.0; nl];
    let (mut total, mut used) = (0usize, 0usize);
    for (i, text) in traces.iter().enumerate() {
        let mut ids = tok.encode(text, true, false)?;
        ids.truncate(a.max_tokens);
        if ids.len() < 2 * a.occlusion + a.continuation + 2 {
            eprintln!(
                "kvrun: calibrate: trace {i}: {} tokens, too short, skipped",
                ids.len()
            );
            continue;
        }
        let d = run_trace(a, w, &ids, n_threads)?;
        let m = d.label.len();
        if m < 8 {
            continue;
        }
        for (l, rs) in rho_sum.iter_mut().enumerate() {
            let x: Vec<f64> = d.feat.iter().map(|f| f[l]).collect();
            *rs += spearman(&x, &d.label) * m as f64;
        }
        total += m;
        used += 1;
        eprintln!(
            "kvrun: calibrate: trace {i}: {} tokens, {m} labeled",
            ids.len()
        );
    }
    if total == 0 {
        return Err(Error::arg("-f/--file", "no trace was long enough to label"));
    }
    let rho: Vec<f64> = rho_sum.iter().map(|s| s / total as f64).collect();
    let (layers, note) = propose(&rho, a.window);
    Ok(Calibration {
        layers,
        label: a.label,
        traces: used,
        tokens: total,
        rho,
        note,
    })
}

/// `kvrun calibrate epikv` (or `headkv`).
pub fn run_calibrate(cmd: &CalibrateCmd) -> Result<()> {
    let a = match cmd {
        CalibrateCmd::Epikv(a) => a,
        CalibrateCmd::Headkv(h) => return crate::cmd::calibrate_headkv::run(h),
    };
    let cal = calibrate(a)?;
    let json = serde_json::to_string_pretty(&cal).map_err(|e| Error::Other(e.to_string()))?;
    if let Some(p) = &a.out {
        std::fs::write(p, format!("{json}\n")).map_err(|source| Error::Io {
            path: p.clone(),
            source,
        })?;
    }
    if a.json {
        println!("{json}");
        return Ok(());
    }
    let l = &cal.layers;
    println!(
        "layer  spearman_rho  ({:?} labels, {} traces, {} tokens, W = {})",
        cal.label, cal.traces, cal.tokens, l.window
    );
    for (i, r) in cal.rho.iter().enumerate() {
        let mut tag = String::new();
        if (l.band_a.0..=l.band_a.1).contains(&i) {
            tag.push_str(" A");
        }
        if (l.band_b.0..=l.band_b.1).contains(&i) {
            tag.push_str(" B");
        }
        if i == l.layer_a || i == l.layer_b {
            tag.push_str(" (representative)");
        }
        println!("{i:5}  {r:+12.4}{tag}");
    }
    println!(
        "proposal: band A {}-{} (layer {}), band B {}-{} (layer {}), window {}; {}",
        l.band_a.0, l.band_a.1, l.layer_a, l.band_b.0, l.band_b.1, l.layer_b, l.window, cal.note
    );
    if let Some(p) = &a.out {
        println!("wrote {}", p.display());
    }
    Ok(())
}
