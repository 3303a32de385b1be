//! Batched multi-slot sampler (being written).

mod options;
pub use options::{SamplingOptions, MAX_TOP_LOGPROBS};

/// Sampler errors.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SamplerError {
    #[error("invalid sampling option `{field}`: {reason}")]
    InvalidOption { field: &'static str, reason: String },
}
