//! [`Sampler`]: slot registration and the batched `sample` call with its
//! two dispatch paths (see the module docs of [`crate::sampler`]).

use std::collections::HashMap;

use candle_core::Tensor;
use rand::{Rng, RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::adjust::{LogitBias, RowAdjust, TokenMask};
use super::device::{self, DeviceHistory};
use super::history::HistoryPool;
use super::host;
use super::transform::{self, Plan, RowFault, RowJob, RowScratch};
use super::{SamplePath, SampleResult, SamplerError, SamplingOptions};
use crate::slot::SlotId;

/// Below this many logits (rows × V) per extra thread, the uniform path
/// stays on the calling thread: spawning costs more than it saves.
const MIN_LOGITS_PER_THREAD: usize = 256 * 1024;

/// One registered sequence.
#[derive(Debug)]
pub(crate) struct SlotState {
    pub id: SlotId,
    /// Normalised options (see [`SamplingOptions::normalized`]).
    pub options: SamplingOptions,
    pub plan: Plan,
    /// Tokens written to the ring so far (priors included, capped at the
    /// window on seeding); only meaningful when the plan uses history.
    pub len: u64,
    /// This sequence's randomness: the stream of its seed. The token at
    /// generation index `n` is drawn with its `n`-th `f64` (see
    /// [`SlotState::stream_at`]), whichever call draws it.
    pub rng: ChaCha8Rng,
    /// Tokens this slot has generated so far (sampled or committed): the
    /// generation index of its next token.
    pub drawn: u64,
    /// Added to the raw logits of every row of this slot (empty: none).
    pub bias: LogitBias,
}

impl SlotState {
    /// The slot's stream positioned at generation index `drawn + offset`:
    /// its next `f64` is the uniform that draws that token. ChaCha8's word
    /// position makes this a seek, not a replay, and `f64`s are two words.
    pub(crate) fn stream_at(&self, offset: u64) -> ChaCha8Rng {
        let mut rng = self.rng.clone();
        rng.set_word_pos(2 * u128::from(self.drawn + offset));
        rng
    }

    /// Whether the next token is the first maximum of the raw logits:
    /// greedy, no penalty, no bias (a grammar mask is per call; callers
    /// that have one know it).
    pub(crate) fn plain_greedy(&self) -> bool {
        self.plan.is_greedy() && !self.plan.uses_history() && self.bias.is_empty()
    }

    /// The tokens the penalty sees now (ring order).
    pub(crate) fn window<'p>(&self, pool: &'p HistoryPool, row: usize) -> &'p [u32] {
        if self.plan.uses_history() {
            pool.filled(row, self.plan.penalty.window, self.len)
        } else {
            &[]
        }
    }
}

/// One row's result before it is committed.
#[derive(Debug)]
struct RowOut {
    token: u32,
    logprob: f32,
    /// The slot's stream at this token's generation index (see
    /// [`SlotState::stream_at`]); a call commits nothing unless it
    /// succeeded, so a failed call leaves every slot as it was.
    rng: ChaCha8Rng,
}

/// Read-only inputs shared by the workers of one call.
struct CallCtx<'a> {
    data: &'a [f32],
    vocab: usize,
    /// Registration index of each row's slot.
    idx: &'a [usize],
    slots: &'a [SlotState],
    pool: &'a HistoryPool,
    /// The shared plan on the uniform path.
    shared: Option<&'a Plan>,
    /// Per row, this step's grammar mask (empty: no row has one).
    masks: &'a [Option<&'a TokenMask>],
    logprobs: bool,
    top_k: usize,
}

/// Where a call runs (see the module docs' *Where the work happens*).
enum Site {
    /// Logits on a CUDA GPU: one kernel launch for every row, grammar masks
    /// and logit biases included.
    CudaKernel,
    /// Logits on another GPU and no logprob request: plain greedy rows take
    /// their argmax there; the `others` (row indices of the call) go to the
    /// host.
    DeviceArgmax { others: Vec<u32> },
    /// Every row on the host.
    Host,
}

/// A batched, slot-based sampler. See the [module docs](crate::sampler).
pub struct Sampler {
    num_ctx: usize,
    /// Registration order; index `r` owns pool row `r`.
    pub(crate) slots: Vec<SlotState>,
    pub(crate) index: HashMap<SlotId, usize>,
    pub(crate) pool: HistoryPool,
    /// Every registered slot has the same plan.
    all_same: bool,
    /// Compute-for-all logprob configuration over registered slots.
    any_logprobs: bool,
    max_top_logprobs: usize,
    /// Seeds the RNG of slots registered without a seed.
    seeder: ChaCha8Rng,
    threads: usize,
    /// One per worker thread of the uniform path (index 0: caller thread).
    scratch: Vec<RowScratch>,
    // Per-call buffers, kept to avoid reallocating every step.
    call_idx: Vec<usize>,
    call_seen: Vec<bool>,
    call_rows: Vec<RowOut>,
    call_top: Vec<(u32, f32)>,
    /// The penalty rings on the device of the last device call.
    device_history: Option<DeviceHistory>,
}

impl std::fmt::Debug for Sampler {
    // The scratch buffers hold whole rows of V; they are not state.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sampler")
            .field("num_ctx", &self.num_ctx)
            .field(
                "slots",
                &self.slots.iter().map(|s| s.id).collect::<Vec<_>>(),
            )
            .field("history_width", &self.pool.width())
            .field("all_same", &self.all_same)
            .field("any_logprobs", &self.any_logprobs)
            .field("max_top_logprobs", &self.max_top_logprobs)
            .field("threads", &self.threads)
            .finish_non_exhaustive()
    }
}

impl Sampler {
    /// An empty sampler. `num_ctx` resolves `repeat_last_n == -1`. Slots
    /// registered without a seed get one from OS entropy.
    pub fn new(num_ctx: usize) -> Self {
        Self::with_seed(num_ctx, rand::random())
    }

    /// Like [`Sampler::new`], but slots without a seed are seeded from a
    /// sampler-level RNG started at `seed` (reproducible runs).
    pub fn with_seed(num_ctx: usize, seed: u64) -> Self {
        Self {
            num_ctx,
            slots: Vec::new(),
            index: HashMap::new(),
            pool: HistoryPool::default(),
            all_same: true,
            any_logprobs: false,
            max_top_logprobs: 0,
            seeder: ChaCha8Rng::seed_from_u64(seed),
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            scratch: Vec::new(),
            call_idx: Vec::new(),
            call_seen: Vec::new(),
            call_rows: Vec::new(),
            call_top: Vec::new(),
            device_history: None,
        }
    }

    /// Registers `slot`. The last `repeat_last_n` of `prior_tokens` (the
    /// prompt) seed its penalty ring. Token ids are checked against the
    /// vocabulary at the first call that brings logits.
    pub fn add(
        &mut self,
        slot: SlotId,
        options: SamplingOptions,
        prior_tokens: &[u32],
    ) -> Result<(), SamplerError> {
        options.validate()?;
        if self.index.contains_key(&slot) {
            return Err(SamplerError::DuplicateSlot(slot));
        }
        let options = options.normalized(self.num_ctx);
        let plan = Plan::from_normalized(&options);
        let seed = options.seed.unwrap_or_else(|| self.seeder.next_u64());
        let len = self
            .pool
            .push_row(self.slots.len(), plan.penalty.window, prior_tokens) as u64;
        self.index.insert(slot, self.slots.len());
        self.slots.push(SlotState {
            id: slot,
            options,
            plan,
            len,
            rng: ChaCha8Rng::seed_from_u64(seed),
            drawn: 0,
            bias: LogitBias::default(),
        });
        self.recompute();
        Ok(())
    }

    /// Releases `slot`; its pool row is dropped. Returns whether it was
    /// registered (removing an unknown slot is a no-op).
    pub fn remove(&mut self, slot: SlotId) -> bool {
        let Some(r) = self.index.remove(&slot) else {
            return false;
        };
        self.slots.remove(r);
        for (i, s) in self.slots.iter().enumerate().skip(r) {
            self.index.insert(s.id, i);
        }
        let width = self
            .slots
            .iter()
            .map(|s| s.plan.penalty.window)
            .max()
            .unwrap_or(0);
        self.pool.remove_row(r, width);
        self.recompute();
        true
    }

    /// Sets `slot`'s logit bias (added to its raw logits at every row,
    /// before penalties and truncation). Bias ids are checked against the
    /// vocabulary at the next call that brings logits for the slot.
    pub fn set_logit_bias(&mut self, slot: SlotId, bias: LogitBias) -> Result<(), SamplerError> {
        let &r = self
            .index
            .get(&slot)
            .ok_or(SamplerError::UnknownSlot(slot))?;
        self.slots[r].bias = bias;
        Ok(())
    }

    /// Caps the worker threads of the uniform path (default: the machine's
    /// available parallelism; at least 1). Tokens do not depend on it.
    pub fn set_max_threads(&mut self, threads: usize) {
        self.threads = threads.max(1);
    }

    /// Number of registered slots.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Whether no slot is registered.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Whether `slot` is registered.
    pub fn contains(&self, slot: SlotId) -> bool {
        self.index.contains_key(&slot)
    }

    /// The normalised options `slot` was registered with.
    pub fn options(&self, slot: SlotId) -> Option<&SamplingOptions> {
        self.index.get(&slot).map(|&r| &self.slots[r].options)
    }

    /// The tokens in `slot`'s penalty window, oldest first (empty for a
    /// slot without penalties).
    pub fn history(&self, slot: SlotId) -> Option<Vec<u32>> {
        let &r = self.index.get(&slot)?;
        let s = &self.slots[r];
        let mut out = Vec::new();
        if s.plan.uses_history() {
            self.pool
                .chronological(r, s.plan.penalty.window, s.len, &mut out);
        }
        Some(out)
    }

    /// Columns of the pooled history (the largest penalty window).
    pub fn history_width(&self) -> usize {
        self.pool.width()
    }

    /// Whether `slot` samples greedily with no penalty: its next token is
    /// the first maximum of its raw logits, whatever came before.
    pub fn is_plain_greedy(&self, slot: SlotId) -> bool {
        self.index
            .get(&slot)
            .is_some_and(|&r| self.slots[r].plain_greedy())
    }

    /// The first maximum of every row of `logits` (`[rows, V]`): what
    /// [`Sampler::sample`] returns for a plain greedy slot (see
    /// [`Sampler::is_plain_greedy`]) on the same device, ties included,
    /// without touching any slot's state. Row `i` belongs to `slots[i]`,
    /// which names it in errors. Speculative decoding uses it to verify and
    /// draft for plain greedy sequences from ids alone: on a CUDA device it
    /// is one launch of the sampling kernel and only the ids cross.
    pub fn argmax_rows(
        &mut self,
        slots: &[SlotId],
        logits: &Tensor,
    ) -> Result<Vec<u32>, SamplerError> {
        let (rows, vocab) = host::check_shape(logits, slots.len())?;
        if let Some(&unknown) = slots.iter().find(|s| !self.index.contains_key(s)) {
            return Err(SamplerError::UnknownSlot(unknown));
        }
        if rows == 0 {
            return Ok(Vec::new());
        }
        if logits.device().is_cuda() {
            let params = device::greedy_params(rows);
            let history =
                DeviceHistory::synced(self.device_history.take(), &self.pool, logits.device())?;
            let launch = device::sample(logits, &params, &history, 0);
            self.device_history = Some(history);
            let launch = launch?;
            let width = device::out_width(0);
            return launch
                .out
                .chunks_exact(width)
                .enumerate()
                .map(|(row, out)| device_row_status(out, slots[row], row, vocab).map(|()| out[0]))
                .collect();
        }
        let plan = Plan::from_normalized(&SamplingOptions::greedy().normalized(self.num_ctx));
        // Greedy rows draw nothing from it.
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        let scratch = match self.scratch.first_mut() {
            Some(s) => s,
            None => {
                self.scratch.push(RowScratch::default());
                &mut self.scratch[0]
            }
        };
        host::with_host_f32(logits, |data| {
            data.chunks_exact(vocab)
                .enumerate()
                .map(|(row, logits)| {
                    let job = RowJob {
                        logits,
                        plan: &plan,
                        window: &[],
                        adjust: RowAdjust::default(),
                    };
                    transform::sample_row(job, &mut rng, scratch)
                        .map_err(|f| fault(f, slots[row], row, vocab))
                })
                .collect()
        })
    }

    /// Which path a call naming `slots` (in this order) would take.
    pub fn path_for(&self, slots: &[SlotId]) -> Result<SamplePath, SamplerError> {
        let mut idx = Vec::with_capacity(slots.len());
        let mut seen = vec![false; self.slots.len()];
        self.resolve(slots, &mut idx, &mut seen)?;
        Ok(self.dispatch(&idx))
    }

    /// Draws one token per row of `logits` (`[B, V]`, any float dtype, any
    /// device); row `i` belongs to `slots[i]`, which may be any subset of
    /// the registered slots in any order. Each token is appended to its
    /// slot's history. On error nothing changes (no RNG advances, no
    /// history is written).
    pub fn sample(
        &mut self,
        slots: &[SlotId],
        logits: &Tensor,
    ) -> Result<SampleResult, SamplerError> {
        self.sample_inner(slots, logits, &[], None)
    }

    /// [`Sampler::sample`] with a grammar mask per row (`masks[i]` for row
    /// `i`; `None` leaves the row unconstrained; an empty `masks` means no
    /// row has one). A masked token is never drawn: the mask applies first
    /// in the chain, on either path. The path rule does not look at masks
    /// (they are per-row data, like a penalty window).
    pub fn sample_masked(
        &mut self,
        slots: &[SlotId],
        logits: &Tensor,
        masks: &[Option<&TokenMask>],
    ) -> Result<SampleResult, SamplerError> {
        if !masks.is_empty() && masks.len() != slots.len() {
            return Err(SamplerError::LogitsShape {
                reason: format!("{} masks for {} rows", masks.len(), slots.len()),
            });
        }
        self.sample_inner(slots, logits, masks, None)
    }

    /// [`Sampler::sample`] forced onto the serial path, so benchmarks and
    /// tests can compare the paths on identical inputs. Not for engines.
    #[doc(hidden)]
    pub fn sample_serial_for_bench(
        &mut self,
        slots: &[SlotId],
        logits: &Tensor,
    ) -> Result<SampleResult, SamplerError> {
        self.sample_inner(slots, logits, &[], Some(SamplePath::Serial))
    }

    /// [`Sampler::sample_masked`] forced onto the serial path (tests).
    #[doc(hidden)]
    pub fn sample_masked_serial_for_test(
        &mut self,
        slots: &[SlotId],
        logits: &Tensor,
        masks: &[Option<&TokenMask>],
    ) -> Result<SampleResult, SamplerError> {
        self.sample_inner(slots, logits, masks, Some(SamplePath::Serial))
    }

    fn sample_inner(
        &mut self,
        slots: &[SlotId],
        logits: &Tensor,
        masks: &[Option<&TokenMask>],
        force: Option<SamplePath>,
    ) -> Result<SampleResult, SamplerError> {
        let mut idx = std::mem::take(&mut self.call_idx);
        let mut seen = std::mem::take(&mut self.call_seen);
        let result = self.resolve(slots, &mut idx, &mut seen).and_then(|()| {
            let path = force.unwrap_or_else(|| self.dispatch(&idx));
            self.run(&idx, logits, masks, path)
        });
        self.call_idx = idx;
        self.call_seen = seen;
        result
    }

    /// Maps slot ids to registration indices, rejecting unknown and
    /// repeated slots.
    fn resolve(
        &self,
        slots: &[SlotId],
        idx: &mut Vec<usize>,
        seen: &mut Vec<bool>,
    ) -> Result<(), SamplerError> {
        idx.clear();
        seen.clear();
        seen.resize(self.slots.len(), false);
        for &id in slots {
            let &r = self.index.get(&id).ok_or(SamplerError::UnknownSlot(id))?;
            if std::mem::replace(&mut seen[r], true) {
                return Err(SamplerError::RepeatedSlot(id));
            }
            idx.push(r);
        }
        Ok(())
    }

    /// The dispatch rule: uniform when every registered slot shares the plan
    /// and, if that plan has penalties, the call names every registered
    /// slot in registration order and every ring is full (so pool row i
    /// is logits row i and all of its window is valid).
    fn dispatch(&self, idx: &[usize]) -> SamplePath {
        if !self.all_same || idx.is_empty() {
            return if idx.is_empty() {
                SamplePath::Uniform
            } else {
                SamplePath::Serial
            };
        }
        let shared = &self.slots[0].plan;
        if !shared.uses_history() {
            return SamplePath::Uniform;
        }
        let window = shared.penalty.window as u64;
        let aligned = idx.len() == self.slots.len()
            && idx.iter().enumerate().all(|(i, &r)| i == r)
            && self.slots.iter().all(|s| s.len >= window);
        if aligned {
            SamplePath::Uniform
        } else {
            SamplePath::Serial
        }
    }

    fn recompute(&mut self) {
        let first = self.slots.first().map(|s| s.plan);
        self.all_same = self.slots.iter().all(|s| Some(s.plan) == first);
        let askers = self.slots.iter().filter(|s| s.options.logprobs);
        self.any_logprobs = askers.clone().next().is_some();
        self.max_top_logprobs = askers.map(|s| s.options.top_logprobs).max().unwrap_or(0);
    }

    /// Where this call's work runs, from where the logits live and what
    /// the named rows need; decided once, at the top of the call.
    fn site(&self, idx: &[usize], logits: &Tensor, masks: &[Option<&TokenMask>]) -> Site {
        if logits.device().is_cuda() {
            return Site::CudaKernel;
        }
        let masked = |i: usize| masks.get(i).is_some_and(Option::is_some);
        if self.any_logprobs || !host::on_device(logits) {
            return Site::Host;
        }
        let others: Vec<u32> = (0..idx.len() as u32)
            .filter(|&i| masked(i as usize) || !self.slots[idx[i as usize]].plain_greedy())
            .collect();
        if others.len() < idx.len() {
            Site::DeviceArgmax { others }
        } else {
            Site::Host
        }
    }

    fn run(
        &mut self,
        idx: &[usize],
        logits: &Tensor,
        masks: &[Option<&TokenMask>],
        path: SamplePath,
    ) -> Result<SampleResult, SamplerError> {
        let (b, vocab) = host::check_shape(logits, idx.len())?;
        if b == 0 {
            return Ok(SampleResult::empty(path));
        }
        match self.site(idx, logits, masks) {
            Site::CudaKernel => self.run_on_device(idx, logits, vocab, masks, path),
            Site::DeviceArgmax { others } => {
                self.run_split(idx, logits, vocab, &others, masks, path)
            }
            Site::Host => self.run_host(idx, logits, vocab, masks, path),
        }
    }

    /// Plain greedy rows take their argmax where the logits live; only the
    /// `others` rows' logits cross to the host, for the host chain.
    fn run_split(
        &mut self,
        idx: &[usize],
        logits: &Tensor,
        vocab: usize,
        others: &[u32],
        masks: &[Option<&TokenMask>],
        path: SamplePath,
    ) -> Result<SampleResult, SamplerError> {
        let mut tokens = host::device_argmax(logits)?;
        if !others.is_empty() {
            let rows = Tensor::new(others, logits.device())
                .and_then(|rows| logits.index_select(&rows, 0))
                .and_then(|l| l.to_device(&candle_core::Device::Cpu))
                .map_err(host::tensor_err)?;
            let sub_idx: Vec<usize> = others.iter().map(|&i| idx[i as usize]).collect();
            let sub_masks: Vec<Option<&TokenMask>> = if masks.is_empty() {
                Vec::new()
            } else {
                others.iter().map(|&i| masks[i as usize]).collect()
            };
            let sampled = self.run_host(&sub_idx, &rows, vocab, &sub_masks, path)?;
            for (&i, t) in others.iter().zip(sampled.tokens) {
                tokens[i as usize] = t;
            }
        }
        Ok(SampleResult {
            tokens,
            ..SampleResult::empty(path)
        })
    }

    /// Every row on the host chain, over the logits read to the host once
    /// (in place when they already are a contiguous CPU f32 tensor).
    fn run_host(
        &mut self,
        idx: &[usize],
        logits: &Tensor,
        vocab: usize,
        masks: &[Option<&TokenMask>],
        path: SamplePath,
    ) -> Result<SampleResult, SamplerError> {
        let b = idx.len();
        let top_k = if self.any_logprobs {
            self.max_top_logprobs.min(vocab)
        } else {
            0
        };
        let mut rows = std::mem::take(&mut self.call_rows);
        let mut top = std::mem::take(&mut self.call_top);
        rows.clear();
        rows.extend(idx.iter().map(|&r| RowOut {
            token: 0,
            logprob: 0.0,
            rng: self.slots[r].stream_at(0),
        }));
        top.clear();
        top.resize(b * top_k, (0, 0.0));

        let outcome = host::with_host_f32(logits, |data| {
            let ctx = CallCtx {
                data,
                vocab,
                idx,
                slots: &self.slots,
                pool: &self.pool,
                shared: (path == SamplePath::Uniform).then(|| &self.slots[idx[0]].plan),
                masks,
                logprobs: self.any_logprobs,
                top_k,
            };
            let threads = match path {
                SamplePath::Serial => 1,
                SamplePath::Uniform => self
                    .threads
                    .min(b)
                    .min((b * vocab / MIN_LOGITS_PER_THREAD).max(1)),
            };
            if self.scratch.len() < threads {
                self.scratch.resize_with(threads, RowScratch::default);
            }
            run_parallel(&ctx, &mut rows, &mut top, &mut self.scratch[..threads])
        });

        let result = outcome.map(|()| {
            for (row, &r) in rows.iter_mut().zip(idx) {
                let slot = &mut self.slots[r];
                slot.drawn += 1;
                if slot.plan.uses_history() {
                    self.pool
                        .write(r, slot.plan.penalty.window, slot.len, row.token);
                    slot.len += 1;
                }
            }
            SampleResult {
                tokens: rows.iter().map(|r| r.token).collect(),
                logprobs: self
                    .any_logprobs
                    .then(|| rows.iter().map(|r| r.logprob).collect()),
                top_logprobs: (top_k > 0).then(|| top.chunks(top_k).map(<[_]>::to_vec).collect()),
                path,
            }
        });
        self.call_rows = rows;
        self.call_top = top;
        result
    }
}

impl Sampler {
    /// The whole call as one kernel launch where the logits live (CUDA):
    /// only the output rows cross to the host. Same RNG use, history
    /// writes and all-or-nothing commit as the host path.
    fn run_on_device(
        &mut self,
        idx: &[usize],
        logits: &Tensor,
        vocab: usize,
        masks: &[Option<&TokenMask>],
        path: SamplePath,
    ) -> Result<SampleResult, SamplerError> {
        let top_k = if self.any_logprobs {
            self.max_top_logprobs.min(vocab)
        } else {
            0
        };
        let mut block = device::ParamBlock::new(idx.len(), vocab);
        for (i, &r) in idx.iter().enumerate() {
            let slot = &self.slots[r];
            let uniform = (!slot.plan.is_greedy()).then(|| slot.stream_at(0).random::<f64>());
            let row = device::row_params(&slot.plan, slot.len, r, uniform, self.any_logprobs);
            block.push(row, masks.get(i).copied().flatten(), slot.bias.pairs());
        }
        let params = block.finish();
        let history =
            DeviceHistory::synced(self.device_history.take(), &self.pool, logits.device())?;
        let launch = match device::sample(logits, &params, &history, top_k) {
            Ok(launch) => launch,
            Err(e) => {
                self.device_history = Some(history);
                return Err(e);
            }
        };
        let width = device::out_width(top_k);
        // Every status first: a failing call commits nothing.
        for (row, out) in launch.out.chunks_exact(width).enumerate() {
            if let Err(e) = device_row_status(out, self.slots[idx[row]].id, row, vocab) {
                self.device_history = Some(history);
                return Err(e);
            }
        }
        let mut result = SampleResult {
            tokens: Vec::with_capacity(idx.len()),
            logprobs: self.any_logprobs.then(Vec::new),
            top_logprobs: (top_k > 0).then(Vec::new),
            path,
        };
        for (out, &r) in launch.out.chunks_exact(width).zip(idx) {
            let token = out[0];
            let slot = &mut self.slots[r];
            slot.drawn += 1;
            if slot.plan.uses_history() {
                self.pool
                    .write(r, slot.plan.penalty.window, slot.len, token);
                slot.len += 1;
            }
            result.tokens.push(token);
            if let Some(lp) = result.logprobs.as_mut() {
                lp.push(f32::from_bits(out[3]));
            }
            if let Some(top) = result.top_logprobs.as_mut() {
                top.push(
                    out[4..]
                        .chunks_exact(2)
                        .map(|c| (c[0], f32::from_bits(c[1])))
                        .collect(),
                );
            }
        }
        // The host pool is committed; should the device append fail, the
        // next call uploads the pool instead of trusting a stale copy.
        self.device_history = device::write_history(history, &launch, self.pool.version()).ok();
        Ok(result)
    }
}

/// Splits the rows into one contiguous chunk per scratch buffer; chunk 0
/// runs on the calling thread. Each row only touches its own output and
/// RNG copy, so the tokens do not depend on the split. Returns the error
/// of the lowest failing row.
fn run_parallel(
    ctx: &CallCtx<'_>,
    rows: &mut [RowOut],
    top: &mut [(u32, f32)],
    scratch: &mut [RowScratch],
) -> Result<(), SamplerError> {
    let chunk = rows.len().div_ceil(scratch.len());
    if scratch.len() == 1 {
        return run_rows(ctx, rows, top, 0, &mut scratch[0]);
    }
    std::thread::scope(|s| {
        let mut rows_rest = rows;
        let mut top_rest = top;
        let mut start = 0;
        let mut handles = Vec::with_capacity(scratch.len());
        let mut first = None;
        for sc in scratch.iter_mut() {
            let len = chunk.min(rows_rest.len());
            if len == 0 {
                break;
            }
            let (r_head, r_tail) = std::mem::take(&mut rows_rest).split_at_mut(len);
            let (t_head, t_tail) = std::mem::take(&mut top_rest).split_at_mut(len * ctx.top_k);
            rows_rest = r_tail;
            top_rest = t_tail;
            if first.is_none() {
                first = Some((r_head, t_head, start, sc));
            } else {
                handles.push(s.spawn(move || run_rows(ctx, r_head, t_head, start, sc)));
            }
            start += len;
        }
        let mut result = match first {
            Some((r, t, st, sc)) => run_rows(ctx, r, t, st, sc),
            None => Ok(()),
        };
        for h in handles {
            let chunk_result = match h.join() {
                Ok(res) => res,
                // A worker panic is a sampler bug, not bad input.
                Err(payload) => std::panic::resume_unwind(payload),
            };
            // Chunks are joined in row order: keep the earliest error.
            if result.is_ok() {
                result = chunk_result;
            }
        }
        result
    })
}

/// Samples rows `start..start + rows.len()` of the call.
fn run_rows(
    ctx: &CallCtx<'_>,
    rows: &mut [RowOut],
    top: &mut [(u32, f32)],
    start: usize,
    scratch: &mut RowScratch,
) -> Result<(), SamplerError> {
    for (j, out) in rows.iter_mut().enumerate() {
        let row = start + j;
        let r = ctx.idx[row];
        let slot = &ctx.slots[r];
        let (plan, window) = match ctx.shared {
            // Uniform with penalties: the call is aligned with the pool and
            // every ring is full, so the window is the row's first N columns.
            Some(plan) if plan.uses_history() => (plan, &ctx.pool.row(row)[..plan.penalty.window]),
            Some(plan) => (plan, &[][..]),
            None => (&slot.plan, slot.window(ctx.pool, r)),
        };
        let logits = &ctx.data[row * ctx.vocab..(row + 1) * ctx.vocab];
        let job = RowJob {
            logits,
            plan,
            window,
            adjust: RowAdjust {
                bias: slot.bias.pairs(),
                mask: ctx.masks.get(row).copied().flatten(),
            },
        };
        out.token = transform::sample_row(job, &mut out.rng, scratch)
            .map_err(|f| fault(f, slot.id, row, ctx.vocab))?;
        if ctx.logprobs {
            let k = ctx.top_k;
            out.logprob =
                transform::logprobs_row(logits, out.token, &mut top[j * k..(j + 1) * k], scratch);
        }
    }
    Ok(())
}

/// Names the slot and row of a row fault.
/// The status of one device output row (`out`, see `device::out_width`) as
/// the host sampler would report it.
fn device_row_status(
    out: &[u32],
    slot: SlotId,
    row: usize,
    vocab: usize,
) -> Result<(), SamplerError> {
    let row_fault = match out[1] {
        device::S_OK => return Ok(()),
        device::S_NON_FINITE => RowFault::NonFinite,
        device::S_NO_FINITE_LOGIT => RowFault::NoFiniteLogit,
        device::S_TOKEN_OUT_OF_VOCAB => RowFault::TokenOutOfVocab(out[2]),
        other => {
            return Err(SamplerError::Tensor(format!(
                "device sampler: unknown status {other} for row {row}"
            )))
        }
    };
    Err(fault(row_fault, slot, row, vocab))
}

pub(crate) fn fault(f: RowFault, slot: SlotId, row: usize, vocab: usize) -> SamplerError {
    match f {
        RowFault::NonFinite => SamplerError::NonFiniteLogits { slot, row },
        RowFault::NoFiniteLogit => SamplerError::NoFiniteLogit { slot, row },
        RowFault::TokenOutOfVocab(token) => SamplerError::VocabMismatch { slot, token, vocab },
    }
}
