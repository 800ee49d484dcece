//! Every way in: the engine serves the same model from a Hugging Face safetensors directory
//! (converted by an independent Python script) as from the GGUF, the GGUF's quantized blocks
//! kept as stored (`--dtype auto`) serve the f32 path's exact output (a type with no kernel is
//! dequantised and reported), and `--dummy-weights` builds seeded random weights of any shape,
//! identical for identical seeds.

use crate::common;

use common::*;
use tandem_engine::{DtypeChoice, Engine, EngineError, KvDtype, Model, ModelSource, WeightDtype, loader};

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

/// Greedy outputs with each token's log probability and top-5 (their Debug text: equal text,
/// equal bits).
fn greedy_with_logprobs(engine: &mut Engine, prompts: &[Vec<u32>]) -> Vec<(u64, u32, String)> {
    let reqs = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let mut r = greedy(i as u64, p.clone(), 32);
            r.params.logprobs = true;
            r.params.top_logprobs = 5;
            r
        })
        .collect();
    let mut out = Vec::new();
    engine.generate(reqs, |o| out.push((o.request_id, o.token, format!("{:?}", o.logprob)))).unwrap();
    out
}

#[test]
fn auto_keeps_the_files_quantized_blocks_and_serves_the_f32_paths_exact_output() {
    let src = ModelSource::Path(model_path());
    let f32w = loader::load(&src, WeightDtype::F32).unwrap();
    let auto = loader::load(&src, DtypeChoice::Auto).unwrap();
    // The default model: Q4_1 layers and a Q8_0 embedding (tied LM head), as the file has them.
    assert_eq!(auto.weights.embed.dtype(), WeightDtype::Q8_0);
    for l in &auto.weights.layers {
        for w in [&l.qkv, &l.o_proj, &l.gate_up, &l.down] {
            assert_eq!(w.dtype(), WeightDtype::Q4_1);
        }
    }
    assert_eq!(auto.weights.fingerprint, f32w.weights.fingerprint, "same values, same KV");
    let (fm, am) = (Model::new(f32w.weights), Model::new(auto.weights));
    let file = std::fs::metadata(model_path()).unwrap().len() as f64;
    let held = am.weight_bytes() as f64;
    assert!((0.93..=1.0).contains(&(held / file)), "auto holds {held} bytes for a {file}-byte file");
    assert!(fm.weight_bytes() as f64 > 5.0 * held);

    let mut f = Engine::new(fm, f32w.tokenizer, config(KvDtype::F32, 256)).unwrap();
    let mut a = Engine::new(am, auto.tokenizer, config(KvDtype::F32, 256)).unwrap();
    let prompts = test_prompts(&f);
    let (want, got) = (greedy_with_logprobs(&mut f, &prompts), greedy_with_logprobs(&mut a, &prompts));
    assert_eq!(want.len(), prompts.len() * 32);
    for (w, g) in want.iter().zip(&got) {
        assert_eq!(w, g, "request {}: token and log probabilities, f32 vs auto", w.0);
    }
}

#[test]
fn a_corrupt_quantized_block_is_a_load_error_naming_the_tensor() {
    let (content, _) = loader::gguf::open(&model_path()).unwrap();
    let name = "blk.3.ffn_down.weight";
    let at = content.tensor_data_offset + content.tensor_infos[name].offset;
    let mut bytes = std::fs::read(model_path()).unwrap();
    // The first block's scale `d` (Q4_1: f16 d, f16 m, 16 bytes of nibbles) becomes a NaN.
    bytes[at as usize..at as usize + 2].copy_from_slice(&0x7e00u16.to_le_bytes());
    let path = std::env::temp_dir().join(format!("tandem-corrupt-{}.gguf", std::process::id()));
    std::fs::write(&path, &bytes).unwrap();
    let err = loader::load(&ModelSource::Path(path.clone()), DtypeChoice::Auto).err().expect("a corrupt block fails");
    let _ = std::fs::remove_file(&path);
    match &err {
        EngineError::ModelFormat { reason, .. } => {
            assert!(reason.contains(name) && reason.contains("scale") && reason.contains("not finite"), "{reason}")
        }
        e => panic!("expected ModelFormat naming {name}, got {e}"),
    }
}

#[test]
fn a_fixed_quantized_dtype_requantizes_what_the_file_does_not_store_so() {
    let l = loader::load(&ModelSource::Path(model_path()), WeightDtype::Q8_0).unwrap();
    assert!(l.weights.layers.iter().all(|l| l.gate_up.dtype() == WeightDtype::Q8_0));
    let f32w = loader::load(&ModelSource::Path(model_path()), WeightDtype::F32).unwrap();
    assert_ne!(l.weights.fingerprint, f32w.weights.fingerprint, "other values, other KV");
    let mut e = Engine::new(Model::new(l.weights), l.tokenizer, config(KvDtype::F32, 64)).unwrap();
    let prompts = test_prompts(&e);
    let out = run(&mut e, vec![greedy(1, prompts[0].clone(), 8)]).remove(0);
    assert_eq!(out.tokens.len(), 8);
}

/// A GGUF whose tensors include a quantization type with no kernel (here `blk.3.ffn_down`
/// rewritten as Q5_0 by candle's quantizer) loads under `--dtype auto`: that tensor is
/// dequantised to f32 (and the type reported, the same set the load logs a warning from, once
/// per type), every other tensor keeps the file's type (`blk.5.ffn_down`, rewritten as Q4_0,
/// runs on the Q4_0 kernels), and the output is the f32 load's of the same file, token for
/// token.
#[test]
fn a_quantization_type_without_a_kernel_is_dequantised_at_load_and_reported() {
    use candle_core::Device;
    use candle_core::quantized::{GgmlDType, QTensor, gguf_file};

    let (name, q4_0) = ("blk.3.ffn_down.weight", "blk.5.ffn_down.weight");
    let mut file = std::fs::File::open(model_path()).unwrap();
    let content = gguf_file::Content::read(&mut file).unwrap();
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    for n in content.tensor_infos.keys() {
        let mut t = content.tensor(&mut file, n, &Device::Cpu).unwrap();
        if n == name || n == q4_0 {
            let to = if n == name { GgmlDType::Q5_0 } else { GgmlDType::Q4_0 };
            t = QTensor::quantize(&t.dequantize(&Device::Cpu).unwrap(), to).unwrap();
        }
        tensors.push((n.clone(), t));
    }
    let path = std::env::temp_dir().join(format!("tandem-q5_0-{}.gguf", std::process::id()));
    {
        let mut out = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
        let meta: Vec<(&str, &gguf_file::Value)> = content.metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let ts: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
        gguf_file::write(&mut out, &meta, &ts).unwrap();
    }
    let src = ModelSource::Path(path.clone());
    let auto = loader::load(&src, DtypeChoice::Auto);
    let f32w = loader::load(&src, WeightDtype::F32);
    let _ = std::fs::remove_file(&path);
    let (auto, f32w) = (auto.unwrap(), f32w.unwrap());

    assert_eq!(auto.dequantized_types, vec!["Q5_0".to_string()]);
    assert!(f32w.dequantized_types.is_empty(), "a fixed dtype converts everything and reports nothing");
    for (i, l) in auto.weights.layers.iter().enumerate() {
        let want = match i {
            3 => WeightDtype::F32,
            5 => WeightDtype::Q4_0,
            _ => WeightDtype::Q4_1,
        };
        assert_eq!(l.down.dtype(), want, "layer {i} ffn_down");
        assert_eq!(l.gate_up.dtype(), WeightDtype::Q4_1, "layer {i} gate_up keeps the file's type");
    }
    let mut a = Engine::new(Model::new(auto.weights), auto.tokenizer, config(KvDtype::F32, 64)).unwrap();
    let mut f = Engine::new(Model::new(f32w.weights), f32w.tokenizer, config(KvDtype::F32, 64)).unwrap();
    let prompts = test_prompts(&f);
    for p in prompts.iter().take(2) {
        let want = run(&mut f, vec![greedy(1, p.clone(), 8)]).remove(0).tokens;
        let got = run(&mut a, vec![greedy(1, p.clone(), 8)]).remove(0).tokens;
        assert_eq!(got, want, "auto (Q4_1 and Q4_0 kernels, a dequantised Q5_0 tensor) against f32");
    }
}
