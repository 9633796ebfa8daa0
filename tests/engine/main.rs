//! Engine-level tests: kernels and their scalar references, quantization, KV metadata, module layering, tokenizer and logits parity with llama.cpp, cache types, position modes, safetensors loading, synthetic-weight models, and the identity hashes.
//!
//! One test binary per group: each binary links llama.cpp, so fewer binaries
//! build and link faster.

#[path = "../util/mod.rs"]
mod util;

mod arch;
mod cache_type;
mod chunking;
mod identity;
mod kernels;
mod kv_cells;
mod layers;
mod parity;
mod pos_mode;
mod quant;
mod safetensors;
mod synth;
mod tokenizer;
