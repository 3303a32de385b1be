//! Speculation on the real model: SmolLM2-135M-Instruct (the Q4_1 GGUF,
//! f32 compute) with prompt lookup, and with lookup and a draft head, in
//! one mixed batch of 16 (greedy reference prompts and seeded sampled
//! requests), must emit exactly what speculation off emits: the float32
//! greedy references of `reference.json`, and for every seeded request its
//! speculation-off tokens. Skips, saying so, when `../shared` is absent.
//!
//! The head is an untrained MTP head: exactness may not depend on the
//! head's quality (a trained head is a user's artefact; see `train_mtp.rs`).

mod support;

use support::engine_driver::{run, Req};
use support::reference::smollm2;
use tandem::engine::{
    DraftHead, Engine, EngineConfig, MtpDraft, PromptLookup, SpecConfig, SpecOptions,
};
use tandem::gguf::GgufFile;
use tandem::model::{LoadOptions, Model, MtpHead};
use tandem::sampler::SamplingOptions;

/// SmolLM2's `<|im_end|>`, where the reference stops.
const EOS: u32 = 2;

fn engine(model: Model, head: Option<Box<dyn DraftHead>>, lookup: bool) -> Engine {
    let e = Engine::new(
        model,
        EngineConfig {
            kv_capacity_tokens: 1 << 15,
            model_name: "smollm2".into(),
            eos_ids: vec![EOS],
            ..Default::default()
        },
    );
    if head.is_none() && !lookup {
        return e;
    }
    e.with_drafters(
        head,
        SpecConfig {
            prompt_lookup: lookup.then(PromptLookup::default),
            ..Default::default()
        },
    )
}

#[test]
fn smollm2_speculation_emits_exactly_what_decoding_without_it_emits() {
    let Some((path, prompts)) = smollm2() else {
        return;
    };
    let file = GgufFile::open(&path).expect("open the GGUF");
    let load = || tandem::gguf::load_model(&file, &LoadOptions::default()).expect("load");
    // 16 requests: the reference prompts greedy, then seeded sampled ones
    // over the same prompts; draft lengths vary from 1 to 4, adaptive too
    // (every length to 8 is covered on the small models, `mtp.rs`).
    let reqs: Vec<Req> = (0..16)
        .map(|i| {
            let p = &prompts[i % prompts.len()];
            let greedy = i < prompts.len();
            Req {
                prompt: p.prompt_ids.clone(),
                sampling: if greedy {
                    SamplingOptions::greedy()
                } else {
                    SamplingOptions {
                        temperature: 0.8,
                        top_p: 0.9,
                        seed: Some(i as u64),
                        ..Default::default()
                    }
                },
                max_new: if greedy { p.generated_ids.len() } else { 16 },
                spec: Some(match i % 3 {
                    0 => SpecOptions::default(),
                    _ => SpecOptions::constant(1 + i % 4),
                }),
            }
        })
        .collect();
    let t = std::time::Instant::now();
    let off = run(&mut engine(load(), None, false), &reqs, 64);
    eprintln!(
        "SmolLM2, speculation off: {} steps in {:?}",
        off.steps.len(),
        t.elapsed()
    );
    for (i, p) in prompts.iter().enumerate() {
        assert_eq!(
            off.ids(i),
            p.generated_ids,
            "prompt `{}`, speculation off",
            p.name
        );
    }
    let random_head = |model: &Model| -> Box<dyn DraftHead> {
        Box::new(MtpDraft {
            head: MtpHead::random(model, 7).expect("a random head"),
        })
    };
    // The head alone is the small models' case (`mtp.rs`); here it drafts
    // beside prompt lookup, wherever lookup proposes nothing.
    for (with_head, lookup) in [(false, true), (true, true)] {
        let t = std::time::Instant::now();
        let model = load();
        let head = with_head.then(|| random_head(&model));
        let got = run(&mut engine(model, head, lookup), &reqs, 64);
        let name = format!("head {with_head}, prompt lookup {lookup}");
        for i in 0..reqs.len() {
            assert_eq!(got.ids(i), off.ids(i), "{name}: request {i}");
        }
        let (d, a): (usize, usize) = (got.drafted.iter().sum(), got.accepted.iter().sum());
        eprintln!(
            "SmolLM2, {name}: acceptance {:.3} ({a}/{d}) in {} steps (off: {}), {:?}",
            a as f64 / d.max(1) as f64,
            got.steps.len(),
            off.steps.len(),
            t.elapsed()
        );
        assert!(d > 0, "{name}: something drafted");
    }
}
