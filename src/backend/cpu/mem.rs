//! Host memory: large buffers asked to be backed by transparent huge pages.
//!
//! On the Zen 4 VMs a plain summing loop read 44 GB/s with 2 threads from
//! 4 KiB pages and 65 GB/s from 2 MiB pages (one thread: 24–28 against
//! 33). Why was not measured; prefetchers that stop at page boundaries
//! and TLB walks are the usual suspects.

/// How far ahead of its reads a decoding kernel that streams a repacked
/// matrix asks for the bytes (see [`prefetch_ahead`]).
///
/// Measured on a 2-core Xeon VM (Emerald Rapids, AVX-512 VNNI, 2 MiB L2
/// per core), synthetic R1-Distill-Qwen-7B Q4_K_M, tg32 at 2 threads,
/// prefetching into L2 from the Q4_K×8 and Q6_K×8 kernels: none 3.7–4.2
/// t/s, 2 KiB ahead 4.66, 4 KiB 5.07–5.21, 8 KiB 5.23, 16 KiB 5.10 (into
/// L1 instead: 4.8–5.1). With only the hardware prefetchers, a kernel
/// that computes between its loads read well below a plain streaming loop.
pub const AHEAD: usize = 8192;

/// Ask for the cache lines of `[p + AHEAD, p + AHEAD + len)` to be brought
/// into L2: a kernel reading a matrix front to back calls it once for each
/// `len`-byte piece `p` it reads, so the lines it reaches [`AHEAD`] bytes
/// on are on their way (consecutive pieces cover every line; past the end
/// of the matrix the hint reads nothing the program sees).
#[inline(always)]
pub fn prefetch_ahead(p: *const u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
        let mut o = 0;
        while o < len {
            // SAFETY: a prefetch (SSE, on every x86_64) never faults and
            // changes nothing the program sees; wrapping_add forms the
            // address without claiming it lies inside p's allocation.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(AHEAD + o).cast()) };
            o += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, len);
}

/// Ask for the whole 2 MiB pages of bytes `[addr, addr + len)` to be
/// transparent huge pages (a hint; where the kernel ignores it nothing
/// changes). It only matters before the pages are first touched: the
/// kernel picks the page size at the fault.
pub fn advise_huge(addr: usize, len: usize) {
    #[cfg(target_os = "linux")]
    {
        let page = 2usize << 20;
        let (lo, hi) = (addr.div_ceil(page) * page, (addr + len) / page * page);
        if hi > lo {
            // SAFETY: callers pass memory this process owns (a buffer or a
            // vector's capacity) and [lo, hi) lies inside it; MADV_HUGEPAGE
            // changes how the pages are backed, never their bytes.
            unsafe { libc::madvise(lo as *mut libc::c_void, hi - lo, libc::MADV_HUGEPAGE) };
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (addr, len);
}

/// An empty vector with room for `n` values, its pages asked to be huge
/// before anything is written to them.
pub fn huge_capacity<T>(n: usize) -> Vec<T> {
    let v: Vec<T> = Vec::with_capacity(n);
    advise_huge(v.as_ptr() as usize, n * std::mem::size_of::<T>());
    v
}
