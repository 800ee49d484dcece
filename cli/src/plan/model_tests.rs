//! Tests of the GGUF and Hugging Face readers, on synthetic files and on the served model.

use super::*;
use std::path::PathBuf;

/// The served model, SmolLM2-135M-Instruct Q4_1, where `tandem model fetch` puts it.
const SMOLLM2_GGUF: &str = "/root/.cache/tandem/models/SmolLM2-135M-Instruct.Q4_1.gguf";

/// A scratch directory unique to this process and test, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("tandem-plan-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create scratch dir");
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Metadata values the writer can emit.
enum Meta<'a> {
    U32(u32),
    Str(&'a str),
    StrArray(&'a [&'a str]),
    F32Array(&'a [f32]),
}

fn gguf_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// Writes a GGUF v3 header with `meta` and tensors of the given shapes (no tensor data).
fn gguf_bytes(meta: &[(&str, Meta)], tensors: &[&[u64]]) -> Vec<u8> {
    let mut out = b"GGUF".to_vec();
    out.extend_from_slice(&3u32.to_le_bytes());
    out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    out.extend_from_slice(&(meta.len() as u64).to_le_bytes());
    for (key, value) in meta {
        gguf_string(&mut out, key);
        match value {
            Meta::U32(v) => {
                out.extend_from_slice(&4u32.to_le_bytes());
                out.extend_from_slice(&v.to_le_bytes());
            }
            Meta::Str(s) => {
                out.extend_from_slice(&8u32.to_le_bytes());
                gguf_string(&mut out, s);
            }
            Meta::StrArray(items) => {
                out.extend_from_slice(&9u32.to_le_bytes());
                out.extend_from_slice(&8u32.to_le_bytes());
                out.extend_from_slice(&(items.len() as u64).to_le_bytes());
                items.iter().for_each(|s| gguf_string(&mut out, s));
            }
            Meta::F32Array(items) => {
                out.extend_from_slice(&9u32.to_le_bytes());
                out.extend_from_slice(&6u32.to_le_bytes());
                out.extend_from_slice(&(items.len() as u64).to_le_bytes());
                items
                    .iter()
                    .for_each(|v| out.extend_from_slice(&v.to_le_bytes()));
            }
        }
    }
    for (i, dims) in tensors.iter().enumerate() {
        gguf_string(&mut out, &format!("t{i}"));
        out.extend_from_slice(&(dims.len() as u32).to_le_bytes());
        dims.iter()
            .for_each(|d| out.extend_from_slice(&d.to_le_bytes()));
        out.extend_from_slice(&0u32.to_le_bytes());
        out.extend_from_slice(&0u64.to_le_bytes());
    }
    out
}

fn llama_meta<'a>() -> Vec<(&'a str, Meta<'a>)> {
    vec![
        ("general.architecture", Meta::Str("llama")),
        ("tokenizer.ggml.tokens", Meta::StrArray(&["a", "bb", "ccc"])),
        ("tokenizer.ggml.scores", Meta::F32Array(&[0.5, 1.5, 2.5])),
        ("llama.block_count", Meta::U32(80)),
        ("llama.embedding_length", Meta::U32(8192)),
        ("llama.attention.head_count", Meta::U32(64)),
        ("llama.attention.head_count_kv", Meta::U32(8)),
    ]
}

#[test]
fn gguf_shape_and_param_count_come_from_metadata_and_tensor_table() {
    let dir = Scratch::new("gguf-llama");
    let path = dir.0.join("m.gguf");
    std::fs::write(
        &path,
        gguf_bytes(&llama_meta(), &[&[8192, 1000], &[8192], &[7, 3, 2]]),
    )
    .unwrap();
    let info = read_model(&path).unwrap();
    assert_eq!(
        info.shape,
        ModelShape {
            num_layers: 80,
            num_kv_heads: 8,
            head_dim: 128
        }
    );
    assert_eq!(info.param_count, Some(8_192_000 + 8192 + 42));
    assert_eq!(
        info.format,
        ModelFormat::Gguf {
            architecture: "llama".into()
        }
    );
}

#[test]
fn gguf_key_length_wins_over_embedding_over_heads_and_kv_heads_default_to_heads() {
    let dir = Scratch::new("gguf-keylen");
    let path = dir.0.join("m.gguf");
    let mut meta: Vec<_> = llama_meta()
        .into_iter()
        .filter(|(k, _)| !k.ends_with("head_count_kv"))
        .collect();
    meta.push(("llama.attention.key_length", Meta::U32(96)));
    meta.push(("llama.rope.dimension_count", Meta::U32(32)));
    std::fs::write(&path, gguf_bytes(&meta, &[])).unwrap();
    let info = read_model(&path).unwrap();
    assert_eq!(
        info.shape,
        ModelShape {
            num_layers: 80,
            num_kv_heads: 64,
            head_dim: 96
        }
    );
    assert_eq!(info.param_count, Some(0));
}

#[test]
fn gguf_without_block_count_names_the_missing_key() {
    let dir = Scratch::new("gguf-missing");
    let path = dir.0.join("m.gguf");
    let meta: Vec<_> = llama_meta()
        .into_iter()
        .filter(|(k, _)| *k != "llama.block_count")
        .collect();
    std::fs::write(&path, gguf_bytes(&meta, &[])).unwrap();
    match read_model(&path) {
        Err(PlanError::ModelFieldMissing { key, .. }) => assert_eq!(key, "llama.block_count"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn truncated_gguf_is_reported_as_malformed_with_an_offset() {
    let dir = Scratch::new("gguf-trunc");
    let path = dir.0.join("m.gguf");
    let bytes = gguf_bytes(&llama_meta(), &[&[4, 4]]);
    std::fs::write(&path, &bytes[..bytes.len() - 5]).unwrap();
    match read_model(&path) {
        Err(PlanError::GgufMalformed { offset, reason, .. }) => {
            assert!(
                offset > 0 && reason.contains("ends inside"),
                "{offset} {reason}"
            )
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn served_smollm2_gguf_has_30_layers_3_kv_heads_head_dim_64() {
    let path = Path::new(SMOLLM2_GGUF);
    assert!(
        path.is_file(),
        "{SMOLLM2_GGUF} missing: fetch it with `tandem model fetch` (see README.md)"
    );
    let info = read_model(path).unwrap();
    assert_eq!(
        info.shape,
        ModelShape {
            num_layers: 30,
            num_kv_heads: 3,
            head_dim: 64
        }
    );
    let params = info.param_count.unwrap();
    // 134.5M parameters (embeddings tied): 30 × 3.54M per layer + 28.3M embedding + norms.
    assert!((134_000_000..135_000_000).contains(&params), "{params}");
}

fn write_safetensors(path: &Path, header: &str) {
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn hf_directory_reads_config_and_counts_safetensors_params() {
    let dir = Scratch::new("hf");
    std::fs::write(
        dir.0.join("config.json"),
        r#"{"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
            "hidden_size": 576, "torch_dtype": "bfloat16"}"#,
    )
    .unwrap();
    write_safetensors(
        &dir.0.join("model-00001-of-00002.safetensors"),
        r#"{"__metadata__": {"format": "pt"}, "a": {"dtype": "BF16", "shape": [576, 49152], "data_offsets": [0, 1]}}"#,
    );
    write_safetensors(
        &dir.0.join("model-00002-of-00002.safetensors"),
        r#"{"b": {"dtype": "BF16", "shape": [576], "data_offsets": [0, 1]}}"#,
    );
    let info = read_model(&dir.0).unwrap();
    assert_eq!(
        info.shape,
        ModelShape {
            num_layers: 30,
            num_kv_heads: 3,
            head_dim: 64
        }
    );
    assert_eq!(info.param_count, Some(576 * 49152 + 576));
    assert_eq!(
        info.format,
        ModelFormat::HuggingFace {
            safetensors_files: 2
        }
    );
    // The config.json path itself works too.
    assert_eq!(
        read_model(&dir.0.join("config.json")).unwrap().shape,
        info.shape
    );
}

#[test]
fn hf_text_config_and_explicit_head_dim_are_honoured_without_safetensors() {
    let dir = Scratch::new("hf-nested");
    std::fs::write(
        dir.0.join("config.json"),
        r#"{"text_config": {"num_hidden_layers": 62, "num_attention_heads": 32,
            "num_key_value_heads": 16, "hidden_size": 5376, "head_dim": 128}}"#,
    )
    .unwrap();
    let info = read_model(&dir.0).unwrap();
    assert_eq!(
        info.shape,
        ModelShape {
            num_layers: 62,
            num_kv_heads: 16,
            head_dim: 128
        }
    );
    assert_eq!(info.param_count, None);
}

#[test]
fn unreadable_or_unrecognised_model_paths_are_typed_errors() {
    let dir = Scratch::new("bad");
    assert!(matches!(
        read_model(&dir.0.join("nope.gguf")),
        Err(PlanError::ModelRead { .. })
    ));
    assert!(
        matches!(
            read_model(&dir.0),
            Err(PlanError::UnknownModelFormat { .. })
        ),
        "no config.json"
    );
    std::fs::write(dir.0.join("weights.bin"), b"not a model").unwrap();
    assert!(matches!(
        read_model(&dir.0.join("weights.bin")),
        Err(PlanError::UnknownModelFormat { .. })
    ));
    std::fs::write(dir.0.join("config.json"), b"{not json").unwrap();
    assert!(matches!(
        read_model(&dir.0),
        Err(PlanError::JsonMalformed { .. })
    ));
    std::fs::write(
        dir.0.join("config.json"),
        br#"{"num_hidden_layers": 0, "num_attention_heads": 4, "hidden_size": 64}"#,
    )
    .unwrap();
    assert!(matches!(
        read_model(&dir.0),
        Err(PlanError::InvalidValue {
            field: "model layer count",
            ..
        })
    ));
}
