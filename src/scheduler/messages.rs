//! Messages into the scheduler actor and the token-level events it sends out.
//!
//! Each inbound message is a small struct with an explicit result type. Events
//! go to the `Recipient<SeqEvent>` given at [`Submit`]; for one request they
//! arrive in this order: `Started` (once, when the request takes a slot; never
//! for a request cancelled while still queued), any number of `Tokens`, then
//! exactly one terminal `Finished` or `Failed`.
//!
//! Events are sent after the `Submit` reply is produced, but they travel on a
//! different channel (the recipient's mailbox), so a recipient shared by many
//! requests may see a request's events before its sender has read the id.

use std::sync::Arc;
use std::time::Duration;

use actix::{Message, Recipient};

use crate::engine::{GeneratedToken, StepOutcome};
use crate::sampler::SamplingOptions;

use super::{RequestId, SchedulerError, SchedulerStats};

/// A token-level generation request.
#[derive(Debug, Clone)]
pub struct SeqRequest {
    /// The whole prompt, already tokenized (BOS included when the model wants
    /// one). Must be non-empty, shorter than the context length, and every id
    /// must be inside the vocabulary.
    pub prompt: Arc<[u32]>,
    /// Sampling options; validated at `Submit`.
    pub sampling: SamplingOptions,
    /// The most tokens to generate (at least 1). Generation also ends at an
    /// end-of-sequence token or when the context is full.
    pub max_new_tokens: usize,
    /// Speculative decoding options; `None` uses the engine's default.
    pub spec: Option<crate::engine::SpecOptions>,
    /// Where this request's [`SeqEvent`]s go. When it disconnects (its actor
    /// stopped) the request is cancelled at the next step boundary.
    pub events: Recipient<SeqEvent>,
}

/// Submit a request. Replies with its id once it is queued, or with a typed
/// error (invalid request, [`SchedulerError::Overloaded`],
/// [`SchedulerError::ShuttingDown`]) before it takes a slot or queue space.
#[derive(Debug, Message)]
#[rtype(result = "Result<RequestId, SchedulerError>")]
pub struct Submit(pub SeqRequest);

/// Why a requester ends its own request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CancelReason {
    /// The client gave up; the request finishes with [`FinishReason::Cancelled`].
    Client,
    /// The text layer matched a stop string; the request finishes with
    /// [`FinishReason::Stop`].
    StopString,
}

/// Cancel a request. A queued request is removed; a running one stops
/// receiving events at once and its slot is released in the next plan. The
/// requester gets `Finished` with `Cancelled` (or `Stop`). Idempotent: replies
/// `true` only when this call ended the request.
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "bool")]
pub struct Cancel {
    /// The request to end.
    pub id: RequestId,
    /// How it should be reported.
    pub reason: CancelReason,
}

/// Ask for a snapshot of counters, gauges and histograms.
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "SchedulerStats")]
pub struct Stats;

/// How [`Shutdown`] treats outstanding work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShutdownMode {
    /// Finish every queued and running request first.
    Drain,
    /// Cancel every queued and running request (each gets `Finished` with
    /// `Cancelled`).
    Abort,
}

/// Stop the scheduler: refuse new requests, drain or abort the outstanding
/// ones, join the engine thread, stop the actor. The reply comes once all of
/// that is done. A later `Abort` upgrades a `Drain` in progress.
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "Result<(), SchedulerError>")]
pub struct Shutdown {
    /// Drain or abort.
    pub mode: ShutdownMode,
}

/// Internal: the engine thread finished a step. Sent by the engine thread's
/// outcome callback; public only because actix needs the type to be nameable.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct StepDone(pub StepOutcome);

/// Internal: the engine thread has exited (normally or by a panic).
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub(crate) struct EngineExited;

/// Internal: run a step now if none is in flight. Sent through the mailbox so
/// that a burst of `Submit`s already queued is admitted in one plan.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub(crate) struct Kick;

/// Why a request ended normally (or by cancellation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FinishReason {
    /// An end-of-sequence token was generated; it is the last token sent.
    Eos,
    /// `max_new_tokens` tokens were generated.
    Length,
    /// The sequence filled the model's context.
    ContextFull,
    /// Cancelled by the client, by shutdown, or because its recipient is gone.
    Cancelled,
    /// Ended by a stop string ([`CancelReason::StopString`]).
    Stop,
}

impl FinishReason {
    /// A fixed lowercase label (metrics, logs).
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Eos => "eos",
            FinishReason::Length => "length",
            FinishReason::ContextFull => "context_full",
            FinishReason::Cancelled => "cancelled",
            FinishReason::Stop => "stop",
        }
    }
}

/// Token counts of one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    /// Prompt length in tokens.
    pub prompt_tokens: usize,
    /// Tokens delivered in `Tokens` events.
    pub completion_tokens: usize,
    /// Prompt tokens found in the prefix cache (not computed again).
    pub cached_prompt_tokens: usize,
    /// Draft tokens proposed for this request (speculative decoding).
    pub draft_tokens: usize,
    /// Draft tokens the target accepted.
    pub accepted_draft_tokens: usize,
}

/// Latencies of one request.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Timings {
    /// From `Submit` to taking a slot (to the cancellation, if it never did).
    pub queue_wait: Duration,
    /// From `Submit` to the first token; `None` when none was generated.
    pub time_to_first_token: Option<Duration>,
    /// Tokens after the first divided by the time since the first;
    /// `None` with fewer than two tokens.
    pub decode_tokens_per_s: Option<f64>,
}

/// Token-level events sent to a request's recipient.
#[derive(Debug, Clone, Message)]
#[rtype(result = "()")]
pub enum SeqEvent {
    /// The request took a slot.
    Started {
        id: RequestId,
        /// Time spent in the waiting queue.
        queue_wait: Duration,
    },
    /// Newly generated tokens. `first_index` is the index of `tokens[0]` in
    /// the completion: the first event has 0, each next one starts where the
    /// previous ended.
    Tokens {
        id: RequestId,
        first_index: usize,
        tokens: Vec<GeneratedToken>,
    },
    /// Terminal: the request ended.
    Finished {
        id: RequestId,
        reason: FinishReason,
        usage: Usage,
        timings: Timings,
    },
    /// Terminal: the request failed (engine error or engine gone).
    Failed {
        id: RequestId,
        error: SchedulerError,
    },
}

impl SeqEvent {
    /// The request this event belongs to.
    pub fn id(&self) -> RequestId {
        match self {
            SeqEvent::Started { id, .. }
            | SeqEvent::Tokens { id, .. }
            | SeqEvent::Finished { id, .. }
            | SeqEvent::Failed { id, .. } => *id,
        }
    }

    /// Whether this is the request's last event.
    pub fn is_terminal(&self) -> bool {
        matches!(self, SeqEvent::Finished { .. } | SeqEvent::Failed { .. })
    }
}
