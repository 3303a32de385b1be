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
    let xc = x.clamp(EXP_FLUSH, EXP_MAX);
    let k = xc * LOG2E + ROUND_MAGIC;
    let n = k - ROUND_MAGIC;
    let r = xc - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4_f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 5.000_000_1e-1;
    let y = p * r * r + r + 1.0;
    // n lies in [-126, 127], so the biased exponent stays in [1, 254].
    let n_int = (k.to_bits() as i32).wrapping_sub(ROUND_MAGIC.to_bits() as i32);
    let scale = f32::from_bits((n_int.wrapping_add(127) as u32) << 23);
    if x < EXP_FLUSH {
        0.0
    } else {
        y * scale
    }
}

/// Largest value of the row and whether it holds a NaN or `+inf`, in one
/// pass (NaN is ignored by `max`, so it is tracked separately).
pub(crate) fn max_and_bad(row: &[f32]) -> (f32, bool) {
    let mut m = [f32::NEG_INFINITY; LANES];
    let mut bad = [false; LANES];
    let chunks = row.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for j in 0..LANES {
            m[j] = m[j].max(c[j]);
            bad[j] |= !(c[j] < f32::INFINITY);
        }
    }
    let mut best = f32::NEG_INFINITY;
    let mut any_bad = false;
    for j in 0..LANES {
        best = best.max(m[j]);
        any_bad |= bad[j];
    }
    for &x in tail {
        best = best.max(x);
        any_bad |= !(x < f32::INFINITY);
    }
    (best, any_bad)
}

/// Largest value of a row known to be NaN-free.
pub(crate) fn max(row: &[f32]) -> f32 {
    max_and_bad(row).0
}

/// Index of the first largest value (the seed's argmax tie rule). The row
/// must hold no NaN.
pub(crate) fn argmax(row: &[f32]) -> usize {
    let m = max(row);
    row.iter().position(|&x| x == m).unwrap_or(0)
}

/// `Σ e^{(x - shift)·scale}` over the row, in a fixed order.
pub(crate) fn sum_exp(row: &[f32], shift: f32, scale: f32) -> f32 {
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

/// Writes `out[i] = e^{(x_i - shift)·scale}` for `x_i ≥ floor`, else 0, and
/// returns their sum in the same fixed order as [`sum_exp`].
pub(crate) fn exp_into(row: &[f32], shift: f32, scale: f32, floor: f32, out: &mut [f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    let n = row.len() - row.len() % LANES;
    for (c, o) in row[..n]
        .chunks_exact(LANES)
        .zip(out[..n].chunks_exact_mut(LANES))
    {
        for j in 0..LANES {
            let e = exp_approx((c[j] - shift) * scale);
            let e = if c[j] >= floor { e } else { 0.0 };
            o[j] = e;
            acc[j] += e;
        }
    }
    let mut total = 0.0f32;
    for a in acc {
        total += a;
    }
    for (x, o) in row[n..].iter().zip(out[n..].iter_mut()) {
        let e = if *x >= floor {
            exp_approx((*x - shift) * scale)
        } else {
            0.0
        };
        *o = e;
        total += e;
    }
    total
}

/// Scales `v` by `1 / z` in place (the probabilities of a weight vector).
pub(crate) fn normalise(v: &mut [f32], z: f32) {
    let inv = 1.0 / z;
    for x in v {
        *x *= inv;
    }
}

/// Inverse CDF over `probs` in index order: the first index whose running
/// sum (in f64) exceeds `u × Σprobs`, skipping zero entries. `probs` need
/// not be normalised. Returns `None` when nothing has positive mass.
///
/// Zero entries leave the running sums bit-identical, which is why a
/// sparse walk over the kept tokens (in id order) and a dense walk over V
/// pick the same index for the same `u`.
pub(crate) fn inverse_cdf<I>(u: f64, probs: I) -> Option<usize>
where
    I: Iterator<Item = (usize, f32)> + Clone,
{
    let total: f64 = probs.clone().map(|(_, p)| f64::from(p)).sum();
    if !(total > 0.0) {
        return None;
    }
    let target = u * total;
    let mut cum = 0.0f64;
    let mut last = None;
    for (i, p) in probs {
        if p <= 0.0 {
            continue;
        }
        cum += f64::from(p);
        last = Some(i);
        if cum > target {
            return Some(i);
        }
    }
    // Rounding can leave the target just above the final sum.
    last
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
    fn argmax_takes_the_first_of_ties() {
        assert_eq!(argmax(&[1.0, 3.0, 2.0, 3.0]), 1);
        assert_eq!(argmax(&[f32::NEG_INFINITY, -1.0]), 1);
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

    #[test]
    fn inverse_cdf_walks_in_order_and_skips_zeros() {
        let p = [0.0f32, 0.25, 0.0, 0.5, 0.25];
        let it = || p.iter().copied().enumerate();
        assert_eq!(inverse_cdf(0.0, it()), Some(1));
        assert_eq!(inverse_cdf(0.2499, it()), Some(1));
        assert_eq!(inverse_cdf(0.25, it()), Some(3));
        assert_eq!(inverse_cdf(0.9999, it()), Some(4));
        assert_eq!(inverse_cdf(0.5, [(0, 0.0f32)].into_iter()), None);
        // Unnormalised weights give the same choices.
        let q: Vec<f32> = p.iter().map(|x| x * 8.0).collect();
        assert_eq!(inverse_cdf(0.3, q.iter().copied().enumerate()), Some(3));
    }
}
