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

use tandem_cluster::Role;
use tandem_proto::v1 as pb;
use tandem_proto::v1::decode_client::DecodeClient;
use tandem_proto::v1::prefill_client::PrefillClient;
use tokio::sync::mpsc;

use super::reservation::ReservationGuard;
use super::{FinishReason, GenerationEvent, GenerationFinal, Inner, Usage};
use crate::error::{RouterError, Step};
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
}

impl AttemptState<'_> {
    async fn send(&self, event: GenerationEvent) -> Result<(), RouterError> {
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
    /// is the request's prompt plus the tokens sent, and its limit what is left.
    pub async fn run(&mut self) -> Result<(), RouterError> {
        let inner = self.inner;
        let request = self.request;
        let tokens_before = self.tokens_sent();
        let prompt_ids: Vec<u32> = request
            .prompt_ids
            .iter()
            .chain(&self.generated)
            .copied()
            .collect();
        let sampling = pb::SamplingParams {
            max_tokens: self.tokens_left(),
            ..request.sampling.clone()
        };
        let demand = Demand {
            tokens: prompt_ids.len() as u64 + sampling.max_tokens as u64,
        };

        // 1. Reserve KV blocks on a decode node, trying each node at most once.
        let (decode_dispatch, mut decode_client, target) = self
            .reserve(demand, prompt_ids.len() as u32, sampling.max_tokens)
            .await?;
        let decode_node = decode_dispatch.node().node_id();
        let mut guard = ReservationGuard::new(
            decode_client.clone(),
            decode_node.clone(),
            target.reservation_id,
            target.epoch,
            inner.options.rpc_timeout,
            Arc::clone(&inner.stats),
        );

        // 2. Prefill on a prefill node (one that has not failed this request, if possible).
        let prefill_dispatch = match inner.prefill.pick(demand, &self.failed_prefill) {
            Err(RouterError::NoNodes { .. }) if !self.failed_prefill.is_empty() => {
                inner.prefill.pick(demand, &HashSet::new())?
            }
            other => other?,
        };
        let prefill_node = prefill_dispatch.node().node_id();
        let prefill_error = |status: &tonic::Status| {
            RouterError::node(Role::Prefill, &prefill_node, Step::Prefill, status)
        };
        let prefill_protocol = |what| RouterError::Protocol {
            role: Role::Prefill,
            node_id: prefill_node.clone(),
            step: Step::Prefill,
            what,
        };
        let mut prefill_client = PrefillClient::new(prefill_dispatch.node().channel()?);
        let prefill_request = pb::PrefillRequest {
            request_id: request.request_id.clone(),
            prompt_token_ids: prompt_ids.clone(),
            sampling: Some(sampling.clone()),
            target: Some(target.clone()),
            priority: request.priority.to_proto() as i32,
        };
        let mut prefill_stream = match prefill_client.prefill(prefill_request).await {
            Ok(response) => response.into_inner(),
            Err(status) => {
                self.failed_prefill.insert(prefill_node.clone());
                return Err(prefill_error(&status));
            }
        };
        let first = match prefill_stream.message().await {
            Ok(Some(pb::PrefillResponse {
                event: Some(pb::prefill_response::Event::FirstToken(first)),
            })) => first,
            Ok(Some(_)) => return Err(prefill_protocol("sent kv_pushed before first_token")),
            Ok(None) => return Err(prefill_protocol("stream ended before the first token")),
            Err(status) => {
                self.failed_prefill.insert(prefill_node.clone());
                return Err(prefill_error(&status));
            }
        };

        // 3. Decode from the pushed KV; the node waits for every block to arrive and verify.
        let decode_error = |status: &tonic::Status| {
            RouterError::node(Role::Decode, &decode_node, Step::Decode, status)
        };
        let decode_protocol = |what| RouterError::Protocol {
            role: Role::Decode,
            node_id: decode_node.clone(),
            step: Step::Decode,
            what,
        };
        let decode_request = pb::DecodeRequest {
            request_id: request.request_id.clone(),
            reservation_id: target.reservation_id,
            epoch: target.epoch,
            prompt_token_ids: prompt_ids,
            first_token_id: first.token_id,
            sampling: Some(sampling),
            priority: request.priority.to_proto() as i32,
            cached_prompt_tokens: first.cached_prompt_tokens,
        };
        let cached_prompt_tokens = *self
            .cached_prompt_tokens
            .get_or_insert(first.cached_prompt_tokens);
        let mut decode_stream = match decode_client.decode(decode_request).await {
            Ok(response) => response.into_inner(),
            Err(status) => {
                self.failed_decode.insert(decode_node.clone());
                return Err(decode_error(&status));
            }
        };

        // 4. Drive both streams: the prefill one until the push is acknowledged (dropping it
        //    earlier would cancel the push), the decode one to the client.
        let mut prefill_dispatch = Some(prefill_dispatch);
        let mut tokens_here = 0u32;
        loop {
            tokio::select! {
                message = prefill_stream.message(), if prefill_dispatch.is_some() => match message {
                    Ok(Some(pb::PrefillResponse { event: Some(pb::prefill_response::Event::KvPushed(pushed)) })) => {
                        tracing::debug!(
                            request_id = %request.request_id,
                            prefill_node = %prefill_node,
                            bytes = pushed.bytes,
                            blocks = pushed.blocks,
                            transfer_us = pushed.transfer_us,
                            "KV pushed"
                        );
                        prefill_dispatch = None;
                    }
                    Ok(Some(_)) => return Err(prefill_protocol("sent a second first_token")),
                    Ok(None) => return Err(prefill_protocol("stream ended before kv_pushed")),
                    Err(status) => {
                        self.failed_prefill.insert(prefill_node.clone());
                        return Err(prefill_error(&status));
                    }
                },
                message = decode_stream.message() => match message {
                    Ok(Some(pb::DecodeResponse { event: Some(pb::decode_response::Event::Tokens(batch)) })) => {
                        // The decode node streams the whole output, the first token included.
                        let token_ids = batch.token_ids;
                        tokens_here += token_ids.len() as u32;
                        self.generated.extend_from_slice(&token_ids);
                        self.send(GenerationEvent::Delta { text: batch.text, token_ids }).await?;
                    }
                    Ok(Some(pb::DecodeResponse { event: Some(pb::decode_response::Event::Final(done)) })) => {
                        guard.disarm();
                        let completion_tokens = done
                            .usage
                            .map(|u| u.completion_tokens)
                            .filter(|&n| n > 0)
                            .unwrap_or(tokens_here)
                            + tokens_before;
                        let finish_reason = FinishReason::from_proto(done.finish_reason);
                        return self
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
                    Ok(Some(_)) => return Err(decode_protocol("sent an empty event")),
                    Ok(None) => {
                        self.failed_decode.insert(decode_node.clone());
                        return Err(decode_protocol("stream ended without a final message"));
                    }
                    Err(status) => {
                        self.failed_decode.insert(decode_node.clone());
                        return Err(decode_error(&status));
                    }
                },
            }
        }
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
            let dispatch = match inner.decode.pick(demand, &asked) {
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
            let mut call = tonic::Request::new(pb::ReserveRequest {
                request_id: request.request_id.clone(),
                prompt_tokens,
                max_new_tokens,
            });
            call.set_timeout(inner.options.rpc_timeout);
            match client.reserve(call).await {
                Ok(reply) => {
                    let Some(target) = reply.into_inner().target else {
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
