//! A user-defined actor that talks to the scheduler with messages and gets
//! token events in its own mailbox.
//!
//! `BestOfN` fans one prompt out as N seeded samples (they share the
//! scheduler's batch, so they cost about one sequence's step time), keeps the
//! one with the highest mean token log-probability, and then continues the
//! winner for a second turn.
//!
//! ```text
//! cargo run --release --example custom_actor
//! ```

use std::collections::HashMap;

use actix::prelude::*;
use tandem::api::{Event, GenerateRequest, Prompt};
use tandem::engine::{Engine, EngineConfig};
use tandem::request::Generate;
use tandem::sampler::SamplingOptions;
use tandem::scheduler::{RequestId, Scheduler, SchedulerConfig, ShutdownMode};
use tandem::tiny::{tiny_model_cpu, TinyPreset};
use tandem::TandemHandle;

/// One candidate's progress.
#[derive(Default)]
struct Candidate {
    seed: u64,
    text: String,
    logprob_sum: f64,
    tokens: usize,
}

struct BestOfN {
    scheduler: Addr<Scheduler>,
    prompt: String,
    n: u64,
    candidates: HashMap<RequestId, Candidate>,
    finished: usize,
    turn: usize,
    done: Option<tokio::sync::oneshot::Sender<String>>,
}

impl BestOfN {
    fn fan_out(&mut self, ctx: &mut Context<Self>) {
        for seed in 0..self.n {
            let request = GenerateRequest {
                prompt: Prompt::Text(self.prompt.clone()),
                max_tokens: Some(24),
                sampling: SamplingOptions {
                    temperature: 0.9,
                    top_p: 0.95,
                    seed: Some(seed),
                    logprobs: true,
                    ..Default::default()
                },
                stop: vec![],
                mtp: None,
                constraints: Default::default(),
            };
            let msg = Generate {
                request,
                events: ctx.address().recipient().into(),
            };
            // The reply (the request id) arrives before or after the events;
            // events carry the id, so either order is fine.
            self.scheduler
                .send(msg)
                .into_actor(self)
                .map(move |res, act, _| match res {
                    Ok(Ok(id)) => act.candidates.entry(id).or_default().seed = seed,
                    other => eprintln!("candidate {seed} was refused: {other:?}"),
                })
                .wait(ctx);
        }
    }
}

impl Actor for BestOfN {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        self.fan_out(ctx);
    }
}

impl Handler<Event> for BestOfN {
    type Result = ();

    fn handle(&mut self, event: Event, ctx: &mut Context<Self>) {
        let id = event.id();
        match event {
            Event::Tokens { text, tokens, .. } => {
                let c = self.candidates.entry(id).or_default();
                c.text.push_str(&text);
                c.tokens += tokens.len();
                c.logprob_sum += tokens
                    .iter()
                    .filter_map(|t| t.logprob)
                    .map(f64::from)
                    .sum::<f64>();
            }
            Event::Finished(_) | Event::Error { .. } => {
                self.finished += 1;
                if self.finished < self.n as usize {
                    return;
                }
                let best = self
                    .candidates
                    .values()
                    .max_by(|a, b| {
                        (a.logprob_sum / a.tokens.max(1) as f64)
                            .total_cmp(&(b.logprob_sum / b.tokens.max(1) as f64))
                    })
                    .expect("n > 0 candidates");
                println!(
                    "turn {}: {} candidates; best (seed {}, mean logprob {:.3}):{}",
                    self.turn + 1,
                    self.n,
                    best.seed,
                    best.logprob_sum / best.tokens.max(1) as f64,
                    best.text
                );
                self.prompt = format!("{}{}", self.prompt, best.text);
                self.turn += 1;
                if self.turn < 2 {
                    self.candidates.clear();
                    self.finished = 0;
                    self.fan_out(ctx);
                } else if let Some(done) = self.done.take() {
                    let _ = done.send(self.prompt.clone());
                    ctx.stop();
                }
            }
        }
    }
}

fn main() {
    tandem::model::fit_cpu_threads_to_affinity();
    let system = System::new();
    system.block_on(async {
        let (model, tokenizer) = tiny_model_cpu(TinyPreset::Default).expect("embedded model");
        let engine = Engine::new(
            model,
            EngineConfig {
                kv_capacity_tokens: 32 * 1024,
                model_name: "tandem-tiny".into(),
                eos_ids: tokenizer.eos_ids().to_vec(),
                ..Default::default()
            },
        );
        // A prompt made of words the embedded vocabulary knows.
        let prompt = tokenizer.decode(&[40, 41, 42]).expect("decodable ids");
        let handle =
            TandemHandle::start(engine, tokenizer, SchedulerConfig::default()).expect("scheduler");
        let (tx, rx) = tokio::sync::oneshot::channel();
        BestOfN {
            scheduler: handle.scheduler().clone(),
            prompt,
            n: 8,
            candidates: HashMap::new(),
            finished: 0,
            turn: 0,
            done: Some(tx),
        }
        .start();
        let conversation = rx.await.expect("best-of-n finished");
        println!("final text: {conversation}");
        let stats = handle.stats().await.expect("stats");
        println!(
            "{} steps, mean {:.1} sequences per step",
            stats.steps, stats.mean_seqs_per_step
        );
        handle
            .shutdown(ShutdownMode::Drain)
            .await
            .expect("shutdown");
    });
}
