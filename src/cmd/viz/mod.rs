//! `kvrun viz`: see what the cache kept. The text is run teacher-forced
//! exactly as `kvrun eval sweep` runs it (one lockstep pass: a full-cache
//! reference and one session per policy at `--kv-budget`, the same
//! [`eval_points`](crate::cmd::eval::fidelity::eval_points_traced)
//! machinery, so the numbers are the sweep's), with every session recording
//! its evictions ([`EvictionLog`](crate::generate::EvictionLog)). The result
//! is ONE self-contained HTML page (`page.html`, no network): the text once
//! per policy, side by side, each token coloured by how long it survived
//! (green: still cached at the end; red → yellow: evicted after a short →
//! long life; for per-(layer, KV-head) stream policies, the share of heads
//! still holding it), the segment after `--segment-after` (default
//! `</think>`: the answer) framed, the per-token KL(full ‖ policy) as a strip
//! under each column, and for stream policies a (layer × head) × position
//! heat map of what each head kept. Hovering a token shows its position,
//! its score when it was evicted and the eviction step.
//!
//! The page's data is one JSON object in `<script id="kvrun-data">` (see
//! [`page_data`]): pieces, per policy the report (evicted, KL, top-1) and
//! compact per-token arrays. `--ctx` caps the text (default 2048 tokens) so
//! a page stays small.

use crate::cmd::args::{resolve_model, resolve_threads, KvArgs, ModelArgs};
use crate::cmd::eval::fidelity::{
    eval_points_traced, EvalText, Lockstep, PointTrace, PplReport, Progress, TextArgs,
};
use crate::cmd::load_model;
use crate::error::{Error, Result};
use crate::generate::{EvictionEvent, Utf8Stream};
use crate::tokenizer::Tokenizer;
use clap::Args;
use serde_json::{json, Value};
use std::path::PathBuf;

/// The page: markup, style and script; the data goes where `/*KVRUN_DATA*/` is.
const PAGE: &str = include_str!("page.html");

/// Columns of the stream heat map (position bins).
const HEAT_BINS: usize = 96;

/// Flags of `kvrun viz`.
#[derive(Args, Debug, Clone)]
pub struct VizArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub text: TextArgs,
    /// Comma-separated policies, one column each.
    #[arg(
        long = "policies",
        value_delimiter = ',',
        default_value = "window,snapkv,epikv,h2o"
    )]
    pub policies: Vec<String>,
    /// KV budget (tokens per layer per KV head) of every policy.
    #[arg(long = "kv-budget")]
    pub kv_budget: Option<usize>,
    /// First positions never evicted (attention sinks).
    #[arg(long = "kv-sink", default_value_t = 4)]
    pub kv_sink: usize,
    /// Newest positions never evicted (default: the policy's own).
    #[arg(long = "kv-recent")]
    pub kv_recent: Option<usize>,
    /// Evict in batches of this many slots (default: the policy's own).
    #[arg(long = "evict-every")]
    pub evict_every: Option<usize>,
    /// Tokens of the text to show (0 = all; large pages get slow).
    #[arg(long = "ctx", default_value_t = 2048)]
    pub ctx: usize,
    /// Tokens fed per step (1 = token by token, as in decoding).
    #[arg(long = "chunk", default_value_t = 1)]
    pub chunk: usize,
    /// Frame the tokens after the first occurrence of MARKER (ignored when
    /// the text does not hold it).
    #[arg(long = "segment-after", default_value = "</think>")]
    pub segment_after: String,
    /// Seed for seeded policies.
    #[arg(short = 's', long = "seed", default_value_t = 0)]
    pub seed: u64,
    /// The HTML page to write.
    #[arg(short = 'o', long = "out", default_value = "viz.html")]
    pub out: PathBuf,
}

impl VizArgs {
    /// The KV settings of one column: those `eval sweep` gives the point
    /// (policy, --kv-budget) with the same flags.
    fn kv_args(&self, policy: &str, budget: usize) -> KvArgs {
        KvArgs {
            policy: policy.to_owned(),
            kv_budget: Some(budget),
            kv_sink: self.kv_sink,
            kv_recent: self.kv_recent,
            keep_prompt: false,
            evict_every: self.evict_every,
            ..KvArgs::default()
        }
    }

    fn source(&self) -> String {
        let name = |p: &std::path::Path| {
            p.file_name()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| p.display().to_string())
        };
        match (&self.text.file, &self.text.jsonl) {
            (Some(f), _) => name(f),
            (None, Some(j)) => format!("{} record {}", name(j), self.text.record),
            _ => "?".into(),
        }
    }
}

/// What one token went through under one policy.
#[derive(Debug, Clone, Copy, Default)]
struct TokenFate {
    /// Streams (or 1 for a token-uniform cache) that evicted it.
    n_evicted: u32,
    /// Sum of the steps at which it was evicted.
    step_sum: u64,
    /// Sum of the scores it was evicted with (finite ones).
    score_sum: f64,
    n_scored: u32,
}

/// Round to 4 significant digits for the page (compact JSON).
fn r4(x: f64) -> Value {
    if !x.is_finite() {
        return Value::Null;
    }
    if x == 0.0 {
        return json!(0);
    }
    let mag = 10f64.powi(3 - x.abs().log10().floor() as i32);
    json!((x * mag).round() / mag)
}

/// The page data of one policy column: its report and per-token arrays.
///
/// - `ev[i]`: token i's (mean) eviction step, −1 when no stream evicted it
///   (the last token, `n_fed`, is never fed: −1 too);
/// - `keep[i]` (stream policies): the share of streams still holding it
///   at the end (token-uniform caches: implied by `ev`);
/// - `score[i]`: its (mean) score when evicted, null when never evicted;
/// - `kl[i]`: KL of the prediction made at position i (of token i + 1);
/// - `heat` (stream policies): per (layer, head) row, `HEAT_BINS` digits
///   0–9, the share of a position bin's tokens the stream still holds at
///   the end.
fn policy_data(
    r: &PplReport,
    t: &PointTrace,
    n: usize,
    n_layers: usize,
    n_kv_heads: usize,
) -> Value {
    let streams = t
        .log
        .events
        .iter()
        .any(|e| e.stream != EvictionEvent::ALL_STREAMS);
    let n_streams = if streams { n_layers * n_kv_heads } else { 1 };
    let mut fate = vec![TokenFate::default(); n];
    let bins = HEAT_BINS.min(n).max(1);
    let bin_of = |p: usize| p * bins / n;
    let mut gone = vec![0u32; if streams { n_streams * bins } else { 0 }];
    for e in &t.log.events {
        let p = e.pos as usize;
        let Some(f) = fate.get_mut(p) else { continue };
        f.n_evicted += 1;
        f.step_sum += e.step as u64;
        if e.score.is_finite() {
            f.score_sum += e.score as f64;
            f.n_scored += 1;
        }
        if streams && (e.stream as usize) < n_streams {
            gone[e.stream as usize * bins + bin_of(p)] += 1;
        }
    }
    let ev: Vec<Value> = fate
        .iter()
        .map(|f| match f.n_evicted {
            0 => json!(-1),
            k => json!((f.step_sum as f64 / k as f64).round() as u64),
        })
        .collect();
    let keep: Vec<Value> = fate
        .iter()
        .map(|f| r4(1.0 - f.n_evicted as f64 / n_streams as f64))
        .collect();
    let score: Vec<Value> = fate
        .iter()
        .map(|f| match f.n_scored {
            0 => Value::Null,
            k => r4(f.score_sum / k as f64),
        })
        .collect();
    let kl: Vec<Value> = t.kl.iter().map(|&x| r4(x as f64)).collect();
    let mut out = json!({
        "name": r.policy,
        "budget": r.budget,
        "streams": streams,
        "evicted": r.evicted,
        "evicted_entries": t.log.events.len(),
        "kl": r.all.kl,
        "top1": r.all.top1_agree,
        "delta_nll": r.all.delta_nll,
        "seg_kl": r.segment.as_ref().map(|s| s.kl),
        "seg_top1": r.segment.as_ref().map(|s| s.top1_agree),
        "peak_kv_entries": r.peak_kv_entries,
        "ev": ev,
        "score": score,
        "kl_tok": kl,
    });
    if streams {
        out["keep"] = json!(keep);
        // tokens per bin, then per stream the kept share as one digit
        let mut per_bin = vec![0u32; bins];
        for p in 0..n {
            per_bin[bin_of(p)] += 1;
        }
        let rows: Vec<String> = (0..n_streams)
            .map(|s| {
                (0..bins)
                    .map(|b| {
                        let tot = per_bin[b].max(1) as f64;
                        let kept = 1.0 - gone[s * bins + b] as f64 / tot;
                        char::from(b'0' + (kept * 9.0).round().clamp(0.0, 9.0) as u8)
                    })
                    .collect()
            })
            .collect();
        out["heat"] = json!({
            "n_layers": n_layers,
            "n_kv_heads": n_kv_heads,
            "bins": bins,
            "rows": rows,
        });
    }
    out
}

/// Display pieces of `ids` (control tokens as their text). A character
/// whose bytes span several tokens is shown on the token that completes it
/// (the others show nothing), so the text reads as the tokenizer's output.
fn pieces(tok: &Tokenizer, ids: &[u32]) -> Vec<String> {
    let mut utf8 = Utf8Stream::default();
    // (a character the text ends inside of shows nothing)
    ids.iter()
        .map(|&id| utf8.push(&tok.token_bytes(id, true)))
        .collect()
}

/// The page's data object.
#[allow(clippy::too_many_arguments)]
pub fn page_data(
    source: &str,
    model: &str,
    tok: &Tokenizer,
    text: &EvalText,
    reports: &[PplReport],
    traces: &[PointTrace],
    n_layers: usize,
    n_kv_heads: usize,
) -> Value {
    let n = text.ids.len();
    let policies: Vec<Value> = reports
        .iter()
        .zip(traces)
        .map(|(r, t)| policy_data(r, t, n, n_layers, n_kv_heads))
        .collect();
    json!({
        "source": source,
        "model": model,
        "n_tokens": n,
        // the last token is only predicted: it never enters a cache
        "n_fed": n - 1,
        "seg_start": text.seg_start,
        "pieces": pieces(tok, &text.ids),
        "policies": policies,
    })
}

/// The HTML page around `data`. Every `<` inside the JSON (only ever
/// inside strings) is written `\u003c`, so no text of the page can close
/// its script element or open a comment in it.
pub fn page_html(data: &Value, title: &str) -> String {
    let json = data.to_string().replace('<', "\\u003c");
    PAGE.replace("/*KVRUN_TITLE*/", &crate::cmd::plot::xml_escape(title))
        .replace("/*KVRUN_DATA*/", &json)
}

/// `kvrun viz`.
pub fn run_viz(a: &VizArgs) -> Result<()> {
    let budget = a
        .kv_budget
        .ok_or_else(|| Error::arg("--kv-budget", "required: the budget every policy gets"))?;
    if budget == 0 {
        return Err(Error::arg("--kv-budget", "must be at least 1"));
    }
    if a.chunk == 0 {
        return Err(Error::arg("--chunk", "must be at least 1"));
    }
    let known = crate::policy::names();
    let mut policies: Vec<String> = Vec::new();
    for p in a
        .policies
        .iter()
        .map(|s| s.trim())
        .filter(|s| !s.is_empty())
    {
        if !known.contains(&p) {
            return Err(Error::arg(
                "--policies",
                format!("unknown policy '{p}' (known: {})", known.join(", ")),
            ));
        }
        if p == "full" {
            return Err(Error::arg(
                "--policies",
                "'full' evicts nothing: it is the reference every column is compared with",
            ));
        }
        if !policies.iter().any(|q| q == p) {
            policies.push(p.to_owned());
        }
    }
    if policies.is_empty() {
        return Err(Error::arg("--policies", "no policy given"));
    }
    let path = resolve_model(&a.model.model)?;
    let mut points = Vec::with_capacity(policies.len());
    for p in &policies {
        let kv = a.kv_args(p, budget);
        if let Some(kp) = kv.build(a.seed, &path)? {
            let e = &kp.evictor;
            if e.n_sink + e.n_recent >= e.budget {
                return Err(Error::arg(
                    "--kv-budget",
                    format!(
                        "budget {budget} cannot hold {p}'s protected tokens (sinks {} + recent {}) plus one new token",
                        e.n_sink, e.n_recent
                    ),
                ));
            }
        }
        points.push(kv);
    }
    let raw = a.text.load()?;
    let n_threads = resolve_threads(a.model.threads)?;
    let model = load_model(&a.model)?;
    let (w, tok) = (model.weights(), &model.tokenizer);
    let seg = raw
        .contains(a.segment_after.as_str())
        .then_some(a.segment_after.as_str())
        .filter(|m| !m.is_empty());
    let text = EvalText::new(tok, &raw, a.ctx, seg, None)?;
    let lk = Lockstep {
        model: &path,
        chunk: a.chunk,
        n_threads,
        seed: a.seed,
    };
    eprintln!(
        "kvrun: viz of {} policies at budget {budget} over {} tokens",
        points.len(),
        text.ids.len()
    );
    let mut prog = Progress::new(text.n_predicted(), true, true);
    let (reports, traces) = eval_points_traced(w, &text, &points, lk, &mut |k| prog.advance(k))?;
    prog.clear();
    let c = &w.config;
    let source = a.source();
    let model_name = path
        .file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let data = page_data(
        &source,
        &model_name,
        tok,
        &text,
        &reports,
        &traces,
        c.n_layers,
        c.n_kv_heads,
    );
    let title = format!("kvrun viz — {source}, budget {budget}");
    std::fs::write(&a.out, page_html(&data, &title)).map_err(|source| Error::Io {
        path: a.out.clone(),
        source,
    })?;
    for r in &reports {
        eprintln!(
            "{} {budget}: kl={:.5} top1={:.4} evicted={}",
            r.policy, r.all.kl, r.all.top1_agree, r.evicted
        );
    }
    eprintln!("kvrun: wrote {}", a.out.display());
    Ok(())
}
