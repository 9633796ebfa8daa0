//! `kvrun eval`: fidelity evaluation of eviction policies.
//!
//! - [`ppl`]: teacher-forced perplexity / KL / top-1 agreement of one policy
//!   against the full cache.
//! - [`sweep`]: policies × KV budgets in one lockstep pass (CSV, JSON, SVG,
//!   markdown).
//! - [`passkey`]: pass-key retrieval at several depths of a long haystack.
//! - [`perturb`]: the output perturbation of one compression event, an
//!   attention-only selection vs its CriticalKV variant.
//! - [`fidelity`]: what `ppl` and `sweep` share (the lockstep evaluation,
//!   the fidelity metrics, the text input, the progress line).

pub mod fidelity;
pub mod passkey;
pub mod perturb;
pub mod ppl;
pub mod sweep;

use clap::Subcommand;

/// `kvrun eval ...`
#[derive(Subcommand, Debug)]
pub enum EvalCmd {
    /// Teacher-forced perplexity / KL / top-1 agreement of a policy vs the full cache.
    Ppl(ppl::PplArgs),
    /// Sweep policies × KV budgets: CSV, JSON, an SVG plot and a markdown table.
    Sweep(sweep::SweepArgs),
    /// Pass-key retrieval at several depths of a long haystack (filler or a reasoning trace).
    Passkey(passkey::PasskeyArgs),
    /// CriticalKV's perturbation analysis: how much one compression changes each head's projected output, base vs critical.
    Perturbation(perturb::PerturbArgs),
}
