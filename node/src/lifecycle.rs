//! A node's life: admission (refused once draining), in-flight tracking (what a drain waits
//! for), OS signals, logging, ids.
//!
//! Phased shutdown (both roles, docs/ARCHITECTURE.md, "A node's life"; Dynamo's phases):
//! ```text
//!  SIGTERM / Ctrl-C
//!   1. draining: etcd record `draining: true`, health NOT_SERVING, new work refused (UNAVAILABLE)
//!   2. drain:    in-flight requests finish (every InFlightGuard dropped), bounded by --drain-timeout-secs
//!   3. stop:     the engine thread ends what is left (clients see UNAVAILABLE), servers stop
//!   4. leave:    load reports stop, the etcd record is deleted and its lease revoked,
//!                `/metrics` stops; exit 0
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::engine_thread::EngineHandle;
use crate::error::NodeError;
use crate::membership::Membership;
use crate::server::GrpcServer;
use crate::status;

/// How long open gRPC calls may take to end once the server stops (after the drain).
const GRPC_STOP_GRACE: Duration = Duration::from_secs(5);

#[derive(Default)]
struct Inner {
    draining: AtomicBool,
    in_flight: AtomicUsize,
    idle: Notify,
}

/// Admission and in-flight accounting of one node. Cheap to clone.
#[derive(Clone, Default)]
pub struct Lifecycle {
    inner: Arc<Inner>,
}

/// One unit of in-flight work (a stream, a reservation); the drain waits for all to drop.
pub struct InFlightGuard {
    inner: Arc<Inner>,
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        if self.inner.in_flight.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.inner.idle.notify_waiters();
        }
    }
}

impl Lifecycle {
    /// A node that admits work.
    pub fn new() -> Self {
        Self::default()
    }

    /// Admits new work, or refuses it with UNAVAILABLE while draining.
    pub fn admit(&self) -> Result<InFlightGuard, tonic::Status> {
        if self.is_draining() {
            return Err(status::unavailable(
                "node is draining; retry on another node",
            ));
        }
        Ok(self.track())
    }

    /// Tracks work that continues something already admitted (allowed while draining, e.g. a
    /// Decode call for a reservation made earlier).
    pub fn track(&self) -> InFlightGuard {
        self.inner.in_flight.fetch_add(1, Ordering::AcqRel);
        InFlightGuard {
            inner: Arc::clone(&self.inner),
        }
    }

    /// True once [`start_draining`](Self::start_draining) was called.
    pub fn is_draining(&self) -> bool {
        self.inner.draining.load(Ordering::Acquire)
    }

    /// Stops admitting new work.
    pub fn start_draining(&self) {
        self.inner.draining.store(true, Ordering::Release);
    }

    /// Units of in-flight work now.
    pub fn in_flight(&self) -> usize {
        self.inner.in_flight.load(Ordering::Acquire)
    }

    /// Waits until nothing is in flight, for at most `timeout`; true if it got there.
    pub async fn drained(&self, timeout: Duration) -> bool {
        let wait = async {
            loop {
                // Registered before the check, so a drop to zero in between is not missed.
                let idle = self.inner.idle.notified();
                if self.in_flight() == 0 {
                    return;
                }
                idle.await;
            }
        };
        tokio::time::timeout(timeout, wait).await.is_ok()
    }
}

/// A part of the node that died on its own (a background task the node cannot serve
/// without): the first reason given wins. Cheap to clone.
#[derive(Clone, Default)]
pub struct Failure {
    token: CancellationToken,
    reason: Arc<std::sync::OnceLock<(&'static str, String)>>,
}

impl Failure {
    /// Records that `what` failed (the first failure is kept) and wakes [`wait`](Self::wait).
    pub fn fail(&self, what: &'static str, reason: String) {
        let _ = self.reason.set((what, reason));
        self.token.cancel();
    }

    /// Resolves with what failed and why, once something did.
    pub async fn wait(&self) -> (&'static str, String) {
        self.token.cancelled().await;
        self.reason.get().cloned().unwrap_or(("a node task", String::new()))
    }
}

/// Warming → serving (the node is registered `warming`, so no router sends it work yet): the
/// engine already ran a forward pass when it was built ([`crate::model::build_engine`]); this
/// moves KV through a loopback transfer on the node's own transport kind and layout
/// ([`tandem_kv_transfer::selfcheck`]) and then publishes `serving`.
pub async fn warm_up(
    membership: &Membership,
    kind: tandem_kv_transfer::TransportKind,
    layout: tandem_engine::KvLayout,
) -> Result<(), NodeError> {
    let report = tandem_kv_transfer::selfcheck::self_check(kind, layout)
        .await
        .map_err(|source| NodeError::Transport {
            transport: kind.as_str(),
            source,
        })?;
    tracing::info!(
        transport = report.transport,
        bytes = report.bytes,
        took_us = report.elapsed.as_micros() as u64,
        "warm: KV self-check passed; serving"
    );
    membership.set_state(tandem_cluster::NodeState::Serving).await
}

/// What ended a node's serving.
enum Ending {
    Stop,
    Drain,
    Died(&'static str, String),
}

/// Serves until `shutdown` (SIGTERM, Ctrl-C), a drain request (`tandem drain`, a scale-down:
/// the same phased shutdown, then exit 0), or a failure the node cannot serve through (its
/// engine thread died, `failure` fired: leave at once and return the error to exit with).
pub async fn serve_until<C: Send + 'static>(
    plan: ShutdownPlan<C>,
    failure: Failure,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), NodeError> {
    let ending = {
        let drain = async {
            match &plan.membership {
                Some(m) => m.drain_requested().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = shutdown => Ending::Stop,
            () = drain => Ending::Drain,
            () = plan.engine.died() => Ending::Died("the engine thread", "it panicked (see the log above)".into()),
            (what, reason) = failure.wait() => Ending::Died(what, reason),
        }
    };
    match ending {
        Ending::Stop => {
            plan.run().await;
            Ok(())
        }
        Ending::Drain => {
            tracing::info!("drain requested: finishing in-flight work, then leaving");
            plan.run().await;
            Ok(())
        }
        Ending::Died(what, reason) => Err(plan.abort(what, reason).await),
    }
}

/// What a node stops at shutdown, in the order of the phases in the module docs.
pub struct ShutdownPlan<C> {
    /// Admission and in-flight accounting.
    pub lifecycle: Lifecycle,
    /// The gRPC server.
    pub server: GrpcServer,
    /// The node's registration and load publisher (absent when startup failed before joining).
    pub membership: Option<Membership>,
    /// The engine thread.
    pub engine: EngineHandle<C>,
    /// Cancels the node's other background tasks (KV receiver, timers).
    pub background: CancellationToken,
    /// Phase 2's bound.
    pub drain_timeout: Duration,
    /// `/metrics`, stopped last so scrapes see the drain to its end.
    pub metrics_server: Option<tandem_telemetry::metrics::MetricsServer>,
}

impl<C: Send + 'static> ShutdownPlan<C> {
    /// The node cannot serve (`what` died): no drain (nothing can finish), stop at once, and
    /// leave the cluster (record deleted, lease revoked) so routers stop sending it work now
    /// rather than when the lease would expire. Returns the error the process exits with.
    pub async fn abort(self, what: &'static str, reason: String) -> NodeError {
        tracing::error!(what, %reason, "the node cannot serve; leaving the cluster and exiting");
        self.lifecycle.start_draining();
        self.server.set_not_serving().await;
        self.engine.shutdown().await;
        if let Err(e) = self.server.stop(Duration::from_secs(1)).await {
            tracing::warn!(error = %e, "gRPC server ended with an error");
        }
        self.background.cancel();
        if let Some(m) = self.membership {
            m.leave().await;
        }
        if let Some(m) = self.metrics_server {
            m.stop().await;
        }
        NodeError::Fatal { what, reason }
    }

    /// Runs the phases: draining, drain (bounded), stop, leave.
    pub async fn run(self) {
        self.lifecycle.start_draining();
        self.server.set_not_serving().await;
        if let Some(m) = &self.membership {
            m.set_draining().await;
        }
        tracing::info!(in_flight = self.lifecycle.in_flight(), timeout = ?self.drain_timeout, "draining: no new work, finishing in-flight requests");
        if !self.lifecycle.drained(self.drain_timeout).await {
            tracing::warn!(
                in_flight = self.lifecycle.in_flight(),
                "drain timeout reached; ending the remaining requests"
            );
        }
        self.engine.shutdown().await;
        if let Err(e) = self.server.stop(GRPC_STOP_GRACE).await {
            tracing::warn!(error = %e, "gRPC server ended with an error");
        }
        self.background.cancel();
        if let Some(m) = self.membership {
            m.leave().await;
        }
        if let Some(m) = self.metrics_server {
            m.stop().await;
        }
        tracing::info!("stopped");
    }
}

/// Binds `addr` for `what` (a listener is bound before anything is registered, so port 0
/// works and the registered address is the real one).
pub async fn bind(
    what: &'static str,
    addr: std::net::SocketAddr,
) -> Result<TcpListener, NodeError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| NodeError::Bind { what, addr, source })
}

/// Resolves on SIGTERM or Ctrl-C (SIGINT), saying which.
pub async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => tokio::select! {
                _ = term.recv() => tracing::info!("SIGTERM received: shutting down"),
                _ = tokio::signal::ctrl_c() => tracing::info!("Ctrl-C received: shutting down"),
            },
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGTERM; only Ctrl-C stops this node");
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
        tracing::info!("Ctrl-C received: shutting down");
    }
}

/// Logs to stderr with `filter` (`RUST_LOG` syntax); a bad filter falls back to `info`. Safe to
/// call twice (the second call changes nothing).
pub fn init_logging(filter: &str) {
    let filter = tracing_subscriber::EnvFilter::try_new(filter).unwrap_or_else(|_| "info".into());
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(filter)
        .try_init();
}

/// 64 bits that differ between processes and starts (node id suffixes, reservation epochs).
pub fn boot_nonce() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let local = 0u8;
    let seed = format!("{nanos}-{}-{:p}", std::process::id(), &local);
    xxhash_rust::xxh3::xxh3_64(seed.as_bytes())
}

/// The default node id: the role and 8 random hex digits (`decode-3fa2c1d9`).
pub fn default_node_id(role: &str) -> String {
    format!("{role}-{:08x}", boot_nonce() as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn draining_refuses_new_work_and_waits_for_in_flight_guards() {
        let life = Lifecycle::new();
        let a = life.admit().unwrap();
        life.start_draining();
        let refused = life.admit().err().expect("draining refuses new work");
        assert_eq!(refused.code(), tonic::Code::Unavailable);
        let b = life.track();
        assert_eq!(life.in_flight(), 2);
        assert!(
            !life.drained(Duration::from_millis(20)).await,
            "two units still in flight"
        );
        drop(a);
        let waiter = {
            let life = life.clone();
            tokio::spawn(async move { life.drained(Duration::from_secs(5)).await })
        };
        tokio::task::yield_now().await;
        drop(b);
        assert!(
            waiter.await.unwrap(),
            "the drain ends when the last guard drops"
        );
    }

    #[test]
    fn default_node_ids_carry_the_role_and_differ() {
        let a = default_node_id("decode");
        assert!(
            a.starts_with("decode-") && a.len() == "decode-".len() + 8,
            "{a}"
        );
        std::thread::sleep(Duration::from_millis(1));
        assert_ne!(a, default_node_id("decode"));
    }
}

/// The body every node binary shares (`tandem prefill`, `tandem decode` and their own
/// binaries): logs on stderr and spans over OTLP when an endpoint is set (flushed once the
/// runtime has shut down), a multi-threaded runtime whose threads are named `thread_name`, and
/// `run` on it until it returns (its node serves until [`shutdown_signal`]). Errors are startup
/// failures, reported flat: [`NodeError`]'s messages already carry their sources.
pub fn run_binary<Fut>(
    service: &str,
    thread_name: &str,
    log: &str,
    trace: &tandem_telemetry::TraceArgs,
    run: impl FnOnce() -> Fut,
) -> anyhow::Result<()>
where
    Fut: std::future::Future<Output = Result<(), NodeError>>,
{
    let _telemetry =
        tandem_telemetry::init(service, log, trace).map_err(|e| anyhow::anyhow!("{e}"))?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name(thread_name)
        .build()?;
    rt.block_on(run()).map_err(|e| anyhow::anyhow!("{e}"))
}
