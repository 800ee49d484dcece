//! In-process transport: pools in one process, blocks moved with `memcpy`, for unit tests and for
//! colocated prefill/decode in one binary.
//!
//! It runs the receiver's real checks (the same [`InboundRegistry`] claim and per-slab checksum
//! verification as the network transports) so tests of fail-closed behaviour do not need sockets.
//! Cost: one copy per slab run plus one xxh3 pass on each side.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio_util::sync::CancellationToken;

use crate::checksum::slab_checksum;
use crate::error::{Phase, TransferError};
use crate::inbound::{AbortHook, InboundRegistry, InboundSession};
use crate::metrics::TransferMetrics;
use crate::pool::{block_runs, check_block_lists};
use crate::transport::{
    KvTransport, OutboundTransfer, PoolRegistration, PushDriver, PushRequest, TransferCapabilities,
    TransferReport, layers_per_chunk, push_pair,
};
use crate::wire::{Begin, DataMode, WireError};

/// Receivers reachable by name within this process.
#[derive(Clone, Default)]
pub struct InProcNetwork {
    peers: Arc<Mutex<HashMap<String, InboundRegistry>>>,
}

impl InProcNetwork {
    /// An empty network.
    pub fn new() -> Self {
        Self::default()
    }

    /// Makes `registry` reachable as `name` (replacing any previous one).
    pub fn attach(&self, name: impl Into<String>, registry: InboundRegistry) {
        self.peers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(name.into(), registry);
    }

    /// Makes `name` unreachable; pushes already running keep their receiver.
    pub fn detach(&self, name: &str) {
        self.peers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(name);
    }

    fn get(&self, name: &str) -> Option<InboundRegistry> {
        self.peers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(name)
            .cloned()
    }
}

/// The in-process [`KvTransport`].
pub struct InProcKvTransport {
    network: InProcNetwork,
    metrics: Arc<TransferMetrics>,
    max_chunk_bytes: usize,
    next_transfer: AtomicU64,
}

impl InProcKvTransport {
    /// A transport on `network`, copying at most `max_chunk_bytes` per chunk between checks for
    /// cancellation.
    pub fn new(network: InProcNetwork, max_chunk_bytes: usize) -> Self {
        Self {
            network,
            metrics: TransferMetrics::new(),
            max_chunk_bytes,
            next_transfer: AtomicU64::new(1),
        }
    }

    /// This transport's counters.
    pub fn metrics(&self) -> &Arc<TransferMetrics> {
        &self.metrics
    }
}

struct InProcHook {
    abort: CancellationToken,
    reason: Mutex<Option<WireError>>,
}

impl AbortHook for InProcHook {
    fn request_abort(&self, _transfer_id: u64, error: WireError) {
        *self.reason.lock().unwrap_or_else(|p| p.into_inner()) = Some(error);
        self.abort.cancel();
    }

    fn kill(&self) {
        self.abort.cancel();
    }
}

impl KvTransport for InProcKvTransport {
    fn capabilities(&self) -> TransferCapabilities {
        TransferCapabilities {
            name: "inproc",
            one_sided_writes: true,
            cross_process: false,
            layer_streaming: true,
        }
    }

    fn register(&self, pool: Arc<crate::pool::KvPool>) -> Result<PoolRegistration, TransferError> {
        Ok(PoolRegistration::plain(pool, &self.metrics, "inproc"))
    }

    fn push(
        &self,
        src: &PoolRegistration,
        req: PushRequest,
        cancel: CancellationToken,
    ) -> Result<OutboundTransfer, TransferError> {
        let registry = self
            .network
            .get(&req.peer)
            .ok_or_else(|| TransferError::Connect {
                peer: req.peer.clone(),
                source: std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "no in-process receiver by that name",
                ),
            })?;
        let dst_blocks = registry.registration().pool().num_blocks();
        check_block_lists(
            &req.src_blocks,
            src.pool().num_blocks(),
            &req.dst_blocks,
            dst_blocks,
        )?;
        let layers = src.pool().layout().num_layers as u32;
        let (handle, driver) = push_pair(req, layers, &cancel, &self.metrics);
        let transfer_id = self.next_transfer.fetch_add(1, Ordering::Relaxed);
        let src = src.clone();
        let max_chunk = self.max_chunk_bytes;
        tokio::spawn(async move {
            let mut driver = driver;
            let result = run(&mut driver, &src, registry, transfer_id, max_chunk).await;
            driver.finish(result);
        });
        Ok(handle)
    }
}

async fn run(
    d: &mut PushDriver,
    src: &PoolRegistration,
    registry: InboundRegistry,
    transfer_id: u64,
    max_chunk_bytes: usize,
) -> Result<TransferReport, TransferError> {
    let layout = *src.pool().layout();
    let layers = layout.num_layers as u32;
    let begin = Begin {
        transfer_id,
        request_id: d.req.request_id,
        trace_context: d.req.trace_context.clone(),
        reservation_id: d.req.reservation_id,
        epoch: d.req.epoch,
        layout_fingerprint: layout.fingerprint(),
        src_blocks: d.req.src_blocks.clone(),
        dst_blocks: d.req.dst_blocks.clone(),
        layer_start: 0,
        layer_end: layers,
        mode: DataMode::Inline,
    };
    let hook = Arc::new(InProcHook {
        abort: CancellationToken::new(),
        reason: Mutex::new(None),
    });
    let session = registry.claim(&begin, Arc::clone(&hook) as Arc<dyn AbortHook>)?;
    let mut session = Some(session);
    let result = fill(
        d,
        src,
        session.as_mut().expect("set above"),
        &hook,
        layers,
        max_chunk_bytes,
    )
    .await;
    let session = session.take().expect("set above");
    match result {
        Ok(bytes) => {
            let block_checksums = session.block_checksums();
            if session.finish(Ok(())) {
                Ok(TransferReport {
                    bytes,
                    elapsed: d.started.elapsed(),
                    block_checksums,
                    data_mode: "memcpy",
                })
            } else {
                // The receiver gave up (expiry, cancel) in the same instant the last layer verified.
                let reason = hook
                    .reason
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .clone();
                Err(reason
                    .unwrap_or(WireError::Cancelled)
                    .into_error(&d.req.peer, Phase::Completion))
            }
        }
        Err(e) => {
            // The receiver's view of our failure, as a network peer would have told it.
            let theirs = WireError::from_error(&e).into_error(&d.req.peer, Phase::Data);
            let _ = session.finish(Err(theirs));
            Err(e)
        }
    }
}

async fn fill(
    d: &mut PushDriver,
    src: &PoolRegistration,
    session: &mut InboundSession,
    hook: &InProcHook,
    layers: u32,
    max_chunk_bytes: usize,
) -> Result<u64, TransferError> {
    let src_pool = Arc::clone(src.pool());
    let dst_pool = Arc::clone(session.pool());
    let layout = *src_pool.layout();
    let slab = layout.slab_bytes();
    let n = d.req.src_blocks.len();
    let runs = block_runs(&d.req.src_blocks, &d.req.dst_blocks);
    let per_chunk = layers_per_chunk(slab, n, layout.num_layers, max_chunk_bytes);
    let peer = d.req.peer.clone();
    let receiver_abort = || {
        let reason = hook
            .reason
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        reason
            .unwrap_or(WireError::Cancelled)
            .into_error(&peer, Phase::Data)
    };
    let (mut sent, mut seq, mut offset) = (0u32, 0u32, 0u64);
    let mut checksums = Vec::new();
    while sent < layers {
        let ready = tokio::select! {
            r = d.next_ready(sent) => r?,
            _ = hook.abort.cancelled() => return Err(receiver_abort()),
        };
        let end = ready.min(sent + per_chunk);
        let chunk_bytes = (end - sent) as u64 * (n * slab) as u64;
        let faults = d.req.faults.for_chunk(seq, offset, chunk_bytes);
        if let Some(delay) = faults.delay {
            d.guard(Phase::Data, async {
                tokio::time::sleep(delay).await;
                Ok(())
            })
            .await?;
        }
        if faults.drop {
            // Nothing lands; only the deadline, a cancel or the receiver can end this now.
            tokio::select! {
                r = d.guard(Phase::Data, std::future::pending::<Result<(), TransferError>>()) => r?,
                _ = hook.abort.cancelled() => return Err(receiver_abort()),
            }
        }
        if hook.abort.is_cancelled() {
            return Err(receiver_abort());
        }
        checksums.clear();
        let mut copied = 0u64;
        for layer in sent..end {
            for (i, &b) in d.req.src_blocks.iter().enumerate() {
                // SAFETY: source slabs of a push are not written while it is in flight (pool contract).
                let bytes = unsafe { src_pool.slab(layer as usize, b) }?;
                checksums.push(slab_checksum(bytes));
                debug_assert_eq!(checksums.len() - 1, (layer - sent) as usize * n + i);
            }
            for run in &runs {
                let len = run.len as usize * slab;
                let s_off = layout.slab_offset(
                    src_pool.num_blocks(),
                    layer as usize,
                    run.src_start as usize,
                );
                let d_off = layout.slab_offset(
                    dst_pool.num_blocks(),
                    layer as usize,
                    run.dst_start as usize,
                );
                let mut len_now = len;
                if let Some(cut) = faults.cut_at {
                    len_now = len.min(cut.saturating_sub(copied) as usize);
                }
                let sp = src_pool.range_ptr(s_off, len)?;
                let dp = dst_pool.range_ptr(d_off, len)?;
                // SAFETY: both ranges are in bounds (range_ptr); the destination belongs to the
                // reservation this session claimed and nobody else touches it until it finishes;
                // the pools are distinct allocations or disjoint ranges of one.
                unsafe { std::ptr::copy_nonoverlapping(sp, dp, len_now) };
                copied += len_now as u64;
                if len_now < len {
                    return Err(TransferError::PeerGone {
                        peer: peer.clone(),
                        phase: Phase::Data,
                        reason: std::io::ErrorKind::ConnectionReset,
                    });
                }
                if let Some(at) = faults
                    .corrupt_at
                    .filter(|&at| at >= copied - len as u64 && at < copied)
                {
                    let at = at - (copied - len as u64);
                    // SAFETY: `at < len`, inside the destination range written just above.
                    unsafe { *dp.add(at as usize) ^= 0xFF };
                }
            }
        }
        session.check_chunk(sent, end, checksums.len(), chunk_bytes)?;
        let done = session.verify_chunk(sent, end, &checksums)?;
        offset += chunk_bytes;
        seq += 1;
        sent = end;
        if done {
            break;
        }
    }
    Ok(offset)
}
