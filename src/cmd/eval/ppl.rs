//! `kvrun eval ppl`: teacher-forced perplexity, ΔNLL, KL and top-1
//! agreement of one policy against the full cache, on a whole text and on a
//! chosen segment (see [`super::fidelity`] for the measurement).

use crate::cmd::args::{resolve_model, resolve_threads, KvArgs, ModelArgs};
use crate::cmd::eval::fidelity::{
    eval_points, EvalText, Fidelity, Lockstep, PplReport, Progress, TextArgs,
};
use crate::cmd::load_model;
use crate::error::{Error, Result};
use clap::Args;

/// Flags of `kvrun eval ppl`.
#[derive(Args, Debug, Clone)]
pub struct PplArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub kv: KvArgs,
    #[command(flatten)]
    pub text: TextArgs,
    /// Tokens of the text to evaluate (0 = all).
    #[arg(long = "ctx", default_value_t = 2048)]
    pub ctx: usize,
    /// Tokens fed per step (1 = token by token, exactly as in decoding).
    #[arg(long = "chunk", default_value_t = 1)]
    pub chunk: usize,
    /// Also report fidelity on the tokens after the first occurrence of MARKER.
    #[arg(long = "segment-after")]
    pub segment_after: Option<String>,
    /// Also report fidelity on the last N tokens.
    #[arg(long = "segment-last")]
    pub segment_last: Option<usize>,
    /// Print one JSON object instead of text.
    #[arg(long = "json")]
    pub json: bool,
    /// Seed for seeded policies.
    #[arg(short = 's', long = "seed", default_value_t = 0)]
    pub seed: u64,
}

/// Run the evaluation: [`eval_points`] with one point.
pub fn eval_ppl(a: &PplArgs) -> Result<PplReport> {
    let path = resolve_model(&a.model.model)?;
    let n_threads = resolve_threads(a.model.threads)?;
    if a.chunk == 0 {
        return Err(Error::arg("--chunk", "must be at least 1"));
    }
    let raw = a.text.load()?;
    let model = load_model(&a.model)?;
    let (w, tok) = (model.weights(), &model.tokenizer);
    let text = EvalText::new(tok, &raw, a.ctx, a.segment_after.as_deref(), a.segment_last)?;
    let mut prog = Progress::new(text.n_predicted(), !a.json, false);
    let lk = Lockstep {
        model: &path,
        chunk: a.chunk,
        n_threads,
        seed: a.seed,
    };
    let mut rs = eval_points(w, &text, std::slice::from_ref(&a.kv), lk, &mut |k| {
        prog.advance(k)
    })?;
    prog.clear();
    rs.pop()
        .ok_or_else(|| Error::Other("eval_points returned no report".into()))
}

/// `kvrun eval ppl` printing.
pub fn run_ppl(a: &PplArgs) -> Result<()> {
    a.kv.check()?;
    let r = eval_ppl(a)?;
    if a.json {
        println!(
            "{}",
            serde_json::to_string(&r).map_err(|e| Error::Other(e.to_string()))?
        );
        return Ok(());
    }
    let row = |name: &str, f: &Fidelity| {
        println!(
            "{name:8} n={:6}  ppl {:9.4} (full {:9.4})  dNLL {:+.5} nats/tok  KL {:.5}  top1 {:6.2}%",
            f.n, f.ppl, f.ppl_full, f.delta_nll, f.kl, 100.0 * f.top1_agree
        )
    };
    println!(
        "policy {} budget {} | {} tokens | peak KV {} entries ({:.2} MiB) | evicted {} | {:.1} tok/s (policy session alone, 1 thread)",
        r.policy,
        r.budget.map(|b| b.to_string()).unwrap_or_else(|| "none".into()),
        r.n_tokens,
        r.peak_kv_entries,
        r.peak_kv_bytes as f64 / (1 << 20) as f64,
        r.evicted,
        r.tokens_per_second
    );
    row("all", &r.all);
    if let (Some(s), Some(st)) = (&r.segment, r.segment_start) {
        row(&format!("seg@{st}"), s);
    }
    println!(
        "Final estimate: PPL = {:.4} +/- {:.5}",
        r.all.ppl, r.all.ppl_err
    );
    Ok(())
}
