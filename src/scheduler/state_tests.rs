//! Transitions of the pure scheduling core, driven by hand-written outcomes.

use std::time::{Duration, Instant};

use super::*;
use crate::engine::{EngineError, GeneratedToken, StepStats};

fn info() -> EngineInfo {
    EngineInfo {
        model_name: "test".into(),
        context_len: 64,
        vocab_size: 100,
        eos_ids: vec![0],
        kv_capacity_tokens: 1000,
        speculation: None,
        kv_block_size: 16,
        draft_needs_hidden: false,
    }
}

fn state(max_seqs: usize) -> SchedulerState {
    let config = SchedulerConfig {
        max_seqs,
        max_queue: 8,
        step_token_budget: 16,
        max_prefill_chunk: 8,
        prefix_caching: true,
    };
    SchedulerState::new(&config, info())
}

/// A greedy request of `prompt_len` tokens, checked against `info()`.
fn checked(prompt_len: usize, max_new: usize) -> ValidSeq {
    let sampling = crate::sampler::SamplingOptions::greedy();
    super::super::validate::validate_seq(
        vec![5u32; prompt_len].into(),
        sampling,
        max_new,
        None,
        &info(),
    )
    .expect("valid request")
}

fn submit(s: &mut SchedulerState, prompt_len: usize, max_new: usize) -> RequestId {
    s.submit(checked(prompt_len, max_new), Instant::now())
        .expect("room in the queue")
}

fn plan(s: &mut SchedulerState, out: &mut Vec<SeqEvent>) -> StepPlan {
    s.plan(Instant::now(), |_| true, out)
        .expect("work to plan")
        .0
}

fn tok(id: u32) -> GeneratedToken {
    GeneratedToken {
        id,
        logprob: None,
        top_logprobs: Vec::new(),
    }
}

fn progress(
    slot: SlotId,
    prefilled: usize,
    tokens: &[u32],
    finish: Option<SeqFinish>,
) -> SeqOutcome {
    SeqOutcome {
        slot,
        result: Ok(SeqProgress {
            prefilled,
            tokens: tokens.iter().map(|&t| tok(t)).collect(),
            finish,
            ..Default::default()
        }),
    }
}

fn outcome(step: u64, seqs: Vec<SeqOutcome>) -> StepOutcome {
    StepOutcome {
        step,
        seqs,
        stats: StepStats {
            total: Duration::from_millis(1),
            uniform_calls: 1,
            ..StepStats::default()
        },
    }
}

#[test]
fn request_runs_to_length_with_indexed_tokens() {
    let mut s = state(2);
    let mut out = Vec::new();
    let id = submit(&mut s, 4, 2);
    let p0 = plan(&mut s, &mut out);
    let slot = p0.admit[0].slot;
    assert_eq!(
        p0.work,
        vec![SeqWork::Prefill {
            slot,
            start: 0,
            len: 4
        }]
    );
    assert!(matches!(out[..], [SeqEvent::Started { id: i, .. }] if i == id));
    out.clear();
    s.apply_outcome(
        outcome(0, vec![progress(slot, 4, &[7], None)]),
        Instant::now(),
        &mut out,
    );
    let p1 = plan(&mut s, &mut out);
    assert_eq!(
        p1.work,
        vec![SeqWork::Decode {
            slot,
            max_drafts: 0
        }]
    );
    s.apply_outcome(
        outcome(1, vec![progress(slot, 0, &[8], Some(SeqFinish::Length))]),
        Instant::now(),
        &mut out,
    );
    let indices: Vec<usize> = out
        .iter()
        .filter_map(|e| match e {
            SeqEvent::Tokens { first_index, .. } => Some(*first_index),
            _ => None,
        })
        .collect();
    assert_eq!(indices, vec![0, 1]);
    match out.last() {
        Some(SeqEvent::Finished { reason, usage, .. }) => {
            assert_eq!(*reason, FinishReason::Length);
            assert_eq!((usage.prompt_tokens, usage.completion_tokens), (4, 2));
        }
        other => panic!("expected Finished, got {other:?}"),
    }
    let st = s.stats();
    assert_eq!(
        (st.running, st.free_slots, st.kv_reserved_tokens),
        (0, 2, 0)
    );
    assert_eq!((st.prompt_tokens_processed, st.tokens_generated), (4, 2));
    assert!(s.plan(Instant::now(), |_| true, &mut out).is_none(), "idle");
}

#[test]
fn cancel_while_running_discards_late_tokens_and_releases_next_plan() {
    let mut s = state(1);
    let mut out = Vec::new();
    let a = submit(&mut s, 2, 10);
    let b = submit(&mut s, 2, 10);
    let slot = plan(&mut s, &mut out).admit[0].slot;
    out.clear();
    assert!(s.cancel(a, CancelReason::StopString, Instant::now(), &mut out));
    assert!(
        !s.cancel(a, CancelReason::Client, Instant::now(), &mut out),
        "idempotent"
    );
    assert!(matches!(
        out[..],
        [SeqEvent::Finished {
            reason: FinishReason::Stop,
            ..
        }]
    ));
    out.clear();
    // The in-flight step's token for the cancelled slot is dropped.
    s.apply_outcome(
        outcome(0, vec![progress(slot, 2, &[9], None)]),
        Instant::now(),
        &mut out,
    );
    assert!(out.is_empty(), "no event after the terminal one: {out:?}");
    let p1 = plan(&mut s, &mut out);
    assert_eq!(p1.release, vec![slot]);
    assert!(p1.admit.is_empty(), "b must wait for the release to go out");
    assert_eq!(s.stats().kv_reserved_tokens, 0);
    s.apply_outcome(outcome(1, vec![]), Instant::now(), &mut out);
    let p2 = plan(&mut s, &mut out);
    assert_eq!(p2.admit[0].slot, slot);
    assert!(matches!(out.last(), Some(SeqEvent::Started { id, .. }) if *id == b));
}

#[test]
fn engine_finish_of_a_cancelled_slot_skips_the_release() {
    let mut s = state(1);
    let mut out = Vec::new();
    let a = submit(&mut s, 2, 1);
    let slot = plan(&mut s, &mut out).admit[0].slot;
    s.cancel(a, CancelReason::Client, Instant::now(), &mut out);
    s.apply_outcome(
        outcome(0, vec![progress(slot, 2, &[9], Some(SeqFinish::Length))]),
        Instant::now(),
        &mut out,
    );
    assert_eq!(s.stats().free_slots, 1);
    assert!(
        s.plan(Instant::now(), |_| true, &mut out).is_none(),
        "no release needed"
    );
}

#[test]
fn engine_error_fails_only_that_request() {
    let mut s = state(2);
    let mut out = Vec::new();
    let a = submit(&mut s, 2, 5);
    let b = submit(&mut s, 2, 5);
    let p = plan(&mut s, &mut out);
    let (sa, sb) = (p.admit[0].slot, p.admit[1].slot);
    out.clear();
    let failed = SeqOutcome {
        slot: sa,
        result: Err(EngineError::Model("boom".into())),
    };
    s.apply_outcome(
        outcome(0, vec![failed, progress(sb, 2, &[3], None)]),
        Instant::now(),
        &mut out,
    );
    assert!(
        matches!(&out[0], SeqEvent::Failed { id, error: SchedulerError::Engine(_) } if *id == a)
    );
    assert!(matches!(&out[1], SeqEvent::Tokens { id, .. } if *id == b));
    let p1 = plan(&mut s, &mut out);
    assert!(
        p1.release.is_empty(),
        "the engine already dropped a failed slot"
    );
    assert_eq!(
        p1.work,
        vec![SeqWork::Decode {
            slot: sb,
            max_drafts: 0
        }]
    );
    assert_eq!(s.stats().requests_failed, 1);
}

#[test]
fn missing_outcome_and_runaway_are_protocol_errors() {
    let mut s = state(2);
    let mut out = Vec::new();
    submit(&mut s, 2, 1);
    submit(&mut s, 2, 1);
    let p = plan(&mut s, &mut out);
    let (sa, sb) = (p.admit[0].slot, p.admit[1].slot);
    out.clear();
    // sa: no entry at all; sb: reaches max_new_tokens without a finish.
    s.apply_outcome(
        outcome(0, vec![progress(sb, 2, &[4], None)]),
        Instant::now(),
        &mut out,
    );
    let protocol = out
        .iter()
        .filter(|e| {
            matches!(
                e,
                SeqEvent::Failed {
                    error: SchedulerError::Protocol { .. },
                    ..
                }
            )
        })
        .count();
    assert_eq!(protocol, 2, "{out:?}");
    let p1 = plan(&mut s, &mut out);
    let mut released = p1.release.clone();
    released.sort();
    assert_eq!(released, vec![sa.min(sb), sa.max(sb)]);
}

#[test]
fn fail_all_and_stop_accepting() {
    let mut s = state(1);
    let mut out = Vec::new();
    submit(&mut s, 2, 5);
    submit(&mut s, 2, 5);
    plan(&mut s, &mut out);
    out.clear();
    s.fail_all(SchedulerError::EngineGone, &mut out);
    assert_eq!(out.len(), 2);
    assert!(out.iter().all(|e| matches!(
        e,
        SeqEvent::Failed {
            error: SchedulerError::EngineGone,
            ..
        }
    )));
    assert!(s.is_drained() && !s.plan_in_flight());
    let err = s.submit(checked(1, 1), Instant::now());
    assert_eq!(err, Err(SchedulerError::EngineGone));
}
