//! The KV cache: K/V storage in fixed-size blocks, each slot reading and
//! writing through its block table, with speculation.
//!
//! # Ownership and invariants
//! - Owned by the engine thread; nothing else touches it.
//! - Storage: one buffer per layer for K and one for V, `[rows, kv_heads,
//!   head_dim]` (token-major), divided into blocks of `block_size` rows;
//!   the keys of a pool the lean CPU path owns are transposed within each
//!   block ([`KeyOrder::BlockLanes`]).
//!   Position `p` of a slot lives at row `table[p / block_size] *
//!   block_size + p % block_size`. A pool of known size (the engine's,
//!   `num_blocks`) is allocated whole the first time it grows: on CUDA a
//!   captured decode graph keeps the pool's addresses and every
//!   reallocation (a new [`pool_generation`](KvCache::pool_generation))
//!   drops them all (lazily grown, a warm engine's pool reached its last
//!   size late in its first run, and every shape captured before was
//!   captured again in the next); on the CPU its memory is left untouched
//!   until rows are written, so an idle pool costs address space, not
//!   memory, and no step stalls on a copy (each doubling had copied the
//!   pool into fresh memory: 1-2 s at 64 streams of SmolLM2 on a 2-core
//!   VM). A pool of no set size grows geometrically to the highest block
//!   in use, and so does one whose whole size the device or the host's
//!   overcommit policy refuses at once (a `--kv-tokens` larger than
//!   memory serves what fits instead of failing every request). Rows past
//!   a slot's `len` are garbage.
//! - Who decides the tables:
//!   - **external** ([`KvCache::paged`], the engine's cache): the
//!     scheduler's [`BlockPool`] owns the accounting, the prefix cache and
//!     preemption, and every plan carries the tables that changed
//!     ([`KvCache::set_table`]). Several slots may share a block (a cached
//!     prefix); the scheduler hands a slot shared blocks only for positions
//!     it will never write.
//!   - **own** ([`KvCache::new`]: draft heads, tests, one-off generation):
//!     the cache takes and returns blocks itself, and capacity is a token
//!     *reservation* per slot, as before paging ([`KvCache::allocate`]).
//! - `len` is the number of positions whose K/V are valid. Forward passes
//!   append at `len`. Speculation: [`KvCache::begin`] remembers `len`, drafts
//!   are appended like any tokens, and [`KvCache::commit`]`(j)` sets `len` back
//!   to the remembered value + j, which leaves the cache exactly as if only
//!   the j accepted tokens had been fed (stale rows are overwritten later;
//!   an own cache also returns the blocks only the rejected drafts used).
//! - **Hidden rows** ([`KvCache::store_hidden`], engines whose draft head
//!   drafts from the target's hidden states): one more buffer, `[rows,
//!   width]`, holds the target's last hidden state (pre-final-norm) of
//!   every position, at the same row as its K/V. Every forward pass writes
//!   the rows of every position it feeds (a CUDA graph's pass inside the
//!   graph, [`KvCache::mark_hidden_written`]; the engine otherwise, with
//!   [`KvCache::write_hidden_rows`]), so a row is valid exactly when
//!   the position's K/V is: a block shared from the prefix cache brings
//!   its hidden states along, and a draft head can catch up on positions
//!   it never saw computed.

pub mod blocks;

use std::collections::HashMap;
use std::ops::Range;

use candle_core::{DType, Device, Tensor};

pub use blocks::{blocks_for, BlockId, BlockPool, SeqBlocks, DEFAULT_BLOCK_SIZE};

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
    #[error("slot {slot}: block {block} is outside the pool of {blocks} blocks")]
    BadBlock {
        slot: SlotId,
        block: BlockId,
        blocks: usize,
    },
    #[error("slot {slot}: commit of {accepted} tokens but only {fed} were fed since begin")]
    BadCommit {
        slot: SlotId,
        accepted: usize,
        fed: usize,
    },
    #[error("slot {0}: commit without begin")]
    NoSpeculation(SlotId),
    #[error("slot {0}: a KV pool is driven by block tables or by reservations, never both")]
    Mixed(SlotId),
    #[error("tensor error in KV cache: {0}")]
    Tensor(String),
    #[error(
        "the KV pool stores its keys as {0:?}; this operation reads and writes them token-major"
    )]
    KeyOrder(KeyOrder),
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
    /// How the pool orders the keys (values are always token-major).
    pub keys: KeyOrder,
}

/// How a pool lays out its keys; the model whose passes write and read
/// them chooses ([`Model::kv_layout`](crate::model::Model::kv_layout)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KeyOrder {
    /// Token-major like the values, `[rows, kv_heads, head_dim]`: what
    /// candle ops and the GPU kernels read, and what [`KvCache::write`]
    /// and [`KvCache::view`] take.
    #[default]
    Rows,
    /// Each block's keys transposed, `[blocks][kv_heads · head_dim][block]`:
    /// a block's values of one key dimension in adjacent lanes, so the lean
    /// CPU path's attention scores a block's keys together without a
    /// horizontal sum (`model::kernels::scores`). Only the lean path reads
    /// and writes such a pool; blocks stay the unit, so tables, prefix
    /// sharing and growth (a prefix copy of whole blocks) are unchanged.
    BlockLanes,
}

impl KvLayout {
    /// Bytes one token occupies (K and V, all layers).
    pub fn bytes_per_token(&self) -> usize {
        2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.size_in_bytes()
    }
}

/// Smallest storage, in blocks.
const MIN_POOL_BLOCKS: usize = 16;

struct SlotKv {
    table: Vec<BlockId>,
    len: usize,
    /// Tokens reserved (own caches only).
    reserved: usize,
    /// `len` when speculation began.
    spec_start: Option<usize>,
}

/// Who hands out blocks.
enum Blocks {
    /// A pool of `num_blocks` whose first registration decides: a table
    /// ([`KvCache::register`]) makes it external, a reservation
    /// ([`KvCache::allocate`]) makes it own. Never both: the scheduler's
    /// cached blocks must not be handed out behind its back.
    Undecided { num_blocks: usize },
    /// The plan's tables; `num_blocks` bounds the ids.
    External { num_blocks: usize },
    /// The cache itself: freed ids (lowest reused first) and the next
    /// never-used id; capacity is a token reservation. `undecided`: the
    /// pool's size when it was undecided before, which it becomes again
    /// once its last slot is freed (a driver that warms an engine up with
    /// reservations leaves it free for the scheduler's tables).
    Own {
        free: std::collections::BTreeSet<BlockId>,
        next: BlockId,
        capacity: usize,
        reserved: usize,
        undecided: Option<usize>,
    },
}

impl Blocks {
    fn own(capacity: usize, undecided: Option<usize>) -> Self {
        Blocks::Own {
            free: Default::default(),
            next: 0,
            capacity,
            reserved: 0,
            undecided,
        }
    }
}

/// The KV caches of every slot.
pub struct KvCache {
    layout: KvLayout,
    device: Device,
    block_size: usize,
    blocks: Blocks,
    slots: HashMap<SlotId, SlotKv>,
    /// Per layer: (K, V), each `[rows, kv_heads, head_dim]`.
    layers: Vec<(Tensor, Tensor)>,
    /// The hidden rows, when stored: their width and dtype, and the buffer
    /// `[rows, width]` once storage exists.
    hidden: Option<HiddenRows>,
    rows: usize,
    /// Names the current pool buffers, unique across caches: it changes
    /// whenever they are reallocated, so whoever keeps their device
    /// addresses (a captured CUDA graph) knows they are stale.
    generation: u64,
}

/// Source of [`KvCache::pool_generation`]s.
static POOL_GENERATIONS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

fn next_pool_generation() -> u64 {
    POOL_GENERATIONS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// Contiguous runs of hidden rows [`KvCache::write_hidden_rows`] copies one
/// by one; past it one scatter (with its index upload) is cheaper.
const FEW_HIDDEN_RUNS: usize = 4;

/// The hidden-state buffer of [`KvCache::store_hidden`].
struct HiddenRows {
    width: usize,
    dtype: DType,
    buffer: Option<Tensor>,
    /// The last forward pass wrote its rows itself (a decode graph; see
    /// [`KvCache::mark_hidden_written`]).
    written: bool,
}

impl KvCache {
    /// A cache that manages its own blocks, holding at most
    /// `capacity_tokens` reserved tokens in total.
    pub fn new(layout: KvLayout, device: Device, capacity_tokens: usize) -> Self {
        Self::own(layout, device, capacity_tokens, DEFAULT_BLOCK_SIZE)
    }

    /// [`new`](Self::new) (kept for callers of the pre-paging API: every
    /// cache is one pool now).
    pub fn per_slot(layout: KvLayout, device: Device, capacity_tokens: usize) -> Self {
        Self::new(layout, device, capacity_tokens)
    }

    /// [`new`](Self::new) (as [`per_slot`](Self::per_slot)).
    pub fn pooled(layout: KvLayout, device: Device, capacity_tokens: usize) -> Self {
        Self::new(layout, device, capacity_tokens)
    }

    /// A self-managed cache with blocks of `block_size` tokens.
    pub fn own(
        layout: KvLayout,
        device: Device,
        capacity_tokens: usize,
        block_size: usize,
    ) -> Self {
        Self::build(
            layout,
            device,
            block_size,
            Blocks::own(capacity_tokens, None),
        )
    }

    /// A cache of `num_blocks` blocks of `block_size` tokens whose tables
    /// come from outside ([`set_table`](Self::set_table)), or, when its
    /// driver reserves tokens instead ([`allocate`](Self::allocate)), that
    /// hands out its blocks itself: the first registration decides.
    pub fn paged(layout: KvLayout, device: Device, num_blocks: usize, block_size: usize) -> Self {
        Self::build(layout, device, block_size, Blocks::Undecided { num_blocks })
    }

    fn build(layout: KvLayout, device: Device, block_size: usize, blocks: Blocks) -> Self {
        assert!(block_size > 0, "KV block size 0: this is a bug");
        Self {
            layout,
            device,
            block_size,
            blocks,
            slots: HashMap::new(),
            layers: Vec::new(),
            generation: next_pool_generation(),
            hidden: None,
            rows: 0,
        }
    }

    /// Keeps a `width`-wide hidden state per position beside its K/V (see
    /// the module docs); `width * dtype` more bytes per pool row. Call
    /// before anything is written: rows written earlier have no hidden state.
    pub fn store_hidden(&mut self, width: usize, dtype: DType) {
        self.hidden = Some(HiddenRows {
            width,
            dtype,
            buffer: None,
            written: false,
        });
    }

    /// The hidden-state buffer (`[pool rows, width]`), allocated (zeroed)
    /// now if nothing has been written yet; `None` when the cache stores
    /// no hidden states. A
    /// pass that writes into it on the device (a decode graph) holds it
    /// only while the pool's generation lasts: a pool that grows gets a
    /// new buffer and a new generation.
    pub fn hidden_buffer_for_pass(&mut self) -> Result<Option<Tensor>, KvError> {
        let rows = self.rows;
        let device = self.device.clone();
        let Some(h) = self.hidden.as_mut() else {
            return Ok(None);
        };
        if h.buffer.is_none() {
            h.buffer = Some(Tensor::zeros((rows, h.width), h.dtype, &device)?);
        }
        Ok(h.buffer.clone())
    }

    /// The forward pass just run wrote its hidden rows into the buffer
    /// itself; the engine's next [`take_hidden_written`](Self::take_hidden_written)
    /// says so, once.
    pub fn mark_hidden_written(&mut self) {
        if let Some(h) = self.hidden.as_mut() {
            h.written = true;
        }
    }

    /// Whether the last forward pass wrote its hidden rows itself (and
    /// forgets it).
    pub fn take_hidden_written(&mut self) -> bool {
        self.hidden
            .as_mut()
            .is_some_and(|h| std::mem::take(&mut h.written))
    }

    /// Whether every forward pass must write its hidden rows here.
    pub fn stores_hidden(&self) -> bool {
        self.hidden.is_some()
    }

    /// Writes `hidden` (`[n, width]`, converted to the stored dtype) as the
    /// hidden states of `slot`'s positions `[at, at + n)`. Room must have
    /// been ensured.
    pub fn write_hidden(
        &mut self,
        slot: SlotId,
        at: usize,
        hidden: &Tensor,
    ) -> Result<(), KvError> {
        let n = hidden.dim(0)?;
        self.write_hidden_rows(&[(slot, at, 0..n)], hidden)
    }

    /// Writes several slots' hidden states: each `(slot, at, rows)` takes
    /// `hidden`'s rows `rows` as `slot`'s positions from `at`. A few
    /// contiguous runs are copied one by one; more go in one scatter (a
    /// forward pass of many sequences: one launch, not one a sequence).
    /// Nothing is written when any slot lacks the room.
    pub fn write_hidden_rows(
        &mut self,
        writes: &[(SlotId, usize, Range<usize>)],
        hidden: &Tensor,
    ) -> Result<(), KvError> {
        // (destination row, source row, length) of each contiguous run.
        let mut runs = Vec::new();
        for (slot, at, rows) in writes {
            for (row, from, len) in self.segments(*slot, *at, rows.len())? {
                runs.push((row, rows.start + from, len));
            }
        }
        self.hidden_buffer_for_pass()?;
        let buffer = self.hidden_buffer()?;
        let hidden = hidden.to_dtype(buffer.dtype())?;
        if runs.len() <= FEW_HIDDEN_RUNS {
            for (row, from, len) in runs {
                buffer.slice_set(&hidden.narrow(0, from, len)?, 0, row)?;
            }
            return Ok(());
        }
        let mut source = Vec::new();
        let mut dest = Vec::new();
        for (row, from, len) in runs {
            source.extend((from..from + len).map(|r| r as u32));
            dest.extend((row..row + len).map(|r| r as u32));
        }
        let whole = source.len() == hidden.dim(0)?
            && source.iter().enumerate().all(|(i, &r)| r as usize == i);
        let hidden = if whole {
            hidden
        } else {
            hidden.index_select(&Tensor::new(source.as_slice(), hidden.device())?, 0)?
        };
        let width = hidden.dim(1)?;
        let dest = Tensor::new(dest.as_slice(), &self.device)?
            .unsqueeze(1)?
            .expand((dest.len(), width))?
            .contiguous()?;
        buffer.scatter_set(&dest, &hidden.contiguous()?, 0)?;
        Ok(())
    }

    /// The hidden states of `slot`'s positions `[from, to)`, `[to - from,
    /// width]`: a view when they are in consecutive rows, a gather otherwise.
    pub fn hidden(&self, slot: SlotId, from: usize, to: usize) -> Result<Tensor, KvError> {
        let n = to.saturating_sub(from);
        let segments = self.segments(slot, from, n)?;
        let buffer = self.hidden_buffer()?;
        if let [(row, _, _)] = segments[..] {
            return Ok(buffer.narrow(0, row, n)?);
        }
        let rows: Vec<u32> = segments
            .iter()
            .flat_map(|&(row, _, len)| (row..row + len).map(|r| r as u32))
            .collect();
        Ok(buffer.index_select(&Tensor::new(rows.as_slice(), &self.device)?, 0)?)
    }

    fn hidden_buffer(&self) -> Result<&Tensor, KvError> {
        match &self.hidden {
            Some(HiddenRows {
                buffer: Some(b), ..
            }) => Ok(b),
            Some(_) => Err(KvError::Tensor("hidden rows have no storage yet".into())),
            None => Err(KvError::Tensor(
                "this KV cache does not store hidden states".into(),
            )),
        }
    }

    /// Whether the tables come from outside.
    pub fn is_external(&self) -> bool {
        matches!(self.blocks, Blocks::External { .. })
    }

    /// Every cache is one pool per layer (the batched attention paths read it).
    pub fn is_pooled(&self) -> bool {
        true
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Names the pool buffers [`pool_layer`](Self::pool_layer) returns: equal
    /// generations mean the same device memory (across all caches).
    pub fn pool_generation(&self) -> u64 {
        self.generation
    }

    /// Layer `layer`'s (K, V) buffers `[rows, kv_heads, head_dim]` shared by
    /// all slots; `None` before anything was stored.
    pub fn pool_layer(&self, layer: usize) -> Option<(&Tensor, &Tensor)> {
        self.layers.get(layer).map(|(k, v)| (k, v))
    }

    /// The slot's block table.
    pub fn table(&self, slot: SlotId) -> Result<&[BlockId], KvError> {
        self.slots
            .get(&slot)
            .map(|s| s.table.as_slice())
            .ok_or(KvError::UnknownSlot(slot))
    }

    /// The pool row of the slot's position `pos` (its block must be in the table).
    pub fn row(&self, slot: SlotId, pos: usize) -> Result<usize, KvError> {
        let s = self.slots.get(&slot).ok_or(KvError::UnknownSlot(slot))?;
        row_of(&s.table, self.block_size, pos).ok_or(KvError::OverReservation {
            slot,
            reserved: s.table.len() * self.block_size,
            needed: pos + 1,
        })
    }

    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    /// Token capacity: the reservation limit of an own cache, the pool's
    /// size for an external one.
    pub fn capacity_tokens(&self) -> usize {
        match &self.blocks {
            Blocks::External { num_blocks } | Blocks::Undecided { num_blocks } => {
                num_blocks * self.block_size
            }
            Blocks::Own { capacity, .. } => *capacity,
        }
    }

    /// Tokens reserved by all slots (own), or held by their tables (external).
    pub fn reserved_tokens(&self) -> usize {
        match &self.blocks {
            Blocks::External { .. } | Blocks::Undecided { .. } => {
                self.blocks_in_tables() * self.block_size
            }
            Blocks::Own { reserved, .. } => *reserved,
        }
    }

    /// Blocks in all tables (a shared block counts once per table).
    pub fn blocks_in_tables(&self) -> usize {
        self.slots.values().map(|s| s.table.len()).sum()
    }

    pub fn available_tokens(&self) -> usize {
        self.capacity_tokens() - self.reserved_tokens()
    }

    /// Registers a slot whose cache reserves `reserve_tokens` for it (the
    /// most it may hold) and takes blocks as it grows. On an external
    /// cache use [`register`](Self::register).
    pub fn allocate(&mut self, slot: SlotId, reserve_tokens: usize) -> Result<(), KvError> {
        if self.slots.contains_key(&slot) {
            return Err(KvError::AlreadyAllocated(slot));
        }
        match self.blocks {
            Blocks::Undecided { num_blocks } => {
                self.blocks = Blocks::own(num_blocks * self.block_size, Some(num_blocks))
            }
            Blocks::External { .. } => return Err(KvError::Mixed(slot)),
            Blocks::Own { .. } => {}
        }
        let mut reserved_here = 0;
        if let Blocks::Own {
            capacity, reserved, ..
        } = &mut self.blocks
        {
            let available = *capacity - *reserved;
            if reserve_tokens > available {
                return Err(KvError::Exhausted {
                    requested: reserve_tokens,
                    available,
                    capacity: *capacity,
                });
            }
            *reserved += reserve_tokens;
            reserved_here = reserve_tokens;
        }
        self.slots.insert(
            slot,
            SlotKv {
                table: Vec::new(),
                len: 0,
                reserved: reserved_here,
                spec_start: None,
            },
        );
        Ok(())
    }

    /// Registers a slot whose block table comes from outside, with `table`
    /// and the first `len` positions already valid (a cached prefix).
    pub fn register(
        &mut self,
        slot: SlotId,
        table: Vec<BlockId>,
        len: usize,
    ) -> Result<(), KvError> {
        if self.slots.contains_key(&slot) {
            return Err(KvError::AlreadyAllocated(slot));
        }
        match self.blocks {
            Blocks::Undecided { num_blocks } => self.blocks = Blocks::External { num_blocks },
            Blocks::Own { .. } => return Err(KvError::Mixed(slot)),
            Blocks::External { .. } => {}
        }
        self.slots.insert(
            slot,
            SlotKv {
                table: Vec::new(),
                len: 0,
                reserved: 0,
                spec_start: None,
            },
        );
        let result = self.set_table(slot, table, Some(len));
        if result.is_err() {
            self.slots.remove(&slot);
        }
        result
    }

    /// External caches: the slot's new block table (the scheduler's) and
    /// the valid length, when it changes (`None`: keep `len`, which must
    /// fit the table).
    pub fn set_table(
        &mut self,
        slot: SlotId,
        table: Vec<BlockId>,
        len: Option<usize>,
    ) -> Result<(), KvError> {
        let num_blocks = match self.blocks {
            Blocks::External { num_blocks } => num_blocks,
            Blocks::Own { .. } | Blocks::Undecided { .. } => {
                return Err(KvError::Tensor(
                    "set_table on a self-managed KV cache: this is a bug".into(),
                ))
            }
        };
        if let Some(&block) = table.iter().find(|&&b| b as usize >= num_blocks) {
            return Err(KvError::BadBlock {
                slot,
                block,
                blocks: num_blocks,
            });
        }
        let bs = self.block_size;
        let s = self
            .slots
            .get_mut(&slot)
            .ok_or(KvError::UnknownSlot(slot))?;
        let len = len.unwrap_or(s.len);
        if len > table.len() * bs {
            return Err(KvError::OverReservation {
                slot,
                reserved: table.len() * bs,
                needed: len,
            });
        }
        s.table = table;
        s.len = len;
        s.spec_start = None;
        let top = s.table.iter().max().map_or(0, |&b| b as usize + 1);
        self.grow_storage(top)
    }

    /// Grows the buffers to hold at least `blocks` blocks.
    fn grow_storage(&mut self, blocks: usize) -> Result<(), KvError> {
        let rows = blocks * self.block_size;
        if rows <= self.rows {
            return Ok(());
        }
        let cap_rows = match self.blocks {
            Blocks::External { num_blocks }
            | Blocks::Undecided { num_blocks }
            | Blocks::Own {
                undecided: Some(num_blocks),
                ..
            } => num_blocks * self.block_size,
            Blocks::Own { .. } => usize::MAX,
        };
        // A pool of known size whole at once (module docs); else, or when
        // the host will not give that much at once, doubling.
        let doubled = rows
            .max(2 * self.rows)
            .max(MIN_POOL_BLOCKS * self.block_size);
        let layout = self.layout;
        let (new_rows, buffers) = match (cap_rows != usize::MAX).then(|| cap_rows.max(rows)) {
            Some(whole) => match pool_buffers(&self.device, layout, whole) {
                Ok(buffers) => (whole, buffers),
                Err(e) if whole > doubled => {
                    tracing::warn!(
                        rows = whole,
                        error = %e,
                        "KV pool: the whole pool could not be allocated at once; growing it as used"
                    );
                    (doubled, pool_buffers(&self.device, layout, doubled)?)
                }
                Err(e) => return Err(e),
            },
            None => (doubled, pool_buffers(&self.device, layout, doubled)?),
        };
        let mut layers = Vec::with_capacity(layout.num_layers);
        for (l, pair) in buffers.chunks_exact(2).enumerate() {
            let (k, v) = (pair[0].clone(), pair[1].clone());
            if let Some((old_k, old_v)) = self.layers.get(l) {
                k.slice_set(old_k, 0, 0)?;
                v.slice_set(old_v, 0, 0)?;
            }
            layers.push((k, v));
        }
        self.layers = layers;
        self.generation = next_pool_generation();
        if let Some(
            h @ HiddenRows {
                buffer: Some(_), ..
            },
        ) = self.hidden.as_mut()
        {
            let buffer =
                zeroed(&self.device, h.dtype, new_rows * h.width)?.reshape((new_rows, h.width))?;
            if let Some(old) = &h.buffer {
                buffer.slice_set(old, 0, 0)?;
            }
            h.buffer = Some(buffer);
        }
        self.rows = new_rows;
        Ok(())
    }

    /// Frees a slot: an own cache takes its blocks and reservation back.
    /// Returns false if unknown.
    pub fn free(&mut self, slot: SlotId) -> bool {
        let Some(s) = self.slots.remove(&slot) else {
            return false;
        };
        if let Blocks::Own {
            free,
            reserved,
            undecided,
            ..
        } = &mut self.blocks
        {
            *reserved -= s.reserved;
            free.extend(s.table);
            if let (Some(num_blocks), true) = (*undecided, self.slots.is_empty()) {
                self.blocks = Blocks::Undecided { num_blocks };
            }
        }
        true
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

    /// Tokens reserved by a slot (own), or its table's room (external).
    pub fn reserved(&self, slot: SlotId) -> Result<usize, KvError> {
        let s = self.slots.get(&slot).ok_or(KvError::UnknownSlot(slot))?;
        Ok(match self.blocks {
            Blocks::Own { .. } => s.reserved,
            _ => s.table.len() * self.block_size,
        })
    }

    /// Makes room for `extra` more tokens after `len`. An own cache takes
    /// blocks (within the reservation); an external one checks that its
    /// table already has them. Call before writing.
    pub fn ensure_room(&mut self, slot: SlotId, extra: usize) -> Result<(), KvError> {
        let bs = self.block_size;
        let s = self
            .slots
            .get_mut(&slot)
            .ok_or(KvError::UnknownSlot(slot))?;
        let needed = s.len + extra;
        let room = s.table.len() * bs;
        let Blocks::Own { free, next, .. } = &mut self.blocks else {
            if needed > room {
                return Err(KvError::OverReservation {
                    slot,
                    reserved: room,
                    needed,
                });
            }
            return Ok(());
        };
        if needed > s.reserved {
            return Err(KvError::OverReservation {
                slot,
                reserved: s.reserved,
                needed,
            });
        }
        while s.table.len() * bs < needed {
            let b = match free.pop_first() {
                Some(b) => b,
                None => {
                    *next += 1;
                    *next - 1
                }
            };
            s.table.push(b);
        }
        let top = s.table.iter().max().map_or(0, |&b| b as usize + 1);
        self.grow_storage(top)
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
        self.token_major_keys()?;
        let n = k.dim(0)?;
        let segments = self.segments(slot, at, n)?;
        let (kb, vb) = self.layer(layer)?;
        for (row, from, len) in segments {
            kb.slice_set(&k.narrow(0, from, len)?, 0, row)?;
            vb.slice_set(&v.narrow(0, from, len)?, 0, row)?;
        }
        Ok(())
    }

    /// The runs of consecutive pool rows that positions `[at, at + n)` of
    /// `slot` occupy: `(first row, offset into the n positions, length)`.
    pub fn segments(
        &self,
        slot: SlotId,
        at: usize,
        n: usize,
    ) -> Result<Vec<(usize, usize, usize)>, KvError> {
        let s = self.slots.get(&slot).ok_or(KvError::UnknownSlot(slot))?;
        let bs = self.block_size;
        if at + n > s.table.len() * bs {
            return Err(KvError::OverReservation {
                slot,
                reserved: s.table.len() * bs,
                needed: at + n,
            });
        }
        let mut out = Vec::new();
        let mut pos = at;
        while pos < at + n {
            let len = (bs - pos % bs).min(at + n - pos);
            let row = s.table[pos / bs] as usize * bs + pos % bs;
            match out.last_mut() {
                Some((r, _, l)) if *r + *l == row => *l += len,
                _ => out.push((row, pos - at, len)),
            }
            pos += len;
        }
        Ok(out)
    }

    /// Ok when the pool's keys are token-major ([`KeyOrder::Rows`]).
    pub fn token_major_keys(&self) -> Result<(), KvError> {
        match self.layout.keys {
            KeyOrder::Rows => Ok(()),
            other => Err(KvError::KeyOrder(other)),
        }
    }

    fn layer(&self, layer: usize) -> Result<(&Tensor, &Tensor), KvError> {
        self.layers
            .get(layer)
            .map(|(k, v)| (k, v))
            .ok_or_else(|| KvError::Tensor(format!("KV layer {layer} has no storage yet")))
    }

    /// K and V of `layer` for positions `[0, upto)`, `[upto, kv_heads,
    /// head_dim]`: a view when the positions are in consecutive blocks, a
    /// gather through the table otherwise.
    pub fn view(
        &self,
        slot: SlotId,
        layer: usize,
        upto: usize,
    ) -> Result<(Tensor, Tensor), KvError> {
        self.token_major_keys()?;
        let segments = self.segments(slot, 0, upto)?;
        let (k, v) = self.layer(layer)?;
        if let [(row, _, _)] = segments[..] {
            return Ok((k.narrow(0, row, upto)?, v.narrow(0, row, upto)?));
        }
        let rows: Vec<u32> = segments
            .iter()
            .flat_map(|&(row, _, len)| (row..row + len).map(|r| r as u32))
            .collect();
        let idx = Tensor::new(rows.as_slice(), &self.device)?;
        Ok((k.index_select(&idx, 0)?, v.index_select(&idx, 0)?))
    }

    /// Marks positions `[0, len)` valid (after a forward pass wrote them).
    pub fn set_len(&mut self, slot: SlotId, len: usize) -> Result<(), KvError> {
        let bs = self.block_size;
        let s = self
            .slots
            .get_mut(&slot)
            .ok_or(KvError::UnknownSlot(slot))?;
        if len > s.table.len() * bs {
            return Err(KvError::OverReservation {
                slot,
                reserved: s.table.len() * bs,
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
    /// [`begin`](Self::begin). An own cache returns the blocks past the
    /// new length; an external one leaves that to the table's owner.
    pub fn commit(&mut self, slot: SlotId, accepted: usize) -> Result<(), KvError> {
        let bs = self.block_size;
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
        if let Blocks::Own { free, .. } = &mut self.blocks {
            let keep = blocks_for(s.len, bs);
            free.extend(s.table.drain(keep.min(s.table.len())..));
        }
        Ok(())
    }
}

/// The pool row of position `pos` through `table`.
pub fn row_of(table: &[BlockId], block_size: usize, pos: usize) -> Option<usize> {
    let b = *table.get(pos / block_size)?;
    Some(b as usize * block_size + pos % block_size)
}

#[cfg(test)]
mod tests;

/// The pool's `2 · num_layers` zeroed buffers of `rows` rows (layer `l`'s
/// K is buffer `2l`, its V `2l + 1`): on the CPU views of one [`zeroed`]
/// buffer, on a GPU buffers of their own. All or none: an error when the
/// device will not give that much.
fn pool_buffers(device: &Device, layout: KvLayout, rows: usize) -> Result<Vec<Tensor>, KvError> {
    let shape = (rows, layout.num_kv_heads, layout.head_dim);
    let too_big = || KvError::Tensor(format!("KV pool: {rows} rows overflow the address space"));
    let n = rows
        .checked_mul(layout.num_kv_heads * layout.head_dim)
        .ok_or_else(too_big)?;
    let count = 2 * layout.num_layers;
    if device.is_cpu() {
        let arena = zeroed(
            device,
            layout.dtype,
            n.checked_mul(count).ok_or_else(too_big)?,
        )?;
        (0..count)
            .map(|i| Ok(arena.narrow(0, i * n, n)?.reshape(shape)?))
            .collect()
    } else {
        (0..count)
            .map(|_| Ok(Tensor::zeros(shape, layout.dtype, device)?))
            .collect()
    }
}

/// `len` zeroed elements of `dtype`. On the CPU the pages are left
/// untouched until written ([`crate::host_memory::zeroed`]):
/// `Tensor::zeros` writes every element, and on the VMs this runs on
/// zeroing a pool's 60 fresh buffers (a page fault per 4 KiB) stalled a
/// step for 0.8-1.7 s. 4 KiB pages, not huge ones: a huge page's first
/// touch (zeroing 2 MiB, compacting memory for it) took longer still
/// there, and a pool's rows are first written a few at a time, by decode
/// steps.
fn zeroed(device: &Device, dtype: DType, len: usize) -> Result<Tensor, KvError> {
    fn host<T: candle_core::WithDType>(len: usize) -> Result<Tensor, KvError> {
        let v = crate::host_memory::zeroed::<T>(len).ok_or_else(|| {
            KvError::Tensor(format!(
                "KV pool: cannot allocate {len} elements of {:?}",
                T::DTYPE
            ))
        })?;
        Ok(Tensor::from_vec(v, len, &Device::Cpu)?)
    }
    match (device.is_cpu(), dtype) {
        (true, DType::F32) => host::<f32>(len),
        (true, DType::F16) => host::<half::f16>(len),
        (true, DType::BF16) => host::<half::bf16>(len),
        _ => Ok(Tensor::zeros(len, dtype, device)?),
    }
}
