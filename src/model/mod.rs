//! Llama-family decoder on candle, run over ragged batches of sequences.
//!
//! # Layout
//! - [`config`]: `config.json` → [`ModelConfig`].
//! - [`weights`]: safetensors (single or sharded) or in-memory tensors.
//! - [`batch`]: the ragged [`Batch`] a forward pass consumes.
//! - [`llama`]: the [`Model`]: `forward` (→ hidden), `unembed`
//!   (hidden → logits), `token_embeddings` (ids → embeddings); it owns the
//!   config and the weights and picks the step's implementation at load.
//! - `llama_weights`: the fused weights (`ModelWeights`, `LayerWeights`),
//!   each loaded from its checkpoint names.
//! - `candle_step`: the candle-op implementation of the step (GPUs, and
//!   the CPU reference), with its attention plan chosen once per pass.
//! - [`linear`]: projection weights in their [`WeightFormat`] (compute
//!   dtype, or Q8_0 / Q4_K quantised at load).
//! - `lean`: the CPU implementation of the step over reused f32 buffers
//!   (the weights passed in),
//!   with the kernels of `kernels` (decode-fast linear, attention in place
//!   over the KV cache, RMSNorm/RoPE/SiLU), runtime-dispatched to AVX-512,
//!   AVX2 or portable code.
//! - `decode_graphs`: CUDA graphs of decode passes, captured per shape and
//!   replayed with the step's ids and attention metadata.
//! - `batched_attention` and `pooled_attention`: attention for a whole
//!   batch over pooled KV (the GPU default): padded candle ops on any
//!   device, Tandem's own kernels (`cuda/*.cu`, built by `build.rs`) on
//!   CUDA.
//!
//! All tensor code lives under `model/`, `kv/` and `sampler/`, so another
//! backend only has to replace these modules.

pub mod batch;
mod batched_attention;
mod candle_step;
pub mod config;
#[cfg(feature = "cuda")]
mod cuda_view;
mod decode_graphs;
mod fused;
mod gemv;
pub(crate) mod kernels;
mod lean;
#[cfg(test)]
mod lean_tests;
pub mod linear;
pub mod llama;
mod llama_weights;
pub mod mtp;
mod pooled_attention;
pub mod weights;

use std::path::PathBuf;

pub use batch::{Batch, OutputRows, SeqSpan};
pub use config::{Architecture, ModelConfig, RopeScaling};
pub use decode_graphs::GraphStats;
pub use kernels::few_rows::settled as few_row_paths;
pub use kernels::pool::fit_cpu_threads_to_affinity;
pub use kernels::qformat::ActivationQuant;
pub use kernels::Isa;
pub use lean::PHASES;
pub use linear::WeightFormat;
pub use llama::{LoadOptions, Model, ProjectionBytes};
pub use mtp::{DraftLogits, MtpHead};
pub use weights::Weights;

/// Errors loading or running a model. Messages name the file and tensor.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: invalid config: {reason}")]
    Config { path: PathBuf, reason: String },
    #[error("unsupported architecture `{0}` (supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM)")]
    UnsupportedArchitecture(String),
    #[error("{path}: missing tensor `{name}`")]
    MissingTensor { path: PathBuf, name: String },
    #[error("{path}: tensor `{name}` has shape {found:?}, expected {expected:?}")]
    ShapeMismatch {
        path: PathBuf,
        name: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("{path}: {reason}")]
    Weights { path: PathBuf, reason: String },
    /// A draft head's `mtp.draft_vocab` is not a sorted set of token ids of
    /// the target's vocabulary (see [`mtp`]).
    #[error("{path}: invalid `mtp.draft_vocab`: {reason}")]
    DraftVocab { path: PathBuf, reason: String },
    #[error("unsupported dtype: {0}")]
    UnsupportedDType(String),
    #[error("invalid batch: {0}")]
    InvalidBatch(String),
    #[error(transparent)]
    Kv(#[from] crate::kv::KvError),
    #[error("tensor error: {0}")]
    Tensor(#[from] candle_core::Error),
}
