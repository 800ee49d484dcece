//! Reading a model's KV shape and parameter count from `--model PATH`.
//!
//! Two formats are recognised:
//! - a **GGUF file** (by its magic bytes): `{arch}.block_count`, `{arch}.attention.head_count_kv`
//!   (defaulting to `head_count`, as llama.cpp does), and the head dim from
//!   `{arch}.attention.key_length`, else `embedding_length / head_count`, else
//!   `{arch}.rope.dimension_count` (the rope dimension can be partial, so it comes last); the
//!   parameter count is summed over the tensor table;
//! - a **Hugging Face directory** (or its `config.json`): `num_hidden_layers`,
//!   `num_key_value_heads` (defaulting to `num_attention_heads`), `head_dim` (defaulting to
//!   `hidden_size / num_attention_heads`), looked up at the top level and then under
//!   `text_config`; parameters are summed over the shapes in every `*.safetensors` header in
//!   the directory, when there are any.
//!
//! K and V are assumed to share one head dim, as in [`tandem_kv_layout::KvLayout`].
//! Cost: the file headers only (a few hundred KB for a GGUF with a vocabulary), never weights.
//! When `tandem_engine::ModelConfig::from_path` exists, [`read_model`] can take the shape from
//! it instead of parsing here.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::calc::ModelShape;
use super::error::PlanError;
use super::gguf;

/// The format a model was read from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelFormat {
    /// A GGUF file of the given `general.architecture`.
    Gguf {
        /// e.g. `llama`.
        architecture: String,
    },
    /// A Hugging Face directory (config.json, optional safetensors).
    HuggingFace {
        /// How many safetensors files were counted for parameters.
        safetensors_files: usize,
    },
}

/// What the planner learned from a model path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelInfo {
    /// The path as given.
    pub path: PathBuf,
    /// Where the figures came from.
    pub format: ModelFormat,
    /// The KV shape.
    pub shape: ModelShape,
    /// Parameters counted from tensor shapes (`None`: a directory without safetensors).
    pub param_count: Option<u64>,
}

/// Reads `path`: a GGUF file, a Hugging Face directory, or a `config.json` inside one.
pub fn read_model(path: &Path) -> Result<ModelInfo, PlanError> {
    let read_err = |source| PlanError::ModelRead {
        path: path.into(),
        source,
    };
    let meta = std::fs::metadata(path).map_err(read_err)?;
    if meta.is_dir() {
        let config = path.join("config.json");
        if !config.is_file() {
            return Err(PlanError::UnknownModelFormat { path: path.into() });
        }
        return read_hf(path, &config);
    }
    let mut magic = [0u8; 4];
    let n = File::open(path)
        .and_then(|mut f| f.read(&mut magic))
        .map_err(read_err)?;
    if n == 4 && &magic == b"GGUF" {
        return read_gguf(path);
    }
    if path.file_name().is_some_and(|n| n == "config.json") {
        let dir = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        return read_hf(dir, path);
    }
    Err(PlanError::UnknownModelFormat { path: path.into() })
}

fn read_gguf(path: &Path) -> Result<ModelInfo, PlanError> {
    let header = gguf::read_header(path)?;
    let missing = |key: String| PlanError::ModelFieldMissing {
        path: path.into(),
        key,
    };
    let architecture = match header.metadata.get("general.architecture") {
        Some(gguf::GgufValue::Str(s)) => s.clone(),
        _ => return Err(missing("general.architecture".into())),
    };
    let int = |suffix: &str| {
        header
            .metadata
            .get(&format!("{architecture}.{suffix}"))
            .and_then(gguf::GgufValue::as_u64)
    };
    let require =
        |suffix: &str| int(suffix).ok_or_else(|| missing(format!("{architecture}.{suffix}")));
    let num_layers = require("block_count")?;
    let heads = int("attention.head_count");
    let num_kv_heads = match int("attention.head_count_kv").or(heads) {
        Some(h) => h,
        None => return Err(missing(format!("{architecture}.attention.head_count_kv"))),
    };
    let from_embedding = match (int("embedding_length"), heads) {
        (Some(e), Some(h)) if h > 0 && e % h == 0 => Some(e / h),
        _ => None,
    };
    let head_dim = int("attention.key_length")
        .or(from_embedding)
        .or_else(|| int("rope.dimension_count"))
        .ok_or_else(|| missing(format!("{architecture}.attention.key_length")))?;
    Ok(ModelInfo {
        path: path.into(),
        format: ModelFormat::Gguf { architecture },
        shape: shape(num_layers, num_kv_heads, head_dim)?,
        param_count: Some(header.param_count),
    })
}

fn read_hf(dir: &Path, config_path: &Path) -> Result<ModelInfo, PlanError> {
    let text = std::fs::read_to_string(config_path).map_err(|source| PlanError::ModelRead {
        path: config_path.into(),
        source,
    })?;
    let config: Value = serde_json::from_str(&text).map_err(|source| PlanError::JsonMalformed {
        path: config_path.into(),
        source,
    })?;
    let text_config = config.get("text_config");
    let field = |names: &[&str]| -> Option<u64> {
        [Some(&config), text_config]
            .into_iter()
            .flatten()
            .flat_map(|c| names.iter().map(move |n| c.get(*n)))
            .flatten()
            .find_map(Value::as_u64)
    };
    let missing = |key: &str| PlanError::ModelFieldMissing {
        path: config_path.into(),
        key: key.into(),
    };
    let num_layers = field(&["num_hidden_layers", "n_layer", "num_layers"])
        .ok_or_else(|| missing("num_hidden_layers"))?;
    let heads = field(&["num_attention_heads", "n_head"]);
    let num_kv_heads = field(&["num_key_value_heads", "num_kv_heads"])
        .or(heads)
        .ok_or_else(|| missing("num_key_value_heads"))?;
    let from_hidden = match (field(&["hidden_size", "n_embd", "d_model"]), heads) {
        (Some(e), Some(h)) if h > 0 && e % h == 0 => Some(e / h),
        _ => None,
    };
    let head_dim = field(&["head_dim"])
        .or(from_hidden)
        .ok_or_else(|| missing("head_dim"))?;
    let (param_count, files) = count_safetensors_params(dir)?;
    Ok(ModelInfo {
        path: dir.into(),
        format: ModelFormat::HuggingFace {
            safetensors_files: files,
        },
        shape: shape(num_layers, num_kv_heads, head_dim)?,
        param_count,
    })
}

/// Longest safetensors JSON header accepted (real ones are a few MB at most).
const MAX_SAFETENSORS_HEADER_BYTES: u64 = 100 << 20;

/// Sums tensor elements over every `*.safetensors` in `dir`: `(None, 0)` when there are none.
fn count_safetensors_params(dir: &Path) -> Result<(Option<u64>, usize), PlanError> {
    fn read_err(path: &Path) -> impl Fn(std::io::Error) -> PlanError + '_ {
        move |source| PlanError::ModelRead {
            path: path.into(),
            source,
        }
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(read_err(dir))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Ok((None, 0));
    }
    let mut total: u64 = 0;
    for path in &files {
        let mut f = File::open(path).map_err(read_err(path))?;
        let mut len = [0u8; 8];
        f.read_exact(&mut len).map_err(read_err(path))?;
        let len = u64::from_le_bytes(len);
        if len > MAX_SAFETENSORS_HEADER_BYTES {
            return Err(PlanError::InvalidValue {
                field: "safetensors header length",
                value: format!("{len} ({})", path.display()),
                reason: "is larger than 100 MiB",
            });
        }
        let mut header = vec![0u8; len as usize];
        f.read_exact(&mut header).map_err(read_err(path))?;
        let header: serde_json::Map<String, Value> =
            serde_json::from_slice(&header).map_err(|source| PlanError::JsonMalformed {
                path: path.clone(),
                source,
            })?;
        for (name, entry) in header.iter().filter(|(k, _)| *k != "__metadata__") {
            let dims = entry
                .get("shape")
                .and_then(Value::as_array)
                .ok_or_else(|| PlanError::ModelFieldMissing {
                    path: path.clone(),
                    key: format!("{name}.shape"),
                })?;
            let elems = dims
                .iter()
                .try_fold(1u64, |acc, d| d.as_u64().and_then(|d| acc.checked_mul(d)));
            total = elems.and_then(|e| total.checked_add(e)).ok_or_else(|| {
                PlanError::InvalidValue {
                    field: "safetensors tensor shape",
                    value: format!("{name} in {}", path.display()),
                    reason: "is not a list of integers whose product fits in u64",
                }
            })?;
        }
    }
    Ok((Some(total), files.len()))
}

fn shape(num_layers: u64, num_kv_heads: u64, head_dim: u64) -> Result<ModelShape, PlanError> {
    let to_usize = |field, v: u64| {
        let invalid = |reason| PlanError::InvalidValue {
            field,
            value: v.to_string(),
            reason,
        };
        match usize::try_from(v) {
            Ok(0) => Err(invalid("must be at least 1")),
            Ok(v) => Ok(v),
            Err(_) => Err(invalid("does not fit in usize")),
        }
    };
    Ok(ModelShape {
        num_layers: to_usize("model layer count", num_layers)?,
        num_kv_heads: to_usize("model KV head count", num_kv_heads)?,
        head_dim: to_usize("model head dim", head_dim)?,
    })
}

#[cfg(test)]
#[path = "model_tests.rs"]
mod tests;
