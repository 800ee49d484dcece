//! The planner in the simulation: `tandem_planner::decide` every interval on the figures the
//! load reports carry; scale-ups warm up before serving, scale-downs drain; the pools together
//! never exceed the cluster's GPUs.

use super::*;

impl Sim {
    // --- the planner ----------------------------------------------------------------------------

    pub(super) fn on_planner_tick(&mut self) {
        let Some(cfg) = self.cfg.planner.clone() else { return };
        let interval = cfg.interval_ms as f64 / 1000.0;
        let cap = (self.cfg.gpus / self.cfg.roofline.tp) as usize;
        let pool = |sim: &mut Sim, role: Role| {
            let mut nodes = Vec::new();
            let mut serving = 0;
            for i in 0..sim.insts.len() {
                if sim.insts[i].role != role || sim.insts[i].life != Life::Serving {
                    continue;
                }
                serving += 1;
                let l = sim.load_of(i);
                let pending = match &sim.insts[i].kind {
                    Kind::Prefill { sched, .. } => sched.pending_prompt_tokens() as u64,
                    _ => 0,
                };
                let tps = std::mem::take(&mut sim.insts[i].computed_tokens) as f64 / interval;
                nodes.push(NodeLoad {
                    queue_len: l.queue_len,
                    running: l.running,
                    pending_prompt_tokens: pending,
                    free_blocks: l.free_blocks,
                    total_blocks: l.total_blocks,
                    tokens_per_s: tps,
                    max_running: if role == Role::Decode { sim.cfg.max_batch } else { 0 },
                });
            }
            let k = if role == Role::Prefill { 0 } else { 1 };
            PoolObservation { desired: sim.desired[k], serving, nodes, bounds: Some((1, cap - 1)) }
        };
        let obs = Observation {
            at: self.base + Duration::from_secs_f64(self.now),
            prefill: pool(self, Role::Prefill),
            decode: pool(self, Role::Decode),
        };
        for d in decide(&obs, &cfg, &mut self.memory) {
            let (k, role) = if d.pool == "prefill" { (0, Role::Prefill) } else { (1, Role::Decode) };
            let other = self.desired[1 - k];
            let to = d.to.min(cap - other);
            if to < d.to {
                self.capped += 1;
            }
            if to != self.desired[k] {
                self.decisions += 1;
                self.desired[k] = to;
                self.reconcile(role, to);
            }
        }
        self.at(self.now + interval, Event::PlannerTick);
    }

    /// Starts or drains instances of `role` until `want` are warming or serving.
    pub(super) fn reconcile(&mut self, role: Role, want: usize) {
        let live: Vec<usize> = (0..self.insts.len())
            .filter(|&i| {
                self.insts[i].role == role && matches!(self.insts[i].life, Life::Warming | Life::Serving)
            })
            .collect();
        if live.len() < want {
            for _ in live.len()..want {
                let i = self.add_instance(role, Life::Warming);
                self.at(self.now + self.cfg.warmup_s, Event::Ready(i));
            }
        } else {
            for &i in live.iter().rev().take(live.len() - want) {
                self.insts[i].life = Life::Draining;
                self.retire_if_drained(i);
            }
        }
    }

    pub(super) fn retire_if_drained(&mut self, i: usize) {
        let inst = &self.insts[i];
        if inst.life != Life::Draining || inst.busy {
            return;
        }
        let empty = match &inst.kind {
            Kind::Prefill { sched, .. } => sched.is_idle(),
            Kind::Decode(b) => b.running == 0 && b.waiting.is_empty() && b.reserved_tokens == 0,
            Kind::Colocated { .. } => false,
        };
        if empty {
            self.insts[i].life = Life::Gone;
            self.insts[i].ended_s = Some(self.now);
        }
    }
}
