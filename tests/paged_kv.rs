//! Paged KV on the real engine (embedded test model), through the whole
//! actor path: prefix-cache hits, preemption under a small pool, and both
//! leaving every request's tokens exactly as an unconstrained, uncached run
//! gives them.

use tandem::api::{Event, GenerateRequest, Prompt};
use tandem::engine::{Engine, EngineConfig};
use tandem::sampler::SamplingOptions;
use tandem::scheduler::{FinishReason, SchedulerConfig, ShutdownMode};
use tandem::tiny::{tiny_model_cpu, TinyPreset};
use tandem::TandemHandle;

const BLOCK: usize = 16;

fn start(config: SchedulerConfig, kv: usize) -> TandemHandle {
    let (model, tokenizer) = tiny_model_cpu(TinyPreset::Test).unwrap();
    let engine = Engine::new(
        model,
        EngineConfig {
            kv_capacity_tokens: kv,
            kv_block_size: BLOCK,
            model_name: "test".into(),
            eos_ids: vec![],
        },
    );
    TandemHandle::start(engine, tokenizer, config).unwrap()
}

fn tokens(i: usize, len: usize) -> Vec<u32> {
    std::iter::once(1)
        .chain((1..len).map(|j| ((i * 31 + j * 7) % 500 + 10) as u32))
        .collect()
}

fn request(prompt: Vec<u32>, max_tokens: usize, sampling: SamplingOptions) -> GenerateRequest {
    GenerateRequest {
        prompt: Prompt::Tokens(prompt),
        max_tokens: Some(max_tokens),
        sampling,
        stop: vec![],
        mtp: None,
        constraints: Default::default(),
    }
}

fn seeded(seed: u64) -> SamplingOptions {
    SamplingOptions {
        temperature: 0.9,
        top_k: 40,
        seed: Some(seed),
        ..Default::default()
    }
}

fn config(max_seqs: usize, prefix_caching: bool) -> SchedulerConfig {
    SchedulerConfig {
        max_seqs,
        step_token_budget: 64,
        max_prefill_chunk: 16,
        prefix_caching,
        ..Default::default()
    }
}

fn ids(c: &tandem::handle::Completion) -> Vec<u32> {
    c.tokens.iter().map(|t| t.id).collect()
}

/// Each request alone on a roomy engine with the prefix cache off.
async fn references(reqs: &[GenerateRequest]) -> Vec<Vec<u32>> {
    let mut out = Vec::new();
    for r in reqs {
        let h = start(config(1, false), 4096);
        out.push(ids(&h.complete(r.clone()).await.unwrap()));
        h.shutdown(ShutdownMode::Drain).await.unwrap();
    }
    out
}

#[actix::test]
async fn same_prompt_twice_prefills_only_the_uncached_tail() {
    let h = start(config(4, true), 4096);
    let prompt = tokens(1, 50); // three full blocks and two tokens
    for sampling in [SamplingOptions::greedy(), seeded(7)] {
        let req = request(prompt.clone(), 12, sampling);
        let want = references(std::slice::from_ref(&req)).await.remove(0);
        let before = h.stats().await.unwrap();
        let first = h.complete(req.clone()).await.unwrap();
        let mid = h.stats().await.unwrap();
        let second = h.complete(req.clone()).await.unwrap();
        let after = h.stats().await.unwrap();
        assert_eq!(ids(&first), want, "{sampling:?}: first run");
        assert_eq!(ids(&second), want, "{sampling:?}: cached run, same tokens");
        assert_eq!(second.finished.usage.cached_prompt_tokens, 48);
        assert_eq!(second.finished.usage.prompt_tokens, 50);
        let computed = |a: &tandem::scheduler::SchedulerStats,
                        b: &tandem::scheduler::SchedulerStats| {
            b.prompt_tokens_processed - a.prompt_tokens_processed
        };
        if before.prefix_cache_queries == 0 {
            assert_eq!(computed(&before, &mid), 50, "a cold cache computes it all");
            assert_eq!(first.finished.usage.cached_prompt_tokens, 0);
        }
        assert_eq!(computed(&mid, &after), 2, "only the tail after 48 cached");
        assert!(after.prefix_cache_hit_tokens >= mid.prefix_cache_hit_tokens + 48);
    }
    // A prompt sharing 40 tokens reuses only the two full blocks among them.
    let mut other = prompt[..40].to_vec();
    other.extend(tokens(9, 20).into_iter().skip(1));
    let req = request(other, 10, SamplingOptions::greedy());
    let want = references(std::slice::from_ref(&req)).await.remove(0);
    let got = h.complete(req).await.unwrap();
    assert_eq!(got.finished.usage.cached_prompt_tokens, 32);
    assert_eq!(ids(&got), want);
    let s = h.stats().await.unwrap();
    assert_eq!(s.kv_blocks_used, 0, "nobody owns a block once all ended");
    assert!(
        s.kv_blocks_cached > 0,
        "finished sequences' blocks stay cached"
    );
    h.shutdown(ShutdownMode::Drain).await.unwrap();
}

#[actix::test]
async fn prefix_cache_off_computes_every_prompt() {
    let h = start(config(4, false), 4096);
    let req = request(tokens(3, 40), 8, SamplingOptions::greedy());
    let a = h.complete(req.clone()).await.unwrap();
    let b = h.complete(req).await.unwrap();
    assert_eq!(ids(&a), ids(&b));
    assert_eq!(b.finished.usage.cached_prompt_tokens, 0);
    let s = h.stats().await.unwrap();
    assert_eq!((s.prompt_tokens_processed, s.kv_blocks_cached), (80, 0));
    h.shutdown(ShutdownMode::Drain).await.unwrap();
}

/// Every request's events: token indices 0, 1, … with no gap or repeat,
/// then exactly one terminal event, last.
async fn run_streams(h: &TandemHandle, reqs: &[GenerateRequest]) -> Vec<Vec<u32>> {
    let mut streams = Vec::new();
    for r in reqs {
        streams.push(h.generate(r.clone()).await.unwrap());
    }
    let futures = streams.into_iter().map(|mut s| async move {
        let mut got = Vec::new();
        let mut terminal = None;
        while let Some(e) = s.next_event().await {
            assert!(terminal.is_none(), "an event after the terminal one");
            match e {
                Event::Tokens { tokens, .. } => {
                    for t in tokens {
                        assert_eq!(t.index, got.len(), "token indices in order, once");
                        got.push(t.id);
                    }
                }
                other => terminal = Some(other),
            }
        }
        match terminal {
            Some(Event::Finished(f)) => assert_eq!(f.reason, FinishReason::Length),
            other => panic!("ended with {other:?}"),
        }
        got
    });
    futures_util::future::join_all(futures).await
}

#[actix::test]
async fn preempted_requests_give_the_tokens_of_an_unconstrained_run() {
    let reqs: Vec<GenerateRequest> = (0..6)
        .map(|i| {
            let sampling = match i % 2 {
                0 => SamplingOptions::greedy(),
                _ => seeded(100 + i as u64),
            };
            request(tokens(i, 18 + 3 * i), 40, sampling)
        })
        .collect();
    let want = references(&reqs).await;
    for prefix_caching in [false, true] {
        // Eight blocks: one sequence needs at most four, six need about 24.
        let h = start(config(6, prefix_caching), 8 * BLOCK);
        let got = run_streams(&h, &reqs).await;
        let s = h.stats().await.unwrap();
        assert!(
            s.preemptions > 0,
            "the pool is too small for everyone at once (cache {prefix_caching})"
        );
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g, w, "request {i} (cache {prefix_caching})");
        }
        assert_eq!((s.kv_blocks_used, s.preempted), (0, 0));
        h.shutdown(ShutdownMode::Drain).await.unwrap();
    }
}

#[actix::test]
async fn a_request_that_can_never_fit_is_refused_at_the_edge() {
    let h = start(config(2, true), 4 * BLOCK);
    let err = h
        .complete(request(tokens(1, 40), 30, SamplingOptions::greedy()))
        .await
        .unwrap_err();
    let text = err.to_string();
    assert!(text.contains("KV"), "a clear error: {text}");
    // One that fits exactly runs, alone, in the whole pool.
    let ok = h
        .complete(request(tokens(1, 40), 24, SamplingOptions::greedy()))
        .await
        .unwrap();
    assert_eq!(ok.tokens.len(), 24);
    h.shutdown(ShutdownMode::Drain).await.unwrap();
}
