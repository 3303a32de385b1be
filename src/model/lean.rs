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
//! - [`Lean`] belongs to its [`Model`]; its workspace sits behind a mutex
//!   only so the model stays `Sync` (the engine thread is its one user).
//! - Activations are f32 whatever the weights are (f32, f16 or quantised);
//!   the KV cache is in the model's dtype (f32 or f16) and is converted on
//!   write and read, never copied per step.
//! - Results equal the candle path's within rounding; a row's result never
//!   depends on the other rows of the batch (see `kernels`).

use std::sync::Mutex;
use std::time::{Duration, Instant};

use candle_core::{CpuStorage, DType, Layout, Storage, Tensor};
use half::f16;

use super::kernels::attention::{attention, Heads, SeqAttn};
use super::kernels::math::{narrow, rms_norm, rope, silu_mul};
use super::kernels::pool::{for_each_range, threads, SharedMut};
use super::kernels::Isa;
use super::llama::Model;
use super::{Batch, ModelError};
use crate::kv::KvCache;

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
    x: Vec<f32>,
    h: Vec<f32>,
    qkv: Vec<f32>,
    attn: Vec<f32>,
    gu: Vec<f32>,
    act: Vec<f32>,
    positions: Vec<usize>,
    profile: Option<[Duration; PHASES.len()]>,
}

/// The lean path's state, built at load on CPU.
pub(crate) struct Lean {
    isa: Isa,
    threads: usize,
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

fn grow(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    if v.len() < n {
        v.resize(n, 0.0);
    }
    &mut v[..n]
}

/// Rows per parallel grab for row-wise element-wise work.
const ROW_GRAIN: usize = 8;
/// Elements below which row-wise work runs on the calling thread: waking
/// the pool costs more than it saves (and every parallel region is a
/// barrier a preempted thread can stall on a shared machine).
const PARALLEL_ELEMENTS: usize = 1 << 17;

impl Lean {
    /// Converts the model's norms, biases and rotary tables to f32.
    pub(crate) fn new(
        model_layers: &[(Tensor, Tensor, Option<Tensor>)],
        final_norm: &Tensor,
        cos: Vec<f32>,
        sin: Vec<f32>,
        thread_cap: Option<usize>,
    ) -> candle_core::Result<Self> {
        let mut layers = Vec::with_capacity(model_layers.len());
        for (attn_norm, mlp_norm, bias) in model_layers {
            layers.push(LayerVecs {
                attn_norm: to_f32_vec(attn_norm)?,
                mlp_norm: to_f32_vec(mlp_norm)?,
                qkv_bias: bias.as_ref().map(to_f32_vec).transpose()?,
            });
        }
        Ok(Self {
            isa: Isa::detect(),
            threads: threads(thread_cap),
            layers,
            final_norm: to_f32_vec(final_norm)?,
            cos,
            sin,
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
/// cache tensor at token `at`, converting to its dtype.
struct WriteRows<'a> {
    src: &'a [f32],
    ld: usize,
    width: usize,
    rows: usize,
    at: usize,
}

impl candle_core::InplaceOp1 for WriteRows<'_> {
    fn name(&self) -> &'static str {
        "tandem-kv-write"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let start = layout.start_offset() + self.at * self.width;
        let end = start + self.rows * self.width;
        let rows = (0..self.rows).map(|r| &self.src[r * self.ld..r * self.ld + self.width]);
        match storage {
            CpuStorage::F32(d) if d.len() >= end => {
                for (r, row) in rows.enumerate() {
                    let o = start + r * self.width;
                    d[o..o + self.width].copy_from_slice(row);
                }
            }
            CpuStorage::F16(d) if d.len() >= end => {
                for (r, row) in rows.enumerate() {
                    let o = start + r * self.width;
                    narrow(row, &mut d[o..o + self.width]);
                }
            }
            _ => candle_core::bail!("KV cache storage is not f32/f16 or is too short"),
        }
        Ok(())
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

impl Model {
    /// [`Model::forward_layers`] on the lean CPU path (batch already checked).
    pub(super) fn forward_lean(
        &self,
        lean: &Lean,
        batch: &Batch,
        kv: &mut KvCache,
        num_layers: usize,
        embeddings: Option<&Tensor>,
    ) -> Result<Tensor, ModelError> {
        let mut guard = lean.ws.lock().unwrap_or_else(|e| e.into_inner());
        let ws = &mut *guard;
        let cfg = &self.cfg;
        let (n, hsz, inter) = (batch.tokens.len(), cfg.hidden_size, cfg.intermediate_size);
        let (nh, nkv, hd) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
        let (qw, kvw) = (nh * hd, nkv * hd);
        let ldqkv = qw + 2 * kvw;
        let eps = cfg.rms_norm_eps as f32;
        let (isa, threads) = (lean.isa, lean.threads);
        // Phase times of this step; added to the profile only on success.
        let profiling = ws.profile.is_some();
        let mut times = [Duration::ZERO; PHASES.len()];
        let mut clock = Instant::now();
        let mut tick = |phase: usize| {
            if profiling {
                let now = Instant::now();
                times[phase] += now - clock;
                clock = now;
            }
        };

        ws.positions.clear();
        for s in &batch.seqs {
            ws.positions.extend(s.offset..s.offset + s.len);
        }
        let x = grow(&mut ws.x, n * hsz);
        match embeddings {
            // Input rows given by the caller (an MTP head's projected inputs).
            Some(e) => x.copy_from_slice(&e.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?),
            None => self.embed_rows(&batch.tokens, x)?,
        }
        tick(0);

        let heads = Heads {
            num_heads: nh,
            num_kv_heads: nkv,
            head_dim: hd,
            sliding_window: cfg.sliding_window,
        };
        let scale = 1.0 / (hd as f32).sqrt();
        for (l, layer) in self.layers.iter().take(num_layers).enumerate() {
            let vecs = &lean.layers[l];
            let h = grow(&mut ws.h, n * hsz);
            lean.norm_rows(x, &vecs.attn_norm, eps, h, n);
            tick(1);
            let qkv = grow(&mut ws.qkv, n * ldqkv);
            layer.qkv.forward_cpu(isa, threads, h, n, qkv, false)?;
            if let Some(b) = &vecs.qkv_bias {
                for row in qkv.chunks_exact_mut(ldqkv) {
                    for (v, b) in row.iter_mut().zip(b) {
                        *v += b;
                    }
                }
            }
            tick(2);
            let half = hd / 2;
            for (row, &p) in qkv.chunks_exact_mut(ldqkv).zip(&ws.positions) {
                let (cos, sin) = (
                    &lean.cos[p * half..(p + 1) * half],
                    &lean.sin[p * half..(p + 1) * half],
                );
                // Queries carry the softmax scale (after rotation, as the
                // candle path rounds it).
                rope(&mut row[..qw], hd, cos, sin, scale);
                rope(&mut row[qw..qw + kvw], hd, cos, sin, 1.0);
            }
            // Each sequence's cache of this layer, shared by the writes and
            // the attention below.
            let views = batch
                .seqs
                .iter()
                .map(|s| kv.view(s.slot, l, s.offset + s.len))
                .collect::<Result<Vec<_>, _>>()?;
            let mut start = 0;
            for (s, (kc, vc)) in batch.seqs.iter().zip(&views) {
                let rows = &qkv[start * ldqkv..(start + s.len) * ldqkv];
                for (t, col) in [(kc, qw), (vc, qw + kvw)] {
                    t.inplace_op1(&WriteRows {
                        src: &rows[col..],
                        ld: ldqkv,
                        width: kvw,
                        rows: s.len,
                        at: s.offset,
                    })?;
                }
                start += s.len;
            }
            tick(3);
            let attn = grow(&mut ws.attn, n * qw);
            attention_lean(
                isa,
                threads,
                heads,
                batch,
                &views,
                kv.layout().dtype,
                qkv,
                ldqkv,
                attn,
            )?;
            tick(4);
            layer.o_proj.forward_cpu(isa, threads, attn, n, x, true)?;
            tick(5);
            lean.norm_rows(x, &vecs.mlp_norm, eps, h, n);
            tick(1);
            let gu = grow(&mut ws.gu, n * 2 * inter);
            layer.gate_up.forward_cpu(isa, threads, h, n, gu, false)?;
            tick(6);
            let act = grow(&mut ws.act, n * inter);
            let (gu, a) = (&*gu, SharedMut(act.as_mut_ptr()));
            lean.rows(n, inter, |r| {
                let row = &gu[r * 2 * inter..(r + 1) * 2 * inter];
                // SAFETY: row r of `act` is written by this call alone.
                let dst = unsafe { std::slice::from_raw_parts_mut(a.at(r * inter), inter) };
                silu_mul(isa, &row[..inter], &row[inter..], dst);
            });
            tick(7);
            layer.down.forward_cpu(isa, threads, act, n, x, true)?;
            tick(8);
        }
        for s in &batch.seqs {
            kv.set_len(s.slot, s.offset + s.len)?;
        }

        let wanted = batch.output_indices();
        let mut out = Vec::with_capacity(wanted.len() * hsz);
        for &r in &wanted {
            out.extend_from_slice(&x[r as usize * hsz..(r as usize + 1) * hsz]);
        }
        if let Some(p) = ws.profile.as_mut() {
            for (p, t) in p.iter_mut().zip(times) {
                *p += t;
            }
        }
        let out = Tensor::from_vec(out, (wanted.len(), hsz), &self.device)?;
        Ok(out.to_dtype(self.dtype)?)
    }

    /// Embedding rows of `ids` into `x` (`ids.len() · hidden` floats).
    fn embed_rows(&self, ids: &[u32], x: &mut [f32]) -> Result<(), ModelError> {
        let h = self.cfg.hidden_size;
        let (storage, layout) = self.embed.storage_and_layout();
        for (r, &id) in ids.iter().enumerate() {
            let dst = &mut x[r * h..(r + 1) * h];
            let off = id as usize * h;
            match self.embed.dtype() {
                DType::F32 => {
                    let p = cpu_ptr::<f32>(&storage, layout)?;
                    // SAFETY: ids were checked against the vocabulary.
                    dst.copy_from_slice(unsafe { std::slice::from_raw_parts(p.add(off), h) });
                }
                DType::F16 => {
                    let p = cpu_ptr::<f16>(&storage, layout)?;
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

    /// [`Model::unembed`] on the lean CPU path.
    pub(super) fn unembed_lean(&self, lean: &Lean, hidden: &Tensor) -> Result<Tensor, ModelError> {
        let start = Instant::now();
        let (rows, h) = hidden.dims2()?;
        let x: Vec<f32> = hidden.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
        let mut normed = vec![0f32; rows * h];
        lean.norm_rows(
            &x,
            &lean.final_norm,
            self.cfg.rms_norm_eps as f32,
            &mut normed,
            rows,
        );
        let vocab = self.cfg.vocab_size;
        let mut logits = vec![0f32; rows * vocab];
        self.lm_head
            .forward_cpu(lean.isa, lean.threads, &normed, rows, &mut logits, false)?;
        let mut ws = lean.ws.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = ws.profile.as_mut() {
            p[PHASES.len() - 1] += start.elapsed();
        }
        Ok(Tensor::from_vec(logits, (rows, vocab), &self.device)?)
    }
}

/// Attention of every sequence over its cache (`views`: K and V of the
/// layer, one pair per sequence in batch order, in `kv_dtype`).
#[allow(clippy::too_many_arguments)]
fn attention_lean(
    isa: Isa,
    threads: usize,
    heads: Heads,
    batch: &Batch,
    views: &[(Tensor, Tensor)],
    kv_dtype: DType,
    qkv: &[f32],
    ldqkv: usize,
    out: &mut [f32],
) -> Result<(), ModelError> {
    let guards: Vec<_> = views
        .iter()
        .map(|(k, v)| (k.storage_and_layout(), v.storage_and_layout()))
        .collect();
    let ldo = heads.num_heads * heads.head_dim;
    let o = SharedMut(out.as_mut_ptr());
    type Guard<'a> = (candle_core::StorageRef<'a>, &'a Layout);
    fn seqs<T: candle_core::WithDType>(
        batch: &Batch,
        guards: &[(Guard, Guard)],
        qkv: &[f32],
        ldqkv: usize,
        o: SharedMut<f32>,
        ldo: usize,
    ) -> candle_core::Result<Vec<SeqAttn<T>>> {
        let mut out = Vec::with_capacity(batch.seqs.len());
        let mut start = 0;
        for (s, ((ks, kl), (vs, vl))) in batch.seqs.iter().zip(guards) {
            out.push(SeqAttn {
                q: qkv[start * ldqkv..].as_ptr(),
                ldq: ldqkv,
                // SAFETY (at use): rows start..start+len belong to this sequence.
                out: SharedMut(unsafe { o.at(start * ldo) }),
                ldo,
                offset: s.offset,
                len: s.len,
                k: cpu_ptr::<T>(ks, kl)?,
                v: cpu_ptr::<T>(vs, vl)?,
            });
            start += s.len;
        }
        Ok(out)
    }
    match kv_dtype {
        DType::F32 => {
            let s = seqs::<f32>(batch, &guards, qkv, ldqkv, o, ldo)?;
            // SAFETY: every pointer comes from a live guard or buffer of
            // the shape the batch describes (checked before the step).
            unsafe { attention(isa, threads, heads, &s) };
        }
        DType::F16 => {
            let s = seqs::<f16>(batch, &guards, qkv, ldqkv, o, ldo)?;
            unsafe { attention(isa, threads, heads, &s) };
        }
        other => return Err(ModelError::UnsupportedDType(format!("{other:?} KV cache"))),
    }
    Ok(())
}
