//! Starting a request: the `router.request` span (continuing the caller's trace), then
//! [`prepare`], the key's limits, node availability, admission, and the spawned request task,
//! returning once its first event is known (the steps of the diagram in the module above).
//!
//! Note: `prepare` runs on the caller's task: tokenization, and for structured output a schema
//! compile (and, on the first such request, building the grammar vocabulary, ~0.1 s).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use tandem_cluster::Role;
use tandem_telemetry::trace::propagation;
use tokio::sync::mpsc;
use tracing::Instrument;

use super::{EVENT_BUFFER, GenerationStream, RequestContext, Router, task};
use crate::error::RouterError;
use crate::keys::KeyIdentity;
use crate::request::{GenerateRequest, prepare};
use crate::stats::bump;

impl Router {
    /// [`generate`](Self::generate) with what the ingress knows beyond the body: the caller's
    /// trace context (the request's `router.request` span continues it).
    pub async fn generate_with(
        &self,
        request: GenerateRequest,
        context: RequestContext,
    ) -> Result<GenerationStream, RouterError> {
        let started = Instant::now();
        let span = tracing::info_span!(
            "router.request",
            otel.kind = "server",
            gen_ai.operation.name = "generate",
            gen_ai.request.model = %self.inner.model.name,
            gen_ai.request.max_tokens = tracing::field::Empty,
            gen_ai.request.temperature = tracing::field::Empty,
            gen_ai.request.top_p = tracing::field::Empty,
            gen_ai.usage.input_tokens = tracing::field::Empty,
            gen_ai.usage.output_tokens = tracing::field::Empty,
            tandem.usage.cached_input_tokens = tracing::field::Empty,
            tandem.request_id = tracing::field::Empty,
            tandem.priority = tracing::field::Empty,
            tandem.ttft_ms = tracing::field::Empty,
            tandem.attempts = tracing::field::Empty,
            tandem.key_id = %context.key.id,
            tandem.rate_limit = tracing::field::Empty,
            error.type = tracing::field::Empty,
        );
        propagation::adopt(&span, context.parent);
        let traceparent = propagation::traceparent(&span);
        let result = self
            .start_request(request, started, span.clone(), context.key)
            .instrument(span.clone())
            .await;
        match result {
            Ok(mut stream) => {
                stream.traceparent = traceparent;
                Ok(stream)
            }
            Err(error) => {
                // Client errors (4xx) leave a server span's status unset (OpenTelemetry
                // semantic conventions); their kind is still recorded.
                if error.is_client_error() {
                    span.record("error.type", error.kind());
                } else {
                    propagation::mark_error(&span, error.kind(), &error);
                }
                Err(error)
            }
        }
    }

    /// A fresh request id: `req-{router}-{counter}`.
    pub(crate) fn new_request_id(&self) -> String {
        let inner = &self.inner;
        format!(
            "req-{}-{}",
            inner.id_prefix,
            inner.next_request.fetch_add(1, Ordering::Relaxed)
        )
    }

    async fn start_request(
        &self,
        request: GenerateRequest,
        started: Instant,
        span: tracing::Span,
        key: KeyIdentity,
    ) -> Result<GenerationStream, RouterError> {
        let inner = &self.inner;
        let prepared = prepare(&inner.model, inner.options.tokens, request, || {
            self.new_request_id()
        })?;
        span.record("tandem.request_id", prepared.request_id.as_str());
        span.record("tandem.priority", prepared.priority.as_str());
        span.record("gen_ai.request.max_tokens", prepared.max_new_tokens());
        span.record(
            "gen_ai.request.temperature",
            f64::from(prepared.sampling.temperature),
        );
        span.record("gen_ai.request.top_p", f64::from(prepared.sampling.top_p));
        // Without prefill nodes, conditional disaggregation still serves the prompts a decode
        // node may compute itself (routing::placement, `prefill_unavailable`).
        let placement = &inner.options.placement;
        let decode_may_prefill = placement.mode == crate::routing::DisaggregationMode::Conditional
            && prepared.prompt_tokens() as u64 <= u64::from(placement.busy_max_local_tokens);
        for (pool, role) in [
            (&inner.prefill, Role::Prefill),
            (&inner.decode, Role::Decode),
        ] {
            if pool.available() == 0 && !(role == Role::Prefill && decode_may_prefill) {
                return Err(RouterError::NoNodes { role });
            }
        }
        let key_permit = inner
            .limiter
            .admit(&key.id, key.limits, prepared.prompt_tokens())
            .await
            .inspect_err(|e| {
                if let RouterError::RateLimited { limit, .. } = e {
                    inner.metrics.rate_limited(&key.id, *limit);
                }
            })?;
        if key_permit.fallback {
            span.record("tandem.rate_limit", "local");
        }
        let rate_limit = key_permit.status();
        let admit = tracing::info_span!(
            "router.admit",
            tandem.priority = prepared.priority.as_str(),
            tandem.queued = inner.admission.queued(),
        );
        let wait_from = Instant::now();
        let permit = inner
            .admission
            .acquire(prepared.priority)
            .instrument(admit)
            .await
            .inspect_err(|_| bump(&inner.stats.overloaded))?;
        inner
            .metrics
            .admitted(prepared.priority, wait_from.elapsed());
        bump(&inner.stats.admitted);
        let (events_tx, mut events) = mpsc::channel(EVENT_BUFFER);
        let request_id = prepared.request_id.clone();
        let prompt_tokens = prepared.prompt_tokens();
        tokio::spawn(
            task::run_request(
                Arc::clone(inner),
                prepared,
                (permit, key_permit),
                events_tx,
                started,
                span.clone(),
                key.id,
            )
            .instrument(span),
        );
        match events.recv().await {
            Some(Ok(first)) => Ok(GenerationStream {
                request_id,
                prompt_tokens,
                rate_limit,
                traceparent: None,
                first: Some(Ok(first)),
                events,
            }),
            Some(Err(error)) => Err(error),
            None => Err(RouterError::PipelineLost),
        }
    }
}
