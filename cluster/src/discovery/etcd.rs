//! [`EtcdDiscovery`]: membership in etcd (v3 API, tested against etcd 3.4).
//!
//! Node records live at `/tandem/{cluster}/nodes/{role}/{node_id}` under a lease (see
//! [`etcd_lease`](super::etcd_lease) for registration and keep-alive). A watch is one
//! background task per [`Discovery::watch`] call:
//!
//! ```text
//! list(prefix) ─▶ view, revision R ─▶ watch(prefix, from R+1) ─▶ apply put/delete ─▶ send view
//!      ▲                                      │ stream error / compaction / etcd restart
//!      └──────── backoff (100 ms .. retry_max) ◀┘   (the view keeps its last value meanwhile)
//! ```
//!
//! Always re-listing after a break (never resuming at an old revision) is what makes a wiped
//! or restored etcd safe: its revisions may have gone backwards.
//!
//! Every unary request runs under `request_timeout`, so nothing here waits forever on a dead
//! server. Cost: one etcd range read per (re)start of a watch; then one event per change.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{EventType, GetOptions, KeyValue, WatchOptions};
use tokio::sync::watch;

use super::{Backoff, Discovery, Registration, etcd_lease};
use crate::etcd::{EtcdClient, timed};
pub use crate::etcd::EtcdConfig;
use crate::error::ClusterError;
use crate::keys::ClusterKeys;
use crate::node::{NodeInfo, NodeView, Role};

/// A [`Discovery`] backed by etcd. Cheap to clone (one shared gRPC channel).
#[derive(Clone)]
pub struct EtcdDiscovery {
    inner: Arc<EtcdClient>,
}

impl std::fmt::Debug for EtcdDiscovery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdDiscovery")
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

impl EtcdDiscovery {
    /// Builds a client for `config.endpoints`. The connection is made lazily: this succeeds
    /// while etcd is down, and requests fail (retryably) until it is up.
    pub async fn connect(config: EtcdConfig) -> Result<Self, ClusterError> {
        Ok(Self {
            inner: Arc::new(EtcdClient::connect(config).await?),
        })
    }

    /// The etcd client underneath (the stores that share it: scale, rate limits, usage).
    pub(crate) fn etcd(&self) -> &EtcdClient {
        &self.inner
    }

    /// The configuration this client was built with.
    pub fn config(&self) -> &EtcdConfig {
        &self.inner.config
    }

    /// The key and subject builder of this cluster.
    pub fn keys(&self) -> &ClusterKeys {
        &self.inner.keys
    }

}

#[async_trait]
impl Discovery for EtcdDiscovery {
    fn cluster(&self) -> &str {
        self.inner.keys.cluster()
    }

    async fn request_drain(&self, role: Role, node_id: &str) -> Result<(), ClusterError> {
        let node_key = self.inner.keys.node_key(role, node_id)?;
        let drain_key = self.inner.keys.drain_key(role, node_id)?;
        let mut kv = self.inner.client.kv_client();
        // Only for a node that is registered now: the request must not wait for a future node.
        let txn = etcd_client::Txn::new()
            .when([etcd_client::Compare::create_revision(
                node_key,
                etcd_client::CompareOp::Greater,
                0,
            )])
            .and_then([etcd_client::TxnOp::put(drain_key, b"drain".to_vec(), None)]);
        let done = timed("drain request", self.inner.config.request_timeout, kv.txn(txn)).await?;
        if done.succeeded() {
            Ok(())
        } else {
            Err(ClusterError::UnknownNode {
                role,
                node_id: node_id.to_string(),
            })
        }
    }

    async fn drain_requested(&self, role: Role, node_id: &str) {
        let Ok(key) = self.inner.keys.drain_key(role, node_id) else {
            return std::future::pending().await;
        };
        let mut backoff = super::Backoff::new(Duration::from_millis(200), Duration::from_secs(5));
        loop {
            match wait_for_key(&self.inner, &key).await {
                Ok(()) => {
                    // Consume the request (a restarted node with the same id must not drain).
                    let mut kv = self.inner.client.kv_client();
                    let _ = timed("drain consume", self.inner.config.request_timeout, kv.delete(key.clone(), None)).await;
                    return;
                }
                Err(e) => {
                    tracing::debug!(error = %e, "waiting for drain requests failed; retrying");
                    tokio::time::sleep(backoff.next_delay()).await;
                }
            }
        }
    }

    async fn register(&self, info: NodeInfo) -> Result<Registration, ClusterError> {
        etcd_lease::register(Arc::clone(&self.inner), info).await
    }

    async fn list(&self, role: Role) -> Result<NodeView, ClusterError> {
        Ok(list_role(&self.inner, role).await?.0)
    }

    async fn watch(&self, role: Role) -> Result<watch::Receiver<NodeView>, ClusterError> {
        let (view, revision) = list_role(&self.inner, role).await?;
        let (tx, rx) = watch::channel(view);
        tokio::spawn(follow(Arc::clone(&self.inner), role, tx, revision));
        Ok(rx)
    }
}

/// Resolves once `key` exists (now, or after a watch sees it put).
async fn wait_for_key(inner: &EtcdClient, key: &str) -> Result<(), ClusterError> {
    let mut kv = inner.client.kv_client();
    let got = timed("drain get", inner.config.request_timeout, kv.get(key, None)).await?;
    if !got.kvs().is_empty() {
        return Ok(());
    }
    let revision = got.header().map_or(0, |h| h.revision());
    let mut client = inner.client.watch_client();
    let mut stream = timed(
        "drain watch",
        inner.config.request_timeout,
        client.watch(key, Some(WatchOptions::new().with_start_revision(revision + 1))),
    )
    .await?;
    while let Some(response) = stream
        .message()
        .await
        .map_err(|e| ClusterError::etcd("drain watch", e))?
    {
        if response
            .events()
            .iter()
            .any(|e| e.event_type() == EventType::Put)
        {
            return Ok(());
        }
    }
    Err(ClusterError::etcd(
        "drain watch",
        etcd_client::Error::WatchError("stream ended".into()),
    ))
}

/// Decodes one node record and checks it against its key.
fn decode_node(keys: &ClusterKeys, role: Role, kv: &KeyValue) -> Result<NodeInfo, ClusterError> {
    let key = String::from_utf8_lossy(kv.key());
    let (key_role, node_id) = keys.parse_node_key(&key)?;
    let info: NodeInfo =
        serde_json::from_slice(kv.value()).map_err(|source| ClusterError::Serde {
            op: "decode",
            at: key.to_string(),
            source,
        })?;
    if key_role != role || info.role != role || info.node_id != node_id {
        return Err(ClusterError::InvalidNodeInfo {
            node_id: info.node_id,
            field: "node_id",
            reason: format!("record does not match its key {key}"),
        });
    }
    Ok(info)
}

/// Lists one role; returns the view and the revision it was read at. Records that do not
/// decode are skipped with a warning (one bad writer must not hide the other nodes).
async fn list_role(inner: &EtcdClient, role: Role) -> Result<(NodeView, i64), ClusterError> {
    let mut kv = inner.client.kv_client();
    let prefix = inner.keys.role_prefix(role);
    let response = timed(
        "list",
        inner.config.request_timeout,
        kv.get(prefix, Some(GetOptions::new().with_prefix())),
    )
    .await?;
    let revision = response.header().map(|h| h.revision()).unwrap_or(0);
    let mut view = NodeView::new();
    for kv in response.kvs() {
        match decode_node(&inner.keys, role, kv) {
            Ok(info) => {
                view.insert(info.node_id.clone(), info);
            }
            Err(e) => tracing::warn!(error = %e, "skipping an unreadable node record"),
        }
    }
    Ok((view, revision))
}

/// The watch task: keeps `tx` current until every receiver is dropped.
async fn follow(inner: Arc<EtcdClient>, role: Role, tx: watch::Sender<NodeView>, mut revision: i64) {
    let cluster = inner.keys.cluster().to_string();
    let mut backoff = Backoff::new(Duration::from_millis(100), inner.config.retry_max);
    loop {
        let broke = tokio::select! {
            _ = tx.closed() => return,
            broke = stream_events(&inner, role, &tx, revision) => broke,
        };
        tracing::warn!(
            cluster = %cluster,
            role = role.as_str(),
            error = %broke,
            "etcd watch broke; serving the last view until etcd answers"
        );
        // Re-list until etcd answers; the view keeps its last value meanwhile.
        let mut failures = 0u32;
        loop {
            tokio::select! {
                _ = tx.closed() => return,
                _ = tokio::time::sleep(backoff.next_delay()) => {}
            }
            match list_role(&inner, role).await {
                Ok((view, listed_at)) => {
                    revision = listed_at;
                    tx.send_if_modified(|current| replace_if_different(current, view));
                    backoff.reset();
                    tracing::info!(
                        cluster = %cluster,
                        role = role.as_str(),
                        failures,
                        "etcd watch resumed; view re-listed"
                    );
                    break;
                }
                Err(e) => {
                    failures += 1;
                    tracing::debug!(cluster = %cluster, role = role.as_str(), error = %e, "re-list failed");
                }
            }
        }
    }
}

fn replace_if_different(current: &mut NodeView, new: NodeView) -> bool {
    if *current == new {
        false
    } else {
        *current = new;
        true
    }
}

/// Applies watch events from `revision + 1` on until the stream breaks; returns why it broke.
async fn stream_events(
    inner: &EtcdClient,
    role: Role,
    tx: &watch::Sender<NodeView>,
    revision: i64,
) -> ClusterError {
    let mut client = inner.client.watch_client();
    let options = WatchOptions::new()
        .with_prefix()
        .with_start_revision(revision + 1);
    let opened = timed(
        "watch",
        inner.config.request_timeout,
        client.watch(inner.keys.role_prefix(role), Some(options)),
    )
    .await;
    let mut stream = match opened {
        Ok(stream) => stream,
        Err(e) => return e,
    };
    tracing::debug!(cluster = %inner.keys.cluster(), role = role.as_str(), revision, "etcd watch opened");
    loop {
        let response = match stream.message().await {
            Ok(Some(response)) => response,
            Ok(None) => {
                return ClusterError::etcd(
                    "watch stream",
                    etcd_client::Error::WatchError("stream ended".into()),
                );
            }
            Err(e) => return ClusterError::etcd("watch stream", e),
        };
        if response.canceled() {
            // Compaction passed our revision (or the server cancelled): re-list.
            return ClusterError::etcd(
                "watch stream",
                etcd_client::Error::WatchError(format!(
                    "watch cancelled (compact revision {}): {}",
                    response.compact_revision(),
                    response.cancel_reason()
                )),
            );
        }
        tx.send_if_modified(|view| {
            let mut changed = false;
            for event in response.events() {
                let Some(kv) = event.kv() else { continue };
                match event.event_type() {
                    EventType::Put => match decode_node(&inner.keys, role, kv) {
                        Ok(info) => {
                            if view.get(&info.node_id) != Some(&info) {
                                view.insert(info.node_id.clone(), info);
                                changed = true;
                            }
                        }
                        Err(e) => tracing::warn!(error = %e, "ignoring an unreadable node record"),
                    },
                    EventType::Delete => {
                        match inner
                            .keys
                            .parse_node_key(&String::from_utf8_lossy(kv.key()))
                        {
                            Ok((_, node_id)) => changed |= view.remove(&node_id).is_some(),
                            Err(e) => tracing::warn!(error = %e, "ignoring a foreign key"),
                        }
                    }
                }
            }
            changed
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lease_ttl_rounds_up_to_whole_seconds_and_keep_alive_runs_at_a_third() {
        let config = EtcdConfig::new(vec![], "c").with_lease_ttl(Duration::from_millis(1500));
        assert_eq!(config.lease_ttl_secs(), 2);
        assert_eq!(config.keep_alive_period(), Duration::from_secs(2) / 3);
        let zero = EtcdConfig::new(vec![], "c").with_lease_ttl(Duration::ZERO);
        assert_eq!(zero.lease_ttl_secs(), 1);
        assert_eq!(zero.keep_alive_period(), Duration::from_secs(1) / 3);
    }
}
