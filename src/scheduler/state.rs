//! The scheduling core: every piece of scheduler state and every transition,
//! with no actix and no I/O.
//!
//! The actor owns one [`SchedulerState`] and feeds it messages and engine
//! outcomes; each transition appends the events it produces to an outbox
//! (`out`), which the actor routes later. Keeping the clock (`now`) a
//! parameter makes every transition reproducible in tests.
//!
//! Lifecycle of a request: `queued` (in the [`WaitingQueue`]) → `running` (in
//! a slot of the [`SlotTable`]) → ended, with exactly one terminal event:
//! - the engine reports a finish or an error: the slot is freed at once (the
//!   engine already dropped it);
//! - the scheduler ends it (cancel, stop string, requester gone, a protocol
//!   violation): the terminal event goes out at once, later tokens for the
//!   slot are discarded, and the slot is released in the next plan.

use std::time::{Duration, Instant};

use crate::engine::{
    EngineInfo, SeqFinish, SeqOutcome, SeqProgress, SeqWork, SlotId, StepOutcome, StepPlan,
};

use super::metrics::{Metrics, SchedulerStats};
use super::plan::{plan_step, PlanLimits};
use super::queue::{QueuedSeq, WaitingQueue};
use super::slots::{RunningSeq, SlotTable};
use super::validate::ValidSeq;
use super::{
    CancelReason, FinishReason, RequestId, SchedulerConfig, SchedulerError, SeqEvent, Timings,
    Usage,
};
use crate::kv::BlockPool;

/// The plan the engine is working on.
#[derive(Debug)]
struct InFlight {
    step: u64,
    work: Vec<SeqWork>,
    submitted_at: Instant,
}

/// Sizes of a built plan, for the step's tracing span.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct PlanSummary {
    pub step: u64,
    pub seqs: usize,
    pub tokens: usize,
    pub prefills: usize,
    pub decodes: usize,
    pub admitted: usize,
    pub released: usize,
}

#[derive(Debug, Default)]
struct Counters {
    steps: u64,
    work_steps: u64,
    seqs_in_steps: u64,
    max_seqs_per_step: usize,
    prompt_tokens: u64,
    tokens_generated: u64,
    drafted: u64,
    accepted_drafts: u64,
    speculative_steps: u64,
    uniform_calls: u64,
    serial_calls: u64,
    submitted: u64,
    rejected: u64,
    finished: u64,
    cancelled: u64,
    failed: u64,
    preemptions: u64,
}

/// All scheduling state of one scheduler.
#[derive(Debug)]
pub(crate) struct SchedulerState {
    info: EngineInfo,
    limits: PlanLimits,
    queue: WaitingQueue,
    slots: SlotTable,
    /// Set once new requests are refused, with the error `Submit` returns.
    closed: Option<SchedulerError>,
    next_id: u64,
    next_step: u64,
    in_flight: Option<InFlight>,
    counters: Counters,
    metrics: Metrics,
}

impl SchedulerState {
    /// `config` must already be validated against `info`.
    pub fn new(config: &SchedulerConfig, info: EngineInfo) -> Self {
        Self {
            limits: PlanLimits {
                step_token_budget: config.step_token_budget,
                max_prefill_chunk: config.max_prefill_chunk,
                speculation: info.speculation,
            },
            queue: WaitingQueue::new(config.max_queue),
            slots: SlotTable::with_pool(
                config.max_seqs,
                BlockPool::new(
                    info.kv_capacity_tokens / info.kv_block_size,
                    info.kv_block_size,
                    config.prefix_caching,
                    model_identity(&info.model_name),
                ),
            ),
            info,
            closed: None,
            next_id: 0,
            next_step: 0,
            in_flight: None,
            counters: Counters::default(),
            metrics: Metrics::new(config.max_seqs),
        }
    }

    /// Queues a checked request (see `validate`). Nothing is reserved on
    /// failure (overloaded or closed).
    pub fn submit(&mut self, seq: ValidSeq, now: Instant) -> Result<RequestId, SchedulerError> {
        let result = self.try_submit(seq, now);
        match &result {
            Ok(_) => self.counters.submitted += 1,
            Err(_) => self.counters.rejected += 1,
        }
        result
    }

    /// Counts a request refused before it reached [`submit`](Self::submit)
    /// (it failed validation at the edge).
    pub fn count_rejected(&mut self) {
        self.counters.rejected += 1;
    }

    fn try_submit(&mut self, seq: ValidSeq, now: Instant) -> Result<RequestId, SchedulerError> {
        if let Some(error) = &self.closed {
            return Err(error.clone());
        }
        let id = RequestId(self.next_id);
        let queued = self.queued_seq(seq, None, now);
        self.queue.push_with_room(queued, self.slots.free_count())?;
        self.next_id += 1;
        Ok(id)
    }

    /// Queues the choices of one request together, all or none: the first
    /// like any request, each other one marked to share the first's prompt
    /// blocks (the planner holds them until those are computed). The caller
    /// keeps the group within the slot count.
    pub fn submit_group(
        &mut self,
        seqs: Vec<ValidSeq>,
        now: Instant,
    ) -> Result<Vec<RequestId>, SchedulerError> {
        let n = seqs.len() as u64;
        let result = self.try_submit_group(seqs, now);
        match &result {
            Ok(_) => self.counters.submitted += n,
            Err(_) => self.counters.rejected += n,
        }
        result
    }

    fn try_submit_group(
        &mut self,
        seqs: Vec<ValidSeq>,
        now: Instant,
    ) -> Result<Vec<RequestId>, SchedulerError> {
        if let Some(error) = &self.closed {
            return Err(error.clone());
        }
        let free = self.slots.free_count();
        if self.queue.len() + seqs.len() > self.queue.limit() + free {
            return Err(SchedulerError::Overloaded {
                queued: self.queue.len(),
                limit: self.queue.limit(),
            });
        }
        let leader = RequestId(self.next_id);
        let mut ids = Vec::with_capacity(seqs.len());
        for (i, seq) in seqs.into_iter().enumerate() {
            let shares = (i > 0).then_some(leader);
            let queued = self.queued_seq(seq, shares, now);
            self.queue.push_with_room(queued, free)?;
            ids.push(RequestId(self.next_id));
            self.next_id += 1;
        }
        Ok(ids)
    }

    /// The queue entry for `seq` under the next id.
    fn queued_seq(
        &self,
        seq: ValidSeq,
        shares_prompt_with: Option<RequestId>,
        now: Instant,
    ) -> QueuedSeq {
        let id = RequestId(self.next_id);
        let span = tracing::debug_span!(
            "request",
            %id,
            prompt_len = seq.prompt.len(),
            max_new_tokens = seq.max_new_tokens
        );
        QueuedSeq {
            id,
            seq,
            submitted_at: now,
            span,
            shares_prompt_with,
        }
    }

    /// Slots in the table: the most choices one request may ask for.
    pub fn max_seqs(&self) -> usize {
        self.slots.capacity()
    }

    /// Whether the waiting queue is at its limit (counting the free slots
    /// its front will take at the next step as room).
    pub fn queue_full(&self) -> bool {
        self.queue.len() >= self.queue.limit() + self.slots.free_count()
    }

    /// Drops queued requests whose requester is gone (`live(id)` false), so
    /// they stop holding queue space. Emits their terminal events.
    pub fn drop_dead_queued(
        &mut self,
        mut live: impl FnMut(RequestId) -> bool,
        now: Instant,
        out: &mut Vec<SeqEvent>,
    ) {
        for q in self.queue.drain_where(|q| !live(q.id)) {
            self.counters.cancelled += 1;
            out.push(queued_finished(&q, FinishReason::Cancelled, now));
        }
    }

    /// Refuses new requests from now on with `error` (the first reason
    /// given sticks); queued ones still run.
    pub fn stop_accepting(&mut self, error: SchedulerError) {
        self.closed.get_or_insert(error);
    }

    pub fn plan_in_flight(&self) -> bool {
        self.in_flight.is_some()
    }

    /// Nothing queued and no slot occupied (running or releasing).
    pub fn is_drained(&self) -> bool {
        self.queue.is_empty() && self.slots.occupied() == 0
    }

    /// Ids of the running sequences (for the requester-gone sweep).
    pub fn running_ids(&self) -> Vec<RequestId> {
        self.slots.iter_by_age().map(|s| s.id).collect()
    }

    /// Ends a queued or running request from the scheduler side. Returns
    /// whether it was still active.
    pub fn cancel(
        &mut self,
        id: RequestId,
        reason: CancelReason,
        now: Instant,
        out: &mut Vec<SeqEvent>,
    ) -> bool {
        let finish = match reason {
            CancelReason::Client => FinishReason::Cancelled,
            CancelReason::StopString => FinishReason::Stop,
        };
        let counter = match finish {
            FinishReason::Stop => &mut self.counters.finished,
            _ => &mut self.counters.cancelled,
        };
        if let Some(q) = self.queue.remove(id) {
            *counter += 1;
            q.span
                .in_scope(|| tracing::debug!(?reason, "cancelled while queued"));
            out.push(queued_finished(&q, finish, now));
            return true;
        }
        let Some(seq) = self
            .slots
            .find(id)
            .and_then(|s| self.slots.start_release(s))
        else {
            return false;
        };
        *counter += 1;
        seq.span
            .in_scope(|| tracing::debug!(?reason, slot = seq.slot, "cancelled while running"));
        out.push(finished(&seq, finish));
        true
    }

    /// Cancels every queued and running request (shutdown by abort).
    pub fn cancel_all(&mut self, now: Instant, out: &mut Vec<SeqEvent>) {
        let queued = self.queue.drain_where(|_| true);
        for q in queued {
            self.counters.cancelled += 1;
            out.push(queued_finished(&q, FinishReason::Cancelled, now));
        }
        for id in self.running_ids() {
            self.cancel(id, CancelReason::Client, now, out);
        }
    }

    /// The engine is gone: every request fails, every slot is forgotten.
    pub fn fail_all(&mut self, error: SchedulerError, out: &mut Vec<SeqEvent>) {
        self.stop_accepting(error.clone());
        self.in_flight = None;
        for q in self.queue.drain_where(|_| true) {
            self.counters.failed += 1;
            out.push(SeqEvent::Failed {
                id: q.id,
                error: error.clone(),
            });
        }
        for seq in self.slots.iter_by_age() {
            self.counters.failed += 1;
            out.push(SeqEvent::Failed {
                id: seq.id,
                error: error.clone(),
            });
        }
        self.slots.reset();
    }

    /// Builds the next plan, or `None` when a plan is already in flight or
    /// there is nothing to ask of the engine. `wanted(id)` filters queued
    /// requests at admission (false: requester gone).
    pub fn plan(
        &mut self,
        now: Instant,
        wanted: impl FnMut(RequestId) -> bool,
        out: &mut Vec<SeqEvent>,
    ) -> Option<(StepPlan, PlanSummary)> {
        if self.in_flight.is_some() {
            return None;
        }
        let step = self.next_step;
        let planned = plan_step(
            step,
            &mut self.queue,
            &mut self.slots,
            self.limits,
            now,
            wanted,
        );
        self.counters.preemptions += planned.preempted.len() as u64;
        for q in &planned.abandoned {
            self.counters.cancelled += 1;
            out.push(queued_finished(q, FinishReason::Cancelled, now));
        }
        for a in &planned.admitted {
            if let Some(seq) = self.slots.get(a.slot) {
                seq.span.in_scope(
                    || tracing::debug!(slot = a.slot, queue_wait = ?a.queue_wait, "admitted"),
                );
            }
            out.push(SeqEvent::Started {
                id: a.id,
                queue_wait: a.queue_wait,
            });
        }
        if planned.is_empty() {
            return None;
        }
        let summary = PlanSummary {
            step,
            seqs: planned.plan.work.len(),
            tokens: planned.tokens(),
            prefills: planned.prefills,
            decodes: planned.decodes,
            admitted: planned.plan.admit.len(),
            released: planned.plan.release.len(),
        };
        self.record_plan(&summary);
        self.next_step += 1;
        self.in_flight = Some(InFlight {
            step,
            work: planned.plan.work.clone(),
            submitted_at: now,
        });
        Some((planned.plan, summary))
    }

    fn record_plan(&mut self, s: &PlanSummary) {
        self.counters.steps += 1;
        if s.seqs > 0 {
            self.counters.work_steps += 1;
            self.counters.seqs_in_steps += s.seqs as u64;
            self.counters.max_seqs_per_step = self.counters.max_seqs_per_step.max(s.seqs);
            self.metrics.batch_size.record(s.seqs as f64);
        }
    }

    /// The submitted plan never reached the engine: forget it so the failure
    /// path can proceed (the caller then fails everything).
    pub fn abandon_in_flight(&mut self) {
        self.in_flight = None;
    }

    /// Applies the in-flight plan's outcome: counters, tokens, finishes and
    /// errors. Returns the engine time of the step (for busy-time metrics).
    pub fn apply_outcome(
        &mut self,
        outcome: StepOutcome,
        now: Instant,
        out: &mut Vec<SeqEvent>,
    ) -> Option<Duration> {
        let Some(flight) = self.in_flight.take() else {
            tracing::warn!(
                step = outcome.step,
                "engine outcome with no plan in flight; ignored"
            );
            return None;
        };
        if outcome.step != flight.step {
            // One plan is in flight, so this outcome is for it whatever it says.
            tracing::warn!(
                expected = flight.step,
                got = outcome.step,
                "outcome step mismatch"
            );
        }
        let round_trip = now.saturating_duration_since(flight.submitted_at);
        self.metrics
            .steps
            .record_outcome(&outcome.stats, round_trip);
        self.counters.uniform_calls += u64::from(outcome.stats.uniform_calls);
        self.counters.serial_calls += u64::from(outcome.stats.serial_calls);

        let mut reported = vec![false; self.slots.capacity()];
        for seq_out in outcome.seqs {
            if let Some(r) = reported.get_mut(seq_out.slot as usize) {
                *r = true;
            }
            self.apply_seq(seq_out, now, out);
        }
        for work in &flight.work {
            let slot = work.slot();
            if !reported.get(slot as usize).copied().unwrap_or(true)
                && self.slots.get(slot).is_some()
            {
                self.fail_and_release(slot, "no outcome for planned work".into(), out);
            }
        }
        Some(outcome.stats.total)
    }

    fn apply_seq(&mut self, so: SeqOutcome, now: Instant, out: &mut Vec<SeqEvent>) {
        let slot = so.slot;
        if let Ok(p) = &so.result {
            self.counters.prompt_tokens += p.prefilled as u64;
            self.counters.tokens_generated += p.tokens.len() as u64;
            self.counters.drafted += p.drafted as u64;
            self.counters.accepted_drafts += p.accepted as u64;
            self.counters.speculative_steps += u64::from(p.drafted > 0);
        }
        if self.slots.get(slot).is_none() {
            // Releasing (cancelled while this step ran): drop its tokens, but
            // if the engine ended it by itself, the release is moot.
            let engine_dropped = match &so.result {
                Ok(p) => p.finish.is_some(),
                Err(_) => true,
            };
            if self.slots.is_releasing(slot) && engine_dropped {
                self.slots.free_now(slot);
            }
            return;
        }
        match so.result {
            Err(error) => {
                if let Some(seq) = self.slots.free_now(slot) {
                    seq.span
                        .in_scope(|| tracing::debug!(%error, slot, "failed by the engine"));
                    self.counters.failed += 1;
                    out.push(SeqEvent::Failed {
                        id: seq.id,
                        error: SchedulerError::Engine(error),
                    });
                }
            }
            Ok(progress) => self.apply_progress(slot, progress, now, out),
        }
    }

    fn apply_progress(
        &mut self,
        slot: SlotId,
        p: SeqProgress,
        now: Instant,
        out: &mut Vec<SeqEvent>,
    ) {
        let context_len = self.info.context_len;
        let Some(seq) = self.slots.get_mut(slot) else {
            return;
        };
        if p.prefilled > seq.prompt_remaining() {
            let reason = format!(
                "prefilled {} tokens with only {} left",
                p.prefilled,
                seq.prompt_remaining()
            );
            return self.fail_and_release(slot, reason, out);
        }
        // A prefill chunk (or recompute) adds its positions; a decode feeds
        // its input token and keeps one position per accepted draft.
        seq.computed += match p.prefilled {
            0 => p.tokens.len(),
            n => n,
        };
        seq.drafted += p.drafted;
        seq.accepted_drafts += p.accepted;
        if !p.tokens.is_empty() {
            if seq.preempted || seq.computed < seq.fill_target() {
                let reason = "generated tokens before the prompt was fed".to_string();
                return self.fail_and_release(slot, reason, out);
            }
            let n = p.tokens.len();
            match seq.last_token_at {
                None => {
                    seq.first_token_at = Some(now);
                    let ttft = now.saturating_duration_since(seq.submitted_at);
                    self.metrics.time_to_first_token.record_duration(ttft);
                }
                Some(last) => {
                    let gap = now.saturating_duration_since(last);
                    self.metrics
                        .inter_token_latency
                        .record_duration(gap / n as u32);
                }
            }
            seq.last_token_at = Some(now);
            seq.tokens.extend(p.tokens.iter().map(|t| t.id));
            out.push(SeqEvent::Tokens {
                id: seq.id,
                first_index: seq.generated,
                tokens: p.tokens,
            });
            seq.generated += n;
        }
        if p.finish.is_none() {
            self.slots.settle_blocks(slot);
        }
        let Some(seq) = self.slots.get(slot) else {
            return;
        };
        if let Some(finish) = p.finish {
            if let Some(seq) = self.slots.free_now(slot) {
                self.counters.finished += 1;
                let reason = match finish {
                    SeqFinish::Eos => FinishReason::Eos,
                    SeqFinish::Length => FinishReason::Length,
                    SeqFinish::ContextFull => FinishReason::ContextFull,
                };
                seq.span.in_scope(|| {
                    tracing::debug!(
                        reason = reason.as_str(),
                        generated = seq.generated,
                        "finished"
                    )
                });
                out.push(finished(&seq, reason));
            }
        } else if seq.generated >= seq.max_new_tokens
            || seq.prompt_len + seq.generated > context_len
        {
            // Guard against a runaway sequence: the engine must end it.
            let reason = format!(
                "sequence not ended at {} generated tokens (max_new_tokens {}, context {})",
                seq.generated, seq.max_new_tokens, context_len
            );
            self.fail_and_release(slot, reason, out);
        }
    }

    /// Fails a running sequence for an engine protocol violation; the engine
    /// may still hold the slot, so it is released.
    fn fail_and_release(&mut self, slot: SlotId, reason: String, out: &mut Vec<SeqEvent>) {
        if let Some(seq) = self.slots.start_release(slot) {
            tracing::warn!(id = %seq.id, slot, %reason, "engine protocol violation");
            self.counters.failed += 1;
            out.push(SeqEvent::Failed {
                id: seq.id,
                error: SchedulerError::Protocol { slot, reason },
            });
        }
    }

    pub fn stats(&self) -> SchedulerStats {
        let c = &self.counters;
        let prefix = self.slots.pool().counters();
        SchedulerStats {
            queued: self.queue.len(),
            running: self.slots.running_count(),
            releasing: self.slots.occupied() - self.slots.running_count(),
            free_slots: self.slots.free_count(),
            max_seqs: self.slots.capacity(),
            kv_reserved_tokens: self.slots.kv_used(),
            kv_capacity_tokens: self.slots.kv_capacity(),
            kv_block_size: self.slots.block_size(),
            kv_blocks_total: self.slots.pool().num_blocks(),
            kv_blocks_used: self.slots.pool().used(),
            kv_blocks_cached: self.slots.pool().cached(),
            prefix_cache_queries: prefix.queries,
            prefix_cache_query_tokens: prefix.query_tokens,
            prefix_cache_hit_tokens: prefix.hit_tokens,
            prefix_cache_evictions: prefix.evictions,
            preemptions: c.preemptions,
            preempted: self.slots.iter_by_age().filter(|s| s.preempted).count(),
            steps: c.steps,
            prompt_tokens_processed: c.prompt_tokens,
            tokens_generated: c.tokens_generated,
            mtp_drafted: c.drafted,
            mtp_accepted: c.accepted_drafts,
            mtp_speculative_steps: c.speculative_steps,
            sampler_uniform_calls: c.uniform_calls,
            sampler_serial_calls: c.serial_calls,
            mean_seqs_per_step: if c.work_steps == 0 {
                0.0
            } else {
                c.seqs_in_steps as f64 / c.work_steps as f64
            },
            max_seqs_per_step: c.max_seqs_per_step,
            requests_submitted: c.submitted,
            requests_rejected: c.rejected,
            requests_finished: c.finished,
            requests_cancelled: c.cancelled,
            requests_failed: c.failed,
            metrics: self.metrics.snapshot(),
        }
    }

    /// Step-timing hooks for the actor, which owns the wall clock around
    /// submission and routing.
    pub fn metrics_mut(&mut self) -> &mut Metrics {
        &mut self.metrics
    }
}

/// Salt of the prefix-cache hashes: what identifies the model's K/V.
fn model_identity(model_name: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    model_name.hash(&mut h);
    h.finish()
}

/// The terminal event of a request that ends while holding a slot.
fn finished(seq: &RunningSeq, reason: FinishReason) -> SeqEvent {
    let decode_tokens_per_s = match (seq.first_token_at, seq.last_token_at) {
        (Some(first), Some(last)) if seq.generated >= 2 && last > first => {
            Some((seq.generated - 1) as f64 / (last - first).as_secs_f64())
        }
        _ => None,
    };
    SeqEvent::Finished {
        id: seq.id,
        reason,
        usage: Usage {
            prompt_tokens: seq.prompt_len,
            completion_tokens: seq.generated,
            cached_prompt_tokens: seq.cached_tokens,
            draft_tokens: seq.drafted,
            accepted_draft_tokens: seq.accepted_drafts,
        },
        timings: Timings {
            queue_wait: seq.admitted_at.saturating_duration_since(seq.submitted_at),
            time_to_first_token: seq
                .first_token_at
                .map(|t| t.saturating_duration_since(seq.submitted_at)),
            decode_tokens_per_s,
        },
    }
}

/// The terminal event of a request that ends before taking a slot.
fn queued_finished(q: &QueuedSeq, reason: FinishReason, now: Instant) -> SeqEvent {
    SeqEvent::Finished {
        id: q.id,
        reason,
        usage: Usage {
            prompt_tokens: q.seq.prompt.len(),
            completion_tokens: 0,
            ..Usage::default()
        },
        timings: Timings {
            queue_wait: now.saturating_duration_since(q.submitted_at),
            time_to_first_token: None,
            decode_tokens_per_s: None,
        },
    }
}

#[cfg(test)]
#[path = "state_tests.rs"]
mod tests;
