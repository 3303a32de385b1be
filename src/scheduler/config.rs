//! Scheduler limits, with defaults and validation against the engine.
//!
//! The KV capacity, context length and vocabulary size are not configured
//! here: they come from the engine's [`EngineInfo`], so the scheduler can never
//! promise more than the engine holds.

use crate::engine::EngineInfo;

use super::SchedulerError;

/// Limits of one scheduler. Build with `SchedulerConfig { max_seqs: 8,
/// ..Default::default() }`; [`SchedulerConfig::validate`] runs at start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Sequence slots: the most sequences in one forward pass. Slot ids are
    /// `0..max_seqs`.
    pub max_seqs: usize,
    /// Requests that may wait for a slot; one more is refused with
    /// [`SchedulerError::Overloaded`] rather than queued without bound.
    pub max_queue: usize,
    /// Tokens fed to the model per step (decode tokens plus prefill chunks).
    /// Must be at least `max_seqs`, so every running sequence can always
    /// decode and a step can never stall.
    pub step_token_budget: usize,
    /// Largest prefill chunk of one sequence in one step.
    ///
    /// NOTE: keep it below `step_token_budget`. Prefill chunks are assigned
    /// oldest first, so when one chunk may take the whole budget a long prompt
    /// holds back every newer prompt until it is done; with half the budget a
    /// short prompt arriving behind a long one still gets its first token
    /// within a step or two.
    pub max_prefill_chunk: usize,
    /// Automatic prefix caching: full KV blocks of finished sequences stay
    /// cached (until their memory is needed) and a new request starts after
    /// its longest cached prefix. Outputs are the same either way.
    pub prefix_caching: bool,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            max_seqs: 64,
            max_queue: 1024,
            step_token_budget: 512,
            max_prefill_chunk: 256,
            prefix_caching: true,
        }
    }
}

impl SchedulerConfig {
    /// Checks the limits against each other and against the engine; the
    /// error names the offending field and the limit it broke.
    pub fn validate(&self, info: &EngineInfo) -> Result<(), SchedulerError> {
        let invalid = |field: &'static str, reason: String| {
            Err(SchedulerError::InvalidConfig { field, reason })
        };
        if self.max_seqs == 0 {
            return invalid("max_seqs", "must be at least 1, got 0".into());
        }
        if u32::try_from(self.max_seqs).is_err() {
            return invalid(
                "max_seqs",
                format!(
                    "must fit a slot id (at most {}), got {}",
                    u32::MAX,
                    self.max_seqs
                ),
            );
        }
        if self.max_queue == 0 {
            return invalid("max_queue", "must be at least 1, got 0".into());
        }
        if self.step_token_budget < self.max_seqs {
            return invalid(
                "step_token_budget",
                format!(
                    "must be at least max_seqs ({}) so every sequence can decode each step, got {}",
                    self.max_seqs, self.step_token_budget
                ),
            );
        }
        if self.max_prefill_chunk == 0 || self.max_prefill_chunk > self.step_token_budget {
            return invalid(
                "max_prefill_chunk",
                format!(
                    "must be in 1..={} (step_token_budget), got {}",
                    self.step_token_budget, self.max_prefill_chunk
                ),
            );
        }
        validate_engine(info)
    }
}

/// The engine must leave room for at least a one-token prompt plus one
/// generated token, and report a usable vocabulary and KV pool.
fn validate_engine(info: &EngineInfo) -> Result<(), SchedulerError> {
    let invalid = |field: &'static str, reason: String| {
        Err(SchedulerError::InvalidEngineInfo { field, reason })
    };
    if info.context_len < 2 {
        return invalid(
            "context_len",
            format!("must be at least 2, got {}", info.context_len),
        );
    }
    if info.vocab_size == 0 {
        return invalid("vocab_size", "must be at least 1, got 0".into());
    }
    if info.kv_capacity_tokens < 2 {
        return invalid(
            "kv_capacity_tokens",
            format!("must be at least 2, got {}", info.kv_capacity_tokens),
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info() -> EngineInfo {
        EngineInfo {
            model_name: "test".into(),
            context_len: 4096,
            vocab_size: 1000,
            eos_ids: vec![0],
            kv_capacity_tokens: 65536,
            speculation: None,
            kv_block_size: 16,
        }
    }

    fn field_of(r: Result<(), SchedulerError>) -> &'static str {
        match r {
            Err(SchedulerError::InvalidConfig { field, .. })
            | Err(SchedulerError::InvalidEngineInfo { field, .. }) => field,
            other => panic!("expected a config error, got {other:?}"),
        }
    }

    #[test]
    fn default_is_valid() {
        assert_eq!(SchedulerConfig::default().validate(&info()), Ok(()));
    }

    #[test]
    fn each_bad_field_is_named() {
        let base = SchedulerConfig::default();
        let cases = [
            (
                SchedulerConfig {
                    max_seqs: 0,
                    ..base.clone()
                },
                "max_seqs",
            ),
            (
                SchedulerConfig {
                    max_queue: 0,
                    ..base.clone()
                },
                "max_queue",
            ),
            (
                SchedulerConfig {
                    step_token_budget: 63,
                    ..base.clone()
                },
                "step_token_budget",
            ),
            (
                SchedulerConfig {
                    max_prefill_chunk: 0,
                    ..base.clone()
                },
                "max_prefill_chunk",
            ),
            (
                SchedulerConfig {
                    max_prefill_chunk: 513,
                    ..base.clone()
                },
                "max_prefill_chunk",
            ),
        ];
        for (cfg, field) in cases {
            assert_eq!(field_of(cfg.validate(&info())), field);
        }
        let small_ctx = EngineInfo {
            context_len: 1,
            ..info()
        };
        assert_eq!(field_of(base.validate(&small_ctx)), "context_len");
        let no_vocab = EngineInfo {
            vocab_size: 0,
            ..info()
        };
        assert_eq!(field_of(base.validate(&no_vocab)), "vocab_size");
    }
}
