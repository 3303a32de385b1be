//! The Llama-family decoder (Llama 2/3, Mistral, Qwen2), after
//! "LLaMA: Open and Efficient Foundation Language Models" (Touvron et al.,
//! 2023), with a position and a KV cache per sequence.
//!
//! Weights are fused at load (q/k/v into one projection, gate/up into one)
//! so a step runs few, large matmuls over every token of the batch: the
//! weights are read once per step, not once per sequence. Attention is the
//! only per-sequence part; it reads each slot's cache in place.
//!
//! RoPE uses the "rotate half" pairing (dimension i with i + d/2), which is
//! what Hugging Face checkpoints expect: their q/k weights are permuted for
//! it. Using the interleaved pairing on them would silently give garbage.
//!
//! # Weights, and one implementation of the step per backend
//! [`Model`] owns the config and the weights (`llama_weights`,
//! loaded layer by layer) and runs every step through one implementation,
//! chosen once at load:
//! - on CPU, the lean path (`lean`: Tandem's own kernels over
//!   reused buffers);
//! - elsewhere, or with [`LoadOptions::lean_cpu`] off, candle ops
//!   (`candle_step`), which choose once per pass how to attend:
//!   Tandem's kernels over pooled KV on CUDA (`pooled_attention`),
//!   padded candle ops over pooled KV elsewhere
//!   (`batched_attention`), or sequence by sequence over per-slot
//!   KV.
//!
//! Both read the same weights and caches and agree within rounding; the
//! candle path is the reference the lean one is tested against. This file
//! keeps what does not depend on the backend: loading, checking a batch,
//! and the public API.

use std::path::Path;
use std::time::Duration;

use candle_core::{DType, Device, IndexOp, Tensor};

use super::candle_step::{CandleStep, GraphPass, ShortSpans};
use super::decode_graphs::{GraphStats, PassInputs};
use super::kernels::qformat::ActivationQuant;
use super::lean::Lean;
use super::linear::{Linear, WeightFormat};
use super::llama_weights::{rope_tables, LayerWeights, ModelWeights, QScale, WeightLoader};
use super::{Batch, ModelConfig, ModelError, OutputRows, Weights};
use crate::kv::{KeyOrder, KvCache, KvLayout};

/// How to load a model.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// Compute dtype: f32 (the default) or f16 on CPU, where activations
    /// stay f32 and f16 is the storage of weights (the KV cache's dtype is
    /// [`kv_dtype`](Self::kv_dtype)'s); bf16
    /// needs a GPU.
    pub dtype: DType,
    pub device: Device,
    /// Storage of the projection weights; quantised formats are made at load.
    pub weight_format: WeightFormat,
    /// On CPU, run steps through the lean kernels (the default) rather than
    /// candle ops. Off is the slower reference path.
    pub lean_cpu: bool,
    /// Most threads a CPU step uses (`None`: one per physical core, or
    /// `CANDLE_NUM_THREADS`, which sizes the shared pool once per process).
    pub threads: Option<usize>,
    /// How the lean CPU path quantises activations for quantised weights:
    /// 8-bit, as llama.cpp (the default), or 15-bit, closer to f32.
    pub activation_quant: ActivationQuant,
    /// On the lean path with 8-bit activations, repack Q8_0 projections
    /// 8 rows interleaved for the quantised linear's register tile (the
    /// same bytes, permuted; on by default). Off keeps GGML's layout, for
    /// A/B measurements.
    pub repack_quantised: bool,
    /// KV cache dtype. `None`: f16 on the lean CPU path (llama.cpp's
    /// default cache type: half the memory and half the bytes attention
    /// reads of an f32 cache, for keys and values rounded to f16; 1.15–1.28×
    /// decode from 4 sequences on, BENCHMARKS.md), the compute dtype
    /// elsewhere. The lean path also takes `F32`; other paths take their
    /// compute dtype only.
    pub kv_dtype: Option<DType>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            dtype: DType::F32,
            device: Device::Cpu,
            weight_format: WeightFormat::AsCompute,
            lean_cpu: true,
            threads: None,
            activation_quant: ActivationQuant::default(),
            repack_quantised: true,
            kv_dtype: None,
        }
    }
}

/// How a model runs its steps, chosen once at load.
enum Step {
    /// Tandem's CPU kernels over reused f32 buffers ([`super::lean`]).
    Lean(Box<Lean>),
    /// candle ops ([`super::candle_step`]): GPUs (with Tandem's attention
    /// kernels over pooled KV and CUDA graphs on CUDA), and the CPU
    /// reference. Both boxed: their state differs in size.
    Candle(Box<CandleStep>),
}

/// Bytes of a model's projection weights by projection ([`Model::projection_bytes`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProjectionBytes {
    pub qkv: usize,
    pub o_proj: usize,
    pub gate_up: usize,
    pub down: usize,
    pub lm_head: usize,
}

/// A loaded model. Immutable after load; the engine owns it with the caches.
pub struct Model {
    cfg: ModelConfig,
    dtype: DType,
    kv_dtype: DType,
    device: Device,
    weights: ModelWeights,
    step: Step,
}

/// Refuses a compute dtype the device cannot run.
fn check_dtype(dtype: DType, device: &Device) -> Result<(), ModelError> {
    match dtype {
        DType::F32 | DType::F16 => Ok(()),
        DType::BF16 if !device.is_cpu() => Ok(()),
        DType::BF16 => Err(ModelError::UnsupportedDType(
            "bf16 compute needs a GPU; use f32 or f16 on CPU".into(),
        )),
        other => Err(ModelError::UnsupportedDType(format!(
            "{other:?} (use f32, f16 or bf16)"
        ))),
    }
}

/// The KV cache dtype for `asked` (`None`: f16 on the lean path, else the
/// compute dtype), or an error when the step path cannot attend over it.
fn kv_dtype(asked: Option<DType>, compute: DType, lean: bool) -> Result<DType, ModelError> {
    match asked {
        None if lean => Ok(DType::F16),
        None => Ok(compute),
        Some(d) if d == compute || (lean && matches!(d, DType::F32 | DType::F16)) => Ok(d),
        Some(d) => Err(ModelError::UnsupportedDType(format!(
            "{d:?} KV cache under {compute:?} compute (the CPU's lean path takes f32 or f16; \
             other paths their compute dtype)"
        ))),
    }
}

impl Model {
    /// Loads `config.json` and the safetensors of a Hugging Face model directory.
    pub fn from_dir(dir: &Path, opts: &LoadOptions) -> Result<Self, ModelError> {
        let cfg = ModelConfig::from_dir(dir)?;
        let weights = Weights::from_dir(dir)?;
        Self::load(cfg, &weights, opts)
    }

    /// Builds the model from any weight source.
    pub fn load(cfg: ModelConfig, w: &Weights, opts: &LoadOptions) -> Result<Self, ModelError> {
        let (dtype, dev) = (opts.dtype, &opts.device);
        check_dtype(dtype, dev)?;
        let use_lean = dev.is_cpu() && opts.lean_cpu;
        let kv_dtype = kv_dtype(opts.kv_dtype, dtype, use_lean)?;
        // The candle path folds the softmax scale 1/√head_dim into the q
        // projection when that is exact (a power of two: head_dim 16, 64,
        // 256), which saves a launch per layer on GPUs. The lean path scales
        // on its own.
        let scale = 1.0 / (cfg.head_dim as f64).sqrt();
        let q_scale = if !use_lean && scale.log2().fract() == 0.0 {
            QScale::Folded(scale)
        } else {
            QScale::Unfolded
        };
        let loader = WeightLoader::new(&cfg, w, dtype, dev, opts.weight_format)?;
        let mut weights = ModelWeights::load(&loader, &cfg, q_scale)?;
        let repack =
            use_lean && opts.repack_quantised && opts.activation_quant == ActivationQuant::Int8;
        if repack {
            weights = weights.repacked()?;
        }
        let tables = rope_tables(&cfg);
        let step = if use_lean {
            Step::Lean(Box::new(Lean::new(
                &weights,
                tables,
                dtype,
                opts.threads,
                opts.activation_quant,
                repack,
            )?))
        } else {
            Step::Candle(Box::new(CandleStep::new(
                &cfg, tables, q_scale, dtype, dev,
            )?))
        };
        Ok(Self {
            cfg,
            dtype,
            kv_dtype,
            device: dev.clone(),
            weights,
            step,
        })
    }

    /// The loaded weights, for tests of their formats.
    #[cfg(test)]
    pub(super) fn loaded_weights(&self) -> &ModelWeights {
        &self.weights
    }

    /// Whether steps run on the lean CPU path.
    pub fn is_lean(&self) -> bool {
        matches!(self.step, Step::Lean(_))
    }

    /// `w` (`[n, k]`), a projection the caller owns (an MTP head's input
    /// projection), in `format` and this model's dtype and device, laid
    /// out for its path's kernels.
    pub(super) fn own_linear(&self, w: Tensor, format: WeightFormat) -> Result<Linear, ModelError> {
        let w = Linear::new(w, format, self.dtype, &self.device, None)?;
        match &self.step {
            Step::Lean(l) => l.prepare(w),
            Step::Candle(_) => Ok(w),
        }
    }

    /// `x` (`[rows, k]`) through a projection from
    /// [`own_linear`](Self::own_linear), with this model's kernels:
    /// `[rows, n]` (f32 on the lean CPU path, else `x`'s dtype).
    pub(super) fn project(&self, w: &Linear, x: &Tensor) -> Result<Tensor, ModelError> {
        match &self.step {
            Step::Lean(l) => l.project(w, x),
            Step::Candle(_) => Ok(w.forward(x)?),
        }
    }

    /// Starts (`true`) or stops accumulating per-phase step times; read
    /// them with [`take_profile`](Self::take_profile). On the candle path
    /// (GPUs) profiling synchronises the device at every phase boundary,
    /// which slows the step down.
    pub fn set_profiling(&self, on: bool) {
        match &self.step {
            Step::Lean(l) => l.set_profiling(on),
            Step::Candle(c) => c.set_profiling(on),
        }
    }

    /// Per-phase times (step order) accumulated since the last call, when
    /// profiling is on; empty otherwise.
    pub fn take_profile(&self) -> Vec<(&'static str, Duration)> {
        match &self.step {
            Step::Lean(l) => l.take_profile(),
            Step::Candle(c) => c.take_profile(),
        }
    }

    /// Turns CUDA graphs of decode passes on (the default on CUDA, unless
    /// `TANDEM_CUDA_GRAPHS=0`) or off; a no-op elsewhere. Replays equal the
    /// eager passes bit for bit: this changes only host time.
    pub fn set_cuda_graphs(&self, on: bool) {
        if let Step::Candle(c) = &self.step {
            c.graphs().set_enabled(on, &self.device);
        }
    }

    /// What CUDA graphs of decode passes have done since load (all zero
    /// off CUDA or with graphs off).
    pub fn cuda_graph_stats(&self) -> GraphStats {
        match &self.step {
            Step::Candle(c) => c.graphs().stats(),
            Step::Lean(_) => GraphStats::default(),
        }
    }

    /// Sequences above which this model's verifying passes mostly run
    /// eagerly while those of fewer replay CUDA graphs (the draft policy
    /// prices the two apart); `None` where every pass runs alike (off CUDA
    /// or with graphs off).
    pub fn eager_verify_above(&self) -> Option<usize> {
        match &self.step {
            Step::Candle(c) => c.graphs().eager_verify_above(),
            Step::Lean(_) => None,
        }
    }

    /// The most rows a pass may hold with each row computed to the same
    /// bits as in a pass of that row alone (`None`: any pass). The lean
    /// CPU kernels never let a row's sums depend on its batch; on CUDA
    /// Tandem's GEMV takes passes of up to 9 rows by default and every
    /// pass with `TANDEM_BATCH_INVARIANT=1`, and the norms and the pooled
    /// KV cache's attention kernels (the engine's cache) are per row (the
    /// padded `batched_attention` of other caches is not); candle's CPU
    /// and Metal matmuls promise no such thing.
    pub fn batch_invariant_rows(&self) -> Option<usize> {
        match &self.step {
            Step::Lean(_) => None,
            Step::Candle(_) if self.device.is_cuda() => super::gemv::invariant_rows(),
            Step::Candle(_) => Some(1),
        }
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The tensors a draft head shares with its target (no copy): token
    /// embeddings `[vocab, hidden]`, final norm `[hidden]`, unembedding
    /// `[vocab, hidden]`, in the compute dtype.
    pub fn shared_tensors(&self) -> Result<(Tensor, Tensor, Tensor), ModelError> {
        let w = &self.weights;
        Ok((w.embed.clone(), w.norm.clone(), w.lm_head.dense()?))
    }

    /// Whether the projection weights are multiplied in GGML blocks (a
    /// quantised GGUF kept as stored, or `--dtype q8_0` / `q4_k`): a draft
    /// head then quantises its own projections too, so its cost scales
    /// with the target's.
    pub fn quantized_projections(&self) -> bool {
        let first = self.weights.layers.first();
        self.weights.lm_head.quantised() || first.is_some_and(|l| l.down.quantised())
    }

    /// Bytes of the projection weights one pass reads, as held (each in
    /// its own format: a quantised GGUF's mixes, or `q4_k`'s Q8_0 fallback
    /// where a width is not a multiple of 256), summed over the layers.
    pub fn projection_bytes(&self) -> ProjectionBytes {
        let layers = &self.weights.layers;
        let sum = |f: fn(&LayerWeights) -> &Linear| layers.iter().map(|l| f(l).bytes()).sum();
        ProjectionBytes {
            qkv: sum(|l| &l.qkv),
            o_proj: sum(|l| &l.o_proj),
            gate_up: sum(|l| &l.gate_up),
            down: sum(|l| &l.down),
            lm_head: self.weights.lm_head.bytes(),
        }
    }

    /// The KV entry shape this model needs; the lean CPU path's pool
    /// keeps each block's keys transposed (its attention scores a block's
    /// keys in vector lanes).
    pub fn kv_layout(&self) -> KvLayout {
        KvLayout {
            num_layers: self.cfg.num_layers,
            num_kv_heads: self.cfg.num_kv_heads,
            head_dim: self.cfg.head_dim,
            dtype: self.kv_dtype,
            keys: if self.is_lean() {
                KeyOrder::BlockLanes
            } else {
                KeyOrder::Rows
            },
        }
    }

    /// Embeddings of `ids`: `[n, hidden]`.
    pub fn token_embeddings(&self, ids: &[u32]) -> Result<Tensor, ModelError> {
        self.check_tokens(ids)?;
        let ids = Tensor::new(ids, &self.device)?;
        Ok(self.weights.embed.index_select(&ids, 0)?)
    }

    /// Token ids must index the embedding table. Requests are checked at
    /// the edge (`scheduler::validate`); this guards the model's own
    /// callers (tools, tests, draft heads) against an out-of-bounds lookup.
    pub(super) fn check_tokens(&self, ids: &[u32]) -> Result<(), ModelError> {
        match ids.iter().find(|&&t| t as usize >= self.cfg.vocab_size) {
            Some(&bad) => Err(ModelError::InvalidBatch(format!(
                "token id {bad} is outside the vocabulary of {}",
                self.cfg.vocab_size
            ))),
            None => Ok(()),
        }
    }

    /// Final norm and unembedding: `[n, hidden]` → `[n, vocab]` logits (f32).
    pub fn unembed(&self, hidden: &Tensor) -> Result<Tensor, ModelError> {
        match &self.step {
            Step::Lean(l) => l.unembed(&self.cfg, &self.weights, hidden),
            Step::Candle(c) => c.unembed(&self.cfg, &self.weights, hidden),
        }
    }

    /// [`unembed`](Self::unembed) in the compute dtype (f32 on the lean CPU
    /// path): on CUDA the final norm folds into the projection's launch
    /// where the GEMV kernel takes the rows, and no conversion launch
    /// follows (an MTP head's draft rounds, bound by launches).
    pub fn unembed_compute(&self, hidden: &Tensor) -> Result<Tensor, ModelError> {
        match &self.step {
            Step::Lean(l) => l.unembed(&self.cfg, &self.weights, hidden),
            Step::Candle(c) => c.unembed_compute(&self.cfg, &self.weights, hidden),
        }
    }

    /// Runs every layer over the batch; returns the (pre-final-norm) hidden
    /// states of the rows each sequence asked for, `[batch.num_outputs(), hidden]`.
    /// Appends each sequence's K/V to its slot at `offset..offset + len`.
    pub fn forward(&self, batch: &Batch, kv: &mut KvCache) -> Result<Tensor, ModelError> {
        self.forward_layers(batch, kv, self.cfg.num_layers)
    }

    /// Like [`forward`](Self::forward) but stops after the first
    /// `num_layers` layers (early exit). Only those layers' K/V are written.
    pub fn forward_layers(
        &self,
        batch: &Batch,
        kv: &mut KvCache,
        num_layers: usize,
    ) -> Result<Tensor, ModelError> {
        self.check_batch(batch, kv, num_layers)?;
        self.check_tokens(&batch.tokens)?;
        for s in &batch.seqs {
            kv.ensure_room(s.slot, s.len)?;
        }
        let (cfg, w) = (&self.cfg, &self.weights);
        match &self.step {
            Step::Lean(l) => l.forward(cfg, w, batch, kv, num_layers, None),
            Step::Candle(c) => c.forward_tokens(cfg, w, batch, kv, num_layers),
        }
    }

    /// Runs every layer over input embeddings `[batch.tokens.len(), hidden]`
    /// given by the caller instead of the token embeddings (`batch.tokens`
    /// then only sets the span lengths). MTP heads feed their projected
    /// inputs through their decoder block this way.
    pub fn forward_embeddings(
        &self,
        batch: &Batch,
        embeddings: Tensor,
        kv: &mut KvCache,
    ) -> Result<Tensor, ModelError> {
        self.check_batch(batch, kv, self.cfg.num_layers)?;
        let expected = (batch.tokens.len(), self.cfg.hidden_size);
        if embeddings.dims2()? != expected {
            return Err(ModelError::InvalidBatch(format!(
                "embeddings of shape {:?}, expected {expected:?}",
                embeddings.dims()
            )));
        }
        for s in &batch.seqs {
            kv.ensure_room(s.slot, s.len)?;
        }
        let (cfg, w, layers) = (&self.cfg, &self.weights, self.cfg.num_layers);
        match &self.step {
            Step::Lean(l) => l.forward(cfg, w, batch, kv, layers, Some(&embeddings)),
            Step::Candle(c) => {
                let x = embeddings.to_dtype(self.dtype)?;
                c.forward(cfg, w, batch, x, kv, layers)
            }
        }
    }

    /// A pass whose layer input and outputs the caller computes on the
    /// device around the layers (an MTP head's round: its input projection
    /// before, its unembedding and argmax after), captured in a CUDA graph
    /// with them and replayed when the batch is graph-shaped (every span at
    /// most nine rows, each read whole or for its last row; see
    /// `decode_graphs`). `prologue` maps the graph's device inputs (token
    /// ids, and `rows` copied into the graph's buffer) to the layers'
    /// `[tokens, hidden]` input; `epilogue` maps the rows the batch asks
    /// for to the outputs. `None` where no graph runs (the CPU, graphs off,
    /// other shapes): the caller then runs the same ops eagerly. The token
    /// ids are the caller's to check (they need not index this model's
    /// vocabulary). Writes each sequence's K/V as a forward pass does. A
    /// replay's outputs are the graph's own buffers, valid until the same
    /// shape's next pass: the caller reads (or copies) them before that.
    pub(super) fn captured_pass(
        &self,
        batch: &Batch,
        kv: &mut KvCache,
        rows: Option<&Tensor>,
        prologue: impl Fn(&PassInputs) -> Result<Tensor, ModelError>,
        epilogue: impl Fn(Tensor) -> Result<Vec<Tensor>, ModelError>,
    ) -> Result<Option<Vec<Tensor>>, ModelError> {
        let Step::Candle(c) = &self.step else {
            return Ok(None);
        };
        self.check_batch(batch, kv, self.cfg.num_layers)?;
        for s in &batch.seqs {
            kv.ensure_room(s.slot, s.len)?;
        }
        let pass = GraphPass {
            batch,
            spans: ShortSpans::EveryOrLastRow,
            rows,
            num_layers: self.cfg.num_layers,
            lend_outputs: true,
            store_hidden: false,
        };
        let out = c.graph_pass(&self.cfg, &self.weights, kv, pass, prologue, epilogue)?;
        if out.is_some() {
            for s in &batch.seqs {
                kv.set_len(s.slot, s.offset + s.len)?;
            }
        }
        Ok(out)
    }

    fn check_batch(
        &self,
        batch: &Batch,
        kv: &KvCache,
        num_layers: usize,
    ) -> Result<(), ModelError> {
        if num_layers == 0 || num_layers > self.cfg.num_layers {
            return Err(ModelError::InvalidBatch(format!(
                "num_layers {num_layers} outside 1..={}",
                self.cfg.num_layers
            )));
        }
        if batch.seqs.is_empty() {
            return Err(ModelError::InvalidBatch("empty batch".into()));
        }
        let total: usize = batch.seqs.iter().map(|s| s.len).sum();
        if total != batch.tokens.len() {
            return Err(ModelError::InvalidBatch(format!(
                "spans cover {total} tokens but the batch holds {}",
                batch.tokens.len()
            )));
        }
        for (i, s) in batch.seqs.iter().enumerate() {
            if s.len == 0 {
                return Err(ModelError::InvalidBatch(format!(
                    "sequence of slot {} has no tokens",
                    s.slot
                )));
            }
            if batch.seqs[..i].iter().any(|o| o.slot == s.slot) {
                return Err(ModelError::InvalidBatch(format!(
                    "slot {} appears twice",
                    s.slot
                )));
            }
            let have = kv.len(s.slot)?;
            if s.offset != have {
                return Err(ModelError::InvalidBatch(format!(
                    "slot {} starts at position {} but its cache holds {have}",
                    s.slot, s.offset
                )));
            }
            if s.offset + s.len > self.cfg.max_position_embeddings {
                return Err(ModelError::InvalidBatch(format!(
                    "slot {} reaches position {} beyond the context of {}",
                    s.slot,
                    s.offset + s.len,
                    self.cfg.max_position_embeddings
                )));
            }
        }
        Ok(())
    }

    /// Logits of the last position of one sequence fed from scratch, for tests
    /// and tools (allocates and frees a temporary slot).
    pub fn logits_for(&self, tokens: &[u32]) -> Result<Vec<f32>, ModelError> {
        let mut kv = KvCache::new(self.kv_layout(), self.device.clone(), tokens.len());
        kv.allocate(0, tokens.len())?;
        let mut batch = Batch::default();
        batch.push(0, 0, tokens, OutputRows::Last);
        let hidden = self.forward(&batch, &mut kv)?;
        Ok(self.unembed(&hidden)?.i(0)?.to_vec1()?)
    }

    /// Greedy continuations of `prompts`, decoded together (one forward
    /// pass per step, argmax of the logits), for tests and tools: `steps`
    /// ids per prompt. Uses a temporary KV cache on the model's device.
    pub fn greedy(&self, prompts: &[Vec<u32>], steps: usize) -> Result<Vec<Vec<u32>>, ModelError> {
        let need: usize = prompts.iter().map(|p| p.len() + steps).sum();
        let mut kv = KvCache::new(self.kv_layout(), self.device.clone(), need);
        let mut out = vec![Vec::with_capacity(steps); prompts.len()];
        let mut batch = Batch::default();
        for (i, p) in prompts.iter().enumerate() {
            kv.allocate(i as u32, p.len() + steps)?;
            batch.push(i as u32, 0, p, OutputRows::Last);
        }
        for _ in 0..steps {
            let logits = self.unembed(&self.forward(&batch, &mut kv)?)?;
            let next: Vec<u32> = logits.argmax(1)?.to_vec1()?;
            batch = Batch::default();
            for (i, &t) in next.iter().enumerate() {
                out[i].push(t);
                batch.push(i as u32, kv.len(i as u32)?, &[t], OutputRows::Last);
            }
        }
        Ok(out)
    }
}
