//! Per-slot KV cache with explicit capacity accounting and speculation.
//!
//! # Ownership and invariants
//! - Owned by the engine thread; nothing else touches it.
//! - Capacity is counted in tokens (one token = K and V for every layer). A
//!   slot *reserves* its worst case (prompt + max new tokens) when it is
//!   allocated, so a running sequence can never run out mid-generation;
//!   `reserved_tokens() <= capacity_tokens()` always holds, and freeing a
//!   slot returns its reservation.
//! - K and V are laid out `[tokens, kv_heads, head_dim]` per layer
//!   (token-major, so appending a chunk is one contiguous copy and
//!   attention reads a prefix without copying), in one of two storages:
//!   - **per slot** (CPU): each slot has its own buffers, grown
//!     geometrically up to the reservation; the lean CPU kernels read them;
//!   - **pooled** (GPUs): one buffer per layer for all slots, each slot
//!     owning a contiguous range the size of its reservation, so that one
//!     gather reads every sequence's keys of a batch (batched attention in
//!     one launch per op instead of one per sequence). The pool grows to
//!     its high-water mark, first fit from the front; when free space is
//!     only fragmented the live ranges are compacted (rare: a copy of their
//!     valid rows).
//!
//!   Either way rows past `len` are garbage.
//! - `len` is the number of positions whose K/V are valid. Forward passes
//!   append at `len`. Speculation: [`KvCache::begin`] remembers `len`, drafts
//!   are appended like any tokens, and [`KvCache::commit`]`(j)` sets `len` back
//!   to the remembered value + j, which leaves the cache exactly as if only
//!   the j accepted tokens had been fed (stale rows are overwritten later).

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};

use crate::slot::SlotId;

/// KV cache errors; the engine maps them to per-sequence failures.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum KvError {
    #[error(
        "KV cache exhausted: {requested} tokens requested, {available} of {capacity} available"
    )]
    Exhausted {
        requested: usize,
        available: usize,
        capacity: usize,
    },
    #[error("slot {0} already has a KV allocation")]
    AlreadyAllocated(SlotId),
    #[error("slot {0} has no KV allocation")]
    UnknownSlot(SlotId),
    #[error("slot {slot} needs {needed} KV tokens but reserved {reserved}")]
    OverReservation {
        slot: SlotId,
        reserved: usize,
        needed: usize,
    },
    #[error("slot {slot}: commit of {accepted} tokens but only {fed} were fed since begin")]
    BadCommit {
        slot: SlotId,
        accepted: usize,
        fed: usize,
    },
    #[error("slot {0}: commit without begin")]
    NoSpeculation(SlotId),
    #[error("tensor error in KV cache: {0}")]
    Tensor(String),
}

impl From<candle_core::Error> for KvError {
    fn from(e: candle_core::Error) -> Self {
        KvError::Tensor(e.to_string())
    }
}

/// Shape of one token's KV entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    pub num_layers: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub dtype: DType,
}

impl KvLayout {
    /// Bytes one token occupies (K and V, all layers).
    pub fn bytes_per_token(&self) -> usize {
        2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.size_in_bytes()
    }
}

/// Smallest buffer a slot starts with, in tokens.
const MIN_ALLOC_TOKENS: usize = 64;

struct SlotKv {
    /// Per layer: (K, V), each `[alloc, kv_heads, head_dim]` (per-slot storage only).
    layers: Vec<(Tensor, Tensor)>,
    /// Rows usable without growing: the buffers' length (per slot) or the
    /// reservation (pooled).
    alloc: usize,
    /// First pool row of the slot's range (pooled storage only).
    base: usize,
    len: usize,
    reserved: usize,
    /// `len` when speculation began.
    spec_start: Option<usize>,
}

/// Smallest pool, in tokens.
const MIN_POOL_TOKENS: usize = 256;

/// The shared buffers of pooled storage.
struct Pool {
    /// Per layer: (K, V), each `[rows, kv_heads, head_dim]`.
    layers: Vec<(Tensor, Tensor)>,
    rows: usize,
}

/// The KV caches of every slot.
pub struct KvCache {
    layout: KvLayout,
    device: Device,
    capacity: usize,
    reserved: usize,
    slots: HashMap<SlotId, SlotKv>,
    /// `Some` for pooled storage.
    pool: Option<Pool>,
}

impl KvCache {
    /// An empty cache holding at most `capacity_tokens` tokens in total:
    /// per-slot storage on the CPU, pooled elsewhere.
    pub fn new(layout: KvLayout, device: Device, capacity_tokens: usize) -> Self {
        if device.is_cpu() {
            Self::per_slot(layout, device, capacity_tokens)
        } else {
            Self::pooled(layout, device, capacity_tokens)
        }
    }

    /// Per-slot storage on any device.
    pub fn per_slot(layout: KvLayout, device: Device, capacity_tokens: usize) -> Self {
        Self {
            layout,
            device,
            capacity: capacity_tokens,
            reserved: 0,
            slots: HashMap::new(),
            pool: None,
        }
    }

    /// Pooled storage on any device (the batched attention path reads it).
    pub fn pooled(layout: KvLayout, device: Device, capacity_tokens: usize) -> Self {
        Self {
            pool: Some(Pool {
                layers: Vec::new(),
                rows: 0,
            }),
            ..Self::per_slot(layout, device, capacity_tokens)
        }
    }

    /// Whether every slot lives in one buffer per layer.
    pub fn is_pooled(&self) -> bool {
        self.pool.is_some()
    }

    /// Pooled storage: layer `layer`'s (K, V) buffers `[rows, kv_heads,
    /// head_dim]` shared by all slots; `None` for per-slot storage.
    pub fn pool_layer(&self, layer: usize) -> Option<(&Tensor, &Tensor)> {
        let pool = self.pool.as_ref()?;
        pool.layers.get(layer).map(|(k, v)| (k, v))
    }

    /// Pooled storage: the pool row of the slot's position 0.
    pub fn pool_base(&self, slot: SlotId) -> Result<usize, KvError> {
        self.slots
            .get(&slot)
            .map(|s| s.base)
            .ok_or(KvError::UnknownSlot(slot))
    }

    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    pub fn capacity_tokens(&self) -> usize {
        self.capacity
    }

    /// Tokens reserved by all allocated slots.
    pub fn reserved_tokens(&self) -> usize {
        self.reserved
    }

    pub fn available_tokens(&self) -> usize {
        self.capacity - self.reserved
    }

    /// Reserves `reserve_tokens` for a new slot.
    pub fn allocate(&mut self, slot: SlotId, reserve_tokens: usize) -> Result<(), KvError> {
        if self.slots.contains_key(&slot) {
            return Err(KvError::AlreadyAllocated(slot));
        }
        if reserve_tokens > self.available_tokens() {
            return Err(KvError::Exhausted {
                requested: reserve_tokens,
                available: self.available_tokens(),
                capacity: self.capacity,
            });
        }
        let (base, alloc) = match self.pool.is_some() {
            true => (self.place(reserve_tokens)?, reserve_tokens),
            false => (0, 0),
        };
        self.reserved += reserve_tokens;
        self.slots.insert(
            slot,
            SlotKv {
                layers: Vec::new(),
                alloc,
                base,
                len: 0,
                reserved: reserve_tokens,
                spec_start: None,
            },
        );
        Ok(())
    }

    /// Pooled storage: finds (first fit) or makes room for a range of
    /// `tokens` rows and returns its first row. The caller has checked the
    /// accounting, so compaction always makes room.
    fn place(&mut self, tokens: usize) -> Result<usize, KvError> {
        let mut ranges: Vec<(usize, usize)> =
            self.slots.values().map(|s| (s.base, s.reserved)).collect();
        ranges.sort_unstable();
        let mut at = 0;
        for &(base, len) in &ranges {
            if base >= at + tokens {
                break;
            }
            at = at.max(base + len);
        }
        if at + tokens > self.capacity {
            at = self.compact()?;
        }
        self.grow_pool(at + tokens)?;
        Ok(at)
    }

    /// Pooled storage: moves every slot's valid rows to the front, in pool
    /// order, and returns the first free row after them.
    fn compact(&mut self) -> Result<usize, KvError> {
        let mut order: Vec<(usize, SlotId)> =
            self.slots.iter().map(|(&id, s)| (s.base, id)).collect();
        order.sort_unstable();
        let layers = &self.pool.as_ref().expect("pooled").layers;
        let mut at = 0;
        for (base, id) in order {
            let s = self.slots.get_mut(&id).expect("listed slot");
            if base != at && s.len > 0 {
                for (k, v) in layers {
                    // Through a copy: the old and new ranges may overlap.
                    k.slice_set(&k.narrow(0, base, s.len)?.copy()?, 0, at)?;
                    v.slice_set(&v.narrow(0, base, s.len)?.copy()?, 0, at)?;
                }
            }
            s.base = at;
            at += s.reserved;
        }
        Ok(at)
    }

    /// Pooled storage: grows the buffers (geometrically, up to the
    /// capacity) to hold at least `rows` rows.
    fn grow_pool(&mut self, rows: usize) -> Result<(), KvError> {
        let layout = self.layout;
        let pool = self.pool.as_mut().expect("pooled");
        if rows <= pool.rows {
            return Ok(());
        }
        let new_rows = rows
            .max(2 * pool.rows)
            .max(MIN_POOL_TOKENS)
            .min(self.capacity.max(rows));
        let shape = (new_rows, layout.num_kv_heads, layout.head_dim);
        let mut layers = Vec::with_capacity(layout.num_layers);
        for l in 0..layout.num_layers {
            let k = Tensor::zeros(shape, layout.dtype, &self.device)?;
            let v = Tensor::zeros(shape, layout.dtype, &self.device)?;
            if let Some((old_k, old_v)) = pool.layers.get(l) {
                k.slice_set(old_k, 0, 0)?;
                v.slice_set(old_v, 0, 0)?;
            }
            layers.push((k, v));
        }
        pool.layers = layers;
        pool.rows = new_rows;
        Ok(())
    }

    /// Frees a slot and returns its reservation. Returns false if unknown.
    pub fn free(&mut self, slot: SlotId) -> bool {
        match self.slots.remove(&slot) {
            Some(s) => {
                self.reserved -= s.reserved;
                true
            }
            None => false,
        }
    }

    pub fn contains(&self, slot: SlotId) -> bool {
        self.slots.contains_key(&slot)
    }

    /// Valid positions of a slot.
    pub fn len(&self, slot: SlotId) -> Result<usize, KvError> {
        self.slots
            .get(&slot)
            .map(|s| s.len)
            .ok_or(KvError::UnknownSlot(slot))
    }

    /// Tokens reserved by a slot.
    pub fn reserved(&self, slot: SlotId) -> Result<usize, KvError> {
        self.slots
            .get(&slot)
            .map(|s| s.reserved)
            .ok_or(KvError::UnknownSlot(slot))
    }

    /// Makes room for `extra` more tokens after `len` (within the
    /// reservation), growing the buffers if needed. Call before writing.
    pub fn ensure_room(&mut self, slot: SlotId, extra: usize) -> Result<(), KvError> {
        let layout = self.layout;
        let device = self.device.clone();
        let s = self
            .slots
            .get_mut(&slot)
            .ok_or(KvError::UnknownSlot(slot))?;
        let needed = s.len + extra;
        if needed > s.reserved {
            return Err(KvError::OverReservation {
                slot,
                reserved: s.reserved,
                needed,
            });
        }
        if needed <= s.alloc {
            return Ok(());
        }
        // (Pooled slots hold their whole reservation: only per-slot buffers grow.)
        let new_alloc = needed
            .max(2 * s.alloc)
            .max(MIN_ALLOC_TOKENS)
            .min(s.reserved);
        let shape = (new_alloc, layout.num_kv_heads, layout.head_dim);
        let mut layers = Vec::with_capacity(layout.num_layers);
        for l in 0..layout.num_layers {
            let k = Tensor::zeros(shape, layout.dtype, &device)?;
            let v = Tensor::zeros(shape, layout.dtype, &device)?;
            if let Some((old_k, old_v)) = s.layers.get(l) {
                if s.len > 0 {
                    k.slice_set(&old_k.narrow(0, 0, s.len)?, 0, 0)?;
                    v.slice_set(&old_v.narrow(0, 0, s.len)?, 0, 0)?;
                }
            }
            layers.push((k, v));
        }
        s.layers = layers;
        s.alloc = new_alloc;
        Ok(())
    }

    /// Writes `k`, `v` (`[n, kv_heads, head_dim]`, contiguous) of `layer` at
    /// positions `[at, at + n)`. Room must have been ensured.
    pub fn write(
        &mut self,
        slot: SlotId,
        layer: usize,
        at: usize,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<(), KvError> {
        let s = self.slots.get(&slot).ok_or(KvError::UnknownSlot(slot))?;
        let n = k.dim(0)?;
        if at + n > s.alloc {
            return Err(KvError::OverReservation {
                slot,
                reserved: s.alloc,
                needed: at + n,
            });
        }
        let (kb, vb) = self.buffers(s, layer);
        kb.slice_set(k, 0, s.base + at)?;
        vb.slice_set(v, 0, s.base + at)?;
        Ok(())
    }

    /// K and V of `layer` for positions `[0, upto)`, as views
    /// `[upto, kv_heads, head_dim]` (no copy).
    pub fn view(
        &self,
        slot: SlotId,
        layer: usize,
        upto: usize,
    ) -> Result<(Tensor, Tensor), KvError> {
        let s = self.slots.get(&slot).ok_or(KvError::UnknownSlot(slot))?;
        if upto > s.alloc {
            return Err(KvError::OverReservation {
                slot,
                reserved: s.alloc,
                needed: upto,
            });
        }
        let (k, v) = self.buffers(s, layer);
        Ok((k.narrow(0, s.base, upto)?, v.narrow(0, s.base, upto)?))
    }

    /// The buffers holding a slot's rows (from row `s.base`).
    fn buffers<'a>(&'a self, s: &'a SlotKv, layer: usize) -> (&'a Tensor, &'a Tensor) {
        let (k, v) = match &self.pool {
            Some(pool) => &pool.layers[layer],
            None => &s.layers[layer],
        };
        (k, v)
    }

    /// Marks positions `[0, len)` valid (after a forward pass wrote them).
    pub fn set_len(&mut self, slot: SlotId, len: usize) -> Result<(), KvError> {
        let s = self
            .slots
            .get_mut(&slot)
            .ok_or(KvError::UnknownSlot(slot))?;
        if len > s.alloc {
            return Err(KvError::OverReservation {
                slot,
                reserved: s.alloc,
                needed: len,
            });
        }
        s.len = len;
        Ok(())
    }

    /// Starts speculation: tokens fed from now on can be rolled back.
    pub fn begin(&mut self, slot: SlotId) -> Result<(), KvError> {
        let s = self
            .slots
            .get_mut(&slot)
            .ok_or(KvError::UnknownSlot(slot))?;
        s.spec_start = Some(s.len);
        Ok(())
    }

    /// Ends speculation keeping the first `accepted` tokens fed since
    /// [`begin`](Self::begin).
    pub fn commit(&mut self, slot: SlotId, accepted: usize) -> Result<(), KvError> {
        let s = self
            .slots
            .get_mut(&slot)
            .ok_or(KvError::UnknownSlot(slot))?;
        let start = s.spec_start.take().ok_or(KvError::NoSpeculation(slot))?;
        let fed = s.len - start;
        if accepted > fed {
            s.spec_start = Some(start);
            return Err(KvError::BadCommit {
                slot,
                accepted,
                fed,
            });
        }
        s.len = start + accepted;
        Ok(())
    }
}
