//! `kvrun calibrate headkv`: per-head importance scores for HeadKV
//! (`policy::headkv`), written as `<model stem>.headkv.json`.
//!
//! Procedure (retrieval heads, Wu et al. 2024, as HeadKV uses them): for
//! each of `--trials` needle tests, a haystack of `--context` tokens of the
//! given text gets a needle sentence ("The secret code of the archive is"
//! followed by 8 random words, a new draw per trial, seeded) inserted at
//! depth (i + 0.5) / trials (the haystacks start `--skip-tokens` into the
//! text, so that evaluated text stays out); then a question and the needle sentence again,
//! teacher-forced, the cache keeping every token. At every token of the
//! copied sentence, every query head whose most attended key (argmax of
//! q·k over the cache, the fused attention's logits recomputed from the
//! recorded queries and the cached keys) is the needle's copy of that
//! token scores a hit (`headkv::retrieval_hits`). A query head's score is
//! its hit rate over every copied token of every trial; a KV head's, the
//! mean over its GQA group.

use crate::cmd::args::{resolve_model, resolve_threads, ModelArgs};
use crate::cmd::load_model;
use crate::error::{Error, Result};
use crate::generate::{Session, StepObserver};
use crate::model::llama::Logits;
use crate::policy::headkv::{retrieval_hits, scores_path_for, HeadScores};
use crate::policy::Step;
use crate::rng::Rng;
use crate::signals::Needs;
use clap::Args;
use std::path::PathBuf;

/// `kvrun calibrate headkv` flags.
#[derive(Args, Debug, Clone)]
pub struct HeadkvArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Haystack text (plain text; e.g. ../shared/data/wikitext2_test_lf.txt).
    #[arg(short = 'f', long = "file")]
    pub file: PathBuf,
    /// Haystack tokens per trial.
    #[arg(long = "context", default_value_t = 1024)]
    pub context: usize,
    /// Haystack tokens of the file to skip (keep evaluated text out).
    #[arg(long = "skip-tokens", default_value_t = 0)]
    pub skip_tokens: usize,
    /// Needle tests (needle depths evenly spread).
    #[arg(long = "trials", default_value_t = 10)]
    pub trials: usize,
    /// Seed of the needles' random words.
    #[arg(long = "seed", default_value_t = 1)]
    pub seed: u64,
    /// Write the scores here (default: <model stem>.headkv.json next to the model).
    #[arg(short = 'o', long = "out")]
    pub out: Option<PathBuf>,
}

/// Words the needles are drawn from.
const WORDS: &[&str] = &[
    "amber", "falcon", "copper", "meadow", "violet", "harbor", "lantern", "pepper", "glacier",
    "orchid", "tunnel", "marble", "cactus", "saddle", "walnut", "thunder", "velvet", "anchor",
    "pebble", "comet", "ginger", "quartz", "willow", "beacon",
];

/// Keeps the query rows (no eviction, no other signal).
struct Queries(usize);

impl StepObserver for Queries {
    fn needs(&self) -> Needs {
        Needs::queries(self.0)
    }
    fn on_step(&mut self, _step: &Step<'_>) {}
}

/// `kvrun calibrate headkv`.
pub fn run(a: &HeadkvArgs) -> Result<()> {
    let path = resolve_model(&a.model.model)?;
    let n_threads = resolve_threads(a.model.threads)?;
    if a.trials == 0 || a.context < 64 {
        return Err(Error::arg(
            "--trials/--context",
            "need at least 1 trial and a context of at least 64 tokens",
        ));
    }
    let text = std::fs::read_to_string(&a.file).map_err(|source| Error::Io {
        path: a.file.clone(),
        source,
    })?;
    let model = load_model(&a.model)?;
    let (w, tok) = (model.weights(), &model.tokenizer);
    let c = &w.config;
    let all = tok.encode(&text, false, false)?;
    let hay = &all[a.skip_tokens.min(all.len())..];
    if hay.len() < a.context {
        return Err(Error::arg(
            "-f/--file",
            format!("{} tokens, --context needs {}", hay.len(), a.context),
        ));
    }
    let mut rng = Rng::new(a.seed);
    let mut hits = vec![0u64; c.n_layers * c.n_heads];
    let mut rows = 0usize;
    for t in 0..a.trials {
        let words: Vec<&str> = (0..8)
            .map(|_| WORDS[(rng.next_u64() % WORDS.len() as u64) as usize])
            .collect();
        let needle = tok.encode(
            &format!(" The secret code of the archive is {}.", words.join(" ")),
            false,
            false,
        )?;
        let question = tok.encode(
            "\nQuestion: what is the secret code of the archive?\nAnswer:",
            false,
            false,
        )?;
        // a different stretch of the text per trial
        let start = (t * a.context) % (hay.len() - a.context + 1);
        let h = &hay[start..start + a.context];
        let depth = ((t as f64 + 0.5) / a.trials as f64 * a.context as f64) as usize;
        let mut ids = tok.encode("", true, false)?;
        ids.extend_from_slice(&h[..depth]);
        let n0 = ids.len();
        ids.extend_from_slice(&needle);
        let n1 = ids.len();
        ids.extend_from_slice(&h[depth..]);
        ids.extend_from_slice(&question);
        let a0 = ids.len();
        ids.extend_from_slice(&needle);
        let n = ids.len();
        // the copied tokens: the answer's, predicted from the row before each
        let mut s = Session::new(w, n, n_threads, 256);
        let mut obs = Queries(n - a0 + 1);
        let mut done = 0;
        while done < n {
            let k = 256.min(n - done);
            s.feed_observed(&ids[done..done + k], Logits::Last, &mut obs)?;
            done += k;
        }
        let qw = s
            .queries()
            .ok_or_else(|| Error::Other("no query rows were recorded".into()))?;
        let (hh, r) = retrieval_hits(&s.kv, qw, &ids, n0..n1, a0..n);
        for (x, y) in hits.iter_mut().zip(&hh) {
            *x += *y as u64;
        }
        rows += r;
        eprintln!(
            "kvrun: calibrate headkv: trial {t}: needle at {n0}..{n1} of {n}, {r} copied tokens"
        );
    }
    let group = c.n_heads / c.n_kv_heads;
    let scores: Vec<f32> = (0..c.n_layers * c.n_kv_heads)
        .map(|s| {
            let (l, g) = (s / c.n_kv_heads, s % c.n_kv_heads);
            let sum: u64 = (g * group..(g + 1) * group)
                .map(|h| hits[l * c.n_heads + h])
                .sum();
            sum as f32 / (rows.max(1) * group) as f32
        })
        .collect();
    let out = HeadScores {
        n_layers: c.n_layers,
        n_kv_heads: c.n_kv_heads,
        scores,
        procedure: format!(
            "kvrun calibrate headkv -m {} -f {} --skip-tokens {} --context {} --trials {} --seed {} (retrieval-head hit rate, mean over each GQA group)",
            path.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default(),
            a.file.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default(),
            a.skip_tokens,
            a.context,
            a.trials,
            a.seed
        ),
    };
    if out.check().is_err() {
        return Err(Error::Other(
            "no head ever retrieved the needle: try a longer --context or more --trials".into(),
        ));
    }
    let json = serde_json::to_string_pretty(&out).map_err(|e| Error::Other(e.to_string()))?;
    let dest = a.out.clone().unwrap_or_else(|| scores_path_for(&path));
    std::fs::write(&dest, format!("{json}\n")).map_err(|source| Error::Io {
        path: dest.clone(),
        source,
    })?;
    println!("layer  retrieval score per KV head");
    for l in 0..c.n_layers {
        let row: Vec<String> = (0..c.n_kv_heads)
            .map(|g| format!("{:.3}", out.scores[l * c.n_kv_heads + g]))
            .collect();
        println!("{l:5}  {}", row.join("  "));
    }
    println!("wrote {}", dest.display());
    Ok(())
}
