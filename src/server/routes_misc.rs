//! The small routes: `GET /v1/models` (and `/v1/models/{id}`), `GET /health`, `GET /metrics`, and the
//! JSON 404 for everything else.
//!
//! `/health` and `/metrics` need no API key (probes and scrapers rarely
//! carry one, and they reveal no prompts); `/v1/models` does.

use actix_web::{web, HttpRequest, HttpResponse};
use serde_json::json;

use super::errors::ApiError;
use super::metrics;
use super::openai_types::{ModelCard, ModelList};
use super::state::{AppState, Ready};
use super::{count, ROUTE_HEALTH, ROUTE_METRICS, ROUTE_MODELS, ROUTE_OTHER};

/// `GET /v1/models`: the one model this server serves.
pub async fn models(req: HttpRequest, state: web::Data<AppState>) -> HttpResponse {
    let result = (|| {
        state.authorize(&req)?;
        let ready = state.ready()?;
        Ok(HttpResponse::Ok().json(ModelList {
            object: "list",
            data: vec![model_card(&ready)],
        }))
    })();
    count(&state, ROUTE_MODELS, result)
}

/// `GET /v1/models/{id}`: the model card of the served model (the `openai`
/// client's `models.retrieve(id)`); a JSON 404 for any other id.
pub async fn model(req: HttpRequest, state: web::Data<AppState>) -> HttpResponse {
    let result = (|| {
        state.authorize(&req)?;
        let ready = state.ready()?;
        // Read from the match, not with a `web::Path` extractor, whose
        // failures (an id that is not UTF-8 once decoded) would be the
        // framework's plain-text 404 instead of a JSON one.
        let id = req.match_info().query("id");
        if id != ready.model_name {
            return Err(ApiError::model_not_found(id));
        }
        Ok(HttpResponse::Ok().json(model_card(&ready)))
    })();
    count(&state, ROUTE_MODELS, result)
}

fn model_card(ready: &Ready) -> ModelCard {
    ModelCard {
        id: ready.model_name.clone(),
        object: "model",
        created: ready.created,
        owned_by: "tandem",
        max_model_len: ready.handle.info().context_len,
        root: ready
            .root
            .clone()
            .unwrap_or_else(|| ready.model_name.clone()),
    }
}

/// `GET /health`: 200 `{"status":"ready"}` once the model is loaded; 503
/// with `loading` or `shutting_down` otherwise.
pub async fn health(state: web::Data<AppState>) -> HttpResponse {
    let phase = state.phase_name();
    let mut response = if phase == "ready" {
        HttpResponse::Ok()
    } else {
        HttpResponse::ServiceUnavailable()
    };
    let response = response.json(json!({ "status": phase }));
    state.count_response(ROUTE_HEALTH, response.status().as_u16());
    response
}

/// `GET /metrics`: Prometheus text.
pub async fn metrics(state: web::Data<AppState>) -> HttpResponse {
    let stats = match state.last_ready() {
        // Fails once the scheduler has stopped; its metrics are then left out.
        Some(ready) => ready.handle.stats().await.ok(),
        None => None,
    };
    state.count_response(ROUTE_METRICS, 200);
    HttpResponse::Ok()
        .content_type(metrics::CONTENT_TYPE)
        .body(metrics::render(&state, stats.as_ref()))
}

/// Any other path or method.
pub async fn not_found(req: HttpRequest, state: web::Data<AppState>) -> HttpResponse {
    let e = ApiError::not_found(format!("no route for {} {}", req.method(), req.path()));
    count(&state, ROUTE_OTHER, Err(e))
}
