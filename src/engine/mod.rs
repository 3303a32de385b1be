//! The engine: everything that touches tensors, driven one step at a time.
//!
//! # Layout
//! - [`protocol`]: the plain-data `StepPlan` / `StepOutcome` boundary.
//! - [`thread`]: the OS thread that owns an executor and runs plans.

pub mod executor;
pub mod protocol;
pub mod spec;
pub mod thread;

pub use executor::{Engine, EngineConfig};
pub use protocol::*;
pub use spec::{DraftHead, DraftInput, EarlyExitDraft, HiddenContext, MtpDraft, SpecConfig};
pub use thread::{EngineCommand, EngineThread};

/// Why the engine could not serve a sequence. Cloneable so that one failed
/// forward pass can report the same error to every affected requester.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EngineError {
    #[error("KV cache exhausted: {requested} tokens requested, {available} available")]
    KvExhausted { requested: usize, available: usize },
    #[error("slot {slot} would exceed its KV reservation of {reserved} tokens (needs {needed})")]
    KvOverReservation {
        slot: SlotId,
        reserved: usize,
        needed: usize,
    },
    #[error("slot {0} is not registered with the engine")]
    UnknownSlot(SlotId),
    #[error("slot {0} is already registered with the engine")]
    DuplicateSlot(SlotId),
    #[error("invalid work for slot {slot}: {reason}")]
    InvalidWork { slot: SlotId, reason: String },
    #[error("sampler: {0}")]
    Sampler(#[from] crate::sampler::SamplerError),
    #[error("model: {0}")]
    Model(String),
}
