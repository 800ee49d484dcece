//! The CUDA IPC data path: KV blocks between two processes on one GPU, device to device.
//!
//! ```text
//!  prefill (sender)                                   decode (receiver)
//!  Hello{wants_data_path, device_uuid} ─────────────▶ same GPU and pool size? offer:
//!  open_peer(handle) ◀──────────── HelloReply{CudaIpc{uuid, handle, len}}   (else: no offer,
//!  per chunk: copy + XXH3 of the source, on device                           bytes in the stream)
//!  Chunk{checksums} (mode Rma) ────────────────────▶ XXH3 of the landed slabs, on device; compare
//! ```
//!
//! It rides on the TCP transport: the connection carries the control frames (Begin, Chunk,
//! Done, Abort) exactly as for UCX's one-sided puts, so reservations, epochs, deadlines, fences
//! and the fail-closed verification are the stream protocol's own. Only the bytes move outside.
//!
//! # Invariants
//! - An offer is made only to a sender on the same GPU (UUIDs equal) whose pool has the
//!   receiver's size; any other sender keeps its bytes in the stream (logged at connect, and
//!   the transfer's `data_mode` says `inline`), never refused.
//! - A chunk's `Chunk` frame is sent only after its copy returned (the bytes have landed).
//! - The receiver hashes landed slabs in its device pool and compares them with the sender's
//!   checksums of the source slabs: a block is ready only if they match, as on every path.
//! - Reports of transfers that landed on the device say so (`InboundReport::on_device`): the
//!   host pool's copy of those blocks is stale, and a node must not stage it up.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use crate::datapath::{BoxFuture, Completion, DataPath, Keep, Offer, PeerDataPath, slab_pairs};
use crate::device::{DeviceKv, DevicePeer};
use crate::error::{Phase, TransferError};
use crate::fault::ChunkFaults;
use crate::metrics::TransferMetrics;
use crate::pool::KvPool;
use crate::transport::PoolRegistration;
use crate::wire::{DataMode, DataOffer, Hello, IpcRemote};

/// A transport's CUDA IPC state: the device pool it sends from and receives into.
pub(crate) struct IpcPath {
    device: Arc<dyn DeviceKv>,
    metrics: Arc<TransferMetrics>,
    handle: OnceLock<Result<Vec<u8>, String>>,
}

impl IpcPath {
    pub fn new(device: Arc<dyn DeviceKv>, metrics: Arc<TransferMetrics>) -> Self {
        tracing::info!(device = %device.label(), bytes = device.len_bytes(), "KV transfers to and from this GPU go by CUDA IPC");
        Self {
            device,
            metrics,
            handle: OnceLock::new(),
        }
    }

    /// The pool's IPC handle, exported once; a failure is logged once and no offer is made.
    fn handle(&self) -> Option<Vec<u8>> {
        let h = self.handle.get_or_init(|| {
            self.device.export().map_err(|e| {
                tracing::warn!(error = %e, "cannot export the KV pool by CUDA IPC: peers on this GPU get the stream");
                e.to_string()
            })
        });
        h.as_ref().ok().cloned()
    }
}

impl DataPath for IpcPath {
    fn offer(&self, registration: &PoolRegistration, hello: &Hello) -> Option<Offer> {
        let uuid = self.device.device_uuid();
        if hello.device_uuid != uuid {
            return None;
        }
        let len = registration.pool().len_bytes();
        if len != self.device.len_bytes() {
            tracing::warn!(
                host_pool = len,
                device_pool = self.device.len_bytes(),
                "the registered pool is not the device pool's mirror: no CUDA IPC offer"
            );
            self.metrics.ipc_declined();
            return None;
        }
        let Some(handle) = self.handle() else {
            self.metrics.ipc_declined();
            return None;
        };
        Some(DataOffer::CudaIpc(IpcRemote {
            device_uuid: uuid.to_vec(),
            handle,
            len_bytes: len as u64,
        }))
    }

    fn device_uuid(&self) -> Vec<u8> {
        self.device.device_uuid().to_vec()
    }

    fn inline_ok(&self) -> bool {
        true
    }

    fn landing_device(&self) -> Option<Arc<dyn DeviceKv>> {
        Some(Arc::clone(&self.device))
    }

    fn connect<'a>(
        &'a self,
        peer: &'a str,
        remote: &'a Offer,
        _conn_id: u32,
        _same_host: bool,
    ) -> BoxFuture<'a, Result<Box<dyn PeerDataPath>, TransferError>> {
        Box::pin(async move {
            let DataOffer::CudaIpc(remote) = remote else {
                return Err(TransferError::protocol(
                    "data_offer",
                    "a CUDA IPC sender was offered another data path",
                ));
            };
            if remote.device_uuid != self.device.device_uuid() {
                return Err(TransferError::protocol(
                    "data_offer",
                    "offered a pool on another GPU",
                ));
            }
            let (device, handle, len) = (
                Arc::clone(&self.device),
                remote.handle.clone(),
                remote.len_bytes as usize,
            );
            let opened = tokio::task::spawn_blocking(move || device.open_peer(&handle, len))
                .await
                .map_err(|_| TransferError::Shutdown)??;
            tracing::info!(
                peer,
                bytes = len,
                "CUDA IPC: the peer's KV pool is open on this GPU"
            );
            Ok(Box::new(IpcPeer {
                peer: peer.to_string(),
                remote: Arc::from(opened),
                remote_len: len,
                closed: AtomicBool::new(false),
                metrics: Arc::clone(&self.metrics),
            }) as Box<dyn PeerDataPath>)
        })
    }

    fn post_recvs(
        &self,
        _conn_id: u32,
        _transfer_id: u64,
        _first_range: u64,
        _ranges: Vec<(usize, usize)>,
        _keep: Keep,
    ) -> Completion {
        // Only `Rma` transfers run on this path; a `Tag` Begin is refused before this.
        let (tx, rx) = tokio::sync::oneshot::channel();
        let _ = tx.send(Err(TransferError::protocol(
            "tag",
            "the CUDA IPC path has no tagged receives",
        )));
        rx
    }

    fn cancel_recvs(&self, _conn_id: u32, _transfer_id: Option<u64>) {}

    fn drain_unexpected(&self, _conn_id: u32) {}
}

/// The sending side: the receiver's pool, opened on this GPU.
struct IpcPeer {
    peer: String,
    remote: Arc<dyn DevicePeer>,
    remote_len: usize,
    closed: AtomicBool,
    metrics: Arc<TransferMetrics>,
}

/// The destination offset of payload byte `at` of a chunk made of `ranges` (in payload order).
fn payload_to_dst(ranges: &[(usize, usize, usize)], at: u64) -> Option<usize> {
    let mut start = 0u64;
    for &(_, dst, len) in ranges {
        if at < start + len as u64 {
            return Some(dst + (at - start) as usize);
        }
        start += len as u64;
    }
    None
}

impl PeerDataPath for IpcPeer {
    fn mode(&self) -> DataMode {
        DataMode::Rma
    }

    fn label(&self) -> &'static str {
        "cuda-ipc"
    }

    fn mapped(&self) -> bool {
        true
    }

    fn copy_chunk<'a>(
        &'a self,
        _pool: &'a Arc<KvPool>,
        ranges: Vec<(usize, usize, usize)>,
        slab_bytes: usize,
        _streaming: bool,
        faults: ChunkFaults,
    ) -> BoxFuture<'a, Result<Vec<u64>, TransferError>> {
        Box::pin(async move {
            if self.closed.load(Ordering::Relaxed) {
                return Err(TransferError::PeerGone {
                    peer: self.peer.clone(),
                    phase: Phase::Data,
                    reason: std::io::ErrorKind::ConnectionAborted,
                });
            }
            let slabs = slab_pairs(&ranges, slab_bytes, self.remote_len as u64)?;
            let flip_at = faults.corrupt_at.and_then(|at| payload_to_dst(&ranges, at));
            let bytes: usize = ranges.iter().map(|r| r.2).sum();
            let remote = Arc::clone(&self.remote);
            // Awaited to the end, never dropped midway: nothing is still copying once this
            // returns.
            let sums = tokio::task::spawn_blocking(move || {
                remote.copy_and_hash(&slabs, slab_bytes, flip_at)
            })
            .await
            .map_err(|_| TransferError::Shutdown)??;
            self.metrics.ipc_sent(bytes as u64);
            Ok(sums)
        })
    }

    fn send_chunk<'a>(
        &'a self,
        _transfer_id: u64,
        _first_range: u64,
        _pool: &'a Arc<KvPool>,
        _ranges: &'a [(usize, usize, usize)],
        _faults: ChunkFaults,
    ) -> BoxFuture<'a, Result<Completion, TransferError>> {
        Box::pin(async {
            Err(TransferError::protocol(
                "send_chunk",
                "the CUDA IPC path copies chunks (mapped)",
            ))
        })
    }

    fn close(&self) {
        self.closed.store(true, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_payload_offset_maps_to_its_destination_byte() {
        let ranges = [(0, 1000, 10), (50, 2000, 20)];
        assert_eq!(payload_to_dst(&ranges, 0), Some(1000));
        assert_eq!(payload_to_dst(&ranges, 9), Some(1009));
        assert_eq!(payload_to_dst(&ranges, 10), Some(2000));
        assert_eq!(payload_to_dst(&ranges, 29), Some(2019));
        assert_eq!(payload_to_dst(&ranges, 30), None);
    }
}
