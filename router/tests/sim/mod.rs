//! The control plane under deterministic simulation (turmoil): the real router (routing,
//! retries, re-prefill, migration, the membership watch, the reservation guard, the load
//! fallback) talks real gRPC over a simulated network to simulated prefill and decode nodes
//! ([`nodes`]), while a seeded plan crashes and restarts nodes, partitions them, delays their
//! links, revokes their leases and cuts prefill→decode KV links.
//!
//! ```text
//!  seed ─▶ fault plan (what, to whom, when, how long) + network latency + workload
//!  turmoil sim: "router" client (Router + the workload) │ hosts prefill-0..1, decode-0..2
//!  driver: step 1 ms at a time, applying the plan (crash/bounce, partition/repair, hold/release)
//!  after: every request's outcome and the nodes' own accounting against the invariants
//! ```
//!
//! Invariants checked for every seed:
//! 1. every admitted request ends exactly once: one `Final` as its last event, or one error that
//!    is not a client error, a cancel or an internal one; none is left hanging;
//! 2. a stream (migrated or not) never repeats or skips a token: a finished one is exactly the
//!    fake model's output, a failed one a prefix of it;
//! 3. no reservation outlives its expiry, and no KV block is held once the load has ended;
//! 4. nothing is routed to a node without a live registration (beyond calls already in flight).
//!
//! Reproduction: the seed fixes the fault plan, the latencies and the workload (`TANDEM_SEED=N`
//! runs one seed). Turmoil orders hosts and messages from the same seed; the order of
//! `tokio::select!` branches within one tick follows tokio's own RNG, which only a
//! `--cfg tokio_unstable` build seeds too, so a rare interleaving may need a few runs.
//!
//! Not simulated: load reports (their freshness is wall-clock time, which the simulation does
//! not control), so the router routes on its fallback (its own in-flight counts) throughout;
//! etcd itself (membership is the in-process registry, with lease lapses modelled on the nodes).

pub mod net;
pub mod nodes;
pub mod prefill;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use tandem_cluster::{MemoryDiscovery, MemoryLoadSignals};
use tandem_router::{
    GenerateRequest, GenerationEvent, PromptInput, Router, RouterOptions, Sampling, ServedModel,
};

use crate::common::Rng;
use nodes::{World, next_token};

/// Prefill and decode hosts.
pub const PREFILL: [&str; 2] = ["prefill-0", "prefill-1"];
/// See [`PREFILL`].
pub const DECODE: [&str; 3] = ["decode-0", "decode-1", "decode-2"];
/// Requests per seed.
const REQUESTS: usize = 48;
/// A request still open this long after it started is hanging (a violation).
const REQUEST_LIMIT: Duration = Duration::from_secs(60);

/// One injected fault.
#[derive(Clone, Debug)]
pub enum Fault {
    /// The node's process dies (everything it held with it) and starts again after `for_`.
    Crash {
        node: &'static str,
        at: Duration,
        for_: Duration,
    },
    /// The node is cut off from every host and from the control plane (its registration lapses
    /// after the lease TTL) for `for_`.
    Partition {
        node: &'static str,
        at: Duration,
        for_: Duration,
    },
    /// Messages between the router and the node are held (delayed) for `for_`.
    Hold {
        node: &'static str,
        at: Duration,
        for_: Duration,
    },
    /// The node's lease is revoked (it runs and is reachable, but is no longer registered)
    /// for `for_`: the router must stop sending it new work.
    Revoke {
        node: &'static str,
        at: Duration,
        for_: Duration,
    },
    /// The prefill node cannot reach the decode node's KV link for `for_`.
    CutKv {
        prefill: &'static str,
        decode: &'static str,
        at: Duration,
        for_: Duration,
    },
}

impl Fault {
    fn window(&self) -> (Duration, Duration) {
        match *self {
            Fault::Crash { at, for_, .. }
            | Fault::Partition { at, for_, .. }
            | Fault::Hold { at, for_, .. }
            | Fault::Revoke { at, for_, .. }
            | Fault::CutKv { at, for_, .. } => (at, at + for_),
        }
    }
}

/// What one seed's run saw.
#[derive(Debug, Default)]
pub struct Report {
    /// The plan.
    pub faults: Vec<Fault>,
    /// Requests answered in full.
    pub ok: usize,
    /// Requests that ended with an error.
    pub failed: usize,
    /// Their errors.
    pub errors: Vec<String>,
    /// Router retries, re-prefills and migrations.
    pub recoveries: u64,
    /// Reservations freed by expiry rather than by the router or a stream.
    pub expired: u64,
    /// Invariant violations (empty: the seed passed).
    pub violations: Vec<String>,
}

/// One request's life as its client saw it.
#[derive(Debug, Default)]
struct Outcome {
    ids: Vec<u32>,
    finals: usize,
    events_after_end: usize,
    error: Option<(String, bool)>,
    hung: bool,
}

/// The suite's router settings with the simulation's shorter timeouts (and a fourth attempt).
fn options() -> RouterOptions {
    RouterOptions {
        max_attempts: 4,
        rpc_timeout: Duration::from_millis(500),
        connect_timeout: Duration::from_millis(300),
        stream_idle_timeout: Duration::from_secs(1),
        ..crate::common::options()
    }
}

fn plan(rng: &mut Rng) -> Vec<Fault> {
    let nodes: Vec<&'static str> = PREFILL.iter().chain(DECODE.iter()).copied().collect();
    let n = 1 + rng.below(3);
    (0..n)
        .map(|_| {
            let at = rng.ms(300, 3_500);
            let for_ = rng.ms(200, 3_000);
            match rng.below(5) {
                0 => Fault::Crash {
                    node: rng.pick(&nodes),
                    at,
                    for_,
                },
                1 => Fault::Partition {
                    node: rng.pick(&nodes),
                    at,
                    for_,
                },
                2 => Fault::Hold {
                    node: rng.pick(&nodes),
                    at,
                    for_,
                },
                3 => Fault::Revoke {
                    node: rng.pick(&nodes),
                    at,
                    for_,
                },
                _ => Fault::CutKv {
                    prefill: rng.pick(&PREFILL),
                    decode: rng.pick(&DECODE),
                    at,
                    for_,
                },
            }
        })
        .collect()
}

fn apply(sim: &mut turmoil::Sim<'_>, world: &World, fault: &Fault, start: bool) {
    match *fault {
        Fault::Crash { node, .. } if start => sim.crash(node),
        Fault::Crash { node, .. } => sim.bounce(node),
        Fault::Partition { node, .. } => {
            for other in PREFILL.iter().chain(DECODE.iter()).chain(&["router"]) {
                if *other != node {
                    if start {
                        sim.partition(node, *other);
                    } else {
                        sim.repair(node, *other);
                    }
                }
            }
            world
                .cut_off
                .lock()
                .unwrap()
                .insert(node.to_string(), start);
        }
        Fault::Hold { node, .. } if start => sim.hold("router", node),
        Fault::Hold { node, .. } => sim.release("router", node),
        Fault::Revoke { node, .. } => {
            world
                .revoked
                .lock()
                .unwrap()
                .insert(node.to_string(), start);
        }
        Fault::CutKv {
            prefill, decode, ..
        } if start => sim.partition(prefill, decode),
        Fault::CutKv {
            prefill, decode, ..
        } => sim.repair(prefill, decode),
    }
}

/// Runs one seed and checks the invariants.
pub fn run_seed(seed: u64, model: ServedModel) -> Report {
    let mut rng = Rng(seed);
    let faults = plan(&mut rng);
    let latency = rng.ms(2, 15);
    let workload: Vec<(Duration, usize, u32)> = (0..REQUESTS)
        .map(|i| {
            let start = Duration::from_millis(300 + 60 * i as u64);
            (start, 4 + rng.below(200), 8 + rng.below(40) as u32)
        })
        .collect();

    let world = Arc::new(World::default());
    let discovery = MemoryDiscovery::new("sim").expect("valid cluster name");
    let mut sim = turmoil::Builder::new()
        .rng_seed(seed)
        .simulation_duration(Duration::from_secs(180))
        .tick_duration(Duration::from_millis(1))
        .min_message_latency(Duration::from_millis(1))
        .max_message_latency(latency)
        .build();
    for name in PREFILL {
        let (world, discovery) = (Arc::clone(&world), discovery.clone());
        sim.host(name, move || {
            prefill::prefill_main(name.into(), Arc::clone(&world), discovery.clone())
        });
    }
    for name in DECODE {
        let (world, discovery) = (Arc::clone(&world), discovery.clone());
        sim.host(name, move || {
            nodes::decode_main(name.into(), Arc::clone(&world), discovery.clone())
        });
    }
    let outcomes: Arc<Mutex<Vec<Outcome>>> = Arc::default();
    let stats = Arc::new(Mutex::new(None));
    {
        let (world, outcomes, stats) = (
            Arc::clone(&world),
            Arc::clone(&outcomes),
            Arc::clone(&stats),
        );
        let discovery = discovery.clone();
        sim.client("router", async move {
            let router = Router::start_with_connector(
                model,
                options(),
                Arc::new(discovery),
                Arc::new(MemoryLoadSignals::new("sim")?),
                tandem_router::Stores::memory(),
                Arc::new(net::SimConnector),
            )
            .await?;
            let mut tasks = Vec::new();
            for (start, prompt_len, max_tokens) in workload {
                let router = router.clone();
                tasks.push(tokio::spawn(async move {
                    tokio::time::sleep_until(tokio::time::Instant::now() + start).await;
                    let request = GenerateRequest {
                        model: String::new(),
                        input: PromptInput::TokenIds(
                            (0..prompt_len as u32).map(|i| 1 + i % 500).collect(),
                        ),
                        sampling: Sampling {
                            max_tokens: Some(max_tokens),
                            ignore_eos: true,
                            ..Default::default()
                        },
                        priority: Default::default(),
                        request_id: None,
                    };
                    let run = async {
                        let mut out = Outcome::default();
                        let mut stream = match router.generate(request).await {
                            Ok(s) => s,
                            Err(e) => {
                                out.error = Some((
                                    e.to_string(),
                                    e.is_client_error() || e.kind() == "internal",
                                ));
                                return out;
                            }
                        };
                        while let Some(event) = stream.next().await {
                            if out.finals > 0 || out.error.is_some() {
                                out.events_after_end += 1;
                            }
                            match event {
                                Ok(GenerationEvent::Delta { token_ids, .. }) => {
                                    out.ids.extend(token_ids)
                                }
                                Ok(GenerationEvent::Final(_)) => out.finals += 1,
                                Err(e) => {
                                    let bad = e.is_client_error()
                                        || matches!(e.kind(), "internal" | "cancelled");
                                    out.error = Some((e.to_string(), bad));
                                }
                            }
                        }
                        out
                    };
                    match tokio::time::timeout(REQUEST_LIMIT, run).await {
                        Ok(out) => (prompt_len, max_tokens, out),
                        Err(_) => (
                            prompt_len,
                            max_tokens,
                            Outcome {
                                hung: true,
                                ..Default::default()
                            },
                        ),
                    }
                }));
            }
            for task in tasks {
                let (prompt_len, max_tokens, out) = task.await?;
                check_outcome(&world, prompt_len, max_tokens, &out);
                outcomes.lock().unwrap().push(out);
            }
            // Settle: every block back within a reservation TTL and a sweep.
            let deadline = tokio::time::Instant::now() + nodes::RESERVATION_TTL * 3;
            loop {
                let held: Vec<(&str, u32)> = DECODE
                    .iter()
                    .map(|n| (*n, world.held_blocks(n)))
                    .filter(|(_, b)| *b > 0)
                    .collect();
                if held.is_empty() {
                    break;
                }
                if tokio::time::Instant::now() > deadline {
                    world.violation(format!("KV blocks still held after the load: {held:?}"));
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            *stats.lock().unwrap() = Some(router.stats());
            Ok(())
        });
    }

    // The driver: one tick at a time, the plan applied as its moments come.
    let mut pending: Vec<(Duration, usize, bool)> = faults
        .iter()
        .enumerate()
        .flat_map(|(i, f)| {
            let (start, end) = f.window();
            [(start, i, true), (end, i, false)]
        })
        .collect();
    pending.sort_by_key(|&(t, i, start)| (t, !start, i));
    let mut next = 0;
    let result = loop {
        while next < pending.len() && sim.elapsed() >= pending[next].0 {
            let (_, i, start) = pending[next];
            apply(&mut sim, &world, &faults[i], start);
            next += 1;
        }
        match sim.step() {
            Ok(true) => break Ok(()),
            Ok(false) => {}
            Err(e) => break Err(e),
        }
    };
    if let Err(e) = result {
        world.violation(format!("the simulation failed: {e}"));
    }

    let outcomes = std::mem::take(&mut *outcomes.lock().unwrap());
    let stats = stats.lock().unwrap().take();
    let violations = std::mem::take(&mut *world.violations.lock().unwrap());
    Report {
        faults,
        ok: outcomes
            .iter()
            .filter(|o| o.finals == 1 && o.error.is_none())
            .count(),
        failed: outcomes.iter().filter(|o| o.error.is_some()).count(),
        errors: outcomes
            .iter()
            .filter_map(|o| o.error.as_ref().map(|e| e.0.clone()))
            .collect(),
        recoveries: stats.map_or(0, |s| s.retries + s.reprefills + s.migrations),
        expired: *world.expired.lock().unwrap(),
        violations,
    }
}

/// Invariants 1 and 2 for one request.
fn check_outcome(world: &World, prompt_len: usize, max_tokens: u32, out: &Outcome) {
    let expected: Vec<u32> = (0..max_tokens as usize)
        .map(|i| next_token(prompt_len + i))
        .collect();
    let what = format!("request (prompt {prompt_len}, {max_tokens} tokens)");
    if out.hung {
        world.violation(format!("{what} never ended"));
        return;
    }
    if out.events_after_end > 0 {
        world.violation(format!(
            "{what}: {} event(s) after its end",
            out.events_after_end
        ));
    }
    match (&out.error, out.finals) {
        (None, 1) if out.ids != expected => world.violation(format!(
            "{what} finished with {:?}, expected {expected:?} (a token repeated or skipped)",
            out.ids
        )),
        (None, 1) => {}
        (None, n) => world.violation(format!("{what} ended with {n} final messages and no error")),
        (Some(_), n) if n > 0 => {
            world.violation(format!("{what} had a final message and an error"))
        }
        (Some((e, true)), _) => world.violation(format!("{what} ended with an unclear error: {e}")),
        (Some(_), _) if !expected.starts_with(&out.ids) => world.violation(format!(
            "{what} failed after {:?}, which is not a prefix of {expected:?}",
            out.ids
        )),
        (Some(_), _) => {}
    }
}
