//! Membership: who is in the cluster, in which role, and whether it takes new work.
//!
//! [`Discovery`] is the seam: [`EtcdDiscovery`] for real clusters,
//! [`MemoryDiscovery`] for tests and `tandem up --coordination embedded`. Both give the same
//! semantics:
//!
//! - [`Discovery::register`] checks the node's KV layout against the cluster's (the first node
//!   sets it; see [`ClusterLayout`](crate::ClusterLayout)), writes the node's record and returns
//!   a [`Registration`] handle whose background task keeps the record alive.
//! - [`Registration::deregister`] removes the record at once (graceful shutdown, last step).
//!   Dropping the handle stops the keep-alive: the record disappears when the lease expires
//!   (etcd: within the lease TTL; memory: at once). A killed process behaves the same way.
//! - [`Discovery::watch`] returns a `watch::Receiver` with the current view of one role, updated
//!   on join, leave and draining changes. It is latest-value data: a slow reader sees the newest
//!   view, never a backlog.
//!
//! ```text
//!   node process                         control plane               router process
//!   register(info) ──txn: layout check + put(key, lease)──▶ etcd ──watch(prefix)──▶ view task
//!   Registration ◀── handle                                   ▲                       │
//!        │  task: keep-alive every TTL/3, re-register if lost ┘         watch::Receiver<NodeView>
//!        └─ set_draining / deregister (commands over a bounded channel, oneshot replies)
//! ```
//!
//! # Degrade, don't die
//! When the backend is unreachable, views keep their last value and registrations keep
//! retrying; when it returns, views are re-listed and lost registrations are written again
//! (see [`RegistrationState`]).

pub(crate) mod etcd;
mod etcd_lease;
mod memory;

use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::error::ClusterError;
use crate::node::{NodeInfo, NodeView, Role};

pub use etcd::{EtcdConfig, EtcdDiscovery};
pub use memory::MemoryDiscovery;

/// Another name for [`MemoryDiscovery`], the in-process implementation.
pub type StaticDiscovery = MemoryDiscovery;

/// Cluster membership: register this node, list and watch the others.
#[async_trait]
pub trait Discovery: Send + Sync + 'static {
    /// The cluster this instance serves.
    fn cluster(&self) -> &str;

    /// Asks node (`role`, `node_id`) to drain (finish what it runs, take nothing new) and leave.
    /// [`ClusterError::UnknownNode`] if no such node is registered.
    async fn request_drain(&self, role: Role, node_id: &str) -> Result<(), ClusterError>;

    /// Resolves once someone asked node (`role`, `node_id`) to drain (the request is consumed).
    /// Outages only delay it.
    async fn drain_requested(&self, role: Role, node_id: &str);

    /// Registers `info` and keeps it registered until the handle is deregistered or dropped.
    ///
    /// Fails with [`ClusterError::LayoutMismatch`] when the cluster's registered nodes use a
    /// different KV layout, [`ClusterError::NodeExists`] when the (role, node id) is taken, and
    /// a retryable error when the backend is unreachable.
    async fn register(&self, info: NodeInfo) -> Result<Registration, ClusterError>;

    /// The nodes of `role` registered now.
    async fn list(&self, role: Role) -> Result<NodeView, ClusterError>;

    /// A receiver holding the current nodes of `role`, kept up to date in the background until
    /// every clone of the receiver is dropped. Fails (retryably) if the first listing fails;
    /// after that, outages only delay updates.
    async fn watch(&self, role: Role) -> Result<watch::Receiver<NodeView>, ClusterError>;
}

/// Where a [`Registration`] stands, for logs, metrics and tests.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RegistrationState {
    /// The record is written and its lease is being kept alive (`lease_id` 0 in memory).
    Live {
        /// The etcd lease the record is attached to.
        lease_id: i64,
    },
    /// The backend is unreachable; the keep-alive keeps trying. The record is still there as
    /// long as the lease has not expired.
    Reconnecting,
    /// The lease was lost (expired or revoked); the record is being written again.
    Reregistering,
    /// Writing the record again was refused for a reason retrying alone will not fix (another
    /// layout took over the cluster while this node's lease was gone). The task logs it once
    /// and keeps trying every keep-alive period, in case the cluster empties.
    Refused {
        /// [`ClusterError::kind`] of the refusal.
        kind: &'static str,
    },
    /// Deregistered, or the handle was dropped.
    Closed,
}

/// A request from a [`Registration`] handle to its background task.
pub(crate) enum Command {
    SetState {
        state: crate::node::NodeState,
        reply: oneshot::Sender<Result<(), ClusterError>>,
    },
    Deregister {
        reply: oneshot::Sender<Result<(), ClusterError>>,
    },
}

/// What a backend's registration task receives.
pub(crate) struct RegistrationTask {
    pub commands: mpsc::Receiver<Command>,
    pub state: watch::Sender<RegistrationState>,
    /// Cancelled when the handle is dropped: stop without deregistering.
    pub dropped: CancellationToken,
}

/// A live registration. Keep it for as long as the node serves.
///
/// Dropping it stops the keep-alive without deleting the record, exactly as a crash would;
/// call [`Registration::deregister`] on graceful shutdown.
#[derive(Debug)]
pub struct Registration {
    node_id: String,
    role: Role,
    commands: mpsc::Sender<Command>,
    state: watch::Receiver<RegistrationState>,
    dropped: CancellationToken,
    task: Option<JoinHandle<()>>,
}

impl Registration {
    /// Spawns `body` as the registration's background task and returns its handle.
    pub(crate) fn spawn<F, Fut>(info: &NodeInfo, initial: RegistrationState, body: F) -> Self
    where
        F: FnOnce(RegistrationTask) -> Fut,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        // Every handle method awaits its reply, so only concurrent callers sharing one handle
        // ever queue here; `send` waits when the bound is reached.
        let (commands_tx, commands) = mpsc::channel(4);
        let (state_tx, state) = watch::channel(initial);
        let dropped = CancellationToken::new();
        let task = tokio::spawn(body(RegistrationTask {
            commands,
            state: state_tx,
            dropped: dropped.clone(),
        }));
        Self {
            node_id: info.node_id.clone(),
            role: info.role,
            commands: commands_tx,
            state,
            dropped,
            task: Some(task),
        }
    }

    /// The registered node id.
    pub fn node_id(&self) -> &str {
        &self.node_id
    }

    /// The registered role.
    pub fn role(&self) -> Role {
        self.role
    }

    /// A receiver of the registration's state.
    pub fn state(&self) -> watch::Receiver<RegistrationState> {
        self.state.clone()
    }

    /// Sets the node's state in its record (`draining` follows: true for `Draining`).
    pub async fn set_state(&self, state: crate::node::NodeState) -> Result<(), ClusterError> {
        self.request(|reply| Command::SetState { state, reply })
            .await
    }

    /// Sets the `draining` flag in the node's record.
    ///
    /// On error (backend unreachable) the flag is still remembered and written whenever the
    /// record is written again.
    pub async fn set_draining(&self, draining: bool) -> Result<(), ClusterError> {
        let state = if draining {
            crate::node::NodeState::Draining
        } else {
            crate::node::NodeState::Serving
        };
        self.set_state(state).await
    }

    /// Removes the node's record and ends its lease now, then stops the background task.
    ///
    /// If the backend is unreachable this returns the error and the record expires with its
    /// lease instead.
    pub async fn deregister(mut self) -> Result<(), ClusterError> {
        let result = self.request(|reply| Command::Deregister { reply }).await;
        if let Some(task) = self.task.take() {
            // The task returns right after replying; a JoinError only means its runtime is
            // shutting down, which changes nothing for the caller.
            let _ = task.await;
        }
        result
    }

    async fn request(
        &self,
        command: impl FnOnce(oneshot::Sender<Result<(), ClusterError>>) -> Command,
    ) -> Result<(), ClusterError> {
        let closed = || ClusterError::RegistrationClosed {
            node_id: self.node_id.clone(),
        };
        let (reply, answer) = oneshot::channel();
        self.commands
            .send(command(reply))
            .await
            .map_err(|_| closed())?;
        answer.await.map_err(|_| closed())?
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.dropped.cancel();
    }
}

/// Exponential retry delay: `min` doubling up to `max`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Backoff {
    next: Duration,
    min: Duration,
    max: Duration,
}

impl Backoff {
    pub fn new(min: Duration, max: Duration) -> Self {
        Self {
            next: min,
            min,
            max,
        }
    }

    /// The delay to wait now; doubles the next one.
    pub fn next_delay(&mut self) -> Duration {
        let d = self.next;
        self.next = (self.next * 2).min(self.max);
        d
    }

    pub fn reset(&mut self) {
        self.next = self.min;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_its_cap_and_resets() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_millis(350));
        let got: Vec<_> = (0..4).map(|_| b.next_delay().as_millis()).collect();
        assert_eq!(got, [100, 200, 350, 350]);
        b.reset();
        assert_eq!(b.next_delay(), Duration::from_millis(100));
    }
}
