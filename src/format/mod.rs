//! On-disk formats, below the model: the GGUF container ([`gguf`]: header,
//! metadata, tensor table, tensor views over the map) and the read-only
//! memory map both model formats use ([`mmap`]), and synthetic-weight
//! models: a real header with random tensor data ([`synth`]).
//!
//! Nothing here knows about models, tokenizers or templates; those read
//! GGUF metadata through this module, and [`crate::load`] puts them together.

pub mod gguf;
pub mod gguf_write;
pub mod mmap;
pub mod synth;
