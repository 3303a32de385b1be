//! Request bodies: read with a size limit, parsed into a JSON object, and
//! read field by field so that every type error names its field.
//!
//! Deserializing a whole request struct with serde would report a wrong type
//! as "invalid type: string, expected f32 at line 1 column 40", which does
//! not tell a client *which* field is wrong. [`Fields`] deserializes one
//! field at a time instead and puts the field's name into the error. Unknown
//! fields are ignored, as OpenAI clients send many the server has no use for
//! (`user`, `metadata`, `store`, …); `null` counts as absent.

use std::sync::Arc;

use actix_web::{web, HttpRequest, HttpResponse};
use futures_util::StreamExt;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use super::errors::ApiError;
use super::state::{AppState, Ready};

/// Reads the whole body, refusing more than `limit` bytes (413) as soon as
/// the `Content-Length` header or the bytes received say so.
pub async fn read_limited(
    req: &HttpRequest,
    mut payload: web::Payload,
    limit: usize,
) -> Result<web::Bytes, ApiError> {
    read_into(req, &mut payload, limit).await
}

async fn read_into(
    req: &HttpRequest,
    payload: &mut web::Payload,
    limit: usize,
) -> Result<web::Bytes, ApiError> {
    let declared = req
        .headers()
        .get(actix_web::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if declared.is_some_and(|n| n > limit) {
        return Err(ApiError::payload_too_large(limit));
    }
    let mut body = web::BytesMut::with_capacity(declared.unwrap_or(1024).min(limit));
    while let Some(chunk) = payload.next().await {
        let chunk =
            chunk.map_err(|e| ApiError::malformed_json(format!("reading the body: {e}")))?;
        if body.len() + chunk.len() > limit {
            return Err(ApiError::payload_too_large(limit));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body.freeze())
}

/// [`read_limited`] within `timeout`: a client that sends its headers and
/// then trickles the body, or declares a longer `Content-Length` than it
/// sends, gets a 408 once `timeout` has passed since the handler started
/// reading, instead of holding a connection forever. The header phase has
/// its own bound (actix-web's client request timeout). The payload stays
/// with the caller: pass it to [`respond`] so that the connection is
/// closed after the 408 rather than drained.
pub async fn read_body(
    req: &HttpRequest,
    payload: &mut web::Payload,
    limit: usize,
    timeout: std::time::Duration,
) -> Result<web::Bytes, ApiError> {
    match tokio::time::timeout(timeout, read_into(req, payload, limit)).await {
        Ok(body) => body,
        Err(_) => {
            tracing::debug!(?timeout, "timed out reading a request body");
            Err(ApiError::body_timeout(timeout))
        }
    }
}

/// The response for a request whose body may be unread. A 408 keeps the
/// request's `payload` alive inside its body until the last byte is
/// written: actix-http then sees an unread payload that nobody consumes and
/// closes the connection, where a dropped one would be drained, as long as
/// a trickling client cares to keep sending.
pub fn respond(response: HttpResponse, payload: web::Payload) -> HttpResponse {
    if response.status() != actix_web::http::StatusCode::REQUEST_TIMEOUT {
        return response;
    }
    let (head, body) = response.into_parts();
    let bytes = actix_web::body::to_bytes_limited(body, usize::MAX);
    // An ApiError body is bytes already: this resolves at once.
    let bytes = match futures_util::FutureExt::now_or_never(bytes) {
        Some(Ok(Ok(b))) => b,
        _ => web::Bytes::new(),
    };
    let mut out = HttpResponse::build(head.status());
    for (name, value) in head.headers() {
        out.insert_header((name.clone(), value.clone()));
    }
    out.force_close().body(HoldPayload {
        _payload: payload,
        body: Some(bytes),
    })
}

/// One chunk of body, with the request's payload held until it is sent.
struct HoldPayload {
    _payload: web::Payload,
    body: Option<web::Bytes>,
}

impl actix_web::body::MessageBody for HoldPayload {
    type Error = std::convert::Infallible;

    fn size(&self) -> actix_web::body::BodySize {
        actix_web::body::BodySize::Sized(self.body.as_ref().map_or(0, |b| b.len() as u64))
    }

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<web::Bytes, Self::Error>>> {
        std::task::Poll::Ready(self.body.take().map(Ok))
    }
}

/// A generation route's preamble: the caller authorized, the model ready,
/// and the body read within the server's limits and parsed as a JSON
/// object.
pub async fn accept_json(
    req: &HttpRequest,
    payload: &mut web::Payload,
    state: &AppState,
) -> Result<(Arc<Ready>, Fields), ApiError> {
    state.authorize(req)?;
    let ready = state.ready()?;
    let limits = &state.config;
    let body = read_body(req, payload, limits.body_limit, limits.body_timeout).await?;
    Ok((ready, parse_object(&body)?))
}

/// Parses a body that must be a JSON object.
pub fn parse_object(body: &[u8]) -> Result<Fields, ApiError> {
    let value: Value = serde_json::from_slice(body).map_err(ApiError::malformed_json)?;
    match value {
        Value::Object(map) => Ok(Fields { map }),
        other => Err(ApiError::malformed_json(format!(
            "expected a JSON object, got {}",
            json_kind(&other)
        ))),
    }
}

/// The name of a JSON value's type, for messages.
pub fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// A JSON object read one typed field at a time.
#[derive(Debug, Clone, Default)]
pub struct Fields {
    map: Map<String, Value>,
}

impl Fields {
    /// Wraps an object (a nested one, such as `stream_options`).
    pub fn from_map(map: Map<String, Value>) -> Self {
        Self { map }
    }

    /// The raw value of a field; `None` when absent or `null`.
    pub fn raw(&self, name: &str) -> Option<&Value> {
        self.map.get(name).filter(|v| !v.is_null())
    }

    /// A field of type `T`, `None` when absent or `null`. `path` is how the
    /// field is named in errors (e.g. `stream_options.include_usage`).
    pub fn get_as<T: DeserializeOwned>(
        &self,
        name: &str,
        path: &str,
    ) -> Result<Option<T>, ApiError> {
        match self.raw(name) {
            None => Ok(None),
            Some(v) => T::deserialize(v)
                .map(Some)
                .map_err(|e| ApiError::invalid_field(path, e)),
        }
    }

    /// A top-level field of type `T`.
    pub fn get<T: DeserializeOwned>(&self, name: &str) -> Result<Option<T>, ApiError> {
        self.get_as(name, name)
    }

    /// A nested object field, as [`Fields`].
    pub fn object(&self, name: &str) -> Result<Option<Fields>, ApiError> {
        match self.raw(name) {
            None => Ok(None),
            Some(Value::Object(m)) => Ok(Some(Fields::from_map(m.clone()))),
            Some(other) => Err(ApiError::invalid_field(
                name,
                format!("expected an object, got {}", json_kind(other)),
            )),
        }
    }

    /// A float field checked against an inclusive range.
    pub fn f32_in(&self, name: &str, lo: f32, hi: f32) -> Result<Option<f32>, ApiError> {
        let v: Option<f64> = self.get(name)?;
        match v {
            None => Ok(None),
            Some(x) if x.is_finite() && (lo as f64..=hi as f64).contains(&x) => Ok(Some(x as f32)),
            Some(x) => Err(ApiError::invalid_field(
                name,
                format!("must be in [{lo}, {hi}], got {x}"),
            )),
        }
    }

    /// An integer field checked against an inclusive range.
    pub fn int_in(&self, name: &str, lo: i64, hi: i64) -> Result<Option<i64>, ApiError> {
        match self.raw(name) {
            None => Ok(None),
            Some(v) => {
                let x = v.as_i64().ok_or_else(|| {
                    ApiError::invalid_field(
                        name,
                        format!("expected an integer, got {}", describe(v)),
                    )
                })?;
                if (lo..=hi).contains(&x) {
                    Ok(Some(x))
                } else {
                    Err(ApiError::invalid_field(
                        name,
                        format!("must be in [{lo}, {hi}], got {x}"),
                    ))
                }
            }
        }
    }
}

/// A short description of a value for error messages: its type, and the
/// value itself when it is short.
pub fn describe(v: &Value) -> String {
    let text = v.to_string();
    if text.len() <= 40 {
        format!("{} ({text})", json_kind(v))
    } else {
        json_kind(v).to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(json: &str) -> Fields {
        parse_object(json.as_bytes()).unwrap()
    }

    #[test]
    fn type_errors_name_the_field() {
        let f = fields(r#"{"temperature": "hot", "n": 1.5, "stream": null}"#);
        let e = f.get::<f32>("temperature").unwrap_err();
        assert_eq!(e.param.as_deref(), Some("temperature"));
        assert!(e.message.contains("temperature"), "{}", e.message);
        let e = f.int_in("n", 1, 1).unwrap_err();
        assert!(e.message.contains("`n`") && e.message.contains("integer"));
        assert_eq!(f.get::<bool>("stream").unwrap(), None, "null is absent");
    }

    #[test]
    fn ranges_are_checked() {
        let f = fields(r#"{"top_p": 1.5, "top_logprobs": 21}"#);
        let e = f.f32_in("top_p", 0.0, 1.0).unwrap_err();
        assert!(e.message.contains("[0, 1]") && e.message.contains("1.5"));
        assert!(f.int_in("top_logprobs", 0, 20).is_err());
        assert_eq!(fields(r#"{"x": 2}"#).int_in("x", 0, 20).unwrap(), Some(2));
    }

    #[test]
    fn non_objects_are_malformed() {
        assert_eq!(parse_object(b"[1]").unwrap_err().status, 400);
        assert_eq!(parse_object(b"{").unwrap_err().code, "invalid_json");
    }
}
