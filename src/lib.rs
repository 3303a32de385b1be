//! Tandem: an actor-based multi-sequence scheduler for LLM inference.
//!
//! Request actors (one per client request) register sequence slots with a
//! central scheduler actor. Every step the scheduler batches all active
//! sequences into one forward pass of the model and one sampler call on the
//! engine thread, and routes the resulting tokens back to each requester's
//! mailbox.
//!
//! ```no_run
//! use tandem::api::GenerateRequest;
//! use tandem::engine::{Engine, EngineConfig};
//! use tandem::scheduler::SchedulerConfig;
//! use tandem::tiny::{tiny_model_cpu, TinyPreset};
//! use tandem::TandemHandle;
//!
//! actix::System::new().block_on(async {
//!     let (model, tokenizer) = tiny_model_cpu(TinyPreset::Default).unwrap();
//!     let engine = Engine::new(model, EngineConfig { kv_capacity_tokens: 16_384, model_name: "tiny".into(), eos_ids: vec![], ..Default::default() });
//!     let tandem = TandemHandle::start(engine, tokenizer, SchedulerConfig::default()).unwrap();
//!     let done = tandem.complete(GenerateRequest::new("hello", 16)).await.unwrap();
//!     println!("{} ({:?})", done.text, done.finished.reason);
//! });
//! ```
//!
//! # Layout
//! - [`api`]: public request / event / error types.
//! - [`slot`]: [`SlotId`](slot::SlotId), the sequence identifier shared by
//!   the engine and the tensor code (a leaf: it imports nothing).
//! - [`handle`]: [`TandemHandle`], the cloneable async front door, and
//!   [`EventStream`](handle::EventStream).
//! - [`request`]: per-request actors (detokenizer, stop strings, sinks) and
//!   the [`Generate`](request::Generate) message for custom actors.
//! - [`scheduler`]: the scheduler actor: queue, admission, step planning,
//!   routing of token events.
//! - [`engine`]: the plain-data step protocol, the engine thread and the
//!   [`Engine`](engine::Engine) executor that owns every tensor.
//! - [`model`], [`kv`], [`sampler`]: the tensor code (candle).
//! - [`gguf`]: GGUF model files: reader, config, weights (dequantised).
//! - [`tokenizer`]: HF tokenizers, incremental detokenizer, stop matching.
//! - [`structured`]: constrained decoding (llguidance grammars: JSON
//!   schemas, Lark, regexes) and the token trie it needs.
//! - [`tiny`]: the embedded default model.
//! - `server` (cargo feature `server`, on by default): the OpenAI-compatible
//!   HTTP API (actix-web, minijinja chat templates) of the `tandem` binary.
//!
//! # Cargo features
//! - `server` (default): the HTTP server module, the `tandem` binary, and
//!   the examples and tests that use them. A service that embeds Tandem
//!   through [`TandemHandle`] or its own actors can build with
//!   `default-features = false` and leave actix-web, minijinja and the
//!   binary's command-line crates out of its tree.
//! - `cuda`, `metal`: candle's GPU backends.

pub mod api;
#[cfg(feature = "cuda")]
mod cuda_only;
pub mod engine;
pub mod gguf;
pub mod handle;
mod host_memory;
pub mod kv;
pub mod model;
pub mod request;
pub mod sampler;
pub mod scheduler;
#[cfg(feature = "server")]
pub mod server;
pub mod structured;
#[doc(hidden)]
pub mod testing;
pub mod tiny;
pub mod tokenizer;
pub mod train;

// The leaf every layer shares (engine and tensor code alike).
pub mod slot;

pub use handle::TandemHandle;
