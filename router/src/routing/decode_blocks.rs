//! [`FreeBlocksDecodePolicy`]: the decode node with the fewest running sequences among those
//! with room for the request's KV blocks.
//!
//! A decode step's latency grows with the batch, so among nodes that can hold the request
//! (estimated free blocks ≥ blocks for prompt + max output) the one running the fewest
//! sequences wins; ties go to the node with more free blocks, then to the lower node id. When
//! no node has room by the estimate, the node with the most free blocks is chosen anyway: the
//! estimate lags, and its `Reserve` answers RESOURCE_EXHAUSTED if it really is full (the
//! pipeline then tries the next node). Cost: O(candidates).

use super::{Candidate, Demand, RoutingPolicy, argmin_by_key};

/// Picks decode nodes by running sequences and free KV blocks (from load reports).
#[derive(Clone, Copy, Debug, Default)]
pub struct FreeBlocksDecodePolicy;

impl RoutingPolicy for FreeBlocksDecodePolicy {
    fn name(&self) -> &'static str {
        "free_blocks"
    }

    fn select(&self, candidates: &[Candidate<'_>], demand: Demand) -> Option<usize> {
        let fits = argmin_by_key(candidates, |c| {
            let load = c.load?;
            (load.free_blocks >= c.blocks_for(demand.tokens))
                .then_some((load.running, std::cmp::Reverse(load.free_blocks)))
        });
        fits.or_else(|| {
            argmin_by_key(candidates, |c| {
                c.load.map(|l| std::cmp::Reverse(l.free_blocks))
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::{loaded, unloaded};
    use super::*;

    const DEMAND: Demand = Demand { tokens: 160, prompt_tokens: 100 }; // 10 blocks of 16

    #[test]
    fn among_nodes_with_room_the_least_busy_wins() {
        let c = [
            loaded("a", 0, 5, 500),
            loaded("b", 0, 2, 20),
            loaded("c", 0, 1, 9),
        ];
        // c runs the fewest but has 9 < 10 free blocks; b has room and runs fewer than a.
        assert_eq!(FreeBlocksDecodePolicy.select(&c, DEMAND), Some(1));
    }

    #[test]
    fn equal_running_counts_go_to_the_node_with_more_free_blocks_then_lower_id() {
        let c = [
            loaded("b", 0, 2, 100),
            loaded("a", 0, 2, 300),
            loaded("c", 0, 2, 300),
        ];
        assert_eq!(FreeBlocksDecodePolicy.select(&c, DEMAND), Some(1));
    }

    #[test]
    fn when_no_node_has_room_the_emptiest_is_tried() {
        let c = [loaded("a", 0, 0, 3), loaded("b", 0, 9, 7)];
        assert_eq!(FreeBlocksDecodePolicy.select(&c, DEMAND), Some(1));
    }

    #[test]
    fn it_refuses_to_choose_without_load_reports() {
        assert_eq!(
            FreeBlocksDecodePolicy.select(&[unloaded("a", 0)], DEMAND),
            None
        );
        assert_eq!(FreeBlocksDecodePolicy.select(&[], DEMAND), None);
    }
}
