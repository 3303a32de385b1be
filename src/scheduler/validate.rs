//! Edge validation: a [`SeqRequest`]'s token-level spec becomes a
//! [`ValidSeq`] before it takes queue space or a slot.
//!
//! Everything the engine would otherwise reject (or worse, panic on) is
//! checked here against the engine's [`EngineInfo`], so inner layers only see
//! requests that fit: a non-empty prompt shorter than the context, in-vocab
//! token ids, sane sampling options, and a KV reservation the pool can hold.
//!
//! [`SeqRequest`]: super::SeqRequest

use std::sync::Arc;

use crate::engine::EngineInfo;
use crate::sampler::SamplingOptions;

use super::SchedulerError;

/// A checked request, with its KV reservation resolved.
#[derive(Debug, Clone)]
pub(crate) struct ValidSeq {
    pub prompt: Arc<[u32]>,
    pub sampling: SamplingOptions,
    pub max_new_tokens: usize,
    /// Speculative decoding options (validated).
    pub spec: Option<crate::engine::SpecOptions>,
    /// `min(prompt + max_new_tokens, context_len)`: the most KV tokens the
    /// sequence can ever occupy, reserved up front at admission.
    pub kv_reserve: usize,
}

/// Checks a request against the engine's limits. The order matters only for
/// which error a request with several faults reports: shape first, then
/// contents, then capacity.
pub(crate) fn validate_seq(
    prompt: Arc<[u32]>,
    sampling: SamplingOptions,
    max_new_tokens: usize,
    spec: Option<crate::engine::SpecOptions>,
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
    let kv_reserve = prompt
        .len()
        .saturating_add(max_new_tokens)
        .min(info.context_len);
    if kv_reserve > info.kv_capacity_tokens {
        return Err(SchedulerError::ExceedsKvCapacity {
            needed: kv_reserve,
            capacity: info.kv_capacity_tokens,
        });
    }
    Ok(ValidSeq {
        prompt,
        sampling,
        max_new_tokens,
        spec,
        kv_reserve,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info() -> EngineInfo {
        EngineInfo {
            model_name: "test".into(),
            context_len: 100,
            vocab_size: 50,
            eos_ids: vec![0],
            kv_capacity_tokens: 80,
            speculation: None,
        }
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
        assert_eq!(check(&[1, 2, 3], 10).map(|v| v.kv_reserve), Ok(13));
        // 60 + 60 > context 100, capped; 100 > capacity 80, refused.
        assert_eq!(
            check(&[1; 60], 60).map(|v| v.kv_reserve),
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
    }
}
