//! Decode and prompt-processing speed of the forward pass (model +
//! unembedding, no sampler) on random weights of the `llama-100m` benchmark
//! shape (`../shared/bench/llama-100m/config.json`: hidden 768, 12 layers,
//! 12 heads / 4 KV heads, MLP 2048, vocab 32 000, untied), in the workload
//! of llama.cpp's `llama-batched-bench -npp 128 -ntg 128`:
//!
//! - B sequences, each with its own 128-token prompt, prefilled in forward
//!   passes of at most 512 tokens (llama.cpp's micro-batch) → prompt
//!   processing tokens/s = B·128 / prefill time;
//! - then 128 decode steps, one token per sequence per step, positions
//!   128..256 → decode tokens/s = B·128 / decode time.
//!
//! Each configuration runs `TANDEM_BENCH_REPS` times (default 3), the
//! repetitions interleaved across configurations so that the noise of a
//! shared machine falls on all of them alike; the table shows medians.
//!
//! Run: `cargo bench --bench forward`. Environment:
//! - `TANDEM_BENCH_BATCHES=1,4,16,64` batch sizes;
//! - `TANDEM_BENCH_FORMATS=f32,f16,q8_0` weight formats (also `q4_k`,
//!   `as-stored` — a GGUF's own quantised blocks — and `candle-f32` /
//!   `candle-f16` for the candle-op reference path; a `-flat` suffix,
//!   e.g. `q8_0-flat`, keeps Q8_0 blocks in GGML's layout instead of
//!   repacking them for the register tile);
//! - `TANDEM_BENCH_REPS=3`, `TANDEM_BENCH_STEPS=128`, `TANDEM_BENCH_PROMPT=128`
//!   (prompt tokens per sequence; a prompt longer than 512 prefills in
//!   one pass of its own);
//! - `TANDEM_BENCH_SPAN=k` makes every decode step a verifying pass's
//!   shape: k rows a sequence (a token and k − 1 drafts), all unembedded;
//!   decode tokens/s then counts steps × B (sequence-steps), so its ratio
//!   to span 1 is what a pass of k rows costs against a plain one;
//! - `TANDEM_BENCH_THREADS=N` caps the lean kernels' threads;
//! - `TANDEM_BENCH_ACTIVATIONS=int16` runs quantised weights with 15-bit
//!   activations instead of the default 8-bit ones;
//! - `TANDEM_BENCH_KV_DTYPE=f32` keeps the CPU's KV cache in f32 instead
//!   of f16 (as `--kv-dtype`);
//! - `TANDEM_BENCH_PROFILE=1` adds a per-phase breakdown of one more
//!   decode run per configuration;
//! - `TANDEM_BENCH_DEVICE=cuda` runs on GPU 0 (a `--features cuda`
//!   build; formats `bf16`, `f16`, `f32` there; each decode step ends with
//!   its greedy ids on the host, as in serving), and times one sampler
//!   call per batch size with top-p and penalties on the device against
//!   the same call after copying the logits to the host;
//! - `TANDEM_BENCH_MODEL=DIR` (or `FILE.gguf`) benchmarks a Hugging Face
//!   model directory's (or a GGUF file's) own config and weights instead
//!   of the random llama-100m;
//! - `TANDEM_BENCH_AGREEMENT=1` adds, for each non-f32 format, the greedy
//!   agreement with f32 over 64-token continuations of 8 prompts (fraction
//!   of identical tokens position by position, and the mean length of the
//!   identical prefix);
//! - `TANDEM_CPU_FEW_ROWS=stream|halves|tile` fixes the f32/f16 linear's path for
//!   calls of a few rows, which otherwise each projection shape settles by
//!   timing its first calls (the bench prints what settled);
//! - `TANDEM_BENCH_ROOFLINE=1` (CPU) adds single-stream decode against the
//!   memory roofline measured in the same run: before every decode step, a
//!   streaming sum over a buffer as large as what the step reads (weights
//!   past the embedding table, plus the KV), on 2 MiB pages and the same
//!   number of threads. Interleaving step by step puts both under the same
//!   memory conditions, which on a shared host change within seconds. The
//!   lean path's phases follow, each against the streaming time of the
//!   bytes it reads (its weights, or the KV for attention).

use std::time::{Duration, Instant};

use candle_core::{DType, Device};
use tandem::kv::KvCache;
use tandem::model::{
    Batch, Isa, LoadOptions, Model, ModelConfig, OutputRows, ProjectionBytes, WeightFormat, Weights,
};

const LLAMA_100M: &str = r#"{
  "architectures": ["LlamaForCausalLM"], "hidden_size": 768, "intermediate_size": 2048,
  "num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 64,
  "vocab_size": 32000, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
  "rope_theta": 10000.0, "tie_word_embeddings": false
}"#;

/// Prompt tokens per sequence (`TANDEM_BENCH_PROMPT`, 128 by default).
fn prompt_len() -> usize {
    static LEN: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *LEN.get_or_init(|| env_usize("TANDEM_BENCH_PROMPT", 128).max(1))
}
/// Rows of each sequence in a decode step (`TANDEM_BENCH_SPAN`, 1 by
/// default): above 1, every step is a verifying pass's shape, a token and
/// `span - 1` drafts, every row unembedded.
fn span() -> usize {
    static SPAN: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *SPAN.get_or_init(|| env_usize("TANDEM_BENCH_SPAN", 1).max(1))
}

/// Tokens per prefill forward pass (llama.cpp's `-ub 512`).
const UBATCH: usize = 512;

fn env_list(name: &str, default: &str) -> Vec<String> {
    std::env::var(name)
        .unwrap_or_else(|_| default.to_string())
        .split(',')
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect()
}

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A prompt of ids below `vocab` (the same ids for every model of at
/// least 32 000 tokens).
fn prompt(seq: u32, vocab: u32) -> Vec<u32> {
    (0..prompt_len() as u32)
        .map(|i| (seq * 7919 + i * 104_729) % 32_000 % vocab)
        .collect()
}

/// `TANDEM_BENCH_DEVICE`: the CPU (default) or GPU 0.
fn bench_device() -> Device {
    match std::env::var("TANDEM_BENCH_DEVICE").as_deref() {
        Err(_) | Ok("cpu") => Device::Cpu,
        Ok("cuda") => Device::new_cuda(0)
            .expect("TANDEM_BENCH_DEVICE=cuda needs a --features cuda build and a GPU"),
        Ok(other) => panic!("TANDEM_BENCH_DEVICE: cpu or cuda, got `{other}`"),
    }
}

/// One weight format's model.
struct Config {
    name: String,
    model: Model,
}

fn load(name: &str, weights: &Weights, cfg: &ModelConfig, device: &Device) -> Config {
    let (base, repack) = match name.strip_suffix("-flat") {
        Some(base) => (base, false),
        None => (name, true),
    };
    let (dtype, format, lean) = match base {
        "f32" => (DType::F32, WeightFormat::AsCompute, true),
        "as-stored" => (DType::F32, WeightFormat::AsStored, true),
        "f16" => (DType::F16, WeightFormat::AsCompute, true),
        "bf16" => (DType::BF16, WeightFormat::AsCompute, true),
        "q8_0" => (DType::F32, WeightFormat::Q8_0, true),
        "q4_k" => (DType::F32, WeightFormat::Q4K, true),
        "candle-f32" => (DType::F32, WeightFormat::AsCompute, false),
        "candle-f16" => (DType::F16, WeightFormat::AsCompute, false),
        other => panic!("unknown format `{other}` in TANDEM_BENCH_FORMATS"),
    };
    let opts = LoadOptions {
        dtype,
        weight_format: format,
        lean_cpu: lean,
        device: device.clone(),
        threads: std::env::var("TANDEM_BENCH_THREADS")
            .ok()
            .and_then(|v| v.parse().ok()),
        activation_quant: std::env::var("TANDEM_BENCH_ACTIVATIONS")
            .map(|v| v.parse().expect("TANDEM_BENCH_ACTIVATIONS: int8 or int16"))
            .unwrap_or_default(),
        kv_dtype: std::env::var("TANDEM_BENCH_KV_DTYPE").map_or(None, |v| {
            tandem::server::load::parse_kv_dtype(&v).expect("TANDEM_BENCH_KV_DTYPE")
        }),
        repack_quantised: repack,
    };
    let model = Model::load(cfg.clone(), weights, &opts).expect("model loads");
    Config {
        name: name.to_string(),
        model,
    }
}

/// Per-phase times of a run's prefill and decode (empty unless profiling).
type Phases = Vec<(&'static str, Duration)>;

/// What one [`run`] measured.
struct RunTimes {
    prefill: Duration,
    decode: Duration,
    /// Host time spent issuing the decode steps (on a GPU: from a step's
    /// start until the sampler call that waits for its ids).
    issue: Duration,
    prefill_phases: Phases,
    decode_phases: Phases,
}

/// Prefill of `b` prompts and `steps` decode steps; returns both durations
/// (and, with `profile`, the per-phase times of each part).
fn run(model: &Model, b: usize, steps: usize, profile: bool) -> RunTimes {
    model.set_profiling(profile);
    let device = model.device().clone();
    let vocab = model.config().vocab_size as u32;
    let mut kv = KvCache::new(
        model.kv_layout(),
        device.clone(),
        b * (prompt_len() + steps * span()),
    );
    for s in 0..b as u32 {
        kv.allocate(s, prompt_len() + steps * span())
            .expect("KV room");
    }
    // A GPU step ends as the engine's does: its greedy ids through the
    // sampler (an all-greedy call: one argmax launch, the ids to the host).
    let slots: Vec<u32> = (0..b as u32).collect();
    let mut sampler = tandem::sampler::Sampler::with_seed(4096, 1);
    for &s in &slots {
        let greedy = tandem::sampler::SamplingOptions::greedy();
        sampler.add(s, greedy, &[]).expect("sampler slot");
    }
    // Prefill: whole prompts packed into passes of at most UBATCH tokens.
    let start = Instant::now();
    let mut batch = Batch::default();
    for s in 0..b as u32 {
        batch.push(s, 0, &prompt(s, vocab), OutputRows::Last);
        if batch.tokens.len() + prompt_len() > UBATCH || s as usize == b - 1 {
            let h = model.forward(&batch, &mut kv).expect("prefill");
            std::hint::black_box(model.unembed(&h).expect("unembed"));
            device.synchronize().expect("sync");
            batch = Batch::default();
        }
    }
    let prefill = start.elapsed();
    let pre_phases = model.take_profile();
    // Decode: one token per sequence per step (fixed ids: no sampler).
    // Profiling a GPU run synchronises after each part of the step.
    let gpu_profile = profile && !device.is_cpu();
    let mut gpu_phases = [Duration::ZERO; 3];
    let mut mark = |i: usize, t: &mut Instant| {
        if gpu_profile {
            device.synchronize().expect("sync");
            gpu_phases[i] += t.elapsed();
            *t = Instant::now();
        }
    };
    let start = Instant::now();
    let mut issue = Duration::ZERO;
    for step in 0..steps {
        let step_start = Instant::now();
        let mut t = Instant::now();
        let mut batch = Batch::default();
        for s in 0..b as u32 {
            let at = step * span();
            let toks: Vec<u32> = (0..span() as u32)
                .map(|i| (s * 31 + (at as u32 + i) * 17 + 5) % vocab)
                .collect();
            let rows = if span() > 1 {
                OutputRows::All
            } else {
                OutputRows::Last
            };
            batch.push(s, prompt_len() + at, &toks, rows);
        }
        let h = model.forward(&batch, &mut kv).expect("decode");
        mark(0, &mut t);
        let logits = model.unembed(&h).expect("unembed");
        mark(1, &mut t);
        if device.is_cpu() {
            std::hint::black_box(logits);
        } else {
            // A GPU step ends when its greedy ids reach the host.
            issue += step_start.elapsed();
            std::hint::black_box(sampler.sample(&slots, &logits).expect("ids"));
        }
        mark(2, &mut t);
    }
    let decode = start.elapsed();
    let mut phases = model.take_profile();
    if gpu_profile {
        phases.push(("unembed", gpu_phases[1]));
        phases.push(("argmax+ids", gpu_phases[2]));
    }
    model.set_profiling(false);
    RunTimes {
        prefill,
        decode,
        issue,
        prefill_phases: pre_phases,
        decode_phases: phases,
    }
}

/// Decode with CUDA graphs on and off, alternating: step time, host time
/// to issue a step, and what a graph holds.
fn graphs_on_off(configs: &[Config], batches: &[usize], steps: usize, reps: usize) {
    println!("\nCUDA graphs of decode passes, on vs off (alternating, medians of {reps}):");
    for c in configs {
        for &b in batches {
            // Per setting: ms per step, then host ms per step. Graphs run
            // last in each round, so the stats below are this batch's graph.
            let mut times = [Vec::new(), Vec::new(), Vec::new(), Vec::new()];
            for _ in 0..reps {
                for (i, on) in [(2, false), (0, true)] {
                    c.model.set_cuda_graphs(on);
                    let t = run(&c.model, b, steps, false);
                    times[i].push(1e3 * t.decode.as_secs_f64() / steps as f64);
                    times[i + 1].push(1e3 * t.issue.as_secs_f64() / steps as f64);
                }
            }
            let g = c.model.cuda_graph_stats();
            let [on, on_host, off, off_host] = times.map(|mut v| median(&mut v));
            println!(
                "  {:<6} B={b:<3} on: {on:.3} ms/step (host {on_host:.3}), off: {off:.3} ms/step \
                 (host {off_host:.3}); {:.2}x tok/s; a graph holds {} kernels ({} nodes)",
                c.name,
                off / on,
                g.kernels,
                g.nodes,
            );
        }
    }
}

/// Prints each format's greedy agreement with the f32 configuration.
fn agreement(configs: &[Config]) {
    let Some(reference) = configs.iter().find(|c| c.name == "f32") else {
        println!("\n(agreement needs f32 in TANDEM_BENCH_FORMATS)");
        return;
    };
    let vocab = reference.model.config().vocab_size as u32;
    let prompts: Vec<Vec<u32>> = (0..8u32).map(|s| prompt(s, vocab)[..16].to_vec()).collect();
    let want = reference.model.greedy(&prompts, 64).expect("greedy");
    println!("\ngreedy agreement with f32 (8 prompts x 64 tokens):");
    for c in configs.iter().filter(|c| c.name != "f32") {
        let got = c.model.greedy(&prompts, 64).expect("greedy");
        let (mut same, mut prefix) = (0usize, 0usize);
        for (g, w) in got.iter().zip(&want) {
            same += g.iter().zip(w).filter(|(a, b)| a == b).count();
            prefix += g.iter().zip(w).take_while(|(a, b)| a == b).count();
        }
        println!(
            "  {:<10} {:.3} of tokens identical, identical prefix {:.1} tokens on average",
            c.name,
            same as f64 / (8.0 * 64.0),
            prefix as f64 / 8.0
        );
    }
}

/// One sampler call (temperature, top-p, repeat penalty over 64 tokens)
/// on `[B, vocab]` logits on the device, against the same call on a host
/// copy of them (what a host sampler costs, the copy included).
fn sampler_cost(device: &Device, vocab: usize, batches: &[usize]) {
    use tandem::sampler::{Sampler, SamplingOptions};
    let options = SamplingOptions {
        temperature: 0.8,
        top_p: 0.9,
        repeat_penalty: 1.1,
        repeat_last_n: 64,
        seed: Some(1),
        ..Default::default()
    };
    println!("sampler call, temperature 0.8, top-p 0.9, repeat penalty over 64 tokens, V={vocab}:");
    for &b in batches {
        let logits = candle_core::Tensor::randn(0f32, 3.0, (b, vocab), device).expect("logits");
        let slots: Vec<u32> = (0..b as u32).collect();
        let mut times = Vec::new();
        for on_host in [false, true] {
            let mut sampler = Sampler::with_seed(4096, 1);
            for &s in &slots {
                let prior: Vec<u32> = (0..64)
                    .map(|i| (s * 977 + i * 131) % vocab as u32)
                    .collect();
                sampler.add(s, options, &prior).expect("add");
            }
            let call = |sampler: &mut Sampler| {
                let input = if on_host {
                    logits.to_device(&Device::Cpu).expect("copy")
                } else {
                    logits.clone()
                };
                sampler.sample(&slots, &input).expect("sample");
            };
            call(&mut sampler);
            let reps = 20;
            let start = Instant::now();
            for _ in 0..reps {
                call(&mut sampler);
            }
            times.push(start.elapsed().as_secs_f64() / reps as f64);
        }
        println!(
            "  B={b:<3} on the device {:>8.0} us, on the host {:>8.0} us (copy included)",
            1e6 * times[0],
            1e6 * times[1]
        );
    }
}

/// Bytes phase `name` of a single-stream decode step reads: a
/// projection's weights as the model holds them (over all layers), or the
/// KV (`kv`) for attention; 0 for the phases that read none worth counting.
fn phase_bytes(p: &ProjectionBytes, kv: f64, name: &str) -> f64 {
    (match name {
        "qkv" => p.qkv,
        "o_proj" => p.o_proj,
        "gate_up" => p.gate_up,
        "down" => p.down,
        "lm_head" => p.lm_head,
        "attention" => return kv,
        _ => 0,
    }) as f64
}

/// The phases that read weights or KV, in a step's order.
const READING_PHASES: [&str; 6] = ["qkv", "attention", "o_proj", "gate_up", "down", "lm_head"];

/// Bytes of the unembedding, and of everything one single-stream decode
/// step at position `pos` reads: every projection weight once and the KV
/// of `pos` positions.
fn bytes_per_step(p: &ProjectionBytes, model: &Model, pos: usize) -> (f64, f64) {
    let kv = (pos * model.kv_layout().bytes_per_token()) as f64;
    let all = READING_PHASES.iter().map(|n| phase_bytes(p, kv, n)).sum();
    (phase_bytes(p, kv, "lm_head"), all)
}

/// A streaming read of `buf` on the kernels' thread pool, the way a plain
/// sum reads memory: the roofline a decode step is held to. The threads
/// take chunks of about 1/8 of their share through a shared cursor, as
/// the kernels split a weight; this reads 5–10 % faster here than one
/// contiguous half per thread (so it is the stricter roofline).
fn stream_sum(buf: &[f32]) -> Duration {
    const BLOCK: usize = 4096;
    let start = Instant::now();
    candle_core::utils::barrier_pool().execute_chunked(buf.len().div_ceil(BLOCK), |blocks| {
        let lo = blocks.start * BLOCK;
        let hi = (blocks.end * BLOCK).min(buf.len());
        std::hint::black_box(lane_sums(&buf[lo..hi]));
    });
    start.elapsed()
}

/// 64 independent lane sums of `v` (the compiler turns them into as many
/// vector accumulators as the widest instruction set allows).
fn lane_sums(v: &[f32]) -> [f32; 64] {
    #[inline(always)]
    fn sums(v: &[f32]) -> [f32; 64] {
        let mut acc = [0f32; 64];
        for block in v.chunks_exact(64) {
            for (a, x) in acc.iter_mut().zip(block) {
                *a += x;
            }
        }
        acc
    }
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f")]
        unsafe fn wide(v: &[f32]) -> [f32; 64] {
            sums(v)
        }
        if is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512 F.
            return unsafe { wide(v) };
        }
    }
    sums(v)
}

/// An f32 buffer of `bytes`, filled, whose whole 2 MiB pages Linux backs
/// with huge pages where it grants them (as the model's weights are).
fn huge_page_buffer(bytes: f64) -> Vec<f32> {
    let len = (bytes / 4.0) as usize;
    // Zeroed (so untouched) until the advice is in place.
    let mut v = vec![0f32; len];
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        let addr = v.as_mut_ptr() as usize;
        let (first, end) = (addr.next_multiple_of(HUGE), (addr + len * 4) / HUGE * HUGE);
        if end > first {
            // SAFETY: advice on untouched memory this Vec owns.
            unsafe {
                libc::madvise(first as *mut libc::c_void, end - first, libc::MADV_HUGEPAGE);
            }
        }
    }
    for (i, x) in v.iter_mut().enumerate() {
        *x = (i % 251) as f32;
    }
    v
}

/// Single-stream decode against a streaming read of as many bytes, one
/// sum pass before every decode step (see the module docs).
fn roofline(configs: &[Config], steps: usize) {
    println!("\nsingle-stream decode vs the memory roofline (a streaming sum of the same bytes before each step):");
    for c in configs {
        let projections = c.model.projection_bytes();
        let (head, bytes) = bytes_per_step(&projections, &c.model, prompt_len() + steps / 2);
        let buf = huge_page_buffer(bytes);
        stream_sum(&buf);
        let mut kv = KvCache::new(c.model.kv_layout(), Device::Cpu, prompt_len() + steps);
        kv.allocate(0, prompt_len() + steps).expect("KV room");
        let vocab = c.model.config().vocab_size as u32;
        let mut batch = Batch::default();
        batch.push(0, 0, &prompt(0, vocab), OutputRows::Last);
        let h = c.model.forward(&batch, &mut kv).expect("prefill");
        std::hint::black_box(c.model.unembed(&h).expect("unembed"));
        let (mut sum_time, mut step_time) = (Duration::ZERO, Duration::ZERO);
        let mut unembed_time = Duration::ZERO;
        let mut ratios = Vec::with_capacity(steps);
        c.model.set_profiling(true);
        for step in 0..steps {
            let read = stream_sum(&buf);
            let start = Instant::now();
            let mut batch = Batch::default();
            batch.push(
                0,
                prompt_len() + step,
                &[(step as u32 * 17 + 5) % vocab],
                OutputRows::Last,
            );
            let h = c.model.forward(&batch, &mut kv).expect("decode");
            let layers_done = Instant::now();
            std::hint::black_box(c.model.unembed(&h).expect("unembed"));
            let took = start.elapsed();
            unembed_time += layers_done.elapsed();
            sum_time += read;
            step_time += took;
            ratios.push(read.as_secs_f64() / took.as_secs_f64());
        }
        println!(
            "  {:<10} {:.0} MB/step: streaming sum {:.1} GB/s, decode {:.0} tok/s = {:.1} GB/s: {:.1} % of the roofline (median step {:.1} %)",
            c.name,
            bytes / 1e6,
            bytes * steps as f64 / sum_time.as_secs_f64() / 1e9,
            steps as f64 / step_time.as_secs_f64(),
            bytes * steps as f64 / step_time.as_secs_f64() / 1e9,
            100.0 * sum_time.as_secs_f64() / step_time.as_secs_f64(),
            100.0 * median(&mut ratios),
        );
        // The same split for the unembedding (one large matmul) and the
        // layers (many small ones with the attention between them).
        let sum_rate = bytes / sum_time.as_secs_f64();
        println!(
            "  {:<10} of which the unembedding {:.1} %, the layers {:.1} %",
            "",
            100.0 * head / sum_rate / unembed_time.as_secs_f64(),
            100.0 * (bytes - head) / sum_rate / (step_time - unembed_time).as_secs_f64(),
        );
        let phases = c.model.take_profile();
        c.model.set_profiling(false);
        let kv = ((prompt_len() + steps / 2) * c.model.kv_layout().bytes_per_token()) as f64;
        for (name, time) in phases.iter().filter(|(_, t)| !t.is_zero()) {
            let per_step = time.as_secs_f64() / steps as f64;
            let share = 100.0 * time.as_secs_f64() / step_time.as_secs_f64();
            let bytes = phase_bytes(&projections, kv, name);
            let of_roofline = if bytes > 0.0 {
                format!(
                    ", {:5.1} MB: {:5.1} % of the roofline",
                    bytes / 1e6,
                    100.0 * bytes / sum_rate / time.as_secs_f64()
                )
            } else {
                String::new()
            };
            println!(
                "  {:<10} {:<10} {:6.3} ms/step ({share:4.1} %){of_roofline}",
                "",
                name,
                1e3 * per_step
            );
        }
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    tandem::model::fit_cpu_threads_to_affinity();
    // `cargo bench` passes `--bench`; a filter argument is not supported.
    let batches: Vec<usize> = env_list("TANDEM_BENCH_BATCHES", "1,4,16,64")
        .iter()
        .map(|s| {
            s.parse()
                .expect("TANDEM_BENCH_BATCHES: comma-separated sizes")
        })
        .collect();
    let formats = env_list("TANDEM_BENCH_FORMATS", "f32,f16,q8_0");
    let reps = env_usize("TANDEM_BENCH_REPS", 3).max(1);
    let steps = env_usize("TANDEM_BENCH_STEPS", 128).max(1);
    let profile = env_usize("TANDEM_BENCH_PROFILE", 0) > 0;
    let agree = env_usize("TANDEM_BENCH_AGREEMENT", 0) > 0;

    let device = bench_device();
    let (cfg, weights, what) = match std::env::var("TANDEM_BENCH_MODEL") {
        Ok(path) if path.ends_with(".gguf") => {
            use tandem::gguf::{config_from_gguf, tensors, GgufFile};
            let file =
                GgufFile::open(std::path::Path::new(&path)).expect("TANDEM_BENCH_MODEL: GGUF");
            let cfg = config_from_gguf(&file).expect("TANDEM_BENCH_MODEL: GGUF metadata");
            let (weights, _) = tensors::hf_weights(&file, &cfg, tensors::Blocks::Keep)
                .expect("TANDEM_BENCH_MODEL: GGUF weights");
            (cfg, weights, path)
        }
        Ok(dir) => {
            let dir = std::path::Path::new(&dir);
            let cfg = ModelConfig::from_dir(dir).expect("TANDEM_BENCH_MODEL: config.json");
            let weights = Weights::from_dir(dir).expect("TANDEM_BENCH_MODEL: safetensors");
            (cfg, weights, format!("{}", dir.display()))
        }
        Err(_) => {
            let cfg = ModelConfig::from_json(LLAMA_100M).expect("valid config");
            let weights = Weights::random(&cfg, 0, 0.02).expect("random weights");
            (cfg, weights, "llama-100m shape, random weights".to_string())
        }
    };
    let configs: Vec<Config> = formats
        .iter()
        .map(|f| load(f, &weights, &cfg, &device))
        .collect();
    drop(weights);
    let on = if device.is_cpu() {
        format!(
            "CPU, ISA {:?}, threads {}, quantised activations {}",
            Isa::detect(),
            candle_core::utils::get_num_threads(),
            std::env::var("TANDEM_BENCH_ACTIVATIONS").unwrap_or_else(|_| "int8".into())
        )
    } else {
        format!("{device:?}")
    };
    println!(
        "{what} ({:.0} M parameters); {on}; prompt {}, {steps} decode steps{}, {reps} reps (medians)",
        cfg.num_parameters() as f64 / 1e6,
        prompt_len(),
        match span() {
            1 => String::new(),
            k => format!(" of {k} rows a sequence (a token and {} drafts)", k - 1),
        }
    );

    if !device.is_cpu() {
        // What one candle op costs on this device when the arithmetic is
        // nil: the floor under a step of a few hundred ops.
        let x =
            candle_core::Tensor::zeros((1, cfg.hidden_size), DType::F32, &device).expect("tensor");
        let mut y = x.clone();
        for _ in 0..100 {
            y = y.affine(1.0, 1.0).expect("op");
        }
        device.synchronize().expect("sync");
        let ops = 2000;
        let start = Instant::now();
        for _ in 0..ops {
            y = y.affine(1.0, 1.0).expect("op");
        }
        device.synchronize().expect("sync");
        println!(
            "one tiny candle op (launch + allocation): {:.1} us",
            1e6 * start.elapsed().as_secs_f64() / ops as f64
        );
    }
    if !device.is_cpu() {
        sampler_cost(&device, cfg.vocab_size, &batches);
    }
    // Warm-up: first-use costs (buffers, page faults) stay out of the figures.
    for c in &configs {
        run(&c.model, batches[0], 2, false);
    }
    // [config][batch] → (pp tok/s, decode tok/s) per rep.
    let mut pp = vec![vec![Vec::new(); batches.len()]; configs.len()];
    let mut tg = vec![vec![Vec::new(); batches.len()]; configs.len()];
    for _ in 0..reps {
        for (bi, &b) in batches.iter().enumerate() {
            for (ci, c) in configs.iter().enumerate() {
                let t = run(&c.model, b, steps, false);
                pp[ci][bi].push((b * prompt_len()) as f64 / t.prefill.as_secs_f64());
                tg[ci][bi].push((b * steps) as f64 / t.decode.as_secs_f64());
            }
        }
    }

    let head: String = batches.iter().map(|b| format!(" | B={b:<5}")).collect();
    let rule: String = batches.iter().map(|_| " | ------:").collect();
    println!("\ndecode tokens/s (prompt processing tokens/s)\n");
    println!("| weights    {head} | pp B=1 | pp max |");
    println!("| ---------- {rule} | -----: | -----: |");
    for (ci, c) in configs.iter().enumerate() {
        let mut row = format!("| {:<10} ", c.name);
        let mut pps = Vec::new();
        for bi in 0..batches.len() {
            row += &format!(" | {:>7.0}", median(&mut tg[ci][bi]));
            pps.push(median(&mut pp[ci][bi]));
        }
        let max = pps.iter().copied().fold(0.0, f64::max);
        row += &format!(" | {:>6.0} | {:>6.0} |", pps[0], max);
        println!("{row}");
    }
    println!("\nprompt processing tokens/s per batch size:");
    for (ci, c) in configs.iter().enumerate() {
        let v: Vec<String> = (0..batches.len())
            .map(|bi| format!("B={} {:.0}", batches[bi], median(&mut pp[ci][bi])))
            .collect();
        println!("  {:<10} {}", c.name, v.join(", "));
    }
    if device.is_cpu() {
        let paths: Vec<String> = tandem::model::few_row_paths()
            .iter()
            .map(|(elem, rows, n, k, path)| format!("{elem} {rows}x{k}->{n} {path}"))
            .collect();
        println!(
            "\nfew-row f32/f16 linear paths settled (rows x k -> n): {}",
            paths.join(", ")
        );
    }

    if !device.is_cpu() {
        graphs_on_off(&configs, &batches, steps, reps);
    }
    if agree {
        agreement(&configs);
    }
    if env_usize("TANDEM_BENCH_ROOFLINE", 0) > 0 && device.is_cpu() {
        roofline(&configs, steps);
    }
    if profile {
        println!("\nper-phase share of time (one more run each, profiling on):");
        for c in &configs {
            for &b in &batches {
                let RunTimes {
                    prefill: p,
                    decode: d,
                    prefill_phases: pre,
                    decode_phases: dec,
                    ..
                } = run(&c.model, b, steps, true);
                for (what, total, phases, per) in [
                    ("decode", d, dec, steps),
                    (
                        "prefill",
                        p,
                        pre,
                        b.div_ceil((UBATCH / prompt_len()).max(1)),
                    ),
                ] {
                    if phases.is_empty() {
                        continue;
                    }
                    let sum: f64 = phases.iter().map(|(_, t)| t.as_secs_f64()).sum();
                    let parts: Vec<String> = phases
                        .iter()
                        .filter(|(_, t)| t.as_secs_f64() >= 0.005 * sum)
                        .map(|(n, t)| format!("{n} {:.1}%", 100.0 * t.as_secs_f64() / sum))
                        .collect();
                    println!(
                        "  {:<10} B={b:<3} {what:<7} {:>7.2} ms/pass (phases cover {:.0}%): {}",
                        c.name,
                        1e3 * total.as_secs_f64() / per as f64,
                        100.0 * sum / total.as_secs_f64(),
                        parts.join(", ")
                    );
                }
            }
        }
    }
}
