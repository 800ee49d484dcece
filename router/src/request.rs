//! A generation request as both ingresses hand it to the core ([`GenerateRequest`]), and its
//! validation into what the pipeline sends to the nodes ([`PreparedRequest`]).
//!
//! Validation happens once, here, before admission: every rule names the offending field
//! ([`Field`]), which each ingress renders in its own vocabulary (`max_tokens` over HTTP,
//! `sampling.max_tokens` over gRPC). Rules:
//!
//! - `model`: empty means the served model; anything else must equal its name.
//! - the input must be non-empty and tokenize to at least one token; token ids must be in the
//!   vocabulary; chat roles must be `system`, `user` or `assistant`.
//! - `max_tokens`: at most the configured limit; prompt + max_tokens at most the context
//!   length (the error names the input field, as OpenAI does). Absent or 0: the configured
//!   default, capped to what the context leaves.
//! - `temperature` in [0, 2], `top_p` in [0, 1] (0 = off), at most 4 non-empty stop strings.
//! - `presence_penalty` and `frequency_penalty` in [-2, 2]; `repetition_penalty` in (0, 2];
//!   `top_logprobs` at most 20 and only with `logprobs`.
//! - `response_format`: compiles against the model's vocabulary (a schema llguidance refuses
//!   is named with its reason); never with `ignore_eos`.
//!
//! Cost: tokenization, linear in the prompt (~2 ms for 8k tokens).

use tandem_grammar::ResponseFormat;
use tandem_proto::v1 as pb;
use tandem_tokenizer::ChatMessage;

use crate::error::RouterError;
use crate::model::ServedModel;

/// A request field, named in validation errors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Field {
    /// The model name.
    Model,
    /// Plain-text prompt.
    Prompt,
    /// Chat messages.
    Messages,
    /// Pre-tokenized prompt.
    TokenIds,
    /// Output token limit.
    MaxTokens,
    /// Sampling temperature.
    Temperature,
    /// Nucleus mass.
    TopP,
    /// Top-k cut.
    TopK,
    /// Stop strings.
    Stop,
    /// Number of choices.
    N,
    /// Presence penalty.
    PresencePenalty,
    /// Frequency penalty.
    FrequencyPenalty,
    /// Repetition penalty.
    RepetitionPenalty,
    /// Whether to return log probabilities.
    Logprobs,
    /// How many alternatives per position.
    TopLogprobs,
    /// Scheduling class.
    Priority,
    /// Structured output (the reason names the part: `response_format.json_schema.schema`).
    ResponseFormat,
    /// A field the router does not support with the given value (HTTP only).
    Unsupported(&'static str),
}

impl Field {
    /// The OpenAI HTTP parameter name.
    pub fn http_name(self) -> &'static str {
        match self {
            Field::Model => "model",
            Field::Prompt | Field::TokenIds => "prompt",
            Field::Messages => "messages",
            Field::MaxTokens => "max_tokens",
            Field::Temperature => "temperature",
            Field::TopP => "top_p",
            Field::TopK => "top_k",
            Field::Stop => "stop",
            Field::N => "n",
            Field::PresencePenalty => "presence_penalty",
            Field::FrequencyPenalty => "frequency_penalty",
            Field::RepetitionPenalty => "repetition_penalty",
            Field::Logprobs => "logprobs",
            Field::TopLogprobs => "top_logprobs",
            Field::Priority => "priority",
            Field::ResponseFormat => "response_format",
            Field::Unsupported(name) => name,
        }
    }

    /// The field path in `tandem.v1.GenerateRequest`.
    pub fn grpc_name(self) -> &'static str {
        match self {
            Field::Model => "model",
            Field::Prompt => "prompt",
            Field::TokenIds => "token_ids.ids",
            Field::Messages => "chat.messages",
            Field::MaxTokens => "sampling.max_tokens",
            Field::Temperature => "sampling.temperature",
            Field::TopP => "sampling.top_p",
            Field::TopK => "sampling.top_k",
            Field::Stop => "sampling.stop",
            Field::N => "n",
            Field::PresencePenalty => "sampling.presence_penalty",
            Field::FrequencyPenalty => "sampling.frequency_penalty",
            Field::RepetitionPenalty => "sampling.repetition_penalty",
            Field::Logprobs => "sampling.logprobs",
            Field::TopLogprobs => "sampling.top_logprobs",
            Field::Priority => "priority",
            Field::ResponseFormat => "sampling.response_format",
            Field::Unsupported(name) => name,
        }
    }
}

/// Which scheduling class a request belongs to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Priority {
    /// Latency-sensitive: admitted and scheduled before batch requests.
    #[default]
    Interactive,
    /// Throughput work: waits behind interactive requests.
    Batch,
}

impl Priority {
    /// The proto enum value.
    pub fn to_proto(self) -> pb::Priority {
        match self {
            Priority::Interactive => pb::Priority::Interactive,
            Priority::Batch => pb::Priority::Batch,
        }
    }

    /// A stable lowercase name.
    pub const fn as_str(self) -> &'static str {
        match self {
            Priority::Interactive => "interactive",
            Priority::Batch => "batch",
        }
    }
}

/// The prompt, in one of three forms.
#[derive(Clone, Debug, PartialEq)]
pub enum PromptInput {
    /// Plain text, tokenized as is (no chat template).
    Text(String),
    /// Chat messages, rendered with the model's chat template and a generation prompt.
    Chat(Vec<ChatMessage>),
    /// Token ids, used as they are.
    TokenIds(Vec<u32>),
}

impl PromptInput {
    /// The field this input arrived in.
    pub fn field(&self) -> Field {
        match self {
            PromptInput::Text(_) => Field::Prompt,
            PromptInput::Chat(_) => Field::Messages,
            PromptInput::TokenIds(_) => Field::TokenIds,
        }
    }
}

/// Sampling settings as the client gave them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Sampling {
    /// 0 = greedy.
    pub temperature: f32,
    /// Nucleus mass in (0, 1]; 0 = off.
    pub top_p: f32,
    /// Keep the k most likely tokens; 0 = off.
    pub top_k: u32,
    /// Seed for reproducible sampling.
    pub seed: Option<u64>,
    /// Stop strings.
    pub stop: Vec<String>,
    /// Output token limit; `None` = the router's default.
    pub max_tokens: Option<u32>,
    /// Keep generating past end-of-sequence.
    pub ignore_eos: bool,
    /// Lowers generated tokens' logits once (-2..=2; 0 = off).
    pub presence_penalty: f32,
    /// Lowers generated tokens' logits per occurrence (-2..=2; 0 = off).
    pub frequency_penalty: f32,
    /// Scales logits of prompt and output tokens (> 0); `None` = off.
    pub repetition_penalty: Option<f32>,
    /// Return each generated token's log probability.
    pub logprobs: bool,
    /// With `logprobs`, the most likely alternatives per position (≤ 20).
    pub top_logprobs: u32,
    /// Structured output: the output is JSON of this shape.
    pub response_format: Option<ResponseFormat>,
}

/// Largest `top_logprobs` accepted (OpenAI's).
pub const MAX_TOP_LOGPROBS: u32 = 20;

/// A request as an ingress hands it to [`Router::generate`](crate::Router::generate).
#[derive(Clone, Debug, PartialEq)]
pub struct GenerateRequest {
    /// Model name; empty = the served model.
    pub model: String,
    /// The prompt.
    pub input: PromptInput,
    /// Sampling settings.
    pub sampling: Sampling,
    /// Scheduling class.
    pub priority: Priority,
    /// The caller's request id, if any.
    pub request_id: Option<String>,
}

/// Output limits the router enforces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenLimits {
    /// Largest `max_tokens` accepted.
    pub max_tokens_limit: u32,
    /// `max_tokens` when the request gives none.
    pub default_max_tokens: u32,
}

/// A validated, tokenized request: what the pipeline sends to the nodes.
#[derive(Clone, Debug, PartialEq)]
pub struct PreparedRequest {
    /// The request id (the caller's or a generated one).
    pub request_id: String,
    /// Prompt token ids (non-empty).
    pub prompt_ids: Vec<u32>,
    /// Sampling with `max_tokens` resolved (never 0).
    pub sampling: pb::SamplingParams,
    /// Scheduling class.
    pub priority: Priority,
}

impl PreparedRequest {
    /// Prompt length in tokens.
    pub fn prompt_tokens(&self) -> u32 {
        self.prompt_ids.len() as u32
    }

    /// The resolved output limit.
    pub fn max_new_tokens(&self) -> u32 {
        self.sampling.max_tokens
    }
}

/// Validates and tokenizes `request` for `model` under `limits`. `request_id` is used when
/// the request carries none.
pub fn prepare(
    model: &ServedModel,
    limits: TokenLimits,
    request: GenerateRequest,
    request_id: impl FnOnce() -> String,
) -> Result<PreparedRequest, RouterError> {
    if !request.model.is_empty() && request.model != model.name {
        return Err(RouterError::ModelNotFound {
            requested: request.model,
            served: model.name.clone(),
        });
    }
    let field = request.input.field();
    let prompt_ids = tokenize(model, request.input)?;
    let sampling = validate_sampling(model, &request.sampling)?;
    let prompt_tokens = prompt_ids.len() as u32;
    let context = model.context_tokens;
    let max_tokens = match request.sampling.max_tokens.filter(|&m| m > 0) {
        Some(m) if m > limits.max_tokens_limit => {
            return Err(RouterError::invalid(
                Field::MaxTokens,
                format!(
                    "is {m}, above this router's limit of {}",
                    limits.max_tokens_limit
                ),
            ));
        }
        Some(m) if prompt_tokens as u64 + m as u64 > context as u64 => {
            return Err(RouterError::invalid(
                field,
                format!(
                    "the prompt ({prompt_tokens} tokens) plus max_tokens ({m}) is {} tokens, \
                     over the model's context length of {context}",
                    prompt_tokens as u64 + m as u64
                ),
            ));
        }
        Some(m) => m,
        None if prompt_tokens >= context => {
            return Err(RouterError::invalid(
                field,
                format!(
                    "the prompt is {prompt_tokens} tokens, which leaves no room for output in \
                     the model's context length of {context}"
                ),
            ));
        }
        None => limits.default_max_tokens.min(context - prompt_tokens),
    };
    let request_id = match request.request_id.filter(|id| !id.is_empty()) {
        Some(id) => id,
        None => request_id(),
    };
    Ok(PreparedRequest {
        request_id,
        prompt_ids,
        sampling: pb::SamplingParams {
            max_tokens,
            ..sampling
        },
        priority: request.priority,
    })
}

fn tokenize(model: &ServedModel, input: PromptInput) -> Result<Vec<u32>, RouterError> {
    let field = input.field();
    let tokenizer = &model.tokenizer;
    let ids = match input {
        PromptInput::Text(text) => {
            if text.is_empty() {
                return Err(RouterError::invalid(field, "must not be empty"));
            }
            tokenizer.encode(&text)
        }
        PromptInput::Chat(messages) => {
            if messages.is_empty() {
                return Err(RouterError::invalid(
                    field,
                    "must contain at least one message",
                ));
            }
            if let Some((i, m)) = messages
                .iter()
                .enumerate()
                .find(|(_, m)| !matches!(m.role.as_str(), "system" | "user" | "assistant"))
            {
                return Err(RouterError::invalid(
                    field,
                    format!(
                        "message {i} has role `{}`; expected system, user or assistant",
                        m.role
                    ),
                ));
            }
            let text = tokenizer
                .apply_chat_template(&messages, true)
                .map_err(|e| RouterError::invalid(field, e.to_string()))?;
            tokenizer.encode(&text)
        }
        PromptInput::TokenIds(ids) => {
            let vocab = tokenizer.vocab_size();
            if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
                return Err(RouterError::invalid(
                    field,
                    format!("token id {bad} is outside the vocabulary (size {vocab})"),
                ));
            }
            ids
        }
    };
    if ids.is_empty() {
        return Err(RouterError::invalid(
            field,
            "must not be empty (it encodes to no tokens)",
        ));
    }
    Ok(ids)
}

fn validate_sampling(model: &ServedModel, s: &Sampling) -> Result<pb::SamplingParams, RouterError> {
    if !s.temperature.is_finite() || !(0.0..=2.0).contains(&s.temperature) {
        return Err(RouterError::invalid(
            Field::Temperature,
            format!("is {}, expected a number in [0, 2]", s.temperature),
        ));
    }
    if !s.top_p.is_finite() || !(0.0..=1.0).contains(&s.top_p) {
        return Err(RouterError::invalid(
            Field::TopP,
            format!("is {}, expected a number in (0, 1]", s.top_p),
        ));
    }
    if s.stop.len() > 4 {
        return Err(RouterError::invalid(
            Field::Stop,
            format!("has {} entries, at most 4 are allowed", s.stop.len()),
        ));
    }
    if s.stop.iter().any(String::is_empty) {
        return Err(RouterError::invalid(
            Field::Stop,
            "contains an empty string",
        ));
    }
    for (field, v) in [
        (Field::PresencePenalty, s.presence_penalty),
        (Field::FrequencyPenalty, s.frequency_penalty),
    ] {
        if !(-2.0..=2.0).contains(&v) {
            return Err(RouterError::invalid(
                field,
                format!("is {v}, expected a number in [-2, 2]"),
            ));
        }
    }
    if let Some(r) = s.repetition_penalty
        && !(r > 0.0 && r <= 2.0)
    {
        return Err(RouterError::invalid(
            Field::RepetitionPenalty,
            format!("is {r}, expected a number in (0, 2] (1 = off)"),
        ));
    }
    if s.top_logprobs > MAX_TOP_LOGPROBS {
        return Err(RouterError::invalid(
            Field::TopLogprobs,
            format!(
                "is {}, at most {MAX_TOP_LOGPROBS} is allowed",
                s.top_logprobs
            ),
        ));
    }
    if s.top_logprobs > 0 && !s.logprobs {
        return Err(RouterError::invalid(
            Field::TopLogprobs,
            "needs logprobs set to true",
        ));
    }
    if let Some(format) = &s.response_format {
        if s.ignore_eos {
            return Err(RouterError::invalid(
                Field::ResponseFormat,
                "cannot be combined with ignore_eos (the output ends with its value)",
            ));
        }
        // Compiled here so a bad schema is refused before admission, naming its part; the
        // nodes compile it again for their own matchers.
        model
            .grammar()
            .and_then(|g| g.compile(format).map_err(|e| e.to_string()))
            .map_err(|reason| RouterError::invalid(Field::ResponseFormat, reason))?;
    }
    Ok(pb::SamplingParams {
        temperature: s.temperature,
        top_p: s.top_p,
        top_k: s.top_k,
        seed: s.seed,
        stop: s.stop.clone(),
        max_tokens: 0,
        ignore_eos: s.ignore_eos,
        presence_penalty: s.presence_penalty,
        frequency_penalty: s.frequency_penalty,
        repetition_penalty: s.repetition_penalty.unwrap_or(0.0),
        logprobs: s.logprobs,
        top_logprobs: s.top_logprobs,
        resumed_output_tokens: 0,
        response_format: s.response_format.as_ref().map(ResponseFormat::to_proto),
    })
}
