//! What a router is started with and what an ingress passes with each request: its settings
//! ([`RouterOptions`]), where the state shared between routers lives ([`Stores`]), and a
//! request's context beyond its body ([`RequestContext`]).

use std::sync::Arc;
use std::time::Duration;

use tandem_cluster::{MemoryRateLimitStore, RateLimitStore, UsageStore};
use tandem_telemetry::trace::propagation::RemoteParent;

use crate::admission::AdmissionLimits;
use crate::canary::CanarySettings;
use crate::keys::{ApiKeys, KeyIdentity};
use crate::request::TokenLimits;
use crate::usage::CostModel;

/// Router settings other than the model and the control plane.
#[derive(Clone, Debug)]
pub struct RouterOptions {
    /// Output limits.
    pub tokens: TokenLimits,
    /// Admission queue limits.
    pub admission: AdmissionLimits,
    /// Accepted API keys (empty: no authentication).
    pub api_keys: ApiKeys,
    /// Attempts per request (first try included) on retry-safe failures.
    pub max_attempts: u32,
    /// Timeout of unary node calls (Reserve, Release).
    pub rpc_timeout: Duration,
    /// Timeout of connecting to a node.
    pub connect_timeout: Duration,
    /// Load reports older than this are stale (routing falls back to in-flight counts).
    pub max_report_age: Duration,
    /// Once a stream is producing (KV pushed, or tokens flowing), the longest silence from the
    /// decode node before it counts as stalled and the request migrates.
    pub stream_idle_timeout: Duration,
    /// The canary (health that runs real inference).
    pub canary: CanarySettings,
    /// The cost of a node-hour per pool (`/v1/usage` prices usage with it).
    pub cost: CostModel,
    /// How prefill nodes are chosen.
    pub prefill_policy: crate::routing::PrefillPolicy,
    /// Which prompts the decode node computes itself (conditional disaggregation).
    pub placement: crate::routing::PlacementSettings,
}

/// Where a router keeps what it shares with the other routers.
#[derive(Clone, Debug)]
pub struct Stores {
    /// The usage ledger.
    pub usage: Arc<dyn UsageStore>,
    /// The per-key rate limits' buckets.
    pub limits: Arc<dyn RateLimitStore>,
}

impl Stores {
    /// In-process stores: usage and limits of this router alone (tests, one-router setups).
    pub fn memory() -> Self {
        Stores {
            usage: Arc::new(tandem_cluster::MemoryUsageStore::default()),
            limits: Arc::new(MemoryRateLimitStore::default()),
        }
    }
}

/// What an ingress knows about a request beyond its body.
#[derive(Clone, Debug)]
pub struct RequestContext {
    /// The caller's W3C trace context (HTTP headers, gRPC metadata); none starts a new trace.
    pub parent: RemoteParent,
    /// Who is calling (usage is counted under its id).
    pub key: KeyIdentity,
}

impl Default for RequestContext {
    fn default() -> Self {
        RequestContext {
            parent: RemoteParent::none(),
            key: KeyIdentity::anonymous(),
        }
    }
}
