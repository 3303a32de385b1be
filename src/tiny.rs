//! The embedded default model: a deterministic Llama with seeded random
//! weights and a word-level vocabulary built in code, so the examples, the
//! server and the tests run on a fresh machine with nothing downloaded.
//!
//! Its output is random words (the weights are untrained), but it exercises
//! every part of the stack with real shapes. Two presets:
//!
//! | preset | vocab | hidden | layers | heads / KV heads | MLP | context | parameters |
//! | --- | --- | --- | --- | --- | --- | --- | --- |
//! | [`TinyPreset::Default`] | 8 192 | 512 | 8 | 8 / 4 | 1 408 | 4 096 | ≈ 32 M |
//! | [`TinyPreset::Test`] | 512 | 64 | 2 | 4 / 2 | 128 | 1 024 | ≈ 0.14 M |
//!
//! The default is big enough that batching measurably pays on a CPU (its
//! weights, 128 MB in f32, are read once per step however many sequences
//! share it). The unembedding is drawn wider than the other projections so
//! logits are well separated: greedy decoding of a random model then never
//! sits on a near-tie, and batched == solo comparisons stay exact.

use candle_core::DType;

use crate::model::{LoadOptions, Model, ModelConfig, ModelError, Weights};
use crate::tokenizer::{word_level_tokenizer, Tokenizer, TokenizerError};

/// Which embedded model to build.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TinyPreset {
    /// ≈ 32 M parameters: the load example's and the server's default.
    #[default]
    Default,
    /// ≈ 0.14 M parameters: fast enough for unit tests.
    Test,
}

impl TinyPreset {
    /// The model's `config.json` equivalent.
    pub fn config(self) -> ModelConfig {
        let (vocab, hidden, layers, heads, kv_heads, mlp, ctx) = match self {
            TinyPreset::Default => (8192, 512, 8, 8, 4, 1408, 4096),
            TinyPreset::Test => (512, 64, 2, 4, 2, 128, 1024),
        };
        let json = serde_json::json!({
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": mlp,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "max_position_embeddings": ctx, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "tie_word_embeddings": false, "bos_token_id": 1, "eos_token_id": 2,
        });
        ModelConfig::from_json(&json.to_string())
            .expect("the embedded config is valid; this is a bug")
    }

    /// Name reported to clients.
    pub fn name(self) -> &'static str {
        match self {
            TinyPreset::Default => "tandem-tiny",
            TinyPreset::Test => "tandem-tiny-test",
        }
    }
}

/// Errors building the embedded model.
#[derive(Debug, thiserror::Error)]
pub enum TinyError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
}

/// Seed of the embedded weights and vocabulary: the same everywhere.
pub const TINY_SEED: u64 = 0x7a4d_e15e;

/// The preset's random weights (deterministic).
pub fn tiny_weights(preset: TinyPreset) -> Result<Weights, ModelError> {
    let cfg = preset.config();
    let lm_head_std = 3.0 / (cfg.hidden_size as f32).sqrt();
    Weights::random(&cfg, TINY_SEED, lm_head_std)
}

/// Builds the embedded model and its tokenizer.
pub fn tiny_model(preset: TinyPreset, opts: &LoadOptions) -> Result<(Model, Tokenizer), TinyError> {
    let cfg = preset.config();
    let tokenizer = word_level_tokenizer(cfg.vocab_size, TINY_SEED)?;
    let model = Model::load(cfg, &tiny_weights(preset)?, opts)?;
    Ok((model, tokenizer))
}

/// `tiny_model` with f32 on the CPU.
pub fn tiny_model_cpu(preset: TinyPreset) -> Result<(Model, Tokenizer), TinyError> {
    tiny_model(
        preset,
        &LoadOptions {
            dtype: DType::F32,
            device: candle_core::Device::Cpu,
            ..LoadOptions::default()
        },
    )
}
