//! Attention for a whole batch in a fixed number of ops, over pooled KV.
//!
//! On a GPU each op is a kernel launch, and launching the per-sequence
//! attention of [`super::candle_step`] B times per layer costs more than the
//! arithmetic at decode batch sizes. With pooled KV storage
//! ([`KvCache::pooled`]) every slot's rows live in one buffer per layer,
//! so the batch's new K/V rows are written with one scatter and every
//! sequence's keys are read with one gather; the sequences are padded to
//! the longest (queries and keys) and a mask hides the padding. The plan
//! (indices and mask) is built once per forward pass on the host and
//! shared by all layers.
//!
//! Padding costs arithmetic, so when the sequences differ a lot in length
//! (a long prefill chunk next to decodes) only the shorter ones form the
//! padded group and each longer one is attended on its own (the
//! per-sequence path of [`super::candle_step`]); their outputs are put back in
//! batch order with one gather.

use candle_core::{DType, Device, Tensor};

use super::{ModelConfig, ModelError, SeqSpan};
use crate::kv::KvCache;

/// Largest padded score matrix (elements, all sequences and KV heads'
/// groups) the batched path builds a mask for.
const MAX_MASK_ELEMENTS: usize = 1 << 24;

/// The per-pass part of batched attention: indices and mask (built on the
/// host once per forward pass, shared by every layer).
pub(super) struct BatchedAttention {
    seqs: usize,
    max_queries: usize,
    keys: usize,
    /// Rows of the batch's `q`/`k`/`v` that belong to the group, when the
    /// group is not the whole batch.
    group_rows: Option<Tensor>,
    /// `[group tokens, kv_heads·head_dim]` u32: the pool row of each of the
    /// group's new tokens, repeated along the row (scatter indices).
    write_rows: Tensor,
    /// `[seqs·keys]` u32: pool rows gathered per sequence (padding repeats
    /// the sequence's first row, which the mask hides).
    key_rows: Tensor,
    /// `[seqs, 1, max_queries·group, keys]` additive mask, compute dtype;
    /// `None` when no real query has a key to hide (sequences of one
    /// length decoding together): padding queries then see every key,
    /// harmlessly, as their rows are dropped.
    mask: Option<Tensor>,
    /// For ragged groups: rows of `q` (with one zero row appended at index
    /// `n`) that make the padded queries, and the padded output rows that
    /// hold real tokens.
    padding: Option<(Tensor, Tensor)>,
    /// The sequences attended one by one: (span, first row in the batch).
    singles: Vec<(SeqSpan, usize)>,
    /// With singles: for each batch row, its row in the group's output
    /// followed by the singles' outputs.
    order: Option<Tensor>,
}

impl BatchedAttention {
    /// The plan for a batch of `n` tokens whose sequences are `spans`
    /// (each with its first row), or `None` when the cache is not pooled or
    /// no two sequences are worth padding together.
    pub(super) fn plan(
        spans: &[(SeqSpan, usize)],
        n: usize,
        kv: &KvCache,
        cfg: &ModelConfig,
        dtype: DType,
        device: &Device,
    ) -> Result<Option<Self>, ModelError> {
        if !kv.is_pooled() || spans.len() < 2 {
            return Ok(None);
        }
        let Some((in_group, keys)) = choose_group(spans, cfg) else {
            return Ok(None); // one sequence attends over its own range more cheaply
        };
        let group: Vec<usize> = (0..spans.len()).filter(|&i| in_group[i]).collect();
        let t = GroupTables::build(spans, &group, keys, n, kv, cfg)?;
        let singles: Vec<(SeqSpan, usize)> = (0..spans.len())
            .filter(|&i| !in_group[i])
            .map(|i| spans[i])
            .collect();
        let group_tokens = t.group_rows.len();
        let order = (!singles.is_empty()).then(|| batch_order(&t.group_rows, &singles, n));
        let write_rows = pool_write_rows(
            group.iter().map(|&i| &spans[i].0),
            kv,
            cfg,
            group_tokens,
            device,
        )?;
        let (seqs, max_queries) = (group.len(), t.max_queries);
        let padding = if seqs * max_queries == group_tokens && singles.is_empty() {
            None
        } else {
            Some((
                Tensor::new(t.q_rows.as_slice(), device)?,
                Tensor::new(t.out_rows.as_slice(), device)?,
            ))
        };
        let mask_shape = (seqs, 1, max_queries * cfg.group_size(), keys);
        Ok(Some(Self {
            seqs,
            max_queries,
            keys,
            group_rows: match singles.is_empty() {
                true => None,
                false => Some(Tensor::new(t.group_rows.as_slice(), device)?),
            },
            write_rows,
            key_rows: Tensor::new(t.key_rows.as_slice(), device)?,
            mask: match t.any_hidden {
                true => Some(Tensor::from_vec(t.mask, mask_shape, device)?.to_dtype(dtype)?),
                false => None,
            },
            padding,
            singles,
            order: order
                .map(|o| Tensor::new(o.as_slice(), device))
                .transpose()?,
        }))
    }

    /// The sequences to attend one by one, with their first batch row.
    pub(super) fn singles(&self) -> &[(SeqSpan, usize)] {
        &self.singles
    }

    /// Puts `[group output; singles' outputs in order]` back in batch order.
    pub(super) fn reorder(&self, parts: &[Tensor]) -> Result<Tensor, ModelError> {
        match &self.order {
            Some(order) => Ok(Tensor::cat(parts, 0)?.index_select(order, 0)?),
            None => Ok(parts[0].clone()),
        }
    }

    /// Writes layer `layer`'s new K/V of the group (from the batch's `[n,
    /// kv_heads, head_dim]`) into the pool and returns the group's attention
    /// output `[group tokens, heads·head_dim]` (group order) for the queries
    /// `q` (`[n, heads, head_dim]`, RoPE applied and scaled).
    pub(super) fn forward(
        &self,
        cfg: &ModelConfig,
        kv: &KvCache,
        layer: usize,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<Tensor, ModelError> {
        let (nh, nkv, hd, g) = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.group_size(),
        );
        let (b, mq, keys) = (self.seqs, self.max_queries, self.keys);
        let (k_pool, v_pool) =
            write_pool(kv, layer, &self.write_rows, self.group_rows.as_ref(), k, v)?;
        let q = match &self.padding {
            Some((q_rows, _)) => {
                let zero = Tensor::zeros((1, nh, hd), q.dtype(), q.device())?;
                Tensor::cat(&[q, &zero], 0)?.index_select(q_rows, 0)?
            }
            None => q.clone(),
        };
        let q = q
            .reshape((b, mq, nkv, g, hd))?
            .permute((0, 2, 1, 3, 4))?
            .contiguous()?
            .reshape((b, nkv, mq * g, hd))?;
        let kt = k_pool
            .index_select(&self.key_rows, 0)?
            .reshape((b, keys, nkv, hd))?
            .permute((0, 2, 3, 1))?
            .contiguous()?; // [b, kv_heads, head_dim, keys]
        let vt = v_pool
            .index_select(&self.key_rows, 0)?
            .reshape((b, keys, nkv, hd))?
            .permute((0, 2, 1, 3))?
            .contiguous()?; // [b, kv_heads, keys, head_dim]
        let mut scores = q.matmul(&kt)?;
        if let Some(mask) = &self.mask {
            scores = scores.broadcast_add(mask)?;
        }
        let probs = candle_nn::ops::softmax_last_dim(&scores)?;
        let out = probs
            .matmul(&vt)?
            .reshape((b, nkv, mq, g, hd))?
            .permute((0, 2, 1, 3, 4))?
            .contiguous()?
            .reshape((b * mq, nh * hd))?;
        Ok(match &self.padding {
            Some((_, out_rows)) => out.index_select(out_rows, 0)?,
            None => out,
        })
    }
}

/// The padded group: the most sequences, shortest first, whose padding at
/// most doubles their tokens and whose mask stays small. Returns which
/// spans belong to it and the keys each of its sequences is padded to, or
/// `None` when fewer than two qualify.
fn choose_group(spans: &[(SeqSpan, usize)], cfg: &ModelConfig) -> Option<(Vec<bool>, usize)> {
    let g = cfg.group_size();
    let mut by_len: Vec<usize> = (0..spans.len()).collect();
    by_len.sort_by_key(|&i| spans[i].0.len);
    let (mut size, mut tokens, mut keys) = (0, 0, 0);
    let (mut best, mut best_keys) = (0, 0);
    for &i in &by_len {
        let s = &spans[i].0;
        size += 1;
        tokens += s.len;
        keys = keys.max(s.offset + s.len);
        if size * s.len <= 2 * tokens && size * s.len * g * keys <= MAX_MASK_ELEMENTS {
            (best, best_keys) = (size, keys);
        }
    }
    if best < 2 {
        return None;
    }
    let mut in_group = vec![false; spans.len()];
    for &i in &by_len[..best] {
        in_group[i] = true;
    }
    Some((in_group, best_keys))
}

/// The group's host-side index tables and mask, before they become tensors.
struct GroupTables {
    max_queries: usize,
    /// Batch rows of the group's tokens, in group order.
    group_rows: Vec<u32>,
    /// `[seqs·keys]` pool rows gathered per sequence.
    key_rows: Vec<u32>,
    /// `[seqs · max_queries · group · keys]` additive mask.
    mask: Vec<f32>,
    /// Whether the mask hides any key from a real query.
    any_hidden: bool,
    /// Per padded query: its batch row, or `n` (the zero row) for padding.
    q_rows: Vec<u32>,
    /// Padded output rows that hold real tokens.
    out_rows: Vec<u32>,
}

impl GroupTables {
    /// The tables for the `group` (indices into `spans`, batch order),
    /// every sequence padded to the longest's queries and to `keys` keys.
    fn build(
        spans: &[(SeqSpan, usize)],
        group: &[usize],
        keys: usize,
        n: usize,
        kv: &KvCache,
        cfg: &ModelConfig,
    ) -> Result<Self, ModelError> {
        let g = cfg.group_size();
        let seqs = group.len();
        let max_queries = group.iter().map(|&i| spans[i].0.len).max().unwrap_or(0);
        let group_tokens: usize = group.iter().map(|&i| spans[i].0.len).sum();
        let mut t = Self {
            max_queries,
            group_rows: Vec::with_capacity(group_tokens),
            key_rows: Vec::with_capacity(seqs * keys),
            mask: vec![f32::NEG_INFINITY; seqs * max_queries * g * keys],
            any_hidden: false,
            q_rows: Vec::with_capacity(seqs * max_queries),
            out_rows: Vec::with_capacity(group_tokens),
        };
        for (gi, &i) in group.iter().enumerate() {
            let (s, start) = &spans[i];
            let total = s.offset + s.len;
            t.group_rows
                .extend((*start..start + s.len).map(|r| r as u32));
            // Through the block table; padding keys read position 0.
            for c in 0..keys {
                t.key_rows
                    .push(kv.row(s.slot, if c < total { c } else { 0 })? as u32);
            }
            for j in 0..max_queries {
                t.unmask_query(cfg, gi, j, s, keys);
                if j < s.len {
                    t.q_rows.push((start + j) as u32);
                    t.out_rows.push((gi * max_queries + j) as u32);
                } else {
                    t.q_rows.push(n as u32);
                }
            }
        }
        Ok(t)
    }

    /// Opens the keys query `j` of group sequence `gi` (span `s`) sees, for
    /// each of its heads in the KV group.
    fn unmask_query(&mut self, cfg: &ModelConfig, gi: usize, j: usize, s: &SeqSpan, keys: usize) {
        let g = cfg.group_size();
        let pos = s.offset + j;
        for h in 0..g {
            let row = &mut self.mask[((gi * self.max_queries + j) * g + h) * keys..][..keys];
            if j >= s.len {
                row[0] = 0.0; // padding query: any finite row will do
                continue;
            }
            let first = match cfg.sliding_window {
                Some(w) if pos + 1 > w => pos + 1 - w,
                _ => 0,
            };
            row[first..=pos].fill(0.0);
            self.any_hidden |= first > 0 || pos + 1 < keys;
        }
    }
}

/// For each of the `n` batch rows, its row in `[group output; singles'
/// outputs in order]`.
fn batch_order(group_rows: &[u32], singles: &[(SeqSpan, usize)], n: usize) -> Vec<u32> {
    let mut order = vec![0u32; n];
    for (k, &r) in group_rows.iter().enumerate() {
        order[r as usize] = k as u32;
    }
    let mut at = group_rows.len();
    for (s, start) in singles {
        for j in 0..s.len {
            order[start + j] = (at + j) as u32;
        }
        at += s.len;
    }
    order
}

/// Scatter indices `[tokens, kv_heads·head_dim]` (u32) of the new K/V rows
/// of `seqs` (in order, `tokens` in all) in the pool: each token's row,
/// repeated along the row.
fn pool_write_rows<'a>(
    seqs: impl Iterator<Item = &'a SeqSpan>,
    kv: &KvCache,
    cfg: &ModelConfig,
    tokens: usize,
    device: &Device,
) -> Result<Tensor, ModelError> {
    let mut rows = Vec::with_capacity(tokens);
    for s in seqs {
        for pos in s.offset..s.offset + s.len {
            rows.push(kv.row(s.slot, pos)? as u32);
        }
    }
    let width = cfg.num_kv_heads * cfg.head_dim;
    Ok(Tensor::new(rows.as_slice(), device)?
        .reshape((tokens, 1))?
        .broadcast_as((tokens, width))?
        .contiguous()?)
}

/// Writes new K/V rows (`[n, kv_heads, head_dim]`; only the rows
/// `selected`, when given) into layer `layer`'s pool at `write_rows`;
/// returns the pool's (K, V) buffers.
fn write_pool<'a>(
    kv: &'a KvCache,
    layer: usize,
    write_rows: &Tensor,
    selected: Option<&Tensor>,
    k: &Tensor,
    v: &Tensor,
) -> Result<(&'a Tensor, &'a Tensor), ModelError> {
    kv.token_major_keys()?;
    let (k_pool, v_pool) = kv
        .pool_layer(layer)
        .ok_or_else(|| ModelError::InvalidBatch("KV pool has no such layer".into()))?;
    let (rows, heads, dim) = k_pool.dims3()?;
    for (pool, new) in [(k_pool, k), (v_pool, v)] {
        let new = match selected {
            Some(r) => new.index_select(r, 0)?,
            None => new.clone(),
        };
        let width = (new.dim(0)?, heads * dim);
        pool.reshape((rows, heads * dim))?
            .scatter_set(write_rows, &new.reshape(width)?, 0)?;
    }
    Ok((k_pool, v_pool))
}
