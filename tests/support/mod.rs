//! Test support for the scheduler: a deterministic fake engine and a
//! requester actor that records events.

#![allow(dead_code)] // each test binary uses a different subset

pub mod collector;
pub mod fake_engine;
pub mod harness;

pub use collector::*;
pub use fake_engine::*;
pub use harness::*;
