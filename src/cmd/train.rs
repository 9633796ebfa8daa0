//! `kvrun train gates`: train TRIM-KV / DBTrimKV retention gates for a
//! model (the library side is `crate::train`).

use crate::cmd::args::{resolve_model, resolve_threads, ModelArgs};
use crate::cmd::load_model;
use crate::error::{Error, Result};
use crate::policy::gates::{gates_path_for, GateArch};
use crate::train::{self, DataSpec, Objective, TrainConfig};
use clap::{Args, Subcommand};
use std::path::PathBuf;

/// `kvrun train ...`
#[derive(Subcommand, Debug)]
pub enum TrainCmd {
    /// Learn retention gates (frozen model; KL to the full model + capacity hinge).
    Gates(GatesArgs),
}

#[derive(Args, Debug)]
pub struct GatesArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Training text: plain text or JSONL (question/problem + solution/answer/output), repeatable.
    #[arg(long = "data", value_name = "FILE", required = true)]
    pub data: Vec<PathBuf>,
    /// Tokens skipped at the start of every plain-text file (held out: what `kvrun eval` reads).
    #[arg(long = "skip-tokens", default_value_t = 16384)]
    pub skip_tokens: usize,
    /// Records skipped at the start of every JSONL file (held out).
    #[arg(long = "skip-records", default_value_t = 0)]
    pub skip_records: usize,
    /// Capacity M: entries per (layer, KV head) the gates learn to fit in.
    #[arg(long = "budget", value_name = "M")]
    pub budget: usize,
    /// Gate architecture: rg10 (DBTrimKV: shared scoring head, global capacity) or rg (TRIM-KV).
    #[arg(long = "arch", default_value = "rg10")]
    pub arch: String,
    /// Gate hidden width I.
    #[arg(long = "gate-dim", default_value_t = 512)]
    pub inter: usize,
    /// Initial bias of the scoring head (10: β ≈ 0.99995, remember everything).
    #[arg(long = "bias-init", default_value_t = 10.0)]
    pub bias_init: f32,
    /// Tokens per training sequence.
    #[arg(long = "seq-len", default_value_t = 256)]
    pub seq_len: usize,
    /// Take the loss on the last N positions of each sequence only; the
    /// positions before them run ungated as the context those N queries
    /// attend to, their entries decaying by their own gates (ages up to
    /// --seq-len are learned at N × seq-len attention cost instead of
    /// seq-len²). 0: the whole sequence.
    #[arg(long = "loss-window", value_name = "N", default_value_t = 0)]
    pub loss_window: usize,
    /// How retention enters the training attention: logit (the paper's: the
    /// scaled logit × β^age, a decayed entry's logit → 0) or weight (the
    /// attention weight × β^age, a decayed entry's weight → 0, as eviction
    /// does at inference).
    #[arg(long = "decay", default_value = "logit")]
    pub decay: String,
    /// Optimizer steps (one sequence each).
    #[arg(long = "steps", default_value_t = 300)]
    pub steps: usize,
    /// AdamW learning rate.
    #[arg(long = "lr", default_value_t = 1e-2)]
    pub lr: f64,
    /// Linear warm-up steps.
    #[arg(long = "warmup", default_value_t = 10)]
    pub warmup: usize,
    /// AdamW weight decay.
    #[arg(long = "weight-decay", default_value_t = 0.0)]
    pub weight_decay: f64,
    /// Weight of the next-token cross-entropy beside the KL (fwkl_ntp).
    #[arg(long = "ce-weight", default_value_t = 0.0)]
    pub ce_weight: f64,
    /// λ: weight of the capacity hinge.
    #[arg(long = "cap-weight", default_value_t = 1.0)]
    pub cap_weight: f64,
    #[arg(long = "seed", default_value_t = 1)]
    pub seed: u64,
    /// Checkpoint every N steps (0 = only at the end).
    #[arg(long = "save-every", default_value_t = 25)]
    pub save_every: usize,
    /// Continue from the checkpoint next to --out.
    #[arg(long = "resume")]
    pub resume: bool,
    /// Start from these gates instead of a fresh initialization (a second
    /// stage, e.g. longer sequences at a smaller capacity; the optimizer
    /// starts afresh and the file's metadata records the first stage).
    #[arg(long = "init", value_name = "GATES", conflicts_with = "resume")]
    pub init: Option<PathBuf>,
    /// Gate file to write (default: <model stem>.gates.safetensors next to the model).
    #[arg(short = 'o', long = "out")]
    pub out: Option<PathBuf>,
}

/// Run `kvrun train ...`.
pub fn run_train(c: &TrainCmd) -> Result<()> {
    match c {
        TrainCmd::Gates(a) => run_gates(a),
    }
}

fn run_gates(a: &GatesArgs) -> Result<()> {
    let arch = GateArch::parse(&a.arch).ok_or_else(|| {
        Error::arg(
            "--arch",
            format!("unknown gate architecture '{}' (rg, rg10)", a.arch),
        )
    })?;
    let decay = train::model::Decay::parse(&a.decay).ok_or_else(|| {
        Error::arg(
            "--decay",
            format!("unknown retention decay '{}' (logit, weight)", a.decay),
        )
    })?;
    if a.budget == 0 {
        return Err(Error::arg("--budget", "must be at least 1"));
    }
    if a.inter == 0 || a.inter > 65536 {
        return Err(Error::arg("--gate-dim", "must be in 1..=65536"));
    }
    if a.seq_len < 2 || a.seq_len > 32768 {
        return Err(Error::arg("--seq-len", "must be in 2..=32768"));
    }
    if a.loss_window >= a.seq_len {
        return Err(Error::arg(
            "--loss-window",
            format!(
                "must be below --seq-len ({}), or 0 for the whole sequence",
                a.seq_len
            ),
        ));
    }
    let window = train::loss_positions(a.seq_len, a.loss_window);
    if !(a.lr > 0.0 && a.lr < 1.0) {
        return Err(Error::arg("--lr", "must be in (0, 1)"));
    }
    let model_path = resolve_model(&a.model.model)?;
    let out = a.out.clone().unwrap_or_else(|| gates_path_for(&model_path));
    if a.resume && !out.is_file() {
        return Err(Error::arg(
            "--resume",
            format!("no checkpoint at {}", out.display()),
        ));
    }
    if let Some(p) = &a.init {
        if !p.is_file() {
            return Err(Error::arg(
                "--init",
                format!("no gate file at {}", p.display()),
            ));
        }
    }
    let threads = resolve_threads(a.model.threads)?;
    crate::train::set_threads(threads);
    let model = load_model(&a.model)?;
    let w = model.weights();
    if let Some(have) = available_memory() {
        let need = train::graph_bytes(&w.config, a.seq_len, a.loss_window);
        if need > have {
            return Err(Error::arg(
                "--seq-len",
                format!(
                    "{} tokens need about {:.1} GiB to train (one layer's gated attention keeps {} heads × {} × {} values for the backward pass, the vocabulary-wide rows {} × {}); {:.1} GiB are available: use a shorter --seq-len or a --loss-window",
                    a.seq_len,
                    need as f64 / GIB,
                    w.config.n_heads,
                    window,
                    a.seq_len,
                    window,
                    w.config.vocab,
                    have as f64 / GIB
                ),
            ));
        }
    }
    let specs: Vec<DataSpec> = a
        .data
        .iter()
        .map(|p| DataSpec {
            path: p.clone(),
            skip_tokens: a.skip_tokens,
            skip_records: a.skip_records,
        })
        .collect();
    let stream = train::load_tokens(&model.tokenizer, &specs, a.steps * a.seq_len)?;
    if stream.len() < a.seq_len {
        return Err(Error::arg(
            "--data",
            format!(
                "the training data holds {} tokens, fewer than one sequence of {}",
                stream.len(),
                a.seq_len
            ),
        ));
    }
    eprintln!(
        "train gates: {} ({} layers, {} KV heads), {} {}×{} → {} (I = {}), M = {}, {} tokens of data, {} steps of {} tokens{}, {} threads",
        model.name(),
        w.config.n_layers,
        w.config.n_kv_heads,
        arch.name(),
        w.config.dim,
        a.inter,
        w.config.n_kv_heads,
        a.inter,
        a.budget,
        stream.len(),
        a.steps,
        a.seq_len,
        if window < a.seq_len {
            format!(" (loss on the last {window})")
        } else {
            String::new()
        },
        threads
    );
    let base = train::model::Base::from_weights(w, a.seq_len, candle_core::DType::F32)
        .map_err(|e| Error::Other(format!("training: {e}")))?;
    let cfg = TrainConfig {
        arch,
        inter: a.inter,
        bias_init: a.bias_init,
        objective: Objective {
            budget: a.budget,
            ce_weight: a.ce_weight,
            cap_weight: a.cap_weight,
        },
        seq_len: a.seq_len,
        loss_window: a.loss_window,
        decay,
        steps: a.steps,
        lr: a.lr,
        warmup: a.warmup,
        weight_decay: a.weight_decay,
        seed: a.seed,
        save_every: a.save_every,
        out: out.clone(),
        resume: a.resume,
        init: a.init.clone(),
        model_name: model.name(),
        data_desc: specs
            .iter()
            .map(|d| {
                let name = d
                    .path
                    .file_name()
                    .map(|s| s.to_string_lossy().into_owned())
                    .unwrap_or_default();
                if d.path.extension().is_some_and(|e| e == "jsonl") {
                    format!("{name} (records from {})", d.skip_records)
                } else {
                    format!("{name} (tokens from {})", d.skip_tokens)
                }
            })
            .collect(),
        progress: true,
    };
    let mut engine =
        (window < a.seq_len).then(|| train::EnginePrefix::new(w, a.seq_len - window, threads));
    let t0 = std::time::Instant::now();
    let (gates, hist) = train::train(&base, &stream, &cfg, engine.as_mut())?;
    gates.save(&out)?;
    let first = hist.first().copied().unwrap_or_default();
    let m = &gates.meta["final"];
    eprintln!(
        "wrote {} ({} parameters) in {:.1} min: loss {:.4} → {:.4} (kl {:.4}, cap {:.4}, occupancy {:.1}; means of the last {} steps)",
        out.display(),
        gates.n_params(),
        t0.elapsed().as_secs_f64() / 60.0,
        first.total,
        m["total"].as_f64().unwrap_or(f64::NAN),
        m["kl"].as_f64().unwrap_or(f64::NAN),
        m["cap"].as_f64().unwrap_or(f64::NAN),
        m["occupancy"].as_f64().unwrap_or(f64::NAN),
        m["over_last_steps"].as_u64().unwrap_or(0),
    );
    Ok(())
}

const GIB: f64 = (1u64 << 30) as f64;

/// Memory the system can still give (Linux `MemAvailable`), if known.
fn available_memory() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = s.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}
