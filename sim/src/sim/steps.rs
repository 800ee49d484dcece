//! Steps: starting an instance's next forward pass, and what its end does (first tokens,
//! the KV transfer, completions). Times come from the roofline or a measured profile.

use super::*;

/// Where step times come from.
#[derive(Clone)]
pub(super) enum Steps {
    Roofline(Roofline),
    Measured(std::sync::Arc<MeasuredSteps>),
}

impl Steps {
    /// A step computing `new` tokens (`decode` of them single decode tokens) attending to
    /// `attended` positions in all and reading `ctx` tokens of KV.
    pub(super) fn step_s(&self, new: f64, decode: f64, attended: f64, ctx: f64) -> f64 {
        match self {
            Steps::Roofline(r) => r.step_s(new, attended, ctx),
            Steps::Measured(m) => {
                let prefill = new - decode;
                let d = if decode > 0.0 { m.decode_s(decode) } else { 0.0 };
                d + if prefill > 0.0 { m.prefill_s(prefill) } else { 0.0 }
            }
        }
    }

    pub(super) fn transfer_s(&self, tokens: f64, layers: f64) -> f64 {
        match self {
            Steps::Roofline(r) => r.transfer_s(tokens) / layers,
            Steps::Measured(m) => m.transfer_s,
        }
    }
}

impl Sim {
    // --- steps --------------------------------------------------------------------------------

    /// Starts a step on an idle instance that has work.
    pub(super) fn kick(&mut self, i: usize) {
        if self.insts[i].busy || self.insts[i].life == Life::Gone {
            return;
        }
        let roof = self.steps.clone();
        let max_batch = self.cfg.max_batch;
        let budget = self.cfg.max_tokens_per_step;
        let now = self.base + std::time::Duration::from_secs_f64(self.now);
        let step_s = match &mut self.insts[i].kind {
            Kind::Prefill { sched, step } => {
                let out = sched.schedule(now);
                *step = out.chunks;
                if step.is_empty() {
                    return;
                }
                let (mut new, mut attended, mut ctx) = (0.0, 0.0, 0.0);
                for c in step.iter() {
                    let (s, l) = (c.first_pos as f64, c.len as f64);
                    new += l;
                    attended += l * s + l * (l + 1.0) / 2.0;
                    ctx += s + l;
                }
                roof.step_s(new, 0.0, attended, ctx)
            }
            Kind::Decode(b) => {
                admit(b, max_batch, &self.reqs);
                if b.running == 0 {
                    return;
                }
                let n = b.running as f64;
                roof.step_s(n, n, b.context, b.context)
            }
            Kind::Colocated { batch, prompts, step } => {
                admit(batch, max_batch, &self.reqs);
                step.clear();
                let mut left = budget.saturating_sub(batch.running);
                let (mut new, mut attended, mut ctx) =
                    (batch.running as f64, batch.context, batch.context);
                for &(id, done) in prompts.queue.iter() {
                    if left == 0 {
                        break;
                    }
                    let rest = self.reqs[id as usize].prompt - done;
                    let n = rest.min(left);
                    let (s, l) = (done as f64, n as f64);
                    new += l;
                    attended += l * s + l * (l + 1.0) / 2.0;
                    ctx += s + l;
                    step.push((id, done, n));
                    left -= n;
                }
                if new == 0.0 {
                    return;
                }
                roof.step_s(new, batch.running as f64, attended, ctx)
            }
        };
        self.insts[i].busy = true;
        self.at(self.now + step_s, Event::Step(i as u32));
        if let Kind::Decode(b) | Kind::Colocated { batch: b, .. } = &self.insts[i].kind {
            self.itl.add(step_s, b.running as u64);
        }
    }

    pub(super) fn on_step_done(&mut self, i: u32) {
        let i = i as usize;
        self.insts[i].busy = false;
        let now = self.now;
        let layers = self.cfg.roofline.model.layers as f64;
        let steps = self.steps.clone();
        let mut first_tokens = Vec::new();
        let mut finished = Vec::new();
        let mut computed = 0u64;
        match &mut self.insts[i].kind {
            Kind::Prefill { sched, step } => {
                for c in step.drain(..) {
                    sched.on_chunk_done(&c, c.want_logits.then_some(0));
                    computed += c.len as u64;
                    if c.want_logits {
                        let blocks = sched.detach(c.seq_id).unwrap_or_default();
                        sched.release_blocks(&blocks);
                        first_tokens.push(c.seq_id as u32);
                    }
                }
            }
            Kind::Decode(b) => {
                computed += b.running as u64;
                step_batch(b, &self.reqs, &mut finished);
            }
            Kind::Colocated { batch, prompts, step } => {
                computed += batch.running as u64;
                step_batch(batch, &self.reqs, &mut finished);
                for (id, done, n) in step.drain(..) {
                    computed += n as u64;
                    let e = prompts.queue.iter_mut().find(|e| e.0 == id).expect("queued");
                    debug_assert_eq!(e.1, done);
                    e.1 = done + n;
                    if e.1 == self.reqs[id as usize].prompt {
                        prompts.queue.retain(|e| e.0 != id);
                        first_tokens.push(id);
                        batch.waiting.push_back(id);
                    }
                }
            }
        }
        self.insts[i].computed_tokens += computed;
        for id in first_tokens {
            let r = &mut self.reqs[id as usize];
            r.first_token = now;
            let ttft = (now - r.arrived) as f32;
            self.ttft.push(ttft);
            self.window_ttft.push(ttft);
            self.input_tokens += r.prompt as u64;
            if self.cfg.mode != Mode::Colocated {
                let tail = steps.transfer_s(r.prompt as f64, layers);
                self.at(now + tail, Event::Transferred(id));
            }
        }
        let freed = !finished.is_empty();
        for id in finished {
            self.finish(id);
        }
        self.kick(i);
        self.retire_if_drained(i);
        if freed {
            self.dispatch_router_queue();
        }
    }

    pub(super) fn on_transferred(&mut self, id: u32) {
        let d = self.reqs[id as usize].decode as usize;
        if let Kind::Decode(b) = &mut self.insts[d].kind {
            b.waiting.push_back(id);
        }
        self.kick(d);
    }

    pub(super) fn finish(&mut self, id: u32) {
        let r = self.reqs[id as usize];
        let d = r.decode as usize;
        if let Kind::Decode(b) | Kind::Colocated { batch: b, .. } = &mut self.insts[d].kind {
            b.reserved_tokens -= (r.prompt + r.output) as u64;
        }
        let tpot = if r.output > 1 { (self.now - r.first_token) / (r.output - 1) as f64 } else { 0.0 };
        self.tpot.push(tpot as f32);
        self.completed += 1;
        self.output_tokens += r.output as u64;
        if let crate::workload::Arrivals::Closed { .. } = self.cfg.arrivals {
            // The client that waited for this one sends its next request now.
            self.at(self.now, Event::Arrival);
        }
        if r.first_token - r.arrived <= self.cfg.ttft_slo_s && tpot <= self.cfg.tpot_slo_s {
            self.good += 1;
        }
    }
}

/// Moves waiting requests into the batch while there is room.
pub(super) fn admit(b: &mut Batch, max_batch: u32, reqs: &[Request]) {
    while b.running < max_batch {
        let Some(id) = b.waiting.pop_front() else { break };
        let r = reqs[id as usize];
        b.running += 1;
        b.context += r.prompt as f64 + 1.0;
        // The first token came from the prefill; each step adds one more.
        b.done_at.push(Reverse((b.step_no + (r.output.max(1) - 1) as u64, id)));
    }
}

/// One decode step done: every running sequence has one more token; some finish.
pub(super) fn step_batch(b: &mut Batch, reqs: &[Request], finished: &mut Vec<u32>) {
    b.step_no += 1;
    b.context += b.running as f64;
    while let Some(&Reverse((at, id))) = b.done_at.peek() {
        if at > b.step_no {
            break;
        }
        b.done_at.pop();
        let r = reqs[id as usize];
        b.running -= 1;
        b.context -= (r.prompt + r.output) as f64;
        finished.push(id);
    }
    if b.running == 0 {
        b.context = 0.0;
    }
}
