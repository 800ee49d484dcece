//! What a generation yields: [`GenerationStream`], a stream of [`GenerationEvent`]s (deltas, then
//! one [`GenerationFinal`]) or an error.
//!
//! Invariant: a stream yields its first event (taken before the call returned) and then its
//! channel's, in order; dropping it drops the receiver, which the request task sees as the
//! client gone (it cancels the request on every node).

use std::pin::Pin;
use std::task::{Context, Poll};

use futures_util::Stream;
use tandem_proto::v1 as pb;
use tokio::sync::mpsc;

use crate::error::RouterError;

/// Why a generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// End of sequence or a stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
    /// Cancelled on the node.
    Cancelled,
}

impl FinishReason {
    /// From the proto enum (unspecified counts as `Stop`).
    pub fn from_proto(value: i32) -> Self {
        match pb::FinishReason::try_from(value) {
            Ok(pb::FinishReason::Length) => FinishReason::Length,
            Ok(pb::FinishReason::Cancelled) => FinishReason::Cancelled,
            _ => FinishReason::Stop,
        }
    }

    /// The proto enum.
    pub fn to_proto(self) -> pb::FinishReason {
        match self {
            FinishReason::Stop => pb::FinishReason::Stop,
            FinishReason::Length => pb::FinishReason::Length,
            FinishReason::Cancelled => pb::FinishReason::Cancelled,
        }
    }

    /// The OpenAI name (`stop`, `length`; a cancel reads as `stop`).
    pub fn openai(self) -> &'static str {
        match self {
            FinishReason::Length => "length",
            FinishReason::Stop | FinishReason::Cancelled => "stop",
        }
    }
}

/// Token accounting of a finished request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Prompt tokens served from a prefix cache.
    pub cached_prompt_tokens: u32,
    /// Generated tokens.
    pub completion_tokens: u32,
}

/// The last event of a successful stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GenerationFinal {
    /// Why it ended.
    pub finish_reason: FinishReason,
    /// Token accounting.
    pub usage: Usage,
    /// The request id.
    pub request_id: String,
}

/// One piece of a generation.
#[derive(Clone, Debug, PartialEq)]
pub enum GenerationEvent {
    /// New tokens and the text they completed (possibly empty mid-character).
    Delta {
        /// Text released by these tokens.
        text: String,
        /// The token ids, in order.
        token_ids: Vec<u32>,
        /// One per token id when the request asked for logprobs, else empty.
        logprobs: Vec<pb::TokenLogprob>,
    },
    /// The end.
    Final(GenerationFinal),
}

/// A generation in progress: a stream of events ending with `Final` or an error. Dropping it
/// cancels the request on every node.
#[derive(Debug)]
pub struct GenerationStream {
    pub(super) request_id: String,
    pub(super) prompt_tokens: u32,
    pub(super) rate_limit: Option<crate::ratelimit::RateLimitStatus>,
    pub(super) traceparent: Option<String>,
    pub(super) first: Option<Result<GenerationEvent, RouterError>>,
    pub(super) events: mpsc::Receiver<Result<GenerationEvent, RouterError>>,
}

impl GenerationStream {
    /// The request id.
    pub fn request_id(&self) -> &str {
        &self.request_id
    }

    /// Prompt length in tokens.
    pub fn prompt_tokens(&self) -> u32 {
        self.prompt_tokens
    }

    /// The caller's key's limits and what is left of them (none: the key has no limits).
    pub fn rate_limit(&self) -> Option<crate::ratelimit::RateLimitStatus> {
        self.rate_limit
    }

    /// The W3C `traceparent` of the request's `router.request` span (for the response), when
    /// traces are exported.
    pub fn traceparent(&self) -> Option<&str> {
        self.traceparent.as_deref()
    }
}

impl Stream for GenerationStream {
    type Item = Result<GenerationEvent, RouterError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if let Some(first) = self.first.take() {
            return Poll::Ready(Some(first));
        }
        self.events.poll_recv(cx)
    }
}
