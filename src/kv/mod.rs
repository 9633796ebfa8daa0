//! The KV cache: slot metadata (`cells`) kept apart from K/V storage.
//!
//! Keys are stored after RoPE, at their absolute positions, so evicting a
//! token (freeing its slot) never moves or re-rotates data. Storage is f16,
//! laid out (n_layers, n_slots, kv_dim) for K and for V.
//!
//! Protocol for a forward step over `n` new tokens: `apply(victims,
//! positions)` frees the evicted slots and picks slots for the new tokens (it
//! is the only place that mutates `cells`); the forward pass then writes each
//! layer's K/V rows into those slots and attends over `live()`. Freed slots
//! are reused ring-style, so eviction never moves data.

pub mod cells;

use crate::error::{Error, Result};
use cells::KvCells;
use half::f16;

/// K/V storage plus slot metadata.
#[derive(Debug, Clone)]
pub struct KvCache {
    pub cells: KvCells,
    pub n_layers: usize,
    /// n_kv_heads * head_dim.
    pub kv_dim: usize,
    /// Dimensions per KV head.
    pub head_dim: usize,
    /// (n_layers, n_slots, kv_dim) keys after RoPE.
    k: Vec<f16>,
    /// (n_layers, n_slots, kv_dim) values.
    v: Vec<f16>,
    /// (n_live,) slots of the live entries, ordered by position (rebuilt by `reserve`).
    live_slots: Vec<u32>,
    /// (n_live,) absolute positions matching `live_slots`.
    live_pos: Vec<i64>,
    /// (n_live,) the live slots in slot (memory) order, and their positions:
    /// decoding attends to every live token, and walking K/V rows in memory
    /// order keeps the hardware prefetcher useful after scattered evictions.
    slot_order: Vec<u32>,
    slot_order_pos: Vec<i64>,
    /// Most tokens ever resident at once since the last `clear`.
    pub peak_live: usize,
}

impl KvCache {
    /// A cache of `n_slots` slots per layer, each holding `kv_dim` =
    /// n_kv_heads * `head_dim` values of K and of V.
    pub fn new(n_layers: usize, kv_dim: usize, head_dim: usize, n_slots: usize) -> KvCache {
        let n = n_layers * n_slots * kv_dim;
        KvCache {
            cells: KvCells::new(n_slots),
            n_layers,
            kv_dim,
            head_dim,
            k: vec![f16::ZERO; n],
            v: vec![f16::ZERO; n],
            live_slots: Vec::new(),
            live_pos: Vec::new(),
            slot_order: Vec::new(),
            slot_order_pos: Vec::new(),
            peak_live: 0,
        }
    }

    /// Bytes of K/V storage held by one resident token (all layers).
    pub fn bytes_per_token(&self) -> usize {
        2 * self.n_layers * self.kv_dim * std::mem::size_of::<f16>()
    }

    /// Drop every cached token.
    pub fn clear(&mut self) {
        self.cells.clear();
        self.live_slots.clear();
        self.live_pos.clear();
        self.slot_order.clear();
        self.slot_order_pos.clear();
        self.peak_live = 0;
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
        // position order: sort slot indices by position
        let pos_of = &self.slot_order_pos;
        let mut idx: Vec<u32> = (0..pos_of.len() as u32).collect();
        idx.sort_unstable_by_key(|&i| pos_of[i as usize]);
        self.live_slots.clear();
        self.live_pos.clear();
        for i in idx {
            self.live_slots.push(self.slot_order[i as usize]);
            self.live_pos.push(self.slot_order_pos[i as usize]);
        }
        Ok(())
    }

    /// Live slots in slot (memory) order, with their positions.
    pub fn live_by_slot(&self) -> (&[u32], &[i64]) {
        (&self.slot_order, &self.slot_order_pos)
    }

    /// Live slots ordered by position, with their positions.
    pub fn live(&self) -> (&[u32], &[i64]) {
        (&self.live_slots, &self.live_pos)
    }

    #[inline]
    fn off(&self, layer: usize, slot: usize) -> usize {
        (layer * self.cells.n_slots() + slot) * self.kv_dim
    }

    /// Store one token's K and V rows (kv_dim each) for `layer`.
    pub fn write(&mut self, layer: usize, slot: usize, k: &[f32], v: &[f32]) {
        let o = self.off(layer, slot);
        let d = self.kv_dim;
        for (dst, &x) in self.k[o..o + d].iter_mut().zip(k) {
            *dst = f16::from_f32(x);
        }
        for (dst, &x) in self.v[o..o + d].iter_mut().zip(v) {
            *dst = f16::from_f32(x);
        }
    }

    /// Key row of (layer, slot), kv_dim long.
    #[inline]
    pub fn k_row(&self, layer: usize, slot: usize) -> &[f16] {
        let o = self.off(layer, slot);
        &self.k[o..o + self.kv_dim]
    }

    /// Value row of (layer, slot), kv_dim long.
    #[inline]
    pub fn v_row(&self, layer: usize, slot: usize) -> &[f16] {
        let o = self.off(layer, slot);
        &self.v[o..o + self.kv_dim]
    }
}
