//! The ragged batch: many sequences' tokens concatenated into one forward pass.

use crate::slot::SlotId;

/// Which positions of a sequence the caller wants hidden states for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutputRows {
    /// None (a prefill chunk that is not the prompt's last).
    None,
    /// The last position (decoding, the final prefill chunk).
    Last,
    /// Every position (verifying drafts).
    All,
}

impl OutputRows {
    fn count(self, len: usize) -> usize {
        match self {
            OutputRows::None => 0,
            OutputRows::Last => 1,
            OutputRows::All => len,
        }
    }
}

/// One sequence's part of a [`Batch`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqSpan {
    /// KV slot the sequence's cache lives in.
    pub slot: SlotId,
    /// Position of the span's first token; must equal the slot's KV length.
    pub offset: usize,
    /// Number of tokens of this sequence in the batch.
    pub len: usize,
    pub output: OutputRows,
}

/// Tokens of several sequences, concatenated in `seqs` order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Batch {
    pub tokens: Vec<u32>,
    pub seqs: Vec<SeqSpan>,
}

impl Batch {
    /// Appends a sequence's tokens.
    pub fn push(&mut self, slot: SlotId, offset: usize, tokens: &[u32], output: OutputRows) {
        self.tokens.extend_from_slice(tokens);
        self.seqs.push(SeqSpan {
            slot,
            offset,
            len: tokens.len(),
            output,
        });
    }

    /// Rows of hidden state the forward pass returns, in order.
    pub fn num_outputs(&self) -> usize {
        self.seqs.iter().map(|s| s.output.count(s.len)).sum()
    }

    /// Row indices (into the concatenated tokens) of the wanted outputs.
    pub fn output_indices(&self) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.num_outputs());
        let mut start = 0u32;
        for s in &self.seqs {
            let len = s.len as u32;
            match s.output {
                OutputRows::None => {}
                OutputRows::Last => out.push(start + len - 1),
                OutputRows::All => out.extend(start..start + len),
            }
            start += len;
        }
        out
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }
}
