//! The Llama decoder's weights as every step implementation reads them:
//! loaded once, fused, in their final format and device, and immutable
//! afterwards.
//!
//! Each component loads itself from the checkpoint's names the candle way
//! ([`LayerWeights::load`] for one decoder layer, [`ModelWeights::load`]
//! for the whole model); the step implementations (`lean`, `candle_step`)
//! take these structs as arguments and own none of them.
//!
//! # Invariants
//! - q/k/v are stacked into one projection `[(heads + 2·kv_heads)·head_dim,
//!   hidden]`, gate/up into one `[2·intermediate, hidden]`, so a step runs
//!   few, large matmuls.
//! - When [`QScale::Folded`], the q rows (and q bias) already carry the
//!   softmax scale 1/√head_dim; the step must not scale again.
//! - Dense CPU weights share one huge-page [`WeightArena`], filled in the
//!   order the layers are loaded (qkv, gate_up, o_proj, down per layer,
//!   then the unembedding).

use std::cell::RefCell;

use candle_core::{DType, Device, Tensor};

use super::linear::{Linear, WeightArena, WeightFormat};
use super::{ModelConfig, ModelError, Weights};

/// Whether the softmax scale is folded into the q projection at load.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum QScale {
    /// The weights are as stored; the step scales the queries.
    Unfolded,
    /// q rows and q bias were multiplied by this factor (1/√head_dim).
    Folded(f64),
}

/// One decoder layer.
pub(super) struct LayerWeights {
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

/// Every weight of the model.
pub(super) struct ModelWeights {
    /// `[vocab, hidden]` in the compute dtype.
    pub(super) embed: Tensor,
    pub(super) layers: Vec<LayerWeights>,
    /// Final norm `[hidden]`.
    pub(super) norm: Tensor,
    /// `[vocab, hidden]`; shares the embedding matrix when tied (unless quantised).
    pub(super) lm_head: Linear,
}

/// Reads tensors from a checkpoint into the model's dtype, device and
/// weight format (one per load).
pub(super) struct WeightLoader<'a> {
    source: &'a Weights,
    dtype: DType,
    device: &'a Device,
    format: WeightFormat,
    /// Where matrices to be quantised are read first (f32 on the CPU), or
    /// the compute dtype and device when they stay dense.
    mat_dtype: DType,
    mat_device: Device,
    arena: RefCell<Option<WeightArena>>,
}

impl<'a> WeightLoader<'a> {
    /// A loader for `cfg`'s weights from `source`, in `dtype` on `device`
    /// with projections in `format`.
    pub(super) fn new(
        cfg: &ModelConfig,
        source: &'a Weights,
        dtype: DType,
        device: &'a Device,
        format: WeightFormat,
    ) -> Result<Self, ModelError> {
        let (mat_dtype, mat_device) = match format {
            WeightFormat::AsCompute | WeightFormat::AsStored => (dtype, device.clone()),
            _ => (DType::F32, Device::Cpu),
        };
        // Dense CPU weights share one buffer on huge pages (see WeightArena).
        // Sized as if every projection were dense: the pages of slots that
        // blocks make unnecessary are never touched, so never backed.
        let dense = matches!(format, WeightFormat::AsCompute | WeightFormat::AsStored);
        let arena = if device.is_cpu() && dense {
            let (h, i, hd) = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim);
            let (q, kv) = (cfg.num_heads * hd, cfg.num_kv_heads * hd);
            let layer = (q + 2 * kv) * h + h * q + 3 * i * h;
            let slots = 4 * cfg.num_layers + 1;
            let elems = cfg.num_layers * layer + cfg.vocab_size * h;
            Some(WeightArena::new(elems, slots, dtype)?)
        } else {
            None
        };
        Ok(Self {
            source,
            dtype,
            device,
            format,
            mat_dtype,
            mat_device,
            arena: RefCell::new(arena),
        })
    }

    /// A small tensor (norm, bias, embedding) in the compute dtype.
    fn vector(&self, name: &str, shape: &[usize]) -> Result<Tensor, ModelError> {
        self.source.get(name, shape, self.dtype, self.device)
    }

    /// A projection matrix, read where its format is made.
    fn matrix(&self, name: &str, shape: &[usize]) -> Result<Tensor, ModelError> {
        self.source
            .get(name, shape, self.mat_dtype, &self.mat_device)
    }

    /// The matrices `parts` stacked by rows into one projection: in the
    /// checkpoint's GGML blocks when the format and device allow and every
    /// part has blocks of one type, otherwise dense (the first part scaled
    /// by `q_scale`, which blocks cannot carry) in the model's weight format.
    fn stacked(
        &self,
        parts: &[(String, [usize; 2])],
        q_scale: QScale,
    ) -> Result<Linear, ModelError> {
        if q_scale == QScale::Unfolded {
            if let Some(linear) = self.stored(parts)? {
                return Ok(linear);
            }
        }
        let mut mats = Vec::with_capacity(parts.len());
        for (i, (name, shape)) in parts.iter().enumerate() {
            let m = self.matrix(name, shape)?;
            mats.push(if i == 0 { scale_q(m, q_scale)? } else { m });
        }
        let w = match mats.len() {
            1 => mats.pop().expect("one part"),
            _ => Tensor::cat(&mats, 0)?,
        };
        self.linear(w)
    }

    /// `parts` in their stored blocks, when [`WeightFormat::AsStored`]
    /// applies to all of them on this device.
    fn stored(&self, parts: &[(String, [usize; 2])]) -> Result<Option<Linear>, ModelError> {
        if self.format != WeightFormat::AsStored || !self.device.is_cpu() {
            return Ok(None);
        }
        let mut blocks = Vec::with_capacity(parts.len());
        for (name, shape) in parts {
            let Some(b) = self.source.blocks(name) else {
                return Ok(None);
            };
            if b.shape().dims() != shape {
                return Err(ModelError::ShapeMismatch {
                    path: "<memory>".into(),
                    name: name.clone(),
                    expected: shape.to_vec(),
                    found: b.shape().dims().to_vec(),
                });
            }
            blocks.push(b);
        }
        Ok(Linear::from_blocks(&blocks)?)
    }

    /// `w` in the model's weight format (placed in the arena when dense on CPU).
    fn linear(&self, w: Tensor) -> Result<Linear, ModelError> {
        Ok(Linear::new(
            w,
            self.format,
            self.dtype,
            self.device,
            self.arena.borrow_mut().as_mut(),
        )?)
    }
}

/// `t` scaled by the folded q scale, if any.
fn scale_q(t: Tensor, q_scale: QScale) -> Result<Tensor, ModelError> {
    Ok(match q_scale {
        QScale::Folded(s) => (t * s)?,
        QScale::Unfolded => t,
    })
}

impl LayerWeights {
    /// Layer `l` of checkpoint `model.layers.{l}.*`, fused.
    pub(super) fn load(
        w: &WeightLoader<'_>,
        cfg: &ModelConfig,
        l: usize,
        q_scale: QScale,
    ) -> Result<Self, ModelError> {
        let (h, i, hd) = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim);
        let (q, kv) = (cfg.num_heads * hd, cfg.num_kv_heads * hd);
        let p = format!("model.layers.{l}");
        let part = |name: &str, shape: [usize; 2]| (format!("{p}.{name}.weight"), shape);
        let qkv = w.stacked(
            &[
                part("self_attn.q_proj", [q, h]),
                part("self_attn.k_proj", [kv, h]),
                part("self_attn.v_proj", [kv, h]),
            ],
            q_scale,
        )?;
        let qkv_bias = if cfg.attention_bias {
            Some(Tensor::cat(
                &[
                    scale_q(
                        w.vector(&format!("{p}.self_attn.q_proj.bias"), &[q])?,
                        q_scale,
                    )?,
                    w.vector(&format!("{p}.self_attn.k_proj.bias"), &[kv])?,
                    w.vector(&format!("{p}.self_attn.v_proj.bias"), &[kv])?,
                ],
                0,
            )?)
        } else {
            None
        };
        let gate_up = w.stacked(
            &[part("mlp.gate_proj", [i, h]), part("mlp.up_proj", [i, h])],
            QScale::Unfolded,
        )?;
        let o_proj = w.stacked(&[part("self_attn.o_proj", [h, q])], QScale::Unfolded)?;
        let down = w.stacked(&[part("mlp.down_proj", [h, i])], QScale::Unfolded)?;
        Ok(Self {
            attn_norm: w.vector(&format!("{p}.input_layernorm.weight"), &[h])?,
            qkv,
            qkv_bias,
            o_proj,
            mlp_norm: w.vector(&format!("{p}.post_attention_layernorm.weight"), &[h])?,
            gate_up,
            down,
        })
    }
}

impl ModelWeights {
    /// Every weight of `cfg`'s model, layer by layer.
    pub(super) fn load(
        w: &WeightLoader<'_>,
        cfg: &ModelConfig,
        q_scale: QScale,
    ) -> Result<Self, ModelError> {
        let h = cfg.hidden_size;
        let embed = w.vector("model.embed_tokens.weight", &[cfg.vocab_size, h])?;
        let layers = (0..cfg.num_layers)
            .map(|l| LayerWeights::load(w, cfg, l, q_scale))
            .collect::<Result<Vec<_>, _>>()?;
        let norm = w.vector("model.norm.weight", &[h])?;
        let head = |name: &str| (name.to_string(), [cfg.vocab_size, h]);
        let lm_head = if !cfg.tie_word_embeddings {
            w.stacked(&[head("lm_head.weight")], QScale::Unfolded)?
        } else if let Some(stored) = w.stored(&[head("model.embed_tokens.weight")])? {
            stored
        } else {
            w.linear(embed.clone())?
        };
        Ok(Self {
            embed,
            layers,
            norm,
            lm_head,
        })
    }
}

/// The rotary tables `[max_positions · head_dim / 2]` (cos, sin) in f32,
/// row p holding position p's angles.
impl ModelWeights {
    /// Every projection as [`Linear::repacked`] makes it.
    pub(super) fn repacked(self) -> Result<Self, ModelError> {
        let layers = self
            .layers
            .into_iter()
            .map(|l| {
                Ok(LayerWeights {
                    qkv: l.qkv.repacked()?,
                    o_proj: l.o_proj.repacked()?,
                    gate_up: l.gate_up.repacked()?,
                    down: l.down.repacked()?,
                    ..l
                })
            })
            .collect::<Result<_, ModelError>>()?;
        Ok(Self {
            layers,
            lm_head: self.lm_head.repacked()?,
            ..self
        })
    }
}

pub(super) fn rope_tables(cfg: &ModelConfig) -> (Vec<f32>, Vec<f32>) {
    let inv_freq = cfg.rope_inv_freq();
    let max_pos = cfg.max_position_embeddings;
    let mut angles = Vec::with_capacity(max_pos * inv_freq.len());
    for p in 0..max_pos {
        angles.extend(inv_freq.iter().map(|f| p as f64 * f));
    }
    let cos = angles.iter().map(|a| a.cos() as f32).collect();
    let sin = angles.iter().map(|a| a.sin() as f32).collect();
    (cos, sin)
}
