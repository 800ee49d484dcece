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
use tandem_engine::scheduler::{ClassPolicy, Priority, ScheduledChunk, Scheduler, SchedulerConfig};
use tandem_planner::{NodeLoad, Observation, PlannerConfig, PlannerMemory, PoolObservation, decide};
use tandem_router::routing::{
    Candidate, Demand, FreeBlocksDecodePolicy, LoadEstimate, RoutingPolicy, ShortestQueuePrefillPolicy,
};

use crate::hw::{MeasuredSteps, Roofline};

mod planning;
mod results;
mod steps;

use steps::Steps;

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
        // A closed loop starts with every client's first request; an open one with the first.
        let first = match sim.cfg.arrivals {
            Arrivals::Closed { clients } => clients,
            _ => 1,
        };
        for _ in 0..first {
            sim.at(0.0, Event::Arrival);
        }
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
                        // One bucket, no window: admission in arrival order.
                        classes: std::array::from_fn(|_| ClassPolicy {
                            max_wait: Duration::ZERO,
                            length_buckets: vec![usize::MAX],
                        }),
                        batch_aging: Duration::from_secs(2),
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
        if let Some(next) = self.cfg.arrivals.next_after(self.now, &mut self.rng) {
            self.at(next, Event::Arrival);
        }
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
                pending_prompt_tokens: sched.pending_prompt_tokens() as u64,
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
                pending_prompt_tokens: 0,
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
                cached_tokens: 0,
            })
            .collect();
        let demand = Demand {
            tokens: demand_tokens,
            ..Demand::default()
        };
        let pick = policy.select(&cands, demand)?;
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

}
