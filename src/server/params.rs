//! The request fields that completions and chat share, checked at the edge
//! into a [`CommonParams`] with OpenAI's ranges and field names.
//!
//! Each route adds its own fields (the prompt or the messages, and the
//! logprobs options, whose shapes differ) and turns the result into a
//! [`GenerateRequest`]. These are the OpenAI API's own checks (types,
//! ranges, field names); what the library requires of a request (sampling
//! options, vocabulary, limits) it checks once, when the request reaches
//! the scheduler, and [`ApiError::from_tandem`] names the OpenAI field of
//! any fault it finds there.
//!
//! Defaults follow OpenAI, not the library: `temperature` is 1 when absent
//! (the library's default is greedy).

use serde_json::Value;

use super::body::{describe, Fields};
use super::choices::ChoiceParams;
use super::errors::ApiError;
use super::mtp::{check_draft_max, MtpMode};
use super::structured::parse_constraints;
use crate::api::{GenerateRequest, OutputConstraints, Prompt};
use crate::engine::SpecOptions;
use crate::sampler::SamplingOptions;

/// Most stop strings one request may give.
pub const MAX_STOP_STRINGS: usize = 16;
/// OpenAI's default `temperature`.
pub const DEFAULT_TEMPERATURE: f32 = 1.0;

/// Fields shared by both generation routes, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct CommonParams {
    /// `max_tokens` (or `max_completion_tokens`); `None` = the route default.
    pub max_tokens: Option<usize>,
    /// Sampling options; the routes fill in the logprobs fields.
    pub sampling: SamplingOptions,
    /// Stop strings.
    pub stop: Vec<String>,
    /// Stream the answer as server-sent events.
    pub stream: bool,
    /// `stream_options.include_usage`: a last chunk with the usage.
    pub include_usage: bool,
    /// The `tandem` extension: speculative decoding for this request.
    pub mtp: Option<SpecOptions>,
    /// `response_format`, `tandem.grammar`, `logit_bias`, stop token ids
    /// (`structured.rs`).
    pub constraints: OutputConstraints,
    /// `n` and `best_of`.
    pub choices: ChoiceParams,
}

impl CommonParams {
    /// Reads and checks the shared fields. `max_tokens_fields` lists the
    /// names the route accepts for the token limit, highest priority first.
    pub fn parse(f: &Fields, max_tokens_fields: &[&str]) -> Result<Self, ApiError> {
        if let Some(model) = f.raw("model") {
            if !model.is_string() {
                return Err(ApiError::invalid_field(
                    "model",
                    format!("expected a string, got {}", describe(model)),
                ));
            }
        }
        let constraints = parse_constraints(f)?;
        let mut max_tokens = None;
        for name in max_tokens_fields {
            if let Some(n) = f.int_in(name, 1, i64::from(u32::MAX))? {
                max_tokens.get_or_insert(n as usize);
            }
        }
        let sampling = parse_sampling(f)?;
        let stop = parse_stop(f)?;
        let stream = f.get::<bool>("stream")?.unwrap_or(false);
        let include_usage = match f.object("stream_options")? {
            Some(o) => o
                .get_as::<bool>("include_usage", "stream_options.include_usage")?
                .unwrap_or(false),
            None => false,
        };
        let mtp = parse_tandem_extension(f)?;
        // OpenAI's end-user id: accepted and recorded in the route's
        // request span (its `user` field), nothing else.
        if let Some(user) = f.get::<String>("user")? {
            tracing::Span::current().record("user", user.as_str());
        }
        let choices = ChoiceParams::parse(f, stream)?;
        Ok(Self {
            max_tokens,
            sampling,
            stop,
            stream,
            include_usage,
            mtp,
            constraints,
            choices,
        })
    }

    /// The library request for `prompt`, with `default_max_tokens` when the
    /// client gave no limit.
    pub fn into_request(
        self,
        prompt: Prompt,
        default_max_tokens: Option<usize>,
    ) -> GenerateRequest {
        GenerateRequest {
            prompt,
            max_tokens: self.max_tokens.or(default_max_tokens),
            sampling: self.choices.sampling(self.sampling),
            stop: self.stop,
            mtp: self.mtp,
            constraints: self.constraints,
        }
    }
}

/// The sampling fields, OpenAI's and the common extensions.
fn parse_sampling(f: &Fields) -> Result<SamplingOptions, ApiError> {
    let mut s = SamplingOptions {
        temperature: DEFAULT_TEMPERATURE,
        ..SamplingOptions::default()
    };
    if let Some(t) = f.f32_in("temperature", 0.0, 2.0)? {
        s.temperature = t;
    }
    if let Some(p) = f.f32_in("top_p", 0.0, 1.0)? {
        s.top_p = p;
    }
    if let Some(p) = f.f32_in("presence_penalty", -2.0, 2.0)? {
        s.presence_penalty = p;
    }
    if let Some(p) = f.f32_in("frequency_penalty", -2.0, 2.0)? {
        s.frequency_penalty = p;
    }
    if let Some(seed) = f.raw("seed") {
        // OpenAI seeds are signed 64-bit; a negative one keeps its bits.
        let seed = seed
            .as_u64()
            .or_else(|| seed.as_i64().map(|x| x as u64))
            .ok_or_else(|| {
                ApiError::invalid_field(
                    "seed",
                    format!("expected an integer, got {}", describe(seed)),
                )
            })?;
        s.seed = Some(seed);
    }
    // Extensions (vLLM / llama.cpp names). `top_k = -1` means "off" there.
    if let Some(k) = f.int_in("top_k", -1, i64::from(i32::MAX))? {
        s.top_k = k.max(0) as i32;
    }
    if let Some(p) = f.f32_in("min_p", 0.0, 1.0)? {
        s.min_p = p;
    }
    if let Some(p) = f.f32_in("repetition_penalty", f32::MIN_POSITIVE, 100.0)? {
        s.repeat_penalty = p;
    }
    if let Some(n) = f.int_in("repeat_last_n", -1, i64::from(i32::MAX))? {
        s.repeat_last_n = n as i32;
    }
    Ok(s)
}

/// `tools`: a list of `{"type": "function", "function": {"name": …}}`.
/// Type-checked in full (a wrong shape is a 400 naming the entry; the
/// calling itself is `tools.rs`). `tool_choice`, when given, must be
/// `none`, `auto`, `required` or an object, and anything but
/// `"none"`/`"auto"` needs tools.
pub fn check_tools(f: &Fields) -> Result<(), ApiError> {
    let tools = match f.raw("tools") {
        None => &Vec::new(),
        Some(Value::Array(tools)) => tools,
        Some(other) => {
            return Err(ApiError::invalid_field(
                "tools",
                format!("expected a list of tool objects, got {}", describe(other)),
            ))
        }
    };
    for (i, tool) in tools.iter().enumerate() {
        let at = format!("tools[{i}]");
        let Value::Object(map) = tool else {
            return Err(ApiError::invalid_field(
                at,
                format!("expected an object, got {}", describe(tool)),
            ));
        };
        let tool = Fields::from_map(map.clone());
        match tool.get_as::<String>("type", &format!("{at}.type"))? {
            Some(t) if t == "function" => {}
            Some(t) => {
                return Err(ApiError::invalid_field(
                    format!("{at}.type"),
                    format!("must be `function`, got `{t}`"),
                ))
            }
            None => return Err(ApiError::missing_field(&format!("{at}.type"))),
        }
        let function = tool
            .object("function")
            .map_err(|_| ApiError::invalid_field(format!("{at}.function"), "expected an object"))?
            .ok_or_else(|| ApiError::missing_field(&format!("{at}.function")))?;
        let name_field = format!("{at}.function.name");
        function
            .get_as::<String>("name", &name_field)?
            .ok_or_else(|| ApiError::missing_field(&name_field))?;
        function.get_as::<String>("description", &format!("{at}.function.description"))?;
        if let Some(p) = function.raw("parameters") {
            if !p.is_object() {
                return Err(ApiError::invalid_field(
                    format!("{at}.function.parameters"),
                    format!("expected a JSON Schema object, got {}", describe(p)),
                ));
            }
        }
    }
    match f.raw("tool_choice") {
        None => {}
        Some(Value::String(c)) if c == "none" || c == "auto" => {}
        Some(Value::String(c)) if c == "required" && !tools.is_empty() => {}
        Some(Value::String(c)) if c != "required" => {
            return Err(ApiError::invalid_field(
                "tool_choice",
                format!("expected `none`, `auto`, `required` or an object, got `{c}`"),
            ))
        }
        Some(Value::Object(_)) if !tools.is_empty() => {}
        Some(c @ (Value::String(_) | Value::Object(_))) => {
            return Err(ApiError::invalid_field(
                "tool_choice",
                format!("{} needs a non-empty `tools` list", describe(c)),
            ))
        }
        Some(other) => {
            return Err(ApiError::invalid_field(
                "tool_choice",
                format!(
                    "expected `none`, `auto`, `required` or an object, got {}",
                    describe(other)
                ),
            ))
        }
    }
    Ok(())
}

/// `stop`: a string or a list of non-empty strings (integers in the list
/// are stop token ids, read by `structured.rs`).
fn parse_stop(f: &Fields) -> Result<Vec<String>, ApiError> {
    let stop = match f.raw("stop") {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => items
            .iter()
            .enumerate()
            .filter(|(_, v)| !v.is_number())
            .map(|(i, v)| match v {
                Value::String(s) => Ok(s.clone()),
                other => Err(ApiError::invalid_field(
                    format!("stop[{i}]"),
                    format!("expected a string or a token id, got {}", describe(other)),
                )),
            })
            .collect::<Result<_, _>>()?,
        Some(other) => {
            return Err(ApiError::invalid_field(
                "stop",
                format!(
                    "expected a string or a list of strings, got {}",
                    describe(other)
                ),
            ))
        }
    };
    if stop.len() > MAX_STOP_STRINGS {
        return Err(ApiError::invalid_field(
            "stop",
            format!(
                "at most {MAX_STOP_STRINGS} stop strings, got {}",
                stop.len()
            ),
        ));
    }
    if let Some(i) = stop.iter().position(String::is_empty) {
        return Err(ApiError::invalid_field(
            format!("stop[{i}]"),
            "stop strings must not be empty",
        ));
    }
    Ok(stop)
}

/// The `tandem` extension object: `{"mtp": "off" | "on", "draft_max": N}`.
/// `mtp` turns the server's drafting off or on for this request (the draft
/// head itself is chosen at start-up with `--mtp`); `draft_max` caps its
/// drafts. `None` when the request says nothing.
fn parse_tandem_extension(f: &Fields) -> Result<Option<SpecOptions>, ApiError> {
    let Some(ext) = f.object("tandem")? else {
        return Ok(None);
    };
    let mut spec = SpecOptions::default();
    if let Some(mode) = ext.get_as::<String>("mtp", "tandem.mtp")? {
        spec.enabled = match mode.as_str() {
            "off" => false,
            "on" => true,
            other => {
                let reason = match other.parse::<MtpMode>() {
                    Ok(_) => format!("`{other}`: the draft head is chosen when the server starts (--mtp); a request says `on` or `off`"),
                    Err(e) => e.to_string(),
                };
                return Err(ApiError::invalid_field("tandem.mtp", reason));
            }
        };
    }
    if let Some(n) = ext.get_as::<usize>("draft_max", "tandem.draft_max")? {
        spec.max_draft =
            check_draft_max(n).map_err(|e| ApiError::invalid_field("tandem.draft_max", e))?;
        spec.initial_draft = spec.initial_draft.min(spec.max_draft);
    }
    Ok(Some(spec))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::body::parse_object;

    fn parse(json: &str) -> Result<CommonParams, ApiError> {
        CommonParams::parse(&parse_object(json.as_bytes()).unwrap(), &["max_tokens"])
    }

    fn param_of(json: &str) -> String {
        let e = parse(json).unwrap_err();
        assert_eq!(e.status, 400, "{json}");
        e.param.unwrap_or_default()
    }

    #[test]
    fn reads_every_field() {
        let p = parse(
            r#"{"model":"m","max_tokens":7,"temperature":0,"top_p":0.5,"seed":-1,"top_k":-1,
                "min_p":0.1,"repetition_penalty":1.1,"repeat_last_n":32,"stop":"x","stream":true,
                "stream_options":{"include_usage":true},"tandem":{"mtp":"off","draft_max":4}}"#,
        )
        .unwrap();
        assert_eq!(p.max_tokens, Some(7));
        assert_eq!(p.sampling.temperature, 0.0);
        assert_eq!(p.sampling.seed, Some(u64::MAX));
        assert_eq!((p.sampling.top_k, p.sampling.repeat_last_n), (0, 32));
        assert_eq!(p.stop, vec!["x".to_string()]);
        assert!(p.stream && p.include_usage);
        assert_eq!(parse("{}").unwrap().sampling.temperature, 1.0);
    }

    #[test]
    fn bad_fields_are_named() {
        assert_eq!(param_of(r#"{"temperature":3}"#), "temperature");
        assert_eq!(param_of(r#"{"n":0}"#), "n");
        assert_eq!(param_of(r#"{"max_tokens":0}"#), "max_tokens");
        assert_eq!(param_of(r#"{"stop":[true]}"#), "stop[0]");
        assert_eq!(param_of(r#"{"stop":["a",""]}"#), "stop[1]");
        assert_eq!(
            param_of(r#"{"repetition_penalty":0}"#),
            "repetition_penalty"
        );
        assert_eq!(param_of(r#"{"stream":"yes"}"#), "stream");
        assert_eq!(
            param_of(r#"{"stream_options":{"include_usage":1}}"#),
            "stream_options.include_usage"
        );
        assert_eq!(
            param_of(r#"{"tandem":{"mtp":"early-exit:2"}}"#),
            "tandem.mtp"
        );
        assert_eq!(
            param_of(r#"{"tandem":{"draft_max":99}}"#),
            "tandem.draft_max"
        );
        assert_eq!(param_of(r#"{"model":3}"#), "model");
        assert_eq!(param_of(r#"{"user":3}"#), "user");
        assert!(parse(r#"{"user":"u-1","unknown_field":[1]}"#).is_ok());
        assert_eq!(param_of(r#"{"logit_bias":{"5":101}}"#), "logit_bias.5");
        assert_eq!(
            parse(r#"{"logit_bias":{"5":-100}}"#)
                .unwrap()
                .constraints
                .logit_bias,
            vec![(5, -100.0)]
        );
        assert!(parse(r#"{"logit_bias":{}}"#).is_ok());
    }

    #[test]
    fn tools_are_type_checked() {
        let tools = |json: &str| {
            let e = check_tools(&parse_object(json.as_bytes()).unwrap()).unwrap_err();
            (e.code, e.param.unwrap_or_default())
        };
        for bad in ["{}", r#""x""#, "1", "true"] {
            assert_eq!(
                tools(&format!(r#"{{"tools":{bad}}}"#)),
                ("invalid_value", "tools".into()),
                "{bad}"
            );
        }
        assert_eq!(tools(r#"{"tools":[1]}"#).1, "tools[0]");
        assert_eq!(
            tools(r#"{"tools":[{"type":"function"}]}"#).1,
            "tools[0].function"
        );
        assert_eq!(
            tools(r#"{"tools":[{"type":"x","function":{"name":"f"}}]}"#).1,
            "tools[0].type"
        );
        assert_eq!(
            tools(r#"{"tools":[{"type":"function","function":{"name":3}}]}"#).1,
            "tools[0].function.name"
        );
        assert_eq!(
            tools(r#"{"tools":[{"type":"function","function":[]}]}"#).1,
            "tools[0].function"
        );
        assert_eq!(tools(r#"{"tool_choice":"required"}"#).1, "tool_choice");
        assert_eq!(tools(r#"{"tool_choice":5}"#).1, "tool_choice");
        let ok = r#"{"tools":[{"type":"function","function":{"name":"f","parameters":{}}}]}"#;
        assert!(check_tools(&parse_object(ok.as_bytes()).unwrap()).is_ok());
        assert!(
            check_tools(&parse_object(br#"{"tools":[],"tool_choice":"none"}"#).unwrap()).is_ok()
        );
    }
}
