//! The engine against an independent reference: a plain numpy Llama forward pass
//! (tests/reference/llama_ref.py) that reads the GGUF itself, uses interleaved RoPE on the raw
//! (permuted) Q/K weights, and shares no code with the engine. Greedy tokens must be equal.

mod common;

use common::*;
use tandem_engine::{KvDtype, WeightDtype};

const NEW_TOKENS: usize = 24;

pub fn reference_tokens(prompt: &[u32], max_new: usize) -> Vec<u32> {
    let ids = prompt.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(",");
    let out = run_reference(
        "llama_ref.py",
        &["--model".into(), model_path().display().to_string(), "--ids".into(), ids, "--max-new".into(), max_new.to_string(), "--ignore-eos".into()],
    );
    let v: serde_json::Value = serde_json::from_str(out.trim().lines().last().unwrap()).expect("reference JSON");
    v["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect()
}

#[test]
fn greedy_tokens_match_the_numpy_reference_on_chat_and_plain_prompts() {
    let mut engine = engine(WeightDtype::F32, config(KvDtype::F32, 256));
    let prompts = test_prompts(&engine);
    let reqs = prompts.iter().enumerate().map(|(i, p)| greedy(i as u64, p.clone(), NEW_TOKENS)).collect();
    let ours = run(&mut engine, reqs);
    let tok = engine.tokenizer().unwrap().clone();
    for (p, c) in prompts.iter().zip(&ours) {
        let reference = reference_tokens(p, NEW_TOKENS);
        assert_eq!(
            c.tokens, reference,
            "prompt {:?}\n ours: {:?}\n  ref: {:?}",
            tok.decode(p),
            tok.decode(&c.tokens),
            tok.decode(&reference)
        );
    }
}
