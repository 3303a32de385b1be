//! CUDA graphs for decode passes: the layers of a pass whose every sequence
//! decodes one token, or one token and the drafts it verifies, are
//! captured once per shape and replayed, so a step costs one graph launch
//! instead of ~170 kernel launches of host time.
//!
//! Verification passes are captured too: were they eager while plain
//! decode passes replay, a draft would cost the whole difference between
//! an eager pass and a replay (on the H200, SmolLM2 at 16 streams: 1.8 ms
//! a plain step, about 4 ms a verifying one; BENCHMARKS.md, issue 18),
//! and speculation could not pay on a GPU.
//!
//! # What is captured, and what varies between replays
//! A graph is keyed by [`GraphKey`]: the number of rows (query tokens) and
//! of sequences (no padding, so a replay computes exactly what the eager
//! pass does), the key bound its attention's shared memory is sized for,
//! and the layers run; every kept graph reads one KV pool
//! ([`KvCache::pool_generation`]). A pass with more rows than sequences
//! verifies drafts: a draft's query reads the keys of the rows before it,
//! which its attention launch reads from their projection rows (sized for
//! the longest span the shape allows), as the eager pass does. A plain
//! decode shape is captured the first time it runs, and so is a verifying
//! one of at most [`FEW_SEQS`] sequences (their draft counts make few
//! shapes); a verifying shape of more only
//! on its [`CAPTURE_VERIFY_AFTER`]th run: there the draft counts combine
//! into many shapes, most of which never recur, and a capture costs about
//! two eager passes. Capturing at once where shapes recur also keeps the
//! draft policy's cost of verification honest: it never sees a captured
//! pass's cost (a one-off), and eager runs of a shape that will replay
//! would teach it that verifying costs several plain passes. Everything a
//! pass reads that changes from step to step lives in device buffers
//! owned by the graph and rewritten before each replay (one upload): the
//! token ids and the attention plan's metadata (per query: its table, first and own
//! position; then each sequence's block table at a fixed place,
//! [`TableLayout::Fixed`]). So a replay after sequences grew, left, joined
//! or were preempted reads the new positions and tables. Weights, rotary
//! tables and the pool stay where they were at capture; a pool that is
//! reallocated gets a new generation, and the graphs over the old one are
//! dropped.
//!
//! # Same kernels, same order
//! The captured pass is the eager pass ([`super::candle_step`] with a
//! pooled plan) run under capture: the same launches with the same
//! arguments, so a replay's outputs equal the eager pass's bit for bit
//! (`tests/device.rs` checks it token for token). The first pass of a new
//! shape runs eagerly (it is the step's real work, and warms candle's
//! parameter caches, since a capture may not upload), then is captured
//! without running.
//!
//! # Failure
//! Any error while capturing ends the capture, turns graphs off for this
//! model (logged once) and keeps the eager pass's result: a graph is an
//! optimisation, never a reason for a step to fail.
//!
//! # Ownership
//! [`DecodeGraphs`] belongs to its model's candle step; the engine thread
//! is its one user (the mutex keeps the model `Sync`).

use std::collections::HashMap;
use std::sync::Mutex;

use candle_core::{Device, Tensor};

#[cfg(doc)]
use super::pooled_attention::TableLayout;
use super::ModelError;
#[cfg(doc)]
use crate::kv::KvCache;

/// Rows above which passes stay eager (large batches are not launch-bound).
pub(super) const MAX_GRAPH_ROWS: usize = 128;
/// The most rows one sequence may feed a captured pass: its decode token
/// and up to eight drafts. Longer spans are prompt chunks, whose lengths
/// vary too much for captures to pay.
pub(super) const MAX_GRAPH_SPAN: usize = 9;
/// Graphs kept at most; past it the cache starts over.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const MAX_GRAPHS: usize = 256;
/// Runs of one verifying shape of more than [`FEW_SEQS`] sequences before
/// it is captured (eager until then).
const CAPTURE_VERIFY_AFTER: u32 = 3;
/// Sequences up to which a verifying shape is captured on its first run.
const FEW_SEQS: usize = 4;
/// The smallest key bound a graph is captured for (bounds are powers of two).
const MIN_KEY_BOUND: usize = 256;

/// What a captured graph depends on besides its two input buffers and the
/// KV pool it reads (see [`DecodeGraphs::run`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct GraphKey {
    /// Query tokens.
    pub rows: usize,
    /// Sequences (each with at least one row).
    pub seqs: usize,
    /// Most keys any query may see (sizes the attention's shared memory).
    pub key_bound: usize,
    pub layers: usize,
    /// Rows the pass returns: `rows`, or one a sequence when it picks
    /// each span's last row ([`GraphInputs::picks`]).
    pub outputs: usize,
}

impl GraphKey {
    /// Whether the pass verifies drafts (some sequence has several rows).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub fn verifies(&self) -> bool {
        self.rows > self.seqs
    }

    /// The key bound for queries that see at most `keys` keys.
    pub fn key_bound(keys: usize) -> usize {
        keys.next_power_of_two().max(MIN_KEY_BOUND)
    }
}

/// A pass's inputs as the host has them, and the device rows it reads.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(super) struct GraphInputs<'a> {
    pub ids: &'a [u32],
    pub meta: &'a [u32],
    /// The rows the pass returns, when not every row (empty: every row).
    pub picks: &'a [u32],
    /// Input rows the pass reads besides the token ids (an MTP head's
    /// hidden states), copied into the graph's own buffer before a replay.
    pub rows: Option<&'a Tensor>,
    /// A replay hands out the graph's own output buffers, valid until its
    /// next replay, instead of copies: for a caller that reads every
    /// output before the graph can run again (an MTP head's draft round,
    /// where the three copies cost three launches and about 12 µs of host
    /// time in a round of 130 µs).
    pub lend_outputs: bool,
}

impl GraphInputs<'_> {
    /// The words one upload writes before a replay: the ids, the
    /// metadata, then the picks ([`PassInputs`] are views of them).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    fn words(&self) -> Vec<u32> {
        [self.ids, self.meta, self.picks].concat()
    }
}

/// What a pass reads, on the device: the graph's buffers under capture
/// (`ids`, `meta` and `picks` are views of one buffer, written by one
/// upload).
#[derive(Clone)]
pub(super) struct PassInputs {
    pub ids: Tensor,
    pub meta: Tensor,
    pub picks: Option<Tensor>,
    pub rows: Option<Tensor>,
}

/// The captured graphs of one model (see the module docs).
pub(super) struct DecodeGraphs {
    state: Mutex<State>,
}

struct State {
    enabled: bool,
    /// The [`KvCache::pool_generation`] every kept graph reads.
    pool: u64,
    #[cfg(feature = "cuda")]
    graphs: HashMap<GraphKey, cuda::Captured>,
    #[cfg(not(feature = "cuda"))]
    graphs: HashMap<GraphKey, ()>,
    /// Runs of each verifying shape not captured yet.
    seen: HashMap<GraphKey, u32>,
    stats: GraphStats,
}

/// What the graphs of one model have done since load.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GraphStats {
    /// Decode passes replayed from a graph.
    pub replays: u64,
    /// Of those, passes that verified drafts.
    pub verify_replays: u64,
    /// Graphs captured.
    pub captures: u64,
    /// Kernel launches in the last graph captured (what one replay saves).
    pub kernels: usize,
    /// All nodes of that graph (kernels, copies, memory allocations and frees).
    pub nodes: usize,
}

impl State {
    /// Counts a run of verifying shape `key`; whether it is now run often
    /// enough to capture.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    fn hot(&mut self, key: GraphKey) -> bool {
        if key.seqs <= FEW_SEQS {
            return true;
        }
        if self.seen.len() >= 4 * MAX_GRAPHS {
            self.seen.clear();
        }
        let runs = self.seen.entry(key).or_insert(0);
        *runs += 1;
        if *runs < CAPTURE_VERIFY_AFTER {
            return false;
        }
        self.seen.remove(&key);
        true
    }
}

impl DecodeGraphs {
    /// Graphs on `device` (CUDA only), unless `TANDEM_CUDA_GRAPHS=0`.
    pub fn new(device: &Device) -> Self {
        let off = std::env::var("TANDEM_CUDA_GRAPHS").is_ok_and(|v| v == "0");
        Self {
            state: Mutex::new(State {
                enabled: device.is_cuda() && cfg!(feature = "cuda") && !off,
                pool: 0,
                graphs: HashMap::new(),
                seen: HashMap::new(),
                stats: GraphStats::default(),
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn enabled(&self) -> bool {
        self.lock().enabled
    }

    /// Sequences above which a verifying pass mostly runs eagerly (its
    /// shape captured only when it recurs, [`CAPTURE_VERIFY_AFTER`]) while
    /// one of fewer replays; `None` with graphs off, where every pass runs
    /// eagerly alike.
    pub fn eager_verify_above(&self) -> Option<usize> {
        self.enabled().then_some(FEW_SEQS)
    }

    /// Turns graphs on or off (off drops every captured graph).
    pub fn set_enabled(&self, on: bool, device: &Device) {
        let mut s = self.lock();
        s.enabled = on && device.is_cuda() && cfg!(feature = "cuda");
        if !s.enabled {
            s.graphs.clear();
            s.seen.clear();
        }
    }

    pub fn stats(&self) -> GraphStats {
        self.lock().stats
    }

    /// The outputs of the pass `key` over `inputs` and the KV pool of
    /// generation `pool`: a replay of its graph, or else `pass` run eagerly
    /// and then captured. `pass` maps the device inputs to its outputs
    /// (fresh tensors, copied out of the graph's buffers on a replay); it
    /// must read nothing else that varies between steps. Graphs over
    /// another pool are dropped. `None` when graphs are off or the shape is
    /// not worth capturing yet (the caller runs the pass itself).
    pub fn run(
        &self,
        device: &Device,
        key: GraphKey,
        pool: u64,
        inputs: GraphInputs<'_>,
        pass: impl FnMut(&PassInputs) -> Result<Vec<Tensor>, ModelError>,
    ) -> Result<Option<Vec<Tensor>>, ModelError> {
        let mut s = self.lock();
        if !s.enabled {
            return Ok(None);
        }
        if s.pool != pool {
            s.graphs.clear();
            s.seen.clear();
            s.pool = pool;
        }
        #[cfg(feature = "cuda")]
        {
            if let Some(g) = s.graphs.get(&key) {
                let out = g.replay(&inputs, key.layers)?;
                s.stats.replays += 1;
                s.stats.verify_replays += u64::from(key.verifies());
                return Ok(Some(out));
            }
            if key.verifies() && !s.hot(key) {
                return Ok(None);
            }
            if s.graphs.len() >= MAX_GRAPHS {
                s.graphs.clear();
            }
            let (out, captured) = cuda::capture(device, &inputs, pass)?;
            match captured {
                Ok(g) => {
                    s.stats.captures += 1;
                    (s.stats.kernels, s.stats.nodes) = g.node_counts();
                    s.graphs.insert(key, g);
                }
                Err(e) => {
                    tracing::warn!("CUDA graphs off for this model: capture failed: {e}");
                    s.enabled = false;
                    s.graphs.clear();
                }
            }
            Ok(Some(out))
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (device, key, inputs, pass);
            Ok(None)
        }
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::sys::{
        CUgraphInstantiate_flags, CUstreamCaptureMode,
    };
    use candle_core::cuda_backend::cudarc::driver::CudaGraph;
    use candle_core::{CudaStorage, Device, InplaceOp1, Layout, Tensor};

    use super::{GraphInputs, PassInputs};
    use crate::model::ModelError;

    /// A graph with the buffers it reads and writes. All are ordinary
    /// allocations made before the capture: the graph frees every
    /// allocation it makes, so it owns no memory that outlives a replay
    /// (cudarc would otherwise free graph memory that a never-launched
    /// graph has not allocated).
    pub(super) struct Captured {
        graph: CudaGraph,
        /// The buffer `inputs.ids`, `inputs.meta` and `inputs.picks` view.
        words: Tensor,
        inputs: PassInputs,
        outputs: Vec<Tensor>,
    }

    // SAFETY: the graph is only launched by the engine thread, under the
    // `DecodeGraphs` mutex (cudarc's `CudaGraph` is not `Send` only because
    // it holds raw driver handles).
    unsafe impl Send for Captured {}

    impl Captured {
        /// Replays the graph over `inputs`; `layers` only names the pass in
        /// the trace.
        pub(super) fn replay(
            &self,
            inputs: &GraphInputs<'_>,
            layers: usize,
        ) -> Result<Vec<Tensor>, ModelError> {
            let start = std::time::Instant::now();
            let own = &self.inputs;
            self.words.inplace_op1(&Upload(&inputs.words()))?;
            match (&own.rows, inputs.rows) {
                (Some(buffer), Some(rows)) => buffer.slice_set(rows, 0, 0)?,
                (None, None) => {}
                _ => {
                    return Err(driver(
                        "graph replay",
                        "input rows differ from the capture's",
                    ))
                }
            }
            let uploaded = start.elapsed();
            self.graph.launch().map_err(|e| driver("graph launch", e))?;
            let launched = start.elapsed();
            // The next replay overwrites the outputs in place: hand out
            // copies unless the caller borrows them.
            let outputs = match inputs.lend_outputs {
                true => self.outputs.clone(),
                false => self
                    .outputs
                    .iter()
                    .map(Tensor::copy)
                    .collect::<candle_core::Result<_>>()?,
            };
            let us = |d: std::time::Duration| d.as_secs_f64() * 1e6;
            tracing::debug!(
                rows = inputs.ids.len(),
                layers,
                upload_us = us(uploaded),
                launch_us = us(launched - uploaded),
                copy_us = us(start.elapsed() - launched),
                "graph replay"
            );
            Ok(outputs)
        }

        /// (kernel nodes, all nodes) of the graph.
        pub(super) fn node_counts(&self) -> (usize, usize) {
            use candle_core::cuda_backend::cudarc::driver::sys;
            let graph = self.graph.cu_graph();
            let mut count = 0usize;
            // SAFETY: a null node array asks only for the count.
            let r = unsafe { sys::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut count) };
            if r != sys::CUresult::CUDA_SUCCESS {
                return (0, 0);
            }
            let mut nodes = vec![std::ptr::null_mut(); count];
            // SAFETY: `nodes` holds `count` entries.
            let r = unsafe { sys::cuGraphGetNodes(graph, nodes.as_mut_ptr(), &mut count) };
            if r != sys::CUresult::CUDA_SUCCESS {
                return (0, count);
            }
            let kernels = nodes
                .iter()
                .filter(|&&n| {
                    let mut t = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
                    // SAFETY: `n` is a node of this graph.
                    let r = unsafe { sys::cuGraphNodeGetType(n, &mut t) };
                    r == sys::CUresult::CUDA_SUCCESS
                        && t == sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL
                })
                .count();
            (kernels, count)
        }
    }

    /// Runs `pass` eagerly over fresh input buffers (the result), then
    /// captures it over the same buffers. The outer error is the eager
    /// pass's; the inner one a failed capture's.
    pub(super) fn capture(
        device: &Device,
        inputs: &GraphInputs<'_>,
        mut pass: impl FnMut(&PassInputs) -> Result<Vec<Tensor>, ModelError>,
    ) -> Result<(Vec<Tensor>, Result<Captured, ModelError>), ModelError> {
        let host = inputs.words();
        let words = Tensor::from_slice(&host, host.len(), device)?;
        let (n, m) = (inputs.ids.len(), inputs.meta.len());
        let own = PassInputs {
            ids: words.narrow(0, 0, n)?,
            meta: words.narrow(0, n, m)?,
            picks: match inputs.picks {
                [] => None,
                p => Some(words.narrow(0, n + m, p.len())?),
            },
            rows: inputs.rows.map(Tensor::copy).transpose()?,
        };
        let Device::Cuda(cuda) = device else {
            return Err(ModelError::InvalidBatch(
                "CUDA graphs need a CUDA device".into(),
            ));
        };
        // Small uploads inside the pass (candle's layout parameters) come
        // from a cache the eager run fills, so the capture uploads nothing.
        let _cache = cuda.enable_cuda_graph_htod_cache();
        let out = pass(&own)?;
        let outputs = out
            .iter()
            .map(Tensor::zeros_like)
            .collect::<candle_core::Result<Vec<_>>>()?;
        device.synchronize()?;
        let stream = cuda.cuda_stream();
        let captured = (|| {
            stream
                .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
                .map_err(|e| driver("begin capture", e))?;
            // The capture always ends, so a failed pass leaves the stream
            // out of capture mode.
            let written = pass(&own).and_then(|o| {
                for (buffer, t) in outputs.iter().zip(&o) {
                    buffer.slice_set(t, 0, 0)?;
                }
                Ok(())
            });
            let graph = stream.end_capture(
                CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH,
            );
            written?;
            let graph = graph
                .map_err(|e| driver("end capture", e))?
                .ok_or_else(|| driver("end capture", "no graph recorded"))?;
            graph.upload().map_err(|e| driver("graph upload", e))?;
            Ok(Captured {
                graph,
                words: words.clone(),
                inputs: own.clone(),
                outputs,
            })
        })();
        Ok((out, captured))
    }

    fn driver(what: &str, e: impl std::fmt::Display) -> ModelError {
        ModelError::Tensor(candle_core::Error::Msg(format!("CUDA {what}: {e}")))
    }

    /// Overwrites a u32 device tensor with host words (same length).
    struct Upload<'a>(&'a [u32]);

    impl InplaceOp1 for Upload<'_> {
        fn name(&self) -> &'static str {
            "graph-input-upload"
        }

        crate::cuda_only::cuda_only_cpu_fwd!(InplaceOp1);

        fn cuda_fwd(&self, storage: &mut CudaStorage, layout: &Layout) -> candle_core::Result<()> {
            if layout.shape().elem_count() != self.0.len() || !layout.is_contiguous() {
                candle_core::bail!(
                    "graph input of {} words into a buffer of {:?}",
                    self.0.len(),
                    layout.shape()
                );
            }
            let dev = storage.device().clone();
            let slice = storage.as_cuda_slice_mut::<u32>()?;
            dev.memcpy_htod(self.0, slice)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_verifying_shape_is_hot_at_once_for_few_sequences_else_on_its_third_run() {
        let graphs = DecodeGraphs::new(&Device::Cpu);
        let mut s = graphs.lock();
        let key = |rows| GraphKey {
            rows,
            seqs: FEW_SEQS + 1,
            key_bound: 256,
            layers: 30,
            outputs: rows,
        };
        assert!(!key(FEW_SEQS + 1).verifies() && key(FEW_SEQS + 2).verifies());
        let runs: Vec<bool> = (0..4).map(|_| s.hot(key(20))).collect();
        assert_eq!(runs, [false, false, true, false], "counted afresh once hot");
        assert!(!s.hot(key(21)), "each shape counts its own runs");
        let few = GraphKey {
            rows: 3,
            seqs: 1,
            ..key(0)
        };
        assert!(s.hot(few), "a lone stream's verification at once");
    }
}
