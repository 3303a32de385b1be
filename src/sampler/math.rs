//! Vectorisable numeric kernels over one vocabulary row.
//!
//! The sampler's cost is dominated by `exp` over V (softmax denominators for
//! top-p, temperature draws without truncation, and logprobs). `f32::exp`
//! is a libm call that the compiler cannot vectorise; [`exp_approx`] is a
//! branch-free Cephes-style kernel that it can, with a relative error of a
//! few ulps (checked in the tests below).
//!
//! Every reduction here runs in a fixed order (eight lanes, then the lanes
//! summed left to right, then the tail), so a row gives bit-identical
//! results whichever thread or path processes it — the uniform and serial
//! paths rely on that to agree token for token.

/// Below this argument `exp` is flushed to exactly zero (e^-87 ≈ 1.6e-38 is
/// at the edge of the normal f32 range). This also maps `-inf` — a masked
/// logit — to exactly zero probability.
const EXP_FLUSH: f32 = -87.0;
const EXP_MAX: f32 = 88.0;
const LOG2E: f32 = std::f32::consts::LOG2_E;
/// ln 2 split in a part exact in f32 and a small correction (Cody–Waite).
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// 1.5 × 2^23: adding it rounds a float to the nearest integer and leaves
/// that integer in the low mantissa bits.
const ROUND_MAGIC: f32 = 12_582_912.0;
const LANES: usize = 8;

/// `e^x` for `x ≤ 88`; exactly 0 for `x < -87` (including `-inf`).
#[inline(always)]
pub(crate) fn exp_approx(x: f32) -> f32 {
    // Plain comparisons (not `clamp`/`max`, whose NaN rules block it) let
    // the loop vectorise; NaN never reaches here.
    let lo = if x < EXP_FLUSH { EXP_FLUSH } else { x };
    let xc = if lo > EXP_MAX { EXP_MAX } else { lo };
    let k = xc * LOG2E + ROUND_MAGIC;
    let n = k - ROUND_MAGIC;
    let r = xc - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4_f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    // n lies in [-126, 127], so the biased exponent stays in [1, 254].
    let n_int = (k.to_bits() as i32).wrapping_sub(ROUND_MAGIC.to_bits() as i32);
    let scale = f32::from_bits((n_int.wrapping_add(127) as u32) << 23);
    // Flush with a bit mask rather than a branch or select, which keeps
    // the callers' loops vectorised.
    mask_below(y * scale, x, EXP_FLUSH)
}

/// `v` where `x >= floor`, else `+0.0`, without a branch.
#[inline(always)]
pub(crate) fn mask_below(v: f32, x: f32, floor: f32) -> f32 {
    let keep = u32::from(x >= floor).wrapping_neg();
    f32::from_bits(v.to_bits() & keep)
}

/// Defines `pub(crate) fn $name` whose body is compiled twice, for the
/// baseline target and for AVX2, and picks the AVX2 build at run time when
/// the CPU has it. Both builds perform the same IEEE operations in the same
/// order (Rust never contracts `a * b + c` into an FMA, and the lane
/// structure is explicit in the code), so they return bit-identical
/// results; only the vector width differs.
macro_rules! multiversion {
    ($(#[$doc:meta])* fn $name:ident($($arg:ident: $ty:ty),* $(,)?) -> $ret:ty $body:block) => {
        $(#[$doc])*
        pub(crate) fn $name($($arg: $ty),*) -> $ret {
            #[inline(always)]
            fn imp($($arg: $ty),*) -> $ret $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2")]
                unsafe fn avx2($($arg: $ty),*) -> $ret {
                    imp($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx2") {
                    // SAFETY: the CPU supports AVX2 (checked just above),
                    // which is all `avx2` requires beyond its safe body.
                    return unsafe { avx2($($arg),*) };
                }
            }
            imp($($arg),*)
        }
    };
}

pub(crate) use multiversion;

multiversion! {
    /// Largest value of the row and whether it holds a NaN or `+inf`, in one
    /// pass (a NaN never wins a `>` so it is tracked separately).
    fn max_and_bad(row: &[f32]) -> (f32, bool) {
        let mut m = [f32::NEG_INFINITY; LANES];
        let mut bad = [0u32; LANES];
        let chunks = row.chunks_exact(LANES);
        let tail = chunks.remainder();
        for c in chunks {
            for j in 0..LANES {
                let x = c[j];
                m[j] = if x > m[j] { x } else { m[j] };
                bad[j] |= u32::from(x.is_nan() | (x == f32::INFINITY));
            }
        }
        let mut best = f32::NEG_INFINITY;
        let mut any_bad = false;
        for j in 0..LANES {
            best = best.max(m[j]);
            any_bad |= bad[j] != 0;
        }
        for &x in tail {
            best = best.max(x);
            any_bad |= x.is_nan() | (x == f32::INFINITY);
        }
        (best, any_bad)
    }
}

/// The row's greedy token: its first maximum (ties go to the lowest id; a
/// NaN never wins), as the sampler's greedy path picks it.
pub fn argmax(row: &[f32]) -> u32 {
    first_index_of(row, max(row)) as u32
}

/// Largest value of a row known to be NaN-free.
pub(crate) fn max(row: &[f32]) -> f32 {
    max_and_bad(row).0
}

multiversion! {
    /// Index of the first entry equal to `m`: with `m` the row maximum,
    /// the argmax with ties broken towards the lowest id. 0 if there is none.
    fn first_index_of(row: &[f32], m: f32) -> usize {
        const BLOCK: usize = 16;
        let mut base = 0;
        for block in row.chunks(BLOCK) {
            // One vectorised test per block; only a hit is searched.
            if block.iter().fold(false, |any, &x| any | (x == m)) {
                return base + block.iter().position(|&x| x == m).unwrap_or(0);
            }
            base += block.len();
        }
        0
    }
}

multiversion! {
    /// `Σ e^{(x - shift)·scale}` over the row, in a fixed order.
    fn sum_exp(row: &[f32], shift: f32, scale: f32) -> f32 {
        let mut acc = [0.0f32; LANES];
        let chunks = row.chunks_exact(LANES);
        let tail = chunks.remainder();
        for c in chunks {
            for j in 0..LANES {
                acc[j] += exp_approx((c[j] - shift) * scale);
            }
        }
        let mut total = 0.0f32;
        for a in acc {
            total += a;
        }
        for &x in tail {
            total += exp_approx((x - shift) * scale);
        }
        total
    }
}

multiversion! {
    /// Writes `out[i] = e^{(x_i - shift)·scale}` for `x_i ≥ floor`, else 0,
    /// and returns their sum in the same fixed order as [`sum_exp`].
    fn exp_into(row: &[f32], shift: f32, scale: f32, floor: f32, out: &mut [f32]) -> f32 {
        let mut acc = [0.0f32; LANES];
        let n = row.len() - row.len() % LANES;
        for (c, o) in row[..n]
            .chunks_exact(LANES)
            .zip(out[..n].chunks_exact_mut(LANES))
        {
            for j in 0..LANES {
                let e = mask_below(exp_approx((c[j] - shift) * scale), c[j], floor);
                o[j] = e;
                acc[j] += e;
            }
        }
        let mut total = 0.0f32;
        for a in acc {
            total += a;
        }
        for (x, o) in row[n..].iter().zip(out[n..].iter_mut()) {
            let e = mask_below(exp_approx((*x - shift) * scale), *x, floor);
            *o = e;
            total += e;
        }
        total
    }
}

multiversion! {
    /// Scales `v` by `1 / z` in place (the probabilities of a weight vector).
    fn normalise(v: &mut [f32], z: f32) -> () {
        let inv = 1.0 / z;
        for x in v {
            *x *= inv;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_approx_is_accurate_over_the_used_range() {
        let mut worst = 0.0f64;
        let mut x = -86.9f32;
        while x <= 10.0 {
            let want = f64::from(x).exp();
            let got = f64::from(exp_approx(x));
            worst = worst.max(((got - want) / want).abs());
            x += 0.0137;
        }
        assert!(worst < 5e-7, "worst relative error {worst}");
        assert_eq!(exp_approx(0.0), 1.0);
    }

    #[test]
    fn exp_approx_flushes_masked_logits_to_zero() {
        assert_eq!(exp_approx(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_approx(-200.0), 0.0);
        assert!(exp_approx(-86.0) > 0.0);
    }

    #[test]
    fn max_and_bad_flags_nan_and_pos_inf_only() {
        let row: Vec<f32> = (0..19).map(|i| i as f32).collect();
        assert_eq!(max_and_bad(&row), (18.0, false));
        let mut r = row.clone();
        r[3] = f32::NEG_INFINITY;
        assert_eq!(max_and_bad(&r), (18.0, false));
        r[17] = f32::NAN;
        assert!(max_and_bad(&r).1);
        let mut r = row.clone();
        r[18] = f32::INFINITY;
        assert!(max_and_bad(&r).1);
    }

    #[test]
    fn first_index_of_takes_the_first_of_ties() {
        assert_eq!(first_index_of(&[1.0, 3.0, 2.0, 3.0], 3.0), 1);
        assert_eq!(first_index_of(&[f32::NEG_INFINITY, -1.0], -1.0), 1);
        let mut long = vec![0.0f32; 100];
        long[37] = 2.0;
        long[90] = 2.0;
        assert_eq!(first_index_of(&long, 2.0), 37);
    }

    #[test]
    fn sums_agree_with_reference() {
        let row: Vec<f32> = (0..37).map(|i| (i as f32 * 0.37).sin() * 4.0).collect();
        let want: f64 = row.iter().map(|&x| (f64::from(x) - 1.0).exp()).sum();
        let got = sum_exp(&row, 1.0, 1.0);
        assert!((f64::from(got) - want).abs() / want < 1e-5);
        let mut out = vec![0.0; row.len()];
        let z = exp_into(&row, 1.0, 1.0, f32::NEG_INFINITY, &mut out);
        assert_eq!(z, got, "both reductions use the same order");
        let z_floor = exp_into(&row, 1.0, 1.0, 0.0, &mut out);
        assert!(out.iter().zip(&row).all(|(e, x)| (*x >= 0.0) == (*e > 0.0)));
        assert!(z_floor < z);
    }
}
