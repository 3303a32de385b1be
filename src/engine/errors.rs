//! [`EngineError`] and the conversions from the stores' own errors.

use crate::kv::KvError;
use crate::model::ModelError;
use crate::slot::SlotId;

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
    /// The sequence's grammar could not go on (fails that sequence only).
    #[error("slot {slot}: {reason}")]
    Grammar { slot: SlotId, reason: String },
}

pub(crate) fn model_err(e: ModelError) -> EngineError {
    EngineError::Model(e.to_string())
}

pub(crate) fn tensor_err(e: candle_core::Error) -> EngineError {
    EngineError::Model(e.to_string())
}

pub(crate) fn kv_err(slot: SlotId, e: KvError) -> EngineError {
    match e {
        KvError::Exhausted {
            requested,
            available,
            ..
        } => EngineError::KvExhausted {
            requested,
            available,
        },
        KvError::OverReservation {
            reserved, needed, ..
        } => EngineError::KvOverReservation {
            slot,
            reserved,
            needed,
        },
        other => EngineError::Model(other.to_string()),
    }
}
