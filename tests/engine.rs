//! The engine executor driven directly with plans: exactness against the
//! stories260k reference, batched == solo for mixed sampling options, and
//! per-sequence failures.

mod support;

use std::collections::HashMap;
use std::sync::Arc;

use support::engine_driver::{run_tokens, Req};
use support::reference::stories260k;

use tandem::engine::*;
use tandem::model::{LoadOptions, Model};
use tandem::sampler::SamplingOptions;
use tandem::tiny::{tiny_model_cpu, TinyPreset};

fn ids(tokens: &[GeneratedToken]) -> Vec<u32> {
    tokens.iter().map(|t| t.id).collect()
}

fn engine_for(model: Model, kv: usize) -> Engine {
    Engine::new(
        model,
        EngineConfig {
            kv_capacity_tokens: kv,
            model_name: "test".into(),
            eos_ids: vec![],
            ..Default::default()
        },
    )
}

#[test]
fn stories260k_reference_through_the_engine() {
    let Some(stories) = stories260k() else {
        return;
    };
    let reqs: Vec<Req> = stories
        .prompts
        .iter()
        .map(|p| Req {
            prompt: p.clone(),
            sampling: SamplingOptions::greedy(),
            max_new: 64,
            spec: None,
        })
        .collect();
    let (dir, want) = (&stories.dir, &stories.generated);
    let mut engine = engine_for(Model::from_dir(dir, &LoadOptions::default()).unwrap(), 4096);
    for chunk in [1, 3, 512] {
        let got: Vec<Vec<u32>> = run_tokens(&mut engine, &reqs, chunk)
            .iter()
            .map(|t| ids(t))
            .collect();
        assert_eq!(&got, want, "chunk {chunk}");
        assert_eq!(
            engine.kv_reserved_tokens(),
            0,
            "finished slots free their KV"
        );
    }
}

fn mixed_requests() -> Vec<Req> {
    let opts = [
        SamplingOptions::greedy(),
        SamplingOptions {
            temperature: 0.8,
            top_p: 0.9,
            seed: Some(7),
            ..Default::default()
        },
        SamplingOptions {
            repeat_penalty: 1.3,
            presence_penalty: 0.5,
            repeat_last_n: 16,
            ..Default::default()
        },
        SamplingOptions {
            logprobs: true,
            top_logprobs: 3,
            ..Default::default()
        },
        SamplingOptions {
            temperature: 1.0,
            top_k: 20,
            min_p: 0.05,
            seed: Some(99),
            frequency_penalty: 0.4,
            ..Default::default()
        },
        SamplingOptions {
            temperature: 0.7,
            seed: Some(1),
            logprobs: true,
            top_logprobs: 2,
            ..Default::default()
        },
    ];
    (0..12)
        .map(|i| Req {
            prompt: (0..(3 + 5 * i) as u32)
                .map(|t| (t * 13 + i as u32 * 7) % 500 + 3)
                .collect(),
            sampling: opts[i % opts.len()],
            max_new: 20 + i,
            spec: None,
        })
        .collect()
}

#[test]
fn batched_equals_solo_with_mixed_options() {
    let (model, _) = tiny_model_cpu(TinyPreset::Test).unwrap();
    let mut engine = engine_for(model, 8192);
    let reqs = mixed_requests();
    let batched = run_tokens(&mut engine, &reqs, 7);
    for (i, r) in reqs.iter().enumerate() {
        let solo = run_tokens(&mut engine, std::slice::from_ref(r), 64);
        assert_eq!(ids(&batched[i]), ids(&solo[0]), "request {i} token ids");
        for (a, b) in batched[i].iter().zip(&solo[0]) {
            assert_eq!(a.logprob.is_some(), r.sampling.logprobs);
            assert_eq!(
                a.top_logprobs.len(),
                if r.sampling.logprobs {
                    r.sampling.top_logprobs
                } else {
                    0
                }
            );
            if let (Some(x), Some(y)) = (a.logprob, b.logprob) {
                assert!((x - y).abs() < 1e-4, "logprob {x} vs {y}");
            }
        }
        assert_eq!(
            batched[i].len(),
            r.max_new,
            "Length finish after max_new tokens"
        );
    }
}

#[test]
fn one_bad_sequence_does_not_fail_the_others() {
    let (model, _) = tiny_model_cpu(TinyPreset::Test).unwrap();
    let mut engine = engine_for(model, 100);
    let ok = Admission {
        slot: 1,
        prompt: Arc::from(vec![5u32, 6, 7]),
        sampling: SamplingOptions::greedy(),
        max_new_tokens: 4,
        kv: KvGrant::Reserve(7),
        spec: None,
        constraints: Default::default(),
    };
    let too_big = Admission {
        slot: 2,
        kv: KvGrant::Reserve(1000),
        ..ok.clone()
    };
    let bad_opts = Admission {
        slot: 3,
        sampling: SamplingOptions {
            top_p: 2.0,
            ..Default::default()
        },
        ..ok.clone()
    };
    let plan = StepPlan {
        step: 0,
        admit: vec![ok, too_big, bad_opts],
        work: vec![
            SeqWork::Prefill {
                slot: 1,
                start: 0,
                len: 3,
            },
            SeqWork::Prefill {
                slot: 2,
                start: 0,
                len: 3,
            },
            SeqWork::Decode {
                slot: 3,
                max_drafts: 0,
            },
            SeqWork::Prefill {
                slot: 9,
                start: 0,
                len: 1,
            },
        ],
        ..Default::default()
    };
    let outcome = engine.execute(plan);
    let by_slot: HashMap<u32, Vec<&Result<SeqProgress, EngineError>>> =
        outcome.seqs.iter().fold(HashMap::new(), |mut m, s| {
            m.entry(s.slot).or_default().push(&s.result);
            m
        });
    assert!(
        matches!(
            by_slot[&2][0],
            Err(EngineError::KvExhausted {
                requested: 1000,
                ..
            })
        ),
        "{:?}",
        by_slot[&2]
    );
    assert!(
        matches!(by_slot[&3][0], Err(EngineError::Sampler(_))),
        "{:?}",
        by_slot[&3]
    );
    assert!(matches!(by_slot[&9][0], Err(EngineError::UnknownSlot(9))));
    let ok = by_slot[&1]
        .iter()
        .find_map(|r| r.as_ref().ok())
        .expect("slot 1 ran");
    assert_eq!(ok.prefilled, 3);
    assert_eq!(ok.tokens.len(), 1);
    assert_eq!(
        engine.kv_reserved_tokens(),
        7,
        "only the good slot holds KV"
    );
    // A decode that would leave the reservation fails only that slot.
    let outcome = engine.execute(StepPlan {
        step: 1,
        work: vec![SeqWork::Prefill {
            slot: 1,
            start: 0,
            len: 1,
        }],
        ..Default::default()
    });
    assert!(matches!(
        outcome.seqs[0].result,
        Err(EngineError::InvalidWork { slot: 1, .. })
    ));
    assert_eq!(
        engine.kv_reserved_tokens(),
        0,
        "the failed slot was dropped"
    );
}

#[test]
fn eos_ends_a_sequence_on_the_eos_token() {
    let (model, _) = tiny_model_cpu(TinyPreset::Test).unwrap();
    // Find what greedy generates, then declare its third token an EOS.
    let mut engine = engine_for(model, 1000);
    let req = Req {
        prompt: vec![1, 40, 41, 42],
        sampling: SamplingOptions::greedy(),
        max_new: 10,
        spec: None,
    };
    let free_run = ids(&run_tokens(&mut engine, std::slice::from_ref(&req), 64)[0]);
    let eos = free_run[2];
    let first = free_run.iter().position(|&t| t == eos).unwrap();
    let (model, _) = tiny_model_cpu(TinyPreset::Test).unwrap();
    let mut engine = Engine::new(
        model,
        EngineConfig {
            kv_capacity_tokens: 1000,
            model_name: "t".into(),
            eos_ids: vec![eos],
            ..Default::default()
        },
    );
    let got = ids(&run_tokens(&mut engine, std::slice::from_ref(&req), 64)[0]);
    assert_eq!(got, free_run[..=first].to_vec());
    assert_eq!(engine.kv_reserved_tokens(), 0);
}
