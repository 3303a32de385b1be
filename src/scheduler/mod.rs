//! The scheduler actor: the token-level heart of Tandem.
//!
//! Requesters submit token-level sequences ([`SeqRequest`]); every step the
//! scheduler batches all running sequences into one [`StepPlan`] for the
//! engine thread and routes the resulting tokens back to each requester's
//! `Recipient<SeqEvent>`. The text layer (detokenizer, stop strings, request
//! actors, the public handle) is built on top of this API.
//!
//! # Ownership
//! - The [`Scheduler`] actor owns all scheduling state: the bounded waiting
//!   queue, the slot table with the KV block pool, the routing table
//!   `RequestId → Recipient`, and the one plan in flight. Nobody else mutates
//!   it; callers talk through messages.
//! - The engine thread owns every tensor. The two sides exchange plain data
//!   only ([`StepPlan`] / [`StepOutcome`]).
//!
//! # Invariants
//! - At most one plan is in flight. When its outcome arrives, counters are
//!   updated, the next plan is built and submitted, and only then are the
//!   events routed, so the engine computes while the actor routes.
//! - A slot id is handed to a new sequence only after the engine has been
//!   told to release it (in an earlier plan) or has reported it finished or
//!   failed. A slot is therefore never released and admitted in one plan.
//! - Every accepted request receives exactly one terminal event
//!   ([`SeqEvent::Finished`] or [`SeqEvent::Failed`]), and it is its last.
//!   `Tokens` indices start at 0 and increase by one per token, no gaps.
//! - KV: the scheduler's block pool owns the accounting; a sequence holds
//!   the blocks of its table (shared prefix blocks counted once per
//!   holder), takes more as it grows and is preempted when none are left;
//!   a request whose longest length could never fit the pool is rejected at
//!   `Submit`.
//!
//! # Layout
//! - [`config`]: [`SchedulerConfig`] and its validation against the engine.
//! - [`error`]: [`SchedulerError`], the one error enum of this layer.
//! - [`messages`]: messages in ([`Submit`], [`Cancel`], [`Stats`],
//!   [`Shutdown`]) and events out ([`SeqEvent`]).
//! - `validate`: the edge's checks; the only constructor of `ValidSeq`, the
//!   checked request the queue, the slots and the engine's `Admission` carry.
//! - `queue`: the bounded FIFO of requests waiting for a slot.
//! - `slots`: the slot table: running sequences, free list, the KV block pool.
//! - `plan`: the pure step planner (admission, block growth and preemption,
//!   resumption, decodes, prefill chunks).
//! - `state`: the pure scheduling core (submit, cancel, plan, apply outcome).
//! - [`metrics`]: histograms, step timings and the [`SchedulerStats`] snapshot.
//! - `actor`: the actix shell: engine thread glue, routing, shutdown.
//!
//! [`StepPlan`]: crate::engine::StepPlan
//! [`StepOutcome`]: crate::engine::StepOutcome

mod actor;
pub mod config;
pub mod error;
pub mod messages;
pub mod metrics;
mod plan;
mod queue;
mod slots;
mod state;
pub(crate) mod validate;

use std::fmt;

pub use actor::Scheduler;
pub use config::SchedulerConfig;
pub use error::SchedulerError;
pub use messages::{
    Cancel, CancelReason, FinishReason, SeqEvent, SeqRequest, Shutdown, ShutdownMode, Stats,
    StepDone, Submit, Timings, Usage,
};
pub use metrics::{HistogramSnapshot, MetricsSnapshot, SchedulerStats, StepTimingSnapshot};

/// Identifies one submitted sequence for its whole life. Ids are assigned by
/// the scheduler in submission order and never reused by one scheduler.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "seq-{}", self.0)
    }
}
