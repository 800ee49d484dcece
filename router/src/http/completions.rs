//! `POST /v1/completions` and `POST /v1/chat/completions`: parse, run through the core, and
//! answer as one JSON object or as server-sent events.
//!
//! Stream shape (what the official `openai` client reads):
//! ```text
//! data: {"object":"chat.completion.chunk", "choices":[{"delta":{"role":"assistant","content":""}}]}   (chat only)
//! data: {... "choices":[{"index":0, "delta":{"content":"Hel"}, "finish_reason":null}]}            (one per delta)
//! data: {... "choices":[{"index":0, "delta":{}, "finish_reason":"stop"}]}
//! data: {... "choices":[], "usage":{...}}                                                           (include_usage)
//! data: [DONE]
//! ```
//! With `n` > 1 the choices' chunks interleave as their tokens come, each naming its `index`;
//! every choice gets its finish chunk, and usage (the prompt once, every choice's output) and
//! `[DONE]` follow the last. With `logprobs`, each chunk carries its tokens' log probabilities
//! ([`super::logprobs`]).
//! A failure after the stream started is sent as `data: {"error": {...}}` followed by
//! `data: [DONE]`. Dropping the response (the client disconnected) drops the
//! [`GenerationStream`](crate::pipeline::GenerationStream), which cancels the request on the
//! nodes at once. The stream itself is written by [`super::sse`].

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use serde_json::{Value, json};
use tandem_tokenizer::Tokenizer;

use super::authorize;
use super::error::ApiError;
use super::logprobs::{LogprobWriter, extend_completion};
use super::openai::{RequestBody, parse_body};
use crate::error::RouterError;
use crate::pipeline::{
    Choices, GenerationEvent, GenerationFinal, RequestContext, Router, Usage,
};
use tandem_telemetry::trace::propagation::{RemoteParent, TRACEPARENT};

/// Which endpoint is answering.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Endpoint {
    Completion,
    Chat,
}

/// What every chunk of one response repeats, and how its choices are rendered.
#[derive(Clone, Debug)]
pub(super) struct Meta {
    pub(super) endpoint: Endpoint,
    pub(super) id: String,
    pub(super) created: u64,
    pub(super) model: String,
    pub(super) include_usage: bool,
    /// Choices in the response.
    pub(super) n: u32,
    /// `Some(with alternatives)` when the request asked for logprobs.
    pub(super) logprobs: Option<bool>,
    pub(super) tokenizer: Arc<Tokenizer>,
}

pub(super) async fn completions(
    State(router): State<Router>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    run(router, headers, body, Endpoint::Completion).await
}

pub(super) async fn chat_completions(
    State(router): State<Router>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    run(router, headers, body, Endpoint::Chat).await
}

async fn run(
    router: Router,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
    endpoint: Endpoint,
) -> Result<Response, ApiError> {
    let key = authorize(&router, &headers)?;
    let request: RequestBody = parse_body(&super::body_bytes(body)?)?;
    let (stream, include_usage, n) = (request.stream, request.include_usage(), request.choices());
    let core = match endpoint {
        Endpoint::Completion => request.into_completion()?,
        Endpoint::Chat => request.into_chat()?,
    };
    let logprobs = core
        .sampling
        .logprobs
        .then_some(core.sampling.top_logprobs > 0);
    let choices = router
        .generate_choices(core, context(&headers, key), n)
        .await?;
    let prefix = match endpoint {
        Endpoint::Completion => "cmpl",
        Endpoint::Chat => "chatcmpl",
    };
    let first = choices.first();
    let meta = Meta {
        endpoint,
        id: format!("{prefix}-{}", choices.request_id),
        created: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        model: router.model().name.clone(),
        include_usage,
        n: choices.streams.len() as u32,
        logprobs,
        tokenizer: Arc::clone(&router.model().tokenizer),
    };
    let traceparent = first.traceparent().map(str::to_owned);
    let rate_limit = first.rate_limit();
    let mut response = if stream {
        super::sse::sse(meta, choices.merged()).into_response()
    } else {
        collect(meta, choices).await?
    };
    // The trace id goes back to the client, whichever way the answer is sent.
    if let Some(value) = traceparent.and_then(|t| axum::http::HeaderValue::from_str(&t).ok()) {
        response.headers_mut().insert(TRACEPARENT, value);
    }
    if let Some(status) = rate_limit {
        super::error::rate_limit_headers(response.headers_mut(), &status);
    }
    Ok(response)
}

/// The request's context: the caller (its key id) and, from a W3C `traceparent` header, the
/// trace it continues.
fn context(headers: &HeaderMap, key: crate::keys::KeyIdentity) -> RequestContext {
    RequestContext {
        parent: RemoteParent::from_http(headers),
        key,
    }
}

/// One choice as it accumulates (the non-streamed answer).
struct Collected {
    text: String,
    logprobs: Value,
    writer: LogprobWriter,
    done: Option<GenerationFinal>,
}

/// Reads every choice to its end and answers one JSON object.
async fn collect(meta: Meta, choices: Choices) -> Result<Response, ApiError> {
    let mut acc: Vec<Collected> = (0..meta.n)
        .map(|_| Collected {
            text: String::new(),
            logprobs: Value::Null,
            writer: LogprobWriter::new(Arc::clone(&meta.tokenizer)),
            done: None,
        })
        .collect();
    let mut events = choices.merged();
    let mut finished = 0;
    while let Some((i, event)) = events.next().await {
        let c = &mut acc[i as usize];
        match event? {
            GenerationEvent::Delta {
                text, logprobs, ..
            } => {
                c.text.push_str(&text);
                if let Some(with_top) = meta.logprobs {
                    match meta.endpoint {
                        Endpoint::Chat => {
                            if c.logprobs.is_null() {
                                c.logprobs = json!([]);
                            }
                            let list = c.logprobs.as_array_mut().expect("a list");
                            list.extend(c.writer.chat(&logprobs));
                        }
                        Endpoint::Completion => {
                            let more = c.writer.completion(&logprobs, with_top);
                            extend_completion(&mut c.logprobs, more);
                        }
                    }
                }
            }
            GenerationEvent::Final(done) => {
                c.done = Some(done);
                finished += 1;
                if finished == meta.n {
                    break;
                }
            }
        }
    }
    if finished < meta.n {
        return Err(ApiError(RouterError::PipelineLost));
    }
    let finals: Vec<GenerationFinal> = acc.iter().filter_map(|c| c.done.clone()).collect();
    let usage = total_usage(&finals);
    let choices: Vec<Value> = acc
        .into_iter()
        .enumerate()
        .map(|(i, c)| {
            let finish = c.done.as_ref().map(|d| d.finish_reason.openai());
            let logprobs = match (meta.endpoint, meta.logprobs) {
                (_, None) => Value::Null,
                (Endpoint::Chat, Some(_)) => json!({"content": if c.logprobs.is_null() { json!([]) } else { c.logprobs }}),
                (Endpoint::Completion, Some(_)) => c.logprobs,
            };
            match meta.endpoint {
                Endpoint::Completion => json!({
                    "index": i, "text": c.text, "logprobs": logprobs, "finish_reason": finish,
                }),
                Endpoint::Chat => json!({
                    "index": i,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": logprobs,
                    "finish_reason": finish,
                }),
            }
        })
        .collect();
    let object = match meta.endpoint {
        Endpoint::Completion => "text_completion",
        Endpoint::Chat => "chat.completion",
    };
    Ok(axum::Json(json!({
        "id": meta.id, "object": object, "created": meta.created, "model": meta.model,
        "choices": choices,
        "usage": usage_json(usage),
    }))
    .into_response())
}

/// The usage of a request whose choices ended with `finals` (in index order): the prompt once
/// (as choice 0 counted it, its cached prefix included), the output of all.
pub(super) fn total_usage(finals: &[GenerationFinal]) -> Usage {
    let first = finals.first().map(|f| f.usage).unwrap_or_default();
    Usage {
        completion_tokens: finals.iter().map(|f| f.usage.completion_tokens).sum(),
        ..first
    }
}

pub(super) fn usage_json(usage: Usage) -> Value {
    json!({
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
    })
}
