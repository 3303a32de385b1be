//! Attention over pooled KV in three kernel launches per layer (CUDA builds).
//!
//! Tandem's own kernels (`cuda/attention.cu`, compiled to PTX by
//! `build.rs`): one writes the batch's new K (or V) rows into the pool; the
//! other runs one thread block per query token and query head and reads
//! the token's keys and values straight from the layer's pool at its
//! sequence's range: no gather, no padding, no mask, whatever mix of
//! decodes, draft verifications and prefill chunks the batch holds. Per
//! layer the step costs three launches instead of the dozen of
//! [`super::batched_attention`] (which stays the path of other devices and
//! of contexts too long for a block's shared memory). candle's own scatter
//! could do the write, but it walks a batch's rows one after the other.
//!
//! The per-pass plan (per query token: its pool base and visible
//! positions) is built on the host once per forward pass and shared by
//! every layer.

use candle_core::{Device, Tensor};

use super::{Batch, ModelConfig, ModelError};
use crate::kv::KvCache;

/// Shared memory one block may use (q, a score per key, reduction
/// scratch). 96 KiB is available to opted-in kernels on every GPU since
/// Ampere: about 24 000 keys.
const SHARED_BYTES: usize = 96 * 1024;

/// Shared bytes a block needs for a query that sees `keys` keys: the
/// query, reduction scratch and one score per key.
fn shared_bytes(cfg: &ModelConfig, keys: usize) -> usize {
    4 * (cfg.head_dim + 32 + keys)
}

/// The per-pass part: where each query token's keys are.
pub(super) struct PooledAttention {
    /// `[3, n]` u32: per query token, the pool row of its sequence's
    /// position 0, its first visible position (sliding window) and its own
    /// position (the last it sees).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    meta: Tensor,
    /// Most keys any query sees (sizes the kernel's shared memory).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    max_keys: usize,
}

impl PooledAttention {
    /// The plan for `batch`, or `None` off CUDA, without pooled KV, for
    /// head shapes beyond the kernel's bounds, or when some query sees more
    /// keys than a block's shared memory holds scores for.
    pub(super) fn plan(
        batch: &Batch,
        kv: &KvCache,
        cfg: &ModelConfig,
        device: &Device,
    ) -> Result<Option<Self>, ModelError> {
        if !device.is_cuda() || !kv.is_pooled() {
            return Ok(None);
        }
        let n = batch.tokens.len();
        let mut meta = vec![0u32; 3 * n];
        let mut max_keys = 0;
        let mut at = 0;
        for s in &batch.seqs {
            let base = kv.pool_base(s.slot)?;
            for pos in s.offset..s.offset + s.len {
                let first = match cfg.sliding_window {
                    Some(w) if pos + 1 > w => pos + 1 - w,
                    _ => 0,
                };
                if shared_bytes(cfg, pos + 1 - first) > SHARED_BYTES {
                    return Ok(None);
                }
                max_keys = max_keys.max(pos + 1 - first);
                meta[at] = base as u32;
                meta[n + at] = first as u32;
                meta[2 * n + at] = pos as u32;
                at += 1;
            }
        }
        Ok(Some(Self {
            meta: Tensor::from_vec(meta, (3, n), device)?,
            max_keys,
        }))
    }

    /// Writes layer `layer`'s new K/V (`[n, kv_heads, head_dim]`) into the
    /// pool and returns the attention output `[n, heads·head_dim]` of `q`
    /// (`[n, heads, head_dim]`, RoPE applied and scaled).
    pub(super) fn forward(
        &self,
        cfg: &ModelConfig,
        kv: &KvCache,
        layer: usize,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<Tensor, ModelError> {
        let (k_pool, v_pool) = kv
            .pool_layer(layer)
            .ok_or_else(|| ModelError::InvalidBatch("KV pool has no such layer".into()))?;
        let n = q.dim(0)?;
        let out = run_kernels(q, k, v, k_pool, v_pool, self, cfg)?;
        Ok(out.reshape((n, cfg.num_heads * cfg.head_dim))?)
    }
}

#[cfg(feature = "cuda")]
fn run_kernels(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    k_pool: &Tensor,
    v_pool: &Tensor,
    plan: &PooledAttention,
    cfg: &ModelConfig,
) -> Result<Tensor, ModelError> {
    let write = kernel::PoolWriteOp;
    k_pool.inplace_op3(&k.contiguous()?, &plan.meta, &write)?;
    v_pool.inplace_op3(&v.contiguous()?, &plan.meta, &write)?;
    let op = kernel::PooledAttentionOp {
        meta: &plan.meta,
        shared_bytes: shared_bytes(cfg, plan.max_keys),
        kv_heads: cfg.num_kv_heads,
    };
    Ok(q.contiguous()?.apply_op3_no_bwd(k_pool, v_pool, &op)?)
}

#[cfg(not(feature = "cuda"))]
fn run_kernels(
    _: &Tensor,
    _: &Tensor,
    _: &Tensor,
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
    use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::{CudaDType, WrapErr};
    use candle_core::{
        CpuStorage, CudaStorage, CustomOp3, DType, InplaceOp3, Layout, Shape, Storage, Tensor,
    };

    const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/attention.ptx"));
    /// Threads per attention block (4 warps).
    const THREADS: u32 = 128;

    pub(super) struct PooledAttentionOp<'a> {
        pub(super) meta: &'a Tensor,
        pub(super) shared_bytes: usize,
        pub(super) kv_heads: usize,
    }

    /// The K or V rows of a batch into a pool, in place:
    /// `pool.inplace_op3(rows, meta, &PoolWriteOp)`.
    pub(super) struct PoolWriteOp;

    /// The metadata's device slice (`[3, n]` u32).
    fn meta_slice<'a>(
        meta: &'a CudaStorage,
        layout: &Layout,
    ) -> candle_core::Result<candle_core::cuda_backend::cudarc::driver::CudaView<'a, u32>> {
        Ok(meta.as_cuda_slice::<u32>()?.slice(layout.start_offset()..))
    }

    impl PoolWriteOp {
        fn launch<T: CudaDType + candle_core::cuda_backend::cudarc::driver::DeviceRepr>(
            &self,
            name: &str,
            (pool, pl): (&mut CudaStorage, &Layout),
            (src, sl): (&CudaStorage, &Layout),
            (meta, ml): (&CudaStorage, &Layout),
        ) -> candle_core::Result<()> {
            let (_, heads, dim) = pl.shape().dims3()?;
            let (n, src_heads, src_dim) = sl.shape().dims3()?;
            if (heads, dim) != (src_heads, src_dim) || !pl.is_contiguous() || !sl.is_contiguous() {
                candle_core::bail!(
                    "pool write: rows {:?} into pool {:?}",
                    sl.shape(),
                    pl.shape()
                );
            }
            let dev = pool.device().clone();
            let func = dev.get_or_load_custom_func(name, "tandem_pooled_attention", PTX)?;
            let meta = meta_slice(meta, ml)?;
            let src = src.as_cuda_slice::<T>()?.slice(sl.start_offset()..);
            let start = pl.start_offset();
            let pool = pool.as_cuda_slice_mut::<T>()?;
            let mut pool = pool.slice_mut(start..);
            let (n32, width) = (n as u32, (heads * dim) as u32);
            let total = n * heads * dim;
            let cfg = LaunchConfig {
                grid_dim: (total.div_ceil(256).clamp(1, 65_535) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = func.builder();
            b.arg(&mut pool);
            b.arg(&src);
            b.arg(&meta);
            b.arg(&n32);
            b.arg(&width);
            // SAFETY: argument types match the kernel; the plan keeps every
            // row inside its slot's range of the pool.
            unsafe { b.launch(cfg) }.w()?;
            Ok(())
        }
    }

    impl InplaceOp3 for PoolWriteOp {
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
            src: &CudaStorage,
            sl: &Layout,
            meta: &CudaStorage,
            ml: &Layout,
        ) -> candle_core::Result<()> {
            let args = ((pool, pl), (src, sl), (meta, ml));
            match src.dtype() {
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
        fn launch<T: CudaDType + candle_core::cuda_backend::cudarc::driver::DeviceRepr>(
            &self,
            name: &str,
            (q, ql): (&CudaStorage, &Layout),
            (k, kl): (&CudaStorage, &Layout),
            (v, vl): (&CudaStorage, &Layout),
        ) -> candle_core::Result<(CudaStorage, Shape)> {
            let dev = q.device().clone();
            let (n, heads, head_dim) = ql.shape().dims3()?;
            if !(ql.is_contiguous() && kl.is_contiguous() && vl.is_contiguous()) {
                candle_core::bail!("pooled attention needs contiguous q and pools");
            }
            let (meta_storage, meta_layout) = self.meta.storage_and_layout();
            let Storage::Cuda(meta_storage) = &*meta_storage else {
                candle_core::bail!("pooled attention metadata is not on the GPU");
            };
            let meta = meta_slice(meta_storage, meta_layout)?;
            let q = q.as_cuda_slice::<T>()?.slice(ql.start_offset()..);
            let k = k.as_cuda_slice::<T>()?.slice(kl.start_offset()..);
            let v = v.as_cuda_slice::<T>()?.slice(vl.start_offset()..);
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
            let (n32, h32, kvh32, hd32) = (
                n as u32,
                heads as u32,
                self.kv_heads as u32,
                head_dim as u32,
            );
            let cfg = LaunchConfig {
                grid_dim: (n32, h32, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: self.shared_bytes as u32,
            };
            let mut b = func.builder();
            b.arg(&q);
            b.arg(&k);
            b.arg(&v);
            b.arg(&meta);
            b.arg(&out);
            b.arg(&n32);
            b.arg(&h32);
            b.arg(&kvh32);
            b.arg(&hd32);
            // SAFETY: argument types and counts match the kernel's
            // signature; the metadata keeps every read inside the pools.
            unsafe { b.launch(cfg) }.w()?;
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
            q: &CudaStorage,
            ql: &Layout,
            k: &CudaStorage,
            kl: &Layout,
            v: &CudaStorage,
            vl: &Layout,
        ) -> candle_core::Result<(CudaStorage, Shape)> {
            let args = ((q, ql), (k, kl), (v, vl));
            match q.dtype() {
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
