//! Fuzzed ingress: valid OpenAI request bodies, mutated at random (bytes flipped, inserted,
//! deleted and duplicated; numbers swapped for extreme ones; JSON fragments, control
//! characters, emoji and invalid UTF-8 spliced in), go through everything the router does
//! before it routes: the JSON parser, the completion and chat validators, the chat template,
//! the tokenizer and the token limits. No input may panic; every refusal must be a client error
//! (HTTP 4xx, typed); every acceptance must fit the model's context. The same holds for random
//! gRPC requests (extreme floats, NaN, unknown priorities, huge token ids, long and odd texts)
//! through the proto mapping and the same validation.
//!
//! Deterministic: `TANDEM_SEED=N` reproduces a run (the failing seed and case are printed);
//! `TANDEM_FUZZ_CASES=N` runs longer. The default (100,000 cases) takes about two seconds.

use crate::common;

use common::{Rng, model};
use tandem_router::TokenLimits;
use tandem_router::http::openai::{RequestBody, parse_body};
use tandem_router::request::prepare;

const SEEDS: &[(&str, bool)] = &[
    (
        r#"{"prompt":"Hello there","max_tokens":8,"temperature":0.7,"top_p":0.9,"top_k":40,"seed":7,"stop":["\n","END"],"stream":true,"stream_options":{"include_usage":true},"ignore_eos":true,"model":"smollm2"}"#,
        false,
    ),
    (r#"{"prompt":[1,2,3,4],"max_tokens":2,"temperature":0}"#, false),
    (r#"{"prompt":[[5,6,7]],"max_tokens":3}"#, false),
    (r#"{"prompt":["one text"],"stop":"x"}"#, false),
    (
        r#"{"messages":[{"role":"system","content":"Be brief."},{"role":"user","content":[{"type":"text","text":"Hi"}]}],"max_tokens":4,"top_k":-1}"#,
        true,
    ),
    (r#"{"messages":[{"role":"user","content":"Why is the sky blue?"}],"stream":false}"#, true),
];

const FRAGMENTS: &[&str] = &[
    "-1", "0", "1e309", "-1e309", "18446744073709551616", "4294967296", "NaN", "null", "true",
    "[]", "{}", "\"\"", "[[]]", "[-1]", "[4294967295]", "\"\\u0000\"", "\"\\ud800\"", "\u{1F980}",
    "\u{202E}", "\"<|im_start|>\"", "\"<|im_end|>\"", "\"role\"", "\"assistant\"", ",", ":", "\"",
    "\\", "{\"type\":\"image_url\"}", "0.000001", "2147483648", "1.5",
];

fn mutate(rng: &mut Rng, input: &[u8]) -> Vec<u8> {
    let mut v = input.to_vec();
    for _ in 0..1 + rng.below(4) {
        let at = rng.below(v.len() + 1);
        match rng.below(7) {
            0 if !v.is_empty() => {
                let i = at.min(v.len() - 1);
                v[i] ^= 1 << rng.below(8);
            }
            1 => v.insert(at, rng.next() as u8),
            2 if !v.is_empty() => {
                let end = (at + 1 + rng.below(8)).min(v.len());
                v.drain(at.min(end)..end);
            }
            3 if !v.is_empty() => {
                let start = rng.below(v.len());
                let end = (start + 1 + rng.below(16)).min(v.len());
                let piece: Vec<u8> = v[start..end].to_vec();
                v.splice(at..at, piece);
            }
            4 => {
                let f = FRAGMENTS[rng.below(FRAGMENTS.len())].as_bytes();
                v.splice(at..at, f.iter().copied());
            }
            5 => {
                v.splice(at..at, [0xff, 0xfe, 0x00, 0x1b]);
            }
            _ => {
                // Replace a run of digits with an extreme number.
                if let Some(start) = v.iter().position(|b| b.is_ascii_digit()) {
                    let end = v[start..]
                        .iter()
                        .position(|b| !b.is_ascii_digit())
                        .map_or(v.len(), |n| start + n);
                    let f = ["-1", "1e309", "18446744073709551616", "0", "4294967296"][rng.below(5)];
                    v.splice(start..end, f.bytes());
                }
            }
        }
    }
    v
}

#[test]
fn mutated_openai_bodies_never_panic_and_every_refusal_is_a_client_error() {
    let seed: u64 = std::env::var("TANDEM_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(1);
    let cases: usize = std::env::var("TANDEM_FUZZ_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(100_000);
    let model = model();
    let limits = TokenLimits {
        max_tokens_limit: 256,
        default_max_tokens: 16,
    };
    let mut rng = Rng(seed);
    let (mut accepted, mut refused) = (0usize, 0usize);
    for case in 0..cases {
        let (base, chat) = SEEDS[rng.below(SEEDS.len())];
        let body = mutate(&mut rng, base.as_bytes());
        let shown = || format!("seed {seed}, case {case}: {:?}", String::from_utf8_lossy(&body));
        let result = parse_body::<RequestBody>(&body)
            .and_then(|b| if chat { b.into_chat() } else { b.into_completion() })
            .and_then(|g| prepare(&model, limits, g, || "fuzz".to_string()));
        match result {
            Ok(p) => {
                accepted += 1;
                let total = p.prompt_tokens() as u64 + p.max_new_tokens() as u64;
                assert!(total <= model.context_tokens as u64, "over the context: {}", shown());
                assert!(p.max_new_tokens() <= limits.max_tokens_limit, "over the limit: {}", shown());
            }
            Err(e) => {
                refused += 1;
                assert!(e.is_client_error(), "{e:?} is not a client error: {}", shown());
                assert!(!e.to_string().is_empty(), "an empty error message: {}", shown());
            }
        }
    }
    eprintln!("seed {seed}: {cases} cases, {accepted} accepted, {refused} refused");
    // The mutations must exercise both sides, or the test proves little.
    assert!(accepted > cases / 50 && refused > cases / 2, "{accepted} accepted, {refused} refused");
}

/// A random string: fragments, special tokens, control characters, emoji, long runs.
fn text(rng: &mut Rng) -> String {
    let mut s = String::new();
    for _ in 0..rng.below(6) {
        match rng.below(5) {
            0 => s.push_str(FRAGMENTS[rng.below(FRAGMENTS.len())]),
            1 => s.push(char::from_u32(rng.next() as u32 % 0x11_0000).unwrap_or('\u{fffd}')),
            2 => s.push_str(&"a".repeat(rng.below(3000))),
            3 => s.push_str("<|im_start|>user\n"),
            _ => s.push_str(" the harbour at night"),
        }
    }
    s
}

#[test]
fn random_grpc_requests_never_panic_and_every_refusal_is_a_client_error() {
    use tandem_proto::v1 as pb;
    use tandem_router::grpc::from_proto;
    let seed: u64 = std::env::var("TANDEM_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(1);
    let model = model();
    let limits = TokenLimits {
        max_tokens_limit: 256,
        default_max_tokens: 16,
    };
    let floats = [0.0f32, -0.0, 1.0, 0.5, -1.0, f32::NAN, f32::INFINITY, f32::NEG_INFINITY, f32::MIN_POSITIVE, 1e30, 2.0];
    let mut rng = Rng(seed);
    let (mut accepted, mut refused) = (0usize, 0usize);
    for case in 0..20_000 {
        let input = match rng.below(4) {
            0 => Some(pb::generate_request::Input::Prompt(text(&mut rng))),
            1 => Some(pb::generate_request::Input::Chat(pb::ChatMessages {
                messages: (0..rng.below(4))
                    .map(|_| pb::ChatMessage {
                        role: ["user", "system", "assistant", "tool", ""][rng.below(5)].to_string(),
                        content: text(&mut rng),
                    })
                    .collect(),
            })),
            2 => Some(pb::generate_request::Input::TokenIds(pb::TokenIds {
                ids: (0..rng.below(40)).map(|_| [0, 1, 2, 49151, 49152, u32::MAX][rng.below(6)] as u32 ^ (rng.next() as u32 % 3)).collect(),
            })),
            _ => None,
        };
        let request = pb::GenerateRequest {
            model: ["", "smollm2", "gpt-4", "\u{0}"][rng.below(4)].to_string(),
            input,
            sampling: (rng.below(5) > 0).then(|| pb::SamplingParams {
                temperature: floats[rng.below(floats.len())],
                top_p: floats[rng.below(floats.len())],
                top_k: [0, 1, 40, u32::MAX][rng.below(4)],
                seed: (rng.below(2) == 0).then(|| rng.next()),
                stop: (0..rng.below(3)).map(|_| text(&mut rng)).collect(),
                max_tokens: [0, 1, 16, 256, 257, 8192, u32::MAX][rng.below(7)],
                ignore_eos: rng.below(2) == 0,
                presence_penalty: floats[rng.below(floats.len())],
                frequency_penalty: floats[rng.below(floats.len())],
                repetition_penalty: floats[rng.below(floats.len())],
                logprobs: rng.below(2) == 0,
                top_logprobs: [0, 1, 20, 21, u32::MAX][rng.below(5)],
                resumed_output_tokens: [0, 0, 0, 3][rng.below(4)],
                response_format: match rng.below(6) {
                    0 => Some(pb::ResponseFormat { format: Some(pb::response_format::Format::JsonObject(Default::default())) }),
                    1 => Some(pb::ResponseFormat {
                        format: Some(pb::response_format::Format::JsonSchema(pb::response_format::JsonSchema {
                            name: ["", "n", "bad name"][rng.below(3)].into(),
                            schema: [
                                "",
                                r#"{"type": "integer"}"#,
                                r#"{"type": "nonsense"}"#,
                                "{",
                                r##"{"properties": {"a": {"$ref": "#/nowhere"}}}"##,
                            ][rng.below(5)]
                            .into(),
                            strict: rng.below(2) == 0,
                        })),
                    }),
                    2 => Some(pb::ResponseFormat::default()),
                    _ => None,
                },
            }),
            priority: [0, 1, 2, -1, i32::MAX][rng.below(5)],
            request_id: ["", "r-1", "\u{202E}x"][rng.below(3)].to_string(),
            n: [0, 1, 2, 16, 17][rng.below(5)],
        };
        let shown = || format!("seed {seed}, case {case}: {request:?}");
        match from_proto(request.clone()).and_then(|g| prepare(&model, limits, g, || "fuzz".to_string())) {
            Ok(p) => {
                accepted += 1;
                let total = p.prompt_tokens() as u64 + p.max_new_tokens() as u64;
                assert!(total <= model.context_tokens as u64, "over the context: {}", shown());
            }
            Err(e) => {
                refused += 1;
                assert!(e.is_client_error(), "{e:?} is not a client error: {}", shown());
            }
        }
    }
    eprintln!("seed {seed}: 20000 gRPC requests, {accepted} accepted, {refused} refused");
    assert!(accepted > 100 && refused > 1000, "{accepted} accepted, {refused} refused");
}
