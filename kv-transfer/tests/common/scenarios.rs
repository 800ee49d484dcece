//! Behaviours every transport must show, written once and run against each.
#![allow(dead_code)]

use std::future::IntoFuture;
use std::time::Duration;

use tandem_kv_transfer::{FailureKind, Fault, PushRequest, Reservation, Side, TransferError};
use tokio_util::sync::CancellationToken;

use super::Pair;

/// Source → destination pairs with runs, gaps and reordering.
pub const SRC: [u32; 7] = [0, 1, 2, 3, 9, 10, 5];
pub const DST: [u32; 7] = [15, 14, 8, 9, 10, 11, 2];

fn reserve(
    pair: &Pair,
    id: u64,
    epoch: u64,
    dst: &[u32],
    ttl: Duration,
) -> tandem_kv_transfer::InboundTransfer {
    pair.registry
        .expect(Reservation {
            reservation_id: id,
            epoch,
            dst_blocks: dst.to_vec(),
            ttl,
        })
        .expect("reservation accepted")
}

fn push(pair: &Pair, id: u64, epoch: u64) -> PushRequest {
    PushRequest::new(pair.peer.clone(), id, epoch, SRC.to_vec(), DST.to_vec())
        .deadline(Duration::from_secs(10))
}

fn payload_bytes(pair: &Pair) -> u64 {
    let l = pair.src.pool().layout();
    (l.num_layers * l.slab_bytes() * SRC.len()) as u64
}

pub async fn every_layer_of_every_block_arrives_intact(pair: &Pair) {
    let inbound = reserve(pair, 1, 1, &DST, Duration::from_secs(10));
    let out = pair
        .sender
        .push(
            &pair.src,
            push(pair, 1, 1).request_id(42),
            CancellationToken::new(),
        )
        .unwrap();
    let (sent, got) = tokio::join!(out.into_future(), inbound.into_future());
    let (sent, got) = (
        sent.expect("push succeeds"),
        got.expect("reservation fills"),
    );
    assert_eq!(sent.bytes, payload_bytes(pair));
    assert_eq!(got.bytes, payload_bytes(pair));
    assert_eq!(got.request_id, 42);
    assert_eq!(got.src_blocks, SRC.to_vec());
    assert_eq!(sent.block_checksums, got.block_checksums);
    assert_eq!(
        pair.mismatched(&SRC, &DST),
        0,
        "destination bytes equal source bytes"
    );
    pair.assert_released().await;
    let s = pair.sender_metrics.snapshot();
    assert_eq!((s.transfers_started, s.transfers_succeeded), (1, 1));
    assert_eq!(
        pair.receiver_metrics.snapshot().bytes_received,
        payload_bytes(pair)
    );
}

pub async fn streamed_layers_complete_only_when_the_last_layer_lands(pair: &Pair) {
    let layers = pair.src.pool().layout().num_layers as u32;
    let inbound = reserve(pair, 2, 1, &DST, Duration::from_secs(10));
    let out = pair
        .sender
        .push(
            &pair.src,
            push(pair, 2, 1).streamed(),
            CancellationToken::new(),
        )
        .unwrap();
    let mut inbound = Box::pin(inbound.into_future());
    for l in 1..layers {
        out.layers_ready(l);
        let early = tokio::time::timeout(Duration::from_millis(30), &mut inbound).await;
        assert!(
            early.is_err(),
            "reservation resolved with only {l} of {layers} layers ready"
        );
    }
    out.layers_ready(layers);
    let got = inbound.await.expect("fills once every layer is ready");
    out.await.expect("push succeeds");
    assert_eq!(got.bytes, payload_bytes(pair));
    assert_eq!(pair.mismatched(&SRC, &DST), 0);
    pair.assert_released().await;
}

/// `pair` must join pools whose layouts differ.
pub async fn layout_mismatch_is_refused_before_any_byte_is_written(pair: &Pair) {
    let inbound = reserve(pair, 3, 1, &DST, Duration::from_secs(10));
    let out = pair
        .sender
        .push(&pair.src, push(pair, 3, 1), CancellationToken::new())
        .unwrap();
    let err = out.await.expect_err("mismatched layouts must be refused");
    assert!(matches!(err, TransferError::LayoutMismatch { .. }), "{err}");
    assert!(!err.retry_safe());
    assert_eq!(
        pair.dst_nonzero_bytes(),
        0,
        "no byte may land in the receiver's pool"
    );
    assert!(matches!(
        inbound.cancel().await,
        Err(TransferError::Cancelled { by: Side::Local })
    ));
    pair.assert_released().await;
}

pub async fn unknown_stale_and_expired_reservations_are_refused_without_writing(pair: &Pair) {
    let out = pair
        .sender
        .push(&pair.src, push(pair, 404, 1), CancellationToken::new())
        .unwrap();
    let err = out.await.unwrap_err();
    assert!(
        matches!(
            err,
            TransferError::UnknownReservation {
                reservation_id: 404
            }
        ),
        "{err}"
    );
    assert!(err.retry_safe() && err.needs_new_reservation());

    let inbound = reserve(pair, 5, 2, &DST, Duration::from_secs(10));
    let out = pair
        .sender
        .push(&pair.src, push(pair, 5, 1), CancellationToken::new())
        .unwrap();
    let err = out.await.unwrap_err();
    assert!(
        matches!(
            err,
            TransferError::StaleEpoch {
                reservation_id: 5,
                current: 2,
                requested: 1
            }
        ),
        "{err}"
    );
    inbound.cancel().await.unwrap_err();

    let inbound = reserve(pair, 6, 1, &DST, Duration::from_millis(1));
    let err = inbound.await.unwrap_err();
    assert!(
        matches!(err, TransferError::ReservationExpired { reservation_id: 6 }),
        "{err}"
    );
    let out = pair
        .sender
        .push(&pair.src, push(pair, 6, 1), CancellationToken::new())
        .unwrap();
    let err = out.await.unwrap_err();
    assert!(
        matches!(err, TransferError::ReservationExpired { reservation_id: 6 }),
        "{err}"
    );
    assert_eq!(pair.dst_nonzero_bytes(), 0);
    pair.assert_released().await;
    assert!(
        pair.receiver_metrics
            .failures(FailureKind::UnknownReservation)
            >= 1
    );
}

pub async fn a_corrupted_byte_is_always_detected_and_never_marked_ready(pair: &Pair) {
    let total = payload_bytes(pair);
    let mut rng = 0x1234_5678u64;
    let mut offsets = vec![0, total - 1, total / 2];
    for _ in 0..5 {
        rng = rng
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        offsets.push((rng >> 11) % total);
    }
    for (i, &offset) in offsets.iter().enumerate() {
        let id = 100 + i as u64;
        let inbound = reserve(pair, id, 1, &DST, Duration::from_secs(10));
        let req = push(pair, id, 1).fault(Fault::CorruptByte { offset });
        let out = pair
            .sender
            .push(&pair.src, req, CancellationToken::new())
            .unwrap();
        let (sent, got) = tokio::join!(out.into_future(), inbound.into_future());
        let got = got.expect_err("a corrupted transfer must not be marked ready");
        assert!(
            matches!(got, TransferError::ChecksumMismatch { .. }),
            "offset {offset}: {got}"
        );
        let sent = sent.expect_err("the sender must hear about the corruption");
        assert!(
            matches!(sent, TransferError::ChecksumMismatch { .. }),
            "offset {offset}: {sent}"
        );
        assert!(sent.retry_safe() && !sent.needs_new_reservation());
    }
    pair.assert_released().await;
    assert_eq!(pair.receiver_metrics.snapshot().inbound_succeeded, 0);
}

pub async fn sender_cancel_ends_both_sides_and_releases_everything(pair: &Pair) {
    let inbound = reserve(pair, 7, 1, &DST, Duration::from_secs(10));
    let cancel = CancellationToken::new();
    let out = pair
        .sender
        .push(&pair.src, push(pair, 7, 1).streamed(), cancel.clone())
        .unwrap();
    out.layers_ready(1);
    let mut inbound = Box::pin(inbound.into_future());
    assert!(
        tokio::time::timeout(Duration::from_millis(30), &mut inbound)
            .await
            .is_err()
    );
    cancel.cancel();
    let sent = out.await.unwrap_err();
    assert!(
        matches!(sent, TransferError::Cancelled { by: Side::Local }),
        "{sent}"
    );
    let got = inbound.await.unwrap_err();
    assert!(
        matches!(got, TransferError::Cancelled { by: Side::Peer }),
        "{got}"
    );
    pair.assert_released().await;
}

pub async fn receiver_cancel_ends_both_sides_and_releases_everything(pair: &Pair) {
    let inbound = reserve(pair, 8, 1, &DST, Duration::from_secs(10));
    let out = pair
        .sender
        .push(
            &pair.src,
            push(pair, 8, 1).streamed(),
            CancellationToken::new(),
        )
        .unwrap();
    out.layers_ready(1);
    tokio::time::sleep(Duration::from_millis(20)).await; // let the transfer claim the reservation
    let got = inbound.cancel().await.unwrap_err();
    assert!(
        matches!(got, TransferError::Cancelled { by: Side::Local }),
        "{got}"
    );
    let sent = out.await.unwrap_err();
    assert!(
        matches!(sent, TransferError::Cancelled { by: Side::Peer }),
        "{sent}"
    );
    pair.assert_released().await;
}

pub async fn reservation_expiry_mid_transfer_ends_both_sides(pair: &Pair) {
    let inbound = reserve(pair, 9, 1, &DST, Duration::from_millis(150));
    let out = pair
        .sender
        .push(
            &pair.src,
            push(pair, 9, 1).streamed(),
            CancellationToken::new(),
        )
        .unwrap();
    out.layers_ready(1);
    let got = inbound.await.unwrap_err();
    assert!(
        matches!(got, TransferError::ReservationExpired { reservation_id: 9 }),
        "{got}"
    );
    let sent = out.await.unwrap_err();
    assert!(
        matches!(sent, TransferError::ReservationExpired { .. }),
        "{sent}"
    );
    assert!(sent.needs_new_reservation());
    pair.assert_released().await;
}

pub async fn a_dropped_chunk_ends_in_a_deadline_error_and_no_leak(pair: &Pair) {
    let inbound = reserve(pair, 10, 1, &DST, Duration::from_secs(10));
    let req = push(pair, 10, 1)
        .fault(Fault::DropChunk { index: 0 })
        .deadline(Duration::from_millis(200));
    let out = pair
        .sender
        .push(&pair.src, req, CancellationToken::new())
        .unwrap();
    let (sent, got) = tokio::join!(out.into_future(), inbound.into_future());
    let sent = sent.unwrap_err();
    assert!(
        matches!(sent, TransferError::DeadlineExceeded { .. }),
        "{sent}"
    );
    let got = got.unwrap_err();
    assert!(
        matches!(got, TransferError::DeadlineExceeded { .. }),
        "{got}"
    );
    pair.assert_released().await;
    assert_eq!(
        pair.sender_metrics.failures(FailureKind::DeadlineExceeded),
        1
    );
}

pub async fn delayed_chunks_still_arrive_intact(pair: &Pair) {
    let inbound = reserve(pair, 11, 1, &DST, Duration::from_secs(10));
    let req = push(pair, 11, 1).fault(Fault::DelayChunks {
        delay: Duration::from_millis(5),
    });
    let out = pair
        .sender
        .push(&pair.src, req, CancellationToken::new())
        .unwrap();
    let (sent, got) = tokio::join!(out.into_future(), inbound.into_future());
    let sent = sent.expect("a slow sender still succeeds");
    got.expect("and fills the reservation");
    assert!(sent.elapsed >= Duration::from_millis(5));
    assert_eq!(pair.mismatched(&SRC, &DST), 0);
    pair.assert_released().await;
}

pub async fn a_cut_connection_ends_both_sides_and_the_next_push_reconnects(pair: &Pair) {
    let inbound = reserve(pair, 12, 1, &DST, Duration::from_secs(10));
    let req = push(pair, 12, 1).fault(Fault::CutAfterBytes { bytes: 3000 });
    let out = pair
        .sender
        .push(&pair.src, req, CancellationToken::new())
        .unwrap();
    let (sent, got) = tokio::join!(out.into_future(), inbound.into_future());
    let sent = sent.unwrap_err();
    assert!(matches!(sent, TransferError::PeerGone { .. }), "{sent}");
    assert!(sent.retry_safe());
    let got = got.unwrap_err();
    assert!(matches!(got, TransferError::PeerGone { .. }), "{got}");
    pair.assert_released().await;

    let inbound = reserve(pair, 13, 1, &DST, Duration::from_secs(10));
    let out = pair
        .sender
        .push(&pair.src, push(pair, 13, 1), CancellationToken::new())
        .unwrap();
    let (sent, got) = tokio::join!(out.into_future(), inbound.into_future());
    sent.expect("a retry after the cut succeeds");
    got.expect("and fills the new reservation");
    assert_eq!(pair.mismatched(&SRC, &DST), 0);
    pair.assert_released().await;
}
