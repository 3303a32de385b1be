//! Fused element-wise steps of the candle forward pass: the residual add
//! with the next RMSNorm, and SiLU(gate) · up.
//!
//! On a CUDA device each is one launch of Tandem's own kernel
//! (`cuda/fused.cu`) instead of two candle launches: a small-batch GPU step
//! is bound by launches, not arithmetic, so every launch saved per layer is
//! time saved per token. The kernels round once where the candle pair
//! rounded twice (in f16/bf16). Every other device, and every build
//! without the `cuda` feature, runs the candle ops.

use candle_core::Tensor;

/// `(x + y, rms_norm(x + y) · w)`.
pub(super) fn add_rms_norm(
    x: &Tensor,
    y: &Tensor,
    w: &Tensor,
    eps: f32,
) -> candle_core::Result<(Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && x.dim(0)? > 0 {
        let both = x.apply_op3_no_bwd(y, w, &kernel::AddRmsNorm { eps })?;
        return Ok((both.get(0)?, both.get(1)?));
    }
    let sum = (x + y)?;
    let normed = candle_nn::ops::rms_norm(&sum, w, eps)?;
    Ok((sum, normed))
}

/// `silu(gu[:, ..inter]) · gu[:, inter..]` for the fused gate/up rows
/// `[n, 2·inter]`.
pub(super) fn silu_mul(gu: &Tensor, inter: usize) -> candle_core::Result<Tensor> {
    #[cfg(feature = "cuda")]
    if gu.device().is_cuda() && gu.dim(0)? > 0 {
        return gu.apply_op1_no_bwd(&kernel::SiluMul { inter });
    }
    candle_nn::ops::silu(&gu.narrow(1, 0, inter)?)? * gu.narrow(1, inter, inter)?
}

#[cfg(feature = "cuda")]
mod kernel {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{
        CudaView, DeviceRepr, LaunchConfig, PushKernelArg,
    };
    use candle_core::cuda_backend::{CudaDType, WrapErr};
    use candle_core::{CpuStorage, CudaStorage, CustomOp1, CustomOp3, DType, Layout, Shape};

    const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/fused.ptx"));
    const MODULE: &str = "tandem_fused";

    pub(super) struct AddRmsNorm {
        pub(super) eps: f32,
    }

    pub(super) struct SiluMul {
        pub(super) inter: usize,
    }

    fn view<'a, T: CudaDType + DeviceRepr>(
        storage: &'a CudaStorage,
        layout: &Layout,
    ) -> candle_core::Result<CudaView<'a, T>> {
        super::super::cuda_view::contiguous(storage, layout, "a fused kernel")
    }

    fn suffix(dtype: DType) -> candle_core::Result<&'static str> {
        Ok(match dtype {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            other => candle_core::bail!("fused kernels have no {other:?} variant"),
        })
    }

    impl AddRmsNorm {
        fn launch<T: CudaDType + DeviceRepr>(
            &self,
            (x, xl): (&CudaStorage, &Layout),
            (y, yl): (&CudaStorage, &Layout),
            (w, wl): (&CudaStorage, &Layout),
        ) -> candle_core::Result<(CudaStorage, Shape)> {
            let (n, d) = xl.shape().dims2()?;
            if yl.shape().dims2()? != (n, d) || wl.shape().dims1()? != d {
                candle_core::bail!(
                    "add_rms_norm: {:?} + {:?} with weight {:?}",
                    xl.shape(),
                    yl.shape(),
                    wl.shape()
                );
            }
            let dev = x.device().clone();
            let name = format!("add_rms_norm_{}", suffix(x.dtype())?);
            let func = dev.get_or_load_custom_func(&name, MODULE, PTX)?;
            let (xv, yv, wv) = (view::<T>(x, xl)?, view::<T>(y, yl)?, view::<T>(w, wl)?);
            // SAFETY: the kernel writes every element.
            let out = unsafe { dev.alloc::<T>(2 * n * d)? };
            let (n32, d32) = (n as u32, d as u32);
            let cfg = LaunchConfig {
                grid_dim: (n32.max(1), 1, 1),
                block_dim: (d.next_multiple_of(32).clamp(32, 512) as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            if n > 0 {
                let mut b = func.builder();
                b.arg(&xv);
                b.arg(&yv);
                b.arg(&wv);
                b.arg(&out);
                b.arg(&n32);
                b.arg(&d32);
                b.arg(&self.eps);
                // SAFETY: argument types match the kernel; one block per row.
                unsafe { b.launch(cfg) }.w()?;
            }
            Ok((
                CudaStorage::wrap_cuda_slice(out, dev),
                Shape::from((2, n, d)),
            ))
        }
    }

    impl CustomOp3 for AddRmsNorm {
        fn name(&self) -> &'static str {
            "add-rms-norm"
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
            candle_core::bail!("add_rms_norm's kernel runs on CUDA only")
        }

        fn cuda_fwd(
            &self,
            x: &CudaStorage,
            xl: &Layout,
            y: &CudaStorage,
            yl: &Layout,
            w: &CudaStorage,
            wl: &Layout,
        ) -> candle_core::Result<(CudaStorage, Shape)> {
            match x.dtype() {
                DType::F32 => self.launch::<f32>((x, xl), (y, yl), (w, wl)),
                DType::F16 => self.launch::<half::f16>((x, xl), (y, yl), (w, wl)),
                DType::BF16 => self.launch::<half::bf16>((x, xl), (y, yl), (w, wl)),
                other => candle_core::bail!("add_rms_norm has no {other:?} kernel"),
            }
        }
    }

    impl SiluMul {
        fn launch<T: CudaDType + DeviceRepr>(
            &self,
            gu: &CudaStorage,
            gl: &Layout,
        ) -> candle_core::Result<(CudaStorage, Shape)> {
            let (n, width) = gl.shape().dims2()?;
            if width != 2 * self.inter {
                candle_core::bail!("silu_mul: rows {:?} for inter {}", gl.shape(), self.inter);
            }
            let dev = gu.device().clone();
            let name = format!("silu_mul_{}", suffix(gu.dtype())?);
            let func = dev.get_or_load_custom_func(&name, MODULE, PTX)?;
            let gv = view::<T>(gu, gl)?;
            let total = n * self.inter;
            // SAFETY: the kernel writes every element.
            let out = unsafe { dev.alloc::<T>(total)? };
            if total > 0 {
                let (n32, i32_) = (n as u32, self.inter as u32);
                let cfg = LaunchConfig {
                    grid_dim: (total.div_ceil(256).clamp(1, 65_535) as u32, 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                };
                let mut b = func.builder();
                b.arg(&gv);
                b.arg(&out);
                b.arg(&n32);
                b.arg(&i32_);
                // SAFETY: argument types match the kernel.
                unsafe { b.launch(cfg) }.w()?;
            }
            Ok((
                CudaStorage::wrap_cuda_slice(out, dev),
                Shape::from((n, self.inter)),
            ))
        }
    }

    impl CustomOp1 for SiluMul {
        fn name(&self) -> &'static str {
            "silu-mul"
        }

        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
            candle_core::bail!("silu_mul's kernel runs on CUDA only")
        }

        fn cuda_fwd(
            &self,
            gu: &CudaStorage,
            gl: &Layout,
        ) -> candle_core::Result<(CudaStorage, Shape)> {
            match gu.dtype() {
                DType::F32 => self.launch::<f32>(gu, gl),
                DType::F16 => self.launch::<half::f16>(gu, gl),
                DType::BF16 => self.launch::<half::bf16>(gu, gl),
                other => candle_core::bail!("silu_mul has no {other:?} kernel"),
            }
        }
    }
}
