//! The flags both nodes take: where the control plane is ([`ClusterArgs`]), where to listen and
//! how KV moves ([`ListenArgs`]), and the engine's own ([`EngineArgs`]).
//!
//! Every flag has an environment fallback (names in [`env_names`](crate::env_names)) and may
//! also come from a `--config` TOML file (see [`config_file`](crate::config_file)); the order of
//! precedence is flag > env > file > default. Values are validated once, at startup, by
//! [`NodeArgs::validate`], whose errors name the flag.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, ValueEnum};
use tandem_engine::EngineArgs;

use crate::env_names::*;
use crate::error::NodeError;

/// Which KV transport a node uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum TransportChoice {
    /// UCX where it starts, TCP otherwise (with a warning).
    #[default]
    Auto,
    /// UCX (shared memory on one host, RDMA or tcp across hosts); fails if UCX cannot start.
    Ucx,
    /// Plain TCP.
    Tcp,
}

/// Where the control plane is and how this node appears in it.
#[derive(Args, Clone, Debug)]
pub struct ClusterArgs {
    /// etcd client URLs, comma-separated (e.g. http://127.0.0.1:2379). Required.
    #[arg(long, env = TANDEM_ETCD_ENDPOINTS, value_delimiter = ',')]
    pub etcd_endpoints: Vec<String>,

    /// NATS server URL for load reports (e.g. nats://127.0.0.1:4222). Required.
    #[arg(long, env = TANDEM_NATS_URL)]
    pub nats_url: Option<String>,

    /// Cluster name: the `{cluster}` level of every etcd key and NATS subject.
    #[arg(long, env = TANDEM_CLUSTER, default_value = "tandem")]
    pub cluster: String,

    /// This node's id, unique within its role (default: the role and a random suffix).
    #[arg(long, env = TANDEM_NODE_ID)]
    pub node_id: Option<String>,

    /// etcd lease TTL in seconds: a node that dies disappears from the cluster within this.
    #[arg(long, env = TANDEM_LEASE_TTL_SECS, default_value_t = 10)]
    pub lease_ttl_secs: u64,

    /// Load report period in milliseconds (NATS `tandem.{cluster}.load.{role}.{node_id}`).
    #[arg(long, env = TANDEM_LOAD_REPORT_MS, default_value_t = 200)]
    pub load_report_ms: u64,

    /// How long registration keeps retrying at startup while etcd is unreachable.
    #[arg(long, env = TANDEM_STARTUP_TIMEOUT_SECS, default_value_t = 30)]
    pub startup_timeout_secs: u64,
}

/// Where the node listens and how KV blocks move.
#[derive(Args, Clone, Debug)]
pub struct ListenArgs {
    /// gRPC listen address (port 0 picks a free port; the bound address is printed and
    /// registered).
    #[arg(long, env = TANDEM_GRPC_ADDR, default_value = "127.0.0.1:0")]
    pub grpc_addr: SocketAddr,

    /// KV-transfer listen address (decode nodes receive KV here; port 0 picks a free port).
    #[arg(long, env = TANDEM_KV_ADDR, default_value = "127.0.0.1:0")]
    pub kv_addr: SocketAddr,

    /// Host other nodes use to reach this one (default: the bound IP; required when binding
    /// 0.0.0.0 or ::).
    #[arg(long, env = TANDEM_ADVERTISE_HOST)]
    pub advertise_host: Option<String>,

    /// KV transport: ucx, tcp or auto (UCX where it starts, else TCP).
    #[arg(long, env = TANDEM_KV_TRANSPORT, value_enum, default_value_t = TransportChoice::Auto)]
    pub kv_transport: TransportChoice,

    /// With `--device cuda`: KV blocks to and from a node on the same GPU move device to device
    /// by CUDA IPC (checksummed on the GPU) instead of being staged through host memory. Peers
    /// on other GPUs or machines still get them over TCP. Needs the TCP transport (`auto` then
    /// picks TCP; `ucx` is refused).
    #[arg(long, env = TANDEM_KV_CUDA_IPC)]
    pub kv_cuda_ipc: bool,

    /// At shutdown, how long in-flight requests may take to finish before they are cut.
    #[arg(long, env = TANDEM_DRAIN_TIMEOUT_SECS, default_value_t = 30)]
    pub drain_timeout_secs: u64,

    /// Prometheus `/metrics` listen address (port 0 picks a free port; the URL is registered
    /// in etcd as `metrics_url` for service discovery).
    #[arg(long, env = TANDEM_METRICS_ADDR, default_value = "127.0.0.1:0")]
    pub metrics_addr: SocketAddr,

    /// A PEM certificate chain: the gRPC service is served over TLS only, with it and
    /// `--tls-key`, and registered as `https://` (routers then need `--node-tls-ca`).
    #[arg(long, env = TANDEM_TLS_CERT, requires = "tls_key")]
    pub tls_cert: Option<std::path::PathBuf>,

    /// The PEM private key of `--tls-cert`.
    #[arg(long, env = TANDEM_TLS_KEY, requires = "tls_cert")]
    pub tls_key: Option<std::path::PathBuf>,

    /// With `--tls-cert`: serve only clients presenting a certificate this PEM CA signed
    /// (mutual TLS: routers give theirs with `--node-tls-cert`/`--node-tls-key`).
    #[arg(long, env = TANDEM_TLS_CLIENT_CA, requires = "tls_cert")]
    pub tls_client_ca: Option<std::path::PathBuf>,
}

/// Everything a node takes besides its role's own flags.
#[derive(Args, Clone, Debug)]
pub struct NodeArgs {
    /// A TOML file with values for any of these flags (keys are flag names, `-` or `_`; tables
    /// are flattened). Flags and environment variables override it.
    #[arg(long, env = TANDEM_CONFIG)]
    pub config: Option<PathBuf>,

    /// Control plane.
    #[command(flatten)]
    pub cluster: ClusterArgs,

    /// Listeners and KV transport.
    #[command(flatten)]
    pub listen: ListenArgs,

    /// Model, KV cache and scheduler.
    #[command(flatten)]
    pub engine: EngineArgs,

    /// Trace export (OTLP); the standard OTEL_* variables apply.
    #[command(flatten)]
    pub trace: tandem_telemetry::TraceArgs,

    /// Fault injection for drills and tests: the engine thread panics after this many steps
    /// (the node must then leave the cluster and exit non-zero). Never set in production.
    #[arg(long, hide = true)]
    pub fault_engine_panic_after_steps: Option<u64>,
}

impl NodeArgs {
    /// Checks what clap cannot: non-zero periods, an advertisable host, the engine settings.
    /// Errors name the flag. See also [`validate_control_plane`](Self::validate_control_plane).
    pub fn validate(&self) -> Result<(), NodeError> {
        let invalid = |flag: &'static str, value: String, reason: &str| NodeError::InvalidConfig {
            flag,
            value,
            reason: reason.to_string(),
        };
        if self.cluster.cluster.is_empty() {
            return Err(invalid("--cluster", String::new(), "must not be empty"));
        }
        if self.cluster.node_id.as_deref() == Some("") {
            return Err(invalid("--node-id", String::new(), "must not be empty"));
        }
        if self.cluster.lease_ttl_secs == 0 {
            return Err(invalid(
                "--lease-ttl-secs",
                "0".into(),
                "must be at least 1",
            ));
        }
        if self.cluster.load_report_ms == 0 {
            return Err(invalid(
                "--load-report-ms",
                "0".into(),
                "must be at least 1",
            ));
        }
        self.listen.validate()?;
        if self.listen.kv_cuda_ipc && !self.engine.device.is_cuda() {
            return Err(invalid(
                "--kv-cuda-ipc",
                "true".into(),
                "moves KV between GPU memory: it needs --device cuda[:N]",
            ));
        }
        if self.listen.kv_cuda_ipc && self.listen.kv_transport == TransportChoice::Ucx {
            return Err(invalid(
                "--kv-transport",
                "ucx".into(),
                "--kv-cuda-ipc rides on the TCP transport (use tcp, or auto)",
            ));
        }
        self.engine.engine_config().map_err(NodeError::Engine)?;
        // `--device cuda` with no driver or no such device fails here, before anything starts.
        self.engine.device.check().map_err(NodeError::Engine)?;
        self.engine.load_dtype().map_err(NodeError::Engine)?;
        Ok(())
    }

    /// Checks that etcd and NATS are configured (required unless the caller provides the
    /// control plane in-process). Errors name the flag and its environment variable.
    pub fn validate_control_plane(&self) -> Result<(), NodeError> {
        if self
            .cluster
            .etcd_endpoints
            .iter()
            .all(|e| e.trim().is_empty())
        {
            return Err(NodeError::InvalidConfig {
                flag: "--etcd-endpoints",
                value: String::new(),
                reason: format!(
                    "is required (or set {TANDEM_ETCD_ENDPOINTS}): nodes register in etcd"
                ),
            });
        }
        if self
            .cluster
            .nats_url
            .as_deref()
            .is_none_or(|u| u.trim().is_empty())
        {
            return Err(NodeError::InvalidConfig {
                flag: "--nats-url",
                value: String::new(),
                reason: format!(
                    "is required (or set {TANDEM_NATS_URL}): nodes publish load reports on NATS"
                ),
            });
        }
        Ok(())
    }

    /// The etcd lease TTL.
    pub fn lease_ttl(&self) -> Duration {
        Duration::from_secs(self.cluster.lease_ttl_secs)
    }

    /// The load report period.
    pub fn load_report_period(&self) -> Duration {
        Duration::from_millis(self.cluster.load_report_ms)
    }
}

impl ListenArgs {
    /// Checks that the node can tell peers where it is.
    pub fn validate(&self) -> Result<(), NodeError> {
        for (flag, addr) in [("--grpc-addr", self.grpc_addr), ("--kv-addr", self.kv_addr)] {
            if addr.ip().is_unspecified() && self.advertise_host.is_none() {
                return Err(NodeError::InvalidConfig {
                    flag,
                    value: addr.to_string(),
                    reason:
                        "binds every interface, so peers need --advertise-host to reach this node"
                            .into(),
                });
            }
        }
        Ok(())
    }

    /// The host to publish for a listener bound at `bound`.
    pub fn advertised(&self, bound: SocketAddr) -> String {
        match &self.advertise_host {
            Some(h) if h.contains(':') && !h.starts_with('[') => format!("[{h}]:{}", bound.port()),
            Some(h) => format!("{h}:{}", bound.port()),
            None => bound.to_string(),
        }
    }

    /// The drain bound.
    pub fn drain_timeout(&self) -> Duration {
        Duration::from_secs(self.drain_timeout_secs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser, Debug)]
    struct Cli {
        #[command(flatten)]
        node: NodeArgs,
    }

    fn parse(args: &[&str]) -> NodeArgs {
        Cli::try_parse_from(std::iter::once("node").chain(args.iter().copied()))
            .unwrap()
            .node
    }

    #[test]
    fn missing_etcd_or_nats_is_an_error_naming_the_flag() {
        let a = parse(&["--nats-url", "nats://x:1"]);
        a.validate().unwrap();
        match a.validate_control_plane() {
            Err(NodeError::InvalidConfig {
                flag: "--etcd-endpoints",
                ..
            }) => {}
            other => panic!("expected --etcd-endpoints error, got {other:?}"),
        }
        let a = parse(&["--etcd-endpoints", "http://a:1,http://b:2"]);
        assert_eq!(a.cluster.etcd_endpoints, ["http://a:1", "http://b:2"]);
        match a.validate_control_plane() {
            Err(NodeError::InvalidConfig {
                flag: "--nats-url", ..
            }) => {}
            other => panic!("expected --nats-url error, got {other:?}"),
        }
        parse(&["--etcd-endpoints", "http://a:1", "--nats-url", "nats://b:2"])
            .validate_control_plane()
            .unwrap();
    }

    #[test]
    fn cuda_ipc_needs_a_gpu_and_the_tcp_transport() {
        let flag_of = |args: &[&str]| match parse(args).validate() {
            Err(NodeError::InvalidConfig { flag, .. }) => flag,
            other => panic!("expected an invalid-config error for {args:?}, got {other:?}"),
        };
        assert_eq!(flag_of(&["--kv-cuda-ipc"]), "--kv-cuda-ipc");
        assert_eq!(
            flag_of(&["--kv-cuda-ipc", "--device", "cuda", "--kv-transport", "ucx"]),
            "--kv-transport"
        );
    }

    #[test]
    fn binding_every_interface_needs_an_advertised_host() {
        let a = parse(&[
            "--etcd-endpoints",
            "e",
            "--nats-url",
            "n",
            "--grpc-addr",
            "0.0.0.0:5000",
        ]);
        assert!(matches!(
            a.validate(),
            Err(NodeError::InvalidConfig {
                flag: "--grpc-addr",
                ..
            })
        ));
        let a = parse(&[
            "--etcd-endpoints",
            "e",
            "--nats-url",
            "n",
            "--grpc-addr",
            "0.0.0.0:5000",
            "--advertise-host",
            "10.0.0.7",
        ]);
        a.validate().unwrap();
        assert_eq!(
            a.listen.advertised("0.0.0.0:5000".parse().unwrap()),
            "10.0.0.7:5000"
        );
        assert_eq!(
            a.listen.advertised("127.0.0.1:9".parse().unwrap()),
            "10.0.0.7:9"
        );
    }
}
