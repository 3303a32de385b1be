//! A growable f32 buffer whose data starts on a 64-byte boundary, for the
//! activations the lean step hands to its kernels.
//!
//! A `Vec<f32>` is only 16-byte aligned (a large one sits 16 bytes past a
//! page boundary, behind the allocator's header), so every 64-byte vector
//! load from it straddles two cache lines and takes two load slots. The f32
//! tile loads five activation vectors per four weight vectors, and the split
//! loads made it load-bound: one thread, k = 768, 2304 × 128 outputs, 92
//! GFLOP/s from a `Vec` against 126 from an aligned buffer (BENCHMARKS.md).

/// One cache line of f32s; the buffer's unit of allocation.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([f32; 16]);

/// f32s starting on a cache line, grown to the largest length asked for
/// and then reused (never shrunk).
#[derive(Default)]
pub(crate) struct AlignedF32 {
    lines: Vec<Line>,
}

impl AlignedF32 {
    /// The first `n` elements, growing the buffer (zero-filled) if it is
    /// shorter.
    pub(crate) fn grow(&mut self, n: usize) -> &mut [f32] {
        let lines = n.div_ceil(16);
        if self.lines.len() < lines {
            self.lines.resize(lines, Line([0.0; 16]));
        }
        // SAFETY: `Line` is 16 f32s with no padding (repr(C), 64 bytes), so
        // the first `lines` lines are at least `n` initialised f32s.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast::<f32>(), n) }
    }

    /// The first `n` elements. Panics if the buffer never grew to `n`.
    pub(crate) fn get(&self, n: usize) -> &[f32] {
        assert!(
            n <= self.lines.len() * 16,
            "AlignedF32: {n} past the buffer"
        );
        // SAFETY: as in `grow`; the assert keeps `n` inside the lines.
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast::<f32>(), n) }
    }
}

#[cfg(test)]
mod tests {
    use super::AlignedF32;

    #[test]
    fn grows_zeroed_keeps_contents_and_stays_aligned() {
        let mut b = AlignedF32::default();
        assert!(b.grow(0).is_empty());
        b.grow(3).copy_from_slice(&[1.0, 2.0, 3.0]);
        let grown = b.grow(100_000);
        assert_eq!(grown.as_ptr() as usize % 64, 0);
        assert_eq!(&grown[..4], &[1.0, 2.0, 3.0, 0.0]);
        assert!(grown[3..].iter().all(|&v| v == 0.0));
        assert_eq!(b.get(2), &[1.0, 2.0]);
        assert_eq!(b.get(17).len(), 17);
    }
}
