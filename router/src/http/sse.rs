//! The server-sent-events writer of `/v1/completions` and `/v1/chat/completions` (the shape is
//! in [`super::completions`]): one `data:` frame of JSON per event, the role chunk first (chat),
//! one chunk per delta and per finished choice, usage after the last choice (`include_usage`),
//! `[DONE]` last; an error after the start is one `{"error": ...}` frame, then `[DONE]`.
//!
//! Invariant: whatever the token texts hold (newlines, `data:` or `[DONE]` look-alikes, control
//! characters), every frame is one line of valid JSON: text only ever travels inside a JSON
//! string (the fuzz test below drives the real writer).

use std::convert::Infallible;
use std::sync::Arc;

use axum::response::sse::{Event, Sse};
use futures_util::{StreamExt, stream};
use serde_json::{Value, json};
use tandem_proto::v1 as pb;

use super::completions::{Endpoint, Meta, total_usage, usage_json};
use super::error::body as error_body;
use super::logprobs::LogprobWriter;
use crate::error::RouterError;
use crate::pipeline::{ChoiceEvent, GenerationEvent, GenerationFinal};

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

    /// The usage chunk, from every choice's final message (`finals[i]` is choice i's).
    fn usage_chunk(&self, finals: &[Option<GenerationFinal>]) -> Value {
        let finals: Vec<GenerationFinal> = finals.iter().flatten().cloned().collect();
        let mut usage = self.chunk(json!([]));
        usage["usage"] = usage_json(total_usage(&finals));
        usage
    }
}

/// The SSE writer's state between events.
struct Writer {
    meta: Meta,
    logprobs: Vec<LogprobWriter>,
    /// Each choice's final message, by index (usage counts the prompt as choice 0 did, in
    /// whatever order the choices finish).
    finals: Vec<Option<GenerationFinal>>,
    finished: usize,
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
pub(super) fn sse<S>(meta: Meta, generation: S) -> Sse<impl futures_util::Stream<Item = Result<Event, Infallible>> + Send>
where
    S: futures_util::Stream<Item = ChoiceEvent> + Send + Unpin + 'static,
{
    let writer = Writer {
        logprobs: (0..meta.n).map(|_| LogprobWriter::new(Arc::clone(&meta.tokenizer))).collect(),
        finals: vec![None; meta.n as usize],
        finished: 0,
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
                        if let Some(slot) = w.finals.get_mut(i as usize)
                            && slot.replace(done).is_none()
                        {
                            w.finished += 1;
                        }
                        if w.finished < w.meta.n as usize {
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
    use axum::response::IntoResponse;
    use tandem_cluster::Role;
    use tandem_tokenizer::Tokenizer;

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
