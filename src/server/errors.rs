//! [`ApiError`]: every HTTP error of the server, as an OpenAI-style JSON body
//! `{"error": {"message", "type", "param", "code"}}`.
//!
//! There is one mapping from library errors to HTTP status codes,
//! [`ApiError::from_tandem`], an exhaustive `match` so that a new error
//! variant cannot silently become a 500. Client mistakes are 400 with `param`
//! naming the offending field (OpenAI's spelling, e.g. `repetition_penalty`),
//! a full queue is 429, a server that is loading or shutting down is 503.

use actix_web::http::StatusCode;
use actix_web::{HttpResponse, ResponseError};
use serde::Serialize;

use crate::api::TandemError;
use crate::sampler::SamplerError;
use crate::scheduler::SchedulerError;

/// The `Retry-After` of a 429, in seconds.
pub const RETRY_AFTER_SECS: u64 = 1;

/// An error answer of the HTTP API.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// Human-readable message; names the field and the limit for 400s.
    pub message: String,
    /// The request field at fault, when there is one.
    pub param: Option<String>,
    /// A fixed machine-readable code (`invalid_value`, `overloaded`, …).
    pub code: &'static str,
}

/// The JSON body of an error.
#[derive(Serialize)]
struct ErrorBody<'a> {
    error: ErrorDetail<'a>,
}

#[derive(Serialize)]
struct ErrorDetail<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    param: Option<&'a str>,
    code: &'static str,
}

impl ApiError {
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            param: None,
            code,
        }
    }

    /// An error answered for the HTTP framework (a malformed or slow
    /// request head: see [`conn`](super::conn)).
    pub fn framework(status: StatusCode, code: &'static str, message: &str) -> Self {
        Self::new(status, code, message)
    }

    /// 400: `field` has a wrong type or an out-of-range value.
    pub fn invalid_field(field: impl Into<String>, reason: impl std::fmt::Display) -> Self {
        let field = field.into();
        Self {
            status: StatusCode::BAD_REQUEST,
            message: format!("invalid `{field}`: {reason}"),
            param: Some(field),
            code: "invalid_value",
        }
    }

    /// 400: `field` asks for something this server does not do.
    pub fn unsupported(field: impl Into<String>, reason: impl std::fmt::Display) -> Self {
        let field = field.into();
        Self {
            status: StatusCode::BAD_REQUEST,
            message: format!("unsupported `{field}`: {reason}"),
            param: Some(field),
            code: "unsupported_value",
        }
    }

    /// 400: a required field is absent.
    pub fn missing_field(field: &str) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: format!("missing required field `{field}`"),
            param: Some(field.to_string()),
            code: "missing_required_parameter",
        }
    }

    /// 400: the body is not a JSON object.
    pub fn malformed_json(reason: impl std::fmt::Display) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_json",
            format!("the request body is not valid JSON: {reason}"),
        )
    }

    /// 401: missing or wrong bearer key.
    pub fn unauthorized() -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "invalid_api_key",
            "missing or incorrect API key: send `Authorization: Bearer <key>`",
        )
    }

    /// 401 with a specific reason.
    pub fn unauthorized_because(reason: &str) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, "invalid_api_key", reason)
    }

    /// 404: no such route or model.
    pub fn not_found(what: impl std::fmt::Display) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found", format!("{what}"))
    }

    /// 404: no model of that id (OpenAI's `model_not_found`, `param: model`).
    pub fn model_not_found(id: &str) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            message: format!("the model `{id}` does not exist"),
            param: Some("model".into()),
            code: "model_not_found",
        }
    }

    /// 413: the body is larger than the limit.
    pub fn payload_too_large(limit: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
            format!("the request body is larger than the limit of {limit} bytes"),
        )
    }

    /// 408: the body did not arrive within the body timeout.
    pub fn body_timeout(timeout: std::time::Duration) -> Self {
        Self::new(
            StatusCode::REQUEST_TIMEOUT,
            "request_timeout",
            format!(
                "the request body did not arrive within {} s",
                timeout.as_secs_f64()
            ),
        )
    }

    /// 503: the model is still loading.
    pub fn loading() -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "model_loading",
            "the model is still loading; retry when GET /health answers 200",
        )
    }

    /// 503: the server is shutting down.
    pub fn shutting_down() -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "shutting_down",
            "the server is shutting down",
        )
    }

    /// 500: a failure on the server's side.
    pub fn internal(message: impl std::fmt::Display) -> Self {
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal_error",
            message.to_string(),
        )
    }

    /// Maps a library error to its HTTP answer. `prompt_field` is what the
    /// route calls its prompt (`prompt` or `messages`), so that prompt errors
    /// name the field the client actually sent.
    pub fn from_tandem(e: &TandemError, prompt_field: &str) -> Self {
        let message = e.to_string();
        let code = e.error_type();
        let bad = |param: &str| Self {
            status: StatusCode::BAD_REQUEST,
            message: message.clone(),
            param: Some(param.to_string()),
            code,
        };
        match e {
            TandemError::InvalidRequest { field, .. } => bad(field),
            TandemError::Tokenizer { .. } => Self {
                message: format!("invalid `{prompt_field}`: {message}"),
                ..bad(prompt_field)
            },
            TandemError::Unavailable => Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                code,
                "the scheduler is not running",
            ),
            TandemError::ThreadSpawn { .. } | TandemError::Internal(_) => {
                Self::new(StatusCode::INTERNAL_SERVER_ERROR, code, message)
            }
            TandemError::Scheduler(s) => match s {
                SchedulerError::EmptyPrompt | SchedulerError::PromptTooLong { .. } => {
                    bad(prompt_field)
                }
                // Only `/v1/completions` takes token ids from the client, and
                // its field is `prompt`: name the id's position there. Chat
                // prompts come from the template, so only the field is named.
                SchedulerError::TokenOutOfVocab { index, .. } if prompt_field == "prompt" => {
                    bad(&format!("prompt[{index}]"))
                }
                SchedulerError::TokenOutOfVocab { .. } => bad(prompt_field),
                SchedulerError::ZeroMaxNewTokens | SchedulerError::ExceedsKvCapacity { .. } => {
                    bad("max_tokens")
                }
                SchedulerError::Sampling(SamplerError::InvalidOption { field, .. }) => {
                    bad(openai_field_name(field))
                }
                SchedulerError::Sampling(_) => bad("sampling"),
                SchedulerError::InvalidSpec(_) => bad("tandem"),
                SchedulerError::InvalidConstraint { field, .. } => bad(field),
                SchedulerError::Overloaded { .. } => {
                    Self::new(StatusCode::TOO_MANY_REQUESTS, code, message)
                }
                SchedulerError::ShuttingDown | SchedulerError::EngineGone => {
                    Self::new(StatusCode::SERVICE_UNAVAILABLE, code, message)
                }
                SchedulerError::InvalidConfig { .. }
                | SchedulerError::InvalidEngineInfo { .. }
                | SchedulerError::Engine(_)
                | SchedulerError::EngineSpawn(_)
                | SchedulerError::Protocol { .. } => {
                    Self::new(StatusCode::INTERNAL_SERVER_ERROR, code, message)
                }
            },
        }
    }

    /// OpenAI's `type` for this status.
    pub fn kind(&self) -> &'static str {
        match self.status.as_u16() {
            401 => "authentication_error",
            429 => "rate_limit_error",
            503 => "service_unavailable",
            400..=499 => "invalid_request_error",
            _ => "server_error",
        }
    }

    /// The JSON body, also used inside an SSE stream for mid-stream errors.
    pub fn body_json(&self) -> String {
        let body = ErrorBody {
            error: ErrorDetail {
                message: &self.message,
                kind: self.kind(),
                param: self.param.as_deref(),
                code: self.code,
            },
        };
        // Serializing plain strings cannot fail; fall back to a fixed body anyway.
        serde_json::to_string(&body)
            .unwrap_or_else(|_| r#"{"error":{"message":"internal error"}}"#.into())
    }
}

/// The OpenAI request field for a [`SamplingOptions`] field name.
///
/// [`SamplingOptions`]: crate::sampler::SamplingOptions
pub fn openai_field_name(library_field: &str) -> &str {
    match library_field {
        "repeat_penalty" => "repetition_penalty",
        other => other,
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status.as_u16(), self.message)
    }
}

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        self.status
    }

    fn error_response(&self) -> HttpResponse {
        let mut response = HttpResponse::build(self.status);
        response.content_type("application/json");
        if self.status == StatusCode::TOO_MANY_REQUESTS {
            // The queue drains as fast as sequences finish: a second is the
            // right order of magnitude, and clients that honour the header
            // (the `openai` client does) back off instead of hammering.
            response.insert_header(("retry-after", RETRY_AFTER_SECS.to_string()));
        }
        if self.status == StatusCode::REQUEST_TIMEOUT {
            // The rest of a slow body is not worth waiting for.
            response.force_close();
        }
        response.body(self.body_json())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn library_errors_map_to_statuses_and_fields() {
        let overloaded = TandemError::Scheduler(SchedulerError::Overloaded {
            queued: 3,
            limit: 3,
        });
        assert_eq!(ApiError::from_tandem(&overloaded, "prompt").status, 429);
        let too_long = TandemError::Scheduler(SchedulerError::PromptTooLong {
            len: 9,
            context_len: 8,
        });
        let e = ApiError::from_tandem(&too_long, "messages");
        assert_eq!(
            (e.status.as_u16(), e.param.as_deref()),
            (400, Some("messages"))
        );
        let sampling =
            TandemError::Scheduler(SchedulerError::Sampling(SamplerError::InvalidOption {
                field: "repeat_penalty",
                reason: "x".into(),
            }));
        let e = ApiError::from_tandem(&sampling, "prompt");
        assert_eq!(e.param.as_deref(), Some("repetition_penalty"));
        let out_of_vocab = TandemError::Scheduler(SchedulerError::TokenOutOfVocab {
            index: 1,
            token: 99,
            vocab_size: 50,
        });
        let e = ApiError::from_tandem(&out_of_vocab, "prompt");
        assert_eq!(
            (e.status.as_u16(), e.param.as_deref()),
            (400, Some("prompt[1]"))
        );
        let spawn = TandemError::ThreadSpawn {
            thread: "t",
            reason: "no".into(),
        };
        assert_eq!(ApiError::from_tandem(&spawn, "prompt").status, 500);
        let gone = TandemError::Scheduler(SchedulerError::ShuttingDown);
        assert_eq!(ApiError::from_tandem(&gone, "prompt").status, 503);
        assert_eq!(
            ApiError::from_tandem(&TandemError::Unavailable, "p").status,
            503
        );
    }

    #[test]
    fn body_has_the_openai_shape() {
        let e = ApiError::invalid_field("temperature", "must be in [0, 2], got 3");
        let v: serde_json::Value = serde_json::from_str(&e.body_json()).unwrap();
        assert_eq!(v["error"]["param"], "temperature");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["code"], "invalid_value");
        assert!(v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("temperature"));
    }
}
