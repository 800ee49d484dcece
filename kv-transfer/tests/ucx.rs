//! The fail-closed behaviours over UCX, in one process: shared memory with UCX-allocated pools
//! (the sender writes through its mapping of the receiver's pool), shared memory with registered
//! heap pools (`ucp_put_nbx`), and tcp (tagged sends, since UCX emulates RMA over tcp).
#![cfg(feature = "ucx")]

mod common;

use common::scenarios as s;
use common::{small_layout, ucx_pair};
use tandem_kv_layout::KvLayout;

macro_rules! ucx_suite {
    ($modname:ident, $tls:expr, $allocated:expr) => {
        mod $modname {
            use super::*;

            async fn pair() -> common::Pair {
                ucx_pair(small_layout(), small_layout(), $tls, $allocated).await
            }

            #[tokio::test]
            async fn every_layer_of_every_block_arrives_intact() {
                s::every_layer_of_every_block_arrives_intact(&pair().await).await;
            }

            #[tokio::test]
            async fn streamed_layers_complete_only_when_the_last_layer_lands() {
                s::streamed_layers_complete_only_when_the_last_layer_lands(&pair().await).await;
            }

            #[tokio::test]
            async fn layout_mismatch_is_refused_before_any_byte_is_written() {
                let other = KvLayout {
                    model_fingerprint: 1,
                    ..small_layout()
                };
                s::layout_mismatch_is_refused_before_any_byte_is_written(
                    &ucx_pair(small_layout(), other, $tls, $allocated).await,
                )
                .await;
            }

            #[tokio::test]
            async fn unknown_stale_and_expired_reservations_are_refused_without_writing() {
                s::unknown_stale_and_expired_reservations_are_refused_without_writing(
                    &pair().await,
                )
                .await;
            }

            #[tokio::test]
            async fn a_corrupted_byte_is_always_detected_and_never_marked_ready() {
                s::a_corrupted_byte_is_always_detected_and_never_marked_ready(&pair().await).await;
            }

            #[tokio::test]
            async fn sender_cancel_ends_both_sides_and_releases_everything() {
                s::sender_cancel_ends_both_sides_and_releases_everything(&pair().await).await;
            }

            #[tokio::test]
            async fn receiver_cancel_ends_both_sides_and_releases_everything() {
                s::receiver_cancel_ends_both_sides_and_releases_everything(&pair().await).await;
            }

            #[tokio::test]
            async fn reservation_expiry_mid_transfer_ends_both_sides() {
                s::reservation_expiry_mid_transfer_ends_both_sides(&pair().await).await;
            }

            #[tokio::test]
            async fn a_dropped_chunk_ends_in_a_deadline_error_and_no_leak() {
                s::a_dropped_chunk_ends_in_a_deadline_error_and_no_leak(&pair().await).await;
            }

            #[tokio::test]
            async fn delayed_chunks_still_arrive_intact() {
                s::delayed_chunks_still_arrive_intact(&pair().await).await;
            }

            #[tokio::test]
            async fn a_cut_connection_ends_both_sides_and_the_next_push_reconnects() {
                s::a_cut_connection_ends_both_sides_and_the_next_push_reconnects(&pair().await)
                    .await;
            }
        }
    };
}

ucx_suite!(shm_mapped, "shm", true);
ucx_suite!(shm_put, "shm", false);
ucx_suite!(tcp, "tcp", false);

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
