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
//! Plain Rust, no tensors; only `KvCache::apply` mutates it.

/// Per-stream live lists and pool ownership.
#[derive(Clone, Debug)]
pub struct StreamLists {
    /// KV heads per layer (streams per layer).
    pub n_kv_heads: usize,
    /// (n_pool,) stream owning each pool slot (meaningful while it is live).
    owner: Vec<u32>,
    /// (n_streams,) live pool slots of each stream, ordered by position.
    slots: Vec<Vec<u32>>,
    /// (n_streams,) positions matching `slots`.
    pos: Vec<Vec<i64>>,
    /// (n_streams,) scratch: whether the stream lost entries this step.
    touched: Vec<bool>,
}

impl StreamLists {
    /// Empty lists for `n_layers` × `n_kv_heads` streams over `n_pool` slots.
    pub fn new(n_layers: usize, n_kv_heads: usize, n_pool: usize) -> StreamLists {
        let n = n_layers * n_kv_heads;
        StreamLists {
            n_kv_heads,
            owner: vec![u32::MAX; n_pool],
            slots: vec![Vec::new(); n],
            pos: vec![Vec::new(); n],
            touched: vec![false; n],
        }
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
        self.owner.fill(u32::MAX);
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
            let (sl, ps) = (&mut self.slots[s], &mut self.pos[s]);
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
        for &v in freed {
            self.owner[v as usize] = u32::MAX;
        }
    }

    /// Append a new entry (its position is after every entry of the stream).
    pub(super) fn push(&mut self, s: usize, slot: u32, pos: i64) {
        debug_assert!(self.pos[s].last().is_none_or(|&p| p < pos));
        self.owner[slot as usize] = s as u32;
        self.slots[s].push(slot);
        self.pos[s].push(pos);
    }
}
