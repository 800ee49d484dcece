//! A loopback transfer a node runs while warming up, before it takes traffic: two fresh
//! transports of the node's kind (UCX or TCP) in this process, a sender pool filled with a
//! seeded pattern and a receiver pool of the node's KV layout, one real push through the
//! receiver's listener on loopback, and a byte-for-byte check of what landed. It exercises
//! what a node needs to move KV: the transport stack (UCX worker, memory registration, the TCP
//! control path), the wire framing, the checksums on both sides and the layout's slab
//! geometry. Cost: two blocks of the node's layout, a few milliseconds.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_kv_layout::KvLayout;
use tokio_util::sync::CancellationToken;

use crate::config::{TransferConfig, UcxConfig};
use crate::error::TransferError;
use crate::inbound::{InboundRegistry, Reservation};
use crate::kind::{NetTransport, TransportKind};
use crate::pattern;
use crate::pool::KvPool;
use crate::transport::{KvTransport, PushRequest};

/// What a passing self-check moved.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SelfCheckReport {
    /// The transport exercised.
    pub transport: &'static str,
    /// Payload bytes pushed, received and compared.
    pub bytes: u64,
    /// Push start to verified receipt.
    pub elapsed: Duration,
}

const BLOCKS: u32 = 2;
const SEED: u64 = 0x5e1f_c4ec;

/// Runs the check for `kind` and `layout` (see the module docs). Must run inside a tokio
/// runtime. An error names what failed; a mismatch is [`TransferError::ChecksumMismatch`].
pub async fn self_check(
    kind: TransportKind,
    layout: KvLayout,
) -> Result<SelfCheckReport, TransferError> {
    let config = TransferConfig::default();
    let sender = NetTransport::new(kind, config.clone(), UcxConfig::default())?;
    let receiver = Arc::new(NetTransport::new(
        kind,
        config.clone(),
        UcxConfig::default(),
    )?);
    let mut src_pool = KvPool::new(layout, BLOCKS as usize)?;
    let ids: Vec<u32> = (0..BLOCKS).collect();
    pattern::fill_blocks(&mut src_pool, SEED, &ids)?;
    let src = sender.register(Arc::new(src_pool))?;
    let dst = receiver.register(Arc::new(KvPool::new(layout, BLOCKS as usize)?))?;
    let registry = InboundRegistry::new(dst, config.fence_timeout);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| TransferError::invalid("self-check listener", e.to_string()))?;
    let peer = listener
        .local_addr()
        .map_err(|e| TransferError::invalid("self-check listener", e.to_string()))?
        .to_string();
    let stop = CancellationToken::new();
    let serve = {
        let (r, reg, s) = (Arc::clone(&receiver), registry.clone(), stop.clone());
        tokio::spawn(async move { r.serve(listener, reg, s).await })
    };
    let dst_blocks: Vec<u32> = ids.iter().rev().copied().collect();
    let result = async {
        let inbound = registry.expect(Reservation {
            reservation_id: 1,
            epoch: 1,
            dst_blocks: dst_blocks.clone(),
            ttl: Duration::from_secs(10),
        })?;
        let t0 = Instant::now();
        let push = sender.push(
            &src,
            PushRequest::new(peer, 1, 1, ids.clone(), dst_blocks.clone())
                .deadline(Duration::from_secs(10)),
            CancellationToken::new(),
        )?;
        let (sent, got) = tokio::join!(push.into_future(), inbound.into_future());
        let (sent, got) = (sent?, got?);
        if sent.block_checksums != got.block_checksums {
            return Err(TransferError::invalid(
                "self-check",
                "sender and receiver checksums differ".to_string(),
            ));
        }
        // SAFETY: the reservation resolved; nothing writes the destination blocks any more.
        let bad = unsafe {
            pattern::mismatched_slabs(registry.registration().pool(), SEED, &ids, &dst_blocks)
        }?;
        if bad > 0 {
            return Err(TransferError::invalid(
                "self-check",
                format!("{bad} slabs differ from what was sent"),
            ));
        }
        Ok(SelfCheckReport {
            transport: kind.as_str(),
            bytes: got.bytes,
            elapsed: t0.elapsed(),
        })
    }
    .await;
    stop.cancel();
    let _ = serve.await;
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_tcp_self_check_moves_and_verifies_two_blocks() {
        let layout = KvLayout::new(4, 2, 16, 4, tandem_kv_layout::KvDtype::F16, 7).unwrap();
        let r = self_check(TransportKind::Tcp, layout).await.unwrap();
        assert_eq!(r.transport, "tcp");
        assert_eq!(r.bytes, (4 * layout.slab_bytes() * 2) as u64);
    }
}
