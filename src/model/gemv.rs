//! Small-batch projections on CUDA: Tandem's GEMV kernel (`cuda/gemv.cu`)
//! for the few rows of a decode step.
//!
//! At one to a few rows a projection is a stream over its weights, and
//! cuBLAS's GEMM tiles reach 1–1.7 TB/s on the H200 for the small matrices
//! of a layer (Nsight Compute, BENCHMARKS.md): the kernel spreads each
//! output row over up to 8 warps, enough to keep the GPU loading, and
//! every lane streams full 16-byte packs instead. Its sums run in an
//! order that does not depend on the row count, so wherever it takes the
//! rows ([`Rows`]: up to 9, against any weights, unless `TANDEM_GEMV=fast`)
//! a row's projections are the same bits in any pass: a decode row in any
//! batch of up to 9 rows, and a lone stream's verifying pass of 8 drafts
//! row for row as its one-row passes. The MLP's
//! fused gate/up projection can end in SiLU(gate) · up (one launch instead
//! of two).
//!
//! A projection can also take its input still to be normed
//! ([`Normed`]): each block then computes the rows' residual add and
//! RMSNorm into shared memory first, so the norm needs no launch either.
//!
//! `TANDEM_BATCH_INVARIANT=1` makes the kernel take every projection, of
//! any rows, in chunks of up to 9 (one launch: a chunk a `blockIdx.y`),
//! so that on a GPU no row's bits depend on its batch at all: prompt rows,
//! decode batches of any size and several streams' verifying passes
//! alike, as vLLM's batch-invariant mode and SGLang's deterministic
//! inference do, at the cost of cuBLAS's tensor-core tiles past 9 rows.
//!
//! Everything else (more rows, other devices, builds without `cuda`,
//! `TANDEM_GEMV=0`) returns `None` and the caller multiplies as before.

use candle_core::Tensor;

use super::fused::Normed;

/// Most rows one launch takes (the kernel's instantiations), against any
/// weights: one token and the default 8 drafts, a lone stream's verifying
/// pass, so that pass computes each row as a one-row pass does (cuBLAS's
/// tiles sum in other orders, and a greedy near-tie then flips: 11 of 13
/// speculating runs of one H100 answered with other tokens than without
/// speculation before, none of the 10 logged after; BENCHMARKS.md, issue
/// 18).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const INVARIANT_ROWS: usize = 9;

/// Rows the `fast` mode's kernel takes against small weights.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const FAST_SMALL_ROWS: usize = 8;

/// Rows the `fast` mode's kernel takes against any weights. Above this it
/// reads every x pack once per output row, and on the 1B model's
/// projections cuBLAS's tiles win at 4 rows (2 430 against 3 048 tok/s,
/// H200, BENCHMARKS.md).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const FAST_ANY_WEIGHTS_ROWS: usize = 2;

/// Weights small enough that the `fast` mode's kernel takes up to
/// [`FAST_SMALL_ROWS`] rows: there cuBLAS's tiles leave the GPU idle
/// (SmolLM2's projections, 0.7–3.5 MB, are 7 % faster at 4 rows through
/// the kernel).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const SMALL_WEIGHT_BYTES: usize = 4 << 20;

/// Which row counts the kernel takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Rows {
    /// The default: up to [`INVARIANT_ROWS`] against any weights, so a
    /// row's bits never depend on which other rows (up to that many) share
    /// its pass.
    Invariant,
    /// `TANDEM_GEMV=fast`: cuBLAS from 3 rows against weights over
    /// [`SMALL_WEIGHT_BYTES`] and from 9 against smaller ones, where its
    /// tiles are faster (a 1B-class model's projections at 3–9 rows); a
    /// verifying pass's greedy tokens may then differ from a plain pass's.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Fast,
    /// `TANDEM_BATCH_INVARIANT=1`: every row count against any weights,
    /// in launches of chunks of up to [`INVARIANT_ROWS`], so no row's bits
    /// depend on the rest of its pass.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    All,
}

impl Rows {
    /// The most rows the kernel takes against `weight_bytes` of weights.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    fn most(self, weight_bytes: usize) -> usize {
        match self {
            Rows::All => usize::MAX,
            Rows::Invariant => INVARIANT_ROWS,
            Rows::Fast if weight_bytes <= SMALL_WEIGHT_BYTES => FAST_SMALL_ROWS,
            Rows::Fast => FAST_ANY_WEIGHTS_ROWS,
        }
    }

    /// Whether the kernel takes `m` rows against `weight_bytes` of weights.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    fn take(self, m: usize, weight_bytes: usize) -> bool {
        (1..=self.most(weight_bytes)).contains(&m)
    }

    /// The most rows one chunk of a launch takes (a launch of more rows
    /// runs chunks of this many, and one of the rest).
    fn per_chunk(self, weight_bytes: usize) -> usize {
        self.most(weight_bytes).min(INVARIANT_ROWS)
    }

    /// Whether a projection of `k`-wide rows of `dtype` by `weight_bytes`
    /// of weights norms its input in its own launch: when the most rows a
    /// chunk takes and the norm weight fit the launch's shared memory. A
    /// function of the shapes alone, so every row count the kernel takes
    /// folds the norm or none does, and a row's bits do not depend on its
    /// batch.
    fn fold_norm(self, k: usize, dtype: candle_core::DType, weight_bytes: usize) -> bool {
        (self.per_chunk(weight_bytes) + 1) * k * dtype.size_in_bytes() <= NORMED_BYTES
    }
}

/// `x · wᵀ` (`x: [m, k]`, `w: [n, k]`, one dtype) by the kernel, or `None`
/// where it does not apply.
pub(super) fn project(x: &Tensor, w: &Tensor) -> candle_core::Result<Option<Tensor>> {
    launch(x, w, false, None)
}

/// `silu(x · gᵀ) · (x · uᵀ)` for the fused gate/up weights `w = [g; u]`
/// (`[2n, k]`, gate rows first): `[m, n]` in one launch, or `None` where
/// the kernel does not apply.
pub(super) fn project_swiglu(x: &Tensor, w: &Tensor) -> candle_core::Result<Option<Tensor>> {
    launch(x, w, true, None)
}

/// The projection by `w` of `input`'s normed rows (the SwiGLU activation
/// for fused gate/up weights with `swiglu`) and the residual sum `x +
/// addend` (`x` itself without an addend), in one launch; `None` where the
/// kernel does not apply or the normed rows do not fit its shared memory.
pub(super) fn project_normed(
    input: &Normed<'_>,
    w: &Tensor,
    swiglu: bool,
) -> candle_core::Result<Option<(Tensor, Tensor)>> {
    #[cfg(feature = "cuda")]
    if setting() == "plain" {
        return Ok(None);
    }
    let x = &input.x;
    let fits = x.rank() == 2
        && taken_rows().fold_norm(
            x.dim(1)?,
            x.dtype(),
            w.elem_count() * w.dtype().size_in_bytes(),
        )
        && input.norm.dims() == [x.dim(1)?]
        && input.norm.dtype() == x.dtype()
        && input.norm.is_contiguous()
        && (input.addend.as_ref()).is_none_or(|a| a.dims() == x.dims() && a.dtype() == x.dtype());
    if !fits {
        return Ok(None);
    }
    let Some(out) = launch(x, w, swiglu, Some(input))? else {
        return Ok(None);
    };
    let (m, k) = x.dims2()?;
    let n = w.dim(0)? / if swiglu { 2 } else { 1 };
    let y = out.narrow(0, 0, m * n)?.reshape((m, n))?;
    let residual = match &input.addend {
        Some(_) => {
            let at = residual_offset(m * n, x.dtype());
            out.narrow(0, at, m * k)?.reshape((m, k))?
        }
        None => x.clone(),
    };
    Ok(Some((y, residual)))
}

/// Warps per block (the kernel's `WARPS`).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const WARPS: usize = 8;
/// Warps a launch should keep busy: about what an H100/H200 holds at once
/// (132 SMs × 64).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const TARGET_WARPS: usize = 8192;

/// 16-byte packs a lane keeps in flight (the kernel's `UNROLL`).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const UNROLL: usize = 4;

/// How many warps share one output row of an `[n, k]` projection (1, 2, 4
/// or 8) whose 16-byte packs hold `pack` elements: enough that `n` rows
/// keep [`TARGET_WARPS`] warps loading, never more than the row has passes
/// of 32 packs, and no more than it takes for each warp's span to load in
/// one round of [`UNROLL`] packs per lane (more warps only add blocks,
/// each norming the rows again: +5 % at B = 1 on the 1B model without
/// them, H200). A function of the shape alone, so the sum order never
/// depends on the rows.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn warps_per_row(n: usize, k: usize, pack: usize) -> usize {
    let passes = k.div_ceil(32 * pack);
    let one_round = |split: usize| passes.div_ceil(split) <= UNROLL;
    let mut split = 1;
    while split < WARPS && n * split < TARGET_WARPS && split * 2 <= passes && !one_round(split) {
        split *= 2;
    }
    split
}

/// Where the residual rows start in a norm launch's flat output: after the
/// `projected` elements, at a 16-byte boundary (the next projection reads
/// them in packs).
fn residual_offset(projected: usize, dtype: candle_core::DType) -> usize {
    projected.next_multiple_of(16 / dtype.size_in_bytes())
}

/// The most bytes of rows a launch norms itself, with its norm weight (its
/// shared memory, under the 48 KiB a launch takes without opting in): 9
/// rows of SmolLM2's 576 in f32, 9 of the 1B model's 2 048 in bf16 (a
/// launch of fewer rows takes less). Every block norms its rows with its
/// first weight packs already loading; when the norm ran before the first
/// load instead, it paid at SmolLM2's 576-wide rows (+5 % at B = 1) and
/// cost at the 1B model's 2 048 (−3 %; H200, BENCHMARKS.md). Wider rows
/// get the norm kernel.
const NORMED_BYTES: usize = 40 * 1024;

#[cfg(not(feature = "cuda"))]
fn launch(
    _: &Tensor,
    _: &Tensor,
    _: bool,
    _: Option<&Normed<'_>>,
) -> candle_core::Result<Option<Tensor>> {
    Ok(None)
}

/// One launch; with a norm, the output is flat: `[m·n]` projection rows,
/// then (from [`residual_offset`]) `[m·k]` residual rows when there is an
/// addend.
#[cfg(feature = "cuda")]
fn launch(
    x: &Tensor,
    w: &Tensor,
    swiglu: bool,
    norm: Option<&Normed<'_>>,
) -> candle_core::Result<Option<Tensor>> {
    if !enabled() || !x.device().is_cuda() || x.rank() != 2 || w.rank() != 2 {
        return Ok(None);
    }
    let ((m, width), (rows, k)) = (x.dims2()?, w.dims2()?);
    let packed = 16 / x.dtype().size_in_bytes();
    // 16-byte packs of w's rows, and of x's unless the kernel norms x
    // into shared memory first.
    let aligned = |t: &Tensor| t.layout().start_offset().is_multiple_of(packed);
    let fits = taken_rows().take(m, w.elem_count() * w.dtype().size_in_bytes())
        && width == k
        && (!swiglu || rows.is_multiple_of(2))
        && x.dtype() == w.dtype()
        && k.is_multiple_of(packed)
        && w.is_contiguous()
        && aligned(w);
    if !fits {
        return Ok(None);
    }
    // x, the addend and the norm weight are read in packs too.
    let x = x.contiguous()?;
    let addend = match norm.and_then(|n| n.addend.as_ref()) {
        Some(a) => Some(a.contiguous()?),
        None => None,
    };
    let norm_packed = norm.is_none_or(|n| n.norm.is_contiguous() && aligned(n.norm));
    if !aligned(&x) || !addend.as_ref().is_none_or(aligned) || !norm_packed {
        return Ok(None);
    }
    let op = kernel::Gemv {
        swiglu,
        norm: norm.map(|n| kernel::Norm {
            addend: addend.as_ref(),
            weight: n.norm,
            eps: n.eps,
        }),
    };
    Ok(Some(x.apply_op2_no_bwd(w, &op)?))
}

/// `TANDEM_GEMV=0` sends every projection to cuBLAS; `TANDEM_GEMV=plain`
/// keeps the kernel but gives the residual add and norm their own launch
/// (A/B switches); `TANDEM_GEMV=fast` takes the [`Rows::Fast`] rows.
/// Read once per process.
#[cfg(feature = "cuda")]
fn setting() -> &'static str {
    static MODE: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    MODE.get_or_init(|| std::env::var("TANDEM_GEMV").unwrap_or_default())
}

/// `TANDEM_BATCH_INVARIANT=1` (or `true`): [`Rows::All`], whatever
/// `TANDEM_GEMV` says. Read once per process.
#[cfg(feature = "cuda")]
fn batch_invariant() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        std::env::var("TANDEM_BATCH_INVARIANT").is_ok_and(|v| matches!(v.as_str(), "1" | "true"))
    })
}

#[cfg(feature = "cuda")]
fn enabled() -> bool {
    setting() != "0" || batch_invariant()
}

/// The row counts the kernel takes in this process.
#[cfg(feature = "cuda")]
fn taken_rows() -> Rows {
    if batch_invariant() {
        Rows::All
    } else if setting() == "fast" {
        Rows::Fast
    } else {
        Rows::Invariant
    }
}

#[cfg(not(feature = "cuda"))]
fn taken_rows() -> Rows {
    Rows::Invariant
}

/// The most rows a GPU pass may hold with every row's projections the
/// same bits as in a one-row pass (`None`: any): what the kernel takes
/// against any weights, 1 where cuBLAS takes every projection.
pub(super) fn invariant_rows() -> Option<usize> {
    #[cfg(feature = "cuda")]
    if !enabled() {
        return Some(1);
    }
    match taken_rows() {
        Rows::All => None,
        rows => Some(rows.most(usize::MAX)),
    }
}

/// `count` chunks of `rows` rows each, the first at row `row0`: one launch.
#[derive(Debug, PartialEq, Eq)]
struct Chunks {
    rows: usize,
    count: usize,
    row0: usize,
}

/// The launches of an `m`-row projection: up to [`INVARIANT_ROWS`] rows in
/// one; more as whole chunks of that many, then one of the rest.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn chunks(m: usize) -> Vec<Chunks> {
    let rows = m.min(INVARIANT_ROWS);
    if rows == 0 {
        return Vec::new();
    }
    let rest = m % rows;
    let mut out = vec![Chunks {
        rows,
        count: m / rows,
        row0: 0,
    }];
    if rest > 0 {
        out.push(Chunks {
            rows: rest,
            count: 1,
            row0: m - rest,
        });
    }
    out
}

#[cfg(feature = "cuda")]
mod kernel {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{
        CudaView, DeviceRepr, LaunchConfig, PushKernelArg,
    };
    use candle_core::cuda_backend::{CudaDType, WrapErr};
    use candle_core::{CudaStorage, CustomOp2, DType, Layout, Shape, Tensor};

    const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/gemv.ptx"));
    const MODULE: &str = "tandem_gemv";
    use super::super::cuda_view::with_view;
    use super::{chunks, warps_per_row, Chunks, WARPS};

    pub(super) struct Gemv<'a> {
        pub(super) swiglu: bool,
        pub(super) norm: Option<Norm<'a>>,
    }

    /// The norm prologue's operands (`rms_norm(x + addend) · weight`).
    pub(super) struct Norm<'a> {
        pub(super) addend: Option<&'a Tensor>,
        pub(super) weight: &'a Tensor,
        pub(super) eps: f32,
    }

    impl Gemv<'_> {
        fn run<T: CudaDType + DeviceRepr>(
            &self,
            suffix: &str,
            (x, xl): (&CudaStorage, &Layout),
            (w, wl): (&CudaStorage, &Layout),
        ) -> candle_core::Result<(CudaStorage, Shape)> {
            let (m, _) = xl.shape().dims2()?;
            let (rows, k) = wl.shape().dims2()?;
            let n = if self.swiglu { rows / 2 } else { rows };
            let pack = 16 / std::mem::size_of::<T>();
            let aligned = |l: &Layout| l.start_offset().is_multiple_of(pack);
            if !aligned(wl) || !aligned(xl) {
                candle_core::bail!("gemv: operands off a 16-byte boundary");
            }
            let view = |s, l| super::super::cuda_view::contiguous::<T>(s, l, "gemv");
            let (xv, wv) = (view(x, xl)?, view(w, wl)?);
            let dev = x.device().clone();
            let swiglu = if self.swiglu { "swiglu_" } else { "" };
            let residual = match &self.norm {
                Some(Norm {
                    addend: Some(_), ..
                }) => m * k,
                _ => 0,
            };
            let at = super::residual_offset(m * n, x.dtype());
            // SAFETY: the kernel writes every element but the padding
            // before `at`, which nothing reads.
            let mut out = unsafe { dev.alloc::<T>(at + residual)? };
            let split = warps_per_row(n, k, pack);
            let groups = n.div_ceil(WARPS / split).max(1);
            let (n32, k32, split32) = (n as u32, k as u32, split as u32);
            let (mut y, mut res) = out.split_at_mut(at);
            let mut launch = |addend: Option<CudaView<'_, T>>,
                              weight: Option<CudaView<'_, T>>,
                              eps: f32|
             -> candle_core::Result<()> {
                for Chunks { rows, count, row0 } in chunks(m) {
                    let name = format!("gemv_{swiglu}{suffix}_m{rows}");
                    let func = dev.get_or_load_custom_func(&name, MODULE, PTX)?;
                    // Every block norms its chunk's rows (from L2) while its
                    // weights load, into shared rows and a copy of the norm
                    // weight.
                    let normed = match self.norm {
                        Some(_) => (rows + 1) * k * std::mem::size_of::<T>(),
                        None => 0,
                    };
                    let cfg = LaunchConfig {
                        grid_dim: (groups as u32, count as u32, 1),
                        block_dim: (32 * WARPS as u32, 1, 1),
                        shared_mem_bytes: normed as u32,
                    };
                    let (null, row0) = (0u64, row0 as u32);
                    let mut b = func.builder();
                    b.arg(&xv);
                    b.arg(&wv);
                    b.arg(&mut y);
                    b.arg(&n32);
                    b.arg(&k32);
                    b.arg(&split32);
                    match &addend {
                        Some(a) => b.arg(a),
                        None => b.arg(&null),
                    };
                    match &weight {
                        Some(w) => b.arg(w),
                        None => b.arg(&null),
                    };
                    b.arg(&eps);
                    if residual > 0 {
                        b.arg(&mut res);
                    } else {
                        b.arg(&null);
                    }
                    b.arg(&row0);
                    // SAFETY: argument types match the kernel; the chunks'
                    // rows (row0 + rows · blockIdx.y onwards) and packs stay
                    // inside x ([m, k]) and w ([n, k], or [2n, k] for
                    // SwiGLU); the residual rows exist where an addend does.
                    unsafe { b.launch(cfg) }.w()?;
                }
                Ok(())
            };
            match &self.norm {
                None => launch(None, None, 0.0)?,
                Some(norm) => with_view::<T, _>(norm.weight, "gemv", |weight| match norm.addend {
                    Some(a) => {
                        with_view::<T, _>(a, "gemv", |a| launch(Some(a), Some(weight), norm.eps))
                    }
                    None => launch(None, Some(weight), norm.eps),
                })?,
            }
            let shape = if self.norm.is_some() {
                Shape::from(at + residual)
            } else {
                Shape::from((m, n))
            };
            Ok((CudaStorage::wrap_cuda_slice(out, dev), shape))
        }
    }

    impl CustomOp2 for Gemv<'_> {
        fn name(&self) -> &'static str {
            "gemv"
        }

        crate::cuda_only::cuda_only_cpu_fwd!(CustomOp2);

        fn cuda_fwd(
            &self,
            x: &CudaStorage,
            xl: &Layout,
            w: &CudaStorage,
            wl: &Layout,
        ) -> candle_core::Result<(CudaStorage, Shape)> {
            let args = ((x, xl), (w, wl));
            match x.dtype() {
                DType::F32 => self.run::<f32>("f32", args.0, args.1),
                DType::F16 => self.run::<half::f16>("f16", args.0, args.1),
                DType::BF16 => self.run::<half::bf16>("bf16", args.0, args.1),
                other => candle_core::bail!("gemv has no {other:?} kernel"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_the_kernel_takes() {
        use Rows::{Fast, Invariant};
        // By default up to 9 rows (a token and 8 drafts) against any
        // weights, the 1B unembedding included.
        for m in 1..=9 {
            assert!(
                Invariant.take(m, 525 << 20),
                "{m} rows of the 1B unembedding"
            );
        }
        assert!(!Invariant.take(10, 1 << 10) && !Invariant.take(0, 1 << 10));
        // `fast`: one or two rows against any weights; up to 8 against small ones.
        for m in [1, 2] {
            assert!(Fast.take(m, 525 << 20), "{m} rows of the 1B unembedding");
        }
        assert!(!Fast.take(4, 67 << 20), "4 rows of the 1B gate/up");
        assert!(Fast.take(8, 3 << 20), "8 rows of SmolLM2's gate/up");
        assert!(!Fast.take(9, 1 << 10) && !Fast.take(0, 1 << 10));
        // Batch-invariant mode: any rows, a chunk at most 9.
        for m in [1, 9, 10, 64, 4096] {
            assert!(Rows::All.take(m, 525 << 20), "{m} rows");
        }
        assert!(!Rows::All.take(0, 1 << 10));
        assert_eq!(Rows::All.per_chunk(525 << 20), INVARIANT_ROWS);
    }

    #[test]
    fn launches_cover_every_row_once_in_chunks_of_at_most_nine() {
        let c = |rows, count, row0| Chunks { rows, count, row0 };
        assert_eq!(chunks(1), [c(1, 1, 0)]);
        assert_eq!(chunks(9), [c(9, 1, 0)]);
        assert_eq!(chunks(18), [c(9, 2, 0)]);
        assert_eq!(chunks(64), [c(9, 7, 0), c(1, 1, 63)]);
        assert!(chunks(0).is_empty());
        for m in 1..200 {
            let mut covered = 0;
            for Chunks { rows, count, row0 } in chunks(m) {
                assert!((1..=INVARIANT_ROWS).contains(&rows));
                assert_eq!(row0, covered, "{m} rows: chunks in order, no gap");
                covered += rows * count;
            }
            assert_eq!(covered, m);
        }
    }

    #[test]
    fn a_projection_folds_its_norm_for_every_row_count_or_none() {
        use candle_core::DType::{BF16, F32};
        for rows in [Rows::Invariant, Rows::Fast, Rows::All] {
            // SmolLM2 (576 wide), both dtypes.
            assert!(rows.fold_norm(576, BF16, 960 * 576 * 2), "{rows:?}");
            assert!(rows.fold_norm(576, F32, 960 * 576 * 4), "{rows:?}");
            // The 1B model (2 048 wide) in bf16.
            assert!(rows.fold_norm(2048, BF16, 16384 * 2048 * 2), "{rows:?}");
            // Rows too wide for the launch's shared memory at its most rows.
            assert!(!rows.fold_norm(4096, F32, 64 << 20), "{rows:?}");
            assert!(
                !rows.fold_norm(2048, F32, 1 << 20),
                "{rows:?}: rows of 8 KiB"
            );
        }
        // Two rows of the 1B model's f32 fit; nine do not.
        assert!(Rows::Fast.fold_norm(2048, F32, 16384 * 2048 * 4));
        assert!(!Rows::Invariant.fold_norm(2048, F32, 16384 * 2048 * 4));
        assert!(!Rows::All.fold_norm(2048, F32, 16384 * 2048 * 4));
    }

    #[test]
    fn warps_per_row_fill_the_gpu_within_a_row() {
        // bf16 (8 per pack): the 1B model's projections and SmolLM2's.
        assert_eq!(
            warps_per_row(2048, 2048, 8),
            2,
            "o_proj: 8 passes, 4 a round"
        );
        assert_eq!(warps_per_row(2048, 8192, 8), 4, "down: 4 x 2 048 warps");
        assert_eq!(warps_per_row(8192, 2048, 8), 1, "SwiGLU: 8 192 rows");
        assert_eq!(warps_per_row(960, 576, 8), 1, "SmolLM2 qkv: 3 passes");
        assert_eq!(warps_per_row(576, 1536, 8), 2, "SmolLM2 down: 6 passes");
        assert_eq!(warps_per_row(16, 32, 4), 1, "a row of one pass");
        for (n, k) in [(1, 64), (7, 100_000), (100_000, 8)] {
            let split = warps_per_row(n, k, 8);
            assert!(split.is_power_of_two() && split <= WARPS);
            assert!(
                split == 1 || split <= k.div_ceil(256),
                "never more warps than passes"
            );
        }
    }

    #[test]
    fn residual_rows_start_on_a_pack() {
        use candle_core::DType;
        assert_eq!(residual_offset(172, DType::BF16), 176);
        assert_eq!(residual_offset(176, DType::BF16), 176);
        assert_eq!(residual_offset(6, DType::F32), 8);
    }
}
