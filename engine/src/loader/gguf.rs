//! GGUF checkpoints (llama.cpp's format): metadata, tokenizer and (quantised) tensors, read through
//! candle-core's GGUF reader. Q8_0, Q4_1 and Q4_0 tensors keep their blocks when the dtype choice allows
//! ([`DtypeChoice`]: `auto`, or that very type), un-permuted and fused by rows as the f32 path
//! does; every other tensor is dequantised to f32 and converted to the dtype asked for.
//!
//! Cost: one pass over the file to hash it (the fingerprint) and one to read tensors; for the
//! default 98 MB SmolLM2 file that is well under a second.

use std::fs::File;
use std::io::BufReader;
use std::path::Path;

use std::collections::BTreeSet;

use candle_core::Device;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::quantized::gguf_file::Content;
use tandem_kernels::{KernelError, Weight, WeightDtype, quant};

use super::{DtypeChoice, LayerWeights, LoadedModel, ModelWeights, fingerprint, require_file, unpermute_rows, weight};
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
    choice: DtypeChoice,
    /// File types with no kernel already reported in the log.
    dequantized: BTreeSet<String>,
}

/// One tensor of a (possibly fused) matrix: its name, rows and, for Q/K, the heads to
/// un-permute `(heads, head_dim)`.
struct Part {
    name: String,
    rows: usize,
    unpermute: Option<(usize, usize)>,
}

impl Part {
    fn plain(name: String, rows: usize) -> Part {
        Part { name, rows, unpermute: None }
    }
}

/// The kernel dtype of a file type (`None`: no kernel; the tensor is dequantised).
fn kernel_dtype(t: GgmlDType) -> Option<WeightDtype> {
    match t {
        GgmlDType::F32 => Some(WeightDtype::F32),
        GgmlDType::F16 => Some(WeightDtype::F16),
        GgmlDType::BF16 => Some(WeightDtype::Bf16),
        GgmlDType::Q8_0 => Some(WeightDtype::Q8_0),
        GgmlDType::Q4_1 => Some(WeightDtype::Q4_1),
        GgmlDType::Q4_0 => Some(WeightDtype::Q4_0),
        _ => None,
    }
}

impl Reader<'_> {
    fn file_type(&self, name: &str) -> Result<GgmlDType, EngineError> {
        self.content
            .tensor_infos
            .get(name)
            .map(|i| i.ggml_dtype)
            .ok_or_else(|| EngineError::MissingTensor { name: name.to_string() })
    }

    /// The `rows × cols` matrix `name`, made of `parts` stacked by rows, stored as the dtype
    /// choice says: the file's blocks kept when every part is of one quantized type the choice
    /// allows, else dequantised to f32 and converted.
    fn matrix(&mut self, name: &str, parts: &[Part], cols: usize) -> Result<Weight, EngineError> {
        let types = parts.iter().map(|p| self.file_type(&p.name)).collect::<Result<Vec<_>, _>>()?;
        let common = types.iter().all(|t| *t == types[0]).then(|| kernel_dtype(types[0])).flatten();
        let dtype = self.choice.for_tensor(common);
        if self.choice == DtypeChoice::Auto {
            for t in types.iter().filter(|t| kernel_dtype(**t).is_none()) {
                if self.dequantized.insert(format!("{t:?}")) {
                    tracing::warn!(file_type = ?t, tensor = name, "no kernel for this quantization type: its tensors are dequantised to f32 at load");
                }
            }
        }
        let rows: usize = parts.iter().map(|p| p.rows).sum();
        if dtype.is_quantized() && common == Some(dtype) {
            let row_bytes = cols / quant::QK * quant::gguf_block_bytes(dtype);
            let mut bytes = Vec::with_capacity(rows * row_bytes);
            for p in parts {
                let b = self.read_blocks(&p.name, &[p.rows, cols])?;
                match p.unpermute {
                    Some((heads, hd)) => bytes.extend(unpermute_rows(&b, heads, hd, row_bytes)),
                    None => bytes.extend(b),
                }
            }
            return Weight::from_gguf_blocks(rows, cols, dtype, &bytes).map_err(|e| {
                let part = match &e {
                    KernelError::BadQuantBlock { row, .. } => {
                        let mut end = 0;
                        parts.iter().find(|p| {
                            end += p.rows;
                            *row < end
                        })
                    }
                    _ => None,
                };
                EngineError::ModelFormat {
                    path: self.path.into(),
                    reason: format!("tensor `{}`: {e}", part.map_or(name, |p| p.name.as_str())),
                }
            });
        }
        let mut data = Vec::with_capacity(rows * cols);
        for p in parts {
            let t = self.read(&p.name, &[p.rows, cols])?;
            match p.unpermute {
                Some((heads, hd)) => data.extend(unpermute_rows(&t, heads, hd, cols)),
                None => data.extend(t),
            }
        }
        weight(name, rows, cols, data, dtype)
    }

    /// Tensor `name` as stored, its shape checked (`[rows, cols]` or `[len]`).
    fn tensor(&mut self, name: &str, shape: &[usize]) -> Result<QTensor, EngineError> {
        if !self.content.tensor_infos.contains_key(name) {
            return Err(EngineError::MissingTensor { name: name.to_string() });
        }
        let q = self.content.tensor(&mut self.file, name, &Device::Cpu).map_err(|e| self.bad(name, e))?;
        let dims = q.shape().dims().to_vec();
        if dims != shape {
            return Err(EngineError::TensorShape { name: name.to_string(), expected: shape.to_vec(), got: dims });
        }
        Ok(q)
    }

    fn bad(&self, name: &str, e: candle_core::Error) -> EngineError {
        EngineError::ModelFormat { path: self.path.into(), reason: format!("tensor `{name}`: {e}") }
    }

    /// The raw GGUF blocks of tensor `name`, its shape checked.
    fn read_blocks(&mut self, name: &str, shape: &[usize]) -> Result<Vec<u8>, EngineError> {
        let q = self.tensor(name, shape)?;
        Ok(q.data().map_err(|e| self.bad(name, e))?.into_owned())
    }

    /// Reads tensor `name` as f32, checking its shape (`[rows, cols]` or `[len]`).
    fn read(&mut self, name: &str, shape: &[usize]) -> Result<Vec<f32>, EngineError> {
        let q = self.tensor(name, shape)?;
        let bad = |e: candle_core::Error| self.bad(name, e);
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

/// Loads a Llama-family GGUF: config, tokenizer and weights stored as `choice` says.
pub fn load(path: &Path, choice: DtypeChoice) -> Result<LoadedModel, EngineError> {
    let content_hash = hash_file(path)?;
    let (content, file) = open(path)?;
    let config = ModelConfig::from_gguf(&content, path)?;
    let tokenizer = tokenizer_of(path)?;
    let mut r = Reader { content: &content, file, path, choice, dequantized: BTreeSet::new() };

    let (h, inter, vocab) = (config.hidden_size, config.intermediate_size, config.vocab_size);
    let (heads, kv, hd) = (config.num_attention_heads, config.kv_heads(), config.head_dim());
    let embed = r.matrix("token_embd.weight", &[Part::plain("token_embd.weight".into(), vocab)], h)?;
    let mut layers = Vec::with_capacity(config.num_hidden_layers);
    for i in 0..config.num_hidden_layers {
        let p = |s: &str| format!("blk.{i}.{s}.weight");
        let qkv = [
            Part { name: p("attn_q"), rows: heads * hd, unpermute: Some((heads, hd)) },
            Part { name: p("attn_k"), rows: kv * hd, unpermute: Some((kv, hd)) },
            Part::plain(p("attn_v"), kv * hd),
        ];
        let gate_up = [Part::plain(p("ffn_gate"), inter), Part::plain(p("ffn_up"), inter)];
        layers.push(LayerWeights {
            attn_norm: r.read(&p("attn_norm"), &[h])?,
            qkv: r.matrix(&p("attn_qkv"), &qkv, h)?,
            o_proj: r.matrix(&p("attn_output"), &[Part::plain(p("attn_output"), h)], heads * hd)?,
            mlp_norm: r.read(&p("ffn_norm"), &[h])?,
            gate_up: r.matrix(&p("ffn_gate_up"), &gate_up, h)?,
            down: r.matrix(&p("ffn_down"), &[Part::plain(p("ffn_down"), h)], inter)?,
        });
    }
    let final_norm = r.read("output_norm.weight", &[h])?;
    let lm_head = if config.tie_word_embeddings {
        None
    } else {
        Some(r.matrix("output.weight", &[Part::plain("output.weight".into(), vocab)], h)?)
    };
    let fingerprint = fingerprint(content_hash, &config, choice.fingerprint_dtype());
    Ok(LoadedModel {
        weights: ModelWeights { config, embed, layers, final_norm, lm_head, fingerprint },
        tokenizer: Some(tokenizer),
        dequantized_types: r.dequantized.into_iter().collect(),
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
