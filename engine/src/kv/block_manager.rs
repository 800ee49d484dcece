//! Logical KV blocks: reference counts, a prefix cache keyed by chained block hashes, and LRU
//! eviction of cached blocks nobody holds (vLLM v1's `BlockPool` + free-queue design).
//!
//! # Invariants (checked by [`BlockManager::check_invariants`] in the seeded test)
//! - Every block is either *held* (`ref_count > 0`) or on the free list, never both, never neither.
//! - `num_free() + held blocks == num_blocks()`.
//! - A block is in the hash map iff it carries a hash, and the map entry points back at it; a
//!   hash maps to at most one block.
//! - Free blocks keep their hash (and so their KV stays reusable) until they are handed out again:
//!   allocation pops the free list's head (least recently freed), which evicts that block's hash.
//!
//! # Costs
//! allocate, retain, release and lookup are O(1) (an intrusive doubly-linked list over block
//! indices, plus one hash map). Memory: 16 bytes per block plus the map.

use std::collections::HashMap;

/// A block's index in the pool.
pub type BlockId = u32;

const NIL: u32 = u32::MAX;

pub use tandem_kv_layout::prefix::hash_block;

/// A change to the prefix cache's contents, for nodes that publish them (KV events).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheEvent {
    /// A full block's content became findable under this hash.
    Stored(u64),
    /// The block cached under this hash was handed out for new content.
    Removed(u64),
}

/// Events kept before a drain at most; past it the log is dropped and marked overflowed (the
/// reader then needs the whole set, [`BlockManager::cached_hashes`]).
pub const MAX_LOGGED_EVENTS: usize = 1 << 16;

/// Reference-counted blocks with a prefix cache. Not thread-safe: owned by the engine thread.
#[derive(Debug)]
pub struct BlockManager {
    ref_count: Vec<u32>,
    hash: Vec<Option<u64>>,
    cached: HashMap<u64, BlockId>,
    prev: Vec<u32>,
    next: Vec<u32>,
    on_free_list: Vec<bool>,
    head: u32,
    tail: u32,
    num_free: usize,
    /// Cached blocks handed out again for new content (prefix cache evictions).
    pub evictions: u64,
    /// Cache changes since the last drain, when logging is on.
    events: Option<Vec<CacheEvent>>,
    /// Events were dropped since the last drain (the log outgrew its bound).
    overflowed: bool,
}

impl BlockManager {
    /// A manager for `num_blocks` blocks, all free.
    pub fn new(num_blocks: usize) -> Self {
        assert!(num_blocks < NIL as usize, "block ids must fit u32");
        let mut m = BlockManager {
            ref_count: vec![0; num_blocks],
            hash: vec![None; num_blocks],
            cached: HashMap::new(),
            prev: vec![NIL; num_blocks],
            next: vec![NIL; num_blocks],
            on_free_list: vec![false; num_blocks],
            head: NIL,
            tail: NIL,
            num_free: 0,
            evictions: 0,
            events: None,
            overflowed: false,
        };
        for b in 0..num_blocks as u32 {
            m.push_back(b);
        }
        m
    }

    /// Blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.ref_count.len()
    }

    /// Blocks nobody holds (some may still carry reusable cached KV).
    pub fn num_free(&self) -> usize {
        self.num_free
    }

    /// Blocks held by at least one sequence.
    pub fn num_used(&self) -> usize {
        self.num_blocks() - self.num_free
    }

    /// Current holders of `block`.
    pub fn ref_count(&self, block: BlockId) -> u32 {
        self.ref_count[block as usize]
    }

    /// The cached block with content hash `hash`, if any (held or free).
    pub fn lookup(&self, hash: u64) -> Option<BlockId> {
        self.cached.get(&hash).copied()
    }

    /// The leading blocks of `hashes` that are cached, in order (not retained).
    pub fn match_prefix(&self, hashes: &[u64]) -> Vec<BlockId> {
        hashes.iter().map_while(|h| self.lookup(*h)).collect()
    }

    /// Takes a free block for new content (evicting its cached hash, if it had one); `None` when
    /// every block is held.
    pub fn allocate(&mut self) -> Option<BlockId> {
        let b = self.head;
        if b == NIL {
            return None;
        }
        self.unlink(b);
        if let Some(h) = self.hash[b as usize].take() {
            self.cached.remove(&h);
            self.evictions += 1;
            self.log(CacheEvent::Removed(h));
        }
        self.ref_count[b as usize] = 1;
        Some(b)
    }

    /// Takes `n` blocks or none (all-or-nothing).
    pub fn allocate_n(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if n > self.num_free {
            return None;
        }
        Some((0..n).map(|_| self.allocate().expect("num_free counted them")).collect())
    }

    /// Adds a holder to `block` (a prefix-cache hit); takes it off the free list if it was there.
    pub fn retain(&mut self, block: BlockId) {
        let i = block as usize;
        if self.ref_count[i] == 0 {
            self.unlink(block);
        }
        self.ref_count[i] += 1;
    }

    /// Drops a holder of `block`; with none left it goes to the free list's tail, keeping its
    /// cached hash (most recently freed = last evicted).
    pub fn release(&mut self, block: BlockId) {
        let i = block as usize;
        assert!(self.ref_count[i] > 0, "release of free block {block}: double free. This is a bug.");
        self.ref_count[i] -= 1;
        if self.ref_count[i] == 0 {
            self.push_back(block);
        }
    }

    /// Releases a sequence's blocks, last block first, so that a sequence's tail is evicted
    /// before its (more shareable) head.
    pub fn release_all(&mut self, blocks: &[BlockId]) {
        for &b in blocks.iter().rev() {
            self.release(b);
        }
    }

    /// Records that held `block` now holds the full-block content with `hash`, making it
    /// findable by [`lookup`](Self::lookup). If another block already caches that content, the
    /// map keeps the existing one (this block stays uncached; both hold identical KV).
    pub fn cache_full_block(&mut self, block: BlockId, hash: u64) {
        debug_assert!(self.ref_count[block as usize] > 0, "caching a free block");
        if self.hash[block as usize].is_some() || self.cached.contains_key(&hash) {
            return;
        }
        self.hash[block as usize] = Some(hash);
        self.cached.insert(hash, block);
        self.log(CacheEvent::Stored(hash));
    }

    /// Starts (or stops) logging cache changes for [`drain_events`](Self::drain_events).
    pub fn log_events(&mut self, on: bool) {
        self.events = on.then(Vec::new);
        self.overflowed = false;
    }

    fn log(&mut self, event: CacheEvent) {
        if let Some(log) = &mut self.events {
            if log.len() >= MAX_LOGGED_EVENTS {
                log.clear();
                self.overflowed = true;
            } else if !self.overflowed {
                log.push(event);
            }
        }
    }

    /// The changes since the last drain, in order; `None` when some were dropped (the log
    /// outgrew [`MAX_LOGGED_EVENTS`]): read [`cached_hashes`](Self::cached_hashes) instead.
    pub fn drain_events(&mut self) -> Option<Vec<CacheEvent>> {
        let log = self.events.as_mut()?;
        let events = std::mem::take(log);
        if std::mem::take(&mut self.overflowed) {
            return None;
        }
        Some(events)
    }

    /// Every hash the cache holds now (held or free blocks), in no particular order.
    pub fn cached_hashes(&self) -> Vec<u64> {
        self.cached.keys().copied().collect()
    }

    /// Cached blocks (held or free).
    pub fn num_cached(&self) -> usize {
        self.cached.len()
    }

    /// Verifies every invariant in the module docs; panics with a description on violation.
    pub fn check_invariants(&self) {
        let mut free_seen = 0;
        let mut b = self.head;
        let mut last = NIL;
        while b != NIL {
            assert!(self.on_free_list[b as usize], "block {b} linked but not flagged free");
            assert_eq!(self.ref_count[b as usize], 0, "block {b} on free list but held");
            assert_eq!(self.prev[b as usize], last, "broken back link at {b}");
            free_seen += 1;
            assert!(free_seen <= self.num_blocks(), "free list has a cycle");
            last = b;
            b = self.next[b as usize];
        }
        assert_eq!(last, self.tail, "tail mismatch");
        assert_eq!(free_seen, self.num_free, "free count mismatch");
        for (i, &rc) in self.ref_count.iter().enumerate() {
            assert_eq!(rc == 0, self.on_free_list[i], "block {i}: ref {rc} vs free flag");
            if let Some(h) = self.hash[i] {
                assert_eq!(self.cached.get(&h), Some(&(i as u32)), "block {i} hash not mapped back");
            }
        }
        for (h, &b) in &self.cached {
            assert_eq!(self.hash[b as usize], Some(*h), "map entry {h:x} → {b} not on block");
        }
    }

    fn push_back(&mut self, b: BlockId) {
        let i = b as usize;
        debug_assert!(!self.on_free_list[i]);
        self.prev[i] = self.tail;
        self.next[i] = NIL;
        if self.tail == NIL {
            self.head = b;
        } else {
            self.next[self.tail as usize] = b;
        }
        self.tail = b;
        self.on_free_list[i] = true;
        self.num_free += 1;
    }

    fn unlink(&mut self, b: BlockId) {
        let i = b as usize;
        debug_assert!(self.on_free_list[i]);
        let (p, n) = (self.prev[i], self.next[i]);
        if p == NIL { self.head = n } else { self.next[p as usize] = n }
        if n == NIL { self.tail = p } else { self.prev[n as usize] = p }
        self.prev[i] = NIL;
        self.next[i] = NIL;
        self.on_free_list[i] = false;
        self.num_free -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn freed_cached_blocks_are_reused_by_hash_until_evicted_lru() {
        let mut m = BlockManager::new(3);
        let a = m.allocate().unwrap();
        m.cache_full_block(a, 11);
        m.release(a);
        assert_eq!(m.num_free(), 3);
        assert_eq!(m.lookup(11), Some(a), "free block keeps its cached content");
        m.retain(a);
        assert_eq!(m.ref_count(a), 1);
        assert_eq!(m.num_free(), 2);
        m.release(a);
        // The two never-used blocks are handed out before the cached one.
        let x = m.allocate().unwrap();
        let y = m.allocate().unwrap();
        assert!(x != a && y != a);
        assert_eq!(m.lookup(11), Some(a));
        let z = m.allocate().unwrap();
        assert_eq!(z, a);
        assert_eq!(m.lookup(11), None, "allocation evicted the cached hash");
        assert_eq!(m.evictions, 1);
        assert!(m.allocate().is_none());
        m.check_invariants();
    }

    #[test]
    fn logged_events_follow_the_cache_and_an_overflow_says_so() {
        let mut m = BlockManager::new(2);
        assert_eq!(m.drain_events(), None, "not logging");
        m.log_events(true);
        let a = m.allocate().unwrap();
        m.cache_full_block(a, 7);
        m.cache_full_block(a, 8); // already cached: no event
        m.release(a);
        let _b = m.allocate().unwrap();
        let again = m.allocate().unwrap();
        assert_eq!(again, a);
        assert_eq!(
            m.drain_events(),
            Some(vec![CacheEvent::Stored(7), CacheEvent::Removed(7)])
        );
        assert_eq!(m.drain_events(), Some(vec![]));
        m.release(again);
        for i in 0..=MAX_LOGGED_EVENTS as u64 / 2 {
            let b = m.allocate().unwrap();
            m.cache_full_block(b, 100 + i);
            m.release(b);
        }
        assert_eq!(m.drain_events(), None, "overflowed");
        assert_eq!(m.cached_hashes().len(), m.num_cached());
        assert_eq!(m.drain_events(), Some(vec![]), "logging goes on after an overflow");
    }

    #[test]
    #[should_panic(expected = "double free")]
    fn double_release_is_caught() {
        let mut m = BlockManager::new(2);
        let a = m.allocate().unwrap();
        m.release(a);
        m.release(a);
    }
}
