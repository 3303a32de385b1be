//! Text ↔ token ids, and the per-request text stream built on it.
//!
//! [`Tokenizer`] wraps a Hugging Face `tokenizers::Tokenizer` together with
//! the special-token facts a model folder states outside `tokenizer.json`
//! (BOS, the EOS set, `add_bos_token`, the chat template). It is immutable
//! after construction and shared as `Arc<Tokenizer>` by every request actor;
//! `tokenizers::Tokenizer` is `Send + Sync`, so no lock is needed.
//!
//! Invariants:
//! - [`Tokenizer::encode`] returns the prompt with the model's BOS exactly
//!   once (when the model has one), whoever adds it: the `tokenizer.json`
//!   post-processor or `add_bos_token`.
//! - Every id handed to a decoding method is range-checked against
//!   [`Tokenizer::vocab_size`]; the `tokenizers` crate would silently drop an
//!   unknown id instead.
//!
//! # Layout
//! - [`error`]: [`TokenizerError`], the layer's one error enum.
//! - `config`: reading `tokenizer_config.json`, `generation_config.json` and
//!   `config.json` into the special-token facts.
//! - [`gguf`]: [`Tokenizer::from_gguf`], the tokenizer in a GGUF file's
//!   metadata, rebuilt as its Hugging Face `tokenizer.json`.
//! - [`incremental`]: [`IncrementalDecoder`], text from a stream of ids,
//!   emitted only at valid UTF-8 boundaries, with per-token payloads.
//! - [`stop`]: [`StopFilter`] and [`TextStream`], the request actor's output
//!   filter (incremental decoding + stop strings).
//! - [`word_vocab`]: [`word_level_tokenizer`], the embedded default model's
//!   generated vocabulary of pseudo-English words.

mod config;
pub mod error;
pub mod gguf;
pub mod incremental;
pub mod stop;
pub mod word_vocab;

use std::path::Path;
use std::sync::{Arc, OnceLock};

use crate::structured::GrammarCompiler;

pub use error::TokenizerError;
pub use incremental::{IncrementalDecoder, TextChunk};
pub use stop::{StopFilter, StopMatch, StreamStep, TextStream};
pub use word_vocab::word_level_tokenizer;

use tokenizers::Decoder as _;

/// A text that every decoder in the `tokenizers` crate passes through
/// unchanged and that gets no leading space stripped; [`Tokenizer::token_text`]
/// decodes a token after it so that decoders which treat the first token of a
/// sequence specially (SentencePiece's leading-space strip) leave it alone.
const ANCHOR_PIECE: &str = "x";

/// A model's tokenizer: encoding, decoding and its special tokens.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    bos: Option<u32>,
    eos: Vec<u32>,
    add_bos: bool,
    /// Whether `inner`'s post-processor itself puts BOS in front (probed once
    /// at construction, since post-processors come in many shapes).
    post_processor_adds_bos: bool,
    vocab_size: usize,
    chat_template: Option<String>,
    /// The grammar compiler over this vocabulary, built on first use and
    /// shared by clones (see [`Tokenizer::grammar_compiler`]).
    grammar: Arc<OnceLock<Result<Arc<GrammarCompiler>, String>>>,
}

impl Tokenizer {
    /// Loads the tokenizer of a Hugging Face model folder.
    ///
    /// Reads `tokenizer.json` (required) and, when present,
    /// `tokenizer_config.json`, `chat_template.jinja`,
    /// `generation_config.json` and `config.json`. BOS comes from the first of
    /// these files that names one; the EOS set is the union of all of them.
    /// Errors name the file and the problem.
    pub fn from_dir(dir: &Path) -> Result<Tokenizer, TokenizerError> {
        let path = dir.join("tokenizer.json");
        let bytes = std::fs::read(&path).map_err(|source| TokenizerError::Read {
            path: path.clone(),
            source,
        })?;
        // Parse to a JSON value first so that syntax errors and schema errors
        // get different, more precise messages.
        let json: serde_json::Value =
            serde_json::from_slice(&bytes).map_err(|source| TokenizerError::Json {
                path: path.clone(),
                source,
            })?;
        let inner: tokenizers::Tokenizer =
            serde_json::from_value(json).map_err(|e| TokenizerError::Load {
                path: path.clone(),
                source: Box::new(e),
            })?;
        let vocab_size = id_space(&inner);
        let special = config::read_special_tokens(dir, &inner, vocab_size)?;
        let mut tokenizer = Self::from_parts(inner, special.bos, special.eos, special.add_bos)?;
        tokenizer.chat_template = special.chat_template;
        Ok(tokenizer)
    }

    /// Wraps a tokenizer built in code.
    ///
    /// `bos` is the model's beginning-of-sequence id; `add_bos` asks
    /// [`encode`](Self::encode) to prepend it when the post-processor does
    /// not already. `eos` is deduplicated. Fails when an id is outside the
    /// vocabulary.
    pub fn from_parts(
        inner: tokenizers::Tokenizer,
        bos: Option<u32>,
        eos: Vec<u32>,
        add_bos: bool,
    ) -> Result<Tokenizer, TokenizerError> {
        let vocab_size = id_space(&inner);
        let check = |field: &str, id: u32| {
            if (id as usize) < vocab_size {
                Ok(id)
            } else {
                Err(TokenizerError::TokenIdOutOfRange {
                    origin: format!("Tokenizer::from_parts: {field}"),
                    id,
                    vocab_size,
                })
            }
        };
        let bos = bos.map(|id| check("bos", id)).transpose()?;
        let mut unique_eos = Vec::with_capacity(eos.len());
        for id in eos {
            let id = check("eos", id)?;
            if !unique_eos.contains(&id) {
                unique_eos.push(id);
            }
        }
        let post_processor_adds_bos = match bos {
            Some(bos) => {
                let probe = "a";
                let with = encode_ids(&inner, probe, true)?;
                let without = encode_ids(&inner, probe, false)?;
                with.first() == Some(&bos) && without.first() != Some(&bos)
            }
            None => false,
        };
        Ok(Tokenizer {
            inner,
            bos,
            eos: unique_eos,
            add_bos,
            post_processor_adds_bos,
            vocab_size,
            chat_template: None,
            grammar: Arc::default(),
        })
    }

    /// Replaces the chat template (Jinja source) kept for the server.
    pub fn with_chat_template(mut self, template: Option<String>) -> Self {
        self.chat_template = template;
        self
    }

    /// Encodes a prompt: the ids the model should see, with its BOS exactly
    /// once at the front (when the model has a BOS).
    ///
    /// When the text itself starts with the BOS token's literal text (a
    /// rendered chat template often does), the BOS the tokenizer would add on
    /// top is dropped rather than doubled.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let mut ids = encode_ids(&self.inner, text, true)?;
        if let Some(bos) = self.bos {
            if self.post_processor_adds_bos {
                if ids.len() >= 2 && ids[0] == bos && ids[1] == bos {
                    ids.remove(0);
                }
            } else if self.add_bos && ids.first() != Some(&bos) {
                ids.insert(0, bos);
            }
        }
        Ok(ids)
    }

    /// Encodes a text without any special tokens (no BOS, no post-processing).
    pub fn encode_plain(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        encode_ids(&self.inner, text, false)
    }

    /// Decodes ids to text, skipping special tokens. Invalid UTF-8 (an
    /// incomplete multi-byte character) comes out as U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        self.check_ids(ids, "Tokenizer::decode")?;
        self.inner.decode(ids, true).map_err(TokenizerError::Decode)
    }

    /// The text one token contributes when it follows other text: `" there"`
    /// for SentencePiece's `▁there` and byte-level BPE's `Ġthere` alike, and
    /// the literal content (`"</s>"`) for added tokens. A token that holds
    /// only part of a multi-byte character yields U+FFFD. Meant for logprob
    /// reports, which show one token at a time.
    pub fn token_text(&self, id: u32) -> Result<String, TokenizerError> {
        self.check_ids(&[id], "Tokenizer::token_text")?;
        let added = self.inner.get_added_vocabulary();
        if let Some(content) = added.simple_id_to_token(id) {
            return Ok(content);
        }
        let Some(piece) = self.inner.id_to_token(id) else {
            // Ids inside the range but absent from the model (holes in a
            // sparse vocabulary) have no text.
            return Ok(String::new());
        };
        let Some(decoder) = self.inner.get_decoder() else {
            return Ok(piece);
        };
        let text = decoder
            .decode(vec![ANCHOR_PIECE.to_owned(), piece])
            .map_err(TokenizerError::Decode)?;
        Ok(match text.strip_prefix(ANCHOR_PIECE) {
            Some(rest) => rest.to_owned(),
            None => text,
        })
    }

    /// Size of the id space: one more than the largest id, added tokens
    /// included. Logits of a matching model have this many columns (or more,
    /// when the embedding is padded).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The beginning-of-sequence id, if the model has one.
    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    /// Every id that ends generation, deduplicated.
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos
    }

    /// Whether `id` ends generation.
    pub fn is_eos(&self, id: u32) -> bool {
        self.eos.contains(&id)
    }

    /// The chat template (Jinja source) from the model folder, if any.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// The compiler of constrained-decoding grammars over this vocabulary
    /// (its token trie), built the first time it is asked for: blocking
    /// work, so ask from a worker thread. A failure (no EOS id) is kept and
    /// returned to every caller.
    pub fn grammar_compiler(&self) -> Result<Arc<GrammarCompiler>, String> {
        self.grammar
            .get_or_init(|| GrammarCompiler::new(self).map(Arc::new))
            .clone()
    }

    /// The wrapped `tokenizers` tokenizer, for what this type does not cover.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// Fails with [`TokenizerError::TokenIdOutOfRange`] on the first id that
    /// is not below [`vocab_size`](Self::vocab_size).
    pub fn check_ids(&self, ids: &[u32], origin: &str) -> Result<(), TokenizerError> {
        match ids.iter().find(|&&id| id as usize >= self.vocab_size) {
            None => Ok(()),
            Some(&id) => Err(TokenizerError::TokenIdOutOfRange {
                origin: origin.to_owned(),
                id,
                vocab_size: self.vocab_size,
            }),
        }
    }
}

impl std::fmt::Debug for Tokenizer {
    // The wrapped tokenizer's own Debug prints the whole vocabulary.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size)
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("add_bos", &self.add_bos)
            .field("post_processor_adds_bos", &self.post_processor_adds_bos)
            .field("has_chat_template", &self.chat_template.is_some())
            .finish_non_exhaustive()
    }
}

fn encode_ids(
    inner: &tokenizers::Tokenizer,
    text: &str,
    add_special_tokens: bool,
) -> Result<Vec<u32>, TokenizerError> {
    inner
        .encode(text, add_special_tokens)
        .map(|encoding| encoding.get_ids().to_vec())
        .map_err(TokenizerError::Encode)
}

/// One more than the largest id of the vocabulary, added tokens included.
/// (`get_vocab_size(true)` counts entries, which undercounts when added
/// tokens share ids with the model vocabulary or ids have holes.)
fn id_space(inner: &tokenizers::Tokenizer) -> usize {
    let model_max = inner.get_vocab(false).into_values().max();
    let added_max = inner
        .get_added_vocabulary()
        .get_added_tokens_decoder()
        .keys()
        .copied()
        .max();
    model_max
        .into_iter()
        .chain(added_max)
        .max()
        .map_or(0, |max| max as usize + 1)
}
