//! `POST /v1/chat/completions`.
//!
//! Fields beyond the shared ones ([`CommonParams`]): `messages` (roles
//! `system`, `developer`, `user`, `assistant`, `tool`; content a string or a
//! list of `{"type": "text", "text": …}` parts), `max_completion_tokens`
//! (preferred over `max_tokens`), `logprobs` (bool) with `top_logprobs`
//! (0–20, needs `logprobs`), the extension `add_generation_prompt`
//! (default true), and tool calling (`tools`, `tool_choice`,
//! `parallel_tool_calls`, tool messages: `tools.rs`). `response_format` is
//! shared with completions (`structured.rs`). Without a limit, generation
//! runs until EOS or the context is full. `n`, and `best_of` as vLLM's
//! extension, go through [`choices`] (not with tool calls yet: a 400).

use std::sync::Arc;

use actix_web::{web, HttpRequest, HttpResponse};
use serde_json::Value;
use tracing::Instrument;

use super::body::{accept_json, describe, json_kind, respond, Fields};
use super::chat_template::ChatMessage;
use super::choices::{self, ChoiceParams};
use super::errors::ApiError;
use super::openai_types::{
    finish_reason, unix_now, ChatChoice, ChatChunk, ChatChunkChoice, ChatDelta, ChatLogprobs,
    ChatMessageOut, ChatResponse, UsageJson, SYSTEM_FINGERPRINT,
};
use super::params::CommonParams;
use super::sse::{ChunkFormatter, SseStream};
use super::state::{AppState, Ready};
use super::tools::{self, CallStream, ToolRequest};
use super::{count, ROUTE_CHAT};
use crate::api::{Event, Finished, GenerateRequest, Prompt, TokenInfo};
use crate::sampler::MAX_TOP_LOGPROBS;

const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

/// The route handler.
pub async fn chat_completions(
    req: HttpRequest,
    mut payload: web::Payload,
    state: web::Data<AppState>,
) -> HttpResponse {
    // The request span: `user` is filled in once the body is read.
    let span = tracing::info_span!("request", route = "chat", user = tracing::field::Empty);
    let result = handle(&req, &mut payload, &state).instrument(span).await;
    respond(count(&state, ROUTE_CHAT, result), payload)
}

async fn handle(
    req: &HttpRequest,
    payload: &mut web::Payload,
    state: &AppState,
) -> Result<HttpResponse, ApiError> {
    let (ready, f) = accept_json(req, payload, state).await?;
    let Parsed {
        mut messages,
        mut common,
        logprobs,
        add_generation_prompt,
        tools,
    } = parse(&f)?;
    let prompt = render_prompt(
        &ready,
        &mut messages,
        add_generation_prompt,
        &tools,
        &mut common,
    )?;
    let (stream, include_usage, choices) = (common.stream, common.include_usage, common.choices);
    let parses_calls = tools.as_ref().is_some_and(ToolRequest::parses_calls);
    let request = common.into_request(Prompt::Text(prompt), None);
    if !choices.is_single() {
        let created = unix_now();
        let format = |id: &str, index| ChatFormat {
            id: id.to_string(),
            created,
            ready: ready.clone(),
            logprobs,
            include_usage,
            index,
            calls: parses_calls.then(|| CallStream::new(choice_call_prefix(id, index))),
        };
        return several_choices(&ready, request, choices, stream, format, &f).await;
    }
    let mut events = ready
        .handle
        .generate(request)
        .await
        .map_err(|e| limit_field_as_sent(ApiError::from_tandem(&e, "messages"), &f))?;
    let format = ChatFormat {
        id: format!("chatcmpl-{}", events.id().0),
        created: unix_now(),
        ready: ready.clone(),
        logprobs,
        include_usage,
        index: 0,
        calls: parses_calls.then(|| CallStream::new(format!("call_{}", events.id().0))),
    };
    if stream {
        return Ok(SseStream::new(events, format).into_response());
    }
    let (mut text, mut lp) = (String::new(), ChatLogprobs::default());
    while let Some(event) = events.next_event().await {
        match event {
            Event::Tokens {
                text: t, tokens, ..
            } => {
                if logprobs {
                    lp.extend(ready.handle.tokenizer(), &tokens, &t);
                }
                text.push_str(&t);
            }
            Event::Finished(fin) => {
                let mut finish = finish_reason(fin.reason);
                let (content, calls) = match format.calls {
                    Some(_) => tools::parse_calls(&text, &format!("call_{}", fin.id.0)),
                    None => (Some(text), Vec::new()),
                };
                if !calls.is_empty() {
                    finish = "tool_calls";
                }
                let response = ChatResponse {
                    id: format.id,
                    object: "chat.completion",
                    created: format.created,
                    model: ready.model_name.clone(),
                    system_fingerprint: SYSTEM_FINGERPRINT,
                    choices: vec![ChatChoice {
                        index: 0,
                        message: ChatMessageOut {
                            role: "assistant",
                            content,
                            tool_calls: (!calls.is_empty()).then_some(calls),
                        },
                        logprobs: logprobs.then_some(lp),
                        finish_reason: Some(finish),
                    }],
                    usage: UsageJson::from(fin.usage),
                };
                return Ok(HttpResponse::Ok().json(response));
            }
            Event::Error { error, .. } => return Err(ApiError::from_tandem(&error, "messages")),
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
    format: impl Fn(&str, usize) -> ChatFormat,
    f: &Fields,
) -> Result<HttpResponse, ApiError> {
    let events = ready
        .handle
        .generate_choices(request, choices.best_of)
        .await
        .map_err(|e| {
            choices.name_field(limit_field_as_sent(
                ApiError::from_tandem(&e, "messages"),
                f,
            ))
        })?;
    let id = format!("chatcmpl-{}", events.ids()[0].0);
    if stream {
        let formats = (0..events.len()).map(|i| format(&id, i)).collect();
        return Ok(SseStream::choices(events, formats).into_response());
    }
    let collected = choices::collect(events, choices)
        .await
        .map_err(|e| ApiError::from_tandem(&e, "messages"))?;
    let first = format(&id, 0);
    let response = ChatResponse {
        id,
        object: "chat.completion",
        created: first.created,
        model: ready.model_name.clone(),
        system_fingerprint: SYSTEM_FINGERPRINT,
        choices: choices::chat_choices(
            &collected,
            first.logprobs,
            ready.handle.tokenizer(),
            |index| {
                first
                    .calls
                    .is_some()
                    .then(|| choice_call_prefix(&first.id, index))
            },
        ),
        usage: collected.usage,
    };
    Ok(HttpResponse::Ok().json(response))
}

/// The call ids' prefix of choice `index` of the response `id`
/// (`chatcmpl-{request}`): ids are `call_{request}_{index}_{n}`, the same
/// streamed or whole.
fn choice_call_prefix(id: &str, index: usize) -> String {
    let request = id.strip_prefix("chatcmpl-").unwrap_or(id);
    format!("call_{request}_{index}")
}

/// A chat body, checked (the prompt is rendered from `messages` later).
#[derive(Debug, Clone, PartialEq)]
pub struct Parsed {
    pub messages: Vec<ChatMessage>,
    /// The shared fields, with the logprobs options filled in.
    pub common: CommonParams,
    pub logprobs: bool,
    pub add_generation_prompt: bool,
    /// `tools`, `tool_choice`, `parallel_tool_calls`; `None` without tools.
    pub tools: Option<ToolRequest>,
}

/// Reads and checks every field of a chat body (no I/O: the fuzz tests
/// drive it directly). Errors are 400s that name the field.
pub fn parse(f: &Fields) -> Result<Parsed, ApiError> {
    let messages = parse_messages(f)?;
    let tools = tools::parse_tools(f)?;
    let mut common = CommonParams::parse(f, &["max_completion_tokens", "max_tokens"])?;
    let logprobs = f.get::<bool>("logprobs")?.unwrap_or(false);
    let top = f.int_in("top_logprobs", 0, MAX_TOP_LOGPROBS as i64)?;
    if top.is_some() && !logprobs {
        return Err(ApiError::invalid_field(
            "top_logprobs",
            "requires `logprobs` to be true",
        ));
    }
    common.sampling.logprobs = logprobs;
    common.sampling.top_logprobs = top.unwrap_or(0) as usize;
    let add_generation_prompt = f.get::<bool>("add_generation_prompt")?.unwrap_or(true);
    Ok(Parsed {
        messages,
        common,
        logprobs,
        add_generation_prompt,
        tools,
    })
}

/// The prompt, with the request's tools told to the model the way its
/// template expects (`tools.rs`), and the tool-call grammar added to the
/// request's constraints.
fn render_prompt(
    ready: &Ready,
    messages: &mut Vec<ChatMessage>,
    add_generation_prompt: bool,
    tools: &Option<ToolRequest>,
    common: &mut CommonParams,
) -> Result<String, ApiError> {
    let knows_tools = ready.template.knows_tools();
    if !knows_tools {
        tools::write_back_all(messages);
    }
    let Some(t) = tools else {
        return ready.template.render(messages, add_generation_prompt);
    };
    if let Some(grammar) = t.constraint(knows_tools) {
        if common.constraints.grammar.is_some() {
            return Err(ApiError::invalid_field(
                "tools",
                "tool calls with `tool_choice` other than `none` cannot be combined with a `response_format` or `tandem.grammar`",
            ));
        }
        common.constraints.grammar = Some(grammar);
    }
    if knows_tools {
        ready
            .template
            .render_with_tools(messages, add_generation_prompt, Some(&t.raw))
    } else {
        t.add_tool_prompt(messages);
        ready.template.render(messages, add_generation_prompt)
    }
}

/// The library names the token limit `max_tokens`; a client that sent
/// `max_completion_tokens` should see that name instead.
fn limit_field_as_sent(mut e: ApiError, f: &Fields) -> ApiError {
    if e.param.as_deref() == Some("max_tokens") && f.raw("max_completion_tokens").is_some() {
        e.param = Some("max_completion_tokens".into());
        e.message = e.message.replace("`max_tokens`", "`max_completion_tokens`");
    }
    e
}

/// `messages`: a non-empty list of `{role, content}`.
fn parse_messages(f: &Fields) -> Result<Vec<ChatMessage>, ApiError> {
    let raw = f
        .raw("messages")
        .ok_or_else(|| ApiError::missing_field("messages"))?;
    let Value::Array(items) = raw else {
        return Err(ApiError::invalid_field(
            "messages",
            format!("expected a list of messages, got {}", describe(raw)),
        ));
    };
    if items.is_empty() {
        return Err(ApiError::invalid_field(
            "messages",
            "must hold at least one message",
        ));
    }
    items
        .iter()
        .enumerate()
        .map(|(i, m)| parse_message(i, m))
        .collect()
}

fn parse_message(i: usize, m: &Value) -> Result<ChatMessage, ApiError> {
    let Value::Object(map) = m else {
        return Err(ApiError::invalid_field(
            format!("messages[{i}]"),
            format!("expected an object, got {}", json_kind(m)),
        ));
    };
    let m = Fields::from_map(map.clone());
    let role_field = format!("messages[{i}].role");
    let role: String = m
        .get_as("role", &role_field)?
        .ok_or_else(|| ApiError::missing_field(&role_field))?;
    if !ROLES.contains(&role.as_str()) {
        return Err(ApiError::invalid_field(
            role_field,
            format!("must be one of {}, got `{role}`", ROLES.join(", ")),
        ));
    }
    let content = match m.raw("content") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for (j, part) in parts.iter().enumerate() {
                let field = format!("messages[{i}].content[{j}]");
                let kind = part.get("type").and_then(Value::as_str);
                match (kind, part.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(t)) => text.push_str(t),
                    (Some("text"), None) => {
                        return Err(ApiError::invalid_field(
                            field + ".text",
                            "expected a string",
                        ))
                    }
                    (other, _) => {
                        return Err(ApiError::unsupported(
                            field + ".type",
                            format!("only text parts are supported, got {other:?}"),
                        ))
                    }
                }
            }
            text
        }
        Some(other) => {
            return Err(ApiError::invalid_field(
                format!("messages[{i}].content"),
                format!(
                    "expected a string or a list of text parts, got {}",
                    describe(other)
                ),
            ))
        }
    };
    let (tool_calls, tool_call_id) = tools::message_tool_fields(map, i)?;
    Ok(ChatMessage {
        role,
        content,
        tool_calls,
        tool_call_id,
    })
}

/// Builds chat stream chunks for one request.
struct ChatFormat {
    id: String,
    created: u64,
    ready: Arc<Ready>,
    logprobs: bool,
    include_usage: bool,
    /// The choice this formatter streams.
    index: usize,
    /// Splits the streamed text into content and tool calls, when the
    /// request has tools to call.
    calls: Option<CallStream>,
}

impl ChatFormat {
    fn chunk(&self, choices: Vec<ChatChunkChoice>, usage: Option<UsageJson>) -> String {
        let chunk = ChatChunk {
            id: self.id.clone(),
            object: "chat.completion.chunk",
            created: self.created,
            model: self.ready.model_name.clone(),
            system_fingerprint: SYSTEM_FINGERPRINT,
            choices,
            usage: self.include_usage.then_some(usage),
        };
        serde_json::to_string(&chunk).unwrap_or_default()
    }

    fn choice(
        &self,
        delta: ChatDelta,
        logprobs: Option<ChatLogprobs>,
        finish: Option<&'static str>,
    ) -> ChatChunkChoice {
        ChatChunkChoice {
            index: self.index,
            delta,
            logprobs,
            finish_reason: finish,
        }
    }
}

impl ChunkFormatter for ChatFormat {
    fn start(&mut self) -> Vec<String> {
        let delta = ChatDelta {
            role: Some("assistant"),
            content: Some(String::new()),
            tool_calls: None,
        };
        vec![self.chunk(vec![self.choice(delta, None, None)], None)]
    }

    fn tokens(&mut self, text: String, tokens: Vec<TokenInfo>) -> Option<String> {
        if text.is_empty() && tokens.is_empty() {
            return None;
        }
        let logprobs = self.logprobs.then(|| {
            let mut lp = ChatLogprobs::default();
            lp.extend(self.ready.handle.tokenizer(), &tokens, &text);
            lp
        });
        let (content, calls) = match self.calls.as_mut() {
            Some(splitter) => splitter.push(&text),
            None => (text, Vec::new()),
        };
        if content.is_empty() && calls.is_empty() && logprobs.is_none() {
            return None;
        }
        let delta = ChatDelta {
            role: None,
            content: (!content.is_empty() || calls.is_empty()).then_some(content),
            tool_calls: (!calls.is_empty()).then_some(calls),
        };
        Some(self.chunk(vec![self.choice(delta, logprobs, None)], None))
    }

    fn finished(&mut self, finished: &Finished) -> Vec<String> {
        let mut reason = finish_reason(finished.reason);
        let mut out = Vec::new();
        if let Some(splitter) = self.calls.as_mut() {
            let held = splitter.finish();
            if splitter.called() {
                reason = "tool_calls";
            } else if !held.is_empty() {
                let delta = ChatDelta {
                    content: Some(held),
                    ..ChatDelta::default()
                };
                out.push(self.chunk(vec![self.choice(delta, None, None)], None));
            }
        }
        out.push(self.chunk(
            vec![self.choice(ChatDelta::default(), None, Some(reason))],
            None,
        ));
        out
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

    fn messages(json: &str) -> Result<Vec<ChatMessage>, ApiError> {
        parse_messages(&parse_object(json.as_bytes()).unwrap())
    }

    #[test]
    fn message_forms_and_errors() {
        let m = messages(
            r#"{"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]},
                {"role":"assistant","content":null}]}"#,
        )
        .unwrap();
        assert_eq!((m[0].content.as_str(), m[1].content.as_str()), ("ab", ""));
        let param = |json: &str| messages(json).unwrap_err().param.unwrap_or_default();
        assert_eq!(param(r#"{}"#), "messages");
        assert_eq!(param(r#"{"messages":[]}"#), "messages");
        assert_eq!(param(r#"{"messages":"hi"}"#), "messages");
        assert_eq!(
            param(r#"{"messages":[{"role":"robot","content":"x"}]}"#),
            "messages[0].role"
        );
        assert_eq!(
            param(r#"{"messages":[{"content":"x"}]}"#),
            "messages[0].role"
        );
        assert_eq!(
            param(r#"{"messages":[{"role":"user","content":5}]}"#),
            "messages[0].content"
        );
        assert_eq!(
            param(r#"{"messages":[{"role":"user","content":[{"type":"image_url"}]}]}"#),
            "messages[0].content[0].type"
        );
    }
}
