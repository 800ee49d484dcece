//! Loading weights into the engine's layout: from a GGUF file, a Hugging Face safetensors
//! directory, or random (seeded) dummy weights of any shape.
//!
//! Whatever the source, the result is a [`ModelWeights`] whose matrices are dense row-major
//! `[out][in]` [`Weight`]s in the dtype asked for, with the Q/K/V projections fused into one
//! matrix (`[q; k; v]` rows) and gate/up fused into one (`[gate; up]` rows), so each layer runs
//! three big matmuls instead of five small ones. Q and K rows are always in Hugging Face order
//! (rotate-half RoPE); GGUF files, which permute them for interleaved RoPE, are un-permuted here,
//! once, at load.

pub mod dummy;
pub mod gguf;
pub mod safetensors;

use std::path::{Path, PathBuf};

use tandem_kernels::{Weight, WeightDtype};

use crate::config::ModelConfig;
use crate::error::EngineError;
use crate::tokenizer::Tokenizer;

/// One decoder layer's weights.
pub struct LayerWeights {
    /// RMSNorm before attention.
    pub attn_norm: Vec<f32>,
    /// Fused `[q; k; v]` projection: `qkv_rows × hidden`.
    pub qkv: Weight,
    /// Attention output projection: `hidden × (heads × head_dim)`.
    pub o_proj: Weight,
    /// RMSNorm before the MLP.
    pub mlp_norm: Vec<f32>,
    /// Fused `[gate; up]` projection: `2·intermediate × hidden`.
    pub gate_up: Weight,
    /// MLP down projection: `hidden × intermediate`.
    pub down: Weight,
}

/// All weights of a model, in the engine's layout.
pub struct ModelWeights {
    /// The model's shape.
    pub config: ModelConfig,
    /// Token embedding, `vocab × hidden`.
    pub embed: Weight,
    /// Decoder layers.
    pub layers: Vec<LayerWeights>,
    /// Final RMSNorm.
    pub final_norm: Vec<f32>,
    /// LM head (`vocab × hidden`); `None` when tied to the embedding.
    pub lm_head: Option<Weight>,
    /// A stable hash of the weights' identity (content hash of the checkpoint, or the dummy
    /// config and seed) and of the compute dtype: KV built by different weights never mixes.
    pub fingerprint: u64,
}

/// A loaded model: weights plus (for real checkpoints) its tokenizer.
pub struct LoadedModel {
    /// The weights.
    pub weights: ModelWeights,
    /// The tokenizer, when the checkpoint carries one (dummy weights do not).
    pub tokenizer: Option<Tokenizer>,
}

/// Where the weights come from.
#[derive(Clone, Debug)]
pub enum ModelSource {
    /// A `.gguf` file or a Hugging Face directory (config.json + *.safetensors + tokenizer.json).
    Path(PathBuf),
    /// Random weights of the shape in a HF-style config.json, seeded.
    Dummy {
        /// The config file.
        config: PathBuf,
        /// RNG seed.
        seed: u64,
    },
}

/// Loads weights (and tokenizer) from `source` in `dtype`.
pub fn load(source: &ModelSource, dtype: WeightDtype) -> Result<LoadedModel, EngineError> {
    match source {
        ModelSource::Path(p) if p.is_dir() => safetensors::load_dir(p, dtype),
        ModelSource::Path(p) => {
            if !p.exists() {
                return Err(EngineError::ModelNotFound { path: p.clone() });
            }
            gguf::load(p, dtype)
        }
        ModelSource::Dummy { config, seed } => {
            let cfg = ModelConfig::from_json_file(config)?;
            Ok(LoadedModel { weights: dummy::build(cfg, *seed, dtype)?, tokenizer: None })
        }
    }
}

/// Builds a [`Weight`] from f32 data, checking the element count against the shape.
pub(crate) fn weight(
    name: &str,
    rows: usize,
    cols: usize,
    data: Vec<f32>,
    dtype: WeightDtype,
) -> Result<Weight, EngineError> {
    if data.len() != rows * cols {
        return Err(EngineError::TensorShape {
            name: name.to_string(),
            expected: vec![rows, cols],
            got: vec![data.len()],
        });
    }
    Ok(Weight::from_f32(rows, cols, data, dtype)?)
}

/// Undoes llama.cpp's Q/K row permutation for interleaved RoPE, in place of a `(heads·hd) × cols`
/// matrix: GGUF row `h·hd + 2i + j` holds HF row `h·hd + j·hd/2 + i`.
pub(crate) fn unpermute_rows(data: &[f32], heads: usize, head_dim: usize, cols: usize) -> Vec<f32> {
    let half = head_dim / 2;
    let mut out = vec![0f32; data.len()];
    for h in 0..heads {
        for i in 0..half {
            for j in 0..2 {
                let src = (h * head_dim + 2 * i + j) * cols;
                let dst = (h * head_dim + j * half + i) * cols;
                out[dst..dst + cols].copy_from_slice(&data[src..src + cols]);
            }
        }
    }
    out
}

/// Hashes a model identity (content hash + compute dtype) into the fingerprint KV layouts carry.
pub(crate) fn fingerprint(content_hash: u64, config: &ModelConfig, dtype: WeightDtype) -> u64 {
    let cfg = serde_json::to_vec(config).expect("ModelConfig always serialises");
    let mut buf = Vec::with_capacity(cfg.len() + 16);
    buf.extend_from_slice(&content_hash.to_le_bytes());
    buf.extend_from_slice(&cfg);
    buf.extend_from_slice(dtype.as_str().as_bytes());
    xxhash_rust::xxh3::xxh3_64(&buf)
}

/// Checks that `path` exists, with the engine's error.
pub(crate) fn require_file(path: &Path) -> Result<(), EngineError> {
    if path.exists() { Ok(()) } else { Err(EngineError::ModelNotFound { path: path.into() }) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpermute_inverts_llama_cpp_permutation() {
        // llama.cpp: w.reshape(heads, 2, hd/2, cols).swapaxes(1, 2).reshape(...)
        let (heads, hd, cols) = (3, 8, 2);
        let hf: Vec<f32> = (0..heads * hd * cols).map(|x| x as f32).collect();
        let mut gguf = vec![0f32; hf.len()];
        for h in 0..heads {
            for j in 0..2 {
                for i in 0..hd / 2 {
                    // permuted index order (h, i, j) takes HF (h, j, i)
                    let src = (h * hd + j * hd / 2 + i) * cols;
                    let dst = (h * hd + 2 * i + j) * cols;
                    gguf[dst..dst + cols].copy_from_slice(&hf[src..src + cols]);
                }
            }
        }
        assert_eq!(unpermute_rows(&gguf, heads, hd, cols), hf);
    }
}
