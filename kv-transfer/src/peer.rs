//! The two-process peer: a child process that receives (or pushes) blocks, driven by a line
//! protocol, for the two-process tests and the benchmark.
//!
//! `tandem-kv-peer serve` binds `127.0.0.1:0`, prints `LISTEN <addr>`, then reads commands on
//! stdin, one per line, and answers on stdout:
//!
//! ```text
//! reserve <id> <epoch> <ttl_ms> <verify 0|1> <dst,blocks>  ->  RESERVED <id> | REFUSED <id> <kind>
//!   ... when it resolves                                    ->  RESULT <id> ok <bytes> <mismatched slabs>
//!                                                               RESULT <id> err <kind>
//! metrics                                                   ->  METRICS <json>
//! quit                                                      ->  (exits)
//! ```
//!
//! `tandem-kv-peer push` pushes once and prints `RESULT ok <bytes>` or `RESULT err <kind>`, then
//! `METRICS <json>`. `tandem-kv-peer sink` is the plain-socket baseline receiver: it reads
//! length-prefixed messages into one buffer and acknowledges each with one byte.
//! Both ends fill and check slabs with [`crate::pattern`], so "the destination bytes equal the
//! source bytes" is checked byte for byte across processes.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::net::TcpListener;
use tokio::process::{Child, ChildStdin, ChildStdout, Command};
use tokio_util::sync::CancellationToken;

use crate::config::{TransferConfig, UcxConfig, UcxDataMode};
use crate::inbound::{InboundRegistry, Reservation};
use crate::kind::{LayoutName, NetTransport, TransportKind};
use crate::pattern;
use crate::pool::BlockId;
use crate::transport::{KvTransport, PushRequest};

/// Seed of the slab pattern both processes use unless told otherwise.
pub const DEFAULT_SEED: u64 = 0x7a11_d0e5;

/// Which transport, and its knobs.
#[derive(clap::Args, Clone, Debug)]
pub struct TransportArgs {
    /// Network transport.
    #[arg(long, value_enum, default_value = "tcp")]
    pub transport: TransportKind,
    /// UCX transports (`UCX_TLS` syntax); unset: UCX's own choice.
    #[arg(long)]
    pub ucx_tls: Option<String>,
    /// UCX data path: RMA puts, tagged sends, or auto.
    #[arg(long, value_enum, default_value = "auto")]
    pub ucx_data_mode: UcxDataMode,
    /// Largest chunk sent as one unit.
    #[arg(long, default_value_t = 16 << 20)]
    pub max_chunk_bytes: usize,
    /// Transfers at least this large are copied into a mapped peer pool with non-temporal
    /// stores (UCX shared memory; see `TransferConfig::streaming_store_min_transfer_bytes`).
    #[arg(long, default_value_t = TransferConfig::default().streaming_store_min_transfer_bytes)]
    pub streaming_store_min_bytes: usize,
}

impl TransportArgs {
    /// Builds the transport these flags describe.
    pub fn build(&self) -> anyhow::Result<NetTransport> {
        let config = TransferConfig {
            max_chunk_bytes: self.max_chunk_bytes,
            streaming_store_min_transfer_bytes: self.streaming_store_min_bytes,
            ..Default::default()
        };
        let ucx = UcxConfig {
            tls: self.ucx_tls.clone(),
            data_mode: self.ucx_data_mode,
        };
        Ok(NetTransport::new(self.transport, config, ucx)?)
    }

    /// The same flags, as arguments for a child process.
    pub fn to_args(&self) -> Vec<String> {
        let mut a = vec![
            "--transport".into(),
            self.transport.as_str().into(),
            "--ucx-data-mode".into(),
            format!("{:?}", self.ucx_data_mode).to_lowercase(),
            "--max-chunk-bytes".into(),
            self.max_chunk_bytes.to_string(),
            "--streaming-store-min-bytes".into(),
            self.streaming_store_min_bytes.to_string(),
        ];
        if let Some(tls) = &self.ucx_tls {
            a.extend(["--ucx-tls".into(), tls.clone()]);
        }
        a
    }
}

/// The pool a peer allocates.
#[derive(clap::Args, Clone, Debug)]
pub struct PoolArgs {
    /// KV layout.
    #[arg(long, value_enum, default_value = "small")]
    pub layout: LayoutName,
    /// Tokens per block.
    #[arg(long, default_value_t = 16)]
    pub block_tokens: usize,
    /// Blocks in the pool.
    #[arg(long, default_value_t = 16)]
    pub blocks: usize,
    /// Seed of the slab pattern.
    #[arg(long, default_value_t = DEFAULT_SEED)]
    pub seed: u64,
}

impl PoolArgs {
    /// The same flags, as arguments for a child process.
    pub fn to_args(&self) -> Vec<String> {
        vec![
            "--layout".into(),
            format!("{:?}", self.layout).to_lowercase(),
            "--block-tokens".into(),
            self.block_tokens.to_string(),
            "--blocks".into(),
            self.blocks.to_string(),
            "--seed".into(),
            self.seed.to_string(),
        ]
    }
}

/// `tandem-kv-peer serve`.
#[derive(clap::Args, Clone, Debug)]
pub struct ServeArgs {
    /// Transport and its knobs.
    #[command(flatten)]
    pub transport: TransportArgs,
    /// The receiving pool.
    #[command(flatten)]
    pub pool: PoolArgs,
}

/// `tandem-kv-peer push`.
#[derive(clap::Args, Clone, Debug)]
pub struct PushArgs {
    /// Transport and its knobs.
    #[command(flatten)]
    pub transport: TransportArgs,
    /// The sending pool (source blocks are filled with the seeded pattern).
    #[command(flatten)]
    pub pool: PoolArgs,
    /// The receiver's control address.
    #[arg(long)]
    pub connect: String,
    /// Reservation id.
    #[arg(long)]
    pub reservation: u64,
    /// Reservation epoch.
    #[arg(long, default_value_t = 1)]
    pub epoch: u64,
    /// Source blocks, comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub src: Vec<BlockId>,
    /// Destination blocks, comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub dst: Vec<BlockId>,
    /// Mark one more layer ready every this many milliseconds (streamed push); 0: all at once.
    #[arg(long, default_value_t = 0)]
    pub layer_delay_ms: u64,
    /// Push deadline, milliseconds.
    #[arg(long, default_value_t = 30_000)]
    pub deadline_ms: u64,
    /// A fault to inject (`drop:N`, `delay-ms:N`, `corrupt:OFFSET`, `cut:BYTES`).
    #[cfg(feature = "fault-injection")]
    #[arg(long)]
    pub fault: Option<crate::fault::Fault>,
}

/// Runs `serve` until stdin says `quit` or closes.
pub async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let transport = args.transport.build()?;
    let layout = args.pool.layout.layout(args.pool.block_tokens)?;
    let registry = InboundRegistry::new(
        transport.allocate(layout, args.pool.blocks)?,
        TransferConfig::default().fence_timeout,
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.context("bind")?;
    say(&format!("LISTEN {}", listener.local_addr()?));
    let shutdown = CancellationToken::new();
    let transport = Arc::new(transport);
    let server = {
        let (t, r, s) = (Arc::clone(&transport), registry.clone(), shutdown.clone());
        tokio::spawn(async move { t.serve(listener, r, s).await })
    };
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    while let Some(line) = lines.next_line().await? {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["reserve", id, epoch, ttl_ms, verify, blocks] => {
                let r = Reservation {
                    reservation_id: id.parse()?,
                    epoch: epoch.parse()?,
                    dst_blocks: parse_blocks(blocks)?,
                    ttl: Duration::from_millis(ttl_ms.parse()?),
                };
                let (id, verify, seed) = (r.reservation_id, *verify == "1", args.pool.seed);
                match registry.expect(r) {
                    Ok(inbound) => {
                        say(&format!("RESERVED {id}"));
                        let pool = Arc::clone(registry.registration().pool());
                        tokio::spawn(async move {
                            let line = match inbound.await {
                                Ok(rep) => {
                                    // SAFETY: the reservation resolved, so nothing writes these blocks.
                                    let bad = if verify {
                                        unsafe {
                                            pattern::mismatched_slabs(
                                                &pool,
                                                seed,
                                                &rep.src_blocks,
                                                &rep.dst_blocks,
                                            )
                                        }
                                        .unwrap_or(usize::MAX)
                                    } else {
                                        0
                                    };
                                    format!("RESULT {id} ok {} {bad}", rep.bytes)
                                }
                                Err(e) => format!("RESULT {id} err {}", e.kind().as_str()),
                            };
                            say(&line);
                        });
                    }
                    Err(e) => say(&format!("REFUSED {id} {}", e.kind().as_str())),
                }
            }
            ["metrics"] => say(&format!(
                "METRICS {}",
                serde_json::to_string(&transport.metrics().snapshot())?
            )),
            ["quit"] => break,
            _ => bail!("unknown command `{line}`"),
        }
    }
    shutdown.cancel();
    let _ = server.await;
    Ok(())
}

/// Runs one `push` and prints its result and the sender's metrics.
pub async fn push(args: PushArgs) -> anyhow::Result<()> {
    let transport = args.transport.build()?;
    let layout = args.pool.layout.layout(args.pool.block_tokens)?;
    let src = transport.allocate(layout, args.pool.blocks)?;
    for &b in &args.src {
        src.pool().check_block(b)?;
    }
    // SAFETY: the pool was just allocated; no transfer touches it yet.
    unsafe { pattern::fill_blocks_shared(src.pool(), args.pool.seed, &args.src) }?;
    let mut req = PushRequest::new(
        &args.connect,
        args.reservation,
        args.epoch,
        args.src.clone(),
        args.dst.clone(),
    )
    .deadline(Duration::from_millis(args.deadline_ms));
    if args.layer_delay_ms > 0 {
        req = req.streamed();
    }
    #[cfg(feature = "fault-injection")]
    if let Some(f) = args.fault {
        req = req.fault(f);
    }
    let out = transport.push(&src, req, CancellationToken::new())?;
    if args.layer_delay_ms > 0 {
        for l in 1..=layout.num_layers as u32 {
            tokio::time::sleep(Duration::from_millis(args.layer_delay_ms)).await;
            out.layers_ready(l);
            if l == 1 {
                say("FIRST_LAYER_READY");
            }
        }
    }
    match out.await {
        Ok(r) => say(&format!("RESULT ok {}", r.bytes)),
        Err(e) => say(&format!("RESULT err {}", e.kind().as_str())),
    }
    drop(src);
    // UCX unmaps on its progress thread: let the registration gauge settle before reporting.
    let metrics = transport.metrics();
    for _ in 0..500 {
        let m = metrics.snapshot();
        if m.live_registrations == 0 && m.live_transfers == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    say(&format!(
        "METRICS {}",
        serde_json::to_string(&metrics.snapshot())?
    ));
    Ok(())
}

/// The plain-socket baseline receiver: length-prefixed messages into one buffer, 1-byte acks.
pub async fn sink() -> anyhow::Result<()> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    say(&format!("LISTEN {}", listener.local_addr()?));
    let (mut s, _) = listener.accept().await?;
    s.set_nodelay(true)?;
    let mut buf: Vec<u8> = Vec::new();
    loop {
        let mut len = [0u8; 8];
        if s.read_exact(&mut len).await.is_err() {
            return Ok(());
        }
        let len = u64::from_le_bytes(len) as usize;
        if buf.len() < len {
            buf.resize(len, 0);
        }
        s.read_exact(&mut buf[..len]).await?;
        s.write_all(&[1]).await?;
    }
}

fn parse_blocks(s: &str) -> anyhow::Result<Vec<BlockId>> {
    s.split(',')
        .map(|b| b.parse::<BlockId>().map_err(Into::into))
        .collect()
}

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// The `tandem-kv-peer` command line (also reachable through a host binary's subcommand).
#[derive(clap::Parser)]
#[command(
    name = "tandem-kv-peer",
    about = "KV transfer peer process (tests and benchmarks)"
)]
pub struct PeerCli {
    /// What to run.
    #[command(subcommand)]
    pub cmd: PeerCmd,
}

/// The peer's subcommands.
#[derive(clap::Subcommand)]
pub enum PeerCmd {
    /// Receive into reservations made over stdin.
    Serve(ServeArgs),
    /// Push blocks once.
    Push(PushArgs),
    /// Plain-socket baseline receiver.
    Sink,
    /// The `tandem bench-transfer` benchmark.
    Bench(crate::bench::BenchTransferArgs),
}

/// Parses `args` (program name first) as [`PeerCli`] and runs it: the whole of `tandem-kv-peer`.
/// A host binary (the `tandem` CLI) can route a hidden `kv-peer` subcommand here, and the bench
/// then needs no separate binary (see [`PeerCommand::find`]).
pub fn run_cli<I, T>(args: I) -> anyhow::Result<()>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let cli = <PeerCli as clap::Parser>::parse_from(args);
    if let PeerCmd::Bench(args) = cli.cmd {
        crate::bench::run(args)?;
        return Ok(());
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        match cli.cmd {
            PeerCmd::Serve(a) => serve(a).await,
            PeerCmd::Push(a) => push(a).await,
            PeerCmd::Sink => sink().await,
            PeerCmd::Bench(_) => unreachable!("handled above"),
        }
    })
}

/// How to start a peer process: a program and the arguments that select the peer in it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerCommand {
    /// The executable.
    pub program: PathBuf,
    /// Arguments before the peer's own (`["kv-peer"]` for a host binary's subcommand).
    pub prefix: Vec<String>,
}

impl PeerCommand {
    /// `$TANDEM_KV_PEER_BIN`; else `tandem-kv-peer` next to this executable; else this
    /// executable's `kv-peer` subcommand (the `tandem` CLI routes it to [`run_cli`]).
    pub fn find() -> Option<Self> {
        if let Ok(p) = std::env::var("TANDEM_KV_PEER_BIN") {
            return Some(PathBuf::from(p).into());
        }
        let exe = std::env::current_exe().ok()?;
        let sibling = exe.with_file_name("tandem-kv-peer");
        if sibling.exists() {
            return Some(sibling.into());
        }
        Some(Self {
            program: exe,
            prefix: vec!["kv-peer".into()],
        })
    }
}

impl From<PathBuf> for PeerCommand {
    fn from(program: PathBuf) -> Self {
        Self {
            program,
            prefix: Vec::new(),
        }
    }
}

/// A running peer child, spoken to over its stdin/stdout. Killed when dropped.
pub struct PeerProcess {
    child: Child,
    stdin: ChildStdin,
    lines: Lines<BufReader<ChildStdout>>,
    /// The address it printed with `LISTEN`, if any.
    pub addr: Option<String>,
}

impl PeerProcess {
    /// Starts the peer binary `bin` with `args`; for `serve` and `sink`, waits for `LISTEN`.
    pub async fn spawn(bin: &Path, args: &[String]) -> anyhow::Result<Self> {
        Self::spawn_command(&PeerCommand::from(bin.to_path_buf()), args).await
    }

    /// Starts a peer through `cmd` with `args`; for `serve` and `sink`, waits for `LISTEN`.
    pub async fn spawn_command(cmd: &PeerCommand, args: &[String]) -> anyhow::Result<Self> {
        let bin = &cmd.program;
        let mut child = Command::new(bin)
            .args(&cmd.prefix)
            .args(args)
            // Keep UCX's own log off the line protocol (unless the caller chose a log file).
            .env(
                "UCX_LOG_FILE",
                std::env::var("UCX_LOG_FILE").unwrap_or_else(|_| "stderr".into()),
            )
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("spawn {}", bin.display()))?;
        let stdin = child.stdin.take().context("child stdin")?;
        let lines = BufReader::new(child.stdout.take().context("child stdout")?).lines();
        let mut p = Self {
            child,
            stdin,
            lines,
            addr: None,
        };
        if matches!(args.first().map(String::as_str), Some("serve" | "sink")) {
            let line = p.line().await?;
            p.addr = Some(
                line.strip_prefix("LISTEN ")
                    .context("expected LISTEN")?
                    .to_string(),
            );
        }
        Ok(p)
    }

    /// The next protocol line the child prints (errors if it exits first). Lines in UCX's log
    /// format (`[timestamp] ...`, which UCX writes to stdout by default) are passed to the log.
    pub async fn line(&mut self) -> anyhow::Result<String> {
        loop {
            let line = tokio::time::timeout(Duration::from_secs(120), self.lines.next_line())
                .await
                .context("peer printed nothing for 120 s")??
                .context("peer exited")?;
            if line.starts_with('[') {
                tracing::info!(target: "tandem_kv_transfer::peer::child", "{line}");
                continue;
            }
            return Ok(line);
        }
    }

    /// Sends one command line.
    pub async fn send(&mut self, line: &str) -> anyhow::Result<()> {
        self.stdin.write_all(format!("{line}\n").as_bytes()).await?;
        self.stdin.flush().await?;
        Ok(())
    }

    /// `reserve` and wait for `RESERVED`.
    pub async fn reserve(
        &mut self,
        id: u64,
        epoch: u64,
        ttl: Duration,
        verify: bool,
        dst: &[BlockId],
    ) -> anyhow::Result<()> {
        let blocks: Vec<String> = dst.iter().map(|b| b.to_string()).collect();
        let v = if verify { 1 } else { 0 };
        self.send(&format!(
            "reserve {id} {epoch} {} {v} {}",
            ttl.as_millis(),
            blocks.join(",")
        ))
        .await?;
        let line = self.line().await?;
        if line != format!("RESERVED {id}") {
            bail!("peer answered `{line}` to reserve {id}");
        }
        Ok(())
    }

    /// Kills the child now and waits for it to exit.
    pub async fn kill(&mut self) -> anyhow::Result<()> {
        self.child.kill().await?;
        Ok(())
    }

    /// Asks the child to quit and waits for its exit status.
    pub async fn quit(mut self) -> anyhow::Result<std::process::ExitStatus> {
        let _ = self.send("quit").await;
        Ok(tokio::time::timeout(Duration::from_secs(30), self.child.wait()).await??)
    }
}
