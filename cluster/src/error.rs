//! The crate's one error type, [`ClusterError`].
//!
//! A variant says *what failed* (which backend, which operation, which node), never what the
//! caller should do about it. [`ClusterError::is_retryable`] classifies once, where the cause is
//! known: a lost connection or a timeout is worth retrying, a layout mismatch or a bad name is
//! not. [`ClusterError::kind`] gives a low-cardinality label for metrics.

use std::time::Duration;

use crate::node::Role;

/// Everything that can go wrong in the control plane.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// An etcd request failed (transport, gRPC status or client error).
    #[error("etcd {op} failed: {source}")]
    Etcd {
        /// The operation, e.g. `"lease grant"`, `"register txn"`.
        op: &'static str,
        /// The client's error (boxed: it is large).
        #[source]
        source: Box<etcd_client::Error>,
    },
    /// An etcd request did not answer in time (etcd down, partitioned or overloaded).
    #[error("etcd {op} timed out after {after:?}")]
    EtcdTimeout {
        /// The operation that timed out.
        op: &'static str,
        /// The limit it ran under.
        after: Duration,
    },
    /// A register transaction kept losing races on the cluster's layout key.
    #[error("etcd {op}: gave up after {attempts} conflicting attempts")]
    EtcdConflict {
        /// The operation.
        op: &'static str,
        /// How many transactions were tried.
        attempts: u32,
    },
    /// A NATS operation failed.
    #[error("NATS {op} failed: {source}")]
    Nats {
        /// The operation, e.g. `"connect"`, `"publish"`, `"subscribe"`.
        op: &'static str,
        /// The client's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The service is not reachable right now (not connected, or an in-process bus switched
    /// off); nothing was sent.
    #[error("{service} unavailable for {op}: not connected")]
    Unavailable {
        /// `"nats"`, `"etcd"` or `"memory"`.
        service: &'static str,
        /// The operation that was skipped.
        op: &'static str,
    },
    /// The node's KV layout differs from the one the cluster's registered nodes use.
    #[error(
        "node {node_id} refused by cluster {cluster}: KV layout fingerprint {got:016x} differs \
         from the cluster's {expected:016x}"
    )]
    LayoutMismatch {
        /// The cluster name.
        cluster: String,
        /// The node that was refused.
        node_id: String,
        /// The cluster's layout fingerprint.
        expected: u64,
        /// The refused node's layout fingerprint.
        got: u64,
    },
    /// A node with this id and role is already registered (a live holder, or a dead holder
    /// whose lease has not yet expired).
    #[error("node {node_id} is already registered as {role} in cluster {cluster}")]
    NodeExists {
        /// The cluster name.
        cluster: String,
        /// The role the id is registered under.
        role: Role,
        /// The node id.
        node_id: String,
    },
    /// A cluster name, node id or role string cannot be used.
    #[error("invalid {what} `{value}`: {reason}")]
    InvalidName {
        /// What the string names: `"cluster"`, `"node id"`, `"role"`.
        what: &'static str,
        /// The offending value.
        value: String,
        /// Why it was refused.
        reason: &'static str,
    },
    /// A [`NodeInfo`](crate::NodeInfo) field is inconsistent.
    #[error("invalid node info for `{node_id}`: `{field}` {reason}")]
    InvalidNodeInfo {
        /// The node id.
        node_id: String,
        /// The offending field.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// An etcd key or NATS subject does not follow the scheme in [`keys`](crate::keys).
    #[error("malformed {what} `{value}`: {reason}")]
    MalformedAddress {
        /// `"etcd key"` or `"NATS subject"` or `"segment"`.
        what: &'static str,
        /// The offending key or subject.
        value: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A value could not be encoded to, or decoded from, JSON.
    #[error("could not {op} JSON at `{at}`: {source}")]
    Serde {
        /// `"encode"` or `"decode"`.
        op: &'static str,
        /// The etcd key or NATS subject the value belongs to.
        at: String,
        /// serde_json's error.
        #[source]
        source: serde_json::Error,
    },
    /// A registration's background task has stopped (its runtime shut down, or it was
    /// deregistered already).
    #[error("registration of node {node_id} is closed")]
    RegistrationClosed {
        /// The node id.
        node_id: String,
    },
    /// A pool size outside the pool's limits (or limits with min above max).
    #[error("{role} pool size {asked} refused: its limits are min {min}, max {max}")]
    ScaleRefused {
        /// The pool.
        role: Role,
        /// The size asked for.
        asked: usize,
        /// The pool's minimum.
        min: usize,
        /// The pool's maximum.
        max: usize,
    },
    /// No node of that role and id is registered.
    #[error("no {role} node `{node_id}` is registered")]
    UnknownNode {
        /// The role asked for.
        role: Role,
        /// The node id asked for.
        node_id: String,
    },
    /// A TLS certificate, key or CA file cannot be used.
    #[error("TLS: {}: {reason}", path.display())]
    TlsFile {
        /// The file.
        path: std::path::PathBuf,
        /// What is wrong with it.
        reason: String,
    },
}

impl ClusterError {
    /// Whether the same call may succeed later without anyone changing its inputs.
    ///
    /// True for lost connections, timeouts, conflicts and [`ClusterError::NodeExists`] (a dead
    /// holder's key goes away when its lease expires); false for refusals and bad input.
    pub fn is_retryable(&self) -> bool {
        match self {
            ClusterError::Etcd { source, .. } => etcd_error_is_retryable(source),
            ClusterError::EtcdTimeout { .. }
            | ClusterError::EtcdConflict { .. }
            | ClusterError::Nats { .. }
            | ClusterError::Unavailable { .. }
            | ClusterError::NodeExists { .. } => true,
            ClusterError::LayoutMismatch { .. }
            | ClusterError::InvalidName { .. }
            | ClusterError::InvalidNodeInfo { .. }
            | ClusterError::MalformedAddress { .. }
            | ClusterError::Serde { .. }
            | ClusterError::RegistrationClosed { .. }
            | ClusterError::UnknownNode { .. }
            | ClusterError::TlsFile { .. }
            | ClusterError::ScaleRefused { .. } => false,
        }
    }

    /// A low-cardinality label for metrics and structured logs.
    pub fn kind(&self) -> &'static str {
        match self {
            ClusterError::Etcd { .. } => "etcd",
            ClusterError::EtcdTimeout { .. } => "etcd_timeout",
            ClusterError::EtcdConflict { .. } => "etcd_conflict",
            ClusterError::Nats { .. } => "nats",
            ClusterError::Unavailable { .. } => "unavailable",
            ClusterError::LayoutMismatch { .. } => "layout_mismatch",
            ClusterError::NodeExists { .. } => "node_exists",
            ClusterError::InvalidName { .. } => "invalid_name",
            ClusterError::InvalidNodeInfo { .. } => "invalid_node_info",
            ClusterError::MalformedAddress { .. } => "malformed_address",
            ClusterError::Serde { .. } => "serde",
            ClusterError::RegistrationClosed { .. } => "registration_closed",
            ClusterError::UnknownNode { .. } => "unknown_node",
            ClusterError::ScaleRefused { .. } => "scale_refused",
            ClusterError::TlsFile { .. } => "tls_file",
        }
    }

    pub(crate) fn etcd(op: &'static str, source: etcd_client::Error) -> Self {
        ClusterError::Etcd {
            op,
            source: Box::new(source),
        }
    }

    pub(crate) fn nats(
        op: &'static str,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        ClusterError::Nats {
            op,
            source: Box::new(source),
        }
    }
}

/// Transport trouble and server-side unavailability are retryable; bad arguments are not.
fn etcd_error_is_retryable(e: &etcd_client::Error) -> bool {
    use etcd_client::Error as E;
    match e {
        E::TransportError(_)
        | E::IoError(_)
        | E::WatchError(_)
        | E::LeaseKeepAliveError(_)
        | E::EndpointError(_) => true,
        E::GRpcStatus(status) => {
            // Compared as wire codes so this crate need not name tonic's `Code` type.
            let code: i32 = status.code().into();
            matches!(
                code,
                GRPC_CANCELLED
                    | GRPC_UNKNOWN
                    | GRPC_DEADLINE_EXCEEDED
                    | GRPC_RESOURCE_EXHAUSTED
                    | GRPC_ABORTED
                    | GRPC_INTERNAL
                    | GRPC_UNAVAILABLE
            )
        }
        _ => false,
    }
}

// gRPC status codes (grpc/doc/statuscodes.md) that mean "the server could not answer now".
const GRPC_CANCELLED: i32 = 1;
const GRPC_UNKNOWN: i32 = 2;
const GRPC_DEADLINE_EXCEEDED: i32 = 4;
const GRPC_RESOURCE_EXHAUSTED: i32 = 8;
const GRPC_ABORTED: i32 = 10;
const GRPC_INTERNAL: i32 = 13;
const GRPC_UNAVAILABLE: i32 = 14;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_are_not_retryable_but_outages_are() {
        let mismatch = ClusterError::LayoutMismatch {
            cluster: "c".into(),
            node_id: "n".into(),
            expected: 1,
            got: 2,
        };
        assert!(!mismatch.is_retryable());
        assert_eq!(mismatch.kind(), "layout_mismatch");
        let timeout = ClusterError::EtcdTimeout {
            op: "get",
            after: Duration::from_secs(1),
        };
        assert!(timeout.is_retryable());
        let exists = ClusterError::NodeExists {
            cluster: "c".into(),
            role: Role::Decode,
            node_id: "n".into(),
        };
        assert!(
            exists.is_retryable(),
            "a dead holder's key expires with its lease"
        );
        let bad = ClusterError::etcd("get", etcd_client::Error::InvalidArgs("x".into()));
        assert!(!bad.is_retryable());
        let io = ClusterError::etcd(
            "get",
            etcd_client::Error::IoError(std::io::Error::other("reset")),
        );
        assert!(io.is_retryable());
    }

    #[test]
    fn layout_mismatch_message_names_cluster_node_and_both_fingerprints() {
        let e = ClusterError::LayoutMismatch {
            cluster: "prod".into(),
            node_id: "decode-7".into(),
            expected: 0xabc,
            got: 0xdef,
        };
        let msg = e.to_string();
        for part in ["prod", "decode-7", "0000000000000abc", "0000000000000def"] {
            assert!(msg.contains(part), "{msg} lacks {part}");
        }
    }
}
