//! The tokenizer layer's one error type.
//!
//! Every variant that comes from a file names the file; every variant that
//! comes from a field names the field and what was wrong with it, so an
//! operator can fix a model folder from the message alone.

use std::path::PathBuf;

/// Why a tokenizer could not be loaded, built or used.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A required file is missing or unreadable.
    #[error("{path}: cannot read file: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A JSON file does not parse.
    #[error("{path}: invalid JSON: {source}")]
    Json {
        path: PathBuf,
        source: serde_json::Error,
    },
    /// `tokenizer.json` parses as JSON but the `tokenizers` crate rejects it.
    #[error("{path}: not a usable tokenizer: {source}")]
    Load {
        path: PathBuf,
        source: tokenizers::Error,
    },
    /// A field of a configuration file has the wrong type or value.
    #[error("{path}: field `{field}`: {reason}")]
    InvalidField {
        path: PathBuf,
        field: &'static str,
        reason: String,
    },
    /// A configuration file names a token string the vocabulary lacks.
    #[error("{path}: field `{field}` names token {token:?}, which is not in the vocabulary")]
    UnknownToken {
        path: PathBuf,
        field: &'static str,
        token: String,
    },
    /// A token id (from a file, a caller or a model) is outside the vocabulary.
    #[error("{origin}: token id {id} is outside the vocabulary (vocab_size {vocab_size})")]
    TokenIdOutOfRange {
        /// Where the id came from: a file and field, or the API that got it.
        origin: String,
        id: u32,
        vocab_size: usize,
    },
    /// The `tokenizers` crate failed to encode a text.
    #[error("encoding failed: {0}")]
    Encode(tokenizers::Error),
    /// The `tokenizers` crate failed to decode ids.
    #[error("decoding failed: {0}")]
    Decode(tokenizers::Error),
    /// A stop string is empty (it would match before any text).
    #[error("stop[{index}] is empty: stop strings must contain at least one character")]
    EmptyStopString { index: usize },
    /// The generated word-level vocabulary was asked for an impossible size.
    #[error("vocab_size {requested} is out of range: must be between {min} and {max}")]
    VocabSize {
        requested: usize,
        min: usize,
        max: usize,
    },
    /// A tokenizer assembled in code was rejected by the `tokenizers` crate.
    #[error("cannot build tokenizer in code: {0}")]
    Build(String),
}

impl TokenizerError {
    /// A fixed, machine-readable name for the error's kind (metrics label and
    /// the `type` of an HTTP error body).
    pub fn error_type(&self) -> &'static str {
        match self {
            TokenizerError::Read { .. }
            | TokenizerError::Json { .. }
            | TokenizerError::Load { .. }
            | TokenizerError::InvalidField { .. }
            | TokenizerError::UnknownToken { .. }
            | TokenizerError::Build(_) => "tokenizer_load",
            TokenizerError::TokenIdOutOfRange { .. } => "token_id_out_of_range",
            TokenizerError::Encode(_) => "tokenizer_encode",
            TokenizerError::Decode(_) => "tokenizer_decode",
            TokenizerError::EmptyStopString { .. } => "invalid_stop",
            TokenizerError::VocabSize { .. } => "invalid_vocab_size",
        }
    }
}
