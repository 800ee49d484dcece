//! One observation of both pools: who serves (etcd membership), how busy each node is (its
//! latest fresh NATS load report) and what size each pool is asked to have (the scale store).
//!
//! A node counts when its record says `serving`; its load counts when its report is younger
//! than `max_report_age` (a node that stopped reporting contributes nothing, rather than a
//! stale backlog). A pool nobody has sized yet is taken to be asked for what is registered.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_cluster::{Discovery, LoadSignals, LoadView, NodeState, NodeView, Role, ScaleStore};
use tokio::sync::watch;

use crate::decide::{NodeLoad, Observation, PoolObservation};
use crate::error::PlannerError;

/// Reads the cluster's state for the planner.
pub struct Observer {
    store: Arc<dyn ScaleStore>,
    members: [watch::Receiver<NodeView>; 2],
    load: [watch::Receiver<LoadView>; 2],
    max_report_age: Duration,
}

impl std::fmt::Debug for Observer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Observer")
            .field("max_report_age", &self.max_report_age)
            .finish_non_exhaustive()
    }
}

impl Observer {
    /// Subscribes to both pools' membership and load reports.
    pub async fn connect(
        discovery: &dyn Discovery,
        signals: &dyn LoadSignals,
        store: Arc<dyn ScaleStore>,
        max_report_age: Duration,
    ) -> Result<Self, PlannerError> {
        Ok(Observer {
            store,
            members: [
                discovery.watch(Role::Prefill).await?,
                discovery.watch(Role::Decode).await?,
            ],
            load: [
                signals.subscribe(Role::Prefill).await?,
                signals.subscribe(Role::Decode).await?,
            ],
            max_report_age,
        })
    }

    /// Both pools now.
    pub async fn observe(&self) -> Result<Observation, PlannerError> {
        let targets = self.store.targets().await?;
        let limits = self.store.limits().await?;
        let pool = |i: usize, role: Role| {
            let members = self.members[i].borrow().clone();
            let load = self.load[i].borrow();
            let serving: Vec<&String> = members
                .iter()
                .filter(|(_, n)| n.state == NodeState::Serving)
                .map(|(id, _)| id)
                .collect();
            let active = members
                .values()
                .filter(|n| n.state != NodeState::Draining)
                .count();
            let nodes = serving
                .iter()
                .filter_map(|id| load.get(*id))
                .filter(|r| r.is_fresh(self.max_report_age))
                .map(|r| NodeLoad {
                    queue_len: r.report.queue_len,
                    running: r.report.running,
                    pending_prompt_tokens: r.report.pending_prompt_tokens,
                    max_running: r.report.max_running,
                    free_blocks: r.report.free_blocks,
                    total_blocks: r.report.total_blocks,
                    tokens_per_s: r.report.tokens_per_s,
                })
                .collect();
            PoolObservation {
                desired: targets.of(role).unwrap_or(active),
                serving: serving.len(),
                nodes,
                bounds: limits.map(|l| (l.of(role).min, l.of(role).max)),
            }
        };
        Ok(Observation {
            at: Instant::now(),
            prefill: pool(0, Role::Prefill),
            decode: pool(1, Role::Decode),
        })
    }
}
