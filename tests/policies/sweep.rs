//! `kvrun eval sweep`: one real sweep on WikiText-2 (2 policies × 2 budgets
//! with SmolLM2-135M), checking the CSV / JSON / SVG it writes; plus the
//! pure helpers (merging records, the plot) and argument errors.

use crate::util;

use kvrun::cmd::eval::fidelity::{Fidelity, PplReport};
use kvrun::cmd::eval::sweep::{
    family, heads_svg, merge_reports, to_csv, to_svg, to_svg_with, write_outputs, Metric,
    PlotStyle, CSV_HEADER,
};
use std::process::Command;

fn field<'a>(header: &[&str], row: &'a [&'a str], name: &str) -> &'a str {
    let i = header
        .iter()
        .position(|h| *h == name)
        .unwrap_or_else(|| panic!("no column {name}"));
    row[i]
}

#[test]
fn sweep_window_random_on_wikitext() {
    let model = util::default_model();
    let text = util::shared("wikitext2_test_lf.txt");
    let dir = std::env::temp_dir().join(format!("kvrun-sweep-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let prefix = dir.join("s");
    let out = Command::new(util::kvrun_bin())
        .args(["eval", "sweep", "-m"])
        .arg(&model)
        .arg("-f")
        .arg(&text)
        .args([
            "--ctx",
            "192",
            "--chunk",
            "8",
            "--policies",
            "window,random",
            "--budgets",
            "64,256",
        ])
        .args([
            "--kv-recent",
            "16",
            "--segment-last",
            "32",
            "-t",
            "2",
            "--out",
        ])
        .arg(&prefix)
        .output()
        .expect("run kvrun");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "exit {:?}\nstderr:\n{stderr}",
        out.status
    );
    // one progress line per run, a markdown table on stdout
    for (i, tag) in [
        "[1/4] window 64:",
        "[2/4] window 256:",
        "[3/4] random 64:",
        "[4/4] random 256:",
    ]
    .iter()
    .enumerate()
    {
        assert!(stderr.contains(tag), "progress line {i} missing: {stderr}");
    }
    assert!(stdout.starts_with("| policy | budget |"), "{stdout}");
    assert_eq!(
        stdout
            .lines()
            .filter(|l| l.starts_with("| window") || l.starts_with("| random"))
            .count(),
        4,
        "{stdout}"
    );

    // CSV
    let csv = std::fs::read_to_string(prefix.with_extension("csv")).expect("s.csv");
    let lines: Vec<&str> = csv.lines().collect();
    assert_eq!(lines.len(), 5, "{csv}");
    assert_eq!(lines[0], CSV_HEADER);
    let header: Vec<&str> = lines[0].split(',').collect();
    assert_eq!(header.len(), 17);
    let mut n_tokens = 0;
    for line in &lines[1..] {
        let row: Vec<&str> = line.split(',').collect();
        assert_eq!(row.len(), header.len(), "{line}");
        let num = |n: &str| {
            field(&header, &row, n)
                .parse::<f64>()
                .unwrap_or_else(|e| panic!("{n} in {line}: {e}"))
        };
        let budget = num("budget") as usize;
        n_tokens = num("n_tokens") as usize;
        assert_eq!(n_tokens, 192);
        assert_eq!(num("seg_n") as usize, 32);
        match budget {
            256 => {
                // the budget holds the whole text: nothing is evicted, the logits are the full cache's
                assert!(num("kl").abs() < 1e-9, "{line}");
                assert!(num("seg_kl").abs() < 1e-9, "{line}");
                assert!(num("delta_nll").abs() < 1e-9, "{line}");
                assert_eq!(num("top1"), 1.0, "{line}");
                assert_eq!(num("seg_top1"), 1.0, "{line}");
                assert_eq!(num("evicted"), 0.0, "{line}");
                assert_eq!(num("ppl"), num("ppl_full"), "{line}");
            }
            64 => {
                assert!(num("evicted") > 0.0, "{line}");
                assert!(num("peak_kv_entries") <= 64.0, "{line}");
                assert!(num("kl") > 0.0 && num("top1") < 1.0, "{line}");
            }
            b => panic!("unexpected budget {b}"),
        }
        assert!(num("peak_kv_bytes") > 0.0 && num("tok_s") > 0.0, "{line}");
    }
    let policies: Vec<&str> = lines[1..]
        .iter()
        .map(|l| l.split(',').next().unwrap())
        .collect();
    assert_eq!(policies, ["window", "window", "random", "random"]);

    // JSON
    let json = std::fs::read_to_string(prefix.with_extension("json")).expect("s.json");
    let v: serde_json::Value = serde_json::from_str(&json).expect("valid JSON");
    let arr = v.as_array().expect("a JSON array");
    assert_eq!(arr.len(), 4);
    for r in arr {
        assert!(
            r["policy"].is_string() && r["budget"].is_u64() && r["all"]["kl"].is_number(),
            "{r}"
        );
        assert_eq!(r["n_tokens"].as_u64(), Some(n_tokens as u64));
        assert!(r["segment"]["top1_agree"].is_number(), "{r}");
    }

    // SVG
    let svg = std::fs::read_to_string(prefix.with_extension("svg")).expect("s.svg");
    check_svg(&svg, &["window", "random"], true);
    assert!(
        svg.contains("wikitext2_test_lf.txt") && svg.contains("KL"),
        "title"
    );
    assert!(
        svg.contains("text length 192"),
        "the no-eviction boundary is marked"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Rough well-formedness: balanced tags, one line per policy (two with a segment), legend names.
fn check_svg(svg: &str, policies: &[&str], seg: bool) {
    assert!(
        svg.trim_start().starts_with("<svg"),
        "{}",
        &svg[..svg.len().min(200)]
    );
    assert!(svg.trim_end().ends_with("</svg>"));
    for tag in ["svg", "g", "text", "circle"] {
        let open =
            svg.matches(&format!("<{tag} ")).count() + svg.matches(&format!("<{tag}>")).count();
        let opener = format!("<{tag} ");
        let self_closed = svg.split(&opener).skip(1).filter(|s| {
            let end = s.find('>').unwrap();
            s[..end].ends_with('/')
        });
        let close = svg.matches(&format!("</{tag}>")).count();
        assert_eq!(open, close + self_closed.count(), "<{tag}> unbalanced");
    }
    let lines = svg.matches("<polyline").count() + svg.matches("<path").count();
    assert_eq!(
        lines,
        policies.len() * if seg { 2 } else { 1 },
        "one line per policy (and segment)"
    );
    for p in policies {
        assert!(
            svg.contains(&format!(r#"data-policy="{p}""#)),
            "no group for {p}"
        );
        assert!(svg.contains(&format!(">{p}</text>")), "legend lacks {p}");
        assert_eq!(
            svg.contains(&format!(">{p} (segment)</text>")),
            seg,
            "segment legend for {p}"
        );
    }
    assert!(
        !svg.contains("NaN") && !svg.contains("inf\"") && !svg.contains("inf,"),
        "non-finite coordinates"
    );
}

fn fid(n: usize, ppl: f64, kl: f64, top1: f64) -> Fidelity {
    Fidelity {
        n,
        ppl,
        ppl_full: ppl * 0.9,
        ppl_err: ppl * 0.05,
        delta_nll: (1.0f64 / 0.9).ln(),
        kl,
        top1_agree: top1,
    }
}

fn report(policy: &str, budget: usize, n: usize, kl: f64, seg: bool) -> PplReport {
    PplReport {
        policy: policy.into(),
        budget: Some(budget),
        n_tokens: n + 1,
        all: fid(n, 20.0, kl, 1.0 - kl),
        segment: seg.then(|| fid(n / 4, 40.0, 2.0 * kl, 1.0 - 2.0 * kl)),
        segment_start: seg.then_some(n - n / 4),
        peak_kv_entries: budget.min(n),
        peak_kv_bytes: budget.min(n) * 100,
        evicted: n.saturating_sub(budget),
        tokens_per_second: 10.0,
        stream_lengths: Vec::new(),
    }
}

/// y coordinates of the circles of policy `p`'s solid line, by budget order.
fn ys_of(svg: &str, p: &str) -> Vec<f64> {
    let g = svg
        .split(&format!(r#"data-policy="{p}">"#))
        .nth(1)
        .unwrap_or_else(|| panic!("no group {p}"));
    let g = &g[..g.find("</g>").unwrap()];
    g.split("<circle ")
        .skip(1)
        .filter(|c| c.contains(&format!("<title>{p} ")))
        .map(|c| {
            let y = c.split("cy=\"").nth(1).unwrap();
            y[..y.find('"').unwrap()].parse().unwrap()
        })
        .collect()
}

#[test]
fn plot_log_scale_and_family_panels() {
    // KL falling by 10× per budget doubling: evenly spaced on a log axis
    let mut rs = Vec::new();
    let pols = [
        "window",
        "h2o",
        "snapkv",
        "adakv",
        "critical-snapkv",
        "epikv",
    ];
    for p in pols {
        for (i, b) in [128, 256, 512, 1024].into_iter().enumerate() {
            rs.push(report(p, b, 2000, 0.5 / 10f64.powi(i as i32), false));
        }
    }
    // a zero (no eviction) is left out of a log plot, not drawn at -inf
    rs.push(report("window", 4096, 2000, 0.0, false));
    let log = to_svg_with(
        &rs,
        Metric::Kl,
        "wiki.txt",
        None,
        PlotStyle {
            log_y: true,
            by_family: false,
        },
    );
    check_svg(&log, &pols, false);
    assert!(
        log.contains("(log scale)"),
        "the axis says it is logarithmic"
    );
    for tick in [">0.001</text>", ">0.01</text>", ">0.1</text>", ">1</text>"] {
        assert!(log.contains(tick), "decade tick {tick}");
    }
    let ys = ys_of(&log, "window");
    assert_eq!(ys.len(), 4, "the zero point is not drawn: {ys:?}");
    let steps: Vec<f64> = ys.windows(2).map(|w| w[1] - w[0]).collect();
    for s in &steps {
        assert!((s - steps[0]).abs() < 0.05, "even decades: {steps:?}");
    }
    assert!(!log.contains("NaN") && !log.contains("inf"));
    // linear: the same values bunch up near zero
    let lin = to_svg(&rs, Metric::Kl, "wiki.txt", None);
    let ys = ys_of(&lin, "window");
    assert!(
        (ys[2] - ys[3]).abs() < 0.2 * (ys[0] - ys[1]).abs(),
        "{ys:?}"
    );

    // one panel per family: nested plots, each with its own lines only
    assert_eq!(family("snapkv"), family("adakv"));
    assert_eq!(family("window"), family("h2o"));
    assert_ne!(family("window"), family("snapkv"));
    assert_eq!(family("critical-snapkv"), "CriticalKV re-ranked");
    let fam = to_svg_with(
        &rs,
        Metric::Kl,
        "wiki.txt",
        None,
        PlotStyle {
            log_y: true,
            by_family: true,
        },
    );
    check_svg(&fam, &pols, false);
    let panels = fam.matches("<svg x=").count();
    assert_eq!(panels, 4, "token heuristics, per-head, CriticalKV, EPIKV");
    for f in [
        "token heuristics",
        "per-head (SnapKV family)",
        "CriticalKV re-ranked",
        "EPIKV",
    ] {
        assert!(fam.contains(&format!(">{f}</text>")), "panel {f}");
    }
    // a policy keeps its colour across layouts
    let colour = |svg: &str, p: &str| {
        let g = svg.split(&format!(r#"data-policy="{p}">"#)).nth(1).unwrap();
        let c = g.split("stroke=\"").nth(1).unwrap();
        c[..c.find('"').unwrap()].to_owned()
    };
    for p in pols {
        assert_eq!(colour(&fam, p), colour(&log, p), "{p}");
    }
}

#[test]
fn plot_and_csv_helpers() {
    let mut rs = Vec::new();
    for (p, k) in [("window", 0.2), ("h2o", 0.1), ("tova", 0.05)] {
        for (i, b) in [128, 256, 512, 1024].into_iter().enumerate() {
            rs.push(report(p, b, 700, k / (i + 1) as f64, false));
        }
    }
    for m in [Metric::Kl, Metric::DeltaNll, Metric::Top1, Metric::Ppl] {
        let svg = to_svg(&rs, m, "wiki.txt", Some(700));
        check_svg(&svg, &["window", "h2o", "tova"], false);
        assert!(svg.contains("text length 700"));
    }
    // names and sources are escaped
    let svg = to_svg(
        &[report("a<&>", 64, 100, 0.1, false)],
        Metric::Kl,
        "a & b.txt",
        None,
    );
    assert!(
        svg.contains("a &amp; b.txt") && svg.contains(">a&lt;&amp;&gt;</text>"),
        "{svg}"
    );
    // a single budget, constant values: still finite coordinates
    let one = vec![report("window", 64, 10, 0.0, true)];
    check_svg(&to_svg(&one, Metric::Kl, "x", Some(11)), &["window"], true);
    let csv = to_csv(&one);
    assert_eq!(csv.lines().count(), 2);
    assert_eq!(csv.lines().nth(1).unwrap().split(',').count(), 17);
    let no_seg = to_csv(&[report("h2o", 64, 10, 0.1, false)]);
    assert_eq!(no_seg.lines().nth(1).unwrap().split(',').count(), 17);

    // merging records: token-weighted, PPL from the mean NLL
    let a = report("h2o", 64, 100, 0.1, true);
    let mut b = report("h2o", 64, 300, 0.3, true);
    b.all.ppl = 80.0;
    let m = merge_reports(&[a.clone(), b.clone()]);
    assert_eq!(m.all.n, 400);
    assert!((m.all.kl - (0.1 * 100.0 + 0.3 * 300.0) / 400.0).abs() < 1e-12);
    let want_ppl = ((100.0 * 20f64.ln() + 300.0 * 80f64.ln()) / 400.0).exp();
    assert!(
        (m.all.ppl - want_ppl).abs() < 1e-9 * want_ppl,
        "{} vs {want_ppl}",
        m.all.ppl
    );
    assert_eq!(m.segment.as_ref().unwrap().n, 100);
    assert_eq!(m.evicted, a.evicted + b.evicted);
    assert_eq!(m.n_tokens, a.n_tokens + b.n_tokens);
    // one record: unchanged
    let s = merge_reports(std::slice::from_ref(&a));
    assert_eq!(
        serde_json::to_string(&s).unwrap(),
        serde_json::to_string(&a).unwrap()
    );

    // the per-head distribution: one panel per point whose streams ended
    // uneven, one cell per (layer, head), the layer totals as bars
    let mut even = report("snapkv", 64, 100, 0.1, false);
    even.stream_lengths = vec![vec![64; 3]; 4];
    let mut glob = report("dbtrimkv", 64, 100, 0.1, false);
    glob.stream_lengths = vec![
        vec![10, 200, 30],
        vec![64, 64, 64],
        vec![1, 2, 3],
        vec![90, 80, 70],
    ];
    let svg = heads_svg(&[even.clone(), glob.clone()]);
    assert!(
        svg.contains("dbtrimkv B=64") && !svg.contains("snapkv B="),
        "only uneven points"
    );
    assert_eq!(svg.matches("<title>layer ").count(), 4 * 3 + 4);
    assert!(svg.contains("layer 0 head 1: 200") && svg.contains("layer 3: 240"));
    let json = serde_json::to_value(&glob).unwrap();
    assert_eq!(json["stream_lengths"][0][1], 200);
    assert!(serde_json::to_value(&a)
        .unwrap()
        .get("stream_lengths")
        .is_none());
    let dir = std::env::temp_dir().join(format!("kvrun-heads-{}", std::process::id()));
    let prefix = dir.join("x");
    write_outputs(&prefix, &[even.clone()], Metric::Kl, "t", None).unwrap();
    assert!(
        !dir.join("x.heads.svg").exists(),
        "even budgets draw no heat map"
    );
    write_outputs(&prefix, &[even, glob], Metric::Kl, "t", None).unwrap();
    assert!(dir.join("x.heads.svg").is_file());
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn bad_sweep_arguments_fail_fast() {
    let text = util::shared("wikitext2_test_lf.txt");
    for (args, want) in [
        (vec!["--policies", "window,nope"], "unknown policy"),
        (
            vec!["--policies", "h2o", "--budgets", "16", "--kv-recent", "16"],
            "cannot hold",
        ),
        (vec!["--records", "2"], "--records"),
        (vec!["--metric", "bogus"], "bogus"),
    ] {
        let out = Command::new(util::kvrun_bin())
            .args(["eval", "sweep", "-f"])
            .arg(&text)
            .args(&args)
            .args(["--out", "/nonexistent-dir-kvrun/s"])
            .output()
            .expect("run kvrun");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(err.contains(want), "{args:?}: {err}");
    }
}

#[test]
fn sweep_flags_are_consistent() {
    use clap::CommandFactory;
    // clap's own consistency checks (duplicate flags, bad defaults) only run in debug builds
    let mut cli = kvrun::cmd::Cli::command();
    let sweep = cli
        .find_subcommand_mut("eval")
        .unwrap()
        .find_subcommand_mut("sweep")
        .expect("eval sweep")
        .clone();
    sweep.debug_assert();
    let c = kvrun::cmd::parse(["kvrun", "eval", "sweep", "-f", "x.txt"].map(String::from))
        .expect("defaults parse");
    let Some(kvrun::cmd::Cmd::Eval(kvrun::cmd::eval::EvalCmd::Sweep(a))) = c.cmd else {
        panic!("not a sweep")
    };
    assert_eq!(a.budgets, [256, 512, 1024, 2048]);
    assert_eq!(a.metric, Metric::Kl);
    let want: Vec<String> = kvrun::policy::names()
        .into_iter()
        .filter(|&n| n != "full")
        .map(String::from)
        .collect();
    assert_eq!(a.policy_list().unwrap(), want);
}

/// A short WikiText-2 excerpt on disk (a few hundred tokens).
fn short_text(tag: &str) -> std::path::PathBuf {
    let p = std::env::temp_dir().join(format!("kvrun-sweep-{tag}-{}.txt", std::process::id()));
    std::fs::write(&p, util::wikitext(2500)).unwrap();
    p
}

/// A report as JSON with the timing (the only non-deterministic field)
/// zeroed: serde_json prints f64s round-trip exactly, so equal strings mean
/// bit-identical figures.
fn figures(r: &PplReport) -> String {
    let mut r = r.clone();
    r.tokens_per_second = 0.0;
    serde_json::to_string(&r).unwrap()
}

fn parse_cli(args: &[&str]) -> kvrun::cmd::Cmd {
    let v: Vec<String> = std::iter::once("kvrun")
        .chain(args.iter().copied())
        .map(String::from)
        .collect();
    kvrun::cmd::parse(v)
        .expect("args parse")
        .cmd
        .expect("a command")
}

/// The lockstep sweep (one reference, two points fed together, spread over
/// two threads) gives, per point, exactly what `eval ppl` gives for that
/// point alone: KL, ΔNLL, top-1, PPL, segment, evicted, peak.
#[test]
fn lockstep_sweep_matches_separate_eval_ppl() {
    let text = short_text("lockstep");
    let text_s = text.to_str().unwrap();
    let prefix = std::env::temp_dir().join(format!("kvrun-lockstep-{}", std::process::id()));
    let common = [
        "--ctx",
        "300",
        "--chunk",
        "8",
        "--kv-recent",
        "16",
        "--segment-last",
        "40",
        "-t",
        "2",
    ];
    let mut sw = vec!["eval", "sweep", "-f", text_s, "--policies", "h2o"];
    sw.extend(["--budgets", "64,128", "--out", prefix.to_str().unwrap()]);
    sw.extend(common);
    let kvrun::cmd::Cmd::Eval(kvrun::cmd::eval::EvalCmd::Sweep(sa)) = parse_cli(&sw) else {
        panic!("not a sweep")
    };
    let swept = kvrun::cmd::eval::sweep::sweep(&sa).expect("sweep");
    assert_eq!(swept.len(), 2);
    for (r, budget) in swept.iter().zip(["64", "128"]) {
        let mut pa = vec!["eval", "ppl", "-f", text_s, "--policy", "h2o"];
        pa.extend(["--kv-budget", budget, "--json"]);
        pa.extend(common);
        let kvrun::cmd::Cmd::Eval(kvrun::cmd::eval::EvalCmd::Ppl(pa)) = parse_cli(&pa) else {
            panic!("not eval ppl")
        };
        let alone = kvrun::cmd::eval::ppl::eval_ppl(&pa).expect("eval ppl");
        assert_eq!(r.n_tokens, 300);
        assert!(
            r.evicted > 0 && r.all.kl > 0.0,
            "budget {budget}: no eviction"
        );
        assert!(r.tokens_per_second > 0.0);
        assert_eq!(figures(r), figures(&alone), "budget {budget}");
    }
    for ext in ["csv", "json", "svg"] {
        let _ = std::fs::remove_file(prefix.with_extension(ext));
    }
    let _ = std::fs::remove_file(&text);
}

/// `eval_points` against an independent, sequential two-session loop (the
/// original `eval ppl` algorithm: a full-cache session with its own 2-thread
/// pool, a 1-thread policy session, both fed chunk by chunk), and against
/// itself with another `-t`: the figures do not depend on the threads.
#[test]
fn lockstep_matches_sequential_reference_for_any_threads() {
    use kvrun::cmd::args::KvArgs;
    use kvrun::cmd::eval::fidelity::{eval_points, EvalText, Lockstep};
    use kvrun::generate::Session;
    use kvrun::model::llama::Logits;

    let model = util::default_model();
    let ck = kvrun::load::Checkpoint::open(&model).unwrap();
    let w = ck.weights().unwrap();
    let tok = ck.tokenizer().unwrap();
    let text = EvalText::new(&tok, &util::wikitext(2500), 260, None, Some(40)).unwrap();
    let n = text.ids.len();
    assert_eq!(n, 260);
    let kv = |p: &str, b: usize| KvArgs {
        policy: p.into(),
        kv_budget: Some(b),
        kv_sink: 4,
        kv_recent: Some(16),
        evict_every: Some(1),
        ..KvArgs::default()
    };
    let points = [kv("h2o", 64), kv("knorm", 96)];
    let chunk = 8;
    let run = |t: usize| {
        let lk = Lockstep {
            model: &model,
            chunk,
            n_threads: t,
            seed: 0,
        };
        eval_points(&w, &text, &points, lk, &mut |_| {}).unwrap()
    };
    let (r1, r2) = (run(1), run(2));
    for (a, b) in r1.iter().zip(&r2) {
        assert_eq!(figures(a), figures(b), "-t 1 vs -t 2");
    }

    let lsm = |l: &[f32]| -> Vec<f64> {
        let m = l.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
        let s: f64 = l.iter().map(|&x| (x as f64 - m).exp()).sum();
        let ls = m + s.ln();
        l.iter().map(|&x| x as f64 - ls).collect()
    };
    let am = |v: &[f64]| {
        v.iter()
            .enumerate()
            .fold(0, |b, (j, &x)| if x > v[b] { j } else { b })
    };
    let vocab = w.config.vocab;
    for (kv, got) in points.iter().zip(&r1) {
        let mut full = Session::new(&w, n, 2, chunk);
        let p = kv.build(0, &model).unwrap().unwrap();
        let mut pol = Session::with_policy(&w, n, 1, chunk, p).unwrap();
        kv.configure(&mut pol).unwrap();
        pol.protect_prompt(0);
        let (mut nll, mut nll_full, mut kl, mut agree, mut cnt) = (0.0, 0.0, 0.0, 0, 0);
        let mut done = 0;
        while done < n - 1 {
            let c = chunk.min(n - 1 - done);
            let ch = &text.ids[done..done + c];
            let f = full.feed(ch, Logits::All).unwrap().to_vec();
            let q = pol.feed(ch, Logits::All).unwrap();
            for i in 0..c {
                let next = text.ids[done + i + 1] as usize;
                let lf = lsm(&f[i * vocab..(i + 1) * vocab]);
                let lp = lsm(&q[i * vocab..(i + 1) * vocab]);
                let k: f64 = lf.iter().zip(&lp).map(|(&x, &y)| x.exp() * (x - y)).sum();
                kl += k.max(0.0);
                nll += -lp[next];
                nll_full += -lf[next];
                agree += (am(&lf) == am(&lp)) as usize;
                cnt += 1;
            }
            done += c;
        }
        let nf = cnt as f64;
        let name = &kv.policy;
        assert_eq!(got.all.n, cnt, "{name}");
        assert_eq!(got.all.kl, kl / nf, "{name} KL");
        assert_eq!(got.all.delta_nll, (nll - nll_full) / nf, "{name} dNLL");
        assert_eq!(got.all.top1_agree, agree as f64 / nf, "{name} top1");
        assert_eq!(got.all.ppl, (nll / nf).exp(), "{name} PPL");
        assert_eq!(got.all.ppl_full, (nll_full / nf).exp(), "{name} full PPL");
        assert_eq!(got.evicted, pol.n_evicted, "{name} evicted");
        assert!(got.evicted > 0, "{name}: nothing evicted");
        assert_eq!(got.peak_kv_entries, pol.kv.peak_live, "{name} peak");
        assert_eq!(
            got.segment.as_ref().map(|s| s.n),
            Some(40),
            "{name} segment"
        );
    }
}

/// The lockstep engine gives every point session a one-thread pool: such a
/// pool must run its jobs inline on the caller, with no worker thread to
/// spin (dozens of spinning pools would swamp a small machine).
#[test]
fn one_thread_pool_runs_inline() {
    let pool = kvrun::backend::pool::ThreadPool::new(1);
    assert_eq!(pool.n_threads(), 1);
    let me = std::thread::current().id();
    let calls = std::sync::Mutex::new(Vec::new());
    pool.run(|i| calls.lock().unwrap().push((i, std::thread::current().id())));
    assert_eq!(calls.into_inner().unwrap(), [(0, me)]);
}
