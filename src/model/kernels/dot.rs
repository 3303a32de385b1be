//! The decode-fast linear: `out[r, j] (+)= Σ_k x[r, k] · w[j, k]` for f32
//! activations and f32 or f16 weights stored `[n, k]` (the checkpoint's own
//! layout, no repacking).
//!
//! # Why a kernel of our own
//! General GEMMs pack both operands into panels, which pays off when many
//! rows share each weight but costs a full extra pass over the weights when
//! there are 1–16 rows, where decoding lives (candle's gemm reaches ~60 % of
//! the memory roofline at one row on the llama-100m shape). Here every
//! weight is read from memory exactly once per call, for all rows at once:
//! work units are blocks of 16 weight rows; inside a unit, 4 weight rows are
//! held against 5 (AVX-512; AVX2: 3) input rows in registers, the
//! activation rows being re-read from cache; calls of 1–4 (AVX2: 1–2)
//! rows, which are memory-bound, may take the 4 weight rows one after
//! another instead, as one linear stream, where that is faster on this CPU
//! (`few_rows` times both per projection shape). 1 row and 128 run the
//! same sums.
//! f16 weights convert as they load. On AVX2 (and the portable tier), a
//! call with more activation rows than one tile takes widens each unit to
//! f32 once instead, and the f32 loop nest sweeps it: there the conversion
//! at every load was the large-batch cost. AVX-512 converts at every load
//! at any batch, which ran faster than widening (`widens`).
//!
//! # Numerics
//! Each output is a dot product accumulated lane-wise over k (16, 8 or 8
//! lanes per tier) and reduced in a fixed tree, so its value depends only on
//! its own row and column: batching and threading never change a result
//! (see the module docs of `kernels`). f16 weights are widened exactly.

use half::f16;

use std::time::Instant;

use super::few_rows::{self, Path};
use super::pool::{for_each_range, SharedMut};
use super::Isa;

/// A weight element the kernels read (widened to f32 exactly).
pub(crate) trait WElem: Copy + Send + Sync + 'static {
    /// Whether loads convert (f16): then a call with more activation rows
    /// than one tile holds widens each unit of weights once instead of at
    /// every tile.
    const CONVERTS: bool;
    /// The element's name (few-row path settlement reports it).
    const NAME: &'static str;

    fn to_f32(self) -> f32;

    /// 16 elements at `p` as f32 (AVX-512 tier only).
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512;
    /// The elements of `p` selected by `mask` (others 0) as f32; never
    /// touches unselected memory (AVX-512 tier only).
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16_masked(p: *const Self, mask: u16) -> std::arch::x86_64::__m512;
    /// 8 elements at `p` as f32 (AVX2 tier and up).
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
    /// The first `n < 8` elements at `p` as f32, the rest 0, without a
    /// call (AVX2 tier and up).
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8_partial(p: *const Self, n: usize) -> std::arch::x86_64::__m256;
}

impl WElem for f32 {
    const CONVERTS: bool = false;
    const NAME: &'static str = "f32";

    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const f32) -> std::arch::x86_64::__m512 {
        std::arch::x86_64::_mm512_loadu_ps(p)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16_masked(p: *const f32, mask: u16) -> std::arch::x86_64::__m512 {
        std::arch::x86_64::_mm512_maskz_loadu_ps(mask, p)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const f32) -> std::arch::x86_64::__m256 {
        std::arch::x86_64::_mm256_loadu_ps(p)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8_partial(p: *const f32, n: usize) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        let mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(n as i32), lanes);
        _mm256_maskload_ps(p, mask)
    }
}

impl WElem for f16 {
    const CONVERTS: bool = true;
    const NAME: &'static str = "f16";

    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const f16) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16_masked(p: *const f16, mask: u16) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p as *const i16))
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const f16) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8_partial(p: *const f16, n: usize) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // Raw bits inserted one by one and converted in-register: a copy
        // loop becomes a memcpy call and `f16::to_f32` a dispatched one.
        let bits = |i: usize| (*p.add(i)).to_bits() as i32;
        let mut v = _mm_setzero_si128();
        if n > 0 {
            v = _mm_insert_epi16::<0>(v, bits(0));
        }
        if n > 1 {
            v = _mm_insert_epi16::<1>(v, bits(1));
        }
        if n > 2 {
            v = _mm_insert_epi16::<2>(v, bits(2));
        }
        if n > 3 {
            v = _mm_insert_epi16::<3>(v, bits(3));
        }
        if n > 4 {
            v = _mm_insert_epi16::<4>(v, bits(4));
        }
        if n > 5 {
            v = _mm_insert_epi16::<5>(v, bits(5));
        }
        if n > 6 {
            v = _mm_insert_epi16::<6>(v, bits(6));
        }
        _mm256_cvtph_ps(v)
    }
}

/// Weight rows per work unit: 16 rows of k = 2048 f32 are 128 KiB, which
/// stays in L2 while every activation chunk passes over it.
const UNIT: usize = 16;
/// Activation bytes per chunk that a unit is swept with (L2-resident).
const X_CHUNK_BYTES: usize = 256 << 10;
/// Most weight bytes one grab of the shared cursor takes. About 8 grabs per
/// thread balance the threads' finishing times on small weights; on large
/// ones (the unembedding) 1/16 of the weight is several MiB, and the thread
/// left with the last grab ran alone for up to a sixteenth of the call.
/// Smaller grabs on small weights cost more than they save (each restarts
/// the hardware prefetcher's streams). Measured on single-stream f32 decode
/// (BENCHMARKS.md).
const MAX_GRAB_BYTES: usize = 1 << 20;

/// One `matmul_t` call's operands, shared by the workers.
struct Job<W> {
    x: *const f32,
    /// Distance between activation rows.
    ldx: usize,
    k: usize,
    w: *const W,
    /// Distance between weight rows.
    ldw: usize,
    out: SharedMut<f32>,
    /// Distance between output rows.
    ldo: usize,
    accumulate: bool,
    /// Whether the call has few rows (at most [`FEW_ROWS`]): then even
    /// its widest tiles prefetch as far as the narrow ones.
    few_rows: bool,
    /// Whether the call streams each group's weight rows one after another
    /// (a projection of a few rows: `may_stream`, `few_rows`) instead of
    /// tiling them.
    streamed: bool,
    /// Whether the weights are a unit of f16 widened into the worker's
    /// cache ([`widen_unit`]): nothing to prefetch.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    widened: bool,
    /// Whether a streamed call on the AVX-512 tiers loads and multiplies
    /// each 16-lane step as two 256-bit halves ([`Path::Halves`]).
    halves: bool,
}

/// Calls of at most this many activation rows (decode batches,
/// speculative verification) prefetch 8 KiB ahead in every tile.
const FEW_ROWS: usize = 16;

impl<W> Clone for Job<W> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<W> Copy for Job<W> {}

// SAFETY: workers only read `x` and `w`, and write disjoint columns of `out`.
unsafe impl<W: Sync> Sync for Job<W> {}

/// `out[r·n + j] = Σ_k x[r·k + k'] · w[j·k + k']` (or `+=` when
/// `accumulate`) for `r < rows`, `j < n`, on up to `threads` threads.
///
/// Panics if a slice is shorter than its shape says (a caller bug).
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul_t<W: WElem>(
    isa: Isa,
    threads: usize,
    x: &[f32],
    rows: usize,
    k: usize,
    w: &[W],
    n: usize,
    out: &mut [f32],
    accumulate: bool,
) {
    let shape = few_rows::Shape {
        isa,
        elem: W::NAME,
        rows,
        n,
        k,
    };
    let (path, trial) = if may_stream(isa, rows) && n > 0 && k > 0 {
        few_rows::choose(shape)
    } else {
        (Path::Tile, None)
    };
    let start = trial.map(|_| Instant::now());
    matmul_t_on(isa, path, threads, x, rows, k, w, n, out, accumulate);
    if let (Some(trial), Some(start)) = (trial, start) {
        few_rows::record(trial, start.elapsed());
    }
}

/// [`matmul_t`] with the few-row path given: `Path::Stream` and
/// `Path::Halves` stream calls of the rows [`may_stream`] allows and tile
/// the rest.
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul_t_on<W: WElem>(
    isa: Isa,
    path: Path,
    threads: usize,
    x: &[f32],
    rows: usize,
    k: usize,
    w: &[W],
    n: usize,
    out: &mut [f32],
    accumulate: bool,
) {
    assert!(x.len() >= rows * k, "matmul_t: x shorter than rows·k");
    assert!(w.len() >= n * k, "matmul_t: w shorter than n·k");
    assert!(out.len() >= rows * n, "matmul_t: out shorter than rows·n");
    if rows == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            out[..rows * n].fill(0.0);
        }
        return;
    }
    let job = Job {
        x: x.as_ptr(),
        ldx: k,
        k,
        w: w.as_ptr(),
        ldw: k,
        out: SharedMut(out.as_mut_ptr()),
        ldo: n,
        accumulate,
        few_rows: rows <= FEW_ROWS,
        widened: false,
        streamed: path != Path::Tile && may_stream(isa, rows),
        halves: path == Path::Halves,
    };
    let units = n.div_ceil(UNIT);
    let unit_bytes = UNIT * k * std::mem::size_of::<W>();
    let grain = (units / (threads * 8))
        .min(MAX_GRAB_BYTES / unit_bytes)
        .max(1);
    let widen = W::CONVERTS && rows > tile_rows(isa) && widens(isa);
    for_each_range(units, grain, threads, |range| {
        for u in range {
            let wr = u * UNIT..((u + 1) * UNIT).min(n);
            // SAFETY: the ranges are inside the asserted shapes and each
            // unit's columns belong to this worker alone.
            unsafe {
                if widen {
                    WIDE.with_borrow_mut(|wide| {
                        let job = widen_unit(isa, &job, wr.clone(), wide);
                        sweep(isa, &job, wr, rows);
                    });
                } else {
                    sweep(isa, &job, wr, rows);
                }
            }
        }
    });
}

thread_local! {
    /// A worker's unit of converting weights widened to f32 (workers are
    /// persistent threads, so it is allocated once per shape).
    static WIDE: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Activation rows one tile of `isa` multiplies against each weight load.
fn tile_rows(isa: Isa) -> usize {
    match isa {
        Isa::Avx512 | Isa::Avx512Vnni => 5,
        Isa::Avx2 => 3,
        Isa::Portable => 1,
    }
}

/// Whether converting weights (f16) are widened to f32 once per unit when
/// a call has more rows than a tile, rather than converted at every load.
/// AVX2 widens: its conversions at every tile's load ran B = 16 at 0.7–0.8×
/// of widening. AVX-512 converts at every load: a 512-bit conversion per
/// weight load is cheaper than storing the widened unit and reading it
/// back, 1.2–2.3× at B = 8–32 and a median 1.08× at B = 64 (AMD EPYC, Zen 4).
/// BENCHMARKS.md, session 22. The sums are the same bit for bit either way.
fn widens(isa: Isa) -> bool {
    !matches!(isa, Isa::Avx512 | Isa::Avx512Vnni)
}

/// Whether a projection of `rows` activation rows may stream each group of
/// 4 weight rows one after another instead of tiling them ([`few_rows`]
/// measures which is faster per shape). Such calls are memory-bound; with
/// more rows the streamed path's one FMA chain per weight row becomes the
/// bound (a unit's rows are in cache by then): AVX2 calls of 4 rows ran
/// 0.77–0.93× with their last row streamed. BENCHMARKS.md, session 21.
/// Either path gives the same sums, bit for bit.
fn may_stream(isa: Isa, rows: usize) -> bool {
    match isa {
        Isa::Avx512 | Isa::Avx512Vnni => rows <= 4,
        Isa::Avx2 => rows <= 2,
        Isa::Portable => false,
    }
}

/// Weight rows `wr` against every activation row, in L2-sized chunks.
#[inline(always)]
unsafe fn sweep<W: WElem>(isa: Isa, job: &Job<W>, wr: std::ops::Range<usize>, rows: usize) {
    let chunk_rows = (X_CHUNK_BYTES / (4 * job.k)).max(8);
    let mut r0 = 0;
    while r0 < rows {
        let r1 = (r0 + chunk_rows).min(rows);
        dispatch(isa, job, wr.clone(), r0..r1);
        r0 = r1;
    }
}

/// Widens weight rows `wr` of `job` into `wide` and returns `job` reading
/// them from there. Widening is exact and the kernels load f32 and
/// converted elements into the same lanes, so the results are the
/// converting kernel's, bit for bit.
///
/// # Safety
/// `wr` must be inside the job's weights.
unsafe fn widen_unit<W: WElem>(
    isa: Isa,
    job: &Job<W>,
    wr: std::ops::Range<usize>,
    wide: &mut Vec<f32>,
) -> Job<f32> {
    let k = job.k;
    wide.resize(wr.len() * k, 0.0);
    for (i, j) in wr.clone().enumerate() {
        let src = std::slice::from_raw_parts(job.w.add(j * job.ldw), k);
        let dst = &mut wide[i * k..(i + 1) * k];
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 | Isa::Avx512 | Isa::Avx512Vnni => x86::widen_avx2(src, dst),
            _ => dst.iter_mut().zip(src).for_each(|(d, s)| *d = s.to_f32()),
        }
    }
    Job {
        x: job.x,
        ldx: job.ldx,
        k,
        // Row `wr.start` of the weights is row 0 of `wide`; only rows in
        // `wr` are ever addressed (see `group_rows`).
        w: wide.as_ptr().wrapping_sub(wr.start * k),
        ldw: k,
        out: job.out,
        ldo: job.ldo,
        accumulate: job.accumulate,
        few_rows: job.few_rows,
        widened: true,
        streamed: job.streamed,
        halves: job.halves,
    }
}

#[inline(always)]
unsafe fn dispatch<W: WElem>(
    isa: Isa,
    job: &Job<W>,
    wr: std::ops::Range<usize>,
    xr: std::ops::Range<usize>,
) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx512Vnni => x86::block_avx512(job, wr, xr),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => x86::block_avx2(job, wr, xr),
        _ => portable_block(job, wr, xr),
    }
}

/// The 4 weight-row pointers of the group at `j0`; a short last group
/// repeats its last row (computed, never stored) so every output goes
/// through the same 4-wide reduction.
#[inline(always)]
unsafe fn group_rows<W>(job: &Job<W>, j0: usize, end: usize) -> ([*const W; 4], usize) {
    let nw = (end - j0).min(4);
    // `wrapping_add`: a widened unit's base pointer lies before its buffer
    // (`widen_unit`); the rows themselves are always inside.
    let rows = std::array::from_fn(|t| job.w.wrapping_add((j0 + t.min(nw - 1)) * job.ldw));
    (rows, nw)
}

/// Writes (or adds) the first `nw` of 4 sums at `o`.
#[inline(always)]
unsafe fn store4(o: *mut f32, v: [f32; 4], nw: usize, accumulate: bool) {
    for (j, &s) in v.iter().enumerate().take(nw) {
        if accumulate {
            *o.add(j) += s;
        } else {
            *o.add(j) = s;
        }
    }
}

const PL: usize = 8;

/// Portable tier: 8 lanes per accumulator, plain multiply-add (the target
/// may not have FMA), reduced pairwise.
unsafe fn portable_block<W: WElem>(
    job: &Job<W>,
    wr: std::ops::Range<usize>,
    xr: std::ops::Range<usize>,
) {
    let k = job.k;
    let mut j0 = wr.start;
    while j0 < wr.end {
        let (w, nw) = group_rows(job, j0, wr.end);
        for r in xr.clone() {
            let x = job.x.add(r * job.ldx);
            let mut acc = [[0f32; PL]; 4];
            let mut kk = 0;
            while kk < k {
                let len = (k - kk).min(PL);
                let xs = std::slice::from_raw_parts(x.add(kk), len);
                for (a, wj) in acc.iter_mut().zip(&w) {
                    let ws = std::slice::from_raw_parts(wj.add(kk), len);
                    for ((a, &xv), &wv) in a.iter_mut().zip(xs).zip(ws) {
                        *a += xv * wv.to_f32();
                    }
                }
                kk += PL;
            }
            let sums =
                acc.map(|a| ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7])));
            store4(job.out.at(r * job.ldo + j0), sums, nw, job.accumulate);
        }
        j0 += 4;
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{group_rows, store4, Job, WElem};

    /// Sums of a, b, c, d (one per lane of the result).
    #[inline(always)]
    pub(super) unsafe fn reduce4_512(a: __m512, b: __m512, c: __m512, d: __m512) -> __m128 {
        let ab = _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x44>(a, b),
            _mm512_shuffle_f32x4::<0xEE>(a, b),
        );
        let cd = _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x44>(c, d),
            _mm512_shuffle_f32x4::<0xEE>(c, d),
        );
        // 128-bit lane i now holds 4 partial sums of operand i.
        let q = _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x88>(ab, cd),
            _mm512_shuffle_f32x4::<0xDD>(ab, cd),
        );
        let t = _mm512_add_ps(q, _mm512_permute_ps::<0b01_00_11_10>(q));
        let u = _mm512_add_ps(t, _mm512_permute_ps::<0b10_11_00_01>(t));
        let idx = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
        _mm512_castps512_ps128(_mm512_permutexvar_ps(idx, u))
    }

    #[inline(always)]
    pub(super) unsafe fn reduce4_256(a: __m256, b: __m256, c: __m256, d: __m256) -> __m128 {
        let t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
        _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps::<1>(t))
    }

    /// Writes (or adds) the first `nw` lanes of `v` at `o`.
    #[inline(always)]
    unsafe fn store_m128(o: *mut f32, v: __m128, nw: usize, accumulate: bool) {
        if nw >= 4 {
            let v = if accumulate {
                _mm_add_ps(_mm_loadu_ps(o), v)
            } else {
                v
            };
            _mm_storeu_ps(o, v);
        } else {
            let mut lanes = [0f32; 4];
            _mm_storeu_ps(lanes.as_mut_ptr(), v);
            store4(o, lanes, nw, accumulate);
        }
    }

    /// How far ahead of the loads a tile of `rows` rows prefetches its
    /// weights: 8 KiB, except the 5-row tile in calls of many rows (4
    /// KiB). Near memory-bound tiles gain from the longer lead: against 4
    /// KiB, SmolLM2's f32 decode at B = 3 / 4 / 5 ran 9 / 12 / 12 % faster
    /// (alternating runs; B = 8 and 16 within noise); a prompt's 5-row
    /// tiles were no faster (llama-100m, B = 64 and prompt: within noise,
    /// a little below). BENCHMARKS.md, session 15.
    #[inline(always)]
    fn prefetch_bytes<W>(job: &Job<W>, rows: usize) -> usize {
        if rows >= 5 && !job.few_rows {
            4096
        } else {
            8192
        }
    }

    /// Asks L2 for the weights `bytes` past column `kk` of each of the
    /// four weight rows `w`. Into L2, not L1: four streams 8 KiB ahead are
    /// the whole of a Zen 4 core's 32 KiB L1, and prefetched lines were
    /// evicted before their loads came. With `prefetcht1` instead of
    /// `prefetcht0`, f32 and f16 passes of 3-64 rows ran 1.03-1.44x faster
    /// on the AVX-512 tier (most at 5 and 8 rows; prompts level), on a
    /// 2-core AMD EPYC (Zen 4), alternating builds (BENCHMARKS.md, issue
    /// 22, session 51). Not measured on Zen 5 or Intel hosts.
    #[inline(always)]
    unsafe fn ahead_l2<W>(w: [*const W; 4], kk: usize, bytes: usize) {
        for p in w {
            let line = (p.wrapping_add(kk) as *const i8).wrapping_add(bytes);
            _mm_prefetch::<_MM_HINT_T1>(line);
        }
    }

    /// MR activation rows × 4 weight rows, 16 lanes, the rows interleaved:
    /// each weight load serves MR rows from registers (calls of a few rows
    /// take [`rows16`] instead).
    #[inline(always)]
    unsafe fn tile16<const MR: usize, W: WElem>(
        job: &Job<W>,
        r: usize,
        w: [*const W; 4],
        o: *mut f32,
        nw: usize,
    ) {
        let (k, ldx, x) = (job.k, job.ldx, job.x.add(r * job.ldx));
        let mut a = [[_mm512_setzero_ps(); 4]; MR];
        let full = k / 16 * 16;
        let mut kk = 0;
        while kk < full {
            // Software prefetch (BENCHMARKS.md):
            // - three rows or more: 4–8 KiB ahead in each weight stream
            //   (`prefetch_bytes`), so the FMAs do not wait on the hardware
            //   prefetcher (Zen 5, f16 at 4 rows: 25 % faster), into L2
            //   ([`ahead_l2`]);
            // - one or two rows of f32 (memory-bound): none. The hardware
            //   prefetcher covers the four adjacent rows, and prefetch
            //   instructions made the loop 10–21 % slower than without
            //   them (without, it reads as fast as a plain streaming sum);
            // - one or two rows of f16, which convert every load: the same
            //   columns of the next tile's rows (3–7 points closer to the roofline
            //   than none, six alternating runs).
            // The last two were measured when calls of one or two rows
            // took this tile; they now stream (`rows16`), and these rules
            // serve the last rows of larger calls.
            // A prefetch past the last tile is never dereferenced and
            // cannot fault.
            if MR > 2 {
                ahead_l2(w, kk, prefetch_bytes(job, MR));
            } else if std::mem::size_of::<W>() < 4 {
                for p in w {
                    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(kk + 4 * job.ldw) as *const i8);
                }
            }
            let wv: [__m512; 4] = std::array::from_fn(|j| W::load16(w[j].add(kk)));
            for (i, ai) in a.iter_mut().enumerate() {
                let xv = _mm512_loadu_ps(x.add(i * ldx + kk));
                for (aij, &wj) in ai.iter_mut().zip(&wv) {
                    *aij = _mm512_fmadd_ps(xv, wj, *aij);
                }
            }
            kk += 16;
        }
        if full < k {
            // Masked loads: no call on this path, since a call would make
            // LLVM keep a stack copy of every accumulator (zmm registers
            // are caller-saved) inside the loop above.
            let mask: __mmask16 = (1u32 << (k - full)) as u16 - 1;
            let wv: [__m512; 4] = std::array::from_fn(|j| W::load16_masked(w[j].add(full), mask));
            for (i, ai) in a.iter_mut().enumerate() {
                let xv = _mm512_maskz_loadu_ps(mask, x.add(i * ldx + full));
                for (aij, &wj) in ai.iter_mut().zip(&wv) {
                    *aij = _mm512_fmadd_ps(xv, wj, *aij);
                }
            }
        }
        // Constant indices only: an accumulator reached through a runtime
        // index or a slice makes LLVM mirror the whole tile on the stack in
        // the loop above (measured: half the FLOP rate).
        for (i, ai) in a.iter().enumerate() {
            let s = reduce4_512(ai[0], ai[1], ai[2], ai[3]);
            store_m128(o.add(i * job.ldo), s, nw, job.accumulate);
        }
    }

    /// MR activation rows × 4 weight rows, the weight rows one after
    /// another: one linear stream over the group's weights, for calls of a
    /// few rows ([`may_stream`]). Each output's sum is the
    /// tile's (the same lane-wise FMAs over k, the same reduction), bit
    /// for bit. `HALVES` runs each 16-lane step as two 256-bit ones, lanes
    /// 0–7 and 8–15 in separate registers: the same lane-wise FMAs, so
    /// the same bits, in two dependency chains where one row has one. On
    /// a Zen 4 EPYC one f32 row streamed so ran 1.06–1.14× faster, two or
    /// three rows level or slower ([`few_rows`] times the paths per
    /// shape).
    #[inline(always)]
    unsafe fn rows16<const MR: usize, const HALVES: bool, W: WElem>(
        job: &Job<W>,
        r: usize,
        w: [*const W; 4],
        o: *mut f32,
        nw: usize,
    ) {
        let (k, ldx, x) = (job.k, job.ldx, job.x.add(r * job.ldx));
        let full = k / 16 * 16;
        let mut sums = [[_mm512_setzero_ps(); 4]; MR];
        for (j, &p) in w.iter().enumerate() {
            let mut a = [_mm512_setzero_ps(); MR];
            let mut kk = 0;
            if HALVES {
                let mut lo = [_mm256_setzero_ps(); MR];
                let mut hi = [_mm256_setzero_ps(); MR];
                while kk < full {
                    let (wl, wh) = (W::load8(p.add(kk)), W::load8(p.add(kk + 8)));
                    for i in 0..MR {
                        let xi = x.add(i * ldx + kk);
                        lo[i] = _mm256_fmadd_ps(_mm256_loadu_ps(xi), wl, lo[i]);
                        hi[i] = _mm256_fmadd_ps(_mm256_loadu_ps(xi.add(8)), wh, hi[i]);
                    }
                    kk += 16;
                }
                for (ai, (l, h)) in a.iter_mut().zip(lo.into_iter().zip(hi)) {
                    *ai = join256(l, h);
                }
            }
            while kk < full {
                let wv = W::load16(p.add(kk));
                for (i, ai) in a.iter_mut().enumerate() {
                    *ai = _mm512_fmadd_ps(_mm512_loadu_ps(x.add(i * ldx + kk)), wv, *ai);
                }
                kk += 16;
            }
            if full < k {
                let mask: __mmask16 = (1u32 << (k - full)) as u16 - 1;
                let wv = W::load16_masked(p.add(full), mask);
                for (i, ai) in a.iter_mut().enumerate() {
                    let xv = _mm512_maskz_loadu_ps(mask, x.add(i * ldx + full));
                    *ai = _mm512_fmadd_ps(xv, wv, *ai);
                }
            }
            for (s, ai) in sums.iter_mut().zip(a) {
                s[j] = ai;
            }
        }
        for (i, si) in sums.iter().enumerate() {
            let s = reduce4_512(si[0], si[1], si[2], si[3]);
            store_m128(o.add(i * job.ldo), s, nw, job.accumulate);
        }
    }

    /// [`rows16`] in halves or not, as the call's path says.
    #[inline(always)]
    unsafe fn streamed16<const MR: usize, W: WElem>(
        job: &Job<W>,
        r: usize,
        w: [*const W; 4],
        o: *mut f32,
        nw: usize,
    ) {
        if job.halves {
            rows16::<MR, true, W>(job, r, w, o, nw)
        } else {
            rows16::<MR, false, W>(job, r, w, o, nw)
        }
    }

    /// `lo` in lanes 0–7 and `hi` in lanes 8–15 (AVX-512F alone, no DQ).
    #[inline(always)]
    unsafe fn join256(lo: __m256, hi: __m256) -> __m512 {
        let lo = _mm512_castpd256_pd512(_mm256_castps_pd(lo));
        _mm512_castpd_ps(_mm512_insertf64x4::<1>(lo, _mm256_castps_pd(hi)))
    }

    /// MR activation rows × 4 weight rows, 8 lanes, interleaved (calls of a
    /// few rows take [`rows8`] instead).
    #[inline(always)]
    unsafe fn tile8<const MR: usize, W: WElem>(
        job: &Job<W>,
        r: usize,
        w: [*const W; 4],
        o: *mut f32,
        nw: usize,
    ) {
        let (k, ldx, x) = (job.k, job.ldx, job.x.add(r * job.ldx));
        let mut a = [[_mm256_setzero_ps(); 4]; MR];
        let full = k / 8 * 8;
        let mut kk = 0;
        while kk < full {
            // Calls of 3-16 rows prefetch as `tile16` does (without it, 3
            // rows ran slower than 2; with it, f32 passes of 3-16 rows ran
            // 1.1-1.75x faster on the EPYC's AVX2 tier, f16 ones of 3 rows
            // 1.3x). Calls of more rows (B = 64, prompts) ran slower with
            // it, and so did widened f16 units, already in cache
            // (BENCHMARKS.md, issue 22, session 51).
            if MR > 2 && job.few_rows && !job.widened {
                ahead_l2(w, kk, prefetch_bytes(job, MR));
            }
            for j in 0..4 {
                let wv = W::load8(w[j].add(kk));
                for (i, ai) in a.iter_mut().enumerate() {
                    ai[j] = _mm256_fmadd_ps(_mm256_loadu_ps(x.add(i * ldx + kk)), wv, ai[j]);
                }
            }
            kk += 8;
        }
        if full < k {
            // No calls here (see tile16).
            let n = k - full;
            for j in 0..4 {
                let wv = W::load8_partial(w[j].add(full), n);
                for (i, ai) in a.iter_mut().enumerate() {
                    let xv = f32::load8_partial(x.add(i * ldx + full), n);
                    ai[j] = _mm256_fmadd_ps(xv, wv, ai[j]);
                }
            }
        }
        for (i, ai) in a.iter().enumerate() {
            let s = reduce4_256(ai[0], ai[1], ai[2], ai[3]);
            store_m128(o.add(i * job.ldo), s, nw, job.accumulate);
        }
    }

    /// [`rows16`] for 8 lanes: [`tile8`]'s sums, bit for bit.
    #[inline(always)]
    unsafe fn rows8<const MR: usize, W: WElem>(
        job: &Job<W>,
        r: usize,
        w: [*const W; 4],
        o: *mut f32,
        nw: usize,
    ) {
        let (k, ldx, x) = (job.k, job.ldx, job.x.add(r * job.ldx));
        let full = k / 8 * 8;
        let mut sums = [[_mm256_setzero_ps(); 4]; MR];
        for (j, &p) in w.iter().enumerate() {
            let mut a = [_mm256_setzero_ps(); MR];
            let mut kk = 0;
            while kk < full {
                let wv = W::load8(p.add(kk));
                for (i, ai) in a.iter_mut().enumerate() {
                    *ai = _mm256_fmadd_ps(_mm256_loadu_ps(x.add(i * ldx + kk)), wv, *ai);
                }
                kk += 8;
            }
            if full < k {
                let n = k - full;
                let wv = W::load8_partial(p.add(full), n);
                for (i, ai) in a.iter_mut().enumerate() {
                    let xv = f32::load8_partial(x.add(i * ldx + full), n);
                    *ai = _mm256_fmadd_ps(xv, wv, *ai);
                }
            }
            for (s, ai) in sums.iter_mut().zip(a) {
                s[j] = ai;
            }
        }
        for (i, si) in sums.iter().enumerate() {
            let s = reduce4_256(si[0], si[1], si[2], si[3]);
            store_m128(o.add(i * job.ldo), s, nw, job.accumulate);
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub(super) unsafe fn block_avx512<W: WElem>(
        job: &Job<W>,
        wr: std::ops::Range<usize>,
        xr: std::ops::Range<usize>,
    ) {
        let mut j0 = wr.start;
        while j0 < wr.end {
            let (w, nw) = group_rows(job, j0, wr.end);
            let mut r = xr.start;
            while r < xr.end {
                let o = job.out.at(r * job.ldo + j0);
                // 5 × 4 accumulators + 4 weights + 1 activation leave room in
                // the 32 registers; at 6 rows LLVM mirrors the tile on the
                // stack every iteration (measured: half the FLOP rate).
                let step = (xr.end - r).min(5);
                match step {
                    4 if job.streamed => streamed16::<4, W>(job, r, w, o, nw),
                    3 if job.streamed => streamed16::<3, W>(job, r, w, o, nw),
                    2 if job.streamed => streamed16::<2, W>(job, r, w, o, nw),
                    1 if job.streamed => streamed16::<1, W>(job, r, w, o, nw),
                    5 => tile16::<5, W>(job, r, w, o, nw),
                    4 => tile16::<4, W>(job, r, w, o, nw),
                    3 => tile16::<3, W>(job, r, w, o, nw),
                    2 => tile16::<2, W>(job, r, w, o, nw),
                    _ => tile16::<1, W>(job, r, w, o, nw),
                }
                r += step;
            }
            j0 += 4;
        }
    }

    /// `dst[i] = src[i]` widened to f32, 8 at a time.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn widen_avx2<W: WElem>(src: &[W], dst: &mut [f32]) {
        let full = src.len() / 8 * 8;
        for i in (0..full).step_by(8) {
            _mm256_storeu_ps(dst.as_mut_ptr().add(i), W::load8(src.as_ptr().add(i)));
        }
        for (d, s) in dst[full..].iter_mut().zip(&src[full..]) {
            *d = s.to_f32();
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn block_avx2<W: WElem>(
        job: &Job<W>,
        wr: std::ops::Range<usize>,
        xr: std::ops::Range<usize>,
    ) {
        let mut j0 = wr.start;
        while j0 < wr.end {
            let (w, nw) = group_rows(job, j0, wr.end);
            let mut r = xr.start;
            while r < xr.end {
                let o = job.out.at(r * job.ldo + j0);
                let step = (xr.end - r).min(3);
                match step {
                    2 if job.streamed => rows8::<2, W>(job, r, w, o, nw),
                    1 if job.streamed => rows8::<1, W>(job, r, w, o, nw),
                    3 => tile8::<3, W>(job, r, w, o, nw),
                    2 => tile8::<2, W>(job, r, w, o, nw),
                    _ => tile8::<1, W>(job, r, w, o, nw),
                }
                r += step;
            }
            j0 += 4;
        }
    }
}
