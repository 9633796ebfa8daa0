//! `PolicyConfig`: the KV-policy settings of one session, free of any
//! front end. The CLI's flags (`cli::KvArgs`) and the server's request
//! fields both resolve to it; `build` checks it against the registry and
//! makes the policy. Errors name the setting by `Field`, which each front
//! end spells its own way (`--kv-budget` / `kv_budget`).

use super::critical::CriticalOptions;
use super::epikv::{self, Band, EpikvLayers, EpikvOptions};
use super::evict::Evictor;
use super::expected::{self, ExpectedAttention};
use super::gates::{self, Gates};
use super::headkv::{self, HeadScores};
use super::lagkv::{LagKv, Reference};
use super::rkv::RkvOptions;
use super::scissorhands::{self, Scissorhands};
use super::snapkv::SnapOptions;
use super::table::{lookup, PolicyDef, ScorerOptions};
use super::{KvPolicy, PromptCompress, PromptPhase};
use crate::error::{Error, Field, Msg, Result};
use crate::kv::{KvType, PosMode};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Everything that decides a session's KV cache and eviction.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyConfig {
    /// Registry name (`full` = no eviction).
    pub policy: String,
    /// Tokens kept per layer per KV head; required unless `full`.
    pub budget: Option<usize>,
    /// First positions never evicted.
    pub sinks: usize,
    /// Newest positions never evicted (default: the policy's).
    pub recent: Option<usize>,
    /// Never evict prompt tokens.
    pub keep_prompt: bool,
    /// Entries freed per stream at once when over budget (default: the policy's).
    pub evict_every: Option<usize>,
    /// Policy of the prompt phase, and its budget (default: budget / 2).
    pub prompt_policy: Option<String>,
    pub prompt_budget: Option<usize>,
    /// EPIKV representative layers A, B.
    pub epikv_layers: Option<(usize, usize)>,
    /// EPIKV bands for `epikv-band`.
    pub epikv_bands: Option<(Band, Band)>,
    /// EPIKV rolling window.
    pub epikv_window: Option<usize>,
    /// EPIKV per-model config file.
    pub epikv_config: Option<PathBuf>,
    /// EPIKV: score prompt tokens instead of keeping them.
    pub epikv_score_prompt: bool,
    /// Observation window (snapkv, adakv, pyramidkv).
    pub obs_window: Option<usize>,
    /// Average-pooling kernel over the votes.
    pub pool_kernel: Option<usize>,
    /// adakv: fraction of the per-head budget every head keeps.
    pub adakv_safeguard: Option<f32>,
    /// pyramidkv: ratio of the largest to the smallest layer term.
    pub pyramid_beta: Option<f32>,
    /// critical-*: stage-1 fraction α.
    pub critical_alpha: Option<f32>,
    /// critical-*: ε added to attention before weighting by the value norm.
    pub critical_eps: Option<f32>,
    /// trimkv/dbtrimkv: retention-gate file (default: next to the model).
    pub gates: Option<PathBuf>,
    /// dbtrimkv: entries each stream keeps whatever the global ranking says.
    pub min_per_head: Option<usize>,
    /// trimkv/dbtrimkv: queries the retention score sums over.
    pub trim_lookahead: Option<usize>,
    /// lagkv/lagkv-causal: partition length (default budget/8 in 16..=128).
    pub lag_size: Option<usize>,
    /// rkv: weight of importance against redundancy (default 0.1).
    pub rkv_lambda: Option<f32>,
    /// scissorhands: history window in steps (default 64).
    pub history_window: Option<usize>,
    /// headkv: per-head importance scores (default: next to the model).
    pub head_scores: Option<PathBuf>,
    /// Streaming prefill under the budget, or the whole prompt then one compression.
    pub prompt_compress: PromptCompress,
    /// KV storage type.
    pub cache_type: KvType,
    /// RoPE positions.
    pub pos_mode: PosMode,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        PolicyConfig {
            policy: "full".into(),
            budget: None,
            sinks: 4,
            recent: None,
            keep_prompt: false,
            evict_every: None,
            prompt_policy: None,
            prompt_budget: None,
            epikv_layers: None,
            epikv_bands: None,
            epikv_window: None,
            epikv_config: None,
            epikv_score_prompt: false,
            obs_window: None,
            pool_kernel: None,
            adakv_safeguard: None,
            pyramid_beta: None,
            critical_alpha: None,
            critical_eps: None,
            gates: None,
            min_per_head: None,
            trim_lookahead: None,
            lag_size: None,
            rkv_lambda: None,
            history_window: None,
            head_scores: None,
            prompt_compress: PromptCompress::Stream,
            cache_type: KvType::default(),
            pos_mode: PosMode::default(),
        }
    }
}

impl PolicyConfig {
    /// The registry row of `policy`.
    pub fn def(&self) -> Result<&'static PolicyDef> {
        lookup(&self.policy, Field::Policy)
    }

    /// The observation-window options, checked.
    pub fn snap_options(&self) -> Result<SnapOptions> {
        let d = SnapOptions::default();
        let o = SnapOptions {
            window: self.obs_window.unwrap_or(d.window),
            kernel: self.pool_kernel.unwrap_or(d.kernel),
            safeguard: self.adakv_safeguard.unwrap_or(d.safeguard),
            beta: self.pyramid_beta.unwrap_or(d.beta),
        };
        if o.window == 0 {
            return Err(Error::config(Field::ObsWindow, "must be at least 1"));
        }
        if o.kernel.is_multiple_of(2) {
            return Err(Error::config(
                Field::PoolKernel,
                format!("must be odd (1 = no pooling), got {}", o.kernel),
            ));
        }
        if !(0.0..=1.0).contains(&o.safeguard) {
            return Err(Error::config(
                Field::AdakvSafeguard,
                format!("must be in 0..1, got {}", o.safeguard),
            ));
        }
        if o.beta.is_nan() || o.beta < 1.0 {
            return Err(Error::config(
                Field::PyramidBeta,
                format!("must be at least 1, got {}", o.beta),
            ));
        }
        Ok(o)
    }

    /// The CriticalKV options, checked.
    pub fn critical_options(&self) -> Result<CriticalOptions> {
        let d = CriticalOptions::default();
        let o = CriticalOptions {
            alpha: self.critical_alpha.unwrap_or(d.alpha),
            eps: self.critical_eps.unwrap_or(d.eps),
        };
        o.check()?;
        Ok(o)
    }

    /// R-KV's options, checked: `--obs-window` and `--pool-kernel` when
    /// given (R-KV's own defaults, 8 and 7, otherwise), `--rkv-lambda`.
    pub fn rkv_options(&self) -> Result<RkvOptions> {
        let d = RkvOptions::default();
        let o = RkvOptions {
            window: self.obs_window.unwrap_or(d.window),
            kernel: self.pool_kernel.unwrap_or(d.kernel),
            lambda: self.rkv_lambda.unwrap_or(d.lambda),
        };
        o.check()?;
        Ok(o)
    }

    /// Build the policy (None for `full`) for `model` (whose directory may
    /// hold a calibrated `<stem>.epikv.json`), seeding seeded scorers with
    /// `seed`.
    pub fn build(&self, seed: u64, model: &Path) -> Result<Option<KvPolicy>> {
        let def = self.def()?;
        let pdef = self
            .prompt_policy
            .as_deref()
            .map(|p| lookup(p, Field::PromptPolicy))
            .transpose()?;
        if self.pos_mode == PosMode::Cache
            && (!def.caps.cache_positions || self.prompt_policy.is_some())
        {
            let ok: Vec<&str> = super::POLICIES
                .iter()
                .filter(|p| p.caps.cache_positions)
                .map(|p| p.name)
                .collect();
            let mut m = Msg::default()
                .t("cache (StreamingLLM in-cache positions) needs ")
                .f(Field::Policy)
                .t(format!(" {}, not {}", ok.join(" or "), self.policy));
            if self.prompt_policy.is_some() {
                m = m.t(" with ").f(Field::PromptPolicy);
            }
            return Err(Error::config(Field::PosMode, m));
        }
        let budget = match (def.budgeted(), self.budget) {
            (false, _) => None,
            (true, None) => {
                return Err(Error::config(
                    Field::Budget,
                    Msg::default()
                        .f(Field::Policy)
                        .t(format!(" {} needs ", self.policy))
                        .f(Field::Budget)
                        .t(" N"),
                ))
            }
            (true, Some(b)) => Some(b),
        };
        let Some(budget) = budget else {
            if self.prompt_policy.is_some() {
                return Err(Error::config(
                    Field::PromptPolicy,
                    Msg::default()
                        .t("needs a budgeted ")
                        .f(Field::Policy)
                        .t(" (not full)"),
                ));
            }
            return Ok(None);
        };
        let evict_every = match self.evict_every {
            Some(0) => return Err(Error::config(Field::EvictEvery, "must be at least 1")),
            Some(e) => e,
            None => def.default_evict_every(budget),
        };
        let snap = self.snap_options()?;
        let critical = self.critical_options()?;
        let once = self.prompt_compress == PromptCompress::Once;
        // (once with a prompt policy is refused where the session is built)
        if once && self.keep_prompt {
            return Err(Error::config(
                Field::PromptCompress,
                Msg::default()
                    .t("once compresses the prompt, which ")
                    .f(Field::KeepPrompt)
                    .t(" forbids"),
            ));
        }
        // an explicit config always; the one next to the model when a
        // policy of this session reads it
        let reads_config = def.caps.epikv_config || pdef.is_some_and(|p| p.caps.epikv_config);
        let config = match &self.epikv_config {
            Some(p) => Some(EpikvLayers::load(p)?),
            None => {
                let auto = epikv::config_path_for(model);
                if reads_config && auto.is_file() {
                    Some(EpikvLayers::load(&auto)?)
                } else {
                    None
                }
            }
        };
        // retention gates: `--gates` or the file next to the model, for a
        // policy that reads them (a prompt phase is token-uniform, so a
        // gated prompt policy is refused where the phase is built)
        let gates = if def.caps.gates {
            let path = self
                .gates
                .clone()
                .unwrap_or_else(|| gates::gates_path_for(model));
            if !path.is_file() {
                return Err(Error::config(
                    Field::Gates,
                    Msg::default()
                        .t(format!(
                            "{} reads learned retention gates: {} not found (give ",
                            def.name,
                            path.display()
                        ))
                        .f(Field::Gates)
                        .t(", or train them with `kvrun train gates`)"),
                ));
            }
            Some(Arc::new(Gates::load(&path)?))
        } else {
            if self.gates.is_some() {
                return Err(Error::config(
                    Field::Gates,
                    Msg::default().t(format!(
                        "only applies to trimkv and dbtrimkv, not {}",
                        self.policy
                    )),
                ));
            }
            None
        };
        if self.trim_lookahead == Some(0) {
            return Err(Error::config(Field::TrimLookahead, "must be at least 1"));
        }
        // head-importance scores: `--head-scores` or the file next to the
        // model, for a policy that reads them
        let head_scores = if def.caps.head_scores {
            let path = self
                .head_scores
                .clone()
                .unwrap_or_else(|| headkv::scores_path_for(model));
            if !path.is_file() {
                return Err(Error::config(
                    Field::HeadScores,
                    Msg::default()
                        .t(format!(
                            "{} reads per-head importance scores: {} not found (give ",
                            def.name,
                            path.display()
                        ))
                        .f(Field::HeadScores)
                        .t(", or compute them with `kvrun calibrate headkv`)"),
                ));
            }
            Some(Arc::new(HeadScores::load(&path)?))
        } else {
            if self.head_scores.is_some() {
                return Err(Error::config(
                    Field::HeadScores,
                    format!("only applies to headkv, not {}", self.policy),
                ));
            }
            None
        };
        let rkv = self.rkv_options()?;
        if let Some(h) = self.history_window {
            // the range is the scorer's; checked here for every policy so a
            // bad value is never silently ignored
            Scissorhands::new(h)?;
        }
        if let Some(l) = self.lag_size {
            LagKv::new(Reference::Prev, Some(l))?;
        }
        let ea_window = self.obs_window.unwrap_or(expected::DEFAULT_WINDOW);
        if def.name == "expected-attention" {
            ExpectedAttention::new(ea_window)?;
        }
        let n_recent = self
            .recent
            .unwrap_or_else(|| def.default_recent(budget, &snap, &rkv));
        let opts = ScorerOptions {
            seed,
            epikv: EpikvOptions {
                layers: self.epikv_layers,
                bands: self.epikv_bands,
                window: self.epikv_window,
                config,
                // a prompt compressed once is ranked like everything else
                score_prompt: self.epikv_score_prompt || once,
            },
            snap,
            critical,
            gates,
            min_per_head: self.min_per_head.unwrap_or(0),
            trim_lookahead: self.trim_lookahead.unwrap_or(1),
            lag_size: self.lag_size,
            rkv,
            history: self.history_window.unwrap_or(scissorhands::MAX_HISTORY),
            ea_window,
            head_scores,
        };
        let policy = def
            .build(&opts)?
            .ok_or_else(|| Error::config(Field::Policy, "full has no scorer"))?;
        // EPIKV as published keeps the whole prompt (decode budget = budget -
        // prompt), unless prompt tokens are scored or go to a prompt policy
        let keep_prompt = self.keep_prompt
            || (def.defaults.keep_prompt && !self.epikv_score_prompt && !once)
            || self.prompt_policy.is_some();
        let evictor = Evictor {
            budget,
            n_sink: self.sinks,
            n_recent,
            keep_prompt_until: if keep_prompt { usize::MAX } else { 0 },
            evict_every,
        };
        let mut kp = KvPolicy::new(policy, evictor.clone());
        kp.compress_once = once;
        if let Some(pdef) = pdef {
            let pb = self.prompt_budget.unwrap_or(budget / 2);
            let pp = pdef.build(&opts)?.ok_or_else(|| {
                Error::config(
                    Field::PromptPolicy,
                    Msg::default()
                        .t("full keeps the whole prompt: leave ")
                        .f(Field::PromptPolicy)
                        .t(" out (and use ")
                        .f(Field::KeepPrompt)
                        .t(")"),
                )
            })?;
            let pevictor = Evictor {
                budget: pb,
                n_recent: n_recent.min(pb / 4),
                keep_prompt_until: 0,
                ..evictor
            };
            kp.prompt = Some(PromptPhase::new(pp, pevictor)?);
        } else if self.prompt_budget.is_some() {
            return Err(Error::config(
                Field::PromptBudget,
                Msg::default()
                    .t("only applies with ")
                    .f(Field::PromptPolicy),
            ));
        }
        Ok(Some(kp))
    }
}
