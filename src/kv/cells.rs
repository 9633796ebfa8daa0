//! KV slot metadata: which absolute position lives in which slot.
//!
//! Plain Rust, no tensors. Storage (`super::KvStorage`) is indexed by slot;
//! this map says what each slot holds. Free slots are found ring-style from
//! `head`, so a freed slot is reused without moving any data. The only
//! mutations are `set` and `free`, called from `KvCache::commit` (the single
//! mutation point of the cache); each asserts its preconditions.

/// Slot → absolute position map with a ring search head.
#[derive(Clone, Debug)]
pub struct KvCells {
    /// (n_slots,) absolute position held by each slot, -1 when free.
    pos: Vec<i64>,
    /// Next slot to try when looking for a free one.
    head: usize,
    /// Number of occupied slots.
    n_live: usize,
}

impl KvCells {
    /// `n_slots` free slots.
    pub fn new(n_slots: usize) -> KvCells {
        KvCells {
            pos: vec![-1; n_slots],
            head: 0,
            n_live: 0,
        }
    }
    /// Capacity in slots.
    pub fn n_slots(&self) -> usize {
        self.pos.len()
    }
    /// Occupied slots.
    pub fn n_live(&self) -> usize {
        self.n_live
    }
    /// Ring head (next slot the search starts from).
    pub fn head(&self) -> usize {
        self.head
    }
    /// Position held by `slot`, if any.
    pub fn pos(&self, slot: usize) -> Option<i64> {
        let p = self.pos[slot];
        (p >= 0).then_some(p)
    }
    /// The first free slot at or after the head (wrapping), if any.
    pub fn find_free(&self) -> Option<usize> {
        let n = self.pos.len();
        (0..n)
            .map(|i| (self.head + i) % n)
            .find(|&s| self.pos[s] < 0)
    }
    /// Occupy a free slot with `pos`; the head moves past it.
    pub fn set(&mut self, slot: usize, pos: i64) {
        assert!(pos >= 0, "negative position {pos}");
        assert!(
            self.pos[slot] < 0,
            "slot {slot} already holds position {}",
            self.pos[slot]
        );
        self.pos[slot] = pos;
        self.n_live += 1;
        self.head = (slot + 1) % self.pos.len();
    }
    /// Free an occupied slot.
    pub fn free(&mut self, slot: usize) {
        assert!(self.pos[slot] >= 0, "slot {slot} is already free");
        self.pos[slot] = -1;
        self.n_live -= 1;
    }
    /// Move the head back to `slot` if it is before it: after a rewind
    /// freed the tail, the next tokens take the slots they would have had
    /// in a fresh run, so the memory order (and any sum taken in it) is
    /// the same.
    pub fn rewind_head(&mut self, slot: usize) {
        self.head = self.head.min(slot);
    }
    /// Free every slot and reset the head.
    pub fn clear(&mut self) {
        self.pos.fill(-1);
        self.head = 0;
        self.n_live = 0;
    }
    /// Occupied (slot, pos) pairs in slot order.
    pub fn live(&self) -> impl Iterator<Item = (usize, i64)> + '_ {
        self.pos
            .iter()
            .enumerate()
            .filter(|(_, &p)| p >= 0)
            .map(|(s, &p)| (s, p))
    }
}
