//! Drives a real [`Engine`] with hand-built plans, the way the scheduler
//! would: everything admitted at once, prompts prefilled in chunks, then
//! one decode per live sequence per step.

use std::sync::Arc;

use tandem::engine::*;
use tandem::sampler::SamplingOptions;

/// One sequence to run.
#[derive(Debug, Clone)]
pub struct Req {
    pub prompt: Vec<u32>,
    pub sampling: SamplingOptions,
    pub max_new: usize,
    pub spec: Option<SpecOptions>,
}

impl Req {
    pub fn new(prompt: Vec<u32>, sampling: SamplingOptions, max_new: usize) -> Self {
        Self {
            prompt,
            sampling,
            max_new,
            spec: None,
        }
    }

    /// Its admission into `slot`, room reserved for its whole run.
    pub fn admission(&self, slot: u32) -> Admission {
        Admission {
            slot,
            prompt: Arc::from(self.prompt.clone()),
            sampling: self.sampling,
            max_new_tokens: self.max_new,
            kv: KvGrant::Reserve(self.prompt.len() + self.max_new),
            spec: self.spec,
            constraints: Default::default(),
        }
    }
}

/// What a run produced, per request, plus the engine's per-step stats.
pub struct RunResult {
    pub tokens: Vec<Vec<GeneratedToken>>,
    pub drafted: Vec<usize>,
    pub accepted: Vec<usize>,
    pub finish: Vec<Option<SeqFinish>>,
    pub steps: Vec<StepStats>,
}

impl RunResult {
    pub fn ids(&self, i: usize) -> Vec<u32> {
        self.tokens[i].iter().map(|t| t.id).collect()
    }
}

/// Runs `reqs` to completion (prefill chunks of `chunk` tokens).
pub fn run(engine: &mut Engine, reqs: &[Req], chunk: usize) -> RunResult {
    let n = reqs.len();
    let mut res = RunResult {
        tokens: vec![Vec::new(); n],
        drafted: vec![0; n],
        accepted: vec![0; n],
        finish: vec![None; n],
        steps: Vec::new(),
    };
    let mut prefilled = vec![0usize; n];
    let mut live = vec![true; n];
    let mut plan = StepPlan::default();
    for (i, r) in reqs.iter().enumerate() {
        plan.admit.push(r.admission(i as u32 + 100));
    }
    for step in 0.. {
        plan.step = step;
        for (i, r) in reqs.iter().enumerate() {
            if !live[i] {
                continue;
            }
            let slot = i as u32 + 100;
            if prefilled[i] < r.prompt.len() {
                let len = chunk.min(r.prompt.len() - prefilled[i]);
                plan.work.push(SeqWork::Prefill {
                    slot,
                    start: prefilled[i],
                    len,
                });
                prefilled[i] += len;
            } else {
                plan.work.push(SeqWork::Decode {
                    slot,
                    max_drafts: MAX_DRAFT_TOKENS,
                });
            }
        }
        if plan.work.is_empty() {
            break;
        }
        let outcome = engine.execute(std::mem::take(&mut plan));
        res.steps.push(outcome.stats.clone());
        for s in outcome.seqs {
            let i = (s.slot - 100) as usize;
            let p = s
                .result
                .unwrap_or_else(|e| panic!("engine error for request {i}: {e}"));
            res.tokens[i].extend(p.tokens);
            res.drafted[i] += p.drafted;
            res.accepted[i] += p.accepted;
            if p.finish.is_some() {
                live[i] = false;
                res.finish[i] = p.finish;
            }
        }
    }
    res
}

/// [`run`], keeping only the tokens.
pub fn run_tokens(engine: &mut Engine, reqs: &[Req], chunk: usize) -> Vec<Vec<GeneratedToken>> {
    run(engine, reqs, chunk).tokens
}

/// Runs `reqs` through `engine`, request `i` admitted at step `joins[i]`
/// (so the batch grows as requests join and shrinks as they finish: the
/// decode passes change size from step to step); prompts prefilled whole.
pub fn run_staggered(engine: &mut Engine, reqs: &[Req], joins: &[usize]) -> Vec<Vec<u32>> {
    let n = reqs.len();
    let mut out = vec![Vec::new(); n];
    let mut state = vec![0u8; n]; // 0 waiting, 1 prefilling, 2 decoding, 3 done
    for step in 0.. {
        let mut plan = StepPlan {
            step,
            ..Default::default()
        };
        for (i, r) in reqs.iter().enumerate() {
            let slot = i as u32 + 100;
            if state[i] == 0 && joins[i] as u64 <= step {
                plan.admit.push(r.admission(slot));
                plan.work.push(SeqWork::Prefill {
                    slot,
                    start: 0,
                    len: r.prompt.len(),
                });
                state[i] = 1;
            } else if state[i] == 1 || state[i] == 2 {
                state[i] = 2;
                plan.work.push(SeqWork::Decode {
                    slot,
                    max_drafts: MAX_DRAFT_TOKENS,
                });
            }
        }
        if state.iter().all(|&s| s == 3) {
            break;
        }
        let outcome = engine.execute(plan);
        for s in outcome.seqs {
            let i = (s.slot - 100) as usize;
            let p = s.result.unwrap_or_else(|e| panic!("request {i}: {e}"));
            out[i].extend(p.tokens.iter().map(|t| t.id));
            if p.finish.is_some() {
                state[i] = 3;
            }
        }
    }
    out
}
