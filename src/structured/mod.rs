//! Structured output: grammars that constrain what a sequence may sample,
//! through llguidance (JSON schemas, Lark grammars, regexes).
//!
//! # Ownership and flow
//! - A request states a [`Constraint`] (plain data, serialisable). It is
//!   compiled at the edge, on the blocking worker that tokenizes the
//!   request ([`crate::request`]'s `check_text`), into a [`Grammar`]: a bad
//!   schema is a typed `InvalidRequest` naming the client's field
//!   ([`ConstraintOrigin::field`]) and never reaches the engine.
//! - The compiled [`Grammar`] travels inside the checked request to the
//!   engine's admission and from then on is owned by the engine thread,
//!   beside the sequence's sampler state (one owner; nothing shared). Each
//!   step the engine asks it for a [`TokenMask`] before the forward pass
//!   (computed on a worker thread while the pass runs: `engine::masks`),
//!   the sampler applies the mask in its one call for the batch, and the
//!   sampled token is fed back with [`Grammar::accept`].
//! - [`GrammarCompiler`] holds what every grammar of one tokenizer shares
//!   (its token trie and llguidance's `ParserFactory`); it is built once,
//!   lazily, the first time a request of that tokenizer needs it
//!   ([`crate::tokenizer::Tokenizer::grammar_compiler`]).
//!
//! # Invariants
//! - A grammar's state is exactly the generated tokens so far: `accept` is
//!   called once per committed token, in order, EOS ids excepted (the end
//!   of sequence ends the grammar too).
//! - Once [`Grammar::is_finished`] the sequence ends (finish reason
//!   `stop`): nothing more can be accepted.
//! - JSON schemas compile with compact separators (`", "`, `": "`) and no
//!   free whitespace unless the schema's own `x-guidance` says otherwise: a
//!   model that could pad JSON with whitespace forever would run to its
//!   limit instead of closing the document.
//!
//! # Layout
//! - `vocab`: the token trie (each id's exact bytes) from a tokenizer.

pub mod vocab;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokEnv};
use llguidance::{Matcher, ParserFactory};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::sampler::TokenMask;
use crate::tokenizer::Tokenizer;

/// What the output must match.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum GrammarSpec {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// A JSON document valid against this JSON Schema.
    JsonSchema { schema: Value },
    /// A grammar in llguidance's Lark dialect.
    Lark { grammar: String },
    /// A regular expression the whole output matches.
    Regex { pattern: String },
}

/// Which request field a constraint came from: errors name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ConstraintOrigin {
    /// OpenAI's `response_format`.
    ResponseFormat,
    /// The `tandem.grammar` extension.
    GrammarExtension,
    /// A tool-calling constraint built from `tools` / `tool_choice`.
    Tools,
    /// A library caller.
    Library,
}

impl ConstraintOrigin {
    /// The request field errors name.
    pub fn field(self) -> &'static str {
        match self {
            ConstraintOrigin::ResponseFormat => "response_format",
            ConstraintOrigin::GrammarExtension => "tandem.grammar",
            ConstraintOrigin::Tools => "tools",
            ConstraintOrigin::Library => "constraint",
        }
    }
}

/// A request's constraint: the grammar and where it came from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Constraint {
    pub spec: GrammarSpec,
    pub origin: ConstraintOrigin,
}

impl Constraint {
    pub fn new(spec: GrammarSpec, origin: ConstraintOrigin) -> Self {
        Self { spec, origin }
    }
}

/// Compiles grammars for one tokenizer. Read-only once built; shared.
pub struct GrammarCompiler {
    factory: ParserFactory,
    /// The id the grammar allows when it may end.
    eos: u32,
    vocab_size: usize,
}

impl std::fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarCompiler")
            .field("eos", &self.eos)
            .field("vocab_size", &self.vocab_size)
            .finish_non_exhaustive()
    }
}

impl GrammarCompiler {
    /// Builds the token trie of `tokenizer` and llguidance's factory over
    /// it (tens of milliseconds for a 50 k vocabulary). The grammar's end
    /// token is the tokenizer's first EOS id.
    pub fn new(tokenizer: &Tokenizer) -> Result<Self, String> {
        let vocab_size = tokenizer.vocab_size();
        let eos = tokenizer
            .eos_ids()
            .first()
            .copied()
            .ok_or("the tokenizer has no end-of-sequence token")?;
        let trie = vocab::token_trie(tokenizer, eos);
        let env: TokEnv = std::sync::Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
        factory.quiet();
        Ok(Self {
            factory,
            eos,
            vocab_size,
        })
    }

    /// Compiles `spec` into a fresh grammar state; the error is
    /// llguidance's reason (the caller names the field).
    pub fn compile(&self, spec: &GrammarSpec) -> Result<Grammar, String> {
        let top = match spec {
            GrammarSpec::JsonObject => {
                TopLevelGrammar::from_json_schema(compact(json!({"type": "object"})))
            }
            GrammarSpec::JsonSchema { schema } => {
                if !schema.is_object() && !schema.is_boolean() {
                    return Err("a JSON Schema must be an object".into());
                }
                TopLevelGrammar::from_json_schema(compact(schema.clone()))
            }
            GrammarSpec::Lark { grammar } => TopLevelGrammar::from_lark(grammar.clone()),
            GrammarSpec::Regex { pattern } => TopLevelGrammar::from_regex(pattern),
        };
        let parser = self.factory.create_parser(top).map_err(|e| e.to_string())?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(e);
        }
        Ok(Grammar {
            matcher,
            eos: self.eos,
        })
    }
}

/// Compact JSON unless the schema's `x-guidance` says otherwise.
fn compact(mut schema: Value) -> Value {
    if let Value::Object(map) = &mut schema {
        map.entry("x-guidance").or_insert_with(
            || json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
        );
    }
    schema
}

/// Why a grammar could not go on (a bug in the grammar engine or a token
/// the mask did not allow; fails that sequence only).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("grammar: {0}")]
pub struct GrammarError(pub String);

impl GrammarError {
    /// llguidance's reason without the parser-state dump it appends.
    fn from_llg(e: impl std::fmt::Display) -> Self {
        let text = e.to_string();
        let reason = text.lines().next().unwrap_or_default();
        Self(match reason {
            "NoExtensionBias" | "NoExtension" => {
                format!("no token of the vocabulary can continue the grammar ({reason})")
            }
            _ => reason.to_string(),
        })
    }
}

/// One sequence's grammar state (llguidance's `Matcher`). Owned by the
/// engine thread once admitted.
#[derive(Clone)]
pub struct Grammar {
    matcher: Matcher,
    eos: u32,
}

impl std::fmt::Debug for Grammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammar")
            .field("finished", &self.is_finished())
            .finish_non_exhaustive()
    }
}

impl Grammar {
    /// The tokens allowed next, `eos_ids` included when the grammar may
    /// end (llguidance knows one EOS id; the model may have several).
    pub fn mask(&mut self, eos_ids: &[u32]) -> Result<TokenMask, GrammarError> {
        let vob = self
            .matcher
            .compute_mask_or_eos()
            .map_err(GrammarError::from_llg)?;
        let mut mask = TokenMask::from_words(vob.as_slice().to_vec());
        if mask.allows(self.eos) {
            for &e in eos_ids {
                mask.allow(e);
            }
        }
        Ok(mask)
    }

    /// Advances by one sampled token.
    pub fn accept(&mut self, token: u32) -> Result<(), GrammarError> {
        self.matcher
            .consume_token(token)
            .map_err(GrammarError::from_llg)
    }

    /// How many of `tokens`, from the start, the grammar accepts in order
    /// (changes nothing).
    pub fn valid_prefix(&mut self, tokens: &[u32]) -> usize {
        self.matcher.validate_tokens(tokens).unwrap_or(0)
    }

    /// The masks at each position of a draft run: before `drafts[0]`, after
    /// it, …, after the last (`drafts.len() + 1` masks), on a copy of the
    /// state (this one changes nothing). The drafts must be a valid prefix.
    pub fn masks_along(
        &mut self,
        drafts: &[u32],
        eos_ids: &[u32],
    ) -> Result<Vec<TokenMask>, GrammarError> {
        let mut out = Vec::with_capacity(drafts.len() + 1);
        out.push(self.mask(eos_ids)?);
        if drafts.is_empty() {
            return Ok(out);
        }
        let mut ahead = self.clone();
        for &d in drafts {
            ahead.accept(d)?;
            out.push(ahead.mask(eos_ids)?);
        }
        Ok(out)
    }

    /// The grammar is complete and accepts nothing more.
    pub fn is_finished(&self) -> bool {
        self.matcher.is_stopped()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::word_level_tokenizer;

    fn compiler() -> GrammarCompiler {
        GrammarCompiler::new(&word_level_tokenizer(2000, 7).unwrap()).unwrap()
    }

    #[test]
    fn bad_grammars_are_refused_at_compile_time() {
        let c = compiler();
        let bad_schema = GrammarSpec::JsonSchema {
            schema: json!({"type": "nonsense"}),
        };
        assert!(c.compile(&bad_schema).is_err());
        let not_object = GrammarSpec::JsonSchema { schema: json!(3) };
        assert!(c.compile(&not_object).is_err());
        let bad_lark = GrammarSpec::Lark {
            grammar: "start: (".into(),
        };
        assert!(c.compile(&bad_lark).is_err());
        assert!(c.compile(&GrammarSpec::JsonObject).is_ok());
    }

    #[test]
    fn a_regex_grammar_masks_then_finishes() {
        let tok = word_level_tokenizer(2000, 7).unwrap();
        let c = GrammarCompiler::new(&tok).unwrap();
        let mut g = c
            .compile(&GrammarSpec::Regex {
                pattern: "ab".into(),
            })
            .unwrap();
        let glue = |ch: u8| crate::tokenizer::word_vocab::glue_id(ch).unwrap();
        let m = g.mask(tok.eos_ids()).unwrap();
        assert!(m.allows(glue(b'a')) && !m.allows(glue(b'b')) && !m.allows(2));
        g.accept(glue(b'a')).unwrap();
        g.accept(glue(b'b')).unwrap();
        let m = g.mask(tok.eos_ids()).unwrap();
        assert!(m.allows(2), "EOS once the regex matched");
        assert!(!m.allows(glue(b'a')));
    }
}
