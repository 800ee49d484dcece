//! Joining the cluster: register this node in etcd (retrying while etcd is unreachable at
//! startup, refusing to start when the cluster's KV layout differs), and publish its load on
//! NATS every `--load-report-ms`, from the engine thread's snapshots.
//!
//! The control plane is not on the data path: once registered, an etcd or NATS outage never
//! stops serving (the cluster crate keeps retrying in the background). Only the *first*
//! registration is a startup condition, bounded by `--startup-timeout-secs`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tandem_cluster::{
    ClusterError, Discovery, EtcdConfig, EtcdDiscovery, LoadPublisher, LoadReport, LoadSignals,
    NatsConfig, NatsLoadSignals, NodeInfo, NodeState, Registration, RegistrationState,
};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::config::NodeArgs;
use crate::engine_thread::EngineSnapshot;
use crate::error::NodeError;

/// Which control plane a node joins.
pub enum Coordination {
    /// etcd and NATS at the addresses in the flags (what the binaries use).
    FromArgs,
    /// Implementations the caller built (in-process clusters: `MemoryDiscovery`,
    /// `MemoryLoadSignals`; or shared etcd/NATS clients).
    Provided {
        /// Membership.
        discovery: Arc<dyn Discovery>,
        /// Load reports.
        signals: Arc<dyn LoadSignals>,
    },
}

/// This node's place in the cluster: its registration and its load publisher.
pub struct Membership {
    registration: Registration,
    publisher: LoadPublisher,
    forwarder: JoinHandle<()>,
    signals: Arc<dyn LoadSignals>,
    discovery: Arc<dyn Discovery>,
    lease_failures: Arc<AtomicU64>,
    lease_watch: JoinHandle<()>,
}

/// Registers `info` and starts publishing load from `snapshots`. `cancel` stops the publisher
/// (the node's shutdown token).
pub async fn join(
    args: &NodeArgs,
    coordination: Coordination,
    info: NodeInfo,
    snapshots: watch::Receiver<EngineSnapshot>,
    cancel: &CancellationToken,
) -> Result<Membership, NodeError> {
    let (discovery, signals): (Arc<dyn Discovery>, Arc<dyn LoadSignals>) = match coordination {
        Coordination::Provided { discovery, signals } => (discovery, signals),
        Coordination::FromArgs => {
            let c = &args.cluster;
            let etcd = EtcdConfig::new(c.etcd_endpoints.clone(), &c.cluster)
                .with_lease_ttl(args.lease_ttl());
            let discovery =
                EtcdDiscovery::connect(etcd)
                    .await
                    .map_err(|source| NodeError::Cluster {
                        step: "connect to etcd; check --etcd-endpoints",
                        source,
                    })?;
            let url = c.nats_url.clone().unwrap_or_default();
            let nats = NatsLoadSignals::connect(NatsConfig::new(&url, &c.cluster))
                .await
                .map_err(|source| NodeError::Cluster {
                    step: "connect to NATS; check --nats-url",
                    source,
                })?;
            // The first connection is made in the background; give it a moment before warning.
            let mut status = nats.status();
            let connected =
                tokio::time::timeout(Duration::from_secs(1), status.wait_for(|s| s.connected))
                    .await
                    .is_ok();
            if !connected {
                tracing::warn!(nats_url = %url, "NATS is not reachable yet; load reports start when it is");
            }
            (Arc::new(discovery), Arc::new(nats))
        }
    };
    let (node_id, role, total) = (info.node_id.clone(), info.role, info.capacity_blocks);
    let registration = register(
        &*discovery,
        info,
        Duration::from_secs(args.cluster.startup_timeout_secs),
    )
    .await?;
    let (load_tx, load_rx) = watch::channel(LoadReport::idle(node_id, role, total));
    let forwarder = tokio::spawn(forward(snapshots, load_tx));
    let publisher = LoadPublisher::spawn(
        Arc::clone(&signals),
        load_rx,
        args.load_report_period(),
        cancel,
    );
    let lease_failures = Arc::new(AtomicU64::new(0));
    let lease_watch = tokio::spawn(count_lease_failures(
        registration.state(),
        Arc::clone(&lease_failures),
    ));
    Ok(Membership {
        registration,
        publisher,
        forwarder,
        signals,
        discovery,
        lease_failures,
        lease_watch,
    })
}

/// Counts every time the registration leaves `Live` for `Reconnecting` or `Reregistering`
/// (etcd unreachable, or the lease lost): `tandem_node_lease_renewal_failures_total`.
async fn count_lease_failures(
    mut state: watch::Receiver<RegistrationState>,
    failures: Arc<AtomicU64>,
) {
    let mut was_live = matches!(*state.borrow(), RegistrationState::Live { .. });
    while state.changed().await.is_ok() {
        let now = state.borrow_and_update().clone();
        match now {
            RegistrationState::Live { .. } => was_live = true,
            RegistrationState::Reconnecting | RegistrationState::Reregistering if was_live => {
                failures.fetch_add(1, Ordering::Relaxed);
                was_live = false;
            }
            _ => {}
        }
    }
}

/// Registers, retrying retryable failures (etcd unreachable, a dead predecessor's record not yet
/// expired) until `timeout`; a layout refusal ends it at once with a clear error log.
pub async fn register(
    discovery: &dyn Discovery,
    info: NodeInfo,
    timeout: Duration,
) -> Result<Registration, NodeError> {
    let deadline = Instant::now() + timeout;
    let mut delay = Duration::from_millis(100);
    let mut warned = false;
    loop {
        match discovery.register(info.clone()).await {
            Ok(r) => {
                tracing::info!(node_id = %info.node_id, role = %info.role, grpc = %info.grpc_addr, "registered in the cluster");
                return Ok(r);
            }
            Err(e @ ClusterError::LayoutMismatch { .. }) => {
                tracing::error!(
                    error = %e,
                    layout = %info.layout,
                    "the cluster refused this node's KV layout (model, KV dtype or block size differ from the registered nodes'); not serving"
                );
                return Err(NodeError::LayoutRefused(e));
            }
            Err(e) if e.is_retryable() && Instant::now() + delay < deadline => {
                if !warned {
                    tracing::warn!(error = %e, ?timeout, "registration failed; retrying until the startup timeout");
                    warned = true;
                }
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(2));
            }
            Err(source) => {
                return Err(NodeError::Cluster {
                    step: "register in etcd; check --etcd-endpoints",
                    source,
                });
            }
        }
    }
}

/// Copies engine snapshots into the load report (latest value; the publisher stamps and sends).
async fn forward(mut snapshots: watch::Receiver<EngineSnapshot>, load: watch::Sender<LoadReport>) {
    loop {
        let s = snapshots.borrow_and_update().clone();
        load.send_modify(|r| {
            r.queue_len = s.waiting as u32;
            r.running = s.running as u32;
            r.free_blocks = s.free_blocks as u64;
            r.total_blocks = s.total_blocks as u64;
            r.tokens_per_s = s.tokens_per_s;
            r.batch_size = s.batch_size as u32;
            r.pending_prompt_tokens = s.pending_prompt_tokens as u64;
            r.max_running = s.max_running as u32;
        });
        if snapshots.changed().await.is_err() {
            return;
        }
    }
}

impl Membership {
    /// The load-signal transport this node joined with (its KV events go there too).
    pub fn signals(&self) -> Arc<dyn LoadSignals> {
        Arc::clone(&self.signals)
    }

    /// Hands the registration state, lease failures and NATS status to `metrics`.
    pub fn export_to(&self, metrics: &crate::metrics::NodeMetrics) {
        metrics.watch_control_plane(
            self.registration.state(),
            self.signals.status(),
            Arc::clone(&self.lease_failures),
        );
    }

    /// Publishes the node's state in its record (warming → serving).
    pub async fn set_state(&self, state: NodeState) -> Result<(), NodeError> {
        self.registration
            .set_state(state)
            .await
            .map_err(|source| NodeError::Cluster {
                step: "publish the node's state in etcd",
                source,
            })
    }

    /// Resolves once someone asked this node to drain (`tandem drain`, a scale-down).
    pub async fn drain_requested(&self) {
        self.discovery
            .drain_requested(self.registration.role(), self.registration.node_id())
            .await
    }

    /// Sets the `draining` flag in the node's record (routers stop sending new work). A failure
    /// is logged: the flag is written once etcd answers again.
    pub async fn set_draining(&self) {
        if let Err(e) = self.registration.set_draining(true).await {
            tracing::warn!(error = %e, "could not mark this node draining in etcd yet; it will be written when etcd answers");
        }
    }

    /// Stops load reports and deletes the node's record (the last step of a graceful shutdown).
    pub async fn leave(self) {
        self.publisher.stop().await;
        self.forwarder.abort();
        self.lease_watch.abort();
        if let Err(e) = self.registration.deregister().await {
            tracing::warn!(error = %e, "deregistering failed; the record expires with its lease");
        } else {
            tracing::info!("deregistered from the cluster");
        }
    }
}
