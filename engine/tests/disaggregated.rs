//! The disaggregated path at engine level: one engine prefills (prefill-only request, KV held),
//! its blocks' bytes are copied into blocks another engine reserved (what kv-transfer does
//! between nodes), and the second engine continues from the first token. The output must equal
//! a colocated run exactly, greedy and seeded, and every block must come back on both sides.

mod common;

use std::time::Instant;

use common::*;
use tandem_engine::{Engine, KvDtype, Priority, Request, SamplingParams, WeightDtype};

fn copy_blocks(src: &Engine, src_blocks: &[u32], dst: &mut Engine, dst_blocks: &[u32]) {
    let layout = *src.kv_layout();
    let (ns, nd) = (src.kv_pool().num_blocks(), dst.kv_pool().num_blocks());
    let slab = layout.slab_bytes();
    for layer in 0..layout.num_layers {
        for (&s, &d) in src_blocks.iter().zip(dst_blocks) {
            let so = layout.slab_offset(ns, layer, s as usize);
            let bytes = src.kv_pool().bytes()[so..so + slab].to_vec();
            let dof = layout.slab_offset(nd, layer, d as usize);
            dst.kv_pool_mut().bytes_mut()[dof..dof + slab].copy_from_slice(&bytes);
        }
    }
}

fn disaggregated(prefill: &mut Engine, decode: &mut Engine, req: Request) -> Vec<u32> {
    let now = Instant::now();
    let id = req.id;
    prefill.add_prefill_request(req.clone(), now).unwrap();
    let first = loop {
        let outs = prefill.step().unwrap();
        if let Some(o) = outs.into_iter().find(|o| o.request_id == id) {
            break o;
        }
    };
    assert!(first.finished.is_some(), "prefill-only requests stop after the first token");
    let held = first.held_blocks.clone().expect("prefill keeps the KV");
    let reserved = decode.reserve(1000 + id, req.prompt.len() + req.params.max_new_tokens).unwrap();
    copy_blocks(prefill, &held, decode, &reserved);
    assert!(prefill.release_held(id));
    let mut tokens = vec![first.token];
    let out = decode.add_prefilled(req, 1000 + id, first.token, 0, now).unwrap();
    assert_eq!(out.token, first.token);
    let mut done = out.finished.is_some();
    while !done {
        for o in decode.step().unwrap() {
            assert_eq!(o.request_id, id);
            tokens.push(o.token);
            done = o.finished.is_some();
        }
    }
    tokens
}

#[test]
fn prefill_here_decode_there_equals_colocated_greedy_and_seeded() {
    let mut colocated = engine(WeightDtype::F32, config(KvDtype::F16, 256));
    let prompts = test_prompts(&colocated);
    let mut prefill = engine(WeightDtype::F32, config(KvDtype::F16, 128));
    let mut decode = engine(WeightDtype::F32, config(KvDtype::F16, 256));
    for (i, p) in prompts.iter().enumerate() {
        let seeded = SamplingParams { temperature: 0.8, top_p: 0.95, seed: Some(i as u64), ignore_eos: true, ..SamplingParams::greedy(48) };
        for (k, params) in [SamplingParams { ignore_eos: true, ..SamplingParams::greedy(48) }, seeded].into_iter().enumerate() {
            let id = (i * 10 + k) as u64;
            let req = Request { id, prompt: p.clone(), params, priority: Priority::Interactive };
            let want = run(&mut colocated, vec![req.clone()]).remove(0).tokens;
            let got = disaggregated(&mut prefill, &mut decode, req);
            assert_eq!(got, want, "prompt {i}, {}", if k == 0 { "greedy" } else { "seeded" });
        }
    }
    for e in [&prefill, &decode] {
        assert!(e.is_idle());
        assert!(e.reserved_and_held_blocks().is_empty());
        assert_eq!(e.scheduler().blocks().num_free(), e.scheduler().blocks().num_blocks(), "every block back");
    }
}

#[test]
fn reservations_fail_typed_when_full_and_release_cleanly() {
    let mut e = engine(WeightDtype::F32, config(KvDtype::F32, 8));
    let blocks = e.reserve(1, 100).unwrap();
    assert_eq!(blocks.len(), 7);
    assert!(matches!(e.reserve(2, 40), Err(tandem_engine::EngineError::OutOfBlocks { requested_blocks: 3, free_blocks: 1 })));
    assert!(matches!(e.reserve(1, 5), Err(tandem_engine::EngineError::DuplicateRequest(1))));
    e.scheduler().check_invariants_with(&e.reserved_and_held_blocks());
    assert!(e.release_reservation(1));
    assert!(!e.release_reservation(1), "idempotent");
    assert_eq!(e.scheduler().blocks().num_free(), 8);
    let req = greedy(9, vec![300; 4], 2);
    assert!(matches!(e.add_prefilled(req, 77, 5, 0, Instant::now()), Err(tandem_engine::EngineError::UnknownReservation(77))));
}
