//! Test support shared by the unit tests (`src/**`) and the integration
//! tests (`tests/`): where the reference files are, and what a test does
//! when they are absent. Not part of the library's API (hidden from the
//! docs); it lives here only because both kinds of test can reach it.
//!
//! Reference tests compare Tandem against files outside the repository (real
//! checkpoints and their outputs from trusted implementations), found in
//! `../shared` beside the crate, or in `$TANDEM_SHARED_DIR`. On a machine
//! without them a test prints a `SKIP:` line and passes; with
//! `TANDEM_REQUIRE_REFERENCES=1` (CI sets it whenever it has the files) the
//! same absence fails the test, so CI cannot go green by skipping.
//!
//! Every skip goes through [`skip`], which also appends the line to
//! `$TANDEM_SKIP_LOG` when that is set, so a runner can list what skipped
//! after the whole suite (the test harness captures the `SKIP:` lines of
//! passing tests).

use std::io::Write;
use std::path::PathBuf;

/// Overrides where the reference files are (default: `../shared` beside
/// the crate).
pub const SHARED_DIR_VAR: &str = "TANDEM_SHARED_DIR";
/// `1`: an absent reference fails its test instead of skipping it.
pub const REQUIRE_REFERENCES_VAR: &str = "TANDEM_REQUIRE_REFERENCES";
/// A file that every skip is appended to, one `SKIP:` line each.
pub const SKIP_LOG_VAR: &str = "TANDEM_SKIP_LOG";

/// The folder of reference files: `$TANDEM_SHARED_DIR`, else `../shared`
/// beside the crate. It may not exist.
pub fn shared_root() -> PathBuf {
    match std::env::var_os(SHARED_DIR_VAR) {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir),
        _ => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared"),
    }
}

/// `rel` under [`shared_root`] when it exists. When it does not, the test
/// cannot run: `None` after a `SKIP:` line, or a panic when references are
/// required (see [`skip`]).
#[track_caller]
pub fn shared(rel: &str) -> Option<PathBuf> {
    let path = shared_root().join(rel);
    if path.exists() {
        Some(path)
    } else {
        let why = format!(
            "{} is absent (reference files are read from ${SHARED_DIR_VAR}, else ../shared beside the crate)",
            path.display()
        );
        skip(REQUIRE_REFERENCES_VAR, &why);
        None
    }
}

/// A test cannot run because of `why`. Prints `SKIP: {why}` (and logs it to
/// `$TANDEM_SKIP_LOG`) so the caller can return, or panics when the
/// environment variable `required_by` is `1`: then the missing piece was
/// promised, and skipping would hide a failure.
#[track_caller]
pub fn skip(required_by: &str, why: &str) {
    if std::env::var(required_by).is_ok_and(|v| v == "1") {
        panic!("{why}, and {required_by}=1 makes that a failure instead of a skip");
    }
    let line = format!("SKIP: {why}");
    eprintln!("{line}");
    if let Some(log) = std::env::var_os(SKIP_LOG_VAR).filter(|l| !l.is_empty()) {
        // Best effort: a log that cannot be written must not fail the test.
        if let Ok(mut file) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
        {
            let _ = writeln!(file, "{line}");
        }
    }
}
