//! Registering a node in etcd and keeping it registered.
//!
//! # The register transaction
//! ```text
//! grant lease (TTL)
//! get layout key ──absent──────────────▶ guard: create_revision(layout) == 0
//!                ──same fingerprint────▶ guard: mod_revision(layout) == seen
//!                ──other fingerprint──▶ any node registered? yes ─▶ LayoutMismatch (logged)
//!                                                             no  ─▶ guard as above (replace)
//! txn  if guard && create_revision(node key) == 0
//!      then put(layout key, this layout); put(node key, info, lease)
//!      else get(node key)                 ─▶ present: NodeExists; absent: layout raced, retry
//! ```
//! Every successful registration rewrites the layout key, so its `mod_revision` changes. That
//! is what makes the check race-free: a node replacing a stale layout and a node registering
//! under it both guard on the same `mod_revision`, and only one of them can win.
//!
//! The layout key has no lease. It outlives the nodes, and is replaced only when no node is
//! registered (a redeploy of the whole cluster with a new model is allowed; a mixed cluster
//! is not).
//!
//! # The keep-alive task
//! Every `keep_alive_period` (TTL/3) it renews the lease over one keep-alive stream, reopened
//! after any error. A response with TTL 0 (or "lease not found" on reopening) means the lease
//! expired or was revoked: the record is gone, so the task registers it again with a new lease
//! (same transaction, same checks), carrying the latest `draining` flag. While etcd is
//! unreachable it keeps trying at the same period; etcd restores leases' TTLs when it restarts,
//! so a short outage costs nothing. A `draining` change that could not be written is written
//! again after the next successful renewal.

use std::sync::Arc;
use std::time::Duration;

use etcd_client::{
    Compare, CompareOp, GetOptions, LeaseKeepAliveStream, LeaseKeeper, PutOptions, Txn, TxnOp,
    TxnOpResponse,
};
use tokio::time::MissedTickBehavior;

use crate::etcd::{EtcdClient, timed};
use super::{Command, Registration, RegistrationState, RegistrationTask};
use crate::error::ClusterError;
use crate::node::{ClusterLayout, NodeInfo};

/// Transactions tried before giving up on a layout key that keeps changing under us.
const MAX_TXN_ATTEMPTS: u32 = 8;

/// Validates, writes the record, and starts the keep-alive task.
pub(super) async fn register(
    inner: Arc<EtcdClient>,
    info: NodeInfo,
) -> Result<Registration, ClusterError> {
    info.validate()?;
    let lease_id = register_once(&inner, &info).await?;
    tracing::info!(
        cluster = %inner.keys.cluster(),
        role = info.role.as_str(),
        node_id = %info.node_id,
        lease_id,
        ttl_secs = inner.config.lease_ttl_secs(),
        "node registered"
    );
    let task_info = info.clone();
    Ok(Registration::spawn(
        &info,
        RegistrationState::Live { lease_id },
        move |task| hold(inner, task_info, lease_id, task),
    ))
}

fn encode<T: serde::Serialize>(value: &T, at: &str) -> Result<Vec<u8>, ClusterError> {
    serde_json::to_vec(value).map_err(|source| ClusterError::Serde {
        op: "encode",
        at: at.to_string(),
        source,
    })
}

/// Grants a lease and writes the record under it; returns the lease id. The lease is revoked
/// again if the record could not be written.
async fn register_once(inner: &EtcdClient, info: &NodeInfo) -> Result<i64, ClusterError> {
    let mut client = inner.client.clone();
    let limit = inner.config.request_timeout;
    let lease = timed(
        "lease grant",
        limit,
        client.lease_grant(inner.config.lease_ttl_secs(), None),
    )
    .await?
    .id();
    let written = write_record(inner, info, lease).await;
    if written.is_err() {
        // Best effort: an orphan lease holds nothing and expires by itself.
        let _ = timed("lease revoke", limit, client.lease_revoke(lease)).await;
    }
    written.map(|()| lease)
}

async fn write_record(inner: &EtcdClient, info: &NodeInfo, lease: i64) -> Result<(), ClusterError> {
    let mut client = inner.client.clone();
    let limit = inner.config.request_timeout;
    let cluster = inner.keys.cluster();
    let node_key = inner.keys.node_key(info.role, &info.node_id)?;
    let layout_key = inner.keys.layout_key();
    let node_value = encode(info, &node_key)?;
    let layout_value = encode(&ClusterLayout::of(info), &layout_key)?;
    for _ in 0..MAX_TXN_ATTEMPTS {
        let current = timed("layout get", limit, client.get(layout_key.clone(), None)).await?;
        let layout_guard = match current.kvs().first() {
            None => Compare::create_revision(layout_key.clone(), CompareOp::Equal, 0),
            Some(kv) => {
                let record: ClusterLayout =
                    serde_json::from_slice(kv.value()).map_err(|source| ClusterError::Serde {
                        op: "decode",
                        at: layout_key.clone(),
                        source,
                    })?;
                if record.fingerprint != info.layout_fingerprint {
                    let nodes = timed(
                        "node count",
                        limit,
                        client.get(
                            inner.keys.nodes_prefix(),
                            Some(GetOptions::new().with_prefix().with_count_only()),
                        ),
                    )
                    .await?
                    .count();
                    if nodes > 0 {
                        tracing::error!(
                            cluster = %cluster,
                            node_id = %info.node_id,
                            expected = %format!("{:016x}", record.fingerprint),
                            got = %format!("{:016x}", info.layout_fingerprint),
                            cluster_layout = %record.layout,
                            node_layout = %info.layout,
                            layout_set_by = %record.set_by,
                            "node refused: its KV layout differs from the cluster's"
                        );
                        return Err(ClusterError::LayoutMismatch {
                            cluster: cluster.to_string(),
                            node_id: info.node_id.clone(),
                            expected: record.fingerprint,
                            got: info.layout_fingerprint,
                        });
                    }
                    tracing::warn!(
                        cluster = %cluster,
                        node_id = %info.node_id,
                        old = %format!("{:016x}", record.fingerprint),
                        new = %format!("{:016x}", info.layout_fingerprint),
                        "no node is registered: the cluster's KV layout is replaced"
                    );
                }
                Compare::mod_revision(layout_key.clone(), CompareOp::Equal, kv.mod_revision())
            }
        };
        let txn = Txn::new()
            .when([
                layout_guard,
                Compare::create_revision(node_key.clone(), CompareOp::Equal, 0),
            ])
            .and_then([
                TxnOp::put(layout_key.clone(), layout_value.clone(), None),
                TxnOp::put(
                    node_key.clone(),
                    node_value.clone(),
                    Some(PutOptions::new().with_lease(lease)),
                ),
            ])
            .or_else([TxnOp::get(node_key.clone(), None)]);
        let response = timed("register txn", limit, client.txn(txn)).await?;
        if response.succeeded() {
            return Ok(());
        }
        let taken = response
            .op_responses()
            .iter()
            .any(|r| matches!(r, TxnOpResponse::Get(get) if !get.kvs().is_empty()));
        if taken {
            return Err(ClusterError::NodeExists {
                cluster: cluster.to_string(),
                role: info.role,
                node_id: info.node_id.clone(),
            });
        }
        // The layout key changed between our read and the txn: read it again.
    }
    Err(ClusterError::EtcdConflict {
        op: "register txn",
        attempts: MAX_TXN_ATTEMPTS,
    })
}

/// Rewrites the record (e.g. a new `draining` flag) under the current lease.
async fn rewrite(inner: &EtcdClient, info: &NodeInfo, lease: i64) -> Result<(), ClusterError> {
    let node_key = inner.keys.node_key(info.role, &info.node_id)?;
    let value = encode(info, &node_key)?;
    let mut client = inner.client.clone();
    // Only while the key is still ours: never resurrect a record after its lease is gone.
    let txn = Txn::new()
        .when([Compare::lease(node_key.clone(), CompareOp::Equal, lease)])
        .and_then([TxnOp::put(
            node_key,
            value,
            Some(PutOptions::new().with_lease(lease)),
        )]);
    let response = timed("put node", inner.config.request_timeout, client.txn(txn)).await?;
    if response.succeeded() {
        Ok(())
    } else {
        Err(ClusterError::Unavailable {
            service: "etcd",
            op: "put node (lease lost)",
        })
    }
}

/// Deletes the record (only if it is still ours) and revokes the lease.
async fn unregister(inner: &EtcdClient, info: &NodeInfo, lease: i64) -> Result<(), ClusterError> {
    let node_key = inner.keys.node_key(info.role, &info.node_id)?;
    let mut client = inner.client.clone();
    let limit = inner.config.request_timeout;
    let txn = Txn::new()
        .when([Compare::lease(node_key.clone(), CompareOp::Equal, lease)])
        .and_then([TxnOp::delete(node_key, None)]);
    timed("delete node", limit, client.txn(txn)).await?;
    if let Err(e) = timed("lease revoke", limit, client.lease_revoke(lease)).await {
        // The record is gone already; the lease expires by itself.
        tracing::debug!(error = %e, lease, "lease revoke after deregister failed");
    }
    Ok(())
}

/// The outcome of one renewal attempt.
enum Renewal {
    Alive,
    Lost,
    Unreachable(ClusterError),
}

/// Renews `lease` once over the (re)opened keep-alive stream.
async fn renew(
    inner: &EtcdClient,
    keeper: &mut Option<(LeaseKeeper, LeaseKeepAliveStream)>,
    lease: i64,
    limit: Duration,
) -> Renewal {
    let Some((sender, responses)) = keeper.as_mut() else {
        // Opening the stream sends one keep-alive and checks the answer.
        let mut client = inner.client.clone();
        return match timed("lease keep-alive", limit, client.lease_keep_alive(lease)).await {
            Ok(pair) => {
                *keeper = Some(pair);
                Renewal::Alive
            }
            Err(ClusterError::Etcd { source, .. })
                if matches!(*source, etcd_client::Error::LeaseKeepAliveError(_)) =>
            {
                Renewal::Lost
            }
            Err(e) => Renewal::Unreachable(e),
        };
    };
    let answer = timed("lease keep-alive", limit, async {
        sender.keep_alive().await?;
        responses.message().await
    })
    .await;
    match answer {
        Ok(Some(response)) if response.ttl() > 0 => Renewal::Alive,
        Ok(Some(_)) => {
            *keeper = None;
            Renewal::Lost
        }
        Ok(None) => {
            *keeper = None;
            Renewal::Unreachable(ClusterError::etcd(
                "lease keep-alive",
                etcd_client::Error::LeaseKeepAliveError("stream ended".into()),
            ))
        }
        Err(e) => {
            *keeper = None;
            Renewal::Unreachable(e)
        }
    }
}

/// The registration task. See the module docs.
async fn hold(inner: Arc<EtcdClient>, mut info: NodeInfo, mut lease: i64, mut task: RegistrationTask) {
    let cluster = inner.keys.cluster().to_string();
    let period = inner.config.keep_alive_period();
    let limit = inner.config.request_timeout.min(period);
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    tick.tick().await; // the first tick is immediate; the lease was just granted
    let mut keeper = None;
    let mut lost = false;
    let mut unwritten_draining = false;
    let set_state = |state: RegistrationState| {
        task.state.send_if_modified(|s| {
            let changed = *s != state;
            *s = state;
            changed
        });
    };
    loop {
        tokio::select! {
            biased;
            _ = task.dropped.cancelled() => break,
            command = task.commands.recv() => match command {
                None => break,
                Some(Command::SetState { state, reply }) => {
                    info.state = state;
                    info.draining = state == crate::node::NodeState::Draining;
                    let written = if lost {
                        Err(ClusterError::Unavailable { service: "etcd", op: "set state" })
                    } else {
                        rewrite(&inner, &info, lease).await
                    };
                    unwritten_draining = written.is_err();
                    let _ = reply.send(written);
                }
                Some(Command::Deregister { reply }) => {
                    let result = if lost { Ok(()) } else { unregister(&inner, &info, lease).await };
                    if result.is_ok() {
                        tracing::info!(cluster = %cluster, node_id = %info.node_id, "node deregistered");
                    }
                    let _ = reply.send(result);
                    break;
                }
            },
            _ = tick.tick() => {
                if lost {
                    match register_once(&inner, &info).await {
                        Ok(new_lease) => {
                            lease = new_lease;
                            lost = false;
                            unwritten_draining = false;
                            set_state(RegistrationState::Live { lease_id: lease });
                            tracing::info!(cluster = %cluster, node_id = %info.node_id, lease_id = lease, "node re-registered");
                        }
                        Err(e) if e.is_retryable() => {
                            tracing::debug!(cluster = %cluster, node_id = %info.node_id, error = %e, "re-register failed; retrying");
                        }
                        Err(e) => {
                            if !matches!(*task.state.borrow(), RegistrationState::Refused { .. }) {
                                tracing::error!(cluster = %cluster, node_id = %info.node_id, error = %e, "re-register refused; retrying every keep-alive period");
                            }
                            set_state(RegistrationState::Refused { kind: e.kind() });
                        }
                    }
                    continue;
                }
                match renew(&inner, &mut keeper, lease, limit).await {
                    Renewal::Alive => {
                        if *task.state.borrow() != (RegistrationState::Live { lease_id: lease }) {
                            tracing::info!(cluster = %cluster, node_id = %info.node_id, lease_id = lease, "lease renewed; etcd is back");
                        }
                        set_state(RegistrationState::Live { lease_id: lease });
                        if unwritten_draining {
                            unwritten_draining = rewrite(&inner, &info, lease).await.is_err();
                        }
                    }
                    Renewal::Lost => {
                        tracing::warn!(cluster = %cluster, node_id = %info.node_id, lease_id = lease, "lease lost; registering again");
                        lost = true;
                        set_state(RegistrationState::Reregistering);
                        // Register again now, not a keep-alive period later: until then no
                        // router may send this node work (an etcd that resumes after a hang
                        // revokes every lease at once, and the pools would stand empty).
                        tick.reset_immediately();
                    }
                    Renewal::Unreachable(e) => {
                        if matches!(*task.state.borrow(), RegistrationState::Live { .. }) {
                            tracing::warn!(cluster = %cluster, node_id = %info.node_id, error = %e, "lease renewal failed; retrying");
                        }
                        set_state(RegistrationState::Reconnecting);
                    }
                }
            }
        }
    }
    set_state(RegistrationState::Closed);
}
