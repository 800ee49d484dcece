//! GGUF checkpoints (llama.cpp's format): metadata, tokenizer and (quantised) tensors, read through
//! candle-core's GGUF reader and dequantised to f32 before conversion to the compute dtype.
//!
//! Cost: one pass over the file to hash it (the fingerprint) and one to read tensors; for the
//! default 98 MB SmolLM2 file that is well under a second.

use std::fs::File;
use std::io::BufReader;
use std::path::Path;

use candle_core::Device;
use candle_core::quantized::gguf_file::Content;
use tandem_kernels::WeightDtype;

use super::{LayerWeights, LoadedModel, ModelWeights, fingerprint, require_file, unpermute_rows, weight};
use crate::config::ModelConfig;
use crate::error::EngineError;
use crate::tokenizer::Tokenizer;

/// Opens a GGUF file and reads its header (metadata and tensor directory).
pub fn open(path: &Path) -> Result<(Content, BufReader<File>), EngineError> {
    require_file(path)?;
    let file = File::open(path).map_err(|e| EngineError::io(path, e))?;
    let mut reader = BufReader::new(file);
    let content = Content::read(&mut reader).map_err(|e| EngineError::ModelFormat {
        path: path.into(),
        reason: format!("not a readable GGUF file: {e}"),
    })?;
    Ok((content, reader))
}

struct Reader<'a> {
    content: &'a Content,
    file: BufReader<File>,
    path: &'a Path,
}

impl Reader<'_> {
    /// Reads tensor `name` as f32, checking its shape (`[rows, cols]` or `[len]`).
    fn read(&mut self, name: &str, shape: &[usize]) -> Result<Vec<f32>, EngineError> {
        if !self.content.tensor_infos.contains_key(name) {
            return Err(EngineError::MissingTensor { name: name.to_string() });
        }
        let bad = |e: candle_core::Error| EngineError::ModelFormat {
            path: self.path.into(),
            reason: format!("tensor `{name}`: {e}"),
        };
        let q = self.content.tensor(&mut self.file, name, &Device::Cpu).map_err(bad)?;
        let dims = q.shape().dims().to_vec();
        if dims != shape {
            return Err(EngineError::TensorShape {
                name: name.to_string(),
                expected: shape.to_vec(),
                got: dims,
            });
        }
        let t = q.dequantize(&Device::Cpu).map_err(bad)?;
        let data = t.flatten_all().and_then(|t| t.to_vec1::<f32>()).map_err(bad)?;
        if let Some(i) = data.iter().position(|x| !x.is_finite()) {
            return Err(EngineError::ModelFormat {
                path: self.path.into(),
                reason: format!("tensor `{name}` has a non-finite value at element {i}"),
            });
        }
        Ok(data)
    }
}

/// The tokenizer embedded in the GGUF at `path` (its metadata read once more, with the
/// tokenizer crate's own reader: the one the router uses too).
pub fn tokenizer_of(path: &Path) -> Result<Tokenizer, EngineError> {
    let meta = crate::tokenizer::GgufMetadata::read(path).map_err(|e| EngineError::ModelFormat {
        path: path.into(),
        reason: e.to_string(),
    })?;
    Ok(Tokenizer::from_gguf(&meta)?)
}

/// Loads a Llama-family GGUF: config, tokenizer and weights in `dtype`.
pub fn load(path: &Path, dtype: WeightDtype) -> Result<LoadedModel, EngineError> {
    let content_hash = hash_file(path)?;
    let (content, file) = open(path)?;
    let config = ModelConfig::from_gguf(&content, path)?;
    let tokenizer = tokenizer_of(path)?;
    let mut r = Reader { content: &content, file, path };

    let (h, inter, vocab) = (config.hidden_size, config.intermediate_size, config.vocab_size);
    let (heads, kv, hd) = (config.num_attention_heads, config.kv_heads(), config.head_dim());
    let embed = weight("token_embd.weight", vocab, h, r.read("token_embd.weight", &[vocab, h])?, dtype)?;
    let mut layers = Vec::with_capacity(config.num_hidden_layers);
    for i in 0..config.num_hidden_layers {
        let p = |s: &str| format!("blk.{i}.{s}.weight");
        let q = unpermute_rows(&r.read(&p("attn_q"), &[heads * hd, h])?, heads, hd, h);
        let k = unpermute_rows(&r.read(&p("attn_k"), &[kv * hd, h])?, kv, hd, h);
        let v = r.read(&p("attn_v"), &[kv * hd, h])?;
        let qkv = [q, k, v].concat();
        let gate_up = [r.read(&p("ffn_gate"), &[inter, h])?, r.read(&p("ffn_up"), &[inter, h])?].concat();
        layers.push(LayerWeights {
            attn_norm: r.read(&p("attn_norm"), &[h])?,
            qkv: weight(&p("attn_qkv"), config.qkv_rows(), h, qkv, dtype)?,
            o_proj: weight(&p("attn_output"), h, heads * hd, r.read(&p("attn_output"), &[h, heads * hd])?, dtype)?,
            mlp_norm: r.read(&p("ffn_norm"), &[h])?,
            gate_up: weight(&p("ffn_gate_up"), 2 * inter, h, gate_up, dtype)?,
            down: weight(&p("ffn_down"), h, inter, r.read(&p("ffn_down"), &[h, inter])?, dtype)?,
        });
    }
    let final_norm = r.read("output_norm.weight", &[h])?;
    let lm_head = if config.tie_word_embeddings {
        None
    } else {
        Some(weight("output.weight", vocab, h, r.read("output.weight", &[vocab, h])?, dtype)?)
    };
    let fingerprint = fingerprint(content_hash, &config, dtype);
    Ok(LoadedModel {
        weights: ModelWeights { config, embed, layers, final_norm, lm_head, fingerprint },
        tokenizer: Some(tokenizer),
    })
}

/// xxh3 of a whole file, memory-mapped.
pub(crate) fn hash_file(path: &Path) -> Result<u64, EngineError> {
    require_file(path)?;
    let file = File::open(path).map_err(|e| EngineError::io(path, e))?;
    // SAFETY: the map is read-only and dropped before returning; a concurrent truncation of a
    // model file by another process would be an operator error we cannot guard against anyway.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| EngineError::io(path, e))?;
    Ok(xxhash_rust::xxh3::xxh3_64(&map))
}
