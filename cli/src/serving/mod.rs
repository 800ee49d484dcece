//! Offering a serving load to a local cluster (or an engine) and summarizing what it saw: the
//! drivers (closed and open loop), the per-level statistics, the prompts and the KV counters
//! that `bench-serve` (every mode) and `bench-sim` share.
//!
//! Invariants: prompts are seeded random tokens, distinct per seed (no prefix-cache hits
//! between levels); every request runs to its `max_tokens`; a failed request fails its level.

pub mod drive;
pub(crate) mod stats;

use serde::Serialize;
use tandem_engine::rng::Rng;

pub use stats::{Level, Load, Sample, Slo, summarize};

/// `n` prompts of `len` seeded random tokens (seed `seed`) from a vocabulary of `vocab`.
pub(crate) fn prompts(n: usize, len: usize, seed: u64, vocab: usize) -> Vec<Vec<u32>> {
    let mut rng = Rng::new(seed);
    // Skip the 256 byte tokens where the vocabulary has more (ordinary text tokens).
    let first = if vocab > 512 { 256 } else { 0 };
    (0..n)
        .map(|_| {
            (0..len)
                .map(|_| (first + rng.below((vocab - first) as u64) as usize) as u32)
                .collect()
        })
        .collect()
}

/// One closed-loop level through the cluster at `grpc` (the telemetry, placement and
/// simulator benchmarks' driver): `c` clients, the default SLO.
pub(crate) async fn disaggregated_level(
    grpc: std::net::SocketAddr,
    c: usize,
    prompts: Vec<Vec<u32>>,
    max_tokens: u32,
) -> anyhow::Result<Level> {
    let load = Load::Concurrency(c);
    let (samples, wall) = drive::disaggregated(grpc, load, prompts, max_tokens, None).await?;
    Ok(summarize(load, &samples, wall, &Slo::default()))
}

/// The KV transfer counters of the disaggregated side, summed over its nodes.
#[derive(Clone, Debug, Default, Serialize)]
pub(crate) struct KvMoved {
    /// Payload bytes the prefill node pushed.
    pub bytes_sent: u64,
    /// Of those, bytes copied device to device by CUDA IPC (same GPU).
    pub ipc_bytes_sent: u64,
    /// Transfers the decode node received and verified.
    pub transfers_received: u64,
    /// Outbound transfer time summed over transfers, push start to the receiver's
    /// confirmation (layers stream while prefill computes the next), seconds.
    pub transfer_seconds: f64,
}

impl KvMoved {
    /// Reads the counters from every node's `/metrics` (a missing family counts 0).
    pub fn scrape(urls: &[(String, String)], rt: &tokio::runtime::Runtime) -> KvMoved {
        let http = reqwest::Client::new();
        let mut kv = KvMoved::default();
        for (_, url) in urls {
            let get = |family: &'static str, label: &'static str| {
                rt.block_on(tandem_chaos_tests::scrape_metric(&http, url, family, label))
                    .unwrap_or(0.0)
            };
            kv.bytes_sent += get("tandem_kv_transfer_bytes_total", "direction=\"sent\"") as u64;
            kv.ipc_bytes_sent += get("tandem_kv_ipc_bytes_total", "direction=\"sent\"") as u64;
            kv.transfers_received += get("tandem_kv_transfers_total", "result=\"received\"") as u64;
            kv.transfer_seconds += get("tandem_kv_transfer_duration_seconds_sum", "");
        }
        kv
    }

    /// One line for the table.
    pub fn line(&self) -> String {
        let share = if self.bytes_sent > 0 { 100.0 * self.ipc_bytes_sent as f64 / self.bytes_sent as f64 } else { 0.0 };
        let per = if self.transfers_received > 0 { 1e3 * self.transfer_seconds / self.transfers_received as f64 } else { 0.0 };
        format!(
            "KV moved: {:.1} MB in {} transfers, {share:.0}% by CUDA IPC; mean push (start to confirmation) {per:.2} ms\n",
            self.bytes_sent as f64 / 1e6,
            self.transfers_received
        )
    }
}

/// One line on stderr per finished level.
pub(crate) fn progress(side: &str, l: &Level) {
    eprintln!(
        "bench-serve: {side} {} done: TTFT p50 {:.1} ms, {:.1} output tok/s, SLO met by {:.0}%",
        l.load(),
        l.ttft_p50_ms,
        l.output_tok_s,
        l.slo_attainment * 100.0
    );
}
