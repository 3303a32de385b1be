//! The MTP head in differentiable form: the same math as
//! [`crate::model::MtpHead`] at inference, written with plain candle ops
//! (the fused inference kernels have no backward pass), over whole
//! sequences with a causal mask.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor, Var, D};

use super::data::Features;
use super::TrainError;
use crate::model::mtp::random_tensors;
use crate::model::{Model, ModelConfig};

/// Trainable head parameters (checkpoint names) and the target's frozen parts.
pub struct TrainableHead {
    cfg: ModelConfig,
    vars: HashMap<String, Var>,
    embed: Tensor,
    norm: Tensor,
    lm_head: Tensor,
}

fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    candle_nn::ops::rms_norm_slow(x, w, eps as f32)
}

fn rotate_half(x: &Tensor) -> candle_core::Result<Tensor> {
    let d = x.dim(D::Minus1)?;
    let (a, b) = (
        x.narrow(D::Minus1, 0, d / 2)?,
        x.narrow(D::Minus1, d / 2, d / 2)?,
    );
    Tensor::cat(&[&b.neg()?, &a], D::Minus1)
}

impl TrainableHead {
    /// A fresh head for `target` with seeded random weights.
    pub fn new(target: &Model, seed: u64) -> Result<Self, TrainError> {
        let vars = random_tensors(target.config(), seed)?
            .into_iter()
            .map(|(name, t)| Ok((name, Var::from_tensor(&t.to_dtype(DType::F32)?)?)))
            .collect::<Result<HashMap<_, _>, TrainError>>()?;
        let (embed, norm, lm_head) = target.shared_tensors();
        Ok(Self {
            cfg: target.config().clone(),
            vars,
            embed,
            norm,
            lm_head,
        })
    }

    pub fn vars(&self) -> impl Iterator<Item = (&String, &Var)> {
        self.vars.iter()
    }

    pub fn var_map(&self) -> &HashMap<String, Var> {
        &self.vars
    }

    /// Detached copies of the parameters, in the checkpoint format.
    pub fn tensors(&self) -> Result<HashMap<String, Tensor>, TrainError> {
        self.vars
            .iter()
            .map(|(n, v)| Ok((n.clone(), v.as_tensor().detach().copy()?)))
            .collect()
    }

    fn w(&self, name: &str) -> Result<&Tensor, TrainError> {
        self.vars
            .get(&format!("mtp.{name}"))
            .map(|v| v.as_tensor())
            .ok_or_else(|| TrainError::Unsupported(format!("no parameter `mtp.{name}`")))
    }

    fn linear(&self, x: &Tensor, name: &str, bias: bool) -> Result<Tensor, TrainError> {
        let y = x.broadcast_matmul(&self.w(&format!("{name}.weight"))?.t()?)?;
        Ok(if bias {
            y.broadcast_add(self.w(&format!("{name}.bias"))?)?
        } else {
            y
        })
    }

    /// Logits `[N·(T-1), vocab]` for every pair of the batch.
    pub fn logits(&self, f: &Features) -> Result<Tensor, TrainError> {
        let cfg = &self.cfg;
        let (n, t, h) = f.hidden.dims3()?;
        let (nh, nkv, hd) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
        let eps = cfg.rms_norm_eps;
        let emb = self
            .embed
            .index_select(&f.next_tokens.flatten_all()?, 0)?
            .reshape((n, t, h))?;
        let x = Tensor::cat(
            &[
                rms_norm(&emb, self.w("enorm.weight")?, eps)?,
                rms_norm(&f.hidden, self.w("hnorm.weight")?, eps)?,
            ],
            D::Minus1,
        )?;
        let u = self.linear(&x, "eh_proj", false)?; // [n, t, h]

        // One Llama decoder layer, causal over the t pairs (positions 0..t).
        let p = "layers.0";
        let a = rms_norm(&u, self.w(&format!("{p}.input_layernorm.weight"))?, eps)?;
        let bias = cfg.attention_bias;
        let q = self
            .linear(&a, &format!("{p}.self_attn.q_proj"), bias)?
            .reshape((n, t, nh, hd))?
            .transpose(1, 2)?;
        let k = self
            .linear(&a, &format!("{p}.self_attn.k_proj"), bias)?
            .reshape((n, t, nkv, hd))?
            .transpose(1, 2)?;
        let v = self
            .linear(&a, &format!("{p}.self_attn.v_proj"), bias)?
            .reshape((n, t, nkv, hd))?
            .transpose(1, 2)?;
        let (cos, sin) = rope_tables(cfg, t)?;
        let rope = |x: &Tensor| -> candle_core::Result<Tensor> {
            x.broadcast_mul(&cos)? + rotate_half(x)?.broadcast_mul(&sin)?
        };
        let (q, k) = (rope(&q.contiguous()?)?, rope(&k.contiguous()?)?);
        let g = nh / nkv;
        let repeat = |x: Tensor| -> candle_core::Result<Tensor> {
            if g == 1 {
                return Ok(x);
            }
            x.unsqueeze(2)?
                .expand((n, nkv, g, t, hd))?
                .reshape((n, nh, t, hd))
        };
        let (k, v) = (repeat(k)?, repeat(v.contiguous()?)?);
        let scores = (q.matmul(&k.t()?)? / (hd as f64).sqrt())?;
        let mask: Vec<f32> = (0..t * t)
            .map(|i| {
                if i % t > i / t {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .collect();
        let scores = scores.broadcast_add(&Tensor::from_vec(mask, (t, t), &Device::Cpu)?)?;
        let probs = candle_nn::ops::softmax(&scores, D::Minus1)?;
        let attn = probs
            .matmul(&v)?
            .transpose(1, 2)?
            .reshape((n, t, nh * hd))?;
        let x = (u + self.linear(&attn, &format!("{p}.self_attn.o_proj"), false)?)?;
        let m = rms_norm(
            &x,
            self.w(&format!("{p}.post_attention_layernorm.weight"))?,
            eps,
        )?;
        let act = (self
            .linear(&m, &format!("{p}.mlp.gate_proj"), false)?
            .silu()?
            * self.linear(&m, &format!("{p}.mlp.up_proj"), false)?)?;
        let out = (x + self.linear(&act, &format!("{p}.mlp.down_proj"), false)?)?;

        let logits = rms_norm(&out, &self.norm, eps)?.broadcast_matmul(&self.lm_head.t()?)?;
        Ok(logits.reshape((n * t, cfg.vocab_size))?)
    }

    /// Cross-entropy against the target's greedy labels.
    pub fn loss(&self, _target: &Model, f: &Features) -> Result<Tensor, TrainError> {
        Ok(candle_nn::loss::cross_entropy(
            &self.logits(f)?,
            &f.labels.flatten_all()?,
        )?)
    }

    /// Held-out loss and top-1 agreement, in chunks.
    pub fn eval(&self, _target: &Model, f: &Features) -> Result<(f64, f64), TrainError> {
        let n = f.hidden.dim(0)?;
        let (mut loss, mut hits, mut count) = (0.0, 0usize, 0usize);
        for start in (0..n).step_by(16) {
            let idx: Vec<u32> = (start..(start + 16).min(n)).map(|i| i as u32).collect();
            let chunk = f.select(&idx)?;
            let logits = self.logits(&chunk)?;
            let labels = chunk.labels.flatten_all()?;
            let rows = labels.dim(0)?;
            loss += candle_nn::loss::cross_entropy(&logits, &labels)?.to_scalar::<f32>()? as f64
                * rows as f64;
            let pred: Vec<u32> = logits.argmax(1)?.to_vec1()?;
            let want: Vec<u32> = labels.to_vec1()?;
            hits += pred.iter().zip(&want).filter(|(a, b)| a == b).count();
            count += rows;
        }
        Ok((
            loss / count.max(1) as f64,
            hits as f64 / count.max(1) as f64,
        ))
    }
}

/// `[t, head_dim]` cos / sin (rotate-half layout) for positions `0..t`.
fn rope_tables(cfg: &ModelConfig, t: usize) -> Result<(Tensor, Tensor), TrainError> {
    let inv = cfg.rope_inv_freq();
    let (mut cos, mut sin) = (
        Vec::with_capacity(t * cfg.head_dim),
        Vec::with_capacity(t * cfg.head_dim),
    );
    for p in 0..t {
        for _ in 0..2 {
            for f in &inv {
                let a = p as f64 * f;
                cos.push(a.cos() as f32);
                sin.push(a.sin() as f32);
            }
        }
    }
    Ok((
        Tensor::from_vec(cos, (t, cfg.head_dim), &Device::Cpu)?,
        Tensor::from_vec(sin, (t, cfg.head_dim), &Device::Cpu)?,
    ))
}
