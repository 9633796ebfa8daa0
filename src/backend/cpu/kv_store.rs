//! The CPU's K/V store: K rows and V rows in host memory, in the cache
//! type (f32, f16 or ggml q8_0 blocks). Attention kernels read a layer's
//! rows in their stored type through [`LayerKv`] (one monomorphized loop per
//! type, via [`KvRow`]); everything else goes through the `KvStore` trait.

use crate::backend::kvstore::{
    dequantize_q8_0, permutation_plan, quantize_q8_0, BlockQ8_0, KvStore, KvType, QK8_0, TEMP,
};
use half::f16;
use half::slice::HalfFloatSliceExt;

/// A cached K or V head row as stored (f32, f16 or q8_0 blocks; f32 also
/// for rows pre-converted for a prefill chunk). Kernels are generic over it,
/// so each cache type gets its own monomorphized loop.
pub trait KvRow {
    /// The row as f32: converted into `buf`, or borrowed as is.
    fn as_f32<'a>(&'a self, buf: &'a mut [f32]) -> &'a [f32];

    /// The row itself if it is stored as f16 (SIMD kernels widen it in
    /// registers instead of converting through a buffer).
    #[inline]
    fn as_f16(&self) -> Option<&[f16]> {
        None
    }
}

impl KvRow for [f16] {
    #[inline]
    fn as_f32<'a>(&'a self, buf: &'a mut [f32]) -> &'a [f32] {
        let b = &mut buf[..self.len()];
        self.convert_to_f32_slice(b);
        b
    }

    #[inline]
    fn as_f16(&self) -> Option<&[f16]> {
        Some(self)
    }
}

impl KvRow for [BlockQ8_0] {
    #[inline]
    fn as_f32<'a>(&'a self, buf: &'a mut [f32]) -> &'a [f32] {
        let b = &mut buf[..self.len() * QK8_0];
        dequantize_q8_0(self, b);
        b
    }
}

impl KvRow for [f32] {
    #[inline]
    fn as_f32<'a>(&'a self, _buf: &'a mut [f32]) -> &'a [f32] {
        self
    }
}

/// K and V storage, in the cache type.
#[derive(Debug, Clone)]
enum Store {
    F32(Vec<f32>, Vec<f32>),
    F16(Vec<f16>, Vec<f16>),
    Q8(Vec<BlockQ8_0>, Vec<BlockQ8_0>),
}

/// A run of rows of K and V as stored, (rows, row units) each, where a row
/// unit is a value (f32/f16) or a 32-value block (q8_0). Kernels match on
/// this once per layer and run a monomorphized loop per type.
#[derive(Clone, Copy, Debug)]
pub enum LayerKv<'a> {
    F32(&'a [f32], &'a [f32]),
    F16(&'a [f16], &'a [f16]),
    Q8(&'a [BlockQ8_0], &'a [BlockQ8_0]),
}

/// K/V rows in host memory.
#[derive(Debug, Clone)]
pub struct CpuKv {
    ty: KvType,
    n_rows: usize,
    row_vals: usize,
    /// Storage units per row: row_vals, or row_vals / 32 blocks (q8_0).
    row_units: usize,
    store: Store,
}

impl CpuKv {
    /// `n_rows` zeroed rows of `row_vals` values (a multiple of the type's
    /// block length).
    pub fn new(ty: KvType, n_rows: usize, row_vals: usize) -> CpuKv {
        let row_units = row_vals / ty.block_len();
        let n = n_rows * row_units;
        let store = match ty {
            KvType::F32 => Store::F32(vec![0.0; n], vec![0.0; n]),
            KvType::F16 => Store::F16(vec![f16::ZERO; n], vec![f16::ZERO; n]),
            KvType::Q8_0 => Store::Q8(vec![BlockQ8_0::default(); n], vec![BlockQ8_0::default(); n]),
        };
        CpuKv {
            ty,
            n_rows,
            row_vals,
            row_units,
            store,
        }
    }

    /// Storage units per row.
    #[inline]
    pub fn row_units(&self) -> usize {
        self.row_units
    }

    /// Rows `first..first + n` of K and V in the stored type.
    #[inline]
    pub fn rows(&self, first: usize, n: usize) -> LayerKv<'_> {
        let (a, b) = (first * self.row_units, (first + n) * self.row_units);
        match &self.store {
            Store::F32(k, v) => LayerKv::F32(&k[a..b], &v[a..b]),
            Store::F16(k, v) => LayerKv::F16(&k[a..b], &v[a..b]),
            Store::Q8(k, v) => LayerKv::Q8(&k[a..b], &v[a..b]),
        }
    }

    /// Values `off..off + out.len()` of K or V row `row` as f32.
    #[inline]
    pub fn read_one(&self, key: bool, row: usize, off: usize, out: &mut [f32]) {
        let bl = self.ty.block_len();
        let o = row * self.row_units + off / bl;
        let r = out.len() / bl;
        match &self.store {
            Store::F32(k, v) => out.copy_from_slice(&(if key { k } else { v })[o..o + r]),
            Store::F16(k, v) => (if key { k } else { v })[o..o + r].convert_to_f32_slice(out),
            Store::Q8(k, v) => dequantize_q8_0(&(if key { k } else { v })[o..o + r], out),
        }
    }
}

impl KvStore for CpuKv {
    fn ty(&self) -> KvType {
        self.ty
    }
    fn n_rows(&self) -> usize {
        self.n_rows
    }
    fn row_vals(&self) -> usize {
        self.row_vals
    }
    fn write(&mut self, row: usize, off: usize, k: &[f32], v: &[f32]) {
        let bl = self.ty.block_len();
        let o = row * self.row_units + off / bl;
        let r = k.len() / bl;
        match &mut self.store {
            Store::F32(ks, vs) => {
                ks[o..o + r].copy_from_slice(k);
                vs[o..o + r].copy_from_slice(v);
            }
            Store::F16(ks, vs) => {
                for (dst, &x) in ks[o..o + r].iter_mut().zip(k) {
                    *dst = f16::from_f32(x);
                }
                for (dst, &x) in vs[o..o + r].iter_mut().zip(v) {
                    *dst = f16::from_f32(x);
                }
            }
            Store::Q8(ks, vs) => {
                quantize_q8_0(k, &mut ks[o..o + r]);
                quantize_q8_0(v, &mut vs[o..o + r]);
            }
        }
    }
    fn read(&self, key: bool, base: usize, rows: &[u32], off: usize, len: usize, out: &mut [f32]) {
        for (i, &r) in rows.iter().enumerate() {
            self.read_one(
                key,
                base + r as usize,
                off,
                &mut out[i * len..(i + 1) * len],
            );
        }
    }
    fn clone_box(&self) -> Box<dyn KvStore> {
        Box::new(self.clone())
    }
    fn resized(&self, n_rows: usize, moves: &[(u32, u32)]) -> Box<dyn KvStore> {
        let mut out = CpuKv::new(self.ty, n_rows, self.row_vals);
        let u = self.row_units;
        fn copy<T: Copy>(src: &[T], dst: &mut [T], u: usize, moves: &[(u32, u32)]) {
            for &(f, t) in moves {
                let (f, t) = (f as usize * u, t as usize * u);
                dst[t..t + u].copy_from_slice(&src[f..f + u]);
            }
        }
        match (&self.store, &mut out.store) {
            (Store::F32(k, v), Store::F32(k2, v2)) => {
                copy(k, k2, u, moves);
                copy(v, v2, u, moves);
            }
            (Store::F16(k, v), Store::F16(k2, v2)) => {
                copy(k, k2, u, moves);
                copy(v, v2, u, moves);
            }
            (Store::Q8(k, v), Store::Q8(k2, v2)) => {
                copy(k, k2, u, moves);
                copy(v, v2, u, moves);
            }
            _ => unreachable!("a store resized keeps its type"),
        }
        Box::new(out)
    }
    fn permute(&mut self, moves: &[(u32, u32)]) {
        let plan = permutation_plan(moves, self.n_rows);
        let u = self.row_units;
        // one row of each buffer carried out along the plan, the spare
        // row on the side
        fn apply<T: Copy + Default>(buf: &mut [T], u: usize, plan: &[(u32, u32)]) {
            let mut spare = vec![T::default(); u];
            for &(f, t) in plan {
                let (f, t) = (f as usize, t as usize);
                if t == TEMP as usize {
                    spare.copy_from_slice(&buf[f * u..(f + 1) * u]);
                } else if f == TEMP as usize {
                    buf[t * u..(t + 1) * u].copy_from_slice(&spare);
                } else {
                    buf.copy_within(f * u..(f + 1) * u, t * u);
                }
            }
        }
        match &mut self.store {
            Store::F32(k, v) => {
                apply(k, u, &plan);
                apply(v, u, &plan);
            }
            Store::F16(k, v) => {
                apply(k, u, &plan);
                apply(v, u, &plan);
            }
            Store::Q8(k, v) => {
                apply(k, u, &plan);
                apply(v, u, &plan);
            }
        }
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}
