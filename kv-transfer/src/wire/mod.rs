//! Wire descriptors (rkyv, zero-copy); their framing is in [`frame`].
//!
//! Every control message is one [`Msg`], archived with rkyv and sent as a frame:
//!
//! ```text
//! [body_len: u32 LE][rkyv body: body_len bytes]            control frame
//! [body_len][Chunk body][payload: chunk.payload_bytes]     chunk with inline data (TCP)
//! ```
//!
//! Anything received is read through the *checked* `rkyv::access` before a single field is
//! used (a frame over [`MAX_FRAME_BYTES`] is refused unread); only bytes this process wrote
//! itself would ever be accessed unchecked, and none are. Encoding reuses one aligned buffer per
//! connection, so the hot path (one `Chunk` per layer range) allocates nothing per block.
//!
//! # Conversation (sender = client, receiver = server)
//! ```text
//! Hello{layout, fingerprint, wants_data_path, device}  ->  HelloReply::Accepted{conn_id, offer} | Refused
//! Begin{reservation, epoch, blocks, ...} ->  BeginReply{refusal: None | Some(error)}
//! Chunk{layers, checksums} [+ payload]   ->  (nothing per chunk)
//!                                        <-  Done{block_checksums} | Abort{error}
//! Abort{error}  (sender gives up)        ->  (receiver releases the reservation)
//!                                        <-  Abort{error} (receiver gives up)
//! AbortAck                               ->  (sender confirms it writes no more)
//! ```

use rkyv::{Archive, Deserialize, Serialize};
use tandem_kv_layout::KvLayout;

use crate::error::{Phase, Side, TransferError};

mod frame;

pub use frame::{FrameReader, ReadError, encode_frame, frame_bytes, to_owned, write_frame};

/// Protocol version carried in [`Hello`]; a peer with another version is refused.
pub const PROTOCOL_VERSION: u32 = 2;

/// Largest control frame accepted (checksums of 64 Ki slabs fit with room to spare).
pub const MAX_FRAME_BYTES: usize = 4 << 20;

/// A layout as it crosses the wire (fixed-width integers, dtype by name).
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct WireLayout {
    /// `KvLayout::num_layers`.
    pub num_layers: u32,
    /// `KvLayout::num_kv_heads`.
    pub num_kv_heads: u32,
    /// `KvLayout::head_dim`.
    pub head_dim: u32,
    /// `KvLayout::block_size_tokens`.
    pub block_size_tokens: u32,
    /// `KvDtype::as_str()`.
    pub dtype: String,
    /// `KvLayout::model_fingerprint`.
    pub model_fingerprint: u64,
}

impl From<&KvLayout> for WireLayout {
    fn from(l: &KvLayout) -> Self {
        Self {
            num_layers: l.num_layers as u32,
            num_kv_heads: l.num_kv_heads as u32,
            head_dim: l.head_dim as u32,
            block_size_tokens: l.block_size_tokens as u32,
            dtype: l.dtype.as_str().to_string(),
            model_fingerprint: l.model_fingerprint,
        }
    }
}

impl WireLayout {
    /// Back to a [`KvLayout`], if the fields make one.
    pub fn to_layout(&self) -> Option<KvLayout> {
        KvLayout::new(
            self.num_layers as usize,
            self.num_kv_heads as usize,
            self.head_dim as usize,
            self.block_size_tokens as usize,
            self.dtype.parse().ok()?,
            self.model_fingerprint,
        )
        .ok()
    }
}

/// First frame of a connection, from the sender.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Hello {
    /// Must equal [`PROTOCOL_VERSION`].
    pub protocol_version: u32,
    /// The sender's pool layout.
    pub layout: WireLayout,
    /// `KvLayout::fingerprint()` of that layout.
    pub layout_fingerprint: u64,
    /// The sender wants block bytes to go over its data path (UCX, or CUDA IPC) rather than
    /// this stream.
    pub wants_data_path: bool,
    /// UUID of the GPU the sender's KV lives on (empty: none); a CUDA IPC receiver offers its
    /// pool only to a sender on its own GPU.
    pub device_uuid: Vec<u8>,
}

/// What the receiver hands a CUDA IPC sender (one on the same GPU) at connection setup.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct IpcRemote {
    /// UUID of the receiver's GPU (the sender checks it is its own).
    pub device_uuid: Vec<u8>,
    /// `cuIpcGetMemHandle` of the receiver's device pool (64 bytes).
    pub handle: Vec<u8>,
    /// Bytes of the receiver's device pool (its host pool's size: same layout and blocks).
    pub len_bytes: u64,
}

/// The receiver's data-path offer: how a sender reaches its pool outside the stream.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
pub enum DataOffer {
    /// UCX keys.
    Ucx(UcxRemote),
    /// A CUDA IPC handle of the receiver's device pool.
    CudaIpc(IpcRemote),
}

/// What the receiver hands a UCX sender at connection setup.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct UcxRemote {
    /// The receiver's UCP worker address (`ucp_worker_get_address`).
    pub worker_address: Vec<u8>,
    /// The receiver pool's packed remote key (`ucp_rkey_pack`).
    pub rkey: Vec<u8>,
    /// Base virtual address of the receiver's pool.
    pub base_addr: u64,
    /// Bytes of the receiver's pool.
    pub len_bytes: u64,
}

/// The receiver's answer to [`Hello`].
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
pub enum HelloReply {
    /// The layouts match; transfers may begin.
    Accepted {
        /// Receiver-chosen id of this connection (part of UCX tags).
        conn_id: u32,
        /// Blocks in the receiver's pool.
        pool_blocks: u32,
        /// The data path's offer, when the sender asked for one and the receiver made one
        /// (none: block bytes travel in this stream).
        offer: Option<DataOffer>,
    },
    /// Refused; the connection closes after this frame.
    Refused(WireError),
}

impl Hello {
    /// The sender's first frame for `layout`; `wants_data_path` asks for block bytes to travel
    /// over the data path (UCX, CUDA IPC) rather than this stream; `device_uuid` names the GPU
    /// its KV lives on (empty: none).
    pub(crate) fn new(layout: &KvLayout, wants_data_path: bool, device_uuid: Vec<u8>) -> Self {
        Self {
            protocol_version: PROTOCOL_VERSION,
            layout: WireLayout::from(layout),
            layout_fingerprint: layout.fingerprint(),
            wants_data_path,
            device_uuid,
        }
    }
}

impl HelloReply {
    /// Accepts a connection as `conn_id` into a pool of `pool_blocks` blocks, with the data
    /// path's `offer` when the sender asked for one.
    pub(crate) fn accepted(conn_id: u32, pool_blocks: u32, offer: Option<DataOffer>) -> Self {
        HelloReply::Accepted {
            conn_id,
            pool_blocks,
            offer,
        }
    }
}

/// How a transfer's block bytes travel.
#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum DataMode {
    /// In this stream, right after each `Chunk` frame.
    Inline,
    /// One-sided UCX puts into the receiver's pool, flushed before the `Chunk` frame.
    Rma,
    /// UCX tagged sends the receiver posts receives for on seeing the `Chunk` frame.
    Tag,
}

/// Asks the receiver to accept a transfer into one of its reservations.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Begin {
    /// Sender-chosen id, unique on this connection.
    pub transfer_id: u64,
    /// The request these blocks belong to (for logs and traces).
    pub request_id: u128,
    /// The sender's W3C `traceparent` for this transfer (empty: none), so the receiver's side
    /// joins the request's trace (linked to the sender's `kv.push` span).
    pub trace_context: String,
    /// The receiver's reservation.
    pub reservation_id: u64,
    /// The reservation's epoch as the sender was told it.
    pub epoch: u64,
    /// Fingerprint of the sender's layout.
    pub layout_fingerprint: u64,
    /// Source block ids (sender's pool).
    pub src_blocks: Vec<u32>,
    /// Destination block ids (receiver's pool), paired with `src_blocks` by position.
    pub dst_blocks: Vec<u32>,
    /// First layer the transfer covers.
    pub layer_start: u32,
    /// One past the last layer the transfer covers.
    pub layer_end: u32,
    /// How the bytes travel.
    pub mode: DataMode,
}

/// A run of layers of every block of the transfer; per-slab checksums, layer-major.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Chunk {
    /// The transfer.
    pub transfer_id: u64,
    /// 0, 1, 2, ... per transfer (UCX tags use it).
    pub seq: u32,
    /// First layer in this chunk.
    pub layer_start: u32,
    /// One past the last layer in this chunk.
    pub layer_end: u32,
    /// Bytes of block data this chunk carries (`layers × blocks × slab_bytes`).
    pub payload_bytes: u64,
    /// xxh3 of each slab, index `(layer - layer_start) * blocks + block_index`.
    pub checksums: Vec<u64>,
}

/// Why one side ended a transfer (or refused it), as sent to the other.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
pub enum WireError {
    /// Layouts differ (`local` is the refusing side's fingerprint).
    LayoutMismatch {
        /// Fingerprint of the refusing side.
        local: u64,
        /// Fingerprint the refusing side received.
        remote: u64,
    },
    /// No such reservation.
    UnknownReservation {
        /// The reservation id.
        reservation_id: u64,
    },
    /// Reservation reused with another epoch.
    StaleEpoch {
        /// The reservation id.
        reservation_id: u64,
        /// The receiver's epoch.
        current: u64,
        /// The descriptor's epoch.
        requested: u64,
    },
    /// Reservation expired.
    ReservationExpired {
        /// The reservation id.
        reservation_id: u64,
    },
    /// Reservation already claimed.
    ReservationBusy {
        /// The reservation id.
        reservation_id: u64,
    },
    /// A slab did not verify.
    ChecksumMismatch {
        /// Layer.
        layer: u32,
        /// Destination block id.
        block: u32,
        /// Sender's checksum.
        expected: u64,
        /// Checksum of what landed.
        actual: u64,
    },
    /// The side sending this cancelled.
    Cancelled,
    /// The side sending this ran out of time.
    DeadlineExceeded {
        /// The deadline it had, milliseconds.
        deadline_ms: u64,
    },
    /// The request was malformed.
    InvalidRequest {
        /// Field name.
        field: String,
        /// Why.
        reason: String,
    },
    /// Something else failed on the side sending this (its label and message).
    Failed {
        /// `FailureKind::as_str()` of the sender's error.
        kind: String,
        /// The sender's error message.
        detail: String,
    },
}

impl WireError {
    /// The wire form of a local error.
    pub fn from_error(e: &TransferError) -> Self {
        match e {
            TransferError::LayoutMismatch { local, remote } => WireError::LayoutMismatch {
                local: *local,
                remote: *remote,
            },
            TransferError::UnknownReservation { reservation_id } => WireError::UnknownReservation {
                reservation_id: *reservation_id,
            },
            TransferError::StaleEpoch {
                reservation_id,
                current,
                requested,
            } => WireError::StaleEpoch {
                reservation_id: *reservation_id,
                current: *current,
                requested: *requested,
            },
            TransferError::ReservationExpired { reservation_id } => WireError::ReservationExpired {
                reservation_id: *reservation_id,
            },
            TransferError::ReservationBusy { reservation_id } => WireError::ReservationBusy {
                reservation_id: *reservation_id,
            },
            TransferError::ChecksumMismatch {
                layer,
                block,
                expected,
                actual,
            } => WireError::ChecksumMismatch {
                layer: *layer,
                block: *block,
                expected: *expected,
                actual: *actual,
            },
            TransferError::Cancelled { .. } => WireError::Cancelled,
            TransferError::DeadlineExceeded { deadline, .. } => WireError::DeadlineExceeded {
                deadline_ms: deadline.as_millis() as u64,
            },
            TransferError::InvalidRequest { field, reason } => WireError::InvalidRequest {
                field: field.to_string(),
                reason: reason.clone(),
            },
            other => WireError::Failed {
                kind: other.kind().as_str().to_string(),
                detail: other.to_string(),
            },
        }
    }

    /// The local error for a `WireError` the peer sent (seen from this side).
    pub fn into_error(self, peer: &str, phase: Phase) -> TransferError {
        match self {
            // The peer's "local" is our "remote".
            WireError::LayoutMismatch { local, remote } => TransferError::LayoutMismatch {
                local: remote,
                remote: local,
            },
            WireError::UnknownReservation { reservation_id } => {
                TransferError::UnknownReservation { reservation_id }
            }
            WireError::StaleEpoch {
                reservation_id,
                current,
                requested,
            } => TransferError::StaleEpoch {
                reservation_id,
                current,
                requested,
            },
            WireError::ReservationExpired { reservation_id } => {
                TransferError::ReservationExpired { reservation_id }
            }
            WireError::ReservationBusy { reservation_id } => {
                TransferError::ReservationBusy { reservation_id }
            }
            WireError::ChecksumMismatch {
                layer,
                block,
                expected,
                actual,
            } => TransferError::ChecksumMismatch {
                layer,
                block,
                expected,
                actual,
            },
            WireError::Cancelled => TransferError::Cancelled { by: Side::Peer },
            WireError::DeadlineExceeded { deadline_ms } => TransferError::DeadlineExceeded {
                phase,
                deadline: std::time::Duration::from_millis(deadline_ms),
            },
            WireError::InvalidRequest { field, reason } => {
                TransferError::invalid("peer_refused", format!("{field}: {reason}"))
            }
            WireError::Failed { kind, detail }
                if kind == crate::error::FailureKind::Protocol.as_str() =>
            {
                TransferError::protocol("peer_refused", detail)
            }
            // The peer failed on its own side and has stopped touching the transfer.
            WireError::Failed { kind, detail } => {
                tracing::debug!(
                    peer,
                    kind,
                    detail,
                    "peer aborted the transfer after a local failure"
                );
                TransferError::PeerGone {
                    peer: peer.to_string(),
                    phase,
                    reason: std::io::ErrorKind::Other,
                }
            }
        }
    }
}

/// The receiver's answer to [`Begin`].
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct BeginReply {
    /// The transfer.
    pub transfer_id: u64,
    /// `None`: accepted; `Some`: refused, send nothing for this transfer.
    pub refusal: Option<WireError>,
}

/// Every layer of every block arrived and verified.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Done {
    /// The transfer.
    pub transfer_id: u64,
    /// Per-block checksum over layers (see `pool::block_checksum`), in `dst_blocks` order.
    pub block_checksums: Vec<u64>,
}

/// One side ends a transfer.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Abort {
    /// The transfer.
    pub transfer_id: u64,
    /// Why.
    pub error: WireError,
}

/// Every control message.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
pub enum Msg {
    /// See [`Hello`].
    Hello(Hello),
    /// See [`HelloReply`].
    HelloReply(HelloReply),
    /// See [`Begin`].
    Begin(Begin),
    /// See [`BeginReply`].
    BeginReply(BeginReply),
    /// See [`Chunk`].
    Chunk(Chunk),
    /// See [`Done`].
    Done(Done),
    /// See [`Abort`].
    Abort(Abort),
    /// The sender saw the receiver's `Abort` and will write nothing more for this transfer.
    AbortAck {
        /// The transfer.
        transfer_id: u64,
    },
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_kv_layout::KvDtype;

    #[test]
    fn wire_errors_keep_their_class_across_the_wire() {
        let e = TransferError::StaleEpoch {
            reservation_id: 1,
            current: 3,
            requested: 2,
        };
        let back = WireError::from_error(&e).into_error("peer", Phase::Begin);
        assert!(matches!(
            back,
            TransferError::StaleEpoch {
                reservation_id: 1,
                current: 3,
                requested: 2
            }
        ));
        let mism = WireError::from_error(&TransferError::LayoutMismatch {
            local: 1,
            remote: 2,
        });
        assert!(matches!(
            mism.into_error("p", Phase::Connect),
            TransferError::LayoutMismatch {
                local: 2,
                remote: 1
            }
        ));
        let cancelled = WireError::from_error(&TransferError::Cancelled { by: Side::Local });
        assert!(matches!(
            cancelled.into_error("p", Phase::Data),
            TransferError::Cancelled { by: Side::Peer }
        ));
    }

    #[test]
    fn wire_layout_round_trips_to_the_same_fingerprint() {
        let l = KvLayout::new(80, 8, 128, 16, KvDtype::Bf16, 42).unwrap();
        let back = WireLayout::from(&l).to_layout().unwrap();
        assert_eq!(back.fingerprint(), l.fingerprint());
    }
}
