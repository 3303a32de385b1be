//! Speculation rules: who drafts, how many drafts a sequence gets each step
//! ([`DraftPolicy`]), and how a step's drafts are verified ([`verify`]).
//!
//! Every step, sequences with speculation on draft `k_i` tokens with a
//! [`DraftHead`](super::DraftHead) (the rounds batched across those
//! sequences), then the step's single forward pass carries, for each of
//! them, its current token plus its drafts next to the plain decodes and
//! prefill chunks.
//!
//! # Verification: the target's own draw at every position
//! One rule for greedy and sampled requests. At each verified position `i`
//! the target's token is the one sequential decoding would emit there: the
//! argmax for greedy requests, and for sampled ones a draw from the
//! target's sampling distribution `p_i` (after penalties, bias, grammar
//! mask and truncation, from [`Sampler::speculative_distributions_masked`])
//! with the uniform keyed by the request's seed and that position's
//! generation index ([`Sampler::draw_at`]). The longest prefix of drafts
//! equal to those tokens is accepted, then the target's token after it.
//! So every emitted token is exactly the token speculation-off decoding
//! emits — for greedy and for seeded sampled requests alike, at any draft
//! length, whatever shares the batch — and the output is an exact sample of
//! the target distribution (the uniforms are independent across positions).
//! Sampled drafts are drawn from the draft distribution with the *same*
//! keyed uniform, which couples them to the target's draw: when the head's
//! distribution is close to the target's, so are the tokens.
//!
//! Plain greedy requests (no penalty) verify from ids alone
//! ([`Sampler::argmax_rows`]: one kernel launch on a GPU, only ids leave
//! the device) unless they ask for logprobs.
//!
//! # Logprobs
//! A request that asks for logprobs drafts like any other; each emitted
//! token's logprob and top logprobs come from the target's raw logits at
//! its verified position ([`Sampler::logprobs_at`]), the arithmetic the
//! plain sampler call uses.
//!
//! # Who decides the draft length
//! The scheduler plans `Decode { max_drafts }` inside the step's token
//! budget; [`DraftPolicy::drafts_for`] then takes at most that many. Since
//! no request's tokens depend on its draft length, the policy is free to
//! choose any length, 0 included.

use candle_core::Tensor;

use super::ngram::PromptLookup;
use crate::engine::{SlotId, SpecOptions};
use crate::sampler::{argmax, Sampler, SamplerError, TokenLogprobs, TokenMask};

/// Engine-wide speculation settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SpecConfig {
    /// What a request that does not say gets.
    pub default: SpecOptions,
    /// Prompt lookup (n-gram drafts) beside the draft head, or alone.
    pub prompt_lookup: Option<PromptLookup>,
    /// Test-only: accept every draft unchecked. This is a deliberately wrong
    /// rule; the distribution test uses it to show that it can fail. Debug
    /// builds only, so no release build carries the branch.
    #[cfg(debug_assertions)]
    #[doc(hidden)]
    pub unchecked_accept: bool,
}

/// How one sequence speculates, once resolved at admission.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Drafting {
    pub options: SpecOptions,
}

impl Drafting {
    /// The rule both sides apply: a sequence drafts when the engine has a
    /// drafter (`default` is its default options) and its options (or the
    /// default) enable it.
    pub fn resolve(requested: Option<SpecOptions>, default: Option<SpecOptions>) -> Option<Self> {
        let options = requested.unwrap_or(default?);
        options.enabled.then_some(Self { options })
    }

    /// Drafts the scheduler plans for this sequence in a step whose budget
    /// is `budget` tokens (one of them its own decode token).
    pub fn planned_drafts(&self, budget: usize) -> usize {
        self.options.max_draft.min(budget.saturating_sub(1))
    }
}

/// Drafts chosen for one sequence.
#[derive(Debug, Default, Clone, PartialEq)]
pub(crate) struct Drafts {
    pub tokens: Vec<u32>,
}

/// The token a request emits from `dist` at `offset` positions past its
/// next one: the argmax for greedy requests, otherwise the draw with that
/// position's keyed uniform.
pub(crate) fn pick(
    sampler: &Sampler,
    slot: SlotId,
    greedy: bool,
    dist: &[f32],
    offset: usize,
) -> Result<u32, SamplerError> {
    if greedy {
        Ok(argmax(dist))
    } else {
        sampler.draw_at(slot, offset, dist)
    }
}

/// The verdict on one sequence's drafts.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Verdict {
    pub accepted: usize,
    /// The target's token after the accepted drafts (a correction or the bonus).
    pub next: u32,
    /// Per kept token (the accepted drafts, then `next`): its logprob and
    /// top logprobs at its verified position; empty unless the request
    /// asked for logprobs.
    pub logprobs: Vec<TokenLogprobs>,
}

impl Verdict {
    /// The kept tokens: the accepted drafts, then the target's next token.
    pub fn kept(&self, drafts: &Drafts) -> Vec<u32> {
        let mut kept = drafts.tokens[..self.accepted].to_vec();
        kept.push(self.next);
        kept
    }
}

/// How many of `drafts` are accepted against the target's own tokens
/// `target[i]` at each verified position (row i predicts the token after
/// draft i): the longest equal prefix.
pub(crate) fn accepted_prefix(drafts: &[u32], target: &[u32]) -> usize {
    drafts
        .iter()
        .zip(target)
        .take_while(|(d, t)| d == t)
        .count()
}

/// The target's own token at each of the `k + 1` verified positions of
/// `logits` (see the module docs).
fn target_tokens(
    sampler: &mut Sampler,
    slot: SlotId,
    greedy: bool,
    logits: &Tensor,
    drafts: &Drafts,
    masks: Option<&[TokenMask]>,
) -> Result<Vec<u32>, SamplerError> {
    let k = drafts.tokens.len();
    if greedy && masks.is_none() && sampler.is_plain_greedy(slot) {
        // Only the ids are needed (on a GPU only they leave the device).
        return sampler.argmax_rows(&vec![slot; k + 1], logits);
    }
    // Under a grammar, position i's distribution is the masked one sequential
    // decoding would draw from, so output equals MTP off.
    let p = sampler.speculative_distributions_masked(
        slot,
        logits,
        &drafts.tokens,
        masks.unwrap_or_default(),
    )?;
    p.iter()
        .enumerate()
        .map(|(i, row)| pick(sampler, slot, greedy, row, i))
        .collect()
}

/// Verifies `drafts` against the target's logits `[k + 1, vocab]` (row i
/// predicts the token after draft i, row 0 after the current token).
/// Commits nothing.
pub(crate) fn verify(
    sampler: &mut Sampler,
    slot: SlotId,
    greedy: bool,
    logits: &Tensor,
    drafts: &Drafts,
    masks: Option<&[TokenMask]>,
    accept_all: bool,
) -> Result<Verdict, SamplerError> {
    let target = target_tokens(sampler, slot, greedy, logits, drafts, masks)?;
    let accepted = if accept_all {
        drafts.tokens.len()
    } else {
        accepted_prefix(&drafts.tokens, &target)
    };
    let mut verdict = Verdict {
        accepted,
        next: target[accepted],
        logprobs: Vec::new(),
    };
    verdict.logprobs = sampler.logprobs_at(slot, logits, &verdict.kept(drafts))?;
    Ok(verdict)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn acceptance_table() {
        // (drafts, the target's own token per row, accepted)
        let table: &[(&[u32], &[u32], usize)] = &[
            (&[], &[7], 0),                 // plain decode
            (&[5], &[5, 9], 1),             // all accepted: the bonus is the last row's
            (&[5], &[6, 9], 0),             // first rejected: the target's token instead
            (&[1, 2, 3], &[1, 2, 3, 4], 3), // full run
            (&[1, 2, 3], &[1, 8, 3, 4], 1), // a later match does not count
            (&[1, 2, 3], &[9, 2, 3, 4], 0), // nothing accepted
            (&[4, 4, 4], &[4, 4, 5, 6], 2), // repeats are fine
        ];
        for &(drafts, target, accepted) in table {
            assert_eq!(
                accepted_prefix(drafts, target),
                accepted,
                "drafts {drafts:?} against {target:?}"
            );
            let v = Verdict {
                accepted,
                next: target[accepted],
                logprobs: Vec::new(),
            };
            let kept = v.kept(&Drafts {
                tokens: drafts.to_vec(),
            });
            assert_eq!(kept, target[..=accepted], "what sequential decoding emits");
        }
    }

    #[test]
    fn who_drafts() {
        let on = Some(SpecOptions::default());
        assert_eq!(Drafting::resolve(None, None), None, "no drafter");
        assert!(Drafting::resolve(None, on).is_some());
        assert_eq!(Drafting::resolve(Some(SpecOptions::off()), on), None);
        let d = Drafting::resolve(Some(SpecOptions::constant(5)), on).unwrap();
        assert_eq!(
            (
                d.planned_drafts(64),
                d.planned_drafts(3),
                d.planned_drafts(0)
            ),
            (5, 2, 0)
        );
    }
}
