//! The plain-data boundary between the scheduler actor and the engine thread.
//!
//! Nothing here holds a tensor: a [`StepPlan`] says *which* slots do *what*
//! this step (counts and token ids), a [`StepOutcome`] says what came of it.
//! The engine remembers each slot's last sampled token, so a plan for step
//! N+1 can be built before the scheduler has routed step N's tokens.
//!
//! Ownership rules both sides rely on:
//! - A slot exists in the engine from the step whose plan admits it until the
//!   engine reports it finished or failed, or until a plan releases it.
//! - The engine frees a slot's KV and sampler state by itself when it reports
//!   a [`SeqFinish`] or an error for it; `release` is only for ends the
//!   scheduler decides (cancellation, stop strings). Releasing an unknown
//!   slot is a no-op, so a release racing a finish is harmless.

use std::sync::Arc;
use std::time::Duration;

use crate::engine::EngineError;
use crate::sampler::{LogitBias, SamplingOptions};
use crate::structured::Grammar;

pub use crate::slot::SlotId;

/// What the scheduler needs to know about the engine to plan steps.
#[derive(Debug, Clone)]
pub struct EngineInfo {
    /// Model name reported to clients.
    pub model_name: String,
    /// Longest sequence (prompt + generated) a slot may hold.
    pub context_len: usize,
    /// Vocabulary size of the model's logits.
    pub vocab_size: usize,
    /// Token ids that end generation.
    pub eos_ids: Vec<u32>,
    /// KV pool capacity in tokens, summed over all slots: a whole number
    /// of blocks.
    pub kv_capacity_tokens: usize,
    /// Tokens per KV block (the pool holds `kv_capacity_tokens /
    /// kv_block_size` blocks, ids `0..` that).
    pub kv_block_size: usize,
    /// The speculation options a request that does not say gets; `None`
    /// when the engine has no draft head (nobody drafts).
    pub speculation: Option<SpecOptions>,
}

/// One step's work, sent to the engine thread.
#[derive(Debug, Clone, Default)]
pub struct StepPlan {
    /// Monotonic step number (echoed in the outcome).
    pub step: u64,
    /// Slots to drop before this step's work (cancelled, stopped by a stop
    /// string, or abandoned by their requester).
    pub release: Vec<SlotId>,
    /// Slots whose KV is dropped before this step's work (preempted: the
    /// sequence keeps its slot, sampler and generated tokens, and is
    /// recomputed after a later [`Resume`]).
    pub preempt: Vec<SlotId>,
    /// Slots to register before this step's work.
    pub admit: Vec<Admission>,
    /// Preempted slots that get a block table again (after `admit`).
    pub resume: Vec<Resume>,
    /// Running slots whose block table changed (grown for this step's
    /// tokens, or trimmed), applied after `resume`.
    pub tables: Vec<TableUpdate>,
    /// Per-sequence work, batched into one forward pass and one sampler call.
    pub work: Vec<SeqWork>,
}

/// Registration of a new sequence.
#[derive(Debug, Clone)]
pub struct Admission {
    pub slot: SlotId,
    /// The whole prompt (BOS included when the model wants one).
    pub prompt: Arc<[u32]>,
    /// Validated sampling options.
    pub sampling: SamplingOptions,
    /// Generation stops with [`SeqFinish::Length`] after this many tokens.
    pub max_new_tokens: usize,
    /// Where its KV goes.
    pub kv: KvGrant,
    /// Speculative decoding for this sequence; `None` uses the engine's
    /// default (see [`crate::engine::SpecConfig`]).
    pub spec: Option<SpecOptions>,
    /// Grammar, logit bias and stop ids (none by default).
    pub constraints: SeqConstraints,
}

/// What constrains a sequence's tokens beyond its sampling options,
/// checked and compiled at the edge. The engine takes ownership of the
/// grammar state at admission.
#[derive(Debug, Clone, Default)]
pub struct SeqConstraints {
    /// The grammar every sampled token must follow (a mask per step).
    pub grammar: Option<Grammar>,
    /// Added to the raw logits at every position.
    pub logit_bias: LogitBias,
    /// Token ids that end the sequence like an EOS (the `stop` extension
    /// with token ids); the id is the last token.
    pub stop_ids: Vec<u32>,
}

impl SeqConstraints {
    /// Whether nothing constrains the sequence.
    pub fn is_empty(&self) -> bool {
        self.grammar.is_none() && self.logit_bias.is_empty() && self.stop_ids.is_empty()
    }
}

/// Where an admitted sequence's KV lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvGrant {
    /// Blocks of the scheduler's pool. The first `cached_tokens` positions
    /// (whole blocks of a cached prefix, fewer than the prompt) are already
    /// computed: prefill starts there.
    Blocks {
        table: Vec<u32>,
        cached_tokens: usize,
    },
    /// Tokens the engine reserves and takes blocks for by itself, for
    /// drivers without a block pool (tests, benches). A pool serves one kind
    /// of admission for its whole life.
    Reserve(usize),
}

/// A preempted sequence given blocks again: its first `cached_tokens`
/// positions are found in the prefix cache, the rest (prompt and every
/// generated token but the last) is recomputed by prefill work before it
/// decodes again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resume {
    pub slot: SlotId,
    pub table: Vec<u32>,
    pub cached_tokens: usize,
}

/// A running slot's whole new block table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableUpdate {
    pub slot: SlotId,
    pub table: Vec<u32>,
}

/// How a sequence drafts tokens for speculative (MTP) decoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct SpecOptions {
    /// Draft at all (needs an engine with a draft head).
    pub enabled: bool,
    /// The longest draft an adaptive sequence takes before the engine has
    /// measured its step cost (the cost priors decide up to it); every
    /// step's draft length for a constant schedule.
    pub initial_draft: usize,
    /// Longest draft.
    pub max_draft: usize,
    pub schedule: DraftSchedule,
}

impl Default for SpecOptions {
    fn default() -> Self {
        Self {
            enabled: true,
            initial_draft: 4,
            max_draft: 8,
            schedule: DraftSchedule::Adaptive,
        }
    }
}

impl SpecOptions {
    /// Speculation off.
    pub fn off() -> Self {
        Self {
            enabled: false,
            ..Self::default()
        }
    }

    /// Speculation on, drafting exactly `k` tokens every step (no schedule).
    pub fn constant(k: usize) -> Self {
        Self {
            enabled: true,
            initial_draft: k,
            max_draft: k,
            schedule: DraftSchedule::Constant,
        }
    }

    /// Checks the lengths; the message names the field.
    pub fn validate(&self) -> Result<(), String> {
        if self.enabled && (self.initial_draft == 0 || self.max_draft == 0) {
            return Err("`initial_draft` and `max_draft` must be at least 1".into());
        }
        if self.initial_draft > self.max_draft {
            return Err(format!(
                "`initial_draft` {} exceeds `max_draft` {}",
                self.initial_draft, self.max_draft
            ));
        }
        if self.max_draft > MAX_DRAFT_TOKENS {
            return Err(format!(
                "`max_draft` must be at most {MAX_DRAFT_TOKENS}, got {}",
                self.max_draft
            ));
        }
        Ok(())
    }
}

/// The longest draft any sequence may ask for.
pub const MAX_DRAFT_TOKENS: usize = 32;

/// How a sequence's draft length evolves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DraftSchedule {
    /// Always `initial_draft` (capped by the step's plan).
    Constant,
    /// Chosen every step by the engine's cost model, 0 to `max_draft`: the
    /// length that maximises expected tokens per unit of step time, from
    /// the sequence's measured acceptance by position and the measured cost
    /// of the step (until the step is measured, from cost priors, at most
    /// `initial_draft`).
    Adaptive,
}

/// What one sequence contributes to a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqWork {
    /// Feed positions `start..start + len` of the sequence: prompt tokens,
    /// or (recomputing after a preemption) prompt and generated tokens up
    /// to the last one. When a first prefill reaches the end of the prompt
    /// the first generated token is sampled in the same step.
    Prefill {
        slot: SlotId,
        start: usize,
        len: usize,
    },
    /// Feed the slot's last sampled token and sample the next one, with at
    /// most `max_drafts` draft tokens verified alongside (the scheduler
    /// counts them in the step's token budget; the engine may draft fewer).
    Decode { slot: SlotId, max_drafts: usize },
}

impl SeqWork {
    pub fn slot(&self) -> SlotId {
        match *self {
            SeqWork::Prefill { slot, .. } | SeqWork::Decode { slot, .. } => slot,
        }
    }

    /// The most tokens this item feeds: the chunk, or the decode token and
    /// every draft it may carry. What the step's token budget counts.
    pub fn max_tokens(&self) -> usize {
        match *self {
            SeqWork::Prefill { len, .. } => len,
            SeqWork::Decode { max_drafts, .. } => 1 + max_drafts,
        }
    }
}

/// The result of one [`StepPlan`].
#[derive(Debug, Clone, Default)]
pub struct StepOutcome {
    pub step: u64,
    /// One entry per admitted-but-failed slot and per `work` item, in plan order.
    pub seqs: Vec<SeqOutcome>,
    pub stats: StepStats,
}

/// What happened to one sequence this step.
#[derive(Debug, Clone)]
pub struct SeqOutcome {
    pub slot: SlotId,
    pub result: Result<SeqProgress, EngineError>,
}

/// Progress of a sequence in one step.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SeqProgress {
    /// Prompt tokens fed this step (0 for a decode).
    pub prefilled: usize,
    /// Tokens generated this step, in order (more than one with MTP).
    pub tokens: Vec<GeneratedToken>,
    /// Set when the engine ended the sequence; its slot is already freed.
    pub finish: Option<SeqFinish>,
    /// Draft tokens proposed for this sequence this step.
    pub drafted: usize,
    /// Draft tokens the target accepted (they are among `tokens`).
    pub accepted: usize,
}

/// A generated token and, when the request asked, its log-probabilities.
#[derive(Debug, Clone, PartialEq)]
pub struct GeneratedToken {
    pub id: u32,
    /// Log-probability of `id` under the model (raw logits, before any
    /// sampling transform); `None` unless the request asked for logprobs.
    pub logprob: Option<f32>,
    /// The request's `top_logprobs` most likely tokens, descending.
    pub top_logprobs: Vec<(u32, f32)>,
}

impl GeneratedToken {
    /// A token without log-probabilities.
    pub fn bare(id: u32) -> Self {
        Self {
            id,
            logprob: None,
            top_logprobs: Vec::new(),
        }
    }
}

/// Why the engine ended a sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqFinish {
    /// The sequence ended by its own rule: an end-of-sequence token or one
    /// of its stop ids was generated (it is the last token), or its
    /// grammar is complete.
    Eos,
    /// `max_new_tokens` were generated.
    Length,
    /// The sequence reached the context length.
    ContextFull,
}

/// Counters and timings of one step, for metrics and benchmarks.
#[derive(Debug, Clone, Default)]
pub struct StepStats {
    /// Sequences in the forward pass.
    pub batch_seqs: usize,
    /// Tokens in the forward pass (prefill chunks + decode tokens + drafts).
    pub batch_tokens: usize,
    /// Wall time of the model's forward pass and unembedding.
    pub forward: Duration,
    /// Wall time of the sampler call(s).
    pub sample: Duration,
    /// Wall time of the whole step inside the engine.
    pub total: Duration,
    /// Sampler calls that took the fused uniform path / the serial path.
    pub uniform_calls: u32,
    pub serial_calls: u32,
    /// Wall time spent drafting (speculative decoding).
    pub draft: Duration,
    /// Grammar masks computed this step, the worker's wall time for them
    /// (overlapped with the forward pass), and how long the step waited
    /// for the worker after the pass (the masks' cost on the critical path).
    pub masks: usize,
    pub mask: Duration,
    pub mask_wait: Duration,
    /// Draft tokens proposed / accepted this step, over all sequences.
    pub drafted: usize,
    pub accepted: usize,
}

/// Executes steps. The engine thread drives any implementation; the real
/// one is [`crate::engine::Engine`], tests may plug in a fake.
pub trait StepExecutor: Send + 'static {
    fn info(&self) -> EngineInfo;
    fn execute(&mut self, plan: StepPlan) -> StepOutcome;
}
