//! `tandem up`: a whole local cluster from one command: etcd and NATS (the installed `etcd` and
//! `nats-server` binaries, data under the run directory), `--decode M` decode nodes, `--prefill N`
//! prefill nodes and a router, each a child process of this one (`tandem decode|prefill|router`)
//! logging to `<run-dir>/logs/<name>.log`. It waits until every node has registered and the
//! router answers a real generation (streamed to stdout), prints the endpoints, and on Ctrl-C /
//! SIGTERM shuts everything down in order: router (stop new work), prefill and decode nodes
//! (each drains and deregisters), then NATS and etcd.
//!
//! No child outlives `tandem up`, however it ends (a signal during startup or the sample request,
//! an error, even SIGKILL): see [`procs`].

use std::io::{BufRead, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;
mod cluster;
pub mod isolate;
mod pools;
mod procs;
mod sample;
pub mod prometheus;
pub use cluster::Cluster;
pub use procs::Interrupt;
use procs::Procs;

use tandem_cluster::{
    Discovery, EtcdConfig, EtcdDiscovery, PoolBounds, Role, ScaleLimits, ScaleStore,
};

/// Flags of `tandem up`.
#[derive(Args, Debug, Clone)]
pub struct UpArgs {
    /// Prefill nodes to start.
    #[arg(long, default_value_t = 1)]
    pub prefill: usize,
    /// Decode nodes to start.
    #[arg(long, default_value_t = 1)]
    pub decode: usize,
    /// Router gRPC address (the `Inference` service for API gateways).
    #[arg(long, default_value = "127.0.0.1:50051")]
    pub grpc: SocketAddr,
    /// Router HTTP address (OpenAI-compatible API).
    #[arg(long, default_value = "127.0.0.1:8000")]
    pub http: SocketAddr,
    /// Where data and logs go (default: .tandem/run/<unix time> under the current directory).
    #[arg(long)]
    pub run_dir: Option<PathBuf>,
    /// Cluster name (the etcd key and NATS subject prefix).
    #[arg(long, default_value = "local")]
    pub cluster: String,
    /// Model for every node and the router (default: SmolLM2-135M-Instruct, fetched on first use).
    #[arg(long, env = "TANDEM_MODEL")]
    pub model: Option<PathBuf>,
    /// Where the nodes' forward runs: `cpu`, or `cuda[:N]` for every node on that GPU (each
    /// node's KV is in device memory, sized by `--kv-cache-gb` in the node arguments after
    /// `--`; the nodes pass KV device to device by CUDA IPC unless `--no-cuda-ipc`). Checked
    /// before anything starts.
    #[arg(long, env = "TANDEM_DEVICE", default_value = "cpu")]
    pub device: tandem_engine::Device,
    /// With `--device cuda`: stage KV through host memory even between the nodes on the GPU
    /// (the path KV takes between machines). By default they pass it device to device by CUDA
    /// IPC (`--kv-cuda-ipc` on each node).
    #[arg(long)]
    pub no_cuda_ipc: bool,
    /// The etcd binary (Debian package `etcd-server`).
    #[arg(long, default_value = "etcd")]
    pub etcd_bin: String,
    /// The NATS server binary (Debian package `nats-server`).
    #[arg(long, default_value = "nats-server")]
    pub nats_bin: String,
    /// The sample chat message streamed once the cluster is up.
    #[arg(
        long,
        default_value = "In two sentences: why serve prefill and decode on separate machines?"
    )]
    pub prompt: String,
    /// Tokens of the sample answer.
    #[arg(long, default_value_t = 96)]
    pub max_tokens: u32,
    /// Skip the sample request (readiness still waits for every node to register).
    #[arg(long)]
    pub no_sample: bool,
    /// Shut the cluster down after the sample answer instead of serving until Ctrl-C.
    #[arg(long)]
    pub exit_after_sample: bool,
    /// How long startup may take.
    #[arg(long, default_value_t = 180)]
    pub ready_timeout_secs: u64,
    /// API keys for the router (a TOML file of `[[key]] id, key or sha256, admin`): requests
    /// are counted per key id (`tandem usage`). The sample request uses the file's first
    /// admin key given as `key = "..."`.
    #[arg(long)]
    pub api_keys_file: Option<PathBuf>,
    /// The cost of a node-hour per pool for the router (`tandem cost` prices usage with it).
    #[arg(long)]
    pub cost_file: Option<PathBuf>,
    /// How the router chooses prefill nodes (`tandem router --prefill-policy`): prefix-aware,
    /// least-loaded, round-robin, power-of-two [default: the router's, prefix-aware].
    #[arg(long, value_enum)]
    pub prefill_policy: Option<tandem_router::routing::PrefillPolicy>,
    /// Whether the router lets decode nodes compute short prompts themselves
    /// (`tandem router --disaggregation`): conditional or always [default: the router's,
    /// conditional].
    #[arg(long, value_enum)]
    pub disaggregation: Option<tandem_router::routing::DisaggregationMode>,
    /// With conditional disaggregation, the longest prompt the decode node computes itself
    /// (`tandem router --local-prefill-max-tokens`) [default: the router's].
    #[arg(long)]
    pub local_prefill_max_tokens: Option<u32>,
    /// Start a real Prometheus (Debian `prometheus`) that scrapes every process of the cluster
    /// (targets kept current from etcd) and loads deploy/observability's alert rules.
    #[arg(long)]
    pub prometheus: bool,
    /// Prometheus's listen address (with --prometheus).
    #[arg(long, default_value = "127.0.0.1:9090")]
    pub prometheus_addr: SocketAddr,
    /// The Prometheus binary (Debian package `prometheus`).
    #[arg(long, default_value = "prometheus")]
    pub prometheus_bin: String,
    /// Run `tandem planner` beside the cluster: it sizes each pool from its load signals
    /// (within --min-*/--max-*), and this process starts and drains nodes to match.
    #[arg(long)]
    pub autoscale: bool,
    /// The planner's SLO file (with --autoscale): see `tandem planner --help`.
    #[arg(long)]
    pub slo_file: Option<PathBuf>,
    /// Fewest prefill nodes the pool may be scaled to (planner or `tandem scale`).
    #[arg(long, default_value_t = 1)]
    pub min_prefill: usize,
    /// Most prefill nodes (default: 4, or --prefill if larger).
    #[arg(long)]
    pub max_prefill: Option<usize>,
    /// Fewest decode nodes.
    #[arg(long, default_value_t = 1)]
    pub min_decode: usize,
    /// Most decode nodes (default: 4, or --decode if larger).
    #[arg(long)]
    pub max_decode: Option<usize>,
    /// Trace export for every process started (`--otlp-endpoint URL` is handed to each).
    #[command(flatten)]
    pub trace: tandem_telemetry::TraceArgs,
    /// Threads of each node's compute kernels (the caller included). Default: the cores this
    /// process may use (its CPU affinity and cgroup quota). With a client or another service on
    /// the same small machine, leave a core for it (`--threads $(( $(nproc) - 1 ))`); the
    /// kernels also run a job on one thread when the others keep losing their cores.
    #[arg(long, env = "TANDEM_THREADS", value_parser = clap::value_parser!(u32).range(1..))]
    pub threads: Option<u32>,
    /// Extra flags given to every prefill and decode node (after `--`), e.g. `-- --kv-cache-gb 0.5`.
    #[arg(last = true)]
    pub node_args: Vec<String>,
    /// Extra environment for every process started (programs that embed `tandem up`, e.g. the
    /// drills' fault switch; not a flag).
    #[arg(skip)]
    pub env: Vec<(String, String)>,
    /// Runs this node (`decode-0`) in its own network namespace, so that a drill can cut it off
    /// (root only; etcd and NATS then listen on the veth pair's host address; not a flag).
    #[arg(skip)]
    pub isolate_node: Option<String>,
    /// Puts etcd's data directory on a tmpfs of this many MiB, so that a drill can fill it
    /// (root only; not a flag).
    #[arg(skip)]
    pub etcd_disk_mib: Option<u64>,
}

impl UpArgs {
    /// Every flag at its default (as `tandem up` with no flags), for programs that start a
    /// cluster in-process (the benchmarks) and set what they need.
    pub fn defaults() -> UpArgs {
        #[derive(clap::Parser)]
        struct Wrapper {
            #[command(flatten)]
            up: UpArgs,
        }
        <Wrapper as clap::Parser>::parse_from(["tandem-up"]).up
    }
}

fn free_port() -> anyhow::Result<u16> {
    Ok(crate::ports::free_loopback_addr()?.port())
}

fn which(bin: &str) -> Option<PathBuf> {
    if bin.contains('/') {
        return Path::new(bin).exists().then(|| bin.into());
    }
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|d| Path::new(d).join(bin))
        .find(|p| p.exists())
}

/// Starts the cluster `args` describe and waits until every node is registered and the router
/// is healthy. A signal `interrupt` catches ends the wait with an error, and every child
/// started so far is stopped (as on any error).
pub fn start(
    args: &UpArgs,
    rt: &tokio::runtime::Runtime,
    interrupt: &Interrupt,
) -> anyhow::Result<Cluster> {
    // A missing driver or device is said here, before any process starts.
    args.device.check()?;
    anyhow::ensure!(
        args.prefill > 0 && args.decode > 0,
        "--prefill and --decode must each be at least 1"
    );
    let limits = pool_limits(args)?;
    let (Some(etcd), Some(nats)) = (which(&args.etcd_bin), which(&args.nats_bin)) else {
        bail!(
            "tandem up needs `{}` and `{}` on PATH. Install them with:\n    sudo apt-get install etcd-server nats-server\n(or run scripts/setup.sh, which installs everything tandem needs)",
            args.etcd_bin,
            args.nats_bin
        );
    };
    if let Some(p) = &args.slo_file {
        tandem_planner::PlannerConfig::from_file(p)?;
    }
    let model = match &args.model {
        Some(m) => m.clone(),
        None => crate::fetch::ensure_default_model()?,
    };
    let run_dir = match &args.run_dir {
        Some(d) => d.clone(),
        None => PathBuf::from(".tandem/run").join(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)?
                .as_secs()
                .to_string(),
        ),
    };
    std::fs::create_dir_all(&run_dir).with_context(|| format!("creating {}", run_dir.display()))?;
    let run_dir = run_dir.canonicalize()?;
    let me = std::env::current_exe()?;
    let deadline = Instant::now() + Duration::from_secs(args.ready_timeout_secs);
    eprintln!("tandem up: run directory {}", run_dir.display());

    // What the drills need of the machine, before any process starts.
    let partition = match &args.isolate_node {
        Some(node) => Some(isolate::NetPartition::create(node)?),
        None => None,
    };
    let etcd_disk = match args.etcd_disk_mib {
        Some(mib) => Some(isolate::SmallDisk::mount(&run_dir.join("etcd"), mib)?),
        None => None,
    };
    let host = partition
        .as_ref()
        .map_or(std::net::Ipv4Addr::LOCALHOST, |p| p.host_ip);

    // Control plane.
    let (etcd_port, etcd_peer, nats_port) = (free_port()?, free_port()?, free_port()?);
    let etcd_url = format!("http://{host}:{etcd_port}");
    let nats_url = format!("nats://{host}:{nats_port}");
    let mut procs = Procs::new(&run_dir)?;
    let mut env = args.env.clone();
    let threads = match args.threads {
        Some(n) => {
            env.push((tandem_kernels::env::TANDEM_THREADS.to_string(), n.to_string()));
            format!("{n} (--threads)")
        }
        None => format!(
            "{} (the cores this process may use)",
            std::thread::available_parallelism().map_or(1, |n| n.get())
        ),
    };
    eprintln!("tandem up: each node's kernels run on {threads} threads");
    procs.set_env(env);
    let mut cluster = Cluster {
        procs,
        run_dir: run_dir.clone(),
        etcd_url: etcd_url.clone(),
        nats_url: nats_url.clone(),
        prometheus_url: None,
        planner_metrics_url: None,
        router_http: args.http,
        pools: None,
        control: None,
        control_host: host,
        partition,
        etcd_disk,
    };
    let peer_url = format!("http://127.0.0.1:{etcd_peer}");
    let etcd_args = vec![
        "--name=tandem-local".into(),
        format!("--data-dir={}", run_dir.join("etcd").display()),
        format!("--listen-client-urls={etcd_url}"),
        format!("--advertise-client-urls={etcd_url}"),
        format!("--listen-peer-urls={peer_url}"),
        format!("--initial-advertise-peer-urls={peer_url}"),
        format!("--initial-cluster=tandem-local={peer_url}"),
    ];
    cluster.procs.spawn("etcd", &etcd, &etcd_args)?;
    let nats_args = vec![format!("--addr={host}"), format!("--port={nats_port}")];
    cluster.procs.spawn("nats", &nats, &nats_args)?;
    for port in [etcd_port, nats_port] {
        cluster
            .procs
            .wait_until(&format!("{host}:{port}"), deadline, interrupt, || {
                TcpStream::connect((host, port)).is_ok()
            })?;
    }

    // Nodes, then the router.
    // Every process of the cluster (nodes, router, planner) finds the same control plane.
    let control: Vec<String> = vec![
        "--cluster".into(),
        args.cluster.clone(),
        "--etcd-endpoints".into(),
        etcd_url.clone(),
        "--nats-url".into(),
        nats_url.clone(),
    ];
    let common: Vec<String> = control
        .iter()
        .cloned()
        .chain(["--model".into(), model.display().to_string()])
        .chain(args.trace.to_flags())
        .collect();
    let node_args = {
        let (common, extra, device) = (common.clone(), args.node_args.clone(), args.device);
        let cuda_ipc = device.is_cuda() && !args.no_cuda_ipc;
        move |role: Role, id: &str| {
            let mut a = vec![role.as_str().to_string()];
            a.extend(common.iter().cloned());
            a.extend(["--node-id".into(), id.to_string()]);
            if device.is_cuda() {
                a.extend(["--device".into(), device.to_string()]);
            }
            if cuda_ipc {
                a.push("--kv-cuda-ipc".into());
            }
            a.extend(extra.iter().cloned());
            a
        }
    };
    for (role, n) in [(Role::Decode, args.decode), (Role::Prefill, args.prefill)] {
        for i in 0..n {
            let id = format!("{role}-{i}");
            match cluster.partition.as_ref().filter(|p| p.node == id) {
                Some(p) => {
                    let (program, a) = p.wrap(&me, node_args(role, &id));
                    cluster.procs.spawn(&id, &program, &a)?;
                }
                None => cluster.procs.spawn(&id, &me, &node_args(role, &id))?,
            }
        }
    }
    let mut a = vec!["router".to_string()];
    a.extend(common.iter().cloned());
    for (flag, path) in [
        ("--api-keys-file", &args.api_keys_file),
        ("--cost-file", &args.cost_file),
    ] {
        if let Some(p) = path {
            let p = p
                .canonicalize()
                .with_context(|| format!("{flag} {}", p.display()))?;
            a.extend([flag.to_string(), p.display().to_string()]);
        }
    }
    a.extend([
        "--grpc-addr".into(),
        args.grpc.to_string(),
        "--http-addr".into(),
        args.http.to_string(),
    ]);
    if let Some(policy) = args.prefill_policy {
        use clap::ValueEnum;
        let name = policy.to_possible_value().expect("no skipped variants");
        a.extend(["--prefill-policy".into(), name.get_name().to_string()]);
    }
    if let Some(mode) = args.disaggregation {
        use clap::ValueEnum;
        let name = mode.to_possible_value().expect("no skipped variants");
        a.extend(["--disaggregation".into(), name.get_name().to_string()]);
    }
    if let Some(n) = args.local_prefill_max_tokens {
        a.extend(["--local-prefill-max-tokens".into(), n.to_string()]);
    }
    cluster.procs.spawn("router", &me, &a)?;

    let config = EtcdConfig::new(vec![etcd_url.clone()], args.cluster.clone());
    let etcd_discovery = rt.block_on(until_interrupted(interrupt, async {
        Ok(EtcdDiscovery::connect(config).await?)
    }))?;
    // Pool sizes: the bounds, and the sizes started, for the reconciler (and the planner).
    let store = etcd_discovery.scale_store();
    rt.block_on(until_interrupted(interrupt, async {
        store.set_limits(limits).await?;
        store.set_target(Role::Prefill, args.prefill).await?;
        store.set_target(Role::Decode, args.decode).await?;
        Ok(())
    }))?;
    let discovery: std::sync::Arc<dyn Discovery> = std::sync::Arc::new(etcd_discovery);
    let registered = |role: Role| {
        rt.block_on(discovery.list(role))
            .map(|v| v.len())
            .unwrap_or(0)
    };
    eprintln!(
        "tandem up: waiting for {} decode and {} prefill node(s) to load the model and register",
        args.decode, args.prefill
    );
    cluster
        .procs
        .wait_until("every node to register", deadline, interrupt, || {
            registered(Role::Decode) >= args.decode && registered(Role::Prefill) >= args.prefill
        })?;
    let http = args.http;
    cluster
        .procs
        .wait_until("the router's /health", deadline, interrupt, || {
            http_get_ok(http, "/health")
        })?;
    cluster.pools = Some(pools::Pools::new(
        [(Role::Prefill, args.prefill), (Role::Decode, args.decode)],
        &me,
        Box::new(node_args),
    ));
    if args.autoscale {
        let port = free_port()?;
        let mut a = vec!["planner".to_string()];
        a.extend(control.iter().cloned());
        a.extend([
            "--metrics-addr".into(),
            format!("127.0.0.1:{port}"),
            "--id".into(),
            "planner-0".into(),
            "--log".into(),
            "info".into(),
        ]);
        if let Some(p) = &args.slo_file {
            let p = p
                .canonicalize()
                .with_context(|| format!("--slo-file {}", p.display()))?;
            a.extend(["--slo-file".into(), p.display().to_string()]);
        }
        cluster.procs.spawn("planner", &me, &a)?;
        cluster.planner_metrics_url = Some(format!("http://127.0.0.1:{port}/metrics"));
    }
    cluster.control = Some((discovery.clone(), store));
    if args.prometheus {
        let Some(bin) = which(&args.prometheus_bin) else {
            bail!(
                "--prometheus needs `{}` on PATH. Install it with:\n    sudo apt-get install prometheus\n(or run scripts/setup.sh)",
                args.prometheus_bin
            );
        };
        let url = prometheus::start(
            &mut cluster.procs,
            &run_dir,
            &bin,
            args.prometheus_addr,
            args.http,
            discovery,
            rt,
            interrupt,
            deadline,
        )?;
        cluster.prometheus_url = Some(url);
    }
    Ok(cluster)
}

/// Runs `tandem up`.
pub fn run(args: &UpArgs) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    // Before any child exists: from here on SIGTERM/SIGINT unwind through the ordered stop.
    let interrupt = Interrupt::install(&rt)?;
    let mut cluster = start(args, &rt, &interrupt)?;
    let (etcd_url, nats_url, logs) = (
        cluster.etcd_url.clone(),
        cluster.nats_url.clone(),
        cluster.run_dir.join("logs"),
    );
    if !args.no_sample {
        eprintln!(
            "tandem up: streaming a sample answer through the router (gRPC {})",
            args.grpc
        );
        rt.block_on(until_interrupted(&interrupt, sample::sample(args)))?;
    }
    eprintln!(
        "tandem up: cluster `{}` is serving\n  gRPC  (tandem.v1.Inference)  {}\n  HTTP  (OpenAI API)            http://{}/v1\n  etcd  {etcd_url}\n  NATS  {nats_url}\n  logs  {}",
        args.cluster,
        args.grpc,
        args.http,
        logs.display()
    );
    if let Some(url) = &cluster.prometheus_url {
        eprintln!("  Prometheus  {url}  (alerts: {url}/alerts)");
    }
    if let Some(endpoint) = &args.trace.otlp_endpoint {
        eprintln!(
            "  traces  OTLP {} → {endpoint}",
            args.trace.otlp_protocol.as_str()
        );
    }
    if args.exit_after_sample {
        cluster.shutdown();
        return Ok(());
    }
    if let Some(url) = &cluster.planner_metrics_url {
        eprintln!(
            "  planner  {url}  (decisions on NATS tandem.{}.planner.decisions)",
            args.cluster
        );
    }
    eprintln!("tandem up: Ctrl-C or SIGTERM stops the cluster; `tandem scale` resizes a pool");
    cluster.serve(&rt, &interrupt);
    eprintln!(
        "tandem up: {} received; stopping the cluster",
        interrupt.signal().unwrap_or("signal")
    );
    cluster.shutdown();
    Ok(())
}

/// The pools' bounds from the flags; the sizes started must lie within them.
fn pool_limits(args: &UpArgs) -> anyhow::Result<ScaleLimits> {
    let limits = ScaleLimits {
        prefill: PoolBounds {
            min: args.min_prefill,
            max: args.max_prefill.unwrap_or(4.max(args.prefill)),
        },
        decode: PoolBounds {
            min: args.min_decode,
            max: args.max_decode.unwrap_or(4.max(args.decode)),
        },
    };
    for (role, n) in [(Role::Prefill, args.prefill), (Role::Decode, args.decode)] {
        let b = limits.of(role);
        anyhow::ensure!(
            b.min <= n && n <= b.max,
            "--{role} {n} is outside --min-{role} {} .. --max-{role} {}",
            b.min,
            b.max
        );
    }
    Ok(limits)
}

/// Runs `work` unless a signal arrives first (then the error says which).
async fn until_interrupted<T>(
    interrupt: &Interrupt,
    work: impl std::future::Future<Output = anyhow::Result<T>>,
) -> anyhow::Result<T> {
    tokio::select! {
        r = work => r,
        _ = interrupt.wait() => Err(interrupt.error()),
    }
}

/// Whether `GET path` on `addr` answers 200.
pub(crate) fn http_get_ok(addr: SocketAddr, path: &str) -> bool {
    let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_secs(1)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    if write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .is_err()
    {
        return false;
    }
    let mut line = String::new();
    std::io::BufReader::new(s).read_line(&mut line).is_ok()
        && line.split_whitespace().nth(1) == Some("200")
}
