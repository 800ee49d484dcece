//! `tandem-router`: the router binary (also `tandem router`). See the crate README for flags.

use std::process::ExitCode;

use clap::Parser;

/// tandem's router: gRPC and OpenAI-compatible HTTP ingress in front of prefill and decode
/// nodes found through etcd, routed by NATS load reports.
#[derive(Parser, Debug)]
#[command(name = "tandem-router", version, about)]
struct Cli {
    /// Log filter for stderr (e.g. info, debug, tandem_router=debug).
    #[arg(long, env = "RUST_LOG", default_value = "info")]
    log: String,
    #[command(flatten)]
    args: tandem_router::RouterArgs,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_new(&cli.log).unwrap_or_else(|_| "info".into()),
        )
        .init();
    match tandem_router::run_blocking(cli.args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::FAILURE
        }
    }
}
