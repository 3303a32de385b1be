//! The CPU side of Tandem's own CUDA kernels' candle ops.
//!
//! candle's op traits (`CustomOp1`–`3`, `InplaceOp1`–`3`) require a
//! `cpu_fwd`; for an op that exists to launch one of Tandem's kernels it
//! can only report that the op needs a GPU. Callers take these ops for
//! tensors on CUDA only, so the error marks a caller's bug, never user
//! input.

/// The `cpu_fwd` of a CUDA-only op of candle's trait `$trait`: an error
/// naming the op (its `name()`).
macro_rules! cuda_only_cpu_fwd {
    (CustomOp1) => {
        fn cpu_fwd(
            &self,
            _: &candle_core::CpuStorage,
            _: &candle_core::Layout,
        ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
            Err($crate::cuda_only::needs_cuda(self.name()))
        }
    };
    (CustomOp2) => {
        fn cpu_fwd(
            &self,
            _: &candle_core::CpuStorage,
            _: &candle_core::Layout,
            _: &candle_core::CpuStorage,
            _: &candle_core::Layout,
        ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
            Err($crate::cuda_only::needs_cuda(self.name()))
        }
    };
    (CustomOp3) => {
        fn cpu_fwd(
            &self,
            _: &candle_core::CpuStorage,
            _: &candle_core::Layout,
            _: &candle_core::CpuStorage,
            _: &candle_core::Layout,
            _: &candle_core::CpuStorage,
            _: &candle_core::Layout,
        ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
            Err($crate::cuda_only::needs_cuda(self.name()))
        }
    };
    (InplaceOp1) => {
        fn cpu_fwd(
            &self,
            _: &mut candle_core::CpuStorage,
            _: &candle_core::Layout,
        ) -> candle_core::Result<()> {
            Err($crate::cuda_only::needs_cuda(self.name()))
        }
    };
    (InplaceOp2) => {
        fn cpu_fwd(
            &self,
            _: &mut candle_core::CpuStorage,
            _: &candle_core::Layout,
            _: &candle_core::CpuStorage,
            _: &candle_core::Layout,
        ) -> candle_core::Result<()> {
            Err($crate::cuda_only::needs_cuda(self.name()))
        }
    };
    (InplaceOp3) => {
        fn cpu_fwd(
            &self,
            _: &mut candle_core::CpuStorage,
            _: &candle_core::Layout,
            _: &candle_core::CpuStorage,
            _: &candle_core::Layout,
            _: &candle_core::CpuStorage,
            _: &candle_core::Layout,
        ) -> candle_core::Result<()> {
            Err($crate::cuda_only::needs_cuda(self.name()))
        }
    };
}
pub(crate) use cuda_only_cpu_fwd;

/// The error of a CUDA-only op asked to run on the CPU.
pub(crate) fn needs_cuda(op: &str) -> candle_core::Error {
    candle_core::Error::Msg(format!("{op} runs on CUDA only"))
}
