//! [`AttemptState::reserve`]: the first step of an attempt, KV blocks reserved on a decode node.
//!
//! Invariants: each decode node is asked at most once per attempt; nodes whose Decode failed for
//! this request are avoided while others exist; refusals for lack of blocks are counted and,
//! when every node refused, reported as `NoCapacity` rather than as the last node's error.

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
                    return Ok(Reservation::new(
                        dispatch,
                        client,
                        target,
                        inner.options.rpc_timeout,
                        std::sync::Arc::clone(&inner.stats),
                    ));
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
