//! `tandem bench-prefix`: routing by cache against the policies that ignore it, on a local
//! cluster of real processes (`tandem up --prefill N --decode 1 --prefill-policy P`), each
//! policy on a fresh cluster with the same workload.
//!
//! The workload: `--systems` system prompts of `--system-tokens` tokens, `--questions`
//! questions of `--question-tokens` tokens each, every request a system prompt plus one of its
//! questions, in a seeded random order, `--concurrency` requests at a time.
//! Reported per policy: TTFT p50/p90, requests and output tokens per second, and the prompt
//! tokens served from a prefix cache against the ideal (every request after the first of its
//! system reusing the system prompt's full blocks).

use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use serde::Serialize;
use tandem_engine::rng::Rng;
use tandem_proto::v1::inference_client::InferenceClient;
use tandem_proto::v1::generate_response;
use tandem_router::routing::PrefillPolicy;

use crate::serving::drive::fixed_length_request;
use crate::up::{self, UpArgs};

/// `tandem bench-prefix` flags.
#[derive(Args, Clone, Debug)]
pub struct BenchPrefixArgs {
    /// Policies to compare, each on a fresh cluster.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "prefix-aware,round-robin"
    )]
    pub policies: Vec<PrefillPolicy>,
    /// Prefill nodes.
    #[arg(long, default_value_t = 2)]
    pub prefill: usize,
    /// Distinct system prompts.
    #[arg(long, default_value_t = 8)]
    pub systems: usize,
    /// Tokens of each system prompt.
    #[arg(long, default_value_t = 1000)]
    pub system_tokens: usize,
    /// Questions per system prompt.
    #[arg(long, default_value_t = 6)]
    pub questions: usize,
    /// Tokens of each question.
    #[arg(long, default_value_t = 24)]
    pub question_tokens: usize,
    /// Output tokens per request.
    #[arg(long, default_value_t = 8)]
    pub max_tokens: u32,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 4)]
    pub concurrency: usize,
    /// The GGUF model [default: the cached default model].
    #[arg(long)]
    pub model: Option<std::path::PathBuf>,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// One policy's figures.
#[derive(Clone, Debug, Serialize)]
pub struct PolicyResult {
    /// The policy.
    pub policy: String,
    /// Requests completed.
    pub requests: usize,
    /// Time to first token, median, ms.
    pub ttft_p50_ms: f64,
    /// Time to first token, 90th percentile, ms.
    pub ttft_p90_ms: f64,
    /// Completed requests per second.
    pub requests_per_s: f64,
    /// Output tokens per second.
    pub output_tokens_per_s: f64,
    /// Prompt tokens served from a prefix cache.
    pub cached_tokens: u64,
    /// The most that could be: every request after its system's first reusing the system
    /// prompt's full blocks.
    pub ideal_cached_tokens: u64,
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(((v.len().max(1) - 1) as f64 * p).round() as usize)
        .copied()
        .unwrap_or(0.0)
}

/// The requests, in the order they are sent (a seeded shuffle).
fn workload(args: &BenchPrefixArgs, vocab: usize) -> Vec<(usize, Vec<u32>)> {
    let first = if vocab > 512 { 256 } else { 0 };
    let mut rng = Rng::new(0x5EED_0F_u64);
    let mut ids = |n: usize| -> Vec<u32> {
        (0..n)
            .map(|_| (first + rng.below((vocab - first) as u64) as usize) as u32)
            .collect()
    };
    let systems: Vec<Vec<u32>> = (0..args.systems).map(|_| ids(args.system_tokens)).collect();
    let mut out = Vec::new();
    for _ in 0..args.questions {
        for (s, system) in systems.iter().enumerate() {
            let mut prompt = system.clone();
            prompt.extend(ids(args.question_tokens));
            out.push((s, prompt));
        }
    }
    // Arrivals in a random (seeded) order, as users ask: no policy gets a fixed pattern for
    // free (with systems a multiple of the nodes, round-robin in a fixed order would pin each
    // system to one node by accident).
    for i in (1..out.len()).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        out.swap(i, j);
    }
    out
}

struct Sample {
    ttft: Duration,
    tokens: usize,
    cached: u64,
}

async fn run_workload(
    grpc: std::net::SocketAddr,
    concurrency: usize,
    requests: Vec<(usize, Vec<u32>)>,
    max_tokens: u32,
) -> anyhow::Result<(Vec<Sample>, Duration)> {
    let queue = std::sync::Arc::new(std::sync::Mutex::new(
        requests.into_iter().rev().collect::<Vec<_>>(),
    ));
    let t0 = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..concurrency.max(1) {
        let queue = queue.clone();
        workers.push(tokio::spawn(async move {
            let mut client = InferenceClient::connect(format!("http://{grpc}")).await?;
            let mut out = Vec::new();
            loop {
                let next = queue.lock().expect("queue lock").pop();
                let Some((_, ids)) = next else { break };
                let req = fixed_length_request(ids, max_tokens);
                let start = Instant::now();
                let mut stream = client.generate(req).await?.into_inner();
                let (mut ttft, mut tokens, mut cached) = (None, 0, 0);
                while let Some(m) = stream.message().await? {
                    match m.event {
                        Some(generate_response::Event::Delta(d)) if !d.token_ids.is_empty() => {
                            ttft.get_or_insert(start.elapsed());
                            tokens += d.token_ids.len();
                        }
                        Some(generate_response::Event::Final(f)) => {
                            cached = f.usage.map_or(0, |u| u64::from(u.cached_prompt_tokens));
                        }
                        _ => {}
                    }
                }
                out.push(Sample {
                    ttft: ttft.unwrap_or_default(),
                    tokens,
                    cached,
                });
            }
            anyhow::Ok(out)
        }));
    }
    let mut samples = Vec::new();
    for w in workers {
        samples.extend(w.await??);
    }
    Ok((samples, t0.elapsed()))
}

/// The nodes' KV block size: tandem up leaves the engine's default.
fn default_block_size() -> usize {
    #[derive(clap::Parser)]
    struct Wrapper {
        #[command(flatten)]
        engine: tandem_engine::EngineArgs,
    }
    <Wrapper as clap::Parser>::parse_from(["tandem"])
        .engine
        .block_size
}

/// Runs every policy; returns the table (or JSON).
pub fn run(args: &BenchPrefixArgs) -> anyhow::Result<String> {
    anyhow::ensure!(
        args.systems > 0 && args.questions > 0 && args.system_tokens > 0 && args.prefill > 0,
        "--systems, --questions, --system-tokens and --prefill must be > 0"
    );
    let model = match &args.model {
        Some(m) => m.clone(),
        None => crate::fetch::ensure_default_model()?,
    };
    let vocab = tandem_engine::ModelConfig::from_path(&model)?.vocab_size;
    let requests = workload(args, vocab);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let mut results = Vec::new();
    for &policy in &args.policies {
        let free = || -> anyhow::Result<std::net::SocketAddr> {
            Ok(crate::ports::free_loopback_addr()?)
        };
        let run_dir =
            std::env::temp_dir().join(format!("tandem-bench-prefix-{}", std::process::id()));
        let up_args = UpArgs {
            grpc: free()?,
            http: free()?,
            prefill: args.prefill,
            decode: 1,
            run_dir: Some(run_dir.clone()),
            cluster: format!("bench-prefix-{}", std::process::id()),
            model: Some(model.clone()),
            no_sample: true,
            exit_after_sample: true,
            prefill_policy: Some(policy),
            trace: tandem_telemetry::TraceArgs::default(),
            ..UpArgs::defaults()
        };
        let interrupt = up::Interrupt::install(&rt)?;
        let mut cluster = up::start(&up_args, &rt, &interrupt)
            .with_context(|| format!("starting the local cluster for {policy:?}"))?;
        // Warm-up through the whole path with a prompt outside the workload.
        let warm = vec![(usize::MAX, (0..64u32).map(|i| 300 + i).collect())];
        rt.block_on(run_workload(up_args.grpc, 1, warm, 2))?;
        // KV events of the nodes' first snapshots reach the router.
        std::thread::sleep(Duration::from_secs(1));
        let (samples, wall) = rt.block_on(run_workload(
            up_args.grpc,
            args.concurrency,
            requests.clone(),
            args.max_tokens,
        ))?;
        cluster.shutdown();
        let _ = std::fs::remove_dir_all(&run_dir);
        let block = default_block_size() as u64;
        let reusable = (args.system_tokens as u64 / block) * block;
        let mut ttft: Vec<f64> = samples.iter().map(|s| s.ttft.as_secs_f64() * 1e3).collect();
        let result = PolicyResult {
            policy: format!("{policy:?}"),
            requests: samples.len(),
            ttft_p50_ms: pct(&mut ttft, 0.5),
            ttft_p90_ms: pct(&mut ttft, 0.9),
            requests_per_s: samples.len() as f64 / wall.as_secs_f64(),
            output_tokens_per_s: samples.iter().map(|s| s.tokens).sum::<usize>() as f64
                / wall.as_secs_f64(),
            cached_tokens: samples.iter().map(|s| s.cached).sum(),
            ideal_cached_tokens: (args.systems * (args.questions - 1)) as u64 * reusable,
        };
        eprintln!(
            "{:>12}: TTFT p50 {:.0} ms, p90 {:.0} ms; {:.2} req/s; cached {} of ideal {}",
            result.policy,
            result.ttft_p50_ms,
            result.ttft_p90_ms,
            result.requests_per_s,
            result.cached_tokens,
            result.ideal_cached_tokens
        );
        results.push(result);
    }
    if args.json {
        return Ok(serde_json::to_string_pretty(&results)?);
    }
    let mut out = String::from(
        "| policy | requests | TTFT p50 ms | TTFT p90 ms | req/s | output tok/s | cached / ideal |\n|---|---|---|---|---|---|---|\n",
    );
    for r in &results {
        out.push_str(&format!(
            "| {} | {} | {:.0} | {:.0} | {:.2} | {:.1} | {} / {} ({:.0}%) |\n",
            r.policy,
            r.requests,
            r.ttft_p50_ms,
            r.ttft_p90_ms,
            r.requests_per_s,
            r.output_tokens_per_s,
            r.cached_tokens,
            r.ideal_cached_tokens,
            100.0 * r.cached_tokens as f64 / r.ideal_cached_tokens.max(1) as f64
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_workload_interleaves_systems_and_shares_each_system_prompt() {
        let args = BenchPrefixArgs {
            policies: vec![],
            prefill: 2,
            systems: 3,
            system_tokens: 40,
            questions: 2,
            question_tokens: 5,
            max_tokens: 1,
            concurrency: 1,
            model: None,
            json: false,
        };
        let w = workload(&args, 1000);
        assert_eq!(w.len(), 6);
        let mut systems: Vec<usize> = w.iter().map(|r| r.0).collect();
        assert_ne!(systems, [0, 1, 2, 0, 1, 2], "shuffled");
        systems.sort();
        assert_eq!(systems, [0, 0, 1, 1, 2, 2]);
        let of = |s: usize| w.iter().filter(|r| r.0 == s).collect::<Vec<_>>();
        let s0 = of(0);
        assert_eq!(s0[0].1[..40], s0[1].1[..40], "same system prompt");
        assert_ne!(s0[0].1[40..], s0[1].1[40..], "different questions");
        assert_ne!(of(0)[0].1[..40], of(1)[0].1[..40]);
        assert!(
            w.iter()
                .all(|r| r.1.len() == 45 && r.1.iter().all(|&t| t >= 256))
        );
    }
}
