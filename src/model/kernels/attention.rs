//! Causal grouped-query attention of a ragged batch, read in place from
//! the layer's paged KV pool through each sequence's block table: values
//! token-major (`[rows, kv_heads, head_dim]`), keys with each block
//! transposed (`[blocks][kv_heads · head_dim][block]`,
//! [`KeyOrder::BlockLanes`](crate::kv::KeyOrder)), f32 or f16.
//!
//! Work units are (sequence, KV head, block of query rows): the query heads
//! sharing a KV head, and the unit's query rows, are scored together (one
//! pass over the keys for all their query vectors), so each key is loaded
//! once for the unit and each value once for the group. Per query row:
//! scores = q·kᵀ over the visible keys (the keys-in-lanes kernel of
//! [`super::scores`], q already scaled; each score one chain of fused
//! multiply-adds over its dimensions, so a row's bits do not depend on the
//! rows scored with it, nor on the tier), an exact softmax (max-shifted,
//! vectorised exp), then the probability-weighted sum of values. Nothing
//! is copied out of the cache and nothing is allocated per call beyond
//! per-thread scratch (scores, a unit's gathered query vectors) kept
//! between calls.
//!
//! Paging: keys are scored a block run at a time (each score is its own
//! chain, so the split changes nothing), and the weighted sum walks the
//! value rows block by block inside one accumulation, in position order:
//! the result is the same, bit for bit, as over a contiguous cache,
//! whatever blocks the table names.

use std::cell::RefCell;

use super::dot::WElem;
use super::math::{exp_shifted_sum, max};
use super::pool::{for_each_range, SharedMut};
use super::scores::{group, lanes, score_chunks, Chunk, Scores, MAX_GROUP};
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
    /// The layer's K and V pools; the sequence's position `p` is at row
    /// `r = table[p / block] · block + p % block`, valid for `0..offset +
    /// len`: its values at `v + r · kv_heads · head_dim`, its key's
    /// element `c` (KV head `c / head_dim`) at `k + (r − r % block) ·
    /// kv_heads · head_dim + c · block + r % block` (each block's keys
    /// transposed).
    pub k: *const T,
    pub v: *const T,
    /// The sequence's block table (covering `offset + len` positions).
    pub table: *const u32,
    /// Rows per block.
    pub block: usize,
}

/// The keys or the values of positions `first..first + keys` of one
/// sequence, for one KV head: runs of consecutive positions (one per block
/// touched). Values are rows `ld = kv_heads · head_dim` apart; keys, in
/// the pool's block lanes (see [`SeqAttn::k`]), are lanes (`ld = 1`).
#[derive(Clone, Copy)]
pub(super) struct Rows<T> {
    /// The KV head's first element of pool block 0: position `off` of
    /// block `b` starts at `base + b · block_len + off · ld`.
    base: *const T,
    ld: usize,
    /// Elements a pool block holds (`block · kv_heads · head_dim`).
    block_len: usize,
    table: *const u32,
    block: usize,
    first: usize,
    keys: usize,
}

impl<T> Rows<T> {
    /// The run starting at key `t`: its first element and how many keys it
    /// holds.
    #[inline(always)]
    unsafe fn run(&self, t: usize) -> (*const T, usize) {
        let pos = self.first + t;
        let (b, off) = (pos / self.block, pos % self.block);
        let n = (self.block - off).min(self.keys - t);
        let start = *self.table.add(b) as usize * self.block_len;
        (self.base.add(start + off * self.ld), n)
    }

    /// Calls `f(t, ptr, n)` for each run: keys `t..t + n` start at `ptr`
    /// and are `ld` apart. In key order.
    #[inline(always)]
    unsafe fn runs(&self, mut f: impl FnMut(usize, *const T, usize)) {
        let mut t = 0;
        while t < self.keys {
            let (ptr, n) = self.run(t);
            f(t, ptr, n);
            t += n;
        }
    }

    /// Prefetches the first `bytes` of every row of the run starting at key
    /// `t` (as [`run`](Self::run) returns it) into L2; a hint, never a
    /// fault. Into L2 rather than L1: a unit asks for 64 lines a run, more
    /// than L1 tracks in flight, and single-stream attention took 15-30 %
    /// less time so (EPYC; BENCHMARKS.md, issue 22).
    #[inline(always)]
    unsafe fn prefetch(&self, t: usize, bytes: usize) {
        let (first, n) = self.run(t);
        for i in 0..n {
            prefetch_l2(first.wrapping_add(i * self.ld), bytes);
        }
    }

    /// Prefetches the first `bytes` of the KV head's part of the block
    /// holding key `t` (for keys: all of its lanes) into L2, as
    /// [`prefetch`](Self::prefetch) does.
    #[inline(always)]
    unsafe fn prefetch_block(&self, t: usize, bytes: usize) {
        let b = *self.table.add((self.first + t) / self.block) as usize;
        prefetch_l2(self.base.wrapping_add(b * self.block_len), bytes);
    }
}

/// Asks L2 for the `bytes` from `p`; a hint, never a fault.
#[inline(always)]
fn prefetch_l2<T>(p: *const T, bytes: usize) {
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, bytes);
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
        for line in (0..bytes).step_by(64) {
            // SAFETY: a prefetch never faults, whatever the address.
            unsafe { _mm_prefetch::<_MM_HINT_T1>((p as *const i8).wrapping_add(line)) };
        }
    }
}

// SAFETY: workers read q, k, v and write disjoint output rows/heads.
unsafe impl<T: Sync> Sync for SeqAttn<T> {}
// SAFETY: as for Sync: the buffers outlive the call that hands them over.
unsafe impl<T: Send> Send for SeqAttn<T> {}

/// Query rows per work unit: long prefills split across threads.
const Q_BLOCK: usize = 16;

/// A worker's buffers, kept between calls: a unit's scores (then
/// probabilities), `[query vector, key]`, and its gathered query vectors.
struct Scratch {
    scores: Vec<f32>,
    q: Vec<f32>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = const {
        RefCell::new(Scratch {
            scores: Vec::new(),
            q: Vec::new(),
        })
    };
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
    // Unit u ↦ (sequence, part of its query rows, KV head), sequences in
    // order.
    let parts = row_parts(seqs, heads.num_kv_heads, threads);
    let mut first_unit = Vec::with_capacity(seqs.len() + 1);
    let mut units = 0;
    for &n in &parts {
        first_unit.push(units);
        units += n * heads.num_kv_heads;
    }
    first_unit.push(units);
    for_each_range(units, 1, threads, |range| {
        for u in range {
            let s = first_unit.partition_point(|&f| f <= u) - 1;
            let local = u - first_unit[s];
            let (part, kvh) = (local / heads.num_kv_heads, local % heads.num_kv_heads);
            let (seq, n) = (&seqs[s], parts[s]);
            let rows = seq.len * part / n..seq.len * (part + 1) / n;
            SCRATCH.with(|sc| run_unit(isa, heads, seq, kvh, rows, &mut sc.borrow_mut()));
        }
    });
}

/// Parts each sequence's query rows are cut into (equal rows give or take
/// one), a unit each per KV head: as many as take at most [`Q_BLOCK`] rows
/// each, or, where those leave the threads fewer than two units each,
/// more, of at least [`part_rows`] rows each.
/// So a lone stream's verifying span (9 rows: 3 units over SmolLM2's KV
/// heads, compute-bound, one thread running two) spreads evenly: its
/// attention took 12-21 % less time (BENCHMARKS.md, session 54). Scores
/// are each their own chain and a row's softmax and sum its own, so how
/// the rows are cut changes no bit.
fn row_parts<T>(seqs: &[SeqAttn<T>], kv_heads: usize, threads: usize) -> Vec<usize> {
    let mut parts: Vec<usize> = seqs.iter().map(|s| s.len.div_ceil(Q_BLOCK)).collect();
    let min_rows = part_rows();
    if min_rows == 0 || threads <= 1 {
        return parts;
    }
    let wanted = 2 * threads;
    while parts.iter().sum::<usize>() * kv_heads < wanted {
        // One more part for the sequence whose parts are the largest.
        let most = (0..seqs.len())
            .filter(|&i| parts[i] > 0)
            .max_by_key(|&i| seqs[i].len / parts[i]);
        match most {
            Some(i) if seqs[i].len / (parts[i] + 1) >= min_rows => parts[i] += 1,
            _ => break,
        }
    }
    parts
}

/// The fewest query rows a part cut for balance takes
/// (`TANDEM_ATTENTION_PART_ROWS`, read once per process; 0: never cut).
fn part_rows() -> usize {
    static ROWS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *ROWS.get_or_init(|| {
        std::env::var("TANDEM_ATTENTION_PART_ROWS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(3)
    })
}

/// The query rows `rows` of one sequence, for the heads of KV head `kvh`:
/// every row's scores in one pass over the keys the rows see between them
/// (a kernel call a group of runs for all their query vectors: each score
/// is its own chain, computed the same way whatever else the call holds,
/// so scoring the rows together changes no bit; a row's scores outside its
/// own keys, past its position or, with a sliding window, before its
/// window, are computed and never read), then each row's softmax and
/// weighted sum over its own keys.
unsafe fn run_unit<T: WElem>(
    isa: Isa,
    h: Heads,
    s: &SeqAttn<T>,
    kvh: usize,
    rows: std::ops::Range<usize>,
    scratch: &mut Scratch,
) {
    let g = h.num_heads / h.num_kv_heads;
    let hd = h.head_dim;
    let ldkv = h.num_kv_heads * hd;
    let first_key = |i: usize| {
        let pos = s.offset + i;
        match h.sliding_window {
            Some(w) if pos + 1 > w => pos + 1 - w,
            _ => 0,
        }
    };
    let first = first_key(rows.start);
    // Keys from the first row's first to the last row's position.
    let span = s.offset + rows.end - first;
    let vecs = rows.len() * g;
    // The rows' query vectors `hd` apart: in place for one row, else
    // gathered (a prompt's rows are `ldq` apart).
    let q = if rows.len() == 1 {
        s.q.add(rows.start * s.ldq + kvh * g * hd)
    } else {
        scratch.q.clear();
        for i in rows.clone() {
            let at = s.q.add(i * s.ldq + kvh * g * hd);
            scratch
                .q
                .extend_from_slice(std::slice::from_raw_parts(at, g * hd));
        }
        scratch.q.as_ptr()
    };
    if scratch.scores.len() < vecs * span {
        scratch.scores.resize(vecs * span, 0.0);
    }
    let sc = scratch.scores.as_mut_ptr();
    let rows_of = |base: *const T, first: usize, keys: usize| Rows {
        base: base.add(kvh * hd),
        ld: ldkv,
        block_len: s.block * ldkv,
        table: s.table,
        block: s.block,
        first,
        keys,
    };
    let keys = Rows {
        base: s.k.add(kvh * hd * s.block),
        ld: 1,
        ..rows_of(s.k, first, span)
    };
    let call = Scores {
        q,
        hd,
        vecs,
        ld: s.block,
        sc,
        ldsc: span,
    };
    score_keys(isa, &call, &keys, &rows_of(s.v, first, span));
    for i in rows.clone() {
        let first_i = first_key(i);
        let keys = s.offset + i + 1 - first_i;
        // Row i's probabilities: head j's at `p + j · span`.
        let p = sc.add((i - rows.start) * g * span + (first_i - first));
        for j in 0..g {
            let row = std::slice::from_raw_parts_mut(p.add(j * span), keys);
            let m = max(isa, row);
            let sum = exp_shifted_sum(isa, row, m);
            let inv = 1.0 / sum;
            for x in row.iter_mut() {
                *x *= inv;
            }
        }
        let out = s.out.at(i * s.ldo + kvh * g * hd);
        weighted_sum(isa, p, span, g, rows_of(s.v, first_i, keys), hd, out);
    }
}

/// Every score of `call` against `keys`, a group of chunks (a kernel's
/// widest tile) a call. The pass asks for each run's value rows while it
/// scores the run's keys, and for the keys a group of runs ahead: the
/// weighted sums and the next scores then find them in cache. A decode's
/// keys and values come from memory, a few rows of each per block, and
/// waiting for them was most of its attention (single-stream SmolLM2
/// Q8_0: 0.36 ms a pass before the values, 0.33 after; with the next
/// keys, 0.42-0.62 ms against 0.52-0.70 on an EPYC; BENCHMARKS.md).
unsafe fn score_keys<T: WElem>(isa: Isa, call: &Scores, keys: &Rows<T>, values: &Rows<T>) {
    let (width, per_call) = (lanes(isa), group(isa));
    let value_bytes = call.hd * std::mem::size_of::<T>();
    let key_bytes = value_bytes * keys.block;
    // Runs after the first start at a block's first key.
    let ahead = |t: usize, j: usize| t + j * keys.block;
    let first_run = keys.run(0).1;
    keys.prefetch_block(0, key_bytes);
    for j in 0..MAX_GROUP - 1 {
        if ahead(first_run, j) < keys.keys {
            keys.prefetch_block(ahead(first_run, j), key_bytes);
        }
    }
    let mut chunks = [Chunk {
        k: keys.base,
        n: 0,
        t: 0,
    }; MAX_GROUP];
    let mut grouped = 0;
    let mut t = 0;
    while t < keys.keys {
        let (k, n) = keys.run(t);
        values.prefetch(t, value_bytes);
        if ahead(t + n, MAX_GROUP - 1) < keys.keys {
            keys.prefetch_block(ahead(t + n, MAX_GROUP - 1), key_bytes);
        }
        for i in (0..n).step_by(width) {
            chunks[grouped] = Chunk {
                k: k.add(i),
                n: (n - i).min(width),
                t: t + i,
            };
            grouped += 1;
            if grouped == per_call {
                score_chunks(isa, call, &chunks[..grouped]);
                grouped = 0;
            }
        }
        t += n;
    }
    score_chunks(isa, call, &chunks[..grouped]);
}

/// `out[j·hd + d] = Σ_t p[j·ldp + t] · v_t[d]` for `j < g`, `d < hd`,
/// where `v_t` is the value row of key `t` in `v` (summed in key order).
unsafe fn weighted_sum<T: WElem>(
    isa: Isa,
    p: *const f32,
    ldp: usize,
    g: usize,
    v: Rows<T>,
    hd: usize,
    out: *mut f32,
) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx512Vnni => {
            // Common head shapes keep every accumulator in registers and
            // read each value row once; the rest go 16 dimensions a pass.
            let a = x86::Args { p, ldp, v, out, hd };
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
                _ => x86::weighted_sum_avx512(p, ldp, g, v, hd, out),
            }
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 if hd.is_multiple_of(16) && g <= 6 => {
            // 16 dimensions of every head a pass, in registers.
            for d0 in (0..hd).step_by(16) {
                let a = x86::Args { p, ldp, v, out, hd };
                match g {
                    1 => x86::ws_avx2_regs::<1, T>(a, d0),
                    2 => x86::ws_avx2_regs::<2, T>(a, d0),
                    3 => x86::ws_avx2_regs::<3, T>(a, d0),
                    4 => x86::ws_avx2_regs::<4, T>(a, d0),
                    5 => x86::ws_avx2_regs::<5, T>(a, d0),
                    _ => x86::ws_avx2_regs::<6, T>(a, d0),
                }
            }
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => x86::weighted_sum_avx2(p, ldp, g, v, hd, out),
        _ => {
            for j in 0..g {
                std::slice::from_raw_parts_mut(out.add(j * hd), hd).fill(0.0);
            }
            v.runs(|t0, rows, n| {
                for i in 0..n {
                    let vt = rows.add(i * v.ld);
                    for j in 0..g {
                        let pj = *p.add(j * ldp + t0 + i);
                        let o = out.add(j * hd);
                        for d in 0..hd {
                            *o.add(d) += pj * (*vt.add(d)).to_f32();
                        }
                    }
                }
            });
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{Rows, WElem};

    /// Heads per register pass (accumulators: HEADS × 1 vector).
    const HEADS: usize = 8;

    /// 8 dimensions × up to 8 heads a pass over the keys (AVX2 tier).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn weighted_sum_avx2<T: WElem>(
        p: *const f32,
        ldp: usize,
        g: usize,
        v: Rows<T>,
        hd: usize,
        out: *mut f32,
    ) {
        let (keys, ldv) = (v.keys, v.ld);
        let mut d = 0;
        while d < hd {
            let lanes = (hd - d).min(8);
            let mut j0 = 0;
            while j0 < g {
                let nj = (g - j0).min(HEADS);
                let mut acc = [_mm256_setzero_ps(); HEADS];
                let mut t0 = 0;
                while t0 < keys {
                    let (rows, n) = v.run(t0);
                    for i in 0..n {
                        let vt = if lanes == 8 {
                            T::load8(rows.add(i * ldv + d))
                        } else {
                            T::load8_partial(rows.add(i * ldv + d), lanes)
                        };
                        for (j, a) in acc.iter_mut().enumerate().take(nj) {
                            let pj = _mm256_set1_ps(*p.add((j0 + j) * ldp + t0 + i));
                            *a = _mm256_fmadd_ps(pj, vt, *a);
                        }
                    }
                    t0 += n;
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

    /// G heads × dimensions `d0..d0 + 16` held in registers over all keys
    /// (AVX2: 2G accumulators, two value vectors and a probability in 16
    /// registers); each output's sum is the generic AVX2 loop's.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn ws_avx2_regs<const G: usize, T: WElem>(a: Args<T>, d0: usize) {
        let (keys, ldv) = (a.v.keys, a.v.ld);
        let mut acc = [[_mm256_setzero_ps(); 2]; G];
        let mut t0 = 0;
        while t0 < keys {
            let (rows, n) = a.v.run(t0);
            for i in 0..n {
                let row = rows.add(i * ldv + d0);
                let vt = [T::load8(row), T::load8(row.add(8))];
                for (j, aj) in acc.iter_mut().enumerate() {
                    let pj = _mm256_set1_ps(*a.p.add(j * a.ldp + t0 + i));
                    for (x, &vc) in aj.iter_mut().zip(&vt) {
                        *x = _mm256_fmadd_ps(pj, vc, *x);
                    }
                }
            }
            t0 += n;
        }
        for (j, aj) in acc.iter().enumerate() {
            for (c, x) in aj.iter().enumerate() {
                _mm256_storeu_ps(a.out.add(j * a.hd + d0 + 8 * c), *x);
            }
        }
    }

    /// Operands of one weighted sum (see `super::weighted_sum`).
    pub(super) struct Args<T> {
        pub p: *const f32,
        /// The probabilities' head stride.
        pub ldp: usize,
        pub v: Rows<T>,
        pub out: *mut f32,
        pub hd: usize,
    }

    /// G heads × C·16 dimensions held in registers over all keys.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub(super) unsafe fn ws_regs<const C: usize, const G: usize, T: WElem>(a: Args<T>) {
        let (keys, ldv) = (a.v.keys, a.v.ld);
        let mut acc = [[_mm512_setzero_ps(); C]; G];
        let mut t0 = 0;
        while t0 < keys {
            let (rows, n) = a.v.run(t0);
            for i in 0..n {
                let vt: [__m512; C] =
                    std::array::from_fn(|c| T::load16(rows.add(i * ldv + 16 * c)));
                for (j, aj) in acc.iter_mut().enumerate() {
                    let pj = _mm512_set1_ps(*a.p.add(j * a.ldp + t0 + i));
                    for (x, &vc) in aj.iter_mut().zip(&vt) {
                        *x = _mm512_fmadd_ps(pj, vc, *x);
                    }
                }
            }
            t0 += n;
        }
        for (j, aj) in acc.iter().enumerate() {
            for (c, x) in aj.iter().enumerate() {
                _mm512_storeu_ps(a.out.add(j * a.hd + 16 * c), *x);
            }
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub(super) unsafe fn weighted_sum_avx512<T: WElem>(
        p: *const f32,
        ldp: usize,
        g: usize,
        v: Rows<T>,
        hd: usize,
        out: *mut f32,
    ) {
        let (keys, ldv) = (v.keys, v.ld);
        let mut d = 0;
        while d < hd {
            let lanes = (hd - d).min(16);
            let mask: __mmask16 = ((1u32 << lanes) - 1) as u16;
            let mut j0 = 0;
            while j0 < g {
                let nj = (g - j0).min(HEADS);
                let mut acc = [_mm512_setzero_ps(); HEADS];
                let mut t0 = 0;
                while t0 < keys {
                    let (rows, n) = v.run(t0);
                    for i in 0..n {
                        let vt = if lanes == 16 {
                            T::load16(rows.add(i * ldv + d))
                        } else {
                            T::load16_masked(rows.add(i * ldv + d), mask)
                        };
                        for (j, a) in acc.iter_mut().enumerate().take(nj) {
                            let pj = _mm512_set1_ps(*p.add((j0 + j) * ldp + t0 + i));
                            *a = _mm512_fmadd_ps(pj, vt, *a);
                        }
                    }
                    t0 += n;
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
