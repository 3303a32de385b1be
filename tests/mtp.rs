//! Speculative (MTP) decoding: exactness for greedy requests with every kind
//! of draft, acceptance of a perfect draft, preservation of the target
//! distribution for sampled requests, stops inside accepted runs, and the
//! stories260k reference.

mod support;

use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};
use support::engine_driver::{run, Req};
use support::reference::stories260k;
use tandem::engine::*;
use tandem::kv::KvCache;
use tandem::model::{LoadOptions, Model, ModelConfig, ModelError, MtpHead, Weights};
use tandem::sampler::SamplingOptions;
use tandem::tiny::{tiny_model_cpu, TinyPreset};

fn engine(model: Model, head: Option<Box<dyn DraftHead>>, eos: Vec<u32>) -> Engine {
    let e = Engine::new(
        model,
        EngineConfig {
            kv_capacity_tokens: 1 << 16,
            model_name: "t".into(),
            eos_ids: eos,
            ..Default::default()
        },
    );
    match head {
        Some(h) => e.with_draft(h, SpecConfig::default()),
        None => e,
    }
}

/// A useless draft: uniform-random logits, each round taking at least
/// `.1` (a real head's cost; the policy weighs it).
struct RandomDraft(rand_chacha::ChaCha8Rng, std::time::Duration);

impl DraftHead for RandomDraft {
    fn name(&self) -> String {
        "random".into()
    }
    fn draft(
        &mut self,
        model: &Model,
        _kv: &mut KvCache,
        inputs: &[DraftInput],
    ) -> Result<Tensor, ModelError> {
        let v = model.config().vocab_size;
        std::thread::sleep(self.1);
        let data: Vec<f32> = (0..inputs.len() * v)
            .map(|_| self.0.random_range(-3.0..3.0))
            .collect();
        Ok(Tensor::from_vec(data, (inputs.len(), v), &Device::Cpu)?)
    }
}

fn test_model() -> Model {
    tiny_model_cpu(TinyPreset::Test).unwrap().0
}

fn prompts(n: usize) -> Vec<Vec<u32>> {
    (0..n)
        .map(|i| {
            std::iter::once(1)
                .chain((0..(2 + (i * 7) % 30)).map(|j| ((i * 37 + j * 11) % 500 + 5) as u32))
                .collect()
        })
        .collect()
}

/// 32+ prompts, half with MTP (draft lengths 1..4, both schedules), half
/// without, all greedy (some with penalties), in mixed batches.
fn mixed_greedy_requests() -> Vec<Req> {
    prompts(36)
        .into_iter()
        .enumerate()
        .map(|(i, p)| {
            let sampling = if i % 3 == 0 {
                SamplingOptions {
                    repeat_penalty: 1.3,
                    repeat_last_n: 8,
                    ..Default::default()
                }
            } else {
                SamplingOptions::greedy()
            };
            let spec = match i % 4 {
                0 => Some(SpecOptions::off()),
                1 => Some(SpecOptions::constant(1)),
                2 => Some(SpecOptions {
                    initial_draft: 3,
                    max_draft: 6,
                    schedule: DraftSchedule::Adaptive,
                    enabled: true,
                }),
                _ => Some(SpecOptions::constant(4)),
            };
            Req {
                prompt: p,
                sampling,
                max_new: 10 + i % 9,
                spec,
            }
        })
        .collect()
}

#[test]
fn greedy_mtp_equals_plain_greedy_with_every_draft_kind() {
    let reqs = mixed_greedy_requests();
    let plain = run(&mut engine(test_model(), None, vec![]), &reqs, 16);
    let layers = TinyPreset::Test.config().num_layers;
    let heads: Vec<Box<dyn DraftHead>> = vec![
        Box::new(EarlyExitDraft { layers: 1 }),
        Box::new(EarlyExitDraft { layers }),
        Box::new(RandomDraft(
            rand_chacha::ChaCha8Rng::seed_from_u64(9),
            Default::default(),
        )),
        Box::new(MtpDraft {
            head: MtpHead::random(&test_model(), 5).unwrap(),
        }),
    ];
    for head in heads {
        let name = head.name();
        let got = run(&mut engine(test_model(), Some(head), vec![]), &reqs, 16);
        for (i, req) in reqs.iter().enumerate() {
            assert_eq!(got.ids(i), plain.ids(i), "{name}: request {i}");
            assert_eq!(got.finish[i], Some(SeqFinish::Length));
            // Constant schedules always draft; adaptive ones as the cost
            // model decides; speculation off never does.
            match req.spec {
                Some(s) if !s.enabled => assert_eq!(got.drafted[i], 0, "{name}: request {i}"),
                Some(s) if s.schedule == DraftSchedule::Constant => {
                    assert!(got.drafted[i] > 0, "{name}: request {i} drafts")
                }
                _ => {}
            }
        }
        let (d, a): (usize, usize) = (got.drafted.iter().sum(), got.accepted.iter().sum());
        eprintln!("{name}: acceptance {:.3} ({a}/{d})", a as f64 / d as f64);
        assert!(
            got.steps.len() <= plain.steps.len(),
            "{name}: speculation never adds steps"
        );
    }
}

#[test]
fn a_perfect_draft_is_always_accepted() {
    let layers = TinyPreset::Test.config().num_layers;
    let k = 3;
    let spec = SpecOptions::constant(k);
    // 1 token from the prefill step, then k + 1 per step: 1 + 4 * 5 = 21.
    let reqs = vec![Req {
        prompt: vec![1, 20, 21, 22],
        sampling: SamplingOptions::greedy(),
        max_new: 21,
        spec: Some(spec),
    }];
    let got = run(
        &mut engine(
            test_model(),
            Some(Box::new(EarlyExitDraft { layers })),
            vec![],
        ),
        &reqs,
        64,
    );
    assert_eq!(got.accepted[0], got.drafted[0], "acceptance 1.0");
    assert_eq!(got.drafted[0], 5 * k);
    assert_eq!(
        got.steps.len(),
        1 + 5,
        "one prefill step, then k + 1 tokens per step"
    );
    assert_eq!(got.tokens[0].len(), 21);
}

#[test]
fn eos_and_max_tokens_inside_an_accepted_run_stop_exactly() {
    let layers = TinyPreset::Test.config().num_layers;
    let spec = Some(SpecOptions::constant(6));
    let base = Req {
        prompt: vec![1, 30, 31],
        sampling: SamplingOptions::greedy(),
        max_new: 23,
        spec,
    };
    let free = run(
        &mut engine(test_model(), None, vec![]),
        std::slice::from_ref(&base),
        64,
    )
    .ids(0);
    // max_tokens falls inside a 7-token run.
    for max_new in [2, 5, 9, 12] {
        let req = Req {
            max_new,
            ..base.clone()
        };
        let got = run(
            &mut engine(
                test_model(),
                Some(Box::new(EarlyExitDraft { layers })),
                vec![],
            ),
            &[req],
            64,
        );
        assert_eq!(got.ids(0), free[..max_new].to_vec());
        assert_eq!(got.finish[0], Some(SeqFinish::Length));
    }
    // An EOS inside the run.
    let eos = free[10];
    let first = free.iter().position(|&t| t == eos).unwrap();
    let mut e = engine(
        test_model(),
        Some(Box::new(EarlyExitDraft { layers })),
        vec![eos],
    );
    let got = run(&mut e, std::slice::from_ref(&base), 64);
    assert_eq!(got.ids(0), free[..=first].to_vec());
    assert_eq!(got.finish[0], Some(SeqFinish::Eos));
    assert_eq!(e.kv_reserved_tokens(), 0, "the finished slot freed its KV");
}

/// A micro model with a 12-token vocabulary and flat-ish distributions.
fn micro_model() -> Model {
    let json = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 12, "hidden_size": 16, "intermediate_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64,
    });
    let cfg = ModelConfig::from_json(&json.to_string()).unwrap();
    // Random projections are small; make the second layer matter, so the
    // early-exit draft (layer 1 only) is a visibly different distribution.
    let Weights::Memory(mut map) = Weights::random(&cfg, 11, 0.35).unwrap() else {
        unreachable!()
    };
    for (name, t) in map.iter_mut() {
        if name.starts_with("model.layers.1.") && !name.ends_with("norm.weight") {
            *t = (&*t * 40.0).unwrap();
        }
    }
    Model::load(cfg, &Weights::Memory(map), &LoadOptions::default()).unwrap()
}

/// Histogram of the 2nd and 3rd generated tokens (the first speculative
/// step's output) over `n` seeded sequences.
fn second_third_tokens(
    spec: Option<SpecOptions>,
    unchecked: bool,
    n: usize,
    first_seed: u64,
) -> Vec<u64> {
    let sampling = |seed| SamplingOptions {
        temperature: 1.0,
        top_k: 8,
        seed: Some(seed),
        ..Default::default()
    };
    let mut counts = vec![0u64; 12 * 12];
    let mut seed = first_seed;
    while seed < first_seed + n as u64 {
        let batch: Vec<Req> = (0..500)
            .map(|i| Req {
                prompt: vec![1, 3],
                sampling: sampling(seed + i),
                max_new: 3,
                spec,
            })
            .collect();
        seed += batch.len() as u64;
        let head: Box<dyn DraftHead> = Box::new(EarlyExitDraft { layers: 1 });
        // The deliberately wrong rule exists in debug builds only.
        #[cfg(debug_assertions)]
        let config = SpecConfig {
            unchecked_accept: unchecked,
            ..Default::default()
        };
        #[cfg(not(debug_assertions))]
        let config = {
            assert!(!unchecked, "accept-all is a debug-build switch");
            SpecConfig::default()
        };
        let mut e = Engine::new(
            micro_model(),
            EngineConfig {
                kv_capacity_tokens: 1 << 16,
                model_name: "m".into(),
                eos_ids: vec![],
                ..Default::default()
            },
        )
        .with_draft(head, config);
        let got = run(&mut e, &batch, 8);
        for i in 0..batch.len() {
            let ids = got.ids(i);
            counts[ids[1] as usize * 12 + ids[2] as usize] += 1;
        }
    }
    counts
}

/// Pearson chi-square of two histograms (cells with expected count < 5 pooled).
fn chi_square_two_sample(a: &[u64], b: &[u64]) -> (f64, usize) {
    let (na, nb) = (a.iter().sum::<u64>() as f64, b.iter().sum::<u64>() as f64);
    let (mut chi, mut dof, mut pool_a, mut pool_b) = (0.0, 0usize, 0.0, 0.0);
    let mut cell = |x: f64, y: f64| {
        let total = x + y;
        let (ea, eb) = (total * na / (na + nb), total * nb / (na + nb));
        chi += (x - ea).powi(2) / ea + (y - eb).powi(2) / eb;
        dof += 1;
    };
    for (&x, &y) in a.iter().zip(b) {
        if x + y < 10 {
            pool_a += x as f64;
            pool_b += y as f64;
        } else {
            cell(x as f64, y as f64);
        }
    }
    if pool_a + pool_b > 0.0 {
        cell(pool_a, pool_b);
    }
    (chi, dof.saturating_sub(1))
}

/// Upper 0.1 % point of chi-square with `dof` degrees of freedom
/// (Wilson–Hilferty).
fn chi_square_critical(dof: usize) -> f64 {
    let k = dof as f64;
    let z = 3.09;
    k * (1.0 - 2.0 / (9.0 * k) + z * (2.0 / (9.0 * k)).sqrt()).powi(3)
}

#[test]
fn sampled_mtp_preserves_the_target_distribution() {
    let n = 20_000;
    let spec = Some(SpecOptions::constant(2));
    // Independent seeds per run: shared seeds would correlate the samples.
    let off = second_third_tokens(Some(SpecOptions::off()), false, n, 0);
    let on = second_third_tokens(spec, false, n, 1_000_000);
    let (chi, dof) = chi_square_two_sample(&off, &on);
    let crit = chi_square_critical(dof);
    eprintln!("MTP on vs off: chi2 {chi:.1} on {dof} dof (critical {crit:.1})");
    assert!(
        chi < crit,
        "MTP changed the distribution: chi2 {chi:.1} > {crit:.1}"
    );
    // The same test rejects a wrong rule (accept every draft; debug
    // builds carry it).
    if !cfg!(debug_assertions) {
        return;
    }
    let wrong = second_third_tokens(spec, true, n, 2_000_000);
    let (chi, dof) = chi_square_two_sample(&off, &wrong);
    eprintln!("accept-all vs off: chi2 {chi:.1} on {dof} dof");
    assert!(
        chi > chi_square_critical(dof),
        "the test must detect a wrong acceptance rule"
    );
}

#[test]
fn stories260k_early_exit_reproduces_the_reference() {
    let Some(stories) = stories260k() else {
        return;
    };
    let dir = &stories.dir;
    let spec = Some(SpecOptions {
        initial_draft: 2,
        max_draft: 6,
        schedule: DraftSchedule::Adaptive,
        enabled: true,
    });
    let reqs: Vec<Req> = stories
        .prompts
        .iter()
        .map(|p| Req {
            prompt: p.clone(),
            sampling: SamplingOptions::greedy(),
            max_new: 64,
            spec,
        })
        .collect();
    for layers in [3, 4] {
        let model = Model::from_dir(dir, &LoadOptions::default()).unwrap();
        let got = run(
            &mut engine(model, Some(Box::new(EarlyExitDraft { layers })), vec![]),
            &reqs,
            512,
        );
        for (i, want) in stories.generated.iter().enumerate() {
            assert_eq!(&got.ids(i), want, "early-exit {layers}: prompt {i}");
        }
        let (d, a): (usize, usize) = (got.drafted.iter().sum(), got.accepted.iter().sum());
        eprintln!("stories260k early-exit after layer {layers} of 5: acceptance {:.3} ({a}/{d}), {} steps", a as f64 / d as f64, got.steps.len());
        assert!(d > 0);
    }
}

/// An engine whose drafters are `head` and/or prompt lookup.
fn engine_with_lookup(model: Model, head: Option<Box<dyn DraftHead>>) -> Engine {
    Engine::new(
        model,
        EngineConfig {
            kv_capacity_tokens: 1 << 16,
            model_name: "t".into(),
            eos_ids: vec![],
            ..Default::default()
        },
    )
    .with_drafters(
        head,
        SpecConfig {
            prompt_lookup: Some(PromptLookup::default()),
            ..Default::default()
        },
    )
}

#[test]
fn prompt_lookup_alone_and_beside_a_head_reproduces_stories260k() {
    let Some(stories) = stories260k() else {
        return;
    };
    let load = || Model::from_dir(&stories.dir, &LoadOptions::default()).unwrap();
    let greedy: Vec<Req> = stories
        .prompts
        .iter()
        .enumerate()
        .map(|(i, p)| Req {
            prompt: p.clone(),
            sampling: SamplingOptions::greedy(),
            max_new: 64,
            spec: Some(if i % 2 == 0 {
                SpecOptions::constant(4)
            } else {
                SpecOptions::default()
            }),
        })
        .collect();
    let seeded: Vec<Req> = greedy
        .iter()
        .enumerate()
        .map(|(i, r)| Req {
            sampling: SamplingOptions {
                temperature: 0.7,
                seed: Some(40 + i as u64),
                ..Default::default()
            },
            ..r.clone()
        })
        .collect();
    let no_spec = |reqs: &[Req]| -> Vec<Req> {
        reqs.iter()
            .map(|r| Req {
                spec: None,
                ..r.clone()
            })
            .collect()
    };
    let seeded_off = run(&mut engine(load(), None, vec![]), &no_spec(&seeded), 512);
    type MakeHead = fn() -> Box<dyn DraftHead>;
    let heads: [Option<MakeHead>; 2] = [None, Some(|| Box::new(EarlyExitDraft { layers: 3 }))];
    for head in heads {
        let both = head.is_some();
        let all: Vec<Req> = greedy.iter().chain(&seeded).cloned().collect();
        let got = run(
            &mut engine_with_lookup(load(), head.map(|h| h())),
            &all,
            512,
        );
        for (i, want) in stories.generated.iter().enumerate() {
            assert_eq!(&got.ids(i), want, "lookup (head {both}): greedy prompt {i}");
            let j = i + greedy.len();
            assert_eq!(
                got.ids(j),
                seeded_off.ids(i),
                "lookup (head {both}): seeded prompt {i}"
            );
        }
        let (d, a): (usize, usize) = (got.drafted.iter().sum(), got.accepted.iter().sum());
        eprintln!(
            "stories260k, prompt lookup (head {both}): acceptance {:.3} ({a}/{d}), {} steps",
            a as f64 / d as f64,
            got.steps.len()
        );
        assert!(
            a > 0,
            "stories repeat themselves: some lookup drafts are accepted"
        );
    }
}

#[test]
fn seeded_sampled_requests_emit_the_same_tokens_with_speculation_on_or_off() {
    let sampled = |seed| SamplingOptions {
        temperature: 0.9,
        top_p: 0.95,
        repeat_penalty: 1.1,
        repeat_last_n: 8,
        seed: Some(seed),
        ..Default::default()
    };
    let target = |spec| Req {
        prompt: vec![1, 50, 51, 52],
        sampling: sampled(77),
        max_new: 30,
        spec,
    };
    let off = run(&mut engine(test_model(), None, vec![]), &[target(None)], 64);
    // Others in the batch: sampled with their own seeds, drafting adaptively.
    let others = |n: usize| -> Vec<Req> {
        prompts(n)
            .into_iter()
            .enumerate()
            .map(|(i, p)| Req {
                prompt: p,
                sampling: sampled(1000 + i as u64),
                max_new: 30,
                spec: Some(SpecOptions::default()),
            })
            .collect()
    };
    // Every drafter: two heads, prompt lookup alone, and lookup beside a head.
    type MakeEngine = fn() -> Engine;
    let drafters: [(&str, MakeEngine, bool); 4] = [
        (
            "early-exit:1",
            || {
                engine(
                    test_model(),
                    Some(Box::new(EarlyExitDraft { layers: 1 })),
                    vec![],
                )
            },
            true,
        ),
        (
            "early-exit:2",
            || {
                engine(
                    test_model(),
                    Some(Box::new(EarlyExitDraft { layers: 2 })),
                    vec![],
                )
            },
            true,
        ),
        ("lookup", || engine_with_lookup(test_model(), None), false),
        (
            "lookup + early-exit:1",
            || engine_with_lookup(test_model(), Some(Box::new(EarlyExitDraft { layers: 1 }))),
            true,
        ),
    ];
    for (name, new_engine, always_drafts) in drafters {
        for k in 1..=8 {
            let alone = run(
                &mut new_engine(),
                &[target(Some(SpecOptions::constant(k)))],
                64,
            );
            assert_eq!(alone.ids(0), off.ids(0), "{name}, draft length {k}, alone");
            assert!(alone.drafted[0] > 0 || !always_drafts, "{name}");
        }
        for n in [16, 64] {
            let mut batch = others(n - 1);
            batch.insert(n / 3, target(Some(SpecOptions::constant(1 + n % 7))));
            let shared = run(&mut new_engine(), &batch, 64);
            assert_eq!(shared.ids(n / 3), off.ids(0), "{name}, batch of {n}");
            assert!(shared.drafted[n / 3] > 0 || !always_drafts, "{name}");
        }
    }
}

#[test]
fn drafting_backs_off_when_it_does_not_pay() {
    let spec = Some(SpecOptions {
        initial_draft: 2,
        ..SpecOptions::default()
    });
    let req = Req {
        prompt: vec![1, 60, 61],
        sampling: SamplingOptions::greedy(),
        max_new: 200,
        spec,
    };
    // As slow as the target's first layer would be: a real head's cost.
    let head = Box::new(RandomDraft(
        rand_chacha::ChaCha8Rng::seed_from_u64(1),
        std::time::Duration::from_micros(300),
    ));
    let got = run(
        &mut engine(test_model(), Some(head), vec![]),
        std::slice::from_ref(&req),
        64,
    );
    let speculative_steps = got.steps.iter().filter(|s| s.drafted > 0).count();
    eprintln!(
        "random draft: {speculative_steps} speculative steps of {}",
        got.steps.len()
    );
    // Whether it probes again depends on the measured costs (a probe is
    // only worth it if a good draft would pay at this step's speed): the
    // probe clock is the policy's unit tests' business.
    assert!(speculative_steps >= 1, "it tried");
    assert!(
        speculative_steps * 8 < got.steps.len(),
        "a useless draft is off most of the time"
    );
}

#[test]
fn requests_with_logprobs_draft_and_report_the_logprobs_of_speculation_off() {
    let layers = TinyPreset::Test.config().num_layers;
    let with_lp = |sampling| SamplingOptions {
        logprobs: true,
        top_logprobs: 3,
        ..sampling
    };
    let penalised = SamplingOptions {
        repeat_penalty: 1.3,
        repeat_last_n: 8,
        ..SamplingOptions::greedy()
    };
    let reqs: Vec<Req> = [SamplingOptions::greedy(), penalised]
        .into_iter()
        .flat_map(|s| [with_lp(s), s])
        .enumerate()
        .map(|(i, sampling)| Req {
            prompt: vec![1, 30 + i as u32, 31],
            sampling,
            max_new: 12,
            spec: Some(SpecOptions::constant(3)),
        })
        .collect();
    let plain = run(&mut engine(test_model(), None, vec![]), &reqs, 8);
    let heads: [Box<dyn DraftHead>; 2] = [
        Box::new(EarlyExitDraft { layers }),
        Box::new(EarlyExitDraft { layers: 1 }),
    ];
    for head in heads {
        let name = head.name();
        let got = run(&mut engine(test_model(), Some(head), vec![]), &reqs, 8);
        for (i, req) in reqs.iter().enumerate() {
            assert!(got.drafted[i] > 0, "{name}: request {i} drafts");
            assert_eq!(got.ids(i), plain.ids(i), "{name}: request {i}");
            for (n, (a, b)) in got.tokens[i].iter().zip(&plain.tokens[i]).enumerate() {
                if !req.sampling.logprobs {
                    assert_eq!(a.logprob, None);
                    continue;
                }
                let (la, lb) = (a.logprob.unwrap(), b.logprob.unwrap());
                assert!(
                    (la - lb).abs() <= 1e-5,
                    "{name}: request {i} token {n}: {la} vs {lb}"
                );
                assert_eq!(a.top_logprobs.len(), 3);
                for ((ta, va), (tb, vb)) in a.top_logprobs.iter().zip(&b.top_logprobs) {
                    assert_eq!(ta, tb, "{name}: request {i} token {n}");
                    assert!((va - vb).abs() <= 1e-5);
                }
            }
        }
    }
}
