//! Streaming text out of a growing list of token ids.
//!
//! Decoding one token at a time is wrong for every common tokenizer family:
//! a multi-byte character may be split over several byte tokens (byte-level
//! BPE, SentencePiece byte fallback), and SentencePiece decoders strip the
//! leading space of the *first* token of whatever they decode. So, like Hugging
//! Face TGI, [`IncrementalDecoder`] decodes a small window of ids twice: the
//! tokens whose text was already emitted ("prefix", `window[..read_offset]`)
//! and the same plus the new tokens (`window[..]`). When the second text is
//! longer and does not end in U+FFFD (an incomplete character), the
//! difference is emitted and the window slides forward; otherwise the new
//! tokens wait for the next one.
//!
//! Invariants:
//! - Text is emitted only at valid UTF-8 boundaries, except by
//!   [`finish`](IncrementalDecoder::finish) and after
//!   [`MAX_PENDING_TOKENS`] tokens without a complete character, where the
//!   rest is flushed lossily (U+FFFD) rather than held forever.
//! - No byte is lost: the concatenated chunks equal the tokenizer's decode of
//!   all pushed ids (given the same context).
//! - Every payload (a token's logprobs, say) comes out exactly once, in push
//!   order, in the chunk that carries that token's text. Tokens that end
//!   mid-character, or have no text of their own (skipped special tokens),
//!   wait and ride with the next chunk that has text.
//! - Cost is bounded: only the window since the last emission is decoded,
//!   never the whole sequence.

use std::sync::Arc;

use super::{Tokenizer, TokenizerError};

/// How many trailing prompt ids [`IncrementalDecoder::with_context`] keeps as
/// decoding context (the value TGI and vLLM use).
pub const CONTEXT_TOKENS: usize = 5;

/// After this many tokens without a complete character, the decoder stops
/// waiting and flushes what it has (lossily). A valid UTF-8 character needs at
/// most four byte tokens, so only broken byte streams, or a long run of
/// text-less special tokens, get here.
pub const MAX_PENDING_TOKENS: usize = 16;

const REPLACEMENT: char = '\u{FFFD}';

/// A piece of text ready to send, and the payloads of the tokens whose text
/// it carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TextChunk<T> {
    /// New text (may be empty only for a flush of text-less tokens).
    pub text: String,
    /// One payload per token, in push order.
    pub payloads: Vec<T>,
}

/// Turns a stream of token ids into text chunks (see the module docs).
///
/// Owned by one request; `T` is whatever the caller attaches to each token
/// (its logprobs, its index, `()`).
pub struct IncrementalDecoder<T> {
    tokenizer: Arc<Tokenizer>,
    /// The decoding window. `window[..read_offset]` produced the text that was
    /// emitted last (or is prompt context); `window[read_offset..]` has not
    /// produced text yet.
    window: Vec<u32>,
    read_offset: usize,
    /// Decode of `window[..read_offset]`; stale after the window slides, and
    /// then recomputed by the next push (so `finish` never has to decode).
    prefix_text: String,
    prefix_stale: bool,
    /// Decode of the whole window as of the last push that did not emit.
    tail_text: String,
    /// Payloads of `window[read_offset..]`.
    pending: Vec<T>,
}

impl<T> IncrementalDecoder<T> {
    /// A decoder with no context: the first token is decoded as the start of
    /// a text (so SentencePiece tokenizers drop its leading space, exactly as
    /// a full decode of the generated ids would).
    pub fn new(tokenizer: Arc<Tokenizer>) -> Self {
        Self {
            tokenizer,
            window: Vec::new(),
            read_offset: 0,
            prefix_text: String::new(),
            prefix_stale: false,
            tail_text: String::new(),
            pending: Vec::new(),
        }
    }

    /// A decoder that continues after `context` (the prompt ids): the first
    /// generated token is decoded as a continuation, so its leading space is
    /// kept. Only the last [`CONTEXT_TOKENS`] ids are used; their text is not
    /// emitted.
    pub fn with_context(
        tokenizer: Arc<Tokenizer>,
        context: &[u32],
    ) -> Result<Self, TokenizerError> {
        tokenizer.check_ids(context, "IncrementalDecoder::with_context")?;
        let tail = &context[context.len().saturating_sub(CONTEXT_TOKENS)..];
        let mut window = tail.to_vec();
        // A context whose tokens all decode to nothing (unknown words that
        // became `<unk>`, skipped as a special token) would make the first
        // generated token decode as the start of a text and lose its
        // leading space, though it follows the prompt. Such a context gets a
        // plain token in front that stands for the prompt's text.
        if !tail.is_empty() && tokenizer.decode(tail)?.is_empty() {
            if let Some(anchor) = anchor_id(&tokenizer) {
                window.insert(0, anchor);
            }
        }
        let mut decoder = Self::new(tokenizer);
        decoder.read_offset = window.len();
        decoder.prefix_stale = !window.is_empty();
        decoder.window = window;
        Ok(decoder)
    }

    /// The tokenizer this decoder decodes with.
    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    /// How many pushed tokens have not produced a chunk yet.
    pub fn pending_tokens(&self) -> usize {
        self.pending.len()
    }

    /// Adds one token; returns a chunk when the text grew by complete
    /// characters. On error (an id outside the vocabulary, a decoder failure)
    /// the token and its payload are discarded and the decoder is unchanged.
    pub fn push(&mut self, id: u32, payload: T) -> Result<Option<TextChunk<T>>, TokenizerError> {
        self.tokenizer
            .check_ids(&[id], "IncrementalDecoder::push")?;
        if self.prefix_stale {
            self.prefix_text = self.tokenizer.decode(&self.window[..self.read_offset])?;
            self.prefix_stale = false;
        }
        self.window.push(id);
        let text = match self.tokenizer.decode(&self.window) {
            Ok(text) => text,
            Err(e) => {
                self.window.pop();
                return Err(e);
            }
        };
        self.pending.push(payload);

        let grew = text.len() > self.prefix_text.len() && !text.ends_with(REPLACEMENT);
        if grew || self.pending.len() >= MAX_PENDING_TOKENS {
            Ok(Some(self.emit(&text)))
        } else {
            self.tail_text = text;
            Ok(None)
        }
    }

    /// Flushes the tokens still waiting (generation ended): their text as far
    /// as it decodes, with U+FFFD for an incomplete last character, and their
    /// payloads. `None` when nothing is waiting. The decoder stays usable.
    pub fn finish(&mut self) -> Option<TextChunk<T>> {
        if self.pending.is_empty() {
            return None;
        }
        // `tail_text` and `prefix_text` were both computed by the last push,
        // which did not emit (or `pending` would be empty).
        let tail = std::mem::take(&mut self.tail_text);
        Some(self.emit(&tail))
    }

    /// Emits the difference between `text` (the decode of the whole window)
    /// and the prefix, with every waiting payload, and slides the window:
    /// the tokens just emitted become the next prefix.
    fn emit(&mut self, text: &str) -> TextChunk<T> {
        let chunk = TextChunk {
            text: text_delta(&self.prefix_text, text),
            payloads: std::mem::take(&mut self.pending),
        };
        self.window.drain(..self.read_offset);
        self.read_offset = self.window.len();
        self.prefix_stale = true;
        chunk
    }
}

impl<T> std::fmt::Debug for IncrementalDecoder<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IncrementalDecoder")
            .field("window", &self.window)
            .field("read_offset", &self.read_offset)
            .field("pending_tokens", &self.pending.len())
            .finish_non_exhaustive()
    }
}

/// Ids searched for an anchor by [`anchor_id`].
const ANCHOR_SEARCH: u32 = 4096;

/// A token that decodes, alone, to plain visible text (no space, no
/// U+FFFD): the first such id. Decoding it before a token makes that token
/// decode as a continuation, as after any text.
fn anchor_id(tokenizer: &Tokenizer) -> Option<u32> {
    let n = u32::try_from(tokenizer.vocab_size()).unwrap_or(u32::MAX);
    (0..n.min(ANCHOR_SEARCH)).find(|&id| {
        tokenizer
            .decode(&[id])
            .is_ok_and(|t| !t.is_empty() && t.chars().all(|c| c.is_alphanumeric()))
    })
}

/// The text `text` adds after `prefix`.
///
/// Normally `prefix` is a prefix of `text`. A few decoders are not
/// monotonic (clean-up rules that rewrite earlier text once later tokens
/// arrive); then the text after the longest common prefix is returned, which
/// may repeat a little already-emitted text rather than lose any.
fn text_delta(prefix: &str, text: &str) -> String {
    if let Some(rest) = text.strip_prefix(prefix) {
        return rest.to_owned();
    }
    let common: usize = prefix
        .chars()
        .zip(text.chars())
        .take_while(|(a, b)| a == b)
        .map(|(a, _)| a.len_utf8())
        .sum();
    tracing::debug!(
        prefix,
        text,
        "incremental decode: window text does not extend the prefix"
    );
    text[common..].to_owned()
}

#[cfg(test)]
mod tests {
    use super::text_delta;

    #[test]
    fn delta_of_an_extension_is_the_suffix() {
        assert_eq!(text_delta("ab", "abcé"), "cé");
        assert_eq!(text_delta("", "x"), "x");
    }

    /// Issue #20: a prompt of unknown words only (all `<unk>`, skipped when
    /// decoding) still makes the first generated word a continuation.
    #[test]
    fn a_context_that_decodes_to_nothing_keeps_the_leading_space() {
        use super::IncrementalDecoder;
        use crate::tokenizer::word_vocab::{word_level_tokenizer, BOS_ID, FIXED_TOKENS, UNK_ID};
        let tok = std::sync::Arc::new(word_level_tokenizer(256, 7).unwrap());
        let word = FIXED_TOKENS as u32 + 3;
        let own = tok.token_text(word).unwrap();
        assert!(own.starts_with(' '), "{own:?}");
        for context in [
            vec![BOS_ID, UNK_ID, UNK_ID, UNK_ID],
            vec![UNK_ID],
            vec![BOS_ID, word],
        ] {
            let mut d = IncrementalDecoder::with_context(tok.clone(), &context).unwrap();
            let chunk = d.push(word, ()).unwrap().expect("a whole word");
            assert_eq!(chunk.text, own, "context {context:?}");
        }
        // Without context, a text starts without its space.
        let mut d = IncrementalDecoder::<()>::new(tok.clone());
        assert_eq!(d.push(word, ()).unwrap().unwrap().text, own.trim_start());
    }

    #[test]
    fn delta_of_a_rewrite_keeps_everything_after_the_common_prefix() {
        assert_eq!(text_delta("a\u{FFFD}", "aé!"), "é!");
        assert_eq!(text_delta("é", "ü"), "ü");
    }
}
