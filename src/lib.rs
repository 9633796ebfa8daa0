//! kvrun: a standalone LLM inference engine for long reasoning traces.
//!
//! It memory-maps GGUF weights, runs its own decode loop on the CPU over a KV
//! cache, and keeps that cache within a fixed budget with pluggable eviction
//! policies.
//!
//! Modules, bottom-up (each imports only from those before it, except the
//! command layer on top, which nothing below imports):
//!
//! - [`error`], [`tensor`] (types), [`quant`] (scalar reference kernels),
//!   [`rng`] (the seeded generator), [`format`] (the GGUF container, the
//!   memory map, synthetic-weight models);
//! - [`kv`] (the ring-indexed KV cache), [`backend`] (CPU compute),
//!   [`model`] (config, weights, the forward pass), [`sample`],
//!   [`signals`] (what a forward step hands to the scorers), [`policy`]
//!   (eviction policies), [`tokenizer`], [`chat`] (templates,
//!   think-tag splitting, stop strings);
//! - [`load`] (a GGUF file or an HF directory → weights, tokenizer,
//!   template), [`generate`] (the decode loop), `train` (Cargo feature
//!   `train`: learning TRIM-KV / DBTrimKV retention gates with candle);
//! - [`cmd`]: the command line and one module per command (`run`,
//!   `inspect`, `bench`, `chat`, `eval`, `batch`, `calibrate`, `serve`,
//!   `train`).
//!
//! `tests/engine/layers.rs` checks this layering from the source.

#![warn(missing_debug_implementations, rust_2018_idioms, unreachable_pub)]
#![deny(unsafe_op_in_unsafe_fn)]
#![allow(clippy::too_many_arguments, clippy::needless_range_loop)]

pub mod backend;
pub mod chat;
pub mod cmd;
pub mod error;
pub mod format;
pub mod generate;
pub mod kv;
pub mod load;
pub mod model;
pub mod policy;
pub mod quant;
pub mod rng;
pub mod sample;
pub mod signals;
pub mod tensor;
pub mod tokenizer;
#[cfg(feature = "train")]
pub mod train;

pub use error::{Error, Result};
