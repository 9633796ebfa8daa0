//! `kvrun bench`: a llama-bench-shaped table comparing kvrun with llama.cpp's
//! own library on the same GGUF file, same thread count, in one process.
//!
//! Tests (as llama-bench): `pp N` = prefill N tokens into an empty cache,
//! `tg N` = decode N tokens one at a time from an empty cache. Each test runs
//! once as warm-up and then `-r` times; the table shows mean ± sd tokens/s
//! and the kvrun / llama.cpp ratio. Tokenization and sampling are excluded.
//!
//! The llama.cpp side needs the `oracle` Cargo feature (on by default);
//! without it the table has kvrun's rows only and one line says why.

use crate::backend::cpu::mem::{set_prefetch, Prefetch};
use crate::backend::Backend;
use crate::cmd::args::{loader_for, resolve_model, resolve_threads, KvArgs, ModelArgs};
use crate::error::{Error, Result};
use crate::generate::Session;
use crate::model::llama::Logits;
use crate::model::Weights;
use clap::Args;
use std::time::Instant;

/// Flags of `kvrun bench`.
#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt tokens for the pp test (0 = skip).
    #[arg(short = 'p', long = "n-prompt", default_value_t = 512)]
    pub n_prompt: usize,
    /// Generated tokens for the tg test (0 = skip).
    #[arg(short = 'n', long = "n-gen", default_value_t = 128)]
    pub n_gen: usize,
    /// Repetitions per test.
    #[arg(short = 'r', long = "repetitions", default_value_t = 3)]
    pub reps: usize,
    /// Skip the llama.cpp side.
    #[arg(long = "no-llama")]
    pub no_llama: bool,
    /// Alternate the engines repetition by repetition (kvrun's sessions,
    /// then llama.cpp, in turn) instead of running all of kvrun's first:
    /// on a shared machine, load that comes and goes then hits both alike.
    /// Both models stay loaded, so kvrun's own peak RSS is not reported.
    #[arg(long = "interleave")]
    pub interleave: bool,
    /// Prefill this many tokens before each test (llama-bench's -d): the
    /// tests then run at context depth D. llama.cpp keeps its full cache;
    /// kvrun uses --policy / --kv-budget.
    #[arg(short = 'd', long = "depth", default_value_t = 0)]
    pub depth: usize,
    #[command(flatten)]
    pub kv: KvArgs,
}

/// The most repetitions `-r` takes (each one reruns every test).
const MAX_REPS: usize = 1000;

/// The context the tests of `a` need: the depth, the longer test and a
/// margin (at least 64); `Err` names the largest of `-p`, `-n` and `-d` when
/// that context cannot be allocated for `c`.
fn bench_ctx(a: &BenchArgs, c: &crate::model::Config, n_threads: usize) -> Result<usize> {
    let (p, n, d) = (a.n_prompt, a.n_gen, a.depth);
    let flag = if d >= p.max(n) {
        "-d/--depth"
    } else if p >= n {
        "-p/--n-prompt"
    } else {
        "-n/--n-gen"
    };
    let n_ctx = d
        .checked_add(p.max(n))
        .and_then(|t| t.checked_add(16))
        .ok_or_else(|| Error::arg(flag, "-d plus the longer of -p and -n overflows"))?
        .max(64);
    crate::cmd::args::check_ctx_alloc_for(flag, c, n_ctx, n_threads)?;
    // kvrun's sessions also hold every repetition's generated tokens
    // (see `KvrunSide::run`)
    let ours_flag = "-n/--n-gen with -r/--repetitions";
    let ours = n
        .checked_mul(a.reps + 1)
        .and_then(|t| t.checked_add(n_ctx))
        .ok_or_else(|| Error::arg(ours_flag, "-n times -r overflows"))?;
    crate::cmd::args::check_ctx_alloc_for(ours_flag, c, ours, n_threads)?;
    Ok(n_ctx)
}

/// Deterministic, varied token ids for benchmarking.
fn bench_tokens(n: usize, vocab: usize) -> Vec<u32> {
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (100 + x % (vocab as u64 - 200)) as u32
        })
        .collect()
}

fn mean_sd(v: &[f64]) -> (f64, f64) {
    let m = v.iter().sum::<f64>() / v.len() as f64;
    let var = if v.len() > 1 {
        v.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / (v.len() - 1) as f64
    } else {
        0.0
    };
    (m, var.sqrt())
}

/// Peak resident set size of this process in bytes (Linux VmHWM).
pub fn peak_rss_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Reset the peak RSS (VmHWM) to the current RSS (Linux `clear_refs` 5);
/// where that is not possible the peak stays as it is. Memory the
/// allocator holds freed is handed back to the system first (glibc's
/// `malloc_trim`): after three models in one `kvrun bench -m` run, the
/// heaps kept about 0.9 GiB of the earlier models' buffers, which the
/// next model's peak counted as its own (1034 MiB for the 94 MiB default
/// model, 142 MiB run alone).
fn reset_peak_rss() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases free memory of the allocator's
    // heaps; nothing live moves.
    unsafe {
        libc::malloc_trim(0);
    }
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// Like `measure`, with an untimed `setup` (e.g. prefilling the context
/// depth) before every run.
#[cfg(feature = "oracle")]
fn measure_with_setup<S>(
    reps: usize,
    n: usize,
    state: &mut S,
    mut setup: impl FnMut(&mut S) -> Result<()>,
    mut f: impl FnMut(&mut S) -> Result<()>,
) -> Result<Vec<f64>> {
    setup(state)?;
    f(state)?;
    let mut out = Vec::with_capacity(reps);
    for _ in 0..reps {
        setup(state)?;
        let t = Instant::now();
        f(state)?;
        out.push(n as f64 / t.elapsed().as_secs_f64());
    }
    Ok(out)
}

/// The models of `-m`: a comma-separated list benchmarks each in turn
/// (llama-bench's `-m a,b`), unless the whole string names an existing
/// file; no `-m` is the default model.
fn bench_models(m: &Option<std::path::PathBuf>) -> Vec<Option<std::path::PathBuf>> {
    match m {
        Some(p) if !p.exists() && p.to_string_lossy().contains(',') => p
            .to_string_lossy()
            .split(',')
            .map(|s| Some(std::path::PathBuf::from(s.trim())))
            .collect(),
        other => vec![other.clone()],
    }
}

/// What the models' runs print: table rows, then notes below the table.
/// The CPU roofline column is filled in at the end, against the best of
/// every model's bandwidth probe.
#[derive(Default)]
struct BenchOut {
    rows: Vec<Row>,
    notes: Vec<Note>,
    /// Every CPU bandwidth probe of the run, GB/s.
    cpu_probes: Vec<f64>,
}

/// One table row: its cells up to the roofline's, and what that needs.
struct Row {
    /// `| model | ... | read/token` (no closing bar).
    head: String,
    /// Decoding rows: bytes read per second (tokens/s × bytes per token).
    read_bps: Option<f64>,
    /// The bandwidth to compare with when not the CPU's best probe (a GPU's).
    device_gbs: Option<f64>,
}

/// A line below the table.
enum Note {
    /// Printed as it is.
    Text(String),
    /// A CPU model's roofline line: `who` (several models), the better of
    /// its own two probes.
    CpuRoofline {
        who: Option<String>,
        probe_gbs: f64,
        n_threads: usize,
        weight_mb: f64,
    },
}

impl From<&str> for Note {
    fn from(t: &str) -> Note {
        Note::Text(t.to_owned())
    }
}

impl BenchOut {
    /// The bandwidth the CPU rows are compared with: the fastest probe. A
    /// probe is a second of reading; on a shared VM one of them can catch
    /// a busy second and read half of what the decoding then did (a 130%
    /// "roofline"), so each model gets two and the best of all counts.
    fn cpu_gbs(&self) -> Option<f64> {
        self.cpu_probes.iter().copied().reduce(f64::max)
    }

    fn print(&self) {
        let best = self.cpu_gbs();
        for r in &self.rows {
            let frac = match (r.read_bps, r.device_gbs.or(best)) {
                (Some(bps), Some(g)) => format!("{:.0}%", 100.0 * bps / (g * 1e9)),
                _ => "-".into(),
            };
            println!("{} | {frac} |", r.head);
        }
        for n in &self.notes {
            match n {
                Note::Text(t) => println!("{t}"),
                Note::CpuRoofline {
                    who,
                    probe_gbs,
                    n_threads,
                    weight_mb,
                } => {
                    let who = who.as_ref().map(|w| format!("{w}: ")).unwrap_or_default();
                    let g = best.unwrap_or(*probe_gbs);
                    let of = if self.cpu_probes.len() > 1 {
                        format!(
                            " (the best of {} probes, before each model loads and after its runs; this model's best {probe_gbs:.1})",
                            self.cpu_probes.len()
                        )
                    } else {
                        String::new()
                    };
                    println!(
                        "{who}roofline: {g:.1} GB/s read bandwidth measured with {n_threads} threads{of}; a decoded token reads {weight_mb:.1} MB of weights plus the live KV (peak)"
                    );
                }
            }
        }
    }
}

/// `kvrun bench`: every model of `-m` in turn, one table.
pub fn run_bench(a: &BenchArgs) -> Result<()> {
    if !(1..=MAX_REPS).contains(&a.reps) {
        return Err(Error::arg(
            "-r/--repetitions",
            format!("must be between 1 and {MAX_REPS}, got {}", a.reps),
        ));
    }
    a.kv.check()?;
    let models = bench_models(&a.model.model);
    // check every path before the first (long) run
    for m in &models {
        resolve_model(m)?;
    }
    let policies: Vec<&str> = a.kv.policy.split(',').map(str::trim).collect();
    let settings = LoadSettings::of(&a.model)?;
    let mut out = BenchOut::default();
    for m in &models {
        let mut one = a.clone();
        one.model.model = m.clone();
        // each model's peak RSS is its own
        reset_peak_rss();
        let first = out.notes.len();
        bench_one(&one, &policies, &settings, &mut out)?;
        if models.len() > 1 {
            // several models: say whose each note is
            let name = resolve_model(m)?.display().to_string();
            for n in &mut out.notes[first..] {
                match n {
                    Note::Text(t) => *t = format!("{name}: {t}"),
                    Note::CpuRoofline { who, .. } => *who = Some(name.clone()),
                }
            }
        }
    }
    println!(
        "| model | size | threads | engine | test | t/s | vs llama.cpp | vs {} | read/token | roofline |",
        policies[0].to_owned() + &settings.label(0)
    );
    println!("| --- | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |");
    out.print();
    Ok(())
}

/// The ways of loading and running the weights a bench compares: every
/// pair of a `--mmap` and a `--repack` setting, each loaded once, each run
/// with every `--prefetch` setting (which needs no load of its own), their
/// sessions taking turns.
struct LoadSettings {
    /// (read in place from the map, which matrices are repacked)
    list: Vec<(bool, crate::backend::cpu::Repack)>,
    /// (index into `list`, prefetch distance): one entry per way of running
    runs: Vec<(usize, Prefetch)>,
    /// whether several `--mmap` / `--repack` / `--prefetch` settings were given
    several: (bool, bool, bool),
}

impl LoadSettings {
    fn of(m: &ModelArgs) -> Result<LoadSettings> {
        let (mmaps, repacks) = (m.mmap_list()?, m.repack_list()?);
        let prefetches = m.prefetch_list()?;
        let list: Vec<_> = mmaps
            .iter()
            .flat_map(|&on| repacks.iter().map(move |&r| (on, r)))
            .collect();
        let runs = (0..list.len())
            .flat_map(|vi| prefetches.iter().map(move |&p| (vi, p)))
            .collect();
        Ok(LoadSettings {
            list,
            runs,
            several: (mmaps.len() > 1, repacks.len() > 1, prefetches.len() > 1),
        })
    }

    /// What tells run `i` apart in an engine's name: nothing when there
    /// is one.
    fn label(&self, i: usize) -> String {
        let (vi, prefetch) = self.runs[i];
        let (mapped, repack) = self.list[vi];
        let mut l = String::new();
        if self.several.0 {
            l += &format!(" mmap={}", mapped as u8);
        }
        if self.several.1 {
            l += &format!(" repack={repack}");
        }
        if self.several.2 {
            l += &format!(" prefetch={}", prefetch.label());
        }
        l
    }
}

/// Bench one model (`a.model.model`) with each `--mmap` setting of
/// `settings`, appending its rows and notes.
fn bench_one(
    a: &BenchArgs,
    policies: &[&str],
    settings: &LoadSettings,
    out: &mut BenchOut,
) -> Result<()> {
    let path = resolve_model(&a.model.model)?;
    let n_threads = resolve_threads(a.model.threads)?;
    let device = crate::cmd::resolve_device(&a.model, None)?;
    if device != crate::backend::Device::Cpu {
        if settings.several.0 {
            return Err(Error::arg(
                "--mmap",
                "a list of settings is for CPU runs (a GPU reads the map once to upload it)",
            ));
        }
        if settings.several.1 {
            return Err(Error::arg(
                "--repack",
                "a list of settings is for CPU runs (a GPU keeps its own layout)",
            ));
        }
        if settings.several.2 {
            return Err(Error::arg(
                "--prefetch",
                "a list of settings is for CPU runs (the CPU's decoding kernels)",
            ));
        }
    }
    // a CPU model's bandwidth is probed before it loads and again after its
    // runs (the machine may be busier at one of them)
    let mut cpu_probe = None;
    let mut probe = || {
        let g = crate::backend::Host::new(n_threads).read_bandwidth();
        // the probe's buffer is gone: forget its peak, so the run's peak
        // RSS is the engines' own
        reset_peak_rss();
        out.cpu_probes.push(g);
        cpu_probe = Some(cpu_probe.map_or(g, |p: f64| p.max(g)));
    };
    if device == crate::backend::Device::Cpu {
        probe();
    }
    // one model per --mmap and --repack setting, all loaded at once (their sessions
    // take turns, as the policies do)
    device.check()?;
    let loaded: Vec<crate::load::Loaded> = settings
        .list
        .iter()
        .map(|&(on, r)| crate::load::Loaded::open_with(&path, &loader_for(on, r, device)))
        .collect::<Result<_>>()?;
    // sessions: per way of running (an index into `settings.runs`), per policy
    let sessions: Vec<(usize, &str)> = (0..settings.runs.len())
        .flat_map(|ri| policies.iter().map(move |p| (ri, *p)))
        .collect();
    let model = &loaded[0];
    let w = model.weights();
    let c = &w.config;
    let name = model.name();
    let size_mib = model.checkpoint().n_bytes() as f64 / (1 << 20) as f64;
    let n_ctx = bench_ctx(a, c, n_threads)?;
    let toks = bench_tokens(a.depth + a.n_prompt.max(a.n_gen), c.vocab);
    let (ctx_toks, toks) = toks.split_at(a.depth);
    let at = if a.depth > 0 {
        format!(" @ d{}", a.depth)
    } else {
        String::new()
    };
    let mut tests: Vec<(String, usize)> = Vec::new();
    if a.n_prompt > 0 {
        tests.push((format!("pp{}{at}", a.n_prompt), a.n_prompt));
    }
    if a.n_gen > 0 {
        tests.push((format!("tg{}{at}", a.n_gen), a.n_gen));
    }

    // kvrun: one session per policy, on the asked device
    let side = KvrunSide {
        a,
        path: &path,
        sessions: &sessions,
        settings,
        tests: &tests,
        n_ctx,
        ctx_toks,
        toks,
    };
    let no_llama = a.no_llama || device != crate::backend::Device::Cpu;
    // --interleave: llama.cpp loaded now, measured inside kvrun's rep loop
    let rival_lm = if a.interleave && !no_llama {
        Some(rival_model(&path)?)
    } else {
        None
    };
    let mut rival = match &rival_lm {
        Some(lm) => llama_rival(lm, &tests, n_ctx, n_threads, a.depth, ctx_toks, toks)?,
        None => None,
    };
    let ((ours, kv_lines, kv_peak), device_note, device_gbs) = match device {
        crate::backend::Device::Cpu => (
            side.run(
                &loaded.iter().map(|m| m.weights()).collect::<Vec<_>>(),
                || Ok(crate::backend::Host::new(n_threads)),
                rival.as_deref_mut().map(|r| r as &mut dyn Rival),
            )?,
            None,
            None,
        ),
        crate::backend::Device::Cuda(ordinal) => {
            let b = crate::backend::cuda::Cuda::new(ordinal, n_threads)?;
            let t = Instant::now();
            let wd = crate::cmd::device_weights(&b, model, &a.kv)?;
            let note = format!(
                "{}: weights uploaded in {:.2} s",
                b.name(),
                t.elapsed().as_secs_f64()
            );
            let m = side.run(&[&wd], || Ok(b.sibling(n_threads)), None)?;
            (m, Some(note), Some(b.read_bandwidth()?))
        }
    };
    // the roofline: this machine's read bandwidth with the same threads,
    // and the bytes a decoded token reads (every weight but the embedding
    // table, plus the live KV)
    // (interleaved, llama.cpp's model is resident too: no kvrun-only peak)
    let rss_kvrun = peak_rss_bytes().filter(|_| rival.is_none());
    // the second probe (the rows are compared with the best probe of the
    // whole run, see `BenchOut::cpu_gbs`); the peak RSS so far is kept
    // across the reset it makes
    let run_peak = peak_rss_bytes();
    if device == crate::backend::Device::Cpu {
        probe();
    }
    let weight_bytes = decode_weight_bytes(model.checkpoint());
    let kv_token_bytes = (2 * c.n_cache_layers() * c.kv_dim() * 2) as f64;

    // llama.cpp
    let theirs = if no_llama {
        vec![None; tests.len()]
    } else if let Some(r) = rival.take() {
        r.results().into_iter().map(Some).collect()
    } else {
        llama_side(a, &path, &tests, n_ctx, n_threads, ctx_toks, toks)?
    };

    // decoding reads every weight and the live KV once per token; prefill
    // is bound by compute, so it gets no roofline
    let roof = |t: &str, m: f64, kv: f64| -> (String, Option<f64>) {
        if !t.starts_with("tg") {
            return ("-".into(), None);
        }
        let bytes = weight_bytes + kv;
        (format!("{:.1} MB", bytes / 1e6), Some(m * bytes))
    };
    let row = |head: String, read_bps: Option<f64>| Row {
        head,
        read_bps,
        device_gbs,
    };
    for (i, (t, _)) in tests.iter().enumerate() {
        let first = mean_sd(&ours[i][0]).0;
        for (si, &(ri, p)) in sessions.iter().enumerate() {
            let (m, sd) = mean_sd(&ours[i][si]);
            let ratio = theirs[i].as_ref().map(|r| m / mean_sd(r).0);
            let engine =
                if policies.len() == 1 && crate::policy::find(p).is_some_and(|d| !d.budgeted()) {
                    "kvrun".to_owned()
                } else {
                    format!("kvrun {p}")
                } + &settings.label(ri);
            let (rb, bps) = roof(t, m, kv_peak[si]);
            out.rows.push(row(
                format!(
                    "| {name} | {size_mib:.2} MiB | {n_threads} | {engine} | {t} | {m:.2} ± {sd:.2} | {} | {:.1}% | {rb}",
                    ratio
                        .map(|r| format!("{r:.2}x"))
                        .unwrap_or_else(|| "-".into()),
                    100.0 * m / first
                ),
                bps,
            ));
        }
        if let Some(r) = &theirs[i] {
            let (m, sd) = mean_sd(r);
            // llama.cpp keeps every token: depth plus the test's tokens
            let (rb, bps) = roof(t, m, kv_token_bytes * (a.depth + tests[i].1) as f64);
            out.rows.push(row(
                format!("| {name} | {size_mib:.2} MiB | {n_threads} | llama.cpp | {t} | {m:.2} ± {sd:.2} | 1.00x | - | {rb}"),
                bps,
            ));
        }
    }
    if let Some(n) = &device_note {
        out.notes.push(Note::Text(n.clone()));
        if !a.no_llama {
            out.notes.push(
                "llama.cpp: not measured: the llama.cpp linked here runs on the CPU only".into(),
            );
        }
    }
    if !no_llama && !cfg!(feature = "oracle") {
        out.notes.push("llama.cpp: not measured: this kvrun was built without the `oracle` feature (cargo build --release --features oracle)".into());
    }
    out.notes.extend(kv_lines.into_iter().map(Note::Text));
    if device == crate::backend::Device::Cpu {
        out.notes.push(Note::Text(kernel_level_note()));
    }
    if device == crate::backend::Device::Cpu && !settings.several.2 {
        out.notes.push(Note::Text(format!(
            "kvrun decoding prefetch (--prefetch): {}",
            settings.runs[0].1.label()
        )));
    }
    if a.interleave && !no_llama && cfg!(feature = "oracle") {
        out.notes.push(
            "interleaved: each repetition ran kvrun, then llama.cpp, with both models loaded"
                .into(),
        );
    }
    if let Some(g) = device_gbs {
        out.notes.push(Note::Text(format!(
            "roofline: {g:.1} GB/s read bandwidth measured on {device}; a decoded token reads {:.1} MB of weights plus the live KV (peak)",
            weight_bytes / 1e6
        )));
    }
    if let Some(g) = cpu_probe {
        out.notes.push(Note::CpuRoofline {
            who: None,
            probe_gbs: g,
            n_threads,
            weight_mb: weight_bytes / 1e6,
        });
    }
    let both = if loaded.len() > 1 {
        " (every --mmap and --repack setting's weights loaded at once)"
    } else {
        ""
    };
    if let Some(b) = rss_kvrun {
        out.notes.push(Note::Text(format!(
            "peak RSS after the kvrun runs (before llama.cpp loads): {:.1} MiB{both}",
            b as f64 / (1 << 20) as f64
        )));
    }
    if let Some(b) =
        peak_rss_bytes().map(|p| p.max(rss_kvrun.unwrap_or(0)).max(run_peak.unwrap_or(0)))
    {
        out.notes.push(Note::Text(format!(
            "peak RSS of the whole run: {:.1} MiB{both}",
            b as f64 / (1 << 20) as f64
        )));
    }
    Ok(())
}

/// The same tests on llama.cpp's own library (the `oracle` feature): one
/// tokens/s list per test.
#[cfg(feature = "oracle")]
fn llama_side(
    a: &BenchArgs,
    path: &std::path::Path,
    tests: &[(String, usize)],
    n_ctx: usize,
    n_threads: usize,
    ctx_toks: &[u32],
    toks: &[u32],
) -> Result<Vec<Option<Vec<f64>>>> {
    let mut theirs: Vec<Option<Vec<f64>>> = vec![None; tests.len()];
    let path_s = path.to_string_lossy().into_owned();
    let lm = ggml_sys::LlamaModel::load(&path_s, false).map_err(Error::Other)?;
    let mut ctx =
        ggml_sys::LlamaContext::new(&lm, n_ctx as u32, n_threads as i32).map_err(Error::Other)?;
    let ltoks: Vec<i32> = toks.iter().map(|&t| t as i32).collect();
    let lctx: Vec<i32> = ctx_toks.iter().map(|&t| t as i32).collect();
    let d = a.depth as i32;
    let setup = |ctx: &mut ggml_sys::LlamaContext<'_>| -> Result<()> {
        ctx.clear();
        if !lctx.is_empty() {
            ctx.decode(&lctx, 0, false).map_err(Error::Other)?;
        }
        Ok(())
    };
    for (i, (t, n)) in tests.iter().enumerate() {
        let r = if t.starts_with("pp") {
            measure_with_setup(a.reps, *n, &mut ctx, setup, |ctx| {
                ctx.decode(&ltoks[..*n], d, false)
                    .map(|_| ())
                    .map_err(Error::Other)
            })?
        } else {
            measure_with_setup(a.reps, *n, &mut ctx, setup, |ctx| {
                for (p, &tk) in ltoks[..*n].iter().enumerate() {
                    ctx.decode(&[tk], d + p as i32, false)
                        .map_err(Error::Other)?;
                }
                Ok(())
            })?
        };
        theirs[i] = Some(r);
    }
    Ok(theirs)
}

/// Another engine measured repetition by repetition beside kvrun's
/// sessions (`--interleave`).
trait Rival {
    /// One repetition of test `i` (its setup untimed): tokens/s.
    fn rep(&mut self, i: usize) -> Result<f64>;
    /// Every timed repetition's tokens/s, per test.
    fn results(self: Box<Self>) -> Vec<Vec<f64>>;
}

/// llama.cpp as a [`Rival`]: the same tests as [`llama_side`].
#[cfg(feature = "oracle")]
struct LlamaRival<'m> {
    ctx: ggml_sys::LlamaContext<'m>,
    tests: Vec<(String, usize)>,
    depth: i32,
    ctx_toks: Vec<i32>,
    toks: Vec<i32>,
    /// per test, the tokens/s of each call to `rep` (the first is the
    /// warm-up, dropped by `results`)
    rates: Vec<Vec<f64>>,
}

#[cfg(feature = "oracle")]
impl Rival for LlamaRival<'_> {
    fn rep(&mut self, i: usize) -> Result<f64> {
        let n = self.tests[i].1;
        self.ctx.clear();
        if !self.ctx_toks.is_empty() {
            self.ctx
                .decode(&self.ctx_toks, 0, false)
                .map_err(Error::Other)?;
        }
        let t = Instant::now();
        if self.tests[i].0.starts_with("pp") {
            self.ctx
                .decode(&self.toks[..n], self.depth, false)
                .map_err(Error::Other)?;
        } else {
            for (p, &tk) in self.toks[..n].iter().enumerate() {
                self.ctx
                    .decode(&[tk], self.depth + p as i32, false)
                    .map_err(Error::Other)?;
            }
        }
        let r = n as f64 / t.elapsed().as_secs_f64();
        self.rates[i].push(r);
        Ok(r)
    }
    fn results(self: Box<Self>) -> Vec<Vec<f64>> {
        self.rates
            .into_iter()
            .map(|r| r.into_iter().skip(1).collect())
            .collect()
    }
}

/// llama.cpp's model for `--interleave` (nothing without the `oracle`
/// feature).
#[cfg(feature = "oracle")]
type RivalModel = ggml_sys::LlamaModel;
#[cfg(not(feature = "oracle"))]
type RivalModel = ();

#[cfg(feature = "oracle")]
fn rival_model(path: &std::path::Path) -> Result<RivalModel> {
    ggml_sys::LlamaModel::load(&path.to_string_lossy(), false).map_err(Error::Other)
}

#[cfg(not(feature = "oracle"))]
fn rival_model(_path: &std::path::Path) -> Result<RivalModel> {
    Ok(())
}

/// llama.cpp on `lm` as a [`Rival`] (`None` without the `oracle` feature:
/// the table then says it was not measured).
#[cfg(feature = "oracle")]
fn llama_rival<'m>(
    lm: &'m RivalModel,
    tests: &[(String, usize)],
    n_ctx: usize,
    n_threads: usize,
    depth: usize,
    ctx_toks: &[u32],
    toks: &[u32],
) -> Result<Option<Box<dyn Rival + 'm>>> {
    let ctx =
        ggml_sys::LlamaContext::new(lm, n_ctx as u32, n_threads as i32).map_err(Error::Other)?;
    Ok(Some(Box::new(LlamaRival {
        ctx,
        tests: tests.to_vec(),
        depth: depth as i32,
        ctx_toks: ctx_toks.iter().map(|&t| t as i32).collect(),
        toks: toks.iter().map(|&t| t as i32).collect(),
        rates: vec![Vec::new(); tests.len()],
    })))
}

#[cfg(not(feature = "oracle"))]
fn llama_rival<'m>(
    _lm: &'m RivalModel,
    _tests: &[(String, usize)],
    _n_ctx: usize,
    _n_threads: usize,
    _depth: usize,
    _ctx_toks: &[u32],
    _toks: &[u32],
) -> Result<Option<Box<dyn Rival + 'm>>> {
    Ok(None)
}

/// Without the `oracle` feature there is no llama.cpp to compare with.
#[cfg(not(feature = "oracle"))]
fn llama_side(
    _a: &BenchArgs,
    _path: &std::path::Path,
    tests: &[(String, usize)],
    _n_ctx: usize,
    _n_threads: usize,
    _ctx_toks: &[u32],
    _toks: &[u32],
) -> Result<Vec<Option<Vec<f64>>>> {
    Ok(vec![None; tests.len()])
}

/// The kvrun half of a bench run, on any backend.
struct KvrunSide<'r> {
    a: &'r BenchArgs,
    path: &'r std::path::Path,
    /// (index into `settings.runs`, policy), one per session
    sessions: &'r [(usize, &'r str)],
    /// the `--mmap`, `--repack` and `--prefetch` settings of each way of
    /// running (the weights `run` gets are indexed as `settings.list`)
    settings: &'r LoadSettings,
    tests: &'r [(String, usize)],
    n_ctx: usize,
    ctx_toks: &'r [u32],
    toks: &'r [u32],
}

/// tokens/s of each repetition, per test and policy.
type Rates = Vec<Vec<Vec<f64>>>;

/// What the kvrun half measured: the rates, and a KV line and the peak KV
/// bytes per policy.
type Measured = (Rates, Vec<String>, Vec<f64>);

impl KvrunSide<'_> {
    /// One session per entry of `sessions` (weights of `ws`, the `--mmap`
    /// settings, by policy of `--policy a,b,c`), measured interleaved (rep
    /// by rep) so that machine noise hits them alike; the tokens/s and a KV
    /// line per session.
    fn run<'w, B: Backend>(
        &self,
        ws: &[&'w Weights<'w, B>],
        backend: impl Fn() -> Result<B>,
        mut rival: Option<&mut dyn Rival>,
    ) -> Result<Measured> {
        let KvrunSide {
            a,
            path,
            sessions: list,
            settings,
            tests,
            n_ctx,
            ctx_toks,
            toks,
        } = *self;
        let n_ctx_ours = n_ctx + a.n_gen * (a.reps + 1);
        let mut sessions = Vec::new();
        for &(ri, p) in list {
            let w = ws[settings.runs[ri].0];
            let kv = KvArgs {
                policy: p.to_owned(),
                // a budget beyond the context holds the context
                kv_budget: a.kv.kv_budget.map(|b| b.min(n_ctx_ours)),
                ..a.kv.clone()
            };
            let mut s = match kv.build(0, path)? {
                None => Session::on(backend()?, w, n_ctx_ours, 512),
                Some(pol) => Session::with_policy_on(backend()?, w, n_ctx_ours, 512, pol)?,
            };
            kv.configure(&mut s)?;
            sessions.push(s);
        }
        // the depth context is context, not a prompt to protect
        let setup = |s: &mut Session<'_, B>| -> Result<()> {
            s.reset();
            s.protect_prompt(0);
            s.feed(ctx_toks, Logits::Last).map(|_| ())
        };
        // ours[test][policy] = tokens/s of each repetition
        let mut ours: Vec<Vec<Vec<f64>>> = Vec::new();
        for (ti, (t, n)) in tests.iter().enumerate() {
            let n = *n;
            let pp = t.starts_with("pp");
            let run = |s: &mut Session<'_, B>| -> Result<()> {
                if pp {
                    // with --prompt-compress once the pp tokens are the prompt
                    // (prefilled whole, then compressed once)
                    if s.policy.as_ref().is_some_and(|p| p.compress_once) {
                        s.protect_prompt(s.n_past + n);
                    }
                    s.feed(&toks[..n], Logits::Last).map(|_| ())
                } else {
                    for &tk in &toks[..n] {
                        s.feed(&[tk], Logits::Last)?;
                    }
                    Ok(())
                }
            };
            // tg at depth continues from the previous repetition (a budgeted
            // cache is in its steady state; prefilling the depth again per
            // repetition would dominate the run); everything else starts afresh
            let fresh_each = pp || a.depth == 0;
            // each session runs with its own --prefetch distance
            let prefetch = |si: usize| set_prefetch(settings.runs[list[si].0].1);
            for (si, s) in sessions.iter_mut().enumerate() {
                prefetch(si);
                setup(s)?;
                run(s)?;
            }
            if let Some(r) = rival.as_deref_mut() {
                r.rep(ti)?; // its warm-up
            }
            let mut res = vec![Vec::with_capacity(a.reps); sessions.len()];
            for _ in 0..a.reps {
                for (pi, s) in sessions.iter_mut().enumerate() {
                    prefetch(pi);
                    if fresh_each {
                        setup(s)?;
                    }
                    let t0 = Instant::now();
                    run(s)?;
                    res[pi].push(n as f64 / t0.elapsed().as_secs_f64());
                }
                if let Some(r) = rival.as_deref_mut() {
                    r.rep(ti)?;
                }
            }
            ours.push(res);
        }
        let kv_lines: Vec<String> = list
            .iter()
            .zip(&sessions)
            .map(|(&(ri, p), sess)| {
                let setting = settings.label(ri);
                format!(
                    "kvrun KV{setting}: policy {p} budget {} peak resident {} tokens ({:.1} MiB), evicted {}, attention exports {}",
                    a.kv.kv_budget
                        .filter(|_| crate::policy::find(p).is_some_and(|d| d.budgeted()))
                        .map(|b| b.to_string())
                        .unwrap_or_else(|| "none".into()),
                    sess.kv.peak_live,
                    sess.kv.peak_bytes() as f64 / (1 << 20) as f64,
                    sess.n_evicted,
                    sess.state.prob_exports
                )
            })
            .collect();
        let peaks = sessions.iter().map(|s| s.kv.peak_bytes() as f64).collect();
        Ok((ours, kv_lines, peaks))
    }
}

/// Bytes of weights a decoded token reads: every tensor but the embedding
/// table (one row of it is read), unless the table is also the output head.
/// A mixture of experts reads only its chosen experts, so this bounds it
/// from above.
fn decode_weight_bytes(ck: &crate::load::Checkpoint) -> f64 {
    match ck {
        crate::load::Checkpoint::Gguf(g) => {
            let tied = !g.tensors.iter().any(|t| t.name == "output.weight");
            g.tensors
                .iter()
                .filter(|t| tied || t.name != "token_embd.weight")
                .filter_map(|t| t.n_bytes())
                .sum::<u64>() as f64
        }
        other => other.n_bytes() as f64,
    }
}

/// The bench's line naming the CPU kernel level kvrun ran at (the CPU's,
/// capped by `KVRUN_CPU`), and a warning where the AMX tiles were emulated
/// (`KVRUN_AMX_EMULATE=1`): those rows time the emulator, not the CPU.
fn kernel_level_note() -> String {
    use crate::backend::cpu::isa;
    format!(
        "kvrun CPU kernels (KVRUN_CPU): {}{}",
        isa::level(),
        if isa::level_is_emulated() {
            ", AMX tiles emulated in software (KVRUN_AMX_EMULATE=1): these timings are not the CPU's"
        } else {
            ""
        }
    )
}
