//! Every way in: the engine serves the same model from a Hugging Face safetensors directory
//! (converted by an independent Python script) as from the GGUF, and `--dummy-weights` builds
//! seeded random weights of any shape, identical for identical seeds.

mod common;

use common::*;
use tandem_engine::{Engine, KvDtype, Model, ModelSource, WeightDtype, loader};

#[test]
fn a_safetensors_directory_serves_the_same_tokens_as_the_gguf() {
    let dir = std::env::temp_dir().join(format!("tandem-hf-{}", std::process::id()));
    run_reference(
        "gguf_to_hf.py",
        &["--model".into(), model_path().display().to_string(), "--out".into(), dir.display().to_string()],
    );
    let mut gguf = engine(WeightDtype::F32, config(KvDtype::F32, 128));
    let prompts = test_prompts(&gguf);
    let hf_loaded = loader::load(&ModelSource::Path(dir.clone()), WeightDtype::F32).expect("load HF dir");
    let hf_tok = hf_loaded.tokenizer.expect("tokenizer.json loads");
    let gguf_tok = gguf.tokenizer().unwrap().clone();
    for p in CHAT_PROMPTS.iter().chain(PLAIN_PROMPTS) {
        assert_eq!(hf_tok.encode(p), gguf_tok.encode(p), "tokenizer.json vs GGUF vocab on {p:?}");
    }
    let mut hf = Engine::new(Model::new(hf_loaded.weights), Some(hf_tok), config(KvDtype::F32, 128)).unwrap();
    let reqs = |id0: u64| prompts.iter().take(2).enumerate().map(|(i, p)| greedy(id0 + i as u64, p.clone(), 24)).collect();
    let a = run(&mut gguf, reqs(0));
    let b = run(&mut hf, reqs(10));
    let _ = std::fs::remove_dir_all(&dir);
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x.tokens, y.tokens);
    }
}

#[test]
fn dummy_weights_of_any_shape_are_seeded_and_runnable() {
    let dir = std::env::temp_dir().join(format!("tandem-dummy-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("config.json");
    // The 70B's attention shape (8 KV heads of 128, GQA 8:1) scaled down in width and layers.
    std::fs::write(
        &cfg,
        r#"{"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 3,
            "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 128,
            "vocab_size": 4096, "max_position_embeddings": 1024, "rope_theta": 500000.0}"#,
    )
    .unwrap();
    let build = |seed| {
        let src = ModelSource::Dummy { config: cfg.clone(), seed };
        let l = loader::load(&src, WeightDtype::F16).unwrap();
        assert!(l.tokenizer.is_none());
        Engine::new(Model::new(l.weights), None, config(KvDtype::F16, 64)).unwrap()
    };
    let (mut a, mut b, mut c) = (build(1), build(1), build(2));
    assert_eq!(a.kv_layout().fingerprint(), b.kv_layout().fingerprint());
    assert_ne!(a.kv_layout().fingerprint(), c.kv_layout().fingerprint(), "different weights, different KV");
    assert_eq!(a.kv_layout().num_kv_heads, 1);
    assert_eq!(a.kv_layout().head_dim, 128);
    let prompt: Vec<u32> = (0..40).map(|i| (i * 37 % 4000) as u32).collect();
    let ta = run(&mut a, vec![greedy(1, prompt.clone(), 8)]).remove(0).tokens;
    let tb = run(&mut b, vec![greedy(1, prompt.clone(), 8)]).remove(0).tokens;
    let tc = run(&mut c, vec![greedy(1, prompt, 8)]).remove(0).tokens;
    assert_eq!(ta, tb, "same seed, same weights, same tokens");
    assert_ne!(ta, tc);
    let _ = std::fs::remove_dir_all(&dir);
}
