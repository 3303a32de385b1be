//! The lean CPU step: the whole forward pass on plain f32 buffers that live
//! between steps, with the kernels of [`super::kernels`] and each
//! sequence's KV cache read and written in place.
//!
//! # Why not candle ops
//! A candle op allocates its output and walks strides generically; a decode
//! step of 64 sequences issues thousands of them (per layer: norms, splits,
//! RoPE, one attention chain per sequence, concatenations), and at one
//! sequence the step's time goes to that overhead rather than to reading
//! the weights. Here a layer is ten calls over buffers sized once.
//!
//! # Ownership and invariants
//! - [`Lean`] belongs to its [`Model`](super::Model) and holds only this
//!   path's own state: f32 copies of the small vectors, the rotary tables,
//!   the thread count and the workspace. The weights are the model's
//!   ([`ModelWeights`]), passed to every call.
//! - The workspace sits behind a mutex only so the model stays `Sync` (the
//!   engine thread is its one user).
//! - Activations are f32 whatever the weights are (f32, f16 or quantised);
//!   the KV cache is in the model's dtype (f32 or f16) and is converted on
//!   write and read, never copied per step.
//! - Results equal the candle path's within rounding; a row's result never
//!   depends on the other rows of the batch (see `kernels`).

use std::sync::Mutex;
use std::time::{Duration, Instant};

use candle_core::{CpuStorage, DType, Device, Layout, Storage, Tensor};
use half::f16;

use super::kernels::aligned::AlignedF32;
use super::kernels::attention::{attention, Heads, SeqAttn};
use super::kernels::math::{narrow, rms_norm, rope, silu_mul};
use super::kernels::pool::{for_each_range, threads, SharedMut};
use super::kernels::qformat::ActivationQuant;
use super::kernels::Isa;
use super::linear::{CpuCall, Linear};
use super::llama_weights::{LayerWeights, ModelWeights};
use super::{Batch, ModelConfig, ModelError};
use crate::kv::{KeyOrder, KvCache};

/// Step phases the profile reports, in step order.
pub const PHASES: [&str; 10] = [
    "embed",
    "norm",
    "qkv",
    "rope+kv",
    "attention",
    "o_proj",
    "gate_up",
    "silu",
    "down",
    "lm_head",
];

/// f32 copies of the small per-layer vectors.
pub(crate) struct LayerVecs {
    attn_norm: Vec<f32>,
    mlp_norm: Vec<f32>,
    qkv_bias: Option<Vec<f32>>,
}

/// Buffers of one step, grown to the largest batch seen and then reused.
#[derive(Default)]
struct Workspace {
    x: AlignedF32,
    h: AlignedF32,
    qkv: AlignedF32,
    attn: AlignedF32,
    gu: AlignedF32,
    act: AlignedF32,
    /// The unembedding's normed rows.
    normed: AlignedF32,
    positions: Vec<usize>,
    profile: Option<[Duration; PHASES.len()]>,
}

/// The lean path's state, built at load on CPU.
pub(crate) struct Lean {
    /// The model's dtype: of the hidden states `forward` returns.
    dtype: DType,
    isa: Isa,
    threads: usize,
    /// How the quantised projections quantise activations.
    quant: ActivationQuant,
    /// Whether the model's quantised projections were repacked
    /// (`LoadOptions::repack_quantised` with 8-bit activations): the
    /// caller's own ([`Lean::prepare`]) are laid out the same way.
    repack: bool,
    layers: Vec<LayerVecs>,
    final_norm: Vec<f32>,
    /// `[max_positions, head_dim / 2]` rotary tables.
    cos: Vec<f32>,
    sin: Vec<f32>,
    ws: Mutex<Workspace>,
}

fn to_f32_vec(t: &Tensor) -> candle_core::Result<Vec<f32>> {
    t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()
}

/// Rows per parallel grab for row-wise element-wise work.
const ROW_GRAIN: usize = 8;
/// Elements below which row-wise work runs on the calling thread: waking
/// the pool costs more than it saves (and every parallel region is a
/// barrier a preempted thread can stall on a shared machine).
const PARALLEL_ELEMENTS: usize = 1 << 17;

impl Lean {
    /// How a projection call runs.
    fn call(&self) -> CpuCall {
        CpuCall {
            isa: self.isa,
            threads: self.threads,
            quant: self.quant,
        }
    }

    /// Converts the weights' norms and biases and the rotary tables (f32,
    /// from `rope_tables`) to f32 buffers, the tables rounded to `dtype`
    /// first as the candle path rounds them, to stay within rounding of it.
    pub(crate) fn new(
        weights: &ModelWeights,
        (cos, sin): (Vec<f32>, Vec<f32>),
        dtype: DType,
        thread_cap: Option<usize>,
        quant: ActivationQuant,
        repack: bool,
    ) -> candle_core::Result<Self> {
        let mut layers = Vec::with_capacity(weights.layers.len());
        for l in &weights.layers {
            layers.push(LayerVecs {
                attn_norm: to_f32_vec(&l.attn_norm)?,
                mlp_norm: to_f32_vec(&l.mlp_norm)?,
                qkv_bias: l.qkv_bias.as_ref().map(to_f32_vec).transpose()?,
            });
        }
        let round = |v: &[f32]| -> candle_core::Result<Vec<f32>> {
            Tensor::new(v, &Device::Cpu)?
                .to_dtype(dtype)?
                .to_dtype(DType::F32)?
                .to_vec1()
        };
        Ok(Self {
            dtype,
            isa: Isa::detect(),
            threads: threads(thread_cap),
            quant,
            repack,
            layers,
            final_norm: to_f32_vec(&weights.norm)?,
            cos: round(&cos)?,
            sin: round(&sin)?,
            ws: Mutex::new(Workspace::default()),
        })
    }

    /// Starts (or stops) accumulating per-phase step times.
    pub(crate) fn set_profiling(&self, on: bool) {
        let mut ws = self.ws.lock().unwrap_or_else(|e| e.into_inner());
        ws.profile = on.then_some([Duration::ZERO; PHASES.len()]);
    }

    /// Per-phase times accumulated since profiling started (then reset).
    pub(crate) fn take_profile(&self) -> Vec<(&'static str, Duration)> {
        let mut ws = self.ws.lock().unwrap_or_else(|e| e.into_inner());
        match ws.profile.as_mut() {
            Some(p) => {
                let out = PHASES.iter().copied().zip(p.iter().copied()).collect();
                *p = [Duration::ZERO; PHASES.len()];
                out
            }
            None => Vec::new(),
        }
    }

    /// Row-parallel `f(row)` over `rows` rows of `width` elements (inline
    /// for small batches).
    fn rows<F: Fn(usize) + Sync>(&self, rows: usize, width: usize, f: F) {
        let t = if rows * width >= PARALLEL_ELEMENTS {
            self.threads
        } else {
            1
        };
        for_each_range(rows, ROW_GRAIN, t, |r| r.for_each(&f));
    }

    /// `out[r] = rms_norm(x[r]) · w` for every row.
    fn norm_rows(&self, x: &[f32], w: &[f32], eps: f32, out: &mut [f32], rows: usize) {
        let h = w.len();
        let o = SharedMut(out.as_mut_ptr());
        self.rows(rows, h, |r| {
            // SAFETY: row r of `out` is written by this call alone.
            let dst = unsafe { std::slice::from_raw_parts_mut(o.at(r * h), h) };
            rms_norm(&x[r * h..(r + 1) * h], w, eps, dst);
        });
    }
}

/// Writes `rows` rows of `width` floats (from `src`, `ld` apart) into a
/// layer's KV pool at a sequence's positions `at..at + rows`, through its
/// block `table` (`block` rows per block), converting to the pool's dtype:
/// token-major, or with `lanes` (the keys of a
/// [`KeyOrder::BlockLanes`] pool) element `c` of a row `block` elements
/// after element `c − 1`, in the block's lane of that row.
struct WriteRows<'a> {
    src: &'a [f32],
    ld: usize,
    width: usize,
    rows: usize,
    at: usize,
    table: &'a [u32],
    block: usize,
    lanes: bool,
}

impl WriteRows<'_> {
    /// Element offset of row `r`'s first element in the pool and the
    /// stride between its elements, or `None` past the table.
    fn dst(&self, r: usize) -> Option<(usize, usize)> {
        let pos = self.at + r;
        let b = *self.table.get(pos / self.block)? as usize;
        let (first, lane) = (b * self.block * self.width, pos % self.block);
        Some(if self.lanes {
            (first + lane, self.block)
        } else {
            (first + lane * self.width, 1)
        })
    }
}

impl candle_core::InplaceOp1 for WriteRows<'_> {
    fn name(&self) -> &'static str {
        "tandem-kv-write"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let start = layout.start_offset();
        for r in 0..self.rows {
            let row = &self.src[r * self.ld..r * self.ld + self.width];
            let Some((o, stride)) = self.dst(r) else {
                candle_core::bail!("KV write past the block table");
            };
            let (o, end) = (start + o, start + o + (self.width - 1) * stride + 1);
            match storage {
                CpuStorage::F32(d) if d.len() >= end => scatter(row, &mut d[o..end], stride),
                CpuStorage::F16(d) if d.len() >= end => {
                    // Narrowed a piece at a time on the stack: no allocation
                    // on the step's path.
                    const PIECE: usize = 64;
                    let mut piece = [f16::ZERO; PIECE];
                    for (c, part) in row.chunks(PIECE).enumerate() {
                        let piece = &mut piece[..part.len()];
                        narrow(part, piece);
                        let at = c * PIECE * stride;
                        scatter(piece, &mut d[o + at..end], stride);
                    }
                }
                _ => candle_core::bail!("KV cache storage is not f32/f16 or is too short"),
            }
        }
        Ok(())
    }
}

/// `dst[c · stride] = src[c]`: a copy when `stride` is 1.
fn scatter<T: Copy>(src: &[T], dst: &mut [T], stride: usize) {
    if stride == 1 {
        dst[..src.len()].copy_from_slice(src);
    } else {
        for (d, &x) in dst.iter_mut().step_by(stride).zip(src) {
            *d = x;
        }
    }
}

/// Raw pointer to a CPU tensor's first element, typed.
fn cpu_ptr<T: candle_core::WithDType>(
    storage: &Storage,
    layout: &Layout,
) -> candle_core::Result<*const T> {
    match storage {
        Storage::Cpu(c) => Ok(c.as_slice::<T>()?[layout.start_offset()..].as_ptr()),
        _ => candle_core::bail!("lean CPU path on a non-CPU tensor"),
    }
}

/// The sizes a step works with, from the config.
#[derive(Clone, Copy)]
struct Dims {
    hidden: usize,
    inter: usize,
    head_dim: usize,
    /// Widths of the q part and of the k (or v) part of a projection row.
    qw: usize,
    kvw: usize,
    /// Floats per projection row: q, k, v.
    ldqkv: usize,
    eps: f32,
    heads: Heads,
    /// The softmax scale the queries carry.
    scale: f32,
}

impl Dims {
    fn new(cfg: &ModelConfig) -> Self {
        let (nh, nkv, hd) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
        Self {
            hidden: cfg.hidden_size,
            inter: cfg.intermediate_size,
            head_dim: hd,
            qw: nh * hd,
            kvw: nkv * hd,
            ldqkv: (nh + 2 * nkv) * hd,
            eps: cfg.rms_norm_eps as f32,
            heads: Heads {
                num_heads: nh,
                num_kv_heads: nkv,
                head_dim: hd,
                sliding_window: cfg.sliding_window,
            },
            scale: 1.0 / (hd as f32).sqrt(),
        }
    }
}

/// Layer `index`'s weights with the lean path's f32 copies of its vectors.
#[derive(Clone, Copy)]
struct LayerRef<'a> {
    index: usize,
    weights: &'a LayerWeights,
    vecs: &'a LayerVecs,
}

/// Phase times of one step; added to the profile only when the step
/// succeeds.
struct StepTimes {
    on: bool,
    times: [Duration; PHASES.len()],
    at: Instant,
}

impl StepTimes {
    fn start(on: bool) -> Self {
        Self {
            on,
            times: [Duration::ZERO; PHASES.len()],
            at: Instant::now(),
        }
    }

    /// Adds the time since the previous tick to `phase`.
    fn tick(&mut self, phase: usize) {
        if self.on {
            let now = Instant::now();
            self.times[phase] += now - self.at;
            self.at = now;
        }
    }

    fn add_to(self, profile: &mut Option<[Duration; PHASES.len()]>) {
        if let Some(p) = profile.as_mut() {
            for (p, t) in p.iter_mut().zip(self.times) {
                *p += t;
            }
        }
    }
}

impl Lean {
    /// The first `num_layers` layers of `weights` over the batch (already
    /// checked, room reserved), from the token embeddings or from the
    /// caller's `embeddings`; returns the hidden states of the rows the
    /// batch asks for, in the model's dtype.
    pub(super) fn forward(
        &self,
        cfg: &ModelConfig,
        weights: &ModelWeights,
        batch: &Batch,
        kv: &mut KvCache,
        num_layers: usize,
        embeddings: Option<&Tensor>,
    ) -> Result<Tensor, ModelError> {
        let mut guard = self.ws.lock().unwrap_or_else(|e| e.into_inner());
        let ws = &mut *guard;
        let d = Dims::new(cfg);
        let n = batch.tokens.len();
        let mut times = StepTimes::start(ws.profile.is_some());

        ws.positions.clear();
        for s in &batch.seqs {
            ws.positions.extend(s.offset..s.offset + s.len);
        }
        let x = ws.x.grow(n * d.hidden);
        match embeddings {
            // Input rows given by the caller (an MTP head's projected inputs).
            Some(e) => x.copy_from_slice(&e.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?),
            None => embed_rows(&weights.embed, d.hidden, &batch.tokens, x)?,
        }
        times.tick(0);

        for (index, weights) in weights.layers.iter().take(num_layers).enumerate() {
            let vecs = &self.layers[index];
            let layer = LayerRef {
                index,
                weights,
                vecs,
            };
            self.attention_block(d, layer, batch, kv, ws, &mut times)?;
            self.mlp_block(d, layer, n, ws, &mut times)?;
        }
        for s in &batch.seqs {
            kv.set_len(s.slot, s.offset + s.len)?;
        }

        let (x, hsz) = (ws.x.get(n * d.hidden), d.hidden);
        let wanted = batch.output_indices();
        let mut out = Vec::with_capacity(wanted.len() * hsz);
        for &r in &wanted {
            out.extend_from_slice(&x[r as usize * hsz..(r as usize + 1) * hsz]);
        }
        times.add_to(&mut ws.profile);
        let out = Tensor::from_vec(out, (wanted.len(), hsz), &Device::Cpu)?;
        Ok(out.to_dtype(self.dtype)?)
    }

    /// Layer `l`'s attention half: norm, q/k/v projection, RoPE, the new
    /// K/V into each slot, attention, and the o projection added to `x`.
    fn attention_block(
        &self,
        d: Dims,
        layer: LayerRef<'_>,
        batch: &Batch,
        kv: &mut KvCache,
        ws: &mut Workspace,
        times: &mut StepTimes,
    ) -> Result<(), ModelError> {
        let n = batch.tokens.len();
        let LayerRef {
            index: l,
            weights: w,
            vecs,
        } = layer;
        let x = ws.x.grow(n * d.hidden);
        let h = ws.h.grow(n * d.hidden);
        self.norm_rows(x, &vecs.attn_norm, d.eps, h, n);
        times.tick(1);
        let qkv = ws.qkv.grow(n * d.ldqkv);
        w.qkv.forward_cpu(self.call(), h, n, qkv, false)?;
        if let Some(b) = &vecs.qkv_bias {
            for row in qkv.chunks_exact_mut(d.ldqkv) {
                for (v, b) in row.iter_mut().zip(b) {
                    *v += b;
                }
            }
        }
        times.tick(2);
        self.rotate(d, qkv, &ws.positions);
        // The layer's pool and each sequence's block table, shared by the
        // writes and the attention below.
        if kv.layout().keys != KeyOrder::BlockLanes {
            return Err(ModelError::InvalidBatch(
                "the lean CPU path needs a KV pool with its keys in block lanes".into(),
            ));
        }
        let pool = kv
            .pool_layer(l)
            .ok_or_else(|| ModelError::InvalidBatch("KV pool has no such layer".into()))?;
        let tables = batch
            .seqs
            .iter()
            .map(|s| kv.table(s.slot))
            .collect::<Result<Vec<_>, _>>()?;
        let cache = Cache {
            pool,
            tables: &tables,
            block: kv.block_size(),
        };
        write_kv(d, batch, &cache, qkv)?;
        times.tick(3);
        let attn = ws.attn.grow(n * d.qw);
        self.attend(d, batch, &cache, kv.layout().dtype, qkv, attn)?;
        times.tick(4);
        w.o_proj.forward_cpu(self.call(), attn, n, x, true)?;
        times.tick(5);
        Ok(())
    }

    /// Layer `l`'s MLP half: norm, gate/up projection, SiLU·up, and the
    /// down projection added to `x`.
    fn mlp_block(
        &self,
        d: Dims,
        layer: LayerRef<'_>,
        n: usize,
        ws: &mut Workspace,
        times: &mut StepTimes,
    ) -> Result<(), ModelError> {
        let (isa, inter) = (self.isa, d.inter);
        let LayerRef {
            weights: w, vecs, ..
        } = layer;
        let x = ws.x.grow(n * d.hidden);
        let h = ws.h.grow(n * d.hidden);
        self.norm_rows(x, &vecs.mlp_norm, d.eps, h, n);
        times.tick(1);
        let gu = ws.gu.grow(n * 2 * inter);
        w.gate_up.forward_cpu(self.call(), h, n, gu, false)?;
        times.tick(6);
        let act = ws.act.grow(n * inter);
        let (gu, a) = (&*gu, SharedMut(act.as_mut_ptr()));
        self.rows(n, inter, |r| {
            let row = &gu[r * 2 * inter..(r + 1) * 2 * inter];
            // SAFETY: row r of `act` is written by this call alone.
            let dst = unsafe { std::slice::from_raw_parts_mut(a.at(r * inter), inter) };
            silu_mul(isa, &row[..inter], &row[inter..], dst);
        });
        times.tick(7);
        w.down.forward_cpu(self.call(), act, n, x, true)?;
        times.tick(8);
        Ok(())
    }

    /// RoPE on the q and k parts of every projection row, by the row's
    /// position; queries also carry the softmax scale (after rotation, as
    /// the candle path rounds it).
    fn rotate(&self, d: Dims, qkv: &mut [f32], positions: &[usize]) {
        let half = d.head_dim / 2;
        for (row, &p) in qkv.chunks_exact_mut(d.ldqkv).zip(positions) {
            let (cos, sin) = (
                &self.cos[p * half..(p + 1) * half],
                &self.sin[p * half..(p + 1) * half],
            );
            rope(&mut row[..d.qw], d.head_dim, cos, sin, d.scale);
            rope(&mut row[d.qw..d.qw + d.kvw], d.head_dim, cos, sin, 1.0);
        }
    }

    /// A projection the model's caller owns (an MTP head's input
    /// projection), for this path: repacked when the model's own are.
    pub(super) fn prepare(&self, w: Linear) -> Result<Linear, ModelError> {
        Ok(if self.repack { w.repacked()? } else { w })
    }

    /// `x` (`[rows, k]`) through `w` with this path's kernels: `[rows, n]`
    /// f32.
    pub(super) fn project(&self, w: &Linear, x: &Tensor) -> Result<Tensor, ModelError> {
        let (rows, _) = x.dims2()?;
        let x: Vec<f32> = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
        let n = w.columns()?;
        let mut out = vec![0f32; rows * n];
        w.forward_cpu(self.call(), &x, rows, &mut out, false)?;
        Ok(Tensor::from_vec(out, (rows, n), &Device::Cpu)?)
    }

    /// Final norm and unembedding of `hidden` (`[rows, hidden]`) by
    /// `weights`' unembedding: `[rows, vocab]` logits (f32).
    pub(super) fn unembed(
        &self,
        cfg: &ModelConfig,
        weights: &ModelWeights,
        hidden: &Tensor,
    ) -> Result<Tensor, ModelError> {
        let start = Instant::now();
        let (rows, h) = hidden.dims2()?;
        let x: Vec<f32> = hidden.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
        let mut ws = self.ws.lock().unwrap_or_else(|e| e.into_inner());
        let normed = ws.normed.grow(rows * h);
        self.norm_rows(&x, &self.final_norm, cfg.rms_norm_eps as f32, normed, rows);
        let vocab = cfg.vocab_size;
        let mut logits = vec![0f32; rows * vocab];
        weights
            .lm_head
            .forward_cpu(self.call(), normed, rows, &mut logits, false)?;
        if let Some(p) = ws.profile.as_mut() {
            p[PHASES.len() - 1] += start.elapsed();
        }
        Ok(Tensor::from_vec(logits, (rows, vocab), &Device::Cpu)?)
    }
}

/// One layer's KV pool and the batch's block tables (batch order).
struct Cache<'a> {
    pool: (&'a Tensor, &'a Tensor),
    tables: &'a [&'a [u32]],
    block: usize,
}

/// Writes every sequence's new K and V rows (from the projection rows
/// `qkv`) into the layer's pool through its block table, the keys in the
/// pool's block lanes.
fn write_kv(d: Dims, batch: &Batch, cache: &Cache<'_>, qkv: &[f32]) -> Result<(), ModelError> {
    let mut start = 0;
    for (s, table) in batch.seqs.iter().zip(cache.tables) {
        let rows = &qkv[start * d.ldqkv..(start + s.len) * d.ldqkv];
        let keys_and_values = [
            (cache.pool.0, d.qw, true),
            (cache.pool.1, d.qw + d.kvw, false),
        ];
        for (t, col, lanes) in keys_and_values {
            t.inplace_op1(&WriteRows {
                src: &rows[col..],
                ld: d.ldqkv,
                width: d.kvw,
                rows: s.len,
                at: s.offset,
                table,
                block: cache.block,
                lanes,
            })?;
        }
        start += s.len;
    }
    Ok(())
}

/// Embedding rows of `ids` (checked against the vocabulary) from `embed`
/// (`[vocab, hidden]` on the CPU) into `x` (`ids.len() · hidden` floats).
fn embed_rows(embed: &Tensor, h: usize, ids: &[u32], x: &mut [f32]) -> Result<(), ModelError> {
    let (storage, layout) = embed.storage_and_layout();
    for (r, &id) in ids.iter().enumerate() {
        let dst = &mut x[r * h..(r + 1) * h];
        let off = id as usize * h;
        match embed.dtype() {
            DType::F32 => {
                let p = cpu_ptr::<f32>(&storage, layout)?;
                // SAFETY: ids were checked against the vocabulary, so row
                // `id` of the `[vocab, hidden]` matrix lies inside the
                // storage, which the guard keeps alive.
                dst.copy_from_slice(unsafe { std::slice::from_raw_parts(p.add(off), h) });
            }
            DType::F16 => {
                let p = cpu_ptr::<f16>(&storage, layout)?;
                // SAFETY: as for f32: row `id` is inside the guarded
                // `[vocab, hidden]` storage.
                let src = unsafe { std::slice::from_raw_parts(p.add(off), h) };
                super::kernels::math::widen(src, dst);
            }
            other => {
                return Err(ModelError::UnsupportedDType(format!(
                    "{other:?} embeddings"
                )))
            }
        }
    }
    Ok(())
}

impl Lean {
    /// Attention of every sequence over its cache (the layer's pool and
    /// block tables, in `kv_dtype`) for the rotated queries of the
    /// projection rows `qkv`, into `out` (`[n, heads·head_dim]`).
    fn attend(
        &self,
        d: Dims,
        batch: &Batch,
        cache: &Cache<'_>,
        kv_dtype: DType,
        qkv: &[f32],
        out: &mut [f32],
    ) -> Result<(), ModelError> {
        let guards = (
            cache.pool.0.storage_and_layout(),
            cache.pool.1.storage_and_layout(),
        );
        let o = SharedMut(out.as_mut_ptr());
        let (isa, threads, heads) = (self.isa, self.threads, d.heads);
        match kv_dtype {
            DType::F32 => {
                let s = seq_attns::<f32>(d, batch, &guards, cache, qkv, o)?;
                // SAFETY: every pointer comes from a live guard or buffer of
                // the shape the batch describes (checked before the step:
                // each table covers its sequence's positions), and the
                // sequences' output rows are disjoint.
                unsafe { attention(isa, threads, heads, &s) };
            }
            DType::F16 => {
                let s = seq_attns::<f16>(d, batch, &guards, cache, qkv, o)?;
                // SAFETY: as for f32: live guards and buffers of the checked
                // shapes, disjoint output rows per sequence.
                unsafe { attention(isa, threads, heads, &s) };
            }
            other => return Err(ModelError::UnsupportedDType(format!("{other:?} KV cache"))),
        }
        Ok(())
    }
}

/// A storage guard and its layout.
type Guard<'a> = (candle_core::StorageRef<'a>, &'a Layout);

/// Each sequence's part of the attention call: its query rows in `qkv`,
/// its output rows behind `o` (`[n, heads·head_dim]`) and its cache
/// (the pool `guards`, K then V, in `T`, and its block table).
fn seq_attns<T: candle_core::WithDType>(
    d: Dims,
    batch: &Batch,
    guards: &(Guard, Guard),
    cache: &Cache<'_>,
    qkv: &[f32],
    o: SharedMut<f32>,
) -> candle_core::Result<Vec<SeqAttn<T>>> {
    let (ldqkv, ldo) = (d.ldqkv, d.qw);
    let ((ks, kl), (vs, vl)) = guards;
    let (k, v) = (cpu_ptr::<T>(ks, kl)?, cpu_ptr::<T>(vs, vl)?);
    let rows = kl.shape().dims().first().copied().unwrap_or(0);
    let mut out = Vec::with_capacity(batch.seqs.len());
    let mut start = 0;
    for (s, table) in batch.seqs.iter().zip(cache.tables) {
        let visible = s.offset + s.len;
        let fits = table.len() * cache.block >= visible
            && table[..visible.div_ceil(cache.block)]
                .iter()
                .all(|&b| (b as usize + 1) * cache.block <= rows);
        if !fits {
            candle_core::bail!("slot {}: block table does not cover its positions", s.slot);
        }
        out.push(SeqAttn {
            q: qkv[start * ldqkv..].as_ptr(),
            ldq: ldqkv,
            // SAFETY: the spans cover the batch's rows back to back, so row
            // `start` is inside `out`'s `n` rows and rows start..start+len
            // belong to this sequence alone.
            out: SharedMut(unsafe { o.at(start * ldo) }),
            ldo,
            offset: s.offset,
            len: s.len,
            k,
            v,
            table: table.as_ptr(),
            block: cache.block,
        });
        start += s.len;
    }
    Ok(out)
}
