//! The `tandem.v1.Prefill` service: validates a call (fail closed on the layout fingerprint),
//! hands it to the engine thread and returns the stream the driver fills.
//!
//! Checks, in order, each answered before anything is computed:
//! 1. the node admits work (UNAVAILABLE while draining);
//! 2. `target` is present and its `layout_fingerprint` equals this node's (FAILED_PRECONDITION:
//!    KV in another layout would be garbage to the decode node);
//! 3. the prompt is non-empty and `target.block_ids` has one block per `block_size` prompt tokens
//!    (INVALID_ARGUMENT naming the field);
//! 4. `target.kv_address` is `ucx://` or `tcp://` and this node can push over it
//!    (FAILED_PRECONDITION otherwise).
//!
//! The engine validates the rest (token ids, sampling, context length).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use tandem_kv_transfer::TransportKind;
use tandem_node::engine_thread::EngineHandle;
use tandem_node::metrics::Outcome;
use tandem_node::{KvAddress, Lifecycle, NodeMetrics, convert, status};
use tandem_proto::v1::prefill_server::Prefill;
use tandem_proto::v1::{PrefillRequest, PrefillResponse};
use tandem_telemetry::trace::propagation::{self, RemoteParent};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Code, Request, Response, Status};

use crate::driver::{Command, Job, PushTarget};

/// Messages buffered per stream (a FirstToken and a KvPushed; room to spare).
const STREAM_BUFFER: usize = 4;

/// The Prefill service of one node.
pub struct PrefillService {
    engine: EngineHandle<Command>,
    lifecycle: Lifecycle,
    fingerprint: u64,
    block_size: usize,
    kinds: Vec<TransportKind>,
    next_id: AtomicU64,
    metrics: NodeMetrics,
    node_id: String,
}

impl PrefillService {
    /// A service over `engine`, for KV of `fingerprint` in blocks of `block_size` tokens, able to
    /// push over `kinds`.
    pub fn new(
        engine: EngineHandle<Command>,
        lifecycle: Lifecycle,
        fingerprint: u64,
        block_size: usize,
        kinds: Vec<TransportKind>,
        metrics: NodeMetrics,
        node_id: String,
    ) -> Self {
        PrefillService {
            engine,
            lifecycle,
            fingerprint,
            block_size,
            kinds,
            next_id: AtomicU64::new(1),
            metrics,
            node_id,
        }
    }
}

#[tonic::async_trait]
impl Prefill for PrefillService {
    type PrefillStream = ReceiverStream<Result<PrefillResponse, Status>>;

    async fn prefill(
        &self,
        request: Request<PrefillRequest>,
    ) -> Result<Response<Self::PrefillStream>, Status> {
        let received_at = Instant::now();
        let span = tracing::info_span!(
            "prefill.request",
            otel.kind = "server",
            tandem.node_id = %self.node_id,
            tandem.request_id = tracing::field::Empty,
            gen_ai.usage.input_tokens = tracing::field::Empty,
            tandem.cached_prompt_tokens = tracing::field::Empty,
            error.type = tracing::field::Empty,
        );
        propagation::adopt(&span, RemoteParent::from_grpc(request.metadata()));
        let r = request.into_inner();
        span.record("tandem.request_id", r.request_id.as_str());
        span.record("gen_ai.usage.input_tokens", r.prompt_token_ids.len());
        let result = self.accept(r, span.clone(), received_at).await;
        if let Err(status) = &result {
            self.metrics.request(Outcome::Refused);
            span.record("error.type", "refused");
            tracing::debug!(parent: &span, code = ?status.code(), message = status.message(), "prefill refused");
        }
        result
    }
}

impl PrefillService {
    /// The checks of the module docs, then the job to the engine thread.
    async fn accept(
        &self,
        r: PrefillRequest,
        span: tracing::Span,
        received_at: Instant,
    ) -> Result<Response<ReceiverStream<Result<PrefillResponse, Status>>>, Status> {
        let in_flight = self.lifecycle.admit()?;
        let target = r
            .target
            .ok_or_else(|| status::invalid("target", "is required"))?;
        if target.layout_fingerprint != self.fingerprint {
            return Err(status::status(
                Code::FailedPrecondition,
                format!(
                    "target layout fingerprint {:016x} differs from this prefill node's {:016x} (another model, KV dtype or block size)",
                    target.layout_fingerprint, self.fingerprint
                ),
                "layout_mismatch",
                false,
            ));
        }
        if r.prompt_token_ids.is_empty() {
            return Err(status::invalid("prompt_token_ids", "is empty"));
        }
        let prompt_blocks = r.prompt_token_ids.len().div_ceil(self.block_size);
        if target.block_ids.len() != prompt_blocks {
            return Err(status::invalid(
                "target.block_ids",
                format!(
                    "has {} blocks; a {}-token prompt needs {prompt_blocks}",
                    target.block_ids.len(),
                    r.prompt_token_ids.len()
                ),
            ));
        }
        let address: KvAddress = target
            .kv_address
            .parse()
            .map_err(|e| status::invalid("target.kv_address", e))?;
        if !self.kinds.contains(&address.kind) {
            return Err(status::status(
                Code::FailedPrecondition,
                format!(
                    "this prefill node cannot push KV over {} (it has {:?})",
                    address.kind.as_str(),
                    self.kinds
                ),
                "transport_mismatch",
                false,
            ));
        }
        let mut params = convert::sampling_params(r.sampling.as_ref(), &r.request_id, 1)
            .map_err(|e| status::invalid("sampling.response_format", e))?;
        // The decode node owns text, and so stop strings; this node samples one token.
        params.stop.clear();
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (events, rx) = mpsc::channel(STREAM_BUFFER);
        let job = Job {
            request: tandem_engine::Request {
                id,
                prompt: r.prompt_token_ids,
                params,
                priority: convert::priority(r.priority),
            },
            label: r.request_id,
            target: PushTarget {
                address,
                reservation_id: target.reservation_id,
                epoch: target.epoch,
                dst_blocks: target.block_ids,
            },
            events,
            in_flight,
            span,
            received_at,
        };
        self.engine
            .send(Command::Prefill(Box::new(job)))
            .await
            .map_err(|_| status::unavailable("the prefill engine has stopped"))?;
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}
