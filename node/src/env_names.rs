//! Every environment variable a node reads, in one place. Each one is the
//! fallback of the flag named in its doc; flags win over variables, variables over a `--config`
//! file, the file over built-in defaults.
//!
//! The engine's own flags (`TANDEM_MODEL`, `TANDEM_KV_DTYPE`, ...) are listed in
//! `tandem_engine::EngineArgs`; `RUST_LOG` sets the log filter; the trace flags read the
//! standard `OTEL_*` variables (`tandem_telemetry::trace::config`).

/// `--config`: a TOML file with flag values.
pub const TANDEM_CONFIG: &str = "TANDEM_CONFIG";
/// `--etcd-endpoints`: comma-separated etcd client URLs.
pub const TANDEM_ETCD_ENDPOINTS: &str = "TANDEM_ETCD_ENDPOINTS";
/// `--nats-url`: the NATS server URL.
pub const TANDEM_NATS_URL: &str = "TANDEM_NATS_URL";
/// `--cluster`: the cluster name.
pub const TANDEM_CLUSTER: &str = "TANDEM_CLUSTER";
/// `--node-id`: this node's id.
pub const TANDEM_NODE_ID: &str = "TANDEM_NODE_ID";
/// `--lease-ttl-secs`: etcd lease TTL.
pub const TANDEM_LEASE_TTL_SECS: &str = "TANDEM_LEASE_TTL_SECS";
/// `--load-report-ms`: load report period.
pub const TANDEM_LOAD_REPORT_MS: &str = "TANDEM_LOAD_REPORT_MS";
/// `--startup-timeout-secs`: how long registration keeps retrying at start.
pub const TANDEM_STARTUP_TIMEOUT_SECS: &str = "TANDEM_STARTUP_TIMEOUT_SECS";
/// `--grpc-addr`: where the gRPC server binds.
pub const TANDEM_GRPC_ADDR: &str = "TANDEM_GRPC_ADDR";
/// `--kv-addr`: where the KV-transfer receiver binds.
pub const TANDEM_KV_ADDR: &str = "TANDEM_KV_ADDR";
/// `--advertise-host`: the host peers use to reach this node.
pub const TANDEM_ADVERTISE_HOST: &str = "TANDEM_ADVERTISE_HOST";
/// `--kv-transport`: ucx, tcp or auto.
pub const TANDEM_KV_TRANSPORT: &str = "TANDEM_KV_TRANSPORT";
/// `--tls-cert`: the node's PEM certificate chain (gRPC over TLS).
pub const TANDEM_TLS_CERT: &str = "TANDEM_TLS_CERT";
/// `--tls-key`: its PEM private key.
pub const TANDEM_TLS_KEY: &str = "TANDEM_TLS_KEY";
/// `--tls-client-ca`: the PEM CA client certificates must chain to (mutual TLS).
pub const TANDEM_TLS_CLIENT_CA: &str = "TANDEM_TLS_CLIENT_CA";
/// `--metrics-addr`: where `/metrics` binds.
pub const TANDEM_METRICS_ADDR: &str = "TANDEM_METRICS_ADDR";
/// `--drain-timeout-secs`: bound on finishing in-flight work at shutdown.
pub const TANDEM_DRAIN_TIMEOUT_SECS: &str = "TANDEM_DRAIN_TIMEOUT_SECS";
/// `--push-deadline-ms` (prefill): bound on one KV push.
pub const TANDEM_PUSH_DEADLINE_MS: &str = "TANDEM_PUSH_DEADLINE_MS";
/// `--reservation-ttl-ms` (decode): how long an unclaimed reservation lives.
pub const TANDEM_RESERVATION_TTL_MS: &str = "TANDEM_RESERVATION_TTL_MS";
/// `--kv-cuda-ipc`: KV between nodes on the same GPU moves device to device by CUDA IPC.
pub const TANDEM_KV_CUDA_IPC: &str = "TANDEM_KV_CUDA_IPC";
/// `--kv-stall-timeout-ms` (decode): a KV push that lands nothing for this long is ended.
pub const TANDEM_KV_STALL_TIMEOUT_MS: &str = "TANDEM_KV_STALL_TIMEOUT_MS";
/// `--max-step-ms` (decode): the step-time target the prompts a decode node computes are
/// chunked to.
pub const TANDEM_MAX_STEP_MS: &str = "TANDEM_MAX_STEP_MS";
/// `--kv-fault` (prefill, fault-injection builds only): a fault applied to every push.
pub const TANDEM_KV_FAULT: &str = "TANDEM_KV_FAULT";
/// `--kv-fault-on-sigusr1` (prefill, fault-injection builds only): the fault starts off and
/// each SIGUSR1 turns it on or off (the drills' switch).
pub const TANDEM_KV_FAULT_ON_SIGUSR1: &str = "TANDEM_KV_FAULT_ON_SIGUSR1";
