//! The planner's one error type.

use tandem_cluster::{ClusterError, Role};

/// What can go wrong in the planner.
#[derive(Debug, thiserror::Error)]
pub enum PlannerError {
    /// A setting is missing, unknown or impossible (refused at start).
    #[error("planner config: `{field}` = {value}: {reason}")]
    Config {
        /// The field (`prefill.min`, `ttft_p90_slo_ms`, or `slo-file` for the file itself).
        field: &'static str,
        /// Its value as given.
        value: String,
        /// Why it is refused.
        reason: String,
    },
    /// The control plane (etcd, NATS) failed or refused.
    #[error(transparent)]
    Cluster(#[from] ClusterError),
    /// An executor could not apply a size.
    #[error("executor {executor}: setting the {pool} pool to {size} failed: {reason}")]
    Executor {
        /// Which executor (`etcd`, `kubernetes`).
        executor: &'static str,
        /// The pool.
        pool: Role,
        /// The size asked for.
        size: usize,
        /// What failed.
        reason: String,
    },
}

impl PlannerError {
    /// Whether trying again later may succeed.
    pub fn is_retryable(&self) -> bool {
        match self {
            PlannerError::Config { .. } => false,
            PlannerError::Cluster(e) => e.is_retryable(),
            PlannerError::Executor { .. } => true,
        }
    }
}
