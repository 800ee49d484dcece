//! [`AttemptState::forward`]: the last step of an attempt, both node streams driven to the end
//! one message at a time (see the parent module's diagram).
//!
//! Invariants: the prefill stream is read until its push is acknowledged (dropping it earlier
//! would cancel the push); the reservation is disarmed only by the decode node's final
//! message (the node freed the blocks); once the stream is producing (for a prompt computed on
//! the decode node: from the call on), a decode node silent for the idle timeout is a failure
//! of that node (the request moves on); tokens and `DecodeProgress` both count as speaking.

use tandem_cluster::Role;
use tandem_proto::v1 as pb;
use tandem_telemetry::trace::propagation;

use super::{AttemptState, DecodeCall, PrefillCall};
use crate::error::{NodeFault, RouterError, Step};
use crate::pipeline::reservation::Reservation;
use crate::pipeline::{FinishReason, GenerationEvent, GenerationFinal, Usage};

/// The state of [`AttemptState::forward`] between messages.
struct Forwarding {
    /// `None` when the decode node computed the prompt (conditional disaggregation).
    prefill_node: Option<String>,
    decode_node: String,
    /// The prefill call's dispatch count and span, until its push is acknowledged.
    prefill_open: Option<(crate::nodes::Dispatch, tracing::Span)>,
    decode_span: tracing::Span,
    reservation: Reservation,
    /// Tokens the client had before this attempt (a migration continues from them).
    tokens_before: u32,
    tokens_here: u32,
    /// From the prefill node's first token; `None` until the decode node's final message says
    /// (it computed the prompt).
    cached_prompt_tokens: Option<u32>,
    /// Once the stream produces, the decode node must speak within this.
    idle: std::time::Duration,
    stall_at: Option<tokio::time::Instant>,
}

/// What one message did to the attempt.
enum Next {
    /// Keep reading.
    Continue,
    /// The attempt ended.
    End(Result<(), RouterError>),
}

impl AttemptState<'_> {
    /// Drives both streams: the prefill one until the push is acknowledged (dropping it earlier
    /// would cancel the push), the decode one to the client, then the final message. Each
    /// message is one step ([`Self::on_prefill`], [`Self::on_decode`]); a decode node silent for
    /// the idle timeout once the stream is producing is [`Self::stalled`].
    pub(super) async fn forward(
        &mut self,
        prefill: Option<PrefillCall>,
        decode: DecodeCall,
        reservation: Reservation,
        tokens_before: u32,
        cached_prompt_tokens: Option<u32>,
    ) -> Result<(), RouterError> {
        let DecodeCall {
            node_id: decode_node,
            stream: mut decode_stream,
            span: decode_span,
        } = decode;
        let idle = self.inner.options.stream_idle_timeout;
        let (prefill_node, mut prefill_stream, prefill_open, stall_at) = match prefill {
            Some(PrefillCall {
                dispatch,
                node_id,
                stream,
                span,
                ..
            }) => (Some(node_id), Some(stream), Some((dispatch, span)), None),
            // The decode node computes the prompt: it is producing from the start.
            None => (None, None, None, Some(tokio::time::Instant::now() + idle)),
        };
        let mut f = Forwarding {
            prefill_node,
            decode_node,
            prefill_open,
            decode_span,
            reservation,
            tokens_before,
            tokens_here: 0,
            cached_prompt_tokens,
            idle,
            stall_at,
        };
        let result = loop {
            let stall_at = f.stall_at;
            let stall = async {
                match stall_at {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            let next = tokio::select! {
                () = stall => Next::End(Err(self.stalled(&f))),
                message = async { prefill_stream.as_mut().expect("open").message().await },
                    if f.prefill_open.is_some() => {
                    self.on_prefill(&mut f, message)
                }
                message = decode_stream.message() => self.on_decode(&mut f, message).await,
            };
            if let Next::End(result) = next {
                break result;
            }
        };
        if let Err(e) = &result
            && !matches!(e, RouterError::Cancelled)
        {
            f.decode_span.record("tandem.output_tokens", f.tokens_here);
            propagation::mark_error(&f.decode_span, e.kind(), e);
        }
        result
    }

    /// The decode node said nothing for the idle timeout while producing: it is avoided and
    /// the request moves on (retry or migration).
    fn stalled(&mut self, f: &Forwarding) -> RouterError {
        self.failed_decode.insert(f.decode_node.clone());
        RouterError::Node {
            role: Role::Decode,
            node_id: f.decode_node.clone(),
            step: Step::Decode,
            fault: NodeFault::Stalled,
            retry_safe: true,
            code: tonic::Code::DeadlineExceeded,
            message: format!("no message from the decode node for {:?}", f.idle),
        }
    }

    /// One message of the prefill stream after its first token: only `KvPushed` is expected
    /// (it ends the prefill span and the node's dispatch count, and arms the stall timer).
    fn on_prefill(
        &mut self,
        f: &mut Forwarding,
        message: Result<Option<pb::PrefillResponse>, tonic::Status>,
    ) -> Next {
        // Read only while a prefill node takes part (`prefill_open`).
        let prefill_node = f.prefill_node.clone().unwrap_or_default();
        let protocol = PrefillCall::protocol(&prefill_node);
        match message {
            Ok(Some(pb::PrefillResponse {
                event: Some(pb::prefill_response::Event::KvPushed(pushed)),
            })) => {
                if let Some((_, span)) = &f.prefill_open {
                    span.record("tandem.kv.bytes", pushed.bytes);
                    span.record("tandem.kv.blocks", pushed.blocks);
                    span.record("tandem.kv.transfer_us", pushed.transfer_us);
                }
                f.prefill_open = None;
                f.stall_at
                    .get_or_insert(tokio::time::Instant::now() + f.idle);
                Next::Continue
            }
            Ok(Some(_)) => Next::End(Err(protocol("sent a second first_token"))),
            Ok(None) => Next::End(Err(protocol("stream ended before kv_pushed"))),
            Err(status) => {
                self.failed_prefill.insert(prefill_node.clone());
                let e = RouterError::node(Role::Prefill, &prefill_node, Step::Prefill, &status);
                if let Some((_, span)) = &f.prefill_open {
                    propagation::mark_error(span, e.kind(), &e);
                }
                Next::End(Err(e))
            }
        }
    }

    /// One message of the decode stream: tokens go to the client (re-arming the stall timer, as
    /// a progress message does),
    /// the final message ends the attempt (the node freed the blocks: the reservation is disarmed),
    /// an error marks the node failed (and, for KV it refused, the prefill node that sent it).
    async fn on_decode(
        &mut self,
        f: &mut Forwarding,
        message: Result<Option<pb::DecodeResponse>, tonic::Status>,
    ) -> Next {
        let protocol = |what| RouterError::Protocol {
            role: Role::Decode,
            node_id: f.decode_node.clone(),
            step: Step::Decode,
            what,
        };
        match message {
            Ok(Some(pb::DecodeResponse {
                event: Some(pb::decode_response::Event::Tokens(batch)),
            })) => {
                f.stall_at = Some(tokio::time::Instant::now() + f.idle);
                // The decode node streams the whole output, the first token included.
                let token_ids = batch.token_ids;
                let want = if self.request.sampling.logprobs {
                    token_ids.len()
                } else {
                    0
                };
                if batch.logprobs.len() != want {
                    return Next::End(Err(protocol(
                        "a token batch whose logprobs do not match its tokens (one each when asked, else none)",
                    )));
                }
                f.tokens_here += token_ids.len() as u32;
                self.generated.extend_from_slice(&token_ids);
                let delta = GenerationEvent::Delta {
                    text: batch.text,
                    token_ids,
                    logprobs: batch.logprobs,
                };
                match self.send(delta).await {
                    Ok(()) => Next::Continue,
                    Err(e) => Next::End(Err(e)),
                }
            }
            Ok(Some(pb::DecodeResponse {
                event: Some(pb::decode_response::Event::Progress(_)),
            })) => {
                // The node is computing (or queueing) the prompt it took: alive, not stalled.
                f.stall_at = Some(tokio::time::Instant::now() + f.idle);
                Next::Continue
            }
            Ok(Some(pb::DecodeResponse {
                event: Some(pb::decode_response::Event::Final(done)),
            })) => {
                f.reservation.disarm();
                self.node_seconds.1 += done.node_seconds;
                let completion_tokens = done
                    .usage
                    .map(|u| u.completion_tokens)
                    .filter(|&n| n > 0)
                    .unwrap_or(f.tokens_here)
                    + f.tokens_before;
                f.decode_span.record("tandem.output_tokens", f.tokens_here);
                // A prompt the decode node computed: its own prefix cache's hits.
                let cached_prompt_tokens = *self.cached_prompt_tokens.get_or_insert(
                    f.cached_prompt_tokens
                        .unwrap_or_else(|| done.usage.map_or(0, |u| u.cached_prompt_tokens)),
                );
                let request = self.request;
                let last = GenerationEvent::Final(GenerationFinal {
                    finish_reason: FinishReason::from_proto(done.finish_reason),
                    usage: Usage {
                        prompt_tokens: request.prompt_tokens(),
                        cached_prompt_tokens,
                        completion_tokens,
                    },
                    request_id: request.request_id.clone(),
                });
                Next::End(self.send(last).await)
            }
            Ok(Some(_)) => Next::End(Err(protocol("sent an empty event"))),
            Ok(None) => {
                self.failed_decode.insert(f.decode_node.clone());
                Next::End(Err(protocol("stream ended without a final message")))
            }
            Err(status) => {
                self.failed_decode.insert(f.decode_node.clone());
                let e = RouterError::node(Role::Decode, &f.decode_node, Step::Decode, &status);
                if matches!(
                    e,
                    RouterError::Node {
                        fault: NodeFault::KvCorrupt,
                        ..
                    }
                ) {
                    // The decode node checked the KV and refused it: its sender is the suspect
                    // too, so the re-prefill avoids both while others exist.
                    if let Some(node) = &f.prefill_node {
                        self.failed_prefill.insert(node.clone());
                    }
                }
                Next::End(Err(e))
            }
        }
    }
}
