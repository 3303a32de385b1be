//! The sampler's side of MTP verification in sampled mode.
//!
//! The engine drafts k tokens for a slot, runs the target model over
//! `k + 1` positions and asks [`Sampler::speculative_distributions`] for
//! the distribution `sample` would draw from at each position — as if the
//! drafts before it had already been appended (penalties see them) — with
//! no state changed. It then draws the target's own token at each position
//! with [`Sampler::draw_at`] — the uniform of that position's generation
//! index, the one `sample` would use there — accepts the drafts that equal
//! those tokens, and [`Sampler::commit`]s what it keeps. `draw_at` walks
//! the distribution exactly as `sample` walks its kept tokens, so every
//! emitted token is the one sequential decoding would have emitted.

use candle_core::Tensor;
use rand::Rng;

use super::adjust::{RowAdjust, TokenMask};
use super::batched::fault;
use super::transform::{self, RowJob, RowScratch};
use super::{draw, host, Sampler, SamplerError, TokenLogprobs};
use crate::slot::SlotId;

impl Sampler {
    /// For each of the `T` rows of `logits` (`[T, V]`), the probability
    /// distribution over V that [`Sampler::sample`] would draw from for
    /// `slot` once `draft_prefix[..i]` had been appended to its history
    /// (a one-hot on the argmax for temperature 0). Needs
    /// `draft_prefix.len() >= T - 1`; later drafts are ignored. Changes
    /// nothing.
    pub fn speculative_distributions(
        &self,
        slot: SlotId,
        logits: &Tensor,
        draft_prefix: &[u32],
    ) -> Result<Vec<Vec<f32>>, SamplerError> {
        self.distributions_after(slot, logits, draft_prefix, 0, &[])
    }

    /// [`speculative_distributions`](Self::speculative_distributions) with
    /// row i under `masks[i]` (a grammar's mask after `draft_prefix[..i]`;
    /// rows past the masks are unmasked): what `sample_masked` would draw
    /// from at each position.
    pub fn speculative_distributions_masked(
        &self,
        slot: SlotId,
        logits: &Tensor,
        draft_prefix: &[u32],
        masks: &[TokenMask],
    ) -> Result<Vec<Vec<f32>>, SamplerError> {
        self.distributions_after(slot, logits, draft_prefix, 0, masks)
    }

    /// Like [`speculative_distributions`](Self::speculative_distributions)
    /// but row i sees `draft_prefix[..seen + i]`: the drafter's view, where
    /// one row of logits arrives after `seen` drafts were already chosen.
    pub fn draft_distributions(
        &self,
        slot: SlotId,
        logits: &Tensor,
        draft_prefix: &[u32],
        seen: usize,
    ) -> Result<Vec<Vec<f32>>, SamplerError> {
        self.distributions_after(slot, logits, draft_prefix, seen, &[])
    }

    fn distributions_after(
        &self,
        slot: SlotId,
        logits: &Tensor,
        draft_prefix: &[u32],
        seen: usize,
        masks: &[TokenMask],
    ) -> Result<Vec<Vec<f32>>, SamplerError> {
        let &r = self
            .index
            .get(&slot)
            .ok_or(SamplerError::UnknownSlot(slot))?;
        let state = &self.slots[r];
        let positions = logits.dims().first().copied().unwrap_or(0);
        let (t, vocab) = host::check_shape(logits, positions)?;
        if draft_prefix.len() + 1 < t + seen {
            return Err(SamplerError::DraftTooShort {
                positions: t + seen,
                drafts: draft_prefix.len(),
            });
        }
        let prefix = &draft_prefix[..(t + seen).saturating_sub(1)];
        if let Some(&token) = prefix.iter().find(|&&x| x as usize >= vocab) {
            return Err(SamplerError::VocabMismatch { slot, token, vocab });
        }
        // History oldest first, then the drafts: position i sees the last
        // `window` tokens of `seen[..base + i]`, the multiset the ring
        // would hold after committing i drafts.
        let skip = seen;
        let mut seen = Vec::new();
        let mut base = 0;
        let window = state.plan.penalty.window;
        let penalised = state.plan.uses_history();
        if penalised {
            self.pool.chronological(r, window, state.len, &mut seen);
            base = seen.len() + skip;
            seen.extend_from_slice(prefix);
        }

        host::with_host_f32(logits, |data| {
            let mut scratch = RowScratch::default();
            let mut out = Vec::with_capacity(t);
            for i in 0..t {
                let window = if penalised {
                    &seen[(base + i).saturating_sub(window)..base + i]
                } else {
                    &[][..]
                };
                let job = RowJob {
                    logits: &data[i * vocab..(i + 1) * vocab],
                    plan: &state.plan,
                    window,
                    adjust: RowAdjust {
                        bias: state.bias.pairs(),
                        mask: masks.get(i),
                    },
                };
                let mut dist = vec![0.0f32; vocab];
                transform::distribution_row(job, &mut scratch, &mut dist)
                    .map_err(|f| fault(f, slot, i, vocab))?;
                out.push(dist);
            }
            Ok(out)
        })
    }

    /// Appends accepted tokens to `slot`'s history, in order, without
    /// drawing anything; the slot's generation index moves past them. Ids
    /// are checked against the vocabulary at the next call that brings
    /// logits for this slot.
    pub fn commit(&mut self, slot: SlotId, tokens: &[u32]) -> Result<(), SamplerError> {
        let &r = self
            .index
            .get(&slot)
            .ok_or(SamplerError::UnknownSlot(slot))?;
        let state = &mut self.slots[r];
        state.drawn += tokens.len() as u64;
        if state.plan.uses_history() {
            for &token in tokens {
                self.pool
                    .write(r, state.plan.penalty.window, state.len, token);
                state.len += 1;
            }
        }
        Ok(())
    }

    /// Draws an index from `probs` (non-negative weights, not necessarily
    /// normalised) with the uniform of `slot`'s token `offset` positions
    /// past its next one: inverse CDF in index order, as `sample` does, so
    /// `draw_at(slot, 0, p)` over the distribution `sample` would use picks
    /// the very token `sample` picks. Changes nothing.
    pub fn draw_at(&self, slot: SlotId, offset: usize, probs: &[f32]) -> Result<u32, SamplerError> {
        let &r = self
            .index
            .get(&slot)
            .ok_or(SamplerError::UnknownSlot(slot))?;
        if let Some((i, p)) = probs
            .iter()
            .enumerate()
            .find(|(_, p)| !p.is_finite() || **p < 0.0)
        {
            return Err(SamplerError::InvalidProbs {
                reason: format!("entry {i} is {p}; weights must be finite and >= 0"),
            });
        }
        if u32::try_from(probs.len()).is_err() {
            return Err(SamplerError::InvalidProbs {
                reason: format!("{} entries exceed the u32 token id range", probs.len()),
            });
        }
        let u = self.slots[r].stream_at(offset as u64).random::<f64>();
        draw::draw_dense(u, probs, &mut Vec::new())
            .map(|i| i as u32)
            .ok_or_else(|| SamplerError::InvalidProbs {
                reason: format!("all {} weights are zero", probs.len()),
            })
    }

    /// The log-probability of `tokens[i]` under row `i` of `logits`
    /// (`[T, V]`, `T >= tokens.len()`) and that row's `top_logprobs` most
    /// likely tokens: what `sample` reports for `slot` when its options ask
    /// for logprobs (raw logits, the same arithmetic), for tokens emitted
    /// by speculative verification. Empty when the slot did not ask.
    pub fn logprobs_at(
        &self,
        slot: SlotId,
        logits: &Tensor,
        tokens: &[u32],
    ) -> Result<Vec<TokenLogprobs>, SamplerError> {
        let &r = self
            .index
            .get(&slot)
            .ok_or(SamplerError::UnknownSlot(slot))?;
        let options = &self.slots[r].options;
        if !options.logprobs {
            return Ok(Vec::new());
        }
        let positions = logits.dims().first().copied().unwrap_or(0);
        let (t, vocab) = host::check_shape(logits, positions)?;
        if tokens.len() > t {
            return Err(SamplerError::LogitsShape {
                reason: format!("{} tokens for {t} rows of logits", tokens.len()),
            });
        }
        if let Some(&token) = tokens.iter().find(|&&x| x as usize >= vocab) {
            return Err(SamplerError::VocabMismatch { slot, token, vocab });
        }
        let k = options.top_logprobs.min(vocab);
        host::with_host_f32(logits, |data| {
            let mut scratch = RowScratch::default();
            let rows = tokens.iter().enumerate().map(|(i, &token)| {
                let mut top = vec![(0, 0.0); k];
                let row = &data[i * vocab..(i + 1) * vocab];
                let lp = transform::logprobs_row(row, token, &mut top, &mut scratch);
                (lp, top)
            });
            Ok(rows.collect())
        })
    }
}
