//! Prefill/decode disaggregation: the calls a prefill node and a decode node make on top of the
//! plain request path ([`Engine::add_request`], [`Engine::step`]).
//!
//! - Prefill node: [`Engine::add_prefill_request`] stops a request after its first token; its
//!   blocks are not released but handed out in that token's [`StepOutput::held_blocks`], to be
//!   pushed to a decode node and then given back with [`Engine::release_held`].
//! - Decode node: [`Engine::reserve`] takes blocks for the KV a prefill node will push;
//!   [`Engine::add_prefilled`] adopts them and continues the request from the first token
//!   sampled there; [`Engine::release_reservation`] returns a reservation never adopted;
//!   [`Engine::add_local`] computes the prompt here instead (conditional disaggregation).
//!
//! # Invariants
//! - Held and reserved blocks belong to no sequence: they are the caller's until
//!   `release_held` / `release_reservation` returns them or `add_prefilled` hands them to a
//!   sequence. [`Engine::reserved_and_held_blocks`] lists them so block accounting
//!   ([`Scheduler::check_invariants_with`](crate::scheduler::Scheduler::check_invariants_with))
//!   can count them as holders.
//! - A staged engine ([`Engine::with_staged_pool`]) receives into its host mirror, and
//!   `add_prefilled` copies the prompt's blocks to the device before the sequence exists, so
//!   its first step reads the pushed KV.
//! - A prefilled request samples as one engine would have: its sampler skips the first token's
//!   draw, so seeded sampling continues exactly.

use std::time::Instant;

use super::{Engine, Request, StepOutput};
use crate::backend::Staging;
use crate::error::EngineError;
use crate::kv::BlockId;
use crate::sampler::TokenLogprob;

impl Engine {
    /// Queues a prefill-only request (a prefill node's work): it stops after its first token,
    /// and its blocks are not released but handed out in that token's
    /// [`StepOutput::held_blocks`], to be pushed to a decode node and then given back with
    /// [`release_held`](Self::release_held).
    pub fn add_prefill_request(&mut self, mut req: Request, now: Instant) -> Result<(), EngineError> {
        let constraint = self.validate(&req)?;
        // The first token is all this node samples; the prompt must still fit the decode side.
        self.sched.add(req.id, req.prompt.clone(), req.params.max_new_tokens, req.priority, now)?;
        req.params.max_new_tokens = 1;
        self.insert_state(req, true, constraint);
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
        self.kv_on_device.remove(&reservation_id);
        match self.reservations.remove(&reservation_id) {
            Some(blocks) => {
                self.sched.release_blocks(&blocks);
                true
            }
            None => false,
        }
    }

    /// Continues a request whose prompt KV arrived in reservation `reservation_id` and whose first
    /// token `first_token` (with its log probability, when the request asks for them) was
    /// sampled elsewhere (a decode node's `Decode`). Returns the output
    /// for the first token (its text; it may already finish the request: EOS, a stop string, or
    /// `max_new_tokens == 1`). The sampler skips the first token's draw, so seeded sampling
    /// continues exactly as one engine would have.
    /// Records that the KV of reservation `reservation_id` arrived in device memory (a CUDA IPC
    /// transfer wrote the engine's own device pool): [`add_prefilled`](Self::add_prefilled)
    /// then adopts it as it is, with no copy from the host mirror (whose bytes are stale).
    /// False when no such reservation is held (nothing recorded).
    pub fn kv_landed_on_device(&mut self, reservation_id: u64) -> bool {
        let held = self.reservations.contains_key(&reservation_id);
        if held {
            self.kv_on_device.insert(reservation_id);
        }
        held
    }

    pub fn add_prefilled(
        &mut self,
        req: Request,
        reservation_id: u64,
        first_token: u32,
        first_logprob: Option<TokenLogprob>,
        cached_prompt_tokens: usize,
        now: Instant,
    ) -> Result<StepOutput, EngineError> {
        let mut constraint = self.validate(&req)?;
        let vocab = self.model.config().vocab_size;
        if first_token as usize >= vocab {
            return Err(EngineError::InvalidRequest {
                field: "first_token_id",
                value: first_token.to_string(),
                reason: format!("outside the vocabulary of {vocab} tokens"),
            });
        }
        if let Some(c) = &mut constraint {
            c.commit(first_token).map_err(|e| EngineError::InvalidRequest {
                field: "first_token_id",
                value: first_token.to_string(),
                reason: format!("does not follow response_format: {e}"),
            })?;
        }
        let blocks = self.take_reservation(reservation_id, &req)?;
        let on_device = self.kv_on_device.remove(&reservation_id);
        if on_device {
            self.stats.kv_adopted_on_device += 1;
        } else if let Some(m) = self.mirror.as_mut().filter(|m| m.staging() == Staging::Receive) {
            // The pushed KV is in the mirror's blocks; the device reads its own.
            let prompt_blocks = req.prompt.len().div_ceil(self.pool.layout().block_size_tokens);
            if let Err(e) = self.model.stage_in(&mut self.pool, m, &blocks[..prompt_blocks]) {
                self.reservations.insert(reservation_id, blocks);
                return Err(e);
            }
        }
        let (id, prompt_len, priority) = (req.id, req.prompt.len(), req.priority);
        let mut tokens = req.prompt.clone();
        tokens.push(first_token);
        self.sched.add_prefilled(id, tokens, prompt_len, blocks, priority, now)?;
        self.insert_state(req, false, constraint);
        let st = self.reqs.get_mut(&id).expect("just inserted");
        st.sampler.skip(first_token);
        st.cached_prompt_tokens = cached_prompt_tokens;
        let first_logprob = first_logprob.filter(|_| st.sampler.params().logprobs);
        let out = self.accept_token(id, first_token, first_logprob);
        if out.finished.is_some() {
            self.reqs.remove(&id);
            self.sched.remove(id);
        }
        Ok(out)
    }

    /// Runs a request whose blocks were reserved for pushed KV on this engine instead, prompt
    /// and all (conditional disaggregation: a decode node prefilling a short prompt itself).
    /// The reservation's blocks go back to the pool and the request is queued as
    /// [`add_request`](Self::add_request) queues one, so this engine's prefix cache serves what
    /// it holds; the reservation only vouched that the blocks exist. Nothing changes on error,
    /// except that an unknown or too small reservation stays as it was.
    pub fn add_local(&mut self, req: Request, reservation_id: u64, now: Instant) -> Result<(), EngineError> {
        let constraint = self.validate(&req)?;
        let blocks = self.take_reservation(reservation_id, &req)?;
        self.sched.release_blocks(&blocks);
        if let Err(e) = self.sched.add(req.id, req.prompt.clone(), req.params.max_new_tokens, req.priority, now) {
            // Put the reservation back as it was: the blocks were free a moment ago.
            let again = self.sched.reserve_blocks(blocks.len() * self.pool.layout().block_size_tokens);
            if let Some(b) = again {
                self.reservations.insert(reservation_id, b);
            }
            return Err(e);
        }
        self.insert_state(req, false, constraint);
        Ok(())
    }

    /// Takes reservation `reservation_id`'s blocks for `req`; nothing changes when the
    /// reservation is unknown or holds fewer blocks than the prompt and output need.
    fn take_reservation(&mut self, reservation_id: u64, req: &Request) -> Result<Vec<BlockId>, EngineError> {
        let blocks = self.reservations.get(&reservation_id).ok_or(EngineError::UnknownReservation(reservation_id))?;
        let need = (req.prompt.len() + req.params.max_new_tokens).div_ceil(self.pool.layout().block_size_tokens);
        if blocks.len() < need {
            return Err(EngineError::InvalidRequest {
                field: "reservation_id",
                value: reservation_id.to_string(),
                reason: format!("holds {} blocks, the request needs {need}", blocks.len()),
            });
        }
        Ok(self.reservations.remove(&reservation_id).expect("checked above"))
    }

    /// Live reservations' blocks (tests: block accounting).
    pub fn reserved_and_held_blocks(&self) -> Vec<BlockId> {
        self.reservations.values().chain(self.held.values()).flatten().copied().collect()
    }
}
