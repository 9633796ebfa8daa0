//! Engine-level tests: kernels and their scalar references, quantization, KV metadata, module layering, tokenizer and logits parity with llama.cpp, cache types, position modes, safetensors loading, and the identity hashes.
//!
//! One test binary per group: each binary links llama.cpp, so fewer binaries
//! build and link faster.

#[path = "../util/mod.rs"]
mod util;

mod kernels;
mod quant;
mod kv_cells;
mod layers;
mod tokenizer;
mod parity;
mod cache_type;
mod pos_mode;
mod safetensors;
mod identity;
