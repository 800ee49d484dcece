//! The fail-closed behaviours over the TCP transport (loopback, one process, port 0).

mod common;

use common::scenarios as s;
use common::{small_layout, tcp_pair};
use tandem_kv_layout::KvLayout;

async fn pair() -> common::Pair {
    tcp_pair(small_layout(), small_layout()).await
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
        &tcp_pair(small_layout(), other).await,
    )
    .await;
}

#[tokio::test]
async fn unknown_stale_and_expired_reservations_are_refused_without_writing() {
    s::unknown_stale_and_expired_reservations_are_refused_without_writing(&pair().await).await;
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
    s::a_cut_connection_ends_both_sides_and_the_next_push_reconnects(&pair().await).await;
}
