//! Sampler throughput: the uniform path against the serial path on the same
//! inputs, for B ∈ {1, 8, 64} at V = 32 000, with and without penalties.
//!
//! The options are temperature 0.8 + top-k 40 + top-p 0.9 (and, "+pen",
//! repeat 1.1 / presence 0.2 / frequency 0.1 over 64 tokens, rings full
//! from 64 priors so the uniform path applies). The serial figures force
//! the serial path on the very same sampler state through the hidden
//! `Sampler::sample_serial_for_bench`, which runs the production serial
//! code; nothing is slowed down artificially. `uniform/+pen/B=64` is the
//! absolute figure for one engine step at B = 64 (goal: under ~12 ms).
//! `uniform/greedy/B=64` shows the cheapest case (argmax only).
//!
//! The uniform path's gain over the serial one is its thread parallelism
//! (the per-row work is identical), so the ratio is bounded by the cores
//! that are actually free while the bench runs.
//!
//! Run: `cargo bench --bench sampler`.

use std::hint::black_box;
use std::time::Duration;

use candle_core::{Device, Tensor};
use criterion::{criterion_group, criterion_main, Criterion};
use tandem::sampler::{SamplePath, Sampler, SamplingOptions};

const V: usize = 32_000;

/// Deterministic logits shaped like a model's: a bulk around 0 and a few
/// strong candidates per row.
fn logits(b: usize) -> Tensor {
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 24) as f32
    };
    let mut data = Vec::with_capacity(b * V);
    for _ in 0..b {
        for i in 0..V {
            let bulk = (next() + next() + next() - 1.5) * 3.0;
            let peak = if i % 997 == 0 { 8.0 * next() } else { 0.0 };
            data.push(bulk + peak);
        }
    }
    Tensor::from_vec(data, (b, V), &Device::Cpu).expect("bench logits")
}

fn options(penalties: bool, seed: u64) -> SamplingOptions {
    let mut o = SamplingOptions {
        temperature: 0.8,
        top_k: 40,
        top_p: 0.9,
        seed: Some(seed),
        ..SamplingOptions::default()
    };
    if penalties {
        o.repeat_penalty = 1.1;
        o.presence_penalty = 0.2;
        o.frequency_penalty = 0.1;
        o.repeat_last_n = 64;
    }
    o
}

fn sampler(b: usize, penalties: bool) -> (Sampler, Vec<u32>) {
    let mut s = Sampler::with_seed(4096, 1);
    let ids: Vec<u32> = (0..b as u32).collect();
    for &id in &ids {
        let priors: Vec<u32> = (0..64).map(|i| (id * 131 + i * 17) % V as u32).collect();
        s.add(id, options(penalties, u64::from(id)), &priors)
            .expect("bench slot");
    }
    (s, ids)
}

fn bench_paths(c: &mut Criterion) {
    let mut group = c.benchmark_group("sampler");
    for penalties in [false, true] {
        for b in [1usize, 8, 64] {
            let t = logits(b);
            let tag = if penalties { "+pen" } else { "plain" };
            let (mut s, ids) = sampler(b, penalties);
            assert_eq!(
                s.sample(&ids, &t).expect("sample").path,
                SamplePath::Uniform
            );
            group.bench_function(format!("uniform/{tag}/B={b}"), |bench| {
                bench.iter(|| black_box(s.sample(&ids, &t).expect("sample")))
            });
            let (mut s, ids) = sampler(b, penalties);
            group.bench_function(format!("serial/{tag}/B={b}"), |bench| {
                bench.iter(|| black_box(s.sample_serial_for_bench(&ids, &t).expect("sample")))
            });
        }
    }
    // Greedy without penalties: the no-truncation fast case.
    let t = logits(64);
    let mut s = Sampler::with_seed(4096, 1);
    let ids: Vec<u32> = (0..64).collect();
    for &id in &ids {
        s.add(id, SamplingOptions::greedy(), &[])
            .expect("bench slot");
    }
    group.bench_function("uniform/greedy/B=64", |bench| {
        bench.iter(|| black_box(s.sample(&ids, &t).expect("sample")))
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(20);
    targets = bench_paths
}
criterion_main!(benches);
