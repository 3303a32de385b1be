//! Loading what the server serves: a model folder, a GGUF file or the
//! embedded model, on the requested device and dtype, wrapped in an
//! [`Engine`].
//!
//! Device and dtype are parsed before any weight is read, so that a build
//! without CUDA answers `--device cuda` at once with a clear error instead
//! of after a long load.

use std::path::PathBuf;
use std::str::FromStr;

use candle_core::{DType, Device};

use super::chat_template::{ChatTemplate, TemplateError};
use crate::engine::{Engine, EngineConfig};
use crate::model::{ActivationQuant, LoadOptions, Model, ModelError, WeightFormat};
use crate::tiny::{tiny_model, TinyError, TinyPreset};
use crate::tokenizer::{Tokenizer, TokenizerError};

/// Why the model could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// `--device` names a backend this build lacks, or the device is absent.
    #[error("--device {device}: {reason}")]
    Device { device: String, reason: String },
    /// `--dtype` is not one of f32, f16, bf16.
    #[error("--dtype {0}: expected auto, f32, f16, bf16, q8_0 or q4_k")]
    DType(String),
    /// `--kv-dtype` is not one of auto, f32, f16, bf16.
    #[error("--kv-dtype {0}: expected auto, f32, f16 or bf16")]
    KvDType(String),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(transparent)]
    Tiny(#[from] TinyError),
    #[error(transparent)]
    Gguf(#[from] crate::gguf::GgufError),
    #[error(transparent)]
    Template(#[from] TemplateError),
    /// `--mtp` names a draft head that cannot be built.
    #[error("--mtp: {0}")]
    Mtp(#[from] super::mtp::MtpError),
}

/// Compute device names accepted by `--device`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceKind {
    #[default]
    Cpu,
    Cuda,
    Metal,
}

impl FromStr for DeviceKind {
    type Err = LoadError;

    fn from_str(s: &str) -> Result<Self, LoadError> {
        match s {
            "cpu" => Ok(DeviceKind::Cpu),
            "cuda" => Ok(DeviceKind::Cuda),
            "metal" => Ok(DeviceKind::Metal),
            other => Err(LoadError::Device {
                device: other.into(),
                reason: "expected cpu, cuda or metal".into(),
            }),
        }
    }
}

impl DeviceKind {
    /// Opens the device (GPU 0 for CUDA and Metal). A backend missing from
    /// this build is an error that says which cargo feature brings it.
    pub fn open(self) -> Result<Device, LoadError> {
        let (name, feature, compiled) = match self {
            DeviceKind::Cpu => return Ok(Device::Cpu),
            DeviceKind::Cuda => ("cuda", "cuda", candle_core::utils::cuda_is_available()),
            DeviceKind::Metal => ("metal", "metal", candle_core::utils::metal_is_available()),
        };
        let err = |reason: String| LoadError::Device {
            device: name.into(),
            reason,
        };
        if !compiled {
            return Err(err(format!(
                "this build has no {name} support (rebuild with `--features {feature}`)"
            )));
        }
        let device = match self {
            DeviceKind::Cuda => Device::new_cuda(0),
            _ => Device::new_metal(0),
        };
        device.map_err(|e| err(e.to_string()))
    }
}

/// Parses `--dtype`: `auto` (f32 compute; weights a GGUF file stores in
/// quantised blocks stay in them on the CPU), a compute dtype (every
/// weight in it: a GGUF's blocks are dequantised at load), or a quantised
/// weight format (`q8_0`, `q4_k`: weights quantised at load, activations in
/// f32).
pub fn parse_dtype(s: &str) -> Result<(DType, WeightFormat), LoadError> {
    match s {
        "auto" => Ok((DType::F32, WeightFormat::AsStored)),
        "f32" => Ok((DType::F32, WeightFormat::AsCompute)),
        "f16" => Ok((DType::F16, WeightFormat::AsCompute)),
        "bf16" => Ok((DType::BF16, WeightFormat::AsCompute)),
        "q8_0" => Ok((DType::F32, WeightFormat::Q8_0)),
        "q4_k" => Ok((DType::F32, WeightFormat::Q4K)),
        other => Err(LoadError::DType(other.into())),
    }
}

/// Parses `--kv-dtype`: `auto` (`None`: f16 on the CPU, the compute dtype
/// elsewhere; see [`LoadOptions::kv_dtype`]), `f32`, `f16` or `bf16`.
pub fn parse_kv_dtype(s: &str) -> Result<Option<DType>, LoadError> {
    match s {
        "auto" => Ok(None),
        "f32" => Ok(Some(DType::F32)),
        "f16" => Ok(Some(DType::F16)),
        "bf16" => Ok(Some(DType::BF16)),
        other => Err(LoadError::KvDType(other.into())),
    }
}

/// Where the weights come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSource {
    /// A Hugging Face folder (config.json, safetensors, tokenizer.json), or
    /// a GGUF file (a path ending in `.gguf`, or any file): model,
    /// tokenizer and chat template all from the file.
    Dir(PathBuf),
    /// The embedded random-weight model.
    Embedded(TinyPreset),
}

/// Everything needed to build the engine.
#[derive(Debug, Clone)]
pub struct LoadSpec {
    pub source: ModelSource,
    pub dtype: DType,
    pub device: Device,
    /// KV pool size in tokens over all sequences.
    pub kv_tokens: usize,
    /// Tokens per KV block.
    pub kv_block_size: usize,
    /// Storage of the projection weights (`--dtype q8_0` / `q4_k` quantise at load).
    pub weight_format: WeightFormat,
    /// How the CPU quantises activations for quantised weights.
    pub activation_quant: ActivationQuant,
    /// KV cache dtype (`None`: the path's default, see
    /// [`LoadOptions::kv_dtype`]).
    pub kv_dtype: Option<DType>,
    /// Speculative decoding: the draft head, and the longest draft.
    pub mtp: super::mtp::MtpMode,
    pub draft_max: usize,
    /// Prompt-lookup (n-gram) drafts, beside the head or alone.
    pub prompt_lookup: bool,
}

/// A loaded engine with its tokenizer, chat template and name.
pub struct Loaded {
    pub engine: Engine,
    pub tokenizer: Tokenizer,
    pub template: ChatTemplate,
    pub model_name: String,
    /// The model's own name from its files (GGUF `general.name`, config
    /// `_name_or_path`), when they give one.
    pub root: Option<String>,
}

/// Loads the model (blocking: run it off the async executor).
pub fn load(spec: &LoadSpec) -> Result<Loaded, LoadError> {
    let opts = LoadOptions {
        dtype: spec.dtype,
        device: spec.device.clone(),
        weight_format: spec.weight_format,
        activation_quant: spec.activation_quant,
        kv_dtype: spec.kv_dtype,
        ..LoadOptions::default()
    };
    let mut root = None;
    let (model, tokenizer, model_name) = match &spec.source {
        ModelSource::Dir(path) if crate::gguf::is_gguf_path(path) => {
            let file = crate::gguf::GgufFile::open(path)?;
            root = file
                .opt_str("general.name")
                .ok()
                .flatten()
                .map(str::to_string);
            let tokenizer = Tokenizer::from_gguf(&file)?;
            let model = crate::gguf::load_model(&file, &opts)?;
            let name = path
                .file_stem()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| path.display().to_string());
            (model, tokenizer, name)
        }
        ModelSource::Dir(dir) => {
            root = std::fs::read_to_string(dir.join("config.json"))
                .ok()
                .and_then(|s| serde_json::from_str::<serde_json::Value>(&s).ok())
                .and_then(|c| c["_name_or_path"].as_str().map(str::to_string))
                .filter(|n| !n.is_empty());
            let tokenizer = Tokenizer::from_dir(dir)?;
            let model = Model::from_dir(dir, &opts)?;
            let name = dir
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| dir.display().to_string());
            (model, tokenizer, name)
        }
        ModelSource::Embedded(preset) => {
            let (model, tokenizer) = tiny_model(*preset, &opts)?;
            (model, tokenizer, preset.name().to_string())
        }
    };
    let template = ChatTemplate::from_tokenizer(&tokenizer)?;
    let head = spec.mtp.draft_head(&model)?;
    let engine = Engine::new(
        model,
        EngineConfig {
            kv_capacity_tokens: spec.kv_tokens,
            kv_block_size: spec.kv_block_size,
            model_name: model_name.clone(),
            eos_ids: tokenizer.eos_ids().to_vec(),
        },
    );
    let config = super::mtp::MtpMode::spec_config(spec.draft_max, spec.prompt_lookup);
    let engine = engine.with_drafters(head, config);
    Ok(Loaded {
        engine,
        tokenizer,
        template,
        model_name,
        root,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_parse_and_missing_backends_say_so() {
        assert_eq!(parse_dtype("bf16").unwrap().0, DType::BF16);
        assert_eq!(
            parse_dtype("q8_0").unwrap(),
            (DType::F32, WeightFormat::Q8_0)
        );
        assert!(parse_dtype("f64")
            .unwrap_err()
            .to_string()
            .contains("f32, f16, bf16, q8_0 or q4_k"));
        assert_eq!(parse_kv_dtype("auto").unwrap(), None);
        assert_eq!(parse_kv_dtype("f16").unwrap(), Some(DType::F16));
        let e = parse_kv_dtype("q8_0").unwrap_err().to_string();
        assert!(e.starts_with("--kv-dtype q8_0"), "{e}");
        assert!(matches!(
            "cpu".parse::<DeviceKind>().unwrap().open(),
            Ok(Device::Cpu)
        ));
        assert!("tpu".parse::<DeviceKind>().is_err());
        if !candle_core::utils::cuda_is_available() {
            let e = DeviceKind::Cuda.open().unwrap_err().to_string();
            assert!(e.contains("--features cuda"), "{e}");
        }
    }
}
