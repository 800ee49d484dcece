//! The seam between the stream protocol (`tcp/`) and a data path that moves block bytes outside
//! the TCP stream: UCX (`ucx/`, feature `ucx`) and CUDA IPC between two processes on one GPU
//! (`cuda_ipc`).
//!
//! ```text
//!  ucx/ ──implements──▶ datapath::{DataPath, PeerDataPath} ◀──calls through── tcp/
//!    └───────────── sends its control frames over (NetShared) ─────────────▶ tcp/
//! ```
//!
//! Dependencies run one way: `tcp/` knows only [`DataPath`] and [`PeerDataPath`] and never
//! names `ucx/`; `ucx/` implements them and reuses `tcp/`'s connections for its control frames.
//! A network transport holds at most one data path (`NetShared::data_path`); without one, block
//! bytes stay in the stream ([`DataMode::Inline`]).
//!
//! # Negotiation
//! A sender whose transport has a data path asks for it in its `Hello`; the receiver answers
//! with its offer for the registered pool, or refuses the connection ([`answer_hello`]); the
//! sender opens the path from that offer ([`open`]). A receiver allows `Rma`/`Tag` transfers
//! only on connections where it made an offer. A path that is only sometimes possible (CUDA
//! IPC: only to a peer on the same GPU) says so ([`DataPath::inline_ok`]): with no offer, the
//! connection keeps block bytes in the stream instead of being refused.
//!
//! # Invariants
//! - Memory handed over with a [`Keep`] stays alive until the matching [`Completion`]
//!   resolves, and "resolved" (success, error or cancel) means the path no longer touches it.
//! - Receives are numbered per transfer from 0 in payload order (layer-major, then block run),
//!   the numbering the sender's `first_range` uses, so both sides name a range alike.
//!
//! # Cost
//! One dynamic call and, on the sending side, one boxed future per chunk: nothing next to the
//! megabytes a chunk moves.

use std::any::Any;
use std::pin::Pin;
use std::sync::Arc;

use tokio::sync::oneshot;

use crate::error::{Phase, TransferError};
use crate::fault::ChunkFaults;
use crate::pool::KvPool;
use crate::transport::PoolRegistration;
use crate::wire::{DataMode, DataOffer, Hello, HelloReply};

/// A boxed, sendable future (what the object-safe methods below return).
pub(crate) type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Something kept alive until a batch of requests completes (the memory they point into).
pub(crate) type Keep = Box<dyn Any + Send>;

/// What a receiver hands a sender so it can reach the receiver's pool over the data path (on
/// the wire, in `HelloReply::Accepted`).
pub(crate) type Offer = DataOffer;

/// Resolves once every request of a batch has completed and the path no longer touches its
/// memory: `Ok` when all of them succeeded.
pub(crate) type Completion = oneshot::Receiver<Result<(), TransferError>>;

/// A network transport's data path: what both of its sides need beyond the stream.
pub(crate) trait DataPath: Send + Sync {
    /// Receiver: what the sender of `hello` needs to reach `registration`'s pool over this
    /// path; `None` when the pool was not registered with it (or, CUDA IPC, the sender is on
    /// another GPU).
    fn offer(&self, registration: &PoolRegistration, hello: &Hello) -> Option<Offer>;

    /// Sender: the UUID of the GPU this side's KV lives on, for its `Hello` (empty: none).
    fn device_uuid(&self) -> Vec<u8> {
        Vec::new()
    }

    /// True when a connection this path cannot serve keeps block bytes in the stream instead
    /// of being refused (CUDA IPC to a peer on another GPU); UCX: false.
    fn inline_ok(&self) -> bool {
        false
    }

    /// Receiver: the device memory this path's bytes land in, when that is not the registered
    /// host pool (CUDA IPC); landed slabs are hashed there.
    fn landing_device(&self) -> Option<Arc<dyn crate::device::DeviceKv>> {
        None
    }

    /// Sender: opens this path to a receiver that offered `remote` on connection `conn_id`;
    /// `same_host` when the control connection runs between two addresses of this host.
    fn connect<'a>(
        &'a self,
        peer: &'a str,
        remote: &'a Offer,
        conn_id: u32,
        same_host: bool,
    ) -> BoxFuture<'a, Result<Box<dyn PeerDataPath>, TransferError>>;

    /// Receiver: posts receives of `(address, len)` ranges, numbered on from `first_range`, for
    /// transfer `transfer_id` of connection `conn_id`, into memory `keep` holds alive.
    fn post_recvs(
        &self,
        conn_id: u32,
        transfer_id: u64,
        first_range: u64,
        ranges: Vec<(usize, usize)>,
        keep: Keep,
    ) -> Completion;

    /// Receiver: cancels the pending receives of one transfer of connection `conn_id` (all of
    /// the connection's when `transfer_id` is `None`); their completions still resolve.
    fn cancel_recvs(&self, conn_id: u32, transfer_id: Option<u64>);

    /// Receiver: discards data of a closed connection that arrived with no receive posted.
    fn drain_unexpected(&self, conn_id: u32);
}

/// The sending side of one connection's data path.
pub(crate) trait PeerDataPath: Send + Sync {
    /// How the receiver learns a chunk's bytes landed: [`DataMode::Rma`] (they are there when
    /// its `Chunk` frame arrives) or [`DataMode::Tag`] (it posts receives on seeing the frame).
    fn mode(&self) -> DataMode;

    /// How bytes travel, for reports and logs: `rma` (puts), `rma-mapped` (writes through a
    /// mapping of the peer pool) or `tag`.
    fn label(&self) -> &'static str;

    /// True when the peer's pool is mapped here: chunks go through [`PeerDataPath::copy_chunk`]
    /// instead of [`PeerDataPath::send_chunk`].
    fn mapped(&self) -> bool;

    /// Copies one chunk's ranges `(src offset, dst offset, len)` into the mapped peer pool,
    /// hashing each slab in the same pass (non-temporal stores when `streaming`); returns the
    /// slab checksums in payload order. Nothing is still being written when it returns.
    fn copy_chunk<'a>(
        &'a self,
        pool: &'a Arc<KvPool>,
        ranges: Vec<(usize, usize, usize)>,
        slab_bytes: usize,
        streaming: bool,
        faults: ChunkFaults,
    ) -> BoxFuture<'a, Result<Vec<u64>, TransferError>>;

    /// Starts moving one chunk's ranges `(src offset, dst offset, len)` of transfer
    /// `transfer_id`, numbered on from `first_range`; the completion resolves once every byte
    /// has landed and the source is no longer read.
    fn send_chunk<'a>(
        &'a self,
        transfer_id: u64,
        first_range: u64,
        pool: &'a Arc<KvPool>,
        ranges: &'a [(usize, usize, usize)],
        faults: ChunkFaults,
    ) -> BoxFuture<'a, Result<Completion, TransferError>>;

    /// Closes the path now (a cut fault); later operations fail.
    fn close(&self);
}

/// Receiver: the data-path half of its answer to `hello`, whose version and layout already
/// matched. No offer when the sender asked for the stream only; `path`'s offer for
/// `registration`'s pool when it asked and one exists; otherwise the connection is refused.
pub(crate) fn answer_hello(
    path: Option<&dyn DataPath>,
    registration: &PoolRegistration,
    hello: &Hello,
) -> Result<Option<Offer>, TransferError> {
    if !hello.wants_data_path {
        return Ok(None);
    }
    if let Some(offer) = path.and_then(|p| p.offer(registration, hello)) {
        return Ok(Some(offer));
    }
    // A sender whose path may fall back (CUDA IPC, peer on another GPU) says so by carrying a
    // device UUID; it then gets the stream.
    if !hello.device_uuid.is_empty() {
        return Ok(None);
    }
    Err(TransferError::invalid(
        "wants_data_path",
        "this receiver serves TCP only",
    ))
}

/// Sender: the data path of a new connection, from the receiver's `reply` to a `Hello` that
/// asked for one exactly when `path` is `Some`. `None`: block bytes stay in the stream. An offer
/// nobody asked for, or none where one was asked for, is a protocol error.
pub(crate) async fn open(
    path: Option<&dyn DataPath>,
    peer: &str,
    reply: &HelloReply,
    same_host: bool,
) -> Result<Option<Box<dyn PeerDataPath>>, TransferError> {
    let (offer, conn_id) = match reply {
        HelloReply::Accepted { offer, conn_id, .. } => (offer.as_ref(), *conn_id),
        HelloReply::Refused(e) => return Err(e.clone().into_error(peer, Phase::Connect)),
    };
    match (offer, path) {
        (None, None) => Ok(None),
        (None, Some(path)) if path.inline_ok() => {
            tracing::info!(peer, "peer is not on this GPU: KV blocks go in the stream");
            Ok(None)
        }
        (Some(remote), Some(path)) => path
            .connect(peer, remote, conn_id, same_host)
            .await
            .map(Some),
        _ => Err(TransferError::protocol(
            "ucx_offer",
            "receiver answered a different data path",
        )),
    }
}

#[cfg(test)]
mod tests {
    use tandem_kv_layout::{KvDtype, KvLayout};

    use super::*;
    use crate::error::FailureKind;
    use crate::metrics::TransferMetrics;
    use crate::wire::WireError;

    /// A data path that only negotiates: it offers `offer` for any pool, and its `connect`
    /// fails with `Shutdown` (so a test sees that it was called).
    struct NegotiatingPath {
        offer: Option<Offer>,
        /// Like CUDA IPC: may fall back to the stream.
        inline: bool,
    }

    impl DataPath for NegotiatingPath {
        fn offer(&self, _: &PoolRegistration, _: &Hello) -> Option<Offer> {
            self.offer.clone()
        }

        fn inline_ok(&self) -> bool {
            self.inline
        }

        fn connect<'a>(
            &'a self,
            _: &'a str,
            _: &'a Offer,
            _: u32,
            _: bool,
        ) -> BoxFuture<'a, Result<Box<dyn PeerDataPath>, TransferError>> {
            Box::pin(async { Err(TransferError::Shutdown) })
        }

        fn post_recvs(
            &self,
            _: u32,
            _: u64,
            _: u64,
            _: Vec<(usize, usize)>,
            _: Keep,
        ) -> Completion {
            unreachable!("not part of the negotiation")
        }

        fn cancel_recvs(&self, _: u32, _: Option<u64>) {}

        fn drain_unexpected(&self, _: u32) {}
    }

    fn registration() -> (KvLayout, PoolRegistration) {
        let layout = KvLayout::new(3, 2, 8, 4, KvDtype::F16, 7).unwrap();
        let pool = Arc::new(KvPool::new(layout, 4).unwrap());
        (
            layout,
            PoolRegistration::plain(pool, &TransferMetrics::new(), "tcp"),
        )
    }

    fn some_offer() -> Offer {
        DataOffer::Ucx(crate::wire::UcxRemote {
            worker_address: vec![1, 2, 3],
            rkey: vec![4, 5],
            base_addr: 4096,
            len_bytes: 1 << 20,
        })
    }

    #[test]
    fn a_receiver_offers_its_data_path_only_to_senders_that_ask_and_refuses_what_it_cannot_serve() {
        let (layout, reg) = registration();
        let (stream_only, asks) = (
            Hello::new(&layout, false, Vec::new()),
            Hello::new(&layout, true, Vec::new()),
        );
        let offering = NegotiatingPath {
            offer: Some(some_offer()),
            inline: false,
        };
        let unmapped = NegotiatingPath {
            offer: None,
            inline: false,
        };
        assert_eq!(answer_hello(None, &reg, &stream_only).unwrap(), None);
        assert_eq!(
            answer_hello(Some(&offering), &reg, &stream_only).unwrap(),
            None
        );
        assert_eq!(
            answer_hello(Some(&offering), &reg, &asks).unwrap(),
            Some(some_offer())
        );
        for path in [None, Some(&unmapped as &dyn DataPath)] {
            let e = answer_hello(path, &reg, &asks).unwrap_err();
            assert_eq!(e.kind(), FailureKind::InvalidRequest);
        }
        // A sender on a GPU (CUDA IPC) that gets no offer keeps its bytes in the stream.
        let on_gpu = Hello::new(&layout, true, vec![7; 16]);
        for path in [None, Some(&unmapped as &dyn DataPath)] {
            assert_eq!(answer_hello(path, &reg, &on_gpu).unwrap(), None);
        }
    }

    #[tokio::test]
    async fn a_sender_opens_the_path_it_asked_for_and_refuses_any_other_answer() {
        let path = NegotiatingPath {
            offer: None,
            inline: false,
        };
        let falls_back = NegotiatingPath {
            offer: None,
            inline: true,
        };
        let with = HelloReply::accepted(7, 4, Some(some_offer()));
        let without = HelloReply::accepted(7, 4, None);
        assert!(open(None, "peer", &without, false).await.unwrap().is_none());
        // Asked and offered: the path connects (this one fails, which shows it was called).
        let e = open(Some(&path), "peer", &with, false).await.err().unwrap();
        assert!(matches!(e, TransferError::Shutdown));
        for (asked, reply) in [(None, &with), (Some(&path as &dyn DataPath), &without)] {
            let e = open(asked, "peer", reply, false).await.err().unwrap();
            assert_eq!(e.kind(), FailureKind::Protocol);
        }
        // A path that may fall back (CUDA IPC to another GPU) takes "no offer" as the stream.
        assert!(
            open(Some(&falls_back), "peer", &without, false)
                .await
                .unwrap()
                .is_none()
        );
        let mismatch = TransferError::LayoutMismatch {
            local: 1,
            remote: 2,
        };
        let refused = HelloReply::Refused(WireError::from_error(&mismatch));
        let e = open(None, "peer", &refused, false).await.err().unwrap();
        assert_eq!(e.kind(), FailureKind::LayoutMismatch);
    }
}

/// The `(source offset, destination offset)` of every slab of a chunk's `ranges`
/// `(src, dst, len)`, in payload order, for a path that writes into the receiver's pool itself
/// (a UCX mapping, a CUDA IPC mapping). A range that ends past `remote_len`, the receiver's
/// pool, is refused before any byte moves.
pub(crate) fn slab_pairs(
    ranges: &[(usize, usize, usize)],
    slab_bytes: usize,
    remote_len: u64,
) -> Result<Vec<(usize, usize)>, TransferError> {
    if ranges
        .iter()
        .any(|&(_, d, len)| (d + len) as u64 > remote_len)
    {
        return Err(TransferError::invalid(
            "dst_blocks",
            "range beyond the receiver's pool",
        ));
    }
    Ok(ranges
        .iter()
        .flat_map(|&(s, d, len)| (0..len).step_by(slab_bytes).map(move |k| (s + k, d + k)))
        .collect())
}
