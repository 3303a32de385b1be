//! The one identifier every layer of the engine shares.
//!
//! A leaf module on purpose: the tensor code (`model`, `kv`, `sampler`)
//! names sequences by slot without importing the engine that assigns them,
//! so the engine depends on the tensor code and never the other way round.

/// Identifies a sequence inside the engine: its sampler row, its KV cache
/// and the routing of its tokens back to the requester.
pub type SlotId = u32;
