//! Choosing a network transport from configuration: [`TransportKind`] and [`NetTransport`].
//!
//! Nodes and tools pick TCP or UCX by name (a flag, an env var, a config file) and then use one
//! type for both roles: [`KvTransport`] to push, [`NetTransport::serve`] to receive.

use std::sync::Arc;

use tandem_kv_layout::{KvDtype, KvLayout};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::config::{TransferConfig, UcxConfig};
use crate::error::TransferError;
use crate::inbound::InboundRegistry;
use crate::metrics::TransferMetrics;
use crate::pool::KvPool;
use crate::tcp::TcpKvTransport;
use crate::transport::{
    KvTransport, OutboundTransfer, PoolRegistration, PushRequest, TransferCapabilities,
};

/// Which network transport to use.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum TransportKind {
    /// UCX (shared memory, tcp or RDMA, as UCX chooses).
    Ucx,
    /// Plain TCP with tokio.
    Tcp,
}

impl TransportKind {
    /// The name used in flags and metrics labels.
    pub const fn as_str(self) -> &'static str {
        match self {
            TransportKind::Ucx => "ucx",
            TransportKind::Tcp => "tcp",
        }
    }
}

/// A named KV layout for tools and tests.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum LayoutName {
    /// SmolLM2-135M: 30 layers × 3 KV heads × 64 dims, bf16.
    Smollm2,
    /// The seed's 70B shape: 80 layers × 8 KV heads × 128 dims, bf16 (320 KiB/token).
    Llama70b,
    /// A tiny layout for tests: 4 layers × 2 KV heads × 16 dims, f16.
    Small,
}

impl LayoutName {
    /// The layout with `block_tokens` tokens per block (not tied to a model's weights).
    pub fn layout(self, block_tokens: usize) -> Result<KvLayout, TransferError> {
        let (layers, heads, dim, dtype) = match self {
            LayoutName::Smollm2 => (30, 3, 64, KvDtype::Bf16),
            LayoutName::Llama70b => (80, 8, 128, KvDtype::Bf16),
            LayoutName::Small => (4, 2, 16, KvDtype::F16),
        };
        KvLayout::new(layers, heads, dim, block_tokens, dtype, 0)
            .map_err(|e| TransferError::invalid("layout", e.to_string()))
    }
}

/// TCP or UCX, chosen at run time.
pub enum NetTransport {
    /// See [`TcpKvTransport`].
    Tcp(TcpKvTransport),
    /// See [`crate::UcxKvTransport`].
    #[cfg(feature = "ucx")]
    Ucx(crate::ucx::UcxKvTransport),
}

impl NetTransport {
    /// Builds the transport `kind` names. `ucx` is ignored for TCP.
    pub fn new(
        kind: TransportKind,
        config: TransferConfig,
        ucx: UcxConfig,
    ) -> Result<Self, TransferError> {
        match kind {
            TransportKind::Tcp => Ok(NetTransport::Tcp(TcpKvTransport::new(config)?)),
            #[cfg(feature = "ucx")]
            TransportKind::Ucx => Ok(NetTransport::Ucx(crate::ucx::UcxKvTransport::new(
                config, ucx,
            )?)),
            #[cfg(not(feature = "ucx"))]
            TransportKind::Ucx => Err({
                let _ = ucx;
                TransferError::invalid("transport", "this build has no UCX (feature `ucx`)")
            }),
        }
    }

    /// This transport's counters.
    pub fn metrics(&self) -> &Arc<TransferMetrics> {
        match self {
            NetTransport::Tcp(t) => t.metrics(),
            #[cfg(feature = "ucx")]
            NetTransport::Ucx(t) => t.metrics(),
        }
    }

    /// Receives into `registry` on `listener` until `shutdown` (see each transport's `serve`).
    pub async fn serve(
        &self,
        listener: TcpListener,
        registry: InboundRegistry,
        shutdown: CancellationToken,
    ) -> Result<(), TransferError> {
        match self {
            NetTransport::Tcp(t) => t.serve(listener, registry, shutdown).await,
            #[cfg(feature = "ucx")]
            NetTransport::Ucx(t) => t.serve(listener, registry, shutdown).await,
        }
    }

    /// Attaches a device pool for the CUDA IPC data path (see
    /// [`TcpKvTransport::attach_device`]); refused on UCX, which has its own data path.
    pub fn attach_device(
        &self,
        device: Arc<dyn crate::device::DeviceKv>,
    ) -> Result<(), TransferError> {
        match self {
            NetTransport::Tcp(t) => t.attach_device(device),
            #[cfg(feature = "ucx")]
            NetTransport::Ucx(_) => Err({
                let _ = device;
                TransferError::invalid("transport", "CUDA IPC rides on the TCP transport, not UCX")
            }),
        }
    }

    fn inner(&self) -> &dyn KvTransport {
        match self {
            NetTransport::Tcp(t) => t,
            #[cfg(feature = "ucx")]
            NetTransport::Ucx(t) => t,
        }
    }
}

impl KvTransport for NetTransport {
    fn capabilities(&self) -> TransferCapabilities {
        self.inner().capabilities()
    }

    fn register(&self, pool: Arc<KvPool>) -> Result<PoolRegistration, TransferError> {
        self.inner().register(pool)
    }

    fn allocate(
        &self,
        layout: KvLayout,
        num_blocks: usize,
    ) -> Result<PoolRegistration, TransferError> {
        self.inner().allocate(layout, num_blocks)
    }

    fn push(
        &self,
        src: &PoolRegistration,
        req: PushRequest,
        cancel: CancellationToken,
    ) -> Result<OutboundTransfer, TransferError> {
        self.inner().push(src, req, cancel)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn named_layouts_have_the_documented_block_sizes() {
        let l = LayoutName::Llama70b.layout(16).unwrap();
        assert_eq!(l.block_bytes(), 5 << 20, "5 MiB per 16-token block");
        assert_eq!(l.bytes_per_token_exact(), Some(320 << 10));
        let s = LayoutName::Smollm2.layout(16).unwrap();
        assert_eq!(s.bytes_per_token_exact(), Some(30 * 3 * 64 * 2 * 2));
    }
}
