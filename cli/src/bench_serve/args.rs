//! The flags of `tandem bench-serve` and its modes (shared by every mode's module).

use std::path::PathBuf;

use clap::{Args, ValueEnum};

use crate::serving::Slo;

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
    /// Poisson arrival rates to sweep after the concurrency levels, requests/s, comma-separated
    /// (open loop; none by default).
    #[arg(long, value_delimiter = ',')]
    pub rates: Vec<f64>,
    /// Requests per level.
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
    /// Goodput's TTFT objective, ms: a request meets the SLO when its TTFT and its mean
    /// inter-token latency are both within theirs.
    #[arg(long, default_value_t = Slo::default().ttft_ms)]
    pub slo_ttft_ms: f64,
    /// Goodput's inter-token latency objective, ms.
    #[arg(long, default_value_t = Slo::default().itl_ms)]
    pub slo_itl_ms: f64,
    /// Draw the throughput–latency curves into this directory: `bench-serve-concurrency.png`
    /// and (with `--rates`) `bench-serve-rate.png`.
    #[arg(long)]
    pub plot_dir: Option<PathBuf>,
    /// Model (default: the cached SmolLM2-135M-Instruct).
    #[arg(long, env = "TANDEM_MODEL")]
    pub model: Option<std::path::PathBuf>,
    /// Where both sides run: `cpu`, or `cuda[:N]` (the cluster's nodes and the colocated engine
    /// on that GPU; the nodes pass KV device to device by CUDA IPC, or with `--no-cuda-ipc`
    /// stage it through host memory). Checked before anything starts.
    #[arg(long, env = "TANDEM_DEVICE", default_value = "cpu")]
    pub device: tandem_engine::Device,
    /// With `--device cuda`: the two nodes stage KV through host memory (the cross-machine
    /// path) instead of passing it device to device by CUDA IPC.
    #[arg(long)]
    pub no_cuda_ipc: bool,
    /// Rounds of each configuration with `--mode telemetry` or `placement` (alternating;
    /// medians reported).
    #[arg(long, default_value_t = 2)]
    pub rounds: usize,
    /// Prompt lengths `--mode placement` sweeps (each computed by the decode node, and by the
    /// prefill node).
    #[arg(long, value_delimiter = ',', default_value = "16,64,256")]
    pub prompt_lens: Vec<usize>,
}

impl BenchServeArgs {
    /// `--requests` prompts of `--prompt-len` tokens for level `level` (seeded by it: distinct
    /// per level, the same every run).
    pub(crate) fn prompts(&self, level: usize, vocab: usize) -> Vec<Vec<u32>> {
        crate::serving::prompts(self.requests, self.prompt_len, 0xBE7C + level as u64, vocab)
    }
}
