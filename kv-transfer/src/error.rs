//! The crate's one error enum, classified once where the cause is known.
//!
//! Callers branch on [`TransferError::retry_safe`] and
//! [`TransferError::needs_new_reservation`], never on message text. The guide:
//!
//! | variant | what failed | retry safe | new reservation |
//! |---|---|---|---|
//! | `LayoutMismatch` | the two pools disagree on the KV layout | no (fails again) | – |
//! | `UnknownReservation`, `StaleEpoch`, `ReservationExpired` | the receiver no longer holds that reservation | yes | yes |
//! | `ReservationBusy` | another transfer already claimed it | no | – |
//! | `ChecksumMismatch` | bytes arrived garbled; blocks never marked ready | yes | no |
//! | `DeadlineExceeded`, `PeerGone`, `Connect`, `Io` | time or the connection ran out | yes | yes (the receiver may have dropped it) |
//! | `Cancelled` | someone asked to stop | no (the caller decided) | – |
//! | `InvalidRequest`, `Protocol`, `Ucx`, `Device`, `Shutdown` | a bug, a version skew or a local setup failure | no | – |
//! | `FenceTimeout` | a peer never confirmed it stopped writing | no: the blocks are suspect | – |
//!
//! "Retry safe" means: repeating the push (with a fresh reservation where the last column says
//! so) may succeed, and nothing of the failed attempt can still land in blocks handed to decode.

use std::fmt;
use std::time::Duration;

/// Which side of a transfer acted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// This process.
    Local,
    /// The other end of the transfer.
    Peer,
}

impl Side {
    /// A stable lowercase name for logs and labels.
    pub const fn as_str(self) -> &'static str {
        match self {
            Side::Local => "local",
            Side::Peer => "peer",
        }
    }
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The step a transfer was in when it failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Opening the connection and exchanging layouts (and UCX keys).
    Connect,
    /// Asking the receiver to accept the transfer into its reservation.
    Begin,
    /// Moving block bytes.
    Data,
    /// Waiting for the receiver to confirm every layer of every block.
    Completion,
}

impl Phase {
    /// A stable lowercase name for logs and labels.
    pub const fn as_str(self) -> &'static str {
        match self {
            Phase::Connect => "connect",
            Phase::Begin => "begin",
            Phase::Data => "data",
            Phase::Completion => "completion",
        }
    }
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Every way a transfer, a registration or a connection can fail.
#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    /// The sender's layout fingerprint differs from the receiver's; refused before any byte.
    #[error("KV layout mismatch: local fingerprint {local:016x}, peer {remote:016x}")]
    LayoutMismatch {
        /// Fingerprint of the pool on the side that refused.
        local: u64,
        /// Fingerprint the other side sent.
        remote: u64,
    },
    /// The receiver holds no reservation with this id (never made, or long gone).
    #[error("reservation {reservation_id} is unknown to the receiver")]
    UnknownReservation {
        /// The reservation the write was for.
        reservation_id: u64,
    },
    /// The reservation id was reused: the write carries an older (or newer) epoch.
    #[error(
        "reservation {reservation_id} is at epoch {current}, the write was for epoch {requested}"
    )]
    StaleEpoch {
        /// The reservation the write was for.
        reservation_id: u64,
        /// The epoch the receiver holds (or last held).
        current: u64,
        /// The epoch in the descriptor.
        requested: u64,
    },
    /// The reservation's time ran out before every layer of every block arrived.
    #[error("reservation {reservation_id} expired")]
    ReservationExpired {
        /// The reservation that expired.
        reservation_id: u64,
    },
    /// Another transfer has already claimed this reservation.
    #[error("reservation {reservation_id} already has a transfer in progress")]
    ReservationBusy {
        /// The reservation in question.
        reservation_id: u64,
    },
    /// A (layer, block) slab arrived with bytes that do not match the sender's checksum.
    #[error(
        "checksum mismatch at layer {layer}, destination block {block}: expected {expected:016x}, got {actual:016x}"
    )]
    ChecksumMismatch {
        /// Layer of the slab.
        layer: u32,
        /// Destination block id of the slab.
        block: u32,
        /// xxh3 the sender computed over its source slab.
        expected: u64,
        /// xxh3 of the bytes that landed.
        actual: u64,
    },
    /// The transfer's deadline passed.
    #[error("transfer deadline of {deadline:?} passed during {phase}")]
    DeadlineExceeded {
        /// What the transfer was doing.
        phase: Phase,
        /// The deadline it was given.
        deadline: Duration,
    },
    /// Cancelled by a token, a dropped handle or the peer's abort.
    #[error("transfer cancelled by the {by} side")]
    Cancelled {
        /// Who cancelled.
        by: Side,
    },
    /// The connection broke or the peer process went away.
    #[error("peer {peer} went away during {phase}: {reason:?}")]
    PeerGone {
        /// The peer's address.
        peer: String,
        /// What the transfer was doing.
        phase: Phase,
        /// The I/O condition that showed it (`UnexpectedEof`, `ConnectionReset`, ...).
        reason: std::io::ErrorKind,
    },
    /// Could not open a connection to the peer.
    #[error("cannot connect to {peer}: {source}")]
    Connect {
        /// The address dialled.
        peer: String,
        /// Why it failed.
        #[source]
        source: std::io::Error,
    },
    /// The request itself is wrong (block out of range, lengths differ, ...): a caller bug.
    #[error("invalid transfer request: `{field}` {reason}")]
    InvalidRequest {
        /// The offending field.
        field: &'static str,
        /// Why it is invalid.
        reason: String,
    },
    /// The peer sent something this protocol version does not allow.
    #[error("protocol violation ({what}): {detail}")]
    Protocol {
        /// Which check failed.
        what: &'static str,
        /// Details for the log.
        detail: String,
    },
    /// A local UCX call failed.
    #[error("UCX {op} failed: {message} (status {status})")]
    Ucx {
        /// The UCP function.
        op: &'static str,
        /// The `ucs_status_t` value.
        status: i32,
        /// `ucs_status_string(status)`.
        message: String,
    },
    /// A local GPU call of the CUDA IPC path failed (open a peer's pool, copy, hash).
    #[error("GPU {op} failed: {message}")]
    Device {
        /// What was being done.
        op: &'static str,
        /// The device error, rendered.
        message: String,
    },
    /// A local I/O call failed outside any transfer's connection (bind, spawn, ...).
    #[error("{op}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The transport (or its UCX progress thread) has shut down.
    #[error("transport shut down")]
    Shutdown,
    /// A one-sided writer never confirmed it stopped after an abort; its blocks stay suspect.
    #[error("reservation {reservation_id}: peer did not confirm the abort within {waited:?}")]
    FenceTimeout {
        /// The reservation whose blocks may still be written.
        reservation_id: u64,
        /// How long the receiver waited.
        waited: Duration,
    },
}

/// A low-cardinality failure class: the metrics label of a [`TransferError`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FailureKind {
    /// [`TransferError::LayoutMismatch`].
    LayoutMismatch,
    /// [`TransferError::UnknownReservation`].
    UnknownReservation,
    /// [`TransferError::StaleEpoch`].
    StaleEpoch,
    /// [`TransferError::ReservationExpired`].
    ReservationExpired,
    /// [`TransferError::ReservationBusy`].
    ReservationBusy,
    /// [`TransferError::ChecksumMismatch`].
    ChecksumMismatch,
    /// [`TransferError::DeadlineExceeded`].
    DeadlineExceeded,
    /// [`TransferError::Cancelled`].
    Cancelled,
    /// [`TransferError::PeerGone`].
    PeerGone,
    /// [`TransferError::Connect`].
    Connect,
    /// [`TransferError::InvalidRequest`].
    InvalidRequest,
    /// [`TransferError::Protocol`].
    Protocol,
    /// [`TransferError::Ucx`].
    Ucx,
    /// [`TransferError::Io`].
    Io,
    /// [`TransferError::Device`].
    Device,
    /// [`TransferError::Shutdown`].
    Shutdown,
    /// [`TransferError::FenceTimeout`].
    FenceTimeout,
}

impl FailureKind {
    /// Every kind, in a fixed order (the index of a kind's counter).
    pub const ALL: [FailureKind; 17] = [
        FailureKind::LayoutMismatch,
        FailureKind::UnknownReservation,
        FailureKind::StaleEpoch,
        FailureKind::ReservationExpired,
        FailureKind::ReservationBusy,
        FailureKind::ChecksumMismatch,
        FailureKind::DeadlineExceeded,
        FailureKind::Cancelled,
        FailureKind::PeerGone,
        FailureKind::Connect,
        FailureKind::InvalidRequest,
        FailureKind::Protocol,
        FailureKind::Ucx,
        FailureKind::Io,
        FailureKind::Device,
        FailureKind::Shutdown,
        FailureKind::FenceTimeout,
    ];

    /// The metrics label value.
    pub const fn as_str(self) -> &'static str {
        match self {
            FailureKind::LayoutMismatch => "layout_mismatch",
            FailureKind::UnknownReservation => "unknown_reservation",
            FailureKind::StaleEpoch => "stale_epoch",
            FailureKind::ReservationExpired => "reservation_expired",
            FailureKind::ReservationBusy => "reservation_busy",
            FailureKind::ChecksumMismatch => "checksum_mismatch",
            FailureKind::DeadlineExceeded => "deadline_exceeded",
            FailureKind::Cancelled => "cancelled",
            FailureKind::PeerGone => "peer_gone",
            FailureKind::Connect => "connect",
            FailureKind::InvalidRequest => "invalid_request",
            FailureKind::Protocol => "protocol",
            FailureKind::Ucx => "ucx",
            FailureKind::Io => "io",
            FailureKind::Device => "device",
            FailureKind::Shutdown => "shutdown",
            FailureKind::FenceTimeout => "fence_timeout",
        }
    }

    /// Position in [`FailureKind::ALL`].
    pub const fn index(self) -> usize {
        self as usize
    }
}

impl TransferError {
    /// The failure class, for metrics and for matching without caring about fields.
    pub const fn kind(&self) -> FailureKind {
        match self {
            TransferError::LayoutMismatch { .. } => FailureKind::LayoutMismatch,
            TransferError::UnknownReservation { .. } => FailureKind::UnknownReservation,
            TransferError::StaleEpoch { .. } => FailureKind::StaleEpoch,
            TransferError::ReservationExpired { .. } => FailureKind::ReservationExpired,
            TransferError::ReservationBusy { .. } => FailureKind::ReservationBusy,
            TransferError::ChecksumMismatch { .. } => FailureKind::ChecksumMismatch,
            TransferError::DeadlineExceeded { .. } => FailureKind::DeadlineExceeded,
            TransferError::Cancelled { .. } => FailureKind::Cancelled,
            TransferError::PeerGone { .. } => FailureKind::PeerGone,
            TransferError::Connect { .. } => FailureKind::Connect,
            TransferError::InvalidRequest { .. } => FailureKind::InvalidRequest,
            TransferError::Protocol { .. } => FailureKind::Protocol,
            TransferError::Ucx { .. } => FailureKind::Ucx,
            TransferError::Io { .. } => FailureKind::Io,
            TransferError::Device { .. } => FailureKind::Device,
            TransferError::Shutdown => FailureKind::Shutdown,
            TransferError::FenceTimeout { .. } => FailureKind::FenceTimeout,
        }
    }

    /// True when repeating the push may succeed and nothing of this attempt can still land in
    /// blocks handed to decode (see the table in the module docs).
    pub const fn retry_safe(&self) -> bool {
        matches!(
            self.kind(),
            FailureKind::UnknownReservation
                | FailureKind::StaleEpoch
                | FailureKind::ReservationExpired
                | FailureKind::ChecksumMismatch
                | FailureKind::DeadlineExceeded
                | FailureKind::PeerGone
                | FailureKind::Connect
                | FailureKind::Io
        )
    }

    /// True when a retry needs a fresh reservation from the receiver first.
    pub const fn needs_new_reservation(&self) -> bool {
        matches!(
            self.kind(),
            FailureKind::UnknownReservation
                | FailureKind::StaleEpoch
                | FailureKind::ReservationExpired
                | FailureKind::DeadlineExceeded
                | FailureKind::PeerGone
                | FailureKind::Connect
                | FailureKind::Io
        )
    }

    /// Shorthand for a protocol violation.
    pub(crate) fn protocol(what: &'static str, detail: impl Into<String>) -> Self {
        TransferError::Protocol {
            what,
            detail: detail.into(),
        }
    }

    /// Shorthand for an invalid request.
    pub(crate) fn invalid(field: &'static str, reason: impl Into<String>) -> Self {
        TransferError::InvalidRequest {
            field,
            reason: reason.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failure_kinds_index_their_own_slot_and_have_distinct_labels() {
        for (i, k) in FailureKind::ALL.iter().enumerate() {
            assert_eq!(k.index(), i, "{k:?}");
        }
        let mut labels: Vec<_> = FailureKind::ALL.iter().map(|k| k.as_str()).collect();
        labels.sort();
        labels.dedup();
        assert_eq!(labels.len(), FailureKind::ALL.len());
    }

    #[test]
    fn garbled_bytes_are_retry_safe_but_layout_mismatch_and_fence_timeout_are_not() {
        let garbled = TransferError::ChecksumMismatch {
            layer: 1,
            block: 2,
            expected: 3,
            actual: 4,
        };
        assert!(garbled.retry_safe());
        assert!(!garbled.needs_new_reservation());
        assert!(
            !TransferError::LayoutMismatch {
                local: 1,
                remote: 2
            }
            .retry_safe()
        );
        let fence = TransferError::FenceTimeout {
            reservation_id: 1,
            waited: Duration::ZERO,
        };
        assert!(!fence.retry_safe());
        let expired = TransferError::ReservationExpired { reservation_id: 9 };
        assert!(expired.retry_safe() && expired.needs_new_reservation());
        assert!(!TransferError::Cancelled { by: Side::Peer }.retry_safe());
    }
}
