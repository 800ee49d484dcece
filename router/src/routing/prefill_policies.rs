//! The prefill policies an operator chooses between (`--prefill-policy`):
//!
//! - [`PrefixAwarePolicy`] (default): the node where the prompt costs least, counting in
//!   prompt tokens still to compute: the part of the prompt the node's prefix cache does not
//!   hold, plus the prompt tokens already waiting or running there. Within a pool (one model,
//!   one node type) a token costs the same time on every node, so ranking by tokens ranks by
//!   seconds. Reuse pulls prompts of one prefix together; queues push them apart once the
//!   queue ahead costs more than recomputing the prefix elsewhere.
//! - `least-loaded`: [`ShortestQueuePrefillPolicy`](super::ShortestQueuePrefillPolicy).
//! - [`RoundRobinPolicy`]: each node in turn, whatever it holds or runs (a baseline).
//! - [`PowerOfTwoPolicy`]: two nodes at random, the one with less work ahead.
//!
//! Cost: O(candidates) each (plus the prefix lookups the pool makes, O(matched blocks)).

use std::sync::atomic::{AtomicU64, Ordering};

use super::{Candidate, Demand, RoutingPolicy, argmin_by_key};

/// Which prefill policy routes (the `--prefill-policy` flag).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PrefillPolicy {
    /// Least uncached + pending prompt tokens.
    #[default]
    PrefixAware,
    /// Fewest requests queued and running.
    LeastLoaded,
    /// Each node in turn.
    RoundRobin,
    /// Two nodes at random, the less loaded.
    PowerOfTwo,
}

impl PrefillPolicy {
    /// The policy itself.
    pub fn build(self) -> Box<dyn RoutingPolicy> {
        match self {
            PrefillPolicy::PrefixAware => Box::new(PrefixAwarePolicy),
            PrefillPolicy::LeastLoaded => Box::new(super::ShortestQueuePrefillPolicy),
            PrefillPolicy::RoundRobin => Box::new(RoundRobinPolicy::default()),
            PrefillPolicy::PowerOfTwo => Box::new(PowerOfTwoPolicy::default()),
        }
    }
}

/// Picks the prefill node with the fewest prompt tokens left to compute for this request.
#[derive(Clone, Copy, Debug, Default)]
pub struct PrefixAwarePolicy;

impl PrefixAwarePolicy {
    /// Prompt tokens the node would compute before this prompt is done.
    pub fn cost(c: &Candidate<'_>, demand: Demand) -> Option<u64> {
        let load = c.load?;
        let uncached = demand.prompt_tokens.saturating_sub(c.cached_tokens);
        Some(uncached + load.pending_prompt_tokens)
    }
}

impl RoutingPolicy for PrefixAwarePolicy {
    fn name(&self) -> &'static str {
        "prefix_aware"
    }

    fn select(&self, candidates: &[Candidate<'_>], demand: Demand) -> Option<usize> {
        argmin_by_key(candidates, |c| {
            Self::cost(c, demand).map(|cost| (cost, c.load.map_or(0, |l| l.queue_len + l.running)))
        })
    }
}

/// Each node in turn (by node id), whatever it holds or runs.
#[derive(Debug, Default)]
pub struct RoundRobinPolicy {
    next: AtomicU64,
}

impl RoutingPolicy for RoundRobinPolicy {
    fn name(&self) -> &'static str {
        "round_robin"
    }

    fn select(&self, candidates: &[Candidate<'_>], _demand: Demand) -> Option<usize> {
        if candidates.is_empty() {
            return None;
        }
        let mut order: Vec<usize> = (0..candidates.len()).collect();
        order.sort_by_key(|&i| candidates[i].node_id);
        let turn = self.next.fetch_add(1, Ordering::Relaxed) as usize;
        Some(order[turn % order.len()])
    }
}

/// Two candidates drawn at random; the one with less work ahead (queued + running) wins.
#[derive(Debug)]
pub struct PowerOfTwoPolicy {
    state: AtomicU64,
}

impl Default for PowerOfTwoPolicy {
    fn default() -> Self {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0x9e37_79b9, |d| d.as_nanos() as u64);
        PowerOfTwoPolicy {
            state: AtomicU64::new(seed | 1),
        }
    }
}

impl PowerOfTwoPolicy {
    fn next(&self) -> u64 {
        // splitmix64 over an atomic counter: lock-free, good enough to spread picks.
        let mut z = self
            .state
            .fetch_add(0x9e37_79b9_7f4a_7c15, Ordering::Relaxed)
            .wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

impl RoutingPolicy for PowerOfTwoPolicy {
    fn name(&self) -> &'static str {
        "power_of_two"
    }

    fn select(&self, candidates: &[Candidate<'_>], _demand: Demand) -> Option<usize> {
        let n = candidates.len();
        match n {
            0 => None,
            1 => candidates[0].load.map(|_| 0),
            _ => {
                let a = (self.next() % n as u64) as usize;
                let b = (a + 1 + (self.next() % (n as u64 - 1)) as usize) % n;
                let pair = [candidates[a].clone(), candidates[b].clone()];
                argmin_by_key(&pair, |c| c.load.map(|l| l.queue_len + l.running)).map(|i| [a, b][i])
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::loaded;
    use super::*;

    fn with(mut c: Candidate<'_>, cached: u64, pending: u64) -> Candidate<'_> {
        c.cached_tokens = cached;
        if let Some(l) = &mut c.load {
            l.pending_prompt_tokens = pending;
        }
        c
    }

    const PROMPT: Demand = Demand {
        tokens: 1100,
        prompt_tokens: 1000,
    };

    #[test]
    fn prefix_aware_goes_where_the_prompt_is_cached_until_the_queue_there_costs_more() {
        let c = [
            with(loaded("a", 0, 0, 0), 0, 0),
            with(loaded("b", 1, 1, 0), 960, 0),
        ];
        assert_eq!(
            PrefixAwarePolicy.select(&c, PROMPT),
            Some(1),
            "40 tokens beat 1000"
        );
        let c = [
            with(loaded("a", 0, 0, 0), 0, 0),
            with(loaded("b", 3, 1, 0), 960, 2000),
        ];
        assert_eq!(
            PrefixAwarePolicy.select(&c, PROMPT),
            Some(0),
            "2040 lose to 1000"
        );
        // Nothing cached anywhere: the least pending work, then the shorter queue.
        let c = [
            with(loaded("a", 2, 0, 0), 0, 10),
            with(loaded("b", 0, 0, 0), 0, 10),
        ];
        assert_eq!(PrefixAwarePolicy.select(&c, PROMPT), Some(1));
    }

    #[test]
    fn round_robin_takes_each_node_in_turn_by_id() {
        let p = RoundRobinPolicy::default();
        let c = [loaded("b", 0, 0, 0), loaded("a", 9, 9, 0)];
        let picks: Vec<_> = (0..4).map(|_| p.select(&c, PROMPT).unwrap()).collect();
        assert_eq!(picks, [1, 0, 1, 0]);
    }

    #[test]
    fn power_of_two_picks_the_less_loaded_of_two_distinct_nodes() {
        let p = PowerOfTwoPolicy::default();
        // With two nodes both are always drawn: the idle one wins every time.
        let c = [loaded("a", 5, 5, 0), loaded("b", 0, 0, 0)];
        assert!((0..50).all(|_| p.select(&c, PROMPT) == Some(1)));
        // With three, the busiest can never win (it always meets a less loaded one).
        let c = [
            loaded("a", 9, 9, 0),
            loaded("b", 1, 0, 0),
            loaded("c", 0, 1, 0),
        ];
        let picks: Vec<_> = (0..200).map(|_| p.select(&c, PROMPT).unwrap()).collect();
        assert!(!picks.contains(&0));
        assert!(picks.contains(&1) && picks.contains(&2));
    }
}
