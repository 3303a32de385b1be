//! CPU kernels of the lean step: the decode-fast linear (`dot`) and its
//! quantised twin for GGML blocks (`quant`, with 15-bit activations, and
//! `quant8`, with 8-bit ones; formats in `qformat`; Q8_0 repacked 8 rows
//! interleaved for a register tile in `packed`), the
//! element-wise math (`math`), attention (`attention`, its scores with the
//! keys in lanes in `scores`) and the parallel split they share (`pool`).
//!
//! # Invariants
//! - Every kernel exists for three instruction-set tiers ([`Isa`]): AVX-512,
//!   AVX2 + FMA + F16C, and portable Rust (which the compiler vectorises for
//!   whatever the target has). AVX-512 with VNNI is a fourth tier for the
//!   quantised linear (`vpdpwssd`, `vpdpbusd`); every other kernel runs its
//!   AVX-512 code there. The tier is detected at run time, once, and can only be
//!   lowered (`TANDEM_CPU_ISA=avx512|avx2|portable`), never raised past
//!   what the CPU reports, so a binary built for generic x86-64 still runs
//!   the widest kernels the machine has.
//! - Results never depend on how rows are batched or on the thread count:
//!   every output element is one dot product whose summation order depends
//!   only on the reduction length, so a sequence decoded alone and the same
//!   sequence inside a batch get bit-identical projections. Attention
//!   scores are one chain of fused multiply-adds per score on the AVX2 and
//!   AVX-512 tiers, so they are the same bits on both.
//! - Kernels work on plain slices the caller owns; they allocate nothing on
//!   the hot path except per-thread scratch that is kept between calls.

pub(crate) mod aligned;
pub(crate) mod attention;
pub(crate) mod dot;
pub mod few_rows;
pub(crate) mod math;
pub(crate) mod packed;
pub(crate) mod pool;
pub(crate) mod qformat;
pub(crate) mod quant;
mod quant8;
mod scores;

#[cfg(test)]
mod quant_tests;
#[cfg(test)]
mod tests;

use std::sync::OnceLock;

/// An instruction-set tier the kernels are compiled for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    /// Plain Rust, auto-vectorised for the compile target.
    Portable,
    /// x86-64 with AVX2, FMA and F16C (8 f32 lanes).
    Avx2,
    /// x86-64 with AVX-512 F/BW/VL plus FMA and F16C (16 f32 lanes).
    Avx512,
    /// [`Isa::Avx512`] plus AVX-512 VNNI (the quantised linear's
    /// multiply-accumulate; the same as `Avx512` everywhere else).
    Avx512Vnni,
}

impl Isa {
    /// The widest tier this CPU supports, lowered by `TANDEM_CPU_ISA` if set.
    /// Detected once per process.
    pub fn detect() -> Isa {
        static ISA: OnceLock<Isa> = OnceLock::new();
        *ISA.get_or_init(|| {
            let best = Self::best_supported();
            let wanted = match std::env::var("TANDEM_CPU_ISA").ok().as_deref() {
                Some("portable") => Isa::Portable,
                Some("avx2") => Isa::Avx2,
                Some("avx512") => Isa::Avx512,
                _ => best,
            };
            wanted.min(best)
        })
    }

    /// Every tier this CPU can run, narrowest first (tests run them all).
    #[cfg(test)]
    pub fn supported() -> Vec<Isa> {
        let best = Self::best_supported();
        [Isa::Portable, Isa::Avx2, Isa::Avx512, Isa::Avx512Vnni]
            .into_iter()
            .filter(|&i| i <= best)
            .collect()
    }

    fn best_supported() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c");
            let avx512 = avx2
                && is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl");
            if avx512 && is_x86_feature_detected!("avx512vnni") {
                return Isa::Avx512Vnni;
            }
            if avx512 {
                return Isa::Avx512;
            }
            if avx2 {
                return Isa::Avx2;
            }
        }
        Isa::Portable
    }
}
