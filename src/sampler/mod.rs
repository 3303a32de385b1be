//! Batched multi-slot sampler: one call draws one token for every sequence
//! in the step.
//!
//! Sequences register with [`Sampler::add`] (options + prompt tokens that
//! seed the penalty history) and leave with [`Sampler::remove`]. Each
//! [`Sampler::sample`] takes any subset of registered slots in any order
//! with their `[B, V]` logits, draws one token per row and appends it to
//! that slot's history. The engine thread owns the sampler; nothing in it
//! is shared.
//!
//! # Where the work happens
//! - **Logits on a CUDA GPU**: the whole call is one kernel launch
//!   (`device.rs`, `cuda/sampling.cu`, one block per row, no sort) over
//!   every row whatever its options, grammar masks and logit biases
//!   included (their bitsets and pairs ride in the parameter upload); the
//!   penalty rings have a copy on the
//!   device, and only the output rows (token, status, requested logprobs)
//!   cross to the host. The host still draws each row's uniform from the
//!   slot's RNG, so seeds mean the same thing on both sides, and the kernel
//!   picks what the host chain picks from the same logits (ties and
//!   rounding at a boundary aside, where parallel sums may differ in the
//!   last bit).
//! - **Anywhere else** the logits are read to the host as f32 once per call
//!   (in place when they already are a contiguous CPU f32 tensor) and every
//!   transform runs in plain Rust over that buffer: no full sort of V ever
//!   — top-k and top-p use partial selection and sort only their
//!   candidates. On another GPU backend (Metal) without logprob requests,
//!   the plain greedy rows take their argmax on the device and only the
//!   other rows' logits are copied to the host.
//!
//! # Transform chain (per row, Ollama semantics)
//! logit bias (the slot's `logit_bias`, [`LogitBias`]) and grammar mask
//! (this call's [`TokenMask`] for the row, disallowed tokens to `-inf`;
//! `adjust.rs`) → penalties (repeat and presence once per distinct token of the window,
//! frequency once per occurrence) → top-p with top-k folded into the same
//! pass, or top-k alone (exactly K survive; ties go to lower ids) → min-p
//! against the row maximum → greedy argmax (first maximum), or temperature
//! and a categorical draw: one uniform from the slot's RNG, inverse CDF over
//! the kept tokens in id order. Top-p and min-p judge the penalised scores
//! at temperature 1.
//!
//! # The two paths
//! - **Uniform**: every registered slot has the same transform options
//!   (seed and logprob requests aside) and, when those include penalties,
//!   the call names every registered slot in registration order and every
//!   ring is full. Then row `i` of the logits is row `i` of the history
//!   pool and all of its window is valid, so one fused pass runs over the
//!   whole batch with the shared options, rows split in contiguous chunks
//!   across `std::thread::scope` threads (up to the machine's parallelism,
//!   at least 256 Ki logits per thread so spawning pays for itself).
//! - **Serial**: anything else. Slot by slot on the calling thread, each
//!   with its own options and the filled part of its own pool row.
//!
//! Both paths run the same per-row code, and every row owns its RNG, so
//! they give the same tokens for the same inputs whatever the thread split;
//! [`SampleResult::path`] says which ran. Because the host work per row is
//! the same on both paths, the uniform path's gain is its parallelism (and
//! no per-slot dispatch): expect up to the core count, not more.
//!
//! # History pool invariants
//! One `[rows, W]` ring-buffer matrix, `W` = the largest `repeat_last_n`
//! among slots with an active penalty. While `W > 0` every registered slot
//! owns row `r` = its registration index; `remove` drops the row (later
//! rows move up), so a new slot never sees a removed slot's tokens. A slot
//! with window `N` and `len` tokens writes its next token at `len % N`;
//! priors are packed at `[0, min(priors, N))`. See `history.rs`.
//!
//! # Randomness
//! Each slot owns a ChaCha8 stream seeded from `options.seed` (or from the
//! sampler's own RNG when `None`). The token at generation index `n` (the
//! slot's `n`-th generated token) is drawn with the stream's `n`-th `f64`,
//! reached by seeking, never by consuming: randomness is keyed by (seed,
//! position). So a seeded request yields the same tokens whatever else
//! shares the batch, whichever path runs, and however its tokens were
//! reached — one per step, or several per step through speculative
//! verification, which draws the target's token at each verified position
//! with that position's uniform ([`Sampler::draw_at`]). A greedy row uses
//! no randomness. A failed call advances nothing and writes no history.
//!
//! # Vocabulary checks
//! The sampler learns V only from the logits. History tokens (priors and
//! commits) are checked against each call's V (a failing call commits nothing), so
//! a prior or committed id ≥ V surfaces as [`SamplerError::VocabMismatch`]
//! at the next call for that slot.
//!
//! # Logprobs
//! Computed for every row whenever any *registered* slot asked (compute
//! for every row, so the result's shape does not depend on which rows
//! asked), from the original logits with a stable
//! log-softmax along each row; the top lists hold the largest
//! `top_logprobs` over registered slots, sorted descending.
//! [`SampleResult::for_row`] cuts a row down to what its request asked.
//!
//! # Layout
//! - `options.rs`: [`SamplingOptions`] and their validation / normalisation.
//! - `batched.rs`: [`Sampler`], registration, dispatch: where the call
//!   runs (CUDA kernel, argmax on another GPU, host; chosen once per call)
//!   and the two host paths.
//! - `speculative.rs`: distributions, commit and draws for MTP verification.
//! - `transform.rs`: the per-row chain; `select.rs`: partial selection
//!   (top-k, top-p, top logprobs); `draw.rs`: the categorical walk;
//!   `math.rs`: vectorised kernels (exp, max, sums; AVX2 when available,
//!   bit-identical to the baseline build).
//! - `adjust.rs`: [`TokenMask`] and [`LogitBias`], the first link of the
//!   chain. Masks arrive per call ([`Sampler::sample_masked`]; the engine
//!   computes them from each sequence's grammar), biases per slot
//!   ([`Sampler::set_logit_bias`]). A call with any of them runs on the
//!   host chain even for CUDA logits (the kernel knows neither yet).
//! - `history.rs`: the pooled ring buffer.  `host.rs`: tensor → host.
//! - `device.rs` + `cuda/sampling.cu`: the one-launch path for CUDA logits
//!   and the device copy of the rings.

mod adjust;
mod batched;
mod device;
mod draw;
mod history;
mod host;
mod math;
mod options;
mod select;
mod speculative;
mod transform;

pub use adjust::{LogitBias, TokenMask};
pub use batched::Sampler;
pub use math::argmax;
pub use options::{SamplingOptions, MAX_TOP_LOGPROBS};

use crate::slot::SlotId;

/// Which dispatch path a [`Sampler::sample`] call took.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SamplePath {
    /// One fused pass over the batch with shared options.
    Uniform,
    /// Slot by slot, each with its own options.
    Serial,
}

/// The tokens of one [`Sampler::sample`] call, row by row.
#[derive(Debug, Clone, PartialEq)]
pub struct SampleResult {
    /// One token per row.
    pub tokens: Vec<u32>,
    /// Log-probability of each row's token under the raw logits; `Some`
    /// whenever any registered slot asked for logprobs.
    pub logprobs: Option<Vec<f32>>,
    /// Per row, the `max top_logprobs` (over registered slots, capped at V)
    /// most likely tokens, descending; `Some` when that maximum is > 0.
    pub top_logprobs: Option<Vec<Vec<(u32, f32)>>>,
    /// The path this call took.
    pub path: SamplePath,
}

impl SampleResult {
    /// No rows: what a call over zero rows returns.
    pub(crate) fn empty(path: SamplePath) -> Self {
        Self {
            tokens: Vec::new(),
            logprobs: None,
            top_logprobs: None,
            path,
        }
    }

    /// What row `row`'s request asked for: its token's logprob when
    /// `options.logprobs`, and its top list cut to `options.top_logprobs`.
    /// A row out of range yields `(None, [])`.
    pub fn for_row(&self, row: usize, options: &SamplingOptions) -> (Option<f32>, Vec<(u32, f32)>) {
        if !options.logprobs {
            return (None, Vec::new());
        }
        let logprob = self.logprobs.as_ref().and_then(|v| v.get(row).copied());
        let top = self
            .top_logprobs
            .as_ref()
            .and_then(|t| t.get(row))
            .map(|t| t[..options.top_logprobs.min(t.len())].to_vec())
            .unwrap_or_default();
        (logprob, top)
    }
}

/// One token's logprob and its position's top logprobs, descending.
pub type TokenLogprobs = (f32, Vec<(u32, f32)>);

/// Sampler errors. Bad input never panics; the message names the field,
/// slot or limit.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SamplerError {
    /// A [`SamplingOptions`] field is out of range (`add` validates).
    #[error("invalid sampling option `{field}`: {reason}")]
    InvalidOption { field: &'static str, reason: String },
    /// `add` of a slot that is registered.
    #[error("slot {0} is already registered with the sampler")]
    DuplicateSlot(SlotId),
    /// A call named a slot that is not registered.
    #[error("slot {0} is not registered with the sampler")]
    UnknownSlot(SlotId),
    /// One `sample` call named the same slot for two rows.
    #[error("slot {0} is named more than once in one sampler call")]
    RepeatedSlot(SlotId),
    /// Logits are not `[rows, V]` with one row per named slot.
    #[error("bad logits shape: {reason}")]
    LogitsShape { reason: String },
    /// Logits of an integer dtype.
    #[error("logits must have a float dtype, got {0}")]
    LogitsDType(String),
    /// Logits with V = 0.
    #[error("logits have an empty vocabulary (V = 0)")]
    EmptyVocab,
    /// A history or draft token id is ≥ V: priors, commits or drafts do
    /// not belong to the model that produced these logits.
    #[error("slot {slot}: token id {token} is outside the vocabulary of the logits (V = {vocab})")]
    VocabMismatch {
        slot: SlotId,
        token: u32,
        vocab: usize,
    },
    /// A row holds NaN or `+inf`.
    #[error("slot {slot} (row {row}): logits contain NaN or +inf")]
    NonFiniteLogits { slot: SlotId, row: usize },
    /// Every score of a row is `-inf` (before or after penalties).
    #[error("slot {slot} (row {row}): every logit is -inf, nothing can be sampled")]
    NoFiniteLogit { slot: SlotId, row: usize },
    /// `speculative_distributions` got fewer than `T - 1` drafts.
    #[error("speculative_distributions: {positions} positions need at least {} draft tokens, got {drafts}", positions - 1)]
    DraftTooShort { positions: usize, drafts: usize },
    /// `draw_at` got weights that are negative, non-finite or all zero.
    #[error("invalid probabilities for draw: {reason}")]
    InvalidProbs { reason: String },
    /// Reading the logits tensor failed (candle error text).
    #[error("tensor operation failed: {0}")]
    Tensor(String),
}
