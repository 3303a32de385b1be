//! Which path a projection of a few activation rows takes in the f32/f16
//! linear (`dot`): the weight rows of a group streamed one after another,
//! or the register tile that interleaves them. Both give the same sums bit
//! for bit, so the choice is speed alone, and it differs by CPU: on an AMD
//! EPYC (Zen 4) host streaming ran one row 1.3–1.5× faster in f32 and
//! 1.5–1.7× in f16; on a Sapphire-Rapids-class Xeon the tile ran one to
//! four rows 1.1–1.4× faster in f32 and 1.5–1.7× in f16 (BENCHMARKS.md,
//! sessions 21 and 28). No rule by ISA or vendor covers both, so the path
//! is measured, per projection shape, on the calls the engine makes anyway
//! (as cuDNN's benchmark mode picks a convolution algorithm on its first
//! calls).
//!
//! # How a shape is settled
//! The calls of one shape `(ISA tier, weight element, rows, n, k)` take the
//! two paths in turn. After [`WARMUP`] calls of each (first touches of
//! freshly loaded weights, cold caches) the next [`SAMPLES`] of each are
//! timed, and the path with the lower median time is kept for the rest of
//! the process; after [`MIN_SAMPLES`] of each, a path whose median is
//! [`CLEAR_GAP`] times the other's loses at once. A decode pass makes one
//! call of each shape per layer, so a 30-layer model settles its per-layer
//! shapes within three passes. Calls
//! of the same shape read different layers' weights of the same size, so
//! both paths see the same work; alternating call by call puts a shared
//! host's noise on both alike.
//!
//! `TANDEM_CPU_FEW_ROWS=stream|tile` fixes the path instead (benchmarks
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
/// A median this many times the other's is a clear loss (the paths
/// differ by 1.1–1.7× on the hosts measured; a shape of one call a
/// pass, the unembedding, would otherwise spend 80 passes settling).
const CLEAR_GAP: f64 = 1.25;

/// A few-row call's path through the linear.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Path {
    /// Each group's weight rows one after another: one linear stream.
    Stream,
    /// The register tile: a group's weight rows interleaved.
    Tile,
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
    calls: [usize; 2],
    nanos: [Vec<u64>; 2],
    settled: Option<Path>,
}

fn index(path: Path) -> usize {
    match path {
        Path::Stream => 0,
        Path::Tile => 1,
    }
}

/// The path `TANDEM_CPU_FEW_ROWS` fixes, if any (read once).
fn fixed() -> Option<Path> {
    static FIXED: OnceLock<Option<Path>> = OnceLock::new();
    *FIXED.get_or_init(
        || match std::env::var("TANDEM_CPU_FEW_ROWS").ok().as_deref() {
            Some("stream") => Some(Path::Stream),
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
    let path = if tuning.calls[0] <= tuning.calls[1] {
        Path::Stream
    } else {
        Path::Tile
    };
    tuning.calls[index(path)] += 1;
    let timed = tuning.calls[index(path)] > WARMUP;
    (path, timed.then_some(Trial { shape, path }))
}

/// Records a timed call; settles the shape once both paths have
/// [`SAMPLES`] times, or [`MIN_SAMPLES`] with one median [`CLEAR_GAP`]
/// times the other.
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
    let fewest = tuning.nanos.iter().map(Vec::len).min().unwrap_or(0);
    if fewest < MIN_SAMPLES {
        return;
    }
    let [stream, tile] = tuning.nanos.each_ref().map(|n| median(n));
    let clear = stream.max(tile) as f64 >= CLEAR_GAP * stream.min(tile) as f64;
    if fewest == SAMPLES || clear {
        let path = if stream <= tile {
            Path::Stream
        } else {
            Path::Tile
        };
        tuning.settled = Some(path);
        tracing::debug!(
            shape = ?trial.shape,
            stream_us = stream as f64 / 1e3,
            tile_us = tile as f64 / 1e3,
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
        .filter_map(|(s, t)| {
            let path = match t.settled? {
                Path::Stream => "stream",
                Path::Tile => "tile",
            };
            Some((s.elem, s.rows, s.n, s.k, path))
        })
        .collect();
    out.sort_unstable();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

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
                None if call > 2 * WARMUP => return (path, call),
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
            }
        });
        assert_eq!(path, Path::Tile);
        assert!(settled().contains(&("u8", 1, 1_000_001, 7, "tile")));
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
