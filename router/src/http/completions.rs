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
use axum::extract::rejection::BytesRejection;
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
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let key = authorize(&router, &headers)?;
    let request: RequestBody = parse_body(&super::body_bytes(body)?)?;
    let (stream, include_usage) = (request.stream, request.include_usage());
    let core = request.into_completion()?;
    let generation = router.generate_with(core, context(&headers, key)).await?;
    respond(&router, Endpoint::Completion, generation, stream, include_usage).await
}

pub(super) async fn chat_completions(
    State(router): State<Router>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let key = authorize(&router, &headers)?;
    let request: RequestBody = parse_body(&super::body_bytes(body)?)?;
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
    let rate_limit = generation.rate_limit();
    let mut response = if stream {
        sse(meta, generation).into_response()
    } else {
        collect(meta, generation).await?
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

/// The generation as server-sent events (any stream of generation events: the pipeline's
/// [`GenerationStream`], or the fuzz test's).
fn sse<S>(meta: Meta, generation: S) -> Sse<impl futures_util::Stream<Item = Result<Event, Infallible>> + Send>
where
    S: futures_util::Stream<Item = Result<GenerationEvent, RouterError>> + Send + Unpin + 'static,
{
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

#[cfg(test)]
mod tests {
    //! Fuzzed SSE writer: random token texts (newlines, CR, NUL and escape characters, `data:`
    //! and `[DONE]` look-alikes, quotes, backslashes, emoji, U+2028, U+FFFD) and random endings
    //! (final, error, stream lost), for both endpoints, with and without usage, through the
    //! real writer into wire bytes. Every frame must be one `data:` line of valid JSON, the
    //! text must come back exactly, the end must be said once and `[DONE]` must close it.

    use super::*;
    use crate::pipeline::{FinishReason, Usage};
    use tandem_cluster::Role;

    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }

    const PIECES: &[&str] = &[
        "Hel", "lo", " ", "\n", "\r\n", "\r", "\n\n", "data: x", "[DONE]", "\u{0}", "\u{1b}[31m",
        "é", "🦀", "\u{2028}", "\"quoted\"", "\\", ":", "event: e", "id: 1", "{\"error\":1}",
        "\u{FFFD}", "\t",
    ];

    fn text(rng: &mut Rng) -> String {
        (0..rng.below(5)).map(|_| PIECES[rng.below(PIECES.len())]).collect()
    }

    #[tokio::test]
    async fn any_text_and_any_ending_make_well_formed_events() {
        let seed = std::env::var("TANDEM_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x55e);
        let mut rng = Rng(seed);
        for case in 0..3_000 {
            let endpoint = if rng.below(2) == 0 { Endpoint::Completion } else { Endpoint::Chat };
            let include_usage = rng.below(2) == 0;
            let meta = Meta {
                endpoint,
                id: "cmpl-1".into(),
                created: 1,
                model: "m".into(),
                include_usage,
            };
            let texts: Vec<String> = (0..rng.below(8)).map(|_| text(&mut rng)).collect();
            let mut events: Vec<Result<GenerationEvent, RouterError>> = texts
                .iter()
                .map(|t| Ok(GenerationEvent::Delta { text: t.clone(), token_ids: vec![1] }))
                .collect();
            let ending = rng.below(3);
            match ending {
                0 => events.push(Ok(GenerationEvent::Final(GenerationFinal {
                    finish_reason: FinishReason::Length,
                    usage: Usage { prompt_tokens: 3, cached_prompt_tokens: 0, completion_tokens: 2 },
                    request_id: "r".into(),
                }))),
                1 => events.push(Err(RouterError::NoNodes { role: Role::Decode })),
                _ => {} // the pipeline went away without a word
            }
            let body = sse(meta, stream::iter(events)).into_response().into_body();
            let bytes = axum::body::to_bytes(body, usize::MAX).await.unwrap();
            let wire = String::from_utf8(bytes.to_vec()).expect("the wire is UTF-8");
            let ctx = format!("case {case} (TANDEM_SEED={seed}): {texts:?} ending {ending}\n{wire}");
            assert!(wire.ends_with("\n\n"), "{ctx}");
            let frames: Vec<&str> = wire.trim_end_matches("\n\n").split("\n\n").collect();
            assert_eq!(frames.last(), Some(&"data: [DONE]"), "{ctx}");
            assert_eq!(frames.iter().filter(|f| **f == "data: [DONE]").count(), 1, "{ctx}");
            let (mut got, mut finishes, mut usages, mut errors) = (String::new(), 0, 0, 0);
            for frame in &frames[..frames.len() - 1] {
                assert!(!frame.contains(['\n', '\r']), "one line per frame: {frame:?}\n{ctx}");
                let json = frame.strip_prefix("data: ").unwrap_or_else(|| panic!("{frame:?}\n{ctx}"));
                let v: Value = serde_json::from_str(json).unwrap_or_else(|e| panic!("{e}: {json}\n{ctx}"));
                if v.get("error").is_some() {
                    errors += 1;
                    continue;
                }
                if v["usage"].is_object() {
                    usages += 1;
                }
                for c in v["choices"].as_array().unwrap() {
                    let piece = match endpoint {
                        Endpoint::Completion => c["text"].as_str(),
                        Endpoint::Chat => c["delta"]["content"].as_str(),
                    };
                    got.push_str(piece.unwrap_or(""));
                    finishes += usize::from(!c["finish_reason"].is_null());
                }
            }
            assert_eq!(got, texts.concat(), "{ctx}");
            match ending {
                0 => {
                    assert_eq!((finishes, errors), (1, 0), "{ctx}");
                    assert_eq!(usages, usize::from(include_usage), "{ctx}");
                }
                _ => assert_eq!((finishes, usages, errors), (0, 0, 1), "{ctx}"),
            }
        }
    }
}
