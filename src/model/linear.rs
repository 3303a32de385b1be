//! Projection weights in the format they are multiplied in, and the two
//! ways to multiply them: candle ops on tensors (any device) and the lean
//! CPU path on slices (the kernels of `kernels`).
//!
//! # Formats
//! - [`WeightFormat::AsCompute`]: weights in the compute dtype, `[n, k]` as
//!   the checkpoint stores them. On CPU the lean path reads f32 or f16 rows
//!   directly (no repacking, so the candle path can share the tensor).
//! - [`WeightFormat::AsStored`]: projections a checkpoint stores in GGML
//!   blocks (a quantised GGUF: Q4_0 … Q8_0, the K-quants) stay in those
//!   blocks on the CPU; everything else is in the compute dtype, as with
//!   `AsCompute`.
//! - [`WeightFormat::Q8_0`] / [`WeightFormat::Q4K`]: quantised at load into
//!   candle's GGML blocks. A weight whose input dimension is not a multiple
//!   of the block size cannot be quantised and stays in the compute dtype
//!   (llama.cpp does the same).
//!
//! Blocks are multiplied by Tandem's own kernels (`kernels::quant8`: 8-bit
//! activations, as llama.cpp, by default; `kernels::quant`: 15-bit ones,
//! [`ActivationQuant::Int16`]) for every format `kernels::qformat` decodes,
//! and by candle's quantized kernels for the rest (Q2_K, Q3_K) and on GPUs.
//!
//! Accuracy cost, measured by greedy agreement with f32 (BENCHMARKS.md):
//! Q8_0 keeps ~8 bits per weight (one f16 scale per 32), Q4_K ~4.5.

use std::str::FromStr;
use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Storage, Tensor};
use half::f16;

use super::kernels::packed::{self, Packed};
use super::kernels::qformat::{ActivationQuant, QFormat};
use super::kernels::quant::{self, QMatrix};
use super::kernels::{dot, Isa};
use crate::host_memory::zeroed_on_huge_pages;

/// How the lean path runs a projection: the kernels' tier, the most
/// threads, and how the quantised linear quantises activations.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CpuCall {
    pub(crate) isa: Isa,
    pub(crate) threads: usize,
    pub(crate) quant: ActivationQuant,
}

/// How projection weights (attention, MLP, unembedding) are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WeightFormat {
    /// In the compute dtype ([`LoadOptions::dtype`](super::LoadOptions)).
    #[default]
    AsCompute,
    /// In the GGML blocks the checkpoint stores them in, where the device
    /// multiplies them (the CPU); otherwise in the compute dtype.
    AsStored,
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
            "as-stored" => Ok(Self::AsStored),
            "q8_0" | "q8" => Ok(Self::Q8_0),
            "q4_k" | "q4k" => Ok(Self::Q4K),
            other => Err(format!(
                "unknown weight format `{other}` (expected as-compute, as-stored, q8_0 or q4_k)"
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
    /// `[n, k]` in a 32-element block format, Q4_K or Q6_K, repacked for the lean CPU path's 8-bit
    /// register tile (`kernels::packed`; [`Linear::repacked`]).
    Packed(Arc<Packed>),
    /// `[Σ n_i, k]`: parts in different GGML block types stacked by rows,
    /// each multiplied in its own blocks into its own output columns. A
    /// quantiser's mixes need it: Q4_K_M keeps `attn_v` in Q6_K in some
    /// layers beside Q4_K `attn_q` and `attn_k`.
    Stacked(Arc<[Linear]>),
}

/// One buffer that holds every dense CPU projection weight of a model, on
/// 2 MiB pages where Linux grants them (`MADV_HUGEPAGE`, asked before the
/// first touch: the default transparent-huge-page mode only backs memory
/// that asks). Decode streams every weight once per step; on 4 KiB pages
/// that is a TLB miss every 4 KiB of every stream. One buffer rather than
/// one per weight because only whole, aligned 2 MiB pages can be backed:
/// per-weight buffers left the tail of each (and all of any weight under
/// 4 MiB) on small pages, about 45 % of the llama-100m shape's bytes.
///
/// The buffer is allocated zeroed (untouched, so advice still applies) and
/// each weight is copied into its own 64-byte-aligned slot; the model keeps
/// views of the slots. `TANDEM_NO_HUGE_PAGES=1` skips the advice, for A/B
/// measurements.
pub(crate) struct WeightArena {
    buf: Tensor,
    /// Element at the 2 MiB boundary where the first slot starts.
    base: usize,
    /// First element of the next slot.
    next: usize,
    /// One past the last element the arena was sized for.
    end: usize,
}

/// Elements a slot is aligned to (64 bytes of the widest element).
const SLOT_ALIGN: usize = 16;

impl WeightArena {
    /// Room for weights of `elems` elements in total, in at most `slots`
    /// slots, of `dtype` (f32, f16 or bf16).
    pub(crate) fn new(elems: usize, slots: usize, dtype: DType) -> candle_core::Result<Self> {
        /// A zeroed buffer with room for `len` elements from its first
        /// 2 MiB boundary to a later one, and the index of that boundary.
        fn zeroed<T: candle_core::WithDType>(len: usize) -> candle_core::Result<(Tensor, usize)> {
            let (v, base) = zeroed_on_huge_pages::<T>(len).ok_or_else(|| {
                candle_core::Error::Msg(format!("weight arena: cannot allocate {len} elements"))
            })?;
            let cap = v.len();
            Ok((Tensor::from_vec(v, cap, &Device::Cpu)?, base))
        }
        let len = elems + slots * SLOT_ALIGN;
        let (buf, base) = match dtype {
            DType::F32 => zeroed::<f32>(len)?,
            DType::F16 => zeroed::<f16>(len)?,
            DType::BF16 => zeroed::<half::bf16>(len)?,
            other => candle_core::bail!("weight arena: no {other:?} weights"),
        };
        Ok(Self {
            buf,
            base,
            next: base,
            end: base + len,
        })
    }

    /// A copy of the contiguous `[n, k]` weight `w` in the arena's dtype.
    pub(crate) fn place(&mut self, w: &Tensor) -> candle_core::Result<Tensor> {
        let (n, k) = w.dims2()?;
        let len = n * k;
        if w.dtype() != self.buf.dtype() || self.next + len > self.end {
            candle_core::bail!("weight arena: {:?} weight of {len} does not fit", w.dtype());
        }
        let offset = self.next;
        self.buf.slice_set(&w.flatten_all()?, 0, offset)?;
        self.next = self.base + (offset - self.base + len).next_multiple_of(SLOT_ALIGN);
        self.buf.narrow(0, offset, len)?.reshape((n, k))
    }
}

impl Linear {
    /// The weight as a dense `[n, k]` tensor (dequantised when quantised).
    pub(crate) fn dense(&self) -> candle_core::Result<Tensor> {
        match self {
            Linear::Dense(w) => Ok(w.clone()),
            Linear::Quantized(q) => q.dequantize(&q.device()),
            Linear::Packed(p) => Self::unpacked(p)?.dequantize(&Device::Cpu),
            Linear::Stacked(parts) => {
                let dense = parts
                    .iter()
                    .map(Self::dense)
                    .collect::<Result<Vec<_>, _>>()?;
                Tensor::cat(&dense, 0)
            }
        }
    }

    /// Whether the weights are GGML blocks (any part's, when stacked).
    pub(crate) fn quantised(&self) -> bool {
        match self {
            Self::Dense(_) => false,
            Self::Quantized(_) | Self::Packed(_) => true,
            Self::Stacked(parts) => parts.iter().any(Self::quantised),
        }
    }

    /// Bytes of its weights as held (what one pass over them reads).
    pub(crate) fn bytes(&self) -> usize {
        match self {
            Self::Dense(w) => w.elem_count() * w.dtype().size_in_bytes(),
            Self::Quantized(q) => q.storage_size_in_bytes(),
            Self::Packed(p) => p.bytes_len(),
            Self::Stacked(parts) => parts.iter().map(Self::bytes).sum(),
        }
    }

    /// Output columns (`n`).
    pub(crate) fn columns(&self) -> candle_core::Result<usize> {
        Ok(match self {
            Self::Dense(w) => w.dims2()?.0,
            Self::Quantized(q) => q.shape().dims2()?.0,
            Self::Packed(p) => p.dims().0,
            Self::Stacked(parts) => parts.iter().map(Self::columns).sum::<Result<_, _>>()?,
        })
    }

    /// This projection as the lean CPU path multiplies it fastest with
    /// 8-bit activations: blocks of the 32-element formats, Q4_K and Q6_K
    /// on the CPU repacked into interleaved records (the same bytes, permuted); anything else
    /// as it is. `TANDEM_QUANT_KERNELS=candle` keeps the blocks for candle.
    pub(crate) fn repacked(self) -> candle_core::Result<Self> {
        if let Self::Stacked(parts) = &self {
            let parts = parts.iter().map(|p| p.clone().repacked());
            return Ok(Self::Stacked(parts.collect::<Result<_, _>>()?));
        }
        let Self::Quantized(q) = &self else {
            return Ok(self);
        };
        match QFormat::of(q.dtype()) {
            Some(format)
                if Packed::packs(format) && q.device().is_cpu() && !candle_kernels_forced() =>
            {
                let (n, k) = q.shape().dims2()?;
                Ok(Self::Packed(Arc::new(Packed::pack(
                    format,
                    &q.data()?,
                    n,
                    k,
                ))))
            }
            _ => Ok(self),
        }
    }

    /// Whether [`Linear::repacked`] repacked this projection.
    #[cfg(test)]
    pub(crate) fn is_packed(&self) -> bool {
        matches!(self, Self::Packed(_))
    }

    /// A repacked projection's blocks as candle holds them.
    fn unpacked(p: &Packed) -> candle_core::Result<QTensor> {
        let (n, k) = p.dims();
        qtensor_from_bytes(p.format().dtype(), &p.unpack(), &[n, k])
    }

    /// Wraps `w` (`[n, k]`, any dtype, on any device) in `format` on
    /// `device` in `dtype`; falls back to dense where quantising is
    /// impossible. Dense CPU weights go into `arena` when one is given.
    pub(crate) fn new(
        w: Tensor,
        format: WeightFormat,
        dtype: DType,
        device: &Device,
        arena: Option<&mut WeightArena>,
    ) -> candle_core::Result<Self> {
        let (_, k) = w.dims2()?;
        let quant = match format {
            WeightFormat::AsCompute | WeightFormat::AsStored => None,
            WeightFormat::Q4K if k % GgmlDType::Q4K.block_size() == 0 => Some(GgmlDType::Q4K),
            WeightFormat::Q8_0 | WeightFormat::Q4K if k % GgmlDType::Q8_0.block_size() == 0 => {
                Some(GgmlDType::Q8_0)
            }
            _ => None,
        };
        match quant {
            Some(q) => {
                // A fresh buffer of exactly these weights: `quantize_onto`
                // reads its source's whole storage from the start, and `w`
                // may be a view into a larger one (a CPU weight arena: the
                // target's unembedding under a draft head).
                let rows = w.to_device(&Device::Cpu)?.to_dtype(DType::F32)?;
                let cpu = Tensor::from_vec(
                    rows.flatten_all()?.to_vec1::<f32>()?,
                    w.dims(),
                    &Device::Cpu,
                )?;
                let qt = QTensor::quantize_onto(&cpu, q, device)?;
                if device.is_cpu() && QFormat::of(q).is_none() {
                    // candle repacks quantised weights for its x86 kernels on
                    // first use; do it now rather than in the first request.
                    let x = Tensor::zeros((1, k), DType::F32, device)?;
                    x.apply_op1_no_bwd(&qt)?;
                }
                Ok(Self::Quantized(Arc::new(qt)))
            }
            None => {
                let w = w.to_device(device)?.to_dtype(dtype)?.contiguous()?;
                Ok(Self::Dense(match arena {
                    Some(arena) if device.is_cpu() => arena.place(&w)?,
                    _ => w,
                }))
            }
        }
    }

    /// The matrices `parts` (GGML blocks, `[n_i, k]` each) stacked by rows
    /// into one projection multiplied in those blocks on the CPU: one
    /// matrix when their types agree, [`Linear::Stacked`] otherwise;
    /// `None` when their widths differ.
    pub(crate) fn from_blocks(parts: &[&QTensor]) -> candle_core::Result<Option<Self>> {
        let Some(first) = parts.first() else {
            return Ok(None);
        };
        let (dtype, k) = (first.dtype(), first.shape().dims2()?.1);
        for part in parts {
            if part.shape().dims2()?.1 != k {
                return Ok(None);
            }
        }
        if parts.iter().any(|p| p.dtype() != dtype) {
            let parts = parts.iter().map(|p| Self::from_blocks(&[p]));
            let parts: Option<Vec<_>> = parts.collect::<candle_core::Result<_>>()?;
            return Ok(parts.map(|p| Self::Stacked(p.into())));
        }
        let mut rows = 0;
        let mut bytes = Vec::new();
        for part in parts {
            rows += part.shape().dims2()?.0;
            bytes.extend_from_slice(&part.data()?);
        }
        let qt = qtensor_from_bytes(dtype, &bytes, &[rows, k])?;
        if QFormat::of(dtype).is_none() {
            // candle repacks quantised weights for its x86 kernels on first
            // use; do it now rather than in the first request.
            Tensor::zeros((1, k), DType::F32, &Device::Cpu)?.apply_op1_no_bwd(&qt)?;
        }
        Ok(Some(Self::Quantized(Arc::new(qt))))
    }

    /// The candle path: `x: [rows, k]` → `[rows, n]` in `x`'s dtype.
    pub(crate) fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Self::Dense(w) => match super::gemv::project(x, w)? {
                Some(y) => Ok(y),
                None => x.matmul(&w.t()?),
            },
            Self::Quantized(q) => {
                let dtype = x.dtype();
                let y = x.contiguous()?.apply_op1_no_bwd(q.as_ref())?;
                y.to_dtype(dtype)
            }
            // Packed projections belong to the lean path, which never
            // calls this; unpacking per call keeps the candle path correct.
            Self::Packed(p) => {
                let dtype = x.dtype();
                let y = x.contiguous()?.apply_op1_no_bwd(&Self::unpacked(p)?)?;
                y.to_dtype(dtype)
            }
            Self::Stacked(parts) => {
                let ys = parts.iter().map(|p| p.forward(x));
                let ys = ys.collect::<candle_core::Result<Vec<_>>>()?;
                Tensor::cat(&ys, x.rank() - 1)
            }
        }
    }

    /// The lean CPU path: `out[r·n + j] (+)= Σ x[r·k + i] · W[j, i]` for
    /// `r < rows`. `x` holds `rows · k` floats, `out` at least `rows · n`.
    pub(crate) fn forward_cpu(
        &self,
        call: CpuCall,
        x: &[f32],
        rows: usize,
        out: &mut [f32],
        accumulate: bool,
    ) -> candle_core::Result<()> {
        if rows == 0 {
            return Ok(());
        }
        let CpuCall {
            isa,
            threads,
            quant,
        } = call;
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
            // Repacked because the activations are 8-bit (Model::load).
            Self::Packed(p) => packed::matmul_t(isa, threads, x, rows, p, out, accumulate),
            Self::Stacked(parts) => Self::stacked_cpu(parts, call, x, rows, out, accumulate)?,
            Self::Quantized(q) => {
                let (n, k) = q.shape().dims2()?;
                if let Some(format) = QFormat::of(q.dtype()).filter(|_| !candle_kernels_forced()) {
                    let bytes = q.data()?;
                    let w = QMatrix {
                        format,
                        bytes: &bytes,
                        n,
                        k,
                    };
                    quant::qmatmul_t(isa, threads, quant, x, rows, w, out, accumulate);
                    return Ok(());
                }
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

    /// [`Linear::forward_cpu`] of stacked parts: a single row's outputs
    /// are each part's, side by side; more rows go through a buffer per
    /// part, then to their columns.
    fn stacked_cpu(
        parts: &[Linear],
        call: CpuCall,
        x: &[f32],
        rows: usize,
        out: &mut [f32],
        accumulate: bool,
    ) -> candle_core::Result<()> {
        let n = parts
            .iter()
            .map(Self::columns)
            .sum::<candle_core::Result<usize>>()?;
        let mut first = 0;
        for part in parts {
            let cols = part.columns()?;
            if rows == 1 {
                part.forward_cpu(call, x, 1, &mut out[first..first + cols], accumulate)?;
            } else {
                let mut y = vec![0f32; rows * cols];
                part.forward_cpu(call, x, rows, &mut y, false)?;
                for (o, y) in out.chunks_mut(n).zip(y.chunks(cols)) {
                    let o = &mut o[first..first + cols];
                    if accumulate {
                        o.iter_mut().zip(y).for_each(|(o, y)| *o += y);
                    } else {
                        o.copy_from_slice(y);
                    }
                }
            }
            first += cols;
        }
        Ok(())
    }
}

/// `TANDEM_QUANT_KERNELS=candle`: multiply every GGML block format with
/// candle's kernels instead of Tandem's (for A/B measurements). Read once.
fn candle_kernels_forced() -> bool {
    static FORCED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *FORCED.get_or_init(|| std::env::var("TANDEM_QUANT_KERNELS").as_deref() == Ok("candle"))
}

/// A CPU tensor of GGML blocks from raw bytes (row-major, `dims` in
/// elements). The bytes are copied to 8-byte-aligned memory first: candle
/// reinterprets them as blocks without checking alignment.
pub(crate) fn qtensor_from_bytes(
    dtype: GgmlDType,
    bytes: &[u8],
    dims: &[usize],
) -> candle_core::Result<QTensor> {
    let mut words = vec![0u64; bytes.len().div_ceil(8)];
    // SAFETY: u8 has no alignment or validity requirements, and the slice
    // covers exactly the words' memory.
    let aligned =
        unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<u8>(), words.len() * 8) };
    aligned[..bytes.len()].copy_from_slice(bytes);
    candle_core::quantized::ggml_file::qtensor_from_ggml(
        dtype,
        &aligned[..bytes.len()],
        dims.to_vec(),
        &Device::Cpu,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host_memory::HUGE_PAGE;

    #[test]
    fn stacked_blocks_multiply_like_their_dense_values() {
        let w = |seed: u64, n: usize| {
            super::super::weights::uniform_tensor(&[n, 64], 0.5, seed).unwrap()
        };
        let (a, b) = (w(1, 3), w(2, 5));
        let qa = QTensor::quantize(&a, GgmlDType::Q4_1).unwrap();
        let qb = QTensor::quantize(&b, GgmlDType::Q4_1).unwrap();
        let stacked = Linear::from_blocks(&[&qa, &qb])
            .unwrap()
            .expect("same type");
        let dense = Tensor::cat(
            &[
                qa.dequantize(&Device::Cpu).unwrap(),
                qb.dequantize(&Device::Cpu).unwrap(),
            ],
            0,
        )
        .unwrap();
        assert_eq!(
            stacked.dense().unwrap().to_vec2::<f32>().unwrap(),
            dense.to_vec2::<f32>().unwrap(),
            "the stacked blocks hold both matrices' values, in order"
        );
        let x: Vec<f32> = (0..64).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut out = [0f32; 8];
        stacked.forward_cpu(solo(), &x, 1, &mut out, false).unwrap();
        let want = Tensor::from_slice(&x, (1, 64), &Device::Cpu)
            .unwrap()
            .matmul(&dense.t().unwrap())
            .unwrap();
        for (o, w) in out
            .iter()
            .zip(want.flatten_all().unwrap().to_vec1::<f32>().unwrap())
        {
            // 8-bit activations, as llama.cpp: close to the dense product, not equal.
            assert!((o - w).abs() < 0.05 * w.abs().max(1.0), "{o} vs {w}");
        }
        let wide = super::super::weights::uniform_tensor(&[2, 96], 0.5, 3).unwrap();
        let wide = QTensor::quantize(&wide, GgmlDType::Q4_1).unwrap();
        assert!(
            Linear::from_blocks(&[&qa, &wide]).unwrap().is_none(),
            "different widths do not stack"
        );
    }

    #[test]
    fn quantising_a_view_quantises_the_view_not_its_storage() {
        // Rows 2..5 of a larger tensor: a view at an offset into storage it
        // shares (as the CPU weight arena hands out). Quantising it must
        // see those rows (candle's `quantize_onto` reads a source's storage
        // from its start).
        let all = super::super::weights::uniform_tensor(&[6, 64], 0.5, 7).unwrap();
        let view = all.narrow(0, 2, 3).unwrap();
        let fresh = Tensor::from_vec(
            view.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            (3, 64),
            &Device::Cpu,
        )
        .unwrap();
        let q = |w: Tensor| {
            let l = Linear::new(w, WeightFormat::Q8_0, DType::F32, &Device::Cpu, None).unwrap();
            l.dense().unwrap().to_vec2::<f32>().unwrap()
        };
        let (from_view, want) = (q(view.clone()), q(fresh));
        assert_eq!(from_view, want);
        for (row, dense) in from_view.iter().zip(view.to_vec2::<f32>().unwrap()) {
            for (a, b) in row.iter().zip(dense) {
                assert!(
                    (a - b).abs() < 0.01,
                    "{a} vs {b}: Q8_0 of the view's own rows"
                );
            }
        }
    }

    #[test]
    fn mixed_block_types_stack_and_give_each_parts_own_outputs() {
        let k = 256;
        let part = |seed: u64, n: usize, dtype: GgmlDType| {
            let w = super::super::weights::uniform_tensor(&[n, k], 0.5, seed).unwrap();
            QTensor::quantize(&w, dtype).unwrap()
        };
        // Q4_K_M's attention: Q4_K query and key, a Q6_K value.
        let parts = [
            part(1, 16, GgmlDType::Q4K),
            part(2, 5, GgmlDType::Q6K),
            part(3, 11, GgmlDType::Q4K),
        ];
        let refs: Vec<&QTensor> = parts.iter().collect();
        let stacked = Linear::from_blocks(&refs).unwrap().expect("one width");
        assert!(matches!(stacked, Linear::Stacked(_)));
        let singles: Vec<Linear> = parts
            .iter()
            .map(|p| Linear::from_blocks(&[p]).unwrap().unwrap())
            .collect();
        let dense: Vec<Tensor> = singles.iter().map(|s| s.dense().unwrap()).collect();
        let dense = Tensor::cat(&dense, 0).unwrap();
        assert_eq!(
            stacked.dense().unwrap().to_vec2::<f32>().unwrap(),
            dense.to_vec2::<f32>().unwrap()
        );
        let rows = 3;
        let x: Vec<f32> = (0..rows * k).map(|i| (i as f32 * 0.37).sin()).collect();
        for repack in [false, true] {
            let (stacked, singles) = match repack {
                false => (stacked.clone(), singles.clone()),
                true => (
                    stacked.clone().repacked().unwrap(),
                    singles
                        .iter()
                        .map(|s| s.clone().repacked().unwrap())
                        .collect(),
                ),
            };
            for (r, accumulate) in [(1, false), (rows, false), (rows, true)] {
                let mut got = vec![0.5f32; r * 32];
                stacked
                    .forward_cpu(solo(), &x, r, &mut got, accumulate)
                    .unwrap();
                // Each part alone, its outputs placed in its columns.
                let mut want = vec![0.5f32; r * 32];
                let mut first = 0;
                for single in &singles {
                    let n = single.columns().unwrap();
                    let mut y = vec![0f32; r * n];
                    single.forward_cpu(solo(), &x, r, &mut y, false).unwrap();
                    for i in 0..r {
                        for j in 0..n {
                            let o = &mut want[i * 32 + first + j];
                            *o = if accumulate {
                                *o + y[i * n + j]
                            } else {
                                y[i * n + j]
                            };
                        }
                    }
                    first += n;
                }
                assert_eq!(
                    got, want,
                    "repack {repack}, rows {r}, accumulate {accumulate}"
                );
            }
            let xt = Tensor::from_slice(&x, (rows, k), &Device::Cpu).unwrap();
            let candle = stacked.forward(&xt).unwrap();
            let parts: Vec<Tensor> = singles.iter().map(|s| s.forward(&xt).unwrap()).collect();
            assert_eq!(
                candle.to_vec2::<f32>().unwrap(),
                Tensor::cat(&parts, 1).unwrap().to_vec2::<f32>().unwrap()
            );
        }
    }

    /// One thread on this CPU's tier, 8-bit activations.
    fn solo() -> CpuCall {
        CpuCall {
            isa: Isa::detect(),
            threads: 1,
            quant: ActivationQuant::Int8,
        }
    }

    /// The address of a CPU tensor view's first element.
    fn addr(t: &Tensor) -> usize {
        let (storage, layout) = t.storage_and_layout();
        let Storage::Cpu(cpu) = &*storage else {
            panic!("not on the CPU")
        };
        let v = cpu.as_slice::<f32>().unwrap();
        v[layout.start_offset()..].as_ptr() as usize
    }

    #[test]
    fn arena_slots_hold_the_weights_from_a_huge_page_boundary() {
        let a = Tensor::arange(0f32, 12.0, &Device::Cpu)
            .unwrap()
            .reshape((3, 4))
            .unwrap();
        let b = Tensor::arange(100f32, 110.0, &Device::Cpu)
            .unwrap()
            .reshape((5, 2))
            .unwrap();
        let mut arena = WeightArena::new(22, 2, DType::F32).unwrap();
        let (pa, pb) = (arena.place(&a).unwrap(), arena.place(&b).unwrap());
        assert_eq!(pa.to_vec2::<f32>().unwrap(), a.to_vec2::<f32>().unwrap());
        assert_eq!(pb.to_vec2::<f32>().unwrap(), b.to_vec2::<f32>().unwrap());
        assert_eq!(addr(&pa) % HUGE_PAGE, 0);
        // Slots start on 64-byte boundaries.
        assert_eq!(addr(&pb) - addr(&pa), 64);
        // The lean path reads the view, not the buffer's start.
        let lin = Linear::Dense(pb);
        let mut out = [0f32; 5];
        lin.forward_cpu(solo(), &[1.0, 1.0], 1, &mut out, false)
            .unwrap();
        assert_eq!(out, [201.0, 205.0, 209.0, 213.0, 217.0]);
    }

    #[test]
    fn arena_refuses_what_does_not_fit() {
        let w = Tensor::zeros((4, 4), DType::F32, &Device::Cpu).unwrap();
        let mut arena = WeightArena::new(16, 1, DType::F32).unwrap();
        assert!(arena.place(&w.to_dtype(DType::F16).unwrap()).is_err());
        arena.place(&w).unwrap();
        let more = Tensor::zeros((5, 4), DType::F32, &Device::Cpu).unwrap();
        assert!(
            arena.place(&more).is_err(),
            "16 + 20 elements in room for 32"
        );
    }
}
