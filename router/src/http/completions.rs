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
//! [`GenerationStream`], which cancels the request on the nodes at once.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::{StreamExt, stream};
use serde_json::{Value, json};
use tandem_proto::v1 as pb;
use tandem_tokenizer::Tokenizer;

use super::authorize;
use super::error::{ApiError, body as error_body};
use super::logprobs::{LogprobWriter, extend_completion};
use super::openai::{RequestBody, parse_body};
use crate::error::RouterError;
use crate::pipeline::{
    ChoiceEvent, Choices, GenerationEvent, GenerationFinal, RequestContext, Router, Usage,
};
use tandem_telemetry::trace::propagation::{RemoteParent, TRACEPARENT};

/// Which endpoint is answering.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Endpoint {
    Completion,
    Chat,
}

/// What every chunk of one response repeats, and how its choices are rendered.
#[derive(Clone, Debug)]
struct Meta {
    endpoint: Endpoint,
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
    /// Choices in the response.
    n: u32,
    /// `Some(with alternatives)` when the request asked for logprobs.
    logprobs: Option<bool>,
    tokenizer: Arc<Tokenizer>,
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
        sse(meta, choices.merged()).into_response()
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

/// The usage of a request whose choices ended with `finals`: the prompt once (as the first
/// choice counted it), the output of all.
fn total_usage(finals: &[GenerationFinal]) -> Usage {
    let first = finals.first().map(|f| f.usage).unwrap_or_default();
    Usage {
        completion_tokens: finals.iter().map(|f| f.usage.completion_tokens).sum(),
        ..first
    }
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

    /// Choice `index`'s chunk: `text` (none: the finish chunk), its tokens' `logprobs`.
    fn choice(
        &self,
        index: u32,
        text: Option<&str>,
        logprobs: Option<Value>,
        finish_reason: Option<&str>,
    ) -> Value {
        let logprobs = logprobs.unwrap_or(Value::Null);
        match self.endpoint {
            Endpoint::Completion => json!([{
                "index": index, "text": text.unwrap_or(""), "logprobs": logprobs, "finish_reason": finish_reason,
            }]),
            Endpoint::Chat => {
                let delta = match text {
                    Some(text) => json!({"content": text}),
                    None => json!({}),
                };
                json!([{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}])
            }
        }
    }

    fn role_chunk(&self) -> Value {
        let choices: Vec<Value> = (0..self.n)
            .map(|i| {
                json!({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null})
            })
            .collect();
        self.chunk(Value::Array(choices))
    }

    fn usage_chunk(&self, finals: &[GenerationFinal]) -> Value {
        let mut usage = self.chunk(json!([]));
        usage["usage"] = usage_json(total_usage(finals));
        usage
    }
}

/// The SSE writer's state between events.
struct Writer {
    meta: Meta,
    logprobs: Vec<LogprobWriter>,
    finals: Vec<GenerationFinal>,
}

impl Writer {
    /// The events for choice `index`'s delta.
    fn delta(&mut self, index: u32, text: &str, logprobs: &[pb::TokenLogprob]) -> Vec<Event> {
        let rendered = match self.meta.logprobs {
            Some(with_top) if !logprobs.is_empty() => {
                let w = &mut self.logprobs[index as usize];
                Some(match self.meta.endpoint {
                    Endpoint::Chat => json!({"content": w.chat(logprobs)}),
                    Endpoint::Completion => w.completion(logprobs, with_top),
                })
            }
            _ => None,
        };
        if text.is_empty() && rendered.is_none() {
            return Vec::new();
        }
        vec![data(&self.meta.chunk(self.meta.choice(index, Some(text), rendered, None)))]
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

/// The choices as server-sent events (any stream of tagged generation events: the pipeline's
/// merged [`Choices`], or the fuzz test's).
fn sse<S>(meta: Meta, generation: S) -> Sse<impl futures_util::Stream<Item = Result<Event, Infallible>> + Send>
where
    S: futures_util::Stream<Item = ChoiceEvent> + Send + Unpin + 'static,
{
    let writer = Writer {
        logprobs: (0..meta.n).map(|_| LogprobWriter::new(Arc::clone(&meta.tokenizer))).collect(),
        finals: Vec::new(),
        meta,
    };
    let events = stream::unfold(
        (generation, writer, Phase::Start),
        |(mut generation, mut w, phase)| async move {
            let events = match phase {
                Phase::Done => return None,
                Phase::Start => {
                    let events = match w.meta.endpoint {
                        Endpoint::Chat => vec![data(&w.meta.role_chunk())],
                        Endpoint::Completion => Vec::new(),
                    };
                    return Some((events, (generation, w, Phase::Streaming)));
                }
                Phase::Streaming => match generation.next().await {
                    Some((i, Ok(GenerationEvent::Delta { text, logprobs, .. }))) => {
                        let events = w.delta(i, &text, &logprobs);
                        return Some((events, (generation, w, Phase::Streaming)));
                    }
                    Some((i, Ok(GenerationEvent::Final(done)))) => {
                        let finish = done.finish_reason.openai();
                        let mut events =
                            vec![data(&w.meta.chunk(w.meta.choice(i, None, None, Some(finish))))];
                        w.finals.push(done);
                        if w.finals.len() < w.meta.n as usize {
                            return Some((events, (generation, w, Phase::Streaming)));
                        }
                        if w.meta.include_usage {
                            events.push(data(&w.meta.usage_chunk(&w.finals)));
                        }
                        events.push(done_event());
                        events
                    }
                    Some((_, Err(error))) => vec![data(&error_body(&error)), done_event()],
                    None => vec![data(&error_body(&RouterError::PipelineLost)), done_event()],
                },
            };
            Some((events, (generation, w, Phase::Done)))
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

    /// The real model's tokenizer (TANDEM_MODEL or the default path; `scripts/test.sh` sets it).
    fn tokenizer() -> Arc<Tokenizer> {
        static T: std::sync::OnceLock<Arc<Tokenizer>> = std::sync::OnceLock::new();
        Arc::clone(T.get_or_init(|| {
            let path = crate::model::default_model_path();
            crate::ServedModel::from_gguf(&path, None)
                .unwrap_or_else(|e| panic!("needs the default model: {e}"))
                .tokenizer
        }))
    }

    fn frames(wire: &str) -> Vec<Value> {
        let frames: Vec<&str> = wire.trim_end_matches("\n\n").split("\n\n").collect();
        assert_eq!(frames.last(), Some(&"data: [DONE]"), "{wire}");
        frames[..frames.len() - 1]
            .iter()
            .map(|f| serde_json::from_str(f.strip_prefix("data: ").unwrap()).unwrap())
            .collect()
    }

    fn final_event(completion_tokens: u32) -> GenerationEvent {
        GenerationEvent::Final(GenerationFinal {
            finish_reason: FinishReason::Stop,
            usage: Usage { prompt_tokens: 5, cached_prompt_tokens: 0, completion_tokens },
            request_id: "r".into(),
        })
    }

    #[tokio::test]
    async fn interleaved_choices_stream_by_index_with_logprobs_and_one_usage() {
        let tok = tokenizer();
        let (hello, world) = (tok.encode("Hello")[0], tok.encode(" world")[0]);
        let lp = |id: u32, v: f32| pb::TokenLogprob {
            token_id: id,
            logprob: v,
            top: vec![pb::TopLogprob { token_id: id, logprob: v }],
        };
        let delta = |id: u32, v: f32| GenerationEvent::Delta {
            text: tok.decode(&[id]),
            token_ids: vec![id],
            logprobs: vec![lp(id, v)],
        };
        for endpoint in [Endpoint::Chat, Endpoint::Completion] {
            let meta = Meta {
                endpoint,
                id: "x".into(),
                created: 1,
                model: "m".into(),
                include_usage: true,
                n: 2,
                logprobs: Some(true),
                tokenizer: Arc::clone(&tok),
            };
            let events: Vec<ChoiceEvent> = vec![
                (1, Ok(delta(world, -0.5))),
                (0, Ok(delta(hello, -0.25))),
                (1, Ok(final_event(1))),
                (0, Ok(delta(world, f32::NEG_INFINITY))),
                (0, Ok(final_event(2))),
            ];
            let body = sse(meta, stream::iter(events)).into_response().into_body();
            let wire = String::from_utf8(axum::body::to_bytes(body, usize::MAX).await.unwrap().to_vec()).unwrap();
            let frames = frames(&wire);
            let (mut text, mut finishes, mut lps) = ([String::new(), String::new()], [0, 0], vec![]);
            for v in &frames {
                for c in v["choices"].as_array().unwrap() {
                    let i = c["index"].as_u64().unwrap() as usize;
                    let piece = match endpoint {
                        Endpoint::Completion => c["text"].as_str(),
                        Endpoint::Chat => c["delta"]["content"].as_str(),
                    };
                    text[i].push_str(piece.unwrap_or(""));
                    finishes[i] += usize::from(!c["finish_reason"].is_null());
                    match endpoint {
                        Endpoint::Chat => {
                            for e in c["logprobs"]["content"].as_array().into_iter().flatten() {
                                lps.push((i, e["token"].as_str().unwrap().to_string(), e["logprob"].as_f64().unwrap()));
                                assert_eq!(e["top_logprobs"][0]["logprob"], e["logprob"]);
                            }
                        }
                        Endpoint::Completion => {
                            let l = &c["logprobs"];
                            for (t, p) in l["tokens"].as_array().into_iter().flatten().zip(l["token_logprobs"].as_array().into_iter().flatten()) {
                                lps.push((i, t.as_str().unwrap().to_string(), p.as_f64().unwrap()));
                            }
                        }
                    }
                }
            }
            assert_eq!(text, ["Hello world".to_string(), " world".to_string()], "{wire}");
            assert_eq!(finishes, [1, 1], "{wire}");
            assert_eq!(
                lps,
                [(1, " world".into(), -0.5), (0, "Hello".into(), -0.25), (0, " world".into(), -9999.0)],
                "{wire}"
            );
            let usage: Vec<&Value> = frames.iter().filter(|v| v["usage"].is_object()).map(|v| &v["usage"]).collect();
            assert_eq!(usage.len(), 1, "{wire}");
            assert_eq!((usage[0]["prompt_tokens"].as_u64(), usage[0]["completion_tokens"].as_u64()), (Some(5), Some(3)));
            assert_eq!(frames.last().unwrap()["choices"], json!([]), "usage comes after both finishes");
        }
    }

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
                n: 1,
                logprobs: None,
                tokenizer: tokenizer(),
            };
            let texts: Vec<String> = (0..rng.below(8)).map(|_| text(&mut rng)).collect();
            let mut events: Vec<Result<GenerationEvent, RouterError>> = texts
                .iter()
                .map(|t| Ok(GenerationEvent::Delta { text: t.clone(), token_ids: vec![1], logprobs: vec![] }))
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
            let events = events.into_iter().map(|e| (0, e));
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
