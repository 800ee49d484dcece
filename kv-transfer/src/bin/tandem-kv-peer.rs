//! `tandem-kv-peer`: the child-process side of the two-process tests and of
//! `tandem bench-transfer` (see `tandem_kv_transfer::peer`), plus `bench` to run the benchmark
//! before the `tandem` CLI is built.

use clap::{Parser, Subcommand};
use tandem_kv_transfer::bench::{self, BenchTransferArgs};
use tandem_kv_transfer::peer::{self, PushArgs, ServeArgs};

#[derive(Parser)]
#[command(
    name = "tandem-kv-peer",
    about = "KV transfer peer process (tests and benchmarks)"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Receive into reservations made over stdin.
    Serve(ServeArgs),
    /// Push blocks once.
    Push(PushArgs),
    /// Plain-socket baseline receiver.
    Sink,
    /// The `tandem bench-transfer` benchmark.
    Bench(BenchTransferArgs),
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber_init();
    let cli = Cli::parse();
    if let Cmd::Bench(args) = cli.cmd {
        bench::run(args)?;
        return Ok(());
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        match cli.cmd {
            Cmd::Serve(a) => peer::serve(a).await,
            Cmd::Push(a) => peer::push(a).await,
            Cmd::Sink => peer::sink().await,
            Cmd::Bench(_) => unreachable!("handled above"),
        }
    })
}

/// Logs to stderr when `RUST_LOG` is set (stdout carries the line protocol).
fn tracing_subscriber_init() {
    if let Ok(filter) = std::env::var("RUST_LOG") {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_writer(std::io::stderr)
            .try_init();
    }
}
