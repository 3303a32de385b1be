//! Getting a `[B, V]` logits tensor onto the host as f32, once per call.
//!
//! The sampler's transforms are plain Rust over a host buffer: per-row
//! selections, small sorts and inverse-CDF walks are cheap on a CPU and
//! awkward as device kernels, and the tokens must reach the host anyway.
//! A contiguous f32 tensor already on the CPU is read in place (no copy);
//! anything else is converted with one `to_dtype` + `to_vec1`.

use candle_core::{DType, Device, Storage, Tensor};

use super::SamplerError;

/// Checks rank, row count and dtype; returns `(rows, vocab)`.
pub(crate) fn check_shape(logits: &Tensor, rows: usize) -> Result<(usize, usize), SamplerError> {
    let dims = logits.dims();
    if dims.len() != 2 {
        return Err(SamplerError::LogitsShape {
            reason: format!("logits must be rank 2 [rows, vocab], got shape {dims:?}"),
        });
    }
    if !logits.dtype().is_float() {
        return Err(SamplerError::LogitsDType(format!("{:?}", logits.dtype())));
    }
    let (b, v) = (dims[0], dims[1]);
    if b != rows {
        return Err(SamplerError::LogitsShape {
            reason: format!("logits have {b} rows but {rows} slots were named"),
        });
    }
    if v == 0 {
        return Err(SamplerError::EmptyVocab);
    }
    Ok((b, v))
}

/// Runs `f` over the logits as one row-major f32 slice.
pub(crate) fn with_host_f32<R>(
    logits: &Tensor,
    f: impl FnOnce(&[f32]) -> Result<R, SamplerError>,
) -> Result<R, SamplerError> {
    if logits.dtype() == DType::F32 && logits.device().is_cpu() {
        let (storage, layout) = logits.storage_and_layout();
        if let (Storage::Cpu(cpu), Some((start, end))) = (&*storage, layout.contiguous_offsets()) {
            let data = cpu.as_slice::<f32>().map_err(tensor_err)?;
            return f(&data[start..end]);
        }
    }
    let data = logits
        .to_dtype(DType::F32)
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1::<f32>())
        .map_err(tensor_err)?;
    f(&data)
}

/// Argmax per row computed where the tensor lives, so only B ids cross to
/// the host. Used only for all-greedy calls without penalties or logprobs
/// on a non-CPU device; the rows are not checked for NaN there. On CUDA,
/// Tandem's kernel spreads a row over many blocks (candle's argmax gives a
/// row one block); ties go to the lowest id either way.
pub(crate) fn device_argmax(logits: &Tensor) -> Result<Vec<u32>, SamplerError> {
    if logits.device().is_cuda() {
        if logits.dims().first() == Some(&0) {
            return Ok(Vec::new());
        }
        return super::device::argmax(logits);
    }
    logits
        .argmax(1)
        .and_then(|t| t.to_dtype(DType::U32))
        .and_then(|t| t.to_vec1::<u32>())
        .map_err(tensor_err)
}

/// Whether the tensor lives off the host.
pub(crate) fn on_device(logits: &Tensor) -> bool {
    !matches!(logits.device(), Device::Cpu)
}

pub(crate) fn tensor_err(e: candle_core::Error) -> SamplerError {
    SamplerError::Tensor(e.to_string())
}
