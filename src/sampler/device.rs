//! Sampling where the logits live, for logits on a CUDA GPU: one kernel
//! launch draws every row's token, so only the ids (and requested logprobs)
//! cross to the host.
//!
//! The kernel (`cuda/sampling.cu`) runs the host chain of `transform.rs`
//! (logit bias and grammar mask, penalties, top-p with top-k folded in or
//! top-k alone, min-p, greedy or temperature and an inverse-CDF draw in id
//! order) with one block per row and no sort; see its header for how the
//! cut-off is found. A row's mask bitset and bias pairs travel in the
//! launch's parameter block ([`ParamBlock`]), so a constrained batch is
//! still one upload and one launch. The host still
//! owns the randomness: each non-greedy row's uniform comes from its slot's
//! RNG exactly as on the host path, and travels in the row's parameters.
//!
//! # The device copy of the history
//! The penalty rings live on the device as well ([`DeviceHistory`]): a copy
//! of the host [`HistoryPool`] tagged with the pool version it reflects. A
//! device call uploads the pool only when the host changed it since
//! (`add`, `remove`, `commit`, a host-path call); otherwise it reads the
//! device copy, and after a successful call a second small kernel appends
//! the new tokens to the device rings while the host appends them to its
//! own, so both stay at the same version without any upload. A failed call
//! writes neither.
//!
//! Only CUDA builds have the kernels; other builds never take this path
//! (`Device::is_cuda` is false there) and get an error if they try.

use candle_core::{DType, Device, Tensor};

use super::adjust::TokenMask;
use super::history::HistoryPool;
use super::host::tensor_err;
use super::transform::Plan;
use super::SamplerError;

/// u32 fields per row of the parameter block (see `sampling.cu`).
pub(crate) const PARAM_WIDTH: usize = 16;
const P_POOL_ROW: usize = 0;
const P_FILLED: usize = 1;
const P_WRITE_POS: usize = 2;
const P_TOP_K: usize = 3;
const P_FLAGS: usize = 4;
const P_INV_T: usize = 5;
const P_TOP_P: usize = 6;
const P_LN_MIN_P: usize = 7;
const P_REPEAT: usize = 8;
const P_PRESENCE: usize = 9;
const P_FREQUENCY: usize = 10;
const P_U_LO: usize = 11;
const P_U_HI: usize = 12;
const P_MASK_OFF: usize = 13;
const P_BIAS_OFF: usize = 14;
const P_BIAS_LEN: usize = 15;

const F_GREEDY: u32 = 1;
const F_HISTORY: u32 = 2;
const F_LOGPROBS: u32 = 4;
const F_MASK: u32 = 8;

/// Per-row status the kernel reports (field 1 of each output row).
pub(crate) const S_OK: u32 = 0;
pub(crate) const S_NON_FINITE: u32 = 1;
pub(crate) const S_NO_FINITE_LOGIT: u32 = 2;
pub(crate) const S_TOKEN_OUT_OF_VOCAB: u32 = 3;

/// u32 fields per output row: token, status, detail, logprob, then
/// `top_logprobs` (id, logprob) pairs.
pub(crate) fn out_width(top_logprobs: usize) -> usize {
    4 + 2 * top_logprobs
}

/// The device copy of the penalty rings.
#[derive(Debug)]
pub(crate) struct DeviceHistory {
    /// `[rows, width]` u32, or `[1, 1]` when no slot has a penalty.
    tensor: Tensor,
    /// The [`HistoryPool::version`] this copy equals.
    version: u64,
}

impl DeviceHistory {
    /// The copy of `pool` on `device`, uploading it only when `current` is
    /// stale or elsewhere.
    pub(crate) fn synced(
        current: Option<Self>,
        pool: &HistoryPool,
        device: &Device,
    ) -> Result<Self, SamplerError> {
        if let Some(h) = current {
            if h.version == pool.version() && h.tensor.device().same_device(device) {
                return Ok(h);
            }
        }
        let tensor = if pool.width() == 0 {
            Tensor::zeros((1, 1), DType::U32, device)
        } else {
            Tensor::from_slice(pool.as_slice(), (pool.rows(), pool.width()), device)
        }
        .map_err(tensor_err)?;
        Ok(Self {
            tensor,
            version: pool.version(),
        })
    }

    /// Columns of the device rings (at least 1).
    #[cfg(feature = "cuda")]
    fn width(&self) -> usize {
        self.tensor.dims()[1]
    }
}

/// The parameter row of one slot: its `plan`, the tokens `len` its ring
/// has seen, its registration index `pool_row`, and `uniform`, the draw
/// for a non-greedy row.
pub(crate) fn row_params(
    plan: &Plan,
    len: u64,
    pool_row: usize,
    uniform: Option<f64>,
    logprobs: bool,
) -> [u32; PARAM_WIDTH] {
    let mut p = [0u32; PARAM_WIDTH];
    let mut flags = 0;
    if plan.is_greedy() {
        flags |= F_GREEDY;
    }
    if plan.uses_history() {
        let window = plan.penalty.window as u64;
        flags |= F_HISTORY;
        p[P_POOL_ROW] = pool_row as u32;
        p[P_FILLED] = len.min(window) as u32;
        p[P_WRITE_POS] = (len % window) as u32;
    }
    if logprobs {
        flags |= F_LOGPROBS;
    }
    p[P_FLAGS] = flags;
    p[P_TOP_K] = u32::try_from(plan.top_k).unwrap_or(u32::MAX);
    // The host chain's numbers, computed the host's way.
    p[P_INV_T] = (1.0 / plan.temperature).min(f32::MAX).to_bits();
    p[P_TOP_P] = plan.top_p.to_bits();
    p[P_LN_MIN_P] = if plan.min_p > 0.0 {
        plan.min_p.ln()
    } else {
        f32::NEG_INFINITY
    }
    .to_bits();
    p[P_REPEAT] = plan.penalty.repeat.to_bits();
    p[P_PRESENCE] = plan.penalty.presence.to_bits();
    p[P_FREQUENCY] = plan.penalty.frequency.to_bits();
    let u = uniform.unwrap_or(0.0).to_bits();
    p[P_U_LO] = u as u32;
    p[P_U_HI] = (u >> 32) as u32;
    p
}

/// Parameter rows for `rows` plain greedy rows (first maximum, no
/// penalty, no logprobs).
pub(crate) fn greedy_params(rows: usize) -> Vec<u32> {
    let mut row = [0u32; PARAM_WIDTH];
    row[P_FLAGS] = F_GREEDY;
    row.repeat(rows)
}

/// The parameter block of one launch: `rows` rows of [`PARAM_WIDTH`]
/// fields, then each adjusted row's mask words (`ceil(V / 32)` of them,
/// zero-padded: tokens past a mask's words are disallowed, as on the host)
/// and bias pairs (id, bias bits), which the row's fields address by their
/// offset in the whole block.
pub(crate) struct ParamBlock {
    words: Vec<u32>,
    rows: usize,
    pushed: usize,
    mask_words: usize,
}

impl ParamBlock {
    pub(crate) fn new(rows: usize, vocab: usize) -> Self {
        Self {
            words: vec![0; rows * PARAM_WIDTH],
            rows,
            pushed: 0,
            mask_words: vocab.div_ceil(32),
        }
    }

    /// Adds the next row: its fields from [`row_params`], this call's mask
    /// for it and its slot's bias (ids ascending, unique).
    pub(crate) fn push(
        &mut self,
        mut row: [u32; PARAM_WIDTH],
        mask: Option<&TokenMask>,
        bias: &[(u32, f32)],
    ) {
        assert!(
            self.pushed < self.rows,
            "ParamBlock: more rows than sized for"
        );
        if let Some(mask) = mask {
            row[P_FLAGS] |= F_MASK;
            row[P_MASK_OFF] = self.offset();
            let given = &mask.words()[..mask.words().len().min(self.mask_words)];
            self.words.extend_from_slice(given);
            self.words
                .resize(self.words.len() + self.mask_words - given.len(), 0);
        }
        if !bias.is_empty() {
            row[P_BIAS_OFF] = self.offset();
            row[P_BIAS_LEN] = bias.len() as u32;
            self.words
                .extend(bias.iter().flat_map(|&(t, b)| [t, b.to_bits()]));
        }
        let at = self.pushed * PARAM_WIDTH;
        self.words[at..at + PARAM_WIDTH].copy_from_slice(&row);
        self.pushed += 1;
    }

    fn offset(&self) -> u32 {
        u32::try_from(self.words.len()).expect("a parameter block under 2^32 words")
    }

    pub(crate) fn finish(self) -> Vec<u32> {
        assert_eq!(self.pushed, self.rows, "ParamBlock: rows missing");
        self.words
    }
}

/// One launch's results: the output rows on the host, and what the history
/// write needs on the device.
pub(crate) struct Launch {
    /// `[rows, out_width]` row-major.
    pub out: Vec<u32>,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    out_device: Tensor,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    params: Tensor,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    rows: usize,
}

/// Samples every row of `logits` (`[rows, V]` on a CUDA device) with the
/// parameter block `params` (its first `rows × PARAM_WIDTH` words are the
/// rows' fields; see [`ParamBlock`]).
#[cfg(feature = "cuda")]
pub(crate) fn sample(
    logits: &Tensor,
    params: &[u32],
    history: &DeviceHistory,
    top_logprobs: usize,
) -> Result<Launch, SamplerError> {
    let rows = logits.dims()[0];
    let run = || -> candle_core::Result<Launch> {
        let logits = logits.to_dtype(DType::F32)?.contiguous()?;
        let params = Tensor::from_slice(params, params.len(), logits.device())?;
        let op = kernel::SampleOp {
            history_width: history.width(),
            top_logprobs,
        };
        let out_device = logits.apply_op3_no_bwd(&params, &history.tensor, &op)?;
        let out = out_device.flatten_all()?.to_vec1::<u32>()?;
        Ok(Launch {
            out,
            out_device,
            params,
            rows,
        })
    };
    run().map_err(tensor_err)
}

/// The first maximum of every row of `logits` (`[rows, V]` on a CUDA
/// device; a NaN never wins, a row without a number gives 0): the greedy
/// ids of an all-greedy call, with a row spread over many blocks.
#[cfg(feature = "cuda")]
pub(crate) fn argmax(logits: &Tensor) -> Result<Vec<u32>, SamplerError> {
    let run = || -> candle_core::Result<Vec<u32>> {
        let logits = logits.to_dtype(DType::F32)?.contiguous()?;
        let keys = logits
            .apply_op1_no_bwd(&kernel::ArgmaxOp)?
            .to_vec1::<i64>()?;
        Ok(keys
            .into_iter()
            .map(|k| match k as u64 {
                0 => 0,
                k => u32::MAX - (k & 0xffff_ffff) as u32,
            })
            .collect())
    };
    run().map_err(tensor_err)
}

/// Without the `cuda` feature no tensor is on a CUDA device, so the
/// sampler never comes here.
#[cfg(not(feature = "cuda"))]
pub(crate) fn argmax(_: &Tensor) -> Result<Vec<u32>, SamplerError> {
    Err(SamplerError::Tensor(
        "the device sampler needs a --features cuda build".into(),
    ))
}

/// Without the `cuda` feature no tensor is on a CUDA device, so the
/// sampler never comes here.
#[cfg(not(feature = "cuda"))]
pub(crate) fn sample(
    _: &Tensor,
    _: &[u32],
    _: &DeviceHistory,
    _: usize,
) -> Result<Launch, SamplerError> {
    Err(SamplerError::Tensor(
        "the device sampler needs a --features cuda build".into(),
    ))
}

/// Appends each history row's token to the device rings (after the host
/// checked every row) and returns the copy, now at `version`.
pub(crate) fn write_history(
    mut history: DeviceHistory,
    launch: &Launch,
    version: u64,
) -> Result<DeviceHistory, SamplerError> {
    #[cfg(feature = "cuda")]
    {
        let op = kernel::HistoryWriteOp {
            rows: launch.rows,
            out_width: launch.out.len() / launch.rows.max(1),
        };
        history
            .tensor
            .inplace_op3(&launch.out_device, &launch.params, &op)
            .map_err(tensor_err)?;
    }
    #[cfg(not(feature = "cuda"))]
    let _ = launch;
    history.version = version;
    Ok(history)
}

#[cfg(feature = "cuda")]
mod kernel {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::WrapErr;
    use candle_core::{CudaStorage, CustomOp1, CustomOp3, InplaceOp3, Layout, Shape};

    use super::{out_width, PARAM_WIDTH};

    /// Columns one argmax block walks.
    const ARGMAX_COLUMNS: usize = 4096;

    /// `logits.apply_op1_no_bwd(&ArgmaxOp)` → `[rows]` keys (i64 holding
    /// the kernel's u64; see `argmax_rows_f32`).
    pub(super) struct ArgmaxOp;

    impl CustomOp1 for ArgmaxOp {
        fn name(&self) -> &'static str {
            "argmax-rows"
        }

        crate::cuda_only::cuda_only_cpu_fwd!(CustomOp1);

        fn cuda_fwd(
            &self,
            logits: &CudaStorage,
            l: &Layout,
        ) -> candle_core::Result<(CudaStorage, Shape)> {
            contiguous("logits", l)?;
            let (rows, vocab) = l.shape().dims2()?;
            let dev = logits.device().clone();
            let func = dev.get_or_load_custom_func("argmax_rows_f32", MODULE, PTX)?;
            let logits = logits.as_cuda_slice::<f32>()?.slice(l.start_offset()..);
            let best = dev.alloc_zeros::<i64>(rows.max(1))?;
            let (vocab32, per_block) = (vocab as u32, ARGMAX_COLUMNS as u32);
            let cfg = LaunchConfig {
                grid_dim: (rows as u32, vocab.div_ceil(ARGMAX_COLUMNS).max(1) as u32, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = func.builder();
            b.arg(&logits);
            b.arg(&vocab32);
            b.arg(&per_block);
            b.arg(&best);
            // SAFETY: argument types match the kernel (the i64 buffer holds
            // its u64 keys); every read is inside row `blockIdx.x`.
            unsafe { b.launch(cfg) }.w()?;
            Ok((CudaStorage::wrap_cuda_slice(best, dev), Shape::from(rows)))
        }
    }

    const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/sampling.ptx"));
    const MODULE: &str = "tandem_sampling";
    /// Threads per row (the kernel's `THREADS`).
    const THREADS: u32 = 1024;

    /// `logits.apply_op3_no_bwd(params, history, &SampleOp)` → `[rows, out_width]` u32.
    pub(super) struct SampleOp {
        pub(super) history_width: usize,
        pub(super) top_logprobs: usize,
    }

    /// `history.inplace_op3(out, params, &HistoryWriteOp)`.
    pub(super) struct HistoryWriteOp {
        pub(super) rows: usize,
        pub(super) out_width: usize,
    }

    fn contiguous(what: &str, l: &Layout) -> candle_core::Result<()> {
        if l.is_contiguous() {
            Ok(())
        } else {
            candle_core::bail!("device sampler: {what} is not contiguous")
        }
    }

    impl CustomOp3 for SampleOp {
        fn name(&self) -> &'static str {
            "device-sample"
        }

        crate::cuda_only::cuda_only_cpu_fwd!(CustomOp3);

        fn cuda_fwd(
            &self,
            logits: &CudaStorage,
            ll: &Layout,
            params: &CudaStorage,
            pl: &Layout,
            history: &CudaStorage,
            hl: &Layout,
        ) -> candle_core::Result<(CudaStorage, Shape)> {
            contiguous("logits", ll)?;
            contiguous("params", pl)?;
            contiguous("history", hl)?;
            let (rows, vocab) = ll.shape().dims2()?;
            if pl.shape().elem_count() < rows * PARAM_WIDTH {
                candle_core::bail!("device sampler: params {:?} for {rows} rows", pl.shape());
            }
            let dev = logits.device().clone();
            let logits = logits.as_cuda_slice::<f32>()?.slice(ll.start_offset()..);
            let params = params.as_cuda_slice::<u32>()?.slice(pl.start_offset()..);
            let history = history.as_cuda_slice::<u32>()?.slice(hl.start_offset()..);
            let width = out_width(self.top_logprobs);
            // SAFETY: the kernel writes every element before reading it.
            let scratch = unsafe { dev.alloc::<f32>(rows * vocab)? };
            // SAFETY: every row gets its status; the host reads the other
            // fields only where the status and the flags say they were
            // written (token on success, detail on a vocabulary fault,
            // logprobs when asked).
            let out = unsafe { dev.alloc::<u32>(rows * width)? };
            let func = dev.get_or_load_custom_func("sample_rows", MODULE, PTX)?;
            let (vocab32, hw32, top32) = (
                vocab as u32,
                self.history_width as u32,
                self.top_logprobs as u32,
            );
            let cfg = LaunchConfig {
                grid_dim: (rows as u32, 1, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = func.builder();
            b.arg(&logits);
            b.arg(&scratch);
            b.arg(&params);
            b.arg(&history);
            b.arg(&out);
            b.arg(&vocab32);
            b.arg(&hw32);
            b.arg(&top32);
            // SAFETY: argument types match the kernel; every row reads only
            // its own logits and scratch, and its ring inside `history`
            // (pool rows and fills come from the host pool it mirrors).
            unsafe { b.launch(cfg) }.w()?;
            Ok((
                CudaStorage::wrap_cuda_slice(out, dev),
                Shape::from((rows, width)),
            ))
        }
    }

    impl InplaceOp3 for HistoryWriteOp {
        fn name(&self) -> &'static str {
            "device-history-write"
        }

        crate::cuda_only::cuda_only_cpu_fwd!(InplaceOp3);

        fn cuda_fwd(
            &self,
            history: &mut CudaStorage,
            hl: &Layout,
            out: &CudaStorage,
            ol: &Layout,
            params: &CudaStorage,
            pl: &Layout,
        ) -> candle_core::Result<()> {
            contiguous("history", hl)?;
            contiguous("out", ol)?;
            contiguous("params", pl)?;
            let (_, width) = hl.shape().dims2()?;
            let dev = history.device().clone();
            let func = dev.get_or_load_custom_func("history_write", MODULE, PTX)?;
            let out = out.as_cuda_slice::<u32>()?.slice(ol.start_offset()..);
            let params = params.as_cuda_slice::<u32>()?.slice(pl.start_offset()..);
            let start = hl.start_offset();
            let history = history.as_cuda_slice_mut::<u32>()?;
            let mut history = history.slice_mut(start..);
            let (rows32, width32, out32) = (self.rows as u32, width as u32, self.out_width as u32);
            let cfg = LaunchConfig {
                grid_dim: (self.rows.div_ceil(256).max(1) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = func.builder();
            b.arg(&mut history);
            b.arg(&out);
            b.arg(&params);
            b.arg(&rows32);
            b.arg(&width32);
            b.arg(&out32);
            // SAFETY: argument types match the kernel; each write lands at
            // (pool row, ring position) of a row the host checked.
            unsafe { b.launch(cfg) }.w()?;
            Ok(())
        }
    }
}
