//! The local executor: keeps each pool of `tandem up` at the size asked for in etcd
//! (`/tandem/{c}/scale/{role}`, written by the planner or `tandem scale`).
//!
//! Every `RECONCILE_PERIOD` it compares the nodes it runs with the target, per pool:
//! ```text
//! fewer live than wanted  → start `tandem {role} --node-id {role}-{next}` (it warms up —
//!                           model, a forward pass, a KV self-check — before it serves)
//! more live than wanted   → drain the newest: a drain request in etcd (it takes nothing new,
//!                           finishes its streams, deregisters, exits 0); a node that has not
//!                           registered yet is simply stopped (it serves nothing)
//! a node exited           → drained: forgotten; anything else: logged with its log's tail and
//!                           replaced, with back-off (1 s doubling to 30 s) while starts fail
//! ```
//! "Live" is a node started and not asked to drain. Node ids are never reused within one
//! `tandem up`, so a new node never meets an old node's drain request. A target outside the
//! limits cannot be written (the scale store refuses it), and a pool is never drained below
//! its target, so a pool reaches zero only when its minimum is zero.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_cluster::{ClusterError, Discovery, NodeState, Role, ScaleStore, ScaleTargets};

use super::procs::Procs;

/// Time between reconciliations.
pub const RECONCILE_PERIOD: Duration = Duration::from_millis(500);
/// First delay after a node failed to start; doubles up to [`RESTART_BACKOFF_MAX`].
const RESTART_BACKOFF_MIN: Duration = Duration::from_secs(1);
const RESTART_BACKOFF_MAX: Duration = Duration::from_secs(30);
/// A node asked to drain that is still running after this is stopped (its own drain timeout
/// has passed long before).
const DRAIN_LIMIT: Duration = Duration::from_secs(180);

struct Managed {
    name: String,
    role: Role,
    started: Instant,
    draining_since: Option<Instant>,
}

/// The nodes `tandem up` runs, by pool.
pub struct Pools {
    nodes: Vec<Managed>,
    next_index: [usize; 2],
    backoff: [Duration; 2],
    not_before: [Instant; 2],
    last_targets: ScaleTargets,
    /// Nodes that exited without being asked to (counted; each is replaced).
    pub unexpected_exits: u64,
    /// How the node command line is built: `(role, node id) → args`.
    node_args: NodeArgs,
    program: std::path::PathBuf,
}

/// Builds a node's command line: `(role, node id) → args`.
pub type NodeArgs = Box<dyn Fn(Role, &str) -> Vec<String> + Send>;

fn idx(role: Role) -> usize {
    match role {
        Role::Prefill => 0,
        Role::Decode => 1,
    }
}

impl Pools {
    /// Takes over the nodes `tandem up` started (`{role}-0 .. {role}-{n-1}`).
    pub fn new(
        initial: [(Role, usize); 2],
        program: &Path,
        node_args: NodeArgs,
    ) -> Pools {
        let mut nodes = Vec::new();
        let mut next_index = [0; 2];
        for (role, n) in initial {
            for i in 0..n {
                nodes.push(Managed {
                    name: format!("{role}-{i}"),
                    role,
                    started: Instant::now(),
                    draining_since: None,
                });
            }
            next_index[idx(role)] = n;
        }
        Pools {
            nodes,
            next_index,
            backoff: [RESTART_BACKOFF_MIN; 2],
            not_before: [Instant::now(); 2],
            last_targets: ScaleTargets {
                prefill: Some(
                    initial
                        .iter()
                        .find(|(r, _)| *r == Role::Prefill)
                        .map_or(0, |x| x.1),
                ),
                decode: Some(
                    initial
                        .iter()
                        .find(|(r, _)| *r == Role::Decode)
                        .map_or(0, |x| x.1),
                ),
            },
            unexpected_exits: 0,
            node_args,
            program: program.to_path_buf(),
        }
    }

    /// Nodes of `role` started and not draining.
    pub fn live(&self, role: Role) -> usize {
        self.nodes
            .iter()
            .filter(|n| n.role == role && n.draining_since.is_none())
            .count()
    }

    /// One reconciliation (see the module docs). Errors reading etcd skip the round.
    pub fn reconcile(
        &mut self,
        procs: &mut Procs,
        rt: &tokio::runtime::Runtime,
        store: &dyn ScaleStore,
        discovery: &Arc<dyn Discovery>,
    ) {
        self.reap(procs);
        let targets = match rt.block_on(store.targets()) {
            Ok(t) => t,
            Err(e) => {
                tracing::warn!(error = %e, "tandem up: reading pool targets from etcd failed");
                return;
            }
        };
        for role in [Role::Prefill, Role::Decode] {
            let Some(want) = targets.of(role) else {
                continue;
            };
            self.note_external_drains(role, rt, discovery);
            if self.last_targets.of(role) != Some(want) {
                eprintln!(
                    "tandem up: {role} pool: {} → {want} node(s)",
                    self.live(role)
                );
            }
            let live = self.live(role);
            if live < want {
                self.grow(role, procs);
            } else if live > want {
                self.shrink(role, procs, rt, discovery);
            }
        }
        self.last_targets = targets;
    }

    /// Forgets nodes that exited: drained ones quietly, others with their log.
    fn reap(&mut self, procs: &mut Procs) {
        let names: Vec<String> = self.nodes.iter().map(|n| n.name.clone()).collect();
        for (name, status, log_tail) in procs.reap(|n| names.iter().any(|m| m == n)) {
            let Some(pos) = self.nodes.iter().position(|n| n.name == name) else {
                continue;
            };
            let node = self.nodes.remove(pos);
            let i = idx(node.role);
            match node.draining_since {
                Some(since) if status.success() => {
                    eprintln!(
                        "tandem up: {name} drained and left ({:.1} s)",
                        since.elapsed().as_secs_f64()
                    );
                }
                None if status.success() => {
                    // Drained by someone else (`tandem drain`): replaced, as in a rolling restart.
                    eprintln!("tandem up: {name} left the cluster (exit 0)");
                }
                _ => {
                    self.unexpected_exits += 1;
                    eprintln!(
                        "tandem up: {name} exited ({status}) after {:.0} s; it will be replaced. Last lines of its log:\n{log_tail}",
                        node.started.elapsed().as_secs_f64()
                    );
                    // A node that dies young backs the pool's starts off.
                    if node.started.elapsed() < Duration::from_secs(60) {
                        self.not_before[i] = Instant::now() + self.backoff[i];
                        self.backoff[i] = (self.backoff[i] * 2).min(RESTART_BACKOFF_MAX);
                    } else {
                        self.backoff[i] = RESTART_BACKOFF_MIN;
                    }
                }
            }
        }
        // A drain that overstays is ended.
        for n in &self.nodes {
            if n.draining_since.is_some_and(|t| t.elapsed() > DRAIN_LIMIT) {
                eprintln!(
                    "tandem up: {} still draining after {DRAIN_LIMIT:?}; stopping it",
                    n.name
                );
                procs.signal(&n.name, libc::SIGKILL);
            }
        }
    }

    /// Nodes draining on someone else's request (`tandem drain`) stop counting as live, so
    /// their replacement starts while they finish their streams.
    fn note_external_drains(
        &mut self,
        role: Role,
        rt: &tokio::runtime::Runtime,
        discovery: &Arc<dyn Discovery>,
    ) {
        let Ok(view) = rt.block_on(discovery.list(role)) else {
            return;
        };
        for n in self
            .nodes
            .iter_mut()
            .filter(|n| n.role == role && n.draining_since.is_none())
        {
            if view
                .get(&n.name)
                .is_some_and(|i| i.state == NodeState::Draining)
            {
                eprintln!(
                    "tandem up: {} is draining (asked elsewhere); starting its replacement",
                    n.name
                );
                n.draining_since = Some(Instant::now());
            }
        }
    }

    fn grow(&mut self, role: Role, procs: &mut Procs) {
        let i = idx(role);
        if Instant::now() < self.not_before[i] {
            return;
        }
        let name = format!("{role}-{}", self.next_index[i]);
        self.next_index[i] += 1;
        let args = (self.node_args)(role, &name);
        match procs.spawn_before("router", &name, &self.program, &args) {
            Ok(()) => {
                eprintln!("tandem up: started {name} (it serves once warmed up)");
                self.nodes.push(Managed {
                    name,
                    role,
                    started: Instant::now(),
                    draining_since: None,
                });
            }
            Err(e) => {
                self.not_before[i] = Instant::now() + self.backoff[i];
                eprintln!(
                    "tandem up: starting {name} failed: {e:#}; retrying in {:?}",
                    self.backoff[i]
                );
                self.backoff[i] = (self.backoff[i] * 2).min(RESTART_BACKOFF_MAX);
            }
        }
    }

    fn shrink(
        &mut self,
        role: Role,
        procs: &mut Procs,
        rt: &tokio::runtime::Runtime,
        discovery: &Arc<dyn Discovery>,
    ) {
        let Some(node) = self
            .nodes
            .iter_mut()
            .rev()
            .find(|n| n.role == role && n.draining_since.is_none())
        else {
            return;
        };
        match rt.block_on(discovery.request_drain(role, &node.name)) {
            Ok(()) => eprintln!("tandem up: draining {}", node.name),
            Err(ClusterError::UnknownNode { .. }) => {
                eprintln!("tandem up: stopping {} (not serving yet)", node.name);
                procs.signal(&node.name, libc::SIGTERM);
            }
            Err(e) => {
                eprintln!(
                    "tandem up: asking {} to drain failed: {e}; retrying",
                    node.name
                );
                return;
            }
        }
        node.draining_since = Some(Instant::now());
    }
}
