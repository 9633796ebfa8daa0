//! Host memory: large buffers asked to be backed by transparent huge pages.
//!
//! On the Zen 4 VMs a plain summing loop read 44 GB/s with 2 threads from
//! 4 KiB pages and 65 GB/s from 2 MiB pages (one thread: 24–28 against
//! 33). Why was not measured; prefetchers that stop at page boundaries
//! and TLB walks are the usual suspects.
//!
//! Also the decoding kernels' software prefetch distance ([`Prefetch`]).

use std::sync::atomic::{AtomicUsize, Ordering};

/// How far ahead of its reads a decoding kernel that streams a repacked
/// matrix asks for the bytes on an Intel CPU (see [`prefetch_ahead`]).
///
/// Measured on a 2-core Xeon VM (Emerald Rapids, AVX-512 VNNI, 2 MiB L2
/// per core), synthetic R1-Distill-Qwen-7B Q4_K_M, tg32 at 2 threads,
/// prefetching into L2 from the Q4_K×8 and Q6_K×8 kernels: none 3.7–4.2
/// t/s, 2 KiB ahead 4.66, 4 KiB 5.07–5.21, 8 KiB 5.23, 16 KiB 5.10 (into
/// L1 instead: 4.8–5.1). With only the hardware prefetchers, a kernel
/// that computes between its loads read well below a plain streaming loop.
pub const INTEL_AHEAD: usize = 8192;

/// Where the decoding kernels' prefetch distance comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Prefetch {
    /// Chosen from the CPU ([`auto_ahead`]).
    Auto,
    /// This many bytes ahead (0: no software prefetch).
    Bytes(usize),
}

impl Prefetch {
    /// `auto`, `off` (= 0) or a distance in bytes (a multiple of 64, at
    /// most 1 MiB; `8k` / `8K` = 8192).
    pub fn parse(v: &str) -> std::result::Result<Prefetch, String> {
        let v = v.trim();
        match v {
            "auto" => return Ok(Prefetch::Auto),
            "off" | "0" => return Ok(Prefetch::Bytes(0)),
            _ => {}
        }
        let (num, mul) = match v.strip_suffix(['k', 'K']) {
            Some(n) => (n, 1024),
            None => (v, 1),
        };
        let bytes = num
            .parse::<usize>()
            .ok()
            .and_then(|n| n.checked_mul(mul))
            .ok_or_else(|| format!("'{v}' is not auto, off or a distance in bytes (8192, 8k)"))?;
        if bytes % 64 != 0 || bytes > 1 << 20 {
            return Err(format!(
                "{bytes} bytes: the distance is a multiple of 64 (a cache line), at most 1 MiB"
            ));
        }
        Ok(Prefetch::Bytes(bytes))
    }

    /// The distance in bytes this setting gives on this CPU.
    pub fn bytes(self) -> usize {
        match self {
            Prefetch::Auto => auto_ahead(),
            Prefetch::Bytes(b) => b,
        }
    }

    /// How it prints: `off`, the bytes, or `auto (…)` with what auto chose.
    pub fn label(self) -> String {
        let bytes = |b: usize| match b {
            0 => "off".to_string(),
            b => b.to_string(),
        };
        match self {
            Prefetch::Auto => format!("auto ({})", bytes(auto_ahead())),
            Prefetch::Bytes(b) => bytes(b),
        }
    }
}

/// The distance for a CPU of this vendor (CPUID leaf 0's 12-byte string):
/// [`INTEL_AHEAD`] on Intel, none elsewhere. On the Zen 4 VMs no software
/// prefetch tried beat the hardware prefetchers on these layouts: there
/// the Xeon's 8 KiB decoded the 7B at 7.0–9.5 t/s against 7.5–11.8 with
/// none, and the 1.5B Q8_0 at 17–23 against 21–33 (2026-12-07, four
/// rounds in turn, a VM whose probe swung between 36 and 68 GB/s).
pub fn ahead_for_vendor(vendor: &[u8; 12]) -> usize {
    match vendor {
        b"GenuineIntel" => INTEL_AHEAD,
        _ => 0,
    }
}

/// [`ahead_for_vendor`] of this CPU (0 off x86).
pub fn auto_ahead() -> usize {
    #[cfg(target_arch = "x86_64")]
    {
        let l0 = std::arch::x86_64::__cpuid(0);
        let mut v = [0u8; 12];
        v[..4].copy_from_slice(&l0.ebx.to_le_bytes());
        v[4..8].copy_from_slice(&l0.edx.to_le_bytes());
        v[8..].copy_from_slice(&l0.ecx.to_le_bytes());
        ahead_for_vendor(&v)
    }
    #[cfg(not(target_arch = "x86_64"))]
    0
}

/// The distance in use; `usize::MAX` until it is first read or set.
static AHEAD: AtomicUsize = AtomicUsize::new(usize::MAX);

/// Set the decoding kernels' prefetch distance for the whole process (it
/// changes no result, only how fast the weights arrive).
pub fn set_prefetch(p: Prefetch) {
    AHEAD.store(p.bytes(), Ordering::Relaxed);
}

/// The decoding kernels' prefetch distance in bytes (0: none): what
/// [`set_prefetch`] last set, else [`auto_ahead`].
#[inline(always)]
pub fn ahead() -> usize {
    match AHEAD.load(Ordering::Relaxed) {
        usize::MAX => first_ahead(),
        a => a,
    }
}

/// The first read of [`ahead`]: auto, unless a [`set_prefetch`] got there
/// in between (out of line, so the kernels inline only the load).
#[cold]
#[inline(never)]
fn first_ahead() -> usize {
    let auto = auto_ahead();
    AHEAD
        .compare_exchange(usize::MAX, auto, Ordering::Relaxed, Ordering::Relaxed)
        .map_or_else(|set| set, |_| auto)
}

/// Ask for the cache lines of `[p + ahead(), p + ahead() + len)` to be
/// brought into L2: a kernel reading a matrix front to back calls it once
/// for each `len`-byte piece `p` it reads, so the lines [`ahead`] bytes on
/// are on their way (consecutive pieces cover every line; past the end of
/// the matrix the hint reads nothing the program sees). With a distance of
/// 0 it does nothing (the hardware prefetchers alone).
#[inline(always)]
pub fn prefetch_ahead(p: *const u8, len: usize) {
    let ahead = ahead();
    if ahead != 0 {
        prefetch_at(p, len, ahead);
    }
}

/// Ask for the cache lines of `[p + ahead, p + ahead + len)` into L2.
#[inline(always)]
pub fn prefetch_at(p: *const u8, len: usize, ahead: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
        let mut o = 0;
        while o < len {
            // SAFETY: a prefetch (SSE, on every x86_64) never faults and
            // changes nothing the program sees; wrapping_add forms the
            // address without claiming it lies inside p's allocation.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(ahead + o).cast()) };
            o += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, len, ahead);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefetch_settings_parse_and_print() {
        assert_eq!(Prefetch::parse("auto"), Ok(Prefetch::Auto));
        assert_eq!(Prefetch::parse("off"), Ok(Prefetch::Bytes(0)));
        assert_eq!(Prefetch::parse("0"), Ok(Prefetch::Bytes(0)));
        assert_eq!(Prefetch::parse(" 8k"), Ok(Prefetch::Bytes(8192)));
        assert_eq!(Prefetch::parse("4K"), Ok(Prefetch::Bytes(4096)));
        assert_eq!(Prefetch::parse("192"), Ok(Prefetch::Bytes(192)));
        for bad in [
            "",
            "soon",
            "100",
            "-64",
            "2048k",
            "99999999999999999999k",
            "k",
        ] {
            assert!(Prefetch::parse(bad).is_err(), "{bad:?}");
        }
        assert_eq!(Prefetch::Bytes(0).label(), "off");
        assert_eq!(Prefetch::Bytes(8192).label(), "8192");
        assert!(Prefetch::Auto.label().starts_with("auto ("));
        assert_eq!(Prefetch::Bytes(4096).bytes(), 4096);
    }

    #[test]
    fn the_distance_is_chosen_by_vendor() {
        assert_eq!(ahead_for_vendor(b"GenuineIntel"), INTEL_AHEAD);
        assert_eq!(ahead_for_vendor(b"AuthenticAMD"), 0);
        assert_eq!(ahead_for_vendor(b"HygonGenuine"), 0);
    }
}
