//! The event loop: requests arrive, the router's policies place them, instances step, the
//! planner resizes the pools.
//!
//! What is tandem's own code and what is modelled:
//! - **routing**: `tandem_router::routing`'s `ShortestQueuePrefillPolicy` and
//!   `FreeBlocksDecodePolicy` choose every prefill and decode instance (colocated instances
//!   are chosen like decode nodes), from the instances' current load (tandem's reports lag a
//!   few hundred ms; the simulation's do not);
//! - **prefill batching and admission**: each prefill instance runs the engine's real
//!   `Scheduler` (chunked prefill under a token budget, the waiting-queue bound, block
//!   accounting); only the forward pass is replaced by the roofline's time;
//! - **planner**: `tandem_planner::decide`, fed the same figures the load reports carry
//!   (pending prompt tokens, tokens/s, free and total KV blocks);
//! - **decode and colocated steps** are simulated step by step on aggregate state (running
//!   count, total context, completions keyed by step number): the same rules as the engine's
//!   scheduler (a batch cap, one token per running sequence per step, prompt + max output
//!   reserved up front, chunked prefill behind decodes when colocated) at O(log n) per step,
//!   which is what lets an hour of a thousand GPUs run in seconds;
//! - step and transfer times come from the roofline ([`crate::hw`]); the KV push is
//!   layer-wise, so only the last layer's share of the transfer follows the prefill.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::time::{Duration, Instant};

use tandem_cluster::Role;
use tandem_engine::scheduler::{Priority, ScheduledChunk, Scheduler, SchedulerConfig};
use tandem_planner::{NodeLoad, Observation, PlannerConfig, PlannerMemory, PoolObservation, decide};
use tandem_router::routing::{
    Candidate, Demand, FreeBlocksDecodePolicy, LoadEstimate, RoutingPolicy, ShortestQueuePrefillPolicy,
};

use crate::hw::{MeasuredSteps, Roofline};

/// Where step times come from.
#[derive(Clone)]
enum Steps {
    Roofline(Roofline),
    Measured(std::sync::Arc<MeasuredSteps>),
}

impl Steps {
    /// A step computing `new` tokens (`decode` of them single decode tokens) attending to
    /// `attended` positions in all and reading `ctx` tokens of KV.
    fn step_s(&self, new: f64, decode: f64, attended: f64, ctx: f64) -> f64 {
        match self {
            Steps::Roofline(r) => r.step_s(new, attended, ctx),
            Steps::Measured(m) => {
                let prefill = new - decode;
                let d = if decode > 0.0 { m.decode_s(decode) } else { 0.0 };
                d + if prefill > 0.0 { m.prefill_s(prefill) } else { 0.0 }
            }
        }
    }

    fn transfer_s(&self, tokens: f64, layers: f64) -> f64 {
        match self {
            Steps::Roofline(r) => r.transfer_s(tokens) / layers,
            Steps::Measured(m) => m.transfer_s,
        }
    }
}
use crate::report::{ItlHistogram, Percentiles, PoolSample, RunReport};
use crate::workload::{Arrivals, Lengths, Rng};

/// KV block size, tokens (tandem's default).
pub const BLOCK_TOKENS: u64 = 16;

/// Disaggregated with a prefill/decode split, or colocated.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Mode {
    /// `prefill` instances prefill, the rest decode.
    Disaggregated {
        /// Prefill instances at the start.
        prefill: u32,
    },
    /// Every instance does both.
    Colocated,
}

/// One run's settings.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// GPUs in the cluster (the cap on the pools together).
    pub gpus: u32,
    /// The hardware and model.
    pub roofline: Roofline,
    /// Simulated time, s.
    pub duration_s: f64,
    /// Arrivals.
    pub arrivals: Arrivals,
    /// Lengths.
    pub lengths: Lengths,
    /// Seed.
    pub seed: u64,
    /// Disaggregated or colocated.
    pub mode: Mode,
    /// Most sequences a decode (or colocated) instance runs at once.
    pub max_batch: u32,
    /// Tokens per step (prefill chunks; colocated: decodes plus chunks).
    pub max_tokens_per_step: u32,
    /// TTFT SLO, s.
    pub ttft_slo_s: f64,
    /// Time-per-output-token SLO, s.
    pub tpot_slo_s: f64,
    /// The planner (disaggregated only); `None`: the split stays fixed.
    pub planner: Option<PlannerConfig>,
    /// Time from a scale-up decision to the instance serving (load + warm-up), s.
    pub warmup_s: f64,
    /// $ per GPU-hour.
    pub gpu_hour_usd: f64,
    /// Timeline sample period, s.
    pub sample_s: f64,
    /// Step times measured on a real engine instead of the roofline's (KV capacity still
    /// comes from the roofline).
    pub measured: Option<crate::hw::MeasuredSteps>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    Arrival,
    Route(u32),
    Step(u32),
    Transferred(u32),
    Ready(u32),
    PlannerTick,
    Sample,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Life {
    Warming,
    Serving,
    Draining,
    Gone,
}

#[derive(Clone, Copy, Debug)]
struct Request {
    arrived: f64,
    prompt: u32,
    output: u32,
    first_token: f64,
    decode: u32,
}

/// A decode (or colocated) instance's batch, as aggregates.
#[derive(Default)]
struct Batch {
    running: u32,
    context: f64,
    step_no: u64,
    done_at: BinaryHeap<Reverse<(u64, u32)>>,
    /// Requests whose KV is here, waiting for a batch slot.
    waiting: VecDeque<u32>,
    /// Tokens reserved (prompt + output of every request placed here, until it completes).
    reserved_tokens: u64,
}

/// A colocated instance's prompts: (request, tokens computed so far).
#[derive(Default)]
struct Prompts {
    queue: VecDeque<(u32, u32)>,
}

enum Kind {
    Prefill { sched: Box<Scheduler>, step: Vec<ScheduledChunk> },
    Decode(Batch),
    Colocated { batch: Batch, prompts: Prompts, step: Vec<(u32, u32, u32)> },
}

struct Inst {
    name: String,
    role: Role,
    life: Life,
    busy: bool,
    started_s: f64,
    ended_s: Option<f64>,
    computed_tokens: u64,
    kind: Kind,
}

/// The simulation.
pub struct Sim {
    cfg: SimConfig,
    now: f64,
    seq: u64,
    events: BinaryHeap<Reverse<(u64, u64, Event)>>,
    rng: Rng,
    reqs: Vec<Request>,
    insts: Vec<Inst>,
    router_queue: VecDeque<u32>,
    kv_capacity_tokens: u64,
    steps: Steps,
    base: Instant,
    memory: PlannerMemory,
    desired: [usize; 2],
    // results
    ttft: Vec<f32>,
    tpot: Vec<f32>,
    itl: ItlHistogram,
    good: u64,
    completed: u64,
    rejected: u64,
    output_tokens: u64,
    input_tokens: u64,
    capped: u64,
    decisions: u64,
    timeline: Vec<PoolSample>,
    window_arrivals: u64,
    window_ttft: Vec<f32>,
}

fn ns(t: f64) -> u64 {
    (t * 1e9) as u64
}

impl Sim {
    /// A simulation of `cfg` (nothing runs until [`Sim::run`]).
    pub fn new(cfg: SimConfig) -> Sim {
        let kv_capacity_tokens = cfg.kv_capacity_tokens() as u64;
        let mut sim = Sim {
            rng: Rng::new(cfg.seed),
            now: 0.0,
            seq: 0,
            events: BinaryHeap::new(),
            reqs: Vec::new(),
            insts: Vec::new(),
            router_queue: VecDeque::new(),
            kv_capacity_tokens,
            steps: match &cfg.measured {
                Some(m) => Steps::Measured(std::sync::Arc::new(m.clone())),
                None => Steps::Roofline(cfg.roofline),
            },
            base: Instant::now(),
            memory: PlannerMemory::default(),
            desired: [0, 0],
            ttft: Vec::new(),
            tpot: Vec::new(),
            itl: ItlHistogram::default(),
            good: 0,
            completed: 0,
            rejected: 0,
            output_tokens: 0,
            input_tokens: 0,
            capped: 0,
            decisions: 0,
            timeline: Vec::new(),
            window_arrivals: 0,
            window_ttft: Vec::new(),
            cfg,
        };
        let instances = sim.cfg.gpus / sim.cfg.roofline.tp;
        match sim.cfg.mode {
            Mode::Disaggregated { prefill } => {
                let prefill = prefill.clamp(1, instances.saturating_sub(1).max(1));
                for i in 0..instances {
                    let role = if i < prefill { Role::Prefill } else { Role::Decode };
                    sim.add_instance(role, Life::Serving);
                }
                sim.desired = [prefill as usize, (instances - prefill) as usize];
            }
            Mode::Colocated => {
                for _ in 0..instances {
                    sim.add_instance(Role::Decode, Life::Serving);
                }
            }
        }
        sim.at(0.0, Event::Arrival);
        sim.at(sim.cfg.sample_s, Event::Sample);
        if let (Some(p), Mode::Disaggregated { .. }) = (&sim.cfg.planner, sim.cfg.mode) {
            sim.at(p.interval_ms as f64 / 1000.0, Event::PlannerTick);
        }
        sim
    }

    fn at(&mut self, t: f64, e: Event) {
        self.seq += 1;
        self.events.push(Reverse((ns(t), self.seq, e)));
    }

    fn add_instance(&mut self, role: Role, life: Life) -> u32 {
        let id = self.insts.len() as u32;
        let colocated = self.cfg.mode == Mode::Colocated;
        let kind = match role {
            Role::Prefill => {
                let blocks = (self.kv_capacity_tokens / BLOCK_TOKENS) as usize;
                let sched = Scheduler::new(
                    SchedulerConfig {
                        max_num_seqs: 64,
                        max_tokens_per_step: self.cfg.max_tokens_per_step as usize,
                        max_waiting: 4096,
                        max_wait: Duration::ZERO,
                        length_buckets: vec![],
                        enable_prefix_caching: false,
                        max_model_len: 1 << 20,
                    },
                    blocks,
                    BLOCK_TOKENS as usize,
                )
                .expect("a valid scheduler config");
                Kind::Prefill { sched: Box::new(sched), step: Vec::new() }
            }
            Role::Decode if colocated => Kind::Colocated {
                batch: Batch::default(),
                prompts: Prompts::default(),
                step: Vec::new(),
            },
            Role::Decode => Kind::Decode(Batch::default()),
        };
        self.insts.push(Inst {
            name: format!("{}-{id:05}", role.as_str()),
            role,
            life,
            busy: false,
            started_s: self.now,
            ended_s: None,
            computed_tokens: 0,
            kind,
        });
        id
    }

    /// Runs to the end and reports.
    pub fn run(mut self) -> RunReport {
        let wall = Instant::now();
        let end = ns(self.cfg.duration_s);
        while let Some(Reverse((t, _, e))) = self.events.pop() {
            if t > end {
                break;
            }
            self.now = t as f64 / 1e9;
            match e {
                Event::Arrival => self.on_arrival(),
                Event::Route(r) => {
                    if !self.place(r) {
                        self.router_queue.push_back(r);
                    }
                }
                Event::Step(i) => self.on_step_done(i),
                Event::Transferred(r) => self.on_transferred(r),
                Event::Ready(i) => {
                    if self.insts[i as usize].life == Life::Warming {
                        self.insts[i as usize].life = Life::Serving;
                        self.dispatch_router_queue();
                    }
                }
                Event::PlannerTick => self.on_planner_tick(),
                Event::Sample => self.on_sample(),
            }
        }
        self.now = self.cfg.duration_s;
        self.report(wall.elapsed().as_secs_f64())
    }

    // --- arrivals and routing -------------------------------------------------------------

    fn on_arrival(&mut self) {
        let (prompt, output) = self.cfg.lengths.draw(&mut self.rng);
        let id = self.reqs.len() as u32;
        self.reqs.push(Request { arrived: self.now, prompt, output, first_token: f64::NAN, decode: u32::MAX });
        self.window_arrivals += 1;
        let overhead = self.cfg.measured.as_ref().map_or(0.0, |m| m.overhead_s);
        if overhead > 0.0 {
            self.at(self.now + overhead, Event::Route(id));
        } else if !self.place(id) {
            self.router_queue.push_back(id);
        }
        let next = self.cfg.arrivals.next_after(self.now, &mut self.rng);
        self.at(next, Event::Arrival);
    }

    fn load_of(&self, i: usize) -> LoadEstimate {
        let inst = &self.insts[i];
        let total = self.kv_capacity_tokens / BLOCK_TOKENS;
        match &inst.kind {
            Kind::Prefill { sched, .. } => LoadEstimate {
                queue_len: sched.num_waiting() as u32,
                running: sched.num_running() as u32,
                free_blocks: sched.blocks().num_free() as u64,
                total_blocks: total,
            },
            Kind::Decode(b) | Kind::Colocated { batch: b, .. } => LoadEstimate {
                queue_len: b.waiting.len() as u32
                    + match &inst.kind {
                        Kind::Colocated { prompts, .. } => prompts.queue.len() as u32,
                        _ => 0,
                    },
                running: b.running,
                free_blocks: total.saturating_sub(b.reserved_tokens.div_ceil(BLOCK_TOKENS)),
                total_blocks: total,
            },
        }
    }

    /// Chooses with `policy` among serving instances of `role`.
    fn choose(&self, role: Role, policy: &dyn RoutingPolicy, demand_tokens: u64) -> Option<usize> {
        let idx: Vec<usize> = (0..self.insts.len())
            .filter(|&i| self.insts[i].role == role && self.insts[i].life == Life::Serving)
            .collect();
        let cands: Vec<Candidate<'_>> = idx
            .iter()
            .map(|&i| Candidate {
                node_id: &self.insts[i].name,
                load: Some(self.load_of(i)),
                in_flight: 0,
                block_size_tokens: BLOCK_TOKENS,
            })
            .collect();
        let pick = policy.select(&cands, Demand { tokens: demand_tokens })?;
        // The policy falls back to the freest node when none has room; the reservation would
        // then fail, so the request waits in the router instead.
        let blocks = demand_tokens.div_ceil(BLOCK_TOKENS);
        (role == Role::Prefill || cands[pick].load.is_some_and(|l| l.free_blocks >= blocks))
            .then_some(idx[pick])
    }

    /// Places a request (reserve on decode, then prefill); false when no decode has room now.
    fn place(&mut self, id: u32) -> bool {
        let r = self.reqs[id as usize];
        let demand = (r.prompt + r.output) as u64;
        let Some(d) = self.choose(Role::Decode, &FreeBlocksDecodePolicy, demand) else {
            return false;
        };
        if let Mode::Colocated = self.cfg.mode {
            let Kind::Colocated { batch, prompts, .. } = &mut self.insts[d].kind else { unreachable!() };
            batch.reserved_tokens += demand;
            prompts.queue.push_back((id, 0));
            self.reqs[id as usize].decode = d as u32;
            self.kick(d);
            return true;
        }
        let Some(p) = self.choose(Role::Prefill, &ShortestQueuePrefillPolicy, r.prompt as u64) else {
            return false;
        };
        let now = self.base + Duration::from_secs_f64(self.now);
        let Kind::Prefill { sched, .. } = &mut self.insts[p].kind else { unreachable!() };
        if sched.add(id as u64, vec![0; r.prompt as usize], 1, Priority::Interactive, now).is_err() {
            self.rejected += 1;
            return true; // refused: counted, not retried
        }
        let Kind::Decode(b) = &mut self.insts[d].kind else { unreachable!() };
        b.reserved_tokens += demand;
        self.reqs[id as usize].decode = d as u32;
        self.kick(p);
        true
    }

    fn dispatch_router_queue(&mut self) {
        while let Some(&id) = self.router_queue.front() {
            if !self.place(id) {
                return;
            }
            self.router_queue.pop_front();
        }
    }

    // --- steps --------------------------------------------------------------------------------

    /// Starts a step on an idle instance that has work.
    fn kick(&mut self, i: usize) {
        if self.insts[i].busy || self.insts[i].life == Life::Gone {
            return;
        }
        let roof = self.steps.clone();
        let max_batch = self.cfg.max_batch;
        let budget = self.cfg.max_tokens_per_step;
        let step_s = match &mut self.insts[i].kind {
            Kind::Prefill { sched, step } => {
                let out = sched.schedule();
                *step = out.chunks;
                if step.is_empty() {
                    return;
                }
                let (mut new, mut attended, mut ctx) = (0.0, 0.0, 0.0);
                for c in step.iter() {
                    let (s, l) = (c.first_pos as f64, c.len as f64);
                    new += l;
                    attended += l * s + l * (l + 1.0) / 2.0;
                    ctx += s + l;
                }
                roof.step_s(new, 0.0, attended, ctx)
            }
            Kind::Decode(b) => {
                admit(b, max_batch, &self.reqs);
                if b.running == 0 {
                    return;
                }
                let n = b.running as f64;
                roof.step_s(n, n, b.context, b.context)
            }
            Kind::Colocated { batch, prompts, step } => {
                admit(batch, max_batch, &self.reqs);
                step.clear();
                let mut left = budget.saturating_sub(batch.running);
                let (mut new, mut attended, mut ctx) =
                    (batch.running as f64, batch.context, batch.context);
                for &(id, done) in prompts.queue.iter() {
                    if left == 0 {
                        break;
                    }
                    let rest = self.reqs[id as usize].prompt - done;
                    let n = rest.min(left);
                    let (s, l) = (done as f64, n as f64);
                    new += l;
                    attended += l * s + l * (l + 1.0) / 2.0;
                    ctx += s + l;
                    step.push((id, done, n));
                    left -= n;
                }
                if new == 0.0 {
                    return;
                }
                roof.step_s(new, batch.running as f64, attended, ctx)
            }
        };
        self.insts[i].busy = true;
        self.at(self.now + step_s, Event::Step(i as u32));
        if let Kind::Decode(b) | Kind::Colocated { batch: b, .. } = &self.insts[i].kind {
            self.itl.add(step_s, b.running as u64);
        }
    }

    fn on_step_done(&mut self, i: u32) {
        let i = i as usize;
        self.insts[i].busy = false;
        let now = self.now;
        let layers = self.cfg.roofline.model.layers as f64;
        let steps = self.steps.clone();
        let mut first_tokens = Vec::new();
        let mut finished = Vec::new();
        let mut computed = 0u64;
        match &mut self.insts[i].kind {
            Kind::Prefill { sched, step } => {
                for c in step.drain(..) {
                    sched.on_chunk_done(&c, c.want_logits.then_some(0));
                    computed += c.len as u64;
                    if c.want_logits {
                        let blocks = sched.detach(c.seq_id).unwrap_or_default();
                        sched.release_blocks(&blocks);
                        first_tokens.push(c.seq_id as u32);
                    }
                }
            }
            Kind::Decode(b) => {
                computed += b.running as u64;
                step_batch(b, &self.reqs, &mut finished);
            }
            Kind::Colocated { batch, prompts, step } => {
                computed += batch.running as u64;
                step_batch(batch, &self.reqs, &mut finished);
                for (id, done, n) in step.drain(..) {
                    computed += n as u64;
                    let e = prompts.queue.iter_mut().find(|e| e.0 == id).expect("queued");
                    debug_assert_eq!(e.1, done);
                    e.1 = done + n;
                    if e.1 == self.reqs[id as usize].prompt {
                        prompts.queue.retain(|e| e.0 != id);
                        first_tokens.push(id);
                        batch.waiting.push_back(id);
                    }
                }
            }
        }
        self.insts[i].computed_tokens += computed;
        for id in first_tokens {
            let r = &mut self.reqs[id as usize];
            r.first_token = now;
            let ttft = (now - r.arrived) as f32;
            self.ttft.push(ttft);
            self.window_ttft.push(ttft);
            self.input_tokens += r.prompt as u64;
            if self.cfg.mode != Mode::Colocated {
                let tail = steps.transfer_s(r.prompt as f64, layers);
                self.at(now + tail, Event::Transferred(id));
            }
        }
        let freed = !finished.is_empty();
        for id in finished {
            self.finish(id);
        }
        self.kick(i);
        self.retire_if_drained(i);
        if freed {
            self.dispatch_router_queue();
        }
    }

    fn on_transferred(&mut self, id: u32) {
        let d = self.reqs[id as usize].decode as usize;
        if let Kind::Decode(b) = &mut self.insts[d].kind {
            b.waiting.push_back(id);
        }
        self.kick(d);
    }

    fn finish(&mut self, id: u32) {
        let r = self.reqs[id as usize];
        let d = r.decode as usize;
        if let Kind::Decode(b) | Kind::Colocated { batch: b, .. } = &mut self.insts[d].kind {
            b.reserved_tokens -= (r.prompt + r.output) as u64;
        }
        let tpot = if r.output > 1 { (self.now - r.first_token) / (r.output - 1) as f64 } else { 0.0 };
        self.tpot.push(tpot as f32);
        self.completed += 1;
        self.output_tokens += r.output as u64;
        if r.first_token - r.arrived <= self.cfg.ttft_slo_s && tpot <= self.cfg.tpot_slo_s {
            self.good += 1;
        }
    }

    // --- the planner ----------------------------------------------------------------------------

    fn on_planner_tick(&mut self) {
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
    fn reconcile(&mut self, role: Role, want: usize) {
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

    fn retire_if_drained(&mut self, i: usize) {
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

    // --- results ---------------------------------------------------------------------------------

    fn gpus_in(&self, role: Role, life: Life) -> u32 {
        self.insts
            .iter()
            .filter(|i| i.role == role && i.life == life)
            .count() as u32
            * self.cfg.roofline.tp
    }

    fn on_sample(&mut self) {
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

    fn report(mut self, wall_s: f64) -> RunReport {
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

/// Moves waiting requests into the batch while there is room.
fn admit(b: &mut Batch, max_batch: u32, reqs: &[Request]) {
    while b.running < max_batch {
        let Some(id) = b.waiting.pop_front() else { break };
        let r = reqs[id as usize];
        b.running += 1;
        b.context += r.prompt as f64 + 1.0;
        // The first token came from the prefill; each step adds one more.
        b.done_at.push(Reverse((b.step_no + (r.output.max(1) - 1) as u64, id)));
    }
}

/// One decode step done: every running sequence has one more token; some finish.
fn step_batch(b: &mut Batch, reqs: &[Request], finished: &mut Vec<u32>) {
    b.step_no += 1;
    b.context += b.running as f64;
    while let Some(&Reverse((at, id))) = b.done_at.peek() {
        if at > b.step_no {
            break;
        }
        b.done_at.pop();
        let r = reqs[id as usize];
        b.running -= 1;
        b.context -= (r.prompt + r.output) as f64;
        finished.push(id);
    }
    if b.running == 0 {
        b.context = 0.0;
    }
}
