//! Moves paged KV blocks between tandem nodes: UCX (the real data path), TCP (hosts without UCX)
//! and in-process (tests), behind one small trait, failing closed.
//!
//! A prefill node pushes the (layer, block) slabs of a request's blocks into blocks a decode
//! node reserved, layer by layer as prefill finishes them; the decode node learns when every
//! layer of every block has arrived *and verified*. The engine owns what a block id means; this
//! crate only moves the bytes of the ids it is handed, in the layout of `tandem-kv-layout`.
//!
//! # Module map
//! - [`transport`]: the [`KvTransport`] seam, [`PushRequest`], [`OutboundTransfer`], [`PoolRegistration`].
//! - [`inbound`]: the receiver's [`InboundRegistry`] of reservations and its fail-closed checks.
//! - [`pool`]: [`KvPool`] memory and block runs; [`checksum`]: slab checksums (XXH3-64, AVX2/AVX-512).
//! - [`wire`]: rkyv descriptors and framing (checked access on everything received).
//! - [`tcp`]: [`TcpKvTransport`] (tokio) and the stream protocol UCX reuses for control.
//! - `datapath`: the traits `tcp` calls for bytes that leave the stream; `ucx` implements them,
//!   so the dependency runs `ucx` → `tcp` → `datapath`, never `tcp` → `ucx`.
//! - `ucx` (feature `ucx`, default): [`UcxKvTransport`] over our `tandem-ucx-sys` bindings.
//! - `cuda_ipc`: the CUDA IPC data path (two processes on one GPU, device to device), attached
//!   to a TCP transport with [`TcpKvTransport::attach_device`]; [`device`]: the device seam it
//!   calls ([`device::DeviceKv`]: CUDA, and a host stand-in for tests).
//! - [`inproc`]: the in-process transport, [`InProcKvTransport`].
//! - [`fault`]: fault injection (feature `fault-injection`, never on by default).
//! - [`metrics`]: atomic counters, a latency histogram and leak gauges.
//! - [`bench`]: `tandem bench-transfer`; [`peer`]: the two-process peer protocol.
//!
//! # Fail-closed guarantees
//! - A layout-fingerprint mismatch is refused at connection setup and again per transfer, before
//!   any byte is written.
//! - A write for an unknown, expired or reused (stale-epoch) reservation is refused before any
//!   byte is written.
//! - A block is ready only when every layer's xxh3 matched the sender's; one bad slab fails the
//!   reservation.
//! - Every failure is a typed [`TransferError`] with [`TransferError::retry_safe`].

#![warn(missing_docs)]

pub mod bench;
pub mod checksum;
pub mod config;
mod cuda_ipc;
mod datapath;
pub mod device;
pub mod error;
pub mod fault;
pub mod inbound;
pub mod inproc;
pub mod kind;
pub mod metrics;
pub mod pattern;
pub mod peer;
pub mod pool;
pub mod selfcheck;
pub mod tcp;
pub mod transport;
#[cfg(feature = "ucx")]
pub mod ucx;
// rkyv's derive emits undocumented helper types for enum variants; every hand-written item in
// `wire` is documented.
#[allow(missing_docs)]
pub mod wire;

pub use config::{TransferConfig, UcxConfig, UcxDataMode};
pub use error::{FailureKind, Phase, Side, TransferError};
#[cfg(feature = "fault-injection")]
pub use fault::Fault;
pub use inbound::{InboundRegistry, InboundReport, InboundTransfer, Reservation};
pub use inproc::{InProcKvTransport, InProcNetwork};
pub use kind::{LayoutName, NetTransport, TransportKind};
pub use metrics::{Live, MetricsSnapshot, TransferMetrics};
pub use pool::{BlockId, KvPool};
pub use tcp::TcpKvTransport;
pub use transport::{
    KvTransport, OutboundTransfer, PoolRegistration, PushRequest, TransferCapabilities,
    TransferReport,
};
#[cfg(feature = "ucx")]
pub use ucx::UcxKvTransport;
