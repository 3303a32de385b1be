//! Stop strings: the request actor's per-request output filter.
//!
//! [`StopFilter`] takes text chunks (each with the payloads of the tokens
//! whose text it carries) and decides what may be sent: text that can no
//! longer be part of a stop string goes out, a suffix that could still grow
//! into one is held back, and at a match the stream ends. [`TextStream`] is
//! an [`IncrementalDecoder`] feeding a `StopFilter`: token ids in, chunks
//! ready to send out. Each request actor owns one of each; nothing is shared.
//!
//! Rules (all tested):
//! - The matched stop string and everything after it are never emitted, not
//!   even a prefix of the match: a pending suffix that is a proper prefix of
//!   any stop string is held back until later text decides it.
//! - Stop strings are matched on text, so they may span token and chunk
//!   boundaries.
//! - When several stop strings match, the match that completes first wins:
//!   the one that ends earliest in the text; at equal ends, the one that
//!   starts earliest (the longer one, which cuts more); then the first in the
//!   caller's list. Ranking by end makes the result independent of how the
//!   text was split into chunks: whether two tokens arrive in one step (MTP)
//!   or two, the same text is emitted.
//! - Payloads: a token's payload is emitted with the chunk that carries the
//!   first byte of its text. When a stop string matches, every token whose
//!   text starts at or after the first byte of the match is dropped, payload
//!   included (its text lies inside the match or after it); a token whose
//!   text starts before the match is emitted with the part before the match.
//!   Tokens the decoder merged into one chunk (the first ones ended
//!   mid-character) count as starting where that chunk starts.
//! - [`finish`](TextStream::finish) (generation ended for another reason)
//!   releases all held text, after one last check for a match.
//! - After a match the stream is closed: later tokens are ignored (an MTP step
//!   can deliver several tokens past the stop) and their payloads dropped.

use std::collections::VecDeque;
use std::sync::Arc;

use super::{IncrementalDecoder, TextChunk, Tokenizer, TokenizerError};

/// Which stop string ended the stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StopMatch {
    /// Index of the stop string in the list given at construction.
    pub index: usize,
    /// The stop string itself.
    pub stop: String,
}

/// What one push (or the final flush) produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamStep<T> {
    /// Chunks ready to send, in order; one per token in the common case.
    /// Every chunk has text or payloads (usually both). A chunk carrying
    /// only the continuation of text already partly sent has no payloads.
    pub chunks: Vec<TextChunk<T>>,
    /// Set on the step where a stop string matched; the stream is then
    /// finished and the request should end with finish reason "stop".
    pub stop: Option<StopMatch>,
}

impl<T> Default for StreamStep<T> {
    fn default() -> Self {
        Self {
            chunks: Vec::new(),
            stop: None,
        }
    }
}

impl<T> StreamStep<T> {
    /// The text of all chunks, concatenated.
    pub fn text(&self) -> String {
        self.chunks.iter().map(|c| c.text.as_str()).collect()
    }
}

/// Where a token's text starts in the pending text, with its payloads.
#[derive(Debug)]
struct Segment<T> {
    start: usize,
    payloads: Vec<T>,
}

/// Holds back text that might be the start of a stop string (see the module
/// docs for the rules). Works on chunks, so it can be driven by any source
/// of text.
#[derive(Debug)]
pub struct StopFilter<T> {
    stops: Vec<String>,
    /// Text received but not emitted yet.
    pending: String,
    /// Owners of `pending`'s text, by ascending start. Invariant: when
    /// `pending` is not empty, `segments[0].start == 0`.
    segments: VecDeque<Segment<T>>,
    stopped: Option<StopMatch>,
}

impl<T> StopFilter<T> {
    /// A filter for `stops`; fails on an empty stop string. With no stop
    /// strings every chunk passes straight through.
    pub fn new(stops: Vec<String>) -> Result<Self, TokenizerError> {
        if let Some(index) = stops.iter().position(String::is_empty) {
            return Err(TokenizerError::EmptyStopString { index });
        }
        Ok(Self {
            stops,
            pending: String::new(),
            segments: VecDeque::new(),
            stopped: None,
        })
    }

    /// The stop strings, as given.
    pub fn stops(&self) -> &[String] {
        &self.stops
    }

    /// The match that ended the stream, if one did.
    pub fn stop_match(&self) -> Option<&StopMatch> {
        self.stopped.as_ref()
    }

    /// Text currently held back (a possible start of a stop string).
    pub fn held_text(&self) -> &str {
        &self.pending
    }

    /// Feeds one chunk; returns what may be sent now.
    pub fn push(&mut self, chunk: TextChunk<T>) -> StreamStep<T> {
        if self.stopped.is_some() {
            return StreamStep::default();
        }
        self.append(chunk);
        self.scan(false)
    }

    /// Ends the stream: one last check for a match, then every held byte and
    /// payload is released.
    pub fn finish(&mut self) -> StreamStep<T> {
        if self.stopped.is_some() {
            return StreamStep::default();
        }
        self.scan(true)
    }

    fn append(&mut self, chunk: TextChunk<T>) {
        let start = self.pending.len();
        match self.segments.back_mut() {
            // A previous chunk without text: its payloads belong with the
            // first text that follows, so merge instead of adding an empty
            // segment.
            Some(last) if last.start == start => last.payloads.extend(chunk.payloads),
            _ if chunk.text.is_empty() && chunk.payloads.is_empty() => {}
            _ => self.segments.push_back(Segment {
                start,
                payloads: chunk.payloads,
            }),
        }
        self.pending.push_str(&chunk.text);
    }

    /// Emits what is safe; at a match, truncates and closes the stream.
    fn scan(&mut self, finishing: bool) -> StreamStep<T> {
        if let Some((start, index)) = self.earliest_match() {
            let chunks = self.emit_until(start);
            self.pending.clear();
            self.segments.clear();
            let stop = StopMatch {
                index,
                stop: self.stops[index].clone(),
            };
            self.stopped = Some(stop.clone());
            return StreamStep {
                chunks,
                stop: Some(stop),
            };
        }
        let cut = if finishing {
            self.pending.len()
        } else {
            self.hold_start()
        };
        let chunks = if cut == self.pending.len() {
            self.emit_all()
        } else {
            self.emit_until(cut)
        };
        StreamStep { chunks, stop: None }
    }

    /// `(start byte, stop index)` of the winning complete match, if any.
    /// A stop string's first occurrence is also the one that ends first, so
    /// one `find` per stop string suffices.
    fn earliest_match(&self) -> Option<(usize, usize)> {
        self.stops
            .iter()
            .enumerate()
            .filter_map(|(index, stop)| {
                self.pending
                    .find(stop.as_str())
                    .map(|start| (start + stop.len(), start, index))
            })
            .min()
            .map(|(_, start, index)| (start, index))
    }

    /// Start of the longest pending suffix that is a proper prefix of some
    /// stop string (`pending.len()` when there is none). Compared as bytes:
    /// both sides are valid UTF-8, so equal byte strings start on a character
    /// boundary.
    fn hold_start(&self) -> usize {
        let text = self.pending.as_bytes();
        let longest = self
            .stops
            .iter()
            .filter_map(|stop| {
                let stop = stop.as_bytes();
                let max = (stop.len() - 1).min(text.len());
                (1..=max).rev().find(|&k| text.ends_with(&stop[..k]))
            })
            .max()
            .unwrap_or(0);
        text.len() - longest
    }

    /// Emits everything pending, including payloads of text-less tokens.
    fn emit_all(&mut self) -> Vec<TextChunk<T>> {
        let mut chunks = Vec::with_capacity(self.segments.len());
        while let Some(segment) = self.segments.pop_front() {
            let end = self
                .segments
                .front()
                .map_or(self.pending.len(), |s| s.start);
            chunks.push(TextChunk {
                text: self.pending[segment.start..end].to_owned(),
                payloads: segment.payloads,
            });
        }
        self.pending.clear();
        chunks
    }

    /// Emits `pending[..cut]` with the payloads of the segments that start
    /// before `cut`; keeps the rest, rebased to start at 0.
    fn emit_until(&mut self, cut: usize) -> Vec<TextChunk<T>> {
        let mut chunks = Vec::new();
        while self.segments.front().is_some_and(|s| s.start < cut) {
            let Some(segment) = self.segments.pop_front() else {
                break;
            };
            let end = self.segments.front().map_or(cut, |s| s.start.min(cut));
            chunks.push(TextChunk {
                text: self.pending[segment.start..end].to_owned(),
                payloads: segment.payloads,
            });
        }
        self.pending.drain(..cut);
        for segment in &mut self.segments {
            segment.start -= cut;
        }
        // The rest of a token whose first text was just sent has no owner
        // left; give it a payload-less segment to keep the invariant.
        if !self.pending.is_empty() && self.segments.front().is_none_or(|s| s.start > 0) {
            self.segments.push_front(Segment {
                start: 0,
                payloads: Vec::new(),
            });
        }
        chunks
    }
}

/// Token ids in, text chunks ready to send out: an [`IncrementalDecoder`]
/// followed by a [`StopFilter`]. One per request, owned by its actor.
#[derive(Debug)]
pub struct TextStream<T> {
    decoder: IncrementalDecoder<T>,
    filter: StopFilter<T>,
}

impl<T> TextStream<T> {
    /// A stream with no decoding context; fails on an empty stop string.
    pub fn new(tokenizer: Arc<Tokenizer>, stop: Vec<String>) -> Result<Self, TokenizerError> {
        Ok(Self {
            decoder: IncrementalDecoder::new(tokenizer),
            filter: StopFilter::new(stop)?,
        })
    }

    /// A stream that continues after the prompt `context` (see
    /// [`IncrementalDecoder::with_context`]): the first generated token keeps
    /// its leading space. Stop strings are matched on generated text only.
    pub fn with_context(
        tokenizer: Arc<Tokenizer>,
        stop: Vec<String>,
        context: &[u32],
    ) -> Result<Self, TokenizerError> {
        Ok(Self {
            decoder: IncrementalDecoder::with_context(tokenizer, context)?,
            filter: StopFilter::new(stop)?,
        })
    }

    /// Feeds one generated token. After a stop match the token is ignored and
    /// an empty step is returned. On error the token is discarded.
    pub fn push(&mut self, id: u32, payload: T) -> Result<StreamStep<T>, TokenizerError> {
        if self.filter.stopped.is_some() {
            return Ok(StreamStep::default());
        }
        Ok(match self.decoder.push(id, payload)? {
            Some(chunk) => self.filter.push(chunk),
            None => StreamStep::default(),
        })
    }

    /// Generation ended for another reason (EOS, length, cancel): flushes the
    /// decoder and releases held text, unless that text completes a stop
    /// string, in which case the step reports the match.
    pub fn finish(&mut self) -> StreamStep<T> {
        if self.filter.stopped.is_some() {
            return StreamStep::default();
        }
        let mut step = match self.decoder.finish() {
            Some(chunk) => self.filter.push(chunk),
            None => StreamStep::default(),
        };
        if step.stop.is_none() {
            let rest = self.filter.finish();
            step.chunks.extend(rest.chunks);
            step.stop = rest.stop;
        }
        step
    }

    /// The match that ended the stream, if one did.
    pub fn stop_match(&self) -> Option<&StopMatch> {
        self.filter.stop_match()
    }

    /// Whether a stop string ended the stream.
    pub fn is_stopped(&self) -> bool {
        self.filter.stopped.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(text: &str, payload: u32) -> TextChunk<u32> {
        TextChunk {
            text: text.to_owned(),
            payloads: vec![payload],
        }
    }

    #[test]
    fn hold_start_finds_the_longest_partial_match() {
        let mut filter = StopFilter::<u32>::new(vec!["abc".into(), "cd".into()]).unwrap();
        filter.pending = "xxab".into();
        assert_eq!(filter.hold_start(), 2);
        filter.pending = "xxabc".into();
        assert_eq!(filter.hold_start(), 4, "`c` may start `cd`");
        filter.pending = "xyz".into();
        assert_eq!(filter.hold_start(), 3);
    }

    #[test]
    fn the_rest_of_a_split_token_keeps_an_owner() {
        let mut filter = StopFilter::new(vec!["lo!".into()]).unwrap();
        let step = filter.push(chunk("hel", 1));
        assert_eq!(step.chunks, vec![chunk("he", 1)]);
        assert_eq!(filter.held_text(), "l");
        // The held "l" belongs to token 1, whose payload already went out.
        let step = filter.push(chunk("lo world", 2));
        let orphan = TextChunk {
            text: "l".to_owned(),
            payloads: vec![],
        };
        assert_eq!(step.chunks, vec![orphan.clone(), chunk("lo world", 2)]);
        assert_eq!(filter.push(chunk("hel", 3)).chunks, vec![chunk("he", 3)]);
        let step = filter.push(chunk("lo!", 4));
        assert_eq!(step.chunks, vec![orphan], "token 4 starts inside the match");
        assert_eq!(
            step.stop,
            Some(StopMatch {
                index: 0,
                stop: "lo!".into()
            })
        );
        assert!(filter.push(chunk("more", 5)).chunks.is_empty());
        assert!(filter.finish().chunks.is_empty());
    }
}
