//! [`ShortestQueuePrefillPolicy`]: the prefill node with the least work ahead of a new prompt
//! (queued plus running requests, from load reports); ties go to the lower node id.
//! Cost: O(candidates).

use super::{Candidate, Demand, RoutingPolicy, argmin_by_key};

/// Picks prefill nodes by queue length (from load reports).
#[derive(Clone, Copy, Debug, Default)]
pub struct ShortestQueuePrefillPolicy;

impl RoutingPolicy for ShortestQueuePrefillPolicy {
    fn name(&self) -> &'static str {
        "shortest_queue"
    }

    fn select(&self, candidates: &[Candidate<'_>], _demand: Demand) -> Option<usize> {
        argmin_by_key(candidates, |c| c.load.map(|l| l.queue_len + l.running))
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::{loaded, unloaded};
    use super::*;

    const DEMAND: Demand = Demand { tokens: 1, prompt_tokens: 1 };

    #[test]
    fn the_node_with_the_least_work_ahead_wins() {
        let c = [
            loaded("a", 3, 1, 0),
            loaded("b", 1, 1, 0),
            loaded("c", 0, 4, 0),
        ];
        assert_eq!(ShortestQueuePrefillPolicy.select(&c, DEMAND), Some(1));
    }

    #[test]
    fn ties_go_to_the_lower_node_id_and_missing_reports_refuse() {
        let c = [loaded("z", 1, 0, 0), loaded("m", 0, 1, 0)];
        assert_eq!(ShortestQueuePrefillPolicy.select(&c, DEMAND), Some(1));
        assert_eq!(
            ShortestQueuePrefillPolicy.select(&[unloaded("a", 0)], DEMAND),
            None
        );
    }
}
