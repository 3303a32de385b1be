//! Decode and prefill speed of the ragged forward pass (model + unembedding,
//! no sampler) on a random-weight model of the `llama-100m` benchmark shape
//! (`../shared/bench/llama-100m/config.json`: hidden 768, 12 layers, 12 heads /
//! 4 KV heads, MLP 2048, vocab 32 000, untied), in f32.
//!
//! decode/B: B sequences, each with its own 128-token prompt already in its
//! cache; one iteration = one step feeding one token per sequence. The cache
//! is rolled back after each step (speculation `begin`/`commit(0)`), so every
//! iteration sees 128 cached positions. Throughput is tokens/s = B / step.
//! prefill: one 128-token prompt into an empty cache.
//!
//! Run: `cargo bench --bench forward` (set TANDEM_BENCH_BATCHES=1,4 to subset).

use std::time::{Duration, Instant};

use candle_core::Device;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use tandem::kv::KvCache;
use tandem::model::{Batch, LoadOptions, Model, ModelConfig, OutputRows, Weights};

const LLAMA_100M: &str = r#"{
  "architectures": ["LlamaForCausalLM"], "hidden_size": 768, "intermediate_size": 2048,
  "num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 64,
  "vocab_size": 32000, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
  "rope_theta": 10000.0, "tie_word_embeddings": false
}"#;

const PROMPT: usize = 128;

fn prompt(seq: u32) -> Vec<u32> {
    (0..PROMPT as u32)
        .map(|i| (seq * 7919 + i * 104_729) % 32_000)
        .collect()
}

fn batches() -> Vec<usize> {
    std::env::var("TANDEM_BENCH_BATCHES")
        .ok()
        .map(|s| s.split(',').filter_map(|x| x.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![1, 4, 16, 64])
}

fn bench(c: &mut Criterion) {
    let cfg = ModelConfig::from_json(LLAMA_100M).expect("valid config");
    let weights = Weights::random(&cfg, 0, 0.02).expect("random weights");
    let model = Model::load(cfg, &weights, &LoadOptions::default()).expect("model");
    drop(weights);

    let mut group = c.benchmark_group("forward");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(6));
    for b in batches() {
        let mut kv = KvCache::new(model.kv_layout(), Device::Cpu, b * (PROMPT + 8));
        let mut step = Batch::default();
        for s in 0..b as u32 {
            kv.allocate(s, PROMPT + 8).unwrap();
            let mut p = Batch::default();
            p.push(s, 0, &prompt(s), OutputRows::None);
            model.forward(&p, &mut kv).unwrap();
            step.push(s, PROMPT, &[s + 1], OutputRows::Last);
        }
        group.throughput(Throughput::Elements(b as u64));
        group.bench_with_input(BenchmarkId::new("decode", b), &b, |bench, _| {
            bench.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    for s in 0..b as u32 {
                        kv.begin(s).unwrap();
                    }
                    let t = Instant::now();
                    let logits = model
                        .unembed(&model.forward(&step, &mut kv).unwrap())
                        .unwrap();
                    std::hint::black_box(logits);
                    total += t.elapsed();
                    for s in 0..b as u32 {
                        kv.commit(s, 0).unwrap();
                    }
                }
                total
            })
        });
    }
    group.throughput(Throughput::Elements(PROMPT as u64));
    group.bench_function("prefill/128", |bench| {
        let mut kv = KvCache::new(model.kv_layout(), Device::Cpu, PROMPT);
        kv.allocate(0, PROMPT).unwrap();
        let mut p = Batch::default();
        p.push(0, 0, &prompt(0), OutputRows::Last);
        bench.iter(|| {
            kv.begin(0).unwrap();
            let logits = model.unembed(&model.forward(&p, &mut kv).unwrap()).unwrap();
            kv.commit(0, 0).unwrap();
            logits
        })
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
