//! Compute backends. The CPU backend is the reference for every kernel.

pub mod attn512;
pub mod cpu;
pub mod decode512;
pub mod pool;
pub mod qgemm;
