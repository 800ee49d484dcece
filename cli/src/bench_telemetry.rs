//! `tandem bench-serve --mode telemetry`: what observability costs a serving cluster, measured
//! side by side in one run. Three configurations of the same local 1 prefill + 1 decode cluster
//! serve the same closed-loop load, in alternating rounds (off, traced, scraped, off, ...):
//! - **off**: no trace export (spans are disabled `tracing` spans), nobody scrapes;
//! - **traced**: every process exports every span (the default parent-based always-on sampler)
//!   over OTLP/gRPC to a receiver in this process;
//! - **scraped**: a thread reads the router's and both nodes' `/metrics` once a second.
//!
//! Reported per concurrency level: the median over rounds of output tokens/s and TTFT p50 for
//! each configuration, and the ratios against "off" measured in the same run.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context;
use serde::Serialize;
use tandem_cluster::{Discovery, EtcdConfig, EtcdDiscovery, Role};
use tandem_telemetry::TraceArgs;
use tandem_telemetry::testing::OtlpReceiver;
use tandem_telemetry::trace::OtlpProtocol;

use crate::bench_serve::args::BenchServeArgs;
use crate::serving::{Level, disaggregated_level, progress};
use crate::up::{self, Interrupt, UpArgs};

/// One configuration's figures at one level, medians over rounds.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    /// Clients at once.
    pub concurrency: usize,
    /// `off`, `traced` or `scraped`.
    pub config: &'static str,
    /// Median output tokens/s.
    pub output_tok_s: f64,
    /// Median TTFT p50, ms.
    pub ttft_p50_ms: f64,
    /// Output tokens/s / off's.
    pub throughput_ratio: f64,
    /// TTFT p50 − off's, ms.
    pub ttft_delta_ms: f64,
}

#[derive(Serialize)]
struct Report {
    rounds: usize,
    requests_per_level: usize,
    prompt_len: usize,
    max_tokens: usize,
    spans_received: u64,
    scrapes: u64,
    rows: Vec<Row>,
}

const CONFIGS: [&str; 3] = ["off", "traced", "scraped"];

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return 0.0;
    }
    v[v.len() / 2]
}

/// Reads every process's /metrics once a second until `stop`.
fn scraper(urls: Vec<String>, stop: Arc<AtomicBool>, count: Arc<AtomicU64>) {
    while !stop.load(Ordering::Relaxed) {
        for u in &urls {
            let rest = u.trim_start_matches("http://");
            let (host, path) = rest.split_once('/').unwrap_or((rest, "metrics"));
            if let Ok(mut s) = std::net::TcpStream::connect(host) {
                use std::io::{Read, Write};
                let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
                if write!(
                    s,
                    "GET /{path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
                )
                .is_ok()
                {
                    let mut sink = Vec::new();
                    if s.read_to_end(&mut sink).is_ok() {
                        count.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// Runs the comparison (see the module docs).
pub fn run(args: &BenchServeArgs, model: &Path, vocab: usize) -> anyhow::Result<String> {
    anyhow::ensure!(args.rounds > 0, "--rounds must be > 0");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let interrupt = Interrupt::install(&rt)?;
    let receiver = rt.block_on(OtlpReceiver::start());
    let scrapes = Arc::new(AtomicU64::new(0));
    // results[config][level] = samples over rounds
    let mut results: Vec<Vec<Vec<Level>>> = vec![vec![Vec::new(); args.concurrency.len()]; 3];
    for round in 0..args.rounds {
        for (ci, config) in CONFIGS.iter().enumerate() {
            let free = || -> anyhow::Result<std::net::SocketAddr> {
                Ok(crate::ports::free_loopback_addr()?)
            };
            let run_dir = std::env::temp_dir().join(format!(
                "tandem-bench-telemetry-{}-{round}-{config}",
                std::process::id()
            ));
            let trace = match *config {
                "traced" => TraceArgs {
                    otlp_endpoint: Some(receiver.grpc_endpoint()),
                    otlp_protocol: OtlpProtocol::Grpc,
                },
                _ => TraceArgs::default(),
            };
            let up_args = UpArgs {
                grpc: free()?,
                http: free()?,
                run_dir: Some(run_dir.clone()),
                cluster: format!("bench-telemetry-{}", std::process::id()),
                model: Some(model.to_path_buf()),
                device: args.device,
                no_sample: true,
                exit_after_sample: true,
                trace,
                ..UpArgs::defaults()
            };
            let mut cluster = up::start(&up_args, &rt, &interrupt)
                .with_context(|| format!("starting the {config} cluster"))?;
            let stop = Arc::new(AtomicBool::new(false));
            let scraper_thread = if *config == "scraped" {
                let d = rt.block_on(EtcdDiscovery::connect(EtcdConfig::new(
                    vec![cluster.etcd_url.clone()],
                    up_args.cluster.clone(),
                )))?;
                let mut urls = vec![format!("http://{}/metrics", up_args.http)];
                for role in [Role::Prefill, Role::Decode] {
                    for n in rt.block_on(d.list(role))?.values() {
                        urls.push(n.metrics_url.clone());
                    }
                }
                let (stop, count) = (Arc::clone(&stop), Arc::clone(&scrapes));
                Some(std::thread::spawn(move || scraper(urls, stop, count)))
            } else {
                None
            };
            // Warm-up: one request through the whole path.
            rt.block_on(disaggregated_level(
                up_args.grpc,
                1,
                args.prompts(0, vocab)[..1].to_vec(),
                4,
            ))?;
            for (li, &c) in args.concurrency.iter().enumerate() {
                let level = rt.block_on(disaggregated_level(
                    up_args.grpc,
                    c,
                    args.prompts(c, vocab),
                    args.max_tokens as u32,
                ))?;
                progress(&format!("round {round} {config}"), &level);
                results[ci][li].push(level);
            }
            stop.store(true, Ordering::Relaxed);
            if let Some(t) = scraper_thread {
                let _ = t.join();
            }
            cluster.shutdown();
            let _ = std::fs::remove_dir_all(&run_dir);
        }
    }
    let mut rows = Vec::new();
    for (li, &c) in args.concurrency.iter().enumerate() {
        let tput = |ci: usize| median(results[ci][li].iter().map(|l| l.output_tok_s).collect());
        let ttft = |ci: usize| median(results[ci][li].iter().map(|l| l.ttft_p50_ms).collect());
        let (base_t, base_ttft) = (tput(0), ttft(0));
        for (ci, config) in CONFIGS.iter().enumerate() {
            rows.push(Row {
                concurrency: c,
                config,
                output_tok_s: tput(ci),
                ttft_p50_ms: ttft(ci),
                throughput_ratio: tput(ci) / base_t,
                ttft_delta_ms: ttft(ci) - base_ttft,
            });
        }
    }
    let report = Report {
        rounds: args.rounds,
        requests_per_level: args.requests,
        prompt_len: args.prompt_len,
        max_tokens: args.max_tokens,
        spans_received: receiver.spans().len() as u64,
        scrapes: scrapes.load(Ordering::Relaxed),
        rows,
    };
    if args.json {
        return Ok(serde_json::to_string(&report)?);
    }
    let mut s = format!(
        "observability cost: {} rounds (off, traced, scraped alternating), {} requests per level, {}-token prompts, {} output tokens\n\
         spans received {}, scrapes {}\n{:>5} {:>8} {:>10} {:>10} {:>10} {:>12}\n",
        report.rounds,
        report.requests_per_level,
        report.prompt_len,
        report.max_tokens,
        report.spans_received,
        report.scrapes,
        "conc",
        "config",
        "tok/s",
        "ratio",
        "TTFT p50",
        "Δ TTFT p50"
    );
    for r in &report.rows {
        s += &format!(
            "{:>5} {:>8} {:>10.1} {:>10.3} {:>8.1}ms {:>+10.2}ms\n",
            r.concurrency,
            r.config,
            r.output_tok_s,
            r.throughput_ratio,
            r.ttft_p50_ms,
            r.ttft_delta_ms
        );
    }
    Ok(s)
}
