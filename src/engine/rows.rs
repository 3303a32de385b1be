//! The step's row layout: planned work → the ragged [`Batch`] the forward
//! pass consumes, plus a row map saying which hidden-state and logit rows
//! belong to which sequence. Pure: no tensors, no model.
//!
//! Rows are assigned in plan order. A sequence gets hidden rows for
//! - every position when it verifies drafts (the logits of each) or when
//!   the KV cache stores every position's hidden state (`store_hidden`);
//! - its last position when that position samples (a decode, the prompt's
//!   last chunk);
//! - none otherwise (a prefill chunk mid-prompt).
//!
//! Its logit rows are all of its hidden rows when it verifies drafts, its
//! last hidden row when it samples plainly, none otherwise. Plain sampling
//! rows go to one sampler call together, in plan order.

use std::ops::Range;

use crate::engine::SlotId;
use crate::model::{Batch, OutputRows};

/// One sequence's share of the step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RowRequest<'a> {
    pub slot: SlotId,
    /// Position of the first fed token (the slot's KV length).
    pub offset: usize,
    /// Fed tokens: a prompt chunk, or the last token followed by drafts.
    pub tokens: &'a [u32],
    /// How many of `tokens` (at the end) are drafts.
    pub drafts: usize,
    /// The pass ends at a position that samples.
    pub samples: bool,
    /// The pass stores the hidden state of every fed position.
    pub store_hidden: bool,
}

impl RowRequest<'_> {
    fn output(&self) -> OutputRows {
        if self.drafts > 0 || self.store_hidden {
            OutputRows::All
        } else if self.samples {
            OutputRows::Last
        } else {
            OutputRows::None
        }
    }
}

/// Where one sequence's rows are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SeqRows {
    /// Rows of the forward pass's hidden output.
    pub hidden: Range<usize>,
    /// Rows of the unembedded logits (`drafts + 1` when verifying).
    pub logits: Range<usize>,
    /// Row of the plain sampler call, when it samples without drafts.
    pub sample: Option<usize>,
}

/// The batch and its row map.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct RowLayout {
    pub batch: Batch,
    /// One entry per request, in order.
    pub seqs: Vec<SeqRows>,
    /// Hidden rows to unembed, in logit order.
    pub unembed: Vec<u32>,
    /// Logit rows of the plain sampler call, in order.
    pub sample: Vec<u32>,
    /// Hidden rows in all.
    pub hidden_rows: usize,
}

impl RowLayout {
    pub fn new(requests: &[RowRequest<'_>]) -> Self {
        let mut out = RowLayout::default();
        for r in requests {
            let output = r.output();
            let n_hidden = match output {
                OutputRows::None => 0,
                OutputRows::Last => 1,
                OutputRows::All => r.tokens.len(),
            };
            let hidden = out.hidden_rows..out.hidden_rows + n_hidden;
            let first_logit = out.unembed.len();
            let mut sample = None;
            if r.drafts > 0 {
                out.unembed.extend(hidden.start as u32..hidden.end as u32);
            } else if r.samples {
                out.unembed.push(hidden.end as u32 - 1);
                sample = Some(out.sample.len());
                out.sample.push(first_logit as u32);
            }
            out.seqs.push(SeqRows {
                hidden: hidden.clone(),
                logits: first_logit..out.unembed.len(),
                sample,
            });
            out.hidden_rows = hidden.end;
            out.batch.push(r.slot, r.offset, r.tokens, output);
        }
        out
    }

    /// Whether every hidden row is unembedded (no row selection needed).
    pub fn unembeds_all(&self) -> bool {
        self.unembed.len() == self.hidden_rows
    }

    /// Whether every logit row goes to the plain sampler call.
    pub fn samples_all(&self) -> bool {
        self.sample.len() == self.unembed.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(tokens: &[u32], drafts: usize, samples: bool, store_hidden: bool) -> RowRequest<'_> {
        RowRequest {
            slot: 0,
            offset: 0,
            tokens,
            drafts,
            samples,
            store_hidden,
        }
    }

    #[test]
    fn one_sequence_table() {
        // (case, tokens, drafts, samples, store_hidden) → (output, hidden, logits, sample)
        type Row = (
            &'static str,
            usize,
            usize,
            bool,
            bool,
            OutputRows,
            Range<usize>,
            Range<usize>,
            Option<usize>,
        );
        #[rustfmt::skip]
        let table: &[Row] = &[
            ("prefill mid-prompt", 5, 0, false, false, OutputRows::None, 0..0, 0..0, None),
            ("last prefill chunk", 5, 0, true, false, OutputRows::Last, 0..1, 0..1, Some(0)),
            ("decode", 1, 0, true, false, OutputRows::Last, 0..1, 0..1, Some(0)),
            ("decode + 3 drafts", 4, 3, true, false, OutputRows::All, 0..4, 0..4, None),
            ("store-hidden prefill mid-prompt", 5, 0, false, true, OutputRows::All, 0..5, 0..0, None),
            ("store-hidden last chunk", 5, 0, true, true, OutputRows::All, 0..5, 0..1, Some(0)),
            ("store-hidden decode + 2 drafts", 3, 2, true, true, OutputRows::All, 0..3, 0..3, None),
        ];
        let tokens: Vec<u32> = (0..8).collect();
        for (case, n, drafts, samples, keep, output, hidden, logits, sample) in
            table.iter().cloned()
        {
            let layout = RowLayout::new(&[req(&tokens[..n], drafts, samples, keep)]);
            assert_eq!(layout.batch.seqs[0].output, output, "{case}");
            assert_eq!(layout.batch.tokens, &tokens[..n], "{case}");
            let rows = &layout.seqs[0];
            assert_eq!(
                (rows.hidden.clone(), rows.logits.clone(), rows.sample),
                (hidden, logits, sample),
                "{case}"
            );
            assert_eq!(layout.hidden_rows, layout.batch.num_outputs(), "{case}");
            // Logit rows point at the sequence's last hidden row, or all of them.
            let unembed: Vec<u32> = layout.unembed.clone();
            let want: Vec<u32> = if drafts > 0 {
                (rows.hidden.start as u32..rows.hidden.end as u32).collect()
            } else if samples {
                vec![rows.hidden.end as u32 - 1]
            } else {
                vec![]
            };
            assert_eq!(unembed, want, "{case}");
        }
    }

    #[test]
    fn mixed_step_rows_follow_plan_order() {
        let t: Vec<u32> = (0..16).collect();
        let mut requests = vec![
            req(&t[0..6], 0, false, false),  // prefill mid-prompt
            req(&t[6..7], 0, true, false),   // decode
            req(&t[7..10], 2, true, false),  // decode + 2 drafts
            req(&t[10..14], 0, true, false), // last prefill chunk
            req(&t[14..15], 0, true, true),  // keep-hidden decode
        ];
        for (i, r) in requests.iter_mut().enumerate() {
            r.slot = i as SlotId;
            r.offset = 100 * i;
        }
        let layout = RowLayout::new(&requests);
        let spans: Vec<(SlotId, usize, usize)> = layout
            .batch
            .seqs
            .iter()
            .map(|s| (s.slot, s.offset, s.len))
            .collect();
        assert_eq!(
            spans,
            vec![
                (0, 0, 6),
                (1, 100, 1),
                (2, 200, 3),
                (3, 300, 4),
                (4, 400, 1)
            ]
        );
        let rows: Vec<(Range<usize>, Range<usize>, Option<usize>)> = layout
            .seqs
            .iter()
            .map(|s| (s.hidden.clone(), s.logits.clone(), s.sample))
            .collect();
        assert_eq!(
            rows,
            vec![
                (0..0, 0..0, None),
                (0..1, 0..1, Some(0)),
                (1..4, 1..4, None),
                (4..5, 4..5, Some(1)),
                (5..6, 5..6, Some(2)),
            ]
        );
        assert_eq!(layout.unembed, vec![0, 1, 2, 3, 4, 5]);
        assert_eq!(layout.sample, vec![0, 4, 5]);
        assert!(layout.unembeds_all() && !layout.samples_all());
        assert_eq!(layout.batch.output_indices(), vec![6, 7, 8, 9, 13, 14]);
    }

    #[test]
    fn nothing_to_sample() {
        let t = [1u32, 2, 3];
        let layout = RowLayout::new(&[req(&t, 0, false, false)]);
        assert!(layout.unembed.is_empty() && layout.sample.is_empty());
        assert!(layout.unembeds_all() && layout.samples_all());
    }
}
