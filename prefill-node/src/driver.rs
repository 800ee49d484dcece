//! The prefill node's engine driver: runs prefill-only requests (chunked prefill, first token),
//! pushes each prompt's KV layer by layer *while its last chunk computes*, and gives the blocks
//! back once the push has ended.
//!
//! ```text
//!  step_observed ─ layer 0 of a request's last chunk ─▶ transport.push(src blocks → target).streamed()
//!                ─ layer l done ──────────────────────▶ push.layers_ready(l + 1)
//!  output (first token, held blocks) ─▶ stream FirstToken ─▶ task: await push ─▶ KvPushed | error
//!                                                                   └─▶ HeldBlocks drop ─▶ ReleaseHeld
//! ```
//!
//! Invariants:
//! - A prompt's blocks are given back only after its push has *ended* (acknowledged, failed or
//!   cancelled and resolved), so no transport reads a block the engine has reused: the
//!   [`HeldBlocks`] guard sends the release when the push task drops it, whatever path it took.
//! - Earlier chunks of a prompt are final before its last chunk runs, and cached prefix blocks
//!   are final, so "layer l is ready" holds for every block of the push once the last chunk's
//!   layer l is written.
//! - A client that goes away before its first token has its request aborted (blocks freed);
//!   after it, its push is cancelled and awaited, then the blocks are freed.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_engine::{Engine, EngineError, LayerDone, Request};
use tandem_kv_transfer::{
    KvTransport, NetTransport, OutboundTransfer, PoolRegistration, PushRequest, TransferError,
    TransportKind,
};
use tandem_node::engine_thread::{Driver, EngineHandle, share_step_time};
use tandem_node::metrics::Outcome;
use tandem_node::{InFlightGuard, KvAddress, NodeMetrics, convert, status};
use tandem_proto::v1::{FirstToken, KvPushed, PrefillResponse, prefill_response::Event};
use tandem_telemetry::trace::propagation;
use tokio::runtime::Handle;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tonic::Status;

/// The events of one Prefill stream.
pub type Events = mpsc::Sender<Result<PrefillResponse, Status>>;

/// Where a request's KV goes.
#[derive(Clone, Debug)]
pub struct PushTarget {
    /// The decode node's KV receiver.
    pub address: KvAddress,
    /// Its reservation.
    pub reservation_id: u64,
    /// The reservation's epoch.
    pub epoch: u64,
    /// Destination blocks, one per prompt block.
    pub dst_blocks: Vec<u32>,
}

/// One admitted Prefill call.
pub struct Job {
    /// The engine request (prefill-only).
    pub request: Request,
    /// The caller's request id (logs).
    pub label: String,
    /// Where the KV goes.
    pub target: PushTarget,
    /// The client's stream.
    pub events: Events,
    /// Held until the stream's last message (the drain waits for it).
    pub in_flight: InFlightGuard,
    /// `prefill.request` (the call's server span): ends when the job is dropped.
    pub span: tracing::Span,
    /// When the call arrived (TTFT).
    pub received_at: Instant,
}

/// Commands of the prefill engine thread.
pub enum Command {
    /// Start a request.
    Prefill(Box<Job>),
    /// A push ended: give the request's held blocks back.
    ReleaseHeld {
        /// The engine request id.
        request_id: u64,
    },
}

/// The pools and transports pushes go out on.
pub struct Senders {
    /// The node's own transport and its pool (the engine's KV memory).
    pub primary: (TransportKind, Arc<NetTransport>, PoolRegistration),
    /// A TCP transport over the same pool, when the primary is UCX (for `tcp://` targets).
    pub tcp: Option<(Arc<NetTransport>, PoolRegistration)>,
}

impl Senders {
    /// The transport kinds this node can push with.
    pub fn kinds(&self) -> Vec<TransportKind> {
        let mut k = vec![self.primary.0];
        if self.tcp.is_some() {
            k.push(TransportKind::Tcp);
        }
        k
    }

    fn for_kind(&self, kind: TransportKind) -> Option<(&NetTransport, &PoolRegistration)> {
        if self.primary.0 == kind {
            return Some((&self.primary.1, &self.primary.2));
        }
        match (&self.tcp, kind) {
            (Some((t, r)), TransportKind::Tcp) => Some((t, r)),
            _ => None,
        }
    }
}

/// Settings of the driver.
pub struct PushSettings {
    /// Bound on one push.
    pub deadline: Duration,
    /// A fault applied to every push (tests and drills).
    #[cfg(feature = "fault-injection")]
    pub fault: Arc<std::sync::Mutex<Option<tandem_kv_transfer::Fault>>>,
}

struct Live {
    job: Job,
    prompt_blocks: usize,
    cancel: CancellationToken,
    push: Option<OutboundTransfer>,
    push_error: Option<TransferError>,
    started: Instant,
    /// `prefill.forward`: admission to first token (queue wait and every chunk).
    forward_span: tracing::Span,
    /// `kv.push`: the transfer, from its start to the receiver's confirmation.
    push_span: tracing::Span,
    /// This node's engine time spent on the prompt.
    node_seconds: f64,
}

/// The prefill role's [`Driver`].
pub struct PrefillDriver {
    runtime: Handle,
    engine: EngineHandle<Command>,
    senders: Senders,
    settings: PushSettings,
    block_size: usize,
    live: HashMap<u64, Live>,
    metrics: NodeMetrics,
}

impl PrefillDriver {
    /// A driver pushing through `senders`; `engine` is its own thread's handle.
    pub fn new(
        runtime: Handle,
        engine: EngineHandle<Command>,
        senders: Senders,
        settings: PushSettings,
        block_size: usize,
        metrics: NodeMetrics,
    ) -> Self {
        PrefillDriver {
            runtime,
            engine,
            senders,
            settings,
            block_size,
            live: HashMap::new(),
            metrics,
        }
    }

    fn fail_all(&mut self, engine: &mut Engine, status: impl Fn() -> Status) {
        for (id, l) in self.live.drain() {
            l.cancel.cancel();
            engine.abort(id);
            self.metrics.request(Outcome::Failed);
            let s = status();
            propagation::mark_error(&l.job.span, "node_failed", s.message());
            let _ = l.job.events.try_send(Err(status()));
        }
    }
}

/// Starts a push of `src` into `live`'s target.
fn start_push(
    senders: &Senders,
    settings: &PushSettings,
    runtime: &Handle,
    request_id: u64,
    live: &mut Live,
    src: Vec<u32>,
    streamed: bool,
) -> Result<OutboundTransfer, TransferError> {
    let t = &live.job.target;
    let span = tracing::info_span!(
        parent: &live.job.span,
        "kv.push",
        tandem.kv.transport = t.address.kind.as_str(),
        tandem.kv.blocks = src.len(),
        tandem.kv.streamed = streamed,
        tandem.kv.bytes = tracing::field::Empty,
        tandem.kv.mode = tracing::field::Empty,
        tandem.reservation_id = t.reservation_id,
        server.address = %t.address.host_port,
    );
    let trace_context = propagation::traceparent(&span).unwrap_or_default();
    live.push_span = span;
    let (transport, pool) =
        senders
            .for_kind(t.address.kind)
            .ok_or_else(|| TransferError::InvalidRequest {
                field: "kv_address",
                reason: format!("this node cannot push over {}", t.address.kind.as_str()),
            })?;
    let mut req = PushRequest::new(
        t.address.host_port.clone(),
        t.reservation_id,
        t.epoch,
        src,
        t.dst_blocks.clone(),
    )
    .deadline(settings.deadline)
    .request_id(request_id as u128)
    .trace_context(trace_context);
    if streamed {
        req = req.streamed();
    }
    #[cfg(feature = "fault-injection")]
    if let Some(f) = *settings.fault.lock().unwrap_or_else(|p| p.into_inner()) {
        req = req.fault(f);
    }
    let _rt = runtime.enter();
    transport.push(pool, req, live.cancel.clone())
}

/// Blocks a finished prefill holds; dropping it asks the engine thread to release them.
struct HeldBlocks {
    request_id: u64,
    engine: EngineHandle<Command>,
}

impl HeldBlocks {
    /// Releases the blocks at once, on the engine thread that owns `engine`.
    fn release_now(self, engine: &mut Engine) {
        engine.release_held(self.request_id);
        std::mem::forget(self);
    }
}

impl Drop for HeldBlocks {
    fn drop(&mut self) {
        self.engine.send_from_drop(Command::ReleaseHeld {
            request_id: self.request_id,
        });
    }
}

impl Driver for PrefillDriver {
    type Command = Command;

    fn on_command(&mut self, engine: &mut Engine, cmd: Command) {
        match cmd {
            Command::Prefill(job) => {
                let id = job.request.id;
                let prompt_blocks = job.request.prompt.len().div_ceil(self.block_size);
                if let Err(e) = engine.add_prefill_request(job.request.clone(), Instant::now()) {
                    let _ = job.events.try_send(Err(status::engine_status(&e)));
                    return;
                }
                tracing::debug!(request = %job.label, prompt_tokens = job.request.prompt.len(), "prefill admitted");
                let forward_span = tracing::info_span!(
                    parent: &job.span,
                    "prefill.forward",
                    gen_ai.usage.input_tokens = job.request.prompt.len(),
                    tandem.cached_prompt_tokens = tracing::field::Empty,
                );
                let live = Live {
                    job: *job,
                    prompt_blocks,
                    cancel: CancellationToken::new(),
                    push: None,
                    push_error: None,
                    started: Instant::now(),
                    forward_span,
                    push_span: tracing::Span::none(),
                    node_seconds: 0.0,
                };
                self.live.insert(id, live);
            }
            Command::ReleaseHeld { request_id } => {
                engine.release_held(request_id);
            }
        }
    }

    fn step(&mut self, engine: &mut Engine) -> Result<usize, EngineError> {
        let (senders, settings, runtime, live) =
            (&self.senders, &self.settings, &self.runtime, &mut self.live);
        let mut on_layer = |done: LayerDone<'_>| {
            for c in done.chunks.iter().filter(|c| c.last_chunk) {
                let Some(l) = live.get_mut(&c.request_id) else {
                    continue;
                };
                if l.push.is_none() && l.push_error.is_none() {
                    let result = match c.block_table.get(..l.prompt_blocks) {
                        Some(src) => start_push(
                            senders,
                            settings,
                            runtime,
                            c.request_id,
                            l,
                            src.to_vec(),
                            true,
                        ),
                        None => Err(TransferError::InvalidRequest {
                            field: "src_blocks",
                            reason: "fewer blocks than the prompt needs".into(),
                        }),
                    };
                    match result {
                        Ok(p) => l.push = Some(p),
                        Err(e) => l.push_error = Some(e),
                    }
                }
                if let Some(p) = &l.push {
                    p.layers_ready(done.layer as u32 + 1);
                }
            }
        };
        let t0 = Instant::now();
        let outputs = engine.step_observed(&mut on_layer)?;
        share_step_time(engine, t0.elapsed(), |id, secs| {
            if let Some(l) = self.live.get_mut(&id) {
                l.node_seconds += secs;
            }
        });
        let n = outputs.len();
        for o in outputs {
            let id = o.request_id;
            let Some(mut l) = self.live.remove(&id) else {
                engine.release_held(id);
                continue;
            };
            if o.held_blocks.is_none() {
                // Not a prefill-only output (cannot happen: every request here is one).
                engine.abort(id);
                continue;
            }
            let first = PrefillResponse {
                event: Some(Event::FirstToken(FirstToken {
                    token_id: o.token,
                    cached_prompt_tokens: o.usage.cached_tokens as u32,
                    node_seconds: l.node_seconds,
                    logprob: o.logprob.as_ref().map(convert::logprob),
                })),
            };
            let _ = l.job.events.try_send(Ok(first));
            self.metrics.first_token(l.job.received_at.elapsed());
            self.metrics
                .prompt(o.usage.prompt_tokens as u64, o.usage.cached_tokens as u64);
            l.forward_span
                .record("tandem.cached_prompt_tokens", o.usage.cached_tokens);
            l.job
                .span
                .record("tandem.cached_prompt_tokens", o.usage.cached_tokens);
            // The forward span ends with the first token.
            l.forward_span = tracing::Span::none();
            let push = match (l.push.take(), l.push_error.take()) {
                (Some(p), _) => Ok(p),
                (None, Some(e)) => Err(e),
                // No layer callback saw the request's last chunk: push every layer at once.
                (None, None) => {
                    let held = o.held_blocks.as_deref().unwrap_or_default();
                    match held.get(..l.prompt_blocks) {
                        Some(src) => start_push(
                            &self.senders,
                            &self.settings,
                            &self.runtime,
                            id,
                            &mut l,
                            src.to_vec(),
                            false,
                        ),
                        None => Err(TransferError::InvalidRequest {
                            field: "src_blocks",
                            reason: "fewer blocks than the prompt needs".into(),
                        }),
                    }
                }
            };
            let guard = HeldBlocks {
                request_id: id,
                engine: self.engine.clone(),
            };
            match push {
                Err(e) => {
                    tracing::warn!(request = %l.job.label, error = %e, "KV push could not start");
                    self.metrics.request(Outcome::Failed);
                    propagation::mark_error(&l.job.span, e.kind().as_str(), &e);
                    let _ = l.job.events.try_send(Err(status::push_status(&e)));
                    // On the engine thread: give the blocks back here, not through the
                    // engine's own (bounded, possibly full) command channel.
                    guard.release_now(engine);
                }
                Ok(push) => {
                    let blocks = l.prompt_blocks as u32;
                    let metrics = self.metrics.clone();
                    self.runtime
                        .spawn(finish_push(push, l, blocks, guard, metrics));
                }
            }
        }
        Ok(n)
    }

    fn housekeeping(&mut self, engine: &mut Engine) {
        let gone: Vec<u64> = self
            .live
            .iter()
            .filter(|(_, l)| l.job.events.is_closed())
            .map(|(&id, _)| id)
            .collect();
        for id in gone {
            if let Some(l) = self.live.remove(&id) {
                self.metrics.request(Outcome::Cancelled);
                l.job.span.record("error.type", "cancelled");
                tracing::debug!(request = %l.job.label, "client went away before its first token; aborted");
                l.cancel.cancel();
                engine.abort(id);
            }
        }
    }

    fn on_step_error(&mut self, engine: &mut Engine, error: &EngineError) {
        let s = status::engine_status(error);
        self.fail_all(engine, || s.clone());
    }

    fn shutdown(&mut self, engine: &mut Engine) {
        self.fail_all(engine, || {
            status::unavailable("prefill node is shutting down")
        });
    }
}

/// Awaits a push (or the client's departure, which cancels it and still awaits its end), reports
/// the outcome, then releases the blocks (`guard`) and the in-flight unit.
async fn finish_push(
    push: OutboundTransfer,
    l: Live,
    blocks: u32,
    guard: HeldBlocks,
    metrics: NodeMetrics,
) {
    let events = l.job.events.clone();
    let mut fut = std::future::IntoFuture::into_future(push);
    let result = tokio::select! {
        r = &mut fut => r,
        _ = events.closed() => {
            l.cancel.cancel();
            fut.await
        }
    };
    match result {
        Ok(report) => {
            let msg = KvPushed {
                bytes: report.bytes,
                blocks,
                transfer_us: report.elapsed.as_micros() as u64,
            };
            l.push_span.record("tandem.kv.bytes", report.bytes);
            l.push_span
                .record("tandem.kv.mode", tracing::field::debug(report.data_mode));
            metrics.request(Outcome::Ok);
            tracing::debug!(
                request = %l.job.label, bytes = report.bytes, blocks, mode = report.data_mode,
                push_us = msg.transfer_us, total_ms = l.started.elapsed().as_millis() as u64, "KV pushed"
            );
            let _ = events
                .send(Ok(PrefillResponse {
                    event: Some(Event::KvPushed(msg)),
                }))
                .await;
        }
        Err(e) if events.is_closed() => {
            metrics.request(Outcome::Cancelled);
            l.job.span.record("error.type", "cancelled");
            tracing::debug!(request = %l.job.label, error = %e, "push ended after the client left")
        }
        Err(e) => {
            metrics.request(Outcome::Failed);
            propagation::mark_error(&l.push_span, e.kind().as_str(), &e);
            propagation::mark_error(&l.job.span, e.kind().as_str(), &e);
            tracing::warn!(request = %l.job.label, error = %e, retry_safe = e.retry_safe(), "KV push failed");
            let _ = events.send(Err(status::push_status(&e))).await;
        }
    }
    drop(guard);
    drop(l);
}
