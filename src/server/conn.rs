//! [`JsonErrors`]: the connection wrapper that gives the HTTP framework's
//! own error answers an OpenAI-shaped JSON body.
//!
//! actix-http answers a request it cannot parse (an invalid header value,
//! `Content-Length: -1`, a NUL in a header, an oversized head or URI) or
//! whose head does not arrive in time by itself, before any handler runs:
//! a bare `400`, `431` or `408` with `content-length: 0`, and then closes
//! the connection. It offers no hook for those answers, so the wrapper sits
//! between the socket and actix-http and replaces them on the way out: a
//! write that begins a response with an error status and an empty body is
//! swapped for the same status with a JSON error body (and
//! `connection: close`, which actix-http does next anyway). The handlers'
//! own errors always carry a body and pass through untouched, as does
//! everything else.
//!
//! The replacement is written before any later byte (there is none: the
//! connection is closing) and flushed by `poll_flush` / `poll_shutdown`.

use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::errors::ApiError;
use actix_web::http::StatusCode;

/// A connection whose bodiless framework errors become JSON ones.
pub struct JsonErrors<T> {
    inner: T,
    /// Replacement bytes not written yet.
    pending: Vec<u8>,
    written: usize,
}

impl<T> JsonErrors<T> {
    pub fn new(inner: T) -> Self {
        Self {
            inner,
            pending: Vec::new(),
            written: 0,
        }
    }

    pub fn get_ref(&self) -> &T {
        &self.inner
    }
}

/// The status of a bodiless error response that `buf` begins with.
pub fn bodiless_error_status(buf: &[u8]) -> Option<StatusCode> {
    let rest = buf.strip_prefix(b"HTTP/1.1 ")?;
    let code = std::str::from_utf8(rest.get(..3)?)
        .ok()?
        .parse::<u16>()
        .ok()?;
    if !(400..600).contains(&code) {
        return None;
    }
    let end = buf.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = String::from_utf8_lossy(&buf[..end + 2]).to_ascii_lowercase();
    head.contains("\r\ncontent-length: 0\r\n")
        .then(|| StatusCode::from_u16(code).ok())
        .flatten()
}

/// The JSON answer that replaces a bodiless framework error.
pub fn json_error_response(status: StatusCode) -> Vec<u8> {
    let error = match status.as_u16() {
        400 => ApiError::framework(
            status,
            "invalid_http_request",
            "malformed HTTP request: the request line or a header is invalid",
        ),
        408 => ApiError::framework(
            status,
            "request_timeout",
            "the request head did not arrive in time",
        ),
        414 | 431 => ApiError::framework(
            status,
            "request_head_too_large",
            "the request line or headers are too large",
        ),
        _ => ApiError::framework(status, "http_error", "the request could not be handled"),
    };
    let body = error.body_json();
    format!(
        "HTTP/1.1 {} {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        status.as_u16(),
        status.canonical_reason().unwrap_or(""),
        body.len()
    )
    .into_bytes()
}

impl<T: AsyncWrite + Unpin> JsonErrors<T> {
    /// Writes what is left of the replacement.
    fn poll_pending(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.written < self.pending.len() {
            let n =
                ready!(Pin::new(&mut self.inner).poll_write(cx, &self.pending[self.written..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.written += n;
        }
        Poll::Ready(Ok(()))
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for JsonErrors<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for JsonErrors<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        ready!(this.poll_pending(cx))?;
        if let Some(status) = bodiless_error_status(buf) {
            tracing::debug!(
                target: super::logging::CLIENT_TARGET,
                status = status.as_u16(),
                "refused a malformed or slow request head"
            );
            this.pending = json_error_response(status);
            this.written = 0;
            // The framework's bytes count as written; ours go out now or
            // at the next flush.
            let _ = this.poll_pending(cx)?;
            return Poll::Ready(Ok(buf.len()));
        }
        Pin::new(&mut this.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.poll_pending(cx))?;
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.poll_pending(cx))?;
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_bodiless_errors_are_replaced() {
        let bare = b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\ndate: x\r\n\r\n";
        assert_eq!(bodiless_error_status(bare), Some(StatusCode::BAD_REQUEST));
        let ours = b"HTTP/1.1 400 Bad Request\r\ncontent-length: 90\r\n\r\n{\"error\":1}";
        assert_eq!(bodiless_error_status(ours), None);
        let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n";
        assert_eq!(bodiless_error_status(ok), None);
        assert_eq!(bodiless_error_status(b"{\"more\": \"body\"}"), None);
        let json = String::from_utf8(json_error_response(
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
        ))
        .unwrap();
        let (head, body) = json.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 431 "));
        assert!(head.contains(&format!("content-length: {}", body.len())));
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["error"]["type"], "invalid_request_error");
    }
}
