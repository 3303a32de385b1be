//! Test support for the scheduler: a deterministic fake engine and a
//! requester actor that records events.

#![allow(dead_code)] // each test binary uses a different subset

pub mod collector;
pub mod engine_driver;
pub mod fake_engine;
pub mod harness;
pub mod ragged;
pub mod reference;

#[allow(unused_imports)]
pub use collector::*;
#[allow(unused_imports)]
pub use fake_engine::*;
#[allow(unused_imports)]
pub use harness::*;
