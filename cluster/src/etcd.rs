//! The etcd client every etcd-backed part of the control plane shares: how to reach etcd
//! ([`EtcdConfig`]), one connection with its key builder ([`EtcdClient`]), and [`timed`], the
//! time limit every unary request runs under. Membership (`discovery::etcd`), the node lease
//! (`discovery::etcd_lease`) and the stores (scale, rate limits, usage, compare-and-set) use it;
//! it names none of them.
//!
//! Invariant: no request here waits forever on a dead server (`request_timeout` on each, HTTP/2
//! pings on the connection).

use std::future::Future;
use std::time::Duration;

use etcd_client::{Client, ConnectOptions};

use crate::error::ClusterError;
use crate::keys::ClusterKeys;

/// Interval of HTTP/2 keep-alive pings to etcd (etcd refuses pings more often than every 5 s).
const GRPC_PING_INTERVAL: Duration = Duration::from_secs(10);

/// How to reach etcd and how to use it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EtcdConfig {
    /// etcd client URLs, e.g. `http://127.0.0.1:2379`.
    pub endpoints: Vec<String>,
    /// The cluster name (the `{cluster}` level of every key).
    pub cluster: String,
    /// Lease TTL of a node record (rounded up to whole seconds; etcd's minimum is about 2 s
    /// with default server timings). A dead node disappears within about this long.
    pub lease_ttl: Duration,
    /// Limit on each unary etcd request.
    pub request_timeout: Duration,
    /// Limit on establishing a connection.
    pub connect_timeout: Duration,
    /// Longest wait between retries while etcd is unreachable.
    pub retry_max: Duration,
}

impl EtcdConfig {
    /// Defaults: lease TTL 10 s, request timeout 3 s, connect timeout 2 s, retries up to 2 s.
    pub fn new(endpoints: Vec<String>, cluster: impl Into<String>) -> Self {
        Self {
            endpoints,
            cluster: cluster.into(),
            lease_ttl: Duration::from_secs(10),
            request_timeout: Duration::from_secs(3),
            connect_timeout: Duration::from_secs(2),
            retry_max: Duration::from_secs(2),
        }
    }

    /// Sets [`EtcdConfig::lease_ttl`].
    pub fn with_lease_ttl(mut self, ttl: Duration) -> Self {
        self.lease_ttl = ttl;
        self
    }

    /// The TTL sent to etcd, in whole seconds (at least 1).
    pub fn lease_ttl_secs(&self) -> i64 {
        let ms = self.lease_ttl.as_millis().max(1);
        ms.div_ceil(1000).min(i64::MAX as u128) as i64
    }

    /// How often a registration renews its lease: a third of the TTL, so two renewals can be
    /// lost before the lease expires.
    pub fn keep_alive_period(&self) -> Duration {
        (Duration::from_secs(self.lease_ttl_secs() as u64) / 3).max(Duration::from_millis(100))
    }
}

/// One etcd connection (cheap to clone underneath: a shared gRPC channel), this cluster's keys
/// and the settings it was built with.
pub(crate) struct EtcdClient {
    /// The etcd v3 client.
    pub client: Client,
    /// Key and subject names of this cluster.
    pub keys: ClusterKeys,
    /// The settings.
    pub config: EtcdConfig,
}

impl EtcdClient {
    /// Builds a client for `config.endpoints`. The connection is made lazily: this succeeds
    /// while etcd is down, and requests fail (retryably) until it is up.
    pub async fn connect(config: EtcdConfig) -> Result<Self, ClusterError> {
        let keys = ClusterKeys::new(&config.cluster)?;
        let options = ConnectOptions::new()
            .with_connect_timeout(config.connect_timeout)
            // HTTP/2 pings find a silently dead server (a partition sends no reset).
            // HTTP/2 pings no more often than etcd's default `--grpc-keepalive-min-time` (5 s):
            // pinging faster makes etcd close the connection ("too many pings"), dropping every
            // watch every few seconds.
            .with_keep_alive(GRPC_PING_INTERVAL, config.request_timeout)
            .with_keep_alive_while_idle(true);
        let client = Client::connect(&config.endpoints, Some(options))
            .await
            .map_err(|e| ClusterError::etcd("connect", e))?;
        Ok(Self {
            client,
            keys,
            config,
        })
    }
}

/// Runs one etcd request under a time limit, naming the operation in any error.
pub(crate) async fn timed<T>(
    op: &'static str,
    limit: Duration,
    request: impl Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, ClusterError> {
    match tokio::time::timeout(limit, request).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(ClusterError::etcd(op, e)),
        Err(_) => Err(ClusterError::EtcdTimeout { op, after: limit }),
    }
}
