//! The step loop: [`Engine::step`] runs one scheduling decision and forward pass, samples a
//! token for every chunk that ends at its sequence's last token, and turns each into a
//! [`StepOutput`]; [`Engine::step_observed`] also reports each layer as its KV lands in the pool
//! (layer-wise KV streaming); [`Engine::generate`] steps until a set of requests finishes.
//!
//! A finished request's blocks are released in the step that finishes it, except a prefill-only
//! request's, which are held for the caller (see `disaggregated`).
//!
//! Text: generated token bytes are accumulated and released as valid UTF-8 only; with stop
//! strings, the last `longest_stop - 1` bytes are held back until they cannot start a stop string,
//! and the stop string itself is never returned.

use std::collections::HashMap;
use std::time::Instant;

use super::{ChunkView, Completion, Engine, FinishReason, LayerDone, Request, StepOutput, Usage};
use crate::backend::Device;
use crate::error::EngineError;
use crate::backend::{ForwardSeq, StepLogits};
use crate::sampler::TokenLogprob;
use tandem_kernels::sample::SampleSpec;

impl Engine {
    /// Runs one scheduling step and forward pass; returns a token for every request that
    /// produced one.
    pub fn step(&mut self) -> Result<Vec<StepOutput>, EngineError> {
        self.step_observed(&mut |_| {})
    }

    /// [`step`](Self::step), calling `on_layer` as each layer's KV of the step's chunks lands in
    /// the pool (layer-wise KV streaming).
    pub fn step_observed(&mut self, on_layer: &mut dyn FnMut(LayerDone<'_>)) -> Result<Vec<StepOutput>, EngineError> {
        let plan = self.sched.schedule(Instant::now());
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
        // When no row needs more than its pick, a GPU picks the tokens itself: the same tokens the
        // host's samplers would pick from the same rows, so this never changes a stream. (The CPU
        // forward returns rows in host memory anyway: nothing to pick there.)
        let picks: Option<Vec<SampleSpec>> = if self.model.device() == Device::Cpu {
            None
        } else {
            plan.chunks
                .iter()
                .filter(|c| c.want_logits)
                .map(|c| self.reqs.get(&c.seq_id).and_then(|st| st.sampler.device_spec()))
                .collect()
        };
        let logits = self.model.forward_staged(&fseqs, &mut self.pool, self.mirror.as_mut(), picks.as_deref(), &mut |layer| {
            on_layer(LayerDone { layer, num_layers, chunks: &views })
        })?;
        drop(views);
        drop(fseqs);
        self.stats.steps += 1;
        self.last_step.clear();
        self.last_step.extend(plan.chunks.iter().map(|c| (c.seq_id, c.len)));
        let mut row = 0;
        let mut sampled = Vec::with_capacity(plan.chunks.len());
        for c in &plan.chunks {
            sampled.push(if c.want_logits {
                let st = self.reqs.get_mut(&c.seq_id).expect("scheduled request has state");
                let sampled = match logits {
                    StepLogits::Rows(l) => st.sampler.sample(&l[row * vocab..(row + 1) * vocab]),
                    StepLogits::Picked(ids) => {
                        self.stats.tokens_picked_on_device += 1;
                        st.sampler.accept_device(ids[row])
                    }
                };
                row += 1;
                if let Some(e) = &sampled.grammar_error {
                    // The output ends at end-of-sequence: the only token the failed grammar left.
                    self.stats.grammar_failures += 1;
                    tracing::warn!(request_id = c.seq_id, error = %e, "structured output: the grammar failed; ending the output");
                }
                Some(sampled)
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
            self.sched.on_chunk_done(c, tok.as_ref().map(|t| t.token));
            if let Some(tok) = tok {
                self.stats.decode_tokens += 1;
                outputs.push(self.accept_token(c.seq_id, tok.token, tok.logprob));
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

    /// Records `tok` as request `id`'s next token: releases its text, checks EOS, stop strings
    /// and `max_new_tokens`, and builds its output (the caller ends a finished request).
    pub(super) fn accept_token(
        &mut self,
        id: u64,
        tok: u32,
        logprob: Option<TokenLogprob>,
    ) -> StepOutput {
        let cached_tokens = self.sched.cached_tokens(id);
        let st = self.reqs.get_mut(&id).expect("request state exists");
        st.generated.push(tok);
        let params = st.sampler.params();
        let is_eos = !params.ignore_eos && self.eos.contains(&tok);
        let mut finished = None;
        if !is_eos
            && let Some(t) = &self.tokenizer
        {
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
            logprob,
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
