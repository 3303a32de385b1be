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
//!     let engine = Engine::new(model, EngineConfig { kv_capacity_tokens: 16_384, model_name: "tiny".into(), eos_ids: vec![] });
//!     let tandem = TandemHandle::start(engine, tokenizer, SchedulerConfig::default()).unwrap();
//!     let done = tandem.complete(GenerateRequest::new("hello", 16)).await.unwrap();
//!     println!("{} ({:?})", done.text, done.finished.reason);
//! });
//! ```
//!
//! # Layout
//! - [`api`]: public request / event / error types.
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
//! - [`tiny`]: the embedded default model.
//! - [`server`]: the OpenAI-compatible HTTP API (actix-web) of the `tandem`
//!   binary.

pub mod api;
pub mod engine;
pub mod gguf;
pub mod handle;
pub mod kv;
pub mod model;
pub mod request;
pub mod sampler;
pub mod scheduler;
pub mod server;
pub mod tiny;
pub mod tokenizer;
pub mod train;

pub use handle::TandemHandle;
