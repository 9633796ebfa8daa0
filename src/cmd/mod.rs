//! The command layer: `kvrun`'s command line and one module per command.
//!
//! Everything clap-derived lives here, on top of the library (model, policy,
//! kv, backend, load, tokenizer, chat, sample, generate), which never
//! imports from `cmd`. [`parse`] turns argv into a [`Cli`] (llama.cpp's
//! multi-letter short flags such as `-sys` or `-ngl` are rewritten to their
//! long forms first, since clap only knows one-letter short flags);
//! [`run()`](fn@run) dispatches it:
//!
//! - [`run`](mod@run): one-shot generation (no subcommand), [`inspect`],
//!   [`bench`], [`chat`] (the REPL), [`eval`] (`ppl`, `sweep`, `passkey`),
//!   [`batch`] (with [`grade`] for the answers), [`calibrate`], [`serve`], [`synth`],
//!   [`viz`] (the eviction viewer).
//! - [`args`]: the flag groups several commands share (model, KV policy,
//!   sampling, one-shot) and their resolution; [`prompt`]: prompt tokens.
//! - [`load_model`]: the one way every command loads its model.

pub mod args;
pub mod batch;
pub mod bench;
pub mod calibrate;
pub mod calibrate_headkv;
pub mod chat;
pub mod eval;
pub mod grade;
pub mod inspect;
pub mod interrupt;
pub mod plot;
pub mod prompt;
pub mod run;
pub mod serve;
pub mod synth;
#[cfg(feature = "train")]
pub mod train;
pub mod viz;

pub use args::{KvArgs, ModelArgs, RunArgs, SamplingArgs};

use crate::error::{Error, Result};
use crate::load::Loaded;
use args::{normalize_args, resolve_model};
use clap::{Parser, Subcommand};
use std::path::PathBuf;

#[derive(Parser, Debug)]
#[command(
    name = "kvrun",
    version,
    about = "kvrun: LLM inference for long reasoning traces, with a budgeted KV cache",
    args_conflicts_with_subcommands = true
)]
pub struct Cli {
    #[command(subcommand)]
    pub cmd: Option<Cmd>,
    #[command(flatten)]
    pub run: RunArgs,
}

#[derive(Subcommand, Debug)]
pub enum Cmd {
    /// Print a model's architecture, shapes, tensor types, tokenizer and template.
    Inspect {
        /// GGUF file (a header-only file works too; default: the default model).
        model: Option<PathBuf>,
        /// The same as the positional file (for `kvrun -m FILE inspect`).
        #[arg(short = 'm', long = "model", conflicts_with = "model")]
        model_flag: Option<PathBuf>,
    },
    /// llama-bench-style table: kvrun vs llama.cpp (same file, same threads).
    Bench(bench::BenchArgs),
    /// Multi-turn chat REPL (the KV cache carries over between turns).
    Chat(chat::ChatArgs),
    /// Fidelity evaluation of eviction policies.
    #[command(subcommand)]
    Eval(eval::EvalCmd),
    /// Run a JSONL file of problems and grade the answers (`batch merge` combines shards).
    Batch(batch::BatchCmd),
    /// Calibrate a policy for a model (`calibrate epikv`: EPIKV's bands and layers; `calibrate headkv`: HeadKV's head scores).
    #[command(subcommand)]
    Calibrate(calibrate::CalibrateCmd),
    /// OpenAI-compatible HTTP server (chat, completions, models, health, metrics).
    Serve(serve::ServeArgs),
    /// Draw what each policy's cache kept, token by token: one self-contained HTML page.
    Viz(viz::VizArgs),
    /// Write a synthetic-weight model: a GGUF header's shapes and types with random weights.
    Synth(synth::SynthArgs),
    /// Train what a policy learns (`train gates`: TRIM-KV / DBTrimKV retention gates).
    #[cfg(feature = "train")]
    #[command(subcommand)]
    Train(train::TrainCmd),
}

/// Load the model `-m` names (or the default one): checkpoint, weights and
/// tokenizer, with the tokenizer checked against the embedding. Every
/// command loads through here.
pub fn load_model(m: &ModelArgs) -> Result<Loaded> {
    if crate::backend::Device::parse(&m.device)? != crate::backend::Device::Cpu {
        return Err(Error::arg(
            "--device",
            format!("{}: this command runs on the CPU only for now (the one-shot command and `kvrun bench` run on the GPU)", m.device),
        ));
    }
    let loader = m.loader(crate::backend::Device::Cpu)?;
    Loaded::open_with(&resolve_model(&m.model)?, &loader)
}

/// `load_model` for the commands that run on any device (`device`, from
/// [`resolve_device`]): a device this build or machine cannot use fails
/// before any loading.
pub fn load_model_any_device(m: &ModelArgs, device: crate::backend::Device) -> Result<Loaded> {
    device.check()?;
    let loader = m.loader(device)?;
    Loaded::open_with(&resolve_model(&m.model)?, &loader)
}

/// The device a command computes on: `--device`, or `-ngl N` (llama.cpp's
/// habit: any N > 0 puts every layer on the first GPU, 0 none; kvrun does
/// not split a model between devices).
pub fn resolve_device(m: &ModelArgs, gpu_layers: Option<&str>) -> Result<crate::backend::Device> {
    use crate::backend::Device;
    let dev = Device::parse(&m.device)?;
    let Some(n) = gpu_layers else {
        return Ok(dev);
    };
    let n: i64 = match n {
        "all" | "auto" => -1,
        _ => n.parse().map_err(|_| {
            Error::arg(
                "-ngl/--gpu-layers",
                format!("'{n}' is not a layer count (a number, or all)"),
            )
        })?,
    };
    Ok(match (dev, n) {
        (Device::Cpu, 0) => Device::Cpu,
        (Device::Cpu, _) => Device::Cuda(0),
        (Device::Cuda(_), 0) => {
            return Err(Error::arg(
                "-ngl/--gpu-layers",
                "0 layers on the GPU contradicts --device cuda (drop one of them)",
            ))
        }
        (d, _) => d,
    })
}

/// The model's weights uploaded to `b`, after checking that the GPU
/// kernels can run its shapes and the cache settings.
pub fn device_weights<'a>(
    b: &crate::backend::cuda::Cuda,
    m: &'a Loaded,
    kv: &args::KvArgs,
) -> Result<crate::model::Weights<'a, crate::backend::cuda::Cuda>> {
    if kv.pos_mode()? == crate::kv::PosMode::Cache {
        return Err(Error::arg(
            "--pos-mode",
            "cache (StreamingLLM position shift) is not supported with --device cuda yet; use --pos-mode absolute",
        ));
    }
    let g = match m.checkpoint() {
        crate::load::Checkpoint::Gguf(g) => g,
        crate::load::Checkpoint::Hf(_) => {
            return Err(Error::arg(
                "--device",
                "cuda: Hugging Face (safetensors) checkpoints run on the CPU only for now; convert the model to GGUF",
            ))
        }
    };
    let c = &m.weights().config;
    crate::backend::cuda::plan::check_attention_shape(c.n_heads, c.n_kv_heads, c.head_dim)?;
    crate::model::Weights::from_gguf_on(b, g)
}

/// The policy table shown in `--help`, from the registry.
pub fn policies_help() -> String {
    let mut s = String::from("KV-cache policies (--policy):\n");
    let w = crate::policy::POLICIES
        .iter()
        .map(|p| p.name.len())
        .max()
        .unwrap_or(0);
    for p in crate::policy::POLICIES {
        s.push_str(&format!("  {:w$} {}\n", p.name, p.about));
    }
    s
}

/// Parse argv (llama.cpp multi-letter flags accepted) into a `Cli`.
/// Arguments are OS strings: paths may be any bytes; a text value that is
/// not UTF-8 is a one-line error naming its flag.
pub fn parse<T: Into<std::ffi::OsString>>(
    args: impl IntoIterator<Item = T>,
) -> std::result::Result<Cli, clap::Error> {
    use clap::{CommandFactory, FromArgMatches};
    let help = format!(
        "{}\nWithout a subcommand kvrun generates from -p/-f (one-shot, like llama-completion).\n\
         Multi-letter llama.cpp flags are accepted: -sys, -sysf, -ngl, -tb, -st, -no-cnv, -np.",
        policies_help()
    );
    let args = args::hoist_global_flags(normalize_args(args));
    let m = allow_negative_values(Cli::command().after_help(help))
        .try_get_matches_from(args.clone())
        .map_err(|e| match (e.kind(), args::non_utf8_message(&args)) {
            (clap::error::ErrorKind::InvalidUtf8, Some(msg)) => {
                clap::Error::raw(clap::error::ErrorKind::InvalidUtf8, msg + "\n")
            }
            _ => negative_value_error(&e).unwrap_or(e),
        })?;
    Cli::from_arg_matches(&m)
}

/// Let every flag that takes a value take a negative number (`-c -1`), so
/// that the value reaches its parser and the error names the flag and its
/// range instead of clap's "unexpected argument '-1'".
fn allow_negative_values(cmd: clap::Command) -> clap::Command {
    cmd.mut_args(|a| {
        if a.get_action().takes_values() {
            a.allow_negative_numbers(true)
        } else {
            a
        }
    })
    .mut_subcommands(allow_negative_values)
}

/// A negative number given to an unsigned flag, as a one-line error naming
/// the flag and the allowed range.
fn negative_value_error(e: &clap::Error) -> Option<clap::Error> {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    if !matches!(
        e.kind(),
        ErrorKind::ValueValidation | ErrorKind::InvalidValue
    ) {
        return None;
    }
    let text = |k| match e.get(k) {
        Some(ContextValue::String(s)) => Some(s.clone()),
        _ => None,
    };
    let value = text(ContextKind::InvalidValue)?;
    value.parse::<f64>().ok().filter(|v| *v < 0.0)?;
    let flag = text(ContextKind::InvalidArg)?;
    let flag = flag.split_whitespace().next().unwrap_or(&flag).to_owned();
    Some(clap::Error::raw(
        ErrorKind::ValueValidation,
        format!("{flag}: must be a whole number ≥ 0, got {value}\n"),
    ))
}

/// A clap error as the one line kvrun prints for bad input: its first
/// paragraph joined, plus clap's tip when it has one (help and version
/// output are not errors and are printed whole by the caller).
pub fn one_line(e: &clap::Error) -> String {
    let text = e.render().to_string();
    let mut paras = text.split("\n\n").map(|p| {
        p.lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect::<Vec<_>>()
            .join(" ")
    });
    let mut line = paras.next().unwrap_or_default();
    if let Some(tip) = paras.find(|p| p.starts_with("tip:")) {
        line = format!("{line} ({tip})");
    }
    line
}

/// Entry point used by main: parse already-normalized args and run.
pub fn run(cli: Cli) -> Result<()> {
    match &cli.cmd {
        Some(Cmd::Inspect { model, model_flag }) => {
            inspect::run_inspect(&resolve_model(&model.clone().or(model_flag.clone()))?)
        }
        Some(Cmd::Bench(b)) => bench::run_bench(b),
        Some(Cmd::Chat(c)) => chat::run_chat(c),
        Some(Cmd::Calibrate(c)) => calibrate::run_calibrate(c),
        Some(Cmd::Eval(eval::EvalCmd::Ppl(p))) => eval::ppl::run_ppl(p),
        Some(Cmd::Eval(eval::EvalCmd::Sweep(s))) => eval::sweep::run_sweep(s),
        Some(Cmd::Eval(eval::EvalCmd::Passkey(p))) => eval::passkey::run_passkey(p),
        Some(Cmd::Eval(eval::EvalCmd::Perturbation(p))) => eval::perturb::run_perturbation(p),
        Some(Cmd::Batch(b)) => batch::run_batch(b),
        Some(Cmd::Serve(s)) => serve::run_serve(s),
        Some(Cmd::Synth(s)) => synth::run_synth(s),
        Some(Cmd::Viz(v)) => viz::run_viz(v),
        #[cfg(feature = "train")]
        Some(Cmd::Train(t)) => train::run_train(t),
        None => run::run_generate(&cli.run),
    }
}
