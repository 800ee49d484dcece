//! OpenAI request bodies (`/v1/completions`, `/v1/chat/completions`) and their conversion to
//! the core's [`GenerateRequest`].
//!
//! Accepted beyond the required fields: `max_tokens` (chat also `max_completion_tokens`),
//! `temperature`, `top_p`, `top_k` (extension; -1 or 0 = off), `seed`, `stop` (string or
//! list), `stream`, `stream_options.include_usage`, `n` (1 to 16 choices), `presence_penalty`,
//! `frequency_penalty`, `repetition_penalty` (extension, as vLLM's), `logprobs` (chat: a
//! boolean with `top_logprobs` 0–20; completions: an integer 0–5, the alternatives per
//! position), `user` (an end-user id for the caller's own records: accepted and not used, as
//! it changes no output), `response_format` (`text`, `json_object`, `json_schema`: structured
//! output by grammar-constrained decoding; a bad schema is a 400 naming its part), and the
//! extensions `priority` (`"interactive"` / `"batch"`, or an integer: ≤ 0 interactive, > 0
//! batch, lower is more urgent as in vLLM), `ignore_eos` and `request_id`. Fields OpenAI has
//! but tandem cannot honour (`echo`, `best_of` > 1, `logit_bias`, `suffix`, `tools`,
//! `tool_choice`, `functions`, `function_call`) are refused with a 400 naming them rather than
//! silently ignored; other unknown fields are ignored, as OpenAI does.

use serde::Deserialize;
use tandem_grammar::ResponseFormat;
use tandem_tokenizer::ChatMessage;

use crate::error::RouterError;
use crate::request::{Field, GenerateRequest, Priority, PromptInput, Sampling};

/// `prompt`: a string, a list of one string, or token ids.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum PromptField {
    /// One prompt.
    Text(String),
    /// A batch of prompts (only one is supported).
    Texts(Vec<String>),
    /// One tokenized prompt.
    Tokens(Vec<u32>),
    /// A batch of tokenized prompts (only one is supported).
    TokenBatches(Vec<Vec<u32>>),
}

/// `stop`: one string or a list.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum StopField {
    /// One stop string.
    One(String),
    /// Several.
    Many(Vec<String>),
}

/// `priority`: a class name or a vLLM-style integer.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum PriorityField {
    /// `"interactive"` or `"batch"`.
    Name(String),
    /// ≤ 0 interactive, > 0 batch.
    Level(i64),
}

/// `stream_options`.
#[derive(Debug, Default, Deserialize)]
pub struct StreamOptions {
    /// Send a last chunk with usage (and `usage: null` on the others).
    #[serde(default)]
    pub include_usage: bool,
}

/// The body of `POST /v1/completions` and `POST /v1/chat/completions` (one struct without
/// `#[serde(flatten)]`, so type errors keep the field's path): `prompt` is required by the
/// first, `messages` by the second.
#[derive(Debug, Default, Deserialize)]
pub struct RequestBody {
    /// The prompt (completions).
    pub prompt: Option<PromptField>,
    /// The conversation (chat).
    pub messages: Option<Vec<ChatMessageField>>,
    /// Model name.
    #[serde(default)]
    pub model: String,
    /// Output limit.
    pub max_tokens: Option<u32>,
    /// The newer name of `max_tokens` (chat; wins over it).
    pub max_completion_tokens: Option<u32>,
    /// Temperature.
    pub temperature: Option<f32>,
    /// Nucleus mass.
    pub top_p: Option<f32>,
    /// Top-k (extension).
    pub top_k: Option<i64>,
    /// Seed.
    pub seed: Option<u64>,
    /// Stop strings.
    pub stop: Option<StopField>,
    /// Stream as server-sent events.
    #[serde(default)]
    pub stream: bool,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// Number of choices (1 to 16).
    pub n: Option<u32>,
    /// Scheduling class (extension).
    pub priority: Option<PriorityField>,
    /// Keep generating past end-of-sequence (extension).
    #[serde(default)]
    pub ignore_eos: bool,
    /// Caller's request id (extension).
    pub request_id: Option<String>,
    /// Echo the prompt (unsupported when true).
    pub echo: Option<bool>,
    /// Log probabilities: a boolean (chat) or the alternatives per position (completions).
    pub logprobs: Option<serde_json::Value>,
    /// Best-of sampling (unsupported above 1).
    pub best_of: Option<u32>,
    /// Presence penalty (-2 to 2).
    pub presence_penalty: Option<f32>,
    /// Frequency penalty (-2 to 2).
    pub frequency_penalty: Option<f32>,
    /// Tool definitions (unsupported).
    pub tools: Option<serde_json::Value>,
    /// Tool choice (unsupported unless `"none"`).
    pub tool_choice: Option<serde_json::Value>,
    /// Legacy function calling (unsupported).
    pub functions: Option<serde_json::Value>,
    /// Legacy function choice (unsupported unless `"none"`).
    pub function_call: Option<serde_json::Value>,
    /// Output format: `{"type": "text"}`, `"json_object"` or `"json_schema"` (structured
    /// output by grammar-constrained decoding).
    pub response_format: Option<serde_json::Value>,
    /// Alternatives per position (chat, with `logprobs: true`; 0 to 20).
    pub top_logprobs: Option<u32>,
    /// Token biases (unsupported unless empty).
    pub logit_bias: Option<serde_json::Value>,
    /// Repetition penalty (extension, vLLM's; (0, 2], 1 = off).
    pub repetition_penalty: Option<f32>,
    /// The caller's end-user id (recorded by the caller; changes nothing here).
    pub user: Option<String>,
    /// Text after the completion (unsupported unless empty).
    pub suffix: Option<String>,
}

/// A chat message's `content`: a string or a list of text parts.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum ContentField {
    /// Plain text.
    Text(String),
    /// Content parts (`{"type": "text", "text": ...}`).
    Parts(Vec<ContentPart>),
}

/// One content part.
#[derive(Debug, Deserialize)]
pub struct ContentPart {
    /// Part type; only `text` is supported.
    #[serde(rename = "type")]
    pub kind: String,
    /// The text.
    #[serde(default)]
    pub text: String,
}

/// One chat message.
#[derive(Debug, Deserialize)]
pub struct ChatMessageField {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// The content (null counts as empty).
    pub content: Option<ContentField>,
}

fn missing(field: &str) -> RouterError {
    RouterError::MalformedBody {
        message: format!("missing field `{field}`"),
        path: Some(field.to_string()),
    }
}

/// Parses a JSON body, naming the offending field's path in the error.
pub fn parse_body<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, RouterError> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let value = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        // serde_path_to_error writes `.` for the root and `?` where it lost track.
        let path = (!matches!(path.as_str(), "" | "." | "?")).then_some(path);
        let inner = e.into_inner();
        RouterError::MalformedBody {
            message: match &path {
                Some(p) => format!("{p}: {inner}"),
                None => inner.to_string(),
            },
            path,
        }
    })?;
    de.end().map_err(|e| RouterError::MalformedBody {
        message: e.to_string(),
        path: None,
    })?;
    Ok(value)
}

impl RequestBody {
    /// The core request of a completion (`prompt` required).
    pub fn into_completion(mut self) -> Result<GenerateRequest, RouterError> {
        let input = match self.prompt.take().ok_or_else(|| missing("prompt"))? {
            PromptField::Text(text) => PromptInput::Text(text),
            PromptField::Tokens(ids) => PromptInput::TokenIds(ids),
            PromptField::Texts(mut texts) if texts.len() == 1 => {
                PromptInput::Text(texts.pop().expect("one element"))
            }
            PromptField::TokenBatches(mut batches) if batches.len() == 1 => {
                PromptInput::TokenIds(batches.pop().expect("one element"))
            }
            PromptField::Texts(texts) if texts.is_empty() => PromptInput::Text(String::new()),
            PromptField::TokenBatches(b) if b.is_empty() => PromptInput::TokenIds(Vec::new()),
            _ => {
                return Err(RouterError::invalid(
                    Field::Prompt,
                    "holds several prompts; send one prompt per request",
                ));
            }
        };
        self.into_core(input, false)
    }

    /// The core request of a chat completion (`messages` required).
    pub fn into_chat(mut self) -> Result<GenerateRequest, RouterError> {
        let fields = self.messages.take().ok_or_else(|| missing("messages"))?;
        let mut messages = Vec::with_capacity(fields.len());
        for (i, m) in fields.into_iter().enumerate() {
            let content = match m.content {
                None => String::new(),
                Some(ContentField::Text(text)) => text,
                Some(ContentField::Parts(parts)) => {
                    if let Some(p) = parts.iter().find(|p| p.kind != "text") {
                        return Err(RouterError::invalid(
                            Field::Messages,
                            format!(
                                "message {i} has a `{}` content part; only text is supported",
                                p.kind
                            ),
                        ));
                    }
                    parts.into_iter().map(|p| p.text).collect()
                }
            };
            messages.push(ChatMessage::new(m.role, content));
        }
        self.into_core(PromptInput::Chat(messages), true)
    }

    /// Choices asked for (`n`; absent = 1; the router checks the range).
    pub fn choices(&self) -> u32 {
        self.n.unwrap_or(1)
    }

    /// `logprobs` (and chat's `top_logprobs`) as (on, alternatives per position).
    fn logprobs(&self, chat: bool) -> Result<(bool, u32), RouterError> {
        let value = self.logprobs.as_ref().filter(|v| !v.is_null());
        if chat {
            return match value {
                None | Some(serde_json::Value::Bool(false)) => {
                    Ok((false, self.top_logprobs.unwrap_or(0)))
                }
                Some(serde_json::Value::Bool(true)) => Ok((true, self.top_logprobs.unwrap_or(0))),
                Some(other) => Err(RouterError::invalid(
                    Field::Logprobs,
                    format!("is {other}, expected true or false (top_logprobs sets the alternatives)"),
                )),
            };
        }
        if self.top_logprobs.is_some() {
            return Err(RouterError::invalid(
                Field::TopLogprobs,
                "is a chat parameter; completions take logprobs: <alternatives per position>",
            ));
        }
        match value {
            None | Some(serde_json::Value::Bool(false)) => Ok((false, 0)),
            Some(v) => match v.as_u64() {
                Some(k) if k <= 5 => Ok((true, k as u32)),
                _ => Err(RouterError::invalid(
                    Field::Logprobs,
                    format!("is {v}, expected an integer from 0 to 5 (alternatives per position)"),
                )),
            },
        }
    }

    /// Whether a final usage chunk is wanted.
    pub fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage)
    }

    fn into_core(self, input: PromptInput, chat: bool) -> Result<GenerateRequest, RouterError> {
        let (logprobs, top_logprobs) = self.logprobs(chat)?;
        let unsupported =
            |name, reason: &str| RouterError::invalid(Field::Unsupported(name), reason.to_string());
        if self.echo == Some(true) {
            return Err(unsupported("echo", "is not supported"));
        }
        if self.best_of.is_some_and(|b| b > 1) {
            return Err(unsupported("best_of", "only best_of = 1 is supported"));
        }
        if self.tools.as_ref().is_some_and(|t| !t.is_null()) {
            return Err(unsupported("tools", "are not supported"));
        }
        let none_or = |v: &Option<serde_json::Value>, ok: &str| {
            v.as_ref()
                .is_none_or(|v| v.is_null() || v.as_str() == Some(ok))
        };
        if !none_or(&self.tool_choice, "none") {
            return Err(unsupported("tool_choice", "is not supported (tools are not)"));
        }
        if self.functions.as_ref().is_some_and(|f| !f.is_null()) {
            return Err(unsupported("functions", "are not supported"));
        }
        if !none_or(&self.function_call, "none") {
            return Err(unsupported("function_call", "is not supported (functions are not)"));
        }
        let response_format = match &self.response_format {
            None | Some(serde_json::Value::Null) => None,
            Some(f) => ResponseFormat::from_openai(f)
                .map_err(|e| RouterError::invalid(Field::ResponseFormat, e.to_string()))?,
        };
        if self.logit_bias.as_ref().is_some_and(|b| {
            !b.is_null() && b.as_object().is_none_or(|m| !m.is_empty())
        }) {
            return Err(unsupported("logit_bias", "is not supported"));
        }
        if self.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
            return Err(unsupported("suffix", "is not supported"));
        }
        let top_k = match self.top_k {
            None | Some(-1) | Some(0) => 0,
            Some(k) if k > 0 && k <= u32::MAX as i64 => k as u32,
            Some(k) => {
                return Err(RouterError::invalid(
                    Field::TopK,
                    format!("is {k}, expected a positive integer, or -1 / 0 for off"),
                ));
            }
        };
        let priority = match self.priority {
            None => Priority::Interactive,
            Some(PriorityField::Name(name)) => match name.as_str() {
                "interactive" => Priority::Interactive,
                "batch" => Priority::Batch,
                other => {
                    return Err(RouterError::invalid(
                        Field::Priority,
                        format!("is `{other}`, expected `interactive` or `batch`"),
                    ));
                }
            },
            Some(PriorityField::Level(level)) if level <= 0 => Priority::Interactive,
            Some(PriorityField::Level(_)) => Priority::Batch,
        };
        let stop = match self.stop {
            None => Vec::new(),
            Some(StopField::One(s)) => vec![s],
            Some(StopField::Many(v)) => v,
        };
        Ok(GenerateRequest {
            model: self.model,
            input,
            sampling: Sampling {
                temperature: self.temperature.unwrap_or(0.0),
                top_p: self.top_p.unwrap_or(0.0),
                top_k,
                seed: self.seed,
                stop,
                max_tokens: self.max_completion_tokens.or(self.max_tokens),
                ignore_eos: self.ignore_eos,
                presence_penalty: self.presence_penalty.unwrap_or(0.0),
                frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
                repetition_penalty: self.repetition_penalty,
                logprobs,
                top_logprobs,
                response_format,
            },
            priority,
            request_id: self.request_id,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_type_error_names_the_field_path() {
        let err =
            parse_body::<RequestBody>(br#"{"prompt": "hi", "max_tokens": "ten"}"#).unwrap_err();
        match err {
            RouterError::MalformedBody { path, message } => {
                assert_eq!(path.as_deref(), Some("max_tokens"), "{message}");
                assert!(message.contains("invalid type"), "{message}");
            }
            other => panic!("expected MalformedBody, got {other:?}"),
        }
    }

    #[test]
    fn prompts_of_every_accepted_shape_convert_and_batches_are_refused() {
        let one = parse_body::<RequestBody>(br#"{"prompt": ["hi"]}"#).unwrap();
        assert_eq!(
            one.into_completion().unwrap().input,
            PromptInput::Text("hi".into())
        );
        let ids = parse_body::<RequestBody>(br#"{"prompt": [1, 2, 3]}"#).unwrap();
        assert_eq!(
            ids.into_completion().unwrap().input,
            PromptInput::TokenIds(vec![1, 2, 3])
        );
        let two = parse_body::<RequestBody>(br#"{"prompt": ["a", "b"]}"#).unwrap();
        assert!(matches!(
            two.into_completion(),
            Err(RouterError::InvalidArgument {
                field: Field::Prompt,
                ..
            })
        ));
    }

    #[test]
    fn chat_takes_max_completion_tokens_over_max_tokens_and_text_parts() {
        let body = br#"{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
                        "max_tokens": 5, "max_completion_tokens": 7, "priority": "batch", "top_k": -1}"#;
        let core = parse_body::<RequestBody>(body)
            .unwrap()
            .into_chat()
            .unwrap();
        assert_eq!(core.sampling.max_tokens, Some(7));
        assert_eq!(core.sampling.top_k, 0);
        assert_eq!(core.priority, Priority::Batch);
        assert_eq!(
            core.input,
            PromptInput::Chat(vec![ChatMessage::new("user", "ab")])
        );
    }

    #[test]
    fn output_changing_fields_are_refused_by_name_and_their_neutral_values_accepted() {
        let refused = [
            (r#""logit_bias": {"50256": -100}"#, "logit_bias"),
            (r#""tool_choice": "auto""#, "tool_choice"),
            (r#""functions": [{"name": "f"}]"#, "functions"),
            (r#""function_call": "auto""#, "function_call"),
            (r#""suffix": "end""#, "suffix"),
        ];
        for (field, name) in refused {
            let body = format!(r#"{{"prompt": "x", {field}}}"#);
            let err = parse_body::<RequestBody>(body.as_bytes())
                .unwrap()
                .into_completion()
                .unwrap_err();
            assert!(
                matches!(&err, RouterError::InvalidArgument { field: Field::Unsupported(n), .. } if *n == name),
                "{body}: {err:?}"
            );
            assert!(err.is_client_error());
        }
        // A malformed response_format is refused naming its part; a well-formed one is
        // carried to the core (the schema itself is compiled there).
        for (format, part) in [
            (r#"{"type": "yaml"}"#, "response_format.type"),
            (r#"{"type": "json_schema", "json_schema": {}}"#, "response_format.json_schema.name"),
            (r#"{"type": "json_schema", "json_schema": {"name": "n", "schema": 1}}"#, "response_format.json_schema.schema"),
        ] {
            let body = format!(r#"{{"prompt": "x", "response_format": {format}}}"#);
            let err = parse_body::<RequestBody>(body.as_bytes()).unwrap().into_completion().unwrap_err();
            assert!(
                matches!(&err, RouterError::InvalidArgument { field: Field::ResponseFormat, reason } if reason.starts_with(part)),
                "{body}: {err:?}"
            );
        }
        let body = r#"{"prompt": "x", "response_format": {"type": "json_object"}}"#;
        let core = parse_body::<RequestBody>(body.as_bytes()).unwrap().into_completion().unwrap();
        assert_eq!(core.sampling.response_format, Some(ResponseFormat::JsonObject));
        let neutral = [
            r#""response_format": {"type": "text"}"#,
            r#""top_logprobs": 0"#,
            r#""logit_bias": {}"#,
            r#""repetition_penalty": 1.0"#,
            r#""tool_choice": "none""#,
            r#""function_call": null"#,
            r#""suffix": """#,
            r#""user": "u-1""#,
        ];
        for field in neutral {
            let body = format!(r#"{{"messages": [{{"role": "user", "content": "x"}}], {field}}}"#);
            let parsed = parse_body::<RequestBody>(body.as_bytes()).unwrap();
            assert!(parsed.into_chat().is_ok(), "{body}");
        }
    }

    #[test]
    fn penalties_logprobs_and_n_are_taken_per_endpoint() {
        let body = br#"{"messages": [{"role": "user", "content": "x"}], "presence_penalty": 0.5,
                        "frequency_penalty": -0.5, "repetition_penalty": 1.1, "logprobs": true,
                        "top_logprobs": 3, "n": 4}"#;
        let parsed = parse_body::<RequestBody>(body).unwrap();
        assert_eq!(parsed.choices(), 4);
        let s = parsed.into_chat().unwrap().sampling;
        assert_eq!(
            (s.presence_penalty, s.frequency_penalty, s.repetition_penalty),
            (0.5, -0.5, Some(1.1))
        );
        assert_eq!((s.logprobs, s.top_logprobs), (true, 3));
        // Completions: logprobs is the number of alternatives.
        let c = parse_body::<RequestBody>(br#"{"prompt": "x", "logprobs": 2}"#).unwrap();
        let s = c.into_completion().unwrap().sampling;
        assert_eq!((s.logprobs, s.top_logprobs), (true, 2));
        let off = parse_body::<RequestBody>(br#"{"prompt": "x", "logprobs": null}"#).unwrap();
        assert!(!off.into_completion().unwrap().sampling.logprobs);
        for (body, chat, field) in [
            (r#""logprobs": 6"#, false, Field::Logprobs),
            (r#""logprobs": true"#, false, Field::Logprobs),
            (r#""top_logprobs": 2"#, false, Field::TopLogprobs),
            (r#""logprobs": 3"#, true, Field::Logprobs),
        ] {
            let b = if chat {
                format!(r#"{{"messages": [{{"role": "user", "content": "x"}}], {body}}}"#)
            } else {
                format!(r#"{{"prompt": "x", {body}}}"#)
            };
            let parsed = parse_body::<RequestBody>(b.as_bytes()).unwrap();
            let err = if chat { parsed.into_chat() } else { parsed.into_completion() }.unwrap_err();
            assert!(
                matches!(&err, RouterError::InvalidArgument { field: f, .. } if *f == field),
                "{b}: {err:?}"
            );
        }
    }
}
