//! The router's configuration: clap flags with `TANDEM_*` environment fallbacks
//! ([`env_names`]), optionally layered over a TOML file (`--config`), resolved and validated
//! once into a [`RouterConfig`].
//!
//! Precedence: flag > environment variable > file > built-in default. Every flag is optional in
//! [`RouterArgs`] so that "not given" is visible; the file fills what flags and env left unset,
//! then defaults fill the rest. File keys are the flag names in snake_case
//! (`max_in_flight = 64`, `etcd_endpoints = ["http://127.0.0.1:2379"]`, `api_keys = [...]`); an
//! unknown key is an error naming it. Validation errors name the flag, the value and the
//! reason ([`RouterError::Config`]).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Args;
use serde::Deserialize;

use crate::admission::AdmissionLimits;
use crate::keys::ApiKeys;
use crate::usage::CostModel;
use crate::canary::CanarySettings;
use crate::error::RouterError;
use crate::model::default_model_path;
use crate::pipeline::RouterOptions;
use crate::request::TokenLimits;

/// Every environment variable the router reads, in one place.
pub mod env_names {
    /// `--config`: a TOML file with flag values.
    pub const CONFIG: &str = "TANDEM_ROUTER_CONFIG";
    /// `--cluster`: the cluster name (shared with the nodes).
    pub const CLUSTER: &str = "TANDEM_CLUSTER";
    /// `--etcd-endpoints`: comma-separated etcd client URLs (shared with the nodes).
    pub const ETCD_ENDPOINTS: &str = "TANDEM_ETCD_ENDPOINTS";
    /// `--nats-url`: the NATS server URL (shared with the nodes).
    pub const NATS_URL: &str = "TANDEM_NATS_URL";
    /// `--grpc-addr`: where the gRPC ingress binds.
    pub const GRPC_ADDR: &str = "TANDEM_ROUTER_GRPC_ADDR";
    /// `--http-addr`: where the HTTP ingress binds.
    pub const HTTP_ADDR: &str = "TANDEM_ROUTER_HTTP_ADDR";
    /// `--model`: the GGUF file the nodes serve (shared with the engine's flags).
    pub const MODEL: &str = "TANDEM_MODEL";
    /// The model cache directory used when `--model` is absent (as `tandem model fetch`).
    pub const MODEL_DIR: &str = "TANDEM_MODEL_DIR";
    /// `--model-name`: the name clients use.
    pub const MODEL_NAME: &str = "TANDEM_MODEL_NAME";
    /// `--api-key`: comma-separated accepted API keys.
    pub const API_KEYS: &str = "TANDEM_API_KEYS";
    /// `--api-keys-file`: a TOML file of named API keys.
    pub const API_KEYS_FILE: &str = "TANDEM_API_KEYS_FILE";
    /// `--cost-file`: the cost of a node-hour per pool.
    pub const COST_FILE: &str = "TANDEM_COST_FILE";
    /// `--tls-cert`.
    pub const TLS_CERT: &str = "TANDEM_TLS_CERT";
    /// `--tls-key`.
    pub const TLS_KEY: &str = "TANDEM_TLS_KEY";
    /// `--node-tls-ca`.
    pub const NODE_TLS_CA: &str = "TANDEM_NODE_TLS_CA";
    /// `--node-tls-cert`.
    pub const NODE_TLS_CERT: &str = "TANDEM_NODE_TLS_CERT";
    /// `--node-tls-key`.
    pub const NODE_TLS_KEY: &str = "TANDEM_NODE_TLS_KEY";
    /// `--max-tokens-limit`.
    pub const MAX_TOKENS_LIMIT: &str = "TANDEM_MAX_TOKENS_LIMIT";
    /// `--default-max-tokens`.
    pub const DEFAULT_MAX_TOKENS: &str = "TANDEM_DEFAULT_MAX_TOKENS";
    /// `--max-context-tokens`.
    pub const MAX_CONTEXT_TOKENS: &str = "TANDEM_MAX_CONTEXT_TOKENS";
    /// `--max-in-flight`.
    pub const MAX_IN_FLIGHT: &str = "TANDEM_MAX_IN_FLIGHT";
    /// `--max-queued`.
    pub const MAX_QUEUED: &str = "TANDEM_MAX_QUEUED";
    /// `--queue-timeout-ms`.
    pub const QUEUE_TIMEOUT_MS: &str = "TANDEM_QUEUE_TIMEOUT_MS";
    /// `--batch-queue-timeout-ms`.
    pub const BATCH_QUEUE_TIMEOUT_MS: &str = "TANDEM_BATCH_QUEUE_TIMEOUT_MS";
    /// `--batch-aging-ms`.
    pub const BATCH_AGING_MS: &str = "TANDEM_ROUTER_BATCH_AGING_MS";
    /// `--max-attempts`.
    pub const MAX_ATTEMPTS: &str = "TANDEM_MAX_ATTEMPTS";
    /// `--prefill-policy`.
    pub const PREFILL_POLICY: &str = "TANDEM_PREFILL_POLICY";
    /// `--disaggregation`.
    pub const DISAGGREGATION: &str = "TANDEM_DISAGGREGATION";
    /// `--local-prefill-max-tokens`.
    pub const LOCAL_PREFILL_MAX_TOKENS: &str = "TANDEM_LOCAL_PREFILL_MAX_TOKENS";
    /// `--local-prefill-busy-max-tokens`.
    pub const LOCAL_PREFILL_BUSY_MAX_TOKENS: &str = "TANDEM_LOCAL_PREFILL_BUSY_MAX_TOKENS";
    /// `--local-prefill-busy-ratio`.
    pub const LOCAL_PREFILL_BUSY_RATIO: &str = "TANDEM_LOCAL_PREFILL_BUSY_RATIO";
    /// `--rpc-timeout-ms`.
    pub const RPC_TIMEOUT_MS: &str = "TANDEM_RPC_TIMEOUT_MS";
    /// `--connect-timeout-ms`.
    pub const CONNECT_TIMEOUT_MS: &str = "TANDEM_CONNECT_TIMEOUT_MS";
    /// `--load-max-age-ms`.
    pub const LOAD_MAX_AGE_MS: &str = "TANDEM_LOAD_MAX_AGE_MS";
    /// `--stream-idle-timeout-ms`.
    pub const STREAM_IDLE_TIMEOUT_MS: &str = "TANDEM_STREAM_IDLE_TIMEOUT_MS";
    /// `--canary-interval-secs`.
    pub const CANARY_INTERVAL_SECS: &str = "TANDEM_CANARY_INTERVAL_SECS";
    /// `--canary-timeout-ms`.
    pub const CANARY_TIMEOUT_MS: &str = "TANDEM_CANARY_TIMEOUT_MS";
    /// `--canary-max-pairs`.
    pub const CANARY_MAX_PAIRS: &str = "TANDEM_CANARY_MAX_PAIRS";
    /// `--startup-timeout-secs` (shared with the nodes).
    pub const STARTUP_TIMEOUT_SECS: &str = "TANDEM_STARTUP_TIMEOUT_SECS";
}

use env_names as env;

/// The router's flags. Unset values come from the `--config` file, then the defaults listed
/// in each flag's help.
#[derive(Args, Clone, Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RouterArgs {
    /// TOML file with flag values (keys: flag names in snake_case).
    #[arg(long, env = env::CONFIG)]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// Cluster name: the `{cluster}` level of etcd keys and NATS subjects [default: tandem].
    #[arg(long, env = env::CLUSTER)]
    pub cluster: Option<String>,
    /// etcd client URLs, comma-separated (e.g. http://127.0.0.1:2379). Required.
    #[arg(long, env = env::ETCD_ENDPOINTS, value_delimiter = ',')]
    pub etcd_endpoints: Vec<String>,
    /// NATS server URL for load reports (e.g. nats://127.0.0.1:4222). Required.
    #[arg(long, env = env::NATS_URL)]
    pub nats_url: Option<String>,
    /// gRPC ingress address (Inference, health, reflection) [default: 127.0.0.1:50051].
    #[arg(long, env = env::GRPC_ADDR)]
    pub grpc_addr: Option<SocketAddr>,
    /// OpenAI-compatible HTTP ingress address [default: 127.0.0.1:8000].
    #[arg(long, env = env::HTTP_ADDR)]
    pub http_addr: Option<SocketAddr>,
    /// The GGUF model file the nodes serve (the router reads its tokenizer) [default: the
    /// cached default model; `tandem model fetch` puts it there].
    #[arg(long, env = env::MODEL)]
    pub model: Option<PathBuf>,
    /// The model name clients pass [default: the file name without `.gguf`].
    #[arg(long, env = env::MODEL_NAME)]
    pub model_name: Option<String>,
    /// An accepted API key (repeat the flag, or comma-separate in the variable). None: no
    /// authentication.
    #[arg(long = "api-key", env = env::API_KEYS, value_delimiter = ',')]
    pub api_keys: Vec<String>,
    /// A TOML file of named API keys (`[[key]] id, key or sha256, admin`): requests are
    /// counted under the key's id in the usage ledger and the per-key metrics.
    #[arg(long, env = env::API_KEYS_FILE)]
    pub api_keys_file: Option<PathBuf>,
    /// A TOML file with the cost of a node-hour per pool (`[prefill]` and `[decode]` tables of
    /// depreciation, power, network, storage, operations, in dollars): `/v1/usage` and
    /// `tandem cost` price usage with it.
    #[arg(long, env = env::COST_FILE)]
    pub cost_file: Option<PathBuf>,
    /// Largest max_tokens a request may ask for [default: 4096].
    #[arg(long, env = env::MAX_TOKENS_LIMIT)]
    pub max_tokens_limit: Option<u32>,
    /// max_tokens when a request gives none [default: 256].
    #[arg(long, env = env::DEFAULT_MAX_TOKENS)]
    pub default_max_tokens: Option<u32>,
    /// Cap on prompt + output tokens, below the model's own context length [default: the
    /// model's].
    #[arg(long, env = env::MAX_CONTEXT_TOKENS)]
    pub max_context_tokens: Option<u32>,
    /// Requests running at once [default: 256].
    #[arg(long, env = env::MAX_IN_FLIGHT)]
    pub max_in_flight: Option<usize>,
    /// Requests waiting for a slot; one more gets 429 / RESOURCE_EXHAUSTED [default: 1024].
    #[arg(long, env = env::MAX_QUEUED)]
    pub max_queued: Option<usize>,
    /// How long an interactive request may wait for a slot, ms; then 429 naming the class
    /// [default: 30000].
    #[arg(long, env = env::QUEUE_TIMEOUT_MS)]
    pub queue_timeout_ms: Option<u64>,
    /// How long a batch request may wait for a slot, ms [default: 300000].
    #[arg(long, env = env::BATCH_QUEUE_TIMEOUT_MS)]
    pub batch_queue_timeout_ms: Option<u64>,
    /// A batch request that has waited this long, ms, takes the next free slot ahead of
    /// interactive waiters (strict priority with aging) [default: 5000].
    #[arg(long, env = env::BATCH_AGING_MS)]
    pub batch_aging_ms: Option<u64>,
    /// Attempts per request on retry-safe node failures, first included [default: 3].
    #[arg(long, env = env::MAX_ATTEMPTS)]
    pub max_attempts: Option<u32>,
    /// How prefill nodes are chosen: `prefix-aware` (fewest uncached + pending prompt
    /// tokens, from the nodes' KV events), `least-loaded`, `round-robin`, `power-of-two`
    /// [default: prefix-aware].
    #[arg(long, env = env::PREFILL_POLICY, value_enum)]
    pub prefill_policy: Option<crate::routing::PrefillPolicy>,
    /// `conditional`: the decode node computes short prompts itself (and medium ones when the
    /// prefill pool is busy), with no KV transfer; `always`: every prompt goes through a
    /// prefill node [default: conditional].
    #[arg(long, env = env::DISAGGREGATION, value_enum)]
    pub disaggregation: Option<crate::routing::DisaggregationMode>,
    /// With conditional disaggregation, prompts of at most this many tokens are computed by
    /// the decode node [default: 64, measured: bench/RESULTS.md].
    #[arg(long, env = env::LOCAL_PREFILL_MAX_TOKENS)]
    pub local_prefill_max_tokens: Option<u32>,
    /// The longest prompt the decode node computes because the prefill pool is busy
    /// [default: 512, or --local-prefill-max-tokens if that is larger].
    #[arg(long, env = env::LOCAL_PREFILL_BUSY_MAX_TOKENS)]
    pub local_prefill_busy_max_tokens: Option<u32>,
    /// The prefill pool is busy when the chosen prefill node has this many times the prompt
    /// tokens to compute that the decode node would [default: 4].
    #[arg(long, env = env::LOCAL_PREFILL_BUSY_RATIO)]
    pub local_prefill_busy_ratio: Option<f64>,
    /// Timeout of Reserve/Release calls, ms [default: 5000].
    #[arg(long, env = env::RPC_TIMEOUT_MS)]
    pub rpc_timeout_ms: Option<u64>,
    /// Timeout of connecting to a node, ms [default: 2000].
    #[arg(long, env = env::CONNECT_TIMEOUT_MS)]
    pub connect_timeout_ms: Option<u64>,
    /// Load reports older than this are stale and routing falls back to the router's own
    /// in-flight counts, ms [default: 1000].
    #[arg(long, env = env::LOAD_MAX_AGE_MS)]
    pub load_max_age_ms: Option<u64>,
    /// How long startup keeps retrying while etcd or NATS is unreachable, seconds [default: 30].
    #[arg(long, env = env::STARTUP_TIMEOUT_SECS)]
    pub startup_timeout_secs: Option<u64>,
    /// Once a request's stream is producing, the longest silence from its decode node before
    /// the node counts as stalled (hung) and the request migrates, ms [default: 10000].
    #[arg(long, env = env::STREAM_IDLE_TIMEOUT_MS)]
    pub stream_idle_timeout_ms: Option<u64>,
    /// Seconds between canary rounds (a two-token generation through each prefill→decode
    /// pair; health is SERVING while one passes); 0 turns the canary off and health counts
    /// registered nodes instead [default: 10].
    #[arg(long, env = env::CANARY_INTERVAL_SECS)]
    pub canary_interval_secs: Option<u64>,
    /// Bound on one canary probe, ms [default: 10000].
    #[arg(long, env = env::CANARY_TIMEOUT_MS)]
    pub canary_timeout_ms: Option<u64>,
    /// Pairs probed per canary round at most (rotating through all pairs of large pools)
    /// [default: 8].
    #[arg(long, env = env::CANARY_MAX_PAIRS)]
    pub canary_max_pairs: Option<usize>,
    /// A PEM certificate chain: both ingresses (HTTP and gRPC) serve TLS with it and
    /// `--tls-key`, and nothing in plain text. Give both or neither.
    #[arg(long, env = env::TLS_CERT, requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The PEM private key of `--tls-cert`.
    #[arg(long, env = env::TLS_KEY, requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// The PEM CA that signed the nodes' certificates: nodes registered as `https://` (started
    /// with `--tls-cert`) are reached over TLS and verified with it. Without it they are refused.
    #[arg(long, env = env::NODE_TLS_CA)]
    pub node_tls_ca: Option<PathBuf>,
    /// The router's own PEM certificate chain for nodes that require client certificates
    /// (mutual TLS: nodes started with `--tls-client-ca`).
    #[arg(long, env = env::NODE_TLS_CERT, requires = "node_tls_key", requires = "node_tls_ca")]
    pub node_tls_cert: Option<PathBuf>,
    /// The PEM private key of `--node-tls-cert`.
    #[arg(long, env = env::NODE_TLS_KEY, requires = "node_tls_cert")]
    pub node_tls_key: Option<PathBuf>,
    /// Trace export (OTLP); the standard OTEL_* variables apply.
    #[command(flatten)]
    #[serde(skip)]
    pub trace: tandem_telemetry::TraceArgs,
}

/// The resolved configuration.
#[derive(Clone, Debug)]
pub struct RouterConfig {
    /// Cluster name.
    pub cluster: String,
    /// etcd client URLs.
    pub etcd_endpoints: Vec<String>,
    /// NATS URL.
    pub nats_url: String,
    /// gRPC ingress address.
    pub grpc_addr: SocketAddr,
    /// HTTP ingress address.
    pub http_addr: SocketAddr,
    /// Model file.
    pub model_path: PathBuf,
    /// Model name override.
    pub model_name: Option<String>,
    /// Context cap override.
    pub max_context_tokens: Option<u32>,
    /// How long startup retries an unreachable control plane.
    pub startup_timeout: Duration,
    /// TLS on both ingresses (loaded and checked).
    pub tls: Option<crate::tls::TlsIdentity>,
    /// TLS towards `https://` nodes (loaded and checked).
    pub node_tls: Option<tonic::transport::ClientTlsConfig>,
    /// Core settings.
    pub options: RouterOptions,
}

impl RouterArgs {
    /// Fills unset values from `file` (values already set win).
    fn layer_under(mut self, file: RouterArgs) -> Self {
        macro_rules! fill {
            ($($field:ident),*) => { $( if self.$field.is_none() { self.$field = file.$field; } )* };
        }
        fill!(
            cluster,
            nats_url,
            grpc_addr,
            http_addr,
            model,
            model_name,
            max_tokens_limit,
            default_max_tokens,
            max_context_tokens,
            max_in_flight,
            max_queued,
            queue_timeout_ms,
            batch_queue_timeout_ms,
            batch_aging_ms,
            max_attempts,
            prefill_policy,
            disaggregation,
            local_prefill_max_tokens,
            local_prefill_busy_max_tokens,
            local_prefill_busy_ratio,
            rpc_timeout_ms,
            connect_timeout_ms,
            load_max_age_ms,
            api_keys_file,
            cost_file,
            tls_cert,
            tls_key,
            node_tls_ca,
            node_tls_cert,
            node_tls_key,
            stream_idle_timeout_ms,
            canary_interval_secs,
            canary_timeout_ms,
            canary_max_pairs
        );
        if self.etcd_endpoints.is_empty() {
            self.etcd_endpoints = file.etcd_endpoints;
        }
        if self.api_keys.is_empty() {
            self.api_keys = file.api_keys;
        }
        self
    }

    /// Reads a config file.
    fn from_file(path: &Path) -> Result<Self, RouterError> {
        let invalid = |reason: String| RouterError::Config {
            field: "config",
            value: path.display().to_string(),
            reason,
        };
        let text = std::fs::read_to_string(path).map_err(|e| invalid(e.to_string()))?;
        toml::from_str(&text).map_err(|e| invalid(e.to_string()))
    }

    /// Layers the config file (if any) and the defaults, and validates.
    pub fn resolve(self) -> Result<RouterConfig, RouterError> {
        let args = match self.config.clone() {
            Some(path) => self.layer_under(Self::from_file(&path)?),
            None => self,
        };
        let nonzero = |field: &'static str, value: u64| {
            if value == 0 {
                Err(RouterError::Config {
                    field,
                    value: "0".into(),
                    reason: "must be positive".into(),
                })
            } else {
                Ok(value)
            }
        };
        let ms = |field, value: Option<u64>, default| -> Result<Duration, RouterError> {
            Ok(Duration::from_millis(nonzero(
                field,
                value.unwrap_or(default),
            )?))
        };
        let max_tokens_limit = nonzero(
            "max-tokens-limit",
            args.max_tokens_limit.unwrap_or(4096) as u64,
        )? as u32;
        let default_max_tokens = nonzero(
            "default-max-tokens",
            args.default_max_tokens.unwrap_or(256) as u64,
        )? as u32;
        if default_max_tokens > max_tokens_limit {
            return Err(RouterError::Config {
                field: "default-max-tokens",
                value: default_max_tokens.to_string(),
                reason: format!("is above --max-tokens-limit ({max_tokens_limit})"),
            });
        }
        if let Some(cap) = args.max_context_tokens {
            nonzero("max-context-tokens", cap as u64)?;
        }
        if args.etcd_endpoints.is_empty() {
            return Err(RouterError::Config {
                field: "etcd-endpoints",
                value: String::new(),
                reason: format!(
                    "is required (flag, ${}, or the config file)",
                    env::ETCD_ENDPOINTS
                ),
            });
        }
        let nats_url = args.nats_url.clone().ok_or_else(|| RouterError::Config {
            field: "nats-url",
            value: String::new(),
            reason: format!("is required (flag, ${}, or the config file)", env::NATS_URL),
        })?;
        let options = RouterOptions {
            tokens: TokenLimits {
                max_tokens_limit,
                default_max_tokens,
            },
            admission: AdmissionLimits {
                max_in_flight: nonzero("max-in-flight", args.max_in_flight.unwrap_or(256) as u64)?
                    as usize,
                max_queued: args.max_queued.unwrap_or(1024),
                queue_timeout: ms("queue-timeout-ms", args.queue_timeout_ms, 30_000)?,
                batch_queue_timeout: ms(
                    "batch-queue-timeout-ms",
                    args.batch_queue_timeout_ms,
                    300_000,
                )?,
                batch_aging: ms("batch-aging-ms", args.batch_aging_ms, 5_000)?,
            },
            api_keys: match &args.api_keys_file {
                Some(f) => ApiKeys::new(args.api_keys.clone()).with_file(f)?,
                None => ApiKeys::new(args.api_keys.clone()),
            },
            cost: match &args.cost_file {
                Some(f) => CostModel::from_file(f)?,
                None => CostModel::default(),
            },
            max_attempts: nonzero("max-attempts", args.max_attempts.unwrap_or(3) as u64)? as u32,
            prefill_policy: args.prefill_policy.unwrap_or_default(),
            placement: crate::routing::PlacementSettings::from_flags(
                args.disaggregation,
                args.local_prefill_max_tokens,
                args.local_prefill_busy_max_tokens,
                args.local_prefill_busy_ratio,
            )?,
            rpc_timeout: ms("rpc-timeout-ms", args.rpc_timeout_ms, 5_000)?,
            connect_timeout: ms("connect-timeout-ms", args.connect_timeout_ms, 2_000)?,
            max_report_age: ms("load-max-age-ms", args.load_max_age_ms, 1_000)?,
            stream_idle_timeout: ms(
                "stream-idle-timeout-ms",
                args.stream_idle_timeout_ms,
                10_000,
            )?,
            canary: CanarySettings {
                interval: match args.canary_interval_secs.unwrap_or(10) {
                    0 => None,
                    s => Some(Duration::from_secs(s)),
                },
                timeout: ms("canary-timeout-ms", args.canary_timeout_ms, 10_000)?,
                max_pairs: nonzero(
                    "canary-max-pairs",
                    args.canary_max_pairs.unwrap_or(8) as u64,
                )? as usize,
                failures_to_quarantine: CanarySettings::default().failures_to_quarantine,
            },
        };
        Ok(RouterConfig {
            cluster: args.cluster.unwrap_or_else(|| "tandem".to_string()),
            etcd_endpoints: args.etcd_endpoints,
            nats_url,
            grpc_addr: args
                .grpc_addr
                .unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 50051))),
            http_addr: args
                .http_addr
                .unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 8000))),
            model_path: args.model.unwrap_or_else(default_model_path),
            model_name: args.model_name,
            max_context_tokens: args.max_context_tokens,
            startup_timeout: Duration::from_secs(args.startup_timeout_secs.unwrap_or(30)),
            tls: match (&args.tls_cert, &args.tls_key) {
                (Some(cert), Some(key)) => Some(crate::tls::TlsIdentity::load(&crate::tls::TlsFiles {
                    cert: cert.clone(),
                    key: key.clone(),
                })?),
                (None, None) => None,
                (Some(_), None) | (None, Some(_)) => {
                    return Err(RouterError::Config {
                        field: if args.tls_cert.is_some() { "tls-key" } else { "tls-cert" },
                        value: String::new(),
                        reason: "TLS needs both --tls-cert and --tls-key".into(),
                    });
                }
            },
            node_tls: crate::tls::node_client_config(
                args.node_tls_ca.as_deref(),
                args.node_tls_cert.as_deref().zip(args.node_tls_key.as_deref()),
            )?,
            options,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn required() -> RouterArgs {
        RouterArgs {
            etcd_endpoints: vec!["http://127.0.0.1:2379".into()],
            nats_url: Some("nats://127.0.0.1:4222".into()),
            ..Default::default()
        }
    }

    #[test]
    fn flags_win_over_the_file_and_the_file_over_defaults() {
        let path =
            std::env::temp_dir().join(format!("tandem-router-cfg-{}.toml", std::process::id()));
        std::fs::write(
            &path,
            "max_in_flight = 7\nmax_queued = 3\ncluster = \"from-file\"\napi_keys = [\"k\"]\n",
        )
        .unwrap();
        let args = RouterArgs {
            config: Some(path.clone()),
            max_in_flight: Some(9),
            ..required()
        };
        let config = args.resolve();
        let _ = std::fs::remove_file(&path);
        let config = config.unwrap();
        assert_eq!(config.options.admission.max_in_flight, 9);
        assert_eq!(config.options.admission.max_queued, 3);
        assert_eq!(config.cluster, "from-file");
        assert!(config.options.api_keys.enabled());
        assert_eq!(config.options.tokens.max_tokens_limit, 4096);
        assert_eq!(config.grpc_addr.port(), 50051);
    }

    #[test]
    fn an_unknown_file_key_is_an_error_naming_it() {
        let path =
            std::env::temp_dir().join(format!("tandem-router-bad-{}.toml", std::process::id()));
        std::fs::write(&path, "max_in_flite = 7\n").unwrap();
        let err = RouterArgs {
            config: Some(path.clone()),
            ..required()
        }
        .resolve()
        .unwrap_err();
        let _ = std::fs::remove_file(&path);
        assert!(err.to_string().contains("max_in_flite"), "{err}");
    }

    #[test]
    fn invalid_values_name_the_flag() {
        let err = RouterArgs {
            max_attempts: Some(0),
            ..required()
        }
        .resolve()
        .unwrap_err();
        assert!(
            matches!(
                err,
                RouterError::Config {
                    field: "max-attempts",
                    ..
                }
            ),
            "{err}"
        );
        let err = RouterArgs::default().resolve().unwrap_err();
        assert!(
            matches!(
                err,
                RouterError::Config {
                    field: "etcd-endpoints",
                    ..
                }
            ),
            "{err}"
        );
        let err = RouterArgs {
            default_max_tokens: Some(10),
            max_tokens_limit: Some(5),
            ..required()
        }
        .resolve()
        .unwrap_err();
        assert!(
            matches!(
                err,
                RouterError::Config {
                    field: "default-max-tokens",
                    ..
                }
            ),
            "{err}"
        );
    }
}
