//! The candle-op implementation of the step: every GPU, and the CPU
//! reference the lean path is tested against.
//!
//! A pass embeds nothing itself (the [`Model`](super::Model) hands it the
//! input rows), runs every layer with candle ops over the fused weights of
//! [`ModelWeights`] and writes each sequence's K/V into its slot. Each
//! projection gets its input as a [`Normed`] (residual add and RMSNorm
//! still to apply), so a small-batch GPU projection can fold them into its
//! own launch (`super::gemv`); elsewhere they run first. Attention
//! is the only per-sequence part, and how it runs is chosen once per pass,
//! before the layer loop, as an [`AttentionPlan`]:
//! - **pooled**: over pooled KV on CUDA, Tandem's own kernels
//!   ([`super::pooled_attention`]) straight from the q/k/v projection; they
//!   rotate by position themselves;
//! - **batched**: over pooled KV elsewhere (or past the kernels' bounds),
//!   padded candle ops for a group of sequences
//!   ([`super::batched_attention`]), the rest one by one;
//! - **per sequence**: over per-slot KV, each sequence over its own cache.
//!
//! # Ownership
//! [`CandleStep`] belongs to its model and holds only what this path adds
//! to the weights: the rotary tables as tensors, whether the q scale is
//! folded into the weights, and the profile (behind a mutex only so the
//! model stays `Sync`; the engine thread is its one user).

use std::sync::Mutex;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};

use super::batched_attention::BatchedAttention;
use super::decode_graphs::{
    DecodeGraphs, GraphInputs, GraphKey, PassInputs, MAX_GRAPH_ROWS, MAX_GRAPH_SPAN,
};
use super::fused::Normed;
use super::llama_weights::{ModelWeights, QScale};
use super::pooled_attention::{PooledAttention, TableLayout, OWN_ROWS};
use super::{Batch, ModelConfig, ModelError, OutputRows, SeqSpan};
use crate::kv::KvCache;

// A verifying graph's attention launch writes its rows' K and V itself.
const _: () = assert!(MAX_GRAPH_SPAN <= OWN_ROWS);

/// Phases of the candle path's profile, in step order.
const CANDLE_PHASES: [&str; 5] = [
    "other",
    "qkv+rope",
    "attention",
    "o_proj+add+norm",
    "mlp+add+norm",
];

type PhaseTimes = [Duration; CANDLE_PHASES.len()];

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// How a captured pass may read a sequence of several rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ShortSpans {
    /// Every row (a decode token and the drafts it verifies). A target's
    /// final prompt chunk (its last row read) stays eager: prompt lengths
    /// vary too much for captures to pay.
    EveryRow,
    /// Every row or only the last (also a draft head's pending pairs,
    /// whose counts are the few accepted-draft counts).
    EveryOrLastRow,
}

/// A pass a CUDA graph may capture, and what it reads besides token ids.
pub(super) struct GraphPass<'a> {
    pub batch: &'a Batch,
    pub spans: ShortSpans,
    /// Input rows copied into the graph before a replay (see
    /// [`GraphInputs::rows`]).
    pub rows: Option<&'a Tensor>,
    pub num_layers: usize,
    /// A replay's outputs are the graph's own buffers (see
    /// [`GraphInputs::lend_outputs`]).
    pub lend_outputs: bool,
    /// The pass writes its rows' hidden states into the KV cache's hidden
    /// buffer, when the cache stores them (a target's decode pass, whose
    /// every row is an output).
    pub store_hidden: bool,
}

/// Whether `batch` is a pass a CUDA graph may capture: each sequence
/// decodes one token, or one token and the drafts it verifies (at most
/// [`MAX_GRAPH_SPAN`] rows, read as `spans` allows); prompt chunks are not.
fn graph_shaped(batch: &Batch, spans: ShortSpans) -> bool {
    let short_output = |o: OutputRows| match spans {
        ShortSpans::EveryRow => o == OutputRows::All,
        ShortSpans::EveryOrLastRow => o != OutputRows::None,
    };
    !batch.seqs.is_empty()
        && batch.seqs.iter().all(|s| match s.len {
            1 => s.output != OutputRows::None,
            2..=MAX_GRAPH_SPAN => short_output(s.output),
            _ => false,
        })
}

/// Accumulates the time since the previous lap into a phase, after
/// synchronising the device; does nothing when profiling is off.
struct PhaseClock<'a> {
    device: &'a Device,
    times: Option<PhaseTimes>,
    at: Instant,
}

impl<'a> PhaseClock<'a> {
    fn start(device: &'a Device, times: Option<PhaseTimes>) -> Self {
        Self {
            device,
            times,
            at: Instant::now(),
        }
    }

    fn lap(&mut self, phase: usize) -> Result<(), ModelError> {
        if let Some(t) = self.times.as_mut() {
            self.device.synchronize()?;
            let now = Instant::now();
            t[phase] += now - self.at;
            self.at = now;
        }
        Ok(())
    }

    fn finish(self) -> Option<PhaseTimes> {
        self.times
    }
}

/// A sequence's span with its first row in the batch.
type Span = (SeqSpan, usize);

/// The batch's rows of the rotary tables (one per token, by position).
struct RopeRows {
    cos: Tensor,
    sin: Tensor,
}

/// A layer's queries `[n, heads, head_dim]` (rotated and scaled), keys
/// `[n, kv_heads, head_dim]` (rotated) and values, in batch order.
struct Rotated {
    q: Tensor,
    k: Tensor,
    v: Tensor,
}

/// How a pass attends, chosen once before the layer loop and shared by
/// every layer.
enum AttentionPlan {
    /// CUDA kernels over pooled KV, from the projection rows as they are.
    Pooled(PooledAttention),
    /// Padded candle ops for a group of sequences over pooled KV; the
    /// plan's singles attend one by one.
    Batched {
        rope: RopeRows,
        plan: BatchedAttention,
    },
    /// candle ops sequence by sequence, each over its own cache.
    PerSequence { rope: RopeRows, spans: Vec<Span> },
}

/// The candle path's state, built at load.
pub(super) struct CandleStep {
    dtype: DType,
    device: Device,
    /// `[max_positions, head_dim / 2]` rotary tables in the compute dtype.
    cos: Tensor,
    sin: Tensor,
    q_scale: QScale,
    /// Per-phase times while profiling (`None`: off).
    profile: Mutex<Option<PhaseTimes>>,
    /// Captured decode passes (CUDA).
    graphs: DecodeGraphs,
}

impl CandleStep {
    /// The path for `cfg` with the f32 rotary tables (`rope_tables`) and
    /// the weights' q scale.
    pub(super) fn new(
        cfg: &ModelConfig,
        (cos, sin): (Vec<f32>, Vec<f32>),
        q_scale: QScale,
        dtype: DType,
        device: &Device,
    ) -> Result<Self, ModelError> {
        let shape = (cfg.max_position_embeddings, cfg.head_dim / 2);
        Ok(Self {
            dtype,
            device: device.clone(),
            cos: Tensor::from_vec(cos, shape, device)?.to_dtype(dtype)?,
            sin: Tensor::from_vec(sin, shape, device)?.to_dtype(dtype)?,
            q_scale,
            profile: Mutex::new(None),
            graphs: DecodeGraphs::new(device),
        })
    }

    /// Starts (or stops) accumulating per-phase step times.
    pub(super) fn set_profiling(&self, on: bool) {
        *lock(&self.profile) = on.then_some(Default::default());
    }

    /// Per-phase times accumulated since the last call (then reset).
    pub(super) fn take_profile(&self) -> Vec<(&'static str, Duration)> {
        lock(&self.profile)
            .as_mut()
            .map(|p| CANDLE_PHASES.into_iter().zip(std::mem::take(p)).collect())
            .unwrap_or_default()
    }

    /// Final norm and unembedding: `[n, hidden]` → `[n, vocab]` logits (f32).
    pub(super) fn unembed(
        &self,
        cfg: &ModelConfig,
        weights: &ModelWeights,
        hidden: &Tensor,
    ) -> Result<Tensor, ModelError> {
        let x = candle_nn::ops::rms_norm(
            &hidden.contiguous()?,
            &weights.norm,
            cfg.rms_norm_eps as f32,
        )?;
        Ok(weights.lm_head.forward(&x)?.to_dtype(DType::F32)?)
    }

    /// [`unembed`](Self::unembed) in the compute dtype, the final norm
    /// folded into the GEMV's launch where the kernel takes the rows.
    pub(super) fn unembed_compute(
        &self,
        cfg: &ModelConfig,
        weights: &ModelWeights,
        hidden: &Tensor,
    ) -> Result<Tensor, ModelError> {
        let input = Normed {
            x: hidden.contiguous()?,
            addend: None,
            norm: &weights.norm,
            eps: cfg.rms_norm_eps as f32,
        };
        Ok(input.project(&weights.lm_head, None)?.0)
    }

    /// The factor the queries still need (1 when folded into the weights).
    fn query_scale(&self, cfg: &ModelConfig) -> f64 {
        match self.q_scale {
            QScale::Folded(_) => 1.0,
            QScale::Unfolded => 1.0 / (cfg.head_dim as f64).sqrt(),
        }
    }

    /// The CUDA graphs of decode passes.
    pub(super) fn graphs(&self) -> &DecodeGraphs {
        &self.graphs
    }

    /// The first `num_layers` layers over `batch`'s token embeddings (from
    /// `embed`; batch already checked, room reserved): a replay of a
    /// captured graph where the pass is a decode one, else eagerly.
    pub(super) fn forward_tokens(
        &self,
        cfg: &ModelConfig,
        weights: &ModelWeights,
        batch: &Batch,
        kv: &mut KvCache,
        num_layers: usize,
    ) -> Result<Tensor, ModelError> {
        if let Some(hidden) = self.decode_graph(cfg, weights, batch, kv, num_layers)? {
            for s in &batch.seqs {
                kv.set_len(s.slot, s.offset + s.len)?;
            }
            return Ok(hidden);
        }
        let ids = Tensor::new(batch.tokens.as_slice(), &self.device)?;
        let x = weights.embed.index_select(&ids, 0)?;
        self.forward(cfg, weights, batch, x, kv, num_layers)
    }

    /// A decode or verification pass (every sequence at least one and at
    /// most [`MAX_GRAPH_SPAN`] tokens, every row wanted, pooled attention,
    /// no sliding window, not profiling) through [`DecodeGraphs`]; `None`
    /// for any other pass or with graphs off.
    fn decode_graph(
        &self,
        cfg: &ModelConfig,
        weights: &ModelWeights,
        batch: &Batch,
        kv: &mut KvCache,
        num_layers: usize,
    ) -> Result<Option<Tensor>, ModelError> {
        let pass = GraphPass {
            batch,
            spans: ShortSpans::EveryRow,
            rows: None,
            num_layers,
            lend_outputs: false,
            store_hidden: true,
        };
        let embed = |inputs: &PassInputs| Ok(weights.embed.index_select(&inputs.ids, 0)?);
        let out = self.graph_pass(cfg, weights, kv, pass, embed, |h| Ok(vec![h]))?;
        Ok(out.map(|mut o| o.swap_remove(0)))
    }

    /// `pass` through [`DecodeGraphs`] when it is graph-shaped (every
    /// sequence at least one and at most [`MAX_GRAPH_SPAN`] rows, the rows
    /// read as `pass.spans` allows; pooled attention, no sliding window,
    /// not profiling): `prologue` makes the layers' input rows from the
    /// device inputs, `epilogue` the outputs from the rows the batch asks
    /// for. `None` for any other pass or with graphs off (the caller runs
    /// it eagerly). Does not set the slots' KV lengths.
    pub(super) fn graph_pass(
        &self,
        cfg: &ModelConfig,
        weights: &ModelWeights,
        kv: &mut KvCache,
        pass: GraphPass<'_>,
        prologue: impl Fn(&PassInputs) -> Result<Tensor, ModelError>,
        epilogue: impl Fn(Tensor) -> Result<Vec<Tensor>, ModelError>,
    ) -> Result<Option<Vec<Tensor>>, ModelError> {
        let batch = pass.batch;
        let n = batch.tokens.len();
        if !graph_shaped(batch, pass.spans)
            || n > MAX_GRAPH_ROWS
            || cfg.sliding_window.is_some()
            || lock(&self.profile).is_some()
            || !self.graphs.enabled()
            || !PooledAttention::supports(kv, cfg, &self.device)
        {
            return Ok(None);
        }
        let keys = batch
            .seqs
            .iter()
            .map(|s| s.offset + s.len)
            .max()
            .unwrap_or(1);
        let key_bound = GraphKey::key_bound(keys);
        if !PooledAttention::fits(cfg, key_bound, kv.block_size()) {
            return Ok(None);
        }
        let layout = TableLayout::Fixed {
            blocks: key_bound.div_ceil(kv.block_size()),
        };
        let Some(host) = PooledAttention::host_plan(batch, kv, cfg, layout)? else {
            return Ok(None);
        };
        let layers = pass.num_layers.min(weights.layers.len());
        let picks = batch.output_indices();
        let key = GraphKey {
            rows: n,
            seqs: batch.seqs.len(),
            key_bound,
            layers,
            outputs: picks.len(),
        };
        let inputs = GraphInputs {
            ids: &batch.tokens,
            meta: &host.meta,
            picks: if picks.len() == n { &[] } else { &picks },
            rows: pass.rows,
            lend_outputs: pass.lend_outputs,
        };
        let pool = kv.pool_generation();
        // A pass over fewer layers (an early exit) has no target hidden
        // states to store.
        let hidden_buffer = if pass.store_hidden && layers == cfg.num_layers {
            kv.hidden_buffer_for_pass()?
                .filter(|b| b.dtype() == self.dtype && b.dim(1).ok() == Some(cfg.hidden_size))
        } else {
            None
        };
        let out = self.graphs.run(&self.device, key, pool, inputs, |inputs| {
            let x = prologue(inputs)?;
            // Spans of a verifying shape vary between replays: size for
            // the longest its rows allow.
            let own_rows = (key.rows - key.seqs + 1).min(OWN_ROWS);
            let meta = inputs.meta.clone();
            let pooled = PooledAttention::over(meta, kv, cfg, n, key_bound, own_rows)?;
            let plan = AttentionPlan::Pooled(pooled);
            let x = self.layers(cfg, weights, x, kv, layers, &plan)?;
            if let (Some(buffer), AttentionPlan::Pooled(pooled)) = (&hidden_buffer, &plan) {
                pooled.write_hidden(buffer, &x)?;
            }
            epilogue(match &inputs.picks {
                Some(picks) => x.index_select(picks, 0)?,
                None => x,
            })
        })?;
        if out.is_some() && hidden_buffer.is_some() {
            kv.mark_hidden_written();
        }
        Ok(out)
    }

    /// The first `num_layers` layers over input rows `x` (`[n, hidden]`,
    /// compute dtype; batch already checked, room reserved). Returns the
    /// hidden states of the rows the batch asks for.
    pub(super) fn forward(
        &self,
        cfg: &ModelConfig,
        weights: &ModelWeights,
        batch: &Batch,
        x: Tensor,
        kv: &mut KvCache,
        num_layers: usize,
    ) -> Result<Tensor, ModelError> {
        let plan = self.plan(cfg, batch, kv)?;
        let x = self.layers(cfg, weights, x, kv, num_layers, &plan)?;
        for s in &batch.seqs {
            kv.set_len(s.slot, s.offset + s.len)?;
        }
        self.output_rows(batch, x)
    }

    /// Runs the first `num_layers` layers over `x` with `plan`; every row's
    /// output.
    fn layers(
        &self,
        cfg: &ModelConfig,
        weights: &ModelWeights,
        mut x: Tensor,
        kv: &mut KvCache,
        num_layers: usize,
        plan: &AttentionPlan,
    ) -> Result<Tensor, ModelError> {
        let eps = cfg.rms_norm_eps as f32;
        let mut clock = PhaseClock::start(&self.device, lock(&self.profile).take());
        let layers = &weights.layers[..num_layers.min(weights.layers.len())];
        // Each projection gets its input with the residual add and norm
        // still to apply (`Normed`), so a small-batch GPU projection folds
        // them into its launch; `down` is the last layer's MLP output, not
        // yet added to the stream.
        let mut down: Option<Tensor> = None;
        for (l, layer) in layers.iter().enumerate() {
            clock.lap(0)?;
            let input = Normed {
                x,
                addend: down.take(),
                norm: &layer.attn_norm,
                eps,
            };
            let (mut qkv, residual) = input.project(&layer.qkv, None)?;
            if let Some(b) = &layer.qkv_bias {
                qkv = qkv.broadcast_add(b)?;
            }
            let attn = self.attend(cfg, l, &qkv, plan, kv, &mut clock)?;
            clock.lap(2)?;
            let input = Normed {
                x: residual,
                addend: Some(layer.o_proj.forward(&attn)?),
                norm: &layer.mlp_norm,
                eps,
            };
            clock.lap(3)?;
            let (act, residual) = input.project(&layer.gate_up, Some(cfg.intermediate_size))?;
            x = residual;
            down = Some(layer.down.forward(&act)?);
            clock.lap(4)?;
        }
        if let Some(down) = down {
            x = (x + down)?;
        }
        *lock(&self.profile) = clock.finish();
        Ok(x)
    }

    /// The rows of `x` the batch asks for.
    fn output_rows(&self, batch: &Batch, x: Tensor) -> Result<Tensor, ModelError> {
        let wanted = batch.output_indices();
        if wanted.len() == batch.tokens.len() {
            return Ok(x);
        }
        if wanted.is_empty() {
            // A view: CUDA refuses zero-byte allocations.
            return Ok(x.narrow(0, 0, 0)?);
        }
        let idx = Tensor::new(wanted.as_slice(), &self.device)?;
        Ok(x.index_select(&idx, 0)?)
    }

    /// This pass's attention plan: the CUDA kernels when they can take the
    /// batch, else padded ops when some sequences are worth padding
    /// together, else sequence by sequence.
    fn plan(
        &self,
        cfg: &ModelConfig,
        batch: &Batch,
        kv: &KvCache,
    ) -> Result<AttentionPlan, ModelError> {
        if let Some(pooled) = PooledAttention::plan(batch, kv, cfg, &self.device)? {
            return Ok(AttentionPlan::Pooled(pooled));
        }
        let spans: Vec<Span> = batch
            .seqs
            .iter()
            .scan(0, |at, s| {
                *at += s.len;
                Some((*s, *at - s.len))
            })
            .collect();
        let n = batch.tokens.len();
        let batched = BatchedAttention::plan(&spans, n, kv, cfg, self.dtype, &self.device)?;
        let rope = self.rope_rows(batch)?;
        Ok(match batched {
            Some(plan) => AttentionPlan::Batched { rope, plan },
            None => AttentionPlan::PerSequence { rope, spans },
        })
    }

    /// The rotary tables' rows at the batch's positions.
    fn rope_rows(&self, batch: &Batch) -> Result<RopeRows, ModelError> {
        let positions: Vec<u32> = batch
            .seqs
            .iter()
            .flat_map(|s| (s.offset..s.offset + s.len).map(|p| p as u32))
            .collect();
        let positions = Tensor::new(positions.as_slice(), &self.device)?;
        Ok(RopeRows {
            cos: self.cos.index_select(&positions, 0)?,
            sin: self.sin.index_select(&positions, 0)?,
        })
    }

    /// Layer `l`'s q/k/v projection of `h` and its attention output
    /// `[n, heads·head_dim]` in batch order, writing the new K/V.
    #[allow(clippy::too_many_arguments)]
    fn attend(
        &self,
        cfg: &ModelConfig,
        l: usize,
        qkv: &Tensor,
        plan: &AttentionPlan,
        kv: &mut KvCache,
        clock: &mut PhaseClock<'_>,
    ) -> Result<Tensor, ModelError> {
        match plan {
            AttentionPlan::Pooled(pooled) => {
                clock.lap(1)?;
                let q_scale = self.query_scale(cfg) as f32;
                pooled.forward(cfg, kv, l, qkv, (&self.cos, &self.sin), q_scale)
            }
            AttentionPlan::Batched { rope, plan } => {
                let r = self.rotated(cfg, qkv, rope)?;
                clock.lap(1)?;
                if plan.singles().is_empty() {
                    return plan.forward(cfg, kv, l, &r.q, &r.k, &r.v);
                }
                let mut parts = vec![plan.forward(cfg, kv, l, &r.q, &r.k, &r.v)?];
                parts.extend(self.attend_each(cfg, plan.singles(), kv, l, &r)?);
                plan.reorder(&parts)
            }
            AttentionPlan::PerSequence { rope, spans } => {
                let r = self.rotated(cfg, qkv, rope)?;
                clock.lap(1)?;
                let mut parts = self.attend_each(cfg, spans, kv, l, &r)?;
                Ok(if parts.len() == 1 {
                    parts.pop().expect("one part")
                } else {
                    Tensor::cat(&parts, 0)?
                })
            }
        }
    }

    /// Splits the projection `[n, (heads + 2·kv_heads)·head_dim]` into
    /// rotated (and scaled) queries, rotated keys and values.
    fn rotated(
        &self,
        cfg: &ModelConfig,
        qkv: &Tensor,
        rope: &RopeRows,
    ) -> Result<Rotated, ModelError> {
        let n = qkv.dim(0)?;
        let (nh, nkv, hd) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
        let q = qkv
            .narrow(1, 0, nh * hd)?
            .contiguous()?
            .reshape((1, n, nh, hd))?;
        let k = qkv
            .narrow(1, nh * hd, nkv * hd)?
            .contiguous()?
            .reshape((1, n, nkv, hd))?;
        let v = qkv
            .narrow(1, (nh + nkv) * hd, nkv * hd)?
            .contiguous()?
            .reshape((n, nkv, hd))?;
        let q = candle_nn::rotary_emb::rope_thd(&q, &rope.cos, &rope.sin)?.squeeze(0)?;
        let q = match self.q_scale {
            QScale::Folded(_) => q,
            QScale::Unfolded => (q * self.query_scale(cfg))?,
        };
        let k = candle_nn::rotary_emb::rope_thd(&k, &rope.cos, &rope.sin)?.squeeze(0)?;
        Ok(Rotated { q, k, v })
    }

    /// Attention sequence by sequence: writes each one's new K/V (rows
    /// `start..start + len` of the batch) into its slot and attends over its
    /// cache in place; one output per sequence.
    fn attend_each(
        &self,
        cfg: &ModelConfig,
        spans: &[Span],
        kv: &mut KvCache,
        layer: usize,
        Rotated { q, k, v }: &Rotated,
    ) -> Result<Vec<Tensor>, ModelError> {
        let mut outs = Vec::with_capacity(spans.len());
        for &(s, start) in spans {
            kv.write(
                s.slot,
                layer,
                s.offset,
                &k.narrow(0, start, s.len)?,
                &v.narrow(0, start, s.len)?,
            )?;
            let (kc, vc) = kv.view(s.slot, layer, s.offset + s.len)?;
            let q = q.narrow(0, start, s.len)?;
            outs.push(self.sequence_attention(cfg, &q, &kc, &vc, s.offset)?);
        }
        Ok(outs)
    }

    /// Causal attention of one sequence's queries `[len, heads, head_dim]`
    /// (already scaled) over its cache `[offset + len, kv_heads, head_dim]`.
    fn sequence_attention(
        &self,
        cfg: &ModelConfig,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        offset: usize,
    ) -> Result<Tensor, ModelError> {
        let (nh, nkv, hd, g) = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.group_size(),
        );
        let len = q.dim(0)?;
        let total = k.dim(0)?;
        // Keys before the sliding window of the *first* query are never seen.
        let first_key = match cfg.sliding_window {
            Some(w) if offset + 1 > w => offset + 1 - w,
            _ => 0,
        };
        let (k, v) = if first_key > 0 {
            (
                k.narrow(0, first_key, total - first_key)?,
                v.narrow(0, first_key, total - first_key)?,
            )
        } else {
            (k.clone(), v.clone())
        };
        let keys = total - first_key;

        // Group the query heads that share a KV head: rows are (position, head-in-group).
        let qg = q
            .reshape((len, nkv, g, hd))?
            .permute((1, 0, 2, 3))?
            .contiguous()?
            .reshape((nkv, len * g, hd))?;
        let kt = k.permute((1, 2, 0))?; // [kv_heads, head_dim, keys]
        let vt = v.permute((1, 0, 2))?; // [kv_heads, keys, head_dim]
        let (kt, vt) = if self.device.is_cpu() {
            (kt, vt)
        } else {
            (kt.contiguous()?, vt.contiguous()?)
        };
        let mut scores = qg.matmul(&kt)?; // [kv_heads, len·g, keys]
        if len > 1 || cfg.sliding_window.is_some() {
            let mask = self.mask(cfg, len, offset, first_key, keys)?;
            if let Some(mask) = mask {
                scores = scores.broadcast_add(&mask)?;
            }
        }
        let probs = candle_nn::ops::softmax_last_dim(&scores)?;
        let out = probs.matmul(&vt)?; // [kv_heads, len·g, head_dim]
        Ok(out
            .reshape((nkv, len, g, hd))?
            .permute((1, 0, 2, 3))?
            .contiguous()?
            .reshape((len, nh * hd))?)
    }

    /// Additive mask `[len·g, keys]` (g: query heads per KV head): query
    /// row r sits at position `offset + r / g` and sees keys at positions ≤
    /// its own (and inside the sliding window). `None` when nothing is
    /// masked.
    fn mask(
        &self,
        cfg: &ModelConfig,
        len: usize,
        offset: usize,
        first_key: usize,
        keys: usize,
    ) -> Result<Option<Tensor>, ModelError> {
        let (window, g) = (cfg.sliding_window, cfg.group_size());
        let mut any = false;
        let mut data = vec![0f32; len * g * keys];
        for r in 0..len * g {
            let pos = offset + r / g;
            for j in 0..keys {
                let kpos = first_key + j;
                let hidden = kpos > pos || window.is_some_and(|w| kpos + w <= pos);
                if hidden {
                    data[r * keys + j] = f32::NEG_INFINITY;
                    any = true;
                }
            }
        }
        if !any {
            return Ok(None);
        }
        Ok(Some(
            Tensor::from_vec(data, (len * g, keys), &self.device)?.to_dtype(self.dtype)?,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(spans: &[(usize, OutputRows)]) -> Batch {
        let mut b = Batch::default();
        for (slot, &(len, output)) in spans.iter().enumerate() {
            b.push(slot as u32, 10, &vec![1; len], output);
        }
        b
    }

    #[test]
    fn decode_and_verification_passes_are_graph_shaped_prompt_chunks_are_not() {
        use OutputRows::{All, Last, None as Hidden};
        let graph_shaped = |b: &Batch| graph_shaped(b, ShortSpans::EveryRow);
        assert!(graph_shaped(&batch(&[(1, Last), (1, Last)])), "decodes");
        assert!(
            graph_shaped(&batch(&[(1, Last), (4, All)])),
            "a verification"
        );
        assert!(
            graph_shaped(&batch(&[(MAX_GRAPH_SPAN, All)])),
            "eight drafts"
        );
        assert!(!graph_shaped(&batch(&[])), "nothing to run");
        assert!(
            !graph_shaped(&batch(&[(MAX_GRAPH_SPAN + 1, All)])),
            "a long span"
        );
        assert!(
            !graph_shaped(&batch(&[(1, Last), (4, Last)])),
            "a final prompt chunk"
        );
        assert!(!graph_shaped(&batch(&[(1, Hidden)])), "a row nobody reads");
        assert!(
            !graph_shaped(&batch(&[(1, Last), (0, Last)])),
            "an empty span"
        );
    }

    #[test]
    fn a_draft_heads_pending_pairs_are_graph_shaped_when_allowed() {
        use OutputRows::{All, Last, None as Hidden};
        let pending = batch(&[(1, Last), (4, Last)]);
        assert!(graph_shaped(&pending, ShortSpans::EveryOrLastRow));
        assert!(!graph_shaped(&pending, ShortSpans::EveryRow));
        let allowed =
            |spans: &[(usize, OutputRows)]| graph_shaped(&batch(spans), ShortSpans::EveryOrLastRow);
        assert!(allowed(&[(3, All), (1, Last)]));
        assert!(!allowed(&[(2, Hidden)]), "a span nobody reads");
        assert!(!allowed(&[(MAX_GRAPH_SPAN + 1, Last)]), "a prompt chunk");
    }
}
