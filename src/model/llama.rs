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
//! # Two implementations of the step
//! On CPU the step runs through the lean path ([`super::lean`]: Tandem's
//! own kernels over reused buffers); elsewhere, or with
//! [`LoadOptions::lean_cpu`] off, through candle ops (below). Both read the
//! same weights and caches and agree within rounding; the candle path is
//! the reference the lean one is tested against. The candle path attends
//! sequence by sequence over per-slot KV; over pooled KV (the GPU default)
//! it attends for the whole batch at once: with Tandem's own kernel on CUDA
//! ([`super::pooled_attention`]), with padded candle ops elsewhere
//! ([`super::batched_attention`]).

use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, IndexOp, Tensor};

use super::batched_attention::BatchedAttention;
use super::fused;
use super::lean::Lean;
use super::linear::{Linear, WeightArena, WeightFormat};
use super::pooled_attention::PooledAttention;
use super::{Batch, ModelConfig, ModelError, OutputRows, SeqSpan, Weights};
use crate::kv::{KvCache, KvLayout};

/// Phases of the candle path's profile, in step order.
const CANDLE_PHASES: [&str; 5] = [
    "other",
    "qkv+rope",
    "attention",
    "o_proj+add+norm",
    "mlp+add+norm",
];

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Accumulates the time since the previous lap into a phase, after
/// synchronising the device; does nothing when profiling is off.
struct PhaseClock<'a> {
    device: &'a Device,
    times: Option<[Duration; CANDLE_PHASES.len()]>,
    at: Instant,
}

impl<'a> PhaseClock<'a> {
    fn start(device: &'a Device, times: Option<[Duration; CANDLE_PHASES.len()]>) -> Self {
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

    fn finish(self) -> Option<[Duration; CANDLE_PHASES.len()]> {
        self.times
    }
}

/// How to load a model.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// Compute (and KV) dtype: f32 (the default) or f16 on CPU, where
    /// activations stay f32 and f16 is the storage of weights and KV; bf16
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
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            dtype: DType::F32,
            device: Device::Cpu,
            weight_format: WeightFormat::AsCompute,
            lean_cpu: true,
            threads: None,
        }
    }
}

pub(super) struct Layer {
    pub(super) attn_norm: Tensor,
    /// `[(heads + 2·kv_heads)·head_dim, hidden]`: q, k, v stacked.
    pub(super) qkv: Linear,
    pub(super) qkv_bias: Option<Tensor>,
    pub(super) o_proj: Linear,
    pub(super) mlp_norm: Tensor,
    /// `[2·intermediate, hidden]`: gate then up.
    pub(super) gate_up: Linear,
    pub(super) down: Linear,
}

/// A loaded model. Immutable after load; the engine owns it with the caches.
pub struct Model {
    pub(super) cfg: ModelConfig,
    pub(super) dtype: DType,
    pub(super) device: Device,
    pub(super) embed: Tensor,
    pub(super) layers: Vec<Layer>,
    pub(super) norm: Tensor,
    /// `[vocab, hidden]`; shares the embedding matrix when tied (unless quantised).
    pub(super) lm_head: Linear,
    /// `[max_positions, head_dim / 2]` rotary tables in the compute dtype.
    cos: Tensor,
    sin: Tensor,
    /// The lean CPU path's state; `None` on GPUs or when turned off.
    lean: Option<Lean>,
    /// Per-phase times of the candle path while profiling (`None`: off).
    candle_profile: Mutex<Option<[Duration; CANDLE_PHASES.len()]>>,
    /// Whether the q projection already includes the 1/√head_dim scale.
    q_prescaled: bool,
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
        match dtype {
            DType::F32 | DType::F16 => {}
            DType::BF16 if !dev.is_cpu() => {}
            DType::BF16 => {
                return Err(ModelError::UnsupportedDType(
                    "bf16 compute needs a GPU; use f32 or f16 on CPU".into(),
                ))
            }
            other => {
                return Err(ModelError::UnsupportedDType(format!(
                    "{other:?} (use f32, f16 or bf16)"
                )))
            }
        }
        let (h, i, hd) = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim);
        let (q, kv) = (cfg.num_heads * hd, cfg.num_kv_heads * hd);
        let get = |name: &str, shape: &[usize]| w.get(name, shape, dtype, dev);
        // Weights to be quantised are read in f32 on the CPU first.
        let (mat_dtype, mat_dev) = match opts.weight_format {
            WeightFormat::AsCompute => (dtype, dev.clone()),
            _ => (DType::F32, Device::Cpu),
        };
        let get_mat = |name: &str, shape: &[usize]| w.get(name, shape, mat_dtype, &mat_dev);
        // Dense CPU weights share one buffer on huge pages (see WeightArena).
        let arena = if dev.is_cpu() && opts.weight_format == WeightFormat::AsCompute {
            let layer = (q + 2 * kv) * h + h * q + 3 * i * h;
            let slots = 4 * cfg.num_layers + 1;
            let elems = cfg.num_layers * layer + cfg.vocab_size * h;
            Some(WeightArena::new(elems, slots, dtype)?)
        } else {
            None
        };
        let arena = std::cell::RefCell::new(arena);
        let linear = |t: Tensor| {
            Linear::new(
                t,
                opts.weight_format,
                dtype,
                dev,
                arena.borrow_mut().as_mut(),
            )
        };

        let embed = get("model.embed_tokens.weight", &[cfg.vocab_size, h])?;
        // The candle path folds the softmax scale 1/√head_dim into the q
        // projection when that is exact (a power of two: head_dim 16, 64,
        // 256), which saves a launch per layer on GPUs. The lean path scales
        // on its own.
        let use_lean = dev.is_cpu() && opts.lean_cpu;
        let q_scale = 1.0 / (hd as f64).sqrt();
        let q_prescaled = !use_lean && q_scale.log2().fract() == 0.0;
        let scale_q = |t: Tensor| -> candle_core::Result<Tensor> {
            if q_prescaled {
                t * q_scale
            } else {
                Ok(t)
            }
        };
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for l in 0..cfg.num_layers {
            let p = format!("model.layers.{l}");
            let qkv = linear(Tensor::cat(
                &[
                    scale_q(get_mat(&format!("{p}.self_attn.q_proj.weight"), &[q, h])?)?,
                    get_mat(&format!("{p}.self_attn.k_proj.weight"), &[kv, h])?,
                    get_mat(&format!("{p}.self_attn.v_proj.weight"), &[kv, h])?,
                ],
                0,
            )?)?;
            let qkv_bias = if cfg.attention_bias {
                Some(Tensor::cat(
                    &[
                        scale_q(get(&format!("{p}.self_attn.q_proj.bias"), &[q])?)?,
                        get(&format!("{p}.self_attn.k_proj.bias"), &[kv])?,
                        get(&format!("{p}.self_attn.v_proj.bias"), &[kv])?,
                    ],
                    0,
                )?)
            } else {
                None
            };
            let gate_up = linear(Tensor::cat(
                &[
                    get_mat(&format!("{p}.mlp.gate_proj.weight"), &[i, h])?,
                    get_mat(&format!("{p}.mlp.up_proj.weight"), &[i, h])?,
                ],
                0,
            )?)?;
            layers.push(Layer {
                attn_norm: get(&format!("{p}.input_layernorm.weight"), &[h])?,
                qkv,
                qkv_bias,
                o_proj: linear(get_mat(&format!("{p}.self_attn.o_proj.weight"), &[h, q])?)?,
                mlp_norm: get(&format!("{p}.post_attention_layernorm.weight"), &[h])?,
                gate_up,
                down: linear(get_mat(&format!("{p}.mlp.down_proj.weight"), &[h, i])?)?,
            });
        }
        let norm = get("model.norm.weight", &[h])?;
        let lm_head = if cfg.tie_word_embeddings {
            linear(embed.clone())?
        } else {
            linear(get_mat("lm_head.weight", &[cfg.vocab_size, h])?)?
        };

        let inv_freq = cfg.rope_inv_freq();
        let max_pos = cfg.max_position_embeddings;
        let mut angles = Vec::with_capacity(max_pos * inv_freq.len());
        for p in 0..max_pos {
            angles.extend(inv_freq.iter().map(|f| p as f64 * f));
        }
        let cos: Vec<f32> = angles.iter().map(|a| a.cos() as f32).collect();
        let sin: Vec<f32> = angles.iter().map(|a| a.sin() as f32).collect();
        let lean = if use_lean {
            let vecs: Vec<_> = layers
                .iter()
                .map(|l| (l.attn_norm.clone(), l.mlp_norm.clone(), l.qkv_bias.clone()))
                .collect();
            // The candle path rounds the tables to the compute dtype; so
            // does the lean one, to stay within rounding of it.
            let round = |v: &[f32]| -> candle_core::Result<Vec<f32>> {
                Tensor::new(v, dev)?
                    .to_dtype(dtype)?
                    .to_dtype(DType::F32)?
                    .to_vec1()
            };
            Some(Lean::new(
                &vecs,
                &norm,
                round(&cos)?,
                round(&sin)?,
                opts.threads,
            )?)
        } else {
            None
        };
        let cos = Tensor::from_vec(cos, (max_pos, hd / 2), dev)?.to_dtype(dtype)?;
        let sin = Tensor::from_vec(sin, (max_pos, hd / 2), dev)?.to_dtype(dtype)?;

        Ok(Self {
            cfg,
            dtype,
            device: dev.clone(),
            embed,
            layers,
            norm,
            lm_head,
            cos,
            sin,
            lean,
            candle_profile: Mutex::new(None),
            q_prescaled,
        })
    }

    /// Whether steps run on the lean CPU path.
    pub fn is_lean(&self) -> bool {
        self.lean.is_some()
    }

    /// Starts (`true`) or stops accumulating per-phase step times; read
    /// them with [`take_profile`](Self::take_profile). On the candle path
    /// (GPUs) profiling synchronises the device at every phase boundary,
    /// which slows the step down.
    pub fn set_profiling(&self, on: bool) {
        match &self.lean {
            Some(l) => l.set_profiling(on),
            None => *lock(&self.candle_profile) = on.then_some(Default::default()),
        }
    }

    /// Per-phase times (step order) accumulated since the last call, when
    /// profiling is on; empty otherwise.
    pub fn take_profile(&self) -> Vec<(&'static str, Duration)> {
        match &self.lean {
            Some(l) => l.take_profile(),
            None => lock(&self.candle_profile)
                .as_mut()
                .map(|p| CANDLE_PHASES.into_iter().zip(std::mem::take(p)).collect())
                .unwrap_or_default(),
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
        Ok((self.embed.clone(), self.norm.clone(), self.lm_head.dense()?))
    }

    /// The KV entry shape this model needs.
    pub fn kv_layout(&self) -> KvLayout {
        KvLayout {
            num_layers: self.cfg.num_layers,
            num_kv_heads: self.cfg.num_kv_heads,
            head_dim: self.cfg.head_dim,
            dtype: self.dtype,
        }
    }

    /// Embeddings of `ids`: `[n, hidden]`.
    pub fn token_embeddings(&self, ids: &[u32]) -> Result<Tensor, ModelError> {
        if let Some(&bad) = ids.iter().find(|&&t| t as usize >= self.cfg.vocab_size) {
            return Err(ModelError::InvalidBatch(format!(
                "token id {bad} is outside the vocabulary of {}",
                self.cfg.vocab_size
            )));
        }
        let ids = Tensor::new(ids, &self.device)?;
        Ok(self.embed.index_select(&ids, 0)?)
    }

    /// Final norm and unembedding: `[n, hidden]` → `[n, vocab]` logits (f32).
    pub fn unembed(&self, hidden: &Tensor) -> Result<Tensor, ModelError> {
        if let Some(lean) = &self.lean {
            return self.unembed_lean(lean, hidden);
        }
        let x = candle_nn::ops::rms_norm(
            &hidden.contiguous()?,
            &self.norm,
            self.cfg.rms_norm_eps as f32,
        )?;
        Ok(self.lm_head.forward(&x)?.to_dtype(DType::F32)?)
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
        if let Some(&bad) = batch
            .tokens
            .iter()
            .find(|&&t| t as usize >= self.cfg.vocab_size)
        {
            return Err(ModelError::InvalidBatch(format!(
                "token id {bad} is outside the vocabulary of {}",
                self.cfg.vocab_size
            )));
        }
        for s in &batch.seqs {
            kv.ensure_room(s.slot, s.len)?;
        }
        if let Some(lean) = &self.lean {
            return self.forward_lean(lean, batch, kv, num_layers, None);
        }
        let x = self.token_embeddings(&batch.tokens)?;
        self.run_layers(batch, x, kv, num_layers)
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
        if let Some(lean) = &self.lean {
            return self.forward_lean(lean, batch, kv, self.cfg.num_layers, Some(&embeddings));
        }
        self.run_layers(
            batch,
            embeddings.to_dtype(self.dtype)?,
            kv,
            self.cfg.num_layers,
        )
    }

    /// The candle path of the forward pass, from input embeddings.
    fn run_layers(
        &self,
        batch: &Batch,
        mut x: Tensor,
        kv: &mut KvCache,
        num_layers: usize,
    ) -> Result<Tensor, ModelError> {
        let n = batch.tokens.len();
        let cfg = &self.cfg;
        let (nh, nkv, hd) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);

        // Each sequence's span with its first row in the batch.
        let spans: Vec<(SeqSpan, usize)> = batch
            .seqs
            .iter()
            .scan(0, |at, s| {
                *at += s.len;
                Some((*s, *at - s.len))
            })
            .collect();
        let pooled = PooledAttention::plan(batch, kv, cfg, &self.device)?;
        let batched = match pooled {
            Some(_) => None,
            None => BatchedAttention::plan(&spans, n, kv, cfg, self.dtype, &self.device)?,
        };
        // The pooled kernels rotate by position themselves; the candle path
        // takes the batch's rows of the tables.
        let rope_rows = match pooled {
            Some(_) => None,
            None => {
                let positions: Vec<u32> = batch
                    .seqs
                    .iter()
                    .flat_map(|s| (s.offset..s.offset + s.len).map(|p| p as u32))
                    .collect();
                let positions = Tensor::new(positions.as_slice(), &self.device)?;
                Some((
                    self.cos.index_select(&positions, 0)?,
                    self.sin.index_select(&positions, 0)?,
                ))
            }
        };
        let q_scale = if self.q_prescaled {
            1.0
        } else {
            1.0 / (hd as f64).sqrt()
        };
        let eps = cfg.rms_norm_eps as f32;
        let mut clock = PhaseClock::start(&self.device, lock(&self.candle_profile).take());
        let layers = &self.layers[..num_layers.min(self.layers.len())];
        // `h` is the normed input of the next block; each residual add is
        // fused with the norm that follows it.
        let mut h = match layers.first() {
            Some(first) => candle_nn::ops::rms_norm(&x, &first.attn_norm, eps)?,
            None => x.clone(),
        };
        for (l, layer) in layers.iter().enumerate() {
            clock.lap(0)?;
            let mut qkv = layer.qkv.forward(&h)?;
            if let Some(b) = &layer.qkv_bias {
                qkv = qkv.broadcast_add(b)?;
            }
            let attn = if let Some(plan) = &pooled {
                clock.lap(1)?;
                plan.forward(cfg, kv, l, &qkv, (&self.cos, &self.sin), q_scale as f32)?
            } else {
                let (cos, sin) = rope_rows.as_ref().expect("tables for the candle path");
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
                let q = candle_nn::rotary_emb::rope_thd(&q, cos, sin)?.squeeze(0)?;
                let q = if self.q_prescaled { q } else { (q * q_scale)? };
                let k = candle_nn::rotary_emb::rope_thd(&k, cos, sin)?.squeeze(0)?;
                clock.lap(1)?;
                match &batched {
                    Some(plan) if plan.singles().is_empty() => {
                        plan.forward(cfg, kv, l, &q, &k, &v)?
                    }
                    Some(plan) => {
                        let mut parts = vec![plan.forward(cfg, kv, l, &q, &k, &v)?];
                        parts.extend(self.attend_each(plan.singles(), kv, l, &q, &k, &v)?);
                        plan.reorder(&parts)?
                    }
                    None => {
                        let mut parts = self.attend_each(&spans, kv, l, &q, &k, &v)?;
                        if parts.len() == 1 {
                            parts.pop().expect("one part")
                        } else {
                            Tensor::cat(&parts, 0)?
                        }
                    }
                }
            };
            clock.lap(2)?;
            let o = layer.o_proj.forward(&attn)?;
            (x, h) = fused::add_rms_norm(&x, &o, &layer.mlp_norm, eps)?;
            clock.lap(3)?;

            let gu = layer.gate_up.forward(&h)?;
            let down = layer
                .down
                .forward(&fused::silu_mul(&gu, cfg.intermediate_size)?)?;
            match layers.get(l + 1) {
                Some(next) => (x, h) = fused::add_rms_norm(&x, &down, &next.attn_norm, eps)?,
                None => x = (x + down)?,
            }
            clock.lap(4)?;
        }
        *lock(&self.candle_profile) = clock.finish();
        for s in &batch.seqs {
            kv.set_len(s.slot, s.offset + s.len)?;
        }

        let wanted = batch.output_indices();
        if wanted.len() == n {
            return Ok(x);
        }
        if wanted.is_empty() {
            // A view: CUDA refuses zero-byte allocations.
            return Ok(x.narrow(0, 0, 0)?);
        }
        let idx = Tensor::new(wanted.as_slice(), &self.device)?;
        Ok(x.index_select(&idx, 0)?)
    }

    /// Attention sequence by sequence: writes each one's new K/V (rows
    /// `start..start + len` of the batch) into its slot and attends over its
    /// cache in place; one output per sequence.
    fn attend_each(
        &self,
        spans: &[(SeqSpan, usize)],
        kv: &mut KvCache,
        layer: usize,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
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
            outs.push(self.attention(&q.narrow(0, start, s.len)?, &kc, &vc, s.offset)?);
        }
        Ok(outs)
    }

    /// Causal attention of one sequence's queries `[len, heads, head_dim]`
    /// (already scaled) over its cache `[offset + len, kv_heads, head_dim]`.
    fn attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        offset: usize,
    ) -> Result<Tensor, ModelError> {
        let cfg = &self.cfg;
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
            let mask = self.mask(len, g, offset, first_key, keys)?;
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

    /// Additive mask `[len·g, keys]`: query row r sits at position
    /// `offset + r / g` and sees keys at positions ≤ its own (and inside the
    /// sliding window). `None` when nothing is masked.
    fn mask(
        &self,
        len: usize,
        g: usize,
        offset: usize,
        first_key: usize,
        keys: usize,
    ) -> Result<Option<Tensor>, ModelError> {
        let window = self.cfg.sliding_window;
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
