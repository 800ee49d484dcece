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
    // Logs on stderr, and spans over OTLP when an endpoint is set; flushed when dropped.
    let _telemetry = match tandem_telemetry::init("tandem-router", &cli.log, &cli.args.trace) {
        Ok(guard) => guard,
        Err(error) => {
            eprintln!("error: {error}");
            return ExitCode::FAILURE;
        }
    };
    match tandem_router::run_blocking(cli.args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::FAILURE
        }
    }
}
