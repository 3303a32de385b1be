//! Attention over pooled KV in three kernel launches per layer (CUDA builds),
//! straight from the fused q/k/v projection.
//!
//! Tandem's own kernels (`cuda/attention.cu`, compiled to PTX by
//! `build.rs`): one writes the batch's new K rows into the pool, rotated
//! (RoPE) on the way, one the V rows; the third runs one thread block per
//! query token and query head, rotates and scales the token's q as it loads
//! it, and reads the token's keys and values straight from the layer's pool
//! through its sequence's block table: no gather, no padding, no mask,
//! whatever mix of
//! decodes, draft verifications and prefill chunks the batch holds. All
//! three read the `[n, (heads + 2·kv_heads)·head_dim]` projection rows as
//! they are, so the q/k/v split copies and the RoPE launches of the candle
//! path do not exist here: three launches per layer instead of the dozen of
//! [`super::batched_attention`] (which stays the path of other devices and
//! of contexts too long for a block's shared memory). candle's own scatter
//! could do the write, but it walks a batch's rows one after the other.
//!
//! The per-pass plan (per query token: where its sequence's block table
//! starts and its visible positions; the tables themselves) is built on
//! the host once per forward pass, uploaded once, and shared by every
//! layer. Position `p` of a sequence is pool row `table[p / block_size] ·
//! block_size + p % block_size`, as in [`KvCache::row`]; the kernels take
//! power-of-two block sizes (the default 16 is one), others go through
//! [`super::batched_attention`].

use candle_core::{Device, Tensor};

use super::{Batch, ModelConfig, ModelError};
use crate::kv::KvCache;

/// Shared memory one block may use (q, a score per key, reduction
/// scratch). 96 KiB is available to opted-in kernels on every GPU since
/// Ampere: about 24 000 keys.
const SHARED_BYTES: usize = 96 * 1024;

/// Warps per attention block (the kernel's block is 32 × this threads).
const WARPS: usize = 4;
/// Largest head dimension the kernel covers (8 per lane).
const MAX_HEAD_DIM: usize = 256;

/// Shared bytes a block needs for a query that sees `keys` keys in blocks
/// of `block_size`: the query, reduction scratch, one partial output row
/// per warp, one score per key and the table entries the keys span.
fn shared_bytes(cfg: &ModelConfig, keys: usize, block_size: usize) -> usize {
    4 * (cfg.head_dim + 32 + WARPS * cfg.head_dim + keys + keys / block_size + 2)
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
        let head_fits = cfg.head_dim <= MAX_HEAD_DIM && cfg.head_dim.is_multiple_of(2);
        let block_size = kv.block_size();
        if !device.is_cuda() || !kv.is_pooled() || !head_fits || !block_size.is_power_of_two() {
            return Ok(None);
        }
        let n = batch.tokens.len();
        let mut meta = vec![0u32; 3 * n];
        let mut tables: Vec<u32> = Vec::new();
        let mut max_keys = 0;
        let mut at = 0;
        for s in &batch.seqs {
            let end = s.offset + s.len;
            if s.len == 0 {
                continue;
            }
            // A typed error when the table does not reach the last position.
            kv.row(s.slot, end - 1)?;
            let table_at = u32::try_from(3 * n + tables.len())
                .map_err(|_| ModelError::InvalidBatch("block tables past 2^32 words".into()))?;
            tables.extend_from_slice(&kv.table(s.slot)?[..end.div_ceil(block_size)]);
            for pos in s.offset..end {
                let first = match cfg.sliding_window {
                    Some(w) if pos + 1 > w => pos + 1 - w,
                    _ => 0,
                };
                if shared_bytes(cfg, pos + 1 - first, block_size) > SHARED_BYTES {
                    return Ok(None);
                }
                max_keys = max_keys.max(pos + 1 - first);
                meta[at] = table_at;
                meta[n + at] = first as u32;
                meta[2 * n + at] = pos as u32;
                at += 1;
            }
        }
        meta.extend_from_slice(&tables);
        let len = meta.len();
        Ok(Some(Self {
            meta: Tensor::from_vec(meta, len, device)?,
            block_shift: block_size.trailing_zeros(),
            max_keys,
        }))
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
    let write = |first_head: usize, rope: bool| kernel::PoolWriteOp {
        cos,
        sin,
        heads: cfg.num_heads,
        first_head,
        rope,
        block_shift: plan.block_shift,
    };
    k_pool.inplace_op3(&qkv, &plan.meta, &write(cfg.num_heads, true))?;
    v_pool.inplace_op3(
        &qkv,
        &plan.meta,
        &write(cfg.num_heads + cfg.num_kv_heads, false),
    )?;
    let op = kernel::PooledAttentionOp {
        meta: &plan.meta,
        cos,
        sin,
        q_scale,
        shared_bytes: shared_bytes(cfg, plan.max_keys, 1 << plan.block_shift),
        heads: cfg.num_heads,
        kv_heads: cfg.num_kv_heads,
        block_shift: plan.block_shift,
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
        CudaView, DeviceRepr, LaunchConfig, PushKernelArg,
    };
    use candle_core::cuda_backend::{CudaDType, WrapErr};
    use candle_core::{
        CpuStorage, CudaStorage, CustomOp3, DType, InplaceOp3, Layout, Shape, Storage, Tensor,
    };

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
        pub(super) heads: usize,
        pub(super) kv_heads: usize,
        pub(super) block_shift: u32,
    }

    /// The K (rotated) or V heads of the projection rows into a pool, in
    /// place: `pool.inplace_op3(qkv, meta, &PoolWriteOp)`.
    pub(super) struct PoolWriteOp<'a> {
        pub(super) cos: &'a Tensor,
        pub(super) sin: &'a Tensor,
        pub(super) heads: usize,
        /// Head index within a qkv row where the written heads start.
        pub(super) first_head: usize,
        pub(super) rope: bool,
        pub(super) block_shift: u32,
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
        meta: Option<&Tensor>,
        cos: &Tensor,
        sin: &Tensor,
        f: impl FnOnce(
            Option<CudaView<'_, u32>>,
            CudaView<'_, T>,
            CudaView<'_, T>,
        ) -> candle_core::Result<R>,
    ) -> candle_core::Result<R> {
        let guards: Vec<_> = [meta, Some(cos), Some(sin)]
            .into_iter()
            .flatten()
            .map(|t| t.storage_and_layout())
            .collect();
        let mut cuda = Vec::with_capacity(guards.len());
        for (storage, layout) in &guards {
            let Storage::Cuda(c) = &**storage else {
                candle_core::bail!("pooled attention operands are not on the GPU");
            };
            cuda.push((c, *layout));
        }
        let mut it = cuda.into_iter();
        let meta = match meta {
            Some(_) => {
                let (c, l) = it.next().expect("meta guard");
                Some(view::<u32>(c, l)?)
            }
            None => None,
        };
        let (c, l) = it.next().expect("cos guard");
        let cos = view::<T>(c, l)?;
        let (c, l) = it.next().expect("sin guard");
        let sin = view::<T>(c, l)?;
        f(meta, cos, sin)
    }

    impl PoolWriteOp<'_> {
        fn launch<T: CudaDType + DeviceRepr>(
            &self,
            name: &str,
            (pool, pl): (&mut CudaStorage, &Layout),
            (qkv, ql): (&CudaStorage, &Layout),
            (meta, ml): (&CudaStorage, &Layout),
        ) -> candle_core::Result<()> {
            let (_, kv_heads, head_dim) = pl.shape().dims3()?;
            let (n, width) = ql.shape().dims2()?;
            if width != (self.heads + 2 * kv_heads) * head_dim || !pl.is_contiguous() {
                candle_core::bail!(
                    "pool write: projection rows {:?} into pool {:?}",
                    ql.shape(),
                    pl.shape()
                );
            }
            let dev = pool.device().clone();
            let func = dev.get_or_load_custom_func(name, "tandem_pooled_attention", PTX)?;
            let meta = view::<u32>(meta, ml)?;
            let qkv = view::<T>(qkv, ql)?;
            let start = pl.start_offset();
            let pool = pool.as_cuda_slice_mut::<T>()?;
            let mut pool = pool.slice_mut(start..);
            let args = [
                n,
                self.heads,
                kv_heads,
                head_dim,
                self.first_head,
                self.rope as usize,
                self.block_shift as usize,
            ]
            .map(|x| x as u32);
            let total = n * kv_heads * head_dim / 2;
            let cfg = LaunchConfig {
                grid_dim: (total.div_ceil(256).clamp(1, 65_535) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            with_tables::<T, _>(None, self.cos, self.sin, |_, cos, sin| {
                let mut b = func.builder();
                b.arg(&mut pool);
                b.arg(&qkv);
                b.arg(&meta);
                b.arg(&cos);
                b.arg(&sin);
                for a in &args {
                    b.arg(a);
                }
                // SAFETY: argument types match the kernel; every row comes
                // from a block table the plan checked against the slot's.
                unsafe { b.launch(cfg) }.w()?;
                Ok(())
            })
        }
    }

    impl InplaceOp3 for PoolWriteOp<'_> {
        fn name(&self) -> &'static str {
            "pool-write"
        }

        fn cpu_fwd(
            &self,
            _: &mut CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
        ) -> candle_core::Result<()> {
            candle_core::bail!("pool write runs on CUDA only")
        }

        fn cuda_fwd(
            &self,
            pool: &mut CudaStorage,
            pl: &Layout,
            qkv: &CudaStorage,
            ql: &Layout,
            meta: &CudaStorage,
            ml: &Layout,
        ) -> candle_core::Result<()> {
            let args = ((pool, pl), (qkv, ql), (meta, ml));
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

    impl PooledAttentionOp<'_> {
        fn launch<T: CudaDType + DeviceRepr>(
            &self,
            name: &str,
            (qkv, ql): (&CudaStorage, &Layout),
            (k, kl): (&CudaStorage, &Layout),
            (v, vl): (&CudaStorage, &Layout),
        ) -> candle_core::Result<(CudaStorage, Shape)> {
            let dev = qkv.device().clone();
            let (n, _) = ql.shape().dims2()?;
            let (_, kv_heads, head_dim) = kl.shape().dims3()?;
            let heads = self.heads;
            let qkv = view::<T>(qkv, ql)?;
            let k = view::<T>(k, kl)?;
            let v = view::<T>(v, vl)?;
            // SAFETY: every element is written by the kernel below.
            let out = unsafe { dev.alloc::<T>(n * heads * head_dim)? };
            let func = dev.get_or_load_custom_func(name, "tandem_pooled_attention", PTX)?;
            if self.shared_bytes > 48 * 1024 {
                // Above 48 KiB a kernel must opt in.
                use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute_enum as Attr;
                func.set_attribute(
                    Attr::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    self.shared_bytes as i32,
                )
                .w()?;
            }
            debug_assert_eq!(kv_heads, self.kv_heads);
            let dims = [n, heads, kv_heads, head_dim, self.block_shift as usize].map(|x| x as u32);
            let cfg = LaunchConfig {
                grid_dim: (dims[0], dims[1], 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: self.shared_bytes as u32,
            };
            with_tables::<T, _>(Some(self.meta), self.cos, self.sin, |meta, cos, sin| {
                let meta = meta.expect("meta view");
                let mut b = func.builder();
                b.arg(&qkv);
                b.arg(&k);
                b.arg(&v);
                b.arg(&meta);
                b.arg(&cos);
                b.arg(&sin);
                b.arg(&out);
                for d in &dims[..4] {
                    b.arg(d);
                }
                b.arg(&self.q_scale);
                b.arg(&dims[4]);
                // SAFETY: argument types and counts match the kernel's
                // signature; the metadata keeps every read inside the pools.
                unsafe { b.launch(cfg) }.w()?;
                Ok(())
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

        fn cpu_fwd(
            &self,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
        ) -> candle_core::Result<(CpuStorage, Shape)> {
            candle_core::bail!("pooled attention runs on CUDA only")
        }

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
                DType::F32 => self.launch::<f32>("pooled_attention_f32", args.0, args.1, args.2),
                DType::F16 => {
                    self.launch::<half::f16>("pooled_attention_f16", args.0, args.1, args.2)
                }
                DType::BF16 => {
                    self.launch::<half::bf16>("pooled_attention_bf16", args.0, args.1, args.2)
                }
                other => candle_core::bail!("pooled attention has no {other:?} kernel"),
            }
        }
    }
}
