//! Q8_0 × Q8_0 with the tokens in the SIMD lanes: a prefill tile and a
//! decoding kernel at the AVX-512 VNNI level and at AVX2, all four
//! following one arithmetic (below), so a prompt's logits do not depend on
//! how it is chunked, nor on which of the two levels ran it.
//!
//! Why not ggml's arithmetic (`qgemm_q8_0`, which keeps it lane for lane):
//! ggml's per-block step costs a product, a scale product, an int → float
//! conversion and an `fma` for each (row, token, 32-weight block), so most
//! of the work is float bookkeeping. Here one 256-bit register holds 8
//! *tokens*, 4 activations each (the token tile is rearranged once per
//! matrix product, [`Prefill::pack`]: block by block, dword group `g` of the
//! 8 tokens side by side, each byte + 128 so it can be taken as unsigned),
//! and each weight dword is broadcast from the row as it lies in the memory
//! map (no repacked copy). The +128 is taken back exactly by starting each
//! block's integer sum at −128·Σ_block w ([`pack_side`], once per row block
//! and product, with the rows' f32 scales). Per (row, block) there is then
//! one float step for all 8 tokens (`mul`, `cvt`, `fma`).
//!
//! - VNNI ([`pack_acts`]): 8 `vpdpbusd` per (row, block) for 8 tokens.
//! - AVX2 ([`pack_acts_nibbles`]): `vpmaddubsw` of the unsigned bytes with
//!   the weights would overflow i16 (255·127·2 > 2¹⁵), so the pack splits
//!   each byte u = 16·h + l into two planes of 4-bit values; per (row, dword
//!   group) two `maddubs` (pairs within ±2·15·128, so a block's 8 groups add
//!   up in i16 exactly), then per (row, block) `madd` by 16 and by 1 turns
//!   the two i16 sums into the i32 `Σ w·u`. Two multiplies per 32 products
//!   and no sign fix-ups, where ggml's AVX2 step spends two `sign`, a
//!   `maddubs`, a `madd`, a conversion and an `fma`.
//!
//! - AVX2, Q4_0 and Q5_0 rows ([`tile_unsigned`], rows expanded by
//!   `b32_x8::row_to_unsigned_at`): their quants q are small and unsigned,
//!   so they go into `maddubs` as they are, against the tokens' signed
//!   bytes ([`pack_acts_signed`]): one multiply per 32 products, the
//!   pairs within 2·31·128, summed in i16 over 4 (Q5_0) or 8 (Q4_0) dword
//!   groups before one `madd`; the offset comes back as −o·Σy per token.
//!   On one Zen 4 core, 8960 × 1536, 128 tokens: 95 GMAC/s against 60 for
//!   the nibble-plane tile on the Q8_0 form.
//!
//! The arithmetic (per row, token and block `b`; `w`, `y` the signed
//! quants, `dx`, `dy` the f16 scales as f32):
//!
//! ```text
//! isum_b = Σ_{i<32} w_i · y_i                                   (exact i32)
//! acc    = fma(dx·dy, f32(isum_b), acc)       (acc from 0, blocks in order)
//! ```
//!
//! [`dot_scalar`] models it; every kernel reproduces it bit for bit (the
//! integer sums are exact whichever way they are added; |isum| ≤ 32·128·127
//! < 2²⁴, so its conversion is exact too). It differs from ggml's (8 float
//! lanes per row summed at the end) by float rounding only.
//!
//! Decoding ([`decode_for`]): one token, 8 rows per call; per row and block
//! ggml's sign trick, `|w| · sign(y, w)` (exact, no correction; `vpdpbusd`
//! with VNNI, `maddubs` + `madd` at AVX2, whose pairs stay within
//! 2·128·127 < 2¹⁵ since the activations lie in ±127), the 8 rows' partial
//! sums reduced into one register (lane = row) for the same float steps.

use super::isa::{vnni_or_avx2, Level};
use crate::tensor::DType;
use half::f16;

/// Weight rows per call (both kernels).
pub const ROWS: usize = 8;
/// Tokens per prefill call (the lanes of a register).
pub const TOKS: usize = 8;
/// Bytes of a Q8_0 block: `d` (f16), `qs[32]` (i8).
pub const Q8_0_BYTES: usize = 34;
/// Bytes of one block of a packed token tile ([`pack_acts`]): 8 dword
/// groups × 8 tokens (32 B each), then the 8 tokens' scales (f32).
pub const PACKED_ACT_BYTES: usize = 8 * 32 + 32;
/// Bytes of one block of a token tile packed in nibble planes
/// ([`pack_acts_nibbles`]): 8 dword groups × (low plane, high plane; 32 B
/// each), then the 8 tokens' scales (f32).
pub const NIBBLE_ACT_BYTES: usize = 8 * 64 + 32;
/// Bytes of one block of a token tile packed signed ([`pack_acts_signed`]):
/// 8 dword groups × 8 tokens (32 B each), the 8 tokens' scales (f32), then
/// their corrections −o·Σy (i32).
pub const SIGNED_ACT_BYTES: usize = 8 * 32 + 32 + 32;
/// Bytes of one block of a packed micro tile's side data ([`pack_side`]):
/// the 8 rows' scales (f32), then their corrections −128·Σw (i32).
pub const SIDE_BYTES: usize = 64;

/// A prefill tile: `(nb, 8 weight rows, their side data (nb ·
/// SIDE_BYTES), a packed token tile (nb · [`Prefill::act_bytes`])) ->
/// out[row][token]`.
pub type TileFn = fn(usize, &[&[u8]; ROWS], &[u8], &[u8]) -> [[f32; TOKS]; ROWS];

/// Packs 8 tokens' Q8_0 rows (`nb` blocks) for a tile: `(nb, tokens, out)`.
pub type PackFn = fn(usize, &[&[u8]; TOKS], &mut [u8]);

/// The form a prefill tile takes its weight rows in: 34-byte blocks of a
/// scale (f16) and 32 quants, one byte each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rows {
    /// Signed quants: Q8_0 itself, or a Q4_0/Q5_0/IQ4_NL row's exact Q8_0
    /// form (`b32_x8::row_to_q8_0`).
    Signed,
    /// A Q4_0/Q5_0 row's unsigned quants, the offset not taken off
    /// (`b32_x8::row_to_unsigned_at`).
    Unsigned,
}

/// A prefill tile with the packing of the token tiles it reads.
#[derive(Clone, Copy, Debug)]
pub struct Prefill {
    /// The form of the weight rows the tile reads.
    pub rows: Rows,
    /// Packs a token tile.
    pub pack: PackFn,
    /// Bytes per block of a packed token tile.
    pub act_bytes: usize,
    /// The tile.
    pub tile: TileFn,
}

/// The VNNI tile on the 8 rows of one Q8_0×8 row block as they lie in the
/// repacked matrix (`b32_x8`'s layout): `(nb, the block's nb groups, side
/// data, packed token tile)`. It reads row r's quant dword g of block b
/// from group b (lane r of its 32-byte run g) where [`TileFn`] reads it from
/// row r, and is otherwise the same code, so the two give the same bits;
/// prefill then needs no gathered copy of a repacked matrix.
pub type TileX8Fn = fn(usize, &[u8], &[u8], &[u8]) -> [[f32; TOKS]; ROWS];

/// Bytes of a Q8_0×8 group (8 rows' scales, then their quants).
pub const X8_GROUP_BYTES: usize = 16 + 8 * 32;

/// A decoding kernel: `(nb, 8 weight rows, one token's Q8_0 row) ->
/// out[row][0]` (the call shape of the other 1-token kernels).
pub type DecodeFn = fn(usize, &[&[u8]; ROWS], &[&[u8]; 1]) -> [[f32; 1]; ROWS];

#[inline]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

/// The scalar model: one weight row · one token's Q8_0 row, `nb` blocks.
pub fn dot_scalar(nb: usize, w: &[u8], y: &[u8]) -> f32 {
    assert!(
        w.len() >= nb * Q8_0_BYTES && y.len() >= nb * Q8_0_BYTES,
        "q8_0: row too short"
    );
    let mut acc = 0f32;
    for b in 0..nb {
        let (x, a) = (&w[b * Q8_0_BYTES..], &y[b * Q8_0_BYTES..]);
        let isum: i32 = (2..Q8_0_BYTES)
            .map(|i| x[i] as i8 as i32 * a[i] as i8 as i32)
            .sum();
        acc = (f16_at(x, 0) * f16_at(a, 0)).mul_add(isum as f32, acc);
    }
    acc
}

/// Every packer's walk over 8 tokens' Q8_0 rows (`nb` blocks; repeat a
/// token to pad): `out` holds `nb` packed blocks of `bytes`, and
/// `put(t, y, o)` writes token t's block `y` (34 bytes) into packed block
/// `o`.
fn pack_tokens(
    nb: usize,
    toks: &[&[u8]; TOKS],
    out: &mut [u8],
    bytes: usize,
    put: impl Fn(usize, &[u8], &mut [u8]),
) {
    assert!(
        toks.iter().all(|t| t.len() >= nb * Q8_0_BYTES),
        "q8_0: activation row too short"
    );
    assert!(out.len() >= nb * bytes, "q8_0: packed tile too short");
    for (b, o) in out[..nb * bytes].chunks_exact_mut(bytes).enumerate() {
        for (t, tok) in toks.iter().enumerate() {
            put(t, &tok[b * Q8_0_BYTES..(b + 1) * Q8_0_BYTES], o);
        }
    }
}

/// Quant dword `g` of a Q8_0 block.
#[inline]
fn dword(y: &[u8], g: usize) -> u32 {
    u32::from_le_bytes([y[2 + 4 * g], y[3 + 4 * g], y[4 + 4 * g], y[5 + 4 * g]])
}

/// Rearrange 8 tokens' Q8_0 rows (`nb` blocks; repeat a token to pad) into
/// the prefill tile's form, `nb · PACKED_ACT_BYTES` bytes in `out`: per
/// block, for g in 0..8 the dwords `g` of tokens 0..8 (each byte + 128,
/// i.e. its sign bit flipped), then the tokens' scales as f32.
pub fn pack_acts(nb: usize, toks: &[&[u8]; TOKS], out: &mut [u8]) {
    pack_tokens(nb, toks, out, PACKED_ACT_BYTES, |t, y, o| {
        for g in 0..8 {
            let at = g * 32 + t * 4;
            o[at..at + 4].copy_from_slice(&(dword(y, g) ^ 0x8080_8080).to_le_bytes());
        }
        o[256 + t * 4..260 + t * 4].copy_from_slice(&f16_at(y, 0).to_le_bytes());
    });
}

/// Rearrange 8 tokens' Q8_0 rows (`nb` blocks; repeat a token to pad) into
/// the AVX2 tile's form, `nb · NIBBLE_ACT_BYTES` bytes in `out`: per block,
/// for g in 0..8 the dwords `g` of tokens 0..8 as [`pack_acts`] has them
/// (u = byte + 128), low nibbles (u & 15) then high nibbles (u >> 4), then
/// the tokens' scales as f32.
pub fn pack_acts_nibbles(nb: usize, toks: &[&[u8]; TOKS], out: &mut [u8]) {
    pack_tokens(nb, toks, out, NIBBLE_ACT_BYTES, |t, y, o| {
        for g in 0..8 {
            let u = dword(y, g) ^ 0x8080_8080;
            let at = g * 64 + t * 4;
            o[at..at + 4].copy_from_slice(&(u & 0x0f0f_0f0f).to_le_bytes());
            o[at + 32..at + 36].copy_from_slice(&((u >> 4) & 0x0f0f_0f0f).to_le_bytes());
        }
        o[512 + t * 4..516 + t * 4].copy_from_slice(&f16_at(y, 0).to_le_bytes());
    });
}

/// Rearrange 8 tokens' Q8_0 rows (`nb` blocks; repeat a token to pad) for
/// the unsigned-row tile (weights `q`, stored value `q − O`), `nb ·
/// SIGNED_ACT_BYTES` bytes in `out`: per block, for g in 0..8 the dwords `g`
/// of tokens 0..8 as they are (signed), the tokens' scales as f32, then
/// each token's −O·Σy (the offset taken back: Σ (q − O)·y = Σ q·y − O·Σ y).
pub fn pack_acts_signed<const O: i32>(nb: usize, toks: &[&[u8]; TOKS], out: &mut [u8]) {
    pack_tokens(nb, toks, out, SIGNED_ACT_BYTES, |t, y, o| {
        for g in 0..8 {
            o[g * 32 + t * 4..g * 32 + t * 4 + 4].copy_from_slice(&dword(y, g).to_le_bytes());
        }
        let at = 256 + t * 4;
        o[at..at + 4].copy_from_slice(&f16_at(y, 0).to_le_bytes());
        let sum: i32 = y[2..].iter().map(|&q| q as i8 as i32).sum();
        o[at + 32..at + 36].copy_from_slice(&(-O * sum).to_le_bytes());
    });
}

/// The side data of 8 weight rows (`nb` blocks), `nb · SIDE_BYTES` bytes in
/// `out`: per block the rows' scales as f32, then −128·Σ of each row's
/// block (the +128 of [`pack_acts`] taken back).
pub fn pack_side(nb: usize, rows: &[&[u8]; ROWS], out: &mut [u8]) {
    assert!(
        rows.iter().all(|r| r.len() >= nb * Q8_0_BYTES),
        "q8_0: weight row too short"
    );
    assert!(out.len() >= nb * SIDE_BYTES, "q8_0: side data too short");
    for b in 0..nb {
        let o = &mut out[b * SIDE_BYTES..(b + 1) * SIDE_BYTES];
        for (r, row) in rows.iter().enumerate() {
            let x = &row[b * Q8_0_BYTES..(b + 1) * Q8_0_BYTES];
            let s: i32 = x[2..].iter().map(|&q| q as i8 as i32).sum();
            o[4 * r..4 * r + 4].copy_from_slice(&f16_at(x, 0).to_le_bytes());
            o[32 + 4 * r..36 + 4 * r].copy_from_slice(&(-128 * s).to_le_bytes());
        }
    }
}

/// [`pack_side`] for the 8 rows of a Q8_0×8 row block, read from its `nb`
/// groups in place (the same bytes out).
pub fn pack_side_x8(nb: usize, groups: &[u8], out: &mut [u8]) {
    assert!(
        groups.len() >= nb * X8_GROUP_BYTES,
        "q8_0: Q8_0×8 block too short"
    );
    assert!(out.len() >= nb * SIDE_BYTES, "q8_0: side data too short");
    for b in 0..nb {
        let (o, g) = (
            &mut out[b * SIDE_BYTES..(b + 1) * SIDE_BYTES],
            &groups[b * X8_GROUP_BYTES..(b + 1) * X8_GROUP_BYTES],
        );
        for r in 0..ROWS {
            // row r's quants: 4 bytes at 16 + 32k + 4r for k in 0..8
            let s: i32 = (0..8)
                .flat_map(|k| &g[16 + 32 * k + 4 * r..20 + 32 * k + 4 * r])
                .map(|&q| q as i8 as i32)
                .sum();
            o[4 * r..4 * r + 4].copy_from_slice(&f16_at(g, 2 * r).to_le_bytes());
            o[32 + 4 * r..36 + 4 * r].copy_from_slice(&(-128 * s).to_le_bytes());
        }
    }
}

/// The Q8_0×8 prefill tile where the CPU runs it: the VNNI level only
/// (the only one that repacks Q8_0).
pub fn tile_x8_for(level: Level) -> Option<TileX8Fn> {
    #[cfg(target_arch = "x86_64")]
    return vnni_or_avx2(level, Some(tile_x8 as TileX8Fn), None).flatten();
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = level;
        None
    }
}

/// The prefill tile for rows of `dtype` (Q8_0, Q4_0, Q5_0 or IQ4_NL) where
/// the CPU runs it, levels avx2 and up: VNNI's from avx512vnni (the Q8_0
/// form of every type), at AVX2 the nibble-plane tile for Q8_0 and IQ4_NL
/// (whose grid values + 128 reach 241, too large for `maddubs` pairs) and
/// the unsigned-row tile for Q4_0 and Q5_0 (one `maddubs` per 32 products,
/// against two).
pub fn prefill_for(dtype: DType, level: Level) -> Option<Prefill> {
    #[cfg(target_arch = "x86_64")]
    {
        let avx2 = match dtype {
            DType::Q8_0 | DType::IQ4NL => Prefill {
                rows: Rows::Signed,
                pack: pack_acts_nibbles,
                act_bytes: NIBBLE_ACT_BYTES,
                tile: tile_avx2,
            },
            DType::Q4_0 => Prefill {
                rows: Rows::Unsigned,
                pack: pack_acts_signed::<8>,
                act_bytes: SIGNED_ACT_BYTES,
                tile: tile_unsigned::<false>,
            },
            DType::Q5_0 => Prefill {
                rows: Rows::Unsigned,
                pack: pack_acts_signed::<16>,
                act_bytes: SIGNED_ACT_BYTES,
                tile: tile_unsigned::<true>,
            },
            _ => return None,
        };
        let vnni = Prefill {
            rows: Rows::Signed,
            pack: pack_acts,
            act_bytes: PACKED_ACT_BYTES,
            tile,
        };
        vnni_or_avx2(level, vnni, avx2)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (dtype, level);
        None
    }
}

/// The decoding kernel where the CPU runs it (levels avx2 and up; VNNI's
/// from avx512vnni).
pub fn decode_for(level: Level) -> Option<DecodeFn> {
    #[cfg(target_arch = "x86_64")]
    return vnni_or_avx2(level, decode::<true>, decode::<false>);
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = level;
        None
    }
}

/// Quant dword `g` of block `b` of a Q8_0-shaped weight row at `row`, in
/// every lane (the tiles' broadcast weights).
///
/// # Safety
/// AVX2 is available; the row holds more than `b` blocks.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn weight_dword(row: *const u8, b: usize, g: usize) -> std::arch::x86_64::__m256i {
    // SAFETY: the caller's contract bounds the read; registers otherwise.
    unsafe {
        let w = row
            .add(b * Q8_0_BYTES + 2 + 4 * g)
            .cast::<i32>()
            .read_unaligned();
        std::arch::x86_64::_mm256_set1_epi32(w)
    }
}

/// The checks every tile's entry makes before its kernel runs: 8 weight
/// rows and the side data of `nb` blocks, a token tile of `nb` packed
/// blocks of `act_bytes`.
#[cfg(target_arch = "x86_64")]
fn check_tile(nb: usize, rows: &[&[u8]; ROWS], side: &[u8], acts: &[u8], act_bytes: usize) {
    assert!(
        rows.iter().all(|r| r.len() >= nb * Q8_0_BYTES),
        "q8_0: weight row too short"
    );
    assert!(side.len() >= nb * SIDE_BYTES, "q8_0: side data too short");
    assert!(acts.len() >= nb * act_bytes, "q8_0: packed tile too short");
}

#[cfg(target_arch = "x86_64")]
fn tile(nb: usize, rows: &[&[u8]; ROWS], side: &[u8], acts: &[u8]) -> [[f32; TOKS]; ROWS] {
    check_tile(nb, rows, side, acts, PACKED_ACT_BYTES);
    // row r's quant dword g of block b at rows[r] + 34b + 2 + 4g
    let wp: [*const u8; ROWS] = std::array::from_fn(|r| rows[r][2..].as_ptr());
    // SAFETY: handed out (prefill_for) only where the CPU has AVX-512
    // F/BW/VL/VNNI (and AVX2, FMA); every buffer holds nb blocks (checked
    // by check_tile), which bounds all loads.
    unsafe { tile_impl::<Q8_0_BYTES, 4>(nb, wp, side, acts) }
}

#[cfg(target_arch = "x86_64")]
fn tile_x8(nb: usize, groups: &[u8], side: &[u8], acts: &[u8]) -> [[f32; TOKS]; ROWS] {
    assert!(
        groups.len() >= nb * X8_GROUP_BYTES,
        "q8_0: Q8_0×8 block too short"
    );
    assert!(side.len() >= nb * SIDE_BYTES, "q8_0: side data too short");
    assert!(
        acts.len() >= nb * PACKED_ACT_BYTES,
        "q8_0: packed tile too short"
    );
    // row r's quant dword g of block b at groups + 272b + 16 + 4r + 32g
    let wp: [*const u8; ROWS] = std::array::from_fn(|r| groups[16 + 4 * r..].as_ptr());
    // SAFETY: handed out (tile_x8_for) only where the CPU has AVX-512
    // F/BW/VL/VNNI (and AVX2, FMA); the groups, side data and tokens hold
    // nb blocks (asserted), which bounds all loads.
    unsafe { tile_impl::<X8_GROUP_BYTES, 32>(nb, wp, side, acts) }
}

/// The VNNI tile over weight rows whose quant dword g of block b is at
/// `wp[r] + BS·b + GS·g`.
///
/// # Safety
/// The CPU has the features below; every `wp[r]` can be read for nb blocks
/// at that stride, `side` and `acts` hold nb blocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn tile_impl<const BS: usize, const GS: usize>(
    nb: usize,
    wp: [*const u8; ROWS],
    side: &[u8],
    acts: &[u8],
) -> [[f32; TOKS]; ROWS] {
    use std::arch::x86_64::*;
    // per row: 8 tokens' float sums in the lanes
    let mut acc = [_mm256_setzero_ps(); ROWS];
    for b in 0..nb {
        // SAFETY (all loads below): b < nb and every buffer holds nb blocks.
        let a = unsafe { acts.as_ptr().add(b * PACKED_ACT_BYTES) };
        let s = unsafe { side.as_ptr().add(b * SIDE_BYTES) };
        // the token tile's 8 dword groups (unsigned) and scales
        let y: [__m256i; 8] =
            std::array::from_fn(|g| unsafe { _mm256_loadu_si256(a.add(32 * g).cast()) });
        let dy = unsafe { _mm256_loadu_ps(a.add(256).cast()) };
        // each row's sum starts at its correction −128·Σw
        let mut isum: [__m256i; ROWS] = std::array::from_fn(|r| unsafe {
            _mm256_set1_epi32(s.add(32 + 4 * r).cast::<i32>().read_unaligned())
        });
        // group by group, rows innermost: 8 independent chains
        for (g, yg) in y.iter().enumerate() {
            for r in 0..ROWS {
                let w = unsafe {
                    _mm256_set1_epi32(wp[r].add(BS * b + GS * g).cast::<i32>().read_unaligned())
                };
                isum[r] = _mm256_dpbusd_epi32(isum[r], *yg, w);
            }
        }
        // acc = fma(dx·dy, f32(isum), acc) for 8 tokens at once
        for r in 0..ROWS {
            let dx = unsafe { s.add(4 * r).cast::<f32>().read_unaligned() };
            let d = _mm256_mul_ps(_mm256_set1_ps(dx), dy);
            acc[r] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(isum[r]), acc[r]);
        }
    }
    let mut out = [[0f32; TOKS]; ROWS];
    for r in 0..ROWS {
        // SAFETY: out[r] holds 8 floats.
        unsafe { _mm256_storeu_ps(out[r].as_mut_ptr(), acc[r]) };
    }
    out
}

#[cfg(target_arch = "x86_64")]
fn tile_avx2(nb: usize, rows: &[&[u8]; ROWS], side: &[u8], acts: &[u8]) -> [[f32; TOKS]; ROWS] {
    check_tile(nb, rows, side, acts, NIBBLE_ACT_BYTES);
    // SAFETY: handed out (prefill_for) only where the CPU has AVX2, FMA and
    // F16C; every buffer holds nb blocks (checked by check_tile), which
    // bounds all loads.
    unsafe { tile_avx2_impl(nb, rows, side, acts) }
}

/// Rows per pass of the AVX2 tile: 4 rows' two i16 sums and float sums
/// are 12 of AVX2's 16 registers.
#[cfg(target_arch = "x86_64")]
const AVX2_PASS_ROWS: usize = 4;

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_avx2_impl(
    nb: usize,
    rows: &[&[u8]; ROWS],
    side: &[u8],
    acts: &[u8],
) -> [[f32; TOKS]; ROWS] {
    use std::arch::x86_64::*;
    const PR: usize = AVX2_PASS_ROWS;
    let mut out = [[0f32; TOKS]; ROWS];
    let (ones, sixteen) = (_mm256_set1_epi16(1), _mm256_set1_epi16(16));
    for pass in 0..ROWS / PR {
        let wp: [*const u8; PR] = std::array::from_fn(|r| rows[pass * PR + r].as_ptr());
        // per row: 8 tokens' float sums in the lanes
        let mut acc = [_mm256_setzero_ps(); PR];
        for b in 0..nb {
            // SAFETY (all loads below): b < nb and every buffer holds nb blocks.
            let a = unsafe { acts.as_ptr().add(b * NIBBLE_ACT_BYTES) };
            let s = unsafe { side.as_ptr().add(b * SIDE_BYTES) };
            // per row: Σ w·l and Σ w·h over the block, pairs of bytes in i16
            // (|sum| ≤ 8 groups · 2·15·128 < 2¹⁵). The groups stay a loop
            // (`black_box` hides the count): unrolled, LLVM hoisted all 16
            // plane loads and spilled them, 106 memory operations per 64
            // `maddubs` instead of 48 (1.5B Q8_0 pp512: 60.9 against 66.6
            // t/s in an x86-64-v3 build)
            let mut lo = [_mm256_setzero_si256(); PR];
            let mut hi = [_mm256_setzero_si256(); PR];
            for g in 0..std::hint::black_box(8usize) {
                let l = unsafe { _mm256_loadu_si256(a.add(64 * g).cast()) };
                let h = unsafe { _mm256_loadu_si256(a.add(64 * g + 32).cast()) };
                for r in 0..PR {
                    let w = unsafe { weight_dword(wp[r], b, g) };
                    lo[r] = _mm256_add_epi16(lo[r], _mm256_maddubs_epi16(l, w));
                    hi[r] = _mm256_add_epi16(hi[r], _mm256_maddubs_epi16(h, w));
                }
            }
            // isum = 16·Σ w·h + Σ w·l − 128·Σ w; acc = fma(dx·dy, f32(isum), acc)
            let dy = unsafe { _mm256_loadu_ps(a.add(512).cast()) };
            for r in 0..PR {
                let corr = unsafe {
                    s.add(32 + 4 * (pass * PR + r))
                        .cast::<i32>()
                        .read_unaligned()
                };
                let isum = _mm256_add_epi32(
                    _mm256_add_epi32(
                        _mm256_madd_epi16(hi[r], sixteen),
                        _mm256_madd_epi16(lo[r], ones),
                    ),
                    _mm256_set1_epi32(corr),
                );
                let dx = unsafe { s.add(4 * (pass * PR + r)).cast::<f32>().read_unaligned() };
                let d = _mm256_mul_ps(_mm256_set1_ps(dx), dy);
                acc[r] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(isum), acc[r]);
            }
        }
        for r in 0..PR {
            // SAFETY: out[pass·PR + r] holds 8 floats.
            unsafe { _mm256_storeu_ps(out[pass * PR + r].as_mut_ptr(), acc[r]) };
        }
    }
    out
}

/// The AVX2 tile on unsigned Q4_0 (`Q5` false) or Q5_0 rows
/// ([`Rows::Unsigned`]) and a token tile from [`pack_acts_signed`]; reads
/// only the scales of the side data.
#[cfg(target_arch = "x86_64")]
fn tile_unsigned<const Q5: bool>(
    nb: usize,
    rows: &[&[u8]; ROWS],
    side: &[u8],
    acts: &[u8],
) -> [[f32; TOKS]; ROWS] {
    check_tile(nb, rows, side, acts, SIGNED_ACT_BYTES);
    // SAFETY: handed out (prefill_for) only where the CPU has AVX2, FMA and
    // F16C; every buffer holds nb blocks (checked by check_tile), which
    // bounds all loads.
    unsafe { tile_unsigned_impl::<Q5>(nb, rows, side, acts) }
}

/// Per (row, dword group) one `maddubs` of the row's 4 unsigned quants
/// (broadcast) with the 8 tokens' 4 signed ones: its pairs are within
/// 2·31·128 (Q5_0) or 2·15·128 (Q4_0), so 4 (Q5_0) or all 8 (Q4_0) groups
/// of a block add up in i16 exactly before one `madd` widens them. The
/// sum starts at the tokens' −o·Σy, so it ends as the exact `isum_b` of the
/// Q8_0 form, and the float steps are the model's.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_unsigned_impl<const Q5: bool>(
    nb: usize,
    rows: &[&[u8]; ROWS],
    side: &[u8],
    acts: &[u8],
) -> [[f32; TOKS]; ROWS] {
    use std::arch::x86_64::*;
    const PR: usize = AVX2_PASS_ROWS;
    // dword groups summed in i16 before widening
    let span = if Q5 { 4 } else { 8 };
    let mut out = [[0f32; TOKS]; ROWS];
    let ones = _mm256_set1_epi16(1);
    for pass in 0..ROWS / PR {
        let wp: [*const u8; PR] = std::array::from_fn(|r| rows[pass * PR + r].as_ptr());
        // per row: 8 tokens' float sums in the lanes
        let mut acc = [_mm256_setzero_ps(); PR];
        for b in 0..nb {
            // SAFETY (all loads below): b < nb and every buffer holds nb blocks.
            let a = unsafe { acts.as_ptr().add(b * SIGNED_ACT_BYTES) };
            let s = unsafe { side.as_ptr().add(b * SIDE_BYTES) };
            // each row's sum starts at the tokens' corrections −o·Σy
            let corr = unsafe { _mm256_loadu_si256(a.add(288).cast()) };
            let mut isum = [corr; PR];
            for g0 in (0..8).step_by(span) {
                let mut p = [_mm256_setzero_si256(); PR];
                for g in g0..g0 + span {
                    let y = unsafe { _mm256_loadu_si256(a.add(32 * g).cast()) };
                    for r in 0..PR {
                        let w = unsafe { weight_dword(wp[r], b, g) };
                        p[r] = _mm256_add_epi16(p[r], _mm256_maddubs_epi16(w, y));
                    }
                }
                for r in 0..PR {
                    isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(p[r], ones));
                }
            }
            // acc = fma(dx·dy, f32(isum), acc)
            let dy = unsafe { _mm256_loadu_ps(a.add(256).cast()) };
            for r in 0..PR {
                let dx = unsafe { s.add(4 * (pass * PR + r)).cast::<f32>().read_unaligned() };
                let d = _mm256_mul_ps(_mm256_set1_ps(dx), dy);
                acc[r] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(isum[r]), acc[r]);
            }
        }
        for r in 0..PR {
            // SAFETY: out[pass·PR + r] holds 8 floats.
            unsafe { _mm256_storeu_ps(out[pass * PR + r].as_mut_ptr(), acc[r]) };
        }
    }
    out
}

#[cfg(target_arch = "x86_64")]
fn decode<const VNNI: bool>(nb: usize, rows: &[&[u8]; ROWS], y: &[&[u8]; 1]) -> [[f32; 1]; ROWS] {
    let y = y[0];
    assert!(
        rows.iter().all(|r| r.len() >= nb * Q8_0_BYTES),
        "q8_0: weight row too short"
    );
    assert!(y.len() >= nb * Q8_0_BYTES, "q8_0: activation row too short");
    // SAFETY: handed out (decode_for) only where the CPU has AVX2, FMA and
    // F16C, and with VNNI only at level avx512vnni (AVX-512 F/BW/VL/VNNI);
    // every row holds nb blocks (checked just above), which bounds all
    // loads.
    unsafe {
        if VNNI {
            decode_vnni(nb, rows, y)
        } else {
            decode_avx2(nb, rows, y)
        }
    }
    .map(|v| [v])
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn decode_vnni(nb: usize, rows: &[&[u8]; ROWS], y: &[u8]) -> [f32; ROWS] {
    // SAFETY: the caller's contract (decode).
    unsafe { decode_body::<true>(nb, rows, y) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn decode_avx2(nb: usize, rows: &[&[u8]; ROWS], y: &[u8]) -> [f32; ROWS] {
    // SAFETY: the caller's contract (decode).
    unsafe { decode_body::<false>(nb, rows, y) }
}

/// Micro tiles ahead that decoding prefetches (into L2; `matvec_k` takes
/// them from a contiguous matrix): the rows are too short for the hardware
/// prefetcher to get going.
const PREFETCH_TILES: usize = 2;

/// The decoding kernel's body, inlined into [`decode_vnni`] and
/// [`decode_avx2`] (`VNNI` only where the CPU has it).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn decode_body<const VNNI: bool>(nb: usize, rows: &[&[u8]; ROWS], y: &[u8]) -> [f32; ROWS] {
    use std::arch::x86_64::*;
    // SAFETY: the function's contract: every intrinsic below has its
    // features where this is inlined (dpbusd only with VNNI); every load is
    // inside nb blocks (b < nb and every row holds nb blocks).
    unsafe {
        let wp: [*const u8; ROWS] = std::array::from_fn(|r| rows[r].as_ptr());
        let yp = y.as_ptr();
        let mut acc = _mm256_setzero_ps();
        for b in 0..nb {
            let off = b * Q8_0_BYTES;
            for p in &wp {
                // a prefetch never faults and reads nothing the program sees;
                // wrapping_add keeps the pointer's provenance
                _mm_prefetch::<_MM_HINT_T1>(
                    p.wrapping_add(PREFETCH_TILES * ROWS * nb * Q8_0_BYTES + off)
                        .cast(),
                );
            }
            let yq = _mm256_loadu_si256(yp.add(off + 2).cast());
            let dy = f16::from_bits(yp.add(off).cast::<u16>().read_unaligned()).to_f32();
            // per row: 8 partial sums of 4 products, |w| · (y signed like w)
            let part: [__m256i; ROWS] = std::array::from_fn(|r| {
                let x = _mm256_loadu_si256(wp[r].add(off + 2).cast());
                if VNNI {
                    let (ax, sy) = (_mm256_abs_epi8(x), _mm256_sign_epi8(yq, x));
                    _mm256_dpbusd_epi32(_mm256_setzero_si256(), ax, sy)
                } else {
                    signed_dot_avx2(x, yq)
                }
            });
            let isum = rows_into_lanes(&part);
            // the rows' scales in their lanes
            let dx: [u16; ROWS] =
                std::array::from_fn(|r| wp[r].add(off).cast::<u16>().read_unaligned());
            let dx = _mm256_cvtph_ps(_mm_loadu_si128(dx.as_ptr().cast()));
            let d = _mm256_mul_ps(dx, _mm256_set1_ps(dy));
            acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(isum), acc);
        }
        let mut out = [0f32; ROWS];
        _mm256_storeu_ps(out.as_mut_ptr(), acc);
        out
    }
}

/// `Σ w·y` in i32 lanes of 4 products at AVX2, for signed bytes `w`
/// within ±127 and activations `y` that are never −128 (ggml's Q8_0
/// quantizer writes ±127 at most): ggml's sign trick, `|w| · sign(y, w)`
/// by `maddubs` (pairs within 2·127·127 < 2¹⁵), widened by `madd` (Q8_0's
/// decoding here, and IQ4_NL's in `b32_x8`).
///
/// # Safety
/// AVX2 must be available.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn signed_dot_avx2(
    w: std::arch::x86_64::__m256i,
    y: std::arch::x86_64::__m256i,
) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    // SAFETY: AVX2 is available (the caller's contract); registers only.
    unsafe {
        let p = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(y, w));
        _mm256_madd_epi16(p, _mm256_set1_epi16(1))
    }
}

/// The 8 rows' partial sums (8 lanes each) added into one register, lane
/// r = row r's whole sum: pairs, quads, halves (exact: integer adds).
///
/// # Safety
/// AVX2 must be available.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn rows_into_lanes(
    part: &[std::arch::x86_64::__m256i; ROWS],
) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    // SAFETY: AVX2 is available (the caller's contract); registers only.
    unsafe {
        let pair = |a: __m256i, b: __m256i| {
            _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b))
        };
        let quad = |a: __m256i, b: __m256i| {
            _mm256_add_epi32(_mm256_unpacklo_epi64(a, b), _mm256_unpackhi_epi64(a, b))
        };
        let q0 = quad(pair(part[0], part[1]), pair(part[2], part[3]));
        let q1 = quad(pair(part[4], part[5]), pair(part[6], part[7]));
        _mm256_add_epi32(
            _mm256_permute2x128_si256::<0x20>(q0, q1),
            _mm256_permute2x128_si256::<0x31>(q0, q1),
        )
    }
}
