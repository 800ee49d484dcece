//! The `tandem.v1.Decode` service: `Reserve`, `Release`, `Decode`.
//!
//! `Decode` claims the reservation, then a task waits for its KV (the inbound transfer resolves
//! once every layer of every block verified, or with the error that ended it, bounded by the
//! reservation's TTL):
//! - verified: the engine adopts the blocks with the first token and streams tokens;
//! - failed (checksum, partial, expired, sender gone): DATA_LOSS when a re-prefill may succeed
//!   (`tandem-retry-safe: true`), nothing is decoded, the blocks go back.
//!
//! With `prefill_here` (conditional disaggregation) no KV is awaited: the transfer is fenced and
//! the engine computes the prompt itself in the reservation's room (`Engine::add_local`).
//!
//! A client that leaves while the KV is still in flight is noticed once the transfer resolves:
//! the router cancels the Prefill call too, whose push then aborts, so that is prompt; at worst
//! the reservation's TTL bounds it. (kv-transfer's `InboundTransfer` can only be cancelled by
//! value, so a wait in progress cannot be fenced early from here.)

use std::time::Instant;
use tandem_node::engine_thread::EngineHandle;

use tandem_node::metrics::Outcome;
use tandem_node::{KvAddress, Lifecycle, NodeMetrics, convert, status};
use tandem_proto::v1::decode_server::Decode;
use tandem_proto::v1::{
    DecodeRequest, DecodeResponse, KvTarget, ReleaseRequest, ReleaseResponse, ReserveRequest,
    ReserveResponse,
};
use tandem_telemetry::trace::propagation::{self, RemoteParent};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use crate::driver::{Command, Start};
use crate::reservations::{Claimed, Pending, Reservations};

/// Messages buffered per stream before output is coalesced (see the driver).
const STREAM_BUFFER: usize = 64;

/// The Decode service of one node.
pub struct DecodeService {
    engine: EngineHandle<Command>,
    reservations: Reservations,
    lifecycle: Lifecycle,
    node_id: String,
    kv_address: KvAddress,
    fingerprint: u64,
    metrics: NodeMetrics,
}

impl DecodeService {
    /// A service for node `node_id`, receiving KV at `kv_address` in layout `fingerprint`.
    pub fn new(
        engine: EngineHandle<Command>,
        reservations: Reservations,
        lifecycle: Lifecycle,
        node_id: String,
        kv_address: KvAddress,
        fingerprint: u64,
        metrics: NodeMetrics,
    ) -> Self {
        DecodeService {
            engine,
            reservations,
            lifecycle,
            node_id,
            kv_address,
            fingerprint,
            metrics,
        }
    }
}

#[tonic::async_trait]
impl Decode for DecodeService {
    async fn reserve(
        &self,
        request: Request<ReserveRequest>,
    ) -> Result<Response<ReserveResponse>, Status> {
        let span = tracing::info_span!(
            "decode.reserve",
            otel.kind = "server",
            tandem.node_id = %self.node_id,
            tandem.kv.tokens = tracing::field::Empty,
            tandem.reservation_id = tracing::field::Empty,
            error.type = tracing::field::Empty,
        );
        propagation::adopt(&span, RemoteParent::from_grpc(request.metadata()));
        let r = request.into_inner();
        span.record(
            "tandem.kv.tokens",
            u64::from(r.prompt_tokens) + u64::from(r.max_new_tokens),
        );
        let result = self.reserve_inner(r).instrument(span.clone()).await;
        match &result {
            Ok(reply) => {
                if let Some(t) = &reply.get_ref().target {
                    span.record("tandem.reservation_id", t.reservation_id);
                }
            }
            Err(status) => {
                self.metrics.request(Outcome::Refused);
                span.record("error.type", "refused");
                tracing::debug!(parent: &span, code = ?status.code(), message = status.message(), "reserve refused");
            }
        }
        result
    }

    async fn release(
        &self,
        request: Request<ReleaseRequest>,
    ) -> Result<Response<ReleaseResponse>, Status> {
        let r = request.into_inner();
        let released = self.reservations.release(r.reservation_id, r.epoch).await;
        Ok(Response::new(ReleaseResponse { released }))
    }

    type DecodeStream = ReceiverStream<Result<DecodeResponse, Status>>;

    async fn decode(
        &self,
        request: Request<DecodeRequest>,
    ) -> Result<Response<Self::DecodeStream>, Status> {
        let received_at = Instant::now();
        let span = tracing::info_span!(
            "decode.request",
            otel.kind = "server",
            tandem.node_id = %self.node_id,
            tandem.request_id = tracing::field::Empty,
            tandem.reservation_id = tracing::field::Empty,
            gen_ai.usage.input_tokens = tracing::field::Empty,
            error.type = tracing::field::Empty,
        );
        propagation::adopt(&span, RemoteParent::from_grpc(request.metadata()));
        let r = request.into_inner();
        span.record("tandem.request_id", r.request_id.as_str());
        span.record("tandem.reservation_id", r.reservation_id);
        span.record("gen_ai.usage.input_tokens", r.prompt_token_ids.len());
        let result = self.decode_inner(r, span.clone(), received_at);
        if let Err(status) = &result {
            self.metrics.request(Outcome::Refused);
            span.record("error.type", "refused");
            tracing::debug!(parent: &span, code = ?status.code(), message = status.message(), "decode refused");
        }
        result
    }
}

impl DecodeService {
    async fn reserve_inner(&self, r: ReserveRequest) -> Result<Response<ReserveResponse>, Status> {
        let in_flight = self.lifecycle.admit()?;
        if r.prompt_tokens == 0 {
            return Err(status::invalid("prompt_tokens", "must be at least 1"));
        }
        if r.max_new_tokens == 0 {
            return Err(status::invalid("max_new_tokens", "must be at least 1"));
        }
        let reserved = self
            .reservations
            .reserve(
                r.request_id,
                r.prompt_tokens as usize,
                r.max_new_tokens as usize,
                in_flight,
            )
            .await?;
        Ok(Response::new(ReserveResponse {
            target: Some(KvTarget {
                decode_node_id: self.node_id.clone(),
                kv_address: self.kv_address.to_string(),
                reservation_id: reserved.reservation_id,
                epoch: reserved.epoch,
                block_ids: reserved.prompt_blocks,
                layout_fingerprint: self.fingerprint,
            }),
            expires_at_unix_ms: reserved.expires_at_unix_ms,
        }))
    }

    fn decode_inner(
        &self,
        r: DecodeRequest,
        span: tracing::Span,
        received_at: Instant,
    ) -> Result<Response<ReceiverStream<Result<DecodeResponse, Status>>>, Status> {
        let (pending, claimed) = self.reservations.claim(r.reservation_id, r.epoch)?;
        let parsed =
            convert::sampling_params(r.sampling.as_ref(), &r.request_id, pending.max_new_tokens);
        let invalid = match &parsed {
            Err(e) => Some(status::invalid("sampling.response_format", e)),
            Ok(_) if r.prompt_token_ids.len() != pending.prompt_tokens => Some(status::invalid(
                "prompt_token_ids",
                format!(
                    "has {} tokens; reservation {} was made for {}",
                    r.prompt_token_ids.len(),
                    r.reservation_id,
                    pending.prompt_tokens
                ),
            )),
            Ok(p) if p.max_new_tokens > pending.max_new_tokens => Some(status::invalid(
                "sampling.max_tokens",
                format!(
                    "{} exceeds the {} output tokens reserved",
                    p.max_new_tokens, pending.max_new_tokens
                ),
            )),
            Ok(_) => None,
        };
        if let Some(s) = invalid {
            // The claim consumed the reservation: fence its transfer, then free the blocks.
            tokio::spawn(async move {
                let _ = pending.inbound.cancel().await;
                drop(claimed);
            });
            return Err(s);
        }
        let params = parsed.expect("an Err is invalid, answered above");
        let request = tandem_engine::Request {
            id: r.reservation_id,
            prompt: r.prompt_token_ids,
            params,
            priority: convert::priority(r.priority),
        };
        let (events, rx) = mpsc::channel(STREAM_BUFFER);
        let start = Start {
            request,
            reservation_id: r.reservation_id,
            first_token: r.first_token_id,
            first_logprob: r.first_token_logprob.as_ref().map(convert::logprob_from),
            cached_prompt_tokens: r.cached_prompt_tokens as usize,
            kv_on_device: false,
            prefill_here: r.prefill_here,
            label: r.request_id,
            events,
            in_flight: self.lifecycle.track(),
            span,
            received_at,
        };
        if start.prefill_here {
            self.metrics.prefill_here();
            tokio::spawn(fence_then_prefill_here(
                self.engine.clone(),
                pending,
                claimed,
                start,
            ));
        } else {
            tokio::spawn(await_kv_then_decode(
                self.engine.clone(),
                pending,
                claimed,
                start,
                self.metrics.clone(),
            ));
        }
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// Conditional disaggregation: no KV is coming. Fences the reservation's inbound transfer (a
/// stray push can no longer land in its blocks), then hands the request to the engine, which
/// computes the prompt itself in the reserved room.
async fn fence_then_prefill_here(
    engine: EngineHandle<Command>,
    pending: Pending,
    claimed: Claimed,
    start: Start,
) {
    let Pending {
        inbound,
        in_flight: reservation_unit,
        ..
    } = pending;
    let fenced = inbound.cancel().await;
    drop(reservation_unit);
    if let Ok(report) = fenced {
        // Someone pushed into a reservation the router meant for a local prefill: harmless
        // (the engine recomputes the prompt), but a router bug worth seeing.
        tracing::warn!(request = %start.label, bytes = report.bytes, "KV arrived for a request prefilled here; ignored");
    }
    // Engine thread gone: its blocks went with it.
    let _ = engine.send(Command::Start(Box::new(start))).await;
    claimed.hand_over();
}

/// Waits for the reservation's KV; on success hands the request to the engine, otherwise
/// reports why and gives the blocks back (`claimed` drops after the transfer resolved).
async fn await_kv_then_decode(
    engine: EngineHandle<Command>,
    pending: Pending,
    claimed: Claimed,
    mut start: Start,
    metrics: NodeMetrics,
) {
    let Pending {
        inbound,
        label,
        in_flight: reservation_unit,
        ..
    } = pending;
    // The receiving side of the transfer; linked to the sender's `kv.push` span (its context
    // travels in the transfer's descriptor) once the report names it.
    let receive_span = tracing::info_span!(
        parent: &start.span,
        "kv.receive",
        tandem.kv.bytes = tracing::field::Empty,
        tandem.kv.blocks = tracing::field::Empty,
        tandem.kv.verified = tracing::field::Empty,
    );
    let result = inbound.wait().instrument(receive_span.clone()).await;
    drop(reservation_unit); // the stream's own unit (in `start`) covers the rest
    match &result {
        Ok(report) => {
            receive_span.record("tandem.kv.bytes", report.bytes);
            receive_span.record("tandem.kv.blocks", report.dst_blocks.len());
            receive_span.record("tandem.kv.verified", true);
            propagation::link(&receive_span, &report.trace_context);
        }
        Err(e) => {
            receive_span.record("tandem.kv.verified", false);
            propagation::mark_error(&receive_span, e.kind().as_str(), e);
        }
    }
    drop(receive_span);
    match result {
        Err(e) => {
            metrics.request(Outcome::Failed);
            propagation::mark_error(&start.span, e.kind().as_str(), &e);
            tracing::warn!(request = %label, error = %e, retry_safe = e.retry_safe(), "KV did not arrive intact; nothing decoded");
            let _ = start.events.send(Err(status::inbound_status(&e))).await;
            drop(claimed);
        }
        Ok(report) if start.events.is_closed() => {
            metrics.request(Outcome::Cancelled);
            tracing::debug!(request = %label, bytes = report.bytes, "client left while the KV arrived; blocks freed");
            drop(claimed);
        }
        Ok(report) => {
            tracing::debug!(request = %label, bytes = report.bytes, blocks = report.dst_blocks.len(), on_device = report.on_device, "KV verified");
            start.kv_on_device = report.on_device;
            match engine.send(Command::Start(Box::new(start))).await {
                Ok(()) => claimed.hand_over(),
                // The engine thread is gone, and its blocks with it.
                Err(_) => claimed.hand_over(),
            }
        }
    }
}
