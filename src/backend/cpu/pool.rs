//! A tiny persistent thread pool for the forward pass.
//!
//! A decode step of a small model issues a few hundred short parallel ops;
//! spawning threads (or parking them on a condvar) per op would cost more than
//! the ops themselves. Workers therefore spin on an epoch counter for a short
//! while after each job (like ggml's threadpool) and only then sleep on a
//! condvar, so an idle server does not burn a core.
//!
//! `run(f)` calls `f(i)` once on every thread `i in 0..n_threads` (the caller
//! is thread 0) and returns when all calls have returned. A panic in any
//! call is caught where it happens; `run` still waits for every thread to
//! finish with `f` (which lives on the caller's stack) and then re-raises the
//! first panic on the calling thread, so neither a use-after-free nor a
//! caller spinning forever on a dead worker can happen.

use std::any::Any;
use std::cell::UnsafeCell;
use std::marker::PhantomData;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

/// Spins before a worker goes to sleep (~ a millisecond on a modern core).
const SPIN_LIMIT: u32 = 1 << 17;

type Job = *const (dyn Fn(usize) + Sync);

struct Shared {
    epoch: AtomicUsize,
    done: AtomicUsize,
    job: UnsafeCell<Option<Job>>,
    stop: AtomicBool,
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
    /// The first panic a worker caught during the current job.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

// SAFETY: `job` is written only by the owning thread while no worker reads it
// (before the epoch is published with Release and after all workers have
// reported done with Release/Acquire); workers read it only between those
// points. Everything else is atomics or std sync types.
unsafe impl Sync for Shared {}
// SAFETY: as above; the raw job pointer is only dereferenced during `run`.
unsafe impl Send for Shared {}

/// A fixed set of worker threads plus the calling thread.
pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    n_threads: usize,
}

impl std::fmt::Debug for ThreadPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ThreadPool({} threads)", self.n_threads)
    }
}

impl ThreadPool {
    /// A pool of `n_threads` threads in all (the caller counts as one).
    pub fn new(n_threads: usize) -> ThreadPool {
        let n_threads = n_threads.max(1);
        let shared = Arc::new(Shared {
            epoch: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            job: UnsafeCell::new(None),
            stop: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            panic: Mutex::new(None),
        });
        let workers = (1..n_threads)
            .map(|i| {
                let s = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("kvrun-worker-{i}"))
                    .spawn(move || worker(s, i))
                    .expect("failed to spawn a worker thread")
            })
            .collect();
        ThreadPool {
            shared,
            workers,
            n_threads,
        }
    }

    /// Number of threads, the caller included.
    pub fn n_threads(&self) -> usize {
        self.n_threads
    }

    /// Run `f(i)` on every thread `i` and wait for all of them. If any call
    /// panics, the panic is re-raised here once every thread is done with `f`.
    pub fn run<F: Fn(usize) + Sync>(&self, f: F) {
        if self.n_threads == 1 {
            f(0);
            return;
        }
        let s = &*self.shared;
        let dynf: &(dyn Fn(usize) + Sync) = &f;
        // SAFETY: erase the lifetime of `f` to store it; we do not return
        // until every worker has finished calling it (the `done` wait below),
        // and we clear the slot before returning, so no dangling use exists.
        let job: Job = unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), Job>(dynf) };
        // SAFETY: no worker reads `job` now: the previous epoch's workers are
        // all done (we waited), and the next epoch is not yet published.
        unsafe { *s.job.get() = Some(job) };
        s.done.store(0, Ordering::Relaxed);
        s.epoch.fetch_add(1, Ordering::Release);
        if s.sleepers.load(Ordering::Acquire) > 0 {
            let _g = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        // our own share: a panic here must not unwind past the wait below
        // while workers still call `f`
        let mine = catch_unwind(AssertUnwindSafe(|| f(0)));
        let n_workers = self.n_threads - 1;
        let mut spins = 0u32;
        while s.done.load(Ordering::Acquire) < n_workers {
            // Spin briefly; if a worker was descheduled (an oversubscribed
            // machine), give the core away instead of burning our slice.
            spins += 1;
            if spins < 2048 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        // SAFETY: all workers are done with this epoch's job.
        unsafe { *s.job.get() = None };
        let theirs = s.panic.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Err(p) = mine {
            resume_unwind(p);
        }
        if let Some(p) = theirs {
            resume_unwind(p);
        }
    }
}

fn worker(s: Arc<Shared>, index: usize) {
    let mut seen = 0usize;
    loop {
        // Wait for a new epoch: spin first, then sleep.
        let mut spins = 0u32;
        loop {
            if s.stop.load(Ordering::Acquire) {
                return;
            }
            let e = s.epoch.load(Ordering::Acquire);
            if e != seen {
                seen = e;
                break;
            }
            spins += 1;
            if spins < SPIN_LIMIT {
                if spins.is_multiple_of(1024) {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
            } else {
                // Idle: sleep until woken. The timeout only guards against a
                // missed wake-up; after it we sleep again without spinning,
                // so an idle chat or server costs no CPU.
                let g = s.lock.lock().unwrap_or_else(|e| e.into_inner());
                s.sleepers.fetch_add(1, Ordering::AcqRel);
                if s.epoch.load(Ordering::Acquire) == seen && !s.stop.load(Ordering::Acquire) {
                    let _ = s.wake.wait_timeout(g, std::time::Duration::from_millis(50));
                }
                s.sleepers.fetch_sub(1, Ordering::AcqRel);
            }
        }
        // SAFETY: the epoch was published after `job` was written (Release /
        // Acquire pair), and the owner waits for our `done` before clearing it.
        let job = unsafe { *s.job.get() };
        if let Some(job) = job {
            // SAFETY: the pointee outlives this call (see `run`).
            let f = unsafe { &*job };
            // a panic is handed to the caller (`run` re-raises it); the
            // worker reports done either way and stays alive
            if let Err(p) = catch_unwind(AssertUnwindSafe(|| f(index))) {
                let mut slot = s.panic.lock().unwrap_or_else(|e| e.into_inner());
                if slot.is_none() {
                    *slot = Some(p);
                }
            }
        }
        s.done.fetch_add(1, Ordering::Release);
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        {
            let _g = self.shared.lock.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

/// The `[start, end)` share of `n` items for thread `i` of `n_threads`.
#[inline]
pub fn split(n: usize, i: usize, n_threads: usize) -> (usize, usize) {
    let per = n.div_ceil(n_threads);
    let start = (i * per).min(n);
    (start, (start + per).min(n))
}

/// Work items `0..n` handed out one at a time to whichever thread asks
/// next (dynamic scheduling): on a shared or noisy machine a thread that
/// loses its core for a while simply takes fewer items, where a fixed
/// [`split`] would leave the others waiting for it at the end of the op.
/// Which thread computes an item never changes its arithmetic.
#[derive(Debug)]
pub struct Chunks {
    next: AtomicUsize,
    n: usize,
}

impl Chunks {
    /// Items `0..n`.
    pub fn new(n: usize) -> Chunks {
        Chunks {
            next: AtomicUsize::new(0),
            n,
        }
    }

    /// The next item nobody has taken, or `None` when all are taken.
    #[inline]
    pub fn next(&self) -> Option<usize> {
        let i = self.next.fetch_add(1, Ordering::Relaxed);
        (i < self.n).then_some(i)
    }
}

/// Items `0..n` first split into one contiguous run per thread (as
/// [`split`]), each run taken front to back by its owner; a thread whose
/// run is used up steals the back half of what is left of another's and
/// goes on with that as its own run. Each thread therefore streams long
/// runs of consecutive items (what a kernel prefetching the items ahead
/// needs), yet none waits at the end of the op for one that lost its core
/// for a while. Which thread computes an item never changes its arithmetic.
#[derive(Debug)]
pub struct Runs {
    /// Per thread, its run `[lo, hi)` packed as `lo << 32 | hi`, each on
    /// its own cache line so the owners' takes do not contend.
    runs: Vec<PaddedU64>,
}

#[derive(Debug)]
#[repr(align(64))]
struct PaddedU64(AtomicU64);

#[inline]
fn pack_run(lo: usize, hi: usize) -> u64 {
    ((lo as u64) << 32) | hi as u64
}

#[inline]
fn unpack_run(v: u64) -> (usize, usize) {
    ((v >> 32) as usize, (v & 0xffff_ffff) as usize)
}

impl Runs {
    /// Items `0..n` over `n_threads` threads.
    pub fn new(n: usize, n_threads: usize) -> Runs {
        assert!(n < 1 << 32, "Runs: {n} items do not fit a packed run");
        let n_threads = n_threads.max(1);
        Runs {
            runs: (0..n_threads)
                .map(|i| {
                    let (lo, hi) = split(n, i, n_threads);
                    PaddedU64(AtomicU64::new(pack_run(lo, hi)))
                })
                .collect(),
        }
    }

    /// The next item for thread `i`: the front of its own run, else the
    /// first item of the back half it steals from another thread's run;
    /// `None` once every run is empty.
    #[inline]
    pub fn next(&self, i: usize) -> Option<usize> {
        let own = &self.runs[i].0;
        let mut cur = own.load(Ordering::Relaxed);
        loop {
            let (lo, hi) = unpack_run(cur);
            if lo >= hi {
                break;
            }
            match own.compare_exchange_weak(
                cur,
                pack_run(lo + 1, hi),
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return Some(lo),
                Err(now) => cur = now,
            }
        }
        self.steal(i)
    }

    #[cold]
    fn steal(&self, i: usize) -> Option<usize> {
        let nt = self.runs.len();
        for k in 1..nt {
            let victim = &self.runs[(i + k) % nt].0;
            let mut cur = victim.load(Ordering::Relaxed);
            loop {
                let (lo, hi) = unpack_run(cur);
                if lo >= hi {
                    break;
                }
                let mid = hi - (hi - lo).div_ceil(2);
                match victim.compare_exchange_weak(
                    cur,
                    pack_run(lo, mid),
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                ) {
                    Ok(_) => {
                        // only this thread refills its own (empty) run;
                        // others never shrink an empty one
                        self.runs[i]
                            .0
                            .store(pack_run(mid + 1, hi), Ordering::Relaxed);
                        return Some(mid);
                    }
                    Err(now) => cur = now,
                }
            }
        }
        None
    }
}

/// A raw pointer to an output buffer that threads write disjoint parts of,
/// valid for the lifetime `'a` of the borrow it was made from.
#[derive(Debug)]
pub struct SharedMut<'a, T> {
    ptr: *mut T,
    len: usize,
    _borrow: PhantomData<&'a mut [T]>,
}

impl<T> Clone for SharedMut<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SharedMut<'_, T> {}

// SAFETY: SharedMut is only a carrier; every write goes through `write`/`slice`
// whose callers guarantee disjoint indices across threads.
unsafe impl<T: Send> Sync for SharedMut<'_, T> {}
// SAFETY: as above.
unsafe impl<T: Send> Send for SharedMut<'_, T> {}

impl<'a, T> SharedMut<'a, T> {
    /// Wrap a mutable slice for the duration of one parallel op (the
    /// slice stays mutably borrowed as long as the wrapper lives).
    pub fn new(s: &'a mut [T]) -> Self {
        SharedMut {
            ptr: s.as_mut_ptr(),
            len: s.len(),
            _borrow: PhantomData,
        }
    }
    /// Write element `i`.
    ///
    /// # Safety
    /// No other thread may access index `i` during the op.
    #[inline]
    pub unsafe fn write(&self, i: usize, v: T) {
        assert!(
            i < self.len,
            "SharedMut index {i} out of bounds {}",
            self.len
        );
        // SAFETY: in bounds (asserted); exclusivity is the caller's contract.
        unsafe { self.ptr.add(i).write(v) };
    }
    /// A mutable sub-slice `[start, start+n)`.
    ///
    /// # Safety
    /// The range must not be accessed by any other thread during the op.
    #[inline]
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice(&self, start: usize, n: usize) -> &'a mut [T] {
        assert!(start + n <= self.len, "SharedMut range out of bounds");
        // SAFETY: in bounds (asserted); exclusivity is the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(start), n) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// Every item is handed out exactly once across the threads, even when
    /// one thread is slow, and a slow thread takes fewer items.
    #[test]
    fn chunks_hand_out_every_item_once() {
        let pool = ThreadPool::new(3);
        let n = 500;
        let chunks = Chunks::new(n);
        let seen: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
        let per_thread: Vec<AtomicUsize> = (0..3).map(|_| AtomicUsize::new(0)).collect();
        pool.run(|i| {
            while let Some(c) = chunks.next() {
                seen[c].fetch_add(1, Ordering::SeqCst);
                per_thread[i].fetch_add(1, Ordering::SeqCst);
                if i == 0 {
                    std::thread::sleep(std::time::Duration::from_millis(2));
                }
            }
        });
        assert!(seen.iter().all(|s| s.load(Ordering::SeqCst) == 1));
        assert!(chunks.next().is_none());
        let slow = per_thread[0].load(Ordering::SeqCst);
        assert!(slow < n / 3, "the sleeping thread took {slow} of {n}");
    }

    /// Every item is computed exactly once, each thread works through
    /// long runs of consecutive items (few steals), and a slow thread's run
    /// is taken over by the others.
    #[test]
    fn runs_hand_out_every_item_once_and_steal_from_a_slow_thread() {
        for nt in [1, 2, 3] {
            let pool = ThreadPool::new(nt);
            let n = 301;
            let runs = Runs::new(n, nt);
            let seen: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            let order: Vec<Mutex<Vec<usize>>> = (0..nt).map(|_| Mutex::new(Vec::new())).collect();
            pool.run(|i| {
                while let Some(c) = runs.next(i) {
                    seen[c].fetch_add(1, Ordering::SeqCst);
                    order[i].lock().unwrap().push(c);
                    if i == 0 && nt > 1 {
                        std::thread::sleep(std::time::Duration::from_millis(2));
                    }
                }
            });
            assert!(
                seen.iter().all(|s| s.load(Ordering::SeqCst) == 1),
                "{nt} threads"
            );
            assert!(runs.next(0).is_none());
            for (i, o) in order.iter().enumerate() {
                let o = o.lock().unwrap();
                let segments = 1 + o.windows(2).filter(|w| w[1] != w[0] + 1).count();
                assert!(segments <= 24, "thread {i} of {nt}: {segments} runs");
            }
            if nt > 1 {
                let slow = order[0].lock().unwrap().len();
                assert!(
                    slow < n.div_ceil(nt) / 2,
                    "the sleeping thread took {slow} of {n}"
                );
            }
        }
    }

    /// A panic in the caller's share is re-raised only after the workers
    /// finished with the job (they still see valid data), and the pool
    /// keeps working.
    #[test]
    fn panic_on_the_calling_thread_waits_for_workers_then_propagates() {
        let pool = ThreadPool::new(2);
        let done = AtomicUsize::new(0);
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.run(|i| {
                if i == 0 {
                    panic!("thread 0 fails");
                }
                std::thread::sleep(std::time::Duration::from_millis(50));
                done.fetch_add(1, Ordering::SeqCst);
            })
        }));
        assert!(r.is_err(), "the panic reaches the caller");
        assert_eq!(done.load(Ordering::SeqCst), 1, "the worker finished first");
        let sum = AtomicUsize::new(0);
        pool.run(|i| {
            sum.fetch_add(i + 1, Ordering::SeqCst);
        });
        assert_eq!(sum.load(Ordering::SeqCst), 3, "the pool still runs jobs");
    }

    /// A panic on a worker does not leave the caller spinning: it is
    /// re-raised on the caller, and the worker stays alive for later jobs.
    #[test]
    fn panic_on_a_worker_is_raised_on_the_caller() {
        let pool = ThreadPool::new(2);
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.run(|i| {
                if i == 1 {
                    panic!("thread 1 fails");
                }
            })
        }));
        let msg = r
            .err()
            .and_then(|p| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default();
        assert_eq!(msg, "thread 1 fails");
        let sum = AtomicUsize::new(0);
        pool.run(|i| {
            sum.fetch_add(i + 1, Ordering::SeqCst);
        });
        assert_eq!(sum.load(Ordering::SeqCst), 3, "the worker survived");
    }
}
