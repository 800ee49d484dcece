//! The scheduler's unit tests (helpers shared with the submodules' tests).

use super::*;

/// A scheduler over `blocks` blocks of 4 tokens with a `budget`-token step (shared by the
/// submodules' tests).
pub(super) fn sched(blocks: usize, budget: usize) -> Scheduler {
    let cfg = SchedulerConfig { max_tokens_per_step: budget, ..Default::default() };
    Scheduler::new(cfg, blocks, 4).unwrap()
}

/// One step in which every scheduled chunk completes (sampling token 7), then the block
/// accounting check.
pub(super) fn run_step(s: &mut Scheduler) -> SchedulerOutput {
    let out = s.schedule(Instant::now());
    for c in &out.chunks {
        s.on_chunk_done(c, c.want_logits.then_some(7));
    }
    s.check_invariants();
    out
}

#[test]
fn pending_prompt_tokens_count_a_waiting_prompts_cached_prefix_out() {
    let mut s = sched(64, 64);
    s.add(1, (0..21).collect(), 1, Priority::Interactive, Instant::now()).unwrap();
    for _ in 0..3 {
        run_step(&mut s);
    }
    assert_eq!(s.pending_prompt_tokens(), 0, "the first request finished");
    // Its five full blocks (20 tokens) stay cached: a prompt sharing them has 2 left.
    let mut shared: Vec<u32> = (0..20).collect();
    shared.extend([50, 51]);
    s.add(2, shared, 1, Priority::Interactive, Instant::now()).unwrap();
    assert_eq!(s.pending_prompt_tokens(), 2);
    s.add(3, (100..122).collect(), 1, Priority::Interactive, Instant::now()).unwrap();
    assert_eq!(s.pending_prompt_tokens(), 2 + 22);
}

#[test]
fn a_prefill_cap_bounds_prompt_chunks_and_never_holds_back_decoding_streams() {
    let mut s = sched(256, 64);
    let now = Instant::now();
    // Two streams decoding, then a long prompt arrives ahead of... nothing: it is the newest.
    s.add(1, vec![1; 4], 50, Priority::Interactive, now).unwrap();
    s.add(2, vec![2; 4], 50, Priority::Interactive, now).unwrap();
    run_step(&mut s);
    s.set_prefill_token_cap(Some(10));
    assert_eq!(s.prefill_token_cap(), 10);
    s.add(3, (0..100).collect(), 2, Priority::Interactive, now).unwrap();
    let mut prompt_chunks = Vec::new();
    for _ in 0..10 {
        let out = run_step(&mut s);
        let mut decoded: Vec<u64> = out.chunks.iter().filter(|c| c.len == 1).map(|c| c.seq_id).collect();
        decoded.sort();
        assert_eq!(decoded, [1, 2], "both streams decode every step: {out:?}");
        prompt_chunks.extend(out.chunks.iter().filter(|c| c.seq_id == 3).map(|c| c.len));
    }
    assert_eq!(prompt_chunks, [10; 10], "the prompt runs 10 tokens a step");
    // Lifted: the rest of the prompt (0 + 100 - 100 = done, so add another) takes the budget.
    s.set_prefill_token_cap(None);
    assert_eq!(s.prefill_token_cap(), 64);
    s.add(4, (200..300).collect(), 2, Priority::Interactive, now).unwrap();
    let out = run_step(&mut s);
    let c4 = out.chunks.iter().find(|c| c.seq_id == 4).unwrap();
    assert_eq!(c4.len, 64 - 3, "the whole budget but the three decoding streams' tokens");
}

#[test]
fn under_a_spent_prefill_cap_an_arrival_with_its_kv_still_joins() {
    let mut s = sched(256, 64);
    let now = Instant::now();
    s.set_prefill_token_cap(Some(8));
    s.add(1, (0..40).collect(), 2, Priority::Interactive, now).unwrap();
    s.add(2, (100..140).collect(), 2, Priority::Interactive, now).unwrap();
    let out = run_step(&mut s);
    assert_eq!(out.chunks.iter().map(|c| (c.seq_id, c.len)).collect::<Vec<_>>(), [(1, 8)]);
    // A sequence whose prompt was computed elsewhere (a prefill node): 12 tokens with KV,
    // one (the first sampled token) to run; queued behind prompt 2 (as after a preemption).
    let blocks = s.blocks.allocate_n(4).unwrap();
    let mut toks: Vec<u32> = (500..512).collect();
    toks.push(9);
    s.add_prefilled(3, toks, 12, blocks, Priority::Interactive, now).unwrap();
    s.waiting[0].retain(|&id| id != 3);
    s.waiting[0].push_back(3);
    let out = run_step(&mut s);
    let by: Vec<(u64, usize)> = out.chunks.iter().map(|c| (c.seq_id, c.len)).collect();
    assert_eq!(by, [(1, 8), (3, 1)], "the cap went to the running prompt; the arrival with its KV joined; prompt 2 waits");
    assert_eq!(s.waiting[0].iter().copied().collect::<Vec<_>>(), [2]);
}

#[test]
fn long_prompts_are_chunked_to_the_token_budget() {
    let mut s = sched(64, 8);
    s.add(1, (0..20).collect(), 4, Priority::Interactive, Instant::now()).unwrap();
    let lens: Vec<_> = (0..3).map(|_| run_step(&mut s).chunks[0].len).collect();
    assert_eq!(lens, vec![8, 8, 4]);
    let out = run_step(&mut s);
    assert_eq!(out.chunks[0], ScheduledChunk { seq_id: 1, first_pos: 20, len: 1, want_logits: true });
}
