//! The plan phase: each work item of a [`StepPlan`](super::StepPlan)
//! checked against the slot registry and turned into a [`Planned`]
//! sequence, with KV room reserved for its tokens and drafts.

use super::errors::kv_err;
use super::policy::{Candidate, Drafter, Grant};
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
    /// Drafts the plan and the sequence's room allow (0 for prefill work
    /// and sequences that do not draft).
    pub draft_cap: usize,
    /// Drafts the policy granted this step (0: plain decode), and who
    /// drafts them.
    pub draft_budget: usize,
    pub drafter: Drafter,
    pub drafts: Drafts,
    /// The pass stores the hidden state of every fed position
    /// ([`KvCache::store_hidden`](crate::kv::KvCache::store_hidden)).
    pub store_hidden: bool,
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
            store_hidden: self.store_hidden,
        }
    }

    /// Drafting was abandoned for this sequence: decode it plainly.
    pub fn drop_drafts(&mut self) {
        self.drafts = Drafts::default();
    }
}

/// Checks one work item and reserves room for its tokens; drafts come
/// later, from [`grant_drafts`].
pub(crate) fn plan_one(
    seqs: &mut Sequences,
    work: SeqWork,
    context_len: usize,
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
    let store_hidden = seqs.kv.stores_hidden();
    let draft_cap = if seqs.policy.drafts(slot) { allowed } else { 0 };
    seqs.kv
        .ensure_room(slot, tokens.len())
        .map_err(|e| kv_err(slot, e))?;
    Ok(Planned {
        slot,
        offset,
        tokens,
        samples,
        draft_cap,
        draft_budget: 0,
        drafter: Drafter::Head,
        drafts: Drafts::default(),
        store_hidden,
        fed: Vec::new(),
    })
}

/// The policy's grants for every planned sequence that may draft, with KV
/// room for them; prompt-lookup drafts are filled in here (they need no
/// round). A sequence whose room cannot grow decodes without drafts.
pub(crate) fn grant_drafts(seqs: &mut Sequences, planned: &mut [Planned]) {
    let drafting: Vec<usize> = (0..planned.len())
        .filter(|&i| planned[i].draft_cap > 0)
        .collect();
    if drafting.is_empty() {
        return;
    }
    let slots: Vec<SlotId> = drafting.iter().map(|&i| planned[i].slot).collect();
    let cap = drafting
        .iter()
        .map(|&i| planned[i].draft_cap)
        .max()
        .unwrap_or(0);
    let base_tokens = planned.iter().map(|p| p.tokens.len()).sum();
    if !seqs
        .policy
        .worth_planning(&slots, base_tokens, cap, planned.len())
    {
        return;
    }
    let lookup = seqs.policy.lookup();
    let candidates: Vec<Candidate> = drafting
        .iter()
        .map(|&i| {
            let p = &planned[i];
            let seq = seqs.get(p.slot);
            let proposal = match (lookup, seq) {
                (Some(l), Some(seq)) => l.propose(&seq.history(), p.draft_cap),
                _ => Default::default(),
            };
            let head_rows = match seq {
                Some(seq) if seqs.head_needs_hidden() => p.offset.saturating_sub(seq.hidden_from),
                _ => 1,
            };
            Candidate {
                slot: p.slot,
                cap: p.draft_cap,
                lookup: proposal,
                head_rows,
                head_fresh: seqs.head_needs_hidden() && seq.is_some_and(|s| s.hidden_from == 0),
                remaining: seq.map_or(0, |s| {
                    s.max_new_tokens.saturating_sub(s.generated.len() + 1)
                }),
            }
        })
        .collect();
    let grants = seqs.policy.assign(&candidates, base_tokens, planned.len());
    for ((&i, c), Grant { drafts, drafter }) in drafting.iter().zip(&candidates).zip(grants) {
        let p = &mut planned[i];
        if drafts == 0
            || seqs
                .kv
                .ensure_room(p.slot, p.tokens.len() + drafts)
                .is_err()
        {
            continue;
        }
        p.draft_budget = drafts;
        p.drafter = drafter;
        if let Drafter::Lookup(_) = drafter {
            p.drafts.tokens = c.lookup.tokens[..drafts].to_vec();
        }
    }
}
