//! The CUDA IPC data path's protocol, over host stand-ins for device pools
//! ([`tandem_kv_transfer::device::HostDeviceKv`]): every fail-closed scenario of the other
//! transports, then what is particular to it. The same path over real GPU memory is checked by
//! `scripts/gpu-check.sh` (two processes on one GPU).

use crate::common;

use std::future::IntoFuture;
use std::time::Duration;

use tandem_kv_transfer::{PushRequest, Reservation};
use tokio_util::sync::CancellationToken;

scenario_tests!(common::ipc_pair);

async fn push_once(
    pair: &common::Pair,
    id: u64,
) -> (
    tandem_kv_transfer::TransferReport,
    tandem_kv_transfer::InboundReport,
) {
    let (src, dst) = (common::scenarios::SRC, common::scenarios::DST);
    let inbound = pair
        .registry
        .expect(Reservation {
            reservation_id: id,
            epoch: 1,
            dst_blocks: dst.to_vec(),
            ttl: Duration::from_secs(10),
        })
        .unwrap();
    let req = PushRequest::new(pair.peer.clone(), id, 1, src.to_vec(), dst.to_vec());
    let out = pair
        .sender
        .push(&pair.src, req, CancellationToken::new())
        .unwrap();
    let (sent, got) = tokio::join!(out.into_future(), inbound.into_future());
    (sent.unwrap(), got.unwrap())
}

/// Serves `dst` on `receiver` (a loopback port), pushes the scenario blocks from `src` with
/// `sender`, and returns both sides' reports.
async fn push_to(
    sender: &dyn tandem_kv_transfer::KvTransport,
    src: &tandem_kv_transfer::PoolRegistration,
    receiver: std::sync::Arc<tandem_kv_transfer::NetTransport>,
    dst: tandem_kv_transfer::PoolRegistration,
) -> (
    tandem_kv_transfer::TransferReport,
    tandem_kv_transfer::InboundReport,
) {
    let registry = tandem_kv_transfer::InboundRegistry::new(dst, Duration::from_secs(2));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let peer = listener.local_addr().unwrap().to_string();
    let stop = CancellationToken::new();
    let (reg, sd) = (registry.clone(), stop.clone());
    tokio::spawn(async move { receiver.serve(listener, reg, sd).await.unwrap() });
    let (s, d) = (common::scenarios::SRC, common::scenarios::DST);
    let inbound = registry
        .expect(Reservation {
            reservation_id: 5,
            epoch: 1,
            dst_blocks: d.to_vec(),
            ttl: Duration::from_secs(10),
        })
        .unwrap();
    let out = sender
        .push(
            src,
            PushRequest::new(peer, 5, 1, s.to_vec(), d.to_vec()),
            CancellationToken::new(),
        )
        .unwrap();
    let (sent, got) = tokio::join!(out.into_future(), inbound.into_future());
    stop.cancel();
    (sent.unwrap(), got.unwrap())
}

fn host_nonzero(pair: &common::Pair) -> usize {
    let pool = pair.registry.registration().pool();
    // SAFETY: no transfer in flight.
    unsafe { std::slice::from_raw_parts(pool.as_ptr(), pool.len_bytes()) }
        .iter()
        .filter(|&&b| b != 0)
        .count()
}

/// Same GPU: the bytes go device to device, the report says so, the IPC counters count them on
/// both sides, and the receiver's host pool (the staging mirror) is never written.
#[tokio::test]
async fn on_one_gpu_blocks_land_in_the_device_pool_verified_and_reported_on_device() {
    let small = common::small_layout();
    let pair = common::ipc_pair(small, small).await;
    let (sent, got) = push_once(&pair, 1).await;
    assert_eq!(sent.data_mode, "cuda-ipc");
    assert!(
        got.on_device,
        "the report tells the node not to stage the host copy up"
    );
    assert_eq!(sent.block_checksums, got.block_checksums);
    assert_eq!(
        pair.mismatched(&common::scenarios::SRC, &common::scenarios::DST),
        0
    );
    assert_eq!(
        host_nonzero(&pair),
        0,
        "nothing was written to the host pool"
    );
    let (s, r) = (
        pair.sender_metrics.snapshot(),
        pair.receiver_metrics.snapshot(),
    );
    assert_eq!(s.ipc_bytes_sent, got.bytes);
    assert_eq!(r.ipc_bytes_received, got.bytes);
    pair.assert_released().await;
}

/// Different GPUs: no offer, so the bytes travel in the TCP stream into the host pool, and the
/// report says they did (a decode node then stages them up as usual).
#[tokio::test]
async fn peers_on_different_gpus_fall_back_to_the_stream_and_say_so() {
    let small = common::small_layout();
    let pair = common::ipc_pair_on(small, small, 1, 2).await;
    let (sent, got) = push_once(&pair, 2).await;
    assert_eq!(sent.data_mode, "inline");
    assert!(!got.on_device);
    assert_eq!(
        pair.mismatched(&common::scenarios::SRC, &common::scenarios::DST),
        0
    );
    assert!(host_nonzero(&pair) > 0);
    let (s, r) = (
        pair.sender_metrics.snapshot(),
        pair.receiver_metrics.snapshot(),
    );
    assert_eq!((s.ipc_bytes_sent, r.ipc_bytes_received), (0, 0));
    assert_eq!(r.ipc_declined, 0, "another GPU is not a decline");
    pair.assert_released().await;
}

/// On one GPU, a receiver whose registered pool is not its device pool's mirror makes no offer:
/// the sender streams from its mirror, the blocks arrive right, and the receiver counts the
/// decline (the fallback an operator must see: `tandem_kv_ipc_declined_total`).
#[tokio::test]
async fn a_receiver_that_cannot_offer_ipc_on_its_gpu_counts_the_decline_and_takes_the_stream() {
    let small = common::small_layout();
    let pair = common::ipc_pair_mismatched_mirror(small, 4096).await;
    let (sent, got) = push_once(&pair, 3).await;
    assert_eq!(sent.data_mode, "inline");
    assert!(!got.on_device);
    assert_eq!(
        pair.mismatched(&common::scenarios::SRC, &common::scenarios::DST),
        0
    );
    let (s, r) = (
        pair.sender_metrics.snapshot(),
        pair.receiver_metrics.snapshot(),
    );
    assert_eq!((s.ipc_bytes_sent, r.ipc_bytes_received), (0, 0));
    assert_eq!(r.ipc_declined, 1, "one connection, declined once");
    pair.assert_released().await;
}

/// A sender with no GPU reaches a receiver that has one (and the reverse) over the stream.
#[tokio::test]
async fn a_plain_tcp_peer_and_an_ipc_peer_talk_over_the_stream_either_way() {
    use std::sync::Arc;
    use tandem_kv_transfer::device::HostDeviceKv;
    use tandem_kv_transfer::{KvPool, KvTransport, TcpKvTransport};

    let small = common::small_layout();
    for sender_has_gpu in [false, true] {
        let sender = TcpKvTransport::new(tandem_kv_transfer::TransferConfig::default()).unwrap();
        let receiver =
            Arc::new(TcpKvTransport::new(tandem_kv_transfer::TransferConfig::default()).unwrap());
        let source = common::source_pool(small, common::BLOCKS);
        let dst_pool = Arc::new(KvPool::new(small, common::BLOCKS).unwrap());
        let device = Arc::new(HostDeviceKv::new([9; 16], source.len_bytes()));
        if sender_has_gpu {
            device.write(0, unsafe {
                std::slice::from_raw_parts(source.as_ptr(), source.len_bytes())
            });
            sender.attach_device(device).unwrap();
        } else {
            receiver.attach_device(device).unwrap();
        }
        let src = sender.register(source).unwrap();
        let dst = receiver.register(dst_pool).unwrap();
        let receiver = Arc::new(tandem_kv_transfer::NetTransport::Tcp(
            Arc::into_inner(receiver).unwrap(),
        ));
        let (sent, got) = push_to(&sender, &src, receiver, dst).await;
        assert_eq!(
            sent.data_mode, "inline",
            "sender has a GPU: {sender_has_gpu}"
        );
        assert!(!got.on_device);
        assert_eq!(sent.block_checksums, got.block_checksums);
    }
}

/// A second data path is refused: a transport has at most one (UCX or CUDA IPC).
#[tokio::test]
async fn a_transport_takes_one_device_only() {
    use std::sync::Arc;
    use tandem_kv_transfer::device::HostDeviceKv;
    let t = tandem_kv_transfer::TcpKvTransport::new(tandem_kv_transfer::TransferConfig::default())
        .unwrap();
    t.attach_device(Arc::new(HostDeviceKv::new([1; 16], 64)))
        .unwrap();
    let e = t
        .attach_device(Arc::new(HostDeviceKv::new([1; 16], 64)))
        .unwrap_err();
    assert_eq!(
        e.kind(),
        tandem_kv_transfer::FailureKind::InvalidRequest,
        "{e}"
    );
}

/// A sender on a GPU pushing to a UCX receiver (whose pool UCX could map) is offered no UCX
/// keys (it asked for CUDA IPC): the bytes go in the stream, intact.
#[cfg(feature = "ucx")]
#[tokio::test]
async fn a_gpu_sender_reaches_a_ucx_receiver_over_the_stream() {
    use std::sync::Arc;
    use tandem_kv_transfer::device::HostDeviceKv;
    use tandem_kv_transfer::{
        KvTransport, TcpKvTransport, TransferConfig, UcxConfig, UcxKvTransport,
    };

    let small = common::small_layout();
    let sender = TcpKvTransport::new(TransferConfig::default()).unwrap();
    let source = common::source_pool(small, common::BLOCKS);
    let device = Arc::new(HostDeviceKv::new([4; 16], source.len_bytes()));
    // SAFETY: nothing else touches the fresh source pool.
    device.write(0, unsafe {
        std::slice::from_raw_parts(source.as_ptr(), source.len_bytes())
    });
    sender.attach_device(device).unwrap();
    let src = sender.register(source).unwrap();
    let ucx = UcxConfig {
        tls: Some("shm".into()),
        ..Default::default()
    };
    let receiver = UcxKvTransport::new(TransferConfig::default(), ucx).unwrap();
    let dst = receiver.allocate(small, common::BLOCKS).unwrap();
    let receiver = Arc::new(tandem_kv_transfer::NetTransport::Ucx(receiver));
    let (sent, got) = push_to(&sender, &src, receiver, dst).await;
    assert_eq!(sent.data_mode, "inline");
    assert!(!got.on_device);
    assert_eq!(sent.block_checksums, got.block_checksums);
}
