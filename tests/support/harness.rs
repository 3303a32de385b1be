//! Helpers for driving a [`Scheduler`] over the fake engine from tests.

use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use tandem::engine::{SeqWork, StepPlan};
use tandem::sampler::SamplingOptions;
use tandem::scheduler::{Scheduler, SchedulerConfig, SchedulerStats, SeqRequest, Stats, Submit};

use super::{Collector, FakeExecutor, FakeProbe, FakeSettings, VOCAB};

/// How long a test waits for anything before failing.
pub const WAIT: Duration = Duration::from_secs(10);

/// Starts a scheduler over a fresh fake engine.
pub fn start(settings: FakeSettings, config: SchedulerConfig) -> (Addr<Scheduler>, FakeProbe) {
    let (fake, probe) = FakeExecutor::new(settings);
    let addr = Scheduler::start(fake, config).expect("scheduler starts");
    (addr, probe)
}

/// A scheduler config from its four limits.
pub fn config(max_seqs: usize, max_queue: usize, budget: usize, chunk: usize) -> SchedulerConfig {
    SchedulerConfig {
        max_seqs,
        max_queue,
        step_token_budget: budget,
        max_prefill_chunk: chunk,
        prefix_caching: true,
    }
}

/// A prompt of `len` in-vocab tokens (never the EOS marker), distinct per seed.
pub fn prompt(seed: u32, len: usize) -> Arc<[u32]> {
    (0..len as u32)
        .map(|i| 2 + (seed.wrapping_mul(7919).wrapping_add(i * 31)) % (VOCAB as u32 - 2))
        .collect()
}

/// A greedy `Submit` whose events go to `to`.
pub fn submit(prompt: Arc<[u32]>, max_new_tokens: usize, to: &Addr<Collector>) -> Submit {
    Submit(SeqRequest {
        spec: None,
        prompt,
        sampling: SamplingOptions::greedy(),
        max_new_tokens,
        events: to.clone().recipient(),
    })
}

/// The scheduler's stats (it must be alive).
pub async fn stats(addr: &Addr<Scheduler>) -> SchedulerStats {
    addr.send(Stats).await.expect("scheduler alive")
}

/// Polls `Stats` until `pred` holds.
pub async fn wait_until(
    addr: &Addr<Scheduler>,
    what: &str,
    pred: impl Fn(&SchedulerStats) -> bool,
) -> SchedulerStats {
    let deadline = Instant::now() + WAIT;
    loop {
        let s = stats(addr).await;
        if pred(&s) {
            return s;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}: {s:#?}"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Waits until the engine has received `n` plans.
pub async fn wait_plans(probe: &FakeProbe, n: usize) {
    let deadline = Instant::now() + WAIT;
    while probe.plan_count() < n {
        assert!(
            Instant::now() < deadline,
            "engine got {} of {n} plans",
            probe.plan_count()
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Tokens a plan feeds the model.
pub fn plan_tokens(plan: &StepPlan) -> usize {
    plan.work.iter().map(SeqWork::max_tokens).sum()
}

/// Nothing queued, running or reserved; every slot free.
pub fn assert_no_leaks(s: &SchedulerStats) {
    assert_eq!(
        (
            s.queued,
            s.running,
            s.releasing,
            s.free_slots,
            s.kv_reserved_tokens
        ),
        (0, 0, 0, s.max_seqs, 0),
        "{s:#?}"
    );
}
