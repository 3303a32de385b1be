//! Edge validation: the one place where a token-level request becomes a
//! [`ValidSeq`], the checked type that the scheduler queues, admits and
//! hands to the engine.
//!
//! # Invariants
//! - [`validate_seq`] is the only constructor of a [`ValidSeq`] (a private
//!   field keeps struct literals out of every other module), so holding one
//!   proves the request was checked against the engine's [`EngineInfo`]: a
//!   non-empty prompt shorter than the context, every prompt id inside the
//!   vocabulary, at least one token to generate, sampling and speculation
//!   options in range, and a longest length whose KV blocks fit the pool.
//! - Nothing downstream checks these again. The scheduler core takes a
//!   `ValidSeq` and only adds queue and slot admission; the engine receives
//!   the same values in its `Admission`.
//!
//! Callers: the scheduler's `Submit` handler (token-level requests, on the
//! scheduler's mailbox: the checks are a pass over the prompt ids, no text)
//! and the text layer's `Generate` path, which tokenizes and validates off
//! the scheduler's mailbox and sends the finished `ValidSeq` in.

use std::sync::Arc;

use crate::engine::{EngineInfo, SeqConstraints, SpecOptions};
use crate::sampler::SamplingOptions;

use super::SchedulerError;

/// A checked request. Built only by
/// [`validate_seq`]; the fields are public to the scheduler so that the
/// planner can move them into the engine's `Admission`.
#[derive(Debug, Clone)]
pub(crate) struct ValidSeq {
    pub prompt: Arc<[u32]>,
    pub sampling: SamplingOptions,
    pub max_new_tokens: usize,
    /// Speculative decoding options; `None` uses the engine's default.
    pub speculation: Option<SpecOptions>,
    /// Grammar, logit bias, stop ids: none unless
    /// [`ValidSeq::with_constraints`] added them.
    pub constraints: SeqConstraints,
    /// Private, so that no other module can build an unchecked `ValidSeq`.
    _checked: Checked,
}

#[derive(Debug, Clone)]
struct Checked;

/// Checks a request against the engine's limits. The order matters only for
/// which error a request with several faults reports: shape first, then
/// contents, then capacity.
pub(crate) fn validate_seq(
    prompt: Arc<[u32]>,
    sampling: SamplingOptions,
    max_new_tokens: usize,
    spec: Option<SpecOptions>,
    info: &EngineInfo,
) -> Result<ValidSeq, SchedulerError> {
    if prompt.is_empty() {
        return Err(SchedulerError::EmptyPrompt);
    }
    if prompt.len() >= info.context_len {
        return Err(SchedulerError::PromptTooLong {
            len: prompt.len(),
            context_len: info.context_len,
        });
    }
    if max_new_tokens == 0 {
        return Err(SchedulerError::ZeroMaxNewTokens);
    }
    sampling.validate()?;
    if let Some(reason) = spec.as_ref().and_then(|s| s.validate().err()) {
        return Err(SchedulerError::InvalidSpec(reason));
    }
    if let Some((index, &token)) = prompt
        .iter()
        .enumerate()
        .find(|(_, &t)| t as usize >= info.vocab_size)
    {
        return Err(SchedulerError::TokenOutOfVocab {
            index,
            token,
            vocab_size: info.vocab_size,
        });
    }
    // The most KV positions the sequence can ever occupy. Nothing is
    // reserved up front (blocks are taken as it grows), but a request whose
    // blocks would not fit the whole pool could never finish: refused here.
    let kv_reserve = prompt
        .len()
        .saturating_add(max_new_tokens)
        .min(info.context_len);
    let blocks = crate::kv::blocks_for(kv_reserve, info.kv_block_size.max(1));
    if blocks * info.kv_block_size > info.kv_capacity_tokens {
        return Err(SchedulerError::ExceedsKvCapacity {
            needed: kv_reserve,
            capacity: info.kv_capacity_tokens,
        });
    }
    Ok(ValidSeq {
        prompt,
        sampling,
        max_new_tokens,
        speculation: spec,
        constraints: SeqConstraints::default(),
        _checked: Checked,
    })
}

impl ValidSeq {
    /// Adds output constraints, whose token ids are checked here against
    /// the vocabulary (a grammar was compiled against the tokenizer's, so
    /// it needs no check).
    pub(crate) fn with_constraints(
        mut self,
        constraints: SeqConstraints,
        info: &EngineInfo,
    ) -> Result<ValidSeq, SchedulerError> {
        let out_of_vocab = |field: &'static str, token: u32| SchedulerError::InvalidConstraint {
            field,
            reason: format!(
                "token id {token} is outside the vocabulary of {}",
                info.vocab_size
            ),
        };
        if let Some(t) = constraints.logit_bias.max_token() {
            if t as usize >= info.vocab_size {
                return Err(out_of_vocab("logit_bias", t));
            }
        }
        if let Some(&t) = constraints
            .stop_ids
            .iter()
            .find(|&&t| t as usize >= info.vocab_size)
        {
            return Err(out_of_vocab("stop", t));
        }
        self.constraints = constraints;
        Ok(self)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn info() -> EngineInfo {
        EngineInfo {
            model_name: "test".into(),
            context_len: 100,
            vocab_size: 50,
            eos_ids: vec![0],
            kv_capacity_tokens: 80,
            kv_block_size: 16,
            speculation: None,
        }
    }

    /// A greedy `ValidSeq` of `prompt_len` ones, checked against an engine
    /// large enough for any test request.
    pub(crate) fn valid(prompt_len: usize, max_new_tokens: usize) -> ValidSeq {
        let roomy = EngineInfo {
            model_name: "test".into(),
            context_len: usize::MAX,
            vocab_size: 2,
            eos_ids: vec![0],
            kv_capacity_tokens: usize::MAX,
            kv_block_size: 1,
            speculation: None,
        };
        validate_seq(
            vec![1u32; prompt_len].into(),
            SamplingOptions::greedy(),
            max_new_tokens,
            None,
            &roomy,
        )
        .expect("a valid test request")
    }

    fn check(prompt: &[u32], max_new: usize) -> Result<ValidSeq, SchedulerError> {
        validate_seq(
            prompt.into(),
            SamplingOptions::greedy(),
            max_new,
            None,
            &info(),
        )
    }

    #[test]
    fn reservation_is_capped_at_context() {
        assert!(check(&[1, 2, 3], 10).is_ok());
        // 80 tokens are exactly five blocks of 16; 81 need a sixth.
        assert!(check(&[1; 70], 10).is_ok());
        assert_eq!(
            check(&[1; 70], 11).err(),
            Some(SchedulerError::ExceedsKvCapacity {
                needed: 81,
                capacity: 80
            })
        );
        // 60 + 60 > context 100, capped; 100 > capacity 80, refused.
        assert_eq!(
            check(&[1; 60], 60).map(|_| ()),
            Err(SchedulerError::ExceedsKvCapacity {
                needed: 100,
                capacity: 80
            })
        );
    }

    #[test]
    fn each_fault_has_its_error() {
        assert_eq!(check(&[], 5).err(), Some(SchedulerError::EmptyPrompt));
        assert_eq!(
            check(&[1; 100], 5).err(),
            Some(SchedulerError::PromptTooLong {
                len: 100,
                context_len: 100
            })
        );
        assert_eq!(check(&[1], 0).err(), Some(SchedulerError::ZeroMaxNewTokens));
        assert_eq!(
            check(&[1, 2, 50, 3], 5).err(),
            Some(SchedulerError::TokenOutOfVocab {
                index: 2,
                token: 50,
                vocab_size: 50
            })
        );
        let bad = SamplingOptions {
            top_p: 2.0,
            ..SamplingOptions::greedy()
        };
        let err = validate_seq([1u32].into(), bad, 5, None, &info()).err();
        assert!(
            matches!(err, Some(SchedulerError::Sampling(_))),
            "got {err:?}"
        );
        let bad_spec = SpecOptions {
            initial_draft: 9,
            max_draft: 4,
            ..SpecOptions::default()
        };
        let err = validate_seq(
            [1u32].into(),
            SamplingOptions::greedy(),
            5,
            Some(bad_spec),
            &info(),
        )
        .err();
        assert!(
            matches!(err, Some(SchedulerError::InvalidSpec(_))),
            "got {err:?}"
        );
    }
}
