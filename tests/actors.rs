//! The whole actor path on the real engine (embedded test model): request
//! actors → scheduler → engine thread → mailboxes.

use std::time::Duration;

use futures_util::StreamExt;
use tandem::api::{Event, GenerateRequest, Prompt, TandemError};
use tandem::engine::{Engine, EngineConfig};
use tandem::sampler::SamplingOptions;
use tandem::scheduler::{FinishReason, SchedulerConfig, ShutdownMode};
use tandem::tiny::{tiny_model_cpu, TinyPreset};
use tandem::TandemHandle;

fn start(config: SchedulerConfig, kv: usize) -> TandemHandle {
    let (model, tokenizer) = tiny_model_cpu(TinyPreset::Test).unwrap();
    let engine = Engine::new(
        model,
        EngineConfig {
            kv_capacity_tokens: kv,
            model_name: "test".into(),
            eos_ids: vec![],
            ..Default::default()
        },
    );
    TandemHandle::start(engine, tokenizer, config).unwrap()
}

/// The test model with a perfect draft (early exit after its last layer)
/// that drafts at any batch size.
fn perfect_drafter(kv: usize) -> (Engine, tandem::tokenizer::Tokenizer) {
    use tandem::engine::{EarlyExitDraft, SpecConfig};
    let (model, tokenizer) = tiny_model_cpu(TinyPreset::Test).unwrap();
    let layers = model.config().num_layers;
    let engine = Engine::new(
        model,
        EngineConfig {
            kv_capacity_tokens: kv,
            model_name: "test".into(),
            eos_ids: vec![],
            ..Default::default()
        },
    )
    .with_draft(Box::new(EarlyExitDraft { layers }), SpecConfig::default());
    (engine, tokenizer)
}

fn prompt(i: usize, len: usize) -> Prompt {
    Prompt::Tokens(
        std::iter::once(1)
            .chain((1..len).map(|j| ((i * 31 + j * 7) % 500 + 10) as u32))
            .collect(),
    )
}

fn request(i: usize, sampling: SamplingOptions) -> GenerateRequest {
    GenerateRequest {
        prompt: prompt(i, 3 + (i * 11) % 40),
        max_tokens: Some(8 + i % 13),
        sampling,
        stop: vec![],
        mtp: None,
        constraints: Default::default(),
    }
}

/// Token ids and text of one request run alone on a fresh scheduler.
async fn solo(req: GenerateRequest) -> (Vec<u32>, String, Vec<Option<f32>>) {
    let handle = start(SchedulerConfig::default(), 4096);
    let c = handle.complete(req).await.unwrap();
    handle.shutdown(ShutdownMode::Drain).await.unwrap();
    (
        c.tokens.iter().map(|t| t.id).collect(),
        c.text,
        c.tokens.iter().map(|t| t.logprob).collect(),
    )
}

#[actix::test]
async fn concurrent_greedy_requests_match_solo_runs() {
    let handle = start(
        SchedulerConfig {
            max_seqs: 16,
            ..Default::default()
        },
        8192,
    );
    let reqs: Vec<GenerateRequest> = (0..16)
        .map(|i| request(i, SamplingOptions::greedy()))
        .collect();
    let futures: Vec<_> = reqs
        .iter()
        .cloned()
        .map(|r| {
            let h = handle.clone();
            async move { h.complete(r).await.unwrap() }
        })
        .collect();
    let batched = futures_util::future::join_all(futures).await;
    let stats = handle.stats().await.unwrap();
    assert!(
        stats.max_seqs_per_step >= 8,
        "requests were batched (max {} per step)",
        stats.max_seqs_per_step
    );
    for (i, (r, got)) in reqs.into_iter().zip(batched).enumerate() {
        let (ids, text, _) = solo(r.clone()).await;
        assert_eq!(
            got.tokens.iter().map(|t| t.id).collect::<Vec<_>>(),
            ids,
            "request {i}"
        );
        assert_eq!(got.text, text);
        assert_eq!(got.finished.reason, FinishReason::Length);
        assert_eq!(got.finished.usage.completion_tokens, r.max_tokens.unwrap());
        assert!(
            got.tokens.iter().enumerate().all(|(k, t)| t.index == k),
            "token indices in order"
        );
    }
}

#[actix::test]
async fn mixed_options_match_solo_runs() {
    let handle = start(SchedulerConfig::default(), 8192);
    let opts = [
        SamplingOptions {
            repeat_penalty: 1.5,
            presence_penalty: 0.4,
            repeat_last_n: 8,
            ..Default::default()
        },
        SamplingOptions {
            logprobs: true,
            top_logprobs: 4,
            ..Default::default()
        },
        SamplingOptions {
            temperature: 0.9,
            top_p: 0.8,
            seed: Some(42),
            ..Default::default()
        },
        SamplingOptions {
            temperature: 1.2,
            top_k: 30,
            min_p: 0.02,
            frequency_penalty: 0.5,
            seed: Some(5),
            logprobs: true,
            ..Default::default()
        },
    ];
    let reqs: Vec<GenerateRequest> = (0..12).map(|i| request(i, opts[i % opts.len()])).collect();
    let batched = futures_util::future::join_all(reqs.iter().cloned().map(|r| {
        let h = handle.clone();
        async move { h.complete(r).await.unwrap() }
    }))
    .await;
    for (i, (r, got)) in reqs.into_iter().zip(batched).enumerate() {
        let (ids, _, logprobs) = solo(r.clone()).await;
        assert_eq!(
            got.tokens.iter().map(|t| t.id).collect::<Vec<_>>(),
            ids,
            "request {i} ({:?})",
            r.sampling
        );
        for (a, b) in got.tokens.iter().map(|t| t.logprob).zip(logprobs) {
            assert_eq!(a.is_some(), r.sampling.logprobs);
            if let (Some(a), Some(b)) = (a, b) {
                assert!((a - b).abs() < 1e-4);
            }
        }
        if r.sampling.logprobs {
            let k = r.sampling.top_logprobs;
            assert!(got.tokens.iter().all(|t| t.top_logprobs.len() == k
                && t.top_logprobs
                    .windows(2)
                    .all(|w| w[0].logprob >= w[1].logprob)));
        }
    }
}

#[actix::test]
async fn stop_strings_spanning_tokens_stop_exactly_and_never_leak() {
    let handle = start(SchedulerConfig::default(), 4096);
    let base = GenerateRequest {
        prompt: prompt(3, 6),
        max_tokens: Some(40),
        sampling: SamplingOptions::greedy(),
        stop: vec![],
        mtp: None,
        constraints: Default::default(),
    };
    let free = handle.complete(base.clone()).await.unwrap();
    assert!(free.text.len() > 30, "need some text: {:?}", free.text);
    // A stop string that starts in the middle of one word and ends inside a later one.
    let start = free.text.char_indices().nth(12).unwrap().0;
    let end = free.text.char_indices().nth(21).unwrap().0;
    let stop = free.text[start..end].to_string();
    let want = &free.text[..free.text.find(&stop).unwrap()];
    let mut stream = handle
        .generate(GenerateRequest {
            stop: vec!["never-matches".into(), stop.clone()],
            mtp: None,
            ..base
        })
        .await
        .unwrap();
    let mut text = String::new();
    let mut finished = None;
    while let Some(ev) = stream.next().await {
        match ev {
            Event::Tokens { text: t, .. } => {
                text.push_str(&t);
                assert!(!text.contains(&stop), "the stop string leaked: {text:?}");
                assert!(
                    want.starts_with(&text),
                    "streamed text {text:?} is not a prefix of {want:?}"
                );
            }
            Event::Finished(f) => finished = Some(f),
            Event::Error { error, .. } => panic!("{error}"),
        }
    }
    let f = finished.expect("terminal event");
    assert_eq!(text, want);
    assert_eq!(f.reason, FinishReason::Stop);
    assert_eq!(f.stop.as_deref(), Some(stop.as_str()));
    let stats = handle.stats().await.unwrap();
    assert_eq!(stats.running, 0);
}

#[actix::test]
async fn dropping_the_stream_cancels_and_frees_the_slot() {
    let handle = start(
        SchedulerConfig {
            max_seqs: 1,
            step_token_budget: 64,
            max_prefill_chunk: 32,
            ..Default::default()
        },
        4096,
    );
    let mut first = handle
        .generate(GenerateRequest {
            prompt: prompt(1, 5),
            max_tokens: Some(1000),
            sampling: SamplingOptions::greedy(),
            stop: vec![],
            mtp: None,
            constraints: Default::default(),
        })
        .await
        .unwrap();
    let waiting = handle.generate(GenerateRequest::new(prompt(2, 5), 4));
    // Let the first request produce something, then abandon it.
    assert!(matches!(first.next().await, Some(Event::Tokens { .. })));
    let stats = handle.stats().await.unwrap();
    assert_eq!((stats.running, stats.free_slots), (1, 0));
    drop(first);
    // The waiting request takes the freed slot and completes.
    let mut second = waiting.await.unwrap();
    let mut reason = None;
    while let Some(ev) = second.next().await {
        if let Event::Finished(f) = ev {
            reason = Some(f.reason);
        }
    }
    assert_eq!(reason, Some(FinishReason::Length));
    let stats = handle.stats().await.unwrap();
    assert_eq!(stats.requests_cancelled, 1);
    assert_eq!((stats.running, stats.kv_reserved_tokens), (0, 0));
}

#[actix::test]
async fn invalid_requests_are_rejected_before_taking_a_slot() {
    let handle = start(SchedulerConfig::default(), 4096);
    let running = handle
        .generate(GenerateRequest::new(prompt(1, 5), 30))
        .await
        .unwrap();
    let bad = [
        (GenerateRequest::new(Prompt::Tokens(vec![]), 5), "prompt"),
        (GenerateRequest::new(prompt(1, 5), 0), "max_tokens"),
        (GenerateRequest::new(prompt(1, 5), 5000), "max_tokens"),
        (GenerateRequest::new(prompt(1, 2000), 5), "context"),
        (
            GenerateRequest::new(Prompt::Tokens(vec![1, 99999]), 5),
            "vocabulary",
        ),
        (
            GenerateRequest::new(prompt(1, 5), 5).with_sampling(SamplingOptions {
                temperature: -1.0,
                ..Default::default()
            }),
            "temperature",
        ),
        (
            GenerateRequest::new(prompt(1, 5), 5).with_sampling(SamplingOptions {
                top_p: f32::NAN,
                ..Default::default()
            }),
            "top_p",
        ),
        (
            GenerateRequest::new(prompt(1, 5), 5).with_stop(vec![String::new()]),
            "stop",
        ),
    ];
    let refused = bad.len() as u64;
    for (req, field) in bad {
        let err = handle.generate(req).await.err().expect("rejected");
        assert!(err.is_invalid_request(), "{err}");
        assert!(
            err.to_string().contains(field),
            "`{err}` should name `{field}`"
        );
    }
    let mut running = running;
    let mut n = 0;
    while let Some(ev) = running.next().await {
        if let Event::Tokens { tokens, .. } = ev {
            n += tokens.len();
        }
    }
    assert_eq!(n, 30, "the running request was not disturbed");
    let stats = handle.stats().await.unwrap();
    assert_eq!(stats.requests_submitted, 1);
    // Checked off the scheduler's mailbox, yet counted by the scheduler.
    assert_eq!(stats.requests_rejected, refused);
}

#[actix::test]
async fn queue_full_is_an_immediate_overload_error() {
    let handle = start(
        SchedulerConfig {
            max_seqs: 1,
            max_queue: 1,
            step_token_budget: 16,
            max_prefill_chunk: 8,
            prefix_caching: true,
        },
        4096,
    );
    let _a = handle
        .generate(GenerateRequest::new(prompt(1, 5), 200))
        .await
        .unwrap();
    let _b = handle
        .generate(GenerateRequest::new(prompt(2, 5), 200))
        .await
        .unwrap();
    let err = tokio::time::timeout(
        Duration::from_secs(5),
        handle.generate(GenerateRequest::new(prompt(3, 5), 5)),
    )
    .await
    .expect("no hang")
    .err()
    .expect("overloaded");
    assert!(
        matches!(
            err,
            TandemError::Scheduler(tandem::scheduler::SchedulerError::Overloaded { .. })
        ),
        "{err}"
    );
    assert!(!err.is_invalid_request());
    handle.shutdown(ShutdownMode::Abort).await.unwrap();
}

#[actix::test]
async fn events_arrive_once_in_order_under_random_cancellation() {
    use rand::{Rng, SeedableRng};
    let handle = start(SchedulerConfig::default(), 16384);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
    let mut tasks = Vec::new();
    for i in 0..64 {
        let h = handle.clone();
        let cancel_after: Option<usize> = if rng.random_bool(0.3) {
            Some(rng.random_range(0..6))
        } else {
            None
        };
        tasks.push(actix::spawn(async move {
            let req = request(
                i,
                SamplingOptions {
                    temperature: 0.8,
                    seed: Some(i as u64),
                    ..Default::default()
                },
            );
            let max = req.max_tokens.unwrap();
            let mut s = h.generate(req).await.unwrap();
            let mut next_index = 0;
            let mut chunks = 0;
            let mut terminal = 0;
            while let Some(ev) = s.next().await {
                assert_eq!(terminal, 0, "nothing after the terminal event");
                match ev {
                    Event::Tokens { tokens, .. } => {
                        for t in tokens {
                            assert_eq!(
                                t.index, next_index,
                                "request {i}: indices in order, no gaps or repeats"
                            );
                            next_index += 1;
                        }
                        chunks += 1;
                        if Some(chunks) == cancel_after {
                            return (true, next_index);
                        }
                    }
                    Event::Finished(f) => {
                        terminal += 1;
                        assert_eq!(f.usage.completion_tokens, next_index);
                        assert!(
                            f.reason == FinishReason::Length && next_index == max
                                || f.reason == FinishReason::Eos
                        );
                    }
                    Event::Error { error, .. } => panic!("{error}"),
                }
            }
            assert_eq!(terminal, 1);
            (false, next_index)
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    // Cancellations are applied at step boundaries; wait for them to settle.
    for _ in 0..100 {
        let stats = handle.stats().await.unwrap();
        if stats.running == 0 && stats.queued == 0 && stats.releasing == 0 {
            assert_eq!(stats.kv_reserved_tokens, 0);
            assert_eq!(stats.free_slots, stats.max_seqs);
            handle.shutdown(ShutdownMode::Drain).await.unwrap();
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("slots were not freed: {:?}", handle.stats().await.unwrap());
}

#[actix::test]
async fn stop_strings_inside_an_accepted_draft_run_stop_exactly() {
    use tandem::engine::SpecOptions;
    let (engine, tokenizer) = perfect_drafter(4096);
    let handle = TandemHandle::start(engine, tokenizer, SchedulerConfig::default()).unwrap();
    let spec = SpecOptions::constant(6);
    let base = GenerateRequest::new(prompt(7, 5), 40).with_mtp(spec);
    let free = handle
        .complete(base.clone().with_mtp(SpecOptions::off()))
        .await
        .unwrap();
    let with_mtp = handle.complete(base.clone()).await.unwrap();
    assert_eq!(
        with_mtp.text, free.text,
        "greedy MTP output equals plain output"
    );
    assert!(with_mtp.finished.usage.draft_tokens > 0);
    // A stop string in the middle of the text: a perfect draft accepts whole
    // runs, so the match falls inside an accepted run.
    let mid = free
        .text
        .char_indices()
        .nth(free.text.chars().count() / 2)
        .unwrap()
        .0;
    let stop: String = free.text[mid..].chars().take(5).collect();
    let got = handle
        .complete(base.with_stop(vec![stop.clone()]))
        .await
        .unwrap();
    assert_eq!(got.text, free.text[..free.text.find(&stop).unwrap()]);
    assert_eq!(got.finished.reason, FinishReason::Stop);
    // The stopped request's slot is released at the next step boundary.
    let mut stats = handle.stats().await.unwrap();
    for _ in 0..100 {
        if stats.kv_reserved_tokens == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
        stats = handle.stats().await.unwrap();
    }
    assert_eq!((stats.running, stats.kv_reserved_tokens), (0, 0));
    assert!(stats.mtp_accepted > 0 && stats.mtp_speculative_steps > 0);
}

/// Records the largest forward pass and the largest plan of a real engine.
struct BudgetProbe {
    engine: Engine,
    widest: std::sync::Arc<std::sync::Mutex<(usize, usize, usize)>>,
}

impl tandem::engine::StepExecutor for BudgetProbe {
    fn info(&self) -> tandem::engine::EngineInfo {
        self.engine.info()
    }
    fn execute(&mut self, plan: tandem::engine::StepPlan) -> tandem::engine::StepOutcome {
        let planned: usize = plan.work.iter().map(|w| w.max_tokens()).sum();
        let outcome = self.engine.execute(plan);
        let mut w = self.widest.lock().unwrap();
        w.0 = w.0.max(planned);
        w.1 = w.1.max(outcome.stats.batch_tokens);
        w.2 += outcome.stats.drafted;
        outcome
    }
}

#[actix::test]
async fn drafts_never_take_a_step_past_its_token_budget() {
    use tandem::engine::SpecOptions;
    let (engine, tokenizer) = perfect_drafter(1 << 16);
    let widest = std::sync::Arc::new(std::sync::Mutex::new((0, 0, 0)));
    let probe = BudgetProbe {
        engine,
        widest: widest.clone(),
    };
    let budget = 48;
    let config = SchedulerConfig {
        max_seqs: 16,
        step_token_budget: budget,
        max_prefill_chunk: 16,
        ..Default::default()
    };
    let handle = TandemHandle::start(probe, tokenizer, config).unwrap();
    // Greedy and seeded sampled drafters (pinned: their drafts are reserved).
    let requests = (0..24).map(|i| {
        let sampling = if i % 3 == 0 {
            SamplingOptions {
                temperature: 0.9,
                seed: Some(i as u64),
                ..Default::default()
            }
        } else {
            SamplingOptions::greedy()
        };
        request(i, sampling).with_mtp(SpecOptions::constant(2 + i % 7))
    });
    let done = futures_util::future::join_all(requests.map(|r| handle.complete(r))).await;
    for (i, r) in done.into_iter().enumerate() {
        assert!(r.is_ok(), "request {i}: {r:?}");
    }
    let (planned, fed, drafted) = *widest.lock().unwrap();
    assert!(drafted > 0, "the test must draft");
    assert!(
        planned <= budget,
        "a plan asked for {planned} tokens of {budget}"
    );
    assert!(fed <= budget, "a step fed {fed} tokens of {budget}");
}
