//! The slot table: which sequence runs in which engine slot, and which KV
//! blocks each one holds.
//!
//! Each slot is `Free`, `Running` (a sequence tracked by counters: prompt
//! length, positions computed, tokens generated; no prefill/decode phases),
//! or `Releasing`: its request has already ended on the scheduler side but
//! the engine still holds the slot until a plan's `release` reaches it. A
//! running sequence may be *preempted*: it keeps its slot (and, in the
//! engine, its sampler state and tokens) but no blocks, and waits to be
//! resumed and recomputed.
//!
//! Invariants kept here:
//! - The [`BlockPool`] owns the KV accounting: every block in a running or
//!   releasing slot's table is retained once for it; a releasing slot's
//!   blocks go back only when the engine can no longer write them (its
//!   release is in a plan being built, or the engine ended it), so no block
//!   is handed out while a step in flight may still write it.
//! - A slot returns to the free list only when the engine no longer holds it:
//!   either the engine reported it finished / failed ([`SlotTable::free_now`]),
//!   or a plan carrying its release has been built
//!   ([`SlotTable::complete_release`], called after that plan's admissions).
//! - The free list is FIFO, so a freed id is reused as late as possible, which
//!   makes a stale slot id in a late message easy to tell apart in logs.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use crate::engine::{Drafting, SlotId};
use crate::kv::{BlockPool, SeqBlocks};

use super::RequestId;

/// A sequence that holds a slot.
#[derive(Debug)]
pub(crate) struct RunningSeq {
    pub id: RequestId,
    pub slot: SlotId,
    pub prompt: Arc<[u32]>,
    pub prompt_len: usize,
    /// Positions whose K/V the engine holds (a cached prefix counts).
    pub computed: usize,
    /// Tokens the engine has generated and the scheduler has accepted.
    pub generated: usize,
    /// Their ids (prefix hashes of generated blocks, recompute lookups).
    pub tokens: Vec<u32>,
    /// Prompt tokens found in the prefix cache at admission.
    pub cached_tokens: usize,
    /// Its block table in the pool.
    pub blocks: SeqBlocks,
    /// The table changed since the engine last got it.
    pub table_dirty: bool,
    /// Preempted: no blocks, waiting to be resumed.
    pub preempted: bool,
    /// Draft tokens proposed / accepted for this sequence (speculation).
    pub drafted: usize,
    pub accepted_drafts: usize,
    pub max_new_tokens: usize,
    /// How it speculates; `None` when it never drafts.
    pub drafting: Option<Drafting>,
    pub submitted_at: Instant,
    pub admitted_at: Instant,
    pub first_token_at: Option<Instant>,
    pub last_token_at: Option<Instant>,
    pub span: tracing::Span,
}

impl RunningSeq {
    /// The KV length prefill work brings it to: the prompt before the first
    /// token, then every token but the last (which the next decode feeds).
    pub fn fill_target(&self) -> usize {
        match self.generated {
            0 => self.prompt_len,
            g => self.prompt_len + g - 1,
        }
    }

    /// Whether the whole prompt (and, after a preemption, every token but
    /// the last) is in the KV cache, so the next step decodes.
    pub fn prompt_done(&self) -> bool {
        !self.preempted && self.generated > 0 && self.computed >= self.fill_target()
    }

    /// Whether it has prefill (or recompute) work left.
    pub fn needs_prefill(&self) -> bool {
        !self.preempted && self.computed < self.fill_target()
    }

    /// Positions prefill work has left.
    pub fn prompt_remaining(&self) -> usize {
        self.fill_target().saturating_sub(self.computed)
    }

    /// Token at `position` (prompt, then generated).
    pub fn token_at(&self, position: usize) -> u32 {
        match position.checked_sub(self.prompt_len) {
            None => self.prompt[position],
            Some(i) => self.tokens[i],
        }
    }
}

#[derive(Debug)]
enum Slot {
    Free,
    /// Boxed: a running sequence is far larger than the other states.
    Running(Box<RunningSeq>),
    /// Ended on the scheduler side; the engine must still be told.
    Releasing {
        blocks: SeqBlocks,
    },
}

/// Fixed-size table of engine slots, and the KV block pool.
#[derive(Debug)]
pub(crate) struct SlotTable {
    slots: Vec<Slot>,
    free: VecDeque<SlotId>,
    /// Running slots in admission order (oldest first), preempted included.
    by_age: Vec<SlotId>,
    /// Releasing slots not yet put into a plan.
    to_release: Vec<SlotId>,
    pool: BlockPool,
}

impl SlotTable {
    /// `max_seqs` slots over a pool of `kv_capacity` tokens in blocks of the
    /// default size, prefix caching on (tests).
    #[cfg(test)]
    pub fn new(max_seqs: usize, kv_capacity: usize) -> Self {
        use crate::kv::DEFAULT_BLOCK_SIZE;
        let pool = BlockPool::new(
            kv_capacity / DEFAULT_BLOCK_SIZE,
            DEFAULT_BLOCK_SIZE,
            true,
            0,
        );
        Self::with_pool(max_seqs, pool)
    }

    /// `max_seqs` must fit a `SlotId` (checked by the config).
    pub fn with_pool(max_seqs: usize, pool: BlockPool) -> Self {
        Self {
            slots: (0..max_seqs).map(|_| Slot::Free).collect(),
            free: (0..max_seqs as SlotId).collect(),
            by_age: Vec::with_capacity(max_seqs),
            to_release: Vec::new(),
            pool,
        }
    }

    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    pub fn pool_mut(&mut self) -> &mut BlockPool {
        &mut self.pool
    }

    /// An empty table of the same shape (after the engine is gone).
    pub fn reset(&mut self) {
        let pool = BlockPool::new(
            self.pool.num_blocks(),
            self.pool.block_size(),
            self.pool.caching(),
            0,
        );
        *self = Self::with_pool(self.capacity(), pool);
    }

    pub fn block_size(&self) -> usize {
        self.pool.block_size()
    }

    pub fn capacity(&self) -> usize {
        self.slots.len()
    }

    pub fn free_count(&self) -> usize {
        self.free.len()
    }

    /// Slots holding a running sequence (preempted ones included).
    pub fn running_count(&self) -> usize {
        self.by_age.len()
    }

    /// Slots in any non-free state (running or releasing).
    pub fn occupied(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    /// KV tokens in blocks owned by some sequence.
    pub fn kv_used(&self) -> usize {
        self.pool.used() * self.pool.block_size()
    }

    pub fn kv_capacity(&self) -> usize {
        self.pool.num_blocks() * self.pool.block_size()
    }

    /// Whether a slot is free for a new sequence.
    pub fn can_admit(&self) -> bool {
        !self.free.is_empty()
    }

    /// Places a sequence in a free slot; `None` when no slot is free.
    /// `build` makes the sequence for the chosen slot (its blocks already
    /// taken from [`pool_mut`](Self::pool_mut)).
    pub fn admit(&mut self, build: impl FnOnce(SlotId) -> RunningSeq) -> Option<SlotId> {
        let slot = self.free.pop_front()?;
        let seq = build(slot);
        self.slots[slot as usize] = Slot::Running(Box::new(seq));
        self.by_age.push(slot);
        Some(slot)
    }

    pub fn get(&self, slot: SlotId) -> Option<&RunningSeq> {
        match self.slots.get(slot as usize) {
            Some(Slot::Running(seq)) => Some(seq),
            _ => None,
        }
    }

    pub fn get_mut(&mut self, slot: SlotId) -> Option<&mut RunningSeq> {
        match self.slots.get_mut(slot as usize) {
            Some(Slot::Running(seq)) => Some(seq),
            _ => None,
        }
    }

    /// A running sequence and the pool, borrowed together.
    pub fn with_pool_mut(&mut self, slot: SlotId) -> Option<(&mut RunningSeq, &mut BlockPool)> {
        match self.slots.get_mut(slot as usize) {
            Some(Slot::Running(seq)) => Some((&mut **seq, &mut self.pool)),
            _ => None,
        }
    }

    /// Grows `slot`'s table to hold `tokens` positions; false (nothing
    /// taken) when the pool is short.
    pub fn grow(&mut self, slot: SlotId, tokens: usize) -> bool {
        let Some((seq, pool)) = self.with_pool_mut(slot) else {
            return false;
        };
        let before = seq.blocks.table.len();
        if !seq.blocks.grow_to(pool, tokens) {
            return false;
        }
        seq.table_dirty |= seq.blocks.table.len() != before;
        true
    }

    /// After an outcome: returns blocks past what `slot` still needs
    /// (rejected drafts, unused room) and indexes its new full blocks.
    pub fn settle_blocks(&mut self, slot: SlotId) {
        let Some((seq, pool)) = self.with_pool_mut(slot) else {
            return;
        };
        if seq.preempted {
            return;
        }
        let before = seq.blocks.table.len();
        seq.blocks
            .trim_to(pool, seq.computed.max(seq.fill_target()));
        seq.table_dirty |= seq.blocks.table.len() != before;
        let (prompt, tokens, n) = (&seq.prompt, &seq.tokens, seq.prompt_len);
        seq.blocks
            .register_full(pool, seq.computed, |p| match p.checked_sub(n) {
                None => prompt[p],
                Some(i) => tokens[i],
            });
    }

    /// Preempts a running sequence: every block back to the pool. Returns
    /// false when it is not running or already preempted.
    pub fn preempt(&mut self, slot: SlotId) -> bool {
        let Some((seq, pool)) = self.with_pool_mut(slot) else {
            return false;
        };
        if seq.preempted {
            return false;
        }
        seq.blocks.free(pool);
        seq.preempted = true;
        seq.computed = 0;
        seq.table_dirty = false;
        true
    }

    /// Whether the slot is waiting for its release to be sent or completed.
    pub fn is_releasing(&self, slot: SlotId) -> bool {
        matches!(self.slots.get(slot as usize), Some(Slot::Releasing { .. }))
    }

    /// The slot of a running request. Linear in `max_seqs`; only used by
    /// cancellation, which is rare next to steps.
    pub fn find(&self, id: RequestId) -> Option<SlotId> {
        self.by_age
            .iter()
            .copied()
            .find(|&s| self.get(s).is_some_and(|seq| seq.id == id))
    }

    /// Running sequences, oldest first.
    pub fn iter_by_age(&self) -> impl Iterator<Item = &RunningSeq> + '_ {
        self.by_age.iter().filter_map(|&s| self.get(s))
    }

    /// Running slots, oldest first.
    pub fn slots_by_age(&self) -> Vec<SlotId> {
        self.by_age.clone()
    }

    /// The engine has already dropped this slot (finish or error): free it at
    /// once, blocks included. Also accepts a releasing slot (the engine
    /// ended it on its own before our release went out; the release is then
    /// not sent at all).
    pub fn free_now(&mut self, slot: SlotId) -> Option<RunningSeq> {
        let entry = self.slots.get_mut(slot as usize)?;
        match std::mem::replace(entry, Slot::Free) {
            Slot::Free => None,
            Slot::Running(mut seq) => {
                self.by_age.retain(|&s| s != slot);
                seq.blocks.free(&mut self.pool);
                self.free.push_back(slot);
                Some(*seq)
            }
            Slot::Releasing { mut blocks } => {
                self.to_release.retain(|&s| s != slot);
                blocks.free(&mut self.pool);
                self.free.push_back(slot);
                None
            }
        }
    }

    /// Ends a running sequence on the scheduler side; the engine is told in
    /// the next plan's `release`. The slot and its blocks stay held until then.
    pub fn start_release(&mut self, slot: SlotId) -> Option<RunningSeq> {
        let entry = self.slots.get_mut(slot as usize)?;
        if !matches!(entry, Slot::Running(_)) {
            return None;
        }
        let Slot::Running(mut seq) = std::mem::replace(
            entry,
            Slot::Releasing {
                blocks: SeqBlocks::default(),
            },
        ) else {
            return None; // matched Running just above
        };
        *entry = Slot::Releasing {
            blocks: std::mem::take(&mut seq.blocks),
        };
        self.by_age.retain(|&s| s != slot);
        self.to_release.push(slot);
        Some(*seq)
    }

    /// Slots whose release goes into the plan being built; their blocks go
    /// back to the pool (the engine applies releases before any work).
    pub fn take_releases(&mut self) -> Vec<SlotId> {
        let slots = std::mem::take(&mut self.to_release);
        for &slot in &slots {
            if let Some(Slot::Releasing { blocks }) = self.slots.get_mut(slot as usize) {
                blocks.free(&mut self.pool);
            }
        }
        slots
    }

    /// The plan carrying this slot's release has been built (after its
    /// admissions), so the id may be handed out from the next plan on.
    pub fn complete_release(&mut self, slot: SlotId) {
        if let Some(entry @ Slot::Releasing { .. }) = self.slots.get_mut(slot as usize) {
            *entry = Slot::Free;
            self.free.push_back(slot);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn seq(id: u64, prompt_len: usize) -> impl FnOnce(SlotId) -> RunningSeq {
        move |slot| RunningSeq {
            id: RequestId(id),
            slot,
            prompt: vec![1u32; prompt_len].into(),
            prompt_len,
            computed: 0,
            generated: 0,
            tokens: Vec::new(),
            cached_tokens: 0,
            blocks: SeqBlocks::default(),
            table_dirty: false,
            preempted: false,
            drafted: 0,
            accepted_drafts: 0,
            max_new_tokens: 10,
            drafting: None,
            submitted_at: Instant::now(),
            admitted_at: Instant::now(),
            first_token_at: None,
            last_token_at: None,
            span: tracing::Span::none(),
        }
    }

    #[test]
    fn release_holds_slot_and_blocks_until_the_plan() {
        let mut t = SlotTable::new(1, 160);
        let s = t.admit(seq(1, 10)).unwrap();
        assert!(t.grow(s, 40));
        assert_eq!(t.kv_used(), 48);
        assert_eq!(t.start_release(s).map(|q| q.id), Some(RequestId(1)));
        assert!(t.get(s).is_none());
        assert!(!t.can_admit(), "slot still held by the engine");
        assert_eq!(t.kv_used(), 48, "a step in flight may still write them");
        assert_eq!(t.take_releases(), vec![s]);
        assert_eq!(t.kv_used(), 0);
        t.complete_release(s);
        assert_eq!(t.free_count(), 1);
        // Completing twice is harmless.
        t.complete_release(s);
        assert_eq!(t.free_count(), 1);
        t.pool().check();
    }

    #[test]
    fn engine_finish_of_releasing_slot_cancels_the_release() {
        let mut t = SlotTable::new(2, 160);
        let s = t.admit(seq(1, 10)).unwrap();
        assert!(t.grow(s, 20));
        t.start_release(s);
        assert!(t.free_now(s).is_none());
        assert!(t.take_releases().is_empty(), "engine already dropped it");
        assert_eq!((t.free_count(), t.kv_used()), (2, 0));
    }

    #[test]
    fn preemption_frees_every_block_and_keeps_the_slot() {
        let mut t = SlotTable::new(2, 64);
        let a = t.admit(seq(1, 10)).unwrap();
        assert!(t.grow(a, 64));
        let b = t.admit(seq(2, 10)).unwrap();
        assert!(!t.grow(b, 1), "the pool is full");
        assert!(t.preempt(a));
        assert!(!t.preempt(a), "already preempted");
        assert!(t.grow(b, 64));
        assert_eq!(t.running_count(), 2);
        assert!(t.get(a).unwrap().preempted);
        t.pool().check();
    }

    #[test]
    fn free_list_is_fifo_and_age_order_kept() {
        let mut t = SlotTable::new(3, 100);
        let a = t.admit(seq(1, 5)).unwrap();
        let b = t.admit(seq(2, 5)).unwrap();
        let c = t.admit(seq(3, 5)).unwrap();
        t.free_now(b);
        let ids: Vec<u64> = t.iter_by_age().map(|s| s.id.0).collect();
        assert_eq!(ids, vec![1, 3]);
        t.free_now(a);
        // b was freed first, so it is reused first.
        assert_eq!(t.admit(seq(4, 5)), Some(b));
        assert_eq!(t.find(RequestId(3)), Some(c));
        assert_eq!(t.find(RequestId(2)), None);
    }
}
