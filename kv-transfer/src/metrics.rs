//! Transfer counters and a latency histogram, as plain atomics the nodes export later.
//!
//! No metrics library is linked: every field is an atomic updated with `Relaxed` ordering (a
//! few nanoseconds each, off the per-byte path: once per chunk or per transfer). A node wraps
//! [`TransferMetrics::snapshot`] into Prometheus text when it exports.
//!
//! The `live_*` gauges are the leak detectors the tests assert on: each is raised by an RAII
//! [`LiveGuard`] when a registration, reservation, outbound transfer or connection comes into
//! being, and lowered when that guard drops, so "back to zero" means "everything released".

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

use serde::Serialize;

use crate::error::{FailureKind, TransferError};

/// Upper bounds (seconds) of the transfer-duration histogram buckets; a final bucket is +Inf.
pub const SECONDS_BUCKETS: [f64; 14] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// Counters shared by one transport (and the receivers it serves).
#[derive(Debug, Default)]
pub struct TransferMetrics {
    bytes_sent: AtomicU64,
    bytes_received: AtomicU64,
    transfers_started: AtomicU64,
    transfers_succeeded: AtomicU64,
    inbound_succeeded: AtomicU64,
    ipc_bytes_sent: AtomicU64,
    ipc_bytes_received: AtomicU64,
    ipc_declined: AtomicU64,
    failures: [AtomicU64; FailureKind::ALL.len()],
    seconds_buckets: [AtomicU64; SECONDS_BUCKETS.len() + 1],
    seconds_sum_ns: AtomicU64,
    live: [AtomicI64; 4],
}

/// Which live gauge a [`LiveGuard`] holds up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Live {
    /// Registered pools (UCX memory registrations).
    Registrations = 0,
    /// Reservations a receiver is waiting on or filling.
    Reservations = 1,
    /// Outbound transfers not yet resolved.
    Transfers = 2,
    /// Open transport connections.
    Connections = 3,
}

/// Holds one unit of a live gauge until dropped.
#[derive(Debug)]
pub struct LiveGuard {
    metrics: Arc<TransferMetrics>,
    which: Live,
}

impl Drop for LiveGuard {
    fn drop(&mut self) {
        self.metrics.live[self.which as usize].fetch_sub(1, Ordering::Relaxed);
    }
}

impl TransferMetrics {
    /// A fresh, shareable set of counters.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Raises a live gauge until the returned guard drops.
    pub fn live_guard(self: &Arc<Self>, which: Live) -> LiveGuard {
        self.live[which as usize].fetch_add(1, Ordering::Relaxed);
        LiveGuard {
            metrics: Arc::clone(self),
            which,
        }
    }

    /// Current value of a live gauge.
    pub fn live(&self, which: Live) -> i64 {
        self.live[which as usize].load(Ordering::Relaxed)
    }

    pub(crate) fn add_sent(&self, bytes: u64) {
        self.bytes_sent.fetch_add(bytes, Ordering::Relaxed);
    }

    pub(crate) fn add_received(&self, bytes: u64) {
        self.bytes_received.fetch_add(bytes, Ordering::Relaxed);
    }

    /// Payload bytes copied into a peer's device pool by CUDA IPC (also in `bytes_sent`).
    pub(crate) fn ipc_sent(&self, bytes: u64) {
        self.ipc_bytes_sent.fetch_add(bytes, Ordering::Relaxed);
    }

    /// Payload bytes verified in this side's device pool after a CUDA IPC copy.
    pub(crate) fn ipc_received(&self, bytes: u64) {
        self.ipc_bytes_received.fetch_add(bytes, Ordering::Relaxed);
    }

    /// A sender on this GPU got no CUDA IPC offer (the pool could not be exported, or the
    /// registered pool is not the device pool's mirror): its bytes go in the stream.
    pub(crate) fn ipc_declined(&self) {
        self.ipc_declined.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn transfer_started(&self) {
        self.transfers_started.fetch_add(1, Ordering::Relaxed);
    }

    /// Records how an outbound transfer ended and how long it took.
    pub(crate) fn transfer_finished(&self, result: Result<(), &TransferError>, elapsed: Duration) {
        match result {
            Ok(()) => {
                self.transfers_succeeded.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => self.failed(e),
        }
        let secs = elapsed.as_secs_f64();
        let bucket = SECONDS_BUCKETS
            .iter()
            .position(|&b| secs <= b)
            .unwrap_or(SECONDS_BUCKETS.len());
        self.seconds_buckets[bucket].fetch_add(1, Ordering::Relaxed);
        self.seconds_sum_ns.fetch_add(
            elapsed.as_nanos().min(u64::MAX as u128) as u64,
            Ordering::Relaxed,
        );
    }

    /// Records how an inbound transfer (a reservation) ended.
    pub(crate) fn inbound_finished(&self, result: Result<(), &TransferError>) {
        match result {
            Ok(()) => {
                self.inbound_succeeded.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => self.failed(e),
        }
    }

    /// Counts one failure of `e`'s kind.
    pub(crate) fn failed(&self, e: &TransferError) {
        self.failures[e.kind().index()].fetch_add(1, Ordering::Relaxed);
    }

    /// Failures counted for one kind.
    pub fn failures(&self, kind: FailureKind) -> u64 {
        self.failures[kind.index()].load(Ordering::Relaxed)
    }

    /// A consistent-enough copy of every counter (each read is atomic; the set is not).
    pub fn snapshot(&self) -> MetricsSnapshot {
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        MetricsSnapshot {
            bytes_sent: load(&self.bytes_sent),
            bytes_received: load(&self.bytes_received),
            transfers_started: load(&self.transfers_started),
            transfers_succeeded: load(&self.transfers_succeeded),
            inbound_succeeded: load(&self.inbound_succeeded),
            ipc_bytes_sent: load(&self.ipc_bytes_sent),
            ipc_bytes_received: load(&self.ipc_bytes_received),
            ipc_declined: load(&self.ipc_declined),
            failures: FailureKind::ALL
                .iter()
                .filter_map(|k| {
                    let n = self.failures(*k);
                    (n > 0).then(|| (k.as_str().to_string(), n))
                })
                .collect(),
            seconds_bucket_counts: self.seconds_buckets.iter().map(load).collect(),
            seconds_sum: load(&self.seconds_sum_ns) as f64 * 1e-9,
            live_registrations: self.live(Live::Registrations),
            live_reservations: self.live(Live::Reservations),
            live_transfers: self.live(Live::Transfers),
            live_connections: self.live(Live::Connections),
        }
    }
}

/// A point-in-time copy of [`TransferMetrics`], serialisable for logs and the peer binary.
#[derive(Clone, Debug, PartialEq, Serialize, serde::Deserialize)]
pub struct MetricsSnapshot {
    /// Payload bytes pushed out.
    pub bytes_sent: u64,
    /// Payload bytes verified in.
    pub bytes_received: u64,
    /// Outbound transfers begun.
    pub transfers_started: u64,
    /// Outbound transfers the receiver confirmed.
    pub transfers_succeeded: u64,
    /// Reservations filled and verified.
    pub inbound_succeeded: u64,
    /// Payload bytes copied into peers' device pools by CUDA IPC (part of `bytes_sent`).
    #[serde(default)]
    pub ipc_bytes_sent: u64,
    /// Payload bytes that arrived by CUDA IPC and verified on this device.
    #[serde(default)]
    pub ipc_bytes_received: u64,
    /// Connections from senders on this GPU that got no CUDA IPC offer and stream their bytes
    /// instead (the pool could not be exported, or is not the device pool's mirror; each logged).
    #[serde(default)]
    pub ipc_declined: u64,
    /// Failures by [`FailureKind`] label (only non-zero kinds).
    pub failures: Vec<(String, u64)>,
    /// Outbound transfer durations per [`SECONDS_BUCKETS`] bucket (last: +Inf), not cumulative.
    pub seconds_bucket_counts: Vec<u64>,
    /// Sum of outbound transfer durations, seconds.
    pub seconds_sum: f64,
    /// Registered pools.
    pub live_registrations: i64,
    /// Reservations held.
    pub live_reservations: i64,
    /// Outbound transfers in flight.
    pub live_transfers: i64,
    /// Open connections.
    pub live_connections: i64,
}

impl MetricsSnapshot {
    /// True when nothing is held: no registration, reservation, transfer or connection.
    pub fn nothing_held(&self) -> bool {
        self.live_registrations == 0
            && self.live_reservations == 0
            && self.live_transfers == 0
            && self.live_connections == 0
    }

    /// The failure count for one kind (0 when absent).
    pub fn failures_of(&self, kind: FailureKind) -> u64 {
        self.failures
            .iter()
            .find(|(k, _)| k == kind.as_str())
            .map_or(0, |(_, n)| *n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Side;

    #[test]
    fn live_guards_return_gauges_to_zero_on_drop() {
        let m = TransferMetrics::new();
        let a = m.live_guard(Live::Reservations);
        let b = m.live_guard(Live::Reservations);
        assert_eq!(m.live(Live::Reservations), 2);
        drop(a);
        drop(b);
        assert!(m.snapshot().nothing_held());
    }

    #[test]
    fn finished_transfers_land_in_their_bucket_and_failures_by_kind() {
        let m = TransferMetrics::new();
        m.transfer_finished(Ok(()), Duration::from_millis(3));
        m.transfer_finished(
            Err(&TransferError::Cancelled { by: Side::Local }),
            Duration::from_secs(60),
        );
        let s = m.snapshot();
        assert_eq!(s.transfers_succeeded, 1);
        assert_eq!(
            s.seconds_bucket_counts[3], 1,
            "3 ms is in the <= 5 ms bucket"
        );
        assert_eq!(
            *s.seconds_bucket_counts.last().unwrap(),
            1,
            "60 s is in +Inf"
        );
        assert_eq!(s.failures_of(FailureKind::Cancelled), 1);
        assert!((s.seconds_sum - 60.003).abs() < 1e-6);
    }
}
