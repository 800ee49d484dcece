//! tandem's decode node: serves `tandem.v1.Decode`: reserves KV blocks with an expiry
//! (`Reserve`/`Release`), receives and verifies the KV a prefill node pushes (fail closed: a
//! corrupt or partial transfer is never decoded), then runs the request in its continuous batch
//! and streams tokens (`Decode`).
//!
//! | module | what |
//! |---|---|
//! | [`driver`] | the engine driver: reserve/release, adopt KV with the first token, batched streams |
//! | [`reservations`] | unclaimed reservations, their inbound transfers, expiry, fenced release |
//! | [`service`] | the gRPC service |
//! | [`step_budget`] | the prompt tokens per step, sized from measured steps (`--max-step-ms`) |
//! | this file | [`DecodeArgs`], [`DecodeNode`] (start / addresses / shutdown), [`run`] |
//!
//! Startup: validate flags → bind the gRPC and KV listeners → start the KV transport → load the
//! model on the engine thread (KV pool in transport memory) → serve KV (InboundRegistry) and
//! gRPC (+ health, reflection) → register in etcd with the bound addresses → publish load on
//! NATS. Shutdown follows [`tandem_node::lifecycle`]'s phases.

#![warn(missing_docs)]

pub mod driver;
pub mod reservations;
pub mod service;
pub mod step_budget;

use std::ffi::OsString;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use tandem_cluster::{NodeInfo, NodeState, Role};
use tandem_engine::KvLayout;
use tandem_kv_transfer::{InboundRegistry, TransferConfig};
use tandem_node::engine_thread::{self, EngineHandle, EngineSnapshot};
use tandem_node::env_names::*;
use tandem_node::lifecycle::{self, ShutdownPlan};
use tandem_node::{
    Coordination, KvAddress, Lifecycle, NodeArgs, NodeError, membership, model, server, transport,
};
use tandem_node::{Failure, NodeMetrics};
use tandem_proto::v1::decode_server::DecodeServer;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::driver::{Command, DecodeDriver};
use crate::reservations::Reservations;
use crate::service::DecodeService;
use crate::step_budget::StepBudget;

/// Engine commands queued before callers wait.
const COMMAND_QUEUE: usize = 256;

/// Flags of `tandem-decode-node` / `tandem decode`.
#[derive(Parser, Clone, Debug)]
#[command(
    name = "tandem-decode-node",
    version,
    about = "tandem decode node: KV reservations, verified receive, continuous batching"
)]
pub struct DecodeArgs {
    /// Cluster, listeners, transport, engine.
    #[command(flatten)]
    pub node: NodeArgs,

    /// How long a reservation waits for its Decode call and its KV before its blocks are
    /// freed, in ms.
    #[arg(long, env = TANDEM_RESERVATION_TTL_MS, default_value_t = 30_000)]
    pub reservation_ttl_ms: u64,

    /// A KV push that has begun but lands nothing for this long (a lost chunk, a sender hung
    /// mid-push) is ended and its request prefilled again, instead of holding its blocks until
    /// the reservation's TTL; in ms, 0 = off. Pushes stream layer by layer as the prefill node
    /// computes them: raise it where one layer of a prompt can take longer (large models on
    /// CPU).
    #[arg(long, env = TANDEM_KV_STALL_TIMEOUT_MS, default_value_t = 5_000)]
    pub kv_stall_timeout_ms: u64,

    /// Target length of one engine step, in ms, for the prompts this node computes itself
    /// (conditional disaggregation): their chunks are sized from measured steps so a step
    /// stays near this, and every stream decoding here gets a token at least that often
    /// (the node also answers `Reserve` between steps). Decode tokens are never capped. 0 = off:
    /// a step may take the engine's whole `--max-tokens-per-step` of prompt.
    #[arg(long, env = TANDEM_MAX_STEP_MS, default_value_t = 100)]
    pub max_step_ms: u64,

    /// Log filter for stderr (RUST_LOG syntax).
    #[arg(long, env = "RUST_LOG", default_value = "info")]
    pub log: String,
}

impl DecodeArgs {
    /// Parses `argv` (program name first) with `--config` file layering; `.exit()` the error in
    /// a binary (it also carries `--help`).
    pub fn parse_layered(argv: Vec<OsString>) -> Result<Self, clap::Error> {
        tandem_node::config_file::parse_layered(argv)
    }
}

/// A running decode node.
pub struct DecodeNode {
    node_id: String,
    grpc_addr: SocketAddr,
    kv_address: KvAddress,
    layout: KvLayout,
    engine: EngineHandle<Command>,
    reservations: Reservations,
    registry: InboundRegistry,
    plan: ShutdownPlan<Command>,
    failure: Failure,
}

impl DecodeNode {
    /// Starts a node: binds, loads the model, serves KV and gRPC, registers.
    /// `Coordination::FromArgs` requires `--etcd-endpoints` and `--nats-url`.
    pub async fn start(args: DecodeArgs, coordination: Coordination) -> Result<Self, NodeError> {
        args.node.validate()?;
        if matches!(coordination, Coordination::FromArgs) {
            args.node.validate_control_plane()?;
        }
        if args.reservation_ttl_ms == 0 {
            return Err(NodeError::InvalidConfig {
                flag: "--reservation-ttl-ms",
                value: "0".into(),
                reason: "must be at least 1".into(),
            });
        }
        let listen = &args.node.listen;
        let tls = tandem_node::tls::server_tls(listen)?;
        let grpc_listener = lifecycle::bind("gRPC", listen.grpc_addr).await?;
        let kv_listener = lifecycle::bind("KV transfer", listen.kv_addr).await?;
        let local = |l: &tokio::net::TcpListener, what, addr| {
            l.local_addr()
                .map_err(|source| NodeError::Bind { what, addr, source })
        };
        let grpc_addr = local(&grpc_listener, "gRPC", listen.grpc_addr)?;
        let kv_bound = local(&kv_listener, "KV transfer", listen.kv_addr)?;
        let (net, kind) = transport::start(listen.kv_transport, listen.kv_cuda_ipc)?;
        let kv_address = KvAddress {
            kind,
            host_port: listen.advertised(kv_bound),
        };

        let node_id = args
            .node
            .cluster
            .node_id
            .clone()
            .unwrap_or_else(|| lifecycle::default_node_id("decode"));
        let metrics = NodeMetrics::new("decode", &node_id);
        metrics.watch_transfers(kind.as_str(), Arc::clone(net.metrics()));
        let engine_args = args.node.engine.clone();
        let cuda_ipc = listen.kv_cuda_ipc;
        let alloc = Arc::clone(&net);
        let budget = (args.max_step_ms > 0).then(|| {
            StepBudget::new(
                Duration::from_millis(args.max_step_ms),
                args.node.engine.max_tokens_per_step,
            )
        });
        let driver = DecodeDriver::new(metrics.clone(), budget);
        let (engine, (layout, num_blocks, registration)) = engine_thread::spawn_with(
            "decode-engine",
            COMMAND_QUEUE,
            engine_thread::SpawnOptions {
                step_seconds: Some(metrics.step_histogram()),
                panic_after_steps: args.node.fault_engine_panic_after_steps,
                cache_events: None,
            },
            move |_ctx| {
                let (engine, registration) =
                    model::build_engine(&engine_args, &*alloc, tandem_engine::Staging::Receive)?;
                if cuda_ipc {
                    model::attach_cuda_ipc(&engine, &alloc)?;
                }
                let layout = *engine.kv_layout();
                let blocks = engine.scheduler().blocks().num_blocks();
                Ok((engine, driver, (layout, blocks, registration)))
            },
        )
        .await?;
        metrics.watch_engine(engine.snapshot());
        let stall =
            (args.kv_stall_timeout_ms > 0).then(|| Duration::from_millis(args.kv_stall_timeout_ms));
        let registry = InboundRegistry::with_stall_timeout(
            registration,
            TransferConfig::default().fence_timeout,
            stall,
        );
        let background = CancellationToken::new();
        let failure = Failure::default();
        let kv_failed = failure.clone();
        {
            let (net, registry, stop) =
                (Arc::clone(&net), registry.clone(), background.child_token());
            let (failed, stop_check) = (kv_failed.clone(), stop.clone());
            tokio::spawn(async move {
                let result = net.serve(kv_listener, registry, stop).await;
                // Only an end the node did not ask for is a failure.
                if !stop_check.is_cancelled() {
                    let reason = match result {
                        Err(e) => e.to_string(),
                        Ok(()) => "it returned without being stopped".into(),
                    };
                    tracing::error!(%reason, "KV receiver stopped");
                    failed.fail("the KV receiver", reason);
                }
            });
        }
        let lifecycle = Lifecycle::new();
        let ttl = Duration::from_millis(args.reservation_ttl_ms);
        let reservations = Reservations::new(
            registry.clone(),
            engine.clone(),
            ttl,
            layout.block_size_tokens,
            lifecycle::boot_nonce() | 1,
        );
        let service = DecodeService::new(
            engine.clone(),
            reservations.clone(),
            lifecycle.clone(),
            node_id.clone(),
            kv_address.clone(),
            layout.fingerprint(),
            metrics.clone(),
        );
        let routes = tonic::service::Routes::new(DecodeServer::new(service));
        let server = match server::spawn(grpc_listener, routes, "tandem.v1.Decode", tls).await {
            Ok(s) => s,
            Err(e) => {
                background.cancel();
                engine.shutdown().await;
                return Err(e);
            }
        };
        let (metrics_server, metrics_url) =
            match tandem_node::metrics::serve(listen, &metrics).await {
                Ok(m) => m,
                Err(e) => {
                    background.cancel();
                    engine.shutdown().await;
                    return Err(e);
                }
            };
        let grpc_url = format!(
            "{}://{}",
            tandem_node::tls::scheme(listen),
            listen.advertised(grpc_addr)
        );
        let info = NodeInfo::new(&node_id, Role::Decode, &grpc_url, layout, num_blocks as u64)
            .with_kv_transfer_addr(kv_address.to_string())
            .with_metrics_url(&metrics_url)
            .with_state(NodeState::Warming);
        let mut plan = ShutdownPlan {
            lifecycle,
            server,
            membership: None,
            engine: engine.clone(),
            background,
            drain_timeout: listen.drain_timeout(),
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
        // The transport lives as long as its serve task and the pool's registration.
        drop(net);
        tracing::info!(node_id = %node_id, grpc = %grpc_url, kv = %kv_address, kv_blocks = num_blocks, "decode node serving");
        Ok(DecodeNode {
            node_id,
            grpc_addr,
            kv_address,
            layout,
            engine,
            reservations,
            registry,
            plan,
            failure,
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

    /// Where it receives KV.
    pub fn kv_address(&self) -> &KvAddress {
        &self.kv_address
    }

    /// The KV layout.
    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    /// The engine's latest snapshot (free/total blocks, reserved blocks, queue, tokens/s).
    pub fn snapshot(&self) -> watch::Receiver<EngineSnapshot> {
        self.engine.snapshot()
    }

    /// Reservations not yet claimed by a Decode call.
    pub fn unclaimed_reservations(&self) -> usize {
        self.reservations.len()
    }

    /// Reservations the KV receiver still waits on (claimed or not).
    pub fn inbound_reservations(&self) -> usize {
        self.registry.live_reservations()
    }

    /// Phased shutdown: draining, drain, stop, deregister.
    pub async fn shutdown(self) {
        self.plan.run().await;
    }

    /// Serves until `shutdown`, a drain request or a failure (see
    /// [`lifecycle::serve_until`]).
    pub async fn serve_until(self, shutdown: impl Future<Output = ()>) -> Result<(), NodeError> {
        lifecycle::serve_until(self.plan, self.failure, shutdown).await
    }
}

/// Runs a decode node with etcd and NATS from the flags until `shutdown` resolves, then shuts
/// it down in phases. Prints `tandem-decode-node listening grpc=ADDR kv=KV_ADDR node_id=ID` on
/// stdout once it serves.
pub async fn run(args: DecodeArgs, shutdown: impl Future<Output = ()>) -> Result<(), NodeError> {
    let node = DecodeNode::start(args, Coordination::FromArgs).await?;
    println!(
        "tandem-decode-node listening grpc={} kv={} node_id={}",
        node.grpc_addr(),
        node.kv_address(),
        node.node_id()
    );
    node.serve_until(shutdown).await
}

/// The binary's body (also `tandem decode`): parse `argv` with file layering, log to stderr,
/// run on a multi-threaded runtime until SIGTERM or Ctrl-C. Errors are startup failures.
pub fn main_with_args(argv: Vec<OsString>) -> anyhow::Result<()> {
    let args = DecodeArgs::parse_layered(argv).unwrap_or_else(|e| e.exit());
    let (log, trace) = (args.log.clone(), args.node.trace.clone());
    lifecycle::run_binary("tandem-decode", "decode-rt", &log, &trace, || {
        run(args, lifecycle::shutdown_signal())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_have_documented_defaults_and_read_the_node_flags() {
        let a =
            DecodeArgs::try_parse_from(["d", "--kv-addr", "127.0.0.1:7000", "--kv-blocks", "64"])
                .unwrap();
        assert_eq!(a.reservation_ttl_ms, 30_000);
        assert_eq!(a.kv_stall_timeout_ms, 5_000);
        assert_eq!(
            a.node.listen.kv_addr,
            "127.0.0.1:7000".parse::<SocketAddr>().unwrap()
        );
        assert_eq!(a.node.engine.kv_blocks, Some(64));
    }

    #[tokio::test]
    async fn a_zero_reservation_ttl_is_refused_before_anything_starts() {
        let a = DecodeArgs::try_parse_from(["d", "--reservation-ttl-ms", "0"]).unwrap();
        match DecodeNode::start(a, Coordination::FromArgs).await {
            Err(NodeError::InvalidConfig { flag, .. }) => {
                assert!(flag == "--etcd-endpoints" || flag == "--reservation-ttl-ms")
            }
            Err(e) => panic!("wrong error: {e}"),
            Ok(_) => panic!("started with a zero TTL"),
        }
        let a = DecodeArgs::try_parse_from([
            "d",
            "--reservation-ttl-ms",
            "0",
            "--etcd-endpoints",
            "e",
            "--nats-url",
            "n",
        ])
        .unwrap();
        assert!(matches!(
            DecodeNode::start(a, Coordination::FromArgs).await,
            Err(NodeError::InvalidConfig {
                flag: "--reservation-ttl-ms",
                ..
            })
        ));
    }
}
