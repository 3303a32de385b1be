//! [`TandemHandle`]: the cheap, cloneable front door for host services.
//!
//! It wraps the scheduler's address and the tokenizer. `generate` returns a
//! `Stream` of [`Event`]s; dropping the stream cancels the request. The
//! handle works from any async runtime: actix mailboxes are thread-safe, so
//! a tokio program can drive a scheduler that lives in an actix System on
//! its own thread ([`TandemHandle::spawn`]).

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};

use actix::prelude::*;
use futures_util::Stream;
use tokio::sync::mpsc;

use crate::api::{Event, Finished, GenerateRequest, TandemError, TokenInfo};
use crate::engine::{EngineInfo, StepExecutor};
use crate::request::{EventSink, Generate, GenerateChoices};
use crate::scheduler::{
    Cancel, CancelReason, RequestId, Scheduler, SchedulerConfig, SchedulerStats, Shutdown,
    ShutdownMode, Stats,
};
use crate::tokenizer::Tokenizer;

/// A handle to a running Tandem scheduler. Clone it freely.
#[derive(Clone)]
pub struct TandemHandle {
    scheduler: Addr<Scheduler>,
    tokenizer: Arc<Tokenizer>,
    info: EngineInfo,
}

/// The collected result of a non-streaming request.
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    pub text: String,
    pub tokens: Vec<TokenInfo>,
    pub finished: Finished,
}

impl TandemHandle {
    /// Starts the scheduler (and its engine thread) on the current actix
    /// arbiter. Call it inside a running actix `System` (e.g. in
    /// `#[actix_web::main]` or `actix::System::new().block_on`).
    pub fn start<E: StepExecutor>(
        executor: E,
        tokenizer: Tokenizer,
        config: SchedulerConfig,
    ) -> Result<Self, TandemError> {
        let info = executor.info();
        let tokenizer = Arc::new(tokenizer);
        let scheduler = Scheduler::start_with_tokenizer(executor, config, tokenizer.clone())?;
        Ok(Self {
            scheduler,
            tokenizer,
            info,
        })
    }

    /// Starts an actix System on a dedicated thread, builds the executor
    /// there with `build`, and returns a handle usable from any runtime. The
    /// thread exits after [`shutdown`](Self::shutdown).
    pub fn spawn<E, F>(
        build: F,
        config: SchedulerConfig,
    ) -> Result<(Self, std::thread::JoinHandle<()>), TandemError>
    where
        E: StepExecutor,
        F: FnOnce() -> Result<(E, Tokenizer), TandemError> + Send + 'static,
    {
        let (tx, rx) = std::sync::mpsc::channel();
        let join = std::thread::Builder::new()
            .name("tandem-actors".into())
            .spawn(move || {
                let system = System::new();
                let started = system
                    .block_on(async move { build().and_then(|(e, t)| Self::start(e, t, config)) });
                let ok = started.is_ok();
                let _ = tx.send(started);
                if ok {
                    system.run().ok();
                }
            })
            .map_err(|e| TandemError::ThreadSpawn {
                thread: "tandem-actors",
                reason: e.to_string(),
            })?;
        let handle = rx.recv().map_err(|_| TandemError::Unavailable)??;
        Ok((handle, join))
    }

    /// The scheduler's address, for custom actors that send it messages
    /// ([`Generate`], [`Cancel`], [`Stats`], [`Shutdown`]) directly.
    pub fn scheduler(&self) -> &Addr<Scheduler> {
        &self.scheduler
    }

    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    /// Model limits and name.
    pub fn info(&self) -> &EngineInfo {
        &self.info
    }

    /// Submits a request; its events arrive on the returned stream. The
    /// request is checked first: a bad one is an `Err` and takes no slot.
    pub async fn generate(&self, request: GenerateRequest) -> Result<EventStream, TandemError> {
        let (tx, rx) = mpsc::unbounded_channel();
        let id = self
            .scheduler
            .send(Generate {
                request,
                events: EventSink::Channel(tx),
            })
            .await
            .map_err(|_| TandemError::Unavailable)??;
        Ok(EventStream {
            id,
            rx,
            scheduler: self.scheduler.clone(),
            done: false,
        })
    }

    /// Submits one request for `n` choices ([`GenerateChoices`]: the prompt
    /// is prefilled once, choice `i` samples with the request's seed plus
    /// `i`); their events arrive interleaved on the returned stream, each
    /// with its choice's index. `n` must be in `1..=max_seqs`.
    pub async fn generate_choices(
        &self,
        request: GenerateRequest,
        n: usize,
    ) -> Result<ChoiceStream, TandemError> {
        let (tx, rx) = mpsc::unbounded_channel();
        let ids = self
            .scheduler
            .send(GenerateChoices {
                request,
                n,
                events: EventSink::Channel(tx),
            })
            .await
            .map_err(|_| TandemError::Unavailable)??;
        Ok(ChoiceStream {
            open: vec![true; ids.len()],
            ids,
            rx,
            scheduler: self.scheduler.clone(),
        })
    }

    /// Runs a request's `n` choices to the end and collects each one's
    /// text, in choice order; a choice that failed is its error, the
    /// others are still complete.
    pub async fn complete_choices(
        &self,
        request: GenerateRequest,
        n: usize,
    ) -> Result<Vec<Result<Completion, TandemError>>, TandemError> {
        let mut stream = self.generate_choices(request, n).await?;
        let mut parts: Vec<(String, Vec<TokenInfo>)> = vec![Default::default(); n];
        let mut done: Vec<Option<Result<Completion, TandemError>>> = vec![None; n];
        while let Some((i, event)) = stream.next_event().await {
            match event {
                Event::Tokens {
                    text, mut tokens, ..
                } => {
                    parts[i].0.push_str(&text);
                    parts[i].1.append(&mut tokens);
                }
                Event::Finished(finished) => {
                    let (text, tokens) = std::mem::take(&mut parts[i]);
                    done[i] = Some(Ok(Completion {
                        text,
                        tokens,
                        finished,
                    }));
                }
                Event::Error { error, .. } => done[i] = Some(Err(error)),
            }
        }
        Ok(done
            .into_iter()
            .map(|d| d.unwrap_or(Err(TandemError::Unavailable)))
            .collect())
    }

    /// Runs a request to the end and collects its text.
    pub async fn complete(&self, request: GenerateRequest) -> Result<Completion, TandemError> {
        let mut stream = self.generate(request).await?;
        let (mut text, mut tokens) = (String::new(), Vec::new());
        while let Some(event) = stream.next_event().await {
            match event {
                Event::Tokens {
                    text: t,
                    tokens: mut ts,
                    ..
                } => {
                    text.push_str(&t);
                    tokens.append(&mut ts);
                }
                Event::Finished(finished) => {
                    return Ok(Completion {
                        text,
                        tokens,
                        finished,
                    })
                }
                Event::Error { error, .. } => return Err(error),
            }
        }
        Err(TandemError::Unavailable)
    }

    /// Cancels a request; true when this call ended it.
    pub async fn cancel(&self, id: RequestId) -> Result<bool, TandemError> {
        self.scheduler
            .send(Cancel {
                id,
                reason: CancelReason::Client,
            })
            .await
            .map_err(|_| TandemError::Unavailable)
    }

    /// A snapshot of the scheduler's counters and histograms.
    pub async fn stats(&self) -> Result<SchedulerStats, TandemError> {
        self.scheduler
            .send(Stats)
            .await
            .map_err(|_| TandemError::Unavailable)
    }

    /// Stops accepting requests, drains or aborts the outstanding ones, and
    /// stops the scheduler and its engine thread.
    pub async fn shutdown(&self, mode: ShutdownMode) -> Result<(), TandemError> {
        self.scheduler
            .send(Shutdown { mode })
            .await
            .map_err(|_| TandemError::Unavailable)??;
        Ok(())
    }
}

/// The events of one request. Dropping it before the terminal event cancels
/// the request (its slot is freed at the next step boundary).
pub struct EventStream {
    id: RequestId,
    rx: mpsc::UnboundedReceiver<Event>,
    scheduler: Addr<Scheduler>,
    done: bool,
}

impl EventStream {
    pub fn id(&self) -> RequestId {
        self.id
    }

    /// The next event; `None` after the terminal one.
    pub async fn next_event(&mut self) -> Option<Event> {
        if self.done {
            return None;
        }
        let event = self.rx.recv().await;
        self.done = event.as_ref().is_none_or(Event::is_terminal);
        event
    }
}

impl Stream for EventStream {
    type Item = Event;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Option<Event>> {
        if self.done {
            return Poll::Ready(None);
        }
        let poll = self.rx.poll_recv(cx);
        if let Poll::Ready(event) = &poll {
            self.done = event.as_ref().is_none_or(Event::is_terminal);
        }
        poll
    }
}

impl Drop for EventStream {
    fn drop(&mut self) {
        if !self.done {
            self.scheduler.do_send(Cancel {
                id: self.id,
                reason: CancelReason::Client,
            });
        }
    }
}

/// The events of one request's choices ([`TandemHandle::generate_choices`]),
/// interleaved as they come, each tagged with its choice's index. Per
/// choice, events keep their order ([`Event`]'s contract). Dropping it
/// before every choice's terminal event cancels the choices still running.
pub struct ChoiceStream {
    /// Choice `i`'s request id is `ids[i]`.
    ids: Vec<RequestId>,
    rx: mpsc::UnboundedReceiver<Event>,
    scheduler: Addr<Scheduler>,
    /// Choices whose terminal event has not arrived.
    open: Vec<bool>,
}

impl ChoiceStream {
    /// The choices' request ids, in choice order.
    pub fn ids(&self) -> &[RequestId] {
        &self.ids
    }

    /// How many choices.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// The next event and its choice; `None` once every choice ended.
    pub async fn next_event(&mut self) -> Option<(usize, Event)> {
        std::future::poll_fn(|cx| Pin::new(&mut *self).poll_next(cx)).await
    }

    /// Tags an event with its choice and notes a terminal one.
    fn tag(&mut self, event: Event) -> Option<(usize, Event)> {
        let i = self.ids.iter().position(|&id| id == event.id())?;
        if event.is_terminal() {
            self.open[i] = false;
        }
        Some((i, event))
    }
}

impl Stream for ChoiceStream {
    type Item = (usize, Event);

    fn poll_next(
        mut self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
    ) -> Poll<Option<(usize, Event)>> {
        loop {
            if !self.open.contains(&true) {
                return Poll::Ready(None);
            }
            match self.rx.poll_recv(cx) {
                Poll::Ready(Some(event)) => {
                    if let Some(tagged) = self.tag(event) {
                        return Poll::Ready(Some(tagged));
                    }
                }
                Poll::Ready(None) => {
                    self.open.iter_mut().for_each(|o| *o = false);
                    return Poll::Ready(None);
                }
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

impl From<EventStream> for ChoiceStream {
    /// One request as a stream of one choice (index 0).
    fn from(mut single: EventStream) -> Self {
        let (_, closed) = mpsc::unbounded_channel();
        let open = vec![!single.done];
        // The events now belong to the choice stream, which cancels on drop.
        single.done = true;
        Self {
            ids: vec![single.id],
            rx: std::mem::replace(&mut single.rx, closed),
            scheduler: single.scheduler.clone(),
            open,
        }
    }
}

impl Drop for ChoiceStream {
    fn drop(&mut self) {
        for (&id, _) in self.ids.iter().zip(&self.open).filter(|(_, &open)| open) {
            self.scheduler.do_send(Cancel {
                id,
                reason: CancelReason::Client,
            });
        }
    }
}
