//! The parallel split every lean-step kernel uses: work units handed out
//! through a shared cursor on candle's persistent barrier pool
//! (`candle_core::utils::barrier_pool`, one spinning worker per core, the
//! calling thread included).
//!
//! A shared cursor rather than a static split because the machines this
//! runs on are shared: when one core is busy with something else, the other
//! threads take its units instead of waiting for it at the barrier.
//!
//! Closures passed here must only compute: calling anything that itself
//! uses the barrier pool (a candle CPU op) from inside one would deadlock.

use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Threads a parallel region may use: the barrier pool's size (one per
/// physical core, or `CANDLE_NUM_THREADS`), capped by `cap` when given.
pub(crate) fn threads(cap: Option<usize>) -> usize {
    let pool = candle_core::utils::barrier_pool().n_workers() + 1;
    cap.map_or(pool, |c| c.clamp(1, pool))
}

/// Runs `f` over `0..units` in contiguous ranges of `grain` units, on up to
/// `threads` threads. Runs inline when there is one range or one thread.
pub(crate) fn for_each_range<F>(units: usize, grain: usize, threads: usize, f: F)
where
    F: Fn(Range<usize>) + Sync,
{
    let grain = grain.max(1);
    if units == 0 {
        return;
    }
    if threads <= 1 || units <= grain {
        f(0..units);
        return;
    }
    let pool = candle_core::utils::barrier_pool();
    let workers = pool.n_workers();
    let cursor = AtomicUsize::new(0);
    pool.execute(|tid| {
        // The caller is `tid == workers`; workers past the cap sit this one out.
        if tid != workers && tid + 1 >= threads {
            return;
        }
        loop {
            let start = cursor.fetch_add(grain, Ordering::Relaxed);
            if start >= units {
                break;
            }
            f(start..units.min(start + grain));
        }
    });
}

/// A raw output pointer that parallel workers write disjoint parts of.
#[derive(Clone, Copy)]
pub(crate) struct SharedMut<T>(pub *mut T);

// SAFETY: only used to hand one buffer to workers that write disjoint
// elements of it while the owner waits for them (for_each_range returns
// after every worker is done).
unsafe impl<T: Send> Send for SharedMut<T> {}
unsafe impl<T: Send> Sync for SharedMut<T> {}

impl<T> SharedMut<T> {
    /// The element pointer at `i`.
    ///
    /// # Safety
    /// `i` must be inside the buffer and no other thread may touch it.
    #[inline(always)]
    pub(crate) unsafe fn at(self, i: usize) -> *mut T {
        self.0.add(i)
    }
}
