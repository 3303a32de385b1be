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

mod block_accounting {
    //! The scheduler's block accounting under random traffic, against a
    //! model engine that follows the protocol (the tokens it reports are
    //! what the plan allowed) and checks every plan against the pool.

    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;
    use crate::engine::{SpecOptions, TableUpdate};

    #[derive(Debug, Clone)]
    enum Op {
        /// A request of `prompt` tokens from family `family` (shared prefixes).
        Submit {
            family: u32,
            prompt: usize,
            max_new: usize,
        },
        /// Cancel the `i`-th request submitted so far.
        Cancel { i: usize },
        /// One step; each decode keeps `accept` (mod its drafts + 1) drafts.
        Step { accept: usize },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u32..3, 1usize..50, 1usize..60).prop_map(|(family, prompt, max_new)| Op::Submit {
                family,
                prompt,
                max_new
            }),
            (0usize..32).prop_map(|i| Op::Cancel { i }),
            (0usize..8).prop_map(|accept| Op::Step { accept }),
            (0usize..8).prop_map(|accept| Op::Step { accept }),
            (0usize..8).prop_map(|accept| Op::Step { accept }),
        ]
    }

    /// The model engine's view of one slot.
    struct Eng {
        prompt: usize,
        kv: usize,
        generated: usize,
        max_new: usize,
        table: Vec<u32>,
    }

    fn drafting_info(blocks: usize) -> EngineInfo {
        EngineInfo {
            context_len: 256,
            vocab_size: 100,
            kv_capacity_tokens: blocks * 16,
            speculation: Some(SpecOptions::constant(3)),
            ..info()
        }
    }

    /// Checks a plan against the model engine and the pool, applies it,
    /// and returns the outcome a well-behaved engine would report.
    fn run(
        s: &SchedulerState,
        eng: &mut HashMap<SlotId, Eng>,
        plan: &StepPlan,
        accept: usize,
    ) -> StepOutcome {
        s.slots.pool().check();
        for slot in &plan.release {
            eng.remove(slot);
        }
        for slot in &plan.preempt {
            let e = eng.get_mut(slot).expect("preempted slot is registered");
            e.table.clear();
            e.kv = 0;
        }
        for a in &plan.admit {
            let crate::engine::KvGrant::Blocks {
                table,
                cached_tokens,
            } = &a.kv
            else {
                panic!("blocks expected");
            };
            eng.insert(
                a.slot,
                Eng {
                    prompt: a.prompt.len(),
                    kv: *cached_tokens,
                    generated: 0,
                    max_new: a.max_new_tokens,
                    table: table.clone(),
                },
            );
        }
        for r in &plan.resume {
            let e = eng.get_mut(&r.slot).unwrap();
            e.table = r.table.clone();
            e.kv = r.cached_tokens;
        }
        for TableUpdate { slot, table } in &plan.tables {
            eng.get_mut(slot).unwrap().table = table.clone();
        }
        // No block is in two live tables unless it is a shared full prefix
        // block below both sequences' KV length (never written again).
        let mut holders: HashMap<u32, Vec<SlotId>> = HashMap::new();
        for (&slot, e) in eng.iter() {
            for &b in &e.table {
                holders.entry(b).or_default().push(slot);
            }
        }
        for w in &plan.work {
            let e = &eng[&w.slot()];
            let end = e.kv + w.max_tokens();
            assert!(e.table.len() * 16 >= end, "slot {}: no room", w.slot());
            for pos in e.kv..end {
                let b = e.table[pos / 16];
                assert_eq!(
                    holders[&b],
                    vec![w.slot()],
                    "block {b} written while shared"
                );
            }
        }
        let mut seqs = Vec::new();
        for w in &plan.work {
            let e = eng.get_mut(&w.slot()).unwrap();
            let mut p = SeqProgress::default();
            match *w {
                SeqWork::Prefill { start, len, .. } => {
                    assert_eq!(start, e.kv);
                    e.kv += len;
                    p.prefilled = len;
                    if e.generated == 0 && e.kv == e.prompt {
                        p.tokens.push(tok(3));
                    }
                }
                SeqWork::Decode { max_drafts, .. } => {
                    let kept = (accept % (max_drafts + 1)).min(e.max_new - e.generated - 1);
                    e.kv += 1 + kept;
                    p.drafted = max_drafts;
                    p.accepted = kept;
                    p.tokens = (0..=kept).map(|_| tok(3)).collect();
                }
            }
            e.generated += p.tokens.len();
            if !p.tokens.is_empty() && e.generated >= e.max_new {
                p.finish = Some(SeqFinish::Length);
            }
            if p.finish.is_some() {
                eng.remove(&w.slot());
            }
            seqs.push(SeqOutcome {
                slot: w.slot(),
                result: Ok(p),
            });
        }
        outcome(plan.step, seqs)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]

        #[test]
        fn random_traffic_returns_the_pool_to_its_start(ops in proptest::collection::vec(op(), 1..80)) {
            let config = SchedulerConfig {
                max_seqs: 6,
                max_queue: 64,
                step_token_budget: 48,
                max_prefill_chunk: 16,
                prefix_caching: true,
            };
            let mut s = SchedulerState::new(&config, drafting_info(8));
            let mut eng: HashMap<SlotId, Eng> = HashMap::new();
            let mut ids = Vec::new();
            let mut out = Vec::new();
            let mut events: HashMap<RequestId, (usize, bool)> = HashMap::new();
            let step_events = |out: &mut Vec<SeqEvent>, events: &mut HashMap<RequestId, (usize, bool)>| {
                for e in out.drain(..) {
                    let id = e.id();
                    let entry = events.entry(id).or_insert((0, false));
                    assert!(!entry.1, "{id}: an event after its terminal one");
                    match e {
                        SeqEvent::Tokens { first_index, tokens, .. } => {
                            assert_eq!(first_index, entry.0, "{id}: tokens once, in order");
                            entry.0 += tokens.len();
                        }
                        e if e.is_terminal() => entry.1 = true,
                        _ => {}
                    }
                }
            };
            let drive = |s: &mut SchedulerState, eng: &mut HashMap<SlotId, Eng>, accept: usize, out: &mut Vec<SeqEvent>| {
                if let Some((plan, _)) = s.plan(Instant::now(), |_| true, out) {
                    let o = run(s, eng, &plan, accept);
                    s.apply_outcome(o, Instant::now(), out);
                }
            };
            for op in ops {
                match op {
                    Op::Submit { family, prompt, max_new } => {
                        let ids_: Vec<u32> = (0..prompt as u32).map(|i| 5 + (i * 7 + family * 13) % 90).collect();
                        let seq = super::super::super::validate::validate_seq(
                            ids_.into(),
                            crate::sampler::SamplingOptions::greedy(),
                            max_new,
                            None,
                            &drafting_info(8),
                        );
                        if let Ok(seq) = seq {
                            if let Ok(id) = s.submit(seq, Instant::now()) {
                                ids.push(id);
                            }
                        }
                    }
                    Op::Cancel { i } if !ids.is_empty() => {
                        let id = ids[i % ids.len()];
                        s.cancel(id, CancelReason::Client, Instant::now(), &mut out);
                    }
                    Op::Step { accept } => {
                        drive(&mut s, &mut eng, accept, &mut out);
                    }
                    _ => {}
                }
                step_events(&mut out, &mut events);
                s.slots.pool().check();
            }
            // Drain: everything ends, by length or not at all.
            let mut guard = 0;
            while !s.is_drained() {
                drive(&mut s, &mut eng, guard, &mut out);
                step_events(&mut out, &mut events);
                guard += 1;
                prop_assert!(guard < 5000, "the scheduler stalled");
            }
            for id in &ids {
                prop_assert!(events.get(id).is_some_and(|e| e.1), "{id} got no terminal event");
            }
            let pool = s.slots.pool();
            pool.check();
            prop_assert_eq!(pool.used(), 0);
            prop_assert_eq!(pool.available(), pool.num_blocks());
            prop_assert!(eng.is_empty(), "the engine still holds slots");
        }
    }
}

#[test]
fn a_group_is_queued_whole_or_not_at_all() {
    let mut s = state(2); // room: 8 queued + 2 free slots
    for _ in 0..7 {
        submit(&mut s, 3, 2);
    }
    let group = |n: usize| (0..n).map(|_| checked(20, 2)).collect::<Vec<_>>();
    let refused = s.submit_group(group(4), Instant::now());
    assert!(matches!(refused, Err(SchedulerError::Overloaded { .. })));
    assert_eq!(s.stats().queued, 7, "nothing of a refused group is queued");
    let ids = s.submit_group(group(3), Instant::now()).unwrap();
    assert_eq!(ids, vec![RequestId(7), RequestId(8), RequestId(9)]);
    let stats = s.stats();
    assert_eq!(
        (
            stats.queued,
            stats.requests_submitted,
            stats.requests_rejected
        ),
        (10, 10, 4)
    );
}
