//! What a run reports: GPUs per pool over time, and the summary at the end.

use super::*;

impl Sim {
    // --- results ---------------------------------------------------------------------------------

    pub(super) fn gpus_in(&self, role: Role, life: Life) -> u32 {
        self.insts
            .iter()
            .filter(|i| i.role == role && i.life == life)
            .count() as u32
            * self.cfg.roofline.tp
    }

    pub(super) fn on_sample(&mut self) {
        let colocated = self.cfg.mode == Mode::Colocated;
        let warming = self.gpus_in(Role::Prefill, Life::Warming) + self.gpus_in(Role::Decode, Life::Warming);
        let (p, d) = (self.gpus_in(Role::Prefill, Life::Serving), self.gpus_in(Role::Decode, Life::Serving));
        let ttft_p90_s = Percentiles::of(&mut self.window_ttft).p90;
        self.window_ttft.clear();
        self.timeline.push(PoolSample {
            t_s: self.now,
            prefill_gpus: if colocated { 0 } else { p },
            decode_gpus: d,
            warming_gpus: warming,
            arrival_rate: std::mem::take(&mut self.window_arrivals) as f64 / self.cfg.sample_s,
            ttft_p90_s,
        });
        self.at(self.now + self.cfg.sample_s, Event::Sample);
    }

    pub(super) fn report(mut self, wall_s: f64) -> RunReport {
        let tp = self.cfg.roofline.tp as f64;
        let gpu_s: f64 = self
            .insts
            .iter()
            .map(|i| (i.ended_s.unwrap_or(self.now) - i.started_s) * tp)
            .sum();
        let gpu_hours = gpu_s / 3600.0;
        let cost = gpu_hours * self.cfg.gpu_hour_usd;
        let arrived = self.reqs.len() as u64;
        let dur = self.cfg.duration_s;
        let goodput = self.good as f64 / dur;
        RunReport {
            mode: if self.cfg.mode == Mode::Colocated { "colocated" } else { "disaggregated" },
            gpus: self.cfg.gpus,
            tp: self.cfg.roofline.tp,
            arrived,
            completed: self.completed,
            rejected: self.rejected,
            ttft_s: Percentiles::of(&mut self.ttft),
            itl_s: self.itl.percentiles(),
            tpot_s: Percentiles::of(&mut self.tpot),
            slo_attainment: if arrived == 0 { 0.0 } else { self.good as f64 / arrived as f64 },
            goodput_rps: goodput,
            goodput_rps_per_gpu: goodput / (gpu_s / dur).max(1.0),
            output_tokens_per_s: self.output_tokens as f64 / dur,
            gpu_hours,
            usd_per_m_output_tokens: cost / (self.output_tokens.max(1) as f64 / 1e6),
            usd_per_m_tokens: cost / ((self.output_tokens + self.input_tokens).max(1) as f64 / 1e6),
            capped_scale_ups: self.capped,
            planner_decisions: self.decisions,
            timeline: self.timeline,
            wall_s,
        }
    }
}
