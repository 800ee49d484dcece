//! Pool sizes: what each pool is asked to have, the bounds it must stay in, and who may decide.
//!
//! ```text
//! /tandem/{c}/scale/{role}     desired node count (JSON number); written by the acting planner
//!                              or `tandem scale`, read by an executor (tandem up's reconciler;
//!                              the Kubernetes executor patches Deployments instead)
//! /tandem/{c}/scale-limits     {"prefill":{"min":1,"max":4},"decode":{...}}; written by whoever
//!                              runs the executor; every write of a desired count is checked
//!                              against it (a count outside is refused, nothing written)
//! /tandem/{c}/planner/leader   the acting planner's id, under its lease (see [`Election`])
//! ```
//!
//! # The election
//! A candidate grants a lease (TTL `ttl`) and creates the leader key under it in one
//! transaction that only succeeds while the key does not exist. The winner renews the lease
//! every `ttl/3` and checks that the key still holds its id. Its [`Leadership`] stays held
//! only while the last successful renewal is younger than `ttl` (less one renewal period of
//! margin), so a leader that is paused, partitioned or slow stops acting before its key can
//! have expired and another candidate taken over: two planners never act in the same instant,
//! and a leader that loses its lease stops acting within one TTL. Losers retry every `ttl/3`.
//! [`MemoryScaleStore`] and [`MemoryElection`] are the in-process twins.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use etcd_client::{Client, Compare, CompareOp, PutOptions, Txn, TxnOp};
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use crate::etcd::timed;
use crate::error::ClusterError;
use crate::keys::ClusterKeys;
use crate::node::Role;

/// One pool's bounds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolBounds {
    /// Fewest nodes.
    pub min: usize,
    /// Most nodes.
    pub max: usize,
}

/// Both pools' bounds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScaleLimits {
    /// The prefill pool's.
    pub prefill: PoolBounds,
    /// The decode pool's.
    pub decode: PoolBounds,
}

impl ScaleLimits {
    /// `role`'s bounds.
    pub fn of(&self, role: Role) -> PoolBounds {
        match role {
            Role::Prefill => self.prefill,
            Role::Decode => self.decode,
        }
    }

    /// Refuses `n` nodes for `role` when outside its bounds.
    pub fn check(&self, role: Role, n: usize) -> Result<(), ClusterError> {
        let b = self.of(role);
        if n < b.min || n > b.max {
            return Err(ClusterError::ScaleRefused {
                role,
                asked: n,
                min: b.min,
                max: b.max,
            });
        }
        Ok(())
    }
}

/// The desired size of each pool (absent: nobody has asked yet).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ScaleTargets {
    /// Prefill nodes wanted.
    pub prefill: Option<usize>,
    /// Decode nodes wanted.
    pub decode: Option<usize>,
}

impl ScaleTargets {
    /// `role`'s target.
    pub fn of(&self, role: Role) -> Option<usize> {
        match role {
            Role::Prefill => self.prefill,
            Role::Decode => self.decode,
        }
    }
}

/// Where desired pool sizes and their bounds live (etcd, or memory in tests).
#[async_trait]
pub trait ScaleStore: Send + Sync + std::fmt::Debug {
    /// Both pools' desired sizes.
    async fn targets(&self) -> Result<ScaleTargets, ClusterError>;
    /// Asks for `n` nodes of `role`; refused ([`ClusterError::ScaleRefused`]) outside the
    /// limits, when limits are set.
    async fn set_target(&self, role: Role, n: usize) -> Result<(), ClusterError>;
    /// The bounds, when set.
    async fn limits(&self) -> Result<Option<ScaleLimits>, ClusterError>;
    /// Sets the bounds (min ≤ max and max ≥ 1 per pool, else refused).
    async fn set_limits(&self, limits: ScaleLimits) -> Result<(), ClusterError>;
}

fn validate_limits(limits: &ScaleLimits) -> Result<(), ClusterError> {
    for role in [Role::Prefill, Role::Decode] {
        let b = limits.of(role);
        if b.max == 0 || b.min > b.max {
            return Err(ClusterError::ScaleRefused {
                role,
                asked: b.min,
                min: b.min,
                max: b.max,
            });
        }
    }
    Ok(())
}

/// Desired sizes and limits in etcd.
#[derive(Clone)]
pub struct EtcdScaleStore {
    client: Client,
    keys: ClusterKeys,
    timeout: Duration,
}

impl std::fmt::Debug for EtcdScaleStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdScaleStore")
            .field("cluster", &self.keys.cluster())
            .finish()
    }
}

impl EtcdScaleStore {
    pub(crate) fn new(client: Client, keys: ClusterKeys, timeout: Duration) -> Self {
        EtcdScaleStore {
            client,
            keys,
            timeout,
        }
    }

    async fn get_json<T: serde::de::DeserializeOwned>(
        &self,
        key: &str,
    ) -> Result<Option<T>, ClusterError> {
        let mut kv = self.client.kv_client();
        let got = timed("scale get", self.timeout, kv.get(key, None)).await?;
        got.kvs()
            .first()
            .map(|item| {
                serde_json::from_slice(item.value()).map_err(|source| ClusterError::Serde {
                    op: "decode",
                    at: key.to_string(),
                    source,
                })
            })
            .transpose()
    }
}

#[async_trait]
impl ScaleStore for EtcdScaleStore {
    async fn targets(&self) -> Result<ScaleTargets, ClusterError> {
        Ok(ScaleTargets {
            prefill: self.get_json(&self.keys.scale_key(Role::Prefill)).await?,
            decode: self.get_json(&self.keys.scale_key(Role::Decode)).await?,
        })
    }

    async fn set_target(&self, role: Role, n: usize) -> Result<(), ClusterError> {
        let limits_key = self.keys.scale_limits_key();
        let mut kv = self.client.kv_client();
        let got = timed("scale get", self.timeout, kv.get(limits_key.as_str(), None)).await?;
        // Checked and written in one transaction: a limits change between them fails it.
        let compare = match got.kvs().first() {
            Some(item) => {
                let limits: ScaleLimits = serde_json::from_slice(item.value()).map_err(|source| {
                    ClusterError::Serde {
                        op: "decode",
                        at: limits_key.clone(),
                        source,
                    }
                })?;
                limits.check(role, n)?;
                Compare::mod_revision(limits_key.as_str(), CompareOp::Equal, item.mod_revision())
            }
            None => Compare::create_revision(limits_key.as_str(), CompareOp::Equal, 0),
        };
        let txn = Txn::new()
            .when([compare])
            .and_then([TxnOp::put(self.keys.scale_key(role), n.to_string(), None)]);
        let done = timed("scale txn", self.timeout, kv.txn(txn)).await?;
        if !done.succeeded() {
            return Err(ClusterError::EtcdConflict {
                op: "scale txn (limits changed meanwhile)",
                attempts: 1,
            });
        }
        Ok(())
    }

    async fn limits(&self) -> Result<Option<ScaleLimits>, ClusterError> {
        self.get_json(&self.keys.scale_limits_key()).await
    }

    async fn set_limits(&self, limits: ScaleLimits) -> Result<(), ClusterError> {
        validate_limits(&limits)?;
        let key = self.keys.scale_limits_key();
        let value = serde_json::to_vec(&limits).map_err(|source| ClusterError::Serde {
            op: "encode",
            at: key.clone(),
            source,
        })?;
        let mut kv = self.client.kv_client();
        timed("scale limits put", self.timeout, kv.put(key, value, None)).await?;
        Ok(())
    }
}

/// The in-process twin of [`EtcdScaleStore`].
#[derive(Debug, Default)]
pub struct MemoryScaleStore {
    state: Mutex<(ScaleTargets, Option<ScaleLimits>)>,
}

#[async_trait]
impl ScaleStore for MemoryScaleStore {
    async fn targets(&self) -> Result<ScaleTargets, ClusterError> {
        Ok(self.state.lock().unwrap_or_else(|p| p.into_inner()).0)
    }

    async fn set_target(&self, role: Role, n: usize) -> Result<(), ClusterError> {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(l) = &s.1 {
            l.check(role, n)?;
        }
        match role {
            Role::Prefill => s.0.prefill = Some(n),
            Role::Decode => s.0.decode = Some(n),
        }
        Ok(())
    }

    async fn limits(&self) -> Result<Option<ScaleLimits>, ClusterError> {
        Ok(self.state.lock().unwrap_or_else(|p| p.into_inner()).1)
    }

    async fn set_limits(&self, limits: ScaleLimits) -> Result<(), ClusterError> {
        validate_limits(&limits)?;
        self.state.lock().unwrap_or_else(|p| p.into_inner()).1 = Some(limits);
        Ok(())
    }
}

/// A held leadership. Act only while [`Leadership::is_held`]; [`Leadership::lost`] fires when
/// it is not any more (it never comes back: campaign again).
#[derive(Debug)]
pub struct Leadership {
    lost: CancellationToken,
    renewed: Arc<Mutex<Instant>>,
    valid_for: Duration,
    resign: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Leadership {
    /// Whether this candidate may act now: not lost, and renewed recently enough that no
    /// other candidate can have taken over.
    pub fn is_held(&self) -> bool {
        !self.lost.is_cancelled()
            && self.renewed.lock().unwrap_or_else(|p| p.into_inner()).elapsed() < self.valid_for
    }

    /// Fires when the leadership is lost.
    pub fn lost(&self) -> CancellationToken {
        self.lost.clone()
    }

    /// Gives it up now (the key is deleted; another candidate can win at once).
    pub fn resign(mut self) {
        if let Some(tx) = self.resign.take() {
            let _ = tx.send(());
        }
    }
}

impl Drop for Leadership {
    fn drop(&mut self) {
        if let Some(tx) = self.resign.take() {
            let _ = tx.send(());
        }
    }
}

/// Leader election among planners (see the module docs).
#[async_trait]
pub trait Election: Send + Sync + std::fmt::Debug {
    /// Waits until `candidate` leads (or `cancel` fires: `None`).
    async fn campaign(
        &self,
        candidate: &str,
        cancel: &CancellationToken,
    ) -> Result<Option<Leadership>, ClusterError>;
    /// The current leader's id, if any.
    async fn leader(&self) -> Result<Option<String>, ClusterError>;
}

/// The election in etcd.
#[derive(Clone)]
pub struct EtcdElection {
    client: Client,
    key: String,
    ttl: Duration,
    timeout: Duration,
}

impl std::fmt::Debug for EtcdElection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdElection")
            .field("key", &self.key)
            .field("ttl", &self.ttl)
            .finish()
    }
}

impl EtcdElection {
    pub(crate) fn new(client: Client, keys: &ClusterKeys, ttl: Duration, timeout: Duration) -> Self {
        EtcdElection {
            client,
            key: keys.planner_leader_key(),
            ttl: ttl.max(Duration::from_secs(2)),
            timeout,
        }
    }

    fn period(&self) -> Duration {
        self.ttl / 3
    }

    /// One attempt: `Some(lease)` when this candidate now holds the key.
    async fn try_acquire(&self, candidate: &str) -> Result<Option<i64>, ClusterError> {
        let mut lease = self.client.lease_client();
        let granted = timed(
            "planner lease grant",
            self.timeout,
            lease.grant(self.ttl.as_secs() as i64, None),
        )
        .await?;
        let id = granted.id();
        let txn = Txn::new()
            .when([Compare::create_revision(self.key.as_str(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(
                self.key.as_str(),
                candidate,
                Some(PutOptions::new().with_lease(id)),
            )]);
        let mut kv = self.client.kv_client();
        match timed("planner election txn", self.timeout, kv.txn(txn)).await {
            Ok(done) if done.succeeded() => Ok(Some(id)),
            other => {
                let _ = timed("planner lease revoke", self.timeout, lease.revoke(id)).await;
                other.map(|_| None)
            }
        }
    }

    /// Renews `lease` and checks the key still names `candidate`; false when it does not.
    async fn renew(&self, candidate: &str, lease_id: i64) -> Result<bool, ClusterError> {
        let mut lease = self.client.lease_client();
        let (mut keeper, mut stream) = timed(
            "planner lease keep-alive",
            self.timeout,
            lease.keep_alive(lease_id),
        )
        .await?;
        timed("planner lease keep-alive", self.timeout, keeper.keep_alive()).await?;
        let alive = match timed("planner lease keep-alive", self.timeout, stream.message()).await? {
            Some(r) => r.ttl() > 0,
            None => false,
        };
        if !alive {
            return Ok(false);
        }
        let mut kv = self.client.kv_client();
        let got = timed("planner leader get", self.timeout, kv.get(self.key.as_str(), None)).await?;
        Ok(got
            .kvs()
            .first()
            .is_some_and(|kv| kv.value() == candidate.as_bytes() && kv.lease() == lease_id))
    }
}

#[async_trait]
impl Election for EtcdElection {
    async fn campaign(
        &self,
        candidate: &str,
        cancel: &CancellationToken,
    ) -> Result<Option<Leadership>, ClusterError> {
        let lease_id = loop {
            match self.try_acquire(candidate).await {
                Ok(Some(id)) => break id,
                Ok(None) => {}
                Err(e) => tracing::warn!(error = %e, "planner election: etcd unreachable, retrying"),
            }
            tokio::select! {
                _ = cancel.cancelled() => return Ok(None),
                _ = tokio::time::sleep(self.period()) => {}
            }
        };
        let renewed = Arc::new(Mutex::new(Instant::now()));
        let lost = CancellationToken::new();
        let (resign_tx, mut resign_rx) = tokio::sync::oneshot::channel();
        let this = self.clone();
        let (who, last, gone) = (candidate.to_string(), renewed.clone(), lost.clone());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(this.period());
            tick.tick().await;
            loop {
                tokio::select! {
                    _ = &mut resign_rx => {
                        gone.cancel();
                        let mut lease = this.client.lease_client();
                        let _ = timed("planner lease revoke", this.timeout, lease.revoke(lease_id)).await;
                        return;
                    }
                    _ = tick.tick() => {}
                }
                match this.renew(&who, lease_id).await {
                    Ok(true) => *last.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now(),
                    Ok(false) => {
                        tracing::warn!(candidate = %who, "planner election: lease or key lost; stepping down");
                        gone.cancel();
                        return;
                    }
                    Err(e) => {
                        let since = last.lock().unwrap_or_else(|p| p.into_inner()).elapsed();
                        tracing::warn!(error = %e, since_renewal_ms = since.as_millis() as u64, "planner election: renewal failed");
                        if since >= this.ttl {
                            gone.cancel();
                            return;
                        }
                    }
                }
            }
        });
        Ok(Some(Leadership {
            lost,
            renewed,
            valid_for: self.ttl.saturating_sub(self.period()),
            resign: Some(resign_tx),
        }))
    }

    async fn leader(&self) -> Result<Option<String>, ClusterError> {
        let mut kv = self.client.kv_client();
        let got = timed("planner leader get", self.timeout, kv.get(self.key.as_str(), None)).await?;
        Ok(got
            .kvs()
            .first()
            .map(|kv| String::from_utf8_lossy(kv.value()).to_string()))
    }
}

/// The in-process twin of [`EtcdElection`]: the first candidate wins until it resigns or
/// drops its [`Leadership`].
#[derive(Debug, Default, Clone)]
pub struct MemoryElection {
    leader: Arc<Mutex<Option<(String, CancellationToken)>>>,
}

#[async_trait]
impl Election for MemoryElection {
    async fn campaign(
        &self,
        candidate: &str,
        cancel: &CancellationToken,
    ) -> Result<Option<Leadership>, ClusterError> {
        loop {
            {
                let mut l = self.leader.lock().unwrap_or_else(|p| p.into_inner());
                if l.as_ref().is_none_or(|(_, lost)| lost.is_cancelled()) {
                    let lost = CancellationToken::new();
                    *l = Some((candidate.to_string(), lost.clone()));
                    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
                    let gone = lost.clone();
                    tokio::spawn(async move {
                        let _ = rx.await;
                        gone.cancel();
                    });
                    return Ok(Some(Leadership {
                        lost,
                        renewed: Arc::new(Mutex::new(Instant::now())),
                        valid_for: Duration::MAX,
                        resign: Some(tx),
                    }));
                }
            }
            tokio::select! {
                _ = cancel.cancelled() => return Ok(None),
                _ = tokio::time::sleep(Duration::from_millis(20)) => {}
            }
        }
    }

    async fn leader(&self) -> Result<Option<String>, ClusterError> {
        let l = self.leader.lock().unwrap_or_else(|p| p.into_inner());
        Ok(l.as_ref()
            .filter(|(_, lost)| !lost.is_cancelled())
            .map(|(id, _)| id.clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(pmin: usize, pmax: usize) -> ScaleLimits {
        ScaleLimits {
            prefill: PoolBounds { min: pmin, max: pmax },
            decode: PoolBounds { min: 1, max: 2 },
        }
    }

    #[tokio::test]
    async fn memory_store_refuses_sizes_outside_the_limits() {
        let s = MemoryScaleStore::default();
        s.set_target(Role::Prefill, 9).await.unwrap();
        s.set_limits(limits(1, 4)).await.unwrap();
        assert!(matches!(
            s.set_target(Role::Prefill, 5).await,
            Err(ClusterError::ScaleRefused { asked: 5, max: 4, .. })
        ));
        assert!(s.set_target(Role::Decode, 0).await.is_err());
        s.set_target(Role::Prefill, 3).await.unwrap();
        assert_eq!(s.targets().await.unwrap().prefill, Some(3));
        assert!(s.set_limits(limits(3, 2)).await.is_err());
    }

    #[tokio::test]
    async fn memory_election_has_one_leader_at_a_time() {
        let e = MemoryElection::default();
        let cancel = CancellationToken::new();
        let a = e.campaign("a", &cancel).await.unwrap().unwrap();
        assert!(a.is_held());
        let e2 = e.clone();
        let c2 = cancel.clone();
        let b = tokio::spawn(async move { e2.campaign("b", &c2).await });
        tokio::time::sleep(Duration::from_millis(60)).await;
        assert!(!b.is_finished());
        assert_eq!(e.leader().await.unwrap().as_deref(), Some("a"));
        let lost = a.lost();
        a.resign();
        lost.cancelled().await;
        let b = b.await.unwrap().unwrap().unwrap();
        assert!(b.is_held());
        assert_eq!(e.leader().await.unwrap().as_deref(), Some("b"));
    }
}

/// The store over a membership client's etcd connection (defined here, beside the store, so the
/// etcd client names no store).
impl crate::discovery::EtcdDiscovery {
    /// Desired pool sizes and their limits in this cluster's etcd, over the same client.
    pub fn scale_store(&self) -> EtcdScaleStore {
        EtcdScaleStore::new(
            self.etcd().client.clone(),
            self.etcd().keys.clone(),
            self.etcd().config.request_timeout,
        )
    }

    /// The planner election in this cluster's etcd: a leader holds it under a lease of `ttl`
    /// (at least 2 s).
    pub fn election(&self, ttl: Duration) -> EtcdElection {
        EtcdElection::new(
            self.etcd().client.clone(),
            &self.etcd().keys,
            ttl,
            self.etcd().config.request_timeout,
        )
    }
}
