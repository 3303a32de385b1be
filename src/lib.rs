//! Tandem: an actor-based multi-sequence scheduler for LLM inference.

pub mod engine;
pub mod kv;
pub mod model;
pub mod sampler;
pub mod tiny;
pub mod tokenizer;
