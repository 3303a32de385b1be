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
//!
//! # Contention
//! A barrier is only as fast as its slowest thread: when another process
//! takes one of two cores, a preempted worker stalls every region until the
//! scheduler runs it again, and a step gets several times slower than on
//! one thread (measured: 35 vs 81 tokens/s at one sequence with one busy
//! neighbour). So each sizeable region times itself: when running in
//! parallel stops paying (wall time ≥ 90 % of the summed busy time) for a
//! few regions in a row, regions run on the calling thread alone for a
//! while, twice as long after each relapse, and then parallelism is tried
//! again. The work split never changes results (see `kernels`).

use std::ops::Range;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

/// Threads a parallel region may use: the barrier pool's size (one per
/// physical core, or `CANDLE_NUM_THREADS`), capped by `cap` when given.
pub(crate) fn threads(cap: Option<usize>) -> usize {
    let pool = candle_core::utils::barrier_pool().n_workers() + 1;
    cap.map_or(pool, |c| c.clamp(1, pool))
}

/// The variables that size candle's pools; set by the user, they win.
const POOL_VARS: [&str; 3] = ["CANDLE_NUM_THREADS", "CANDLE_CPU_MASK", "RAYON_NUM_THREADS"];

/// Sizes the kernels' thread pool to the CPUs this process may run on.
///
/// candle sizes its spinning barrier pool from the host's physical cores,
/// not from the process's affinity mask or CPU quota: under `taskset` or a
/// cpuset container it starts more spinning threads than the cores it
/// gets, and every parallel region waits for threads that cannot run
/// (measured: single-stream decode at about half its speed, 16 threads on
/// 2 cores; BENCHMARKS.md, issue 22). Unless one of `CANDLE_NUM_THREADS`, `CANDLE_CPU_MASK` or
/// `RAYON_NUM_THREADS` is set, this sets `CANDLE_NUM_THREADS` to the lesser
/// of candle's count and `std::thread::available_parallelism` (which
/// reads the mask and the cgroup quota), and returns what it set.
///
/// Call it first thing in `main`, before any thread is spawned and before
/// any model is loaded (the pool reads the variable once, when it starts).
/// The `tandem` binary and the examples do.
pub fn fit_cpu_threads_to_affinity() -> Option<usize> {
    if POOL_VARS.iter().any(|v| std::env::var_os(v).is_some()) {
        return None;
    }
    let allowed = std::thread::available_parallelism().ok()?.get();
    let pool = candle_core::utils::get_num_threads();
    (allowed < pool).then(|| {
        std::env::set_var("CANDLE_NUM_THREADS", allowed.to_string());
        allowed
    })
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
    if threads <= 1 || units <= grain || ADAPT.serial_now() {
        f(0..units);
        return;
    }
    let pool = candle_core::utils::barrier_pool();
    let workers = pool.n_workers();
    let cursor = AtomicUsize::new(0);
    let busy_ns = AtomicU64::new(0);
    let start = Instant::now();
    pool.execute(|tid| {
        // The caller is `tid == workers`; workers past the cap sit this one out.
        if tid != workers && tid + 1 >= threads {
            return;
        }
        let t = Instant::now();
        loop {
            let start = cursor.fetch_add(grain, Ordering::Relaxed);
            if start >= units {
                break;
            }
            f(start..units.min(start + grain));
        }
        busy_ns.fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
    });
    ADAPT.record(start.elapsed().as_nanos() as u64, busy_ns.into_inner());
}

/// Regions with less summed work than this say nothing about contention
/// (their cost is the wake-up, not a stalled worker).
const JUDGED_NS: u64 = 100_000;
/// Unprofitable regions in a row that switch to serial execution.
const BAD_STREAK: usize = 4;
/// Profitable regions in a row after which the back-off starts over.
const GOOD_STREAK: usize = 256;
/// Serial regions after the first relapse; doubled per relapse up to MAX.
const HOLD_MIN: usize = 64;
const HOLD_MAX: usize = 16_384;

/// Process-wide contention state (contention is a property of the machine).
struct Adapt {
    serial_left: AtomicUsize,
    bad: AtomicUsize,
    good: AtomicUsize,
    hold: AtomicUsize,
}

static ADAPT: Adapt = Adapt {
    serial_left: AtomicUsize::new(0),
    bad: AtomicUsize::new(0),
    good: AtomicUsize::new(0),
    hold: AtomicUsize::new(0),
};

impl Adapt {
    /// Whether this region should run serially (consumes one serial turn).
    fn serial_now(&self) -> bool {
        // Races between callers only shift a turn or two; both are harmless.
        let left = self.serial_left.load(Ordering::Relaxed);
        if left == 0 {
            return false;
        }
        self.serial_left.store(left - 1, Ordering::Relaxed);
        true
    }

    /// Judges a parallel region from its wall time and summed busy time.
    fn record(&self, wall_ns: u64, busy_ns: u64) {
        if busy_ns < JUDGED_NS {
            return;
        }
        if wall_ns * 10 >= busy_ns * 9 {
            self.good.store(0, Ordering::Relaxed);
            if self.bad.fetch_add(1, Ordering::Relaxed) + 1 >= BAD_STREAK {
                self.bad.store(0, Ordering::Relaxed);
                let hold = (self.hold.load(Ordering::Relaxed) * 2).clamp(HOLD_MIN, HOLD_MAX);
                self.hold.store(hold, Ordering::Relaxed);
                self.serial_left.store(hold, Ordering::Relaxed);
            }
        } else {
            self.bad.store(0, Ordering::Relaxed);
            if self.good.fetch_add(1, Ordering::Relaxed) + 1 >= GOOD_STREAK {
                self.hold.store(0, Ordering::Relaxed);
            }
        }
    }
}

/// A raw output pointer that parallel workers write disjoint parts of.
#[derive(Clone, Copy)]
pub(crate) struct SharedMut<T>(pub *mut T);

// SAFETY: only used to hand one buffer to workers that write disjoint
// elements of it while the owner waits for them (for_each_range returns
// after every worker is done).
unsafe impl<T: Send> Send for SharedMut<T> {}
// SAFETY: as for Send: workers share the pointer, never an element.
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
