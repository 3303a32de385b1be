//! The sampler's side of MTP verification in sampled mode.
//!
//! The engine drafts k tokens for a slot, runs the target model over
//! `k + 1` positions and asks [`Sampler::speculative_distributions`] for
//! the distribution `sample` would draw from at each position — as if the
//! drafts before it had already been appended (penalties see them) — with
//! no state changed. It then accepts draft `d_i` with probability
//! `min(1, p_i(d_i) / q_i(d_i))` using [`Sampler::uniform`], on rejection
//! draws from the normalised residual `max(0, p − q)` with
//! [`Sampler::draw`], and finally [`Sampler::commit`]s the accepted tokens.
//! Both draws use the slot's own RNG, so a seeded request stays
//! reproducible. `draw` walks the distribution exactly as `sample` walks
//! its kept tokens, so drawing from position 0's distribution picks the
//! very token `sample` would have picked from the same RNG state.

use candle_core::Tensor;
use rand::Rng;

use super::adjust::{RowAdjust, TokenMask};
use super::batched::fault;
use super::transform::{self, RowJob, RowScratch};
use super::{draw, host, Sampler, SamplerError};
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
    /// drawing anything. Ids are checked against the vocabulary at the
    /// next call that brings logits for this slot.
    pub fn commit(&mut self, slot: SlotId, tokens: &[u32]) -> Result<(), SamplerError> {
        let &r = self
            .index
            .get(&slot)
            .ok_or(SamplerError::UnknownSlot(slot))?;
        let state = &mut self.slots[r];
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
    /// normalised — a residual `max(0, p − q)` is fine) with `slot`'s RNG:
    /// one uniform, inverse CDF in index order, as `sample` does.
    pub fn draw(&mut self, slot: SlotId, probs: &[f32]) -> Result<u32, SamplerError> {
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
        if !probs.iter().any(|&p| p > 0.0) {
            return Err(SamplerError::InvalidProbs {
                reason: format!("all {} weights are zero", probs.len()),
            });
        }
        let u = self.slots[r].rng.random::<f64>();
        let pick = draw::draw_dense(u, probs, &mut Vec::new());
        pick.map(|i| i as u32)
            .ok_or_else(|| SamplerError::InvalidProbs {
                reason: "the weights sum to zero".into(),
            })
    }

    /// A uniform number in `[0, 1)` from `slot`'s RNG (for the
    /// `min(1, p/q)` acceptance test).
    pub fn uniform(&mut self, slot: SlotId) -> Result<f32, SamplerError> {
        let &r = self
            .index
            .get(&slot)
            .ok_or(SamplerError::UnknownSlot(slot))?;
        Ok(self.slots[r].rng.random::<f32>())
    }
}
