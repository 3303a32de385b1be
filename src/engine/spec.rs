//! Speculative (MTP) decoding inside the batched step.
//!
//! Every step, sequences with speculation on draft `k_i` tokens with a
//! [`DraftHead`] (the draft rounds themselves batched across those
//! sequences), then the step's single forward pass carries, for each of
//! them, its current token plus its drafts next to the plain decodes and
//! prefill chunks. Verification uses one rule for greedy and sampled
//! requests: with `p` the target's sampling distribution (after penalties
//! and truncation, from [`Sampler::speculative_distributions`]) and `q` the
//! draft's, draft `d` is accepted with probability `min(1, p(d) / q(d))`; on
//! rejection the token is drawn from the normalised residual `max(0, p − q)`;
//! when every draft is accepted a bonus token is drawn from the last `p`.
//! For greedy requests `p` and `q` are one-hot, so this reduces to "accept
//! the longest argmax-matching prefix, then the target's token", with no
//! randomness at all: greedy output is exactly plain greedy output. Plain
//! greedy requests (no penalty) take that shortcut literally: their drafts
//! and their verification come from [`Sampler::argmax_rows`] (ids only,
//! one kernel launch on a GPU) instead of full distributions.
//!
//! Draft heads may write into the target's KV cache at the positions they
//! draft (the early-exit head does, for its layers); the engine rolls each
//! slot back before the verifying pass rewrites those positions.

use candle_core::Tensor;

use crate::engine::{DraftSchedule, SlotId, SpecOptions};
use crate::kv::KvCache;
use crate::model::{Batch, Model, ModelError, MtpHead, OutputRows};
use crate::sampler::{Sampler, SamplerError};

/// One sequence's input to a draft round.
#[derive(Debug, Clone)]
pub struct DraftInput {
    pub slot: SlotId,
    /// The token whose successor is drafted.
    pub token: u32,
    /// Its position in the sequence. In round 0 it equals the slot's target
    /// KV length; round r drafts the token at `position + 1`.
    pub position: usize,
    /// 0 for the first round of a step.
    pub round: usize,
    /// Round 0 of a head that [`needs_hidden`](DraftHead::needs_hidden): the
    /// target's hidden states the head has not consumed yet.
    pub context: Option<HiddenContext>,
}

/// Target hidden states `h_t` for positions `position - m .. position` and
/// the tokens `x_{t+1}` that followed them (all but the last, which is the
/// input's `token`).
#[derive(Debug, Clone)]
pub struct HiddenContext {
    /// `[m, hidden]`, pre-final-norm.
    pub hidden: Tensor,
    /// `m - 1` tokens, at positions `position - m + 1 .. position`.
    pub tokens: Vec<u32>,
}

/// A draft model: proposes the next token for many sequences at once.
pub trait DraftHead: Send {
    /// A short description for logs and reports.
    fn name(&self) -> String;

    /// Whether round 0 needs the target's hidden states ([`HiddenContext`]).
    fn needs_hidden(&self) -> bool {
        false
    }

    /// A sequence joins (its KV may grow to `reserve` positions).
    fn admit(&mut self, _slot: SlotId, _reserve: usize) -> Result<(), ModelError> {
        Ok(())
    }

    /// A sequence leaves.
    fn release(&mut self, _slot: SlotId) {}

    /// One draft round: logits `[inputs.len(), vocab]` (f32) of the token
    /// that follows each input's `token`. May write the target's KV cache at
    /// the drafted positions (the engine restores each slot's length).
    fn draft(
        &mut self,
        model: &Model,
        kv: &mut KvCache,
        inputs: &[DraftInput],
    ) -> Result<Tensor, ModelError>;

    /// The step's draft rounds are over for `slot`, whose target KV holds
    /// `position` tokens: forget any speculative state past it.
    fn end_rounds(&mut self, _slot: SlotId, _position: usize) -> Result<(), ModelError> {
        Ok(())
    }
}

/// Self-speculative early exit: the target's first `layers` layers, then
/// its final norm and unembedding. Needs no extra weights, works for any
/// model; with `layers` equal to the model's depth it is a perfect draft.
#[derive(Debug, Clone, Copy)]
pub struct EarlyExitDraft {
    pub layers: usize,
}

impl DraftHead for EarlyExitDraft {
    fn name(&self) -> String {
        format!("early-exit:{}", self.layers)
    }

    fn draft(
        &mut self,
        model: &Model,
        kv: &mut KvCache,
        inputs: &[DraftInput],
    ) -> Result<Tensor, ModelError> {
        let mut batch = Batch::default();
        for i in inputs {
            batch.push(i.slot, i.position, &[i.token], OutputRows::Last);
        }
        let hidden = model.forward_layers(&batch, kv, self.layers)?;
        model.unembed(&hidden)
    }
}

/// A trained DeepSeek-style MTP head ([`MtpHead`]) as a draft: round 0
/// consumes every pending `(h_t, x_{t+1})` pair of the sequence (prompt,
/// accepted tokens) so the head's own KV stays complete, later rounds feed
/// back its projected hidden state.
pub struct MtpDraft {
    pub head: MtpHead,
}

impl DraftHead for MtpDraft {
    fn name(&self) -> String {
        "mtp-head".into()
    }

    fn needs_hidden(&self) -> bool {
        true
    }

    fn admit(&mut self, slot: SlotId, reserve: usize) -> Result<(), ModelError> {
        self.head.admit(slot, reserve)
    }

    fn release(&mut self, slot: SlotId) {
        self.head.release(slot)
    }

    fn draft(
        &mut self,
        model: &Model,
        _kv: &mut KvCache,
        inputs: &[DraftInput],
    ) -> Result<Tensor, ModelError> {
        let mut batch = Batch::default();
        let mut hidden = Vec::new();
        for i in inputs {
            let start = self.head.len(i.slot)?;
            match &i.context {
                Some(ctx) => {
                    let tokens: Vec<u32> = ctx.tokens.iter().copied().chain([i.token]).collect();
                    if start + tokens.len() != i.position {
                        return Err(ModelError::InvalidBatch(format!(
                            "slot {}: the head holds {start} positions but {} pairs lead to position {}",
                            i.slot,
                            tokens.len(),
                            i.position
                        )));
                    }
                    batch.push(i.slot, start, &tokens, OutputRows::Last);
                    hidden.push(ctx.hidden.clone());
                }
                None => batch.push(i.slot, start, &[i.token], OutputRows::Last),
            }
        }
        let given = inputs.iter().filter(|i| i.context.is_some()).count();
        if given != 0 && given != inputs.len() {
            return Err(ModelError::InvalidBatch(
                "a draft round mixes sequences with and without hidden context".into(),
            ));
        }
        let hidden = if given == 0 {
            None
        } else {
            Some(Tensor::cat(&hidden, 0)?)
        };
        self.head.step(model, &batch, hidden.as_ref())
    }

    fn end_rounds(&mut self, slot: SlotId, position: usize) -> Result<(), ModelError> {
        self.head.truncate(slot, position)
    }
}

/// Engine-wide speculation settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpecConfig {
    /// What a request that does not say gets.
    pub default: SpecOptions,
    /// When more sequences than this decode in one step, nobody drafts: a
    /// large batch is compute-bound, and drafts would cost more than they
    /// save.
    pub max_batch: usize,
    /// Debug: re-verify greedy drafts one token at a time and log the first
    /// disagreement with the batched verification (the seed's compare mode).
    pub compare_serial: bool,
    /// Test-only: accept every draft unchecked. This is a deliberately wrong
    /// rule; the distribution test uses it to show that it can fail.
    #[doc(hidden)]
    pub unchecked_accept: bool,
}

impl Default for SpecConfig {
    fn default() -> Self {
        Self {
            default: SpecOptions::default(),
            max_batch: 8,
            compare_serial: false,
            unchecked_accept: false,
        }
    }
}

/// A sequence's speculation state (engine side).
///
/// NOTE: two policies decide when a sequence drafts: the step's batch-size
/// policy and a per-sequence back-off that pauses drafting while it does not
/// pay (fewer tokens per speculative step than the step's measured cost
/// ratio). Both depend on the rest of the batch or on timings. That is
/// harmless for greedy requests (drafts never change their output) but a
/// seeded sampled request must not depend on them, since drafts consume its
/// RNG: such a sequence is *pinned* and drafts on its own schedule only.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SeqSpec {
    pub options: SpecOptions,
    /// Draft length of the next speculative step.
    pub draft_len: usize,
    /// Seeded sampled request: drafting ignores batch and timing policies.
    pinned: bool,
    /// Speculative steps and tokens they produced, in the current window.
    window_steps: usize,
    window_tokens: usize,
    /// Decode steps left without drafting, and the next pause's length.
    paused: usize,
    backoff: usize,
}

/// Speculative steps per back-off decision.
const WINDOW_STEPS: usize = 8;
const MIN_BACKOFF: usize = 8;
const MAX_BACKOFF: usize = 256;

impl SeqSpec {
    pub fn new(options: SpecOptions, pinned: bool) -> Self {
        Self {
            options,
            draft_len: options.initial_draft.max(1),
            pinned,
            window_steps: 0,
            window_tokens: 0,
            paused: 0,
            backoff: MIN_BACKOFF,
        }
    }

    /// Drafts this sequence wants in the coming decode step.
    pub fn next_draft(&mut self, step_allows: bool) -> usize {
        if self.pinned {
            return self.draft_len;
        }
        if !step_allows {
            return 0;
        }
        if self.paused > 0 {
            self.paused -= 1;
            return 0;
        }
        self.draft_len
    }

    /// After a speculative step that accepted `accepted` of `drafted`:
    /// the draft-length schedule, then the back-off against `cost` (what a
    /// speculative step costs relative to a plain one).
    pub fn update(&mut self, drafted: usize, accepted: usize, cost: f64) {
        if self.options.schedule == DraftSchedule::Heuristic {
            self.draft_len = if accepted == drafted {
                (self.draft_len + 2).min(self.options.max_draft)
            } else {
                self.draft_len.saturating_sub(1).max(1)
            };
        }
        if self.pinned {
            return;
        }
        self.window_steps += 1;
        self.window_tokens += 1 + accepted;
        if self.window_steps >= WINDOW_STEPS {
            let tokens_per_step = self.window_tokens as f64 / self.window_steps as f64;
            if tokens_per_step < cost {
                self.paused = self.backoff;
                self.backoff = (2 * self.backoff).min(MAX_BACKOFF);
            } else {
                self.backoff = MIN_BACKOFF;
            }
            self.window_steps = 0;
            self.window_tokens = 0;
        }
    }
}

/// Drafts chosen for one sequence and the draft distributions they came from.
#[derive(Debug, Default, Clone)]
pub(crate) struct Drafts {
    pub tokens: Vec<u32>,
    /// `q_i`: what draft i was drawn from (one-hot for greedy requests;
    /// empty for plain greedy ones, which verify from ids alone).
    pub probs: Vec<Vec<f32>>,
}

fn argmax(p: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in p.iter().enumerate() {
        if v > p[best] {
            best = i;
        }
    }
    best as u32
}

/// Picks a token from a distribution the way the request samples: greedy
/// requests take the argmax (no randomness), others draw with their RNG.
pub(crate) fn pick(
    sampler: &mut Sampler,
    slot: SlotId,
    greedy: bool,
    dist: &[f32],
) -> Result<u32, SamplerError> {
    if greedy {
        Ok(argmax(dist))
    } else {
        sampler.draw(slot, dist)
    }
}

/// Verifies `drafts` against the target's logits `[k + 1, vocab]` (row i
/// predicts the token after draft i, row 0 after the current token).
/// Returns how many drafts were accepted and the token that follows them.
/// Commits nothing.
pub(crate) fn verify(
    sampler: &mut Sampler,
    slot: SlotId,
    greedy: bool,
    logits: &Tensor,
    drafts: &Drafts,
    unchecked: bool,
) -> Result<(usize, u32), SamplerError> {
    if greedy && sampler.is_plain_greedy(slot) {
        // p_i is one-hot on row i's first maximum a_i and q_i one-hot on
        // d_i, so the rule reduces to: accept while d_i == a_i, then a_i.
        // Only the ids are needed (on a GPU only they leave the device).
        let rows = logits
            .dim(0)
            .map_err(|e| SamplerError::Tensor(e.to_string()))?;
        let ids = sampler.argmax_rows(&vec![slot; rows], logits)?;
        let k = drafts.tokens.len();
        let accepted = if unchecked {
            k
        } else {
            drafts
                .tokens
                .iter()
                .zip(&ids)
                .take_while(|(d, a)| d == a)
                .count()
        };
        return Ok((accepted, ids[accepted]));
    }
    let p = sampler.speculative_distributions(slot, logits, &drafts.tokens)?;
    if unchecked {
        let k = drafts.tokens.len();
        return Ok((k, pick(sampler, slot, greedy, &p[k])?));
    }
    for (i, (&d, q)) in drafts.tokens.iter().zip(&drafts.probs).enumerate() {
        let (pd, qd) = (p[i][d as usize], q[d as usize]);
        let accept = if pd >= qd {
            true
        } else if pd <= 0.0 {
            false
        } else {
            sampler.uniform(slot)? < pd / qd
        };
        if !accept {
            let residual: Vec<f32> = p[i].iter().zip(q).map(|(a, b)| (a - b).max(0.0)).collect();
            let dist = if residual.iter().any(|&r| r > 0.0) {
                &residual
            } else {
                &p[i]
            };
            return Ok((i, pick(sampler, slot, greedy, dist)?));
        }
    }
    let k = drafts.tokens.len();
    Ok((k, pick(sampler, slot, greedy, &p[k])?))
}
