//! A request's task (spawned by [`Router::generate`](super::Router::generate)): attempts until
//! the request succeeds, fails for good, or its client leaves.
//!
//! Invariants: the task owns the admission permit until it ends; the client gets exactly one
//! `Final` or one error (unless it left first); a failure after output reached the client is a
//! migration (retry-safe, attempts left) or `Interrupted`, never a silent restart.

use std::sync::Arc;
use std::time::Instant;

use tandem_telemetry::trace::propagation;
use tokio::sync::mpsc;
use tracing::Instrument;

use super::attempt::AttemptState;
use super::{FinishReason, GenerationEvent, GenerationFinal, Inner, Usage};
use crate::admission::Permit;
use crate::ratelimit::KeyPermit;
use crate::error::{NodeFault, RouterError};
use crate::request::PreparedRequest;
use crate::stats::bump;

/// A request's task: attempts until success, a final error, or the client leaving.
pub(super) async fn run_request(
    inner: Arc<Inner>,
    request: PreparedRequest,
    (permit, key_permit): (Permit, KeyPermit),
    events: mpsc::Sender<Result<GenerationEvent, RouterError>>,
    started: Instant,
    span: tracing::Span,
    key_id: Arc<str>,
) {
    let mut state = AttemptState::new(&inner, &request, &events, started, span.clone());
    state.key_id = Some(key_id);
    let outcome = tokio::select! {
        biased;
        _ = events.closed() => Err(RouterError::Cancelled),
        outcome = drive(&inner, &request, &mut state, span.clone()) => outcome,
    };
    // What the key's tokens-per-minute limit counts beyond the prompt: the output sent.
    key_permit.spend_output(state.tokens_sent());
    drop(state);
    match outcome {
        Ok(()) => bump(&inner.stats.completed),
        Err(RouterError::Cancelled) => {
            bump(&inner.stats.cancelled);
            span.record("error.type", "cancelled");
            tracing::info!(request_id = %request.request_id, "client went away; request cancelled");
        }
        Err(error) => {
            bump(&inner.stats.failed);
            inner.metrics.failed(error.kind());
            propagation::mark_error(&span, error.kind(), &error);
            tracing::warn!(request_id = %request.request_id, kind = error.kind(), %error, "request failed");
            // The client may be gone by now; nothing else to tell.
            let _ = events.send(Err(error)).await;
        }
    }
    drop(permit);
    drop(key_permit);
}

/// Attempts `request` until it succeeds or fails for good. Each attempt is a `router.attempt`
/// span; a retry or migration is visible as a second one with its reason.
async fn drive(
    inner: &Inner,
    request: &PreparedRequest,
    state: &mut AttemptState<'_>,
    request_span: tracing::Span,
) -> Result<(), RouterError> {
    let max_attempts = inner.options.max_attempts.max(1);
    let mut attempts = 0;
    let mut reason: &'static str = "first";
    loop {
        attempts += 1;
        request_span.record("tandem.attempts", attempts);
        let attempt_span = tracing::info_span!(
            "router.attempt",
            tandem.attempt = attempts,
            tandem.reason = reason,
            tandem.resumed_tokens = state.tokens_sent(),
        );
        let error = match state.run().instrument(attempt_span.clone()).await {
            Ok(()) => return Ok(()),
            Err(error) => error,
        };
        if matches!(error, RouterError::Cancelled) {
            return Err(error);
        }
        propagation::mark_error(&attempt_span, error.kind(), &error);
        drop(attempt_span);
        let sent = state.tokens_sent();
        if sent > 0 && error.is_retry_safe() && state.tokens_left() == 0 {
            // Every token arrived; only the final message was lost.
            tracing::warn!(request_id = %request.request_id, %error, "final message lost after the last token; finishing the stream here");
            return finish_without_node(state).await;
        }
        if !error.is_retry_safe() || attempts >= max_attempts {
            return Err(match (sent, error.is_retry_safe()) {
                (0, true) => RouterError::RetriesExhausted {
                    attempts,
                    last: Box::new(error),
                },
                (0, false) => error,
                (tokens_sent, _) => RouterError::Interrupted {
                    tokens_sent,
                    cause: Box::new(error),
                },
            });
        }
        bump(&inner.stats.retries);
        if sent > 0 {
            bump(&inner.stats.migrations);
            reason = "migration";
            tracing::warn!(request_id = %request.request_id, %error, tokens_sent = sent, "stream lost mid-generation; migrating: re-prefilling prompt + output so far on another pair");
        } else if matches!(
            error,
            RouterError::Node {
                fault: NodeFault::KvCorrupt,
                ..
            }
        ) {
            bump(&inner.stats.reprefills);
            reason = "reprefill";
            tracing::warn!(request_id = %request.request_id, %error, "KV transfer failed verification; re-prefilling on a fresh reservation");
        } else {
            reason = "retry";
            tracing::warn!(request_id = %request.request_id, %error, attempt = attempts, "attempt failed before any output; retrying on another pair");
        }
    }
}

/// Ends a stream whose tokens all arrived but whose final message was lost.
async fn finish_without_node(state: &mut AttemptState<'_>) -> Result<(), RouterError> {
    let done = GenerationFinal {
        finish_reason: FinishReason::Length,
        usage: Usage {
            prompt_tokens: state.request.prompt_tokens(),
            cached_prompt_tokens: state.cached_prompt_tokens.unwrap_or(0),
            completion_tokens: state.tokens_sent(),
        },
        request_id: state.request.request_id.clone(),
    };
    state.send(GenerationEvent::Final(done)).await
}
