//! The router's view of one role's nodes: membership from the discovery watch, load from the
//! load-signal subscription, a lazily created gRPC channel per node, and the router's own
//! in-flight counts. [`NodePool::pick`] asks a routing policy for a node.
//!
//! ```text
//!  Discovery::watch(role) ──watch::Receiver<NodeView>──┐
//!  LoadSignals::subscribe(role) ──watch::Receiver<LoadView>──┤
//!                                                      ▼
//!  pick(demand, exclude) ── sync entries with the view ── candidates (accepting work, not excluded)
//!        ── every candidate fresh? ── yes: load policy   (FreeBlocks / ShortestQueue)
//!                                  └─ no:  LeastInFlight (log once on each switch, count)
//!        ──▶ Dispatch (RAII: counts the request on the node until dropped)
//! ```
//!
//! # Invariants
//! - Membership changes take effect on the next pick (the view is compared on every pick)
//!   and are logged by a background task. A node that left is never chosen again; requests
//!   already on it keep their entry (and channel) alive until they finish.
//! - A draining node is never chosen.
//! - A node's channel is created on its first use and reused by every later request (one
//!   HTTP/2 connection per node, multiplexed); a node that re-registers with another address
//!   gets a new entry.
//! - In-flight counts are exact: a [`Dispatch`] adds one on creation and removes it on drop.
//!
//! Cost: a pick is O(nodes + this router's requests in flight on them) under one mutex.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tandem_cluster::{LoadView, NodeInfo, NodeView, Role};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tonic::transport::{Channel, Endpoint};

use crate::canary;
use crate::error::RouterError;
use crate::routing::{
    Candidate, Demand, LeastInFlightPolicy, LoadEstimate, PrefixIndex, RoutingPolicy,
};
use tandem_kv_layout::prefix::prompt_block_hashes;
use crate::stats::{RouterStats, bump};

mod dispatch;
pub use dispatch::Dispatch;

/// How the pool connects to nodes and judges their reports.
#[derive(Clone, Debug)]
pub struct ChannelSettings {
    /// Limit on establishing a connection.
    pub connect_timeout: Duration,
    /// Load reports older than this are stale.
    pub max_report_age: Duration,
    /// What carries the node connections.
    pub connector: Arc<dyn NodeConnector>,
}

/// How the router opens a node's gRPC channel: TCP in production ([`TcpConnector`]); any
/// other byte stream where a test needs it (the deterministic simulation's network).
pub trait NodeConnector: Send + Sync + std::fmt::Debug + 'static {
    /// A channel to `endpoint` (configured: timeouts, keep-alive) that connects on first use
    /// and reconnects after a failure; `Err` says why the node cannot be reached this way.
    fn connect_lazy(&self, endpoint: Endpoint) -> Result<Channel, String>;
}

/// Node connections over TCP; to nodes registered as `https://`, over TLS with `tls` (the CA
/// that signed the nodes' certificates and, for mutual TLS, the router's own certificate).
#[derive(Clone, Debug, Default)]
pub struct TcpConnector {
    /// TLS towards `https://` nodes (`None`: such nodes are refused, never trusted blindly).
    pub tls: Option<tonic::transport::ClientTlsConfig>,
}

impl NodeConnector for TcpConnector {
    fn connect_lazy(&self, endpoint: Endpoint) -> Result<Channel, String> {
        if endpoint.uri().scheme_str() != Some("https") {
            if self.tls.is_some() {
                // Channels are made once per node: this says it once for each plain node.
                tracing::warn!(node = %endpoint.uri(), "node TLS is configured but this node registered plain http; reaching it without TLS");
            }
            return Ok(endpoint.connect_lazy());
        }
        let Some(tls) = &self.tls else {
            return Err(
                "the node serves gRPC over TLS (https) but this router has no --node-tls-ca"
                    .into(),
            );
        };
        endpoint
            .tls_config(tls.clone())
            .map(|e| e.connect_lazy())
            .map_err(|e| format!("TLS: {e}"))
    }
}

/// HTTP/2 keep-alive pings on every node connection: a node whose process is frozen (SIGSTOP,
/// a hung host) stops answering them, and the connection, with every stream on it, fails
/// within interval + timeout (≈ 5 s), so its requests are retried or migrated.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(2);
/// See [`KEEPALIVE_INTERVAL`].
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(3);

/// One node as the pool knows it.
#[derive(Debug)]
pub struct NodeEntry {
    /// Its registration record (as of when the entry was made or last updated).
    info: Mutex<NodeInfo>,
    channel: Mutex<Option<Channel>>,
    settings: ChannelSettings,
    in_flight: AtomicU32,
    /// This router's live dispatches to the node: (ticket, when, KV blocks).
    dispatches: Mutex<Vec<(u64, Instant, u64)>>,
    next_ticket: AtomicU64,
}

impl NodeEntry {
    fn new(info: NodeInfo, settings: ChannelSettings) -> Self {
        Self {
            info: Mutex::new(info),
            channel: Mutex::new(None),
            settings,
            in_flight: AtomicU32::new(0),
            dispatches: Mutex::new(Vec::new()),
            next_ticket: AtomicU64::new(0),
        }
    }

    /// The node's record.
    pub fn info(&self) -> NodeInfo {
        lock(&self.info).clone()
    }

    /// The node id.
    pub fn node_id(&self) -> String {
        lock(&self.info).node_id.clone()
    }

    /// This router's requests in flight on the node.
    pub fn in_flight(&self) -> u32 {
        self.in_flight.load(Ordering::SeqCst)
    }

    /// The node's gRPC channel, created on first use (connecting lazily) and cached.
    pub fn channel(&self) -> Result<Channel, RouterError> {
        let mut slot = lock(&self.channel);
        if let Some(channel) = slot.as_ref() {
            return Ok(channel.clone());
        }
        let info = self.info();
        let bad = |reason: String| RouterError::BadNodeAddress {
            role: info.role,
            node_id: info.node_id.clone(),
            addr: info.grpc_addr.clone(),
            reason,
        };
        let endpoint = Endpoint::from_shared(info.grpc_addr.clone())
            .map_err(|e| bad(e.to_string()))?
            .connect_timeout(self.settings.connect_timeout)
            .tcp_nodelay(true)
            .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
            .keep_alive_timeout(KEEPALIVE_TIMEOUT)
            .keep_alive_while_idle(true);
        let channel = self.settings.connector.connect_lazy(endpoint).map_err(bad)?;
        *slot = Some(channel.clone());
        Ok(channel)
    }

    /// Own dispatches received after `since`: (count, summed work: KV blocks on a decode node,
    /// prompt tokens to compute on a prefill node).
    fn dispatched_after(&self, since: Instant) -> (u32, u64) {
        lock(&self.dispatches)
            .iter()
            .filter(|(_, at, _)| *at > since)
            .fold((0, 0), |(n, w), (_, _, work)| (n + 1, w + work))
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section here is a single read or update, so a poisoned lock still holds
    // consistent data.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The nodes of one role.
#[derive(Debug)]
pub struct NodePool {
    role: Role,
    load_policy: Box<dyn RoutingPolicy>,
    max_report_age: Duration,
    settings: ChannelSettings,
    stats: Arc<RouterStats>,
    loads: watch::Receiver<LoadView>,
    state: Mutex<PoolState>,
    /// Whether the last pick used the fallback (for the once-per-switch log line).
    in_fallback: AtomicBool,
    /// Nodes the canary took out of routing (every pair they are in fails).
    quarantined: Mutex<HashSet<String>>,
    /// Every accepting node fails the canary (none is quarantined then).
    all_failing: AtomicBool,
    /// What each node's prefix cache holds (prefill pools), from KV events.
    prefixes: Option<Arc<PrefixIndex>>,
}

#[derive(Debug)]
struct PoolState {
    members: watch::Receiver<NodeView>,
    entries: HashMap<String, Arc<NodeEntry>>,
}

impl NodePool {
    /// A pool over the `members` and `loads` views of `role`. Spawns a task that logs
    /// membership changes until `shutdown` is cancelled.
    pub fn new(
        role: Role,
        members: watch::Receiver<NodeView>,
        loads: watch::Receiver<LoadView>,
        load_policy: Box<dyn RoutingPolicy>,
        settings: ChannelSettings,
        stats: Arc<RouterStats>,
        shutdown: CancellationToken,
    ) -> Self {
        tokio::spawn(log_membership(role, members.clone(), shutdown));
        let mut members = members;
        members.mark_changed();
        Self {
            role,
            load_policy,
            max_report_age: settings.max_report_age,
            settings,
            stats,
            loads,
            state: Mutex::new(PoolState {
                members,
                entries: HashMap::new(),
            }),
            in_fallback: AtomicBool::new(false),
            quarantined: Mutex::new(HashSet::new()),
            all_failing: AtomicBool::new(false),
            prefixes: None,
        }
    }

    /// The pool with candidates' cached prompt tokens read from `index` (prefill).
    pub fn with_prefix_index(mut self, index: Arc<PrefixIndex>) -> Self {
        self.prefixes = Some(index);
        self
    }

    /// The prefix index, if this pool keeps one.
    pub fn prefix_index(&self) -> Option<&Arc<PrefixIndex>> {
        self.prefixes.as_ref()
    }

    /// Replaces the set of nodes the canary keeps out of routing; logs each change once. A set
    /// holding every node that accepts work quarantines none ([`canary::quarantine_guard`]).
    pub fn set_quarantined(&self, nodes: HashSet<String>) {
        let (nodes, all) = canary::quarantine_guard(nodes, &self.accepting_ids());
        if self.all_failing.swap(all, Ordering::SeqCst) != all {
            if all {
                tracing::error!(role = %self.role, "canary: every {} node fails its probes; routing to all of them anyway rather than refusing every request", self.role);
            } else {
                tracing::info!(role = %self.role, "canary: some {} node passes again", self.role);
            }
        }
        let mut q = lock(&self.quarantined);
        for id in nodes.difference(&q) {
            tracing::warn!(role = %self.role, node_id = %id, "canary: every pair with this {} node fails; it leaves routing until a probe passes", self.role);
        }
        for id in q.difference(&nodes) {
            tracing::info!(role = %self.role, node_id = %id, "canary: probes pass again; the {} node is back in routing", self.role);
        }
        *q = nodes;
    }

    /// Whether every node that accepts work fails the canary (routed to anyway).
    pub fn canary_all_failing(&self) -> bool {
        self.all_failing.load(Ordering::SeqCst)
    }

    /// Ids of the registered nodes that accept work, sorted.
    pub fn accepting_ids(&self) -> Vec<String> {
        let state = lock(&self.state);
        let ids: Vec<String> = state
            .members
            .borrow()
            .values()
            .filter(|n| n.accepts_work())
            .map(|n| n.node_id.clone())
            .collect();
        ids
    }

    /// Ids of every registered node (draining ones included).
    pub fn registered_ids(&self) -> HashSet<String> {
        lock(&self.state).members.borrow().keys().cloned().collect()
    }

    /// Counts a request on node `node_id` whatever the policy and the canary say (the canary's
    /// own probes); [`RouterError::NoNodes`] if it is not registered and accepting work.
    pub fn dispatch_to(&self, node_id: &str) -> Result<Dispatch, RouterError> {
        let mut state = lock(&self.state);
        sync(&mut state, &self.settings);
        let accepting = state
            .members
            .borrow()
            .get(node_id)
            .is_some_and(|n| n.accepts_work());
        match state.entries.get(node_id) {
            Some(entry) if accepting => Ok(Dispatch::new(Arc::clone(entry), 0, None)),
            _ => Err(RouterError::NoNodes { role: self.role }),
        }
    }

    /// The role.
    pub fn role(&self) -> Role {
        self.role
    }

    /// A receiver of the membership view (it notifies on joins, leaves and draining changes).
    pub fn members(&self) -> watch::Receiver<NodeView> {
        lock(&self.state).members.clone()
    }

    /// Registered nodes that accept work now.
    pub fn available(&self) -> usize {
        lock(&self.state)
            .members
            .borrow()
            .values()
            .filter(|n| n.accepts_work())
            .count()
    }

    /// KV capacity, in tokens, of the nodes that accept work and reported their load (blocks
    /// × block size); `None` while none has reported.
    pub fn kv_capacity_tokens(&self) -> Option<u64> {
        let members = lock(&self.state).members.borrow().clone();
        let loads = self.loads.borrow();
        members
            .values()
            .filter(|n| n.accepts_work())
            .filter_map(|n| {
                let r = loads.get(&n.node_id)?;
                Some(r.report.total_blocks * n.layout.block_size_tokens as u64)
            })
            .reduce(|a, b| a + b)
    }

    /// Age of the newest load report of each node that sent one.
    pub fn load_report_ages(&self) -> Vec<(String, Duration)> {
        let loads = self.loads.borrow();
        let mut out: Vec<_> = loads
            .iter()
            .map(|(id, r)| (id.clone(), r.age()))
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// `node_id`'s latest load report, if it is fresh (`--load-max-age-ms`).
    pub fn fresh_report(&self, node_id: &str) -> Option<tandem_cluster::LoadReport> {
        let loads = self.loads.borrow();
        loads
            .get(node_id)
            .filter(|r| r.is_fresh(self.max_report_age))
            .map(|r| r.report.clone())
    }

    /// Registered nodes that accept work, with this router's in-flight count on each.
    pub fn in_flight_by_node(&self) -> Vec<(String, u32)> {
        let mut state = lock(&self.state);
        sync(&mut state, &self.settings);
        let mut out: Vec<_> = state
            .entries
            .iter()
            .map(|(id, e)| (id.clone(), e.in_flight()))
            .collect();
        out.sort();
        out
    }

    /// Chooses a node for a request of `demand`, skipping `exclude`, and counts the request
    /// on it. [`RouterError::NoNodes`] when no other node accepts work.
    pub fn pick(&self, demand: Demand, exclude: &HashSet<String>) -> Result<Dispatch, RouterError> {
        self.pick_for(demand, exclude, &[])
    }

    /// [`pick`](Self::pick) for the prompt `prompt`: with a prefix index, each candidate says
    /// how much of the prompt its cache holds (so the policy can weigh it).
    pub fn pick_for(
        &self,
        demand: Demand,
        exclude: &HashSet<String>,
        prompt: &[u32],
    ) -> Result<Dispatch, RouterError> {
        let mut state = lock(&self.state);
        sync(&mut state, &self.settings);
        let members = state.members.borrow().clone();
        let quarantined = lock(&self.quarantined).clone();
        let nodes: Vec<(&NodeInfo, Arc<NodeEntry>)> = members
            .values()
            .filter(|info| {
                info.accepts_work()
                    && !exclude.contains(&info.node_id)
                    && !quarantined.contains(&info.node_id)
            })
            .filter_map(|info| {
                state
                    .entries
                    .get(&info.node_id)
                    .map(|e| (info, Arc::clone(e)))
            })
            .collect();
        if nodes.is_empty() {
            return Err(RouterError::NoNodes { role: self.role });
        }
        let loads = self.loads.borrow();
        let mut stale = Vec::new();
        // The prompt's block hashes, once per block size the nodes use.
        let mut hashes: HashMap<u32, Arc<[u64]>> = HashMap::new();
        let mut hashes_for = |block_size: u32| {
            Arc::clone(hashes.entry(block_size).or_insert_with(|| {
                Arc::from(prompt_block_hashes(prompt, block_size as usize))
            }))
        };
        let candidates: Vec<Candidate<'_>> = nodes
            .iter()
            .map(|(info, entry)| {
                let load = loads
                    .get(&info.node_id)
                    .filter(|r| r.is_fresh(self.max_report_age))
                    .map(|r| self.estimate(entry, r));
                if load.is_none() {
                    stale.push(info.node_id.as_str());
                }
                let cached_tokens = match &self.prefixes {
                    Some(index) if !prompt.is_empty() => {
                        index.cached_tokens(&info.node_id, &mut hashes_for)
                    }
                    _ => 0,
                };
                Candidate {
                    node_id: &info.node_id,
                    load,
                    in_flight: entry.in_flight(),
                    block_size_tokens: info.layout.block_size_tokens as u64,
                    cached_tokens,
                }
            })
            .collect();
        let role_stats = self.stats.role(self.role);
        let fallback = !stale.is_empty();
        let chosen = if fallback {
            if !self.in_fallback.swap(true, Ordering::SeqCst) {
                bump(&role_stats.fallback_entered);
                tracing::warn!(
                    role = %self.role,
                    nodes = ?stale,
                    max_age = ?self.max_report_age,
                    "load reports stale or absent; routing {} requests by this router's own in-flight counts",
                    self.role
                );
            }
            bump(&role_stats.fallback_picks);
            LeastInFlightPolicy.select(&candidates, demand)
        } else {
            if self.in_fallback.swap(false, Ordering::SeqCst) {
                tracing::info!(
                    role = %self.role,
                    policy = self.load_policy.name(),
                    "fresh load reports from every {} node again; routing by load",
                    self.role
                );
            }
            bump(&role_stats.load_picks);
            self.load_policy.select(&candidates, demand)
        };
        let index = chosen.ok_or(RouterError::NoNodes { role: self.role })?;
        let entry = Arc::clone(&nodes[index].1);
        let chosen = &candidates[index];
        let work = match self.role {
            Role::Decode => chosen.blocks_for(demand.tokens),
            // What the node will compute: the prompt less the prefix it caches.
            Role::Prefill => demand.prompt_tokens.saturating_sub(chosen.cached_tokens),
        };
        Ok(Dispatch::new(entry, work, chosen.load))
    }

    /// A fresh report plus this router's dispatches to the node since it arrived (each with
    /// the work it brought: KV blocks, or the prompt tokens the node had left to compute).
    fn estimate(
        &self,
        entry: &NodeEntry,
        received: &tandem_cluster::ReceivedReport,
    ) -> LoadEstimate {
        let (since, work) = entry.dispatched_after(received.received_at);
        let report = &received.report;
        let mut estimate = LoadEstimate {
            queue_len: report.queue_len,
            running: report.running,
            free_blocks: report.free_blocks,
            total_blocks: report.total_blocks,
            pending_prompt_tokens: report.pending_prompt_tokens,
        };
        match self.role {
            Role::Prefill => {
                estimate.queue_len += since;
                estimate.pending_prompt_tokens += work;
            }
            Role::Decode => {
                estimate.running += since;
                estimate.free_blocks = estimate.free_blocks.saturating_sub(work);
            }
        }
        estimate
    }
}

/// Brings the entries in line with the membership view if it changed.
fn sync(state: &mut PoolState, settings: &ChannelSettings) {
    if !state.members.has_changed().unwrap_or(false) {
        return;
    }
    let view = state.members.borrow_and_update().clone();
    state.entries.retain(|id, entry| {
        view.get(id)
            .is_some_and(|info| info.grpc_addr == lock(&entry.info).grpc_addr)
    });
    for (id, info) in view {
        match state.entries.get(&id) {
            Some(entry) => *lock(&entry.info) = info,
            None => {
                state
                    .entries
                    .insert(id, Arc::new(NodeEntry::new(info, settings.clone())));
            }
        }
    }
}

/// Logs joins, leaves and draining changes of `role` until `shutdown`.
async fn log_membership(
    role: Role,
    mut members: watch::Receiver<NodeView>,
    shutdown: CancellationToken,
) {
    let mut known = members.borrow_and_update().clone();
    if !known.is_empty() {
        tracing::info!(role = %role, nodes = ?known.keys().collect::<Vec<_>>(), "{role} nodes registered");
    }
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            changed = members.changed() => if changed.is_err() { return },
        }
        let view = members.borrow_and_update().clone();
        for (id, info) in &view {
            match known.get(id) {
                None => {
                    tracing::info!(role = %role, node_id = %id, addr = %info.grpc_addr, "{role} node joined")
                }
                Some(old) if old.draining != info.draining || old.state != info.state => {
                    tracing::info!(role = %role, node_id = %id, state = info.state.as_str(), draining = info.draining, "{role} node state changed")
                }
                Some(_) => {}
            }
        }
        for id in known.keys().filter(|id| !view.contains_key(*id)) {
            tracing::info!(role = %role, node_id = %id, "{role} node left");
        }
        known = view;
    }
}
