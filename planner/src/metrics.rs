//! The planner's Prometheus families (served on `--metrics-addr`).

use std::sync::Arc;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PoolLabels {
    pool: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DecisionLabels {
    pool: &'static str,
    direction: &'static str,
}

/// The planner's metric handles. Cheap to clone.
#[derive(Clone)]
pub struct PlannerMetrics {
    registry: Arc<Registry>,
    decisions: Family<DecisionLabels, Counter>,
    desired: Family<PoolLabels, Gauge>,
    serving: Family<PoolLabels, Gauge>,
    executor_errors: Family<PoolLabels, Counter>,
    leader: Gauge,
    rounds: Counter,
}

impl std::fmt::Debug for PlannerMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PlannerMetrics").finish_non_exhaustive()
    }
}

impl Default for PlannerMetrics {
    fn default() -> Self {
        let (decisions, desired, serving, executor_errors) = (
            Family::<DecisionLabels, Counter>::default(),
            Family::<PoolLabels, Gauge>::default(),
            Family::<PoolLabels, Gauge>::default(),
            Family::<PoolLabels, Counter>::default(),
        );
        for pool in ["prefill", "decode"] {
            for direction in ["up", "down"] {
                let _ = decisions.get_or_create(&DecisionLabels { pool, direction });
            }
            let _ = executor_errors.get_or_create(&PoolLabels { pool });
        }
        let (leader, rounds) = (Gauge::default(), Counter::default());
        let mut r = Registry::default();
        r.register(
            "tandem_planner_decisions",
            "Pool size changes decided, by pool and direction",
            decisions.clone(),
        );
        r.register(
            "tandem_planner_desired_nodes",
            "The size each pool is asked to have",
            desired.clone(),
        );
        r.register(
            "tandem_planner_serving_nodes",
            "Nodes serving per pool, as the planner last saw them",
            serving.clone(),
        );
        r.register(
            "tandem_planner_executor_errors",
            "Sizes the executor failed to apply (each retried with back-off)",
            executor_errors.clone(),
        );
        r.register(
            "tandem_planner_leader",
            "1 while this planner holds the election and acts",
            leader.clone(),
        );
        r.register("tandem_planner_rounds", "Observe-decide rounds run", rounds.clone());
        PlannerMetrics {
            registry: Arc::new(r),
            decisions,
            desired,
            serving,
            executor_errors,
            leader,
            rounds,
        }
    }
}

impl PlannerMetrics {
    /// The text exposition of every family.
    pub fn render(&self) -> String {
        tandem_telemetry::metrics::render(&self.registry)
    }

    pub(crate) fn decided(&self, pool: &'static str, from: usize, to: usize) {
        let direction = if to > from { "up" } else { "down" };
        self.decisions
            .get_or_create(&DecisionLabels { pool, direction })
            .inc();
    }

    pub(crate) fn observed(&self, pool: &'static str, desired: usize, serving: usize) {
        self.desired.get_or_create(&PoolLabels { pool }).set(desired as i64);
        self.serving.get_or_create(&PoolLabels { pool }).set(serving as i64);
    }

    pub(crate) fn executor_failed(&self, pool: &'static str) {
        self.executor_errors.get_or_create(&PoolLabels { pool }).inc();
    }

    pub(crate) fn set_leader(&self, leading: bool) {
        self.leader.set(leading as i64);
    }

    pub(crate) fn round(&self) {
        self.rounds.inc();
    }
}
