//! The draft phase: batched draft rounds for every planned sequence whose
//! drafts come from the draft head, over explicit arguments (the model, the
//! slot registry and the planned sequences). Prompt-lookup drafts were
//! filled in at planning and take no round.
//!
//! Round r feeds each member's newest token (its decode token in round 0,
//! its previous draft after that) to the draft head in one call, then picks
//! each member's draft from its row: plain greedy members by one argmax
//! call over all of their rows (only ids leave the device), the others from
//! the sampler's draft distribution with the keyed uniform of the position
//! drafted (see [`super::spec`]). Each round's time and the rows it fed
//! go to the policy's cost model, but for a round whose CUDA graph was
//! captured (a one-off). Afterwards every drafting slot's target KV length
//! is back where it was, whatever happened.

use std::time::Instant;

use super::draft_heads::{DraftInput, HiddenContext};
use super::errors::{kv_err, model_err};
use super::policy::Drafter;
use super::sequences::Sequences;
use super::spec;
use super::work::Planned;
use super::EngineError;
use crate::model::{DraftLogits, Model};

/// Runs every draft round; on return each member's `drafts` holds what was
/// drafted (all members' rounds complete, or an error).
pub(crate) fn run_rounds(
    model: &Model,
    seqs: &mut Sequences,
    planned: &mut [Planned],
) -> Result<(), EngineError> {
    let rounds = planned
        .iter()
        .filter(|p| by_head(p))
        .map(|p| p.draft_budget)
        .max()
        .unwrap_or(0);
    let result = (0..rounds).try_for_each(|round| run_round(model, seqs, planned, round));
    let rolled_back = end_rounds(seqs, planned);
    result.and(rolled_back)
}

/// Whether `p` drafts with the head this step.
fn by_head(p: &Planned) -> bool {
    p.draft_budget > 0 && p.drafter == Drafter::Head
}

fn run_round(
    model: &Model,
    seqs: &mut Sequences,
    planned: &mut [Planned],
    round: usize,
) -> Result<(), EngineError> {
    let start = Instant::now();
    let members: Vec<usize> = (0..planned.len())
        .filter(|&i| by_head(&planned[i]) && planned[i].draft_budget > round)
        .collect();
    let inputs = members
        .iter()
        .map(|&i| round_input(seqs, &planned[i], round))
        .collect::<Result<Vec<_>, _>>()?;
    let prepared = start.elapsed();
    let head = seqs.head.as_mut().expect("drafting needs a head");
    let captures = head.graph_captures();
    let logits = head
        .draft_logits(model, &mut seqs.kv, &inputs)
        .map_err(model_err)?;
    let captured = head.graph_captures() != captures;
    let ran = start.elapsed();
    pick_drafts(seqs, planned, &members, round, &logits)?;
    let rows = inputs.iter().map(DraftInput::rows).sum();
    let time = start.elapsed();
    // Where a round's time goes: on a GPU the host waits for the device
    // only in `pick_us` (the drafts' read-back).
    tracing::debug!(
        round,
        rows,
        captured,
        inputs_us = micros(prepared),
        head_us = micros(ran - prepared),
        pick_us = micros(time - ran),
        "draft round"
    );
    if !captured {
        seqs.policy.cost_mut().record_round(rows, time);
    }
    Ok(())
}

fn round_input(seqs: &Sequences, p: &Planned, round: usize) -> Result<DraftInput, EngineError> {
    let context = if round == 0 && seqs.head_needs_hidden() {
        Some(hidden_context(seqs, p)?)
    } else {
        None
    };
    Ok(DraftInput {
        slot: p.slot,
        token: *p.drafts.tokens.last().unwrap_or(&p.tokens[0]),
        position: p.offset + round,
        round,
        context,
    })
}

/// Round 0's hidden context: the hidden states of the positions the head
/// has not consumed, from the KV cache, and the tokens that followed them.
fn hidden_context(seqs: &Sequences, p: &Planned) -> Result<HiddenContext, EngineError> {
    let slot_err = |what: String| EngineError::Model(format!("slot {}: {what}", p.slot));
    let seq = seqs.get(p.slot).ok_or(EngineError::UnknownSlot(p.slot))?;
    if seq.hidden_from >= p.offset {
        return Err(slot_err(format!(
            "no hidden state to draft from: the head consumed {} positions of {}",
            seq.hidden_from, p.offset
        )));
    }
    let hidden = seqs
        .kv
        .hidden(p.slot, seq.hidden_from, p.offset)
        .map_err(|e| kv_err(p.slot, e))?;
    let tokens = (seq.hidden_from + 1..p.offset)
        .map(|pos| seq.token_at(pos))
        .collect::<Option<Vec<u32>>>()
        .ok_or_else(|| slot_err("token history shorter than its hidden states".into()))?;
    Ok(HiddenContext { hidden, tokens })
}

/// Appends each member's draft of this round.
fn pick_drafts(
    seqs: &mut Sequences,
    planned: &mut [Planned],
    members: &[usize],
    round: usize,
    logits: &DraftLogits,
) -> Result<(), EngineError> {
    let plain_rows: Vec<usize> = (0..members.len())
        .filter(|&row| seqs.sampler.is_plain_greedy(planned[members[row]].slot))
        .collect();
    // Plain greedy drafts: one argmax over their rows, where the logits lie.
    let plain_ids = logits.argmax(&plain_rows).map_err(model_err)?;
    let mut plain = plain_rows.iter().zip(&plain_ids).peekable();
    for (row, &i) in members.iter().enumerate() {
        let p = &mut planned[i];
        if let Some((_, &token)) = plain.next_if(|(&r, _)| r == row) {
            p.drafts.tokens.push(token);
        } else {
            let greedy = seqs.get(p.slot).is_some_and(|s| s.sampling.is_greedy());
            let row_logits = logits.widened(row).map_err(model_err)?;
            let q = seqs
                .sampler
                .draft_distributions(p.slot, &row_logits, &p.drafts.tokens, round)?
                .remove(0);
            let token = spec::pick(&seqs.sampler, p.slot, greedy, &q, round)?;
            p.drafts.tokens.push(token);
        }
        if round == 0 && seqs.head_needs_hidden() {
            // The head consumed these pairs into its own KV.
            if let Ok(seq) = seqs.get_mut(p.slot) {
                seq.hidden_from = p.offset;
            }
        }
    }
    Ok(())
}

/// Puts every drafting slot's target KV back at its step offset and tells
/// the head its rounds are over.
fn end_rounds(seqs: &mut Sequences, planned: &[Planned]) -> Result<(), EngineError> {
    for p in planned.iter().filter(|p| by_head(p)) {
        seqs.kv
            .set_len(p.slot, p.offset)
            .map_err(|e| kv_err(p.slot, e))?;
        if let Some(head) = seqs.head.as_mut() {
            head.end_rounds(p.slot, p.offset).map_err(model_err)?;
        }
    }
    Ok(())
}

fn micros(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1e6
}
