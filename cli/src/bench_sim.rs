//! `tandem bench-sim`: `tandem sim` checked against the real cluster it predicts.
//!
//! A local 1 prefill + 1 decode cluster (real processes, as `tandem up` starts them) with every
//! prompt through the prefill node and a KV push (`--disaggregation always`: the path the
//! simulation models), and beside it, in this process, the engine measured alone by
//! `bench-engine` while the cluster is idle. Then, in each of `--rounds` rounds:
//!
//! 1. **Calibrate** on the predicted path: prompts of two tokens, one at a time; their TTFT less
//!    one engine pass is the time outside the engines (ingress, tokenizing, routing, the hops:
//!    `--overhead-ms` of the simulation), and the mean KV push they cost (the nodes' transfer
//!    counters) is the transfer tail after a prompt's last chunk (`--transfer-ms`).
//! 2. **Profile** the engine: `bench-engine` at the prompt length and at each concurrency's batch.
//! 3. **Serve** each `--concurrency` level closed loop (`c` clients, each sending its next request
//!    when the last ended), distinct seeded prompts of `--prompt-len` tokens (no prefix-cache
//!    hits), `--max-tokens` each.
//! 4. **Simulate** the same: 1 prefill + 1 decode instance with the round's profile, overhead
//!    and transfer, `c` closed-loop clients.
//!
//! Reported per level: the real and simulated TTFT p50 and ITL p50 of every round, and the median
//! over rounds of simulated / real. The shared machine's speed drifts within a minute, which is
//! why each round's simulation uses that round's own measurements. This is a benchmark: its
//! figures depend on the machine, and `--check` (exit non-zero when a median ratio is outside
//! `--tolerance`) is for a person or a bench script to ask for, never for the test suite.

use std::net::SocketAddr;

use anyhow::Context;
use clap::{Args, Parser};
use serde::Serialize;

use crate::bench_engine::BenchEngineArgs;
use crate::serving::{self, Load, Slo};
use crate::up::{self, UpArgs};

/// Flags of `tandem bench-sim`.
#[derive(Args, Debug, Clone)]
pub struct BenchSimArgs {
    /// Concurrency levels (closed-loop clients), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,4,8")]
    pub concurrency: Vec<usize>,
    /// Rounds (each: calibrate, profile, serve every level, simulate it).
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Requests per client in each level.
    #[arg(long, default_value_t = 3)]
    pub requests_per_client: usize,
    /// Prompt length in tokens.
    #[arg(long, default_value_t = 160)]
    pub prompt_len: usize,
    /// Output tokens per request.
    #[arg(long, default_value_t = 24)]
    pub max_tokens: usize,
    /// With `--check`: the largest |simulated / real − 1| a level's median may show.
    #[arg(long, default_value_t = 0.2)]
    pub tolerance: f64,
    /// Exit non-zero when a level's median ratio is outside `--tolerance`.
    #[arg(long)]
    pub check: bool,
    /// JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Model (default: the cached SmolLM2-135M-Instruct).
    #[arg(long, env = "TANDEM_MODEL")]
    pub model: Option<std::path::PathBuf>,
}

/// One level of one round: the real cluster beside the simulation.
#[derive(Clone, Debug, Serialize)]
pub struct Point {
    /// Closed-loop clients.
    pub concurrency: usize,
    /// Real TTFT p50, ms.
    pub real_ttft_ms: f64,
    /// Simulated TTFT p50, ms.
    pub sim_ttft_ms: f64,
    /// Real inter-token latency p50 (per-request means), ms.
    pub real_itl_ms: f64,
    /// Simulated inter-token latency p50, ms.
    pub sim_itl_ms: f64,
}

/// What one round measured before serving.
#[derive(Clone, Debug, Serialize)]
pub struct Calibration {
    /// Time outside the engines per request, ms (the simulation's `--overhead-ms`).
    pub overhead_ms: f64,
    /// Mean KV push of a two-token prompt, ms (the simulation's `--transfer-ms`).
    pub transfer_ms: f64,
    /// The engine alone: prefill tokens/s at `--prompt-len`.
    pub prefill_tok_s: f64,
    /// The engine alone: batch-1 decode tokens/s.
    pub decode_tok_s_batch1: f64,
}

/// The median over rounds at one level.
#[derive(Clone, Debug, Serialize)]
pub struct Summary {
    /// Closed-loop clients.
    pub concurrency: usize,
    /// Median of simulated / real TTFT p50.
    pub ttft_ratio: f64,
    /// Median of simulated / real ITL p50.
    pub itl_ratio: f64,
    /// Both within `--tolerance`.
    pub within_tolerance: bool,
}

/// The whole report.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// Prompt tokens (as the router counted them).
    pub prompt_tokens: usize,
    /// Output tokens per request.
    pub max_tokens: usize,
    /// The tolerance the summary was judged by.
    pub tolerance: f64,
    /// Per round: its calibration and its points.
    pub rounds: Vec<(Calibration, Vec<Point>)>,
    /// Per level: the medians.
    pub summary: Vec<Summary>,
}

#[derive(Parser)]
struct BenchEngineCli {
    #[command(flatten)]
    args: BenchEngineArgs,
}

#[derive(Parser)]
struct SimCli {
    #[command(flatten)]
    args: crate::sim::SimArgs,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// `bench-engine` in this process (the cluster idle): prefill at `prompt_len`, decode from a
/// prompt that long for `max_tokens` at each batch; its JSON.
fn profile(args: &BenchSimArgs, model: &std::path::Path) -> anyhow::Result<serde_json::Value> {
    let mut batches: Vec<usize> = args.concurrency.clone();
    batches.push(1);
    batches.sort_unstable();
    batches.dedup();
    let batch = batches.iter().map(|b| b.to_string()).collect::<Vec<_>>().join(",");
    let (len, out) = (args.prompt_len.to_string(), args.max_tokens.to_string());
    let cli = BenchEngineCli::try_parse_from([
        "bench-engine", "--format", "json", "--runs", "3", "--batch", &batch, "--prompt-len", &len,
        "--decode-prompt-len", &len, "--decode-tokens", &out, "--model",
    ]
    .into_iter()
    .map(std::ffi::OsString::from)
    .chain([model.as_os_str().to_owned()]))?;
    let json = crate::bench_engine::run(&cli.args)?;
    Ok(serde_json::from_str(&json)?)
}

/// `tandem sim` of 1 prefill + 1 decode instance with this round's measurements, `clients`
/// closed-loop clients: (TTFT p50, ITL p50), ms.
fn simulate(
    profile: &serde_json::Value,
    dir: &std::path::Path,
    cal: &Calibration,
    prompt_tokens: usize,
    args: &BenchSimArgs,
    clients: usize,
) -> anyhow::Result<(f64, f64)> {
    let path = dir.join(format!("profile-c{clients}.json"));
    std::fs::write(&path, profile.to_string())?;
    let cli = SimCli::try_parse_from(
        [
            "sim", "--gpus", "2", "--tp", "1", "--prefill-instances", "1", "--arrivals", "closed",
            "--clients", &clients.to_string(), "--duration-secs", "600", "--spread", "0",
            "--prompt-tokens", &prompt_tokens.to_string(), "--output-tokens",
            &args.max_tokens.to_string(), "--overhead-ms", &format!("{:.2}", cal.overhead_ms),
            "--transfer-ms", &format!("{:.2}", cal.transfer_ms), "--profile",
        ]
        .into_iter()
        .map(std::ffi::OsString::from)
        .chain([path.as_os_str().to_owned()]),
    )?;
    let cfg = crate::sim::config(&cli.args)?;
    let c = tandem_sim::compare(&cfg)?;
    let d = &c.disaggregated;
    Ok((d.ttft_s.p50 * 1e3, d.itl_s.p50 * 1e3))
}

/// Prompts of two tokens through the cluster, one at a time: (TTFT p50 ms, mean push ms).
fn calibrate(
    rt: &tokio::runtime::Runtime,
    grpc: SocketAddr,
    metrics: &[(String, String)],
    vocab: usize,
    round: usize,
) -> anyhow::Result<(f64, f64)> {
    let before = serving::KvMoved::scrape(metrics, rt);
    let tiny = serving::prompts(6, 2, 0x71D + round as u64, vocab);
    let level = rt.block_on(serving::disaggregated_level(grpc, 1, tiny, 2))?;
    let after = serving::KvMoved::scrape(metrics, rt);
    let transfers = after.transfers_received.saturating_sub(before.transfers_received);
    anyhow::ensure!(
        transfers > 0,
        "the calibration's prompts were not pushed by the prefill node (is disaggregation forced?)"
    );
    let push_ms = 1e3 * (after.transfer_seconds - before.transfer_seconds) / transfers as f64;
    Ok((level.ttft_p50_ms, push_ms))
}

/// Runs the benchmark; returns what to print.
pub fn run(args: &BenchSimArgs) -> anyhow::Result<String> {
    anyhow::ensure!(
        args.rounds > 0 && args.requests_per_client > 0 && args.prompt_len > 2 && args.max_tokens > 1,
        "--rounds and --requests-per-client must be > 0, --prompt-len > 2, --max-tokens > 1"
    );
    anyhow::ensure!(
        !args.concurrency.is_empty() && args.concurrency.iter().all(|&c| c > 0),
        "--concurrency levels must be > 0"
    );
    anyhow::ensure!(args.tolerance > 0.0, "--tolerance must be > 0");
    let model = match &args.model {
        Some(m) => m.clone(),
        None => crate::fetch::ensure_default_model()?,
    };
    let vocab = tandem_engine::ModelConfig::from_path(&model)?.vocab_size;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let free = || -> anyhow::Result<SocketAddr> { Ok(crate::ports::free_loopback_addr()?) };
    let run_dir = std::env::temp_dir().join(format!("tandem-bench-sim-{}", std::process::id()));
    let up_args = UpArgs {
        grpc: free()?,
        http: free()?,
        run_dir: Some(run_dir.clone()),
        cluster: format!("bench-sim-{}", std::process::id()),
        model: Some(model.clone()),
        no_sample: true,
        exit_after_sample: true,
        // The path the simulation models: every prompt computed by the prefill node and pushed.
        disaggregation: Some(tandem_router::routing::DisaggregationMode::Always),
        trace: tandem_telemetry::TraceArgs::default(),
        ..UpArgs::defaults()
    };
    let interrupt = up::Interrupt::install(&rt)?;
    eprintln!("bench-sim: starting the 1P+1D cluster");
    let mut cluster = up::start(&up_args, &rt, &interrupt).context("starting the local 1P+1D cluster")?;
    let result = (|| -> anyhow::Result<Report> {
        let metrics = cluster.node_metrics_urls(&rt)?;
        // Warm-up: one request through the whole path.
        rt.block_on(serving::disaggregated_level(up_args.grpc, 1, serving::prompts(1, args.prompt_len, 7, vocab), 4))?;
        let sim_dir = run_dir.join("bench-sim");
        std::fs::create_dir_all(&sim_dir)?;
        let mut rounds = Vec::new();
        for round in 0..args.rounds {
            let (tiny_ttft_ms, transfer_ms) = calibrate(&rt, up_args.grpc, &metrics, vocab, round)?;
            let prof = profile(args, &model)?;
            let tok_s = |v: &serde_json::Value| v.as_f64().context("bench-engine JSON: a rate is missing");
            let decode1 = tok_s(&prof["decode_tok_s"]["1"])?;
            // A prompt of two tokens is one bandwidth-bound pass, as long as a batch-1 decode
            // step (the weights are read once either way); the rest of its TTFT is overhead.
            let cal = Calibration {
                overhead_ms: (tiny_ttft_ms - 1e3 / decode1).max(0.0),
                transfer_ms,
                prefill_tok_s: tok_s(&prof["prefill_tok_s"])?,
                decode_tok_s_batch1: decode1,
            };
            eprintln!(
                "bench-sim: round {}: overhead {:.1} ms, KV push {:.2} ms, engine prefill {:.0} tok/s, decode {:.1} tok/s",
                round + 1, cal.overhead_ms, cal.transfer_ms, cal.prefill_tok_s, cal.decode_tok_s_batch1
            );
            let mut points = Vec::new();
            for (i, &c) in args.concurrency.iter().enumerate() {
                let seed = 0x5133 + (round * 100 + i) as u64;
                let prompts = serving::prompts(c * args.requests_per_client, args.prompt_len, seed, vocab);
                let (samples, wall) = rt.block_on(serving::drive::disaggregated(
                    up_args.grpc,
                    Load::Concurrency(c),
                    prompts,
                    args.max_tokens as u32,
                    None,
                ))?;
                let real = serving::summarize(Load::Concurrency(c), &samples, wall, &Slo::default());
                let (sim_ttft_ms, sim_itl_ms) = simulate(&prof, &sim_dir, &cal, args.prompt_len, args, c)?;
                let p = Point {
                    concurrency: c,
                    real_ttft_ms: real.ttft_p50_ms,
                    sim_ttft_ms,
                    real_itl_ms: real.itl_p50_ms,
                    sim_itl_ms,
                };
                eprintln!(
                    "bench-sim: round {}, c={c}: TTFT real {:.1} ms, simulated {:.1} ms; ITL real {:.1} ms, simulated {:.1} ms",
                    round + 1, p.real_ttft_ms, p.sim_ttft_ms, p.real_itl_ms, p.sim_itl_ms
                );
                points.push(p);
            }
            rounds.push((cal, points));
        }
        let summary = args
            .concurrency
            .iter()
            .enumerate()
            .map(|(i, &c)| {
                let ratio = |f: fn(&Point) -> f64| median(rounds.iter().map(|(_, p)| f(&p[i])).collect());
                let ttft_ratio = ratio(|p| p.sim_ttft_ms / p.real_ttft_ms);
                let itl_ratio = ratio(|p| p.sim_itl_ms / p.real_itl_ms);
                let within = |r: f64| (r - 1.0).abs() <= args.tolerance;
                Summary { concurrency: c, ttft_ratio, itl_ratio, within_tolerance: within(ttft_ratio) && within(itl_ratio) }
            })
            .collect();
        Ok(Report {
            prompt_tokens: args.prompt_len,
            max_tokens: args.max_tokens,
            tolerance: args.tolerance,
            rounds,
            summary,
        })
    })();
    cluster.shutdown();
    let _ = std::fs::remove_dir_all(&run_dir);
    let report = result?;
    let text = if args.json { serde_json::to_string(&report)? } else { table(&report) };
    if args.check && report.summary.iter().any(|s| !s.within_tolerance) {
        anyhow::bail!("{text}\nbench-sim: a level's simulated/real median is outside ±{:.0}%", args.tolerance * 1e2);
    }
    Ok(text)
}

fn table(r: &Report) -> String {
    let mut s = format!(
        "tandem sim vs the real 1P+1D cluster (every prompt through the prefill node): {}-token \
         prompts, {} output tokens, closed loop; medians over {} rounds of simulated / real\n\
         {:>6} | {:>12} {:>12} | {:>8}\n",
        r.prompt_tokens,
        r.max_tokens,
        r.rounds.len(),
        "c",
        "TTFT p50",
        "ITL p50",
        format!("±{:.0}%", r.tolerance * 1e2)
    );
    for x in &r.summary {
        s += &format!(
            "{:>6} | {:>12.3} {:>12.3} | {:>8}\n",
            x.concurrency,
            x.ttft_ratio,
            x.itl_ratio,
            if x.within_tolerance { "within" } else { "outside" }
        );
    }
    s
}
