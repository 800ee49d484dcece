//! [`MemoryDiscovery`]: an in-process registry with etcd's semantics, for tests and for
//! `tandem up --coordination embedded`.
//!
//! Clones share one registry (an `Arc<Mutex<..>>`), so every component of one process sees the
//! same cluster. The layout rule and `NodeExists` are the etcd ones; the "lease" is the
//! [`Registration`] and its task, so a dropped handle, an aborted holder task or a shut-down
//! runtime (a dead holder) disappears at once, which is within any TTL.
//!
//! Cost: register/deregister/draining take one mutex and publish one `watch` value; views are
//! `BTreeMap` clones, so O(nodes) per change. No I/O.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use async_trait::async_trait;
use tokio::sync::watch;

use super::{Command, Discovery, Registration, RegistrationState, RegistrationTask};
use crate::error::ClusterError;
use crate::keys::ClusterKeys;
use crate::node::{ClusterLayout, NodeInfo, NodeView, Role};

/// An in-process [`Discovery`]: clone it to share the registry.
#[derive(Clone, Debug)]
pub struct MemoryDiscovery {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    keys: ClusterKeys,
    registry: Mutex<Registry>,
}

#[derive(Debug)]
struct Registry {
    layout: Option<ClusterLayout>,
    /// One sender per role (index: [`role_index`]); its value *is* the role's node table.
    views: [watch::Sender<NodeView>; 2],
    /// Drain requests not yet consumed: (role, node id).
    drains: watch::Sender<std::collections::BTreeSet<(Role, String)>>,
}

fn role_index(role: Role) -> usize {
    match role {
        Role::Prefill => 0,
        Role::Decode => 1,
    }
}

impl MemoryDiscovery {
    /// An empty registry for the cluster named `cluster`.
    pub fn new(cluster: &str) -> Result<Self, ClusterError> {
        let keys = ClusterKeys::new(cluster)?;
        let registry = Registry {
            layout: None,
            views: [
                watch::Sender::new(BTreeMap::new()),
                watch::Sender::new(BTreeMap::new()),
            ],
            drains: watch::Sender::new(Default::default()),
        };
        Ok(Self {
            shared: Arc::new(Shared {
                keys,
                registry: Mutex::new(registry),
            }),
        })
    }

    /// The cluster's layout record, if a node has set one.
    pub fn cluster_layout(&self) -> Option<ClusterLayout> {
        self.shared.lock().layout.clone()
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Registry> {
        // A panic while holding this lock leaves the maps consistent (every change is one
        // insert or remove), so a poisoned lock is still safe to use.
        self.registry
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn remove(&self, role: Role, node_id: &str) -> bool {
        self.lock().views[role_index(role)].send_if_modified(|view| view.remove(node_id).is_some())
    }

    fn set_state(&self, role: Role, node_id: &str, state: crate::node::NodeState) {
        self.lock().views[role_index(role)].send_if_modified(|view| match view.get_mut(node_id) {
            Some(info) if info.state != state => {
                info.state = state;
                info.draining = state == crate::node::NodeState::Draining;
                true
            }
            _ => false,
        });
    }
}

#[async_trait]
impl Discovery for MemoryDiscovery {
    fn cluster(&self) -> &str {
        self.shared.keys.cluster()
    }

    async fn request_drain(&self, role: Role, node_id: &str) -> Result<(), ClusterError> {
        let reg = self.shared.lock();
        if !reg.views[role_index(role)].borrow().contains_key(node_id) {
            return Err(ClusterError::UnknownNode {
                role,
                node_id: node_id.to_string(),
            });
        }
        reg.drains.send_modify(|d| {
            d.insert((role, node_id.to_string()));
        });
        Ok(())
    }

    async fn drain_requested(&self, role: Role, node_id: &str) {
        let mut rx = self.shared.lock().drains.subscribe();
        let key = (role, node_id.to_string());
        if rx.wait_for(|d| d.contains(&key)).await.is_ok() {
            self.shared.lock().drains.send_modify(|d| {
                d.remove(&key);
            });
        } else {
            std::future::pending::<()>().await;
        }
    }

    async fn register(&self, info: NodeInfo) -> Result<Registration, ClusterError> {
        info.validate()?;
        {
            let mut registry = self.shared.lock();
            let cluster = self.cluster().to_string();
            if let Some(layout) = &registry.layout
                && layout.fingerprint != info.layout_fingerprint
            {
                let registered: usize = registry.views.iter().map(|v| v.borrow().len()).sum();
                if registered > 0 {
                    tracing::error!(
                        cluster = %cluster,
                        node_id = %info.node_id,
                        expected = %format!("{:016x}", layout.fingerprint),
                        got = %format!("{:016x}", info.layout_fingerprint),
                        cluster_layout = %layout.layout,
                        node_layout = %info.layout,
                        "node refused: its KV layout differs from the cluster's"
                    );
                    return Err(ClusterError::LayoutMismatch {
                        cluster,
                        node_id: info.node_id.clone(),
                        expected: layout.fingerprint,
                        got: info.layout_fingerprint,
                    });
                }
                tracing::warn!(
                    cluster = %cluster,
                    node_id = %info.node_id,
                    old = %format!("{:016x}", layout.fingerprint),
                    new = %format!("{:016x}", info.layout_fingerprint),
                    "no node is registered: the cluster's KV layout is replaced"
                );
            }
            let view = &registry.views[role_index(info.role)];
            if view.borrow().contains_key(&info.node_id) {
                return Err(ClusterError::NodeExists {
                    cluster,
                    role: info.role,
                    node_id: info.node_id.clone(),
                });
            }
            view.send_modify(|v| {
                v.insert(info.node_id.clone(), info.clone());
            });
            registry.layout = Some(ClusterLayout::of(&info));
        }
        let shared = Arc::clone(&self.shared);
        let (role, node_id) = (info.role, info.node_id.clone());
        Ok(Registration::spawn(
            &info,
            RegistrationState::Live { lease_id: 0 },
            move |task| hold(shared, role, node_id, task),
        ))
    }

    async fn list(&self, role: Role) -> Result<NodeView, ClusterError> {
        Ok(self.shared.lock().views[role_index(role)].borrow().clone())
    }

    async fn watch(&self, role: Role) -> Result<watch::Receiver<NodeView>, ClusterError> {
        Ok(self.shared.lock().views[role_index(role)].subscribe())
    }
}

/// Removes the node when dropped: whether the task ends by deregistering, because its handle
/// was dropped, or because its runtime was shut down (the holder's process died).
struct RemoveOnDrop {
    shared: Arc<Shared>,
    role: Role,
    node_id: String,
}

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        self.shared.remove(self.role, &self.node_id);
    }
}

/// The registration task: serves commands until deregistered or dropped.
async fn hold(shared: Arc<Shared>, role: Role, node_id: String, mut task: RegistrationTask) {
    let registered = RemoveOnDrop {
        shared,
        role,
        node_id,
    };
    loop {
        tokio::select! {
            _ = task.dropped.cancelled() => break,
            command = task.commands.recv() => match command {
                Some(Command::SetState { state, reply }) => {
                    registered.shared.set_state(role, &registered.node_id, state);
                    let _ = reply.send(Ok(()));
                }
                Some(Command::Deregister { reply }) => {
                    drop(registered);
                    let _ = reply.send(Ok(()));
                    task.state.send_replace(RegistrationState::Closed);
                    return;
                }
                None => break,
            },
        }
    }
    drop(registered);
    task.state.send_replace(RegistrationState::Closed);
}
