//! Tandem: an actor-based multi-sequence scheduler for LLM inference.

pub mod engine;
pub mod sampler;
pub mod scheduler;
