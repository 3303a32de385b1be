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
        let (embed, norm, lm_head) = target.shared_tensors()?;
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

    /// Logits `[N·(T-1), vocab]` for every pair of the batch (one draft
    /// step from the target's hidden states).
    pub fn logits(&self, f: &Features) -> Result<Tensor, TrainError> {
        Ok(self.forward(f, false)?.0)
    }

    /// Step one over every pair and, with `second`, step two: the head's own
    /// output fed back with the next token, as the second draft round runs at
    /// inference (its query sees the real pairs up to its base position and
    /// itself). Returns logits of step one `[N·(T-1), V]` and of step two
    /// `[N·(T-2), V]`.
    fn forward(&self, f: &Features, second: bool) -> Result<(Tensor, Option<Tensor>), TrainError> {
        let cfg = &self.cfg;
        let (n, t, h) = f.hidden.dims3()?;
        let v = cfg.vocab_size;
        let emb = self
            .embed
            .index_select(&f.next_tokens.flatten_all()?, 0)?
            .reshape((n, t, h))?;
        let (cos, sin) = rope_tables(cfg, t)?;

        let s1 = self.project(&emb, &f.hidden)?;
        let (q1, k1, v1) = self.qkv(&s1, &cos, &sin)?;
        let mask1: Vec<f32> = (0..t * t)
            .map(|i| {
                if i % t > i / t {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .collect();
        let attn1 = attend(
            &q1,
            &k1,
            &v1,
            Tensor::from_vec(mask1, (t, t), &Device::Cpu)?,
        )?;
        let out1 = self.finish_block(&s1, &attn1)?;
        let logits1 = self.unembed(&out1)?.reshape((n * t, v))?;
        if !second || t < 2 {
            return Ok((logits1, None));
        }

        // Step two for base pairs 0..t-1: (out1_i, x_{i+2}) at position i + 1.
        let m = t - 1;
        let emb2 = emb.narrow(1, 1, m)?;
        let s2 = self.project(&emb2, &out1.narrow(1, 0, m)?)?;
        let (q2, k2, v2) = self.qkv(&s2, &cos.narrow(0, 1, m)?, &sin.narrow(0, 1, m)?)?;
        let keys = Tensor::cat(&[&k1, &k2], 2)?;
        let values = Tensor::cat(&[&v1, &v2], 2)?;
        let mut mask2 = vec![f32::NEG_INFINITY; m * (t + m)];
        for i in 0..m {
            for j in 0..=i {
                mask2[i * (t + m) + j] = 0.0;
            }
            mask2[i * (t + m) + t + i] = 0.0;
        }
        let attn2 = attend(
            &q2,
            &keys,
            &values,
            Tensor::from_vec(mask2, (m, t + m), &Device::Cpu)?,
        )?;
        let out2 = self.finish_block(&s2, &attn2)?;
        Ok((logits1, Some(self.unembed(&out2)?.reshape((n * m, v))?)))
    }

    /// `eh_proj([enorm(emb); hnorm(hidden)])`.
    fn project(&self, emb: &Tensor, hidden: &Tensor) -> Result<Tensor, TrainError> {
        let eps = self.cfg.rms_norm_eps;
        let x = Tensor::cat(
            &[
                rms_norm(emb, self.w("enorm.weight")?, eps)?,
                rms_norm(hidden, self.w("hnorm.weight")?, eps)?,
            ],
            D::Minus1,
        )?;
        self.linear(&x, "eh_proj", false)
    }

    /// Roped queries `[n, heads, t, d]` and keys / values repeated to every
    /// query head, for block input `x` `[n, t, hidden]`.
    fn qkv(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor), TrainError> {
        let cfg = &self.cfg;
        let (n, t, _) = x.dims3()?;
        let (nh, nkv, hd) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
        let p = "layers.0";
        let a = rms_norm(
            x,
            self.w(&format!("{p}.input_layernorm.weight"))?,
            cfg.rms_norm_eps,
        )?;
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
        let rope = |x: &Tensor| -> candle_core::Result<Tensor> {
            x.broadcast_mul(cos)? + rotate_half(x)?.broadcast_mul(sin)?
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
        Ok((q, repeat(k)?, repeat(v.contiguous()?)?))
    }

    /// Output projection, residual and MLP of the block.
    fn finish_block(&self, x: &Tensor, attn: &Tensor) -> Result<Tensor, TrainError> {
        let p = "layers.0";
        let x = (x + self.linear(attn, &format!("{p}.self_attn.o_proj"), false)?)?;
        let m = rms_norm(
            &x,
            self.w(&format!("{p}.post_attention_layernorm.weight"))?,
            self.cfg.rms_norm_eps,
        )?;
        let act = (self
            .linear(&m, &format!("{p}.mlp.gate_proj"), false)?
            .silu()?
            * self.linear(&m, &format!("{p}.mlp.up_proj"), false)?)?;
        Ok((x + self.linear(&act, &format!("{p}.mlp.down_proj"), false)?)?)
    }

    /// The target's frozen final norm and unembedding.
    fn unembed(&self, x: &Tensor) -> Result<Tensor, TrainError> {
        Ok(rms_norm(x, &self.norm, self.cfg.rms_norm_eps)?.broadcast_matmul(&self.lm_head.t()?)?)
    }

    /// Training loss: cross-entropy of step one, plus step two's when
    /// `second` (so recursive drafts stay accurate).
    pub fn train_loss(&self, f: &Features, second: bool) -> Result<Tensor, TrainError> {
        let (l1, l2) = self.forward(f, second)?;
        let labels = &f.labels;
        let mut loss = candle_nn::loss::cross_entropy(&l1, &labels.flatten_all()?)?;
        if let Some(l2) = l2 {
            let t = labels.dim(1)?;
            loss = (loss
                + candle_nn::loss::cross_entropy(
                    &l2,
                    &labels.narrow(1, 1, t - 1)?.flatten_all()?,
                )?)?;
        }
        Ok(loss)
    }

    /// Held-out loss and top-1 agreement, in chunks.
    pub fn eval(&self, f: &Features) -> Result<(f64, f64), TrainError> {
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

/// Softmax attention of `q` `[n, h, tq, d]` over `k`, `v` `[n, h, tk, d]`
/// with an additive `mask` `[tq, tk]`; returns `[n, tq, h·d]`.
fn attend(q: &Tensor, k: &Tensor, v: &Tensor, mask: Tensor) -> Result<Tensor, TrainError> {
    let (n, h, tq, d) = q.dims4()?;
    let scores = (q.matmul(&k.t()?)? / (d as f64).sqrt())?.broadcast_add(&mask)?;
    let probs = candle_nn::ops::softmax(&scores, D::Minus1)?;
    Ok(probs.matmul(v)?.transpose(1, 2)?.reshape((n, tq, h * d))?)
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
