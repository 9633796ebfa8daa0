//! Scalar reference kernels for every tensor type kvrun computes with.
//!
//! These are the *readable* versions: one function per block layout, written
//! from the layout description (see `ENGINES.md` §6), with the arithmetic
//! ordered exactly like ggml's so that results can be compared bit for bit.
//! Fast (SIMD) kernels elsewhere in kvrun are tested against these.
//!
//! Contents:
//! * [`dequantize_row`]: weight bytes → f32 (bit-exact with ggml's `to_float`).
//! * Activation quantizers [`quantize_row_q8_0`], [`quantize_row_q8_1`],
//!   [`quantize_row_q8_k`] (plus [`quantize_row_f16`], [`quantize_row_bf16`])
//!   and the dispatcher [`quantize_act_row`]: f32 activations → the format a
//!   quantized dot product pairs the weight type with ([`ActType`], ggml's
//!   `vec_dot_type`).
//! * [`dot_ref`]: weight row · f32 activations (dequantize, then an f64 dot).
//! * [`dot_q_ref`]: weight row · *quantized* activations, with integer sums per
//!   block times the block scales, the way ggml's `vec_dot` computes it.
//!
//! All multi-byte fields are little-endian. `f16` is IEEE binary16, `bf16` the
//! upper half of an IEEE binary32.

use crate::tensor::DType;

// ---------------------------------------------------------------------------
// Scalar conversions
// ---------------------------------------------------------------------------

/// IEEE binary16 bits → f32 (exact).
#[inline]
pub fn f16_to_f32(bits: u16) -> f32 {
    half::f16::from_bits(bits).to_f32()
}

/// f32 → IEEE binary16 bits, rounding to nearest, ties to even (like F16C's
/// `vcvtps2ph` with `_MM_FROUND_TO_NEAREST_INT`, which ggml uses).
#[inline]
pub fn f32_to_f16(x: f32) -> u16 {
    half::f16::from_f32(x).to_bits()
}

/// bf16 bits → f32 (exact: the bits become the upper half of the f32).
#[inline]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// f32 → bf16 bits, rounding to nearest, ties to even; a NaN stays a NaN and
/// is made quiet. (Same rule as ggml's `GGML_FP32_TO_BF16`.)
#[inline]
pub fn f32_to_bf16(x: f32) -> u16 {
    let u = x.to_bits();
    if u & 0x7fff_ffff > 0x7f80_0000 {
        // NaN: keep sign and payload top bits, force the quiet bit.
        return ((u >> 16) | 0x40) as u16;
    }
    // Add half an ulp of the result (minus one when the kept lsb is 0, so a
    // tie goes to the even neighbour), then truncate.
    let round = 0x7fff + ((u >> 16) & 1);
    (u.wrapping_add(round) >> 16) as u16
}

// ---------------------------------------------------------------------------
// Little byte-reading helpers (the slices are bounds-checked by the callers'
// length asserts, and again by Rust's indexing)
// ---------------------------------------------------------------------------

#[inline]
fn read_f16(b: &[u8], off: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[off], b[off + 1]]))
}

#[inline]
fn read_u32(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

#[inline]
fn read_f32(b: &[u8], off: usize) -> f32 {
    f32::from_bits(read_u32(b, off))
}

#[inline]
fn read_i16(b: &[u8], off: usize) -> i16 {
    i16::from_le_bytes([b[off], b[off + 1]])
}

/// Check `src`/`dst` sizes for a row of `dst.len()` elements of `dtype`.
fn check_row(what: &str, dtype: DType, n: usize, bytes: usize) {
    let bl = dtype.block_len();
    assert!(
        n.is_multiple_of(bl),
        "{what}: {n} elements is not a multiple of the {dtype} block length {bl}"
    );
    let want = dtype.row_bytes(n);
    assert!(
        bytes == want,
        "{what}: {dtype} row of {n} elements needs {want} bytes, got {bytes}"
    );
}

// ---------------------------------------------------------------------------
// Dequantization
// ---------------------------------------------------------------------------

/// Dequantize one row of `dst.len()` elements of type `dtype` from `src`.
///
/// `dst.len()` must be a multiple of the block length and `src.len()` must be
/// exactly `dtype.row_bytes(dst.len())`. The result is bit-identical to
/// ggml's reference `to_float` for the type.
pub fn dequantize_row(dtype: DType, src: &[u8], dst: &mut [f32]) {
    check_row("dequantize_row", dtype, dst.len(), src.len());
    let bb = dtype.block_bytes();
    let bl = dtype.block_len();
    let block_fn: fn(&[u8], &mut [f32]) = match dtype {
        DType::F32 => dequant_f32,
        DType::F16 => dequant_f16,
        DType::BF16 => dequant_bf16,
        DType::Q4_0 => dequant_q4_0,
        DType::Q4_1 => dequant_q4_1,
        DType::Q5_0 => dequant_q5_0,
        DType::Q5_1 => dequant_q5_1,
        DType::Q8_0 => dequant_q8_0,
        DType::Q2K => dequant_q2_k,
        DType::Q3K => dequant_q3_k,
        DType::Q4K => dequant_q4_k,
        DType::Q5K => dequant_q5_k,
        DType::Q6K => dequant_q6_k,
        DType::IQ4NL => dequant_iq4_nl,
        DType::IQ4XS => dequant_iq4_xs,
    };
    for (blk, y) in src.chunks_exact(bb).zip(dst.chunks_exact_mut(bl)) {
        block_fn(blk, y);
    }
}

/// F32: one little-endian f32 per element.
fn dequant_f32(b: &[u8], y: &mut [f32]) {
    y[0] = read_f32(b, 0);
}

/// F16: one IEEE binary16 per element.
fn dequant_f16(b: &[u8], y: &mut [f32]) {
    y[0] = read_f16(b, 0);
}

/// BF16: one bfloat16 (upper 16 bits of an f32) per element.
fn dequant_bf16(b: &[u8], y: &mut [f32]) {
    y[0] = bf16_to_f32(u16::from_le_bytes([b[0], b[1]]));
}

/// Q4_0, 32 weights in 18 bytes: `d: f16`, `qs[16]`.
/// Byte `qs[j]` holds element `j` in its low nibble and element `j + 16` in
/// its high nibble; the 4-bit values are offset by 8:
/// `y = (q - 8) · d`.
fn dequant_q4_0(b: &[u8], y: &mut [f32]) {
    let d = read_f16(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        let lo = (qs[j] & 0x0f) as i32 - 8;
        let hi = (qs[j] >> 4) as i32 - 8;
        y[j] = lo as f32 * d;
        y[j + 16] = hi as f32 * d;
    }
}

/// Q4_1, 32 weights in 20 bytes: `d: f16`, `m: f16`, `qs[16]`.
/// Nibble order as Q4_0, unsigned values with an offset `m`:
/// `y = q · d + m`.
fn dequant_q4_1(b: &[u8], y: &mut [f32]) {
    let d = read_f16(b, 0);
    let m = read_f16(b, 2);
    let qs = &b[4..20];
    for j in 0..16 {
        let lo = (qs[j] & 0x0f) as f32;
        let hi = (qs[j] >> 4) as f32;
        y[j] = lo * d + m;
        y[j + 16] = hi * d + m;
    }
}

/// The 5-bit values of a Q5_0/Q5_1 block, in element order (0..32).
/// `qh` (a little-endian u32) has bit `i` = the 5th bit of element `i`;
/// `qs` holds the low 4 bits, nibble order as Q4_0.
fn q5_values(qh: u32, qs: &[u8]) -> [u8; 32] {
    let mut q = [0u8; 32];
    for j in 0..16 {
        let h_lo = ((qh >> j) & 1) as u8;
        let h_hi = ((qh >> (j + 16)) & 1) as u8;
        q[j] = (qs[j] & 0x0f) | (h_lo << 4);
        q[j + 16] = (qs[j] >> 4) | (h_hi << 4);
    }
    q
}

/// Q5_0, 32 weights in 22 bytes: `d: f16`, `qh[4]`, `qs[16]`.
/// 5-bit values offset by 16: `y = (q - 16) · d`.
fn dequant_q5_0(b: &[u8], y: &mut [f32]) {
    let d = read_f16(b, 0);
    let q = q5_values(read_u32(b, 2), &b[6..22]);
    for j in 0..32 {
        y[j] = (q[j] as i32 - 16) as f32 * d;
    }
}

/// Q5_1, 32 weights in 24 bytes: `d: f16`, `m: f16`, `qh[4]`, `qs[16]`.
/// Unsigned 5-bit values with an offset: `y = q · d + m`.
fn dequant_q5_1(b: &[u8], y: &mut [f32]) {
    let d = read_f16(b, 0);
    let m = read_f16(b, 2);
    let q = q5_values(read_u32(b, 4), &b[8..24]);
    for j in 0..32 {
        y[j] = q[j] as f32 * d + m;
    }
}

/// Q8_0, 32 weights in 34 bytes: `d: f16`, `qs[32]: i8`. `y = q · d`.
fn dequant_q8_0(b: &[u8], y: &mut [f32]) {
    let d = read_f16(b, 0);
    for j in 0..32 {
        y[j] = (b[2 + j] as i8) as f32 * d;
    }
}

/// The eight 6-bit (scale, min) pairs of a Q4_K/Q5_K super-block, unpacked
/// from the 12 packed bytes `s`:
/// * bytes 0..4: scales 0..4 in the low 6 bits; top 2 bits = bits 4..6 of
///   scales 4..8;
/// * bytes 4..8: mins 0..4 in the low 6 bits; top 2 bits = bits 4..6 of
///   mins 4..8;
/// * bytes 8..12: low 4 bits of scales 4..8 (low nibble) and of mins 4..8
///   (high nibble).
pub fn k_scales_mins(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let mut sc = [0u8; 8];
    let mut mn = [0u8; 8];
    for j in 0..4 {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
    }
    for j in 4..8 {
        sc[j] = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
        mn[j] = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
    (sc, mn)
}

/// The 256 unsigned 4-bit values of a Q4_K super-block, in element order.
/// The 128 bytes `qs` form four 32-byte groups; group `c` holds sub-block
/// `2c` in its low nibbles and sub-block `2c + 1` in its high nibbles.
pub(crate) fn q4_k_values(qs: &[u8]) -> [u8; 256] {
    let mut q = [0u8; 256];
    for c in 0..4 {
        for l in 0..32 {
            let byte = qs[32 * c + l];
            q[64 * c + l] = byte & 0x0f;
            q[64 * c + 32 + l] = byte >> 4;
        }
    }
    q
}

/// The 256 unsigned 5-bit values of a Q5_K super-block: low 4 bits exactly
/// as Q4_K; the 5th bit of element `64c + l` is bit `2c` of `qh[l]`, that of
/// element `64c + 32 + l` is bit `2c + 1` of `qh[l]`.
pub(crate) fn q5_k_values(qh: &[u8], qs: &[u8]) -> [u8; 256] {
    let mut q = q4_k_values(qs);
    for c in 0..4 {
        for l in 0..32 {
            q[64 * c + l] |= ((qh[l] >> (2 * c)) & 1) << 4;
            q[64 * c + 32 + l] |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
        }
    }
    q
}

/// Shared by Q4_K and Q5_K: 8 sub-blocks of 32 with 6-bit scale `sc` and
/// min `m`: `y = (d·sc)·q − (dmin·m)`.
fn dequant_k_with_mins(d: f32, dmin: f32, scales: &[u8], q: &[u8; 256], y: &mut [f32]) {
    let (sc, mn) = k_scales_mins(scales);
    for sb in 0..8 {
        let d1 = d * sc[sb] as f32;
        let m1 = dmin * mn[sb] as f32;
        for l in 0..32 {
            let i = 32 * sb + l;
            y[i] = d1 * q[i] as f32 - m1;
        }
    }
}

/// Q4_K, 256 weights in 144 bytes: `d: f16`, `dmin: f16`, `scales[12]`
/// (packed 6-bit scales and mins, see [`k_scales_mins`]), `qs[128]`.
fn dequant_q4_k(b: &[u8], y: &mut [f32]) {
    let d = read_f16(b, 0);
    let dmin = read_f16(b, 2);
    let q = q4_k_values(&b[16..144]);
    dequant_k_with_mins(d, dmin, &b[4..16], &q, y);
}

/// Q5_K, 256 weights in 176 bytes: `d: f16`, `dmin: f16`, `scales[12]`,
/// `qh[32]`, `qs[128]`.
fn dequant_q5_k(b: &[u8], y: &mut [f32]) {
    let d = read_f16(b, 0);
    let dmin = read_f16(b, 2);
    let q = q5_k_values(&b[16..48], &b[48..176]);
    dequant_k_with_mins(d, dmin, &b[4..16], &q, y);
}

/// The 256 signed 6-bit values (−32..32) of a Q6_K super-block, in element
/// order. Two halves of 128 elements; half `h` uses `ql[64h..64h+64]` and
/// `qh[32h..32h+32]`. Within a half, for `l` in 0..32:
/// * element `l`      = low nibble of `ql[l]`      | bits 0-1 of `qh[l]` << 4
/// * element `l + 32` = low nibble of `ql[l + 32]` | bits 2-3 of `qh[l]` << 4
/// * element `l + 64` = high nibble of `ql[l]`     | bits 4-5 of `qh[l]` << 4
/// * element `l + 96` = high nibble of `ql[l + 32]`| bits 6-7 of `qh[l]` << 4
///
/// each minus 32.
pub(crate) fn q6_k_values(ql: &[u8], qh: &[u8]) -> [i8; 256] {
    let mut q = [0i8; 256];
    for h in 0..2 {
        let ql = &ql[64 * h..64 * h + 64];
        let qh = &qh[32 * h..32 * h + 32];
        let out = &mut q[128 * h..128 * h + 128];
        for l in 0..32 {
            let v = |low4: u8, shift: u32| ((low4 | (((qh[l] >> shift) & 3) << 4)) as i8) - 32;
            out[l] = v(ql[l] & 0x0f, 0);
            out[l + 32] = v(ql[l + 32] & 0x0f, 2);
            out[l + 64] = v(ql[l] >> 4, 4);
            out[l + 96] = v(ql[l + 32] >> 4, 6);
        }
    }
    q
}

/// Q6_K, 256 weights in 210 bytes: `ql[128]`, `qh[64]`, `scales[16]: i8`
/// (one per 16 weights), `d: f16` **last**. `y = (d·scale)·q`.
fn dequant_q6_k(b: &[u8], y: &mut [f32]) {
    let q = q6_k_values(&b[0..128], &b[128..192]);
    let scales = &b[192..208];
    let d = read_f16(b, 208);
    for i in 0..256 {
        let sc = scales[i / 16] as i8;
        y[i] = d * sc as f32 * q[i] as f32;
    }
}

/// The 256 unsigned 2-bit values of a Q2_K super-block, in element order.
/// Two halves of 128 elements; half `h` reads `qs[32h..32h+32]`, and its
/// 32-element quarter `j` takes bits `2j, 2j + 1` of those 32 bytes:
/// element `128h + 32j + l` is `(qs[32h + l] >> 2j) & 3`.
pub(crate) fn q2_k_values(qs: &[u8]) -> [u8; 256] {
    let mut q = [0u8; 256];
    for (i, v) in q.iter_mut().enumerate() {
        let (h, j, l) = (i / 128, (i % 128) / 32, i % 32);
        *v = (qs[32 * h + l] >> (2 * j)) & 3;
    }
    q
}

/// Q2_K, 256 weights in 84 bytes: `scales[16]` (per 16 weights: the scale
/// in the low nibble, the min in the high nibble), `qs[64]` (see
/// [`q2_k_values`]), `d: f16`, `dmin: f16`. `y = (d·sc)·q − (dmin·m)`.
fn dequant_q2_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (read_f16(b, 80), read_f16(b, 82));
    let q = q2_k_values(&b[16..80]);
    for (i, y) in y.iter_mut().enumerate() {
        let sc = b[i / 16];
        let (d1, m1) = (d * (sc & 0x0f) as f32, dmin * (sc >> 4) as f32);
        *y = d1 * q[i] as f32 - m1;
    }
}

/// The 16 six-bit scales of a Q3_K super-block (0..64, used as `sc − 32`)
/// from its 12 bytes: scale `k` and `k + 8` (k < 8) take the low and high
/// nibble of byte `k`, and their top two bits come from bits
/// `2·(k / 4)`, `2·(k / 4) + 4` of byte `8 + k % 4`.
pub(crate) fn q3_k_scales(s: &[u8]) -> [i8; 16] {
    let mut sc = [0i8; 16];
    for k in 0..8 {
        let hi = s[8 + k % 4] >> (2 * (k / 4));
        sc[k] = ((s[k] & 0x0f) | ((hi & 3) << 4)) as i8;
        sc[k + 8] = ((s[k] >> 4) | (((hi >> 4) & 3) << 4)) as i8;
    }
    sc
}

/// The 256 signed 3-bit values (−4..4) of a Q3_K super-block: the low two
/// bits as Q2_K's ([`q2_k_values`] of `qs`), and 4 subtracted unless the
/// element's bit of `hmask` is set: element `128h + 32j + l` reads bit
/// `4h + j` of `hmask[l]`.
pub(crate) fn q3_k_values(hmask: &[u8], qs: &[u8]) -> [i8; 256] {
    let low = q2_k_values(qs);
    let mut q = [0i8; 256];
    for (i, v) in q.iter_mut().enumerate() {
        let (h, j, l) = (i / 128, (i % 128) / 32, i % 32);
        let high = (hmask[l] >> (4 * h + j)) & 1;
        *v = low[i] as i8 - if high == 1 { 0 } else { 4 };
    }
    q
}

/// Q3_K, 256 weights in 110 bytes: `hmask[32]`, `qs[64]`, `scales[12]`
/// (16 packed 6-bit scales, [`q3_k_scales`]), `d: f16`.
/// `y = (d·(sc − 32))·q`.
fn dequant_q3_k(b: &[u8], y: &mut [f32]) {
    let d = read_f16(b, 108);
    let sc = q3_k_scales(&b[96..108]);
    let q = q3_k_values(&b[0..32], &b[32..96]);
    for (i, y) in y.iter_mut().enumerate() {
        let dl = d * (sc[i / 16] as i32 - 32) as f32;
        *y = dl * q[i] as f32;
    }
}

/// The 16 values of IQ4_NL and IQ4_XS: a 4-bit index picks one of these
/// (a non-uniform grid, denser near zero), times the block's scale.
pub const IQ4_VALUES: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// The 32 grid values of a 16-byte run of IQ4 nibbles: element `l` is the
/// low nibble of byte `l`, element `l + 16` its high nibble.
pub(crate) fn iq4_values(qs: &[u8]) -> [i8; 32] {
    let mut q = [0i8; 32];
    for l in 0..16 {
        q[l] = IQ4_VALUES[(qs[l] & 0x0f) as usize];
        q[l + 16] = IQ4_VALUES[(qs[l] >> 4) as usize];
    }
    q
}

/// IQ4_NL, 32 weights in 18 bytes: `d: f16`, `qs[16]` (indices into
/// [`IQ4_VALUES`], [`iq4_values`]). `y = d·v`.
fn dequant_iq4_nl(b: &[u8], y: &mut [f32]) {
    let d = read_f16(b, 0);
    for (y, v) in y.iter_mut().zip(iq4_values(&b[2..18])) {
        *y = d * v as f32;
    }
}

/// The 8 six-bit scales of an IQ4_XS super-block (0..64, used as
/// `ls − 32`): the low 4 bits of scale `k` are nibble `k % 2` of
/// `scales_l[k / 2]`, the top two bits `2k, 2k + 1` of `scales_h`.
pub(crate) fn iq4_xs_scales(b: &[u8]) -> [u8; 8] {
    let h = u16::from_le_bytes([b[2], b[3]]);
    std::array::from_fn(|k| {
        let low = (b[4 + k / 2] >> (4 * (k % 2))) & 0x0f;
        low | ((((h >> (2 * k)) & 3) as u8) << 4)
    })
}

/// IQ4_XS, 256 weights in 136 bytes: `d: f16`, `scales_h: u16`,
/// `scales_l[4]` ([`iq4_xs_scales`]), `qs[128]`: 8 sub-blocks of 32, each
/// 16 bytes as [`iq4_values`]. `y = (d·(ls − 32))·v`.
fn dequant_iq4_xs(b: &[u8], y: &mut [f32]) {
    let d = read_f16(b, 0);
    let ls = iq4_xs_scales(b);
    for sb in 0..8 {
        let dl = d * (ls[sb] as i32 - 32) as f32;
        let v = iq4_values(&b[8 + 16 * sb..24 + 16 * sb]);
        for (y, v) in y[32 * sb..32 * sb + 32].iter_mut().zip(v) {
            *y = dl * v as f32;
        }
    }
}

// ---------------------------------------------------------------------------
// Affine form: small integers and one (a, b) per group
// ---------------------------------------------------------------------------

/// Elements sharing one `(a, b)` in [`affine_row`] for `dtype`, or `None`
/// for the float types (they have no integer form).
pub fn affine_group(dtype: DType) -> Option<usize> {
    match dtype {
        DType::F32 | DType::F16 | DType::BF16 => None,
        // one scale (and min) per 16 weights
        DType::Q2K | DType::Q3K | DType::Q6K => Some(16),
        DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q5_1 | DType::Q8_0 => Some(32),
        // one (scale, min) per 32-weight sub-block
        DType::Q4K | DType::Q5K | DType::IQ4NL | DType::IQ4XS => Some(32),
    }
}

/// One row of a quantized type as small integers `q` (one per element)
/// and per-group steps `a`, `b` (one per [`affine_group`] elements), such
/// that element `i` is `fma(q[i], a[i / g], b[i / g])`: equal (`==`) to
/// what [`dequantize_row`] gives. Each type's dequantization is one
/// exact product of its integer and a scale (the f16 scale, or for K-quants
/// the exact product of the f16 super-block scale and the 6- or 8-bit
/// sub-block scale) followed by at most one rounded addition, which is
/// what the fused step rounds too:
///
/// | type | q | a | b |
/// | --- | --- | --- | --- |
/// | Q8_0 | the quant | d | 0 |
/// | Q4_0, Q5_0 | nibble − 8, 5-bit − 16 | d | 0 |
/// | Q4_1, Q5_1 | the 4- / 5-bit value | d | m |
/// | Q4_K, Q5_K | the 4- / 5-bit value | d·sc | −(dmin·m) |
/// | Q6_K | the 6-bit value − 32 | d·sc | 0 |
/// | Q2_K | the 2-bit value | d·sc | −(dmin·m) |
/// | Q3_K | the 3-bit value − 4 | d·(sc − 32) | 0 |
/// | IQ4_NL | the grid value | d | 0 |
/// | IQ4_XS | the grid value | d·(ls − 32) | 0 |
///
/// Panics on a float type or on sizes that do not fit (`q` n elements,
/// `a` and `b` n / g).
pub fn affine_row(dtype: DType, src: &[u8], q: &mut [i8], a: &mut [f32], b: &mut [f32]) {
    let n = q.len();
    check_row("affine_row", dtype, n, src.len());
    let g = affine_group(dtype).expect("affine_row: a float type has no integer form");
    assert!(
        a.len() == n / g && b.len() == n / g,
        "affine_row: {n} elements need {} steps",
        n / g
    );
    let (bb, bl) = (dtype.block_bytes(), dtype.block_len());
    let per = bl / g;
    for (i, blk) in src.chunks_exact(bb).enumerate() {
        let q = &mut q[i * bl..(i + 1) * bl];
        let (a, b) = (
            &mut a[i * per..(i + 1) * per],
            &mut b[i * per..(i + 1) * per],
        );
        match dtype {
            DType::Q8_0 => {
                (a[0], b[0]) = (read_f16(blk, 0), 0.0);
                for (x, &y) in q.iter_mut().zip(&blk[2..34]) {
                    *x = y as i8;
                }
            }
            DType::Q4_0 | DType::Q4_1 => {
                let (d, m, qs) = match dtype {
                    DType::Q4_0 => (read_f16(blk, 0), 0.0, &blk[2..18]),
                    _ => (read_f16(blk, 0), read_f16(blk, 2), &blk[4..20]),
                };
                let off = if dtype == DType::Q4_0 { 8 } else { 0 };
                (a[0], b[0]) = (d, m);
                for j in 0..16 {
                    q[j] = (qs[j] & 0x0f) as i8 - off;
                    q[j + 16] = (qs[j] >> 4) as i8 - off;
                }
            }
            DType::Q5_0 | DType::Q5_1 => {
                let (d, m, v) = match dtype {
                    DType::Q5_0 => (
                        read_f16(blk, 0),
                        0.0,
                        q5_values(read_u32(blk, 2), &blk[6..22]),
                    ),
                    _ => (
                        read_f16(blk, 0),
                        read_f16(blk, 2),
                        q5_values(read_u32(blk, 4), &blk[8..24]),
                    ),
                };
                let off = if dtype == DType::Q5_0 { 16 } else { 0 };
                (a[0], b[0]) = (d, m);
                for (x, &y) in q.iter_mut().zip(&v) {
                    *x = y as i8 - off;
                }
            }
            DType::Q4K | DType::Q5K => {
                let (d, dmin) = (read_f16(blk, 0), read_f16(blk, 2));
                let v = match dtype {
                    DType::Q4K => q4_k_values(&blk[16..144]),
                    _ => q5_k_values(&blk[16..48], &blk[48..176]),
                };
                let (sc, mn) = k_scales_mins(&blk[4..16]);
                for sb in 0..8 {
                    a[sb] = d * sc[sb] as f32;
                    b[sb] = -(dmin * mn[sb] as f32);
                }
                for (x, &y) in q.iter_mut().zip(&v) {
                    *x = y as i8;
                }
            }
            DType::Q6K => {
                let d = read_f16(blk, 208);
                for (s, x) in a.iter_mut().enumerate() {
                    *x = d * blk[192 + s] as i8 as f32;
                }
                b.fill(0.0);
                q.copy_from_slice(&q6_k_values(&blk[0..128], &blk[128..192]));
            }
            DType::Q2K => {
                let (d, dmin) = (read_f16(blk, 80), read_f16(blk, 82));
                for s in 0..16 {
                    a[s] = d * (blk[s] & 0x0f) as f32;
                    b[s] = -(dmin * (blk[s] >> 4) as f32);
                }
                for (x, &y) in q.iter_mut().zip(&q2_k_values(&blk[16..80])) {
                    *x = y as i8;
                }
            }
            DType::Q3K => {
                let d = read_f16(blk, 108);
                for (x, &sc) in a.iter_mut().zip(&q3_k_scales(&blk[96..108])) {
                    *x = d * (sc as i32 - 32) as f32;
                }
                b.fill(0.0);
                q.copy_from_slice(&q3_k_values(&blk[0..32], &blk[32..96]));
            }
            DType::IQ4NL => {
                (a[0], b[0]) = (read_f16(blk, 0), 0.0);
                q.copy_from_slice(&iq4_values(&blk[2..18]));
            }
            DType::IQ4XS => {
                let d = read_f16(blk, 0);
                for (sb, &ls) in iq4_xs_scales(blk).iter().enumerate() {
                    a[sb] = d * (ls as i32 - 32) as f32;
                    b[sb] = 0.0;
                    q[32 * sb..32 * sb + 32]
                        .copy_from_slice(&iq4_values(&blk[8 + 16 * sb..24 + 16 * sb]));
                }
            }
            DType::F32 | DType::F16 | DType::BF16 => unreachable!("checked above"),
        }
    }
}

// ---------------------------------------------------------------------------
// Activation formats and quantizers
// ---------------------------------------------------------------------------

/// The format activations are converted to before a dot product with a weight
/// row (ggml's `vec_dot_type` of the weight type).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ActType {
    /// Plain f32 (partner of F32 weights).
    F32,
    /// IEEE binary16 (partner of F16 weights).
    F16,
    /// bfloat16 (partner of BF16 weights).
    BF16,
    /// 32 per block: `d: f16`, `qs[32]: i8` (34 bytes). Partner of Q4_0, Q5_0, Q8_0.
    Q8_0,
    /// 32 per block: `d: f16`, `s: f16` (= d·Σqs), `qs[32]: i8` (36 bytes).
    /// Partner of Q4_1, Q5_1.
    Q8_1,
    /// 256 per block: `d: f32`, `qs[256]: i8`, `bsums[16]: i16` (sum of each
    /// 16 consecutive quants), 292 bytes. Partner of the K-quants.
    Q8K,
}

impl ActType {
    /// The activation format ggml pairs weights of type `dtype` with.
    pub fn for_weight(dtype: DType) -> ActType {
        match dtype {
            DType::F32 => ActType::F32,
            DType::F16 => ActType::F16,
            DType::BF16 => ActType::BF16,
            DType::Q4_0 | DType::Q5_0 | DType::Q8_0 | DType::IQ4NL => ActType::Q8_0,
            DType::Q4_1 | DType::Q5_1 => ActType::Q8_1,
            DType::Q2K | DType::Q3K | DType::Q4K | DType::Q5K | DType::Q6K => ActType::Q8K,
            DType::IQ4XS => ActType::Q8K,
        }
    }

    /// The ggml type id.
    pub fn ggml_id(self) -> u32 {
        match self {
            ActType::F32 => 0,
            ActType::F16 => 1,
            ActType::BF16 => 30,
            ActType::Q8_0 => 8,
            ActType::Q8_1 => 9,
            ActType::Q8K => 15,
        }
    }

    /// Number of activations per block.
    pub fn block_len(self) -> usize {
        match self {
            ActType::F32 | ActType::F16 | ActType::BF16 => 1,
            ActType::Q8_0 | ActType::Q8_1 => 32,
            ActType::Q8K => 256,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            ActType::F32 => 4,
            ActType::F16 | ActType::BF16 => 2,
            ActType::Q8_0 => 34,
            ActType::Q8_1 => 36,
            ActType::Q8K => 292,
        }
    }

    /// Bytes taken by `n` activations (`n` a multiple of the block length).
    pub fn row_bytes(self, n: usize) -> usize {
        n / self.block_len() * self.block_bytes()
    }
}

fn check_act(what: &str, act: ActType, n: usize, bytes: usize) {
    let bl = act.block_len();
    assert!(
        n.is_multiple_of(bl),
        "{what}: {n} activations is not a multiple of the {act:?} block length {bl}"
    );
    let want = act.row_bytes(n);
    assert!(
        bytes == want,
        "{what}: {act:?} row of {n} activations needs {want} bytes, got {bytes}"
    );
}

/// Convert `x` to the activation format `act`, writing exactly
/// `act.row_bytes(x.len())` bytes to `out`.
pub fn quantize_act_row(act: ActType, x: &[f32], out: &mut [u8]) {
    match act {
        ActType::F32 => {
            check_act("quantize_act_row", act, x.len(), out.len());
            for (v, o) in x.iter().zip(out.chunks_exact_mut(4)) {
                o.copy_from_slice(&v.to_le_bytes());
            }
        }
        ActType::F16 => quantize_row_f16(x, out),
        ActType::BF16 => quantize_row_bf16(x, out),
        ActType::Q8_0 => quantize_row_q8_0(x, out),
        ActType::Q8_1 => quantize_row_q8_1(x, out),
        ActType::Q8K => quantize_row_q8_k(x, out),
    }
}

/// f32 → F16 row (2 bytes per element, round to nearest even).
pub fn quantize_row_f16(x: &[f32], out: &mut [u8]) {
    check_act("quantize_row_f16", ActType::F16, x.len(), out.len());
    for (v, o) in x.iter().zip(out.chunks_exact_mut(2)) {
        o.copy_from_slice(&f32_to_f16(*v).to_le_bytes());
    }
}

/// f32 → BF16 row (2 bytes per element, round to nearest even).
pub fn quantize_row_bf16(x: &[f32], out: &mut [u8]) {
    check_act("quantize_row_bf16", ActType::BF16, x.len(), out.len());
    for (v, o) in x.iter().zip(out.chunks_exact_mut(2)) {
        o.copy_from_slice(&f32_to_bf16(*v).to_le_bytes());
    }
}

/// The symmetric 8-bit quantization of one 32-block shared by Q8_0 and Q8_1:
/// returns (`d` as stored, the f32 `d` before rounding to f16, the quants).
///
/// This follows the arithmetic of ggml's x86 (AVX/AVX2/AVX-512) activation
/// quantizer, which is what ggml's CPU matmul uses on x86-64:
/// `amax = max|x|`, `d = amax / 127`, multiplier `id = 127 / amax` (0 when
/// `amax == 0`), `q = round_half_even(x · id)` saturated to i8.
/// (ggml's portable `quantize_row_q8_0_ref` uses `id = 1/d` and rounds halves
/// away from zero instead; its quants can differ by ±1 in rare cases.)
fn q8_block(x: &[f32]) -> (u16, f32, [i8; 32]) {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    let mut q = [0i8; 32];
    for (qj, &xj) in q.iter_mut().zip(x) {
        *qj = (xj * id).round_ties_even().clamp(-128.0, 127.0) as i8;
    }
    (f32_to_f16(d), d, q)
}

/// Quantize activations to Q8_0 (32 per block: `d: f16`, `qs[32]: i8`).
/// `out` must be exactly `34 · x.len() / 32` bytes. Byte-identical to
/// ggml's x86 `quantize_row_q8_0` (see [`q8_block`] for the rounding rule).
pub fn quantize_row_q8_0(x: &[f32], out: &mut [u8]) {
    check_act("quantize_row_q8_0", ActType::Q8_0, x.len(), out.len());
    for (xb, ob) in x.chunks_exact(32).zip(out.chunks_exact_mut(34)) {
        let (d16, _, q) = q8_block(xb);
        ob[0..2].copy_from_slice(&d16.to_le_bytes());
        for j in 0..32 {
            ob[2 + j] = q[j] as u8;
        }
    }
}

/// Quantize activations to Q8_1 (32 per block: `d: f16`, `s: f16`,
/// `qs[32]: i8`), where `s = f16(d · Σ qs)` with the f32 (unrounded) `d`.
/// `out` must be exactly `36 · x.len() / 32` bytes. Byte-identical to
/// ggml's x86 `quantize_row_q8_1`.
pub fn quantize_row_q8_1(x: &[f32], out: &mut [u8]) {
    check_act("quantize_row_q8_1", ActType::Q8_1, x.len(), out.len());
    for (xb, ob) in x.chunks_exact(32).zip(out.chunks_exact_mut(36)) {
        let (d16, d, q) = q8_block(xb);
        let sum: i32 = q.iter().map(|&v| v as i32).sum();
        ob[0..2].copy_from_slice(&d16.to_le_bytes());
        ob[2..4].copy_from_slice(&f32_to_f16(d * sum as f32).to_le_bytes());
        for j in 0..32 {
            ob[4 + j] = q[j] as u8;
        }
    }
}

/// Quantize activations to Q8_K (256 per block: `d: f32`, `qs[256]: i8`,
/// `bsums[16]: i16`). `out` must be exactly `292 · x.len() / 256` bytes.
///
/// Per block: `max` is the first element of largest magnitude (sign kept),
/// `iscale = −127 / max`, `q = min(127, round_half_even(iscale · x))`,
/// `d = 1 / iscale`, `bsums[k] = Σ q[16k..16k+16]`. An all-zero block gets
/// `d = 0`, zero quants and zero `bsums` (ggml leaves `bsums` unwritten in
/// that case; the dot product multiplies them by `d = 0`).
/// This is byte-identical to ggml's `quantize_row_q8_K` (which on x86 is the
/// reference routine; its `nearest_int` rounds halves to even).
pub fn quantize_row_q8_k(x: &[f32], out: &mut [u8]) {
    check_act("quantize_row_q8_k", ActType::Q8K, x.len(), out.len());
    for (xb, ob) in x.chunks_exact(256).zip(out.chunks_exact_mut(292)) {
        let mut amax = 0.0f32;
        let mut max = 0.0f32;
        for &v in xb {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        if amax == 0.0 {
            ob.fill(0);
            continue;
        }
        let iscale = -127.0f32 / max;
        let mut q = [0i8; 256];
        for (qj, &xj) in q.iter_mut().zip(xb) {
            *qj = (iscale * xj).round_ties_even().clamp(-128.0, 127.0) as i8;
        }
        ob[0..4].copy_from_slice(&(1.0 / iscale).to_le_bytes());
        for j in 0..256 {
            ob[4 + j] = q[j] as u8;
        }
        for k in 0..16 {
            let s: i32 = q[16 * k..16 * k + 16].iter().map(|&v| v as i32).sum();
            ob[260 + 2 * k..262 + 2 * k].copy_from_slice(&(s as i16).to_le_bytes());
        }
    }
}

// ---------------------------------------------------------------------------
// Dot products
// ---------------------------------------------------------------------------

/// Reference dot product of a weight row (`n` elements of `dtype` in `w`)
/// with f32 activations `x`: dequantize the weights exactly (as
/// [`dequantize_row`]), then accumulate `w_i · x_i` in f64.
pub fn dot_ref(dtype: DType, n: usize, w: &[u8], x: &[f32]) -> f32 {
    check_row("dot_ref (weights)", dtype, n, w.len());
    assert!(
        x.len() == n,
        "dot_ref: expected {n} activations, got {}",
        x.len()
    );
    // Dequantize a whole number of blocks at a time (256 elements for every
    // type), so no row-sized buffer is needed.
    let bl = dtype.block_len();
    let chunk = 256 / bl * bl;
    let chunk_bytes = dtype.row_bytes(chunk);
    let mut buf = [0f32; 256];
    let mut sum = 0f64;
    for (wc, xc) in w.chunks(chunk_bytes).zip(x.chunks(chunk)) {
        let y = &mut buf[..xc.len()];
        dequantize_row(dtype, wc, y);
        sum += y
            .iter()
            .zip(xc)
            .map(|(&a, &b)| a as f64 * b as f64)
            .sum::<f64>();
    }
    sum as f32
}

/// Reference *quantized* dot product of a weight row (`n` elements of
/// `dtype` in `w`) with activations already converted to the partner format
/// [`ActType::for_weight`]`(dtype)` (`act`, e.g. by [`quantize_act_row`]).
///
/// This is the scalar model of ggml's `vec_dot` kernels: per block, the
/// integer products of the quants are summed exactly in i32, and the block's
/// float scales are applied afterwards, in f32, in the same order as ggml:
/// * Q4_0/Q5_0/Q8_0 × Q8_0: `(dw·da) · Σ qw·qa` (`qw` with its offset removed).
/// * Q4_1/Q5_1 × Q8_1: `(dw·da) · Σ qw·qa + m · s` (`s` = the Q8_1 block sum).
/// * Q4_K/Q5_K × Q8_K: `(dw·da) · Σ_sub sc·Σ qw·qa − (dmin·da) · Σ_k m_{k/2}·bsums_k`.
/// * Q6_K × Q8_K: `(dw·da) · Σ_sub sc·Σ qw·qa` (signed 6-bit `qw`).
/// * Q2_K × Q8_K: `(dw·da) · Σ_sub sc·Σ qw·qa − (dmin·da) · Σ_sub m·bsums`.
/// * Q3_K × Q8_K: `(dw·da) · Σ_sub (sc − 32)·Σ qw·qa` (`qw` in −4..4).
/// * IQ4_NL × Q8_0: `(dw·da) · Σ v·qa` (`v` the grid values).
/// * IQ4_XS × Q8_K: `(dw·da) · Σ_sub (ls − 32)·Σ v·qa`.
/// * F32/F16/BF16: exact products of the (converted) values.
///
/// The per-block results are accumulated in f64 (ggml uses f32 lanes; the
/// difference is float summation order/rounding only).
pub fn dot_q_ref(dtype: DType, n: usize, w: &[u8], act: &[u8]) -> f32 {
    check_row("dot_q_ref (weights)", dtype, n, w.len());
    let at = ActType::for_weight(dtype);
    check_act("dot_q_ref (activations)", at, n, act.len());
    let (bw, ba) = (dtype.block_bytes(), at.block_bytes());
    let block_fn: fn(&[u8], &[u8]) -> f64 = match dtype {
        DType::F32 => |w, a| read_f32(w, 0) as f64 * read_f32(a, 0) as f64,
        DType::F16 => |w, a| read_f16(w, 0) as f64 * read_f16(a, 0) as f64,
        DType::BF16 => |w, a| {
            let wv = bf16_to_f32(u16::from_le_bytes([w[0], w[1]]));
            let av = bf16_to_f32(u16::from_le_bytes([a[0], a[1]]));
            wv as f64 * av as f64
        },
        DType::Q4_0 => vec_dot_q4_0_q8_0,
        DType::Q4_1 => vec_dot_q4_1_q8_1,
        DType::Q5_0 => vec_dot_q5_0_q8_0,
        DType::Q5_1 => vec_dot_q5_1_q8_1,
        DType::Q8_0 => vec_dot_q8_0_q8_0,
        DType::Q2K => vec_dot_q2_k_q8_k,
        DType::Q3K => vec_dot_q3_k_q8_k,
        DType::Q4K => vec_dot_q4_k_q8_k,
        DType::Q5K => vec_dot_q5_k_q8_k,
        DType::Q6K => vec_dot_q6_k_q8_k,
        DType::IQ4NL => vec_dot_iq4_nl_q8_0,
        DType::IQ4XS => vec_dot_iq4_xs_q8_k,
    };
    let mut sum = 0f64;
    for (wb, ab) in w.chunks_exact(bw).zip(act.chunks_exact(ba)) {
        sum += block_fn(wb, ab);
    }
    sum as f32
}

/// The i8 quants of a Q8_0 block (`d`, then `qs[32]`).
#[inline]
fn q8_0_qs(a: &[u8]) -> impl Iterator<Item = i32> + '_ {
    a[2..34].iter().map(|&v| v as i8 as i32)
}

/// The i8 quants of a Q8_1 block (`d`, `s`, then `qs[32]`).
#[inline]
fn q8_1_qs(a: &[u8]) -> impl Iterator<Item = i32> + '_ {
    a[4..36].iter().map(|&v| v as i8 as i32)
}

/// One Q4_0 block · one Q8_0 block.
fn vec_dot_q4_0_q8_0(w: &[u8], a: &[u8]) -> f64 {
    let qs = &w[2..18];
    let qw = (0..32).map(|i| if i < 16 { qs[i] & 0x0f } else { qs[i - 16] >> 4 } as i32 - 8);
    let isum: i32 = qw.zip(q8_0_qs(a)).map(|(x, y)| x * y).sum();
    let d = read_f16(w, 0) * read_f16(a, 0);
    (d * isum as f32) as f64
}

/// One Q4_1 block · one Q8_1 block.
fn vec_dot_q4_1_q8_1(w: &[u8], a: &[u8]) -> f64 {
    let qs = &w[4..20];
    let qw = (0..32).map(|i| if i < 16 { qs[i] & 0x0f } else { qs[i - 16] >> 4 } as i32);
    let isum: i32 = qw.zip(q8_1_qs(a)).map(|(x, y)| x * y).sum();
    let d = read_f16(w, 0) * read_f16(a, 0);
    let (m, s) = (read_f16(w, 2), read_f16(a, 2));
    (d * isum as f32 + m * s) as f64
}

/// One Q5_0 block · one Q8_0 block.
fn vec_dot_q5_0_q8_0(w: &[u8], a: &[u8]) -> f64 {
    let q = q5_values(read_u32(w, 2), &w[6..22]);
    let isum: i32 = q
        .iter()
        .zip(q8_0_qs(a))
        .map(|(&x, y)| (x as i32 - 16) * y)
        .sum();
    let d = read_f16(w, 0) * read_f16(a, 0);
    (d * isum as f32) as f64
}

/// One Q5_1 block · one Q8_1 block.
fn vec_dot_q5_1_q8_1(w: &[u8], a: &[u8]) -> f64 {
    let q = q5_values(read_u32(w, 4), &w[8..24]);
    let isum: i32 = q.iter().zip(q8_1_qs(a)).map(|(&x, y)| x as i32 * y).sum();
    let d = read_f16(w, 0) * read_f16(a, 0);
    let (m, s) = (read_f16(w, 2), read_f16(a, 2));
    (d * isum as f32 + m * s) as f64
}

/// One Q8_0 block · one Q8_0 block.
fn vec_dot_q8_0_q8_0(w: &[u8], a: &[u8]) -> f64 {
    let isum: i32 = q8_0_qs(w).zip(q8_0_qs(a)).map(|(x, y)| x * y).sum();
    let d = read_f16(w, 0) * read_f16(a, 0);
    (d * isum as f32) as f64
}

/// A Q8_K block's scale, quants and 16 partial sums.
fn q8_k_parts(a: &[u8]) -> (f32, [i32; 256], [i32; 16]) {
    let d = read_f32(a, 0);
    let mut q = [0i32; 256];
    for j in 0..256 {
        q[j] = a[4 + j] as i8 as i32;
    }
    let mut bsums = [0i32; 16];
    for k in 0..16 {
        bsums[k] = read_i16(a, 260 + 2 * k) as i32;
    }
    (d, q, bsums)
}

/// Shared by Q4_K/Q5_K × Q8_K: `q` are the unsigned weight quants.
fn vec_dot_k_with_mins(d: f32, dmin: f32, scales: &[u8], q: &[u8; 256], a: &[u8]) -> f64 {
    let (sc, mn) = k_scales_mins(scales);
    let (da, qa, bsums) = q8_k_parts(a);
    // Σ over the 8 sub-blocks of scale · (Σ qw·qa), exact in i32.
    let mut isum = 0i32;
    for sb in 0..8 {
        let s: i32 = (32 * sb..32 * sb + 32).map(|i| q[i] as i32 * qa[i]).sum();
        isum += sc[sb] as i32 * s;
    }
    // The min term uses the activation block sums: each 32-sub-block is two
    // 16-element bsums.
    let msum: i32 = (0..16).map(|k| bsums[k] * mn[k / 2] as i32).sum();
    let d = d * da;
    let dmin = dmin * da;
    (d * isum as f32 - dmin * msum as f32) as f64
}

/// One Q4_K super-block · one Q8_K block.
fn vec_dot_q4_k_q8_k(w: &[u8], a: &[u8]) -> f64 {
    let q = q4_k_values(&w[16..144]);
    vec_dot_k_with_mins(read_f16(w, 0), read_f16(w, 2), &w[4..16], &q, a)
}

/// One Q5_K super-block · one Q8_K block.
fn vec_dot_q5_k_q8_k(w: &[u8], a: &[u8]) -> f64 {
    let q = q5_k_values(&w[16..48], &w[48..176]);
    vec_dot_k_with_mins(read_f16(w, 0), read_f16(w, 2), &w[4..16], &q, a)
}

/// One Q6_K super-block · one Q8_K block.
fn vec_dot_q6_k_q8_k(w: &[u8], a: &[u8]) -> f64 {
    let q = q6_k_values(&w[0..128], &w[128..192]);
    let scales = &w[192..208];
    let (da, qa, _) = q8_k_parts(a);
    let mut isum = 0i32;
    for sb in 0..16 {
        let s: i32 = (16 * sb..16 * sb + 16).map(|i| q[i] as i32 * qa[i]).sum();
        isum += scales[sb] as i8 as i32 * s;
    }
    let d = read_f16(w, 208) * da;
    (d * isum as f32) as f64
}

/// One Q2_K super-block · one Q8_K block.
fn vec_dot_q2_k_q8_k(w: &[u8], a: &[u8]) -> f64 {
    let q = q2_k_values(&w[16..80]);
    let (da, qa, bsums) = q8_k_parts(a);
    let mut isum = 0i32;
    let mut msum = 0i32;
    for sb in 0..16 {
        let s: i32 = (16 * sb..16 * sb + 16).map(|i| q[i] as i32 * qa[i]).sum();
        isum += (w[sb] & 0x0f) as i32 * s;
        msum += (w[sb] >> 4) as i32 * bsums[sb];
    }
    let d = read_f16(w, 80) * da;
    let dmin = read_f16(w, 82) * da;
    (d * isum as f32 - dmin * msum as f32) as f64
}

/// One Q3_K super-block · one Q8_K block.
fn vec_dot_q3_k_q8_k(w: &[u8], a: &[u8]) -> f64 {
    let q = q3_k_values(&w[0..32], &w[32..96]);
    let sc = q3_k_scales(&w[96..108]);
    let (da, qa, _) = q8_k_parts(a);
    let mut isum = 0i32;
    for sb in 0..16 {
        let s: i32 = (16 * sb..16 * sb + 16).map(|i| q[i] as i32 * qa[i]).sum();
        isum += (sc[sb] as i32 - 32) * s;
    }
    let d = read_f16(w, 108) * da;
    (d * isum as f32) as f64
}

/// One IQ4_NL block · one Q8_0 block.
fn vec_dot_iq4_nl_q8_0(w: &[u8], a: &[u8]) -> f64 {
    let v = iq4_values(&w[2..18]);
    let isum: i32 = v.iter().zip(q8_0_qs(a)).map(|(&x, y)| x as i32 * y).sum();
    let d = read_f16(w, 0) * read_f16(a, 0);
    (d * isum as f32) as f64
}

/// One IQ4_XS super-block · one Q8_K block.
fn vec_dot_iq4_xs_q8_k(w: &[u8], a: &[u8]) -> f64 {
    let ls = iq4_xs_scales(w);
    let (da, qa, _) = q8_k_parts(a);
    let mut isum = 0i32;
    for sb in 0..8 {
        let v = iq4_values(&w[8 + 16 * sb..24 + 16 * sb]);
        let s: i32 = (0..32).map(|l| v[l] as i32 * qa[32 * sb + l]).sum();
        isum += (ls[sb] as i32 - 32) * s;
    }
    let d = read_f16(w, 0) * da;
    (d * isum as f32) as f64
}
