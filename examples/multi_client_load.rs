//! The main job: N concurrent clients with a mix of prompts, lengths and
//! sampling options stream completions from one Tandem scheduler, and a
//! closing report says how the batching went.
//!
//! ```text
//! cargo run --release --example multi_client_load                  # embedded model, 32 clients
//! cargo run --release --example multi_client_load -- --clients 64
//! cargo run --release --example multi_client_load -- --model ../shared/models/stories260k
//! cargo run --release --example multi_client_load -- --shape ../shared/bench/llama-100m --uniform --engine-baseline
//! ```
//!
//! `--turns N` runs a multi-turn chat workload instead: every client
//! continues its own conversation for N turns (each turn's prompt is the
//! whole conversation so far), all conversations open with the same
//! `--system-tokens` system prompt, and the report gives, per turn, the
//! time to first token and the share of prompt tokens served by the prefix
//! cache (`--no-prefix-cache` for the baseline).
//!
//! ```text
//! cargo run --release --example multi_client_load -- --turns 8 --clients 16
//! ```
//!
//! `--shape DIR` loads `DIR/config.json` with random weights (and
//! `DIR/tokenizer.json` when present). `--uniform` gives every client the
//! same greedy options, prompt length and `--max-tokens` (a clean throughput
//! figure); `--engine-baseline` then runs the same workload directly on the
//! engine, with no actors, and prints the ratio.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tandem::api::{Event, GenerateRequest, Prompt};
use tandem::engine::{
    Admission, Engine, EngineConfig, KvGrant, PromptLookup, SeqWork, SpecConfig, StepExecutor,
    StepPlan, MAX_DRAFT_TOKENS,
};
use tandem::model::{LoadOptions, Model, ModelConfig, Weights};
use tandem::sampler::SamplingOptions;
use tandem::scheduler::{SchedulerConfig, SchedulerStats, ShutdownMode, StepTimingSnapshot};
use tandem::server::load::{parse_dtype, parse_kv_dtype, DeviceKind};
use tandem::server::mtp::MtpMode;
use tandem::tiny::{tiny_model_cpu, TinyPreset};
use tandem::tokenizer::{word_level_tokenizer, Tokenizer};
use tandem::TandemHandle;

#[derive(Parser, Debug, Clone)]
#[command(about = "Many concurrent clients against one Tandem scheduler")]
struct Args {
    /// Concurrent clients (one request each).
    #[arg(long, default_value_t = 32)]
    clients: usize,
    /// Compute device: cpu, cuda or metal (GPU backends need a build with `--features cuda` / `metal`).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Weights and compute dtype: auto (f32; a GGUF's quantised weights stay quantised on the CPU), f32, f16, bf16 (GPU), q8_0 or q4_k (CPU, quantised at load).
    #[arg(long, default_value = "auto")]
    dtype: String,
    /// KV cache dtype: auto (f16 on the CPU, the compute dtype on GPUs) or f32 (CPU).
    #[arg(long, default_value = "auto")]
    kv_dtype: String,
    /// Hugging Face model directory (default: the embedded model). Without
    /// a tokenizer.json, a word-level vocabulary of the model's size stands
    /// in (the workload's prompts are token ids).
    #[arg(long, conflicts_with = "shape")]
    model: Option<PathBuf>,
    /// Directory with a config.json to instantiate with random weights.
    #[arg(long)]
    shape: Option<PathBuf>,
    /// Tokens to generate per request (the mixed workload varies around it).
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// Prompt length in tokens for --uniform (mixed: 8 to 160).
    #[arg(long, default_value_t = 128)]
    prompt_tokens: usize,
    /// Same greedy options and lengths for every client.
    #[arg(long)]
    uniform: bool,
    /// Also run the workload directly on the engine and print the ratio.
    #[arg(long)]
    engine_baseline: bool,
    /// Scheduler slots (most sequences per step).
    #[arg(long, default_value_t = 64)]
    max_seqs: usize,
    /// Tokens per forward pass.
    #[arg(long, default_value_t = 512)]
    step_tokens: usize,
    /// Seed of the workload mix.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Speculative decoding: `off`, `early-exit:L` (draft with the first L layers) or `head:DIR` (a trained MTP head).
    #[arg(long, default_value = "off")]
    mtp: String,
    /// Longest draft (the adaptive schedule starts at min(4, this)).
    #[arg(long, default_value_t = 8)]
    draft_max: usize,
    /// Speculative decoding with prompt lookup (n-gram drafts), beside
    /// `--mtp` or alone.
    #[arg(long)]
    prompt_lookup: bool,
    /// Draft exactly `--draft-max` tokens every step instead of the
    /// engine's cost model (to measure a drafter's own acceptance).
    #[arg(long)]
    constant_drafts: bool,
    /// Run the workload twice, MTP off then with `--mtp` / `--prompt-lookup`, and print the ratio.
    #[arg(long)]
    mtp_compare: bool,
    /// Run every configuration this many times, alternating (off, on, off,
    /// on, …), and report medians: the figures of a noisy machine.
    #[arg(long, default_value_t = 1)]
    repeat: usize,
    /// Keep one engine per configuration for all `--repeat` runs and send
    /// the workload through each once, untimed, before them: the figures
    /// of a server in steady state (CUDA graphs captured, the draft
    /// policy's costs and acceptance learned), not of fresh engines, whose
    /// one-offs (on the H200, 10-12 ms a graph capture) are a share of a
    /// short run. The repeated prompts hit the prefix cache unless
    /// `--no-prefix-cache`.
    #[arg(long)]
    warm: bool,
    /// Multi-turn chat: every client continues its conversation this many
    /// turns (0: the one-shot workload).
    #[arg(long, default_value_t = 0)]
    turns: usize,
    /// Multi-turn chat: tokens of the system prompt every conversation shares.
    #[arg(long, default_value_t = 256)]
    system_tokens: usize,
    /// Multi-turn chat: tokens of each user message.
    #[arg(long, default_value_t = 32)]
    user_tokens: usize,
    /// Turn the scheduler's prefix cache off.
    #[arg(long)]
    no_prefix_cache: bool,
    /// A file of real prompts, one user message per line (`\n` for a
    /// newline inside one): client `i` sends
    /// line `i mod lines` through the model's chat template (greedy, up to
    /// `--max-tokens`), and the report prints the first answers. Needs a
    /// model with its own tokenizer (a GGUF, or a directory with
    /// tokenizer.json).
    #[arg(long, conflicts_with_all = ["uniform", "turns"])]
    prompts: Option<PathBuf>,
    /// With --prompts: how many answers to print.
    #[arg(long, default_value_t = 3)]
    show_answers: usize,
}

/// What drafts in one run (`None`: speculation off).
#[derive(Debug, Clone)]
struct Speculation {
    mtp: MtpMode,
    prompt_lookup: bool,
}

impl Speculation {
    fn from_args(args: &Args) -> anyhow_like::Result<Option<Self>> {
        let mtp = args
            .mtp
            .parse::<MtpMode>()
            .map_err(|e| format!("--mtp: {e}"))?;
        Ok((mtp != MtpMode::Off || args.prompt_lookup).then_some(Self {
            mtp,
            prompt_lookup: args.prompt_lookup,
        }))
    }
}

impl std::fmt::Display for Speculation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "head {}", self.mtp)?;
        if self.prompt_lookup {
            write!(f, " + prompt lookup")?;
        }
        Ok(())
    }
}

/// Builds the engine, with the chosen drafters.
fn build_engine(
    args: &Args,
    spec: Option<&Speculation>,
    kv_tokens: usize,
) -> anyhow_like::Result<(Engine, Tokenizer)> {
    let (model, tokenizer, name) = load(args)?;
    let vocab = model.config().vocab_size as u32;
    let (head, config) = match spec {
        None => (None, SpecConfig::default()),
        Some(s) => {
            let mut config = MtpMode::spec_config(args.draft_max, s.prompt_lookup);
            if args.constant_drafts {
                config.default = tandem::engine::SpecOptions::constant(args.draft_max);
            }
            (s.mtp.draft_head(&model)?, config)
        }
    };
    let engine = Engine::new(
        model,
        EngineConfig {
            kv_capacity_tokens: kv_tokens,
            model_name: name,
            eos_ids: tokenizer.eos_ids().to_vec(),
            ..Default::default()
        },
    )
    .with_drafters(head, config);
    let mut engine = engine;
    warm_up(&mut engine, vocab);
    Ok((engine, tokenizer))
}

/// Runs two short requests so that first-use costs (on a GPU: kernel
/// modules, cuBLAS handles, the memory pool) stay out of the figures.
fn warm_up(engine: &mut Engine, vocab: u32) {
    let jobs: Vec<Job> = [5usize, 9]
        .iter()
        .map(|&len| Job {
            prompt: (0..len as u32).map(|i| 3 + i % (vocab - 3)).collect(),
            sampling: SamplingOptions::greedy(),
            max_tokens: 4,
            kind: "warm-up",
            question: None,
        })
        .collect();
    engine_baseline(engine, &jobs, 512);
}

fn load(args: &Args) -> anyhow_like::Result<(Model, Tokenizer, String)> {
    let (dtype, weight_format) = parse_dtype(&args.dtype)?;
    let opts = LoadOptions {
        dtype,
        weight_format,
        device: args.device.parse::<DeviceKind>()?.open()?,
        kv_dtype: parse_kv_dtype(&args.kv_dtype)?,
        ..LoadOptions::default()
    };
    let tokenizer = |dir: &std::path::Path, cfg: &ModelConfig| -> anyhow_like::Result<Tokenizer> {
        Ok(if dir.join("tokenizer.json").exists() {
            Tokenizer::from_dir(dir)?
        } else {
            word_level_tokenizer(cfg.vocab_size, 0)?
        })
    };
    if let Some(path) = args
        .model
        .as_ref()
        .filter(|p| tandem::gguf::is_gguf_path(p))
    {
        let file = tandem::gguf::GgufFile::open(path)?;
        let tok = Tokenizer::from_gguf(&file)?;
        let model = tandem::gguf::load_model(&file, &opts)?;
        return Ok((model, tok, path.display().to_string()));
    }
    if let Some(dir) = &args.model {
        let model = Model::from_dir(dir, &opts)?;
        let tok = tokenizer(dir, model.config())?;
        return Ok((model, tok, dir.display().to_string()));
    }
    if let Some(dir) = &args.shape {
        let cfg = ModelConfig::from_dir(dir)?;
        let tok = tokenizer(dir, &cfg)?;
        let name = format!("{} (random weights)", dir.display());
        let weights = Weights::random(&cfg, 0, 0.02)?;
        let model = Model::load(cfg, &weights, &opts)?;
        return Ok((model, tok, name));
    }
    if !opts.device.is_cpu() || !matches!(args.dtype.as_str(), "auto" | "f32") {
        return Err("the embedded model runs on the CPU in f32; pass --model or --shape".into());
    }
    let (model, tok) = tiny_model_cpu(TinyPreset::Default)?;
    Ok((model, tok, TinyPreset::Default.name().to_string()))
}

/// A small error shim so `?` works on every layer's error type.
mod anyhow_like {
    pub type Result<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;
}

#[derive(Debug, Clone)]
struct Job {
    prompt: Vec<u32>,
    sampling: SamplingOptions,
    max_tokens: usize,
    kind: &'static str,
    /// The user message behind the prompt (`--prompts`), to print with its answer.
    question: Option<String>,
}

/// `--prompts`: one greedy job per client, cycling through the file's
/// lines, each rendered through the model's chat template.
fn prompt_jobs(
    args: &Args,
    path: &std::path::Path,
    tok: &Tokenizer,
) -> anyhow_like::Result<Vec<Job>> {
    use tandem::server::chat_template::{ChatMessage, ChatTemplate};
    let text =
        std::fs::read_to_string(path).map_err(|e| format!("--prompts {}: {e}", path.display()))?;
    let lines: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    if lines.is_empty() {
        return Err(format!("--prompts {}: no prompts (one per line)", path.display()).into());
    }
    if tok.chat_template().is_none() {
        eprintln!("note: the model has no chat template; prompts are sent as plain turns");
    }
    let template = ChatTemplate::from_tokenizer(tok)?;
    (0..args.clients)
        .map(|i| {
            // `\n` in a line is a newline (multi-line prompts: code, documents).
            let question = lines[i % lines.len()].replace("\\n", "\n");
            let messages = [ChatMessage {
                role: "user".into(),
                content: question.clone(),
                ..ChatMessage::default()
            }];
            let rendered = template
                .render(&messages, true)
                .map_err(|e| e.to_string())?;
            Ok(Job {
                prompt: tok.encode(&rendered)?,
                sampling: SamplingOptions::greedy(),
                max_tokens: args.max_tokens,
                kind: "prompt file",
                question: Some(question),
            })
        })
        .collect()
}

fn workload(args: &Args, vocab: u32) -> Vec<Job> {
    let mut rng = ChaCha8Rng::seed_from_u64(args.seed);
    // Token ids from 3 up avoid BOS/EOS/UNK in the embedded vocabulary.
    let mut prompt = |len: usize| -> Vec<u32> {
        std::iter::once(1)
            .chain((1..len).map(|_| rng.random_range(3..vocab)))
            .collect()
    };
    (0..args.clients)
        .map(|i| {
            if args.uniform {
                return Job {
                    prompt: prompt(args.prompt_tokens),
                    sampling: SamplingOptions::greedy(),
                    max_tokens: args.max_tokens,
                    kind: "greedy",
                    question: None,
                };
            }
            let len = 8 + (i * 37) % 153;
            let max_tokens = (args.max_tokens / 2 + (i * 13) % args.max_tokens.max(1)).max(1);
            let (kind, sampling) = match i % 4 {
                0 => ("greedy", SamplingOptions::greedy()),
                1 => (
                    "temperature+top-p",
                    SamplingOptions {
                        temperature: 0.8,
                        top_p: 0.9,
                        seed: Some(i as u64),
                        ..Default::default()
                    },
                ),
                2 => (
                    "penalties",
                    SamplingOptions {
                        temperature: 0.7,
                        repeat_penalty: 1.2,
                        presence_penalty: 0.3,
                        frequency_penalty: 0.2,
                        seed: Some(i as u64),
                        ..Default::default()
                    },
                ),
                _ => (
                    "logprobs",
                    SamplingOptions {
                        logprobs: true,
                        top_logprobs: 3,
                        ..Default::default()
                    },
                ),
            };
            Job {
                prompt: prompt(len),
                sampling,
                max_tokens,
                kind,
                question: None,
            }
        })
        .collect()
}

#[derive(Debug, Default, Clone)]
struct ClientReport {
    tokens: usize,
    ttft: Option<Duration>,
    latency: Duration,
    ok: bool,
    /// The streamed text and token ids (kept for `--prompts`).
    text: String,
    ids: Vec<u32>,
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let idx = ((sorted.len() - 1) as f64 * q).round() as usize;
    sorted[idx]
}

fn main() -> anyhow_like::Result<()> {
    tandem::model::fit_cpu_threads_to_affinity();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_target(false)
        .init();
    let args = Args::parse();
    let t_load = Instant::now();
    let (model, tok, name) = load(&args)?;
    let vocab = model.config().vocab_size as u32;
    let context = model.config().max_position_embeddings;
    let params = model.config().num_parameters();
    let jobs = match &args.prompts {
        Some(path) => prompt_jobs(&args, path, &tok)?,
        None => workload(&args, vocab),
    };
    let kv_tokens = jobs
        .iter()
        .map(|j| (j.prompt.len() + j.max_tokens).min(context))
        .sum::<usize>()
        .max(context);
    println!(
        "model: {name} ({:.1} M parameters, loaded in {:.2?}); {} clients, max_seqs {}, step budget {} tokens",
        params as f64 / 1e6,
        t_load.elapsed(),
        args.clients,
        args.max_seqs,
        args.step_tokens
    );
    drop(model);
    let draft = Speculation::from_args(&args)?;
    let config = SchedulerConfig {
        max_seqs: args.max_seqs,
        step_token_budget: args.step_tokens.max(args.max_seqs),
        max_prefill_chunk: (args.step_tokens / 2).max(1),
        prefix_caching: !args.no_prefix_cache,
        ..Default::default()
    };

    let system = actix::System::new();
    if args.turns > 0 {
        let per_client = args.system_tokens + args.turns * (args.user_tokens + args.max_tokens);
        let kv = (args.clients * per_client.min(context)).max(context);
        let (engine, tokenizer) = build_engine(&args, draft.as_ref(), kv)?;
        return system.block_on(chat::run(engine, tokenizer, config, args, vocab, context));
    }
    let mut runs = vec![draft.clone()];
    if args.mtp_compare {
        runs.insert(0, None);
    }
    let mut figures = vec![Vec::new(); runs.len()];
    let mut warm: Vec<Option<TandemHandle>> = vec![None; runs.len()];
    for _ in 0..args.repeat.max(1) {
        for (run, draft) in runs.iter().enumerate() {
            let handle = match &warm[run] {
                Some(handle) => handle.clone(),
                None => {
                    let (engine, tokenizer) = build_engine(&args, draft.as_ref(), kv_tokens)?;
                    system.block_on(start(engine, tokenizer, config.clone(), &jobs, &args))?
                }
            };
            println!(
                "--- MTP {}{}",
                draft.as_ref().map_or("off".to_string(), |d| format!(
                    "{d} (draft max {})",
                    args.draft_max
                )),
                if args.warm { " (warm engine)" } else { "" }
            );
            figures[run].push(system.block_on(run_clients(&handle, &jobs, &args))?);
            if args.warm {
                warm[run] = Some(handle);
            } else {
                system.block_on(handle.shutdown(ShutdownMode::Drain))?;
            }
        }
    }
    for handle in warm.into_iter().flatten() {
        system.block_on(handle.shutdown(ShutdownMode::Drain))?;
    }
    let medians: Vec<f64> = figures.iter().map(|f| median(f)).collect();
    if figures[0].len() > 1 {
        println!(
            "medians of {} alternating runs: {medians:.1?} tokens/s",
            figures[0].len()
        );
    }
    if let [off, on] = medians[..] {
        println!("MTP on / off: {:.2}x aggregate tokens/s", on / off);
    }
    let figures = medians;
    let actor_tps = *figures.last().expect("one run at least");

    if args.engine_baseline {
        let (model, _, _) = load(&args)?;
        let mut engine = Engine::new(
            model,
            EngineConfig {
                kv_capacity_tokens: kv_tokens,
                model_name: "baseline".into(),
                eos_ids: vec![],
                ..Default::default()
            },
        );
        warm_up(&mut engine, vocab);
        let tps = engine_baseline(&mut engine, &jobs, args.step_tokens);
        println!("engine baseline (no actors, same workload): {tps:.1} tokens/s; actor path / engine = {:.1} %", 100.0 * actor_tps / tps);
    }
    Ok(())
}

/// Starts a scheduler over `engine`; with `--warm`, sends `jobs` through it
/// once (untimed) first.
async fn start(
    engine: Engine,
    tokenizer: Tokenizer,
    config: SchedulerConfig,
    jobs: &[Job],
    args: &Args,
) -> anyhow_like::Result<TandemHandle> {
    let handle = TandemHandle::start(engine, tokenizer, config)?;
    if args.warm {
        drive(&handle, jobs).await;
    }
    Ok(handle)
}

/// Streams every job concurrently through `handle`; prints the report of
/// this run (the scheduler's counters since it began).
async fn run_clients(handle: &TandemHandle, jobs: &[Job], args: &Args) -> anyhow_like::Result<f64> {
    let before = handle.stats().await?;
    let (reports, wall) = drive(handle, jobs).await;
    let stats = RunStats::between(&before, &handle.stats().await?);
    print_report(jobs, &reports, wall, &stats, args);
    Ok(reports.iter().map(|r| r.tokens).sum::<usize>() as f64 / wall.as_secs_f64())
}

/// Streams every job concurrently through `handle`: each client's report
/// and the wall time of the whole.
async fn drive(handle: &TandemHandle, jobs: &[Job]) -> (Vec<ClientReport>, Duration) {
    let total_tokens: usize = jobs.iter().map(|j| j.max_tokens).sum();
    let bar = ProgressBar::new(total_tokens as u64);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} tokens {per_sec} {msg}")
            .expect("valid template"),
    );
    let bar = Arc::new(bar);
    let start = Instant::now();
    let mut tasks = Vec::new();
    for job in jobs.iter().cloned() {
        let handle = handle.clone();
        let bar = bar.clone();
        tasks.push(actix::spawn(async move {
            let t0 = Instant::now();
            let mut report = ClientReport::default();
            let request = GenerateRequest {
                prompt: Prompt::Tokens(job.prompt),
                max_tokens: Some(job.max_tokens),
                sampling: job.sampling,
                stop: vec![],
                mtp: None,
                constraints: Default::default(),
            };
            let Ok(mut stream) = handle.generate(request).await else {
                return report;
            };
            while let Some(event) = stream.next_event().await {
                match event {
                    Event::Tokens { tokens, text, .. } => {
                        if job.question.is_some() {
                            report.text.push_str(&text);
                            report.ids.extend(tokens.iter().map(|t| t.id));
                        }
                        if report.ttft.is_none() && !tokens.is_empty() {
                            report.ttft = Some(t0.elapsed());
                        }
                        report.tokens += tokens.len();
                        bar.inc(tokens.len() as u64);
                    }
                    Event::Finished(f) => {
                        report.tokens = f.usage.completion_tokens;
                        report.ok = true;
                    }
                    Event::Error { error, .. } => eprintln!("request failed: {error}"),
                }
            }
            report.latency = t0.elapsed();
            report
        }));
    }
    let mut reports = Vec::new();
    for t in tasks {
        reports.push(t.await.unwrap_or_default());
    }
    let wall = start.elapsed();
    bar.finish_and_clear();
    (reports, wall)
}

fn print_report(
    jobs: &[Job],
    reports: &[ClientReport],
    wall: Duration,
    stats: &RunStats,
    args: &Args,
) {
    let tokens: usize = reports.iter().map(|r| r.tokens).sum();
    let ok = reports.iter().filter(|r| r.ok).count();
    let mut ttft: Vec<f64> = reports
        .iter()
        .filter_map(|r| r.ttft)
        .map(|d| d.as_secs_f64() * 1e3)
        .collect();
    let mut lat: Vec<f64> = reports
        .iter()
        .map(|r| r.latency.as_secs_f64() * 1e3)
        .collect();
    ttft.sort_by(f64::total_cmp);
    lat.sort_by(f64::total_cmp);
    let tps = tokens as f64 / wall.as_secs_f64();
    let kinds: std::collections::BTreeMap<&str, usize> =
        jobs.iter().fold(Default::default(), |mut m, j| {
            *m.entry(j.kind).or_default() += 1;
            m
        });
    println!("clients: {ok}/{} completed; mix: {kinds:?}", args.clients);
    println!("aggregate: {tokens} tokens in {wall:.2?} = {tps:.1} tokens/s");
    println!(
        "time to first token: p50 {:.1} ms, p99 {:.1} ms",
        percentile(&ttft, 0.5),
        percentile(&ttft, 0.99)
    );
    println!(
        "request latency:     p50 {:.1} ms, p99 {:.1} ms",
        percentile(&lat, 0.5),
        percentile(&lat, 0.99)
    );
    println!(
        "sequences per step:  mean {:.1}, max {} over {} steps",
        stats.mean_seqs, stats.max_seqs, stats.steps
    );
    println!(
        "sampler calls:       {} uniform, {} serial",
        stats.uniform_calls, stats.serial_calls
    );
    let steps = &stats.times;
    if stats.mtp_drafted > 0 {
        println!(
            "MTP: {} drafted, {} accepted (acceptance {:.3}) in {} speculative sequence-steps; drafting took {:.1} % of engine time",
            stats.mtp_drafted,
            stats.mtp_accepted,
            stats.mtp_accepted as f64 / stats.mtp_drafted as f64,
            stats.mtp_speculative_steps,
            100.0 * steps.draft_total.as_secs_f64() / steps.engine_total.as_secs_f64().max(1e-9)
        );
    }
    println!(
        "engine time {:.2?} (forward {:.2?}, sampling {:.2?}); scheduler overhead {:.2} % of busy wall time",
        steps.engine_total,
        steps.forward_total,
        steps.sample_total,
        100.0 * steps.overhead_fraction()
    );
    if args.prompt_lookup && jobs.iter().any(|j| j.question.is_some()) {
        let (tokens, steps) = lookup_ceiling(jobs, reports, args.draft_max);
        println!(
            "prompt lookup at best: {tokens} tokens in {steps} decode steps = {:.2} tokens per step \
             (every proposal drafted, up to {}, and verified at no cost)",
            tokens as f64 / steps.max(1) as f64,
            args.draft_max
        );
    }
    let answered = jobs
        .iter()
        .zip(reports)
        .filter_map(|(j, r)| Some((j.question.as_ref()?, r)));
    for (i, (question, report)) in answered.take(args.show_answers).enumerate() {
        println!("\n[client {i}] {question}\n  → {}", report.text.trim());
    }
}

/// What the scheduler counted during one run: the difference of its
/// cumulative stats after and before (a warm engine's include the runs
/// before).
struct RunStats {
    steps: u64,
    mean_seqs: f64,
    max_seqs: usize,
    uniform_calls: u64,
    serial_calls: u64,
    mtp_drafted: u64,
    mtp_accepted: u64,
    mtp_speculative_steps: u64,
    times: StepTimingSnapshot,
}

impl RunStats {
    fn between(before: &SchedulerStats, after: &SchedulerStats) -> Self {
        let (b, a) = (&before.metrics.batch_size, &after.metrics.batch_size);
        let passes = a.count - b.count;
        // The batch-size histogram has a bucket per size up to 256.
        let max_seqs = (0..a.counts.len())
            .rev()
            .find(|&i| a.counts[i] > b.counts[i])
            .map_or(0, |i| {
                a.bounds
                    .get(i)
                    .map_or(after.max_seqs_per_step, |&x| x as usize)
            });
        let (tb, ta) = (&before.metrics.steps, &after.metrics.steps);
        Self {
            steps: after.steps - before.steps,
            mean_seqs: (a.sum - b.sum) / passes.max(1) as f64,
            max_seqs,
            uniform_calls: after.sampler_uniform_calls - before.sampler_uniform_calls,
            serial_calls: after.sampler_serial_calls - before.sampler_serial_calls,
            mtp_drafted: after.mtp_drafted - before.mtp_drafted,
            mtp_accepted: after.mtp_accepted - before.mtp_accepted,
            mtp_speculative_steps: after.mtp_speculative_steps - before.mtp_speculative_steps,
            times: StepTimingSnapshot {
                steps: ta.steps - tb.steps,
                engine_total: ta.engine_total - tb.engine_total,
                forward_total: ta.forward_total - tb.forward_total,
                sample_total: ta.sample_total - tb.sample_total,
                draft_total: ta.draft_total - tb.draft_total,
                busy_wall_total: ta.busy_wall_total - tb.busy_wall_total,
                busy_engine_total: ta.busy_engine_total - tb.busy_engine_total,
                ..Default::default()
            },
        }
    }
}

/// The ceiling of prompt lookup on these answers: decode steps if every step
/// drafted what the lookup proposes (the engine's default settings, up to
/// `max_draft` tokens) and verification cost nothing. Returns (answer
/// tokens, steps); a workload whose answers rarely repeat their context
/// cannot gain much whatever the policy does.
fn lookup_ceiling(jobs: &[Job], reports: &[ClientReport], max_draft: usize) -> (usize, usize) {
    let lookup = PromptLookup::default();
    let (mut tokens, mut steps) = (0, 0);
    for (job, report) in jobs.iter().zip(reports) {
        let mut history = job.prompt.clone();
        let mut at = 0;
        while at < report.ids.len() {
            let drafts = lookup.propose(&history, max_draft).tokens;
            let accepted = drafts
                .iter()
                .zip(&report.ids[at..])
                .take_while(|(d, t)| d == t)
                .count();
            let emitted = (accepted + 1).min(report.ids.len() - at);
            history.extend_from_slice(&report.ids[at..at + emitted]);
            at += emitted;
            steps += 1;
        }
        tokens += report.ids.len();
    }
    (tokens, steps)
}

/// The same jobs straight on the engine: admit all, prefill under the same
/// token budget, decode together. Returns generated tokens/s.
fn engine_baseline(engine: &mut Engine, jobs: &[Job], budget: usize) -> f64 {
    let start = Instant::now();
    let mut plan = StepPlan::default();
    for (i, j) in jobs.iter().enumerate() {
        plan.admit.push(Admission {
            slot: i as u32,
            prompt: Arc::from(j.prompt.clone()),
            sampling: j.sampling,
            max_new_tokens: j.max_tokens,
            kv: KvGrant::Reserve(j.prompt.len() + j.max_tokens),
            spec: None,
            constraints: Default::default(),
        });
    }
    let mut prefilled = vec![0usize; jobs.len()];
    let mut live = vec![true; jobs.len()];
    let mut tokens = 0usize;
    for step in 0.. {
        plan.step = step;
        let mut left = budget.saturating_sub(live.iter().filter(|&&l| l).count());
        for (i, j) in jobs.iter().enumerate() {
            if !live[i] {
                continue;
            }
            if prefilled[i] < j.prompt.len() {
                let len = left.min(j.prompt.len() - prefilled[i]);
                if len > 0 {
                    plan.work.push(SeqWork::Prefill {
                        slot: i as u32,
                        start: prefilled[i],
                        len,
                    });
                    prefilled[i] += len;
                    left -= len;
                }
            } else {
                plan.work.push(SeqWork::Decode {
                    slot: i as u32,
                    max_drafts: MAX_DRAFT_TOKENS,
                });
            }
        }
        if plan.work.is_empty() {
            break;
        }
        for s in engine.execute(std::mem::take(&mut plan)).seqs {
            if let Ok(p) = s.result {
                tokens += p.tokens.len();
                if p.finish.is_some() {
                    live[s.slot as usize] = false;
                }
            } else {
                live[s.slot as usize] = false;
            }
        }
    }
    tokens as f64 / start.elapsed().as_secs_f64()
}

/// The multi-turn chat workload (`--turns`).
mod chat {
    use std::time::{Duration, Instant};

    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;
    use tandem::api::{Event, GenerateRequest, Prompt};
    use tandem::engine::Engine;
    use tandem::sampler::SamplingOptions;
    use tandem::scheduler::SchedulerConfig;
    use tandem::tokenizer::Tokenizer;
    use tandem::TandemHandle;

    use super::{anyhow_like, Args};

    /// One turn of one client.
    #[derive(Debug, Clone, Copy, Default)]
    struct Turn {
        ttft: Option<Duration>,
        prompt: usize,
        cached: usize,
    }

    fn message(rng: &mut ChaCha8Rng, n: usize, vocab: u32) -> Vec<u32> {
        (0..n).map(|_| rng.random_range(3..vocab)).collect()
    }

    /// One client's conversation: `turns` requests, each the whole
    /// conversation so far plus a new user message.
    async fn converse(
        handle: TandemHandle,
        system: Vec<u32>,
        args: Args,
        client: usize,
        vocab: u32,
        context: usize,
    ) -> Vec<Turn> {
        let mut rng = ChaCha8Rng::seed_from_u64(args.seed ^ ((client as u64 + 1) * 0x9e37));
        let mut conversation = system;
        let mut turns = Vec::new();
        for _ in 0..args.turns {
            conversation.extend(message(&mut rng, args.user_tokens, vocab));
            if conversation.len() + args.max_tokens >= context {
                break; // the conversation no longer fits the context
            }
            let request = GenerateRequest {
                prompt: Prompt::Tokens(conversation.clone()),
                max_tokens: Some(args.max_tokens),
                sampling: SamplingOptions::greedy(),
                stop: vec![],
                mtp: None,
                constraints: Default::default(),
            };
            let t0 = Instant::now();
            let mut turn = Turn {
                prompt: conversation.len(),
                ..Turn::default()
            };
            let Ok(mut stream) = handle.generate(request).await else {
                break;
            };
            while let Some(event) = stream.next_event().await {
                match event {
                    Event::Tokens { tokens, .. } => {
                        if turn.ttft.is_none() && !tokens.is_empty() {
                            turn.ttft = Some(t0.elapsed());
                        }
                        conversation.extend(tokens.iter().map(|t| t.id));
                    }
                    Event::Finished(f) => turn.cached = f.usage.cached_prompt_tokens,
                    Event::Error { error, .. } => eprintln!("client {client}: {error}"),
                }
            }
            turns.push(turn);
        }
        turns
    }

    /// Runs every conversation concurrently and prints the per-turn report.
    pub async fn run(
        engine: Engine,
        tokenizer: Tokenizer,
        config: SchedulerConfig,
        args: Args,
        vocab: u32,
        context: usize,
    ) -> anyhow_like::Result<()> {
        let caching = config.prefix_caching;
        let handle = TandemHandle::start(engine, tokenizer, config)?;
        let mut rng = ChaCha8Rng::seed_from_u64(args.seed);
        let system = message(&mut rng, args.system_tokens, vocab);
        println!(
            "multi-turn chat: {} clients x {} turns, shared system prompt of {} tokens, {} user tokens and {} reply tokens a turn, prefix cache {}",
            args.clients,
            args.turns,
            args.system_tokens,
            args.user_tokens,
            args.max_tokens,
            if caching { "on" } else { "off" }
        );
        let start = Instant::now();
        let tasks: Vec<_> = (0..args.clients)
            .map(|c| {
                let f = converse(
                    handle.clone(),
                    system.clone(),
                    args.clone(),
                    c,
                    vocab,
                    context,
                );
                actix::spawn(f)
            })
            .collect();
        let mut all = Vec::new();
        for t in tasks {
            all.push(t.await.unwrap_or_default());
        }
        let elapsed = start.elapsed();
        println!("turn  requests  mean TTFT   p90 TTFT   prompt tokens  cached   hit rate");
        for turn in 0..args.turns {
            let rows: Vec<Turn> = all.iter().filter_map(|c| c.get(turn).copied()).collect();
            if rows.is_empty() {
                break;
            }
            let mut ttfts: Vec<f64> = rows
                .iter()
                .filter_map(|t| t.ttft.map(|d| d.as_secs_f64() * 1e3))
                .collect();
            ttfts.sort_by(f64::total_cmp);
            let mean = ttfts.iter().sum::<f64>() / ttfts.len().max(1) as f64;
            let prompt: usize = rows.iter().map(|t| t.prompt).sum();
            let cached: usize = rows.iter().map(|t| t.cached).sum();
            println!(
                "{:>4}  {:>8}  {:>7.1} ms {:>7.1} ms  {:>13}  {:>7}  {:>7.1} %",
                turn + 1,
                rows.len(),
                mean,
                super::percentile(&ttfts, 0.9),
                prompt,
                cached,
                100.0 * cached as f64 / prompt.max(1) as f64
            );
        }
        let s = handle.stats().await?;
        println!(
            "in {elapsed:.2?}: prompt tokens computed {} (of {} looked up, {} cached: hit rate {:.1} %), preemptions {}, KV blocks {} of {} cached at the end",
            s.prompt_tokens_processed,
            s.prefix_cache_query_tokens,
            s.prefix_cache_hit_tokens,
            100.0 * s.prefix_cache_hit_tokens as f64 / s.prefix_cache_query_tokens.max(1) as f64,
            s.preemptions,
            s.kv_blocks_cached,
            s.kv_blocks_total,
        );
        handle
            .shutdown(tandem::scheduler::ShutdownMode::Drain)
            .await?;
        Ok(())
    }
}

/// The median of `v` (the mean of the middle two for an even count).
fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => 0.5 * (v[n / 2 - 1] + v[n / 2]),
    }
}
