//! [`Cluster`]: the processes one `tandem up` runs, and what can be done to them while they run
//! (signal, restart, cut off the network, fill etcd's disk, stop).
//!
//! Invariant: dropping a cluster stops its processes in reverse start order (router, nodes,
//! NATS, etcd) and only then takes down what the drills set up around them (the partition's
//! namespace, the tmpfs), since fields drop in declaration order.

use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use tandem_cluster::{Discovery, EtcdScaleStore, Role};

use super::procs::{Interrupt, Procs};
use super::{http_get_ok, isolate, pools};

/// A running local cluster: processes in start order, stopped in reverse order on drop.
pub struct Cluster {
    pub(super) procs: Procs,
    /// Where its data and logs are.
    pub run_dir: PathBuf,
    /// etcd client URL.
    pub etcd_url: String,
    /// NATS URL.
    pub nats_url: String,
    /// Prometheus's URL (with `--prometheus`).
    pub prometheus_url: Option<String>,
    /// The planner's metrics URL (with `--autoscale`).
    pub planner_metrics_url: Option<String>,
    /// The router's HTTP address.
    pub router_http: SocketAddr,
    pub(super) pools: Option<pools::Pools>,
    pub(super) control: Option<(std::sync::Arc<dyn Discovery>, EtcdScaleStore)>,
    /// Where etcd and NATS listen (127.0.0.1, or the veth address with an isolated node).
    pub(super) control_host: std::net::Ipv4Addr,
    // Dropped after `procs` (fields drop in order): taken down once every process has stopped.
    pub(super) partition: Option<isolate::NetPartition>,
    pub(super) etcd_disk: Option<isolate::SmallDisk>,
}

impl Cluster {
    /// Stops in reverse start order: router, prefill, decode, NATS, etcd. Dropping the cluster
    /// does the same.
    pub fn shutdown(&mut self) {
        self.procs.shutdown();
    }

    /// Serves until `interrupt` fires, keeping each pool at its target (see [`pools`]).
    pub fn serve(&mut self, rt: &tokio::runtime::Runtime, interrupt: &Interrupt) {
        while !interrupt.fired() {
            if let (Some(pools), Some((discovery, store))) = (self.pools.as_mut(), &self.control) {
                pools.reconcile(&mut self.procs, rt, store, discovery);
            }
            std::thread::sleep(pools::RECONCILE_PERIOD);
        }
    }

    /// Sends `signal` to the child named `name`; fails if none by that name runs.
    pub fn signal(&mut self, name: &str, signal: i32) -> anyhow::Result<()> {
        anyhow::ensure!(self.procs.running(name), "no running process named {name}");
        self.procs.signal(name, signal);
        Ok(())
    }

    /// Starts the child named `name` again with its original command line (it must have
    /// exited or been killed) and waits until it serves: etcd and NATS accept connections, the
    /// router answers `/health`, a node is registered again.
    pub fn restart(
        &mut self,
        name: &str,
        rt: &tokio::runtime::Runtime,
        interrupt: &Interrupt,
    ) -> anyhow::Result<()> {
        self.procs.restart(name)?;
        let port_of = |url: &str| url.rsplit(':').next().and_then(|p| p.parse::<u16>().ok());
        let deadline = Instant::now() + Duration::from_secs(60);
        let what = format!("{name} to serve again");
        match name {
            "etcd" | "nats" => {
                let url = if name == "etcd" {
                    &self.etcd_url
                } else {
                    &self.nats_url
                };
                let port = port_of(url).with_context(|| format!("no port in {url}"))?;
                let host = self.control_host;
                self.procs.wait_until(&what, deadline, interrupt, || {
                    TcpStream::connect((host, port)).is_ok()
                })
            }
            "router" => {
                let http = self.router_http;
                self.procs
                    .wait_until(&what, deadline, interrupt, || http_get_ok(http, "/health"))
            }
            node => {
                let discovery = self.control.as_ref().map(|(d, _)| d.clone());
                self.procs.wait_until(&what, deadline, interrupt, || {
                    discovery.as_ref().is_some_and(|d| {
                        [Role::Prefill, Role::Decode]
                            .iter()
                            .any(|&r| rt.block_on(d.list(r)).is_ok_and(|v| v.contains_key(node)))
                    })
                })
            }
        }
    }

    /// Whether the child named `name` runs.
    pub fn running(&mut self, name: &str) -> bool {
        self.procs.running(name)
    }

    /// Cuts the node `name` off the network (`true`) or joins it again; it must have been
    /// started in its own namespace (`UpArgs::isolate_node`).
    pub fn partition(&mut self, name: &str, cut: bool) -> anyhow::Result<()> {
        match &self.partition {
            Some(p) if p.node == name => p.set_cut(cut),
            _ => bail!("{name} was not started in its own network namespace"),
        }
    }

    /// Fills (`true`: returns the bytes written) or frees the small disk under `name`'s data
    /// (etcd's, with `UpArgs::etcd_disk_mib`).
    pub fn fill_disk(&mut self, name: &str, full: bool) -> anyhow::Result<u64> {
        match (&self.etcd_disk, name) {
            (Some(d), "etcd") if full => d.fill(),
            (Some(d), "etcd") => d.free().map(|()| 0),
            _ => bail!("{name} has no size-limited disk"),
        }
    }

    /// Every registered node's `(id, metrics URL)`.
    pub fn node_metrics_urls(
        &self,
        rt: &tokio::runtime::Runtime,
    ) -> anyhow::Result<Vec<(String, String)>> {
        let (discovery, _) = self
            .control
            .as_ref()
            .context("the cluster has no control plane")?;
        let mut out = Vec::new();
        for role in [Role::Prefill, Role::Decode] {
            for (id, info) in rt.block_on(discovery.list(role))? {
                out.push((id, info.metrics_url));
            }
        }
        Ok(out)
    }

    /// Stops the cluster, then lists every process it ever started (restarts included) that
    /// still runs, as `name pid`.
    pub fn shutdown_and_list_leftovers(&mut self) -> Vec<String> {
        self.procs.shutdown();
        self.procs.leftovers()
    }

    /// `(name, pid)` of every running child, in start order.
    pub fn pids(&self) -> Vec<(String, u32)> {
        self.procs
            .iter()
            .map(|p| (p.name.clone(), p.pid()))
            .collect()
    }
}
