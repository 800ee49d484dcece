//! tandem's router: the gRPC (`tandem.v1.Inference`) and OpenAI-compatible HTTP ingresses,
//! admission, routing across prefill and decode nodes, and the request pipeline that ties a
//! reservation, a prefill and a decode together. It never links the engine: it tokenizes with
//! `tandem-tokenizer` and talks to nodes over gRPC.
//!
//! ```text
//!  grpc.rs ──┐                                             ┌─ nodes.rs (prefill pool) ─ routing/prefill_queue.rs
//!  http/ ────┴─▶ pipeline::Router::generate ─ request.rs ─┤                              routing/in_flight.rs (fallback)
//!                 (validate, tokenize)                     └─ nodes.rs (decode pool) ── routing/decode_blocks.rs
//!                 admission.rs (API keys, bounded priority queue), canary.rs (health by real probes)
//!                 pipeline/attempt.rs (Reserve → Prefill → Decode), pipeline/reservation.rs (RAII release)
//!  config.rs (flags, env, TOML) ─ server.rs (run both servers) ─ model.rs (tokenizer, context length)
//!  error.rs (RouterError, NodeFault: classified once) ─ stats.rs (counters) ─ metrics.rs (Prometheus families)
//! ```
//!
//! Servers take bound listeners and a shutdown future ([`serve`], [`grpc::serve`],
//! [`http::serve`]), so tests run them on port 0. The core is generic over
//! `Arc<dyn Discovery>` and `Arc<dyn LoadSignals>` (etcd + NATS in production, the in-memory
//! twins in tests and embedded mode).

#![warn(missing_docs)]

pub mod admission;
pub mod canary;
pub mod config;
pub mod error;
pub mod grpc;
pub mod http;
pub mod keys;
pub mod metrics;
pub mod model;
pub mod nodes;
pub mod pipeline;
pub mod ratelimit;
pub mod request;
pub mod routing;
pub mod server;
pub mod stats;
pub mod tls;
pub mod usage;

pub use admission::{Admission, AdmissionLimits};
pub use keys::{ApiKeys, KeyIdentity};
pub use config::{RouterArgs, RouterConfig};
pub use error::{NodeFault, RouterError, Step};
pub use model::ServedModel;
pub use ratelimit::{KeyPermit, RateLimitStatus, RateLimiter};
pub use nodes::{NodeConnector, TcpConnector};
pub use pipeline::{
    ChoiceEvent, Choices, MAX_CHOICES, FinishReason, GenerationEvent, GenerationFinal, GenerationStream, RequestContext, Router,
    RouterOptions, Stores, Usage,
};
pub use request::{Field, GenerateRequest, Priority, PromptInput, Sampling, TokenLimits};
pub use server::{run, run_blocking, serve, serve_tls};
pub use stats::StatsSnapshot;
