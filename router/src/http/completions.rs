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
//! A failure after the stream started is sent as `data: {"error": {...}}` followed by
//! `data: [DONE]`. Dropping the response (the client disconnected) drops the
//! [`GenerationStream`], which cancels the request on the nodes at once.

use std::convert::Infallible;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::{StreamExt, stream};
use serde_json::{Value, json};

use super::authorize;
use super::error::{ApiError, body as error_body};
use super::openai::{RequestBody, parse_body};
use crate::error::RouterError;
use crate::pipeline::{
    GenerationEvent, GenerationFinal, GenerationStream, RequestContext, Router, Usage,
};
use tandem_telemetry::trace::propagation::{RemoteParent, TRACEPARENT};

/// Which endpoint is answering.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Endpoint {
    Completion,
    Chat,
}

/// What every chunk of one response repeats.
#[derive(Clone, Debug)]
struct Meta {
    endpoint: Endpoint,
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
}

pub(super) async fn completions(
    State(router): State<Router>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let key = authorize(&router, &headers)?;
    let request: RequestBody = parse_body(&body)?;
    let (stream, include_usage) = (request.stream, request.include_usage());
    let core = request.into_completion()?;
    let generation = router.generate_with(core, context(&headers, key)).await?;
    respond(&router, Endpoint::Completion, generation, stream, include_usage).await
}

pub(super) async fn chat_completions(
    State(router): State<Router>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let key = authorize(&router, &headers)?;
    let request: RequestBody = parse_body(&body)?;
    let (stream, include_usage) = (request.stream, request.include_usage());
    let core = request.into_chat()?;
    let generation = router.generate_with(core, context(&headers, key)).await?;
    respond(&router, Endpoint::Chat, generation, stream, include_usage).await
}

/// The request's context: the caller (its key id) and, from a W3C `traceparent` header, the
/// trace it continues.
fn context(headers: &HeaderMap, key: crate::keys::KeyIdentity) -> RequestContext {
    RequestContext {
        parent: RemoteParent::from_http(headers),
        key,
    }
}

async fn respond(
    router: &Router,
    endpoint: Endpoint,
    generation: GenerationStream,
    stream: bool,
    include_usage: bool,
) -> Result<Response, ApiError> {
    let prefix = match endpoint {
        Endpoint::Completion => "cmpl",
        Endpoint::Chat => "chatcmpl",
    };
    let meta = Meta {
        endpoint,
        id: format!("{prefix}-{}", generation.request_id()),
        created: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        model: router.model().name.clone(),
        include_usage,
    };
    let traceparent = generation.traceparent().map(str::to_owned);
    let mut response = if stream {
        sse(meta, generation).into_response()
    } else {
        collect(meta, generation).await?
    };
    // The trace id goes back to the client, whichever way the answer is sent.
    if let Some(value) = traceparent.and_then(|t| axum::http::HeaderValue::from_str(&t).ok()) {
        response.headers_mut().insert(TRACEPARENT, value);
    }
    Ok(response)
}

/// Reads the whole generation and answers one JSON object.
async fn collect(meta: Meta, mut generation: GenerationStream) -> Result<Response, ApiError> {
    let mut text = String::new();
    while let Some(event) = generation.next().await {
        match event? {
            GenerationEvent::Delta { text: piece, .. } => text.push_str(&piece),
            GenerationEvent::Final(done) => {
                let choice = match meta.endpoint {
                    Endpoint::Completion => json!({
                        "index": 0, "text": text, "logprobs": null,
                        "finish_reason": done.finish_reason.openai(),
                    }),
                    Endpoint::Chat => json!({
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "logprobs": null,
                        "finish_reason": done.finish_reason.openai(),
                    }),
                };
                let object = match meta.endpoint {
                    Endpoint::Completion => "text_completion",
                    Endpoint::Chat => "chat.completion",
                };
                return Ok(axum::Json(json!({
                    "id": meta.id, "object": object, "created": meta.created, "model": meta.model,
                    "choices": [choice],
                    "usage": usage_json(done.usage),
                }))
                .into_response());
            }
        }
    }
    Err(ApiError(RouterError::PipelineLost))
}

fn usage_json(usage: Usage) -> Value {
    json!({
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
    })
}

impl Meta {
    fn chunk(&self, choices: Value) -> Value {
        let object = match self.endpoint {
            Endpoint::Completion => "text_completion",
            Endpoint::Chat => "chat.completion.chunk",
        };
        let mut chunk = json!({
            "id": self.id, "object": object, "created": self.created, "model": self.model,
            "choices": choices,
        });
        if self.include_usage {
            chunk["usage"] = Value::Null;
        }
        chunk
    }

    fn choice(&self, text: Option<&str>, finish_reason: Option<&str>) -> Value {
        match self.endpoint {
            Endpoint::Completion => json!([{
                "index": 0, "text": text.unwrap_or(""), "logprobs": null, "finish_reason": finish_reason,
            }]),
            Endpoint::Chat => {
                let delta = match text {
                    Some(text) => json!({"content": text}),
                    None => json!({}),
                };
                json!([{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish_reason}])
            }
        }
    }

    fn role_chunk(&self) -> Value {
        self.chunk(json!([{
            "index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null,
        }]))
    }

    fn final_chunks(&self, done: &GenerationFinal) -> Vec<Value> {
        let mut chunks = vec![self.chunk(self.choice(None, Some(done.finish_reason.openai())))];
        if self.include_usage {
            let mut usage = self.chunk(json!([]));
            usage["usage"] = usage_json(done.usage);
            chunks.push(usage);
        }
        chunks
    }
}

enum Phase {
    Start,
    Streaming,
    Done,
}

fn data(value: &Value) -> Event {
    Event::default().data(value.to_string())
}

fn done_event() -> Event {
    Event::default().data("[DONE]")
}

/// The generation as server-sent events.
fn sse(
    meta: Meta,
    generation: GenerationStream,
) -> Sse<impl futures_util::Stream<Item = Result<Event, Infallible>> + Send> {
    let events = stream::unfold(
        (generation, meta, Phase::Start),
        |(mut generation, meta, phase)| async move {
            let events = match phase {
                Phase::Done => return None,
                Phase::Start => {
                    let events = match meta.endpoint {
                        Endpoint::Chat => vec![data(&meta.role_chunk())],
                        Endpoint::Completion => Vec::new(),
                    };
                    return Some((events, (generation, meta, Phase::Streaming)));
                }
                Phase::Streaming => match generation.next().await {
                    Some(Ok(GenerationEvent::Delta { text, .. })) => {
                        let events = if text.is_empty() {
                            Vec::new()
                        } else {
                            vec![data(&meta.chunk(meta.choice(Some(&text), None)))]
                        };
                        return Some((events, (generation, meta, Phase::Streaming)));
                    }
                    Some(Ok(GenerationEvent::Final(done))) => {
                        let mut events: Vec<Event> =
                            meta.final_chunks(&done).iter().map(data).collect();
                        events.push(done_event());
                        events
                    }
                    Some(Err(error)) => vec![data(&error_body(&error)), done_event()],
                    None => vec![data(&error_body(&RouterError::PipelineLost)), done_event()],
                },
            };
            Some((events, (generation, meta, Phase::Done)))
        },
    )
    .flat_map(|events| stream::iter(events.into_iter().map(Ok)));
    Sse::new(events)
}
