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
    /// The file's quantization types that have no kernel (GGUF names, e.g. `Q5_0`): under
    /// `--dtype auto` their tensors were dequantised to f32 at load, and each type was logged
    /// once as a warning. Empty when every tensor kept its type or the dtype was fixed.
    pub dequantized_types: Vec<String>,
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

/// How the weights are stored in memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DtypeChoice {
    /// As the checkpoint stores them: a GGUF's Q8_0, Q4_1 and Q4_0 tensors keep their blocks (decoded
    /// in registers to the very values the f32 path computes with, so the output is the f32
    /// path's, bit for bit), its F16 / BF16 tensors stay so (widened exactly), and every other
    /// type is dequantised to f32 (said once per type in the log). Safetensors and dummy
    /// weights: f32.
    /// The fingerprint is the f32 load's: the values are the same.
    Auto,
    /// Every matrix converted to this dtype (quantizing, for Q8_0 / Q4_1 / Q4_0, unless the file's
    /// tensor already is of that type).
    Fixed(WeightDtype),
}

impl DtypeChoice {
    /// `auto` or the dtype's name.
    pub const fn as_str(self) -> &'static str {
        match self {
            DtypeChoice::Auto => "auto",
            DtypeChoice::Fixed(d) => d.as_str(),
        }
    }

    /// The dtype a matrix gets whose file type is `file` (`None`: a type with no kernel, or a
    /// source that keeps no types, e.g. dummy weights).
    pub(crate) fn for_tensor(self, file: Option<WeightDtype>) -> WeightDtype {
        match (self, file) {
            (DtypeChoice::Fixed(d), _) => d,
            (DtypeChoice::Auto, Some(d)) => d,
            (DtypeChoice::Auto, None) => WeightDtype::F32,
        }
    }

    /// The dtype that names the weights' values in the fingerprint: `auto` loads the f32
    /// path's values exactly.
    pub(crate) fn fingerprint_dtype(self) -> WeightDtype {
        match self {
            DtypeChoice::Auto => WeightDtype::F32,
            DtypeChoice::Fixed(d) => d,
        }
    }
}

impl From<WeightDtype> for DtypeChoice {
    fn from(d: WeightDtype) -> DtypeChoice {
        DtypeChoice::Fixed(d)
    }
}

impl std::fmt::Display for DtypeChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for DtypeChoice {
    type Err = tandem_kernels::KernelError;
    fn from_str(s: &str) -> Result<DtypeChoice, Self::Err> {
        if s.trim().eq_ignore_ascii_case("auto") {
            Ok(DtypeChoice::Auto)
        } else {
            s.trim().parse().map(DtypeChoice::Fixed)
        }
    }
}

/// Loads weights (and tokenizer) from `source`, stored as `dtype` says.
pub fn load(source: &ModelSource, dtype: impl Into<DtypeChoice>) -> Result<LoadedModel, EngineError> {
    let dtype = dtype.into();
    match source {
        ModelSource::Path(p) if p.is_dir() => safetensors::load_dir(p, dtype.for_tensor(None)),
        ModelSource::Path(p) => {
            if !p.exists() {
                return Err(EngineError::ModelNotFound { path: p.clone() });
            }
            gguf::load(p, dtype)
        }
        ModelSource::Dummy { config, seed } => {
            let cfg = ModelConfig::from_json_file(config)?;
            Ok(LoadedModel {
                weights: dummy::build(cfg, *seed, dtype.for_tensor(None))?,
                tokenizer: None,
                dequantized_types: Vec::new(),
            })
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
/// matrix: GGUF row `h·hd + 2i + j` holds HF row `h·hd + j·hd/2 + i`. `cols` counts elements of
/// `T` a row (for quantized blocks: the row's bytes).
pub(crate) fn unpermute_rows<T: Copy + Default>(data: &[T], heads: usize, head_dim: usize, cols: usize) -> Vec<T> {
    let half = head_dim / 2;
    let mut out = vec![T::default(); data.len()];
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
