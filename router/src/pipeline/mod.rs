//! The core both ingresses share: [`Router::generate`] turns a [`GenerateRequest`] into a
//! stream of [`GenerationEvent`]s, running the disaggregated pipeline across the cluster.
//!
//! ```text
//!  generate(request)
//!    prepare (validate, tokenize)        ── InvalidArgument / ModelNotFound
//!    the key's limits (ratelimit.rs)     ── RateLimited (429 / RESOURCE_EXHAUSTED)
//!    a prefill and a decode node exist?  ── NoNodes (UNAVAILABLE); no prefill node is fine for a
//!                                           prompt a decode node may compute (placement)
//!    admission.acquire(priority)         ── Overloaded / QueueTimeout (RESOURCE_EXHAUSTED)
//!    spawn the request task ──────────────────────────────────────────────┐
//!    wait for its first event (an error here becomes the call's status)   │
//!    ◀── GenerationStream (first event, then the rest)                    │
//!                                                                         ▼
//!  request task: attempt (attempt.rs) ── retry-safe failure, nothing sent yet, attempts left?
//!                   │ yes: release, count, attempt again on another pair (DATA_LOSS = re-prefill)
//!                   │ output already sent, retry safe, attempts left: migrate (re-prefill prompt +
//!                   │   output so far on another pair; the client sees one unbroken stream)
//!                   │ no:  the error ends the stream (Interrupted once output was sent)
//!                 client gone (stream dropped) ── the task stops at once: node streams are
//!                   dropped (the nodes see the calls cancelled), the reservation is released
//!                 the admission permit is held until the task ends
//! ```
//!
//! # Invariants ("nothing lost")
//! - Every admitted request ends with exactly one `Final` event or one error, unless the client
//!   went away first.
//! - The request task owns every resource of the request (permit, node dispatch counts,
//!   reservation guard, node streams): they are freed when it ends, on every path.
//! - Events are sent through a bounded channel: a slow client slows the decode stream it reads
//!   (HTTP/2 flow control reaches the node) instead of buffering without limit.

mod attempt;
mod choices;
mod options;
mod events;
mod probe;
mod reservation;
mod start;
mod task;

pub use choices::{ChoiceEvent, Choices, MAX_CHOICES};
pub use options::{RequestContext, RouterOptions, Stores};
pub use events::{FinishReason, GenerationEvent, GenerationFinal, GenerationStream, Usage};

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tandem_cluster::{Discovery, LoadSignals, Role};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::admission::Admission;
use crate::keys::{ApiKeys, KeyIdentity};
use crate::canary::CanaryState;
use crate::usage::Ledger;
use crate::error::RouterError;
use crate::metrics::RouterMetrics;
use crate::model::ServedModel;
use crate::ratelimit::RateLimiter;
use crate::nodes::{ChannelSettings, NodePool};
use crate::request::GenerateRequest;
use crate::routing::{FreeBlocksDecodePolicy, PrefixIndex};
use crate::stats::{RouterStats, StatsSnapshot};


/// Events buffered between a request's task and its client.
const EVENT_BUFFER: usize = 16;

/// Shared state of a router.
#[derive(Debug)]
pub(crate) struct Inner {
    model: ServedModel,
    options: RouterOptions,
    admission: Admission,
    prefill: NodePool,
    decode: NodePool,
    stats: Arc<RouterStats>,
    metrics: RouterMetrics,
    ledger: Arc<Ledger>,
    /// The API keys now (the key file is reloaded in place).
    keys: std::sync::RwLock<Arc<ApiKeys>>,
    limiter: Arc<RateLimiter>,
    canary: std::sync::Mutex<CanaryState>,
    /// Bumped after every canary round (health watchers re-evaluate).
    canary_rounds: tokio::sync::watch::Sender<u64>,
    /// The probe prompt's token ids.
    canary_prompt: Vec<u32>,
    next_request: AtomicU64,
    id_prefix: String,
    shutdown: CancellationToken,
    /// The control-plane handles the views come from, kept for the router's lifetime.
    control_plane: ControlPlane,
}

/// The discovery and load-signal handles a router was started with.
struct ControlPlane {
    discovery: Arc<dyn Discovery>,
    signals: Arc<dyn LoadSignals>,
}

impl std::fmt::Debug for ControlPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlPlane")
            .field("discovery_cluster", &self.discovery.cluster())
            .field("signals_cluster", &self.signals.cluster())
            .finish()
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// The router core. Cheap to clone; clones share everything.
#[derive(Clone, Debug)]
pub struct Router {
    inner: Arc<Inner>,
}

/// A [`Router`] reference that does not keep it alive (scrape-time collectors).
#[derive(Clone, Debug)]
pub struct WeakRouter {
    inner: std::sync::Weak<Inner>,
}

impl WeakRouter {
    /// The router, while it lives.
    pub fn upgrade(&self) -> Option<Router> {
        self.inner.upgrade().map(|inner| Router { inner })
    }
}

impl Router {
    /// Starts a router for `model`: watches both roles' membership and load reports, and keeps
    /// usage and rate limits in `stores` (etcd in production). Fails if the first listing of
    /// either role fails (the control plane is unreachable at startup).
    pub async fn start(
        model: ServedModel,
        options: RouterOptions,
        discovery: Arc<dyn Discovery>,
        signals: Arc<dyn LoadSignals>,
        stores: Stores,
    ) -> Result<Self, RouterError> {
        let tcp = Arc::new(crate::nodes::TcpConnector::default());
        Self::start_with_connector(model, options, discovery, signals, stores, tcp).await
    }

    /// [`Router::start`] with node connections carried by `connector` instead of TCP (the
    /// deterministic simulation runs the router over a simulated network).
    pub async fn start_with_connector(
        model: ServedModel,
        options: RouterOptions,
        discovery: Arc<dyn Discovery>,
        signals: Arc<dyn LoadSignals>,
        stores: Stores,
        connector: Arc<dyn crate::nodes::NodeConnector>,
    ) -> Result<Self, RouterError> {
        let stats = Arc::new(RouterStats::default());
        let shutdown = CancellationToken::new();
        let settings = ChannelSettings {
            connect_timeout: options.connect_timeout,
            max_report_age: options.max_report_age,
            connector,
        };
        let mut pools = Vec::with_capacity(2);
        for role in [Role::Prefill, Role::Decode] {
            let members = discovery.watch(role).await?;
            let loads = signals.subscribe(role).await?;
            let policy: Box<dyn crate::routing::RoutingPolicy> = match role {
                Role::Prefill => options.prefill_policy.build(),
                Role::Decode => Box::new(FreeBlocksDecodePolicy),
            };
            pools.push(NodePool::new(
                role,
                members,
                loads,
                policy,
                settings.clone(),
                Arc::clone(&stats),
                shutdown.clone(),
            ));
        }
        let decode = pools.pop().expect("two pools were built");
        let prefixes = Arc::new(PrefixIndex::default());
        let prefill = pools
            .pop()
            .expect("two pools were built")
            .with_prefix_index(Arc::clone(&prefixes));
        match signals.subscribe_kv_events().await {
            Ok(events) => {
                tokio::spawn(follow_kv_events(
                    events,
                    prefixes,
                    discovery.watch(Role::Prefill).await?,
                    shutdown.clone(),
                ));
            }
            Err(error) => tracing::warn!(
                %error,
                "no KV events: prefill routing cannot see what nodes have cached (every prompt counts as uncached)"
            ),
        }
        // Unique per router: request ids and the rate limiter's holder name come from it. Pid
        // and start time alone collide for two routers of one process started in the same
        // millisecond (or of two hosts), which made them one holder of a key's slots.
        let nonce = {
            use std::hash::{BuildHasher, Hasher};
            static STARTED: AtomicU64 = AtomicU64::new(0);
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u64(STARTED.fetch_add(1, Ordering::Relaxed));
            h.finish() & 0xffff
        };
        let id_prefix = format!(
            "{:x}{:x}{nonce:04x}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_millis() as u64)
                .unwrap_or(0)
        );
        let metrics = RouterMetrics::new(&model.name);
        let canary_prompt = model
            .tokenizer
            .encode("The canary checks that every pair serves.");
        let canary_interval = options.canary.interval;
        let router = Self {
            inner: Arc::new(Inner {
                metrics: metrics.clone(),
                ledger: Arc::new(Ledger::new(stores.usage)),
                keys: std::sync::RwLock::new(Arc::new(options.api_keys.clone())),
                limiter: RateLimiter::new(stores.limits, format!("router-{id_prefix}")),
                canary: std::sync::Mutex::new(CanaryState::default()),
                canary_rounds: tokio::sync::watch::Sender::new(0),
                canary_prompt,
                model,
                admission: Admission::new(options.admission),
                options,
                prefill,
                decode,
                stats,
                next_request: AtomicU64::new(0),
                id_prefix,
                shutdown,
                control_plane: ControlPlane { discovery, signals },
            }),
        };
        metrics.install(&router);
        tokio::spawn(Arc::clone(&router.inner.limiter).maintain(router.inner.shutdown.clone()));
        tokio::spawn(crate::usage::flush_loop(
            Arc::clone(&router.inner.ledger),
            router.inner.shutdown.clone(),
        ));
        if let Some(interval) = canary_interval {
            tokio::spawn(probe::canary_loop(
                router.downgrade(),
                router.inner.prefill.members(),
                router.inner.decode.members(),
                router.inner.shutdown.clone(),
                interval,
            ));
        }
        Ok(router)
    }

    /// A reference that does not keep the router alive.
    pub fn downgrade(&self) -> WeakRouter {
        WeakRouter {
            inner: Arc::downgrade(&self.inner),
        }
    }

    /// The metric handles (and `/metrics` rendering).
    pub fn metrics(&self) -> &RouterMetrics {
        &self.inner.metrics
    }

    /// Age of the newest load report of each node of `role` that sent one.
    pub fn load_report_ages(&self, role: Role) -> Vec<(String, Duration)> {
        match role {
            Role::Prefill => self.inner.prefill.load_report_ages(),
            Role::Decode => self.inner.decode.load_report_ages(),
        }
    }

    /// The served model.
    pub fn model(&self) -> &ServedModel {
        &self.inner.model
    }

    /// The settings.
    pub fn options(&self) -> &RouterOptions {
        &self.inner.options
    }

    /// Checks an `Authorization` value against the API keys and names the caller.
    pub fn authorize(&self, authorization: Option<&str>) -> Result<KeyIdentity, RouterError> {
        self.api_keys().check(authorization)
    }

    /// The API keys now (the key file may have been reloaded since the router started).
    pub fn api_keys(&self) -> Arc<ApiKeys> {
        Arc::clone(&self.inner.keys.read().unwrap_or_else(|p| p.into_inner()))
    }

    /// Reads the key file again (SIGHUP, or the file changed). On an error the keys loaded
    /// before stay in place; the error names the file and line.
    pub fn reload_api_keys(&self) -> Result<usize, RouterError> {
        let result = self.api_keys().reload();
        self.inner.metrics.key_file_reload(result.is_ok());
        let keys = result?;
        let n = keys.ids().len();
        *self.inner.keys.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(keys);
        Ok(n)
    }

    /// What the router knows of the prefill nodes' prefix caches (KV events).
    pub fn prefix_index(&self) -> Option<&Arc<PrefixIndex>> {
        self.inner.prefill.prefix_index()
    }

    /// The per-key rate limiter.
    pub fn rate_limiter(&self) -> &Arc<RateLimiter> {
        &self.inner.limiter
    }

    /// The usage ledger.
    pub fn ledger(&self) -> &Ledger {
        &self.inner.ledger
    }

    /// Writes pending usage now (graceful shutdown, tests).
    pub async fn flush_usage(&self) -> Result<(), RouterError> {
        self.inner.ledger.flush().await.map_err(RouterError::Cluster)
    }

    /// The cluster this router serves.
    pub fn cluster(&self) -> &str {
        self.inner.control_plane.discovery.cluster()
    }

    /// Whether the load-signal transport (NATS) is connected now.
    pub fn load_signals_connected(&self) -> bool {
        self.inner.control_plane.signals.status().borrow().connected
    }

    /// Registered nodes accepting work: (prefill, decode).
    pub fn available_nodes(&self) -> (usize, usize) {
        (
            self.inner.prefill.available(),
            self.inner.decode.available(),
        )
    }

    /// Whether the router can serve: with the canary on, at least one prefill → decode pair
    /// passed its last probe; without it, at least one node of each role accepts work.
    pub fn is_ready(&self) -> bool {
        let (prefill, decode) = self.available_nodes();
        if prefill == 0 || decode == 0 {
            return false;
        }
        match self.inner.options.canary.interval {
            Some(_) => self.canary_counts().1 > 0,
            None => true,
        }
    }

    /// Canary pairs known and passing.
    pub fn canary_counts(&self) -> (usize, usize) {
        self.canary_state().counts()
    }

    /// A copy of the canary's state (every pair's last result).
    pub fn canary_state(&self) -> CanaryState {
        self.inner
            .canary
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Resolves when the membership of either role changes or a canary round ends (for
    /// readiness reporting); never resolves once the control-plane views are gone.
    pub async fn membership_changed(&self) {
        let mut prefill = self.inner.prefill.members();
        let mut decode = self.inner.decode.members();
        let mut rounds = self.inner.canary_rounds.subscribe();
        tokio::select! {
            Ok(()) = prefill.changed() => {}
            Ok(()) = decode.changed() => {}
            Ok(()) = rounds.changed() => {}
            else => std::future::pending().await,
        }
    }

    /// Whether every node of `role`'s pool fails the canary (routed to anyway).
    pub fn canary_all_failing(&self, role: Role) -> bool {
        match role {
            Role::Prefill => self.inner.prefill.canary_all_failing(),
            Role::Decode => self.inner.decode.canary_all_failing(),
        }
    }

    /// This router's in-flight requests per node of `role`, by node id.
    pub fn in_flight_by_node(&self, role: Role) -> Vec<(String, u32)> {
        match role {
            Role::Prefill => self.inner.prefill.in_flight_by_node(),
            Role::Decode => self.inner.decode.in_flight_by_node(),
        }
    }

    /// The counters.
    pub fn stats(&self) -> StatsSnapshot {
        self.inner.stats.snapshot()
    }

    /// The admission queue (for its occupancy).
    pub fn admission(&self) -> &Admission {
        &self.inner.admission
    }

    /// Validates, admits and starts `request`; returns once its first event is known, so an
    /// early failure is this call's error rather than the stream's. See the module docs.
    pub async fn generate(
        &self,
        request: GenerateRequest,
    ) -> Result<GenerationStream, RouterError> {
        self.generate_with(request, RequestContext::default()).await
    }
}

/// Applies every node's KV events to `index` until `shutdown`, forgetting nodes that left the
/// prefill membership.
async fn follow_kv_events(
    mut events: mpsc::Receiver<tandem_cluster::KvEventBatch>,
    index: Arc<PrefixIndex>,
    mut members: tokio::sync::watch::Receiver<tandem_cluster::NodeView>,
    shutdown: CancellationToken,
) {
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            batch = events.recv() => match batch {
                Some(batch) => index.apply(batch),
                None => return,
            },
            Ok(()) = members.changed() => {
                let view = members.borrow_and_update().clone();
                index.retain(|id| view.contains_key(id));
            }
        }
    }
}
