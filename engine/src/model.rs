//! The Llama-family decoder's forward pass over a batch of sequence chunks, reading and writing
//! the paged KV cache through block tables.
//!
//! The model owns weights and its backend's scratch buffers, never KV: the caller passes the
//! [`KvStore`] and each sequence's block table (candle's `qwen2.rs` keeps its cache inside
//! `Attention`; a paged server cannot).
//!
//! # Backends
//! The forward itself runs in a backend ([`crate::backend`]): the CPU kernels, or CUDA
//! (`--device cuda[:N]`). This file is the seam: it holds the host weights and the shape, and
//! dispatches each forward to the backend, which reads and writes a KV store of its own kind.
//!
//! # Batch invariance
//! Every kernel computes each output row with a fixed sequence of float operations that depends
//! only on that row (see `tandem-kernels`), and tokens of different sequences never mix except
//! through the row dimension. So a token's hidden states, its KV and its logits are bitwise the
//! same whether its sequence runs alone or batched, chunked or not, on a prefill node or a
//! decode node. The tests in `engine/tests/` assert this on the real model. (This is the CPU
//! backend's guarantee; the CUDA backend agrees with it within float rounding, see
//! [`crate::backend::cuda`].)
//!
//! # Cost per layer (T tokens in the batch)
//! three weight-streaming matmuls (fused QKV, O, fused gate|up, down: four), one paged-attention
//! call, and O(T · hidden) elementwise work; the LM head runs only on rows that need logits.

use tandem_kernels::WeightDtype;
use tandem_kernels::sample::SampleSpec;
use tandem_kv_layout::{KvDtype, KvLayout};

use crate::backend::cpu::CpuForward;
use crate::backend::cuda::CudaForward;
use crate::backend::staging::{self, HostMirror, StageOut, Staging};
use crate::backend::{Device, ForwardSeq, KvStore, StepLogits};
use crate::config::ModelConfig;
use crate::error::EngineError;
use crate::kv::KvPool;
use crate::loader::ModelWeights;

enum Backend {
    Cpu(CpuForward),
    Cuda(Box<CudaForward>),
}

/// A loaded Llama-family model ready to run.
pub struct Model {
    weights: ModelWeights,
    backend: Backend,
}

impl Model {
    /// Wraps loaded weights for the CPU backend; precomputes the RoPE table for the model's
    /// context length.
    pub fn new(weights: ModelWeights) -> Self {
        let backend = Backend::Cpu(CpuForward::new(&weights.config));
        Model { weights, backend }
    }

    /// Wraps loaded weights for `device`: the CPU as [`Model::new`]; CUDA opens the device,
    /// compiles (or reads cached) kernels and uploads every matrix once, in the dtype the host
    /// weights have (f32 or bf16; others are [`EngineError::InvalidConfig`]), or fails with
    /// [`EngineError::Cuda`] (no driver, no such device, out of device memory, ...).
    pub fn on_device(weights: ModelWeights, device: Device) -> Result<Self, EngineError> {
        match device {
            Device::Cpu => Ok(Model::new(weights)),
            Device::Cuda(ordinal) => {
                let fwd = CudaForward::new(&weights, ordinal)?;
                Ok(Model { weights, backend: Backend::Cuda(Box::new(fwd)) })
            }
        }
    }

    /// One rank of a tensor-parallel group on `cuda:ordinal`: uploads `coll`'s shard of
    /// `weights`, keeps that rank's KV heads ([`kv_layout`](Self::kv_layout)) and all-reduces
    /// through `coll` (see `backend::cuda::shard`).
    pub fn on_cuda_rank(
        weights: ModelWeights,
        ordinal: usize,
        coll: Box<dyn crate::backend::cuda::shard::Collective>,
    ) -> Result<Self, EngineError> {
        let fwd = CudaForward::with_collective(&weights, ordinal, coll)?;
        Ok(Model { weights, backend: Backend::Cuda(Box::new(fwd)) })
    }

    /// Where the forward runs.
    pub fn device(&self) -> Device {
        match &self.backend {
            Backend::Cpu(_) => Device::Cpu,
            Backend::Cuda(c) => Device::Cuda(c.ordinal()),
        }
    }

    /// CUDA: decode steps replayed from a graph, and failed captures; `(0, 0)` on the CPU.
    pub fn cuda_graph_counts(&self) -> (u64, u64) {
        match &self.backend {
            Backend::Cpu(_) => (0, 0),
            Backend::Cuda(c) => c.graph_counts(),
        }
    }

    /// A zeroed KV store of `num_blocks` blocks of `layout` on this model's device (host memory
    /// for the CPU, device memory for CUDA).
    pub fn new_kv(&self, layout: KvLayout, num_blocks: usize) -> Result<KvStore, EngineError> {
        match &self.backend {
            Backend::Cpu(_) => Ok(KvStore::Host(KvPool::new(layout, num_blocks)?)),
            Backend::Cuda(c) => Ok(KvStore::Cuda(c.new_kv(layout, num_blocks)?)),
        }
    }

    /// A host mirror over `host` (the transport's pool; same layout as this model's KV) for a
    /// cache on this model's device. On a GPU the pool is page-locked for DMA; when the driver
    /// refuses, the mirror copies through pageable memory and says so once, here.
    pub fn mirror(&self, host: KvPool, staging: Staging) -> HostMirror {
        let pinned = match &self.backend {
            Backend::Cpu(_) => None,
            Backend::Cuda(c) => match c.pin(&host) {
                Ok(p) => Some(p),
                Err(e) => {
                    tracing::warn!(
                        error = %e,
                        bytes = host.layout().pool_bytes(host.num_blocks()),
                        "KV staging: the host pool could not be page-locked; copies go through pageable memory (slower)"
                    );
                    None
                }
            },
        };
        HostMirror::new(host, staging, pinned)
    }

    /// Transfer access to `kv` when it is in device memory (CUDA IPC); `None` for host memory.
    pub fn kv_device_access(&self, kv: &KvStore) -> Result<Option<tandem_kernels_cuda::KvDeviceAccess>, EngineError> {
        match (&self.backend, kv) {
            (Backend::Cuda(c), KvStore::Cuda(pool)) => c.kv_access(pool).map(Some),
            (_, KvStore::Host(_)) => Ok(None),
            (_, kv) => Err(store_mismatch(self.device(), kv)),
        }
    }

    /// Copies every layer of `blocks` from `mirror` into `kv` (a decode node adopting pushed KV);
    /// they are in `kv` when this returns.
    pub fn stage_in(&mut self, kv: &mut KvStore, mirror: &mut HostMirror, blocks: &[u32]) -> Result<(), EngineError> {
        let here = self.device();
        match (&mut self.backend, kv) {
            (Backend::Cpu(_), KvStore::Host(pool)) => {
                mirror.copy_in_host(pool, blocks);
                Ok(())
            }
            (Backend::Cuda(cuda), KvStore::Cuda(pool)) => cuda.stage_in(pool, mirror, blocks),
            (_, kv) => Err(store_mismatch(here, kv)),
        }
    }

    /// The model's shape.
    pub fn config(&self) -> &ModelConfig {
        &self.weights.config
    }

    /// Weight identity hash (goes into the KV layout fingerprint).
    pub fn fingerprint(&self) -> u64 {
        self.weights.fingerprint
    }

    /// How the matrices are stored, largest share first: e.g. `q4_1+q8_0` for the default
    /// model under `--dtype auto` (Q4_1 layers, a Q8_0 embedding), `f32` for an f32 load.
    pub fn weight_storage(&self) -> String {
        let w = &self.weights;
        let mut by_dtype: Vec<(WeightDtype, usize)> = Vec::new();
        let mats = w.layers.iter().flat_map(|l| [&l.qkv, &l.o_proj, &l.gate_up, &l.down]);
        for m in mats.chain([&w.embed]).chain(w.lm_head.as_ref()) {
            match by_dtype.iter_mut().find(|(d, _)| *d == m.dtype()) {
                Some((_, b)) => *b += m.size_bytes(),
                None => by_dtype.push((m.dtype(), m.size_bytes())),
            }
        }
        by_dtype.sort_by(|a, b| b.1.cmp(&a.1));
        by_dtype.iter().map(|(d, _)| d.as_str()).collect::<Vec<_>>().join("+")
    }

    /// Bytes of weights held in memory.
    pub fn weight_bytes(&self) -> usize {
        let w = &self.weights;
        let layers: usize = w
            .layers
            .iter()
            .map(|l| {
                l.qkv.size_bytes() + l.o_proj.size_bytes() + l.gate_up.size_bytes() + l.down.size_bytes()
                    + 4 * (l.attn_norm.len() + l.mlp_norm.len())
            })
            .sum();
        w.embed.size_bytes() + layers + w.lm_head.as_ref().map_or(0, |h| h.size_bytes())
    }

    /// Bytes of weights streamed per decoded token (everything but the embedding table, which is
    /// only indexed, plus the LM head, which is the embedding again when tied).
    pub fn weight_bytes_per_token(&self) -> usize {
        let w = &self.weights;
        let head = w.lm_head.as_ref().unwrap_or(&w.embed).size_bytes();
        self.weight_bytes() - w.embed.size_bytes() + head
    }

    /// The KV layout this model needs for `block_size_tokens` and `dtype`.
    pub fn kv_layout(&self, block_size_tokens: usize, dtype: KvDtype) -> Result<KvLayout, EngineError> {
        let c = self.config();
        let kv_heads = match &self.backend {
            Backend::Cuda(f) => f.shard().kv_heads(c),
            Backend::Cpu(_) => c.kv_heads(),
        };
        Ok(KvLayout::new(
            c.num_hidden_layers,
            kv_heads,
            c.head_dim(),
            block_size_tokens,
            dtype,
            self.weights.fingerprint,
        )?)
    }

    /// Runs `seqs` through the model, writing their KV into `kv`, and returns the logits of the
    /// last token of every sequence with `want_logits`, row by row in `seqs` order
    /// (`rows × vocab_size`).
    pub fn forward(&mut self, seqs: &[ForwardSeq<'_>], kv: &mut KvStore) -> Result<&[f32], EngineError> {
        self.forward_observed(seqs, kv, &mut |_| {})
    }

    /// [`forward`](Self::forward), calling `on_layer(l)` as soon as layer `l`'s KV of every
    /// sequence in the batch is in the pool (a prefill node streams it out from there while the
    /// later layers compute). On CUDA, "in the pool" means queued on the device's stream ahead
    /// of any later work on it; a staged engine ([`forward_staged`](Self::forward_staged)) reports
    /// a layer only once its KV is in the host mirror.
    pub fn forward_observed(
        &mut self,
        seqs: &[ForwardSeq<'_>],
        kv: &mut KvStore,
        on_layer: &mut dyn FnMut(usize),
    ) -> Result<&[f32], EngineError> {
        match self.forward_staged(seqs, kv, None, None, on_layer)? {
            StepLogits::Rows(rows) => Ok(rows),
            StepLogits::Picked(_) => unreachable!("picks only when asked"),
        }
    }

    /// [`forward_observed`](Self::forward_observed) with a host mirror of `kv` (the staged path
    /// of disaggregated serving): a [`Staging::Push`] mirror receives every slab the step
    /// writes, layer by layer, and `on_layer(l)` is called once layer `l`'s slabs are in the
    /// mirror. A [`Staging::Receive`] mirror is not touched by a forward pass.
    ///
    /// `picks`: every wanted row only needs its pick, by these specs (one per wanted row, in
    /// order; see [`Sampler::device_spec`](crate::sampler::Sampler::device_spec)). A GPU then
    /// picks the tokens on the device and returns only their ids ([`StepLogits::Picked`]); the
    /// CPU returns the rows either way (they are in host memory already).
    pub fn forward_staged(
        &mut self,
        seqs: &[ForwardSeq<'_>],
        kv: &mut KvStore,
        mirror: Option<&mut HostMirror>,
        picks: Option<&[SampleSpec]>,
        on_layer: &mut dyn FnMut(usize),
    ) -> Result<StepLogits<'_>, EngineError> {
        let mut stage = mirror.filter(|m| m.staging() == Staging::Push).map(|mirror| {
            let blocks = staging::written_blocks(seqs, kv.layout().block_size_tokens);
            StageOut { mirror, blocks }
        });
        let stage = stage.as_mut();
        let here = self.device();
        match (&mut self.backend, kv) {
            (Backend::Cpu(cpu), KvStore::Host(pool)) => {
                cpu.forward(&self.weights, seqs, pool, stage, on_layer).map(StepLogits::Rows)
            }
            (Backend::Cuda(cuda), KvStore::Cuda(pool)) => {
                cuda.forward(&self.weights.config, seqs, pool, stage, picks, on_layer)
            }
            (_, kv) => Err(store_mismatch(here, kv)),
        }
    }
}

/// A KV store on another device than the model's.
fn store_mismatch(model_device: Device, kv: &KvStore) -> EngineError {
    EngineError::InvalidConfig {
        field: "kv_store",
        value: kv.device().to_string(),
        reason: format!("the model runs on {model_device}; its KV must be there too (build it with Model::new_kv)"),
    }
}
