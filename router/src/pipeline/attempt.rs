//! One attempt at a request: reserve on a decode node, prefill on a prefill node, decode, and
//! forward tokens to the client.
//!
//! ```text
//!  pick decode ─▶ Reserve ─RESOURCE_EXHAUSTED/unreachable─▶ next decode node (each once)
//!       │ KvTarget (ReservationGuard armed)
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
//! token sent so far and asks for what is left: with greedy sampling the continuation is the
//! one the lost node would have produced. Limits: a seeded sampler restarts its generator, a
//! stop string spanning the seam is not seen, and a character split across the seam decodes
//! as U+FFFD (the lost node held its first bytes back).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;

use tandem_cluster::{Role, UsageTotals};
use tandem_proto::v1 as pb;
use tandem_proto::v1::decode_client::DecodeClient;
use tandem_proto::v1::prefill_client::PrefillClient;
use tandem_telemetry::trace::propagation;
use tokio::sync::mpsc;
use tracing::Instrument;

use super::reservation::ReservationGuard;
use super::{FinishReason, GenerationEvent, GenerationFinal, Inner, Usage};
use crate::error::{NodeFault, RouterError, Step};
use crate::request::PreparedRequest;
use crate::routing::Demand;
use crate::stats::bump;

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
            ..self.request.sampling.clone()
        };
        let demand = Demand {
            tokens: prompt_ids.len() as u64 + sampling.max_tokens as u64,
        };

        // 1. Reserve KV blocks on a decode node, trying each node at most once.
        let (decode_dispatch, decode_client, target) = self
            .reserve(demand, prompt_ids.len() as u32, sampling.max_tokens)
            .await?;
        let decode_node = decode_dispatch.node().node_id();
        let guard = ReservationGuard::new(
            decode_client.clone(),
            decode_node.clone(),
            target.reservation_id,
            target.epoch,
            self.inner.options.rpc_timeout,
            Arc::clone(&self.inner.stats),
        );
        // 2. Prefill: the prompt, its first token, the KV pushed into the reservation.
        let prefill = self
            .start_prefill(demand, &prompt_ids, &sampling, &target)
            .await?;
        // 3. Decode from the pushed KV; the node waits for every block to arrive and verify.
        let cached_prompt_tokens = *self
            .cached_prompt_tokens
            .get_or_insert(prefill.first.cached_prompt_tokens);
        let decode = self
            .start_decode(
                decode_client,
                &decode_node,
                &target,
                prompt_ids,
                sampling,
                &prefill.first,
            )
            .await?;
        // 4. Drive both streams to the end.
        self.forward(prefill, decode, guard, tokens_before, cached_prompt_tokens)
            .await
    }

    /// Picks a prefill node (one that has not failed this request, if possible), sends it the
    /// prompt with the reservation, and waits for the first token.
    async fn start_prefill(
        &mut self,
        demand: Demand,
        prompt_ids: &[u32],
        sampling: &pb::SamplingParams,
        target: &pb::KvTarget,
    ) -> Result<PrefillCall, RouterError> {
        let inner = self.inner;
        let dispatch = match &self.pin {
            Some((prefill, _)) => inner.prefill.dispatch_to(prefill)?,
            None => match inner.prefill.pick(demand, &self.failed_prefill) {
                Err(RouterError::NoNodes { .. }) if !self.failed_prefill.is_empty() => {
                    inner.prefill.pick(demand, &HashSet::new())?
                }
                other => other?,
            },
        };
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
        let mut client = PrefillClient::new(dispatch.node().channel()?);
        let request = pb::PrefillRequest {
            request_id: self.request.request_id.clone(),
            prompt_token_ids: prompt_ids.to_vec(),
            sampling: Some(sampling.clone()),
            target: Some(target.clone()),
            priority: self.request.priority.to_proto() as i32,
        };
        let call = tonic::Request::from_parts(call_metadata(&span), Default::default(), request);
        let result = async {
            let mut stream = client.prefill(call).await?.into_inner();
            let first = stream.message().await?;
            Ok::<_, tonic::Status>((stream, first))
        }
        .instrument(span.clone())
        .await;
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

    /// Starts the Decode call for the reservation with the prefill's first token.
    async fn start_decode(
        &mut self,
        mut client: DecodeClient<tonic::transport::Channel>,
        node_id: &str,
        target: &pb::KvTarget,
        prompt_ids: Vec<u32>,
        sampling: pb::SamplingParams,
        first: &pb::FirstToken,
    ) -> Result<DecodeCall, RouterError> {
        let span = tracing::info_span!(
            "router.decode",
            otel.kind = "client",
            tandem.node_id = %node_id,
            tandem.reservation_id = target.reservation_id,
            tandem.output_tokens = tracing::field::Empty,
        );
        let request = pb::DecodeRequest {
            request_id: self.request.request_id.clone(),
            reservation_id: target.reservation_id,
            epoch: target.epoch,
            prompt_token_ids: prompt_ids,
            first_token_id: first.token_id,
            sampling: Some(sampling),
            priority: self.request.priority.to_proto() as i32,
            cached_prompt_tokens: first.cached_prompt_tokens,
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

    /// Drives both streams: the prefill one until the push is acknowledged (dropping it earlier
    /// would cancel the push), the decode one to the client, then the final message.
    async fn forward(
        &mut self,
        prefill: PrefillCall,
        decode: DecodeCall,
        mut guard: ReservationGuard,
        tokens_before: u32,
        cached_prompt_tokens: u32,
    ) -> Result<(), RouterError> {
        let request = self.request;
        let PrefillCall {
            dispatch,
            node_id: prefill_node,
            stream: mut prefill_stream,
            span: prefill_span,
            ..
        } = prefill;
        let DecodeCall {
            node_id: decode_node,
            stream: mut decode_stream,
            span: decode_span,
        } = decode;
        let prefill_protocol = PrefillCall::protocol(&prefill_node);
        let decode_protocol = |what| RouterError::Protocol {
            role: Role::Decode,
            node_id: decode_node.clone(),
            step: Step::Decode,
            what,
        };
        let mut prefill_open = Some((dispatch, prefill_span));
        let mut tokens_here = 0u32;
        // Armed once the stream is producing (KV pushed or a decode message arrived): the
        // decode node must then speak within the idle timeout.
        let idle = self.inner.options.stream_idle_timeout;
        let mut stall_at: Option<tokio::time::Instant> = None;
        let result = loop {
            let stall = async {
                match stall_at {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = stall => {
                    self.failed_decode.insert(decode_node.clone());
                    break Err(RouterError::Node {
                        role: Role::Decode,
                        node_id: decode_node.clone(),
                        step: Step::Decode,
                        fault: NodeFault::Stalled,
                        retry_safe: true,
                        code: tonic::Code::DeadlineExceeded,
                        message: format!("no message from the decode node for {idle:?}"),
                    });
                }
                message = prefill_stream.message(), if prefill_open.is_some() => match message {
                    Ok(Some(pb::PrefillResponse { event: Some(pb::prefill_response::Event::KvPushed(pushed)) })) => {
                        if let Some((_, span)) = &prefill_open {
                            span.record("tandem.kv.bytes", pushed.bytes);
                            span.record("tandem.kv.blocks", pushed.blocks);
                            span.record("tandem.kv.transfer_us", pushed.transfer_us);
                        }
                        // Ends the prefill span and the node's dispatch count.
                        prefill_open = None;
                        stall_at.get_or_insert(tokio::time::Instant::now() + idle);
                    }
                    Ok(Some(_)) => break Err(prefill_protocol("sent a second first_token")),
                    Ok(None) => break Err(prefill_protocol("stream ended before kv_pushed")),
                    Err(status) => {
                        self.failed_prefill.insert(prefill_node.clone());
                        let e = RouterError::node(Role::Prefill, &prefill_node, Step::Prefill, &status);
                        if let Some((_, span)) = &prefill_open {
                            propagation::mark_error(span, e.kind(), &e);
                        }
                        break Err(e);
                    }
                },
                message = decode_stream.message() => match message {
                    Ok(Some(pb::DecodeResponse { event: Some(pb::decode_response::Event::Tokens(batch)) })) => {
                        stall_at = Some(tokio::time::Instant::now() + idle);
                        // The decode node streams the whole output, the first token included.
                        let token_ids = batch.token_ids;
                        tokens_here += token_ids.len() as u32;
                        self.generated.extend_from_slice(&token_ids);
                        if let Err(e) = self.send(GenerationEvent::Delta { text: batch.text, token_ids }).await {
                            break Err(e);
                        }
                    }
                    Ok(Some(pb::DecodeResponse { event: Some(pb::decode_response::Event::Final(done)) })) => {
                        guard.disarm();
                        self.node_seconds.1 += done.node_seconds;
                        let completion_tokens = done
                            .usage
                            .map(|u| u.completion_tokens)
                            .filter(|&n| n > 0)
                            .unwrap_or(tokens_here)
                            + tokens_before;
                        decode_span.record("tandem.output_tokens", tokens_here);
                        let finish_reason = FinishReason::from_proto(done.finish_reason);
                        break self
                            .send(GenerationEvent::Final(GenerationFinal {
                                finish_reason,
                                usage: Usage {
                                    prompt_tokens: request.prompt_tokens(),
                                    cached_prompt_tokens,
                                    completion_tokens,
                                },
                                request_id: request.request_id.clone(),
                            }))
                            .await;
                    }
                    Ok(Some(_)) => break Err(decode_protocol("sent an empty event")),
                    Ok(None) => {
                        self.failed_decode.insert(decode_node.clone());
                        break Err(decode_protocol("stream ended without a final message"));
                    }
                    Err(status) => {
                        self.failed_decode.insert(decode_node.clone());
                        let e = RouterError::node(Role::Decode, &decode_node, Step::Decode, &status);
                        if matches!(e, RouterError::Node { fault: NodeFault::KvCorrupt, .. }) {
                            // The decode node checked the KV and refused it: its sender is the
                            // suspect too, so the re-prefill avoids both while others exist.
                            self.failed_prefill.insert(prefill_node.clone());
                        }
                        break Err(e);
                    }
                },
            }
        };
        if let Err(e) = &result
            && !matches!(e, RouterError::Cancelled)
        {
            decode_span.record("tandem.output_tokens", tokens_here);
            propagation::mark_error(&decode_span, e.kind(), e);
        }
        result
    }

    /// Picks decode nodes until one grants a reservation; each node is asked at most once.
    async fn reserve(
        &mut self,
        demand: Demand,
        prompt_tokens: u32,
        max_new_tokens: u32,
    ) -> Result<
        (
            crate::nodes::Dispatch,
            DecodeClient<tonic::transport::Channel>,
            pb::KvTarget,
        ),
        RouterError,
    > {
        let inner = self.inner;
        let request = self.request;
        // Nodes whose Decode failed for this request are avoided while others exist.
        let mut asked = self.failed_decode.clone();
        let mut avoiding = !asked.is_empty();
        let mut busy = 0usize;
        let mut last_error = None;
        loop {
            let picked = match &self.pin {
                Some((_, decode)) if asked.contains(decode) => {
                    return Err(last_error.unwrap_or(RouterError::NoNodes { role: Role::Decode }));
                }
                Some((_, decode)) => inner.decode.dispatch_to(decode),
                None => inner.decode.pick(demand, &asked),
            };
            let dispatch = match picked {
                Ok(dispatch) => dispatch,
                Err(RouterError::NoNodes { .. }) if avoiding => {
                    avoiding = false;
                    asked.retain(|id| !self.failed_decode.contains(id));
                    continue;
                }
                Err(no_nodes @ RouterError::NoNodes { .. }) => {
                    return Err(match last_error {
                        _ if busy > 0 => RouterError::NoCapacity {
                            tried: busy,
                            blocks_needed: demand.tokens,
                        },
                        Some(e) => e,
                        None => no_nodes,
                    });
                }
                Err(e) => return Err(e),
            };
            let node_id = dispatch.node().node_id();
            asked.insert(node_id.clone());
            let mut client = DecodeClient::new(dispatch.node().channel()?);
            let span = tracing::info_span!(
                "router.reserve",
                otel.kind = "client",
                server.address = %dispatch.node().info().grpc_addr,
                tandem.node_id = %node_id,
                tandem.kv.tokens = demand.tokens,
                tandem.reservation_id = tracing::field::Empty,
            );
            let mut call = tonic::Request::from_parts(
                call_metadata(&span),
                Default::default(),
                pb::ReserveRequest {
                    request_id: request.request_id.clone(),
                    prompt_tokens,
                    max_new_tokens,
                },
            );
            call.set_timeout(inner.options.rpc_timeout);
            match client.reserve(call).instrument(span.clone()).await {
                Ok(reply) => {
                    let target = reply.into_inner().target;
                    if let Some(t) = &target {
                        span.record("tandem.reservation_id", t.reservation_id);
                    }
                    let Some(target) = target else {
                        last_error = Some(RouterError::Protocol {
                            role: Role::Decode,
                            node_id,
                            step: Step::Reserve,
                            what: "reserve answered without a target",
                        });
                        continue;
                    };
                    return Ok((dispatch, client, target));
                }
                Err(status) => {
                    let error = RouterError::node(Role::Decode, &node_id, Step::Reserve, &status);
                    propagation::mark_error(&span, error.kind(), &error);
                    tracing::debug!(request_id = %request.request_id, %error, "reserve refused");
                    if status.code() == tonic::Code::ResourceExhausted {
                        bump(&inner.stats.reserve_refusals);
                        busy += 1;
                    } else if !error.is_retry_safe() {
                        return Err(error);
                    }
                    last_error = Some(error);
                }
            }
        }
    }
}
