//! Kernel tests against plain f64 references, on every ISA tier this CPU
//! runs, with shapes that hit every tail (k, n and row counts that are not
//! multiples of the vector width, the 4-row weight group or the row tile).

use half::f16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::attention::{attention, Heads, SeqAttn};
use super::dot::{matmul_t, matmul_t_on, WElem};
use super::few_rows::Path;
use super::math::{exp_shifted_sum, max, rms_norm, silu_mul};
use super::pool::SharedMut;
use super::scores::{group, lanes, score_chunks, Chunk, Scores};
use super::Isa;

fn randn(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

/// Relative error of `got` against an f64 reference, scaled by the L1 norm
/// of the terms (the natural bound for a rounded sum).
fn check_rel(got: f32, want: f64, scale: f64, what: &str) {
    let err = (got as f64 - want).abs() / scale.max(1e-30);
    assert!(err <= 1e-6, "{what}: got {got}, want {want} (rel {err:e})");
}

fn reference<W: WElem>(x: &[f32], rows: usize, k: usize, w: &[W], n: usize) -> Vec<(f64, f64)> {
    let mut out = Vec::with_capacity(rows * n);
    for r in 0..rows {
        for j in 0..n {
            let (mut s, mut a) = (0f64, 0f64);
            for i in 0..k {
                let t = x[r * k + i] as f64 * w[j * k + i].to_f32() as f64;
                s += t;
                a += t.abs();
            }
            out.push((s, a));
        }
    }
    out
}

fn check_matmul<W: WElem>(w_of: impl Fn(&[f32]) -> Vec<W>) {
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    for isa in Isa::supported() {
        for &(rows, k, n) in &[
            (1, 768, 40),
            (1, 19, 5),
            (3, 64, 17),
            (4, 172, 64),
            (7, 33, 9),
            (13, 100, 30),
            (64, 48, 21),
            (70, 7, 3),
        ] {
            let x = randn(&mut rng, rows * k);
            let w = w_of(&randn(&mut rng, n * k));
            let want = reference(&x, rows, k, &w, n);
            for (threads, path) in [
                (1, Path::Stream),
                (2, Path::Stream),
                (2, Path::Halves),
                (2, Path::Tile),
            ] {
                for accumulate in [false, true] {
                    let mut out = vec![0.5f32; rows * n];
                    matmul_t_on(isa, path, threads, &x, rows, k, &w, n, &mut out, accumulate);
                    for (i, (&g, &(s, a))) in out.iter().zip(&want).enumerate() {
                        let s = if accumulate { s + 0.5 } else { s };
                        let what = format!("{isa:?} {path:?} {rows}x{k}x{n} [{i}]");
                        check_rel(g, s, a + 0.5, &what);
                    }
                }
            }
        }
    }
}

#[test]
fn matmul_f32_matches_reference() {
    check_matmul(|w| w.to_vec());
}

#[test]
fn matmul_f16_matches_reference() {
    check_matmul(|w| w.iter().map(|&v| f16::from_f32(v)).collect::<Vec<_>>());
}

#[test]
fn matmul_rows_are_batch_invariant() {
    // A row's result is bit-identical alone, inside any batch, on any
    // thread count: the property behind "batched == solo" being exact.
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    let (k, n) = (200, 37);
    let w = randn(&mut rng, n * k);
    let wh: Vec<f16> = w.iter().map(|&v| f16::from_f32(v)).collect();
    let x = randn(&mut rng, 23 * k);
    // Calls of a few rows stream their weights (on AVX-512 also in 256-bit
    // halves) or take the tiles (`may_stream`: up to 4 rows on AVX-512, 2
    // on AVX2; `few_rows` times which); 23 rows always take the tiles (f16
    // widened first on AVX2 and the portable tier, converted at each load
    // on AVX-512: `widens`).
    // Every row, by every path and the timed choice, equals the streamed
    // and the tiled single row.
    for isa in Isa::supported() {
        for batch in [23, 4, 3, 2, 1] {
            for path in Path::ALL.map(Some).into_iter().chain([None]) {
                let call = |x: &[f32], rows: usize, out: &mut [f32], half: bool| match (path, half)
                {
                    (Some(p), false) => matmul_t_on(isa, p, 2, x, rows, k, &w, n, out, false),
                    (Some(p), true) => matmul_t_on(isa, p, 2, x, rows, k, &wh, n, out, false),
                    (None, false) => matmul_t(isa, 2, x, rows, k, &w, n, out, false),
                    (None, true) => matmul_t(isa, 2, x, rows, k, &wh, n, out, false),
                };
                let mut all = vec![0f32; batch * n];
                let mut all_h = vec![0f32; batch * n];
                call(&x, batch, &mut all, false);
                call(&x, batch, &mut all_h, true);
                for r in [0, 1.min(batch - 1), batch / 2, batch - 1] {
                    let x = &x[r * k..(r + 1) * k];
                    for one_path in Path::ALL {
                        let mut one = vec![0f32; n];
                        matmul_t_on(isa, one_path, 1, x, 1, k, &w, n, &mut one, false);
                        assert_eq!(
                            one,
                            all[r * n..(r + 1) * n],
                            "{isa:?} f32 row {r} of {batch} ({path:?}) against {one_path:?}"
                        );
                        matmul_t_on(isa, one_path, 1, x, 1, k, &wh, n, &mut one, false);
                        assert_eq!(
                            one,
                            all_h[r * n..(r + 1) * n],
                            "{isa:?} f16 row {r} of {batch} ({path:?}) against {one_path:?}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn elementwise_math_matches_std() {
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    for isa in Isa::supported() {
        for n in [1, 7, 16, 33, 172] {
            let g: Vec<f32> = randn(&mut rng, n).iter().map(|v| v * 12.0).collect();
            let u = randn(&mut rng, n);
            let mut out = vec![0f32; n];
            silu_mul(isa, &g, &u, &mut out);
            for i in 0..n {
                let want = g[i] as f64 / (1.0 + (-g[i] as f64).exp()) * u[i] as f64;
                check_rel(
                    out[i],
                    want,
                    want.abs().max(1e-6),
                    &format!("{isa:?} silu {i}"),
                );
            }
            let mut s: Vec<f32> = randn(&mut rng, n).iter().map(|v| v * 30.0).collect();
            let want_max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let max = max(isa, &s);
            assert_eq!(max, want_max, "{isa:?} max of {n}");
            let orig = s.clone();
            let sum = exp_shifted_sum(isa, &mut s, max);
            let mut want_sum = 0f64;
            for i in 0..n {
                let want = ((orig[i] - max) as f64).exp();
                want_sum += want;
                check_rel(s[i], want, want, &format!("{isa:?} exp {i}"));
            }
            check_rel(sum, want_sum, want_sum, &format!("{isa:?} exp sum"));
        }
    }
    let x = randn(&mut rng, 37);
    let w = randn(&mut rng, 37);
    let mut out = vec![0f32; 37];
    rms_norm(&x, &w, 1e-5, &mut out);
    let ms = x.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / 37.0;
    for i in 0..37 {
        let want = x[i] as f64 / (ms + 1e-5).sqrt() * w[i] as f64;
        check_rel(out[i], want, want.abs().max(1e-6), "rms_norm");
    }
}

/// Plain causal GQA attention in f64 for one sequence.
fn attention_reference(
    h: Heads,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    offset: usize,
    len: usize,
) -> Vec<f64> {
    let (g, hd, nkv) = (h.num_heads / h.num_kv_heads, h.head_dim, h.num_kv_heads);
    let mut out = vec![0f64; len * h.num_heads * hd];
    for i in 0..len {
        let pos = offset + i;
        for head in 0..h.num_heads {
            let kvh = head / g;
            let visible: Vec<usize> = (0..=pos)
                .filter(|&t| h.sliding_window.is_none_or(|w| t + w > pos))
                .collect();
            let scores: Vec<f64> = visible
                .iter()
                .map(|&t| {
                    (0..hd)
                        .map(|d| {
                            q[(i * h.num_heads + head) * hd + d] as f64
                                * k[(t * nkv + kvh) * hd + d] as f64
                        })
                        .sum()
                })
                .collect();
            let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let z: f64 = e.iter().sum();
            for d in 0..hd {
                out[(i * h.num_heads + head) * hd + d] = visible
                    .iter()
                    .zip(&e)
                    .map(|(&t, p)| p / z * v[(t * nkv + kvh) * hd + d] as f64)
                    .sum();
            }
        }
    }
    out
}

/// A block table naming blocks 0, 1, 2, …: a contiguous cache.
static IDENTITY: [u32; 64] = {
    let mut t = [0u32; 64];
    let mut i = 0;
    while i < 64 {
        t[i] = i as u32;
        i += 1;
    }
    t
};

/// Keys `k` (`[rows, width]`, token-major) as a
/// [`KeyOrder::BlockLanes`](crate::kv::KeyOrder) pool holds them: each
/// `block` rows transposed, the last block padded.
fn in_block_lanes<T: Copy + Default>(k: &[T], width: usize, block: usize) -> Vec<T> {
    let rows = k.len() / width;
    let mut out = vec![T::default(); rows.div_ceil(block) * block * width];
    for (r, row) in k.chunks_exact(width).enumerate() {
        let (b, lane) = (r / block, r % block);
        for (c, &x) in row.iter().enumerate() {
            out[b * block * width + c * block + lane] = x;
        }
    }
    out
}

#[test]
fn a_scattered_block_table_gives_the_contiguous_result_bit_for_bit() {
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let block = 4;
    for isa in Isa::supported() {
        for (nh, nkv, hd, window) in [(9, 3, 64, None), (8, 4, 8, Some(6)), (4, 2, 20, None)] {
            let h = Heads {
                num_heads: nh,
                num_kv_heads: nkv,
                head_dim: hd,
                sliding_window: window,
            };
            // A short history (a few block runs) and a long one (dozens).
            for (offset, len) in [(13usize, 6usize), (130, 6)] {
                let n = offset + len;
                let blocks = n.div_ceil(block);
                let ldkv = nkv * hd;
                let q = randn(&mut rng, len * nh * hd);
                let k = randn(&mut rng, blocks * block * ldkv);
                let v = randn(&mut rng, blocks * block * ldkv);
                // The same rows scattered over a bigger pool, blocks reversed
                // and spread out.
                let table: Vec<u32> = (0..blocks).map(|b| (3 * (blocks - b) + 1) as u32).collect();
                let pool_rows = (3 * blocks + 2) * block;
                let (mut kp, mut vp) = (vec![0f32; pool_rows * ldkv], vec![0f32; pool_rows * ldkv]);
                for pos in 0..blocks * block {
                    let row = table[pos / block] as usize * block + pos % block;
                    kp[row * ldkv..(row + 1) * ldkv]
                        .copy_from_slice(&k[pos * ldkv..(pos + 1) * ldkv]);
                    vp[row * ldkv..(row + 1) * ldkv]
                        .copy_from_slice(&v[pos * ldkv..(pos + 1) * ldkv]);
                }
                let (k, kp) = (
                    in_block_lanes(&k, ldkv, block),
                    in_block_lanes(&kp, ldkv, block),
                );
                let ld = nh * hd;
                let run = |k: &[f32], v: &[f32], table: &[u32]| {
                    let mut out = vec![0f32; len * ld];
                    let seqs = [SeqAttn {
                        q: q.as_ptr(),
                        ldq: ld,
                        out: SharedMut(out.as_mut_ptr()),
                        ldo: ld,
                        offset,
                        len,
                        k: k.as_ptr(),
                        v: v.as_ptr(),
                        table: table.as_ptr(),
                        block,
                    }];
                    // SAFETY: the tables cover `n` positions of live pools.
                    unsafe { attention(isa, 2, h, &seqs) };
                    out
                };
                let contiguous = run(&k, &v, &IDENTITY);
                let scattered = run(&kp, &vp, &table);
                let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&contiguous),
                    bits(&scattered),
                    "{isa:?} {h:?} {offset}"
                );
            }
        }
    }
}

#[test]
fn a_sequence_attends_to_the_same_bits_alone_or_in_a_batch_on_any_threads_and_row_by_row() {
    let mut rng = ChaCha8Rng::seed_from_u64(21);
    let block = 16;
    for isa in Isa::supported() {
        for (nh, nkv, hd, window) in [(9, 3, 64, None), (8, 2, 8, Some(7)), (4, 1, 20, None)] {
            let h = Heads {
                num_heads: nh,
                num_kv_heads: nkv,
                head_dim: hd,
                sliding_window: window,
            };
            let ld = nh * hd;
            // Decodes and verifying passes over long and short histories,
            // and longer sequences to batch them with.
            let shapes = [
                (150usize, 1usize),
                (130, 3),
                (20, 17),
                (9, 1),
                (0, 12),
                (70, 2),
                // A lone stream's verifying span: alone on 2 threads its
                // rows are cut in two parts per KV head.
                (140, 9),
            ];
            let data: Vec<_> = shapes
                .iter()
                .map(|&(offset, len)| {
                    let n = offset + len;
                    let q = randn(&mut rng, len * ld);
                    let k = in_block_lanes(&randn(&mut rng, n * nkv * hd), nkv * hd, block);
                    let v = randn(&mut rng, n * nkv * hd);
                    (q, k, v)
                })
                .collect();
            // Outputs of sequences `which`, attended together on `threads`.
            let run = |which: &[usize], threads: usize| {
                let mut outs: Vec<Vec<f32>> = which
                    .iter()
                    .map(|&s| vec![0f32; shapes[s].1 * ld])
                    .collect();
                let seqs: Vec<SeqAttn<f32>> = which
                    .iter()
                    .zip(outs.iter_mut())
                    .map(|(&s, out)| SeqAttn {
                        q: data[s].0.as_ptr(),
                        ldq: ld,
                        out: SharedMut(out.as_mut_ptr()),
                        ldo: ld,
                        offset: shapes[s].0,
                        len: shapes[s].1,
                        k: data[s].1.as_ptr(),
                        v: data[s].2.as_ptr(),
                        table: IDENTITY.as_ptr(),
                        block,
                    })
                    .collect();
                // SAFETY: contiguous caches of `offset + len` rows each.
                unsafe { attention(isa, threads, h, &seqs) };
                outs.iter()
                    .map(|o| o.iter().map(|f| f.to_bits()).collect::<Vec<_>>())
                    .collect::<Vec<_>>()
            };
            // Row `r` of sequence `s` attended as a decode of its own (one
            // query row at its position, over the same cache).
            let decode = |s: usize, r: usize| {
                let mut out = vec![0f32; ld];
                let seq = SeqAttn {
                    q: data[s].0[r * ld..].as_ptr(),
                    ldq: ld,
                    out: SharedMut(out.as_mut_ptr()),
                    ldo: ld,
                    offset: shapes[s].0 + r,
                    len: 1,
                    k: data[s].1.as_ptr(),
                    v: data[s].2.as_ptr(),
                    table: IDENTITY.as_ptr(),
                    block,
                };
                // SAFETY: as in `run`: the cache holds `offset + r + 1` rows.
                unsafe { attention(isa, 1, h, &[seq]) };
                out.iter().map(|f| f.to_bits()).collect::<Vec<_>>()
            };
            let batched = run(&[2, 0, 3, 5, 1, 4, 6], 2);
            for (i, s) in [2, 0, 3, 5, 1, 4, 6].into_iter().enumerate() {
                let alone = run(&[s], 2);
                let alone_one_thread = run(&[s], 1);
                assert_eq!(
                    alone[0], batched[i],
                    "{isa:?} {h:?} seq {s}: alone vs batch"
                );
                assert_eq!(
                    alone_one_thread[0], batched[i],
                    "{isa:?} {h:?} seq {s}: 1 thread"
                );
                // A prompt's or a verification's rows, scored together,
                // equal each row decoded alone.
                for r in 0..shapes[s].1 {
                    assert_eq!(
                        decode(s, r),
                        batched[i][r * ld..(r + 1) * ld],
                        "{isa:?} {h:?} seq {s}: row {r} against its decode"
                    );
                }
            }
        }
    }
}

/// Scores of the query vectors `q` (`hd` floats each) against one KV
/// head's keys in block lanes (`keys` keys from key `from`, blocks of
/// `block`), chunked for `isa` and handed to the kernel `per_call` chunks
/// at a time.
fn lane_scores<T: WElem>(
    isa: Isa,
    q: &[f32],
    hd: usize,
    k: &[T],
    block: usize,
    (from, keys): (usize, usize),
    per_call: usize,
) -> Vec<f32> {
    let vecs = q.len() / hd;
    let mut sc = vec![f32::NAN; vecs * keys];
    let mut chunks = Vec::new();
    let mut t = 0;
    while t < keys {
        let pos = from + t;
        let n = (block - pos % block).min(keys - t);
        for i in (0..n).step_by(lanes(isa)) {
            chunks.push(Chunk {
                // SAFETY: inside `k`, which holds whole blocks.
                k: unsafe { k.as_ptr().add(pos / block * block * hd + pos % block + i) },
                n: (n - i).min(lanes(isa)),
                t: t + i,
            });
        }
        t += n;
    }
    let call = Scores {
        q: q.as_ptr(),
        hd,
        vecs,
        ld: block,
        sc: sc.as_mut_ptr(),
        ldsc: keys,
    };
    for some in chunks.chunks(per_call) {
        // SAFETY: every chunk's keys lie in `k`; `sc` has `keys` columns.
        unsafe { score_chunks(isa, &call, some) };
    }
    sc
}

#[test]
fn a_score_is_one_chain_over_its_dimensions_on_every_tier_and_tile() {
    let mut rng = ChaCha8Rng::seed_from_u64(31);
    for (hd, block, from, keys) in [
        (64usize, 16usize, 0usize, 75usize),
        (20, 4, 3, 30),
        (8, 32, 5, 90),
    ] {
        let blocks = (from + keys).div_ceil(block);
        let kf = randn(&mut rng, blocks * block * hd);
        let kh: Vec<f16> = kf.iter().map(|&x| f16::from_f32(x)).collect();
        for vecs in [1, 3, 7, 13] {
            let q = randn(&mut rng, vecs * hd);
            // One KV head's block lanes: dimension d of key p at
            // (p / block) · block · hd + d · block + p % block.
            // Fused on the SIMD tiers, the product rounded first on the
            // portable one.
            let chain = |fused: bool, k: &dyn Fn(usize) -> f32, v: usize, t: usize| {
                let p = from + t;
                (0..hd).fold(0f32, |s, d| {
                    let (q, k) = (
                        q[v * hd + d],
                        k(p / block * block * hd + d * block + p % block),
                    );
                    if fused {
                        q.mul_add(k, s)
                    } else {
                        s + q * k
                    }
                })
            };
            let want = |fused: bool, k: &dyn Fn(usize) -> f32| -> Vec<u32> {
                (0..vecs * keys)
                    .map(|i| chain(fused, k, i / keys, i % keys).to_bits())
                    .collect()
            };
            let bits = |x: Vec<f32>| x.into_iter().map(f32::to_bits).collect::<Vec<_>>();
            for isa in Isa::supported() {
                let fused = isa != Isa::Portable;
                let (want_f32, want_f16) =
                    (want(fused, &|i| kf[i]), want(fused, &|i| kh[i].to_f32()));
                for per_call in [1, 3, 4, 9] {
                    let case = (from, keys);
                    let got = lane_scores(isa, &q, hd, &kf, block, case, per_call);
                    assert_eq!(
                        bits(got),
                        want_f32,
                        "{isa:?} f32 hd {hd} vecs {vecs} {per_call}"
                    );
                    let got = lane_scores(isa, &q, hd, &kh, block, case, per_call);
                    assert_eq!(
                        bits(got),
                        want_f16,
                        "{isa:?} f16 hd {hd} vecs {vecs} {per_call}"
                    );
                }
            }
        }
    }
}

/// One attention case's inputs per sequence: q, K, V (f32) and an output
/// buffer, for the (offset, len) `shapes`.
type AttnCase = Vec<(Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>)>;

#[test]
fn attention_matches_reference() {
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    for isa in Isa::supported() {
        for (nh, nkv, hd, window) in [
            (12, 4, 64, None),
            (8, 4, 8, None),
            (4, 2, 20, Some(5)),
            (4, 4, 128, None),
            (16, 2, 64, Some(9)),
        ] {
            let h = Heads {
                num_heads: nh,
                num_kv_heads: nkv,
                head_dim: hd,
                sliding_window: window,
            };
            // (offset, len) per sequence: decode, prefill, chunk after history,
            // a verifying pass after a long history.
            let shapes = [(0, 1), (9, 1), (0, 37), (20, 5), (140, 2)];
            let mut data = Vec::new();
            for &(offset, len) in &shapes {
                let q = randn(&mut rng, len * nh * hd);
                let k = randn(&mut rng, (offset + len) * nkv * hd);
                let v = randn(&mut rng, (offset + len) * nkv * hd);
                data.push((q, k, v, vec![0f32; len * nh * hd]));
            }
            check_attention_f32(isa, h, &shapes, &mut data);
            check_attention_f16(isa, h, &shapes, &data);
        }
    }
}

/// The kernel over an f32 cache against the f64 reference.
fn check_attention_f32(isa: Isa, h: Heads, shapes: &[(usize, usize)], data: &mut AttnCase) {
    let ld = h.num_heads * h.head_dim;
    let ldkv = h.num_kv_heads * h.head_dim;
    let kl: Vec<Vec<f32>> = data.iter().map(|d| in_block_lanes(&d.1, ldkv, 4)).collect();
    let seqs: Vec<SeqAttn<f32>> = data
        .iter_mut()
        .zip(shapes)
        .zip(&kl)
        .map(|((d, &(offset, len)), kl)| SeqAttn {
            q: d.0.as_ptr(),
            ldq: ld,
            out: SharedMut(d.3.as_mut_ptr()),
            ldo: ld,
            offset,
            len,
            k: kl.as_ptr(),
            v: d.2.as_ptr(),
            table: IDENTITY.as_ptr(),
            block: 4,
        })
        .collect();
    // SAFETY: every pointer is into a live buffer of the shape its
    // sequence's (offset, len) implies; outputs are separate vectors.
    unsafe { attention(isa, 2, h, &seqs) };
    for (d, &(offset, len)) in data.iter().zip(shapes) {
        let want = attention_reference(h, &d.0, &d.1, &d.2, offset, len);
        for (i, (&g, &w)) in d.3.iter().zip(&want).enumerate() {
            assert!(
                (g as f64 - w).abs() <= 1e-5,
                "{isa:?} f32 attn [{i}]: {g} vs {w}"
            );
        }
    }
}

/// The kernel over an f16 cache (the same inputs rounded) against the f64
/// reference over the rounded values.
fn check_attention_f16(isa: Isa, h: Heads, shapes: &[(usize, usize)], data: &AttnCase) {
    let ld = h.num_heads * h.head_dim;
    let round = |x: &[f32]| -> Vec<f16> { x.iter().map(|&x| f16::from_f32(x)).collect() };
    let kh: Vec<Vec<f16>> = data.iter().map(|d| round(&d.1)).collect();
    let vh: Vec<Vec<f16>> = data.iter().map(|d| round(&d.2)).collect();
    let kl: Vec<Vec<f16>> = kh
        .iter()
        .map(|k| in_block_lanes(k, h.num_kv_heads * h.head_dim, 4))
        .collect();
    let mut outs: Vec<Vec<f32>> = shapes.iter().map(|&(_, l)| vec![0f32; l * ld]).collect();
    let seqs: Vec<SeqAttn<f16>> = outs
        .iter_mut()
        .enumerate()
        .map(|(s, o)| SeqAttn {
            q: data[s].0.as_ptr(),
            ldq: ld,
            out: SharedMut(o.as_mut_ptr()),
            ldo: ld,
            offset: shapes[s].0,
            len: shapes[s].1,
            k: kl[s].as_ptr(),
            v: vh[s].as_ptr(),
            table: IDENTITY.as_ptr(),
            block: 4,
        })
        .collect();
    // SAFETY: as for f32: live buffers of the implied shapes, separate outputs.
    unsafe { attention(isa, 2, h, &seqs) };
    for (s, &(offset, len)) in shapes.iter().enumerate() {
        let k: Vec<f32> = kh[s].iter().map(|x| x.to_f32()).collect();
        let v: Vec<f32> = vh[s].iter().map(|x| x.to_f32()).collect();
        let want = attention_reference(h, &data[s].0, &k, &v, offset, len);
        for (i, (&g, &w)) in outs[s].iter().zip(&want).enumerate() {
            assert!(
                (g as f64 - w).abs() <= 1e-5,
                "{isa:?} f16 attn [{i}]: {g} vs {w}"
            );
        }
    }
}

/// Throughput of the step's matmuls alone on the llama-100m shapes (12
/// layers + lm_head), as decode tokens/s. A report, not a check:
/// `cargo test --release --lib kernels::tests::matmul_speed -- --ignored --nocapture`.
#[test]
#[ignore]
fn matmul_speed() {
    use std::time::Instant;
    let shapes = [(1280, 768), (768, 768), (4096, 768), (768, 2048)];
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let layers: Vec<Vec<Vec<f32>>> = (0..12)
        .map(|_| {
            shapes
                .iter()
                .map(|&(n, k)| randn(&mut rng, n * k))
                .collect()
        })
        .collect();
    let head = randn(&mut rng, 32000 * 768);
    let layers_h: Vec<Vec<Vec<f16>>> = layers
        .iter()
        .map(|l| {
            l.iter()
                .map(|w| w.iter().map(|&v| f16::from_f32(v)).collect())
                .collect()
        })
        .collect();
    let head_h: Vec<f16> = head.iter().map(|&v| f16::from_f32(v)).collect();
    let isa = Isa::detect();
    let threads = super::pool::threads(None);
    for rows in [1usize, 4, 16, 64, 128] {
        let x = randn(&mut rng, rows * 2048);
        let mut out = vec![0f32; rows * 32000];
        let mut times = [Vec::new(), Vec::new()];
        for rep in 0..15 {
            for (f, t) in times.iter_mut().enumerate() {
                let start = Instant::now();
                for l in 0..12 {
                    for (s, &(n, k)) in shapes.iter().enumerate() {
                        if f == 0 {
                            matmul_t(isa, threads, &x, rows, k, &layers[l][s], n, &mut out, false);
                        } else {
                            matmul_t(
                                isa,
                                threads,
                                &x,
                                rows,
                                k,
                                &layers_h[l][s],
                                n,
                                &mut out,
                                false,
                            );
                        }
                    }
                }
                if f == 0 {
                    matmul_t(isa, threads, &x, rows, 768, &head, 32000, &mut out, false);
                } else {
                    matmul_t(isa, threads, &x, rows, 768, &head_h, 32000, &mut out, false);
                }
                if rep > 0 {
                    t.push(start.elapsed().as_secs_f64());
                }
            }
        }
        for (f, t) in times.iter_mut().enumerate() {
            t.sort_by(|a, b| a.partial_cmp(b).unwrap());
            let (med, min) = (t[t.len() / 2], t[0]);
            let bytes = 100.1e6 * if f == 0 { 4.0 } else { 2.0 };
            eprintln!(
                "{isa:?} {} rows {rows:>3}: median {:>7.2} ms {:>7.1} tok/s | best {:>7.1} tok/s {:>5.1} GB/s {:>6.1} GFLOP/s",
                ["f32", "f16"][f],
                med * 1e3,
                rows as f64 / med,
                rows as f64 / min,
                bytes / min / 1e9,
                2.0 * 100.1e6 * rows as f64 / min / 1e9
            );
        }
    }
}

/// Single-stream attention on SmolLM2's heads alone (9 query heads over 3
/// KV heads of 64, an f16 cache): a pass over 30 layers' pools of `keys`
/// positions, on one thread and on the pool, cache-warm and after
/// streaming 256 MB; a pass of one query row, or of a verifying span's
/// (`TANDEM_ATTENTION_SPEED_ROWS=1,3,9`, the rows ending at the last key;
/// `TANDEM_ATTENTION_SPEED_KEYS=800` for other key counts). A report, not
/// a check:
/// `cargo test --release --lib kernels::tests::attention_speed -- --ignored --nocapture`.
#[test]
#[ignore]
fn attention_speed() {
    use std::time::Instant;
    let h = Heads {
        num_heads: 9,
        num_kv_heads: 3,
        head_dim: 64,
        sliding_window: None,
    };
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let isa = Isa::detect();
    let pool_threads = super::pool::threads(None);
    let block = 16;
    let table: Vec<u32> = (0..256u32).collect();
    let flush: Vec<f32> = vec![1.0; 64 << 20];
    // Query width, and a pool row's width (elements and f16 bytes).
    let qw = h.num_heads * h.head_dim;
    let ld = h.num_kv_heads * h.head_dim;
    let row_bytes = (ld * std::mem::size_of::<f16>()) as f64;
    // A comma-separated list from the environment, or `default`.
    let list = |var: &str, default: &[usize]| -> Vec<usize> {
        std::env::var(var).map_or_else(
            |_| default.to_vec(),
            |v| v.split(',').filter_map(|r| r.parse().ok()).collect(),
        )
    };
    let spans = list("TANDEM_ATTENTION_SPEED_ROWS", &[1]);
    let key_counts = list("TANDEM_ATTENTION_SPEED_KEYS", &[16, 160, 2048]);
    for (keys, rows) in key_counts
        .iter()
        .flat_map(|&k| spans.iter().map(move |&r| (k, r)))
    {
        let half = |x: Vec<f32>| x.into_iter().map(f16::from_f32).collect::<Vec<_>>();
        let pools: Vec<(Vec<f16>, Vec<f16>)> = (0..30)
            .map(|_| {
                let n = keys.div_ceil(block) * block * ld;
                (half(randn(&mut rng, n)), half(randn(&mut rng, n)))
            })
            .collect();
        let q = randn(&mut rng, rows * qw);
        let mut out = vec![0f32; rows * qw];
        for threads in [1, pool_threads] {
            let mut pass = |cold: bool| {
                let mut times = Vec::new();
                for _ in 0..21 {
                    if cold {
                        let mut acc = [0f32; 16];
                        for c in flush.chunks_exact(16) {
                            acc.iter_mut().zip(c).for_each(|(a, &x)| *a += x);
                        }
                        std::hint::black_box(acc);
                    }
                    let start = Instant::now();
                    for (k, v) in &pools {
                        let seqs = [SeqAttn {
                            q: q.as_ptr(),
                            ldq: qw,
                            out: SharedMut(out.as_mut_ptr()),
                            ldo: qw,
                            offset: keys - rows,
                            len: rows,
                            k: k.as_ptr(),
                            v: v.as_ptr(),
                            table: table.as_ptr(),
                            block,
                        }];
                        // SAFETY: pools of `keys` rows, an identity table.
                        unsafe { attention(isa, threads, h, &seqs) };
                    }
                    times.push(start.elapsed().as_secs_f64() * 1e3);
                }
                times.sort_by(f64::total_cmp);
                times[times.len() / 2]
            };
            let (warm, cold) = (pass(false), pass(true));
            let layers = pools.len() as f64;
            let per_key = warm * 1e6 / (layers * h.num_kv_heads as f64 * keys as f64);
            let mb = layers * 2.0 * keys as f64 * row_bytes / 1e6;
            println!(
                "keys {keys:5}, rows {rows}, {threads} threads: {mb:5.1} MB a pass; warm {warm:.3} ms \
                 ({per_key:.1} ns a key and KV head), cold {cold:.3} ms ({:.1} GB/s)",
                mb / cold
            );
        }
    }
}

/// Throughput of the keys-in-lanes scores alone (SmolLM2's head width,
/// 2 048 f16 keys in L2, a decode's 3 query vectors and a prompt unit's
/// 48), per tier. A report, not a check:
/// `cargo test --release --lib kernels::tests::scores_speed -- --ignored --nocapture`.
#[test]
#[ignore]
fn scores_speed() {
    use std::time::Instant;
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let (hd, block, keys) = (64usize, 16usize, 2048usize);
    let kh: Vec<f16> = randn(&mut rng, keys * hd)
        .into_iter()
        .map(f16::from_f32)
        .collect();
    for isa in Isa::supported() {
        for vecs in [3usize, 48] {
            let q = randn(&mut rng, vecs * hd);
            let reps = 20_000_000 / (keys * vecs) + 1;
            let mut best = f64::MAX;
            for _ in 0..5 {
                let t0 = Instant::now();
                for _ in 0..reps {
                    std::hint::black_box(lane_scores(
                        isa,
                        &q,
                        hd,
                        &kh,
                        block,
                        (0, keys),
                        group(isa),
                    ));
                }
                best = best.min(t0.elapsed().as_secs_f64() / reps as f64);
            }
            println!(
                "{isa:?} vecs {vecs}: {:.3} ns a (key, vector)",
                best * 1e9 / (keys * vecs) as f64
            );
        }
    }
}
