//! The simulated prefill node: computes a first token with the fake model, pushes the "KV"
//! (the reservation id and epoch) over the decode node's KV link, and reports `KvPushed` or the
//! push's failure with the labels a real prefill node sends.

use std::sync::Arc;
use std::time::Duration;

use tandem_cluster::{MemoryDiscovery, NodeInfo, Role};
use tandem_proto::v1 as pb;
use tandem_proto::v1::prefill_server::{Prefill, PrefillServer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Code, Request, Response, Status};

use super::net::incoming;
use super::nodes::{EventStream, GRPC_PORT, World, hold_registration, layout, next_token, status};

struct PrefillNode {
    name: String,
    world: Arc<World>,
}

/// The prefill node's gRPC service.
#[derive(Clone)]
struct PrefillSvc(Arc<PrefillNode>);

/// Pushes the "KV" of a reservation to its decode node; `Err` with the status to report.
async fn push(target: &pb::KvTarget) -> Result<(), Status> {
    let unreachable = |e: std::io::Error| {
        status(
            Code::Unavailable,
            &format!("KV push: {e}"),
            "peer_gone",
            true,
        )
    };
    let attempt = async {
        let mut s = turmoil::net::TcpStream::connect(target.kv_address.as_str())
            .await
            .map_err(unreachable)?;
        let mut msg = target.reservation_id.to_le_bytes().to_vec();
        msg.extend_from_slice(&target.epoch.to_le_bytes());
        s.write_all(&msg).await.map_err(unreachable)?;
        let mut ack = [0u8; 1];
        s.read_exact(&mut ack).await.map_err(unreachable)?;
        if ack[0] == 1 {
            Ok(())
        } else {
            Err(status(
                Code::Aborted,
                "reservation refused the KV",
                "reservation_expired",
                true,
            ))
        }
    };
    match tokio::time::timeout(Duration::from_secs(1), attempt).await {
        Ok(r) => r,
        Err(_) => Err(status(
            Code::Unavailable,
            "KV push timed out",
            "deadline_exceeded",
            true,
        )),
    }
}

#[tonic::async_trait]
impl Prefill for PrefillSvc {
    type PrefillStream = EventStream<pb::PrefillResponse>;

    async fn prefill(
        &self,
        request: Request<pb::PrefillRequest>,
    ) -> Result<Response<Self::PrefillStream>, Status> {
        self.0.world.check_lease(&self.0.name, "Prefill");
        let r = request.into_inner();
        let target = r.target.ok_or_else(|| {
            status(
                Code::InvalidArgument,
                "target is required",
                "invalid",
                false,
            )
        })?;
        let name = self.0.name.clone();
        let granted = self.0.world.with_life(
            &target.decode_node_id,
            target.epoch,
            target.reservation_id,
            |life| life.prefills.push(name),
        );
        if !granted {
            self.0.world.violation(format!(
                "Prefill to {} with reservation {} epoch {} of {}, which that node never granted",
                self.0.name, target.reservation_id, target.epoch, target.decode_node_id
            ));
        }
        let (tx, rx) = mpsc::channel(4);
        tokio::spawn(async move {
            // Compute: 1 ms per 16 prompt tokens.
            let prompt = r.prompt_token_ids.len();
            tokio::time::sleep(Duration::from_millis(1 + prompt as u64 / 16)).await;
            let first = pb::PrefillResponse {
                event: Some(pb::prefill_response::Event::FirstToken(pb::FirstToken {
                    token_id: next_token(prompt),
                    cached_prompt_tokens: 0,
                    node_seconds: 0.0,
                    logprob: None,
                })),
            };
            if tx.send(Ok(first)).await.is_err() {
                return;
            }
            let event = match push(&target).await {
                Ok(()) => Ok(pb::PrefillResponse {
                    event: Some(pb::prefill_response::Event::KvPushed(pb::KvPushed {
                        bytes: 1024,
                        blocks: target.block_ids.len() as u32,
                        transfer_us: 10,
                    })),
                }),
                Err(s) => Err(s),
            };
            let _ = tx.send(event).await;
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// A prefill node's software.
pub async fn prefill_main(
    name: String,
    world: Arc<World>,
    discovery: MemoryDiscovery,
) -> turmoil::Result {
    world.restart(&name);
    let node = PrefillSvc(Arc::new(PrefillNode {
        name: name.clone(),
        world: Arc::clone(&world),
    }));
    let listener = turmoil::net::TcpListener::bind(("0.0.0.0", GRPC_PORT)).await?;
    let info = NodeInfo::new(
        &name,
        Role::Prefill,
        format!("http://{name}:{GRPC_PORT}"),
        layout(),
        1024,
    );
    tokio::spawn(hold_registration(Arc::clone(&world), discovery, info));
    tonic::transport::Server::builder()
        .add_service(PrefillServer::new(node))
        .serve_with_incoming(incoming(listener))
        .await?;
    Ok(())
}
