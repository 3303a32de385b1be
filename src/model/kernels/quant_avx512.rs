//! The quantised linear's AVX-512 tier (F/BW, and VNNI where the CPU has
//! it): the sums of the AVX2 tier with one 32-element block per 512-bit
//! register, so a block costs one multiply (`vpmaddwd`, or `vpdpwssd`
//! folding the add in) per activation row instead of two, and up to
//! [`MR`] activation rows share each decoded block.
//!
//! Numerics are the AVX2 tier's with 16 float lanes per output instead of
//! 8: integer sums exact, each output's float sum in an order fixed by `k`
//! alone, so batching and threading never change a bit. K-quants convert
//! once per 256-element super-block (16 products per 32-bit lane, inside
//! the bound of the `qformat` module docs).

use std::arch::x86_64::*;

use super::x86::{block_levels, block_scales, q6k_levels, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0};
use super::{k4_scales, min_term, store, ActRows, DecodedRow, Job, QFormat};

/// Activation rows multiplied against one weight row at a time (32 vector
/// registers hold 8 accumulators, 8 integer sums and the operands).
const MR: usize = 8;

#[inline(always)]
unsafe fn f16_at(p: *const u8) -> f32 {
    let h = std::ptr::read_unaligned(p as *const u16);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)))
}

/// `acc + Σ pairs of a · b` per 32-bit lane.
#[inline(always)]
unsafe fn dot_pairs<const VNNI: bool>(acc: __m512i, a: __m512i, b: __m512i) -> __m512i {
    if VNNI {
        _mm512_dpwssd_epi32(acc, a, b)
    } else {
        _mm512_add_epi32(acc, _mm512_madd_epi16(a, b))
    }
}

/// `R` activation rows from `r0` against weight row `j` of a 32-element
/// block format, decoded straight from its bytes.
#[inline(always)]
unsafe fn tile_direct<const R: usize, const F: u8, const VNNI: bool>(
    job: &Job<'_>,
    j: usize,
    r0: usize,
) {
    let k = job.w.k;
    let groups = k / 32;
    let p = job.w.row(j).as_ptr();
    let bb = job.w.format.block_bytes();
    let act = ActRows::<R>::new(job, r0, 32);
    let mut acc = [_mm512_setzero_ps(); R];
    let mut mins = [0f32; R];
    for g in 0..groups {
        let b = p.add(g * bb);
        let wv = _mm512_cvtepi8_epi16(block_levels::<F>(b));
        let (d, min) = block_scales::<F>(b);
        let dw = _mm512_set1_ps(d);
        for i in 0..R {
            let xv = _mm512_loadu_si512(act.q[i].add(32 * g) as *const __m512i);
            let t = dot_pairs::<VNNI>(_mm512_setzero_si512(), wv, xv);
            let scale = _mm512_mul_ps(dw, _mm512_set1_ps(*act.d[i].add(g)));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), scale, acc[i]);
            if F == Q4_1 || F == Q5_1 {
                mins[i] = min.mul_add(*act.sum[i].add(g), mins[i]);
            }
        }
    }
    for i in 0..R {
        store(job, r0 + i, j, _mm512_reduce_add_ps(acc[i]) + mins[i]);
    }
}

/// `R` activation rows from `r0` against the decoded weight row `w`, in
/// groups of `G` elements (converted to float once per group).
#[inline(always)]
unsafe fn tile<const R: usize, const G: usize, const VNNI: bool>(
    job: &Job<'_>,
    w: &DecodedRow,
    j: usize,
    r0: usize,
) {
    let k = job.w.k;
    let groups = k / G;
    let a = job.acts;
    let act = ActRows::<R>::new(job, r0, G);
    let wq = w.w.as_ptr();
    let mut acc = [_mm512_setzero_ps(); R];
    for g in 0..groups {
        let mut isum = [_mm512_setzero_si512(); R];
        for s in 0..G / 32 {
            let e = g * G + 32 * s;
            let wv = _mm512_loadu_si512(wq.add(e) as *const __m512i);
            for (t, x) in isum.iter_mut().zip(&act.q) {
                let xv = _mm512_loadu_si512(x.add(e) as *const __m512i);
                *t = dot_pairs::<VNNI>(*t, wv, xv);
            }
        }
        let dw = _mm512_set1_ps(*w.d.get_unchecked(g));
        for i in 0..R {
            let scale = _mm512_mul_ps(dw, _mm512_set1_ps(*act.d[i].add(g)));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[i]), scale, acc[i]);
        }
    }
    for (i, c) in acc.iter().enumerate() {
        let mut v = _mm512_reduce_add_ps(*c);
        if job.w.format.has_min() {
            let r = r0 + i;
            v += min_term(&w.min, &a.sum[r * k / 32..(r + 1) * k / 32]);
        }
        store(job, r0 + i, j, v);
    }
}

/// `R` activation rows from `r0` against Q4_K weight row `j`, decoded
/// straight from its bytes into registers: the integer products of
/// [`tile`] over the decoded row, in the same lanes and with the same
/// conversions (so bit-identical to it), without the scratch row's store
/// and reload, which at a few rows cost more than the multiplies. The
/// row's mins land in `w.min` for the min term.
#[inline(always)]
unsafe fn tile_q4k<const R: usize, const VNNI: bool>(
    job: &Job<'_>,
    w: &mut DecodedRow,
    j: usize,
    r0: usize,
) {
    let k = job.w.k;
    let groups = k / 256;
    let a = job.acts;
    let p = job.w.row(j).as_ptr();
    let bb = job.w.format.block_bytes();
    let act = ActRows::<R>::new(job, r0, 256);
    let m4 = _mm256_set1_epi8(0xF);
    let mut acc = [_mm512_setzero_ps(); R];
    for g in 0..groups {
        let b = std::slice::from_raw_parts(p.add(g * bb), bb);
        let min: &mut [f32; 8] = (&mut w.min[8 * g..8 * g + 8]).try_into().unwrap();
        let (d, sc) = k4_scales(b, min);
        let mut isum = [_mm512_setzero_si512(); R];
        for c in 0..4 {
            let v = _mm256_loadu_si256(b.as_ptr().add(16 + 32 * c) as *const __m256i);
            let lo = _mm512_cvtepu8_epi16(_mm256_and_si256(v, m4));
            let hi = _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16::<4>(v), m4));
            let lo = _mm512_mullo_epi16(lo, _mm512_set1_epi16(sc[2 * c]));
            let hi = _mm512_mullo_epi16(hi, _mm512_set1_epi16(sc[2 * c + 1]));
            let e = 256 * g + 64 * c;
            for (t, x) in isum.iter_mut().zip(&act.q) {
                let x0 = _mm512_loadu_si512(x.add(e) as *const __m512i);
                let x1 = _mm512_loadu_si512(x.add(e + 32) as *const __m512i);
                *t = dot_pairs::<VNNI>(dot_pairs::<VNNI>(*t, lo, x0), hi, x1);
            }
        }
        let dw = _mm512_set1_ps(d);
        for i in 0..R {
            let scale = _mm512_mul_ps(dw, _mm512_set1_ps(*act.d[i].add(g)));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[i]), scale, acc[i]);
        }
    }
    for (i, c) in acc.iter().enumerate() {
        let r = r0 + i;
        let v = _mm512_reduce_add_ps(*c) + min_term(&w.min, &a.sum[r * k / 32..(r + 1) * k / 32]);
        store(job, r, j, v);
    }
}

/// `R` activation rows from `r0` against Q6_K weight row `j`, decoded in
/// registers; bit-identical to [`tile`] over the decoded row (as
/// [`tile_q4k`]).
#[inline(always)]
unsafe fn tile_q6k<const R: usize, const VNNI: bool>(job: &Job<'_>, j: usize, r0: usize) {
    let k = job.w.k;
    let groups = k / 256;
    let p = job.w.row(j).as_ptr();
    let bb = job.w.format.block_bytes();
    let act = ActRows::<R>::new(job, r0, 256);
    let mut acc = [_mm512_setzero_ps(); R];
    for g in 0..groups {
        let b = p.add(g * bb);
        let sc = |e: usize| *b.add(192 + e / 16) as i8 as i16;
        let mut isum = [_mm512_setzero_si512(); R];
        for h in 0..2 {
            for (c, v) in q6k_levels(b, h).into_iter().enumerate() {
                let e = 128 * h + 32 * c;
                // Elements 0–15 take one sub-block scale, 16–31 the next.
                let s = _mm512_inserti64x4::<1>(
                    _mm512_set1_epi16(sc(e)),
                    _mm256_set1_epi16(sc(e + 16)),
                );
                let wv = _mm512_mullo_epi16(_mm512_cvtepi8_epi16(v), s);
                for (t, x) in isum.iter_mut().zip(&act.q) {
                    let xv = _mm512_loadu_si512(x.add(256 * g + e) as *const __m512i);
                    *t = dot_pairs::<VNNI>(*t, wv, xv);
                }
            }
        }
        let dw = _mm512_set1_ps(f16_at(b.add(208)));
        for i in 0..R {
            let scale = _mm512_mul_ps(dw, _mm512_set1_ps(*act.d[i].add(g)));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[i]), scale, acc[i]);
        }
    }
    for (i, c) in acc.iter().enumerate() {
        store(job, r0 + i, j, _mm512_reduce_add_ps(*c));
    }
}

/// Every activation row (at most [`MR`]) against Q6_K weight row `j`,
/// decoded in registers.
#[inline(always)]
unsafe fn sweep_q6k<const VNNI: bool>(job: &Job<'_>, j: usize) {
    match job.rows {
        8 => tile_q6k::<8, VNNI>(job, j, 0),
        7 => tile_q6k::<7, VNNI>(job, j, 0),
        6 => tile_q6k::<6, VNNI>(job, j, 0),
        5 => tile_q6k::<5, VNNI>(job, j, 0),
        4 => tile_q6k::<4, VNNI>(job, j, 0),
        3 => tile_q6k::<3, VNNI>(job, j, 0),
        2 => tile_q6k::<2, VNNI>(job, j, 0),
        _ => tile_q6k::<1, VNNI>(job, j, 0),
    }
}

/// Every activation row (at most [`MR`]) against Q4_K weight row `j`,
/// decoded in registers.
#[inline(always)]
unsafe fn sweep_q4k<const VNNI: bool>(job: &Job<'_>, w: &mut DecodedRow, j: usize) {
    w.prepare(QFormat::Q4K, job.w.k);
    match job.rows {
        8 => tile_q4k::<8, VNNI>(job, w, j, 0),
        7 => tile_q4k::<7, VNNI>(job, w, j, 0),
        6 => tile_q4k::<6, VNNI>(job, w, j, 0),
        5 => tile_q4k::<5, VNNI>(job, w, j, 0),
        4 => tile_q4k::<4, VNNI>(job, w, j, 0),
        3 => tile_q4k::<3, VNNI>(job, w, j, 0),
        2 => tile_q4k::<2, VNNI>(job, w, j, 0),
        _ => tile_q4k::<1, VNNI>(job, w, j, 0),
    }
}

/// Every activation row against weight row `j` of a 32-element block
/// format, `MR` rows at a time.
#[inline(always)]
unsafe fn sweep_direct<const F: u8, const VNNI: bool>(job: &Job<'_>, j: usize) {
    let mut r = 0;
    while r < job.rows {
        let step = (job.rows - r).min(MR);
        match step {
            8 => tile_direct::<8, F, VNNI>(job, j, r),
            7 => tile_direct::<7, F, VNNI>(job, j, r),
            6 => tile_direct::<6, F, VNNI>(job, j, r),
            5 => tile_direct::<5, F, VNNI>(job, j, r),
            4 => tile_direct::<4, F, VNNI>(job, j, r),
            3 => tile_direct::<3, F, VNNI>(job, j, r),
            2 => tile_direct::<2, F, VNNI>(job, j, r),
            _ => tile_direct::<1, F, VNNI>(job, j, r),
        }
        r += step;
    }
}

/// Every activation row against the decoded weight row `w`, `MR` rows at
/// a time.
#[inline(always)]
unsafe fn sweep_decoded<const G: usize, const VNNI: bool>(job: &Job<'_>, w: &DecodedRow, j: usize) {
    let mut r = 0;
    while r < job.rows {
        let step = (job.rows - r).min(MR);
        match step {
            8 => tile::<8, G, VNNI>(job, w, j, r),
            7 => tile::<7, G, VNNI>(job, w, j, r),
            6 => tile::<6, G, VNNI>(job, w, j, r),
            5 => tile::<5, G, VNNI>(job, w, j, r),
            4 => tile::<4, G, VNNI>(job, w, j, r),
            3 => tile::<3, G, VNNI>(job, w, j, r),
            2 => tile::<2, G, VNNI>(job, w, j, r),
            _ => tile::<1, G, VNNI>(job, w, j, r),
        }
        r += step;
    }
}

/// Weight row `j` against every activation row.
#[inline(always)]
unsafe fn row<const VNNI: bool>(job: &Job<'_>, w: &mut DecodedRow, j: usize) {
    match job.w.format {
        QFormat::Q4_0 => sweep_direct::<Q4_0, VNNI>(job, j),
        QFormat::Q4_1 => sweep_direct::<Q4_1, VNNI>(job, j),
        QFormat::Q8_0 => sweep_direct::<Q8_0, VNNI>(job, j),
        QFormat::Q5_0 => sweep_direct::<Q5_0, VNNI>(job, j),
        QFormat::Q5_1 => sweep_direct::<Q5_1, VNNI>(job, j),
        // Up to one tile of rows, decoding in registers beats decoding
        // once into the scratch row; past it, decoding once wins.
        QFormat::Q4K if job.rows <= MR => sweep_q4k::<VNNI>(job, w, j),
        QFormat::Q6K if job.rows <= MR => sweep_q6k::<VNNI>(job, j),
        format => {
            // The other formats decode through the AVX2 tier's decoder
            // (SIMD for the K-quants, whose 32-byte planes suit 256-bit
            // loads).
            super::x86::decode(job, w, j);
            match format.group() {
                32 => sweep_decoded::<32, VNNI>(job, w, j),
                _ => sweep_decoded::<256, VNNI>(job, w, j),
            }
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn row_avx512(job: &Job<'_>, w: &mut DecodedRow, j: usize) {
    row::<false>(job, w, j)
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn row_avx512_vnni(job: &Job<'_>, w: &mut DecodedRow, j: usize) {
    row::<true>(job, w, j)
}
