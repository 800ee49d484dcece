//! The disaggregated path at engine level: one engine prefills (prefill-only request, KV held),
//! its blocks' bytes are copied into blocks another engine reserved (what kv-transfer does
//! between nodes), and the second engine continues from the first token. The output must equal
//! a colocated run exactly, greedy and seeded, and every block must come back on both sides.

mod common;

use std::time::Instant;

use common::*;
use tandem_engine::{Engine, KvDtype, Priority, Request, SamplingParams, TokenLogprob, WeightDtype};

fn copy_blocks(src: &Engine, src_blocks: &[u32], dst: &mut Engine, dst_blocks: &[u32]) {
    for layer in 0..src.kv_layout().num_layers {
        for (&s, &d) in src_blocks.iter().zip(dst_blocks) {
            let from = src.kv_pool().expect("CPU engines keep KV in host memory").slab(layer, s);
            dst.kv_pool_mut().expect("CPU engines keep KV in host memory").slab_mut(layer, d).copy_from_slice(from);
        }
    }
}

fn disaggregated(prefill: &mut Engine, decode: &mut Engine, req: Request) -> Vec<u32> {
    disaggregated_with_logprobs(prefill, decode, req).0
}

/// Tokens and (when the request asks) their log probabilities, one engine prefilling and the
/// other decoding.
fn disaggregated_with_logprobs(
    prefill: &mut Engine,
    decode: &mut Engine,
    req: Request,
) -> (Vec<u32>, Vec<Option<TokenLogprob>>) {
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
    let out = decode.add_prefilled(req, 1000 + id, first.token, first.logprob.clone(), 0, now).unwrap();
    assert_eq!(out.token, first.token);
    let mut logprobs = vec![out.logprob];
    let mut done = out.finished.is_some();
    while !done {
        for o in decode.step().unwrap() {
            assert_eq!(o.request_id, id);
            tokens.push(o.token);
            logprobs.push(o.logprob);
            done = o.finished.is_some();
        }
    }
    (tokens, logprobs)
}

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
