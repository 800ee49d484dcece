//! tandem's inference engine: a Llama-family decoder over a paged KV cache, with continuous
//! batching, chunked prefill, prefix caching, preemption by recompute, sampling and a byte-level
//! BPE tokenizer.
//!
//! Synchronous and deterministic by design: no sockets, no async runtime, no clocks read inside
//! (time is passed in). The nodes run it on a dedicated thread and talk to it through channels.
//!
//! | module | owns |
//! |---|---|
//! | [`config`] | the model's shape (GGUF metadata, HF config.json, dummy configs) |
//! | [`loader`] | weights from GGUF / safetensors / seeded random, in the compute dtype |
//! | [`model`] | the forward pass over block tables (the seam to its backend) |
//! | [`backend`] | where the forward runs: CPU kernels or CUDA (`--device`), and the KV store there |
//! | [`kv`] | KV pool bytes and the block manager (ref counts, prefix cache, LRU) |
//! | [`scheduler`] | continuous batching, chunked prefill, priorities, preemption |
//! | [`sampler`] | penalties, greedy / temperature / top-k / top-p with per-request seeds, logprobs |
//! | [`tokenizer`] | byte-level BPE from GGUF or tokenizer.json, ChatML, streaming decode |
//! | [`engine`] | the step loop tying them together |
//!
//! The one invariant everything else leans on: **a request's greedy output is bitwise the same
//! alone or in any batch, chunked or not** (see [`model`]).

pub mod args;
pub mod backend;
pub mod config;
pub mod engine;
pub mod error;
pub mod kv;
pub mod loader;
pub mod model;
pub mod rng;
pub mod sampler;
pub mod scheduler;

pub use args::EngineArgs;
pub use backend::{Device, HostMirror, KvStore, Staging};
pub use config::ModelConfig;
pub use engine::{
    ChunkView, Completion, Engine, EngineConfig, EngineStats, FinishReason, KvCapacity, LayerDone, Request, StepOutput, Usage,
};
pub use error::EngineError;
pub use loader::{DtypeChoice, LoadedModel, ModelSource};
pub use model::Model;
pub use sampler::{SamplingParams, TokenLogprob};
pub use scheduler::{ClassPolicy, Priority, SchedulerConfig};
pub use tandem_kernels::WeightDtype;
/// The tokenizer lives in its own crate (the router uses it without the engine).
pub use tandem_grammar as grammar;
pub use tandem_tokenizer as tokenizer;
pub use tandem_kv_layout::{KvDtype, KvLayout};

/// Threads the compute kernels run on (the global worker pool; `TANDEM_THREADS` sets it).
pub fn kernels_threads() -> usize {
    tandem_kernels::global_pool().threads()
}
