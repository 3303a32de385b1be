//! Server-sent events: a request's [`EventStream`] turned into the OpenAI
//! streaming format, `data: {json}\n\n` per chunk and `data: [DONE]\n\n` at
//! the end.
//!
//! [`SseStream`] owns the request's `EventStream`. actix-web drops the body
//! stream when the client disconnects, which drops the `EventStream`, which
//! cancels the request: the slot is released at the next step boundary.
//! Nothing else is needed for disconnect handling. (Whole answers rely on
//! the same drop: see the server's module docs.)
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

use super::errors::ApiError;
use crate::api::{Event, Finished, TokenInfo};
use crate::handle::EventStream;

/// The end-of-stream marker.
const DONE: &[u8] = b"data: [DONE]\n\n";
/// At most this many ready events are merged into one body chunk.
const MAX_EVENTS_PER_WRITE: usize = 64;

/// Turns a request's events into the JSON payloads of its chunks. One
/// implementation per route (completions, chat).
pub trait ChunkFormatter: Unpin + 'static {
    /// Payloads sent before the first event (chat's role delta).
    fn start(&mut self) -> Vec<String>;
    /// The payload for new text and its tokens; `None` to send nothing.
    fn tokens(&mut self, text: String, tokens: Vec<TokenInfo>) -> Option<String>;
    /// The payloads ending the stream (finish reason, then usage).
    fn finished(&mut self, finished: &Finished) -> Vec<String>;
}

/// An SSE body over a request's events.
pub struct SseStream<F> {
    events: EventStream,
    format: F,
    /// Chunks ready to be written before polling for more events.
    pending: VecDeque<String>,
    started: bool,
    /// The terminal event was seen; after `pending` comes `[DONE]`.
    ended: bool,
    /// `[DONE]` was written.
    closed: bool,
}

impl<F: ChunkFormatter> SseStream<F> {
    /// Streams `events` through `format`.
    pub fn new(events: EventStream, format: F) -> Self {
        Self {
            events,
            format,
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

    /// Formats one event (`None`: the stream closed without a terminal one).
    fn on_event(&mut self, event: Option<Event>) {
        match event {
            Some(Event::Tokens { text, tokens, .. }) => {
                if let Some(chunk) = self.format.tokens(text, tokens) {
                    self.pending.push_back(chunk);
                }
            }
            Some(Event::Finished(f)) => {
                self.pending.extend(self.format.finished(&f));
                self.ended = true;
            }
            Some(Event::Error { error, .. }) => {
                let e = ApiError::from_tandem(&error, "prompt");
                self.pending.push_back(e.body_json());
                self.ended = true;
            }
            None => {
                let e = ApiError::internal("the request ended without a result");
                self.pending.push_back(e.body_json());
                self.ended = true;
            }
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
            let start = this.format.start();
            this.pending.extend(start);
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
