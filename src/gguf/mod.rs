//! GGUF files (llama.cpp's single-file model format): a bounds-checked
//! reader over a memory map, the model configuration and weights it holds,
//! and the errors of both.
//!
//! A GGUF file is a header (magic `GGUF`, version, tensor and key counts),
//! typed metadata key/value pairs, tensor infos (name, dimensions innermost
//! first, GGML type, offset), then the aligned tensor data. Every length,
//! count and offset read from the file is checked against the bytes that
//! are actually there before anything is allocated or sliced, so a
//! truncated or corrupt file is a [`GgufError`] naming the key, tensor or
//! offset, never a panic or a huge allocation.
//!
//! # Layout
//! - [`value`]: metadata values ([`Value`]) and their typed accessors.
//! - [`reader`]: [`GgufFile`]: parse and validate a file (memory-mapped) or
//!   a byte buffer; look up metadata and tensor bytes.
//! - [`config`]: metadata → [`ModelConfig`](crate::model::ModelConfig)
//!   (`llama`, `qwen2`).
//! - [`tensors`]: GGUF tensor names → Hugging Face names, dequantisation to
//!   f32 (candle's GGML block code), llama.cpp's q/k row permutation undone.
//! - [`load`]: the loader behind
//!   [`Model::from_gguf`](crate::model::Model::from_gguf).
//! - [`writer`]: a small GGUF writer, for tests and tools.
//!
//! The tokenizer stored in the metadata is built by
//! [`Tokenizer::from_gguf`](crate::tokenizer::Tokenizer::from_gguf).

pub mod config;
pub mod load;
pub mod reader;
pub mod tensors;
pub mod value;
pub mod writer;

#[cfg(test)]
mod tests;

use std::path::PathBuf;

pub use config::config_from_gguf;
pub use load::load_model;
pub use reader::{GgmlType, GgufFile, TensorInfo};
pub use value::{Value, ValueType};

/// Why a GGUF file cannot be read or used. Messages name the key, tensor or
/// byte offset involved.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The first four bytes are not `GGUF`.
    #[error("not a GGUF file: magic is {found:02x?}, expected \"GGUF\"")]
    BadMagic { found: Vec<u8> },
    #[error("unsupported GGUF version {version} (supported: 2 and 3, little-endian){hint}")]
    UnsupportedVersion { version: u32, hint: &'static str },
    /// The file ends before a structure it announces.
    #[error(
        "truncated file: {what} needs {need} bytes at offset {offset}, but the file has {len}"
    )]
    Truncated {
        what: String,
        offset: u64,
        need: u64,
        len: u64,
    },
    /// A count or length is beyond what the file could hold or Tandem accepts.
    #[error("{what} is {value}, over the limit of {limit}")]
    Limit {
        what: String,
        value: u64,
        limit: u64,
    },
    #[error("metadata `{key}`: unknown value type {type_id} at offset {offset}")]
    BadValueType {
        key: String,
        type_id: u32,
        offset: u64,
    },
    #[error("{what} at offset {offset} is not valid UTF-8")]
    InvalidUtf8 { what: String, offset: u64 },
    #[error("metadata key `{0}` appears twice")]
    DuplicateKey(String),
    #[error("tensor `{0}` appears twice")]
    DuplicateTensor(String),
    /// A GGML type id this reader does not know at all.
    #[error("tensor `{tensor}`: unknown GGML type {type_id}")]
    UnknownTensorType { tensor: String, type_id: u32 },
    /// A known GGML type that Tandem cannot dequantise.
    #[error("tensor `{tensor}`: unsupported tensor type {type_name} (supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K)")]
    UnsupportedTensorType {
        tensor: String,
        type_name: &'static str,
    },
    /// A tensor info that does not describe valid data in this file.
    #[error("tensor `{tensor}`: {reason}")]
    BadTensor { tensor: String, reason: String },
    #[error("missing metadata key `{0}`")]
    MissingKey(String),
    #[error("metadata `{key}`: expected {expected}, found {found}")]
    WrongType {
        key: String,
        expected: &'static str,
        found: String,
    },
    /// A metadata value of the right type but an unusable value.
    #[error("metadata `{key}`: {reason}")]
    BadMetadata { key: String, reason: String },
    #[error("unsupported architecture `{0}` in `general.architecture` (supported: llama, qwen2)")]
    UnsupportedArchitecture(String),
    #[error("missing tensor `{0}`")]
    MissingTensor(String),
    /// Building the model from the file's weights failed.
    #[error(transparent)]
    Model(#[from] crate::model::ModelError),
    /// The tokenizer built from the metadata is unusable.
    #[error(transparent)]
    Tokenizer(#[from] crate::tokenizer::TokenizerError),
    #[error("tensor `{tensor}`: {source}")]
    Tensor {
        tensor: String,
        source: candle_core::Error,
    },
}

impl GgufError {
    /// A fixed, machine-readable name for the error's kind (metrics label
    /// and the `type` of an error body).
    pub fn error_type(&self) -> &'static str {
        match self {
            GgufError::Io { .. } => "gguf_io",
            GgufError::BadMagic { .. }
            | GgufError::Truncated { .. }
            | GgufError::Limit { .. }
            | GgufError::BadValueType { .. }
            | GgufError::InvalidUtf8 { .. }
            | GgufError::DuplicateKey(_)
            | GgufError::DuplicateTensor(_)
            | GgufError::BadTensor { .. } => "gguf_corrupt",
            GgufError::UnsupportedVersion { .. }
            | GgufError::UnknownTensorType { .. }
            | GgufError::UnsupportedTensorType { .. }
            | GgufError::UnsupportedArchitecture(_) => "gguf_unsupported",
            GgufError::MissingKey(_)
            | GgufError::WrongType { .. }
            | GgufError::BadMetadata { .. } => "gguf_metadata",
            GgufError::MissingTensor(_) | GgufError::Tensor { .. } => "gguf_tensor",
            GgufError::Model(_) => "model_load",
            GgufError::Tokenizer(e) => e.error_type(),
        }
    }

    pub(crate) fn bad_meta(key: &str, reason: impl Into<String>) -> Self {
        GgufError::BadMetadata {
            key: key.to_string(),
            reason: reason.into(),
        }
    }

    pub(crate) fn bad_tensor(tensor: &str, reason: impl Into<String>) -> Self {
        GgufError::BadTensor {
            tensor: tensor.to_string(),
            reason: reason.into(),
        }
    }
}

/// Whether `path` names a GGUF model (a file whose name ends in `.gguf`,
/// or any regular file, as opposed to a model folder).
pub fn is_gguf_path(path: &std::path::Path) -> bool {
    path.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
        || path.is_file()
}
