//! [`UcxPeer`]: the sending side's UCX state for one connection, and how a chunk's bytes leave:
//! through a mapping of the peer's pool (fused copy + checksum), as `ucp_put_nbx` puts, or as
//! tagged sends. The stream protocol reaches it as a [`PeerDataPath`].

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use super::runtime::{Cmd, Keep, UcxRuntime};
use super::{PutOp, TagOp, tag_for};
use crate::checksum::copy_slabs_with_checksums;
use crate::datapath::{BoxFuture, Completion, PeerDataPath};
use crate::error::TransferError;
use crate::fault::ChunkFaults;
use crate::pool::KvPool;
use crate::wire::DataMode;

/// The UCX side of one connection: an endpoint to the receiver's worker and its pool's key.
pub(crate) struct UcxPeer {
    pub(super) rt: UcxRuntime,
    pub(super) ep: u64,
    pub(super) mode: DataMode,
    pub(super) conn_id: u32,
    pub(super) remote_base: u64,
    pub(super) remote_len: u64,
    pub(super) closed: AtomicBool,
    /// Local address of the peer pool's base when UCX maps it into this process.
    pub(super) mapped: Option<usize>,
}

impl PeerDataPath for UcxPeer {
    fn mode(&self) -> DataMode {
        self.mode
    }

    fn label(&self) -> &'static str {
        if self.mapped.is_some() {
            "rma-mapped"
        } else if self.mode == DataMode::Tag {
            "tag"
        } else {
            "rma"
        }
    }

    fn mapped(&self) -> bool {
        self.mapped.is_some()
    }

    fn copy_chunk<'a>(
        &'a self,
        pool: &'a Arc<KvPool>,
        ranges: Vec<(usize, usize, usize)>,
        slab_bytes: usize,
        streaming: bool,
        faults: ChunkFaults,
    ) -> BoxFuture<'a, Result<Vec<u64>, TransferError>> {
        Box::pin(self.copy_into_mapping(pool, ranges, slab_bytes, streaming, faults))
    }

    fn send_chunk<'a>(
        &'a self,
        transfer_id: u64,
        first_range: u64,
        pool: &'a Arc<KvPool>,
        ranges: &'a [(usize, usize, usize)],
        faults: ChunkFaults,
    ) -> BoxFuture<'a, Result<Completion, TransferError>> {
        Box::pin(self.start_chunk(transfer_id, first_range, pool, ranges, faults))
    }

    fn close(&self) {
        self.close_endpoint();
    }
}

impl UcxPeer {
    /// Copies one chunk's ranges `(src offset, dst offset, len)` into the peer's mapped pool,
    /// hashing each slab in the same pass (non-temporal stores when `streaming`: see
    /// [`crate::TransferConfig::streaming_store_min_transfer_bytes`]); returns the slab checksums
    /// in payload order. Runs on
    /// a blocking thread and always completes (it is not cancelled midway: the mapping must
    /// outlive every write, and the caller holds the endpoint until this returns).
    async fn copy_into_mapping(
        &self,
        pool: &Arc<KvPool>,
        ranges: Vec<(usize, usize, usize)>,
        slab_bytes: usize,
        streaming: bool,
        faults: ChunkFaults,
    ) -> Result<Vec<u64>, TransferError> {
        let base = self
            .mapped
            .ok_or_else(|| TransferError::protocol("ucx_copy", "peer pool not mapped"))?;
        let slabs = crate::datapath::slab_pairs(&ranges, slab_bytes, self.remote_len)?;
        let pool = Arc::clone(pool);
        // Awaited to the end, never dropped midway: the copy must not outlive the mapping.
        let sums = tokio::task::spawn_blocking(move || {
            copy_slabs(&pool, base, &slabs, slab_bytes, streaming, faults)
        })
        .await
        .map_err(|_| TransferError::Shutdown)?;
        // Make every store visible before the Chunk frame announces it.
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        Ok(sums)
    }

    /// Closes the endpoint now (a cut fault, or the connection going); later operations fail.
    fn close_endpoint(&self) {
        if !self.closed.swap(true, Ordering::Relaxed) {
            let _ = self.rt.send(Cmd::Close { ep: self.ep });
        }
    }

    /// Starts moving one chunk's ranges `(src offset, dst offset, len)`; the receiver resolves
    /// once every byte has landed (puts: flushed) and UCX no longer touches the source. Range
    /// `k` of a tagged chunk goes under [`tag_for`]`(conn_id, transfer_id, first_range + k)`.
    async fn start_chunk(
        &self,
        transfer_id: u64,
        first_range: u64,
        pool: &Arc<KvPool>,
        ranges: &[(usize, usize, usize)],
        faults: ChunkFaults,
    ) -> Result<Completion, TransferError> {
        let base = pool.as_ptr() as usize;
        let limit = faults.cut_at.unwrap_or(u64::MAX);
        let mut offset = 0u64;
        // Under a cut, only whole ranges before the cut point move (then the connection dies).
        let kept: Vec<(usize, usize, usize, u64)> = ranges
            .iter()
            .map(|&(s, t, len)| {
                let at = offset;
                offset += len as u64;
                (s, t, len, at)
            })
            .take_while(|&(_, _, len, at)| at + len as u64 <= limit)
            .collect();
        for &(_, t, len, _) in &kept {
            if (t + len) as u64 > self.remote_len {
                return Err(TransferError::invalid(
                    "dst_blocks",
                    "range beyond the receiver's pool",
                ));
            }
        }
        match self.mode {
            DataMode::Rma => {
                let ops = kept
                    .iter()
                    .map(|&(s, t, len, _)| PutOp {
                        local: base + s,
                        len,
                        remote: self.remote_base + t as u64,
                    })
                    .collect();
                let keep: Keep = Box::new(Arc::clone(pool));
                let rx = self.rt.request(|reply| Cmd::Put {
                    ep: self.ep,
                    ops,
                    keep,
                    reply,
                });
                let Some(at) = faults.corrupt_at else {
                    return Ok(rx);
                };
                // Fault: after the honest bytes land, overwrite one of them with its complement.
                rx.await.map_err(|_| TransferError::Shutdown)??;
                let &(s, t, _, start) = kept
                    .iter()
                    .find(|&&(_, _, len, start)| at >= start && at < start + len as u64)
                    .ok_or_else(|| {
                        TransferError::invalid("fault", "corrupt offset outside the chunk")
                    })?;
                let k = (at - start) as usize;
                // SAFETY: s + k is inside the source pool (k < that range's length).
                let flipped = Box::new([!unsafe { *pool.as_ptr().add(s + k) }]);
                let op = PutOp {
                    local: flipped.as_ptr() as usize,
                    len: 1,
                    remote: self.remote_base + (t + k) as u64,
                };
                Ok(self.rt.request(|reply| Cmd::Put {
                    ep: self.ep,
                    ops: vec![op],
                    keep: Box::new(flipped),
                    reply,
                }))
            }
            DataMode::Tag | DataMode::Inline => {
                let mut copy: Option<Vec<u8>> = None;
                let mut ops: Vec<TagOp> = kept
                    .iter()
                    .enumerate()
                    .map(|(k, &(s, _, len, _))| TagOp {
                        addr: base + s,
                        len,
                        tag: tag_for(self.conn_id, transfer_id, first_range + k as u64),
                    })
                    .collect();
                let target = faults.corrupt_at.and_then(|at| {
                    let k = kept
                        .iter()
                        .position(|&(_, _, len, start)| at >= start && at < start + len as u64)?;
                    Some((at, k))
                });
                if let Some((at, k)) = target {
                    let (s, _, len, start) = kept[k];
                    // SAFETY: (s, len) is a checked range of the source pool.
                    let mut bytes =
                        unsafe { std::slice::from_raw_parts(pool.as_ptr().add(s), len) }.to_vec();
                    bytes[(at - start) as usize] ^= 0xFF;
                    ops[k].addr = bytes.as_ptr() as usize;
                    copy = Some(bytes);
                }
                let keep: Keep = Box::new((Arc::clone(pool), copy));
                Ok(self.rt.request(|reply| Cmd::TagSend {
                    ep: self.ep,
                    ops,
                    keep,
                    reply,
                }))
            }
        }
    }
}

/// Copies `slabs` (source offset, destination offset) of `slab_bytes` each into the mapped pool
/// at `base`, hashing each in the same pass (with non-temporal stores when `streaming`). Stops
/// early (returning fewer sums) at a cut fault.
fn copy_slabs(
    pool: &KvPool,
    base: usize,
    slabs: &[(usize, usize)],
    slab_bytes: usize,
    streaming: bool,
    faults: ChunkFaults,
) -> Vec<u64> {
    let limit = faults.cut_at.unwrap_or(u64::MAX);
    // Whole slabs before the cut; the rest never moves.
    let moving = slabs.len().min(
        (limit / slab_bytes.max(1) as u64)
            .try_into()
            .unwrap_or(usize::MAX),
    );
    let pairs: Vec<(&[u8], *mut u8)> = slabs[..moving]
        .iter()
        .map(|&(s, t)| {
            // SAFETY: (s, slab_bytes) is a checked slab range of the source pool, which the
            // caller keeps alive and nobody writes during the push.
            let src = unsafe { std::slice::from_raw_parts(pool.as_ptr().add(s), slab_bytes) };
            (src, (base + t) as *mut u8)
        })
        .collect();
    let mut sums = Vec::with_capacity(moving);
    // SAFETY: every t + slab_bytes <= the peer pool's length (checked by the caller), inside its
    // mapping, which stays mapped while the caller holds the endpoint; the receiver keeps these
    // blocks untouched while the transfer holds them; source and destination pools differ.
    unsafe { copy_slabs_with_checksums(&pairs, streaming, &mut sums) };
    if let Some(at) = faults.corrupt_at {
        let (slab, within) = ((at / slab_bytes as u64) as usize, at % slab_bytes as u64);
        if let Some(&(_, dst)) = pairs.get(slab) {
            // SAFETY: inside a slab just written (its checksum was taken before the flip).
            unsafe { *dst.add(within as usize) ^= 0xFF };
        }
    }
    sums
}

impl Drop for UcxPeer {
    fn drop(&mut self) {
        self.close_endpoint();
    }
}
