//! Per-(layer, KV-head) streams: the metadata of a head-granular cache.
//!
//! In this layout every (layer l, KV head h) pair is its own stream s =
//! l · n_kv_heads + h holding its own set of tokens, and storage is one pool
//! of rows of `head_dim` values shared by all streams (paged attention with
//! one-row pages). A pool slot belongs to at most one stream at a time;
//! `KvCells` (the same ring map as the token-uniform cache) says which
//! position it holds and `owner` which stream. Each stream keeps its live
//! slots in position order, so attention and scorers walk a stream without
//! searching the pool. Evicting an entry frees its pool slot for any stream:
//! memory really is released, and streams can hold different numbers of
//! tokens (head-adaptive and global budgets).
//!
//! The pool is cut into regions, one per budget group of streams (one
//! stream for SnapKV, a layer's heads for AdaKV): a stream's rows stay in
//! its region, found ring-style from the region's head, so its attention
//! reads stay local however scattered its evictions are, and a region's
//! size is its group's budget.
//!
//! Plain Rust, no tensors; only `KvCache::apply` mutates it.

/// A contiguous range of pool rows serving consecutive streams (the
/// streams of one budget group): keeping a stream's rows together keeps its
/// attention reads local, however scattered its evictions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region {
    /// First stream served.
    pub first_stream: usize,
    /// Streams served.
    pub n_streams: usize,
    /// Pool rows.
    pub rows: usize,
}

/// Per-stream live lists and pool ownership.
#[derive(Clone, Debug)]
pub struct StreamLists {
    /// KV heads per layer (streams per layer).
    pub n_kv_heads: usize,
    /// (n_regions,) regions, in stream order, covering every stream.
    regions: Vec<Region>,
    /// (n_regions,) first pool row of each region.
    base: Vec<usize>,
    /// (n_regions,) ring head (next row to try) of each region, relative.
    rhead: Vec<usize>,
    /// (n_streams,) region of each stream.
    region_of: Vec<u32>,
    /// (n_streams,) live pool slots of each stream in slot (memory) order,
    /// and their positions: decoding walks rows in memory order.
    mslots: Vec<Vec<u32>>,
    mpos: Vec<Vec<i64>>,
    /// (n_pool,) stream owning each pool slot (meaningful while it is live).
    owner: Vec<u32>,
    /// (n_streams,) live pool slots of each stream, ordered by position.
    slots: Vec<Vec<u32>>,
    /// (n_streams,) positions matching `slots`.
    pos: Vec<Vec<i64>>,
    /// (n_streams,) scratch: whether the stream lost entries this step.
    touched: Vec<bool>,
    /// Entries pushed since the lists were made (or last packed).
    pushed: usize,
}

impl StreamLists {
    /// Empty lists for `n_layers` × `n_kv_heads` streams served by
    /// `regions` (consecutive, covering every stream once).
    pub fn new(n_layers: usize, n_kv_heads: usize, regions: &[Region]) -> StreamLists {
        let n = n_layers * n_kv_heads;
        let mut region_of = vec![u32::MAX; n];
        let mut base = Vec::with_capacity(regions.len());
        let mut at = 0;
        for (i, r) in regions.iter().enumerate() {
            for s in r.first_stream..(r.first_stream + r.n_streams).min(n) {
                region_of[s] = i as u32;
            }
            base.push(at);
            at += r.rows;
        }
        assert!(
            region_of.iter().all(|&r| r != u32::MAX),
            "regions must cover every stream"
        );
        StreamLists {
            n_kv_heads,
            regions: regions.to_vec(),
            base,
            rhead: vec![0; regions.len()],
            region_of,
            mslots: vec![Vec::new(); n],
            mpos: vec![Vec::new(); n],
            owner: vec![u32::MAX; at],
            slots: vec![Vec::new(); n],
            pos: vec![Vec::new(); n],
            touched: vec![false; n],
            pushed: 0,
        }
    }

    /// Entries pushed since the lists were made or `reset_pushed` was called.
    pub fn pushed(&self) -> usize {
        self.pushed
    }

    /// Start counting pushes again (the lists were just packed).
    pub(super) fn reset_pushed(&mut self) {
        self.pushed = 0;
    }

    /// Pool rows of all regions.
    pub fn n_rows(&self) -> usize {
        self.owner.len()
    }

    /// The regions.
    pub fn regions(&self) -> &[Region] {
        &self.regions
    }

    /// Region serving stream `s`.
    #[inline]
    pub fn region_of(&self, s: usize) -> usize {
        self.region_of[s] as usize
    }

    /// Live slots and positions of stream `s`, in slot (memory) order.
    #[inline]
    pub fn stream_by_slot(&self, s: usize) -> (&[u32], &[i64]) {
        (&self.mslots[s], &self.mpos[s])
    }

    /// The first free row of stream `s`'s region at or after the region's
    /// ring head (wrapping), if any; `is_free` says whether a pool row is free.
    pub(super) fn find_free(&self, s: usize, is_free: impl Fn(usize) -> bool) -> Option<usize> {
        let ri = self.region_of[s] as usize;
        let (b, n, h) = (self.base[ri], self.regions[ri].rows, self.rhead[ri]);
        (0..n).map(|i| b + (h + i) % n).find(|&sl| is_free(sl))
    }

    /// Number of streams (n_layers · n_kv_heads).
    pub fn n_streams(&self) -> usize {
        self.slots.len()
    }

    /// Stream of (layer, KV head).
    #[inline]
    pub fn id(&self, layer: usize, head: usize) -> usize {
        layer * self.n_kv_heads + head
    }

    /// Live slots and positions of stream `s`, in position order.
    #[inline]
    pub fn stream(&self, s: usize) -> (&[u32], &[i64]) {
        (&self.slots[s], &self.pos[s])
    }

    /// Live entries of stream `s`.
    #[inline]
    pub fn len(&self, s: usize) -> usize {
        self.slots[s].len()
    }

    /// Whether every stream is empty.
    pub fn is_empty(&self) -> bool {
        self.slots.iter().all(|v| v.is_empty())
    }

    /// Stream owning pool slot `slot`.
    #[inline]
    pub fn owner(&self, slot: usize) -> usize {
        self.owner[slot] as usize
    }

    /// Drop every entry.
    pub fn clear(&mut self) {
        for v in &mut self.slots {
            v.clear();
        }
        for v in &mut self.pos {
            v.clear();
        }
        for v in &mut self.mslots {
            v.clear();
        }
        for v in &mut self.mpos {
            v.clear();
        }
        self.rhead.fill(0);
        self.owner.fill(u32::MAX);
        self.pushed = 0;
    }

    /// Remove freed pool slots (`freed`, whose owners are still recorded)
    /// from their streams' lists, keeping position order.
    pub(super) fn remove(&mut self, freed: &[u32], is_live: impl Fn(usize) -> bool) {
        for &v in freed {
            self.touched[self.owner[v as usize] as usize] = true;
        }
        for s in 0..self.slots.len() {
            if !std::mem::take(&mut self.touched[s]) {
                continue;
            }
            retain_live(&mut self.slots[s], &mut self.pos[s], &is_live);
            retain_live(&mut self.mslots[s], &mut self.mpos[s], &is_live);
        }
        for &v in freed {
            self.owner[v as usize] = u32::MAX;
        }
    }

    /// Move the ring head of `slot`'s region back to it if it is before
    /// the head (see `KvCells::rewind_head`).
    pub(super) fn rewind_head(&mut self, slot: usize) {
        let within =
            |ri: usize| (self.base[ri]..self.base[ri] + self.regions[ri].rows).contains(&slot);
        if let Some(ri) = (0..self.regions.len()).find(|&ri| within(ri)) {
            self.rhead[ri] = self.rhead[ri].min(slot - self.base[ri]);
        }
    }

    /// Append a new entry (its position is after every entry of the
    /// stream); the region's ring head moves past its row.
    pub(super) fn push(&mut self, s: usize, slot: u32, pos: i64) {
        debug_assert!(self.pos[s].last().is_none_or(|&p| p < pos));
        self.pushed += 1;
        self.owner[slot as usize] = s as u32;
        self.slots[s].push(slot);
        self.pos[s].push(pos);
        let at = self.mslots[s].partition_point(|&x| x < slot);
        self.mslots[s].insert(at, slot);
        self.mpos[s].insert(at, pos);
        let ri = self.region_of[s] as usize;
        self.rhead[ri] = (slot as usize + 1 - self.base[ri]) % self.regions[ri].rows;
    }
}

/// Keep the (slot, position) pairs whose slot is still live, in order.
fn retain_live(sl: &mut Vec<u32>, ps: &mut Vec<i64>, is_live: &impl Fn(usize) -> bool) {
    let mut w = 0;
    for r in 0..sl.len() {
        if is_live(sl[r] as usize) {
            sl[w] = sl[r];
            ps[w] = ps[r];
            w += 1;
        }
    }
    sl.truncate(w);
    ps.truncate(w);
}
