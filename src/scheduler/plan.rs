//! The step planner: a pure function from scheduling state to one
//! [`StepPlan`] (vLLM v1 style).
//!
//! Every step, in this order:
//! 1. **Release**: slots ended on the scheduler side (cancel, stop string,
//!    requester gone) go into `release`.
//! 2. **Admit**: requests leave the FIFO queue while a slot is free and the
//!    KV pool can hold the head's reservation. The head is never overtaken.
//! 3. **Decode**: one token for every sequence whose prompt is done.
//! 4. **Prefill**: chunks of the remaining prompts, oldest first (admission
//!    order, which the slot table keeps), each at most
//!    `max_prefill_chunk` and at most what is left of the token budget.
//!
//! There are no phases: a sequence is described by counters and gets
//! whatever work catches those counters up. Decodes come first so that a long
//! prompt's prefill rides along with the other streams' decodes instead of
//! freezing them. Released slots are returned to the free list only after
//! admission, so a slot id is never released and re-admitted in one plan.
//!
//! No I/O, no actix, no clock reads: the caller passes `now`, which makes the
//! planner unit-testable on plain state.

use std::time::{Duration, Instant};

use crate::engine::{Admission, SeqWork, SlotId, StepPlan};

use super::queue::{QueuedSeq, WaitingQueue};
use super::slots::{RunningSeq, SlotTable};
use super::RequestId;

/// The per-step limits the planner enforces.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PlanLimits {
    pub step_token_budget: usize,
    pub max_prefill_chunk: usize,
}

/// A request that took a slot in this plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Admitted {
    pub id: RequestId,
    pub slot: SlotId,
    pub queue_wait: Duration,
}

/// The plan and what building it did to the state.
#[derive(Debug, Default)]
pub(crate) struct PlannedStep {
    pub plan: StepPlan,
    pub admitted: Vec<Admitted>,
    /// Queued requests dropped at admission because their requester is gone.
    pub abandoned: Vec<QueuedSeq>,
    /// Prompt tokens scheduled this step.
    pub prefill_tokens: usize,
    /// Sequences decoding this step.
    pub decodes: usize,
    /// Sequences prefilling this step.
    pub prefills: usize,
}

impl PlannedStep {
    /// Whether the plan asks nothing of the engine (then it is not sent).
    pub fn is_empty(&self) -> bool {
        self.plan.release.is_empty() && self.plan.admit.is_empty() && self.plan.work.is_empty()
    }

    /// Tokens in the forward pass.
    pub fn tokens(&self) -> usize {
        self.prefill_tokens + self.decodes
    }
}

/// Builds step `step`'s plan, mutating the queue and slot table to match
/// (admitted requests move into slots; released slots become free).
/// `wanted(id)` is asked before admitting a queued request; `false` drops it
/// (its requester disconnected) without spending a slot on it.
pub(crate) fn plan_step(
    step: u64,
    queue: &mut WaitingQueue,
    slots: &mut SlotTable,
    limits: PlanLimits,
    now: Instant,
    mut wanted: impl FnMut(RequestId) -> bool,
) -> PlannedStep {
    let mut out = PlannedStep {
        plan: StepPlan {
            step,
            release: slots.take_releases(),
            ..StepPlan::default()
        },
        ..PlannedStep::default()
    };
    admit(queue, slots, now, &mut wanted, &mut out);
    schedule_work(slots, limits, &mut out);
    for &slot in &out.plan.release {
        slots.complete_release(slot);
    }
    out
}

/// Moves requests from the queue's front into free slots.
fn admit(
    queue: &mut WaitingQueue,
    slots: &mut SlotTable,
    now: Instant,
    wanted: &mut impl FnMut(RequestId) -> bool,
    out: &mut PlannedStep,
) {
    while let Some(head) = queue.front() {
        if !wanted(head.id) {
            out.abandoned.extend(queue.pop_front());
            continue;
        }
        if !slots.can_admit(head.spec.kv_reserve) {
            break;
        }
        let Some(q) = queue.pop_front() else { break };
        let queue_wait = now.saturating_duration_since(q.submitted_at);
        let admission = |slot| RunningSeq {
            id: q.id,
            slot,
            prompt_len: q.spec.prompt.len(),
            num_prefilled: 0,
            generated: 0,
            drafted: 0,
            accepted_drafts: 0,
            max_new_tokens: q.spec.max_new_tokens,
            kv_reserve: q.spec.kv_reserve,
            submitted_at: q.submitted_at,
            admitted_at: now,
            first_token_at: None,
            last_token_at: None,
            span: q.span.clone(),
        };
        let Some(slot) = slots.admit(q.spec.kv_reserve, admission) else {
            break; // can_admit said yes just above
        };
        out.plan.admit.push(Admission {
            slot,
            prompt: q.spec.prompt,
            sampling: q.spec.sampling,
            max_new_tokens: q.spec.max_new_tokens,
            kv_reserve: q.spec.kv_reserve,
            spec: q.spec.spec,
        });
        out.admitted.push(Admitted {
            id: q.id,
            slot,
            queue_wait,
        });
    }
}

/// Fills the token budget: decodes first, then prefill chunks oldest first.
fn schedule_work(slots: &SlotTable, limits: PlanLimits, out: &mut PlannedStep) {
    let mut budget = limits.step_token_budget;
    // The config guarantees budget >= max_seqs, so every decode fits; the
    // check only keeps a bad config from overrunning the budget.
    for seq in slots.iter_by_age().filter(|s| s.prompt_done()) {
        if budget == 0 {
            break;
        }
        out.plan.work.push(SeqWork::Decode { slot: seq.slot });
        out.decodes += 1;
        budget -= 1;
    }
    for seq in slots.iter_by_age().filter(|s| !s.prompt_done()) {
        if budget == 0 {
            break;
        }
        let len = seq
            .prompt_remaining()
            .min(limits.max_prefill_chunk)
            .min(budget);
        out.plan.work.push(SeqWork::Prefill {
            slot: seq.slot,
            start: seq.num_prefilled,
            len,
        });
        out.prefills += 1;
        out.prefill_tokens += len;
        budget -= len;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::queue::tests::queued;

    const LIMITS: PlanLimits = PlanLimits {
        step_token_budget: 64,
        max_prefill_chunk: 32,
    };

    fn plan(q: &mut WaitingQueue, t: &mut SlotTable, step: u64) -> PlannedStep {
        plan_step(step, q, t, LIMITS, Instant::now(), |_| true)
    }

    /// Applies a plan as a well-behaved engine would (counters only).
    fn apply(t: &mut SlotTable, p: &PlannedStep) {
        for w in &p.plan.work {
            let seq = t.get_mut(w.slot()).expect("planned slot is running");
            match *w {
                SeqWork::Prefill { start, len, .. } => {
                    assert_eq!(start, seq.num_prefilled, "chunks must be contiguous");
                    seq.num_prefilled += len;
                    if seq.prompt_done() {
                        seq.generated += 1;
                    }
                }
                SeqWork::Decode { .. } => seq.generated += 1,
            }
        }
    }

    fn budget_used(p: &PlannedStep) -> usize {
        p.plan
            .work
            .iter()
            .map(|w| match *w {
                SeqWork::Prefill { len, .. } => len,
                SeqWork::Decode { .. } => 1,
            })
            .sum()
    }

    #[test]
    fn decodes_first_then_prefill_within_budget() {
        let mut q = WaitingQueue::new(16);
        let mut t = SlotTable::new(8, 10_000);
        for i in 0..3 {
            q.push(queued(i, 4, 10)).unwrap();
        }
        let p0 = plan(&mut q, &mut t, 0);
        assert_eq!(p0.plan.admit.len(), 3);
        assert_eq!((p0.prefills, p0.decodes, p0.tokens()), (3, 0, 12));
        apply(&mut t, &p0);
        q.push(queued(9, 1000, 10)).unwrap();
        let p1 = plan(&mut q, &mut t, 1);
        // Three decodes, then the long prompt's first chunk capped at 32.
        assert_eq!(p1.decodes, 3);
        assert!(matches!(
            p1.plan.work[..3],
            [
                SeqWork::Decode { .. },
                SeqWork::Decode { .. },
                SeqWork::Decode { .. }
            ]
        ));
        assert_eq!(
            p1.plan.work[3],
            SeqWork::Prefill {
                slot: p1.admitted[0].slot,
                start: 0,
                len: 32
            }
        );
        assert!(budget_used(&p1) <= LIMITS.step_token_budget);
    }

    #[test]
    fn decodes_are_never_crowded_out_by_a_prefill() {
        // Even when one chunk could take the whole budget, decodes go first.
        let limits = PlanLimits {
            step_token_budget: 64,
            max_prefill_chunk: 64,
        };
        let mut q = WaitingQueue::new(16);
        let mut t = SlotTable::new(8, 10_000);
        for i in 0..3 {
            q.push(queued(i, 2, 10)).unwrap();
        }
        let p0 = plan_step(0, &mut q, &mut t, limits, Instant::now(), |_| true);
        apply(&mut t, &p0);
        q.push(queued(9, 1000, 10)).unwrap();
        let p1 = plan_step(1, &mut q, &mut t, limits, Instant::now(), |_| true);
        assert_eq!((p1.decodes, p1.prefill_tokens), (3, 61));
        assert_eq!(budget_used(&p1), 64);
    }

    #[test]
    fn long_prefill_is_contiguous_and_shares_budget_oldest_first() {
        let mut q = WaitingQueue::new(16);
        let mut t = SlotTable::new(8, 10_000);
        q.push(queued(1, 100, 5)).unwrap();
        q.push(queued(2, 50, 5)).unwrap();
        q.push(queued(3, 10, 5)).unwrap();
        let p = plan(&mut q, &mut t, 0);
        let chunks: Vec<(u64, usize)> = p
            .plan
            .work
            .iter()
            .map(|w| match *w {
                SeqWork::Prefill { slot, len, .. } => (t.get(slot).unwrap().id.0, len),
                SeqWork::Decode { .. } => panic!("nothing is prefilled yet"),
            })
            .collect();
        // Oldest first: 32 for #1, the remaining 32 for #2, nothing for #3.
        assert_eq!(chunks, vec![(1, 32), (2, 32)]);
        let mut step = 1;
        apply(&mut t, &p);
        while t.iter_by_age().any(|s| !s.prompt_done()) {
            let p = plan(&mut q, &mut t, step);
            assert!(budget_used(&p) <= LIMITS.step_token_budget);
            apply(&mut t, &p);
            step += 1;
        }
        assert!(t.iter_by_age().all(|s| s.num_prefilled == s.prompt_len));
        assert!(
            step <= 4,
            "160 prompt tokens at 64 per step took {step} steps"
        );
    }

    #[test]
    fn admission_limited_by_slots_in_fifo_order() {
        let mut q = WaitingQueue::new(16);
        let mut t = SlotTable::new(2, 10_000);
        for i in 0..4 {
            q.push(queued(i, 2, 2)).unwrap();
        }
        let p = plan(&mut q, &mut t, 0);
        let ids: Vec<u64> = p.admitted.iter().map(|a| a.id.0).collect();
        assert_eq!(ids, vec![0, 1]);
        assert_eq!(q.len(), 2);
        assert_eq!(q.front().map(|s| s.id.0), Some(2));
    }

    #[test]
    fn admission_limited_by_kv_and_head_is_not_overtaken() {
        let mut q = WaitingQueue::new(16);
        let mut t = SlotTable::new(8, 100);
        q.push(queued(1, 30, 30)).unwrap(); // 60
        q.push(queued(2, 30, 20)).unwrap(); // 50: does not fit next to 60
        q.push(queued(3, 5, 5)).unwrap(); // 10: would fit, but must wait its turn
        let p = plan(&mut q, &mut t, 0);
        assert_eq!(p.admitted.len(), 1);
        assert_eq!(t.kv_reserved(), 60);
        assert_eq!(q.len(), 2);
        // Once #1 ends, #2 and #3 both fit.
        let slot = p.admitted[0].slot;
        t.free_now(slot);
        let p = plan(&mut q, &mut t, 1);
        let ids: Vec<u64> = p.admitted.iter().map(|a| a.id.0).collect();
        assert_eq!(ids, vec![2, 3]);
        assert_eq!(t.kv_reserved(), 60);
    }

    #[test]
    fn released_slot_is_not_reused_in_the_same_plan() {
        let mut q = WaitingQueue::new(16);
        let mut t = SlotTable::new(1, 100);
        q.push(queued(1, 2, 2)).unwrap();
        let p = plan(&mut q, &mut t, 0);
        let slot = p.admitted[0].slot;
        t.start_release(slot);
        q.push(queued(2, 2, 2)).unwrap();
        let p = plan(&mut q, &mut t, 1);
        assert_eq!(p.plan.release, vec![slot]);
        assert!(
            p.plan.admit.is_empty(),
            "slot must not be re-admitted alongside its release"
        );
        assert!(p.plan.work.is_empty());
        let p = plan(&mut q, &mut t, 2);
        assert_eq!(
            p.admitted.iter().map(|a| a.slot).collect::<Vec<_>>(),
            vec![slot]
        );
        assert!(p.plan.release.is_empty());
    }

    #[test]
    fn abandoned_requests_take_no_slot_and_empty_state_plans_nothing() {
        let mut q = WaitingQueue::new(16);
        let mut t = SlotTable::new(1, 100);
        q.push(queued(1, 2, 2)).unwrap();
        q.push(queued(2, 2, 2)).unwrap();
        let p = plan_step(0, &mut q, &mut t, LIMITS, Instant::now(), |id| id.0 != 1);
        assert_eq!(
            p.abandoned.iter().map(|s| s.id.0).collect::<Vec<_>>(),
            vec![1]
        );
        assert_eq!(
            p.admitted.iter().map(|a| a.id.0).collect::<Vec<_>>(),
            vec![2]
        );
        let slot = p.admitted[0].slot;
        t.free_now(slot);
        assert!(plan(&mut q, &mut t, 1).is_empty());
    }
}
