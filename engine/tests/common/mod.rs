//! Shared helpers of the engine's integration tests: find the real model and the Python
//! reference, build engines. A missing model or Python package fails the test with the command
//! that fixes it; nothing is skipped.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use tandem_engine::{
    Completion, Engine, EngineConfig, KvCapacity, KvDtype, Model, ModelSource, Priority, Request,
    SamplingParams, SchedulerConfig, TokenLogprob, WeightDtype, loader,
};

/// The real model: `$TANDEM_MODEL`, else the default cache location.
pub fn model_path() -> PathBuf {
    let p = std::env::var_os("TANDEM_MODEL").map(PathBuf::from).unwrap_or_else(|| {
        let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_default();
        home.join(".cache/tandem/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    });
    assert!(
        p.exists(),
        "the real model is missing at {}: run `scripts/setup.sh` (or `cargo run -p tandem-cli -- model fetch`)",
        p.display()
    );
    p
}

/// The repository root.
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// The Python interpreter with the reference's packages (`$TANDEM_PYTHON`, else python3).
pub fn python() -> String {
    std::env::var("TANDEM_PYTHON").unwrap_or_else(|_| "python3".into())
}

/// Runs a script from tests/reference with arguments, returns stdout; fails loudly.
pub fn run_reference(script: &str, args: &[String]) -> String {
    let path = repo_root().join("tests/reference").join(script);
    let out = Command::new(python())
        .arg(&path)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {} with {}: {e}; run scripts/setup.sh", path.display(), python()));
    assert!(
        out.status.success(),
        "{} failed ({}): {}\nInstall its packages with scripts/setup.sh (TANDEM_PYTHON={}).",
        script,
        out.status,
        String::from_utf8_lossy(&out.stderr),
        python()
    );
    String::from_utf8(out.stdout).expect("reference prints UTF-8")
}

/// Engine settings for tests: small pool, prefix caching on.
pub fn config(kv_dtype: KvDtype, blocks: usize) -> EngineConfig {
    EngineConfig {
        block_size_tokens: 16,
        kv_dtype,
        kv_capacity: KvCapacity::Blocks(blocks),
        scheduler: SchedulerConfig { max_model_len: 8192, ..SchedulerConfig::default() },
    }
}

/// Loads the real model and builds an engine.
pub fn engine(dtype: WeightDtype, cfg: EngineConfig) -> Engine {
    let loaded = loader::load(&ModelSource::Path(model_path()), dtype).expect("load the real model");
    Engine::new(Model::new(loaded.weights), loaded.tokenizer, cfg).expect("build engine")
}

/// A greedy request.
pub fn greedy(id: u64, prompt: Vec<u32>, max_new: usize) -> Request {
    Request {
        id,
        prompt,
        params: SamplingParams { ignore_eos: true, ..SamplingParams::greedy(max_new) },
        priority: Priority::Interactive,
    }
}

/// Runs requests to completion.
pub fn run(engine: &mut Engine, reqs: Vec<Request>) -> Vec<Completion> {
    engine.generate(reqs, |_| {}).expect("generation succeeds")
}

/// Chat prompts (ChatML with the default system message) and plain prompts used across tests.
pub const CHAT_PROMPTS: &[&str] = &[
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why they are prime.",
];
/// Plain-text prompts.
pub const PLAIN_PROMPTS: &[&str] = &[
    "The quick brown fox",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "In 1969, the first humans landed on",
];

/// Token ids of every test prompt (chat ones templated), in CHAT then PLAIN order.
pub fn test_prompts(engine: &Engine) -> Vec<Vec<u32>> {
    use tandem_engine::tokenizer::ChatMessage;
    let tok = engine.tokenizer().expect("real model has a tokenizer");
    let mut out = Vec::new();
    for p in CHAT_PROMPTS {
        let msgs = [ChatMessage { role: "user".into(), content: (*p).into() }];
        out.push(tok.encode(&tok.apply_chat_template(&msgs, true).unwrap()));
    }
    for p in PLAIN_PROMPTS {
        out.push(tok.encode(p));
    }
    out
}

/// Greedy tokens of the independent numpy reference (tests/reference/llama_ref.py), EOS ignored.
pub fn reference_tokens(prompt: &[u32], max_new: usize) -> Vec<u32> {
    let ids = prompt.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(",");
    let out = run_reference(
        "llama_ref.py",
        &["--model".into(), model_path().display().to_string(), "--ids".into(), ids, "--max-new".into(), max_new.to_string(), "--ignore-eos".into()],
    );
    let v: serde_json::Value = serde_json::from_str(out.trim().lines().last().unwrap()).expect("reference JSON");
    v["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect()
}

/// Copies blocks' bytes between two engines' host pools, as kv-transfer does between nodes.
pub fn copy_blocks(src: &Engine, src_blocks: &[u32], dst: &mut Engine, dst_blocks: &[u32]) {
    for layer in 0..src.kv_layout().num_layers {
        for (&s, &d) in src_blocks.iter().zip(dst_blocks) {
            let from = src.kv_pool().expect("a host pool (the KV, or its mirror)").slab(layer, s);
            dst.kv_pool_mut().expect("a host pool (the KV, or its mirror)").slab_mut(layer, d).copy_from_slice(from);
        }
    }
}

/// Tokens of `req`, one engine prefilling and the other decoding.
pub fn disaggregated(prefill: &mut Engine, decode: &mut Engine, req: Request) -> Vec<u32> {
    disaggregated_with_logprobs(prefill, decode, req).0
}

/// Tokens and (when the request asks) their log probabilities, one engine prefilling and the
/// other decoding.
pub fn disaggregated_with_logprobs(
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
