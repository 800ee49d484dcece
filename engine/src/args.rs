//! Command-line/env/file configuration of an engine, shared by every binary that runs one
//! (`tandem generate`, `tandem bench-engine`, and later the prefill and decode nodes).
//!
//! Every flag also reads an environment variable (`TANDEM_…`), and the struct deserialises from
//! a config file section with the same field names. "GB" means 2^30 bytes throughout.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use serde::{Deserialize, Serialize};

use tandem_kv_layout::KvDtype;

use crate::backend::Device;
use crate::engine::{EngineConfig, KvCapacity};
use crate::error::EngineError;
use crate::loader::{DtypeChoice, ModelSource};
use crate::scheduler::{ClassPolicy, SchedulerConfig};

/// How to build an engine: which weights, in which dtype, with how much KV and which scheduling.
#[derive(Args, Clone, Debug, Serialize, Deserialize)]
pub struct EngineArgs {
    /// Model to serve: a .gguf file or a Hugging Face directory (config.json, *.safetensors,
    /// tokenizer.json). Default: SmolLM2-135M-Instruct from the model cache (fetched on first use).
    #[arg(long, env = "TANDEM_MODEL", conflicts_with = "dummy_weights")]
    pub model: Option<PathBuf>,

    /// Serve random weights of the shape in this HF-style config.json instead of a checkpoint
    /// (performance work; there is no tokenizer, so prompts must be token ids).
    #[arg(long, env = "TANDEM_DUMMY_WEIGHTS", value_name = "CONFIG")]
    pub dummy_weights: Option<PathBuf>,

    /// Seed of the dummy weights.
    #[arg(long, env = "TANDEM_DUMMY_SEED", default_value_t = 0)]
    pub dummy_seed: u64,

    /// Where the forward runs: `cpu`, `cuda` (device 0) or `cuda:N`. CUDA needs an NVIDIA
    /// driver and libnvrtc / libcublas on LD_LIBRARY_PATH; without them it is an error, never a
    /// silent fallback. Disaggregated serving (prefill, decode, up) is CPU-only for now.
    #[arg(long, env = "TANDEM_DEVICE", default_value = "cpu", value_parser = parse_device)]
    #[serde(default)]
    pub device: Device,

    /// How the weights are held: `auto` (default) keeps a GGUF's Q8_0 / Q4_1 / Q4_0 blocks and
    /// F16 / BF16 tensors as stored, computing exactly the f32 path's output with the file's
    /// bytes in memory (other quantization types are dequantised to f32, said in the log);
    /// `f32`, `f16`, `bf16`, `q8_0`, `q4_1` or `q4_0` converts every matrix (f16 halves the bytes
    /// of f32 but rounds; q8_0 / q4_1 / q4_0 quantize what the file does not already store so).
    /// On CUDA: `auto` means bf16 (quantized and f32 tensors converted at load, said in the
    /// log), and only `f32` (the exactness check) and `bf16` have GPU kernels.
    #[arg(long, env = "TANDEM_DTYPE", default_value = "auto", value_parser = parse_weight_dtype)]
    #[serde(with = "weight_dtype_name")]
    pub dtype: DtypeChoice,

    /// Element type of the KV cache: f32, f16, bf16 or int8 (per-block scales).
    #[arg(long, env = "TANDEM_KV_DTYPE", default_value = "f32", value_parser = parse_kv_dtype)]
    pub kv_dtype: KvDtype,

    /// Tokens per KV block.
    #[arg(long, env = "TANDEM_BLOCK_SIZE", default_value_t = 16)]
    pub block_size: usize,

    /// KV cache size in GB (2^30 bytes).
    #[arg(long, env = "TANDEM_KV_CACHE_GB", default_value_t = 1.0, conflicts_with = "kv_blocks")]
    pub kv_cache_gb: f64,

    /// KV cache size as an exact number of blocks (instead of --kv-cache-gb).
    #[arg(long, env = "TANDEM_KV_BLOCKS")]
    pub kv_blocks: Option<usize>,

    /// Sequences running at once.
    #[arg(long, env = "TANDEM_MAX_NUM_SEQS", default_value_t = 64)]
    pub max_num_seqs: usize,

    /// Tokens per engine step (prefill chunks + decode tokens): the chunked-prefill budget.
    #[arg(long, env = "TANDEM_MAX_TOKENS_PER_STEP", default_value_t = 512)]
    pub max_tokens_per_step: usize,

    /// Requests allowed to wait for admission before new ones are refused.
    #[arg(long, env = "TANDEM_MAX_WAITING", default_value_t = 1024)]
    pub max_waiting: usize,

    /// Interactive requests: when idle, wait up to this many milliseconds for more requests
    /// before a step (the class's batching window).
    #[arg(long, env = "TANDEM_MAX_WAIT_MS", default_value_t = 0)]
    pub max_wait_ms: u64,

    /// Batch requests: their batching window, in milliseconds.
    #[arg(long, env = "TANDEM_BATCH_MAX_WAIT_MS", default_value_t = 20)]
    #[serde(default = "default_batch_max_wait_ms")]
    pub batch_max_wait_ms: u64,

    /// Interactive prompt-length buckets admissions are grouped by (increasing token bounds,
    /// comma-separated) [default: derived from --max-model-len: /64, /16, /4].
    #[arg(long, env = "TANDEM_LENGTH_BUCKETS", value_delimiter = ',')]
    #[serde(default)]
    pub length_buckets: Vec<usize>,

    /// Batch prompt-length buckets [default: derived from --max-model-len: /16, /4].
    #[arg(long, env = "TANDEM_BATCH_LENGTH_BUCKETS", value_delimiter = ',')]
    #[serde(default)]
    pub batch_length_buckets: Vec<usize>,

    /// A batch request that has waited this many milliseconds is admitted ahead of interactive
    /// ones (aging: batch work is never starved).
    #[arg(long, env = "TANDEM_BATCH_AGING_MS", default_value_t = 2000)]
    #[serde(default = "default_batch_aging_ms")]
    pub batch_aging_ms: u64,

    /// Disable reuse of cached prefix blocks.
    #[arg(long, env = "TANDEM_NO_PREFIX_CACHING")]
    pub no_prefix_caching: bool,

    /// Longest prompt + output accepted (capped by the model's context length).
    #[arg(long, env = "TANDEM_MAX_MODEL_LEN", default_value_t = 8192)]
    pub max_model_len: usize,
}

/// (De)serialises a [`DtypeChoice`] by its name, so config files say `dtype = "f16"`.
mod weight_dtype_name {
    use super::DtypeChoice;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &DtypeChoice, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(d.as_str())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<DtypeChoice, D::Error> {
        String::deserialize(d)?.parse().map_err(serde::de::Error::custom)
    }
}

fn default_batch_max_wait_ms() -> u64 {
    20
}

fn default_batch_aging_ms() -> u64 {
    2000
}

fn parse_weight_dtype(s: &str) -> Result<DtypeChoice, String> {
    s.parse::<DtypeChoice>().map_err(|e| e.to_string())
}

fn parse_device(s: &str) -> Result<Device, String> {
    s.parse::<Device>().map_err(|e| e.to_string())
}

fn parse_kv_dtype(s: &str) -> Result<KvDtype, String> {
    s.parse::<KvDtype>().map_err(|e| e.to_string())
}

impl EngineArgs {
    /// Where the weights come from; `default_model` is used when neither flag is given.
    pub fn source(&self, default_model: impl FnOnce() -> PathBuf) -> ModelSource {
        match (&self.model, &self.dummy_weights) {
            (_, Some(config)) => ModelSource::Dummy { config: config.clone(), seed: self.dummy_seed },
            (Some(p), None) => ModelSource::Path(p.clone()),
            (None, None) => ModelSource::Path(default_model()),
        }
    }

    /// The weight dtype to load for `--device`: `--dtype` as given on the CPU; on CUDA, `auto`
    /// becomes bf16 (logged once), `f32` and `bf16` stay, and dtypes with no GPU kernel (f16,
    /// q8_0, q4_1, q4_0) are refused with the dtypes that have one.
    pub fn load_dtype(&self) -> Result<DtypeChoice, EngineError> {
        use tandem_kernels::WeightDtype;
        if !self.device.is_cuda() {
            return Ok(self.dtype);
        }
        match self.dtype {
            DtypeChoice::Auto => {
                tracing::info!(
                    device = %self.device,
                    "--dtype auto on CUDA: weights load as bf16 (quantized and f32 tensors converted; cuBLAS bf16 in, f32 accumulate)"
                );
                Ok(DtypeChoice::Fixed(WeightDtype::Bf16))
            }
            DtypeChoice::Fixed(WeightDtype::F32 | WeightDtype::Bf16) => Ok(self.dtype),
            DtypeChoice::Fixed(d) => Err(EngineError::InvalidConfig {
                field: "dtype",
                value: d.as_str().to_string(),
                reason: format!(
                    "no GPU kernel for {} weights on --device {}: use --dtype bf16 (or auto), or f32",
                    d.as_str(),
                    self.device
                ),
            }),
        }
    }

    /// The engine configuration these flags describe, validated.
    pub fn engine_config(&self) -> Result<EngineConfig, EngineError> {
        if !self.kv_cache_gb.is_finite() || self.kv_cache_gb <= 0.0 {
            return Err(EngineError::InvalidConfig {
                field: "kv_cache_gb",
                value: self.kv_cache_gb.to_string(),
                reason: "must be a positive number of GB".into(),
            });
        }
        if self.block_size == 0 {
            return Err(EngineError::InvalidConfig { field: "block_size", value: "0".into(), reason: "must be > 0".into() });
        }
        let kv_capacity = match self.kv_blocks {
            Some(n) => KvCapacity::Blocks(n),
            None => KvCapacity::Bytes((self.kv_cache_gb * (1u64 << 30) as f64) as u64),
        };
        let scheduler = SchedulerConfig {
            max_num_seqs: self.max_num_seqs,
            max_tokens_per_step: self.max_tokens_per_step,
            max_waiting: self.max_waiting,
            classes: [
                ClassPolicy { max_wait: Duration::from_millis(self.max_wait_ms), length_buckets: self.length_buckets.clone() },
                ClassPolicy {
                    max_wait: Duration::from_millis(self.batch_max_wait_ms),
                    length_buckets: self.batch_length_buckets.clone(),
                },
            ],
            batch_aging: Duration::from_millis(self.batch_aging_ms),
            enable_prefix_caching: !self.no_prefix_caching,
            max_model_len: self.max_model_len,
            ..SchedulerConfig::default()
        };
        scheduler.validate()?;
        Ok(EngineConfig { block_size_tokens: self.block_size, kv_dtype: self.kv_dtype, kv_capacity, scheduler })
    }
}
