//! Which of kvrun's own SIMD kernels this process runs.
//!
//! The level is read off the CPU once, at the first kernel choice, and can
//! be capped with the environment variable `KVRUN_CPU`
//! (`portable | avx2 | avx512 | avx512vnni | amx | native`, default
//! `native`):
//! `KVRUN_CPU=portable` runs every op on the portable loops and ggml's
//! kernels, so one machine can test (and compare) every path it is able to
//! run. Asking for more than the CPU has is an error ([`check_env`], called
//! by the binary at start-up); a library user who never calls it gets the
//! cap clamped to what the CPU has.
//!
//! ggml's own kernels (the `vec_dot`s) are compiled for the build machine
//! (`target-cpu=native`) and do not follow this setting.
//!
//! `KVRUN_AMX_EMULATE=1` runs the `amx` level on a CPU with AVX-512 VNNI
//! but no AMX, its tile instructions emulated in software (`amx_emu`; slow,
//! for tests), and on a CPU with AMX replaces the hardware tiles by the
//! emulated ones, so the two can be compared.

use crate::error::{Error, Result};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::OnceLock;

/// A level of x86 SIMD support, ordered: each includes the ones below it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    /// No kvrun SIMD kernel: portable Rust loops (and ggml's kernels).
    Portable,
    /// AVX2 + FMA.
    Avx2,
    /// AVX-512 F/BW/VL (the attention tiles).
    Avx512,
    /// AVX-512 with VNNI (the Q4_1 × Q8_1 matmul tile).
    Avx512Vnni,
    /// AVX-512 VNNI plus AMX-INT8 tiles, usable by this process (the
    /// K-quant prefill of `qgemm_amx`; every other kernel is VNNI's).
    Amx,
}

impl Level {
    /// Every level, lowest first.
    pub const ALL: [Level; 5] = [
        Level::Portable,
        Level::Avx2,
        Level::Avx512,
        Level::Avx512Vnni,
        Level::Amx,
    ];

    /// The name `KVRUN_CPU` takes.
    pub fn name(self) -> &'static str {
        match self {
            Level::Portable => "portable",
            Level::Avx2 => "avx2",
            Level::Avx512 => "avx512",
            Level::Avx512Vnni => "avx512vnni",
            Level::Amx => "amx",
        }
    }

    /// Whether this level has AVX-512 VNNI (`avx512vnni` and `amx`).
    pub fn vnni(self) -> bool {
        self >= Level::Avx512Vnni
    }

    fn parse(s: &str) -> Option<Option<Level>> {
        if s.is_empty() || s == "native" {
            return Some(None);
        }
        Level::ALL.iter().find(|l| l.name() == s).map(|&l| Some(l))
    }
}

impl std::fmt::Display for Level {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The levels this process can run, ignoring `KVRUN_CPU`: what the CPU
/// supports, `amx` included where its tiles are emulated
/// ([`amx_emulated`]). Kernels of any level up to this one can be asked
/// for by name (the tests); the process's own level is [`level`].
pub fn detected() -> Level {
    let cpu = cpu();
    if cpu == Level::Avx512Vnni && amx_emulated() {
        Level::Amx
    } else {
        cpu
    }
}

/// What the CPU supports, `amx` included where `KVRUN_AMX_EMULATE=1`
/// emulates its tiles; [`emulate_amx`] does not change it (nor, so, the
/// process's own [`level`]).
fn cpu() -> Level {
    match raw() {
        Level::Avx512Vnni if emulate_env() => Level::Amx,
        l => l,
    }
}

/// What the CPU itself supports (detected once).
fn raw() -> Level {
    static RAW: OnceLock<Level> = OnceLock::new();
    *RAW.get_or_init(detect)
}

static EMULATE_AMX: AtomicBool = AtomicBool::new(false);

/// `KVRUN_AMX_EMULATE=1` (read once).
fn emulate_env() -> bool {
    static ENV: OnceLock<bool> = OnceLock::new();
    *ENV.get_or_init(|| std::env::var("KVRUN_AMX_EMULATE").is_ok_and(|v| v.trim() == "1"))
}

/// Whether the `amx` level's tile instructions run emulated in software
/// (`amx_emu`), on a CPU with AVX-512 VNNI (the rest of the level is VNNI
/// code): everywhere under `KVRUN_AMX_EMULATE=1`, and after
/// [`emulate_amx`] where the CPU has no AMX of its own.
pub fn amx_emulated() -> bool {
    // asked in every block of tile instructions: one load once known
    match EMULATED.load(Ordering::Relaxed) {
        1 => false,
        2 => true,
        _ => {
            let e = emulation_asked();
            // a value stored meanwhile by `emulate_amx` is the newer one
            let _ = EMULATED.compare_exchange(0, 1 + e as u8, Ordering::Relaxed, Ordering::Relaxed);
            e
        }
    }
}

/// [`amx_emulated`]'s answer: 0 not yet known, 1 no, 2 yes.
static EMULATED: AtomicU8 = AtomicU8::new(0);

fn emulation_asked() -> bool {
    raw() >= Level::Avx512Vnni
        && (emulate_env() || (EMULATE_AMX.load(Ordering::Relaxed) && !amx_enabled()))
}

/// Whether this process's own kernel level ([`level`]) is `amx` on
/// emulated tiles: its timings are the emulator's, not the CPU's.
pub fn level_is_emulated() -> bool {
    level() == Level::Amx && amx_emulated()
}

/// Let kernels asked for at level `amx` run on emulated tiles from now on
/// where the CPU has AVX-512 VNNI but no AMX (for tests: such a CPU then
/// runs, and checks, the AMX kernels). The process's own [`level`] stays
/// the CPU's. Returns whether `amx` kernels can now run.
pub fn emulate_amx() -> bool {
    EMULATE_AMX.store(true, Ordering::Relaxed);
    EMULATED.store(1 + emulation_asked() as u8, Ordering::Relaxed);
    detected() >= Level::Amx
}

/// A kernel of a family with an AVX-512 VNNI and an AVX2 version, for
/// kernel level `level` where this CPU runs it: `vnni` from avx512vnni,
/// `avx2` at avx2 and avx512, `None` at portable and at levels above what
/// the CPU runs.
pub fn vnni_or_avx2<T>(level: Level, vnni: T, avx2: T) -> Option<T> {
    if level < Level::Avx2 || level > detected() {
        return None;
    }
    Some(if level.vnni() { vnni } else { avx2 })
}

#[cfg(target_arch = "x86_64")]
fn detect() -> Level {
    use std::arch::is_x86_feature_detected as has;
    if !(has!("avx2") && has!("fma") && has!("f16c")) {
        return Level::Portable;
    }
    if !(has!("avx512f") && has!("avx512bw") && has!("avx512vl")) {
        return Level::Avx2;
    }
    if !has!("avx512vnni") {
        return Level::Avx512;
    }
    if amx_enabled() {
        Level::Amx
    } else {
        Level::Avx512Vnni
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> Level {
    Level::Portable
}

/// The cap `KVRUN_CPU` asks for: `Ok(None)` when unset or `native`.
fn requested() -> Result<Option<Level>> {
    match std::env::var("KVRUN_CPU") {
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(_)) => {
            Err(Error::Other("KVRUN_CPU is not valid UTF-8".into()))
        }
        Ok(v) => Level::parse(v.trim()).ok_or_else(|| {
            Error::Other(format!(
                "KVRUN_CPU={v}: expected one of native, {}",
                Level::ALL.map(Level::name).join(", ")
            ))
        }),
    }
}

/// Check `KVRUN_CPU` and `KVRUN_AMX_EMULATE`: a one-line error when the
/// first names no level or one this CPU lacks, or the second asks for
/// emulated tiles on a CPU without AVX-512 VNNI; otherwise the level
/// kernels will run at.
pub fn check_env() -> Result<Level> {
    match std::env::var("KVRUN_AMX_EMULATE") {
        Err(std::env::VarError::NotPresent) => {}
        Ok(v) if v.trim() == "0" || v.trim().is_empty() => {}
        Ok(v) if v.trim() == "1" => {
            if !amx_emulated() {
                return Err(Error::Other(format!(
                    "KVRUN_AMX_EMULATE=1: emulated AMX tiles need AVX-512 VNNI; this CPU supports at most {}",
                    cpu()
                )));
            }
        }
        Ok(v) => {
            return Err(Error::Other(format!(
                "KVRUN_AMX_EMULATE={v}: expected 1 (emulate the AMX tiles) or 0"
            )))
        }
        Err(_) => return Err(Error::Other("KVRUN_AMX_EMULATE is not valid UTF-8".into())),
    }
    let have = cpu();
    match requested()? {
        Some(want) if want > have => Err(Error::Other(format!(
            "KVRUN_CPU={want}: this CPU supports at most {have}"
        ))),
        Some(want) => Ok(want),
        None => Ok(have),
    }
}

/// The level kvrun's kernels run at in this process: what the CPU has,
/// capped by `KVRUN_CPU` (an unreadable value counts as `native`; the
/// binary rejects it up front through [`check_env`]).
pub fn level() -> Level {
    static LEVEL: OnceLock<Level> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        let have = cpu();
        match requested() {
            Ok(Some(want)) => want.min(have),
            _ => have,
        }
    })
}

/// Whether kernels of level `l` run here.
#[inline]
pub fn at_least(l: Level) -> bool {
    level() >= l
}

/// Whether this process may run AMX-INT8 tiles: the CPU has AMX-TILE and
/// AMX-INT8, the OS saves their state (XCR0 bits 17 and 18), and the Linux
/// kernel granted this process the tile data state. Asks at most once;
/// `KVRUN_CPU` caps the level on top of this.
pub fn amx_enabled() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(ask_amx)
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn ask_amx() -> bool {
    use std::arch::x86_64::{__cpuid, __cpuid_count, _xgetbv};
    // SAFETY: cpuid is present on every x86_64 CPU; xgetbv is only run
    // once cpuid says the OS enabled XSAVE (OSXSAVE, leaf 1 ECX bit 27).
    unsafe {
        if __cpuid(0).eax < 7 {
            return false;
        }
        let l7 = __cpuid_count(7, 0);
        let (tile, int8) = (l7.edx >> 24 & 1 == 1, l7.edx >> 25 & 1 == 1);
        if !(tile && int8) || __cpuid(1).ecx >> 27 & 1 == 0 {
            return false;
        }
        if _xgetbv(0) >> 17 & 3 != 3 {
            return false;
        }
    }
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: arch_prctl with ARCH_REQ_XCOMP_PERM only changes which
    // extended register states this process may use; it reads and writes
    // no memory of ours.
    unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        ) == 0
    }
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn ask_amx() -> bool {
    false
}
