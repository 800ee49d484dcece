//! The OpenAI-compatible HTTP ingress (axum, HTTP/1.1):
//!
//! | route | answer |
//! |---|---|
//! | `POST /v1/completions` | text completion; `stream: true` as SSE (`data: {...}` chunks, `data: [DONE]`) |
//! | `POST /v1/chat/completions` | chat completion, same streaming rules |
//! | `GET /v1/models` | the served model |
//! | `GET /v1/usage` | every key id's usage and cost (admin keys) |
//! | `GET /v1/usage/{key_id}` | one key id's usage and cost (admin keys, or the key itself); 404 for an unknown id |
//! | `GET /health[?verbose=true]` | 200 while a prefill → decode pair passes the canary (see [`crate::canary`]; with the canary off: while ≥ 1 node of each role accepts work), else 503; `verbose` lists every pair's last probe |
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
mod sse;
mod error;
mod logprobs;
mod usage;
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
use crate::keys::KeyIdentity;
use crate::pipeline::Router;

/// The axum application over `router`.
pub fn app(router: Router) -> AxumRouter {
    AxumRouter::new()
        .route("/v1/completions", post(completions::completions))
        .route("/v1/chat/completions", post(completions::chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .route("/v1/usage", get(usage::all))
        .route("/v1/usage/{key_id}", get(usage::one))
        .fallback(not_found)
        .layer(axum::extract::DefaultBodyLimit::max(BODY_LIMIT_BYTES))
        .with_state(router)
}

/// The largest request body the OpenAI routes accept (a prompt at the context limit is a few
/// hundred KiB at most).
pub const BODY_LIMIT_BYTES: usize = 4 << 20;

/// A request body, or the error the client gets for it: too large is a 413 with an
/// OpenAI-shaped body (not axum's plain text), unreadable a 400.
fn body_bytes(
    body: Result<axum::body::Bytes, axum::extract::rejection::BytesRejection>,
) -> Result<axum::body::Bytes, RouterError> {
    body.map_err(|rejection| {
        if rejection.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE {
            RouterError::BodyTooLarge {
                limit_bytes: BODY_LIMIT_BYTES,
            }
        } else {
            RouterError::MalformedBody {
                message: rejection.body_text(),
                path: None,
            }
        }
    })
}

/// Serves the HTTP ingress on `listener` until `shutdown` resolves (in-flight responses are
/// allowed to finish).
/// With `tls`, every connection is a TLS one (HTTP/1.1 or h2 by ALPN); a failed handshake
/// costs only its connection.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    tls: Option<crate::tls::TlsIdentity>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), RouterError> {
    match tls {
        None => axum::serve(listener, app(router))
            .with_graceful_shutdown(shutdown)
            .await
            .map_err(|e| RouterError::Serve {
                server: "http",
                message: e.to_string(),
            }),
        Some(tls) => {
            serve_tls(listener, app(router), tls.server_config(), shutdown).await;
            Ok(())
        }
    }
}

/// Longest a client may take to finish its TLS handshake.
const TLS_HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// The HTTPS accept loop: TLS handshake per connection, then hyper (HTTP/1.1 or h2) over
/// `app`. On shutdown it stops accepting and lets open connections finish their responses.
async fn serve_tls(
    listener: TcpListener,
    app: AxumRouter,
    config: std::sync::Arc<tokio_rustls::rustls::ServerConfig>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    use hyper_util::rt::{TokioExecutor, TokioIo};
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        let (tcp, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(c) => c,
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "accepting an HTTPS connection failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let (acceptor, app, builder) = (acceptor.clone(), app.clone(), builder.clone());
        let watcher = graceful.watcher();
        tokio::spawn(async move {
            let stream = match tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                Ok(Ok(stream)) => stream,
                Ok(Err(e)) => {
                    tracing::debug!(%peer, error = %e, "TLS handshake failed");
                    return;
                }
                Err(_) => {
                    tracing::debug!(%peer, "TLS handshake timed out");
                    return;
                }
            };
            let service = hyper_util::service::TowerToHyperService::new(app);
            let connection = builder
                .serve_connection_with_upgrades(TokioIo::new(stream), service)
                .into_owned();
            if let Err(e) = watcher.watch(connection).await {
                tracing::debug!(%peer, error = %e, "HTTPS connection ended with an error");
            }
        });
    }
    graceful.shutdown().await;
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

/// Checks the `Authorization` header and names the caller.
fn authorize(router: &Router, headers: &HeaderMap) -> Result<KeyIdentity, ApiError> {
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

/// `GET /health[?verbose=true]`: 200 while the router can serve (with the canary on: a pair
/// passed its last probe), else 503; `verbose` adds every canary pair's record.
async fn health(
    State(router): State<Router>,
    axum::extract::RawQuery(query): axum::extract::RawQuery,
) -> Response {
    let verbose = query.as_deref().unwrap_or("").split('&').any(|kv| {
        matches!(kv, "verbose" | "verbose=true" | "verbose=1")
    });
    let (prefill, decode) = router.available_nodes();
    let status = if router.is_ready() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let canary = router.canary_state();
    let (pairs, passing) = canary.counts();
    let mut body = json!({
        "cluster": router.cluster(),
        "serving": status == StatusCode::OK,
        "prefill_nodes": prefill,
        "decode_nodes": decode,
        "load_reports_connected": router.load_signals_connected(),
        "canary": {
            "enabled": router.options().canary.interval.is_some(),
            "rounds": canary.rounds(),
            "pairs": pairs,
            "pairs_passing": passing,
        },
    });
    if verbose {
        body["canary"]["pair_results"] = json!(canary.pairs());
    }
    (status, axum::Json(body)).into_response()
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
