//! [`Engine`]: the real [`StepExecutor`]. It owns the model, the KV cache,
//! the sampler, the draft head and each slot's progress, and turns one
//! [`StepPlan`] into (optional) batched draft rounds, one ragged forward
//! pass, one sampler call and the verification of every sequence's drafts.
//!
//! # Invariants
//! - A slot is registered in `slots`, the KV cache, the sampler and the
//!   draft head at once (admission) and leaves all of them at once
//!   ([`Engine::drop_slot`]).
//! - Until the prompt is done `SlotState::prefilled` equals the KV length;
//!   afterwards the KV holds `prompt + generated - 1` positions (the last
//!   sampled token is fed by the next decode).
//! - For a draft head that needs hidden states, `pending_hidden` holds the
//!   target's hidden states of the fed positions the head has not consumed
//!   (its own KV length up to the target's).
//! - One bad sequence (invalid work, KV over its reservation) is failed and
//!   dropped before the forward pass; the others still run. Only a failure
//!   of the pass itself fails every sequence in it.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use candle_core::Tensor;

use super::protocol::*;
use super::spec::{self, DraftHead, DraftInput, Drafts, HiddenContext, SeqSpec, SpecConfig};
use super::EngineError;
use crate::kv::{KvCache, KvError};
use crate::model::{Batch, Model, ModelError, OutputRows};
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
    /// Speculation state; `None` when this sequence never drafts.
    spec: Option<SeqSpec>,
    /// Generated token ids (MTP heads pair hidden states with them).
    generated_ids: Vec<u32>,
    /// Target hidden states `[m, hidden]` of the last `m` fed positions not
    /// yet consumed by the draft head (heads that need hidden only).
    pending_hidden: Option<Tensor>,
}

impl SlotState {
    /// Token at `position` of the whole sequence (prompt, then generated).
    fn token_at(&self, position: usize) -> Option<u32> {
        match position.checked_sub(self.prompt.len()) {
            None => self.prompt.get(position).copied(),
            Some(i) => self.generated_ids.get(i).copied(),
        }
    }
}

/// The engine thread's state. Build it, then hand it to
/// [`EngineThread::spawn`](super::EngineThread::spawn).
pub struct Engine {
    model: Model,
    kv: KvCache,
    sampler: Sampler,
    slots: HashMap<SlotId, SlotState>,
    info: EngineInfo,
    draft: Option<Box<dyn DraftHead>>,
    spec_config: SpecConfig,
    /// Moving average of (draft + forward time) / forward time over steps
    /// that drafted: what a speculative step costs relative to a plain one.
    draft_cost: f64,
}

/// A sequence that takes part in this step's forward pass.
struct Planned {
    slot: SlotId,
    offset: usize,
    tokens: Vec<u32>,
    /// The pass ends at a position that samples (a decode or the last prompt chunk).
    samples: bool,
    /// Drafts allowed this step (0: plain decode).
    draft_budget: usize,
    drafts: Drafts,
    /// The draft head needs this sequence's hidden state at every position.
    keep_hidden: bool,
}

impl Planned {
    /// Rows of hidden state this sequence gets from the forward pass.
    fn output(&self) -> OutputRows {
        if !self.drafts.tokens.is_empty() || self.keep_hidden {
            OutputRows::All
        } else if self.samples {
            OutputRows::Last
        } else {
            OutputRows::None
        }
    }
}

fn model_err(e: ModelError) -> EngineError {
    EngineError::Model(e.to_string())
}

fn tensor_err(e: candle_core::Error) -> EngineError {
    EngineError::Model(e.to_string())
}

fn kv_err(slot: SlotId, e: KvError) -> EngineError {
    match e {
        KvError::Exhausted {
            requested,
            available,
            ..
        } => EngineError::KvExhausted {
            requested,
            available,
        },
        KvError::OverReservation {
            reserved, needed, ..
        } => EngineError::KvOverReservation {
            slot,
            reserved,
            needed,
        },
        other => EngineError::Model(other.to_string()),
    }
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
            draft: None,
            spec_config: SpecConfig::default(),
            draft_cost: 1.0,
        }
    }

    /// Enables speculative decoding with `head` (sequences draft according
    /// to their own [`SpecOptions`], or `config.default`).
    pub fn with_draft(mut self, head: Box<dyn DraftHead>, config: SpecConfig) -> Self {
        self.draft = Some(head);
        self.spec_config = config;
        self
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
        if let Some(head) = self.draft.as_mut() {
            head.release(slot);
        }
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
        let options = a.spec.unwrap_or(self.spec_config.default);
        options
            .validate()
            .map_err(|reason| EngineError::InvalidWork {
                slot: a.slot,
                reason,
            })?;
        // NOTE: requests that want logprobs decode without drafts, so every
        // logprob they get comes from a plain sampler call.
        let spec = (options.enabled && self.draft.is_some() && !a.sampling.logprobs).then(|| {
            SeqSpec::new(
                options,
                !a.sampling.is_greedy() && a.sampling.seed.is_some(),
            )
        });
        self.kv
            .allocate(a.slot, a.kv_reserve)
            .map_err(|e| kv_err(a.slot, e))?;
        if let Err(e) = self.sampler.add(a.slot, a.sampling, &a.prompt) {
            self.kv.free(a.slot);
            return Err(e.into());
        }
        if let (Some(head), Some(_)) = (self.draft.as_mut(), &spec) {
            if let Err(e) = head.admit(a.slot, a.kv_reserve + MAX_DRAFT_TOKENS) {
                self.kv.free(a.slot);
                self.sampler.remove(a.slot);
                return Err(model_err(e));
            }
        }
        let state = SlotState {
            prompt: a.prompt,
            prefilled: 0,
            last_token: None,
            generated: 0,
            max_new_tokens: a.max_new_tokens,
            sampling: a.sampling,
            spec,
            generated_ids: Vec::new(),
            pending_hidden: None,
        };
        self.slots.insert(a.slot, state);
        Ok(())
    }

    /// Checks one work item and reserves room for its tokens (and drafts).
    fn plan_one(&mut self, work: SeqWork, may_draft: bool) -> Result<Planned, EngineError> {
        let slot = work.slot();
        if !self.slots.contains_key(&slot) {
            return Err(EngineError::UnknownSlot(slot));
        }
        let offset = self.kv.len(slot).map_err(|e| kv_err(slot, e))?;
        let needs_hidden = self.draft.as_ref().is_some_and(|h| h.needs_hidden());
        let context_len = self.info.context_len;
        let state = self
            .slots
            .get_mut(&slot)
            .ok_or(EngineError::UnknownSlot(slot))?;
        let invalid = |reason: String| EngineError::InvalidWork { slot, reason };
        let (tokens, samples, draft_cap) = match work {
            SeqWork::Prefill { start, len, .. } => {
                if start != state.prefilled || len == 0 || start + len > state.prompt.len() {
                    let (done, total) = (state.prefilled, state.prompt.len());
                    return Err(invalid(format!(
                        "prefill {start}..{} but {done} of {total} prompt tokens are done",
                        start + len
                    )));
                }
                (
                    state.prompt[start..start + len].to_vec(),
                    start + len == state.prompt.len(),
                    0,
                )
            }
            SeqWork::Decode { .. } => match state.last_token {
                // Drafts never run past max_new_tokens (the bonus token
                // counts) nor past the context.
                Some(t) if state.prefilled == state.prompt.len() => {
                    let remaining = state.max_new_tokens.saturating_sub(state.generated);
                    (
                        vec![t],
                        true,
                        remaining
                            .saturating_sub(1)
                            .min(context_len.saturating_sub(offset + 1)),
                    )
                }
                _ => return Err(invalid("decode before the prompt is prefilled".into())),
            },
        };
        if offset + tokens.len() > context_len {
            return Err(invalid(format!(
                "position {} beyond the context of {context_len}",
                offset + tokens.len()
            )));
        }
        // The sequence's schedule and the step's policy decide how many of
        // the `draft_cap` possible drafts it takes.
        let draft_budget = match state.spec.as_mut() {
            Some(spec) if draft_cap > 0 => spec.next_draft(may_draft).min(draft_cap),
            _ => 0,
        };
        let keep_hidden = needs_hidden && state.spec.is_some();
        self.kv
            .ensure_room(slot, tokens.len() + draft_budget)
            .map_err(|e| kv_err(slot, e))?;
        Ok(Planned {
            slot,
            offset,
            tokens,
            samples,
            draft_budget,
            drafts: Drafts::default(),
            keep_hidden,
        })
    }

    /// Round 0's hidden context of a sequence (heads that need hidden).
    fn hidden_context(&self, p: &Planned) -> Result<Option<HiddenContext>, EngineError> {
        if !p.keep_hidden {
            return Ok(None);
        }
        let state = &self.slots[&p.slot];
        let hidden = state.pending_hidden.clone().ok_or_else(|| {
            EngineError::Model(format!("slot {}: no hidden state to draft from", p.slot))
        })?;
        let m = hidden.dim(0).map_err(tensor_err)?;
        if m == 0 || m > p.offset {
            return Err(EngineError::Model(format!(
                "slot {}: {m} pending hidden states at position {}",
                p.slot, p.offset
            )));
        }
        let tokens = (p.offset + 1 - m..p.offset)
            .map(|pos| state.token_at(pos))
            .collect::<Option<Vec<u32>>>();
        let tokens = tokens.ok_or_else(|| {
            EngineError::Model(format!(
                "slot {}: token history shorter than its hidden states",
                p.slot
            ))
        })?;
        Ok(Some(HiddenContext { hidden, tokens }))
    }

    /// Batched draft rounds for every planned sequence with a draft budget.
    /// Leaves each slot's KV length where it was.
    fn run_drafts(&mut self, planned: &mut [Planned]) -> Result<(), EngineError> {
        let rounds = planned.iter().map(|p| p.draft_budget).max().unwrap_or(0);
        let mut result = Ok(());
        for round in 0..rounds {
            let members: Vec<usize> = (0..planned.len())
                .filter(|&i| planned[i].draft_budget > round)
                .collect();
            let mut inputs = Vec::with_capacity(members.len());
            for &i in &members {
                let p = &planned[i];
                let context = if round == 0 {
                    self.hidden_context(p)?
                } else {
                    None
                };
                let token = *p.drafts.tokens.last().unwrap_or(&p.tokens[0]);
                inputs.push(DraftInput {
                    slot: p.slot,
                    token,
                    position: p.offset + round,
                    round,
                    context,
                });
            }
            let head = self
                .draft
                .as_mut()
                .expect("drafting needs a head; this is a bug");
            let logits = match head.draft(&self.model, &mut self.kv, &inputs) {
                Ok(l) => l,
                Err(e) => {
                    result = Err(model_err(e));
                    break;
                }
            };
            // Plain greedy members draft the first maximum of their row:
            // one call for all of them, only ids leave the device.
            let plain: Vec<usize> = (0..members.len())
                .filter(|&row| self.sampler.is_plain_greedy(planned[members[row]].slot))
                .collect();
            let mut plain_ids = Vec::new();
            if !plain.is_empty() {
                let slots: Vec<SlotId> = plain
                    .iter()
                    .map(|&row| planned[members[row]].slot)
                    .collect();
                let idx: Vec<u32> = plain.iter().map(|&row| row as u32).collect();
                let rows = Tensor::new(idx.as_slice(), logits.device())
                    .and_then(|idx| logits.index_select(&idx, 0))
                    .map_err(tensor_err)?;
                plain_ids = self.sampler.argmax_rows(&slots, &rows)?;
            }
            let mut plain_next = plain.iter().zip(&plain_ids).peekable();
            for (row, &i) in members.iter().enumerate() {
                let p = &mut planned[i];
                if let Some((_, &token)) = plain_next.next_if(|(&r, _)| r == row) {
                    p.drafts.tokens.push(token);
                    p.drafts.probs.push(Vec::new());
                } else {
                    let greedy = self.slots[&p.slot].sampling.is_greedy();
                    let row_logits = logits.narrow(0, row, 1).map_err(tensor_err)?;
                    let q = self
                        .sampler
                        .draft_distributions(p.slot, &row_logits, &p.drafts.tokens, round)?
                        .remove(0);
                    let token = spec::pick(&mut self.sampler, p.slot, greedy, &q)?;
                    p.drafts.tokens.push(token);
                    p.drafts.probs.push(q);
                }
                if round == 0 && p.keep_hidden {
                    // The head consumed these pairs into its own KV.
                    if let Some(state) = self.slots.get_mut(&p.slot) {
                        state.pending_hidden = None;
                    }
                }
            }
        }
        let head = self
            .draft
            .as_mut()
            .expect("drafting needs a head; this is a bug");
        for p in planned.iter().filter(|p| p.draft_budget > 0) {
            self.kv
                .set_len(p.slot, p.offset)
                .map_err(|e| kv_err(p.slot, e))?;
            head.end_rounds(p.slot, p.offset).map_err(model_err)?;
        }
        result
    }

    /// Runs the forward pass, the sampler and the verification.
    fn run_batch(
        &mut self,
        planned: &[Planned],
        stats: &mut StepStats,
    ) -> Result<Vec<(SlotId, SeqProgress)>, EngineError> {
        let t0 = Instant::now();
        let mut batch = Batch::default();
        // Per sequence: where its hidden rows and its logit rows start.
        let mut hidden_start = Vec::with_capacity(planned.len());
        let mut logit_start = Vec::with_capacity(planned.len());
        let mut logit_rows: Vec<u32> = Vec::new();
        let mut hidden_rows = 0u32;
        for p in planned {
            let tokens: Vec<u32> = p.tokens.iter().chain(&p.drafts.tokens).copied().collect();
            if !p.drafts.tokens.is_empty() {
                self.kv.begin(p.slot).map_err(|e| kv_err(p.slot, e))?;
            }
            let output = p.output();
            let n_out = match output {
                OutputRows::None => 0,
                OutputRows::Last => 1,
                OutputRows::All => tokens.len() as u32,
            };
            hidden_start.push(hidden_rows);
            logit_start.push(logit_rows.len());
            if !p.drafts.tokens.is_empty() {
                logit_rows.extend(hidden_rows..hidden_rows + n_out);
            } else if p.samples {
                logit_rows.push(hidden_rows + n_out - 1);
            }
            hidden_rows += n_out;
            batch.push(p.slot, p.offset, &tokens, output);
        }
        stats.batch_tokens = batch.tokens.len();
        let hidden = self
            .model
            .forward(&batch, &mut self.kv)
            .map_err(model_err)?;
        let logits = if logit_rows.is_empty() {
            None
        } else if logit_rows.len() as u32 == hidden_rows {
            Some(self.model.unembed(&hidden).map_err(model_err)?)
        } else {
            let idx = Tensor::new(logit_rows.as_slice(), hidden.device()).map_err(tensor_err)?;
            Some(
                self.model
                    .unembed(&hidden.index_select(&idx, 0).map_err(tensor_err)?)
                    .map_err(model_err)?,
            )
        };
        stats.forward = t0.elapsed();

        // One sampler call over the plain sampling rows.
        let t1 = Instant::now();
        let plain: Vec<usize> = (0..planned.len())
            .filter(|&i| planned[i].drafts.tokens.is_empty() && planned[i].samples)
            .collect();
        let sampled = match &logits {
            Some(logits) if !plain.is_empty() => {
                let slots: Vec<SlotId> = plain.iter().map(|&i| planned[i].slot).collect();
                let rows = if plain.len() == logit_rows.len() {
                    logits.clone()
                } else {
                    let idx: Vec<u32> = plain.iter().map(|&i| logit_start[i] as u32).collect();
                    logits
                        .index_select(
                            &Tensor::new(idx.as_slice(), logits.device()).map_err(tensor_err)?,
                            0,
                        )
                        .map_err(tensor_err)?
                };
                let res = self.sampler.sample(&slots, &rows)?;
                match res.path {
                    SamplePath::Uniform => stats.uniform_calls += 1,
                    SamplePath::Serial => stats.serial_calls += 1,
                }
                Some(res)
            }
            _ => None,
        };

        let mut out = Vec::with_capacity(planned.len());
        let mut plain_row = 0;
        for (i, p) in planned.iter().enumerate() {
            let mut progress = SeqProgress::default();
            let state = self
                .slots
                .get_mut(&p.slot)
                .ok_or(EngineError::UnknownSlot(p.slot))?;
            if state.prefilled < state.prompt.len() {
                state.prefilled += p.tokens.len();
                progress.prefilled = p.tokens.len();
            }
            let mut emitted: Vec<GeneratedToken> = Vec::new();
            // Hidden rows the draft head will pair with known next tokens.
            let mut kept_hidden_rows = p.tokens.len();
            if !p.drafts.tokens.is_empty() {
                let k = p.drafts.tokens.len();
                let logits = logits
                    .as_ref()
                    .expect("speculative rows exist; this is a bug");
                let rows = logits
                    .narrow(0, logit_start[i], k + 1)
                    .map_err(tensor_err)?;
                let greedy = state.sampling.is_greedy();
                let (accepted, next) = spec::verify(
                    &mut self.sampler,
                    p.slot,
                    greedy,
                    &rows,
                    &p.drafts,
                    self.spec_config.unchecked_accept,
                )?;
                if self.spec_config.compare_serial && greedy {
                    compare_serial(&self.model, &mut self.kv, p, &rows).map_err(model_err)?;
                }
                self.kv
                    .commit(p.slot, 1 + accepted)
                    .map_err(|e| kv_err(p.slot, e))?;
                let mut kept: Vec<u32> = p.drafts.tokens[..accepted].to_vec();
                kept.push(next);
                self.sampler.commit(p.slot, &kept)?;
                if let Some(s) = state.spec.as_mut() {
                    s.update(k, accepted, self.draft_cost);
                }
                progress.drafted = k;
                progress.accepted = accepted;
                stats.drafted += k;
                stats.accepted += accepted;
                kept_hidden_rows = 1 + accepted;
                emitted.extend(kept.into_iter().map(|id| GeneratedToken {
                    id,
                    logprob: None,
                    top_logprobs: Vec::new(),
                }));
            } else if p.samples {
                let res = sampled
                    .as_ref()
                    .expect("a plain sampling row was sampled; this is a bug");
                let (logprob, top_logprobs) = res.for_row(plain_row, &state.sampling);
                emitted.push(GeneratedToken {
                    id: res.tokens[plain_row],
                    logprob,
                    top_logprobs,
                });
                plain_row += 1;
            }
            if p.keep_hidden {
                let rows = hidden
                    .narrow(0, hidden_start[i] as usize, kept_hidden_rows)
                    .map_err(tensor_err)?;
                state.pending_hidden = Some(match state.pending_hidden.take() {
                    Some(prev) => Tensor::cat(&[prev, rows], 0).map_err(tensor_err)?,
                    None => rows,
                });
            }
            // EOS or max_new_tokens inside an accepted run stop exactly there.
            for token in emitted {
                let id = token.id;
                state.last_token = Some(id);
                state.generated += 1;
                state.generated_ids.push(id);
                progress.tokens.push(token);
                if self.info.eos_ids.contains(&id) {
                    progress.finish = Some(SeqFinish::Eos);
                    break;
                }
                if state.generated >= state.max_new_tokens {
                    progress.finish = Some(SeqFinish::Length);
                    break;
                }
            }
            if progress.finish.is_none()
                && !progress.tokens.is_empty()
                && state.prompt.len() + state.generated >= self.info.context_len
            {
                progress.finish = Some(SeqFinish::ContextFull);
            }
            out.push((p.slot, progress));
        }
        stats.sample = t1.elapsed();
        Ok(out)
    }
}

/// The seed's compare mode: feeds the verified tokens again one at a time
/// and logs the first position whose argmax differs from the batched pass.
/// Leaves the cache as the batched pass did (same tokens, same positions).
fn compare_serial(
    model: &Model,
    kv: &mut KvCache,
    p: &Planned,
    batched: &Tensor,
) -> Result<(), ModelError> {
    let batched: Vec<u32> = batched.argmax(1)?.to_vec1()?;
    kv.set_len(p.slot, p.offset)?;
    for (i, &token) in p.tokens.iter().chain(&p.drafts.tokens).enumerate() {
        let mut b = Batch::default();
        b.push(p.slot, p.offset + i, &[token], OutputRows::Last);
        let serial: Vec<u32> = model
            .unembed(&model.forward(&b, kv)?)?
            .argmax(1)?
            .to_vec1()?;
        if serial[0] != batched[i] {
            tracing::warn!(
                slot = p.slot,
                position = p.offset + i,
                batched = batched[i],
                serial = serial[0],
                "MTP: batched and serial verification disagree"
            );
            break;
        }
    }
    kv.set_len(p.slot, p.offset + p.tokens.len() + p.drafts.tokens.len())?;
    Ok(())
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

        // NOTE: the batch-size policy: a big batch is compute-bound, drafts
        // would only add work, so nobody (but pinned sequences) drafts.
        let decodes = plan
            .work
            .iter()
            .filter(|w| matches!(w, SeqWork::Decode { .. }))
            .count();
        let may_draft = self.draft.is_some() && decodes <= self.spec_config.max_batch;
        let mut planned = Vec::with_capacity(plan.work.len());
        for work in plan.work {
            match self.plan_one(work, may_draft) {
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
        if planned.iter().any(|p| p.draft_budget > 0) {
            let t = Instant::now();
            if let Err(error) = self.run_drafts(&mut planned) {
                // Drafting is an optimisation: on failure decode plainly, and
                // stop drafting for these sequences (the head's state for
                // them can no longer be trusted).
                tracing::warn!(%error, "drafting failed; decoding without drafts");
                for p in planned.iter_mut().filter(|p| p.draft_budget > 0) {
                    p.drafts = Drafts::default();
                    p.keep_hidden = false;
                    if let Some(state) = self.slots.get_mut(&p.slot) {
                        state.spec = None;
                        state.pending_hidden = None;
                    }
                    if let Some(head) = self.draft.as_mut() {
                        head.release(p.slot);
                    }
                }
            }
            outcome.stats.draft = t.elapsed();
        }
        if !planned.is_empty() {
            outcome.stats.batch_seqs = planned.len();
            let result = self.run_batch(&planned, &mut outcome.stats);
            if outcome.stats.drafted > 0 {
                let forward = outcome.stats.forward.as_secs_f64().max(1e-9);
                let ratio = (outcome.stats.draft.as_secs_f64() + forward) / forward;
                self.draft_cost = 0.8 * self.draft_cost + 0.2 * ratio;
            }
            match result {
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
