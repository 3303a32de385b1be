//! Prompt lookup: an n-gram drafter with no weights (llama.cpp's and vLLM's
//! n-gram speculation).
//!
//! It proposes the tokens that followed the most recent earlier occurrence
//! of the sequence's last `n` tokens, for the longest `n` in
//! `min_n..=max_n` that occurs, searching the prompt and the generated text
//! together. Summaries, code edits, RAG answers and structured output copy
//! long spans of their context, and there such drafts are accepted whole.
//! A proposal costs one backwards scan of the history: no model call, no
//! draft round.
//!
//! A proposal names the length of the suffix it matched (its *order*): a
//! continuation after a recurring 4-gram is far likelier to be copied than
//! one after a single recurring token, and the draft policy keeps each
//! order's acceptance apart, so a short match drafts only where it has paid.

/// Prompt-lookup settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PromptLookup {
    /// Shortest suffix that may be matched.
    pub min_n: usize,
    /// Longest suffix tried first.
    pub max_n: usize,
}

impl Default for PromptLookup {
    /// Single-token matches included: the policy learns, per sequence and
    /// order, whether they pay (on issue 18's edit prompts they add about
    /// a tenth of the accepted tokens at a third the acceptance).
    fn default() -> Self {
        Self { min_n: 1, max_n: 4 }
    }
}

/// A prompt-lookup draft: the continuation of a match of `order` tokens.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Proposal {
    /// Length of the matched suffix (`min_n..=max_n`; 0 when empty).
    pub order: usize,
    pub tokens: Vec<u32>,
}

impl PromptLookup {
    /// Checks the lengths; the message names the field.
    pub fn validate(&self) -> Result<(), String> {
        if self.min_n == 0 || self.min_n > self.max_n {
            return Err(format!(
                "prompt lookup needs 1 <= min_n <= max_n, got min_n {} and max_n {}",
                self.min_n, self.max_n
            ));
        }
        Ok(())
    }

    /// Up to `max` tokens continuing `history` (prompt, then generated
    /// tokens, ending with the token whose successor is drafted): what
    /// followed the latest earlier occurrence of the longest matching
    /// suffix, and that suffix's length. Empty when no suffix of `min_n`
    /// tokens recurs.
    pub fn propose(&self, history: &[u32], max: usize) -> Proposal {
        if max == 0 {
            return Proposal::default();
        }
        match longest_latest_match(history, self.min_n, self.max_n) {
            Some((order, start)) => Proposal {
                order,
                tokens: history[start..(start + max).min(history.len())].to_vec(),
            },
            None => Proposal::default(),
        }
    }
}

/// The longest `n` in `min_n..=max_n` whose last-`n`-token suffix of
/// `history` occurred earlier, and where the continuation of its latest
/// earlier occurrence starts (the position right after it; at least one
/// token must follow). One backwards scan for every `n` at once: each
/// earlier position is scored by how many tokens before it match the
/// suffix, and most fail on the first.
fn longest_latest_match(history: &[u32], min_n: usize, max_n: usize) -> Option<(usize, usize)> {
    let len = history.len();
    let last = *history.last()?;
    let mut best: Option<(usize, usize)> = None;
    // `end`: where an occurrence ends (exclusive), its continuation's start.
    for end in (1..len).rev() {
        if history[end - 1] != last {
            continue;
        }
        let most = max_n.min(end);
        let n = 1
            + (1..most)
                .take_while(|&k| history[end - 1 - k] == history[len - 1 - k])
                .count();
        if n >= min_n && best.is_none_or(|(b, _)| n > b) {
            best = Some((n, end));
            if n == max_n {
                break;
            }
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proposes_the_continuation_of_the_longest_latest_match() {
        let pl = PromptLookup { min_n: 1, max_n: 3 };
        let tokens = |h: &[u32], max| pl.propose(h, max).tokens;
        // "1 2 3 4 5 … 1 2 3": the 3-gram recurs, its continuation is 4 5.
        assert_eq!(
            pl.propose(&[1, 2, 3, 4, 5, 9, 1, 2, 3], 2),
            Proposal {
                order: 3,
                tokens: vec![4, 5]
            }
        );
        // The continuation is cut at `max` and at the end of the history.
        assert_eq!(
            tokens(&[1, 2, 3, 4, 5, 9, 1, 2, 3], 8),
            vec![4, 5, 9, 1, 2, 3]
        );
        // The latest occurrence wins: "7 8" followed by 1 then by 2.
        assert_eq!(tokens(&[7, 8, 1, 7, 8, 2, 7, 8], 1), vec![2]);
        // A longer match beats a later shorter one.
        assert_eq!(tokens(&[5, 6, 7, 1, 9, 7, 2, 5, 6, 7], 1), vec![1]);
        // Only one token recurs: an order-1 proposal.
        assert_eq!(pl.propose(&[4, 8, 6, 4], 2).order, 1);
    }

    #[test]
    fn nothing_without_a_recurring_suffix() {
        let pl = PromptLookup { min_n: 2, max_n: 4 };
        let tokens = |h: &[u32], max| pl.propose(h, max).tokens;
        assert!(tokens(&[1, 2, 3, 4], 4).is_empty());
        assert_eq!(pl.propose(&[], 4), Proposal::default());
        assert!(
            tokens(&[3, 3], 4).is_empty(),
            "min_n 2 needs a 2-gram before the suffix"
        );
        assert_eq!(tokens(&[3, 3, 3], 4), vec![3]);
        assert!(tokens(&[1, 2, 1, 2], 0).is_empty());
        assert_eq!(PromptLookup::default().propose(&[3, 3], 4).tokens, vec![3]);
        assert!(PromptLookup { min_n: 0, max_n: 2 }.validate().is_err());
        assert!(PromptLookup { min_n: 3, max_n: 2 }.validate().is_err());
    }

    /// The definition, one scan per suffix length (longest first).
    fn reference(pl: &PromptLookup, history: &[u32], max: usize) -> Proposal {
        let len = history.len();
        for n in (pl.min_n..=pl.max_n).rev() {
            if max == 0 || len <= n {
                continue;
            }
            let suffix = &history[len - n..];
            if let Some(i) = (0..len - n).rev().find(|&i| &history[i..i + n] == suffix) {
                let start = i + n;
                return Proposal {
                    order: n,
                    tokens: history[start..(start + max).min(len)].to_vec(),
                };
            }
        }
        Proposal::default()
    }

    #[test]
    fn one_scan_finds_what_a_scan_per_length_finds() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        for case in 0..4000 {
            let len = rng.random_range(0..40);
            let alphabet = rng.random_range(1..6);
            let history: Vec<u32> = (0..len).map(|_| rng.random_range(0..alphabet)).collect();
            let min_n = rng.random_range(1..4);
            let pl = PromptLookup {
                min_n,
                max_n: min_n + rng.random_range(0..4),
            };
            let max = rng.random_range(0..6);
            assert_eq!(
                pl.propose(&history, max),
                reference(&pl, &history, max),
                "case {case}: {pl:?} over {history:?}, max {max}"
            );
        }
    }
}
