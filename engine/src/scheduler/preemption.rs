//! Preemption by recompute: what a step does when a running sequence needs a block and none is
//! free.
//!
//! The victim is the last running sequence; `running` is kept in (priority, arrival) order, so
//! that is the lowest-priority, most recently admitted one. Its blocks are released and it
//! returns to the front of its waiting queue with its generated tokens appended to its prompt, to
//! be re-prefilled later (the kernels are batch-invariant, so the recomputed KV, and hence the
//! output, is bitwise what it would have been). A step that preempted admits nothing.
//!
//! # Invariants
//! - The highest-priority oldest sequence is never preempted by another, so it always completes
//!   (no deadlock, given admission's whole-pool check).
//! - A preempted sequence releases every block it holds, once, and restarts from no computed
//!   tokens; prompt tokens it was first served from the prefix cache stay counted.

use super::{Scheduler, class};

impl Scheduler {
    /// Preempts running sequences from the back until `need` blocks are free, recording each in
    /// `preempted`. Returns false if `for_id` itself had to go (it runs nothing this step).
    pub(super) fn make_room(&mut self, need: usize, for_id: u64, preempted: &mut Vec<u64>) -> bool {
        while self.blocks.num_free() < need {
            let victim_idx = self.running.len() - 1;
            let victim = self.running[victim_idx];
            self.preempt(victim_idx);
            preempted.push(victim);
            if victim == for_id {
                return false;
            }
        }
        true
    }

    /// Moves running sequence at `idx` back to the front of its waiting queue, releasing its blocks.
    fn preempt(&mut self, idx: usize) {
        let id = self.running.remove(idx);
        let s = self.seqs.get_mut(&id).expect("running id is known");
        self.blocks.release_all(&s.blocks);
        s.blocks.clear();
        s.num_computed = 0;
        s.running = false;
        s.preemptions += 1;
        self.waiting[class(s.priority)].push_front(id);
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::time::Instant;

    use crate::scheduler::Priority;
    use crate::scheduler::tests::{run_step, sched};

    #[test]
    fn out_of_blocks_preempts_the_newest_and_everything_finishes() {
        let mut s = sched(6, 64);
        let now = Instant::now();
        for id in 0..3 {
            s.add(id, vec![id as u32; 6], 10, Priority::Interactive, now).unwrap();
        }
        let mut generated = HashMap::<u64, usize>::new();
        let mut preempted = 0;
        for _ in 0..500 {
            if s.is_idle() {
                break;
            }
            let out = run_step(&mut s);
            preempted += out.preempted.len();
            for c in out.chunks.iter().filter(|c| c.want_logits) {
                let n = generated.entry(c.seq_id).or_default();
                *n += 1;
                if *n == 10 {
                    assert!(s.remove(c.seq_id));
                }
            }
        }
        assert!(s.is_idle(), "all sequences finish (no deadlock)");
        assert!(preempted > 0, "6 blocks cannot hold three 16-token sequences at once");
        assert_eq!(s.blocks().num_free(), 6, "every block returned");
    }

}
