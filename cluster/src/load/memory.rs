//! [`MemoryLoadSignals`]: an in-process load bus with the NATS semantics, for tests and for
//! `tandem up --coordination embedded`.
//!
//! Clones share one bus. A subscriber sees reports published after it subscribed (as with
//! core NATS). [`MemoryLoadSignals::set_available`] switches the bus off and on to rehearse an
//! outage: publishing fails fast, subscribers keep their last (ageing) reports.
//!
//! Cost: publishing takes one mutex and updates one `watch` value per matching subscriber.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use async_trait::async_trait;
use tokio::sync::{mpsc, watch};

use super::{KvEventBatch, LoadReport, LoadSignals, LoadSignalsStatus, LoadView, ReceivedReport, StatusCell};
use crate::error::ClusterError;
use crate::keys::ClusterKeys;
use crate::node::Role;

/// An in-process [`LoadSignals`]: clone it to share the bus.
#[derive(Clone, Debug)]
pub struct MemoryLoadSignals {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    keys: ClusterKeys,
    subscribers: Mutex<Vec<(Role, watch::Sender<LoadView>)>>,
    kv_subscribers: Mutex<Vec<mpsc::Sender<KvEventBatch>>>,
    available: AtomicBool,
    status: StatusCell,
}

impl MemoryLoadSignals {
    /// A bus for the cluster named `cluster`, switched on.
    pub fn new(cluster: &str) -> Result<Self, ClusterError> {
        Ok(Self {
            shared: Arc::new(Shared {
                keys: ClusterKeys::new(cluster)?,
                subscribers: Mutex::new(Vec::new()),
                kv_subscribers: Mutex::new(Vec::new()),
                available: AtomicBool::new(true),
                status: StatusCell::new(true),
            }),
        })
    }

    /// Switches the bus off (an outage) or back on.
    pub fn set_available(&self, available: bool) {
        self.shared.available.store(available, Ordering::SeqCst);
        let error = (!available).then(|| "memory bus switched off".to_string());
        self.shared.status.set_connected(available, error);
    }
}

#[async_trait]
impl LoadSignals for MemoryLoadSignals {
    fn cluster(&self) -> &str {
        self.shared.keys.cluster()
    }

    async fn publish(&self, report: &LoadReport) -> Result<(), ClusterError> {
        // Same naming rules as the NATS subject, so both refuse the same reports.
        self.shared
            .keys
            .load_subject(report.role, &report.node_id)?;
        if !self.shared.available.load(Ordering::SeqCst) {
            let error = ClusterError::Unavailable {
                service: "memory",
                op: "publish",
            };
            self.shared.status.publish_failed(&error);
            return Err(error);
        }
        let received_at = Instant::now();
        let mut subscribers = self
            .shared
            .subscribers
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        subscribers.retain(|(_, tx)| !tx.is_closed());
        for (role, tx) in subscribers.iter() {
            if *role == report.role {
                tx.send_modify(|view| {
                    view.insert(
                        report.node_id.clone(),
                        ReceivedReport {
                            report: report.clone(),
                            received_at,
                        },
                    );
                });
                self.shared.status.received();
            }
        }
        self.shared.status.published();
        Ok(())
    }

    async fn subscribe(&self, role: Role) -> Result<watch::Receiver<LoadView>, ClusterError> {
        let (tx, rx) = watch::channel(LoadView::new());
        self.shared
            .subscribers
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .push((role, tx));
        Ok(rx)
    }

    fn status(&self) -> watch::Receiver<LoadSignalsStatus> {
        self.shared.status.subscribe()
    }

    async fn publish_kv_events(&self, batch: &KvEventBatch) -> Result<(), ClusterError> {
        self.shared.keys.kv_subject(&batch.node_id)?;
        if !self.shared.available.load(Ordering::SeqCst) {
            return Err(ClusterError::Unavailable {
                service: "memory",
                op: "publish kv events",
            });
        }
        let mut subscribers = self
            .shared
            .kv_subscribers
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        subscribers.retain(|tx| !tx.is_closed());
        for tx in subscribers.iter() {
            // A full queue drops the message, as a slow NATS subscriber would lose it.
            let _ = tx.try_send(batch.clone());
        }
        Ok(())
    }

    async fn subscribe_kv_events(&self) -> Result<mpsc::Receiver<KvEventBatch>, ClusterError> {
        let (tx, rx) = mpsc::channel(super::kv_events::KV_EVENT_QUEUE);
        self.shared
            .kv_subscribers
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .push(tx);
        Ok(rx)
    }
}
