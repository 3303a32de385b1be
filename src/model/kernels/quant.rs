//! The quantised linear: `out[r, j] (+)= Σ_e x[r, e] · W[j, e]` for f32
//! activations and weights in GGML blocks ([`QFormat`]), read where they
//! lie (a memory-mapped GGUF or candle's block storage). The lean model
//! path sends weights here when they are not repacked (`packed`: most
//! formats with 8-bit activations): always with 15-bit activations, and
//! Q5_K with 8-bit ones.
//!
//! [`qmatmul_t`] is the entry for both activation schemes: it quantises the
//! activations once per call and splits the weight rows across threads;
//! the 8-bit scheme's kernels are `quant8`'s, the 15-bit ones these.
//!
//! # Scheme (15-bit)
//! Activations are quantised once per call, in the weight format's groups,
//! to 15-bit levels ([`QuantisedRows`]; the two schemes: the `qformat`
//! module docs). Work units are runs of weight rows; a worker
//! decodes each of its rows once ([`DecodedRow`]: 16-bit levels with the
//! sub-block scales folded in) and multiplies it against every activation
//! row, `MR` at a time: the decoded row stays in L1 while the activation
//! rows stream past, so a weight is read from memory once per call however
//! many rows there are, and decoded once. (The SIMD tiers decode Q4_0,
//! Q4_1, Q5_0, Q5_1 and Q8_0 blocks in registers instead, once per `MR`
//! rows, and Q4_K and Q6_K ones when a call has at most `MR` rows: cheaper
//! than the scratch row's store and reload. Both ways give the same bits.) Per 16 elements (32 on
//! AVX-512) a tier multiplies 16-bit pairs into 32-bit sums (`vpmaddwd`,
//! or VNNI's `vpdpwssd`), converts once per group
//! (at most 128 elements), scaled by `d_w · d_x`, and a format with a min
//! adds `Σ_b min_b · d_x Σ q_x` per 32 elements.
//!
//! # Numerics
//! Integer sums are exact; each output's float sum runs over its groups in
//! a fixed order that depends only on `k`, so batching and threading never
//! change a result (the invariant of `kernels`).

use super::pool::{for_each_range, SharedMut};
#[cfg(target_arch = "x86_64")]
use super::qformat::k4_scales;
use super::qformat::{ActivationQuant, DecodedRow, QFormat, QuantisedRows, QuantisedRows8};
use super::quant8;
use super::Isa;
use std::cell::RefCell;
use std::ops::Range;

/// Weight rows per work unit.
const UNIT: usize = 8;
/// Activation rows multiplied against one decoded weight row at a time.
const MR: usize = 4;

thread_local! {
    /// Each worker's decoded weight row (workers are persistent threads).
    static DECODED: RefCell<DecodedRow> = RefCell::default();
    /// The calling thread's quantised activations (15-bit, 8-bit).
    static ACTS: RefCell<QuantisedRows> = RefCell::default();
    static ACTS8: RefCell<QuantisedRows8> = RefCell::default();
}

/// A `[n, k]` weight matrix in GGML blocks, borrowed.
#[derive(Clone, Copy)]
pub(crate) struct QMatrix<'a> {
    pub(crate) format: QFormat,
    pub(crate) bytes: &'a [u8],
    pub(crate) n: usize,
    pub(crate) k: usize,
}

impl QMatrix<'_> {
    pub(crate) fn row(&self, j: usize) -> &[u8] {
        let len = self.k / self.format.group() * self.format.block_bytes();
        &self.bytes[j * len..(j + 1) * len]
    }
}

/// What one unit of work reads and writes; `A` is the activations' form.
pub(crate) struct Job<'a, A = QuantisedRows> {
    pub(crate) w: QMatrix<'a>,
    pub(crate) acts: &'a A,
    pub(crate) rows: usize,
    out: SharedMut<f32>,
    accumulate: bool,
}

// SAFETY: workers only read `w` and `acts`, and write disjoint columns of `out`.
unsafe impl<A: Sync> Sync for Job<'_, A> {}

/// Activation rows `r0..r0 + R` as a SIMD tile reads them: each row's
/// levels, its scales (one per group of the weight format) and its sums
/// (one per 32 elements).
struct ActRows<const R: usize> {
    q: [*const i16; R],
    d: [*const f32; R],
    sum: [*const f32; R],
}

impl<const R: usize> ActRows<R> {
    /// # Safety
    /// Rows `r0..r0 + R` must be inside `job.acts`, quantised in groups of
    /// `group` elements.
    #[inline(always)]
    unsafe fn new(job: &Job<'_>, r0: usize, group: usize) -> Self {
        let (a, k) = (job.acts, job.w.k);
        Self {
            q: std::array::from_fn(|i| a.q.as_ptr().add((r0 + i) * k)),
            d: std::array::from_fn(|i| a.d.as_ptr().add((r0 + i) * (k / group))),
            sum: std::array::from_fn(|i| a.sum.as_ptr().add((r0 + i) * (k / 32))),
        }
    }
}

/// `out[r·n + j] = Σ_e x[r·k + e] · W[j, e]` (or `+=` when `accumulate`)
/// for `r < rows`, `j < n`, on up to `threads` threads, the activations
/// quantised as `quant` says.
///
/// Panics if a slice is shorter than its shape says or `k` is not a whole
/// number of the format's groups (caller bugs: loading checks both).
#[allow(clippy::too_many_arguments)]
pub(crate) fn qmatmul_t(
    isa: Isa,
    threads: usize,
    quant: ActivationQuant,
    x: &[f32],
    rows: usize,
    w: QMatrix<'_>,
    out: &mut [f32],
    accumulate: bool,
) {
    let (n, k) = (w.n, w.k);
    assert!(x.len() >= rows * k, "qmatmul_t: x shorter than rows·k");
    assert!(out.len() >= rows * n, "qmatmul_t: out shorter than rows·n");
    let bytes = w
        .format
        .matrix_bytes(n, k)
        .expect("qmatmul_t: k is not a whole number of groups");
    assert!(
        w.bytes.len() >= bytes,
        "qmatmul_t: weights shorter than n·k"
    );
    if rows == 0 || n == 0 {
        return;
    }
    let group = w.format.group();
    let out = SharedMut(out.as_mut_ptr());
    match quant {
        ActivationQuant::Int16 => ACTS.with_borrow_mut(|acts| {
            quantise(
                isa,
                |a: &mut QuantisedRows| a.quantise(x, rows, k, group),
                acts,
            );
            let job = Job {
                w,
                acts: &*acts,
                rows,
                out,
                accumulate,
            };
            // SAFETY (both arms): the tier was detected on this CPU, and
            // each column belongs to one worker.
            run(threads, &job, |dec, js| {
                js.for_each(|j| unsafe { dispatch(isa, &job, dec, j) })
            });
        }),
        ActivationQuant::Int8 => with_acts8(isa, x, rows, k, w.format, |acts| {
            let job = Job {
                w,
                acts,
                rows,
                out,
                accumulate,
            };
            run(threads, &job, |dec, js| unsafe {
                dispatch8(isa, &job, dec, js)
            });
        }),
    }
}

/// Quantises `rows` rows of `x` (`k` each) to 8 bits in `format`'s
/// groups into the calling thread's buffer, with the per-16 sums only
/// where `format` reads them, and hands them to `f`.
pub(super) fn with_acts8<T>(
    isa: Isa,
    x: &[f32],
    rows: usize,
    k: usize,
    format: QFormat,
    f: impl FnOnce(&QuantisedRows8) -> T,
) -> T {
    ACTS8.with_borrow_mut(|acts| {
        let group = format.group();
        match isa {
            // SAFETY: the tier was detected on this CPU (AVX2 at least).
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 | Isa::Avx512 | Isa::Avx512Vnni => unsafe {
                x86::quantise8(acts, x, rows, k, group)
            },
            _ => acts.quantise(x, rows, k, group),
        }
        if format == QFormat::Q6K {
            acts.sum_sixteens();
        }
        f(acts)
    })
}

/// Runs `quantise` on `acts`, compiled for the tier's vector width.
fn quantise<A>(isa: Isa, quantise: impl FnOnce(&mut A), acts: &mut A) {
    match isa {
        // SAFETY: the tier was detected on this CPU.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 | Isa::Avx512Vnni => unsafe { x86::with_avx2(|| quantise(acts)) },
        _ => quantise(acts),
    }
}

/// Weight rows of `job` in units of [`UNIT`] across `threads`, `rows`
/// multiplying a run of them against every activation row.
fn run<A: Sync>(
    threads: usize,
    job: &Job<'_, A>,
    rows: impl Fn(&mut DecodedRow, Range<usize>) + Sync,
) {
    let n = job.w.n;
    let units = n.div_ceil(UNIT);
    let grain = (units / (threads * 8)).max(1);
    for_each_range(units, grain, threads, |range| {
        DECODED.with_borrow_mut(|dec| rows(dec, range.start * UNIT..(range.end * UNIT).min(n)));
    });
}

/// Weight rows `js` against every activation row, through the 8-bit
/// scheme's kernels for `isa` (`quant8`; AVX-512 without VNNI runs the
/// AVX2 ones, whose 256-bit byte products it has).
#[inline(always)]
unsafe fn dispatch8(isa: Isa, job: &Job<'_, QuantisedRows8>, w: &mut DecodedRow, js: Range<usize>) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni => quant8::x86::rows_vnni(job, js),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx2 => quant8::x86::rows_avx2(job, js),
        _ => js.for_each(|j| quant8::row_portable(job, w, j)),
    }
}

/// Decodes weight row `j` into `w` and multiplies it by every activation row.
#[inline(always)]
unsafe fn dispatch(isa: Isa, job: &Job<'_>, w: &mut DecodedRow, j: usize) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni => avx512::row_avx512_vnni(job, w, j),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => avx512::row_avx512(job, w, j),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => match job.w.format.group() {
            32 => x86::row_avx2::<32, 32>(job, w, j),
            _ => x86::row_avx2::<256, 128>(job, w, j),
        },
        _ => {
            w.decode(job.w.format, job.w.row(j), job.w.k);
            row_portable(job, w, j)
        }
    }
}

/// Writes (or adds) `v` at output element `(r, j)`.
#[inline(always)]
pub(crate) unsafe fn store<A>(job: &Job<'_, A>, r: usize, j: usize, v: f32) {
    let o = job.out.at(r * job.w.n + j);
    if job.accumulate {
        *o += v;
    } else {
        *o = v;
    }
}

/// `Σ_b min[b] · sum[b]`: the min term of one output, 8 lanes reduced
/// pairwise (the same order on every tier).
#[inline(always)]
pub(crate) fn min_term(min: &[f32], sum: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let full = min.len() / 8 * 8;
    for (m, s) in min[..full].chunks_exact(8).zip(sum[..full].chunks_exact(8)) {
        for l in 0..8 {
            lanes[l] += m[l] * s[l];
        }
    }
    for (l, (m, s)) in min[full..].iter().zip(&sum[full..]).enumerate() {
        lanes[l] += m * s;
    }
    pairwise8(&lanes)
}

/// The sum of 8 float lanes in the SIMD tiers' horizontal order: (0 + 4,
/// 2 + 6), (1 + 5, 3 + 7).
#[inline(always)]
pub(crate) fn pairwise8(l: &[f32; 8]) -> f32 {
    ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]))
}

/// Portable tier: the same sums in plain integers, 8 float lanes per
/// output as the AVX2 tier (lane `l` holds elements `2l, 2l + 1` of each 16).
unsafe fn row_portable(job: &Job<'_>, w: &DecodedRow, j: usize) {
    let f = job.w.format;
    let (k, group, chunk) = (job.w.k, f.group(), f.chunk());
    let a = job.acts;
    for r in 0..job.rows {
        let x = &a.q[r * k..(r + 1) * k];
        let mut acc = [0f32; 8];
        for g in 0..k / group {
            let scale = w.d[g] * a.d[r * (k / group) + g];
            for c in (g * group..(g + 1) * group).step_by(chunk) {
                let mut isum = [0i32; 8];
                for e in c..c + chunk {
                    isum[(e % 16) / 2] += w.w[e] as i32 * x[e] as i32;
                }
                for l in 0..8 {
                    acc[l] += isum[l] as f32 * scale;
                }
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
#[path = "quant_avx512.rs"]
mod avx512;

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use std::arch::x86_64::*;

    use super::{
        k4_scales, min_term, store, ActRows, DecodedRow, Job, QFormat, QuantisedRows8, MR,
    };
    use crate::model::kernels::qformat::LEVELS8;

    #[inline(always)]
    pub(crate) unsafe fn hsum(v: __m256) -> f32 {
        // The portable tier's pairwise order: (0+4, 2+6), (1+5, 3+7).
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let t = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)))
    }

    /// `R` activation rows from `r0` against decoded weight row `j`, in
    /// groups of `G` elements converted to float every `CH`.
    #[inline(always)]
    unsafe fn tile<const R: usize, const G: usize, const CH: usize>(
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
        let mut acc = [_mm256_setzero_ps(); R];
        for g in 0..groups {
            let dw = _mm256_set1_ps(*w.d.get_unchecked(g));
            let scale: [__m256; R] =
                std::array::from_fn(|i| _mm256_mul_ps(dw, _mm256_broadcast_ss(&*act.d[i].add(g))));
            for c in 0..G / CH {
                let mut isum = [_mm256_setzero_si256(); R];
                for s in 0..CH / 16 {
                    let e = g * G + c * CH + 16 * s;
                    let wv = _mm256_loadu_si256(wq.add(e) as *const __m256i);
                    for (t, x) in isum.iter_mut().zip(&act.q) {
                        let xv = _mm256_loadu_si256(x.add(e) as *const __m256i);
                        *t = _mm256_add_epi32(*t, _mm256_madd_epi16(wv, xv));
                    }
                }
                for ((c, t), s) in acc.iter_mut().zip(&isum).zip(&scale) {
                    *c = _mm256_fmadd_ps(_mm256_cvtepi32_ps(*t), *s, *c);
                }
            }
        }
        for (i, c) in acc.iter().enumerate() {
            let mut v = hsum(*c);
            if job.w.format.has_min() {
                let r = r0 + i;
                v += min_term(&w.min, &a.sum[r * k / 32..(r + 1) * k / 32]);
            }
            store(job, r0 + i, j, v);
        }
    }

    /// [`QuantisedRows8::quantise`] in AVX2 intrinsics, the same bits: its
    /// loops did not vectorise (the `f32::max` fold of the group's
    /// magnitude, the saturating `as i8`), and took 2 ns an element, 3 µs
    /// for a 1 536-wide row: a fifth of a small projection's call.
    /// The levels are `v · (1 / d)` clamped to ±127 (NaN to 0, as `as i8` makes
    /// it) and rounded by `vcvtps2dq`, which rounds to nearest, ties to
    /// even, as [`super::qformat`]'s scalar rounding does.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn quantise8(
        a: &mut QuantisedRows8,
        x: &[f32],
        rows: usize,
        k: usize,
        group: usize,
    ) {
        a.size(rows, k, group);
        let x = &x[..rows * k];
        let sign = _mm256_set1_ps(-0.0);
        let (lo, hi) = (_mm256_set1_ps(-LEVELS8), _mm256_set1_ps(LEVELS8));
        let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        let (flip, zero) = (_mm256_set1_epi8(-128), _mm256_setzero_si256());
        for (g, xs) in x.chunks_exact(group).enumerate() {
            let mut m = _mm256_setzero_ps();
            for c in xs.chunks_exact(8) {
                // A NaN lane keeps `m` (the second operand), as `f32::max` does.
                m = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(c.as_ptr())), m);
            }
            let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
            let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            let amax = _mm_cvtss_f32(_mm_max_ss(m2, _mm_shuffle_ps::<1>(m2, m2)));
            let d = amax / LEVELS8;
            a.d[g] = d;
            let id = _mm256_set1_ps(if d > 0.0 { 1.0 / d } else { 0.0 });
            let level = |c: &[f32], i: usize| {
                let v = _mm256_mul_ps(_mm256_loadu_ps(c.as_ptr().add(8 * i)), id);
                let v = _mm256_and_ps(v, _mm256_cmp_ps::<_CMP_ORD_Q>(v, v));
                _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, lo), hi))
            };
            for (b, c) in xs.chunks_exact(32).enumerate() {
                let block = (g * group) / 32 + b;
                let words = (
                    _mm256_packs_epi32(level(c, 0), level(c, 1)),
                    _mm256_packs_epi32(level(c, 2), level(c, 3)),
                );
                // packs interleaves the 128-bit lanes: dwords a0 b0 c0 d0 a1 b1 c1 d1.
                let q = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(words.0, words.1), order);
                let qu = _mm256_xor_si256(q, flip);
                _mm256_storeu_si256(a.q.as_mut_ptr().add(32 * block) as *mut __m256i, q);
                _mm256_storeu_si256(a.qu.as_mut_ptr().add(32 * block) as *mut __m256i, qu);
                // Σ qu over the 32 bytes, less 32 · 128: Σ q.
                let sad = _mm256_sad_epu8(qu, zero);
                let pair = _mm_add_epi64(
                    _mm256_castsi256_si128(sad),
                    _mm256_extracti128_si256::<1>(sad),
                );
                let s = (_mm_cvtsi128_si64(pair) + _mm_extract_epi64::<1>(pair)) as i32 - 32 * 128;
                a.qsum[block] = s as i16;
                a.sum[block] = d * s as f32;
                a.qoff[block] = -128 * s;
            }
        }
    }

    /// Runs `f` (inlined into it) with AVX2 enabled, so its loops
    /// vectorise 8 wide.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn with_avx2(f: impl FnOnce()) {
        f()
    }

    #[inline(always)]
    pub(crate) unsafe fn f16_at(p: *const u8) -> f32 {
        let h = std::ptr::read_unaligned(p as *const u16);
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)))
    }

    /// 32 levels (`i8` lanes, signed or not) widened to two vectors of 16
    /// `i16`s.
    #[inline(always)]
    unsafe fn widen(v: __m256i, signed: bool) -> (__m256i, __m256i) {
        let (lo, hi) = (_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        if signed {
            (_mm256_cvtepi8_epi16(lo), _mm256_cvtepi8_epi16(hi))
        } else {
            (_mm256_cvtepu8_epi16(lo), _mm256_cvtepu8_epi16(hi))
        }
    }

    /// Stores 32 levels widened to `i16` times the scales `s0` (first 16)
    /// and `s1`.
    #[inline(always)]
    unsafe fn store_scaled(p: *mut i16, v: __m256i, signed: bool, s0: i16, s1: i16) {
        let (lo, hi) = widen(v, signed);
        let lo = _mm256_mullo_epi16(lo, _mm256_set1_epi16(s0));
        let hi = _mm256_mullo_epi16(hi, _mm256_set1_epi16(s1));
        _mm256_storeu_si256(p as *mut __m256i, lo);
        _mm256_storeu_si256(p.add(16) as *mut __m256i, hi);
    }

    /// The levels `q − 32` of half `h` (128 elements) of the Q6_K block at
    /// `b`, as four vectors of 32 `i8`s in element order: `ql: [u8; 128]`
    /// (low 4 bits), `qh: [u8; 64]` (high 2 bits), as ggml lays them out.
    #[inline(always)]
    pub(crate) unsafe fn q6k_levels(b: *const u8, h: usize) -> [__m256i; 4] {
        let (m4, m2) = (_mm256_set1_epi8(0xF), _mm256_set1_epi8(3));
        let ql0 = _mm256_loadu_si256(b.add(64 * h) as *const __m256i);
        let ql1 = _mm256_loadu_si256(b.add(64 * h + 32) as *const __m256i);
        let qh = _mm256_loadu_si256(b.add(128 + 32 * h) as *const __m256i);
        let high = |bits: __m256i| _mm256_slli_epi16::<4>(_mm256_and_si256(bits, m2));
        let levels = [
            _mm256_or_si256(_mm256_and_si256(ql0, m4), high(qh)),
            _mm256_or_si256(_mm256_and_si256(ql1, m4), high(_mm256_srli_epi16::<2>(qh))),
            _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16::<4>(ql0), m4),
                high(_mm256_srli_epi16::<4>(qh)),
            ),
            _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16::<4>(ql1), m4),
                high(_mm256_srli_epi16::<6>(qh)),
            ),
        ];
        levels.map(|v| _mm256_sub_epi8(v, _mm256_set1_epi8(32)))
    }

    /// Decodes row `j` into `w`, as [`DecodedRow::decode`] does: the
    /// K-quants in SIMD, Q5_K through the reference decoder (the formats
    /// [`tile_direct`] reads never come here).
    #[inline(always)]
    pub(super) unsafe fn decode(job: &Job<'_>, w: &mut DecodedRow, j: usize) {
        let (format, k) = (job.w.format, job.w.k);
        let bytes = job.w.row(j);
        w.prepare(format, k);
        let bb = format.block_bytes();
        let groups = k / format.group();
        let q = w.w.as_mut_ptr();
        let p = bytes.as_ptr();
        let m4 = _mm256_set1_epi8(0xF);
        match format {
            QFormat::Q4K => {
                for g in 0..groups {
                    let b = &bytes[g * bb..(g + 1) * bb];
                    let min: &mut [f32; 8] = (&mut w.min[8 * g..8 * g + 8]).try_into().unwrap();
                    let (d, sc) = k4_scales(b, min);
                    w.d[g] = d;
                    for c in 0..4 {
                        let v = _mm256_loadu_si256(b.as_ptr().add(16 + 32 * c) as *const __m256i);
                        let lo = _mm256_and_si256(v, m4);
                        let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4);
                        let (s0, s1) = (sc[2 * c], sc[2 * c + 1]);
                        store_scaled(q.add(256 * g + 64 * c), lo, false, s0, s0);
                        store_scaled(q.add(256 * g + 64 * c + 32), hi, false, s1, s1);
                    }
                }
            }
            QFormat::Q6K => {
                for g in 0..groups {
                    let b = p.add(g * bb);
                    let sc = |e: usize| *b.add(192 + e / 16) as i8 as i16;
                    for h in 0..2 {
                        for (c, v) in q6k_levels(b, h).into_iter().enumerate() {
                            let e = 128 * h + 32 * c;
                            store_scaled(q.add(256 * g + e), v, true, sc(e), sc(e + 16));
                        }
                    }
                    w.d[g] = f16_at(b.add(208));
                }
            }
            _ => w.decode(format, bytes, k),
        }
    }

    /// Formats whose blocks a tile decodes in registers as it goes (one
    /// 32-element block at a time, no scratch row): the `F` of
    /// [`tile_direct`] and of the AVX-512 tier's twin.
    pub(crate) const Q4_0: u8 = 0;
    pub(crate) const Q4_1: u8 = 1;
    pub(crate) const Q8_0: u8 = 2;
    pub(crate) const Q5_0: u8 = 3;
    pub(crate) const Q5_1: u8 = 4;

    /// Bytes `e` of the result are `0xFF` where bit `e` of `bits` is set
    /// (ggml's `bytes_from_bits_32`).
    #[inline(always)]
    unsafe fn bytes_from_bits(bits: i32) -> __m256i {
        let spread = _mm256_shuffle_epi8(
            _mm256_set1_epi32(bits),
            _mm256_set_epi64x(
                0x0303030303030303,
                0x0202020202020202,
                0x0101010101010101,
                0,
            ),
        );
        let others = _mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
        _mm256_cmpeq_epi8(others, _mm256_set1_epi64x(-1))
    }

    /// The 32 levels of the block at `b` of direct format `F` as `i8`s in
    /// element order, centred where the format has a zero point (the
    /// decoded form of `qformat`). 4-bit formats keep element `j` in the
    /// low nibble of byte `j` and element `j + 16` in the high one; the
    /// 5-bit ones take bit `e` of `qh` as element `e`'s fifth bit.
    #[inline(always)]
    pub(crate) unsafe fn block_levels<const F: u8>(b: *const u8) -> __m256i {
        if F == Q8_0 {
            return _mm256_loadu_si256(b.add(2) as *const __m256i);
        }
        let qs = match F {
            Q4_0 => 2,
            Q4_1 => 4,
            Q5_0 => 6,
            _ => 8,
        };
        let v = _mm_loadu_si128(b.add(qs) as *const __m128i);
        let both = _mm256_set_m128i(_mm_srli_epi16::<4>(v), v);
        let mut q = _mm256_and_si256(both, _mm256_set1_epi8(0xF));
        if F == Q5_0 || F == Q5_1 {
            let qh = std::ptr::read_unaligned(b.add(qs - 4) as *const i32);
            let fifth = _mm256_and_si256(bytes_from_bits(qh), _mm256_set1_epi8(0x10));
            q = _mm256_or_si256(q, fifth);
        }
        match F {
            Q4_0 => _mm256_sub_epi8(q, _mm256_set1_epi8(8)),
            Q5_0 => _mm256_sub_epi8(q, _mm256_set1_epi8(16)),
            _ => q,
        }
    }

    /// [`block_levels`] widened to two vectors of 16 `i16`s; the 4- and
    /// 8-bit formats straight from 128-bit loads (two shuffles fewer a
    /// block, which shows at one row).
    #[inline(always)]
    unsafe fn block_halves<const F: u8>(b: *const u8) -> (__m256i, __m256i) {
        match F {
            Q8_0 => (
                _mm256_cvtepi8_epi16(_mm_loadu_si128(b.add(2) as *const __m128i)),
                _mm256_cvtepi8_epi16(_mm_loadu_si128(b.add(18) as *const __m128i)),
            ),
            Q4_0 | Q4_1 => {
                let m4 = _mm_set1_epi8(0xF);
                let v = _mm_loadu_si128(b.add(if F == Q4_1 { 4 } else { 2 }) as *const __m128i);
                let (mut l, mut h) = (
                    _mm_and_si128(v, m4),
                    _mm_and_si128(_mm_srli_epi16::<4>(v), m4),
                );
                if F == Q4_0 {
                    l = _mm_sub_epi8(l, _mm_set1_epi8(8));
                    h = _mm_sub_epi8(h, _mm_set1_epi8(8));
                }
                (_mm256_cvtepi8_epi16(l), _mm256_cvtepi8_epi16(h))
            }
            _ => widen(block_levels::<F>(b), true),
        }
    }

    /// Block `b`'s scale and min (0 without one) of direct format `F`.
    #[inline(always)]
    pub(crate) unsafe fn block_scales<const F: u8>(b: *const u8) -> (f32, f32) {
        if F == Q4_1 || F == Q5_1 {
            // d and m side by side: one conversion for both.
            let dm = _mm_cvtph_ps(_mm_cvtsi32_si128(std::ptr::read_unaligned(b as *const i32)));
            (_mm_cvtss_f32(dm), _mm_cvtss_f32(_mm_movehdup_ps(dm)))
        } else {
            (f16_at(b), 0.0)
        }
    }

    /// `R` activation rows from `r0` against weight row `j` of a 32-element
    /// block format, decoded straight from its bytes: the sums of [`tile`]
    /// over the decoded row without the scratch row's store and reload,
    /// which at one to four rows cost more than the multiplies. (The min
    /// term is one fused multiply-add per block, in block order.)
    #[inline(always)]
    unsafe fn tile_direct<const R: usize, const F: u8>(job: &Job<'_>, j: usize, r0: usize) {
        let k = job.w.k;
        let groups = k / 32;
        let p = job.w.row(j).as_ptr();
        let bb = job.w.format.block_bytes();
        let act = ActRows::<R>::new(job, r0, 32);
        let mut acc = [_mm256_setzero_ps(); R];
        let mut mins = [0f32; R];
        for g in 0..groups {
            let b = p.add(g * bb);
            let (lo, hi) = block_halves::<F>(b);
            let (d, min) = block_scales::<F>(b);
            let dw = _mm256_set1_ps(d);
            for i in 0..R {
                let x = act.q[i].add(32 * g);
                let x0 = _mm256_loadu_si256(x as *const __m256i);
                let x1 = _mm256_loadu_si256(x.add(16) as *const __m256i);
                let t = _mm256_add_epi32(_mm256_madd_epi16(lo, x0), _mm256_madd_epi16(hi, x1));
                let scale = _mm256_mul_ps(dw, _mm256_broadcast_ss(&*act.d[i].add(g)));
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), scale, acc[i]);
                if F == Q4_1 || F == Q5_1 {
                    mins[i] = min.mul_add(*act.sum[i].add(g), mins[i]);
                }
            }
        }
        for i in 0..R {
            store(job, r0 + i, j, hsum(acc[i]) + mins[i]);
        }
    }

    /// `R` activation rows from `r0` against Q4_K weight row `j`, decoded
    /// in registers: [`tile`]'s products over the decoded row, lane for
    /// lane and converted at the same points, so bit-identical to it
    /// (see the AVX-512 twin). The row's mins land in `w.min`.
    #[inline(always)]
    unsafe fn tile_q4k<const R: usize>(job: &Job<'_>, w: &mut DecodedRow, j: usize, r0: usize) {
        let k = job.w.k;
        let groups = k / 256;
        let a = job.acts;
        let p = job.w.row(j).as_ptr();
        let bb = job.w.format.block_bytes();
        let act = ActRows::<R>::new(job, r0, 256);
        let m4 = _mm256_set1_epi8(0xF);
        let mut acc = [_mm256_setzero_ps(); R];
        for g in 0..groups {
            let b = std::slice::from_raw_parts(p.add(g * bb), bb);
            let min: &mut [f32; 8] = (&mut w.min[8 * g..8 * g + 8]).try_into().unwrap();
            let (d, sc) = k4_scales(b, min);
            let dw = _mm256_set1_ps(d);
            let scale: [__m256; R] =
                std::array::from_fn(|i| _mm256_mul_ps(dw, _mm256_broadcast_ss(&*act.d[i].add(g))));
            let mut isum = [_mm256_setzero_si256(); R];
            for c in 0..4 {
                let v = _mm256_loadu_si256(b.as_ptr().add(16 + 32 * c) as *const __m256i);
                let scaled = |q: __m256i, s: i16| {
                    let (q0, q1) = widen(q, false);
                    let s = _mm256_set1_epi16(s);
                    (_mm256_mullo_epi16(q0, s), _mm256_mullo_epi16(q1, s))
                };
                let (l0, l1) = scaled(_mm256_and_si256(v, m4), sc[2 * c]);
                let (h0, h1) = scaled(
                    _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4),
                    sc[2 * c + 1],
                );
                let e = 256 * g + 64 * c;
                for (t, x) in isum.iter_mut().zip(&act.q) {
                    let m = |wv: __m256i, at: usize| {
                        _mm256_madd_epi16(wv, _mm256_loadu_si256(x.add(at) as *const __m256i))
                    };
                    let s01 = _mm256_add_epi32(m(l0, e), m(l1, e + 16));
                    let s23 = _mm256_add_epi32(m(h0, e + 32), m(h1, e + 48));
                    *t = _mm256_add_epi32(*t, _mm256_add_epi32(s01, s23));
                }
                // Converted every 128 elements, as `tile::<_, 256, 128>`.
                if c % 2 == 1 {
                    for i in 0..R {
                        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i]), scale[i], acc[i]);
                        isum[i] = _mm256_setzero_si256();
                    }
                }
            }
        }
        for (i, c) in acc.iter().enumerate() {
            let r = r0 + i;
            let v = hsum(*c) + min_term(&w.min, &a.sum[r * k / 32..(r + 1) * k / 32]);
            store(job, r, j, v);
        }
    }

    /// `R` activation rows from `r0` against Q6_K weight row `j`, decoded
    /// in registers; bit-identical to [`tile`] over the decoded row (as
    /// [`tile_q4k`]).
    #[inline(always)]
    unsafe fn tile_q6k<const R: usize>(job: &Job<'_>, j: usize, r0: usize) {
        let k = job.w.k;
        let groups = k / 256;
        let p = job.w.row(j).as_ptr();
        let bb = job.w.format.block_bytes();
        let act = ActRows::<R>::new(job, r0, 256);
        let mut acc = [_mm256_setzero_ps(); R];
        for g in 0..groups {
            let b = p.add(g * bb);
            let sc = |e: usize| _mm256_set1_epi16(*b.add(192 + e / 16) as i8 as i16);
            let dw = _mm256_set1_ps(f16_at(b.add(208)));
            let scale: [__m256; R] =
                std::array::from_fn(|i| _mm256_mul_ps(dw, _mm256_broadcast_ss(&*act.d[i].add(g))));
            // One half is one 128-element conversion chunk of `tile`.
            for h in 0..2 {
                let mut isum = [_mm256_setzero_si256(); R];
                for (c, v) in q6k_levels(b, h).into_iter().enumerate() {
                    let e = 128 * h + 32 * c;
                    let (lo, hi) = widen(v, true);
                    let (lo, hi) = (
                        _mm256_mullo_epi16(lo, sc(e)),
                        _mm256_mullo_epi16(hi, sc(e + 16)),
                    );
                    let at = 256 * g + e;
                    for (t, x) in isum.iter_mut().zip(&act.q) {
                        let x0 = _mm256_loadu_si256(x.add(at) as *const __m256i);
                        let x1 = _mm256_loadu_si256(x.add(at + 16) as *const __m256i);
                        let s =
                            _mm256_add_epi32(_mm256_madd_epi16(lo, x0), _mm256_madd_epi16(hi, x1));
                        *t = _mm256_add_epi32(*t, s);
                    }
                }
                for i in 0..R {
                    acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i]), scale[i], acc[i]);
                }
            }
        }
        for (i, c) in acc.iter().enumerate() {
            store(job, r0 + i, j, hsum(*c));
        }
    }

    #[inline(always)]
    unsafe fn rows_direct<const F: u8>(job: &Job<'_>, j: usize) {
        let mut r = 0;
        while r < job.rows {
            let step = (job.rows - r).min(MR);
            match step {
                4 => tile_direct::<4, F>(job, j, r),
                3 => tile_direct::<3, F>(job, j, r),
                2 => tile_direct::<2, F>(job, j, r),
                _ => tile_direct::<1, F>(job, j, r),
            }
            r += step;
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn row_avx2<const G: usize, const CH: usize>(
        job: &Job<'_>,
        w: &mut DecodedRow,
        j: usize,
    ) {
        match job.w.format {
            QFormat::Q4_0 => return rows_direct::<Q4_0>(job, j),
            QFormat::Q4_1 => return rows_direct::<Q4_1>(job, j),
            QFormat::Q8_0 => return rows_direct::<Q8_0>(job, j),
            QFormat::Q5_0 => return rows_direct::<Q5_0>(job, j),
            QFormat::Q5_1 => return rows_direct::<Q5_1>(job, j),
            // Up to one tile of rows, decoding in registers beats decoding
            // once into the scratch row; past it, decoding once wins.
            QFormat::Q4K if job.rows <= MR => {
                w.prepare(QFormat::Q4K, job.w.k);
                return match job.rows {
                    4 => tile_q4k::<4>(job, w, j, 0),
                    3 => tile_q4k::<3>(job, w, j, 0),
                    2 => tile_q4k::<2>(job, w, j, 0),
                    _ => tile_q4k::<1>(job, w, j, 0),
                };
            }
            QFormat::Q6K if job.rows <= MR => {
                return match job.rows {
                    4 => tile_q6k::<4>(job, j, 0),
                    3 => tile_q6k::<3>(job, j, 0),
                    2 => tile_q6k::<2>(job, j, 0),
                    _ => tile_q6k::<1>(job, j, 0),
                };
            }
            _ => {}
        }
        decode(job, w, j);
        let w = &*w;
        let mut r = 0;
        while r < job.rows {
            let step = (job.rows - r).min(MR);
            match step {
                4 => tile::<4, G, CH>(job, w, j, r),
                3 => tile::<3, G, CH>(job, w, j, r),
                2 => tile::<2, G, CH>(job, w, j, r),
                _ => tile::<1, G, CH>(job, w, j, r),
            }
            r += step;
        }
    }
}
