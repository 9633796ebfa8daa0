//! Memory is part of correctness: attention never materializes an n×n
//! matrix, and with a budget the resident KV never exceeds it.
//!
//! A counting global allocator records the largest single allocation made
//! while tokens are fed (the session's fixed buffers are allocated before the
//! counter starts). Doubling the context must at most double it (O(n), not
//! O(n²)), it must stay far below n² floats, and with a budget it must not
//! grow with the context at all.

mod util;

use kvrun::generate::{KvPolicy, Session};
use kvrun::load::gguf::Gguf;
use kvrun::model::llama::Logits;
use kvrun::model::Weights;
use kvrun::policy::table::ScorerOptions;
use kvrun::policy::{find, Evictor};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

struct Counting;
static TRACK: AtomicBool = AtomicBool::new(false);
static MAX_ALLOC: AtomicUsize = AtomicUsize::new(0);
static SERIAL: Mutex<()> = Mutex::new(());

// SAFETY: forwards to the system allocator unchanged; only records sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        if TRACK.load(Ordering::Relaxed) {
            MAX_ALLOC.fetch_max(l.size(), Ordering::Relaxed);
        }
        // SAFETY: same layout contract as the caller's.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: p was allocated by System with l.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        if TRACK.load(Ordering::Relaxed) {
            MAX_ALLOC.fetch_max(n, Ordering::Relaxed);
        }
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(p, l, n) }
    }
}

#[global_allocator]
static A: Counting = Counting;

/// Largest allocation while feeding `n` tokens (chunks of 64) with `policy`.
fn max_alloc_feeding<'w>(
    w: &'w Weights<'w>,
    toks: &[u32],
    policy: Option<(&str, usize)>,
) -> (usize, usize) {
    let mut s = match policy {
        None => Session::new(w, toks.len(), 2, 64),
        Some((name, budget)) => {
            let p = find(name)
                .unwrap()
                .build(&ScorerOptions::default())
                .unwrap()
                .unwrap();
            let evictor = Evictor {
                budget,
                n_sink: 4,
                n_recent: 32,
                keep_prompt_until: 0,
                evict_every: 1,
            };
            Session::with_policy(w, toks.len(), 2, 64, KvPolicy::new(p, evictor)).unwrap()
        }
    };
    // warm the scratch buffers that grow to their steady size on first use
    s.feed(&toks[..64], Logits::Last).unwrap();
    MAX_ALLOC.store(0, Ordering::Relaxed);
    TRACK.store(true, Ordering::Relaxed);
    for c in toks[64..].chunks(64) {
        s.feed(c, Logits::Last).unwrap();
    }
    TRACK.store(false, Ordering::Relaxed);
    (MAX_ALLOC.load(Ordering::Relaxed), s.kv.peak_live)
}

#[test]
fn attention_memory_is_linear_in_context() {
    let _g = SERIAL.lock().unwrap();
    let path = util::default_model();
    let g = Gguf::open(&path).unwrap();
    let w = Weights::from_gguf(&g).unwrap();
    let toks: Vec<u32> = (0..1024u32).map(|i| 200 + (i * 7919) % 40000).collect();
    // h2o asks the attention pass for per-slot probabilities of every row:
    // the export path must stay O(n) as well.
    for policy in [None, Some(("h2o", 4096)), Some(("epikv", 4096))] {
        let (a1, _) = max_alloc_feeding(&w, &toks[..512], policy);
        let (a2, _) = max_alloc_feeding(&w, &toks, policy);
        let n = 1024usize;
        eprintln!(
            "{policy:?}: largest allocation while feeding: n=512 -> {a1} B, n=1024 -> {a2} B"
        );
        assert!(
            a2 <= a1 * 5 / 2,
            "allocations grew super-linearly: {a1} -> {a2}"
        );
        // An n×n f32 score matrix would be 4 MiB at n = 1024; the largest
        // legitimate buffers are (n, kv_dim) = (1024, 192) f32 copies of the
        // chunk's keys and values (768 KiB).
        assert!(
            a2 < n * n * 4 / 4,
            "an allocation of {a2} B is O(n^2)-sized for n = {n}"
        );
    }
}

#[test]
fn budgeted_memory_does_not_grow_with_context() {
    let _g = SERIAL.lock().unwrap();
    let path = util::default_model();
    let g = Gguf::open(&path).unwrap();
    let w = Weights::from_gguf(&g).unwrap();
    let toks: Vec<u32> = (0..1024u32).map(|i| 200 + (i * 7919) % 40000).collect();
    // snapkv: per-(layer, KV-head) streams scored from the query window
    // (its scratch is O(budget) per stream, never O(context))
    for name in ["h2o", "snapkv"] {
        let (a1, p1) = max_alloc_feeding(&w, &toks[..512], Some((name, 256)));
        let (a2, p2) = max_alloc_feeding(&w, &toks, Some((name, 256)));
        eprintln!("{name} budget 256: largest allocation n=512 -> {a1} B, n=1024 -> {a2} B; peak resident {p1}, {p2}");
        assert!(
            p1 <= 256 && p2 <= 256,
            "{name}: resident KV exceeded the budget"
        );
        assert!(
            a2 <= a1 + 4096,
            "{name}: allocations grew with context under a fixed budget: {a1} -> {a2}"
        );
    }
}
