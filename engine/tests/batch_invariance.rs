//! Same output, any path: greedy tokens of a request are identical whether it runs alone, in a
//! batch of mixed-length requests, with its prefill chunked, after preemption by recompute, or
//! from prefix-cached blocks. The disaggregated and migrated paths of later issues lean on this.

use crate::common;

use common::*;
use tandem_engine::{Engine, KvDtype, Request, SchedulerConfig, WeightDtype};

/// Long enough for batched decode steps to diverge if any kernel's order depended on the batch
/// (every token is compared); short enough for the suite.
const NEW_TOKENS: usize = 32;

/// Eight prompts of mixed lengths (real text, so greedy continuations are non-trivial).
fn mixed_prompts(engine: &Engine) -> Vec<Vec<u32>> {
    let tok = engine.tokenizer().unwrap();
    let base = "Paged attention stores the key and value cache in fixed-size blocks, so memory is \
                allocated on demand and shared between sequences with a common prefix. ";
    (0..8)
        .map(|i| {
            let mut text = format!("Note {i}: ");
            for _ in 0..(1 + i * 3) {
                text.push_str(base);
            }
            text.push_str("In short,");
            tok.encode(&text)
        })
        .collect()
}

fn alone(engine: &mut Engine, prompts: &[Vec<u32>]) -> Vec<Vec<u32>> {
    prompts
        .iter()
        .enumerate()
        .map(|(i, p)| run(engine, vec![greedy(100 + i as u64, p.clone(), NEW_TOKENS)]).remove(0).tokens)
        .collect()
}

fn batched(engine: &mut Engine, prompts: &[Vec<u32>], id0: u64) -> Vec<Vec<u32>> {
    let reqs: Vec<Request> = prompts.iter().enumerate().map(|(i, p)| greedy(id0 + i as u64, p.clone(), NEW_TOKENS)).collect();
    run(engine, reqs).into_iter().map(|c| c.tokens).collect()
}

fn check(dtype: WeightDtype, kv: KvDtype) {
    let mut cfg = config(kv, 512);
    cfg.scheduler.enable_prefix_caching = false;
    let mut e = engine(dtype, cfg);
    let prompts = mixed_prompts(&e);
    assert!(prompts.iter().map(|p| p.len()).max().unwrap() > 300, "prompts span several blocks and chunks");
    let solo = alone(&mut e, &prompts);
    let together = batched(&mut e, &prompts, 200);
    for (i, (a, b)) in solo.iter().zip(&together).enumerate() {
        assert_eq!(a, b, "prompt {i} ({} tokens): alone vs batch of 8 ({dtype:?} weights, {kv} KV)", prompts[i].len());
    }
}

#[test]
fn greedy_tokens_are_identical_alone_and_in_a_batch_of_8_f32() {
    check(WeightDtype::F32, KvDtype::F32);
}

#[test]
fn greedy_tokens_are_identical_alone_and_in_a_batch_of_8_f16_weights_f16_kv() {
    check(WeightDtype::F16, KvDtype::F16);
}

#[test]
fn chunked_prefill_preemption_and_prefix_hits_do_not_change_output() {
    // Reference: alone, big budget, no prefix caching.
    let mut cfg = config(KvDtype::F32, 512);
    cfg.scheduler.enable_prefix_caching = false;
    let mut e = engine(WeightDtype::F32, cfg);
    let prompts: Vec<Vec<u32>> = mixed_prompts(&e).into_iter().step_by(2).collect();
    let solo = alone(&mut e, &prompts);
    drop(e);

    // Tiny token budget (prefill in 13-token chunks, not block aligned) and a pool so small that
    // four sequences cannot all hold their blocks: forces chunking and preemption by recompute.
    let total_tokens: usize = prompts.iter().map(|p| p.len() + NEW_TOKENS).sum();
    let max_single = prompts.iter().map(|p| (p.len() + NEW_TOKENS).div_ceil(16)).max().unwrap();
    let blocks = max_single + 2;
    assert!(blocks * 16 < total_tokens);
    let mut cfg = config(KvDtype::F32, blocks);
    cfg.scheduler = SchedulerConfig { max_tokens_per_step: 13, ..cfg.scheduler };
    let mut e = engine(WeightDtype::F32, cfg);
    let squeezed = batched(&mut e, &prompts, 300);
    assert!(e.stats().preemptions > 0, "the small pool must force preemption");
    assert_eq!(solo, squeezed, "chunked + preempted output differs");
    assert_eq!(e.scheduler().blocks().num_free(), blocks, "every block returned");

    // Prefix caching: run the same prompts again; their full blocks come from the cache.
    let mut cfg = config(KvDtype::F32, 512);
    cfg.scheduler.enable_prefix_caching = true;
    let mut e = engine(WeightDtype::F32, cfg);
    let first = batched(&mut e, &prompts, 400);
    let again = e.generate(
        prompts.iter().enumerate().map(|(i, p)| greedy(500 + i as u64, p.clone(), NEW_TOKENS)).collect(),
        |_| {},
    ).unwrap();
    assert!(again.iter().all(|c| c.usage.cached_tokens > 0), "second run hit the prefix cache");
    assert_eq!(first, solo);
    assert_eq!(again.into_iter().map(|c| c.tokens).collect::<Vec<_>>(), solo, "prefix-cache hits changed output");
}
