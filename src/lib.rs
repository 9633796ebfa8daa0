//! kvrun: a standalone LLM inference engine for long reasoning traces.
//!
//! It memory-maps GGUF weights, runs its own decode loop on the CPU over a KV
//! cache, and (in later layers of this crate) keeps that cache within a fixed
//! budget with pluggable eviction policies.
//!
//! Modules, bottom-up: [`tensor`] (types), [`load`] (GGUF / safetensors),
//! [`quant`] (scalar reference kernels), [`backend`] (CPU compute),
//! [`model`] (config, weights, the forward pass), [`tokenizer`], [`chat`],
//! [`sample`], [`signals`] (what a forward step hands to the eviction
//! scorers), [`policy`] (eviction), [`generate`] (the decode loop), [`server`] (`kvrun serve`), [`cli`].

#![warn(missing_debug_implementations, rust_2018_idioms, unreachable_pub)]
#![deny(unsafe_op_in_unsafe_fn)]
#![allow(clippy::too_many_arguments, clippy::needless_range_loop)]

pub mod backend;
pub mod batch;
pub mod bench;
pub mod calibrate;
pub mod chat;
pub mod chat_repl;
pub mod cli;
pub mod error;
pub mod eval;
pub mod generate;
pub mod grade;
pub mod kv;
pub mod load;
pub mod model;
pub mod passkey;
pub mod policy;
pub mod quant;
pub mod sample;
pub mod server;
pub mod signals;
pub mod sweep;
pub mod tensor;
pub mod tokenizer;

pub use error::{Error, Result};
