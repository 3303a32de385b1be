//! `config.json` of a Hugging Face Llama-family checkpoint, parsed and
//! checked into a [`ModelConfig`] with every default resolved.
//!
//! Both transformers 4 (`rope_theta` + `rope_scaling`) and transformers 5
//! (`rope_parameters`) spellings load. Anything Tandem cannot run exactly
//! (an unknown architecture, an unsupported RoPE type) is an error here,
//! before any weight is read.

use std::path::Path;

use serde::Deserialize;

use super::ModelError;

/// The decoder families Tandem runs. They share one implementation; the
/// differences are data (biases, sliding window), not code paths.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    /// `LlamaForCausalLM`: Llama 2/3 (and the many models that reuse it).
    Llama,
    /// `MistralForCausalLM`: Llama with an optional sliding window.
    Mistral,
    /// `Qwen2ForCausalLM`: Llama with biases on the q/k/v projections.
    Qwen2,
}

impl Architecture {
    fn from_hf(name: &str) -> Option<Self> {
        match name {
            "LlamaForCausalLM" => Some(Self::Llama),
            "MistralForCausalLM" => Some(Self::Mistral),
            "Qwen2ForCausalLM" => Some(Self::Qwen2),
            _ => None,
        }
    }
}

/// How rotary frequencies are derived from `rope_theta`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE.
    None,
    /// Positions divided by `factor` (`rope_type: "linear"`).
    Linear { factor: f64 },
    /// Llama 3.1's frequency-dependent scaling (`rope_type: "llama3"`).
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
}

/// A resolved model configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    /// Longest sequence the model was trained for; the engine's context.
    pub max_position_embeddings: usize,
    /// `lm_head` shares the embedding matrix.
    pub tie_word_embeddings: bool,
    /// q/k/v projections carry biases (Qwen2, or `attention_bias: true`).
    pub attention_bias: bool,
    /// Mistral's sliding attention window, when it is smaller than the context.
    pub sliding_window: Option<usize>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

/// `eos_token_id` is an int or a list of ints.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(u32),
    Many(Vec<u32>),
}

impl OneOrMany {
    fn into_vec(self) -> Vec<u32> {
        match self {
            OneOrMany::One(x) => vec![x],
            OneOrMany::Many(v) => v,
        }
    }
}

#[derive(Debug, Deserialize)]
struct RawRope {
    #[serde(alias = "type")]
    rope_type: Option<String>,
    rope_theta: Option<f64>,
    factor: Option<f64>,
    low_freq_factor: Option<f64>,
    high_freq_factor: Option<f64>,
    original_max_position_embeddings: Option<f64>,
}

#[derive(Debug, Deserialize)]
struct RawConfig {
    architectures: Option<Vec<String>>,
    model_type: Option<String>,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_scaling: Option<RawRope>,
    rope_parameters: Option<RawRope>,
    max_position_embeddings: Option<usize>,
    tie_word_embeddings: Option<bool>,
    attention_bias: Option<bool>,
    sliding_window: Option<usize>,
    use_sliding_window: Option<bool>,
    hidden_act: Option<String>,
    bos_token_id: Option<u32>,
    eos_token_id: Option<OneOrMany>,
}

/// A config error (the caller adds the path).
fn bad(reason: String) -> ModelError {
    ModelError::Config {
        path: Default::default(),
        reason,
    }
}

/// `v`, or an error naming `field` when it is 0.
fn positive(field: &str, v: usize) -> Result<usize, ModelError> {
    if v == 0 {
        Err(bad(format!("`{field}` must be positive")))
    } else {
        Ok(v)
    }
}

/// The checked sizes of a config.
struct Sizes {
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_layers: usize,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
}

impl RawConfig {
    /// The architecture, from `architectures` or else `model_type`; only
    /// the SiLU activation is supported.
    fn architecture(&self) -> Result<Architecture, ModelError> {
        let arch_name = self
            .architectures
            .as_ref()
            .and_then(|a| a.first().cloned())
            .or_else(|| {
                self.model_type.as_deref().map(|t| match t {
                    "llama" => "LlamaForCausalLM".to_string(),
                    "mistral" => "MistralForCausalLM".to_string(),
                    "qwen2" => "Qwen2ForCausalLM".to_string(),
                    other => other.to_string(),
                })
            })
            .ok_or_else(|| bad("no `architectures` or `model_type`".into()))?;
        let architecture = Architecture::from_hf(&arch_name)
            .ok_or_else(|| ModelError::UnsupportedArchitecture(arch_name.clone()))?;
        if let Some(act) = self.hidden_act.as_deref() {
            if act != "silu" {
                return Err(bad(format!("unsupported hidden_act `{act}` (only `silu`)")));
            }
        }
        Ok(architecture)
    }

    /// Sizes, all positive, with heads that divide evenly and an even
    /// head dimension (RoPE pairs dimensions).
    fn sizes(&self) -> Result<Sizes, ModelError> {
        let vocab_size = positive("vocab_size", self.vocab_size)?;
        let hidden_size = positive("hidden_size", self.hidden_size)?;
        let intermediate_size = positive("intermediate_size", self.intermediate_size)?;
        let num_layers = positive("num_hidden_layers", self.num_hidden_layers)?;
        let num_heads = positive("num_attention_heads", self.num_attention_heads)?;
        let num_kv_heads = positive(
            "num_key_value_heads",
            self.num_key_value_heads.unwrap_or(num_heads),
        )?;
        if num_heads % num_kv_heads != 0 {
            return Err(bad(format!("num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}")));
        }
        let head_dim = match self.head_dim {
            Some(d) => positive("head_dim", d)?,
            None if hidden_size % num_heads == 0 => hidden_size / num_heads,
            None => {
                return Err(bad(format!(
                "hidden_size {hidden_size} is not a multiple of num_attention_heads {num_heads}"
            )))
            }
        };
        if head_dim % 2 != 0 {
            return Err(bad(format!("head_dim {head_dim} must be even for RoPE")));
        }
        Ok(Sizes {
            vocab_size,
            hidden_size,
            intermediate_size,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
        })
    }

    /// `rope_theta` (positive) and the scaling.
    fn rope(&self) -> Result<(f64, RopeScaling), ModelError> {
        // transformers 5 moved theta and scaling into `rope_parameters`.
        let rope = self.rope_parameters.as_ref().or(self.rope_scaling.as_ref());
        let rope_theta = rope
            .and_then(|r| r.rope_theta)
            .or(self.rope_theta)
            .unwrap_or(10_000.0);
        let rope_scaling = match rope {
            None => RopeScaling::None,
            Some(r) => r.scaling()?,
        };
        if !(rope_theta.is_finite() && rope_theta > 0.0) {
            return Err(bad(format!(
                "rope_theta must be positive, got {rope_theta}"
            )));
        }
        Ok((rope_theta, rope_scaling))
    }
}

impl RawRope {
    /// The scaling this `rope_type` (default, linear, llama3) describes.
    fn scaling(&self) -> Result<RopeScaling, ModelError> {
        Ok(match self.rope_type.as_deref().unwrap_or("default") {
            "default" => RopeScaling::None,
            "linear" => RopeScaling::Linear {
                factor: self
                    .factor
                    .ok_or_else(|| bad("linear rope scaling without `factor`".into()))?,
            },
            "llama3" => {
                let need = |name: &str, v: Option<f64>| {
                    v.ok_or_else(|| bad(format!("llama3 rope scaling without `{name}`")))
                };
                RopeScaling::Llama3 {
                    factor: need("factor", self.factor)?,
                    low_freq_factor: need("low_freq_factor", self.low_freq_factor)?,
                    high_freq_factor: need("high_freq_factor", self.high_freq_factor)?,
                    original_max_position_embeddings: need(
                        "original_max_position_embeddings",
                        self.original_max_position_embeddings,
                    )?,
                }
            }
            other => {
                return Err(bad(format!(
                    "unsupported rope type `{other}` (supported: default, linear, llama3)"
                )))
            }
        })
    }
}

impl ModelConfig {
    /// Reads and checks `dir/config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self, ModelError> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| ModelError::Io {
            path: path.clone(),
            source: e,
        })?;
        Self::from_json(&text).map_err(|e| match e {
            ModelError::Config { reason, .. } => ModelError::Config {
                path: path.clone(),
                reason,
            },
            other => other,
        })
    }

    /// Parses a `config.json` text (errors carry an empty path).
    pub fn from_json(text: &str) -> Result<Self, ModelError> {
        let raw: RawConfig =
            serde_json::from_str(text).map_err(|e| bad(format!("invalid JSON: {e}")))?;
        let architecture = raw.architecture()?;
        let sizes = raw.sizes()?;
        let (rope_theta, rope_scaling) = raw.rope()?;
        let max_position_embeddings = raw.max_position_embeddings.unwrap_or(2048);
        let sliding_window = match architecture {
            Architecture::Mistral => raw.sliding_window.filter(|&w| w < max_position_embeddings),
            Architecture::Qwen2 if raw.use_sliding_window == Some(true) => {
                raw.sliding_window.filter(|&w| w < max_position_embeddings)
            }
            _ => None,
        };
        let attention_bias = raw
            .attention_bias
            .unwrap_or(architecture == Architecture::Qwen2);

        Ok(Self {
            architecture,
            vocab_size: sizes.vocab_size,
            hidden_size: sizes.hidden_size,
            intermediate_size: sizes.intermediate_size,
            num_layers: sizes.num_layers,
            num_heads: sizes.num_heads,
            num_kv_heads: sizes.num_kv_heads,
            head_dim: sizes.head_dim,
            rms_norm_eps: raw.rms_norm_eps.unwrap_or(1e-6),
            rope_theta,
            rope_scaling,
            max_position_embeddings,
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            attention_bias,
            sliding_window,
            bos_token_id: raw.bos_token_id,
            eos_token_ids: raw
                .eos_token_id
                .map(OneOrMany::into_vec)
                .unwrap_or_default(),
        })
    }

    /// Attention heads that share one KV head.
    pub fn group_size(&self) -> usize {
        self.num_heads / self.num_kv_heads
    }

    /// Parameter count (embeddings included once when tied).
    pub fn num_parameters(&self) -> usize {
        let (h, i, hd) = (self.hidden_size, self.intermediate_size, self.head_dim);
        let attn = h * self.num_heads * hd * 2 + h * self.num_kv_heads * hd * 2;
        let bias = if self.attention_bias {
            (self.num_heads + 2 * self.num_kv_heads) * hd
        } else {
            0
        };
        let layer = attn + bias + 3 * h * i + 2 * h;
        let emb = self.vocab_size * h * if self.tie_word_embeddings { 1 } else { 2 };
        emb + self.num_layers * layer + h
    }

    /// Inverse rotary frequencies, one per pair of head dimensions.
    pub fn rope_inv_freq(&self) -> Vec<f64> {
        let d = self.head_dim;
        let base: Vec<f64> = (0..d / 2)
            .map(|i| 1.0 / self.rope_theta.powf(2.0 * i as f64 / d as f64))
            .collect();
        match self.rope_scaling {
            RopeScaling::None => base,
            RopeScaling::Linear { factor } => base.into_iter().map(|f| f / factor).collect(),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: old,
            } => {
                let low_wavelen = old / low_freq_factor;
                let high_wavelen = old / high_freq_factor;
                base.into_iter()
                    .map(|f| {
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        if wavelen < high_wavelen {
                            f
                        } else if wavelen > low_wavelen {
                            f / factor
                        } else {
                            let smooth = (old / wavelen - low_freq_factor)
                                / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect()
            }
        }
    }
}
