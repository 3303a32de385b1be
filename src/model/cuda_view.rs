//! The device view every CUDA custom op of the model hands its kernels.

use candle_core::cuda_backend::cudarc::driver::{CudaView, DeviceRepr};
use candle_core::cuda_backend::CudaDType;
use candle_core::{CudaStorage, Layout, Storage, Tensor};

/// A device slice of `storage` from its layout's offset; `op` names the
/// caller in the error for a strided operand (the kernels index rows as
/// packed).
pub(super) fn contiguous<'a, T: CudaDType + DeviceRepr>(
    storage: &'a CudaStorage,
    layout: &Layout,
    op: &str,
) -> candle_core::Result<CudaView<'a, T>> {
    if !layout.is_contiguous() {
        candle_core::bail!("{op} needs contiguous operands");
    }
    Ok(storage.as_cuda_slice::<T>()?.slice(layout.start_offset()..))
}

/// Runs `f` with the device view of `t`, a tensor an op captured beside its
/// candle operands (its storage stays read-locked meanwhile); `op` names
/// the caller in errors.
pub(super) fn with_view<T: CudaDType + DeviceRepr, R>(
    t: &Tensor,
    op: &str,
    f: impl FnOnce(CudaView<'_, T>) -> candle_core::Result<R>,
) -> candle_core::Result<R> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(c) = &*storage else {
        candle_core::bail!("{op}: an operand is not on the GPU");
    };
    f(contiguous(c, layout, op)?)
}
