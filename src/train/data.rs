//! Self-distillation data: sequences the target writes itself, the target's
//! hidden states and greedy choices along them, and draft acceptance.

use candle_core::{DType, Device, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::TrainError;
use crate::kv::KvCache;
use crate::model::{Batch, Model, ModelError, MtpHead, OutputRows};
use crate::sampler::argmax;

/// Pairs `(h_t, x_{t+1})` of N sequences with the target's greedy label for
/// each (the token it predicts after `x_{t+1}`), positions `0..T-1`.
pub struct Features {
    /// `[N, T-1, hidden]`: target hidden states (pre-final-norm) at `t`.
    pub hidden: Tensor,
    /// `[N, T-1]` u32: tokens `x_{t+1}`.
    pub next_tokens: Tensor,
    /// `[N, T-1]` u32: `argmax target(x_{≤t+1})`.
    pub labels: Tensor,
    /// `[N, T-1]` f32: 1 where the label is trained on and scored — it
    /// predicts a token the target wrote (not the prompt's) and `x_{t+1}`
    /// is text (not the ending EOS or the padding after it).
    pub mask: Tensor,
    /// The whole sequences (for acceptance measurement), padded with EOS
    /// to `T` after an early EOS.
    pub sequences: Vec<Vec<u32>>,
    /// Prompt length of each sequence (the rest is the target's).
    pub prompt_lens: Vec<usize>,
    /// Tokens of text: up to (not including) the EOS that ended the
    /// sequence, `T` when none did.
    pub lens: Vec<usize>,
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
            mask: self.mask.index_select(&i, 0)?,
            sequences: Vec::new(),
            prompt_lens: Vec::new(),
            lens: Vec::new(),
        })
    }

    /// Trained-on labels (mask 1), in order.
    pub fn scored_labels(&self) -> Result<Vec<u32>, TrainError> {
        let labels: Vec<u32> = self.labels.flatten_all()?.to_vec1()?;
        let mask: Vec<f32> = self.mask.flatten_all()?.to_vec1()?;
        Ok(labels
            .into_iter()
            .zip(mask)
            .filter(|(_, m)| *m > 0.0)
            .map(|(l, _)| l)
            .collect())
    }
}

/// Sequences written per forward pass while generating: a GPU step costs
/// about the same for many more rows than a CPU step. The data does not
/// depend on it (each draw is keyed by sequence and position).
fn gen_batch(device: &Device) -> usize {
    if device.is_cpu() {
        32
    } else {
        128
    }
}

/// Fewest tokens a prompt must leave the target to write: longer prompts
/// are skipped.
pub const MIN_CONTINUATION: usize = 8;

/// `n` sequences of `seq_len` tokens: `prompts` in turn (repeated when
/// there are fewer than `n`; prompts longer than `seq_len -
/// MIN_CONTINUATION` are skipped), each continued by the target — sampled
/// at `temperature`, or greedily when `None` — until `seq_len` tokens or an
/// EOS (then padded with EOS, which the mask leaves out), plus the target's
/// features along them.
pub fn generate(
    target: &Model,
    prompts: &[Vec<u32>],
    n: usize,
    seq_len: usize,
    temperature: Option<f32>,
    seed: u64,
) -> Result<Features, TrainError> {
    let cfg = target.config();
    let usable: Vec<&Vec<u32>> = prompts
        .iter()
        .filter(|p| !p.is_empty() && p.len() + MIN_CONTINUATION <= seq_len)
        .collect();
    if usable.is_empty() {
        return Err(TrainError::InvalidOption {
            field: "seq_len",
            reason: format!(
                "no prompt leaves {MIN_CONTINUATION} tokens to write within {seq_len} tokens (of {} prompts)",
                prompts.len()
            ),
        });
    }
    let mut sequences: Vec<Vec<u32>> = (0..n).map(|i| usable[i % usable.len()].clone()).collect();
    let prompt_lens: Vec<usize> = sequences.iter().map(Vec::len).collect();
    let mut lens = vec![seq_len; n];
    let (t, h) = (seq_len, cfg.hidden_size);
    // Features are gathered while writing: the row the target outputs at
    // position p is h_p (pair p's input, p ≤ T-2) and its argmax is the
    // label of pair p-1. The prompt is prefilled with every row out; the
    // last token is fed too, for its label. Padding rows stay zero.
    let mut hidden = vec![0f32; n * (t - 1) * h];
    let mut labels = vec![0u32; n * (t - 1)];
    let eos: Vec<u32> = cfg.eos_token_ids.clone();
    let pad = eos.first().copied().unwrap_or(0);
    let per_pass = gen_batch(target.device());
    for (c, chunk) in sequences.chunks_mut(per_pass).enumerate() {
        let base = c * per_pass;
        let mut kv = KvCache::new(
            target.kv_layout(),
            target.device().clone(),
            chunk.len() * seq_len,
        );
        let mut batch = Batch::default();
        for (i, s) in chunk.iter().enumerate() {
            kv.allocate(i as u32, seq_len).map_err(ModelError::from)?;
            batch.push(i as u32, 0, s, OutputRows::All);
        }
        while !batch.is_empty() {
            let out = target.forward(&batch, &mut kv)?.to_dtype(DType::F32)?;
            let logits: Vec<f32> = target.unembed(&out)?.flatten_all()?.to_vec1()?;
            let out: Vec<f32> = out.flatten_all()?.to_vec1()?;
            let spans: Vec<(u32, usize, usize)> = batch
                .seqs
                .iter()
                .map(|s| (s.slot, s.offset, s.len))
                .collect();
            // Each span's last row draws the sequence's next token at the
            // position after it.
            let mut draw_at = vec![None; out.len() / h];
            let mut row = 0;
            for &(slot, offset, len) in &spans {
                row += len;
                draw_at[row - 1] = Some((base + slot as usize, offset + len));
            }
            let picked = pick_rows(&logits, &draw_at, temperature, seed);
            batch = Batch::default();
            let mut row = 0;
            for (slot, offset, len) in spans {
                let i = base + slot as usize;
                for pos in offset..offset + len {
                    if pos + 1 < t {
                        let dst = (i * (t - 1) + pos) * h;
                        hidden[dst..dst + h].copy_from_slice(&out[row * h..(row + 1) * h]);
                    }
                    if pos >= 1 {
                        labels[i * (t - 1) + pos - 1] = picked[row].greedy;
                    }
                    row += 1;
                }
                let s = &mut chunk[slot as usize];
                if s.len() == seq_len {
                    continue; // the last token, fed for its label
                }
                let next = picked[row - 1].drawn;
                s.push(next);
                if eos.contains(&next) {
                    lens[i] = s.len() - 1;
                    s.resize(seq_len, pad);
                } else {
                    batch.push(slot, s.len() - 1, &[next], OutputRows::Last);
                }
            }
        }
    }
    let mask = scored_mask(&prompt_lens, &lens, t);
    Ok(Features {
        hidden: Tensor::from_vec(hidden, (n, t - 1, h), &Device::Cpu)?,
        next_tokens: Tensor::from_vec(
            sequences
                .iter()
                .flat_map(|s| s[1..].to_vec())
                .collect::<Vec<u32>>(),
            (n, t - 1),
            &Device::Cpu,
        )?,
        labels: Tensor::from_vec(labels, (n, t - 1), &Device::Cpu)?,
        mask: Tensor::from_vec(mask, (n, t - 1), &Device::Cpu)?,
        sequences,
        prompt_lens,
        lens,
    })
}

/// [`Features::mask`] of sequences of `t` tokens: pair `j` (input
/// `x_{j+1}`, label for position `j + 2`) counts when position `j + 2` is
/// the target's to write (`j + 2 ≥ prompt_len`) and `x_{j+1}` is text, not
/// the EOS that ended the sequence or padding (`j + 1 < lens`).
fn scored_mask(prompt_lens: &[usize], lens: &[usize], t: usize) -> Vec<f32> {
    prompt_lens
        .iter()
        .zip(lens)
        .flat_map(|(&p, &l)| (0..t - 1).map(move |j| f32::from(u8::from(j + 2 >= p && j + 1 < l))))
        .collect()
}

/// One logits row's greedy choice and the token drawn from it.
#[derive(Debug, Clone, Copy, Default)]
struct Picked {
    greedy: u32,
    /// The draw at the temperature (the greedy choice without one, or where
    /// the row draws nothing).
    drawn: u32,
}

/// [`Picked`] for every row of `logits` (`[rows, vocab]`, row-major);
/// `draw_at[row]` names the `(sequence, position)` a row draws for. Rows
/// are split across the host's threads (a GPU pass returns many rows of a
/// large vocabulary), and each draw has its own stream of `seed`, keyed by
/// sequence and position, so the data does not depend on the batching.
fn pick_rows(
    logits: &[f32],
    draw_at: &[Option<(usize, usize)>],
    temperature: Option<f32>,
    seed: u64,
) -> Vec<Picked> {
    let rows = draw_at.len();
    let vocab = logits.len() / rows.max(1);
    let pick = |row: usize| {
        let x = &logits[row * vocab..(row + 1) * vocab];
        let greedy = argmax(x);
        let drawn = match (temperature, draw_at[row]) {
            (Some(temp), Some((seq, pos))) => {
                let mut rng = ChaCha8Rng::seed_from_u64(seed);
                rng.set_stream(seq as u64);
                rng.set_word_pos(pos as u128);
                sample(x, temp, &mut rng)
            }
            _ => greedy,
        };
        Picked { greedy, drawn }
    };
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let per_thread = rows.div_ceil(threads.max(1)).max(1);
    let mut picked = vec![Picked::default(); rows];
    std::thread::scope(|scope| {
        for (c, out) in picked.chunks_mut(per_thread).enumerate() {
            let pick = &pick;
            scope.spawn(move || {
                for (j, p) in out.iter_mut().enumerate() {
                    *p = pick(c * per_thread + j);
                }
            });
        }
    });
    picked
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

/// The drafts a speculating engine makes while it walks an answer with
/// `k` drafts a step: each step drafts from the position right after the
/// previous step's accepted drafts and the target's own token (the first
/// from the answer's first token). So it counts only the positions an
/// engine drafts from, most of them right after a rejection, where
/// [`HeadScore::by_position`] averages over every position.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Walk {
    pub steps: usize,
    pub accepted: usize,
}

impl Walk {
    /// Accepted drafts a step.
    pub fn per_step(&self) -> f64 {
        self.accepted as f64 / self.steps.max(1) as f64
    }

    /// Walks one sequence: `depths[i]` drafts are accepted from its `i`-th
    /// position (consecutive positions, the first the answer's first token).
    pub fn add_sequence(&mut self, depths: &[usize]) {
        let mut i = 0;
        while let Some(&d) = depths.get(i) {
            self.steps += 1;
            self.accepted += d;
            i += d + 1;
        }
    }
}

/// A head's greedy acceptance on answered sequences.
#[derive(Debug, Clone, PartialEq)]
pub struct HeadScore {
    /// `by_position[i]`: fraction of positions where drafts 1..=i+1 all
    /// equal the greedy continuation.
    pub by_position: Vec<f64>,
    /// The same drafts walked as an engine drafting `k` a step meets them.
    pub walk: Walk,
}

/// The head's [`HeadScore`] on `heldout`: at every position, drafts
/// 1..=k until one differs from the greedy continuation (what greedy
/// verification would accept), drafting recursively with the head as the
/// engine does.
///
/// Every held-out sequence advances together, one position at a time:
/// each draft round is one head call over all sequences still drafting,
/// with greedy drafts taken where the logits are (over the draft
/// vocabulary when the head has one) and only their ids read back. A
/// sequence's drafts depend only on its own pairs, so the result is the
/// one sequence-by-sequence drafting gives.
pub fn acceptance_by_position(
    target: &Model,
    head: &mut MtpHead,
    heldout: &Features,
    k: usize,
) -> Result<HeadScore, TrainError> {
    let seqs = &heldout.sequences;
    // Pairs (h_t, x_{t+1}) exist for t < pairs[n].
    let pairs: Vec<usize> = (0..seqs.len())
        .map(|n| heldout.lens[n].min(seqs[n].len()).saturating_sub(1))
        .collect();
    for (n, seq) in seqs.iter().enumerate() {
        head.admit(n as u32, seq.len() + k)?;
    }
    let result = (|| -> Result<HeadScore, TrainError> {
        let mut hits = vec![0usize; k];
        let mut trials = 0usize;
        // Drafts accepted from each position an engine may draft from
        // (the answer's first token on), per sequence, in order.
        let mut depths = vec![Vec::new(); seqs.len()];
        for t in 0..pairs.iter().copied().max().unwrap_or(0) {
            let live: Vec<usize> = (0..seqs.len()).filter(|&n| t < pairs[n]).collect();
            let mut batch = Batch::default();
            let mut hidden = Vec::with_capacity(live.len());
            for &n in &live {
                batch.push(n as u32, t, &[seqs[n][t + 1]], OutputRows::Last);
                hidden.push(heldout.hidden.get(n)?.narrow(0, t, 1)?);
            }
            let hidden = Tensor::cat(&hidden, 0)?.to_device(target.device())?;
            let logits = head.step_logits(target, &batch, Some(&hidden))?;
            // Draft only where the next k tokens are the target's greedy output.
            let evaluable =
                |n: usize| t + 2 >= heldout.prompt_lens[n] && t + 1 + k < heldout.lens[n];
            let rows: Vec<usize> = (0..live.len()).filter(|&r| evaluable(live[r])).collect();
            trials += rows.len();
            let mut members: Vec<usize> = rows.iter().map(|&r| live[r]).collect();
            // The walk starts at the answer's first token.
            let walks = |n: usize| t + 1 >= heldout.prompt_lens[n];
            for &n in members.iter().filter(|&&n| walks(n)) {
                depths[n].push(0);
            }
            let mut drafts = logits.argmax(&rows)?;
            for (r, hit) in hits.iter_mut().enumerate() {
                let (kept, kept_drafts): (Vec<usize>, Vec<u32>) = members
                    .iter()
                    .zip(&drafts)
                    .filter(|&(&n, &d)| d == seqs[n][t + 2 + r])
                    .unzip();
                *hit += kept.len();
                for &n in kept.iter().filter(|&&n| walks(n)) {
                    *depths[n].last_mut().expect("pushed above") += 1;
                }
                if kept.is_empty() || r + 1 == k {
                    break;
                }
                let mut batch = Batch::default();
                for (&n, &d) in kept.iter().zip(&kept_drafts) {
                    batch.push(n as u32, t + 1 + r, &[d], OutputRows::Last);
                }
                let all: Vec<usize> = (0..kept.len()).collect();
                drafts = head.step_logits(target, &batch, None)?.argmax(&all)?;
                members = kept;
            }
            for &n in &live {
                head.truncate(n as u32, t + 1)?;
            }
        }
        let mut walk = Walk::default();
        for d in &depths {
            walk.add_sequence(d);
        }
        Ok(HeadScore {
            by_position: hits
                .iter()
                .map(|&h| h as f64 / trials.max(1) as f64)
                .collect(),
            walk,
        })
    })();
    for n in 0..seqs.len() {
        head.release(n as u32);
    }
    result
}

/// The `n` most frequent of `labels` (ties: the lower id), as a draft
/// vocabulary: sorted ids, `min(n, vocab)` of them (unseen ids fill up in
/// id order when fewer than `n` are seen).
pub fn top_labels(labels: &[u32], vocab: usize, n: usize) -> Vec<u32> {
    let mut counts = vec![0u64; vocab];
    for &l in labels {
        if let Some(c) = counts.get_mut(l as usize) {
            *c += 1;
        }
    }
    let mut ids: Vec<u32> = (0..vocab as u32).collect();
    ids.sort_by_key(|&i| (std::cmp::Reverse(counts[i as usize]), i));
    ids.truncate(n.min(vocab));
    ids.sort_unstable();
    ids
}

/// Fraction of `labels` inside the sorted draft vocabulary `ids`.
pub fn coverage(labels: &[u32], ids: &[u32]) -> f64 {
    let hit = labels
        .iter()
        .filter(|l| ids.binary_search(l).is_ok())
        .count();
    hit as f64 / labels.len().max(1) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_labels_keeps_the_most_frequent_sorted() {
        let labels = [5, 5, 5, 9, 9, 1, 7, 7, 7, 7];
        assert_eq!(top_labels(&labels, 10, 3), vec![5, 7, 9]);
        // A tie (1 and nothing else seen) goes to the lower unseen id.
        assert_eq!(top_labels(&labels, 10, 5), vec![0, 1, 5, 7, 9]);
        assert_eq!(top_labels(&labels, 4, 9), vec![0, 1, 2, 3]);
        assert!((coverage(&labels, &[5, 7]) - 0.7).abs() < 1e-12);
    }
}
