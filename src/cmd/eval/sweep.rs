//! `kvrun eval sweep`: fidelity of several eviction policies over a range of
//! KV budgets, as a CSV, a JSON array of [`PplReport`]s, an SVG line plot
//! and a markdown table.
//!
//! Each text (one file, or each JSONL record) is evaluated in ONE lockstep
//! pass ([`eval_points`]): a single full-cache reference session and one
//! session per (policy, budget) point are fed the same chunks, and every
//! point is compared with the reference's log-softmax, computed once per
//! chunk. Each point's figures are exactly those `kvrun eval ppl` gives for
//! that point alone. Budgets at or above the text length are still run: they
//! are the "no eviction" points (KL 0, top-1 agreement 1). With several
//! records, the output files are rewritten after every record (merged over
//! the records done), so an interrupted sweep keeps what it measured.
//!
//! Memory: each point holds a budget-sized cache and chunk × vocab logits;
//! the reference holds the whole text's cache.

use crate::cmd::args::{resolve_model, resolve_threads, KvArgs, ModelArgs};
use crate::cmd::eval::fidelity::{
    eval_points, EvalText, Fidelity, Lockstep, PplReport, Progress, TextArgs,
};
use crate::cmd::load_model;
use crate::cmd::plot::{panels_svg, with_ext, Line, LinePlot, PALETTE};
use crate::error::{Error, Result};
use clap::{Args, ValueEnum};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// Metric drawn in the SVG plot.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Metric {
    /// Mean KL(full ‖ policy), nats/token.
    Kl,
    /// Mean ΔNLL (policy − full), nats/token.
    DeltaNll,
    /// Top-1 agreement with the full cache.
    Top1,
    /// Perplexity under the policy.
    Ppl,
}

impl Metric {
    /// The metric's value in `f`.
    pub fn of(self, f: &Fidelity) -> f64 {
        match self {
            Metric::Kl => f.kl,
            Metric::DeltaNll => f.delta_nll,
            Metric::Top1 => f.top1_agree,
            Metric::Ppl => f.ppl,
        }
    }
    /// Axis label.
    pub fn label(self) -> &'static str {
        match self {
            Metric::Kl => "KL(full ‖ policy), nats/token",
            Metric::DeltaNll => "ΔNLL (policy − full), nats/token",
            Metric::Top1 => "top-1 agreement with the full cache",
            Metric::Ppl => "perplexity",
        }
    }
    /// Short name.
    pub fn short(self) -> &'static str {
        match self {
            Metric::Kl => "KL",
            Metric::DeltaNll => "ΔNLL",
            Metric::Top1 => "top-1 agreement",
            Metric::Ppl => "PPL",
        }
    }
}

/// Flags of `kvrun eval sweep`.
#[derive(Args, Debug, Clone)]
pub struct SweepArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub text: TextArgs,
    /// With --jsonl: evaluate N records (from --record on) and average them, token-weighted.
    #[arg(long = "records")]
    pub records: Option<usize>,
    /// Comma-separated policies (default: every registered policy except full).
    #[arg(long = "policies", value_delimiter = ',')]
    pub policies: Vec<String>,
    /// Comma-separated KV budgets (tokens per layer per KV head).
    #[arg(
        long = "budgets",
        value_delimiter = ',',
        default_value = "256,512,1024,2048"
    )]
    pub budgets: Vec<usize>,
    /// Tokens of the text to evaluate (0 = all).
    #[arg(long = "ctx", default_value_t = 2048)]
    pub ctx: usize,
    /// Tokens fed per step (1 = token by token, exactly as in decoding).
    #[arg(long = "chunk", default_value_t = 1)]
    pub chunk: usize,
    /// First positions never evicted (attention sinks).
    #[arg(long = "kv-sink", default_value_t = 4)]
    pub kv_sink: usize,
    /// Newest positions never evicted (default: min(128, budget/4)).
    #[arg(long = "kv-recent")]
    pub kv_recent: Option<usize>,
    /// Evict in batches: free this many slots at a time once over budget
    /// (default 1; snapkv/adakv/pyramidkv: budget/8, at most 128).
    #[arg(long = "evict-every")]
    pub evict_every: Option<usize>,
    /// Also report fidelity on the tokens after the first occurrence of MARKER.
    #[arg(long = "segment-after")]
    pub segment_after: Option<String>,
    /// Also report fidelity on the last N tokens.
    #[arg(long = "segment-last")]
    pub segment_last: Option<usize>,
    /// Output prefix: writes PREFIX.csv, PREFIX.json and PREFIX.svg.
    #[arg(long = "out", default_value = "sweep")]
    pub out: PathBuf,
    /// Metric drawn in the SVG plot.
    #[arg(long = "metric", value_enum, default_value_t = Metric::Kl)]
    pub metric: Metric,
    /// Log-scale y axis in the SVG plot (zero values, e.g. the KL of
    /// no-eviction points, are not drawn).
    #[arg(long = "log-y")]
    pub log_y: bool,
    /// One SVG panel per policy family (token heuristics, per-head,
    /// CriticalKV, learned, reasoning, EPIKV) instead of every line in one.
    #[arg(long = "by-family")]
    pub by_family: bool,
    /// Seed for seeded policies.
    #[arg(short = 's', long = "seed", default_value_t = 0)]
    pub seed: u64,
}

impl SweepArgs {
    /// The policies to run (validated against the registry).
    pub fn policy_list(&self) -> Result<Vec<String>> {
        let known = crate::policy::names();
        let list: Vec<String> = if self.policies.is_empty() {
            crate::policy::POLICIES
                .iter()
                .filter(|p| p.budgeted())
                .map(|p| p.name.to_string())
                .collect()
        } else {
            self.policies
                .iter()
                .map(|s| s.trim().to_owned())
                .filter(|s| !s.is_empty())
                .collect()
        };
        if list.is_empty() {
            return Err(Error::arg("--policies", "no policy given"));
        }
        for p in &list {
            if !known.contains(&p.as_str()) {
                return Err(Error::arg(
                    "--policies",
                    format!("unknown policy '{p}' (known: {})", known.join(", ")),
                ));
            }
        }
        let mut seen = Vec::new();
        for p in list {
            if !seen.contains(&p) {
                seen.push(p);
            }
        }
        Ok(seen)
    }

    /// The KV settings of one point (the same `kvrun eval ppl` gets from
    /// `--policy P --kv-budget B` and the sweep's other flags).
    pub fn kv_args(&self, policy: &str, budget: usize) -> KvArgs {
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

    /// How the SVG is drawn (`--log-y`, `--by-family`).
    pub fn style(&self) -> PlotStyle {
        PlotStyle {
            log_y: self.log_y,
            by_family: self.by_family,
        }
    }

    /// Tokens of the evaluated text, when it is a single text.
    fn text_len(&self, rs: &[PplReport]) -> Option<usize> {
        match self.records {
            Some(n) if n > 1 => None,
            _ => rs.first().map(|r| r.n_tokens),
        }
    }

    /// Where the text comes from, for titles.
    pub fn source(&self) -> String {
        let name = |p: &Path| {
            p.file_name()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| p.display().to_string())
        };
        match (&self.text.file, &self.text.jsonl) {
            (Some(f), _) => name(f),
            (None, Some(j)) => match self.records {
                Some(n) if n > 1 => format!(
                    "{} records {}–{}",
                    name(j),
                    self.text.record,
                    self.text.record + n - 1
                ),
                _ => format!("{} record {}", name(j), self.text.record),
            },
            _ => "?".into(),
        }
    }
}

/// Combine per-record fidelities (token-weighted; PPL and its error exactly,
/// from the per-record mean and variance of the NLL).
fn merge_fidelity(fs: &[&Fidelity]) -> Fidelity {
    let n: usize = fs.iter().map(|f| f.n).sum();
    if n == 0 {
        return Fidelity::default();
    }
    let (mut nll, mut nll2, mut nll_full, mut dn, mut kl, mut agree) =
        (0.0, 0.0, 0.0, 0.0, 0.0, 0.0);
    for f in fs {
        let k = f.n as f64;
        let mean = f.ppl.ln();
        let rel = if f.ppl > 0.0 { f.ppl_err / f.ppl } else { 0.0 };
        let var = rel * rel * (k - 1.0).max(1.0);
        nll += k * mean;
        nll2 += k * (var + mean * mean);
        nll_full += k * f.ppl_full.ln();
        dn += k * f.delta_nll;
        kl += k * f.kl;
        agree += k * f.top1_agree;
    }
    let nf = n as f64;
    let mean = nll / nf;
    let var = (nll2 / nf - mean * mean).max(0.0);
    let ppl = mean.exp();
    Fidelity {
        n,
        ppl,
        ppl_full: (nll_full / nf).exp(),
        ppl_err: ppl * (var / (nf - 1.0).max(1.0)).sqrt(),
        delta_nll: dn / nf,
        kl: kl / nf,
        top1_agree: agree / nf,
    }
}

/// Average several records' reports of one (policy, budget) point.
pub fn merge_reports(rs: &[PplReport]) -> PplReport {
    if rs.len() == 1 {
        return rs[0].clone();
    }
    let all = merge_fidelity(&rs.iter().map(|r| &r.all).collect::<Vec<_>>());
    let segs: Vec<&Fidelity> = rs.iter().filter_map(|r| r.segment.as_ref()).collect();
    let secs: f64 = rs
        .iter()
        .map(|r| (r.n_tokens.saturating_sub(1)) as f64 / r.tokens_per_second.max(1e-12))
        .sum();
    let n_pred: usize = rs.iter().map(|r| r.n_tokens.saturating_sub(1)).sum();
    PplReport {
        policy: rs[0].policy.clone(),
        budget: rs[0].budget,
        n_tokens: rs.iter().map(|r| r.n_tokens).sum(),
        all,
        segment: if segs.is_empty() {
            None
        } else {
            Some(merge_fidelity(&segs))
        },
        segment_start: None,
        peak_kv_entries: rs.iter().map(|r| r.peak_kv_entries).max().unwrap_or(0),
        peak_kv_bytes: rs.iter().map(|r| r.peak_kv_bytes).max().unwrap_or(0),
        evicted: rs.iter().map(|r| r.evicted).sum(),
        tokens_per_second: if secs > 0.0 {
            n_pred as f64 / secs
        } else {
            0.0
        },
        // how the budget was shared at the end of the last record
        stream_lengths: rs
            .last()
            .map(|r| r.stream_lengths.clone())
            .unwrap_or_default(),
    }
}

/// CSV header.
pub const CSV_HEADER: &str =
    "policy,budget,n_tokens,ppl,ppl_full,delta_nll,kl,top1,seg_n,seg_ppl,seg_delta_nll,seg_kl,seg_top1,peak_kv_entries,peak_kv_bytes,evicted,tok_s";

/// The CSV text of `rs`.
pub fn to_csv(rs: &[PplReport]) -> String {
    let mut s = String::from(CSV_HEADER);
    s.push('\n');
    for r in rs {
        let a = &r.all;
        let _ = write!(
            s,
            "{},{},{},{},{},{},{},{},",
            r.policy,
            r.budget.map(|b| b.to_string()).unwrap_or_default(),
            r.n_tokens,
            a.ppl,
            a.ppl_full,
            a.delta_nll,
            a.kl,
            a.top1_agree
        );
        match &r.segment {
            Some(g) => {
                let _ = write!(
                    s,
                    "{},{},{},{},{},",
                    g.n, g.ppl, g.delta_nll, g.kl, g.top1_agree
                );
            }
            None => s.push_str(",,,,,"),
        }
        let _ = writeln!(
            s,
            "{},{},{},{:.3}",
            r.peak_kv_entries, r.peak_kv_bytes, r.evicted, r.tokens_per_second
        );
    }
    s
}

/// The markdown table of `rs`.
pub fn to_markdown(rs: &[PplReport]) -> String {
    let mut s = String::from(
        "| policy | budget | ppl | ΔNLL | KL | top1 | seg KL | seg top1 | peak KV |\n",
    );
    s.push_str("|---|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for r in rs {
        let (sk, st) = match &r.segment {
            Some(g) => (
                format!("{:.5}", g.kl),
                format!("{:.2}%", 100.0 * g.top1_agree),
            ),
            None => ("–".into(), "–".into()),
        };
        let _ = writeln!(
            s,
            "| {} | {} | {:.4} | {:+.5} | {:.5} | {:.2}% | {} | {} | {} ({:.2} MiB) |",
            r.policy,
            r.budget
                .map(|b| b.to_string())
                .unwrap_or_else(|| "none".into()),
            r.all.ppl,
            r.all.delta_nll,
            r.all.kl,
            100.0 * r.all.top1_agree,
            sk,
            st,
            r.peak_kv_entries,
            r.peak_kv_bytes as f64 / (1 << 20) as f64
        );
    }
    s
}

/// How the sweep's SVG is drawn.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PlotStyle {
    /// Log10 y axis.
    pub log_y: bool,
    /// One panel per [`family`].
    pub by_family: bool,
}

/// The family a policy is drawn with in a per-family plot: policies that
/// share a scoring idea, so one panel compares close variants.
pub fn family(policy: &str) -> &'static str {
    match policy {
        p if p.starts_with("critical-") => "CriticalKV re-ranked",
        p if p.starts_with("epikv") => "EPIKV",
        "snapkv" | "adakv" | "pyramidkv" | "headkv" | "expected-attention" => {
            "per-head (SnapKV family)"
        }
        "trimkv" | "dbtrimkv" => "learned retention",
        "rkv" | "thinkv" | "raas" | "lagkv" | "lagkv-causal" => "reasoning-aware",
        "window" | "h2o" | "tova" | "knorm" | "scissorhands" | "random" => "token heuristics",
        _ => "other",
    }
}

/// The SVG line plot: x = budget (log2), y = `metric`, one line per policy,
/// dashed lines for the segment when present; `text_len` (tokens of a single
/// text) is marked with a dotted vertical line when inside the budget range.
pub fn to_svg(rs: &[PplReport], metric: Metric, source: &str, text_len: Option<usize>) -> String {
    to_svg_with(rs, metric, source, text_len, PlotStyle::default())
}

/// [`to_svg`] drawn as `style` says: a log y axis, and/or one panel per
/// policy family (two columns; colours stay those of the single plot, so a
/// policy keeps its colour across panels).
pub fn to_svg_with(
    rs: &[PplReport],
    metric: Metric,
    source: &str,
    text_len: Option<usize>,
    style: PlotStyle,
) -> String {
    let mut policies: Vec<&str> = Vec::new();
    for x in rs {
        if !policies.contains(&x.policy.as_str()) {
            policies.push(&x.policy);
        }
    }
    if !style.by_family {
        return plot_of(
            rs,
            &policies,
            &policies,
            metric,
            source,
            text_len,
            style.log_y,
        )
        .svg();
    }
    let mut families: Vec<&str> = Vec::new();
    for p in &policies {
        if !families.contains(&family(p)) {
            families.push(family(p));
        }
    }
    let panels: Vec<LinePlot> = families
        .iter()
        .map(|f| {
            let mine: Vec<&str> = policies
                .iter()
                .copied()
                .filter(|p| family(p) == *f)
                .collect();
            let mut plot = plot_of(rs, &policies, &mine, metric, f, text_len, style.log_y);
            plot.title = f.to_string();
            plot
        })
        .collect();
    let sub = plot_of(
        rs,
        &policies,
        &policies,
        metric,
        source,
        text_len,
        style.log_y,
    )
    .subtitle;
    panels_svg(
        &format!("{} vs KV budget — {}", metric.short(), source),
        sub.as_deref(),
        &panels,
        2,
        640.0,
    )
}

/// The plot of the `mine` policies (colours by their index in `all`).
fn plot_of(
    rs: &[PplReport],
    all: &[&str],
    mine: &[&str],
    metric: Metric,
    source: &str,
    text_len: Option<usize>,
    log_y: bool,
) -> LinePlot {
    let has_seg = rs.iter().any(|x| x.segment.is_some());
    let mut lines = Vec::new();
    for p in mine {
        let i = all.iter().position(|q| q == p).unwrap_or(0);
        let color = PALETTE[i % PALETTE.len()];
        let of = |seg: bool| -> Vec<(usize, f64)> {
            rs.iter()
                .filter(|x| x.policy == *p)
                .filter_map(|x| {
                    let f = if seg { x.segment.as_ref()? } else { &x.all };
                    x.budget.map(|bud| (bud, metric.of(f)))
                })
                .collect()
        };
        lines.push(Line {
            label: p.to_string(),
            group: p.to_string(),
            color,
            dashed: false,
            pts: of(false),
        });
        let seg = of(true);
        if seg.iter().any(|q| q.1.is_finite()) {
            lines.push(Line {
                label: format!("{p} (segment)"),
                group: p.to_string(),
                color,
                dashed: true,
                pts: seg,
            });
        }
    }
    let subtitle = rs.first().map(|x| {
        let mut sub = format!("{} tokens", x.n_tokens);
        if let (true, Some(st)) = (has_seg, x.segment_start) {
            let _ = write!(sub, "; segment from token {st} dashed");
        } else if has_seg {
            sub.push_str("; segment dashed");
        }
        sub
    });
    LinePlot {
        title: format!("{} vs KV budget — {}", metric.short(), source),
        subtitle,
        y_label: metric.label().into(),
        y_short: metric.short().into(),
        y_include: match metric {
            Metric::Kl | Metric::DeltaNll => vec![0.0],
            Metric::Top1 => vec![1.0],
            Metric::Ppl => vec![],
        },
        x_marker: text_len.map(|n| (n, format!("text length {n}"))),
        lines,
        log_y,
    }
}

fn write_file(path: &Path, text: &str) -> Result<()> {
    std::fs::write(path, text).map_err(|source| Error::Io {
        path: path.to_owned(),
        source,
    })
}

/// Whether a point's streams ended with different lengths (a shared or
/// global budget: adakv, dbtrimkv, ...).
fn uneven(r: &PplReport) -> bool {
    let mut it = r.stream_lengths.iter().flatten();
    let first = it.next();
    it.any(|x| Some(x) != first)
}

/// How the budget ended up shared, one heat map per point whose streams
/// ended uneven: rows = layers, columns = KV heads, colour = resident
/// entries relative to the per-head budget (white 0, blue at the budget,
/// dark red at 4× or more), with the per-layer total as a bar.
pub fn heads_svg(rs: &[PplReport]) -> String {
    let pts: Vec<&PplReport> = rs.iter().filter(|r| uneven(r)).collect();
    let nl = pts.first().map_or(0, |r| r.stream_lengths.len());
    let nh = pts
        .first()
        .and_then(|r| r.stream_lengths.first())
        .map_or(0, |h| h.len());
    let (cell_w, cell_h, bar_w, gap) = (18.0, 11.0, 60.0, 40.0);
    let panel_w = nh as f64 * cell_w + bar_w + gap;
    let (top, left) = (70.0, 40.0);
    let w = left + panel_w * pts.len().max(1) as f64;
    let h = top + nl as f64 * cell_h + 50.0;
    let mut s = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w:.0}" height="{h:.0}" font-family="sans-serif" font-size="11">
<rect width="100%" height="100%" fill="white"/>
<text x="{:.0}" y="20" text-anchor="middle" font-size="14" font-weight="bold">resident entries per (layer, KV head) at the end: how the budget was shared</text>
"#,
        w / 2.0
    );
    for l in (0..nl).step_by(5) {
        s.push_str(&format!(
            r#"<text x="{:.0}" y="{:.1}" text-anchor="end">L{l}</text>
"#,
            left - 4.0,
            top + (l as f64 + 0.8) * cell_h
        ));
    }
    let colour = |f: f64| {
        // 0 → white, 1 → blue, ≥ 4 → dark red
        let (r, g, b) = if f <= 1.0 {
            (
                255.0 * (1.0 - f) + 31.0 * f,
                255.0 * (1.0 - f) + 119.0 * f,
                255.0 * (1.0 - f) + 180.0 * f,
            )
        } else {
            let t = ((f - 1.0) / 3.0).min(1.0);
            (
                31.0 + (160.0 - 31.0) * t,
                119.0 * (1.0 - t),
                180.0 * (1.0 - t) + 20.0 * t,
            )
        };
        format!("rgb({:.0},{:.0},{:.0})", r, g, b)
    };
    for (k, r) in pts.iter().enumerate() {
        let x0 = left + k as f64 * panel_w;
        let budget = r.budget.unwrap_or(1).max(1) as f64;
        let totals: Vec<usize> = r.stream_lengths.iter().map(|h| h.iter().sum()).collect();
        let max_total = totals.iter().copied().max().unwrap_or(1).max(1) as f64;
        s.push_str(&format!(
            r##"<text x="{:.1}" y="{:.0}" font-weight="bold">{} B={}</text>
<text x="{:.1}" y="{:.0}" fill="#555">heads ×{}; bar: layer total (max {})</text>
"##,
            x0,
            top - 22.0,
            r.policy,
            budget,
            x0,
            top - 8.0,
            nh,
            max_total
        ));
        for (l, heads) in r.stream_lengths.iter().enumerate() {
            let y = top + l as f64 * cell_h;
            for (hh, &n) in heads.iter().enumerate() {
                s.push_str(&format!(
                    r#"<rect x="{:.1}" y="{y:.1}" width="{}" height="{}" fill="{}"><title>layer {l} head {hh}: {n}</title></rect>
"#,
                    x0 + hh as f64 * cell_w,
                    cell_w - 1.0,
                    cell_h - 1.0,
                    colour(n as f64 / budget)
                ));
            }
            let bw = bar_w * totals[l] as f64 / max_total;
            s.push_str(&format!(
                r##"<rect x="{:.1}" y="{y:.1}" width="{bw:.1}" height="{}" fill="#888"><title>layer {l}: {}</title></rect>
"##,
                x0 + nh as f64 * cell_w + 4.0,
                cell_h - 2.0,
                totals[l]
            ));
        }
    }
    s.push_str(&format!(
        r##"<text x="{left}" y="{:.0}" fill="#555">colour: entries / per-head budget — white 0, blue 1, dark red ≥ 4</text>
</svg>
"##,
        h - 14.0
    ));
    s
}

/// Write PREFIX.csv, PREFIX.json and PREFIX.svg; returns their paths.
pub fn write_outputs(
    prefix: &Path,
    rs: &[PplReport],
    metric: Metric,
    source: &str,
    text_len: Option<usize>,
) -> Result<[PathBuf; 3]> {
    write_outputs_with(prefix, rs, metric, source, text_len, PlotStyle::default())
}

/// [`write_outputs`] with the SVG drawn in `style`.
pub fn write_outputs_with(
    prefix: &Path,
    rs: &[PplReport],
    metric: Metric,
    source: &str,
    text_len: Option<usize>,
    style: PlotStyle,
) -> Result<[PathBuf; 3]> {
    if let Some(dir) = prefix.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|source| Error::Io {
            path: dir.to_owned(),
            source,
        })?;
    }
    let paths = [
        with_ext(prefix, "csv"),
        with_ext(prefix, "json"),
        with_ext(prefix, "svg"),
    ];
    write_file(&paths[0], &to_csv(rs))?;
    let json = serde_json::to_string_pretty(rs).map_err(|e| Error::Other(e.to_string()))?;
    write_file(&paths[1], &(json + "\n"))?;
    write_file(&paths[2], &to_svg_with(rs, metric, source, text_len, style))?;
    // the per-head distribution of points whose budget is shared unevenly
    if rs.iter().any(uneven) {
        write_file(&with_ext(prefix, "heads.svg"), &heads_svg(rs))?;
    }
    Ok(paths)
}

/// Run the sweep and return the reports (one per policy × budget, in
/// order; merged over records). Progress goes to stderr: an in-place bar on
/// a terminal, a plain line per 10 % otherwise, then one summary line per
/// point.
pub fn sweep(a: &SweepArgs) -> Result<Vec<PplReport>> {
    let policies = a.policy_list()?;
    if a.budgets.is_empty() {
        return Err(Error::arg("--budgets", "no budget given"));
    }
    let mut budgets = a.budgets.clone();
    budgets.dedup();
    let n_rec = match (a.records, &a.text.jsonl) {
        (None, _) => 1,
        (Some(0), _) => return Err(Error::arg("--records", "must be at least 1")),
        (Some(n), Some(_)) => n,
        (Some(_), None) => return Err(Error::arg("--records", "needs --jsonl")),
    };
    if a.chunk == 0 {
        return Err(Error::arg("--chunk", "must be at least 1"));
    }
    // Check every point's settings before spending minutes on the text
    // (policies may read files next to the model: EPIKV's config, gates).
    let path = resolve_model(&a.model.model)?;
    let mut points = Vec::with_capacity(policies.len() * budgets.len());
    for p in &policies {
        for &bud in &budgets {
            let kv = a.kv_args(p, bud);
            if let Some(kp) = kv.build(a.seed, &path)? {
                let e = &kp.evictor;
                if e.budget == 0 || e.n_sink + e.n_recent >= e.budget {
                    return Err(Error::arg(
                        "--budgets",
                        format!("budget {bud} cannot hold the protected tokens (sinks {} + recent {}) plus one new token", e.n_sink, e.n_recent),
                    ));
                }
            }
            points.push(kv);
        }
    }
    let raw: Vec<String> = (0..n_rec)
        .map(|r| {
            TextArgs {
                record: a.text.record + r,
                ..a.text.clone()
            }
            .load()
        })
        .collect::<Result<_>>()?;
    let n_threads = resolve_threads(a.model.threads)?;
    let model = load_model(&a.model)?;
    let (w, tok) = (model.weights(), &model.tokenizer);
    let texts: Vec<EvalText> = raw
        .iter()
        .map(|t| EvalText::new(tok, t, a.ctx, a.segment_after.as_deref(), a.segment_last))
        .collect::<Result<_>>()?;
    let source = a.source();
    let lk = Lockstep {
        model: &path,
        chunk: a.chunk,
        n_threads,
        seed: a.seed,
    };
    let total_tokens: usize = texts.iter().map(EvalText::n_predicted).sum();
    eprintln!(
        "kvrun: sweep of {} points ({} policies × {} budgets) over {} tokens in {} text(s), one lockstep pass per text",
        points.len(),
        policies.len(),
        budgets.len(),
        total_tokens,
        texts.len()
    );
    let mut prog = Progress::new(total_tokens, true, true);
    let mut per_point: Vec<Vec<PplReport>> = vec![Vec::with_capacity(n_rec); points.len()];
    let mut out = Vec::new();
    for text in &texts {
        let reps = eval_points(w, text, &points, lk, &mut |k| prog.advance(k))?;
        for (acc, r) in per_point.iter_mut().zip(reps) {
            acc.push(r);
        }
        out = per_point.iter().map(|rs| merge_reports(rs)).collect();
        write_outputs_with(&a.out, &out, a.metric, &source, a.text_len(&out), a.style())?;
    }
    prog.clear();
    let total = out.len();
    for (i, rep) in out.iter().enumerate() {
        let seg = rep
            .segment
            .as_ref()
            .map(|g| format!(" seg_kl={:.5} seg_top1={:.4}", g.kl, g.top1_agree))
            .unwrap_or_default();
        // the point's own forward time (its feeds), not the wall clock
        let secs =
            rep.n_tokens.saturating_sub(texts.len()) as f64 / rep.tokens_per_second.max(1e-12);
        eprintln!(
            "[{}/{total}] {} {}: kl={:.5} top1={:.4} dnll={:+.5}{seg} evicted={} ({secs:.1}s forward)",
            i + 1,
            rep.policy,
            rep.budget.unwrap_or(0),
            rep.all.kl,
            rep.all.top1_agree,
            rep.all.delta_nll,
            rep.evicted
        );
    }
    Ok(out)
}

/// `kvrun eval sweep`.
pub fn run_sweep(a: &SweepArgs) -> Result<()> {
    let rs = sweep(a)?;
    let [csv, json, svg] = write_outputs_with(
        &a.out,
        &rs,
        a.metric,
        &a.source(),
        a.text_len(&rs),
        a.style(),
    )?;
    print!("{}", to_markdown(&rs));
    eprintln!(
        "kvrun: wrote {}, {}, {}",
        csv.display(),
        json.display(),
        svg.display()
    );
    Ok(())
}
