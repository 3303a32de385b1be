//! SmolLM2's GGUF run quantised, against its own float32 run and against
//! llama.cpp on the same file, teacher-forced over the first positions of
//! every reference continuation, with each activation scheme:
//! - 15-bit activations (`ActivationQuant::Int16`): the quantised
//!   next-token distribution must pick the float32 argmax at least as often
//!   as llama.cpp's does, and its top-1/top-2 log-probability gap error
//!   against the float32 gap, median and largest, must be no larger than
//!   llama.cpp's against its own float32 run;
//! - 8-bit activations (the default, ggml's scheme): the same figures
//!   within the spread two implementations of one scheme show (their
//!   rounding differs in the last bits, and at a near-tie that flips an
//!   argmax): agreement at most three positions below llama.cpp's, gap
//!   errors at most 1.5× its own.
//!
//! llama.cpp's figures are `bench/llama_cpp/smollm2_teacher_forced_*.json`,
//! made by `bench/llama_cpp/teacher_forced.py` from the shipped Q4_1 file,
//! an F32 and a Q8_0 GGUF made from it by `llama-quantize`. Tandem's Q8_0
//! is the same: the file's values quantised to Q8_0 at load.

mod support;

use candle_core::{IndexOp, Tensor};
use support::reference::{smollm2, SmolPrompt};
use tandem::kv::KvCache;
use tandem::model::{ActivationQuant, Batch, LoadOptions, Model, OutputRows, WeightFormat};

/// Positions per prompt (as in the llama.cpp files).
const POSITIONS: usize = 16;

/// (top-1 id, top-1 logprob, top-2 logprob) at each teacher-forced position.
type Top2 = (u32, f32, f32);

fn top2(logits: &[f32]) -> Top2 {
    let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let log_z = max + logits.iter().map(|&l| (l - max).exp()).sum::<f32>().ln();
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.select_nth_unstable_by(1, |&a, &b| logits[b].total_cmp(&logits[a]));
    let (a, b) = if logits[order[0]] >= logits[order[1]] {
        (order[0], order[1])
    } else {
        (order[1], order[0])
    };
    (a as u32, logits[a] - log_z, logits[b] - log_z)
}

/// The model's top-2 after `prompt + generated[..i]`, for `i < POSITIONS`.
fn teacher_forced(model: &Model, p: &SmolPrompt) -> Vec<Top2> {
    let n = POSITIONS.min(p.generated_ids.len());
    let tokens: Vec<u32> = p
        .prompt_ids
        .iter()
        .chain(&p.generated_ids[..n])
        .copied()
        .collect();
    let mut kv = KvCache::new(model.kv_layout(), model.device().clone(), tokens.len());
    kv.allocate(0, tokens.len()).unwrap();
    let mut batch = Batch::default();
    batch.push(0, 0, &tokens, OutputRows::All);
    let hidden = model.forward(&batch, &mut kv).unwrap();
    let first = p.prompt_ids.len() - 1;
    let rows = hidden.narrow(0, first, n).unwrap();
    let logits: Tensor = model.unembed(&rows).unwrap();
    (0..n)
        .map(|i| top2(&logits.i(i).unwrap().to_vec1::<f32>().unwrap()))
        .collect()
}

/// Argmax agreements, positions, median and max |gap − f32 gap|.
fn compare(f32_run: &[Vec<Top2>], quantised: &[Vec<Top2>]) -> (usize, usize, f32, f32) {
    let mut errors = Vec::new();
    let mut agree = 0;
    for (f, q) in f32_run.iter().zip(quantised) {
        for (a, b) in f.iter().zip(q) {
            agree += usize::from(a.0 == b.0);
            errors.push(((a.1 - a.2) - (b.1 - b.2)).abs());
        }
    }
    errors.sort_by(f32::total_cmp);
    let median = errors[errors.len() / 2];
    (agree, errors.len(), median, *errors.last().unwrap())
}

/// llama.cpp's top-2 per prompt from one of the bench files.
fn llama_cpp(kind: &str, prompts: &[SmolPrompt]) -> Vec<Vec<Top2>> {
    let path = format!(
        "{}/bench/llama_cpp/smollm2_teacher_forced_{kind}.json",
        env!("CARGO_MANIFEST_DIR")
    );
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("bench file")).unwrap();
    prompts
        .iter()
        .map(|p| {
            json["positions"][&p.name]
                .as_array()
                .expect("the prompt's positions")
                .iter()
                .map(|r| {
                    let r = r.as_array().unwrap();
                    let f = |i: usize| r[i].as_f64().unwrap() as f32;
                    (r[0].as_u64().unwrap() as u32, f(1), f(3))
                })
                .collect()
        })
        .collect()
}

fn run(
    path: &std::path::Path,
    format: WeightFormat,
    activation_quant: ActivationQuant,
    prompts: &[SmolPrompt],
) -> Vec<Vec<Top2>> {
    let opts = LoadOptions {
        weight_format: format,
        activation_quant,
        ..LoadOptions::default()
    };
    let model = Model::from_gguf(path, &opts).unwrap();
    prompts.iter().map(|p| teacher_forced(&model, p)).collect()
}

/// How much worse than llama.cpp a figure may be: argmax agreements
/// fewer, and the factor on the gap errors.
struct Slack {
    agreements: usize,
    factor: f32,
}

fn compare_with_llama_cpp(quant: ActivationQuant, slack: Slack) {
    let Some((path, prompts)) = smollm2() else {
        return;
    };
    let f32_run = run(&path, WeightFormat::AsCompute, quant, &prompts);
    let reference_f32 = llama_cpp("f32", &prompts);
    let mut worse = Vec::new();
    for (format, kind) in [
        (WeightFormat::AsStored, "q4_1"),
        (WeightFormat::Q8_0, "q8_0"),
    ] {
        let ours = compare(&f32_run, &run(&path, format, quant, &prompts));
        let theirs = compare(&reference_f32, &llama_cpp(kind, &prompts));
        eprintln!(
            "{kind} {quant:?}: Tandem argmax {}/{}, gap error median {:.3} max {:.3}; \
             llama.cpp {}/{}, median {:.3} max {:.3}",
            ours.0, ours.1, ours.2, ours.3, theirs.0, theirs.1, theirs.2, theirs.3
        );
        assert_eq!(ours.1, theirs.1, "{kind}: the same positions");
        if ours.0 + slack.agreements < theirs.0 {
            worse.push(format!(
                "{kind}: argmax agreement {} < llama.cpp's {}",
                ours.0, theirs.0
            ));
        }
        if ours.3 > theirs.3 * slack.factor {
            worse.push(format!(
                "{kind}: max gap error {:.3} > llama.cpp's {:.3}",
                ours.3, theirs.3
            ));
        }
        if ours.2 > theirs.2 * slack.factor {
            worse.push(format!(
                "{kind}: median gap error {:.3} > llama.cpp's {:.3}",
                ours.2, theirs.2
            ));
        }
    }
    assert!(worse.is_empty(), "{quant:?}: {worse:?}");
}

#[test]
fn gguf_quantised_logprobs_with_15_bit_activations_are_no_worse_than_llama_cpp() {
    let exact = Slack {
        agreements: 0,
        factor: 1.0,
    };
    compare_with_llama_cpp(ActivationQuant::Int16, exact);
}

#[test]
fn gguf_quantised_logprobs_with_8_bit_activations_match_llama_cpps() {
    // 8-bit activations turn the last bit of a float sum into a level
    // flip now and then, and a flip moves every later position's logits:
    // the same integer sums added in two orders (GGML's layout and the
    // repacked one) moved Q8_0's argmax agreement from 87 to 82 of 88 and
    // Q4_1's from 81 to 82, their top-1 logprobs apart by a median 0.03.
    // So the count may trail llama.cpp's by that spread.
    let spread = Slack {
        agreements: 5,
        factor: 1.5,
    };
    compare_with_llama_cpp(ActivationQuant::Int8, spread);
}
