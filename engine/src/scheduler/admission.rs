//! Admission: how sequences enter the scheduler and move from waiting to running.
//!
//! [`Scheduler::add`] queues a new sequence, or refuses it with a typed error if it could never
//! run; [`Scheduler::add_prefilled`] queues one whose first tokens already have KV (received from
//! a prefill node) at the front of its class, ahead of new work. [`Scheduler::wait_hint`] is the
//! wait window that lets a first batch gather before a step.
//!
//! In each step that preempted nothing, waiting sequences are admitted: batch sequences that
//! have waited `batch_aging` first (strict priority with aging: batch work is never starved),
//! then interactive before batch, first-come first-served within a class, preferring (among the
//! first 16 of a queue) sequences in the same length bucket of the class as the class's first
//! one admitted this step, reusing cached prefix blocks where the prefix cache has them. Each
//! class has its own wait window and buckets ([`super::ClassPolicy`]). Admission stops, keeping queue order, at the first sequence
//! whose blocks are not free, or when `max_num_seqs` run or the step's token budget is spent.
//!
//! # Invariants
//! - A request is queued only if prompt + max new tokens fit `max_model_len` and the whole pool:
//!   with preemption never taking the highest-priority oldest sequence, it always completes.
//! - An admission that does not fit changes nothing: the prefix-cache hits it retained are
//!   released again and the sequence stays where it was in its queue.
//! - A prefix-cache match never covers a sequence's last token: it must run to give logits.

use std::time::{Duration, Instant};

use super::{Priority, ScheduledChunk, Scheduler, Sequence, class};
use crate::error::EngineError;
use crate::kv::BlockId;

impl Scheduler {
    /// Queues a new sequence, or refuses it with a typed error if it could never run.
    pub fn add(
        &mut self,
        seq_id: u64,
        prompt: Vec<u32>,
        max_new_tokens: usize,
        priority: Priority,
        now: Instant,
    ) -> Result<(), EngineError> {
        if self.seqs.contains_key(&seq_id) {
            return Err(EngineError::DuplicateRequest(seq_id));
        }
        if prompt.is_empty() {
            return Err(EngineError::InvalidRequest {
                field: "prompt",
                value: "\"\"".into(),
                reason: "the prompt must contain at least one token".into(),
            });
        }
        let total = prompt.len() + max_new_tokens;
        if total > self.cfg.max_model_len {
            return Err(EngineError::ContextOverflow {
                prompt_tokens: prompt.len(),
                max_new_tokens,
                max_context_tokens: self.cfg.max_model_len,
            });
        }
        let required_blocks = self.blocks_for(total);
        if required_blocks > self.blocks.num_blocks() {
            return Err(EngineError::NeverFits { required_blocks, total_blocks: self.blocks.num_blocks() });
        }
        if self.num_waiting() >= self.cfg.max_waiting {
            return Err(EngineError::QueueFull { capacity: self.cfg.max_waiting });
        }
        self.insert_new(seq_id, priority, now, prompt, 0, Vec::new());
        self.waiting[class(priority)].push_back(seq_id);
        Ok(())
    }

    /// Inserts a new, not yet queued sequence (the next arrival number) whose first
    /// `num_computed` tokens already have KV in `blocks`.
    fn insert_new(
        &mut self,
        seq_id: u64,
        priority: Priority,
        now: Instant,
        tokens: Vec<u32>,
        num_computed: usize,
        blocks: Vec<BlockId>,
    ) {
        let arrival = self.next_arrival;
        self.next_arrival += 1;
        self.seqs.insert(
            seq_id,
            Sequence {
                priority,
                arrival,
                arrived_at: now,
                tokens,
                num_computed,
                blocks,
                block_hashes: Vec::new(),
                cached_tokens: 0,
                preemptions: 0,
                running: false,
            },
        );
    }

    /// Queues a sequence whose first `computed` tokens already have KV in `blocks` (received from
    /// a prefill node). It is admitted ahead of new work of its class; if it is ever preempted it
    /// is recomputed from scratch like any other (same output: the kernels are batch-invariant).
    pub fn add_prefilled(
        &mut self,
        seq_id: u64,
        tokens: Vec<u32>,
        computed: usize,
        blocks: Vec<BlockId>,
        priority: Priority,
        now: Instant,
    ) -> Result<(), EngineError> {
        if self.seqs.contains_key(&seq_id) {
            return Err(EngineError::DuplicateRequest(seq_id));
        }
        assert!(
            computed > 0 && computed < tokens.len() && blocks.len() * self.block_size >= computed,
            "prefilled sequence: {computed} computed of {} tokens in {} blocks. This is a bug.",
            tokens.len(),
            blocks.len()
        );
        self.insert_new(seq_id, priority, now, tokens, computed, blocks);
        self.waiting[class(priority)].push_front(seq_id);
        Ok(())
    }

    /// How long the caller should wait before the next step to gather a batch (the wait window
    /// of each class with waiters, the earliest deadline), or `None` to step now (or nothing to
    /// do). A class whose window is 0 steps at once.
    pub fn wait_hint(&self, now: Instant) -> Option<Duration> {
        if !self.running.is_empty() {
            return None;
        }
        let (mut deadline, mut tokens, mut n) = (None::<Instant>, 0usize, 0usize);
        for (c, queue) in self.waiting.iter().enumerate() {
            let window = self.cfg.classes[c].max_wait;
            for s in queue.iter().map(|id| &self.seqs[id]) {
                let d = s.arrived_at + window;
                deadline = Some(deadline.map_or(d, |o: Instant| o.min(d)));
                tokens += s.tokens.len();
                n += 1;
            }
        }
        let deadline = deadline?;
        if tokens >= self.cfg.max_tokens_per_step || n >= self.cfg.max_num_seqs {
            return None;
        }
        (deadline > now).then(|| deadline - now)
    }

    /// Class `c`'s bucket of a sequence with `tokens` tokens left to compute.
    fn bucket(&self, c: usize, tokens: usize) -> usize {
        let b = &self.buckets[c];
        b.iter().position(|&bound| tokens <= bound).unwrap_or(b.len())
    }

    /// Admits waiting sequences into the step (after the running ones took their share of
    /// `budget`), appending their first chunks to `chunks`: batch sequences waiting since
    /// `batch_aging` before `now` first, then interactive, then batch.
    pub(super) fn admit_waiting(
        &mut self,
        mut budget: usize,
        mut prefill_budget: usize,
        now: Instant,
        chunks: &mut Vec<ScheduledChunk>,
    ) {
        let mut head_bucket = [None, None];
        let aging = self.cfg.batch_aging;
        let aged = |s: &Scheduler| {
            s.waiting[1].front().is_some_and(|id| now.saturating_duration_since(s.seqs[id].arrived_at) >= aging)
        };
        // (class, only the aged head): the aged batch sequences, then each class in order.
        'passes: for (c, aged_only) in [(1, true), (0, false), (1, false)] {
            while self.running.len() < self.cfg.max_num_seqs
                && budget > 0
                && !self.waiting[c].is_empty()
                && (!aged_only || aged(self))
            {
                let mut pick = if aged_only { 0 } else { self.pick_waiting(c, head_bucket[c]) };
                if prefill_budget == 0 && self.left(self.waiting[c][pick]) > 1 {
                    // No prompt can run this step: a sequence that arrived with its KV (one
                    // token to run) may still join; the prompts keep their order.
                    match self.waiting[c].iter().take(16).position(|&id| self.left(id) == 1) {
                        Some(p) => pick = p,
                        None => break 'passes,
                    }
                }
                let id = self.waiting[c][pick];
                let decoding = self.left(id) == 1;
                let cap = if decoding { budget } else { budget.min(prefill_budget) };
                match self.try_admit(id, cap) {
                    Some(chunk) => {
                        self.waiting[c].remove(pick);
                        head_bucket[c].get_or_insert(self.bucket(c, chunk.len));
                        budget -= chunk.len;
                        if !decoding {
                            prefill_budget -= chunk.len;
                        }
                        chunks.push(chunk);
                    }
                    None => break 'passes, // no room: keep order, stop admitting
                }
            }
        }
        self.sort_running();
    }

    /// Index in waiting queue `c` of the next sequence to admit: the first one in `bucket` among
    /// the first 16, else the head.
    fn pick_waiting(&self, c: usize, bucket: Option<usize>) -> usize {
        let Some(b) = bucket else { return 0 };
        self.waiting[c]
            .iter()
            .take(16)
            .position(|id| {
                let s = &self.seqs[id];
                self.bucket(c, s.tokens.len() - s.num_computed) == b
            })
            .unwrap_or(0)
    }

    /// Allocates a first chunk for waiting sequence `id` (after prefix-cache reuse), or `None`
    /// (changing nothing) when the blocks are not there.
    fn try_admit(&mut self, id: u64, budget: usize) -> Option<ScheduledChunk> {
        let bs = self.block_size;
        let caching = self.cfg.enable_prefix_caching;
        let s = self.seqs.get_mut(&id).expect("waiting id is known");
        if s.num_computed > 0 {
            // Arrived with its KV (decode node): it already holds blocks for what was computed.
            let (computed, len, held) = (s.num_computed, s.tokens.len(), s.blocks.len());
            let n = (len - computed).min(budget);
            let need = (computed + n).div_ceil(bs).saturating_sub(held);
            let fresh = self.blocks.allocate_n(need)?;
            let s = self.seqs.get_mut(&id).expect("waiting id is known");
            s.blocks.extend(fresh);
            s.running = true;
            self.running.push(id);
            return Some(ScheduledChunk { seq_id: id, first_pos: computed, len: n, want_logits: computed + n == len });
        }
        debug_assert!(s.blocks.is_empty());
        // Hashes of the full blocks, never covering the last token (it must run to give logits).
        let full = (s.tokens.len() - 1) / bs;
        if caching {
            s.extend_hashes(full, bs);
        }
        let hits = if caching { self.blocks.match_prefix(&s.block_hashes[..full.min(s.block_hashes.len())]) } else { vec![] };
        for &b in &hits {
            self.blocks.retain(b);
        }
        let computed = hits.len() * bs;
        let len = s.tokens.len();
        let n = (len - computed).min(budget);
        let need = (computed + n).div_ceil(bs) - hits.len();
        let Some(fresh) = self.blocks.allocate_n(need) else {
            self.blocks.release_all(&hits);
            return None;
        };
        let s = self.seqs.get_mut(&id).expect("waiting id is known");
        if s.preemptions == 0 {
            s.cached_tokens = computed;
        }
        s.blocks = hits;
        s.blocks.extend(fresh);
        s.num_computed = computed;
        s.running = true;
        self.running.push(id);
        Some(ScheduledChunk { seq_id: id, first_pos: computed, len: n, want_logits: computed + n == len })
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use crate::error::EngineError;
    use crate::scheduler::tests::{run_step, sched};
    use crate::scheduler::{ClassPolicy, Priority, Scheduler, SchedulerConfig};

    #[test]
    fn interactive_is_admitted_before_batch() {
        let mut s = sched(64, 4);
        let now = Instant::now();
        s.add(1, vec![1; 4], 4, Priority::Batch, now).unwrap();
        s.add(2, vec![2; 4], 4, Priority::Interactive, now).unwrap();
        assert_eq!(run_step(&mut s).chunks[0].seq_id, 2);
    }

    #[test]
    fn requests_that_can_never_fit_are_refused_up_front() {
        let mut s = sched(4, 64);
        let err = s.add(1, vec![1; 10], 10, Priority::Interactive, Instant::now()).unwrap_err();
        assert!(matches!(err, EngineError::NeverFits { required_blocks: 5, total_blocks: 4 }));
        assert!(s.is_idle());
        let err = s.add(2, vec![], 1, Priority::Interactive, Instant::now()).unwrap_err();
        assert!(matches!(err, EngineError::InvalidRequest { field: "prompt", .. }));
    }

    #[test]
    fn a_shared_prefix_is_served_from_cached_blocks() {
        let mut s = sched(64, 64);
        let now = Instant::now();
        let prompt: Vec<u32> = (0..13).collect();
        s.add(1, prompt.clone(), 2, Priority::Interactive, now).unwrap();
        run_step(&mut s);
        s.add(2, prompt.clone(), 2, Priority::Interactive, now).unwrap();
        let out = run_step(&mut s);
        let c2 = out.chunks.iter().find(|c| c.seq_id == 2).unwrap();
        assert_eq!(c2.first_pos, 12, "three full blocks reused");
        assert_eq!(s.cached_tokens(2), 12);
        assert_eq!(s.block_table(1).unwrap()[..3], s.block_table(2).unwrap()[..3]);
    }

    fn windows(interactive_ms: u64, batch_ms: u64) -> SchedulerConfig {
        SchedulerConfig {
            classes: [
                ClassPolicy { max_wait: Duration::from_millis(interactive_ms), length_buckets: vec![] },
                ClassPolicy { max_wait: Duration::from_millis(batch_ms), length_buckets: vec![] },
            ],
            ..Default::default()
        }
    }

    #[test]
    fn wait_window_holds_a_small_first_batch_until_it_expires() {
        let mut s = Scheduler::new(windows(5, 5), 64, 4).unwrap();
        let t0 = Instant::now();
        s.add(1, vec![1; 4], 4, Priority::Interactive, t0).unwrap();
        assert_eq!(s.wait_hint(t0), Some(Duration::from_millis(5)));
        assert_eq!(s.wait_hint(t0 + Duration::from_millis(5)), None);
    }

    #[test]
    fn each_class_has_its_own_wait_window() {
        let mut s = Scheduler::new(windows(0, 20), 64, 4).unwrap();
        let t0 = Instant::now();
        s.add(1, vec![1; 4], 4, Priority::Batch, t0).unwrap();
        assert_eq!(s.wait_hint(t0), Some(Duration::from_millis(20)), "batch waits for company");
        let t1 = t0 + Duration::from_millis(3);
        s.add(2, vec![2; 4], 4, Priority::Interactive, t1).unwrap();
        assert_eq!(s.wait_hint(t1), None, "an interactive arrival steps at once");
    }

    #[test]
    fn batch_work_waiting_past_its_aging_goes_before_interactive_work() {
        // One sequence a step (budget 4): interactive first while the batch one is young.
        let cfg = SchedulerConfig { max_tokens_per_step: 4, batch_aging: Duration::from_secs(2), ..Default::default() };
        let mut s = Scheduler::new(cfg, 64, 4).unwrap();
        let t0 = Instant::now();
        s.add(1, vec![1; 4], 4, Priority::Batch, t0).unwrap();
        s.add(2, vec![2; 4], 4, Priority::Interactive, t0).unwrap();
        s.add(3, vec![3; 4], 4, Priority::Interactive, t0).unwrap();
        let first = s.schedule(t0 + Duration::from_millis(10));
        assert_eq!(first.chunks[0].seq_id, 2, "strict priority while the batch request is young");
        s.remove(2);
        let later = s.schedule(t0 + Duration::from_secs(2));
        assert_eq!(later.chunks[0].seq_id, 1, "aged: ahead of the waiting interactive request");
    }

    #[test]
    fn length_buckets_derive_from_the_context_length_unless_set() {
        assert_eq!(ClassPolicy::interactive().length_buckets_for(Priority::Interactive, 8192), [128, 512, 2048]);
        assert_eq!(ClassPolicy::batch().length_buckets_for(Priority::Batch, 8192), [512, 2048]);
        assert_eq!(ClassPolicy::interactive().length_buckets_for(Priority::Interactive, 2048), [32, 128, 512]);
        let own = ClassPolicy { max_wait: Duration::ZERO, length_buckets: vec![64, 256] };
        assert_eq!(own.length_buckets_for(Priority::Interactive, 8192), [64, 256]);
        let bad = SchedulerConfig {
            classes: [ClassPolicy { max_wait: Duration::ZERO, length_buckets: vec![256, 64] }, ClassPolicy::batch()],
            ..Default::default()
        };
        assert!(matches!(bad.validate(), Err(EngineError::InvalidConfig { field: "length_buckets", .. })));
    }
}
