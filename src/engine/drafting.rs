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
//! drafted (see [`super::spec`]). When every member drafts plain greedy
//! and the head can, its rounds are chained instead (by default off the
//! CPU only): each fed the previous round's argmax where it lies, the
//! drafts read back once at the end, so a GPU runs the rounds without a
//! host round trip each. Each round's time and the rows it fed go to the
//! policy's cost model, but for rounds during which a CUDA graph was
//! captured (a one-off). Afterwards every drafting slot's target KV
//! length is back where it was, whatever happened.

use std::time::{Duration, Instant};

use super::draft_heads::{DraftInput, HiddenContext};
use super::errors::{kv_err, model_err};
use super::policy::Drafter;
use super::sequences::Sequences;
use super::spec;
use super::work::Planned;
use super::EngineError;
use crate::engine::SlotId;
use crate::model::{DraftLogits, Model, ModelError};

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
    let chained = match rounds {
        0 => Ok(true),
        _ => run_greedy_rounds(model, seqs, planned),
    };
    let result = match chained {
        Ok(true) => Ok(()),
        Ok(false) => (0..rounds).try_for_each(|round| run_round(model, seqs, planned, round)),
        Err(e) => Err(e),
    };
    let rolled_back = end_rounds(seqs, planned);
    result.and(rolled_back)
}

/// Every round at once when chaining is on ([`SpecConfig::chain_rounds`]),
/// every member drafts plain greedy and the head can chain its rounds
/// ([`DraftHead::draft_greedy_rounds`]); false (nothing done) otherwise.
/// The rounds are timed as a whole (on a GPU the host does not wait
/// between them), each recorded at the whole's mean.
///
/// [`SpecConfig::chain_rounds`]: super::spec::SpecConfig::chain_rounds
/// [`DraftHead::draft_greedy_rounds`]: super::draft_heads::DraftHead::draft_greedy_rounds
fn run_greedy_rounds(
    model: &Model,
    seqs: &mut Sequences,
    planned: &mut [Planned],
) -> Result<bool, EngineError> {
    if !seqs.chain_rounds.unwrap_or(!model.device().is_cpu()) {
        return Ok(false);
    }
    let start = Instant::now();
    let members: Vec<usize> = (0..planned.len())
        .filter(|&i| by_head(&planned[i]))
        .collect();
    if !members
        .iter()
        .all(|&i| seqs.sampler.is_plain_greedy(planned[i].slot))
    {
        return Ok(false);
    }
    let inputs = members
        .iter()
        .map(|&i| round_input(seqs, &planned[i], 0))
        .collect::<Result<Vec<_>, _>>()?;
    let budgets: Vec<usize> = members.iter().map(|&i| planned[i].draft_budget).collect();
    let head = seqs.head.as_mut().expect("drafting needs a head");
    let captures = head.graph_captures();
    let drafts = match head.draft_greedy_rounds(model, &mut seqs.kv, &inputs, &budgets) {
        Ok(Some(drafts)) => drafts,
        Ok(None) => return Ok(false),
        Err(e) => return abandon_chain(seqs, &inputs, e),
    };
    let captured = head.graph_captures() != captures;
    for (&i, tokens) in members.iter().zip(drafts) {
        planned[i].drafts.tokens.extend(tokens);
        context_consumed(seqs, &planned[i]);
    }
    if !captured {
        record_chain(seqs, &inputs, &budgets, start.elapsed());
    }
    Ok(true)
}

/// Each round of a chain at the chain's mean time, with the rows it fed.
fn record_chain(seqs: &mut Sequences, inputs: &[DraftInput], budgets: &[usize], time: Duration) {
    let rounds = budgets.iter().copied().max().unwrap_or(1);
    let mean = time / rounds as u32;
    let first = inputs.iter().map(DraftInput::rows).sum();
    seqs.policy.cost_mut().record_round(first, mean);
    for round in 1..rounds {
        let rows = budgets.iter().filter(|&&b| b > round).count();
        seqs.policy.cost_mut().record_round(rows, mean);
    }
}

/// A chain failed: chaining is an optimisation, never a reason for a step
/// to fail (as a CUDA graph's capture is not), so the head forgets what
/// the chain wrote (back to the pairs it held before round 0, which the
/// chain's success alone would have marked consumed), chaining stays off
/// for this engine, and the rounds run one by one.
fn abandon_chain(
    seqs: &mut Sequences,
    inputs: &[DraftInput],
    error: ModelError,
) -> Result<bool, EngineError> {
    tracing::warn!("chained draft rounds off for this engine: {error}");
    seqs.chain_rounds = Some(false);
    let held: Vec<(SlotId, usize)> = inputs
        .iter()
        .map(|i| (i.slot, seqs.get(i.slot).map_or(0, |s| s.hidden_from)))
        .collect();
    let head = seqs.head.as_mut().expect("drafting needs a head");
    for (slot, len) in held {
        head.end_rounds(slot, len).map_err(model_err)?;
    }
    Ok(false)
}

/// Round 0 fed `p`'s pending pairs into a head that drafts from hidden
/// states: its own KV holds them now.
fn context_consumed(seqs: &mut Sequences, p: &Planned) {
    if seqs.head_needs_hidden() {
        if let Ok(seq) = seqs.get_mut(p.slot) {
            seq.hidden_from = p.offset;
        }
    }
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
    let head = seqs.head.as_mut().expect("drafting needs a head");
    let captures = head.graph_captures();
    let logits = head
        .draft_logits(model, &mut seqs.kv, &inputs)
        .map_err(model_err)?;
    let captured = head.graph_captures() != captures;
    pick_drafts(seqs, planned, &members, round, &logits)?;
    if !captured {
        let rows = inputs.iter().map(DraftInput::rows).sum();
        seqs.policy.cost_mut().record_round(rows, start.elapsed());
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
        if round == 0 {
            context_consumed(seqs, p);
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
