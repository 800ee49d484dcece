//! [`Reservation`]: the one owner, on the router's side, of KV blocks reserved on a decode node
//! for one attempt (docs/ARCHITECTURE.md, "A request's path", steps 7 and 13).
//!
//! It holds together what used to be three separate records of the same reservation: the node's
//! answer (the [`pb::KvTarget`]: id, epoch, blocks, KV address), the node's dispatch count (the
//! in-flight request and blocks the router's load estimate charges to that node), and the duty
//! to release the blocks if no Decode call finishes with them.
//!
//! ```text
//!  reserve() ─▶ Reservation (armed) ─▶ Prefill (target) ─▶ Decode (id, epoch) ─▶ Final: disarm
//!                   │ dropped armed (a failure, a retry, a client gone, a panic)
//!                   ▼
//!             Release(id, epoch) from a spawned task, and the dispatch count goes with it
//! ```
//!
//! `Release` is idempotent and carries the reservation's epoch, so releasing a reservation that a
//! cancelled Decode call had already claimed and freed is harmless: the node answers
//! `released: false`, and blocks reused under a newer epoch are never touched. The reservation
//! is therefore kept armed on every path except a completed Decode stream. Dropping it without a
//! runtime (process exit) leaves the blocks to the node's own expiry.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tandem_proto::v1 as pb;
use tandem_proto::v1::ReleaseRequest;
use tandem_proto::v1::decode_client::DecodeClient;
use tonic::transport::Channel;

use crate::nodes::Dispatch;
use crate::stats::{RouterStats, bump};

/// KV blocks reserved on a decode node for one attempt; released on drop unless disarmed.
#[derive(Debug)]
pub(super) struct Reservation {
    target: pb::KvTarget,
    client: DecodeClient<Channel>,
    node_id: String,
    /// Counts the request (and its blocks) on the node while the reservation lives.
    dispatch: Dispatch,
    rpc_timeout: Duration,
    stats: Arc<RouterStats>,
    /// When the node frees the blocks unless a Decode call claims them (`None`: the node's
    /// answer gave no usable expiry).
    expires: Option<tokio::time::Instant>,
    armed: bool,
}

impl Reservation {
    /// Takes ownership of a granted reservation, which the node frees unclaimed at
    /// `expires_at_unix_ms` (its clock).
    pub(super) fn new(
        dispatch: Dispatch,
        client: DecodeClient<Channel>,
        target: pb::KvTarget,
        expires_at_unix_ms: u64,
        rpc_timeout: Duration,
        stats: Arc<RouterStats>,
    ) -> Self {
        Self {
            node_id: dispatch.node().node_id(),
            target,
            client,
            dispatch,
            rpc_timeout,
            stats,
            expires: expires_in(expires_at_unix_ms, SystemTime::now())
                .map(|left| tokio::time::Instant::now() + left),
            armed: true,
        }
    }

    /// When the reservation expires unclaimed, on this process's clock: past it, no KV can land
    /// in it, so an attempt still waiting for its prefill has lost it.
    pub(super) fn expires(&self) -> Option<tokio::time::Instant> {
        self.expires
    }

    /// The decode node's load when it was chosen (conditional disaggregation weighs its
    /// pending prompt tokens).
    pub(super) fn node_load(&self) -> Option<crate::routing::LoadEstimate> {
        self.dispatch.load()
    }

    /// Where the prefill node pushes the KV, and what the Decode call presents.
    pub(super) fn target(&self) -> &pb::KvTarget {
        &self.target
    }

    /// The decode node holding the blocks.
    pub(super) fn node_id(&self) -> &str {
        &self.node_id
    }

    /// A client of the decode node (the channel is shared).
    pub(super) fn client(&self) -> DecodeClient<Channel> {
        self.client.clone()
    }

    /// The Decode stream finished: the node freed the blocks itself.
    pub(super) fn disarm(&mut self) {
        self.armed = false;
    }
}

/// How long until `expires_at_unix_ms` by the clock reading `now`: `None` when the node sent
/// none (0) or one that is not in the future, which only a clock far behind the router's gives
/// (the attempt then waits without the reservation's bound, as it would for an older node).
fn expires_in(expires_at_unix_ms: u64, now: SystemTime) -> Option<Duration> {
    let now_ms = now.duration_since(UNIX_EPOCH).ok()?.as_millis() as u64;
    let left_ms = expires_at_unix_ms.checked_sub(now_ms).filter(|&ms| ms > 0)?;
    Some(Duration::from_millis(left_ms))
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            // No runtime (process exit): the reservation expires on the node.
            return;
        };
        bump(&self.stats.releases);
        let mut client = self.client.clone();
        let mut request = tonic::Request::new(ReleaseRequest {
            reservation_id: self.target.reservation_id,
            epoch: self.target.epoch,
        });
        request.set_timeout(self.rpc_timeout);
        let node_id = std::mem::take(&mut self.node_id);
        let reservation_id = self.target.reservation_id;
        runtime.spawn(async move {
            match client.release(request).await {
                Ok(reply) => tracing::debug!(
                    node_id,
                    reservation_id,
                    released = reply.get_ref().released,
                    "reservation released"
                ),
                // The reservation expires on the node anyway; say so and move on.
                Err(status) => tracing::warn!(
                    node_id,
                    reservation_id,
                    code = ?status.code(),
                    message = status.message(),
                    "release failed; the reservation will expire on the node"
                ),
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_expiry_is_read_against_the_routers_clock_and_a_past_or_missing_one_gives_no_bound() {
        let now = UNIX_EPOCH + Duration::from_millis(1_000_000);
        assert_eq!(expires_in(1_030_000, now), Some(Duration::from_secs(30)));
        assert_eq!(expires_in(1_000_000, now), None, "expires now");
        assert_eq!(expires_in(999_000, now), None, "in the past");
        assert_eq!(expires_in(0, now), None, "not sent");
    }
}
