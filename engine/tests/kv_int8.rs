//! 8-bit KV: half the data bytes of bf16 (plus 3.9 % of bf16 for its f16 scales) and keeps the greedy answers of the
//! chat prompts equal to the independent f32 reference for 16 tokens.

use crate::common;

use common::*;
use tandem_engine::{KvDtype, WeightDtype};

#[test]
fn int8_kv_holds_half_the_data_bytes_and_keeps_the_chat_answers_for_16_tokens() {
    let f32_engine = engine(WeightDtype::F32, config(KvDtype::F32, 64));
    let bf16 = f32_engine.model().kv_layout(16, KvDtype::Bf16).unwrap();
    let int8 = f32_engine.model().kv_layout(16, KvDtype::Int8).unwrap();
    let ratio = int8.bytes_per_token() / bf16.bytes_per_token();
    // int8 data is exactly half of bf16; the f16 scales (64 per head for keys, 16 for values per
    // 16-token block) add 3.9 % of bf16: 2208 / 4096 bytes per head and block.
    assert!(ratio < 0.54, "int8 KV is {ratio:.4} of bf16");
    let prompts: Vec<Vec<u32>> = test_prompts(&f32_engine).into_iter().take(CHAT_PROMPTS.len()).collect();
    drop(f32_engine);
    let mut engine = engine(WeightDtype::F32, config(KvDtype::Int8, 64));
    for (i, p) in prompts.iter().enumerate() {
        let ours = run(&mut engine, vec![greedy(i as u64, p.clone(), 16)]);
        assert_eq!(ours[0].tokens, reference_tokens(p, 16), "chat prompt {i} with int8 KV");
    }
}
