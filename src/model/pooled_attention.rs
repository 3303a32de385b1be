//! Attention over pooled KV in one kernel launch per layer for a decode or
//! verifying pass and two for others (CUDA builds), straight from the
//! fused q/k/v projection.
//!
//! Tandem's own kernels (`cuda/attention.cu`, compiled to PTX by
//! `build.rs`): one writes the batch's new K rows (rotated by RoPE on the
//! way) and V rows into the pools; the second runs one thread block per
//! query token, query head and *split* of the token's keys (split-K, as
//! flash-decoding does), rotates and scales the token's q as it loads it,
//! and reads its keys and values straight from the layer's pool through its
//! sequence's block table: no gather, no padding, no mask, whatever mix of
//! decodes, draft verifications and prefill chunks the batch holds; the
//! last of a query's splits to finish merges them (an arrival count per
//! query and head, which that block resets to zero). Where a KV head has a
//! multiple of four query heads and the launch is large, one block attends
//! four of them (the grouped kernel), each head's sums in the same order;
//! where those grouped blocks alone fill the GPU (a decode or verifying
//! launch past [`serial_threshold`]), each runs all its query's splits
//! itself, one after the other, and merges them in shared memory (the
//! same sums and merge, no arrival). A query's split count is a function
//! of its own key count alone ([`key_splits`]), and the merge adds the
//! splits in order whichever block runs it, so a single decoding
//! sequence fills the GPU and its sums still never depend on the rest of
//! the batch. All read the `[n, (heads + 2·kv_heads)·head_dim]` projection
//! rows as they are, so the q/k/v split copies and the RoPE launches of
//! the candle path do not exist here: two launches per layer instead of
//! the dozen of [`super::batched_attention`] (which stays the path of
//! other devices). candle's own scatter could do the write, but it walks
//! a batch's rows one after the other. When every sequence has at most
//! [`OWN_ROWS`] rows in the pass ([`PooledAttention::own_rows`]: a decode
//! pass, or a draft verification), a query's new keys are its own and
//! those of its sequence's rows before it, which it reads from their
//! projection rows (rotated and rounded as the pool holds them), so the
//! attention launch writes the rows into the pool itself: one launch. A
//! key's bits are the same whichever kernel wrote it.
//!
//! The per-pass plan (per query token: where its sequence's block table
//! starts and its visible positions; the tables themselves) is built on
//! the host once per forward pass, uploaded once, and shared by every
//! layer. Position `p` of a sequence is pool row `table[p / block_size] ·
//! block_size + p % block_size`, as in [`KvCache::row`]; the kernels take
//! power-of-two block sizes (the default 16 is one), others go through
//! [`super::batched_attention`].

use std::sync::OnceLock;

use candle_core::{Device, Tensor};

use super::{Batch, ModelConfig, ModelError};
use crate::kv::KvCache;

/// Shared memory one block may use (q, a score per key, reduction
/// scratch). 96 KiB is available to opted-in kernels on every GPU since
/// Ampere: about 24 000 keys.
const SHARED_BYTES: usize = 96 * 1024;

/// Warps per attention block (the kernel's block is 32 × this threads;
/// its `__launch_bounds__` assume 128).
const WARPS: usize = 4;
/// Largest head dimension the kernel covers (two 16-byte packs per lane),
/// which must be a multiple of 8 (whole packs in every dtype).
const MAX_HEAD_DIM: usize = 256;

/// The most rows of one sequence a pass may hold for its attention launch
/// to write their K and V itself (a decode token and up to eight drafts:
/// the decode graphs' longest span).
pub(super) const OWN_ROWS: usize = 9;

/// The most splits of one query's keys (the kernel's `MAX_SPLITS`: split-K
/// attention, see `cuda/attention.cu`).
const MAX_SPLITS: usize = 16;

/// Whether a decode or verifying pass's attention launch asks L2 for a
/// split's key and value rows before it reads them: at one sequence a
/// split otherwise waits on memory four times in a row (H100: SmolLM2's
/// shape +4–6.5 % at B = 1 and +1–3 % at B = 64, the 1B model 0–1.4 % and
/// 0–2 %; the real model's speculative runs +0.5–3 %; BENCHMARKS.md).
/// `TANDEM_ATTENTION_PREFETCH=0`: not (an A/B switch read once per
/// process).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn prefetch_rows() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    switched_on(&ON, "TANDEM_ATTENTION_PREFETCH")
}

/// An A/B switch read once per process into `cell`: on unless `var` is `0`.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn switched_on(cell: &OnceLock<bool>, var: &str) -> bool {
    *cell.get_or_init(|| std::env::var(var).map_or(true, |v| v != "0"))
}

/// Shared bytes a split's key and value rows may take when a decode or
/// verifying pass's attention copies them into shared memory at once
/// ([`stage_bytes`]); past it, they are read from global memory.
const STAGE_BYTES: usize = 32 * 1024;

/// Whether a decode or verifying pass's attention launch of at most one
/// block per multiprocessor has each block copy its split's key and value
/// rows into shared memory first thing, all in flight at once: one wait on
/// memory where the loops over keys and values otherwise wait at every
/// other round of 16 keys, and nothing else on the multiprocessor hides
/// those waits (with the one-wait merge, on an H100: SmolLM2's shape
/// +3.0 % at B = 1, the 1B model +3.5 %; earlier versions on an H200 and
/// an H100, +5-6 % and +1-2.6 %; staging every decode launch cost
/// 2-2.5 % at B = 64, where other blocks hide the waits and the shared
/// memory it takes leaves room for fewer blocks; BENCHMARKS.md).
/// `TANDEM_ATTENTION_STAGE=0`: never (an A/B switch read once per process).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn stage_rows() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    switched_on(&ON, "TANDEM_ATTENTION_STAGE")
}

/// The shared bytes a split of a pass over queries of at most `max_keys`
/// keys takes to copy its key and value rows (elements of `elem` bytes),
/// or 0 where it cannot: prompt passes (their rows share keys, read from
/// L2 after the first), splits past [`STAGE_BYTES`], or staging switched
/// off. Whether a launch stages is decided at its size ([`stage_rows`]);
/// no result depends on it.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn stage_bytes(cfg: &ModelConfig, max_keys: usize, own_rows: usize, elem: usize) -> usize {
    let bytes = 2 * split_bound(max_keys) * cfg.head_dim * elem;
    if own_rows > 0 && bytes <= STAGE_BYTES && stage_rows() {
        bytes
    } else {
        0
    }
}

/// Keys per split below `MAX_SPLITS` splits: 64, or
/// `TANDEM_ATTENTION_SPLIT_KEYS` (16–4096; a tuning knob read once per
/// process, so every launch splits alike).
fn split_keys() -> usize {
    static KEYS: OnceLock<usize> = OnceLock::new();
    *KEYS.get_or_init(|| {
        std::env::var("TANDEM_ATTENTION_SPLIT_KEYS")
            .ok()
            .and_then(|v| v.parse().ok())
            .map_or(64, |k: usize| k.clamp(16, 4096))
    })
}

/// How many blocks split the keys of a query that sees `keys` keys: a
/// function of that count alone, so a query's sums never depend on the
/// rest of the batch.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn key_splits(keys: usize) -> usize {
    keys.div_ceil(split_keys()).clamp(1, MAX_SPLITS)
}

/// The most keys one split of any query with at most `keys` keys holds.
fn split_bound(keys: usize) -> usize {
    let per_split = split_keys();
    if keys <= per_split * MAX_SPLITS {
        keys.min(per_split)
    } else {
        keys.div_ceil(MAX_SPLITS)
    }
}

/// Shared bytes a block of `group` query heads needs for a split of at
/// most `keys` keys in blocks of `block_size`: each head's query, reduction
/// scratch, one partial output row per warp and head, one score per key and
/// head and the table entries the keys span; then, 16-byte aligned, the K
/// and V of up to `own_rows` rows read from the projection (f32 at most).
fn shared_bytes(
    cfg: &ModelConfig,
    keys: usize,
    block_size: usize,
    own_rows: usize,
    group: usize,
) -> usize {
    let own = match own_rows {
        0 => 0,
        rows => 16 + 4 * 2 * rows * cfg.head_dim,
    };
    let per_head = cfg.head_dim + WARPS * cfg.head_dim + keys;
    4 * (group * per_head + 32 + keys / block_size + 2) + own
}

/// Query heads a grouped attention block attends (the kernel's grouped
/// instantiation: `G = 4`, one 16-byte pack of a head per lane).
const GROUP: usize = 4;

/// Whether a launch of many blocks may run the grouped kernel: the query
/// heads of a KV head in one block, each key's row address and loads
/// shared by them (the same sums per head, so no result depends on it).
/// `TANDEM_ATTENTION_GROUP=0`: never (an A/B switch read once per process).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn group_heads() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    switched_on(&ON, "TANDEM_ATTENTION_GROUP")
}

/// The shared bytes of a grouped block for `plan`'s pass, or 0 where the
/// grouped kernel does not apply: query heads per KV head not a multiple of
/// [`GROUP`] (over SmolLM2's 3 the kernel computes a fourth head for
/// nothing: 0.90x at B = 16 and 0.98x at 64 on an H100, BENCHMARKS.md), a head
/// wider than a lane's pack times 32, more shared memory than a block may
/// take, or grouping switched off. Whether a launch groups is decided at
/// its size (the grouped grid still fills the multiprocessors).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn grouped_bytes(cfg: &ModelConfig, plan: &PooledAttention, elem: usize) -> usize {
    let per_kv = cfg.num_heads / cfg.num_kv_heads.max(1);
    let pack = 16 / elem;
    let bytes = shared_bytes(
        cfg,
        split_bound(plan.max_keys),
        1 << plan.block_shift,
        plan.own_rows,
        GROUP,
    );
    if per_kv.is_multiple_of(GROUP)
        && cfg.head_dim <= 32 * pack
        && bytes <= SHARED_BYTES
        && group_heads()
    {
        bytes
    } else {
        0
    }
}

/// How many blocks per multiprocessor a grouped decode or verifying
/// launch's (query, head group) blocks must reach for each of them to run
/// all its query's splits itself, one after the other (the kernel's
/// `SERIAL`: the split grid's sums and merge, without its per-split setup,
/// partial rows in global memory and arrival round trip; where those
/// blocks alone fill the GPU, the split grid only multiplies them). H100,
/// 1B shape at B = 64: 1.10x; ungrouped over SmolLM2's shape it read 0.97x
/// at B = 64 (BENCHMARKS.md), so ungrouped launches keep the split grid.
/// `TANDEM_ATTENTION_SERIAL`: the threshold (read once per process; 0:
/// never).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn serial_threshold() -> usize {
    static BLOCKS: OnceLock<usize> = OnceLock::new();
    *BLOCKS.get_or_init(|| {
        std::env::var("TANDEM_ATTENTION_SERIAL")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(2)
    })
}

/// The shared bytes of a serial grouped block for `plan`'s pass without
/// staged rows (a grouped split block's `grouped` bytes, the table entries
/// of all its query's keys and each head's partial row per split), or 0
/// where it may not run: no grouped kernel, or more than a block may take.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn serial_bytes(cfg: &ModelConfig, plan: &PooledAttention, grouped: usize) -> usize {
    let block_size = 1 << plan.block_shift;
    let table = plan.max_keys / block_size - split_bound(plan.max_keys) / block_size;
    let rows = GROUP * key_splits(plan.max_keys) * (cfg.head_dim + 2);
    let bytes = grouped + 4 * (table + rows);
    if grouped > 0 && bytes <= SHARED_BYTES {
        bytes
    } else {
        0
    }
}

/// The per-pass part: where each query token's keys are.
pub(super) struct PooledAttention {
    /// u32, `3·n` words then the batch's block tables: per query token, the
    /// offset in this tensor of its sequence's block table, its first
    /// visible position (sliding window) and its own position (the last it
    /// sees); then each sequence's table up to the block of its last
    /// position.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    meta: Tensor,
    /// log2 of the KV block size.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    block_shift: u32,
    /// Most keys any query sees (sizes the kernel's shared memory).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    max_keys: usize,
    /// u32 per (query token, head), zero between launches: how many of the
    /// query's splits have finished, so the last one merges them.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    arrivals: Tensor,
    /// Nonzero when every sequence has at most this many rows in the pass
    /// (at most [`OWN_ROWS`]): the attention launch then reads the pass's
    /// keys from the projection rows and writes the rows' K and V itself.
    /// Zero: a launch before it writes them (prompt chunks).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    own_rows: usize,
}

/// [`PooledAttention::own_rows`] for `batch`'s pass: its longest span,
/// or 0 past [`OWN_ROWS`].
fn own_rows(batch: &Batch) -> usize {
    let longest = batch.seqs.iter().map(|s| s.len).max().unwrap_or(0);
    if longest <= OWN_ROWS {
        longest.max(1)
    } else {
        0
    }
}

/// The zeroed arrival counts of `rows` query tokens (see
/// [`PooledAttention::arrivals`]); one memset per pass, shared by every
/// layer, since each merge leaves its count at zero again.
fn arrivals(rows: usize, cfg: &ModelConfig, device: &Device) -> Result<Tensor, ModelError> {
    let len = rows.max(1) * cfg.num_heads;
    Ok(Tensor::zeros(len, candle_core::DType::U32, device)?)
}

/// Where each sequence's block table sits in the plan's metadata.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum TableLayout {
    /// Back to back, each up to the block of its sequence's last position.
    Packed,
    /// Sequence `i`'s at `3·n + i·blocks`, zero-padded to `blocks` entries,
    /// so a plan of the same rows and bound has the same length and layout
    /// whatever the positions (what a captured CUDA graph replays over).
    Fixed { blocks: usize },
}

/// The host side of a plan: the metadata words and the most keys a query sees.
pub(super) struct HostPlan {
    pub(super) meta: Vec<u32>,
    pub(super) max_keys: usize,
}

impl PooledAttention {
    /// The plan for `batch`, or `None` off CUDA, without pooled KV, for
    /// head shapes beyond the kernel's bounds or a block size that is not a
    /// power of two, or when some query sees more keys than a block's
    /// shared memory holds scores for.
    pub(super) fn plan(
        batch: &Batch,
        kv: &KvCache,
        cfg: &ModelConfig,
        device: &Device,
    ) -> Result<Option<Self>, ModelError> {
        if !Self::supports(kv, cfg, device) {
            return Ok(None);
        }
        let Some(host) = Self::host_plan(batch, kv, cfg, TableLayout::Packed)? else {
            return Ok(None);
        };
        let len = host.meta.len();
        Ok(Some(Self {
            meta: Tensor::from_vec(host.meta, len, device)?,
            block_shift: kv.block_size().trailing_zeros(),
            max_keys: host.max_keys,
            arrivals: arrivals(batch.tokens.len(), cfg, device)?,
            own_rows: own_rows(batch),
        }))
    }

    /// A plan for a pass of `rows` query tokens over metadata already on
    /// the device (`meta`, laid out by [`Self::host_plan`]), sized for
    /// queries of at most `max_keys` keys and sequences of at most
    /// `own_rows` rows (see [`PooledAttention::own_rows`]).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(super) fn over(
        meta: Tensor,
        kv: &KvCache,
        cfg: &ModelConfig,
        rows: usize,
        max_keys: usize,
        own_rows: usize,
    ) -> Result<Self, ModelError> {
        Ok(Self {
            arrivals: arrivals(rows, cfg, meta.device())?,
            meta,
            block_shift: kv.block_size().trailing_zeros(),
            max_keys,
            own_rows,
        })
    }

    /// Whether the kernels can attend over `kv` on `device` for `cfg`'s heads.
    pub(super) fn supports(kv: &KvCache, cfg: &ModelConfig, device: &Device) -> bool {
        let head_fits = cfg.head_dim <= MAX_HEAD_DIM && cfg.head_dim.is_multiple_of(8);
        device.is_cuda() && kv.is_pooled() && head_fits && kv.block_size().is_power_of_two()
    }

    /// Whether the splits of a query that sees `keys` keys fit a block's
    /// shared memory, beside the most rows a launch reads from the
    /// projection.
    pub(super) fn fits(cfg: &ModelConfig, keys: usize, block_size: usize) -> bool {
        shared_bytes(cfg, split_bound(keys), block_size, OWN_ROWS, 1) <= SHARED_BYTES
    }

    /// The metadata of `batch`'s queries (see [`PooledAttention::meta`]) in
    /// `layout`; `None` when a query sees more keys than fit (or, for a
    /// fixed layout, than its `blocks` cover).
    pub(super) fn host_plan(
        batch: &Batch,
        kv: &KvCache,
        cfg: &ModelConfig,
        layout: TableLayout,
    ) -> Result<Option<HostPlan>, ModelError> {
        let block_size = kv.block_size();
        let n = batch.tokens.len();
        let mut meta = vec![0u32; 3 * n];
        if let TableLayout::Fixed { blocks } = layout {
            meta.resize(3 * n + batch.seqs.len() * blocks, 0);
        }
        let mut max_keys = 0;
        let mut at = 0;
        for (i, s) in batch.seqs.iter().enumerate() {
            let end = s.offset + s.len;
            if s.len == 0 {
                continue;
            }
            // A typed error when the table does not reach the last position.
            kv.row(s.slot, end - 1)?;
            let used = end.div_ceil(block_size);
            let table = &kv.table(s.slot)?[..used];
            let table_at = match layout {
                TableLayout::Packed => {
                    meta.extend_from_slice(table);
                    meta.len() - used
                }
                TableLayout::Fixed { blocks } if used <= blocks => {
                    let start = 3 * n + i * blocks;
                    meta[start..start + used].copy_from_slice(table);
                    start
                }
                TableLayout::Fixed { .. } => return Ok(None),
            };
            let table_at = u32::try_from(table_at)
                .map_err(|_| ModelError::InvalidBatch("block tables past 2^32 words".into()))?;
            for pos in s.offset..end {
                let first = match cfg.sliding_window {
                    Some(w) if pos + 1 > w => pos + 1 - w,
                    _ => 0,
                };
                max_keys = max_keys.max(pos + 1 - first);
                meta[at] = table_at;
                meta[n + at] = first as u32;
                meta[2 * n + at] = pos as u32;
                at += 1;
            }
        }
        // `fits` only loosens as keys shrink: the longest query decides.
        if !Self::fits(cfg, max_keys, block_size) {
            return Ok(None);
        }
        Ok(Some(HostPlan { meta, max_keys }))
    }

    /// Writes layer `layer`'s new K (rotated) and V rows of `qkv` (the
    /// projection, `[n, (heads + 2·kv_heads)·head_dim]`, before RoPE) into
    /// the pool and returns the attention output `[n, heads·head_dim]` of
    /// its q rows, rotated by `rope` (`(cos, sin)`, `[positions,
    /// head_dim / 2]`) and scaled by `q_scale`.
    pub(super) fn forward(
        &self,
        cfg: &ModelConfig,
        kv: &KvCache,
        layer: usize,
        qkv: &Tensor,
        rope: (&Tensor, &Tensor),
        q_scale: f32,
    ) -> Result<Tensor, ModelError> {
        let (k_pool, v_pool) = kv
            .pool_layer(layer)
            .ok_or_else(|| ModelError::InvalidBatch("KV pool has no such layer".into()))?;
        let n = qkv.dim(0)?;
        let out = run_kernels(qkv, rope, q_scale, k_pool, v_pool, self, cfg)?;
        Ok(out.reshape((n, cfg.num_heads * cfg.head_dim))?)
    }
}

impl PooledAttention {
    /// Writes the pass's hidden rows (`[n, width]`, one per query token)
    /// into the KV cache's hidden `buffer` (`[pool rows, width]`) at each
    /// token's pool row, in one launch: inside a decode graph, the hidden
    /// states a draft head reads cost no host work a step.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(super) fn write_hidden(&self, buffer: &Tensor, hidden: &Tensor) -> Result<(), ModelError> {
        #[cfg(feature = "cuda")]
        {
            let op = kernel::HiddenWriteOp {
                meta: &self.meta,
                block_shift: self.block_shift,
            };
            buffer.inplace_op2(&hidden.contiguous()?, &op)?;
            Ok(())
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (buffer, hidden);
            Err(ModelError::InvalidBatch(
                "pooled hidden writes need a --features cuda build".into(),
            ))
        }
    }
}

#[cfg(feature = "cuda")]
fn run_kernels(
    qkv: &Tensor,
    (cos, sin): (&Tensor, &Tensor),
    q_scale: f32,
    k_pool: &Tensor,
    v_pool: &Tensor,
    plan: &PooledAttention,
    cfg: &ModelConfig,
) -> Result<Tensor, ModelError> {
    let qkv = qkv.contiguous()?;
    if plan.own_rows == 0 {
        let write = kernel::PoolWriteOp {
            meta: &plan.meta,
            cos,
            sin,
            heads: cfg.num_heads,
            block_shift: plan.block_shift,
        };
        k_pool.inplace_op3(v_pool, &qkv, &write)?;
    }
    let elem = qkv.dtype().size_in_bytes();
    let grouped_bytes = grouped_bytes(cfg, plan, elem);
    let op = kernel::PooledAttentionOp {
        meta: &plan.meta,
        cos,
        sin,
        q_scale,
        shared_bytes: shared_bytes(
            cfg,
            split_bound(plan.max_keys),
            1 << plan.block_shift,
            plan.own_rows,
            1,
        ),
        stage_bytes: stage_bytes(cfg, plan.max_keys, plan.own_rows, elem),
        grouped_bytes,
        serial_bytes: serial_bytes(cfg, plan, grouped_bytes),
        splits: key_splits(plan.max_keys),
        heads: cfg.num_heads,
        kv_heads: cfg.num_kv_heads,
        block_shift: plan.block_shift,
        arrivals: &plan.arrivals,
        own_rows: plan.own_rows,
    };
    Ok(qkv.apply_op3_no_bwd(k_pool, v_pool, &op)?)
}

#[cfg(not(feature = "cuda"))]
fn run_kernels(
    _: &Tensor,
    _: (&Tensor, &Tensor),
    _: f32,
    _: &Tensor,
    _: &Tensor,
    _: &PooledAttention,
    _: &ModelConfig,
) -> Result<Tensor, ModelError> {
    Err(ModelError::InvalidBatch(
        "pooled attention kernels need a --features cuda build".into(),
    ))
}

#[cfg(feature = "cuda")]
mod kernel {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{
        CudaView, CudaViewMut, DeviceRepr, LaunchConfig, PushKernelArg,
    };
    use candle_core::cuda_backend::{CudaDType, WrapErr};
    use candle_core::{
        CudaStorage, CustomOp3, DType, InplaceOp2, InplaceOp3, Layout, Shape, Tensor,
    };

    use super::super::cuda_view::with_view;

    const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/attention.ptx"));
    /// Threads per attention block.
    const THREADS: u32 = 32 * super::WARPS as u32;

    /// `qkv.apply_op3_no_bwd(k_pool, v_pool, &PooledAttentionOp)`.
    pub(super) struct PooledAttentionOp<'a> {
        pub(super) meta: &'a Tensor,
        pub(super) cos: &'a Tensor,
        pub(super) sin: &'a Tensor,
        pub(super) q_scale: f32,
        pub(super) shared_bytes: usize,
        /// Splits of the query with the most keys (the grid's depth).
        pub(super) splits: usize,
        pub(super) heads: usize,
        pub(super) kv_heads: usize,
        pub(super) block_shift: u32,
        /// The plan's arrival counts: the last split of a query merges.
        pub(super) arrivals: &'a Tensor,
        /// The shared bytes a split takes to copy its key and value rows
        /// first, 0 where it may not ([`super::stage_bytes`]): a launch of
        /// at most one block per multiprocessor does.
        pub(super) stage_bytes: usize,
        /// The shared bytes of a grouped block, 0 where the grouped kernel
        /// may not run ([`super::grouped_bytes`]): a launch whose grouped
        /// grid has at least a block per multiprocessor does.
        pub(super) grouped_bytes: usize,
        /// The shared bytes of a serial grouped block before staging, 0
        /// where none may run ([`super::serial_bytes`]).
        pub(super) serial_bytes: usize,
        /// Nonzero: the launch reads the pass's keys from the projection
        /// rows of sequences of at most this many rows and writes the rows'
        /// K and V into the pools (through their storages' device
        /// pointers, as [`PoolWriteOp`] writes the V pool).
        pub(super) own_rows: usize,
    }

    /// The K (rotated) and V heads of the projection rows into a layer's
    /// two pools, in place, in one launch: `k_pool.inplace_op3(v_pool, qkv,
    /// &PoolWriteOp)`. candle's in-place ops take one mutable operand, so
    /// the V pool is written through its storage's device pointer; both
    /// pools are the KV cache's own, and every later reader of them runs on
    /// the same stream after this launch.
    pub(super) struct PoolWriteOp<'a> {
        pub(super) meta: &'a Tensor,
        pub(super) cos: &'a Tensor,
        pub(super) sin: &'a Tensor,
        pub(super) heads: usize,
        pub(super) block_shift: u32,
    }

    /// A pass's hidden rows into the KV cache's hidden buffer, in place:
    /// `buffer.inplace_op2(hidden, &HiddenWriteOp)`.
    pub(super) struct HiddenWriteOp<'a> {
        pub(super) meta: &'a Tensor,
        pub(super) block_shift: u32,
    }

    impl HiddenWriteOp<'_> {
        fn launch<T: CudaDType + DeviceRepr>(
            &self,
            name: &str,
            (buffer, bl): (&mut CudaStorage, &Layout),
            (hidden, hl): (&CudaStorage, &Layout),
        ) -> candle_core::Result<()> {
            let (_, width) = bl.shape().dims2()?;
            let (n, hidden_width) = hl.shape().dims2()?;
            if hidden_width != width || !bl.is_contiguous() {
                candle_core::bail!("hidden write: rows {:?} into {:?}", hl.shape(), bl.shape());
            }
            let dev = buffer.device().clone();
            let func = dev.get_or_load_custom_func(name, "tandem_pooled_attention", PTX)?;
            let hidden = view::<T>(hidden, hl)?;
            let mut buffer = written::<T>(buffer, bl)?;
            let args = [n, width, self.block_shift as usize].map(|x| x as u32);
            let cfg = per_element(n * width);
            with_view::<u32, _>(self.meta, "hidden write", |meta| {
                let mut b = func.builder();
                b.arg(&mut buffer);
                b.arg(&hidden);
                b.arg(&meta);
                for a in &args {
                    b.arg(a);
                }
                // SAFETY: argument types match the kernel; every row comes
                // from a block table the plan checked against the slot's,
                // inside the buffer of the pool's rows.
                unsafe { b.launch(cfg) }.w()?;
                Ok(())
            })
        }
    }

    impl InplaceOp2 for HiddenWriteOp<'_> {
        fn name(&self) -> &'static str {
            "hidden-write"
        }

        crate::cuda_only::cuda_only_cpu_fwd!(InplaceOp2);

        fn cuda_fwd(
            &self,
            buffer: &mut CudaStorage,
            bl: &Layout,
            hidden: &CudaStorage,
            hl: &Layout,
        ) -> candle_core::Result<()> {
            let args = ((buffer, bl), (hidden, hl));
            match hidden.dtype() {
                DType::F32 => self.launch::<f32>("hidden_write_f32", args.0, args.1),
                DType::F16 => self.launch::<half::f16>("hidden_write_f16", args.0, args.1),
                DType::BF16 => self.launch::<half::bf16>("hidden_write_bf16", args.0, args.1),
                other => candle_core::bail!("hidden write has no {other:?} kernel"),
            }
        }
    }

    /// The mutable operand of an in-place op (contiguous, checked by the
    /// caller) from its layout's offset on.
    fn written<'a, T: CudaDType + DeviceRepr>(
        storage: &'a mut CudaStorage,
        layout: &Layout,
    ) -> candle_core::Result<CudaViewMut<'a, T>> {
        let start = layout.start_offset();
        Ok(storage.as_cuda_slice_mut::<T>()?.slice_mut(start..))
    }

    /// A grid-stride launch over `total` elements, 256 threads a block.
    fn per_element(total: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (total.div_ceil(256).clamp(1, 65_535) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// A device slice of a storage at its layout's offset.
    fn view<'a, T: CudaDType + DeviceRepr>(
        storage: &'a CudaStorage,
        layout: &Layout,
    ) -> candle_core::Result<CudaView<'a, T>> {
        super::super::cuda_view::contiguous(storage, layout, "pooled attention")
    }

    /// Runs `f` with device views of the captured tensors (meta as u32, the
    /// RoPE tables as `T`).
    fn with_tables<T: CudaDType + DeviceRepr, R>(
        meta: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        f: impl FnOnce(CudaView<'_, u32>, CudaView<'_, T>, CudaView<'_, T>) -> candle_core::Result<R>,
    ) -> candle_core::Result<R> {
        let op = "pooled attention";
        with_view(meta, op, |meta| {
            with_view(cos, op, |cos| with_view(sin, op, |sin| f(meta, cos, sin)))
        })
    }

    impl PoolWriteOp<'_> {
        fn launch<T: CudaDType + DeviceRepr>(
            &self,
            name: &str,
            (k_pool, kl): (&mut CudaStorage, &Layout),
            (v_pool, vl): (&CudaStorage, &Layout),
            (qkv, ql): (&CudaStorage, &Layout),
        ) -> candle_core::Result<()> {
            let (_, kv_heads, head_dim) = kl.shape().dims3()?;
            let (n, width) = ql.shape().dims2()?;
            let pools_match = kl.shape() == vl.shape() && kl.is_contiguous();
            if width != (self.heads + 2 * kv_heads) * head_dim || !pools_match {
                candle_core::bail!(
                    "pool write: projection rows {:?} into pools {:?} and {:?}",
                    ql.shape(),
                    kl.shape(),
                    vl.shape()
                );
            }
            let dev = k_pool.device().clone();
            let func = dev.get_or_load_custom_func(name, "tandem_pooled_attention", PTX)?;
            let qkv = view::<T>(qkv, ql)?;
            let v_pool = view::<T>(v_pool, vl)?;
            let mut k_pool = written::<T>(k_pool, kl)?;
            let args =
                [n, self.heads, kv_heads, head_dim, self.block_shift as usize].map(|x| x as u32);
            let cfg = per_element(n * kv_heads * head_dim);
            with_tables::<T, _>(self.meta, self.cos, self.sin, |meta, cos, sin| {
                let mut b = func.builder();
                b.arg(&mut k_pool);
                b.arg(&v_pool);
                b.arg(&qkv);
                b.arg(&meta);
                b.arg(&cos);
                b.arg(&sin);
                for a in &args {
                    b.arg(a);
                }
                // SAFETY: argument types match the kernel; every row comes
                // from a block table the plan checked against the slot's,
                // in pools of one shape.
                unsafe { b.launch(cfg) }.w()?;
                Ok(())
            })
        }
    }

    impl InplaceOp3 for PoolWriteOp<'_> {
        fn name(&self) -> &'static str {
            "pool-write"
        }

        crate::cuda_only::cuda_only_cpu_fwd!(InplaceOp3);

        fn cuda_fwd(
            &self,
            k_pool: &mut CudaStorage,
            kl: &Layout,
            v_pool: &CudaStorage,
            vl: &Layout,
            qkv: &CudaStorage,
            ql: &Layout,
        ) -> candle_core::Result<()> {
            let args = ((k_pool, kl), (v_pool, vl), (qkv, ql));
            match qkv.dtype() {
                DType::F32 => self.launch::<f32>("pooled_write_f32", args.0, args.1, args.2),
                DType::F16 => self.launch::<half::f16>("pooled_write_f16", args.0, args.1, args.2),
                DType::BF16 => {
                    self.launch::<half::bf16>("pooled_write_bf16", args.0, args.1, args.2)
                }
                other => candle_core::bail!("pool write has no {other:?} kernel"),
            }
        }
    }

    /// The multiprocessors of `dev`'s GPU (asked once per process: one GPU).
    fn multiprocessors(dev: &candle_core::cuda_backend::CudaDevice) -> candle_core::Result<usize> {
        use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute as Attr;
        static COUNT: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
        if let Some(&count) = COUNT.get() {
            return Ok(count);
        }
        let stream = dev.cuda_stream();
        let count = stream
            .context()
            .attribute(Attr::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .w()?;
        Ok(*COUNT.get_or_init(|| count.max(1) as usize))
    }

    impl PooledAttentionOp<'_> {
        fn launch<T: CudaDType + DeviceRepr>(
            &self,
            suffix: &str,
            (qkv, ql): (&CudaStorage, &Layout),
            (k, kl): (&CudaStorage, &Layout),
            (v, vl): (&CudaStorage, &Layout),
        ) -> candle_core::Result<(CudaStorage, Shape)> {
            let dev = qkv.device().clone();
            let (n, _) = ql.shape().dims2()?;
            let (_, kv_heads, head_dim) = kl.shape().dims3()?;
            let heads = self.heads;
            // A lane reads 16-byte packs: `pack` elements of a head.
            let pack = 16 / std::mem::size_of::<T>();
            if [kl, vl]
                .iter()
                .any(|l| !l.start_offset().is_multiple_of(pack))
            {
                candle_core::bail!("pooled attention: pool views off a 16-byte boundary");
            }
            let lanes = (head_dim / pack).next_power_of_two().min(32) as u32;
            let qkv = view::<T>(qkv, ql)?;
            let k = view::<T>(k, kl)?;
            let v = view::<T>(v, vl)?;
            // SAFETY: the kernel below writes every element.
            let out = unsafe { dev.alloc::<T>(n * heads * head_dim)? };
            let sms = multiprocessors(&dev)?;
            let group_blocks = heads / super::GROUP;
            let grouped = self.grouped_bytes > 0 && n * group_blocks * self.splits >= sms;
            let head_blocks = if grouped { group_blocks } else { heads };
            let threshold = super::serial_threshold();
            let serial = grouped
                && self.serial_bytes > 0
                && self.splits > 1
                && self.own_rows > 0
                && threshold > 0
                && n * group_blocks >= threshold * sms;
            let (name, stage, shared_bytes) = if serial {
                let bytes = self.serial_bytes;
                // Two splits' rows: the next copied while one computes.
                let staged = 2 * self.stage_bytes;
                let stage = self.stage_bytes > 0 && bytes + staged <= super::SHARED_BYTES;
                let name = "pooled_attention_grouped_serial";
                (name, stage, bytes + if stage { staged } else { 0 })
            } else if grouped {
                ("pooled_attention_grouped", false, self.grouped_bytes)
            } else {
                let stage = self.stage_bytes > 0 && n * heads * self.splits <= sms;
                let staged = if stage { self.stage_bytes } else { 0 };
                ("pooled_attention", stage, self.shared_bytes + staged)
            };
            let depth = if serial { 1 } else { self.splits };
            // SAFETY: every element is written by the kernel below before
            // it is read (a split past a query's own count is never read;
            // a serial block keeps its splits' rows in shared memory).
            let partial_rows = if serial { 1 } else { n * heads * depth };
            let partial = unsafe { dev.alloc::<f32>(partial_rows * (head_dim + 2))? };
            let func = dev.get_or_load_custom_func(
                &format!("{name}_{suffix}"),
                "tandem_pooled_attention",
                PTX,
            )?;
            if shared_bytes > 48 * 1024 {
                // Above 48 KiB a kernel must opt in.
                use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute_enum as Attr;
                func.set_attribute(
                    Attr::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    shared_bytes as i32,
                )
                .w()?;
            }
            debug_assert_eq!(kv_heads, self.kv_heads);
            let dims = [n, heads, kv_heads, head_dim, self.block_shift as usize].map(|x| x as u32);
            let cfg = LaunchConfig {
                grid_dim: (dims[0], head_blocks as u32, depth as u32),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: shared_bytes as u32,
            };
            let split_keys = super::split_keys() as u32;
            let own_rows = self.own_rows as u32;
            // Prompt chunks' rows read the same keys many times over (from
            // L2 after the first): asked again, they only add requests
            // (prompt passes 1-2 % slower with it, H100).
            let prefetch = u32::from(super::prefetch_rows() && self.own_rows > 0);
            let stage = u32::from(stage);
            if self.arrivals.elem_count() < n * heads {
                candle_core::bail!("pooled attention: arrival counts for fewer rows");
            }
            with_view::<u32, _>(self.arrivals, "pooled attention", |arrivals| {
                with_tables::<T, _>(self.meta, self.cos, self.sin, |meta, cos, sin| {
                    let mut b = func.builder();
                    b.arg(&qkv);
                    b.arg(&k);
                    b.arg(&v);
                    b.arg(&meta);
                    b.arg(&cos);
                    b.arg(&sin);
                    b.arg(&partial);
                    for d in &dims[..4] {
                        b.arg(d);
                    }
                    b.arg(&self.q_scale);
                    b.arg(&dims[4]);
                    b.arg(&split_keys);
                    b.arg(&lanes);
                    b.arg(&own_rows);
                    b.arg(&prefetch);
                    b.arg(&stage);
                    b.arg(&arrivals);
                    b.arg(&out);
                    // SAFETY: argument types and counts match the kernel's
                    // signature; the metadata keeps every read and write
                    // inside the pools (with `own_rows`, each row at its
                    // own position, which no other block of the launch
                    // reads from the pool); the arrival counts hold one word per (token,
                    // head), zero on entry; `partial` holds `splits` rows
                    // per (token, head), the first `key_splits` of each
                    // written before the last split reads them.
                    unsafe { b.launch(cfg) }.w()?;
                    Ok(())
                })
            })?;
            Ok((
                CudaStorage::wrap_cuda_slice(out, dev),
                Shape::from((n, heads, head_dim)),
            ))
        }
    }

    impl CustomOp3 for PooledAttentionOp<'_> {
        fn name(&self) -> &'static str {
            "pooled-attention"
        }

        crate::cuda_only::cuda_only_cpu_fwd!(CustomOp3);

        fn cuda_fwd(
            &self,
            qkv: &CudaStorage,
            ql: &Layout,
            k: &CudaStorage,
            kl: &Layout,
            v: &CudaStorage,
            vl: &Layout,
        ) -> candle_core::Result<(CudaStorage, Shape)> {
            let args = ((qkv, ql), (k, kl), (v, vl));
            match qkv.dtype() {
                DType::F32 => self.launch::<f32>("f32", args.0, args.1, args.2),
                DType::F16 => self.launch::<half::f16>("f16", args.0, args.1, args.2),
                DType::BF16 => self.launch::<half::bf16>("bf16", args.0, args.1, args.2),
                other => candle_core::bail!("pooled attention has no {other:?} kernel"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device};

    use super::*;
    use crate::kv::{KeyOrder, KvLayout};
    use crate::model::OutputRows;

    fn config() -> ModelConfig {
        ModelConfig::from_json(
            r#"{"architectures": ["LlamaForCausalLM"], "vocab_size": 97, "hidden_size": 32,
                "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
                "num_key_value_heads": 2, "max_position_embeddings": 4096}"#,
        )
        .unwrap()
    }

    /// Three decoding sequences at positions 40, 3 and 70 (blocks of 16).
    fn cache_and_batch() -> (KvCache, Batch) {
        let layout = KvLayout {
            num_layers: 1,
            num_kv_heads: 2,
            head_dim: 8,
            dtype: DType::F32,
            keys: KeyOrder::Rows,
        };
        let mut kv = KvCache::own(layout, Device::Cpu, 4096, 16);
        let mut batch = Batch::default();
        for (slot, len) in [(1u32, 40usize), (2, 3), (3, 70)] {
            kv.allocate(slot, len + 1).unwrap();
            kv.ensure_room(slot, len + 1).unwrap();
            kv.set_len(slot, len).unwrap();
            batch.push(slot, len, &[5], OutputRows::Last);
        }
        (kv, batch)
    }

    /// The fixed layout a graph replays over: same per-token words as the
    /// packed one, each table at `3·n + i·blocks` padded with zeros, and no
    /// plan when a table needs more blocks than the layout holds.
    #[test]
    fn fixed_tables_sit_at_fixed_places() {
        let (kv, batch) = cache_and_batch();
        let cfg = config();
        let n = batch.tokens.len();
        let packed = PooledAttention::host_plan(&batch, &kv, &cfg, TableLayout::Packed)
            .unwrap()
            .unwrap();
        let blocks = 8;
        let fixed = PooledAttention::host_plan(&batch, &kv, &cfg, TableLayout::Fixed { blocks })
            .unwrap()
            .unwrap();
        assert_eq!(fixed.max_keys, 71);
        assert_eq!(packed.max_keys, 71);
        assert_eq!(fixed.meta.len(), 3 * n + n * blocks);
        assert_eq!(
            fixed.meta[n..3 * n],
            packed.meta[n..3 * n],
            "first and own positions"
        );
        for (i, s) in batch.seqs.iter().enumerate() {
            let at = fixed.meta[i] as usize;
            assert_eq!(at, 3 * n + i * blocks);
            let table = kv.table(s.slot).unwrap();
            let used = (s.offset + 1).div_ceil(16);
            assert_eq!(&fixed.meta[at..at + used], &table[..used]);
            assert!(fixed.meta[at + used..at + blocks].iter().all(|&b| b == 0));
            let p = packed.meta[i] as usize;
            assert_eq!(&packed.meta[p..p + used], &table[..used]);
        }
        let short = TableLayout::Fixed { blocks: 4 };
        assert!(PooledAttention::host_plan(&batch, &kv, &cfg, short)
            .unwrap()
            .is_none());
    }

    /// A pass whose sequences have at most [`OWN_ROWS`] rows (decodes, draft
    /// verifications) lets the attention launch write the rows' K and V,
    /// sized by its longest span; a longer chunk needs a launch before.
    #[test]
    fn decode_and_verifying_passes_write_in_the_attention_launch() {
        let (_, mut batch) = cache_and_batch();
        assert_eq!(own_rows(&batch), 1, "three decoding sequences");
        batch.push(4, 0, &[], OutputRows::None);
        assert_eq!(own_rows(&batch), 1, "an empty span adds no key");
        batch.push(5, 8, &[1, 2], OutputRows::All);
        assert_eq!(own_rows(&batch), 2, "a decode token and one draft");
        batch.push(6, 8, &[3; OWN_ROWS + 1], OutputRows::All);
        assert_eq!(own_rows(&batch), 0, "a ten-row chunk");
    }

    /// A serial grouped block's shared memory is a grouped block's plus the
    /// table entries of all its query's keys and a partial row per split
    /// and head; where that passes what a block may take (heads of 256 over
    /// 32 Ki keys: 16 splits of four heads' 258-float rows), or no grouped
    /// kernel runs, no serial block does.
    #[test]
    fn serial_blocks_run_only_where_their_shared_memory_fits() {
        let (kv, _) = cache_and_batch();
        let cfg = |head_dim: usize| {
            ModelConfig::from_json(&format!(
                r#"{{"architectures": ["LlamaForCausalLM"], "vocab_size": 97,
                    "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 1,
                    "num_attention_heads": 32, "num_key_value_heads": 8,
                    "head_dim": {head_dim}, "max_position_embeddings": 65536}}"#
            ))
            .unwrap()
        };
        let plan = |cfg: &ModelConfig, max_keys| {
            let meta = Tensor::zeros(1, candle_core::DType::U32, &Device::Cpu).unwrap();
            PooledAttention::over(meta, &kv, cfg, 1, max_keys, 1).unwrap()
        };
        let (narrow, wide) = (cfg(64), cfg(256));
        let short = plan(&narrow, 256);
        let grouped = grouped_bytes(&narrow, &short, 2);
        assert!(grouped > 0);
        // Four splits of 64 keys in blocks of 16: 12 more table entries,
        // four heads' four rows of 66 floats.
        let serial = grouped + 4 * (256 / 16 - 64 / 16 + 4 * 4 * 66);
        assert_eq!(serial_bytes(&narrow, &short, grouped), serial);
        assert_eq!(serial_bytes(&narrow, &short, 0), 0, "no grouped kernel");
        let long = plan(&wide, 32 * 1024);
        let grouped = grouped_bytes(&wide, &long, 2);
        assert!(grouped > 0, "a grouped split block fits");
        assert_eq!(serial_bytes(&wide, &long, grouped), 0);
    }

    /// Split counts depend on a query's own keys, never exceed the kernel's
    /// bound, and every split fits the shared memory `split_bound` sizes.
    #[test]
    fn key_splits_cover_every_key() {
        for keys in [1, 63, 64, 65, 200, 1023, 1024, 1025, 5000, 20_000] {
            let splits = key_splits(keys);
            assert!((1..=MAX_SPLITS).contains(&splits));
            let chunk = keys.div_ceil(splits);
            assert!(chunk * (splits - 1) < keys, "{keys}: an empty split");
            assert!(chunk <= split_bound(keys), "{keys}: chunk {chunk}");
        }
    }
}
