//! Request actors: one per text request, between the scheduler's token-level
//! events and the client's event sink.
//!
//! # Ownership
//! A [`RequestActor`] owns its request's [`TextStream`] (incremental
//! detokenizer + stop-string matcher) and its [`EventSink`]. The scheduler
//! sends it [`SeqEvent`]s; it turns tokens into text [`Event`]s, ends the
//! request when a stop string matches (a `Cancel` with
//! [`CancelReason::StopString`]), and cancels the request when its sink is
//! gone. It stops itself after forwarding the terminal event.

use std::sync::Arc;

use actix::prelude::*;
use tokio::sync::mpsc;

use crate::api::{Event, Finished, TandemError, TokenInfo, TopLogprob};
use crate::scheduler::{
    Cancel, CancelReason, FinishReason, RequestId, Scheduler, SchedulerError, SeqEvent, SeqRequest,
};
use crate::tokenizer::{StreamStep, TextStream, Tokenizer};

/// Where a request's events go: an actor's mailbox or an async channel.
#[derive(Clone)]
pub enum EventSink {
    /// Any actor that handles [`Event`] (custom actors, host services).
    Recipient(Recipient<Event>),
    /// An async consumer (the [`crate::TandemHandle`] stream, HTTP handlers).
    Channel(mpsc::UnboundedSender<Event>),
}

impl EventSink {
    /// Delivers an event; false when the receiver is gone.
    pub fn send(&self, event: Event) -> bool {
        match self {
            EventSink::Recipient(r) => r.connected() && r.try_send(event).is_ok(),
            EventSink::Channel(tx) => tx.send(event).is_ok(),
        }
    }

    /// Whether the receiver is still there.
    pub fn is_connected(&self) -> bool {
        match self {
            EventSink::Recipient(r) => r.connected(),
            EventSink::Channel(tx) => !tx.is_closed(),
        }
    }
}

impl From<Recipient<Event>> for EventSink {
    fn from(r: Recipient<Event>) -> Self {
        EventSink::Recipient(r)
    }
}

/// The per-request actor. Created by the scheduler's `Generate` handler.
pub struct RequestActor {
    stream: TextStream<TokenInfo>,
    sink: EventSink,
    scheduler: Addr<Scheduler>,
    tokenizer: Arc<Tokenizer>,
    /// Learnt from the first scheduler event (every event carries it),
    /// so it is known before anything is sent to the sink.
    id: RequestId,
    /// The stop string that matched, once one did.
    stopped_by: Option<String>,
    /// A `Cancel` has been sent; events until the terminal one are ignored.
    cancelling: bool,
}

impl RequestActor {
    pub(crate) fn new(
        stream: TextStream<TokenInfo>,
        sink: EventSink,
        scheduler: Addr<Scheduler>,
        tokenizer: Arc<Tokenizer>,
    ) -> Self {
        Self {
            stream,
            sink,
            scheduler,
            tokenizer,
            id: RequestId(u64::MAX),
            stopped_by: None,
            cancelling: false,
        }
    }

    fn cancel(&mut self, reason: CancelReason) {
        if !self.cancelling {
            self.cancelling = true;
            self.scheduler.do_send(Cancel {
                id: self.id,
                reason,
            });
        }
    }

    /// Sends the chunks of a stream step; notes a stop match.
    fn forward(&mut self, step: StreamStep<TokenInfo>) {
        for chunk in step.chunks {
            if !self.sink.send(Event::Tokens {
                id: self.id,
                text: chunk.text,
                tokens: chunk.payloads,
            }) {
                self.cancel(CancelReason::Client);
                return;
            }
        }
        if let Some(m) = step.stop {
            self.stopped_by = Some(m.stop);
            self.cancel(CancelReason::StopString);
        }
    }

    fn token_info(&self, index: usize, t: crate::engine::GeneratedToken) -> TokenInfo {
        let top_logprobs = t
            .top_logprobs
            .into_iter()
            .map(|(id, logprob)| TopLogprob {
                id,
                text: self.tokenizer.token_text(id).unwrap_or_default(),
                logprob,
            })
            .collect();
        TokenInfo {
            index,
            id: t.id,
            logprob: t.logprob,
            top_logprobs,
        }
    }
}

impl Actor for RequestActor {
    type Context = Context<Self>;
}

impl Handler<SeqEvent> for RequestActor {
    type Result = ();

    fn handle(&mut self, event: SeqEvent, ctx: &mut Context<Self>) {
        self.id = event.id();
        match event {
            SeqEvent::Started { .. } => {
                if !self.sink.is_connected() {
                    self.cancel(CancelReason::Client);
                }
            }
            SeqEvent::Tokens {
                first_index,
                tokens,
                ..
            } => {
                if self.cancelling {
                    return;
                }
                for (i, t) in tokens.into_iter().enumerate() {
                    let info = self.token_info(first_index + i, t);
                    let id = info.id;
                    match self.stream.push(id, info) {
                        Ok(step) => self.forward(step),
                        Err(e) => {
                            self.sink.send(Event::Error {
                                id: self.id,
                                error: TandemError::from(e),
                            });
                            self.cancel(CancelReason::Client);
                        }
                    }
                    if self.cancelling {
                        return;
                    }
                }
            }
            SeqEvent::Finished {
                mut reason,
                usage,
                timings,
                ..
            } => {
                if self.stopped_by.is_none() && reason != FinishReason::Cancelled {
                    let step = self.stream.finish();
                    self.forward(step);
                }
                if self.stopped_by.is_some() {
                    reason = FinishReason::Stop;
                }
                self.sink.send(Event::Finished(Finished {
                    id: self.id,
                    reason,
                    usage,
                    timings,
                    stop: self.stopped_by.take(),
                }));
                ctx.stop();
            }
            SeqEvent::Failed { error, .. } => {
                self.sink.send(Event::Error {
                    id: self.id,
                    error: TandemError::Scheduler(error),
                });
                ctx.stop();
            }
        }
    }
}

/// Submit a text request; its [`Event`]s go to `events`. Send it to the
/// scheduler's `Addr` from any actor. Replies with the request's id, or with
/// an error before the request takes a slot.
#[derive(Message)]
#[rtype(result = "Result<RequestId, TandemError>")]
pub struct Generate {
    pub request: crate::api::GenerateRequest,
    pub events: EventSink,
}

impl Handler<Generate> for Scheduler {
    type Result = Result<RequestId, TandemError>;

    fn handle(&mut self, msg: Generate, ctx: &mut Context<Self>) -> Self::Result {
        let tokenizer = self
            .tokenizer()
            .cloned()
            .ok_or(TandemError::InvalidRequest {
                field: "prompt",
                reason:
                    "this scheduler was started without a tokenizer; submit token ids with `Submit`"
                        .into(),
            })?;
        let crate::api::GenerateRequest {
            prompt,
            max_tokens,
            sampling,
            stop,
            mtp,
        } = msg.request;
        let prompt: Vec<u32> = match prompt {
            crate::api::Prompt::Text(text) => tokenizer.encode(&text)?,
            crate::api::Prompt::Tokens(ids) => ids,
        };
        let vocab_size = self.engine_info().vocab_size;
        if let Some((index, &token)) = prompt
            .iter()
            .enumerate()
            .find(|(_, &t)| t as usize >= vocab_size)
        {
            return Err(SchedulerError::TokenOutOfVocab {
                index,
                token,
                vocab_size,
            }
            .into());
        }
        let context_len = self.engine_info().context_len;
        let max_new_tokens = match max_tokens {
            Some(0) => {
                return Err(TandemError::InvalidRequest {
                    field: "max_tokens",
                    reason: "must be at least 1".into(),
                })
            }
            Some(n) if n >= context_len => {
                return Err(TandemError::InvalidRequest {
                    field: "max_tokens",
                    reason: format!("must be below the context length of {context_len}, got {n}"),
                })
            }
            Some(n) => n,
            // Until EOS or a full context.
            None => context_len.saturating_sub(prompt.len()).max(1),
        };
        if stop.iter().any(|s| s.is_empty()) {
            return Err(TandemError::InvalidRequest {
                field: "stop",
                reason: "stop strings must not be empty".into(),
            });
        }
        let stream = TextStream::with_context(tokenizer.clone(), stop, &prompt)?;
        let actor = RequestActor::new(stream, msg.events, ctx.address(), tokenizer).start();
        let request = SeqRequest {
            prompt: Arc::from(prompt),
            sampling,
            max_new_tokens,
            spec: mtp,
            events: actor.recipient(),
        };
        Ok(self.submit_request(request, ctx)?)
    }
}
