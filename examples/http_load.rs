//! What HTTP costs: the same load — N concurrent streaming greedy
//! completions — once through the library API ([`TandemHandle::generate`])
//! and once through the OpenAI-compatible server (SSE over loopback, parsed
//! by a reqwest client), against one in-process scheduler on the embedded
//! model. Prints both aggregate tokens/s and their ratio.
//!
//! ```text
//! cargo run --release --example http_load
//! cargo run --release --example http_load -- --clients 32 --max-tokens 128 --rounds 3
//! ```
//!
//! Rounds alternate library / HTTP so that drift (thermal, other load)
//! hits both alike; the best round of each is reported, and every HTTP text
//! is checked against the library's text for the same prompt.

use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use futures_util::future::join_all;
use futures_util::StreamExt;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};
use tandem::api::{Event, GenerateRequest, Prompt};
use tandem::engine::{Engine, EngineConfig};
use tandem::scheduler::SchedulerConfig;
use tandem::server::{self, AppState, ChatTemplate, HttpConfig, ListenConfig};
use tandem::tiny::{tiny_model_cpu, TinyPreset};
use tandem::TandemHandle;

#[derive(Parser, Debug)]
#[command(about = "Aggregate tokens/s through the library API vs. through HTTP")]
struct Args {
    /// Concurrent streaming clients.
    #[arg(long, default_value_t = 32)]
    clients: usize,
    /// Prompt length in tokens.
    #[arg(long, default_value_t = 32)]
    prompt_tokens: usize,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Rounds of each (alternating); the best of each is reported.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// HTTP worker threads.
    #[arg(long, default_value_t = 1)]
    workers: usize,
    /// Use the small Test model instead of the default one.
    #[arg(long)]
    test_model: bool,
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

fn main() -> Result<(), BoxError> {
    tandem::model::fit_cpu_threads_to_affinity();
    let args = Args::parse();
    let preset = if args.test_model {
        TinyPreset::Test
    } else {
        TinyPreset::Default
    };
    let (handle, addr) = start_server(preset, &args)?;
    let vocab = handle.info().vocab_size as u32;
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let prompts: Vec<Vec<u32>> = (0..args.clients)
        .map(|_| {
            std::iter::once(1)
                .chain((1..args.prompt_tokens).map(|_| rng.random_range(3..vocab)))
                .collect()
        })
        .collect();
    println!(
        "model {} | {} clients x {} prompt + {} generated tokens | {} HTTP worker(s)",
        preset.name(),
        args.clients,
        args.prompt_tokens,
        args.max_tokens,
        args.workers
    );

    // The client side runs on one thread, as a separate process would use
    // little CPU; its parsing work is still counted in the HTTP figure.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(args.clients)
            .build()?;
        // Warm-up (allocations, connections).
        run_library(&handle, &prompts[..4], 8).await?;
        run_http(&client, addr, &prompts[..4], 8).await?;

        let (mut best_lib, mut best_http) = (Duration::MAX, Duration::MAX);
        let mut reference = Vec::new();
        for round in 0..args.rounds {
            let (t_lib, texts) = run_library(&handle, &prompts, args.max_tokens).await?;
            let (t_http, http_texts) = run_http(&client, addr, &prompts, args.max_tokens).await?;
            if round == 0 {
                reference = texts;
            }
            if http_texts != reference {
                return Err::<(), BoxError>("HTTP texts differ from the library's".into());
            }
            let total = (args.clients * args.max_tokens) as f64;
            println!(
                "round {round}: library {:>8.1} tokens/s ({:.2?}) | http {:>8.1} tokens/s ({:.2?})",
                total / t_lib.as_secs_f64(),
                t_lib,
                total / t_http.as_secs_f64(),
                t_http
            );
            best_lib = best_lib.min(t_lib);
            best_http = best_http.min(t_http);
        }
        let total = (args.clients * args.max_tokens) as f64;
        let (lib, http) = (
            total / best_lib.as_secs_f64(),
            total / best_http.as_secs_f64(),
        );
        println!("best: library {lib:.1} tokens/s | http {http:.1} tokens/s");
        println!(
            "http / library = {:.3} (HTTP costs {:.1} % of aggregate throughput)",
            http / lib,
            (1.0 - http / lib) * 100.0
        );
        Ok(())
    })?;
    Ok(())
}

/// Starts the scheduler and the HTTP server in an actix System on its own
/// thread (as `tandem serve` does, minus signals).
fn start_server(
    preset: TinyPreset,
    args: &Args,
) -> Result<(TandemHandle, std::net::SocketAddr), BoxError> {
    let workers = args.workers;
    let kv_tokens = args.clients * (args.prompt_tokens + args.max_tokens) * 2;
    let (tx, rx) = std::sync::mpsc::channel::<Result<_, String>>();
    std::thread::spawn(move || {
        let system = actix_web::rt::System::new();
        let started = system.block_on(async move {
            let (model, tokenizer) = tiny_model_cpu(preset).map_err(|e| e.to_string())?;
            let template = ChatTemplate::from_tokenizer(&tokenizer).map_err(|e| e.to_string())?;
            let engine = Engine::new(
                model,
                EngineConfig {
                    kv_capacity_tokens: kv_tokens,
                    model_name: preset.name().into(),
                    eos_ids: Vec::new(),
                    ..Default::default()
                },
            );
            let handle = TandemHandle::start(engine, tokenizer, SchedulerConfig::default())
                .map_err(|e| e.to_string())?;
            let state = AppState::new(HttpConfig::default());
            state.set_ready(handle.clone(), template);
            let listen = ListenConfig {
                port: 0,
                workers,
                ..ListenConfig::default()
            };
            let (http, addr) =
                server::bind(Arc::clone(&state), &listen).map_err(|e| e.to_string())?;
            actix_web::rt::spawn(http);
            Ok((handle, addr))
        });
        let ok = started.is_ok();
        let _ = tx.send(started);
        if ok {
            system.run().ok();
        }
    });
    Ok(rx.recv()??)
}

/// All prompts at once through `TandemHandle::generate`; (wall time, texts).
async fn run_library(
    handle: &TandemHandle,
    prompts: &[Vec<u32>],
    max_tokens: usize,
) -> Result<(Duration, Vec<String>), BoxError> {
    let t0 = Instant::now();
    let runs = prompts.iter().map(|p| async move {
        let request = GenerateRequest {
            prompt: Prompt::Tokens(p.clone()),
            ..GenerateRequest::new("", max_tokens)
        };
        let mut events = handle.generate(request).await?;
        let mut text = String::new();
        while let Some(event) = events.next().await {
            match event {
                Event::Tokens { text: t, .. } => text.push_str(&t),
                Event::Finished(_) => break,
                Event::Error { error, .. } => return Err(BoxError::from(error)),
            }
        }
        Ok(text)
    });
    let texts = join_all(runs)
        .await
        .into_iter()
        .collect::<Result<Vec<_>, _>>()?;
    Ok((t0.elapsed(), texts))
}

/// All prompts at once as streaming `/v1/completions`; (wall time, texts).
/// Bodies are read as they stream and parsed after the clock stops.
async fn run_http(
    client: &reqwest::Client,
    addr: std::net::SocketAddr,
    prompts: &[Vec<u32>],
    max_tokens: usize,
) -> Result<(Duration, Vec<String>), BoxError> {
    let url = format!("http://{addr}/v1/completions");
    let t0 = Instant::now();
    let runs = prompts.iter().map(|p| {
        let body = json!({"prompt": p, "max_tokens": max_tokens, "temperature": 0, "stream": true});
        let (client, url) = (client.clone(), url.clone());
        async move {
            let response = client.post(&url).json(&body).send().await?;
            if !response.status().is_success() {
                return Err(BoxError::from(format!("HTTP {}", response.status())));
            }
            let mut stream = response.bytes_stream();
            let mut raw = Vec::new();
            while let Some(chunk) = stream.next().await {
                raw.extend_from_slice(&chunk?);
            }
            Ok::<_, BoxError>(raw)
        }
    });
    let bodies = join_all(runs)
        .await
        .into_iter()
        .collect::<Result<Vec<_>, _>>()?;
    let elapsed = t0.elapsed();
    let texts = bodies
        .iter()
        .map(|raw| sse_text(raw))
        .collect::<Result<_, _>>()?;
    Ok((elapsed, texts))
}

/// The completion text of an SSE body.
fn sse_text(raw: &[u8]) -> Result<String, BoxError> {
    let body = std::str::from_utf8(raw)?;
    let mut text = String::new();
    for event in body.split("\n\n") {
        match event.trim().strip_prefix("data: ") {
            Some("[DONE]") | None => {}
            Some(data) => {
                let chunk: Value = serde_json::from_str(data)?;
                text.push_str(chunk["choices"][0]["text"].as_str().unwrap_or(""));
            }
        }
    }
    Ok(text)
}
