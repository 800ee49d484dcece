//! tandem's CPU compute kernels: dense and block-quantized (GGUF Q8_0 / Q4_1 / Q4_0) linear layers,
//! RMSNorm, RoPE, SiLU-gating, paged-KV writes and causal paged attention, multi-threaded on a
//! persistent [`WorkerPool`] and vectorised for AVX-512 and AVX2 with a portable fallback.
//!
//! # The invariance contract
//!
//! Every output element is computed by **one fixed sequence of IEEE-754 operations** that
//! depends only on the inputs that element reads (for attention: the query, its position and
//! the KV it attends to). It never depends on the batch size `m`, on the other rows in the
//! batch, on how a prefill was chunked, on the thread count or on which thread ran it, and not
//! even on the instruction set: the AVX-512, AVX2 and portable paths produce the same bits.
//! Concretely (the canonical orders are defined by the scalar code in `simd/portable.rs`):
//!
//! | kernel | per-element order |
//! |---|---|
//! | [`linear`] | `acc = fma(x[i][k], w[j][k], acc)` for `k` ascending, from `+0.0`; a quantized `w[j][k]` is first decoded to its exact f32 value ([`quant`]) |
//! | [`rms_norm`] | 16-lane sum of squares (`fma`) + fixed tree; `(x * (1/sqrt(ss/n + eps))) * w` |
//! | [`rope`] | `a*cos - b*sin`, `b*cos + a*sin`, unfused |
//! | [`silu_mul`] | `(g / (1 + exp(-g))) * u`, `exp` a fixed polynomial |
//! | [`paged_attention`] | 16-lane dot per score; max; `exp(s - max)`; 16-lane sum over positions; `acc = fma(e_t, v_t, acc)` over positions ascending; `acc / sum` |
//!
//! Work is split across threads by output rows / features / (sequence, head, query), never along
//! a reduction. The price: no split-K parallelism and one accumulator chain per output.
//!
//! Int8 KV is the exception for *chunking*: a block's per-channel key scales grow as tokens
//! arrive, so a query that ran before later tokens requantized a channel can read slightly
//! different keys than the same query run after them. Batch and thread invariance still hold.
//!
//! # Choosing how kernels run
//! The plain functions ([`linear`], ...) use [`Exec::global`]: the process-wide pool
//! ([`global_pool`], `TANDEM_THREADS`) and the active ISA ([`active_isa`], `TANDEM_KERNELS`).
//! The `*_on` variants take an explicit [`Exec`] (tests use them to compare thread counts
//! and instruction sets).

pub use half::{bf16, f16};
pub use tandem_kv_layout::{KvDtype, KvLayout};

mod act;
mod attention;
mod error;
mod kv;
mod linear;
mod norm;
pub mod pool;
pub mod probe;
pub mod quant;
pub mod reference;
mod rope;
pub mod sample;
mod simd;
mod weight;

pub use act::{add_inplace, add_inplace_on, argmax, silu_mul, silu_mul_on};
pub use attention::{AttnSeq, paged_attention, paged_attention_on};
pub use error::KernelError;
pub use kv::{KvCacheMut, KvCacheRef, KvPart, read_kv, write_kv};
pub use linear::{linear, linear_on};
pub use norm::{rms_norm, rms_norm_on};
pub use pool::{PoolStats, Sharing, WorkerPool, global_pool};
pub use rope::{RopeTable, rope, rope_on};
pub use simd::{Isa, active_isa, set_active_isa};
pub use weight::{PANEL_ROWS, Weight, WeightDtype};

/// Names of the environment variables this crate reads, in one place.
pub mod env {
    /// Instruction set for the plain entry points: `portable`, `avx2`, `avx512` or `auto`.
    pub const TANDEM_KERNELS: &str = "TANDEM_KERNELS";
    /// Threads in the global worker pool (caller included); default: available cores.
    pub const TANDEM_THREADS: &str = "TANDEM_THREADS";
    /// How the global pool shares jobs: `adaptive` (default: the caller runs alone while the
    /// workers' help does not pay, e.g. a worker's core is taken) or `always`.
    pub const TANDEM_POOL_SHARING: &str = "TANDEM_POOL_SHARING";
}

/// Where and how a kernel runs: a worker pool and an instruction set.
#[derive(Clone, Copy, Debug)]
pub struct Exec<'p> {
    pool: &'p WorkerPool,
    isa: Isa,
}

impl<'p> Exec<'p> {
    /// Runs on `pool` with `isa`; fails if this CPU cannot run `isa`.
    pub fn new(pool: &'p WorkerPool, isa: Isa) -> Result<Exec<'p>, KernelError> {
        if isa.is_supported() {
            Ok(Exec { pool, isa })
        } else {
            Err(KernelError::IsaUnsupported(isa))
        }
    }

    /// The pool.
    pub fn pool(&self) -> &'p WorkerPool {
        self.pool
    }

    /// The instruction set.
    pub fn isa(&self) -> Isa {
        self.isa
    }
}

impl Exec<'static> {
    /// The global pool and the active ISA.
    pub fn global() -> Exec<'static> {
        Exec {
            pool: global_pool(),
            isa: active_isa(),
        }
    }
}
