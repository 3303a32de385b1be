//! The MTP head in differentiable form: the same math as
//! [`crate::model::MtpHead`] at inference, written with plain candle ops
//! (the fused inference kernels have no backward pass), over whole
//! sequences with a causal mask.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor, Var, D};

use super::data::Features;
use super::TrainError;
use crate::model::mtp::{check_draft_vocab, random_tensors, DRAFT_VOCAB_TENSOR};
use crate::model::{Model, ModelConfig};

/// Trainable head parameters (checkpoint names) and the target's frozen parts.
pub struct TrainableHead {
    cfg: ModelConfig,
    vars: HashMap<String, Var>,
    embed: Tensor,
    norm: Tensor,
    /// The target's unembedding, or its draft-vocabulary rows `[N, H]`.
    lm_head: Tensor,
    /// The draft vocabulary (sorted ids), `None` for the full vocabulary.
    draft_vocab: Option<Vec<u32>>,
    /// The target's device: parameters, optimiser state and every batch
    /// live there (features are kept on the host and moved per batch).
    device: Device,
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
    /// A fresh head for `target` with seeded random weights, unembedding
    /// over `draft_vocab` (sorted ids; `None`: the full vocabulary).
    pub fn new(
        target: &Model,
        seed: u64,
        draft_vocab: Option<Vec<u32>>,
    ) -> Result<Self, TrainError> {
        let device = target.device().clone();
        let vars = random_tensors(target.config(), seed)?
            .into_iter()
            .map(|(name, t)| {
                let t = t.to_dtype(DType::F32)?.to_device(&device)?;
                Ok((name, Var::from_tensor(&t)?))
            })
            .collect::<Result<HashMap<_, _>, TrainError>>()?;
        let (embed, norm, lm_head) = target.shared_tensors()?;
        let lm_head = match &draft_vocab {
            Some(ids) => {
                check_draft_vocab(ids, target.config().vocab_size).map_err(|reason| {
                    TrainError::InvalidOption {
                        field: "draft_vocab",
                        reason,
                    }
                })?;
                let idx = Tensor::new(ids.as_slice(), lm_head.device())?;
                lm_head.index_select(&idx, 0)?.to_dtype(DType::F32)?
            }
            None => lm_head.to_dtype(DType::F32)?,
        };
        Ok(Self {
            cfg: target.config().clone(),
            vars,
            embed,
            norm,
            lm_head,
            draft_vocab,
            device,
        })
    }

    /// Where the parameters live.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The draft vocabulary, `None` for the full vocabulary.
    pub fn draft_vocab(&self) -> Option<&[u32]> {
        self.draft_vocab.as_deref()
    }

    /// The unembedding row of token `id`, `None` outside the draft vocabulary.
    fn row_of(&self, id: u32) -> Option<u32> {
        match &self.draft_vocab {
            Some(ids) => ids.binary_search(&id).ok().map(|r| r as u32),
            None => Some(id),
        }
    }

    /// The token id of unembedding row `row`.
    fn id_of(&self, row: u32) -> u32 {
        match &self.draft_vocab {
            Some(ids) => ids[row as usize],
            None => row,
        }
    }

    /// Rows of `labels` in the unembedding and their loss weights: `mask`,
    /// and 0 for a label outside the draft vocabulary.
    fn targets(&self, labels: &Tensor, mask: &Tensor) -> Result<(Tensor, Tensor), TrainError> {
        let labels: Vec<u32> = labels.flatten_all()?.to_vec1()?;
        let mask: Vec<f32> = mask.flatten_all()?.to_vec1()?;
        let (mut rows, mut weights) = (Vec::with_capacity(labels.len()), Vec::new());
        for (&l, &m) in labels.iter().zip(&mask) {
            match self.row_of(l) {
                Some(r) if m > 0.0 => {
                    rows.push(r);
                    weights.push(1f32);
                }
                _ => {
                    rows.push(0);
                    weights.push(0.0);
                }
            }
        }
        let n = rows.len();
        Ok((
            Tensor::from_vec(rows, n, &self.device)?,
            Tensor::from_vec(weights, n, &self.device)?,
        ))
    }

    pub fn vars(&self) -> impl Iterator<Item = (&String, &Var)> {
        self.vars.iter()
    }

    pub fn var_map(&self) -> &HashMap<String, Var> {
        &self.vars
    }

    /// Detached host copies of the parameters, with the draft vocabulary, in
    /// the checkpoint format.
    pub fn tensors(&self) -> Result<HashMap<String, Tensor>, TrainError> {
        let mut out = self
            .vars
            .iter()
            .map(|(n, v)| {
                let t = v.as_tensor().detach().copy()?.to_device(&Device::Cpu)?;
                Ok((n.clone(), t))
            })
            .collect::<Result<HashMap<_, _>, TrainError>>()?;
        if let Some(ids) = &self.draft_vocab {
            out.insert(
                DRAFT_VOCAB_TENSOR.to_string(),
                Tensor::new(ids.as_slice(), &Device::Cpu)?,
            );
        }
        Ok(out)
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

    /// Logits `[N·(T-1), rows]` over the unembedding's rows (the draft
    /// vocabulary) for every pair of the batch (one draft step from the
    /// target's hidden states).
    pub fn logits(&self, f: &Features) -> Result<Tensor, TrainError> {
        Ok(self.round_logits(f, 1)?.swap_remove(0))
    }

    /// Logits of draft rounds `1..=rounds` over every pair, as
    /// [`Self::forward`] computes them for training.
    pub fn round_logits(&self, f: &Features, rounds: usize) -> Result<Vec<Tensor>, TrainError> {
        let hidden = f.hidden.to_device(&self.device)?;
        self.forward(f, &hidden, rounds)
    }

    /// The head's draft rounds `1..=rounds` over every pair, with the real
    /// next tokens (teacher forcing). Round 1 reads the target's hidden
    /// states; round `r > 1` reads round `r - 1`'s output with the next
    /// token, one position on, as the `r`-th draft round runs at inference
    /// (EAGLE-3's "training-time test"): base pair `i`'s query sees the
    /// real pairs `0..=i` and pair `i`'s entries of the earlier rounds.
    /// `hidden` is `f.hidden` on the head's device. Round `r`'s logits are
    /// over the unembedding's rows `R`, `[N·(T-r+1), R]` (base pairs
    /// `0..T-r+1`).
    fn forward(
        &self,
        f: &Features,
        hidden: &Tensor,
        rounds: usize,
    ) -> Result<Vec<Tensor>, TrainError> {
        let (n, t, h) = f.hidden.dims3()?;
        let rows = self.lm_head.dim(0)?;
        let next = f.next_tokens.flatten_all()?.to_device(&self.device)?;
        let emb = self.embed.index_select(&next, 0)?.reshape((n, t, h))?;
        let (cos, sin) = rope_tables(&self.cfg, t, &self.device)?;
        // Every round's keys and values so far, laid end to end.
        let mut kv: Option<(Tensor, Tensor)> = None;
        let mut logits = Vec::with_capacity(rounds);
        let mut previous: Option<Tensor> = None;
        for r in 0..rounds.min(t) {
            // Round r + 1: base pairs 0..m, the input (out_i, x_{i+r+1}) at position i + r.
            let m = t - r;
            let input = match &previous {
                None => self.project(&emb, hidden)?,
                Some(out) => self.project(&emb.narrow(1, r, m)?, &out.narrow(1, 0, m)?)?,
            };
            let (q, k, value) = self.qkv(&input, &cos.narrow(0, r, m)?, &sin.narrow(0, r, m)?)?;
            let (keys, values) = match kv.take() {
                None => (k, value),
                Some((keys, values)) => (
                    Tensor::cat(&[&keys, &k], 2)?,
                    Tensor::cat(&[&values, &value], 2)?,
                ),
            };
            let attn = attend(&q, &keys, &values, round_mask(t, r, &self.device)?)?;
            kv = Some((keys, values));
            let out = self.finish_block(&input, &attn)?;
            logits.push(self.unembed(&out)?.reshape((n * m, rows))?);
            previous = Some(out);
        }
        Ok(logits)
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

    /// Training loss: the sum over draft rounds `1..=rounds` (later rounds
    /// keep recursive drafts accurate) of each round's cross-entropy over
    /// the masked labels inside the draft vocabulary: against the greedy
    /// labels (`soft` false) or against the target's whole distribution
    /// over the draft vocabulary (`soft`: see [`Self::soft_loss`]).
    pub fn train_loss(
        &self,
        f: &Features,
        rounds: usize,
        soft: bool,
    ) -> Result<Tensor, TrainError> {
        // Moved to the device once: the soft loss reads it too.
        let hidden = f.hidden.to_device(&self.device)?;
        let logits = self.forward(f, &hidden, rounds)?;
        if soft {
            return self.soft_loss(f, &hidden, &logits);
        }
        let t = f.labels.dim(1)?;
        let mut loss: Option<Tensor> = None;
        for (r, l) in logits.iter().enumerate() {
            // Round r + 1 of base pair i predicts pair i + r's label.
            let (rows, weights) =
                self.targets(&f.labels.narrow(1, r, t - r)?, &f.mask.narrow(1, r, t - r)?)?;
            let term = masked_cross_entropy(l, &rows, &weights)?;
            loss = Some(match loss {
                None => term,
                Some(sum) => (sum + term)?,
            });
        }
        Ok(loss.expect("at least one round"))
    }

    /// The target's logits over the unembedding's rows for the label of
    /// every pair but the last, `[N, T-2, R]`: pair `t`'s from `h_{t+1}`.
    pub fn teacher_logits(&self, f: &Features) -> Result<Tensor, TrainError> {
        self.teacher_of(&f.hidden.to_device(&self.device)?)
    }

    /// [`Self::teacher_logits`] of the hidden states `[N, T-1, H]` already
    /// on the head's device.
    fn teacher_of(&self, hidden: &Tensor) -> Result<Tensor, TrainError> {
        let t = hidden.dim(1)?;
        self.unembed(&hidden.narrow(1, 1, t - 1)?)
    }

    /// Distillation against the target's own distribution: pair `t`'s label
    /// is the target's choice after `x_{t+1}`, whose logits are the target's
    /// unembedding of `h_{t+1}`, the hidden state of the next pair. So the
    /// features already hold the whole distribution the greedy label was
    /// taken from; the loss is its cross-entropy with the head's, over the
    /// draft vocabulary's rows (the target's renormalised there), weighted
    /// as the greedy loss is. A pair whose next hidden state is not in the
    /// features (the last) is left out. Round `r + 1`'s base pair `t` is
    /// scored against `h_{t+r+1}`.
    fn soft_loss(
        &self,
        f: &Features,
        hidden: &Tensor,
        logits: &[Tensor],
    ) -> Result<Tensor, TrainError> {
        let (n, t, _) = hidden.dims3()?;
        let r = self.lm_head.dim(0)?;
        let teacher = self.teacher_of(hidden)?;
        let score = |logits: &Tensor, pairs: usize, shift: usize| -> Result<Tensor, TrainError> {
            let own = logits.reshape((n, (), r))?.narrow(1, 0, pairs)?;
            let target = teacher.narrow(1, shift, pairs)?;
            let (_, weights) = self.targets(
                &f.labels.narrow(1, shift, pairs)?,
                &f.mask.narrow(1, shift, pairs)?,
            )?;
            soft_cross_entropy(
                &own.reshape((n * pairs, r))?,
                &target.reshape((n * pairs, r))?,
                &weights,
            )
        };
        let mut loss = score(&logits[0], t - 1, 0)?;
        for (round, l) in logits.iter().enumerate().skip(1) {
            if t > round + 1 {
                loss = (loss + score(l, t - 1 - round, round)?)?;
            }
        }
        Ok(loss)
    }

    /// Held-out loss (over labels inside the draft vocabulary) and top-1
    /// agreement (over every scored label: one outside the draft vocabulary
    /// is a miss), in chunks.
    pub fn eval(&self, f: &Features) -> Result<(f64, f64), TrainError> {
        let n = f.hidden.dim(0)?;
        let (mut loss, mut weight) = (0.0, 0.0);
        let (mut hits, mut count) = (0usize, 0usize);
        for start in (0..n).step_by(16) {
            let idx: Vec<u32> = (start..(start + 16).min(n)).map(|i| i as u32).collect();
            let chunk = f.select(&idx)?;
            let logits = self.logits(&chunk)?;
            let (rows, weights) = self.targets(&chunk.labels, &chunk.mask)?;
            let w = weights.sum_all()?.to_scalar::<f32>()? as f64;
            loss += masked_cross_entropy(&logits, &rows, &weights)?.to_scalar::<f32>()? as f64 * w;
            weight += w;
            let pred: Vec<u32> = logits.argmax(1)?.to_vec1()?;
            let want: Vec<u32> = chunk.labels.flatten_all()?.to_vec1()?;
            let mask: Vec<f32> = chunk.mask.flatten_all()?.to_vec1()?;
            for ((&p, &l), &m) in pred.iter().zip(&want).zip(&mask) {
                if m > 0.0 {
                    count += 1;
                    hits += usize::from(self.id_of(p) == l);
                }
            }
        }
        Ok((loss / weight.max(1.0), hits as f64 / count.max(1) as f64))
    }
}

/// Mean cross-entropy of `logits` `[R, C]` against class `rows` `[R]`,
/// each row weighted by `weights` `[R]` (0: skipped).
fn masked_cross_entropy(
    logits: &Tensor,
    rows: &Tensor,
    weights: &Tensor,
) -> Result<Tensor, TrainError> {
    let logp = candle_nn::ops::log_softmax(logits, D::Minus1)?;
    let picked = logp.gather(&rows.unsqueeze(1)?, 1)?.squeeze(1)?;
    weighted_negative_mean(&picked, weights)
}

/// Mean cross-entropy of `logits` `[R, C]` against the distributions
/// `softmax(target)` `[R, C]`, each row weighted by `weights` `[R]`.
fn soft_cross_entropy(
    logits: &Tensor,
    target: &Tensor,
    weights: &Tensor,
) -> Result<Tensor, TrainError> {
    let logp = candle_nn::ops::log_softmax(logits, D::Minus1)?;
    let p = candle_nn::ops::softmax(target, D::Minus1)?;
    let per_row = (p * logp)?.sum(D::Minus1)?;
    weighted_negative_mean(&per_row, weights)
}

/// `-Σ logp·w / Σ w` for per-row log-likelihoods `logp` `[R]`.
fn weighted_negative_mean(logp: &Tensor, weights: &Tensor) -> Result<Tensor, TrainError> {
    let total = weights.sum_all()?.to_scalar::<f32>()?.max(1.0) as f64;
    Ok(((logp * weights)?.sum_all()? * (-1.0 / total))?)
}

/// The additive mask of round `r + 1` (0-based `r`) over the keys of
/// rounds `1..=r + 1` laid end to end (round `s + 1` holds `t - s` keys):
/// base pair `i` sees the real pairs `0..=i` and its own entry of every
/// later round. `[t - r, Σ_{s≤r} (t - s)]`.
fn round_mask(t: usize, r: usize, device: &Device) -> Result<Tensor, TrainError> {
    let rows = t - r;
    let cols: usize = (0..=r).map(|s| t - s).sum();
    let mut mask = vec![f32::NEG_INFINITY; rows * cols];
    for i in 0..rows {
        let row = &mut mask[i * cols..(i + 1) * cols];
        row[..=i].fill(0.0);
        let mut start = t;
        for s in 1..=r {
            row[start + i] = 0.0;
            start += t - s;
        }
    }
    Ok(Tensor::from_vec(mask, (rows, cols), device)?)
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
fn rope_tables(
    cfg: &ModelConfig,
    t: usize,
    device: &Device,
) -> Result<(Tensor, Tensor), TrainError> {
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
        Tensor::from_vec(cos, (t, cfg.head_dim), device)?,
        Tensor::from_vec(sin, (t, cfg.head_dim), device)?,
    ))
}
