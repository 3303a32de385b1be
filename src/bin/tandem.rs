//! The `tandem` command: `tandem serve` runs the OpenAI-compatible HTTP
//! server, `tandem generate` streams one completion to the terminal.
//!
//! Logs go to stderr through `tracing` (filter with `RUST_LOG`, default
//! `info`). `serve` prints `listening on http://ADDR` and then `ready` on
//! stdout, so scripts can wait for them. It exits 0 after a SIGINT / SIGTERM
//! once in-flight requests have drained (or were cancelled after
//! `--drain-timeout`), and 1 with a message on any startup error.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Args, Parser, Subcommand};
use futures_util::StreamExt;
use indicatif::{ProgressBar, ProgressStyle};
use tandem::api::{Event, GenerateRequest};
use tandem::engine::EngineInfo;
use tandem::sampler::SamplingOptions;
use tandem::scheduler::{SchedulerConfig, SchedulerError, ShutdownMode};
use tandem::server::load::{
    load, parse_dtype, parse_kv_dtype, DeviceKind, LoadSpec, Loaded, ModelSource,
};
use tandem::server::mtp::{check_draft_max, MtpMode};
use tandem::server::{self, AppState, HttpConfig, ListenConfig, ShutdownSignal};
use tandem::tiny::TinyPreset;
use tandem::TandemHandle;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

#[derive(Parser, Debug)]
#[command(
    name = "tandem",
    version,
    about = "Serve an LLM to many clients at once: one forward pass and one sampler call per step for every active sequence."
)]
struct Cli {
    /// Log line format on stderr: `text` (coloured only on a terminal) or `json` (one object per line).
    #[arg(long, global = true, default_value = "text", value_parser = ["text", "json"])]
    log_format: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics).
    Serve(ServeArgs),
    /// Generate one completion and stream it to the terminal.
    Generate(GenerateArgs),
    /// Train a self-distilled MTP draft head for a model (use it with `--mtp head:DIR`).
    TrainMtp(TrainArgs),
    /// Measure an MTP head's greedy draft acceptance on your own prompts (the model's greedy answers to them).
    EvalMtp(EvalArgs),
}

#[derive(Args, Debug)]
struct EvalArgs {
    /// Hugging Face model folder or GGUF file (weights dequantised to f32).
    #[arg(long, value_name = "DIR|FILE.gguf")]
    model: PathBuf,
    /// The head's folder (mtp.safetensors, as `train-mtp --out` wrote it).
    #[arg(long, value_name = "DIR")]
    head: PathBuf,
    /// Prompts, one per line (`\n` for a newline), each rendered as a user turn through the model's chat template.
    #[arg(long, value_name = "FILE")]
    prompts: PathBuf,
    /// Tokens per answered sequence, the chat prompt included.
    #[arg(long, default_value_t = 256)]
    seq_len: usize,
    /// Draft positions to report.
    #[arg(long, default_value_t = 6)]
    draft_positions: usize,
    /// Where the model and the head run: cpu, cuda or metal.
    #[arg(long, default_value = "cpu")]
    device: String,
}

#[derive(Args, Debug)]
struct TrainArgs {
    /// Hugging Face model folder or GGUF file (weights dequantised to f32 for training); without it, the embedded model.
    #[arg(long, value_name = "DIR|FILE.gguf")]
    model: Option<PathBuf>,
    /// Which embedded model to use without --model: `default` or `test`.
    #[arg(long, default_value = "default", value_parser = ["default", "test"])]
    embedded: String,
    /// Where the head (mtp.safetensors), its report (mtp_training.json) and checkpoints go.
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
    /// Optimiser steps.
    #[arg(long, default_value_t = 300)]
    steps: usize,
    /// Sequences per batch.
    #[arg(long, default_value_t = 16)]
    batch: usize,
    /// Tokens per training sequence, the chat prompt included (a sequence ends early at an EOS).
    #[arg(long, default_value_t = 64)]
    seq_len: usize,
    /// Prompts to answer, one per line (`\n` for a newline), each rendered as a user turn through the model's chat template. Without it, the built-in set (questions, explanations, instructions, code, lists, summaries). The embedded models answer random token prompts instead.
    #[arg(long, value_name = "FILE")]
    prompts: Option<PathBuf>,
    /// Answer N requests the model writes itself (continued from its chat template's user cue, the Magpie recipe), shuffled in with the other prompts (with the built-in set, N of the --train-seqs + --heldout-seqs prompts): requests as varied as the model's own chat data, beyond the built-in set's templates.
    #[arg(long, default_value_t = 0)]
    self_prompts: usize,
    /// Held-out prompts from this file (one per line; --heldout-seqs sequences cycle through them) instead of the last of the training prompts, e.g. requests like those the head will serve.
    #[arg(long, value_name = "FILE")]
    heldout_prompts: Option<PathBuf>,
    /// Unembed the head over the N most frequent training labels only (stored with the head as `mtp.draft_vocab`); 0 = the full vocabulary.
    #[arg(long, default_value_t = 0)]
    draft_vocab: usize,
    /// Train against the target's whole next-token distribution over the draft vocabulary (distillation), not its greedy label alone.
    #[arg(long)]
    soft_labels: bool,
    /// Draft rounds trained per position: each round after the first feeds the head its own previous output, as drafting k tokens does (EAGLE-3's training-time test); more rounds make later drafts land more often, at a training step's cost.
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// Adam learning rate.
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    /// Sequences the model writes for training (self-distillation).
    #[arg(long, default_value_t = 1024)]
    train_seqs: usize,
    /// Held-out sequences (greedy continuations) for loss, top-1 and acceptance.
    #[arg(long, default_value_t = 32)]
    heldout_seqs: usize,
    /// Sampling temperature of the training continuations.
    #[arg(long, default_value_t = 1.0)]
    temperature: f32,
    /// Draft positions whose held-out acceptance is reported.
    #[arg(long, default_value_t = 6)]
    draft_positions: usize,
    /// Transformer blocks in the head (DeepSeek-V3 uses one; only 1 is supported).
    #[arg(long, default_value_t = 1)]
    draft_layers: usize,
    /// Evaluate on the held-out set every N steps.
    #[arg(long, default_value_t = 50)]
    eval_every: usize,
    /// Write a resumable checkpoint every N steps (0 = only at the end).
    #[arg(long, default_value_t = 100)]
    checkpoint_every: usize,
    /// Seed of the data and the initial head (runs are deterministic).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Continue from the checkpoint in --out.
    #[arg(long)]
    resume: bool,
    /// Where the target and the head run: cpu, cuda or metal (GPU backends need a build with `--features cuda` / `metal`). Training is f32 on every device.
    #[arg(long, default_value = "cpu")]
    device: String,
}

#[derive(Args, Debug, Clone)]
struct ModelArgs {
    /// Hugging Face model folder (config.json, *.safetensors, tokenizer.json), or a GGUF file (model, tokenizer and chat template from its metadata; see --dtype for its quantised weights). Without it, the embedded random-weight model is served.
    #[arg(long, value_name = "DIR|FILE.gguf")]
    model: Option<PathBuf>,
    /// Which embedded model to use without --model: `default` (≈32 M parameters) or `test` (≈0.14 M, for smoke tests).
    #[arg(long, default_value = "default", value_parser = ["default", "test"])]
    embedded: String,
    /// `auto`: f32 compute, and a GGUF file's quantised weights stay quantised on the CPU. Or a compute dtype for every weight, f32, f16 or bf16 (bf16 needs a GPU; a GGUF's weights are dequantised at load), or weights quantised at load to q8_0 / q4_k (f32 activations).
    #[arg(long, default_value = "auto")]
    dtype: String,
    /// How the CPU multiplies quantised weights: `int8` activations (llama.cpp's scheme, the fastest) or `int16` (15-bit: nearly the dequantised weights' f32 result, about half the prompt speed).
    #[arg(long, default_value = "int8", value_parser = ["int8", "int16"])]
    activations: String,
    /// Compute device: cpu, cuda or metal (GPU backends need a build with `--features cuda` / `metal`).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// KV cache pool in tokens, over all sequences, in blocks of --kv-block-size. A request takes blocks as it grows (its prompt's when it starts, minus a cached prefix); when they run out the newest running request is preempted and recomputed later.
    #[arg(long, default_value_t = 131_072)]
    kv_tokens: usize,
    /// Tokens per KV cache block (the unit of allocation and of prefix caching).
    #[arg(long, default_value_t = tandem::kv::DEFAULT_BLOCK_SIZE)]
    kv_block_size: usize,
    /// KV cache dtype: `auto` (f16 on the CPU, as llama.cpp's default cache type: half the memory and the bytes attention reads of f32, keys and values rounded to f16; on GPUs the compute dtype), or `f32` on the CPU. GPUs take their compute dtype only.
    #[arg(long, default_value = "auto")]
    kv_dtype: String,
    /// Speculative decoding: `off`, `early-exit:L` (draft with the model's first L layers) or `head:DIR` (an MTP head trained by `tandem train-mtp`).
    #[arg(long, default_value = "off")]
    mtp: String,
    /// Most tokens drafted per step per sequence with --mtp or --prompt-lookup (1-32).
    #[arg(long, default_value_t = 4)]
    draft_max: usize,
    /// Speculative decoding with prompt lookup: draft the continuation of the latest earlier occurrence of the last 2-4 tokens in the request's prompt and output (no weights; pays on summaries, code edits, quoting). With --mtp too, the draft policy picks per sequence.
    #[arg(long)]
    prompt_lookup: bool,
}

#[derive(Args, Debug)]
struct ServeArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Interface to listen on (0.0.0.0 exposes the server to the network).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// TCP port (0 picks a free one).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Most sequences generated together (one forward pass per step).
    #[arg(long, default_value_t = 64)]
    max_seqs: usize,
    /// Turn automatic prefix caching off (every prompt is computed in full).
    #[arg(long)]
    no_prefix_cache: bool,
    /// Most requests waiting for a slot; beyond it requests get HTTP 429.
    #[arg(long, default_value_t = 1024)]
    max_queue: usize,
    /// Tokens fed to the model per step (decodes plus prefill chunks); at least --max-seqs.
    #[arg(long, default_value_t = 512)]
    step_tokens: usize,
    /// Require `Authorization: Bearer KEY` on /v1 routes (or set TANDEM_API_KEY).
    #[arg(long, value_name = "KEY")]
    api_key: Option<String>,
    /// HTTP worker threads.
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// Largest request body in bytes (HTTP 413 above).
    #[arg(long, default_value_t = 4 * 1024 * 1024)]
    body_limit: usize,
    /// Seconds to let in-flight requests finish after SIGINT/SIGTERM before cancelling them.
    #[arg(long, default_value_t = 30)]
    drain_timeout: u64,
    /// Seconds a client may take to send a request body once its headers are in (HTTP 408 and the connection closed above).
    #[arg(long, default_value_t = 30.0)]
    body_timeout: f64,
    /// Seconds a client may take to send a request's headers (HTTP 408 above).
    #[arg(long, default_value_t = 5.0)]
    header_timeout: f64,
}

#[derive(Args, Debug)]
struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The prompt (with --chat: the user's message).
    prompt: String,
    /// Send the prompt as one user message through the model's chat
    /// template (as /v1/chat/completions does) instead of as raw text.
    #[arg(long)]
    chat: bool,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 0.8)]
    temperature: f32,
    /// Keep the K most likely tokens (0 = off).
    #[arg(long, default_value_t = 0)]
    top_k: i32,
    /// Nucleus sampling threshold (1 = off).
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Drop tokens below this fraction of the top probability (0 = off).
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    /// Repeat penalty (1 = off).
    #[arg(long, default_value_t = 1.0)]
    repeat_penalty: f32,
    /// RNG seed, for reproducible sampling.
    #[arg(long)]
    seed: Option<u64>,
    /// Stop before this string (repeatable).
    #[arg(long)]
    stop: Vec<String>,
}

fn main() -> ExitCode {
    tandem::model::fit_cpu_threads_to_affinity();
    let cli = Cli::parse();
    let format = cli.log_format.parse().unwrap_or_default();
    if let Err(e) = tandem::server::logging::init(format) {
        eprintln!("error: setting up the log: {e}");
        return ExitCode::FAILURE;
    }
    let system = actix_web::rt::System::new();
    let result = match cli.command {
        Command::Serve(args) => system.block_on(serve(args)),
        Command::Generate(args) => system.block_on(generate(args)),
        Command::TrainMtp(args) => train_mtp(args),
        Command::EvalMtp(args) => eval_mtp(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Checks the model flags and opens the device (before any weight is read).
fn load_spec(args: &ModelArgs) -> Result<LoadSpec, BoxError> {
    let source = match &args.model {
        Some(dir) if !dir.is_dir() && !tandem::gguf::is_gguf_path(dir) => {
            return Err(format!("--model {}: not a directory or a GGUF file", dir.display()).into())
        }
        Some(dir) => ModelSource::Dir(dir.clone()),
        None if args.embedded == "test" => ModelSource::Embedded(TinyPreset::Test),
        None => ModelSource::Embedded(TinyPreset::Default),
    };
    let (dtype, weight_format) = parse_dtype(&args.dtype)?;
    Ok(LoadSpec {
        source,
        dtype,
        weight_format,
        activation_quant: args.activations.parse()?,
        kv_dtype: parse_kv_dtype(&args.kv_dtype)?,
        device: args.device.parse::<DeviceKind>()?.open()?,
        kv_tokens: args.kv_tokens,
        kv_block_size: args.kv_block_size,
        mtp: args
            .mtp
            .parse::<MtpMode>()
            .map_err(|e| format!("--mtp: {e}"))?,
        draft_max: check_draft_max(args.draft_max).map_err(|e| format!("--draft-max: {e}"))?,
        prompt_lookup: args.prompt_lookup,
    })
}

/// Loads the model on a blocking thread, with a spinner on stderr.
async fn load_with_spinner(spec: LoadSpec) -> Result<Loaded, BoxError> {
    let what = match &spec.source {
        ModelSource::Dir(d) => d.display().to_string(),
        ModelSource::Embedded(p) => format!("embedded model {}", p.name()),
    };
    actix_web::rt::task::spawn_blocking(move || {
        let spinner = ProgressBar::new_spinner().with_message(format!("loading {what}"));
        if let Ok(style) = ProgressStyle::with_template("{spinner} {msg} ({elapsed})") {
            spinner.set_style(style);
        }
        spinner.enable_steady_tick(Duration::from_millis(100));
        let t0 = Instant::now();
        let loaded = load(&spec);
        spinner.finish_and_clear();
        let loaded = loaded?;
        tracing::info!(model = %loaded.model_name, elapsed = ?t0.elapsed(), chat_template = loaded.template.has_template(), "model loaded");
        Ok(loaded)
    })
    .await
    .map_err(|e| -> BoxError { format!("the loading thread failed: {e}").into() })?
}

/// Scheduler limits from the flags, checked against generous engine limits
/// so flag mistakes surface before the model loads (named as flags).
fn scheduler_config(args: &ServeArgs) -> Result<SchedulerConfig, BoxError> {
    let cfg = SchedulerConfig {
        max_seqs: args.max_seqs,
        max_queue: args.max_queue,
        step_token_budget: args.step_tokens,
        // Half the budget, so a long prompt never holds back newer ones
        // (see SchedulerConfig::max_prefill_chunk).
        max_prefill_chunk: (args.step_tokens / 2).max(1),
        prefix_caching: !args.no_prefix_cache,
    };
    let roomy = EngineInfo {
        model_name: String::new(),
        context_len: usize::MAX,
        vocab_size: usize::MAX,
        eos_ids: Vec::new(),
        kv_capacity_tokens: usize::MAX,
        kv_block_size: 1,
        speculation: None,
    };
    match cfg.validate(&roomy) {
        Ok(()) => Ok(cfg),
        Err(SchedulerError::InvalidConfig { field, reason }) => {
            let flag = match field {
                "max_seqs" => "--max-seqs",
                "max_queue" => "--max-queue",
                _ => "--step-tokens",
            };
            Err(format!("{flag}: {reason}").into())
        }
        Err(e) => Err(e.into()),
    }
}

async fn serve(args: ServeArgs) -> Result<(), BoxError> {
    let sched = scheduler_config(&args)?;
    let spec = load_spec(&args.model)?;
    let mut signal = ShutdownSignal::install()?;

    let api_key = args
        .api_key
        .clone()
        .or_else(|| std::env::var("TANDEM_API_KEY").ok());
    let seconds = |flag: &str, s: f64| -> Result<Duration, BoxError> {
        Duration::try_from_secs_f64(s)
            .ok()
            .filter(|d| !d.is_zero())
            .ok_or_else(|| format!("{flag}: expected a positive number of seconds, got {s}").into())
    };
    let state = AppState::new(HttpConfig {
        api_key,
        body_limit: args.body_limit,
        body_timeout: seconds("--body-timeout", args.body_timeout)?,
    });
    let drain_timeout = Duration::from_secs(args.drain_timeout);
    let listen = ListenConfig {
        host: args.host.clone(),
        port: args.port,
        workers: args.workers,
        shutdown_timeout: drain_timeout + Duration::from_secs(5),
        header_timeout: seconds("--header-timeout", args.header_timeout)?,
    };
    let (http, addr) = server::bind(state.clone(), &listen)?;
    let http_handle = http.handle();
    let mut http_task = actix_web::rt::spawn(http);
    println!("listening on http://{addr}");
    let _ = std::io::stdout().flush();
    tracing::info!(%addr, "listening (GET /health answers 503 until the model is loaded)");

    let loaded = tokio::select! {
        loaded = load_with_spinner(spec) => loaded?,
        sig = signal.recv() => {
            tracing::info!(signal = sig, "stopping before the model finished loading");
            server::shutdown_gracefully(&state, &http_handle, drain_timeout).await;
            return Ok(());
        }
    };
    let handle = TandemHandle::start(loaded.engine, loaded.tokenizer, sched)?;
    state.set_ready_named(handle, loaded.template, loaded.root);
    println!("ready");
    let _ = std::io::stdout().flush();
    tracing::info!(model = %loaded.model_name, "ready");

    tokio::select! {
        sig = signal.recv() => tracing::info!(signal = sig, "shutting down: draining in-flight requests"),
        ended = &mut http_task => {
            return Err(format!("the HTTP server stopped unexpectedly: {ended:?}").into());
        }
    }
    let outcome = server::shutdown_gracefully(&state, &http_handle, drain_timeout).await;
    tracing::info!(?outcome, "stopped");
    Ok(())
}

async fn generate(args: GenerateArgs) -> Result<(), BoxError> {
    let spec = load_spec(&args.model)?;
    let loaded = load_with_spinner(spec).await?;
    let handle = TandemHandle::start(loaded.engine, loaded.tokenizer, SchedulerConfig::default())?;
    let sampling = SamplingOptions {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: args.min_p,
        repeat_penalty: args.repeat_penalty,
        seed: args.seed,
        ..SamplingOptions::default()
    };
    let prompt = if args.chat {
        let message = tandem::server::chat_template::ChatMessage {
            role: "user".into(),
            content: args.prompt,
            ..Default::default()
        };
        loaded
            .template
            .render(&[message], true)
            .map_err(|e| format!("--chat: {}", e.message))?
    } else {
        args.prompt
    };
    let request = GenerateRequest::new(prompt, args.max_tokens)
        .with_sampling(sampling)
        .with_stop(args.stop);
    let mut events = handle.generate(request).await?;
    let mut out = std::io::stdout().lock();
    let mut failure = None;
    while let Some(event) = events.next().await {
        match event {
            Event::Tokens { text, .. } => {
                out.write_all(text.as_bytes())?;
                out.flush()?;
            }
            Event::Finished(f) => {
                writeln!(out)?;
                let rate = f
                    .timings
                    .decode_tokens_per_s
                    .map_or(String::new(), |r| format!(", {r:.1} tokens/s"));
                eprintln!(
                    "[{}: {} prompt + {} generated tokens{rate}]",
                    f.reason.as_str(),
                    f.usage.prompt_tokens,
                    f.usage.completion_tokens
                );
            }
            Event::Error { error, .. } => failure = Some(error),
        }
    }
    drop(out);
    handle.shutdown(ShutdownMode::Abort).await?;
    match failure {
        Some(e) => Err(e.into()),
        None => Ok(()),
    }
}

/// The prompt set of `train-mtp`: the file's or the built-in prompts, the
/// model's own requests shuffled in, and the held-out file's (or the last
/// `--heldout-seqs` of them) held out. Random token prompts for the
/// embedded models.
fn train_prompts(
    args: &TrainArgs,
    model: &tandem::model::Model,
    tokenizer: Option<&tandem::tokenizer::Tokenizer>,
) -> Result<tandem::train::PromptSet, BoxError> {
    use tandem::train::prompts;
    let wanted = args.train_seqs + args.heldout_seqs;
    let Some(tok) = tokenizer else {
        if args.prompts.is_some() || args.heldout_prompts.is_some() || args.self_prompts > 0 {
            return Err("--prompts, --heldout-prompts and --self-prompts need --model (the embedded models answer random token prompts)".into());
        }
        let all = prompts::random_token_prompts(model.config(), wanted, args.seed);
        return Ok(tandem::train::PromptSet::split(all, args.heldout_seqs)?);
    };
    let mut texts = match &args.prompts {
        Some(path) => prompts::read_file(path)?,
        None => prompts::builtin(wanted.saturating_sub(args.self_prompts).max(1)),
    };
    if args.self_prompts > 0 {
        let start = std::time::Instant::now();
        let own = prompts::self_prompts(model, tok, args.self_prompts, args.seed)?;
        eprintln!(
            "the model wrote {} requests of its own in {:.1} s, e.g. {:?}",
            own.len(),
            start.elapsed().as_secs_f64(),
            own.first().map(String::as_str).unwrap_or_default()
        );
        texts.extend(own);
        texts = prompts::shuffled(texts, args.seed);
    }
    let texts = prompts::render_chat(tok, &texts)?;
    Ok(match &args.heldout_prompts {
        Some(path) => tandem::train::PromptSet {
            train: texts,
            heldout: prompts::render_chat(tok, &prompts::read_file(path)?)?,
        },
        None => tandem::train::PromptSet::split(texts, args.heldout_seqs)?,
    })
}

/// A model folder or GGUF file with its tokenizer, weights in f32 (a
/// GGUF's dequantised) on `device`: what `train-mtp` and `eval-mtp` run.
fn load_f32(
    path: &Path,
    device: &str,
) -> Result<(tandem::model::Model, tandem::tokenizer::Tokenizer), BoxError> {
    let f32_weights = tandem::model::LoadOptions {
        device: device.parse::<DeviceKind>()?.open()?,
        ..Default::default()
    };
    Ok(if tandem::gguf::is_gguf_path(path) {
        (
            tandem::model::Model::from_gguf(path, &f32_weights)?,
            tandem::tokenizer::Tokenizer::from_gguf_path(path)?,
        )
    } else {
        (
            tandem::model::Model::from_dir(path, &f32_weights)?,
            tandem::tokenizer::Tokenizer::from_dir(path)?,
        )
    })
}

/// `tandem eval-mtp`: a saved head's acceptance on a prompt file.
fn eval_mtp(args: EvalArgs) -> Result<(), BoxError> {
    let (model, tokenizer) = load_f32(&args.model, &args.device)?;
    let mut head = tandem::model::MtpHead::from_dir(&model, &args.head)?;
    let texts = tandem::train::prompts::read_file(&args.prompts)?;
    let prompts = tandem::train::prompts::render_chat(&tokenizer, &texts)?;
    let (score, scored) = tandem::train::evaluate_head(
        &model,
        &mut head,
        &prompts,
        args.seq_len,
        args.draft_positions,
    )?;
    println!(
        "{}: {} prompts, {scored} answer positions scored",
        args.head.display(),
        prompts.len()
    );
    let tokens = tandem::train::tokens_per_step(&score.by_position);
    for (i, (a, t)) in score.by_position.iter().zip(&tokens).enumerate() {
        println!(
            "draft position {}: acceptance {a:.3} (draft length {}: {t:.2} tokens per step)",
            i + 1,
            i + 1
        );
    }
    let walk = score.walk;
    println!(
        "walked as an engine drafting {} a step: {} accepted in {} steps ({:.2} a step, {:.2} tokens per step)",
        args.draft_positions,
        walk.accepted,
        walk.steps,
        walk.per_step(),
        1.0 + walk.per_step()
    );
    Ok(())
}

/// `tandem train-mtp`: trains (or resumes) a head with a progress bar.
fn train_mtp(args: TrainArgs) -> Result<(), BoxError> {
    if args.draft_layers != 1 {
        return Err(format!(
            "--draft-layers {}: the MTP head has exactly one block (DeepSeek-V3 style)",
            args.draft_layers
        )
        .into());
    }
    let (model, tokenizer, name) = match &args.model {
        Some(path) => {
            let (model, tokenizer) = load_f32(path, &args.device)?;
            (model, Some(tokenizer), path.display().to_string())
        }
        None => {
            let preset = if args.embedded == "test" {
                TinyPreset::Test
            } else {
                TinyPreset::Default
            };
            let f32_weights = tandem::model::LoadOptions {
                device: args.device.parse::<DeviceKind>()?.open()?,
                ..Default::default()
            };
            (
                tandem::tiny::tiny_model(preset, &f32_weights)?.0,
                None,
                preset.name().to_string(),
            )
        }
    };
    let prompts = train_prompts(&args, &model, tokenizer.as_ref())?;
    let config = tandem::train::TrainConfig {
        steps: args.steps,
        batch: args.batch,
        seq_len: args.seq_len,
        lr: args.lr,
        train_seqs: args.train_seqs,
        heldout_seqs: args.heldout_seqs,
        temperature: args.temperature,
        draft_positions: args.draft_positions,
        eval_every: args.eval_every,
        checkpoint_every: args.checkpoint_every,
        seed: args.seed,
        draft_vocab: args.draft_vocab,
        soft_labels: args.soft_labels,
        rounds: args.rounds,
    };
    eprintln!(
        "{name}: generating {} training and {} held-out sequences of {} tokens from {} + {} prompts",
        config.train_seqs,
        config.heldout_seqs,
        config.seq_len,
        prompts.train.len(),
        prompts.heldout.len()
    );
    let mut trainer = if args.resume {
        tandem::train::Trainer::resume(&model, &args.out, &prompts)?
    } else {
        tandem::train::Trainer::new(&model, config, &prompts)?
    };
    let d = trainer.data();
    eprintln!(
        "data in {:.1} s: {} training sequences ({} labels, mean prompt {:.1} tokens, {} ended at an EOS), {} held-out ({} labels); draft vocabulary {} rows covering {:.4} of held-out labels",
        d.seconds,
        d.train_seqs,
        d.train_tokens,
        d.mean_prompt_tokens,
        d.ended_early,
        d.heldout_seqs,
        d.heldout_tokens,
        d.draft_vocab,
        d.heldout_coverage
    );
    let bar = ProgressBar::new(trainer.config().steps as u64);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} steps {elapsed_precise} {msg}")
            .expect("valid template"),
    );
    bar.set_position(trainer.step() as u64);
    let report = trainer.run(&args.out, |step, loss, eval| {
        bar.set_position(step as u64);
        let evaluated_now = eval.is_some_and(|e| e.step == step);
        let eval = eval.map_or(String::new(), |e| {
            format!(", held-out loss {:.3}, top-1 {:.3}", e.loss, e.top1)
        });
        // Without a terminal the bar is hidden: a log still shows each
        // evaluation.
        if bar.is_hidden() && evaluated_now {
            eprintln!("step {step}: loss {loss:.3}{eval}");
        }
        bar.set_message(format!("loss {loss:.3}{eval}"));
    })?;
    bar.finish_and_clear();
    let last = report.evals.last();
    println!(
        "trained {} steps in {:.1} s; held-out loss {:.3}, top-1 agreement {:.3}",
        report.config.steps,
        report.seconds,
        last.map_or(f64::NAN, |e| e.loss),
        last.map_or(f64::NAN, |e| e.top1)
    );
    for (i, (a, t)) in report
        .acceptance
        .iter()
        .zip(&report.tokens_per_step)
        .enumerate()
    {
        println!(
            "draft position {}: acceptance {a:.3} (draft length {}: {t:.2} tokens per step)",
            i + 1,
            i + 1
        );
    }
    println!(
        "head written to {} (serve it with --mtp head:{})",
        args.out.join(tandem::model::mtp::MTP_FILE).display(),
        args.out.display()
    );
    Ok(())
}
