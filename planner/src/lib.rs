//! tandem's planner: sizes the prefill and decode pools on their own from the load signals.
//!
//! ```text
//! config    PlannerConfig: SLOs, watermarks, per-pool min/max and cooldowns (TOML, validated)
//! decide    the pure decision function (also used by `tandem sim`), with table tests
//! observe   Observer: membership (etcd) + fresh load reports (NATS) + desired sizes → Observation
//! actuate   Actuator trait (StoreActuator: desired sizes in etcd), Retry with back-off
//! kube      KubeExecutor: patches the pools' Deployments (`/scale`) to etcd's targets
//! run       Planner: election → rounds; DecisionRecord published on
//!           tandem.{cluster}.planner.decisions; DecisionSink trait (NATS, memory)
//! metrics   tandem_planner_* families
//! ```
//!
//! The planner always writes each pool's desired size to etcd; an executor applies it: `tandem
//! up`'s reconciler on one machine, or [`KubeExecutor`] (`tandem planner --executor kubernetes`)
//! in a Kubernetes cluster. Two planners may run; the etcd election
//! ([`tandem_cluster::Election`]) makes one act. A `--dry-run` planner decides and publishes but
//! never campaigns or applies.

#![warn(missing_docs)]

pub mod actuate;
pub mod config;
pub mod decide;
pub mod error;
pub mod kube;
pub mod metrics;
pub mod observe;
pub mod run;

pub use actuate::{Actuator, Retry, StoreActuator};
pub use config::{PlannerConfig, PoolLimits};
pub use decide::{Decision, DecisionInputs, NodeLoad, Observation, PlannerMemory, PoolObservation, decide};
pub use error::PlannerError;
pub use crate::kube::{KubeExecutor, KubeExecutorConfig, PoolOutcome};
pub use metrics::PlannerMetrics;
pub use observe::Observer;
pub use run::{DecisionRecord, DecisionSink, MemoryDecisionSink, NatsDecisionSink, Planner};
