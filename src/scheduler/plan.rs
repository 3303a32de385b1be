//! The step planner: a pure function from scheduling state to one
//! [`StepPlan`] (vLLM v1 style).
//!
//! Every step, in this order:
//! 1. **Release**: slots ended on the scheduler side (cancel, stop string,
//!    requester gone) go into `release`, and their blocks back to the pool.
//! 2. **Grow**: every decoding sequence, oldest first, gets the blocks its
//!    decode token needs. When the pool is out of
//!    blocks, the most recently admitted running sequence is **preempted**
//!    (all its blocks back; it keeps its slot and is recomputed later),
//!    until the block is found or the sequence itself was the youngest.
//!    The oldest sequence therefore always progresses.
//! 3. **Resume**: preempted sequences, oldest first, get blocks again for
//!    what they must recompute (prompt + generated tokens but the last),
//!    minus their cached prefix, when the pool holds them with the
//!    watermark to spare. They come before any queued request.
//! 4. **Admit**: when nobody waits to resume, requests leave the FIFO queue
//!    while a slot is free, the pool holds the blocks of the head's prompt
//!    minus its cached prefix (plus a watermark of free blocks, so a fresh
//!    admission does not preempt at once), and the step budget can hold its
//!    decode. The head is never
//!    overtaken. The later choices of an `n` > 1 request wait at the head
//!    until the first choice has computed the prompt's full blocks, then
//!    share them (reference counts, no copy) and compute only the tail.
//! 3. **Decode**: one token for every sequence whose prompt is done.
//! 4. **Prefill**: chunks of the remaining prompts, oldest first (admission
//!    order, which the slot table keeps), each at most
//!    `max_prefill_chunk` and at most what is left of the token budget.
//! 5. **Drafts**: what is left of the budget goes to the drafting
//!    sequences' `max_drafts`, oldest first, as far as free blocks allow:
//!    speculation spends spare capacity, never a waiting prompt's, and
//!    never preempts.
//!
//! Every block table that changed goes into the plan (`tables`, or with
//! its admission / resumption).
//!
//! Every token a step may feed (prefill chunks, decode tokens, drafts) is
//! counted in `step_token_budget`; the engine may draft fewer than
//! planned, never more. There are no phases: a sequence is described by
//! counters and gets whatever work catches those counters up. Released
//! slots are returned to the free list only after admission, so a slot id
//! is never released and re-admitted in one plan.
//!
//! No I/O, no actix, no clock reads: the caller passes `now`, which makes the
//! planner unit-testable on plain state.

use std::time::{Duration, Instant};

use crate::engine::{
    Admission, Drafting, KvGrant, Resume, SeqWork, SlotId, SpecOptions, StepPlan, TableUpdate,
};
use crate::kv::{blocks_for, BlockId, SeqBlocks};

use super::queue::{QueuedSeq, WaitingQueue};
use super::slots::{RunningSeq, SlotTable};
use super::RequestId;

/// The per-step limits the planner enforces.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PlanLimits {
    pub step_token_budget: usize,
    pub max_prefill_chunk: usize,
    /// The engine's default speculation options; `None`: nobody drafts.
    pub speculation: Option<SpecOptions>,
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
    /// Draft tokens planned this step (the engine may use fewer).
    pub drafts: usize,
    /// Sequences prefilling this step.
    pub prefills: usize,
    /// Requests preempted in this plan.
    pub preempted: Vec<RequestId>,
}

impl PlannedStep {
    /// Whether the plan asks nothing of the engine (then it is not sent).
    pub fn is_empty(&self) -> bool {
        self.plan.release.is_empty()
            && self.plan.admit.is_empty()
            && self.plan.work.is_empty()
            && self.plan.preempt.is_empty()
            && self.plan.resume.is_empty()
    }

    /// The most tokens the forward pass may carry.
    pub fn tokens(&self) -> usize {
        self.prefill_tokens + self.decodes + self.drafts
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
    grow_decodes(slots, &mut out);
    resume(slots, &mut out);
    if !slots.iter_by_age().any(|s| s.preempted) {
        admit(queue, slots, limits, now, &mut wanted, &mut out);
    }
    schedule_work(slots, limits, &mut out);
    collect_tables(slots, &mut out);
    for &slot in &out.plan.release {
        slots.complete_release(slot);
    }
    out
}

/// Free blocks a new admission or resumption must leave (none when nothing
/// runs: a lone sequence may use the whole pool).
fn watermark(slots: &SlotTable) -> usize {
    if slots.iter_by_age().all(|s| s.preempted) {
        0
    } else {
        (slots.pool().num_blocks() / 100).max(1)
    }
}

/// Step 2: blocks for every decode, preempting the youngest when short.
fn grow_decodes(slots: &mut SlotTable, out: &mut PlannedStep) {
    for slot in slots.slots_by_age() {
        let Some(seq) = slots.get(slot).filter(|s| s.prompt_done()) else {
            continue;
        };
        let tokens = seq.computed + 1;
        while !slots.grow(slot, tokens) {
            let victim = slots
                .slots_by_age()
                .into_iter()
                .rev()
                .find(|&s| slots.get(s).is_some_and(|q| !q.preempted))
                .expect("the growing sequence itself is running");
            preempt(slots, victim, out);
            if victim == slot {
                break;
            }
        }
    }
}

fn preempt(slots: &mut SlotTable, slot: SlotId, out: &mut PlannedStep) {
    if let Some(seq) = slots.get(slot) {
        seq.span
            .in_scope(|| tracing::debug!(slot, computed = seq.computed, "preempted"));
        out.preempted.push(seq.id);
    }
    slots.preempt(slot);
    // A slot admitted or resumed in this very plan is never a victim: the
    // growth pass runs before both.
    out.plan.preempt.push(slot);
}

/// Step 3: preempted sequences get their blocks back, oldest first.
fn resume(slots: &mut SlotTable, out: &mut PlannedStep) {
    for slot in slots.slots_by_age() {
        if out.plan.preempt.contains(&slot) {
            break; // preempted just now: no room to resume anything
        }
        let Some(seq) = slots.get(slot).filter(|s| s.preempted) else {
            continue;
        };
        let bs = slots.block_size();
        let target = seq.fill_target();
        // A first prefill must compute at least one token (for its logits).
        let max_hit = match seq.generated {
            0 => (target - 1) / bs,
            _ => target / bs,
        };
        let known: Vec<u32> = (0..target).map(|p| seq.token_at(p)).collect();
        let (hits, idle) = slots.pool().peek_prefix(&known, max_hit);
        // Room for the recompute and, when it has generated, the decode
        // that follows (which may come at once if all of it is cached).
        let room = match seq.generated {
            0 => target,
            _ => target + 1,
        };
        let need = blocks_for(room, bs) - hits + idle;
        if need + watermark(slots) > slots.pool().available() {
            break; // oldest first: nobody younger overtakes it
        }
        let (seq, pool) = slots.with_pool_mut(slot).expect("running");
        let (prefix, last) = pool.claim_prefix(&known, max_hit);
        let cached = prefix.len() * bs;
        seq.blocks = SeqBlocks::with_prefix(prefix, last);
        let grown = seq.blocks.grow_to(pool, room);
        debug_assert!(grown, "checked against available() above");
        seq.preempted = false;
        seq.computed = cached;
        seq.table_dirty = false;
        out.plan.resume.push(Resume {
            slot,
            table: seq.blocks.table.clone(),
            cached_tokens: cached,
        });
    }
}

/// The tables that changed (admissions and resumptions carry their own).
fn collect_tables(slots: &mut SlotTable, out: &mut PlannedStep) {
    for slot in slots.slots_by_age() {
        let Some(seq) = slots.get_mut(slot) else {
            continue;
        };
        if seq.table_dirty && !seq.preempted {
            seq.table_dirty = false;
            out.plan.tables.push(TableUpdate {
                slot,
                table: seq.blocks.table.clone(),
            });
        }
    }
}

/// Moves requests from the queue's front into free slots.
fn admit(
    queue: &mut WaitingQueue,
    slots: &mut SlotTable,
    limits: PlanLimits,
    now: Instant,
    wanted: &mut impl FnMut(RequestId) -> bool,
    out: &mut PlannedStep,
) {
    // Every running sequence may always decode one token.
    let mut step_reserved: usize = slots.iter_by_age().count();
    while let Some(head) = queue.front() {
        if !wanted(head.id) {
            out.abandoned.extend(queue.pop_front());
            continue;
        }
        let drafting = Drafting::resolve(head.seq.speculation, limits.speculation);
        let fits_step = step_reserved < limits.step_token_budget;
        if !fits_step || !slots.can_admit() {
            break;
        }
        // The prompt's blocks, minus its cached (or shared) prefix.
        let bs = slots.block_size();
        let prefix = find_prefix(slots, head);
        let (hits, idle) = match &prefix {
            Prefix::Wait => break, // the head is never overtaken
            Prefix::Cached { hits, idle, .. } => (*hits, *idle),
            Prefix::Shared(blocks) => (blocks.len(), 0),
        };
        let need = blocks_for(head.seq.prompt.len(), bs) - hits + idle;
        if need + watermark(slots) > slots.pool().available() {
            break;
        }
        let Some(q) = queue.pop_front() else { break };
        step_reserved += 1;
        let queue_wait = now.saturating_duration_since(q.submitted_at);
        let pool = slots.pool_mut();
        let mut blocks = match prefix {
            Prefix::Cached { max_hit, .. } => {
                let (prefix, last) = pool.claim_prefix(&q.seq.prompt, max_hit);
                SeqBlocks::with_prefix(prefix, last)
            }
            Prefix::Shared(shared) => SeqBlocks::share_prefix(pool, &shared, &q.seq.prompt),
            Prefix::Wait => unreachable!("a waiting head breaks the loop above"),
        };
        let cached = blocks.table.len() * bs;
        let grown = blocks.grow_to(pool, q.seq.prompt.len());
        debug_assert!(grown, "checked against available() above");
        let table = blocks.table.clone();
        let admission = |slot| RunningSeq {
            id: q.id,
            slot,
            prompt: q.seq.prompt.clone(),
            prompt_len: q.seq.prompt.len(),
            computed: cached,
            generated: 0,
            tokens: Vec::new(),
            cached_tokens: cached,
            blocks,
            table_dirty: false,
            preempted: false,
            drafted: 0,
            accepted_drafts: 0,
            max_new_tokens: q.seq.max_new_tokens,
            drafting,
            submitted_at: q.submitted_at,
            admitted_at: now,
            first_token_at: None,
            last_token_at: None,
            span: q.span.clone(),
        };
        let Some(slot) = slots.admit(admission) else {
            break; // can_admit said yes just above
        };
        out.plan.admit.push(Admission {
            slot,
            prompt: q.seq.prompt,
            sampling: q.seq.sampling,
            max_new_tokens: q.seq.max_new_tokens,
            kv: KvGrant::Blocks {
                table,
                cached_tokens: cached,
            },
            spec: q.seq.speculation,
            constraints: q.seq.constraints,
        });
        out.admitted.push(Admitted {
            id: q.id,
            slot,
            queue_wait,
        });
    }
}

/// Where a queued request's first blocks come from. At least one prompt
/// token is always computed (for the first logits), so at most the full
/// blocks before the prompt's last token are reused.
enum Prefix {
    /// Its longest cached prefix: `hits` blocks (of at most `max_hit`),
    /// `idle` of them owned by nobody. Zero hits with caching off.
    Cached {
        hits: usize,
        idle: usize,
        max_hit: usize,
    },
    /// The computed prompt blocks of the first choice of its request.
    Shared(Vec<BlockId>),
    /// The first choice of its request is still computing them.
    Wait,
}

/// The prefix `head` starts from. A later choice of a request waits until
/// the first choice (running) has computed the prompt's full blocks, then
/// shares them: the prompt is prefilled once for the whole request, with or
/// without the prefix cache. If the first choice is no longer running (it
/// ended, e.g. at `max_tokens` 1, before the others were admitted), the
/// choice is on its own: the prefix cache, when on, still holds those
/// blocks; without it the prompt is computed again.
fn find_prefix(slots: &SlotTable, head: &QueuedSeq) -> Prefix {
    let bs = slots.block_size();
    let prompt = &head.seq.prompt;
    let max_hit = (prompt.len() - 1) / bs;
    let leader = head
        .shares_prompt_with
        .and_then(|id| slots.find(id))
        .and_then(|slot| slots.get(slot));
    match leader {
        Some(first) if max_hit > 0 && first.prompt == *prompt => {
            if first.preempted || first.computed < max_hit * bs {
                Prefix::Wait
            } else {
                Prefix::Shared(first.blocks.table[..max_hit].to_vec())
            }
        }
        _ => {
            let (hits, idle) = slots.pool().peek_prefix(prompt, max_hit);
            Prefix::Cached {
                hits,
                idle,
                max_hit,
            }
        }
    }
}

/// Fills the token budget: decodes first, then prefill chunks oldest
/// first, then drafts from what is left.
fn schedule_work(slots: &mut SlotTable, limits: PlanLimits, out: &mut PlannedStep) {
    let mut budget = limits.step_token_budget;
    // Admission keeps every decode inside the budget; the checks only keep
    // a bad state from overrunning it.
    for seq in slots.iter_by_age().filter(|s| s.prompt_done()) {
        if budget == 0 {
            break;
        }
        if seq.blocks.room(slots.block_size()) < seq.computed + 1 {
            continue; // no blocks this step (the growth pass preempted it)
        }
        out.plan.work.push(SeqWork::Decode {
            slot: seq.slot,
            max_drafts: 0,
        });
        out.decodes += 1;
        budget -= 1;
    }
    for seq in slots.iter_by_age().filter(|s| s.needs_prefill()) {
        if budget == 0 {
            break;
        }
        let len = seq
            .prompt_remaining()
            .min(limits.max_prefill_chunk)
            .min(budget);
        out.plan.work.push(SeqWork::Prefill {
            slot: seq.slot,
            start: seq.computed,
            len,
        });
        out.prefills += 1;
        out.prefill_tokens += len;
        budget -= len;
    }
    for work in out.plan.work.iter_mut() {
        let SeqWork::Decode { slot, max_drafts } = work else {
            continue;
        };
        let Some(seq) = slots.get(*slot) else {
            continue;
        };
        if let Some(d) = seq.drafting {
            // Only as many drafts as free blocks hold: drafts never preempt.
            let bs = slots.block_size();
            let base = seq.computed + 1;
            let room = seq.blocks.room(bs) + slots.pool().available() * bs - base;
            let grant = d
                .planned_drafts(limits.step_token_budget)
                .min(budget)
                .min(room);
            let grown = slots.grow(*slot, base + grant);
            debug_assert!(grown, "room counted the free blocks");
            *max_drafts = grant;
            out.drafts += grant;
            budget -= grant;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::queue::tests::queued;

    const LIMITS: PlanLimits = PlanLimits {
        step_token_budget: 64,
        max_prefill_chunk: 32,
        speculation: None,
    };

    fn plan(q: &mut WaitingQueue, t: &mut SlotTable, step: u64) -> PlannedStep {
        plan_step(step, q, t, LIMITS, Instant::now(), |_| true)
    }

    /// Applies a plan as a well-behaved engine would (counters and blocks).
    fn apply(t: &mut SlotTable, p: &PlannedStep) {
        for w in &p.plan.work {
            let slot = w.slot();
            let seq = t.get_mut(slot).expect("planned slot is running");
            assert!(seq.blocks.room(t_block()) >= seq.computed + w.max_tokens());
            match *w {
                SeqWork::Prefill { start, len, .. } => {
                    assert_eq!(start, seq.computed, "chunks must be contiguous");
                    seq.computed += len;
                    if seq.generated == 0 && seq.computed == seq.prompt_len {
                        seq.generated += 1;
                        seq.tokens.push(7);
                    }
                }
                SeqWork::Decode { .. } => {
                    seq.computed += 1;
                    seq.generated += 1;
                    seq.tokens.push(7);
                }
            }
            t.settle_blocks(slot);
        }
    }

    fn t_block() -> usize {
        crate::kv::DEFAULT_BLOCK_SIZE
    }

    fn budget_used(p: &PlannedStep) -> usize {
        p.plan.work.iter().map(SeqWork::max_tokens).sum()
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
            speculation: None,
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
        assert!(t.iter_by_age().all(|s| s.computed >= s.prompt_len));
        assert!(
            step <= 4,
            "160 prompt tokens at 64 per step took {step} steps"
        );
    }

    #[test]
    fn later_choices_wait_for_the_first_and_share_its_prompt_blocks() {
        for caching in [false, true] {
            let pool = crate::kv::BlockPool::new(100, t_block(), caching, 0);
            let mut t = SlotTable::with_pool(8, pool);
            let mut q = WaitingQueue::new(16);
            // 70 tokens: four full blocks and 6; chunks of 32 take 3 steps.
            let first = queued(1, 70, 5);
            for id in 1..=3 {
                let mut choice = queued(id, 70, 5);
                choice.seq = first.seq.clone();
                choice.shares_prompt_with = (id > 1).then_some(RequestId(1));
                q.push(choice).unwrap();
            }
            q.push(queued(9, 3, 5)).unwrap(); // queued behind the group
            let p0 = plan(&mut q, &mut t, 0);
            assert_eq!(p0.admitted.len(), 1, "the others wait for the prompt");
            apply(&mut t, &p0);
            let p1 = plan(&mut q, &mut t, 1);
            assert!(p1.admitted.is_empty(), "32 of 64 shareable tokens done");
            apply(&mut t, &p1);
            let p2 = plan(&mut q, &mut t, 2);
            let ids: Vec<u64> = p2.admitted.iter().map(|a| a.id.0).collect();
            assert_eq!(ids, vec![2, 3, 9], "caching {caching}");
            let leader = t.get(p0.admitted[0].slot).unwrap().blocks.table.clone();
            for a in &p2.admitted[..2] {
                let seq = t.get(a.slot).unwrap();
                assert_eq!(seq.blocks.table[..4], leader[..4], "caching {caching}");
                assert_eq!((seq.computed, seq.cached_tokens), (64, 64));
                assert_eq!(t.pool().refs(leader[0]), 3);
                let prefill = p2.plan.work.iter().find(|w| w.slot() == a.slot);
                assert_eq!(
                    prefill,
                    Some(&SeqWork::Prefill {
                        slot: a.slot,
                        start: 64,
                        len: 6
                    }),
                    "only the tail is computed"
                );
            }
            // The first choice ending early leaves the shared blocks valid.
            t.free_now(p0.admitted[0].slot);
            assert_eq!(t.pool().refs(leader[0]), 2);
            t.pool().check();
        }
    }

    #[test]
    fn a_later_choice_whose_first_is_gone_starts_on_its_own() {
        let mut t = SlotTable::new(4, 10_000);
        let mut q = WaitingQueue::new(16);
        let mut choice = queued(2, 40, 5);
        choice.shares_prompt_with = Some(RequestId(1)); // never admitted
        q.push(choice).unwrap();
        let p = plan(&mut q, &mut t, 0);
        assert_eq!(p.admitted.len(), 1);
        assert_eq!(t.get(p.admitted[0].slot).unwrap().computed, 0);
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
        let mut t = SlotTable::new(8, 160); // 10 blocks of 16
        q.push(queued(1, 100, 30)).unwrap(); // 7 blocks for its prompt
        q.push(queued(2, 50, 20)).unwrap(); // 4: not with 7 and a watermark of 1
        q.push(queued(3, 5, 5)).unwrap(); // 1: would fit, but must wait its turn
        let p = plan(&mut q, &mut t, 0);
        assert_eq!(p.admitted.len(), 1);
        assert_eq!(
            t.kv_used(),
            7 * 16,
            "the prompt's blocks, not its worst case"
        );
        assert_eq!(q.len(), 2);
        // Once #1 ends, #2 and #3 both fit.
        let slot = p.admitted[0].slot;
        t.free_now(slot);
        let p = plan(&mut q, &mut t, 1);
        let ids: Vec<u64> = p.admitted.iter().map(|a| a.id.0).collect();
        assert_eq!(ids, vec![2, 3]);
        assert_eq!(t.kv_used(), 5 * 16);
        t.pool().check();
    }

    #[test]
    fn out_of_blocks_the_youngest_is_preempted_and_resumed_first() {
        let mut q = WaitingQueue::new(16);
        let mut t = SlotTable::new(8, 64); // 4 blocks of 16
        q.push(queued(1, 16, 40)).unwrap();
        q.push(queued(2, 16, 40)).unwrap();
        let p = plan(&mut q, &mut t, 0);
        assert_eq!(p.admitted.len(), 2);
        let (old, young) = (p.admitted[0].slot, p.admitted[1].slot);
        apply(&mut t, &p);
        // Both decode into a second block: the pool is full after that.
        let mut step = 1;
        let mut preempted_at = None;
        while preempted_at.is_none() && step < 40 {
            let p = plan(&mut q, &mut t, step);
            if !p.plan.preempt.is_empty() {
                assert_eq!(p.plan.preempt, vec![young], "the most recently admitted");
                assert!(p.plan.work.iter().all(|w| w.slot() != young));
                preempted_at = Some(step);
            }
            apply(&mut t, &p);
            t.pool().check();
            step += 1;
        }
        assert!(preempted_at.is_some(), "four blocks cannot hold both");
        let young_seq = t.get(young).unwrap();
        assert!(young_seq.preempted && young_seq.blocks.table.is_empty());
        // The old one runs on alone; once it ends the young one resumes,
        // recomputing everything but its last token.
        let generated = young_seq.generated;
        t.free_now(old);
        let p = plan(&mut q, &mut t, step);
        let resume = &p.plan.resume;
        assert_eq!(resume.len(), 1);
        assert_eq!(resume[0].slot, young);
        let target = 16 + generated - 1;
        let cached = resume[0].cached_tokens;
        let want = match target - cached {
            // Everything but the last token was still cached: decode at once.
            0 => SeqWork::Decode {
                slot: young,
                max_drafts: 0,
            },
            left => SeqWork::Prefill {
                slot: young,
                start: cached,
                len: left.min(LIMITS.max_prefill_chunk),
            },
        };
        assert_eq!(p.plan.work, vec![want]);
        apply(&mut t, &p);
        t.pool().check();
    }

    #[test]
    fn a_repeated_prompt_starts_after_its_cached_blocks() {
        let mut q = WaitingQueue::new(16);
        let mut t = SlotTable::new(8, 1024);
        q.push(queued(1, 40, 1)).unwrap();
        let mut step = 0;
        while t.running_count() > 0 || step == 0 {
            let p = plan(&mut q, &mut t, step);
            apply(&mut t, &p);
            let done: Vec<SlotId> = t
                .iter_by_age()
                .filter(|s| s.generated >= s.max_new_tokens)
                .map(|s| s.slot)
                .collect();
            for s in done {
                t.free_now(s);
            }
            step += 1;
        }
        assert_eq!(
            t.pool().cached(),
            2,
            "two full blocks of the 40-token prompt"
        );
        q.push(queued(2, 40, 1)).unwrap();
        let p = plan(&mut q, &mut t, step);
        let KvGrant::Blocks { cached_tokens, .. } = p.plan.admit[0].kv else {
            panic!("the scheduler hands out blocks");
        };
        assert_eq!(cached_tokens, 32);
        assert_eq!(
            p.plan.work,
            vec![SeqWork::Prefill {
                slot: p.admitted[0].slot,
                start: 32,
                len: 8
            }]
        );
        assert_eq!(t.pool().counters().hit_tokens, 32);
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

    /// Limits of an engine with a draft head.
    fn drafting_limits(step_token_budget: usize, max_prefill_chunk: usize) -> PlanLimits {
        PlanLimits {
            step_token_budget,
            max_prefill_chunk,
            speculation: Some(SpecOptions::default()),
        }
    }

    /// A queued request that may draft (`seed`: sampled and seeded).
    fn drafting(id: u64, prompt_len: usize, max_draft: usize, seed: Option<u64>) -> QueuedSeq {
        let mut q = queued(id, prompt_len, 100);
        q.seq.speculation = Some(SpecOptions::constant(max_draft));
        if let Some(seed) = seed {
            q.seq.sampling = crate::sampler::SamplingOptions {
                temperature: 0.8,
                seed: Some(seed),
                ..Default::default()
            };
        }
        q
    }

    #[test]
    fn drafts_stay_inside_the_token_budget() {
        let limits = drafting_limits(40, 16);
        let mut q = WaitingQueue::new(64);
        let mut t = SlotTable::new(16, 100_000);
        // Seeded and greedy drafters, and a few plain requests.
        for i in 0..12u64 {
            let seed = (i % 3 == 0).then_some(i);
            q.push(drafting(i, 3 + i as usize, 2 + i as usize % 5, seed))
                .unwrap();
        }
        for i in 12..16u64 {
            q.push(queued(i, 5, 100)).unwrap();
        }
        for step in 0..30 {
            let p = plan_step(step, &mut q, &mut t, limits, Instant::now(), |_| true);
            let used = budget_used(&p);
            assert!(
                used <= limits.step_token_budget,
                "step {step}: {used} tokens"
            );
            assert_eq!(used, p.tokens(), "step {step}: the counters match the work");
            for w in &p.plan.work {
                if let SeqWork::Decode { slot, max_drafts } = *w {
                    let seq = t.get(slot).unwrap();
                    let cap = seq.drafting.map_or(0, |d| d.options.max_draft);
                    assert!(max_drafts <= cap, "step {step}: slot {slot}");
                }
            }
            apply(&mut t, &p);
        }
    }

    #[test]
    fn drafts_use_what_prefill_leaves() {
        let limits = drafting_limits(20, 16);
        let mut q = WaitingQueue::new(8);
        let mut t = SlotTable::new(8, 10_000);
        q.push(drafting(1, 2, 8, None)).unwrap();
        let p = plan_step(0, &mut q, &mut t, limits, Instant::now(), |_| true);
        apply(&mut t, &p);
        // Alone, the drafter gets its whole allowance.
        let p = plan_step(1, &mut q, &mut t, limits, Instant::now(), |_| true);
        assert_eq!(
            p.plan.work,
            vec![SeqWork::Decode {
                slot: 0,
                max_drafts: 8
            }]
        );
        // A long prompt arrives: its chunk comes first, drafts get the rest.
        q.push(queued(2, 100, 4)).unwrap();
        let p = plan_step(2, &mut q, &mut t, limits, Instant::now(), |_| true);
        assert_eq!(
            p.plan.work,
            vec![
                SeqWork::Decode {
                    slot: 0,
                    max_drafts: 3
                },
                SeqWork::Prefill {
                    slot: 1,
                    start: 0,
                    len: 16
                },
            ]
        );
        assert_eq!(budget_used(&p), 20);
    }
}
