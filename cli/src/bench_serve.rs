//! `tandem bench-serve`: the serving curve, disaggregated vs colocated, side by side.
//!
//! - **Disaggregated**: a local cluster started as `tandem up` does (1 prefill + 1 decode node
//!   and the router, real processes), driven over the router's gRPC ingress.
//! - **Colocated**: one engine doing prefill and decode, in this process, driven the same way
//!   (no RPC, no KV transfer): the baseline disaggregation is measured against.
//!
//! Load, per level (`--requests` each): closed loop at each `--concurrency c` (`c` clients, each
//! sending its next request when its last one finished), then open loop at each `--rates r`
//! (Poisson arrivals at `r` requests/s, seeded). Every prompt is `--prompt-len` seeded random
//! tokens (distinct, so no prefix-cache hits) and asks for `--max-tokens` (EOS ignored).
//! Reported per level: TTFT, inter-token latency and end-to-end p50/p90/p99 (from the scheduled
//! arrival), output tokens/s, requests/s, and goodput: requests/s that met the SLO
//! (`--slo-ttft-ms`, `--slo-itl-ms`). `--json` prints the report as JSON; `--plot-dir` draws the
//! throughput–latency curves as PNG (one per load kind). A progress bar on stderr counts
//! requests when stderr is a terminal; a line per finished level is printed either way.
//! On a 2-core machine both nodes and the router share the cores the colocated engine has to
//! itself: the comparison shows the cost of disaggregation there, not its benefit at scale.

pub mod args;
mod plot;

use std::path::PathBuf;

use anyhow::Context;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use plotters::style::{BLUE, RED};
use serde::Serialize;
use tandem_engine::EngineArgs;

pub use args::{BenchServeArgs, Mode};
pub use crate::serving::{Level, Load, Sample, Slo};
use crate::serving::{KvMoved, disaggregated_level, drive, progress, stats};

use crate::load::engine_from_args;
use crate::up::{self, UpArgs};


#[derive(Serialize)]
struct Report {
    prompt_len: usize,
    max_tokens: usize,
    requests_per_level: usize,
    slo: Slo,
    disaggregated: Vec<Level>,
    colocated: Vec<Level>,
    /// How the disaggregated side's KV moved (the nodes' `/metrics` after its last level).
    kv: Option<KvMoved>,
}

/// The levels to run, in order: the concurrency sweep, then the rate sweep.
fn loads(args: &BenchServeArgs) -> Vec<Load> {
    let closed = args.concurrency.iter().map(|&c| Load::Concurrency(c));
    closed.chain(args.rates.iter().map(|&r| Load::Rate(r))).collect()
}

/// Prompts of the level at `index` of [`loads`] (seeded by its position, so distinct per level).
fn level_prompts(args: &BenchServeArgs, index: usize, vocab: usize) -> Vec<Vec<u32>> {
    args.prompts(1_000 + index, vocab)
}

/// A bar counting every measured request of the run, drawn on stderr only when it is a terminal.
fn progress_bar(total_requests: u64) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(Some(total_requests), ProgressDrawTarget::stderr());
    let style = ProgressStyle::with_template(
        "bench-serve [{elapsed_precise}] {bar:30} {pos}/{len} requests, {msg} (eta {eta})",
    )
    .expect("a valid progress template");
    bar.with_style(style)
}

/// Runs the benchmark and returns what to print.
pub fn run(args: &BenchServeArgs) -> anyhow::Result<String> {
    anyhow::ensure!(
        args.requests > 0 && args.prompt_len > 0 && args.max_tokens > 0,
        "--requests, --prompt-len and --max-tokens must be > 0"
    );
    anyhow::ensure!(
        args.concurrency.iter().all(|&c| c > 0),
        "concurrency levels must be > 0"
    );
    anyhow::ensure!(
        args.rates.iter().all(|&r| r.is_finite() && r > 0.0),
        "--rates must be finite and > 0 requests/s, got {:?}",
        args.rates
    );
    anyhow::ensure!(
        args.slo_ttft_ms > 0.0 && args.slo_itl_ms > 0.0,
        "--slo-ttft-ms and --slo-itl-ms must be > 0"
    );
    if let Some(dir) = &args.plot_dir {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("--plot-dir {}: cannot create it", dir.display()))?;
    }
    args.device.check()?;
    let model = match &args.model {
        Some(m) => m.clone(),
        None => crate::fetch::ensure_default_model()?,
    };
    let vocab = tandem_engine::ModelConfig::from_path(&model)?.vocab_size;
    if args.mode == Mode::Telemetry {
        return crate::bench_telemetry::run(args, &model, vocab);
    }
    if args.mode == Mode::Placement {
        return crate::bench_placement::run(args, &model, vocab);
    }
    let slo = Slo { ttft_ms: args.slo_ttft_ms, itl_ms: args.slo_itl_ms };
    let mut report = Report {
        prompt_len: args.prompt_len,
        max_tokens: args.max_tokens,
        requests_per_level: args.requests,
        slo,
        disaggregated: vec![],
        colocated: vec![],
        kv: None,
    };
    let loads = loads(args);
    let sides = if args.mode == Mode::Both { 2 } else { 1 };
    let bar = progress_bar((sides * loads.len() * args.requests) as u64);
    if args.mode != Mode::Colocated {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        let free = |_: ()| -> anyhow::Result<std::net::SocketAddr> {
            Ok(crate::ports::free_loopback_addr()?)
        };
        // The cluster's data and logs are scratch: a temporary directory, removed afterwards
        // (never the source tree the benchmark happens to run in).
        let run_dir =
            std::env::temp_dir().join(format!("tandem-bench-serve-{}", std::process::id()));
        let up_args = UpArgs {
            grpc: free(())?,
            http: free(())?,
            run_dir: Some(run_dir.clone()),
            cluster: format!("bench-{}", std::process::id()),
            model: Some(model.clone()),
            device: args.device,
            no_cuda_ipc: args.no_cuda_ipc,
            no_sample: true,
            exit_after_sample: true,
            trace: tandem_telemetry::TraceArgs::default(),
            ..UpArgs::defaults()
        };
        let interrupt = up::Interrupt::install(&rt)?;
        bar.set_message("starting the 1P+1D cluster");
        let mut cluster =
            up::start(&up_args, &rt, &interrupt).context("starting the local 1P+1D cluster")?;
        // Warm-up: one request through the whole path.
        rt.block_on(disaggregated_level(up_args.grpc, 1, args.prompts(0, vocab)[..1].to_vec(), 4))?;
        for (i, &load) in loads.iter().enumerate() {
            bar.set_message(format!("disaggregated, {load}"));
            let (samples, wall) = rt.block_on(drive::disaggregated(
                up_args.grpc,
                load,
                level_prompts(args, i, vocab),
                args.max_tokens as u32,
                Some(&bar),
            ))?;
            let level = stats::summarize(load, &samples, wall, &slo);
            bar.suspend(|| progress("disaggregated", &level));
            report.disaggregated.push(level);
        }
        match cluster.node_metrics_urls(&rt) {
            Ok(urls) => report.kv = Some(KvMoved::scrape(&urls, &rt)),
            Err(e) => eprintln!("bench-serve: the nodes' KV counters could not be read: {e:#}"),
        }
        cluster.shutdown();
        let _ = std::fs::remove_dir_all(&run_dir);
    }
    if args.mode != Mode::Disaggregated {
        let eargs = EngineArgs {
            model: Some(model.clone()),
            device: args.device,
            ..<EngineArgsDefaults as clap::Parser>::parse_from(["x"]).engine
        };
        bar.set_message("loading the colocated engine");
        let mut engine = engine_from_args(&eargs)?;
        let warm = args.prompts(0, vocab)[..1].to_vec();
        drive::colocated(&mut engine, Load::Concurrency(1), warm, 4, 1 << 40, None)?;
        for (i, &load) in loads.iter().enumerate() {
            bar.set_message(format!("colocated, {load}"));
            let prompts = level_prompts(args, i, vocab);
            let id0 = ((i + 1) as u64) << 32;
            let (samples, wall) =
                drive::colocated(&mut engine, load, prompts, args.max_tokens, id0, Some(&bar))?;
            let level = stats::summarize(load, &samples, wall, &slo);
            bar.suspend(|| progress("colocated", &level));
            report.colocated.push(level);
        }
    }
    bar.finish_and_clear();
    if let Some(dir) = &args.plot_dir {
        for written in draw(&report, dir)? {
            eprintln!("bench-serve: wrote {}", written.display());
        }
    }
    if args.json {
        return Ok(serde_json::to_string(&report)?);
    }
    Ok(table(args, &report, &loads))
}

/// Draws one PNG per load kind that has levels; returns the files written.
fn draw(report: &Report, dir: &std::path::Path) -> anyhow::Result<Vec<PathBuf>> {
    let mut written = Vec::new();
    let kinds: [(&str, fn(&Level) -> bool, &str); 2] = [
        ("bench-serve-concurrency.png", |l| l.concurrency.is_some(), "closed loop, concurrency sweep"),
        ("bench-serve-rate.png", |l| l.rate_req_s.is_some(), "open loop, Poisson arrival rate sweep"),
    ];
    for (file, is_kind, what) in kinds {
        let sides: Vec<plot::Side> = [
            ("disaggregated (1 prefill + 1 decode + router)", &report.disaggregated, BLUE),
            ("colocated (one engine)", &report.colocated, RED),
        ]
        .into_iter()
        .map(|(name, levels, color)| plot::Side {
            name,
            levels: levels.iter().filter(|l| is_kind(l)).collect(),
            color,
        })
        .filter(|s| !s.levels.is_empty())
        .collect();
        if sides.is_empty() {
            continue;
        }
        let title = format!(
            "tandem bench-serve: {what}; {}-token prompts, {} output tokens, {} requests per level",
            report.prompt_len, report.max_tokens, report.requests_per_level
        );
        let path = dir.join(file);
        plot::curves(&path, &title, &sides)?;
        written.push(path);
    }
    Ok(written)
}

/// The human-readable report: one block per side, a row per level.
fn table(args: &BenchServeArgs, report: &Report, loads: &[Load]) -> String {
    let mut s = format!(
        "serving benchmark: {} requests per level, {}-token prompts, {} output tokens, greedy; \
         SLO: TTFT ≤ {} ms and ITL ≤ {} ms\n",
        args.requests, args.prompt_len, args.max_tokens, report.slo.ttft_ms, report.slo.itl_ms
    );
    let sides = [
        ("disaggregated (1 prefill + 1 decode + router)", &report.disaggregated),
        ("colocated (one engine, in-process)", &report.colocated),
    ];
    for (name, levels) in sides {
        if levels.is_empty() {
            continue;
        }
        s += &format!(
            "\n{name}\n{:>12} | {:>23} | {:>20} | {:>23} | {:>7} {:>7} {:>7} {:>5}\n",
            "load",
            "TTFT p50/p90/p99 ms",
            "ITL p50/p90/p99 ms",
            "e2e p50/p90/p99 ms",
            "tok/s",
            "req/s",
            "good/s",
            "SLO"
        );
        for (load, l) in loads.iter().zip(levels) {
            s += &format!(
                "{:>12} | {:>7.0} {:>7.0} {:>7.0} | {:>6.1} {:>6.1} {:>6.1} | {:>7.0} {:>7.0} {:>7.0} | \
                 {:>7.1} {:>7.2} {:>7.2} {:>4.0}%\n",
                load.label(),
                l.ttft_p50_ms,
                l.ttft_p90_ms,
                l.ttft_p99_ms,
                l.itl_p50_ms,
                l.itl_p90_ms,
                l.itl_p99_ms,
                l.e2e_p50_ms,
                l.e2e_p90_ms,
                l.e2e_p99_ms,
                l.output_tok_s,
                l.throughput_req_s,
                l.goodput_req_s,
                l.slo_attainment * 100.0
            );
        }
    }
    if let Some(kv) = &report.kv {
        s += "\n";
        s += &kv.line();
    }
    s
}

/// One progress line per finished level on stderr (stdout carries only the report).
/// Parses the engine's defaults (clap holds them) for the colocated run.
#[derive(clap::Parser)]
struct EngineArgsDefaults {
    #[command(flatten)]
    engine: EngineArgs,
}
