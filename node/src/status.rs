//! Request errors → `tonic::Status`, classified once here so the router can branch on codes and
//! metadata, never on message text.
//!
//! Every status a node returns for a request carries two metadata keys:
//! - `tandem-error-kind`: a low-cardinality label (`checksum_mismatch`, `overloaded`, ...);
//! - `tandem-retry-safe`: `true` when repeating the same step (with a fresh reservation where
//!   the code says so) may succeed and nothing of the failed attempt can still affect it.
//!
//! | cause | code | retry safe |
//! |---|---|---|
//! | bad request (field named in the message) | INVALID_ARGUMENT | no |
//! | queue full, no free blocks | RESOURCE_EXHAUSTED | yes (another node, or later) |
//! | node draining or stopping, engine gone | UNAVAILABLE | yes (another node) |
//! | layout fingerprint mismatch | FAILED_PRECONDITION | no |
//! | unknown/expired reservation, wrong epoch | NOT_FOUND / FAILED_PRECONDITION | yes, with a new reservation |
//! | KV arrived corrupt or incomplete (decode side) | DATA_LOSS | yes: re-prefill into a new reservation |
//! | push failed retry-safely (prefill side) | UNAVAILABLE (ABORTED when a new reservation is needed) | yes |
//! | push cancelled | CANCELLED | no (the caller decided) |
//! | anything else (bugs, setup) | INTERNAL | no |

use tandem_engine::EngineError;
use tandem_kv_transfer::{FailureKind, TransferError};
use tonic::{Code, Status};

/// Metadata key of the error label.
pub const ERROR_KIND_KEY: &str = "tandem-error-kind";
/// Metadata key of the retry-safety flag.
pub const RETRY_SAFE_KEY: &str = "tandem-retry-safe";

/// A status with the two classification keys set.
pub fn status(
    code: Code,
    message: impl Into<String>,
    kind: &'static str,
    retry_safe: bool,
) -> Status {
    let mut s = Status::new(code, message);
    let md = s.metadata_mut();
    md.insert(
        ERROR_KIND_KEY,
        tonic::metadata::MetadataValue::from_static(kind),
    );
    md.insert(
        RETRY_SAFE_KEY,
        tonic::metadata::MetadataValue::from_static(if retry_safe { "true" } else { "false" }),
    );
    s
}

/// The error label a status carries (`None` if it was not made here).
pub fn error_kind(s: &Status) -> Option<&str> {
    s.metadata()
        .get(ERROR_KIND_KEY)
        .and_then(|v| v.to_str().ok())
}

/// Whether a status says a retry is safe (false if it does not say).
pub fn is_retry_safe(s: &Status) -> bool {
    s.metadata()
        .get(RETRY_SAFE_KEY)
        .and_then(|v| v.to_str().ok())
        == Some("true")
}

/// The status of an engine error met while serving a request.
pub fn engine_status(e: &EngineError) -> Status {
    let kind = e.error_type();
    match e {
        EngineError::QueueFull { .. } | EngineError::OutOfBlocks { .. } => {
            status(Code::ResourceExhausted, e.to_string(), kind, true)
        }
        EngineError::UnknownReservation(_) => status(Code::NotFound, e.to_string(), kind, true),
        e if e.is_invalid_request() => status(Code::InvalidArgument, e.to_string(), kind, false),
        e => status(Code::Internal, e.to_string(), kind, false),
    }
}

/// The status of a failed KV push, as the prefill node reports it.
pub fn push_status(e: &TransferError) -> Status {
    let kind = e.kind().as_str();
    let msg = format!("KV push failed: {e}");
    match e.kind() {
        FailureKind::LayoutMismatch => status(Code::FailedPrecondition, msg, kind, false),
        FailureKind::Cancelled => status(Code::Cancelled, msg, kind, false),
        FailureKind::ChecksumMismatch => status(Code::DataLoss, msg, kind, true),
        _ if e.needs_new_reservation() => status(Code::Aborted, msg, kind, e.retry_safe()),
        _ if e.retry_safe() => status(Code::Unavailable, msg, kind, true),
        _ => status(Code::Internal, msg, kind, false),
    }
}

/// The status of KV that did not arrive intact, as the decode node reports it: DATA_LOSS for
/// anything retry-safe (the router re-prefills into a new reservation), INTERNAL otherwise.
pub fn inbound_status(e: &TransferError) -> Status {
    let kind = e.kind().as_str();
    match e.kind() {
        FailureKind::Cancelled => status(
            Code::Cancelled,
            format!("KV transfer cancelled: {e}"),
            kind,
            false,
        ),
        _ if e.retry_safe() => status(
            Code::DataLoss,
            format!("KV did not arrive intact, nothing was decoded: {e}"),
            kind,
            true,
        ),
        _ => status(
            Code::Internal,
            format!("KV transfer failed, nothing was decoded: {e}"),
            kind,
            false,
        ),
    }
}

/// UNAVAILABLE because the node is draining or stopping (retry on another node).
pub fn unavailable(why: &str) -> Status {
    status(Code::Unavailable, why.to_string(), "unavailable", true)
}

/// INVALID_ARGUMENT naming `field`.
pub fn invalid(field: &'static str, reason: impl std::fmt::Display) -> Status {
    status(
        Code::InvalidArgument,
        format!("invalid `{field}`: {reason}"),
        "invalid_request",
        false,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn corrupt_kv_is_data_loss_and_retry_safe_on_both_sides() {
        let e = TransferError::ChecksumMismatch {
            layer: 0,
            block: 1,
            expected: 2,
            actual: 3,
        };
        for s in [push_status(&e), inbound_status(&e)] {
            assert_eq!(s.code(), Code::DataLoss);
            assert!(is_retry_safe(&s));
            assert_eq!(error_kind(&s), Some("checksum_mismatch"));
        }
    }

    #[test]
    fn layout_mismatch_is_a_precondition_that_retrying_cannot_fix() {
        let s = push_status(&TransferError::LayoutMismatch {
            local: 1,
            remote: 2,
        });
        assert_eq!(s.code(), Code::FailedPrecondition);
        assert!(!is_retry_safe(&s));
        let expired = push_status(&TransferError::ReservationExpired { reservation_id: 4 });
        assert_eq!(expired.code(), Code::Aborted);
        assert!(is_retry_safe(&expired));
    }

    #[test]
    fn engine_errors_split_into_caller_mistakes_and_overload() {
        let full = engine_status(&EngineError::OutOfBlocks {
            requested_blocks: 3,
            free_blocks: 1,
        });
        assert_eq!(full.code(), Code::ResourceExhausted);
        assert!(is_retry_safe(&full));
        let bad = engine_status(&EngineError::ContextOverflow {
            prompt_tokens: 9000,
            max_new_tokens: 1,
            max_context_tokens: 8192,
        });
        assert_eq!(bad.code(), Code::InvalidArgument);
        assert!(!is_retry_safe(&bad));
        assert_eq!(error_kind(&bad), Some("context_overflow"));
    }
}
