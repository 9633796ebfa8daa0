//! Eviction policies: the registry, scorers, budget rules and wrappers, per-head streams, EPIKV, and the lockstep sweep.
//!
//! One test binary per group: each binary links llama.cpp, so fewer binaries
//! build and link faster.

#[path = "../util/mod.rs"]
mod util;

mod arch;
mod baselines;
mod critical;
mod epikv;
mod eviction_log;
mod policy;
mod streams;
mod sweep;
mod trimkv;
