//! A self-contained SVG line plot of a metric against the KV budget (x on a
//! log2 scale, one tick per budget; y linear or, with `log_y`, log10 with
//! a tick per decade), shared by `eval sweep` (fidelity) and `batch report`
//! (accuracy). [`panels_svg`] lays several plots out as a grid in one SVG
//! (the sweep's one panel per policy family). No plotting dependency: the page is written by
//! hand, so it opens anywhere (browser, GitHub, an image viewer).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// `PREFIX.ext` (the prefix may hold dots of its own).
pub fn with_ext(prefix: &Path, ext: &str) -> PathBuf {
    let mut s = prefix.as_os_str().to_owned();
    s.push(".");
    s.push(ext);
    PathBuf::from(s)
}

/// Line colours, in series order.
pub const PALETTE: &[&str] = &[
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
    "#7f7f7f", "#bcbd22",
];

/// One polyline.
#[derive(Debug, Clone)]
pub struct Line {
    /// Legend label (and the hover text's name).
    pub label: String,
    /// Lines of one group (a policy and its segment) share a `<g
    /// class="policy" data-policy=GROUP>`.
    pub group: String,
    pub color: &'static str,
    /// Dashed, with hollow markers (a segment, or a reference line).
    pub dashed: bool,
    /// (budget, value); non-finite values are left out.
    pub pts: Vec<(usize, f64)>,
}

/// The plot: titles, axes and lines.
#[derive(Debug, Clone, Default)]
pub struct LinePlot {
    pub title: String,
    pub subtitle: Option<String>,
    /// Y axis label.
    pub y_label: String,
    /// Short metric name for hover texts.
    pub y_short: String,
    /// Values the y range must include (e.g. 0 for a divergence, 1 for a rate).
    pub y_include: Vec<f64>,
    /// A dotted vertical marker at this budget, with its label.
    pub x_marker: Option<(usize, String)>,
    pub lines: Vec<Line>,
    /// Log10 y axis: values ≤ 0 cannot be drawn and are left out (and
    /// `y_include` values ≤ 0 ignored).
    pub log_y: bool,
}

/// Escape text for SVG/HTML content and attribute values.
pub fn xml_escape(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&apos;"),
            _ => o.push(c),
        }
    }
    o
}

/// "Nice" axis ticks (1-2-5 steps) covering [lo, hi].
fn nice_ticks(lo: f64, hi: f64, target: usize) -> (f64, f64, f64) {
    let span = (hi - lo).max(1e-12);
    let raw = span / target.max(1) as f64;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|&s| s >= raw)
        .unwrap_or(10.0 * mag);
    ((lo / step).floor() * step, (hi / step).ceil() * step, step)
}

fn fmt_tick(v: f64, step: f64) -> String {
    let dec = if step >= 1.0 {
        0
    } else {
        (-step.log10()).ceil().max(0.0) as usize + 1
    };
    let s = format!("{v:.dec$}");
    let s = if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_owned()
    } else {
        s
    };
    if s == "-0" {
        "0".into()
    } else {
        s
    }
}

/// Decade ticks of a log10 axis covering [lo, hi] (both > 0): (log lo,
/// log hi, tick values).
fn log_ticks(lo: f64, hi: f64) -> (f64, f64, Vec<f64>) {
    let (a, z) = (
        lo.log10().floor(),
        hi.log10().ceil().max(lo.log10().floor() + 1.0),
    );
    let ticks = (a as i32..=z as i32).map(|e| 10f64.powi(e)).collect();
    (a, z, ticks)
}

/// A log-axis tick label: 1e-4, 0.001, 0.01, 0.1, 1, 10, 100, 1000, 1e4.
fn fmt_log_tick(v: f64) -> String {
    let e = v.log10().round() as i32;
    match e {
        -3..=-1 => format!("0.{}1", "0".repeat((-e - 1) as usize)),
        0..=3 => format!("1{}", "0".repeat(e as usize)),
        _ => format!("1e{e}"),
    }
}

/// Several plots in one SVG document, `cols` per row, each panel scaled to
/// `panel_w` pixels wide, under a common title.
pub fn panels_svg(
    title: &str,
    subtitle: Option<&str>,
    panels: &[LinePlot],
    cols: usize,
    panel_w: f64,
) -> String {
    let cols = cols.clamp(1, panels.len().max(1));
    let rows = panels.len().div_ceil(cols).max(1);
    let scale = panel_w / PLOT_W;
    let panel_h = PLOT_H * scale;
    let top = if subtitle.is_some() { 56.0 } else { 40.0 };
    let (w, h) = (panel_w * cols as f64, top + panel_h * rows as f64);
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w:.0}" height="{h:.0}" viewBox="0 0 {w:.0} {h:.0}" font-family="Helvetica, Arial, sans-serif" font-size="12">"#
    );
    let _ = writeln!(
        s,
        r#"<rect x="0" y="0" width="{w:.0}" height="{h:.0}" fill="white"/>"#
    );
    let _ = writeln!(
        s,
        r#"<text x="{:.0}" y="26" text-anchor="middle" font-size="18" font-weight="bold">{}</text>"#,
        w / 2.0,
        xml_escape(title)
    );
    if let Some(sub) = subtitle {
        let _ = writeln!(
            s,
            r##"<text x="{:.0}" y="46" text-anchor="middle" fill="#555">{}</text>"##,
            w / 2.0,
            xml_escape(sub)
        );
    }
    for (i, p) in panels.iter().enumerate() {
        let (x, y) = (
            (i % cols) as f64 * panel_w,
            top + (i / cols) as f64 * panel_h,
        );
        s.push_str(&p.render(Some((x, y, panel_w, panel_h))));
    }
    s.push_str("</svg>\n");
    s
}

/// The size of one plot, in its own units.
const PLOT_W: f64 = 900.0;
const PLOT_H: f64 = 520.0;

impl LinePlot {
    /// The SVG document.
    pub fn svg(&self) -> String {
        self.render(None)
    }

    /// The plot as a whole document (`None`) or as a nested `<svg>` placed
    /// at (x, y) with that width and height (a panel of [`panels_svg`]).
    fn render(&self, place: Option<(f64, f64, f64, f64)>) -> String {
        let (w, h) = (PLOT_W, PLOT_H);
        let (l, r, t, b) = (80.0, 700.0, 60.0, 450.0); // plot area
        let mut budgets: Vec<usize> = self
            .lines
            .iter()
            .flat_map(|x| x.pts.iter().map(|p| p.0))
            .filter(|&b| b > 0)
            .collect();
        budgets.sort_unstable();
        budgets.dedup();
        // y range
        let ys = self
            .lines
            .iter()
            .flat_map(|x| x.pts.iter().map(|p| p.1))
            .chain(self.y_include.iter().copied())
            .filter(|v| v.is_finite());
        let (mut ylo, mut yhi) = ys.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), v| {
            (a.min(v), b.max(v))
        });
        if !ylo.is_finite() {
            (ylo, yhi) = (0.0, 1.0);
        }
        if yhi - ylo < 1e-9 {
            let pad = if yhi.abs() > 1e-9 {
                yhi.abs() * 0.1
            } else {
                0.1
            };
            ylo -= pad;
            yhi += pad;
        }
        // log y: the positive values only, one tick per decade
        let log_range = if self.log_y {
            let pos = self
                .lines
                .iter()
                .flat_map(|x| x.pts.iter().map(|p| p.1))
                .chain(self.y_include.iter().copied())
                .filter(|v| v.is_finite() && *v > 0.0);
            let (lo, hi) = pos.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), v| {
                (a.min(v), b.max(v))
            });
            Some(if lo.is_finite() {
                log_ticks(lo, hi)
            } else {
                log_ticks(0.1, 1.0)
            })
        } else {
            None
        };
        let (ylo, yhi, ystep) = match &log_range {
            Some((a, z, _)) => (*a, *z, 1.0),
            None => nice_ticks(ylo, yhi, 6),
        };
        // x range (log2)
        let (xlo, xhi) = match (budgets.first(), budgets.last()) {
            (Some(&a), Some(&z)) if z > a => ((a as f64).log2(), (z as f64).log2()),
            (Some(&a), _) => ((a as f64).log2() - 1.0, (a as f64).log2() + 1.0),
            _ => (0.0, 1.0),
        };
        let xpad = 0.05 * (xhi - xlo);
        let (xlo, xhi) = (xlo - xpad, xhi + xpad);
        let px = |bud: usize| l + ((bud as f64).log2() - xlo) / (xhi - xlo) * (r - l);
        let log_y = self.log_y;
        let py = |v: f64| {
            let v = if log_y { v.log10() } else { v };
            b - (v - ylo) / (yhi - ylo) * (b - t)
        };

        let mut s = String::new();
        match place {
            None => {
                let _ = writeln!(
                    s,
                    r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="Helvetica, Arial, sans-serif" font-size="12">"#
                );
            }
            Some((x, y, pw, ph)) => {
                let _ = writeln!(
                    s,
                    r#"<svg x="{x:.1}" y="{y:.1}" width="{pw:.1}" height="{ph:.1}" viewBox="0 0 {w} {h}">"#
                );
            }
        }
        let _ = writeln!(
            s,
            r#"<rect x="0" y="0" width="{w}" height="{h}" fill="white"/>"#
        );
        let _ = writeln!(
            s,
            r#"<text x="{}" y="28" text-anchor="middle" font-size="16" font-weight="bold">{}</text>"#,
            (l + r) / 2.0,
            xml_escape(&self.title)
        );
        if let Some(sub) = &self.subtitle {
            let _ = writeln!(
                s,
                r##"<text x="{}" y="46" text-anchor="middle" fill="#555">{}</text>"##,
                (l + r) / 2.0,
                xml_escape(sub)
            );
        }
        // grid + y ticks
        let n_yt = ((yhi - ylo) / ystep).round() as usize;
        for i in 0..=n_yt {
            let v = ylo + i as f64 * ystep;
            let (y, label) = match &log_range {
                Some((_, _, ticks)) => {
                    let tv = ticks.get(i).copied().unwrap_or(10f64.powf(v));
                    (py(tv), fmt_log_tick(tv))
                }
                None => (py(v), fmt_tick(v, ystep)),
            };
            if log_y {
                // minor ticks at 2× and 5× inside the decade
                for m in [2.0, 5.0] {
                    let mv = 10f64.powf(v) * m;
                    if i < n_yt {
                        let my = py(mv);
                        let _ = writeln!(
                            s,
                            r##"<line x1="{l}" y1="{my:.2}" x2="{r}" y2="{my:.2}" stroke="#f2f2f2"/>"##
                        );
                    }
                }
            }
            let _ = writeln!(
                s,
                r##"<line x1="{l}" y1="{y:.2}" x2="{r}" y2="{y:.2}" stroke="#e5e5e5"/>"##
            );
            let _ = writeln!(
                s,
                r#"<line x1="{}" y1="{y:.2}" x2="{l}" y2="{y:.2}" stroke="black"/>"#,
                l - 5.0
            );
            let _ = writeln!(
                s,
                r#"<text x="{}" y="{:.2}" text-anchor="end">{}</text>"#,
                l - 8.0,
                y + 4.0,
                label
            );
        }
        // x ticks at each budget
        for &bud in &budgets {
            let x = px(bud);
            let _ = writeln!(
                s,
                r##"<line x1="{x:.2}" y1="{t}" x2="{x:.2}" y2="{b}" stroke="#e5e5e5"/>"##
            );
            let _ = writeln!(
                s,
                r#"<line x1="{x:.2}" y1="{b}" x2="{x:.2}" y2="{}" stroke="black"/>"#,
                b + 5.0
            );
            let _ = writeln!(
                s,
                r#"<text x="{x:.2}" y="{}" text-anchor="middle">{bud}</text>"#,
                b + 20.0
            );
        }
        if let Some((n, label)) = &self.x_marker {
            let lx = (*n as f64).log2();
            if *n > 0 && lx > xlo && lx < xhi {
                let x = l + (lx - xlo) / (xhi - xlo) * (r - l);
                let _ = writeln!(
                    s,
                    r##"<line x1="{x:.2}" y1="{t}" x2="{x:.2}" y2="{b}" stroke="#999" stroke-dasharray="2,3"/>"##
                );
                let _ = writeln!(
                    s,
                    r##"<text x="{:.2}" y="{}" fill="#777" font-size="10">{}</text>"##,
                    x + 3.0,
                    t + 12.0,
                    xml_escape(label)
                );
            }
        }
        // axes
        let _ = writeln!(
            s,
            r#"<line x1="{l}" y1="{b}" x2="{r}" y2="{b}" stroke="black"/>"#
        );
        let _ = writeln!(
            s,
            r#"<line x1="{l}" y1="{t}" x2="{l}" y2="{b}" stroke="black"/>"#
        );
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" text-anchor="middle" font-size="13">KV budget (tokens, log2 scale)</text>"#,
            (l + r) / 2.0,
            b + 42.0
        );
        let _ = writeln!(
            s,
            r#"<text x="22" y="{}" text-anchor="middle" font-size="13" transform="rotate(-90 22 {})">{}</text>"#,
            (t + b) / 2.0,
            (t + b) / 2.0,
            xml_escape(&if log_y {
                format!("{} (log scale)", self.y_label)
            } else {
                self.y_label.clone()
            })
        );
        // lines, grouped
        let mut open: Option<&str> = None;
        for line in &self.lines {
            if open != Some(line.group.as_str()) {
                if open.is_some() {
                    s.push_str("</g>\n");
                }
                let _ = writeln!(
                    s,
                    r#"<g class="policy" data-policy="{}">"#,
                    xml_escape(&line.group)
                );
                open = Some(&line.group);
            }
            let mut pts: Vec<(usize, f64)> = line
                .pts
                .iter()
                .copied()
                .filter(|p| p.0 > 0 && p.1.is_finite() && (!log_y || p.1 > 0.0))
                .collect();
            pts.sort_by_key(|p| p.0);
            let color = line.color;
            let (width, dash, fill, radius) = if line.dashed {
                ("1.5", r#" stroke-dasharray="6,4""#, "white", "3")
            } else {
                ("2", "", color, "3.5")
            };
            let poly: Vec<String> = pts
                .iter()
                .map(|p| format!("{:.2},{:.2}", px(p.0), py(p.1)))
                .collect();
            let _ = writeln!(
                s,
                r#"<polyline fill="none" stroke="{color}" stroke-width="{width}"{dash} points="{}"/>"#,
                poly.join(" ")
            );
            let ring = if line.dashed {
                format!(r#" stroke="{color}" stroke-width="1.5""#)
            } else {
                String::new()
            };
            for p in &pts {
                let _ = writeln!(
                    s,
                    r#"<circle cx="{:.2}" cy="{:.2}" r="{radius}" fill="{fill}"{ring}><title>{} {}: {} = {}</title></circle>"#,
                    px(p.0),
                    py(p.1),
                    xml_escape(&line.label),
                    p.0,
                    xml_escape(&self.y_short),
                    p.1
                );
            }
        }
        if open.is_some() {
            s.push_str("</g>\n");
        }
        // legend
        let lx = r + 20.0;
        let _ = writeln!(
            s,
            r##"<rect x="{}" y="{}" width="{}" height="{}" fill="white" stroke="#ccc"/>"##,
            lx - 8.0,
            t - 8.0,
            w - lx - 4.0,
            self.lines.len() as f64 * 20.0 + 10.0
        );
        for (i, line) in self.lines.iter().enumerate() {
            let y = t + 8.0 + i as f64 * 20.0;
            let color = line.color;
            let dash = if line.dashed {
                r#" stroke-dasharray="6,4""#
            } else {
                ""
            };
            let _ = writeln!(
                s,
                r#"<line x1="{lx}" y1="{y}" x2="{}" y2="{y}" stroke="{color}" stroke-width="2"{dash}/>"#,
                lx + 28.0
            );
            let fill = if line.dashed { "white" } else { color };
            let _ = writeln!(
                s,
                r#"<circle cx="{}" cy="{y}" r="3" fill="{fill}" stroke="{color}"/>"#,
                lx + 14.0
            );
            let _ = writeln!(
                s,
                r#"<text x="{}" y="{}">{}</text>"#,
                lx + 36.0,
                y + 4.0,
                xml_escape(&line.label)
            );
        }
        s.push_str("</svg>\n");
        s
    }
}
