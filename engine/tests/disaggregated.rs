//! The disaggregated path at engine level: one engine prefills (prefill-only request, KV held),
//! its blocks' bytes are copied into blocks another engine reserved (what kv-transfer does
//! between nodes), and the second engine continues from the first token. The output must equal
//! a colocated run exactly, greedy and seeded, and every block must come back on both sides.
//! The staged path (the KV on the model's device, the transport's pool beside it as a host
//! mirror: how a GPU node serves) runs here on the CPU, with slab copies for the device copies.

use crate::common;

use std::sync::Arc;
use std::time::Instant;

use common::*;
use tandem_engine::kv::{KvBacking, KvPool};
use tandem_engine::{
    Engine, KvDtype, Model, ModelSource, Priority, Request, SamplingParams, Staging, TokenLogprob, WeightDtype, loader,
};

/// Tokens and log probabilities of `req` run on one engine.
fn colocated_with_logprobs(engine: &mut Engine, req: Request) -> (Vec<u32>, Vec<Option<TokenLogprob>>) {
    let mut logprobs = Vec::new();
    let done = engine.generate(vec![req], |o| logprobs.push(o.logprob.clone())).unwrap();
    (done[0].tokens.clone(), logprobs)
}

#[test]
fn penalties_and_logprobs_survive_the_split_and_a_migration() {
    let mut colocated = engine(WeightDtype::F32, config(KvDtype::F16, 256));
    let prompts = test_prompts(&colocated);
    let mut prefill = engine(WeightDtype::F32, config(KvDtype::F16, 128));
    let mut decode = engine(WeightDtype::F32, config(KvDtype::F16, 256));
    let plain = SamplingParams { temperature: 0.8, seed: Some(5), ignore_eos: true, ..SamplingParams::greedy(32) };
    let penalised = SamplingParams {
        presence_penalty: 0.6,
        frequency_penalty: 0.4,
        repetition_penalty: 1.3,
        logprobs: true,
        top_logprobs: 3,
        ..plain.clone()
    };
    for (i, p) in prompts.iter().take(2).enumerate() {
        let req = |id: u64, params: &SamplingParams| Request { id, prompt: p.clone(), params: params.clone(), priority: Priority::Interactive };
        let (want, want_lp) = colocated_with_logprobs(&mut colocated, req(100 + i as u64, &penalised));
        let (unpenalised, none) = colocated_with_logprobs(&mut colocated, req(200 + i as u64, &plain));
        assert_ne!(want, unpenalised, "prompt {i}: the penalties change the output");
        assert!(none.iter().all(Option::is_none), "no logprobs unless asked");
        for (t, lp) in want.iter().zip(&want_lp) {
            let lp = lp.as_ref().expect("asked for");
            assert_eq!(lp.token, *t);
            assert!(lp.logprob <= 0.0 && lp.top.len() == 3, "{lp:?}");
            assert!(lp.top.windows(2).all(|w| w[0].1 >= w[1].1), "most likely first: {lp:?}");
            assert!(lp.top[0].1 >= lp.logprob, "{lp:?}");
        }
        // Prefill on one engine, decode on another: the same tokens and numbers.
        let (got, got_lp) = disaggregated_with_logprobs(&mut prefill, &mut decode, req(300 + i as u64, &penalised));
        assert_eq!(got, want, "prompt {i}: split");
        assert_eq!(got_lp, want_lp, "prompt {i}: split logprobs");
        // A migration after k tokens: the prompt carries them, and the rest continues exactly.
        let k = 7;
        let mut prompt = p.clone();
        prompt.extend_from_slice(&want[..k]);
        let resumed = SamplingParams { max_new_tokens: 32 - k, resumed_output_tokens: k, ..penalised.clone() };
        let moved = Request { id: 400 + i as u64, prompt, params: resumed, priority: Priority::Interactive };
        let (rest, rest_lp) = colocated_with_logprobs(&mut colocated, moved);
        assert_eq!(rest, want[k..], "prompt {i}: after a migration");
        assert_eq!(rest_lp, want_lp[k..], "prompt {i}: logprobs after a migration");
    }
}

#[test]
fn prefill_here_decode_there_equals_colocated_greedy_and_seeded() {
    let mut colocated = engine(WeightDtype::F32, config(KvDtype::F16, 256));
    let prompts = test_prompts(&colocated);
    let mut prefill = engine(WeightDtype::F32, config(KvDtype::F16, 128));
    let mut decode = engine(WeightDtype::F32, config(KvDtype::F16, 256));
    for (i, p) in prompts.iter().enumerate() {
        let seeded = SamplingParams { temperature: 0.8, top_p: 0.95, seed: Some(i as u64), ignore_eos: true, ..SamplingParams::greedy(24) };
        for (k, params) in [SamplingParams { ignore_eos: true, ..SamplingParams::greedy(24) }, seeded].into_iter().enumerate() {
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
    assert!(matches!(e.add_prefilled(req, 77, 5, None, 0, Instant::now()), Err(tandem_engine::EngineError::UnknownReservation(77))));
}

#[test]
fn a_decode_engine_computing_the_prompt_in_its_reservation_equals_colocated() {
    // Conditional disaggregation: the decode engine reserves as for pushed KV, then runs the
    // whole request itself (`add_local`) beside a sequence it is already decoding.
    let mut colocated = engine(WeightDtype::F32, config(KvDtype::F16, 256));
    let prompts = test_prompts(&colocated);
    let mut decode = engine(WeightDtype::F32, config(KvDtype::F16, 256));
    let seeded = SamplingParams { temperature: 0.8, top_p: 0.95, seed: Some(3), ignore_eos: true, ..SamplingParams::greedy(24) };
    let greedy_params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(24) };
    let reqs: Vec<Request> = prompts
        .iter()
        .take(2)
        .zip([greedy_params, seeded])
        .enumerate()
        .map(|(i, (p, params))| Request { id: i as u64, prompt: p.clone(), params, priority: Priority::Interactive })
        .collect();
    let want: Vec<Vec<u32>> = reqs.iter().map(|r| run(&mut colocated, vec![r.clone()]).remove(0).tokens).collect();
    let now = Instant::now();
    for r in &reqs {
        decode.reserve(500 + r.id, r.prompt.len() + r.params.max_new_tokens).unwrap();
    }
    // Bad input changes nothing: an unknown reservation, one too small for the request.
    let small = decode.reserve(900, 4).unwrap();
    assert!(matches!(decode.add_local(reqs[0].clone(), 77, now), Err(tandem_engine::EngineError::UnknownReservation(77))));
    assert!(matches!(decode.add_local(reqs[0].clone(), 900, now), Err(tandem_engine::EngineError::InvalidRequest { field: "reservation_id", .. })));
    assert!(decode.release_reservation(900), "the small reservation is still held: {small:?}");
    for r in &reqs {
        decode.add_local(r.clone(), 500 + r.id, now).unwrap();
    }
    assert!(decode.reserved_and_held_blocks().is_empty(), "the reservations became the requests' blocks");
    let mut got = vec![Vec::new(); reqs.len()];
    while !decode.is_idle() {
        for o in decode.step().unwrap() {
            got[o.request_id as usize].push(o.token);
        }
        decode.scheduler().check_invariants_with(&decode.reserved_and_held_blocks());
    }
    assert_eq!(got, want, "greedy and seeded, computed in the reservation");
    assert_eq!(decode.scheduler().blocks().num_free(), decode.scheduler().blocks().num_blocks(), "every block back");
}

#[test]
fn structured_output_is_json_of_the_schema_and_survives_the_split_and_a_migration() {
    use tandem_engine::grammar::ResponseFormat;
    use tandem_engine::tokenizer::ChatMessage;
    use tandem_engine::{EngineError, FinishReason};

    let mut colocated = engine(WeightDtype::F32, config(KvDtype::F16, 256));
    let mut prefill = engine(WeightDtype::F32, config(KvDtype::F16, 128));
    let mut decode = engine(WeightDtype::F32, config(KvDtype::F16, 256));
    let tok = colocated.tokenizer().unwrap().clone();
    let msgs = [ChatMessage { role: "user".into(), content: "Describe a cat with its name and age.".into() }];
    let prompt = tok.encode(&tok.apply_chat_template(&msgs, true).unwrap());
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 30}
        },
        "required": ["name", "age"],
        "additionalProperties": false
    });
    let formats = [ResponseFormat::JsonObject, ResponseFormat::JsonSchema { name: "cat".into(), schema }];
    let samplings = [
        SamplingParams::greedy(96),
        SamplingParams { temperature: 0.9, top_p: 0.95, seed: Some(11), ..SamplingParams::greedy(96) },
    ];
    let mut id = 500;
    for (f, format) in formats.iter().enumerate() {
        for (s, sampling) in samplings.iter().enumerate() {
            let case = format!("format {f}, sampling {s}");
            let params = SamplingParams { response_format: Some(format.clone()), ..sampling.clone() };
            let mut req = |params: SamplingParams, prompt: &Vec<u32>| {
                id += 1;
                Request { id, prompt: prompt.clone(), params, priority: Priority::Interactive }
            };
            let done = run(&mut colocated, vec![req(params.clone(), &prompt)]).remove(0);
            let free = run(&mut colocated, vec![req(sampling.clone(), &prompt)]).remove(0);
            assert_ne!(done.tokens, free.tokens, "{case}: the constraint changes the output");
            if f == 1 || done.finish_reason == FinishReason::Eos {
                assert_eq!(done.finish_reason, FinishReason::Eos, "{case}: a bounded schema ends: {:?}", done.text);
                let v: serde_json::Value =
                    serde_json::from_str(&done.text).unwrap_or_else(|e| panic!("{case}: {:?}: {e}", done.text));
                assert!(v.is_object(), "{case}: {}", done.text);
                if f == 1 {
                    let o = v.as_object().unwrap();
                    assert_eq!(o.len(), 2, "{case}: {v}");
                    assert!(o["name"].as_str().is_some_and(|n| n.chars().count() <= 12), "{case}: {v}");
                    assert!(o["age"].as_u64().is_some_and(|a| a <= 30), "{case}: {v}");
                }
            } else {
                assert!(done.text.starts_with('{'), "{case}: {:?}", done.text);
            }
            // Prefill on one engine (its first token constrained), decode on another.
            let got = disaggregated(&mut prefill, &mut decode, req(params.clone(), &prompt));
            assert_eq!(got, done.tokens, "{case}: split");
            // A migration after k tokens replays them into a fresh grammar.
            let k = 5;
            let mut moved = prompt.clone();
            moved.extend_from_slice(&done.tokens[..k]);
            let resumed = SamplingParams { max_new_tokens: 96 - k, resumed_output_tokens: k, ..params.clone() };
            let rest = run(&mut colocated, vec![req(resumed, &moved)]).remove(0);
            assert_eq!(rest.tokens, done.tokens[k..], "{case}: after a migration");
        }
    }
    for e in [&colocated, &prefill, &decode] {
        assert_eq!(e.stats().grammar_failures, 0);
    }

    // Bad input changes nothing: an unsupported schema, ignore_eos, output that breaks the grammar.
    let bad = |params: SamplingParams, prompt: &Vec<u32>| Request { id: 9_000, prompt: prompt.clone(), params, priority: Priority::Interactive };
    let unsupported = ResponseFormat::JsonSchema { name: "x".into(), schema: serde_json::json!({"type": "nonsense"}) };
    let err = colocated
        .add_request(bad(SamplingParams { response_format: Some(unsupported), ..SamplingParams::greedy(8) }, &prompt), Instant::now())
        .unwrap_err();
    assert!(err.is_invalid_request() && err.to_string().contains("response_format.json_schema.schema"), "{err}");
    let err = colocated
        .add_request(
            bad(SamplingParams { response_format: Some(ResponseFormat::JsonObject), ignore_eos: true, ..SamplingParams::greedy(8) }, &prompt),
            Instant::now(),
        )
        .unwrap_err();
    assert!(matches!(err, EngineError::InvalidRequest { field: "ignore_eos", .. }), "{err}");
    let mut prose = prompt.clone();
    prose.extend(tok.encode("Sure!"));
    let resumed = SamplingParams { response_format: Some(ResponseFormat::JsonObject), resumed_output_tokens: 2, ..SamplingParams::greedy(8) };
    let err = colocated.add_request(bad(resumed, &prose), Instant::now()).unwrap_err();
    assert!(matches!(err, EngineError::InvalidRequest { field: "resumed_output_tokens", .. }), "{err}");
    assert!(colocated.is_idle());
}

/// An engine on the CPU whose KV is staged through a host mirror (the GPU's path, with slab
/// copies for device copies).
fn staged(staging: Staging, cfg: tandem_engine::EngineConfig) -> Engine {
    let loaded = loader::load(&ModelSource::Path(model_path()), WeightDtype::F32).unwrap();
    let model = Model::new(loaded.weights);
    let (layout, n) = Engine::pool_shape(&model, &cfg).unwrap();
    Engine::with_staged_pool(model, loaded.tokenizer, cfg, KvPool::new(layout, n).unwrap(), staging).unwrap()
}

#[test]
fn staged_engines_pass_the_kv_through_their_host_mirrors_and_equal_colocated() {
    let mut colocated = engine(WeightDtype::F32, config(KvDtype::F16, 256));
    let prompts = test_prompts(&colocated);
    let mut prefill = staged(Staging::Push, config(KvDtype::F16, 128));
    let mut decode = staged(Staging::Receive, config(KvDtype::F16, 256));
    let mirror = prefill.kv_pool().unwrap() as *const KvPool;
    assert!(!std::ptr::eq(mirror, prefill.kv_store().host().unwrap()), "the mirror is not the KV itself");
    let block_bytes = prefill.kv_layout().block_bytes() as u64;
    let mut pushed_blocks = 0;
    // Three prompts: the chat ones share the system prompt, so the prefill engine's prefix cache
    // serves blocks a previous request wrote (and mirrored then).
    for (i, p) in prompts.iter().take(3).enumerate() {
        let req = greedy(i as u64, p.clone(), 32);
        let want = run(&mut colocated, vec![req.clone()]).remove(0).tokens;
        assert_eq!(disaggregated(&mut prefill, &mut decode, req), want, "prompt {i}");
        pushed_blocks += p.len().div_ceil(16) as u64;
    }
    let (ps, ds) = (prefill.stats(), decode.stats());
    assert!(ps.kv_staged_out_bytes >= block_bytes, "the prefill engine copied out: {ps:?}");
    assert_eq!(ps.kv_staged_in_bytes, 0, "and nothing in");
    assert_eq!(ds.kv_staged_in_bytes, pushed_blocks * block_bytes, "the decode engine copied every prompt block in, once");
    assert_eq!(ds.kv_staged_out_bytes, 0, "decode steps copy nothing out");
    assert!(!ps.kv_mirror_pinned && !ds.kv_mirror_pinned, "host memory needs no locking");
    for e in [&prefill, &decode] {
        assert!(e.is_idle() && e.reserved_and_held_blocks().is_empty());
        assert_eq!(e.scheduler().blocks().num_free(), e.scheduler().blocks().num_blocks(), "every block back");
    }
}

/// KV that a transport wrote straight into the decode engine's own cache (CUDA IPC on one GPU;
/// here the CPU stand-in for device memory) is adopted as it is: nothing is copied up from the
/// mirror (whose bytes are stale: zero here), and the output equals the colocated engine's.
#[test]
fn kv_that_landed_in_device_memory_is_adopted_without_a_copy_from_the_mirror() {
    let mut colocated = engine(WeightDtype::F32, config(KvDtype::F16, 256));
    let prompt = test_prompts(&colocated).remove(0);
    let mut prefill = staged(Staging::Push, config(KvDtype::F16, 128));
    let mut decode = staged(Staging::Receive, config(KvDtype::F16, 256));
    let req = greedy(7, prompt.clone(), 24);
    let want = run(&mut colocated, vec![req.clone()]).remove(0).tokens;
    let now = std::time::Instant::now();
    prefill.add_prefill_request(req.clone(), now).unwrap();
    let first = loop {
        if let Some(o) = prefill.step().unwrap().into_iter().find(|o| o.request_id == 7) {
            break o;
        }
    };
    let held = first.held_blocks.clone().unwrap();
    let reserved = decode.reserve(70, prompt.len() + 24).unwrap();
    assert!(!decode.kv_landed_on_device(71), "no such reservation: nothing recorded");
    // What the IPC copy does: the prefill engine's KV into the decode engine's own cache.
    let layers = decode.kv_layout().num_layers;
    for layer in 0..layers {
        for (&s, &d) in held.iter().zip(&reserved) {
            let from = prefill.kv_store().host().unwrap().slab(layer, s).to_vec();
            decode.kv_store_mut().host_mut().unwrap().slab_mut(layer, d).copy_from_slice(&from);
        }
    }
    assert!(decode.kv_landed_on_device(70));
    let out = decode.add_prefilled(req, 70, first.token, None, 0, now).unwrap();
    let mut tokens = vec![first.token];
    assert_eq!(out.token, first.token);
    let mut done = out.finished.is_some();
    while !done {
        for o in decode.step().unwrap() {
            tokens.push(o.token);
            done = o.finished.is_some();
        }
    }
    assert_eq!(tokens, want);
    let s = decode.stats();
    assert_eq!(s.kv_staged_in_bytes, 0, "nothing copied up from the mirror: {s:?}");
    assert_eq!(s.kv_adopted_on_device, 1);
    let mirror = decode.kv_pool().unwrap();
    assert!(mirror.slab(0, reserved[0]).iter().all(|&b| b == 0), "the mirror was never written");
    assert!(prefill.release_held(7));
}

/// Host memory the test can read while the engine writes it (the transport's view).
struct SharedBytes {
    buf: Vec<u64>,
}

// SAFETY: the buffer is never reallocated; the engine and the test (on the same thread, inside
// the engine's step callback) are its only users.
unsafe impl KvBacking for SharedBytes {
    fn as_ptr(&self) -> *mut u8 {
        self.buf.as_ptr() as *mut u8
    }
    fn len_bytes(&self) -> usize {
        self.buf.len() * 8
    }
}

#[test]
fn a_pushing_mirror_holds_each_layer_before_the_layer_is_reported() {
    let cfg = config(KvDtype::F16, 64);
    let loaded = loader::load(&ModelSource::Path(model_path()), WeightDtype::F32).unwrap();
    let model = Model::new(loaded.weights);
    let (layout, n) = Engine::pool_shape(&model, &cfg).unwrap();
    let shared = Arc::new(SharedBytes { buf: vec![0; layout.pool_bytes(n).div_ceil(8)] });
    let host = KvPool::external(layout, n, shared.clone()).unwrap();
    let mut e = Engine::with_staged_pool(model, loaded.tokenizer, cfg, host, Staging::Push).unwrap();
    let prompt = test_prompts(&e).remove(0);
    assert!(prompt.len() > 16, "the prompt spans blocks");
    e.add_prefill_request(greedy(1, prompt.clone(), 4), Instant::now()).unwrap();
    let slab = layout.slab_bytes();
    let read = |layer: usize, block: u32| -> Vec<u8> {
        let at = layout.slab_offset(n, layer, block as usize);
        // SAFETY: inside the pool; the engine is paused in its callback on this thread.
        unsafe { std::slice::from_raw_parts(shared.as_ptr().add(at), slab) }.to_vec()
    };
    let (mut seen, mut blocks) = (Vec::new(), Vec::new());
    let outs = e
        .step_observed(&mut |done| {
            let c = &done.chunks[0];
            blocks = c.block_table[..(c.first_pos + c.len).div_ceil(16)].to_vec();
            assert_eq!(done.layer, seen.len(), "layers are reported in order");
            seen.push(blocks.iter().map(|&b| read(done.layer, b)).collect::<Vec<_>>());
            if done.layer + 1 < done.num_layers {
                let next = blocks.iter().all(|&b| read(done.layer + 1, b).iter().all(|&x| x == 0));
                assert!(next, "layer {} is not in the mirror before it is computed", done.layer + 1);
            }
        })
        .unwrap();
    assert_eq!(outs.len(), 1, "one step prefills the prompt");
    assert_eq!(seen.len(), layout.num_layers);
    let store = e.kv_store().host().expect("a CPU engine's KV");
    for (layer, slabs) in seen.iter().enumerate() {
        for (&b, got) in blocks.iter().zip(slabs) {
            assert!(got.iter().any(|&x| x != 0), "layer {layer} block {b} was written");
            assert_eq!(got.as_slice(), store.slab(layer, b), "layer {layer} block {b}: mirror = KV when reported");
        }
    }
    let want = (layout.num_layers * blocks.len() * slab) as u64;
    assert_eq!(e.stats().kv_staged_out_bytes, want, "each written slab copied once");
}

#[test]
fn a_mirror_of_another_layout_is_refused() {
    let cfg = config(KvDtype::F16, 64);
    let loaded = loader::load(&ModelSource::Path(model_path()), WeightDtype::F32).unwrap();
    let model = Model::new(loaded.weights);
    let (layout, n) = Engine::pool_shape(&model, &cfg).unwrap();
    let other = tandem_engine::KvLayout { block_size_tokens: 32, ..layout };
    let err = Engine::with_staged_pool(model, None, cfg, KvPool::new(other, n).unwrap(), Staging::Receive).err().unwrap();
    assert!(matches!(err, tandem_engine::EngineError::Layout(_)), "{err}");
}
