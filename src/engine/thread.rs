//! The engine thread: a plain OS thread that owns a [`StepExecutor`] (and so
//! every tensor) and runs one plan at a time.
//!
//! Plans arrive over a crossbeam channel; each outcome is handed to a
//! callback (the scheduler passes one that `do_send`s to its own mailbox).
//! The thread never touches an async runtime, so a long forward pass cannot
//! stall the actors. It exits when told to, or when every sender is gone.
//!
//! Between steps it polls for the next plan for up to `POLL` (yielding
//! its core each time) before it parks: the scheduler answers an outcome
//! with the next plan within tens of microseconds, while a parked thread
//! pays a wake-up and starts the step on a cold core. On a GPU, where a
//! step is a couple of milliseconds of kernel launches, that was several
//! percent of the actor path's throughput.

use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvError, Sender, TryRecvError};

use super::protocol::{EngineInfo, StepExecutor, StepOutcome, StepPlan};

/// Commands to the engine thread.
#[derive(Debug)]
pub enum EngineCommand {
    Step(StepPlan),
    Shutdown,
}

/// The sending side of the engine thread, owned by the scheduler.
pub struct EngineThread {
    tx: Sender<EngineCommand>,
    join: Option<JoinHandle<()>>,
    info: EngineInfo,
}

impl EngineThread {
    /// Starts the thread. `on_outcome` runs on the engine thread after each
    /// step; it should only hand the outcome off (e.g. `Addr::do_send`).
    pub fn spawn<E, F>(executor: E, on_outcome: F) -> std::io::Result<Self>
    where
        E: StepExecutor,
        F: FnMut(StepOutcome) + Send + 'static,
    {
        let info = executor.info();
        let (tx, rx) = crossbeam_channel::unbounded();
        let join = std::thread::Builder::new()
            .name("tandem-engine".into())
            .spawn(move || run(executor, rx, on_outcome))?;
        Ok(Self {
            tx,
            join: Some(join),
            info,
        })
    }

    pub fn info(&self) -> &EngineInfo {
        &self.info
    }

    /// Queues a plan. Returns false when the thread is gone.
    pub fn submit(&self, plan: StepPlan) -> bool {
        self.tx.send(EngineCommand::Step(plan)).is_ok()
    }

    /// Stops the thread after the plan in progress and waits for it.
    pub fn shutdown(&mut self) {
        let _ = self.tx.send(EngineCommand::Shutdown);
        if let Some(join) = self.join.take() {
            let _ = join.join();
        }
    }
}

impl Drop for EngineThread {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// How long the thread polls for the next plan before it parks.
const POLL: Duration = Duration::from_micros(200);

/// The next command: polled for a while, then waited for.
fn next_command(rx: &Receiver<EngineCommand>) -> Result<EngineCommand, RecvError> {
    let start = Instant::now();
    loop {
        match rx.try_recv() {
            Ok(cmd) => return Ok(cmd),
            Err(TryRecvError::Disconnected) => return Err(RecvError),
            Err(TryRecvError::Empty) if start.elapsed() < POLL => std::thread::yield_now(),
            Err(TryRecvError::Empty) => return rx.recv(),
        }
    }
}

fn run<E: StepExecutor, F: FnMut(StepOutcome)>(
    mut executor: E,
    rx: Receiver<EngineCommand>,
    mut on_outcome: F,
) {
    while let Ok(cmd) = next_command(&rx) {
        match cmd {
            EngineCommand::Step(plan) => {
                let step = plan.step;
                let _span = tracing::debug_span!("engine_step", step).entered();
                on_outcome(executor.execute(plan));
            }
            EngineCommand::Shutdown => break,
        }
    }
}
