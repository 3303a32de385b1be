//! Element-wise math of the lean step, one row at a time: RMSNorm, SiLU·up,
//! the exponentials of a softmax, RoPE, and f16 ⇄ f32 conversion.
//!
//! `exp` is vectorised (the Cephes `expf` polynomial, ≤ 2 ulp on the
//! range a softmax or SiLU feeds it), because a scalar `expf` per element
//! would cost more than the attention dot products at decode batch sizes.
//! RMSNorm follows candle's formula (`x / sqrt(mean(x²) + eps) · w`) so the
//! lean step stays within rounding of the candle path.

use half::f16;
use half::slice::HalfFloatSliceExt;

use super::Isa;

/// `dst = src` widened (exact). Uses F16C when the CPU has it.
pub(crate) fn widen(src: &[f16], dst: &mut [f32]) {
    src.convert_to_f32_slice(dst);
}

/// `dst = src` rounded to f16 (nearest-even). Uses F16C when the CPU has it.
pub(crate) fn narrow(src: &[f32], dst: &mut [f16]) {
    dst.convert_from_f32_slice(src);
}

/// `out = x / sqrt(mean(x²) + eps) · w` for one row.
pub(crate) fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    // Eight partial sums: vectorises without -ffast-math and keeps the
    // order fixed, so a row's norm never depends on its neighbours.
    let mut acc = [0f32; 8];
    let chunks = x.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for (a, v) in acc.iter_mut().zip(c) {
            *a += v * v;
        }
    }
    for (a, v) in acc.iter_mut().zip(rest) {
        *a += v * v;
    }
    let sum = super::quant::pairwise8(&acc);
    let m = (sum / x.len() as f32 + eps).sqrt();
    for ((o, v), g) in out.iter_mut().zip(x).zip(w) {
        *o = v / m * g;
    }
}

/// `out = silu(gate) · up = gate / (1 + e^-gate) · up` for one row.
pub(crate) fn silu_mul(isa: Isa, gate: &[f32], up: &[f32], out: &mut [f32]) {
    let n = out.len().min(gate.len()).min(up.len());
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the tier was detected on this CPU.
        Isa::Avx512 | Isa::Avx512Vnni => unsafe {
            x86::silu_mul_avx512(&gate[..n], &up[..n], &mut out[..n])
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the tier was detected on this CPU.
        Isa::Avx2 => unsafe { x86::silu_mul_avx2(&gate[..n], &up[..n], &mut out[..n]) },
        _ => {
            for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
                *o = g / (1.0 + (-g).exp()) * u;
            }
        }
    }
}

/// The largest element (−∞ for an empty slice; NaNs are skipped).
pub(crate) fn max(isa: Isa, s: &[f32]) -> f32 {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the tier was detected on this CPU.
        Isa::Avx512 | Isa::Avx512Vnni => unsafe { x86::max_avx512(s) },
        _ => {
            // Eight running maxima: vectorises without fast-math.
            let mut m = [f32::NEG_INFINITY; 8];
            let chunks = s.chunks_exact(8);
            let rest = chunks.remainder();
            for c in chunks {
                for (a, &v) in m.iter_mut().zip(c) {
                    *a = a.max(v);
                }
            }
            rest.iter()
                .chain(&m)
                .copied()
                .fold(f32::NEG_INFINITY, f32::max)
        }
    }
}

/// `s[i] = e^(s[i] - max)` in place; returns the sum of the results.
pub(crate) fn exp_shifted_sum(isa: Isa, s: &mut [f32], max: f32) -> f32 {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the tier was detected on this CPU.
        Isa::Avx512 | Isa::Avx512Vnni => unsafe { x86::exp_shifted_sum_avx512(s, max) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the tier was detected on this CPU.
        Isa::Avx2 => unsafe { x86::exp_shifted_sum_avx2(s, max) },
        _ => {
            let mut sum = 0f32;
            for v in s.iter_mut() {
                *v = (*v - max).exp();
                sum += *v;
            }
            sum
        }
    }
}

/// Rotates each `head_dim` head of `x` (heads back to back) by the angles
/// whose cos/sin are `cos`, `sin` (`head_dim / 2` each): the "rotate half"
/// pairing of dimension i with i + head_dim/2, then multiplies by `scale`.
pub(crate) fn rope(x: &mut [f32], head_dim: usize, cos: &[f32], sin: &[f32], scale: f32) {
    let half = head_dim / 2;
    let (cos, sin) = (&cos[..half], &sin[..half]);
    for head in x.chunks_exact_mut(head_dim) {
        let (a, b) = head.split_at_mut(half);
        // Zipped iterators: no bounds checks, so the loop vectorises.
        for (((x0, x1), &c), &s) in a.iter_mut().zip(b.iter_mut()).zip(cos).zip(sin) {
            let (u, v) = (*x0, *x1);
            *x0 = (u * c - v * s) * scale;
            *x1 = (v * c + u * s) * scale;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    // Cephes expf: e^x = 2^n · e^r, |r| ≤ ln2/2, r split in two for accuracy.
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Cephes' coefficients as published.
    #[allow(clippy::excessive_precision)]
    const P: [f32; 6] = [
        1.987_569_1e-4,
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        1.666_666_5e-1,
        5.000_000_1e-1,
    ];
    // Inputs are clamped so 2^n stays a normal float (n ∈ [-126, 127]);
    // beyond them softmax and SiLU only need "tiny" and "huge".
    const HI: f32 = 88.0;
    const LO: f32 = -87.0;

    #[inline(always)]
    unsafe fn exp512(x: __m512) -> __m512 {
        let x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(LO)), _mm512_set1_ps(HI));
        let n = _mm512_roundscale_ps::<0x08>(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)));
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
        let mut p = _mm512_set1_ps(P[0]);
        for &c in &P[1..] {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
        }
        let r2 = _mm512_mul_ps(r, r);
        let y = _mm512_fmadd_ps(p, r2, _mm512_add_ps(r, _mm512_set1_ps(1.0)));
        _mm512_scalef_ps(y, n)
    }

    #[inline(always)]
    unsafe fn exp256(x: __m256) -> __m256 {
        let x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(LO)), _mm256_set1_ps(HI));
        let n = _mm256_round_ps::<0x08>(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)));
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
        let mut p = _mm256_set1_ps(P[0]);
        for &c in &P[1..] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        }
        let r2 = _mm256_mul_ps(r, r);
        let y = _mm256_fmadd_ps(p, r2, _mm256_add_ps(r, _mm256_set1_ps(1.0)));
        // 2^n through the exponent bits; n ∈ [-126, 127] after the clamp.
        let e = _mm256_slli_epi32::<23>(_mm256_add_epi32(
            _mm256_cvtps_epi32(n),
            _mm256_set1_epi32(127),
        ));
        _mm256_mul_ps(y, _mm256_castsi256_ps(e))
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub(super) unsafe fn silu_mul_avx512(g: &[f32], u: &[f32], o: &mut [f32]) {
        let n = o.len();
        let one = _mm512_set1_ps(1.0);
        let mut i = 0;
        while i < n {
            let m: __mmask16 = if n - i >= 16 {
                0xffff
            } else {
                ((1u32 << (n - i)) - 1) as u16
            };
            let gv = _mm512_maskz_loadu_ps(m, g.as_ptr().add(i));
            let uv = _mm512_maskz_loadu_ps(m, u.as_ptr().add(i));
            let e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv));
            let s = _mm512_div_ps(gv, _mm512_add_ps(one, e));
            _mm512_mask_storeu_ps(o.as_mut_ptr().add(i), m, _mm512_mul_ps(s, uv));
            i += 16;
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn silu_mul_avx2(g: &[f32], u: &[f32], o: &mut [f32]) {
        let n = o.len();
        let one = _mm256_set1_ps(1.0);
        let full = n / 8 * 8;
        let mut i = 0;
        while i < full {
            let gv = _mm256_loadu_ps(g.as_ptr().add(i));
            let uv = _mm256_loadu_ps(u.as_ptr().add(i));
            let e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            let s = _mm256_div_ps(gv, _mm256_add_ps(one, e));
            _mm256_storeu_ps(o.as_mut_ptr().add(i), _mm256_mul_ps(s, uv));
            i += 8;
        }
        if full < n {
            let (mut gt, mut ut, mut ot) = ([0f32; 8], [0f32; 8], [0f32; 8]);
            gt[..n - full].copy_from_slice(&g[full..n]);
            ut[..n - full].copy_from_slice(&u[full..n]);
            let gv = _mm256_loadu_ps(gt.as_ptr());
            let e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            let s = _mm256_div_ps(gv, _mm256_add_ps(one, e));
            _mm256_storeu_ps(
                ot.as_mut_ptr(),
                _mm256_mul_ps(s, _mm256_loadu_ps(ut.as_ptr())),
            );
            o[full..n].copy_from_slice(&ot[..n - full]);
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub(super) unsafe fn max_avx512(s: &[f32]) -> f32 {
        let n = s.len();
        let mut m = _mm512_set1_ps(f32::NEG_INFINITY);
        let mut i = 0;
        while i < n {
            let k: __mmask16 = if n - i >= 16 {
                0xffff
            } else {
                ((1u32 << (n - i)) - 1) as u16
            };
            m = _mm512_mask_max_ps(m, k, m, _mm512_maskz_loadu_ps(k, s.as_ptr().add(i)));
            i += 16;
        }
        _mm512_reduce_max_ps(m)
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub(super) unsafe fn exp_shifted_sum_avx512(s: &mut [f32], max: f32) -> f32 {
        let n = s.len();
        let mv = _mm512_set1_ps(max);
        let mut acc = _mm512_setzero_ps();
        let mut i = 0;
        while i < n {
            let m: __mmask16 = if n - i >= 16 {
                0xffff
            } else {
                ((1u32 << (n - i)) - 1) as u16
            };
            let v = exp512(_mm512_sub_ps(
                _mm512_maskz_loadu_ps(m, s.as_ptr().add(i)),
                mv,
            ));
            _mm512_mask_storeu_ps(s.as_mut_ptr().add(i), m, v);
            acc = _mm512_mask_add_ps(acc, m, acc, v);
            i += 16;
        }
        _mm512_reduce_add_ps(acc)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn exp_shifted_sum_avx2(s: &mut [f32], max: f32) -> f32 {
        let n = s.len();
        let mv = _mm256_set1_ps(max);
        let mut acc = _mm256_setzero_ps();
        let full = n / 8 * 8;
        let mut i = 0;
        while i < full {
            let v = exp256(_mm256_sub_ps(_mm256_loadu_ps(s.as_ptr().add(i)), mv));
            _mm256_storeu_ps(s.as_mut_ptr().add(i), v);
            acc = _mm256_add_ps(acc, v);
            i += 8;
        }
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
        let mut sum = lanes.iter().sum::<f32>();
        if full < n {
            let mut t = [max; 8];
            t[..n - full].copy_from_slice(&s[full..n]);
            let v = exp256(_mm256_sub_ps(_mm256_loadu_ps(t.as_ptr()), mv));
            _mm256_storeu_ps(t.as_mut_ptr(), v);
            s[full..n].copy_from_slice(&t[..n - full]);
            sum += t[..n - full].iter().sum::<f32>();
        }
        sum
    }
}
