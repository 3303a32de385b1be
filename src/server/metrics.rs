//! `GET /metrics`: the scheduler's [`SchedulerStats`] and the HTTP layer's
//! counters in the Prometheus text exposition format (version 0.0.4).
//!
//! Everything is rendered from one snapshot per scrape; nothing here keeps
//! state. Histograms come from the scheduler's fixed buckets (cumulative
//! `_bucket{le=…}` lines, `+Inf`, `_sum`, `_count`); latencies are in
//! seconds. MTP counters are exported as 0 until the engine drafts, so that
//! dashboards can be built against the final names now.

use std::fmt::Write;

use super::state::AppState;
use crate::scheduler::{HistogramSnapshot, SchedulerStats};

/// The `Content-Type` of the exposition format.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Renders all metrics. `stats` is `None` while loading or once the
/// scheduler has stopped; the scheduler's metrics are then left out.
pub fn render(state: &AppState, stats: Option<&SchedulerStats>) -> String {
    let mut out = String::with_capacity(8 * 1024);
    let phase = state.phase_name();
    metric(
        &mut out,
        "tandem_ready",
        "gauge",
        "1 when the model is loaded and the server accepts requests.",
    );
    sample(
        &mut out,
        "tandem_ready",
        "",
        (phase == "ready") as u64 as f64,
    );

    metric(
        &mut out,
        "tandem_http_responses_total",
        "counter",
        "HTTP responses by route and status code.",
    );
    for ((route, status), n) in state.responses() {
        let labels = format!("route=\"{route}\",code=\"{status}\"");
        sample(&mut out, "tandem_http_responses_total", &labels, n as f64);
    }

    if let Some(s) = stats {
        scheduler(&mut out, s);
    }
    out
}

fn scheduler(out: &mut String, s: &SchedulerStats) {
    let gauges: [(&str, &str, usize); 11] = [
        (
            "tandem_queue_depth",
            "Requests waiting for a slot.",
            s.queued,
        ),
        (
            "tandem_running_sequences",
            "Sequences holding a slot and generating.",
            s.running,
        ),
        (
            "tandem_releasing_sequences",
            "Slots whose request ended, freed at the next step.",
            s.releasing,
        ),
        (
            "tandem_free_slots",
            "Slots free for admission.",
            s.free_slots,
        ),
        (
            "tandem_max_sequences",
            "Sequence slots (max_seqs).",
            s.max_seqs,
        ),
        (
            "tandem_kv_reserved_tokens",
            "KV cache tokens in blocks owned by some sequence.",
            s.kv_reserved_tokens,
        ),
        (
            "tandem_kv_capacity_tokens",
            "KV cache capacity in tokens.",
            s.kv_capacity_tokens,
        ),
        (
            "tandem_kv_blocks_total",
            "KV cache blocks in the pool.",
            s.kv_blocks_total,
        ),
        (
            "tandem_kv_blocks_used",
            "KV cache blocks owned by some sequence.",
            s.kv_blocks_used,
        ),
        (
            "tandem_kv_blocks_cached",
            "KV cache blocks nobody owns that hold a cached prefix (evictable).",
            s.kv_blocks_cached,
        ),
        (
            "tandem_preempted_sequences",
            "Sequences preempted and waiting to be recomputed.",
            s.preempted,
        ),
    ];
    for (name, help, v) in gauges {
        metric(out, name, "gauge", help);
        sample(out, name, "", v as f64);
    }

    let counters: [(&str, &str, u64); 12] = [
        (
            "tandem_prefix_cache_queries_total",
            "Prefix-cache lookups (admissions and resumptions).",
            s.prefix_cache_queries,
        ),
        (
            "tandem_prefix_cache_query_tokens_total",
            "Prompt tokens looked up in the prefix cache.",
            s.prefix_cache_query_tokens,
        ),
        (
            "tandem_prefix_cache_hit_tokens_total",
            "Prompt tokens found in the prefix cache (not computed).",
            s.prefix_cache_hit_tokens,
        ),
        (
            "tandem_prefix_cache_evictions_total",
            "Cached KV blocks taken back for new ones.",
            s.prefix_cache_evictions,
        ),
        (
            "tandem_preemptions_total",
            "Sequences preempted when KV blocks ran out.",
            s.preemptions,
        ),
        (
            "tandem_steps_total",
            "Step plans run by the engine.",
            s.steps,
        ),
        (
            "tandem_prompt_tokens_total",
            "Prompt tokens fed to the model.",
            s.prompt_tokens_processed,
        ),
        (
            "tandem_generated_tokens_total",
            "Tokens generated.",
            s.tokens_generated,
        ),
        (
            "tandem_requests_submitted_total",
            "Requests accepted for generation.",
            s.requests_submitted,
        ),
        (
            "tandem_mtp_drafted_tokens_total",
            "Tokens drafted by speculative (MTP) decoding.",
            s.mtp_drafted,
        ),
        (
            "tandem_mtp_accepted_tokens_total",
            "Drafted tokens the target accepted.",
            s.mtp_accepted,
        ),
        (
            "tandem_mtp_speculative_steps_total",
            "Sequence-steps that verified drafts.",
            s.mtp_speculative_steps,
        ),
    ];
    for (name, help, v) in counters {
        metric(out, name, "counter", help);
        sample(out, name, "", v as f64);
    }

    metric(
        out,
        "tandem_sampler_calls_total",
        "counter",
        "Sampler calls by dispatch path.",
    );
    sample(
        out,
        "tandem_sampler_calls_total",
        "path=\"uniform\"",
        s.sampler_uniform_calls as f64,
    );
    sample(
        out,
        "tandem_sampler_calls_total",
        "path=\"serial\"",
        s.sampler_serial_calls as f64,
    );

    metric(
        out,
        "tandem_requests_total",
        "counter",
        "Requests by outcome.",
    );
    for (outcome, n) in [
        ("finished", s.requests_finished),
        ("cancelled", s.requests_cancelled),
        ("failed", s.requests_failed),
        ("rejected", s.requests_rejected),
    ] {
        sample(
            out,
            "tandem_requests_total",
            &format!("outcome=\"{outcome}\""),
            n as f64,
        );
    }

    let t = &s.metrics.steps;
    metric(
        out,
        "tandem_engine_seconds_total",
        "counter",
        "Engine time summed over steps, by phase.",
    );
    for (phase, d) in [
        ("forward", t.forward_total),
        ("sample", t.sample_total),
        ("draft", t.draft_total),
        ("step", t.engine_total),
    ] {
        sample(
            out,
            "tandem_engine_seconds_total",
            &format!("phase=\"{phase}\""),
            d.as_secs_f64(),
        );
    }

    histogram(
        out,
        "tandem_batch_size",
        "Sequences per forward pass.",
        &s.metrics.batch_size,
    );
    histogram(
        out,
        "tandem_time_to_first_token_seconds",
        "Seconds from submission to the first token.",
        &s.metrics.time_to_first_token,
    );
    histogram(
        out,
        "tandem_inter_token_latency_seconds",
        "Seconds per token between consecutive token events of a request.",
        &s.metrics.inter_token_latency,
    );
}

fn metric(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

fn sample(out: &mut String, name: &str, labels: &str, v: f64) {
    if labels.is_empty() {
        let _ = writeln!(out, "{name} {v}");
    } else {
        let _ = writeln!(out, "{name}{{{labels}}} {v}");
    }
}

fn histogram(out: &mut String, name: &str, help: &str, h: &HistogramSnapshot) {
    metric(out, name, "histogram", help);
    let mut cumulative = 0;
    for (bound, count) in h.bounds.iter().zip(&h.counts) {
        cumulative += count;
        let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {cumulative}");
    }
    let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", h.count);
    let _ = writeln!(out, "{name}_sum {}", h.sum);
    let _ = writeln!(out, "{name}_count {}", h.count);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::state::HttpConfig;

    #[test]
    fn histograms_are_cumulative() {
        let h = HistogramSnapshot {
            bounds: vec![1.0, 2.0],
            counts: vec![2, 1, 1],
            count: 4,
            sum: 7.5,
            min: 0.5,
            max: 3.0,
        };
        let mut out = String::new();
        histogram(&mut out, "x", "help", &h);
        assert!(out.contains("x_bucket{le=\"1\"} 2\n"));
        assert!(out.contains("x_bucket{le=\"2\"} 3\n"));
        assert!(out.contains("x_bucket{le=\"+Inf\"} 4\n"));
        assert!(out.contains("x_sum 7.5\nx_count 4\n"));
    }

    #[test]
    fn loading_server_exports_readiness_only() {
        let state = AppState::new(HttpConfig::default());
        state.count_response("health", 503);
        let text = render(&state, None);
        assert!(text.contains("tandem_ready 0\n"));
        assert!(text.contains("tandem_http_responses_total{route=\"health\",code=\"503\"} 1\n"));
        assert!(!text.contains("tandem_queue_depth"));
    }
}
