//! Flag groups shared by several commands and their resolution: model
//! selection ([`ModelArgs`], the default model path, threads), the KV cache
//! budget and eviction policy ([`KvArgs`]), sampling ([`SamplingArgs`]) and
//! the one-shot generation flags ([`RunArgs`], which `kvrun chat` reuses),
//! plus the checks on them (llama.cpp's multi-letter flags, files named by
//! flags, the context size).

use crate::error::{Error, Result};
use crate::generate::Session;
use crate::sample::SamplerConfig;
use clap::Args;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// File name of the default model (fetched by models/fetch.sh).
pub const DEFAULT_MODEL: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// The host loader of one `--mmap` setting (`mapped`: on) for `device`:
/// a GPU always reads the map, since it uploads the weights and never
/// decodes from the host's copy.
pub fn loader_for(
    mapped: bool,
    repack: crate::backend::cpu::Repack,
    device: crate::backend::Device,
) -> crate::backend::HostLoader {
    use crate::backend::cpu::WeightPages;
    let pages = if mapped || device != crate::backend::Device::Cpu {
        WeightPages::Mapped
    } else {
        WeightPages::Huge
    };
    crate::backend::cpu::Loader { pages, repack }
}

/// Model selection shared by every command.
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// Model: a GGUF file, a Hugging Face directory, or
    /// synth:HEADER.gguf[:ARCH][:SHAPE][:TYPE] (random weights in that
    /// header's shapes and types, or a named architecture / shape /
    /// quantization mix, generated in memory; see `kvrun synth`). Default: models/SmolLM2-135M-Instruct.Q4_1.gguf.
    #[arg(short = 'm', long = "model", env = "KVRUN_MODEL")]
    pub model: Option<PathBuf>,
    /// Threads (default: all cores).
    #[arg(short = 't', long = "threads")]
    pub threads: Option<i64>,
    /// Compute device: cpu, cuda or cuda:N (the one-shot command and bench;
    /// CUDA needs a build that found nvcc and an NVIDIA driver).
    #[arg(long = "device", default_value = "cpu")]
    pub device: String,
    /// Thinking for chat templates with a switch (Qwen3's
    /// `enable_thinking`): on, off (the template opens an empty think
    /// block, so the model answers directly) or auto (the template's
    /// default). A server request may override it with
    /// `chat_template_kwargs: {"enable_thinking": false}`.
    #[arg(long = "reasoning", default_value = "auto", value_parser = ["on", "off", "auto"])]
    pub reasoning: String,
    /// Chat template instead of the model's own: a built-in name (chatml,
    /// gemma) or Jinja source. A model without a template of its own
    /// (a base model) otherwise runs prompts as plain text.
    #[arg(long = "chat-template", conflicts_with = "chat_template_file")]
    pub chat_template: Option<String>,
    /// Read the chat template (Jinja source) from a file.
    #[arg(long = "chat-template-file")]
    pub chat_template_file: Option<PathBuf>,
    /// Where the CPU reads the weight matrices it does not repack: on (as
    /// llama.cpp) in place from the file's memory map, so loading is quick
    /// and the pages are the page cache's, shared with other processes
    /// mapping the file; off copies them at load into 2 MiB pages, which
    /// decoding streams a little faster (0-4% measured, for about 0.7 s of
    /// load per GB). `kvrun bench` takes a list (--mmap 0,1) and measures
    /// each in turn. A GPU run reads the map to upload it.
    #[arg(long = "mmap", default_value = "on", value_name = "on|off")]
    pub mmap: String,
    /// Which weight matrices the CPU rearranges at load for its decoding
    /// kernels (as llama.cpp's --no-repack turns off): on (every type with
    /// a repacked layout, 8 rows at a time: Q4_K, Q5_K, Q6_K, Q3_K, Q2_K,
    /// Q4_0, Q5_0, Q4_1, IQ4_NL and IQ4_XS from AVX2 up, Q8_0 from
    /// AVX-512 VNNI up),
    /// off (all read as the file stores them; quicker to load, slower to
    /// decode), or the types joined with + (Q4_K+Q6_K). Results are the
    /// same bit for bit. `kvrun bench` takes a list (--repack on,off).
    #[arg(long = "repack", default_value = "on", value_name = "on|off|TYPES")]
    pub repack: String,
    /// How far ahead of its reads the CPU's decoding kernels ask for the
    /// repacked weights (a software prefetch into L2): auto (8 KiB on
    /// Intel, where it decoded a 7B 30% faster; none elsewhere: on AMD Zen 4
    /// the hardware prefetchers alone were faster), off, or a distance in
    /// bytes (4096, 8k). Results are the same bit for bit. `kvrun bench`
    /// takes a list (--prefetch off,8k) and measures the settings in turn.
    #[arg(
        long = "prefetch",
        default_value = "auto",
        value_name = "auto|off|BYTES"
    )]
    pub prefetch: String,
}

impl ModelArgs {
    /// `--mmap` as a list of settings (true: read in place from the map).
    pub fn mmap_list(&self) -> Result<Vec<bool>> {
        self.mmap
            .split(',')
            .map(|v| match v.trim() {
                "on" | "1" | "true" => Ok(true),
                "off" | "0" | "false" => Ok(false),
                o => Err(Error::arg(
                    "--mmap",
                    format!("'{o}' is not on, off, 1 or 0"),
                )),
            })
            .collect()
    }

    /// `--repack` as a list of settings.
    pub fn repack_list(&self) -> Result<Vec<crate::backend::cpu::Repack>> {
        self.repack
            .split(',')
            .map(|v| crate::backend::cpu::Repack::parse(v).map_err(|e| Error::arg("--repack", e)))
            .collect()
    }

    /// `--prefetch` as a list of settings.
    pub fn prefetch_list(&self) -> Result<Vec<crate::backend::cpu::mem::Prefetch>> {
        self.prefetch
            .split(',')
            .map(|v| {
                crate::backend::cpu::mem::Prefetch::parse(v)
                    .map_err(|e| Error::arg("--prefetch", e))
            })
            .collect()
    }

    /// How the host takes the weights for `device`: `--mmap` and
    /// `--repack` (one setting each; see [`loader_for`]). Also sets the
    /// process's `--prefetch` distance (one setting).
    pub fn loader(&self, device: crate::backend::Device) -> Result<crate::backend::HostLoader> {
        let one = |flag: &str, n: usize| {
            Error::arg(
                flag,
                format!("takes one setting here, not {n} (a list is for `kvrun bench`)"),
            )
        };
        let (mmaps, repacks) = (self.mmap_list()?, self.repack_list()?);
        let [mapped] = mmaps[..] else {
            return Err(one("--mmap", mmaps.len()));
        };
        let [repack] = repacks[..] else {
            return Err(one("--repack", repacks.len()));
        };
        let prefetches = self.prefetch_list()?;
        let [prefetch] = prefetches[..] else {
            return Err(one("--prefetch", prefetches.len()));
        };
        crate::backend::cpu::mem::set_prefetch(prefetch);
        Ok(loader_for(mapped, repack, device))
    }

    /// `--reasoning` as a template's `enable_thinking`.
    pub fn enable_thinking(&self) -> Option<bool> {
        match self.reasoning.as_str() {
            "on" => Some(true),
            "off" => Some(false),
            _ => None,
        }
    }

    /// The chat template (`--chat-template[-file]`, else the model's own)
    /// with `--reasoning` applied.
    pub fn chat_template(
        &self,
        m: &crate::load::Loaded,
    ) -> Result<Option<crate::chat::ChatTemplate>> {
        use crate::chat::ChatTemplate;
        let t = match (&self.chat_template, &self.chat_template_file) {
            (Some(a), _) => Some(
                ChatTemplate::from_arg(a, &m.tokenizer)
                    .map_err(|e| Error::arg("--chat-template", e.to_string()))?,
            ),
            (None, Some(f)) => {
                let src = read_text(f, "--chat-template-file")?;
                Some(
                    ChatTemplate::for_tokenizer(&src, &m.tokenizer).map_err(|e| {
                        Error::arg("--chat-template-file", format!("{}: {e}", f.display()))
                    })?,
                )
            }
            (None, None) => m.chat_template()?,
        };
        Ok(t.map(|mut t| {
            t.enable_thinking = self.enable_thinking();
            t
        }))
    }
}

/// KV-cache budget and eviction flags, shared by every command that decodes.
#[derive(Args, Debug, Clone, Default)]
pub struct KvArgs {
    /// Eviction policy (see the list below; `full` = no eviction).
    #[arg(long = "policy", default_value = "full")]
    pub policy: String,
    /// Tokens kept in the KV cache (per layer per KV head); required unless --policy full.
    #[arg(long = "kv-budget")]
    pub kv_budget: Option<usize>,
    /// First positions never evicted (attention sinks).
    #[arg(long = "kv-sink", default_value_t = 4)]
    pub kv_sink: usize,
    /// Newest positions never evicted (default: min(128, budget/4); the
    /// observation window for snapkv/adakv/pyramidkv).
    #[arg(long = "kv-recent")]
    pub kv_recent: Option<usize>,
    /// Never evict prompt tokens.
    #[arg(long = "keep-prompt")]
    pub keep_prompt: bool,
    /// Evict in batches: free this many slots at a time once over budget
    /// (default 1; snapkv/adakv/pyramidkv: budget/8, at most 128).
    #[arg(long = "evict-every")]
    pub evict_every: Option<usize>,
    /// Policy for the prompt phase (the prompt is trimmed to --prompt-budget
    /// with it, the survivors are kept, then --policy takes over).
    #[arg(long = "prompt-policy")]
    pub prompt_policy: Option<String>,
    /// Tokens the prompt may keep with --prompt-policy (default: budget/2).
    #[arg(long = "prompt-budget")]
    pub prompt_budget: Option<usize>,
    /// EPIKV representative layers A,B (0-based; default: scaled from 10,21 of 32 layers).
    #[arg(long = "epikv-layers", value_name = "A,B")]
    pub epikv_layers: Option<String>,
    /// EPIKV bands a0-a1,b0-b1 for epikv-band (default: scaled from 7-13,18-25 of 32).
    #[arg(long = "epikv-bands", value_name = "A0-A1,B0-B1")]
    pub epikv_bands: Option<String>,
    /// EPIKV rolling window W.
    #[arg(long = "epikv-window", value_name = "W")]
    pub epikv_window: Option<usize>,
    /// EPIKV per-model JSON config (default: <model stem>.epikv.json next to the model, if present).
    #[arg(long = "epikv-config", value_name = "FILE")]
    pub epikv_config: Option<PathBuf>,
    /// EPIKV: score prompt tokens from the prefill's hidden states instead of keeping them all.
    #[arg(long = "epikv-score-prompt")]
    pub epikv_score_prompt: bool,
    /// snapkv/adakv/pyramidkv: query rows that vote (observation window; default 32).
    #[arg(long = "obs-window", value_name = "W")]
    pub obs_window: Option<usize>,
    /// snapkv/adakv/pyramidkv: average-pooling kernel over the votes (odd; 1 = none; default 5).
    #[arg(long = "pool-kernel", value_name = "K")]
    pub pool_kernel: Option<usize>,
    /// adakv: fraction of the per-head budget every head always keeps (default 0.2).
    #[arg(long = "adakv-safeguard", value_name = "F")]
    pub adakv_safeguard: Option<f32>,
    /// pyramidkv: ratio between the largest and smallest layer budgets' terms (default 20).
    #[arg(long = "pyramid-beta", value_name = "B")]
    pub pyramid_beta: Option<f32>,
    /// critical-*: fraction of each head's kept entries chosen by attention alone (stage 1; default 0.5).
    #[arg(long = "critical-alpha", value_name = "A")]
    pub critical_alpha: Option<f32>,
    /// critical-*: epsilon added to attention before weighting by the projected value norm (default 1e-4).
    #[arg(long = "critical-eps", value_name = "E")]
    pub critical_eps: Option<f32>,
    /// trimkv/dbtrimkv: retention-gate file (default: <model stem>.gates.safetensors next to the model; made by `kvrun train gates`).
    #[arg(long = "gates", value_name = "FILE")]
    pub gates: Option<PathBuf>,
    /// dbtrimkv: entries every (layer, KV head) keeps whatever the global ranking says (default 0).
    #[arg(long = "min-per-head", value_name = "N")]
    pub min_per_head: Option<usize>,
    /// trimkv/dbtrimkv: score by the retention summed over the next N queries (default 1).
    #[arg(long = "trim-lookahead", value_name = "N")]
    pub trim_lookahead: Option<usize>,
    /// lagkv/lagkv-causal: partition length (default: budget/8, clamped to 16..=128).
    #[arg(long = "lag-size", value_name = "N")]
    pub lag_size: Option<usize>,
    /// rkv: weight λ of attention importance against key redundancy (0..1; default 0.1).
    #[arg(long = "rkv-lambda", value_name = "L")]
    pub rkv_lambda: Option<f32>,
    /// scissorhands: steps of attention history counted (1..=64; default 64).
    #[arg(long = "history-window", value_name = "N")]
    pub history_window: Option<usize>,
    /// headkv: per-head importance scores (default: <model stem>.headkv.json next to the model; made by `kvrun calibrate headkv`).
    #[arg(long = "head-scores", value_name = "FILE")]
    pub head_scores: Option<PathBuf>,
    /// How a budgeted policy meets a prompt longer than its budget: stream
    /// (prefill in chunks, evicting between them; memory stays within the
    /// budget) or once (prefill the whole prompt, then compress it to the
    /// budget once with the policy's scores, as SnapKV/AdaKV/kvpress do;
    /// transient KV memory = the prompt).
    #[arg(
        long = "prompt-compress",
        value_name = "MODE",
        default_value = "stream"
    )]
    pub prompt_compress: String,
    /// KV cache storage type: f32, f16 or q8_0 (32-value blocks, 8.5 bits per value).
    #[arg(long = "cache-type", value_name = "TYPE", default_value = "f16")]
    pub cache_type: String,
    /// RoPE positions: absolute (position in the text) or cache (StreamingLLM's
    /// in-cache positions; needs --policy window).
    #[arg(long = "pos-mode", value_name = "MODE", default_value = "absolute")]
    pub pos_mode: String,
}

impl KvArgs {
    /// Refuse flag combinations that would silently do nothing: a budget
    /// with `--policy full` (which keeps every token; the budget would be
    /// reported but never applied). The server refuses the same in requests.
    pub fn check(&self) -> Result<()> {
        if self.policy == "full" {
            if let Some(b) = self.kv_budget {
                return Err(Error::arg(
                    "--kv-budget",
                    format!("--policy full keeps every token, so a budget of {b} would never apply; choose an eviction policy (e.g. --policy window) or drop --kv-budget"),
                ));
            }
        }
        Ok(())
    }

    /// The `--cache-type` value, checked.
    pub fn kv_type(&self) -> Result<crate::kv::KvType> {
        match self.cache_type.as_str() {
            "" => Ok(crate::kv::KvType::default()),
            t => crate::kv::KvType::parse(t),
        }
    }

    /// The `--pos-mode` value, checked.
    pub fn pos_mode(&self) -> Result<crate::kv::PosMode> {
        match self.pos_mode.as_str() {
            "" => Ok(crate::kv::PosMode::default()),
            m => crate::kv::PosMode::parse(m),
        }
    }

    /// The flags resolved into the clap-free policy configuration.
    pub fn config(&self) -> Result<crate::policy::PolicyConfig> {
        use crate::policy::epikv;
        Ok(crate::policy::PolicyConfig {
            policy: self.policy.clone(),
            budget: self.kv_budget,
            sinks: self.kv_sink,
            recent: self.kv_recent,
            keep_prompt: self.keep_prompt,
            evict_every: self.evict_every,
            prompt_policy: self.prompt_policy.clone(),
            prompt_budget: self.prompt_budget,
            epikv_layers: self
                .epikv_layers
                .as_deref()
                .map(epikv::parse_layers)
                .transpose()?,
            epikv_bands: self
                .epikv_bands
                .as_deref()
                .map(epikv::parse_bands)
                .transpose()?,
            epikv_window: self.epikv_window,
            epikv_config: self.epikv_config.clone(),
            epikv_score_prompt: self.epikv_score_prompt,
            obs_window: self.obs_window,
            pool_kernel: self.pool_kernel,
            adakv_safeguard: self.adakv_safeguard,
            pyramid_beta: self.pyramid_beta,
            critical_alpha: self.critical_alpha,
            critical_eps: self.critical_eps,
            gates: self.gates.clone(),
            min_per_head: self.min_per_head,
            trim_lookahead: self.trim_lookahead,
            lag_size: self.lag_size,
            rkv_lambda: self.rkv_lambda,
            history_window: self.history_window,
            head_scores: self.head_scores.clone(),
            prompt_compress: crate::policy::PromptCompress::parse(&self.prompt_compress)?,
            cache_type: self.kv_type()?,
            pos_mode: self.pos_mode()?,
        })
    }

    /// Apply the cache settings that hold with and without a policy
    /// (`--cache-type`, `--pos-mode`) to a fresh session.
    pub fn configure<B: crate::backend::Backend>(&self, s: &mut Session<'_, B>) -> Result<()> {
        s.configure(&self.config()?)
    }

    /// A session for one generation from an `n_prompt`-token prompt (see
    /// `Session::for_config`).
    pub fn session<'w>(
        &self,
        w: &'w crate::model::Weights<'w>,
        seed: u64,
        model: &Path,
        n_ctx: usize,
        n_threads: usize,
        n_batch: usize,
        n_prompt: usize,
    ) -> Result<Session<'w>> {
        Session::<crate::backend::Host>::for_config(
            w,
            &self.config()?,
            seed,
            model,
            n_ctx,
            n_threads,
            n_batch,
            n_prompt,
        )
    }

    /// Build the policy (None for `full`) for `model` (whose directory may
    /// hold a calibrated `<stem>.epikv.json`).
    pub fn build(&self, seed: u64, model: &Path) -> Result<Option<crate::generate::KvPolicy>> {
        self.config()?.build(seed, model)
    }
}

/// Sampling flags shared by one-shot runs, chat, batch and the server.
#[derive(Args, Debug, Clone)]
pub struct SamplingArgs {
    /// Temperature (0 = greedy; default 0.8, batch 0).
    #[arg(long = "temp", alias = "temperature")]
    pub temp: Option<f32>,
    /// Top-k (0 = off).
    #[arg(long = "top-k", default_value_t = 40)]
    pub top_k: usize,
    /// Top-p (1.0 = off).
    #[arg(long = "top-p", default_value_t = 0.95)]
    pub top_p: f32,
    /// Min-p (0.0 = off).
    #[arg(long = "min-p", default_value_t = 0.05)]
    pub min_p: f32,
    /// Repeat penalty (1.0 = off).
    #[arg(long = "repeat-penalty", default_value_t = 1.0)]
    pub repeat_penalty: f32,
    /// Tokens the repeat penalty looks back over.
    #[arg(long = "repeat-last-n", default_value_t = 64)]
    pub repeat_last_n: usize,
}

impl SamplingArgs {
    /// Reject values out of range (the library's check, the server's too).
    pub fn check(&self) -> Result<()> {
        self.config(0.0, 0).validate()
    }
    /// The sampler settings, with `default_temp` when --temp is absent.
    pub fn config(&self, default_temp: f32, seed: u64) -> SamplerConfig {
        SamplerConfig {
            temp: self.temp.unwrap_or(default_temp),
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            repeat_last_n: self.repeat_last_n,
            seed,
        }
    }
}

/// One-shot generation flags.
#[derive(Args, Debug, Clone)]
pub struct RunArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub kv: KvArgs,
    /// Prompt text.
    #[arg(short = 'p', long = "prompt")]
    pub prompt: Option<String>,
    /// Read the prompt from a file.
    #[arg(short = 'f', long = "file")]
    pub file: Option<PathBuf>,
    /// Tokens to predict (-1 = until end of generation).
    #[arg(short = 'n', long = "n-predict", alias = "predict", default_value_t = -1, allow_negative_numbers = true)]
    pub n_predict: i64,
    /// Context size in tokens (0 = the model's training context).
    #[arg(short = 'c', long = "ctx-size", default_value_t = 4096)]
    pub ctx_size: i64,
    /// Prompt processing chunk size.
    #[arg(short = 'b', long = "batch-size", default_value_t = 512)]
    pub batch_size: usize,
    /// RNG seed (-1 = random).
    #[arg(short = 's', long = "seed", default_value_t = -1, allow_negative_numbers = true)]
    pub seed: i64,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// System prompt (through the chat template).
    #[arg(long = "system-prompt")]
    pub system: Option<String>,
    /// Read the system prompt from a file.
    #[arg(long = "system-prompt-file")]
    pub system_file: Option<PathBuf>,
    /// Send the prompt as is, without the chat template.
    #[arg(long = "raw", alias = "no-conversation")]
    pub raw: bool,
    /// Keep generating past end-of-generation tokens.
    #[arg(long = "ignore-eos")]
    pub ignore_eos: bool,
    /// Do not print the timing lines.
    #[arg(long = "no-perf")]
    pub no_perf: bool,
    /// Echo the prompt before the generated text.
    #[arg(long = "display-prompt")]
    pub display_prompt: bool,
    /// Single turn (accepted for llama-cli compatibility; one-shot is the default).
    #[arg(long = "single-turn", hide = true)]
    pub single_turn: bool,
    /// GPU layers, as llama.cpp's -ngl: any N > 0 (or `all`) runs every
    /// layer on GPU 0 (`--device cuda`), 0 on the CPU.
    #[arg(long = "gpu-layers", hide = true)]
    pub gpu_layers: Option<String>,
}

/// Rewrite llama.cpp's multi-letter short flags to long ones clap understands.
/// Arguments stay OS strings: file names need not be UTF-8.
pub fn normalize_args<T: Into<OsString>>(args: impl IntoIterator<Item = T>) -> Vec<OsString> {
    args.into_iter()
        .map(|a| {
            let a: OsString = a.into();
            let m = match a.to_str() {
                Some("-sys") => "--system-prompt",
                Some("-sysf") => "--system-prompt-file",
                Some("-ngl") => "--gpu-layers",
                Some("-st") => "--single-turn",
                Some("-no-cnv") => "--raw",
                Some("-tb") => "--threads",
                Some("-np") => "--parallel",
                _ => return a,
            };
            m.into()
        })
        .collect()
}

/// Subcommands, and those whose first word may be a subcommand of their own.
const SUBCOMMANDS: &[&str] = &[
    "inspect",
    "bench",
    "chat",
    "eval",
    "batch",
    "calibrate",
    "serve",
    "synth",
    "train",
];
const NESTED: &[&str] = &["eval", "calibrate", "train", "batch"];

/// Move the model flags typed before a subcommand (`kvrun -m M -t 2 batch
/// ...`, as llama.cpp users write them) after it, where the subcommand's own
/// parser reads them. Only -m/--model, -t/--threads and --device move, and
/// only when nothing else comes before the subcommand.
pub fn hoist_global_flags(args: Vec<OsString>) -> Vec<OsString> {
    const GLOBAL: &[&str] = &["-m", "--model", "-t", "--threads", "--device"];
    let mut i = 1;
    while i < args.len() {
        let Some(a) = args[i].to_str() else { break };
        if GLOBAL.contains(&a) && i + 1 < args.len() {
            i += 2;
        } else if GLOBAL
            .iter()
            .any(|g| g.starts_with("--") && a.starts_with(&format!("{g}=")))
        {
            i += 1;
        } else {
            break;
        }
    }
    let sub = args.get(i).and_then(|a| a.to_str());
    let Some(sub) = sub.filter(|s| i > 1 && SUBCOMMANDS.contains(s)) else {
        return args;
    };
    // nested subcommand (`eval ppl`, `batch merge`): the flags go after it
    let mut at = i + 1;
    if NESTED.contains(&sub)
        && args
            .get(at)
            .and_then(|a| a.to_str())
            .is_some_and(|a| !a.starts_with('-'))
    {
        at += 1;
    }
    let mut out = Vec::with_capacity(args.len());
    out.push(args[0].clone());
    out.extend_from_slice(&args[i..at]);
    out.extend_from_slice(&args[1..i]);
    out.extend_from_slice(&args[at..]);
    out
}

/// The one-line message for a command line whose text value is not UTF-8
/// (file names may be anything; prompts and other values must be text):
/// names the flag it belongs to and the first bad byte.
pub fn non_utf8_message(args: &[OsString]) -> Option<String> {
    use std::os::unix::ffi::OsStrExt;
    let i = args.iter().position(|a| a.to_str().is_none())?;
    let bytes = args[i].as_bytes();
    let at = std::str::from_utf8(bytes)
        .err()
        .map_or(0, |e| e.valid_up_to());
    let whose = match i.checked_sub(1).and_then(|j| args[j].to_str()) {
        Some(flag) if flag.starts_with('-') && i > 1 => format!("{flag}: value"),
        _ => format!("argument {i}"),
    };
    Some(format!(
        "{whose} is not valid UTF-8 (byte {at}: 0x{:02x}); text must be UTF-8, file names may be anything",
        bytes.get(at).copied().unwrap_or(0)
    ))
}

/// Resolve the model path: -m, else the default model next to the working
/// directory, the executable, or the source tree.
pub fn resolve_model(m: &Option<PathBuf>) -> Result<PathBuf> {
    if let Some(p) = m {
        if let Some(name) = crate::format::synth::parse_name(p) {
            let (header, _) = name?;
            if !header.is_file() {
                return Err(Error::arg(
                    "-m/--model",
                    format!("{}: no such header file", header.display()),
                ));
            }
            return Ok(p.clone());
        }
        if !p.exists() {
            return Err(Error::arg(
                "-m/--model",
                format!("{}: no such file", p.display()),
            ));
        }
        return Ok(p.clone());
    }
    let mut cands = vec![Path::new("models").join(DEFAULT_MODEL)];
    if let Ok(exe) = std::env::current_exe() {
        for dir in exe.ancestors().skip(1).take(4) {
            cands.push(dir.join("models").join(DEFAULT_MODEL));
        }
    }
    cands.push(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("models")
            .join(DEFAULT_MODEL),
    );
    cands.into_iter().find(|p| p.exists()).ok_or_else(|| {
        Error::arg("-m/--model", format!("no model given and the default {DEFAULT_MODEL} is missing (run: bash models/fetch.sh)"))
    })
}

/// `-s`: a negative seed means a random one (from the clock).
pub fn resolve_seed(s: i64) -> u64 {
    if s < 0 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0)
    } else {
        s as u64
    }
}

/// Thread count from -t (default: available parallelism).
pub fn resolve_threads(t: Option<i64>) -> Result<usize> {
    match t {
        None | Some(-1) => Ok(std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)),
        Some(n) if (1..=1024).contains(&n) => Ok(n as usize),
        Some(n) => Err(Error::arg(
            "-t/--threads",
            format!("must be between 1 and 1024 (got {n})"),
        )),
    }
}

pub(crate) fn read_text(path: &Path, flag: &str) -> Result<String> {
    let bytes = std::fs::read(path).map_err(|source| Error::Io {
        path: path.to_owned(),
        source,
    })?;
    String::from_utf8(bytes).map_err(|e| {
        Error::arg(
            flag,
            format!(
                "{}: not valid UTF-8 (byte {})",
                path.display(),
                e.utf8_error().valid_up_to()
            ),
        )
    })
}
/// Fail cleanly when the KV cache and per-slot buffers of an `n_ctx` context
/// cannot be allocated (a huge -c would otherwise abort in the allocator).
pub(crate) fn check_ctx_alloc(
    c: &crate::model::Config,
    n_ctx: usize,
    n_threads: usize,
) -> Result<()> {
    check_ctx_alloc_for("-c/--ctx-size", c, n_ctx, n_threads)
}

/// [`check_ctx_alloc`] for a context that `flag` sets (its error names it).
pub(crate) fn check_ctx_alloc_for(
    flag: &str,
    c: &crate::model::Config,
    n_ctx: usize,
    n_threads: usize,
) -> Result<()> {
    let per_slot = (2 * c.n_cache_layers() * c.kv_dim() * 2).checked_add(4 * (n_threads + 1));
    let bytes = per_slot
        .and_then(|b| b.checked_mul(n_ctx))
        .filter(|&b| b <= isize::MAX as usize);
    if bytes.is_some_and(|b| Vec::<u8>::new().try_reserve_exact(b).is_ok()) {
        return Ok(());
    }
    let gib = per_slot.map_or(f64::INFINITY, |b| {
        b as f64 * n_ctx as f64 / (1u64 << 30) as f64
    });
    Err(Error::arg(
        flag,
        format!("a context of {n_ctx} tokens needs {gib:.1} GiB of KV cache, which cannot be allocated (the model was trained with {})", c.n_ctx_train),
    ))
}

/// Say on stderr what the context size does to the run: a context beyond
/// the model's training is allowed but warned about, and a KV budget larger
/// than the context is clamped to it (it could never evict) where `clamps`
/// (a policy that splits its budget unevenly keeps it as given).
pub(crate) fn context_notes(c: &crate::model::Config, n_ctx: usize, kv: &KvArgs, clamps: bool) {
    if n_ctx > c.n_ctx_train {
        eprintln!(
            "kvrun: warning: -c/--ctx-size {n_ctx} is beyond the model's trained context ({}); quality may degrade past it",
            c.n_ctx_train
        );
    }
    if let Some(b) = kv
        .kv_budget
        .filter(|&b| clamps && b > n_ctx && kv.policy != "full")
    {
        eprintln!(
            "kvrun: --kv-budget {b} is larger than the context (-c/--ctx-size {n_ctx}): clamped to {n_ctx}, so nothing is evicted"
        );
    }
}
