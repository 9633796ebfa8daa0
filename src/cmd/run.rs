//! One-shot generation, the command without a subcommand (like
//! llama-completion): prompt from -p/-f, chat template unless --raw, tokens
//! streamed to stdout, timings and KV statistics on stderr.

use crate::backend::{Backend, Device};
use crate::cmd::args::{
    check_ctx_alloc, context_notes, read_text, resolve_model, resolve_seed, resolve_threads,
    RunArgs,
};
use crate::cmd::prompt::prompt_tokens;
use crate::cmd::{interrupt, load_model_any_device};
use crate::error::{Error, Result};
use crate::generate::{generate, GenOptions, Session};
use crate::sample::Sampler;
use std::io::Write;

/// One-shot generation (the default command).
pub fn run_generate(a: &RunArgs) -> Result<()> {
    let path = resolve_model(&a.model.model)?;
    let n_threads = resolve_threads(a.model.threads)?;
    if a.n_predict < -1 {
        return Err(Error::arg(
            "-n/--n-predict",
            format!("must be -1 (unlimited) or ≥ 0, got {}", a.n_predict),
        ));
    }
    if a.ctx_size < 0 {
        return Err(Error::arg(
            "-c/--ctx-size",
            format!("must be ≥ 0, got {}", a.ctx_size),
        ));
    }
    if a.batch_size == 0 {
        return Err(Error::arg("-b/--batch-size", "must be at least 1"));
    }
    a.sampling.check()?;
    a.kv.check()?;
    if a.raw && (a.system.is_some() || a.system_file.is_some()) {
        return Err(Error::arg(
            "-sys/--system-prompt",
            "a system prompt goes through the chat template, which --raw turns off (drop one of them)",
        ));
    }
    let prompt = match (&a.prompt, &a.file) {
        (Some(p), None) if p.trim().is_empty() => {
            return Err(Error::arg("-p/--prompt", "the prompt is empty"))
        }
        (Some(p), None) => p.clone(),
        (None, Some(f)) => {
            let text = read_text(f, "-f/--file")?;
            if text.trim().is_empty() {
                return Err(Error::arg(
                    "-f/--file",
                    format!("{}: the prompt file is empty", f.display()),
                ));
            }
            text
        }
        (Some(_), Some(_)) => {
            return Err(Error::arg(
                "-p/-f",
                "give either a prompt or a prompt file, not both",
            ))
        }
        (None, None) => {
            return Err(Error::arg(
                "-p/--prompt",
                "no prompt given (use -p TEXT or -f FILE)",
            ))
        }
    };
    let system = match (&a.system, &a.system_file) {
        (Some(s), _) => Some(s.clone()),
        (None, Some(f)) => Some(read_text(f, "-sysf/--system-prompt-file")?),
        _ => None,
    };
    // Ctrl-C from here on: while the model loads nothing is lost, so it
    // ends the process at once; from the prefill on it stops the run
    interrupt::install();
    interrupt::set_mode(interrupt::Mode::Idle);
    let t_load = std::time::Instant::now();
    let device = crate::cmd::resolve_device(&a.model, a.gpu_layers.as_deref())?;
    let m = load_model_any_device(&a.model, device)?;
    let (w, tok) = (m.weights(), &m.tokenizer);
    let tmpl = if a.raw {
        None
    } else {
        a.model.chat_template(&m)?
    };
    let load_ms = t_load.elapsed().as_secs_f64() * 1e3;
    let ids = prompt_tokens(tok, tmpl.as_ref(), &prompt, system.as_deref(), a.raw)?;
    let n_ctx = if a.ctx_size == 0 {
        w.config.n_ctx_train
    } else {
        a.ctx_size as usize
    };
    if ids.len() > n_ctx {
        return Err(Error::ContextTooSmall {
            n_prompt: ids.len(),
            n_ctx,
        });
    }
    check_ctx_alloc(&w.config, n_ctx, n_threads)?;
    let seed = resolve_seed(a.seed);
    let run = Tail {
        a,
        tok,
        ids: &ids,
        n_ctx,
        seed,
        no_template: tmpl.is_none() && !a.raw,
        load_ms,
    };
    match device {
        Device::Cpu => {
            let sess =
                a.kv.session(w, seed, &path, n_ctx, n_threads, a.batch_size, ids.len())?;
            run.generate(sess)?;
        }
        Device::Cuda(ordinal) => {
            let t = std::time::Instant::now();
            let b = crate::backend::cuda::Cuda::new(ordinal, n_threads)?;
            let wd = crate::cmd::device_weights(&b, &m, &a.kv)?;
            let cfg = a.kv.config()?;
            let sess = crate::generate::Session::for_config_on(
                b,
                &wd,
                &cfg,
                seed,
                &path,
                n_ctx,
                a.batch_size,
                ids.len(),
            )?;
            let run = Tail {
                load_ms: run.load_ms + t.elapsed().as_secs_f64() * 1e3,
                ..run
            };
            run.generate(sess)?;
        }
    }
    // Ctrl-C: the text and the timings are out, the exit status says so
    interrupt::check()
}

/// What the one-shot run does once its session is made, on any backend.
struct Tail<'r> {
    a: &'r RunArgs,
    tok: &'r crate::tokenizer::Tokenizer,
    ids: &'r [u32],
    n_ctx: usize,
    seed: u64,
    no_template: bool,
    load_ms: f64,
}

impl Tail<'_> {
    /// Notes, then generation streamed to stdout, then the timings.
    fn generate<B: Backend>(&self, mut sess: Session<'_, B>) -> Result<()> {
        let Tail {
            a,
            tok,
            ids,
            n_ctx,
            seed,
            no_template,
            load_ms,
        } = *self;
        let mut sampler = Sampler::new(a.sampling.config(0.8, seed));
        let clamps = sess
            .policy
            .as_ref()
            .is_some_and(|p| p.rule.caps_each_stream());
        context_notes(&sess.w.config, n_ctx, &a.kv, clamps);
        // (said once everything is checked, so an error stays one line)
        if no_template {
            eprintln!(
                "kvrun: the model has no chat template: the prompt is sent as plain text (--chat-template to choose one)"
            );
        }
        let stdout = std::io::stdout();
        let mut out = stdout.lock();
        if a.display_prompt {
            let _ = write!(out, "{}", tok.decode(ids, true));
        }
        let opts = GenOptions {
            n_predict: a.n_predict,
            ignore_eos: a.ignore_eos,
        };
        interrupt::set_mode(interrupt::Mode::Busy);
        // a long prompt: Ctrl-C stops between its chunks (-b)
        sess.stop_between_chunks(interrupt::requested);
        let stats = generate(&mut sess, tok, &mut sampler, ids, &opts, |piece| {
            // A closed pipe (e.g. `| head`) ends generation quietly, so does Ctrl-C.
            out.write_all(piece.as_bytes())
                .and_then(|_| out.flush())
                .is_ok()
                && !interrupt::requested()
        })?;
        let _ = writeln!(out);
        if stats.stop == crate::generate::StopReason::ContextFull {
            // (a policy does not lift the limit: one-shot positions end at
            // -c, the budget only bounds what the cache holds of them)
            eprintln!(
                "kvrun: stopped: the context is full ({n_ctx} tokens); raise -c/--ctx-size for longer output{}",
                if sess.policy.is_some() {
                    " (--kv-budget bounds the cache's memory, not the context)"
                } else {
                    ""
                }
            );
        }
        if !a.no_perf {
            eprintln!("kvrun: load time = {load_ms:10.2} ms");
            eprint!("{}", stats.timing_lines("kvrun"));
            eprintln!(
                "kvrun: kv: policy={} type={} budget={} evicted={} occupancy={} peak={} ({:.2} MiB peak){}",
                a.kv.policy,
                sess.kv.ty,
                sess.policy
                    .as_ref()
                    .map(|p| p.evictor.budget.to_string())
                    .unwrap_or_else(|| "none".into()),
                sess.n_evicted,
                sess.kv.resident_tokens(),
                sess.kv.peak_live,
                sess.kv.peak_bytes() as f64 / (1 << 20) as f64,
                match sess.kv.layout() {
                    crate::kv::Layout::Streams => format!(
                        " streams={} entries={} peak_entries={}",
                        sess.kv.n_streams(),
                        sess.kv.cells.n_live(),
                        sess.kv.peak_entries
                    ),
                    crate::kv::Layout::Uniform => String::new(),
                }
            );
        }
        Ok(())
    }
}
