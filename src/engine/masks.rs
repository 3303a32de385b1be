//! The mask phase: the grammar masks of the step's constrained sampling
//! rows, computed on a worker thread while the forward pass runs (as vLLM
//! and SGLang overlap them), split across sequences on a few scoped threads.
//! A drafting sequence gets one mask per verified position (before its
//! first draft, after each draft), for verification; [`truncate_drafts`]
//! first ends each draft run at the first draft its grammar forbids.
//!
//! # Ownership
//! Each constrained sequence's [`Grammar`] is *lent* to the worker for the
//! pass: [`lend`] takes it out of the slot registry, the worker computes
//! its mask, and [`give_back`] returns it before the sample phase, whatever
//! the pass's outcome. One owner at a time, no lock. A mask depends only on
//! the tokens generated before this step, which the engine knows when the
//! step starts, so the worker needs nothing from the pass.
//!
//! # Failure
//! A grammar that fails to give a mask fails its own sequence only
//! (`EngineError::Grammar`, reported after the pass); its row is sampled
//! unmasked and the token discarded.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::sequences::Sequences;
use super::work::Planned;
use super::SlotId;
use crate::sampler::TokenMask;
use crate::structured::Grammar;

/// The most threads one step's masks are split across. llguidance takes
/// tens of microseconds to a millisecond per mask; more threads would only
/// take cores from the forward pass running beside them.
const MAX_MASK_THREADS: usize = 4;

/// Grammars lent for one pass, in plan order, with the drafts each one's
/// masks run along.
pub(crate) type Lent = Vec<(SlotId, Grammar, Vec<u32>)>;

/// The masks of one step.
#[derive(Debug, Default)]
pub(crate) struct StepMasks {
    /// Per constrained sequence, the mask of each position it samples or
    /// verifies (one for a plain decode, drafts + 1 when drafting).
    pub by_slot: HashMap<SlotId, Vec<TokenMask>>,
    /// Sequences whose grammar failed, with the reason.
    pub failed: HashMap<SlotId, String>,
    /// The worker's wall time.
    pub took: Duration,
}

impl StepMasks {
    /// The mask of each of `slots` (the sampler call's rows), or an empty
    /// list when no row has one.
    pub fn for_rows(&self, slots: &[SlotId]) -> Vec<Option<&TokenMask>> {
        if self.by_slot.is_empty() {
            return Vec::new();
        }
        slots
            .iter()
            .map(|s| self.by_slot.get(s).and_then(|m| m.first()))
            .collect()
    }
}

/// Ends each constrained sequence's draft run before the first draft its
/// grammar forbids (the rest could never be accepted).
pub(crate) fn truncate_drafts(seqs: &mut Sequences, planned: &mut [Planned]) {
    for p in planned.iter_mut().filter(|p| !p.drafts.tokens.is_empty()) {
        let Some(grammar) = seqs.get_mut(p.slot).ok().and_then(|s| s.grammar.as_mut()) else {
            continue;
        };
        let valid = grammar.valid_prefix(&p.drafts.tokens);
        p.drafts.tokens.truncate(valid);
    }
}

/// Takes the grammars of the planned sequences that sample this step.
pub(crate) fn lend(seqs: &mut Sequences, planned: &[Planned]) -> Lent {
    planned
        .iter()
        .filter(|p| p.samples)
        .filter_map(|p| {
            let grammar = seqs.get_mut(p.slot).ok()?.grammar.take()?;
            Some((p.slot, grammar, p.drafts.tokens.clone()))
        })
        .collect()
}

/// Returns lent grammars to their sequences.
pub(crate) fn give_back(seqs: &mut Sequences, lent: Lent) {
    for (slot, grammar, _) in lent {
        if let Ok(seq) = seqs.get_mut(slot) {
            seq.grammar = Some(grammar);
        }
    }
}

/// Computes every lent grammar's mask (`eos_ids` allowed wherever the
/// grammar may end), split in contiguous chunks across scoped threads.
pub(crate) fn compute(lent: &mut Lent, eos_ids: &[u32]) -> StepMasks {
    let start = Instant::now();
    let threads = lent.len().clamp(1, MAX_MASK_THREADS);
    let chunk = lent.len().div_ceil(threads).max(1);
    let results: Vec<(SlotId, Result<Vec<TokenMask>, String>)> = if threads == 1 {
        lent.iter_mut().map(|job| mask_one(job, eos_ids)).collect()
    } else {
        std::thread::scope(|s| {
            let handles: Vec<_> = lent
                .chunks_mut(chunk)
                .map(|jobs| {
                    s.spawn(move || {
                        jobs.iter_mut()
                            .map(|job| mask_one(job, eos_ids))
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            handles
                .into_iter()
                .flat_map(|h| match h.join() {
                    Ok(r) => r,
                    // A panic inside llguidance is a bug there, not bad input.
                    Err(payload) => std::panic::resume_unwind(payload),
                })
                .collect()
        })
    };
    let mut out = StepMasks::default();
    for (slot, result) in results {
        match result {
            Ok(masks) => {
                out.by_slot.insert(slot, masks);
            }
            Err(reason) => {
                out.failed.insert(slot, reason);
            }
        }
    }
    out.took = start.elapsed();
    out
}

fn mask_one(
    job: &mut (SlotId, Grammar, Vec<u32>),
    eos_ids: &[u32],
) -> (SlotId, Result<Vec<TokenMask>, String>) {
    let (slot, grammar, drafts) = job;
    let masks = grammar.masks_along(drafts, eos_ids);
    (*slot, masks.map_err(|e| e.to_string()))
}
