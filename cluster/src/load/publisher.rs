//! [`LoadPublisher`]: publishes a node's latest [`LoadReport`] every period.
//!
//! The node writes its load into a `watch::Sender<LoadReport>` whenever it likes (latest value
//! wins; nothing queues). Every `period` the publisher clones the current value, stamps `seq`
//! and `sent_at_unix_ms`, and publishes it, whether or not it changed: a steady stream is what
//! tells subscribers the node is alive. Failures are counted (in the transport's
//! [`LoadSignalsStatus`](super::LoadSignalsStatus)) and logged once per outage, never fatal.
//!
//! The task stops when its handle is dropped or stopped, when the `cancel` token given to
//! [`LoadPublisher::spawn`] fires, or when the report sender is dropped (the node is going
//! away).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::MissedTickBehavior;
use tokio_util::sync::CancellationToken;

use super::{LoadReport, LoadSignals};
use crate::node::unix_ms_now;

/// The default publish period: 5 reports a second.
pub const DEFAULT_LOAD_PERIOD: Duration = Duration::from_millis(200);

/// A running publisher. Dropping it stops publishing.
#[derive(Debug)]
pub struct LoadPublisher {
    cancel: CancellationToken,
    task: Option<JoinHandle<()>>,
}

impl LoadPublisher {
    /// Starts publishing the latest value of `reports` every `period` (use
    /// [`DEFAULT_LOAD_PERIOD`] unless you have a reason). `cancel` is the parent token of the
    /// node's shutdown tree; the publisher stops when it fires.
    pub fn spawn(
        signals: Arc<dyn LoadSignals>,
        reports: watch::Receiver<LoadReport>,
        period: Duration,
        cancel: &CancellationToken,
    ) -> Self {
        let cancel = cancel.child_token();
        let task = tokio::spawn(run(
            signals,
            reports,
            period.max(Duration::from_millis(1)),
            cancel.clone(),
        ));
        Self {
            cancel,
            task: Some(task),
        }
    }

    /// Whether the task is still publishing.
    pub fn is_running(&self) -> bool {
        self.task.as_ref().is_some_and(|t| !t.is_finished())
    }

    /// Stops publishing and waits for the task to end.
    pub async fn stop(mut self) {
        self.cancel.cancel();
        if let Some(task) = self.task.take() {
            // A JoinError here only means the runtime is shutting down.
            let _ = task.await;
        }
    }
}

impl Drop for LoadPublisher {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

async fn run(
    signals: Arc<dyn LoadSignals>,
    reports: watch::Receiver<LoadReport>,
    period: Duration,
    cancel: CancellationToken,
) {
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut seq = 0u64;
    let mut failing_since: Option<u64> = None;
    loop {
        tokio::select! {
            biased;
            _ = cancel.cancelled() => break,
            _ = tick.tick() => {}
        }
        if reports.has_changed().is_err() {
            tracing::debug!("load report sender dropped; publisher stops");
            break;
        }
        let mut report = reports.borrow().clone();
        seq += 1;
        report.seq = seq;
        report.sent_at_unix_ms = unix_ms_now();
        match signals.publish(&report).await {
            Ok(()) => {
                if let Some(first_failed_seq) = failing_since.take() {
                    tracing::info!(
                        cluster = %signals.cluster(),
                        node_id = %report.node_id,
                        missed = seq - first_failed_seq,
                        "load reports are being published again"
                    );
                }
            }
            Err(e) => {
                if failing_since.is_none() {
                    failing_since = Some(seq);
                    tracing::warn!(
                        cluster = %signals.cluster(),
                        node_id = %report.node_id,
                        error = %e,
                        "load report not published; will keep trying every period"
                    );
                } else {
                    tracing::debug!(error = %e, "load report not published");
                }
            }
        }
    }
}
