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
//!    is not a client error, a cancel or an internal one; none is left hanging (a request its
//!    client cancels only has to stop);
//! 2. a stream (migrated or not) never repeats or skips a token: a finished one is exactly the
//!    fake model's output, a failed or cancelled one a prefix of it;
//! 3. the router keeps its reservations' books (judged from the decode nodes' [`nodes::Ledger`],
//!    not from their expiry sweep): every reservation the router made is handed on (claimed by a
//!    Decode stream that streams every token) or released by the router, exactly once; a
//!    Release that never arrived is forgiven only where the router lost contact with that decode
//!    node (it crashed, was partitioned or its link held) during the reservation's life, or
//!    within the keep-alive's reach after (a connection a fault broke stays stuck until the
//!    router's keep-alive drops it); a grant the router never saw (never prefilled, claimed or
//!    released) is forgiven only while the router counts at least as many Reserve calls that
//!    went unanswered; a reservation that expired is forgiven only where a fault hit its decode
//!    or prefill node while it lived; a seed with no fault lets none expire, and at most 2 % of
//!    all reservations may; the Releases the nodes received equal those the router counts as
//!    sent wherever no decode node lost contact; and once the load and the last fault end,
//!    every block is free within one reservation TTL;
//! 4. nothing is routed to a node without a live registration (beyond calls already in flight).
//!
//! Faults compose: two partitions (or holds, revocations, crashes) of the same node that
//! overlap keep it cut until the last one ends. A quarter of the seeds draw no fault at all, and
//! every seed's workload has clients that cancel mid-request (which the router must release).
//!
//! Mutation checks (run by hand, 2026-12-07, 200 seeds; put back afterwards): a router whose
//! `Reservation` never sends Release (`router/src/pipeline/reservation.rs`, `Drop` returning at
//! once) fails 199 of the 200 seeds; one that sends each Release twice fails all 200. The check
//! also found two real leaks, fixed with it: a client that cancelled while its Reserve call was in
//! flight lost the grant (the blocks stayed reserved until the TTL), and a prefill node that went
//! silent held its request's reservation with no bound (now: the reservation's own expiry).
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

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use tandem_cluster::{MemoryDiscovery, MemoryLoadSignals};
use tandem_router::{
    GenerateRequest, GenerationEvent, PromptInput, Router, RouterOptions, Sampling, ServedModel,
};

use crate::common::Rng;
use nodes::{Freed, World, next_token};

/// Prefill and decode hosts.
pub const PREFILL: [&str; 2] = ["prefill-0", "prefill-1"];
/// See [`PREFILL`].
pub const DECODE: [&str; 3] = ["decode-0", "decode-1", "decode-2"];
/// Requests per seed.
const REQUESTS: usize = 48;
/// A request still open this long after it started is hanging (a violation).
const REQUEST_LIMIT: Duration = Duration::from_secs(60);

/// How long a connection a fault broke may stay stuck after the fault: the router's keep-alive
/// interval and timeout.
const LINK_RECOVERY: Duration = Duration::from_secs(
    tandem_router::nodes::KEEPALIVE_INTERVAL.as_secs() + tandem_router::nodes::KEEPALIVE_TIMEOUT.as_secs(),
);

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

    /// Whether the fault, or its aftermath, meets `[from, to]`. A link the fault broke can stay
    /// broken after it heals (messages it dropped leave the connection stuck) until the
    /// router's HTTP/2 keep-alive finds it dead and reconnects.
    fn overlaps(&self, from: Duration, to: Duration) -> bool {
        let (start, end) = self.window();
        start <= to && from <= end + LINK_RECOVERY
    }

    /// Whether the fault hits `node` in any way.
    fn touches(&self, node: &str) -> bool {
        match *self {
            Fault::Crash { node: n, .. }
            | Fault::Partition { node: n, .. }
            | Fault::Hold { node: n, .. }
            | Fault::Revoke { node: n, .. } => n == node,
            Fault::CutKv {
                prefill, decode, ..
            } => prefill == node || decode == node,
        }
    }

    /// Whether the fault cuts the router off from `node` (a Release sent then can be lost).
    fn cuts_router_from(&self, node: &str) -> bool {
        match *self {
            Fault::Crash { node: n, .. }
            | Fault::Partition { node: n, .. }
            | Fault::Hold { node: n, .. } => n == node,
            Fault::Revoke { .. } | Fault::CutKv { .. } => false,
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
    /// Reservations the decode nodes granted.
    pub reservations: u64,
    /// Releases the router counts as sent, and those the decode nodes received.
    pub releases_sent: u64,
    /// See [`Report::releases_sent`].
    pub releases_received: u64,
    /// Requests their client cancelled before the end.
    pub cancelled: usize,
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
    cancelled: bool,
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
    // A quarter of the seeds run without a fault: the router's books must then be exact.
    let n = rng.below(4);
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

/// How many active faults hold each node or link, so that overlapping faults compose: the
/// network is repaired, a hold released, a node restarted only when the last fault on it ends.
#[derive(Default)]
struct Depths {
    crashed: HashMap<&'static str, u32>,
    /// Partitions by link (the two hosts in name order).
    cut: HashMap<(&'static str, &'static str), u32>,
    /// Holds of the router's link to a node.
    held: HashMap<&'static str, u32>,
}

/// One fault on `key` begins (`start`) or ends; `true` when the first begins or the last ends.
fn step_depth<K: Eq + std::hash::Hash>(map: &mut HashMap<K, u32>, key: K, start: bool) -> bool {
    let depth = map.entry(key).or_default();
    if start {
        *depth += 1;
        *depth == 1
    } else {
        *depth -= 1;
        *depth == 0
    }
}

fn link(a: &'static str, b: &'static str) -> (&'static str, &'static str) {
    if a < b { (a, b) } else { (b, a) }
}

fn cut(sim: &mut turmoil::Sim<'_>, depths: &mut Depths, a: &'static str, b: &'static str, start: bool) {
    if step_depth(&mut depths.cut, link(a, b), start) {
        if start {
            sim.partition(a, b);
        } else {
            sim.repair(a, b);
        }
    }
}

fn apply(sim: &mut turmoil::Sim<'_>, world: &World, depths: &mut Depths, fault: &Fault, start: bool) {
    match *fault {
        Fault::Crash { node, .. } => {
            if step_depth(&mut depths.crashed, node, start) {
                if start {
                    world.crash(node, sim.elapsed());
                    sim.crash(node);
                } else {
                    sim.bounce(node);
                }
            }
        }
        Fault::Partition { node, .. } => {
            for other in PREFILL.iter().chain(DECODE.iter()).chain(&["router"]) {
                if *other != node {
                    cut(sim, depths, node, other, start);
                }
            }
            step_depth(&mut world.cut_off.lock().unwrap(), node.to_string(), start);
        }
        Fault::Hold { node, .. } => {
            if step_depth(&mut depths.held, node, start) {
                if start {
                    sim.hold("router", node);
                } else {
                    sim.release("router", node);
                }
            }
        }
        Fault::Revoke { node, .. } => {
            step_depth(&mut world.revoked.lock().unwrap(), node.to_string(), start);
        }
        Fault::CutKv {
            prefill, decode, ..
        } => cut(sim, depths, prefill, decode, start),
    }
}

/// Runs one seed and checks the invariants.
pub fn run_seed(seed: u64, model: ServedModel) -> Report {
    let mut rng = Rng(seed);
    let faults = plan(&mut rng);
    let latency = rng.ms(2, 15);
    // (start, prompt tokens, max tokens, cancelled by its client after)
    let workload: Vec<(Duration, usize, u32, Option<Duration>)> = (0..REQUESTS)
        .map(|i| {
            let start = Duration::from_millis(300 + 60 * i as u64);
            let (prompt, max_tokens) = (4 + rng.below(200), 8 + rng.below(40) as u32);
            let cancel = (rng.below(8) == 0).then(|| rng.ms(1, 150));
            (start, prompt, max_tokens, cancel)
        })
        .collect();
    // Messages a fault held are delivered when it ends (a Reserve among them): the books can
    // only close a TTL after the last fault, if that is after the load.
    let faults_end = faults.iter().map(|f| f.window().1).max().unwrap_or_default();
    // A Release can be lost only on the way to a decode node the router is cut off from.
    let releases_can_be_lost = faults
        .iter()
        .any(|f| DECODE.iter().any(|d| f.cuts_router_from(d)));

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
            for (start, prompt_len, max_tokens, cancel) in workload {
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
                    let mut out = Outcome::default();
                    let run = async {
                        let out = &mut out;
                        let mut stream = match router.generate(request).await {
                            Ok(s) => s,
                            Err(e) => {
                                out.error = Some((
                                    e.to_string(),
                                    e.is_client_error() || e.kind() == "internal",
                                ));
                                return;
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
                    };
                    // A cancelling client drops the request (and its stream) at its moment.
                    if tokio::time::timeout(cancel.unwrap_or(REQUEST_LIMIT), run)
                        .await
                        .is_err()
                    {
                        if cancel.is_some() {
                            out.cancelled = true;
                        } else {
                            out.hung = true;
                        }
                    }
                    (prompt_len, max_tokens, out)
                }));
            }
            for task in tasks {
                let (prompt_len, max_tokens, out) = task.await?;
                check_outcome(&world, prompt_len, max_tokens, &out);
                outcomes.lock().unwrap().push(out);
            }
            // Settle: the longest a block may legitimately stay held after the load (and the
            // last fault) is an unclaimed reservation's TTL (plus the sweep and the network's
            // latency); the Releases still on their way arrive within that too.
            let deadline = tokio::time::Instant::now()
                + faults_end.saturating_sub(nodes::now())
                + nodes::RESERVATION_TTL
                + nodes::SWEEP * 2
                + Duration::from_millis(100);
            loop {
                let held: Vec<(&str, u32)> = DECODE
                    .iter()
                    .map(|n| (*n, world.held_blocks(n)))
                    .filter(|(_, b)| *b > 0)
                    .collect();
                let (sent, received) = (router.stats().releases, world.releases_received());
                let books_open = sent != received && !releases_can_be_lost;
                if held.is_empty() && !books_open {
                    break;
                }
                if tokio::time::Instant::now() > deadline {
                    if !held.is_empty() {
                        world.violation(format!(
                            "KV blocks still held a reservation TTL after the load: {held:?}"
                        ));
                    }
                    if books_open {
                        world.violation(format!(
                            "the router counts {sent} Releases sent, the decode nodes received {received}, and none was cut off from it"
                        ));
                    }
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
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
    let mut depths = Depths::default();
    let result = loop {
        while next < pending.len() && sim.elapsed() >= pending[next].0 {
            let (_, i, start) = pending[next];
            apply(&mut sim, &world, &mut depths, &faults[i], start);
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
    check_books(
        &world,
        &faults,
        stats.as_ref().map_or(0, |s| s.reserve_unanswered),
    );
    let violations = std::mem::take(&mut *world.violations.lock().unwrap());
    let reservations = world.ledger.lock().unwrap().len() as u64;
    Report {
        reservations,
        releases_sent: stats.as_ref().map_or(0, |s| s.releases),
        releases_received: world.releases_received(),
        cancelled: outcomes.iter().filter(|o| o.cancelled).count(),
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

/// How long after a decode node freed a reservation the router may still be sending its
/// Release (it gives up on a stream after its idle timeout, on an RPC after its timeout).
const RELEASE_SLACK: Duration = Duration::from_secs(3);

/// Invariant 3: the router's books, reservation by reservation, from the decode nodes' ledger
/// (after the simulation: the violations name the reservations' own times).
fn check_books(world: &World, faults: &[Fault], reserve_unanswered: u64) {
    let ledger = world.ledger.lock().unwrap().clone();
    let violation = |what: String| world.violations.lock().unwrap().push(what);
    let mut expired = 0;
    // Grants the router never saw (its Reserve call got no answer), as the nodes found them.
    let mut unseen_grants = Vec::new();
    for ((node, epoch, id), life) in &ledger {
        let what = format!(
            "{node} reservation {id} (boot {epoch}, granted at {:?})",
            life.created
        );
        if life.releases.len() > 1 {
            violation(format!(
                "{what}: released {} times (at {:?}); the router releases a reservation once",
                life.releases.len(),
                life.releases
            ));
        }
        let freed_at = life.freed.map(|(at, _)| at);
        let finished = matches!(life.freed, Some((_, Freed::Finished)));
        if !finished && life.releases.is_empty() {
            let until = freed_at.unwrap_or(Duration::MAX - RELEASE_SLACK) + RELEASE_SLACK;
            let excuse = faults
                .iter()
                .any(|f| f.cuts_router_from(node) && f.overlaps(life.created, until));
            // Never prefilled, claimed or released: the grant may not have reached the router
            // (a connection a fault broke can stay broken after it heals). The router counts
            // every Reserve that went unanswered; these must not outnumber them.
            let unseen = life.prefills.is_empty() && life.claimed.is_none();
            if !excuse && unseen {
                unseen_grants.push(what.clone());
            } else if !excuse {
                violation(format!(
                    "{what}: neither streamed to its end nor released ({:?}, claimed {:?}), and the router was never cut off from {node}",
                    life.freed, life.claimed
                ));
            }
        }
        if matches!(life.freed, Some((_, Freed::Expired))) {
            expired += 1;
            // A fault on its decode node or its prefill node while it lived; a Prefill that
            // never arrived may have gone to any prefill node.
            let prefill_node = |n: &str| match life.prefills.is_empty() {
                true => PREFILL.contains(&n),
                false => life.prefills.iter().any(|p| p == n),
            };
            let excuse = faults.iter().any(|f| {
                (f.touches(node) || PREFILL.iter().any(|p| prefill_node(p) && f.touches(p)))
                    && f.overlaps(life.created, life.expires)
            });
            let unseen = life.prefills.is_empty() && life.claimed.is_none() && life.releases.is_empty();
            let excuse = excuse || (unseen && reserve_unanswered > 0);
            if !excuse {
                violation(format!(
                    "{what}: expired unclaimed and unreleased (prefilled by {:?}), with no fault on its nodes while it lived",
                    life.prefills
                ));
            }
        }
    }
    if unseen_grants.len() as u64 > reserve_unanswered {
        violation(format!(
            "{} grants were never prefilled, claimed or released, but the router counts only {reserve_unanswered} Reserve calls unanswered: {unseen_grants:?}",
            unseen_grants.len()
        ));
    }
    if faults.is_empty() && expired > 0 {
        violation(format!(
            "{expired} reservation(s) expired in a seed without faults"
        ));
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
    if out.cancelled {
        if !expected.starts_with(&out.ids) {
            world.violation(format!(
                "{what} was cancelled after {:?}, which is not a prefix of {expected:?}",
                out.ids
            ));
        }
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
