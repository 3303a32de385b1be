//! Reading the special-token facts a model folder spreads over several files.
//!
//! Hugging Face model folders state BOS / EOS in up to three places:
//! `tokenizer_config.json` (token *strings*, plus `add_bos_token` and the
//! chat template), `generation_config.json` and `config.json` (token *ids*,
//! each an int or a list of ints). Models disagree on which file is complete
//! (chat models often list extra end-of-turn ids only in
//! `generation_config.json`), so the EOS set is the union of all three, in
//! the order first seen. BOS is taken from the first file that names one, in
//! the order above, because the tokenizer config is what the tokenizer itself
//! was trained with.
//!
//! Only `tokenizer.json` is required; the others are optional, but a file
//! that exists must parse and its fields must make sense.

use std::path::{Path, PathBuf};

use serde_json::Value;

use super::TokenizerError;

/// Special-token facts read from a model folder, ids resolved and checked.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct SpecialTokenConfig {
    /// Beginning-of-sequence token, if any file names one.
    pub bos: Option<u32>,
    /// Every end-of-sequence id, deduplicated, in the order first seen.
    pub eos: Vec<u32>,
    /// `tokenizer_config.json`'s `add_bos_token` (false when absent).
    pub add_bos: bool,
    /// The chat template (Jinja source), if the folder has one.
    pub chat_template: Option<String>,
}

/// Reads a JSON file; `Ok(None)` when it does not exist.
pub(crate) fn read_optional_json(path: &Path) -> Result<Option<Value>, TokenizerError> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(TokenizerError::Read {
                path: path.to_path_buf(),
                source,
            })
        }
    };
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|source| TokenizerError::Json {
            path: path.to_path_buf(),
            source,
        })
}

/// Reads the optional configuration files of `dir` and resolves every token
/// they name against `tokenizer` (token strings to ids, ids range-checked).
pub(crate) fn read_special_tokens(
    dir: &Path,
    tokenizer: &tokenizers::Tokenizer,
    vocab_size: usize,
) -> Result<SpecialTokenConfig, TokenizerError> {
    let mut out = SpecialTokenConfig::default();
    let resolver = Resolver {
        tokenizer,
        vocab_size,
    };

    let path = dir.join("tokenizer_config.json");
    if let Some(json) = read_optional_json(&path)? {
        let file = JsonFile { path, json: &json };
        out.add_bos = file.bool_field("add_bos_token")?.unwrap_or(false);
        out.bos = resolver.token_field(&file, "bos_token")?;
        if let Some(eos) = resolver.token_field(&file, "eos_token")? {
            push_unique(&mut out.eos, eos);
        }
        out.chat_template = file.chat_template()?;
    }
    if out.chat_template.is_none() {
        // Newer `transformers` versions save the template next to the
        // config instead of inside it.
        let path = dir.join("chat_template.jinja");
        match std::fs::read_to_string(&path) {
            Ok(text) => out.chat_template = Some(text),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => return Err(TokenizerError::Read { path, source }),
        }
    }

    for name in ["generation_config.json", "config.json"] {
        let path = dir.join(name);
        let Some(json) = read_optional_json(&path)? else {
            continue;
        };
        let file = JsonFile { path, json: &json };
        for id in resolver.id_list_field(&file, "eos_token_id")? {
            push_unique(&mut out.eos, id);
        }
        if out.bos.is_none() {
            out.bos = resolver
                .id_list_field(&file, "bos_token_id")?
                .first()
                .copied();
        }
    }
    Ok(out)
}

fn push_unique(ids: &mut Vec<u32>, id: u32) {
    if !ids.contains(&id) {
        ids.push(id);
    }
}

/// A parsed JSON object and the path it came from (for error messages).
struct JsonFile<'a> {
    path: PathBuf,
    json: &'a Value,
}

impl JsonFile<'_> {
    /// A field, treating JSON `null` like an absent field.
    fn field(&self, field: &'static str) -> Option<&Value> {
        self.json.get(field).filter(|v| !v.is_null())
    }

    fn invalid(&self, field: &'static str, reason: impl Into<String>) -> TokenizerError {
        TokenizerError::InvalidField {
            path: self.path.clone(),
            field,
            reason: reason.into(),
        }
    }

    fn bool_field(&self, field: &'static str) -> Result<Option<bool>, TokenizerError> {
        match self.field(field) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(other) => Err(self.invalid(field, format!("expected true or false, got {other}"))),
        }
    }

    /// `chat_template`: a string, or a list of `{"name", "template"}` objects
    /// (multi-template configs), of which the one named `default` wins, else
    /// the first.
    fn chat_template(&self) -> Result<Option<String>, TokenizerError> {
        const FIELD: &str = "chat_template";
        match self.field(FIELD) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(Value::Array(entries)) => {
                let mut first = None;
                for entry in entries {
                    let name = entry.get("name").and_then(Value::as_str);
                    let Some(template) = entry.get("template").and_then(Value::as_str) else {
                        return Err(self.invalid(FIELD, "list entries need a string `template`"));
                    };
                    if name == Some("default") {
                        return Ok(Some(template.to_owned()));
                    }
                    first.get_or_insert(template);
                }
                Ok(first.map(str::to_owned))
            }
            Some(other) => Err(self.invalid(
                FIELD,
                format!("expected a string or a list of templates, got {other}"),
            )),
        }
    }
}

/// Resolves token strings and ids against one tokenizer.
struct Resolver<'a> {
    tokenizer: &'a tokenizers::Tokenizer,
    vocab_size: usize,
}

impl Resolver<'_> {
    /// A token given as a string or as an AddedToken object `{"content": …}`.
    fn token_field(
        &self,
        file: &JsonFile<'_>,
        field: &'static str,
    ) -> Result<Option<u32>, TokenizerError> {
        let content = match file.field(field) {
            None => return Ok(None),
            Some(Value::String(s)) => s.as_str(),
            Some(Value::Object(map)) => match map.get("content") {
                Some(Value::String(s)) => s.as_str(),
                _ => return Err(file.invalid(field, "token object has no string `content`")),
            },
            Some(other) => {
                return Err(file.invalid(
                    field,
                    format!("expected a token string or {{\"content\": ...}}, got {other}"),
                ))
            }
        };
        match self.tokenizer.token_to_id(content) {
            Some(id) => Ok(Some(id)),
            None => Err(TokenizerError::UnknownToken {
                path: file.path.clone(),
                field,
                token: content.to_owned(),
            }),
        }
    }

    /// An id field given as an int or a list of ints (absent or null: empty).
    fn id_list_field(
        &self,
        file: &JsonFile<'_>,
        field: &'static str,
    ) -> Result<Vec<u32>, TokenizerError> {
        let values: &[Value] = match file.field(field) {
            None => return Ok(Vec::new()),
            Some(Value::Array(list)) => list,
            Some(single) => std::slice::from_ref(single),
        };
        values
            .iter()
            .map(|v| {
                let id = v
                    .as_u64()
                    .and_then(|id| u32::try_from(id).ok())
                    .ok_or_else(|| {
                        file.invalid(
                            field,
                            format!("expected a token id (int ≥ 0) or a list of them, got {v}"),
                        )
                    })?;
                if (id as usize) >= self.vocab_size {
                    return Err(TokenizerError::TokenIdOutOfRange {
                        origin: format!("{}: field `{field}`", file.path.display()),
                        id,
                        vocab_size: self.vocab_size,
                    });
                }
                Ok(id)
            })
            .collect()
    }
}
