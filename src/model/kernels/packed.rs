//! The 32-element GGML formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1), Q4_K and
//! Q6_K repacked at load for the 8-bit linear's register tile: 8 weight rows
//! interleaved per block, so one `vpdpbusd` of 4 activation bytes
//! (broadcast to every lane) against 32 weight bytes adds 4 products to
//! each of 8 outputs, and a block's 8 integer sums are converted, scaled
//! and accumulated by one vector instruction each.
//!
//! Read where they lie (`quant8`), GGML blocks give one output per
//! register: every 32 products cost a conversion, a scale and a fused add
//! besides the multiply, and the lanes are summed at the end. Interleaved,
//! those costs are shared by 8 outputs, and the lanes *are* the outputs
//! (llama.cpp's `repack` formats do the same for Q4_0 and the K-quants).
//!
//! # Layout
//! Rows in groups of [`ROWS`]; the last group is padded with zero bytes
//! (scale 0: those lanes are computed and never stored). Group `G`, block
//! `g` is one record of [`record`] bytes (8 GGML blocks' worth) at
//! `(G · blocks + g) · record`, `blocks = k / 32` (Q4_K: `k / 256`):
//! - level bytes, in 4-byte chunks: bytes `32c + 4l .. 32c + 4l + 4` are
//!   chunk `c` of row `8G + l`'s level bytes. For Q8_0 (8 chunks) that is
//!   elements `4c .. 4c + 4`, offset to unsigned (`w + 128`, `w ^ 0x80`);
//!   for the 4- and 5-bit formats chunks 0–3 are GGML's nibbles (low:
//!   elements `4c .. 4c + 4`, high: `16 + 4c ..`), and the 5-bit ones add
//!   chunk 4, the fifth bits, byte `b`'s bit `u` for element `4u + b` and
//!   bit `4 + u` for `16 + 4u + b` (one shift and mask per nibble vector);
//! - then the 8 rows' f16 scales, and for Q4_1 / Q5_1 their 8 f16 mins.
//!
//! A Q4_K record covers a 256-element super-block: the nibbles in 32 such
//! vectors (`K4_*` constants), then the sub-block scales and mins
//! unpacked from their 6 bits, and the rows' `d` and `dmin`.
//!
//! A Q6_K record holds the 6-bit levels as 64 vectors of 4 bytes a row
//! (`Q6_*` constants): their low 4 bits in 32 nibble vectors, their high
//! 2 bits in 16 vectors of 4 pairs each; then the sub-block scales (`i8`)
//! and the rows' `d`.
//!
//! A record holds 8 rows' GGML blocks, permuted: packing and unpacking
//! lose nothing, and the weights take the same memory (Q4_K: 8 % more,
//! for its unpacked scales).
//!
//! # Numerics
//! Per output and block one exact integer sum `Σ w x` of the signed level
//! `w` (Q4_0: `q − 8`; Q5_0: `q − 16`; with a min: `q`) and the
//! activation level `x`: from the unsigned bytes `u = w + o` as
//! `Σ u x − o Σ x` (VNNI; AVX2 for the 4- and 5-bit formats), or on AVX2
//! for Q8_0 as `Σ |w| · sign(w) x` (every pair below 2¹⁵), or plainly
//! (portable). It is converted, scaled by `d_w · d_x` (one f32 rounding)
//! and added by a fused multiply-add, blocks in order; a format with a
//! min then adds `m_w · (d_x Σ x)` by another. Q4_K, with activations
//! scaled per super-block (`q8_K`), sums `Σ_j sc_j Σ q x` and
//! `Σ_j m_j Σ x` over its sub-blocks in integers and converts each once
//! per super-block; Q6_K likewise `Σ_s sc_s Σ (q − 32) x`. So every tier, batch composition and thread count
//! gives the same bits.

use half::f16;

use crate::host_memory::WeightBytes;

use super::pool::{for_each_range, SharedMut};
use super::qformat::{k4_scale_bytes, QFormat, QuantisedRows8};
use super::quant::with_acts8;
use super::Isa;

/// Weight rows interleaved in a record.
pub(crate) const ROWS: usize = 8;

/// The formats this module repacks, as the kernels' const parameter.
const Q8_0: u8 = 0;
const Q4_0: u8 = 1;
const Q4_1: u8 = 2;
const Q5_0: u8 = 3;
const Q5_1: u8 = 4;
const Q4K: u8 = 5;
const Q6K: u8 = 6;

/// A Q4_K record (8 rows of a 256-element super-block): the nibbles, then
/// the 8 sub-block scales of each row (`u8`, sub-block-major), the mins as
/// `i16` pairs (sub-blocks `2p, 2p + 1` of row `l` in 32-bit lane `l` of
/// vector `p`: one `vpmaddwd` against the activations' sums), and the
/// rows' `d` and `dmin` (f16).
const K4_SCALES: usize = 1024;
const K4_MINS: usize = K4_SCALES + 8 * ROWS;
const K4_D: usize = K4_MINS + 16 * ROWS;
const K4_DMIN: usize = K4_D + 2 * ROWS;
const K4_RECORD: usize = K4_DMIN + 2 * ROWS;

/// A Q6_K record (8 rows of a 256-element super-block). Level vector `t`
/// (`4s + v`: elements `16s + 4v .. + 4` of each row, sub-block `s`) is
/// the low nibbles of nibble vector `t` for `t < 32`, the high ones of
/// `t − 32` otherwise (the levels' low 4 bits), with bits `2m, 2m + 1` of
/// high-bits vector `t mod 16`, `m = t / 16` (their high 2 bits). Then
/// the 16 sub-block scales of each row (`i8`, sub-block-major) and the
/// rows' `d` (f16): GGML's 210 bytes a row.
const Q6_HIGH: usize = 1024;
const Q6_SCALES: usize = Q6_HIGH + 512;
const Q6_D: usize = Q6_SCALES + 16 * ROWS;
const Q6_RECORD: usize = Q6_D + 2 * ROWS;

/// Q6_K: byte `b` of row `l` in level vector `t` of a record: the offsets
/// of its nibble and of its high bits, the nibble's shift and the high
/// bits' shift.
fn q6k_at(t: usize, l: usize, b: usize) -> (usize, usize, u32, u32) {
    let lane = 4 * l + b;
    let nibble = 32 * (t % 32) + lane;
    let high = Q6_HIGH + 32 * (t % 16) + lane;
    (nibble, high, 4 * (t / 32) as u32, 2 * (t / 16) as u32)
}

/// Q6_K's level (0..64) of element `e` of row `l` in a record.
fn q6k_level(rec: &[u8], l: usize, e: usize) -> u8 {
    let (nibble, high, ns, hs) = q6k_at(e / 4, l, e % 4);
    (rec[nibble] >> ns & 0xF) | (rec[high] >> hs & 3) << 4
}

/// Bytes before a GGML block's levels: the f16 scale (and the f16 min of
/// the formats with one).
const fn header(format: QFormat) -> usize {
    if format.has_min() {
        4
    } else {
        2
    }
}

/// Level bytes of a record: 8 rows' level bytes (32 for Q8_0; 16 nibble
/// pairs for the 4-bit formats, and 4 bytes of fifth bits for the 5-bit
/// ones).
const fn level_bytes(format: QFormat) -> usize {
    ROWS * (format.block_bytes() - header(format))
}

/// Bytes of a record: 8 GGML blocks' worth (Q4_K: plus its scales and
/// mins unpacked from 6 bits, 96 bytes).
pub(crate) const fn record(format: QFormat) -> usize {
    match format {
        QFormat::Q4K => K4_RECORD,
        QFormat::Q6K => Q6_RECORD,
        _ => ROWS * format.block_bytes(),
    }
}

/// Writes GGML block `src` into record `rec` as row `l`.
fn put(format: QFormat, src: &[u8], rec: &mut [u8], l: usize) {
    if format == QFormat::Q4K {
        return put_q4k(src, rec, l);
    }
    if format == QFormat::Q6K {
        return put_q6k(src, rec, l);
    }
    let (hd, lb) = (header(format), level_bytes(format));
    let flip = if format == QFormat::Q8_0 { 0x80 } else { 0 };
    for h in 0..hd / 2 {
        rec[lb + 2 * ROWS * h + 2 * l..][..2].copy_from_slice(&src[2 * h..][..2]);
    }
    let levels = interleaved_levels(format, &src[hd..]);
    for (c, chunk) in levels.chunks_exact(4).enumerate() {
        for (dst, &q) in rec[32 * c + 4 * l..][..4].iter_mut().zip(chunk) {
            *dst = q ^ flip;
        }
    }
}

/// Reads row `l` of record `rec` back into GGML block `dst`.
fn get(format: QFormat, rec: &[u8], l: usize, dst: &mut [u8]) {
    if format == QFormat::Q4K {
        return get_q4k(rec, l, dst);
    }
    if format == QFormat::Q6K {
        return get_q6k(rec, l, dst);
    }
    let (hd, lb, bb) = (header(format), level_bytes(format), format.block_bytes());
    let flip = if format == QFormat::Q8_0 { 0x80 } else { 0 };
    for h in 0..hd / 2 {
        dst[2 * h..][..2].copy_from_slice(&rec[lb + 2 * ROWS * h + 2 * l..][..2]);
    }
    let mut levels = [0u8; 32];
    for (c, chunk) in levels[..bb - hd].chunks_exact_mut(4).enumerate() {
        for (q, &b) in chunk.iter_mut().zip(&rec[32 * c + 4 * l..][..4]) {
            *q = b ^ flip;
        }
    }
    dst[hd..].copy_from_slice(&ggml_levels(format, &levels[..bb - hd]));
}

/// [`put`] for Q4_K: nibble vector `8c + v` holds bytes `4v..4v + 4` of
/// each row's 32-byte chunk `c` (low nibbles: sub-block `2c`, high:
/// `2c + 1`).
fn put_q4k(src: &[u8], rec: &mut [u8], l: usize) {
    rec[K4_D + 2 * l..][..2].copy_from_slice(&src[..2]);
    rec[K4_DMIN + 2 * l..][..2].copy_from_slice(&src[2..4]);
    let (sc, m) = k4_scale_bytes(src);
    for j in 0..8 {
        rec[K4_SCALES + 8 * j + l] = sc[j];
        rec[K4_MINS + 32 * (j / 2) + 4 * l + 2 * (j % 2)..][..2]
            .copy_from_slice(&(m[j] as i16).to_le_bytes());
    }
    for (c4, chunk) in src[16..].chunks_exact(4).enumerate() {
        rec[32 * c4 + 4 * l..][..4].copy_from_slice(chunk);
    }
}

/// The inverse of [`put_q4k`], the 6-bit scales packed back as GGML's
/// `get_scale_min_k4` reads them.
fn get_q4k(rec: &[u8], l: usize, dst: &mut [u8]) {
    dst[..2].copy_from_slice(&rec[K4_D + 2 * l..][..2]);
    dst[2..4].copy_from_slice(&rec[K4_DMIN + 2 * l..][..2]);
    let sc: [u8; 8] = std::array::from_fn(|j| rec[K4_SCALES + 8 * j + l]);
    let m: [u8; 8] = std::array::from_fn(|j| rec[K4_MINS + 32 * (j / 2) + 4 * l + 2 * (j % 2)]);
    for j in 0..4 {
        dst[4 + j] = sc[j] | (sc[j + 4] >> 4) << 6;
        dst[8 + j] = m[j] | (m[j + 4] >> 4) << 6;
        dst[12 + j] = (sc[j + 4] & 0xF) | (m[j + 4] & 0xF) << 4;
    }
    for (c4, chunk) in dst[16..].chunks_exact_mut(4).enumerate() {
        chunk.copy_from_slice(&rec[32 * c4 + 4 * l..][..4]);
    }
}

/// Q6_K's element `e` of half `h`, chunk `c`, lane `l` (GGML's `ql` /
/// `qh` order): element `128h + 32c + l`.
fn q6k_element(h: usize, c: usize, l: usize) -> usize {
    128 * h + 32 * c + l
}

/// [`put`] for Q6_K: the levels decoded, then split as the record holds
/// them (OR-ed in: `rec` starts zeroed, as [`Packed::pack`] allocates it).
fn put_q6k(src: &[u8], rec: &mut [u8], row: usize) {
    let mut q = [0u8; 256];
    for h in 0..2 {
        let (ql, qh) = (&src[64 * h..64 * h + 64], &src[128 + 32 * h..160 + 32 * h]);
        for l in 0..32 {
            q[q6k_element(h, 0, l)] = (ql[l] & 0xF) | (qh[l] & 3) << 4;
            q[q6k_element(h, 1, l)] = (ql[l + 32] & 0xF) | (qh[l] >> 2 & 3) << 4;
            q[q6k_element(h, 2, l)] = (ql[l] >> 4) | (qh[l] >> 4 & 3) << 4;
            q[q6k_element(h, 3, l)] = (ql[l + 32] >> 4) | (qh[l] >> 6 & 3) << 4;
        }
    }
    for (e, &level) in q.iter().enumerate() {
        let (nibble, high, ns, hs) = q6k_at(e / 4, row, e % 4);
        rec[nibble] |= (level & 0xF) << ns;
        rec[high] |= (level >> 4) << hs;
    }
    for s in 0..16 {
        rec[Q6_SCALES + 8 * s + row] = src[192 + s];
    }
    rec[Q6_D + 2 * row..][..2].copy_from_slice(&src[208..210]);
}

/// The inverse of [`put_q6k`].
fn get_q6k(rec: &[u8], row: usize, dst: &mut [u8]) {
    let q = |e: usize| q6k_level(rec, row, e);
    for h in 0..2 {
        for l in 0..32 {
            let [a, b, c, d] = [0, 1, 2, 3].map(|c| q(q6k_element(h, c, l)));
            dst[64 * h + l] = (a & 0xF) | (c & 0xF) << 4;
            dst[64 * h + l + 32] = (b & 0xF) | (d & 0xF) << 4;
            dst[128 + 32 * h + l] = a >> 4 | (b >> 4) << 2 | (c >> 4) << 4 | (d >> 4) << 6;
        }
    }
    for s in 0..16 {
        dst[192 + s] = rec[Q6_SCALES + 8 * s + row];
    }
    dst[208..210].copy_from_slice(&rec[Q6_D + 2 * row..][..2]);
}

/// A block's level bytes as a record holds them (module docs): GGML's for
/// Q8_0 and the 4-bit formats; for the 5-bit ones the 16 nibble bytes,
/// then 4 bytes of fifth bits where bit `u` of byte `b` is element
/// `4u + b`'s and bit `4 + u` element `16 + 4u + b`'s (GGML: `qh`, bit `e`
/// for element `e`, before the nibbles).
fn interleaved_levels(format: QFormat, ggml: &[u8]) -> Vec<u8> {
    if !matches!(format, QFormat::Q5_0 | QFormat::Q5_1) {
        return ggml.to_vec();
    }
    let qh = u32::from_le_bytes(ggml[..4].try_into().expect("4 bytes"));
    let mut out = ggml[4..20].to_vec();
    out.extend((0..4).map(|b| {
        (0..4).fold(0u8, |byte, u| {
            let lo = (qh >> (4 * u + b)) & 1;
            let hi = (qh >> (16 + 4 * u + b)) & 1;
            byte | (lo << u) as u8 | (hi << (4 + u)) as u8
        })
    }));
    out
}

/// The inverse of [`interleaved_levels`].
fn ggml_levels(format: QFormat, levels: &[u8]) -> Vec<u8> {
    if !matches!(format, QFormat::Q5_0 | QFormat::Q5_1) {
        return levels.to_vec();
    }
    let mut qh = 0u32;
    for (b, &byte) in levels[16..20].iter().enumerate() {
        for u in 0..4 {
            qh |= ((byte >> u) as u32 & 1) << (4 * u + b);
            qh |= ((byte >> (4 + u)) as u32 & 1) << (16 + 4 * u + b);
        }
    }
    let mut out = qh.to_le_bytes().to_vec();
    out.extend_from_slice(&levels[..16]);
    out
}

/// A `[n, k]` matrix of GGML blocks in interleaved records (the module
/// docs).
///
/// The records sit on huge pages ([`WeightBytes`]): decode streams every
/// one of them each step.
#[derive(Debug)]
pub(crate) struct Packed {
    format: QFormat,
    bytes: WeightBytes,
    n: usize,
    k: usize,
}

impl Packed {
    /// Whether [`Packed::pack`] takes `format`.
    pub(crate) fn packs(format: QFormat) -> bool {
        matches!(
            format,
            QFormat::Q8_0
                | QFormat::Q4_0
                | QFormat::Q4_1
                | QFormat::Q5_0
                | QFormat::Q5_1
                | QFormat::Q4K
                | QFormat::Q6K
        )
    }

    /// Repacks `n` rows of GGML blocks of `format` (`k` elements each).
    ///
    /// Panics if the format is not one [`Packed::packs`], `k` is not a
    /// multiple of 32 or `ggml` is shorter than `n` rows (caller bugs: a
    /// loaded tensor's type and shape say all three).
    pub(crate) fn pack(format: QFormat, ggml: &[u8], n: usize, k: usize) -> Self {
        assert!(Self::packs(format), "Packed: {format:?} is not repacked");
        assert!(
            k.is_multiple_of(format.group()),
            "Packed: k = {k} is not whole blocks"
        );
        let (blocks, bb, rec_len) = (k / format.group(), format.block_bytes(), record(format));
        assert!(ggml.len() >= n * blocks * bb, "Packed: too few bytes");
        let len = n.div_ceil(ROWS) * blocks * rec_len;
        let mut bytes = WeightBytes::zeroed(len)
            .unwrap_or_else(|| panic!("Packed: cannot allocate {len} bytes of weights"));
        for j in 0..n {
            let (group, l) = (j / ROWS, j % ROWS);
            for g in 0..blocks {
                let src = &ggml[(j * blocks + g) * bb..][..bb];
                put(
                    format,
                    src,
                    &mut bytes[(group * blocks + g) * rec_len..][..rec_len],
                    l,
                );
            }
        }
        Self {
            format,
            bytes,
            n,
            k,
        }
    }

    /// The GGML blocks [`Packed::pack`] was given (its first `n` rows).
    pub(crate) fn unpack(&self) -> Vec<u8> {
        let f = self.format;
        let (blocks, bb, rec_len) = (self.k / f.group(), f.block_bytes(), record(f));
        let mut ggml = vec![0u8; self.n * blocks * bb];
        for j in 0..self.n {
            let (group, l) = (j / ROWS, j % ROWS);
            for g in 0..blocks {
                let rec = &self.bytes[(group * blocks + g) * rec_len..][..rec_len];
                get(f, rec, l, &mut ggml[(j * blocks + g) * bb..][..bb]);
            }
        }
        ggml
    }

    /// The GGML block format.
    pub(crate) fn format(&self) -> QFormat {
        self.format
    }

    /// `(n, k)`.
    pub(crate) fn dims(&self) -> (usize, usize) {
        (self.n, self.k)
    }

    /// Bytes held (whole records).
    pub(crate) fn bytes_len(&self) -> usize {
        self.bytes.len()
    }

    /// The records of row group `group`.
    #[inline(always)]
    fn group(&self, group: usize) -> *const u8 {
        let len = self.k / self.format.group() * record(self.format);
        self.bytes[group * len..][..len].as_ptr()
    }
}

/// `out[r·n + j] = Σ_e x[r·k + e] · W[j, e]` (or `+=` when `accumulate`)
/// for `r < rows`, `j < n`, with 8-bit activations, on up to `threads`
/// threads.
///
/// Panics if `x` or `out` is shorter than its shape says.
pub(crate) fn matmul_t(
    isa: Isa,
    threads: usize,
    x: &[f32],
    rows: usize,
    w: &Packed,
    out: &mut [f32],
    accumulate: bool,
) {
    let (n, k) = w.dims();
    assert!(x.len() >= rows * k, "packed matmul: x shorter than rows·k");
    assert!(
        out.len() >= rows * n,
        "packed matmul: out shorter than rows·n"
    );
    if rows == 0 || n == 0 {
        return;
    }
    let out = SharedMut(out.as_mut_ptr());
    // The activations' scales per 32 elements, or per super-block (as
    // ggml's `q8_K`) for Q4_K, whose sub-block scales are integers.
    with_acts8(isa, x, rows, k, w.format, |acts| {
        let job = Job {
            w,
            acts,
            rows,
            out,
            accumulate,
            isa,
        };
        let groups = n.div_ceil(ROWS);
        let grain = (groups / (threads * GRABS_PER_THREAD)).max(1);
        // SAFETY: the tier was detected on this CPU, and each row group's
        // columns belong to one worker.
        for_each_range(groups, grain, threads, |range| unsafe {
            match w.format {
                QFormat::Q8_0 => dispatch::<Q8_0>(&job, range),
                QFormat::Q4_0 => dispatch::<Q4_0>(&job, range),
                QFormat::Q4_1 => dispatch::<Q4_1>(&job, range),
                QFormat::Q5_0 => dispatch::<Q5_0>(&job, range),
                QFormat::Q5_1 => dispatch::<Q5_1>(&job, range),
                QFormat::Q4K => dispatch::<Q4K>(&job, range),
                _ => dispatch::<Q6K>(&job, range),
            }
        });
    });
}

/// Ranges of row groups a call is cut into per thread: each worker takes
/// about this many from the shared cursor. Two rather than eight: on a
/// 2-core AMD EPYC (Zen 4), alternating builds, SmolLM2's Q4_1 GGUF
/// decoded 246–337 against 244–274 tok/s single stream and 1.0–1.4×
/// faster at 4–64 rows; its Q8_0 level to 1.1× (bench/cpu/
/// grabs_per_thread_epyc_2026-12-05.log); prompts level. Each range is
/// one more stream for the prefetchers to find, one more cursor line
/// passed between the cores, and its first records were prefetched by
/// whichever worker read the range before it. Two still lets a worker
/// take a stalled one's share. (On a Sapphire Rapids Xeon one range per
/// thread measured level with eight, session 31.) BENCHMARKS.md, issue
/// 22, session 36.
const GRABS_PER_THREAD: usize = 2;

/// What one call reads and writes.
struct Job<'a> {
    w: &'a Packed,
    acts: &'a QuantisedRows8,
    rows: usize,
    out: SharedMut<f32>,
    accumulate: bool,
    /// The tier the call runs on (its kernels and their prefetch rule).
    isa: Isa,
}

// SAFETY: workers only read `w` and `acts`, and write disjoint columns of `out`.
unsafe impl Sync for Job<'_> {}

impl Job<'_> {
    /// Writes (or adds) the outputs of activation row `r` and row group
    /// `group`, lane `l` for weight row `8·group + l` (padding dropped).
    #[inline(always)]
    unsafe fn store(&self, r: usize, group: usize, lanes: &[f32; ROWS]) {
        let (n, j0) = (self.w.n, group * ROWS);
        for (l, &v) in lanes.iter().enumerate().take(n - j0) {
            let o = self.out.at(r * n + j0 + l);
            *o = if self.accumulate { *o + v } else { v };
        }
    }
}

/// The format of the kernels' const parameter `F`.
const fn format_of(f: u8) -> QFormat {
    match f {
        Q8_0 => QFormat::Q8_0,
        Q4_0 => QFormat::Q4_0,
        Q4_1 => QFormat::Q4_1,
        Q5_0 => QFormat::Q5_0,
        Q5_1 => QFormat::Q5_1,
        Q4K => QFormat::Q4K,
        _ => QFormat::Q6K,
    }
}

unsafe fn dispatch<const F: u8>(job: &Job<'_>, groups: std::ops::Range<usize>) {
    match job.isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni => x86::groups_vnni::<F>(job, groups),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx2 => x86::groups_avx2::<F>(job, groups),
        _ if F == Q4K => groups.for_each(|g| groups_portable_q4k(job, g)),
        _ if F == Q6K => groups.for_each(|g| groups_portable_q6k(job, g)),
        _ => groups.for_each(|g| groups_portable::<F>(job, g)),
    }
}

/// Portable tier for Q6_K: per super-block the integer sum
/// `Σ_s sc_s Σ (q − 32) x` over its 16-element sub-blocks `s`, then
/// `acc + cvt(sum) · (d · d_x)`.
fn groups_portable_q6k(job: &Job<'_>, group: usize) {
    let k = job.w.k;
    let blocks = k / 256;
    let recs = &job.w.bytes[group * blocks * Q6_RECORD..][..blocks * Q6_RECORD];
    let a = job.acts;
    for r in 0..job.rows {
        let mut lanes = [0f32; ROWS];
        for (l, lane) in lanes.iter_mut().enumerate() {
            for (g, rec) in recs.chunks_exact(Q6_RECORD).enumerate() {
                let mut total = 0i32;
                for s in 0..16 {
                    let x = &a.q[r * k + 256 * g + 16 * s..][..16];
                    let isum: i32 = (0..16)
                        .map(|e| {
                            let q = q6k_level(rec, l, 16 * s + e) as i32;
                            (q - 32) * x[e] as i32
                        })
                        .sum();
                    total += rec[Q6_SCALES + 8 * s + l] as i8 as i32 * isum;
                }
                let d = f16::from_le_bytes([rec[Q6_D + 2 * l], rec[Q6_D + 2 * l + 1]]).to_f32();
                *lane = (total as f32).mul_add(d * a.d[r * blocks + g], *lane);
            }
        }
        // SAFETY: the group's columns belong to this worker.
        unsafe { job.store(r, group, &lanes) };
    }
}

/// Portable tier for Q4_K: per super-block the integer sums
/// `Σ_j sc_j Σ q x` and `Σ_j m_j Σ x` (sub-blocks `j`), then
/// `acc + cvt(Σ sc q x) · (d · d_x)` and `+ cvt(Σ m x) · (−dmin · d_x)`.
fn groups_portable_q4k(job: &Job<'_>, group: usize) {
    let k = job.w.k;
    let blocks = k / 256;
    let recs = &job.w.bytes[group * blocks * K4_RECORD..][..blocks * K4_RECORD];
    let a = job.acts;
    let half = |rec: &[u8], at: usize| f16::from_le_bytes([rec[at], rec[at + 1]]).to_f32();
    for r in 0..job.rows {
        let mut lanes = [0f32; ROWS];
        for (l, lane) in lanes.iter_mut().enumerate() {
            for (g, rec) in recs.chunks_exact(K4_RECORD).enumerate() {
                let (mut total, mut mins) = (0i32, 0i32);
                for j in 0..8 {
                    let x = &a.q[r * k + 256 * g + 32 * j..][..32];
                    let isum: i32 = (0..32)
                        .map(|e| {
                            let b = rec[32 * (8 * (j / 2) + e / 4) + 4 * l + e % 4];
                            let q = if j % 2 == 0 { b & 0xF } else { b >> 4 };
                            q as i32 * x[e] as i32
                        })
                        .sum();
                    total += rec[K4_SCALES + 8 * j + l] as i32 * isum;
                    let m = rec[K4_MINS + 32 * (j / 2) + 4 * l + 2 * (j % 2)] as i32;
                    mins += m * a.qsum[r * k / 32 + 8 * g + j] as i32;
                }
                let dx = a.d[r * blocks + g];
                *lane = (total as f32).mul_add(half(rec, K4_D + 2 * l) * dx, *lane);
                *lane = (mins as f32).mul_add(-half(rec, K4_DMIN + 2 * l) * dx, *lane);
            }
        }
        // SAFETY: the group's columns belong to this worker.
        unsafe { job.store(r, group, &lanes) };
    }
}

/// Portable tier: the module's sums in plain integers and `mul_add`.
fn groups_portable<const F: u8>(job: &Job<'_>, group: usize) {
    let f = format_of(F);
    let (k, rec_len, lb) = (job.w.k, record(f), level_bytes(f));
    let blocks = k / 32;
    let recs = &job.w.bytes[group * blocks * rec_len..][..blocks * rec_len];
    let a = job.acts;
    let half = |rec: &[u8], at: usize| f16::from_le_bytes([rec[at], rec[at + 1]]).to_f32();
    // Element `e` of row `l`'s block, as a signed level.
    let level = |rec: &[u8], l: usize, e: usize| -> i32 {
        match F {
            Q8_0 => (rec[32 * (e / 4) + 4 * l + e % 4] ^ 0x80) as i8 as i32,
            _ => {
                let b = rec[32 * (e % 16 / 4) + 4 * l + e % 4];
                let mut q = if e < 16 { b & 0xF } else { b >> 4 } as i32;
                if F == Q5_0 || F == Q5_1 {
                    let fifth = rec[128 + 4 * l + e % 4] >> (e % 16 / 4 + 4 * (e / 16));
                    q |= (fifth as i32 & 1) << 4;
                }
                match F {
                    Q4_0 => q - 8,
                    Q5_0 => q - 16,
                    _ => q,
                }
            }
        }
    };
    for r in 0..job.rows {
        let mut lanes = [0f32; ROWS];
        for (l, lane) in lanes.iter_mut().enumerate() {
            for (g, rec) in recs.chunks_exact(rec_len).enumerate() {
                let x = &a.q[r * k + 32 * g..][..32];
                let isum: i32 = (0..32).map(|e| level(rec, l, e) * x[e] as i32).sum();
                let scale = half(rec, lb + 2 * l) * a.d[r * blocks + g];
                *lane = (isum as f32).mul_add(scale, *lane);
                if F == Q4_1 || F == Q5_1 {
                    *lane = half(rec, lb + 2 * ROWS + 2 * l).mul_add(a.sum[r * blocks + g], *lane);
                }
            }
        }
        // SAFETY: the group's columns belong to this worker.
        unsafe { job.store(r, group, &lanes) };
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;
    use std::ops::Range;

    use super::{
        format_of, level_bytes, record, Job, K4_D, K4_DMIN, K4_MINS, K4_RECORD, K4_SCALES, Q4K,
        Q4_0, Q4_1, Q5_0, Q5_1, Q6K, Q6_D, Q6_HIGH, Q6_RECORD, Q6_SCALES, Q8_0, ROWS,
    };

    /// How far ahead of its reads a tile prefetches weight records. The
    /// hardware prefetcher alone left single-stream decode at half of a
    /// streaming sum's rate: measured on the llama-100m shape's Q4_1 file
    /// (2 threads, Sapphire Rapids), the layers went from 49–51 % of the
    /// memory roofline to 64–66 % at 4 KiB; 1 KiB gained little, and 8 or
    /// 16 KiB no more than 4.
    const PREFETCH_AHEAD: usize = 4096;

    /// Calls of at most this many activation rows prefetch (every tile of
    /// them). Decode batches and speculative verification live here:
    /// their tiles of 2–8 rows compute long enough per record that the
    /// hardware prefetcher alone fell behind (SmolLM2 Q8_0 at B = 8: 400
    /// tok/s prefetching only 1–4-row tiles, 490 prefetching all; session
    /// 15, alternating runs). In a prompt's call, every group is swept by
    /// many tiles, so all but the first find the records in cache.
    const PREFETCH_ROWS: usize = 16;

    /// Calls of at most this many rows prefetch Q8_0, Q4_K and Q6_K
    /// records into L2 only (`prefetcht1`) rather than into L1 too
    /// (`prefetcht0`). Their records (Q8_0: 4¼ lines, two prefetched; the
    /// K-quants: 20 and 27 lines, all prefetched at once) decode faster so
    /// on a 2-core AMD EPYC (Zen 4), alternating builds: SmolLM2 single
    /// stream as Q8_0 143–149 → 190–199 tok/s (AVX-512 tier) and 120–141 →
    /// 167–175 (AVX2 tier), as Q4_K 163–168 → 201–208; the llama-100m
    /// shape's Q8_0 242–266 → 309–346; four rows gained as well. At 16
    /// rows it lost (llama-100m Q8_0 1 119–1 173 → 874–1 221 tok/s), where
    /// a tile computes long enough per record to want it in L1. The 4- and
    /// 5-bit 32-element formats' records (2½–3 lines, two prefetched) did
    /// not gain (Q4_1 single stream 217–249 → 190–215 tok/s with two lines
    /// into L2, level with three), so they keep L1. Not measured on Intel
    /// hosts. BENCHMARKS.md, issue 22, session 36.
    const L2_PREFETCH_ROWS: usize = 4;

    /// [`L2_PREFETCH_ROWS`] on the VNNI tier, whose Q4_0 / Q4_1 calls of
    /// 5 and 6 rows keep the 8-lane tile ([`PAIR_ROWS_ABOVE`]): the two
    /// together, on the same EPYC, ran SmolLM2's passes of 5 and 6 rows
    /// 22-28 % faster as Q8_0 and Q4_K, 11-12 % as the Q4_1 file; either
    /// alone, no faster (Q8_0 has since moved to pairs with the far
    /// prefetch from 3 rows, [`Q8_PAIR_ROWS_ABOVE`]). The AVX2 tier's 5-
    /// and 6-row Q8_0 passes measured 6-9 % slower with it (medians of six
    /// noisy rounds), so it keeps 4 (BENCHMARKS.md, issue 18, session 42).
    const L2_PREFETCH_ROWS_VNNI: usize = 6;

    /// How far ahead Q8_0 calls of more rows than [`Q8_PAIR_ROWS_ABOVE`]
    /// (and at most [`PREFETCH_ROWS`]) prefetch on the VNNI tier, each
    /// record whole and into L2. A pair tile of that many rows computes
    /// long enough per record that two lines a record at [`PREFETCH_AHEAD`]
    /// left the weights' reads and the multiply-adds taking turns: SmolLM2
    /// as Q8_0 on a 2-core AMD EPYC (Zen 4) decoded 8 and 16 rows at 1.5
    /// and 1.1 ms a row where its prompts take 0.5. With this rule, eight
    /// alternating rounds: B = 7 / 8 / 12 / 16 1.43 / 1.32 / 1.15 / 1.17x
    /// (1-6 rows, prompts: the same code; 3-6 rows joined later, see
    /// [`Q8_PAIR_ROWS_ABOVE`]). Whole records at the old
    /// distance, or two lines twice as far, gained little; at 17-64 rows
    /// (no prefetch) the rule read 0.8x at 32 and 64, and the 4-bit
    /// formats (2½-line records) and the AVX2 tier measured no gain.
    /// BENCHMARKS.md, issue 18, session 49.
    const FAR_AHEAD: usize = 8192;

    /// Where a call's tiles prefetch the records ahead of their reads.
    #[derive(Clone, Copy, PartialEq)]
    enum Prefetch {
        Off,
        L1,
        L2,
        /// Each record whole, into L2, [`FAR_AHEAD`] ahead.
        FarL2,
    }

    impl Prefetch {
        /// For `job`'s call against format `F`.
        fn of<const F: u8>(job: &Job<'_>) -> Self {
            let rows = job.rows;
            let vnni = job.isa == super::Isa::Avx512Vnni;
            let l2_rows = if vnni {
                L2_PREFETCH_ROWS_VNNI
            } else {
                L2_PREFETCH_ROWS
            };
            if rows > PREFETCH_ROWS {
                Self::Off
            } else if F == Q8_0 && vnni && rows > pair_rows_above::<F>() {
                // The far prefetch goes with Q8_0's pair tile.
                Self::FarL2
            } else if rows <= l2_rows && matches!(F, Q8_0 | Q4K | Q6K) {
                Self::L2
            } else {
                Self::L1
            }
        }

        /// Prefetches `lines` cache lines from [`PREFETCH_AHEAD`] past
        /// `rec` (for [`Self::FarL2`], the record of format `F` from
        /// [`FAR_AHEAD`] past it); a prefetch never faults, so past the
        /// last record is harmless.
        #[inline(always)]
        unsafe fn ahead<const F: u8>(self, rec: *const u8, lines: usize) {
            let (ahead, lines) = match self {
                Self::Off => return,
                Self::FarL2 => (FAR_AHEAD, const { record(format_of(F)).div_ceil(64) }),
                _ => (PREFETCH_AHEAD, lines),
            };
            for i in 0..lines {
                let line = rec.wrapping_add(ahead + 64 * i) as *const i8;
                if self == Self::L1 {
                    _mm_prefetch::<_MM_HINT_T0>(line)
                } else {
                    _mm_prefetch::<_MM_HINT_T1>(line)
                }
            }
        }
    }

    /// Activation rows `r0..r0 + R` as a tile reads them.
    struct Acts<const R: usize> {
        q: [*const u8; R],
        d: [*const f32; R],
        sum: [*const f32; R],
        qoff: [*const i32; R],
        qsum: [*const i16; R],
        qsum16: [*const i16; R],
    }

    impl<const R: usize> Acts<R> {
        #[inline(always)]
        unsafe fn new(job: &Job<'_>, r0: usize) -> Self {
            let (a, k) = (job.acts, job.w.k);
            let at = |i: usize| (r0 + i) * (k / 32);
            let group = job.w.format.group();
            Self {
                q: std::array::from_fn(|i| a.q.as_ptr().add((r0 + i) * k) as *const u8),
                d: std::array::from_fn(|i| a.d.as_ptr().add((r0 + i) * (k / group))),
                qsum: std::array::from_fn(|i| a.qsum.as_ptr().add(at(i))),
                qsum16: std::array::from_fn(|i| a.qsum16.as_ptr().add((r0 + i) * (k / 16))),
                sum: std::array::from_fn(|i| a.sum.as_ptr().add(at(i))),
                qoff: std::array::from_fn(|i| a.qoff.as_ptr().add(at(i))),
            }
        }

        /// Activation bytes `e..e + 4` of row `i`, in every lane.
        #[inline(always)]
        unsafe fn quad(&self, i: usize, e: usize) -> __m256i {
            _mm256_set1_epi32(std::ptr::read_unaligned(self.q[i].add(e) as *const i32))
        }

        /// Where row `i`'s block `g` sum starts so that it ends at `Σ w x`
        /// for weights stored as unsigned bytes: `−128 Σ x` for Q8_0's
        /// `w + 128`, `−8 Σ x` for Q4_0's `q = w + 8`, `−16 Σ x` for
        /// Q5_0's `q = w + 16`, 0 for the formats with a min.
        #[inline(always)]
        unsafe fn start<const F: u8>(&self, i: usize, g: usize) -> __m256i {
            match F {
                Q8_0 => _mm256_set1_epi32(*self.qoff[i].add(g)),
                Q4_0 => _mm256_set1_epi32(*self.qoff[i].add(g) >> 4),
                Q5_0 => _mm256_set1_epi32(*self.qoff[i].add(g) >> 3),
                _ => _mm256_setzero_si256(),
            }
        }
    }

    /// Writes a tile's accumulators: row `r0 + i`'s 8 outputs of row group
    /// `group` from `acc[i]`.
    #[inline(always)]
    unsafe fn store_tile<const R: usize>(
        job: &Job<'_>,
        r0: usize,
        group: usize,
        acc: &[__m256; R],
    ) {
        for (i, a) in acc.iter().enumerate() {
            let mut lanes = [0f32; ROWS];
            _mm256_storeu_ps(lanes.as_mut_ptr(), *a);
            job.store(r0 + i, group, &lanes);
        }
    }

    /// How many independent sums a tile of `R` activation rows splits each
    /// block's sum into. `vpdpbusd` adds into its own destination (5
    /// cycles' latency), so with few rows one chain per row leaves the
    /// port idle. Measured at one row (Sapphire Rapids, single thread):
    /// 2 chains beat 1 by ~10 % for Q8_0, and 4 lost to 2 for Q4_K / Q6_K
    /// (more zeroing and adds). The sums are integers: splitting them
    /// changes no bit.
    const fn chains(rows: usize) -> usize {
        if rows <= 4 {
            2
        } else {
            1
        }
    }

    /// `R` rows' sums split over [`chains`]`(R)` partial sums, each
    /// vector's products added to the partial `v % chains` (so chains stay
    /// short when `R` is small), then added together.
    struct Split<const R: usize> {
        part: [[__m256i; R]; 2],
    }

    impl<const R: usize> Split<R> {
        /// Partial sums starting at `start` (in the first) and zero.
        #[inline(always)]
        unsafe fn new(start: [__m256i; R]) -> Self {
            Self {
                part: [start, [_mm256_setzero_si256(); R]],
            }
        }

        /// Adds vector `v`'s products `dot(sum, weights, activations of row i)`.
        #[inline(always)]
        unsafe fn add(
            &mut self,
            v: usize,
            w: __m256i,
            x: impl Fn(usize) -> __m256i,
            dot: &impl Fn(__m256i, __m256i, __m256i) -> __m256i,
        ) {
            let part = &mut self.part[v % chains(R)];
            for (i, s) in part.iter_mut().enumerate() {
                *s = dot(*s, w, x(i));
            }
        }

        /// The rows' whole sums.
        #[inline(always)]
        unsafe fn sum(self) -> [__m256i; R] {
            let mut out = self.part[0];
            for p in &self.part[1..chains(R)] {
                for (o, s) in out.iter_mut().zip(p) {
                    *o = _mm256_add_epi32(*o, *s);
                }
            }
            out
        }
    }

    /// The block sums of rows `R` against one record's level bytes `rec`,
    /// from `isum`: `dot(acc, weights, activations)` multiplies 32
    /// unsigned weight bytes by 4 activation bytes in every lane and adds
    /// the products in fours. For Q8_0 vector `v` holds elements
    /// `4v..4v + 4`; for the 4-bit formats each vector holds two: low nibbles
    /// (elements `4u..4u + 4`) and high ones (`16 + 4u..`).
    #[inline(always)]
    unsafe fn block_sums<const F: u8, const R: usize>(
        rec: *const u8,
        act: &Acts<R>,
        g: usize,
        isum: &mut [__m256i; R],
        dot: impl Fn(__m256i, __m256i, __m256i) -> __m256i,
    ) {
        let mut split = Split::new(*isum);
        if F == Q8_0 {
            for v in 0..8 {
                let w = _mm256_loadu_si256(rec.add(32 * v) as *const __m256i);
                split.add(v, w, |i| act.quad(i, 32 * g + 4 * v), &dot);
            }
        } else {
            let (m4, bit4) = (_mm256_set1_epi8(0xF), _mm256_set1_epi8(0x10));
            let fifths = _mm256_loadu_si256(rec.add(128) as *const __m256i);
            for u in 0..4 {
                let v = _mm256_loadu_si256(rec.add(32 * u) as *const __m256i);
                let mut lo = _mm256_and_si256(v, m4);
                let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4);
                if F == Q5_0 || F == Q5_1 {
                    // Bit u (low half) and bit 4 + u (high half) to bit 4;
                    // 16-bit shifts, but no bit crosses into bit 4 of the
                    // next byte (shifts of at most 4).
                    let up = _mm256_sll_epi16(fifths, _mm_cvtsi32_si128(4 - u as i32));
                    let down = _mm256_srl_epi16(fifths, _mm_cvtsi32_si128(u as i32));
                    lo = _mm256_or_si256(lo, _mm256_and_si256(up, bit4));
                    hi = _mm256_or_si256(hi, _mm256_and_si256(down, bit4));
                }
                split.add(2 * u, lo, |i| act.quad(i, 32 * g + 4 * u), &dot);
                split.add(2 * u + 1, hi, |i| act.quad(i, 32 * g + 16 + 4 * u), &dot);
            }
        }
        *isum = split.sum();
    }

    /// Row group `group`'s records against the `R` activation rows from
    /// `r0`: `record(rec, g, act, acc)` adds record `g`'s terms to the
    /// accumulators (one lane per weight row), in order; then the tile is
    /// stored. In calls of at most [`PREFETCH_ROWS`] rows, each record's
    /// first `lines` cache lines are prefetched [`PREFETCH_AHEAD`] ahead,
    /// into the cache level [`Prefetch::of`] picks.
    #[inline(always)]
    unsafe fn records<const F: u8, const R: usize>(
        job: &Job<'_>,
        group: usize,
        r0: usize,
        lines: usize,
        record_terms: impl Fn(*const u8, usize, &Acts<R>, &mut [__m256; R]),
    ) {
        let act = Acts::<R>::new(job, r0);
        let recs = job.w.group(group);
        let len = record(job.w.format);
        let mut acc = [_mm256_setzero_ps(); R];
        let prefetch = Prefetch::of::<F>(job);
        for g in 0..job.w.k / job.w.format.group() {
            let rec = recs.add(g * len);
            prefetch.ahead::<F>(rec, lines);
            record_terms(rec, g, &act, &mut acc);
        }
        store_tile(job, r0, group, &acc);
    }

    /// Row groups `group`'s `R` activation rows from `r0`: per block the
    /// sums `sums` forms from zero, then `acc + cvt(isum) · (d_w · d_x)` (and
    /// Q4_1's `+ m_w · Σ x`), one lane per weight row.
    #[inline(always)]
    unsafe fn tile<const F: u8, const R: usize>(
        job: &Job<'_>,
        group: usize,
        r0: usize,
        sums: impl Fn(*const u8, &Acts<R>, usize, &mut [__m256i; R]),
    ) {
        let lb = level_bytes(format_of(F));
        // Two lines a record (at most 272 bytes): against one, SmolLM2's
        // Q8_0 and Q4_1 decode at B = 4–8 ran 10–20 % faster, and three
        // were no better (session 15, alternating runs).
        records::<F, R>(job, group, r0, 2, |rec, g, act, acc| {
            let mut isum = [_mm256_setzero_si256(); R];
            sums(rec, act, g, &mut isum);
            let half = |at: usize| _mm256_cvtph_ps(_mm_loadu_si128(rec.add(at) as *const __m128i));
            let dw = half(lb);
            for (i, a) in acc.iter_mut().enumerate() {
                let scale = _mm256_mul_ps(dw, _mm256_broadcast_ss(&*act.d[i].add(g)));
                *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i]), scale, *a);
            }
            if F == Q4_1 || F == Q5_1 {
                let mw = half(lb + 2 * ROWS);
                for (i, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(mw, _mm256_broadcast_ss(&*act.sum[i].add(g)), *a);
                }
            }
        })
    }

    /// `total += isum · sc` per 32-bit lane: sub-block sums times the
    /// rows' sub-block scales.
    #[inline(always)]
    unsafe fn add_scaled<const R: usize>(
        total: &mut [__m256i; R],
        isum: [__m256i; R],
        sc: __m256i,
    ) {
        for (t, s) in total.iter_mut().zip(isum) {
            *t = _mm256_add_epi32(*t, _mm256_mullo_epi32(s, sc));
        }
    }

    /// [`tile`] with VNNI's `vpdpbusd`.
    #[inline(always)]
    unsafe fn tile_vnni<const F: u8, const R: usize>(job: &Job<'_>, group: usize, r0: usize) {
        if F == Q4K {
            return tile_q4k::<R>(job, group, r0, |s, w, x| _mm256_dpbusd_epi32(s, w, x));
        }
        if F == Q6K {
            return tile_q6k::<R>(job, group, r0, |s, w, x| _mm256_dpbusd_epi32(s, w, x));
        }
        tile::<F, R>(job, group, r0, |rec, act, g, isum| {
            *isum = std::array::from_fn(|i| act.start::<F>(i, g));
            block_sums::<F, R>(rec, act, g, isum, |s, w, x| _mm256_dpbusd_epi32(s, w, x))
        })
    }

    /// [`tile`] with AVX2's `vpmaddubsw` + `vpmaddwd`: exact while a pair
    /// of products fits 16 bits, so Q8_0 multiplies `|w|` by the
    /// activations with `w`'s sign (pairs below 2 · 128 · 127) instead of
    /// `w + 128` by them; nibbles (below 16) need nothing.
    #[inline(always)]
    unsafe fn tile_avx2<const F: u8, const R: usize>(job: &Job<'_>, group: usize, r0: usize) {
        let ones = _mm256_set1_epi16(1);
        let flip = _mm256_set1_epi8(-128);
        let pairs =
            |s, w, x| _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones));
        if F == Q4K {
            return tile_q4k::<R>(job, group, r0, pairs);
        }
        if F == Q6K {
            return tile_q6k::<R>(job, group, r0, pairs);
        }
        tile::<F, R>(job, group, r0, |rec, act, g, isum| {
            if F == Q8_0 {
                // Signed levels against signed activations: from 0.
                for v in 0..8 {
                    let w = _mm256_xor_si256(
                        _mm256_loadu_si256(rec.add(32 * v) as *const __m256i),
                        flip,
                    );
                    let magnitude = _mm256_abs_epi8(w);
                    for (i, s) in isum.iter_mut().enumerate() {
                        let x = _mm256_sign_epi8(act.quad(i, 32 * g + 4 * v), w);
                        *s = pairs(*s, magnitude, x);
                    }
                }
            } else {
                *isum = std::array::from_fn(|i| act.start::<F>(i, g));
                block_sums::<F, R>(rec, act, g, isum, pairs)
            }
        })
    }

    /// Q4_K: [`groups_portable_q4k`](super::groups_portable_q4k)'s sums,
    /// each sub-block's 8 block sums (`dot`, from 0) scaled by the rows'
    /// sub-block scales in 32-bit integers, the mins' sums by one
    /// `vpmaddwd` per two sub-blocks.
    #[inline(always)]
    unsafe fn tile_q4k<const R: usize>(
        job: &Job<'_>,
        group: usize,
        r0: usize,
        dot: impl Fn(__m256i, __m256i, __m256i) -> __m256i,
    ) {
        let sign = _mm256_set1_ps(-0.0);
        // Every line (spread over the sub-blocks: measured no faster).
        records::<Q4K, R>(
            job,
            group,
            r0,
            K4_RECORD.div_ceil(64),
            |rec, g, act, acc| {
                let mut total = [_mm256_setzero_si256(); R];
                for c in 0..4 {
                    q4k_sub_block::<false, R>(rec, act, g, c, &mut total, &dot);
                    q4k_sub_block::<true, R>(rec, act, g, c, &mut total, &dot);
                }
                let half =
                    |at: usize| _mm256_cvtph_ps(_mm_loadu_si128(rec.add(at) as *const __m128i));
                let (d, dmin) = (half(K4_D), _mm256_xor_ps(half(K4_DMIN), sign));
                for (i, a) in acc.iter_mut().enumerate() {
                    let mut mins = _mm256_setzero_si256();
                    for p in 0..4 {
                        let m = _mm256_loadu_si256(rec.add(K4_MINS + 32 * p) as *const __m256i);
                        let pair =
                            std::ptr::read_unaligned(act.qsum[i].add(8 * g + 2 * p) as *const i32);
                        mins =
                            _mm256_add_epi32(mins, _mm256_madd_epi16(m, _mm256_set1_epi32(pair)));
                    }
                    let dx = _mm256_broadcast_ss(&*act.d[i].add(g));
                    *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total[i]), _mm256_mul_ps(d, dx), *a);
                    *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mins), _mm256_mul_ps(dmin, dx), *a);
                }
            },
        )
    }

    /// Q4_K's sub-block `2c` (the low nibbles of chunk `c`) or, when
    /// `HIGH`, `2c + 1` (the high ones) of record `rec` (super-block `g`):
    /// its 8 sums of `q x` (`dot`, from 0) times the rows' scales, added
    /// to `total`.
    #[inline(always)]
    unsafe fn q4k_sub_block<const HIGH: bool, const R: usize>(
        rec: *const u8,
        act: &Acts<R>,
        g: usize,
        c: usize,
        total: &mut [__m256i; R],
        dot: &impl Fn(__m256i, __m256i, __m256i) -> __m256i,
    ) {
        let m4 = _mm256_set1_epi8(0xF);
        let j = 2 * c + HIGH as usize;
        let mut split = Split::new([_mm256_setzero_si256(); R]);
        for v in 0..8 {
            let raw = _mm256_loadu_si256(rec.add(32 * (8 * c + v)) as *const __m256i);
            let w = match HIGH {
                false => _mm256_and_si256(raw, m4),
                true => _mm256_and_si256(_mm256_srli_epi16::<4>(raw), m4),
            };
            split.add(v, w, |i| act.quad(i, 256 * g + 32 * j + 4 * v), dot);
        }
        let sc =
            _mm256_cvtepu8_epi32(_mm_loadl_epi64(rec.add(K4_SCALES + 8 * j) as *const __m128i));
        add_scaled(total, split.sum(), sc);
    }

    /// Q6_K's level vector `t` of record `rec` (module docs), `t / 16 =
    /// M` (a constant, so the shifts are): the low 4 bits from a nibble
    /// vector, the high 2 from a high-bits vector, moved to bits 4 and 5
    /// (16-bit shifts: bits crossing from the next byte are masked off).
    #[inline(always)]
    unsafe fn q6k_levels<const M: usize>(rec: *const u8, t: usize) -> __m256i {
        let (m4, m30) = (_mm256_set1_epi8(0xF), _mm256_set1_epi8(0x30));
        let nibbles = _mm256_loadu_si256(rec.add(32 * (t % 32)) as *const __m256i);
        let low = match M {
            0 | 1 => _mm256_and_si256(nibbles, m4),
            _ => _mm256_and_si256(_mm256_srli_epi16::<4>(nibbles), m4),
        };
        let bits = _mm256_loadu_si256(rec.add(Q6_HIGH + 32 * (t % 16)) as *const __m256i);
        let high = match M {
            0 => _mm256_slli_epi16::<4>(bits),
            1 => _mm256_slli_epi16::<2>(bits),
            2 => bits,
            _ => _mm256_srli_epi16::<2>(bits),
        };
        _mm256_or_si256(low, _mm256_and_si256(high, m30))
    }

    /// Q6_K's sub-blocks `4M .. 4M + 4` of record `rec` (super-block `g`):
    /// each one's 8 sums of `q x` (`dot`, from 0) times the rows' scales,
    /// added to `total`. A quarter at a time so that `M`, which picks the
    /// shifts of [`q6k_levels`], is a constant.
    #[inline(always)]
    unsafe fn q6k_quarter<const M: usize, const R: usize>(
        rec: *const u8,
        act: &Acts<R>,
        g: usize,
        total: &mut [__m256i; R],
        dot: &impl Fn(__m256i, __m256i, __m256i) -> __m256i,
    ) {
        for s in 4 * M..4 * M + 4 {
            let mut split = Split::new([_mm256_setzero_si256(); R]);
            for v in 0..4 {
                let w = q6k_levels::<M>(rec, 4 * s + v);
                split.add(v, w, |i| act.quad(i, 256 * g + 16 * s + 4 * v), dot);
            }
            let sc =
                _mm256_cvtepi8_epi32(_mm_loadl_epi64(rec.add(Q6_SCALES + 8 * s) as *const __m128i));
            add_scaled(total, split.sum(), sc);
        }
    }

    /// Q6_K's sub-block scales `2p, 2p + 1` of the 8 rows as `i16` pairs,
    /// row `l`'s in 32-bit lane `l` (one `vpmaddwd` against the
    /// activations' per-16 sums).
    #[inline(always)]
    unsafe fn q6k_scale_pairs(rec: *const u8, p: usize) -> __m256i {
        let rows = _mm_loadu_si128(rec.add(Q6_SCALES + 16 * p) as *const __m128i);
        let zip = _mm_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
        _mm256_cvtepi8_epi16(_mm_shuffle_epi8(rows, zip))
    }

    /// Q6_K: [`groups_portable_q6k`](super::groups_portable_q6k)'s sum,
    /// each sub-block's 8 sums of `q x` (`dot`, from 0) scaled by the
    /// rows' sub-block scales in 32-bit integers, less `32 Σ_s sc_s Σ x`
    /// by one `vpmaddwd` per two sub-blocks.
    #[inline(always)]
    unsafe fn tile_q6k<const R: usize>(
        job: &Job<'_>,
        group: usize,
        r0: usize,
        dot: impl Fn(__m256i, __m256i, __m256i) -> __m256i,
    ) {
        records::<Q6K, R>(
            job,
            group,
            r0,
            Q6_RECORD.div_ceil(64),
            |rec, g, act, acc| {
                let mut total = [_mm256_setzero_si256(); R];
                q6k_quarter::<0, R>(rec, act, g, &mut total, &dot);
                q6k_quarter::<1, R>(rec, act, g, &mut total, &dot);
                q6k_quarter::<2, R>(rec, act, g, &mut total, &dot);
                q6k_quarter::<3, R>(rec, act, g, &mut total, &dot);
                let mut offset = [_mm256_setzero_si256(); R];
                for p in 0..8 {
                    let sc = q6k_scale_pairs(rec, p);
                    for (i, o) in offset.iter_mut().enumerate() {
                        let pair = std::ptr::read_unaligned(
                            act.qsum16[i].add(16 * g + 2 * p) as *const i32
                        );
                        *o = _mm256_add_epi32(*o, _mm256_madd_epi16(sc, _mm256_set1_epi32(pair)));
                    }
                }
                let d = _mm256_cvtph_ps(_mm_loadu_si128(rec.add(Q6_D) as *const __m128i));
                for (i, a) in acc.iter_mut().enumerate() {
                    let t = _mm256_sub_epi32(total[i], _mm256_slli_epi32::<5>(offset[i]));
                    let dx = _mm256_broadcast_ss(&*act.d[i].add(g));
                    *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(d, dx), *a);
                }
            },
        )
    }

    /// Every activation row of `$job` against row group `$group` through
    /// `$tile`, `$mr` rows at a time. A macro, not a closure: the tiles
    /// must inline into the `target_feature` function that expands it.
    macro_rules! tiles {
        ($tile:ident::<$f:ident>, $mr:expr, $job:expr, $group:expr) => {{
            let mut r = 0;
            while r < $job.rows {
                let rows = ($job.rows - r).min($mr);
                match rows {
                    8 if $mr >= 8 => $tile::<$f, 8>($job, $group, r),
                    7 if $mr >= 8 => $tile::<$f, 7>($job, $group, r),
                    6 if $mr >= 8 => $tile::<$f, 6>($job, $group, r),
                    5 if $mr >= 8 => $tile::<$f, 5>($job, $group, r),
                    4 => $tile::<$f, 4>($job, $group, r),
                    3 => $tile::<$f, 3>($job, $group, r),
                    2 => $tile::<$f, 2>($job, $group, r),
                    _ => $tile::<$f, 1>($job, $group, r),
                }
                r += rows;
            }
        }};
    }

    /// Row groups `groups` against every activation row, 8 rows a tile
    /// (AVX-512's 32 vector registers hold 8 sums and 8 accumulators).
    /// Q8_0, Q4_0 and Q4_1 calls of more rows than [`pair_rows_above`]
    /// take their groups in pairs ([`tile_pair`]); an odd last group takes
    /// the 8-lane tile, whose sums are the same.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn groups_vnni<const F: u8>(job: &Job<'_>, groups: Range<usize>) {
        let mut group = groups.start;
        if job.rows > pair_rows_above::<F>() {
            while group + 1 < groups.end {
                tiles!(tile_pair::<F>, 8, job, group);
                group += 2;
            }
        }
        for group in group..groups.end {
            tiles!(tile_vnni::<F>, 8, job, group);
        }
    }

    /// Q4_0 and Q4_1 calls of at most this many rows keep the 8-lane tile
    /// (Q8_0's bound is [`Q8_PAIR_ROWS_ABOVE`]): against it,
    /// the Q8_0 pair measured +2 / 0 / −4 % at 1 / 2 / 4 rows and +3 / +10
    /// / +17 % at 8 / 16 / 64, prompts +27 %; SmolLM2's Q4_1 GGUF +11–13 %
    /// at 16 and 64 rows, prompts +18 % (2 threads, Sapphire Rapids class;
    /// BENCHMARKS.md, session 28). On a Zen 4 EPYC, 5- and 6-row calls on
    /// the 8-lane tile with the L2 prefetch ([`L2_PREFETCH_ROWS_VNNI`]) ran
    /// 11-28 % faster than as pairs (session 42; not measured on Intel
    /// hosts); 7 rows and more stay pairs (measured mixed there).
    const PAIR_ROWS_ABOVE: usize = 6;

    /// Q8_0 calls of more rows than this take pairs, with the far
    /// prefetch ([`Prefetch::FarL2`]), on the VNNI tier: on the same EPYC,
    /// against the 8-lane tile with its L2 prefetch, SmolLM2 as Q8_0 in
    /// the forward bench, eight alternating rounds, 3 / 4 / 5 / 6 rows ran
    /// 0.97 / 1.13 / 1.29 / 1.41x (faster in 4 / 5 / 7 / 7 rounds), and
    /// 1.06 / 1.13 / 1.06 / 1.27x in an eight-round run of a knob build
    /// before; 2 rows read 0.95x there, so they keep the 8-lane tile.
    /// These are a lone stream's verifying passes of 2-5 drafts.
    /// BENCHMARKS.md, issue 18, session 49.
    const Q8_PAIR_ROWS_ABOVE: usize = 2;

    /// Calls of format `F` with more rows than this take pairs
    /// ([`usize::MAX`]: never, a format without a pair tile).
    const fn pair_rows_above<const F: u8>() -> usize {
        match F {
            Q8_0 => Q8_PAIR_ROWS_ABOVE,
            Q4_0 | Q4_1 => PAIR_ROWS_ABOVE,
            _ => usize::MAX,
        }
    }

    /// Row groups `group` and `group + 1` (Q8_0, Q4_0, Q4_1) against the
    /// `R` activation rows from `r0`, in 512-bit vectors: the low 8 lanes
    /// are `group`'s weight rows, the high 8 `group + 1`'s, so each
    /// broadcast of 4 activation bytes and each `vpdpbusd` serves 16
    /// weight rows, half the instructions per activation row of two 8-lane
    /// tiles (a Q8_0 pass on a Sapphire Rapids host whose L3 holds the
    /// weights costs about a millisecond per extra row, most of it these
    /// instructions). Every lane computes what [`tile_vnni`] computes for
    /// its row: the same exact integer sums (split into the same chains,
    /// which integers make order-free), converted, scaled and accumulated
    /// by the same operations, block by block in order. The bits are the
    /// same.
    #[inline(always)]
    unsafe fn tile_pair<const F: u8, const R: usize>(job: &Job<'_>, group: usize, r0: usize) {
        let act = Acts::<R>::new(job, r0);
        let (lo, hi) = (job.w.group(group), job.w.group(group + 1));
        let (len, lb) = (record(format_of(F)), level_bytes(format_of(F)));
        let prefetch = Prefetch::of::<F>(job);
        // 32 bytes of each group's record at `at`, as one vector.
        let both = |a: *const u8, b: *const u8, at: usize| {
            _mm512_inserti64x4::<1>(
                _mm512_castsi256_si512(_mm256_loadu_si256(a.add(at) as *const __m256i)),
                _mm256_loadu_si256(b.add(at) as *const __m256i),
            )
        };
        // Each group's 8 f16 values at `at`, as 16 f32 lanes.
        let halves = |a: *const u8, b: *const u8, at: usize| {
            _mm512_cvtph_ps(_mm256_inserti128_si256::<1>(
                _mm256_castsi128_si256(_mm_loadu_si128(a.add(at) as *const __m128i)),
                _mm_loadu_si128(b.add(at) as *const __m128i),
            ))
        };
        let quad = |i: usize, e: usize| {
            _mm512_set1_epi32(std::ptr::read_unaligned(act.q[i].add(e) as *const i32))
        };
        let m4 = _mm512_set1_epi8(0xF);
        let mut acc = [_mm512_setzero_ps(); R];
        for g in 0..job.w.k / 32 {
            let (a, b) = (lo.add(g * len), hi.add(g * len));
            prefetch.ahead::<F>(a, 2);
            prefetch.ahead::<F>(b, 2);
            // As `Acts::start`: the sums end at `Σ w x` for unsigned levels.
            let mut part: [[__m512i; R]; 2] = [
                std::array::from_fn(|i| match F {
                    Q8_0 => _mm512_set1_epi32(*act.qoff[i].add(g)),
                    Q4_0 => _mm512_set1_epi32(*act.qoff[i].add(g) >> 4),
                    _ => _mm512_setzero_si512(),
                }),
                [_mm512_setzero_si512(); R],
            ];
            let mut add = |v: usize, w: __m512i, e: usize| {
                for (i, s) in part[v % chains(R)].iter_mut().enumerate() {
                    *s = _mm512_dpbusd_epi32(*s, w, quad(i, 32 * g + e));
                }
            };
            if F == Q8_0 {
                for v in 0..8 {
                    add(v, both(a, b, 32 * v), 4 * v);
                }
            } else {
                for u in 0..4 {
                    let v = both(a, b, 32 * u);
                    add(2 * u, _mm512_and_si512(v, m4), 4 * u);
                    add(
                        2 * u + 1,
                        _mm512_and_si512(_mm512_srli_epi16::<4>(v), m4),
                        16 + 4 * u,
                    );
                }
            }
            let dw = halves(a, b, lb);
            for (i, acc) in acc.iter_mut().enumerate() {
                let isum = if chains(R) == 2 {
                    _mm512_add_epi32(part[0][i], part[1][i])
                } else {
                    part[0][i]
                };
                let scale = _mm512_mul_ps(dw, _mm512_set1_ps(*act.d[i].add(g)));
                *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, *acc);
            }
            if F == Q4_1 {
                let mw = halves(a, b, lb + 2 * ROWS);
                for (i, acc) in acc.iter_mut().enumerate() {
                    *acc = _mm512_fmadd_ps(mw, _mm512_set1_ps(*act.sum[i].add(g)), *acc);
                }
            }
        }
        for (i, a) in acc.iter().enumerate() {
            let mut lanes = [0f32; 2 * ROWS];
            _mm512_storeu_ps(lanes.as_mut_ptr(), *a);
            let (l, h) = lanes.split_at(ROWS);
            job.store(r0 + i, group, l.try_into().expect("8 lanes"));
            job.store(r0 + i, group + 1, h.try_into().expect("8 lanes"));
        }
    }

    /// Row groups `groups` against every activation row, 4 rows a tile
    /// (AVX2's 16 vector registers).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn groups_avx2<const F: u8>(job: &Job<'_>, groups: Range<usize>) {
        for group in groups {
            tiles!(tile_avx2::<F>, 4, job, group);
        }
    }
}
