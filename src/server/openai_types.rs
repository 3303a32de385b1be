//! OpenAI response shapes (serialize only): completions, chat completions,
//! their streaming chunks, usage, the two logprobs formats and the model
//! list.
//!
//! The shapes follow the OpenAI API reference field for field, including its
//! quirks: a streaming chunk carries `"usage": null` when the client asked
//! for `stream_options.include_usage` and omits the key otherwise; the
//! legacy completions logprobs are four parallel lists whose
//! `top_logprobs` entries are `{token: logprob}` objects; chat logprobs are
//! a list of `{token, logprob, bytes, top_logprobs}`.

use serde::ser::SerializeMap;
use serde::{Serialize, Serializer};

use crate::api::TokenInfo;
use crate::scheduler::{FinishReason, Usage};
use crate::tokenizer::Tokenizer;

/// What OpenAI reports for a log-probability of minus infinity (JSON has no
/// infinities).
pub const NEG_INF_LOGPROB: f32 = -9999.0;

/// OpenAI's `finish_reason` for a library finish reason: end of sequence and
/// stop strings are `stop`, token and context limits are `length`, and a
/// request the server cancelled (shutdown) is `abort`, as vLLM reports it.
pub fn finish_reason(reason: FinishReason) -> &'static str {
    match reason {
        FinishReason::Eos | FinishReason::Stop => "stop",
        FinishReason::Length | FinishReason::ContextFull => "length",
        FinishReason::Cancelled => "abort",
    }
}

fn finite(lp: f32) -> f32 {
    if lp.is_finite() {
        lp
    } else {
        NEG_INF_LOGPROB
    }
}

/// Token counts of a response.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct UsageJson {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    /// As OpenAI reports it: `{"cached_tokens": n}`, the prompt tokens
    /// served from the prefix cache.
    pub prompt_tokens_details: PromptTokensDetails,
    /// Speculative decoding's share, in OpenAI's predicted-output fields:
    /// draft tokens the model accepted and rejected (0 and 0 when the
    /// request did not draft).
    pub completion_tokens_details: CompletionTokensDetails,
}

/// The breakdown of `completion_tokens`.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct CompletionTokensDetails {
    pub accepted_prediction_tokens: usize,
    pub rejected_prediction_tokens: usize,
}

/// The breakdown of `prompt_tokens`.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct PromptTokensDetails {
    pub cached_tokens: usize,
}

impl From<Usage> for UsageJson {
    fn from(u: Usage) -> Self {
        Self {
            prompt_tokens: u.prompt_tokens,
            completion_tokens: u.completion_tokens,
            total_tokens: u.prompt_tokens + u.completion_tokens,
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens: u.cached_prompt_tokens,
            },
            completion_tokens_details: CompletionTokensDetails {
                accepted_prediction_tokens: u.accepted_draft_tokens,
                rejected_prediction_tokens: u.draft_tokens - u.accepted_draft_tokens,
            },
        }
    }
}

/// `{token: logprob, …}` with the keys in the given (descending) order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TopLogprobMap(pub Vec<(String, f32)>);

impl Serialize for TopLogprobMap {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(self.0.len()))?;
        for (token, lp) in &self.0 {
            map.serialize_entry(token, lp)?;
        }
        map.end()
    }
}

/// Legacy completions logprobs: parallel lists, one entry per token.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<f32>,
    pub top_logprobs: Vec<TopLogprobMap>,
    /// Character offset of each token from the start of the completion text.
    pub text_offset: Vec<usize>,
}

impl CompletionLogprobs {
    /// Appends the tokens of one text chunk (`chunk_text`, starting at
    /// character `chunk_offset` of the completion). Each token's text is its
    /// share of the chunk ([`token_texts`]), so the tokens of a whole
    /// completion concatenate to its text. A chunk without tokens (the
    /// continuation of text held back for a possible stop string) extends
    /// the last token's text.
    pub fn extend(
        &mut self,
        tokenizer: &Tokenizer,
        tokens: &[TokenInfo],
        chunk_offset: usize,
        chunk_text: &str,
    ) {
        if tokens.is_empty() {
            if let Some(last) = self.tokens.last_mut() {
                last.push_str(chunk_text);
            }
            return;
        }
        let mut offset = chunk_offset;
        for (t, text) in tokens
            .iter()
            .zip(token_texts(tokenizer, tokens, chunk_text))
        {
            self.text_offset.push(offset);
            offset += text.chars().count();
            self.tokens.push(text);
            self.token_logprobs
                .push(finite(t.logprob.unwrap_or(NEG_INF_LOGPROB)));
            self.top_logprobs.push(TopLogprobMap(
                t.top_logprobs
                    .iter()
                    .map(|a| (a.text.clone(), finite(a.logprob)))
                    .collect(),
            ));
        }
    }
}

/// The text each of `tokens` contributes to `chunk_text`, the text they
/// produced together: the tokens' own texts ([`Tokenizer::token_text`]) when
/// they concatenate to the chunk, as they do for whole tokens. Otherwise (a
/// character split over byte tokens, a special token the decoder skips, a
/// stop string that cut the chunk) each token keeps its own text while the
/// rest of the chunk starts with it, and gets nothing otherwise; the last
/// token takes what is left. Either way the texts concatenate to
/// `chunk_text`, so `"".join(tokens) == text` holds for every tokenizer.
pub fn token_texts(tokenizer: &Tokenizer, tokens: &[TokenInfo], chunk_text: &str) -> Vec<String> {
    let own: Vec<String> = tokens
        .iter()
        .map(|t| tokenizer.token_text(t.id).unwrap_or_default())
        .collect();
    if own.concat() == chunk_text {
        return own;
    }
    let mut rest = chunk_text;
    let n = own.len();
    own.into_iter()
        .enumerate()
        .map(|(i, text)| {
            if i + 1 == n {
                std::mem::take(&mut rest).to_owned()
            } else if !text.is_empty() && rest.starts_with(&text) {
                rest = &rest[text.len()..];
                text
            } else {
                String::new()
            }
        })
        .collect()
}

/// One alternative of a chat token.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatTopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

/// One chat token with its log-probability and alternatives.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatTokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<ChatTopLogprob>,
}

/// Chat logprobs: `{"content": [...], "refusal": null}`.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ChatLogprobs {
    pub content: Vec<ChatTokenLogprob>,
    pub refusal: Option<String>,
}

impl ChatLogprobs {
    /// Appends the tokens of one chunk of text `chunk_text`; their `token`s
    /// are their shares of it ([`token_texts`]). A chunk without tokens
    /// extends the last token.
    pub fn extend(&mut self, tokenizer: &Tokenizer, tokens: &[TokenInfo], chunk_text: &str) {
        if tokens.is_empty() {
            if let Some(last) = self.content.last_mut() {
                last.token.push_str(chunk_text);
                last.bytes = last.token.as_bytes().to_vec();
            }
            return;
        }
        for (t, token) in tokens
            .iter()
            .zip(token_texts(tokenizer, tokens, chunk_text))
        {
            self.content.push(ChatTokenLogprob {
                bytes: token.as_bytes().to_vec(),
                token,
                logprob: finite(t.logprob.unwrap_or(NEG_INF_LOGPROB)),
                top_logprobs: t
                    .top_logprobs
                    .iter()
                    .map(|a| ChatTopLogprob {
                        token: a.text.clone(),
                        logprob: finite(a.logprob),
                        bytes: a.text.as_bytes().to_vec(),
                    })
                    .collect(),
            });
        }
    }
}

/// One choice of a (streamed or whole) text completion.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CompletionChoice {
    pub index: usize,
    pub text: String,
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: Option<&'static str>,
}

/// `text_completion` object; also each streamed chunk.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CompletionResponse {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub system_fingerprint: &'static str,
    pub choices: Vec<CompletionChoice>,
    /// Outer `None`: no key; `Some(None)`: `"usage": null`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<UsageJson>>,
}

/// The assistant's message in a whole chat response.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatMessageOut {
    pub role: &'static str,
    /// `null` when the answer is only tool calls.
    pub content: Option<String>,
    /// The calls the answer makes (`tools.rs`); absent when none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<serde_json::Value>>,
}

/// One choice of a whole chat response.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatChoice {
    pub index: usize,
    pub message: ChatMessageOut,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
}

/// OpenAI's `system_fingerprint`: the server build that answered (the
/// same seed and fingerprint give the same tokens).
pub const SYSTEM_FINGERPRINT: &str = concat!("tandem-", env!("CARGO_PKG_VERSION"));

/// `chat.completion` object.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatResponse {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub system_fingerprint: &'static str,
    pub choices: Vec<ChatChoice>,
    pub usage: UsageJson,
}

/// The delta of a streamed chat chunk.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ChatDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    /// Finished tool calls (each with its index, id, name and arguments).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<serde_json::Value>>,
}

/// One choice of a streamed chat chunk.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatChunkChoice {
    pub index: usize,
    pub delta: ChatDelta,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
}

/// `chat.completion.chunk` object.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatChunk {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub system_fingerprint: &'static str,
    pub choices: Vec<ChatChunkChoice>,
    /// Outer `None`: no key; `Some(None)`: `"usage": null`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<UsageJson>>,
}

/// One entry of `GET /v1/models`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelCard {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
    /// Context length in tokens (a vLLM extension many clients read).
    pub max_model_len: usize,
    /// The model's own name (GGUF `general.name`, a folder's config
    /// `_name_or_path`), or the id when the files name none; vLLM's field.
    pub root: String,
}

/// `GET /v1/models`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelList {
    pub object: &'static str,
    pub data: Vec<ModelCard>,
}

/// Seconds since the Unix epoch (0 if the clock is before it).
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finish_reasons_follow_openai() {
        assert_eq!(finish_reason(FinishReason::Eos), "stop");
        assert_eq!(finish_reason(FinishReason::Stop), "stop");
        assert_eq!(finish_reason(FinishReason::Length), "length");
        assert_eq!(finish_reason(FinishReason::ContextFull), "length");
        assert_eq!(finish_reason(FinishReason::Cancelled), "abort");
    }

    #[test]
    fn top_logprobs_keep_their_order_and_usage_null_is_explicit() {
        let m = TopLogprobMap(vec![("b".into(), -0.5), ("a".into(), -1.0)]);
        assert_eq!(serde_json::to_string(&m).unwrap(), r#"{"b":-0.5,"a":-1.0}"#);
        let chunk = ChatChunk {
            id: "x".into(),
            object: "chat.completion.chunk",
            created: 0,
            model: "m".into(),
            system_fingerprint: SYSTEM_FINGERPRINT,
            choices: vec![],
            usage: Some(None),
        };
        let v = serde_json::to_value(&chunk).unwrap();
        assert!(v.get("usage").is_some_and(|u| u.is_null()));
        let chunk = ChatChunk {
            usage: None,
            ..chunk
        };
        assert!(serde_json::to_value(&chunk).unwrap().get("usage").is_none());
    }
}
