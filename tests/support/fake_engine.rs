//! A deterministic [`StepExecutor`] for scheduler tests.
//!
//! It behaves like the real engine at the protocol level: it registers slots
//! with their block tables (and applies preemptions, resumptions and table
//! updates), checks that prefill chunks are contiguous, that decodes only
//! follow a complete prompt (or recompute), that every fed token has room
//! in its table and that no block it writes is in another live table, ends
//! sequences itself (EOS, `max_new_tokens`, context full) and frees their
//! slots, and frees released slots. Token ids are a pure function of the prompt and the token index
//! ([`fake_token`]), so tests know every expected output ([`expected`]).
//!
//! A [`FakeProbe`] (shared with the executor) lets a test read every plan the
//! engine received, the slots still registered, whether the executor has
//! been dropped (the engine thread has exited), inject a failure, and hold
//! the engine between steps (pause / allow / resume).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tandem::engine::{
    Admission, EngineError, EngineInfo, GeneratedToken, KvGrant, SeqFinish, SeqOutcome,
    SeqProgress, SeqWork, SlotId, StepExecutor, StepOutcome, StepPlan, StepStats,
};

/// Tokens per KV block of the fake.
pub const BLOCK: usize = 16;
use tandem::scheduler::FinishReason;

/// Vocabulary size of the fake model.
pub const VOCAB: usize = 1000;
/// The end-of-sequence id.
pub const EOS: u32 = 0;
/// A prompt starting with this token ends with EOS at index `prompt[1]`.
pub const EOS_MARKER: u32 = 1;

/// The token the fake generates at `index` for `prompt`: EOS where a marked
/// prompt asks for it, otherwise a hash of the prompt and index in `2..VOCAB`.
pub fn fake_token(prompt: &[u32], index: usize) -> u32 {
    if prompt.len() >= 2 && prompt[0] == EOS_MARKER && prompt[1] as usize == index {
        return EOS;
    }
    let h = prompt
        .iter()
        .fold(17u64, |h, &t| h.wrapping_mul(31).wrapping_add(u64::from(t)));
    let mixed = h.wrapping_add((index as u64).wrapping_mul(7919));
    2 + (mixed % (VOCAB as u64 - 2)) as u32
}

/// The whole completion the fake produces for a request, and how it ends.
pub fn expected(prompt: &[u32], max_new: usize, context_len: usize) -> (Vec<u32>, FinishReason) {
    let mut out = Vec::new();
    loop {
        let t = fake_token(prompt, out.len());
        out.push(t);
        if t == EOS {
            return (out, FinishReason::Eos);
        }
        if out.len() == max_new {
            return (out, FinishReason::Length);
        }
        if prompt.len() + out.len() >= context_len {
            return (out, FinishReason::ContextFull);
        }
    }
}

/// Limits of the fake engine.
#[derive(Debug, Clone)]
pub struct FakeSettings {
    pub context_len: usize,
    pub kv_capacity_tokens: usize,
    /// Sleep per step, to give concurrent tests something to race against.
    pub step_delay: Duration,
}

impl Default for FakeSettings {
    fn default() -> Self {
        Self {
            context_len: 8192,
            kv_capacity_tokens: 1 << 20,
            step_delay: Duration::ZERO,
        }
    }
}

#[derive(Debug)]
struct FakeSeq {
    prompt: Arc<[u32]>,
    /// Positions in the KV.
    kv_len: usize,
    /// Recomputing after a preemption, up to this KV length.
    recompute: Option<usize>,
    generated: usize,
    max_new: usize,
    table: Vec<u32>,
    preempted: bool,
}

#[derive(Debug, Default)]
struct FakeState {
    seqs: HashMap<SlotId, FakeSeq>,
    /// Cached prefix tokens each admission started with, in order.
    pub cached: Vec<usize>,
    plans: Vec<StepPlan>,
    /// (first prompt token, token index): fail such a sequence there.
    fail_rules: Vec<(u32, usize)>,
}

#[derive(Debug, Default)]
struct Gate {
    paused: bool,
    permits: u64,
}

#[derive(Debug, Default)]
struct Shared {
    state: Mutex<FakeState>,
    gate: Mutex<Gate>,
    gate_cv: Condvar,
    dropped: AtomicBool,
}

/// The test's view of a [`FakeExecutor`].
#[derive(Debug, Clone, Default)]
pub struct FakeProbe(Arc<Shared>);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl FakeProbe {
    /// Every plan the engine has received, in order.
    pub fn plans(&self) -> Vec<StepPlan> {
        lock(&self.0.state).plans.clone()
    }

    pub fn plan_count(&self) -> usize {
        lock(&self.0.state).plans.len()
    }

    /// Slots the engine still holds.
    pub fn registered(&self) -> usize {
        lock(&self.0.state).seqs.len()
    }

    /// KV tokens in the blocks the engine's live tables hold.
    pub fn kv_used(&self) -> usize {
        let st = lock(&self.0.state);
        let blocks: std::collections::HashSet<u32> = st
            .seqs
            .values()
            .flat_map(|s| s.table.iter().copied())
            .collect();
        blocks.len() * BLOCK
    }

    /// Cached prefix tokens of every admission so far, in order.
    pub fn cached_at_admission(&self) -> Vec<usize> {
        lock(&self.0.state).cached.clone()
    }

    /// Whether the executor has been dropped (its thread has ended).
    pub fn dropped(&self) -> bool {
        self.0.dropped.load(Ordering::SeqCst)
    }

    /// Fails a sequence whose prompt starts with `first_token` when it is
    /// about to generate token `index`.
    pub fn fail_prompt(&self, first_token: u32, index: usize) {
        lock(&self.0.state).fail_rules.push((first_token, index));
    }

    /// Holds the engine before each following step until allowed. The
    /// guard resumes on drop, so a failing test unwinds instead of hanging
    /// in the engine thread's join.
    #[must_use = "dropping the guard resumes the engine at once"]
    pub fn pause(&self) -> PauseGuard {
        lock(&self.0.gate).paused = true;
        PauseGuard(self.clone())
    }

    /// Lets `n` more steps run while paused.
    pub fn allow(&self, n: u64) {
        lock(&self.0.gate).permits += n;
        self.0.gate_cv.notify_all();
    }

    /// Lets every step run.
    pub fn resume(&self) {
        lock(&self.0.gate).paused = false;
        self.0.gate_cv.notify_all();
    }

    /// Blocks while paused without a permit; gives up after [`GATE_LIMIT`]
    /// so a broken test cannot hold the engine thread forever.
    fn wait_gate(&self) {
        let deadline = Instant::now() + GATE_LIMIT;
        let mut gate = lock(&self.0.gate);
        while gate.paused && gate.permits == 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                eprintln!("fake engine: gate held for {GATE_LIMIT:?}; running anyway");
                return;
            }
            gate = self
                .0
                .gate_cv
                .wait_timeout(gate, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        if gate.paused {
            gate.permits -= 1;
        }
    }
}

/// The longest the gate holds a step.
const GATE_LIMIT: Duration = Duration::from_secs(30);

/// Resumes the fake engine when dropped (see [`FakeProbe::pause`]).
pub struct PauseGuard(FakeProbe);

impl Drop for PauseGuard {
    fn drop(&mut self) {
        self.0.resume();
    }
}

/// The fake engine; move it into `Scheduler::start`.
pub struct FakeExecutor {
    settings: FakeSettings,
    probe: FakeProbe,
}

impl FakeExecutor {
    pub fn new(settings: FakeSettings) -> (Self, FakeProbe) {
        let probe = FakeProbe::default();
        (
            Self {
                settings,
                probe: probe.clone(),
            },
            probe,
        )
    }
}

impl Drop for FakeExecutor {
    fn drop(&mut self) {
        self.probe.0.dropped.store(true, Ordering::SeqCst);
    }
}

impl StepExecutor for FakeExecutor {
    fn info(&self) -> EngineInfo {
        EngineInfo {
            model_name: "fake".into(),
            context_len: self.settings.context_len,
            vocab_size: VOCAB,
            eos_ids: vec![EOS],
            kv_capacity_tokens: self.settings.kv_capacity_tokens,
            speculation: None,
            kv_block_size: BLOCK,
        }
    }

    fn execute(&mut self, plan: StepPlan) -> StepOutcome {
        let started = Instant::now();
        // Recorded before the gate, so a test can see a plan that is held.
        lock(&self.probe.0.state).plans.push(plan.clone());
        self.probe.wait_gate();
        if !self.settings.step_delay.is_zero() {
            std::thread::sleep(self.settings.step_delay);
        }
        let mut st = lock(&self.probe.0.state);
        let mut seqs = Vec::new();
        for slot in &plan.release {
            st.seqs.remove(slot);
        }
        for slot in &plan.preempt {
            let s = st.seqs.get_mut(slot).expect("preempted slot is registered");
            assert!(!s.preempted, "slot {slot} preempted twice");
            s.preempted = true;
            s.table.clear();
            s.kv_len = 0;
        }
        for a in &plan.admit {
            if let Err(e) = admit(&mut st, a, &plan.release, &self.settings) {
                seqs.push(SeqOutcome {
                    slot: a.slot,
                    result: Err(e),
                });
            }
        }
        for r in &plan.resume {
            let s = st
                .seqs
                .get_mut(&r.slot)
                .expect("resumed slot is registered");
            assert!(s.preempted, "slot {} resumed without a preemption", r.slot);
            s.preempted = false;
            s.table = r.table.clone();
            s.kv_len = r.cached_tokens;
            let target = match s.generated {
                0 => s.prompt.len(),
                g => s.prompt.len() + g - 1,
            };
            assert!(r.cached_tokens <= target);
            s.recompute = (s.generated > 0 && r.cached_tokens < target).then_some(target);
        }
        for t in &plan.tables {
            let s = st
                .seqs
                .get_mut(&t.slot)
                .expect("table of a registered slot");
            assert!(!s.preempted, "table update for preempted slot {}", t.slot);
            assert!(
                t.table.len() * BLOCK >= s.kv_len,
                "a table shorter than the KV"
            );
            s.table = t.table.clone();
        }
        let mut tokens_in_batch = 0;
        let mut sampled = false;
        for w in &plan.work {
            tokens_in_batch += match *w {
                SeqWork::Prefill { len, .. } => len,
                SeqWork::Decode { .. } => 1,
            };
            let result = run_work(&mut st, *w, self.settings.context_len);
            if let Ok(p) = &result {
                sampled |= !p.tokens.is_empty();
            }
            if result.as_ref().map_or(true, |p| p.finish.is_some()) {
                st.seqs.remove(&w.slot());
            }
            seqs.push(SeqOutcome {
                slot: w.slot(),
                result,
            });
        }
        let total = started.elapsed();
        StepOutcome {
            step: plan.step,
            seqs,
            stats: StepStats {
                batch_seqs: plan.work.len(),
                batch_tokens: tokens_in_batch,
                forward: total,
                sample: Duration::ZERO,
                total,
                uniform_calls: u32::from(sampled),
                serial_calls: 0,
                ..Default::default()
            },
        }
    }
}

fn admit(
    st: &mut FakeState,
    a: &Admission,
    released: &[SlotId],
    settings: &FakeSettings,
) -> Result<(), EngineError> {
    // The scheduler promises never to reuse a slot in the plan that releases
    // it (the protocol leaves the order of release and admit open).
    if released.contains(&a.slot) {
        return Err(EngineError::InvalidWork {
            slot: a.slot,
            reason: "released and admitted in one plan".into(),
        });
    }
    if st.seqs.contains_key(&a.slot) {
        return Err(EngineError::DuplicateSlot(a.slot));
    }
    let KvGrant::Blocks {
        table,
        cached_tokens,
    } = &a.kv
    else {
        return Err(EngineError::InvalidWork {
            slot: a.slot,
            reason: "the scheduler must hand out blocks".into(),
        });
    };
    let blocks = settings.kv_capacity_tokens / BLOCK;
    if table.iter().any(|&b| b as usize >= blocks) || table.len() * BLOCK < a.prompt.len() {
        return Err(EngineError::InvalidWork {
            slot: a.slot,
            reason: format!("table {table:?} for a {}-token prompt", a.prompt.len()),
        });
    }
    if *cached_tokens >= a.prompt.len() || cached_tokens % BLOCK != 0 {
        return Err(EngineError::InvalidWork {
            slot: a.slot,
            reason: format!("{cached_tokens} cached tokens"),
        });
    }
    st.cached.push(*cached_tokens);
    st.seqs.insert(
        a.slot,
        FakeSeq {
            prompt: a.prompt.clone(),
            kv_len: *cached_tokens,
            recompute: None,
            generated: 0,
            max_new: a.max_new_tokens,
            table: table.clone(),
            preempted: false,
        },
    );
    Ok(())
}

/// The positions `w` feeds have room in its table, and none of their blocks
/// is in another live table (a shared prefix block is never written).
fn check_writes(st: &FakeState, w: SeqWork) -> Result<(), EngineError> {
    let slot = w.slot();
    let Some(seq) = st.seqs.get(&slot) else {
        return Ok(()); // reported as unknown by the caller
    };
    let invalid = |reason: String| EngineError::InvalidWork { slot, reason };
    if seq.preempted {
        return Err(invalid("work for a preempted slot".into()));
    }
    let end = seq.kv_len + w.max_tokens();
    if end > seq.table.len() * BLOCK {
        return Err(invalid(format!(
            "{end} positions but a table of {} blocks",
            seq.table.len()
        )));
    }
    for pos in seq.kv_len..end {
        let b = seq.table[pos / BLOCK];
        if let Some((other, _)) = st
            .seqs
            .iter()
            .find(|(&o, s)| o != slot && s.table.contains(&b))
        {
            return Err(invalid(format!(
                "writes block {b}, also held by slot {other}"
            )));
        }
    }
    Ok(())
}

fn run_work(
    st: &mut FakeState,
    w: SeqWork,
    context_len: usize,
) -> Result<SeqProgress, EngineError> {
    let slot = w.slot();
    let fail_rules = st.fail_rules.clone();
    check_writes(st, w)?;
    let seq = st
        .seqs
        .get_mut(&slot)
        .ok_or(EngineError::UnknownSlot(slot))?;
    let invalid = |reason: String| EngineError::InvalidWork { slot, reason };
    let mut progress = SeqProgress::default();
    match w {
        SeqWork::Prefill { start, len, .. } => {
            let target = seq.recompute.unwrap_or(seq.prompt.len());
            if start != seq.kv_len || len == 0 || start + len > target {
                return Err(invalid(format!(
                    "prefill {start}..{} but {} of {target} positions fed",
                    start + len,
                    seq.kv_len,
                )));
            }
            seq.kv_len += len;
            progress.prefilled = len;
            if seq.recompute.is_some() {
                if seq.kv_len == target {
                    seq.recompute = None;
                }
                return Ok(progress);
            }
            if seq.kv_len < seq.prompt.len() {
                return Ok(progress);
            }
        }
        SeqWork::Decode { .. } => {
            if seq.kv_len < seq.prompt.len() || seq.generated == 0 || seq.recompute.is_some() {
                return Err(invalid("decode before the prompt was fed".into()));
            }
            seq.kv_len += 1;
        }
    }
    let index = seq.generated;
    if fail_rules.contains(&(seq.prompt[0], index)) {
        return Err(EngineError::Model(format!(
            "injected failure at token {index}"
        )));
    }
    let id = fake_token(&seq.prompt, index);
    seq.generated += 1;
    progress.tokens.push(GeneratedToken {
        id,
        logprob: None,
        top_logprobs: Vec::new(),
    });
    progress.finish = if id == EOS {
        Some(SeqFinish::Eos)
    } else if seq.generated == seq.max_new {
        Some(SeqFinish::Length)
    } else if seq.prompt.len() + seq.generated >= context_len {
        Some(SeqFinish::ContextFull)
    } else {
        None
    };
    Ok(progress)
}
