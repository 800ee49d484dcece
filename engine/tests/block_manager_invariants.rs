//! A seeded randomized test of the block manager: 100,000 rounds of allocate / append / free /
//! prefix-hit / evict, checking every invariant after every round (no block owned twice, exact
//! reference counts, free + used = total), and that a prefix hit returns blocks whose KV bytes are
//! exactly what was written for that content.
//!
//! A small "vocabulary" of block contents (TGI's trick: small vocabularies hit corner cases
//! sooner) makes prefix hits, sharing and eviction frequent.

use tandem_engine::kv::{BlockId, BlockManager, KvPool, hash_block};
use tandem_engine::rng::Rng;
use tandem_engine::{KvDtype, KvLayout};

const BLOCKS: usize = 48;
const ROUNDS: usize = 100_000;
const BLOCK_TOKENS: usize = 4;

struct Seq {
    blocks: Vec<BlockId>,
    hashes: Vec<u64>,
    /// Tokens in the last, partial block.
    tail: usize,
}

/// Deterministic KV bytes for block content `hash` (what a forward pass would have written).
fn content_bytes(hash: u64, len: usize) -> Vec<u8> {
    let mut r = Rng::new(hash);
    (0..len).map(|_| r.next_u64() as u8).collect()
}

fn write_block(pool: &mut KvPool, block: BlockId, hash: u64) {
    let layout = *pool.layout();
    let bytes = content_bytes(hash, layout.slab_bytes() * layout.num_layers);
    for layer in 0..layout.num_layers {
        let src = &bytes[layer * layout.slab_bytes()..(layer + 1) * layout.slab_bytes()];
        pool.slab_mut(layer, block).copy_from_slice(src);
    }
}

#[test]
fn block_manager_keeps_its_invariants_over_100k_seeded_rounds() {
    let layout = KvLayout::new(2, 1, 8, BLOCK_TOKENS, KvDtype::F32, 0).unwrap();
    let mut pool = KvPool::new(layout, BLOCKS).unwrap();
    let mut m = BlockManager::new(BLOCKS);
    let mut rng = Rng::new(64);
    let mut seqs: Vec<Seq> = Vec::new();
    let (mut hits, mut evictions_seen, mut allocs) = (0u64, 0u64, 0u64);

    for round in 0..ROUNDS {
        match rng.below(10) {
            // Start a sequence: reuse the cached prefix of a random chain, then allocate the rest.
            0..=2 => {
                let chain_len = 1 + rng.below(4) as usize;
                let mut hashes = Vec::new();
                let mut prev = 0;
                for _ in 0..chain_len {
                    // Vocabulary of 2 token values per block position.
                    let tokens: Vec<u32> = (0..BLOCK_TOKENS).map(|_| rng.below(2) as u32).collect();
                    prev = hash_block(prev, &tokens);
                    hashes.push(prev);
                }
                let hit = m.match_prefix(&hashes);
                let need = chain_len - hit.len();
                if m.num_free() < need + hit.iter().filter(|&&b| m.ref_count(b) == 0).count() {
                    continue;
                }
                for &b in &hit {
                    // A hit must return exactly the KV written for that content.
                    let expect = content_bytes(hashes[hit.iter().position(|&x| x == b).unwrap()], layout.block_bytes());
                    assert_eq!(pool.block_bytes(b), expect, "round {round}: prefix hit on block {b} returned other KV");
                    m.retain(b);
                    hits += 1;
                }
                let mut blocks = hit.clone();
                for h in &hashes[hit.len()..] {
                    let b = m.allocate().expect("counted free blocks");
                    allocs += 1;
                    write_block(&mut pool, b, *h);
                    m.cache_full_block(b, *h);
                    blocks.push(b);
                }
                seqs.push(Seq { blocks, hashes, tail: 0 });
            }
            // Append a token to a running sequence (a new block when the tail fills).
            3..=6 if !seqs.is_empty() => {
                let i = rng.below(seqs.len() as u64) as usize;
                let s = &mut seqs[i];
                s.tail += 1;
                if s.tail == BLOCK_TOKENS {
                    s.tail = 0;
                    if let Some(b) = m.allocate() {
                        allocs += 1;
                        let h = hash_block(*s.hashes.last().unwrap(), &[9, 9, round as u32 % 3, 1]);
                        write_block(&mut pool, b, h);
                        m.cache_full_block(b, h);
                        s.blocks.push(b);
                        s.hashes.push(h);
                    }
                }
            }
            // Finish a sequence: release its blocks (cached ones stay findable until evicted).
            _ if !seqs.is_empty() => {
                let i = rng.below(seqs.len() as u64) as usize;
                let s = seqs.swap_remove(i);
                m.release_all(&s.blocks);
            }
            _ => {}
        }
        evictions_seen = m.evictions;
        m.check_invariants();
        let held: usize = seqs.iter().map(|s| s.blocks.len()).sum();
        assert!(held >= m.num_used(), "round {round}");
        let mut owners = [0u32; BLOCKS];
        for s in &seqs {
            for &b in &s.blocks {
                owners[b as usize] += 1;
            }
        }
        for (b, &n) in owners.iter().enumerate() {
            assert_eq!(n, m.ref_count(b as u32), "round {round}: block {b} ref count");
        }
        assert_eq!(m.num_free() + owners.iter().filter(|&&n| n > 0).count(), BLOCKS, "round {round}: free + used");
    }
    for s in seqs.drain(..) {
        m.release_all(&s.blocks);
    }
    m.check_invariants();
    assert_eq!(m.num_free(), BLOCKS);
    assert!(hits > 1_000 && evictions_seen > 1_000 && allocs > 10_000, "hits {hits}, evictions {evictions_seen}, allocs {allocs}");
}
