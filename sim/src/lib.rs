//! `tandem sim`: a discrete-event simulation of a large tandem cluster — by default a thousand
//! H200s serving the seed's 70B GQA model, 8-way tensor parallel per instance — with tandem's
//! own routing policies, the engine's scheduler on every prefill instance and the planner's
//! decision function (see [`sim`] for what is tandem's code and what is modelled).
//!
//! ```text
//! hw        Roofline: model shape × GPU → prefill/decode step and KV-transfer times, KV capacity
//! workload  Poisson and bursty arrivals, prompt/output lengths, a seeded RNG
//! sim       the event loop (routing, prefill with the real Scheduler, decode batches, planner)
//! report    percentiles, goodput under SLO, cost per 1M tokens, GPUs per pool over time
//! ```
//! [`compare`] runs the same workload disaggregated and colocated on the same GPUs.

#![warn(missing_docs)]

pub mod hw;
pub mod report;
pub mod sim;
pub mod workload;

use serde::Serialize;

pub use hw::{Gpu, MeasuredSteps, ModelShape, Roofline};
pub use report::{Percentiles, PoolSample, RunReport};
pub use sim::{Mode, Sim, SimConfig};
pub use workload::{Arrivals, Lengths, Rng};

/// What can be wrong with a simulation's settings.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// A setting is out of range.
    #[error("sim: `{field}` = {value}: {reason}")]
    Config {
        /// The flag.
        field: &'static str,
        /// Its value.
        value: String,
        /// Why it is refused.
        reason: String,
    },
}

fn bad(field: &'static str, value: impl ToString, reason: &str) -> SimError {
    SimError::Config {
        field,
        value: value.to_string(),
        reason: reason.to_string(),
    }
}

impl SimConfig {
    /// Refuses settings the simulation cannot run, naming the flag.
    pub fn validate(&self) -> Result<(), SimError> {
        let tp = self.roofline.tp;
        if tp == 0 || self.gpus < 2 * tp {
            return Err(bad("gpus", self.gpus, &format!("needs at least two instances of --tp {tp}")));
        }
        if self.kv_capacity_tokens() < (self.lengths.prompt + self.lengths.output) as f64 * 2.0 {
            return Err(bad("tp", tp, "the model's weights leave no room for KV at this tensor-parallel width"));
        }
        if self.duration_s.is_nan() || self.duration_s <= 0.0 {
            return Err(bad("duration-secs", self.duration_s, "must be positive"));
        }
        match self.arrivals {
            Arrivals::Closed { clients } if clients == 0 => {
                return Err(bad("clients", clients, "must be at least 1"));
            }
            Arrivals::Closed { .. } => {}
            _ => {
                let rate = self.arrivals.mean_rate().unwrap_or(0.0);
                if !rate.is_finite() || rate <= 0.0 {
                    return Err(bad("rate", rate, "must be positive"));
                }
            }
        }
        if let Arrivals::Bursty { high, duty, period_s, .. } = self.arrivals
            && !(high >= 1.0 && high * duty < 1.0 && duty > 0.0 && period_s > 0.0)
        {
            return Err(bad("burst", format!("high {high}, duty {duty}"), "needs high ≥ 1, 0 < duty, high × duty < 1"));
        }
        if self.lengths.prompt == 0 || self.lengths.output == 0 || !(0.0..1.0).contains(&self.lengths.spread) {
            return Err(bad("prompt-tokens/output-tokens/spread", format!("{:?}", self.lengths), "lengths ≥ 1, spread in [0, 1)"));
        }
        if self.max_batch == 0 || self.max_tokens_per_step < self.max_batch {
            return Err(bad("max-tokens-per-step", self.max_tokens_per_step, "must be at least --max-batch"));
        }
        if let Some(p) = &self.planner {
            p.validate().map_err(|e| bad("slo-file", "", &e.to_string()))?;
        }
        Ok(())
    }

    /// KV tokens one instance holds (measured steps carry their own).
    pub fn kv_capacity_tokens(&self) -> f64 {
        match &self.measured {
            Some(m) => m.kv_capacity_tokens,
            None => self.roofline.kv_capacity_tokens(),
        }
    }

    /// Per instance, requests/s a prefill instance and a decode instance can take at these
    /// lengths (roofline; decode at its batch cap).
    pub fn capacities(&self) -> (f64, f64) {
        let (p, o) = (self.lengths.prompt as f64, self.lengths.output as f64);
        let r = &self.roofline;
        let prefill = 1.0 / r.prefill_chunk_s(0.0, p).max(1e-9);
        let batch = self.max_batch as f64;
        let fit = (r.kv_capacity_tokens() / (p + o)).floor().min(batch).max(1.0);
        let step = r.decode_step_s(fit, fit * (p + o / 2.0));
        let decode = fit / (o * step);
        (prefill, decode)
    }

    /// The prefill instances that balance the two pools' capacities on `gpus`.
    pub fn balanced_prefill_instances(&self) -> u32 {
        let n = self.gpus / self.roofline.tp;
        let (p, d) = self.capacities();
        let share = (1.0 / p) / (1.0 / p + 1.0 / d);
        ((n as f64 * share).round() as u32).clamp(1, n - 1)
    }

    /// Requests/s the cluster can take at the balanced split.
    pub fn capacity_rps(&self) -> f64 {
        let n = self.gpus / self.roofline.tp;
        let np = self.balanced_prefill_instances();
        let (p, d) = self.capacities();
        (np as f64 * p).min((n - np) as f64 * d)
    }
}

/// Both modes on the same workload and GPUs.
#[derive(Clone, Debug, Serialize)]
pub struct Comparison {
    /// The workload's mean rate, requests/s (a closed loop's: what the disaggregated run
    /// sustained).
    pub rate_rps: f64,
    /// Prompt and output lengths.
    pub lengths: Lengths,
    /// TTFT SLO, s.
    pub ttft_slo_s: f64,
    /// TPOT SLO, s.
    pub tpot_slo_s: f64,
    /// Disaggregated (with the planner when configured).
    pub disaggregated: RunReport,
    /// Colocated.
    pub colocated: RunReport,
}

/// Runs `cfg` disaggregated (its own mode's split, or the balanced one) and colocated.
pub fn compare(cfg: &SimConfig) -> Result<Comparison, SimError> {
    cfg.validate()?;
    let disagg = SimConfig {
        mode: match cfg.mode {
            Mode::Disaggregated { prefill } => Mode::Disaggregated { prefill },
            Mode::Colocated => Mode::Disaggregated { prefill: cfg.balanced_prefill_instances() },
        },
        ..cfg.clone()
    };
    let coloc = SimConfig {
        mode: Mode::Colocated,
        planner: None,
        ..cfg.clone()
    };
    let disaggregated = Sim::new(disagg).run();
    Ok(Comparison {
        rate_rps: cfg
            .arrivals
            .mean_rate()
            .unwrap_or(disaggregated.arrived as f64 / cfg.duration_s),
        lengths: cfg.lengths,
        ttft_slo_s: cfg.ttft_slo_s,
        tpot_slo_s: cfg.tpot_slo_s,
        disaggregated,
        colocated: Sim::new(coloc).run(),
    })
}

/// The comparison as a table.
pub fn table(c: &Comparison) -> String {
    let mut out = format!(
        "workload: {:.1} req/s, prompt {} / output {} tokens (±{:.0}%); SLO: TTFT ≤ {:.0} ms, TPOT ≤ {:.0} ms\n\n",
        c.rate_rps,
        c.lengths.prompt,
        c.lengths.output,
        c.lengths.spread * 100.0,
        c.ttft_slo_s * 1e3,
        c.tpot_slo_s * 1e3
    );
    out += &format!("{:<34} {:>16} {:>16}\n", "", "disaggregated", "colocated");
    let (d, k) = (&c.disaggregated, &c.colocated);
    let ms = |x: f64| format!("{:.1}", x * 1e3);
    let rows: Vec<(&str, String, String)> = vec![
        ("GPUs (instances × TP)", format!("{} × {}", d.gpus / d.tp, d.tp), format!("{} × {}", k.gpus / k.tp, k.tp)),
        ("requests arrived / completed", format!("{} / {}", d.arrived, d.completed), format!("{} / {}", k.arrived, k.completed)),
        ("TTFT p50 / p90 / p99 (ms)", format!("{} / {} / {}", ms(d.ttft_s.p50), ms(d.ttft_s.p90), ms(d.ttft_s.p99)), format!("{} / {} / {}", ms(k.ttft_s.p50), ms(k.ttft_s.p90), ms(k.ttft_s.p99))),
        ("ITL p50 / p90 / p99 (ms)", format!("{} / {} / {}", ms(d.itl_s.p50), ms(d.itl_s.p90), ms(d.itl_s.p99)), format!("{} / {} / {}", ms(k.itl_s.p50), ms(k.itl_s.p90), ms(k.itl_s.p99))),
        ("TPOT p90 (ms)", ms(d.tpot_s.p90), ms(k.tpot_s.p90)),
        ("SLO attainment", format!("{:.1}%", d.slo_attainment * 100.0), format!("{:.1}%", k.slo_attainment * 100.0)),
        ("goodput (req/s)", format!("{:.1}", d.goodput_rps), format!("{:.1}", k.goodput_rps)),
        ("goodput per GPU (req/s)", format!("{:.3}", d.goodput_rps_per_gpu), format!("{:.3}", k.goodput_rps_per_gpu)),
        ("output tokens/s", format!("{:.0}", d.output_tokens_per_s), format!("{:.0}", k.output_tokens_per_s)),
        ("GPU-hours", format!("{:.1}", d.gpu_hours), format!("{:.1}", k.gpu_hours)),
        ("$ per 1M output tokens", format!("{:.3}", d.usd_per_m_output_tokens), format!("{:.3}", k.usd_per_m_output_tokens)),
        ("$ per 1M tokens (in + out)", format!("{:.3}", d.usd_per_m_tokens), format!("{:.3}", k.usd_per_m_tokens)),
        ("planner decisions (capped)", format!("{} ({})", d.planner_decisions, d.capped_scale_ups), "-".into()),
        ("simulation wall time (s)", format!("{:.1}", d.wall_s), format!("{:.1}", k.wall_s)),
    ];
    for (name, a, b) in rows {
        out += &format!("{name:<34} {a:>16} {b:>16}\n");
    }
    if let (Some(first), Some(last)) = (d.timeline.first(), d.timeline.last()) {
        out += &format!(
            "\ndisaggregated GPUs per pool: prefill {} → {}, decode {} → {} (min prefill {}, max {}; {} samples in --format json)\n",
            first.prefill_gpus,
            last.prefill_gpus,
            first.decode_gpus,
            last.decode_gpus,
            d.timeline.iter().map(|s| s.prefill_gpus).min().unwrap_or(0),
            d.timeline.iter().map(|s| s.prefill_gpus).max().unwrap_or(0),
            d.timeline.len()
        );
    }
    out
}
