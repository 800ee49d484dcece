//! tandem's control plane: who is in the cluster (etcd membership) and how busy each node is
//! (NATS load signals).
//!
//! ```text
//! keys        every etcd key and NATS subject, percent-encoded segments, parse-back
//! node        Role, NodeInfo (the JSON record in etcd), ClusterLayout
//! discovery   Discovery trait; EtcdDiscovery (leases, keep-alive, re-register, watch with
//!             re-list); MemoryDiscovery (= StaticDiscovery, in-process, same semantics)
//! load        LoadReport, LoadSignals trait; NatsLoadSignals, MemoryLoadSignals;
//!             LoadPublisher (latest value every period); LoadView with received-at times
//! scale       desired pool sizes and their limits (ScaleStore), the planner election
//! testing     TestEtcd, TestNats: the real servers on free ports, for tests
//! error       ClusterError (one enum, structured variants, is_retryable, kind)
//! ```
//!
//! The control plane is not on the data path: if etcd or NATS goes away, views keep their
//! last value, publishers keep ticking, registrations keep retrying, and everything resumes
//! when the server returns ("degrade, don't die": docs/ARCHITECTURE.md, "Invariants and where
//! tests assert them"). Nothing here blocks a thread; all waits on the network carry a timeout.
//!
//! Background tasks are spawned on the caller's tokio runtime (`tokio::spawn`), so every
//! constructor and trait method must be called from within one.

#![warn(missing_docs)]

pub mod discovery;
pub mod error;
mod etcd;
pub mod keys;
pub mod load;
pub mod node;
pub mod ratelimit;
pub mod scale;
pub mod testing;
pub mod tls;
pub mod usage;

mod cas;

pub use discovery::{
    Discovery, EtcdConfig, EtcdDiscovery, MemoryDiscovery, Registration, RegistrationState,
    StaticDiscovery,
};
pub use error::ClusterError;
pub use keys::ClusterKeys;
pub use load::{
    KvEventBatch, KvEventBody, DEFAULT_LOAD_PERIOD, LoadPublisher, LoadReport, LoadSignals, LoadSignalsStatus, LoadView,
    MemoryLoadSignals, NatsConfig, NatsLoadSignals, ReceivedReport,
};
pub use node::{ClusterLayout, NodeInfo, NodeState, NodeView, Role};
pub use scale::{
    Election, EtcdElection, EtcdScaleStore, Leadership, MemoryElection, MemoryScaleStore, PoolBounds,
    ScaleLimits, ScaleStore, ScaleTargets,
};
pub use ratelimit::{
    Ask, EtcdRateLimitStore, Grant, KeyLimits, LimitKind, LimitRecord, MemoryRateLimitStore,
    RateLimitStore, SlotHold,
};
pub use usage::{EtcdUsageStore, MemoryUsageStore, UsageStore, UsageTotals};
