//! `tandem sim`: the seed's thousand-GPU question by simulation (see the `tandem-sim` crate):
//! the same workload served disaggregated and colocated on the same GPUs, as a table or JSON.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, ValueEnum};
use tandem_planner::PlannerConfig;
use tandem_sim::{Arrivals, Gpu, Lengths, Mode, ModelShape, Roofline, SimConfig};

/// Arrival processes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ArrivalKind {
    /// Poisson at --rate.
    Poisson,
    /// Poisson whose rate is --burst-high × the mean for --burst-duty of every
    /// --burst-period-secs, and lower the rest of the time (same mean).
    Bursty,
    /// A closed loop of --clients clients, each sending its next request when its last one
    /// finished (--rate and --load do not apply).
    Closed,
}

/// Output formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// A side-by-side table.
    Table,
    /// Both runs' reports (with the GPUs-per-pool timeline) as JSON.
    Json,
}

/// Flags of `tandem sim`.
#[derive(Args, Debug, Clone)]
pub struct SimArgs {
    /// GPUs in the cluster (H200s).
    #[arg(long, default_value_t = 1000)]
    pub gpus: u32,
    /// GPUs per instance (tensor parallel).
    #[arg(long, default_value_t = 8)]
    pub tp: u32,
    /// Simulated time.
    #[arg(long, default_value_t = 3600.0)]
    pub duration_secs: f64,
    /// Mean arrival rate, requests/s (default: --load × the cluster's roofline capacity).
    #[arg(long)]
    pub rate: Option<f64>,
    /// The default rate as a fraction of capacity.
    #[arg(long, default_value_t = 0.7)]
    pub load: f64,
    /// Arrival process.
    #[arg(long, value_enum, default_value_t = ArrivalKind::Poisson)]
    pub arrivals: ArrivalKind,
    /// Closed: clients at once.
    #[arg(long, default_value_t = 1)]
    pub clients: u32,
    /// Bursty: the burst rate over the mean.
    #[arg(long, default_value_t = 2.0)]
    pub burst_high: f64,
    /// Bursty: one burst-and-lull cycle, seconds.
    #[arg(long, default_value_t = 900.0)]
    pub burst_period_secs: f64,
    /// Bursty: the share of a cycle spent bursting.
    #[arg(long, default_value_t = 0.3)]
    pub burst_duty: f64,
    /// Mean prompt tokens (the seed's 2,048-token sequences: 1,792 in, 256 out).
    #[arg(long, default_value_t = 1792)]
    pub prompt_tokens: u32,
    /// Mean output tokens.
    #[arg(long, default_value_t = 256)]
    pub output_tokens: u32,
    /// Lengths vary uniformly within ± this fraction of their mean.
    #[arg(long, default_value_t = 0.5)]
    pub spread: f64,
    /// TTFT SLO, ms.
    #[arg(long, default_value_t = 1000.0)]
    pub ttft_slo_ms: f64,
    /// Time-per-output-token SLO, ms.
    #[arg(long, default_value_t = 50.0)]
    pub tpot_slo_ms: f64,
    /// Prefill instances of the disaggregated run (default: the split that balances the pools'
    /// roofline capacities).
    #[arg(long)]
    pub prefill_instances: Option<u32>,
    /// Most sequences per decode (or colocated) instance.
    #[arg(long, default_value_t = 256)]
    pub max_batch: u32,
    /// Tokens per engine step.
    #[arg(long, default_value_t = 8192)]
    pub max_tokens_per_step: u32,
    /// Run tandem's planner on the disaggregated pools (its SLO file: --slo-file).
    #[arg(long)]
    pub planner: bool,
    /// The planner's SLO file (see `tandem planner --help`); default: TTFT/ITL from the flags
    /// above, pools 1..all instances, cooldowns 60 s up / 300 s down, 10 s rounds.
    #[arg(long)]
    pub slo_file: Option<PathBuf>,
    /// A new instance's load and warm-up time, seconds.
    #[arg(long, default_value_t = 120.0)]
    pub warmup_secs: f64,
    /// $ per GPU-hour.
    #[arg(long, default_value_t = 3.5)]
    pub gpu_hour_usd: f64,
    /// Fraction of bf16 peak a prefill step reaches.
    #[arg(long, default_value_t = 0.6)]
    pub prefill_efficiency: f64,
    /// Timeline sample period, seconds.
    #[arg(long, default_value_t = 60.0)]
    pub sample_secs: f64,
    /// Step times measured on a real engine (`tandem bench-engine --format json` output)
    /// instead of the H200 roofline: for checking the simulation against a real cluster.
    #[arg(long)]
    pub profile: Option<PathBuf>,
    /// With --profile: the KV-transfer tail after a prompt's last chunk, ms.
    #[arg(long, default_value_t = 1.0)]
    pub transfer_ms: f64,
    /// With --profile: per-request time outside the engines (ingress, tokenization, routing,
    /// hops), ms: a real cluster's TTFT for a prompt of a few tokens, less its prefill.
    #[arg(long, default_value_t = 0.0)]
    pub overhead_ms: f64,
    /// With --profile: KV tokens per instance.
    #[arg(long, default_value_t = 100_000)]
    pub kv_tokens: u64,
    /// Random seed.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
}

/// The simulation's settings from the flags (validated).
pub fn config(a: &SimArgs) -> anyhow::Result<SimConfig> {
    let roofline = Roofline {
        model: ModelShape::seed_70b(),
        gpu: Gpu { prefill_efficiency: a.prefill_efficiency, ..Gpu::h200() },
        tp: a.tp,
    };
    let planner = if a.planner {
        Some(match &a.slo_file {
            Some(p) => PlannerConfig::from_file(p)?,
            None => {
                let n = (a.gpus / a.tp.max(1)) as usize;
                let mut c = PlannerConfig {
                    // The throughput profile: the roofline's, for the mean prompt.
                    prefill_tokens_per_s: a.prompt_tokens as f64
                        / roofline.prefill_chunk_s(0.0, a.prompt_tokens as f64),
                    ttft_p90_slo_ms: a.ttft_slo_ms as u64,
                    itl_p90_slo_ms: a.tpot_slo_ms as u64,
                    interval_ms: 10_000,
                    ..PlannerConfig::default()
                };
                for l in [&mut c.prefill, &mut c.decode] {
                    l.min = 1;
                    l.max = n.saturating_sub(1).max(1);
                    l.scale_up_cooldown_secs = 60;
                    l.scale_down_cooldown_secs = 300;
                }
                c
            }
        })
    } else {
        None
    };
    let mut cfg = SimConfig {
        gpus: a.gpus,
        roofline,
        duration_s: a.duration_secs,
        arrivals: Arrivals::Poisson { rate: 1.0 },
        lengths: Lengths { prompt: a.prompt_tokens, output: a.output_tokens, spread: a.spread },
        seed: a.seed,
        mode: Mode::Colocated,
        max_batch: a.max_batch,
        max_tokens_per_step: a.max_tokens_per_step,
        ttft_slo_s: a.ttft_slo_ms / 1e3,
        tpot_slo_s: a.tpot_slo_ms / 1e3,
        planner,
        warmup_s: a.warmup_secs,
        gpu_hour_usd: a.gpu_hour_usd,
        sample_s: a.sample_secs,
        measured: match &a.profile {
            Some(p) => {
                let text = std::fs::read_to_string(p)
                    .with_context(|| format!("--profile {}", p.display()))?;
                Some(
                    tandem_sim::MeasuredSteps::from_bench_engine(
                        &text,
                        a.transfer_ms / 1e3,
                        a.kv_tokens as f64,
                        a.overhead_ms / 1e3,
                    )
                        .map_err(|e| anyhow::anyhow!("--profile {}: {e}", p.display()))?,
                )
            }
            None => None,
        },
    };
    anyhow::ensure!(a.load > 0.0 && a.load.is_finite(), "--load must be positive");
    anyhow::ensure!(
        !matches!(a.arrivals, ArrivalKind::Closed) || a.rate.is_none(),
        "--rate does not apply to --arrivals closed (its clients send as fast as they are served)"
    );
    cfg.validate()?;
    let rate = a.rate.unwrap_or_else(|| a.load * cfg.capacity_rps());
    cfg.arrivals = match a.arrivals {
        ArrivalKind::Poisson => Arrivals::Poisson { rate },
        ArrivalKind::Bursty => Arrivals::Bursty {
            rate,
            high: a.burst_high,
            period_s: a.burst_period_secs,
            duty: a.burst_duty,
        },
        ArrivalKind::Closed => Arrivals::Closed { clients: a.clients },
    };
    cfg.mode = Mode::Disaggregated {
        prefill: a.prefill_instances.unwrap_or_else(|| cfg.balanced_prefill_instances()),
    };
    cfg.validate()?;
    Ok(cfg)
}

/// Runs `tandem sim`; returns what to print.
pub fn run(a: &SimArgs) -> anyhow::Result<String> {
    let cfg = config(a)?;
    let c = tandem_sim::compare(&cfg)?;
    Ok(match a.format {
        Format::Table => tandem_sim::table(&c),
        Format::Json => serde_json::to_string_pretty(&c)?,
    })
}
