//! Projection weights in the format they are multiplied in, and the two
//! ways to multiply them: candle ops on tensors (any device) and the lean
//! CPU path on slices (the kernels of [`super::kernels`]).
//!
//! # Formats
//! - [`WeightFormat::AsCompute`]: weights in the compute dtype, `[n, k]` as
//!   the checkpoint stores them. On CPU the lean path reads f32 or f16 rows
//!   directly (no repacking, so the candle path can share the tensor).
//! - [`WeightFormat::Q8_0`] / [`WeightFormat::Q4K`]: quantised at load with
//!   candle's GGML blocks; candle's quantized kernels run the matmul (on
//!   AVX-512 VNNI CPUs they are repacked for `vpdpbusd`). A weight whose
//!   input dimension is not a multiple of the block size cannot be
//!   quantised and stays in the compute dtype (llama.cpp does the same).
//!
//! Accuracy cost, measured by greedy agreement with f32 (BENCHMARKS-cpu.md):
//! Q8_0 keeps ~8 bits per weight (one f16 scale per 32), Q4_K ~4.5.

use std::str::FromStr;
use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Storage, Tensor};
use half::f16;

use super::kernels::{dot, Isa};

/// How projection weights (attention, MLP, unembedding) are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WeightFormat {
    /// In the compute dtype ([`LoadOptions::dtype`](super::LoadOptions)).
    #[default]
    AsCompute,
    /// GGML Q8_0: blocks of 32 int8 weights with one f16 scale (8.5 bits
    /// per weight); near-lossless.
    Q8_0,
    /// GGML Q4_K: 256-weight super-blocks of 4-bit weights (4.5 bits per
    /// weight); weights whose input dimension is not a multiple of 256 fall
    /// back to Q8_0.
    Q4K,
}

impl FromStr for WeightFormat {
    type Err = String;

    /// Parses `as-compute` (or `f32`/`f16`/`bf16`: "as loaded"), `q8_0`, `q4_k`.
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "as-compute" | "f32" | "f16" | "bf16" => Ok(Self::AsCompute),
            "q8_0" | "q8" => Ok(Self::Q8_0),
            "q4_k" | "q4k" => Ok(Self::Q4K),
            other => Err(format!(
                "unknown weight format `{other}` (expected as-compute, q8_0 or q4_k)"
            )),
        }
    }
}

/// One projection `y = x · Wᵀ`, `W: [n, k]`.
#[derive(Debug, Clone)]
pub(crate) enum Linear {
    /// `[n, k]` in the compute dtype, contiguous.
    Dense(Tensor),
    /// Quantised `[n, k]`.
    Quantized(Arc<QTensor>),
}

/// A copy of the CPU tensor `w` in memory the kernel may back with 2 MiB
/// pages (`MADV_HUGEPAGE`, asked before the first touch; Linux's default
/// transparent-huge-page mode only grants them on request). Decode streams
/// every weight once per step: with 4 KiB pages that is a TLB miss every
/// 4 KiB of every weight stream (measured: single-stream f32 decode ~3 %
/// faster with them). Only the 2 MiB-aligned interior of the buffer can be
/// backed so; below 2 MiB, off Linux, or with `TANDEM_NO_HUGE_PAGES` set
/// (for A/B measurements), `w` is returned as it is.
fn on_huge_pages(w: Tensor) -> candle_core::Result<Tensor> {
    #[cfg(target_os = "linux")]
    {
        fn huge<T: candle_core::WithDType>(w: &Tensor) -> candle_core::Result<Tensor> {
            let src = w.flatten_all()?.to_vec1::<T>()?;
            let mut v: Vec<T> = Vec::with_capacity(src.len());
            const HUGE: usize = 2 << 20;
            let (start, bytes) = (v.as_ptr() as usize, src.len() * std::mem::size_of::<T>());
            let first = start.next_multiple_of(HUGE);
            let end = (start + bytes) / HUGE * HUGE;
            if end > first {
                // SAFETY: the range lies inside `v`'s untouched allocation;
                // madvise only changes how the kernel backs it.
                unsafe {
                    libc::madvise(first as *mut libc::c_void, end - first, libc::MADV_HUGEPAGE);
                }
            }
            v.extend_from_slice(&src);
            Tensor::from_vec(v, w.shape(), &Device::Cpu)
        }
        let wanted = std::env::var_os("TANDEM_NO_HUGE_PAGES").is_none();
        if wanted && w.elem_count() * w.dtype().size_in_bytes() >= 2 << 20 {
            return match w.dtype() {
                DType::F32 => huge::<f32>(&w),
                DType::F16 => huge::<f16>(&w),
                DType::BF16 => huge::<half::bf16>(&w),
                _ => Ok(w),
            };
        }
    }
    Ok(w)
}

impl Linear {
    /// The weight as a dense `[n, k]` tensor (dequantised when quantised).
    pub(crate) fn dense(&self) -> candle_core::Result<Tensor> {
        match self {
            Linear::Dense(w) => Ok(w.clone()),
            Linear::Quantized(q) => q.dequantize(&q.device()),
        }
    }

    /// Wraps `w` (`[n, k]`, any dtype, on any device) in `format` on
    /// `device` in `dtype`; falls back to dense where quantising is impossible.
    pub(crate) fn new(
        w: Tensor,
        format: WeightFormat,
        dtype: DType,
        device: &Device,
    ) -> candle_core::Result<Self> {
        let (_, k) = w.dims2()?;
        let quant = match format {
            WeightFormat::AsCompute => None,
            WeightFormat::Q4K if k % GgmlDType::Q4K.block_size() == 0 => Some(GgmlDType::Q4K),
            WeightFormat::Q8_0 | WeightFormat::Q4K if k % GgmlDType::Q8_0.block_size() == 0 => {
                Some(GgmlDType::Q8_0)
            }
            _ => None,
        };
        match quant {
            Some(q) => {
                let cpu = w.to_device(&Device::Cpu)?.to_dtype(DType::F32)?;
                let qt = QTensor::quantize_onto(&cpu, q, device)?;
                if device.is_cpu() {
                    // candle repacks quantised weights for its x86 kernels on
                    // first use; do it now rather than in the first request.
                    let x = Tensor::zeros((1, k), DType::F32, device)?;
                    x.apply_op1_no_bwd(&qt)?;
                }
                Ok(Self::Quantized(Arc::new(qt)))
            }
            None => {
                let w = w.to_device(device)?.to_dtype(dtype)?.contiguous()?;
                Ok(Self::Dense(if device.is_cpu() {
                    on_huge_pages(w)?
                } else {
                    w
                }))
            }
        }
    }

    /// The candle path: `x: [rows, k]` → `[rows, n]` in `x`'s dtype.
    pub(crate) fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Self::Dense(w) => x.matmul(&w.t()?),
            Self::Quantized(q) => {
                let dtype = x.dtype();
                let y = x.contiguous()?.apply_op1_no_bwd(q.as_ref())?;
                y.to_dtype(dtype)
            }
        }
    }

    /// The lean CPU path: `out[r·n + j] (+)= Σ x[r·k + i] · W[j, i]` for
    /// `r < rows`. `x` holds `rows · k` floats, `out` at least `rows · n`.
    pub(crate) fn forward_cpu(
        &self,
        isa: Isa,
        threads: usize,
        x: &[f32],
        rows: usize,
        out: &mut [f32],
        accumulate: bool,
    ) -> candle_core::Result<()> {
        if rows == 0 {
            return Ok(());
        }
        match self {
            Self::Dense(w) => {
                let (n, k) = w.dims2()?;
                let (storage, layout) = w.storage_and_layout();
                let Storage::Cpu(cpu) = &*storage else {
                    candle_core::bail!("lean CPU path on a non-CPU weight");
                };
                let start = layout.start_offset();
                match w.dtype() {
                    DType::F32 => {
                        let s = &cpu.as_slice::<f32>()?[start..start + n * k];
                        dot::matmul_t(isa, threads, x, rows, k, s, n, out, accumulate);
                    }
                    DType::F16 => {
                        let s = &cpu.as_slice::<f16>()?[start..start + n * k];
                        dot::matmul_t(isa, threads, x, rows, k, s, n, out, accumulate);
                    }
                    other => candle_core::bail!("lean CPU path has no {other:?} weights"),
                }
            }
            Self::Quantized(q) => {
                let (n, k) = q.shape().dims2()?;
                let xt = Tensor::from_slice(&x[..rows * k], (rows, k), &Device::Cpu)?;
                let y = xt.apply_op1_no_bwd(q.as_ref())?;
                let (storage, layout) = y.storage_and_layout();
                let Storage::Cpu(cpu) = &*storage else {
                    candle_core::bail!("lean CPU path on a non-CPU weight");
                };
                let start = layout.start_offset();
                let y = &cpu.as_slice::<f32>()?[start..start + rows * n];
                let out = &mut out[..rows * n];
                if accumulate {
                    for (o, v) in out.iter_mut().zip(y) {
                        *o += v;
                    }
                } else {
                    out.copy_from_slice(y);
                }
            }
        }
        Ok(())
    }
}
