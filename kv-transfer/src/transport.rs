//! The transport seam: register a pool once, push blocks into a peer's reservation.
//!
//! ```text
//! let reg = transport.register(pool)?;                       // once per pool (UCX: ucp_mem_map)
//! let t = transport.push(&reg, PushRequest::new(peer, res, epoch, src, dst).streamed(), cancel)?;
//! t.layers_ready(1); ... t.layers_ready(L);                  // as prefill finishes each layer
//! let report = t.await?;                                     // receiver verified every slab
//! ```
//!
//! The receiving side is an [`crate::InboundRegistry`] served by the transport's own `serve`
//! (TCP and UCX take a bound listener and a shutdown token; in-process attaches by name).
//!
//! # Lifecycle
//! A push ends exactly once: `Ok(TransferReport)` when the receiver confirmed every layer of every
//! block, or a typed [`TransferError`]. Its deadline, its [`CancellationToken`], dropping the
//! [`OutboundTransfer`], the receiver's abort or the connection's end all stop it promptly; the
//! sender then tells the receiver (when it can) and releases its `live_transfers` unit.

use std::future::{Future, IntoFuture};
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_kv_layout::KvLayout;
use tokio::sync::{oneshot, watch};
use tokio_util::sync::CancellationToken;

use crate::error::{Phase, Side, TransferError};
use crate::fault::FaultState;
use crate::metrics::{Live, LiveGuard, TransferMetrics};
use crate::pool::{BlockId, KvPool};

/// What a transport can do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TransferCapabilities {
    /// Implementation name (`"ucx"`, `"tcp"`, `"inproc"`), also the metrics label.
    pub name: &'static str,
    /// Block bytes can land in the receiver's pool without the receiver's CPU (RDMA-style).
    pub one_sided_writes: bool,
    /// Works between processes (and hosts).
    pub cross_process: bool,
    /// Layers can be pushed as they are computed.
    pub layer_streaming: bool,
}

/// A small transport trait (see the module docs): TCP, UCX and in-process implement it.
pub trait KvTransport: Send + Sync + 'static {
    /// What this transport can do.
    fn capabilities(&self) -> TransferCapabilities;

    /// Registers a pool for transfers (once per pool). Deregistered when the last clone of the
    /// returned registration drops.
    fn register(&self, pool: Arc<KvPool>) -> Result<PoolRegistration, TransferError>;

    /// Allocates a zeroed pool where this transport moves bytes fastest, registered. The default
    /// is a heap pool; UCX allocates memory peers can map (see [`KvPool`]).
    fn allocate(
        &self,
        layout: KvLayout,
        num_blocks: usize,
    ) -> Result<PoolRegistration, TransferError> {
        self.register(Arc::new(KvPool::new(layout, num_blocks)?))
    }

    /// Starts pushing `req.src_blocks` of `src` into the peer's reservation. Must be called
    /// inside a tokio runtime. Errors here are request errors; everything later arrives through
    /// the returned handle.
    fn push(
        &self,
        src: &PoolRegistration,
        req: PushRequest,
        cancel: CancellationToken,
    ) -> Result<OutboundTransfer, TransferError>;
}

/// A registered pool. Clones share one registration.
#[derive(Clone)]
pub struct PoolRegistration {
    inner: Arc<RegistrationInner>,
}

pub(crate) struct RegistrationInner {
    pub pool: Arc<KvPool>,
    pub metrics: Arc<TransferMetrics>,
    pub transport: &'static str,
    #[cfg(feature = "ucx")]
    pub ucx: Option<crate::ucx::MappedPool>,
    /// Held for its `Drop` (the registrations gauge); UCX moves it into the unmap command.
    #[cfg_attr(not(feature = "ucx"), allow(dead_code))]
    pub live: Option<LiveGuard>,
}

impl Drop for RegistrationInner {
    fn drop(&mut self) {
        #[cfg(feature = "ucx")]
        if let Some(mapped) = self.ucx.take() {
            // The gauge unit goes down only once UCX has really unmapped the pool.
            mapped.unmap(self.live.take());
        }
    }
}

impl PoolRegistration {
    pub(crate) fn new(inner: RegistrationInner) -> Self {
        Self {
            inner: Arc::new(inner),
        }
    }

    /// A registration with nothing to map (TCP, in-process).
    pub(crate) fn plain(
        pool: Arc<KvPool>,
        metrics: &Arc<TransferMetrics>,
        transport: &'static str,
    ) -> Self {
        Self::new(RegistrationInner {
            pool,
            metrics: Arc::clone(metrics),
            transport,
            #[cfg(feature = "ucx")]
            ucx: None,
            live: Some(metrics.live_guard(Live::Registrations)),
        })
    }

    /// The registered pool.
    pub fn pool(&self) -> &Arc<KvPool> {
        &self.inner.pool
    }

    /// The metrics of the transport that registered it.
    pub fn metrics(&self) -> &Arc<TransferMetrics> {
        &self.inner.metrics
    }

    /// Name of the transport that registered it.
    pub fn transport(&self) -> &'static str {
        self.inner.transport
    }

    #[cfg(feature = "ucx")]
    pub(crate) fn ucx(&self) -> Option<&crate::ucx::MappedPool> {
        self.inner.ucx.as_ref()
    }
}

/// Which blocks go where, and under what limits.
#[derive(Clone, Debug)]
pub struct PushRequest {
    /// The receiver: `host:port` for TCP/UCX, a name for in-process.
    pub peer: String,
    /// The request these blocks belong to (logs, traces).
    pub request_id: u128,
    /// The sender's W3C `traceparent` (empty: none), carried to the receiver in the descriptor.
    pub trace_context: String,
    /// The receiver's reservation.
    pub reservation_id: u64,
    /// The reservation's epoch.
    pub epoch: u64,
    /// Source block ids in the sender's pool.
    pub src_blocks: Vec<BlockId>,
    /// Destination block ids in the receiver's pool (as reserved), paired by position.
    pub dst_blocks: Vec<BlockId>,
    /// The whole push must finish within this.
    pub deadline: Duration,
    /// Layers are sent as [`OutboundTransfer::layers_ready`] marks them; otherwise all at once.
    pub streamed: bool,
    pub(crate) faults: FaultState,
}

impl PushRequest {
    /// A push of every layer of `src_blocks` into `dst_blocks`, all layers ready now, 30 s deadline.
    pub fn new(
        peer: impl Into<String>,
        reservation_id: u64,
        epoch: u64,
        src_blocks: Vec<BlockId>,
        dst_blocks: Vec<BlockId>,
    ) -> Self {
        Self {
            peer: peer.into(),
            request_id: 0,
            trace_context: String::new(),
            reservation_id,
            epoch,
            src_blocks,
            dst_blocks,
            deadline: Duration::from_secs(30),
            streamed: false,
            faults: FaultState::default(),
        }
    }

    /// Sets the request id.
    pub fn request_id(mut self, id: u128) -> Self {
        self.request_id = id;
        self
    }

    /// Sets the W3C `traceparent` the receiver sees (the sender's transfer span).
    pub fn trace_context(mut self, traceparent: impl Into<String>) -> Self {
        self.trace_context = traceparent.into();
        self
    }

    /// Sets the deadline.
    pub fn deadline(mut self, d: Duration) -> Self {
        self.deadline = d;
        self
    }

    /// Sends layers only as they are marked ready.
    pub fn streamed(mut self) -> Self {
        self.streamed = true;
        self
    }

    /// Injects a fault into this push (tests and drills only).
    #[cfg(feature = "fault-injection")]
    pub fn fault(mut self, f: crate::fault::Fault) -> Self {
        self.faults.fault = Some(f);
        self
    }
}

/// A finished push.
#[derive(Clone, Debug, PartialEq)]
pub struct TransferReport {
    /// Payload bytes moved.
    pub bytes: u64,
    /// From `push` to the receiver's confirmation.
    pub elapsed: Duration,
    /// Per-block checksums the receiver computed over what landed, in block order.
    pub block_checksums: Vec<u64>,
    /// How the bytes travelled: `"inline"` (TCP stream), `"rma"` (UCX puts), `"rma-mapped"`
    /// (writes through UCX's mapping of the peer pool), `"tag"` (UCX tagged sends) or
    /// `"memcpy"` (in-process).
    pub data_mode: &'static str,
}

/// An in-flight push: mark layers ready, cancel, or await the result.
///
/// Dropping it cancels the push.
pub struct OutboundTransfer {
    ready_tx: watch::Sender<u32>,
    done_rx: oneshot::Receiver<Result<TransferReport, TransferError>>,
    cancel: CancellationToken,
}

impl OutboundTransfer {
    /// Layers `0..layers` of every source block are final and may be sent. Monotonic: a smaller
    /// value than before is ignored. Has no effect on a push that was not `streamed`.
    pub fn layers_ready(&self, layers: u32) {
        self.ready_tx.send_if_modified(|cur| {
            let grow = layers > *cur;
            if grow {
                *cur = layers;
            }
            grow
        });
    }

    /// Stops the push; it resolves to `Cancelled { by: Local }` (unless it already finished).
    pub fn cancel(&self) {
        self.cancel.cancel();
    }
}

impl IntoFuture for OutboundTransfer {
    type Output = Result<TransferReport, TransferError>;
    type IntoFuture = Pin<Box<dyn Future<Output = Self::Output> + Send>>;

    fn into_future(mut self) -> Self::IntoFuture {
        let rx = std::mem::replace(&mut self.done_rx, oneshot::channel().1);
        Box::pin(async move {
            let _keep = self; // dropping the handle would cancel the push
            rx.await.unwrap_or(Err(TransferError::Shutdown))
        })
    }
}

impl Drop for OutboundTransfer {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// The task side of an [`OutboundTransfer`]: readiness, cancellation, deadline, result.
pub(crate) struct PushDriver {
    pub req: PushRequest,
    pub started: Instant,
    ready_rx: watch::Receiver<u32>,
    done_tx: Option<oneshot::Sender<Result<TransferReport, TransferError>>>,
    pub cancel: CancellationToken,
    deadline: tokio::time::Instant,
    metrics: Arc<TransferMetrics>,
    _live: LiveGuard,
}

/// Creates the handle/driver pair for a push of `num_layers` layers.
pub(crate) fn push_pair(
    req: PushRequest,
    num_layers: u32,
    cancel: &CancellationToken,
    metrics: &Arc<TransferMetrics>,
) -> (OutboundTransfer, PushDriver) {
    let initial = if req.streamed { 0 } else { num_layers };
    let (ready_tx, ready_rx) = watch::channel(initial);
    let (done_tx, done_rx) = oneshot::channel();
    let token = cancel.child_token();
    let deadline = tokio::time::Instant::now() + req.deadline;
    metrics.transfer_started();
    let driver = PushDriver {
        req,
        started: Instant::now(),
        ready_rx,
        done_tx: Some(done_tx),
        cancel: token.clone(),
        deadline,
        metrics: Arc::clone(metrics),
        _live: metrics.live_guard(Live::Transfers),
    };
    (
        OutboundTransfer {
            ready_tx,
            done_rx,
            cancel: token,
        },
        driver,
    )
}

impl PushDriver {
    /// Runs `fut` unless the push is cancelled or its deadline passes first.
    pub async fn guard<T>(
        &self,
        phase: Phase,
        fut: impl Future<Output = Result<T, TransferError>>,
    ) -> Result<T, TransferError> {
        tokio::select! {
            biased;
            _ = self.cancel.cancelled() => Err(TransferError::Cancelled { by: Side::Local }),
            _ = tokio::time::sleep_until(self.deadline) => {
                Err(TransferError::DeadlineExceeded { phase, deadline: self.req.deadline })
            }
            r = fut => r,
        }
    }

    /// Waits until more than `sent` layers are ready; returns the new watermark.
    pub async fn next_ready(&mut self, sent: u32) -> Result<u32, TransferError> {
        let mut rx = self.ready_rx.clone();
        let wait = async move {
            let v = rx
                .wait_for(|&v| v > sent)
                .await
                .map_err(|_| TransferError::Cancelled { by: Side::Local })?;
            Ok(*v)
        };
        self.guard(Phase::Data, wait).await
    }

    /// Records and delivers the result (once).
    pub fn finish(&mut self, result: Result<TransferReport, TransferError>) {
        self.metrics
            .transfer_finished(result.as_ref().map(|_| ()), self.started.elapsed());
        if let Ok(r) = &result {
            self.metrics.add_sent(r.bytes);
        }
        if let Some(tx) = self.done_tx.take() {
            let _ = tx.send(result);
        }
    }
}

impl Drop for PushDriver {
    fn drop(&mut self) {
        if self.done_tx.is_some() {
            self.finish(Err(TransferError::Shutdown));
        }
    }
}

/// A transfer is cut into at least this many chunks (when they stay over
/// [`MIN_PIPELINED_CHUNK_BYTES`]), so the receiver verifies one while the next moves.
const PIPELINE_CHUNKS: usize = 4;
/// Chunks are not cut smaller than this for pipelining: below it, a chunk's round of frames
/// costs more than the overlap saves.
const MIN_PIPELINED_CHUNK_BYTES: usize = 1 << 20;

/// Layers per chunk: as many as fit in `max_chunk_bytes`, at least one, and few enough that a
/// transfer of `layers` layers moves in [`PIPELINE_CHUNKS`] chunks or more (chunks of at least
/// [`MIN_PIPELINED_CHUNK_BYTES`]): with a single chunk, nothing overlaps the receiver's check.
pub(crate) fn layers_per_chunk(
    slab_bytes: usize,
    blocks: usize,
    layers: usize,
    max_chunk_bytes: usize,
) -> u32 {
    let per_layer = (slab_bytes * blocks).max(1);
    let pipelined = (per_layer * layers)
        .div_ceil(PIPELINE_CHUNKS)
        .max(MIN_PIPELINED_CHUNK_BYTES);
    (max_chunk_bytes.min(pipelined) / per_layer).max(1) as u32
}

#[cfg(test)]
mod tests {
    use super::layers_per_chunk;

    #[test]
    fn chunks_fit_the_cap_and_split_mid_size_transfers_for_overlap() {
        let slab = 64 << 10; // the 70B layout's slab
        // 64 blocks × 80 layers = 320 MiB: the 16 MiB cap decides (4 layers of 4 MiB).
        assert_eq!(layers_per_chunk(slab, 64, 80, 16 << 20), 4);
        // 3 blocks × 80 layers = 15 MiB: under the cap, still cut into >= 4 chunks.
        let per = layers_per_chunk(slab, 3, 80, 16 << 20);
        assert_eq!(per, 20);
        assert!(80u32.div_ceil(per) >= 4);
        // Small transfers are not cut below 1 MiB per chunk: SmolLM2, 8 blocks (48 KiB a
        // layer, 1.4 MiB in all) moves in 21 + 9 layers, 2 blocks' worth in one chunk.
        assert_eq!(layers_per_chunk(6144, 8, 30, 16 << 20), 21);
        assert_eq!(layers_per_chunk(6144, 2, 30, 16 << 20), 85);
        // A cap below one layer still moves a whole layer at a time.
        assert_eq!(layers_per_chunk(slab, 64, 80, 1 << 10), 1);
    }
}
