//! [`ReservationGuard`]: a decode reservation that is released unless a Decode call finished
//! with it (RAII, DESIGN.md "A request's path" step 6).
//!
//! Dropping an armed guard sends `Release` from a spawned task (a drop cannot await), with the
//! RPC timeout. `Release` is idempotent and carries the reservation's epoch, so releasing a
//! reservation that a cancelled Decode call had already claimed and freed is harmless: the
//! node answers `released: false`, and blocks reused under a newer epoch are never touched.
//! The guard is therefore kept armed on every path except a completed Decode stream: prefill
//! failures, retries, client disconnects and panics all release.

use std::sync::Arc;
use std::time::Duration;

use tandem_proto::v1::ReleaseRequest;
use tandem_proto::v1::decode_client::DecodeClient;
use tonic::transport::Channel;

use crate::stats::{RouterStats, bump};

/// A reservation to release on drop unless disarmed.
#[derive(Debug)]
pub(super) struct ReservationGuard {
    client: DecodeClient<Channel>,
    node_id: String,
    reservation_id: u64,
    epoch: u64,
    rpc_timeout: Duration,
    stats: Arc<RouterStats>,
    armed: bool,
}

impl ReservationGuard {
    pub(super) fn new(
        client: DecodeClient<Channel>,
        node_id: String,
        reservation_id: u64,
        epoch: u64,
        rpc_timeout: Duration,
        stats: Arc<RouterStats>,
    ) -> Self {
        Self {
            client,
            node_id,
            reservation_id,
            epoch,
            rpc_timeout,
            stats,
            armed: true,
        }
    }

    /// The Decode stream finished: the node freed the blocks itself.
    pub(super) fn disarm(&mut self) {
        self.armed = false;
    }
}

impl Drop for ReservationGuard {
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
            reservation_id: self.reservation_id,
            epoch: self.epoch,
        });
        request.set_timeout(self.rpc_timeout);
        let node_id = std::mem::take(&mut self.node_id);
        let reservation_id = self.reservation_id;
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
