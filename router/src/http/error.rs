//! OpenAI-shaped error responses: `{"error": {"message", "type", "param", "code"}}` with the
//! status the README's error table gives (400, 401, 404, 429, 503, 500).

use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use tandem_cluster::LimitKind;

use crate::error::RouterError;
use crate::ratelimit::RateLimitStatus;

/// An error on its way to an HTTP client.
#[derive(Debug)]
pub struct ApiError(pub RouterError);

impl From<RouterError> for ApiError {
    fn from(error: RouterError) -> Self {
        ApiError(error)
    }
}

/// Status, OpenAI `type`, `param` and `code` for an error.
pub fn classify(error: &RouterError) -> (StatusCode, &'static str, Option<String>, &'static str) {
    match error.root() {
        RouterError::Unauthenticated => (
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            None,
            "invalid_api_key",
        ),
        RouterError::InvalidArgument { field, .. } => (
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            Some(field.http_name().to_string()),
            "invalid_value",
        ),
        RouterError::MalformedBody { path, .. } => (
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            path.clone(),
            "invalid_json",
        ),
        RouterError::BodyTooLarge { .. } => (
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            None,
            "request_too_large",
        ),
        RouterError::ModelNotFound { .. } => (
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            Some("model".to_string()),
            "model_not_found",
        ),
        RouterError::RateLimited { limit, .. } => (
            StatusCode::TOO_MANY_REQUESTS,
            match limit {
                LimitKind::Tokens => "tokens",
                LimitKind::Requests => "requests",
                LimitKind::Concurrency => "concurrent_requests",
            },
            None,
            "rate_limit_exceeded",
        ),
        RouterError::Overloaded { .. }
        | RouterError::QueueTimeout { .. }
        | RouterError::NoCapacity { .. } => (
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            None,
            "overloaded",
        ),
        RouterError::NoNodes { .. }
        | RouterError::Node { .. }
        | RouterError::Protocol { .. }
        | RouterError::BadNodeAddress { .. } => (
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable_error",
            None,
            error.root().kind(),
        ),
        _ => (
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal_error",
            None,
            error.root().kind(),
        ),
    }
}

/// The JSON error body.
pub fn body(error: &RouterError) -> serde_json::Value {
    let (_, kind, param, code) = classify(error);
    json!({
        "error": {
            "message": error.to_string(),
            "type": kind,
            "param": param,
            "code": code,
        }
    })
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, ..) = classify(&self.0);
        let mut response = (status, axum::Json(body(&self.0))).into_response();
        let headers = response.headers_mut();
        if let RouterError::RateLimited {
            retry_after,
            status,
            ..
        } = self.0.root()
        {
            rate_limit_headers(headers, status);
            if let Some(after) = retry_after {
                let secs = after.as_secs() + u64::from(after.subsec_nanos() > 0);
                let ms = after.as_millis().max(1);
                headers.insert(header::RETRY_AFTER, HeaderValue::from(secs.max(1)));
                headers.insert("retry-after-ms", HeaderValue::from(ms as u64));
            }
        } else if status == StatusCode::TOO_MANY_REQUESTS
            || status == StatusCode::SERVICE_UNAVAILABLE
        {
            headers.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        response
    }
}

/// The `x-ratelimit-*` headers of a limited key's response (every response, not only 429s).
pub fn rate_limit_headers(headers: &mut HeaderMap, status: &RateLimitStatus) {
    for (name, value) in status.headers() {
        if let Ok(v) = HeaderValue::from_str(&value) {
            headers.insert(name, v);
        }
    }
}
