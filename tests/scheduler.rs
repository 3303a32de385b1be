//! End-to-end tests of the scheduler actor against a deterministic fake
//! engine (tests/support): routing, cancellation, admission, errors, chunked
//! prefill, dropped requesters and shutdown.

mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tandem::engine::SeqWork;
use tandem::sampler::{SamplerError, SamplingOptions};
use tandem::scheduler::{
    Cancel, CancelReason, FinishReason, RequestId, SchedulerConfig, SchedulerError, SeqEvent,
    SeqRequest, Shutdown, ShutdownMode, Stats, Submit, Usage,
};

use support::*;

#[actix::test]
async fn sixteen_concurrent_requests_get_exactly_their_tokens() {
    let settings = FakeSettings::default();
    let ctx = settings.context_len;
    let (addr, probe) = start(settings, config(8, 16, 64, 32));
    let (col, mut rx) = collector();
    let mut specs: Vec<(Arc<[u32]>, usize)> = (0..16u32)
        .map(|i| {
            (
                prompt(i, 1 + (i as usize * 37) % 300),
                5 + (i as usize * 7) % 40,
            )
        })
        .collect();
    // One request ends by EOS at its 4th token.
    specs[5].0 = [EOS_MARKER, 3, 9, 9, 9].into();
    let ids = join_all(
        specs
            .iter()
            .map(|(p, n)| addr.send(submit(p.clone(), *n, &col))),
    )
    .await;
    let by = by_id(collect_terminals(&mut rx, 16, WAIT).await);
    assert_eq!(by.len(), 16);
    let mut want_generated = 0;
    for (id, (p, n)) in ids.into_iter().zip(&specs) {
        let id = id.expect("mailbox").expect("valid request");
        let s = check_stream(&by[&id]);
        let (tokens, reason) = expected(p, *n, ctx);
        assert!(s.started);
        assert_eq!(s.tokens, tokens, "{id}");
        let usage = Usage {
            prompt_tokens: p.len(),
            completion_tokens: tokens.len(),
            ..Usage::default()
        };
        assert_eq!(s.end, End::Finished(reason, usage), "{id}");
        want_generated += tokens.len() as u64;
    }
    assert!(matches!(
        check_stream(&by[&RequestId(5)]).end,
        End::Finished(FinishReason::Eos, _)
    ));
    let st = wait_until(&addr, "idle", |s| s.running == 0).await;
    assert_no_leaks(&st);
    let prompt_total: usize = specs.iter().map(|(p, _)| p.len()).sum();
    assert_eq!(st.prompt_tokens_processed, prompt_total as u64);
    assert_eq!(st.tokens_generated, want_generated);
    assert_eq!(st.requests_finished, 16);
    assert!(
        st.max_seqs_per_step <= 8 && st.max_seqs_per_step >= 4,
        "{st:#?}"
    );
    assert_eq!(st.steps as usize, probe.plan_count());
    assert_eq!(st.metrics.time_to_first_token.count, 16);
    assert!(probe.plans().iter().all(|p| plan_tokens(p) <= 64));
}

#[actix::test]
async fn sixty_four_requests_with_random_cancellations_deliver_each_event_once() {
    let mut rng = ChaCha8Rng::seed_from_u64(0x7a4d_2026);
    let settings = FakeSettings {
        step_delay: Duration::from_micros(100),
        ..FakeSettings::default()
    };
    let ctx = settings.context_len;
    let (addr, probe) = start(settings, config(16, 64, 128, 64));
    let (col, mut rx) = collector();
    let specs: Vec<(Arc<[u32]>, usize)> = (0..64u32)
        .map(|i| {
            (
                prompt(i, rng.random_range(1..=200)),
                rng.random_range(1..=60),
            )
        })
        .collect();
    let ids: Vec<RequestId> = join_all(
        specs
            .iter()
            .map(|(p, n)| addr.send(submit(p.clone(), *n, &col))),
    )
    .await
    .into_iter()
    .map(|r| r.expect("mailbox").expect("valid"))
    .collect();
    let mut cancels: Vec<(u64, usize, CancelReason)> = Vec::new();
    for i in 0..64 {
        if rng.random_bool(0.4) {
            let reason = if rng.random_bool(0.5) {
                CancelReason::Client
            } else {
                CancelReason::StopString
            };
            cancels.push((rng.random_range(0..4000), i, reason));
        }
    }
    cancels.sort_by_key(|c| (c.0, c.1));
    let t0 = Instant::now();
    let mut outcome = [None; 64];
    for &(at_us, i, reason) in &cancels {
        let at = t0 + Duration::from_micros(at_us);
        tokio::time::sleep(at.saturating_duration_since(Instant::now())).await;
        let ended = addr
            .send(Cancel { id: ids[i], reason })
            .await
            .expect("mailbox");
        let again = addr
            .send(Cancel { id: ids[i], reason })
            .await
            .expect("mailbox");
        assert!(!again, "cancel must be idempotent");
        outcome[i] = Some((ended, reason));
    }
    let by = by_id(collect_terminals(&mut rx, 64, WAIT).await);
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert!(
        rx.try_recv().is_err(),
        "an event arrived after every request ended"
    );
    let mut cancelled = 0;
    for (i, (p, n)) in specs.iter().enumerate() {
        let s = check_stream(&by[&ids[i]]);
        let (tokens, reason) = expected(p, *n, ctx);
        match outcome[i] {
            Some((true, why)) => {
                let want = match why {
                    CancelReason::Client => FinishReason::Cancelled,
                    CancelReason::StopString => FinishReason::Stop,
                };
                assert!(
                    matches!(s.end, End::Finished(r, _) if r == want),
                    "{:?}",
                    s.end
                );
                assert!(
                    tokens.starts_with(&s.tokens),
                    "cancelled stream is a prefix"
                );
                cancelled += usize::from(why == CancelReason::Client);
            }
            _ => {
                assert_eq!(s.tokens, tokens, "request {i}");
                assert!(matches!(s.end, End::Finished(r, _) if r == reason));
            }
        }
    }
    assert!(
        cancels
            .iter()
            .filter(|c| outcome[c.1].is_some_and(|o| o.0))
            .count()
            >= 5,
        "the schedule should cancel a fair number of live requests"
    );
    let st = wait_until(&addr, "all slots free", |s| s.running + s.releasing == 0).await;
    assert_no_leaks(&st);
    assert_eq!(st.requests_cancelled as usize, cancelled);
    assert_eq!((st.requests_finished + st.requests_cancelled) as usize, 64);
    // The engine got every release too.
    let deadline = Instant::now() + WAIT;
    while probe.registered() > 0 || probe.kv_used() > 0 {
        assert!(
            Instant::now() < deadline,
            "engine still holds {} slots",
            probe.registered()
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

#[actix::test]
async fn cancel_frees_slot_and_kv_for_the_waiting_request() {
    let (addr, probe) = start(FakeSettings::default(), config(1, 4, 16, 16));
    let (col, mut rx) = collector();
    let _gate = probe.pause();
    let a = addr
        .send(submit(prompt(1, 10), 1000, &col))
        .await
        .unwrap()
        .unwrap();
    wait_plans(&probe, 1).await;
    let slot = probe.plans()[0].admit[0].slot;
    let b_prompt = prompt(2, 5);
    let b = addr
        .send(submit(b_prompt.clone(), 3, &col))
        .await
        .unwrap()
        .unwrap();
    let s = stats(&addr).await;
    // One block for A's 10-token prompt, not its worst case of 1010.
    assert_eq!(
        (s.running, s.queued, s.free_slots, s.kv_reserved_tokens),
        (1, 1, 0, 16)
    );

    assert!(addr
        .send(Cancel {
            id: a,
            reason: CancelReason::Client
        })
        .await
        .unwrap());
    // Ended at once, but the engine still holds the slot until a release.
    let s = stats(&addr).await;
    assert_eq!((s.running, s.releasing, s.kv_reserved_tokens), (0, 1, 16));

    probe.allow(1);
    wait_plans(&probe, 2).await;
    let release_plan = &probe.plans()[1];
    assert_eq!(release_plan.release, vec![slot]);
    assert!(
        release_plan.admit.is_empty(),
        "never admitted alongside its own release"
    );
    let s = wait_until(&addr, "release sent", |s| s.releasing == 0).await;
    assert_eq!((s.free_slots, s.kv_reserved_tokens, s.queued), (1, 0, 1));

    probe.allow(1);
    wait_plans(&probe, 3).await;
    assert_eq!(
        probe.plans()[2].admit[0].slot,
        slot,
        "B takes the freed slot"
    );
    let s = wait_until(&addr, "B admitted", |s| s.running == 1).await;
    assert_eq!((s.queued, s.kv_reserved_tokens), (0, 16));

    probe.resume();
    let by = by_id(collect_terminals(&mut rx, 2, WAIT).await);
    let sa = check_stream(&by[&a]);
    assert!(
        sa.started && sa.tokens.is_empty(),
        "A's in-flight token is discarded"
    );
    let usage = Usage {
        prompt_tokens: 10,
        completion_tokens: 0,
        ..Usage::default()
    };
    assert_eq!(sa.end, End::Finished(FinishReason::Cancelled, usage));
    let (tokens, reason) = expected(&b_prompt, 3, 8192);
    let sb = check_stream(&by[&b]);
    assert_eq!(
        (sb.tokens, sb.end),
        (
            tokens,
            End::Finished(
                reason,
                Usage {
                    prompt_tokens: 5,
                    completion_tokens: 3,
                    ..Usage::default()
                }
            )
        )
    );
    assert_no_leaks(&wait_until(&addr, "idle", |s| s.running == 0).await);
}

#[actix::test]
async fn overload_and_invalid_requests_get_typed_errors_without_disturbing_others() {
    let settings = FakeSettings {
        context_len: 256,
        kv_capacity_tokens: 200,
        ..FakeSettings::default()
    };
    let (addr, probe) = start(settings, config(1, 2, 16, 16));
    let (col, mut rx) = collector();
    let _gate = probe.pause();
    let valid: Vec<(Arc<[u32]>, usize)> =
        vec![(prompt(1, 10), 20), (prompt(2, 3), 4), (prompt(3, 7), 5)];
    let mut ids = Vec::new();
    for (i, (p, n)) in valid.iter().enumerate() {
        ids.push(
            addr.send(submit(p.clone(), *n, &col))
                .await
                .unwrap()
                .unwrap(),
        );
        if i == 0 {
            wait_plans(&probe, 1).await; // A runs (held in the engine)
        }
    }
    let send = |p: Arc<[u32]>, n: usize, sampling: SamplingOptions| {
        addr.send(Submit(SeqRequest {
            spec: None,
            prompt: p,
            sampling,
            max_new_tokens: n,
            events: col.clone().recipient(),
        }))
    };
    let greedy = SamplingOptions::greedy();
    let overloaded = send(prompt(4, 3), 3, greedy).await.unwrap();
    assert_eq!(
        overloaded,
        Err(SchedulerError::Overloaded {
            queued: 2,
            limit: 2
        })
    );
    assert_eq!(overloaded.unwrap_err().error_type(), "overloaded");

    let cases: Vec<(Arc<[u32]>, usize, SamplingOptions, SchedulerError)> = vec![
        (Arc::from([]), 5, greedy, SchedulerError::EmptyPrompt),
        (
            prompt(5, 256),
            5,
            greedy,
            SchedulerError::PromptTooLong {
                len: 256,
                context_len: 256,
            },
        ),
        (prompt(6, 4), 0, greedy, SchedulerError::ZeroMaxNewTokens),
        (
            prompt(7, 4),
            5,
            SamplingOptions {
                top_k: -1,
                ..greedy
            },
            SchedulerError::Sampling(SamplerError::InvalidOption {
                field: "top_k",
                reason: "must be >= 0, got -1".into(),
            }),
        ),
        (
            [2, 3, 1000, 4].into(),
            5,
            greedy,
            SchedulerError::TokenOutOfVocab {
                index: 2,
                token: 1000,
                vocab_size: 1000,
            },
        ),
        (
            prompt(8, 100),
            150,
            greedy,
            SchedulerError::ExceedsKvCapacity {
                needed: 250,
                capacity: 200,
            },
        ),
    ];
    for (p, n, sampling, want) in cases {
        let got = send(p, n, sampling).await.unwrap();
        assert_eq!(got.as_ref().err(), Some(&want));
        assert!(want.is_invalid_request(), "{want}");
    }
    let s = stats(&addr).await;
    assert_eq!(
        (
            s.running,
            s.queued,
            s.requests_submitted,
            s.requests_rejected
        ),
        (1, 2, 3, 7)
    );

    probe.resume();
    let by = by_id(collect_terminals(&mut rx, 3, WAIT).await);
    assert_eq!(by.len(), 3, "refused requests get no events");
    for (id, (p, n)) in ids.iter().zip(&valid) {
        let (tokens, reason) = expected(p, *n, 256);
        let s = check_stream(&by[id]);
        assert_eq!(s.tokens, tokens);
        assert!(matches!(s.end, End::Finished(r, _) if r == reason));
    }
    assert_no_leaks(&wait_until(&addr, "idle", |s| s.running == 0).await);
}

#[actix::test]
async fn an_engine_error_fails_only_its_request() {
    let (addr, probe) = start(FakeSettings::default(), config(4, 8, 64, 32));
    probe.fail_prompt(777, 3);
    let (col, mut rx) = collector();
    let mut specs: Vec<(Arc<[u32]>, usize)> = (0..4u32)
        .map(|i| (prompt(i + 10, 20 + i as usize), 12))
        .collect();
    assert!(specs.iter().all(|(p, _)| p[0] != 777));
    specs[2].0 = [777, 5, 6, 7].into();
    let ids: Vec<RequestId> = join_all(
        specs
            .iter()
            .map(|(p, n)| addr.send(submit(p.clone(), *n, &col))),
    )
    .await
    .into_iter()
    .map(|r| r.unwrap().unwrap())
    .collect();
    let by = by_id(collect_terminals(&mut rx, 4, WAIT).await);
    for (i, (id, (p, n))) in ids.iter().zip(&specs).enumerate() {
        let s = check_stream(&by[id]);
        let (tokens, reason) = expected(p, *n, 8192);
        if i == 2 {
            assert_eq!(s.tokens, tokens[..3], "tokens before the failure are kept");
            assert!(
                matches!(&s.end, End::Failed(e) if e.contains("injected failure")),
                "{:?}",
                s.end
            );
        } else {
            assert_eq!(s.tokens, tokens);
            assert_eq!(
                s.end,
                End::Finished(
                    reason,
                    Usage {
                        prompt_tokens: p.len(),
                        completion_tokens: *n,
                        ..Usage::default()
                    }
                )
            );
        }
    }
    let st = wait_until(&addr, "idle", |s| s.running == 0).await;
    assert_no_leaks(&st);
    assert_eq!((st.requests_failed, st.requests_finished), (1, 3));
    assert_eq!(probe.registered(), 0);
    assert!(
        probe.plans().iter().all(|p| p.release.is_empty()),
        "the engine freed the failed slot itself"
    );
}

#[actix::test]
async fn long_prompt_prefills_in_chunks_alongside_decodes_and_short_prompts() {
    const BUDGET: usize = 512;
    const CHUNK: usize = 256;
    let (addr, probe) = start(FakeSettings::default(), config(8, 8, BUDGET, CHUNK));
    let (col, mut rx) = collector();
    let _gate = probe.pause();
    // C: a stream already decoding. L: a 4 000-token prompt. S: a short one.
    let c = addr
        .send(submit(prompt(1, 8), 200, &col))
        .await
        .unwrap()
        .unwrap();
    wait_plans(&probe, 1).await;
    probe.allow(1);
    wait_plans(&probe, 2).await; // C decodes in plan 1
    let long = prompt(2, 4000);
    let l = addr
        .send(submit(long.clone(), 4, &col))
        .await
        .unwrap()
        .unwrap();
    probe.allow(1);
    wait_plans(&probe, 3).await; // plan 2 admits L
    let s_prompt = prompt(3, 10);
    let s = addr
        .send(submit(s_prompt.clone(), 4, &col))
        .await
        .unwrap()
        .unwrap();
    probe.resume();
    let events = collect_terminals(&mut rx, 3, WAIT).await;

    let plans = probe.plans();
    let slot_of = |len: usize| {
        plans
            .iter()
            .flat_map(|p| p.admit.iter().map(move |a| (p.step, a)))
            .find(|(_, a)| a.prompt.len() == len)
            .map(|(step, a)| (step, a.slot))
            .expect("admitted")
    };
    let (c_admit, c_slot) = slot_of(8);
    let (l_admit, l_slot) = slot_of(4000);
    let (s_admit, s_slot) = slot_of(10);
    assert_eq!((c_admit, l_admit), (0, 2));
    for p in &plans {
        assert!(
            plan_tokens(p) <= BUDGET,
            "step {} has {} tokens",
            p.step,
            plan_tokens(p)
        );
    }
    // L's chunks: contiguous, each within the chunk limit, covering the prompt.
    let mut next = 0;
    let mut l_last_chunk_step = 0;
    for p in &plans {
        for w in &p.work {
            if let SeqWork::Prefill { slot, start, len } = *w {
                if slot == l_slot && p.step >= l_admit {
                    assert_eq!(start, next, "L's chunks must be contiguous");
                    assert!(len <= CHUNK);
                    next += len;
                    l_last_chunk_step = p.step;
                }
            }
        }
    }
    assert_eq!(next, 4000);
    // S's prompt ends (first token) within 3 steps of its admission, while L
    // is still prefilling.
    let s_first = plans
        .iter()
        .find(|p| p.work.iter().any(|w| matches!(*w, SeqWork::Prefill { slot, start, len } if slot == s_slot && start + len == 10)))
        .map(|p| p.step)
        .expect("S prefilled");
    assert!(
        s_first >= s_admit && s_first - s_admit <= 2,
        "admitted {s_admit}, first token {s_first}"
    );
    assert!(
        l_last_chunk_step > s_first + 5,
        "L was still prefilling (last chunk {l_last_chunk_step})"
    );
    // C decodes in every step while L prefills: never frozen.
    for p in plans
        .iter()
        .filter(|p| p.step >= l_admit && p.step <= l_last_chunk_step)
    {
        assert!(
            p.work.contains(&SeqWork::Decode {
                slot: c_slot,
                max_drafts: 0
            }),
            "C skipped in step {}",
            p.step
        );
    }
    // S's first token reaches its requester before L's.
    let first_tokens: Vec<RequestId> = events
        .iter()
        .filter(|e| matches!(e, SeqEvent::Tokens { first_index: 0, .. }))
        .map(|e| e.id())
        .collect();
    assert_eq!(first_tokens, vec![c, s, l]);
    let by = by_id(events);
    assert_eq!(check_stream(&by[&l]).tokens, expected(&long, 4, 8192).0);
    assert_eq!(check_stream(&by[&s]).tokens, expected(&s_prompt, 4, 8192).0);
}

#[actix::test]
async fn a_dropped_requester_is_cancelled_and_its_slot_freed() {
    let (addr, probe) = start(FakeSettings::default(), config(1, 4, 16, 16));
    let (c1, mut rx1) = collector();
    let (c2, mut rx2) = collector();
    let (c3, mut rx3) = collector();
    let _gate = probe.pause();
    addr.send(submit(prompt(1, 6), 50, &c1))
        .await
        .unwrap()
        .unwrap();
    wait_plans(&probe, 1).await;
    addr.send(submit(prompt(2, 7), 5, &c2))
        .await
        .unwrap()
        .unwrap(); // queued
    let p3 = prompt(3, 8);
    let r3 = addr
        .send(submit(p3.clone(), 5, &c3))
        .await
        .unwrap()
        .unwrap();
    // R1 (running) and R2 (queued) go away.
    c1.do_send(StopCollector);
    c2.do_send(StopCollector);
    while rx1.recv().await.is_some() {}
    while rx2.recv().await.is_some() {}
    probe.resume();
    let by = by_id(collect_terminals(&mut rx3, 1, WAIT).await);
    let s3 = check_stream(&by[&r3]);
    assert_eq!(s3.tokens, expected(&p3, 5, 8192).0);

    let st = wait_until(&addr, "slots free", |s| s.running + s.releasing == 0).await;
    assert_no_leaks(&st);
    assert_eq!(st.requests_cancelled, 2);
    assert!(
        st.tokens_generated < 50,
        "R1 did not run to its end: {}",
        st.tokens_generated
    );
    let plans = probe.plans();
    let r1_slot = plans[0].admit[0].slot;
    assert!(
        plans.iter().any(|p| p.release == vec![r1_slot]),
        "R1's slot was released"
    );
    assert!(
        plans
            .iter()
            .flat_map(|p| &p.admit)
            .all(|a| a.prompt.len() != 7),
        "R2 never took a slot"
    );
    assert_eq!(probe.registered(), 0);
}

#[actix::test]
async fn shutdown_drain_finishes_all_work_and_joins_the_engine() {
    let (addr, probe) = start(FakeSettings::default(), config(2, 8, 32, 16));
    let (col, mut rx) = collector();
    let specs: Vec<(Arc<[u32]>, usize)> = (0..6u32)
        .map(|i| (prompt(i, 5 + i as usize * 9), 10 + i as usize))
        .collect();
    let ids: Vec<RequestId> = join_all(
        specs
            .iter()
            .map(|(p, n)| addr.send(submit(p.clone(), *n, &col))),
    )
    .await
    .into_iter()
    .map(|r| r.unwrap().unwrap())
    .collect();
    let shutdown = addr.send(Shutdown {
        mode: ShutdownMode::Drain,
    });
    let late = addr.send(submit(prompt(9, 3), 3, &col)).await.unwrap();
    assert_eq!(late, Err(SchedulerError::ShuttingDown));
    assert_eq!(shutdown.await.expect("mailbox"), Ok(()));
    assert!(probe.dropped(), "the engine thread has exited");
    let by = by_id(collect_terminals(&mut rx, 6, WAIT).await);
    for (id, (p, n)) in ids.iter().zip(&specs) {
        let (tokens, reason) = expected(p, *n, 8192);
        let s = check_stream(&by[id]);
        assert_eq!(s.tokens, tokens);
        assert!(matches!(s.end, End::Finished(r, _) if r == reason));
    }
    assert!(addr.send(Stats).await.is_err(), "the actor has stopped");
}

#[actix::test]
async fn shutdown_abort_cancels_everything_and_joins_the_engine() {
    let (addr, probe) = start(FakeSettings::default(), config(2, 8, 32, 16));
    let (col, mut rx) = collector();
    let _gate = probe.pause();
    let ids: Vec<RequestId> =
        join_all((0..4u32).map(|i| addr.send(submit(prompt(i, 6), 100, &col))))
            .await
            .into_iter()
            .map(|r| r.unwrap().unwrap())
            .collect();
    wait_plans(&probe, 1).await;
    let shutdown = addr.send(Shutdown {
        mode: ShutdownMode::Abort,
    });
    stats(&addr).await; // the mailbox is FIFO: Shutdown has been handled
    probe.resume();
    assert_eq!(shutdown.await.expect("mailbox"), Ok(()));
    assert!(probe.dropped(), "the engine thread has exited");
    let by = by_id(collect_terminals(&mut rx, 4, WAIT).await);
    let mut started = 0;
    for id in &ids {
        let s = check_stream(&by[id]);
        started += usize::from(s.started);
        assert!(s.tokens.is_empty());
        assert!(
            matches!(s.end, End::Finished(FinishReason::Cancelled, _)),
            "{:?}",
            s.end
        );
    }
    assert_eq!(started, 2, "two were running, two queued");
    assert_eq!(probe.plan_count(), 1, "no plan after the abort");
}

#[actix::test]
async fn dropping_every_addr_stops_the_scheduler_and_its_engine() {
    let settings = FakeSettings {
        step_delay: Duration::from_millis(1),
        ..FakeSettings::default()
    };
    let (addr, probe) = start(settings, config(2, 8, 32, 16));
    let (col, mut rx) = collector();
    let id = addr
        .send(submit(prompt(1, 4), 5000, &col))
        .await
        .unwrap()
        .unwrap();
    wait_plans(&probe, 3).await;
    drop(addr);
    let events = collect_terminals(&mut rx, 1, WAIT).await;
    let s = check_stream(&by_id(events)[&id]);
    assert!(
        matches!(s.end, End::Finished(FinishReason::Cancelled, _)),
        "{:?}",
        s.end
    );
    let deadline = Instant::now() + WAIT;
    while !probe.dropped() {
        assert!(Instant::now() < deadline, "engine thread still running");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Not a check: prints the scheduler's per-step cost against a zero-cost
/// engine (64 streams × 256 tokens). Run with
/// `cargo test --test scheduler -- --ignored --nocapture`.
#[actix::test]
#[ignore]
async fn report_scheduler_overhead() {
    let (addr, _probe) = start(FakeSettings::default(), SchedulerConfig::default());
    let (col, mut rx) = collector();
    let t0 = Instant::now();
    join_all((0..64u32).map(|i| addr.send(submit(prompt(i, 64 + i as usize), 256, &col)))).await;
    collect_terminals(&mut rx, 64, Duration::from_secs(120)).await;
    let wall = t0.elapsed();
    let s = stats(&addr).await;
    let t = &s.metrics.steps;
    let per = |d: Duration| d / t.steps.max(1) as u32;
    eprintln!(
        "steps {} in {wall:?} ({:?}/step), mean seqs/step {:.1}, max {}\n\
         engine {:?}/step, round trip {:?}/step (max {:?}), plan {:?}/step (max {:?}), \
         route {:?}/step (max {:?}); busy wall {:?} vs engine {:?}",
        t.steps,
        wall / t.steps.max(1) as u32,
        s.mean_seqs_per_step,
        s.max_seqs_per_step,
        per(t.engine_total),
        per(t.round_trip_total),
        t.round_trip_max,
        per(t.plan_total),
        t.plan_max,
        per(t.route_total),
        t.route_max,
        t.busy_wall_total,
        t.busy_engine_total,
    );
    assert_eq!(s.tokens_generated, 64 * 256);
}
