//! tandem's prefill node: serves `tandem.v1.Prefill`: runs a prompt (chunked prefill on a
//! dedicated engine thread), streams the first token as soon as it is sampled, and pushes the
//! prompt's KV blocks layer by layer into a decode node's reservation over kv-transfer (UCX by
//! default where available), streaming `KvPushed` once the decode node acknowledged every block.
//!
//! | module | what |
//! |---|---|
//! | [`driver`] | the engine driver: prefill-only requests, layer-wise push, held-block release |
//! | [`service`] | the gRPC service: validation (layout fingerprint, block count), streams |
//! | this file | [`PrefillArgs`], [`PrefillNode`] (start / addresses / shutdown), [`run`] |
//!
//! Startup: validate flags → bind the gRPC listener → start the KV transport → load the model
//! on the engine thread (KV pool in transport memory) → serve gRPC (+ health, reflection) →
//! register in etcd with the bound address → publish load on NATS. Shutdown follows
//! [`tandem_node::lifecycle`]'s phases.

#![warn(missing_docs)]

pub mod driver;
pub mod service;

use std::ffi::OsString;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use tandem_cluster::{NodeInfo, NodeState, Role};
use tandem_engine::KvLayout;
use tandem_kv_transfer::{KvTransport, TransportKind};
use tandem_node::engine_thread::{self, EngineHandle, EngineSnapshot};
use tandem_node::env_names::*;
use tandem_node::lifecycle::{self, ShutdownPlan};
use tandem_node::{
    Coordination, Lifecycle, NodeArgs, NodeError, membership, model, server, transport,
};
use tandem_node::{Failure, NodeMetrics};
use tandem_proto::v1::prefill_server::PrefillServer;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::driver::{Command, PrefillDriver, PushSettings, Senders};
use crate::service::PrefillService;

/// Engine commands queued before callers wait.
const COMMAND_QUEUE: usize = 256;

/// Flags of `tandem-prefill-node` / `tandem prefill`.
#[derive(Parser, Clone, Debug)]
#[command(
    name = "tandem-prefill-node",
    version,
    about = "tandem prefill node: chunked prefill, first token, layer-wise KV push"
)]
pub struct PrefillArgs {
    /// Cluster, listeners, transport, engine.
    #[command(flatten)]
    pub node: NodeArgs,

    /// Bound on one KV push (connect, every layer, the decode node's verification), in ms.
    #[arg(long, env = TANDEM_PUSH_DEADLINE_MS, default_value_t = 30_000)]
    pub push_deadline_ms: u64,

    /// Inject a fault into every KV push: `corrupt:OFFSET`, `drop:CHUNK`, `cut:BYTES`,
    /// `delay-ms:N` (fault-injection builds only; for tests and drills).
    #[cfg(feature = "fault-injection")]
    #[arg(long, env = TANDEM_KV_FAULT)]
    pub kv_fault: Option<tandem_kv_transfer::Fault>,

    /// With `--kv-fault`: start with the fault off; each SIGUSR1 turns it on or off (how
    /// `tandem drill` injects transfer faults into one node of a running cluster).
    #[cfg(feature = "fault-injection")]
    #[arg(long, env = TANDEM_KV_FAULT_ON_SIGUSR1, requires = "kv_fault")]
    pub kv_fault_on_sigusr1: bool,

    /// Log filter for stderr (RUST_LOG syntax).
    #[arg(long, env = "RUST_LOG", default_value = "info")]
    pub log: String,
}

impl PrefillArgs {
    /// Parses `argv` (program name first) with `--config` file layering; `.exit()` the error in
    /// a binary (it also carries `--help`).
    pub fn parse_layered(argv: Vec<OsString>) -> Result<Self, clap::Error> {
        tandem_node::config_file::parse_layered(argv)
    }
}

/// A running prefill node.
pub struct PrefillNode {
    node_id: String,
    grpc_addr: SocketAddr,
    layout: KvLayout,
    engine: EngineHandle<Command>,
    plan: ShutdownPlan<Command>,
    #[cfg(feature = "fault-injection")]
    fault: Arc<std::sync::Mutex<Option<tandem_kv_transfer::Fault>>>,
}

impl PrefillNode {
    /// Starts a node: binds, loads the model, serves, registers. `Coordination::FromArgs`
    /// requires `--etcd-endpoints` and `--nats-url`.
    pub async fn start(args: PrefillArgs, coordination: Coordination) -> Result<Self, NodeError> {
        args.node.validate()?;
        if matches!(coordination, Coordination::FromArgs) {
            args.node.validate_control_plane()?;
        }
        let tls = tandem_node::tls::server_tls(&args.node.listen)?;
        let listener = lifecycle::bind("gRPC", args.node.listen.grpc_addr).await?;
        let grpc_addr = listener.local_addr().map_err(|source| NodeError::Bind {
            what: "gRPC",
            addr: args.node.listen.grpc_addr,
            source,
        })?;
        let (primary, kind) = transport::start(args.node.listen.kv_transport, args.node.listen.kv_cuda_ipc)?;
        // A UCX node also pushes to TCP decode nodes, over the same pool.
        let tcp = match kind {
            TransportKind::Ucx => Some(transport::start(tandem_node::TransportChoice::Tcp, false)?.0),
            TransportKind::Tcp => None,
        };
        #[cfg(feature = "fault-injection")]
        let fault = fault_switch(args.kv_fault, args.kv_fault_on_sigusr1)?;
        let settings = PushSettings {
            deadline: Duration::from_millis(args.push_deadline_ms),
            #[cfg(feature = "fault-injection")]
            fault: Arc::clone(&fault),
        };
        let node_id = args
            .node
            .cluster
            .node_id
            .clone()
            .unwrap_or_else(|| lifecycle::default_node_id("prefill"));
        let metrics = NodeMetrics::new("prefill", &node_id);
        metrics.watch_transfers(kind.as_str(), Arc::clone(primary.metrics()));
        if let Some(t) = &tcp {
            metrics.watch_transfers("tcp", Arc::clone(t.metrics()));
        }
        let engine_args = args.node.engine.clone();
        let cuda_ipc = args.node.listen.kv_cuda_ipc;
        let driver_metrics = metrics.clone();
        // The prefix cache's contents go to routers as KV events (cache-aware routing).
        let (cache_sink, cache_source) = tandem_node::kv_events::channel();
        let (engine, (layout, num_blocks, kinds)) = engine_thread::spawn_with(
            "prefill-engine",
            COMMAND_QUEUE,
            engine_thread::SpawnOptions {
                step_seconds: Some(metrics.step_histogram()),
                panic_after_steps: args.node.fault_engine_panic_after_steps,
                cache_events: Some(cache_sink),
            },
            move |ctx| {
                let (engine, registration) = model::build_engine(&engine_args, &*primary, tandem_engine::Staging::Push)?;
                if cuda_ipc {
                    model::attach_cuda_ipc(&engine, &primary)?;
                }
                let tcp = match tcp {
                    Some(t) => {
                        let reg =
                            t.register(Arc::clone(registration.pool()))
                                .map_err(|source| NodeError::Transport {
                                    transport: "tcp",
                                    source,
                                })?;
                        Some((t, reg))
                    }
                    None => None,
                };
                let senders = Senders {
                    primary: (kind, primary, registration),
                    tcp,
                };
                let kinds = senders.kinds();
                let layout = *engine.kv_layout();
                let blocks = engine.scheduler().blocks().num_blocks();
                let driver = PrefillDriver::new(
                    ctx.runtime,
                    ctx.engine,
                    senders,
                    settings,
                    layout.block_size_tokens,
                    driver_metrics,
                );
                Ok((engine, driver, (layout, blocks, kinds)))
            },
        )
        .await?;
        metrics.watch_engine(engine.snapshot());
        let lifecycle = Lifecycle::new();
        let service = PrefillService::new(
            engine.clone(),
            lifecycle.clone(),
            layout.fingerprint(),
            layout.block_size_tokens,
            kinds,
            metrics.clone(),
            node_id.clone(),
        );
        let routes = tonic::service::Routes::new(PrefillServer::new(service));
        let server = match server::spawn(listener, routes, "tandem.v1.Prefill", tls).await {
            Ok(s) => s,
            Err(e) => {
                engine.shutdown().await;
                return Err(e);
            }
        };
        let background = CancellationToken::new();
        let (metrics_server, metrics_url) =
            match tandem_node::metrics::serve(&args.node.listen, &metrics).await {
                Ok(m) => m,
                Err(e) => {
                    engine.shutdown().await;
                    return Err(e);
                }
            };
        let grpc_url = format!(
            "{}://{}",
            tandem_node::tls::scheme(&args.node.listen),
            args.node.listen.advertised(grpc_addr)
        );
        let info = NodeInfo::new(
            &node_id,
            Role::Prefill,
            &grpc_url,
            layout,
            num_blocks as u64,
        )
        .with_metrics_url(&metrics_url)
        .with_state(NodeState::Warming);
        let mut plan = ShutdownPlan {
            lifecycle,
            server,
            membership: None,
            engine: engine.clone(),
            background,
            drain_timeout: args.node.listen.drain_timeout(),
            metrics_server: Some(metrics_server),
        };
        match membership::join(
            &args.node,
            coordination,
            info,
            engine.snapshot(),
            &plan.background,
        )
        .await
        {
            Ok(m) => {
                m.export_to(&metrics);
                tokio::spawn(tandem_node::kv_events::publish(
                    cache_source,
                    m.signals(),
                    node_id.clone(),
                    layout.block_size_tokens as u32,
                    plan.background.clone(),
                ));
                if let Err(e) = lifecycle::warm_up(&m, kind, layout).await {
                    plan.membership = Some(m);
                    return Err(plan.abort("warm-up", e.to_string()).await);
                }
                plan.membership = Some(m);
            }
            Err(e) => {
                plan.run().await;
                return Err(e);
            }
        }
        tracing::info!(node_id = %node_id, grpc = %grpc_url, kv_blocks = num_blocks, "prefill node serving");
        Ok(PrefillNode {
            node_id,
            grpc_addr,
            layout,
            engine,
            plan,
            #[cfg(feature = "fault-injection")]
            fault,
        })
    }

    /// This node's id in the cluster.
    pub fn node_id(&self) -> &str {
        &self.node_id
    }

    /// The bound gRPC address.
    pub fn grpc_addr(&self) -> SocketAddr {
        self.grpc_addr
    }

    /// The KV layout (its fingerprint is what targets must carry).
    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    /// The engine's latest snapshot (free/total blocks, queue, tokens/s).
    pub fn snapshot(&self) -> watch::Receiver<EngineSnapshot> {
        self.engine.snapshot()
    }

    /// Sets (or clears) a fault applied to every push from now on (tests and drills).
    #[cfg(feature = "fault-injection")]
    pub fn set_fault(&self, fault: Option<tandem_kv_transfer::Fault>) {
        *self.fault.lock().unwrap_or_else(|p| p.into_inner()) = fault;
    }

    /// Phased shutdown: draining, drain, stop, deregister.
    pub async fn shutdown(self) {
        self.plan.run().await;
    }

    /// Serves until `shutdown`, a drain request or a failure (see
    /// [`lifecycle::serve_until`]).
    pub async fn serve_until(self, shutdown: impl Future<Output = ()>) -> Result<(), NodeError> {
        lifecycle::serve_until(self.plan, Failure::default(), shutdown).await
    }
}

/// Whether this build can inject KV-transfer faults (`--kv-fault`): the `fault-injection`
/// feature, which no default build has.
pub const FAULT_INJECTION: bool = cfg!(feature = "fault-injection");

/// The fault every push reads; with `on_signal`, off until a SIGUSR1 and toggled by each one.
#[cfg(feature = "fault-injection")]
fn fault_switch(
    fault: Option<tandem_kv_transfer::Fault>,
    on_signal: bool,
) -> Result<Arc<std::sync::Mutex<Option<tandem_kv_transfer::Fault>>>, NodeError> {
    let current = Arc::new(std::sync::Mutex::new(if on_signal { None } else { fault }));
    if on_signal {
        let mut usr1 =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::user_defined1()).map_err(
                |e| NodeError::InvalidConfig {
                    flag: "--kv-fault-on-sigusr1",
                    value: "true".into(),
                    reason: format!("cannot listen for SIGUSR1: {e}"),
                },
            )?;
        let switch = Arc::clone(&current);
        tokio::spawn(async move {
            while usr1.recv().await.is_some() {
                let mut f = switch.lock().unwrap_or_else(|p| p.into_inner());
                *f = if f.is_some() { None } else { fault };
                tracing::warn!(fault = ?*f, "SIGUSR1: KV push fault switched");
            }
        });
    }
    Ok(current)
}

/// Runs a prefill node with etcd and NATS from the flags until `shutdown` resolves, then shuts
/// it down in phases. Prints `tandem-prefill-node listening grpc=ADDR node_id=ID` on stdout once
/// it serves.
pub async fn run(args: PrefillArgs, shutdown: impl Future<Output = ()>) -> Result<(), NodeError> {
    let node = PrefillNode::start(args, Coordination::FromArgs).await?;
    println!(
        "tandem-prefill-node listening grpc={} node_id={}",
        node.grpc_addr(),
        node.node_id()
    );
    node.serve_until(shutdown).await
}

/// The binary's body (also `tandem prefill`): parse `argv` with file layering, log to stderr,
/// run on a multi-threaded runtime until SIGTERM or Ctrl-C. Errors are startup failures.
pub fn main_with_args(argv: Vec<OsString>) -> anyhow::Result<()> {
    let args = PrefillArgs::parse_layered(argv).unwrap_or_else(|e| e.exit());
    let (log, trace) = (args.log.clone(), args.node.trace.clone());
    lifecycle::run_binary("tandem-prefill", "prefill-rt", &log, &trace, || {
        run(args, lifecycle::shutdown_signal())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_have_documented_defaults_and_read_the_node_flags() {
        let a =
            PrefillArgs::try_parse_from(["p", "--cluster", "c1", "--kv-transport", "tcp"]).unwrap();
        assert_eq!(a.push_deadline_ms, 30_000);
        assert_eq!(a.node.cluster.cluster, "c1");
        assert_eq!(
            a.node.listen.kv_transport,
            tandem_node::TransportChoice::Tcp
        );
        assert_eq!(a.log, "info");
        assert!(PrefillArgs::try_parse_from(["p", "--push-deadline-ms", "soon"]).is_err());
    }

    #[cfg(feature = "fault-injection")]
    #[test]
    fn fault_injection_builds_take_a_kv_fault_flag() {
        let a = PrefillArgs::try_parse_from(["p", "--kv-fault", "corrupt:7"]).unwrap();
        assert_eq!(
            a.kv_fault,
            Some(tandem_kv_transfer::Fault::CorruptByte { offset: 7 })
        );
        assert!(!a.kv_fault_on_sigusr1);
        // The switch needs a fault to switch.
        assert!(PrefillArgs::try_parse_from(["p", "--kv-fault-on-sigusr1"]).is_err());
    }

    #[cfg(feature = "fault-injection")]
    #[tokio::test]
    async fn sigusr1_switches_the_fault_on_and_off() {
        let fault = tandem_kv_transfer::Fault::CutAfterBytes { bytes: 9 };
        let switch = fault_switch(Some(fault), true).unwrap();
        let now = || *switch.lock().unwrap();
        assert_eq!(now(), None, "starts off");
        let wait_for = async |want| {
            for _ in 0..100 {
                if now() == want {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            panic!("the fault did not become {want:?}");
        };
        // The handler is installed above, so SIGUSR1 no longer ends this process.
        let usr1 = || {
            let me = std::process::id().to_string();
            assert!(
                std::process::Command::new("kill")
                    .args(["-USR1", &me])
                    .status()
                    .unwrap()
                    .success()
            );
        };
        usr1();
        wait_for(Some(fault)).await;
        usr1();
        wait_for(None).await;
        // Without the switch the fault is on from the start.
        assert_eq!(
            *fault_switch(Some(fault), false).unwrap().lock().unwrap(),
            Some(fault)
        );
    }

    #[tokio::test]
    async fn a_node_without_etcd_or_nats_flags_refuses_to_start_naming_the_flag() {
        let a = PrefillArgs::try_parse_from(["p", "--nats-url", "nats://127.0.0.1:1"]).unwrap();
        match PrefillNode::start(a, Coordination::FromArgs).await {
            Err(NodeError::InvalidConfig {
                flag: "--etcd-endpoints",
                ..
            }) => {}
            Err(e) => panic!("wrong error: {e}"),
            Ok(_) => panic!("started without etcd"),
        }
    }
}
