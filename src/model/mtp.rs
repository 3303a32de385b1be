//! A DeepSeek-V3-style multi-token-prediction (MTP) head for a Llama-family
//! target ("DeepSeek-V3 Technical Report", 2024, §2.2).
//!
//! Given the target's last hidden state `h_t` (before its final norm) and
//! the embedding of token `x_{t+1}`, the head predicts `x_{t+2}`:
//!
//! ```text
//! u_t = eh_proj([enorm(emb(x_{t+1})) ; hnorm(h_t)])      // [2H] → [H]
//! o_t = block(u_t)                                      // one Llama decoder layer, own KV, position t
//! logits = lm_head(norm(o_t))                           // the target's final norm and unembedding
//! ```
//!
//! `o_t` (pre-norm) is the "projected hidden" fed back for the next draft.
//!
//! # Checkpoint format (`mtp.safetensors` in the model or a draft directory)
//!
//! | tensor | shape |
//! | --- | --- |
//! | `mtp.enorm.weight`, `mtp.hnorm.weight` | `[H]` |
//! | `mtp.eh_proj.weight` | `[H, 2H]` (input: embedding half first) |
//! | `mtp.layers.0.input_layernorm.weight`, `mtp.layers.0.post_attention_layernorm.weight` | `[H]` |
//! | `mtp.layers.0.self_attn.{q,k,v,o}_proj.weight` (+ `.bias` for q/k/v when the target has them) | as the target's layers |
//! | `mtp.layers.0.mlp.{gate,up,down}_proj.weight` | as the target's layers |
//!
//! | `mtp.draft_vocab` (optional) | `[N]` u32: the draft vocabulary, strictly increasing token ids `< vocab` |
//!
//! The embedding, final norm and unembedding are the target's own (frozen,
//! shared, not stored). The block uses the target's head counts, RoPE and
//! norm epsilon.
//!
//! # Draft vocabulary (FR-Spec, EAGLE-3)
//! With `mtp.draft_vocab` the head unembeds over those `N` rows of the
//! target's unembedding only (gathered once at load into an `[N, H]`
//! matrix), typically the most frequent tokens of the training labels: the
//! unembedding is most of a draft token's cost, and `N = 8192` of SmolLM2's
//! 49 152 rows cover nearly every label. [`MtpHead::step`] still returns
//! logits over the full vocabulary, `-inf` outside the set, so a draft of a
//! token outside it is simply never proposed and the rest of the engine is
//! unchanged. Loading checks the ids ([`ModelError::DraftVocab`]).
//!
//! # Formats
//! The input projection, the block and the gathered unembedding run where
//! the target's layers run (the lean CPU kernels on CPU) and are quantised
//! to Q8_0 at load when the target's projections are quantised, so a draft
//! token costs a fixed share of a target step whatever the target's format.
//! On the lean CPU path they are Q8_0 over f32 and f16 targets too
//! (`head_q8_on_cpu`). The input projection ran as a candle f32 matmul
//! until session 30: 0.09 ms of a 0.30 ms one-pair round on a 2-core Xeon,
//! and 0.25 ms for two pairs, which a step that verified drafts feeds
//! (`examples/head_round_cost.rs`; BENCHMARKS.md, issue 18).
//!
//! # Captured rounds (CUDA)
//! A round is a handful of small launches (the input projection, one
//! layer, the draft-vocabulary unembedding, an argmax) and on a GPU their
//! host time is most of its cost: eagerly about 0.3-0.4 ms against a 0.7
//! ms replayed SmolLM2 step on the H200 (BENCHMARKS.md, issue 18). So a
//! round whose spans are graph-shaped (one pair a slot, or round 0's few
//! pending pairs) runs as one CUDA graph of all of it, through the block's
//! [`Model::captured_pass`]: token ids, attention metadata, the rows to
//! read and the hidden rows go in; the projected hidden, the logits and
//! every row's argmax come out, so a greedy draft reads back only its id.
//! The graph runs the eager round's ops in order over the same inputs, so
//! it computes what the eager round does. `TANDEM_HEAD_GRAPHS=0` keeps the
//! rounds eager (`TANDEM_CUDA_GRAPHS=0` turns every graph off).
//!
//! # KV
//! The block keeps its own one-layer KV cache per slot: entry `t` holds the
//! block's keys/values for the pair `(h_t, x_{t+1})`, so it can be written only
//! once `x_{t+1}` is known. The engine feeds the head every pair as soon as it
//! is (prompt, accepted drafts, sampled tokens) and rolls the speculative
//! entries of later draft rounds back.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};

use super::linear::Linear;
use super::{Batch, LoadOptions, Model, ModelConfig, ModelError, WeightFormat, Weights};
use crate::kv::KvCache;
use crate::slot::SlotId;

/// File name of a head's weights.
pub const MTP_FILE: &str = "mtp.safetensors";

/// Name of the optional draft-vocabulary tensor (`[N]` u32).
pub const DRAFT_VOCAB_TENSOR: &str = "mtp.draft_vocab";

/// The head's tensors and shapes for a target config (the documented format).
pub fn mtp_tensor_shapes(target: &ModelConfig) -> Vec<(String, Vec<usize>)> {
    let h = target.hidden_size;
    let mut out = vec![
        ("mtp.enorm.weight".to_string(), vec![h]),
        ("mtp.hnorm.weight".to_string(), vec![h]),
        ("mtp.eh_proj.weight".to_string(), vec![h, 2 * h]),
    ];
    for (name, shape) in super::weights::tensor_shapes(&block_config(target)) {
        if let Some(rest) = name.strip_prefix("model.layers.0.") {
            out.push((format!("mtp.layers.0.{rest}"), shape));
        }
    }
    out
}

/// The block as a one-layer model of the target's shape.
fn block_config(target: &ModelConfig) -> ModelConfig {
    ModelConfig {
        num_layers: 1,
        ..target.clone()
    }
}

/// Checks a draft vocabulary for a target of `vocab` tokens: non-empty,
/// strictly increasing, every id `< vocab`.
pub fn check_draft_vocab(ids: &[u32], vocab: usize) -> Result<(), String> {
    if ids.is_empty() {
        return Err("empty (leave the tensor out for the full vocabulary)".into());
    }
    if let Some(w) = ids.windows(2).find(|w| w[0] >= w[1]) {
        return Err(format!(
            "ids must be strictly increasing (sorted, unique); found {} then {}",
            w[0], w[1]
        ));
    }
    let last = ids[ids.len() - 1];
    if last as usize >= vocab {
        return Err(format!(
            "token id {last} is outside the target's vocabulary of {vocab}"
        ));
    }
    Ok(())
}

/// Whether a head over an unquantised target runs Q8_0 anyway: on the lean
/// CPU path a draft round streams the head's weights (one layer, the input
/// projection and the draft vocabulary's unembedding: 36 MB in f32 for
/// SmolLM2 with 8 192 draft rows) and Q8_0 streams a quarter of that bytes,
/// while a draft's exactness never depends on the head (verification
/// decides). `TANDEM_HEAD_FORMAT=as-compute` keeps the target's format.
fn head_q8_on_cpu(target: &Model) -> bool {
    target.is_lean() && std::env::var("TANDEM_HEAD_FORMAT").map_or(true, |v| v != "as-compute")
}

/// Takes and checks `mtp.draft_vocab` from a checkpoint, when present.
fn take_draft_vocab(
    tensors: &mut HashMap<String, Tensor>,
    vocab: usize,
    origin: &Path,
) -> Result<Option<Vec<u32>>, ModelError> {
    let Some(t) = tensors.remove(DRAFT_VOCAB_TENSOR) else {
        return Ok(None);
    };
    let bad = |reason: String| ModelError::DraftVocab {
        path: origin.to_path_buf(),
        reason,
    };
    if t.dtype() != DType::U32 || t.rank() != 1 {
        return Err(bad(format!(
            "expected a [N] u32 tensor, found {:?} of shape {:?}",
            t.dtype(),
            t.dims()
        )));
    }
    let ids: Vec<u32> = t.to_vec1()?;
    check_draft_vocab(&ids, vocab).map_err(bad)?;
    Ok(Some(ids))
}

/// A reduced draft vocabulary, ready to widen logits to the full vocabulary.
#[derive(Debug, Clone)]
struct DraftVocab {
    /// `[N]` u32 ids on the target's device.
    ids: Tensor,
    /// The same ids on the host (maps an argmax row back to its token).
    host_ids: Vec<u32>,
    vocab: usize,
}

/// A draft round's logits, one row per drafting sequence: over the whole
/// vocabulary, or over a head's draft vocabulary. Greedy drafts are the
/// argmax of the rows where they lie ([`argmax`](Self::argmax): only the
/// ids reach the host); only rows that need a distribution (sampled or
/// constrained drafts) are widened to the whole vocabulary.
#[derive(Debug, Clone)]
pub struct DraftLogits {
    /// `[rows, N]` in the head's compute dtype. On a GPU it and `best` may
    /// be a captured graph's output buffers, valid until the head's next
    /// round (see `Model::captured_pass`): every accessor reads them into
    /// a fresh tensor or the host.
    logits: Tensor,
    vocab: Option<Arc<DraftVocab>>,
    /// `[rows]` u32: every row's argmax (into the `N` columns), when the
    /// round already computed it on the device (a captured round).
    best: Option<Tensor>,
}

impl DraftLogits {
    /// Logits over the whole vocabulary, `[rows, vocab]`.
    pub fn full(logits: Tensor) -> Self {
        Self {
            logits,
            vocab: None,
            best: None,
        }
    }

    /// The greedy draft (argmax token id) of each of `rows`, computed on
    /// the logits' device (candle's argmax: on the CPU a tie goes to the
    /// lowest id; on a GPU the tie-break is the kernel's). A draft's
    /// tie-break never changes what verification emits.
    pub fn argmax(&self, rows: &[usize]) -> Result<Vec<u32>, ModelError> {
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        let best: Vec<u32> = match &self.best {
            Some(all) => {
                let all: Vec<u32> = all.to_vec1()?;
                rows.iter().map(|&r| all[r]).collect()
            }
            None => {
                let idx: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
                let idx = Tensor::new(idx.as_slice(), self.logits.device())?;
                self.logits
                    .index_select(&idx, 0)?
                    .to_dtype(DType::F32)?
                    .argmax(candle_core::D::Minus1)?
                    .to_vec1()?
            }
        };
        Ok(match &self.vocab {
            Some(v) => best.iter().map(|&i| v.host_ids[i as usize]).collect(),
            None => best,
        })
    }

    /// Row `row` over the whole vocabulary, `[1, vocab]` f32 (`-inf` outside
    /// a draft vocabulary).
    pub fn widened(&self, row: usize) -> Result<Tensor, ModelError> {
        self.widen(&self.logits.narrow(0, row, 1)?)
    }

    /// Every row over the whole vocabulary, `[rows, vocab]` f32.
    pub fn widened_all(&self) -> Result<Tensor, ModelError> {
        self.widen(&self.logits)
    }

    fn widen(&self, small: &Tensor) -> Result<Tensor, ModelError> {
        let small = small.to_dtype(DType::F32)?.contiguous()?;
        let Some(v) = &self.vocab else {
            // f32 logits on a GPU may still be a captured graph's own
            // buffer: a copy outlives the head's next round.
            return Ok(if small.device().is_cuda() {
                small.copy()?
            } else {
                small
            });
        };
        let (rows, n) = small.dims2()?;
        let idx = v.ids.unsqueeze(0)?.expand((rows, n))?.contiguous()?;
        let full = Tensor::full(f32::NEG_INFINITY, (rows, v.vocab), small.device())?;
        Ok(full.scatter(&idx, &small, 1)?)
    }
}

/// A loaded MTP head (see the module docs).
pub struct MtpHead {
    /// The target's token embedding (shared).
    embed: Tensor,
    enorm: Tensor,
    hnorm: Tensor,
    /// In the block's weight format, run by the block's kernels.
    eh_proj: Linear,
    eps: f32,
    /// The decoder block, as a one-layer model sharing the target's
    /// embedding, final norm and unembedding.
    block: Model,
    kv: KvCache,
    /// Last projected hidden state per slot (input of the next draft round).
    projected: HashMap<SlotId, Tensor>,
    /// `None`: the block unembeds over the full vocabulary.
    draft_vocab: Option<Arc<DraftVocab>>,
}

impl MtpHead {
    /// Loads `dir/mtp.safetensors` for `target`.
    pub fn from_dir(target: &Model, dir: &Path) -> Result<Self, ModelError> {
        let path = dir.join(MTP_FILE);
        if !path.exists() {
            return Err(ModelError::Weights {
                path,
                reason: "no MTP head here (expected mtp.safetensors)".into(),
            });
        }
        let tensors = candle_core::safetensors::load(&path, &Device::Cpu).map_err(|e| {
            ModelError::Weights {
                path: path.clone(),
                reason: e.to_string(),
            }
        })?;
        Self::from_tensors(target, tensors, &path)
    }

    /// Builds a head from named tensors (as in the checkpoint format).
    pub fn from_tensors(
        target: &Model,
        mut tensors: HashMap<String, Tensor>,
        origin: &Path,
    ) -> Result<Self, ModelError> {
        let cfg = target.config();
        let (dtype, device) = (target.dtype(), target.device().clone());
        let h = cfg.hidden_size;
        let draft_ids = take_draft_vocab(&mut tensors, cfg.vocab_size, origin)?;
        let mut take = |name: &str, shape: &[usize]| -> Result<Tensor, ModelError> {
            let t = tensors
                .remove(name)
                .ok_or_else(|| ModelError::MissingTensor {
                    path: origin.to_path_buf(),
                    name: name.into(),
                })?;
            if t.dims() != shape {
                return Err(ModelError::ShapeMismatch {
                    path: origin.to_path_buf(),
                    name: name.into(),
                    expected: shape.to_vec(),
                    found: t.dims().to_vec(),
                });
            }
            Ok(t.to_device(&device)?.to_dtype(dtype)?)
        };
        let enorm = take("mtp.enorm.weight", &[h])?;
        let hnorm = take("mtp.hnorm.weight", &[h])?;
        let eh_proj = take("mtp.eh_proj.weight", &[h, 2 * h])?;
        let (embed, norm, lm_head) = target.shared_tensors()?;
        let mut block_weights = HashMap::new();
        for (name, shape) in mtp_tensor_shapes(cfg).into_iter().skip(3) {
            let t = take(&name, &shape)?;
            block_weights.insert(name.replacen("mtp.", "model.", 1), t);
        }
        // The block is a one-layer model whose vocabulary is the draft
        // vocabulary: its (tied) unembedding holds the gathered rows of the
        // target's, in the block's weight format. It never embeds tokens
        // (the head feeds `forward_embeddings`).
        let (rows, draft_vocab) = match &draft_ids {
            Some(ids) => {
                let idx = Tensor::new(ids.as_slice(), lm_head.device())?;
                let vocab = DraftVocab {
                    ids: Tensor::new(ids.as_slice(), &device)?,
                    host_ids: ids.clone(),
                    vocab: cfg.vocab_size,
                };
                (lm_head.index_select(&idx, 0)?, Some(Arc::new(vocab)))
            }
            None => (lm_head, None),
        };
        block_weights.insert("model.embed_tokens.weight".into(), rows);
        block_weights.insert("model.norm.weight".into(), norm);
        let block_cfg = ModelConfig {
            vocab_size: draft_ids.as_ref().map_or(cfg.vocab_size, Vec::len),
            tie_word_embeddings: true,
            ..block_config(cfg)
        };
        let weight_format = if target.quantized_projections() || head_q8_on_cpu(target) {
            WeightFormat::Q8_0
        } else {
            WeightFormat::AsCompute
        };
        let block = Model::load(
            block_cfg,
            &Weights::Memory(block_weights),
            &LoadOptions {
                dtype,
                device: device.clone(),
                weight_format,
                lean_cpu: target.is_lean(),
                ..LoadOptions::default()
            },
        )?;
        let eh_proj = block.own_linear(eh_proj, weight_format)?;
        // An A/B knob for the captured rounds (see the module docs).
        if std::env::var("TANDEM_HEAD_GRAPHS").is_ok_and(|v| v == "0") {
            block.set_cuda_graphs(false);
        }
        // One layer of KV per slot; the capacity bound is generous because the
        // engine's own pool already limits how many tokens slots can hold.
        let kv = KvCache::new(block.kv_layout(), device, usize::MAX / 2);
        Ok(Self {
            embed,
            enorm,
            hnorm,
            eh_proj,
            eps: cfg.rms_norm_eps as f32,
            block,
            kv,
            projected: HashMap::new(),
            draft_vocab,
        })
    }

    /// Turns the CUDA graphs of the head's rounds on or off (see
    /// [`step_logits`](Self::step_logits)).
    pub fn set_cuda_graphs(&self, on: bool) {
        self.block.set_cuda_graphs(on);
    }

    /// What the graphs of the head's rounds have done since load.
    pub fn cuda_graph_stats(&self) -> super::GraphStats {
        self.block.cuda_graph_stats()
    }

    /// The draft vocabulary's size, `None` for the full vocabulary.
    pub fn draft_vocab_len(&self) -> Option<usize> {
        self.draft_vocab.as_ref().map(|d| d.ids.elem_count())
    }

    /// An untrained head with deterministic random weights (tests, and the
    /// starting point of training).
    pub fn random(target: &Model, seed: u64) -> Result<Self, ModelError> {
        Self::from_tensors(
            target,
            random_tensors(target.config(), seed)?,
            Path::new("<random>"),
        )
    }

    /// Registers a slot with room for `reserve` positions.
    pub fn admit(&mut self, slot: SlotId, reserve: usize) -> Result<(), ModelError> {
        self.kv.allocate(slot, reserve)?;
        Ok(())
    }

    pub fn release(&mut self, slot: SlotId) {
        self.kv.free(slot);
        self.projected.remove(&slot);
    }

    /// Positions of the slot whose block KV is written.
    pub fn len(&self, slot: SlotId) -> Result<usize, ModelError> {
        Ok(self.kv.len(slot)?)
    }

    /// Forgets KV entries at positions `len..` (speculative draft rounds).
    pub fn truncate(&mut self, slot: SlotId, len: usize) -> Result<(), ModelError> {
        Ok(self.kv.set_len(slot, len)?)
    }

    /// [`step_logits`](Self::step_logits) over the whole vocabulary:
    /// `[slots, vocab]` f32, `-inf` outside the draft vocabulary.
    pub fn step(
        &mut self,
        target: &Model,
        batch: &Batch,
        hidden: Option<&Tensor>,
    ) -> Result<Tensor, ModelError> {
        self.step_logits(target, batch, hidden)?.widened_all()
    }

    /// Runs pairs through the head. `batch` spans give, per slot, the tokens
    /// `x_{t+1}` of consecutive pairs starting at position `offset` (= the
    /// slot's head KV length); `hidden` holds the matching `h_t` rows, or
    /// `None` to use each slot's last projected hidden (one pair per slot).
    /// Returns the logits of each span's last pair (over the draft vocabulary
    /// when the head has one) and stores its projected hidden for the next
    /// round. On a GPU the round replays a CUDA graph where it can (see the
    /// module docs).
    pub fn step_logits(
        &mut self,
        target: &Model,
        batch: &Batch,
        hidden: Option<&Tensor>,
    ) -> Result<DraftLogits, ModelError> {
        let start = std::time::Instant::now();
        let hidden = match hidden {
            Some(h) => h.clone(),
            None => {
                let rows = batch
                    .seqs
                    .iter()
                    .map(|s| {
                        self.projected.get(&s.slot).cloned().ok_or_else(|| {
                            ModelError::InvalidBatch(format!(
                                "slot {} has no projected hidden state",
                                s.slot
                            ))
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                Tensor::cat(&rows, 0)?
            }
        };
        target.check_tokens(&batch.tokens)?;
        let hidden = hidden.to_dtype(self.embed.dtype())?.contiguous()?;
        let (embed, enorm, hnorm, eps) = (&self.embed, &self.enorm, &self.hnorm, self.eps);
        let (eh_proj, block) = (&self.eh_proj, &self.block);
        let project = |ids: &Tensor, hidden: &Tensor| -> Result<Tensor, ModelError> {
            let x = match super::fused::mtp_input(ids, embed, hidden, (enorm, hnorm), eps)? {
                Some(x) => x,
                None => {
                    let emb = embed.index_select(ids, 0)?.contiguous()?;
                    Tensor::cat(
                        &[
                            candle_nn::ops::rms_norm(&emb, enorm, eps)?,
                            candle_nn::ops::rms_norm(hidden, hnorm, eps)?,
                        ],
                        1,
                    )?
                }
            };
            block.project(eh_proj, &x)
        };
        // A captured round also takes every row's argmax on the device, so
        // a greedy draft reads back only its id.
        let unembed = |out: Tensor| -> Result<Vec<Tensor>, ModelError> {
            let logits = block.unembed_compute(&out)?;
            let best = logits.argmax(candle_core::D::Minus1)?;
            Ok(vec![out, logits, best])
        };
        let prepared = start.elapsed();
        let captured = self.block.captured_pass(
            batch,
            &mut self.kv,
            Some(&hidden),
            |inputs| match &inputs.rows {
                Some(rows) => project(&inputs.ids, rows),
                None => Err(ModelError::InvalidBatch(
                    "a head round without hidden rows".into(),
                )),
            },
            unembed,
        )?;
        let (out, logits, best) = match captured {
            Some(mut outputs) if outputs.len() == 3 => {
                let best = outputs.pop();
                let logits = outputs.pop().expect("three outputs");
                (outputs.pop().expect("three outputs"), logits, best)
            }
            Some(outputs) => {
                return Err(ModelError::InvalidBatch(format!(
                    "a captured head round returned {} outputs, not 3",
                    outputs.len()
                )))
            }
            None => {
                let ids = Tensor::new(batch.tokens.as_slice(), target.device())?;
                let u = project(&ids, &hidden)?;
                let out = self.block.forward_embeddings(batch, u, &mut self.kv)?; // [slots, H] (Last rows)
                let logits = self.block.unembed_compute(&out)?;
                (out, logits, None)
            }
        };
        let passed = start.elapsed();
        // `out` may view the graph's output buffer, overwritten when the
        // same shape next runs. It is read first: the next round's members
        // are among this round's, and it copies their rows into its own
        // graph's input (ordered on the stream before that graph runs); a
        // step's first round starts from hidden states, not from these.
        for (i, s) in batch.seqs.iter().enumerate() {
            self.projected.insert(s.slot, out.narrow(0, i, 1)?);
        }
        let us = |d: std::time::Duration| d.as_secs_f64() * 1e6;
        tracing::debug!(
            rows = batch.tokens.len(),
            graph = best.is_some(),
            prep_us = us(prepared),
            pass_us = us(passed - prepared),
            rest_us = us(start.elapsed() - passed),
            "head round"
        );
        Ok(DraftLogits {
            logits,
            vocab: self.draft_vocab.clone(),
            best,
        })
    }
}

/// Deterministic random head tensors for `cfg` (uniform, std 0.02; norms 1).
pub fn random_tensors(cfg: &ModelConfig, seed: u64) -> Result<HashMap<String, Tensor>, ModelError> {
    let Weights::Memory(block) = Weights::random(&block_config(cfg), seed, 0.02)? else {
        unreachable!("Weights::random is in memory")
    };
    let mut out = HashMap::new();
    for (name, shape) in mtp_tensor_shapes(cfg) {
        let t = match name.strip_prefix("mtp.layers.0.") {
            Some(rest) => block
                .get(&format!("model.layers.0.{rest}"))
                .cloned()
                .ok_or_else(|| ModelError::MissingTensor {
                    path: "<random>".into(),
                    name: name.clone(),
                })?,
            None if name.ends_with("norm.weight") => {
                Tensor::ones(shape.as_slice(), DType::F32, &Device::Cpu)?
            }
            None => super::weights::uniform_tensor(&shape, 0.02, seed ^ 0x5eed)?,
        };
        out.insert(name, t);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A captured round hands over every row's argmax; the drafts read from
    /// it are the ones computed from the logits, mapped through the draft
    /// vocabulary alike.
    #[test]
    fn a_rounds_precomputed_argmax_gives_the_computed_drafts() {
        let device = Device::Cpu;
        let ids = [5u32, 7, 9];
        let vocab = Arc::new(DraftVocab {
            ids: Tensor::new(&ids, &device).unwrap(),
            host_ids: ids.to_vec(),
            vocab: 10,
        });
        let logits = Tensor::new(&[[0.1f32, 2.0, -1.0], [3.0, 0.5, 4.0]], &device).unwrap();
        let computed = DraftLogits {
            logits: logits.clone(),
            vocab: Some(vocab.clone()),
            best: None,
        };
        let given = DraftLogits {
            best: Some(logits.argmax(candle_core::D::Minus1).unwrap()),
            ..computed.clone()
        };
        for rows in [vec![0, 1], vec![1], vec![]] {
            let want = computed.argmax(&rows).unwrap();
            assert_eq!(given.argmax(&rows).unwrap(), want, "rows {rows:?}");
        }
        assert_eq!(computed.argmax(&[0, 1]).unwrap(), [7, 9]);
    }
}
