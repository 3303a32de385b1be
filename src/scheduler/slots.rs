//! The slot table: which sequence runs in which engine slot, and how much of
//! the KV pool is reserved.
//!
//! Each slot is `Free`, `Running` (a sequence tracked by counters: prompt
//! length, tokens prefilled, tokens generated; no prefill/decode phases), or
//! `Releasing`: its request has already ended on the scheduler side but the
//! engine still holds the slot until a plan's `release` reaches it.
//!
//! Invariants kept here:
//! - `kv_reserved` is the sum of the reservations of every non-free slot and
//!   never exceeds `kv_capacity`.
//! - A slot returns to the free list only when the engine no longer holds it:
//!   either the engine reported it finished / failed ([`SlotTable::free_now`]),
//!   or a plan carrying its release has been built
//!   ([`SlotTable::complete_release`], called after that plan's admissions).
//! - The free list is FIFO, so a freed id is reused as late as possible, which
//!   makes a stale slot id in a late message easy to tell apart in logs.

use std::collections::VecDeque;
use std::time::Instant;

use crate::engine::{Drafting, SlotId};

use super::RequestId;

/// A sequence that holds a slot.
#[derive(Debug)]
pub(crate) struct RunningSeq {
    pub id: RequestId,
    pub slot: SlotId,
    pub prompt_len: usize,
    /// Prompt tokens the engine has fed (`== prompt_len` once prefilled).
    pub num_prefilled: usize,
    /// Tokens the engine has generated and the scheduler has accepted.
    pub generated: usize,
    /// Draft tokens proposed / accepted for this sequence (speculation).
    pub drafted: usize,
    pub accepted_drafts: usize,
    pub max_new_tokens: usize,
    pub kv_reserve: usize,
    /// How it speculates; `None` when it never drafts.
    pub drafting: Option<Drafting>,
    pub submitted_at: Instant,
    pub admitted_at: Instant,
    pub first_token_at: Option<Instant>,
    pub last_token_at: Option<Instant>,
    pub span: tracing::Span,
}

impl RunningSeq {
    /// Whether the whole prompt is in the KV cache, so the next step decodes.
    pub fn prompt_done(&self) -> bool {
        self.num_prefilled >= self.prompt_len
    }

    /// Prompt tokens not yet fed.
    pub fn prompt_remaining(&self) -> usize {
        self.prompt_len - self.num_prefilled
    }
}

#[derive(Debug)]
enum Slot {
    Free,
    Running(RunningSeq),
    /// Ended on the scheduler side; the engine must still be told.
    Releasing {
        kv_reserve: usize,
    },
}

/// Fixed-size table of engine slots.
#[derive(Debug)]
pub(crate) struct SlotTable {
    slots: Vec<Slot>,
    free: VecDeque<SlotId>,
    /// Running slots in admission order (oldest first).
    by_age: Vec<SlotId>,
    /// Releasing slots not yet put into a plan.
    to_release: Vec<SlotId>,
    kv_capacity: usize,
    kv_reserved: usize,
}

impl SlotTable {
    /// `max_seqs` must fit a `SlotId` (checked by the config).
    pub fn new(max_seqs: usize, kv_capacity: usize) -> Self {
        Self {
            slots: (0..max_seqs).map(|_| Slot::Free).collect(),
            free: (0..max_seqs as SlotId).collect(),
            by_age: Vec::with_capacity(max_seqs),
            to_release: Vec::new(),
            kv_capacity,
            kv_reserved: 0,
        }
    }

    pub fn capacity(&self) -> usize {
        self.slots.len()
    }

    pub fn free_count(&self) -> usize {
        self.free.len()
    }

    /// Slots holding a running sequence.
    pub fn running_count(&self) -> usize {
        self.by_age.len()
    }

    /// Slots in any non-free state (running or releasing).
    pub fn occupied(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    pub fn kv_reserved(&self) -> usize {
        self.kv_reserved
    }

    pub fn kv_capacity(&self) -> usize {
        self.kv_capacity
    }

    /// Whether a sequence reserving `kv_reserve` tokens can take a slot now.
    pub fn can_admit(&self, kv_reserve: usize) -> bool {
        !self.free.is_empty() && kv_reserve <= self.kv_capacity - self.kv_reserved
    }

    /// Places a sequence in a free slot; `None` when [`Self::can_admit`] is
    /// false. `build` makes the sequence for the chosen slot.
    pub fn admit(
        &mut self,
        kv_reserve: usize,
        build: impl FnOnce(SlotId) -> RunningSeq,
    ) -> Option<SlotId> {
        if !self.can_admit(kv_reserve) {
            return None;
        }
        let slot = self.free.pop_front()?;
        let seq = build(slot);
        debug_assert_eq!(seq.kv_reserve, kv_reserve);
        self.kv_reserved += kv_reserve;
        self.slots[slot as usize] = Slot::Running(seq);
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

    /// The engine has already dropped this slot (finish or error): free it at
    /// once. Also accepts a releasing slot (the engine ended it on its own
    /// before our release went out; the release is then not sent at all).
    pub fn free_now(&mut self, slot: SlotId) -> Option<RunningSeq> {
        let entry = self.slots.get_mut(slot as usize)?;
        match std::mem::replace(entry, Slot::Free) {
            Slot::Free => None,
            Slot::Running(seq) => {
                self.by_age.retain(|&s| s != slot);
                self.kv_reserved -= seq.kv_reserve;
                self.free.push_back(slot);
                Some(seq)
            }
            Slot::Releasing { kv_reserve } => {
                self.to_release.retain(|&s| s != slot);
                self.kv_reserved -= kv_reserve;
                self.free.push_back(slot);
                None
            }
        }
    }

    /// Ends a running sequence on the scheduler side; the engine is told in
    /// the next plan's `release`. The slot and its KV stay reserved until then.
    pub fn start_release(&mut self, slot: SlotId) -> Option<RunningSeq> {
        let entry = self.slots.get_mut(slot as usize)?;
        let kv_reserve = match entry {
            Slot::Running(seq) => seq.kv_reserve,
            Slot::Free | Slot::Releasing { .. } => return None,
        };
        let Slot::Running(seq) = std::mem::replace(entry, Slot::Releasing { kv_reserve }) else {
            return None; // matched Running just above
        };
        self.by_age.retain(|&s| s != slot);
        self.to_release.push(slot);
        Some(seq)
    }

    /// Slots whose release goes into the plan being built.
    pub fn take_releases(&mut self) -> Vec<SlotId> {
        std::mem::take(&mut self.to_release)
    }

    /// The plan carrying this slot's release has been built (after its
    /// admissions), so the id may be handed out from the next plan on.
    pub fn complete_release(&mut self, slot: SlotId) {
        if let Some(entry @ Slot::Releasing { .. }) = self.slots.get_mut(slot as usize) {
            if let Slot::Releasing { kv_reserve } = std::mem::replace(entry, Slot::Free) {
                self.kv_reserved -= kv_reserve;
                self.free.push_back(slot);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(id: u64, prompt_len: usize, kv: usize) -> impl FnOnce(SlotId) -> RunningSeq {
        move |slot| RunningSeq {
            id: RequestId(id),
            slot,
            prompt_len,
            num_prefilled: 0,
            generated: 0,
            drafted: 0,
            accepted_drafts: 0,
            max_new_tokens: kv - prompt_len,
            kv_reserve: kv,
            drafting: None,
            submitted_at: Instant::now(),
            admitted_at: Instant::now(),
            first_token_at: None,
            last_token_at: None,
            span: tracing::Span::none(),
        }
    }

    #[test]
    fn admission_respects_slots_and_kv() {
        let mut t = SlotTable::new(2, 100);
        assert_eq!(t.admit(60, seq(1, 10, 60)), Some(0));
        assert!(!t.can_admit(41), "only 40 KV tokens left");
        assert_eq!(t.admit(41, seq(2, 10, 41)), None);
        assert_eq!(t.admit(40, seq(2, 10, 40)), Some(1));
        assert!(!t.can_admit(0), "no slot left");
        assert_eq!(t.kv_reserved(), 100);
    }

    #[test]
    fn release_holds_slot_until_completed() {
        let mut t = SlotTable::new(1, 100);
        let s = t.admit(50, seq(1, 10, 50)).unwrap();
        assert_eq!(t.start_release(s).map(|q| q.id), Some(RequestId(1)));
        assert!(t.get(s).is_none());
        assert!(!t.can_admit(1), "slot still held by the engine");
        assert_eq!(t.kv_reserved(), 50);
        assert_eq!(t.take_releases(), vec![s]);
        t.complete_release(s);
        assert_eq!((t.free_count(), t.kv_reserved()), (1, 0));
        // Completing twice is harmless.
        t.complete_release(s);
        assert_eq!(t.free_count(), 1);
    }

    #[test]
    fn engine_finish_of_releasing_slot_cancels_the_release() {
        let mut t = SlotTable::new(2, 100);
        let s = t.admit(50, seq(1, 10, 50)).unwrap();
        t.start_release(s);
        assert!(t.free_now(s).is_none());
        assert!(t.take_releases().is_empty(), "engine already dropped it");
        assert_eq!((t.free_count(), t.kv_reserved()), (2, 0));
    }

    #[test]
    fn free_list_is_fifo_and_age_order_kept() {
        let mut t = SlotTable::new(3, 100);
        let a = t.admit(10, seq(1, 5, 10)).unwrap();
        let b = t.admit(10, seq(2, 5, 10)).unwrap();
        let c = t.admit(10, seq(3, 5, 10)).unwrap();
        t.free_now(b);
        let ids: Vec<u64> = t.iter_by_age().map(|s| s.id.0).collect();
        assert_eq!(ids, vec![1, 3]);
        t.free_now(a);
        // b was freed first, so it is reused first.
        assert_eq!(t.admit(10, seq(4, 5, 10)), Some(b));
        assert_eq!(t.find(RequestId(3)), Some(c));
        assert_eq!(t.find(RequestId(2)), None);
    }
}
