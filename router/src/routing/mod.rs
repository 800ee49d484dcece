//! Routing policies: which node of a role gets the next request (one small trait,
//! one file per policy, as SGLang's `policies/`).
//!
//! | policy | role | signal | file |
//! |---|---|---|---|
//! | [`FreeBlocksDecodePolicy`] | decode | free KV blocks, running sequences (load reports) | `decode_blocks.rs` |
//! | [`ShortestQueuePrefillPolicy`] | prefill | queue length + running (load reports) | `prefill_queue.rs` |
//! | [`PrefixAwarePolicy`] (prefill default) | prefill | uncached prompt tokens (KV events, [`PrefixIndex`]) + pending prompt tokens (load reports) | `prefill_policies.rs` |
//! | [`RoundRobinPolicy`] | prefill | none: each node in turn | `prefill_policies.rs` |
//! | [`PowerOfTwoPolicy`] | prefill | two nodes at random, the less loaded | `prefill_policies.rs` |
//! | [`LeastInFlightPolicy`] | either | the router's own in-flight counts | `in_flight.rs` |
//!
//! Whether a prompt needs a prefill node at all is [`placement`]'s decision (conditional
//! disaggregation).
//!
//! The node pool ([`crate::nodes`]) builds one [`Candidate`] per node that accepts work and
//! decides the mode: when *every* candidate has a fresh load report it asks the role's
//! load policy, otherwise (a report stale or absent: NATS down, a node just joined) it asks
//! [`LeastInFlightPolicy`]. Comparing a fresh report with a guess would be meaningless, so
//! modes are never mixed within one choice.
//!
//! Reports arrive a few times a second; requests arrive in bursts between them. A report alone
//! would send a whole burst to the node that looked idlest, so [`LoadEstimate`] adds what this
//! router dispatched to the node after the report was received (its running count, queue and
//! reserved blocks). Policies are pure functions of their input: deterministic, ties broken by
//! node id.

mod decode_blocks;
mod in_flight;
pub mod placement;
mod prefill_policies;
mod prefill_queue;
pub mod prefix_index;

pub use decode_blocks::FreeBlocksDecodePolicy;
pub use in_flight::LeastInFlightPolicy;
pub use placement::{DisaggregationMode, Placement, PlacementReason, PlacementSettings};
pub use prefill_policies::{PowerOfTwoPolicy, PrefillPolicy, PrefixAwarePolicy, RoundRobinPolicy};
pub use prefill_queue::ShortestQueuePrefillPolicy;
pub use prefix_index::PrefixIndex;

/// A node's load as a policy sees it: its latest fresh report plus the router's own
/// dispatches to it since that report was received.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LoadEstimate {
    /// Requests waiting on the node.
    pub queue_len: u32,
    /// Sequences running on the node.
    pub running: u32,
    /// KV blocks free on the node.
    pub free_blocks: u64,
    /// KV blocks in total.
    pub total_blocks: u64,
    /// Prompt tokens waiting or being computed on the node (prefill).
    pub pending_prompt_tokens: u64,
}

/// One node a policy may choose.
#[derive(Clone, Debug, PartialEq)]
pub struct Candidate<'a> {
    /// The node id (ties are broken by it).
    pub node_id: &'a str,
    /// The estimate from a fresh load report; `None` when the pool routes by in-flight counts.
    pub load: Option<LoadEstimate>,
    /// Requests this router has in flight on the node now.
    pub in_flight: u32,
    /// The node's KV block size, in tokens.
    pub block_size_tokens: u64,
    /// Leading prompt tokens the node's prefix cache holds (KV events; 0 when unknown).
    pub cached_tokens: u64,
}

impl Candidate<'_> {
    /// KV blocks a request of `tokens` tokens occupies on this node.
    pub fn blocks_for(&self, tokens: u64) -> u64 {
        tokens.div_ceil(self.block_size_tokens.max(1))
    }
}

/// What the request needs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Demand {
    /// Prompt plus maximum output, in tokens.
    pub tokens: u64,
    /// The prompt, in tokens.
    pub prompt_tokens: u64,
}

/// Chooses a node for a request.
pub trait RoutingPolicy: Send + Sync + std::fmt::Debug {
    /// A stable name for logs and metrics.
    fn name(&self) -> &'static str;

    /// The index of the chosen candidate, or `None` if the policy cannot choose (no candidate,
    /// or a load policy given candidates without load).
    fn select(&self, candidates: &[Candidate<'_>], demand: Demand) -> Option<usize>;
}

/// Index of the minimum of `key` over `candidates`, ties broken by node id.
pub(crate) fn argmin_by_key<K: Ord>(
    candidates: &[Candidate<'_>],
    key: impl Fn(&Candidate<'_>) -> Option<K>,
) -> Option<usize> {
    candidates
        .iter()
        .enumerate()
        .filter_map(|(i, c)| key(c).map(|k| (k, c.node_id, i)))
        .min_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)))
        .map(|(_, _, i)| i)
}

#[cfg(test)]
pub(crate) mod test_support {
    use super::*;

    /// A candidate with a load report.
    pub fn loaded(node_id: &str, queue_len: u32, running: u32, free_blocks: u64) -> Candidate<'_> {
        Candidate {
            node_id,
            load: Some(LoadEstimate {
                queue_len,
                running,
                free_blocks,
                total_blocks: 1024,
                pending_prompt_tokens: 0,
            }),
            in_flight: 0,
            block_size_tokens: 16,
            cached_tokens: 0,
        }
    }

    /// A candidate without a report.
    pub fn unloaded(node_id: &str, in_flight: u32) -> Candidate<'_> {
        Candidate {
            node_id,
            load: None,
            in_flight,
            block_size_tokens: 16,
            cached_tokens: 0,
        }
    }
}
