//! Causal grouped-query attention of a ragged batch, read in place from
//! each sequence's KV cache (`[tokens, kv_heads, head_dim]`, f32 or f16).
//!
//! Work units are (sequence, KV head, block of query rows): the query heads
//! sharing a KV head are scored together, so each key and value is loaded
//! once for the whole group. Per query row: scores = q·kᵀ over the visible
//! keys (the dot kernel of [`super::dot`], q already scaled), an exact
//! softmax (max-shifted, vectorised exp), then the probability-weighted sum
//! of values. Nothing is copied out of the cache and nothing is allocated
//! per call beyond per-thread score scratch that is kept between calls.

use std::cell::RefCell;

use super::dot::{dot_rows, WElem};
use super::math::{exp_shifted_sum, max};
use super::pool::{for_each_range, SharedMut};
use super::Isa;

/// Head layout shared by every sequence of the batch.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Heads {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Keys more than this many positions behind a query are invisible.
    pub sliding_window: Option<usize>,
}

/// One sequence's part of the batch.
#[derive(Clone, Copy)]
pub(crate) struct SeqAttn<T> {
    /// First query row (`len` rows, `ldq` apart, heads back to back, scaled).
    pub q: *const f32,
    pub ldq: usize,
    /// First output row (`len` rows, `ldo` apart, `num_heads · head_dim` used).
    pub out: SharedMut<f32>,
    pub ldo: usize,
    /// Position of the first query row; query i sits at `offset + i`.
    pub offset: usize,
    pub len: usize,
    /// The cache's K and V, valid for positions `0..offset + len`.
    pub k: *const T,
    pub v: *const T,
}

// SAFETY: workers read q, k, v and write disjoint output rows/heads.
unsafe impl<T: Sync> Sync for SeqAttn<T> {}
// SAFETY: as for Sync: the buffers outlive the call that hands them over.
unsafe impl<T: Send> Send for SeqAttn<T> {}

/// Query rows per work unit: long prefills split across threads.
const Q_BLOCK: usize = 16;

thread_local! {
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Runs attention for every sequence, on up to `threads` threads.
///
/// # Safety
/// Each `SeqAttn` must describe live buffers of the shapes its fields and
/// `heads` imply, and no two sequences may share output rows.
pub(crate) unsafe fn attention<T: WElem>(
    isa: Isa,
    threads: usize,
    heads: Heads,
    seqs: &[SeqAttn<T>],
) {
    // Unit u ↦ (sequence, query block, KV head), sequences in order.
    let mut first_unit = Vec::with_capacity(seqs.len() + 1);
    let mut units = 0;
    for s in seqs {
        first_unit.push(units);
        units += s.len.div_ceil(Q_BLOCK) * heads.num_kv_heads;
    }
    first_unit.push(units);
    for_each_range(units, 1, threads, |range| {
        for u in range {
            let s = first_unit.partition_point(|&f| f <= u) - 1;
            let local = u - first_unit[s];
            let (block, kvh) = (local / heads.num_kv_heads, local % heads.num_kv_heads);
            let seq = &seqs[s];
            let rows = block * Q_BLOCK..((block + 1) * Q_BLOCK).min(seq.len);
            SCORES.with(|sc| run_unit(isa, heads, seq, kvh, rows, &mut sc.borrow_mut()));
        }
    });
}

/// The query rows `rows` of one sequence, for the heads of KV head `kvh`.
unsafe fn run_unit<T: WElem>(
    isa: Isa,
    h: Heads,
    s: &SeqAttn<T>,
    kvh: usize,
    rows: std::ops::Range<usize>,
    scores: &mut Vec<f32>,
) {
    let g = h.num_heads / h.num_kv_heads;
    let hd = h.head_dim;
    let ldkv = h.num_kv_heads * hd;
    let need = g * (s.offset + rows.end);
    if scores.len() < need {
        scores.resize(need, 0.0);
    }
    for i in rows {
        let pos = s.offset + i;
        let first = match h.sliding_window {
            Some(w) if pos + 1 > w => pos + 1 - w,
            _ => 0,
        };
        let keys = pos + 1 - first;
        let q = s.q.add(i * s.ldq + kvh * g * hd);
        let k = s.k.add(first * ldkv + kvh * hd);
        let v = s.v.add(first * ldkv + kvh * hd);
        let sc = scores.as_mut_ptr();
        dot_rows(isa, q, hd, g, hd, k, ldkv, keys, sc, keys);
        for j in 0..g {
            let row = std::slice::from_raw_parts_mut(sc.add(j * keys), keys);
            let m = max(isa, row);
            let sum = exp_shifted_sum(isa, row, m);
            let inv = 1.0 / sum;
            for p in row.iter_mut() {
                *p *= inv;
            }
        }
        let out = s.out.at(i * s.ldo + kvh * g * hd);
        weighted_sum(isa, sc, keys, g, v, ldkv, hd, out);
    }
}

/// `out[j·hd + d] = Σ_t p[j·keys + t] · v[t·ldv + d]` for `j < g`, `d < hd`.
#[allow(clippy::too_many_arguments)]
unsafe fn weighted_sum<T: WElem>(
    isa: Isa,
    p: *const f32,
    keys: usize,
    g: usize,
    v: *const T,
    ldv: usize,
    hd: usize,
    out: *mut f32,
) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => {
            // Common head shapes keep every accumulator in registers and
            // read each value row once; the rest go 16 dimensions a pass.
            let a = x86::Args {
                p,
                keys,
                v,
                ldv,
                out,
                hd,
            };
            match (hd, g) {
                (64, 1) => x86::ws_regs::<4, 1, T>(a),
                (64, 2) => x86::ws_regs::<4, 2, T>(a),
                (64, 3) => x86::ws_regs::<4, 3, T>(a),
                (64, 4) => x86::ws_regs::<4, 4, T>(a),
                (64, 5) => x86::ws_regs::<4, 5, T>(a),
                (64, 6) => x86::ws_regs::<4, 6, T>(a),
                (128, 1) => x86::ws_regs::<8, 1, T>(a),
                (128, 2) => x86::ws_regs::<8, 2, T>(a),
                (128, 3) => x86::ws_regs::<8, 3, T>(a),
                _ => x86::weighted_sum_avx512(p, keys, g, v, ldv, hd, out),
            }
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => x86::weighted_sum_avx2(p, keys, g, v, ldv, hd, out),
        _ => {
            for j in 0..g {
                std::slice::from_raw_parts_mut(out.add(j * hd), hd).fill(0.0);
            }
            for t in 0..keys {
                let vt = v.add(t * ldv);
                for j in 0..g {
                    let pj = *p.add(j * keys + t);
                    let o = out.add(j * hd);
                    for d in 0..hd {
                        *o.add(d) += pj * (*vt.add(d)).to_f32();
                    }
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::WElem;

    /// Heads per register pass (accumulators: HEADS × 1 vector).
    const HEADS: usize = 8;

    /// 8 dimensions × up to 8 heads a pass over the keys (AVX2 tier).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn weighted_sum_avx2<T: WElem>(
        p: *const f32,
        keys: usize,
        g: usize,
        v: *const T,
        ldv: usize,
        hd: usize,
        out: *mut f32,
    ) {
        let mut d = 0;
        while d < hd {
            let lanes = (hd - d).min(8);
            let mut j0 = 0;
            while j0 < g {
                let nj = (g - j0).min(HEADS);
                let mut acc = [_mm256_setzero_ps(); HEADS];
                for t in 0..keys {
                    let vt = if lanes == 8 {
                        T::load8(v.add(t * ldv + d))
                    } else {
                        T::load8_partial(v.add(t * ldv + d), lanes)
                    };
                    for (j, a) in acc.iter_mut().enumerate().take(nj) {
                        let pj = _mm256_set1_ps(*p.add((j0 + j) * keys + t));
                        *a = _mm256_fmadd_ps(pj, vt, *a);
                    }
                }
                let mask = _mm256_cmpgt_epi32(
                    _mm256_set1_epi32(lanes as i32),
                    _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                );
                for (j, a) in acc.iter().enumerate().take(nj) {
                    _mm256_maskstore_ps(out.add((j0 + j) * hd + d), mask, *a);
                }
                j0 += nj;
            }
            d += 8;
        }
    }

    /// Operands of one weighted sum (see `super::weighted_sum`).
    pub(super) struct Args<T> {
        pub p: *const f32,
        pub keys: usize,
        pub v: *const T,
        pub ldv: usize,
        pub out: *mut f32,
        pub hd: usize,
    }

    /// G heads × C·16 dimensions held in registers over all keys.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub(super) unsafe fn ws_regs<const C: usize, const G: usize, T: WElem>(a: Args<T>) {
        let mut acc = [[_mm512_setzero_ps(); C]; G];
        for t in 0..a.keys {
            let vt: [__m512; C] = std::array::from_fn(|c| T::load16(a.v.add(t * a.ldv + 16 * c)));
            for (j, aj) in acc.iter_mut().enumerate() {
                let pj = _mm512_set1_ps(*a.p.add(j * a.keys + t));
                for (x, &vc) in aj.iter_mut().zip(&vt) {
                    *x = _mm512_fmadd_ps(pj, vc, *x);
                }
            }
        }
        for (j, aj) in acc.iter().enumerate() {
            for (c, x) in aj.iter().enumerate() {
                _mm512_storeu_ps(a.out.add(j * a.hd + 16 * c), *x);
            }
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn weighted_sum_avx512<T: WElem>(
        p: *const f32,
        keys: usize,
        g: usize,
        v: *const T,
        ldv: usize,
        hd: usize,
        out: *mut f32,
    ) {
        let mut d = 0;
        while d < hd {
            let lanes = (hd - d).min(16);
            let mask: __mmask16 = ((1u32 << lanes) - 1) as u16;
            let mut j0 = 0;
            while j0 < g {
                let nj = (g - j0).min(HEADS);
                let mut acc = [_mm512_setzero_ps(); HEADS];
                for t in 0..keys {
                    let vt = if lanes == 16 {
                        T::load16(v.add(t * ldv + d))
                    } else {
                        T::load16_masked(v.add(t * ldv + d), mask)
                    };
                    for (j, a) in acc.iter_mut().enumerate().take(nj) {
                        let pj = _mm512_set1_ps(*p.add((j0 + j) * keys + t));
                        *a = _mm512_fmadd_ps(pj, vt, *a);
                    }
                }
                for (j, a) in acc.iter().enumerate().take(nj) {
                    _mm512_mask_storeu_ps(out.add((j0 + j) * hd + d), mask, *a);
                }
                j0 += nj;
            }
            d += 16;
        }
    }
}
