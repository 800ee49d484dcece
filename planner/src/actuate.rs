//! Executors as the planner sees them: something that sets a pool's size. The planner's own
//! is [`StoreActuator`] (the desired count in etcd, which `tandem up`'s reconciler applies);
//! the Kubernetes executor patches the pools' Deployments instead.
//!
//! A failed apply is retried with back-off ([`Retry`]) until it succeeds or a newer decision
//! replaces it; every failure is logged and counted (`tandem_planner_executor_errors_total`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use tandem_cluster::{Role, ScaleStore};

use crate::error::PlannerError;

/// Sets pool sizes.
#[async_trait]
pub trait Actuator: Send + Sync + std::fmt::Debug {
    /// A short name for logs and errors.
    fn name(&self) -> &'static str;
    /// Asks for `size` nodes in `pool`.
    async fn apply(&self, pool: Role, size: usize) -> Result<(), PlannerError>;
}

/// Writes desired sizes to the cluster's scale store (etcd).
#[derive(Debug, Clone)]
pub struct StoreActuator(pub Arc<dyn ScaleStore>);

#[async_trait]
impl Actuator for StoreActuator {
    fn name(&self) -> &'static str {
        "etcd"
    }

    async fn apply(&self, pool: Role, size: usize) -> Result<(), PlannerError> {
        Ok(self.0.set_target(pool, size).await?)
    }
}

/// A size not applied yet, and when to try again.
#[derive(Clone, Debug, PartialEq)]
pub struct Retry {
    /// The pool.
    pub pool: Role,
    /// The size.
    pub size: usize,
    /// Failures so far.
    pub failures: u32,
    /// Not before.
    pub next_at: Instant,
}

/// First retry delay; doubles per failure up to [`RETRY_MAX`].
pub const RETRY_MIN: Duration = Duration::from_millis(500);
/// Longest retry delay.
pub const RETRY_MAX: Duration = Duration::from_secs(30);

impl Retry {
    /// The next attempt after one more failure at `now`.
    pub fn after_failure(pool: Role, size: usize, failures: u32, now: Instant) -> Retry {
        let delay = RETRY_MIN
            .saturating_mul(1 << failures.min(10))
            .min(RETRY_MAX);
        Retry {
            pool,
            size,
            failures: failures + 1,
            next_at: now + delay,
        }
    }
}
