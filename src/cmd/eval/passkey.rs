//! `kvrun eval passkey`: synthetic long-context retrieval under a KV budget.
//!
//! A five-digit pass key is hidden at a relative depth of a long haystack
//! (repeated filler sentences, or a real reasoning trace from a JSONL file),
//! and the model is asked for it at the end; the answer's first words
//! ("The pass key is", `--answer-prefix`) close the prompt, as in the
//! standard pass-key format, so the next tokens are the key itself and an
//! observation-window policy's last queries are the ones that will copy it.
//! Greedy decoding; a trial is correct when the generated text contains the
//! key. The table reports accuracy per depth for the chosen policy and
//! budget, next to the full cache on the same prompts (so a miss of the
//! model itself is not charged to the policy).

use crate::cmd::args::{resolve_model, resolve_threads, KvArgs, ModelArgs};
use crate::cmd::load_model;
use crate::cmd::prompt::prompt_tokens;
use crate::error::{Error, Result};
use crate::generate::{generate, GenOptions, Session};
use crate::sample::{Rng, Sampler, SamplerConfig};
use clap::Args;
use serde::Serialize;
use std::path::PathBuf;

/// Flags of `kvrun eval passkey`.
#[derive(Args, Debug, Clone)]
pub struct PasskeyArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub kv: KvArgs,
    /// Approximate haystack length in tokens.
    #[arg(long = "ctx", default_value_t = 1024)]
    pub ctx: usize,
    /// Relative depths of the needle, comma-separated (0 = start, 1 = end).
    #[arg(
        long = "depths",
        default_value = "0.1,0.3,0.5,0.7,0.9",
        value_delimiter = ','
    )]
    pub depths: Vec<f64>,
    /// Trials per depth (different keys).
    #[arg(long = "trials", default_value_t = 3)]
    pub trials: usize,
    /// Use the reasoning traces of this JSONL (field `output`) as the haystack.
    #[arg(long = "trace")]
    pub trace: Option<PathBuf>,
    /// Seed for the keys.
    #[arg(short = 's', long = "seed", default_value_t = 1)]
    pub seed: u64,
    /// Text the answer starts with (the assistant's turn is primed with it,
    /// as in the standard pass-key prompt; "" = the model answers freely).
    #[arg(long = "answer-prefix", default_value = "The pass key is")]
    pub answer_prefix: String,
    /// Print JSON.
    #[arg(long = "json")]
    pub json: bool,
    /// Print every trial's greedy answer (full cache and policy) to stderr.
    #[arg(long = "show-answers")]
    pub show_answers: bool,
}

/// Accuracy at one depth.
#[derive(Debug, Clone, Serialize)]
pub struct DepthResult {
    pub depth: f64,
    pub correct: usize,
    pub correct_full: usize,
    pub trials: usize,
}

/// Tokens of a pass-key prompt besides the haystack (the instructions, the
/// key sentences, the chat template, the answer prefix), with room to spare.
const PROMPT_MARGIN: usize = 256;

const FILLER: &str =
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ";

fn haystack(a: &PasskeyArgs) -> Result<String> {
    match &a.trace {
        None => Ok(FILLER.to_owned()),
        Some(p) => {
            let s = std::fs::read_to_string(p).map_err(|source| Error::Io {
                path: p.clone(),
                source,
            })?;
            let mut out = String::new();
            for (i, line) in s.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
                let v: serde_json::Value = serde_json::from_str(line).map_err(|e| {
                    Error::arg("--trace", format!("{} line {}: {e}", p.display(), i + 1))
                })?;
                if let Some(t) = v.get("output").and_then(|x| x.as_str()) {
                    out.push_str(t);
                    out.push('\n');
                }
            }
            if out.is_empty() {
                return Err(Error::arg(
                    "--trace",
                    format!("{}: no `output` text found", p.display()),
                ));
            }
            Ok(out)
        }
    }
}

/// Run the evaluation.
pub fn eval_passkey(a: &PasskeyArgs) -> Result<Vec<DepthResult>> {
    let path = resolve_model(&a.model.model)?;
    let n_threads = resolve_threads(a.model.threads)?;
    if a.trials == 0 || a.depths.iter().any(|d| !(0.0..=1.0).contains(d)) {
        return Err(Error::arg(
            "--depths/--trials",
            "depths must lie in [0, 1] and trials ≥ 1",
        ));
    }
    let model = load_model(&a.model)?;
    let (w, tok) = (model.weights(), &model.tokenizer);
    // the full-cache reference holds the whole haystack (and the question):
    // a --ctx whose cache cannot be allocated is refused before any text is built
    crate::cmd::args::check_ctx_alloc_for(
        "--ctx",
        &w.config,
        a.ctx.saturating_add(PROMPT_MARGIN),
        n_threads,
    )?;
    let tmpl = model.chat_template()?;
    let hay = haystack(a)?;
    // Build a haystack of about `ctx` tokens as a list of sentence-sized pieces.
    let per_char = tok.encode(&hay[..hay.len().min(4000)], false, false)?.len() as f64
        / hay.len().min(4000) as f64;
    let want_chars = (a.ctx as f64 / per_char.max(1e-3)) as usize;
    let mut text = String::new();
    while text.len() < want_chars {
        text.push_str(&hay);
    }
    let mut cut = want_chars.min(text.len());
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    text.truncate(cut);
    let mut rng = Rng::new(a.seed);
    let mut results = Vec::new();
    for &d in &a.depths {
        let mut r = DepthResult {
            depth: d,
            correct: 0,
            correct_full: 0,
            trials: a.trials,
        };
        for _ in 0..a.trials {
            let key = 10000 + rng.next_u64() % 90000;
            let mut at = (text.len() as f64 * d) as usize;
            while !text.is_char_boundary(at) {
                at -= 1;
            }
            let prompt = format!(
                "There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it.\n\n{} The pass key is {key}. Remember it. {key} is the pass key. {}\n\nWhat is the pass key?",
                &text[..at],
                &text[at..]
            );
            let mut ids = prompt_tokens(tok, tmpl.as_ref(), &prompt, None, false)?;
            // The answer's first words close the prompt (Mohtashami & Jaggi's
            // pass-key format): the model's next tokens are the key itself,
            // and an observation-window policy sees the queries that copy it.
            if !a.answer_prefix.is_empty() {
                let sep = if tmpl.is_some() { "" } else { " " };
                ids.extend(tok.encode(&format!("{sep}{}", a.answer_prefix), false, false)?);
            }
            let n_ctx = ids.len() + 16;
            for full in [true, false] {
                let mut sess = if full {
                    Session::new(w, n_ctx, n_threads, 256)
                } else {
                    let mut s = match a.kv.build(a.seed, &path)? {
                        None => Session::new(w, n_ctx, n_threads, 256),
                        Some(p) => Session::with_policy(w, n_ctx, n_threads, 256, p)?,
                    };
                    a.kv.configure(&mut s)?;
                    s
                };
                let mut sampler = Sampler::new(SamplerConfig {
                    temp: 0.0,
                    ..Default::default()
                });
                let mut out = String::new();
                generate(
                    &mut sess,
                    tok,
                    &mut sampler,
                    &ids,
                    &GenOptions {
                        n_predict: 12,
                        ignore_eos: false,
                    },
                    |s| {
                        out.push_str(s);
                        true
                    },
                )?;
                let ok = out.contains(&key.to_string());
                if a.show_answers {
                    let who = if full { "full" } else { a.kv.policy.as_str() };
                    eprintln!(
                        "depth {d:.2} key {key} {who}: {} {:?}",
                        if ok { "ok  " } else { "miss" },
                        out.trim()
                    );
                }
                if full {
                    r.correct_full += ok as usize;
                } else {
                    r.correct += ok as usize;
                }
            }
        }
        results.push(r);
    }
    Ok(results)
}

/// `kvrun eval passkey` printing.
pub fn run_passkey(a: &PasskeyArgs) -> Result<()> {
    a.kv.check()?;
    let rs = eval_passkey(a)?;
    if a.json {
        println!(
            "{}",
            serde_json::to_string(&rs).map_err(|e| Error::Other(e.to_string()))?
        );
        return Ok(());
    }
    let budget =
        a.kv.kv_budget
            .map(|b| b.to_string())
            .unwrap_or_else(|| "none".into());
    println!("| depth | {} @ {budget} | full cache |", a.kv.policy);
    println!("| ---: | ---: | ---: |");
    for r in &rs {
        println!(
            "| {:.2} | {}/{} | {}/{} |",
            r.depth, r.correct, r.trials, r.correct_full, r.trials
        );
    }
    Ok(())
}
