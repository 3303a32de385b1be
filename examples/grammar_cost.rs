//! The cost of grammar masks (issue #19): per decode step at B = 1, 16 and
//! 64 sequences under a JSON schema, as a share of the step, and the
//! decode throughput of B constrained sequences against B unconstrained
//! ones in the same run.
//!
//! ```sh
//! cargo run --release --example grammar_cost -- \
//!     --model ../shared/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf
//! ```
//!
//! It drives the engine directly (one step per plan, as the scheduler
//! would), so the numbers are the engine's own `StepStats`: `mask` is the
//! mask worker's wall time (overlapped with the forward pass), `wait` how
//! long the step waited for it after the pass (the masks' cost on the
//! critical path), `step` the whole step. Only decode steps in which every
//! sequence is still running count. Options: `--batches 1,16,64`,
//! `--steps N` (decode steps per run, default 48), `--dtype`-free: the
//! GGUF's weights as stored (the server's default).

use std::sync::Arc;
use std::time::Duration;

use tandem::engine::*;
use tandem::model::{LoadOptions, WeightFormat};
use tandem::sampler::SamplingOptions;
use tandem::structured::GrammarSpec;
use tandem::tokenizer::Tokenizer;

/// A schema whose documents run long (an array of at least 64 strings), so
/// no sequence finishes inside the measured steps.
fn schema() -> serde_json::Value {
    serde_json::json!({
        "type": "object",
        "properties": {
            "title": {"type": "string"},
            "notes": {"type": "array", "items": {"type": "string"}, "minItems": 64},
        },
        "required": ["title", "notes"],
        "additionalProperties": false,
    })
}

struct Run {
    /// Per measured decode step: (forward, mask, wait, total).
    steps: Vec<(Duration, Duration, Duration, Duration)>,
    tokens: usize,
    wall: Duration,
}

fn run(model_path: &str, tokenizer: &Tokenizer, b: usize, steps: usize, constrained: bool) -> Run {
    let file = tandem::gguf::GgufFile::open(std::path::Path::new(model_path)).expect("GGUF");
    let opts = LoadOptions {
        weight_format: WeightFormat::AsStored,
        ..LoadOptions::default()
    };
    let model = tandem::gguf::load_model(&file, &opts).expect("model");
    let mut engine = Engine::new(
        model,
        EngineConfig {
            kv_capacity_tokens: 64 * 1024,
            eos_ids: tokenizer.eos_ids().to_vec(),
            ..Default::default()
        },
    );
    let compiler = tokenizer.grammar_compiler().expect("grammar compiler");
    let spec = GrammarSpec::JsonSchema { schema: schema() };
    let prompt: Arc<[u32]> = tokenizer
        .encode("<|im_start|>user\nWrite notes as JSON.<|im_end|>\n<|im_start|>assistant\n")
        .expect("encode")
        .into();
    let mut plan = StepPlan::default();
    for i in 0..b as u32 {
        plan.admit.push(Admission {
            slot: i,
            prompt: prompt.clone(),
            sampling: SamplingOptions {
                temperature: 0.8,
                seed: Some(u64::from(i)),
                repeat_last_n: 0,
                ..SamplingOptions::default()
            },
            max_new_tokens: steps + 2,
            kv: KvGrant::Reserve(prompt.len() + steps + 2),
            spec: Some(SpecOptions::off()),
            constraints: SeqConstraints {
                grammar: constrained.then(|| compiler.compile(&spec).expect("schema")),
                ..SeqConstraints::default()
            },
        });
        plan.work.push(SeqWork::Prefill {
            slot: i,
            start: 0,
            len: prompt.len(),
        });
    }
    let mut out = Run {
        steps: Vec::new(),
        tokens: 0,
        wall: Duration::ZERO,
    };
    let first = engine.execute(plan);
    assert!(
        first.seqs.iter().all(|s| s.result.is_ok()),
        "prefill failed"
    );
    let mut live: Vec<u32> = (0..b as u32).collect();
    for step in 1..=steps as u64 {
        let plan = StepPlan {
            step,
            work: live
                .iter()
                .map(|&slot| SeqWork::Decode {
                    slot,
                    max_drafts: 0,
                })
                .collect(),
            ..StepPlan::default()
        };
        let outcome = engine.execute(plan);
        let all_live = outcome.seqs.len() == b;
        for s in &outcome.seqs {
            let p = s.result.as_ref().expect("decode");
            out.tokens += p.tokens.len();
            if p.finish.is_some() {
                live.retain(|&x| x != s.slot);
            }
        }
        let st = &outcome.stats;
        out.wall += st.total;
        if all_live {
            out.steps
                .push((st.forward, st.mask, st.mask_wait, st.total));
        }
        if live.is_empty() {
            break;
        }
    }
    out
}

fn mean(d: impl Iterator<Item = Duration>, n: usize) -> f64 {
    d.sum::<Duration>().as_secs_f64() * 1e3 / n.max(1) as f64
}

fn main() {
    tandem::model::fit_cpu_threads_to_affinity();
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1).cloned())
    };
    let model = arg("--model").unwrap_or_else(|| {
        "../shared/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf".into()
    });
    let steps: usize = arg("--steps").and_then(|s| s.parse().ok()).unwrap_or(48);
    let batches: Vec<usize> = arg("--batches")
        .unwrap_or_else(|| "1,16,64".into())
        .split(',')
        .filter_map(|s| s.parse().ok())
        .collect();
    let file = tandem::gguf::GgufFile::open(std::path::Path::new(&model)).expect("GGUF");
    let tokenizer = Tokenizer::from_gguf(&file).expect("tokenizer");
    let t = std::time::Instant::now();
    tokenizer.grammar_compiler().expect("grammar compiler");
    println!(
        "token trie + parser factory: {:.1} ms",
        t.elapsed().as_secs_f64() * 1e3
    );
    println!(
        "B\tmode\tsteps\tforward_ms\tmask_ms\twait_ms\tstep_ms\tmask_share\twait_share\ttok/s"
    );
    let mut throughput = Vec::new();
    for &b in &batches {
        for constrained in [false, true] {
            let r = run(&model, &tokenizer, b, steps, constrained);
            let n = r.steps.len();
            let fwd = mean(r.steps.iter().map(|s| s.0), n);
            let mask = mean(r.steps.iter().map(|s| s.1), n);
            let wait = mean(r.steps.iter().map(|s| s.2), n);
            let step = mean(r.steps.iter().map(|s| s.3), n);
            let tps = r.tokens as f64 / r.wall.as_secs_f64();
            throughput.push((b, constrained, tps));
            println!(
                "{b}\t{}\t{n}\t{fwd:.2}\t{mask:.3}\t{wait:.3}\t{step:.2}\t{:.1}%\t{:.1}%\t{tps:.1}",
                if constrained { "json" } else { "free" },
                100.0 * mask / step,
                100.0 * wait / step,
            );
        }
    }
    for &b in &batches {
        let get = |c: bool| {
            throughput
                .iter()
                .find(|t| t.0 == b && t.1 == c)
                .map_or(0.0, |t| t.2)
        };
        println!(
            "B = {b}: constrained / unconstrained throughput = {:.3}",
            get(true) / get(false)
        );
    }
}
