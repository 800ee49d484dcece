//! The fail-closed behaviours over the TCP transport (loopback, one process, port 0).

use crate::common;

scenario_tests!(common::tcp_pair);

/// A push that lost a chunk, with 10 s left on both its deadline and the reservation's TTL, is
/// ended by the receiver's stall timeout (300 ms without a landed chunk): the receiver reports
/// `DeadlineExceeded` in the data phase, the sender learns it through the abort, and nothing is
/// held afterwards; long before either 10 s bound.
#[tokio::test]
async fn a_push_that_stops_landing_ends_at_the_receivers_stall_timeout() {
    use std::future::IntoFuture;
    use std::time::{Duration, Instant};
    use tandem_kv_transfer::{Fault, Phase, PushRequest, Reservation, TransferError};
    use tokio_util::sync::CancellationToken;

    let small = common::small_layout();
    let stall = Duration::from_millis(300);
    let pair = common::tcp_pair_with_stall_timeout(small, small, Some(stall)).await;
    let (src, dst) = (common::scenarios::SRC, common::scenarios::DST);
    let inbound = pair
        .registry
        .expect(Reservation {
            reservation_id: 21,
            epoch: 1,
            dst_blocks: dst.to_vec(),
            ttl: Duration::from_secs(10),
        })
        .unwrap();
    let req = PushRequest::new(pair.peer.clone(), 21, 1, src.to_vec(), dst.to_vec())
        .deadline(Duration::from_secs(10))
        .fault(Fault::DropChunk { index: 1 });
    let t0 = Instant::now();
    let out = pair
        .sender
        .push(&pair.src, req, CancellationToken::new())
        .unwrap();
    let (sent, got) = tokio::join!(out.into_future(), inbound.into_future());
    let took = t0.elapsed();
    let got = got.unwrap_err();
    assert!(
        matches!(got, TransferError::DeadlineExceeded { phase: Phase::Data, deadline } if deadline == stall),
        "{got}"
    );
    let sent = sent.unwrap_err();
    assert!(
        sent.retry_safe(),
        "the sender may push again elsewhere: {sent}"
    );
    assert!(
        took < Duration::from_secs(5),
        "ended after {took:?}, not at the stall timeout"
    );
    pair.assert_released().await;
}

/// A reservation nobody has begun to fill is not "stalled": only its TTL ends it (a prefill
/// node may still be computing the prompt).
#[tokio::test]
async fn an_unclaimed_reservation_is_ended_by_its_ttl_not_the_stall_timeout() {
    use std::time::{Duration, Instant};
    use tandem_kv_transfer::{Reservation, TransferError};

    let small = common::small_layout();
    let pair =
        common::tcp_pair_with_stall_timeout(small, small, Some(Duration::from_millis(100))).await;
    let t0 = Instant::now();
    let inbound = pair
        .registry
        .expect(Reservation {
            reservation_id: 22,
            epoch: 1,
            dst_blocks: common::scenarios::DST.to_vec(),
            ttl: Duration::from_millis(600),
        })
        .unwrap();
    let got = inbound.await.unwrap_err();
    assert!(
        matches!(
            got,
            TransferError::ReservationExpired { reservation_id: 22 }
        ),
        "{got}"
    );
    assert!(
        t0.elapsed() >= Duration::from_millis(600),
        "{:?}",
        t0.elapsed()
    );
    pair.assert_released().await;
}
