//! The decode node's engine driver: reservations (blocks set aside for KV a prefill node
//! pushes), adopting verified KV with the first token, continuous batching, and one token
//! stream per request.
//!
//! ```text
//!  Reserve ─▶ engine.reserve(id, prompt + max_new tokens) ─▶ blocks (the service expects the
//!             prompt's blocks in the InboundRegistry)
//!  Start   ─▶ engine.add_prefilled(req, id, first token) ─▶ stream: first token's text
//!            (prefill_here: engine.add_local(req, id) ─▶ the prompt runs in the batch here)
//!  step    ─▶ one TokenBatch per request per step ─▶ … ─▶ DecodeFinal (finish reason, usage)
//! ```
//!
//! Streams are bounded. Output that does not fit (a slow client) is coalesced into the
//! request's pending batch and sent when there is room, so the engine never blocks on a
//! client and no token is lost. A closed stream (client cancelled or disconnected) aborts the
//! request at the next loop iteration and frees its blocks.
//!
//! A request whose prompt is computed here sends a `DecodeProgress` every
//! [`PROGRESS_INTERVAL`] until its first token (checked each loop iteration, so at worst one
//! step late): queueing behind other prompts is not taken for a hang by the router.

use std::collections::HashMap;
use std::time::Instant;

use tandem_engine::{Engine, EngineError, Request, StepOutput};

use crate::step_budget::StepBudget;
use tandem_node::engine_thread::{Driver, share_step_time};
use tandem_node::metrics::Outcome;
use tandem_node::{InFlightGuard, NodeMetrics, convert, status};
use tandem_proto::v1::decode_response::Event;
use tandem_proto::v1::{DecodeFinal, DecodeProgress, DecodeResponse, TokenBatch};
use tandem_telemetry::trace::propagation;
use tokio::sync::mpsc::{self, error::TrySendError};
use tokio::sync::oneshot;
use tonic::Status;

/// The events of one Decode stream.
pub type Events = mpsc::Sender<Result<DecodeResponse, Status>>;

/// A request whose KV arrived and verified, ready to join the batch.
pub struct Start {
    /// The engine request (its id is the reservation id).
    pub request: Request,
    /// The reservation holding its KV.
    pub reservation_id: u64,
    /// The first token, sampled by the prefill node.
    pub first_token: u32,
    /// Its log probability (requests asking for logprobs).
    pub first_logprob: Option<tandem_engine::TokenLogprob>,
    /// Prompt tokens the prefill node served from its prefix cache.
    pub cached_prompt_tokens: usize,
    /// The KV arrived in the engine's device memory (CUDA IPC): nothing to copy up from the
    /// host mirror.
    pub kv_on_device: bool,
    /// No prefill node took part: this engine computes the prompt and samples the first token
    /// (`first_token`, `first_logprob` and `cached_prompt_tokens` are unused).
    pub prefill_here: bool,
    /// The caller's request id (logs).
    pub label: String,
    /// The client's stream.
    pub events: Events,
    /// Held until the stream's last message.
    pub in_flight: InFlightGuard,
    /// `decode.request` (the call's server span).
    pub span: tracing::Span,
    /// When the Decode call arrived (TTFT).
    pub received_at: Instant,
}

/// Commands of the decode engine thread.
pub enum Command {
    /// Reserve blocks for `tokens` tokens; replies with the block ids.
    Reserve {
        /// The reservation's id.
        reservation_id: u64,
        /// Prompt + output tokens.
        tokens: usize,
        /// The blocks, or why not (OutOfBlocks: RESOURCE_EXHAUSTED).
        reply: oneshot::Sender<Result<Vec<u32>, EngineError>>,
    },
    /// Return an unadopted reservation's blocks (released, expired, failed transfer).
    ReleaseReservation {
        /// The reservation.
        reservation_id: u64,
    },
    /// Adopt a reservation's KV and start decoding.
    Start(Box<Start>),
}

struct Stream {
    label: String,
    events: Events,
    pending: Option<TokenBatch>,
    finish: Option<DecodeFinal>,
    finished_in_engine: bool,
    _in_flight: InFlightGuard,
    /// `decode.stream`: from adoption to the final message.
    span: tracing::Span,
    /// Tokens generated here (the first token included).
    tokens: u32,
    /// This node's engine time spent on the request.
    node_seconds: f64,
    /// A request prefilled here, before its first token: when its Decode call arrived (TTFT
    /// and prompt metrics are recorded at the first output).
    awaiting_first: Option<Instant>,
    /// When the last message (or the adoption) went to the client: before the first token of a
    /// prompt computed here, a `DecodeProgress` follows every [`PROGRESS_INTERVAL`].
    last_sent: Instant,
}

/// How often a request whose prompt is computed here reports liveness before its first token
/// (the router's stall clock is 10 s by default).
pub const PROGRESS_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);

enum Flush {
    /// Everything produced so far was handed over.
    Delivered,
    /// The stream is full; try again later.
    Blocked,
    /// The client is gone.
    Gone,
}

impl Stream {
    fn push(&mut self, o: &StepOutput) {
        self.tokens += 1;
        let b = self.pending.get_or_insert_with(TokenBatch::default);
        b.token_ids.push(o.token);
        if let Some(l) = &o.logprob {
            b.logprobs.push(convert::logprob(l));
        }
        b.text.push_str(&o.text);
        if let Some(reason) = o.finished {
            self.finished_in_engine = true;
            self.span.record("gen_ai.usage.output_tokens", self.tokens);
            propagation::set_strings(
                &self.span,
                "gen_ai.response.finish_reasons",
                &[match convert::finish_reason(reason) {
                    tandem_proto::v1::FinishReason::Length => "length",
                    tandem_proto::v1::FinishReason::Cancelled => "cancelled",
                    _ => "stop",
                }],
            );
            self.finish = Some(DecodeFinal {
                finish_reason: convert::finish_reason(reason) as i32,
                usage: Some(convert::usage(o.usage)),
                node_seconds: self.node_seconds,
            });
        }
    }

    fn flush(&mut self) -> Flush {
        if self.events.is_closed() {
            return Flush::Gone;
        }
        if let Some(b) = &self.pending {
            match self.events.try_send(Ok(DecodeResponse {
                event: Some(Event::Tokens(b.clone())),
            })) {
                Ok(()) => {
                    self.pending = None;
                    self.last_sent = Instant::now();
                }
                Err(TrySendError::Full(_)) => return Flush::Blocked,
                Err(TrySendError::Closed(_)) => return Flush::Gone,
            }
        }
        if let Some(f) = &self.finish {
            match self.events.try_send(Ok(DecodeResponse {
                event: Some(Event::Final(*f)),
            })) {
                Ok(()) => self.finish = None,
                Err(TrySendError::Full(_)) => return Flush::Blocked,
                Err(TrySendError::Closed(_)) => return Flush::Gone,
            }
        }
        Flush::Delivered
    }

    fn undelivered(&self) -> bool {
        self.pending.is_some() || self.finish.is_some()
    }

    /// Still waiting for its first token here, and silent for [`PROGRESS_INTERVAL`].
    fn progress_due(&self, now: Instant) -> bool {
        self.awaiting_first.is_some() && now.duration_since(self.last_sent) >= PROGRESS_INTERVAL
    }

    /// Tells the client the request is alive (a full stream already proves it; a closed one is
    /// noticed by the next flush).
    fn send_progress(&mut self, prompt_tokens_computed: usize, now: Instant) {
        let progress = DecodeProgress {
            prompt_tokens_computed: prompt_tokens_computed as u32,
        };
        if self
            .events
            .try_send(Ok(DecodeResponse {
                event: Some(Event::Progress(progress)),
            }))
            .is_ok()
        {
            self.last_sent = now;
        }
    }
}

/// The decode role's [`Driver`].
pub struct DecodeDriver {
    streams: HashMap<u64, Stream>,
    metrics: NodeMetrics,
    /// Sizes the engine's prompt tokens per step from measured steps (`None`: uncapped).
    budget: Option<StepBudget>,
    /// The cap last given to the engine.
    cap: Option<usize>,
}

impl DecodeDriver {
    /// A driver with no streams, counting into `metrics`; with `budget`, the prompts this node
    /// computes itself are chunked to fit its step-time target.
    pub fn new(metrics: NodeMetrics, budget: Option<StepBudget>) -> Self {
        DecodeDriver {
            streams: HashMap::new(),
            metrics,
            budget,
            cap: None,
        }
    }

    /// Feeds the last step to the budget and hands the engine the cap it gives now.
    fn resize_budget(&mut self, engine: &mut Engine, elapsed: std::time::Duration) {
        let Some(budget) = self.budget.as_mut() else {
            return;
        };
        let (mut prompt, mut decode) = (0, 0);
        for &(_, n) in engine.last_step_tokens() {
            if n > 1 { prompt += n } else { decode += n }
        }
        budget.observe(elapsed, prompt, decode);
        let cap = Some(budget.cap());
        if cap != self.cap {
            tracing::debug!(prompt_tokens_per_step = cap, "step budget resized");
            engine.set_prefill_token_cap(cap);
            self.cap = cap;
        }
    }

    /// Delivers what `id` has; ends it when finished and delivered, aborts it if the client left.
    fn flush(&mut self, engine: &mut Engine, id: u64) {
        let Some(s) = self.streams.get_mut(&id) else {
            return;
        };
        match s.flush() {
            Flush::Blocked => {}
            Flush::Delivered if s.finished_in_engine => {
                self.metrics.request(Outcome::Ok);
                self.streams.remove(&id);
            }
            Flush::Delivered => {}
            Flush::Gone => {
                if !s.finished_in_engine {
                    engine.abort(id);
                }
                tracing::debug!(request = %s.label, "client went away; request aborted, blocks freed");
                self.metrics.request(Outcome::Cancelled);
                s.span.record("error.type", "cancelled");
                self.streams.remove(&id);
            }
        }
    }

    fn fail_all(&mut self, engine: &mut Engine, status: impl Fn() -> Status) {
        for (id, s) in self.streams.drain() {
            if !s.finished_in_engine {
                engine.abort(id);
            }
            let st = status();
            self.metrics.request(Outcome::Failed);
            propagation::mark_error(&s.span, "node_failed", st.message());
            let _ = s.events.try_send(Err(st));
        }
    }
}

impl DecodeDriver {
    /// Adopts a verified reservation with its first token, or (`prefill_here`) queues the
    /// whole request on this engine; either way the request's stream joins the batch.
    fn start(&mut self, engine: &mut Engine, start: Start) {
        let Start {
            request,
            reservation_id,
            first_token,
            first_logprob,
            cached_prompt_tokens,
            kv_on_device,
            prefill_here,
            label,
            events,
            in_flight,
            span,
            received_at,
        } = start;
        let id = request.id;
        let prompt_tokens = request.prompt.len() as u64;
        let now = Instant::now();
        if kv_on_device {
            engine.kv_landed_on_device(reservation_id);
        }
        let first = if prefill_here {
            engine
                .add_local(request, reservation_id, now)
                .map(|()| None)
        } else {
            engine
                .add_prefilled(
                    request,
                    reservation_id,
                    first_token,
                    first_logprob,
                    cached_prompt_tokens,
                    now,
                )
                .map(Some)
        };
        let first = match first {
            Ok(first) => first,
            Err(e) => {
                // Nothing adopted the blocks: give them back (false if already gone).
                engine.release_reservation(reservation_id);
                self.metrics.request(Outcome::Failed);
                propagation::mark_error(&span, e.error_type(), &e);
                let _ = events.try_send(Err(status::engine_status(&e)));
                return;
            }
        };
        let stream_span = tracing::info_span!(
            parent: &span,
            "decode.stream",
            tandem.prefill_here = prefill_here,
            gen_ai.usage.output_tokens = tracing::field::Empty,
        );
        let mut s = Stream {
            label,
            events,
            pending: None,
            finish: None,
            finished_in_engine: false,
            _in_flight: in_flight,
            span: stream_span,
            tokens: 0,
            node_seconds: 0.0,
            awaiting_first: None,
            last_sent: now,
        };
        match first {
            Some(first) => {
                self.metrics.first_token(received_at.elapsed());
                self.metrics
                    .prompt(prompt_tokens, cached_prompt_tokens as u64);
                s.push(&first);
                self.streams.insert(id, s);
                self.flush(engine, id);
            }
            None => {
                s.awaiting_first = Some(received_at);
                self.streams.insert(id, s);
            }
        }
    }
}

impl Driver for DecodeDriver {
    type Command = Command;

    fn on_command(&mut self, engine: &mut Engine, cmd: Command) {
        match cmd {
            Command::Reserve {
                reservation_id,
                tokens,
                reply,
            } => {
                let _ = reply.send(engine.reserve(reservation_id, tokens));
            }
            Command::ReleaseReservation { reservation_id } => {
                engine.release_reservation(reservation_id);
            }
            Command::Start(start) => self.start(engine, *start),
        }
    }

    fn step(&mut self, engine: &mut Engine) -> Result<usize, EngineError> {
        if self.cap.is_none()
            && let Some(b) = &self.budget
        {
            self.cap = Some(b.cap());
            engine.set_prefill_token_cap(self.cap);
        }
        let t0 = Instant::now();
        let outputs = engine.step()?;
        let elapsed = t0.elapsed();
        self.resize_budget(engine, elapsed);
        let streams = &mut self.streams;
        share_step_time(engine, elapsed, |id, secs| {
            if let Some(s) = streams.get_mut(&id) {
                s.node_seconds += secs;
            }
        });
        for o in &outputs {
            match self.streams.get_mut(&o.request_id) {
                Some(s) => {
                    if let Some(received_at) = s.awaiting_first.take() {
                        self.metrics.first_token(received_at.elapsed());
                        self.metrics
                            .prompt(o.usage.prompt_tokens as u64, o.usage.cached_tokens as u64);
                    }
                    s.push(o)
                }
                None => {
                    engine.abort(o.request_id);
                }
            }
        }
        for o in &outputs {
            self.flush(engine, o.request_id);
        }
        Ok(outputs.len())
    }

    fn housekeeping(&mut self, engine: &mut Engine) {
        let now = Instant::now();
        for (&id, s) in self.streams.iter_mut().filter(|(_, s)| s.progress_due(now)) {
            s.send_progress(engine.scheduler().computed_tokens(id), now);
        }
        let ids: Vec<u64> = self
            .streams
            .iter()
            .filter(|(_, s)| s.events.is_closed() || s.undelivered())
            .map(|(&id, _)| id)
            .collect();
        for id in ids {
            self.flush(engine, id);
        }
    }

    fn has_undelivered(&self) -> bool {
        self.streams.values().any(Stream::undelivered)
    }

    fn on_step_error(&mut self, engine: &mut Engine, error: &EngineError) {
        let s = status::engine_status(error);
        self.fail_all(engine, || s.clone());
    }

    fn shutdown(&mut self, engine: &mut Engine) {
        self.fail_all(engine, || {
            status::unavailable("decode node is shutting down")
        });
    }
}
