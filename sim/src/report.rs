//! What a run reports: latency percentiles, goodput under the SLO (DistServe's definition:
//! completed requests per second that met both the TTFT and the per-token SLO, here also per
//! GPU), cost per million tokens, and each pool's GPUs over time.

use serde::Serialize;

/// A latency distribution's summary, seconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Percentiles {
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
}

impl Percentiles {
    /// From samples (sorted in place).
    pub fn of(samples: &mut [f32]) -> Percentiles {
        if samples.is_empty() {
            return Percentiles::default();
        }
        samples.sort_unstable_by(|a, b| a.total_cmp(b));
        let at = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize] as f64;
        Percentiles { p50: at(0.5), p90: at(0.9), p99: at(0.99) }
    }
}

/// Token-weighted inter-token latencies: a log-bucketed histogram (1 % wide buckets from
/// 10 µs), so an hour of billions of tokens costs a few kilobytes.
#[derive(Clone, Debug)]
pub struct ItlHistogram {
    counts: Vec<u64>,
}

const ITL_MIN_S: f64 = 1e-5;
const ITL_BUCKETS: usize = 1400; // 1.01^1400 × 10 µs ≈ 11 s

impl Default for ItlHistogram {
    fn default() -> Self {
        ItlHistogram { counts: vec![0; ITL_BUCKETS] }
    }
}

impl ItlHistogram {
    /// `tokens` tokens each waited `s` seconds.
    pub fn add(&mut self, s: f64, tokens: u64) {
        let i = ((s / ITL_MIN_S).max(1.0).ln() / 1.01f64.ln()) as usize;
        self.counts[i.min(ITL_BUCKETS - 1)] += tokens;
    }

    /// Percentiles (bucket upper bounds: within 1 %).
    pub fn percentiles(&self) -> Percentiles {
        let total: u64 = self.counts.iter().sum();
        if total == 0 {
            return Percentiles::default();
        }
        let at = |q: f64| {
            let want = (total as f64 * q).ceil() as u64;
            let mut seen = 0;
            for (i, c) in self.counts.iter().enumerate() {
                seen += c;
                if seen >= want.max(1) {
                    return ITL_MIN_S * 1.01f64.powi(i as i32 + 1);
                }
            }
            f64::NAN
        };
        Percentiles { p50: at(0.5), p90: at(0.9), p99: at(0.99) }
    }
}

/// GPUs per pool at one instant.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct PoolSample {
    /// Simulated time, s.
    pub t_s: f64,
    /// GPUs serving prefill (colocated: 0; every GPU counts under decode).
    pub prefill_gpus: u32,
    /// GPUs serving decode.
    pub decode_gpus: u32,
    /// GPUs loading or warming up.
    pub warming_gpus: u32,
    /// Requests arrived in the last sample period, per second.
    pub arrival_rate: f64,
    /// TTFT p90 of the requests whose first token came in the last sample period, s.
    pub ttft_p90_s: f64,
}

/// One run's results.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RunReport {
    /// `disaggregated` or `colocated`.
    pub mode: &'static str,
    /// GPUs in the cluster (the cap).
    pub gpus: u32,
    /// GPUs per instance.
    pub tp: u32,
    /// Requests that arrived.
    pub arrived: u64,
    /// Requests completed.
    pub completed: u64,
    /// Requests refused (a queue was full).
    pub rejected: u64,
    /// Time to first token.
    pub ttft_s: Percentiles,
    /// Inter-token latency, over every token.
    pub itl_s: Percentiles,
    /// Time per output token, per request (DistServe's TPOT).
    pub tpot_s: Percentiles,
    /// Share of arrived requests that completed within both SLOs.
    pub slo_attainment: f64,
    /// Completed requests within both SLOs per second.
    pub goodput_rps: f64,
    /// The same per GPU (average GPUs in use).
    pub goodput_rps_per_gpu: f64,
    /// Output tokens per second.
    pub output_tokens_per_s: f64,
    /// GPU-hours used (every instance from its start to its end, warming included).
    pub gpu_hours: f64,
    /// $ per million output tokens at the configured GPU-hour price.
    pub usd_per_m_output_tokens: f64,
    /// $ per million tokens, input and output together.
    pub usd_per_m_tokens: f64,
    /// Scale-ups the GPU cap cut short (planner runs).
    pub capped_scale_ups: u64,
    /// Planner decisions applied.
    pub planner_decisions: u64,
    /// GPUs per pool over time.
    pub timeline: Vec<PoolSample>,
    /// Wall time the simulation took, s.
    pub wall_s: f64,
}
