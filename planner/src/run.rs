//! The planner's loop: campaign, then every `interval` observe → decide → log, count, publish
//! and (while leading, unless dry-run) apply; step down the moment leadership is lost.
//!
//! Invariants:
//! - only a held [`Leadership`] acts, checked right before each apply (a leader paused past its
//!   lease resumes without acting);
//! - every decision is logged with its inputs, counted and published, acted on or not;
//! - a failed apply is retried with back-off until it succeeds or a newer decision for the
//!   same pool replaces it.

use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use serde::Serialize;
use tandem_cluster::{Election, Leadership, Role};
use tokio_util::sync::CancellationToken;

use crate::actuate::{Actuator, Retry};
use crate::config::PlannerConfig;
use crate::decide::{Decision, PlannerMemory, decide};
use crate::error::PlannerError;
use crate::metrics::PlannerMetrics;
use crate::observe::Observer;

/// A decision as logged and published on `tandem.{cluster}.planner.decisions`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DecisionRecord {
    /// The deciding planner's id.
    pub planner: String,
    /// When, Unix milliseconds.
    pub at_unix_ms: u64,
    /// The decision, with its reason and inputs.
    #[serde(flatten)]
    pub decision: Decision,
    /// Decided by a `--dry-run` planner (never applied).
    pub dry_run: bool,
    /// Whether the executor applied it (false: dry-run, not leading, or failed and retrying).
    pub applied: bool,
}

/// Where decision records go besides the log.
#[async_trait]
pub trait DecisionSink: Send + Sync {
    /// Publishes one record (failures are the sink's to log; the planner goes on).
    async fn publish(&self, record: &DecisionRecord);
}

/// Publishes records as JSON on a NATS subject.
pub struct NatsDecisionSink {
    client: async_nats::Client,
    subject: String,
}

impl NatsDecisionSink {
    /// Publishes on `subject` over `client`.
    pub fn new(client: async_nats::Client, subject: String) -> Self {
        NatsDecisionSink { client, subject }
    }
}

#[async_trait]
impl DecisionSink for NatsDecisionSink {
    async fn publish(&self, record: &DecisionRecord) {
        let body = match serde_json::to_vec(record) {
            Ok(b) => b,
            Err(e) => return tracing::warn!(error = %e, "planner: encoding a decision"),
        };
        if let Err(e) = self.client.publish(self.subject.clone(), body.into()).await {
            tracing::warn!(error = %e, subject = %self.subject, "planner: publishing a decision");
        }
    }
}

/// Keeps records in memory (tests, `--dry-run` printing).
#[derive(Default, Clone)]
pub struct MemoryDecisionSink(pub Arc<Mutex<Vec<DecisionRecord>>>);

#[async_trait]
impl DecisionSink for MemoryDecisionSink {
    async fn publish(&self, record: &DecisionRecord) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).push(record.clone());
    }
}

/// A planner, ready to run.
pub struct Planner {
    /// Its id (in the election and in every record).
    pub id: String,
    /// SLOs, bounds, cooldowns.
    pub config: PlannerConfig,
    /// Decide and publish, never apply (and do not campaign).
    pub dry_run: bool,
    /// The cluster's state.
    pub observer: Observer,
    /// Applies sizes.
    pub actuator: Arc<dyn Actuator>,
    /// Decides who acts.
    pub election: Arc<dyn Election>,
    /// Where records go.
    pub sinks: Vec<Arc<dyn DecisionSink>>,
    /// Its metrics.
    pub metrics: PlannerMetrics,
}

fn pool_role(pool: &str) -> Role {
    if pool == "prefill" { Role::Prefill } else { Role::Decode }
}

impl Planner {
    /// Runs until `cancel` fires (then resigns).
    pub async fn run(self, cancel: CancellationToken) -> Result<(), PlannerError> {
        let mut memory = PlannerMemory::default();
        let mut retries: Vec<Retry> = Vec::new();
        if self.dry_run {
            tracing::info!(planner = %self.id, "planner: dry run (deciding and publishing, never applying)");
            let mut tick = tokio::time::interval(self.config.interval());
            loop {
                tokio::select! {
                    _ = cancel.cancelled() => return Ok(()),
                    _ = tick.tick() => {}
                }
                self.round(&mut memory, &mut retries, None).await;
            }
        }
        loop {
            self.metrics.set_leader(false);
            let Some(lead) = self.election.campaign(&self.id, &cancel).await? else {
                return Ok(());
            };
            tracing::info!(planner = %self.id, "planner: elected; acting");
            self.metrics.set_leader(true);
            // A new term starts from what the cluster says, not from the last term's memory.
            memory = memory.new_term();
            retries.clear();
            let lost = lead.lost();
            let mut tick = tokio::time::interval(self.config.interval());
            loop {
                tokio::select! {
                    _ = cancel.cancelled() => {
                        self.metrics.set_leader(false);
                        lead.resign();
                        return Ok(());
                    }
                    _ = lost.cancelled() => break,
                    _ = tick.tick() => {}
                }
                self.round(&mut memory, &mut retries, Some(&lead)).await;
            }
            tracing::warn!(planner = %self.id, "planner: lost the election; not acting");
        }
    }

    /// One observe → decide → act round; returns the records it published.
    pub async fn round(
        &self,
        memory: &mut PlannerMemory,
        retries: &mut Vec<Retry>,
        lead: Option<&Leadership>,
    ) -> Vec<DecisionRecord> {
        self.metrics.round();
        let obs = match self.observer.observe().await {
            Ok(o) => o,
            Err(e) => {
                tracing::warn!(error = %e, "planner: observing the cluster failed; skipping this round");
                return Vec::new();
            }
        };
        self.metrics.observed("prefill", obs.prefill.desired, obs.prefill.serving);
        self.metrics.observed("decode", obs.decode.desired, obs.decode.serving);
        let acting = || !self.dry_run && lead.is_some_and(Leadership::is_held);
        let decisions = decide(&obs, &self.config, memory);
        let mut out = Vec::new();
        for d in decisions {
            let role = pool_role(d.pool);
            retries.retain(|r| r.pool != role);
            let applied = acting() && self.apply(role, d.to, 0, retries).await;
            self.metrics.decided(d.pool, d.from, d.to);
            tracing::info!(
                planner = %self.id,
                pool = d.pool,
                from = d.from,
                to = d.to,
                reason = %d.reason,
                serving = d.inputs.serving,
                demand = d.inputs.demand,
                capacity = d.inputs.capacity,
                utilisation = d.inputs.utilisation,
                dry_run = self.dry_run,
                applied,
                "planner decision"
            );
            let record = DecisionRecord {
                planner: self.id.clone(),
                at_unix_ms: SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map(|d| d.as_millis() as u64)
                    .unwrap_or(0),
                decision: d,
                dry_run: self.dry_run,
                applied,
            };
            for s in &self.sinks {
                s.publish(&record).await;
            }
            out.push(record);
        }
        let now = Instant::now();
        let due: Vec<Retry> = retries.iter().filter(|r| r.next_at <= now).cloned().collect();
        for r in due {
            retries.retain(|x| x.pool != r.pool);
            if acting() && self.apply(r.pool, r.size, r.failures, retries).await {
                tracing::info!(pool = %r.pool, size = r.size, after_failures = r.failures, "planner: applied on retry");
            }
        }
        out
    }

    /// Applies one size; on failure schedules a retry. True when applied.
    async fn apply(&self, pool: Role, size: usize, failures: u32, retries: &mut Vec<Retry>) -> bool {
        match self.actuator.apply(pool, size).await {
            Ok(()) => true,
            Err(e) => {
                let retry = Retry::after_failure(pool, size, failures, Instant::now());
                self.metrics.executor_failed(pool.as_str());
                tracing::warn!(
                    executor = self.actuator.name(),
                    %pool,
                    size,
                    failures = retry.failures,
                    retry_in_ms = retry.next_at.saturating_duration_since(Instant::now()).as_millis() as u64,
                    error = %e,
                    "planner: applying a size failed; will retry"
                );
                if e.is_retryable() {
                    retries.push(retry);
                }
                false
            }
        }
    }
}
