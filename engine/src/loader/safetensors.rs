//! Hugging Face checkpoints: a directory with `config.json`, one or more `*.safetensors` files and
//! `tokenizer.json`. Tensors may be f32, f16 or bf16; they are widened to f32 and converted to the
//! compute dtype. Tensor names follow `LlamaForCausalLM` (`model.layers.{i}.self_attn.q_proj.weight`).

use std::path::{Path, PathBuf};

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device};
use tandem_kernels::WeightDtype;

use super::{LayerWeights, LoadedModel, ModelWeights, fingerprint, weight};
use crate::config::ModelConfig;
use crate::error::EngineError;
use crate::tokenizer::Tokenizer;

struct Reader {
    st: MmapedSafetensors,
    dir: PathBuf,
}

impl Reader {
    fn read(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, EngineError> {
        let t = self.st.load(name, &Device::Cpu).map_err(|e| {
            if e.to_string().contains("cannot find tensor") {
                EngineError::MissingTensor { name: name.to_string() }
            } else {
                EngineError::ModelFormat { path: self.dir.clone(), reason: format!("tensor `{name}`: {e}") }
            }
        })?;
        if t.dims() != shape {
            return Err(EngineError::TensorShape {
                name: name.to_string(),
                expected: shape.to_vec(),
                got: t.dims().to_vec(),
            });
        }
        let bad = |e: candle_core::Error| EngineError::ModelFormat {
            path: self.dir.clone(),
            reason: format!("tensor `{name}`: {e}"),
        };
        t.to_dtype(DType::F32).and_then(|t| t.flatten_all()).and_then(|t| t.to_vec1::<f32>()).map_err(bad)
    }

    fn has(&self, name: &str) -> bool {
        self.st.get(name).is_ok()
    }
}

/// Loads a HF Llama directory in `dtype`.
pub fn load_dir(dir: &Path, dtype: WeightDtype) -> Result<LoadedModel, EngineError> {
    let config = ModelConfig::from_json_file(&dir.join("config.json"))?;
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| EngineError::io(dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(EngineError::ModelFormat { path: dir.into(), reason: "no *.safetensors files".into() });
    }
    let mut content_hash = 0u64;
    for f in &files {
        content_hash = content_hash.rotate_left(17) ^ super::gguf::hash_file(f)?;
    }
    // SAFETY: read-only maps of files we just listed; see `MmapedSafetensors::multi`.
    let st = unsafe { MmapedSafetensors::multi(&files) }
        .map_err(|e| EngineError::ModelFormat { path: dir.into(), reason: e.to_string() })?;
    let r = Reader { st, dir: dir.into() };
    let tokenizer = Tokenizer::from_hf_json(&dir.join("tokenizer.json"))?;

    let (h, inter, vocab) = (config.hidden_size, config.intermediate_size, config.vocab_size);
    let (heads, kv, hd) = (config.num_attention_heads, config.kv_heads(), config.head_dim());
    let embed_name = "model.embed_tokens.weight";
    let embed = weight(embed_name, vocab, h, r.read(embed_name, &[vocab, h])?, dtype)?;
    let mut layers = Vec::with_capacity(config.num_hidden_layers);
    for i in 0..config.num_hidden_layers {
        let p = |s: &str| format!("model.layers.{i}.{s}.weight");
        let qkv = [
            r.read(&p("self_attn.q_proj"), &[heads * hd, h])?,
            r.read(&p("self_attn.k_proj"), &[kv * hd, h])?,
            r.read(&p("self_attn.v_proj"), &[kv * hd, h])?,
        ]
        .concat();
        let gate_up =
            [r.read(&p("mlp.gate_proj"), &[inter, h])?, r.read(&p("mlp.up_proj"), &[inter, h])?].concat();
        layers.push(LayerWeights {
            attn_norm: r.read(&p("input_layernorm"), &[h])?,
            qkv: weight(&p("self_attn.qkv_proj"), config.qkv_rows(), h, qkv, dtype)?,
            o_proj: weight(&p("self_attn.o_proj"), h, heads * hd, r.read(&p("self_attn.o_proj"), &[h, heads * hd])?, dtype)?,
            mlp_norm: r.read(&p("post_attention_layernorm"), &[h])?,
            gate_up: weight(&p("mlp.gate_up_proj"), 2 * inter, h, gate_up, dtype)?,
            down: weight(&p("mlp.down_proj"), h, inter, r.read(&p("mlp.down_proj"), &[h, inter])?, dtype)?,
        });
    }
    let final_norm = r.read("model.norm.weight", &[h])?;
    let lm_head = if config.tie_word_embeddings || !r.has("lm_head.weight") {
        None
    } else {
        Some(weight("lm_head.weight", vocab, h, r.read("lm_head.weight", &[vocab, h])?, dtype)?)
    };
    let fingerprint = fingerprint(content_hash, &config, dtype);
    Ok(LoadedModel {
        weights: ModelWeights { config, embed, layers, final_norm, lm_head, fingerprint },
        tokenizer: Some(tokenizer),
        dequantized_types: Vec::new(),
    })
}
