//! The fail-closed behaviours over UCX, in one process: shared memory with UCX-allocated pools
//! (the sender writes through its mapping of the receiver's pool), shared memory with registered
//! heap pools (`ucp_put_nbx`), and tcp (tagged sends, since UCX emulates RMA over tcp).
#![cfg(feature = "ucx")]

use crate::common;

use common::{small_layout, ucx_pair};

mod shm_mapped {
    scenario_tests!(|src, dst| crate::common::ucx_pair(src, dst, "shm", true));
}

/// The same through the streaming-store copy (non-temporal stores, four slabs per pass), which
/// the default config keeps for transfers of 8 MiB and more: forced here on the small layout.
mod shm_mapped_streaming {
    scenario_tests!(|src, dst| crate::common::ucx_pair_with(
        src,
        dst,
        "shm",
        true,
        tandem_kv_transfer::TransferConfig {
            streaming_store_min_transfer_bytes: 0,
            ..crate::common::small_chunks()
        }
    ));
}

mod shm_put {
    scenario_tests!(|src, dst| crate::common::ucx_pair(src, dst, "shm", false));
}

mod tcp {
    scenario_tests!(|src, dst| crate::common::ucx_pair(src, dst, "tcp", false));
}

/// Which UCX data path a pair really takes: UCX-allocated shared memory is written through the
/// sender's mapping, registered heap memory with `ucp_put_nbx`, tcp with tagged sends.
#[tokio::test]
async fn each_pool_kind_and_transport_takes_its_intended_data_path() {
    use std::future::IntoFuture;
    use std::time::Duration;
    use tandem_kv_transfer::{PushRequest, Reservation};
    use tokio_util::sync::CancellationToken;

    for (tls, allocated, want) in [
        ("shm", true, "rma-mapped"),
        ("shm", false, "rma"),
        ("tcp", false, "tag"),
    ] {
        let pair = ucx_pair(small_layout(), small_layout(), tls, allocated).await;
        let blocks = vec![0, 1, 2];
        let inbound = pair
            .registry
            .expect(Reservation {
                reservation_id: 1,
                epoch: 1,
                dst_blocks: blocks.clone(),
                ttl: Duration::from_secs(10),
            })
            .unwrap();
        let req = PushRequest::new(pair.peer.clone(), 1, 1, blocks.clone(), blocks.clone());
        let out = pair
            .sender
            .push(&pair.src, req, CancellationToken::new())
            .unwrap();
        let (sent, got) = tokio::join!(out.into_future(), inbound.into_future());
        assert_eq!(
            sent.unwrap().data_mode,
            want,
            "tls {tls}, allocated {allocated}"
        );
        got.unwrap();
        assert_eq!(pair.mismatched(&blocks, &blocks), 0);
    }
}

/// Registrations (heap pools) and allocations (UCX-owned shared memory) are released when their
/// last handle drops: the gauge returns to zero once UCX has unmapped.
#[tokio::test]
async fn registrations_and_allocations_return_to_zero_when_dropped() {
    use std::sync::Arc;
    use tandem_kv_transfer::{
        KvPool, KvTransport, Live, TransferConfig, UcxConfig, UcxKvTransport,
    };

    let t = UcxKvTransport::new(TransferConfig::default(), UcxConfig::default()).unwrap();
    let heap = t
        .register(Arc::new(KvPool::new(small_layout(), 8).unwrap()))
        .unwrap();
    let shared = t.allocate(small_layout(), 8).unwrap();
    let again = shared.clone();
    assert_eq!(t.metrics().live(Live::Registrations), 2);
    drop((heap, shared, again));
    common::wait_for("UCX to unmap both pools", || {
        t.metrics().live(Live::Registrations) == 0
    })
    .await;
}
