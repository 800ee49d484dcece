//! `tandem bench-transfer`: moves blocks between two processes and compares the rate with
//! baselines measured in the same run.
//!
//! This process is the sender (prefill side); it spawns `tandem-kv-peer serve` as the receiver
//! (decode side), reserves the destination blocks over the peer's stdin before each transfer
//! (outside the timed region, as a router's reserve RPC would be), and times `push` → receiver's
//! `Done`. The first warm-up transfer is checked byte for byte by the receiver.
//!
//! Baselines (skipped with `--no-baseline`): for UCX, `ucx_perftest` (`ucp_put_bw` for RMA,
//! `tag_bw` when the transport uses tagged sends; same `UCX_TLS`) twice: at our message size (one chunk: the bytes written and then committed with one
//! `Chunk` frame, `--max-chunk-bytes` rounded to whole layers) and at the whole transfer's size.
//! perftest reuses one buffer per message, so at small sizes it copies cache-resident data while
//! a transfer streams a pool from DRAM; the whole-transfer run has the same working set. For
//! TCP, a plain loopback socket copy of the same bytes per iteration to `tandem-kv-peer sink`,
//! written in `--max-chunk-bytes` pieces; for both, `memcpy` of the same bytes in-process.
//! `--compute-ms-per-layer` adds streamed runs where layers become ready one by one at that pace,
//! to show the transfer hiding under compute (total ≈ max(compute, transfer), not their sum).
//!
//! Transfers and baselines alternate in `--rounds` rounds so that load from other processes on a
//! shared machine affects both sides of each ratio. Rates are medians over the `--iterations`
//! timed transfers; ratios are medians of per-round ratios; GB/s is 1e9 payload bytes per second.

pub mod baseline;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::kind::{LayoutName, TransportKind};
use crate::pattern;
use crate::peer::{DEFAULT_SEED, PeerCommand, PeerProcess, PoolArgs, TransportArgs};
use crate::pool::BlockId;
use crate::transport::{KvTransport, PushRequest};

/// Output format of the report.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum OutputFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object.
    Json,
}

/// Flags of `tandem bench-transfer`.
#[derive(clap::Args, Clone, Debug)]
pub struct BenchTransferArgs {
    /// Transport and its knobs (shared with the peer process).
    #[command(flatten)]
    pub transport: TransportArgs,
    /// KV layout of both pools.
    #[arg(long, value_enum, default_value = "llama70b")]
    pub layout: LayoutName,
    /// Blocks per transfer (and per pool).
    #[arg(long, default_value_t = 64)]
    pub blocks: usize,
    /// Tokens per block.
    #[arg(long, default_value_t = 16)]
    pub block_tokens: usize,
    /// Timed transfers.
    #[arg(long, default_value_t = 20)]
    pub iterations: usize,
    /// Untimed transfers first.
    #[arg(long, default_value_t = 3)]
    pub warmup: usize,
    /// Our transfers and the baselines alternate in this many rounds; ratios are the median of
    /// the per-round ratios.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Also run streamed transfers with this much simulated compute per layer (0: skip).
    #[arg(long, default_value_t = 0.0)]
    pub compute_ms_per_layer: f64,
    /// Skip the perftest / socket / memcpy baselines.
    #[arg(long)]
    pub no_baseline: bool,
    /// Report format.
    #[arg(long, value_enum, default_value = "text")]
    pub format: OutputFormat,
    /// The `tandem-kv-peer` binary (default: `$TANDEM_KV_PEER_BIN`, else next to this
    /// executable, else this executable's `kv-peer` subcommand).
    #[arg(long, env = "TANDEM_KV_PEER_BIN")]
    pub peer_bin: Option<PathBuf>,
}

/// Median and percentiles of a set of timed transfers of `bytes` each.
#[derive(Clone, Debug)]
pub struct Stats {
    /// Payload bytes per transfer.
    pub bytes: u64,
    /// Median rate, GB/s.
    pub gb_per_s: f64,
    /// Median latency, ms.
    pub p50_ms: f64,
    /// 99th-percentile latency, ms.
    pub p99_ms: f64,
}

impl Stats {
    /// Summarises per-transfer times.
    pub fn from_times(bytes: u64, times: &[Duration]) -> Self {
        let p50 = median(times);
        Self {
            bytes,
            gb_per_s: bytes as f64 / p50.as_secs_f64().max(1e-12) / 1e9,
            p50_ms: p50.as_secs_f64() * 1e3,
            p99_ms: percentile(times, 0.99).as_secs_f64() * 1e3,
        }
    }
}

/// The `ucx_perftest` test that does what a data mode does: tagged sends for `tag`, puts
/// otherwise.
fn perftest_test(data_mode: &str) -> &'static str {
    if data_mode == "tag" {
        "tag_bw"
    } else {
        "ucp_put_bw"
    }
}

/// The median of some figures (`None` when empty).
pub fn median_f64(v: &[f64]) -> Option<f64> {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    (!v.is_empty()).then(|| v[v.len() / 2])
}

/// The median of some durations (zero when empty).
pub fn median(times: &[Duration]) -> Duration {
    percentile(times, 0.5)
}

fn percentile(times: &[Duration], q: f64) -> Duration {
    if times.is_empty() {
        return Duration::ZERO;
    }
    let mut t = times.to_vec();
    t.sort();
    t[((t.len() - 1) as f64 * q).round() as usize]
}

/// Layer-streamed transfers under simulated compute.
#[derive(Clone, Debug, Serialize)]
pub struct StreamingReport {
    /// Simulated compute per layer.
    pub compute_ms_per_layer: f64,
    /// Compute alone: layers × per-layer compute.
    pub compute_ms: f64,
    /// Transfer alone (the median of the all-layers-ready runs).
    pub transfer_ms: f64,
    /// Median total of the streamed runs, from the first layer's start to `Done`.
    pub total_ms: f64,
    /// `total / max(compute, transfer)`: 1.0 is perfect overlap.
    pub over_max: f64,
    /// `total / (compute + transfer)`: 1.0 would mean no overlap at all.
    pub over_sum: f64,
}

/// What `bench-transfer` measured.
#[derive(Clone, Debug, Serialize)]
pub struct BenchReport {
    /// `ucx` or `tcp`.
    pub transport: &'static str,
    /// `rma-mapped`, `rma`, `tag` or `inline` (see `TransferReport::data_mode`).
    pub data_mode: &'static str,
    /// Layout name.
    pub layout: String,
    /// Blocks per transfer.
    pub blocks: usize,
    /// Tokens per block.
    pub block_tokens: usize,
    /// Timed transfers.
    pub iterations: usize,
    /// Payload bytes per transfer.
    pub bytes: u64,
    /// Bytes per chunk (written, then committed with one descriptor): the message size the
    /// perftest baseline uses.
    pub message_bytes: usize,
    /// Median payload rate, 1e9 bytes/s.
    pub gb_per_s: f64,
    /// Median transfer latency, ms.
    pub p50_ms: f64,
    /// 99th-percentile transfer latency, ms.
    pub p99_ms: f64,
    /// `ucx_perftest` at `message_bytes`, median over rounds (UCX only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub perftest_gb_per_s: Option<f64>,
    /// The perftest test run: `ucp_put_bw` for RMA, `tag_bw` for tagged sends.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub perftest_test: Option<&'static str>,
    /// Plain loopback socket copy of `bytes` (TCP only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub socket_gb_per_s: Option<f64>,
    /// Median over rounds of (our rate / the transport's baseline in the same round): perftest
    /// at `message_bytes` for UCX, socket copy for TCP.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ratio: Option<f64>,
    /// `ucx_perftest` with one message of the whole transfer's `bytes` (UCX only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub perftest_transfer_gb_per_s: Option<f64>,
    /// Median over rounds of (our rate / perftest at the whole transfer's size).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ratio_transfer: Option<f64>,
    /// In-process memcpy of `bytes`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memcpy_gb_per_s: Option<f64>,
    /// Streamed runs, when asked for.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub streaming: Option<StreamingReport>,
    /// Percent of the host's CPU time the hypervisor gave to other guests during the run
    /// (Linux `/proc/stat` steal): above a few percent, ratios against the one-core baselines
    /// understate the transfer.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu_steal_pct: Option<f64>,
}

/// Runs the benchmark (on its own tokio runtime), prints the report in `args.format`, returns it.
pub fn run(args: BenchTransferArgs) -> anyhow::Result<BenchReport> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let report = rt.block_on(run_async(&args))?;
    match args.format {
        OutputFormat::Json => println!("{}", serde_json::to_string(&report)?),
        OutputFormat::Text => print_text(&report),
    }
    Ok(report)
}

async fn run_async(args: &BenchTransferArgs) -> anyhow::Result<BenchReport> {
    if args.iterations == 0 || args.blocks == 0 {
        bail!("--iterations and --blocks must be > 0");
    }
    let started = baseline::CpuTimes::now();
    let peer = args
        .peer_bin
        .clone()
        .map(PeerCommand::from)
        .or_else(PeerCommand::find);
    let peer_cmd = peer.context("cannot find tandem-kv-peer: set TANDEM_KV_PEER_BIN")?;
    let layout = args.layout.layout(args.block_tokens)?;
    let transport = args.transport.build()?;
    let src = transport.allocate(layout, args.blocks)?;
    let ids: Vec<BlockId> = (0..args.blocks as BlockId).collect();
    // SAFETY: the pool was just allocated; no transfer touches it yet.
    unsafe { pattern::fill_blocks_shared(src.pool(), DEFAULT_SEED, &ids) }?;
    let pool = Arc::clone(src.pool());

    let pool_args = PoolArgs {
        layout: args.layout,
        block_tokens: args.block_tokens,
        blocks: args.blocks,
        seed: DEFAULT_SEED,
    };
    let mut child: Vec<String> = vec!["serve".into()];
    child.extend(args.transport.to_args());
    child.extend(pool_args.to_args());
    let mut peer = PeerProcess::spawn_command(&peer_cmd, &child).await?;
    let addr = peer.addr.clone().context("peer address")?;

    let bytes = layout.pool_bytes(args.blocks) as u64;
    let layer_bytes = layout.slab_bytes() * args.blocks;
    let message_bytes = crate::transport::layers_per_chunk(
        layout.slab_bytes(),
        args.blocks,
        layout.num_layers,
        args.transport.max_chunk_bytes,
    )
    .min(layout.num_layers as u32) as usize
        * layer_bytes;

    let mut id = 0u64;
    let mut data_mode = "";
    for i in 0..args.warmup {
        id += 1;
        data_mode = transfer(&mut peer, &transport, &src, &addr, &ids, id, i == 0, None)
            .await?
            .1;
    }
    // Rounds: our transfers, then the baselines, so a change of load on a shared machine hits
    // both sides of every ratio.
    let rounds = args.rounds.clamp(1, args.iterations);
    let mut times = Vec::with_capacity(args.iterations);
    let (mut perftests, mut perftests_transfer, mut sockets) = (Vec::new(), Vec::new(), Vec::new());
    let (mut ratios, mut ratios_transfer) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        let n = args.iterations / rounds + usize::from(round < args.iterations % rounds);
        let mut round_times = Vec::with_capacity(n);
        for _ in 0..n {
            id += 1;
            let (dt, mode) =
                transfer(&mut peer, &transport, &src, &addr, &ids, id, false, None).await?;
            data_mode = mode;
            round_times.push(dt);
        }
        let ours = Stats::from_times(bytes, &round_times).gb_per_s;
        times.extend(round_times);
        if args.no_baseline {
            continue;
        }
        match args.transport.transport {
            TransportKind::Ucx => {
                let tls = args.transport.ucx_tls.as_deref();
                let test = perftest_test(data_mode);
                let count = (bytes as usize * n / message_bytes).clamp(20, 20_000);
                let p = baseline::perftest_bw(test, message_bytes, count, tls).await?;
                let q = baseline::perftest_bw(test, bytes as usize, n.max(5), tls).await?;
                perftests.push(p);
                perftests_transfer.push(q);
                ratios.push(ours / p);
                ratios_transfer.push(ours / q);
            }
            TransportKind::Tcp => {
                let chunk = args.transport.max_chunk_bytes;
                let b =
                    baseline::socket_copy(&peer_cmd, &pool, bytes as usize, chunk, n, 1).await?;
                sockets.push(b.gb_per_s);
                ratios.push(ours / b.gb_per_s);
            }
        }
    }
    let stats = Stats::from_times(bytes, &times);

    let streaming = if args.compute_ms_per_layer > 0.0 {
        let runs = (args.iterations / 4).max(3);
        let mut totals = Vec::with_capacity(runs);
        for _ in 0..runs {
            id += 1;
            let c = Some(args.compute_ms_per_layer);
            totals.push(
                transfer(&mut peer, &transport, &src, &addr, &ids, id, false, c)
                    .await?
                    .0,
            );
        }
        let compute_ms = args.compute_ms_per_layer * layout.num_layers as f64;
        let total_ms = median(&totals).as_secs_f64() * 1e3;
        Some(StreamingReport {
            compute_ms_per_layer: args.compute_ms_per_layer,
            compute_ms,
            transfer_ms: stats.p50_ms,
            total_ms,
            over_max: total_ms / compute_ms.max(stats.p50_ms),
            over_sum: total_ms / (compute_ms + stats.p50_ms),
        })
    } else {
        None
    };
    peer.quit().await?;
    drop(src);
    let memcpy = (!args.no_baseline).then(|| baseline::memcpy_gb_per_s(&pool, bytes as usize, 5));
    let (perftest, perftest_transfer, socket) = (
        median_f64(&perftests),
        median_f64(&perftests_transfer),
        median_f64(&sockets),
    );
    let (ratio, ratio_transfer) = (median_f64(&ratios), median_f64(&ratios_transfer));
    Ok(BenchReport {
        transport: args.transport.transport.as_str(),
        data_mode,
        layout: format!("{:?}", args.layout).to_lowercase(),
        blocks: args.blocks,
        block_tokens: args.block_tokens,
        iterations: args.iterations,
        bytes,
        message_bytes,
        gb_per_s: stats.gb_per_s,
        p50_ms: stats.p50_ms,
        p99_ms: stats.p99_ms,
        perftest_gb_per_s: perftest,
        perftest_test: perftest.map(|_| perftest_test(data_mode)),
        socket_gb_per_s: socket,
        ratio,
        perftest_transfer_gb_per_s: perftest_transfer,
        ratio_transfer,
        memcpy_gb_per_s: memcpy,
        streaming,
        cpu_steal_pct: started
            .zip(baseline::CpuTimes::now())
            .and_then(|(a, b)| b.steal_pct_since(&a)),
    })
}

/// One reserved, timed push of `blocks` → the same ids; `compute_ms` streams layers at that pace.
#[allow(clippy::too_many_arguments)]
async fn transfer(
    peer: &mut PeerProcess,
    transport: &impl KvTransport,
    src: &crate::transport::PoolRegistration,
    addr: &str,
    blocks: &[BlockId],
    id: u64,
    verify: bool,
    compute_ms: Option<f64>,
) -> anyhow::Result<(Duration, &'static str)> {
    peer.reserve(id, 1, Duration::from_secs(120), verify, blocks)
        .await?;
    let mut req = PushRequest::new(addr, id, 1, blocks.to_vec(), blocks.to_vec())
        .deadline(Duration::from_secs(60));
    if compute_ms.is_some() {
        req = req.streamed();
    }
    let t0 = Instant::now();
    let out = transport.push(src, req, CancellationToken::new())?;
    if let Some(ms) = compute_ms {
        let layers = src.pool().layout().num_layers as u32;
        let per_layer = Duration::from_secs_f64(ms / 1e3);
        for l in 1..=layers {
            // Simulated compute: layer l is ready l × per_layer after the start.
            tokio::time::sleep_until(tokio::time::Instant::from_std(t0 + per_layer * l)).await;
            out.layers_ready(l);
        }
    }
    let report = out.await.with_context(|| format!("transfer {id}"))?;
    let dt = t0.elapsed();
    let line = peer.line().await?;
    let want = format!("RESULT {id} ok {} 0", report.bytes);
    if line != want {
        bail!("receiver reported `{line}`, expected `{want}`");
    }
    Ok((dt, report.data_mode))
}

fn print_text(r: &BenchReport) {
    println!(
        "bench-transfer: {} ({}), layout {}, {} blocks × {} tokens, {} iterations",
        r.transport, r.data_mode, r.layout, r.blocks, r.block_tokens, r.iterations
    );
    println!(
        "  payload per transfer: {} bytes; message (one chunk): {} bytes",
        r.bytes, r.message_bytes
    );
    println!(
        "  rate: {:.2} GB/s (median); latency p50 {:.2} ms, p99 {:.2} ms",
        r.gb_per_s, r.p50_ms, r.p99_ms
    );
    if let Some(p) = r.perftest_gb_per_s {
        let test = r.perftest_test.unwrap_or("?");
        println!(
            "  ucx_perftest {test} at {} bytes: {:.2} GB/s",
            r.message_bytes, p
        );
    }
    if let Some(s) = r.socket_gb_per_s {
        println!("  plain loopback socket copy: {:.2} GB/s", s);
    }
    if let Some(x) = r.ratio {
        println!("  ratio to baseline: {:.3}", x);
    }
    if let (Some(p), Some(x)) = (r.perftest_transfer_gb_per_s, r.ratio_transfer) {
        println!(
            "  ucx_perftest at {} bytes (whole transfer): {:.2} GB/s, ratio {:.3}",
            r.bytes, p, x
        );
    }
    if let Some(m) = r.memcpy_gb_per_s {
        println!("  memcpy of the same bytes: {:.2} GB/s", m);
    }
    if let Some(s) = &r.streaming {
        println!(
            "  streamed with {:.2} ms/layer compute: total {:.1} ms vs compute {:.1} ms, transfer {:.1} ms (total/max {:.2}, total/sum {:.2})",
            s.compute_ms_per_layer, s.total_ms, s.compute_ms, s.transfer_ms, s.over_max, s.over_sum
        );
    }
    if let Some(p) = r.cpu_steal_pct {
        println!("  host CPU steal during the run: {p:.1}%");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_use_the_median_and_the_99th_percentile() {
        let times: Vec<Duration> = [5u64, 1, 3, 2, 4]
            .iter()
            .map(|&ms| Duration::from_millis(ms))
            .collect();
        let s = Stats::from_times(3_000_000, &times);
        assert_eq!(s.p50_ms, 3.0);
        assert_eq!(s.p99_ms, 5.0);
        assert!((s.gb_per_s - 1.0).abs() < 1e-9, "3 MB in 3 ms is 1 GB/s");
    }
}
