//! Two real processes: this test process and `tandem-kv-peer` children, over TCP and UCX (shared
//! memory and tcp). Bytes are checked slab by slab against the seeded pattern in the process
//! that receives them; process death and every fault mode must end in a typed error and leave
//! nothing held on either side.

use crate::common;

use std::future::IntoFuture;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use common::{SEED, wait_for};
use tandem_kv_transfer::peer::{PeerProcess, PoolArgs, TransportArgs};
use tandem_kv_transfer::{
    FailureKind, InboundRegistry, KvPool, KvTransport, LayoutName, MetricsSnapshot, NetTransport,
    PushRequest, Reservation, TransferError, TransportKind, UcxDataMode, pattern,
};
use tokio_util::sync::CancellationToken;

const SRC: [u32; 6] = [0, 1, 2, 3, 12, 7];
const DST: [u32; 6] = [4, 5, 6, 7, 0, 15];
const BLOCKS: usize = 16;

fn peer_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_tandem-kv-peer"))
}

fn transport(kind: TransportKind, tls: Option<&str>) -> TransportArgs {
    TransportArgs {
        transport: kind,
        ucx_tls: tls.map(str::to_string),
        ucx_data_mode: UcxDataMode::Auto,
        // One layer per chunk of the small layout, so faults can land mid-transfer.
        max_chunk_bytes: 8 << 10,
        // Shared-memory copies take the streaming-store path the big transfers take (the
        // in-process tests cover plain stores).
        streaming_store_min_bytes: 0,
    }
}

fn pool_args() -> PoolArgs {
    PoolArgs {
        layout: LayoutName::Small,
        block_tokens: 4,
        blocks: BLOCKS,
        seed: SEED,
    }
}

fn csv(blocks: &[u32]) -> String {
    blocks
        .iter()
        .map(|b| b.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// A receiver in this process: (transport, registry, address, shutdown).
async fn local_receiver(
    t: &TransportArgs,
) -> (
    Arc<NetTransport>,
    InboundRegistry,
    String,
    CancellationToken,
) {
    let transport = Arc::new(t.build().unwrap());
    let layout = LayoutName::Small.layout(4).unwrap();
    let reg = transport
        .register(Arc::new(KvPool::new(layout, BLOCKS).unwrap()))
        .unwrap();
    let registry = InboundRegistry::new(reg, Duration::from_millis(500));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let shutdown = CancellationToken::new();
    let (tr, r, s) = (Arc::clone(&transport), registry.clone(), shutdown.clone());
    tokio::spawn(async move { tr.serve(listener, r, s).await.unwrap() });
    (transport, registry, addr, shutdown)
}

async fn spawn_pusher(
    t: &TransportArgs,
    addr: &str,
    reservation: u64,
    extra: &[&str],
) -> PeerProcess {
    let mut args: Vec<String> = vec!["push".into()];
    args.extend(t.to_args());
    args.extend(pool_args().to_args());
    args.extend([
        "--connect".into(),
        addr.into(),
        "--reservation".into(),
        reservation.to_string(),
    ]);
    args.extend(["--src".into(), csv(&SRC), "--dst".into(), csv(&DST)]);
    args.extend(extra.iter().map(|s| s.to_string()));
    PeerProcess::spawn(&peer_bin(), &args).await.unwrap()
}

/// Reads the pusher's `RESULT` and `METRICS` lines.
async fn pusher_outcome(p: &mut PeerProcess) -> (String, MetricsSnapshot) {
    let mut result = p.line().await.unwrap();
    while result == "FIRST_LAYER_READY" {
        result = p.line().await.unwrap();
    }
    let metrics = p.line().await.unwrap();
    let json = metrics.strip_prefix("METRICS ").expect("METRICS line");
    (result, serde_json::from_str(json).unwrap())
}

/// This process pushes to a `serve` child, which checks every byte.
async fn push_to_child_receiver(t: TransportArgs, expect_mode: &str) {
    let mut args: Vec<String> = vec!["serve".into()];
    args.extend(t.to_args());
    args.extend(pool_args().to_args());
    let mut child = PeerProcess::spawn(&peer_bin(), &args).await.unwrap();
    let addr = child.addr.clone().unwrap();
    let sender = t.build().unwrap();
    let mut pool = KvPool::new(LayoutName::Small.layout(4).unwrap(), BLOCKS).unwrap();
    pattern::fill_blocks(&mut pool, SEED, &SRC).unwrap();
    let src = sender.register(Arc::new(pool)).unwrap();
    for id in 1..=3u64 {
        child
            .reserve(id, 1, Duration::from_secs(30), true, &DST)
            .await
            .unwrap();
        let req = PushRequest::new(&addr, id, 1, SRC.to_vec(), DST.to_vec());
        let report = sender
            .push(&src, req, CancellationToken::new())
            .unwrap()
            .await
            .unwrap();
        assert_eq!(report.data_mode, expect_mode);
        let line = child.line().await.unwrap();
        assert_eq!(
            line,
            format!("RESULT {id} ok {} 0", report.bytes),
            "0 = no slab differs from its source"
        );
    }
    child.send("metrics").await.unwrap();
    let m: MetricsSnapshot = serde_json::from_str(
        child
            .line()
            .await
            .unwrap()
            .strip_prefix("METRICS ")
            .unwrap(),
    )
    .unwrap();
    assert_eq!((m.inbound_succeeded, m.live_reservations), (3, 0));
    assert!(child.quit().await.unwrap().success());
}

#[tokio::test]
async fn two_processes_move_blocks_over_tcp_byte_for_byte() {
    push_to_child_receiver(transport(TransportKind::Tcp, None), "inline").await;
}

#[cfg(feature = "ucx")]
#[tokio::test]
async fn two_processes_move_blocks_over_ucx_shared_memory_with_one_sided_puts() {
    push_to_child_receiver(transport(TransportKind::Ucx, Some("shm")), "rma-mapped").await;
}

#[cfg(feature = "ucx")]
#[tokio::test]
async fn two_processes_move_blocks_over_ucx_tcp_with_tagged_sends() {
    push_to_child_receiver(transport(TransportKind::Ucx, Some("tcp")), "tag").await;
}

/// A child pushes into this process; checks bytes, or the fault's typed error on both sides.
async fn child_pushes_into_local_receiver(t: TransportArgs) {
    let (rx_transport, registry, addr, _shutdown) = local_receiver(&t).await;
    let cases: [(&[&str], Result<(), FailureKind>, FailureKind); 5] = [
        (&[], Ok(()), FailureKind::Io),
        (
            &["--fault", "corrupt:5000"],
            Err(FailureKind::ChecksumMismatch),
            FailureKind::ChecksumMismatch,
        ),
        (
            &["--fault", "cut:9000"],
            Err(FailureKind::PeerGone),
            FailureKind::PeerGone,
        ),
        (
            &["--fault", "drop:1", "--deadline-ms", "300"],
            Err(FailureKind::DeadlineExceeded),
            FailureKind::DeadlineExceeded,
        ),
        (&["--fault", "delay-ms:3"], Ok(()), FailureKind::Io),
    ];
    for (i, (extra, want, sender_kind)) in cases.into_iter().enumerate() {
        let id = 10 + i as u64;
        let inbound = registry
            .expect(Reservation {
                reservation_id: id,
                epoch: 1,
                dst_blocks: DST.to_vec(),
                ttl: Duration::from_secs(20),
            })
            .unwrap();
        let mut child = spawn_pusher(&t, &addr, id, extra).await;
        let got = inbound.await;
        let (line, m) = pusher_outcome(&mut child).await;
        match want {
            Ok(()) => {
                let r = got.unwrap_or_else(|e| panic!("case {extra:?}: {e}"));
                assert_eq!(line, format!("RESULT ok {}", r.bytes));
                // SAFETY: the reservation resolved; nothing writes these blocks now.
                let bad = unsafe {
                    pattern::mismatched_slabs(registry.registration().pool(), SEED, &SRC, &DST)
                };
                assert_eq!(bad.unwrap(), 0, "destination bytes equal source bytes");
            }
            Err(kind) => {
                let e = got.expect_err("fault must fail the reservation");
                assert_eq!(e.kind(), kind, "case {extra:?}: receiver got {e}");
                assert_eq!(
                    line,
                    format!("RESULT err {}", sender_kind.as_str()),
                    "case {extra:?}"
                );
            }
        }
        assert_eq!(
            (m.live_transfers, m.live_registrations),
            (0, 0),
            "child leaked: {m:?}"
        );
        assert_eq!(registry.live_reservations(), 0);
    }
    wait_for("receiver to release its connections", || {
        rx_transport.metrics().snapshot().live_connections == 0
    })
    .await;
    assert_eq!(rx_transport.metrics().snapshot().live_reservations, 0);
}

#[tokio::test]
async fn every_fault_mode_across_processes_over_tcp_yields_its_typed_error_and_no_leak() {
    child_pushes_into_local_receiver(transport(TransportKind::Tcp, None)).await;
}

#[cfg(feature = "ucx")]
#[tokio::test]
async fn every_fault_mode_across_processes_over_ucx_shm_yields_its_typed_error_and_no_leak() {
    child_pushes_into_local_receiver(transport(TransportKind::Ucx, Some("shm"))).await;
}

#[cfg(feature = "ucx")]
#[tokio::test]
async fn every_fault_mode_across_processes_over_ucx_tcp_yields_its_typed_error_and_no_leak() {
    child_pushes_into_local_receiver(transport(TransportKind::Ucx, Some("tcp"))).await;
}

/// The sending process dies after its first layer: the receiver must fail the reservation
/// promptly with `PeerGone` and hold nothing.
async fn sender_death_releases_the_reservation(t: TransportArgs) {
    let (rx_transport, registry, addr, _shutdown) = local_receiver(&t).await;
    let inbound = registry
        .expect(Reservation {
            reservation_id: 1,
            epoch: 1,
            dst_blocks: DST.to_vec(),
            ttl: Duration::from_secs(60),
        })
        .unwrap();
    let mut child = spawn_pusher(&t, &addr, 1, &["--layer-delay-ms", "300"]).await;
    assert_eq!(child.line().await.unwrap(), "FIRST_LAYER_READY");
    tokio::time::sleep(Duration::from_millis(50)).await; // the first chunk is on its way
    child.kill().await.unwrap();
    let e = tokio::time::timeout(Duration::from_secs(5), inbound.into_future())
        .await
        .expect("the receiver notices the dead sender promptly")
        .unwrap_err();
    assert!(matches!(e, TransferError::PeerGone { .. }), "{e}");
    assert_eq!(registry.live_reservations(), 0);
    wait_for("receiver to drop the dead connection", || {
        rx_transport.metrics().snapshot().live_connections == 0
    })
    .await;
}

#[tokio::test]
async fn sender_process_death_over_tcp_fails_the_reservation_with_peer_gone() {
    sender_death_releases_the_reservation(transport(TransportKind::Tcp, None)).await;
}

#[cfg(feature = "ucx")]
#[tokio::test]
async fn sender_process_death_over_ucx_shm_fails_the_reservation_with_peer_gone() {
    sender_death_releases_the_reservation(transport(TransportKind::Ucx, Some("shm"))).await;
}

/// The receiving process dies mid-push: the push must fail promptly with `PeerGone`, and the
/// sender must hold no transfer or connection afterwards.
async fn receiver_death_fails_the_push(t: TransportArgs) {
    let mut args: Vec<String> = vec!["serve".into()];
    args.extend(t.to_args());
    args.extend(pool_args().to_args());
    let mut child = PeerProcess::spawn(&peer_bin(), &args).await.unwrap();
    let addr = child.addr.clone().unwrap();
    let sender = t.build().unwrap();
    let mut pool = KvPool::new(LayoutName::Small.layout(4).unwrap(), BLOCKS).unwrap();
    pattern::fill_blocks(&mut pool, SEED, &SRC).unwrap();
    let src = sender.register(Arc::new(pool)).unwrap();
    child
        .reserve(1, 1, Duration::from_secs(60), false, &DST)
        .await
        .unwrap();
    let req = PushRequest::new(&addr, 1, 1, SRC.to_vec(), DST.to_vec()).streamed();
    let out = sender.push(&src, req, CancellationToken::new()).unwrap();
    out.layers_ready(1);
    tokio::time::sleep(Duration::from_millis(100)).await;
    child.kill().await.unwrap();
    let e = tokio::time::timeout(Duration::from_secs(5), out.into_future())
        .await
        .expect("the sender notices the dead receiver promptly")
        .unwrap_err();
    assert!(matches!(e, TransferError::PeerGone { .. }), "{e}");
    assert!(e.retry_safe() && e.needs_new_reservation());
    let m = sender.metrics();
    wait_for("sender to release the transfer and connection", || {
        let s = m.snapshot();
        s.live_transfers == 0 && s.live_connections == 0
    })
    .await;
}

#[tokio::test]
async fn receiver_process_death_over_tcp_fails_the_push_with_peer_gone() {
    receiver_death_fails_the_push(transport(TransportKind::Tcp, None)).await;
}

#[cfg(feature = "ucx")]
#[tokio::test]
async fn receiver_process_death_over_ucx_shm_fails_the_push_with_peer_gone() {
    receiver_death_fails_the_push(transport(TransportKind::Ucx, Some("shm"))).await;
}

#[cfg(feature = "ucx")]
#[tokio::test]
async fn receiver_process_death_over_ucx_tcp_fails_the_push_with_peer_gone() {
    receiver_death_fails_the_push(transport(TransportKind::Ucx, Some("tcp"))).await;
}
