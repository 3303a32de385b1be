//! [`Model::from_gguf`]: a model from one GGUF file.
//!
//! With [`WeightFormat::AsStored`] on the CPU, weight matrices stored in
//! GGML blocks stay in them (candle's quantized kernels multiply them, with
//! activations quantised to 8 bits as llama.cpp does); norms, biases and the
//! embedding lookup are dequantised to the compute dtype. Otherwise every
//! weight is dequantised to f32 and handed to [`Model::load`], which
//! converts it to the compute dtype (or re-quantises it for
//! `WeightFormat::Q8_0`/`Q4K`).
//!
//! Measured (release, `examples/gguf_info --load`, SmolLM2-135M Q4_1,
//! 98 MB, on a shared 2-core machine): parsing the memory-mapped file
//! 31–115 ms; dequantising every weight to f32 (both cores) 0.39–0.9 s;
//! the whole `load_model` 0.43 s when the machine was quiet, 1.1–1.9 s
//! with other builds running (load average 4.3); the tokenizer 0.18–0.37 s.

use std::path::Path;
use std::time::Instant;

use super::{config_from_gguf, tensors, GgufError, GgufFile};
use crate::model::{LoadOptions, Model, WeightFormat};

impl Model {
    /// Loads a model from a GGUF file (memory-mapped): configuration from
    /// the metadata, weights dequantised to the compute dtype.
    pub fn from_gguf(path: &Path, opts: &LoadOptions) -> Result<Model, GgufError> {
        let file = GgufFile::open(path)?;
        load_model(&file, opts)
    }
}

/// Builds the model of an opened GGUF file.
pub fn load_model(file: &GgufFile, opts: &LoadOptions) -> Result<Model, GgufError> {
    let t0 = Instant::now();
    let cfg = config_from_gguf(file)?;
    // The CPU multiplies GGML blocks (candle's quantized kernels); other
    // backends get the weights dequantised to the compute dtype.
    let keep = if opts.weight_format == WeightFormat::AsStored && opts.device.is_cpu() {
        tensors::Blocks::Keep
    } else {
        tensors::Blocks::Dequantise
    };
    let (weights, types) = tensors::hf_weights(file, &cfg, keep)?;
    let read = t0.elapsed();
    let mut types: Vec<_> = types.into_iter().collect();
    types.sort();
    match keep {
        tensors::Blocks::Keep => tracing::info!(
            path = %file.path.display(),
            types = ?types,
            elapsed = ?read,
            "GGUF weight matrices kept in their GGML blocks (CPU); the rest in the compute dtype"
        ),
        tensors::Blocks::Dequantise => tracing::info!(
            path = %file.path.display(),
            types = ?types,
            compute_dtype = ?opts.dtype,
            elapsed = ?read,
            "GGUF weights dequantised at load to the compute dtype"
        ),
    }
    Ok(Model::load(cfg, &weights, opts)?)
}
