//! `n` choices of one request (OpenAI `n`, `GenerateRequest.n`): the prompt is validated and
//! tokenized once, then each choice runs as its own request through admission, routing and
//! the nodes (`{id}-{i}` as request id; a seeded request's choice `i` samples with
//! `seed + i`, an unseeded one from its own request id, so choices differ unless greedy).
//! Every choice after the first finds the prompt in a prefill node's prefix cache when routing
//! by cache sends it there.
//!
//! Limits: at most [`MAX_CHOICES`]; and `n × (prompt + max_tokens)` must fit in the decode
//! pool's KV (from its load reports), else a 400 naming `n` with the largest that fits. A
//! choice that cannot start (rate limit, no nodes) fails the whole request and cancels the
//! choices already started.

use futures_util::stream::{SelectAll, StreamExt};

use super::{GenerationEvent, GenerationStream, RequestContext, Router};
use crate::error::RouterError;
use crate::request::{Field, GenerateRequest, PromptInput, prepare};

/// The most choices one request may ask for.
pub const MAX_CHOICES: u32 = 16;

/// The started choices of one request, in order.
#[derive(Debug)]
pub struct Choices {
    /// The request's id (each choice's is `{id}-{i}` when n > 1).
    pub request_id: String,
    /// One stream per choice, choice `i` at index `i`.
    pub streams: Vec<GenerationStream>,
}

/// One choice's event, tagged with its index.
pub type ChoiceEvent = (u32, Result<GenerationEvent, RouterError>);

impl Choices {
    /// The first choice (its id, rate-limit status and trace context stand for the request).
    pub fn first(&self) -> &GenerationStream {
        &self.streams[0]
    }

    /// Every choice's events as they come, tagged with the choice index. Dropping it cancels
    /// every choice still running.
    pub fn merged(self) -> SelectAll<futures_util::stream::BoxStream<'static, ChoiceEvent>> {
        futures_util::stream::select_all(
            self.streams
                .into_iter()
                .enumerate()
                .map(|(i, s)| s.map(move |e| (i as u32, e)).boxed()),
        )
    }
}

impl Router {
    /// Starts `n` choices of `request` (n = 1: one ordinary request).
    pub async fn generate_choices(
        &self,
        request: GenerateRequest,
        context: RequestContext,
        n: u32,
    ) -> Result<Choices, RouterError> {
        if n == 0 || n > MAX_CHOICES {
            return Err(RouterError::invalid(
                Field::N,
                format!("is {n}, expected 1 to {MAX_CHOICES}"),
            ));
        }
        if n == 1 {
            let stream = self.generate_with(request, context).await?;
            return Ok(Choices {
                request_id: stream.request_id().to_string(),
                streams: vec![stream],
            });
        }
        let inner = &self.inner;
        let base_id = request.request_id.clone().filter(|id| !id.is_empty());
        let template = request.clone();
        let prepared = prepare(&inner.model, inner.options.tokens, request, || {
            self.new_request_id()
        })?;
        let per_choice = u64::from(prepared.prompt_tokens()) + u64::from(prepared.max_new_tokens());
        if let Some(capacity) = inner.decode.kv_capacity_tokens()
            && u64::from(n) * per_choice > capacity
        {
            return Err(RouterError::invalid(
                Field::N,
                format!(
                    "is {n}: each choice needs {per_choice} KV tokens (prompt + max_tokens) and the \
                     decode pool holds {capacity}, so at most n = {} fits",
                    capacity / per_choice
                ),
            ));
        }
        let base_id = base_id.unwrap_or(prepared.request_id.clone());
        let mut streams = Vec::with_capacity(n as usize);
        for i in 0..n {
            let mut choice = template.clone();
            choice.input = PromptInput::TokenIds(prepared.prompt_ids.clone());
            choice.sampling.max_tokens = Some(prepared.max_new_tokens());
            choice.sampling.seed = template.sampling.seed.map(|s| s.wrapping_add(u64::from(i)));
            choice.request_id = Some(format!("{base_id}-{i}"));
            streams.push(self.generate_with(choice, context.clone()).await?);
        }
        Ok(Choices {
            request_id: base_id,
            streams,
        })
    }
}
