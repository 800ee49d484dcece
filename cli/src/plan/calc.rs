//! The capacity arithmetic: from a model's KV shape and a unit of `tp` GPUs to KV bytes, the KV
//! budget and how many requests of one length fit.
//!
//! # The formulas
//! - KV bytes per token (the whole model) = layers × kv_heads × head_dim × 2 (K and V) × dtype
//!   bytes, taken from [`tandem_kv_layout::KvLayout`] (int8 adds its per-block f16 scales,
//!   one per K channel and one per V token of each head, amortised over `block_size` tokens; fp8 is 1 byte per element with no scales).
//! - Weight bytes per GPU = ceil(weights / tp) (the largest shard; rounded up).
//! - KV budget per GPU = GPU memory − weight bytes per GPU − reserve; an error when `<= 0`.
//! - KV heads per GPU: [`KvPerGpu::Split`] (default) gives each GPU ceil(kv_heads / tp) heads,
//!   at least 1, so heads are replicated when tp > kv_heads; [`KvPerGpu::Full`] charges every
//!   GPU all kv_heads, as the seed does.
//! - Bytes per request per GPU = ceil(per-GPU bytes per token × seq_len).
//! - Max concurrent requests per unit = floor(budget / bytes per request per GPU). Every request
//!   lives on all tp GPUs of the unit, so this is also the unit's largest batch at seq_len:
//!   `max_batch_at_seq_len == max_concurrent_requests` by construction.
//! - Batches in flight = floor(max concurrent requests / batch).
//!
//! Requests are charged exactly seq_len tokens, as the seed does, not rounded up to whole
//! blocks (the two agree whenever seq_len is a multiple of the block size).
//!
//! # Invariants and cost
//! All arithmetic is integer (u64, with u128 intermediates for products); every quantity the
//! plan reports is below 2^63 or the plan is refused. O(1).

use serde::Serialize;
use tandem_kv_layout::{KvDtype, KvLayout};

use super::error::PlanError;
use super::units::{at_least_one, checked_product};

/// Element type of the stored KV cache, as the planner accepts it (`--dtype`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum PlanKvDtype {
    /// 4 bytes per element.
    F32,
    /// 2 bytes per element.
    F16,
    /// 2 bytes per element.
    Bf16,
    /// 1 byte per element plus f16 scales per (layer, block, head): one per K channel, one per V
    /// token (KIVI), amortised per token.
    Int8,
    /// 1 byte per element, no scales.
    Fp8,
}

impl PlanKvDtype {
    /// A stable lowercase name.
    pub const fn as_str(self) -> &'static str {
        match self {
            PlanKvDtype::F32 => "f32",
            PlanKvDtype::F16 => "f16",
            PlanKvDtype::Bf16 => "bf16",
            PlanKvDtype::Int8 => "int8",
            PlanKvDtype::Fp8 => "fp8",
        }
    }
}

/// How KV heads are charged to the GPUs of a tensor-parallel unit (`--kv-per-gpu`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum KvPerGpu {
    /// Each GPU holds ceil(kv_heads / tp) heads, at least one (replicated when tp > kv_heads).
    Split,
    /// Each GPU is charged all KV heads: the seed's conservative arithmetic.
    Full,
}

impl KvPerGpu {
    /// A stable lowercase name.
    pub const fn as_str(self) -> &'static str {
        match self {
            KvPerGpu::Split => "split",
            KvPerGpu::Full => "full",
        }
    }
}

/// The part of a model's shape that sizes its KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct ModelShape {
    /// Transformer layers.
    pub num_layers: usize,
    /// KV heads per layer (after GQA), for the whole model.
    pub num_kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
}

/// Everything the arithmetic needs, already in bytes and tokens.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PlanInput {
    /// The model's KV shape.
    pub shape: ModelShape,
    /// KV element type.
    pub kv_dtype: PlanKvDtype,
    /// Tokens per KV block (only changes the figures for int8, whose scales are per block).
    pub block_size_tokens: usize,
    /// All weights of the model.
    pub weight_bytes: u64,
    /// Memory of one GPU.
    pub gpu_mem_bytes: u64,
    /// Tensor-parallel degree: GPUs per serving unit.
    pub tp: u32,
    /// Memory set aside per GPU for activations and runtime.
    pub reserve_bytes: u64,
    /// Tokens per request (prompt + output) the plan is for.
    pub seq_len_tokens: u64,
    /// Requests per batch.
    pub batch: u64,
    /// How KV heads are charged per GPU.
    pub kv_per_gpu: KvPerGpu,
}

/// KV bytes per token as an exact ratio (`bytes` per `tokens` tokens), so int8's per-block
/// scales amortise without floating point.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvCost {
    /// Bytes stored for `tokens` tokens.
    pub bytes: u64,
    /// Tokens those bytes hold (1, or the block size for int8).
    pub tokens: u64,
}

impl KvCost {
    /// The cost of `num_kv_heads` heads of `shape` stored as `dtype`.
    pub fn of(
        shape: ModelShape,
        num_kv_heads: usize,
        dtype: PlanKvDtype,
        block_size_tokens: usize,
    ) -> Result<Self, PlanError> {
        let layout = |d| {
            KvLayout::new(
                shape.num_layers,
                num_kv_heads,
                shape.head_dim,
                block_size_tokens,
                d,
                0,
            )
        };
        let exact = |d| -> Result<KvCost, PlanError> {
            let bytes = layout(d)?
                .bytes_per_token_exact()
                .expect("unquantised KV dtypes have an exact per-token size");
            Ok(KvCost {
                bytes: bytes as u64,
                tokens: 1,
            })
        };
        match dtype {
            PlanKvDtype::F32 => exact(KvDtype::F32),
            PlanKvDtype::F16 => exact(KvDtype::F16),
            PlanKvDtype::Bf16 => exact(KvDtype::Bf16),
            // fp8 has no KvDtype yet: one byte per element, no scales, so half of f16's bytes.
            PlanKvDtype::Fp8 => exact(KvDtype::F16).map(|c| KvCost {
                bytes: c.bytes / 2,
                ..c
            }),
            PlanKvDtype::Int8 => {
                let l = layout(KvDtype::Int8)?;
                Ok(KvCost {
                    bytes: l.block_bytes() as u64,
                    tokens: block_size_tokens as u64,
                })
            }
        }
    }

    /// Bytes for `tokens` tokens, rounded up to a whole byte.
    pub fn bytes_for(&self, field: &'static str, tokens: u64) -> Result<u64, PlanError> {
        let bytes = (self.bytes as u128 * tokens as u128).div_ceil(self.tokens as u128);
        u64::try_from(bytes)
            .ok()
            .filter(|b| *b < (1 << 63))
            .ok_or_else(|| PlanError::InvalidValue {
                field,
                value: tokens.to_string(),
                reason: "needs more than 2^63 bytes of KV",
            })
    }

    /// Bytes per token, rounded up to a whole byte (exact unless int8 scales leave a fraction).
    pub fn bytes_per_token_ceil(&self) -> u64 {
        self.bytes.div_ceil(self.tokens)
    }
}

/// How many requests one unit holds under one [`KvPerGpu`] mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Capacity {
    /// The mode these figures are for.
    pub mode: KvPerGpu,
    /// KV heads each GPU stores.
    pub kv_heads_per_gpu: usize,
    /// KV bytes per token on one GPU (rounded up).
    pub kv_bytes_per_token_per_gpu: u64,
    /// KV bytes one request of seq_len tokens occupies on one GPU.
    pub kv_bytes_per_request_per_gpu: u64,
    /// KV bytes one batch of seq_len-token requests occupies on one GPU.
    pub kv_bytes_at_batch_per_gpu: u64,
    /// floor(KV budget per GPU / bytes per request per GPU): requests the unit holds at once.
    pub max_concurrent_requests: u64,
    /// floor(max_concurrent_requests / batch).
    pub batches_in_flight: u64,
}

/// A computed plan: the chosen mode's figures, and the other mode's for comparison.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Plan {
    /// What the plan was computed from.
    pub input: PlanInput,
    /// KV bytes per token for the whole model (all KV heads; rounded up).
    pub kv_bytes_per_token: u64,
    /// KV bytes of one batch at seq_len for the whole model (all KV heads).
    pub kv_bytes_at_batch: u64,
    /// The weight shard one GPU holds: ceil(weights / tp).
    pub weight_bytes_per_gpu: u64,
    /// GPU memory − weight bytes per GPU − reserve.
    pub kv_budget_bytes: u64,
    /// Figures under the requested mode.
    pub chosen: Capacity,
    /// Figures under the other mode (equal to `chosen` when tp = 1).
    pub alternative: Capacity,
}

impl Plan {
    /// The largest batch of seq_len-token requests one unit holds; equal to
    /// [`Capacity::max_concurrent_requests`] because every request spans all tp GPUs.
    pub fn max_batch_at_seq_len(&self) -> u64 {
        self.chosen.max_concurrent_requests
    }
}

/// Validates `input` and computes its plan.
pub fn compute(input: &PlanInput) -> Result<Plan, PlanError> {
    let tp = at_least_one("--tp", u64::from(input.tp))?;
    let seq_len = at_least_one("--seq-len", input.seq_len_tokens)?;
    let batch = at_least_one("--batch", input.batch)?;
    at_least_one("--layers", input.shape.num_layers as u64)?;
    at_least_one("--kv-heads", input.shape.num_kv_heads as u64)?;
    at_least_one("--head-dim", input.shape.head_dim as u64)?;
    at_least_one("--block-size", input.block_size_tokens as u64)?;

    let weight_bytes_per_gpu = input.weight_bytes.div_ceil(tp);
    let needed = weight_bytes_per_gpu as u128 + input.reserve_bytes as u128;
    if needed >= input.gpu_mem_bytes as u128 {
        return Err(PlanError::WeightsDoNotFit {
            weight_bytes: input.weight_bytes,
            weight_bytes_per_gpu,
            reserve_bytes: input.reserve_bytes,
            gpu_mem_bytes: input.gpu_mem_bytes,
            tp: input.tp,
        });
    }
    let kv_budget_bytes = input.gpu_mem_bytes - weight_bytes_per_gpu - input.reserve_bytes;

    let whole = KvCost::of(
        input.shape,
        input.shape.num_kv_heads,
        input.kv_dtype,
        input.block_size_tokens,
    )?;
    let request_bytes = whole.bytes_for("--seq-len", seq_len)?;
    let kv_bytes_at_batch = checked_product("--batch", request_bytes, batch)?;

    let capacity = |mode| capacity(input, mode, kv_budget_bytes);
    let other = match input.kv_per_gpu {
        KvPerGpu::Split => KvPerGpu::Full,
        KvPerGpu::Full => KvPerGpu::Split,
    };
    Ok(Plan {
        input: *input,
        kv_bytes_per_token: whole.bytes_per_token_ceil(),
        kv_bytes_at_batch,
        weight_bytes_per_gpu,
        kv_budget_bytes,
        chosen: capacity(input.kv_per_gpu)?,
        alternative: capacity(other)?,
    })
}

/// KV heads one GPU stores under `mode`.
pub fn kv_heads_per_gpu(num_kv_heads: usize, tp: u32, mode: KvPerGpu) -> usize {
    match mode {
        KvPerGpu::Full => num_kv_heads,
        KvPerGpu::Split => num_kv_heads.div_ceil(tp as usize).max(1),
    }
}

fn capacity(input: &PlanInput, mode: KvPerGpu, budget: u64) -> Result<Capacity, PlanError> {
    let heads = kv_heads_per_gpu(input.shape.num_kv_heads, input.tp, mode);
    let cost = KvCost::of(input.shape, heads, input.kv_dtype, input.block_size_tokens)?;
    let per_request = cost.bytes_for("--seq-len", input.seq_len_tokens)?;
    let max_concurrent_requests = budget / per_request;
    Ok(Capacity {
        mode,
        kv_heads_per_gpu: heads,
        kv_bytes_per_token_per_gpu: cost.bytes_per_token_ceil(),
        kv_bytes_per_request_per_gpu: per_request,
        kv_bytes_at_batch_per_gpu: checked_product("--batch", per_request, input.batch)?,
        max_concurrent_requests,
        batches_in_flight: max_concurrent_requests / input.batch,
    })
}

#[cfg(test)]
#[path = "calc_tests.rs"]
mod tests;
