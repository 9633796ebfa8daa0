//! `kvrun synth`: write a synthetic-weight model, a GGUF with another
//! GGUF's metadata and tensor table (byte for byte) and random tensor data
//! (`crate::format::synth`). `-m synth:HEADER` makes the same model in
//! memory instead.

use crate::cmd::interrupt;
use crate::error::{Error, Result};
use crate::format::synth::{self, Spec};
use clap::Args;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Args, Debug)]
pub struct SynthArgs {
    /// The GGUF whose header (metadata and tensor table) to keep: a
    /// header-only file such as ../shared/data/r1-distill-qwen-7b.header.gguf,
    /// or any model.
    pub header: PathBuf,
    /// Output GGUF file.
    #[arg(short = 'o', long)]
    pub out: PathBuf,
    /// Seed of the random weights.
    #[arg(short = 's', long, default_value_t = 0)]
    pub seed: u64,
    /// Standard deviation of the random tensors (norms are 1).
    #[arg(long, default_value_t = 0.02)]
    pub sigma: f32,
    /// Threads (default: all cores).
    #[arg(short = 't', long)]
    pub threads: Option<usize>,
    /// Reshape to a named shape (r1-distill-qwen-1.5b, r1-distill-qwen-7b,
    /// r1-distill-qwen-14b, r1-distill-llama-8b, qwen3-8b, qwen3-30b-a3b,
    /// qwen3-30b-a3b-8l, phi4-mini, tiny, tiny-moe), keeping the header's
    /// architecture, tokenizer and vocabulary.
    #[arg(long)]
    pub shape: Option<String>,
    /// Retype to a llama.cpp quantization mix (Q4_K_M, Q5_K_M, Q6_K, Q8_0,
    /// Q4_0, Q3_K_M, Q2_K, IQ4_XS, IQ4_NL): its per-tensor type choices.
    #[arg(long = "type")]
    pub mix: Option<String>,
    /// Build this architecture's tensor table from scratch (llama, qwen2,
    /// qwen3, qwen3moe, gemma3, phi3; needs --shape), keeping only the
    /// header's tokenizer: a model of a family no header is at hand for.
    #[arg(long)]
    pub arch: Option<String>,
}

pub fn run_synth(a: &SynthArgs) -> Result<()> {
    if a.threads == Some(0) {
        return Err(Error::arg("-t/--threads", "must be at least 1"));
    }
    if !(a.sigma.is_finite() && a.sigma > 0.0) {
        return Err(Error::arg(
            "--sigma",
            format!("{} must be finite and positive", a.sigma),
        ));
    }
    if !a.header.is_file() {
        return Err(Error::arg(
            "HEADER",
            format!("{}: no such file", a.header.display()),
        ));
    }
    let mut spec = Spec {
        seed: a.seed,
        sigma: a.sigma,
        ..Spec::default()
    };
    if let Some(t) = a.threads {
        spec.threads = t;
    }
    let arch = match &a.arch {
        None => None,
        Some(n) => Some(*synth::ARCHS.iter().find(|&&x| x == n).ok_or_else(|| {
            Error::arg(
                "--arch",
                format!(
                    "unknown architecture {n:?} (known: {})",
                    synth::ARCHS.join(", ")
                ),
            )
        })?),
    };
    if arch.is_some() && a.shape.is_none() {
        return Err(Error::arg(
            "--arch",
            "needs --shape (the new model's dimensions)",
        ));
    }
    let recipe = synth::Recipe {
        arch,
        shape: match &a.shape {
            None => None,
            Some(n) => Some(synth::shape(n).ok_or_else(|| {
                Error::arg(
                    "--shape",
                    format!(
                        "unknown shape {n:?} (known: {})",
                        synth::SHAPES.map(|(n, _)| n).join(", ")
                    ),
                )
            })?),
        },
        mix: match &a.mix {
            None => None,
            Some(n) => Some(synth::Mix::parse(n).ok_or_else(|| {
                Error::arg(
                    "--type",
                    format!(
                        "unknown mix {n:?} (known: {})",
                        synth::Mix::ALL.map(|(n, _)| n).join(", ")
                    ),
                )
            })?),
        },
    };
    // writing over the header the model is made from is refused, as
    // `batch -i X -o X` is
    if let (Ok(h), Ok(o)) = (a.header.canonicalize(), a.out.canonicalize()) {
        if h == o {
            return Err(Error::arg(
                "-o/--out",
                format!(
                    "{} is the header file itself; write the model to another file",
                    a.out.display()
                ),
            ));
        }
    }
    // Ctrl-C or SIGTERM: stop, remove the unfinished file, exit 130 / 143
    interrupt::install_term();
    interrupt::set_mode(interrupt::Mode::Busy);
    spec.stop = Some(interrupt::requested);
    let t0 = Instant::now();
    let n = synth::write_file(&a.header, &recipe, &a.out, &spec)?;
    eprintln!(
        "synth: wrote {} ({:.2} GiB) in {:.1} s",
        a.out.display(),
        n as f64 / (1u64 << 30) as f64,
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}
