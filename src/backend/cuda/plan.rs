//! The CUDA backend's host-side decisions, in plain Rust: compiled and
//! tested with or without the `cuda` feature and a GPU.
//!
//! - Type codes shared with kernels/quant.cuh.
//! - Launch shapes of the matmul, element-wise and attention kernels.
//! - The attention records of a layer (kernels/attention.cu): one head
//!   record per KV head {first entry, entry count, unit base lo/hi, unit
//!   stride} and the entry lists (slot, position) they point into, for
//!   every layer, built and uploaded once per step (`StepTables`); a
//!   token-uniform cache shows every layer and head the same list, so it is
//!   stored once whatever the depth of the model.
//! - The split-K partition of attention: `ATT_CHUNK` entries per block.

use crate::backend::{KvAccess, KvType};
use crate::error::{Error, Result};
use crate::tensor::DType;

/// Entries one attention block scores (kernels/attention.cu `ATT_CHUNK`).
pub const ATT_CHUNK: usize = 128;
/// Threads of an attention block (`ATT_THREADS`).
pub const ATT_THREADS: u32 = 128;
/// Largest head dimension of the attention kernels (`KV_MAX_HD`).
pub const MAX_HEAD_DIM: usize = 256;
/// Most query heads per KV head (`KV_MAX_GROUP`).
pub const MAX_GROUP: usize = 16;
/// Weight rows per block of the decode matmul (`MMV_WARPS`: a warp a row).
pub const MMV_ROWS: usize = 4;
/// Output tile of the prefill matmul (`TM` × `TN`).
pub const TILE_ROWS: usize = 64;
pub const TILE_TOKENS: usize = 32;
/// Most tokens the decode matmul takes in one launch.
pub const MMV_MAX_TOKENS: usize = 8;
/// u32 words of one head record.
pub const HEAD_REC_WORDS: usize = 5;

/// A weight type's code in kernels/quant.cuh.
pub fn type_code(d: DType) -> i32 {
    match d {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::BF16 => 2,
        DType::Q4_0 => 3,
        DType::Q4_1 => 4,
        DType::Q5_0 => 5,
        DType::Q5_1 => 6,
        DType::Q8_0 => 7,
        DType::Q4K => 8,
        DType::Q5K => 9,
        DType::Q6K => 10,
        DType::Q2K => 11,
        DType::Q3K => 12,
        DType::IQ4NL => 13,
        DType::IQ4XS => 14,
    }
}

/// A K/V store type's code (the same codes: f32, f16, q8_0).
pub fn kv_code(t: KvType) -> i32 {
    match t {
        KvType::F32 => 0,
        KvType::F16 => 1,
        KvType::Q8_0 => 7,
    }
}

/// Grid and block of one launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Launch {
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
}

/// Which matmul kernel a product runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MatKernel {
    /// `mmv_N`: up to N tokens, a warp per weight row.
    Mmv(usize),
    /// `mm_tile`: 64 rows × 32 tokens per block.
    Tile,
}

impl MatKernel {
    /// The kernel's name in the PTX.
    pub fn name(self) -> &'static str {
        match self {
            MatKernel::Mmv(1) => "mmv_1",
            MatKernel::Mmv(2) => "mmv_2",
            MatKernel::Mmv(4) => "mmv_4",
            MatKernel::Mmv(_) => "mmv_8",
            MatKernel::Tile => "mm_tile",
        }
    }
}

/// The kernel and launch shape of y (n_tok, n_out) = x · Wᵀ: decoding
/// steps (≤ 8 tokens) read each weight once for all their tokens; longer
/// steps run the tiled kernel.
pub fn matmul_launch(n_tok: usize, n_out: usize) -> (MatKernel, Launch) {
    if n_tok <= MMV_MAX_TOKENS {
        let n = n_tok.max(1).next_power_of_two();
        (
            MatKernel::Mmv(n),
            Launch {
                grid: (n_out.div_ceil(MMV_ROWS) as u32, 1, 1),
                block: (32 * MMV_ROWS as u32, 1, 1),
            },
        )
    } else {
        (
            MatKernel::Tile,
            Launch {
                grid: (
                    n_out.div_ceil(TILE_ROWS) as u32,
                    n_tok.div_ceil(TILE_TOKENS) as u32,
                    1,
                ),
                block: (256, 1, 1),
            },
        )
    }
}

/// A grid-stride element-wise launch over `len` values.
pub fn elementwise_launch(len: usize) -> Launch {
    Launch {
        grid: (len.div_ceil(256).clamp(1, 8192) as u32, 1, 1),
        block: (256, 1, 1),
    }
}

/// Blocks along the entries of one (token, KV head): the split-K of
/// flash-decoding.
pub fn n_splits(max_entries: usize) -> usize {
    max_entries.div_ceil(ATT_CHUNK).max(1)
}

/// Can the attention kernels run this shape? (checked before a model runs
/// on the device, so a step never meets a shape it cannot compute)
pub fn check_attention_shape(n_heads: usize, n_kv_heads: usize, head_dim: usize) -> Result<()> {
    let bad = |what: String| Err(Error::Other(format!("--device cuda: {what}")));
    if head_dim == 0 || !head_dim.is_multiple_of(32) || head_dim > MAX_HEAD_DIM {
        return bad(format!(
            "head dimension {head_dim} is not supported (a multiple of 32 up to {MAX_HEAD_DIM})"
        ));
    }
    if n_kv_heads == 0 || !n_heads.is_multiple_of(n_kv_heads) || n_heads / n_kv_heads > MAX_GROUP {
        return bad(format!(
            "{n_heads} query heads over {n_kv_heads} KV heads are not supported (at most {MAX_GROUP} per KV head)"
        ));
    }
    Ok(())
}

/// Can the matmul kernels read rows of `n_in` values of `dtype`?
pub fn check_matrix(dtype: DType, n_in: usize) -> Result<()> {
    if !n_in.is_multiple_of(32) {
        return Err(Error::Other(format!(
            "--device cuda: rows of {n_in} {dtype:?} values are not supported (the kernels read 32 values at a time)"
        )));
    }
    Ok(())
}

/// The attention records of every layer of one cache for one step, built
/// on the host once per step and uploaded in one copy: `words` holds the
/// head records of layer 0, 1, … (`HEAD_REC_WORDS` each, `n_kv_heads` a
/// layer), then the entry lists as (slot, position) pairs. A list shown to
/// several layers or heads (a token-uniform cache shows every one the same
/// list) is stored once.
#[derive(Debug, Default)]
pub struct StepTables {
    /// Head records, then entries (u32 words).
    pub words: Vec<u32>,
    /// Largest entry count over the heads of each layer.
    pub max_entries: Vec<usize>,
    n_kv_heads: usize,
    /// (slots pointer, positions pointer, length, first entry) of each list
    /// stored.
    lists: Vec<(usize, usize, usize, u32)>,
}

impl StepTables {
    /// Build the records of `kv`'s layers (each head's live entries in
    /// memory order).
    pub fn build(&mut self, kv: &dyn KvAccess, n_kv_heads: usize) {
        let n_layers = kv.n_layers();
        self.n_kv_heads = n_kv_heads;
        self.lists.clear();
        self.max_entries.clear();
        self.words.clear();
        self.words.resize(self.entries_offset_for(n_layers), 0);
        let mut n_entries = 0u32;
        for layer in 0..n_layers {
            let base_row = kv.layer_base(layer) as u64;
            let mut max = 0;
            for g in 0..n_kv_heads {
                let h = kv.head(layer, g, true);
                let key = (
                    h.slots.as_ptr() as usize,
                    h.pos.as_ptr() as usize,
                    h.slots.len(),
                );
                let first = match self.lists.iter().find(|l| (l.0, l.1, l.2) == key) {
                    Some(l) => l.3,
                    None => {
                        for (&s, &p) in h.slots.iter().zip(h.pos) {
                            self.words.extend_from_slice(&[s, p as u32]);
                        }
                        self.lists.push((key.0, key.1, key.2, n_entries));
                        n_entries += h.slots.len() as u32;
                        n_entries - h.slots.len() as u32
                    }
                };
                // entry e of this head starts at unit (layer_base + slot) · stride + off
                let base = base_row * h.stride as u64 + h.off as u64;
                let at = self.heads_offset(layer) + g * HEAD_REC_WORDS;
                self.words[at..at + HEAD_REC_WORDS].copy_from_slice(&[
                    first,
                    h.slots.len() as u32,
                    base as u32,
                    (base >> 32) as u32,
                    h.stride as u32,
                ]);
                max = max.max(h.slots.len());
            }
            self.max_entries.push(max);
        }
    }

    /// Word offset of `layer`'s head records.
    pub fn heads_offset(&self, layer: usize) -> usize {
        layer * self.n_kv_heads * HEAD_REC_WORDS
    }

    /// Word offset of the entry lists.
    pub fn entries_offset(&self) -> usize {
        self.entries_offset_for(self.max_entries.len())
    }

    fn entries_offset_for(&self, n_layers: usize) -> usize {
        self.heads_offset(n_layers)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{Backend, KvStore};
    use crate::kv::KvCache;

    /// The weight-format decoding of kernels/quant.cuh, built for the host
    /// by build.rs.
    mod host {
        extern "C" {
            pub(super) fn kvrun_host_deq32(ty: i32, row: *const u8, s: i32, out: *mut f32);
            pub(super) fn kvrun_host_block_bytes(ty: i32) -> i32;
        }
    }

    fn host_deq_row(d: DType, row: &[u8], n: usize) -> Vec<f32> {
        let mut out = vec![0f32; n];
        for (s, o) in out.chunks_exact_mut(32).enumerate() {
            // SAFETY: `row` holds a whole row of n values of `d` (checked by
            // the caller's row_bytes), sub-block s < n/32 reads inside it,
            // and `o` has room for the 32 values written.
            unsafe { host::kvrun_host_deq32(type_code(d), row.as_ptr(), s as i32, o.as_mut_ptr()) };
        }
        out
    }

    #[test]
    fn kernel_formats_decode_every_type_as_the_cpu_does() {
        let mut rng = crate::rng::Rng::new(7);
        for d in DType::ALL {
            // SAFETY: a pure function of its argument.
            let bb = unsafe { host::kvrun_host_block_bytes(type_code(d)) };
            assert_eq!(bb as usize, d.block_bytes(), "{d:?}");
            for n in [256usize, 512, 1024] {
                // weights of several scales, quantized by ggml's reference
                let x: Vec<f32> = (0..n)
                    .map(|i| rng.normal() * [0.02, 1.0, 30.0][i / 256 % 3])
                    .collect();
                let q = match d {
                    DType::F32 => bytemuck::cast_slice(&x).to_vec(),
                    DType::F16 | DType::BF16 => {
                        let mut q = vec![0u8; 2 * n];
                        match d {
                            DType::F16 => crate::quant::quantize_row_f16(&x, &mut q),
                            _ => crate::quant::quantize_row_bf16(&x, &mut q),
                        }
                        q
                    }
                    _ => ggml_sys::quantize_ref(d.ggml_id(), &x),
                };
                assert_eq!(q.len(), d.row_bytes(n));
                let mut want = vec![0f32; n];
                crate::quant::dequantize_row(d, &q, &mut want);
                let got = host_deq_row(d, &q, n);
                for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        a.to_bits() == b.to_bits(),
                        "{d:?} n={n} value {i}: {a} vs {b}"
                    );
                }
            }
        }
    }

    #[test]
    fn matmul_launches_cover_every_output_once() {
        for n_tok in [1usize, 2, 3, 5, 8, 9, 31, 32, 33, 512] {
            for n_out in [1usize, 3, 4, 63, 64, 65, 151_936] {
                let (k, l) = matmul_launch(n_tok, n_out);
                match k {
                    MatKernel::Mmv(n) => {
                        assert!(n_tok <= n && n <= MMV_MAX_TOKENS && n.is_power_of_two());
                        assert!(n < 2 * n_tok.max(1));
                        let rows = l.grid.0 as usize * MMV_ROWS;
                        assert!(rows >= n_out && rows < n_out + MMV_ROWS);
                        assert_eq!(l.block.0 as usize, 32 * MMV_ROWS);
                    }
                    MatKernel::Tile => {
                        assert!(n_tok > MMV_MAX_TOKENS);
                        let rows = l.grid.0 as usize * TILE_ROWS;
                        let toks = l.grid.1 as usize * TILE_TOKENS;
                        assert!(rows >= n_out && rows < n_out + TILE_ROWS);
                        assert!(toks >= n_tok && toks < n_tok + TILE_TOKENS);
                    }
                }
            }
        }
        assert_eq!(matmul_launch(3, 8).0.name(), "mmv_4");
        assert_eq!(matmul_launch(100, 8).0.name(), "mm_tile");
        assert_eq!(elementwise_launch(0).grid.0, 1);
        assert_eq!(elementwise_launch(257).grid.0, 2);
        assert_eq!(elementwise_launch(1 << 30).grid.0, 8192);
    }

    #[test]
    fn splits_cover_the_entries() {
        assert_eq!(n_splits(0), 1);
        assert_eq!(n_splits(1), 1);
        assert_eq!(n_splits(ATT_CHUNK), 1);
        assert_eq!(n_splits(ATT_CHUNK + 1), 2);
        assert_eq!(n_splits(32768), 32768 / ATT_CHUNK);
    }

    #[test]
    fn shapes_the_kernels_cannot_run_are_refused_in_one_line() {
        assert!(check_attention_shape(28, 4, 128).is_ok());
        assert!(check_attention_shape(9, 3, 64).is_ok());
        assert!(check_attention_shape(4, 1, 256).is_ok());
        for (h, k, d) in [(8, 8, 80), (8, 8, 512), (32, 1, 64), (9, 2, 64), (8, 0, 64)] {
            let e = check_attention_shape(h, k, d).unwrap_err().to_string();
            assert!(e.starts_with("--device cuda") && !e.contains('\n'), "{e}");
        }
        assert!(check_matrix(DType::F16, 100).is_err());
        assert!(check_matrix(DType::Q4K, 4096).is_ok());
    }

    /// A CPU cache of 3 layers × 2 KV heads of 64 (the metadata is the
    /// same whatever device stores the rows) after a first step of 10
    /// tokens, with the step's slots.
    fn cache(streams: bool) -> (KvCache, Vec<u32>) {
        let b = crate::backend::Host::new(1);
        let make = |sh: crate::kv::StoreShape| b.kv_store(sh.ty, sh.n_rows, sh.row_vals);
        let (n_layers, n_kv, hd, slots) = (3, 2, 64, 16);
        let mut kv = if streams {
            let r = crate::kv::streams::Region {
                first_stream: 0,
                n_streams: n_layers * n_kv,
                rows: n_layers * n_kv * slots,
            };
            KvCache::streams_on(&make, n_layers, n_kv * hd, hd, &[r], KvType::F32).unwrap()
        } else {
            KvCache::uniform_on(&make, n_layers, n_kv * hd, hd, slots, KvType::F32).unwrap()
        };
        let mut step = Vec::new();
        let pos: Vec<i64> = (0..10).collect();
        kv.apply(&[], &pos, &mut step).unwrap();
        (kv, step)
    }

    /// Storage unit → (row, value offset) of a store.
    fn unit_row(store: &dyn KvStore, u: u64) -> (u32, usize) {
        let ru =
            store.ty().row_bytes(store.row_vals()) / store.ty().row_bytes(store.ty().block_len());
        (
            (u / ru as u64) as u32,
            (u % ru as u64) as usize * store.ty().block_len(),
        )
    }

    #[test]
    fn head_records_and_write_units_address_the_rows_the_cpu_uses() {
        for streams in [false, true] {
            let (mut kv, slots) = cache(streams);
            let (n_layers, n_kv, hd) = (3, 2, 64);
            // write distinct rows through the cache, as the CPU backend does
            let n = 10;
            for l in 0..n_layers {
                for i in 0..n {
                    let k: Vec<f32> = (0..n_kv * hd)
                        .map(|j| (l * 1000 + i * 10 + j / hd) as f32)
                        .collect();
                    kv.write_token(l, i, n, &slots, &k, &k);
                }
            }
            let mut tables = StepTables::default();
            tables.build(&kv, n_kv);
            // the uniform cache's one list is stored once for every layer
            // and head; streams have a list each
            let lists = if streams { n_layers * n_kv } else { 1 };
            assert_eq!(tables.entries_offset(), n_layers * n_kv * HEAD_REC_WORDS);
            assert_eq!(tables.words.len(), tables.entries_offset() + 2 * n * lists);
            assert_eq!(tables.max_entries, vec![n; n_layers]);
            let mut units = Vec::new();
            let mut out = vec![0f32; hd];
            let ents = &tables.words[tables.entries_offset()..];
            for l in 0..n_layers {
                // every entry of every head, read as the kernel reads it,
                // finds the row written for it
                for g in 0..n_kv {
                    let at = tables.heads_offset(l) + g * HEAD_REC_WORDS;
                    let h = &tables.words[at..at + HEAD_REC_WORDS];
                    let base = h[2] as u64 | (h[3] as u64) << 32;
                    assert_eq!(h[1] as usize, kv.head(l, g, true).slots.len());
                    for e in 0..h[1] as usize {
                        let (s, pos) = (
                            ents[2 * (h[0] as usize + e)],
                            ents[2 * (h[0] as usize + e) + 1],
                        );
                        let u = base + s as u64 * h[4] as u64;
                        let (row, off) = unit_row(kv.store(), u);
                        kv.store().read(true, 0, &[row], off, hd, &mut out);
                        assert_eq!(
                            out[0],
                            (l * 1000) as f32 + pos as f32 * 10.0 + g as f32,
                            "layer {l} head {g}"
                        );
                    }
                }
                // and write_units names the same rows write_token wrote
                kv.write_units(l, n, &slots, &mut units);
                assert_eq!(units.len(), n * n_kv);
                for i in 0..n {
                    for g in 0..n_kv {
                        let (row, off) = unit_row(kv.store(), units[i * n_kv + g]);
                        kv.store().read(false, 0, &[row], off, hd, &mut out);
                        assert_eq!(out[5], (l * 1000 + i * 10 + g) as f32);
                    }
                }
            }
        }
    }
}
