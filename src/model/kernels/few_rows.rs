//! Which path a projection of a few activation rows takes in the f32/f16
//! linear (`dot`): the weight rows of a group streamed one after another
//! (on the AVX-512 tiers, also as two 256-bit halves per 16 lanes), or the
//! register tile that interleaves them. All give the same sums bit for
//! bit, so the choice is speed alone, and it differs by CPU: on an AMD
//! EPYC (Zen 4) host streaming ran one row 1.3–1.5× faster in f32 and
//! 1.5–1.7× in f16, and streaming in halves one f32 row another
//! 1.06–1.14× and four f16 rows 1.08–1.18× (one f16 row 0.97–1.13×, two
//! or three rows 0.85–1.05×); on a
//! Sapphire-Rapids-class Xeon the tile ran one to four rows 1.1–1.4×
//! faster in f32 and 1.5–1.7× in f16 (BENCHMARKS.md, sessions 21, 28 and
//! 50). No rule by ISA or vendor covers these, so the path is measured,
//! per projection shape, on the calls the engine makes anyway (as cuDNN's
//! benchmark mode picks a convolution algorithm on its first calls).
//!
//! # How a shape is settled
//! The calls of one shape `(ISA tier, weight element, rows, n, k)` take the
//! tier's paths ([`Path::candidates`]) in turn. After [`WARMUP`] calls of
//! each (first touches of freshly loaded weights, cold caches) the next
//! [`SAMPLES`] of each are timed, and the path with the lowest median time
//! is kept for the rest of the process; once each has [`MIN_SAMPLES`],
//! the paths whose median is [`CLEAR_GAP`] times the best's leave the
//! rotation, and a path left alone wins at once. A decode pass makes one
//! call of each shape per layer, so a 30-layer model settles its per-layer
//! shapes within four passes. Calls
//! of the same shape read different layers' weights of the same size, so
//! both paths see the same work; alternating call by call puts a shared
//! host's noise on both alike.
//!
//! `TANDEM_CPU_FEW_ROWS=stream|halves|tile` fixes the path instead (benchmarks
//! that compare builds should fix it, or let each run settle its own).
//!
//! # Ownership
//! One table per process behind a mutex; a lookup is a few hundred
//! nanoseconds against calls of tens of microseconds and more. Engines in
//! one process share what they measured.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use super::Isa;

/// Calls of each path not timed, per shape.
const WARMUP: usize = 8;
/// Timed calls of each path, per shape, before the faster is kept.
const SAMPLES: usize = 32;
/// Timed calls of each path after which a clear winner is kept early.
const MIN_SAMPLES: usize = 8;
/// A median this many times the best's is a clear loss: the path leaves
/// the rotation (stream and tile differ by 1.1–1.7× on the hosts
/// measured; a shape of one call a pass, the unembedding, would otherwise
/// spend 80–120 passes settling).
const CLEAR_GAP: f64 = 1.25;

/// A few-row call's path through the linear.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Path {
    /// Each group's weight rows one after another: one linear stream.
    Stream,
    /// [`Path::Stream`] with each 16-lane step loaded and multiplied as two
    /// 256-bit halves (the AVX-512 tiers; elsewhere the same as `Stream`).
    Halves,
    /// The register tile: a group's weight rows interleaved.
    Tile,
}

impl Path {
    /// Every path, in the order a shape's calls take them while settling.
    pub(crate) const ALL: [Path; 3] = [Path::Stream, Path::Halves, Path::Tile];

    /// The paths worth timing on `isa`: halves only where a step is wider
    /// than 256 bits.
    pub(crate) fn candidates(isa: Isa) -> &'static [Path] {
        match isa {
            Isa::Avx512 | Isa::Avx512Vnni => &Self::ALL,
            _ => &[Path::Stream, Path::Tile],
        }
    }

    fn name(self) -> &'static str {
        match self {
            Path::Stream => "stream",
            Path::Halves => "halves",
            Path::Tile => "tile",
        }
    }
}

/// A projection's shape: what the choice is kept for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Shape {
    pub isa: Isa,
    /// The weight element's name (`f32`, `f16`).
    pub elem: &'static str,
    pub rows: usize,
    pub n: usize,
    pub k: usize,
}

/// A call that is timed for its shape: hand it back to [`record`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct Trial {
    shape: Shape,
    path: Path,
}

#[derive(Debug, Default)]
struct Tuning {
    calls: [usize; 3],
    nanos: [Vec<u64>; 3],
    /// Paths dropped from the rotation, clearly slower than the best.
    dropped: [bool; 3],
    settled: Option<Path>,
}

fn index(path: Path) -> usize {
    match path {
        Path::Stream => 0,
        Path::Halves => 1,
        Path::Tile => 2,
    }
}

/// The path `TANDEM_CPU_FEW_ROWS` fixes, if any (read once).
fn fixed() -> Option<Path> {
    static FIXED: OnceLock<Option<Path>> = OnceLock::new();
    *FIXED.get_or_init(
        || match std::env::var("TANDEM_CPU_FEW_ROWS").ok().as_deref() {
            Some("stream") => Some(Path::Stream),
            Some("halves") => Some(Path::Halves),
            Some("tile") => Some(Path::Tile),
            _ => None,
        },
    )
}

fn table() -> &'static Mutex<HashMap<Shape, Tuning>> {
    static TABLE: OnceLock<Mutex<HashMap<Shape, Tuning>>> = OnceLock::new();
    TABLE.get_or_init(Default::default)
}

/// The path for a call of `shape`, and a [`Trial`] when the call's time is
/// wanted.
pub(crate) fn choose(shape: Shape) -> (Path, Option<Trial>) {
    if let Some(path) = fixed() {
        return (path, None);
    }
    let mut table = table().lock().unwrap_or_else(|e| e.into_inner());
    let tuning = table.entry(shape).or_default();
    if let Some(path) = tuning.settled {
        return (path, None);
    }
    // The candidate with the fewest calls: they take turns.
    let path = tuning
        .live(shape.isa)
        .min_by_key(|&p| tuning.calls[index(p)])
        .expect("the best path is never dropped");
    tuning.calls[index(path)] += 1;
    let timed = tuning.calls[index(path)] > WARMUP;
    (path, timed.then_some(Trial { shape, path }))
}

impl Tuning {
    /// The tier's paths still in the rotation.
    fn live(&self, isa: Isa) -> impl Iterator<Item = Path> + '_ {
        Path::candidates(isa)
            .iter()
            .copied()
            .filter(|&p| !self.dropped[index(p)])
    }
}

/// Records a timed call. Once every path in the rotation has
/// [`MIN_SAMPLES`] times, those whose median is [`CLEAR_GAP`] times the
/// best's leave it; the shape settles on the best when it is alone or
/// every path left has [`SAMPLES`].
pub(crate) fn record(trial: Trial, elapsed: Duration) {
    let mut table = table().lock().unwrap_or_else(|e| e.into_inner());
    let Some(tuning) = table.get_mut(&trial.shape) else {
        return;
    };
    if tuning.settled.is_some() {
        return;
    }
    let nanos = &mut tuning.nanos[index(trial.path)];
    if nanos.len() < SAMPLES {
        nanos.push(elapsed.as_nanos().min(u64::MAX as u128) as u64);
    }
    let isa = trial.shape.isa;
    let fewest = tuning.live(isa).map(|p| tuning.nanos[index(p)].len()).min();
    if fewest.unwrap_or(0) < MIN_SAMPLES {
        return;
    }
    let medians: Vec<(Path, u64)> = tuning
        .live(isa)
        .map(|p| (p, median(&tuning.nanos[index(p)])))
        .collect();
    // Ties go to the earlier candidate (`min_by_key` keeps the first).
    let (path, best) = *medians.iter().min_by_key(|&&(_, m)| m).expect("candidates");
    for &(p, m) in &medians {
        if m as f64 >= CLEAR_GAP * best as f64 {
            tuning.dropped[index(p)] = true;
        }
    }
    let left = tuning.live(isa).count();
    let fewest = tuning.live(isa).map(|p| tuning.nanos[index(p)].len()).min();
    if left == 1 || fewest == Some(SAMPLES) {
        tuning.settled = Some(path);
        tracing::debug!(
            shape = ?trial.shape,
            medians_us = ?medians.iter().map(|&(p, m)| (p.name(), m as f64 / 1e3)).collect::<Vec<_>>(),
            ?path,
            "few-row linear path settled"
        );
    }
}

fn median(nanos: &[u64]) -> u64 {
    let mut sorted = nanos.to_vec();
    sorted.sort_unstable();
    sorted[sorted.len() / 2]
}

/// The settled path of every shape measured so far, as (element, rows, n,
/// k, path) (benchmarks print it).
pub fn settled() -> Vec<(&'static str, usize, usize, usize, &'static str)> {
    let table = table().lock().unwrap_or_else(|e| e.into_inner());
    let mut out: Vec<_> = table
        .iter()
        .filter_map(|(s, t)| Some((s.elem, s.rows, s.n, s.k, t.settled?.name())))
        .collect();
    out.sort_unstable();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOT_PORTABLE: &str = "halves are timed on the AVX-512 tiers only";

    fn shape(n: usize) -> Shape {
        Shape {
            isa: Isa::Portable,
            elem: "u8",
            rows: 1,
            n,
            k: 7,
        }
    }

    /// Drives one shape's calls with `time(path)` until it settles.
    fn settle(shape: Shape, time: impl Fn(Path) -> u64) -> (Path, usize) {
        for call in 1..=4 * (WARMUP + SAMPLES) {
            let (path, trial) = choose(shape);
            match trial {
                Some(t) => record(t, Duration::from_nanos(time(path))),
                // Past the warm-up, an untimed call is a settled one.
                None if call > Path::ALL.len() * WARMUP => return (path, call),
                None => {}
            }
        }
        panic!("{shape:?} never settled");
    }

    #[test]
    fn the_faster_path_is_kept_after_both_were_timed_alike() {
        // Noise that favours one path on a third of its calls must not
        // decide: the median does.
        let (path, call) = settle(shape(1_000_001), |p| match p {
            Path::Stream => 100,
            Path::Tile => 90,
            Path::Halves => unreachable!("{NOT_PORTABLE}"),
        });
        assert_eq!(path, Path::Tile);
        assert_eq!(
            call,
            2 * (WARMUP + SAMPLES) + 1,
            "settles as soon as both have their samples"
        );
        let (path, call) = settle(shape(1_000_002), |p| match p {
            Path::Stream => 50,
            Path::Tile => 90,
            Path::Halves => unreachable!("{NOT_PORTABLE}"),
        });
        assert_eq!(path, Path::Stream);
        assert_eq!(
            call,
            2 * (WARMUP + MIN_SAMPLES) + 1,
            "a clear gap settles early"
        );
        let seen = std::cell::Cell::new(0u64);
        let (path, _) = settle(shape(1_000_003), |p| {
            seen.set(seen.get() + 1);
            match p {
                Path::Stream if seen.get() % 6 == 1 => 10,
                Path::Stream => 100,
                Path::Tile => 90,
                Path::Halves => unreachable!("{NOT_PORTABLE}"),
            }
        });
        assert_eq!(path, Path::Tile);
        assert!(settled().contains(&("u8", 1, 1_000_001, 7, "tile")));
    }

    #[test]
    fn avx512_shapes_time_the_halves_too() {
        let wide = |n| Shape {
            isa: Isa::Avx512,
            ..shape(n)
        };
        let s = wide(1_000_005);
        let first: Vec<_> = (0..3).map(|_| choose(s).0).collect();
        assert_eq!(first, Path::ALL, "the three paths take turns");
        // The tile is clearly slower and leaves the rotation once each path
        // has a few samples; the other two, 10 % apart, need all theirs.
        let (path, call) = settle(wide(1_000_006), |p| match p {
            Path::Stream => 100,
            Path::Halves => 90,
            Path::Tile => 150,
        });
        assert_eq!(path, Path::Halves);
        assert_eq!(call, (WARMUP + MIN_SAMPLES) + 2 * (WARMUP + SAMPLES) + 1);
        let (path, call) = settle(wide(1_000_008), |p| match p {
            Path::Stream => 100,
            Path::Halves => 95,
            Path::Tile => 110,
        });
        assert_eq!(path, Path::Halves);
        assert_eq!(call, 3 * (WARMUP + SAMPLES) + 1, "no gap: all take samples");
        // A path clearly ahead of both others wins once each has a few.
        let (path, call) = settle(wide(1_000_007), |p| match p {
            Path::Stream => 60,
            Path::Halves => 100,
            Path::Tile => 150,
        });
        assert_eq!(path, Path::Stream);
        assert_eq!(call, 3 * (WARMUP + MIN_SAMPLES) + 1);
        assert!(settled().contains(&("u8", 1, 1_000_006, 7, "halves")));
    }

    #[test]
    fn warmup_calls_alternate_and_are_not_timed() {
        let s = shape(1_000_004);
        let paths: Vec<_> = (0..2 * WARMUP).map(|_| choose(s)).collect();
        assert!(paths.iter().all(|(_, trial)| trial.is_none()));
        assert!(paths
            .chunks(2)
            .all(|c| c[0].0 == Path::Stream && c[1].0 == Path::Tile));
        assert!(choose(s).1.is_some(), "the call after the warm-up is timed");
    }
}
