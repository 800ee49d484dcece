//! Load signals: each node says how busy it is, several times a second; routers listen.
//!
//! One module owns the signal's schema ([`LoadReport`]), its publisher ([`LoadPublisher`]) and
//! its consumer view ([`LoadView`]), so adding a field touches one file (no
//! "shotgun surgery"). Transports sit behind the small [`LoadSignals`] trait:
//! [`NatsLoadSignals`] (core NATS pub/sub, no JetStream) and [`MemoryLoadSignals`].
//!
//! ```text
//! node: engine ──watch::Sender<LoadReport>──▶ LoadPublisher (every period: stamp seq and
//!        sent_at, publish the *latest* value; never a queue)
//!                                      │ tandem.{cluster}.load.{role}.{node_id}
//! router: subscribe(role) ──▶ watch::Receiver<LoadView> (node id → report + received_at)
//! ```
//!
//! # Degrade, don't die
//! - Publishing while the transport is down fails fast (nothing is queued to be flushed later
//!   with a stale `sent_at`); the publisher counts and logs it and keeps ticking.
//! - A subscriber's view keeps the last report of each node. Reports age; consumers check
//!   [`ReceivedReport::is_fresh`] and fall back to their own counts for stale nodes.
//! - When the transport returns, publishing resumes on the next tick and subscriptions resume
//!   (async-nats re-subscribes on reconnect).
//!
//! [`LoadSignalsStatus`] says whether the transport is connected and what failed last.

pub mod kv_events;
mod memory;
mod nats;
mod publisher;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::error::ClusterError;
use crate::node::Role;

pub use kv_events::{KvEventBatch, KvEventBody};
pub use memory::MemoryLoadSignals;
pub use nats::{NatsConfig, NatsLoadSignals};
pub use publisher::{DEFAULT_LOAD_PERIOD, LoadPublisher};

/// How busy one node is. Published as JSON.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LoadReport {
    /// The reporting node.
    pub node_id: String,
    /// Its role.
    pub role: Role,
    /// Requests admitted but not yet running.
    pub queue_len: u32,
    /// Sequences running now.
    pub running: u32,
    /// KV blocks free now.
    pub free_blocks: u64,
    /// KV blocks in total.
    pub total_blocks: u64,
    /// Tokens processed per second, recent average.
    pub tokens_per_s: f64,
    /// Sequences in the last engine step.
    pub batch_size: u32,
    /// Prompt tokens queued and not computed yet (what the planner sizes a prefill pool by).
    /// Absent in reports of older nodes (read as 0).
    #[serde(default)]
    pub pending_prompt_tokens: u64,
    /// The most sequences the node runs at once (its batch cap; 0 in reports of older nodes).
    #[serde(default)]
    pub max_running: u32,
    /// When the publisher sent it, Unix milliseconds (stamped by [`LoadPublisher`]).
    pub sent_at_unix_ms: u64,
    /// Per-publisher sequence number, from 1 (stamped by [`LoadPublisher`]; restarts with the
    /// node, so it orders reports of one process only).
    pub seq: u64,
}

impl LoadReport {
    /// An idle report for `node_id` (all counts zero, not yet stamped).
    pub fn idle(node_id: impl Into<String>, role: Role, total_blocks: u64) -> Self {
        Self {
            node_id: node_id.into(),
            role,
            queue_len: 0,
            running: 0,
            free_blocks: total_blocks,
            total_blocks,
            tokens_per_s: 0.0,
            batch_size: 0,
            pending_prompt_tokens: 0,
            max_running: 0,
            sent_at_unix_ms: 0,
            seq: 0,
        }
    }
}

/// A report as a subscriber holds it.
#[derive(Clone, Debug, PartialEq)]
pub struct ReceivedReport {
    /// The report.
    pub report: LoadReport,
    /// When this process received it (monotonic clock: immune to clock skew between nodes).
    pub received_at: Instant,
}

impl ReceivedReport {
    /// Time since it was received.
    pub fn age(&self) -> Duration {
        self.received_at.elapsed()
    }

    /// Whether it was received within `max_age`. Use a few publish periods.
    pub fn is_fresh(&self, max_age: Duration) -> bool {
        self.age() <= max_age
    }
}

/// The latest report of every node of one role, by node id.
pub type LoadView = HashMap<String, ReceivedReport>;

/// A transport's health, for metrics and logs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LoadSignalsStatus {
    /// Whether the transport is connected now.
    pub connected: bool,
    /// Reports handed to the transport.
    pub published: u64,
    /// Reports not sent (disconnected, timed out or refused).
    pub publish_failures: u64,
    /// Reports received by this process's subscriptions.
    pub received: u64,
    /// Messages on a load subject that did not decode or did not match their subject.
    pub rejected: u64,
    /// The last thing that went wrong, rendered.
    pub last_error: Option<String>,
}

/// A load-report transport.
#[async_trait]
pub trait LoadSignals: Send + Sync + 'static {
    /// The cluster this instance serves.
    fn cluster(&self) -> &str;

    /// Sends one report now, or fails fast if the transport is down. Most callers want
    /// [`LoadPublisher`] instead.
    async fn publish(&self, report: &LoadReport) -> Result<(), ClusterError>;

    /// A view of the reports of `role`'s nodes received from now on, kept current until every
    /// receiver is dropped. It notifies on every report; readers that only sample can `borrow()`.
    async fn subscribe(&self, role: Role) -> Result<watch::Receiver<LoadView>, ClusterError>;

    /// The transport's health; notifies when `connected` or `last_error` change (the counters
    /// update silently).
    fn status(&self) -> watch::Receiver<LoadSignalsStatus>;

    /// Sends one batch of a node's KV events ([`kv_events`]); fails fast while the transport
    /// is down. Transports without KV events refuse.
    async fn publish_kv_events(&self, batch: &KvEventBatch) -> Result<(), ClusterError> {
        let _ = batch;
        Err(ClusterError::Unavailable {
            service: "kv events",
            op: "publish (this transport has none)",
        })
    }

    /// Every node's KV events from now on, through a bounded queue (a message that does not fit
    /// is dropped: a gap in that node's `seq`). Transports without KV events refuse.
    async fn subscribe_kv_events(
        &self,
    ) -> Result<tokio::sync::mpsc::Receiver<KvEventBatch>, ClusterError> {
        Err(ClusterError::Unavailable {
            service: "kv events",
            op: "subscribe (this transport has none)",
        })
    }
}

/// Shared bookkeeping for [`LoadSignalsStatus`].
#[derive(Debug)]
pub(crate) struct StatusCell(watch::Sender<LoadSignalsStatus>);

impl StatusCell {
    pub fn new(connected: bool) -> Self {
        Self(watch::Sender::new(LoadSignalsStatus {
            connected,
            ..Default::default()
        }))
    }

    pub fn subscribe(&self) -> watch::Receiver<LoadSignalsStatus> {
        self.0.subscribe()
    }

    pub fn published(&self) {
        self.0.send_if_modified(|s| {
            s.published += 1;
            false
        });
    }

    pub fn publish_failed(&self, error: &ClusterError) {
        let text = error.to_string();
        self.0.send_if_modified(|s| {
            s.publish_failures += 1;
            replace(&mut s.last_error, Some(text))
        });
    }

    pub fn received(&self) {
        self.0.send_if_modified(|s| {
            s.received += 1;
            false
        });
    }

    pub fn rejected(&self, error: &ClusterError) {
        let text = error.to_string();
        self.0.send_if_modified(|s| {
            s.rejected += 1;
            replace(&mut s.last_error, Some(text))
        });
    }

    pub fn set_connected(&self, connected: bool, error: Option<String>) {
        self.0.send_if_modified(|s| {
            let changed = s.connected != connected;
            s.connected = connected;
            let error_changed = error.is_some() && replace(&mut s.last_error, error);
            changed || error_changed
        });
    }

    pub fn set_error(&self, error: String) {
        self.0
            .send_if_modified(|s| replace(&mut s.last_error, Some(error)));
    }
}

/// Sets `slot` to `value`; true when it changed.
fn replace<T: PartialEq>(slot: &mut T, value: T) -> bool {
    if *slot == value {
        false
    } else {
        *slot = value;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_is_fresh_until_max_age_passes() {
        let old = ReceivedReport {
            report: LoadReport::idle("d0", Role::Decode, 8),
            received_at: Instant::now() - Duration::from_millis(900),
        };
        assert!(!old.is_fresh(Duration::from_millis(500)));
        assert!(old.is_fresh(Duration::from_secs(2)));
        assert!(old.age() >= Duration::from_millis(900));
    }

    #[test]
    fn status_counters_update_without_waking_watchers_but_errors_do() {
        let cell = StatusCell::new(true);
        let mut rx = cell.subscribe();
        rx.borrow_and_update();
        cell.published();
        cell.received();
        assert!(!rx.has_changed().unwrap());
        assert_eq!((rx.borrow().published, rx.borrow().received), (1, 1));
        cell.publish_failed(&ClusterError::Unavailable {
            service: "nats",
            op: "publish",
        });
        assert!(rx.has_changed().unwrap());
        let status = rx.borrow_and_update().clone();
        assert_eq!(status.publish_failures, 1);
        assert!(status.last_error.unwrap().contains("nats"));
        cell.set_connected(false, None);
        assert!(rx.has_changed().unwrap());
        assert!(!rx.borrow_and_update().connected);
    }

    #[test]
    fn load_report_json_names_its_fields_with_units() {
        let json = serde_json::to_value(LoadReport::idle("p0", Role::Prefill, 4)).unwrap();
        for field in [
            "queue_len",
            "free_blocks",
            "total_blocks",
            "tokens_per_s",
            "sent_at_unix_ms",
            "seq",
        ] {
            assert!(json.get(field).is_some(), "{field} missing from {json}");
        }
        assert_eq!(json["role"], "prefill");
    }
}
