//! `POST /v1/completions`: the legacy text completion API.
//!
//! Fields beyond the shared ones ([`CommonParams`]): `prompt` (a string, or a
//! list of token ids; a one-element list of either is accepted too),
//! `logprobs` (an integer: report the sampled token's log-probability and
//! that many alternatives, at most 20), `echo` (the prompt's text before
//! the completion, in every choice; logprobs cover the completion only),
//! `suffix` (only empty). `n` and `best_of` ([`choices`]) go through their
//! own path. `max_tokens` defaults to 16, as in OpenAI's API.

use std::sync::Arc;

use actix_web::{web, HttpRequest, HttpResponse};
use serde_json::Value;
use tracing::Instrument;

use super::body::{accept_json, describe, respond, Fields};
use super::choices::{self, ChoiceParams};
use super::errors::ApiError;
use super::openai_types::{
    finish_reason, unix_now, CompletionChoice, CompletionLogprobs, CompletionResponse, UsageJson,
    SYSTEM_FINGERPRINT,
};
use super::params::CommonParams;
use super::sse::{ChunkFormatter, SseStream};
use super::state::{AppState, Ready};
use super::{count, ROUTE_COMPLETIONS};
use crate::api::{Event, Finished, GenerateRequest, Prompt, TokenInfo};
use crate::sampler::MAX_TOP_LOGPROBS;

/// OpenAI's default `max_tokens` for completions.
pub const DEFAULT_MAX_TOKENS: usize = 16;

/// The route handler.
pub async fn completions(
    req: HttpRequest,
    mut payload: web::Payload,
    state: web::Data<AppState>,
) -> HttpResponse {
    // The request span: `user` is filled in once the body is read.
    let span = tracing::info_span!(
        "request",
        route = "completions",
        user = tracing::field::Empty
    );
    let result = handle(&req, &mut payload, &state).instrument(span).await;
    respond(count(&state, ROUTE_COMPLETIONS, result), payload)
}

async fn handle(
    req: &HttpRequest,
    payload: &mut web::Payload,
    state: &AppState,
) -> Result<HttpResponse, ApiError> {
    let (ready, f) = accept_json(req, payload, state).await?;
    let Parsed {
        request,
        logprobs,
        stream,
        include_usage,
        echo,
        choices,
    } = parse(&f)?;
    let echoed = match (&request.prompt, echo) {
        (_, false) => String::new(),
        (Prompt::Text(text), true) => text.clone(),
        (Prompt::Tokens(ids), true) => ready
            .handle
            .tokenizer()
            .decode(ids)
            .map_err(|e| ApiError::invalid_field("prompt", e))?,
    };
    if !choices.is_single() {
        let created = unix_now();
        let format = |id: &str, index| CompletionFormat {
            id: id.to_string(),
            created,
            ready: ready.clone(),
            logprobs: logprobs.is_some(),
            include_usage,
            offset: 0,
            index,
            echo: Some(echoed.clone()).filter(|e| !e.is_empty()),
        };
        return several_choices(&ready, request, choices, stream, format).await;
    }
    let mut events = ready
        .handle
        .generate(request)
        .await
        .map_err(|e| ApiError::from_tandem(&e, "prompt"))?;
    let format = CompletionFormat {
        id: format!("cmpl-{}", events.id().0),
        created: unix_now(),
        ready: ready.clone(),
        logprobs: logprobs.is_some(),
        include_usage,
        offset: 0,
        index: 0,
        echo: Some(echoed.clone()).filter(|e| !e.is_empty()),
    };
    if stream {
        return Ok(SseStream::new(events, format).into_response());
    }
    let (mut text, mut lp) = (echoed, CompletionLogprobs::default());
    while let Some(event) = events.next_event().await {
        match event {
            Event::Tokens {
                text: t, tokens, ..
            } => {
                if format.logprobs {
                    lp.extend(ready.handle.tokenizer(), &tokens, text.chars().count(), &t);
                }
                text.push_str(&t);
            }
            Event::Finished(fin) => {
                let choice = CompletionChoice {
                    index: 0,
                    text,
                    logprobs: format.logprobs.then_some(lp),
                    finish_reason: Some(finish_reason(fin.reason)),
                };
                let usage = Some(Some(UsageJson::from(fin.usage)));
                return Ok(HttpResponse::Ok().json(format.response(vec![choice], usage)));
            }
            Event::Error { error, .. } => return Err(ApiError::from_tandem(&error, "prompt")),
        }
    }
    Err(ApiError::internal("the request ended without a result"))
}

/// Answers a request of several choices (`n` or `best_of` > 1): a stream
/// with one formatter per choice, or one whole response.
async fn several_choices(
    ready: &Arc<Ready>,
    request: GenerateRequest,
    choices: ChoiceParams,
    stream: bool,
    format: impl Fn(&str, usize) -> CompletionFormat,
) -> Result<HttpResponse, ApiError> {
    let events = ready
        .handle
        .generate_choices(request, choices.best_of)
        .await
        .map_err(|e| choices.name_field(ApiError::from_tandem(&e, "prompt")))?;
    let id = format!("cmpl-{}", events.ids()[0].0);
    if stream {
        let formats = (0..events.len()).map(|i| format(&id, i)).collect();
        return Ok(SseStream::choices(events, formats).into_response());
    }
    let collected = choices::collect(events, choices)
        .await
        .map_err(|e| ApiError::from_tandem(&e, "prompt"))?;
    let first = format(&id, 0);
    let tokenizer = ready.handle.tokenizer();
    let body = first.response(
        choices::completion_choices(
            &collected,
            first.logprobs,
            tokenizer,
            first.echo.as_deref().unwrap_or(""),
        ),
        Some(Some(collected.usage)),
    );
    Ok(HttpResponse::Ok().json(body))
}

/// A completions body, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct Parsed {
    /// The library request.
    pub request: crate::api::GenerateRequest,
    /// `logprobs`: how many alternatives, when asked for.
    pub logprobs: Option<i64>,
    pub stream: bool,
    pub include_usage: bool,
    /// `echo`: the prompt's text comes first.
    pub echo: bool,
    /// `n` and `best_of`.
    pub choices: ChoiceParams,
}

/// Reads and checks every field of a completions body (no I/O: the fuzz
/// tests drive it directly). Errors are 400s that name the field.
pub fn parse(f: &Fields) -> Result<Parsed, ApiError> {
    let prompt = parse_prompt(f)?;
    check_unsupported(f)?;
    let mut common = CommonParams::parse(f, &["max_tokens"])?;
    let logprobs = f.int_in("logprobs", 0, MAX_TOP_LOGPROBS as i64)?;
    if let Some(n) = logprobs {
        common.sampling.logprobs = true;
        common.sampling.top_logprobs = n as usize;
    }
    let (stream, include_usage, choices) = (common.stream, common.include_usage, common.choices);
    let echo = f.get::<bool>("echo")?.unwrap_or(false);
    Ok(Parsed {
        request: common.into_request(prompt, Some(DEFAULT_MAX_TOKENS)),
        logprobs,
        stream,
        include_usage,
        echo,
        choices,
    })
}

/// `prompt`: a string or token ids, alone or as a one-element list.
fn parse_prompt(f: &Fields) -> Result<Prompt, ApiError> {
    let raw = f
        .raw("prompt")
        .ok_or_else(|| ApiError::missing_field("prompt"))?;
    let one = |v: &Value| -> Option<Prompt> {
        match v {
            Value::String(s) => Some(Prompt::Text(s.clone())),
            Value::Array(ids) => ids
                .iter()
                .map(|id| id.as_u64().and_then(|id| u32::try_from(id).ok()))
                .collect::<Option<Vec<u32>>>()
                .map(Prompt::Tokens),
            _ => None,
        }
    };
    let prompt = match raw {
        Value::Array(items) if items.len() == 1 && !items[0].is_number() => one(&items[0]),
        Value::Array(items) if items.iter().any(|i| !i.is_number()) => {
            return Err(ApiError::unsupported(
                "prompt",
                format!(
                    "one prompt per request: got a list of {} prompts (send them as separate requests)",
                    items.len()
                ),
            ))
        }
        other => one(other),
    };
    prompt.ok_or_else(|| {
        ApiError::invalid_field(
            "prompt",
            format!(
                "expected a string or a list of token ids (integers in [0, {}]), got {}",
                u32::MAX,
                describe(raw)
            ),
        )
    })
}

/// Fields this server accepts only at their neutral value.
fn check_unsupported(f: &Fields) -> Result<(), ApiError> {
    if f.get::<String>("suffix")?.is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::unsupported(
            "suffix",
            "insertion (suffix) is not supported",
        ));
    }
    Ok(())
}

/// Builds completion objects and stream chunks for one request.
struct CompletionFormat {
    id: String,
    created: u64,
    ready: Arc<Ready>,
    logprobs: bool,
    include_usage: bool,
    /// Characters streamed so far (the next chunk's `text_offset` base).
    offset: usize,
    /// The choice this formatter streams.
    index: usize,
    /// The prompt's text, sent first (`echo`).
    echo: Option<String>,
}

impl CompletionFormat {
    fn response(
        &self,
        choices: Vec<CompletionChoice>,
        usage: Option<Option<UsageJson>>,
    ) -> CompletionResponse {
        CompletionResponse {
            id: self.id.clone(),
            object: "text_completion",
            created: self.created,
            model: self.ready.model_name.clone(),
            system_fingerprint: SYSTEM_FINGERPRINT,
            choices,
            usage,
        }
    }

    fn chunk(&self, choices: Vec<CompletionChoice>, usage: Option<UsageJson>) -> String {
        let usage = self.include_usage.then_some(usage);
        serde_json::to_string(&self.response(choices, usage)).unwrap_or_default()
    }
}

impl ChunkFormatter for CompletionFormat {
    fn start(&mut self) -> Vec<String> {
        let Some(text) = self.echo.take() else {
            return Vec::new();
        };
        self.offset = text.chars().count();
        let choice = CompletionChoice {
            index: self.index,
            text,
            logprobs: None,
            finish_reason: None,
        };
        vec![self.chunk(vec![choice], None)]
    }

    fn tokens(&mut self, text: String, tokens: Vec<TokenInfo>) -> Option<String> {
        if text.is_empty() && tokens.is_empty() {
            return None;
        }
        let chars = text.chars().count();
        let logprobs = self.logprobs.then(|| {
            let mut lp = CompletionLogprobs::default();
            lp.extend(self.ready.handle.tokenizer(), &tokens, self.offset, &text);
            lp
        });
        self.offset += chars;
        let choice = CompletionChoice {
            index: self.index,
            text,
            logprobs,
            finish_reason: None,
        };
        Some(self.chunk(vec![choice], None))
    }

    fn finished(&mut self, finished: &Finished) -> Vec<String> {
        let last = CompletionChoice {
            index: self.index,
            text: String::new(),
            logprobs: None,
            finish_reason: Some(finish_reason(finished.reason)),
        };
        vec![self.chunk(vec![last], None)]
    }

    fn usage(&mut self, usage: UsageJson) -> Option<String> {
        self.include_usage
            .then(|| self.chunk(Vec::new(), Some(usage)))
    }
}

#[cfg(test)]
mod tests {
    use super::super::body::parse_object;
    use super::*;

    fn prompt(json: &str) -> Result<Prompt, ApiError> {
        parse_prompt(&parse_object(json.as_bytes()).unwrap())
    }

    #[test]
    fn prompt_forms() {
        assert_eq!(
            prompt(r#"{"prompt":"hi"}"#).unwrap(),
            Prompt::Text("hi".into())
        );
        assert_eq!(
            prompt(r#"{"prompt":["hi"]}"#).unwrap(),
            Prompt::Text("hi".into())
        );
        assert_eq!(
            prompt(r#"{"prompt":[1,2]}"#).unwrap(),
            Prompt::Tokens(vec![1, 2])
        );
        assert_eq!(
            prompt(r#"{"prompt":[[1,2]]}"#).unwrap(),
            Prompt::Tokens(vec![1, 2])
        );
        assert_eq!(
            prompt(r#"{}"#).unwrap_err().param.as_deref(),
            Some("prompt")
        );
        assert_eq!(
            prompt(r#"{"prompt":["a","b"]}"#).unwrap_err().code,
            "unsupported_value"
        );
        assert_eq!(
            prompt(r#"{"prompt":[1,-2]}"#).unwrap_err().param.as_deref(),
            Some("prompt")
        );
        assert_eq!(prompt(r#"{"prompt":5}"#).unwrap_err().status, 400);
    }
}
