//! Continuous batching: which tokens of which sequences run in the next step.
//!
//! Each step has a token budget. Running sequences go first (highest priority, oldest first):
//! a decoding sequence takes one token, a sequence still prefilling takes the next chunk of its
//! prompt (chunked prefill). If a running sequence needs a block and none is free, the
//! lowest-priority, most recently admitted running sequence is **preempted by recompute**: its
//! blocks are released and it returns to the front of its waiting queue with its generated tokens
//! appended to its prompt, to be re-prefilled later (the kernels are batch-invariant, so the
//! recomputed KV, and hence the output, is bitwise what it would have been).
//! Then, if nothing was preempted, waiting sequences are admitted: batch sequences that have
//! waited `batch_aging` first (aging: batch work is never starved), then interactive before
//! batch, first-come first-served within a class, preferring sequences in the same length bucket
//! (the class's own, [`ClassPolicy`]) as the class's first one admitted this step, reusing cached
//! prefix blocks where the prefix cache has them.
//!
//! # Invariants
//! - No deadlock: a request is admitted only if prompt + max new tokens fit the whole pool, and
//!   the highest-priority oldest sequence is never preempted by another, so it always completes.
//! - Every block a sequence holds is released exactly once: on finish, abort or preemption.
//! - `free + held == total` after any sequence of calls (asserted by the seeded tests).
//!
//! The scheduler is synchronous and deterministic: time is passed in (`now`), never read.
//!
//! | file | holds |
//! |---|---|
//! | `mod.rs` | the types, [`Scheduler::schedule`] (running sequences, then admission), chunk completion, removal, reservations, queries, invariant checks |
//! | `admission.rs` | `add` / `add_prefilled`, the wait window, waiting → running (buckets, prefix-cache reuse) |
//! | `preemption.rs` | preemption by recompute: victim choice, releasing its blocks, requeueing it |

mod admission;
mod preemption;

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::error::EngineError;
use crate::kv::{BlockId, BlockManager, hash_block};

/// Priority class of a request: interactive traffic is always scheduled before batch traffic.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Priority {
    /// Latency-sensitive requests (chat, completions): the default.
    #[default]
    Interactive,
    /// Throughput requests (offline jobs); preempted first.
    Batch,
}

impl Priority {
    /// Stable label for logs and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Priority::Interactive => "interactive",
            Priority::Batch => "batch",
        }
    }
}

/// Scheduling knobs.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SchedulerConfig {
    /// Sequences running at once.
    pub max_num_seqs: usize,
    /// Tokens computed per step (prefill chunks + decode tokens).
    pub max_tokens_per_step: usize,
    /// Requests waiting to be admitted; more are refused with `QueueFull`.
    pub max_waiting: usize,
    /// How each priority class is batched: interactive, then batch.
    pub classes: [ClassPolicy; 2],
    /// A batch request that has waited this long is admitted ahead of interactive ones, so a
    /// constant interactive load never starves batch work.
    pub batch_aging: Duration,
    /// Reuse KV of full blocks whose chained hash matches an earlier request's.
    pub enable_prefix_caching: bool,
    /// Longest sequence (prompt + output) accepted.
    pub max_model_len: usize,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            max_num_seqs: 64,
            max_tokens_per_step: 512,
            max_waiting: 1024,
            classes: [ClassPolicy::interactive(), ClassPolicy::batch()],
            batch_aging: Duration::from_secs(2),
            enable_prefix_caching: true,
            max_model_len: 8192,
        }
    }
}

/// How one priority class is batched (an SLO class: latency for interactive, throughput for
/// batch).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClassPolicy {
    /// When idle, wait up to this long after the class's oldest waiting arrival before a step,
    /// so requests arriving together share it (0 = step at once).
    pub max_wait: Duration,
    /// Upper bounds (tokens) of the prompt-length buckets the class's admissions are grouped
    /// by; empty: derived from `max_model_len` ([`ClassPolicy::length_buckets_for`]).
    pub length_buckets: Vec<usize>,
}

impl ClassPolicy {
    /// Interactive defaults: no wait window, buckets derived from the context length.
    pub fn interactive() -> Self {
        ClassPolicy { max_wait: Duration::ZERO, length_buckets: Vec::new() }
    }

    /// Batch defaults: a 20 ms window (throughput over latency), buckets derived from the
    /// context length.
    pub fn batch() -> Self {
        ClassPolicy { max_wait: Duration::from_millis(20), length_buckets: Vec::new() }
    }

    /// The buckets this class uses under `max_model_len`: its own, or derived from the context
    /// length: interactive `max_model_len / 64, / 16, / 4` (128, 512, 2048 at 8,192), batch
    /// the coarser `/ 16, / 4`; bounds under 16 tokens are dropped.
    pub fn length_buckets_for(&self, priority: Priority, max_model_len: usize) -> Vec<usize> {
        if !self.length_buckets.is_empty() {
            return self.length_buckets.clone();
        }
        let divisors: &[usize] = match priority {
            Priority::Interactive => &[64, 16, 4],
            Priority::Batch => &[16, 4],
        };
        let mut b: Vec<usize> = divisors.iter().map(|d| max_model_len / d).filter(|&n| n >= 16).collect();
        b.dedup();
        b
    }
}

impl SchedulerConfig {
    /// Rejects values that would stall the scheduler.
    pub fn validate(&self) -> Result<(), EngineError> {
        for (class, c) in ["interactive", "batch"].iter().zip(&self.classes) {
            if c.length_buckets.windows(2).any(|w| w[0] >= w[1]) || c.length_buckets.contains(&0) {
                return Err(EngineError::InvalidConfig {
                    field: "length_buckets",
                    value: format!("{class}: {:?}", c.length_buckets),
                    reason: "bounds must be positive and increasing".into(),
                });
            }
        }
        for (field, v) in [
            ("max_num_seqs", self.max_num_seqs),
            ("max_tokens_per_step", self.max_tokens_per_step),
            ("max_waiting", self.max_waiting),
            ("max_model_len", self.max_model_len),
        ] {
            if v == 0 {
                return Err(EngineError::InvalidConfig { field, value: "0".into(), reason: "must be > 0".into() });
            }
        }
        Ok(())
    }
}

/// A piece of work for the next forward pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScheduledChunk {
    /// The sequence.
    pub seq_id: u64,
    /// Position of the chunk's first token.
    pub first_pos: usize,
    /// Tokens in the chunk.
    pub len: usize,
    /// True when the chunk ends at the sequence's last token, so its logits give the next token.
    pub want_logits: bool,
}

/// What one call to [`Scheduler::schedule`] decided.
#[derive(Debug, Default)]
pub struct SchedulerOutput {
    /// Work for this step, running sequences first.
    pub chunks: Vec<ScheduledChunk>,
    /// Sequences preempted (moved back to waiting) by this step.
    pub preempted: Vec<u64>,
}

#[derive(Debug)]
struct Sequence {
    priority: Priority,
    arrival: u64,
    arrived_at: Instant,
    tokens: Vec<u32>,
    /// Tokens whose KV is in the cache.
    num_computed: usize,
    blocks: Vec<BlockId>,
    /// Chained hashes of the leading full blocks (prefix caching).
    block_hashes: Vec<u64>,
    /// Prompt tokens served from the prefix cache at (first) admission.
    cached_tokens: usize,
    preemptions: u32,
    running: bool,
}

impl Sequence {
    /// Extends the chained block hashes to cover the first `full` blocks.
    fn extend_hashes(&mut self, full: usize, bs: usize) {
        while self.block_hashes.len() < full {
            let j = self.block_hashes.len();
            let prev = j.checked_sub(1).map_or(0, |p| self.block_hashes[p]);
            self.block_hashes.push(hash_block(prev, &self.tokens[j * bs..(j + 1) * bs]));
        }
    }
}

/// The continuous-batching scheduler and the block manager it drives.
#[derive(Debug)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    /// Each class's length buckets (its own, or derived from `max_model_len`).
    buckets: [Vec<usize>; 2],
    blocks: BlockManager,
    block_size: usize,
    seqs: HashMap<u64, Sequence>,
    waiting: [VecDeque<u64>; 2],
    running: Vec<u64>,
    next_arrival: u64,
    /// Prompt tokens one step may compute beyond the decode tokens (`None`: only
    /// `max_tokens_per_step` bounds them); set at run time ([`Scheduler::set_prefill_token_cap`]).
    prefill_cap: Option<usize>,
}

fn class(p: Priority) -> usize {
    match p {
        Priority::Interactive => 0,
        Priority::Batch => 1,
    }
}

impl Scheduler {
    /// A scheduler over `num_blocks` KV blocks of `block_size` tokens.
    pub fn new(cfg: SchedulerConfig, num_blocks: usize, block_size: usize) -> Result<Self, EngineError> {
        cfg.validate()?;
        let buckets = [Priority::Interactive, Priority::Batch]
            .map(|p| cfg.classes[class(p)].length_buckets_for(p, cfg.max_model_len));
        Ok(Scheduler {
            buckets,
            cfg,
            blocks: BlockManager::new(num_blocks),
            block_size,
            seqs: HashMap::new(),
            waiting: [VecDeque::new(), VecDeque::new()],
            running: Vec::new(),
            next_arrival: 0,
            prefill_cap: None,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// The block manager (read-only: free/used counts, prefix-cache stats).
    pub fn blocks(&self) -> &BlockManager {
        &self.blocks
    }

    /// Starts logging prefix-cache changes ([`BlockManager::log_events`]).
    pub fn log_cache_events(&mut self) {
        self.blocks.log_events(true);
    }

    /// The prefix-cache changes since the last drain ([`BlockManager::drain_events`]).
    pub fn drain_cache_events(&mut self) -> Option<Vec<crate::kv::CacheEvent>> {
        self.blocks.drain_events()
    }

    /// Sequences admitted and running.
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Sequences waiting for admission (new or preempted).
    pub fn num_waiting(&self) -> usize {
        self.waiting[0].len() + self.waiting[1].len()
    }

    /// Prompt tokens not computed yet: every waiting sequence's prompt less the prefix the
    /// cache holds now (it will not be computed), and the rest of every prompt still in chunked
    /// prefill (what a prefill pool's planner sizes against its throughput, and what a router
    /// weighs against recomputing a prefix elsewhere). O(sequences + cached blocks matched).
    pub fn pending_prompt_tokens(&self) -> usize {
        let bs = self.block_size;
        self.seqs
            .values()
            .map(|s| {
                let left = s.tokens.len().saturating_sub(s.num_computed);
                if s.num_computed > 0 || !self.cfg.enable_prefix_caching || left <= 1 {
                    return left;
                }
                // Waiting: count the cached leading blocks out, as admission will.
                let full = (s.tokens.len() - 1) / bs;
                let mut prev = 0;
                let cached = (0..full)
                    .take_while(|&j| {
                        prev = hash_block(prev, &s.tokens[j * bs..(j + 1) * bs]);
                        self.blocks.lookup(prev).is_some()
                    })
                    .count();
                left - cached * bs
            })
            .filter(|&n| n > 1)
            .sum()
    }

    /// True when no sequence is waiting or running.
    pub fn is_idle(&self) -> bool {
        self.seqs.is_empty()
    }

    fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    fn sort_running(&mut self) {
        let seqs = &self.seqs;
        self.running.sort_by_key(|id| (seqs[id].priority, seqs[id].arrival));
    }

    /// Caps the prompt tokens (prefill chunks) a step computes at `cap` (at least 1), or lifts
    /// the cap with `None`. Decode tokens (sequences with one token to run) are not capped, and
    /// under a cap the prefill chunks also leave room in `max_tokens_per_step` for every
    /// decoding sequence: a long prompt never holds back the streams already decoding, and a
    /// step's length stays near what the cap was sized for (a decode node sizes it from its
    /// measured step time).
    pub fn set_prefill_token_cap(&mut self, cap: Option<usize>) {
        self.prefill_cap = cap.map(|c| c.max(1));
    }

    /// Prompt tokens one step may compute now: the cap, or `max_tokens_per_step` without one.
    pub fn prefill_token_cap(&self) -> usize {
        self.prefill_cap.unwrap_or(usize::MAX).min(self.cfg.max_tokens_per_step)
    }

    /// Tokens `id` still has to run (1: it is decoding, or has one prompt token left).
    fn left(&self, id: u64) -> usize {
        let s = &self.seqs[&id];
        s.tokens.len() - s.num_computed
    }

    /// Decides the next step's work at time `now` (batch waiters older than `batch_aging` go
    /// first). Each sequence with one token left takes one; prefill chunks share what is left
    /// of `max_tokens_per_step` and of the prefill cap.
    pub fn schedule(&mut self, now: Instant) -> SchedulerOutput {
        let mut out = SchedulerOutput::default();
        let mut budget = self.cfg.max_tokens_per_step;
        let mut prefill_budget = match self.prefill_cap {
            None => budget,
            Some(cap) => {
                let decoding = self.running.iter().filter(|&&id| self.left(id) == 1).count();
                cap.min(budget.saturating_sub(decoding))
            }
        };

        // 1. Running sequences, in priority/arrival order.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            let (computed, len, held) = {
                let s = &self.seqs[&id];
                (s.num_computed, s.tokens.len(), s.blocks.len())
            };
            let decoding = len - computed == 1;
            let n = if decoding { 1 } else { (len - computed).min(budget).min(prefill_budget) };
            if n == 0 {
                i += 1; // a prompt with no prefill budget left this step
                continue;
            }
            let need = self.blocks_for(computed + n).saturating_sub(held);
            if !self.make_room(need, id, &mut out.preempted) {
                continue; // `id` itself was preempted
            }
            let new_blocks = self.blocks.allocate_n(need).expect("freed enough blocks above");
            let s = self.seqs.get_mut(&id).expect("running id is known");
            s.blocks.extend(new_blocks);
            out.chunks.push(ScheduledChunk { seq_id: id, first_pos: computed, len: n, want_logits: computed + n == len });
            budget -= n;
            if !decoding {
                prefill_budget -= n;
            }
            i += 1;
        }

        // 2. Admit waiting sequences, unless this step had to preempt (no room).
        if out.preempted.is_empty() {
            self.admit_waiting(budget, prefill_budget, now, &mut out.chunks);
        }
        out
    }

    /// Records that `chunk` ran: its KV is cached and, if it produced a token, `sampled` joins
    /// the sequence. Full blocks become findable by the prefix cache.
    pub fn on_chunk_done(&mut self, chunk: &ScheduledChunk, sampled: Option<u32>) {
        let bs = self.block_size;
        let caching = self.cfg.enable_prefix_caching;
        let Some(s) = self.seqs.get_mut(&chunk.seq_id) else { return };
        if !s.running || s.num_computed != chunk.first_pos {
            return; // preempted or aborted in the meantime
        }
        s.num_computed += chunk.len;
        if caching {
            let full = s.num_computed / bs;
            s.extend_hashes(full, bs);
            // Blocks completed before this chunk were registered when they completed.
            for j in chunk.first_pos / bs..full {
                self.blocks.cache_full_block(s.blocks[j], s.block_hashes[j]);
            }
        }
        if let Some(t) = sampled {
            s.tokens.push(t);
        }
    }

    /// Takes `n_tokens` worth of free blocks for KV that will arrive from elsewhere (a decode
    /// node's reservation), or `None` (changing nothing) if they are not free now.
    pub fn reserve_blocks(&mut self, n_tokens: usize) -> Option<Vec<BlockId>> {
        self.blocks.allocate_n(self.blocks_for(n_tokens))
    }

    /// Returns reserved blocks that were never adopted by a sequence.
    pub fn release_blocks(&mut self, blocks: &[BlockId]) {
        self.blocks.release_all(blocks);
    }

    /// Removes a sequence but hands its blocks to the caller instead of releasing them (a prefill
    /// node keeps a finished prompt's KV until it has been pushed). The caller must
    /// [`release_blocks`](Self::release_blocks) them.
    pub fn detach(&mut self, seq_id: u64) -> Option<Vec<BlockId>> {
        let s = self.seqs.remove(&seq_id)?;
        if s.running {
            self.running.retain(|&r| r != seq_id);
        } else {
            self.waiting[class(s.priority)].retain(|&w| w != seq_id);
        }
        Some(s.blocks)
    }

    /// Ends a sequence (finished or aborted), releasing every block it holds. Returns false if
    /// the id is unknown.
    pub fn remove(&mut self, seq_id: u64) -> bool {
        let Some(s) = self.seqs.remove(&seq_id) else { return false };
        self.blocks.release_all(&s.blocks);
        if s.running {
            self.running.retain(|&r| r != seq_id);
        } else {
            self.waiting[class(s.priority)].retain(|&w| w != seq_id);
        }
        true
    }

    /// All tokens of a sequence (prompt, then generated).
    pub fn tokens(&self, seq_id: u64) -> Option<&[u32]> {
        self.seqs.get(&seq_id).map(|s| s.tokens.as_slice())
    }

    /// Physical blocks of a sequence, in position order.
    pub fn block_table(&self, seq_id: u64) -> Option<&[BlockId]> {
        self.seqs.get(&seq_id).map(|s| s.blocks.as_slice())
    }

    /// Prompt tokens that were served from the prefix cache at admission.
    pub fn cached_tokens(&self, seq_id: u64) -> usize {
        self.seqs.get(&seq_id).map_or(0, |s| s.cached_tokens)
    }

    /// Tokens of a sequence whose KV is computed (prefix-cache hits included); 0 when unknown.
    pub fn computed_tokens(&self, seq_id: u64) -> usize {
        self.seqs.get(&seq_id).map_or(0, |s| s.num_computed)
    }

    /// Times a sequence has been preempted.
    pub fn preemptions(&self, seq_id: u64) -> u32 {
        self.seqs.get(&seq_id).map_or(0, |s| s.preemptions)
    }

    /// Panics if block accounting is inconsistent (tests).
    pub fn check_invariants(&self) {
        self.check_invariants_with(&[]);
    }

    /// As [`check_invariants`](Self::check_invariants), counting `outside` (blocks held by
    /// reservations or detached sequences) as holders too.
    pub fn check_invariants_with(&self, outside: &[BlockId]) {
        self.blocks.check_invariants();
        let mut per_block = vec![0u32; self.blocks.num_blocks()];
        for s in self.seqs.values() {
            for &b in &s.blocks {
                per_block[b as usize] += 1;
            }
            assert!(s.blocks.len() * self.block_size >= s.num_computed, "computed tokens without blocks");
        }
        for &b in outside {
            per_block[b as usize] += 1;
        }
        for (b, &n) in per_block.iter().enumerate() {
            assert_eq!(n, self.blocks.ref_count(b as u32), "block {b}: holders vs ref count");
        }
    }
}

#[cfg(test)]
mod tests;
