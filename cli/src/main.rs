//! `tandem`: the command-line entry point. Results go to stdout; logs and progress to stderr
//! (`RUST_LOG` or `--log` set the level).

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tandem_cli::{bench_engine, fetch, generate, plan};

/// tandem serves LLMs with prefill and decode disaggregated. This binary runs a local cluster,
/// the router and the nodes, the engine on its own, the capacity planner and the benchmarks.
#[derive(Parser, Debug)]
#[command(name = "tandem", version, about, long_about = None)]
struct Cli {
    /// Log filter for stderr (e.g. info, debug, tandem_engine=trace).
    #[arg(long, global = true, env = "RUST_LOG", default_value = "warn")]
    log: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Generate a completion with the local engine, streamed to stdout.
    Generate(generate::GenerateArgs),
    /// Capacity planning: KV bytes per token, KV budget, largest batch, concurrency.
    /// "GB" in flags means 2^30 bytes, "KB" 2^10.
    Plan(plan::PlanArgs),
    /// Benchmark the engine: prefill and decode tokens/s beside the bandwidth bound.
    BenchEngine(bench_engine::BenchEngineArgs),
    /// Benchmark KV-block transfer between two processes (UCX or TCP) beside `ucx_perftest`,
    /// a plain socket copy and memcpy measured in the same run.
    BenchTransfer(tandem_kv_transfer::bench::BenchTransferArgs),
    /// The child-process side of `bench-transfer` (internal).
    #[command(hide = true)]
    KvPeer {
        /// Arguments of the peer protocol.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<std::ffi::OsString>,
    },
    /// Serving benchmark: TTFT and tokens/s at a few concurrency levels, a local 1 prefill +
    /// 1 decode cluster beside one colocated engine.
    BenchServe(tandem_cli::bench_serve::BenchServeArgs),
    /// The simulator checked against reality: a local 1 prefill + 1 decode cluster (every
    /// prompt through the prefill node) and `tandem sim` of it from the engine's measured steps,
    /// TTFT and ITL at each concurrency, medians of simulated / real over rounds.
    BenchSim(tandem_cli::bench_sim::BenchSimArgs),
    /// Routing by cache against policies blind to it: TTFT, throughput and cached prompt
    /// tokens on a shared-prefix workload, each policy on a fresh local cluster.
    BenchPrefix(tandem_cli::bench_prefix::BenchPrefixArgs),
    /// Start a local cluster (etcd, NATS, decode and prefill nodes, router), stream a sample
    /// answer through it, and serve until Ctrl-C.
    Up(tandem_cli::up::UpArgs),
    /// Run the router: gRPC (tandem.v1.Inference) and OpenAI-compatible HTTP ingress in front of
    /// the cluster's prefill and decode nodes.
    Router(tandem_router::RouterArgs),
    /// Run a prefill node (chunked prefill, first token, layer-wise KV push); same flags as
    /// `tandem-prefill-node` (`tandem prefill --help`).
    #[command(disable_help_flag = true)]
    Prefill {
        /// The node's flags.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<std::ffi::OsString>,
    },
    /// Run a decode node (KV reservations, verified receive, continuous batching); same flags as
    /// `tandem-decode-node` (`tandem decode --help`).
    #[command(disable_help_flag = true)]
    Decode {
        /// The node's flags.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<std::ffi::OsString>,
    },
    /// Ask a node to drain (finish its streams, take nothing new) and leave; waits until it has.
    Drain(tandem_cli::drain::DrainArgs),
    /// Size the prefill and decode pools from their load signals (two may run; an etcd
    /// election makes one act). `--dry-run` decides and prints without acting.
    Planner(tandem_cli::planner::PlannerArgs),
    /// Show or set the pools' sizes and bounds by hand (`tandem scale prefill=3 decode=2`).
    Scale(tandem_cli::scale::ScaleArgs),
    /// Simulate a large cluster (default: 1,000 H200s, the seed's 70B model, TP 8) with
    /// tandem's router policy, scheduler and planner: disaggregated vs colocated.
    Sim(tandem_cli::sim::SimArgs),
    /// Failover drills: real requests on a fresh local cluster, one fault (a node killed or
    /// hung, etcd/NATS/router lost, clients hanging up), and a table of what the clients saw.
    Drill(tandem_cli::drill::DrillArgs),
    /// Usage per API key (requests, tokens, node-seconds) from a router's ledger.
    Usage(tandem_cli::usage::UsageArgs),
    /// Cost per API key and per pool ($ per million input, cached input and output tokens)
    /// at the router's configured node-hour prices.
    Cost(tandem_cli::usage::UsageArgs),
    /// Manage the model cache.
    #[command(subcommand)]
    Model(ModelCommand),
}

#[derive(Subcommand, Debug)]
enum ModelCommand {
    /// Download and verify the default model (SmolLM2-135M-Instruct) into the model cache
    /// ($TANDEM_MODEL_DIR, default ~/.cache/tandem/models). Idempotent.
    Fetch,
    /// Print the path of the default model in the cache.
    Path,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Logs on stderr (and, for the router, spans over OTLP when an endpoint is set). Nodes set
    // up their own (their `--log`, default info, and their own trace flags).
    let trace = match &cli.command {
        Command::Router(a) => a.trace.clone(),
        _ => tandem_telemetry::TraceArgs::default(),
    };
    let service = match &cli.command {
        Command::Router(_) => "tandem-router",
        _ => "tandem",
    };
    let _telemetry = if matches!(
        cli.command,
        Command::Prefill { .. } | Command::Decode { .. }
    ) {
        None
    } else {
        match tandem_telemetry::init(service, &cli.log, &trace) {
            Ok(guard) => Some(guard),
            Err(error) => {
                eprintln!("error: {error}");
                return ExitCode::FAILURE;
            }
        }
    };
    let result = match &cli.command {
        Command::Generate(a) => generate::run(a),
        Command::Plan(a) => plan::run(a).map(|s| println!("{s}")),
        Command::Up(a) => tandem_cli::up::run(a),
        Command::Planner(a) => tandem_cli::planner::run(a),
        Command::Scale(a) => tandem_cli::scale::run(a).map(|s| println!("{s}")),
        Command::Sim(a) => tandem_cli::sim::run(a).map(|s| println!("{s}")),
        Command::Drain(a) => tandem_cli::drain::run(a).map(|s| println!("{s}")),
        Command::Drill(a) => tandem_cli::drill::run(a),
        Command::Usage(a) => tandem_cli::usage::usage(a).map(|s| println!("{s}")),
        Command::Cost(a) => tandem_cli::usage::cost(a).map(|s| println!("{s}")),
        Command::BenchServe(a) => tandem_cli::bench_serve::run(a).map(|s| println!("{s}")),
        Command::BenchSim(a) => tandem_cli::bench_sim::run(a).map(|s| println!("{s}")),
        Command::BenchPrefix(a) => tandem_cli::bench_prefix::run(a).map(|s| println!("{s}")),
        Command::Router(a) => tandem_router::run_blocking(a.clone()).map_err(Into::into),
        Command::BenchEngine(a) => bench_engine::run(a).map(|s| println!("{s}")),
        Command::BenchTransfer(a) => tandem_kv_transfer::bench::run(a.clone()).map(|_| ()),
        Command::KvPeer { args } => tandem_kv_transfer::peer::run_cli(
            std::iter::once("tandem-kv-peer".into()).chain(args.iter().cloned()),
        ),
        Command::Prefill { args } => tandem_prefill_node::main_with_args(
            std::iter::once("tandem prefill".into())
                .chain(args.iter().cloned())
                .collect(),
        ),
        Command::Decode { args } => tandem_decode_node::main_with_args(
            std::iter::once("tandem decode".into())
                .chain(args.iter().cloned())
                .collect(),
        ),
        Command::Model(ModelCommand::Fetch) => {
            fetch::ensure_default_model().map(|p| println!("{}", p.display()))
        }
        Command::Model(ModelCommand::Path) => {
            println!("{}", fetch::default_model_path().display());
            Ok(())
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
