//! The server's log: `tracing` to stderr, as text or JSON lines, with
//! client mistakes kept out of the ERROR level.
//!
//! actix-http logs every connection it gives up on at ERROR
//! (`actix_http::h1::dispatcher: stream error: …`): a malformed request
//! head, an invalid header value, an oversized URI, a client that vanished
//! mid-write. Those are the client's faults, and anyone who can reach the
//! port could otherwise fill the log at ERROR and trip alerts. [`init`]
//! installs a layer that drops them from ERROR and logs them again at
//! DEBUG under the target [`CLIENT_TARGET`] (`RUST_LOG=tandem::server::client=debug`
//! shows them). The server's own failures stay at ERROR.
//!
//! Colours (ANSI escapes) are used only when stderr is a terminal, so log
//! files and pipelines get plain text; `--log-format json` writes one JSON
//! object per line for log pipelines.

use std::fmt::Write as _;
use std::io::IsTerminal;

use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::EnvFilter;

/// Where client-caused connection errors are logged, at DEBUG.
pub const CLIENT_TARGET: &str = "tandem::server::client";

/// The log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    /// Human-readable lines (coloured only on a terminal).
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

impl std::str::FromStr for LogFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "text" => Ok(Self::Text),
            "json" => Ok(Self::Json),
            other => Err(format!("expected `text` or `json`, got `{other}`")),
        }
    }
}

/// Installs the global subscriber: `RUST_LOG` (default `info`) to stderr in
/// `format`. Fails when a global subscriber is already set.
pub fn init(format: LogFormat) -> Result<(), String> {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let registry = tracing_subscriber::registry()
        .with(filter)
        .with(ClientFaultsAtDebug);
    let result = match format {
        LogFormat::Text => registry
            .with(
                tracing_subscriber::fmt::layer()
                    .with_writer(std::io::stderr)
                    .with_ansi(std::io::stderr().is_terminal()),
            )
            .try_init(),
        LogFormat::Json => registry
            .with(
                tracing_subscriber::fmt::layer()
                    .json()
                    .with_writer(std::io::stderr),
            )
            .try_init(),
    };
    result.map_err(|e| e.to_string())
}

/// Whether an event is actix-http reporting a connection that failed
/// because of its client (see the module docs).
pub fn is_client_fault(target: &str, level: &Level, message: &str) -> bool {
    *level == Level::ERROR
        && target.starts_with("actix_http::h1")
        && [
            "stream error",
            "write zero",
            "Internal server error: unexpected",
        ]
        .iter()
        .any(|p| message.starts_with(p))
}

/// The layer that takes client faults out of ERROR (see the module docs).
pub struct ClientFaultsAtDebug;

impl<S: Subscriber> Layer<S> for ClientFaultsAtDebug {
    fn event_enabled(&self, event: &Event<'_>, _ctx: Context<'_, S>) -> bool {
        let meta = event.metadata();
        if *meta.level() != Level::ERROR || !meta.target().starts_with("actix_http") {
            return true;
        }
        let mut message = MessageText(String::new());
        event.record(&mut message);
        if !is_client_fault(meta.target(), meta.level(), &message.0) {
            return true;
        }
        tracing::debug!(target: CLIENT_TARGET, "connection closed: {}", message.0);
        false
    }
}

/// Collects an event's `message` field.
struct MessageText(String);

impl Visit for MessageText {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.0, "{value:?}");
        }
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.0.push_str(value);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_actix_connection_errors_are_client_faults() {
        let d = "actix_http::h1::dispatcher";
        assert!(is_client_fault(
            d,
            &Level::ERROR,
            "stream error: Parse(Header)"
        ));
        assert!(is_client_fault(d, &Level::ERROR, "write zero; closing"));
        assert!(!is_client_fault(d, &Level::WARN, "stream error: x"));
        assert!(!is_client_fault(
            "tandem::server",
            &Level::ERROR,
            "stream error: x"
        ));
        assert!(!is_client_fault(d, &Level::ERROR, "something else"));
        assert_eq!("json".parse::<LogFormat>(), Ok(LogFormat::Json));
        assert!("xml".parse::<LogFormat>().is_err());
    }
}
