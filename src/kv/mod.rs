//! The KV cache: slot metadata (`cells`) kept apart from K/V storage.
//!
//! Keys are stored after RoPE, at their absolute positions, so evicting a
//! token (freeing its slot) never moves or re-rotates data. Storage is laid
//! out (n_layers, n_slots, kv_dim) for K and for V, in the cache type
//! (`KvType`, `--cache-type`): f32, f16 (default) or q8_0 (ggml's block
//! layout: 32 values per block, one f16 scale + 32 i8, 34 bytes). The
//! storage itself is a backend-owned `KvStore` (host memory on the CPU,
//! device memory later): this module decides which store row each token's
//! (layer, head) values go to, the backend converts and reads them, and
//! scorers fetch rows through `read_heads` / `k_f32` / `v_f32`.
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
use streams::{Region, StreamLists};

pub use crate::backend::kvstore::{
    dequantize_q8_0, quantize_q8_0, BlockQ8_0, HeadView, KvAccess, KvStore, KvType, QK8_0,
};

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

/// Slot metadata plus the backend-owned K/V store it addresses.
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
    /// Keys after RoPE and values: token-uniform, (n_layers · n_slots) rows
    /// of kv_dim (row layer · n_slots + slot); streams, n_pool rows of
    /// head_dim shared by every layer.
    store: Box<dyn KvStore>,
    /// Storage units per head row: head_dim, or head_dim / 32 (q8_0).
    head_units: usize,
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

/// How a cache's store must be shaped: rows and values per row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoreShape {
    pub ty: KvType,
    pub n_rows: usize,
    pub row_vals: usize,
}

impl KvCache {
    /// An f16 cache (CPU store) of `n_slots` slots per layer, each holding
    /// `kv_dim` = n_kv_heads * `head_dim` values of K and of V.
    pub fn new(n_layers: usize, kv_dim: usize, head_dim: usize, n_slots: usize) -> KvCache {
        // f16 has no block constraint: this cannot fail
        match Self::with_type(n_layers, kv_dim, head_dim, n_slots, KvType::F16) {
            Ok(c) => c,
            Err(_) => unreachable!("f16 caches accept any shape"),
        }
    }

    /// A token-uniform cache storing K and V as `ty` in host memory (the
    /// CPU backend's store).
    pub fn with_type(
        n_layers: usize,
        kv_dim: usize,
        head_dim: usize,
        n_slots: usize,
        ty: KvType,
    ) -> Result<KvCache> {
        Self::uniform_on(&cpu_store, n_layers, kv_dim, head_dim, n_slots, ty)
    }

    /// A per-(layer, KV head) stream cache in host memory over a pool of
    /// rows of `head_dim` values (K and V) cut into `regions`, each serving
    /// a run of streams (see `streams`).
    pub fn with_streams(
        n_layers: usize,
        kv_dim: usize,
        head_dim: usize,
        regions: &[Region],
        ty: KvType,
    ) -> Result<KvCache> {
        Self::streams_on(&cpu_store, n_layers, kv_dim, head_dim, regions, ty)
    }

    /// A token-uniform cache whose store `make` allocates (a backend's
    /// `kv_store`). q8_0 blocks must not straddle heads: head_dim (hence
    /// kv_dim) must be a multiple of 32.
    pub fn uniform_on(
        make: &dyn Fn(StoreShape) -> Result<Box<dyn KvStore>>,
        n_layers: usize,
        kv_dim: usize,
        head_dim: usize,
        n_slots: usize,
        ty: KvType,
    ) -> Result<KvCache> {
        check_type(ty, kv_dim, head_dim)?;
        let store = make(StoreShape {
            ty,
            n_rows: n_layers * n_slots,
            row_vals: kv_dim,
        })?;
        Ok(Self::assemble(
            n_layers, kv_dim, head_dim, n_slots, ty, store, None,
        ))
    }

    /// A stream cache whose store `make` allocates.
    pub fn streams_on(
        make: &dyn Fn(StoreShape) -> Result<Box<dyn KvStore>>,
        n_layers: usize,
        kv_dim: usize,
        head_dim: usize,
        regions: &[Region],
        ty: KvType,
    ) -> Result<KvCache> {
        check_type(ty, kv_dim, head_dim)?;
        let lists = StreamLists::new(n_layers, kv_dim / head_dim, regions);
        let n_pool = lists.n_rows();
        let store = make(StoreShape {
            ty,
            n_rows: n_pool,
            row_vals: head_dim,
        })?;
        Ok(Self::assemble(
            n_layers,
            kv_dim,
            head_dim,
            n_pool,
            ty,
            store,
            Some(lists),
        ))
    }

    /// The shape of this cache's store, to reallocate it elsewhere.
    pub fn store_shape(&self) -> StoreShape {
        StoreShape {
            ty: self.ty,
            n_rows: self.store.n_rows(),
            row_vals: self.store.row_vals(),
        }
    }

    fn assemble(
        n_layers: usize,
        kv_dim: usize,
        head_dim: usize,
        n_slots: usize,
        ty: KvType,
        store: Box<dyn KvStore>,
        streams: Option<StreamLists>,
    ) -> KvCache {
        KvCache {
            cells: KvCells::new(n_slots),
            n_layers,
            kv_dim,
            head_dim,
            ty,
            store,
            head_units: head_dim / ty.block_len(),
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

    /// Count the peak afresh from what the cache holds now: a session kept
    /// for another request (the server's prompt cache) reports that
    /// request's peak, not an earlier one's.
    pub fn restart_peak(&mut self) {
        self.peak_entries = self.cells.n_live();
        self.peak_live = self.resident_tokens();
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

    /// Drop every entry at a position ≥ `pos` (a rewind: chat, the
    /// server's prompt cache) through `apply`, then move each ring head
    /// back to the first row freed, so the tokens fed next take the rows
    /// a fresh run gives them: after a rewind the cache's memory layout,
    /// and so every result, is the fresh run's.
    pub fn rewind(&mut self, pos: usize) -> Result<()> {
        let victims = self.entries_in(pos, usize::MAX);
        self.apply(&victims, &[], &mut Vec::new())?;
        for &v in &victims {
            match &mut self.streams {
                Some(st) => st.rewind_head(v as usize),
                None => self.cells.rewind_head(v as usize),
            }
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

    /// Re-lay a token-uniform cache into `n_slots` slots, keeping every
    /// live token (packed to the front, in slot order, copied as stored).
    /// `map` receives (old slot, new slot) of every live token so per-slot
    /// state elsewhere (scorers, attention mass) can follow. Grows the cache
    /// for a prompt prefilled whole (`--prompt-compress once`) and shrinks
    /// it back to the budget once that prompt is compressed. Fails, leaving
    /// the cache untouched, when the live tokens do not fit.
    pub fn resize_slots(&mut self, n_slots: usize, map: &mut Vec<(u32, u32)>) -> Result<()> {
        if self.streams.is_some() {
            return Err(Error::Other("resize_slots on a stream cache".into()));
        }
        let n_live = self.cells.n_live();
        if n_live > n_slots {
            return Err(Error::Other(format!(
                "KV cache resize: {n_live} live tokens do not fit in {n_slots} slots"
            )));
        }
        let old_n = self.cells.n_slots();
        map.clear();
        map.extend(
            self.cells
                .live()
                .enumerate()
                .map(|(r, (s, _))| (s as u32, r as u32)),
        );
        let rows: Vec<(u32, u32)> = (0..self.n_layers)
            .flat_map(|l| {
                map.iter()
                    .map(move |&(f, t)| ((l * old_n) as u32 + f, (l * n_slots) as u32 + t))
            })
            .collect();
        let mut cells = KvCells::new(n_slots);
        for &(f, t) in map.iter() {
            let p = self.cells.pos(f as usize).unwrap_or(0);
            cells.set(t as usize, p);
        }
        self.store = self.store.resized(self.n_layers * n_slots, &rows);
        self.cells = cells;
        // refresh the live lists (no victims, no new tokens)
        self.apply(&[], &[], &mut Vec::new())
    }

    /// Re-lay a stream cache into `regions` (the same streams, other row
    /// counts), keeping every live entry, packed to the front of its region
    /// stream by stream (each stream's entries in position order), copied
    /// as stored. `map` receives (old pool slot, new pool slot) of every
    /// live entry. Fails, leaving the cache untouched, when a region cannot
    /// hold its streams' live entries.
    pub fn resize_regions(&mut self, regions: &[Region], map: &mut Vec<(u32, u32)>) -> Result<()> {
        let (lists, cells) = self.packed(regions, map)?;
        self.store = self.store.resized(lists.n_rows(), map);
        self.cells = cells;
        self.streams = Some(lists);
        Ok(())
    }

    /// Defragment a stream cache in place when some region serves more
    /// than one stream: every region's live entries are packed to its
    /// front stream by stream, so each stream's rows are contiguous
    /// (attention reads them as one run instead of rows scattered over the
    /// pool) and the free rows are one run at the region's end, where new
    /// entries go. Evictions under a budget shared by many streams
    /// (dbtrimkv's global one, adakv's per layer) scatter the streams' rows;
    /// dbtrimkv then decoded at 94% of window's speed at the same memory,
    /// packed at 98–99% (`defragment` says when to pack). `map`
    /// receives (old pool slot, new pool slot) of every live entry; returns
    /// whether anything moved (token-uniform caches never do).
    pub fn compact(&mut self, map: &mut Vec<(u32, u32)>) -> Result<bool> {
        map.clear();
        let Some(st) = &self.streams else {
            return Ok(false);
        };
        if st.regions().iter().all(|r| r.n_streams <= 1) {
            return Ok(false);
        }
        let regions = st.regions().to_vec();
        let (lists, cells) = self.packed(&regions, map)?;
        if map.iter().all(|&(f, t)| f == t) {
            if let Some(st) = &mut self.streams {
                st.reset_pushed();
            }
            return Ok(false);
        }
        self.store.permute(map);
        self.cells = cells;
        self.streams = Some(lists);
        Ok(true)
    }

    /// `compact` once it pays: when a region serves several streams and
    /// at least a sixteenth of the live entries were written since the
    /// last packing (each such entry landed in a hole of some other
    /// stream's run, or after them all). With the default batched eviction
    /// (every budget/8 steps) that is every eviction event; evicting at
    /// every step it is every budget/16 steps or so, so copying the live
    /// rows stays a small fraction of what attention reads meanwhile.
    pub fn defragment(&mut self, map: &mut Vec<(u32, u32)>) -> Result<bool> {
        let due = self
            .streams
            .as_ref()
            .is_some_and(|st| st.pushed() * 16 >= self.cells.n_live());
        if !due {
            map.clear();
            return Ok(false);
        }
        self.compact(map)
    }

    /// The metadata of this stream cache re-laid into `regions` (same
    /// streams), each region's live entries packed to its front stream by
    /// stream in position order; `map` gets (old slot, new slot) of every
    /// live entry, sorted by old slot. The store is not touched.
    fn packed(
        &self,
        regions: &[Region],
        map: &mut Vec<(u32, u32)>,
    ) -> Result<(StreamLists, KvCells)> {
        let Some(st) = &self.streams else {
            return Err(Error::Other(
                "resize_regions on a token-uniform cache".into(),
            ));
        };
        let old = st.regions();
        if old.len() != regions.len()
            || old
                .iter()
                .zip(regions)
                .any(|(a, b)| (a.first_stream, a.n_streams) != (b.first_stream, b.n_streams))
        {
            return Err(Error::Other(
                "KV cache resize: regions must serve the same streams".into(),
            ));
        }
        // new slot of every old pool row (u32::MAX: free)
        let mut new_of = vec![u32::MAX; st.n_rows()];
        map.clear();
        let mut base = 0usize;
        for (ri, r) in regions.iter().enumerate() {
            let live: usize = (r.first_stream..r.first_stream + r.n_streams)
                .map(|s| st.len(s))
                .sum();
            if live > r.rows {
                return Err(Error::Other(format!(
                    "KV cache resize: region {ri} holds {live} entries, more than {} rows",
                    r.rows
                )));
            }
            let mut t = base as u32;
            for s in r.first_stream..r.first_stream + r.n_streams {
                for &sl in st.stream(s).0 {
                    new_of[sl as usize] = t;
                    map.push((sl, t));
                    t += 1;
                }
            }
            base += r.rows;
        }
        map.sort_unstable();
        // pushed stream by stream in position order, i.e. in new-slot
        // order: each region's ring head ends after its last entry, so new
        // entries fill the free run at its end
        let mut lists = StreamLists::new(self.n_layers, self.n_kv_heads, regions);
        let mut cells = KvCells::new(lists.n_rows());
        for s in 0..st.n_streams() {
            let (sl, ps) = st.stream(s);
            for (&o, &p) in sl.iter().zip(ps) {
                let t = new_of[o as usize];
                cells.set(t as usize, p);
                lists.push(s, t, p);
            }
        }
        lists.reset_pushed();
        Ok((lists, cells))
    }

    /// The keys KV head `g` of `layer` attends over, by position or
    /// (`memory_order`) by slot: token-uniform caches give the shared live
    /// list, stream caches the stream's own.
    #[inline]
    pub fn head(&self, layer: usize, g: usize, memory_order: bool) -> HeadView<'_> {
        let hu = self.head_units;
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
                    stride: self.n_kv_heads * hu,
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
        let hd = self.head_dim;
        for g in 0..self.n_kv_heads {
            let sl = step_slots[st.id(layer, g) * n + i] as usize;
            let r = g * hd..(g + 1) * hd;
            self.store.write(sl, 0, &k[r.clone()], &v[r]);
        }
    }

    /// Key (or value) row of KV head `g` of (layer, slot) as f32 into `out`
    /// (head_dim), for either layout.
    pub fn head_f32(&self, key: bool, layer: usize, g: usize, slot: usize, out: &mut [f32]) {
        self.read_heads(key, layer, g, &[slot as u32], out)
    }

    /// Key (or value) rows of KV head `g` of `layer` for every slot of
    /// `slots` as f32 into `out` ((slots.len(), head_dim)): one batched
    /// read of the store, whatever device holds it.
    pub fn read_heads(&self, key: bool, layer: usize, g: usize, slots: &[u32], out: &mut [f32]) {
        let hd = self.head_dim;
        let out = &mut out[..slots.len() * hd];
        match &self.streams {
            Some(_) => self.store.read(key, 0, slots, 0, hd, out),
            None => self
                .store
                .read(key, self.layer_base(layer), slots, g * hd, hd, out),
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

    /// First store row of `layer` (token-uniform: layer · n_slots; the
    /// stream pool serves every layer from row 0).
    #[inline]
    pub fn layer_base(&self, layer: usize) -> usize {
        if self.streams.is_some() {
            0
        } else {
            layer * self.cells.n_slots()
        }
    }

    /// The K/V store.
    pub fn store(&self) -> &dyn KvStore {
        &*self.store
    }

    /// Store one token's K and V rows (kv_dim each) for `layer`
    /// (token-uniform layout; streams write through `write_token`).
    pub fn write(&mut self, layer: usize, slot: usize, k: &[f32], v: &[f32]) {
        debug_assert!(self.streams.is_none());
        let d = self.kv_dim;
        let row = self.layer_base(layer) + slot;
        self.store.write(row, 0, &k[..d], &v[..d]);
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
        let d = self.kv_dim;
        let row = [slot as u32];
        self.store
            .read(key, self.layer_base(layer), &row, 0, d, &mut out[..d]);
    }
}

/// The q8_0 block constraint: blocks must not straddle heads.
fn check_type(ty: KvType, kv_dim: usize, head_dim: usize) -> Result<()> {
    let bl = ty.block_len();
    if head_dim == 0 || !head_dim.is_multiple_of(bl) || !kv_dim.is_multiple_of(bl) {
        return Err(Error::arg(
            "--cache-type",
            format!(
                "{ty} stores blocks of {bl} values, but this model's head_dim {head_dim} (kv_dim {kv_dim}) is not a multiple of {bl}: use f16 or f32"
            ),
        ));
    }
    Ok(())
}

/// A host-memory store (the CPU backend's).
fn cpu_store(s: StoreShape) -> Result<Box<dyn KvStore>> {
    Ok(Box::new(crate::backend::cpu::kv_store::CpuKv::new(
        s.ty, s.n_rows, s.row_vals,
    )))
}

impl KvAccess for KvCache {
    fn head(&self, layer: usize, g: usize, memory_order: bool) -> HeadView<'_> {
        KvCache::head(self, layer, g, memory_order)
    }
    fn n_layers(&self) -> usize {
        self.n_layers
    }
    fn live_positions(&self) -> &[i64] {
        &self.live_pos
    }
    fn n_slots(&self) -> usize {
        self.cells.n_slots()
    }
    fn layer_base(&self, layer: usize) -> usize {
        KvCache::layer_base(self, layer)
    }
    fn store(&self) -> &dyn KvStore {
        &*self.store
    }
    fn write_token(
        &mut self,
        layer: usize,
        i: usize,
        n: usize,
        slots: &[u32],
        k: &[f32],
        v: &[f32],
    ) {
        KvCache::write_token(self, layer, i, n, slots, k, v)
    }
    fn write_units(&self, layer: usize, n: usize, slots: &[u32], out: &mut Vec<u64>) {
        let (hu, nk) = (self.head_units as u64, self.n_kv_heads);
        out.clear();
        for i in 0..n {
            for g in 0..nk {
                out.push(match &self.streams {
                    // a stream's row holds one head
                    Some(st) => slots[st.id(layer, g) * n + i] as u64 * hu,
                    // a token's row holds every head, in order
                    None => {
                        let row = (self.layer_base(layer) + slots[i] as usize) as u64;
                        (row * nk as u64 + g as u64) * hu
                    }
                });
            }
        }
    }
}
