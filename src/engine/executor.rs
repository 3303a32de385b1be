//! [`Engine`]: the real [`StepExecutor`]. It owns the model, the KV cache,
//! the sampler and each slot's progress, and turns one [`StepPlan`] into one
//! ragged forward pass plus one sampler call.
//!
//! # Invariants
//! - A slot is registered in `slots`, the KV cache and the sampler at once
//!   (admission) and leaves all three at once ([`Engine::drop_slot`]).
//! - `SlotState::prefilled` equals the KV length until the prompt is done;
//!   afterwards the KV holds `prompt + generated - 1` positions (the last
//!   sampled token is fed by the next decode).
//! - One bad sequence (invalid work, KV over its reservation) is failed and
//!   dropped before the forward pass; the others still run. Only a failure
//!   of the pass itself fails every sequence in it.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use super::protocol::*;
use super::EngineError;
use crate::kv::KvCache;
use crate::model::{Batch, Model, OutputRows};
use crate::sampler::{SamplePath, Sampler, SamplingOptions};

/// Engine settings.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// KV pool size in tokens, over all slots.
    pub kv_capacity_tokens: usize,
    /// Name reported to clients.
    pub model_name: String,
    /// Extra end-of-sequence ids (the tokenizer's), merged with the model's.
    pub eos_ids: Vec<u32>,
}

struct SlotState {
    prompt: Arc<[u32]>,
    prefilled: usize,
    last_token: Option<u32>,
    generated: usize,
    max_new_tokens: usize,
    sampling: SamplingOptions,
}

/// The engine thread's state. Build it, then hand it to
/// [`EngineThread::spawn`](super::EngineThread::spawn).
pub struct Engine {
    model: Model,
    kv: KvCache,
    sampler: Sampler,
    slots: HashMap<SlotId, SlotState>,
    info: EngineInfo,
}

/// A sequence that takes part in this step's forward pass.
struct Planned {
    slot: SlotId,
    tokens_fed: usize,
    samples: bool,
}

impl Engine {
    pub fn new(model: Model, config: EngineConfig) -> Self {
        let cfg = model.config();
        let mut eos_ids = cfg.eos_token_ids.clone();
        for id in config.eos_ids {
            if !eos_ids.contains(&id) {
                eos_ids.push(id);
            }
        }
        let info = EngineInfo {
            model_name: config.model_name,
            context_len: cfg.max_position_embeddings,
            vocab_size: cfg.vocab_size,
            eos_ids,
            kv_capacity_tokens: config.kv_capacity_tokens,
        };
        let kv = KvCache::new(
            model.kv_layout(),
            model.device().clone(),
            config.kv_capacity_tokens,
        );
        let sampler = Sampler::new(info.context_len);
        Self {
            model,
            kv,
            sampler,
            slots: HashMap::new(),
            info,
        }
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    /// KV tokens currently reserved (for tests and stats).
    pub fn kv_reserved_tokens(&self) -> usize {
        self.kv.reserved_tokens()
    }

    fn drop_slot(&mut self, slot: SlotId) {
        self.slots.remove(&slot);
        self.kv.free(slot);
        self.sampler.remove(slot);
    }

    fn admit(&mut self, a: Admission) -> Result<(), EngineError> {
        if self.slots.contains_key(&a.slot) {
            return Err(EngineError::DuplicateSlot(a.slot));
        }
        if a.prompt.is_empty() || a.max_new_tokens == 0 {
            return Err(EngineError::InvalidWork {
                slot: a.slot,
                reason: "empty prompt or max_new_tokens 0".into(),
            });
        }
        self.kv
            .allocate(a.slot, a.kv_reserve)
            .map_err(|e| match e {
                crate::kv::KvError::Exhausted {
                    requested,
                    available,
                    ..
                } => EngineError::KvExhausted {
                    requested,
                    available,
                },
                other => EngineError::Model(other.to_string()),
            })?;
        if let Err(e) = self.sampler.add(a.slot, a.sampling, &a.prompt) {
            self.kv.free(a.slot);
            return Err(e.into());
        }
        self.slots.insert(
            a.slot,
            SlotState {
                prompt: a.prompt,
                prefilled: 0,
                last_token: None,
                generated: 0,
                max_new_tokens: a.max_new_tokens,
                sampling: a.sampling,
            },
        );
        Ok(())
    }

    /// Checks one work item and adds its tokens to the batch.
    fn plan_one(&mut self, work: SeqWork, batch: &mut Batch) -> Result<Planned, EngineError> {
        let slot = work.slot();
        let state = self
            .slots
            .get(&slot)
            .ok_or(EngineError::UnknownSlot(slot))?;
        let invalid = |reason: String| EngineError::InvalidWork { slot, reason };
        let (tokens, samples): (Vec<u32>, bool) = match work {
            SeqWork::Prefill { start, len, .. } => {
                if start != state.prefilled || len == 0 || start + len > state.prompt.len() {
                    return Err(invalid(format!(
                        "prefill {start}..{} but {} of {} prompt tokens are done",
                        start + len,
                        state.prefilled,
                        state.prompt.len()
                    )));
                }
                (
                    state.prompt[start..start + len].to_vec(),
                    start + len == state.prompt.len(),
                )
            }
            SeqWork::Decode { .. } => match state.last_token {
                Some(t) if state.prefilled == state.prompt.len() => (vec![t], true),
                _ => return Err(invalid("decode before the prompt is prefilled".into())),
            },
        };
        let offset = self
            .kv
            .len(slot)
            .map_err(|e| EngineError::Model(e.to_string()))?;
        if offset + tokens.len() > self.info.context_len {
            return Err(invalid(format!(
                "position {} beyond the context of {}",
                offset + tokens.len(),
                self.info.context_len
            )));
        }
        self.kv
            .ensure_room(slot, tokens.len())
            .map_err(|e| match e {
                crate::kv::KvError::OverReservation {
                    reserved, needed, ..
                } => EngineError::KvOverReservation {
                    slot,
                    reserved,
                    needed,
                },
                other => EngineError::Model(other.to_string()),
            })?;
        batch.push(
            slot,
            offset,
            &tokens,
            if samples {
                OutputRows::Last
            } else {
                OutputRows::None
            },
        );
        Ok(Planned {
            slot,
            tokens_fed: tokens.len(),
            samples,
        })
    }

    /// Runs the forward pass and the sampler over the planned sequences.
    fn run_batch(
        &mut self,
        batch: &Batch,
        planned: &[Planned],
        stats: &mut StepStats,
    ) -> Result<Vec<(SlotId, SeqProgress)>, EngineError> {
        let t0 = Instant::now();
        let sampling_slots: Vec<SlotId> = planned
            .iter()
            .filter(|p| p.samples)
            .map(|p| p.slot)
            .collect();
        let model_err = |e: crate::model::ModelError| EngineError::Model(e.to_string());
        let hidden = self.model.forward(batch, &mut self.kv).map_err(model_err)?;
        let logits = if sampling_slots.is_empty() {
            None
        } else {
            Some(self.model.unembed(&hidden).map_err(model_err)?)
        };
        stats.forward = t0.elapsed();

        let t1 = Instant::now();
        let sampled = match &logits {
            Some(logits) => {
                let res = self.sampler.sample(&sampling_slots, logits)?;
                match res.path {
                    SamplePath::Uniform => stats.uniform_calls += 1,
                    SamplePath::Serial => stats.serial_calls += 1,
                }
                Some(res)
            }
            None => None,
        };
        stats.sample = t1.elapsed();

        let mut out = Vec::with_capacity(planned.len());
        let mut row = 0;
        for p in planned {
            let state = self
                .slots
                .get_mut(&p.slot)
                .ok_or(EngineError::UnknownSlot(p.slot))?;
            let mut progress = SeqProgress::default();
            if state.prefilled < state.prompt.len() {
                state.prefilled += p.tokens_fed;
                progress.prefilled = p.tokens_fed;
            }
            if p.samples {
                let res = sampled
                    .as_ref()
                    .expect("sampled when any slot samples; this is a bug");
                let id = res.tokens[row];
                let (logprob, top_logprobs) = res.for_row(row, &state.sampling);
                row += 1;
                state.last_token = Some(id);
                state.generated += 1;
                progress.tokens.push(GeneratedToken {
                    id,
                    logprob,
                    top_logprobs,
                });
                let kv_len = state.prompt.len() + state.generated - 1;
                progress.finish = if self.info.eos_ids.contains(&id) {
                    Some(SeqFinish::Eos)
                } else if state.generated >= state.max_new_tokens {
                    Some(SeqFinish::Length)
                } else if kv_len + 1 >= self.info.context_len {
                    Some(SeqFinish::ContextFull)
                } else {
                    None
                };
            }
            out.push((p.slot, progress));
        }
        Ok(out)
    }
}

impl StepExecutor for Engine {
    fn info(&self) -> EngineInfo {
        self.info.clone()
    }

    fn execute(&mut self, plan: StepPlan) -> StepOutcome {
        let start = Instant::now();
        let mut outcome = StepOutcome {
            step: plan.step,
            ..Default::default()
        };
        for slot in plan.release {
            self.drop_slot(slot);
        }
        for a in plan.admit {
            let slot = a.slot;
            if let Err(error) = self.admit(a) {
                outcome.seqs.push(SeqOutcome {
                    slot,
                    result: Err(error),
                });
            }
        }

        let mut batch = Batch::default();
        let mut planned = Vec::with_capacity(plan.work.len());
        for work in plan.work {
            match self.plan_one(work, &mut batch) {
                Ok(p) => planned.push(p),
                Err(error) => {
                    let slot = work.slot();
                    if !matches!(error, EngineError::UnknownSlot(_)) {
                        self.drop_slot(slot);
                    }
                    outcome.seqs.push(SeqOutcome {
                        slot,
                        result: Err(error),
                    });
                }
            }
        }
        if !planned.is_empty() {
            outcome.stats.batch_seqs = planned.len();
            outcome.stats.batch_tokens = batch.tokens.len();
            match self.run_batch(&batch, &planned, &mut outcome.stats) {
                Ok(results) => {
                    for (slot, progress) in results {
                        if progress.finish.is_some() {
                            self.drop_slot(slot);
                        }
                        outcome.seqs.push(SeqOutcome {
                            slot,
                            result: Ok(progress),
                        });
                    }
                }
                Err(error) => {
                    tracing::warn!(%error, "step failed; failing every sequence in it");
                    for p in &planned {
                        self.drop_slot(p.slot);
                        outcome.seqs.push(SeqOutcome {
                            slot: p.slot,
                            result: Err(error.clone()),
                        });
                    }
                }
            }
        }
        outcome.stats.total = start.elapsed();
        outcome
    }
}
