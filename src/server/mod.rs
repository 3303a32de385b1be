//! The OpenAI-compatible HTTP API: actix-web handlers in front of a
//! [`TandemHandle`](crate::TandemHandle). Built with the cargo feature
//! `server` (on by default), like the `tandem` binary that serves it.
//!
//! The binary runs the HTTP workers and the scheduler in one actix System;
//! the handlers only reach the scheduler through the handle's messages, so
//! a host may equally serve a handle whose scheduler lives elsewhere
//! ([`TandemHandle::spawn`](crate::TandemHandle::spawn)).
//!
//! # Ownership
//! - [`AppState`] is shared by every HTTP worker: the phase (loading → ready
//!   → shutting down), the HTTP limits and API key ([`HttpConfig`]), and the
//!   counters of HTTP responses. Only the owner of the server's life cycle
//!   (the binary, or a test) changes the phase: [`AppState::set_ready`] once
//!   the model is loaded, [`shutdown_gracefully`] on a signal.
//! - Each generation request owns its [`EventStream`](crate::handle::EventStream)
//!   (a [`ChoiceStream`](crate::handle::ChoiceStream) for `n` > 1, whose drop
//!   cancels every choice).
//!   A streaming response owns it inside its body, a whole (non-streaming)
//!   one inside the handler that waits for it; a client that disconnects,
//!   with a FIN or an RST, drops the connection and with it the stream, and
//!   the request is cancelled at the next step. (HTTP/1 half-closes count
//!   as disconnects: [`bind`] turns them off.)
//! - The scheduler and the engine thread are reached only through the
//!   [`TandemHandle`](crate::TandemHandle) held in the ready state.
//!
//! # Validation
//! The handlers check what the OpenAI API defines (JSON types, OpenAI's
//! ranges, unsupported fields) and build a [`GenerateRequest`]. Everything
//! the library itself requires (sampling options, vocabulary, context and
//! KV limits) is checked once, by the library, when the request reaches the
//! scheduler; [`ApiError::from_tandem`] turns its errors into 400s that name
//! the OpenAI field.
//!
//! # Routes
//! `POST /v1/completions`, `POST /v1/chat/completions` (JSON or SSE with
//! `stream: true`), `GET /v1/models`, `GET /v1/models/{id}`, `GET /health` (503 while loading or
//! shutting down), `GET /metrics` (Prometheus text); any other path or
//! method is a 404.
//! `/v1/*` routes require the API key when one is set. Errors are
//! OpenAI-style JSON bodies ([`ApiError`]), the framework's own answers to
//! malformed or slow request heads included ([`conn`]); a 429 carries
//! `Retry-After`. A body must arrive within [`HttpConfig::body_timeout`]
//! (408), a head within [`ListenConfig::header_timeout`].
//!
//! # Usage and stop strings
//! `usage.completion_tokens` counts the tokens of the answer: one per
//! `logprobs` entry, whose texts concatenate to the answer's text. Tokens a
//! matched stop string swallowed are in neither (OpenAI-style clients
//! compare the two); `tandem_generated_tokens_total` counts every token the
//! model produced.
//!
//! # Life cycle
//! [`bind`] binds the listener and returns the server future (signals are
//! left to the caller); [`ShutdownSignal`] catches SIGINT / SIGTERM from
//! start-up on; [`shutdown_gracefully`] refuses new requests (503), drains
//! the scheduler for a bounded time, then aborts what is left.
//!
//! # Layout
//! - [`state`]: [`AppState`], phases, auth, HTTP counters.
//! - [`errors`]: [`ApiError`] and the one error → status mapping.
//! - [`body`]: size-limited body reading and per-field typed access.
//! - [`params`]: the fields both generation routes share.
//! - [`choices`]: `n` and `best_of`: several choices of one prompt, their
//!   whole answers, the `best_of` pick and the summed usage.
//! - [`mtp`]: the `--mtp` / `--draft-max` flags (`off`, `early-exit:L`,
//!   `head:DIR`) and a request's `tandem` extension (`mtp: on | off`,
//!   `draft_max`).
//! - [`routes_completions`], [`routes_chat`], [`routes_misc`]: handlers.
//! - [`openai_types`]: response shapes; [`sse`]: the streaming body.
//! - [`chat_template`]: minijinja rendering of the model's chat template.
//! - [`metrics`]: Prometheus text rendering.
//! - [`conn`]: the connection wrapper that gives the framework's own
//!   400/408/431 answers a JSON body.
//! - [`logging`]: the binary's log (text or JSON; client faults at DEBUG).
//! - [`load`]: what the binary serves (a model folder or the embedded
//!   model) on the requested device and dtype, with its tokenizer, chat
//!   template and draft head, as an [`Engine`](crate::engine::Engine).
//!
//! [`GenerateRequest`]: crate::api::GenerateRequest

pub mod body;
pub mod chat_template;
pub mod choices;
pub mod conn;
pub mod errors;
pub mod load;
pub mod logging;
pub mod metrics;
pub mod mtp;
pub mod openai_types;
pub mod params;
pub mod routes_chat;
pub mod routes_completions;
pub mod routes_misc;
pub mod sse;
pub mod state;
pub mod structured;
pub mod tools;

#[cfg(test)]
mod fuzz_tests;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use actix_web::dev::{Server, ServerHandle};
use actix_web::{web, App, HttpResponse};

pub use chat_template::{ChatMessage, ChatTemplate};
pub use errors::ApiError;
pub use state::{AppState, HttpConfig, Ready};

use crate::scheduler::ShutdownMode;

/// Route labels of the `tandem_http_responses_total` metric.
pub const ROUTE_COMPLETIONS: &str = "completions";
pub const ROUTE_CHAT: &str = "chat_completions";
pub const ROUTE_MODELS: &str = "models";
pub const ROUTE_HEALTH: &str = "health";
pub const ROUTE_METRICS: &str = "metrics";
pub const ROUTE_OTHER: &str = "other";

/// How to listen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListenConfig {
    /// Interface to bind (`127.0.0.1` by default: not reachable from other
    /// machines unless asked for).
    pub host: String,
    /// TCP port; 0 picks a free one.
    pub port: u16,
    /// HTTP worker threads. The handlers only parse JSON and copy tokens,
    /// so few are needed; each one competes with the engine for cores.
    pub workers: usize,
    /// Upper bound on waiting for open connections at shutdown.
    pub shutdown_timeout: Duration,
    /// Longest time to receive a request's headers (a 408 above). The body
    /// has its own bound, [`HttpConfig::body_timeout`].
    pub header_timeout: Duration,
}

impl Default for ListenConfig {
    fn default() -> Self {
        Self {
            host: "127.0.0.1".into(),
            port: 8080,
            workers: 2,
            shutdown_timeout: Duration::from_secs(30),
            header_timeout: Duration::from_secs(5),
        }
    }
}

/// Registers every route and the shared state on an actix-web app.
pub fn configure(
    state: Arc<AppState>,
) -> impl Fn(&mut web::ServiceConfig) + Clone + Send + 'static {
    let data = web::Data::from(state);
    move |cfg: &mut web::ServiceConfig| {
        cfg.app_data(data.clone())
            .route(
                "/v1/completions",
                web::post().to(routes_completions::completions),
            )
            .route(
                "/v1/chat/completions",
                web::post().to(routes_chat::chat_completions),
            )
            .route("/v1/models", web::get().to(routes_misc::models))
            .route("/v1/models/{id:.+}", web::get().to(routes_misc::model))
            .route("/health", web::get().to(routes_misc::health))
            .route("/metrics", web::get().to(routes_misc::metrics))
            .default_service(web::to(routes_misc::not_found));
    }
}

/// Binds the HTTP server. Run the returned [`Server`] (a future) on the actix
/// System, e.g. with `actix_web::rt::spawn`; the address is the bound one
/// (the real port when `port` was 0). Signals are left to the caller (see
/// [`ShutdownSignal`]), so that shutdown can drain the scheduler first.
pub fn bind(state: Arc<AppState>, listen: &ListenConfig) -> std::io::Result<(Server, SocketAddr)> {
    use actix_service::{fn_service, map_config, IntoServiceFactory, ServiceFactoryExt};
    let lst = std::net::TcpListener::bind((listen.host.as_str(), listen.port))?;
    let addr = lst.local_addr()?;
    let routes = configure(state);
    let (header_timeout, keep_alive) = (listen.header_timeout, Duration::from_secs(5));
    let server = actix_server::Server::build()
        .workers(listen.workers.max(1))
        .disable_signals()
        .shutdown_timeout(listen.shutdown_timeout.as_secs().max(1))
        .listen("tandem-http", lst, move || {
            let routes = routes.clone();
            let app = App::new().configure(routes).into_factory();
            let http = actix_http::HttpService::<
                conn::JsonErrors<actix_web::rt::net::TcpStream>,
                _,
                _,
            >::build()
            .keep_alive(keep_alive)
            .client_request_timeout(header_timeout)
            .client_disconnect_timeout(Duration::from_secs(1))
            // A client that closes its connection (FIN) while it waits
            // for a whole (non-streaming) answer has gone: drop the
            // connection, and with it the handler and its
            // `EventStream`, which cancels the request at the next step.
            // Half-closing clients are not worth the abandoned sequences
            // that allowing them costs (actix's default keeps them
            // generating to `max_tokens` for nobody).
            .h1_allow_half_closed(false)
            .local_addr(addr)
            .h1(map_config(app, |_| actix_web::dev::AppConfig::default()));
            fn_service(|io: actix_web::rt::net::TcpStream| async move {
                let _ = io.set_nodelay(true);
                let peer = io.peer_addr().ok();
                Ok::<_, actix_http::error::DispatchError>((conn::JsonErrors::new(io), peer))
            })
            .and_then(http)
        })?;
    Ok((server.run(), addr))
}

/// What [`shutdown_gracefully`] did with the requests in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShutdownOutcome {
    /// No model was loaded yet: nothing to drain.
    NothingLoaded,
    /// Every in-flight request finished.
    Drained,
    /// The drain timed out; the rest were cancelled (`finish_reason: "abort"`).
    Aborted,
}

/// Stops the server: refuse new requests (503), stop accepting connections,
/// let in-flight requests finish for at most `drain_timeout`, cancel what is
/// left, stop the scheduler and wait for the HTTP workers.
pub async fn shutdown_gracefully(
    state: &AppState,
    server: &ServerHandle,
    drain_timeout: Duration,
) -> ShutdownOutcome {
    state.begin_shutdown();
    // Sent now; awaited at the end, once the streams have ended.
    let http_stopped = server.stop(true);
    let outcome = match state.last_ready() {
        None => ShutdownOutcome::NothingLoaded,
        Some(ready) => {
            let drain = ready.handle.shutdown(ShutdownMode::Drain);
            match tokio::time::timeout(drain_timeout, drain).await {
                Ok(_) => ShutdownOutcome::Drained,
                Err(_) => {
                    tracing::warn!(
                        ?drain_timeout,
                        "drain timed out; cancelling the remaining requests"
                    );
                    // An Abort upgrades the Drain in progress.
                    let _ = ready.handle.shutdown(ShutdownMode::Abort).await;
                    ShutdownOutcome::Aborted
                }
            }
        }
    };
    http_stopped.await;
    outcome
}

/// SIGINT (Ctrl-C) and SIGTERM, caught from the moment of
/// [`ShutdownSignal::install`]: a signal that arrives while the model is
/// still loading is not lost, and never kills the process unhandled.
pub struct ShutdownSignal {
    #[cfg(unix)]
    interrupt: tokio::signal::unix::Signal,
    #[cfg(unix)]
    terminate: tokio::signal::unix::Signal,
}

impl ShutdownSignal {
    /// Installs the handlers. Call inside the async runtime.
    pub fn install() -> std::io::Result<Self> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            Ok(Self {
                interrupt: signal(SignalKind::interrupt())?,
                terminate: signal(SignalKind::terminate())?,
            })
        }
        #[cfg(not(unix))]
        {
            Ok(Self {})
        }
    }

    /// Resolves at the next signal and names it.
    pub async fn recv(&mut self) -> &'static str {
        #[cfg(unix)]
        {
            tokio::select! {
                _ = self.interrupt.recv() => "SIGINT",
                _ = self.terminate.recv() => "SIGTERM",
            }
        }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
            "Ctrl-C"
        }
    }
}

/// Counts a handler's result and turns an error into its JSON response.
pub(crate) fn count(
    state: &AppState,
    route: &'static str,
    result: Result<HttpResponse, ApiError>,
) -> HttpResponse {
    let response = match result {
        Ok(r) => r,
        Err(e) => {
            if e.status.is_server_error() && e.status.as_u16() != 503 {
                tracing::error!(route, error = %e, "request failed");
            } else {
                tracing::debug!(route, error = %e, "request refused");
            }
            actix_web::ResponseError::error_response(&e)
        }
    };
    state.count_response(route, response.status().as_u16());
    response
}
