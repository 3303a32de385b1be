//! Self-distillation data: sequences the target writes itself, the target's
//! hidden states and greedy choices along them, and draft acceptance.

use candle_core::{DType, Device, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::TrainError;
use crate::kv::KvCache;
use crate::model::{Batch, Model, ModelError, MtpHead, OutputRows};

/// Pairs `(h_t, x_{t+1})` of N sequences with the target's greedy label for
/// each (the token it predicts after `x_{t+1}`), positions `0..T-1`.
pub struct Features {
    /// `[N, T-1, hidden]`: target hidden states (pre-final-norm) at `t`.
    pub hidden: Tensor,
    /// `[N, T-1]` u32: tokens `x_{t+1}`.
    pub next_tokens: Tensor,
    /// `[N, T-1]` u32: `argmax target(x_{≤t+1})`.
    pub labels: Tensor,
    /// The whole sequences (for acceptance measurement).
    pub sequences: Vec<Vec<u32>>,
    /// Prompt length of each sequence (the rest is the target's).
    pub prompt_lens: Vec<usize>,
}

impl Features {
    pub fn len(&self) -> usize {
        self.sequences.len()
    }

    pub fn is_empty(&self) -> bool {
        self.sequences.is_empty()
    }

    /// The sequences at `idx` (tensors only).
    pub fn select(&self, idx: &[u32]) -> Result<Features, TrainError> {
        let i = Tensor::new(idx, &Device::Cpu)?;
        Ok(Features {
            hidden: self.hidden.index_select(&i, 0)?,
            next_tokens: self.next_tokens.index_select(&i, 0)?,
            labels: self.labels.index_select(&i, 0)?,
            sequences: Vec::new(),
            prompt_lens: Vec::new(),
        })
    }
}

/// Sequences written per forward pass while generating.
const GEN_BATCH: usize = 32;

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}

/// `n` sequences of `seq_len` tokens: a short random prompt (BOS first when
/// the model has one), continued by the target — sampled at `temperature`,
/// or greedily when `None` — plus the target's features along them.
pub fn generate(
    target: &Model,
    n: usize,
    seq_len: usize,
    temperature: Option<f32>,
    seed: u64,
) -> Result<Features, TrainError> {
    let cfg = target.config();
    let vocab = cfg.vocab_size as u32;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let bos = cfg.bos_token_id;
    let mut sequences = Vec::with_capacity(n);
    let mut prompt_lens = Vec::with_capacity(n);
    for _ in 0..n {
        let len = rng.random_range(1..=4usize);
        let mut p: Vec<u32> = bos.into_iter().collect();
        // Avoid the special ids at the bottom of most vocabularies.
        p.extend((0..len).map(|_| rng.random_range(3.min(vocab - 1)..vocab)));
        prompt_lens.push(p.len());
        sequences.push(p);
    }
    let eos: Vec<u32> = cfg.eos_token_ids.clone();
    for chunk in sequences.chunks_mut(GEN_BATCH) {
        let mut kv = KvCache::new(
            target.kv_layout(),
            target.device().clone(),
            chunk.len() * seq_len,
        );
        let mut batch = Batch::default();
        for (i, s) in chunk.iter().enumerate() {
            kv.allocate(i as u32, seq_len).map_err(ModelError::from)?;
            batch.push(i as u32, 0, s, OutputRows::Last);
        }
        while !batch.is_empty() {
            let logits: Vec<Vec<f32>> = target
                .unembed(&target.forward(&batch, &mut kv)?)?
                .to_vec2()?;
            let fed: Vec<u32> = batch.seqs.iter().map(|s| s.slot).collect();
            batch = Batch::default();
            for (&slot, row) in fed.iter().zip(&logits) {
                let i = slot as usize;
                let s = &mut chunk[i];
                let mut next = match temperature {
                    None => argmax(row),
                    Some(t) => sample(row, t, &mut rng),
                };
                // Keep sequences full length: an EOS would end the text, so
                // redraw greedily among the rest (rarely matters).
                if eos.contains(&next) {
                    let mut masked = row.clone();
                    for &e in &eos {
                        masked[e as usize] = f32::NEG_INFINITY;
                    }
                    next = argmax(&masked);
                }
                s.push(next);
                if s.len() < seq_len {
                    batch.push(slot, s.len() - 1, &[next], OutputRows::Last);
                }
            }
        }
    }
    features(target, sequences, prompt_lens)
}

fn sample(row: &[f32], temperature: f32, rng: &mut ChaCha8Rng) -> u32 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let weights: Vec<f32> = row
        .iter()
        .map(|&l| ((l - max) / temperature).exp())
        .collect();
    let total: f32 = weights.iter().sum();
    let mut u = rng.random::<f32>() * total;
    for (i, w) in weights.iter().enumerate() {
        if u < *w {
            return i as u32;
        }
        u -= w;
    }
    (row.len() - 1) as u32
}

/// Runs the target over whole sequences (all the same length) for hidden
/// states and greedy labels.
pub fn features(
    target: &Model,
    sequences: Vec<Vec<u32>>,
    prompt_lens: Vec<usize>,
) -> Result<Features, TrainError> {
    let t = sequences.first().map(Vec::len).unwrap_or(0);
    if t < 2 || sequences.iter().any(|s| s.len() != t) {
        return Err(TrainError::InvalidOption {
            field: "seq_len",
            reason: "sequences must share a length of at least 2".into(),
        });
    }
    let (mut hidden, mut next_tokens, mut labels) = (Vec::new(), Vec::new(), Vec::new());
    for chunk in sequences.chunks(GEN_BATCH) {
        let mut kv = KvCache::new(target.kv_layout(), target.device().clone(), chunk.len() * t);
        let mut batch = Batch::default();
        for (i, s) in chunk.iter().enumerate() {
            kv.allocate(i as u32, t).map_err(ModelError::from)?;
            batch.push(i as u32, 0, s, OutputRows::All);
        }
        let h = target.forward(&batch, &mut kv)?.to_dtype(DType::F32)?; // [chunk·T, H]
        let greedy: Vec<u32> = target.unembed(&h)?.argmax(1)?.to_vec1()?;
        let h = h.reshape((chunk.len(), t, target.config().hidden_size))?;
        hidden.push(h.narrow(1, 0, t - 1)?.contiguous()?);
        for (i, s) in chunk.iter().enumerate() {
            next_tokens.extend_from_slice(&s[1..]);
            labels.extend_from_slice(&greedy[i * t + 1..(i + 1) * t]);
        }
    }
    let n = sequences.len();
    Ok(Features {
        hidden: Tensor::cat(&hidden, 0)?,
        next_tokens: Tensor::from_vec(next_tokens, (n, t - 1), &Device::Cpu)?,
        labels: Tensor::from_vec(labels, (n, t - 1), &Device::Cpu)?,
        sequences,
        prompt_lens,
    })
}

/// `result[i]`: fraction of positions where drafts 1..=i+1 all equal the
/// greedy continuation (what greedy verification would accept), drafting
/// recursively with the head as the engine does.
pub fn acceptance_by_position(
    target: &Model,
    head: &mut MtpHead,
    heldout: &Features,
    k: usize,
) -> Result<Vec<f64>, TrainError> {
    let mut hits = vec![0usize; k];
    let mut trials = 0usize;
    let h_all = &heldout.hidden;
    for (n, seq) in heldout.sequences.iter().enumerate() {
        let slot = n as u32;
        head.admit(slot, seq.len() + k)?;
        let hidden = h_all.get(n)?; // [T-1, H]
        for t in 0..seq.len() - 1 {
            let mut b = Batch::default();
            b.push(slot, t, &[seq[t + 1]], OutputRows::Last);
            let mut logits: Vec<f32> = head
                .step(target, &b, Some(&hidden.narrow(0, t, 1)?))?
                .get(0)?
                .to_vec1()?;
            // Draft only where the next k tokens are the target's greedy output.
            let evaluable = t + 2 >= heldout.prompt_lens[n] && t + 1 + k < seq.len();
            if !evaluable {
                continue;
            }
            trials += 1;
            let mut all = true;
            for r in 0..k {
                let d = argmax(&logits);
                all &= d == seq[t + 2 + r];
                if !all {
                    break;
                }
                hits[r] += 1;
                if r + 1 < k {
                    let mut b = Batch::default();
                    b.push(slot, t + 1 + r, &[d], OutputRows::Last);
                    logits = head.step(target, &b, None)?.get(0)?.to_vec1()?;
                }
            }
            head.truncate(slot, t + 1)?;
        }
        head.release(slot);
    }
    Ok(hits
        .iter()
        .map(|&h| h as f64 / trials.max(1) as f64)
        .collect())
}
