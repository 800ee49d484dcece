//! [`InboundSession`]: one claimed reservation being filled by one transfer, and the per-slab
//! verification that decides whether its blocks may ever be called ready.

use std::sync::Arc;

use super::{InboundRegistry, InboundReport};
use crate::checksum::block_checksum;
use crate::error::TransferError;
use crate::pool::{BlockId, BlockRun, KvPool};

/// A claimed reservation being filled by one transfer on one connection.
pub(crate) struct InboundSession {
    pub(super) registry: InboundRegistry,
    pub(super) reservation_id: u64,
    pub(super) epoch: u64,
    pub(super) transfer_id: u64,
    pub(super) request_id: u128,
    pub(super) trace_context: String,
    pub(super) src_blocks: Vec<BlockId>,
    pub(super) dst_blocks: Arc<[BlockId]>,
    pub(super) runs: Vec<BlockRun>,
    pub(super) next_layer: u32,
    pub(super) layers_verified: u32,
    pub(super) num_layers: u32,
    pub(super) slab_sums: Vec<u64>,
    pub(super) bytes: u64,
    /// Bytes land in the receiver's device pool (CUDA IPC), not the registered host pool.
    pub(super) on_device: bool,
    pub(super) finished: bool,
    pub(super) progress: super::Progress,
}

impl InboundSession {
    /// The pool being written.
    pub fn pool(&self) -> &Arc<KvPool> {
        self.registry.inner.registration.pool()
    }

    /// The transfer's block runs (consecutive on both sides).
    pub fn runs(&self) -> &[BlockRun] {
        &self.runs
    }

    /// Blocks in the transfer.
    pub fn num_blocks(&self) -> usize {
        self.dst_blocks.len()
    }

    /// True once the registry asked this transfer to abort: land nothing more.
    pub fn aborting(&self) -> bool {
        let t = self.registry.lock();
        t.entries
            .get(&self.reservation_id)
            .and_then(|e| e.claim.as_ref())
            .is_none_or(|c| c.pending.is_some())
    }

    /// Checks a chunk's header against what this transfer still expects (layers in order, sizes
    /// that match), and accounts its layers as announced.
    pub fn check_chunk(
        &mut self,
        layer_start: u32,
        layer_end: u32,
        checksums: usize,
        payload_bytes: u64,
    ) -> Result<(), TransferError> {
        if layer_start != self.next_layer || layer_end <= layer_start || layer_end > self.num_layers
        {
            return Err(TransferError::protocol(
                "chunk_layers",
                format!(
                    "layers {layer_start}..{layer_end}, expected to start at {}",
                    self.next_layer
                ),
            ));
        }
        let slabs = (layer_end - layer_start) as usize * self.num_blocks();
        let slab_bytes = self.pool().layout().slab_bytes() as u64;
        if checksums != slabs || payload_bytes != slabs as u64 * slab_bytes {
            return Err(TransferError::protocol(
                "chunk_size",
                format!("{checksums} checksums / {payload_bytes} bytes for {slabs} slabs"),
            ));
        }
        self.next_layer = layer_end;
        Ok(())
    }

    /// Destination byte range `(offset, len)` of one layer of one run.
    pub fn dst_run_range(&self, layer: u32, run: &BlockRun) -> (usize, usize) {
        let pool = self.pool();
        let off =
            pool.layout()
                .slab_offset(pool.num_blocks(), layer as usize, run.dst_start as usize);
        (off, run.len as usize * pool.layout().slab_bytes())
    }

    /// Marks this transfer's bytes as landing in device memory (CUDA IPC; see
    /// [`InboundReport::on_device`]).
    pub fn set_on_device(&mut self) {
        self.on_device = true;
    }

    /// Byte offsets of every destination slab of layers `layer_start..layer_end`, layer-major
    /// (the order of the sender's checksums), and the bytes of one slab.
    pub fn dst_slab_offsets(&self, layer_start: u32, layer_end: u32) -> (Vec<usize>, usize) {
        let pool = self.pool();
        let (layout, nb) = (pool.layout(), pool.num_blocks());
        let offsets = (layer_start..layer_end)
            .flat_map(|l| {
                self.dst_blocks
                    .iter()
                    .map(move |&b| layout.slab_offset(nb, l as usize, b as usize))
            })
            .collect();
        (offsets, layout.slab_bytes())
    }

    /// A job computing XXH3 of every destination slab of layers `layer_start..layer_end`
    /// (layer-major), to run off the connection's task once those bytes have landed.
    ///
    /// The job reads the claimed destination blocks: the caller must let it finish before the
    /// session does (the fence also covers readers).
    pub fn hasher(
        &self,
        layer_start: u32,
        layer_end: u32,
    ) -> impl FnOnce() -> Result<Vec<u64>, TransferError> + Send + 'static {
        let pool = Arc::clone(self.pool());
        let dst = Arc::clone(&self.dst_blocks);
        move || {
            // SAFETY: these slabs belong to a reservation claimed by the session, which outlives
            // the job; their bytes have landed and nobody writes them now.
            unsafe { pool.slab_checksums(layer_start..layer_end, &dst) }
        }
    }

    /// Compares landed slabs' checksums (`actual`) with the sender's (`expected`), both
    /// layer-major over layers `layer_start..layer_end` (a range [`Self::check_chunk`]
    /// accepted). Returns true when every layer of the transfer has now verified.
    pub fn accept_chunk(
        &mut self,
        layer_start: u32,
        layer_end: u32,
        actual: &[u64],
        expected: &[u64],
    ) -> Result<bool, TransferError> {
        let n = self.num_blocks();
        let slabs = (layer_end - layer_start) as usize * n;
        if actual.len() != slabs || expected.len() != slabs {
            return Err(TransferError::protocol(
                "chunk_size",
                format!("{} of {slabs} checksums", actual.len()),
            ));
        }
        for (idx, (&a, &e)) in actual.iter().zip(expected).enumerate() {
            if a != e {
                let layer = layer_start + (idx / n) as u32;
                let block = self.dst_blocks[idx % n];
                return Err(TransferError::ChecksumMismatch {
                    layer,
                    block,
                    expected: e,
                    actual: a,
                });
            }
        }
        let first = layer_start as usize * n;
        self.slab_sums[first..first + slabs].copy_from_slice(actual);
        let bytes = slabs as u64 * self.pool().layout().slab_bytes() as u64;
        self.bytes += bytes;
        self.registry.inner.metrics.add_received(bytes);
        self.layers_verified += layer_end - layer_start;
        self.progress.touch(self.registry.inner.started);
        Ok(self.layers_verified == self.num_layers)
    }

    /// Hashes layers `layer_start..layer_end` here and accepts them (see [`Self::accept_chunk`]).
    pub fn verify_chunk(
        &mut self,
        layer_start: u32,
        layer_end: u32,
        expected: &[u64],
    ) -> Result<bool, TransferError> {
        let actual = self.hasher(layer_start, layer_end)()?;
        self.accept_chunk(layer_start, layer_end, &actual, expected)
    }

    /// Per-block checksums across layers (valid once every layer verified).
    pub fn block_checksums(&self) -> Vec<u64> {
        let n = self.num_blocks();
        (0..n)
            .map(|i| {
                block_checksum((0..self.num_layers as usize).map(|l| self.slab_sums[l * n + i]))
            })
            .collect()
    }

    /// Ends the session: releases the reservation and resolves its [`InboundTransfer`]. If the
    /// registry had asked for an abort, that reason wins over `result`. Returns true when the
    /// reservation resolved `Ok` (only then may the sender be told `Done`).
    pub fn finish(mut self, result: Result<(), TransferError>) -> bool {
        self.finish_inner(result)
    }

    /// Asks this session's writer to abort with `err` (via the same path an expiry takes); the
    /// session must then be finished once the writer confirms.
    pub fn abort(&self, err: TransferError) {
        let _ = self
            .registry
            .request_abort(self.reservation_id, self.epoch, err);
    }

    fn finish_inner(&mut self, result: Result<(), TransferError>) -> bool {
        if std::mem::replace(&mut self.finished, true) {
            return false;
        }
        let mut t = self.registry.lock();
        let ours = t
            .entries
            .get(&self.reservation_id)
            .filter(|e| e.epoch == self.epoch)
            .and_then(|e| e.claim.as_ref())
            .filter(|c| c.transfer_id == self.transfer_id);
        let Some(claim) = ours else { return false };
        let expired = matches!(
            claim.pending,
            Some(TransferError::ReservationExpired { .. })
        );
        let Some(mut entry) = t.remove(self.reservation_id, expired) else {
            return false;
        };
        let pending = entry.claim.take().and_then(|c| c.pending);
        drop(t);
        let outcome = match (pending, result) {
            (Some(e), _) | (None, Err(e)) => Err(e),
            (None, Ok(())) => Ok(InboundReport {
                reservation_id: self.reservation_id,
                epoch: self.epoch,
                request_id: self.request_id,
                trace_context: std::mem::take(&mut self.trace_context),
                src_blocks: std::mem::take(&mut self.src_blocks),
                dst_blocks: self.dst_blocks.to_vec(),
                block_checksums: self.block_checksums(),
                bytes: self.bytes,
                on_device: self.on_device,
            }),
        };
        let ok = outcome.is_ok();
        if ok && self.on_device {
            self.registry.inner.metrics.ipc_received(self.bytes);
        }
        self.registry
            .inner
            .metrics
            .inbound_finished(outcome.as_ref().map(|_| ()));
        if let Some(tx) = entry.done_tx.take() {
            let _ = tx.send(outcome);
        }
        ok
    }
}

impl Drop for InboundSession {
    fn drop(&mut self) {
        let _ = self.finish_inner(Err(TransferError::protocol(
            "session_dropped",
            "transfer ended without a result",
        )));
    }
}
