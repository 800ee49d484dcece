//! The flags every operator command shares to find a cluster's control plane, and the etcd
//! client they open with them.

use clap::Args;
use tandem_cluster::{EtcdConfig, EtcdDiscovery};

/// `--etcd-endpoints` and `--cluster` (with `TANDEM_*` env fallbacks).
#[derive(Args, Debug, Clone)]
pub struct ClusterTarget {
    /// etcd client URLs, comma-separated (`tandem up` prints its own).
    #[arg(
        long,
        env = "TANDEM_ETCD_ENDPOINTS",
        value_delimiter = ',',
        required = true
    )]
    pub etcd_endpoints: Vec<String>,
    /// Cluster name.
    #[arg(long, env = "TANDEM_CLUSTER", default_value = "local")]
    pub cluster: String,
}

impl ClusterTarget {
    /// A client of this cluster's etcd (connected lazily: requests fail while it is down).
    pub async fn discovery(&self) -> anyhow::Result<EtcdDiscovery> {
        Ok(EtcdDiscovery::connect(EtcdConfig::new(
            self.etcd_endpoints.clone(),
            self.cluster.clone(),
        ))
        .await?)
    }
}
