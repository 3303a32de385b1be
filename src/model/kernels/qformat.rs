//! GGML block formats as the quantised linear reads them: each block of a
//! weight row decodes into one shared form, so one kernel serves them all.
//!
//! # The decoded form
//! A weight row of `k` elements decodes into
//! - `w`: one `i16` per element, the block's integer level (centred where
//!   the format has a fixed zero point: Q4_0 `q − 8`, Q5_0 `q − 16`, Q6_K
//!   `q − 32`; raw where it has a min: Q4_1, Q5_1, Q4_K, Q5_K) times the
//!   K-quants' integer sub-block scale;
//! - `d`: one f32 scale per *group* (the block: 32 elements, or a K-quant
//!   super-block of 256);
//! - `min`: one f32 offset per 32 elements, for formats with a min;
//!
//! so that element `e` of group `g` is `d[g] · w[e] + min[e / 32]`: the
//! value llama.cpp's (and candle's) dequantisation gives, up to the order
//! of two f32 products, with everything but `d` and `min` in exact
//! integers, so the kernel can sum integer products and apply `d` once per
//! group.
//!
//! # Activations
//! Activations are quantised in the same groups, in one of two schemes
//! ([`ActivationQuant`]):
//! - 8-bit levels (±[`LEVELS8`], the default), ggml's `q8_0` / `q8_K`:
//!   what llama.cpp computes, multiplied as unsigned × signed bytes
//!   (`vpmaddubsw`, VNNI's `vpdpbusd`: 32 products an instruction at 256
//!   bits) by `quant8`;
//! - 15-bit levels (±[`LEVELS`]): the activation rounding error, which
//!   llama.cpp adds on top of the file's own weight rounding, becomes ~1/128
//!   of the 8-bit scheme's, so a quantised file computes nearly what its
//!   dequantised weights compute in f32 (`tests/gguf_quantised.rs`). The
//!   cost is 16-bit multiplies (`vpmaddwd`, 16 products an instruction)
//!   against the decoded form, by `quant`. Bounds: `|w| ≤ 32 · 128` (Q6_K)
//!   and `|x| ≤ 16383`, so a 32-bit lane holding 16 products (128 elements)
//!   cannot overflow.

use candle_core::quantized::GgmlDType;
use half::f16;

/// A GGML block format the lean quantised kernels multiply directly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum QFormat {
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q4K,
    Q5K,
    Q6K,
}

impl QFormat {
    /// The kernel format of `dtype`; `None` for types multiplied elsewhere
    /// (Q2_K, Q3_K: candle's kernels; floats: the dense kernels).
    pub(crate) fn of(dtype: GgmlDType) -> Option<Self> {
        Some(match dtype {
            GgmlDType::Q4_0 => Self::Q4_0,
            GgmlDType::Q4_1 => Self::Q4_1,
            GgmlDType::Q5_0 => Self::Q5_0,
            GgmlDType::Q5_1 => Self::Q5_1,
            GgmlDType::Q8_0 => Self::Q8_0,
            GgmlDType::Q4K => Self::Q4K,
            GgmlDType::Q5K => Self::Q5K,
            GgmlDType::Q6K => Self::Q6K,
            _ => return None,
        })
    }

    /// The GGML type of this format (the inverse of [`QFormat::of`]).
    pub(crate) const fn dtype(self) -> GgmlDType {
        match self {
            Self::Q4_0 => GgmlDType::Q4_0,
            Self::Q4_1 => GgmlDType::Q4_1,
            Self::Q5_0 => GgmlDType::Q5_0,
            Self::Q5_1 => GgmlDType::Q5_1,
            Self::Q8_0 => GgmlDType::Q8_0,
            Self::Q4K => GgmlDType::Q4K,
            Self::Q5K => GgmlDType::Q5K,
            Self::Q6K => GgmlDType::Q6K,
        }
    }

    /// Elements per group (one block, or one K-quant super-block).
    pub(crate) const fn group(self) -> usize {
        match self {
            Self::Q4K | Self::Q5K | Self::Q6K => 256,
            _ => 32,
        }
    }

    /// Bytes of one block (one group).
    pub(crate) const fn block_bytes(self) -> usize {
        match self {
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q5_0 => 22,
            Self::Q5_1 => 24,
            Self::Q8_0 => 34,
            Self::Q4K => 144,
            Self::Q5K => 176,
            Self::Q6K => 210,
        }
    }

    /// Whether the format has a per-block min (an offset term).
    pub(crate) const fn has_min(self) -> bool {
        matches!(self, Self::Q4_1 | Self::Q5_1 | Self::Q4K | Self::Q5K)
    }

    /// Elements between two float conversions of a 32-bit integer sum:
    /// the group, at most 128 (see the bounds in the module docs).
    pub(crate) const fn chunk(self) -> usize {
        if self.group() < 128 {
            self.group()
        } else {
            128
        }
    }

    /// Bytes of a `[n, k]` matrix in this format; `None` when `k` is not a
    /// whole number of groups.
    pub(crate) fn matrix_bytes(self, n: usize, k: usize) -> Option<usize> {
        k.is_multiple_of(self.group())
            .then(|| n * k / self.group() * self.block_bytes())
    }
}

/// How the quantised linear quantises its activations (each row, in the
/// weight format's groups, once per call).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ActivationQuant {
    /// 8-bit levels, ggml's scheme (`q8_0` / `q8_K`): what llama.cpp
    /// computes, and twice the products per instruction of `Int16`.
    #[default]
    Int8,
    /// 15-bit levels: the activation rounding error becomes ~1/128 of
    /// `Int8`'s, so a quantised file computes nearly what its dequantised
    /// weights compute in f32, at about half the compute-bound speed.
    Int16,
}

impl std::str::FromStr for ActivationQuant {
    type Err = String;

    /// Parses `int8` (or `8`) and `int16` (or `16`).
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "int8" | "8" | "i8" => Ok(Self::Int8),
            "int16" | "16" | "i16" => Ok(Self::Int16),
            other => Err(format!(
                "unknown activation quantisation `{other}` (expected int8 or int16)"
            )),
        }
    }
}

/// The activation levels: `x ≈ d · q` with `|q| ≤ LEVELS`.
pub(crate) const LEVELS: f32 = 16383.0;

/// The 8-bit activation levels ([`ActivationQuant::Int8`]).
pub(crate) const LEVELS8: f32 = 127.0;

/// One weight row in the decoded form (see the module docs); reused
/// between rows, so it allocates only when `k` grows.
#[derive(Debug, Default)]
pub(crate) struct DecodedRow {
    pub(crate) w: Vec<i16>,
    pub(crate) d: Vec<f32>,
    pub(crate) min: Vec<f32>,
}

impl DecodedRow {
    /// Sizes the buffers for a `k`-element row of `format`.
    #[inline(always)]
    pub(crate) fn prepare(&mut self, format: QFormat, k: usize) {
        self.w.resize(k, 0);
        self.d.resize(k / format.group(), 0.0);
        self.min.resize(k / 32, 0.0);
    }

    /// Decodes the `k`-element row `bytes` of `format` (the reference
    /// decoder; SIMD tiers have their own for the common formats).
    #[inline(always)]
    pub(crate) fn decode(&mut self, format: QFormat, bytes: &[u8], k: usize) {
        self.prepare(format, k);
        let group = format.group();
        let bb = format.block_bytes();
        for g in 0..k / group {
            let b = &bytes[g * bb..(g + 1) * bb];
            let w = &mut self.w[g * group..(g + 1) * group];
            let min = &mut self.min[g * group / 32..(g + 1) * group / 32];
            self.d[g] = match format {
                QFormat::Q4_0 => q4_0(b, w.try_into().unwrap()),
                QFormat::Q4_1 => q4_1(b, w.try_into().unwrap(), &mut min[0]),
                QFormat::Q5_0 => q5_0(b, w.try_into().unwrap()),
                QFormat::Q5_1 => q5_1(b, w.try_into().unwrap(), &mut min[0]),
                QFormat::Q8_0 => q8_0(b, w.try_into().unwrap()),
                QFormat::Q4K => q4_k(b, w.try_into().unwrap(), min.try_into().unwrap()),
                QFormat::Q5K => q5_k(b, w.try_into().unwrap(), min.try_into().unwrap()),
                QFormat::Q6K => q6_k(b, w.try_into().unwrap()),
            };
        }
    }
}

#[inline(always)]
fn half(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Q4_0: `d: f16, qs: [u8; 16]`; element `j` is the low nibble of
/// `qs[j]`, element `j + 16` the high one; value `d · (q − 8)`.
#[inline(always)]
fn q4_0(b: &[u8], w: &mut [i16; 32]) -> f32 {
    for j in 0..16 {
        w[j] = (b[2 + j] & 0xF) as i16 - 8;
        w[j + 16] = (b[2 + j] >> 4) as i16 - 8;
    }
    half(b, 0)
}

/// Q4_1: `d, m: f16, qs: [u8; 16]`; value `d · q + m`.
#[inline(always)]
fn q4_1(b: &[u8], w: &mut [i16; 32], min: &mut f32) -> f32 {
    for j in 0..16 {
        w[j] = (b[4 + j] & 0xF) as i16;
        w[j + 16] = (b[4 + j] >> 4) as i16;
    }
    *min = half(b, 2);
    half(b, 0)
}

/// The levels of a Q5 block: bit `j` of the little-endian `qh` is the
/// fifth bit of element `j`.
#[inline(always)]
fn q5_levels(qh: &[u8], qs: &[u8], w: &mut [i16; 32], zero: i16) {
    let qh = u32::from_le_bytes(qh[..4].try_into().unwrap());
    for j in 0..16 {
        let lo = ((qh >> j) & 1) as u8;
        let hi = ((qh >> (j + 16)) & 1) as u8;
        w[j] = ((qs[j] & 0xF) | (lo << 4)) as i16 - zero;
        w[j + 16] = ((qs[j] >> 4) | (hi << 4)) as i16 - zero;
    }
}

/// Q5_0: `d: f16, qh: [u8; 4], qs: [u8; 16]`; value `d · (q − 16)`.
#[inline(always)]
fn q5_0(b: &[u8], w: &mut [i16; 32]) -> f32 {
    q5_levels(&b[2..6], &b[6..22], w, 16);
    half(b, 0)
}

/// Q5_1: `d, m: f16, qh: [u8; 4], qs: [u8; 16]`; value `d · q + m`.
#[inline(always)]
fn q5_1(b: &[u8], w: &mut [i16; 32], min: &mut f32) -> f32 {
    q5_levels(&b[4..8], &b[8..24], w, 0);
    *min = half(b, 2);
    half(b, 0)
}

/// Q8_0: `d: f16, qs: [i8; 32]`; value `d · q`.
#[inline(always)]
fn q8_0(b: &[u8], w: &mut [i16; 32]) -> f32 {
    for (w, &v) in w.iter_mut().zip(&b[2..34]) {
        *w = v as i8 as i16;
    }
    half(b, 0)
}

/// The 6-bit scale and min of sub-block `j` of a Q4_K / Q5_K block
/// (llama.cpp's `get_scale_min_k4`).
#[inline(always)]
fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// The scales and mins of a Q4_K / Q5_K super-block: `d, dmin: f16,
/// scales: [u8; 12]`; sub-block `j` (32 elements) has value
/// `d · sc_j · q − dmin · m_j`. Returns `d` and the 8 scales; writes the
/// mins.
#[inline(always)]
pub(crate) fn k4_scales(b: &[u8], min: &mut [f32; 8]) -> (f32, [i16; 8]) {
    let (d, dmin) = (half(b, 0), half(b, 2));
    let mut sc = [0i16; 8];
    for j in 0..8 {
        let (s, m) = scale_min_k4(j, &b[4..16]);
        sc[j] = s as i16;
        min[j] = -(dmin * m as f32);
    }
    (d, sc)
}

/// The 6-bit scales and mins of a Q4_K / Q5_K super-block's 8 sub-blocks
/// (the 8-bit kernels apply them in integers): [`scale_min_k4`]'s values,
/// unpacked four at a time from the 12 bytes read as three words.
#[inline(always)]
pub(crate) fn k4_scale_bytes(b: &[u8]) -> ([u8; 8], [u8; 8]) {
    let word = |i: usize| u32::from_le_bytes(b[4 + 4 * i..8 + 4 * i].try_into().unwrap());
    let (u0, u1, u2) = (word(0), word(1), word(2));
    const LOW6: u32 = 0x3f3f_3f3f;
    const LOW4: u32 = 0x0f0f_0f0f;
    const LOW2: u32 = 0x0303_0303;
    let sc_hi = (u2 & LOW4) | (((u0 >> 6) & LOW2) << 4);
    let m_hi = ((u2 >> 4) & LOW4) | (((u1 >> 6) & LOW2) << 4);
    let bytes = |lo: u32, hi: u32| (lo as u64 | (hi as u64) << 32).to_le_bytes();
    (bytes(u0 & LOW6, sc_hi), bytes(u1 & LOW6, m_hi))
}

/// Q4_K: scales as [`k4_scales`], then `qs: [u8; 128]`: each 64 elements
/// take 32 bytes, low nibbles first.
#[inline(always)]
fn q4_k(b: &[u8], w: &mut [i16; 256], min: &mut [f32; 8]) -> f32 {
    let (d, sc) = k4_scales(b, min);
    for c in 0..4 {
        for l in 0..32 {
            let v = b[16 + 32 * c + l];
            w[64 * c + l] = (v & 0xF) as i16 * sc[2 * c];
            w[64 * c + 32 + l] = (v >> 4) as i16 * sc[2 * c + 1];
        }
    }
    d
}

/// Q5_K: scales as [`k4_scales`], `qh: [u8; 32]` (bit `2c` / `2c + 1` of
/// byte `l` is the fifth bit of element `l` of chunk `c`'s low / high
/// half), then `qs` as Q4_K.
#[inline(always)]
fn q5_k(b: &[u8], w: &mut [i16; 256], min: &mut [f32; 8]) -> f32 {
    let (d, sc) = k4_scales(b, min);
    for c in 0..4 {
        for l in 0..32 {
            let (v, h) = (b[48 + 32 * c + l], b[16 + l]);
            let lo = (v & 0xF) | (((h >> (2 * c)) & 1) << 4);
            let hi = (v >> 4) | (((h >> (2 * c + 1)) & 1) << 4);
            w[64 * c + l] = lo as i16 * sc[2 * c];
            w[64 * c + 32 + l] = hi as i16 * sc[2 * c + 1];
        }
    }
    d
}

/// Q6_K: `ql: [u8; 128], qh: [u8; 64], scales: [i8; 16], d: f16`; each
/// 128 elements take 64 bytes of `ql` (low nibbles of elements 0–31 and
/// 32–63, then high nibbles of 64–95 and 96–127) and 32 of `qh` (two bits
/// each); value `d · scale[e / 16] · (q − 32)`.
#[inline(always)]
fn q6_k(b: &[u8], w: &mut [i16; 256]) -> f32 {
    let sc = |e: usize| b[192 + e / 16] as i8 as i16;
    for h in 0..2 {
        let (ql, qh) = (&b[64 * h..64 * h + 64], &b[128 + 32 * h..160 + 32 * h]);
        let o = 128 * h;
        for l in 0..32 {
            let levels = [
                (ql[l] & 0xF) | ((qh[l] & 3) << 4),
                (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4),
                (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4),
                (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4),
            ];
            for (c, q) in levels.into_iter().enumerate() {
                let e = o + 32 * c + l;
                w[e] = (q as i16 - 32) * sc(e);
            }
        }
    }
    half(b, 208)
}

/// Activation rows quantised in the weight format's groups: `q[r·k + e]`,
/// scale `d[r·groups + g]` (`x ≈ d · q`), and per 32 elements
/// `sum[r·k/32 + b] = d · Σ q` (for the min term).
#[derive(Debug, Default)]
pub(crate) struct QuantisedRows {
    pub(crate) q: Vec<i16>,
    pub(crate) d: Vec<f32>,
    pub(crate) sum: Vec<f32>,
}

impl QuantisedRows {
    /// Quantises `rows` rows of `x` (`k` each) in groups of `group`
    /// elements: scale `amax / LEVELS`, levels rounded to nearest, ties to
    /// even (what `vcvtps2dq` does), so every ISA tier gets the same
    /// levels.
    #[inline(always)]
    pub(crate) fn quantise(&mut self, x: &[f32], rows: usize, k: usize, group: usize) {
        self.q.resize(rows * k, 0);
        self.d.resize(rows * (k / group), 0.0);
        self.sum.resize(rows * k / 32, 0.0);
        let x = &x[..rows * k];
        quantise_groups(x, &mut self.q, &mut self.d, group, LEVELS, |v| v as i16);
        for (b, block) in self.q.chunks_exact(32).enumerate() {
            let s: i32 = block.iter().map(|&q| q as i32).sum();
            self.sum[b] = self.d[32 * b / group] * s as f32;
        }
    }
}

/// Quantises `x` in groups of `group` elements: group `g`'s scale
/// `d[g] = amax / levels`, its elements' levels `level(v / d)` rounded to
/// nearest, ties to even (all zeros for an all-zero group).
#[inline(always)]
fn quantise_groups<Q>(
    x: &[f32],
    q: &mut [Q],
    d: &mut [f32],
    group: usize,
    levels: f32,
    level: impl Fn(f32) -> Q,
) {
    for ((xs, qs), d) in x.chunks_exact(group).zip(q.chunks_exact_mut(group)).zip(d) {
        let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
        *d = amax / levels;
        let id = if *d > 0.0 { 1.0 / *d } else { 0.0 };
        for (q, &v) in qs.iter_mut().zip(xs) {
            *q = level(round_ties_even_small(v * id));
        }
    }
}

/// `v` rounded to nearest, ties to even, for `|v| ≤ 2²²` (levels are at
/// most [`LEVELS`]): adding and subtracting `1.5 · 2²³` leaves no
/// fraction bits under the default rounding mode. Plain adds vectorise;
/// `f32::round_ties_even` was a libm call per element.
#[inline(always)]
fn round_ties_even_small(v: f32) -> f32 {
    const SHIFT: f32 = 12_582_912.0;
    (v + SHIFT) - SHIFT
}

/// Activation rows quantised to 8 bits ([`ActivationQuant::Int8`]) in the
/// weight format's groups (32, or a K-quant's 256, as ggml's `q8_0` /
/// `q8_K`): levels `q[r·k + e]`, the same offset to unsigned bytes
/// `qu = q + 128` (for products with signed weights), scale
/// `d[r·groups + g]`, and per 32 elements the integer sum `qsum`,
/// `sum = d · qsum` (the min terms), per 16 elements `qsum16` (Q6_K's
/// sub-blocks: sized by every call, filled only by
/// [`QuantisedRows8::sum_sixteens`]), and `qoff = −128 · qsum` (where a sum
/// of unsigned weights `w + 128` against the levels starts, so that it
/// ends at `Σ w q`).
#[derive(Debug, Default)]
pub(crate) struct QuantisedRows8 {
    pub(crate) q: Vec<i8>,
    pub(crate) qu: Vec<u8>,
    pub(crate) d: Vec<f32>,
    pub(crate) qsum: Vec<i16>,
    pub(crate) sum: Vec<f32>,
    pub(crate) qoff: Vec<i32>,
    pub(crate) qsum16: Vec<i16>,
}

impl QuantisedRows8 {
    /// Quantises `rows` rows of `x` (`k` each) in groups of `group`:
    /// scale `amax / 127`, levels rounded to nearest, ties to even.
    #[inline(always)]
    pub(crate) fn quantise(&mut self, x: &[f32], rows: usize, k: usize, group: usize) {
        self.size(rows, k, group);
        let x = &x[..rows * k];
        let level = |v: f32| v.clamp(-LEVELS8, LEVELS8) as i8;
        quantise_groups(x, &mut self.q, &mut self.d, group, LEVELS8, level);
        for (b, block) in self.q.chunks_exact(32).enumerate() {
            let s: i32 = block.iter().map(|&q| q as i32).sum();
            self.qsum[b] = s as i16;
            self.sum[b] = self.d[32 * b / group] * s as f32;
            self.qoff[b] = -128 * s;
        }
        for (u, &q) in self.qu.iter_mut().zip(&self.q) {
            *u = (q as u8) ^ 0x80;
        }
    }

    /// Sizes every buffer for `rows` rows of `k` in groups of `group`.
    #[inline(always)]
    pub(crate) fn size(&mut self, rows: usize, k: usize, group: usize) {
        self.q.resize(rows * k, 0);
        self.qu.resize(rows * k, 0);
        self.d.resize(rows * (k / group), 0.0);
        self.qsum.resize(rows * k / 32, 0);
        self.sum.resize(rows * k / 32, 0.0);
        self.qoff.resize(rows * k / 32, 0);
        self.qsum16.resize(rows * k / 16, 0);
    }

    /// Fills `qsum16`, the levels' sums per 16 elements, which only Q6_K
    /// reads.
    #[inline(always)]
    pub(crate) fn sum_sixteens(&mut self) {
        for (s, half) in self.qsum16.iter_mut().zip(self.q.chunks_exact(16)) {
            *s = half.iter().map(|&q| q as i16).sum();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{k4_scale_bytes, round_ties_even_small, scale_min_k4};

    #[test]
    fn small_values_round_as_round_ties_even_does() {
        let ties = (-40_000..40_000).map(|i| i as f32 * 0.5);
        let steps = (-200_000..200_000).map(|i| i as f32 * 0.001_37);
        let edges = [
            4_194_304.0f32,
            -4_194_304.0,
            4_194_303.5,
            0.499_999_97,
            -0.5,
        ];
        for v in ties.chain(steps).chain(edges) {
            assert_eq!(round_ties_even_small(v), v.round_ties_even(), "{v}");
        }
    }

    #[test]
    fn k4_scale_bytes_unpack_what_scale_min_k4_does() {
        // Every byte value in every position of the 12 packed bytes.
        for v in 0..=255u8 {
            for at in 0..12 {
                let mut b = [0u8; 16];
                for (i, x) in b[4..].iter_mut().enumerate() {
                    *x = (i as u8).wrapping_mul(37).wrapping_add(11);
                }
                b[4 + at] = v;
                let (sc, m) = k4_scale_bytes(&b);
                for j in 0..8 {
                    assert_eq!(
                        (sc[j], m[j]),
                        scale_min_k4(j, &b[4..16]),
                        "byte {at} = {v}, j {j}"
                    );
                }
            }
        }
    }
}
