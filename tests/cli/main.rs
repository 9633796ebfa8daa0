//! The kvrun binary end to end: golden text, bad input, robustness (signals, sizes, chat), batch runs, shards (GNU parallel, Slurm) and grading, chat (template and REPL), the OpenAI-compatible server and its web chat, and the eviction viewer.
//!
//! One test binary per group: each binary links llama.cpp, so fewer binaries
//! build and link faster.

#[path = "../util/mod.rs"]
mod util;

mod bad_input;
mod batch;
mod chat;
mod chat_repl;
mod golden;
mod grade;
mod robust;
mod server;
mod shards;
mod viz;
mod webchat;
