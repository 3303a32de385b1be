//! The bounded FIFO of requests waiting for a slot.
//!
//! Owned by the scheduling core. Admission takes from the front only, so
//! requests are served in arrival order; a head that does not fit yet (KV)
//! blocks the ones behind it rather than being overtaken, which keeps large
//! requests from starving. The bound turns overload into an immediate
//! [`SchedulerError::Overloaded`] instead of unbounded memory.

use std::collections::VecDeque;
use std::time::Instant;

use super::validate::ValidSeq;
use super::{RequestId, SchedulerError};

/// A request that has been accepted but holds no slot yet.
#[derive(Debug)]
pub(crate) struct QueuedSeq {
    pub id: RequestId,
    pub seq: ValidSeq,
    pub submitted_at: Instant,
    /// Per-request tracing span, carried into the slot table on admission.
    pub span: tracing::Span,
    /// Another choice of the same request (its first), whose prompt blocks
    /// this one shares once they are computed (see `plan`).
    pub shares_prompt_with: Option<RequestId>,
}

/// Bounded FIFO of [`QueuedSeq`].
#[derive(Debug)]
pub(crate) struct WaitingQueue {
    items: VecDeque<QueuedSeq>,
    limit: usize,
}

impl WaitingQueue {
    pub fn new(limit: usize) -> Self {
        Self {
            items: VecDeque::new(),
            limit,
        }
    }

    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// The most requests that may wait at once.
    pub fn limit(&self) -> usize {
        self.limit
    }

    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Appends a request, or refuses it when `limit` requests already wait.
    #[cfg(test)]
    pub fn push(&mut self, seq: QueuedSeq) -> Result<(), SchedulerError> {
        self.push_with_room(seq, 0)
    }

    /// [`push`](Self::push) when `free_slots` slots are free: requests that
    /// will take those slots at the next step do not count against the
    /// limit, so a burst into an idle scheduler is admitted up to
    /// `limit + free_slots`, not just `limit`.
    pub fn push_with_room(
        &mut self,
        seq: QueuedSeq,
        free_slots: usize,
    ) -> Result<(), SchedulerError> {
        if self.items.len() >= self.limit.saturating_add(free_slots) {
            return Err(SchedulerError::Overloaded {
                queued: self.items.len(),
                limit: self.limit,
            });
        }
        self.items.push_back(seq);
        Ok(())
    }

    pub fn front(&self) -> Option<&QueuedSeq> {
        self.items.front()
    }

    pub fn pop_front(&mut self) -> Option<QueuedSeq> {
        self.items.pop_front()
    }

    /// Removes a request by id (cancellation). Linear, but cancellations are
    /// rare next to steps and the queue is bounded.
    pub fn remove(&mut self, id: RequestId) -> Option<QueuedSeq> {
        let pos = self.items.iter().position(|q| q.id == id)?;
        self.items.remove(pos)
    }

    /// Removes and returns, in order, every request for which `drop` is true.
    pub fn drain_where(&mut self, mut drop: impl FnMut(&QueuedSeq) -> bool) -> Vec<QueuedSeq> {
        let mut removed = Vec::new();
        let mut kept = VecDeque::with_capacity(self.items.len());
        for q in self.items.drain(..) {
            if drop(&q) {
                removed.push(q);
            } else {
                kept.push_back(q);
            }
        }
        self.items = kept;
        removed
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::scheduler::validate::tests::valid;

    /// A queued request with `prompt_len` tokens and the given reservation.
    pub(crate) fn queued(id: u64, prompt_len: usize, max_new: usize) -> QueuedSeq {
        QueuedSeq {
            id: RequestId(id),
            seq: valid(prompt_len, max_new),
            submitted_at: Instant::now(),
            span: tracing::Span::none(),
            shares_prompt_with: None,
        }
    }

    #[test]
    fn free_slots_add_room() {
        let mut q = WaitingQueue::new(2);
        for i in 0..5 {
            q.push_with_room(queued(i, 1, 1), 3).unwrap();
        }
        assert!(q.push_with_room(queued(9, 1, 1), 3).is_err());
        assert!(q.push(queued(9, 1, 1)).is_err());
    }

    #[test]
    fn bounded_fifo() {
        let mut q = WaitingQueue::new(2);
        q.push(queued(1, 1, 1)).unwrap();
        q.push(queued(2, 1, 1)).unwrap();
        assert_eq!(
            q.push(queued(3, 1, 1)).err(),
            Some(SchedulerError::Overloaded {
                queued: 2,
                limit: 2
            })
        );
        assert_eq!(q.pop_front().map(|s| s.id), Some(RequestId(1)));
        q.push(queued(4, 1, 1)).unwrap();
        assert_eq!(q.remove(RequestId(4)).map(|s| s.id), Some(RequestId(4)));
        assert!(q.remove(RequestId(4)).is_none());
        assert_eq!(q.len(), 1);
    }

    #[test]
    fn drain_where_keeps_order() {
        let mut q = WaitingQueue::new(8);
        for i in 0..6 {
            q.push(queued(i, 1, 1)).unwrap();
        }
        let gone = q.drain_where(|s| s.id.0 % 2 == 1);
        assert_eq!(
            gone.iter().map(|s| s.id.0).collect::<Vec<_>>(),
            vec![1, 3, 5]
        );
        let rest: Vec<u64> = std::iter::from_fn(|| q.pop_front().map(|s| s.id.0)).collect();
        assert_eq!(rest, vec![0, 2, 4]);
    }
}
