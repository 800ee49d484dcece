//! [`AttemptState::reserve`]: the first step of an attempt, KV blocks reserved on a decode node.
//!
//! Invariants: each decode node is asked at most once per attempt; nodes whose Decode failed for
//! this request are avoided while others exist; refusals for lack of blocks are counted and,
//! when every node refused, reported as `NoCapacity` rather than as the last node's error; a
//! grant is never lost to a caller that goes away mid-call (the call runs in its own task, which
//! turns the grant into a [`Reservation`] that releases itself when nobody takes it).

use std::sync::Arc;

use tandem_cluster::Role;
use tandem_proto::v1 as pb;
use tandem_proto::v1::decode_client::DecodeClient;
use tandem_telemetry::trace::propagation;
use tracing::Instrument;

use super::{AttemptState, call_metadata};
use crate::error::{RouterError, Step};
use crate::pipeline::reservation::Reservation;
use crate::routing::Demand;
use crate::stats::bump;

impl AttemptState<'_> {
    /// Picks decode nodes until one grants a reservation; each node is asked at most once.
    pub(super) async fn reserve(
        &mut self,
        demand: Demand,
        prompt_tokens: u32,
        max_new_tokens: u32,
    ) -> Result<Reservation, RouterError> {
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
            let channel = match dispatch.node().channel() {
                Ok(channel) => channel,
                Err(e) => {
                    // Unreachable as registered (a bad address, TLS the router cannot speak):
                    // this attempt asks the next node.
                    tracing::warn!(request_id = %request.request_id, error = %e, "decode node unreachable as registered");
                    last_error = Some(e);
                    continue;
                }
            };
            let mut client = DecodeClient::new(channel);
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
            // The call runs in a task of its own, which makes the node's grant a `Reservation`
            // as soon as it arrives: a caller that goes away while the call is in flight (its
            // client cancelled) drops the task's result, not the answer, so the blocks the node
            // granted are released at once instead of staying reserved until they expire.
            let (rpc_timeout, stats) = (inner.options.rpc_timeout, Arc::clone(&inner.stats));
            let call_span = span.clone();
            let granted = tokio::spawn(async move {
                let reply = client.reserve(call).instrument(call_span).await?.into_inner();
                Ok::<_, tonic::Status>(reply.target.map(|target| {
                    let expires = reply.expires_at_unix_ms;
                    Reservation::new(dispatch, client, target, expires, rpc_timeout, stats)
                }))
            })
            .await
            .unwrap_or_else(|e| match e.try_into_panic() {
                Ok(panic) => std::panic::resume_unwind(panic),
                Err(_) => Err(tonic::Status::cancelled("the router is shutting down")),
            });
            match granted {
                Ok(Some(reservation)) => {
                    span.record("tandem.reservation_id", reservation.target().reservation_id);
                    return Ok(reservation);
                }
                Ok(None) => {
                    last_error = Some(RouterError::Protocol {
                        role: Role::Decode,
                        node_id,
                        step: Step::Reserve,
                        what: "reserve answered without a target",
                    });
                    continue;
                }
                Err(status) => {
                    let error = RouterError::node(Role::Decode, &node_id, Step::Reserve, &status);
                    propagation::mark_error(&span, error.kind(), &error);
                    tracing::debug!(request_id = %request.request_id, %error, "reserve refused");
                    if matches!(
                        status.code(),
                        tonic::Code::Cancelled
                            | tonic::Code::DeadlineExceeded
                            | tonic::Code::Unavailable
                            | tonic::Code::Unknown
                    ) {
                        // No answer: the node may have granted blocks nobody will name.
                        bump(&inner.stats.reserve_unanswered);
                    }
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
