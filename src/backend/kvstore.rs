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
    /// Rearrange rows in place, all `(from, to)` of `moves` at once: row
    /// `to` takes what row `from` held, copied as stored (`from`s distinct,
    /// `to`s distinct; rows that are no move's `to` keep their contents or
    /// not, as the backend finds cheapest). Compacting a fragmented cache.
    fn permute(&mut self, moves: &[(u32, u32)]);
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

/// The order of single-row copies that carries out `moves` (all at once,
/// as `KvStore::permute` means them) in place, over rows `0..n_rows`:
/// `(from, to)` copies row `from` to row `to`, and `TEMP` on either side
/// is one spare row. Every chain of moves is walked from its free end
/// (a `to` nobody reads), so no row is overwritten before it is read; a
/// cycle first saves one of its rows in the spare. Moves with
/// `from == to` need no copy and are left out.
pub fn permutation_plan(moves: &[(u32, u32)], n_rows: usize) -> Vec<(u32, u32)> {
    const NONE: u32 = u32::MAX;
    // where each row's new contents come from, and whether a row still
    // has contents some move needs
    let mut src_of = vec![NONE; n_rows];
    let mut needed = vec![false; n_rows];
    for &(f, t) in moves {
        if f != t {
            src_of[t as usize] = f;
            needed[f as usize] = true;
        }
    }
    let mut plan = Vec::with_capacity(moves.len() + 1);
    // chains: start at every target whose own contents nobody needs
    for &(f, t) in moves {
        if f == t || needed[t as usize] || src_of[t as usize] == NONE {
            continue;
        }
        let mut cur = t as usize;
        while src_of[cur] != NONE {
            let from = src_of[cur];
            plan.push((from, cur as u32));
            src_of[cur] = NONE;
            needed[from as usize] = false;
            cur = from as usize;
        }
    }
    // what is left are cycles: every target is also a needed source
    for &(_, t) in moves {
        if src_of[t as usize] == NONE {
            continue;
        }
        plan.push((t, TEMP));
        let mut cur = t as usize;
        loop {
            let from = src_of[cur];
            src_of[cur] = NONE;
            if from == t {
                plan.push((TEMP, cur as u32));
                break;
            }
            plan.push((from, cur as u32));
            cur = from as usize;
        }
    }
    plan
}

/// The spare row of a `permutation_plan`.
pub const TEMP: u32 = u32::MAX;

#[cfg(test)]
mod permutation_tests {
    use super::*;
    use crate::rng::Rng;

    /// Apply `moves` at once to a row → value table, directly.
    fn direct(rows: &[u64], moves: &[(u32, u32)]) -> Vec<u64> {
        let mut out = rows.to_vec();
        for &(f, t) in moves {
            out[t as usize] = rows[f as usize];
        }
        out
    }

    fn run_plan(rows: &[u64], plan: &[(u32, u32)]) -> Vec<u64> {
        let mut out = rows.to_vec();
        let mut temp = 0;
        for &(f, t) in plan {
            let x = if f == TEMP { temp } else { out[f as usize] };
            if t == TEMP {
                temp = x;
            } else {
                out[t as usize] = x;
            }
        }
        out
    }

    #[test]
    fn plan_carries_out_moves_in_place() {
        // hand-made: a swap (cycle of 2), a chain into a free row, a fixed point
        let rows: Vec<u64> = (0..6).map(|i| 100 + i).collect();
        let moves = [(0, 1), (1, 0), (3, 2), (4, 3), (5, 5)];
        let plan = permutation_plan(&moves, 6);
        let got = run_plan(&rows, &plan);
        let want = direct(&rows, &moves);
        for &(_, t) in &moves {
            assert_eq!(got[t as usize], want[t as usize], "row {t}");
        }
        // 2 copies for the chain, 3 for the swap (through the spare)
        assert_eq!(plan.len(), 5, "{plan:?}");
        // random partial permutations: packing live rows to the front in a
        // shuffled order, as compaction does
        let mut rng = Rng::new(7);
        for case in 0..200 {
            let n = 1 + (rng.next_u64() % 64) as usize;
            let mut live: Vec<u32> = (0..n as u32).filter(|_| rng.next_u64() % 3 != 0).collect();
            // shuffle (Fisher–Yates)
            for i in (1..live.len()).rev() {
                live.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
            }
            let moves: Vec<(u32, u32)> = live
                .iter()
                .enumerate()
                .map(|(k, &f)| (f, k as u32))
                .collect();
            let rows: Vec<u64> = (0..n as u64).map(|i| i * 31 + 7).collect();
            let plan = permutation_plan(&moves, n);
            let got = run_plan(&rows, &plan);
            let want = direct(&rows, &moves);
            for &(f, t) in &moves {
                assert_eq!(got[t as usize], want[t as usize], "case {case}: {f} -> {t}");
            }
            let moved = moves.iter().filter(|(f, t)| f != t).count();
            assert!(
                plan.len() <= moved + moved / 2 + 1,
                "case {case}: {} copies",
                plan.len()
            );
        }
    }
}
