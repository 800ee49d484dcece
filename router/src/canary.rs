//! The canary: health that runs real inference. Every `interval` (and soon after membership
//! changes) the router sends a tiny greedy generation through prefill → KV transfer → decode for
//! each pair of nodes that accept work (a rotating window of at most `max_pairs` pairs when the
//! pools are large), with a timeout.
//!
//! ```text
//!  round: pairs = prefill × decode (accepting work), window of max_pairs, rotating
//!         each pair: Reserve on d, Prefill on p (KV pushed to d), Decode 2 tokens  ── timeout
//!         pair passing  ⇔  its last probe succeeded (after `failures_to_quarantine`
//!                          consecutive failures it is failing; one success restores it)
//!         a timeout while a node of the pair is busy with other work it is making progress
//!           on (fresh load reports) is inconclusive: not recorded (`result="inconclusive"`)
//!         node quarantined ⇔ every probed pair it is in is failing → leaves routing
//!  health: SERVING ⇔ at least one pair passes (HTTP /health 200, gRPC SERVING)
//! ```
//!
//! Probes bypass admission and are not counted as client requests (no TTFT samples, no request
//! counters); they have their own metrics (`tandem_router_canary_*`) and `router.canary` spans.
//! `GET /health?verbose=true` lists every pair: last success, latency, last error.

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::Serialize;

/// Canary settings (router flags `--canary-*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CanarySettings {
    /// Time between rounds; `None` disables the canary (health then counts registered nodes).
    pub interval: Option<Duration>,
    /// Bound on one probe.
    pub timeout: Duration,
    /// Pairs probed per round at most.
    pub max_pairs: usize,
    /// Consecutive failures after which a pair counts as failing.
    pub failures_to_quarantine: u32,
}

impl CanarySettings {
    /// No canary.
    pub fn disabled() -> Self {
        CanarySettings {
            interval: None,
            timeout: Duration::from_secs(10),
            max_pairs: 8,
            failures_to_quarantine: 2,
        }
    }
}

impl Default for CanarySettings {
    /// Every 10 s, 10 s timeout, 8 pairs a round, failing after 2 misses.
    fn default() -> Self {
        CanarySettings {
            interval: Some(Duration::from_secs(10)),
            ..CanarySettings::disabled()
        }
    }
}

/// One pair's canary record (`GET /health?verbose=true`).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PairHealth {
    /// Prefill node id.
    pub prefill: String,
    /// Decode node id.
    pub decode: String,
    /// Whether the pair counts as healthy.
    pub passing: bool,
    /// When a probe last succeeded, Unix ms.
    pub last_success_unix_ms: Option<u64>,
    /// That probe's latency, ms.
    pub last_latency_ms: Option<f64>,
    /// The last failure's kind and message (cleared by a success).
    pub last_error: Option<String>,
    /// Failures since the last success.
    pub consecutive_failures: u32,
    /// When the pair was last probed, Unix ms.
    pub checked_at_unix_ms: u64,
}

/// What the canary knows: every probed pair, and the round count.
#[derive(Clone, Debug, Default)]
pub struct CanaryState {
    pairs: BTreeMap<(String, String), PairHealth>,
    rounds: u64,
    probes_ok: u64,
    probes_failed: u64,
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

impl CanaryState {
    /// Records one probe of (`prefill`, `decode`).
    pub fn record(
        &mut self,
        prefill: &str,
        decode: &str,
        result: Result<Duration, String>,
        failures_to_quarantine: u32,
    ) {
        let now = unix_ms();
        let p = self
            .pairs
            .entry((prefill.to_string(), decode.to_string()))
            .or_insert_with(|| PairHealth {
                prefill: prefill.to_string(),
                decode: decode.to_string(),
                passing: false,
                last_success_unix_ms: None,
                last_latency_ms: None,
                last_error: None,
                consecutive_failures: 0,
                checked_at_unix_ms: now,
            });
        p.checked_at_unix_ms = now;
        match result {
            Ok(latency) => {
                self.probes_ok += 1;
                p.passing = true;
                p.consecutive_failures = 0;
                p.last_success_unix_ms = Some(now);
                p.last_latency_ms = Some(latency.as_secs_f64() * 1e3);
                p.last_error = None;
            }
            Err(e) => {
                self.probes_failed += 1;
                p.consecutive_failures += 1;
                p.last_error = Some(e);
                // A pair never seen passing fails at once; a known-good one gets some slack.
                if p.last_success_unix_ms.is_none()
                    || p.consecutive_failures >= failures_to_quarantine.max(1)
                {
                    p.passing = false;
                }
            }
        }
    }

    /// Forgets pairs whose nodes are gone.
    pub fn retain_nodes(&mut self, prefill: &HashSet<String>, decode: &HashSet<String>) {
        self.pairs
            .retain(|(p, d), _| prefill.contains(p) && decode.contains(d));
    }

    /// Every pair's record.
    pub fn pairs(&self) -> Vec<PairHealth> {
        self.pairs.values().cloned().collect()
    }

    /// Pairs known / passing.
    pub fn counts(&self) -> (usize, usize) {
        (
            self.pairs.len(),
            self.pairs.values().filter(|p| p.passing).count(),
        )
    }

    /// Probes that succeeded / failed since start.
    pub fn probe_counts(&self) -> (u64, u64) {
        (self.probes_ok, self.probes_failed)
    }

    /// Rounds run.
    pub fn rounds(&self) -> u64 {
        self.rounds
    }

    /// Nodes of each role whose every probed pair is failing: (prefill, decode).
    pub fn quarantined(&self) -> (HashSet<String>, HashSet<String>) {
        let mut seen_p: BTreeMap<&str, bool> = BTreeMap::new();
        let mut seen_d: BTreeMap<&str, bool> = BTreeMap::new();
        for p in self.pairs.values() {
            *seen_p.entry(&p.prefill).or_insert(false) |= p.passing;
            *seen_d.entry(&p.decode).or_insert(false) |= p.passing;
        }
        let bad = |m: BTreeMap<&str, bool>| {
            m.into_iter()
                .filter(|(_, ok)| !ok)
                .map(|(id, _)| id.to_string())
                .collect()
        };
        (bad(seen_p), bad(seen_d))
    }
}

/// The pairs of a round: `prefill × decode` in a stable order, a window of `max` of them
/// starting at `round × max` (so successive rounds cover every pair).
pub fn round_pairs(
    prefill: &[String],
    decode: &[String],
    round: u64,
    max: usize,
) -> Vec<(String, String)> {
    let all: Vec<(String, String)> = prefill
        .iter()
        .flat_map(|p| decode.iter().map(move |d| (p.clone(), d.clone())))
        .collect();
    if all.len() <= max || max == 0 {
        return all;
    }
    let start = (round as usize).wrapping_mul(max) % all.len();
    (0..max)
        .map(|i| all[(start + i) % all.len()].clone())
        .collect()
}

/// The nodes of one pool to keep out of routing, given those whose every probed pair fails and
/// those that accept work: when the canary would take out every node of a pool, it takes out
/// none (the second value says so). A canary that empties a pool turns a slow pool (probes
/// queued behind real work past their timeout) or a canary fault into a full outage; routing
/// to every node keeps serving what can be served, and client requests have their own
/// retries. Health stays NOT_SERVING while no pair passes.
pub fn quarantine_guard(
    failing: HashSet<String>,
    accepting: &[String],
) -> (HashSet<String>, bool) {
    let all = !accepting.is_empty() && accepting.iter().all(|id| failing.contains(id));
    if all { (HashSet::new(), true) } else { (failing, false) }
}

/// Whether a probe of a pair that timed out says nothing about the pair's health: a node of the
/// pair is busy with other work (more queued and running than the probe itself) and making
/// progress, and neither node looks stuck. A probe queued behind real work past its timeout is
/// not a failure; a node that stopped reporting (frozen, partitioned) or holds work without
/// computing (a hung engine) still fails it. Reports are the nodes' fresh load reports (`None`:
/// stale or absent).
pub fn timeout_is_inconclusive(
    prefill: Option<&tandem_cluster::LoadReport>,
    decode: Option<&tandem_cluster::LoadReport>,
) -> bool {
    let (Some(p), Some(d)) = (prefill, decode) else {
        return false;
    };
    let work = |r: &tandem_cluster::LoadReport| u64::from(r.queue_len) + u64::from(r.running);
    let progressing = |r: &tandem_cluster::LoadReport| r.tokens_per_s > 0.0;
    // Idle (nothing held) or computing: not stuck.
    let not_stuck = |r: &tandem_cluster::LoadReport| work(r) == 0 || progressing(r);
    let busy = |r: &tandem_cluster::LoadReport| work(r) > 1 && progressing(r);
    not_stuck(p) && not_stuck(d) && (busy(p) || busy(d))
}

/// Debounce for membership-triggered rounds.
pub const MEMBERSHIP_DEBOUNCE: Duration = Duration::from_millis(200);

impl CanaryState {
    /// Marks a round as run.
    pub fn round_done(&mut self) {
        self.rounds += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn rounds_rotate_through_every_pair_of_large_pools() {
        let (p, d) = (ids(&["p0", "p1", "p2"]), ids(&["d0", "d1", "d2"]));
        let mut seen = HashSet::new();
        for round in 0..3 {
            let pairs = round_pairs(&p, &d, round, 3);
            assert_eq!(pairs.len(), 3);
            seen.extend(pairs);
        }
        assert_eq!(seen.len(), 9, "three rounds of three cover all nine pairs");
        assert_eq!(round_pairs(&p[..1], &d[..2], 5, 8).len(), 2, "small pools: every pair");
    }

    #[test]
    fn a_known_good_pair_fails_after_the_threshold_and_one_success_restores_it() {
        let mut s = CanaryState::default();
        s.record("p0", "d0", Ok(Duration::from_millis(40)), 2);
        assert_eq!(s.counts(), (1, 1));
        s.record("p0", "d0", Err("unreachable: decode node".into()), 2);
        assert_eq!(s.counts(), (1, 1), "one miss is tolerated");
        s.record("p0", "d0", Err("unreachable: decode node".into()), 2);
        assert_eq!(s.counts(), (1, 0));
        assert_eq!(s.quarantined().1, HashSet::from(["d0".to_string()]));
        s.record("p0", "d0", Ok(Duration::from_millis(41)), 2);
        assert_eq!(s.counts(), (1, 1));
        assert!(s.quarantined().1.is_empty());
        assert_eq!(s.pairs()[0].last_error, None);
    }

    #[test]
    fn a_pool_is_never_emptied_by_the_canary() {
        let failing = HashSet::from(["d0".to_string(), "d1".to_string()]);
        let (q, all) = quarantine_guard(failing.clone(), &ids(&["d0", "d1"]));
        assert!(q.is_empty() && all, "every node failing: none taken out");
        let (q, all) = quarantine_guard(failing.clone(), &ids(&["d0", "d1", "d2"]));
        assert_eq!((q, all), (failing, false), "d2 still serves: the failing two leave");
        let (q, all) = quarantine_guard(HashSet::new(), &[]);
        assert!(q.is_empty() && !all);
    }

    #[test]
    fn a_node_is_quarantined_only_when_all_its_pairs_fail() {
        let mut s = CanaryState::default();
        // d1 is broken; p0 and p1 are fine.
        for p in ["p0", "p1"] {
            s.record(p, "d0", Ok(Duration::from_millis(30)), 2);
            s.record(p, "d1", Err("kv_corrupt".into()), 2);
        }
        let (qp, qd) = s.quarantined();
        assert!(qp.is_empty(), "{qp:?}");
        assert_eq!(qd, HashSet::from(["d1".to_string()]));
        // d1 leaves: its pairs are forgotten.
        s.retain_nodes(
            &HashSet::from(["p0".into(), "p1".into()]),
            &HashSet::from(["d0".into()]),
        );
        assert_eq!(s.counts(), (2, 2));
    }

    fn report(queue_len: u32, running: u32, tokens_per_s: f64) -> tandem_cluster::LoadReport {
        tandem_cluster::LoadReport {
            queue_len,
            running,
            tokens_per_s,
            ..tandem_cluster::LoadReport::idle("n", tandem_cluster::Role::Decode, 100)
        }
    }

    #[test]
    fn a_timeout_behind_real_work_is_inconclusive_but_a_stuck_or_silent_node_fails() {
        let idle = report(0, 0, 0.0);
        let busy = report(3, 8, 900.0);
        assert!(timeout_is_inconclusive(Some(&idle), Some(&busy)), "queued behind work");
        assert!(timeout_is_inconclusive(Some(&busy), Some(&idle)));
        // Only the probe itself there: the node had nothing else to do, the timeout is real.
        assert!(!timeout_is_inconclusive(Some(&idle), Some(&report(0, 1, 50.0))));
        // Holding work without computing: a hung engine.
        assert!(!timeout_is_inconclusive(Some(&report(2, 4, 0.0)), Some(&busy)));
        assert!(!timeout_is_inconclusive(Some(&report(2, 4, 0.0)), Some(&idle)));
        // No fresh report (frozen, partitioned): a failure.
        assert!(!timeout_is_inconclusive(None, Some(&busy)));
        assert!(!timeout_is_inconclusive(Some(&busy), None));
    }
}
