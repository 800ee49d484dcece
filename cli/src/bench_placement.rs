//! `tandem bench-serve --mode placement`: what conditional disaggregation buys, measured side by
//! side in one run. The same local 1 prefill + 1 decode cluster serves the same closed-loop load
//! in two configurations, in alternating rounds:
//! - **decode node**: `--local-prefill-max-tokens` above every prompt, so the decode node computes
//!   each prompt itself (no prefill call, no KV transfer);
//! - **prefill node**: `--disaggregation always`, every prompt through the prefill node.
//!
//! For each `--prompt-lens` length and `--concurrency` level: the median over rounds of TTFT p50,
//! ITL p50 and output tokens/s for each configuration, and the decode node's TTFT as a ratio of
//! the prefill node's. The longest length where computing on the decode node still wins is what
//! the router's default `--local-prefill-max-tokens` is set from.

use std::path::Path;

use anyhow::Context;
use serde::Serialize;
use tandem_router::routing::DisaggregationMode;

use crate::bench_serve::args::BenchServeArgs;
use crate::serving::{Level, disaggregated_level, progress};
use crate::up::{self, Interrupt, UpArgs};

/// Where the prompts were computed.
const CONFIGS: [&str; 2] = ["decode_node", "prefill_node"];

/// One prompt length and concurrency level: both configurations, medians over rounds.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    /// Prompt tokens.
    pub prompt_len: usize,
    /// Clients at once.
    pub concurrency: usize,
    /// TTFT p50 with the decode node computing the prompt, ms.
    pub decode_node_ttft_p50_ms: f64,
    /// TTFT p50 through the prefill node, ms.
    pub prefill_node_ttft_p50_ms: f64,
    /// The first over the second (below 1: computing on the decode node is faster).
    pub ttft_ratio: f64,
    /// ITL p50 with the decode node computing prompts, ms.
    pub decode_node_itl_p50_ms: f64,
    /// ITL p50 through the prefill node, ms.
    pub prefill_node_itl_p50_ms: f64,
    /// Output tokens/s with the decode node computing prompts.
    pub decode_node_tok_s: f64,
    /// Output tokens/s through the prefill node.
    pub prefill_node_tok_s: f64,
}

#[derive(Serialize)]
struct Report {
    rounds: usize,
    requests_per_level: usize,
    max_tokens: usize,
    rows: Vec<Row>,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// Runs the comparison (see the module docs).
pub fn run(args: &BenchServeArgs, model: &Path, vocab: usize) -> anyhow::Result<String> {
    anyhow::ensure!(args.rounds > 0, "--rounds must be > 0");
    anyhow::ensure!(
        !args.prompt_lens.is_empty() && args.prompt_lens.iter().all(|&n| n > 0),
        "--prompt-lens must list lengths > 0"
    );
    let longest = *args.prompt_lens.iter().max().expect("not empty");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let interrupt = Interrupt::install(&rt)?;
    let cells = args.prompt_lens.len() * args.concurrency.len();
    // results[config][cell] = one level per round
    let mut results: Vec<Vec<Vec<Level>>> = vec![vec![Vec::new(); cells]; CONFIGS.len()];
    for round in 0..args.rounds {
        for (ci, config) in CONFIGS.iter().enumerate() {
            let free = || -> anyhow::Result<std::net::SocketAddr> {
                Ok(crate::ports::free_loopback_addr()?)
            };
            let run_dir = std::env::temp_dir().join(format!(
                "tandem-bench-placement-{}-{round}-{config}",
                std::process::id()
            ));
            let (disaggregation, local_max) = match *config {
                "decode_node" => (DisaggregationMode::Conditional, Some(longest as u32)),
                _ => (DisaggregationMode::Always, None),
            };
            let up_args = UpArgs {
                grpc: free()?,
                http: free()?,
                run_dir: Some(run_dir.clone()),
                cluster: format!("bench-placement-{}", std::process::id()),
                model: Some(model.to_path_buf()),
                device: args.device,
                no_sample: true,
                exit_after_sample: true,
                disaggregation: Some(disaggregation),
                local_prefill_max_tokens: local_max,
                trace: tandem_telemetry::TraceArgs::default(),
                ..UpArgs::defaults()
            };
            let mut cluster = up::start(&up_args, &rt, &interrupt)
                .with_context(|| format!("starting the {config} cluster"))?;
            // Warm-up: one request through the whole path.
            let warm = BenchServeArgs {
                prompt_len: args.prompt_lens[0],
                ..args.clone()
            };
            rt.block_on(disaggregated_level(
                up_args.grpc,
                1,
                warm.prompts(0, vocab)[..1].to_vec(),
                4,
            ))?;
            for (li, &len) in args.prompt_lens.iter().enumerate() {
                let at_len = BenchServeArgs {
                    prompt_len: len,
                    ..args.clone()
                };
                for (k, &c) in args.concurrency.iter().enumerate() {
                    // Distinct prompts per level and round: no prefix-cache hits.
                    let seed = (round * 1000 + li * 100 + k) + 1;
                    let level = rt.block_on(disaggregated_level(
                        up_args.grpc,
                        c,
                        at_len.prompts(seed, vocab),
                        args.max_tokens as u32,
                    ))?;
                    progress(&format!("round {round} {config} prompt {len}"), &level);
                    results[ci][li * args.concurrency.len() + k].push(level);
                }
            }
            cluster.shutdown();
            let _ = std::fs::remove_dir_all(&run_dir);
        }
    }
    let mut rows = Vec::new();
    for (li, &len) in args.prompt_lens.iter().enumerate() {
        for (k, &c) in args.concurrency.iter().enumerate() {
            let cell = li * args.concurrency.len() + k;
            let m =
                |ci: usize, f: fn(&Level) -> f64| median(results[ci][cell].iter().map(f).collect());
            let (here, there) = (m(0, |l| l.ttft_p50_ms), m(1, |l| l.ttft_p50_ms));
            rows.push(Row {
                prompt_len: len,
                concurrency: c,
                decode_node_ttft_p50_ms: here,
                prefill_node_ttft_p50_ms: there,
                ttft_ratio: here / there,
                decode_node_itl_p50_ms: m(0, |l| l.itl_p50_ms),
                prefill_node_itl_p50_ms: m(1, |l| l.itl_p50_ms),
                decode_node_tok_s: m(0, |l| l.output_tok_s),
                prefill_node_tok_s: m(1, |l| l.output_tok_s),
            });
        }
    }
    let report = Report {
        rounds: args.rounds,
        requests_per_level: args.requests,
        max_tokens: args.max_tokens,
        rows,
    };
    if args.json {
        return Ok(serde_json::to_string(&report)?);
    }
    let mut s = format!(
        "conditional disaggregation: prompts computed by the decode node vs through the prefill \
         node (1P+1D), {} requests per level, {} output tokens, greedy; medians of {} \
         alternating rounds\n\
         {:>6} {:>5} | {:>17} {:>17} {:>6} | {:>15} {:>15} | {:>13} {:>13}\n",
        args.requests,
        args.max_tokens,
        args.rounds,
        "prompt",
        "conc",
        "TTFT p50 decode",
        "TTFT p50 prefill",
        "ratio",
        "ITL p50 decode",
        "ITL p50 prefill",
        "tok/s decode",
        "tok/s prefill",
    );
    for r in &report.rows {
        s += &format!(
            "{:>6} {:>5} | {:>15.1}ms {:>15.1}ms {:>6.2} | {:>13.1}ms {:>13.1}ms | {:>13.1} {:>13.1}\n",
            r.prompt_len,
            r.concurrency,
            r.decode_node_ttft_p50_ms,
            r.prefill_node_ttft_p50_ms,
            r.ttft_ratio,
            r.decode_node_itl_p50_ms,
            r.prefill_node_itl_p50_ms,
            r.decode_node_tok_s,
            r.prefill_node_tok_s,
        );
    }
    Ok(s)
}
