//! Model file loading: GGUF (memory-mapped) and Hugging Face safetensors directories.

pub mod gguf;
pub mod mmap;
pub mod safetensors;
