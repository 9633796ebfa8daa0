//! Tokenizer built from GGUF metadata (in progress).
