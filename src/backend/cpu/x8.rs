//! Quantized matrices repacked eight rows at a time at load ([`X8`]): the
//! container, the copy in and out of GGUF's row layout, and the choice of
//! a K-quant decoding kernel. The layouts and their kernels are per type:
//! [`super::q4k_x8`] (Q4_K×8 and Q5_K×8), [`super::q6k_x8`] (Q6_K×8,
//! Q3_K×8 and Q2_K×8: a scale per 16 weights), [`super::iq4xs_x8`]
//! (IQ4_XS×8),
//! [`super::b32_x8`] (Q8_0×8, Q4_0×8, Q5_0×8 and IQ4_NL×8, whose kernels take Q8_0
//! activations: `b32_x8::decode_for`) and [`super::q4_1_x8`] (Q4_1×8, Q8_1
//! activations, ggml's lanes).
//!
//! A row block (8 rows) is stored as `nb` groups, one per (super)block, each
//! holding exactly the bytes of the 8 rows' superblocks, rearranged so
//! that one 64-byte load holds 8 quants of every row (rows in the SIMD
//! lanes): a decoding kernel then sums a whole run for 8 rows with no
//! transpose, applies the scales to 8 rows at once and never reduces a
//! row's lanes. Each layout is described by one list of copies per row
//! (its `segments`), which packing and unpacking both follow, so a row always
//! comes back as GGUF stores it (tests/engine/kernels.rs).
//!
//! Every decoding kernel reads its row block front to back and asks, per
//! group, for the lines [`super::mem::ahead`] bytes on
//! ([`super::mem::prefetch_ahead`]; the next row block follows in memory,
//! so the prefetch runs on into it; the distance is chosen per CPU, 0 = the
//! hardware prefetchers alone).
//!
//! The K-quant decoding kernels reproduce `qgemm_lanes::dot_scalar` bit
//! for bit, the others `b32_x8::dot_scalar`, so a matrix gives the same
//! logits repacked or not, at every level.

use super::qgemm_lanes::{GroupMap, Q8_K_BYTES, ROWS};
use super::{b32_x8, iq4xs_x8, q4_1_x8, q4k_x8, q6k_x8};
use crate::tensor::DType;

/// A decoding kernel: `(nb, one row block's groups, one Q8_K activation
/// row) -> the 8 rows' dot products`.
pub type X8Fn = fn(usize, &[u8], &[u8]) -> [f32; ROWS];

/// The types with a repacked layout.
pub const LAYOUTS: [DType; 11] = [
    DType::Q4K,
    DType::Q5K,
    DType::Q6K,
    DType::Q8_0,
    DType::Q4_0,
    DType::Q5_0,
    DType::Q4_1,
    DType::IQ4NL,
    DType::IQ4XS,
    DType::Q3K,
    DType::Q2K,
];

/// Whether `dtype` has a repacked layout.
pub fn has_layout(dtype: DType) -> bool {
    LAYOUTS.contains(&dtype)
}

/// Whether kernel level `level` has a decoding kernel for `dtype`'s
/// layout on this CPU (what repacking a matrix at load asks).
pub fn has_kernel(dtype: DType, level: super::isa::Level) -> bool {
    decode_for(dtype, level).is_some()
        || b32_x8::decode_for(dtype, level).is_some()
        || (q4_1_x8::is_q4_1(dtype) && q4_1_x8::decode_for(level).is_some())
}

/// The 256-weight superblock types with a layout here (Q8_K activations:
/// the ones with a [`group_map`]).
const SUPERBLOCK: [DType; 6] = [
    DType::Q4K,
    DType::Q5K,
    DType::Q6K,
    DType::Q3K,
    DType::Q2K,
    DType::IQ4XS,
];

/// Whether `dtype` is one of the 256-weight superblock types with a
/// layout here (Q4_K, Q5_K, Q6_K, Q3_K, Q2_K, IQ4_XS).
pub fn is_k_quant(dtype: DType) -> bool {
    SUPERBLOCK.contains(&dtype)
}

/// Bytes of one group (8 rows × one block) of `dtype`.
pub fn group_bytes(dtype: DType) -> usize {
    ROWS * dtype.block_bytes()
}

/// The most copies a layout lists per row (Q6_K: 29).
const MAX_SEGMENTS: usize = 32;

/// Row `r`'s copies between one superblock and its group, `(offset in
/// the superblock, offset in the group, length)`, from its layout's
/// `segments`, listed once: packing and unpacking loop over this table for
/// every group instead of re-running the layout's iterator (when K-quant
/// prefill still gathered every micro tile's rows back this way, on the
/// 7B Q5_K_M that cost 4% of pp512 through the iterator and 2.3% through
/// this table; it now packs through [`group_map`], built from this list).
struct Segments {
    list: [(usize, usize, usize); MAX_SEGMENTS],
    len: usize,
}

impl Segments {
    fn of(dtype: DType, r: usize) -> Segments {
        let mut list = [(0, 0, 0); MAX_SEGMENTS];
        let mut len = 0;
        let mut push = |seg| {
            list[len] = seg;
            len += 1;
        };
        match dtype {
            DType::Q4K => q4k_x8::segments(false, r).for_each(&mut push),
            DType::Q5K => q4k_x8::segments(true, r).for_each(&mut push),
            DType::Q6K => q6k_x8::segments(r).for_each(&mut push),
            DType::IQ4XS => iq4xs_x8::segments(r).for_each(&mut push),
            DType::Q3K => q6k_x8::q3_segments(r).for_each(&mut push),
            DType::Q2K => q6k_x8::q2_segments(r).for_each(&mut push),
            d if b32_x8::is_b32(d) => b32_x8::segments(d, r).for_each(&mut push),
            DType::Q4_1 => q4_1_x8::segments(r).for_each(&mut push),
            other => panic!("x8: no repacked layout for {other}"),
        }
        Segments { list, len }
    }

    fn list(&self) -> &[(usize, usize, usize)] {
        &self.list[..self.len]
    }
}

/// The decoding kernel of a superblock `dtype`'s layout ([`is_k_quant`]) at kernel level
/// `level`, where this CPU runs it: the 512-bit one from avx512vnni, AVX2's
/// at avx2 and avx512; none below AVX2 or for another type.
pub fn decode_for(dtype: DType, level: super::isa::Level) -> Option<X8Fn> {
    #[cfg(target_arch = "x86_64")]
    {
        use q6k_x8::{Q2k, Q3k, Q6k};
        let pick = |vnni: X8Fn, avx2: X8Fn| super::isa::vnni_or_avx2(level, vnni, avx2);
        match dtype {
            DType::Q4K => pick(decode::<Q45k<false>, true>, decode::<Q45k<false>, false>),
            DType::Q5K => pick(decode::<Q45k<true>, true>, decode::<Q45k<true>, false>),
            DType::Q6K => pick(decode::<Sub<Q6k>, true>, decode::<Sub<Q6k>, false>),
            DType::Q3K => pick(decode::<Sub<Q3k>, true>, decode::<Sub<Q3k>, false>),
            DType::Q2K => pick(decode::<Sub<Q2k>, true>, decode::<Sub<Q2k>, false>),
            DType::IQ4XS => pick(decode::<Iq4xs, true>, decode::<Iq4xs, false>),
            _ => None,
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (dtype, level);
        None
    }
}

/// A layout's two decoding kernels, over raw pointers.
///
/// # Safety (of both)
/// The CPU has AVX2, FMA and F16C, and for `vnni` AVX-512 F/BW/VL and
/// VNNI; `x` holds `nb` groups of `GROUP_BYTES`, `y` `nb` Q8_K blocks.
#[cfg(target_arch = "x86_64")]
trait Kernels {
    const GROUP_BYTES: usize;
    unsafe fn vnni(nb: usize, x: *const u8, y: *const u8) -> [f32; ROWS];
    unsafe fn avx2(nb: usize, x: *const u8, y: *const u8) -> [f32; ROWS];
}

/// Q4_K×8 (`Q5` false) or Q5_K×8.
#[cfg(target_arch = "x86_64")]
struct Q45k<const Q5: bool>;
/// Q6_K×8, Q3_K×8 or Q2_K×8 (`q6k_x8`'s shared kernels).
#[cfg(target_arch = "x86_64")]
struct Sub<T>(std::marker::PhantomData<T>);
#[cfg(target_arch = "x86_64")]
struct Iq4xs;

#[cfg(target_arch = "x86_64")]
impl<const Q5: bool> Kernels for Q45k<Q5> {
    const GROUP_BYTES: usize = q4k_x8::group_bytes(Q5);
    unsafe fn vnni(nb: usize, x: *const u8, y: *const u8) -> [f32; ROWS] {
        // SAFETY: the trait's contract is the kernel's.
        unsafe { q4k_x8::decode_vnni::<Q5>(nb, x, y) }
    }
    unsafe fn avx2(nb: usize, x: *const u8, y: *const u8) -> [f32; ROWS] {
        // SAFETY: the trait's contract is the kernel's.
        unsafe { q4k_x8::decode_avx2::<Q5>(nb, x, y) }
    }
}

#[cfg(target_arch = "x86_64")]
impl<T: q6k_x8::Sub16> Kernels for Sub<T> {
    const GROUP_BYTES: usize = T::GROUP_BYTES;
    unsafe fn vnni(nb: usize, x: *const u8, y: *const u8) -> [f32; ROWS] {
        // SAFETY: the trait's contract is the kernel's.
        unsafe { q6k_x8::decode_vnni::<T>(nb, x, y) }
    }
    unsafe fn avx2(nb: usize, x: *const u8, y: *const u8) -> [f32; ROWS] {
        // SAFETY: the trait's contract is the kernel's.
        unsafe { q6k_x8::decode_avx2::<T>(nb, x, y) }
    }
}

#[cfg(target_arch = "x86_64")]
impl Kernels for Iq4xs {
    const GROUP_BYTES: usize = iq4xs_x8::GROUP_BYTES;
    unsafe fn vnni(nb: usize, x: *const u8, y: *const u8) -> [f32; ROWS] {
        // SAFETY: the trait's contract is the kernel's.
        unsafe { iq4xs_x8::decode_vnni(nb, x, y) }
    }
    unsafe fn avx2(nb: usize, x: *const u8, y: *const u8) -> [f32; ROWS] {
        // SAFETY: the trait's contract is the kernel's.
        unsafe { iq4xs_x8::decode_avx2(nb, x, y) }
    }
}

/// The checked entry of a layout's kernels (what `decode_for` hands out).
#[cfg(target_arch = "x86_64")]
fn decode<K: Kernels, const VNNI: bool>(nb: usize, groups: &[u8], y: &[u8]) -> [f32; ROWS] {
    assert!(
        groups.len() >= nb * K::GROUP_BYTES && y.len() >= nb * Q8_K_BYTES,
        "x8 decode: short operands"
    );
    // SAFETY: handed out by `decode_for` only where `vnni_or_avx2` found
    // the CPU has the kernel's features (AVX2, FMA, F16C; AVX-512 F/BW/VL
    // and VNNI for the VNNI one); the lengths (checked above) bound every
    // load.
    unsafe {
        if VNNI {
            K::vnni(nb, groups.as_ptr(), y.as_ptr())
        } else {
            K::avx2(nb, groups.as_ptr(), y.as_ptr())
        }
    }
}

/// A matrix of `n_out` rows (a multiple of 8) × `nb` blocks (K-quants:
/// superblocks), repacked: `n_out / 8` row blocks of `nb` groups, 64-byte
/// aligned.
pub struct X8 {
    buf: Vec<u8>,
    off: usize,
    /// One of [`LAYOUTS`].
    pub dtype: DType,
    /// Blocks per row.
    pub nb: usize,
    /// Rows.
    pub n_out: usize,
}

impl std::fmt::Debug for X8 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}×8({}x{} superblocks)",
            self.dtype, self.n_out, self.nb
        )
    }
}

impl X8 {
    /// Repack `src`, `n_out` rows of `nb` superblocks of `dtype` each
    /// (row-major, as GGUF stores them); `n_out` must be a multiple of 8.
    pub fn new(dtype: DType, src: &[u8], n_out: usize, nb: usize) -> X8 {
        assert!(has_layout(dtype), "x8: no repacked layout for {dtype}");
        assert!(n_out.is_multiple_of(ROWS), "{dtype}×8: {n_out} rows");
        let sb = dtype.block_bytes();
        let rb = nb * sb;
        assert_eq!(src.len(), n_out * rb, "{dtype}×8: matrix bytes");
        let len = src.len();
        // untouched zero pages (calloc), asked to come as transparent huge
        // pages: a 7B's load went from 7.3 to 5.7 s on a VM, where faulting
        // the new memory in dominates
        let mut buf = vec![0u8; len + 63];
        super::mem::advise_huge(buf.as_ptr() as usize, buf.len());
        let off = buf.as_ptr().align_offset(64).min(63);
        let dst = &mut buf[off..off + len];
        let (gb, block) = (group_bytes(dtype), ROWS * rb);
        let segs: [Segments; ROWS] = std::array::from_fn(|r| Segments::of(dtype, r));
        let pack_blocks = |first: usize, out: &mut [u8]| {
            for (i, out) in out.chunks_exact_mut(block).enumerate() {
                let r0 = (first + i) * ROWS;
                for (b, g) in out.chunks_exact_mut(gb).enumerate() {
                    for (r, segs) in segs.iter().enumerate() {
                        let x = &src[(r0 + r) * rb + b * sb..][..sb];
                        for &(at, to, n) in segs.list() {
                            copy_small(&mut g[to..to + n], &x[at..at + n]);
                        }
                    }
                }
            }
        };
        // the page faults of the new memory dominate: spread them over the
        // cores for a large matrix
        let n_blocks = n_out / ROWS;
        let threads = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(8);
        if threads > 1 && len >= 8 << 20 {
            let per = n_blocks.div_ceil(threads);
            std::thread::scope(|s| {
                for (t, part) in dst.chunks_mut(per * block).enumerate() {
                    let pack_blocks = &pack_blocks;
                    s.spawn(move || pack_blocks(t * per, part));
                }
            });
        } else {
            pack_blocks(0, dst);
        }
        X8 {
            buf,
            off,
            dtype,
            nb,
            n_out,
        }
    }

    /// All groups, `(n_out / 8, nb, group bytes)`.
    pub fn bytes(&self) -> &[u8] {
        &self.buf[self.off..self.off + self.n_out * self.nb * self.dtype.block_bytes()]
    }

    /// The `nb` groups of row block `blk` (rows 8·blk..8·blk + 8).
    pub fn block(&self, blk: usize) -> &[u8] {
        let bb = self.nb * group_bytes(self.dtype);
        &self.bytes()[blk * bb..(blk + 1) * bb]
    }

    /// Row `r` as GGUF stores it (`nb` superblocks) into `out`.
    pub fn row_into(&self, r: usize, out: &mut [u8]) {
        self.superblocks_into(r, 0, self.nb, out);
    }

    /// The 8 rows of row block `blk` as GGUF stores them, row `8·blk + r`
    /// at `out[r · stride..]`: the group-at-a-time transpose for Q4_1
    /// where the CPU has one, row by row otherwise.
    pub fn block_rows_into(&self, blk: usize, out: &mut [u8], stride: usize) {
        let groups = self.block(blk);
        if q4_1_x8::is_q4_1(self.dtype) && q4_1_x8::unpack_rows(self.nb, groups, out, stride) {
            return;
        }
        if is_k_quant(self.dtype) {
            return self.block_superblocks_into(blk, 0, self.nb, out, stride);
        }
        let rb = self.nb * self.dtype.block_bytes();
        for r in 0..ROWS {
            unpack(
                self.dtype,
                groups,
                r,
                self.nb,
                &mut out[r * stride..r * stride + rb],
            );
        }
    }

    /// Row block `blk` of a Q4_0, Q5_0 or (`signed` only) Q8_0 or IQ4_NL matrix as
    /// its 8 rows of Q8_0-shaped blocks (`signed`: the Q8_0 form, else the
    /// unsigned quants; `b32_x8::row_to_q8_0_at` / `row_to_unsigned_at` at
    /// `level`), row `8·blk + r` at `out[r · stride..]`: straight from the
    /// groups from AVX2 up (`b32_x8::block_to_q8_0_at`), each row unpacked
    /// and expanded below it.
    pub fn block_to_q8_0_at(
        &self,
        blk: usize,
        level: super::isa::Level,
        out: &mut [u8],
        stride: usize,
        signed: bool,
    ) {
        let (dt, nb, groups) = (self.dtype, self.nb, self.block(blk));
        if b32_x8::block_to_q8_0_at(level, dt, nb, groups, out, stride, signed) {
            return;
        }
        let mut row = vec![0u8; nb * dt.block_bytes()];
        let qrb = nb * b32_x8::Q8_0_BYTES;
        for r in 0..ROWS {
            unpack(dt, groups, r, nb, &mut row);
            let dst = &mut out[r * stride..r * stride + qrb];
            if signed {
                b32_x8::row_to_q8_0_at(level, dt, nb, &row, dst);
            } else {
                b32_x8::row_to_unsigned_at(level, dt, nb, &row, dst);
            }
        }
    }

    /// Superblocks `s0..s0 + k` of the 8 rows of row block `blk` of a
    /// K-quant matrix as GGUF stores them, row `8·blk + r` at `out[r ·
    /// stride..]`: from AVX2 up a group at a time through the type's
    /// [`group_map`] (`GroupMap::unpack`: a chunk's 8 rows in a few
    /// shuffles), row by row along the copy list below it. The AMX
    /// prefill gathers its panels this way: the copy list alone took three
    /// times as long as expanding the gathered rows for the tiles.
    pub fn block_superblocks_into(
        &self,
        blk: usize,
        s0: usize,
        k: usize,
        out: &mut [u8],
        stride: usize,
    ) {
        let (dt, sb) = (self.dtype, self.dtype.block_bytes());
        assert!(is_k_quant(dt), "x8: {dt} has no group map");
        assert!(
            blk < self.n_out / ROWS
                && s0 + k <= self.nb
                && stride >= k * sb
                && out.len() >= (ROWS - 1) * stride + k * sb,
            "x8: short superblock gather"
        );
        let groups = &self.block(blk)[s0 * group_bytes(dt)..];
        #[cfg(target_arch = "x86_64")]
        if super::isa::detected() >= super::isa::Level::Avx2 {
            let map = group_map(dt);
            let o = out.as_mut_ptr();
            for b in 0..k {
                // SAFETY: the CPU has AVX2; group b lies in `groups` (s0 + k
                // ≤ nb) and row r's superblock b at r·stride + b·sb in `out`
                // (asserted above), disjoint.
                unsafe {
                    map.unpack(
                        groups[b * group_bytes(dt)..].as_ptr(),
                        std::array::from_fn(|r| o.add(r * stride + b * sb)),
                    )
                };
            }
            return;
        }
        for r in 0..ROWS {
            unpack(dt, groups, r, k, &mut out[r * stride..r * stride + k * sb]);
        }
    }

    /// Superblocks `s0..s0 + k` of row `r` as GGUF stores them into `out`.
    pub fn superblocks_into(&self, r: usize, s0: usize, k: usize, out: &mut [u8]) {
        assert!(r < self.n_out && s0 + k <= self.nb);
        let groups = &self.block(r / ROWS)[s0 * group_bytes(self.dtype)..];
        unpack(self.dtype, groups, r % ROWS, k, out);
    }
}

/// Where superblock `dtype`'s layout (Q4_K, Q5_K, Q6_K, Q3_K, Q2_K, IQ4_XS) keeps every byte of
/// the 8 rows' superblocks in a group, for the prefill's packing straight
/// from a row block (`qgemm_lanes::PackX8Fn`): read from the same copy
/// list as packing and unpacking, checked one to one by `GroupMap::new`,
/// and built once per type (prefill asks for it on every product).
pub fn group_map(dtype: DType) -> &'static GroupMap {
    static MAPS: [std::sync::OnceLock<GroupMap>; SUPERBLOCK.len()] =
        [const { std::sync::OnceLock::new() }; SUPERBLOCK.len()];
    let i = SUPERBLOCK
        .iter()
        .position(|&d| d == dtype)
        .unwrap_or_else(|| panic!("x8: no group map for {dtype}"));
    MAPS[i].get_or_init(|| build_group_map(dtype))
}

fn build_group_map(dtype: DType) -> GroupMap {
    let sb = dtype.block_bytes();
    let mut at = vec![[usize::MAX; ROWS]; sb];
    for r in 0..ROWS {
        for &(from, to, n) in Segments::of(dtype, r).list() {
            for i in 0..n {
                at[from + i][r] = to + i;
            }
        }
    }
    GroupMap::new(dtype, |r, b| at[b][r])
}

/// Row `r` (< 8) of the first `k` groups of `groups` into `out`, `k`
/// superblocks as GGUF stores them.
fn unpack(dtype: DType, groups: &[u8], r: usize, k: usize, out: &mut [u8]) {
    let (sb, gb) = (dtype.block_bytes(), group_bytes(dtype));
    assert!(
        groups.len() >= k * gb && out.len() >= k * sb,
        "x8: short unpack"
    );
    let segs = Segments::of(dtype, r);
    for (g, x) in groups
        .chunks_exact(gb)
        .zip(out.chunks_exact_mut(sb))
        .take(k)
    {
        for &(at, from, n) in segs.list() {
            copy_small(&mut x[at..at + n], &g[from..from + n]);
        }
    }
}

/// `dst.copy_from_slice(src)` with the segments' lengths (8, 4, 2 bytes)
/// as fixed-size moves rather than calls to `memcpy`: prefill gathers
/// every row of a repacked matrix back this way.
#[inline(always)]
fn copy_small(dst: &mut [u8], src: &[u8]) {
    match src.len() {
        8 => dst[..8].copy_from_slice(&src[..8]),
        4 => dst[..4].copy_from_slice(&src[..4]),
        2 => dst[..2].copy_from_slice(&src[..2]),
        _ => dst.copy_from_slice(src),
    }
}

/// Scalar model of a decoding call: each of the row block's 8 rows
/// unpacked and run through `qgemm_lanes::dot_scalar` (K-quants, Q8_K
/// activations), `b32_x8::dot_scalar` (Q8_0 activations) or
/// `q4_1_x8::dot_scalar` (Q8_1 activations).
pub fn decode_scalar(dtype: DType, nb: usize, groups: &[u8], y: &[u8]) -> [f32; ROWS] {
    let mut row = vec![0u8; nb * dtype.block_bytes()];
    std::array::from_fn(|r| {
        unpack(dtype, groups, r, nb, &mut row);
        if b32_x8::is_b32(dtype) {
            b32_x8::dot_scalar(dtype, nb, &row, y)
        } else if q4_1_x8::is_q4_1(dtype) {
            q4_1_x8::dot_scalar(nb, &row, y)
        } else {
            super::qgemm_lanes::dot_scalar(dtype, nb, &row, y)
        }
    })
}
