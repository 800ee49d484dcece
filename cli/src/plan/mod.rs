//! `tandem plan`: the capacity planner.
//!
//! From a model (`--model PATH`, or the shape flags `--layers --kv-heads --head-dim` with
//! weights as `--params` or `--weights-gb`) and a serving unit (`--gpu-mem-gb --tp`, a reserve,
//! `--seq-len --batch`), it reports KV bytes per token, KV bytes for the batch, weight bytes per
//! GPU, the KV budget per GPU, the largest batch at that length, concurrent requests per unit
//! and batches in flight — as a table, or as one JSON object with `--format json`.
//!
//! It reproduces every figure of the reference deployment, a 70B-class dense GQA model (80
//! layers, 8 KV heads, head dim 128, BF16: 327,680 B = 320 KiB of KV per token):
//! - 320 KiB × 4096 tokens × batch 32 = 40 GiB;
//! - one 80 GB card, 40 GB weights, 8 GB reserve → 32 GiB of KV → largest batch at 8192
//!   tokens = floor(32 GiB / (320 KiB × 8192)) = 12;
//! - a TP-4 unit of 4 × 80 GB, 140 GB weights (35 GB a card), 5 GB reserve → 40 GiB of KV a
//!   card; at 2048 tokens a request needs 640 MiB → 64 concurrent requests, batches of 16 → 4
//!   batches in flight, with every card charged the full 320 KiB a token (with the KV heads
//!   split 2 a card: 256 requests, 16 batches).
//!
//! These are asserted in `calc_tests.rs` and `cli/tests/plan.rs`. By default it
//! models tensor parallelism splitting the KV heads across the unit's GPUs (replicating them
//! when TP exceeds the KV heads); `--kv-per-gpu full` charges every GPU all KV heads, the
//! seed's conservative arithmetic. The output says which mode it used and what the other gives.
//!
//! Module map: [`calc`] the arithmetic, [`model`] + [`gguf`] reading a model's shape,
//! [`units`] byte units and input checks, [`render`] table and JSON, [`error`] the error enum.
//! Cost: O(1) arithmetic plus reading a model's headers (never its weights).

pub mod calc;
pub mod error;
pub mod gguf;
pub mod model;
pub mod render;
pub mod units;

use std::path::PathBuf;

use clap::{Args, ValueEnum};

pub use calc::{KvPerGpu, ModelShape, Plan, PlanInput, PlanKvDtype, compute};
pub use error::PlanError;
pub use model::{ModelInfo, read_model};
use units::{GIB_BYTES, Rounding, non_negative, parse_param_count, to_bytes};

/// Text appended to `tandem plan --help`: the units and how `--model` combines with flags.
pub const PLAN_AFTER_HELP: &str = "\
Units: as in the seed's arithmetic, GB in a flag means 2^30 bytes (a GiB) and KB means 2^10 bytes.
--model conflicts with --layers/--kv-heads/--head-dim; --params or --weights-gb, if given,
override the parameter count read from the model.
KV per GPU: 'split' (default) gives each GPU ceil(kv_heads / tp) heads (at least 1: replicated
when tp > kv_heads); 'full' charges every GPU all KV heads, as the seed does.";

/// Weight element type for `--params` and for parameters counted from `--model`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum WeightDtype {
    /// 4 bytes per parameter.
    F32,
    /// 2 bytes per parameter.
    F16,
    /// 2 bytes per parameter.
    Bf16,
    /// 1 byte per parameter.
    Fp8,
    /// 1 byte per parameter.
    Int8,
    /// Half a byte per parameter.
    Int4,
}

impl WeightDtype {
    /// Bits stored per parameter.
    pub const fn bits_per_param(self) -> u64 {
        match self {
            WeightDtype::F32 => 32,
            WeightDtype::F16 | WeightDtype::Bf16 => 16,
            WeightDtype::Fp8 | WeightDtype::Int8 => 8,
            WeightDtype::Int4 => 4,
        }
    }

    /// e.g. `bf16 (2 B)`, for the table.
    pub fn describe(self) -> String {
        let name = self
            .to_possible_value()
            .map(|v| v.get_name().to_string())
            .unwrap_or_default();
        match self.bits_per_param() {
            4 => format!("{name} (0.5 B)"),
            bits => format!("{name} ({} B)", bits / 8),
        }
    }
}

/// Output format of `tandem plan`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum PlanFormat {
    /// An aligned table with units.
    Table,
    /// One JSON object (integers in bytes and counts).
    Json,
}

/// Flags of `tandem plan`. Every flag can also be set by its `TANDEM_PLAN_*` variable.
#[derive(Args, Debug, Clone)]
#[command(after_help = PLAN_AFTER_HELP)]
pub struct PlanArgs {
    /// Model to read the KV shape and parameter count from: a GGUF file, or a Hugging Face
    /// directory (config.json, parameters counted from *.safetensors headers). Conflicts with
    /// --layers/--kv-heads/--head-dim; --params/--weights-gb override its parameter count
    #[arg(long, env = "TANDEM_PLAN_MODEL", value_name = "PATH")]
    pub model: Option<PathBuf>,
    /// Transformer layers (without --model)
    #[arg(
        long,
        env = "TANDEM_PLAN_LAYERS",
        conflicts_with = "model",
        required_unless_present = "model",
        allow_negative_numbers = true,
        value_parser = parse_count,
    )]
    pub layers: Option<u64>,
    /// KV heads per layer, after GQA (without --model)
    #[arg(
        long,
        env = "TANDEM_PLAN_KV_HEADS",
        conflicts_with = "model",
        required_unless_present = "model",
        allow_negative_numbers = true,
        value_parser = parse_count,
    )]
    pub kv_heads: Option<u64>,
    /// Elements per attention head (without --model)
    #[arg(
        long,
        env = "TANDEM_PLAN_HEAD_DIM",
        conflicts_with = "model",
        required_unless_present = "model",
        allow_negative_numbers = true,
        value_parser = parse_count,
    )]
    pub head_dim: Option<u64>,
    /// KV cache element type (int8 adds f16 scales per block, layer and head: one per K channel, one per V token)
    #[arg(long, env = "TANDEM_PLAN_DTYPE", value_enum, default_value = "bf16")]
    pub dtype: PlanKvDtype,
    /// Tokens per KV block (changes the figures only for int8, whose scales are per block)
    #[arg(
        long,
        env = "TANDEM_PLAN_BLOCK_SIZE",
        default_value = "16",
        allow_negative_numbers = true,
        value_parser = parse_count,
    )]
    pub block_size: u64,
    /// Parameter count (70B, 134.5M, 7e10): weights = params × --weight-dtype bytes
    #[arg(
        long,
        env = "TANDEM_PLAN_PARAMS",
        conflicts_with = "weights_gb",
        value_parser = parse_params,
    )]
    pub params: Option<u64>,
    /// Bytes per parameter for --params or a --model's counted parameters
    #[arg(
        long,
        env = "TANDEM_PLAN_WEIGHT_DTYPE",
        value_enum,
        default_value = "bf16",
        conflicts_with = "weights_gb"
    )]
    pub weight_dtype: WeightDtype,
    /// Total weights in GB (2^30 bytes), all GPUs together
    #[arg(
        long,
        env = "TANDEM_PLAN_WEIGHTS_GB",
        allow_negative_numbers = true,
        value_parser = parse_non_negative,
    )]
    pub weights_gb: Option<f64>,
    /// Memory of one GPU in GB (2^30 bytes)
    #[arg(
        long,
        env = "TANDEM_PLAN_GPU_MEM_GB",
        allow_negative_numbers = true,
        value_parser = parse_non_negative,
    )]
    pub gpu_mem_gb: f64,
    /// Tensor-parallel degree: GPUs per serving unit
    #[arg(
        long,
        env = "TANDEM_PLAN_TP",
        default_value = "1",
        allow_negative_numbers = true,
        value_parser = parse_count,
    )]
    pub tp: u64,
    /// Memory reserved per GPU for activations and runtime, in GB (2^30 bytes) [default: 0]
    #[arg(
        long,
        env = "TANDEM_PLAN_RESERVE_GB",
        conflicts_with = "reserve_frac",
        allow_negative_numbers = true,
        value_parser = parse_non_negative,
    )]
    pub reserve_gb: Option<f64>,
    /// Memory reserved per GPU as a fraction of --gpu-mem-gb, in [0, 1)
    #[arg(
        long,
        env = "TANDEM_PLAN_RESERVE_FRAC",
        allow_negative_numbers = true,
        value_parser = parse_non_negative,
    )]
    pub reserve_frac: Option<f64>,
    /// Tokens per request (prompt + output) to plan for
    #[arg(
        long,
        env = "TANDEM_PLAN_SEQ_LEN",
        allow_negative_numbers = true,
        value_parser = parse_count,
    )]
    pub seq_len: u64,
    /// Requests per batch (for KV at batch and batches in flight)
    #[arg(
        long,
        env = "TANDEM_PLAN_BATCH",
        default_value = "1",
        allow_negative_numbers = true,
        value_parser = parse_count,
    )]
    pub batch: u64,
    /// How KV heads are charged per GPU under TP: split across GPUs, or all on every GPU (the seed)
    #[arg(
        long,
        env = "TANDEM_PLAN_KV_PER_GPU",
        value_enum,
        default_value = "split"
    )]
    pub kv_per_gpu: KvPerGpu,
    /// Output format
    #[arg(long, env = "TANDEM_PLAN_FORMAT", value_enum, default_value = "table")]
    pub format: PlanFormat,
}

/// Where the weight bytes came from.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum WeightSource {
    /// `--weights-gb`.
    Gb(f64),
    /// A parameter count times bytes per parameter.
    Params {
        /// Parameters.
        count: u64,
        /// Their element type.
        dtype: WeightDtype,
        /// Counted from `--model` rather than given by `--params`.
        from_model: bool,
    },
}

/// Flags resolved into bytes and tokens, with the model they were read from.
#[derive(Clone, Debug, PartialEq)]
pub struct Resolved {
    /// The arithmetic's input.
    pub input: PlanInput,
    /// The model read from `--model`, if any.
    pub model: Option<ModelInfo>,
    /// Where the weight bytes came from.
    pub weights: WeightSource,
}

/// Resolves flags (reading `--model` if given) into a [`PlanInput`].
pub fn resolve(args: &PlanArgs) -> Result<Resolved, PlanError> {
    let model = args.model.as_deref().map(read_model).transpose()?;
    let shape = match &model {
        Some(m) => m.shape,
        None => ModelShape {
            num_layers: flag_usize("--layers", args.layers)?,
            num_kv_heads: flag_usize("--kv-heads", args.kv_heads)?,
            head_dim: flag_usize("--head-dim", args.head_dim)?,
        },
    };
    let params = |count, from_model| WeightSource::Params {
        count,
        dtype: args.weight_dtype,
        from_model,
    };
    let weights = match (
        args.weights_gb,
        args.params,
        model.as_ref().map(|m| m.param_count),
    ) {
        (Some(gb), _, _) => WeightSource::Gb(gb),
        (None, Some(count), _) => params(count, false),
        (None, None, Some(Some(count))) => params(count, true),
        (None, None, Some(None)) => {
            return Err(PlanError::Missing {
                what: "weights",
                hint: "--params or --weights-gb (the model directory has no *.safetensors to count)",
            });
        }
        (None, None, None) => {
            return Err(PlanError::Missing {
                what: "weights",
                hint: "--params, --weights-gb or --model",
            });
        }
    };
    let weight_bytes = match weights {
        WeightSource::Gb(gb) => to_bytes("--weights-gb", gb, GIB_BYTES, Rounding::Up)?,
        WeightSource::Params { count, dtype, .. } => {
            let bits = count as u128 * u128::from(dtype.bits_per_param());
            u64::try_from(bits.div_ceil(8))
                .ok()
                .filter(|b| *b < 1 << 63)
                .ok_or_else(|| PlanError::InvalidValue {
                    field: "--params",
                    value: count.to_string(),
                    reason: "is too large",
                })?
        }
    };
    let gpu_mem_bytes = to_bytes("--gpu-mem-gb", args.gpu_mem_gb, GIB_BYTES, Rounding::Down)?;
    let reserve_bytes = match (args.reserve_gb, args.reserve_frac) {
        (Some(gb), _) => to_bytes("--reserve-gb", gb, GIB_BYTES, Rounding::Up)?,
        (None, Some(frac)) => {
            if non_negative("--reserve-frac", frac)? >= 1.0 {
                return Err(PlanError::InvalidValue {
                    field: "--reserve-frac",
                    value: frac.to_string(),
                    reason: "must be below 1 (a fraction of GPU memory)",
                });
            }
            (frac * gpu_mem_bytes as f64).ceil() as u64
        }
        (None, None) => 0,
    };
    let input = PlanInput {
        shape,
        kv_dtype: args.dtype,
        block_size_tokens: flag_usize("--block-size", Some(args.block_size))?,
        weight_bytes,
        gpu_mem_bytes,
        tp: u32::try_from(args.tp).map_err(|_| PlanError::InvalidValue {
            field: "--tp",
            value: args.tp.to_string(),
            reason: "must fit in 32 bits",
        })?,
        reserve_bytes,
        seq_len_tokens: args.seq_len,
        batch: args.batch,
        kv_per_gpu: args.kv_per_gpu,
    };
    Ok(Resolved {
        input,
        model,
        weights,
    })
}

/// Computes the plan for `args` and returns the text to print (a table or one JSON object).
pub fn run(args: &PlanArgs) -> anyhow::Result<String> {
    let resolved = resolve(args)?;
    let plan = compute(&resolved.input)?;
    Ok(match args.format {
        PlanFormat::Table => render::table(&resolved, &plan),
        PlanFormat::Json => render::json(&resolved, &plan),
    })
}

fn flag_usize(flag: &'static str, value: Option<u64>) -> Result<usize, PlanError> {
    let value = value.ok_or(PlanError::Missing {
        what: "model shape",
        hint: "--layers, --kv-heads and --head-dim, or --model",
    })?;
    usize::try_from(value).map_err(|_| PlanError::InvalidValue {
        field: flag,
        value: value.to_string(),
        reason: "does not fit in usize",
    })
}

/// clap parser for GB amounts and fractions: a finite number `>= 0`.
fn parse_non_negative(text: &str) -> Result<f64, String> {
    let v: f64 = text
        .trim()
        .parse()
        .map_err(|_| format!("`{text}` is not a number"))?;
    non_negative("value", v).map_err(|e| match e {
        PlanError::InvalidValue { reason, .. } => reason.to_string(),
        other => other.to_string(),
    })
}

/// clap parser for whole-number flags; zero passes here and is refused by the plan with the
/// flag's name, negative numbers are refused here.
fn parse_count(text: &str) -> Result<u64, String> {
    let t = text.trim();
    if t.starts_with('-') {
        return Err("must not be negative".to_string());
    }
    t.parse()
        .map_err(|_| format!("`{text}` is not a whole number"))
}

/// clap parser for `--params`.
fn parse_params(text: &str) -> Result<u64, String> {
    parse_param_count("--params", text).map_err(|e| match e {
        PlanError::InvalidValue { reason, .. } => reason.to_string(),
        other => other.to_string(),
    })
}

#[cfg(test)]
#[path = "args_tests.rs"]
mod tests;
