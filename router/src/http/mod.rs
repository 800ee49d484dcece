//! The OpenAI-compatible HTTP ingress (axum, HTTP/1.1):
//!
//! | route | answer |
//! |---|---|
//! | `POST /v1/completions` | text completion; `stream: true` as SSE (`data: {...}` chunks, `data: [DONE]`) |
//! | `POST /v1/chat/completions` | chat completion, same streaming rules |
//! | `GET /v1/models` | the served model |
//! | `GET /health` | 200 while ≥ 1 prefill and ≥ 1 decode node accept work, else 503 |
//! | `GET /metrics` | every family of [`crate::metrics`], Prometheus text format (open, like /health) |
//! | anything else | 404, OpenAI-shaped |
//!
//! Tracing: a W3C `traceparent` header continues the caller's trace; every completion response
//! (streamed or not) carries the request span's `traceparent` header.
//!
//! Authentication (when API keys are configured): `Authorization: Bearer <key>` on every
//! `/v1` route; `/health` is open. Bodies are parsed here (not by axum's extractor) so a
//! malformed body gets serde's message and the field's path in an OpenAI error. A streamed
//! request's status is decided by its first event: an error before any output (no nodes, queue
//! full, every attempt failed) is an ordinary error response, never a 200 with an error inside.

mod completions;
mod error;
pub mod openai;

use std::future::Future;

use axum::Router as AxumRouter;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::json;
use tokio::net::TcpListener;

pub use error::{ApiError, body as error_body, classify};

use crate::error::RouterError;
use crate::pipeline::Router;

/// The axum application over `router`.
pub fn app(router: Router) -> AxumRouter {
    AxumRouter::new()
        .route("/v1/completions", post(completions::completions))
        .route("/v1/chat/completions", post(completions::chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .fallback(not_found)
        .with_state(router)
}

/// Serves the HTTP ingress on `listener` until `shutdown` resolves (in-flight responses are
/// allowed to finish).
pub async fn serve(
    listener: TcpListener,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), RouterError> {
    axum::serve(listener, app(router))
        .with_graceful_shutdown(shutdown)
        .await
        .map_err(|e| RouterError::Serve {
            server: "http",
            message: e.to_string(),
        })
}

async fn metrics_text(State(router): State<Router>) -> Response {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            tandem_telemetry::metrics::CONTENT_TYPE,
        )],
        router.metrics().render(),
    )
        .into_response()
}

/// Checks the `Authorization` header.
fn authorize(router: &Router, headers: &HeaderMap) -> Result<(), ApiError> {
    let header = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    router.authorize(header).map_err(ApiError)
}

async fn models(State(router): State<Router>, headers: HeaderMap) -> Result<Response, ApiError> {
    authorize(&router, &headers)?;
    let model = router.model();
    let created = model
        .path
        .metadata()
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map(|d| d.as_secs())
        .unwrap_or(0);
    Ok(axum::Json(json!({
        "object": "list",
        "data": [{
            "id": model.name,
            "object": "model",
            "created": created,
            "owned_by": "tandem",
            "max_model_len": model.context_tokens,
        }],
    }))
    .into_response())
}

async fn health(State(router): State<Router>) -> Response {
    let (prefill, decode) = router.available_nodes();
    let status = if prefill > 0 && decode > 0 {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (
        status,
        axum::Json(json!({
            "cluster": router.cluster(),
            "prefill_nodes": prefill,
            "decode_nodes": decode,
            "load_reports_connected": router.load_signals_connected(),
        })),
    )
        .into_response()
}

async fn not_found() -> Response {
    (
        StatusCode::NOT_FOUND,
        axum::Json(json!({
            "error": {
                "message": "no such route; see /v1/completions, /v1/chat/completions, /v1/models, /health",
                "type": "invalid_request_error",
                "param": null,
                "code": "not_found",
            }
        })),
    )
        .into_response()
}
