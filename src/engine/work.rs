//! The plan phase: each work item of a [`StepPlan`](super::StepPlan)
//! checked against the slot registry and turned into a [`Planned`]
//! sequence, with KV room reserved for its tokens and drafts.

use super::errors::kv_err;
use super::rows::RowRequest;
use super::sequences::Sequences;
use super::spec::Drafts;
use super::{EngineError, SeqWork, SlotId};

/// A sequence that takes part in this step's forward pass.
#[derive(Debug)]
pub(crate) struct Planned {
    pub slot: SlotId,
    /// The slot's KV length before the step.
    pub offset: usize,
    /// Fed tokens before drafts: a prompt chunk, or the last sampled token.
    pub tokens: Vec<u32>,
    /// The pass ends at a position that samples (a decode or the last prompt chunk).
    pub samples: bool,
    /// Drafts the policy granted this step (0: plain decode).
    pub draft_budget: usize,
    pub drafts: Drafts,
    /// The draft head needs this sequence's hidden state at every position.
    pub keep_hidden: bool,
    /// Every fed token: `tokens` then `drafts.tokens` (filled by [`Planned::seal`]).
    fed: Vec<u32>,
}

impl Planned {
    /// Fixes the fed tokens once drafting is over.
    pub fn seal(&mut self) {
        self.fed = self
            .tokens
            .iter()
            .chain(&self.drafts.tokens)
            .copied()
            .collect();
    }

    /// This sequence's share of the row layout (after [`seal`](Self::seal)).
    pub fn rows(&self) -> RowRequest<'_> {
        RowRequest {
            slot: self.slot,
            offset: self.offset,
            tokens: &self.fed,
            drafts: self.drafts.tokens.len(),
            samples: self.samples,
            keep_hidden: self.keep_hidden,
        }
    }

    /// Drafting was abandoned for this sequence: decode it plainly.
    pub fn drop_drafts(&mut self) {
        self.drafts = Drafts::default();
        self.keep_hidden = false;
    }
}

/// Checks one work item and reserves room for its tokens and drafts.
/// `step_allows` is the policy's verdict on the step's batch size.
pub(crate) fn plan_one(
    seqs: &mut Sequences,
    work: SeqWork,
    context_len: usize,
    step_allows: bool,
) -> Result<Planned, EngineError> {
    let slot = work.slot();
    let offset = seqs
        .kv
        .len(slot)
        .map_err(|_| EngineError::UnknownSlot(slot))?;
    let seq = seqs.get(slot).ok_or(EngineError::UnknownSlot(slot))?;
    let invalid = |reason: String| EngineError::InvalidWork { slot, reason };
    let (tokens, samples, allowed) = match work {
        SeqWork::Prefill { start, len, .. } => {
            let target = seq.fill_target();
            if start != seq.prefilled || len == 0 || start + len > target {
                let done = seq.prefilled;
                return Err(invalid(format!(
                    "prefill {start}..{} but {done} of {target} positions are done",
                    start + len
                )));
            }
            let chunk = (start..start + len)
                .map(|p| seq.token_at(p))
                .collect::<Option<Vec<u32>>>()
                .ok_or_else(|| invalid("prefill past the known tokens".into()))?;
            let samples = seq.recompute.is_none() && start + len == seq.prompt.len();
            (chunk, samples, 0)
        }
        SeqWork::Decode { max_drafts, .. } => match seq.last_token {
            Some(t) if seq.prompt_done() => (
                vec![t],
                true,
                max_drafts.min(seq.draft_room(offset, context_len)),
            ),
            _ => return Err(invalid("decode before the prompt is prefilled".into())),
        },
    };
    if offset + tokens.len() > context_len {
        return Err(invalid(format!(
            "position {} beyond the context of {context_len}",
            offset + tokens.len()
        )));
    }
    let recomputing = seq.recompute.is_some();
    let draft_budget = seqs.policy.drafts_for(slot, allowed, step_allows);
    // A recompute refills the target's KV only: the draft head already
    // consumed these positions' hidden states before the preemption.
    let keep_hidden = seqs.keeps_hidden(slot) && !recomputing;
    seqs.kv
        .ensure_room(slot, tokens.len() + draft_budget)
        .map_err(|e| kv_err(slot, e))?;
    Ok(Planned {
        slot,
        offset,
        tokens,
        samples,
        draft_budget,
        drafts: Drafts::default(),
        keep_hidden,
        fed: Vec::new(),
    })
}
