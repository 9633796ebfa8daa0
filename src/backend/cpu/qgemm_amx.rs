//! K-quant (Q4_K, Q5_K, Q6_K) × Q8_K and Q8_0 × Q8_0 prefill on AMX-INT8
//! tiles (Q4_0 and Q5_0 through Q8_0's, on rows expanded to their exact
//! Q8_0 form by the caller): 16 weight rows × 16 tokens per tile product,
//! for CPUs with Intel AMX (Sapphire Rapids and later), the `amx` kernel
//! level.
//!
//! # Idea
//! A `tdpbusd` multiplies a 16 × 64 tile of unsigned bytes by a 64 × 16
//! tile of signed bytes into 16 × 16 exact i32 sums: 16384 multiply-adds
//! per instruction, against 64 for an AVX-512 `vpdpbusd`. What a K-quant
//! needs between the bytes and the sums is its sub-block scale (one per 32
//! or 16 weights), which no tile op applies. Here it is applied *before*
//! the product, in the weights: the expanded weight `w = (q − o) · sc`
//! (`q` the unsigned quant, `o` 32 for Q6_K and 0 otherwise, `sc` its
//! sub-block scale) is an exact 16-bit integer (|w| ≤ 31·63 = 1953 for
//! Q5_K, ≤ 32·128 = 4096 for Q6_K), split into its low byte (unsigned)
//! and its high byte (signed, `w >> 8`). Two tile products per 64 weights,
//! `tdpbusd` on the low bytes and `tdpbssd` on the high ones, give a
//! superblock's whole scaled sum `isum = lo + 256·hi` with no per-sub-block
//! work at all. The low sum is at most 256·255·128 < 2³¹, so both are
//! exact, and `isum` is *the same integer* as the one `qgemm_lanes`'s
//! arithmetic forms (its module doc: `Σ_j sc16[j]·Σ q·y`, with Q6_K's
//! `−32·Σ sc16·bsum` folded in, which is `Σ (q − 32)·sc·y`). The mins of
//! Q4_K and Q5_K (`Σ_s min[s]·(bsum[2s] + bsum[2s+1])`) are four
//! `vpdpwssd` per row against the token tile's block sums, also exact.
//! Each superblock then ends in the same float steps, `fma(dy·d, isum,
//! acc)` and `fma(−dy·dmin, msum, acc_m)`, in the same order, so the
//! result equals every other K-quant kernel's bit for bit (and a prompt's
//! logits still do not depend on the kernel level or on its chunking).
//!
//! # Layouts
//! - Expanded weights ([`expand`]), per panel of 16 rows and superblock:
//!   [`A_SB`] bytes, for each 64-weight chunk `c` the low-byte tile at
//!   `2048·c` and the high-byte tile at `2048·c + 1024` (row r at `64·r`,
//!   its 64 weights in order); then, apart, [`SIDE_SB`] bytes of side data:
//!   `d` (16 f32), `dmin` (16 f32), and the mins as pairs, `(min[2p],
//!   min[2p + 1])` in i16 for p < 4, 16 rows each.
//! - Packed activations ([`pack_acts`]), per tile of 16 tokens and
//!   superblock: [`ACT_SB`] bytes, for each chunk the 64 × 16 tile in the
//!   AMX B layout (row k holds bytes 4k..4k + 4 of the chunk for tokens 0..16
//!   in turn), then the 16 tokens' `d` (f32) and the pairs of their 32-value
//!   block sums `(s[2p], s[2p + 1])` (i16) for p < 4. Tokens past the end are
//!   zeros.
//!
//! # Parameters
//! Tiles of 16 × 64 bytes throughout (palette 1); the driver
//! (`matmul::matmul_k_amx`) runs two token tiles against each panel so
//! that a weight tile loaded serves 32 tokens.
//!
//! AMX's register state must be granted to the process by the Linux kernel
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM)`): `isa::amx_enabled` asks once, and
//! the level is `amx` only where that succeeded, or where the tiles are
//! emulated (`isa::amx_emulated`). Every block of tile instructions is
//! written once, through `tile_ops!`, and runs either as `asm!` or on
//! `amx_emu`'s software tiles, so the tests run this module's very
//! instructions on CPUs without AMX.

use super::qgemm_lanes::Q8_K_BYTES;
pub use super::qgemm_q8_0_tokens::Q8_0_BYTES;
use crate::tensor::DType;

/// Rows of a panel, tokens of a token tile.
pub const TILE: usize = 16;
/// Bytes of one panel's expanded superblock (4 chunks × 2 tiles of 1 KiB).
pub const A_SB: usize = 8 * 1024;
/// Bytes of one panel's side data per superblock.
pub const SIDE_SB: usize = 64 + 64 + 4 * 64;
/// Bytes of one token tile's packed superblock.
pub const ACT_SB: usize = 4 * 1024 + 64 + 4 * 64;
const ACT_D: usize = 4096;
const ACT_BS: usize = 4096 + 64;
const SIDE_DMIN: usize = 64;
const SIDE_MP: usize = 128;

/// The K-quant types this module runs.
pub fn supports(dtype: DType) -> bool {
    matches!(dtype, DType::Q4K | DType::Q5K | DType::Q6K)
}

/// Expands `kb` superblocks of a panel's 16 rows (`x[r]` points at the
/// first of them, in GGUF's layout) into `a` (`kb · A_SB`) and `side`
/// (`kb · SIDE_SB`), both 64-byte aligned. Panics on short or unaligned
/// buffers, rows that do not hold `kb` superblocks, or a type without
/// an AMX kernel.
pub fn expand(dtype: DType, x: &[&[u8]; TILE], kb: usize, a: &mut [u8], side: &mut [u8]) {
    assert!(supports(dtype), "amx: no kernel for {dtype}");
    assert!(
        super::isa::detected() >= super::isa::Level::Amx,
        "amx: not available"
    );
    let bytes = dtype.block_bytes();
    assert!(
        x.iter().all(|r| r.len() >= kb * bytes),
        "amx expand: short rows"
    );
    assert!(
        a.len() >= kb * A_SB && side.len() >= kb * SIDE_SB,
        "amx expand: short buffers"
    );
    assert!(
        a.as_ptr().align_offset(64) == 0 && side.as_ptr().align_offset(64) == 0,
        "amx expand: unaligned buffers"
    );
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the level check above means AVX-512 F/BW/VL; the lengths
    // and alignment checked above bound every access.
    unsafe {
        let p: [*const u8; TILE] = std::array::from_fn(|r| x[r].as_ptr());
        x86::expand_impl(dtype, &p, kb, a.as_mut_ptr(), side.as_mut_ptr())
    }
}

/// Packs token tile `tt` (tokens `16·tt ..`, of `n_tok` rows of `nb` Q8_K
/// blocks each, `ab` bytes apart in `act`) into `out` (`nb · ACT_SB`).
pub fn pack_acts(act: &[u8], ab: usize, n_tok: usize, nb: usize, tt: usize, out: &mut [u8]) {
    let shape = (nb, Q8_K_BYTES, ACT_SB);
    for_blocks(act, ab, n_tok, tt, shape, out, |n, y, o| {
        for c in 0..4 {
            for k in 0..16 {
                let at = 4 + 64 * c + 4 * k;
                let to = 1024 * c + 64 * k + 4 * n;
                o[to..to + 4].copy_from_slice(&y[at..at + 4]);
            }
        }
        o[ACT_D + 4 * n..ACT_D + 4 * n + 4].copy_from_slice(&y[..4]);
        let bsum = |j: usize| i16::from_le_bytes([y[260 + 2 * j], y[261 + 2 * j]]);
        for s in 0..8 {
            // a 32-value sum: |Σ| ≤ 32·128, an exact i16
            let v = bsum(2 * s) + bsum(2 * s + 1);
            let to = ACT_BS + 64 * (s / 2) + 4 * n + 2 * (s % 2);
            o[to..to + 2].copy_from_slice(&v.to_le_bytes());
        }
    });
}

/// Token tile `tt`'s packing: `out` (`nb` blocks of `blk_out` bytes) is
/// zeroed, then `f(n, y, o)` runs for every token `n` < 16 of the tile
/// that exists (of `n_tok` rows, `ab` bytes apart in `act`) and every
/// block: `y` the token's block (`blk_in` bytes), `o` the packed block.
fn for_blocks(
    act: &[u8],
    ab: usize,
    n_tok: usize,
    tt: usize,
    (nb, blk_in, blk_out): (usize, usize, usize),
    out: &mut [u8],
    f: impl Fn(usize, &[u8], &mut [u8]),
) {
    assert!(out.len() >= nb * blk_out, "amx pack: short buffer");
    assert!(
        ab >= nb * blk_in && act.len() >= n_tok * ab,
        "amx pack: short activations"
    );
    out[..nb * blk_out].fill(0);
    for n in 0..TILE.min(n_tok.saturating_sub(TILE * tt)) {
        let t = TILE * tt + n;
        let row = &act[t * ab..t * ab + nb * blk_in];
        for (y, o) in row.chunks_exact(blk_in).zip(out.chunks_exact_mut(blk_out)) {
            f(n, y, o);
        }
    }
}

/// The tile product of one panel against one or two token tiles over `kb`
/// superblocks, added into the float accumulators: `acc` and `acc_m`
/// hold `(token tile, row, token)` = `n_tt × 16 × 16` floats each.
/// `a`, `side`: the panel's expanded superblocks ([`expand`]); `b[k]`: the
/// packed superblocks of token tile k ([`pack_acts`]), `n_tt` (1 or 2) of
/// them. The caller must have configured the tiles ([`TileScope`]).
///
/// # Safety
/// The level is `amx` (tiles configured by a live [`TileScope`] on this
/// thread); `a` holds `kb · A_SB` bytes, `side` `kb · SIDE_SB`, each
/// `b[k]` `kb · ACT_SB`, `acc`/`acc_m` `n_tt · 256` floats.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn panel(
    mins: bool,
    kb: usize,
    a: *const u8,
    side: *const u8,
    b: [*const u8; 2],
    n_tt: usize,
    acc: *mut f32,
    acc_m: *mut f32,
) {
    // SAFETY: the caller's contract.
    unsafe {
        match (mins, n_tt) {
            (true, 2) => x86::panel_impl::<true, true>(kb, a, side, b, acc, acc_m),
            (true, _) => x86::panel_impl::<true, false>(kb, a, side, b, acc, acc_m),
            (false, 2) => x86::panel_impl::<false, true>(kb, a, side, b, acc, acc_m),
            (false, _) => x86::panel_impl::<false, false>(kb, a, side, b, acc, acc_m),
        }
    }
}

/// Bytes of one token tile's packed Q8_0 block: the 8 × 64-byte B tile
/// (row k: bytes 4k..4k + 4 of tokens 0..16), then the 16 tokens' `d` (f32).
pub const ACT8_BLK: usize = 512 + 64;

/// Packs token tile `tt` of `n_tok` Q8_0 rows (`nb` blocks, `ab` bytes
/// apart in `act`) into `out` (`nb · ACT8_BLK`); tokens past the end are
/// zeros.
pub fn pack_acts_q8_0(act: &[u8], ab: usize, n_tok: usize, nb: usize, tt: usize, out: &mut [u8]) {
    let shape = (nb, Q8_0_BYTES, ACT8_BLK);
    for_blocks(act, ab, n_tok, tt, shape, out, |n, y, o| {
        for k in 0..8 {
            o[64 * k + 4 * n..64 * k + 4 * n + 4].copy_from_slice(&y[2 + 4 * k..6 + 4 * k]);
        }
        let d = half::f16::from_le_bytes([y[0], y[1]]).to_f32();
        o[512 + 4 * n..516 + 4 * n].copy_from_slice(&d.to_le_bytes());
    });
}

/// One panel of 16 Q8_0 rows (row r at `w + r·rb`, GGUF's layout) against
/// one packed token tile over `nb` blocks: `out[r][t]` is the sum over the
/// blocks, in order, of `fma(dx·dy, isum, acc)` — `qgemm_q8_0_tokens`'s
/// arithmetic (its `dot_scalar`), bit for bit. `dx[b·16 + r]` holds row
/// r's scale of block b as f32. The caller must have configured the tiles
/// with [`TileScope::q8_0`].
///
/// # Safety
/// The level is `amx` and this thread's tiles are configured by a live
/// `TileScope::q8_0`; the 16 rows hold `nb` blocks each, `dx` `16 · nb`
/// floats, `b` `nb · ACT8_BLK` bytes.
#[cfg(target_arch = "x86_64")]
pub unsafe fn panel_q8_0(
    nb: usize,
    w: *const u8,
    rb: usize,
    dx: *const f32,
    b: *const u8,
) -> [[f32; TILE]; TILE] {
    // SAFETY: the caller's contract.
    unsafe { x86::panel_q8_0_impl(nb, w, rb, dx, b) }
}

/// A tile configuration: palette 1 (or 0, tiles unused), 64 bytes.
#[repr(C, align(64))]
struct Cfg([u8; 64]);

/// The tile configuration of this module (8 tiles of 16 rows × 64 bytes)
/// loaded on the current thread for the scope's life. On drop the
/// thread's previous configuration comes back (or the tiles are released
/// if it had none): ggml's AMX kernels, which run in the same process when
/// llama.cpp is loaded (`kvrun bench`), configure a thread once and expect
/// their configuration to stay; releasing it under them faulted
/// (`Illegal instruction` in `kvrun bench --interleave`).
#[derive(Debug)]
pub struct TileScope {
    /// The configuration found at entry; palette 0 when there was none.
    prev: [u8; 64],
    /// Whether the tiles are `amx_emu`'s (fixed for the scope's life).
    emulated: bool,
    /// Tile state belongs to a thread: a scope must end where it began.
    _thread: std::marker::PhantomData<*const ()>,
}

impl TileScope {
    /// Configure the tiles for the K-quant kernel ([`panel`]). Panics
    /// unless AMX is enabled for this process.
    pub fn new() -> TileScope {
        TileScope::with([(16, 64); 8])
    }

    /// Configure the tiles for the Q8_0 kernel ([`panel_q8_0`]): tmm0, 1
    /// the sums (16 × 64 bytes), tmm2, 3 weight blocks (16 rows × 32
    /// bytes), tmm4, 5 token blocks (8 × 64 bytes).
    pub fn q8_0() -> TileScope {
        TileScope::with([
            (16, 64),
            (16, 64),
            (16, 32),
            (16, 32),
            (8, 64),
            (8, 64),
            (16, 64),
            (16, 64),
        ])
    }

    /// (rows, bytes per row) of tiles 0..8, palette 1.
    fn with(shape: [(u8, u16); 8]) -> TileScope {
        let emulated = super::isa::amx_emulated();
        assert!(
            emulated || super::isa::amx_enabled(),
            "amx: tiles not available"
        );
        let mut cfg = Cfg([0; 64]);
        cfg.0[0] = 1; // palette 1
        for (t, (rows, bytes)) in shape.into_iter().enumerate() {
            cfg.0[16 + 2 * t..18 + 2 * t].copy_from_slice(&bytes.to_le_bytes());
            cfg.0[48 + t] = rows;
        }
        let mut prev = Cfg([0; 64]);
        if emulated {
            prev.0 = super::amx_emu::configure(cfg.0);
        } else {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: AMX is enabled for this process (checked above);
            // sttilecfg writes 64 bytes (all zeros when the tiles are not
            // configured) and the configuration loaded is valid for
            // palette 1.
            unsafe {
                std::arch::asm!(
                    "sttilecfg [{p}]",
                    "ldtilecfg [{c}]",
                    p = in(reg) prev.0.as_mut_ptr(),
                    c = in(reg) cfg.0.as_ptr(),
                    options(nostack)
                )
            };
        }
        TileScope {
            prev: prev.0,
            emulated,
            _thread: std::marker::PhantomData,
        }
    }
}

impl Default for TileScope {
    fn default() -> Self {
        TileScope::new()
    }
}

impl Drop for TileScope {
    fn drop(&mut self) {
        if self.emulated {
            super::amx_emu::configure(self.prev);
            return;
        }
        #[cfg(target_arch = "x86_64")]
        {
            let prev = Cfg(self.prev);
            // SAFETY: a TileScope only exists where AMX is enabled; `prev`
            // is what sttilecfg stored on this thread (a scope is not Send),
            // valid to load back.
            unsafe {
                if prev.0[0] == 0 {
                    std::arch::asm!("tilerelease", options(nostack, nomem))
                } else {
                    std::arch::asm!("ldtilecfg [{0}]", in(reg) prev.0.as_ptr(), options(nostack, readonly))
                }
            };
        }
    }
}

/// Runs lines of AMX instructions (`asm!` template strings, `{name}` the
/// operands, each a pointer or a `usize`) on the hardware tiles, or on
/// `amx_emu`'s where the process emulates them: the same text either way.
#[cfg(target_arch = "x86_64")]
macro_rules! tile_ops {
    ([$($t:expr),+ $(,)?], $($name:ident = $val:expr),+ $(,)?) => {
        if super::super::isa::amx_emulated() {
            super::super::amx_emu::run(
                concat!($($t, "\n"),+),
                &[$((stringify!($name), $val as usize)),+],
            )
        } else {
            std::arch::asm!($($t),+, $($name = in(reg) $val),+, options(nostack))
        }
    };
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use std::arch::x86_64::*;

    /// # Safety
    /// AVX-512 F/BW/VL; `x[r]` hold `kb` superblocks of `dtype`, `a` and
    /// `side` `kb · A_SB` and `kb · SIDE_SB` bytes, 64-byte aligned.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn expand_impl(
        dtype: DType,
        x: &[*const u8; TILE],
        kb: usize,
        a: *mut u8,
        side: *mut u8,
    ) {
        let bytes = dtype.block_bytes();
        // SAFETY (every access): b < kb, r < 16, c < 4; the contract.
        unsafe {
            for b in 0..kb {
                let ab = a.add(b * A_SB);
                let sb = side.add(b * SIDE_SB);
                for (r, &xr) in x.iter().enumerate() {
                    let x = xr.add(b * bytes);
                    let (d, dmin, w) = match dtype {
                        DType::Q4K => q45k::<false>(x),
                        DType::Q5K => q45k::<true>(x),
                        _ => q6k(x),
                    };
                    sb.cast::<f32>().add(r).write(d);
                    sb.add(SIDE_DMIN).cast::<f32>().add(r).write(dmin.0);
                    for p in 0..4 {
                        sb.add(SIDE_MP + 64 * p)
                            .cast::<u32>()
                            .add(r)
                            .write(dmin.1[p]);
                    }
                    for (c, (wa, wb)) in w.into_iter().enumerate() {
                        let lo = ab.add(2048 * c + 64 * r);
                        let hi = lo.add(1024);
                        // low bytes (unsigned) and high bytes (w >> 8, signed)
                        _mm256_store_si256(lo.cast(), _mm512_cvtepi16_epi8(wa));
                        _mm256_store_si256(lo.add(32).cast(), _mm512_cvtepi16_epi8(wb));
                        _mm256_store_si256(
                            hi.cast(),
                            _mm512_cvtepi16_epi8(_mm512_srai_epi16(wa, 8)),
                        );
                        _mm256_store_si256(
                            hi.add(32).cast(),
                            _mm512_cvtepi16_epi8(_mm512_srai_epi16(wb, 8)),
                        );
                    }
                }
            }
        }
    }

    /// A superblock's `d`, (`dmin`, its min pairs) and its 4 chunks of
    /// expanded weights, two halves of 32 (i16) each.
    type Expanded = (f32, (f32, [u32; 4]), [(__m512i, __m512i); 4]);

    #[inline(always)]
    unsafe fn f16(x: *const u8) -> f32 {
        // SAFETY: x points to 2 readable bytes (callers).
        half::f16::from_le_bytes(unsafe { [*x, *x.add(1)] }).to_f32()
    }

    /// Scales and mins of a Q4_K / Q5_K superblock: `(sc[8], min pairs)`.
    #[inline(always)]
    unsafe fn scales_mins(x: *const u8) -> ([u8; 8], [u32; 4]) {
        // SAFETY: x + 4 holds the 12 packed scale bytes (callers).
        let u = unsafe { super::super::qgemm_lanes::unpack16(x.add(4)) };
        let b: [u8; 16] = std::array::from_fn(|i| (u[i / 4] >> (8 * (i % 4))) as u8);
        let sc = std::array::from_fn(|i| b[i]);
        let mp = std::array::from_fn(|p| b[8 + 2 * p] as u32 | (b[9 + 2 * p] as u32) << 16);
        (sc, mp)
    }

    /// `q · sc` of 32 unsigned quants (bytes of `q`) in i16.
    #[inline(always)]
    unsafe fn times(q: __m256i, sc: __m512i) -> __m512i {
        // SAFETY: register-only AVX-512 BW ops (the callers' features).
        unsafe { _mm512_mullo_epi16(_mm512_cvtepu8_epi16(q), sc) }
    }

    /// Q4_K (`Q5` false) or Q5_K: the same nibbles and scales, Q5_K's
    /// quants 16 bytes later with a fifth bit from `qh`.
    #[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl")]
    unsafe fn q45k<const Q5: bool>(x: *const u8) -> Expanded {
        // SAFETY: x holds a Q4_K (Q5_K) superblock (callers).
        unsafe {
            let (sc, mp) = scales_mins(x);
            let m4 = _mm256_set1_epi8(0x0f);
            let one = _mm256_set1_epi8(1);
            let qh = _mm256_loadu_si256(x.add(16).cast());
            // Q5_K: bit `s` of every byte of qh, as 16
            let bit = |s: i32| {
                if !Q5 {
                    return _mm256_setzero_si256();
                }
                let v = _mm256_srl_epi16(qh, _mm_cvtsi32_si128(s));
                _mm256_slli_epi16(_mm256_and_si256(v, one), 4)
            };
            let qs = if Q5 { 48 } else { 16 };
            let w = std::array::from_fn(|c| {
                let v = _mm256_loadu_si256(x.add(qs + 32 * c).cast());
                let lo = _mm256_or_si256(_mm256_and_si256(v, m4), bit(2 * c as i32));
                let hi = _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16(v, 4), m4),
                    bit(2 * c as i32 + 1),
                );
                (
                    times(lo, _mm512_set1_epi16(sc[2 * c] as i16)),
                    times(hi, _mm512_set1_epi16(sc[2 * c + 1] as i16)),
                )
            });
            (f16(x), (f16(x.add(2)), mp), w)
        }
    }

    #[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl")]
    unsafe fn q6k(x: *const u8) -> Expanded {
        // SAFETY: x holds a Q6_K superblock (callers).
        unsafe {
            let m4 = _mm256_set1_epi8(0x0f);
            let m3 = _mm256_set1_epi8(0x03);
            let sc = |i: usize| *x.add(192 + i) as i8 as i16;
            let off = _mm512_set1_epi16(32);
            // scales of weights 0..16 and 16..32 of a half
            let pair = |i: usize| {
                _mm512_mask_blend_epi16(
                    0xffff_0000,
                    _mm512_set1_epi16(sc(i)),
                    _mm512_set1_epi16(sc(i + 1)),
                )
            };
            let w = std::array::from_fn(|c| {
                let (n, high) = (c / 2, c % 2 == 1);
                let l1 = _mm256_loadu_si256(x.add(64 * n).cast());
                let l2 = _mm256_loadu_si256(x.add(64 * n + 32).cast());
                let h = _mm256_loadu_si256(x.add(128 + 32 * n).cast());
                let (l1, l2, ha, hb) = if high {
                    (
                        _mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                        _mm256_and_si256(_mm256_srli_epi16(l2, 4), m4),
                        _mm256_and_si256(_mm256_srli_epi16(h, 4), m3),
                        _mm256_and_si256(_mm256_srli_epi16(h, 6), m3),
                    )
                } else {
                    (
                        _mm256_and_si256(l1, m4),
                        _mm256_and_si256(l2, m4),
                        _mm256_and_si256(h, m3),
                        _mm256_and_si256(_mm256_srli_epi16(h, 2), m3),
                    )
                };
                let qa = _mm256_or_si256(l1, _mm256_slli_epi16(ha, 4));
                let qb = _mm256_or_si256(l2, _mm256_slli_epi16(hb, 4));
                let wide = |q: __m256i| _mm512_sub_epi16(_mm512_cvtepu8_epi16(q), off);
                (
                    _mm512_mullo_epi16(wide(qa), pair(4 * c)),
                    _mm512_mullo_epi16(wide(qb), pair(4 * c + 2)),
                )
            });
            (f16(x.add(208)), (0.0, [0; 4]), w)
        }
    }

    /// See [`super::panel`].
    ///
    /// # Safety
    /// [`super::panel`]'s contract; `TWO` means `b[1]` is used too.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn panel_impl<const MINS: bool, const TWO: bool>(
        kb: usize,
        a: *const u8,
        side: *const u8,
        b: [*const u8; 2],
        acc: *mut f32,
        acc_m: *mut f32,
    ) {
        #[repr(C, align(64))]
        struct Scratch([u8; 4096]);
        let mut scr = Scratch([0; 4096]);
        let o = scr.0.as_mut_ptr();
        let n_tt = if TWO { 2 } else { 1 };
        // SAFETY (every access): sb < kb, r < 16, k < n_tt; the contract.
        unsafe {
            for sb in 0..kb {
                let a = a.add(sb * A_SB);
                let s = side.add(sb * SIDE_SB);
                let b0 = b[0].add(sb * ACT_SB);
                let b1 = if TWO { b[1].add(sb * ACT_SB) } else { b0 };
                tiles::<TWO>(a, b0, b1, o);
                for k in 0..n_tt {
                    let bk = if k == 0 { b0 } else { b1 };
                    let dy = _mm512_loadu_ps(bk.add(ACT_D).cast());
                    let ndy = _mm512_sub_ps(_mm512_setzero_ps(), dy);
                    let bs: [__m512i; 4] =
                        std::array::from_fn(|p| _mm512_loadu_si512(bk.add(ACT_BS + 64 * p).cast()));
                    let c = o.add(2048 * k);
                    for r in 0..TILE {
                        let lo = _mm512_load_si512(c.add(64 * r).cast());
                        let hi = _mm512_load_si512(c.add(1024 + 64 * r).cast());
                        let isum = _mm512_add_epi32(lo, _mm512_slli_epi32(hi, 8));
                        let at = 256 * k + 16 * r;
                        let d = _mm512_set1_ps(s.cast::<f32>().add(r).read());
                        let v = _mm512_fmadd_ps(
                            _mm512_mul_ps(dy, d),
                            _mm512_cvtepi32_ps(isum),
                            _mm512_loadu_ps(acc.add(at)),
                        );
                        _mm512_storeu_ps(acc.add(at), v);
                        if MINS {
                            let mut msum = _mm512_setzero_si512();
                            for (p, bs) in bs.iter().enumerate() {
                                let mp = s.add(SIDE_MP + 64 * p).cast::<i32>().add(r).read();
                                msum = _mm512_dpwssd_epi32(msum, *bs, _mm512_set1_epi32(mp));
                            }
                            let dmin = _mm512_set1_ps(s.add(SIDE_DMIN).cast::<f32>().add(r).read());
                            let v = _mm512_fmadd_ps(
                                _mm512_mul_ps(ndy, dmin),
                                _mm512_cvtepi32_ps(msum),
                                _mm512_loadu_ps(acc_m.add(at)),
                            );
                            _mm512_storeu_ps(acc_m.add(at), v);
                        }
                    }
                }
            }
        }
    }

    /// One superblock's tile products: the low- and high-byte sums of
    /// token tile 0 (and 1 when `TWO`) stored at `o` (+0, +1024, and
    /// +2048, +3072), 16 rows of 16 i32 each.
    ///
    /// # Safety
    /// Tiles configured on this thread ([`TileScope`]); `a` holds
    /// `A_SB` bytes, `b0`/`b1` 4 KiB of packed chunks, `o` 4 KiB.
    #[inline(always)]
    unsafe fn tiles<const TWO: bool>(a: *const u8, b0: *const u8, b1: *const u8, o: *mut u8) {
        // one 64-weight chunk: the chunk's low- and high-byte weight tiles
        // at `a + $w`, token tile 0's at `b0 + $y` (both variants), then
        // token tile 1's at `b1 + $y` (`two`) and the products
        macro_rules! loads {
            ($w:literal, $y:literal) => {
                concat!(
                    "tileloadd tmm4, [{a} + {s}*1 + ",
                    $w,
                    "]\n",
                    "tileloadd tmm5, [{a} + {s}*1 + ",
                    $w,
                    " + 1024]\n",
                    "tileloadd tmm6, [{b0} + {s}*1 + ",
                    $y,
                    "]\n",
                )
            };
        }
        macro_rules! chunk {
            (two, $w:literal, $y:literal) => {
                concat!(
                    loads!($w, $y),
                    "tileloadd tmm7, [{b1} + {s}*1 + ",
                    $y,
                    "]\n",
                    "tdpbusd tmm0, tmm4, tmm6\n",
                    "tdpbssd tmm1, tmm5, tmm6\n",
                    "tdpbusd tmm2, tmm4, tmm7\n",
                    "tdpbssd tmm3, tmm5, tmm7",
                )
            };
            (one, $w:literal, $y:literal) => {
                concat!(
                    loads!($w, $y),
                    "tdpbusd tmm0, tmm4, tmm6\n",
                    "tdpbssd tmm1, tmm5, tmm6",
                )
            };
        }
        // SAFETY: the contract; the tile loads and stores stay inside the
        // buffers above (16 rows of 64 bytes, stride 64).
        unsafe {
            if TWO {
                tile_ops!(
                    [
                        "tilezero tmm0",
                        "tilezero tmm1",
                        "tilezero tmm2",
                        "tilezero tmm3",
                        chunk!(two, "0", "0"),
                        chunk!(two, "2048", "1024"),
                        chunk!(two, "4096", "2048"),
                        chunk!(two, "6144", "3072"),
                        "tilestored [{o} + {s}*1], tmm0",
                        "tilestored [{o} + {s}*1 + 1024], tmm1",
                        "tilestored [{o} + {s}*1 + 2048], tmm2",
                        "tilestored [{o} + {s}*1 + 3072], tmm3",
                    ],
                    a = a,
                    b0 = b0,
                    b1 = b1,
                    o = o,
                    s = 64usize,
                );
            } else {
                let _ = b1;
                tile_ops!(
                    [
                        "tilezero tmm0",
                        "tilezero tmm1",
                        chunk!(one, "0", "0"),
                        chunk!(one, "2048", "1024"),
                        chunk!(one, "4096", "2048"),
                        chunk!(one, "6144", "3072"),
                        "tilestored [{o} + {s}*1], tmm0",
                        "tilestored [{o} + {s}*1 + 1024], tmm1",
                    ],
                    a = a,
                    b0 = b0,
                    o = o,
                    s = 64usize,
                );
            }
        }
    }

    /// See [`super::panel_q8_0`].
    ///
    /// # Safety
    /// [`super::panel_q8_0`]'s contract.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn panel_q8_0_impl(
        nb: usize,
        w: *const u8,
        rb: usize,
        dx: *const f32,
        b: *const u8,
    ) -> [[f32; TILE]; TILE] {
        #[repr(C, align(64))]
        struct Scratch([u8; 2048]);
        let mut scr = Scratch([0; 2048]);
        let o = scr.0.as_mut_ptr();
        let mut acc = [_mm512_setzero_ps(); TILE];
        // SAFETY (every access): blocks < nb, rows < 16; the contract.
        unsafe {
            let mut blk = 0;
            while blk < nb {
                let two = nb - blk >= 2;
                // the quants of block blk (and blk + 1) of the 16 rows
                let a = w.add(blk * Q8_0_BYTES + 2);
                let bt = b.add(blk * ACT8_BLK);
                if two {
                    tile_ops!(
                        [
                            "tilezero tmm0",
                            "tilezero tmm1",
                            "tileloadd tmm2, [{a} + {rb}*1]",
                            "tileloadd tmm3, [{a} + {rb}*1 + 34]",
                            "tileloadd tmm4, [{b} + {s}*1]",
                            "tileloadd tmm5, [{b} + {s}*1 + 576]",
                            "tdpbssd tmm0, tmm2, tmm4",
                            "tdpbssd tmm1, tmm3, tmm5",
                            "tilestored [{o} + {s}*1], tmm0",
                            "tilestored [{o} + {s}*1 + 1024], tmm1",
                        ],
                        a = a,
                        rb = rb,
                        b = bt,
                        o = o,
                        s = 64usize,
                    );
                } else {
                    tile_ops!(
                        [
                            "tilezero tmm0",
                            "tileloadd tmm2, [{a} + {rb}*1]",
                            "tileloadd tmm4, [{b} + {s}*1]",
                            "tdpbssd tmm0, tmm2, tmm4",
                            "tilestored [{o} + {s}*1], tmm0",
                        ],
                        a = a,
                        rb = rb,
                        b = bt,
                        o = o,
                        s = 64usize,
                    );
                }
                for j in 0..if two { 2 } else { 1 } {
                    let dy = _mm512_loadu_ps(bt.add(j * ACT8_BLK + 512).cast());
                    let dxb = dx.add((blk + j) * TILE);
                    for (r, acc) in acc.iter_mut().enumerate() {
                        let isum = _mm512_load_si512(o.add(1024 * j + 64 * r).cast());
                        *acc = _mm512_fmadd_ps(
                            _mm512_mul_ps(_mm512_set1_ps(dxb.add(r).read()), dy),
                            _mm512_cvtepi32_ps(isum),
                            *acc,
                        );
                    }
                }
                blk += if two { 2 } else { 1 };
            }
            let mut out = [[0f32; TILE]; TILE];
            for (r, acc) in acc.iter().enumerate() {
                _mm512_storeu_ps(out[r].as_mut_ptr(), *acc);
            }
            out
        }
    }
}
