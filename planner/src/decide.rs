//! The planner's decision: a pure function of one observation, the configuration and what the
//! planner remembers (when each pool last changed, since when it has been quiet). The same
//! function runs in `tandem planner`, in `tandem sim` and in the table tests below: no second
//! copy of the policy (docs/ARCHITECTURE.md, "The planner").
//!
//! **Prefill** is sized by its backlog: the prompt tokens queued and not yet computed, over the
//! throughput of one node (configured, or the best the reports have shown). The pool should
//! clear its backlog within half the TTFT SLO (the other half is transfer, the first decode
//! step and queueing noise):
//! ```text
//!   needed = ceil(pending_tokens / (tokens_per_s_per_node × ttft_slo / 2))
//!   grow to min(needed, max) when needed > desired and the up-cooldown has passed;
//!   shrink by one when busy < prefill_util_low of the pool's throughput and one node fewer
//!   would still clear the backlog in time (needed < desired), continuously for the
//!   down-cooldown.
//! ```
//! **Decode** is sized by its occupancy: the larger of KV use (used over total blocks across
//! the pool) and batch use (running over the nodes' batch caps, where they report one), with
//! hysteresis: above `decode_kv_high` it grows to the size that would bring occupancy back to
//! the middle of the band; below `decode_kv_low` for the down-cooldown (and with the ITL under
//! half its SLO) it shrinks by one. The ITL a decode node gives each sequence is
//! `running / tokens_per_s` (one token per running sequence per step); a pool whose
//! token-weighted ITL is above `itl_p90_slo_ms` grows by one whatever its occupancy.
//!
//! Every decision carries its inputs and a reason in words; min and max always hold.

use std::time::{Duration, Instant};

use serde::Serialize;
use tandem_cluster::Role;

use crate::config::PlannerConfig;

/// One node's figures, from its latest fresh load report.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct NodeLoad {
    /// Requests waiting.
    pub queue_len: u32,
    /// Sequences running.
    pub running: u32,
    /// Prompt tokens queued and not computed.
    pub pending_prompt_tokens: u64,
    /// KV blocks free.
    pub free_blocks: u64,
    /// KV blocks in all.
    pub total_blocks: u64,
    /// Tokens computed per second, recent.
    pub tokens_per_s: f64,
    /// The node's batch cap (0: unknown).
    pub max_running: u32,
}

/// A pool as observed.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PoolObservation {
    /// The size the pool is asked to have now (the executor's desired count).
    pub desired: usize,
    /// Nodes serving now.
    pub serving: usize,
    /// Their loads (nodes without a fresh report are absent).
    pub nodes: Vec<NodeLoad>,
    /// The executor's bounds `(min, max)`, when it has set any: the planner's own bounds are
    /// narrowed to them.
    pub bounds: Option<(usize, usize)>,
}

impl PoolObservation {
    /// `limits` narrowed to the executor's bounds (an empty intersection keeps the
    /// executor's: it refuses anything else).
    fn effective(&self, limits: crate::config::PoolLimits) -> crate::config::PoolLimits {
        let Some((lo, hi)) = self.bounds else { return limits };
        let (min, max) = (limits.min.max(lo), limits.max.min(hi));
        let (min, max) = if min > max { (lo, hi) } else { (min, max) };
        crate::config::PoolLimits { min, max, ..limits }
    }
}

/// Both pools at one instant.
#[derive(Clone, Debug, PartialEq)]
pub struct Observation {
    /// When it was taken.
    pub at: Instant,
    /// The prefill pool.
    pub prefill: PoolObservation,
    /// The decode pool.
    pub decode: PoolObservation,
}

/// What the planner remembers between rounds.
#[derive(Clone, Debug, Default)]
pub struct PlannerMemory {
    last_change: [Option<Instant>; 2],
    quiet_since: [Option<Instant>; 2],
    /// The best prefill throughput per node seen in reports, tokens/s.
    pub best_prefill_tokens_per_s: f64,
}

impl PlannerMemory {
    /// What a new leadership term keeps: the measured throughput, not the cooldowns.
    pub fn new_term(&self) -> PlannerMemory {
        PlannerMemory {
            best_prefill_tokens_per_s: self.best_prefill_tokens_per_s,
            ..PlannerMemory::default()
        }
    }
}

fn idx(pool: Role) -> usize {
    match pool {
        Role::Prefill => 0,
        Role::Decode => 1,
    }
}

/// A change of one pool's size, with why.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Decision {
    /// `prefill` or `decode`.
    pub pool: &'static str,
    /// The desired size before.
    pub from: usize,
    /// The desired size after.
    pub to: usize,
    /// Why, in words (with the figures).
    pub reason: String,
    /// The figures it was decided on.
    pub inputs: DecisionInputs,
}

/// The figures behind a decision (logged and published with it).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DecisionInputs {
    /// Nodes serving.
    pub serving: usize,
    /// Prefill: prompt tokens pending; decode: KV blocks used.
    pub demand: f64,
    /// Prefill: tokens/s per node assumed; decode: KV blocks in the pool.
    pub capacity: f64,
    /// Prefill: busy fraction; decode: occupancy (the larger of KV and batch use).
    pub utilisation: f64,
}

/// The floor for a measured prefill throughput (a pool that has not worked yet).
pub const MIN_PREFILL_TOKENS_PER_S: f64 = 100.0;

/// Decides both pools (see the module docs). `memory` is updated with what was decided.
pub fn decide(obs: &Observation, cfg: &PlannerConfig, memory: &mut PlannerMemory) -> Vec<Decision> {
    let mut out = Vec::new();
    if let Some(d) = decide_prefill(obs, cfg, memory) {
        out.push(d);
    }
    if let Some(d) = decide_decode(obs, cfg, memory) {
        out.push(d);
    }
    for d in &out {
        let i = if d.pool == "prefill" { 0 } else { 1 };
        memory.last_change[i] = Some(obs.at);
        memory.quiet_since[i] = None;
    }
    out
}

fn cooled(memory: &PlannerMemory, pool: Role, at: Instant, secs: u64) -> bool {
    memory.last_change[idx(pool)].is_none_or(|t| at.duration_since(t) >= Duration::from_secs(secs))
}

/// Tracks how long `pool` has been quiet; true once it has been for `secs`.
fn quiet_for(memory: &mut PlannerMemory, pool: Role, at: Instant, quiet: bool, secs: u64) -> bool {
    let slot = &mut memory.quiet_since[idx(pool)];
    if !quiet {
        *slot = None;
        return false;
    }
    let since = *slot.get_or_insert(at);
    at.duration_since(since) >= Duration::from_secs(secs)
}

fn decide_prefill(obs: &Observation, cfg: &PlannerConfig, memory: &mut PlannerMemory) -> Option<Decision> {
    let pool = &obs.prefill;
    let limits = pool.effective(cfg.prefill);
    let best = pool.nodes.iter().map(|n| n.tokens_per_s).fold(0.0, f64::max);
    memory.best_prefill_tokens_per_s = memory.best_prefill_tokens_per_s.max(best);
    // No throughput configured and none measured yet (the pool has not worked): no basis to
    // size it by its backlog; wait for the first reports of work.
    let measured = cfg.prefill_tokens_per_s > 0.0 || memory.best_prefill_tokens_per_s > 0.0;
    let per_node = if cfg.prefill_tokens_per_s > 0.0 {
        cfg.prefill_tokens_per_s
    } else {
        memory.best_prefill_tokens_per_s.max(MIN_PREFILL_TOKENS_PER_S)
    };
    let pending: u64 = pool.nodes.iter().map(|n| n.pending_prompt_tokens).sum();
    let busy: f64 = pool.nodes.iter().map(|n| n.tokens_per_s).sum();
    let size = pool.desired.max(1);
    let utilisation = busy / (per_node * size as f64);
    let inputs = DecisionInputs {
        serving: pool.serving,
        demand: pending as f64,
        capacity: per_node,
        utilisation,
    };
    let window = cfg.ttft_p90_slo_ms as f64 / 1000.0 / 2.0;
    let needed = (pending as f64 / (per_node * window)).ceil() as usize;
    let target = needed.clamp(limits.min, limits.max);
    if measured && target > pool.desired && cooled(memory, Role::Prefill, obs.at, limits.scale_up_cooldown_secs) {
        return Some(Decision {
            pool: "prefill",
            from: pool.desired,
            to: target,
            reason: format!(
                "{pending} prompt tokens pending; at {per_node:.0} tok/s per node they need {needed} node(s) to clear within {window:.1} s (half the {} ms TTFT SLO)",
                cfg.ttft_p90_slo_ms
            ),
            inputs,
        });
    }
    if pool.desired < limits.min {
        return Some(Decision {
            pool: "prefill",
            from: pool.desired,
            to: limits.min,
            reason: format!("below the minimum of {}", limits.min),
            inputs,
        });
    }
    // Quiet: one node fewer would still clear the backlog in time, and the pool is mostly idle.
    let quiet = needed < pool.desired && utilisation < cfg.prefill_util_low && pool.desired > limits.min;
    if quiet_for(memory, Role::Prefill, obs.at, quiet, limits.scale_down_cooldown_secs)
        && cooled(memory, Role::Prefill, obs.at, limits.scale_down_cooldown_secs)
    {
        return Some(Decision {
            pool: "prefill",
            from: pool.desired,
            to: pool.desired - 1,
            reason: format!(
                "{pending} prompt tokens pending (one node fewer clears them in time) and {:.0}% busy (< {:.0}%) for {} s",
                utilisation * 100.0,
                cfg.prefill_util_low * 100.0,
                limits.scale_down_cooldown_secs
            ),
            inputs,
        });
    }
    None
}

fn decide_decode(obs: &Observation, cfg: &PlannerConfig, memory: &mut PlannerMemory) -> Option<Decision> {
    let pool = &obs.decode;
    let limits = pool.effective(cfg.decode);
    let total: u64 = pool.nodes.iter().map(|n| n.total_blocks).sum();
    let free: u64 = pool.nodes.iter().map(|n| n.free_blocks).sum();
    let used = total.saturating_sub(free);
    let kv_use = if total == 0 { 0.0 } else { used as f64 / total as f64 };
    let running: u64 = pool.nodes.iter().map(|n| n.running as u64).sum();
    let cap: u64 = pool.nodes.iter().map(|n| n.max_running as u64).sum();
    let batch_use = if cap == 0 || pool.nodes.iter().any(|n| n.max_running == 0) {
        0.0
    } else {
        running as f64 / cap as f64
    };
    let occupancy = kv_use.max(batch_use);
    let tokens_per_s: f64 = pool.nodes.iter().map(|n| n.tokens_per_s).sum();
    // Token-weighted ITL: Σ running / Σ tokens/s (each running sequence gets one token a step).
    let itl_ms = if tokens_per_s > 0.0 && running > 0 {
        running as f64 / tokens_per_s * 1000.0
    } else {
        0.0
    };
    let inputs = DecisionInputs {
        serving: pool.serving,
        demand: used as f64,
        capacity: total as f64,
        utilisation: occupancy,
    };
    if pool.desired < limits.min {
        return Some(Decision {
            pool: "decode",
            from: pool.desired,
            to: limits.min,
            reason: format!("below the minimum of {}", limits.min),
            inputs,
        });
    }
    let slow = itl_ms > cfg.itl_p90_slo_ms as f64;
    if (occupancy > cfg.decode_kv_high || slow)
        && pool.desired < limits.max
        && cooled(memory, Role::Decode, obs.at, limits.scale_up_cooldown_secs)
    {
        // Grow to where occupancy would sit mid-band with the same demand.
        let mid = (cfg.decode_kv_high + cfg.decode_kv_low) / 2.0;
        let n = pool.nodes.len().max(1) as f64;
        let want = (occupancy * n / mid).ceil() as usize;
        let to = want.clamp(pool.desired + 1, limits.max);
        let why = if occupancy > cfg.decode_kv_high {
            format!(
                "occupancy {:.0}% (KV {:.0}%, batch {:.0}%) above {:.0}%: {to} node(s) bring it to about {:.0}%",
                occupancy * 100.0,
                kv_use * 100.0,
                batch_use * 100.0,
                cfg.decode_kv_high * 100.0,
                mid * 100.0
            )
        } else {
            format!("ITL {itl_ms:.1} ms above the {} ms SLO", cfg.itl_p90_slo_ms)
        };
        return Some(Decision { pool: "decode", from: pool.desired, to, reason: why, inputs });
    }
    let quiet = occupancy < cfg.decode_kv_low
        && itl_ms < cfg.itl_p90_slo_ms as f64 / 2.0
        && pool.desired > limits.min;
    if quiet_for(memory, Role::Decode, obs.at, quiet, limits.scale_down_cooldown_secs)
        && cooled(memory, Role::Decode, obs.at, limits.scale_down_cooldown_secs)
    {
        return Some(Decision {
            pool: "decode",
            from: pool.desired,
            to: pool.desired - 1,
            reason: format!(
                "occupancy {:.0}% below {:.0}% and ITL {itl_ms:.1} ms for {} s",
                occupancy * 100.0,
                cfg.decode_kv_low * 100.0,
                limits.scale_down_cooldown_secs
            ),
            inputs,
        });
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prefill(desired: usize, pending: &[u64], tps: f64) -> PoolObservation {
        PoolObservation {
            desired,
            serving: desired,
            nodes: pending
                .iter()
                .map(|&p| NodeLoad {
                    pending_prompt_tokens: p,
                    tokens_per_s: tps,
                    ..Default::default()
                })
                .collect(),
            bounds: None,
        }
    }

    fn decode(desired: usize, used_of_100: &[u64]) -> PoolObservation {
        PoolObservation {
            desired,
            serving: desired,
            nodes: used_of_100
                .iter()
                .map(|&u| NodeLoad {
                    free_blocks: 100 - u,
                    total_blocks: 100,
                    ..Default::default()
                })
                .collect(),
            bounds: None,
        }
    }

    fn cfg() -> PlannerConfig {
        PlannerConfig {
            prefill_tokens_per_s: 1000.0,
            ttft_p90_slo_ms: 2000,
            ..PlannerConfig::default()
        }
    }

    /// (case, prefill obs, decode obs, expected (pool, from, to) changes)
    type Case = (&'static str, PoolObservation, PoolObservation, Vec<(&'static str, usize, usize)>);

    #[test]
    fn table_of_single_rounds() {
        let t = Instant::now();
        let cases: Vec<Case> = vec![
            ("idle at min: nothing", prefill(1, &[0], 0.0), decode(1, &[10]), vec![]),
            (
                "3,000 pending tokens at 1,000 tok/s and a 1 s window: 3 prefill nodes",
                prefill(1, &[3000], 900.0),
                decode(1, &[50]),
                vec![("prefill", 1, 3)],
            ),
            (
                "a huge backlog is capped at max",
                prefill(2, &[50_000, 50_000], 1000.0),
                decode(1, &[50]),
                vec![("prefill", 2, 4)],
            ),
            (
                "backlog the pool clears in time: nothing",
                prefill(2, &[900, 900], 1000.0),
                decode(2, &[50, 50]),
                vec![],
            ),
            (
                "decode KV at 90% of 2 nodes: grows to bring use mid-band",
                prefill(1, &[0], 0.0),
                decode(2, &[90, 90]),
                vec![("decode", 2, 4)],
            ),
            (
                "decode at 80%: inside the band, nothing",
                prefill(1, &[0], 0.0),
                decode(2, &[80, 80]),
                vec![],
            ),
            (
                "decode at max stays at max",
                prefill(1, &[0], 0.0),
                decode(4, &[99, 99, 99, 99]),
                vec![],
            ),
            (
                "decode at its batch cap grows though its KV is nearly empty",
                prefill(1, &[0], 0.0),
                PoolObservation {
                    nodes: vec![
                        NodeLoad { running: 64, max_running: 64, free_blocks: 90, total_blocks: 100, tokens_per_s: 6400.0, ..Default::default() };
                        2
                    ],
                    ..decode(2, &[])
                },
                vec![("decode", 2, 4)],
            ),
            (
                "decode whose ITL (32 running at 200 tok/s: 160 ms) is above the 100 ms SLO grows",
                prefill(1, &[0], 0.0),
                PoolObservation {
                    nodes: vec![NodeLoad { running: 32, max_running: 256, free_blocks: 50, total_blocks: 100, tokens_per_s: 200.0, ..Default::default() }],
                    ..decode(1, &[])
                },
                vec![("decode", 1, 2)],
            ),
            (
                "the executor's max (2) narrows the planner's (4)",
                PoolObservation {
                    bounds: Some((1, 2)),
                    ..prefill(1, &[50_000], 1000.0)
                },
                decode(1, &[50]),
                vec![("prefill", 1, 2)],
            ),
            (
                "a pool below min is raised to it",
                prefill(0, &[], 0.0),
                decode(0, &[]),
                vec![("prefill", 0, 1), ("decode", 0, 1)],
            ),
        ];
        for (name, p, d, want) in cases {
            let mut m = PlannerMemory::default();
            let got: Vec<_> = decide(
                &Observation {
                    at: t,
                    prefill: p,
                    decode: d,
                },
                &cfg(),
                &mut m,
            )
            .into_iter()
            .map(|d| (d.pool, d.from, d.to))
            .collect();
            assert_eq!(got, want, "{name}");
        }
    }

    #[test]
    fn cooldowns_and_quiet_windows_give_hysteresis() {
        let c = PlannerConfig {
            prefill: crate::config::PoolLimits {
                min: 1,
                max: 4,
                scale_up_cooldown_secs: 10,
                scale_down_cooldown_secs: 30,
            },
            ..cfg()
        };
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut m = PlannerMemory::default();
        let obs = |s: u64, p: PoolObservation| Observation {
            at: at(s),
            prefill: p,
            decode: decode(1, &[50]),
        };
        // A burst: up to 2.
        let d = decide(&obs(0, prefill(1, &[2000], 1000.0)), &c, &mut m);
        assert_eq!(d[0].to, 2);
        // More pending 5 s later: still cooling down, nothing.
        assert!(decide(&obs(5, prefill(2, &[4000, 4000], 1000.0)), &c, &mut m).is_empty());
        // After the up-cooldown: up to 4 (8,000 tokens need 8 nodes; max 4).
        let d = decide(&obs(11, prefill(2, &[4000, 4000], 1000.0)), &c, &mut m);
        assert_eq!((d[0].from, d[0].to), (2, 4));
        // Quiet from 20 s: no scale-down before 30 s of quiet *and* 30 s since the change.
        for s in [20, 30, 40] {
            assert!(
                decide(&obs(s, prefill(4, &[0, 0, 0, 0], 10.0)), &c, &mut m).is_empty(),
                "at {s} s"
            );
        }
        // A backlog the pool needs all its nodes for resets the quiet window.
        assert!(decide(&obs(45, prefill(4, &[3500, 0, 0, 0], 10.0)), &c, &mut m).is_empty());
        assert!(decide(&obs(60, prefill(4, &[0, 0, 0, 0], 10.0)), &c, &mut m).is_empty());
        let d = decide(&obs(91, prefill(4, &[0, 0, 0, 0], 10.0)), &c, &mut m);
        assert_eq!((d[0].pool, d[0].from, d[0].to), ("prefill", 4, 3));
        assert!(d[0].reason.contains("one node fewer clears them"), "{}", d[0].reason);
        // Never below min.
        let mut m = PlannerMemory::default();
        for s in (0..200).step_by(10) {
            let d = decide(&obs(s, prefill(1, &[0], 0.0)), &c, &mut m);
            assert!(d.is_empty(), "went below min: {d:?}");
        }
    }

    #[test]
    fn measured_throughput_is_used_when_none_is_configured() {
        let c = PlannerConfig {
            prefill_tokens_per_s: 0.0,
            ..cfg()
        };
        let mut m = PlannerMemory::default();
        // Reports show 2,000 tok/s per node; 6,000 pending need 3 nodes in a 1 s window.
        let d = decide(
            &Observation {
                at: Instant::now(),
                prefill: prefill(1, &[6000], 2000.0),
                decode: decode(1, &[50]),
            },
            &c,
            &mut m,
        );
        assert_eq!(d[0].to, 3);
        assert_eq!(d[0].inputs.capacity, 2000.0);
        // Before any report of work there is no throughput to size by: a backlog alone does
        // not grow the pool.
        let mut m = PlannerMemory::default();
        let d = decide(
            &Observation {
                at: Instant::now(),
                prefill: prefill(1, &[6000], 0.0),
                decode: decode(1, &[50]),
            },
            &c,
            &mut m,
        );
        assert!(d.is_empty(), "{d:?}");
    }
}
