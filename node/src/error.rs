//! The node crate's one boundary error, [`NodeError`]: what failed while a node started, served or
//! stopped. Each variant names the step; conversion to `tonic::Status` happens only in
//! [`status`](crate::status), for errors a request can meet.

use std::path::PathBuf;

use tandem_cluster::ClusterError;
use tandem_engine::EngineError;
use tandem_kv_transfer::TransferError;

/// Everything a node can fail with outside a request's own status.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// A flag or config value is invalid (or missing: `value` is empty).
    #[error("{}", if value.is_empty() { format!("{flag} {reason}") } else { format!("invalid {flag} `{value}`: {reason}") })]
    InvalidConfig {
        /// The flag, as typed (`--etcd-endpoints`).
        flag: &'static str,
        /// The value given (empty when missing).
        value: String,
        /// Why it is refused.
        reason: String,
    },
    /// The model could not be fetched or loaded, or the engine refused its settings.
    #[error("engine: {0}")]
    Engine(#[source] EngineError),
    /// The default model could not be fetched into the cache.
    #[error("fetching the default model into {path}: {reason}")]
    ModelFetch {
        /// Where it should have gone.
        path: PathBuf,
        /// What went wrong (pip, network, hash).
        reason: String,
    },
    /// The KV transport could not start or allocate the pool.
    #[error("KV transport ({transport}): {source}")]
    Transport {
        /// `ucx` or `tcp`.
        transport: &'static str,
        /// The transport's error.
        #[source]
        source: TransferError,
    },
    /// Binding a listener failed.
    #[error("binding {what} on {addr}: {source}")]
    Bind {
        /// `gRPC` or `KV transfer`.
        what: &'static str,
        /// The address asked for.
        addr: std::net::SocketAddr,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The cluster refused this node's KV layout (another model, dtype or block size is
    /// registered): the node must not serve.
    #[error(
        "{0}; start this node with the cluster's model, --kv-dtype and --block-size, or drain the cluster first"
    )]
    LayoutRefused(#[source] ClusterError),
    /// Registering in etcd, connecting to NATS or deregistering failed.
    #[error("control plane ({step}): {source}")]
    Cluster {
        /// What was being done: `register`, `nats connect`, ...
        step: &'static str,
        /// The cluster crate's error.
        #[source]
        source: ClusterError,
    },
    /// The engine thread stopped (it panicked, or the node is shutting down).
    #[error("the engine thread has stopped")]
    EngineStopped,

    /// The node could not go on serving (its engine thread died, its KV receiver stopped): it
    /// left the cluster (record deleted, lease revoked) and exits non-zero.
    #[error("{what} failed: {reason}; the node left the cluster")]
    Fatal {
        /// What died.
        what: &'static str,
        /// Why, as far as known.
        reason: String,
    },
    /// The engine thread could not be started.
    #[error("starting the engine thread: {0}")]
    Thread(#[source] std::io::Error),
    /// The gRPC server failed.
    #[error("gRPC server: {0}")]
    Grpc(#[source] tonic::transport::Error),
}

impl NodeError {
    /// A low-cardinality label for metrics and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            NodeError::InvalidConfig { .. } => "invalid_config",
            NodeError::Engine(_) => "engine",
            NodeError::ModelFetch { .. } => "model_fetch",
            NodeError::Transport { .. } => "transport",
            NodeError::Bind { .. } => "bind",
            NodeError::LayoutRefused(_) => "layout_refused",
            NodeError::Cluster { .. } => "cluster",
            NodeError::EngineStopped => "engine_stopped",
            NodeError::Thread(_) => "thread",
            NodeError::Grpc(_) => "grpc",
            NodeError::Fatal { .. } => "fatal",
        }
    }
}
