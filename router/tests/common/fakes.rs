//! Fake prefill and decode nodes: real tonic servers on port 0 implementing the internal proto
//! with deterministic canned tokens, plus knobs to inject failures and hold streams, and
//! counters/notifications of what they observed (calls, releases, cancellations).
//!
//! Canned output, a fake "model" whose next token depends only on the sequence length: after
//! `n` tokens comes `next_token(n) = 100 + n % 50`. The prefill node's first token is
//! `next_token(prompt.len())`; the decode node streams `max_tokens` tokens from there (the
//! first one included, one per batch; computed itself when asked to `prefill_here`), each with
//! the text `t{id} `, and finishes with `length`.
//! So a stream re-prefilled from prompt + output so far continues exactly (as greedy decoding
//! of a real model would).

use std::pin::Pin;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicI64, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use futures_util::Stream;
use tandem_cluster::{NodeInfo, Role};
use tandem_kv_layout::{KvDtype, KvLayout};
use tandem_proto::v1 as pb;
use tandem_proto::v1::decode_server::{Decode, DecodeServer};
use tandem_proto::v1::prefill_server::{Prefill, PrefillServer};
use tokio::net::TcpListener;
use tokio::sync::{Notify, mpsc};
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

/// KV block size of the fake nodes' layout, in tokens.
pub const BLOCK_TOKENS: usize = 16;

/// The layout every fake node registers.
pub fn layout() -> KvLayout {
    KvLayout::new(30, 3, 64, BLOCK_TOKENS, KvDtype::F16, 7).expect("valid layout")
}

/// The fake model's token after a sequence of `len` tokens.
pub fn next_token(len: usize) -> u32 {
    100 + (len as u32 % 50)
}

/// The first token the fake prefill node samples for `prompt`.
pub fn first_token(prompt: &[u32]) -> u32 {
    next_token(prompt.len())
}

/// The log probability the fake nodes report for `id` (with one alternative, itself).
pub fn fake_logprob(id: u32) -> pb::TokenLogprob {
    let logprob = -(id as f32) / 1000.0;
    pb::TokenLogprob {
        token_id: id,
        logprob,
        top: vec![pb::TopLogprob {
            token_id: id,
            logprob,
        }],
    }
}

/// The text of a canned token.
pub fn token_text(id: u32) -> String {
    format!("t{id} ")
}

/// The whole canned output for a prompt of `prompt_len` tokens and `max_tokens`.
pub fn expected_output(prompt_len: usize, max_tokens: u32) -> (Vec<u32>, String) {
    let ids: Vec<u32> = (0..max_tokens as usize)
        .map(|i| next_token(prompt_len + i))
        .collect();
    let text = ids.iter().map(|&id| token_text(id)).collect();
    (ids, text)
}

type EventStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

/// What a fake decode node saw, and how it misbehaves.
#[derive(Debug, Default)]
pub struct DecodeBehaviour {
    /// Reserve calls answered (granted or refused).
    pub reserve_calls: AtomicU32,
    /// Decode calls received.
    pub decode_calls: AtomicU32,
    /// Of those, calls asking this node to compute the prompt itself (`prefill_here`).
    pub prefill_here_calls: AtomicU32,
    /// Reservation ids released (Release calls).
    pub released: Mutex<Vec<u64>>,
    /// Decode streams that saw their caller go away before finishing.
    pub cancelled_streams: AtomicU32,
    /// Decode streams that finished.
    pub completed_streams: AtomicU32,
    /// Refuse the next N Reserve calls with RESOURCE_EXHAUSTED.
    pub refuse_reserves: AtomicU32,
    /// Fail the next N Decode calls with DATA_LOSS (a corrupt transfer).
    pub data_loss: AtomicU32,
    /// Fail the next stream with UNAVAILABLE after this many batches (-1: never): the node
    /// dying mid-stream.
    pub fail_after_batches: AtomicI64,
    /// Hold every stream after this many batches (-1: never) until `resume` or cancellation.
    pub hold_after_batches: AtomicI64,
    /// A prompt computed here (`prefill_here`) takes this long before its first token (ms).
    pub compute_prompt_ms: AtomicU64,
    /// While computing such a prompt, a `DecodeProgress` every this many ms (0: silent).
    pub progress_every_ms: AtomicU64,
    /// Wakes held streams.
    pub resume: Notify,
    /// Streams that reached their hold point.
    pub held: AtomicU32,
    /// Notified when a stream holds.
    pub holding: Notify,
    /// Notified on every Release and every cancelled stream.
    pub changed: Notify,
    next_reservation: AtomicU64,
}

/// What a fake prefill node saw, and how it misbehaves.
#[derive(Debug, Default)]
pub struct PrefillBehaviour {
    /// Prefill calls received.
    pub prefill_calls: AtomicU32,
    /// Streams that saw their caller go away before finishing.
    pub cancelled_streams: AtomicU32,
    /// Fail the next N calls with UNAVAILABLE before the first token.
    pub fail_before_first: AtomicU32,
    /// Hold every stream before the first token (until cancelled) when nonzero.
    pub hold_before_first: AtomicU32,
    /// Streams that reached their hold point.
    pub held: AtomicU32,
    /// Notified when a stream holds.
    pub holding: Notify,
    /// Notified when a stream is cancelled.
    pub changed: Notify,
}

/// A running fake node.
pub struct FakeNode<B> {
    /// Its node id.
    pub node_id: String,
    /// Its role.
    pub role: Role,
    /// `http://127.0.0.1:port`.
    pub grpc_addr: String,
    /// Observations and knobs.
    pub behaviour: Arc<B>,
    stop: CancellationToken,
}

impl<B> FakeNode<B> {
    /// The record to register in discovery.
    pub fn info(&self) -> NodeInfo {
        NodeInfo::new(&self.node_id, self.role, &self.grpc_addr, layout(), 1024)
            .with_kv_transfer_addr("tcp://127.0.0.1:1")
    }
}

impl<B> Drop for FakeNode<B> {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

#[derive(Clone)]
struct DecodeService {
    node_id: String,
    b: Arc<DecodeBehaviour>,
}

fn take_one(counter: &AtomicU32) -> bool {
    counter
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok()
}

#[tonic::async_trait]
impl Decode for DecodeService {
    async fn reserve(
        &self,
        request: Request<pb::ReserveRequest>,
    ) -> Result<Response<pb::ReserveResponse>, Status> {
        self.b.reserve_calls.fetch_add(1, Ordering::SeqCst);
        if take_one(&self.b.refuse_reserves) {
            return Err(Status::resource_exhausted("no free blocks (fake)"));
        }
        let r = request.into_inner();
        let id = self.b.next_reservation.fetch_add(1, Ordering::SeqCst) + 1;
        let blocks = (r.prompt_tokens as usize).div_ceil(BLOCK_TOKENS) as u32;
        Ok(Response::new(pb::ReserveResponse {
            target: Some(pb::KvTarget {
                decode_node_id: self.node_id.clone(),
                kv_address: "tcp://127.0.0.1:1".into(),
                reservation_id: id,
                epoch: 1,
                block_ids: (0..blocks).collect(),
                layout_fingerprint: layout().fingerprint(),
            }),
            expires_at_unix_ms: u64::MAX,
        }))
    }

    async fn release(
        &self,
        request: Request<pb::ReleaseRequest>,
    ) -> Result<Response<pb::ReleaseResponse>, Status> {
        self.b
            .released
            .lock()
            .unwrap()
            .push(request.into_inner().reservation_id);
        self.b.changed.notify_waiters();
        Ok(Response::new(pb::ReleaseResponse { released: true }))
    }

    type DecodeStream = EventStream<pb::DecodeResponse>;

    async fn decode(
        &self,
        request: Request<pb::DecodeRequest>,
    ) -> Result<Response<Self::DecodeStream>, Status> {
        self.b.decode_calls.fetch_add(1, Ordering::SeqCst);
        if take_one(&self.b.data_loss) {
            return Err(Status::data_loss("block 0 failed its checksum (fake)"));
        }
        let r = request.into_inner();
        if r.prefill_here {
            self.b.prefill_here_calls.fetch_add(1, Ordering::SeqCst);
        }
        let max_tokens = r.sampling.as_ref().map(|s| s.max_tokens).unwrap_or(1).max(1);
        let logprobs = r.sampling.as_ref().is_some_and(|s| s.logprobs);
        let first_logprob = r.first_token_logprob.clone();
        let (tx, rx) = mpsc::channel(4);
        let b = Arc::clone(&self.b);
        let prompt_tokens = r.prompt_token_ids.len() as u32;
        let prefill_here = r.prefill_here;
        tokio::spawn(async move {
            let compute = Duration::from_millis(b.compute_prompt_ms.load(Ordering::SeqCst));
            if prefill_here && !compute.is_zero() {
                let every = Duration::from_millis(b.progress_every_ms.load(Ordering::SeqCst));
                let until = tokio::time::Instant::now() + compute;
                let mut computed = 0;
                while tokio::time::Instant::now() < until {
                    let left = until - tokio::time::Instant::now();
                    tokio::time::sleep(if every.is_zero() { left } else { every.min(left) }).await;
                    if !every.is_zero() {
                        computed = (computed + 1).min(prompt_tokens);
                        let progress = pb::DecodeResponse {
                            event: Some(pb::decode_response::Event::Progress(pb::DecodeProgress {
                                prompt_tokens_computed: computed,
                            })),
                        };
                        if tx.send(Ok(progress)).await.is_err() {
                            b.cancelled_streams.fetch_add(1, Ordering::SeqCst);
                            b.changed.notify_waiters();
                            return;
                        }
                    }
                }
            }
            let hold_at = b.hold_after_batches.load(Ordering::SeqCst);
            let fail_at = b.fail_after_batches.swap(-1, Ordering::SeqCst);
            for i in 0..max_tokens {
                if i as i64 == fail_at {
                    let _ = tx
                        .send(Err(Status::unavailable("node stopping (fake)")))
                        .await;
                    return;
                }
                if i as i64 == hold_at {
                    b.held.fetch_add(1, Ordering::SeqCst);
                    b.holding.notify_waiters();
                    tokio::select! {
                        _ = b.resume.notified() => {}
                        _ = tx.closed() => {
                            b.cancelled_streams.fetch_add(1, Ordering::SeqCst);
                            b.changed.notify_waiters();
                            return;
                        }
                    }
                }
                let id = if i == 0 && !r.prefill_here {
                    r.first_token_id
                } else {
                    next_token(prompt_tokens as usize + i as usize)
                };
                let logprob = match (logprobs, i) {
                    (false, _) => None,
                    (true, 0) => Some(first_logprob.clone().unwrap_or_else(|| fake_logprob(id))),
                    (true, _) => Some(fake_logprob(id)),
                };
                let batch = pb::DecodeResponse {
                    event: Some(pb::decode_response::Event::Tokens(pb::TokenBatch {
                        token_ids: vec![id],
                        text: token_text(id),
                        logprobs: logprob.into_iter().collect(),
                    })),
                };
                if tx.send(Ok(batch)).await.is_err() {
                    b.cancelled_streams.fetch_add(1, Ordering::SeqCst);
                    b.changed.notify_waiters();
                    return;
                }
            }
            let done = pb::DecodeResponse {
                event: Some(pb::decode_response::Event::Final(pb::DecodeFinal {
                    finish_reason: pb::FinishReason::Length as i32,
                    usage: Some(pb::Usage {
                        prompt_tokens,
                        cached_prompt_tokens: r.cached_prompt_tokens,
                        completion_tokens: max_tokens,
                    }),
                    node_seconds: 0.001 * f64::from(max_tokens),
                })),
            };
            if tx.send(Ok(done)).await.is_ok() {
                b.completed_streams.fetch_add(1, Ordering::SeqCst);
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

#[derive(Clone)]
struct PrefillService {
    b: Arc<PrefillBehaviour>,
}

#[tonic::async_trait]
impl Prefill for PrefillService {
    type PrefillStream = EventStream<pb::PrefillResponse>;

    async fn prefill(
        &self,
        request: Request<pb::PrefillRequest>,
    ) -> Result<Response<Self::PrefillStream>, Status> {
        self.b.prefill_calls.fetch_add(1, Ordering::SeqCst);
        if take_one(&self.b.fail_before_first) {
            return Err(Status::unavailable("engine restarting (fake)"));
        }
        let r = request.into_inner();
        let target = r
            .target
            .ok_or_else(|| Status::invalid_argument("target is required"))?;
        if target.layout_fingerprint != layout().fingerprint() {
            return Err(Status::failed_precondition("layout mismatch"));
        }
        let (tx, rx) = mpsc::channel(4);
        let b = Arc::clone(&self.b);
        tokio::spawn(async move {
            if b.hold_before_first.load(Ordering::SeqCst) > 0 {
                b.held.fetch_add(1, Ordering::SeqCst);
                b.holding.notify_waiters();
                tx.closed().await;
                b.cancelled_streams.fetch_add(1, Ordering::SeqCst);
                b.changed.notify_waiters();
                return;
            }
            let first = pb::PrefillResponse {
                event: Some(pb::prefill_response::Event::FirstToken(pb::FirstToken {
                    token_id: first_token(&r.prompt_token_ids),
                    cached_prompt_tokens: 0,
                    node_seconds: 0.002,
                    logprob: r
                        .sampling
                        .as_ref()
                        .filter(|s| s.logprobs)
                        .map(|_| fake_logprob(first_token(&r.prompt_token_ids))),
                })),
            };
            let pushed = pb::PrefillResponse {
                event: Some(pb::prefill_response::Event::KvPushed(pb::KvPushed {
                    bytes: 1024,
                    blocks: target.block_ids.len() as u32,
                    transfer_us: 10,
                })),
            };
            for event in [first, pushed] {
                if tx.send(Ok(event)).await.is_err() {
                    b.cancelled_streams.fetch_add(1, Ordering::SeqCst);
                    b.changed.notify_waiters();
                    return;
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// A tonic server builder, over TLS when `tls` is given.
fn server(tls: Option<tonic::transport::ServerTlsConfig>) -> tonic::transport::Server {
    let builder = tonic::transport::Server::builder();
    match tls {
        Some(tls) => builder.tls_config(tls).expect("the test's TLS configuration"),
        None => builder,
    }
}

/// `http://127.0.0.1:PORT`, or `https://localhost:PORT` for a TLS node (its certificate names
/// localhost).
fn with_scheme(addr: String, tls: bool) -> String {
    if tls {
        addr.replace("http://127.0.0.1", "https://localhost")
    } else {
        addr
    }
}

async fn bind() -> (TcpListener, String) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind port 0");
    let addr = format!("http://{}", listener.local_addr().unwrap());
    (listener, addr)
}

/// A [`MemoryCluster`](super::MemoryCluster) with one fake prefill node `p0` and one fake
/// decode node `d0`, registered; keep the returned nodes alive while the test runs.
pub async fn cluster_with_one_pair() -> (super::MemoryCluster, Vec<Box<dyn std::any::Any>>) {
    let mut cluster = super::MemoryCluster::new();
    let p = start_prefill("p0").await;
    let d = start_decode("d0").await;
    cluster.register(p.info()).await;
    cluster.register(d.info()).await;
    (cluster, vec![Box::new(p), Box::new(d)])
}

/// Starts a fake decode node.
pub async fn start_decode(node_id: &str) -> FakeNode<DecodeBehaviour> {
    start_decode_with(node_id, None).await
}

/// Starts a fake decode node, serving gRPC over TLS with `tls` when given (registered as
/// `https://localhost:PORT`).
pub async fn start_decode_with(
    node_id: &str,
    tls: Option<tonic::transport::ServerTlsConfig>,
) -> FakeNode<DecodeBehaviour> {
    let (listener, grpc_addr) = bind().await;
    let grpc_addr = with_scheme(grpc_addr, tls.is_some());
    let behaviour = Arc::new(DecodeBehaviour {
        hold_after_batches: AtomicI64::new(-1),
        fail_after_batches: AtomicI64::new(-1),
        ..Default::default()
    });
    let stop = CancellationToken::new();
    let service = DecodeService {
        node_id: node_id.to_string(),
        b: Arc::clone(&behaviour),
    };
    let token = stop.clone();
    tokio::spawn(async move {
        server(tls)
            .add_service(DecodeServer::new(service))
            .serve_with_incoming_shutdown(TcpListenerStream::new(listener), token.cancelled_owned())
            .await
            .expect("fake decode server");
    });
    FakeNode {
        node_id: node_id.to_string(),
        role: Role::Decode,
        grpc_addr,
        behaviour,
        stop,
    }
}

/// Starts a fake prefill node.
pub async fn start_prefill(node_id: &str) -> FakeNode<PrefillBehaviour> {
    start_prefill_with(node_id, None).await
}

/// Starts a fake prefill node, over TLS with `tls` when given.
pub async fn start_prefill_with(
    node_id: &str,
    tls: Option<tonic::transport::ServerTlsConfig>,
) -> FakeNode<PrefillBehaviour> {
    let (listener, grpc_addr) = bind().await;
    let grpc_addr = with_scheme(grpc_addr, tls.is_some());
    let behaviour = Arc::new(PrefillBehaviour::default());
    let stop = CancellationToken::new();
    let service = PrefillService {
        b: Arc::clone(&behaviour),
    };
    let token = stop.clone();
    tokio::spawn(async move {
        server(tls)
            .add_service(PrefillServer::new(service))
            .serve_with_incoming_shutdown(TcpListenerStream::new(listener), token.cancelled_owned())
            .await
            .expect("fake prefill server");
    });
    FakeNode {
        node_id: node_id.to_string(),
        role: Role::Prefill,
        grpc_addr,
        behaviour,
        stop,
    }
}
