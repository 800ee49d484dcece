//! Byte-level BPE merging of one pre-tokenised piece.
//!
//! A piece starts as one symbol per byte (the vocabulary's token for that byte) in a doubly
//! linked list; a byte the vocabulary has no token for is dropped, its neighbours becoming
//! adjacent (HF `BPE` without `unk_token` does the same; SmolLM2 lacks 21 such bytes, e.g.
//! 0x04, 0xC0, 0xF5..=0xFF). Every adjacent pair with a merge rule goes into a min-heap keyed by
//! `(rank, position)`; popping the smallest merges that pair in place and pushes the two new
//! pairs it forms with its neighbours. Stale heap entries (a side already merged away, or the
//! pair at that position no longer the one pushed) are skipped when popped. This is the order of
//! Hugging Face's `Word::merge_all` — lowest rank first, leftmost first among equal ranks — so the
//! output ids are identical to `tokenizers`' BPE with dropout off.
//!
//! Cost: O(n log n) for a piece of n bytes (each merge removes a symbol and pushes at most two
//! entries), so a pathological 100 kB piece without spaces is still fast; the scratch buffers are
//! reused across pieces so steady-state encoding does not allocate per piece.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

/// Hasher for the `(left, right)` pair keys packed into a `u64`: one folded multiply.
#[derive(Default)]
pub(crate) struct PairHasher(u64);

impl Hasher for PairHasher {
    fn finish(&self) -> u64 {
        let m = u128::from(self.0) * 0x9E37_79B9_7F4A_7C15_u128;
        (m as u64) ^ ((m >> 64) as u64)
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x100_0000_01B3);
        }
    }

    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

/// What a merge rule turns a pair into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MergeTarget {
    /// Priority: the rule's position in the merge list (lower merges first).
    pub(crate) rank: u32,
    /// The id of the merged token.
    pub(crate) id: u32,
}

/// Merge rules keyed by `pair_key(left, right)`.
pub(crate) type MergeMap = HashMap<u64, MergeTarget, BuildHasherDefault<PairHasher>>;

/// Pack a pair of token ids into one map key.
pub(crate) fn pair_key(left: u32, right: u32) -> u64 {
    (u64::from(left) << 32) | u64::from(right)
}

/// Sentinel for "no symbol" in the linked list, and for "no token" in the byte table.
pub(crate) const NONE: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
struct Symbol {
    id: u32,
    prev: u32,
    next: u32,
    alive: bool,
}

/// Reusable buffers for [`Bpe::encode_piece`].
#[derive(Debug, Default)]
pub(crate) struct BpeScratch {
    symbols: Vec<Symbol>,
    /// `(rank, position of the left symbol, merged id)`, smallest first.
    heap: BinaryHeap<Reverse<(u32, u32, u32)>>,
}

/// The merge rules and byte tokens of a byte-level BPE vocabulary.
#[derive(Debug, Clone)]
pub(crate) struct Bpe {
    merges: MergeMap,
    byte_ids: [u32; 256],
}

impl Bpe {
    /// A merger over `merges` whose initial symbols are `byte_ids[b]` for each byte `b`
    /// ([`NONE`] for bytes without a token, which are dropped).
    pub(crate) fn new(merges: MergeMap, byte_ids: [u32; 256]) -> Self {
        Self { merges, byte_ids }
    }

    /// Number of merge rules.
    #[cfg(test)]
    pub(crate) fn merge_count(&self) -> usize {
        self.merges.len()
    }

    /// Append the token ids of the piece `bytes` to `out`.
    pub(crate) fn encode_piece(&self, bytes: &[u8], scratch: &mut BpeScratch, out: &mut Vec<u32>) {
        let BpeScratch { symbols, heap } = scratch;
        symbols.clear();
        heap.clear();
        for id in bytes
            .iter()
            .map(|&b| self.byte_ids[b as usize])
            .filter(|&id| id != NONE)
        {
            let i = u32::try_from(symbols.len()).expect("a piece over 4 GiB cannot be tokenised");
            // i - 1 wraps to NONE for the first symbol; the last one's `next` is fixed below.
            symbols.push(Symbol {
                id,
                prev: i.wrapping_sub(1),
                next: i + 1,
                alive: true,
            });
        }
        let n = symbols.len() as u32;
        match symbols.last_mut() {
            None => return,
            Some(last) => last.next = NONE,
        }
        for i in 0..n - 1 {
            let (l, r) = (symbols[i as usize].id, symbols[i as usize + 1].id);
            if let Some(t) = self.merges.get(&pair_key(l, r)) {
                heap.push(Reverse((t.rank, i, t.id)));
            }
        }
        while let Some(Reverse((rank, pos, merged))) = heap.pop() {
            let left = symbols[pos as usize];
            if !left.alive || left.next == NONE {
                continue;
            }
            let right = symbols[left.next as usize];
            let current = self.merges.get(&pair_key(left.id, right.id));
            if current.is_none_or(|t| t.id != merged || t.rank != rank) {
                continue;
            }
            symbols[pos as usize].id = merged;
            symbols[pos as usize].next = right.next;
            symbols[left.next as usize].alive = false;
            if right.next != NONE {
                symbols[right.next as usize].prev = pos;
                let after = symbols[right.next as usize].id;
                if let Some(t) = self.merges.get(&pair_key(merged, after)) {
                    heap.push(Reverse((t.rank, pos, t.id)));
                }
            }
            if left.prev != NONE {
                let before = symbols[left.prev as usize].id;
                if let Some(t) = self.merges.get(&pair_key(before, merged)) {
                    heap.push(Reverse((t.rank, left.prev, t.id)));
                }
            }
        }
        let mut i = 0;
        while i != NONE {
            out.push(symbols[i as usize].id);
            i = symbols[i as usize].next;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Byte `b` has id `b`; merges listed as `(left, right, merged)` in rank order.
    fn toy(merges: &[(u32, u32, u32)]) -> Bpe {
        let mut map = MergeMap::default();
        for (rank, &(l, r, m)) in merges.iter().enumerate() {
            map.insert(
                pair_key(l, r),
                MergeTarget {
                    rank: rank as u32,
                    id: m,
                },
            );
        }
        let mut byte_ids = [0u32; 256];
        for (b, id) in byte_ids.iter_mut().enumerate() {
            *id = b as u32;
        }
        Bpe::new(map, byte_ids)
    }

    fn encode(bpe: &Bpe, text: &str) -> Vec<u32> {
        let mut out = Vec::new();
        bpe.encode_piece(text.as_bytes(), &mut BpeScratch::default(), &mut out);
        out
    }

    const A: u32 = b'a' as u32;
    const B: u32 = b'b' as u32;
    const C: u32 = b'c' as u32;

    #[test]
    fn lower_rank_merges_first() {
        // "bc" (rank 0) beats "ab" (rank 1): a|bc, then "a"+"bc" (rank 2).
        let bpe = toy(&[(B, C, 300), (A, B, 301), (A, 300, 302)]);
        assert_eq!(encode(&bpe, "abc"), [302]);
        assert_eq!(encode(&bpe, "abd"), [301, u32::from(b'd')]);
    }

    #[test]
    fn equal_ranks_merge_leftmost_first_without_overlap() {
        let bpe = toy(&[(A, A, 300)]);
        assert_eq!(encode(&bpe, "aaa"), [300, A]);
        assert_eq!(encode(&bpe, "aaaa"), [300, 300]);
    }

    #[test]
    fn newly_formed_pairs_are_merged() {
        let bpe = toy(&[(A, A, 300), (300, 300, 301), (301, 301, 302)]);
        assert_eq!(encode(&bpe, &"a".repeat(8)), [302]);
        assert_eq!(encode(&bpe, &"a".repeat(9)), [302, A]);
    }

    #[test]
    fn pieces_without_merges_stay_as_bytes() {
        let bpe = toy(&[]);
        assert_eq!(encode(&bpe, "xyz"), [120, 121, 122]);
        assert_eq!(encode(&bpe, ""), Vec::<u32>::new());
        assert_eq!(bpe.merge_count(), 0);
    }

    #[test]
    fn bytes_without_a_token_are_dropped_and_their_neighbours_merge() {
        let mut bpe = toy(&[(A, A, 300)]);
        bpe.byte_ids[b'x' as usize] = NONE;
        assert_eq!(encode(&bpe, "axa"), [300]);
        assert_eq!(encode(&bpe, "xx"), Vec::<u32>::new());
        assert_eq!(encode(&bpe, "x"), Vec::<u32>::new());
    }

    #[test]
    fn long_piece_encodes_in_near_linear_time() {
        let bpe = toy(&[(A, A, 300), (300, 300, 301), (301, 301, 302)]);
        let start = std::time::Instant::now();
        let ids = encode(&bpe, &"a".repeat(200_000));
        assert_eq!(ids, vec![302; 25_000]);
        // O(n^2) would take minutes; O(n log n) takes milliseconds.
        assert!(
            start.elapsed().as_secs_f64() < 2.0,
            "took {:?}",
            start.elapsed()
        );
    }
}
