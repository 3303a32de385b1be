//! The CPU side of Tandem's own CUDA kernels' candle ops.
//!
//! candle's op traits (`CustomOp1`–`3`, `InplaceOp1`–`3`) require a
//! `cpu_fwd`; for an op that exists to launch one of Tandem's kernels it
//! can only report that the op needs a GPU. Callers take these ops for
//! tensors on CUDA only, so the error marks a caller's bug, never user
//! input.

/// The `cpu_fwd` of a CUDA-only op of candle's trait `$trait`: an error
/// naming the op (its `name()`). The `@` arms spell the signatures: an
/// op's operands as (storage, layout) pairs, an in-place op's first one
/// mutable.
macro_rules! cuda_only_cpu_fwd {
    (CustomOp1) => { $crate::cuda_only::cuda_only_cpu_fwd!(@custom _a); };
    (CustomOp2) => { $crate::cuda_only::cuda_only_cpu_fwd!(@custom _a _b); };
    (CustomOp3) => { $crate::cuda_only::cuda_only_cpu_fwd!(@custom _a _b _c); };
    (InplaceOp1) => { $crate::cuda_only::cuda_only_cpu_fwd!(@inplace); };
    (InplaceOp2) => { $crate::cuda_only::cuda_only_cpu_fwd!(@inplace _b); };
    (InplaceOp3) => { $crate::cuda_only::cuda_only_cpu_fwd!(@inplace _b _c); };
    (@custom $($operand:ident)+) => {
        fn cpu_fwd(
            &self,
            $($operand: &candle_core::CpuStorage, _: &candle_core::Layout),+
        ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
            Err($crate::cuda_only::needs_cuda(self.name()))
        }
    };
    (@inplace $($operand:ident)*) => {
        fn cpu_fwd(
            &self,
            _: &mut candle_core::CpuStorage,
            _: &candle_core::Layout
            $(, $operand: &candle_core::CpuStorage, _: &candle_core::Layout)*
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
