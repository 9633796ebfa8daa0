//! The KV cache: slot metadata (`cells`) kept apart from K/V storage.
//!
//! Keys are stored after RoPE, at their absolute positions, so evicting a
//! token (freeing its slot) never moves or re-rotates data. Storage is laid
//! out (n_layers, n_slots, kv_dim) for K and for V, in the cache type
//! (`KvType`, `--cache-type`): f32, f16 (default) or q8_0 (ggml's block
//! layout: 32 values per block, one f16 scale + 32 i8, 34 bytes). Attention
//! kernels read a layer through `layer()`, which dispatches on the type once
//! per layer; each row type implements `backend::cpu::KvRow`.
//!
//! Two layouts (`Layout`): token-uniform (one slot map shared by every layer
//! and head: a slot holds one token's K/V rows of all layers) and per-(layer,
//! KV-head) streams (`streams`: every stream keeps its own tokens in a shared
//! pool of head_dim rows, so heads and layers can hold different tokens and
//! different counts, with memory really freed on eviction).
//!
//! Protocol for a forward step over `n` new tokens: `apply(victims,
//! positions)` frees the evicted slots and picks slots for the new tokens (it
//! is the only place that mutates `cells`); the forward pass then writes each
//! layer's K/V rows into those slots and attends over `live()`. Freed slots
//! are reused ring-style, so eviction never moves data.

pub mod cells;
pub mod streams;

use crate::error::{Error, Result};
use cells::KvCells;
use half::f16;
use half::slice::HalfFloatSliceExt;
use streams::{Region, StreamLists};

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

/// Which RoPE position a cached token's key meets the query at (`--pos-mode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum PosMode {
    /// The token's position in the text (keys rotated once, at write).
    #[default]
    Absolute,
    /// StreamingLLM's pos-shift: a token's position is its index in the
    /// cache (0..n_resident), the query's is the number of resident tokens
    /// before it. See `model::llama::forward` for how it is computed exactly.
    Cache,
}

impl PosMode {
    /// Name as `--pos-mode` spells it.
    pub fn name(self) -> &'static str {
        match self {
            PosMode::Absolute => "absolute",
            PosMode::Cache => "cache",
        }
    }

    /// Parse a `--pos-mode` value.
    pub fn parse(s: &str) -> Result<PosMode> {
        match s {
            "absolute" => Ok(PosMode::Absolute),
            "cache" => Ok(PosMode::Cache),
            _ => Err(Error::arg(
                "--pos-mode",
                format!("unknown position mode '{s}' (known: absolute, cache)"),
            )),
        }
    }
}

/// How cache entries are organized.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Layout {
    /// One slot map for every layer and head (one decision per token).
    #[default]
    Uniform,
    /// One stream per (layer, KV head) over a shared pool of head rows.
    Streams,
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

/// K and V storage of every layer, in the cache type.
#[derive(Debug, Clone)]
enum Store {
    F32(Vec<f32>, Vec<f32>),
    F16(Vec<f16>, Vec<f16>),
    Q8(Vec<BlockQ8_0>, Vec<BlockQ8_0>),
}

/// One layer's K and V as stored, (n_slots, row units) each, where a row is
/// kv_dim values (f32/f16) or kv_dim/32 blocks (q8_0). Kernels match on
/// this once per layer and run a monomorphized loop per type.
#[derive(Clone, Copy, Debug)]
pub enum LayerKv<'a> {
    F32(&'a [f32], &'a [f32]),
    F16(&'a [f16], &'a [f16]),
    Q8(&'a [BlockQ8_0], &'a [BlockQ8_0]),
}

/// K/V storage plus slot metadata.
#[derive(Debug, Clone)]
pub struct KvCache {
    pub cells: KvCells,
    pub n_layers: usize,
    /// n_kv_heads * head_dim.
    pub kv_dim: usize,
    /// Dimensions per KV head.
    pub head_dim: usize,
    /// Storage type.
    pub ty: KvType,
    /// (n_layers, n_slots, kv_dim) keys after RoPE and values, in `ty`.
    store: Store,
    /// Storage units per row: kv_dim (f32, f16) or kv_dim/32 (q8_0).
    row_len: usize,
    /// (n_live,) slots of the live entries, ordered by position (rebuilt by `reserve`).
    live_slots: Vec<u32>,
    /// (n_live,) absolute positions matching `live_slots`.
    live_pos: Vec<i64>,
    /// (n_live,) the live slots in slot (memory) order, and their positions:
    /// decoding attends to every live token, and walking K/V rows in memory
    /// order keeps the hardware prefetcher useful after scattered evictions.
    slot_order: Vec<u32>,
    slot_order_pos: Vec<i64>,
    /// (n_live,) (position, slot) scratch for the position sort.
    by_pos: Vec<(i64, u32)>,
    /// Per-stream lists (None = token-uniform layout).
    streams: Option<StreamLists>,
    /// KV heads per layer.
    n_kv_heads: usize,
    /// Most tokens ever resident at once since the last `clear` (with
    /// streams: peak entries / streams, rounded up: token equivalents).
    pub peak_live: usize,
    /// Most (layer, KV head, token) entries ever resident at once.
    pub peak_entries: usize,
}

impl KvCache {
    /// An f16 cache of `n_slots` slots per layer, each holding `kv_dim` =
    /// n_kv_heads * `head_dim` values of K and of V.
    pub fn new(n_layers: usize, kv_dim: usize, head_dim: usize, n_slots: usize) -> KvCache {
        // f16 has no block constraint: this cannot fail
        match Self::with_type(n_layers, kv_dim, head_dim, n_slots, KvType::F16) {
            Ok(c) => c,
            Err(_) => unreachable!("f16 caches accept any shape"),
        }
    }

    /// A cache storing K and V as `ty`. q8_0 blocks must not straddle
    /// heads: head_dim (hence kv_dim) must be a multiple of 32.
    pub fn with_type(
        n_layers: usize,
        kv_dim: usize,
        head_dim: usize,
        n_slots: usize,
        ty: KvType,
    ) -> Result<KvCache> {
        let bl = ty.block_len();
        if head_dim == 0 || !head_dim.is_multiple_of(bl) || !kv_dim.is_multiple_of(bl) {
            return Err(Error::arg(
                "--cache-type",
                format!(
                    "{ty} stores blocks of {bl} values, but this model's head_dim {head_dim} (kv_dim {kv_dim}) is not a multiple of {bl}: use f16 or f32"
                ),
            ));
        }
        let row_len = kv_dim / bl;
        let n = n_layers * n_slots * row_len;
        Ok(Self::alloc(
            n_layers, kv_dim, head_dim, n_slots, ty, n, row_len, None,
        ))
    }

    /// A per-(layer, KV head) stream cache over a pool of rows of
    /// `head_dim` values (K and V) cut into `regions`, each serving a run of
    /// streams (see `streams`).
    pub fn with_streams(
        n_layers: usize,
        kv_dim: usize,
        head_dim: usize,
        regions: &[Region],
        ty: KvType,
    ) -> Result<KvCache> {
        let c = Self::with_type(n_layers, kv_dim, head_dim, 0, ty)?;
        let row_len = head_dim / ty.block_len();
        let lists = StreamLists::new(n_layers, kv_dim / head_dim, regions);
        let n_pool = lists.n_rows();
        Ok(Self::alloc(
            n_layers,
            kv_dim,
            head_dim,
            n_pool,
            c.ty,
            n_pool * row_len,
            row_len,
            Some(lists),
        ))
    }

    #[allow(clippy::too_many_arguments)]
    fn alloc(
        n_layers: usize,
        kv_dim: usize,
        head_dim: usize,
        n_slots: usize,
        ty: KvType,
        n: usize,
        row_len: usize,
        streams: Option<StreamLists>,
    ) -> KvCache {
        let store = match ty {
            KvType::F32 => Store::F32(vec![0.0; n], vec![0.0; n]),
            KvType::F16 => Store::F16(vec![f16::ZERO; n], vec![f16::ZERO; n]),
            KvType::Q8_0 => Store::Q8(vec![BlockQ8_0::default(); n], vec![BlockQ8_0::default(); n]),
        };
        KvCache {
            cells: KvCells::new(n_slots),
            n_layers,
            kv_dim,
            head_dim,
            ty,
            store,
            row_len,
            live_slots: Vec::new(),
            live_pos: Vec::new(),
            slot_order: Vec::new(),
            slot_order_pos: Vec::new(),
            by_pos: Vec::new(),
            n_kv_heads: kv_dim / head_dim,
            streams,
            peak_live: 0,
            peak_entries: 0,
        }
    }

    /// The layout of this cache.
    pub fn layout(&self) -> Layout {
        if self.streams.is_some() {
            Layout::Streams
        } else {
            Layout::Uniform
        }
    }

    /// Per-stream lists (stream layout only).
    pub fn streams(&self) -> Option<&StreamLists> {
        self.streams.as_ref()
    }

    /// Number of streams: n_layers · n_kv_heads with streams, 1 token-uniform.
    pub fn n_streams(&self) -> usize {
        self.streams.as_ref().map_or(1, |s| s.n_streams())
    }

    /// Bytes of K/V storage held by one resident token (all layers):
    /// 2 · n_layers · kv_dim · {4, 2, 34/32}.
    pub fn bytes_per_token(&self) -> usize {
        2 * self.n_layers * self.ty.row_bytes(self.kv_dim)
    }

    /// Bytes of K/V storage allocated for every slot (pool row).
    pub fn bytes_allocated(&self) -> usize {
        match &self.streams {
            None => self.cells.n_slots() * self.bytes_per_token(),
            Some(_) => self.cells.n_slots() * 2 * self.ty.row_bytes(self.head_dim),
        }
    }

    /// Resident tokens: live slots, or with streams live entries over
    /// streams, rounded up (token equivalents).
    pub fn resident_tokens(&self) -> usize {
        self.cells.n_live().div_ceil(self.n_streams())
    }

    /// Bytes of K/V held at the peak (`peak_entries` rows or tokens).
    pub fn peak_bytes(&self) -> usize {
        match &self.streams {
            None => self.peak_live * self.bytes_per_token(),
            Some(_) => self.peak_entries * 2 * self.ty.row_bytes(self.head_dim),
        }
    }

    /// Drop every cached token.
    pub fn clear(&mut self) {
        self.cells.clear();
        self.live_slots.clear();
        self.live_pos.clear();
        self.slot_order.clear();
        self.slot_order_pos.clear();
        if let Some(st) = &mut self.streams {
            st.clear();
        }
        self.peak_live = 0;
        self.peak_entries = 0;
    }

    /// The single mutation point: free the `victims` slots, occupy one slot
    /// per new position, and refresh the live list. The new tokens' slots
    /// are returned in `slots`, in the order of `positions`.
    pub fn apply(
        &mut self,
        victims: &[u32],
        positions: &[i64],
        slots: &mut Vec<u32>,
    ) -> Result<()> {
        if self.streams.is_some() {
            return self.apply_streams(victims, positions, slots);
        }
        // Check capacity first so a failed step leaves the cache untouched.
        if self.cells.n_live() - victims.len().min(self.cells.n_live()) + positions.len()
            > self.cells.n_slots()
        {
            return Err(Error::Other(format!(
                "KV cache full: {} slots hold {} tokens (raise -c/--ctx-size)",
                self.cells.n_slots(),
                self.cells.n_live()
            )));
        }
        for &v in victims {
            self.cells.free(v as usize);
        }
        self.peak_live = self.peak_live.max(self.cells.n_live() + positions.len());
        self.peak_entries = self.peak_live;
        slots.clear();
        for &p in positions {
            let s = self.cells.find_free().ok_or_else(|| {
                Error::Other(format!(
                    "KV cache full: {} slots hold {} tokens (raise -c/--ctx-size)",
                    self.cells.n_slots(),
                    self.cells.n_live()
                ))
            })?;
            self.cells.set(s, p);
            slots.push(s as u32);
        }
        self.slot_order.clear();
        self.slot_order_pos.clear();
        for (s, p) in self.cells.live() {
            self.slot_order.push(s as u32);
            self.slot_order_pos.push(p);
        }
        // position order (reusing one scratch buffer: no allocation per step)
        self.by_pos.clear();
        self.by_pos.extend(
            self.slot_order_pos
                .iter()
                .copied()
                .zip(self.slot_order.iter().copied()),
        );
        self.by_pos.sort_unstable();
        self.live_slots.clear();
        self.live_pos.clear();
        for &(p, sl) in &self.by_pos {
            self.live_slots.push(sl);
            self.live_pos.push(p);
        }
        Ok(())
    }

    /// `apply` for the stream layout: victims are pool slots of any
    /// streams; every stream receives one entry per new position, and
    /// `slots` is filled (n_streams, n) stream-major.
    fn apply_streams(
        &mut self,
        victims: &[u32],
        positions: &[i64],
        slots: &mut Vec<u32>,
    ) -> Result<()> {
        let Some(st) = self.streams.as_mut() else {
            return Ok(());
        };
        let ns = st.n_streams();
        // every region must hold its streams' entries after the step; check
        // first so that a failed step leaves the cache untouched
        let nr = st.regions().len();
        let mut fill = vec![0usize; nr];
        for s in 0..ns {
            fill[st.region_of(s)] += st.len(s) + positions.len();
        }
        for &v in victims {
            let ri = st.region_of(st.owner(v as usize));
            fill[ri] = fill[ri].saturating_sub(1);
        }
        for (ri, (&f, r)) in fill.iter().zip(st.regions()).enumerate() {
            if f > r.rows {
                return Err(Error::Other(format!(
                    "KV pool region {ri} full: {f} entries would exceed its {} rows",
                    r.rows
                )));
            }
        }
        for &v in victims {
            self.cells.free(v as usize);
        }
        let cells = &self.cells;
        st.remove(victims, |s| cells.pos(s).is_some());
        slots.clear();
        for s in 0..ns {
            for &p in positions {
                let cells = &self.cells;
                let Some(sl) = st.find_free(s, |x| cells.pos(x).is_none()) else {
                    unreachable!("region capacity was checked above");
                };
                self.cells.set(sl, p);
                st.push(s, sl as u32, p);
                slots.push(sl as u32);
            }
        }
        self.peak_entries = self.peak_entries.max(self.cells.n_live());
        self.peak_live = self.peak_entries.div_ceil(ns);
        Ok(())
    }

    /// The keys KV head `g` of `layer` attends over, by position or
    /// (`memory_order`) by slot: token-uniform caches give the shared live
    /// list, stream caches the stream's own.
    #[inline]
    pub fn head(&self, layer: usize, g: usize, memory_order: bool) -> HeadView<'_> {
        let hu = self.head_dim / self.ty.block_len();
        match &self.streams {
            Some(st) => {
                let id = st.id(layer, g);
                let (slots, pos) = if memory_order {
                    st.stream_by_slot(id)
                } else {
                    st.stream(id)
                };
                HeadView {
                    slots,
                    pos,
                    stride: hu,
                    off: 0,
                }
            }
            None => {
                let (slots, pos) = if memory_order {
                    self.live_by_slot()
                } else {
                    self.live()
                };
                HeadView {
                    slots,
                    pos,
                    stride: self.row_len,
                    off: g * hu,
                }
            }
        }
    }

    /// Pool slots (or token slots) holding positions in `lo..hi`.
    pub fn entries_in(&self, lo: usize, hi: usize) -> Vec<u32> {
        self.cells
            .live()
            .filter(|&(_, p)| (lo..hi).contains(&(p as usize)))
            .map(|(s, _)| s as u32)
            .collect()
    }

    /// Store token `i` of the current step (the step wrote `n` tokens and
    /// `apply` returned `step_slots`) for `layer`: K and V rows of kv_dim.
    pub fn write_token(
        &mut self,
        layer: usize,
        i: usize,
        n: usize,
        step_slots: &[u32],
        k: &[f32],
        v: &[f32],
    ) {
        let Some(st) = &self.streams else {
            self.write(layer, step_slots[i] as usize, k, v);
            return;
        };
        let (hd, hu) = (self.head_dim, self.row_len);
        for g in 0..self.n_kv_heads {
            let sl = step_slots[st.id(layer, g) * n + i] as usize;
            let r = g * hd..(g + 1) * hd;
            Self::put(&mut self.store, sl * hu, hu, &k[r.clone()], &v[r]);
        }
    }

    /// Key (or value) row of KV head `g` of (layer, slot) as f32 into `out`
    /// (head_dim), for either layout.
    pub fn head_f32(&self, key: bool, layer: usize, g: usize, slot: usize, out: &mut [f32]) {
        let hu = self.head_dim / self.ty.block_len();
        let o = match &self.streams {
            Some(_) => slot * hu,
            None => self.off(layer, slot) + g * hu,
        };
        let out = &mut out[..self.head_dim];
        match &self.store {
            Store::F32(k, v) => out.copy_from_slice(&(if key { k } else { v })[o..o + hu]),
            Store::F16(k, v) => (if key { k } else { v })[o..o + hu].convert_to_f32_slice(out),
            Store::Q8(k, v) => dequantize_q8_0(&(if key { k } else { v })[o..o + hu], out),
        }
    }

    /// Live slots in slot (memory) order, with their positions.
    pub fn live_by_slot(&self) -> (&[u32], &[i64]) {
        (&self.slot_order, &self.slot_order_pos)
    }

    /// Live slots ordered by position, with their positions.
    pub fn live(&self) -> (&[u32], &[i64]) {
        (&self.live_slots, &self.live_pos)
    }

    /// Storage units from the start of the store to (layer, slot)
    /// (stream layout: to pool row `slot`; the pool serves every layer).
    #[inline]
    fn off(&self, layer: usize, slot: usize) -> usize {
        if self.streams.is_some() {
            return slot * self.row_len;
        }
        (layer * self.cells.n_slots() + slot) * self.row_len
    }

    /// Storage units per row: kv_dim (f32, f16) or kv_dim/32 blocks (q8_0).
    #[inline]
    pub fn row_len(&self) -> usize {
        self.row_len
    }

    /// Layer `layer`'s K and V, (n_slots, row_len) each, in the stored type
    /// (stream layout: the whole pool, (n_pool, head units)).
    #[inline]
    pub fn layer(&self, layer: usize) -> LayerKv<'_> {
        let (a, b) = if self.streams.is_some() {
            (0, self.cells.n_slots() * self.row_len)
        } else {
            (self.off(layer, 0), self.off(layer + 1, 0))
        };
        match &self.store {
            Store::F32(k, v) => LayerKv::F32(&k[a..b], &v[a..b]),
            Store::F16(k, v) => LayerKv::F16(&k[a..b], &v[a..b]),
            Store::Q8(k, v) => LayerKv::Q8(&k[a..b], &v[a..b]),
        }
    }

    /// Store one token's K and V rows (kv_dim each) for `layer`
    /// (token-uniform layout; streams write through `write_token`).
    pub fn write(&mut self, layer: usize, slot: usize, k: &[f32], v: &[f32]) {
        debug_assert!(self.streams.is_none());
        let o = self.off(layer, slot);
        let (d, r) = (self.kv_dim, self.row_len);
        Self::put(&mut self.store, o, r, &k[..d], &v[..d]);
    }

    /// Convert and store `k`, `v` as `r` storage units at offset `o`.
    fn put(store: &mut Store, o: usize, r: usize, k: &[f32], v: &[f32]) {
        match store {
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

    /// Key row of (layer, slot) as f32 into `out` (kv_dim), whatever the type.
    pub fn k_f32(&self, layer: usize, slot: usize, out: &mut [f32]) {
        self.row_f32(true, layer, slot, out)
    }

    /// Value row of (layer, slot) as f32 into `out` (kv_dim), whatever the type.
    pub fn v_f32(&self, layer: usize, slot: usize, out: &mut [f32]) {
        self.row_f32(false, layer, slot, out)
    }

    fn row_f32(&self, key: bool, layer: usize, slot: usize, out: &mut [f32]) {
        let o = self.off(layer, slot);
        let (d, r) = (self.kv_dim, self.row_len);
        let out = &mut out[..d];
        match &self.store {
            Store::F32(k, v) => out.copy_from_slice(&(if key { k } else { v })[o..o + r]),
            Store::F16(k, v) => (if key { k } else { v })[o..o + r].convert_to_f32_slice(out),
            Store::Q8(k, v) => dequantize_q8_0(&(if key { k } else { v })[o..o + r], out),
        }
    }

    /// Key row of (layer, slot), kv_dim long, of an f16 cache (the default).
    /// Panics on other types: use `k_f32` or `layer` there.
    #[inline]
    pub fn k_row(&self, layer: usize, slot: usize) -> &[f16] {
        let o = self.off(layer, slot);
        match &self.store {
            Store::F16(k, _) => &k[o..o + self.kv_dim],
            _ => panic!("k_row on a {} cache (use k_f32)", self.ty),
        }
    }

    /// Value row of (layer, slot), kv_dim long, of an f16 cache (the default).
    /// Panics on other types: use `v_f32` or `layer` there.
    #[inline]
    pub fn v_row(&self, layer: usize, slot: usize) -> &[f16] {
        let o = self.off(layer, slot);
        match &self.store {
            Store::F16(_, v) => &v[o..o + self.kv_dim],
            _ => panic!("v_row on a {} cache (use v_f32)", self.ty),
        }
    }
}
