//! The verify and update phases of one sequence: its drafts judged against
//! the target's logits, then its step committed to every store (KV length,
//! sampler history, draft policy, pending hidden states) and the
//! end-of-sequence rule applied.

use candle_core::Tensor;

use super::errors::{kv_err, tensor_err};
use super::rows::SeqRows;
use super::sequences::Sequences;
use super::spec::{self, Verdict};
use super::work::Planned;
use super::{EngineError, EngineInfo, GeneratedToken, SeqFinish, SeqProgress, StepStats};
use crate::sampler::{SampleResult, TokenLogprobs, TokenMask};

/// What the pass produced for the sequences of one step.
pub(crate) struct StepResult<'a> {
    /// The verdict on this sequence's drafts, when it drafted.
    pub verdict: Option<Verdict>,
    /// The plain sampler call's result, when there was one.
    pub sampled: Option<&'a SampleResult>,
}

/// Judges `p`'s drafts against its logit rows, under its grammar's masks
/// (one per verified position) when it has a grammar. Commits nothing.
pub(crate) fn verify(
    seqs: &mut Sequences,
    p: &Planned,
    rows: &SeqRows,
    logits: &Tensor,
    masks: Option<&[TokenMask]>,
) -> Result<Verdict, EngineError> {
    let greedy = seqs
        .get(p.slot)
        .ok_or(EngineError::UnknownSlot(p.slot))?
        .sampling
        .is_greedy();
    let logits = logits
        .narrow(0, rows.logits.start, rows.logits.len())
        .map_err(tensor_err)?;
    #[cfg(debug_assertions)]
    let accept_all = seqs.accept_all;
    #[cfg(not(debug_assertions))]
    let accept_all = false;
    Ok(spec::verify(
        &mut seqs.sampler,
        p.slot,
        greedy,
        &logits,
        &p.drafts,
        masks,
        accept_all,
    )?)
}

/// Commits one sequence's step and applies the end-of-sequence rule.
pub(crate) fn update(
    seqs: &mut Sequences,
    info: &EngineInfo,
    p: &Planned,
    rows: &SeqRows,
    step: StepResult<'_>,
    stats: &mut StepStats,
) -> Result<SeqProgress, EngineError> {
    let mut progress = SeqProgress::default();
    let emitted = match (step.verdict, rows.sample) {
        (Some(v), _) => {
            let kept = commit_verdict(seqs, p, &v)?;
            progress.drafted = p.drafts.tokens.len();
            progress.accepted = v.accepted;
            stats.drafted += progress.drafted;
            stats.accepted += v.accepted;
            with_logprobs(kept, v.logprobs)
        }
        (None, Some(row)) => {
            let res = step.sampled.expect("a plain sampling row was sampled");
            let seq = seqs.get_mut(p.slot)?;
            let (logprob, top_logprobs) = res.for_row(row, &seq.sampling);
            vec![GeneratedToken {
                id: res.tokens[row],
                logprob,
                top_logprobs,
            }]
        }
        (None, None) => Vec::new(),
    };
    let seq = seqs.get_mut(p.slot)?;
    if !seq.prompt_done() {
        seq.prefilled += p.tokens.len();
        progress.prefilled = p.tokens.len();
        if seq.recompute == Some(seq.prefilled) {
            seq.recompute = None;
        }
    }
    let (emitted, grammar_done) = follow_grammar(seq, emitted, &info.eos_ids, p.slot)?;
    let (tokens, mut finish) = seq.append(emitted, &info.eos_ids, info.context_len);
    if finish.is_none() && grammar_done {
        finish = Some(SeqFinish::Eos);
    }
    progress.tokens = tokens;
    progress.finish = finish;
    Ok(progress)
}

/// Feeds `emitted` to the sequence's grammar, in order, up to the token
/// that completes it: what comes after (a bonus token past the end of an
/// accepted run, the EOS the finished grammar allows) is dropped, so MTP
/// on ends exactly where MTP off does. Returns the tokens kept and whether
/// the grammar is complete (the sequence then ends, finish reason `stop`).
fn follow_grammar(
    seq: &mut super::sequences::Sequence,
    mut emitted: Vec<GeneratedToken>,
    eos_ids: &[u32],
    slot: super::SlotId,
) -> Result<(Vec<GeneratedToken>, bool), EngineError> {
    let Some(grammar) = seq.grammar.as_mut() else {
        return Ok((emitted, false));
    };
    for (i, t) in emitted.iter().enumerate() {
        if eos_ids.contains(&t.id) || seq.stop_ids.contains(&t.id) {
            // The end of the sequence ends the grammar too.
            return Ok((emitted, false));
        }
        grammar.accept(t.id).map_err(|e| EngineError::Grammar {
            slot,
            reason: e.to_string(),
        })?;
        if grammar.is_finished() {
            emitted.truncate(i + 1);
            return Ok((emitted, true));
        }
    }
    Ok((emitted, false))
}

/// Keeps the accepted drafts and the target's next token in the KV cache,
/// the sampler's history and the draft policy.
fn commit_verdict(seqs: &mut Sequences, p: &Planned, v: &Verdict) -> Result<Vec<u32>, EngineError> {
    seqs.kv
        .commit(p.slot, 1 + v.accepted)
        .map_err(|e| kv_err(p.slot, e))?;
    let kept = v.kept(&p.drafts);
    seqs.sampler.commit(p.slot, &kept)?;
    seqs.policy
        .record(p.slot, p.drafter, p.drafts.tokens.len(), v.accepted);
    Ok(kept)
}

/// The kept tokens with their logprobs (none when the request did not ask).
fn with_logprobs(kept: Vec<u32>, logprobs: Vec<TokenLogprobs>) -> Vec<GeneratedToken> {
    let mut logprobs = logprobs.into_iter();
    kept.into_iter()
        .map(|id| match logprobs.next() {
            Some((logprob, top_logprobs)) => GeneratedToken {
                id,
                logprob: Some(logprob),
                top_logprobs,
            },
            None => GeneratedToken::bare(id),
        })
        .collect()
}
