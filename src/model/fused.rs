//! Fused element-wise steps of the candle forward pass: the residual add
//! with the next RMSNorm, and SiLU(gate) · up.
//!
//! On a CUDA device each is one launch of Tandem's own kernel
//! (`cuda/fused.cu`) instead of two candle launches: a small-batch GPU step
//! is bound by launches, not arithmetic, so every launch saved per layer is
//! time saved per token. The kernels round once where the candle pair
//! rounded twice (in f16/bf16). Every other device, and every build
//! without the `cuda` feature, runs the candle ops.
//!
//! Smaller steps on CUDA fold further ([`super::gemv`]): a layer hands its
//! projections a [`Normed`] input, the residual add and norm still to
//! apply, and the GEMV kernel applies them as it loads it; SwiGLU ends the
//! gate/up projection's launch.

use candle_core::Tensor;

use super::linear::Linear;

/// Widest row the fused norm kernel keeps in registers (16 elements for
/// each of at most 1 024 threads; `ITEMS` in `cuda/fused.cu`).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const MAX_NORM_WIDTH: usize = 16 * 1024;

/// Threads of the norm kernel's block for rows of `d`: up to 512, more
/// only where a row needs them (16 elements a thread).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn norm_threads(d: usize) -> usize {
    d.next_multiple_of(32)
        .clamp(32, 512)
        .max(d.div_ceil(16).next_multiple_of(32))
}

/// `(x + y, rms_norm(x + y) · w)`.
pub(super) fn add_rms_norm(
    x: &Tensor,
    y: &Tensor,
    w: &Tensor,
    eps: f32,
) -> candle_core::Result<(Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && x.dim(0)? > 0 && x.dim(1)? <= MAX_NORM_WIDTH {
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

/// An MTP head's input rows: `[rms_norm(embed[ids]) · enorm,
/// rms_norm(hidden) · hnorm]` (`[n, 2·d]` for `hidden: [n, d]`), one launch
/// of Tandem's kernel on CUDA instead of candle's gather, two norms and
/// concatenation; `None` elsewhere (the caller runs those ops).
pub(super) fn mtp_input(
    ids: &Tensor,
    embed: &Tensor,
    hidden: &Tensor,
    (enorm, hnorm): (&Tensor, &Tensor),
    eps: f32,
) -> candle_core::Result<Option<Tensor>> {
    #[cfg(feature = "cuda")]
    if hidden.device().is_cuda()
        && hidden.rank() == 2
        && hidden.dim(0)? > 0
        && hidden.dim(1)? <= MAX_NORM_WIDTH
        && ids.dims() == [hidden.dim(0)?]
        && ids.dtype() == candle_core::DType::U32
        && [embed, enorm, hnorm]
            .iter()
            .all(|t| t.dtype() == hidden.dtype())
        && embed.rank() == 2
        && embed.dim(1)? == hidden.dim(1)?
        && [enorm, hnorm]
            .iter()
            .all(|t| t.dims() == [hidden.dim(1).unwrap_or(0)])
        && [embed, enorm, hnorm].iter().all(|t| t.is_contiguous())
    {
        let op = kernel::MtpInput {
            embed,
            enorm,
            hnorm,
            eps,
        };
        return Ok(Some(
            hidden
                .contiguous()?
                .apply_op2_no_bwd(&ids.contiguous()?, &op)?,
        ));
    }
    let _ = (ids, embed, hidden, enorm, hnorm, eps);
    Ok(None)
}

/// A projection's input still to be normed: `rms_norm(x + addend) · norm`
/// (no add without `addend`). Deferring the norm lets a small-batch GPU
/// projection fold the residual add and the norm into its own launch.
pub(super) struct Normed<'a> {
    pub(super) x: Tensor,
    pub(super) addend: Option<Tensor>,
    pub(super) norm: &'a Tensor,
    pub(super) eps: f32,
}

impl Normed<'_> {
    /// The projection of the normed rows by `linear` (with `mlp =
    /// Some(inter)`, the MLP's SwiGLU activation of its fused gate/up
    /// rows) and the residual stream `x + addend`.
    pub(super) fn project(
        &self,
        linear: &Linear,
        mlp: Option<usize>,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        if let Linear::Dense(w) = linear {
            if let Some(both) = super::gemv::project_normed(self, w, mlp.is_some())? {
                return Ok(both);
            }
        }
        let (x, h) = match &self.addend {
            Some(y) => add_rms_norm(&self.x, y, self.norm, self.eps)?,
            None => (
                self.x.clone(),
                candle_nn::ops::rms_norm(&self.x, self.norm, self.eps)?,
            ),
        };
        let out = match mlp {
            Some(inter) => swiglu(&h, linear, inter)?,
            None => linear.forward(&h)?,
        };
        Ok((out, x))
    }
}

/// The MLP's activation `silu(gate) · up` of the fused gate/up projection
/// of `h`: one launch of the GEMV kernel where it takes the rows (a decode
/// step on CUDA), else the projection and [`silu_mul`].
pub(super) fn swiglu(h: &Tensor, gate_up: &Linear, inter: usize) -> candle_core::Result<Tensor> {
    if let Linear::Dense(w) = gate_up {
        if let Some(y) = super::gemv::project_swiglu(h, w)? {
            return Ok(y);
        }
    }
    silu_mul(&gate_up.forward(h)?, inter)
}

#[cfg(feature = "cuda")]
mod kernel {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{
        CudaView, DeviceRepr, LaunchConfig, PushKernelArg,
    };
    use candle_core::cuda_backend::{CudaDType, WrapErr};
    use candle_core::{CudaStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Shape, Tensor};

    use super::super::cuda_view::with_view;

    const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/fused.ptx"));
    const MODULE: &str = "tandem_fused";

    pub(super) struct AddRmsNorm {
        pub(super) eps: f32,
    }

    pub(super) struct SiluMul {
        pub(super) inter: usize,
    }

    /// [`super::mtp_input`]'s operands beside its candle ones (the hidden
    /// rows and the ids).
    pub(super) struct MtpInput<'a> {
        pub(super) embed: &'a Tensor,
        pub(super) enorm: &'a Tensor,
        pub(super) hnorm: &'a Tensor,
        pub(super) eps: f32,
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
                block_dim: (super::norm_threads(d) as u32, 1, 1),
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

        crate::cuda_only::cuda_only_cpu_fwd!(CustomOp3);

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

        crate::cuda_only::cuda_only_cpu_fwd!(CustomOp1);

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

    impl MtpInput<'_> {
        fn launch<T: CudaDType + DeviceRepr>(
            &self,
            (h, hl): (&CudaStorage, &Layout),
            (ids, il): (&CudaStorage, &Layout),
        ) -> candle_core::Result<(CudaStorage, Shape)> {
            let (n, d) = hl.shape().dims2()?;
            let dev = h.device().clone();
            let name = format!("mtp_input_{}", suffix(h.dtype())?);
            let func = dev.get_or_load_custom_func(&name, MODULE, PTX)?;
            let hv = view::<T>(h, hl)?;
            let iv = view::<u32>(ids, il)?;
            // SAFETY: the kernel writes every element.
            let out = unsafe { dev.alloc::<T>(2 * n * d)? };
            let cfg = LaunchConfig {
                grid_dim: (n as u32, 1, 1),
                block_dim: (super::norm_threads(d) as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            let d32 = d as u32;
            with_view::<T, _>(self.embed, "mtp_input", |ev| {
                with_view::<T, _>(self.enorm, "mtp_input", |env| {
                    with_view::<T, _>(self.hnorm, "mtp_input", |hnv| {
                        let mut b = func.builder();
                        b.arg(&iv);
                        b.arg(&ev);
                        b.arg(&hv);
                        b.arg(&env);
                        b.arg(&hnv);
                        b.arg(&out);
                        b.arg(&d32);
                        b.arg(&self.eps);
                        // SAFETY: argument types match the kernel; one
                        // block per row, every id checked against the
                        // vocabulary before the pass.
                        unsafe { b.launch(cfg) }.w()?;
                        Ok(())
                    })
                })
            })?;
            Ok((
                CudaStorage::wrap_cuda_slice(out, dev),
                Shape::from((n, 2 * d)),
            ))
        }
    }

    impl CustomOp2 for MtpInput<'_> {
        fn name(&self) -> &'static str {
            "mtp-input"
        }

        crate::cuda_only::cuda_only_cpu_fwd!(CustomOp2);

        fn cuda_fwd(
            &self,
            h: &CudaStorage,
            hl: &Layout,
            ids: &CudaStorage,
            il: &Layout,
        ) -> candle_core::Result<(CudaStorage, Shape)> {
            match h.dtype() {
                DType::F32 => self.launch::<f32>((h, hl), (ids, il)),
                DType::F16 => self.launch::<half::f16>((h, hl), (ids, il)),
                DType::BF16 => self.launch::<half::bf16>((h, hl), (ids, il)),
                other => candle_core::bail!("mtp_input has no {other:?} kernel"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn norm_threads_cover_a_row_in_registers() {
        // Up to 512 threads as before; wider rows take more, 16 each.
        assert_eq!(norm_threads(32), 32);
        assert_eq!(norm_threads(576), 512);
        assert_eq!(norm_threads(8192), 512);
        assert_eq!(norm_threads(8200), 544);
        for d in [1, 100, 2048, 8192, 8193, MAX_NORM_WIDTH] {
            let t = norm_threads(d);
            assert!(t.is_multiple_of(32) && t <= 1024 && 16 * t >= d, "d = {d}");
        }
    }
}
