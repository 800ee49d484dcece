//! [`PrefixIndex`]: which prefill node holds which prompt prefix, kept from the nodes' KV events
//! (`tandem_cluster::load::kv_events`), so [`PrefixAwarePolicy`](super::PrefixAwarePolicy) can
//! send a prompt where most of it is already cached.
//!
//! Invariants: a node's set is trusted ("synced") only while every batch since its last
//! complete snapshot arrived in `seq` order; after a gap it counts as caching nothing until the
//! next snapshot completes (at most the node's snapshot period, 5 s). A node that left the
//! membership is forgotten ([`PrefixIndex::retain`]). Lookups take one mutex and cost
//! O(matched blocks).

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use tandem_cluster::{KvEventBatch, KvEventBody};

#[derive(Debug, Default)]
struct NodeCache {
    hashes: HashSet<u64>,
    block_size_tokens: u32,
    next_seq: Option<u64>,
    synced: bool,
    /// A snapshot being received: the next part expected, of how many, and the hashes so far.
    pending: Option<(u32, u32, HashSet<u64>)>,
}

/// Counters of the index (for `/metrics`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixIndexCounts {
    /// Batches applied.
    pub batches: u64,
    /// Gaps seen (a node's set was distrusted until its next snapshot).
    pub gaps: u64,
    /// Nodes whose set is trusted now.
    pub synced_nodes: u64,
    /// Hashes held, over every node.
    pub hashes: u64,
}

/// The router's view of every prefill node's prefix cache.
#[derive(Debug, Default)]
pub struct PrefixIndex {
    nodes: Mutex<HashMap<String, NodeCache>>,
    batches: std::sync::atomic::AtomicU64,
    gaps: std::sync::atomic::AtomicU64,
}

impl PrefixIndex {
    fn nodes(&self) -> std::sync::MutexGuard<'_, HashMap<String, NodeCache>> {
        self.nodes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Applies one batch of a node's stream.
    pub fn apply(&self, batch: KvEventBatch) {
        use std::sync::atomic::Ordering::Relaxed;
        self.batches.fetch_add(1, Relaxed);
        let mut nodes = self.nodes();
        let node = nodes.entry(batch.node_id).or_default();
        let in_order = node.next_seq == Some(batch.seq);
        if node.next_seq.is_some() && !in_order {
            self.gaps.fetch_add(1, Relaxed);
        }
        node.next_seq = Some(batch.seq + 1);
        node.block_size_tokens = batch.block_size_tokens;
        match batch.body {
            KvEventBody::Snapshot {
                hashes,
                part,
                parts,
            } => {
                let pending = match (part, node.pending.take()) {
                    (0, _) => Some((1, parts, hashes.into_iter().collect())),
                    (p, Some((next, n, mut set))) if in_order && p == next && n == parts => {
                        set.extend(hashes);
                        Some((next + 1, n, set))
                    }
                    _ => None,
                };
                match pending {
                    Some((next, n, set)) if next >= n => {
                        node.hashes = set;
                        node.synced = true;
                    }
                    other => node.pending = other,
                }
            }
            KvEventBody::Delta { stored, removed } => {
                if in_order && node.synced {
                    for h in removed {
                        node.hashes.remove(&h);
                    }
                    node.hashes.extend(stored);
                } else {
                    node.synced = false;
                    node.hashes.clear();
                }
            }
        }
    }

    /// How many leading blocks of a prompt `node_id` holds, the prompt's block hashes given
    /// per block size by `hashes_for` (0 for a node whose set is not trusted now).
    pub fn cached_tokens(
        &self,
        node_id: &str,
        hashes_for: &mut dyn FnMut(u32) -> std::sync::Arc<[u64]>,
    ) -> u64 {
        let nodes = self.nodes();
        let Some(node) = nodes.get(node_id).filter(|n| n.synced) else {
            return 0;
        };
        let hashes = hashes_for(node.block_size_tokens);
        let blocks = hashes
            .iter()
            .take_while(|h| node.hashes.contains(h))
            .count();
        blocks as u64 * u64::from(node.block_size_tokens)
    }

    /// Forgets nodes for which `keep` is false (they left the membership).
    pub fn retain(&self, keep: impl Fn(&str) -> bool) {
        self.nodes().retain(|id, _| keep(id));
    }

    /// The counters now.
    pub fn counts(&self) -> PrefixIndexCounts {
        use std::sync::atomic::Ordering::Relaxed;
        let nodes = self.nodes();
        PrefixIndexCounts {
            batches: self.batches.load(Relaxed),
            gaps: self.gaps.load(Relaxed),
            synced_nodes: nodes.values().filter(|n| n.synced).count() as u64,
            hashes: nodes.values().map(|n| n.hashes.len() as u64).sum(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn batch(seq: u64, body: KvEventBody) -> KvEventBatch {
        KvEventBatch {
            node_id: "p0".into(),
            seq,
            block_size_tokens: 4,
            body,
        }
    }

    fn delta(stored: &[u64], removed: &[u64]) -> KvEventBody {
        KvEventBody::Delta {
            stored: stored.to_vec(),
            removed: removed.to_vec(),
        }
    }

    fn cached(index: &PrefixIndex, prompt: &[u64]) -> u64 {
        let prompt: Arc<[u64]> = Arc::from(prompt);
        index.cached_tokens("p0", &mut |_| Arc::clone(&prompt))
    }

    #[test]
    fn snapshots_then_deltas_in_order_track_the_cache_and_a_gap_distrusts_it() {
        let index = PrefixIndex::default();
        // Deltas before any snapshot are not trusted.
        index.apply(batch(0, delta(&[1], &[])));
        assert_eq!(cached(&index, &[1]), 0);
        for b in KvEventBatch::snapshot("p0", 4, 1, &[1, 2]) {
            index.apply(b);
        }
        assert_eq!(
            cached(&index, &[1, 2, 3]),
            8,
            "two leading blocks of 4 tokens"
        );
        index.apply(batch(2, delta(&[3], &[1])));
        assert_eq!(
            cached(&index, &[1, 2, 3]),
            0,
            "the first block is gone: no prefix"
        );
        assert_eq!(cached(&index, &[2, 3]), 8);
        // Seq 3 lost: the set is not trusted until a snapshot.
        index.apply(batch(4, delta(&[1], &[])));
        assert_eq!(cached(&index, &[2, 3]), 0);
        index.apply(batch(5, delta(&[2], &[])));
        assert_eq!(cached(&index, &[2]), 0);
        for b in KvEventBatch::snapshot("p0", 4, 6, &[7]) {
            index.apply(b);
        }
        assert_eq!(cached(&index, &[7]), 4);
        let c = index.counts();
        assert_eq!((c.gaps, c.synced_nodes, c.hashes), (1, 1, 1));
        index.retain(|id| id != "p0");
        assert_eq!(cached(&index, &[7]), 0);
    }

    #[test]
    fn a_snapshot_missing_a_part_is_not_taken() {
        let index = PrefixIndex::default();
        let hashes: Vec<u64> =
            (0..tandem_cluster::load::kv_events::SNAPSHOT_PART_HASHES as u64 + 1).collect();
        let parts = KvEventBatch::snapshot("p0", 4, 0, &hashes);
        assert_eq!(parts.len(), 2);
        index.apply(parts[0].clone());
        assert_eq!(cached(&index, &[0]), 0, "not complete yet");
        let mut late = parts[1].clone();
        late.seq += 1; // the second part after a lost message
        index.apply(late);
        assert_eq!(cached(&index, &[0]), 0);
        for b in KvEventBatch::snapshot("p0", 4, 10, &hashes) {
            index.apply(b);
        }
        assert_eq!(cached(&index, &[0, 1, 2]), 12);
    }
}
