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

use crate::api::{
    Event, Finished, GenerateRequest, OutputConstraints, Prompt, TandemError, TokenInfo, TopLogprob,
};
use crate::engine::{EngineInfo, SeqConstraints};
use crate::sampler::{LogitBias, SamplingOptions};
use crate::scheduler::validate::{validate_seq, ValidSeq};
use crate::scheduler::{Cancel, CancelReason, FinishReason, RequestId, Scheduler, SeqEvent};
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
    /// Tokens whose payloads reached the sink (see `Finished` below).
    emitted: usize,
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
            emitted: 0,
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
            self.emitted += chunk.payloads.len();
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
                mut usage,
                timings,
                ..
            } => {
                if self.stopped_by.is_none() && reason != FinishReason::Cancelled {
                    let step = self.stream.finish();
                    self.forward(step);
                }
                if self.stopped_by.is_some() {
                    reason = FinishReason::Stop;
                    // Tokens that a matched stop string swallowed (its own
                    // and any an MTP step produced past it) are neither
                    // sent nor counted: `completion_tokens` is the number
                    // of tokens in the answer, one per logprobs entry, as
                    // OpenAI-style clients compare them. The scheduler's
                    // own counters (`tandem_generated_tokens_total`) still
                    // count every token the model produced.
                    usage.completion_tokens = usage.completion_tokens.min(self.emitted);
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
///
/// The prompt is tokenized and the request checked on a blocking worker
/// thread, not on the scheduler's mailbox, so requests sent together may be
/// queued in the order their checks finish rather than the order sent.
#[derive(Message)]
#[rtype(result = "Result<RequestId, TandemError>")]
pub struct Generate {
    pub request: GenerateRequest,
    pub events: EventSink,
}

impl Handler<Generate> for Scheduler {
    type Result = ResponseActFuture<Self, Result<RequestId, TandemError>>;

    /// One choice: a [`GenerateChoices`] with `n` = 1.
    fn handle(&mut self, msg: Generate, ctx: &mut Context<Self>) -> Self::Result {
        let Generate { request, events } = msg;
        let choices = GenerateChoices {
            request,
            n: 1,
            events,
        };
        Box::pin(
            Handler::<GenerateChoices>::handle(self, choices, ctx)
                .map(|ids, _, _| ids.map(|ids| ids[0])),
        )
    }
}

/// Submit one text request for `n` choices: `n` sequences that share the
/// prompt (it is tokenized and checked once, and prefilled once: the later
/// choices start from the first one's computed prompt blocks) and sample
/// independently. Choice `i` samples with seed `seed + i` (wrapping) when
/// the request has a seed, so each choice equals a single request with
/// that seed; without one, every choice draws its own seed. All of a
/// request's events go to `events`, each carrying its choice's id; the
/// reply lists the ids in choice order. `n` must be in `1..=max_seqs`.
#[derive(Message)]
#[rtype(result = "Result<Vec<RequestId>, TandemError>")]
pub struct GenerateChoices {
    pub request: GenerateRequest,
    /// How many choices.
    pub n: usize,
    pub events: EventSink,
}

impl Handler<GenerateChoices> for Scheduler {
    type Result = ResponseActFuture<Self, Result<Vec<RequestId>, TandemError>>;

    /// Hands the text work to a worker thread and waits for it without
    /// holding the mailbox: the scheduler keeps routing tokens and planning
    /// steps meanwhile. Only the checked choices come back to this actor.
    fn handle(&mut self, msg: GenerateChoices, _ctx: &mut Context<Self>) -> Self::Result {
        let refuse = |scheduler: &mut Self, error| {
            scheduler.count_rejected();
            Box::pin(actix::fut::ready(Err(error))) as Self::Result
        };
        let Some(tokenizer) = self.tokenizer().cloned() else {
            let reason =
                "this scheduler was started without a tokenizer; submit token ids with `Submit`";
            let error = TandemError::InvalidRequest {
                field: "prompt",
                reason: reason.into(),
            };
            return refuse(self, error);
        };
        let GenerateChoices { request, n, events } = msg;
        if let Err(error) = check_choice_count(n, self.max_seqs()) {
            return refuse(self, error);
        }
        let info = self.engine_info().clone();
        let workers = self.text_workers().clone();
        let worker_tokenizer = tokenizer.clone();
        let checking = async move {
            // The semaphore is never closed, so the permit always comes.
            let _permit = workers.acquire_owned().await.ok();
            tokio::task::spawn_blocking(move || check_choices(request, n, &worker_tokenizer, &info))
                .await
        };
        Box::pin(
            checking
                .into_actor(self)
                .map(move |checked, scheduler, ctx| {
                    let checked = checked.unwrap_or_else(|join| {
                        Err(TandemError::Internal(format!(
                            "the worker checking the request failed: {join}"
                        )))
                    });
                    scheduler.queue_text(checked, events, tokenizer, ctx)
                }),
        )
    }
}

/// `n` choices must fit the scheduler's slots at once (so that they can
/// share the prompt's blocks).
fn check_choice_count(n: usize, max_seqs: usize) -> Result<(), TandemError> {
    if n == 0 || n > max_seqs {
        return Err(TandemError::InvalidRequest {
            field: "n",
            reason: format!("must be in [1, {max_seqs}] (`max_seqs`: the sequence slots), got {n}"),
        });
    }
    Ok(())
}

impl Scheduler {
    /// Back on the mailbox with a request's checked choices: starts a
    /// request actor per choice and queues them as one group; a refusal is
    /// counted like one at `Submit`.
    fn queue_text(
        &mut self,
        checked: Result<Vec<CheckedText>, TandemError>,
        events: EventSink,
        tokenizer: Arc<Tokenizer>,
        ctx: &mut Context<Self>,
    ) -> Result<Vec<RequestId>, TandemError> {
        let checked = checked.inspect_err(|_| self.count_rejected())?;
        let choices = checked
            .into_iter()
            .map(|c| {
                let actor =
                    RequestActor::new(c.stream, events.clone(), ctx.address(), tokenizer.clone());
                (c.seq, actor.start().recipient())
            })
            .collect();
        Ok(self.submit_valid_group(choices, ctx)?)
    }
}

/// A text request after the edge's checks: the token-level [`ValidSeq`] the
/// scheduler carries, and the request actor's text state (detokenizer and
/// stop strings, primed with the prompt).
pub(crate) struct CheckedText {
    pub seq: ValidSeq,
    pub stream: TextStream<TokenInfo>,
}

/// Tokenizes a text request and checks it against the engine's limits: the
/// text layer's own fields (`max_tokens` resolved against the context,
/// non-empty stop strings), then [`validate_seq`] for everything the
/// scheduler and the engine rely on, once per choice. The prompt is
/// tokenized once; choice `i` gets the request's seed plus `i` (see
/// [`GenerateChoices`]) and its own detokenizer and stop-string matcher.
/// Blocking (tokenizer work); run it off the scheduler's mailbox.
pub(crate) fn check_choices(
    request: GenerateRequest,
    n: usize,
    tokenizer: &Arc<Tokenizer>,
    info: &EngineInfo,
) -> Result<Vec<CheckedText>, TandemError> {
    let GenerateRequest {
        prompt,
        max_tokens,
        sampling,
        stop,
        mtp,
        constraints,
    } = request;
    let prompt: Vec<u32> = match prompt {
        Prompt::Text(text) => tokenizer.encode(&text)?,
        Prompt::Tokens(ids) => ids,
    };
    let context_len = info.context_len;
    let max_new_tokens = match max_tokens {
        // `max_new_tokens` 0 is refused by `validate_seq` too, but that
        // error names the token-level field, not the one this caller sent.
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
    let prompt: Arc<[u32]> = Arc::from(prompt);
    let constraints = compile_constraints(constraints, tokenizer)?;
    (0..n)
        .map(|i| {
            let sampling = choice_sampling(&sampling, i);
            // Each choice gets its own copy of the compiled grammar's state.
            let seq = validate_seq(prompt.clone(), sampling, max_new_tokens, mtp, info)?
                .with_constraints(constraints.clone(), info)?;
            let stream = TextStream::with_context(tokenizer.clone(), stop.clone(), &prompt)?;
            Ok(CheckedText { seq, stream })
        })
        .collect()
}

/// The sampling options of choice `index`: the request's, with the seed
/// moved on by the index (wrapping), so choice 0 is the request itself.
// `clone`, not a copy: the options need not stay `Copy` (per-request lists).
#[allow(clippy::clone_on_copy)]
pub fn choice_sampling(sampling: &SamplingOptions, index: usize) -> SamplingOptions {
    SamplingOptions {
        seed: sampling.seed.map(|s| s.wrapping_add(index as u64)),
        ..sampling.clone()
    }
}

/// Compiles the request's grammar against the tokenizer's vocabulary (the
/// token trie is built on the first constrained request) and packs the
/// bias and stop ids; their ids are checked by `with_constraints`.
/// Blocking: part of [`check_choices`].
fn compile_constraints(
    c: OutputConstraints,
    tokenizer: &Tokenizer,
) -> Result<SeqConstraints, TandemError> {
    let grammar = match &c.grammar {
        None => None,
        Some(constraint) => {
            let field = constraint.origin.field();
            let invalid = |reason: String| TandemError::InvalidRequest { field, reason };
            let compiler = tokenizer.grammar_compiler().map_err(invalid)?;
            Some(compiler.compile(&constraint.spec).map_err(invalid)?)
        }
    };
    if let Some(&(token, bias)) = c.logit_bias.iter().find(|(_, b)| !b.is_finite()) {
        return Err(TandemError::InvalidRequest {
            field: "logit_bias",
            reason: format!("the bias of token {token} must be finite, got {bias}"),
        });
    }
    Ok(SeqConstraints {
        grammar,
        logit_bias: LogitBias::new(c.logit_bias),
        stop_ids: c.stop_token_ids,
    })
}
