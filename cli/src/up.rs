//! `tandem up`: a whole local cluster from one command: etcd and NATS (the installed `etcd` and
//! `nats-server` binaries, data under the run directory), `--decode M` decode nodes, `--prefill N`
//! prefill nodes and a router, each a child process of this one (`tandem decode|prefill|router`)
//! logging to `<run-dir>/logs/<name>.log`. It waits until every node has registered and the
//! router answers a real generation (streamed to stdout), prints the endpoints, and on Ctrl-C /
//! SIGTERM shuts everything down in order: router (stop new work), prefill and decode nodes
//! (each drains and deregisters), then NATS and etcd.
//!
//! Every child runs in its own process group, so a terminal's Ctrl-C reaches `tandem up` alone
//! and the shutdown order holds; if `tandem up` itself is killed, the children notice their
//! parent's pipe closing only through their own health (they keep serving): stop them with
//! `pkill -f 'tandem (router|prefill|decode)'` in that case.

use std::io::{BufRead, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;
use tandem_cluster::{Discovery, EtcdConfig, EtcdDiscovery, Role};
use tandem_proto::v1::inference_client::InferenceClient;
use tandem_proto::v1::{
    ChatMessage, ChatMessages, GenerateRequest, SamplingParams, generate_request, generate_response,
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
    /// Extra flags given to every prefill and decode node (after `--`), e.g. `-- --kv-cache-gb 0.5`.
    #[arg(last = true)]
    pub node_args: Vec<String>,
}

/// A child process with its name and log.
struct Proc {
    name: String,
    child: Child,
    log: PathBuf,
}

impl Proc {
    fn spawn(name: &str, program: &Path, args: &[String], logs: &Path) -> anyhow::Result<Proc> {
        let log = logs.join(format!("{name}.log"));
        let out =
            std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let err = out.try_clone()?;
        let child = Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .process_group(0)
            .spawn()
            .with_context(|| format!("starting {name} ({})", program.display()))?;
        Ok(Proc {
            name: name.to_string(),
            child,
            log,
        })
    }

    /// Fails with the log's tail if the process has exited.
    fn check_alive(&mut self) -> anyhow::Result<()> {
        if let Some(status) = self.child.try_wait()? {
            bail!(
                "{} exited ({status}) during startup; last lines of {}:\n{}",
                self.name,
                self.log.display(),
                tail(&self.log, 15)
            );
        }
        Ok(())
    }

    /// SIGTERM, then wait up to `grace`, then SIGKILL.
    fn stop(&mut self, grace: Duration) {
        if self.child.try_wait().ok().flatten().is_some() {
            return;
        }
        // SAFETY: plain kill(2) on our own child's pid.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let t0 = Instant::now();
        while t0.elapsed() < grace {
            if self.child.try_wait().ok().flatten().is_some() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        eprintln!(
            "tandem up: {} did not stop within {grace:?}; killing it",
            self.name
        );
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
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

/// Waits until `cond` holds, checking that the processes are alive meanwhile.
fn wait_until(
    what: &str,
    deadline: Instant,
    procs: &mut [Proc],
    mut cond: impl FnMut() -> bool,
) -> anyhow::Result<()> {
    loop {
        if cond() {
            return Ok(());
        }
        for p in procs.iter_mut() {
            p.check_alive()?;
        }
        if Instant::now() > deadline {
            bail!("timed out waiting for {what}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A running local cluster: processes in start order, stopped in reverse order on drop.
pub struct Cluster {
    procs: Vec<Proc>,
    /// Where its data and logs are.
    pub run_dir: PathBuf,
    /// etcd client URL.
    pub etcd_url: String,
    /// NATS URL.
    pub nats_url: String,
}

impl Cluster {
    /// Stops in reverse start order: router, prefill, decode, NATS, etcd.
    pub fn shutdown(&mut self) {
        while let Some(mut p) = self.procs.pop() {
            eprintln!("tandem up: stopping {}", p.name);
            p.stop(Duration::from_secs(40));
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Starts the cluster `args` describe and waits until every node is registered and the router
/// is healthy.
pub fn start(args: &UpArgs, rt: &tokio::runtime::Runtime) -> anyhow::Result<Cluster> {
    anyhow::ensure!(
        args.prefill > 0 && args.decode > 0,
        "--prefill and --decode must each be at least 1"
    );
    let (Some(etcd), Some(nats)) = (which(&args.etcd_bin), which(&args.nats_bin)) else {
        bail!(
            "tandem up needs `{}` and `{}` on PATH. Install them with:\n    sudo apt-get install etcd-server nats-server\n(or run scripts/setup.sh, which installs everything tandem needs)",
            args.etcd_bin,
            args.nats_bin
        );
    };
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
    let logs = run_dir.join("logs");
    std::fs::create_dir_all(&logs).with_context(|| format!("creating {}", logs.display()))?;
    let run_dir = run_dir.canonicalize()?;
    let logs = run_dir.join("logs");
    let me = std::env::current_exe()?;
    let deadline = Instant::now() + Duration::from_secs(args.ready_timeout_secs);
    eprintln!("tandem up: run directory {}", run_dir.display());

    // Control plane.
    let (etcd_port, etcd_peer, nats_port) = (free_port()?, free_port()?, free_port()?);
    let etcd_url = format!("http://127.0.0.1:{etcd_port}");
    let nats_url = format!("nats://127.0.0.1:{nats_port}");
    let mut cluster = Cluster {
        procs: Vec::new(),
        run_dir: run_dir.clone(),
        etcd_url: etcd_url.clone(),
        nats_url: nats_url.clone(),
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
    cluster
        .procs
        .push(Proc::spawn("etcd", &etcd, &etcd_args, &logs)?);
    let nats_args = vec!["--addr=127.0.0.1".into(), format!("--port={nats_port}")];
    cluster
        .procs
        .push(Proc::spawn("nats", &nats, &nats_args, &logs)?);
    for port in [etcd_port, nats_port] {
        wait_until(
            &format!("127.0.0.1:{port}"),
            deadline,
            &mut cluster.procs,
            || TcpStream::connect(("127.0.0.1", port)).is_ok(),
        )?;
    }

    // Nodes, then the router.
    let common = vec![
        "--cluster".into(),
        args.cluster.clone(),
        "--etcd-endpoints".into(),
        etcd_url.clone(),
        "--nats-url".into(),
        nats_url.clone(),
        "--model".into(),
        model.display().to_string(),
    ];
    for (role, n) in [("decode", args.decode), ("prefill", args.prefill)] {
        for i in 0..n {
            let mut a = vec![role.to_string()];
            a.extend(common.iter().cloned());
            a.extend(["--node-id".into(), format!("{role}-{i}")]);
            a.extend(args.node_args.iter().cloned());
            cluster
                .procs
                .push(Proc::spawn(&format!("{role}-{i}"), &me, &a, &logs)?);
        }
    }
    let mut a = vec!["router".to_string()];
    a.extend(common.iter().cloned());
    a.extend([
        "--grpc-addr".into(),
        args.grpc.to_string(),
        "--http-addr".into(),
        args.http.to_string(),
    ]);
    cluster.procs.push(Proc::spawn("router", &me, &a, &logs)?);

    let discovery = rt.block_on(EtcdDiscovery::connect(EtcdConfig::new(
        vec![etcd_url.clone()],
        args.cluster.clone(),
    )))?;
    let registered = |role: Role| {
        rt.block_on(discovery.list(role))
            .map(|v| v.len())
            .unwrap_or(0)
    };
    eprintln!(
        "tandem up: waiting for {} decode and {} prefill node(s) to load the model and register",
        args.decode, args.prefill
    );
    wait_until(
        "every node to register",
        deadline,
        &mut cluster.procs,
        || registered(Role::Decode) >= args.decode && registered(Role::Prefill) >= args.prefill,
    )?;
    let http = args.http;
    wait_until("the router's /health", deadline, &mut cluster.procs, || {
        http_health_ok(http)
    })?;
    Ok(cluster)
}

/// Runs `tandem up`.
pub fn run(args: &UpArgs) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let mut cluster = start(args, &rt)?;
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
        rt.block_on(sample(args))?;
    }
    eprintln!(
        "tandem up: cluster `{}` is serving\n  gRPC  (tandem.v1.Inference)  {}\n  HTTP  (OpenAI API)            http://{}/v1\n  etcd  {etcd_url}\n  NATS  {nats_url}\n  logs  {}",
        args.cluster,
        args.grpc,
        args.http,
        logs.display()
    );
    if args.exit_after_sample {
        cluster.shutdown();
        return Ok(());
    }
    eprintln!("tandem up: Ctrl-C or SIGTERM stops the cluster");
    rt.block_on(async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        anyhow::Ok(())
    })?;
    cluster.shutdown();
    Ok(())
}

fn http_health_ok(addr: SocketAddr) -> bool {
    let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_secs(1)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    if write!(
        s,
        "GET /health HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .is_err()
    {
        return false;
    }
    let mut line = String::new();
    std::io::BufReader::new(s).read_line(&mut line).is_ok()
        && line.split_whitespace().nth(1) == Some("200")
}

async fn sample(args: &UpArgs) -> anyhow::Result<()> {
    let mut client = InferenceClient::connect(format!("http://{}", args.grpc)).await?;
    let req = GenerateRequest {
        input: Some(generate_request::Input::Chat(ChatMessages {
            messages: vec![ChatMessage {
                role: "user".into(),
                content: args.prompt.clone(),
            }],
        })),
        sampling: Some(SamplingParams {
            max_tokens: args.max_tokens,
            ..Default::default()
        }),
        ..Default::default()
    };
    let mut stream = client.generate(req).await?.into_inner();
    let mut out = std::io::stdout().lock();
    while let Some(msg) = stream.message().await? {
        match msg.event {
            Some(generate_response::Event::Delta(d)) => {
                out.write_all(d.text.as_bytes())?;
                out.flush()?;
            }
            Some(generate_response::Event::Final(f)) => {
                writeln!(out)?;
                if let Some(u) = f.usage {
                    eprintln!(
                        "tandem up: {} prompt + {} completion tokens, finish reason {:?}",
                        u.prompt_tokens,
                        u.completion_tokens,
                        f.finish_reason()
                    );
                }
            }
            None => {}
        }
    }
    Ok(())
}
