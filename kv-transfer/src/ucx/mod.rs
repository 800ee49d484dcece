//! UCX transport: block bytes over UCP (one-sided puts straight into the receiver's pool, or
//! tagged sends where RMA would be emulated), control over the TCP stream protocol.
//!
//! ```text
//!  sender                                              receiver
//!  TCP: Hello ───────────────────────────────────────▶ layout check
//!       ◀─────────── Accepted{worker address, rkey, pool base}
//!  UCX: ucp_ep_create(worker address), ucp_ep_rkey_unpack    (once per connection)
//!  per chunk (RMA):  ucp_put_nbx × (layers × runs) → ucp_ep_flush_nbx → TCP: Chunk{checksums}
//!  per chunk (tag):  TCP: Chunk{checksums} ; ucp_tag_send_nbx × ranges  ─▶ ucp_tag_recv_nbx into
//!                                                                         the destination slabs
//! ```
//!
//! Memory is registered once per pool (`ucp_mem_map` at [`KvTransport::register`]), remote keys
//! are exchanged at connection setup, and neither side copies block bytes: puts read the source
//! slabs and land in the destination slabs; tagged receives are posted on the destination slabs.
//!
//! # Choosing the data path
//! UCX picks the transport (`UCX_TLS`, or [`UcxConfig::tls`] which overrides it): shared memory
//! and cross-memory attach on one host, tcp, rc/ud/dc verbs with RDMA NICs. After creating an
//! endpoint we read `ucp_ep_print_info` (logged at info level) and, in [`UcxDataMode::Auto`], use
//! RMA only if a lane that serves `rma_bw` is not `tcp`: over `UCX_TLS=tcp` UCX 1.13 emulates RMA
//! in software (seen here at 0.4–1.3 GB/s) while tagged messages reach 4–6 GB/s.
//!
//! # Peer death
//! Endpoints use `UCP_ERR_HANDLING_MODE_PEER`; outstanding requests to a dead peer complete with
//! an error, and closing such an endpoint answers "Connection reset by remote peer", which is
//! expected: endpoints are force-closed then and the status is not an error. The TCP control
//! connection's end is what tells the receiver its sender is gone.
//!
//! # Place in the crate
//! `UcxNet` and `UcxPeer` implement `DataPath` and `PeerDataPath` (`crate::datapath`): that is
//! all the stream protocol in `tcp` sees of UCX. This module builds on `tcp` (its
//! `NetShared` carries the control frames); `tcp` never names this module.

mod peer;
mod runtime;
mod ucp;
mod worker;

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use tandem_kv_layout::KvLayout;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::config::{TransferConfig, UcxConfig, UcxDataMode};
use crate::datapath::{BoxFuture, Completion, DataPath, PeerDataPath};
use crate::error::TransferError;
use crate::inbound::InboundRegistry;
use crate::metrics::{Live, LiveGuard, TransferMetrics};
use crate::pool::KvPool;
use crate::tcp::NetShared;
use crate::transport::{
    KvTransport, OutboundTransfer, PoolRegistration, PushRequest, RegistrationInner,
    TransferCapabilities,
};
use crate::wire::{DataMode, DataOffer, Hello, UcxRemote};

use peer::UcxPeer;
use runtime::{Cmd, Keep, UcxRuntime};

/// Mask selecting the connection and transfer bits of a tag.
pub(crate) const TRANSFER_TAG_MASK: u64 = 0xFFFF_FFFF_F000_0000;
/// Mask selecting the connection bits of a tag.
pub(crate) const CONN_TAG_MASK: u64 = 0xFFFF_0000_0000_0000;

/// The tag of range `index` of a transfer: 16 bits of connection id, 20 bits of transfer id,
/// 28 bits of range index. Transfer ids wrap after 2^20 on one connection; a collision needs a
/// transfer still active a million transfers later.
pub(crate) fn tag_for(conn_id: u32, transfer_id: u64, index: u64) -> u64 {
    ((conn_id as u64 & 0xFFFF) << 48) | ((transfer_id & 0xF_FFFF) << 28) | (index & 0xFFF_FFFF)
}

/// One put: `len` bytes at local address `local` to remote address `remote`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PutOp {
    pub local: usize,
    pub len: usize,
    pub remote: u64,
}

/// One tagged send or receive of `len` bytes at `addr`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TagOp {
    pub addr: usize,
    pub len: usize,
    pub tag: u64,
}

/// Reads which transport serves each lane out of `ucp_ep_print_info`; true when some `rma_bw`
/// lane is not `tcp` (so puts are native, not emulated).
pub(crate) fn rma_is_native(ep_info: &str) -> bool {
    ep_info
        .lines()
        .filter(|l| l.contains("lane[") && l.contains("rma_bw"))
        .any(|l| {
            let after = l.split("]:").nth(1).unwrap_or("").trim_start();
            let tl = after
                .split(':')
                .nth(1)
                .unwrap_or("")
                .split('/')
                .next()
                .unwrap_or("");
            !tl.is_empty() && tl != "tcp"
        })
}

/// True unless the transport list (`UCX_TLS` syntax) rules out every shared-memory transport.
pub(crate) fn shm_allowed(tls: Option<&str>) -> bool {
    const SHM: [&str; 8] = ["shm", "sm", "posix", "sysv", "cma", "xpmem", "knem", "mm"];
    match tls {
        None => true,
        Some(t) if t.starts_with('^') || t == "all" => true,
        Some(t) => t.split(',').any(|tl| SHM.contains(&tl.trim())),
    }
}

/// UCX state of a network transport: the data path its TCP connections call through.
pub(crate) struct UcxNet {
    rt: UcxRuntime,
    data_mode: UcxDataMode,
    shm_allowed: bool,
}

impl DataPath for UcxNet {
    /// The worker address, remote key and extent of `registration`'s pool, when it was mapped
    /// by this transport and the sender is a UCX sender.
    fn offer(&self, registration: &PoolRegistration, hello: &Hello) -> Option<DataOffer> {
        // A sender with a device UUID wants CUDA IPC, not UCX: no offer, so it gets the stream.
        if !hello.device_uuid.is_empty() {
            return None;
        }
        let mapped = registration.ucx()?;
        Some(DataOffer::Ucx(UcxRemote {
            worker_address: self.rt.worker_address().to_vec(),
            rkey: mapped.rkey.clone(),
            base_addr: mapped.base,
            len_bytes: mapped.len,
        }))
    }

    /// Creates the endpoint and picks the data mode ([`UcxDataMode::Auto`]: RMA only over a
    /// native RMA lane); a mapping of the peer pool is used only in RMA mode.
    fn connect<'a>(
        &'a self,
        peer: &'a str,
        remote: &'a DataOffer,
        conn_id: u32,
        same_host: bool,
    ) -> BoxFuture<'a, Result<Box<dyn PeerDataPath>, TransferError>> {
        Box::pin(async move {
            let DataOffer::Ucx(remote) = remote else {
                return Err(TransferError::protocol(
                    "data_offer",
                    "a UCX sender was offered another data path",
                ));
            };
            // Shared memory (what UCX picks on one host) cannot detect peer failure in UCX 1.13
            // and refuses endpoints that ask for it; elsewhere, ask for it.
            let peer_failure = !(same_host && self.shm_allowed);
            let rx = self.rt.request(|reply| Cmd::Connect {
                address: remote.worker_address.clone(),
                rkey: remote.rkey.clone(),
                base: remote.base_addr,
                peer_failure,
                reply,
            });
            let (ep, info, mapped) = rx.await.map_err(|_| TransferError::Shutdown)??;
            let mode = match self.data_mode {
                UcxDataMode::Rma => DataMode::Rma,
                UcxDataMode::Tag => DataMode::Tag,
                UcxDataMode::Auto if rma_is_native(&info) => DataMode::Rma,
                UcxDataMode::Auto => DataMode::Tag,
            };
            // Writing through the mapping is the one-sided put UCX itself does on shared memory
            // (a memcpy into the mapped segment); doing it here lets the copy and the checksum
            // share one pass over the source.
            let mapped = mapped.filter(|_| mode == DataMode::Rma);
            tracing::info!(peer, ?mode, mapped = mapped.is_some(), lanes = %info.trim(), "UCX endpoint ready");
            let peer: Box<dyn PeerDataPath> = Box::new(UcxPeer {
                rt: self.rt.clone(),
                ep,
                mode,
                conn_id,
                remote_base: remote.base_addr,
                remote_len: remote.len_bytes,
                closed: AtomicBool::new(false),
                mapped,
            });
            Ok(peer)
        })
    }

    /// Tagged receives, range `first_range + k` under [`tag_for`]`(conn_id, transfer_id, ..)`.
    fn post_recvs(
        &self,
        conn_id: u32,
        transfer_id: u64,
        first_range: u64,
        ranges: Vec<(usize, usize)>,
        keep: Keep,
    ) -> Completion {
        let ops = ranges
            .iter()
            .enumerate()
            .map(|(k, &(addr, len))| TagOp {
                addr,
                len,
                tag: tag_for(conn_id, transfer_id, first_range + k as u64),
            })
            .collect();
        self.rt.request(|reply| Cmd::TagRecv { ops, keep, reply })
    }

    fn cancel_recvs(&self, conn_id: u32, transfer_id: Option<u64>) {
        let (tag, mask) = match transfer_id {
            Some(id) => (tag_for(conn_id, id, 0), TRANSFER_TAG_MASK),
            None => (tag_for(conn_id, 0, 0), CONN_TAG_MASK),
        };
        let _ = self.rt.send(Cmd::CancelRecvs { tag, mask });
    }

    fn drain_unexpected(&self, conn_id: u32) {
        let _ = self.rt.send(Cmd::DrainUnexpected {
            tag: tag_for(conn_id, 0, 0),
            mask: CONN_TAG_MASK,
        });
    }
}

/// A pool registered with UCX (`ucp_mem_map`).
pub(crate) struct MappedPool {
    rt: UcxRuntime,
    mem: u64,
    rkey: Vec<u8>,
    base: u64,
    len: u64,
    /// UCX allocated the memory: the pool unmaps (frees) it when it drops, not the registration.
    allocated: bool,
}

impl MappedPool {
    /// Unmaps a registered heap pool on the progress thread, then drops `guard` (so the gauge
    /// falls only when done). An allocated pool's memory goes when the pool itself drops.
    pub fn unmap(self, guard: Option<LiveGuard>) {
        if !self.allocated {
            let _ = self.rt.send(Cmd::Unmap {
                mem: self.mem,
                guard,
            });
        }
    }
}

/// Moves KV blocks over UCX (see the module docs).
pub struct UcxKvTransport {
    shared: Arc<NetShared>,
    /// The same UCX state as `shared.data_path`, typed (registration needs its runtime).
    net: Arc<UcxNet>,
}

impl UcxKvTransport {
    /// Starts the UCX progress thread (context and worker) and validates `config`.
    pub fn new(config: TransferConfig, ucx: UcxConfig) -> Result<Self, TransferError> {
        let shared = NetShared::new(config)?;
        let rt = UcxRuntime::start(ucx.tls.clone())?;
        let tls = ucx.tls.clone().or_else(|| std::env::var("UCX_TLS").ok());
        let net = Arc::new(UcxNet {
            rt,
            data_mode: ucx.data_mode,
            shm_allowed: shm_allowed(tls.as_deref()),
        });
        if shared
            .data_path
            .set(Arc::clone(&net) as Arc<dyn DataPath>)
            .is_err()
        {
            unreachable!("a new transport has no data path yet");
        }
        Ok(Self {
            shared: Arc::new(shared),
            net,
        })
    }

    /// This transport's counters.
    pub fn metrics(&self) -> &Arc<TransferMetrics> {
        &self.shared.metrics
    }

    /// Receives pushes into `registry`'s reservations: control on `listener`, bytes over UCX.
    /// `registry` must hold a pool registered with this transport.
    pub async fn serve(
        &self,
        listener: TcpListener,
        registry: InboundRegistry,
        shutdown: CancellationToken,
    ) -> Result<(), TransferError> {
        if registry.registration().ucx().is_none() {
            return Err(TransferError::invalid(
                "registry",
                "pool is not registered with a UCX transport",
            ));
        }
        self.shared.serve(listener, registry, shutdown).await
    }
}

impl KvTransport for UcxKvTransport {
    fn capabilities(&self) -> TransferCapabilities {
        TransferCapabilities {
            name: "ucx",
            one_sided_writes: true,
            cross_process: true,
            layer_streaming: true,
        }
    }

    fn register(&self, pool: Arc<KvPool>) -> Result<PoolRegistration, TransferError> {
        let (tx, rx) = std::sync::mpsc::channel();
        self.net.rt.send(Cmd::Map {
            pool: Arc::clone(&pool),
            reply: tx,
        })?;
        let (mem, rkey) = rx.recv().map_err(|_| TransferError::Shutdown)??;
        let mapped = MappedPool {
            rt: self.net.rt.clone(),
            mem,
            rkey,
            base: pool.as_ptr() as u64,
            len: pool.len_bytes() as u64,
            allocated: false,
        };
        Ok(self.registration(pool, mapped))
    }

    fn allocate(
        &self,
        layout: KvLayout,
        num_blocks: usize,
    ) -> Result<PoolRegistration, TransferError> {
        let len = layout.pool_bytes(num_blocks);
        let (tx, rx) = std::sync::mpsc::channel();
        self.net.rt.send(Cmd::Alloc { len, reply: tx })?;
        let (mem, addr, rkey) = rx.recv().map_err(|_| TransferError::Shutdown)??;
        let rt = self.net.rt.clone();
        let release = Box::new(move || {
            let _ = rt.send(Cmd::Unmap { mem, guard: None });
        });
        // SAFETY: UCX allocated `len` zeroed, page-aligned bytes at `addr` (checked on the
        // progress thread) and frees them only on the Unmap that `release` sends.
        let pool = Arc::new(unsafe {
            KvPool::from_external(layout, num_blocks, addr as *mut u8, release)
        }?);
        let mapped = MappedPool {
            rt: self.net.rt.clone(),
            mem,
            rkey,
            base: addr as u64,
            len: len as u64,
            allocated: true,
        };
        Ok(self.registration(pool, mapped))
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

impl UcxKvTransport {
    fn registration(&self, pool: Arc<KvPool>, mapped: MappedPool) -> PoolRegistration {
        let metrics = &self.shared.metrics;
        PoolRegistration::new(RegistrationInner {
            pool,
            metrics: Arc::clone(metrics),
            transport: "ucx",
            ucx: Some(mapped),
            live: Some(metrics.live_guard(Live::Registrations)),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHM_INFO: &str = "#                 lane[0]:  0:sysv/memory.0 md[0]           -> md[0]/sysv/sysdev[255] am am_bw#0
#                 lane[1]:  2:cma/memory.0 md[2]            -> md[2]/cma/sysdev[255] rma_bw#0
#                  rma_bw: mds rndv_rkey_size 9";
    const TCP_INFO: &str = "#                 lane[0]:  1:tcp/lo.0 md[0]                -> md[0]/tcp/sysdev[255] rma_bw#0 am am_bw#0
#                 lane[1]:  0:tcp/eth0.0 md[0]              -> md[0]/tcp/sysdev[255] rma_bw#1 wireup";

    #[test]
    fn rma_is_chosen_for_cma_lanes_and_not_for_emulated_tcp_rma() {
        assert!(rma_is_native(SHM_INFO));
        assert!(!rma_is_native(TCP_INFO));
        assert!(!rma_is_native(""));
    }

    #[test]
    fn shared_memory_is_ruled_out_only_by_an_explicit_list_without_it() {
        assert!(shm_allowed(None));
        assert!(shm_allowed(Some("shm,tcp")));
        assert!(shm_allowed(Some("^ib")));
        assert!(!shm_allowed(Some("tcp")));
        assert!(!shm_allowed(Some("rc,ud")));
    }

    #[test]
    fn tags_separate_connections_transfers_and_ranges() {
        let t = tag_for(3, 7, 9);
        assert_eq!(t & CONN_TAG_MASK, tag_for(3, 0, 0) & CONN_TAG_MASK);
        assert_eq!(t & TRANSFER_TAG_MASK, tag_for(3, 7, 0));
        assert_ne!(t & TRANSFER_TAG_MASK, tag_for(3, 8, 9) & TRANSFER_TAG_MASK);
        assert_ne!(t & CONN_TAG_MASK, tag_for(4, 7, 9) & CONN_TAG_MASK);
        assert_ne!(tag_for(1, 0, 0), 0, "tag 0 is never used");
    }
}
