//! The engine's public data types: its configuration ([`EngineConfig`], [`KvCapacity`]), a
//! [`Request`], what a step hands back ([`StepOutput`], [`Usage`], [`FinishReason`]), what a
//! layer observer sees ([`ChunkView`], [`LayerDone`]), a whole [`Completion`], and the
//! [`EngineStats`] counters.
//!
//! Plain data: the [`Engine`](super::Engine) builds and consumes these; none of them holds
//! engine state.

use serde::{Deserialize, Serialize};
use tandem_kv_layout::KvDtype;

use crate::kv::BlockId;
use crate::sampler::{SamplingParams, TokenLogprob};
use crate::scheduler::{Priority, SchedulerConfig};

/// How big the KV pool is.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KvCapacity {
    /// A byte budget (blocks = budget / block bytes).
    Bytes(u64),
    /// An exact block count.
    Blocks(usize),
}

/// Engine settings beyond the model itself.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct EngineConfig {
    /// Tokens per KV block.
    pub block_size_tokens: usize,
    /// Element type of the stored KV.
    pub kv_dtype: KvDtype,
    /// Size of the KV pool.
    pub kv_capacity: KvCapacity,
    /// Scheduling knobs.
    pub scheduler: SchedulerConfig,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            block_size_tokens: 16,
            kv_dtype: KvDtype::F32,
            kv_capacity: KvCapacity::Bytes(1 << 30),
            scheduler: SchedulerConfig::default(),
        }
    }
}

/// One generation request.
#[derive(Clone, Debug)]
pub struct Request {
    /// Caller-chosen id, unique among live requests.
    pub id: u64,
    /// Prompt token ids (already templated and tokenised).
    pub prompt: Vec<u32>,
    /// Sampling parameters.
    pub params: SamplingParams,
    /// Priority class.
    pub priority: Priority,
}

/// Why a request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// The model produced an end-of-sequence token.
    Eos,
    /// A stop string appeared in the output.
    StopString,
    /// `max_new_tokens` were generated.
    Length,
    /// The caller aborted it.
    Aborted,
}

impl FinishReason {
    /// Stable label; `Eos` and `StopString` both read "stop", as OpenAI's API does.
    pub fn as_openai_str(self) -> &'static str {
        match self {
            FinishReason::Eos | FinishReason::StopString => "stop",
            FinishReason::Length => "length",
            FinishReason::Aborted => "abort",
        }
    }
}

/// Token accounting of a request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Prompt tokens whose KV came from the prefix cache.
    pub cached_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
}

/// What a step produced for one request.
#[derive(Clone, Debug, PartialEq)]
pub struct StepOutput {
    /// The request.
    pub request_id: u64,
    /// The sampled token.
    pub token: u32,
    /// Its log probability and top alternatives, when the request asked (`logprobs`).
    pub logprob: Option<TokenLogprob>,
    /// Newly released text (may be empty while a character or a possible stop string is pending).
    pub text: String,
    /// Set when this was the request's last output.
    pub finished: Option<FinishReason>,
    /// Token accounting so far.
    pub usage: Usage,
    /// For requests added with [`Engine::add_prefill_request`](super::Engine::add_prefill_request), on their (only) output: the
    /// blocks holding the prompt's KV, kept until [`Engine::release_held`](super::Engine::release_held).
    pub held_blocks: Option<Vec<BlockId>>,
}

/// One chunk of the batch being computed, as a [`LayerDone`] observer sees it.
#[derive(Clone, Copy, Debug)]
pub struct ChunkView<'a> {
    /// The request.
    pub request_id: u64,
    /// Position of the chunk's first token.
    pub first_pos: usize,
    /// Tokens in the chunk.
    pub len: usize,
    /// The sequence's blocks (covering at least `first_pos + len` tokens).
    pub block_table: &'a [BlockId],
    /// True when this chunk ends at the sequence's last token (a prompt's final chunk).
    pub last_chunk: bool,
}

/// What a step observer is told after each layer's KV is written.
#[derive(Clone, Copy, Debug)]
pub struct LayerDone<'a> {
    /// The layer whose KV is now in the pool for every chunk of the step.
    pub layer: usize,
    /// Layers in the model.
    pub num_layers: usize,
    /// The step's chunks.
    pub chunks: &'a [ChunkView<'a>],
}

/// A finished request's whole output (see [`Engine::generate`](super::Engine::generate)).
#[derive(Clone, Debug, PartialEq)]
pub struct Completion {
    /// The request.
    pub request_id: u64,
    /// Generated token ids (EOS included if it ended the request).
    pub tokens: Vec<u32>,
    /// Generated text (stop string and EOS excluded).
    pub text: String,
    /// Why it ended.
    pub finish_reason: FinishReason,
    /// Token accounting.
    pub usage: Usage,
}

/// Counters since start (for benchmarks and load reports).
#[derive(Clone, Copy, Debug, Default)]
pub struct EngineStats {
    /// Forward passes run.
    pub steps: u64,
    /// Prompt tokens computed (prefill).
    pub prefill_tokens: u64,
    /// Tokens generated.
    pub decode_tokens: u64,
    /// Preemptions by recompute.
    pub preemptions: u64,
    /// Structured outputs ended early because their grammar failed (llguidance's limits).
    pub grammar_failures: u64,
    /// KV bytes copied from the device to the host mirror (staged push; 0 without a mirror).
    pub kv_staged_out_bytes: u64,
    /// KV bytes copied from the host mirror to the device (staged receive).
    pub kv_staged_in_bytes: u64,
    /// Prompts adopted whose KV a transport had already put in device memory (CUDA IPC): no
    /// copy from the host mirror.
    pub kv_adopted_on_device: u64,
    /// Whether a staged engine's host mirror is page-locked (false without a mirror: see
    /// [`Engine::kv_mirror`](crate::Engine::kv_mirror)).
    pub kv_mirror_pinned: bool,
    /// Tokens picked on the device (greedy or sampled there; only their ids came back). The
    /// rest were picked by the host from rows of logits.
    pub tokens_picked_on_device: u64,
    /// CUDA: decode steps replayed from a captured graph.
    pub cuda_graph_replays: u64,
    /// CUDA: graph captures that failed (decode then runs without graphs; logged once).
    pub cuda_graph_fallbacks: u64,
}
