//! Draft heads: what proposes the tokens a sequence speculates on.
//!
//! A [`DraftHead`] drafts the next token for many sequences at once (one
//! call per draft round, batched across every drafting sequence of the
//! step). Heads may write into the target's KV cache at the positions they
//! draft (the early-exit head does, for its layers); the engine rolls each
//! slot back before the verifying pass rewrites those positions.

use candle_core::Tensor;

use crate::engine::SlotId;
use crate::kv::KvCache;
use crate::model::{Batch, DraftLogits, Model, ModelError, MtpHead, OutputRows};

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

impl DraftInput {
    /// Rows the input feeds a round: its token, after the pairs of its
    /// hidden context.
    pub fn rows(&self) -> usize {
        1 + self.context.as_ref().map_or(0, |c| c.tokens.len())
    }
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

    /// [`draft`](Self::draft) as [`DraftLogits`]: a head with a reduced
    /// draft vocabulary returns its own rows, so greedy drafts never
    /// leave the device as whole-vocabulary distributions.
    fn draft_logits(
        &mut self,
        model: &Model,
        kv: &mut KvCache,
        inputs: &[DraftInput],
    ) -> Result<DraftLogits, ModelError> {
        Ok(DraftLogits::full(self.draft(model, kv, inputs)?))
    }

    /// CUDA graphs the head has captured since load: a round that
    /// captured one ran twice (eagerly, then under capture), a one-off the
    /// draft policy does not take as a round's cost.
    fn graph_captures(&self) -> u64 {
        0
    }

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
/// back its projected hidden state. A head with a draft vocabulary returns
/// `-inf` outside it, so its drafts never leave it.
pub struct MtpDraft {
    pub head: MtpHead,
}

impl DraftHead for MtpDraft {
    fn name(&self) -> String {
        match self.head.draft_vocab_len() {
            Some(n) => format!("mtp-head (draft vocabulary {n})"),
            None => "mtp-head".into(),
        }
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
        kv: &mut KvCache,
        inputs: &[DraftInput],
    ) -> Result<Tensor, ModelError> {
        self.draft_logits(model, kv, inputs)?.widened_all()
    }

    fn draft_logits(
        &mut self,
        model: &Model,
        _kv: &mut KvCache,
        inputs: &[DraftInput],
    ) -> Result<DraftLogits, ModelError> {
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
        self.head.step_logits(model, &batch, hidden.as_ref())
    }

    fn graph_captures(&self) -> u64 {
        self.head.cuda_graph_stats().captures
    }

    fn end_rounds(&mut self, slot: SlotId, position: usize) -> Result<(), ModelError> {
        self.head.truncate(slot, position)
    }
}
