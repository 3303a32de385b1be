//! The pooled penalty history: one `[rows, width]` ring-buffer matrix.
//!
//! Invariants (the sampler keeps them across `add` / `remove`):
//! - When `width > 0`, row `r` belongs to the `r`-th registered slot in
//!   registration order, for *every* registered slot; rows of slots without
//!   penalties stay zero and are never read. When no registered slot uses
//!   penalties the pool is empty (`width == 0`, no rows).
//! - `width` is the largest window among registered penalty slots.
//! - A slot with window `N` and `len` tokens seen uses columns `[0, N)` of
//!   its row as a ring: its next token goes to `len % N`, and the filled
//!   part is `[0, min(len, N))`. Seeding from priors packs the last
//!   `take = min(priors, N)` tokens at `[0, take)` with `len = take`, so
//!   once a seeded ring is full the next write overwrites the oldest entry.
//! - Removing a slot drops its row, so a slot registered later gets a
//!   fresh zeroed row: nothing of a removed slot's history can leak.

/// Ring-buffer rows of all registered slots.
#[derive(Debug, Default)]
pub(crate) struct HistoryPool {
    width: usize,
    /// Row-major `[rows, width]`.
    data: Vec<u32>,
    /// Bumped by every change, so a copy elsewhere (the device sampler's)
    /// knows whether it is stale.
    version: u64,
}

impl HistoryPool {
    /// Columns per row (0 when no slot uses penalties).
    pub(crate) fn width(&self) -> usize {
        self.width
    }

    /// Number of rows (equals the registered slot count when `width > 0`).
    pub(crate) fn rows(&self) -> usize {
        self.data.len().checked_div(self.width).unwrap_or(0)
    }

    /// Changes so far; equal versions mean equal contents.
    pub(crate) fn version(&self) -> u64 {
        self.version
    }

    /// The whole matrix, row-major `[rows, width]`.
    pub(crate) fn as_slice(&self) -> &[u32] {
        &self.data
    }

    /// The whole row `r`.
    pub(crate) fn row(&self, r: usize) -> &[u32] {
        &self.data[r * self.width..(r + 1) * self.width]
    }

    /// Appends a row for a new slot (the `existing`-th, so `existing` rows
    /// must already be there once the pool is allocated). `window` is the
    /// slot's penalty window (0 for a slot without penalties); the last
    /// `window` priors are packed at the front. Returns the ring length.
    pub(crate) fn push_row(&mut self, existing: usize, window: usize, priors: &[u32]) -> usize {
        if self.width == 0 && window == 0 {
            return 0;
        }
        self.version += 1;
        if window > self.width {
            // Zero rows for earlier slots keep rows aligned with slots when
            // the pool is allocated by its first penalty slot.
            let rows = if self.width == 0 {
                existing
            } else {
                self.rows()
            };
            self.repack(rows, window);
        }
        let take = priors.len().min(window);
        let start = self.data.len();
        self.data.resize(start + self.width, 0);
        self.data[start..start + take].copy_from_slice(&priors[priors.len() - take..]);
        take
    }

    /// Drops row `r` and shrinks the width to `new_width` (the largest
    /// window left; 0 empties the pool).
    pub(crate) fn remove_row(&mut self, r: usize, new_width: usize) {
        if self.width == 0 {
            return;
        }
        self.version += 1;
        self.data.drain(r * self.width..(r + 1) * self.width);
        if new_width == 0 {
            self.width = 0;
            self.data = Vec::new();
        } else if new_width < self.width {
            let rows = self.rows();
            self.repack(rows, new_width);
        }
    }

    /// Writes `token` at ring position `len % window` of row `r`.
    pub(crate) fn write(&mut self, r: usize, window: usize, len: u64, token: u32) {
        let pos = (len % window as u64) as usize;
        self.data[r * self.width + pos] = token;
        self.version += 1;
    }

    /// The filled part of row `r` for a ring of `window` holding `len`
    /// tokens (in ring order, not chronological).
    pub(crate) fn filled(&self, r: usize, window: usize, len: u64) -> &[u32] {
        let fill = (len.min(window as u64)) as usize;
        &self.row(r)[..fill]
    }

    /// The ring's tokens oldest first (what speculation extends).
    pub(crate) fn chronological(&self, r: usize, window: usize, len: u64, out: &mut Vec<u32>) {
        out.clear();
        let ring = self.filled(r, window, len);
        if len as usize >= window && window > 0 {
            let head = (len % window as u64) as usize;
            out.extend_from_slice(&ring[head..]);
            out.extend_from_slice(&ring[..head]);
        } else {
            out.extend_from_slice(ring);
        }
    }

    /// Re-lays `rows` rows at `width` columns, keeping each row's first
    /// `min(old, new)` columns (rings never extend past their window, and
    /// every window fits the new width).
    fn repack(&mut self, rows: usize, width: usize) {
        let mut data = vec![0u32; rows * width];
        let keep = self.width.min(width);
        if self.width > 0 {
            for (r, dst) in data.chunks_exact_mut(width).enumerate() {
                dst[..keep].copy_from_slice(&self.data[r * self.width..r * self.width + keep]);
            }
        }
        self.width = width;
        self.data = data;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_penalty_slot_allocates_rows_for_earlier_slots() {
        let mut pool = HistoryPool::default();
        assert_eq!(pool.push_row(0, 0, &[1, 2]), 0);
        assert_eq!(pool.rows(), 0);
        assert_eq!(pool.push_row(1, 3, &[5, 6, 7, 8]), 3);
        assert_eq!(pool.rows(), 2);
        assert_eq!(pool.row(0), &[0, 0, 0]);
        assert_eq!(pool.row(1), &[6, 7, 8]);
    }

    #[test]
    fn widening_keeps_rings_and_removal_drops_the_row() {
        let mut pool = HistoryPool::default();
        pool.push_row(0, 2, &[1, 2, 3]);
        pool.push_row(1, 4, &[9]);
        assert_eq!(pool.row(0), &[2, 3, 0, 0]);
        assert_eq!(pool.row(1), &[9, 0, 0, 0]);
        pool.remove_row(1, 2);
        assert_eq!(pool.width(), 2);
        assert_eq!(pool.row(0), &[2, 3]);
        pool.push_row(1, 2, &[]);
        assert_eq!(pool.row(1), &[0, 0], "a recycled row starts empty");
        pool.remove_row(0, 2);
        pool.remove_row(0, 0);
        assert_eq!((pool.width(), pool.rows()), (0, 0));
    }

    #[test]
    fn ring_wraps_and_reads_back_in_order() {
        let mut pool = HistoryPool::default();
        let mut len = pool.push_row(0, 3, &[1, 2, 3, 4]) as u64;
        assert_eq!(len, 3);
        pool.write(0, 3, len, 5);
        len += 1;
        assert_eq!(pool.filled(0, 3, len), &[5, 3, 4]);
        let mut chron = Vec::new();
        pool.chronological(0, 3, len, &mut chron);
        assert_eq!(chron, vec![3, 4, 5]);

        let mut pool = HistoryPool::default();
        let len = pool.push_row(0, 4, &[7]) as u64;
        assert_eq!(pool.filled(0, 4, len), &[7]);
        pool.chronological(0, 4, len, &mut chron);
        assert_eq!(chron, vec![7]);
    }
}
