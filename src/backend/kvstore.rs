//! What the K/V storage of any backend offers the layers above it.
//!
//! - [`KvType`]: how K and V values are stored (`--cache-type`), with
//!   ggml's q8_0 block format.
//! - [`KvStore`]: a backend-owned array of K rows and V rows (CPU memory
//!   today, device memory later). The cache's metadata decides which row a
//!   token's (layer, head) values go to; the store converts on write and
//!   on read. Readers (scorers that rank by keys or values) fetch rows
//!   through it, in batches, never by borrowing its memory.
//! - [`KvAccess`]: the cache metadata as the backend's attention sees it
//!   (which rows each KV head of a layer attends over), implemented by
//!   `crate::kv::KvCache`.

use crate::error::{Error, Result};
use half::f16;

/// Storage type of cached K and V (`--cache-type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum KvType {
    F32,
    #[default]
    F16,
    /// ggml q8_0: blocks of 32 values, f16 scale d, x = d * q (q in -127..=127).
    Q8_0,
}

impl KvType {
    /// Every type, in `--cache-type` order.
    pub const ALL: [KvType; 3] = [KvType::F32, KvType::F16, KvType::Q8_0];

    /// Name as `--cache-type` spells it.
    pub fn name(self) -> &'static str {
        match self {
            KvType::F32 => "f32",
            KvType::F16 => "f16",
            KvType::Q8_0 => "q8_0",
        }
    }

    /// Parse a `--cache-type` value.
    pub fn parse(s: &str) -> Result<KvType> {
        KvType::ALL
            .into_iter()
            .find(|t| t.name() == s)
            .ok_or_else(|| {
                Error::arg(
                    "--cache-type",
                    format!("unknown cache type '{s}' (known: f32, f16, q8_0)"),
                )
            })
    }

    /// Values per storage unit (1, or 32 per q8_0 block).
    pub fn block_len(self) -> usize {
        match self {
            KvType::Q8_0 => QK8_0,
            _ => 1,
        }
    }

    /// Bytes of one row of `n` values (`n` a multiple of `block_len`).
    pub fn row_bytes(self, n: usize) -> usize {
        match self {
            KvType::F32 => 4 * n,
            KvType::F16 => 2 * n,
            KvType::Q8_0 => n / QK8_0 * std::mem::size_of::<BlockQ8_0>(),
        }
    }
}

impl std::fmt::Display for KvType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Values per q8_0 block.
pub const QK8_0: usize = 32;

/// One q8_0 block, ggml's `block_q8_0`: 34 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct BlockQ8_0 {
    /// Scale: x = d * q.
    pub d: f16,
    /// Quantized values.
    pub qs: [i8; QK8_0],
}

/// Quantize x (n) into n/32 blocks as ggml's `quantize_row_q8_0_ref` does:
/// d = max|x| / 127, q = round(x / d).
pub fn quantize_q8_0(x: &[f32], out: &mut [BlockQ8_0]) {
    for (b, xb) in out.iter_mut().zip(x.chunks_exact(QK8_0)) {
        let amax = xb.iter().fold(0f32, |m, &v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        b.d = f16::from_f32(d);
        for (q, &v) in b.qs.iter_mut().zip(xb) {
            *q = (v * id).round() as i8;
        }
    }
}

/// Dequantize blocks into out (32 per block).
#[inline]
pub fn dequantize_q8_0(b: &[BlockQ8_0], out: &mut [f32]) {
    for (blk, o) in b.iter().zip(out.chunks_exact_mut(QK8_0)) {
        let d = blk.d.to_f32();
        for (y, &q) in o.iter_mut().zip(&blk.qs) {
            *y = q as f32 * d;
        }
    }
}

/// The keys one KV head of one layer attends over: live slots, their
/// positions, and where head `g`'s row of slot `s` starts in `layer()`'s
/// storage (`s * stride + off`, in storage units).
#[derive(Clone, Copy, Debug)]
pub struct HeadView<'a> {
    pub slots: &'a [u32],
    pub pos: &'a [i64],
    pub stride: usize,
    pub off: usize,
}

/// A backend-owned K/V store: `n_rows` rows of `row_vals` values for K and
/// for V, in one `KvType`.
pub trait KvStore: std::fmt::Debug + Send + Sync {
    /// Storage type.
    fn ty(&self) -> KvType;
    /// Rows held.
    fn n_rows(&self) -> usize;
    /// Values per row.
    fn row_vals(&self) -> usize;
    /// Convert and store `k` and `v` at values `off..off + k.len()` of row `row`.
    fn write(&mut self, row: usize, off: usize, k: &[f32], v: &[f32]);
    /// Read values `off..off + len` of K (`key`) or V rows `base + rows[i]`
    /// as f32 into `out` ((rows.len(), len), row-major).
    fn read(&self, key: bool, base: usize, rows: &[u32], off: usize, len: usize, out: &mut [f32]);
    /// A copy of the store (same type and contents).
    fn clone_box(&self) -> Box<dyn KvStore>;
    /// A store of the same type with `n_rows` rows (zeroed) holding, for
    /// each `(from, to)` of `moves`, this store's row `from` at row `to`,
    /// copied as stored (no re-quantization). Growing for a transient
    /// prompt, shrinking back to a budget after compressing it.
    fn resized(&self, n_rows: usize, moves: &[(u32, u32)]) -> Box<dyn KvStore>;
    /// For the backend that made it: its concrete type.
    fn as_any(&self) -> &dyn std::any::Any;
}

impl Clone for Box<dyn KvStore> {
    fn clone(&self) -> Self {
        self.clone_box()
    }
}

/// The cache as attention reads it: the live rows of each KV head of each
/// layer, and the store they are in.
pub trait KvAccess: Sync {
    /// The entries KV head `g` of `layer` attends over, by position or
    /// (`memory_order`) by row.
    fn head(&self, layer: usize, g: usize, memory_order: bool) -> HeadView<'_>;
    /// Layers the cache holds.
    fn n_layers(&self) -> usize;
    /// Positions of the live entries in position order (token-uniform
    /// layout; the shared list).
    fn live_positions(&self) -> &[i64];
    /// Slots (token-uniform) or pool rows (streams): the length of the
    /// per-slot attention mass.
    fn n_slots(&self) -> usize;
    /// First store row of `layer` (`HeadView` slots are relative to it).
    fn layer_base(&self, layer: usize) -> usize;
    /// The K/V storage.
    fn store(&self) -> &dyn KvStore;
    /// Where a step's K/V values go, for a backend that writes them
    /// itself: for each token `i < n` and KV head `g`, in that order
    /// (`out[i · n_kv_heads + g]`), the storage unit (value, or q8_0 block)
    /// of the store where head `g`'s row of token `i` starts (`slots` as
    /// the cache assigned them, as `write_token` reads them).
    fn write_units(&self, layer: usize, n: usize, slots: &[u32], out: &mut Vec<u64>);
    /// Store token `i` of a step of `n` tokens (`slots` as the cache
    /// assigned them) for `layer`: K and V rows of kv_dim.
    fn write_token(
        &mut self,
        layer: usize,
        i: usize,
        n: usize,
        slots: &[u32],
        k: &[f32],
        v: &[f32],
    );
}
