//! KV events: what each node's prefix cache holds, as chained block hashes
//! (`tandem_kv_layout::prefix`), so a router can send a prompt where its prefix is cached.
//!
//! ```text
//! node: engine thread ──(deltas, snapshots)──▶ publisher ──▶ tandem.{cluster}.kv.{node_id}
//! router: subscribe_kv_events() ──▶ mpsc::Receiver<KvEventBatch> ──▶ its prefix index
//! ```
//!
//! Core NATS is at-most-once, so the stream is built to survive loss: every batch of a node
//! carries the next number of its `seq`; a receiver that sees a gap stops trusting that node's
//! set until the next [`KvEventBody::Snapshot`] (the whole set, sent every few seconds and
//! after any loss the node knows of, split into parts of at most [`SNAPSHOT_PART_HASHES`]
//! hashes to stay under NATS's payload limit). A receiver's queue is bounded: a message that
//! does not fit is dropped, which is a gap like any other.

use serde::{Deserialize, Serialize};

/// Hashes in one snapshot part (8 bytes each in memory, ~20 in JSON: ~330 KB a part).
pub const SNAPSHOT_PART_HASHES: usize = 16 * 1024;

/// Messages a subscriber may have queued before newer ones are dropped.
pub const KV_EVENT_QUEUE: usize = 1024;

/// One message of a node's KV event stream.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KvEventBatch {
    /// The node whose cache this describes.
    pub node_id: String,
    /// Its position in the node's stream (consecutive; a gap is a loss).
    pub seq: u64,
    /// The node's KV block size in tokens (the hashes are of blocks that long).
    pub block_size_tokens: u32,
    /// What changed.
    pub body: KvEventBody,
}

/// The content of a [`KvEventBatch`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KvEventBody {
    /// Part `part` (from 0) of `parts` of the whole set; the parts are consecutive in `seq`,
    /// and the set replaces the receiver's once the last part arrived with no gap.
    Snapshot {
        /// Hashes in this part.
        hashes: Vec<u64>,
        /// This part's number.
        part: u32,
        /// How many parts.
        parts: u32,
    },
    /// Changes since the previous batch: blocks now cached, blocks no longer cached (net of
    /// each other: a hash is in at most one of the two).
    Delta {
        /// Newly cached.
        stored: Vec<u64>,
        /// Evicted.
        removed: Vec<u64>,
    },
}

impl KvEventBatch {
    /// The batches of a snapshot of `hashes`, numbered from `first_seq`.
    pub fn snapshot(
        node_id: &str,
        block_size_tokens: u32,
        first_seq: u64,
        hashes: &[u64],
    ) -> Vec<Self> {
        let chunks: Vec<&[u64]> = if hashes.is_empty() {
            vec![&[]]
        } else {
            hashes.chunks(SNAPSHOT_PART_HASHES).collect()
        };
        let parts = chunks.len() as u32;
        chunks
            .into_iter()
            .enumerate()
            .map(|(i, chunk)| KvEventBatch {
                node_id: node_id.to_string(),
                seq: first_seq + i as u64,
                block_size_tokens,
                body: KvEventBody::Snapshot {
                    hashes: chunk.to_vec(),
                    part: i as u32,
                    parts,
                },
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_large_snapshot_is_split_into_consecutive_parts() {
        let hashes: Vec<u64> = (0..(SNAPSHOT_PART_HASHES as u64 * 2 + 5)).collect();
        let batches = KvEventBatch::snapshot("p0", 16, 7, &hashes);
        assert_eq!(batches.len(), 3);
        assert_eq!(batches.iter().map(|b| b.seq).collect::<Vec<_>>(), [7, 8, 9]);
        let mut all: Vec<u64> = Vec::new();
        for b in &batches {
            let KvEventBody::Snapshot { hashes, parts, .. } = &b.body else {
                panic!("not a snapshot");
            };
            assert_eq!(*parts, 3);
            all.extend(hashes.iter().copied());
        }
        assert_eq!(all, hashes);
        assert_eq!(
            KvEventBatch::snapshot("p0", 16, 0, &[]).len(),
            1,
            "an empty set is one part"
        );
        let json = serde_json::to_string(&batches[2]).unwrap();
        assert_eq!(
            serde_json::from_str::<KvEventBatch>(&json).unwrap(),
            batches[2]
        );
    }
}
