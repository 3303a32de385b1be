//! A requester actor that forwards every [`SeqEvent`] it receives to a
//! channel the test reads, plus checks on one request's event stream.

use std::collections::HashMap;
use std::time::Duration;

use actix::prelude::*;
use tandem::scheduler::{FinishReason, RequestId, SeqEvent, Usage};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

/// Forwards events to the test; stops on [`StopCollector`].
pub struct Collector {
    tx: UnboundedSender<SeqEvent>,
}

impl Actor for Collector {
    type Context = Context<Self>;
}

impl Handler<SeqEvent> for Collector {
    type Result = ();

    fn handle(&mut self, event: SeqEvent, _: &mut Context<Self>) {
        let _ = self.tx.send(event);
    }
}

/// Stops the collector, as a requester that goes away would.
#[derive(Message)]
#[rtype(result = "()")]
pub struct StopCollector;

impl Handler<StopCollector> for Collector {
    type Result = ();

    fn handle(&mut self, _: StopCollector, ctx: &mut Context<Self>) {
        ctx.stop();
    }
}

/// Starts a collector; its events come out of the receiver in arrival order.
pub fn collector() -> (Addr<Collector>, UnboundedReceiver<SeqEvent>) {
    let (tx, rx) = unbounded_channel();
    (Collector { tx }.start(), rx)
}

/// Reads events until `terminals` terminal events have arrived (panics after
/// `timeout`). Returns every event in arrival order.
pub async fn collect_terminals(
    rx: &mut UnboundedReceiver<SeqEvent>,
    terminals: usize,
    timeout: Duration,
) -> Vec<SeqEvent> {
    let mut events = Vec::new();
    let mut seen = 0;
    let deadline = tokio::time::Instant::now() + timeout;
    while seen < terminals {
        match tokio::time::timeout_at(deadline, rx.recv()).await {
            Ok(Some(e)) => {
                seen += usize::from(e.is_terminal());
                events.push(e);
            }
            Ok(None) => panic!("event channel closed after {seen}/{terminals} terminals"),
            Err(_) => panic!("timed out after {seen}/{terminals} terminal events: {events:?}"),
        }
    }
    events
}

/// Groups events by request, keeping each request's order.
pub fn by_id(events: Vec<SeqEvent>) -> HashMap<RequestId, Vec<SeqEvent>> {
    let mut map: HashMap<RequestId, Vec<SeqEvent>> = HashMap::new();
    for e in events {
        map.entry(e.id()).or_default().push(e);
    }
    map
}

/// How one request's stream ended.
#[derive(Debug, Clone, PartialEq)]
pub enum End {
    Finished(FinishReason, Usage),
    Failed(String),
}

/// One request's stream, checked.
#[derive(Debug, Clone)]
pub struct Stream {
    pub started: bool,
    pub tokens: Vec<u32>,
    pub end: End,
}

/// Checks the stream's shape: at most one `Started`, first; `Tokens`
/// indices contiguous from 0; exactly one terminal event, last. Returns
/// the tokens and the end.
pub fn check_stream(events: &[SeqEvent]) -> Stream {
    let mut started = false;
    let mut tokens = Vec::new();
    let mut end = None;
    for (i, e) in events.iter().enumerate() {
        assert!(end.is_none(), "event after the terminal one: {events:?}");
        match e {
            SeqEvent::Started { .. } => {
                assert!(
                    i == 0 && !started,
                    "Started must come once, first: {events:?}"
                );
                started = true;
            }
            SeqEvent::Tokens {
                first_index,
                tokens: new,
                ..
            } => {
                assert!(started, "tokens before Started: {events:?}");
                assert_eq!(*first_index, tokens.len(), "index gap: {events:?}");
                assert!(!new.is_empty(), "empty Tokens event");
                tokens.extend(new.iter().map(|t| t.id));
            }
            SeqEvent::Finished { reason, usage, .. } => {
                assert_eq!(usage.completion_tokens, tokens.len(), "usage: {events:?}");
                end = Some(End::Finished(*reason, *usage));
            }
            SeqEvent::Failed { error, .. } => end = Some(End::Failed(error.to_string())),
        }
    }
    Stream {
        started,
        tokens,
        end: end.unwrap_or_else(|| panic!("no terminal event: {events:?}")),
    }
}
