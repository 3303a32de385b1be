//! Speculation under a grammar (issue #19): a constrained sequence drafts,
//! drafts the grammar forbids end the run, verification applies the mask
//! at every position, and greedy output with MTP on equals MTP off.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{Device, Tensor};
use tandem::engine::*;
use tandem::kv::KvCache;
use tandem::model::{Model, ModelError};
use tandem::sampler::SamplingOptions;
use tandem::structured::{Grammar, GrammarSpec};
use tandem::tiny::{tiny_model_cpu, TinyPreset};

fn schema() -> serde_json::Value {
    serde_json::json!({"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["x", "yy", "zzz"]}, "maxItems": 5},
        "ok": {"type": "boolean"},
    }, "required": ["a", "tags", "ok"], "additionalProperties": false})
}

struct Out {
    ids: Vec<Vec<u32>>,
    finish: Vec<Option<SeqFinish>>,
    drafted: usize,
    accepted: usize,
}

/// A drafter that proposes a known continuation (each slot's greedy
/// output), except at every fifth position, where it proposes a word the
/// grammar forbids there: drafts are accepted, and runs are cut.
struct Scripted {
    script: HashMap<SlotId, Vec<u32>>,
    prompt_len: usize,
    forbidden: u32,
}

impl DraftHead for Scripted {
    fn name(&self) -> String {
        "scripted".into()
    }
    fn draft(
        &mut self,
        model: &Model,
        _kv: &mut KvCache,
        inputs: &[DraftInput],
    ) -> Result<Tensor, ModelError> {
        let v = model.config().vocab_size;
        let mut data = vec![0.0f32; inputs.len() * v];
        for (row, input) in inputs.iter().enumerate() {
            let index = input.position + 1 - self.prompt_len;
            let token = match self.script[&input.slot].get(index) {
                Some(_) if index % 5 == 4 => self.forbidden,
                Some(&t) => t,
                None => self.forbidden,
            };
            data[row * v + token as usize] = 50.0;
        }
        Ok(Tensor::from_vec(data, (inputs.len(), v), &Device::Cpu)?)
    }
}

/// Which drafter a run uses.
enum Drafter {
    None,
    EarlyExit(usize),
    Scripted(Vec<Vec<u32>>),
}

/// Runs one constrained sequence per prompt to the end.
fn run(drafter: Drafter, sampling: SamplingOptions, prompts: &[Vec<u32>]) -> Out {
    let (model, tokenizer) = tiny_model_cpu(TinyPreset::Test).unwrap();
    let mut engine = Engine::new(
        model,
        EngineConfig {
            kv_capacity_tokens: 1 << 16,
            eos_ids: tokenizer.eos_ids().to_vec(),
            ..Default::default()
        },
    );
    let drafts = !matches!(drafter, Drafter::None);
    let head: Option<Box<dyn DraftHead>> = match drafter {
        Drafter::None => None,
        Drafter::EarlyExit(layers) => Some(Box::new(EarlyExitDraft { layers })),
        Drafter::Scripted(script) => Some(Box::new(Scripted {
            script: script
                .into_iter()
                .enumerate()
                .map(|(i, s)| (i as u32, s))
                .collect(),
            prompt_len: prompts[0].len(),
            forbidden: tandem::tokenizer::word_vocab::FIXED_TOKENS as u32 + 7,
        })),
    };
    if let Some(head) = head {
        engine = engine.with_draft(head, SpecConfig::default());
    }
    let compiler = tokenizer.grammar_compiler().unwrap();
    let grammar = || -> Grammar {
        compiler
            .compile(&GrammarSpec::JsonSchema { schema: schema() })
            .unwrap()
    };
    let n = prompts.len();
    let mut plan = StepPlan::default();
    for (i, prompt) in prompts.iter().enumerate() {
        let slot = i as u32;
        plan.admit.push(Admission {
            slot,
            prompt: Arc::from(prompt.clone()),
            sampling,
            max_new_tokens: 200,
            kv: KvGrant::Reserve(prompt.len() + 200 + MAX_DRAFT_TOKENS),
            spec: drafts.then(|| SpecOptions::constant(4)),
            constraints: SeqConstraints {
                grammar: Some(grammar()),
                ..SeqConstraints::default()
            },
        });
        plan.work.push(SeqWork::Prefill {
            slot,
            start: 0,
            len: prompt.len(),
        });
    }
    let mut out = Out {
        ids: vec![Vec::new(); n],
        finish: vec![None; n],
        drafted: 0,
        accepted: 0,
    };
    for step in 1.. {
        let outcome = engine.execute(std::mem::take(&mut plan));
        for s in outcome.seqs {
            let i = s.slot as usize;
            let p = s.result.unwrap_or_else(|e| panic!("sequence {i}: {e}"));
            out.ids[i].extend(p.tokens.iter().map(|t| t.id));
            out.drafted += p.drafted;
            out.accepted += p.accepted;
            if p.finish.is_some() {
                out.finish[i] = p.finish;
            }
        }
        plan.step = step;
        plan.work = (0..n)
            .filter(|&i| out.finish[i].is_none())
            .map(|i| SeqWork::Decode {
                slot: i as u32,
                max_drafts: 4,
            })
            .collect();
        if plan.work.is_empty() {
            break;
        }
    }
    out
}

fn prompts() -> Vec<Vec<u32>> {
    (0..4u32)
        .map(|i| vec![1, 120 + i, 130 + 2 * i, 150])
        .collect()
}

fn text(ids: &[u32]) -> String {
    let (_, tokenizer) = tiny_model_cpu(TinyPreset::Test).unwrap();
    let mut all = vec![150u32];
    all.extend_from_slice(ids);
    let full = tokenizer.decode(&all).unwrap();
    let head = tokenizer.decode(&[150]).unwrap();
    full[head.len()..].to_string()
}

#[test]
fn greedy_under_a_grammar_is_the_same_with_mtp_on_and_off() {
    let greedy = SamplingOptions::greedy();
    let off = run(Drafter::None, greedy, &prompts());
    let total: usize = off.ids.iter().map(Vec::len).sum();
    // A drafter that mostly knows the answer: drafts accepted, runs cut
    // where it proposes what the grammar forbids.
    let scripted = run(Drafter::Scripted(off.ids.clone()), greedy, &prompts());
    assert_eq!(scripted.ids, off.ids);
    assert_eq!(scripted.finish, off.finish);
    assert!(
        scripted.accepted > total / 3,
        "{} of {total} accepted",
        scripted.accepted
    );
    assert!(
        scripted.drafted < 4 * total,
        "forbidden drafts end their runs"
    );
    // The model's own early exit: whatever it drafts, the same output.
    for layers in [1, 2] {
        let on = run(Drafter::EarlyExit(layers), greedy, &prompts());
        assert_eq!(on.ids, off.ids, "early exit after {layers} layer(s)");
        assert_eq!(on.finish, off.finish);
    }
    for (i, ids) in off.ids.iter().enumerate() {
        if off.finish[i] == Some(SeqFinish::Eos) {
            let t = text(ids);
            let doc: serde_json::Value =
                serde_json::from_str(&t).unwrap_or_else(|e| panic!("{e}: {t}"));
            assert!(doc["a"].is_u64() && doc["ok"].is_boolean(), "{doc}");
        }
    }
}

#[test]
fn sampled_drafts_under_a_grammar_stay_inside_it() {
    let sampled = SamplingOptions {
        temperature: 1.0,
        seed: Some(5),
        repeat_last_n: 0,
        ..SamplingOptions::default()
    };
    let greedy_ids = run(Drafter::None, SamplingOptions::greedy(), &prompts()).ids;
    let on = run(Drafter::Scripted(greedy_ids), sampled, &prompts());
    assert!(on.drafted > 0);
    for (i, ids) in on.ids.iter().enumerate() {
        let t = text(ids);
        match on.finish[i] {
            Some(SeqFinish::Eos) => {
                let doc: serde_json::Value =
                    serde_json::from_str(&t).unwrap_or_else(|e| panic!("{e}: {t}"));
                assert!(doc.is_object(), "{doc}");
            }
            other => assert_eq!(other, Some(SeqFinish::Length), "{t}"),
        }
    }
}
