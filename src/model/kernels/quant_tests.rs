//! Tests of the quantised linear: decoding equals candle's (llama.cpp's)
//! dequantisation exactly, products stay within the bound that the
//! activations' levels (8-bit or 15-bit) allow of an f64 reference, on
//! every ISA tier this CPU runs (forced lower tiers included), and
//! batching or threading never changes a bit.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::packed::{self, record, Packed, ROWS};
use super::qformat::{
    ActivationQuant, DecodedRow, QFormat, QuantisedRows, QuantisedRows8, LEVELS, LEVELS8,
};
use super::quant::{qmatmul_t, QMatrix};
use super::Isa;

const QUANTS: [ActivationQuant; 2] = [ActivationQuant::Int8, ActivationQuant::Int16];

/// The most an activation level may be: `x ≈ d · q`, `|q| ≤ levels`.
fn levels(quant: ActivationQuant) -> f32 {
    match quant {
        ActivationQuant::Int8 => LEVELS8,
        ActivationQuant::Int16 => LEVELS,
    }
}

const FORMATS: [(GgmlDType, QFormat); 8] = [
    (GgmlDType::Q4_0, QFormat::Q4_0),
    (GgmlDType::Q4_1, QFormat::Q4_1),
    (GgmlDType::Q5_0, QFormat::Q5_0),
    (GgmlDType::Q5_1, QFormat::Q5_1),
    (GgmlDType::Q8_0, QFormat::Q8_0),
    (GgmlDType::Q4K, QFormat::Q4K),
    (GgmlDType::Q5K, QFormat::Q5K),
    (GgmlDType::Q6K, QFormat::Q6K),
];

/// Values spread over several magnitudes, with an offset so that formats
/// with a min see one, and a few exact zeros.
fn weights(rng: &mut ChaCha8Rng, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| match i % 97 {
            0 => 0.0,
            _ => rng.random_range(-1.0f32..1.2) * [0.02, 0.3, 2.0][i / 300 % 3],
        })
        .collect()
}

/// A quantised `[n, k]` matrix, its bytes and candle's dequantised values.
fn quantised(dtype: GgmlDType, n: usize, k: usize, seed: u64) -> (Vec<u8>, Vec<f32>) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let w = Tensor::from_vec(weights(&mut rng, n * k), (n, k), &Device::Cpu).unwrap();
    let q = QTensor::quantize(&w, dtype).unwrap();
    let dense = q.dequantize(&Device::Cpu).unwrap();
    let values = dense.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    (q.data().unwrap().into_owned(), values)
}

#[test]
fn decoded_rows_equal_candles_dequantisation() {
    for (dtype, format) in FORMATS {
        let (n, k) = (3, 512);
        let (bytes, values) = quantised(dtype, n, k, 7);
        let row_bytes = bytes.len() / n;
        let mut row = DecodedRow::default();
        for j in 0..n {
            row.decode(format, &bytes[j * row_bytes..(j + 1) * row_bytes], k);
            for e in 0..k {
                let g = e / format.group();
                let mut v = row.d[g] * row.w[e] as f32;
                if format.has_min() {
                    v += row.min[e / 32];
                }
                // Candle multiplies `(d · scale) · q`; the decoded form
                // `d · (scale · q)`: the same value up to one rounding.
                let want = values[j * k + e];
                assert!(
                    (v - want).abs() <= 2.5e-7 * want.abs().max(row.d[g] * row.w[e].abs() as f32),
                    "{format:?} row {j} element {e}: decoded {} · {} (+ min) = {v}, candle {want}",
                    row.d[g],
                    row.w[e]
                );
            }
        }
    }
}

/// `x · Wᵀ` in f64 over the dequantised weights, and the most that
/// quantised activations may move it: half a level of each element's
/// group, times the weight (plus f32 rounding of the sums).
fn reference(
    x: &[f32],
    rows: usize,
    w: &[f32],
    (n, k): (usize, usize),
    group: usize,
    levels: f32,
) -> Vec<(f64, f64)> {
    let mut out = Vec::new();
    for r in 0..rows {
        let xr = &x[r * k..(r + 1) * k];
        let level: Vec<f64> = xr
            .chunks(group)
            .map(|g| g.iter().fold(0f32, |m, v| m.max(v.abs())) as f64 / levels as f64)
            .collect();
        for j in 0..n {
            let (mut s, mut bound, mut mag) = (0f64, 0f64, 0f64);
            for e in 0..k {
                let wv = w[j * k + e] as f64;
                s += wv * xr[e] as f64;
                bound += wv.abs() * 0.505 * level[e / group];
                mag += (wv * xr[e] as f64).abs() + wv.abs() * level[e / group];
            }
            out.push((s, bound + 1e-5 * mag + 1e-6));
        }
    }
    out
}

#[test]
fn products_are_within_the_activation_rounding_bound_on_every_tier() {
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    for (dtype, format) in FORMATS {
        for &(rows, k, n) in &[(1, 256, 13), (3, 512, 8), (6, 256, 21), (17, 768, 9)] {
            let (bytes, values) = quantised(dtype, n, k, rows as u64);
            let x: Vec<f32> = (0..rows * k)
                .map(|i| rng.random_range(-1.0f32..1.0) * if i % 50 == 0 { 8.0 } else { 1.0 })
                .collect();
            let w = QMatrix {
                format,
                bytes: &bytes,
                n,
                k,
            };
            for quant in QUANTS {
                let want = reference(&x, rows, &values, (n, k), format.group(), levels(quant));
                for isa in Isa::supported() {
                    for threads in [1, 2] {
                        for accumulate in [false, true] {
                            let mut out = vec![0.5f32; rows * n];
                            qmatmul_t(isa, threads, quant, &x, rows, w, &mut out, accumulate);
                            for (i, (&got, &(s, bound))) in out.iter().zip(&want).enumerate() {
                                let s = if accumulate { s + 0.5 } else { s };
                                assert!(
                                    (got as f64 - s).abs() <= bound,
                                    "{format:?} {quant:?} {isa:?} rows {rows} k {k} n {n} \
                                     out {i}: {got} vs {s} (bound {bound})"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

/// The products of the dequantised weights with the quantised activations
/// the kernel multiplies (`x̂ = d · q`), in f64: the kernel's integer sums
/// are exact, so it may differ from these only by f32 rounding.
fn exact_reference(
    x: &[f32],
    rows: usize,
    w: &[f32],
    (n, k): (usize, usize),
    group: usize,
    quant: ActivationQuant,
) -> Vec<(f64, f64)> {
    // The activations as the kernel sees them: `d · q` per element.
    let (d, q): (Vec<f32>, Vec<f64>) = match quant {
        ActivationQuant::Int16 => {
            let mut acts = QuantisedRows::default();
            acts.quantise(x, rows, k, group);
            (acts.d, acts.q.iter().map(|&q| q as f64).collect())
        }
        ActivationQuant::Int8 => {
            let mut acts = QuantisedRows8::default();
            acts.quantise(x, rows, k, group);
            (acts.d, acts.q.iter().map(|&q| q as f64).collect())
        }
    };
    let mut out = Vec::new();
    for r in 0..rows {
        for j in 0..n {
            let (mut s, mut mag) = (0f64, 0f64);
            for e in 0..k {
                let xq = d[(r * k + e) / group] as f64 * q[r * k + e];
                let t = w[j * k + e] as f64 * xq;
                s += t;
                mag += t.abs();
            }
            out.push((s, 2e-6 * mag + 1e-7));
        }
    }
    out
}

#[test]
fn products_equal_the_quantised_activations_product_up_to_f32_rounding() {
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    for (dtype, format) in FORMATS {
        let (rows, k, n) = (6, 512, 11);
        let (bytes, values) = quantised(dtype, n, k, 9);
        let x: Vec<f32> = (0..rows * k)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let w = QMatrix {
            format,
            bytes: &bytes,
            n,
            k,
        };
        for quant in QUANTS {
            let want = exact_reference(&x, rows, &values, (n, k), format.group(), quant);
            for isa in Isa::supported() {
                let mut out = vec![0f32; rows * n];
                qmatmul_t(isa, 2, quant, &x, rows, w, &mut out, false);
                for (i, (&got, &(s, tol))) in out.iter().zip(&want).enumerate() {
                    assert!(
                        (got as f64 - s).abs() <= tol,
                        "{format:?} {quant:?} {isa:?} out {i}: {got} vs {s} (tolerance {tol})"
                    );
                }
            }
        }
    }
}

#[test]
fn quantised_activations_are_within_half_a_level() {
    let mut rng = ChaCha8Rng::seed_from_u64(8);
    let (rows, k) = (3, 512);
    let x: Vec<f32> = (0..rows * k)
        .map(|_| rng.random_range(-3.0f32..3.0))
        .collect();
    for group in [32, 256] {
        let mut acts = QuantisedRows::default();
        acts.quantise(&x, rows, k, group);
        for (e, &v) in x.iter().enumerate() {
            let d = acts.d[e / group];
            let q = acts.q[e];
            // Half a level, plus f32 rounding of `v / d` at levels up to 16383.
            assert!(
                (q as f32 * d - v).abs() <= 0.505 * d,
                "element {e}: {q}·{d} vs {v}"
            );
        }
        for b in 0..rows * k / 32 {
            let s: i32 = acts.q[32 * b..32 * b + 32].iter().map(|&q| q as i32).sum();
            assert_eq!(acts.sum[b], acts.d[32 * b / group] * s as f32, "block {b}");
        }
        let mut acts8 = QuantisedRows8::default();
        acts8.quantise(&x, rows, k, group);
        for (e, &v) in x.iter().enumerate() {
            let (d, q) = (acts8.d[e / group], acts8.q[e]);
            assert!(
                (q as f32 * d - v).abs() <= 0.5001 * d,
                "8-bit element {e}: {q}·{d} vs {v}"
            );
        }
        for b in 0..rows * k / 32 {
            let s: i32 = acts8.q[32 * b..32 * b + 32].iter().map(|&q| q as i32).sum();
            assert_eq!(acts8.qsum[b] as i32, s, "8-bit block {b}");
            assert_eq!(
                acts8.sum[b],
                acts8.d[32 * b / group] * s as f32,
                "8-bit block {b}"
            );
        }
    }
}

#[test]
fn batching_and_threads_never_change_a_bit() {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let (rows, k, n) = (11, 512, 19);
    for (dtype, format) in FORMATS {
        let (bytes, _) = quantised(dtype, n, k, 5);
        let w = QMatrix {
            format,
            bytes: &bytes,
            n,
            k,
        };
        let x: Vec<f32> = (0..rows * k)
            .map(|_| rng.random_range(-2.0f32..2.0))
            .collect();
        for (quant, isa) in QUANTS
            .into_iter()
            .flat_map(|q| Isa::supported().into_iter().map(move |i| (q, i)))
        {
            let mut batched = vec![0f32; rows * n];
            qmatmul_t(isa, 2, quant, &x, rows, w, &mut batched, false);
            for r in 0..rows {
                let mut solo = vec![0f32; n];
                qmatmul_t(
                    isa,
                    1,
                    quant,
                    &x[r * k..(r + 1) * k],
                    1,
                    w,
                    &mut solo,
                    false,
                );
                assert_eq!(
                    solo.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    batched[r * n..(r + 1) * n]
                        .iter()
                        .map(|v| v.to_bits())
                        .collect::<Vec<_>>(),
                    "{format:?} {quant:?} {isa:?}: row {r} alone differs from the batch"
                );
            }
        }
    }
}

#[test]
fn zero_activations_give_exact_zeros_and_accumulate_adds_nothing() {
    let (bytes, _) = quantised(GgmlDType::Q4_1, 5, 64, 1);
    let w = QMatrix {
        format: QFormat::Q4_1,
        bytes: &bytes,
        n: 5,
        k: 64,
    };
    for isa in Isa::supported() {
        for quant in QUANTS {
            let mut out = vec![1.5f32; 10];
            qmatmul_t(isa, 1, quant, &[0.0; 128], 2, w, &mut out, true);
            assert_eq!(out, vec![1.5; 10], "{quant:?} {isa:?}");
        }
    }
}

#[test]
fn the_simd_tiers_form_the_same_8_bit_sums() {
    // `vpdpbusd` (VNNI) and `vpmaddubsw` + `vpmaddwd` (AVX2) give the same
    // integers, converted at the same points: the same bits.
    let mut rng = ChaCha8Rng::seed_from_u64(12);
    let (rows, k, n) = (9, 768, 10);
    let simd: Vec<Isa> = Isa::supported()
        .into_iter()
        .filter(|&i| i > Isa::Portable)
        .collect();
    if simd.len() < 2 {
        eprintln!("SKIP: one SIMD tier on this CPU ({simd:?}): nothing to compare");
        return;
    }
    for (dtype, format) in FORMATS {
        let (bytes, _) = quantised(dtype, n, k, 6);
        let w = QMatrix {
            format,
            bytes: &bytes,
            n,
            k,
        };
        let x: Vec<f32> = (0..rows * k)
            .map(|_| rng.random_range(-2.0f32..2.0))
            .collect();
        let outs: Vec<Vec<u32>> = simd
            .iter()
            .map(|&isa| {
                let mut out = vec![0f32; rows * n];
                qmatmul_t(isa, 2, ActivationQuant::Int8, &x, rows, w, &mut out, false);
                out.iter().map(|v| v.to_bits()).collect()
            })
            .collect();
        for (isa, out) in simd.iter().zip(&outs) {
            assert_eq!(
                out, &outs[0],
                "{format:?}: {isa:?} differs from {:?}",
                simd[0]
            );
        }
    }
}

/// The formats `packed` repacks.
const PACKED: [(GgmlDType, QFormat); 7] = [
    (GgmlDType::Q8_0, QFormat::Q8_0),
    (GgmlDType::Q4_0, QFormat::Q4_0),
    (GgmlDType::Q4_1, QFormat::Q4_1),
    (GgmlDType::Q5_0, QFormat::Q5_0),
    (GgmlDType::Q5_1, QFormat::Q5_1),
    (GgmlDType::Q4K, QFormat::Q4K),
    (GgmlDType::Q6K, QFormat::Q6K),
];

/// An `[n, k]` matrix's GGML bytes, dequantised values, and the same
/// repacked.
fn packed_matrix(dtype: GgmlDType, n: usize, k: usize, seed: u64) -> (Vec<u8>, Vec<f32>, Packed) {
    let (bytes, values) = quantised(dtype, n, k, seed);
    let packed = Packed::pack(QFormat::of(dtype).expect("a block format"), &bytes, n, k);
    (bytes, values, packed)
}

#[test]
fn repacking_loses_nothing_and_takes_the_same_memory() {
    for (dtype, format) in PACKED {
        for n in [1, 8, 13, 24] {
            let (bytes, _, packed) = packed_matrix(dtype, n, 768, n as u64);
            assert_eq!(packed.dims(), (n, 768));
            assert_eq!(packed.unpack(), bytes, "{format:?} n {n}");
            // Whole records of 8 blocks: the last group's padding is the
            // only extra (and Q4_K's scales unpacked from 6 bits).
            let records = n.div_ceil(ROWS) * 768 / format.group();
            assert_eq!(packed.bytes_len(), records * record(format));
            let extra = if format == QFormat::Q4K { 96 } else { 0 };
            assert_eq!(record(format), ROWS * format.block_bytes() + extra);
        }
    }
}

#[test]
fn packed_products_equal_the_quantised_activations_product_up_to_f32_rounding() {
    let mut rng = ChaCha8Rng::seed_from_u64(21);
    for (dtype, format) in PACKED {
        let shapes = [(1, 256, 13), (5, 512, 8), (9, 96, 21), (17, 768, 9)];
        for &(rows, k, n) in shapes.iter().filter(|s| s.1 % format.group() == 0) {
            let (_, values, packed) = packed_matrix(dtype, n, k, rows as u64 + 40);
            let x: Vec<f32> = (0..rows * k)
                .map(|i| rng.random_range(-1.0f32..1.0) * if i % 50 == 0 { 8.0 } else { 1.0 })
                .collect();
            let group = format.group();
            let want = exact_reference(&x, rows, &values, (n, k), group, ActivationQuant::Int8);
            for isa in Isa::supported() {
                for threads in [1, 2] {
                    for accumulate in [false, true] {
                        let mut out = vec![0.5f32; rows * n];
                        packed::matmul_t(isa, threads, &x, rows, &packed, &mut out, accumulate);
                        for (i, (&got, &(s, tol))) in out.iter().zip(&want).enumerate() {
                            let s = if accumulate { s + 0.5 } else { s };
                            assert!(
                                (got as f64 - s).abs() <= tol,
                                "{format:?} {isa:?} rows {rows} k {k} n {n} accumulate \
                                 {accumulate} out {i}: {got} vs {s} (tolerance {tol})"
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn packed_tiers_batches_and_threads_give_the_same_bits() {
    // Every tier forms the same block sums and adds them in the same
    // order, so all of them, every batch and every thread count agree.
    // (VNNI takes Q8_0's row groups in pairs, with another prefetch, in
    // calls of more than 2 rows, and Q4_0's and Q4_1's in calls of more
    // than 6: the 19-row calls here do, as do the few-row calls of 3-7
    // rows for Q8_0 and of 7 rows for the 4-bit formats; the 2-row calls
    // and the solo rows take the 8-lane tile.)
    let mut rng = ChaCha8Rng::seed_from_u64(22);
    let (rows, k, n) = (19, 512, 27);
    let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    for (dtype, format) in PACKED {
        let (_, _, packed) = packed_matrix(dtype, n, k, 23);
        let x: Vec<f32> = (0..rows * k)
            .map(|_| rng.random_range(-2.0f32..2.0))
            .collect();
        let mut reference = vec![0f32; rows * n];
        packed::matmul_t(Isa::Portable, 1, &x, rows, &packed, &mut reference, false);
        for isa in Isa::supported() {
            for threads in [1, 2, 3] {
                let mut batched = vec![0f32; rows * n];
                packed::matmul_t(isa, threads, &x, rows, &packed, &mut batched, false);
                assert_eq!(
                    bits(&batched),
                    bits(&reference),
                    "{format:?} {isa:?} threads {threads}"
                );
            }
            for few in 2..=7 {
                let mut part = vec![0f32; few * n];
                packed::matmul_t(isa, 2, &x[..few * k], few, &packed, &mut part, false);
                assert_eq!(
                    bits(&part),
                    bits(&reference[..few * n]),
                    "{format:?} {isa:?}: a call of {few} rows differs from the batch"
                );
            }
            for r in 0..rows {
                let mut solo = vec![0f32; n];
                packed::matmul_t(isa, 1, &x[r * k..(r + 1) * k], 1, &packed, &mut solo, false);
                assert_eq!(
                    bits(&solo),
                    bits(&reference[r * n..(r + 1) * n]),
                    "{format:?} {isa:?}: row {r} alone differs from the batch"
                );
            }
        }
    }
}

#[test]
fn packed_products_reach_the_extreme_levels_exactly() {
    // Weights at −128 and 127 against activations at ±127: the AVX2 tier's
    // byte pairs and the VNNI tier's offset sums at their limits.
    let k = 64;
    let n = 9;
    let mut bytes = Vec::new();
    for j in 0..n {
        for _ in 0..k / 32 {
            bytes.extend_from_slice(&half::f16::from_f32(0.5).to_le_bytes());
            bytes.extend((0..32).map(|e| if (e + j) % 2 == 0 { 0x80u8 } else { 0x7f }));
        }
    }
    let packed = Packed::pack(QFormat::Q8_0, &bytes, n, k);
    let x: Vec<f32> = (0..2 * k)
        .map(|e| if e % 3 == 0 { -1.0 } else { 1.0 })
        .collect();
    let mut acts = QuantisedRows8::default();
    acts.quantise(&x, 2, k, 32);
    for isa in Isa::supported() {
        let mut out = vec![0f32; 2 * n];
        packed::matmul_t(isa, 1, &x, 2, &packed, &mut out, false);
        for r in 0..2 {
            for j in 0..n {
                let mut want = 0f32;
                for g in 0..k / 32 {
                    let isum: i32 = (0..32)
                        .map(|e| {
                            let w = if (e + j) % 2 == 0 { -128 } else { 127 };
                            w * acts.q[r * k + 32 * g + e] as i32
                        })
                        .sum();
                    want = (isum as f32).mul_add(0.5 * acts.d[r * 2 + g], want);
                }
                assert_eq!(out[r * n + j], want, "{isa:?} row {r} output {j}");
            }
        }
    }
}

/// The quantiser the x86 tiers run gives the scalar one's bits: levels,
/// scales and every per-block sum, for groups of 32 and 256, with ties,
/// zero groups, extreme magnitudes, infinities and NaN among the inputs.
#[test]
fn the_vector_activation_quantiser_gives_the_scalar_ones_bits() {
    if !Isa::supported().contains(&Isa::Avx2) {
        eprintln!("skipped: no AVX2 on this CPU");
        return;
    }
    let mut rng = ChaCha8Rng::seed_from_u64(31);
    let (rows, k) = (3, 1536);
    let mut x: Vec<f32> = (0..rows * k)
        .map(|i| match i % 211 {
            // Exact ties once scaled: amax 127 makes d 1.
            0 => 127.0,
            1..=40 => (i % 9) as f32 - 4.5,
            _ => rng.random_range(-3.0f32..3.0) * [1e-3, 1.0, 50.0][i / 500 % 3],
        })
        .collect();
    x[64..96].fill(0.0);
    x[300] = f32::INFINITY;
    x[700] = f32::NEG_INFINITY;
    x[1000] = f32::NAN;
    x[2000..2032].iter_mut().for_each(|v| *v *= 1e-39);
    for group in [32, 256] {
        let mut scalar = QuantisedRows8::default();
        scalar.quantise(&x, rows, k, group);
        let mut vector = QuantisedRows8::default();
        // SAFETY: AVX2 was detected above.
        unsafe { super::quant::x86::quantise8(&mut vector, &x, rows, k, group) };
        assert_eq!(vector.q, scalar.q, "levels, group {group}");
        assert_eq!(vector.qu, scalar.qu, "unsigned levels, group {group}");
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&vector.d), bits(&scalar.d), "scales, group {group}");
        assert_eq!(bits(&vector.sum), bits(&scalar.sum), "sums, group {group}");
        assert_eq!(vector.qsum, scalar.qsum, "level sums, group {group}");
        assert_eq!(vector.qoff, scalar.qoff, "offsets, group {group}");
    }
}
