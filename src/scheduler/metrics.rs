//! Counters, histograms and step timings, and the [`SchedulerStats`] snapshot
//! that the `Stats` message returns.
//!
//! All of it is owned by the scheduling core and updated on the actor's
//! thread, so plain fields suffice (no atomics, no locks). Snapshots are
//! copies; a consumer (HTTP `/metrics`, a benchmark) never holds a reference
//! into live state.
//!
//! Durations in histograms are recorded in seconds, as Prometheus does.

use std::time::Duration;

/// A fixed-bucket histogram: `counts[i]` holds values `<= bounds[i]` (and
/// above `bounds[i - 1]`); the last count holds values above every bound.
#[derive(Debug, Clone)]
pub(crate) struct Histogram {
    bounds: Vec<f64>,
    counts: Vec<u64>,
    count: u64,
    sum: f64,
    min: f64,
    max: f64,
}

impl Histogram {
    /// A histogram with the given ascending upper bounds.
    pub fn with_bounds(bounds: Vec<f64>) -> Self {
        let counts = vec![0; bounds.len() + 1];
        Self {
            bounds,
            counts,
            count: 0,
            sum: 0.0,
            min: f64::INFINITY,
            max: f64::NEG_INFINITY,
        }
    }

    /// `n` bounds `start, start·factor, start·factor², …`.
    pub fn exponential(start: f64, factor: f64, n: usize) -> Self {
        Self::with_bounds(
            std::iter::successors(Some(start), |b| Some(b * factor))
                .take(n)
                .collect(),
        )
    }

    /// Latencies from 100 µs to about 52 s, doubling.
    pub fn latency() -> Self {
        Self::exponential(1e-4, 2.0, 20)
    }

    /// Batch sizes: one bucket per size up to 256 slots, doubling beyond.
    pub fn batch_size(max_seqs: usize) -> Self {
        let exact = max_seqs.min(256);
        let mut bounds: Vec<f64> = (1..=exact).map(|n| n as f64).collect();
        let mut b = exact * 2;
        while exact < max_seqs && b < max_seqs * 2 {
            bounds.push(b.min(max_seqs) as f64);
            b *= 2;
        }
        Self::with_bounds(bounds)
    }

    pub fn record(&mut self, v: f64) {
        let i = self.bounds.partition_point(|&b| b < v);
        self.counts[i] += 1;
        self.count += 1;
        self.sum += v;
        self.min = self.min.min(v);
        self.max = self.max.max(v);
    }

    pub fn record_duration(&mut self, d: Duration) {
        self.record(d.as_secs_f64());
    }

    pub fn snapshot(&self) -> HistogramSnapshot {
        HistogramSnapshot {
            bounds: self.bounds.clone(),
            counts: self.counts.clone(),
            count: self.count,
            sum: self.sum,
            min: if self.count == 0 { 0.0 } else { self.min },
            max: if self.count == 0 { 0.0 } else { self.max },
        }
    }
}

/// A copy of a histogram.
#[derive(Debug, Clone, PartialEq)]
pub struct HistogramSnapshot {
    /// Ascending upper bounds of the buckets.
    pub bounds: Vec<f64>,
    /// One count per bound, plus a last one for values above every bound.
    pub counts: Vec<u64>,
    /// Values recorded.
    pub count: u64,
    /// Sum of the values recorded.
    pub sum: f64,
    /// Smallest value recorded (0 when empty).
    pub min: f64,
    /// Largest value recorded (0 when empty).
    pub max: f64,
}

impl HistogramSnapshot {
    /// Arithmetic mean (0 when empty).
    pub fn mean(&self) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            self.sum / self.count as f64
        }
    }

    /// An upper estimate of the `q`-quantile (`q` in `[0, 1]`): the upper
    /// bound of the bucket holding it, clamped to the observed min and max.
    pub fn quantile(&self, q: f64) -> f64 {
        if self.count == 0 {
            return 0.0;
        }
        let rank = ((q.clamp(0.0, 1.0) * self.count as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (i, &c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                let upper = self.bounds.get(i).copied().unwrap_or(self.max);
                return upper.clamp(self.min, self.max);
            }
        }
        self.max
    }
}

/// Where the time of each step goes, summed over steps.
#[derive(Debug, Clone, Default)]
pub(crate) struct StepTimings {
    steps: u64,
    engine: Duration,
    forward: Duration,
    sample: Duration,
    draft: Duration,
    round_trip: Duration,
    round_trip_max: Duration,
    plan: Duration,
    plan_max: Duration,
    route: Duration,
    route_max: Duration,
    busy_wall: Duration,
    busy_engine: Duration,
}

impl StepTimings {
    /// An outcome arrived: the engine's own timings, and the time from
    /// submitting the plan to handling its outcome.
    pub fn record_outcome(&mut self, stats: &crate::engine::StepStats, round_trip: Duration) {
        self.steps += 1;
        self.engine += stats.total;
        self.forward += stats.forward;
        self.sample += stats.sample;
        self.draft += stats.draft;
        self.round_trip += round_trip;
        self.round_trip_max = self.round_trip_max.max(round_trip);
    }

    /// Time from handling an outcome to submitting the next plan (the
    /// scheduler's share of the critical path).
    pub fn record_plan(&mut self, d: Duration) {
        self.plan += d;
        self.plan_max = self.plan_max.max(d);
    }

    /// Time spent routing events after submitting (overlaps the engine).
    pub fn record_route(&mut self, d: Duration) {
        self.route += d;
        self.route_max = self.route_max.max(d);
    }

    /// Back-to-back steps: the wall time between two submissions, and the
    /// engine time of the step that ran in between.
    pub fn record_busy_interval(&mut self, wall: Duration, engine: Duration) {
        self.busy_wall += wall;
        self.busy_engine += engine;
    }

    pub fn snapshot(&self) -> StepTimingSnapshot {
        StepTimingSnapshot {
            steps: self.steps,
            engine_total: self.engine,
            forward_total: self.forward,
            sample_total: self.sample,
            draft_total: self.draft,
            round_trip_total: self.round_trip,
            round_trip_max: self.round_trip_max,
            plan_total: self.plan,
            plan_max: self.plan_max,
            route_total: self.route,
            route_max: self.route_max,
            busy_wall_total: self.busy_wall,
            busy_engine_total: self.busy_engine,
        }
    }
}

/// Step timing aggregates, for reporting the scheduler's overhead.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepTimingSnapshot {
    /// Outcomes received.
    pub steps: u64,
    /// Sum of the engine's whole-step time ([`crate::engine::StepStats::total`]).
    pub engine_total: Duration,
    /// Sum of the engine's forward-pass time.
    pub forward_total: Duration,
    /// Sum of the engine's sampler time (verification of drafts included).
    pub sample_total: Duration,
    /// Sum of the engine's drafting time (speculative decoding).
    pub draft_total: Duration,
    /// Sum over steps of plan submitted → outcome handled by the actor
    /// (engine time plus the two channel hops and mailbox wait).
    pub round_trip_total: Duration,
    pub round_trip_max: Duration,
    /// Sum over steps of outcome handled → next plan submitted (counter
    /// updates plus planning: the scheduler's share of the critical path).
    pub plan_total: Duration,
    pub plan_max: Duration,
    /// Sum over steps of routing events after submitting (off the critical
    /// path: it overlaps the next step).
    pub route_total: Duration,
    pub route_max: Duration,
    /// Wall time between consecutive submissions of back-to-back steps (idle
    /// gaps excluded) …
    pub busy_wall_total: Duration,
    /// … and the engine time of the same steps.
    pub busy_engine_total: Duration,
}

impl StepTimingSnapshot {
    /// Share of busy wall time in which the engine was not computing
    /// (scheduler work plus hand-off latency); 0 when nothing ran.
    pub fn overhead_fraction(&self) -> f64 {
        let wall = self.busy_wall_total.as_secs_f64();
        if wall == 0.0 {
            return 0.0;
        }
        (1.0 - self.busy_engine_total.as_secs_f64() / wall).max(0.0)
    }
}

/// The live histograms and timings.
#[derive(Debug, Clone)]
pub(crate) struct Metrics {
    pub batch_size: Histogram,
    pub time_to_first_token: Histogram,
    pub inter_token_latency: Histogram,
    pub steps: StepTimings,
}

impl Metrics {
    pub fn new(max_seqs: usize) -> Self {
        Self {
            batch_size: Histogram::batch_size(max_seqs),
            time_to_first_token: Histogram::latency(),
            inter_token_latency: Histogram::latency(),
            steps: StepTimings::default(),
        }
    }

    pub fn snapshot(&self) -> MetricsSnapshot {
        MetricsSnapshot {
            batch_size: self.batch_size.snapshot(),
            time_to_first_token: self.time_to_first_token.snapshot(),
            inter_token_latency: self.inter_token_latency.snapshot(),
            steps: self.steps.snapshot(),
        }
    }
}

/// A copy of the scheduler's histograms and step timings.
#[derive(Debug, Clone, PartialEq)]
pub struct MetricsSnapshot {
    /// Sequences per forward pass (steps with work only).
    pub batch_size: HistogramSnapshot,
    /// Seconds from `Submit` to the first token, per request.
    pub time_to_first_token: HistogramSnapshot,
    /// Seconds per token between consecutive `Tokens` events of a request.
    pub inter_token_latency: HistogramSnapshot,
    /// Engine time vs. scheduler time per step.
    pub steps: StepTimingSnapshot,
}

/// Everything the `Stats` message reports.
#[derive(Debug, Clone, PartialEq)]
pub struct SchedulerStats {
    /// Requests waiting for a slot.
    pub queued: usize,
    /// Sequences holding a slot and generating.
    pub running: usize,
    /// Slots whose request ended but whose release the engine has not been
    /// sent yet (they become free at the next step boundary).
    pub releasing: usize,
    /// Slots free for admission.
    pub free_slots: usize,
    /// Total slots (`max_seqs`).
    pub max_seqs: usize,
    /// KV tokens in blocks owned by some sequence (`kv_blocks_used ·
    /// kv_block_size`).
    pub kv_reserved_tokens: usize,
    /// KV pool capacity in tokens (from the engine).
    pub kv_capacity_tokens: usize,
    /// Tokens per KV block.
    pub kv_block_size: usize,
    /// Blocks of the pool.
    pub kv_blocks_total: usize,
    /// Blocks owned by at least one sequence.
    pub kv_blocks_used: usize,
    /// Blocks nobody owns that hold a cached prefix (evictable).
    pub kv_blocks_cached: usize,
    /// Prefix-cache lookups (admissions and resumptions).
    pub prefix_cache_queries: u64,
    /// Tokens looked up / found cached (whole blocks).
    pub prefix_cache_query_tokens: u64,
    pub prefix_cache_hit_tokens: u64,
    /// Cached blocks reused for new ones under memory pressure.
    pub prefix_cache_evictions: u64,
    /// Sequences preempted (their blocks freed, recomputed later).
    pub preemptions: u64,
    /// Sequences preempted now, waiting to resume.
    pub preempted: usize,
    /// Plans submitted to the engine.
    pub steps: u64,
    /// Prompt tokens the engine has fed.
    pub prompt_tokens_processed: u64,
    /// Tokens the engine has generated (including ones discarded because
    /// their request had just been cancelled).
    pub tokens_generated: u64,
    /// Draft tokens proposed by speculative decoding.
    pub mtp_drafted: u64,
    /// Draft tokens the target accepted.
    pub mtp_accepted: u64,
    /// Sequence-steps that verified drafts (mean accepted per speculative
    /// step = `mtp_accepted / mtp_speculative_steps`).
    pub mtp_speculative_steps: u64,
    /// Sampler calls on the fused uniform path.
    pub sampler_uniform_calls: u64,
    /// Sampler calls on the serial path.
    pub sampler_serial_calls: u64,
    /// Mean sequences per forward pass (steps with work only).
    pub mean_seqs_per_step: f64,
    /// Most sequences in one forward pass.
    pub max_seqs_per_step: usize,
    /// Requests accepted by `Submit`.
    pub requests_submitted: u64,
    /// Requests refused by `Submit` (invalid, overloaded, shutting down).
    pub requests_rejected: u64,
    /// Requests that ended with `Finished` (any reason but cancellation).
    pub requests_finished: u64,
    /// Requests cancelled (client, stop string, gone, shutdown).
    pub requests_cancelled: u64,
    /// Requests that ended with `Failed`.
    pub requests_failed: u64,
    /// Histograms and step timings.
    pub metrics: MetricsSnapshot,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_and_quantiles() {
        let mut h = Histogram::with_bounds(vec![1.0, 2.0, 4.0]);
        for v in [0.5, 1.0, 1.5, 3.0, 10.0] {
            h.record(v);
        }
        let s = h.snapshot();
        assert_eq!(s.counts, vec![2, 1, 1, 1]);
        assert_eq!((s.count, s.min, s.max), (5, 0.5, 10.0));
        assert!((s.mean() - 3.2).abs() < 1e-9);
        assert_eq!(s.quantile(0.4), 1.0);
        assert_eq!(s.quantile(0.6), 2.0);
        assert_eq!(s.quantile(1.0), 10.0, "overflow bucket reports the max");
        assert_eq!(Histogram::latency().snapshot().quantile(0.5), 0.0);
    }

    #[test]
    fn batch_size_buckets() {
        let h = Histogram::batch_size(4);
        assert_eq!(h.snapshot().bounds, vec![1.0, 2.0, 3.0, 4.0]);
        let big = Histogram::batch_size(1000).snapshot().bounds;
        assert_eq!(big.len(), 256 + 2);
        assert_eq!(big[256..], [512.0, 1000.0]);
    }

    #[test]
    fn overhead_fraction() {
        let mut t = StepTimings::default();
        t.record_busy_interval(Duration::from_millis(10), Duration::from_millis(9));
        assert!((t.snapshot().overhead_fraction() - 0.1).abs() < 1e-9);
    }
}
