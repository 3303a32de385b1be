//! [`Model::from_gguf`]: a model from one GGUF file.
//!
//! NOTE: every weight is dequantised at load to f32 and handed to
//! [`Model::load`] as in-memory tensors, which converts them to the compute
//! dtype (or re-quantises them for `WeightFormat::Q8_0`/`Q4K`). No backend
//! multiplies GGUF blocks directly yet, so a Q4_1 file takes the memory of
//! its f32 (or f16) weights once loaded. Keeping the file's blocks on the
//! lean CPU path is a later step.
//!
//! Measured (release, `examples/gguf_info --load`, SmolLM2-135M Q4_1,
//! 98 MB, on a shared 2-core machine): parsing the memory-mapped file
//! 31–115 ms; dequantising every weight to f32 (both cores) 0.39–0.9 s;
//! the whole `load_model` 0.43 s when the machine was quiet, 1.1–1.9 s
//! with other builds running (load average 4.3); the tokenizer 0.18–0.37 s.

use std::path::Path;
use std::time::Instant;

use super::{config_from_gguf, tensors, GgufError, GgufFile};
use crate::model::{LoadOptions, Model};

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
    let (weights, types) = tensors::hf_weights(file, &cfg)?;
    let dequantised = t0.elapsed();
    let mut types: Vec<_> = types.into_iter().collect();
    types.sort();
    tracing::info!(
        path = %file.path.display(),
        types = ?types,
        compute_dtype = ?opts.dtype,
        elapsed = ?dequantised,
        "GGUF weights dequantised at load to the compute dtype (no kernel for GGUF blocks on this backend)"
    );
    Ok(Model::load(cfg, &weights, opts)?)
}
