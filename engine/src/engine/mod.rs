//! The engine: model + KV pool + scheduler + per-request sampling and detokenisation, driven one
//! step at a time by its owner (a node's engine thread, or `tandem generate`).
//!
//! ```text
//!   add_request ──► Scheduler (waiting → running, blocks) ──► step():
//!                      schedule ─► Model::forward(chunks, KvPool) ─► sample ─► text/stop checks
//!                      ◄── on_chunk_done / remove (blocks released) ◄────────────┘
//! ```
//! The engine is synchronous and single-threaded (the kernels parallelise internally); it never
//! sleeps: [`Engine::wait_hint`] tells the driver how long the batching window wants it to wait.
//!
//! | file | holds |
//! |---|---|
//! | `mod.rs` | [`Engine`]: construction, accessors, request validation, `add_request`, `abort` |
//! | `step.rs` | the step loop: `step`, `step_observed`, sampling, text and stop checks, `generate` |
//! | `disaggregated.rs` | prefill/decode split: held prefill KV, reservations, `add_prefilled` |
//! | `types.rs` | the public data types: config, request, outputs, stats |

mod disaggregated;
mod step;
mod types;

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use tandem_grammar::{Constraint, Vocabulary};
use tandem_kv_layout::KvLayout;

use crate::backend::{Device, HostMirror, KvStore, Staging};
use crate::error::EngineError;
use crate::kv::{BlockId, KvPool};
use crate::model::Model;
use crate::sampler::Sampler;
use crate::scheduler::Scheduler;
use crate::tokenizer::Tokenizer;

pub use self::types::{
    ChunkView, Completion, EngineConfig, EngineStats, FinishReason, KvCapacity, LayerDone, Request, StepOutput, Usage,
};

struct ReqState {
    sampler: Sampler,
    hold_kv: bool,
    prompt_len: usize,
    generated: Vec<u32>,
    pending: Vec<u8>,
    text: String,
    emitted: usize,
    max_stop_len: usize,
    /// Prompt tokens a prefill node served from its prefix cache (prefilled requests).
    cached_prompt_tokens: usize,
}

/// The inference engine.
pub struct Engine {
    model: Model,
    /// The KV cache, on the model's device.
    pool: KvStore,
    /// The transport's host pool beside a cache on another device (staged disaggregation).
    mirror: Option<HostMirror>,
    sched: Scheduler,
    tokenizer: Option<Arc<Tokenizer>>,
    reqs: HashMap<u64, ReqState>,
    eos: Vec<u32>,
    stats: EngineStats,
    /// Finished prefill-only requests' blocks, until released.
    held: HashMap<u64, Vec<BlockId>>,
    /// Blocks reserved for KV arriving from elsewhere, by reservation id.
    reservations: HashMap<u64, Vec<BlockId>>,
    /// Reservations whose KV a transport wrote straight into device memory (CUDA IPC): adopting
    /// them copies nothing up from the mirror.
    kv_on_device: std::collections::HashSet<u64>,
    /// The last step's requests and the tokens each computed in it (cost accounting).
    last_step: Vec<(u64, usize)>,
    /// The tokenizer's vocabulary for structured output, built on the first request that asks
    /// (~0.1 s); an error (no tokenizer) is kept and returned to every such request.
    grammar: OnceLock<Result<Arc<Vocabulary>, String>>,
}

impl Engine {
    /// Builds an engine around `model`; the KV pool is allocated here, once, on the model's
    /// device (host memory, or device memory for CUDA).
    pub fn new(model: Model, tokenizer: Option<Tokenizer>, cfg: EngineConfig) -> Result<Self, EngineError> {
        let (layout, num_blocks) = Self::pool_shape(&model, &cfg)?;
        let pool = model.new_kv(layout, num_blocks)?;
        Self::with_store(model, tokenizer, cfg, pool, None)
    }

    /// The KV layout and block count `cfg` asks of `model` (to allocate external memory for).
    pub fn pool_shape(model: &Model, cfg: &EngineConfig) -> Result<(KvLayout, usize), EngineError> {
        let layout = model.kv_layout(cfg.block_size_tokens, cfg.kv_dtype)?;
        let num_blocks = match cfg.kv_capacity {
            KvCapacity::Blocks(n) => n,
            KvCapacity::Bytes(b) => layout.blocks_for_bytes(b),
        };
        if num_blocks == 0 {
            return Err(EngineError::InvalidConfig {
                field: "kv_cache",
                value: format!("{:?}", cfg.kv_capacity),
                reason: format!("smaller than one block ({} bytes)", layout.block_bytes()),
            });
        }
        Ok((layout, num_blocks))
    }

    /// Builds an engine whose KV lives in `pool` (e.g. [`KvPool::external`] over memory a KV
    /// transport allocated); the pool's layout must be the model's, and the model must run on
    /// the CPU (a CUDA model's KV is in device memory: give the host pool as its mirror with
    /// [`with_staged_pool`](Self::with_staged_pool)).
    pub fn with_pool(model: Model, tokenizer: Option<Tokenizer>, cfg: EngineConfig, pool: KvPool) -> Result<Self, EngineError> {
        if model.device() != Device::Cpu {
            return Err(EngineError::InvalidConfig {
                field: "kv_pool",
                value: format!("host memory, model on {}", model.device()),
                reason: "a CUDA model's KV lives in device memory; pass the host pool as its mirror \
                         (Engine::with_staged_pool)"
                    .into(),
            });
        }
        Self::with_store(model, tokenizer, cfg, KvStore::Host(pool), None)
    }

    /// Builds an engine whose KV lives on the model's device, beside `host` (the transport's
    /// pool, same layout and block count) as its [`HostMirror`]: a prefill node pushes from the
    /// mirror ([`Staging::Push`]: every slab a step writes is copied there, layer by layer), a
    /// decode node receives into it ([`Staging::Receive`]: adopted prompts are copied up by
    /// [`add_prefilled`](Self::add_prefilled)). On the CPU the device cache is a second host
    /// pool, so the path runs (and is tested) without a GPU; a CPU node needs no mirror and
    /// uses [`with_pool`](Self::with_pool).
    pub fn with_staged_pool(
        model: Model,
        tokenizer: Option<Tokenizer>,
        cfg: EngineConfig,
        host: KvPool,
        staging: Staging,
    ) -> Result<Self, EngineError> {
        let layout = model.kv_layout(cfg.block_size_tokens, cfg.kv_dtype)?;
        layout.check_compatible(host.layout())?;
        let store = model.new_kv(*host.layout(), host.num_blocks())?;
        let mirror = model.mirror(host, staging);
        tracing::info!(
            device = %model.device(),
            staging = staging.as_str(),
            pinned = mirror.pinned(),
            kv_bytes = layout.pool_bytes(store.num_blocks()),
            "KV staged through the transport's host pool"
        );
        Self::with_store(model, tokenizer, cfg, store, Some(mirror))
    }

    fn with_store(
        model: Model,
        tokenizer: Option<Tokenizer>,
        cfg: EngineConfig,
        pool: KvStore,
        mirror: Option<HostMirror>,
    ) -> Result<Self, EngineError> {
        model.kv_layout(cfg.block_size_tokens, cfg.kv_dtype)?.check_compatible(pool.layout())?;
        let num_blocks = pool.num_blocks();
        let mut sched_cfg = cfg.scheduler.clone();
        sched_cfg.max_model_len = sched_cfg.max_model_len.min(model.config().max_position_embeddings);
        let sched = Scheduler::new(sched_cfg, num_blocks, cfg.block_size_tokens)?;
        let mut eos = model.config().eos_token_id.clone();
        if let Some(t) = &tokenizer
            && !eos.contains(&t.eos_token_id())
        {
            eos.push(t.eos_token_id());
        }
        Ok(Engine { model, pool, mirror, sched, tokenizer: tokenizer.map(Arc::new), reqs: HashMap::new(), eos, stats: EngineStats::default(), held: HashMap::new(), reservations: HashMap::new(), kv_on_device: Default::default(), last_step: Vec::new(), grammar: OnceLock::new() })
    }

    /// The model.
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// The tokenizer, if the checkpoint has one.
    pub fn tokenizer(&self) -> Option<&Arc<Tokenizer>> {
        self.tokenizer.as_ref()
    }

    /// The KV layout (with the model fingerprint).
    pub fn kv_layout(&self) -> &KvLayout {
        self.pool.layout()
    }

    /// The host KV pool kv-transfer reads and writes: the KV itself on the CPU, its
    /// [`HostMirror`] when the KV is staged; `None` when the KV lives in device memory with no
    /// mirror (`Engine::new` with `--device cuda`).
    pub fn kv_pool(&self) -> Option<&KvPool> {
        match &self.mirror {
            Some(m) => Some(m.host()),
            None => self.pool.host(),
        }
    }

    /// The host KV pool, mutable: for copying received KV into reserved blocks in-process
    /// (colocated transfers, tests). Writing blocks a sequence owns corrupts its output.
    pub fn kv_pool_mut(&mut self) -> Option<&mut KvPool> {
        match &mut self.mirror {
            Some(m) => Some(m.host_mut()),
            None => self.pool.host_mut(),
        }
    }

    /// The KV cache itself, on the model's device (tests compare it with the mirror).
    pub fn kv_store(&self) -> &KvStore {
        &self.pool
    }

    /// The KV cache, writable: for writing received KV into reserved blocks in-process, as a
    /// CUDA IPC transfer writes device memory (tests). Writing blocks a sequence owns corrupts
    /// its output.
    pub fn kv_store_mut(&mut self) -> &mut KvStore {
        &mut self.pool
    }

    /// The host mirror of a staged KV cache ([`with_staged_pool`](Self::with_staged_pool)).
    pub fn kv_mirror(&self) -> Option<&HostMirror> {
        self.mirror.as_ref()
    }

    /// Where the forward runs (and the KV lives).
    pub fn device(&self) -> Device {
        self.model.device()
    }

    /// The scheduler (queue lengths, block counts).
    pub fn scheduler(&self) -> &Scheduler {
        &self.sched
    }

    /// Caps the prompt tokens a step computes ([`Scheduler::set_prefill_token_cap`]).
    pub fn set_prefill_token_cap(&mut self, cap: Option<usize>) {
        self.sched.set_prefill_token_cap(cap);
    }

    /// Starts logging prefix-cache changes (nodes publish them as KV events).
    pub fn log_cache_events(&mut self) {
        self.sched.log_cache_events();
    }

    /// The prefix-cache changes since the last call; `None` when some were dropped (read
    /// [`cached_hashes`](Self::cached_hashes) instead), or when logging is off.
    pub fn drain_cache_events(&mut self) -> Option<Vec<crate::kv::CacheEvent>> {
        self.sched.drain_cache_events()
    }

    /// Every block hash the prefix cache holds now.
    pub fn cached_hashes(&self) -> Vec<u64> {
        self.sched.blocks().cached_hashes()
    }

    /// What a KV transport needs to reach this engine's KV in device memory directly (CUDA IPC
    /// between two processes on one GPU); `None` when the KV is in host memory.
    pub fn kv_device_access(&self) -> Result<Option<tandem_kernels_cuda::KvDeviceAccess>, EngineError> {
        self.model.kv_device_access(&self.pool)
    }

    /// Counters since start.
    pub fn stats(&self) -> EngineStats {
        let mut s = self.stats;
        (s.cuda_graph_replays, s.cuda_graph_fallbacks) = self.model.cuda_graph_counts();
        if let Some(m) = &self.mirror {
            (s.kv_staged_out_bytes, s.kv_staged_in_bytes, s.kv_mirror_pinned) = (m.bytes_out(), m.bytes_in(), m.pinned());
        }
        s
    }

    /// The requests of the last step that ran a forward pass, with the tokens each computed in
    /// it (a chunk's length, 1 for a decode token): what a step's time is shared by.
    pub fn last_step_tokens(&self) -> &[(u64, usize)] {
        &self.last_step
    }

    /// True when nothing is waiting or running.
    pub fn is_idle(&self) -> bool {
        self.sched.is_idle()
    }

    /// How long to wait before stepping, to let a batch gather (the configured window).
    pub fn wait_hint(&self, now: Instant) -> Option<Duration> {
        self.sched.wait_hint(now)
    }

    /// Validates and queues a request. Nothing changes on error.
    pub fn add_request(&mut self, req: Request, now: Instant) -> Result<(), EngineError> {
        let constraint = self.validate(&req)?;
        self.sched.add(req.id, req.prompt.clone(), req.params.max_new_tokens, req.priority, now)?;
        self.insert_state(req, false, constraint);
        Ok(())
    }

    /// Checks `req` against this engine, and compiles its `response_format` into a constraint
    /// advanced past the output a migration resumes after.
    fn validate(&self, req: &Request) -> Result<Option<Constraint>, EngineError> {
        req.params.validate()?;
        let vocab = self.model.config().vocab_size;
        if let Some(&bad) = req.prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(EngineError::InvalidRequest {
                field: "prompt",
                value: format!("token id {bad}"),
                reason: format!("outside the vocabulary of {vocab} tokens"),
            });
        }
        if !req.params.stop.is_empty() && self.tokenizer.is_none() {
            return Err(EngineError::InvalidRequest {
                field: "stop",
                value: format!("{:?}", req.params.stop),
                reason: "stop strings need a tokenizer; this model has none".into(),
            });
        }
        if self.reqs.contains_key(&req.id) || self.held.contains_key(&req.id) {
            return Err(EngineError::DuplicateRequest(req.id));
        }
        let Some(format) = &req.params.response_format else {
            return Ok(None);
        };
        let mut constraint = self.grammar_vocabulary()?.compile(format)?;
        let resumed = req.params.resumed_output_tokens.min(req.prompt.len());
        for &t in &req.prompt[req.prompt.len() - resumed..] {
            constraint.commit(t).map_err(|e| EngineError::InvalidRequest {
                field: "resumed_output_tokens",
                value: resumed.to_string(),
                reason: format!("the output so far does not follow response_format: {e}"),
            })?;
        }
        Ok(Some(constraint))
    }

    /// The vocabulary structured output compiles against (built once, on first use).
    fn grammar_vocabulary(&self) -> Result<&Arc<Vocabulary>, EngineError> {
        let built = self.grammar.get_or_init(|| {
            let t = self.tokenizer.as_ref().ok_or("this model has no tokenizer")?;
            // The tokenizer's end of sequence first: it is the grammar's own.
            let mut eos = vec![t.eos_token_id()];
            eos.extend(self.eos.iter().filter(|&&e| e != t.eos_token_id()));
            Vocabulary::new(t.clone(), self.model.config().vocab_size, &eos)
                .map(Arc::new)
                .map_err(|e| e.to_string())
        });
        built.as_ref().map_err(|reason| EngineError::InvalidRequest {
            field: "response_format",
            value: "(structured output)".into(),
            reason: reason.clone(),
        })
    }

    fn insert_state(&mut self, req: Request, hold_kv: bool, constraint: Option<Constraint>) {
        let max_stop_len = req.params.stop.iter().map(|s| s.len()).max().unwrap_or(0);
        self.reqs.insert(
            req.id,
            ReqState {
                sampler: Sampler::new(req.params, req.id, &req.prompt).constrained(constraint),
                hold_kv,
                cached_prompt_tokens: 0,
                prompt_len: req.prompt.len(),
                generated: Vec::new(),
                pending: Vec::new(),
                text: String::new(),
                emitted: 0,
                max_stop_len,
            },
        );
    }

    /// Stops a request and releases its blocks; false if it was not live.
    pub fn abort(&mut self, request_id: u64) -> bool {
        self.reqs.remove(&request_id);
        self.sched.remove(request_id)
    }
}

// An engine may be built on one thread and run on another (on the CPU or a GPU): keep it `Send`.
const _: () = {
    const fn assert_send<T: Send>() {}
    assert_send::<Engine>();
};
