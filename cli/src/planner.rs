//! `tandem planner`: sizes the prefill and decode pools from their load signals (see the
//! `tandem-planner` crate). It reads membership from etcd and load reports from NATS, decides
//! every `interval_ms`, logs each decision with its inputs, publishes it on
//! `tandem.{cluster}.planner.decisions` and, while it leads the etcd election, writes the
//! pools' desired sizes to etcd for an executor to apply: `tandem up`'s reconciler on one
//! machine, or, with `--executor kubernetes`, this process itself, patching the pools'
//! Deployments' `/scale` to follow the targets in etcd (see deploy/k8s/README.md).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, ValueEnum};
use tandem_cluster::{Discovery, LoadSignals, NatsConfig, NatsLoadSignals, ScaleStore};
use tandem_planner::{
    DecisionRecord, DecisionSink, KubeExecutor, KubeExecutorConfig, NatsDecisionSink, Observer,
    Planner, PlannerConfig, PlannerMetrics, StoreActuator,
};
use tokio_util::sync::CancellationToken;

/// Who applies the desired sizes the planner writes to etcd.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum ExecutorKind {
    /// Nobody in this process: the sizes stay in etcd for `tandem up`'s reconciler.
    #[default]
    None,
    /// Patch the pools' Deployments (`/scale`) to the sizes in etcd (in-cluster credentials).
    Kubernetes,
}

/// Flags of `tandem planner`.
#[derive(Args, Debug, Clone)]
pub struct PlannerArgs {
    #[command(flatten)]
    pub target: crate::control::ClusterTarget,
    /// NATS URL (load reports in, decisions out).
    #[arg(long, env = "TANDEM_NATS_URL", required = true)]
    pub nats_url: String,
    /// SLOs, watermarks and per-pool bounds (TOML; unknown keys and impossible values are
    /// refused, naming the field). Default: TTFT p90 2 s, ITL p90 100 ms, pools 1..4.
    #[arg(long)]
    pub slo_file: Option<PathBuf>,
    /// A prefill node's throughput profile: `tandem bench-engine --format json` output run on
    /// the nodes' hardware and config; its `prefill_tok_s` becomes `prefill_tokens_per_s`
    /// (otherwise the SLO file's value, or the best the nodes have reported).
    #[arg(long)]
    pub profile: Option<PathBuf>,
    /// Decide, log and publish, but never apply (and do not take part in the election).
    #[arg(long)]
    pub dry_run: bool,
    /// With --dry-run: observe for a second, decide once, print the pools and what would be
    /// done, and exit (a preview of an SLO file, or a look at the pools).
    #[arg(long, requires = "dry_run")]
    pub once: bool,
    /// This planner's id in the election and in its decisions (default: planner-<pid>).
    #[arg(long)]
    pub id: Option<String>,
    /// Lease of the election: a leader that cannot renew stops acting within this.
    #[arg(long, default_value_t = 5)]
    pub lease_ttl_secs: u64,
    /// Load reports older than this are ignored.
    #[arg(long, default_value_t = 3000)]
    pub report_max_age_ms: u64,
    /// Serve the planner's Prometheus metrics here (`GET /metrics`).
    #[arg(long)]
    pub metrics_addr: Option<SocketAddr>,
    /// Who applies the sizes: `none` (they stay in etcd, for `tandem up`), or `kubernetes`
    /// (patch the pools' Deployments to follow them; needs `get`/`patch` on deployments/scale).
    #[arg(long, env = "TANDEM_PLANNER_EXECUTOR", value_enum, default_value_t = ExecutorKind::None)]
    pub executor: ExecutorKind,
    /// With --executor kubernetes: the pools' namespace (default: the planner's own, from its
    /// service account).
    #[arg(long, env = "TANDEM_KUBE_NAMESPACE")]
    pub namespace: Option<String>,
    /// With --executor kubernetes: the prefill pool's Deployment.
    #[arg(
        long,
        env = "TANDEM_PREFILL_DEPLOYMENT",
        default_value = "tandem-prefill"
    )]
    pub prefill_deployment: String,
    /// With --executor kubernetes: the decode pool's Deployment.
    #[arg(
        long,
        env = "TANDEM_DECODE_DEPLOYMENT",
        default_value = "tandem-decode"
    )]
    pub decode_deployment: String,
}

impl PlannerArgs {
    /// The Kubernetes executor's settings (`namespace` when --namespace is not given).
    pub fn kube_config(&self, namespace: &str) -> KubeExecutorConfig {
        KubeExecutorConfig {
            prefill_deployment: self.prefill_deployment.clone(),
            decode_deployment: self.decode_deployment.clone(),
            ..KubeExecutorConfig::new(self.namespace.as_deref().unwrap_or(namespace))
        }
    }
}

/// Prints every decision as one JSON line on stdout.
struct StdoutSink;

#[async_trait::async_trait]
impl DecisionSink for StdoutSink {
    async fn publish(&self, record: &DecisionRecord) {
        if let Ok(line) = serde_json::to_string(record) {
            println!("{line}");
        }
    }
}

/// The pools as observed, one line each.
fn describe(obs: &tandem_planner::Observation) -> String {
    let mut out = String::from(
        "pool     desired  serving  reporting  pending_prompt_tokens  tokens_per_s  kv_use\n",
    );
    for (name, p) in [("prefill", &obs.prefill), ("decode", &obs.decode)] {
        let pending: u64 = p.nodes.iter().map(|n| n.pending_prompt_tokens).sum();
        let tps: f64 = p.nodes.iter().map(|n| n.tokens_per_s).sum();
        let (free, total) = p.nodes.iter().fold((0u64, 0u64), |(f, t), n| {
            (f + n.free_blocks, t + n.total_blocks)
        });
        let kv = if total == 0 {
            0.0
        } else {
            100.0 * (total - free) as f64 / total as f64
        };
        out += &format!(
            "{name:<8} {:>7}  {:>7}  {:>9}  {pending:>21}  {tps:>12.0}  {kv:>5.1}%\n",
            p.desired,
            p.serving,
            p.nodes.len()
        );
    }
    out.trim_end().to_string()
}

/// `prefill_tok_s` of a `tandem bench-engine --format json` file.
pub fn profile_tokens_per_s(path: &std::path::Path) -> anyhow::Result<f64> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("--profile {}", path.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text).with_context(|| {
        format!(
            "--profile {}: not `tandem bench-engine --format json` output",
            path.display()
        )
    })?;
    match v["prefill_tok_s"].as_f64() {
        Some(t) if t.is_finite() && t > 0.0 => Ok(t),
        _ => anyhow::bail!("--profile {}: no positive `prefill_tok_s`", path.display()),
    }
}

/// Checks the SLO file (refused at start, naming the field) and the flags.
pub fn load_config(args: &PlannerArgs) -> anyhow::Result<PlannerConfig> {
    let mut config = match &args.slo_file {
        Some(p) => PlannerConfig::from_file(p)?,
        None => PlannerConfig::default(),
    };
    if let Some(p) = &args.profile {
        config.prefill_tokens_per_s = profile_tokens_per_s(p)?;
    }
    anyhow::ensure!(
        args.lease_ttl_secs >= 2,
        "--lease-ttl-secs must be at least 2 (etcd's minimum)"
    );
    if args.executor == ExecutorKind::Kubernetes {
        anyhow::ensure!(
            !args.dry_run,
            "--dry-run applies nothing: it cannot run --executor kubernetes"
        );
        // Names refused before anything connects ("default" stands in for an inferred namespace).
        args.kube_config("default").validate()?;
    }
    Ok(config)
}

/// Runs `tandem planner` until SIGINT/SIGTERM.
pub fn run(args: &PlannerArgs) -> anyhow::Result<()> {
    let config = load_config(args)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let id = args.id.clone().unwrap_or_else(|| format!("planner-{}", std::process::id()));
        let discovery = args.target.discovery().await?;
        let nats = NatsLoadSignals::connect(NatsConfig::new(args.nats_url.clone(), args.target.cluster.clone()))
            .await
            .with_context(|| format!("connecting to NATS at {}", args.nats_url))?;
        let store: Arc<dyn ScaleStore> = Arc::new(discovery.scale_store());
        let observer = Observer::connect(
            &discovery as &dyn Discovery,
            &nats as &dyn LoadSignals,
            store.clone(),
            Duration::from_millis(args.report_max_age_ms),
        )
        .await?;
        let metrics = PlannerMetrics::default();
        let server = match args.metrics_addr {
            Some(addr) => {
                let listener = tokio::net::TcpListener::bind(addr)
                    .await
                    .with_context(|| format!("binding --metrics-addr {addr}"))?;
                let m = metrics.clone();
                let s = tandem_telemetry::metrics::MetricsServer::spawn(
                    listener,
                    Arc::new(move || m.render()),
                )?;
                eprintln!("tandem planner: metrics on http://{}/metrics", s.addr());
                Some(s)
            }
            None => None,
        };
        let subject = discovery.keys().planner_decisions_subject();
        let mut sinks: Vec<Arc<dyn DecisionSink>> =
            vec![Arc::new(NatsDecisionSink::new(nats.client().clone(), subject.clone()))];
        if args.dry_run {
            sinks.push(Arc::new(StdoutSink));
        }
        eprintln!(
            "tandem planner {id}: cluster `{}`, decisions on {subject}{}; SLOs: TTFT p90 {} ms, ITL p90 {} ms; prefill {}..{}, decode {}..{}",
            args.target.cluster,
            if args.dry_run { " (dry run: nothing is applied)" } else { "" },
            config.ttft_p90_slo_ms,
            config.itl_p90_slo_ms,
            config.prefill.min,
            config.prefill.max,
            config.decode.min,
            config.decode.max,
        );
        let planner = Planner {
            id,
            config,
            dry_run: args.dry_run,
            observer,
            actuator: Arc::new(StoreActuator(store.clone())),
            election: Arc::new(discovery.election(Duration::from_secs(args.lease_ttl_secs))),
            sinks,
            metrics,
        };
        if args.once {
            // Subscriptions see reports sent from now on: wait a few report periods.
            tokio::time::sleep(Duration::from_millis(1200)).await;
            let obs = planner.observer.observe().await?;
            println!("{}", describe(&obs));
            let records = planner
                .round(&mut tandem_planner::PlannerMemory::default(), &mut Vec::new(), None)
                .await;
            if records.is_empty() {
                println!("no change: both pools are sized for their load");
            }
            return Ok(());
        }
        let cancel = CancellationToken::new();
        let executor = match args.executor {
            ExecutorKind::None => None,
            ExecutorKind::Kubernetes => {
                let kube = tandem_planner::kube::infer_kube_config().await?;
                let config = args.kube_config(&kube.default_namespace);
                eprintln!(
                    "tandem planner: kubernetes executor: deployments {} and {} in namespace {}",
                    config.prefill_deployment, config.decode_deployment, config.namespace
                );
                let executor = KubeExecutor::new(kube, store.clone(), config, planner.metrics.clone())?;
                Some(tokio::spawn(executor.run(cancel.clone())))
            }
        };
        let stop = cancel.clone();
        tokio::spawn(async move {
            let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                .expect("SIGTERM handler");
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            stop.cancel();
        });
        let result = planner.run(cancel.clone()).await;
        // The executor follows etcd, not the planner; it stops with it all the same.
        cancel.cancel();
        if let Some(e) = executor {
            let _ = e.await;
        }
        result?;
        if let Some(s) = server {
            s.stop().await;
        }
        Ok(())
    })
}

#[cfg(test)]
mod profile_tests {
    use super::profile_tokens_per_s;

    #[test]
    fn a_bench_engine_profile_gives_the_prefill_throughput_and_anything_else_is_refused() {
        let dir = std::env::temp_dir().join(format!("tandem-profile-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = dir.join("good.json");
        std::fs::write(
            &good,
            r#"{"prefill_tok_s": 566.5, "decode_tok_s": {"1": 68.4}}"#,
        )
        .unwrap();
        assert_eq!(profile_tokens_per_s(&good).unwrap(), 566.5);
        for (name, text) in [
            ("zero.json", r#"{"prefill_tok_s": 0}"#),
            ("other.json", "[1, 2]"),
            ("bad.json", "{"),
        ] {
            let p = dir.join(name);
            std::fs::write(&p, text).unwrap();
            let e = format!("{:#}", profile_tokens_per_s(&p).unwrap_err());
            assert!(e.contains("--profile"), "{e}");
        }
        assert!(profile_tokens_per_s(&dir.join("missing.json")).is_err());
    }
}
