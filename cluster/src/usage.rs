//! The usage ledger's storage: per API key id, what its requests used (requests, input,
//! cached input and output tokens, node-seconds per pool). Every router adds its requests'
//! usage; readers see the sum over every router and every restart.
//!
//! Where it lives, and why: in etcd, one record per key id
//! (`/tandem/{cluster}/usage/{key_id}`, JSON), updated by compare-and-swap on the record's
//! `mod_revision`. etcd is already the cluster's durable, replicated store: the ledger
//! survives router restarts and adds up across routers with no new component. (NATS JetStream
//! KV would do the same, but creating a KV bucket fails on Debian's nats-server 2.9.10; an
//! embedded store per router would not add across routers.) Routers batch their additions
//! (one CAS per key per flush, every second or so), so the cost is a few etcd writes a second
//! per router, not one per request; what a router had not flushed when it was killed (at most
//! one flush interval) is lost, and a graceful shutdown flushes.
//!
//! [`MemoryUsageStore`] is the in-process twin for tests.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{Client, GetOptions};
use serde::{Deserialize, Serialize};

use crate::cas::{decode, update_json};
use crate::etcd::timed;
use crate::error::ClusterError;
use crate::keys::{ClusterKeys, decode_segment};

/// What one key's requests used (totals, or a delta to add).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct UsageTotals {
    /// Completed requests.
    pub requests: u64,
    /// Prompt tokens.
    pub input_tokens: u64,
    /// Of those, served from a prefix cache.
    pub cached_input_tokens: u64,
    /// Generated tokens.
    pub output_tokens: u64,
    /// Prefill-pool engine time (each step shared among its requests by tokens computed).
    pub prefill_node_seconds: f64,
    /// Decode-pool engine time.
    pub decode_node_seconds: f64,
}

impl UsageTotals {
    /// Adds `other` into `self`.
    pub fn add(&mut self, other: &UsageTotals) {
        self.requests += other.requests;
        self.input_tokens += other.input_tokens;
        self.cached_input_tokens += other.cached_input_tokens;
        self.output_tokens += other.output_tokens;
        self.prefill_node_seconds += other.prefill_node_seconds;
        self.decode_node_seconds += other.decode_node_seconds;
    }

    /// Nothing counted.
    pub fn is_empty(&self) -> bool {
        *self == UsageTotals::default()
    }
}

/// Where usage is kept (etcd in production, memory in tests).
#[async_trait]
pub trait UsageStore: Send + Sync + std::fmt::Debug {
    /// Adds `delta` to `key_id`'s record; returns the new totals.
    async fn add(&self, key_id: &str, delta: &UsageTotals) -> Result<UsageTotals, ClusterError>;
    /// Every key id's totals.
    async fn list(&self) -> Result<BTreeMap<String, UsageTotals>, ClusterError>;
}

/// The ledger in etcd (see the module docs).
#[derive(Clone)]
pub struct EtcdUsageStore {
    client: Client,
    keys: ClusterKeys,
    timeout: Duration,
}

impl std::fmt::Debug for EtcdUsageStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdUsageStore")
            .field("cluster", &self.keys.cluster())
            .finish()
    }
}

impl EtcdUsageStore {
    pub(crate) fn new(client: Client, keys: ClusterKeys, timeout: Duration) -> Self {
        EtcdUsageStore {
            client,
            keys,
            timeout,
        }
    }
}

#[async_trait]
impl UsageStore for EtcdUsageStore {
    /// An addition that meets too many concurrent writers fails (it is retried at the next
    /// flush).
    async fn add(&self, key_id: &str, delta: &UsageTotals) -> Result<UsageTotals, ClusterError> {
        let key = self.keys.usage_key(key_id)?;
        update_json(&self.client, &key, self.timeout, "usage txn", |current| {
            let mut totals: UsageTotals = current.unwrap_or_default();
            totals.add(delta);
            totals
        })
        .await
    }

    async fn list(&self) -> Result<BTreeMap<String, UsageTotals>, ClusterError> {
        let prefix = self.keys.usage_prefix();
        let mut kv = self.client.kv_client();
        let got = timed(
            "usage list",
            self.timeout,
            kv.get(prefix.clone(), Some(GetOptions::new().with_prefix())),
        )
        .await?;
        let mut out = BTreeMap::new();
        for item in got.kvs() {
            let key = String::from_utf8_lossy(item.key()).to_string();
            let id = decode_segment(key.strip_prefix(&prefix).unwrap_or(&key))?;
            out.insert(id, decode(&key, item.value())?);
        }
        Ok(out)
    }
}

/// The in-process twin of [`EtcdUsageStore`].
#[derive(Debug, Default)]
pub struct MemoryUsageStore {
    totals: Mutex<BTreeMap<String, UsageTotals>>,
}

#[async_trait]
impl UsageStore for MemoryUsageStore {
    async fn add(&self, key_id: &str, delta: &UsageTotals) -> Result<UsageTotals, ClusterError> {
        let mut t = self.totals.lock().unwrap_or_else(|p| p.into_inner());
        let e = t.entry(key_id.to_string()).or_default();
        e.add(delta);
        Ok(*e)
    }

    async fn list(&self) -> Result<BTreeMap<String, UsageTotals>, ClusterError> {
        Ok(self.totals.lock().unwrap_or_else(|p| p.into_inner()).clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn memory_store_adds_per_key() {
        let s = MemoryUsageStore::default();
        let d = UsageTotals {
            requests: 1,
            input_tokens: 10,
            cached_input_tokens: 4,
            output_tokens: 3,
            prefill_node_seconds: 0.5,
            decode_node_seconds: 0.25,
        };
        s.add("a", &d).await.unwrap();
        let t = s.add("a", &d).await.unwrap();
        assert_eq!(t.requests, 2);
        assert_eq!(t.output_tokens, 6);
        assert_eq!(s.list().await.unwrap().len(), 1);
    }
}

/// The store over a membership client's etcd connection (defined here, beside the store, so the
/// etcd client names no store).
impl crate::discovery::EtcdDiscovery {
    /// The usage ledger in this cluster's etcd, over the same client.
    pub fn usage_store(&self) -> EtcdUsageStore {
        EtcdUsageStore::new(
            self.etcd().client.clone(),
            self.etcd().keys.clone(),
            self.etcd().config.request_timeout,
        )
    }
}
