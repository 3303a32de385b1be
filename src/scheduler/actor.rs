//! The actix shell around the scheduling core: message handlers, the engine
//! thread, event routing and shutdown.
//!
//! The actor lives on the caller's actix arbiter and never runs the model:
//! plans go to the engine thread over its channel, and the engine's outcome
//! callback `do_send`s a [`StepDone`] back into this actor's mailbox. Nor
//! does it touch text: a `Generate` is tokenized and checked on a blocking
//! worker (`request::check_choices`), and only the checked request comes back
//! to the mailbox. While a plan is in flight, every millisecond this actor
//! spends is time the next plan waits.
//!
//! One step, from the actor's side:
//! 1. `StepDone(N)` arrives; the core applies it (counters, tokens, ends).
//! 2. Requesters that disconnected are cancelled (their slots join `release`).
//! 3. Plan N+1 is built and submitted at once, so the engine is busy again.
//! 4. Only then are step N's events routed to the requesters' mailboxes.
//!
//! When nothing is runnable the actor idles with no plan in flight; a
//! `Submit` (or anything else that creates work) sends a `Kick` through the
//! mailbox, so a burst of submissions already queued is admitted together.
//!
//! The engine callback holds only a `WeakAddr`, so dropping every `Addr`
//! stops the actor; `stopped` then ends every request and joins the engine.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use actix::WeakAddr;
use tokio::sync::{oneshot, Semaphore};

use crate::engine::{EngineInfo, EngineThread, StepExecutor, StepOutcome};
use crate::tokenizer::Tokenizer;

use super::messages::{EngineExited, Kick};
use super::state::SchedulerState;
use super::validate::{validate_seq, ValidSeq};
use super::{
    Cancel, CancelReason, RequestId, SchedulerConfig, SchedulerError, SchedulerStats, SeqEvent,
    SeqRequest, Shutdown, ShutdownMode, Stats, StepDone, Submit,
};

/// The scheduler actor. Start it with [`Scheduler::start`].
pub struct Scheduler {
    /// All scheduling state (queue, slots, counters); see `state`.
    state: SchedulerState,
    /// The engine thread; `None` once joined (shutdown or engine death).
    engine: Option<EngineThread>,
    /// Where each live request's events go. An entry is removed with the
    /// request's terminal event, or when its recipient is found gone.
    routes: HashMap<RequestId, Recipient<SeqEvent>>,
    /// Events produced by the core, routed at the end of each handler.
    outbox: Vec<SeqEvent>,
    /// A `Kick` is in the mailbox.
    kick_pending: bool,
    /// Set by the first `Shutdown`.
    shutdown: Option<ShutdownState>,
    /// When the last plan was submitted (busy-time metrics).
    last_submit: Option<Instant>,
    /// Tokenizer for text requests (`Generate`); `None` for a token-only scheduler.
    tokenizer: Option<Arc<Tokenizer>>,
    /// Permits for the blocking threads that tokenize and check `Generate`
    /// requests, one per core: a burst of text requests then waits for a
    /// permit instead of growing tokio's blocking pool toward its 512
    /// threads, which would only compete with the engine for the cores.
    text_workers: Arc<Semaphore>,
    /// The engine's limits, which every request is checked against.
    info: EngineInfo,
}

struct ShutdownState {
    mode: ShutdownMode,
    waiters: Vec<oneshot::Sender<()>>,
}

impl Scheduler {
    /// Validates `config` against the executor's [`EngineInfo`], spawns the
    /// engine thread that owns `executor`, and starts the actor on the
    /// current arbiter (call it inside a running actix `System`).
    ///
    /// [`EngineInfo`]: crate::engine::EngineInfo
    pub fn start<E: StepExecutor>(
        executor: E,
        config: SchedulerConfig,
    ) -> Result<Addr<Scheduler>, SchedulerError> {
        Self::start_inner(executor, config, None)
    }

    /// Like [`start`](Self::start), and also serves text requests
    /// ([`crate::request::Generate`]) with `tokenizer`.
    pub fn start_with_tokenizer<E: StepExecutor>(
        executor: E,
        config: SchedulerConfig,
        tokenizer: Arc<Tokenizer>,
    ) -> Result<Addr<Scheduler>, SchedulerError> {
        Self::start_inner(executor, config, Some(tokenizer))
    }

    /// The tokenizer text requests use, if any.
    pub(crate) fn tokenizer(&self) -> Option<&Arc<Tokenizer>> {
        self.tokenizer.as_ref()
    }

    /// The permits of the text layer's tokenizing threads.
    pub(crate) fn text_workers(&self) -> &Arc<Semaphore> {
        &self.text_workers
    }

    /// The engine's limits.
    pub(crate) fn engine_info(&self) -> &EngineInfo {
        &self.info
    }

    fn start_inner<E: StepExecutor>(
        executor: E,
        config: SchedulerConfig,
        tokenizer: Option<Arc<Tokenizer>>,
    ) -> Result<Addr<Scheduler>, SchedulerError> {
        let info = executor.info();
        config.validate(&info)?;
        let ctx = Context::<Scheduler>::new();
        let forwarder = OutcomeForwarder {
            addr: ctx.address().downgrade(),
        };
        let engine = EngineThread::spawn(executor, move |outcome| forwarder.forward(outcome))
            .map_err(|e| SchedulerError::EngineSpawn(e.to_string()))?;
        tracing::debug!(
            model = %info.model_name,
            max_seqs = config.max_seqs,
            step_token_budget = config.step_token_budget,
            kv_capacity = info.kv_capacity_tokens,
            "scheduler starting"
        );
        let actor = Scheduler {
            state: SchedulerState::new(&config, info.clone()),
            engine: Some(engine),
            routes: HashMap::new(),
            outbox: Vec::new(),
            kick_pending: false,
            shutdown: None,
            last_submit: None,
            tokenizer,
            text_workers: Arc::new(Semaphore::new(
                std::thread::available_parallelism().map_or(1, |n| n.get()),
            )),
            info,
        };
        Ok(ctx.run(actor))
    }

    fn is_live(routes: &HashMap<RequestId, Recipient<SeqEvent>>, id: RequestId) -> bool {
        routes.get(&id).is_some_and(|r| r.connected())
    }

    /// Schedules a step through the mailbox unless one is running or queued.
    fn kick(&mut self, ctx: &mut Context<Self>) {
        if !self.kick_pending && !self.state.plan_in_flight() && self.engine.is_some() {
            self.kick_pending = true;
            ctx.address().do_send(Kick);
        }
    }

    /// Steps 2–4 of a step (see the module doc). `engine_time` is the
    /// finished step's engine time when called from `StepDone`.
    fn advance(&mut self, ctx: &mut Context<Self>, t0: Instant, engine_time: Option<Duration>) {
        self.cancel_gone_requesters(t0);
        let aborting = matches!(&self.shutdown, Some(s) if s.mode == ShutdownMode::Abort);
        let span = if aborting {
            None
        } else {
            self.submit_next(t0, engine_time)
        };
        let _entered = span.as_ref().map(|s| s.enter());
        let t1 = Instant::now();
        let cancelled = self.route_events();
        if span.is_some() {
            let metrics = self.state.metrics_mut();
            metrics.steps.record_plan(t1 - t0);
            metrics.steps.record_route(t1.elapsed());
        } else if cancelled && !aborting {
            // Idle, but routing found a requester gone: its release needs a plan.
            self.kick(ctx);
        }
        self.try_finish_shutdown(ctx);
    }

    /// Builds and submits the next plan; returns its tracing span.
    fn submit_next(
        &mut self,
        now: Instant,
        engine_time: Option<Duration>,
    ) -> Option<tracing::Span> {
        let routes = &self.routes;
        let (plan, s) = self
            .state
            .plan(now, |id| Self::is_live(routes, id), &mut self.outbox)?;
        let span = tracing::debug_span!(
            "step",
            step = s.step,
            seqs = s.seqs,
            tokens = s.tokens,
            prefills = s.prefills,
            decodes = s.decodes,
            admitted = s.admitted,
            released = s.released,
        );
        let submitted = self.engine.as_ref().is_some_and(|e| e.submit(plan));
        if !submitted {
            span.in_scope(|| tracing::warn!("engine thread gone; failing every request"));
            self.state.abandon_in_flight();
            self.state
                .fail_all(SchedulerError::EngineGone, &mut self.outbox);
            return None;
        }
        let at = Instant::now();
        if let (Some(prev), Some(engine)) = (self.last_submit, engine_time) {
            self.state
                .metrics_mut()
                .steps
                .record_busy_interval(at - prev, engine);
        }
        self.last_submit = Some(at);
        Some(span)
    }

    /// Cancels running requests whose recipient disconnected. Their terminal
    /// event has nowhere to go, so it is discarded.
    fn cancel_gone_requesters(&mut self, now: Instant) {
        for id in self.state.running_ids() {
            if !Self::is_live(&self.routes, id) {
                tracing::debug!(%id, "requester gone; cancelling");
                self.routes.remove(&id);
                let mut discard = Vec::new();
                self.state
                    .cancel(id, CancelReason::Client, now, &mut discard);
            }
        }
    }

    /// Sends every event in the outbox to its requester, in order. Returns
    /// whether a gone requester's request was cancelled on the way.
    fn route_events(&mut self) -> bool {
        let now = Instant::now();
        let mut cancelled = false;
        for event in std::mem::take(&mut self.outbox) {
            let id = event.id();
            let terminal = event.is_terminal();
            let Some(recipient) = self.routes.get(&id) else {
                continue; // the requester is gone; nothing to deliver
            };
            let delivered = match recipient.try_send(event) {
                Ok(()) => true,
                // The mailbox is past its soft capacity: deliver anyway (the
                // backlog is bounded by the request's length) and keep order.
                Err(SendError::Full(event)) => {
                    recipient.do_send(event);
                    true
                }
                Err(SendError::Closed(_)) => false,
            };
            if terminal || !delivered {
                self.routes.remove(&id);
            }
            if !delivered && !terminal {
                tracing::debug!(%id, "requester gone while routing; cancelling");
                let mut discard = Vec::new();
                cancelled |= self
                    .state
                    .cancel(id, CancelReason::Client, now, &mut discard);
            }
        }
        cancelled
    }

    /// Completes a shutdown once its conditions hold: no plan in flight, and
    /// (for `Drain`) nothing left queued or running.
    fn try_finish_shutdown(&mut self, ctx: &mut Context<Self>) {
        let Some(shutdown) = &self.shutdown else {
            return;
        };
        if self.state.plan_in_flight() {
            return;
        }
        if shutdown.mode == ShutdownMode::Drain && !self.state.is_drained() {
            return;
        }
        if let Some(mut engine) = self.engine.take() {
            // Idle (no plan in flight), so the join is immediate.
            engine.shutdown();
        }
        tracing::debug!(mode = ?shutdown.mode, "scheduler stopped");
        ctx.stop();
    }
}

impl Actor for Scheduler {
    type Context = Context<Self>;

    /// Whatever stopped the actor, no request is left without a terminal
    /// event and no engine thread is left running. On an unplanned stop
    /// (every `Addr` dropped) the join waits for the step in progress.
    fn stopped(&mut self, _ctx: &mut Self::Context) {
        self.state.stop_accepting(SchedulerError::ShuttingDown);
        self.state.cancel_all(Instant::now(), &mut self.outbox);
        self.route_events();
        if let Some(mut engine) = self.engine.take() {
            engine.shutdown();
        }
        if let Some(shutdown) = self.shutdown.take() {
            for waiter in shutdown.waiters {
                let _ = waiter.send(());
            }
        }
    }
}

impl Handler<Submit> for Scheduler {
    type Result = Result<RequestId, SchedulerError>;

    fn handle(&mut self, Submit(request): Submit, ctx: &mut Context<Self>) -> Self::Result {
        self.submit_request(request, ctx)
    }
}

impl Scheduler {
    /// Checks and queues a token-level request (the body of `Submit`). The
    /// checks are one pass over the prompt ids, cheap enough for the mailbox.
    fn submit_request(
        &mut self,
        request: SeqRequest,
        ctx: &mut Context<Self>,
    ) -> Result<RequestId, SchedulerError> {
        let SeqRequest {
            prompt,
            sampling,
            max_new_tokens,
            spec,
            events,
        } = request;
        match validate_seq(prompt, sampling, max_new_tokens, spec, &self.info) {
            Ok(seq) => self.submit_valid(seq, events, ctx),
            Err(e) => {
                self.state.count_rejected();
                Err(e)
            }
        }
    }

    /// Queues a request checked at the edge; `events` is where its
    /// [`SeqEvent`]s go. Used by `Submit`.
    pub(crate) fn submit_valid(
        &mut self,
        seq: ValidSeq,
        events: Recipient<SeqEvent>,
        ctx: &mut Context<Self>,
    ) -> Result<RequestId, SchedulerError> {
        self.make_queue_room();
        let id = self.state.submit(seq, Instant::now())?;
        self.routes.insert(id, events);
        self.kick(ctx);
        Ok(id)
    }

    /// Queues the choices of one request (each with where its events go)
    /// together, all or none; the later ones share the first one's prompt
    /// blocks. Used by the text layer's `Generate` and `GenerateChoices`.
    pub(crate) fn submit_valid_group(
        &mut self,
        choices: Vec<(ValidSeq, Recipient<SeqEvent>)>,
        ctx: &mut Context<Self>,
    ) -> Result<Vec<RequestId>, SchedulerError> {
        self.make_queue_room();
        let (seqs, recipients): (Vec<_>, Vec<_>) = choices.into_iter().unzip();
        let ids = self.state.submit_group(seqs, Instant::now())?;
        for (&id, events) in ids.iter().zip(recipients) {
            self.routes.insert(id, events);
        }
        self.kick(ctx);
        Ok(ids)
    }

    /// When the queue is full, drops queued requests whose requester is
    /// gone: dead entries must not hold queue space against live clients.
    fn make_queue_room(&mut self) {
        if self.state.queue_full() {
            let routes = &self.routes;
            self.state.drop_dead_queued(
                |id| Self::is_live(routes, id),
                Instant::now(),
                &mut self.outbox,
            );
            self.route_events();
        }
    }

    /// Sequence slots: the most choices one request may have.
    pub(crate) fn max_seqs(&self) -> usize {
        self.state.max_seqs()
    }

    /// Counts a request that failed the text layer's checks (they run off
    /// this mailbox, so the core never saw it).
    pub(crate) fn count_rejected(&mut self) {
        self.state.count_rejected();
    }
}

impl Handler<Cancel> for Scheduler {
    type Result = bool;

    fn handle(&mut self, msg: Cancel, ctx: &mut Context<Self>) -> bool {
        let ended = self
            .state
            .cancel(msg.id, msg.reason, Instant::now(), &mut self.outbox);
        self.route_events();
        // A running request's release goes out with the next plan; usually
        // one is in flight already and this is a no-op.
        self.kick(ctx);
        self.try_finish_shutdown(ctx);
        ended
    }
}

impl Handler<Stats> for Scheduler {
    type Result = MessageResult<Stats>;

    fn handle(&mut self, _: Stats, _: &mut Context<Self>) -> MessageResult<Stats> {
        let stats: SchedulerStats = self.state.stats();
        MessageResult(stats)
    }
}

impl Handler<Shutdown> for Scheduler {
    type Result = ResponseFuture<Result<(), SchedulerError>>;

    fn handle(&mut self, msg: Shutdown, ctx: &mut Context<Self>) -> Self::Result {
        let (tx, rx) = oneshot::channel();
        self.state.stop_accepting(SchedulerError::ShuttingDown);
        let shutdown = self.shutdown.get_or_insert(ShutdownState {
            mode: msg.mode,
            waiters: Vec::new(),
        });
        shutdown.waiters.push(tx);
        if msg.mode == ShutdownMode::Abort {
            shutdown.mode = ShutdownMode::Abort;
            self.state.cancel_all(Instant::now(), &mut self.outbox);
            self.route_events();
        }
        tracing::debug!(mode = ?msg.mode, "shutdown requested");
        self.try_finish_shutdown(ctx);
        // A dropped sender means the actor is gone, which is what was asked.
        Box::pin(async move {
            let _ = rx.await;
            Ok(())
        })
    }
}

impl Handler<StepDone> for Scheduler {
    type Result = ();

    fn handle(&mut self, StepDone(outcome): StepDone, ctx: &mut Context<Self>) {
        let t0 = Instant::now();
        let engine_time = self.state.apply_outcome(outcome, t0, &mut self.outbox);
        self.advance(ctx, t0, engine_time);
    }
}

impl Handler<Kick> for Scheduler {
    type Result = ();

    fn handle(&mut self, _: Kick, ctx: &mut Context<Self>) {
        self.kick_pending = false;
        if !self.state.plan_in_flight() {
            self.advance(ctx, Instant::now(), None);
        }
    }
}

impl Handler<EngineExited> for Scheduler {
    type Result = ();

    /// The engine thread ended on its own (a panic in the executor, most
    /// likely): every request fails and new ones are refused.
    fn handle(&mut self, _: EngineExited, ctx: &mut Context<Self>) {
        let Some(engine) = self.engine.take() else {
            return; // we joined it ourselves during shutdown
        };
        tracing::error!("engine thread exited unexpectedly");
        drop(engine); // joins the finished thread
        self.state
            .fail_all(SchedulerError::EngineGone, &mut self.outbox);
        self.route_events();
        self.try_finish_shutdown(ctx);
    }
}

/// The engine side of the hand-off: forwards outcomes to the actor and, when
/// the engine thread ends (it owns this value), tells the actor so. Holds a
/// `WeakAddr` so the engine thread does not keep the actor alive.
struct OutcomeForwarder {
    addr: WeakAddr<Scheduler>,
}

impl OutcomeForwarder {
    fn forward(&self, outcome: StepOutcome) {
        if let Some(addr) = self.addr.upgrade() {
            addr.do_send(StepDone(outcome));
        }
    }
}

impl Drop for OutcomeForwarder {
    fn drop(&mut self) {
        if let Some(addr) = self.addr.upgrade() {
            addr.do_send(EngineExited);
        }
    }
}
