//! [`AppState`]: what every HTTP worker shares: the server's phase (loading,
//! ready with a [`TandemHandle`], shutting down), its limits, the API key,
//! and counters of HTTP responses.
//!
//! # Ownership
//! The phase is written only by the code that owns the server's life cycle
//! (the `tandem` binary or a test): [`AppState::set_ready`] once the model is
//! loaded, [`AppState::begin_shutdown`] on a signal. Handlers only read it,
//! and take an `Arc` of the ready state so a request keeps working while the
//! phase changes under it. A std `RwLock` suffices: it is held only to clone
//! an `Arc`, never across an `.await`.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use actix_web::http::header::AUTHORIZATION;
use actix_web::HttpRequest;

use super::chat_template::ChatTemplate;
use super::errors::ApiError;
use super::openai_types::unix_now;
use crate::TandemHandle;

/// Settings of the HTTP layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpConfig {
    /// When set, `/v1/*` routes require `Authorization: Bearer <key>`.
    pub api_key: Option<String>,
    /// Largest accepted request body in bytes (413 above).
    pub body_limit: usize,
    /// Longest time to receive a request body once its headers are in
    /// (408 above, and the connection is closed).
    pub body_timeout: Duration,
}

/// Default of [`HttpConfig::body_timeout`].
pub const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(30);

impl Default for HttpConfig {
    fn default() -> Self {
        Self {
            api_key: None,
            body_limit: 4 * 1024 * 1024,
            body_timeout: DEFAULT_BODY_TIMEOUT,
        }
    }
}

/// The loaded model, as the handlers need it.
pub struct Ready {
    /// The scheduler's front door.
    pub handle: TandemHandle,
    /// The chat prompt renderer.
    pub template: ChatTemplate,
    /// The model id reported to clients.
    pub model_name: String,
    /// The model's own name from its files, when they give one.
    pub root: Option<String>,
    /// Unix time at which the model became ready (`created` of the model card).
    pub created: u64,
}

impl std::fmt::Debug for Ready {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ready")
            .field("model_name", &self.model_name)
            .field("template", &self.template)
            .field("created", &self.created)
            .finish_non_exhaustive()
    }
}

/// Where the server is in its life.
enum Phase {
    Loading,
    Ready(Arc<Ready>),
    /// Refusing new work; the last ready state is kept for `/metrics`.
    ShuttingDown(Option<Arc<Ready>>),
}

/// State shared by all HTTP workers.
pub struct AppState {
    phase: RwLock<Phase>,
    /// HTTP settings.
    pub config: HttpConfig,
    /// Responses by (route, status code).
    responses: Mutex<BTreeMap<(&'static str, u16), u64>>,
}

impl AppState {
    /// A state in the loading phase.
    pub fn new(config: HttpConfig) -> Arc<Self> {
        Arc::new(Self {
            phase: RwLock::new(Phase::Loading),
            config,
            responses: Mutex::new(BTreeMap::new()),
        })
    }

    /// The model is loaded: start serving with `handle`.
    pub fn set_ready(&self, handle: TandemHandle, template: ChatTemplate) {
        self.set_ready_named(handle, template, None);
    }

    /// [`set_ready`](Self::set_ready) with the model's own name (shown as
    /// `root` in `/v1/models`).
    pub fn set_ready_named(
        &self,
        handle: TandemHandle,
        template: ChatTemplate,
        root: Option<String>,
    ) {
        let ready = Ready {
            model_name: handle.info().model_name.clone(),
            root,
            handle,
            template,
            created: unix_now(),
        };
        *self.phase.write().unwrap_or_else(|p| p.into_inner()) = Phase::Ready(Arc::new(ready));
    }

    /// Stop accepting generation requests (503 from now on).
    pub fn begin_shutdown(&self) {
        let mut phase = self.phase.write().unwrap_or_else(|p| p.into_inner());
        let last = match &*phase {
            Phase::Ready(r) => Some(r.clone()),
            Phase::ShuttingDown(r) => r.clone(),
            Phase::Loading => None,
        };
        *phase = Phase::ShuttingDown(last);
    }

    /// The ready state, or the 503 for the current phase.
    pub fn ready(&self) -> Result<Arc<Ready>, ApiError> {
        match &*self.phase.read().unwrap_or_else(|p| p.into_inner()) {
            Phase::Ready(r) => Ok(r.clone()),
            Phase::Loading => Err(ApiError::loading()),
            Phase::ShuttingDown(_) => Err(ApiError::shutting_down()),
        }
    }

    /// The ready state even while shutting down (for `/metrics`).
    pub fn last_ready(&self) -> Option<Arc<Ready>> {
        match &*self.phase.read().unwrap_or_else(|p| p.into_inner()) {
            Phase::Ready(r) => Some(r.clone()),
            Phase::ShuttingDown(r) => r.clone(),
            Phase::Loading => None,
        }
    }

    /// `loading`, `ready` or `shutting_down`.
    pub fn phase_name(&self) -> &'static str {
        match &*self.phase.read().unwrap_or_else(|p| p.into_inner()) {
            Phase::Loading => "loading",
            Phase::Ready(_) => "ready",
            Phase::ShuttingDown(_) => "shutting_down",
        }
    }

    /// Checks the bearer key when one is configured (401 otherwise).
    ///
    /// The scheme is matched case-insensitively (`bearer`, `BEARER`: RFC
    /// 7235 §2.1), the key exactly and in constant time. A request with
    /// several `Authorization` headers is refused: which one a proxy in
    /// front and this server each look at must not be a matter of luck.
    pub fn authorize(&self, req: &HttpRequest) -> Result<(), ApiError> {
        let Some(key) = &self.config.api_key else {
            return Ok(());
        };
        let mut headers = req.headers().get_all(AUTHORIZATION);
        let first = headers.next();
        if headers.next().is_some() {
            return Err(ApiError::unauthorized_because(
                "several `Authorization` headers: send exactly one",
            ));
        }
        let given = first.and_then(|v| v.to_str().ok()).and_then(bearer_token);
        match given {
            Some(given) if constant_time_eq(given.as_bytes(), key.as_bytes()) => Ok(()),
            _ => Err(ApiError::unauthorized()),
        }
    }

    /// Counts one response of `route`.
    pub fn count_response(&self, route: &'static str, status: u16) {
        let mut map = self.responses.lock().unwrap_or_else(|p| p.into_inner());
        *map.entry((route, status)).or_insert(0) += 1;
    }

    /// A copy of the response counters.
    pub fn responses(&self) -> BTreeMap<(&'static str, u16), u64> {
        self.responses
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

/// The credentials of a `Bearer` authorization value; the scheme is
/// case-insensitive and may be followed by any amount of spaces or tabs.
fn bearer_token(value: &str) -> Option<&str> {
    let value = value.trim();
    let (scheme, rest) = value.split_at_checked(6)?;
    if !scheme.eq_ignore_ascii_case("bearer") || !rest.starts_with([' ', '\t']) {
        return None;
    }
    Some(rest.trim_start_matches([' ', '\t']))
}

/// Compares two keys in time independent of where they first differ, so a
/// client cannot find the key byte by byte from response times.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = a.len() ^ b.len();
    for (i, &x) in a.iter().enumerate() {
        diff |= usize::from(x ^ b.get(i % b.len().max(1)).copied().unwrap_or(0));
    }
    diff == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use actix_web::test::TestRequest;

    #[test]
    fn keys_compare_exactly() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secret", b"secreT"));
        assert!(!constant_time_eq(b"secret", b"secret2"));
        assert!(!constant_time_eq(b"", b"x"));
        assert!(constant_time_eq(b"", b""));
    }

    #[test]
    fn bearer_key_is_enforced_only_when_set() {
        let open = AppState::new(HttpConfig::default());
        assert!(open
            .authorize(&TestRequest::default().to_http_request())
            .is_ok());
        let locked = AppState::new(HttpConfig {
            api_key: Some("k1".into()),
            ..HttpConfig::default()
        });
        let with = |h: &str| {
            TestRequest::default()
                .insert_header((AUTHORIZATION, h))
                .to_http_request()
        };
        assert!(locked.authorize(&with("Bearer k1")).is_ok());
        assert!(locked.authorize(&with("bearer k1")).is_ok());
        assert!(locked.authorize(&with("BEARER \t k1 ")).is_ok());
        assert!(locked.authorize(&with("Bearerk1")).is_err());
        assert!(locked.authorize(&with("Basic k1")).is_err());
        let twice = TestRequest::default()
            .append_header((AUTHORIZATION, "Bearer k1"))
            .append_header((AUTHORIZATION, "Bearer k1"))
            .to_http_request();
        let e = locked.authorize(&twice).unwrap_err();
        assert_eq!(e.status, 401);
        assert!(e.message.contains("several"), "{}", e.message);
        assert_eq!(
            locked.authorize(&with("Bearer k2")).unwrap_err().status,
            401
        );
        assert!(locked
            .authorize(&TestRequest::default().to_http_request())
            .is_err());
        assert_eq!(locked.phase_name(), "loading");
        assert_eq!(locked.ready().unwrap_err().status, 503);
        locked.begin_shutdown();
        assert_eq!(locked.ready().unwrap_err().code, "shutting_down");
    }
}
