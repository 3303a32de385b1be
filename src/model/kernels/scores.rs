//! Attention scores with the keys in lanes: the CPU pool stores each
//! block's keys transposed ([`KeyOrder::BlockLanes`](crate::kv::KeyOrder)),
//! so dimension `d` of a block's keys for one KV head is a row of adjacent
//! lanes, and one fused multiply-add a dimension adds `q_d · k_d` to the
//! scores of 16 keys (8 on AVX2) at once, with no horizontal sum.
//!
//! # Numerics
//! Every score is one chain over `d = 0, 1, …, hd − 1` from zero, one
//! lane a key: `s ← fma(q_d, k_d, s)` on the AVX2 and AVX-512 tiers (the
//! same bits on both), `s ← s + q_d · k_d` on the portable one. Neither
//! depends on what else a call holds (the number of keys, query vectors
//! or chunks a tile takes, a lane's neighbours), so a score's bits depend
//! on its query vector, its key and the tier alone: a decode, a verifying
//! row and a prompt row score alike.
//!
//! Measured on a 2-core Zen 4 EPYC against the pool's former token-major
//! keys scored by the projection tile (dimensions in lanes, a horizontal
//! sum per score, about as many instructions as the multiply-adds at a
//! head of 64): 1.6 ns a (key, query vector) at a decode and 1.2 at a
//! prompt unit on AVX-512, against 2.3–2.8 and 1.8–2.0 (AVX2: 1.5 and
//! 1.3); 2 048-token prompts 1.11–1.16× faster there and, with the AVX2
//! weighted sum in registers, 1.22–1.35× on AVX2, and single-stream
//! attention at 160 keys 0.43 → 0.30 ms a pass (BENCHMARKS.md, issue 22,
//! session 48).

use super::dot::WElem;
use super::Isa;

/// Up to [`lanes`] keys of one block and KV head, in adjacent lanes:
/// dimension `d` of key `i` at `k + d · ld + i` (`ld` is the block's
/// size); their scores go to columns `t..t + n`.
#[derive(Clone, Copy)]
pub(super) struct Chunk<T> {
    pub k: *const T,
    pub n: usize,
    pub t: usize,
}

/// The most keys a chunk holds on `isa`: one vector's lanes.
pub(super) fn lanes(isa: Isa) -> usize {
    match isa {
        Isa::Avx2 => 8,
        _ => 16,
    }
}

/// Chunks the widest tile on `isa` takes at once (at most [`MAX_GROUP`]):
/// a call of fewer runs them one at a time.
pub(super) fn group(isa: Isa) -> usize {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => x86::C256,
        #[cfg(target_arch = "x86_64")]
        _ => x86::C512,
        #[cfg(not(target_arch = "x86_64"))]
        _ => MAX_GROUP,
    }
}

/// The largest [`group`] of any tier.
pub(super) const MAX_GROUP: usize = 4;
#[cfg(target_arch = "x86_64")]
const _: () = assert!(x86::C512 <= MAX_GROUP && x86::C256 <= MAX_GROUP);

/// One scoring pass: `vecs` query vectors (`hd` floats apart from `q`)
/// against chunks of keys whose dimensions are `ld` apart, scores into
/// `sc` (`vecs` rows `ldsc` apart, a chunk's keys at its columns).
pub(super) struct Scores {
    pub q: *const f32,
    pub hd: usize,
    pub vecs: usize,
    pub ld: usize,
    pub sc: *mut f32,
    pub ldsc: usize,
}

/// `sc[v · ldsc + t + i] = Σ_d q[v · hd + d] · k_i[d]` for every query
/// vector `v` and key `i` of every chunk of `chunks`.
///
/// # Safety
/// `q` holds `vecs · hd` floats; each chunk's `n ≤ lanes(isa)` keys are
/// readable at `k + d · ld + i` for `d < hd`, `i < n`; `sc` has room for
/// every column the chunks name, in `vecs` rows `ldsc` apart.
pub(super) unsafe fn score_chunks<T: WElem>(isa: Isa, call: &Scores, chunks: &[Chunk<T>]) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx512Vnni => x86::chunks512(call, chunks),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => x86::chunks256(call, chunks),
        _ => portable(call, chunks),
    }
}

/// The portable tier: the same chain per key, the product rounded before
/// the add: `f32::mul_add` is a library call where the target has no
/// fused multiply-add (twice this loop's time over f16 keys on x86-64,
/// measured by `scores_speed`), and the plain loop over a chunk's keys
/// is one the compiler may vectorise.
unsafe fn portable<T: WElem>(c: &Scores, chunks: &[Chunk<T>]) {
    for ch in chunks {
        for v in 0..c.vecs {
            let q = std::slice::from_raw_parts(c.q.add(v * c.hd), c.hd);
            let s = std::slice::from_raw_parts_mut(c.sc.add(v * c.ldsc + ch.t), ch.n);
            s.fill(0.0);
            for (d, &qd) in q.iter().enumerate() {
                let k = std::slice::from_raw_parts(ch.k.add(d * c.ld), ch.n);
                for (s, &k) in s.iter_mut().zip(k) {
                    *s += qd * k.to_f32();
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{Chunk, Scores, WElem};

    /// Chunks and query vectors a tile takes at once: with a few query
    /// vectors (a decode's three), `V · C` independent chains hide the
    /// multiply-add's latency. AVX-512: 24 accumulators and 4 keys in 32
    /// registers, the query broadcast from memory into the multiply-add;
    /// AVX2: 9, 3 keys and the broadcast query in 16 (with 4 × 3 the tile
    /// spills).
    pub(super) const C512: usize = 4;
    const V512: usize = 6;
    pub(super) const C256: usize = 3;
    const V256: usize = 3;

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub(super) unsafe fn chunks512<T: WElem>(call: &Scores, chunks: &[Chunk<T>]) {
        let mut groups = chunks.chunks_exact(C512);
        for g in &mut groups {
            vecs512::<C512, T>(call, g.try_into().unwrap_unchecked());
        }
        for ch in groups.remainder() {
            vecs512::<1, T>(call, &[*ch]);
        }
    }

    /// Every query vector of the call against the chunks `ch`, in tiles of
    /// up to [`V512`] vectors.
    #[inline(always)]
    unsafe fn vecs512<const NC: usize, T: WElem>(call: &Scores, ch: &[Chunk<T>; NC]) {
        let mut v0 = 0;
        while v0 < call.vecs {
            let nv = (call.vecs - v0).min(V512);
            match nv {
                1 => tile512::<1, NC, T>(call, v0, ch),
                2 => tile512::<2, NC, T>(call, v0, ch),
                3 => tile512::<3, NC, T>(call, v0, ch),
                4 => tile512::<4, NC, T>(call, v0, ch),
                5 => tile512::<5, NC, T>(call, v0, ch),
                _ => tile512::<V512, NC, T>(call, v0, ch),
            }
            v0 += nv;
        }
    }

    /// Query vectors `v0..v0 + V` against the chunks `ch`: masked loads
    /// (a short chunk reads only its own keys) and masked stores.
    #[inline(always)]
    unsafe fn tile512<const V: usize, const NC: usize, T: WElem>(
        call: &Scores,
        v0: usize,
        ch: &[Chunk<T>; NC],
    ) {
        let masks: [u16; NC] = std::array::from_fn(|c| ((1u32 << ch[c].n) - 1) as u16);
        let q = call.q.add(v0 * call.hd);
        let mut acc = [[_mm512_setzero_ps(); NC]; V];
        for d in 0..call.hd {
            let kv: [__m512; NC] =
                std::array::from_fn(|c| T::load16_masked(ch[c].k.add(d * call.ld), masks[c]));
            for (v, av) in acc.iter_mut().enumerate() {
                let qd = _mm512_set1_ps(*q.add(v * call.hd + d));
                for (a, &k) in av.iter_mut().zip(&kv) {
                    *a = _mm512_fmadd_ps(qd, k, *a);
                }
            }
        }
        for (v, av) in acc.iter().enumerate() {
            let row = call.sc.add((v0 + v) * call.ldsc);
            for (c, &a) in av.iter().enumerate() {
                _mm512_mask_storeu_ps(row.add(ch[c].t), masks[c], a);
            }
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn chunks256<T: WElem>(call: &Scores, chunks: &[Chunk<T>]) {
        let mut groups = chunks.chunks_exact(C256);
        for g in &mut groups {
            vecs256::<C256, T>(call, g.try_into().unwrap_unchecked());
        }
        for ch in groups.remainder() {
            vecs256::<1, T>(call, &[*ch]);
        }
    }

    #[inline(always)]
    unsafe fn vecs256<const NC: usize, T: WElem>(call: &Scores, ch: &[Chunk<T>; NC]) {
        // Full chunks (all but a run's last) take a tile without the
        // short chunks' per-load branch.
        if ch.iter().all(|c| c.n == 8) {
            vec_tiles256::<NC, true, T>(call, ch)
        } else {
            vec_tiles256::<NC, false, T>(call, ch)
        }
    }

    #[inline(always)]
    unsafe fn vec_tiles256<const NC: usize, const FULL: bool, T: WElem>(
        call: &Scores,
        ch: &[Chunk<T>; NC],
    ) {
        let mut v0 = 0;
        while v0 < call.vecs {
            let nv = (call.vecs - v0).min(V256);
            match nv {
                1 => tile256::<1, NC, FULL, T>(call, v0, ch),
                2 => tile256::<2, NC, FULL, T>(call, v0, ch),
                _ => tile256::<V256, NC, FULL, T>(call, v0, ch),
            }
            v0 += nv;
        }
    }

    /// The AVX2 tile: 8 lanes; a short chunk's keys are read one by one
    /// (AVX2 has no masked 16-bit load), only its own.
    #[inline(always)]
    unsafe fn tile256<const V: usize, const NC: usize, const FULL: bool, T: WElem>(
        call: &Scores,
        v0: usize,
        ch: &[Chunk<T>; NC],
    ) {
        let q = call.q.add(v0 * call.hd);
        let mut acc = [[_mm256_setzero_ps(); NC]; V];
        for d in 0..call.hd {
            let kv: [__m256; NC] = std::array::from_fn(|c| {
                let p = ch[c].k.add(d * call.ld);
                if FULL || ch[c].n == 8 {
                    T::load8(p)
                } else {
                    T::load8_partial(p, ch[c].n)
                }
            });
            for (v, av) in acc.iter_mut().enumerate() {
                let qd = _mm256_set1_ps(*q.add(v * call.hd + d));
                for (a, &k) in av.iter_mut().zip(&kv) {
                    *a = _mm256_fmadd_ps(qd, k, *a);
                }
            }
        }
        let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        for (v, av) in acc.iter().enumerate() {
            let row = call.sc.add((v0 + v) * call.ldsc);
            for (c, &a) in av.iter().enumerate() {
                let mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(ch[c].n as i32), lanes);
                _mm256_maskstore_ps(row.add(ch[c].t), mask, a);
            }
        }
    }
}
