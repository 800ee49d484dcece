//! The engine against an independent reference: a plain numpy Llama forward pass
//! (tests/reference/llama_ref.py) that reads the GGUF itself, uses interleaved RoPE on the raw
//! (permuted) Q/K weights, and shares no code with the engine. Greedy tokens must be equal.

use crate::common;

use common::*;
use tandem_engine::{KvDtype, WeightDtype};

const NEW_TOKENS: usize = 24;

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
