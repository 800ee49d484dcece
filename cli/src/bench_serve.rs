//! `tandem bench-serve`: a short serving benchmark, disaggregated vs colocated, side by side.
//!
//! - **Disaggregated**: a local cluster started as `tandem up` does (1 prefill + 1 decode node
//!   and the router, real processes), driven over the router's gRPC ingress.
//! - **Colocated**: one engine doing prefill and decode, in this process, driven the same way
//!   (no RPC, no KV transfer): the baseline disaggregation is measured against.
//!
//! Load: closed-loop clients, `c` at a time for each `--concurrency c`, each sending the next
//! request as soon as its previous one finished, `--requests` per level, every prompt
//! `--prompt-len` seeded random tokens (distinct, so no prefix-cache hits) and `--max-tokens`
//! output tokens (EOS ignored). Reported per level: TTFT median and p90, inter-token latency
//! median, end-to-end median, and output tokens/s over the level's wall time.
//! On a 2-core machine both nodes and the router share the cores the colocated engine has to
//! itself: the comparison shows the cost of disaggregation there, not its benefit at scale.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Args, ValueEnum};
use serde::Serialize;
use tandem_engine::rng::Rng;
use tandem_engine::{EngineArgs, Priority, Request, SamplingParams};
use tandem_proto::v1::inference_client::InferenceClient;
use tandem_proto::v1::{GenerateRequest, TokenIds, generate_request, generate_response};

use crate::load::engine_from_args;
use crate::up::{self, UpArgs};

/// Which side(s) to run.
#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum Mode {
    /// Both, side by side.
    Both,
    /// Only the local 1P+1D cluster.
    Disaggregated,
    /// Only the in-process engine.
    Colocated,
    /// What observability costs: the 1P+1D cluster with telemetry off, traced (every request
    /// sampled, exported to a local OTLP receiver) and scraped (every process's /metrics read
    /// once a second), in alternating rounds.
    Telemetry,
    /// Conditional disaggregation: the 1P+1D cluster with every prompt computed by the decode
    /// node, and with every prompt through the prefill node, at each `--prompt-lens`, in
    /// alternating rounds (where the default `--local-prefill-max-tokens` comes from).
    Placement,
}

/// Flags of `tandem bench-serve`.
#[derive(Args, Debug, Clone)]
pub struct BenchServeArgs {
    /// Concurrency levels, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    pub concurrency: Vec<usize>,
    /// Requests per concurrency level.
    #[arg(long, default_value_t = 16)]
    pub requests: usize,
    /// Prompt length in tokens.
    #[arg(long, default_value_t = 128)]
    pub prompt_len: usize,
    /// Output tokens per request.
    #[arg(long, default_value_t = 64)]
    pub max_tokens: usize,
    /// What to run.
    #[arg(long, value_enum, default_value_t = Mode::Both)]
    pub mode: Mode,
    /// JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Model (default: the cached SmolLM2-135M-Instruct).
    #[arg(long, env = "TANDEM_MODEL")]
    pub model: Option<std::path::PathBuf>,
    /// Rounds of each configuration with `--mode telemetry` or `placement` (alternating;
    /// medians reported).
    #[arg(long, default_value_t = 2)]
    pub rounds: usize,
    /// Prompt lengths `--mode placement` sweeps (each computed by the decode node, and by the
    /// prefill node).
    #[arg(long, value_delimiter = ',', default_value = "16,64,256")]
    pub prompt_lens: Vec<usize>,
}

/// One request's timings.
#[derive(Clone, Copy, Debug)]
struct Sample {
    ttft: Duration,
    e2e: Duration,
    tokens: usize,
}

/// Figures of one concurrency level.
#[derive(Clone, Debug, Serialize)]
pub struct Level {
    /// Clients at once.
    pub concurrency: usize,
    /// Median time to first token, ms.
    pub ttft_p50_ms: f64,
    /// 90th percentile time to first token, ms.
    pub ttft_p90_ms: f64,
    /// Median inter-token latency, ms.
    pub itl_p50_ms: f64,
    /// Median end-to-end latency, ms.
    pub e2e_p50_ms: f64,
    /// Output tokens per second over the level's wall time.
    pub output_tok_s: f64,
    /// Requests that finished.
    pub requests: usize,
    /// Output tokens received, all requests together.
    pub output_tokens: usize,
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

fn summarize(concurrency: usize, samples: &[Sample], wall: Duration) -> Level {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let mut ttft: Vec<f64> = samples.iter().map(|s| ms(s.ttft)).collect();
    let mut e2e: Vec<f64> = samples.iter().map(|s| ms(s.e2e)).collect();
    let mut itl: Vec<f64> = samples
        .iter()
        .filter(|s| s.tokens > 1)
        .map(|s| ms(s.e2e - s.ttft) / (s.tokens - 1) as f64)
        .collect();
    let tokens: usize = samples.iter().map(|s| s.tokens).sum();
    Level {
        concurrency,
        ttft_p50_ms: pct(&mut ttft, 0.5),
        ttft_p90_ms: pct(&mut ttft, 0.9),
        itl_p50_ms: if itl.is_empty() {
            0.0
        } else {
            pct(&mut itl, 0.5)
        },
        e2e_p50_ms: pct(&mut e2e, 0.5),
        output_tok_s: tokens as f64 / wall.as_secs_f64(),
        requests: samples.len(),
        output_tokens: tokens,
    }
}

pub(crate) fn prompts(args: &BenchServeArgs, level: usize, vocab: usize) -> Vec<Vec<u32>> {
    let mut rng = Rng::new(0xBE7C + level as u64);
    // Skip the 256 byte tokens where the vocabulary has more (ordinary text tokens).
    let first = if vocab > 512 { 256 } else { 0 };
    (0..args.requests)
        .map(|_| {
            (0..args.prompt_len)
                .map(|_| (first + rng.below((vocab - first) as u64) as usize) as u32)
                .collect()
        })
        .collect()
}

pub(crate) async fn disaggregated_level(
    grpc: std::net::SocketAddr,
    c: usize,
    prompts: Vec<Vec<u32>>,
    max_tokens: u32,
) -> anyhow::Result<Level> {
    let queue = std::sync::Arc::new(std::sync::Mutex::new(prompts));
    let t0 = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..c {
        let queue = queue.clone();
        workers.push(tokio::spawn(async move {
            let mut client = InferenceClient::connect(format!("http://{grpc}")).await?;
            let mut out = Vec::new();
            loop {
                let next = queue.lock().expect("queue lock").pop();
                let Some(ids) = next else { break };
                let req = GenerateRequest {
                    input: Some(generate_request::Input::TokenIds(TokenIds { ids })),
                    sampling: Some(tandem_proto::v1::SamplingParams {
                        max_tokens,
                        ignore_eos: true,
                        ..Default::default()
                    }),
                    ..Default::default()
                };
                let start = Instant::now();
                let mut stream = client.generate(req).await?.into_inner();
                let (mut ttft, mut tokens) = (None, 0);
                while let Some(m) = stream.message().await? {
                    if let Some(generate_response::Event::Delta(d)) = m.event
                        && !d.token_ids.is_empty() {
                            ttft.get_or_insert(start.elapsed());
                            tokens += d.token_ids.len();
                        }
                }
                out.push(Sample {
                    ttft: ttft.unwrap_or_default(),
                    e2e: start.elapsed(),
                    tokens,
                });
            }
            anyhow::Ok(out)
        }));
    }
    let mut samples = Vec::new();
    for w in workers {
        samples.extend(w.await??);
    }
    Ok(summarize(c, &samples, t0.elapsed()))
}

fn colocated_level(
    engine: &mut tandem_engine::Engine,
    c: usize,
    mut prompts: Vec<Vec<u32>>,
    max_tokens: usize,
    id0: u64,
) -> anyhow::Result<Level> {
    let mut live: HashMap<u64, (Instant, Option<Duration>, usize)> = HashMap::new();
    let mut samples = Vec::new();
    let mut next_id = id0;
    let t0 = Instant::now();
    loop {
        while live.len() < c {
            let Some(p) = prompts.pop() else { break };
            let params = SamplingParams {
                ignore_eos: true,
                ..SamplingParams::greedy(max_tokens)
            };
            engine.add_request(
                Request {
                    id: next_id,
                    prompt: p,
                    params,
                    priority: Priority::Interactive,
                },
                Instant::now(),
            )?;
            live.insert(next_id, (Instant::now(), None, 0));
            next_id += 1;
        }
        if live.is_empty() {
            break;
        }
        for o in engine.step()? {
            let e = live.get_mut(&o.request_id).expect("live request");
            e.1.get_or_insert(e.0.elapsed());
            e.2 += 1;
            if o.finished.is_some() {
                let (start, ttft, tokens) = live.remove(&o.request_id).expect("live request");
                samples.push(Sample {
                    ttft: ttft.unwrap_or_default(),
                    e2e: start.elapsed(),
                    tokens,
                });
            }
        }
    }
    Ok(summarize(c, &samples, t0.elapsed()))
}

#[derive(Serialize)]
struct Report {
    prompt_len: usize,
    max_tokens: usize,
    requests_per_level: usize,
    disaggregated: Vec<Level>,
    colocated: Vec<Level>,
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
    let mut report = Report {
        prompt_len: args.prompt_len,
        max_tokens: args.max_tokens,
        requests_per_level: args.requests,
        disaggregated: vec![],
        colocated: vec![],
    };
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
            no_sample: true,
            exit_after_sample: true,
            trace: tandem_telemetry::TraceArgs::default(),
            ..UpArgs::defaults()
        };
        let interrupt = up::Interrupt::install(&rt)?;
        let mut cluster =
            up::start(&up_args, &rt, &interrupt).context("starting the local 1P+1D cluster")?;
        // Warm-up: one request through the whole path.
        rt.block_on(disaggregated_level(
            up_args.grpc,
            1,
            prompts(args, 0, vocab)[..1].to_vec(),
            4,
        ))?;
        for &c in &args.concurrency {
            let level = rt.block_on(disaggregated_level(
                up_args.grpc,
                c,
                prompts(args, c, vocab),
                args.max_tokens as u32,
            ))?;
            progress("disaggregated", &level);
            report.disaggregated.push(level);
        }
        cluster.shutdown();
        let _ = std::fs::remove_dir_all(&run_dir);
    }
    if args.mode != Mode::Disaggregated {
        let eargs = EngineArgs {
            model: Some(model.clone()),
            ..<EngineArgsDefaults as clap::Parser>::parse_from(["x"]).engine
        };
        let mut engine = engine_from_args(&eargs)?;
        colocated_level(
            &mut engine,
            1,
            prompts(args, 0, vocab)[..1].to_vec(),
            4,
            1 << 40,
        )?;
        for &c in &args.concurrency {
            let level = colocated_level(
                &mut engine,
                c,
                prompts(args, c, vocab),
                args.max_tokens,
                (c as u64) << 32,
            )?;
            progress("colocated", &level);
            report.colocated.push(level);
        }
    }
    if args.json {
        return Ok(serde_json::to_string(&report)?);
    }
    let mut s = format!(
        "serving benchmark: {} requests per level, {}-token prompts, {} output tokens, greedy\n\
         {:>5} | {:^44} | {:^44}\n\
         {:>5} | {:>9} {:>9} {:>8} {:>8} {:>7} | {:>9} {:>9} {:>8} {:>8} {:>7}\n",
        args.requests,
        args.prompt_len,
        args.max_tokens,
        "",
        "disaggregated (1 prefill + 1 decode + router)",
        "colocated (one engine, in-process)",
        "conc",
        "TTFT p50",
        "TTFT p90",
        "ITL p50",
        "e2e p50",
        "tok/s",
        "TTFT p50",
        "TTFT p90",
        "ITL p50",
        "e2e p50",
        "tok/s"
    );
    let cell = |l: Option<&Level>| match l {
        Some(l) => format!(
            "{:>7.1}ms {:>7.1}ms {:>6.1}ms {:>6.0}ms {:>7.1}",
            l.ttft_p50_ms, l.ttft_p90_ms, l.itl_p50_ms, l.e2e_p50_ms, l.output_tok_s
        ),
        None => format!("{:>44}", "-"),
    };
    for (i, &c) in args.concurrency.iter().enumerate() {
        s += &format!(
            "{c:>5} | {} | {}\n",
            cell(report.disaggregated.get(i)),
            cell(report.colocated.get(i))
        );
    }
    Ok(s)
}

/// One progress line per finished level on stderr (stdout carries only the report).
pub(crate) fn progress(side: &str, l: &Level) {
    eprintln!(
        "bench-serve: {side} concurrency {} done: TTFT p50 {:.1} ms, {:.1} output tok/s",
        l.concurrency, l.ttft_p50_ms, l.output_tok_s
    );
}

/// Parses the engine's defaults (clap holds them) for the colocated run.
#[derive(clap::Parser)]
struct EngineArgsDefaults {
    #[command(flatten)]
    engine: EngineArgs,
}
