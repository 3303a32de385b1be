//! What a row's logits become before the transform chain sees them: the
//! slot's `logit_bias` added, then the step's grammar mask applied
//! (disallowed tokens set to `-inf`).
//!
//! Both run first in the chain, before penalties and truncation, so a
//! masked token can never be drawn, whatever the penalties, top-k, top-p
//! or min-p do afterwards: its score is `-inf`, its probability exactly 0,
//! and greedy never picks it because some allowed token keeps a finite
//! score (a row whose mask leaves no finite score is a
//! [`RowFault::NoFiniteLogit`](super::transform::RowFault), never a silent
//! pick).
//!
//! Logprobs are reported from the raw logits (the model's view), as
//! OpenAI does for `logit_bias`.

use std::sync::Arc;

/// The allowed tokens of one row: bit `t % 32` of word `t / 32` is set when
/// token `t` may be sampled (the layout of llguidance's `SimpleVob`, so a
/// grammar's mask is copied word for word). Tokens past the last word are
/// disallowed: a model whose logits are wider than the tokenizer's
/// vocabulary (padded embeddings) never samples the padding.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TokenMask {
    words: Vec<u32>,
}

impl TokenMask {
    /// A mask from its bit words (see the type's docs for the layout).
    pub fn from_words(words: Vec<u32>) -> Self {
        Self { words }
    }

    /// A mask that allows exactly `tokens`.
    pub fn allowing(tokens: &[u32]) -> Self {
        let len = tokens.iter().max().map_or(0, |&t| t as usize / 32 + 1);
        let mut words = vec![0u32; len];
        for &t in tokens {
            words[t as usize / 32] |= 1 << (t % 32);
        }
        Self { words }
    }

    /// Whether `token` may be sampled.
    pub fn allows(&self, token: u32) -> bool {
        self.words
            .get(token as usize / 32)
            .is_some_and(|w| w & (1 << (token % 32)) != 0)
    }

    /// Also allows `token` (the engine adds every EOS id when the grammar
    /// allows its own).
    pub fn allow(&mut self, token: u32) {
        let word = token as usize / 32;
        if self.words.len() <= word {
            self.words.resize(word + 1, 0);
        }
        self.words[word] |= 1 << (token % 32);
    }

    /// The bit words (for the device upload).
    pub fn words(&self) -> &[u32] {
        &self.words
    }

    /// Sets every disallowed score of `scores` to `-inf`, a word at a time.
    pub(crate) fn apply(&self, scores: &mut [f32]) {
        for (w, chunk) in scores.chunks_mut(32).enumerate() {
            let bits = self.words.get(w).copied().unwrap_or(0);
            if bits == u32::MAX {
                continue;
            }
            for (b, s) in chunk.iter_mut().enumerate() {
                if bits & (1 << b) == 0 {
                    *s = f32::NEG_INFINITY;
                }
            }
        }
    }
}

/// A slot's `logit_bias`: `(token, bias)` pairs added to the raw logits
/// before anything else, ids sorted and unique. Shared, since it is fixed
/// for the life of the slot.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LogitBias(Arc<[(u32, f32)]>);

impl LogitBias {
    /// A bias from pairs; a repeated id keeps its last value. Values are
    /// checked by the caller (the HTTP edge: finite, in [-100, 100]).
    pub fn new(pairs: impl IntoIterator<Item = (u32, f32)>) -> Self {
        let mut v: Vec<(u32, f32)> = pairs.into_iter().collect();
        // Stable: among equal ids the last given comes last; keep it.
        v.sort_by_key(|&(t, _)| t);
        let mut out: Vec<(u32, f32)> = Vec::with_capacity(v.len());
        for (t, b) in v {
            match out.last_mut() {
                Some(last) if last.0 == t => last.1 = b,
                _ => out.push((t, b)),
            }
        }
        Self(out.into())
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn pairs(&self) -> &[(u32, f32)] {
        &self.0
    }

    /// The largest biased id, for the vocabulary check.
    pub fn max_token(&self) -> Option<u32> {
        self.0.last().map(|&(t, _)| t)
    }
}

/// One row's adjustment: the slot's bias and this step's mask.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct RowAdjust<'a> {
    pub bias: &'a [(u32, f32)],
    pub mask: Option<&'a TokenMask>,
}

impl RowAdjust<'_> {
    pub(crate) fn is_identity(&self) -> bool {
        self.bias.is_empty() && self.mask.is_none()
    }

    /// Adds the bias and applies the mask to `scores` (a copy of the raw
    /// row). Returns the first biased id outside the row, if any.
    pub(crate) fn apply(&self, scores: &mut [f32]) -> Result<(), u32> {
        for &(t, b) in self.bias {
            let s = scores.get_mut(t as usize).ok_or(t)?;
            // A large positive bias on a large logit must not reach +inf,
            // which would poison the softmax.
            *s = (*s + b).min(f32::MAX);
        }
        if let Some(mask) = self.mask {
            mask.apply(scores);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mask_bits_follow_the_vob_layout() {
        let m = TokenMask::allowing(&[0, 31, 32, 70]);
        assert_eq!(m.words(), &[1 | (1 << 31), 1, 1 << 6]);
        assert!(m.allows(70) && !m.allows(69) && !m.allows(1000));
        let mut s = vec![1.0f32; 100];
        m.apply(&mut s);
        let kept: Vec<usize> = (0..100).filter(|&i| s[i].is_finite()).collect();
        assert_eq!(
            kept,
            vec![0, 31, 32, 70],
            "padding past the words is masked too"
        );
    }

    #[test]
    fn bias_sorts_dedups_and_checks_the_row() {
        let b = LogitBias::new([(5, 1.0), (2, -1.0), (5, 3.0)]);
        assert_eq!(b.pairs(), &[(2, -1.0), (5, 3.0)]);
        let adj = RowAdjust {
            bias: b.pairs(),
            mask: None,
        };
        let mut s = vec![0.0f32; 6];
        adj.apply(&mut s).unwrap();
        assert_eq!(s, vec![0.0, 0.0, -1.0, 0.0, 0.0, 3.0]);
        assert_eq!(adj.apply(&mut [0.0; 4]), Err(5));
    }
}
