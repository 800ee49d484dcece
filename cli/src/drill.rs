//! `tandem drill NAME… | --all`: failover drills, each on a fresh local cluster (`tandem up`'s,
//! in this process: 2 prefill + 2 decode nodes by default), printed as a table or JSON.
//!
//! Each drill's cluster is stopped before the next starts, and the row counts any process it
//! left running. SIGINT/SIGTERM end the drill at its next step and stop its cluster; the exit
//! status is non-zero when a drill could not run or missed its target.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Args;
use tandem_chaos_tests::{
    ClusterHandle, Drill, DrillError, DrillOptions, NodeEndpoint, Row, Setup, Signal,
};

use crate::up::{self, Interrupt, UpArgs};

/// Flags of `tandem drill`.
#[derive(Args, Debug, Clone)]
pub struct DrillArgs {
    /// The drills to run, by name (`--list` shows them).
    pub names: Vec<String>,
    /// Run every drill.
    #[arg(long, conflicts_with = "names")]
    pub all: bool,
    /// List the drills and what each proves, then exit.
    #[arg(long)]
    pub list: bool,
    /// Short form (what the test suite runs): every wait of a fault at 30 % of its full length,
    /// less load before and after it.
    #[arg(long)]
    pub short: bool,
    /// Output: an aligned table, or JSON (one object per drill).
    #[arg(long, default_value = "table", value_parser = ["table", "json"])]
    pub format: String,
    /// Requests started per second during a drill (an open loop).
    #[arg(long, default_value_t = 1.0)]
    pub rate: f64,
    /// Tokens per request.
    #[arg(long, default_value_t = 24)]
    pub max_tokens: u32,
    /// Prefill nodes in each drill's cluster (at least 2: a killed one needs a peer).
    #[arg(long, default_value_t = 2)]
    pub prefill: usize,
    /// Decode nodes in each drill's cluster (at least 2).
    #[arg(long, default_value_t = 2)]
    pub decode: usize,
    /// Model for the nodes and the router (default: SmolLM2-135M-Instruct, fetched on first use).
    #[arg(long, env = "TANDEM_MODEL")]
    pub model: Option<PathBuf>,
    /// Where each drill's cluster keeps data and logs (`<dir>/<drill>`; default
    /// .tandem/run/drill-<unix time>).
    #[arg(long)]
    pub run_dir: Option<PathBuf>,
    /// Extra flags for every node (after `--`), as for `tandem up`.
    #[arg(last = true)]
    pub node_args: Vec<String>,
}

/// The nodes' lease TTL, from `--lease-ttl-secs` among the node flags or the nodes' default.
fn lease_ttl(node_args: &[String]) -> Duration {
    let mut value = None;
    for (i, a) in node_args.iter().enumerate() {
        if a == "--lease-ttl-secs" {
            value = node_args.get(i + 1).map(String::as_str);
        } else if let Some(v) = a.strip_prefix("--lease-ttl-secs=") {
            value = Some(v);
        }
    }
    value
        .and_then(|v| v.parse().ok())
        .map_or(Duration::from_secs(10), Duration::from_secs)
}

fn free_addr() -> anyhow::Result<SocketAddr> {
    Ok(crate::ports::free_loopback_addr()?)
}

/// A `tandem up` cluster as the drills see it.
struct UpCluster<'a> {
    cluster: up::Cluster,
    rt: &'a tokio::runtime::Runtime,
    interrupt: &'a Interrupt,
    lease_ttl: Duration,
}

impl ClusterHandle for UpCluster<'_> {
    fn http_addr(&self) -> SocketAddr {
        self.cluster.router_http
    }

    fn nodes(&self) -> Result<Vec<NodeEndpoint>, String> {
        let urls = self
            .cluster
            .node_metrics_urls(self.rt)
            .map_err(|e| format!("{e:#}"))?;
        Ok(urls
            .into_iter()
            .map(|(name, metrics_url)| NodeEndpoint { name, metrics_url })
            .collect())
    }

    fn lease_ttl(&self) -> Duration {
        self.lease_ttl
    }

    fn signal(&mut self, name: &str, signal: Signal) -> Result<(), String> {
        let sig = match signal {
            Signal::Kill => libc::SIGKILL,
            Signal::Term => libc::SIGTERM,
            Signal::Stop => libc::SIGSTOP,
            Signal::Cont => libc::SIGCONT,
            Signal::Usr1 => libc::SIGUSR1,
        };
        self.cluster.signal(name, sig).map_err(|e| format!("{e:#}"))
    }

    fn restart(&mut self, name: &str) -> Result<(), String> {
        self.cluster
            .restart(name, self.rt, self.interrupt)
            .map_err(|e| format!("{e:#}"))
    }

    fn running(&mut self, name: &str) -> bool {
        self.cluster.running(name)
    }

    fn partition(&mut self, name: &str, cut: bool) -> Result<(), String> {
        self.cluster
            .partition(name, cut)
            .map_err(|e| format!("{e:#}"))
    }

    fn fill_disk(&mut self, name: &str, full: bool) -> Result<u64, String> {
        self.cluster
            .fill_disk(name, full)
            .map_err(|e| format!("{e:#}"))
    }

    fn interrupted(&self) -> bool {
        self.interrupt.fired()
    }

    fn stop_and_list_leftovers(&mut self) -> Vec<String> {
        self.cluster.shutdown_and_list_leftovers()
    }
}

/// Runs `tandem drill`: prints the table (or JSON) and fails if any drill missed its target.
pub fn run(args: &DrillArgs) -> anyhow::Result<()> {
    if args.list {
        for d in Drill::all() {
            println!("{:<17} {}", d.name, d.proves);
        }
        return Ok(());
    }
    let drills: Vec<Drill> = if args.all {
        Drill::all()
    } else if args.names.is_empty() {
        bail!(
            "name the drills to run, or --all; the drills are: {}",
            Drill::all()
                .iter()
                .map(|d| d.name)
                .collect::<Vec<_>>()
                .join(", ")
        );
    } else {
        args.names
            .iter()
            .map(|n| Drill::by_name(n))
            .collect::<Result<_, _>>()?
    };
    // KV-transfer drills need a fault-injection build: named ones are refused up front; `--all`
    // runs the rest and fails at the end, naming what it could not run.
    let needs_build = |d: &Drill| d.kv_fault.is_some() && !tandem_prefill_node::FAULT_INJECTION;
    let how = "they inject KV-transfer faults, which this build of tandem cannot (no `fault-injection` feature, as in every default build); build one with\n    cargo build --release -p tandem-cli --features fault-injection";
    let mut errors = Vec::new();
    let skipped: Vec<&str> = drills
        .iter()
        .filter(|d| needs_build(d))
        .map(|d| d.name)
        .collect();
    if !skipped.is_empty() {
        if !args.all {
            bail!("drill(s) {}: {how}", skipped.join(", "));
        }
        eprintln!("tandem drill: skipping {}: {how}", skipped.join(", "));
        errors.push(format!("{}: not run ({how})", skipped.join(", ")));
    }
    let drills: Vec<Drill> = drills.into_iter().filter(|d| !needs_build(d)).collect();
    // The partition and full-disk drills need root; without it they fail up front, never pass.
    let not_permitted: Vec<(&str, String)> = drills
        .iter()
        .filter(|d| d.setup.is_some())
        .filter_map(|d| {
            up::isolate::missing_privilege(&format!("drill {}", d.name)).map(|w| (d.name, w))
        })
        .collect();
    if !not_permitted.is_empty() {
        let names: Vec<&str> = not_permitted.iter().map(|(n, _)| *n).collect();
        let why = &not_permitted[0].1;
        if !args.all {
            return Err(DrillError::NotPermitted {
                drill: names.join(", "),
                reason: why.clone(),
            }
            .into());
        }
        eprintln!("tandem drill: skipping {}: {why}", names.join(", "));
        errors.push(format!("{}: not run ({why})", names.join(", ")));
    }
    let drills: Vec<Drill> = drills
        .into_iter()
        .filter(|d| !not_permitted.iter().any(|(n, _)| *n == d.name))
        .collect();
    anyhow::ensure!(
        args.prefill >= 2 && args.decode >= 2,
        "--prefill and --decode must each be at least 2 (a drill kills one node of a pool)"
    );
    anyhow::ensure!(
        args.rate > 0.0 && args.rate.is_finite(),
        "--rate must be a positive number of requests per second"
    );
    anyhow::ensure!(args.max_tokens > 0, "--max-tokens must be at least 1");
    let (scale, margin_s) = if args.short { (0.3, 6.0) } else { (1.0, 10.0) };
    let opts = DrillOptions {
        rate_per_s: args.rate,
        max_tokens: args.max_tokens,
        margin_s,
    };
    let base = match &args.run_dir {
        Some(d) => d.clone(),
        None => PathBuf::from(".tandem/run").join(format!(
            "drill-{}",
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)?
                .as_secs()
        )),
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let interrupt = Interrupt::install(&rt)?;
    let mut rows: Vec<Row> = Vec::new();
    for drill in drills {
        let drill = drill.scaled(scale);
        if interrupt.fired() {
            return Err(interrupt.error());
        }
        eprintln!("tandem drill: {} — {}", drill.name, drill.proves);
        let up_args = UpArgs {
            prefill: args.prefill,
            decode: args.decode,
            grpc: free_addr()?,
            http: free_addr()?,
            run_dir: Some(base.join(drill.name)),
            model: args.model.clone(),
            no_sample: true,
            cluster: format!("drill-{}", drill.name),
            node_args: args.node_args.clone(),
            // The prefill nodes start with the drill's KV fault switched off; SIGUSR1 flips it.
            env: drill
                .kv_fault
                .map(|spec| {
                    vec![
                        ("TANDEM_KV_FAULT".to_string(), spec.to_string()),
                        ("TANDEM_KV_FAULT_ON_SIGUSR1".to_string(), "true".to_string()),
                    ]
                })
                .unwrap_or_default(),
            isolate_node: match drill.setup {
                Some(Setup::OwnNetns(node)) => Some(node.to_string()),
                _ => None,
            },
            etcd_disk_mib: match drill.setup {
                Some(Setup::SmallEtcdDisk { mib }) => Some(mib),
                _ => None,
            },
            // Every prompt crosses from a prefill node to a decode node, so the faults on
            // that path (KV cut, corrupt, delayed, prefill nodes killed) meet every request;
            // with conditional disaggregation the mix's short prompts would never cross.
            disaggregation: Some(tandem_router::routing::DisaggregationMode::Always),
            ..UpArgs::defaults()
        };
        let cluster = up::start(&up_args, &rt, &interrupt)
            .with_context(|| format!("starting the cluster for drill {}", drill.name))?;
        let mut handle = UpCluster {
            cluster,
            rt: &rt,
            interrupt: &interrupt,
            lease_ttl: lease_ttl(&args.node_args),
        };
        match tandem_chaos_tests::run_drill(&mut handle, &rt, &drill, &opts) {
            Ok(row) => {
                eprintln!(
                    "tandem drill: {}: {}",
                    drill.name,
                    if row.target_met {
                        "target met"
                    } else {
                        "target MISSED"
                    }
                );
                rows.push(row);
            }
            Err(e) => {
                eprintln!("tandem drill: {}: {e}", drill.name);
                errors.push(format!("{}: {e}", drill.name));
            }
        }
        // The handle's cluster stops here if the drill did not get to stop it.
        drop(handle);
    }
    match args.format.as_str() {
        "json" => println!("{}", serde_json::to_string_pretty(&rows)?),
        _ => print!("{}", tandem_chaos_tests::table(&rows)),
    }
    let missed: Vec<&str> = rows
        .iter()
        .filter(|r| !r.target_met)
        .map(|r| r.drill.as_str())
        .collect();
    if !errors.is_empty() {
        bail!("drill(s) that could not run: {}", errors.join("; "));
    }
    if !missed.is_empty() {
        bail!("drill(s) that missed the target: {}", missed.join(", "));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lease_ttl_comes_from_the_node_flags_or_the_default() {
        let v = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(lease_ttl(&[]), Duration::from_secs(10));
        assert_eq!(
            lease_ttl(&v(&["--lease-ttl-secs", "4"])),
            Duration::from_secs(4)
        );
        assert_eq!(
            lease_ttl(&v(&["--x", "--lease-ttl-secs=6"])),
            Duration::from_secs(6)
        );
    }
}
