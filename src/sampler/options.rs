//! Per-request sampling options, as the client states them.
//!
//! `SamplingOptions` is plain data that crosses the actor → engine boundary.
//! `validate` turns bad values into a typed [`SamplerError`] before a request
//! takes a slot; the sampler re-validates on `add` so a library user who
//! bypasses the scheduler still cannot make it panic.

use serde::{Deserialize, Serialize};

use super::SamplerError;

/// The most top-logprob alternatives a request may ask for (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// Sampling knobs of one sequence (Ollama / OpenAI semantics).
///
/// Neutral values turn a transform off: `temperature == 0` is greedy,
/// `top_k == 0`, `top_p` of 0 or 1, `min_p == 0`, `repeat_penalty == 1`,
/// zero presence / frequency penalties, and `repeat_last_n == 0` (which
/// disables all three penalties whatever their coefficients).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingOptions {
    /// Softmax temperature; 0 selects the argmax (greedy).
    pub temperature: f32,
    /// Keep only the K most likely tokens (0 = off).
    pub top_k: i32,
    /// Nucleus sampling: keep the smallest prefix (descending) whose exclusive
    /// cumulative probability stays below `top_p` (0 or 1 = off).
    pub top_p: f32,
    /// Drop tokens whose probability is below `min_p` × the top probability.
    pub min_p: f32,
    /// Multiplicative repeat penalty (> 1 discourages repeats; ≤ 0 means 1).
    pub repeat_penalty: f32,
    /// Subtracted once from the logit of every token in the window.
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per occurrence in the window.
    pub frequency_penalty: f32,
    /// Penalty window in tokens: 0 disables penalties, −1 means the context.
    pub repeat_last_n: i32,
    /// Report the sampled token's log-probability.
    pub logprobs: bool,
    /// Also report this many most likely alternatives (needs `logprobs`).
    pub top_logprobs: usize,
    /// Seed of this sequence's own RNG; `None` draws one at registration.
    /// The same request with the same seed yields the same tokens whatever
    /// else shares the batch.
    pub seed: Option<u64>,
}

impl Default for SamplingOptions {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repeat_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repeat_last_n: 64,
            logprobs: false,
            top_logprobs: 0,
            seed: None,
        }
    }
}

impl SamplingOptions {
    /// Greedy decoding with no penalties.
    pub fn greedy() -> Self {
        Self::default()
    }

    /// Checks every field; the error names the field and the limit.
    pub fn validate(&self) -> Result<(), SamplerError> {
        fn finite(field: &'static str, v: f32) -> Result<(), SamplerError> {
            if v.is_finite() {
                Ok(())
            } else {
                Err(SamplerError::InvalidOption {
                    field,
                    reason: format!("must be a finite number, got {v}"),
                })
            }
        }
        finite("temperature", self.temperature)?;
        if self.temperature < 0.0 {
            return Err(SamplerError::InvalidOption {
                field: "temperature",
                reason: format!("must be >= 0, got {}", self.temperature),
            });
        }
        if self.top_k < 0 {
            return Err(SamplerError::InvalidOption {
                field: "top_k",
                reason: format!("must be >= 0, got {}", self.top_k),
            });
        }
        for (field, v) in [("top_p", self.top_p), ("min_p", self.min_p)] {
            finite(field, v)?;
            if !(0.0..=1.0).contains(&v) {
                return Err(SamplerError::InvalidOption {
                    field,
                    reason: format!("must be in [0, 1], got {v}"),
                });
            }
        }
        finite("repeat_penalty", self.repeat_penalty)?;
        finite("presence_penalty", self.presence_penalty)?;
        finite("frequency_penalty", self.frequency_penalty)?;
        if self.repeat_last_n < -1 {
            return Err(SamplerError::InvalidOption {
                field: "repeat_last_n",
                reason: format!(
                    "must be -1 (context), 0 (off) or positive, got {}",
                    self.repeat_last_n
                ),
            });
        }
        if self.top_logprobs > MAX_TOP_LOGPROBS {
            return Err(SamplerError::InvalidOption {
                field: "top_logprobs",
                reason: format!(
                    "must be at most {MAX_TOP_LOGPROBS}, got {}",
                    self.top_logprobs
                ),
            });
        }
        Ok(())
    }

    /// Whether the penalty window is in use (some penalty active and a
    /// non-zero window).
    pub fn uses_history(&self) -> bool {
        self.repeat_last_n != 0
            && ((self.repeat_penalty > 0.0 && self.repeat_penalty != 1.0)
                || self.presence_penalty != 0.0
                || self.frequency_penalty != 0.0)
    }

    /// Whether the choice is the argmax of the (penalised) scores.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// The form the sampler stores: a repeat penalty ≤ 0
    /// becomes the neutral 1, `repeat_last_n == -1` becomes `num_ctx`, and
    /// the window is zeroed when no penalty is active, so slots that differ
    /// only in an unused window still share the uniform path and do not
    /// widen the history pool.
    pub fn normalized(mut self, num_ctx: usize) -> Self {
        if self.repeat_penalty <= 0.0 {
            self.repeat_penalty = 1.0;
        }
        if self.repeat_last_n < 0 {
            self.repeat_last_n = i32::try_from(num_ctx).unwrap_or(i32::MAX);
        }
        if !self.uses_history() {
            self.repeat_last_n = 0;
        }
        self
    }

    /// The penalty window in tokens of normalised options (0 = no history).
    pub fn window(&self) -> usize {
        usize::try_from(self.repeat_last_n).unwrap_or(0)
    }
}
