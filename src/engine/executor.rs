//! [`Engine`]: the real [`StepExecutor`]. It owns the model and the slot
//! registry (KV cache, sampler, draft head, draft policy, sequences) and
//! runs a [`StepPlan`] as its phases, in this order:
//!
//! 1. **release** the slots the scheduler ended;
//! 2. **admit** new sequences into every store ([`Sequences::admit`]);
//! 3. **plan**: check each work item and reserve its KV ([`work::plan_one`]);
//! 4. **draft**: batched draft rounds ([`drafting::run_rounds`]);
//! 5. **forward**: one ragged pass over the [`RowLayout`], every fed
//!    position's hidden state into the KV cache when a draft head drafts
//!    from them, and the unembedding of the rows that need logits, while a
//!    worker thread computes the grammar masks of the constrained rows
//!    ([`masks`]);
//! 6. **sample**: one sampler call over every plain sampling row, with
//!    those masks;
//! 7. **verify** each drafting sequence's drafts ([`update::verify`]);
//! 8. **update** ([`update::update`]): KV and sampler commits, the
//!    end-of-sequence rule, and the release of finished slots.
//!
//! One bad sequence (invalid work, KV over its reservation) is failed and
//! released in the plan phase; the others still run. Only a failure of the
//! pass itself (phases 5–8) fails every sequence in it.

use std::time::{Duration, Instant};

use candle_core::Tensor;

use super::draft_heads::DraftHead;
use super::errors::{kv_err, model_err, tensor_err};
use super::masks::{self, StepMasks};
use super::protocol::*;
use super::rows::RowLayout;
use super::sequences::Sequences;
use super::spec::SpecConfig;
use super::update;
use super::work::{self, Planned};
use super::{drafting, EngineError};
use crate::kv::{KvCache, KvError};
use crate::model::Model;
use crate::sampler::{SamplePath, SampleResult, Sampler};

/// Engine settings.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// KV pool size in tokens, over all slots (rounded down to whole blocks).
    pub kv_capacity_tokens: usize,
    /// Tokens per KV block ([`crate::kv::DEFAULT_BLOCK_SIZE`] by default).
    pub kv_block_size: usize,
    /// Name reported to clients.
    pub model_name: String,
    /// Extra end-of-sequence ids (the tokenizer's), merged with the model's.
    pub eos_ids: Vec<u32>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            kv_capacity_tokens: 16_384,
            kv_block_size: crate::kv::DEFAULT_BLOCK_SIZE,
            model_name: "tandem".into(),
            eos_ids: Vec::new(),
        }
    }
}

/// The engine thread's state. Build it, then hand it to
/// [`EngineThread::spawn`](super::EngineThread::spawn).
pub struct Engine {
    model: Model,
    seqs: Sequences,
    info: EngineInfo,
}

/// Each sequence's outcome of a pass that ran (a grammar failure fails
/// only its own sequence).
type PassResults = Vec<(SlotId, Result<SeqProgress, EngineError>)>;

impl Engine {
    pub fn new(model: Model, config: EngineConfig) -> Self {
        let cfg = model.config();
        let mut eos_ids = cfg.eos_token_ids.clone();
        for id in config.eos_ids {
            if !eos_ids.contains(&id) {
                eos_ids.push(id);
            }
        }
        let block_size = config.kv_block_size.max(1);
        let num_blocks = config.kv_capacity_tokens / block_size;
        let info = EngineInfo {
            model_name: config.model_name,
            context_len: cfg.max_position_embeddings,
            vocab_size: cfg.vocab_size,
            eos_ids,
            kv_capacity_tokens: num_blocks * block_size,
            kv_block_size: block_size,
            speculation: None,
        };
        let kv = KvCache::paged(
            model.kv_layout(),
            model.device().clone(),
            num_blocks,
            block_size,
        );
        let seqs = Sequences::new(kv, Sampler::new(info.context_len));
        Self { model, seqs, info }
    }

    /// Enables speculative decoding with `head` (sequences draft according
    /// to their own [`SpecOptions`], or `config.default`), and with prompt
    /// lookup too when `config.prompt_lookup` says so.
    pub fn with_draft(self, head: Box<dyn DraftHead>, config: SpecConfig) -> Self {
        self.with_drafters(Some(head), config)
    }

    /// Enables speculative decoding with any of the drafters: a head,
    /// `config.prompt_lookup`, or both (neither: nobody drafts).
    pub fn with_drafters(mut self, head: Option<Box<dyn DraftHead>>, config: SpecConfig) -> Self {
        if head.as_ref().is_some_and(|h| h.needs_hidden()) {
            let width = self.model.config().hidden_size;
            self.seqs.kv.store_hidden(width, self.model.dtype());
        }
        let any = head.is_some() || config.prompt_lookup.is_some();
        self.seqs.set_drafters(head, config);
        self.info.speculation = any.then_some(config.default);
        self
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    /// KV tokens currently reserved, or held by block tables (for tests and stats).
    pub fn kv_reserved_tokens(&self) -> usize {
        self.seqs.kv.reserved_tokens()
    }

    /// Preemptions, admissions, resumptions and table updates, in that
    /// order; a sequence that fails one is released and reported.
    fn apply_kv(
        &mut self,
        preempt: Vec<SlotId>,
        admissions: Vec<Admission>,
        resume: Vec<Resume>,
        tables: Vec<TableUpdate>,
        out: &mut Vec<SeqOutcome>,
    ) {
        let mut fail = |seqs: &mut super::sequences::Sequences, slot, error: EngineError| {
            if !matches!(
                error,
                EngineError::UnknownSlot(_) | EngineError::DuplicateSlot(_)
            ) {
                seqs.release(slot);
            }
            out.push(SeqOutcome {
                slot,
                result: Err(error),
            });
        };
        for slot in preempt {
            if let Err(e) = self.seqs.preempt(slot) {
                fail(&mut self.seqs, slot, e);
            }
        }
        for a in admissions {
            let slot = a.slot;
            if let Err(e) = self.seqs.admit(a) {
                fail(&mut self.seqs, slot, e);
            }
        }
        for r in resume {
            let slot = r.slot;
            if let Err(e) = self.seqs.resume(r) {
                fail(&mut self.seqs, slot, e);
            }
        }
        for t in tables {
            if let Err(e) = self.seqs.kv.set_table(t.slot, t.table, None) {
                fail(&mut self.seqs, t.slot, kv_err(t.slot, e));
            }
        }
    }

    fn plan(&mut self, work: Vec<SeqWork>, out: &mut Vec<SeqOutcome>) -> Vec<Planned> {
        let mut planned = Vec::with_capacity(work.len());
        for w in work {
            match work::plan_one(&mut self.seqs, w, self.info.context_len) {
                Ok(p) => planned.push(p),
                Err(error) => {
                    if !matches!(error, EngineError::UnknownSlot(_)) {
                        self.seqs.release(w.slot());
                    }
                    out.push(SeqOutcome {
                        slot: w.slot(),
                        result: Err(error),
                    });
                }
            }
        }
        // Graphs may turn off (a failed capture) or be turned off at any
        // step.
        let eager_verify_above = self.model.eager_verify_above();
        let cost = self.seqs.policy.cost_mut();
        cost.set_eager_verify_above(eager_verify_above);
        work::grant_drafts(&mut self.seqs, &mut planned);
        planned
    }

    fn draft(&mut self, planned: &mut [Planned], stats: &mut StepStats) {
        if !planned.iter().any(|p| p.draft_budget > 0) {
            return;
        }
        let t = Instant::now();
        let drafted = drafting::run_rounds(&self.model, &mut self.seqs, planned);
        masks::truncate_drafts(&mut self.seqs, planned);
        if let Err(error) = drafted {
            // Drafting is an optimisation: on failure decode plainly, and
            // stop drafting for these sequences (the head's state for them
            // can no longer be trusted).
            tracing::warn!(%error, "drafting failed; decoding without drafts");
            for p in planned.iter_mut().filter(|p| p.draft_budget > 0) {
                p.drop_drafts();
                self.seqs.stop_drafting(p.slot);
            }
        }
        stats.draft = t.elapsed();
    }

    /// Phases 5–8 for every planned sequence. The outer error fails the
    /// whole pass; an inner one (a grammar's) only its sequence.
    fn run_pass(
        &mut self,
        planned: &mut [Planned],
        stats: &mut StepStats,
    ) -> Result<PassResults, EngineError> {
        planned.iter_mut().for_each(Planned::seal);
        let layout = RowLayout::new(&planned.iter().map(Planned::rows).collect::<Vec<_>>());
        stats.batch_tokens = layout.batch.tokens.len();
        let t0 = Instant::now();
        let (logits, mut step_masks) = self.forward_with_masks(planned, &layout, stats);
        let logits = logits?;
        stats.forward = t0.elapsed();
        let t1 = Instant::now();
        let sampled = self.sample(planned, &layout, logits.as_ref(), &step_masks, stats)?;
        let mut out = Vec::with_capacity(planned.len());
        for (p, rows) in planned.iter().zip(&layout.seqs) {
            if let Some(reason) = step_masks.failed.remove(&p.slot) {
                out.push((
                    p.slot,
                    Err(EngineError::Grammar {
                        slot: p.slot,
                        reason,
                    }),
                ));
                continue;
            }
            let verdict = match &logits {
                Some(logits) if !p.drafts.tokens.is_empty() => {
                    let masks = step_masks.by_slot.get(&p.slot).map(Vec::as_slice);
                    Some(update::verify(&mut self.seqs, p, rows, logits, masks)?)
                }
                _ => None,
            };
            let step = update::StepResult {
                verdict,
                sampled: sampled.as_ref(),
            };
            let progress = match update::update(&mut self.seqs, &self.info, p, rows, step, stats) {
                Err(e @ EngineError::Grammar { .. }) => Err(e),
                other => Ok(other?),
            };
            out.push((p.slot, progress));
        }
        stats.sample = t1.elapsed();
        Ok(out)
    }

    /// The forward phase, with the grammar masks computed beside it on a
    /// worker thread when any sampling row is constrained. The lent
    /// grammars are back in the registry when this returns, whatever the
    /// pass's outcome.
    fn forward_with_masks(
        &mut self,
        planned: &[Planned],
        layout: &RowLayout,
        stats: &mut StepStats,
    ) -> (Result<Option<Tensor>, EngineError>, StepMasks) {
        let mut lent = masks::lend(&mut self.seqs, planned);
        if lent.is_empty() {
            return (self.forward(planned, layout), StepMasks::default());
        }
        let eos_ids = self.info.eos_ids.clone();
        let (pass, lent, step_masks, waited) = std::thread::scope(|s| {
            let worker = s.spawn(move || {
                let m = masks::compute(&mut lent, &eos_ids);
                (lent, m)
            });
            let pass = self.forward(planned, layout);
            let t = Instant::now();
            let (lent, m) = match worker.join() {
                Ok(done) => done,
                Err(payload) => std::panic::resume_unwind(payload),
            };
            (pass, lent, m, t.elapsed())
        });
        masks::give_back(&mut self.seqs, lent);
        stats.masks = step_masks.by_slot.len() + step_masks.failed.len();
        stats.mask = step_masks.took;
        stats.mask_wait = waited;
        (pass, step_masks)
    }

    fn forward(
        &mut self,
        planned: &[Planned],
        layout: &RowLayout,
    ) -> Result<Option<Tensor>, EngineError> {
        for p in planned.iter().filter(|p| !p.drafts.tokens.is_empty()) {
            self.seqs.kv.begin(p.slot).map_err(|e| kv_err(p.slot, e))?;
        }
        // A mark left by a pass the engine did not make (a draft head's)
        // must not skip this pass's write.
        self.seqs.kv.take_hidden_written();
        let hidden = self
            .model
            .forward(&layout.batch, &mut self.seqs.kv)
            .map_err(model_err)?;
        // A CUDA graph's pass writes its hidden rows itself: a scatter and
        // its index upload less a step (BENCHMARKS.md, issue 18).
        if self.seqs.kv.stores_hidden() && !self.seqs.kv.take_hidden_written() {
            self.store_hidden(planned, layout, &hidden)?;
        }
        let logits = if layout.unembed.is_empty() {
            None
        } else if layout.unembeds_all() {
            Some(self.model.unembed(&hidden).map_err(model_err)?)
        } else {
            let rows = select_rows(&hidden, &layout.unembed)?;
            Some(self.model.unembed(&rows).map_err(model_err)?)
        };
        Ok(logits)
    }

    /// Writes every fed position's hidden state into the KV cache (every
    /// sequence has all its rows when the cache stores them).
    fn store_hidden(
        &mut self,
        planned: &[Planned],
        layout: &RowLayout,
        hidden: &Tensor,
    ) -> Result<(), EngineError> {
        let writes: Vec<_> = planned
            .iter()
            .zip(&layout.seqs)
            .map(|(p, rows)| (p.slot, p.offset, rows.hidden.clone()))
            .collect();
        self.seqs
            .kv
            .write_hidden_rows(&writes, hidden)
            .map_err(|e| {
                // `kv_err` names a slot only for an over-reservation, whose
                // error carries it.
                let slot = match e {
                    KvError::OverReservation { slot, .. } => slot,
                    _ => SlotId::default(),
                };
                kv_err(slot, e)
            })
    }

    /// One sampler call over the plain sampling rows.
    fn sample(
        &mut self,
        planned: &[Planned],
        layout: &RowLayout,
        logits: Option<&Tensor>,
        step_masks: &StepMasks,
        stats: &mut StepStats,
    ) -> Result<Option<SampleResult>, EngineError> {
        let Some(logits) = logits.filter(|_| !layout.sample.is_empty()) else {
            return Ok(None);
        };
        let slots: Vec<SlotId> = planned
            .iter()
            .zip(&layout.seqs)
            .filter(|(_, rows)| rows.sample.is_some())
            .map(|(p, _)| p.slot)
            .collect();
        let rows = if layout.samples_all() {
            logits.clone()
        } else {
            select_rows(logits, &layout.sample)?
        };
        let row_masks = step_masks.for_rows(&slots);
        let result = self.seqs.sampler.sample_masked(&slots, &rows, &row_masks)?;
        match result.path {
            SamplePath::Uniform => stats.uniform_calls += 1,
            SamplePath::Serial => stats.serial_calls += 1,
        }
        Ok(Some(result))
    }

    /// Routes the pass's results; finished or failed slots leave the registry.
    fn report(
        &mut self,
        planned: &[Planned],
        result: Result<PassResults, EngineError>,
        out: &mut Vec<SeqOutcome>,
    ) {
        match result {
            Ok(results) => {
                for (slot, progress) in results {
                    if progress.as_ref().map_or(true, |p| p.finish.is_some()) {
                        self.seqs.release(slot);
                    }
                    out.push(SeqOutcome {
                        slot,
                        result: progress,
                    });
                }
            }
            Err(error) => {
                tracing::warn!(%error, "step failed; failing every sequence in it");
                for p in planned {
                    self.seqs.release(p.slot);
                    out.push(SeqOutcome {
                        slot: p.slot,
                        result: Err(error.clone()),
                    });
                }
            }
        }
    }
}

/// Rows `idx` of a `[n, d]` tensor.
fn select_rows(t: &Tensor, idx: &[u32]) -> Result<Tensor, EngineError> {
    let idx = Tensor::new(idx, t.device()).map_err(tensor_err)?;
    t.index_select(&idx, 0).map_err(tensor_err)
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
            self.seqs.release(slot);
        }
        self.apply_kv(
            plan.preempt,
            plan.admit,
            plan.resume,
            plan.tables,
            &mut outcome.seqs,
        );
        let admitted = start.elapsed();
        let planning = Instant::now();
        let mut planned = self.plan(plan.work, &mut outcome.seqs);
        let planning = planning.elapsed();
        self.draft(&mut planned, &mut outcome.stats);
        if !planned.is_empty() {
            outcome.stats.batch_seqs = planned.len();
            let captures = self.model.cuda_graph_stats().captures;
            let result = self.run_pass(&mut planned, &mut outcome.stats);
            let captured = self.model.cuda_graph_stats().captures != captures;
            // The KV phase is no part of what a pass of these tokens
            // costs: when a CPU pool grows (doubling, copying every layer's
            // K and V) it took 1.3-1.8 s of a 95 ms step, and those steps,
            // priced as passes, made a 64-token pass look 2.5 times its
            // cost and drafting at 64 streams look cheap.
            let pass = start
                .elapsed()
                .saturating_sub(admitted + outcome.stats.draft);
            self.record_pass_cost(&planned, &outcome.stats, pass, captured);
            self.report(&planned, result, &mut outcome.seqs);
        }
        outcome.stats.total = start.elapsed();
        trace_step(&outcome.stats, admitted, planning);
        outcome
    }
}

impl Engine {
    /// Gives a decode pass's time (`pass`: the step's, its KV phase and
    /// drafting aside) to the draft policy's cost model, as a plain or a
    /// verifying pass, and traces it. Decode steps only: a prompt chunk's
    /// tokens are far cheaper at the margin than a decode's, and would
    /// skew the slope the policy prices drafts with. A pass that `captured` a CUDA graph ran
    /// twice (eagerly, then under capture): a one-off, not what its shape
    /// costs.
    fn record_pass_cost(
        &mut self,
        planned: &[Planned],
        stats: &StepStats,
        pass: Duration,
        captured: bool,
    ) {
        if planned.iter().any(|p| p.tokens.len() != 1) {
            return;
        }
        let verifies = planned.iter().any(|p| !p.drafts.tokens.is_empty());
        tracing::debug!(
            tokens = stats.batch_tokens,
            seqs = planned.len(),
            verifies,
            captured,
            pass_ms = ms(pass),
            forward_ms = ms(stats.forward),
            sample_ms = ms(stats.sample),
            "decode pass"
        );
        let cost = self.seqs.policy.cost_mut();
        match (captured, verifies) {
            (true, _) => {}
            (false, true) => cost.record_verify(stats.batch_tokens, planned.len(), pass),
            (false, false) => cost.record_pass(stats.batch_tokens, pass),
        }
    }
}

/// Traces a step's phases (`admitted`: release and admission; `planning`:
/// the plan phase, drafts granted).
fn trace_step(stats: &StepStats, admitted: Duration, planning: Duration) {
    tracing::debug!(
        seqs = stats.batch_seqs,
        tokens = stats.batch_tokens,
        kv_ms = ms(admitted),
        plan_ms = ms(planning),
        draft_ms = ms(stats.draft),
        forward_ms = ms(stats.forward),
        sample_ms = ms(stats.sample),
        total_ms = ms(stats.total),
        "step"
    );
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}
