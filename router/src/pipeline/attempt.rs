//! One attempt at a request: reserve on a decode node, prefill on a prefill node, decode, and
//! forward tokens to the client.
//!
//! ```text
//!  pick decode ─▶ Reserve ─RESOURCE_EXHAUSTED/unreachable─▶ next decode node (each once)
//!       │ Reservation (armed: target, dispatch count, release duty in one owner)
//!  place: short prompt (or busy prefill pool)? ─yes─▶ Decode(reservation, prefill_here)
//!       │ no                                          (the decode node computes the prompt)
//!  pick prefill ─▶ Prefill stream ─▶ FirstToken
//!       │                              │
//!       │                   Decode(reservation, first token) stream
//!       ▼                              ▼
//!  poll prefill until KvPushed   ║   forward TokenBatches to the client, then DecodeFinal
//!  (dropping it earlier cancels  ║   (guard disarmed: the node freed the blocks)
//!   the push)                    ║
//! ```
//!
//! Any failure returns a classified [`RouterError`]; dropping the attempt's state cancels both
//! node streams (tonic resets the HTTP/2 stream, the node sees the call cancelled) and the armed
//! guard releases the reservation. The caller decides whether to try again.
//!
//! A later attempt after output reached the client (a migration) sends the prompt plus every
//! token sent so far and asks for what is left, saying how many prompt tokens are output
//! (`resumed_output_tokens`): the nodes count them for penalties and skip their draws, so
//! greedy and seeded sampling continue as the lost node would have. Limits: a stop string
//! spanning the seam is not seen, and a character split across the seam decodes as U+FFFD
//! (the lost node held its first bytes back).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;

use tandem_cluster::{Role, UsageTotals};
use tandem_proto::v1 as pb;
use tandem_proto::v1::prefill_client::PrefillClient;
use tandem_telemetry::trace::propagation;
use tokio::sync::mpsc;
use tracing::Instrument;

use super::reservation::Reservation;

mod forward;
mod reserve;
use super::{GenerationEvent, Inner};
use crate::error::{RouterError, Step};
use crate::request::PreparedRequest;
use crate::routing::placement::{self, PlacementInput};
use crate::routing::{Demand, Placement, PlacementReason};

/// What the attempts of one request share.
pub(super) struct AttemptState<'a> {
    pub inner: &'a Inner,
    pub request: &'a PreparedRequest,
    pub events: &'a mpsc::Sender<Result<GenerationEvent, RouterError>>,
    /// Token ids the client has received, over every attempt. A later attempt continues from
    /// them: its prompt is the request's prompt plus these (migration).
    pub generated: Vec<u32>,
    /// Prompt tokens the first successful prefill served from its prefix cache.
    pub cached_prompt_tokens: Option<u32>,
    /// Prefill nodes that failed this request (avoided while others exist).
    pub failed_prefill: HashSet<String>,
    /// Decode nodes whose Decode call failed for this request (avoided while others exist).
    pub failed_decode: HashSet<String>,
    /// When the request arrived (before admission): TTFT and end-to-end times start here.
    pub started: Instant,
    /// When the client was last sent tokens (inter-token latency).
    pub last_token_at: Option<Instant>,
    /// `router.request`: usage and finish reason are recorded on it.
    pub request_span: tracing::Span,
    /// Fixed (prefill, decode) node ids instead of the routing policies' choice (the canary).
    pub pin: Option<(String, String)>,
    /// Whether this is a client request (counted in the request metrics); the canary's are not.
    pub counted: bool,
    /// The caller's key id: the completed request's usage is recorded under it.
    pub key_id: Option<Arc<str>>,
    /// Engine time the nodes reported for this request, every attempt included.
    pub node_seconds: (f64, f64),
}

/// An open Prefill call whose first token arrived.
struct PrefillCall {
    /// Counts the request on the node until the push is acknowledged.
    dispatch: crate::nodes::Dispatch,
    node_id: String,
    stream: tonic::Streaming<pb::PrefillResponse>,
    first: pb::FirstToken,
    /// `router.prefill`: ends when the push is acknowledged.
    span: tracing::Span,
}

impl PrefillCall {
    /// A protocol error of the prefill node `node_id`.
    fn protocol(node_id: &str) -> impl Fn(&'static str) -> RouterError + '_ {
        move |what| RouterError::Protocol {
            role: Role::Prefill,
            node_id: node_id.to_string(),
            step: Step::Prefill,
            what,
        }
    }
}

/// An open Decode call.
struct DecodeCall {
    node_id: String,
    stream: tonic::Streaming<pb::DecodeResponse>,
    /// `router.decode`: ends with the stream.
    span: tracing::Span,
}

/// Metadata of a call made under `span`: its W3C trace context (nothing with tracing off).
fn call_metadata(span: &tracing::Span) -> tonic::metadata::MetadataMap {
    let mut metadata = tonic::metadata::MetadataMap::new();
    propagation::inject_grpc(span, &mut metadata);
    metadata
}

impl<'a> AttemptState<'a> {
    /// A client request's state before its first attempt.
    pub fn new(
        inner: &'a Inner,
        request: &'a PreparedRequest,
        events: &'a mpsc::Sender<Result<GenerationEvent, RouterError>>,
        started: Instant,
        request_span: tracing::Span,
    ) -> Self {
        AttemptState {
            inner,
            request,
            events,
            generated: Vec::new(),
            cached_prompt_tokens: None,
            failed_prefill: Default::default(),
            failed_decode: Default::default(),
            started,
            last_token_at: None,
            request_span,
            pin: None,
            counted: true,
            key_id: None,
            node_seconds: (0.0, 0.0),
        }
    }

    /// Sends `event` to the client and counts it: TTFT at the first token, inter-token gaps
    /// after it, the end-to-end time and usage at the final message.
    pub(super) async fn send(&mut self, event: GenerationEvent) -> Result<(), RouterError> {
        let metrics = &self.inner.metrics;
        let priority = self.request.priority;
        match &event {
            _ if !self.counted => {}
            GenerationEvent::Delta { token_ids, .. } if !token_ids.is_empty() => {
                let n = token_ids.len() as u32;
                let now = Instant::now();
                match self.last_token_at {
                    None => {
                        metrics.first_token(priority, now - self.started);
                        self.request_span.record(
                            "tandem.ttft_ms",
                            (now - self.started).as_secs_f64() * 1e3,
                        );
                        // The first token's own gap is TTFT; later ones in its batch are ITL.
                        metrics.tokens_after(priority, std::time::Duration::ZERO, n - 1);
                    }
                    Some(last) => metrics.tokens_after(priority, now - last, n),
                }
                metrics.output(priority, n);
                self.last_token_at = Some(now);
            }
            GenerationEvent::Final(done) => {
                metrics.completed(priority, self.started.elapsed(), done.usage);
                let usage = UsageTotals {
                    requests: 1,
                    input_tokens: u64::from(done.usage.prompt_tokens),
                    cached_input_tokens: u64::from(done.usage.cached_prompt_tokens),
                    output_tokens: u64::from(done.usage.completion_tokens),
                    prefill_node_seconds: self.node_seconds.0,
                    decode_node_seconds: self.node_seconds.1,
                };
                if let Some(key) = &self.key_id {
                    self.inner.ledger.record(key, &usage);
                    metrics.key_usage(key, &usage);
                }
                let span = &self.request_span;
                span.record("gen_ai.usage.input_tokens", done.usage.prompt_tokens);
                span.record("gen_ai.usage.output_tokens", done.usage.completion_tokens);
                span.record(
                    "tandem.usage.cached_input_tokens",
                    done.usage.cached_prompt_tokens,
                );
                propagation::set_strings(
                    span,
                    "gen_ai.response.finish_reasons",
                    &[done.finish_reason.openai()],
                );
            }
            GenerationEvent::Delta { .. } => {}
        }
        self.events
            .send(Ok(event))
            .await
            .map_err(|_| RouterError::Cancelled)
    }

    /// Tokens the client has received.
    pub fn tokens_sent(&self) -> u32 {
        self.generated.len() as u32
    }

    /// Tokens still to generate.
    pub fn tokens_left(&self) -> u32 {
        self.request
            .max_new_tokens()
            .saturating_sub(self.tokens_sent())
    }

    /// Runs one attempt to its end. After output was sent (a migration), the attempt's prompt
    /// is the request's prompt plus the tokens sent, and its limit what is left. Steps:
    /// [`reserve`](Self::reserve) → [`start_prefill`](Self::start_prefill) →
    /// [`start_decode`](Self::start_decode) → [`forward`](Self::forward).
    pub async fn run(&mut self) -> Result<(), RouterError> {
        let tokens_before = self.tokens_sent();
        let prompt_ids: Vec<u32> = self
            .request
            .prompt_ids
            .iter()
            .chain(&self.generated)
            .copied()
            .collect();
        let sampling = pb::SamplingParams {
            max_tokens: self.tokens_left(),
            resumed_output_tokens: tokens_before,
            ..self.request.sampling.clone()
        };
        let demand = Demand {
            tokens: prompt_ids.len() as u64 + sampling.max_tokens as u64,
            prompt_tokens: prompt_ids.len() as u64,
        };

        // 1. Reserve KV blocks on a decode node, trying each node at most once.
        let reservation = self
            .reserve(demand, prompt_ids.len() as u32, sampling.max_tokens)
            .await?;
        // 2. Where the prompt is computed: a prefill node, or the decode node itself.
        let (placement, prefill_node) = self.place(demand, &prompt_ids, &reservation)?;
        // 3. Prefill: the prompt, its first token, the KV pushed into the reservation.
        let (prefill, cached_prompt_tokens) = match prefill_node {
            Some(dispatch) => {
                let prefill = self
                    .start_prefill(dispatch, &prompt_ids, &sampling, &reservation)
                    .await?;
                let cached = *self
                    .cached_prompt_tokens
                    .get_or_insert(prefill.first.cached_prompt_tokens);
                (Some(prefill), Some(cached))
            }
            // Known from the decode node's final message.
            None => (None, self.cached_prompt_tokens),
        };
        // 4. Decode from the pushed KV (the node waits for every block to arrive and verify),
        //    or from the prompt computed there.
        let decode = self
            .start_decode(&reservation, prompt_ids, sampling, prefill.as_ref().map(|p| &p.first), placement)
            .await?;
        // 5. Drive both streams to the end.
        self.forward(prefill, decode, reservation, tokens_before, cached_prompt_tokens)
            .await
    }

    /// Decides where the prompt is computed (see [`crate::routing::placement`]): a short one
    /// on the decode node at once; a longer one after the prefill node is chosen, on the decode
    /// node only if that prefill node is busy. Returns the chosen prefill node, if any.
    fn place(
        &mut self,
        demand: Demand,
        prompt_ids: &[u32],
        reservation: &Reservation,
    ) -> Result<(Placement, Option<crate::nodes::Dispatch>), RouterError> {
        let settings = &self.inner.options.placement;
        let mut input = PlacementInput {
            prompt_tokens: prompt_ids.len() as u64,
            prefill_work_tokens: None,
            decode_pending_tokens: reservation.node_load().map(|l| l.pending_prompt_tokens),
            pinned: self.pin.is_some(),
            prefill_unavailable: false,
        };
        let mut placement = placement::decide(settings, input);
        let mut prefill_node = None;
        if !placement.is_local() {
            match self.pick_prefill(demand, prompt_ids) {
                Ok(dispatch) => {
                    if placement.reason() == PlacementReason::LongPrompt {
                        input.prefill_work_tokens = dispatch
                            .load()
                            .map(|l| l.pending_prompt_tokens + dispatch.work());
                        placement = placement::decide(settings, input);
                    }
                    // Dropping a dispatch the decode node takes over uncounts it.
                    prefill_node = Some(dispatch).filter(|_| !placement.is_local());
                }
                Err(no_nodes @ RouterError::NoNodes { .. }) if self.pin.is_none() => {
                    input.prefill_unavailable = true;
                    placement = placement::decide(settings, input);
                    if !placement.is_local() {
                        return Err(no_nodes);
                    }
                }
                Err(e) => return Err(e),
            }
        }
        if self.counted {
            self.inner.metrics.placement(placement);
        }
        tracing::debug!(
            request_id = %self.request.request_id,
            prompt_tokens = input.prompt_tokens,
            prefill_work_tokens = ?input.prefill_work_tokens,
            decode_pending_tokens = ?input.decode_pending_tokens,
            site = placement.site(),
            reason = placement.reason().as_str(),
            "prompt placed"
        );
        Ok((placement, prefill_node))
    }

    /// Picks a prefill node (the pinned one, else one that has not failed this request if
    /// possible) and counts the request on it.
    fn pick_prefill(
        &self,
        demand: Demand,
        prompt_ids: &[u32],
    ) -> Result<crate::nodes::Dispatch, RouterError> {
        let pool = &self.inner.prefill;
        match &self.pin {
            Some((prefill, _)) => pool.dispatch_to(prefill),
            None => match pool.pick_for(demand, &self.failed_prefill, prompt_ids) {
                Err(RouterError::NoNodes { .. }) if !self.failed_prefill.is_empty() => {
                    pool.pick_for(demand, &HashSet::new(), prompt_ids)
                }
                other => other,
            },
        }
    }

    /// Sends the prompt with the reservation to the chosen prefill node, and waits for the
    /// first token.
    async fn start_prefill(
        &mut self,
        dispatch: crate::nodes::Dispatch,
        prompt_ids: &[u32],
        sampling: &pb::SamplingParams,
        reservation: &Reservation,
    ) -> Result<PrefillCall, RouterError> {
        let target = reservation.target();
        let node_id = dispatch.node().node_id();
        let span = tracing::info_span!(
            "router.prefill",
            otel.kind = "client",
            server.address = %dispatch.node().info().grpc_addr,
            tandem.node_id = %node_id,
            tandem.prompt_tokens = prompt_ids.len(),
            tandem.cached_prompt_tokens = tracing::field::Empty,
            tandem.kv.bytes = tracing::field::Empty,
            tandem.kv.blocks = tracing::field::Empty,
            tandem.kv.transfer_us = tracing::field::Empty,
        );
        let channel = dispatch.node().channel().inspect_err(|_| {
            // Unreachable as registered (a bad address, TLS the router cannot speak): the next
            // attempt avoids it.
            self.failed_prefill.insert(node_id.clone());
        })?;
        let mut client = PrefillClient::new(channel);
        let request = pb::PrefillRequest {
            request_id: self.request.request_id.clone(),
            prompt_token_ids: prompt_ids.to_vec(),
            sampling: Some(sampling.clone()),
            target: Some(target.clone()),
            priority: self.request.priority.to_proto() as i32,
        };
        let call = tonic::Request::from_parts(call_metadata(&span), Default::default(), request);
        let first_token = async {
            let mut stream = client.prefill(call).await?.into_inner();
            let first = stream.message().await?;
            Ok::<_, tonic::Status>((stream, first))
        }
        .instrument(span.clone());
        // A prefill node that goes silent (hung, cut off) is waited for only while the
        // reservation lives: past its expiry the KV cannot land, and the attempt gives the
        // reservation back and tries again elsewhere.
        let result = match reservation.expires() {
            Some(expires) => tokio::time::timeout_at(expires, first_token)
                .await
                .unwrap_or_else(|_| {
                    Err(tonic::Status::deadline_exceeded(format!(
                        "no first token before decode node {}'s reservation {} expired",
                        reservation.node_id(),
                        target.reservation_id
                    )))
                }),
            None => first_token.await,
        };
        let (stream, first) = match result {
            Ok(r) => r,
            Err(status) => {
                self.failed_prefill.insert(node_id.clone());
                let e = RouterError::node(Role::Prefill, &node_id, Step::Prefill, &status);
                propagation::mark_error(&span, e.kind(), &e);
                return Err(e);
            }
        };
        let first = match first {
            Some(pb::PrefillResponse {
                event: Some(pb::prefill_response::Event::FirstToken(first)),
            }) => first,
            Some(_) => return Err(PrefillCall::protocol(&node_id)("sent kv_pushed before first_token")),
            None => return Err(PrefillCall::protocol(&node_id)("stream ended before the first token")),
        };
        span.record("tandem.cached_prompt_tokens", first.cached_prompt_tokens);
        self.node_seconds.0 += first.node_seconds;
        Ok(PrefillCall {
            dispatch,
            node_id,
            stream,
            first,
            span,
        })
    }

    /// Starts the Decode call for the reservation: with the prefill's first token, or (no
    /// prefill node) asking the decode node to compute the prompt itself.
    async fn start_decode(
        &mut self,
        reservation: &Reservation,
        prompt_ids: Vec<u32>,
        sampling: pb::SamplingParams,
        first: Option<&pb::FirstToken>,
        placement: Placement,
    ) -> Result<DecodeCall, RouterError> {
        let (node_id, target) = (reservation.node_id(), reservation.target());
        let mut client = reservation.client();
        let span = tracing::info_span!(
            "router.decode",
            otel.kind = "client",
            tandem.node_id = %node_id,
            tandem.reservation_id = target.reservation_id,
            tandem.prefill.site = placement.site(),
            tandem.prefill.reason = placement.reason().as_str(),
            tandem.output_tokens = tracing::field::Empty,
        );
        let request = pb::DecodeRequest {
            request_id: self.request.request_id.clone(),
            reservation_id: target.reservation_id,
            epoch: target.epoch,
            prompt_token_ids: prompt_ids,
            first_token_id: first.map_or(0, |f| f.token_id),
            sampling: Some(sampling),
            priority: self.request.priority.to_proto() as i32,
            cached_prompt_tokens: first.map_or(0, |f| f.cached_prompt_tokens),
            first_token_logprob: first.and_then(|f| f.logprob.clone()),
            prefill_here: first.is_none(),
        };
        let call = tonic::Request::from_parts(call_metadata(&span), Default::default(), request);
        match client.decode(call).instrument(span.clone()).await {
            Ok(response) => Ok(DecodeCall {
                node_id: node_id.to_string(),
                stream: response.into_inner(),
                span,
            }),
            Err(status) => {
                self.failed_decode.insert(node_id.to_string());
                let e = RouterError::node(Role::Decode, node_id, Step::Decode, &status);
                propagation::mark_error(&span, e.kind(), &e);
                Err(e)
            }
        }
    }
}
