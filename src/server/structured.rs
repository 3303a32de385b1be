//! The request fields that constrain the output, read at the edge into an
//! [`OutputConstraints`]: `response_format`, the `tandem.grammar`
//! extension, `logit_bias`, and stop token ids.
//!
//! Only shapes and types are checked here (a 400 naming the field); the
//! grammar is compiled with the rest of the request on the tokenizing
//! worker, so a schema llguidance cannot compile is a 400 naming
//! `response_format` (or `tandem.grammar`) from there, and token ids are
//! checked against the vocabulary there too.
//!
//! - `response_format`: `{"type": "text"}` (no constraint),
//!   `{"type": "json_object"}`, or `{"type": "json_schema", "json_schema":
//!   {"name", "schema", "strict"}}` (`schema` required; `strict` accepted,
//!   the schema is always enforced).
//! - `tandem.grammar`: `{"type": "lark", "grammar": "..."}` (llguidance's
//!   Lark dialect) or `{"type": "regex", "pattern": "..."}`.
//! - `logit_bias`: token ids (decimal strings) to numbers in [-100, 100].
//! - `stop`: integers in the list are token ids (an extension, as is
//!   `stop_token_ids`); strings stay stop strings (`params.rs`).

use serde_json::Value;

use super::body::{describe, Fields};
use super::errors::ApiError;
use crate::api::OutputConstraints;
use crate::structured::{Constraint, ConstraintOrigin, GrammarSpec};

/// Largest magnitude of a `logit_bias` value (OpenAI's range).
pub const MAX_LOGIT_BIAS: f64 = 100.0;
/// Most stop token ids one request may give.
pub const MAX_STOP_TOKEN_IDS: usize = 64;

/// Reads every constraint field of a body.
pub fn parse_constraints(f: &Fields) -> Result<OutputConstraints, ApiError> {
    let format = parse_response_format(f)?;
    let grammar = parse_grammar_extension(f)?;
    if format.is_some() && grammar.is_some() {
        return Err(ApiError::invalid_field(
            "tandem.grammar",
            "give either `response_format` or `tandem.grammar`, not both",
        ));
    }
    let grammar = format
        .map(|spec| Constraint::new(spec, ConstraintOrigin::ResponseFormat))
        .or(grammar.map(|spec| Constraint::new(spec, ConstraintOrigin::GrammarExtension)));
    Ok(OutputConstraints {
        grammar,
        logit_bias: parse_logit_bias(f)?,
        stop_token_ids: parse_stop_token_ids(f)?,
    })
}

/// `response_format`; `None` for absent or `text`.
fn parse_response_format(f: &Fields) -> Result<Option<GrammarSpec>, ApiError> {
    let Some(format) = f.object("response_format")? else {
        return Ok(None);
    };
    let kind = format
        .get_as::<String>("type", "response_format.type")?
        .ok_or_else(|| ApiError::missing_field("response_format.type"))?;
    match kind.as_str() {
        "text" => Ok(None),
        "json_object" => Ok(Some(GrammarSpec::JsonObject)),
        "json_schema" => {
            let js = format
                .object("json_schema")
                .map_err(|_| {
                    ApiError::invalid_field("response_format.json_schema", "expected an object")
                })?
                .ok_or_else(|| ApiError::missing_field("response_format.json_schema"))?;
            js.get_as::<String>("name", "response_format.json_schema.name")?;
            js.get_as::<bool>("strict", "response_format.json_schema.strict")?;
            js.get_as::<String>("description", "response_format.json_schema.description")?;
            match js.raw("schema") {
                Some(schema @ (Value::Object(_) | Value::Bool(_))) => {
                    Ok(Some(GrammarSpec::JsonSchema {
                        schema: schema.clone(),
                    }))
                }
                Some(other) => Err(ApiError::invalid_field(
                    "response_format.json_schema.schema",
                    format!("expected a JSON Schema object, got {}", describe(other)),
                )),
                None => Err(ApiError::missing_field(
                    "response_format.json_schema.schema",
                )),
            }
        }
        other => Err(ApiError::invalid_field(
            "response_format.type",
            format!("must be `text`, `json_object` or `json_schema`, got `{other}`"),
        )),
    }
}

/// `tandem.grammar`.
fn parse_grammar_extension(f: &Fields) -> Result<Option<GrammarSpec>, ApiError> {
    let Some(ext) = f.object("tandem")? else {
        return Ok(None);
    };
    let Some(g) = ext
        .object("grammar")
        .map_err(|_| ApiError::invalid_field("tandem.grammar", "expected an object with `type`"))?
    else {
        return Ok(None);
    };
    let kind = g
        .get_as::<String>("type", "tandem.grammar.type")?
        .ok_or_else(|| ApiError::missing_field("tandem.grammar.type"))?;
    let text = |name: &str| -> Result<String, ApiError> {
        let field = format!("tandem.grammar.{name}");
        g.get_as::<String>(name, &field)?
            .ok_or_else(|| ApiError::missing_field(&field))
    };
    match kind.as_str() {
        "lark" => Ok(Some(GrammarSpec::Lark {
            grammar: text("grammar")?,
        })),
        "regex" => Ok(Some(GrammarSpec::Regex {
            pattern: text("pattern")?,
        })),
        other => Err(ApiError::invalid_field(
            "tandem.grammar.type",
            format!("must be `lark` or `regex`, got `{other}`"),
        )),
    }
}

/// `logit_bias`: an object mapping token ids (as decimal strings) to
/// numbers in [-100, 100]. A wrong shape is a 400 that names the entry.
pub fn parse_logit_bias(f: &Fields) -> Result<Vec<(u32, f32)>, ApiError> {
    let Some(raw) = f.raw("logit_bias") else {
        return Ok(Vec::new());
    };
    let bias = match raw {
        Value::Object(bias) => bias,
        Value::Null => return Ok(Vec::new()),
        other => {
            return Err(ApiError::invalid_field(
                "logit_bias",
                format!(
                    "expected an object mapping token ids to numbers, got {}",
                    describe(other)
                ),
            ))
        }
    };
    let mut out = Vec::with_capacity(bias.len());
    for (key, value) in bias {
        let field = format!("logit_bias.{key}");
        let token = key
            .parse::<u32>()
            .ok()
            .filter(|_| !key.is_empty() && key.bytes().all(|b| b.is_ascii_digit()))
            .ok_or_else(|| {
                ApiError::invalid_field(
                    "logit_bias",
                    format!(
                        "keys must be token ids (decimal integers in [0, {}]), got {key:?}",
                        u32::MAX
                    ),
                )
            })?;
        match value.as_f64() {
            Some(x) if (-MAX_LOGIT_BIAS..=MAX_LOGIT_BIAS).contains(&x) => {
                out.push((token, x as f32))
            }
            Some(x) => {
                return Err(ApiError::invalid_field(
                    field,
                    format!("must be in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], got {x}"),
                ))
            }
            None => {
                return Err(ApiError::invalid_field(
                    field,
                    format!("expected a number, got {}", describe(value)),
                ))
            }
        }
    }
    Ok(out)
}

/// Stop token ids: the integers of a `stop` list, and `stop_token_ids`.
fn parse_stop_token_ids(f: &Fields) -> Result<Vec<u32>, ApiError> {
    let mut ids = Vec::new();
    let id_of = |field: String, v: &Value| -> Result<u32, ApiError> {
        v.as_u64()
            .and_then(|x| u32::try_from(x).ok())
            .ok_or_else(|| {
                ApiError::invalid_field(
                    field,
                    format!("expected a token id (an integer >= 0), got {}", describe(v)),
                )
            })
    };
    if let Some(Value::Array(items)) = f.raw("stop") {
        for (i, v) in items.iter().enumerate().filter(|(_, v)| v.is_number()) {
            ids.push(id_of(format!("stop[{i}]"), v)?);
        }
    }
    match f.raw("stop_token_ids") {
        None | Some(Value::Null) => {}
        Some(Value::Array(items)) => {
            for (i, v) in items.iter().enumerate() {
                ids.push(id_of(format!("stop_token_ids[{i}]"), v)?);
            }
        }
        Some(other) => {
            return Err(ApiError::invalid_field(
                "stop_token_ids",
                format!("expected a list of token ids, got {}", describe(other)),
            ))
        }
    }
    if ids.len() > MAX_STOP_TOKEN_IDS {
        return Err(ApiError::invalid_field(
            "stop_token_ids",
            format!(
                "at most {MAX_STOP_TOKEN_IDS} stop token ids, got {}",
                ids.len()
            ),
        ));
    }
    Ok(ids)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::body::parse_object;

    fn parse(json: &str) -> Result<OutputConstraints, ApiError> {
        parse_constraints(&parse_object(json.as_bytes()).unwrap())
    }

    fn param_of(json: &str) -> String {
        let e = parse(json).unwrap_err();
        assert_eq!(e.status, 400, "{json}");
        e.param.unwrap_or_default()
    }

    #[test]
    fn reads_each_form() {
        assert_eq!(parse("{}").unwrap(), OutputConstraints::default());
        assert!(parse(r#"{"response_format":{"type":"text"}}"#)
            .unwrap()
            .grammar
            .is_none());
        let c = parse(r#"{"response_format":{"type":"json_object"}}"#).unwrap();
        assert_eq!(c.grammar.unwrap().spec, GrammarSpec::JsonObject);
        let c = parse(
            r#"{"response_format":{"type":"json_schema","json_schema":{"name":"x","strict":true,"schema":{"type":"integer"}}}}"#,
        )
        .unwrap();
        let g = c.grammar.unwrap();
        assert_eq!(g.origin.field(), "response_format");
        assert!(matches!(g.spec, GrammarSpec::JsonSchema { .. }));
        let c = parse(r#"{"tandem":{"grammar":{"type":"regex","pattern":"a+"}}}"#).unwrap();
        assert_eq!(
            c.grammar.unwrap().spec,
            GrammarSpec::Regex {
                pattern: "a+".into()
            }
        );
        let c = parse(r#"{"logit_bias":{"5":-100,"7":2.5},"stop":["x",3],"stop_token_ids":[4]}"#)
            .unwrap();
        assert_eq!(c.logit_bias, vec![(5, -100.0), (7, 2.5)]);
        assert_eq!(c.stop_token_ids, vec![3, 4]);
    }

    #[test]
    fn bad_fields_are_named() {
        assert_eq!(param_of(r#"{"response_format":3}"#), "response_format");
        assert_eq!(
            param_of(r#"{"response_format":{"type":"xml"}}"#),
            "response_format.type"
        );
        assert_eq!(
            param_of(r#"{"response_format":{"type":"json_schema"}}"#),
            "response_format.json_schema"
        );
        assert_eq!(
            param_of(
                r#"{"response_format":{"type":"json_schema","json_schema":{"name":1,"schema":{}}}}"#
            ),
            "response_format.json_schema.name"
        );
        assert_eq!(
            param_of(r#"{"response_format":{"type":"json_schema","json_schema":{"schema":"x"}}}"#),
            "response_format.json_schema.schema"
        );
        assert_eq!(
            param_of(r#"{"tandem":{"grammar":{"type":"ebnf","grammar":"x"}}}"#),
            "tandem.grammar.type"
        );
        assert_eq!(
            param_of(r#"{"tandem":{"grammar":{"type":"lark"}}}"#),
            "tandem.grammar.grammar"
        );
        for bad in [r#""x""#, "1", "true", "[1]"] {
            assert_eq!(
                param_of(&format!(r#"{{"logit_bias":{bad}}}"#)),
                "logit_bias"
            );
        }
        assert_eq!(param_of(r#"{"logit_bias":{"x":1}}"#), "logit_bias");
        assert_eq!(param_of(r#"{"logit_bias":{"-1":1}}"#), "logit_bias");
        assert_eq!(param_of(r#"{"logit_bias":{"5":"a"}}"#), "logit_bias.5");
        assert_eq!(param_of(r#"{"logit_bias":{"5":101}}"#), "logit_bias.5");
        assert_eq!(param_of(r#"{"stop":["a",-1]}"#), "stop[1]");
        assert_eq!(param_of(r#"{"stop_token_ids":[1.5]}"#), "stop_token_ids[0]");
        assert_eq!(param_of(r#"{"stop_token_ids":3}"#), "stop_token_ids");
    }
}
