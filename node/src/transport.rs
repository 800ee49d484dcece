//! KV transport setup for a node: choosing UCX or TCP ([`start`]), the address format peers
//! see ([`KvAddress`], `ucx://host:port` / `tcp://host:port`), and [`TransferBacking`], which
//! lets the engine's KV pool live in the memory the transport allocated.
//!
//! Why the engine's pool lives in transport memory: with UCX on one host,
//! `KvTransport::allocate` returns a shared-memory segment the peer maps, so a push is one
//! fused copy+checksum straight from the prefill engine's blocks into the decode engine's
//! blocks, with no staging buffer on either side.
//!
//! A decode node serves one protocol on its KV port; the scheme of its address tells a prefill
//! node which one to speak. A prefill node can push over TCP whatever its own transport is (TCP
//! works with any registered pool), so a UCX prefill node reaches a TCP decode node too.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use tandem_engine::kv::KvBacking;
use tandem_kv_transfer::{
    NetTransport, PoolRegistration, TransferConfig, TransportKind, UcxConfig,
};

use crate::config::TransportChoice;
use crate::error::NodeError;

/// Starts the transport `choice` asks for; `auto` falls back to TCP (with a warning) when UCX
/// cannot start, and is TCP with `cuda_ipc` (the CUDA IPC path rides on it).
pub fn start(choice: TransportChoice, cuda_ipc: bool) -> Result<(Arc<NetTransport>, TransportKind), NodeError> {
    let choice = match choice {
        TransportChoice::Auto if cuda_ipc => TransportChoice::Tcp,
        c => c,
    };
    let make = |kind: TransportKind| {
        NetTransport::new(kind, TransferConfig::default(), UcxConfig::default())
            .map(Arc::new)
            .map_err(|source| NodeError::Transport {
                transport: kind.as_str(),
                source,
            })
    };
    match choice {
        TransportChoice::Ucx => Ok((make(TransportKind::Ucx)?, TransportKind::Ucx)),
        TransportChoice::Tcp => Ok((make(TransportKind::Tcp)?, TransportKind::Tcp)),
        TransportChoice::Auto => match make(TransportKind::Ucx) {
            Ok(t) => Ok((t, TransportKind::Ucx)),
            Err(e) => {
                tracing::warn!(error = %e, "UCX did not start; moving KV over TCP (--kv-transport tcp to silence this)");
                Ok((make(TransportKind::Tcp)?, TransportKind::Tcp))
            }
        },
    }
}

/// Where a decode node receives KV: transport and `host:port`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvAddress {
    /// The protocol its receiver speaks.
    pub kind: TransportKind,
    /// `host:port` of its KV listener.
    pub host_port: String,
}

impl fmt::Display for KvAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}://{}", self.kind.as_str(), self.host_port)
    }
}

/// A KV address that does not parse.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("KV address `{0}` is not ucx://host:port or tcp://host:port")]
pub struct BadKvAddress(pub String);

impl FromStr for KvAddress {
    type Err = BadKvAddress;
    fn from_str(s: &str) -> Result<Self, BadKvAddress> {
        let bad = || BadKvAddress(s.to_string());
        let (scheme, rest) = s.split_once("://").ok_or_else(bad)?;
        let kind = match scheme {
            "ucx" => TransportKind::Ucx,
            "tcp" => TransportKind::Tcp,
            _ => return Err(bad()),
        };
        let (host, port) = rest.rsplit_once(':').ok_or_else(bad)?;
        if host.is_empty() || port.parse::<u16>().is_err() {
            return Err(bad());
        }
        Ok(KvAddress {
            kind,
            host_port: rest.to_string(),
        })
    }
}

/// The memory of a transport-allocated pool, as engine KV storage.
///
/// Holds the registration, so the memory (and its UCX mapping) lives as long as the engine's
/// pool does.
pub struct TransferBacking(pub PoolRegistration);

// SAFETY: a kv-transfer pool is 64-byte aligned, writable and valid for `len_bytes()` bytes until
// it drops, and the registration held here keeps it alive. Transports write only into blocks the
// decode engine reserved for them and read only blocks the prefill engine holds for a push (the
// nodes pass exactly those block ids), which is the access contract `KvBacking` asks for.
unsafe impl KvBacking for TransferBacking {
    fn as_ptr(&self) -> *mut u8 {
        self.0.pool().as_ptr()
    }

    fn len_bytes(&self) -> usize {
        self.0.pool().len_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_addresses_round_trip_and_reject_other_schemes() {
        let a: KvAddress = "ucx://127.0.0.1:4000".parse().unwrap();
        assert_eq!(a.kind, TransportKind::Ucx);
        assert_eq!(a.host_port, "127.0.0.1:4000");
        assert_eq!(a.to_string(), "ucx://127.0.0.1:4000");
        let v6: KvAddress = "tcp://[::1]:9".parse().unwrap();
        assert_eq!(v6.host_port, "[::1]:9");
        for bad in [
            "127.0.0.1:4000",
            "http://a:1",
            "tcp://a",
            "tcp://:1",
            "tcp://a:99999",
        ] {
            assert!(bad.parse::<KvAddress>().is_err(), "{bad}");
        }
    }

    #[test]
    fn a_transport_backing_exposes_the_whole_pool() {
        let (t, _) = start(TransportChoice::Tcp, false).unwrap();
        let layout =
            tandem_engine::KvLayout::new(2, 1, 8, 4, tandem_engine::KvDtype::F32, 1).unwrap();
        let reg = tandem_kv_transfer::KvTransport::allocate(&*t, layout, 3).unwrap();
        let b = TransferBacking(reg.clone());
        assert_eq!(b.len_bytes(), layout.pool_bytes(3));
        assert_eq!(b.as_ptr() as usize % 64, 0);
        tandem_engine::kv::KvPool::external(layout, 3, Arc::new(b)).unwrap();
    }

    #[test]
    fn auto_is_tcp_when_kv_goes_by_cuda_ipc() {
        let (_, kind) = start(TransportChoice::Auto, true).unwrap();
        assert_eq!(kind, TransportKind::Tcp);
    }
}
