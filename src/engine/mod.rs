//! The engine: everything that touches tensors, driven one step at a time.
//!
//! # Layout
//! - [`protocol`]: the plain-data `StepPlan` / `StepOutcome` boundary.
//! - [`thread`]: the OS thread that owns an executor and runs plans.
//! - [`executor`]: [`Engine`], whose step reads as its phases: release →
//!   admit → plan → draft → forward → sample → verify → update.
//! - `sequences`: the slot registry (every per-sequence store, one admit
//!   and one idempotent release, the end-of-sequence rule).
//! - `work`: the plan phase (work items checked against their KV room).
//! - `rows`: the pure row layout (planned work → ragged batch + row map).
//! - `drafting`: the batched draft rounds.
//! - `masks`: the grammar masks of constrained rows, computed beside the
//!   forward pass.
//! - `update`: the verify and update phases of one sequence.
//! - [`spec`]: speculation rules: who drafts, and verification.
//! - `policy`: the one draft policy (how many drafts, from which drafter,
//!   by a cost model of the step).
//! - [`draft_heads`]: what drafts ([`DraftHead`], early exit, MTP head).
//! - [`ngram`]: prompt lookup, the drafter without weights.
//! - `errors`: [`EngineError`].

pub mod draft_heads;
mod drafting;
mod errors;
pub mod executor;
mod masks;
pub mod ngram;
mod policy;
pub mod protocol;
mod rows;
mod sequences;
pub mod spec;
pub mod thread;
mod update;
mod work;

pub use draft_heads::{DraftHead, DraftInput, EarlyExitDraft, HiddenContext, MtpDraft};
pub use errors::EngineError;
pub use executor::{Engine, EngineConfig};
pub use ngram::PromptLookup;
pub use protocol::*;
pub use spec::{Drafting, SpecConfig};
pub use thread::{EngineCommand, EngineThread};
