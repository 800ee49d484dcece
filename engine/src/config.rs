//! Model configuration: the shape of a Llama-family decoder, read from a GGUF's metadata, from a
//! Hugging Face `config.json`, or from a hand-written config for `--dummy-weights`.
//!
//! Field names follow Hugging Face's `LlamaConfig` so a `config.json` deserialises directly, and
//! the same struct (or a scaled copy of a real model's) is what a dummy-weights run takes.

use std::path::Path;

use candle_core::quantized::gguf_file;
use serde::{Deserialize, Serialize};

use crate::error::EngineError;

fn default_rope_theta() -> f64 {
    10_000.0
}
fn default_rms_eps() -> f64 {
    1e-5
}
fn default_max_pos() -> usize {
    2048
}

/// The shape and constants of a Llama-family decoder.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the MLP's gate/up projections.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// KV heads (GQA); equals `num_attention_heads` for plain multi-head attention.
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    /// Elements per head; `hidden_size / num_attention_heads` when absent.
    #[serde(default)]
    pub head_dim: Option<usize>,
    /// Vocabulary size (rows of the embedding and of the LM head).
    pub vocab_size: usize,
    /// RoPE base frequency.
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f64,
    /// RMSNorm epsilon.
    #[serde(default = "default_rms_eps")]
    pub rms_norm_eps: f64,
    /// Longest context the model was trained for.
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: usize,
    /// Whether the LM head reuses the token embedding matrix.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Beginning-of-sequence token (not added to prompts unless the tokenizer says so).
    #[serde(default)]
    pub bos_token_id: Option<u32>,
    /// End-of-sequence token(s); HF configs give a number or a list.
    #[serde(default, deserialize_with = "de_eos")]
    pub eos_token_id: Vec<u32>,
}

fn de_eos<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<u32>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(u32),
        Many(Vec<u32>),
        None,
    }
    Ok(match Option::<OneOrMany>::deserialize(d)? {
        Some(OneOrMany::One(x)) => vec![x],
        Some(OneOrMany::Many(v)) => v,
        Some(OneOrMany::None) | None => vec![],
    })
}

impl ModelConfig {
    /// KV heads per layer.
    pub fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// Elements per attention head.
    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// Rows of the fused QKV projection: (heads + 2 × kv heads) × head dim.
    pub fn qkv_rows(&self) -> usize {
        (self.num_attention_heads + 2 * self.kv_heads()) * self.head_dim()
    }

    /// Parameters in the model (the tied embedding counted once).
    pub fn param_count(&self) -> u64 {
        let (h, i, v) = (self.hidden_size as u64, self.intermediate_size as u64, self.vocab_size as u64);
        let attn = h * self.qkv_rows() as u64 + (self.num_attention_heads * self.head_dim()) as u64 * h;
        let mlp = 3 * h * i;
        let per_layer = attn + mlp + 2 * h;
        let head = if self.tie_word_embeddings { 0 } else { v * h };
        v * h + self.num_hidden_layers as u64 * per_layer + h + head
    }

    /// Checks the shape is self-consistent; names the field that is not.
    pub fn validate(&self) -> Result<(), EngineError> {
        let bad = |field: &'static str, value: usize, reason: &str| {
            Err(EngineError::InvalidConfig { field, value: value.to_string(), reason: reason.into() })
        };
        for (field, v) in [
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("vocab_size", self.vocab_size),
            ("max_position_embeddings", self.max_position_embeddings),
        ] {
            if v == 0 {
                return bad(field, v, "must be > 0");
            }
        }
        let kv = self.kv_heads();
        if kv == 0 || !self.num_attention_heads.is_multiple_of(kv) {
            return bad("num_key_value_heads", kv, "must divide num_attention_heads");
        }
        let hd = self.head_dim();
        if hd == 0 || !hd.is_multiple_of(2) {
            return bad("head_dim", hd, "must be a positive even number (RoPE rotates pairs)");
        }
        let positive = |x: f64| x > 0.0; // false for NaN as well
        if !positive(self.rms_norm_eps) || !positive(self.rope_theta) {
            return Err(EngineError::InvalidConfig {
                field: "rope_theta/rms_norm_eps",
                value: format!("{}/{}", self.rope_theta, self.rms_norm_eps),
                reason: "must be positive".into(),
            });
        }
        Ok(())
    }

    /// Reads a config from a HF-style `config.json` (also the format of `--dummy-weights` files).
    pub fn from_json_file(path: &Path) -> Result<Self, EngineError> {
        let text = std::fs::read_to_string(path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => EngineError::ModelNotFound { path: path.into() },
            _ => EngineError::io(path, e),
        })?;
        let value: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
            EngineError::ModelFormat { path: path.into(), reason: format!("config JSON: {e}") }
        })?;
        if let Some(archs) = value.get("architectures").and_then(|a| a.as_array()) {
            let known = archs.iter().filter_map(|a| a.as_str()).any(|a| {
                matches!(a, "LlamaForCausalLM" | "MistralForCausalLM")
            });
            if !known {
                return Err(EngineError::UnsupportedArchitecture(format!("{archs:?}")));
            }
        }
        let cfg: ModelConfig = serde_json::from_value(value).map_err(|e| {
            EngineError::ModelFormat { path: path.into(), reason: format!("config fields: {e}") }
        })?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads a config from a GGUF's metadata (`{arch}.block_count`, `{arch}.embedding_length`, ...).
    pub fn from_gguf(content: &gguf_file::Content, path: &Path) -> Result<Self, EngineError> {
        let md = &content.metadata;
        let arch = md
            .get("general.architecture")
            .and_then(|v| v.to_string().ok())
            .cloned()
            .ok_or_else(|| EngineError::ModelFormat {
                path: path.into(),
                reason: "missing general.architecture".into(),
            })?;
        if !matches!(arch.as_str(), "llama" | "mistral") {
            return Err(EngineError::UnsupportedArchitecture(arch));
        }
        let get = |key: &str| -> Result<&gguf_file::Value, EngineError> {
            md.get(&format!("{arch}.{key}")).ok_or_else(|| EngineError::ModelFormat {
                path: path.into(),
                reason: format!("missing metadata {arch}.{key}"),
            })
        };
        let as_usize = |key: &str| -> Result<usize, EngineError> {
            gguf_usize(get(key)?).ok_or_else(|| EngineError::ModelFormat {
                path: path.into(),
                reason: format!("metadata {arch}.{key} is not an integer"),
            })
        };
        let heads = as_usize("attention.head_count")?;
        let hidden = as_usize("embedding_length")?;
        let vocab = match md.get(&format!("{arch}.vocab_size")).and_then(gguf_usize) {
            Some(v) => v,
            None => md
                .get("tokenizer.ggml.tokens")
                .and_then(|t| t.to_vec().ok())
                .map(|t| t.len())
                .ok_or_else(|| EngineError::ModelFormat {
                    path: path.into(),
                    reason: "no vocab size in metadata".into(),
                })?,
        };
        let cfg = ModelConfig {
            hidden_size: hidden,
            intermediate_size: as_usize("feed_forward_length")?,
            num_hidden_layers: as_usize("block_count")?,
            num_attention_heads: heads,
            num_key_value_heads: Some(
                get("attention.head_count_kv").ok().and_then(gguf_usize).unwrap_or(heads),
            ),
            head_dim: Some(
                md.get(&format!("{arch}.attention.key_length"))
                    .and_then(gguf_usize)
                    .unwrap_or(hidden / heads.max(1)),
            ),
            vocab_size: vocab,
            rope_theta: md
                .get(&format!("{arch}.rope.freq_base"))
                .and_then(gguf_f64)
                .unwrap_or(10_000.0),
            rms_norm_eps: md
                .get(&format!("{arch}.attention.layer_norm_rms_epsilon"))
                .and_then(gguf_f64)
                .unwrap_or(1e-5),
            max_position_embeddings: get("context_length").ok().and_then(gguf_usize).unwrap_or(2048),
            tie_word_embeddings: !content.tensor_infos.contains_key("output.weight"),
            bos_token_id: md.get("tokenizer.ggml.bos_token_id").and_then(gguf_usize).map(|v| v as u32),
            eos_token_id: md
                .get("tokenizer.ggml.eos_token_id")
                .and_then(gguf_usize)
                .map(|v| vec![v as u32])
                .unwrap_or_default(),
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads the config of whatever `path` is: a `.gguf` file, a HF directory (its
    /// `config.json`), or a config `.json` file.
    pub fn from_path(path: &Path) -> Result<Self, EngineError> {
        if !path.exists() {
            return Err(EngineError::ModelNotFound { path: path.into() });
        }
        if path.is_dir() {
            return Self::from_json_file(&path.join("config.json"));
        }
        if path.extension().is_some_and(|e| e == "json") {
            return Self::from_json_file(path);
        }
        let (content, _) = crate::loader::gguf::open(path)?;
        Self::from_gguf(&content, path)
    }
}

fn gguf_usize(v: &gguf_file::Value) -> Option<usize> {
    use gguf_file::Value::*;
    match *v {
        U8(x) => Some(x as usize),
        U16(x) => Some(x as usize),
        U32(x) => Some(x as usize),
        U64(x) => usize::try_from(x).ok(),
        I8(x) => usize::try_from(x).ok(),
        I16(x) => usize::try_from(x).ok(),
        I32(x) => usize::try_from(x).ok(),
        I64(x) => usize::try_from(x).ok(),
        _ => None,
    }
}

fn gguf_f64(v: &gguf_file::Value) -> Option<f64> {
    match *v {
        gguf_file::Value::F32(x) => Some(x as f64),
        gguf_file::Value::F64(x) => Some(x),
        _ => gguf_usize(v).map(|x| x as f64),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn smollm2() -> ModelConfig {
        ModelConfig {
            hidden_size: 576,
            intermediate_size: 1536,
            num_hidden_layers: 30,
            num_attention_heads: 9,
            num_key_value_heads: Some(3),
            head_dim: None,
            vocab_size: 49_152,
            rope_theta: 100_000.0,
            rms_norm_eps: 1e-5,
            max_position_embeddings: 8192,
            tie_word_embeddings: true,
            bos_token_id: Some(1),
            eos_token_id: vec![2],
        }
    }

    #[test]
    fn smollm2_has_134_million_parameters_and_64_dim_heads() {
        let c = smollm2();
        assert_eq!(c.head_dim(), 64);
        assert_eq!(c.qkv_rows(), 960);
        assert_eq!(c.param_count(), 134_515_008);
    }

    #[test]
    fn hf_config_json_parses_with_eos_as_number_or_list() {
        let one = r#"{"architectures":["LlamaForCausalLM"],"hidden_size":64,"intermediate_size":128,
            "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":100,
            "eos_token_id":2}"#;
        let c: ModelConfig = serde_json::from_str(one).unwrap();
        assert_eq!(c.eos_token_id, vec![2]);
        assert_eq!(c.kv_heads(), 2);
        let many = one.replace("\"eos_token_id\":2", "\"eos_token_id\":[2,7]");
        let c: ModelConfig = serde_json::from_str(&many).unwrap();
        assert_eq!(c.eos_token_id, vec![2, 7]);
    }

    #[test]
    fn validation_names_the_bad_field() {
        let mut c = smollm2();
        c.num_key_value_heads = Some(4);
        match c.validate() {
            Err(EngineError::InvalidConfig { field, .. }) => assert_eq!(field, "num_key_value_heads"),
            other => panic!("{other:?}"),
        }
        let mut c = smollm2();
        c.num_hidden_layers = 0;
        assert!(matches!(c.validate(), Err(EngineError::InvalidConfig { field: "num_hidden_layers", .. })));
    }
}
