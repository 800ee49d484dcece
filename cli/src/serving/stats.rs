//! Per-request samples and the figures of one load level: percentiles of TTFT, inter-token
//! latency and end-to-end latency, throughput, and goodput under a latency SLO.
//!
//! Every time is measured from the request's **scheduled** arrival (closed loop: when its client
//! sent it; open loop: its Poisson arrival instant), so time a request waited because the client
//! or the server was behind counts against it.

use std::time::Duration;

use serde::Serialize;

/// One request's timings.
#[derive(Clone, Copy, Debug)]
pub struct Sample {
    /// Scheduled arrival to the first output token.
    pub ttft: Duration,
    /// Scheduled arrival to the last output token.
    pub e2e: Duration,
    /// Output tokens received.
    pub tokens: usize,
}

impl Sample {
    /// Mean time between consecutive output tokens of this request (None with fewer than 2).
    pub fn itl(&self) -> Option<Duration> {
        (self.tokens > 1).then(|| (self.e2e - self.ttft) / (self.tokens - 1) as u32)
    }
}

/// A latency objective: a request meets it when its TTFT and its mean inter-token latency are
/// both within bounds (the goodput definition of DistServe, per request).
#[derive(Clone, Copy, Debug, Serialize, PartialEq)]
pub struct Slo {
    /// Largest acceptable time to first token, ms.
    pub ttft_ms: f64,
    /// Largest acceptable mean inter-token latency, ms.
    pub itl_ms: f64,
}

impl Default for Slo {
    fn default() -> Self {
        Slo { ttft_ms: 2_000.0, itl_ms: 100.0 }
    }
}

impl Slo {
    /// Whether `s` met this objective.
    pub fn met_by(&self, s: &Sample) -> bool {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        ms(s.ttft) <= self.ttft_ms && s.itl().is_none_or(|d| ms(d) <= self.itl_ms)
    }
}

/// How load is offered at one level.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Load {
    /// Closed loop: this many clients, each sending its next request when the last one ended.
    Concurrency(usize),
    /// Open loop: requests arrive as a Poisson process at this many per second.
    Rate(f64),
}

impl Load {
    /// `c=4` or `2.5 req/s`, for tables, progress and plot labels.
    pub fn label(&self) -> String {
        match self {
            Load::Concurrency(c) => format!("c={c}"),
            Load::Rate(r) => format!("{r} req/s"),
        }
    }
}

impl std::fmt::Display for Load {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Load::Concurrency(c) => write!(f, "concurrency {c}"),
            Load::Rate(r) => write!(f, "rate {r} req/s"),
        }
    }
}

/// Figures of one load level.
#[derive(Clone, Debug, Serialize)]
pub struct Level {
    /// Clients at once (closed loop), or absent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub concurrency: Option<usize>,
    /// Poisson arrival rate, requests per second (open loop), or absent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rate_req_s: Option<f64>,
    /// Time to first token percentiles, ms.
    pub ttft_p50_ms: f64,
    pub ttft_p90_ms: f64,
    pub ttft_p99_ms: f64,
    /// Per-request mean inter-token latency percentiles, ms (requests with ≥ 2 tokens).
    pub itl_p50_ms: f64,
    pub itl_p90_ms: f64,
    pub itl_p99_ms: f64,
    /// End-to-end latency percentiles, ms.
    pub e2e_p50_ms: f64,
    pub e2e_p90_ms: f64,
    pub e2e_p99_ms: f64,
    /// Output tokens per second over the level's wall time.
    pub output_tok_s: f64,
    /// Finished requests per second over the level's wall time.
    pub throughput_req_s: f64,
    /// Requests per second that met the SLO, over the level's wall time.
    pub goodput_req_s: f64,
    /// Share of requests that met the SLO, 0..=1.
    pub slo_attainment: f64,
    /// Requests that finished.
    pub requests: usize,
    /// Output tokens received, all requests together.
    pub output_tokens: usize,
    /// The level's wall time, s (first arrival to last token).
    pub wall_s: f64,
}

impl Level {
    /// The load this level was measured at.
    pub fn load(&self) -> Load {
        match (self.concurrency, self.rate_req_s) {
            (Some(c), _) => Load::Concurrency(c),
            (None, Some(r)) => Load::Rate(r),
            (None, None) => unreachable!("a level has a concurrency or a rate"),
        }
    }
}

/// The `p` quantile (0..=1) of `v` by nearest rank; 0 for no values.
pub fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// The figures of `samples`, measured over `wall`.
pub fn summarize(load: Load, samples: &[Sample], wall: Duration, slo: &Slo) -> Level {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let mut ttft: Vec<f64> = samples.iter().map(|s| ms(s.ttft)).collect();
    let mut e2e: Vec<f64> = samples.iter().map(|s| ms(s.e2e)).collect();
    let mut itl: Vec<f64> = samples.iter().filter_map(Sample::itl).map(ms).collect();
    let tokens: usize = samples.iter().map(|s| s.tokens).sum();
    let good = samples.iter().filter(|s| slo.met_by(s)).count();
    let secs = wall.as_secs_f64().max(1e-9);
    let (concurrency, rate_req_s) = match load {
        Load::Concurrency(c) => (Some(c), None),
        Load::Rate(r) => (None, Some(r)),
    };
    Level {
        concurrency,
        rate_req_s,
        ttft_p50_ms: pct(&mut ttft, 0.5),
        ttft_p90_ms: pct(&mut ttft, 0.9),
        ttft_p99_ms: pct(&mut ttft, 0.99),
        itl_p50_ms: pct(&mut itl, 0.5),
        itl_p90_ms: pct(&mut itl, 0.9),
        itl_p99_ms: pct(&mut itl, 0.99),
        e2e_p50_ms: pct(&mut e2e, 0.5),
        e2e_p90_ms: pct(&mut e2e, 0.9),
        e2e_p99_ms: pct(&mut e2e, 0.99),
        output_tok_s: tokens as f64 / secs,
        throughput_req_s: samples.len() as f64 / secs,
        goodput_req_s: good as f64 / secs,
        slo_attainment: if samples.is_empty() { 0.0 } else { good as f64 / samples.len() as f64 },
        requests: samples.len(),
        output_tokens: tokens,
        wall_s: wall.as_secs_f64(),
    }
}

/// Seeded Poisson arrival offsets from the level's start: `n` exponential gaps of mean
/// `1 / rate_req_s`, the first request at 0.
pub fn poisson_arrivals(n: usize, rate_req_s: f64, seed: u64) -> Vec<Duration> {
    let mut rng = tandem_engine::rng::Rng::new(seed);
    let mut t = 0.0f64;
    (0..n)
        .map(|i| {
            if i > 0 {
                // 1 - u is in (0, 1]: ln never sees 0.
                t += -(1.0 - rng.next_f64()).ln() / rate_req_s;
            }
            Duration::from_secs_f64(t)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(ttft_ms: u64, e2e_ms: u64, tokens: usize) -> Sample {
        Sample { ttft: Duration::from_millis(ttft_ms), e2e: Duration::from_millis(e2e_ms), tokens }
    }

    #[test]
    fn percentiles_goodput_and_attainment() {
        // ITLs: (1000-100)/9 = 100 ms, (2100-300)/9 = 200 ms, (650-200)/9 = 50 ms, none.
        let samples = [s(100, 1000, 10), s(300, 2100, 10), s(200, 650, 10), s(3000, 3000, 1)];
        let slo = Slo { ttft_ms: 500.0, itl_ms: 150.0 };
        let l = summarize(Load::Rate(2.0), &samples, Duration::from_secs(4), &slo);
        assert_eq!((l.concurrency, l.rate_req_s), (None, Some(2.0)));
        assert_eq!(l.ttft_p50_ms, 300.0); // nearest rank of [100, 200, 300, 3000]
        assert_eq!(l.ttft_p99_ms, 3000.0);
        assert_eq!(l.itl_p50_ms, 100.0); // of [50, 100, 200]
        assert_eq!(l.itl_p99_ms, 200.0);
        // Met: the first (100 ms, 100 ms) and the third (200 ms, 50 ms); the second's ITL and
        // the fourth's TTFT miss.
        assert_eq!(l.goodput_req_s, 0.5);
        assert_eq!(l.slo_attainment, 0.5);
        assert_eq!(l.throughput_req_s, 1.0);
        assert_eq!(l.output_tokens, 31);
        assert_eq!(l.load(), Load::Rate(2.0));
    }

    #[test]
    fn poisson_arrivals_are_seeded_increasing_and_at_the_rate() {
        let a = poisson_arrivals(4000, 8.0, 7);
        assert_eq!(a, poisson_arrivals(4000, 8.0, 7));
        assert_ne!(a, poisson_arrivals(4000, 8.0, 8));
        assert_eq!(a[0], Duration::ZERO);
        assert!(a.windows(2).all(|w| w[0] <= w[1]));
        // 3999 gaps of mean 125 ms: the span is within 5 % of 500 s (sd ≈ 1.6 %).
        let span = a.last().unwrap().as_secs_f64();
        assert!((span - 3999.0 / 8.0).abs() < 0.05 * 500.0, "{span}");
    }
}
