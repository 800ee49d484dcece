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
//! Text: generated token bytes are accumulated and released as valid UTF-8 only; with stop
//! strings, the last `longest_stop - 1` bytes are held back until they cannot start a stop string,
//! and the stop string itself is never returned.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tandem_kv_layout::{KvDtype, KvLayout};

use crate::error::EngineError;
use crate::kv::{BlockId, KvPool};
use crate::model::{ForwardSeq, Model};
use crate::sampler::{Sampler, SamplingParams};
use crate::scheduler::{Priority, Scheduler, SchedulerConfig};
use crate::tokenizer::Tokenizer;

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
    /// Newly released text (may be empty while a character or a possible stop string is pending).
    pub text: String,
    /// Set when this was the request's last output.
    pub finished: Option<FinishReason>,
    /// Token accounting so far.
    pub usage: Usage,
    /// For requests added with [`Engine::add_prefill_request`], on their (only) output: the
    /// blocks holding the prompt's KV, kept until [`Engine::release_held`].
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

/// A finished request's whole output (see [`Engine::generate`]).
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
    pool: KvPool,
    sched: Scheduler,
    tokenizer: Option<Arc<Tokenizer>>,
    reqs: HashMap<u64, ReqState>,
    eos: Vec<u32>,
    stats: EngineStats,
    /// Finished prefill-only requests' blocks, until released.
    held: HashMap<u64, Vec<BlockId>>,
    /// Blocks reserved for KV arriving from elsewhere, by reservation id.
    reservations: HashMap<u64, Vec<BlockId>>,
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
}

impl Engine {
    /// Builds an engine around `model`; the KV pool is allocated here, once.
    pub fn new(model: Model, tokenizer: Option<Tokenizer>, cfg: EngineConfig) -> Result<Self, EngineError> {
        let (layout, num_blocks) = Self::pool_shape(&model, &cfg)?;
        let pool = KvPool::new(layout, num_blocks)?;
        Self::with_pool(model, tokenizer, cfg, pool)
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
    /// transport allocated); the pool's layout must be the model's.
    pub fn with_pool(model: Model, tokenizer: Option<Tokenizer>, cfg: EngineConfig, pool: KvPool) -> Result<Self, EngineError> {
        model.kv_layout(cfg.block_size_tokens, cfg.kv_dtype)?.check_compatible(pool.layout())?;
        let num_blocks = pool.num_blocks();
        let mut sched_cfg = cfg.scheduler.clone();
        sched_cfg.max_model_len = sched_cfg.max_model_len.min(model.config().max_position_embeddings);
        let sched = Scheduler::new(sched_cfg, num_blocks, cfg.block_size_tokens)?;
        let mut eos = model.config().eos_token_id.clone();
        if let Some(t) = &tokenizer {
            if !eos.contains(&t.eos_token_id()) {
                eos.push(t.eos_token_id());
            }
        }
        Ok(Engine { model, pool, sched, tokenizer: tokenizer.map(Arc::new), reqs: HashMap::new(), eos, stats: EngineStats::default(), held: HashMap::new(), reservations: HashMap::new() })
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

    /// The KV pool (kv-transfer reads and writes its bytes).
    pub fn kv_pool(&self) -> &KvPool {
        &self.pool
    }

    /// The KV pool, mutable: for copying received KV into reserved blocks in-process (colocated
    /// transfers, tests). Writing blocks a sequence owns corrupts its output.
    pub fn kv_pool_mut(&mut self) -> &mut KvPool {
        &mut self.pool
    }

    /// The scheduler (queue lengths, block counts).
    pub fn scheduler(&self) -> &Scheduler {
        &self.sched
    }

    /// Counters since start.
    pub fn stats(&self) -> EngineStats {
        self.stats
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
        self.validate(&req)?;
        self.sched.add(req.id, req.prompt.clone(), req.params.max_new_tokens, req.priority, now)?;
        self.insert_state(req, false);
        Ok(())
    }

    /// Queues a prefill-only request (a prefill node's work): it stops after its first token,
    /// and its blocks are not released but handed out in that token's
    /// [`StepOutput::held_blocks`], to be pushed to a decode node and then given back with
    /// [`release_held`](Self::release_held).
    pub fn add_prefill_request(&mut self, mut req: Request, now: Instant) -> Result<(), EngineError> {
        self.validate(&req)?;
        // The first token is all this node samples; the prompt must still fit the decode side.
        self.sched.add(req.id, req.prompt.clone(), req.params.max_new_tokens, req.priority, now)?;
        req.params.max_new_tokens = 1;
        self.insert_state(req, true);
        Ok(())
    }

    /// Gives back the blocks of a finished prefill-only request; false if none are held.
    pub fn release_held(&mut self, request_id: u64) -> bool {
        match self.held.remove(&request_id) {
            Some(blocks) => {
                self.sched.release_blocks(&blocks);
                true
            }
            None => false,
        }
    }

    /// Reserves blocks for `tokens` tokens of KV that a prefill node will push (a decode node's
    /// `Reserve`). The blocks are the caller's until [`add_prefilled`](Self::add_prefilled)
    /// adopts them or [`release_reservation`](Self::release_reservation) returns them.
    pub fn reserve(&mut self, reservation_id: u64, tokens: usize) -> Result<Vec<BlockId>, EngineError> {
        if self.reservations.contains_key(&reservation_id) {
            return Err(EngineError::DuplicateRequest(reservation_id));
        }
        let max = self.sched.config().max_model_len;
        if tokens == 0 || tokens > max {
            return Err(EngineError::ContextOverflow { prompt_tokens: tokens, max_new_tokens: 0, max_context_tokens: max });
        }
        let blocks = self.sched.reserve_blocks(tokens).ok_or(EngineError::OutOfBlocks {
            requested_blocks: tokens.div_ceil(self.pool.layout().block_size_tokens),
            free_blocks: self.sched.blocks().num_free(),
        })?;
        self.reservations.insert(reservation_id, blocks.clone());
        Ok(blocks)
    }

    /// Returns an unadopted reservation's blocks; false if it is not held.
    pub fn release_reservation(&mut self, reservation_id: u64) -> bool {
        match self.reservations.remove(&reservation_id) {
            Some(blocks) => {
                self.sched.release_blocks(&blocks);
                true
            }
            None => false,
        }
    }

    /// Continues a request whose prompt KV arrived in reservation `reservation_id` and whose first
    /// token `first_token` was sampled elsewhere (a decode node's `Decode`). Returns the output
    /// for the first token (its text; it may already finish the request: EOS, a stop string, or
    /// `max_new_tokens == 1`). The sampler skips the first token's draw, so seeded sampling
    /// continues exactly as one engine would have.
    pub fn add_prefilled(
        &mut self,
        req: Request,
        reservation_id: u64,
        first_token: u32,
        cached_prompt_tokens: usize,
        now: Instant,
    ) -> Result<StepOutput, EngineError> {
        self.validate(&req)?;
        let vocab = self.model.config().vocab_size;
        if first_token as usize >= vocab {
            return Err(EngineError::InvalidRequest {
                field: "first_token_id",
                value: first_token.to_string(),
                reason: format!("outside the vocabulary of {vocab} tokens"),
            });
        }
        let blocks = self.reservations.get(&reservation_id).ok_or(EngineError::UnknownReservation(reservation_id))?;
        let need = (req.prompt.len() + req.params.max_new_tokens).div_ceil(self.pool.layout().block_size_tokens);
        if blocks.len() < need {
            return Err(EngineError::InvalidRequest {
                field: "reservation_id",
                value: reservation_id.to_string(),
                reason: format!("holds {} blocks, the request needs {need}", blocks.len()),
            });
        }
        let blocks = self.reservations.remove(&reservation_id).expect("checked above");
        let (id, prompt_len, priority) = (req.id, req.prompt.len(), req.priority);
        let mut tokens = req.prompt.clone();
        tokens.push(first_token);
        self.sched.add_prefilled(id, tokens, prompt_len, blocks, priority, now)?;
        self.insert_state(req, false);
        let st = self.reqs.get_mut(&id).expect("just inserted");
        st.sampler.advance(1);
        st.cached_prompt_tokens = cached_prompt_tokens;
        let out = self.accept_token(id, first_token);
        if out.finished.is_some() {
            self.reqs.remove(&id);
            self.sched.remove(id);
        }
        Ok(out)
    }

    /// Live reservations' blocks (tests: block accounting).
    pub fn reserved_and_held_blocks(&self) -> Vec<BlockId> {
        self.reservations.values().chain(self.held.values()).flatten().copied().collect()
    }

    fn validate(&self, req: &Request) -> Result<(), EngineError> {
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
        Ok(())
    }

    fn insert_state(&mut self, req: Request, hold_kv: bool) {
        let max_stop_len = req.params.stop.iter().map(|s| s.len()).max().unwrap_or(0);
        self.reqs.insert(
            req.id,
            ReqState {
                sampler: Sampler::new(req.params, req.id),
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

    /// Runs one scheduling step and forward pass; returns a token for every request that
    /// produced one.
    pub fn step(&mut self) -> Result<Vec<StepOutput>, EngineError> {
        self.step_observed(&mut |_| {})
    }

    /// [`step`](Self::step), calling `on_layer` as each layer's KV of the step's chunks lands in
    /// the pool (layer-wise KV streaming).
    pub fn step_observed(&mut self, on_layer: &mut dyn FnMut(LayerDone<'_>)) -> Result<Vec<StepOutput>, EngineError> {
        let plan = self.sched.schedule();
        self.stats.preemptions += plan.preempted.len() as u64;
        if plan.chunks.is_empty() {
            return Ok(Vec::new());
        }
        let mut fseqs = Vec::with_capacity(plan.chunks.len());
        for c in &plan.chunks {
            let tokens = self.sched.tokens(c.seq_id).expect("scheduled sequence exists");
            fseqs.push(ForwardSeq {
                tokens: &tokens[c.first_pos..c.first_pos + c.len],
                first_pos: c.first_pos,
                block_table: self.sched.block_table(c.seq_id).expect("scheduled sequence exists"),
                want_logits: c.want_logits,
            });
        }
        let views: Vec<ChunkView<'_>> = plan
            .chunks
            .iter()
            .zip(&fseqs)
            .map(|(c, f)| ChunkView {
                request_id: c.seq_id,
                first_pos: c.first_pos,
                len: c.len,
                block_table: f.block_table,
                last_chunk: c.want_logits,
            })
            .collect();
        let vocab = self.model.config().vocab_size;
        let num_layers = self.model.config().num_hidden_layers;
        let logits = self.model.forward_observed(&fseqs, &mut self.pool, &mut |layer| {
            on_layer(LayerDone { layer, num_layers, chunks: &views })
        })?;
        drop(views);
        drop(fseqs);
        self.stats.steps += 1;
        let mut row = 0;
        let mut sampled = Vec::with_capacity(plan.chunks.len());
        for c in &plan.chunks {
            sampled.push(if c.want_logits {
                let st = self.reqs.get_mut(&c.seq_id).expect("scheduled request has state");
                let tok = st.sampler.sample(&logits[row * vocab..(row + 1) * vocab]);
                row += 1;
                Some(tok)
            } else {
                None
            });
        }
        let mut outputs = Vec::new();
        for (c, tok) in plan.chunks.iter().zip(sampled) {
            let prompt_len = self.reqs.get(&c.seq_id).map_or(0, |r| r.prompt_len);
            if c.len > 1 || c.first_pos < prompt_len {
                self.stats.prefill_tokens += c.len as u64;
            }
            self.sched.on_chunk_done(c, tok);
            if let Some(tok) = tok {
                self.stats.decode_tokens += 1;
                outputs.push(self.accept_token(c.seq_id, tok));
            }
        }
        for o in &mut outputs {
            if o.finished.is_some() {
                let hold = self.reqs.remove(&o.request_id).is_some_and(|st| st.hold_kv);
                if hold {
                    let blocks = self.sched.detach(o.request_id).unwrap_or_default();
                    self.held.insert(o.request_id, blocks.clone());
                    o.held_blocks = Some(blocks);
                } else {
                    self.sched.remove(o.request_id);
                }
            }
        }
        Ok(outputs)
    }

    fn accept_token(&mut self, id: u64, tok: u32) -> StepOutput {
        let cached_tokens = self.sched.cached_tokens(id);
        let st = self.reqs.get_mut(&id).expect("request state exists");
        st.generated.push(tok);
        let params = st.sampler.params();
        let is_eos = !params.ignore_eos && self.eos.contains(&tok);
        let mut finished = None;
        if !is_eos {
            if let Some(t) = &self.tokenizer {
                st.pending.extend_from_slice(t.token_bytes(tok).unwrap_or(&[]));
                let valid = match std::str::from_utf8(&st.pending) {
                    Ok(s) => s.len(),
                    Err(e) if e.error_len().is_some() => st.pending.len(), // invalid, not partial
                    Err(e) => e.valid_up_to(),
                };
                let piece: Vec<u8> = st.pending.drain(..valid).collect();
                st.text.push_str(&String::from_utf8_lossy(&piece));
                if let Some(cut) = params.stop.iter().filter_map(|s| st.text.find(s.as_str())).min() {
                    st.text.truncate(cut);
                    finished = Some(FinishReason::StopString);
                }
            }
        }
        if finished.is_none() {
            if is_eos {
                finished = Some(FinishReason::Eos);
            } else if st.generated.len() >= params.max_new_tokens {
                finished = Some(FinishReason::Length);
            }
        }
        let mut release = st.text.len();
        if finished.is_none() && st.max_stop_len > 1 {
            release = release.saturating_sub(st.max_stop_len - 1).max(st.emitted);
            while !st.text.is_char_boundary(release) {
                release -= 1;
            }
        }
        if finished.is_some() && !st.pending.is_empty() {
            st.text.push_str(&String::from_utf8_lossy(&std::mem::take(&mut st.pending)));
            release = st.text.len();
        }
        let text = st.text[st.emitted..release].to_string();
        st.emitted = release;
        StepOutput {
            request_id: id,
            token: tok,
            text,
            finished,
            usage: Usage {
                prompt_tokens: st.prompt_len,
                cached_tokens: cached_tokens.max(st.cached_prompt_tokens),
                completion_tokens: st.generated.len(),
            },
            held_blocks: None,
        }
    }

    /// Runs `requests` to completion (convenience for the CLI, tests and benchmarks); outputs in
    /// request order. `on_output` sees every step output as it happens (streaming).
    pub fn generate(
        &mut self,
        requests: Vec<Request>,
        mut on_output: impl FnMut(&StepOutput),
    ) -> Result<Vec<Completion>, EngineError> {
        let order: Vec<u64> = requests.iter().map(|r| r.id).collect();
        let now = Instant::now();
        for r in requests {
            self.add_request(r, now)?;
        }
        let mut done: HashMap<u64, Completion> = HashMap::new();
        let mut partial: HashMap<u64, (Vec<u32>, String)> = HashMap::new();
        while done.len() < order.len() {
            let outputs = self.step()?;
            assert!(!outputs.is_empty() || !self.is_idle(), "engine idle with unfinished requests. This is a bug.");
            for o in outputs {
                on_output(&o);
                let e = partial.entry(o.request_id).or_default();
                e.0.push(o.token);
                e.1.push_str(&o.text);
                if let Some(reason) = o.finished {
                    let (tokens, text) = partial.remove(&o.request_id).unwrap_or_default();
                    done.insert(o.request_id, Completion { request_id: o.request_id, tokens, text, finish_reason: reason, usage: o.usage });
                }
            }
        }
        Ok(order.into_iter().map(|id| done.remove(&id).expect("every request finished")).collect())
    }
}
