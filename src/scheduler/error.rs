//! The scheduler layer's one error enum.
//!
//! Validation errors are returned by `Submit` before a request takes a slot;
//! engine errors reach a requester inside [`SeqEvent::Failed`]. Every variant
//! has a fixed [`SchedulerError::error_type`] string, meant to be reused as a
//! metrics label and in JSON error bodies by the layers above.
//!
//! [`SeqEvent::Failed`]: super::SeqEvent::Failed

use crate::engine::{EngineError, SlotId};
use crate::sampler::SamplerError;

/// Why the scheduler refused or failed a request, or could not start.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SchedulerError {
    /// A [`super::SchedulerConfig`] field is out of range.
    #[error("invalid scheduler config `{field}`: {reason}")]
    InvalidConfig { field: &'static str, reason: String },
    /// The engine reported limits the scheduler cannot work with.
    #[error("unusable engine info `{field}`: {reason}")]
    InvalidEngineInfo { field: &'static str, reason: String },
    /// The prompt has no tokens.
    #[error("`prompt` is empty: at least one token is required")]
    EmptyPrompt,
    /// The prompt leaves no room for a generated token.
    #[error(
        "`prompt` has {len} tokens but must be shorter than the context length of {context_len}"
    )]
    PromptTooLong { len: usize, context_len: usize },
    /// `max_new_tokens` is zero.
    #[error("`max_new_tokens` must be at least 1, got 0")]
    ZeroMaxNewTokens,
    /// A prompt token id is not in the model's vocabulary.
    #[error("`prompt[{index}]` is token id {token}, outside the vocabulary of {vocab_size} ids")]
    TokenOutOfVocab {
        index: usize,
        token: u32,
        vocab_size: usize,
    },
    /// A speculative-decoding option is out of range.
    #[error("invalid `mtp` options: {0}")]
    InvalidSpec(String),
    /// A constraint (grammar, `logit_bias`, stop ids) is invalid; `field`
    /// is the request field it came from.
    #[error("invalid `{field}`: {reason}")]
    InvalidConstraint { field: &'static str, reason: String },
    /// A sampling option is out of range.
    #[error("invalid `sampling`: {0}")]
    Sampling(#[from] SamplerError),
    /// The request's KV reservation is larger than the whole KV pool, so it
    /// could never be admitted.
    #[error(
        "request needs {needed} KV tokens (prompt + max_new_tokens, capped at the context \
         length) but the KV pool holds {capacity}"
    )]
    ExceedsKvCapacity { needed: usize, capacity: usize },
    /// The waiting queue is full; retry later (HTTP 429 / 503).
    #[error("overloaded: {queued} requests are already waiting (`max_queue` is {limit})")]
    Overloaded { queued: usize, limit: usize },
    /// The scheduler no longer admits requests.
    #[error("the scheduler is shutting down")]
    ShuttingDown,
    /// The engine failed this sequence.
    #[error("engine: {0}")]
    Engine(#[from] EngineError),
    /// The engine thread stopped (or could not be reached) mid-request.
    #[error("the engine thread has stopped")]
    EngineGone,
    /// The engine thread could not be started.
    #[error("could not start the engine thread: {0}")]
    EngineSpawn(String),
    /// The engine's outcome contradicts the plan (a bug in the engine).
    #[error("engine protocol violation for slot {slot}: {reason}")]
    Protocol { slot: SlotId, reason: String },
}

impl SchedulerError {
    /// A fixed, lowercase identifier of the variant, for metrics labels and
    /// the `type` field of error bodies.
    pub fn error_type(&self) -> &'static str {
        match self {
            SchedulerError::InvalidConfig { .. } => "invalid_config",
            SchedulerError::InvalidEngineInfo { .. } => "invalid_engine_info",
            SchedulerError::EmptyPrompt => "empty_prompt",
            SchedulerError::PromptTooLong { .. } => "prompt_too_long",
            SchedulerError::ZeroMaxNewTokens => "invalid_max_new_tokens",
            SchedulerError::TokenOutOfVocab { .. } => "token_out_of_vocab",
            SchedulerError::Sampling(_) => "invalid_sampling",
            SchedulerError::InvalidSpec(_) => "invalid_mtp",
            SchedulerError::InvalidConstraint { .. } => "invalid_constraint",
            SchedulerError::ExceedsKvCapacity { .. } => "exceeds_kv_capacity",
            SchedulerError::Overloaded { .. } => "overloaded",
            SchedulerError::ShuttingDown => "shutting_down",
            SchedulerError::Engine(_) => "engine",
            SchedulerError::EngineGone => "engine_gone",
            SchedulerError::EngineSpawn(_) => "engine_spawn",
            SchedulerError::Protocol { .. } => "engine_protocol",
        }
    }

    /// Whether the request itself was at fault (the caller should not retry
    /// it unchanged), as opposed to load or a server-side failure.
    pub fn is_invalid_request(&self) -> bool {
        matches!(
            self,
            SchedulerError::EmptyPrompt
                | SchedulerError::PromptTooLong { .. }
                | SchedulerError::ZeroMaxNewTokens
                | SchedulerError::TokenOutOfVocab { .. }
                | SchedulerError::Sampling(_)
                | SchedulerError::InvalidSpec(_)
                | SchedulerError::InvalidConstraint { .. }
                | SchedulerError::ExceedsKvCapacity { .. }
        )
    }
}
