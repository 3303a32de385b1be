//! Tests of the quantised linear: decoding equals candle's (llama.cpp's)
//! dequantisation exactly, products stay within the bound that 8-bit
//! activations allow of an f64 reference, on every ISA tier this CPU runs,
//! and batching or threading never changes a bit.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::qformat::{DecodedRow, QFormat, QuantisedRows, LEVELS};
use super::quant::{qmatmul_t, QMatrix};
use super::Isa;

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
    n: usize,
    k: usize,
    group: usize,
) -> Vec<(f64, f64)> {
    let mut out = Vec::new();
    for r in 0..rows {
        let xr = &x[r * k..(r + 1) * k];
        let level: Vec<f64> = xr
            .chunks(group)
            .map(|g| g.iter().fold(0f32, |m, v| m.max(v.abs())) as f64 / LEVELS as f64)
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
            let want = reference(&x, rows, &values, n, k, format.group());
            let w = QMatrix {
                format,
                bytes: &bytes,
                n,
                k,
            };
            for isa in Isa::supported() {
                for threads in [1, 2] {
                    for accumulate in [false, true] {
                        let mut out = vec![0.5f32; rows * n];
                        qmatmul_t(isa, threads, &x, rows, w, &mut out, accumulate);
                        for (i, (&got, &(s, bound))) in out.iter().zip(&want).enumerate() {
                            let s = if accumulate { s + 0.5 } else { s };
                            assert!(
                                (got as f64 - s).abs() <= bound,
                                "{format:?} {isa:?} rows {rows} k {k} n {n} out {i}: \
                                 {got} vs {s} (bound {bound})"
                            );
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
    n: usize,
    k: usize,
    group: usize,
) -> Vec<(f64, f64)> {
    let mut acts = QuantisedRows::default();
    acts.quantise(x, rows, k, group);
    let mut out = Vec::new();
    for r in 0..rows {
        for j in 0..n {
            let (mut s, mut mag) = (0f64, 0f64);
            for e in 0..k {
                let xq = acts.d[(r * k + e) / group] as f64 * acts.q[r * k + e] as f64;
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
        let want = exact_reference(&x, rows, &values, n, k, format.group());
        let w = QMatrix {
            format,
            bytes: &bytes,
            n,
            k,
        };
        for isa in Isa::supported() {
            let mut out = vec![0f32; rows * n];
            qmatmul_t(isa, 2, &x, rows, w, &mut out, false);
            for (i, (&got, &(s, tol))) in out.iter().zip(&want).enumerate() {
                assert!(
                    (got as f64 - s).abs() <= tol,
                    "{format:?} {isa:?} out {i}: {got} vs {s} (tolerance {tol})"
                );
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
        for isa in Isa::supported() {
            let mut batched = vec![0f32; rows * n];
            qmatmul_t(isa, 2, &x, rows, w, &mut batched, false);
            for r in 0..rows {
                let mut solo = vec![0f32; n];
                qmatmul_t(isa, 1, &x[r * k..(r + 1) * k], 1, w, &mut solo, false);
                assert_eq!(
                    solo.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    batched[r * n..(r + 1) * n]
                        .iter()
                        .map(|v| v.to_bits())
                        .collect::<Vec<_>>(),
                    "{format:?} {isa:?}: row {r} alone differs from the batch"
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
        let mut out = vec![1.5f32; 10];
        qmatmul_t(isa, 1, &[0.0; 128], 2, w, &mut out, true);
        assert_eq!(out, vec![1.5; 10], "{isa:?}");
    }
}
