//! Server-sent events: a request's [`EventStream`] turned into the OpenAI
//! streaming format, `data: {json}\n\n` per chunk and `data: [DONE]\n\n` at
//! the end.
//!
//! [`SseStream`] owns the request's events (a [`ChoiceStream`]: one choice,
//! or `n`). actix-web drops the body stream when the client disconnects,
//! which drops the `ChoiceStream`, which cancels every choice still
//! running: their slots are released at the next step boundary. Nothing
//! else is needed for disconnect handling. (Whole answers rely on the same
//! drop: see the server's module docs.)
//!
//! Several choices interleave as their events arrive, each chunk carrying
//! one choice (`choices: [{index: i, …}]`, as OpenAI streams them); every
//! choice gets its own finish chunk (or, if it fails, an error chunk while
//! the others go on), then one usage chunk when asked for (every choice's
//! tokens, the prompt once), then one `[DONE]`.
//!
//! Events that are already waiting are written as one body chunk (one
//! socket write), so a slow consumer of many small chunks costs fewer
//! syscalls per token.

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll};

use actix_web::web::{Bytes, BytesMut};
use actix_web::HttpResponse;
use futures_util::Stream;

use super::choices::total_usage;
use super::errors::ApiError;
use super::openai_types::UsageJson;
use crate::api::{Event, Finished, TokenInfo};
use crate::handle::{ChoiceStream, EventStream};
use crate::scheduler::Usage;

/// The end-of-stream marker.
const DONE: &[u8] = b"data: [DONE]\n\n";
/// At most this many ready events are merged into one body chunk.
const MAX_EVENTS_PER_WRITE: usize = 64;

/// Turns one choice's events into the JSON payloads of its chunks. One
/// implementation per route (completions, chat); one instance per choice.
pub trait ChunkFormatter: Unpin + 'static {
    /// Payloads sent before the first event (chat's role delta).
    fn start(&mut self) -> Vec<String>;
    /// The payload for new text and its tokens; `None` to send nothing.
    fn tokens(&mut self, text: String, tokens: Vec<TokenInfo>) -> Option<String>;
    /// The payloads ending the choice (its finish reason).
    fn finished(&mut self, finished: &Finished) -> Vec<String>;
    /// The request's usage chunk, sent after every choice ended, when the
    /// client asked for it (`stream_options.include_usage`).
    fn usage(&mut self, usage: UsageJson) -> Option<String>;
}

/// An SSE body over a request's events.
pub struct SseStream<F> {
    events: ChoiceStream,
    /// Choice `i`'s formatter is `formats[i]`.
    formats: Vec<F>,
    /// Usage of each choice that finished.
    usage: Vec<Option<Usage>>,
    /// Choices whose terminal event has not been seen.
    open: usize,
    /// Chunks ready to be written before polling for more events.
    pending: VecDeque<String>,
    started: bool,
    /// Every choice ended; after `pending` comes `[DONE]`.
    ended: bool,
    /// `[DONE]` was written.
    closed: bool,
}

impl<F: ChunkFormatter> SseStream<F> {
    /// Streams one request's `events` through `format`.
    pub fn new(events: EventStream, format: F) -> Self {
        Self::choices(events.into(), vec![format])
    }

    /// Streams a request's choices, choice `i` through `formats[i]`.
    pub fn choices(events: ChoiceStream, formats: Vec<F>) -> Self {
        debug_assert_eq!(events.len(), formats.len(), "one formatter per choice");
        Self {
            usage: vec![None; formats.len()],
            open: formats.len(),
            events,
            formats,
            pending: VecDeque::new(),
            started: false,
            ended: false,
            closed: false,
        }
    }

    /// The `text/event-stream` response.
    pub fn into_response(self) -> HttpResponse {
        HttpResponse::Ok()
            .content_type("text/event-stream")
            .insert_header(("cache-control", "no-cache"))
            .insert_header(("x-accel-buffering", "no"))
            .streaming(self)
    }

    /// Formats one event (`None`: the stream closed with choices open).
    fn on_event(&mut self, event: Option<(usize, Event)>) {
        let Some((i, event)) = event else {
            let e = ApiError::internal("the request ended without a result");
            self.pending.push_back(e.body_json());
            self.ended = true;
            return;
        };
        match event {
            Event::Tokens { text, tokens, .. } => {
                if let Some(chunk) = self.formats[i].tokens(text, tokens) {
                    self.pending.push_back(chunk);
                }
                return;
            }
            Event::Finished(f) => {
                self.pending.extend(self.formats[i].finished(&f));
                self.usage[i] = Some(f.usage);
            }
            Event::Error { error, .. } => {
                let mut e = ApiError::from_tandem(&error, "prompt");
                if self.formats.len() > 1 {
                    // The error body has no `index`: say which choice failed.
                    e.message = format!("choice {i}: {}", e.message);
                }
                self.pending.push_back(e.body_json());
            }
        }
        self.open -= 1;
        if self.open == 0 {
            self.finish();
        }
    }

    /// After the last choice: the usage chunk (if any choice finished).
    fn finish(&mut self) {
        self.ended = true;
        if self.usage.iter().any(Option::is_some) {
            let usage = total_usage(self.usage.iter().flatten());
            self.pending.extend(self.formats[0].usage(usage));
        }
    }

    fn drain_pending(&mut self, out: &mut BytesMut) {
        for chunk in self.pending.drain(..) {
            out.extend_from_slice(b"data: ");
            out.extend_from_slice(chunk.as_bytes());
            out.extend_from_slice(b"\n\n");
        }
    }
}

impl<F: ChunkFormatter> Stream for SseStream<F> {
    type Item = Result<Bytes, actix_web::Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        if this.closed {
            return Poll::Ready(None);
        }
        if !this.started {
            this.started = true;
            for format in &mut this.formats {
                let start = format.start();
                this.pending.extend(start);
            }
        }
        let mut out = BytesMut::new();
        let mut merged = 0;
        while !this.ended && merged < MAX_EVENTS_PER_WRITE {
            match Pin::new(&mut this.events).poll_next(cx) {
                Poll::Ready(event) => {
                    this.on_event(event);
                    merged += 1;
                }
                Poll::Pending => break,
            }
        }
        this.drain_pending(&mut out);
        if this.ended {
            out.extend_from_slice(DONE);
            this.closed = true;
        }
        if out.is_empty() {
            if merged == MAX_EVENTS_PER_WRITE {
                // Stopped at the cap, not on `Pending`: no waker is registered.
                cx.waker().wake_by_ref();
            }
            Poll::Pending
        } else {
            Poll::Ready(Some(Ok(out.freeze())))
        }
    }
}
