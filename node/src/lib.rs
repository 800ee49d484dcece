//! What tandem's prefill and decode nodes share: configuration, the engine thread, the gRPC
//! server (with health and reflection), KV-transfer setup, cluster membership and load reports,
//! and the phased shutdown.
//!
//! ```text
//!   gRPC (tonic, tokio workers)             engine thread (one OS thread, owns the Engine)
//!   service ── Command (bounded mpsc) ────▶ drain commands ─▶ step() ─▶ outputs
//!       ▲        replies: oneshot                 │                       │
//!       └──── per-request stream (bounded mpsc) ◀─┴───────────────────────┘
//!                                                 └─▶ watch<EngineSnapshot> ─▶ LoadReport ─▶ NATS
//!   KV memory: KvTransport::allocate (UCX shared memory) ──TransferBacking──▶ KvPool::external
//! ```
//!
//! | module | what |
//! |---|---|
//! | [`config`], [`config_file`], [`env_names`] | flags (clap + env), `--config` TOML layering, every env var name |
//! | [`engine_thread`] | the engine actor: a dedicated thread, a [`Driver`](engine_thread::Driver) per role, snapshots |
//! | [`model`], [`fetch`] | resolving (fetching the default) and loading the model into transport memory |
//! | [`transport`] | choosing UCX/TCP, KV addresses (`ucx://host:port`), the [`TransferBacking`](transport::TransferBacking) adapter |
//! | [`server`] | the tonic server with `grpc.health.v1.Health` and server reflection |
//! | [`kv_events`] | publishing the prefix cache's contents (KV events) for cache-aware routing |
//! | [`membership`] | etcd registration (retry at startup, layout refusal) and NATS load reports |
//! | [`lifecycle`] | admission while draining, in-flight tracking, signals, the phased shutdown |
//! | [`metrics`] | every metric family of a node, its `/metrics` endpoint |
//! | [`convert`] | proto ⇄ engine types (sampling, priority, finish reason, usage) and seeds |
//! | [`status`] | engine and transfer errors → `tonic::Status` with retry metadata |
//! | [`error`] | [`NodeError`], this crate's boundary error |
//!
//! Invariant shared by both nodes: the engine is only touched on its own thread; everything
//! else reaches it through [`engine_thread::EngineHandle`], and every reply channel is bounded.

#![warn(missing_docs)]

pub mod config;
pub mod config_file;
pub mod convert;
pub mod engine_thread;
pub mod env_names;
pub mod error;
pub mod fetch;
pub mod kv_events;
pub mod lifecycle;
pub mod membership;
pub mod metrics;
pub mod model;
pub mod server;
pub mod status;
pub mod tls;
pub mod transport;

pub use config::{ClusterArgs, ListenArgs, NodeArgs, TransportChoice};
pub use engine_thread::{Driver, EngineHandle, EngineSnapshot};
pub use error::NodeError;
pub use lifecycle::{Failure, InFlightGuard, Lifecycle};
pub use membership::{Coordination, Membership};
pub use metrics::NodeMetrics;
pub use transport::{KvAddress, TransferBacking};
