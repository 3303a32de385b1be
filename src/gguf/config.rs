//! GGUF metadata → [`ModelConfig`].
//!
//! Keys are `{arch}.*` where `arch` is `general.architecture`: `llama`
//! (Llama 2/3, SmolLM2, Mistral converted as llama) or `qwen2`. Shapes the
//! metadata leaves implicit are read off the tensors: the vocabulary size
//! from `token_embd.weight`, tied embeddings from the absence of
//! `output.weight`, attention biases from `blk.0.attn_q.bias`.
//!
//! RoPE scaling: `rope.scaling.type` `linear` (or the older
//! `rope.scale_linear`) maps to [`RopeScaling::Linear`]. Llama 3.1-style
//! scaling is not metadata in GGUF but a `rope_freqs.weight` tensor of
//! per-frequency divisors; it is matched against Llama 3's formula (factor
//! taken from the tensor, `low/high_freq_factor` 1/4 and the original
//! context 8192 as llama.cpp's converter writes them) and accepted only if
//! every divisor agrees. Anything else (YaRN, partial rotary) is an error.

use super::{tensors, GgufError, GgufFile};
use crate::model::{Architecture, ModelConfig, RopeScaling};

/// Reads and checks the model configuration of `file`.
pub fn config_from_gguf(file: &GgufFile) -> Result<ModelConfig, GgufError> {
    let arch_name = file.str("general.architecture")?;
    let architecture = match arch_name {
        "llama" => Architecture::Llama,
        "qwen2" => Architecture::Qwen2,
        other => return Err(GgufError::UnsupportedArchitecture(other.to_string())),
    };
    let key = |k: &str| format!("{arch_name}.{k}");
    let positive = |k: &str| -> Result<usize, GgufError> {
        let k = key(k);
        match file.usize(&k)? {
            0 => Err(GgufError::bad_meta(&k, "must be positive")),
            v => Ok(v),
        }
    };
    let hidden_size = positive("embedding_length")?;
    let intermediate_size = positive("feed_forward_length")?;
    let num_layers = positive("block_count")?;
    let num_heads = positive("attention.head_count")?;
    let num_kv_heads = match file.opt_usize(&key("attention.head_count_kv"))? {
        None => num_heads,
        Some(0) => {
            return Err(GgufError::bad_meta(
                &key("attention.head_count_kv"),
                "must be positive",
            ))
        }
        Some(v) => v,
    };
    if num_heads % num_kv_heads != 0 {
        return Err(GgufError::bad_meta(
            &key("attention.head_count_kv"),
            format!("{num_kv_heads} does not divide head_count {num_heads}"),
        ));
    }
    let head_dim = match file.opt_usize(&key("attention.key_length"))? {
        Some(d) => d,
        None if hidden_size % num_heads == 0 => hidden_size / num_heads,
        None => {
            return Err(GgufError::bad_meta(
                &key("attention.head_count"),
                format!("{num_heads} does not divide embedding_length {hidden_size}"),
            ))
        }
    };
    if head_dim == 0 || head_dim % 2 != 0 {
        return Err(GgufError::bad_meta(
            &key("attention.key_length"),
            format!("head dimension {head_dim} must be positive and even"),
        ));
    }
    if let Some(v) = file.opt_usize(&key("attention.value_length"))? {
        if v != head_dim {
            return Err(GgufError::bad_meta(
                &key("attention.value_length"),
                format!("{v} differs from the key length {head_dim} (unsupported)"),
            ));
        }
    }
    if let Some(rot) = file.opt_usize(&key("rope.dimension_count"))? {
        if rot != head_dim {
            return Err(GgufError::bad_meta(
                &key("rope.dimension_count"),
                format!(
                    "partial rotary embeddings ({rot} of {head_dim} dimensions) are unsupported"
                ),
            ));
        }
    }
    let rms_norm_eps = file.f64(&key("attention.layer_norm_rms_epsilon"))?;
    if !(rms_norm_eps.is_finite() && rms_norm_eps > 0.0) {
        return Err(GgufError::bad_meta(
            &key("attention.layer_norm_rms_epsilon"),
            format!("{rms_norm_eps} is not positive"),
        ));
    }
    let rope_theta = file.opt_f64(&key("rope.freq_base"))?.unwrap_or(10_000.0);
    if !(rope_theta.is_finite() && rope_theta > 0.0) {
        return Err(GgufError::bad_meta(
            &key("rope.freq_base"),
            format!("{rope_theta} is not positive"),
        ));
    }
    let max_position_embeddings = file.opt_usize(&key("context_length"))?.unwrap_or(2048);

    let embed = file
        .tensor("token_embd.weight")
        .ok_or_else(|| GgufError::MissingTensor("token_embd.weight".into()))?;
    if embed.dims.len() != 2 || embed.dims[0] as usize != hidden_size {
        return Err(GgufError::bad_tensor(
            "token_embd.weight",
            format!(
                "dimensions {:?}, expected [{hidden_size}, vocab]",
                embed.dims
            ),
        ));
    }
    let vocab_size = embed.dims[1] as usize;
    let attention_bias = file.tensor("blk.0.attn_q.bias").is_some();

    let mut cfg = ModelConfig {
        architecture,
        vocab_size,
        hidden_size,
        intermediate_size,
        num_layers,
        num_heads,
        num_kv_heads,
        head_dim,
        rms_norm_eps,
        rope_theta,
        rope_scaling: RopeScaling::None,
        max_position_embeddings,
        tie_word_embeddings: file.tensor("output.weight").is_none(),
        attention_bias,
        sliding_window: None,
        bos_token_id: file
            .opt_usize("tokenizer.ggml.bos_token_id")?
            .map(|v| v as u32),
        eos_token_ids: file
            .opt_usize("tokenizer.ggml.eos_token_id")?
            .map(|v| v as u32)
            .into_iter()
            .collect(),
    };
    cfg.rope_scaling = rope_scaling(file, &key, &cfg)?;
    Ok(cfg)
}

fn rope_scaling(
    file: &GgufFile,
    key: &dyn Fn(&str) -> String,
    cfg: &ModelConfig,
) -> Result<RopeScaling, GgufError> {
    let ty_key = key("rope.scaling.type");
    let factor_key = key("rope.scaling.factor");
    let mut scaling = match file.opt_str(&ty_key)? {
        None | Some("none") => match file.opt_f64(&key("rope.scale_linear"))? {
            Some(f) if f != 1.0 => RopeScaling::Linear { factor: f },
            _ => RopeScaling::None,
        },
        Some("linear") => {
            let factor = file.f64(&factor_key)?;
            if !(factor.is_finite() && factor > 0.0) {
                return Err(GgufError::bad_meta(&factor_key, format!("{factor} is not positive")));
            }
            RopeScaling::Linear { factor }
        }
        Some(other) => {
            return Err(GgufError::bad_meta(
                &ty_key,
                format!("unsupported rope scaling `{other}` (supported: none, linear, and Llama 3's rope_freqs)"),
            ))
        }
    };
    if let Some(freqs) = file.tensor("rope_freqs.weight") {
        if scaling != RopeScaling::None {
            return Err(GgufError::bad_tensor(
                "rope_freqs.weight",
                "together with rope.scaling metadata (unsupported)",
            ));
        }
        let t = tensors::dequantize(file, freqs)?;
        let divisors: Vec<f32> = t
            .flatten_all()
            .and_then(|t| t.to_vec1())
            .map_err(|source| GgufError::Tensor {
                tensor: freqs.name.clone(),
                source,
            })?;
        scaling = llama3_from_freqs(cfg, &divisors)?;
    }
    Ok(scaling)
}

/// Matches llama.cpp's per-frequency divisors against Llama 3's scaling.
fn llama3_from_freqs(cfg: &ModelConfig, divisors: &[f32]) -> Result<RopeScaling, GgufError> {
    let name = "rope_freqs.weight";
    if divisors.len() != cfg.head_dim / 2 {
        return Err(GgufError::bad_tensor(
            name,
            format!(
                "{} divisors, expected head_dim/2 = {}",
                divisors.len(),
                cfg.head_dim / 2
            ),
        ));
    }
    let factor = divisors.iter().copied().fold(1.0f32, f32::max) as f64;
    let candidate = RopeScaling::Llama3 {
        factor,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192.0,
    };
    let plain = ModelConfig {
        rope_scaling: RopeScaling::None,
        ..cfg.clone()
    };
    let scaled = ModelConfig {
        rope_scaling: candidate,
        ..cfg.clone()
    };
    for ((base, got), div) in plain
        .rope_inv_freq()
        .iter()
        .zip(scaled.rope_inv_freq())
        .zip(divisors)
    {
        let expected = base / got;
        if ((expected - *div as f64) / expected).abs() > 1e-3 {
            return Err(GgufError::bad_tensor(
                name,
                format!("divisor {div} does not follow Llama 3's rope scaling (expected {expected:.4}); unsupported"),
            ));
        }
    }
    Ok(candidate)
}
