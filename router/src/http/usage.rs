//! `GET /v1/usage` and `GET /v1/usage/{key_id}`: what each API key used, from the ledger
//! (every router, every restart; see [`crate::usage`]), and what it cost at the configured
//! node-hour prices. Admin keys read every key; a key may read its own id; an unknown id is a
//! 404.

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tandem_cluster::UsageTotals;

use super::authorize;
use super::error::ApiError;
use crate::error::RouterError;
use crate::pipeline::Router;

fn entry(router: &Router, t: &UsageTotals) -> Value {
    let mut v = serde_json::to_value(t).unwrap_or(Value::Null);
    v["cost"] = json!(router.options().cost.price(t));
    v
}

fn error(status: StatusCode, message: String, code: &str) -> Response {
    (
        status,
        axum::Json(json!({"error": {"message": message, "type": "invalid_request_error", "param": null, "code": code}})),
    )
        .into_response()
}

async fn totals(router: &Router) -> Result<std::collections::BTreeMap<String, UsageTotals>, ApiError> {
    router
        .ledger()
        .totals()
        .await
        .map_err(|e| ApiError(RouterError::Cluster(e)))
}

pub(super) async fn all(State(router): State<Router>, headers: HeaderMap) -> Result<Response, ApiError> {
    let key = authorize(&router, &headers)?;
    if !key.admin {
        return Ok(error(
            StatusCode::FORBIDDEN,
            format!("key `{}` is not an admin key; it may read /v1/usage/{}", key.id, key.id),
            "forbidden",
        ));
    }
    let all = totals(&router).await?;
    let mut pools = UsageTotals::default();
    for t in all.values() {
        pools.add(t);
    }
    let cost = router.options().cost.price(&pools);
    Ok(axum::Json(json!({
        "object": "usage",
        "keys": all.iter().map(|(k, t)| (k.clone(), entry(&router, t))).collect::<serde_json::Map<_, _>>(),
        "pools": {
            "prefill": {
                "node_seconds": pools.prefill_node_seconds,
                "input_tokens": pools.input_tokens,
                "cached_input_tokens": pools.cached_input_tokens,
                "usd": cost.usd_prefill,
                "usd_per_million_input": cost.usd_per_million_input,
            },
            "decode": {
                "node_seconds": pools.decode_node_seconds,
                "output_tokens": pools.output_tokens,
                "usd": cost.usd_decode,
                "usd_per_million_output": cost.usd_per_million_output,
            },
        },
        "cost_model": router.options().cost,
    }))
    .into_response())
}

pub(super) async fn one(
    State(router): State<Router>,
    headers: HeaderMap,
    Path(key_id): Path<String>,
) -> Result<Response, ApiError> {
    let key = authorize(&router, &headers)?;
    if !key.admin && *key.id != *key_id {
        return Ok(error(
            StatusCode::FORBIDDEN,
            format!("key `{}` may only read its own usage", key.id),
            "forbidden",
        ));
    }
    if !router.api_keys().knows(&key_id) {
        return Ok(error(
            StatusCode::NOT_FOUND,
            format!("no API key with id `{key_id}`"),
            "key_not_found",
        ));
    }
    let t = totals(&router).await?.remove(&key_id).unwrap_or_default();
    let mut v = entry(&router, &t);
    v["key_id"] = json!(key_id);
    Ok(axum::Json(v).into_response())
}
