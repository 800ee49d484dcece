//! [`LeastInFlightPolicy`]: the node with the fewest of this router's requests in flight; ties
//! go to the lower node id. The fallback when load reports are stale or absent: it needs
//! nothing but the router's own counts, so it keeps working with NATS down. Since each
//! dispatch raises the chosen node's count at once, a burst spreads over the nodes.
//! Cost: O(candidates).

use super::{Candidate, Demand, RoutingPolicy, argmin_by_key};

/// Picks the node with the fewest requests in flight from this router.
#[derive(Clone, Copy, Debug, Default)]
pub struct LeastInFlightPolicy;

impl RoutingPolicy for LeastInFlightPolicy {
    fn name(&self) -> &'static str {
        "least_in_flight"
    }

    fn select(&self, candidates: &[Candidate<'_>], _demand: Demand) -> Option<usize> {
        argmin_by_key(candidates, |c| Some(c.in_flight))
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::{loaded, unloaded};
    use super::*;

    #[test]
    fn the_node_with_fewest_in_flight_wins_whatever_its_report_says() {
        let mut busy_but_idle_report = loaded("a", 0, 0, 999);
        busy_but_idle_report.in_flight = 5;
        let c = [busy_but_idle_report, unloaded("b", 2), unloaded("c", 2)];
        assert_eq!(
            LeastInFlightPolicy.select(&c, Demand { tokens: 1, prompt_tokens: 1 }),
            Some(1)
        );
        assert_eq!(LeastInFlightPolicy.select(&[], Demand { tokens: 1, prompt_tokens: 1 }), None);
    }
}
