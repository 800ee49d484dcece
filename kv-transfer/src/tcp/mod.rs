//! TCP transport (tokio), and the stream protocol the UCX transport reuses for its control path.
//!
//! ```text
//!  sender process                                         receiver process
//!  push() ─▶ transfer task ──cmds──▶ writer task ══TCP══▶ connection task ─▶ InboundRegistry
//!               ▲  (checksums,          (writev: frame +    (frames; inline payload read
//!               │   chunk plan)          slab slices)        straight into dst slabs; verify)
//!               └──events── reader task ◀═════════════════ writer task (BeginReply/Done/Abort)
//! ```
//!
//! One connection per (peer, layout) is opened on first use and shared by every push to that
//! peer; transfers interleave on it at chunk granularity. With a data path (UCX), the same
//! connection carries only control frames and block bytes go over that path (one-sided puts, or
//! tagged sends over tcp).
//!
//! This module calls a data path only through the traits of `crate::datapath`, set in
//! `NetShared::data_path` by the transport that owns one; it never names the UCX module, which
//! builds on this one (the dependency runs one way).
//!
//! # Costs (TCP data path)
//! Sender: one xxh3 pass over each source slab, then `writev` of the frame and the slab ranges
//! straight from the pool (the kernel's copy is the only one; no per-block allocation).
//! Receiver: `read` straight into the destination slabs, then one xxh3 pass per slab.

mod client;
mod conn;
mod receive;
mod server;

use std::collections::HashMap;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::config::TransferConfig;
use crate::datapath::DataPath;
use crate::error::TransferError;
use crate::inbound::InboundRegistry;
use crate::metrics::TransferMetrics;
use crate::pool::KvPool;
use crate::transport::{
    KvTransport, OutboundTransfer, PoolRegistration, PushRequest, TransferCapabilities,
};

pub(crate) use conn::ClientConn;

/// State shared by a network transport's senders and servers.
pub(crate) struct NetShared {
    pub config: TransferConfig,
    pub metrics: Arc<TransferMetrics>,
    pub conns: tokio::sync::Mutex<HashMap<(String, u64), Arc<ClientConn>>>,
    /// Where block bytes go besides the stream (UCX, or CUDA IPC), when this transport has
    /// such a path: set once, before the first connection (UCX at construction, CUDA IPC when
    /// the node's engine has its device pool).
    pub data_path: std::sync::OnceLock<Arc<dyn DataPath>>,
}

impl NetShared {
    pub fn new(config: TransferConfig) -> Result<Self, TransferError> {
        config.validate()?;
        Ok(Self {
            config,
            metrics: TransferMetrics::new(),
            conns: tokio::sync::Mutex::new(HashMap::new()),
            data_path: std::sync::OnceLock::new(),
        })
    }

    /// The data path, if this transport has one.
    pub fn data_path(&self) -> Option<&dyn DataPath> {
        self.data_path.get().map(|p| p.as_ref())
    }

    /// Starts a push on a network transport.
    pub fn push(
        self: &Arc<Self>,
        src: &PoolRegistration,
        req: PushRequest,
        cancel: CancellationToken,
    ) -> Result<OutboundTransfer, TransferError> {
        crate::pool::check_block_lists(
            &req.src_blocks,
            src.pool().num_blocks(),
            &req.dst_blocks,
            u32::MAX as usize,
        )?;
        let layers = src.pool().layout().num_layers as u32;
        let (handle, driver) = crate::transport::push_pair(req, layers, &cancel, &self.metrics);
        tokio::spawn(client::run_push(Arc::clone(self), src.clone(), driver));
        Ok(handle)
    }

    /// Serves a bound listener until `shutdown`.
    pub async fn serve(
        self: &Arc<Self>,
        listener: TcpListener,
        registry: InboundRegistry,
        shutdown: CancellationToken,
    ) -> Result<(), TransferError> {
        server::serve(Arc::clone(self), listener, registry, shutdown).await
    }
}

/// Moves KV blocks over plain TCP (tokio). See the module docs.
pub struct TcpKvTransport {
    shared: Arc<NetShared>,
}

impl TcpKvTransport {
    /// A TCP transport with `config` (validated here).
    pub fn new(config: TransferConfig) -> Result<Self, TransferError> {
        Ok(Self {
            shared: Arc::new(NetShared::new(config)?),
        })
    }

    /// This transport's counters.
    pub fn metrics(&self) -> &Arc<TransferMetrics> {
        &self.shared.metrics
    }

    /// Receives pushes into `registry`'s reservations on `listener` until `shutdown` fires.
    /// Bind the listener first (port 0 in tests) and pass it in.
    pub async fn serve(
        &self,
        listener: TcpListener,
        registry: InboundRegistry,
        shutdown: CancellationToken,
    ) -> Result<(), TransferError> {
        self.shared.serve(listener, registry, shutdown).await
    }

    /// Moves block bytes between pools on the same GPU by CUDA IPC from now on: `device` holds
    /// this node's KV (the registered pool is its host mirror, same layout and block count).
    /// Connections to or from a peer on another GPU (or with no GPU) keep block bytes in the
    /// stream. Call it before serving or pushing: connections already open keep their path.
    /// Refused when the transport already has a data path.
    pub fn attach_device(
        &self,
        device: Arc<dyn crate::device::DeviceKv>,
    ) -> Result<(), TransferError> {
        let path = crate::cuda_ipc::IpcPath::new(device, Arc::clone(&self.shared.metrics));
        self.shared
            .data_path
            .set(Arc::new(path))
            .map_err(|_| TransferError::invalid("device", "this transport already has a data path"))
    }
}

impl KvTransport for TcpKvTransport {
    fn capabilities(&self) -> TransferCapabilities {
        TransferCapabilities {
            name: "tcp",
            one_sided_writes: false,
            cross_process: true,
            layer_streaming: true,
        }
    }

    fn register(&self, pool: Arc<KvPool>) -> Result<PoolRegistration, TransferError> {
        Ok(PoolRegistration::plain(pool, &self.shared.metrics, "tcp"))
    }

    fn push(
        &self,
        src: &PoolRegistration,
        req: PushRequest,
        cancel: CancellationToken,
    ) -> Result<OutboundTransfer, TransferError> {
        self.shared.push(src, req, cancel)
    }
}
