//! `kvrun eval perturbation`: how much a compression event changes what
//! attention writes into the residual stream, for an attention-only
//! selection and for its CriticalKV variant (the analysis of CriticalKV,
//! arXiv 2502.03805, §5).
//!
//! The prompt (the first `--ctx` tokens of a text) is prefilled whole into
//! a per-(layer, KV-head) stream cache that evicts nothing; the last `w`
//! prompt queries are kept (the observation window). At that moment every
//! head is compressed to `B` entries twice: by the base rule on the
//! observation-window scores A (SnapKV: each head's top B; Ada-KV: the
//! layer's heads share H·B, 20% safeguard) and by CriticalKV on the same
//! A with the projected value norms N. For every (layer, KV head) the
//! perturbation is the L1 size of the change of the head group's output
//! once projected by W_O, averaged over the window's queries:
//!
//!   Δ_{l,h} = mean_r Σ_{q ∈ group(h)} ‖(o_full,q,r − o_kept,q,r) · W_O^(q)‖₁,
//!
//! o = softmax(q·K/√d) V over all keys or over the kept ones. Reported per
//! layer (both means, and the share of heads where CriticalKV is lower),
//! overall, and at the output: the next `--next` tokens of the text are fed
//! teacher-forced through the full cache and both compressed caches, and
//! the mean KL(full ‖ compressed) of the next-token distributions and the
//! relative L2 change of the final layer's input are reported. Writes a
//! markdown table, JSON and an SVG plot (per layer) to `--out`.

use crate::backend::cpu::Cpu;
use crate::cmd::args::{resolve_model, resolve_threads, ModelArgs};
use crate::cmd::eval::fidelity::TextArgs;
use crate::cmd::load_model;
use crate::error::{Error, Result};
use crate::generate::{KvPolicy, Session, StepObserver};
use crate::model::llama::Logits;
use crate::model::{BackendWeights, ModelView, Weights};
use crate::policy::critical::{two_stage, two_stage_shared, Critical, CriticalOptions};
use crate::policy::snapkv::{window_scores, SnapOptions};
use crate::policy::streams::stream_offsets;
use crate::policy::wrap::Rescorer;
use crate::policy::{find, table::ScorerOptions, CacheShape, Evictor, Step};
use crate::signals::Needs;
use clap::Args;
use serde::Serialize;
use std::fmt::Write as _;
use std::path::PathBuf;

/// Flags of `kvrun eval perturbation`.
#[derive(Args, Debug, Clone)]
pub struct PerturbArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub text: TextArgs,
    /// Prompt tokens (the first N of the text).
    #[arg(long = "ctx", default_value_t = 2048)]
    pub ctx: usize,
    /// Per-head budgets B to compress to (comma-separated).
    #[arg(long = "budgets", default_value = "128,256,512", value_delimiter = ',')]
    pub budgets: Vec<usize>,
    /// Base allocations: snapkv (each head keeps B) and/or adakv (a layer's heads share H·B).
    #[arg(long = "rules", default_value = "snapkv,adakv", value_delimiter = ',')]
    pub rules: Vec<String>,
    /// Observation window (queries that vote and whose outputs are compared).
    #[arg(long = "obs-window", default_value_t = 32)]
    pub obs_window: usize,
    /// Continuation tokens fed after the compression to measure the output perturbation.
    #[arg(long = "next", default_value_t = 32)]
    pub next: usize,
    /// CriticalKV's stage-1 fraction α.
    #[arg(long = "critical-alpha", default_value_t = 0.5)]
    pub alpha: f32,
    /// Directory for perturbation.{md,json,svg} (default: print the table only).
    #[arg(long = "out")]
    pub out: Option<PathBuf>,
}

/// One (rule, budget) point.
#[derive(Debug, Clone, Serialize)]
pub struct PerturbPoint {
    pub rule: String,
    pub budget: usize,
    /// (n_layers,) mean Δ over the layer's KV heads: base, critical.
    pub layer_base: Vec<f64>,
    pub layer_critical: Vec<f64>,
    /// (n_layers,) share of the layer's heads where critical < base.
    pub layer_share: Vec<f64>,
    /// Over every head: share where critical < base; reduction of the
    /// total (1 − Σ critical / Σ base; negative = critical perturbs more).
    pub share: f64,
    pub mean_reduction: f64,
    /// Next-token KL(full ‖ compressed) over the continuation.
    pub kl_base: f64,
    pub kl_critical: f64,
    /// Relative L2 change of the last layer's input over the continuation.
    pub hidden_base: f64,
    pub hidden_critical: f64,
}

/// Records the last layer's attention input of every step.
struct LastInput(Vec<f32>, usize);

impl StepObserver for LastInput {
    fn needs(&self) -> Needs {
        Needs {
            attn_inputs: true,
            ..Needs::none()
        }
    }
    fn on_step(&mut self, st: &Step<'_>) {
        if let Some(a) = &st.signals.attn_inputs {
            self.0.extend_from_slice(a.layer(self.1));
        }
    }
}

/// A stream-layout session that evicts nothing (its budget exceeds the
/// text) and keeps the last `snap.window` queries.
fn stream_session<'w>(
    w: &'w Weights<'w>,
    n_ctx: usize,
    n_threads: usize,
    snap: SnapOptions,
) -> Result<Session<'w>> {
    let p = find("snapkv")
        .map(|d| {
            d.build(&ScorerOptions {
                snap,
                ..Default::default()
            })
        })
        .transpose()?
        .flatten()
        .ok_or_else(|| Error::Other("snapkv is not registered".into()))?;
    let e = Evictor {
        budget: n_ctx + 8,
        n_sink: 4,
        n_recent: snap.window,
        keep_prompt_until: 0,
        evict_every: 1,
    };
    Session::with_policy(w, n_ctx, n_threads, 512, KvPolicy::new(p, e))
}

fn log_softmax(x: &[f32]) -> Vec<f64> {
    let m = x.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let z: f64 = x.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln() + m;
    x.iter().map(|&v| v as f64 - z).collect()
}

/// Run the analysis.
pub fn eval_perturbation(a: &PerturbArgs) -> Result<Vec<PerturbPoint>> {
    let _ = resolve_model(&a.model.model)?;
    let n_threads = resolve_threads(a.model.threads)?;
    if a.obs_window == 0 || a.budgets.contains(&0) {
        return Err(Error::arg("--obs-window/--budgets", "must be at least 1"));
    }
    for r in &a.rules {
        if r != "snapkv" && r != "adakv" {
            return Err(Error::arg(
                "--rules",
                format!("unknown rule '{r}' (known: snapkv, adakv)"),
            ));
        }
    }
    let model = load_model(&a.model)?;
    let (w, tok) = (model.weights(), &model.tokenizer);
    let c = w.config.clone();
    let text = a.text.load()?;
    let ids = tok.encode(&text, true, false)?;
    if ids.len() < a.ctx + a.next || a.ctx <= a.obs_window {
        return Err(Error::arg(
            "--ctx",
            format!(
                "the text has {} tokens; --ctx {} + --next {} needed (and ctx above the window)",
                ids.len(),
                a.ctx,
                a.next
            ),
        ));
    }
    let (prompt, cont) = (&ids[..a.ctx], &ids[a.ctx..a.ctx + a.next]);
    let n_ctx = a.ctx + a.next + 1;
    let (nl, nkv, hd, dim) = (c.n_cache_layers(), c.n_kv_heads, c.head_dim, c.dim);
    let group = c.n_heads / nkv;
    let q_dim = c.n_heads * hd;

    // a stream cache that evicts nothing (budget above the text), keeping
    // the last w queries
    let snap = SnapOptions {
        window: a.obs_window,
        ..SnapOptions::default()
    };
    let make = || stream_session(w, n_ctx, n_threads, snap);
    let mut full = make()?;
    let mut last = LastInput(Vec::new(), nl - 1);
    full.feed_observed(prompt, Logits::Last, &mut last)?;
    let st = full
        .kv
        .streams()
        .ok_or_else(|| Error::Other("expected a stream cache".into()))?
        .clone();
    let ns = st.n_streams();
    let qw = full
        .queries()
        .ok_or_else(|| Error::Other("no query window recorded".into()))?
        .clone();
    // A: observation-window scores of every entry (window forced kept)
    let mut off = Vec::new();
    stream_offsets(&full.kv, &mut off);
    let mut score = vec![0f32; off[ns]];
    window_scores(
        &full.kv,
        &qw,
        full.pool(),
        snap.kernel,
        &vec![true; ns],
        &off,
        &mut score,
    );
    // sinks are protected by the evictor in every policy
    for s in 0..ns {
        for (j, &p) in st.stream(s).1.iter().enumerate() {
            if p < 4 {
                score[off[s] + j] = f32::INFINITY;
            }
        }
    }
    // N: projected value norms of every entry
    let cpu = Cpu::new(n_threads);
    let weights = BackendWeights::new(&cpu, w);
    let view = ModelView::new(&c, &weights);
    let mut crit = Critical::new(CriticalOptions {
        alpha: a.alpha,
        ..CriticalOptions::default()
    });
    crit.prepare(
        &view,
        CacheShape {
            n_slots: full.kv.cells.n_slots(),
            budget: n_ctx,
        },
    )?;
    let mut norm = vec![0f32; off[ns]];
    let mut vbuf = Vec::new();
    for s in 0..ns {
        let (l, h) = (s / nkv, s % nkv);
        let slots = st.stream(s).0;
        vbuf.resize(slots.len() * hd, 0.0);
        full.kv.read_heads(false, l, h, slots, &mut vbuf);
        crit.norms_of(l, h, &vbuf, &mut norm[off[s]..off[s + 1]]);
    }
    // the full cache's continuation
    let mut full_last = LastInput(Vec::new(), nl - 1);
    let full_logits = full
        .feed_observed(cont, Logits::All, &mut full_last)?
        .to_vec();
    let wo: Vec<Vec<f32>> = (0..nl)
        .map(|l| {
            let mut m = Vec::new();
            view.wo_f32(l, &mut m).map(|_| m)
        })
        .collect::<Result<_>>()?;
    let opts = CriticalOptions {
        alpha: a.alpha,
        ..CriticalOptions::default()
    };
    let mut points = Vec::new();
    for rule in &a.rules {
        for &b in &a.budgets {
            // kept sets per stream: base and critical
            let mut keep_base = vec![false; off[ns]];
            let mut keep_crit = vec![false; off[ns]];
            let mut out = vec![0f32; off[ns]];
            let mut idx = Vec::new();
            let top = |x: &[f32], k: usize, mark: &mut [bool]| {
                let mut o: Vec<usize> = (0..x.len()).collect();
                o.sort_by(|&i, &j| x[j].total_cmp(&x[i]).then(j.cmp(&i)));
                for &i in o.iter().take(k) {
                    mark[i] = true;
                }
            };
            if rule == "snapkv" {
                for s in 0..ns {
                    let r = off[s]..off[s + 1];
                    top(&score[r.clone()], b, &mut keep_base[r.clone()]);
                    two_stage(
                        &score[r.clone()],
                        &norm[r.clone()],
                        b,
                        &opts,
                        false,
                        &mut idx,
                        &mut out[r.clone()],
                    );
                    top(&out[r.clone()], b, &mut keep_crit[r]);
                }
            } else {
                let guard = (0.2 * b as f32).floor() as usize;
                for l in 0..nl {
                    let r = off[l * nkv]..off[(l + 1) * nkv];
                    let goff: Vec<usize> = off[l * nkv..=(l + 1) * nkv]
                        .iter()
                        .map(|&x| x - r.start)
                        .collect();
                    // Ada-KV: safeguard, then the layer's top H·B
                    let mut g = score[r.clone()].to_vec();
                    for s in 0..nkv {
                        let sr = goff[s]..goff[s + 1];
                        let mut m = vec![false; sr.len()];
                        top(&g[sr.clone()], guard, &mut m);
                        for (i, k) in m.into_iter().enumerate() {
                            if k {
                                g[sr.start + i] = f32::INFINITY;
                            }
                        }
                    }
                    top(&g, nkv * b, &mut keep_base[r.clone()]);
                    two_stage_shared(
                        &score[r.clone()],
                        &norm[r.clone()],
                        &goff,
                        nkv * b,
                        guard,
                        &opts,
                        &mut idx,
                        &mut out[r.clone()],
                    );
                    top(&out[r.clone()], nkv * b, &mut keep_crit[r]);
                }
            }
            // Δ per (layer, KV head) over the window's queries
            let mut delta = vec![(0f64, 0f64); ns];
            let scale = 1.0 / (hd as f64).sqrt();
            let (mut kf, mut vf) = (Vec::new(), Vec::new());
            for s in 0..ns {
                let (l, h) = (s / nkv, s % nkv);
                let (slots, pos) = st.stream(s);
                let n = slots.len();
                kf.resize(n * hd, 0.0);
                vf.resize(n * hd, 0.0);
                full.kv.read_heads(true, l, h, slots, &mut kf);
                full.kv.read_heads(false, l, h, slots, &mut vf);
                let kb = &keep_base[off[s]..off[s + 1]];
                let kc = &keep_crit[off[s]..off[s + 1]];
                let mut sum = (0f64, 0f64);
                for r in 0..qw.len() {
                    let (q, qp) = qw.row(l, r);
                    let nv = pos.partition_point(|&p| p <= qp);
                    for qh in h * group..(h + 1) * group {
                        let qv = &q[qh * hd..(qh + 1) * hd];
                        let lg: Vec<f64> = (0..nv)
                            .map(|j| {
                                kf[j * hd..(j + 1) * hd]
                                    .iter()
                                    .zip(qv)
                                    .map(|(&k, &x)| k as f64 * x as f64)
                                    .sum::<f64>()
                                    * scale
                            })
                            .collect();
                        let attn = |keep: Option<&[bool]>| {
                            let ok = |j: usize| keep.is_none_or(|k| k[j]);
                            let m = (0..nv)
                                .filter(|&j| ok(j))
                                .map(|j| lg[j])
                                .fold(f64::NEG_INFINITY, f64::max);
                            let mut o = vec![0f64; hd];
                            let mut z = 0f64;
                            for j in (0..nv).filter(|&j| ok(j)) {
                                let p = (lg[j] - m).exp();
                                z += p;
                                for (y, &v) in o.iter_mut().zip(&vf[j * hd..(j + 1) * hd]) {
                                    *y += p * v as f64;
                                }
                            }
                            o.iter_mut().for_each(|y| *y /= z.max(1e-300));
                            o
                        };
                        let of = attn(None);
                        let proj = |o: &[f64]| -> f64 {
                            // ‖(o_full − o) · W_O^(qh)‖₁
                            let d: Vec<f64> = of.iter().zip(o).map(|(x, y)| x - y).collect();
                            (0..dim)
                                .map(|i| {
                                    let row =
                                        &wo[l][i * q_dim + qh * hd..i * q_dim + (qh + 1) * hd];
                                    row.iter()
                                        .zip(&d)
                                        .map(|(&wv, &x)| wv as f64 * x)
                                        .sum::<f64>()
                                        .abs()
                                })
                                .sum()
                        };
                        sum.0 += proj(&attn(Some(kb)));
                        sum.1 += proj(&attn(Some(kc)));
                    }
                }
                let rows = qw.len().max(1) as f64;
                delta[s] = (sum.0 / rows, sum.1 / rows);
            }
            // the output: the continuation through both compressed caches
            let mut out_pert = Vec::new();
            for keep in [&keep_base, &keep_crit] {
                let mut sess = make()?;
                sess.kv = full.kv.clone();
                sess.n_past = a.ctx;
                // drop what the full cache's continuation added, then the evicted entries
                let mut victims = sess.kv.entries_in(a.ctx, n_ctx);
                for s in 0..ns {
                    for (j, &sl) in st.stream(s).0.iter().enumerate() {
                        if !keep[off[s] + j] {
                            victims.push(sl);
                        }
                    }
                }
                sess.kv.apply(&victims, &[], &mut Vec::new())?;
                let mut li = LastInput(Vec::new(), nl - 1);
                let lg = sess.feed_observed(cont, Logits::All, &mut li)?.to_vec();
                let v = c.vocab;
                let mut kl = 0f64;
                for t in 0..cont.len() {
                    let p = log_softmax(&full_logits[t * v..(t + 1) * v]);
                    let q = log_softmax(&lg[t * v..(t + 1) * v]);
                    kl += p
                        .iter()
                        .zip(&q)
                        .map(|(&x, &y)| x.exp() * (x - y))
                        .sum::<f64>();
                }
                let (mut num, mut den) = (0f64, 0f64);
                for (x, y) in full_last.0.iter().zip(&li.0) {
                    num += ((x - y) as f64).powi(2);
                    den += (*x as f64).powi(2);
                }
                out_pert.push((kl / cont.len() as f64, (num / den.max(1e-300)).sqrt()));
            }
            let per_layer = |f: &dyn Fn(&(f64, f64)) -> f64| -> Vec<f64> {
                (0..nl)
                    .map(|l| delta[l * nkv..(l + 1) * nkv].iter().map(f).sum::<f64>() / nkv as f64)
                    .collect()
            };
            let better = |d: &(f64, f64)| if d.1 < d.0 { 1.0 } else { 0.0 };
            let (tb, tc) = delta
                .iter()
                .fold((0f64, 0f64), |(x, y), d| (x + d.0, y + d.1));
            points.push(PerturbPoint {
                rule: rule.clone(),
                budget: b,
                layer_base: per_layer(&|d| d.0),
                layer_critical: per_layer(&|d| d.1),
                layer_share: per_layer(&better),
                share: delta.iter().map(better).sum::<f64>() / ns as f64,
                mean_reduction: if tb > 0.0 { 1.0 - tc / tb } else { 0.0 },
                kl_base: out_pert[0].0,
                kl_critical: out_pert[1].0,
                hidden_base: out_pert[0].1,
                hidden_critical: out_pert[1].1,
            });
        }
    }
    Ok(points)
}

/// The markdown summary table.
pub fn to_markdown(ps: &[PerturbPoint]) -> String {
    let mut s = String::from(
        "| base | B | heads where critical is lower | total reduction | KL base | KL critical | last-layer input Δ base | Δ critical |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n",
    );
    for p in ps {
        let _ = writeln!(
            s,
            "| {} | {} | {:.1}% | {:+.1}% | {:.4} | {:.4} | {:.4} | {:.4} |",
            p.rule,
            p.budget,
            100.0 * p.share,
            100.0 * p.mean_reduction,
            p.kl_base,
            p.kl_critical,
            p.hidden_base,
            p.hidden_critical
        );
    }
    s
}

/// Per-layer SVG: mean Δ of the base (solid) and CriticalKV (dashed) for
/// every point.
pub fn to_svg(ps: &[PerturbPoint]) -> String {
    let (w, h) = (900.0f64, 480.0f64);
    let (l, r, t, b) = (70.0, 690.0, 40.0, 420.0);
    let nl = ps.first().map_or(1, |p| p.layer_base.len()).max(2);
    let ymax = ps
        .iter()
        .flat_map(|p| p.layer_base.iter().chain(&p.layer_critical))
        .fold(0f64, |a, &x| a.max(x))
        .max(1e-9);
    let px = |i: usize| l + i as f64 / (nl - 1) as f64 * (r - l);
    let py = |v: f64| b - v / ymax * (b - t);
    let colors = [
        "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
    ];
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"{l}\" y=\"24\" font-size=\"14\">attention-output perturbation per layer (solid: base, dashed: CriticalKV)</text>\n<line x1=\"{l}\" y1=\"{b}\" x2=\"{r}\" y2=\"{b}\" stroke=\"black\"/>\n<line x1=\"{l}\" y1=\"{t}\" x2=\"{l}\" y2=\"{b}\" stroke=\"black\"/>\n<text x=\"{}\" y=\"{}\">layer</text>\n<text x=\"{}\" y=\"{}\">0</text><text x=\"{}\" y=\"{}\">{ymax:.3}</text>\n",
        (l + r) / 2.0,
        b + 32.0,
        l - 14.0,
        b + 4.0,
        l - 62.0,
        t + 4.0,
    );
    for (i, p) in ps.iter().enumerate() {
        let col = colors[i % colors.len()];
        for (vals, dash) in [
            (&p.layer_base, ""),
            (&p.layer_critical, " stroke-dasharray=\"6,4\""),
        ] {
            let pts: Vec<String> = vals
                .iter()
                .enumerate()
                .map(|(k, &v)| format!("{:.1},{:.1}", px(k), py(v)))
                .collect();
            let _ = writeln!(
                s,
                "<polyline fill=\"none\" stroke=\"{col}\" stroke-width=\"2\"{dash} points=\"{}\"/>",
                pts.join(" ")
            );
        }
        let _ = writeln!(
            s,
            "<text x=\"{}\" y=\"{}\" fill=\"{col}\">{} B={}: {:.0}% of heads lower</text>",
            r + 10.0,
            t + 16.0 + 18.0 * i as f64,
            p.rule,
            p.budget,
            100.0 * p.share
        );
    }
    s.push_str("</svg>\n");
    s
}

/// `kvrun eval perturbation` printing and files.
pub fn run_perturbation(a: &PerturbArgs) -> Result<()> {
    let ps = eval_perturbation(a)?;
    let md = to_markdown(&ps);
    print!("{md}");
    if let Some(dir) = &a.out {
        std::fs::create_dir_all(dir).map_err(|source| Error::Io {
            path: dir.clone(),
            source,
        })?;
        let write = |name: &str, body: &str| {
            let p = dir.join(name);
            std::fs::write(&p, body).map_err(|source| Error::Io { path: p, source })
        };
        write("perturbation.md", &md)?;
        write(
            "perturbation.json",
            &serde_json::to_string_pretty(&ps).map_err(|e| Error::Other(e.to_string()))?,
        )?;
        write("perturbation.svg", &to_svg(&ps))?;
    }
    Ok(())
}
