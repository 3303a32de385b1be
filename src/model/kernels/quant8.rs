//! The quantised linear with 8-bit activations (`ActivationQuant::Int8`,
//! the default): ggml's arithmetic, Tandem's loop order.
//!
//! # Scheme
//! Activations are quantised once per call to 8-bit levels in the weight
//! format's groups ([`QuantisedRows8`]: a scale per 32 elements, or per
//! 256 for the K-quants, as ggml's `q8_0` / `q8_K`). A worker takes runs of
//! weight rows and multiplies each row, decoded in registers block by
//! block, against every activation row, `MR` rows at a time, so a weight
//! is read from memory once per call however many rows there are. On VNNI
//! the 32-element formats at four rows or more take 4 weight rows × 4
//! activation rows at a time instead (a register tile: each activation
//! block loaded once for 4 weight rows); every output is the same sequence
//! of operations either way, so the tiles give the same bits.
//!
//! Per 32 elements a tier forms unsigned × signed byte products: weights
//! with a fixed zero point (Q4_0, Q5_0, Q8_0, Q6_K) against the
//! activations offset to unsigned bytes (`x + 128`, the sum started at
//! `−128 Σ w`; Q8_0 on AVX2 as `|w|` times the activation with `w`'s sign,
//! `vpsignb`, whose pairs fit 16 bits), weights with a min (Q4_1, Q5_1,
//! Q4_K, Q5_K) as their raw unsigned levels against the activations. AVX2
//! sums them in pairs (`vpmaddubsw`, exact: every pair is below 2¹⁵ in
//! magnitude) and then in fours (`vpmaddwd` by ones, or by the K-quants' sub-block scales); the
//! VNNI tier does the same in one instruction (`vpdpbusd`, or `vpdpwssd`
//! for the scaled pairs), so both give the same integers. The 32-element
//! formats convert once per block, scaled by `d_w · d_x`; the K-quants
//! once per 256-element super-block, with the sub-block scales and mins
//! applied in integers (`Σ_j m_j Σ q_x` over the sub-blocks, as ggml's
//! `bsums`).
//!
//! # Numerics
//! Integer sums are exact; each output's float sum runs over its blocks in
//! an order that depends only on `k`, so batching and threading never
//! change a result (the invariant of `kernels`). The portable tier is the
//! scalar reference: the same integers over the decoded row, converted per
//! group.

use super::qformat::{DecodedRow, QuantisedRows8};
use super::quant::{min_term, pairwise8, store, Job};

/// Activation rows `r0..r0 + R` as a tile reads them: levels, scales (one
/// per group of the weight format), and per 32 elements the integer and
/// scaled sums.
pub(super) struct ActRows8<const R: usize> {
    pub(super) q: [*const i8; R],
    pub(super) qu: [*const u8; R],
    pub(super) d: [*const f32; R],
    pub(super) qsum: [*const i16; R],
    pub(super) sum: [*const f32; R],
}

impl<const R: usize> ActRows8<R> {
    /// # Safety
    /// Rows `r0..r0 + R` must be inside `job.acts`, quantised in groups of
    /// `group` elements.
    #[inline(always)]
    pub(super) unsafe fn new(job: &Job<'_, QuantisedRows8>, r0: usize, group: usize) -> Self {
        let (a, k) = (job.acts, job.w.k);
        Self {
            q: std::array::from_fn(|i| a.q.as_ptr().add((r0 + i) * k)),
            qu: std::array::from_fn(|i| a.qu.as_ptr().add((r0 + i) * k)),
            d: std::array::from_fn(|i| a.d.as_ptr().add((r0 + i) * (k / group))),
            qsum: std::array::from_fn(|i| a.qsum.as_ptr().add((r0 + i) * (k / 32))),
            sum: std::array::from_fn(|i| a.sum.as_ptr().add((r0 + i) * (k / 32))),
        }
    }
}

/// Portable tier: the integer sums over the decoded row, one float
/// conversion per group, in 8 lanes (lane `l` holds elements `4l..4l + 3`
/// of each 32, as the SIMD tiers), then the min term.
pub(super) unsafe fn row_portable(job: &Job<'_, QuantisedRows8>, w: &mut DecodedRow, j: usize) {
    let f = job.w.format;
    w.decode(f, job.w.row(j), job.w.k);
    let (k, group) = (job.w.k, f.group());
    let a = job.acts;
    for r in 0..job.rows {
        let x = &a.q[r * k..(r + 1) * k];
        let mut acc = [0f32; 8];
        for g in 0..k / group {
            let scale = w.d[g] * a.d[r * (k / group) + g];
            let mut isum = [0i32; 8];
            for e in g * group..(g + 1) * group {
                isum[(e % 32) / 4] += w.w[e] as i32 * x[e] as i32;
            }
            for l in 0..8 {
                acc[l] = (isum[l] as f32).mul_add(scale, acc[l]);
            }
        }
        let mut v = pairwise8(&acc);
        if f.has_min() {
            v += min_term(&w.min, &a.sum[r * k / 32..(r + 1) * k / 32]);
        }
        store(job, r, j, v);
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    use std::arch::x86_64::*;
    use std::ops::Range;

    use super::super::qformat::{k4_scale_bytes, QFormat, QuantisedRows8};
    use super::super::quant::x86::{
        block_levels, block_scales, f16_at, hsum, q6k_levels, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
    };
    use super::super::quant::{store, Job};
    use super::ActRows8;

    type Job8<'a> = Job<'a, QuantisedRows8>;

    /// `acc +` the 32 products of unsigned bytes `a` and signed bytes `b`,
    /// summed in fours into 8 `i32` lanes.
    #[inline(always)]
    unsafe fn dot_bytes<const VNNI: bool>(acc: __m256i, a: __m256i, b: __m256i) -> __m256i {
        if VNNI {
            _mm256_dpbusd_epi32(acc, a, b)
        } else {
            let pairs = _mm256_maddubs_epi16(a, b);
            _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
        }
    }

    /// `−128 Σ w` in the lanes of [`dot_bytes`]: where the sum of signed
    /// levels `w` against activations offset by 128 starts, so that it ends
    /// at `Σ w x`.
    #[inline(always)]
    unsafe fn offset_start<const VNNI: bool>(w: __m256i) -> __m256i {
        let zero = _mm256_setzero_si256();
        _mm256_sub_epi32(zero, dot_bytes::<VNNI>(zero, _mm256_set1_epi8(-128), w))
    }

    /// `acc +` the pairs of `i16`s `p` times the `i16` scales `s`, summed
    /// in twos into 8 `i32` lanes.
    #[inline(always)]
    unsafe fn dot_scaled<const VNNI: bool>(acc: __m256i, p: __m256i, s: __m256i) -> __m256i {
        if VNNI {
            _mm256_dpwssd_epi32(acc, p, s)
        } else {
            _mm256_add_epi32(acc, _mm256_madd_epi16(p, s))
        }
    }

    /// `R` activation rows from `r0` against weight row `j` of a 32-element
    /// block format `F`, each block decoded in registers once for all `R`.
    #[inline(always)]
    unsafe fn tile_blocks<const R: usize, const F: u8, const VNNI: bool>(
        job: &Job8<'_>,
        j: usize,
        r0: usize,
    ) {
        let with_min = F == Q4_1 || F == Q5_1;
        let p = job.w.row(j).as_ptr();
        let bb = job.w.format.block_bytes();
        let act = ActRows8::<R>::new(job, r0, 32);
        let mut acc = [_mm256_setzero_ps(); R];
        let mut mins = [0f32; R];
        // Signed weights against the offset activations `x + 128`, from
        // `−128 Σ w`: one instruction a row fewer than `|w|` against the
        // sign-flipped activation, the same integers. (AVX2's pairs would
        // overflow 16 bits with Q8_0's levels.)
        let offset = !with_min && (VNNI || F != Q8_0);
        let zero = _mm256_setzero_si256();
        for g in 0..job.w.k / 32 {
            let b = p.add(g * bb);
            let w = block_levels::<F>(b);
            let (d, min) = block_scales::<F>(b);
            let dw = _mm256_set1_ps(d);
            let unsigned = if with_min || offset {
                w
            } else {
                _mm256_sign_epi8(w, w)
            };
            let start = if offset {
                offset_start::<VNNI>(w)
            } else {
                zero
            };
            for i in 0..R {
                let t = if offset {
                    let xu = _mm256_loadu_si256(act.qu[i].add(32 * g) as *const __m256i);
                    dot_bytes::<VNNI>(start, xu, w)
                } else {
                    let x = _mm256_loadu_si256(act.q[i].add(32 * g) as *const __m256i);
                    let x = if with_min { x } else { _mm256_sign_epi8(x, w) };
                    dot_bytes::<VNNI>(zero, unsigned, x)
                };
                let scale = _mm256_mul_ps(dw, _mm256_broadcast_ss(&*act.d[i].add(g)));
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), scale, acc[i]);
                if with_min {
                    mins[i] = min.mul_add(*act.sum[i].add(g), mins[i]);
                }
            }
        }
        for i in 0..R {
            store(job, r0 + i, j, hsum(acc[i]) + mins[i]);
        }
    }

    /// `R` activation rows from `r0` against the `W` weight rows from `j0`
    /// of a 32-element block format `F` (VNNI): [`tile_blocks`]'s
    /// operations for each output, in the same order (so the same bits),
    /// with each activation block loaded once for the `W` weight rows and
    /// the `W` scale products of a row in one multiply (a register tile,
    /// as a GEMM's; `W ≤ 4`, the lanes of one `__m128`).
    #[inline(always)]
    unsafe fn tile_grid<const W: usize, const R: usize, const F: u8>(
        job: &Job8<'_>,
        j0: usize,
        r0: usize,
    ) {
        const { assert!(W <= 4) };
        let with_min = F == Q4_1 || F == Q5_1;
        let p: [*const u8; W] = std::array::from_fn(|i| job.w.row(j0 + i).as_ptr());
        let bb = job.w.format.block_bytes();
        let act = ActRows8::<R>::new(job, r0, 32);
        let zero = _mm256_setzero_si256();
        let mut acc = [[_mm256_setzero_ps(); W]; R];
        let mut mins = [_mm_setzero_ps(); R];
        for g in 0..job.w.k / 32 {
            let mut w = [zero; W];
            let mut start = [zero; W];
            let (mut d, mut m) = ([0f32; 4], [0f32; 4]);
            for i in 0..W {
                let b = p[i].add(g * bb);
                w[i] = block_levels::<F>(b);
                (d[i], m[i]) = block_scales::<F>(b);
                if !with_min {
                    start[i] = offset_start::<true>(w[i]);
                }
            }
            let dw = _mm_loadu_ps(d.as_ptr());
            let mw = _mm_loadu_ps(m.as_ptr());
            for r in 0..R {
                let dx = _mm_broadcast_ss(&*act.d[r].add(g));
                // Lane i: d_w,i · d_x, rounded once, as tile_blocks' product.
                let scale = _mm256_castps128_ps256(_mm_mul_ps(dw, dx));
                let x = if with_min {
                    _mm256_loadu_si256(act.q[r].add(32 * g) as *const __m256i)
                } else {
                    _mm256_loadu_si256(act.qu[r].add(32 * g) as *const __m256i)
                };
                for i in 0..W {
                    let t = if with_min {
                        _mm256_dpbusd_epi32(zero, w[i], x)
                    } else {
                        _mm256_dpbusd_epi32(start[i], x, w[i])
                    };
                    let si = _mm256_permutevar8x32_ps(scale, _mm256_set1_epi32(i as i32));
                    acc[r][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), si, acc[r][i]);
                }
                if with_min {
                    let sum = _mm_broadcast_ss(&*act.sum[r].add(g));
                    mins[r] = _mm_fmadd_ps(mw, sum, mins[r]);
                }
            }
        }
        for r in 0..R {
            let mut m = [0f32; 4];
            _mm_storeu_ps(m.as_mut_ptr(), mins[r]);
            for i in 0..W {
                store(job, r0 + r, j0 + i, hsum(acc[r][i]) + m[i]);
            }
        }
    }

    /// Weight rows `j0..j0 + 4` of a 32-element block format against every
    /// activation row (VNNI): [`tile_grid`] for each 4 rows, the remaining
    /// ones row by row.
    #[inline(always)]
    unsafe fn grid<const F: u8>(job: &Job8<'_>, j0: usize) {
        let full = job.rows / 4 * 4;
        for r in (0..full).step_by(4) {
            tile_grid::<4, 4, F>(job, j0, r);
        }
        for j in j0..j0 + 4 {
            match job.rows - full {
                3 => tile_blocks::<3, F, true>(job, j, full),
                2 => tile_blocks::<2, F, true>(job, j, full),
                1 => tile_blocks::<1, F, true>(job, j, full),
                _ => {}
            }
        }
    }

    /// `R` activation rows from `r0` against Q4_K (`FIVE` false) or Q5_K
    /// weight row `j`: per 32-element sub-block the byte pairs scaled by
    /// its 6-bit scale, per super-block one conversion of the sum scaled by
    /// `d · d_x` and one of `Σ_j m_j Σ q_x` scaled by `−dmin · d_x`.
    #[inline(always)]
    unsafe fn tile_k4<const R: usize, const FIVE: bool, const VNNI: bool>(
        job: &Job8<'_>,
        j: usize,
        r0: usize,
    ) {
        let p = job.w.row(j).as_ptr();
        let bb = job.w.format.block_bytes();
        let act = ActRows8::<R>::new(job, r0, 256);
        let (m4, one) = (_mm256_set1_epi8(0xF), _mm256_set1_epi8(1));
        let mut acc = [_mm256_setzero_ps(); R];
        for g in 0..job.w.k / 256 {
            let b = p.add(g * bb);
            let (sc, m) = k4_scale_bytes(std::slice::from_raw_parts(b, 16));
            let qs = b.add(if FIVE { 48 } else { 16 });
            let mut high = _mm256_loadu_si256(b.add(16) as *const __m256i);
            let mut isum = [_mm256_setzero_si256(); R];
            for c in 0..4 {
                let v = _mm256_loadu_si256(qs.add(32 * c) as *const __m256i);
                let mut lo = _mm256_and_si256(v, m4);
                let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4);
                if FIVE {
                    // Bit 2c / 2c + 1 of byte l: the fifth bit of element
                    // l of chunk c's low / high half.
                    let fifth = |bits: __m256i| _mm256_slli_epi16::<4>(_mm256_and_si256(bits, one));
                    lo = _mm256_or_si256(lo, fifth(high));
                    hi = _mm256_or_si256(hi, fifth(_mm256_srli_epi16::<1>(high)));
                    high = _mm256_srli_epi16::<2>(high);
                }
                let s_lo = _mm256_set1_epi16(sc[2 * c] as i16);
                let s_hi = _mm256_set1_epi16(sc[2 * c + 1] as i16);
                let e = 256 * g + 64 * c;
                for (t, x) in isum.iter_mut().zip(&act.q) {
                    let x0 = _mm256_loadu_si256(x.add(e) as *const __m256i);
                    let x1 = _mm256_loadu_si256(x.add(e + 32) as *const __m256i);
                    *t = dot_scaled::<VNNI>(*t, _mm256_maddubs_epi16(lo, x0), s_lo);
                    *t = dot_scaled::<VNNI>(*t, _mm256_maddubs_epi16(hi, x1), s_hi);
                }
            }
            let (d, dmin) = (f16_at(b), f16_at(b.add(2)));
            let mins = _mm_cvtepu8_epi16(_mm_loadl_epi64(m.as_ptr() as *const __m128i));
            for i in 0..R {
                let dx = *act.d[i].add(g);
                let qsum = _mm_loadu_si128(act.qsum[i].add(8 * g) as *const __m128i);
                let msum = _mm256_zextsi128_si256(_mm_madd_epi16(mins, qsum));
                acc[i] =
                    _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i]), _mm256_set1_ps(d * dx), acc[i]);
                acc[i] =
                    _mm256_fmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_set1_ps(-dmin * dx), acc[i]);
            }
        }
        for (i, a) in acc.iter().enumerate() {
            store(job, r0 + i, j, hsum(*a));
        }
    }

    /// `R` activation rows from `r0` against Q6_K weight row `j`: levels
    /// `q − 32` against the offset activations, pairs scaled by the
    /// 16-element sub-block scales, one conversion per super-block.
    #[inline(always)]
    unsafe fn tile_q6k<const R: usize, const VNNI: bool>(job: &Job8<'_>, j: usize, r0: usize) {
        let p = job.w.row(j).as_ptr();
        let bb = job.w.format.block_bytes();
        let act = ActRows8::<R>::new(job, r0, 256);
        let mut acc = [_mm256_setzero_ps(); R];
        for g in 0..job.w.k / 256 {
            let b = p.add(g * bb);
            let sc = |e: usize| *b.add(192 + e / 16) as i8 as i16;
            // The levels `q − 32` against the offset activations `x + 128`
            // (pairs below 2¹⁵: |w| ≤ 32), from `−128 Σ w` scaled as they are.
            let levels = [q6k_levels(b, 0), q6k_levels(b, 1)];
            let scales = |e: usize| {
                // Pairs 0–7 are elements 0–15 (one scale), 8–15 the next.
                _mm256_set_m128i(_mm_set1_epi16(sc(e + 16)), _mm_set1_epi16(sc(e)))
            };
            let mut offset = _mm256_setzero_si256();
            for (e, w) in (0..256).step_by(32).zip(levels.iter().flatten()) {
                let pairs = _mm256_maddubs_epi16(_mm256_set1_epi8(-128), *w);
                offset = dot_scaled::<VNNI>(offset, pairs, scales(e));
            }
            let mut isum = [_mm256_sub_epi32(_mm256_setzero_si256(), offset); R];
            for (e, w) in (0..256).step_by(32).zip(levels.iter().flatten()) {
                let s = scales(e);
                for (t, x) in isum.iter_mut().zip(&act.qu) {
                    let xv = _mm256_loadu_si256(x.add(256 * g + e) as *const __m256i);
                    *t = dot_scaled::<VNNI>(*t, _mm256_maddubs_epi16(xv, *w), s);
                }
            }
            let d = f16_at(b.add(208));
            for i in 0..R {
                let scale = _mm256_set1_ps(d * *act.d[i].add(g));
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i]), scale, acc[i]);
            }
        }
        for (i, a) in acc.iter().enumerate() {
            store(job, r0 + i, j, hsum(*a));
        }
    }

    /// Every activation row of `$job` against weight row `$j` through
    /// `$kernel`, in tiles of `MR` rows (4 on AVX2's 16 vector registers,
    /// 8 on AVX-512's 32). A macro, not a closure: the kernels must inline
    /// into the `target_feature` function that expands it.
    macro_rules! tiles {
        ($kernel:ident::<$($c:tt),*>, $job:expr, $j:expr) => {{
            let mr = if VNNI { 8 } else { 4 };
            let mut r = 0;
            while r < $job.rows {
                let rows = ($job.rows - r).min(mr);
                match rows {
                    8 => $kernel::<8, $($c),*>($job, $j, r),
                    7 => $kernel::<7, $($c),*>($job, $j, r),
                    6 => $kernel::<6, $($c),*>($job, $j, r),
                    5 => $kernel::<5, $($c),*>($job, $j, r),
                    4 => $kernel::<4, $($c),*>($job, $j, r),
                    3 => $kernel::<3, $($c),*>($job, $j, r),
                    2 => $kernel::<2, $($c),*>($job, $j, r),
                    _ => $kernel::<1, $($c),*>($job, $j, r),
                }
                r += rows;
            }
        }};
    }

    /// Weight row `j` against every activation row.
    #[inline(always)]
    unsafe fn row<const VNNI: bool>(job: &Job8<'_>, j: usize) {
        match job.w.format {
            QFormat::Q4_0 => tiles!(tile_blocks::<Q4_0, VNNI>, job, j),
            QFormat::Q4_1 => tiles!(tile_blocks::<Q4_1, VNNI>, job, j),
            QFormat::Q5_0 => tiles!(tile_blocks::<Q5_0, VNNI>, job, j),
            QFormat::Q5_1 => tiles!(tile_blocks::<Q5_1, VNNI>, job, j),
            QFormat::Q8_0 => tiles!(tile_blocks::<Q8_0, VNNI>, job, j),
            QFormat::Q4K => tiles!(tile_k4::<false, VNNI>, job, j),
            QFormat::Q5K => tiles!(tile_k4::<true, VNNI>, job, j),
            QFormat::Q6K => tiles!(tile_q6k::<VNNI>, job, j),
        }
    }

    /// Weight rows `js` against every activation row.
    pub(in super::super) unsafe fn rows_avx2(job: &Job8<'_>, js: Range<usize>) {
        for j in js {
            row_avx2(job, j)
        }
    }

    /// Weight rows `js` against every activation row.
    pub(in super::super) unsafe fn rows_vnni(job: &Job8<'_>, js: Range<usize>) {
        let mut j = js.start;
        if job.rows >= 4 && job.w.format.group() == 32 {
            while j + 4 <= js.end {
                grid_vnni(job, j);
                j += 4;
            }
        }
        for j in j..js.end {
            row_vnni(job, j)
        }
    }

    #[inline(never)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn grid_vnni(job: &Job8<'_>, j0: usize) {
        match job.w.format {
            QFormat::Q4_0 => grid::<Q4_0>(job, j0),
            QFormat::Q4_1 => grid::<Q4_1>(job, j0),
            QFormat::Q5_0 => grid::<Q5_0>(job, j0),
            QFormat::Q5_1 => grid::<Q5_1>(job, j0),
            QFormat::Q8_0 => grid::<Q8_0>(job, j0),
            other => unreachable!("{other:?} has no 32-element blocks"),
        }
    }

    // One call per weight row (or per 4 in the grid): the same kernels
    // inlined into one function with the loop over rows around them ran
    // Q8_0 at one activation row at 0.7x (BENCHMARKS.md, session 10).
    #[inline(never)]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn row_avx2(job: &Job8<'_>, j: usize) {
        row::<false>(job, j)
    }

    #[inline(never)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn row_vnni(job: &Job8<'_>, j: usize) {
        row::<true>(job, j)
    }
}
