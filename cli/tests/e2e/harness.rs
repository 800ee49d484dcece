//! A real local cluster for the end-to-end tests: etcd and NATS from `cluster::testing`, and
//! decode / prefill nodes and a router as real `tandem` processes (logs in a temp dir, shown on
//! failure). Observation goes through the same interfaces an operator has: etcd membership, NATS
//! load reports, the router's /health and /metrics, gRPC and HTTP.
#![allow(dead_code)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tandem_cluster::testing::{TestEtcd, TestNats};
use tandem_cluster::{
    Discovery, EtcdConfig, EtcdDiscovery, LoadSignals, LoadView, NatsConfig, NatsLoadSignals, Role,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::watch;

/// Limit on every wait in these tests.
pub const WAIT: Duration = Duration::from_secs(120);

pub use crate::common::model;

fn free_addr() -> SocketAddr {
    tandem_cli::ports::free_loopback_addr().unwrap()
}

/// One `tandem` child process.
pub struct Proc {
    pub name: String,
    pub child: Child,
    pub log: PathBuf,
}

impl Proc {
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

/// etcd + NATS + tandem processes; everything is killed on drop.
pub struct Cluster {
    pub name: String,
    pub etcd: TestEtcd,
    pub nats: TestNats,
    pub dir: PathBuf,
    pub procs: Vec<Proc>,
    pub grpc: SocketAddr,
    pub http: SocketAddr,
    pub discovery: EtcdDiscovery,
    pub loads_decode: watch::Receiver<LoadView>,
    pub loads_prefill: watch::Receiver<LoadView>,
    _signals: NatsLoadSignals,
}

impl Cluster {
    /// Starts etcd and NATS and connects the observers; no tandem processes yet.
    pub async fn start(name: &str) -> Cluster {
        let etcd = TestEtcd::start().await;
        let nats = TestNats::start().await;
        let dir = std::env::temp_dir().join(format!("tandem-e2e-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let discovery = EtcdDiscovery::connect(EtcdConfig::new(vec![etcd.endpoint()], name))
            .await
            .unwrap();
        let signals = NatsLoadSignals::connect(NatsConfig::new(nats.url(), name))
            .await
            .unwrap();
        let loads_decode = signals.subscribe(Role::Decode).await.unwrap();
        let loads_prefill = signals.subscribe(Role::Prefill).await.unwrap();
        Cluster {
            name: name.into(),
            etcd,
            nats,
            dir,
            procs: Vec::new(),
            grpc: free_addr(),
            http: free_addr(),
            discovery,
            loads_decode,
            loads_prefill,
            _signals: signals,
        }
    }

    fn common_args(&self) -> Vec<String> {
        vec![
            "--cluster".into(),
            self.name.clone(),
            "--etcd-endpoints".into(),
            self.etcd.endpoint(),
            "--nats-url".into(),
            self.nats.url(),
            "--model".into(),
            model().display().to_string(),
        ]
    }

    /// Spawns `tandem <args>` named `name`.
    pub fn spawn(&mut self, name: &str, args: Vec<String>) {
        let log = self.dir.join(format!("{name}.log"));
        let out = std::fs::File::create(&log).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_tandem"))
            .args(&args)
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .unwrap();
        self.procs.push(Proc {
            name: name.into(),
            child,
            log,
        });
    }

    /// Starts a node (`role` is "decode" or "prefill") with extra flags.
    pub fn node(&mut self, role: &str, id: &str, extra: &[&str]) {
        let mut a = vec![role.to_string()];
        a.extend(self.common_args());
        a.extend([
            "--node-id".into(),
            id.into(),
            "--lease-ttl-secs".into(),
            "2".into(),
            "--kv-cache-gb".into(),
            "0.25".into(),
        ]);
        a.extend(extra.iter().map(|s| s.to_string()));
        self.spawn(id, a);
    }

    /// Starts the router on ports the kernel picks and waits for the addresses it prints
    /// (`grpc ADDR` / `http ADDR`), so no other process can take a port between choosing and
    /// binding it.
    pub fn router(&mut self, extra: &[&str]) {
        self.router_named("router", extra);
    }

    /// [`router`](Self::router) as process `name` (a second router on the same cluster); the
    /// cluster's addresses become its own.
    pub fn router_named(&mut self, name: &str, extra: &[&str]) {
        let mut a = vec!["router".to_string()];
        a.extend(self.common_args());
        a.extend([
            "--grpc-addr".into(),
            "127.0.0.1:0".into(),
            "--http-addr".into(),
            "127.0.0.1:0".into(),
        ]);
        a.extend(extra.iter().map(|s| s.to_string()));
        self.spawn(name, a);
        let deadline = Instant::now() + WAIT;
        let me = self.procs.len() - 1;
        loop {
            let text = self.procs[me].log_text();
            let addr = |name: &str| {
                text.lines()
                    .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
            };
            if let (Some(grpc), Some(http)) = (addr("grpc"), addr("http")) {
                (self.grpc, self.http) = (grpc, http);
                return;
            }
            if let Ok(Some(status)) = self.procs[me].child.try_wait() {
                panic!("router exited ({status}) before serving:\n{}", self.logs());
            }
            assert!(
                Instant::now() < deadline,
                "router did not bind within {WAIT:?}:\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn proc(&mut self, name: &str) -> &mut Proc {
        self.procs
            .iter_mut()
            .find(|p| p.name == name)
            .unwrap_or_else(|| panic!("no process {name}"))
    }

    /// Every log, for failure messages.
    pub fn logs(&self) -> String {
        self.procs
            .iter()
            .map(|p| format!("==== {} ====\n{}", p.name, tail(&p.log_text(), 40)))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Waits until `cond` holds (polling every 50 ms), panicking with the logs after `limit`.
    pub async fn wait_for(
        &mut self,
        what: &str,
        limit: Duration,
        mut cond: impl AsyncFnMut(&mut Cluster) -> bool,
    ) {
        let t0 = Instant::now();
        loop {
            if cond(self).await {
                return;
            }
            let mut exited = None;
            for p in &mut self.procs {
                if let Ok(Some(status)) = p.child.try_wait()
                    && !p.name.starts_with("expect-exit")
                    && !p.name.starts_with("killed-")
                {
                    exited = Some(format!("{} exited ({status})", p.name));
                }
            }
            if let Some(e) = exited {
                panic!("{e} while waiting for {what}\n{}", self.logs());
            }
            if t0.elapsed() > limit {
                panic!(
                    "timed out after {limit:?} waiting for {what}\n{}",
                    self.logs()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Node ids registered under `role`.
    pub async fn registered(&self, role: Role) -> Vec<String> {
        self.discovery
            .list(role)
            .await
            .map(|v| v.keys().cloned().collect())
            .unwrap_or_default()
    }

    /// Waits until `n_prefill` and `n_decode` nodes *serve* (registered and warmed up: a node
    /// still warming takes no work, so a test that expects a request on it must wait for this)
    /// and the router is healthy; then gives the router's membership watch a moment to see
    /// the last state change.
    pub async fn wait_ready(&mut self, n_prefill: usize, n_decode: usize) {
        self.wait_for(
            "nodes to serve and the router to be healthy",
            WAIT,
            async |c| {
                c.serving(Role::Prefill).await >= n_prefill
                    && c.serving(Role::Decode).await >= n_decode
                    && http(c.http, "GET", "/health", None)
                        .await
                        .map(|r| r.0 == 200)
                        .unwrap_or(false)
            },
        )
        .await;
        tokio::time::sleep(Duration::from_millis(300)).await;
    }

    /// Nodes of `role` whose record says `serving`.
    pub async fn serving(&self, role: Role) -> usize {
        self.discovery
            .list(role)
            .await
            .map(|v| {
                v.values()
                    .filter(|n| n.state == tandem_cluster::NodeState::Serving)
                    .count()
            })
            .unwrap_or(0)
    }

    /// Latest load reports of every node (both roles).
    pub fn loads(&self) -> HashMap<String, (u64, u64)> {
        let mut m = HashMap::new();
        for v in [
            self.loads_decode.borrow().clone(),
            self.loads_prefill.borrow().clone(),
        ] {
            for (id, r) in v {
                m.insert(id, (r.report.free_blocks, r.report.total_blocks));
            }
        }
        m
    }

    /// Waits until every live node reports free blocks == total blocks (nothing leaked).
    pub async fn wait_all_blocks_free(&mut self, nodes: &[&str]) {
        let nodes: Vec<String> = nodes.iter().map(|s| s.to_string()).collect();
        self.wait_for(
            "every node to report all KV blocks free",
            Duration::from_secs(20),
            async |c| {
                let l = c.loads();
                nodes.iter().all(|n| {
                    l.get(n)
                        .is_some_and(|(free, total)| free == total && *total > 0)
                })
            },
        )
        .await;
    }

    /// The router's /metrics value of the exact series `series` (e.g. `name{labels}`).
    /// A series of one node's own `/metrics` (found through its etcd record), summed over
    /// every line that starts with `series` (all label sets when given without labels).
    pub async fn node_metric(&self, role: Role, node_id: &str, series: &str) -> Option<f64> {
        let info = self.discovery.list(role).await.ok()?.remove(node_id)?;
        let url = info.metrics_url;
        let rest = url.strip_prefix("http://")?;
        let (addr, path) = rest
            .split_once('/')
            .map_or((rest, "/metrics".to_string()), |(a, p)| {
                (a, format!("/{p}"))
            });
        let (_, body) = http(addr.parse().ok()?, "GET", &path, None).await.ok()?;
        let values: Vec<f64> = body
            .lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| l.strip_prefix(series))
            .filter(|rest| rest.starts_with(' ') || rest.starts_with('{'))
            .filter_map(|rest| rest.rsplit(' ').next()?.parse().ok())
            .collect();
        (!values.is_empty()).then(|| values.iter().sum())
    }

    pub async fn metric(&self, series: &str) -> Option<u64> {
        let (_, body) = http(self.http, "GET", "/metrics", None).await.ok()?;
        body.lines()
            .find_map(|l| l.strip_prefix(series).and_then(|v| v.trim().parse().ok()))
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for p in &mut self.procs {
            let _ = p.child.kill();
            let _ = p.child.wait();
        }
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        } else {
            eprintln!("e2e logs kept in {}", self.dir.display());
        }
    }
}

pub fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// One HTTP/1.1 request (Connection: close); returns (status, body with chunking removed).
pub async fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> std::io::Result<(u16, String)> {
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    let body = body.unwrap_or("");
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await?;
    let mut raw = Vec::new();
    tokio::time::timeout(WAIT, s.read_to_end(&mut raw))
        .await
        .map_err(|_| std::io::Error::other("timeout"))??;
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map_or(raw.len(), |i| i + 4);
    let head = String::from_utf8_lossy(&raw[..split]).to_ascii_lowercase();
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = if head.contains("transfer-encoding: chunked") {
        dechunk(&raw[split..])
    } else {
        raw[split..].to_vec()
    };
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

fn dechunk(mut s: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(eol) = s.windows(2).position(|w| w == b"\r\n") {
        let size = String::from_utf8_lossy(&s[..eol]);
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        let rest = &s[eol + 2..];
        if n == 0 || rest.len() < n {
            break;
        }
        out.extend_from_slice(&rest[..n]);
        s = rest[n..].strip_prefix(b"\r\n").unwrap_or(&rest[n..]);
    }
    out
}
