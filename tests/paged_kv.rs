//! Paged KV on the real engine (embedded test model), through the whole
//! actor path: prefix-cache hits, preemption under a small pool, and both
//! leaving every request's tokens exactly as an unconstrained, uncached run
//! gives them.

use std::sync::{Arc, Mutex};

use candle_core::Tensor;
use tandem::api::{Event, GenerateRequest, Prompt};
use tandem::engine::{
    DraftHead, DraftInput, Engine, EngineConfig, MtpDraft, SpecConfig, SpecOptions,
};
use tandem::kv::KvCache;
use tandem::model::{Batch, Model, ModelError, MtpHead, OutputRows};
use tandem::sampler::SamplingOptions;
use tandem::scheduler::{FinishReason, SchedulerConfig, ShutdownMode};
use tandem::tiny::{tiny_model_cpu, TinyPreset};
use tandem::TandemHandle;

const BLOCK: usize = 16;

fn start(config: SchedulerConfig, kv: usize) -> TandemHandle {
    start_with_head(config, kv, None)
}

/// [`start`], drafting with `head` (constant schedules: every request
/// drafts two tokens a step unless it says otherwise).
fn start_with_head(
    config: SchedulerConfig,
    kv: usize,
    head: Option<Box<dyn DraftHead>>,
) -> TandemHandle {
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
    let engine = match head {
        Some(head) => engine.with_draft(
            head,
            SpecConfig {
                default: SpecOptions::constant(2),
                ..Default::default()
            },
        ),
        None => engine,
    };
    TandemHandle::start(engine, tokenizer, config).unwrap()
}

/// Every draft round's input position and logits row, in order.
type RoundLog = Arc<Mutex<Vec<(usize, Vec<f32>)>>>;

/// A random MTP head (it drafts from the target's hidden states) that
/// records what it computes.
struct RecordingHead {
    inner: MtpDraft,
    log: RoundLog,
}

impl RecordingHead {
    fn boxed(log: &RoundLog) -> Box<dyn DraftHead> {
        let target = tiny_model_cpu(TinyPreset::Test).unwrap().0;
        Box::new(Self {
            inner: MtpDraft {
                head: MtpHead::random(&target, 11).unwrap(),
            },
            log: log.clone(),
        })
    }
}

impl DraftHead for RecordingHead {
    fn name(&self) -> String {
        self.inner.name()
    }
    fn needs_hidden(&self) -> bool {
        self.inner.needs_hidden()
    }
    fn admit(&mut self, slot: u32, reserve: usize) -> Result<(), ModelError> {
        self.inner.admit(slot, reserve)
    }
    fn release(&mut self, slot: u32) {
        self.inner.release(slot)
    }
    fn draft(
        &mut self,
        model: &Model,
        kv: &mut KvCache,
        inputs: &[DraftInput],
    ) -> Result<Tensor, ModelError> {
        let logits = self.inner.draft(model, kv, inputs)?;
        let rows = logits.to_vec2::<f32>()?;
        let mut log = self.log.lock().unwrap();
        log.extend(inputs.iter().map(|i| i.position).zip(rows));
        Ok(logits)
    }
    fn end_rounds(&mut self, slot: u32, position: usize) -> Result<(), ModelError> {
        self.inner.end_rounds(slot, position)
    }
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

/// A head that drafts from the target's hidden states takes a cached
/// prefix like any request: its hidden states come from the cache with its
/// K/V, so the head computes exactly what it computes when the prompt is
/// prefilled, and output stays exact.
#[actix::test]
async fn a_draft_head_reads_a_cached_prefix_hidden_states() {
    let req = request(tokens(3, 50), 12, SamplingOptions::greedy());
    let want = references(std::slice::from_ref(&req)).await.remove(0);
    let mut logs = Vec::new();
    for prefix_caching in [false, true] {
        let log = RoundLog::default();
        let h = start_with_head(
            config(4, prefix_caching),
            4096,
            Some(RecordingHead::boxed(&log)),
        );
        let first = h.complete(req.clone()).await.unwrap();
        log.lock().unwrap().clear();
        let second = h.complete(req.clone()).await.unwrap();
        assert_eq!(ids(&first), want, "cache {prefix_caching}: first run");
        assert_eq!(ids(&second), want, "cache {prefix_caching}: second run");
        let cached = second.finished.usage.cached_prompt_tokens;
        assert_eq!(cached, if prefix_caching { 48 } else { 0 });
        assert!(second.finished.usage.draft_tokens > 0, "it drafted");
        logs.push(std::mem::take(&mut *log.lock().unwrap()));
        h.shutdown(ShutdownMode::Drain).await.unwrap();
    }
    assert_eq!(
        logs[0], logs[1],
        "the head's rounds from a cached prefix equal those from a computed one"
    );
    // Both equal the head fed the target's own hidden states: its first
    // round pairs h_0..h_49 with the prompt's next tokens and the first
    // generated one.
    let (position, first_round) = &logs[1][0];
    assert_eq!(*position, 50);
    assert_eq!(first_round, &head_after_prompt(&tokens(3, 50), want[0]));
}

/// The logits of [`RecordingHead`]'s head after the pairs of `prompt`
/// followed by `next`, from a plain forward pass's hidden states.
fn head_after_prompt(prompt: &[u32], next: u32) -> Vec<f32> {
    let model = tiny_model_cpu(TinyPreset::Test).unwrap().0;
    let mut kv = KvCache::new(model.kv_layout(), candle_core::Device::Cpu, 4096);
    kv.allocate(0, 64).unwrap();
    kv.ensure_room(0, prompt.len()).unwrap();
    let mut batch = Batch::default();
    batch.push(0, 0, prompt, OutputRows::All);
    let hidden = model.forward(&batch, &mut kv).unwrap();
    let mut head = MtpHead::random(&model, 11).unwrap();
    head.admit(0, 64).unwrap();
    let pairs: Vec<u32> = prompt[1..].iter().copied().chain([next]).collect();
    let mut batch = Batch::default();
    batch.push(0, 0, &pairs, OutputRows::Last);
    let logits = head.step(&model, &batch, Some(&hidden)).unwrap();
    logits.to_vec2::<f32>().unwrap().remove(0)
}

/// Preempted drafting requests resume from the prefix cache (hidden states
/// included) and still give the tokens of an unconstrained run.
#[actix::test]
async fn preempted_drafting_requests_resume_from_the_cache_exactly() {
    let reqs: Vec<GenerateRequest> = (0..6)
        .map(|i| request(tokens(i, 18 + 3 * i), 40, SamplingOptions::greedy()))
        .collect();
    let want = references(&reqs).await;
    let log = RoundLog::default();
    let h = start_with_head(config(6, true), 8 * BLOCK, Some(RecordingHead::boxed(&log)));
    let got = run_streams(&h, &reqs).await;
    let s = h.stats().await.unwrap();
    assert!(
        s.preemptions > 0,
        "the pool is too small for everyone at once"
    );
    assert!(
        s.prefix_cache_hit_tokens > 0,
        "resumptions reuse cached blocks"
    );
    assert!(!log.lock().unwrap().is_empty(), "the head drafted");
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g, w, "request {i}");
    }
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

/// The 50-token prompt (three full blocks and two tokens) the `n` tests
/// ask 12 tokens for.
fn fifty_token_request(sampling: SamplingOptions) -> GenerateRequest {
    request(tokens(5, 50), 12, sampling)
}

/// `n` = 4 choices of `req`, drafting with an MTP head when `head` (which
/// must then draft).
async fn four_choices(
    prefix_caching: bool,
    head: bool,
    req: GenerateRequest,
) -> (Vec<Vec<u32>>, u64) {
    let log = RoundLog::default();
    let h = start_with_head(
        config(4, prefix_caching),
        4096,
        head.then(|| RecordingHead::boxed(&log)),
    );
    let before = h.stats().await.unwrap();
    let choices = h.complete_choices(req, 4).await.unwrap();
    let after = h.stats().await.unwrap();
    let got: Vec<Vec<u32>> = choices.iter().map(|c| ids(c.as_ref().unwrap())).collect();
    for c in &choices {
        let usage = c.as_ref().unwrap().finished.usage;
        assert_eq!((usage.prompt_tokens, usage.completion_tokens), (50, 12));
    }
    assert_eq!(after.kv_blocks_used, 0, "every choice's blocks are back");
    assert_eq!(!log.lock().unwrap().is_empty(), head, "the head drafts");
    h.shutdown(ShutdownMode::Drain).await.unwrap();
    let computed = after.prompt_tokens_processed - before.prompt_tokens_processed;
    (got, computed)
}

#[actix::test]
async fn n_four_choices_prefill_once_and_equal_single_requests_with_derived_seeds() {
    for (name, sampling) in [("greedy", SamplingOptions::greedy()), ("seeded", seeded(7))] {
        // Choice i is the single request with seed + i.
        let singles: Vec<GenerateRequest> = (0..4)
            .map(|i| {
                let seed = sampling.seed.map(|s| s + i);
                fifty_token_request(SamplingOptions { seed, ..sampling })
            })
            .collect();
        let want = references(&singles).await;
        // A drafting head shares the prompt's blocks (and their hidden
        // states) like any choice.
        for (prefix_caching, head) in [(true, false), (false, false), (true, true), (false, true)] {
            let req = fifty_token_request(sampling);
            let (got, computed) = four_choices(prefix_caching, head, req).await;
            let case = format!("{name}, prefix cache {prefix_caching}, head {head}");
            assert_eq!(got, want, "{case}");
            // One prompt, then three tails of two tokens after 48 shared.
            assert_eq!(computed, 50 + 3 * 2, "{case}");
        }
        if name == "seeded" {
            assert!(want.windows(2).any(|w| w[0] != w[1]), "seeds differ");
        }
    }
    // Without a seed the choices still draw independently. Their draws
    // are not reproducible, so EOS (id 2) is barred: one choice drawing it
    // would end short of 12 tokens, now and then.
    let mut unseeded = fifty_token_request(SamplingOptions {
        seed: None,
        ..seeded(0)
    });
    unseeded.constraints.logit_bias = vec![(2, -100.0)];
    let (got, _) = four_choices(true, false, unseeded).await;
    assert!(got.windows(2).any(|w| w[0] != w[1]), "{got:?}");
}

#[actix::test]
async fn n_dropping_the_choice_stream_cancels_every_choice_and_frees_blocks() {
    let h = start(config(4, false), 4096);
    let mut stream = h
        .generate_choices(request(tokens(6, 40), 200, seeded(1)), 3)
        .await
        .unwrap();
    let mut seen = std::collections::HashSet::new();
    while seen.len() < 3 {
        let (i, event) = stream.next_event().await.unwrap();
        assert!(!event.is_terminal(), "choice {i} ended early: {event:?}");
        seen.insert(i);
    }
    drop(stream);
    let t0 = std::time::Instant::now();
    let s = loop {
        let s = h.stats().await.unwrap();
        if s.requests_cancelled == 3 && s.kv_blocks_used == 0 || t0.elapsed().as_secs() > 10 {
            break s;
        }
        actix::clock::sleep(std::time::Duration::from_millis(5)).await;
    };
    assert_eq!((s.requests_cancelled, s.kv_blocks_used), (3, 0));
    assert_eq!(s.running, 0);
    // More choices than slots is a clear error naming `n`.
    let err = h
        .complete_choices(request(tokens(6, 10), 4, seeded(1)), 5)
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            tandem::api::TandemError::InvalidRequest { field: "n", .. }
        ),
        "{err}"
    );
    h.shutdown(ShutdownMode::Drain).await.unwrap();
}

#[actix::test]
async fn n_choices_preempted_in_a_small_pool_keep_their_tokens() {
    let sampling = seeded(21);
    let singles: Vec<GenerateRequest> = (0..4)
        .map(|i| {
            let seed = sampling.seed.map(|s| s + i);
            request(tokens(8, 34), 40, SamplingOptions { seed, ..sampling })
        })
        .collect();
    let want = references(&singles).await;
    for prefix_caching in [false, true] {
        // Eight blocks: each choice grows to five (two of them shared).
        let h = start(config(4, prefix_caching), 8 * BLOCK);
        let req = request(tokens(8, 34), 40, sampling);
        let got: Vec<Vec<u32>> = h
            .complete_choices(req, 4)
            .await
            .unwrap()
            .iter()
            .map(|c| ids(c.as_ref().unwrap()))
            .collect();
        let s = h.stats().await.unwrap();
        assert!(
            s.preemptions > 0,
            "the pool is too small (cache {prefix_caching})"
        );
        assert_eq!(got, want, "cache {prefix_caching}");
        assert_eq!(s.kv_blocks_used, 0);
        h.shutdown(ShutdownMode::Drain).await.unwrap();
    }
}

/// Requests without `max_tokens` may each grow to the whole context, which
/// a worst-case reservation held for every one of them up front: a pool of
/// four contexts admitted four at a time. Blocks are taken as sequences
/// grow, so the same pool runs sixteen at once (4×, the goal), and
/// preemption covers the growth that no longer fits.
#[actix::test]
async fn requests_without_max_tokens_run_four_times_as_many_as_whole_context_reservations() {
    const CONTEXT: usize = 1024; // TinyPreset::Test
    let h = start(config(16, false), 4 * CONTEXT);
    let mut streams = Vec::new();
    for i in 0..16 {
        let mut r = request(tokens(i, 20), 1, SamplingOptions::greedy());
        r.max_tokens = None;
        streams.push(h.generate(r).await.unwrap());
    }
    let t0 = std::time::Instant::now();
    let s = loop {
        let s = h.stats().await.unwrap();
        if s.running == 16 || t0.elapsed().as_secs() > 10 {
            break s;
        }
        actix::clock::sleep(std::time::Duration::from_millis(2)).await;
    };
    assert_eq!(
        (s.running, s.queued),
        (16, 0),
        "sixteen context-long requests run at once in four contexts of KV"
    );
    assert!(s.kv_blocks_used * BLOCK <= 4 * CONTEXT);
    drop(streams);
    h.shutdown(ShutdownMode::Abort).await.unwrap();
}
