//! The simulated decode node (the prefill node is in `prefill.rs`) and what every simulated node
//! shares: the internal gRPC protocol served over turmoil's
//! network, with a deterministic fake model and the decode node's reservation accounting.
//!
//! The fake model (as in `common/fakes.rs`): after `n` tokens comes `next_token(n)`, so a stream
//! re-prefilled from prompt + output so far continues exactly, as greedy decoding would.
//!
//! ```text
//!  router ──Reserve──▶ decode (reservation: blocks, epoch, expiry) ◀──kv link (TCP :7000)── prefill
//!  router ──Prefill──▶ prefill: FirstToken, then pushes "KV" (reservation id + epoch) to the
//!                      decode node's kv link, then KvPushed
//!  router ──Decode───▶ decode: claims the reservation, waits for its KV, streams tokens
//! ```
//! Every status carries the labels real nodes send (`tandem-error-kind`, `tandem-retry-safe`).
//!
//! Invariants the nodes check and report as violations (never panic inside the simulation):
//! - a Reserve or Prefill arrives only while the node holds a live registration, or within
//!   [`LEASE_GRACE`] of losing it (calls already in flight when it was lost);
//! - no unclaimed reservation lives past its expiry (the sweep frees it; one found more than a
//!   sweep late is a violation).

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::Stream;
use tandem_cluster::{Discovery, MemoryDiscovery, NodeInfo, Role};
use tandem_kv_layout::{KvDtype, KvLayout};
use tandem_proto::v1 as pb;
use tandem_proto::v1::decode_server::{Decode, DecodeServer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{Notify, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Code, Request, Response, Status};

use super::net::incoming;

/// gRPC port of every simulated node.
pub const GRPC_PORT: u16 = 9000;
/// KV-link port of decode nodes.
pub const KV_PORT: u16 = 7000;
/// Tokens per KV block.
pub const BLOCK_TOKENS: u32 = 16;
/// KV blocks per decode node.
pub const CAPACITY_BLOCKS: u32 = 64;
/// How long an unclaimed reservation waits for its Decode call.
pub const RESERVATION_TTL: Duration = Duration::from_secs(2);
/// How often the decode node frees expired reservations.
pub const SWEEP: Duration = Duration::from_millis(50);
/// How long a cut-off node keeps its registration (the lease TTL).
pub const LEASE_TTL: Duration = Duration::from_secs(2);
/// Calls picked before a node lost its lease may still arrive this long after.
pub const LEASE_GRACE: Duration = Duration::from_millis(500);
/// Decode time per token.
pub const TOKEN_TIME: Duration = Duration::from_millis(5);

/// The fake model's token after a sequence of `len` tokens.
pub fn next_token(len: usize) -> u32 {
    100 + (len as u32 % 50)
}

/// The layout every simulated node registers.
pub fn layout() -> KvLayout {
    KvLayout::new(30, 3, 64, BLOCK_TOKENS as usize, KvDtype::F16, 7).expect("valid layout")
}

/// Simulated time now.
pub fn now() -> Duration {
    turmoil::sim_elapsed().unwrap_or_default()
}

/// What every host of one simulation shares (outside the simulated network: the test's
/// bookkeeping and the in-process control plane).
#[derive(Default)]
pub struct World {
    /// Invariant violations, as found.
    pub violations: Mutex<Vec<String>>,
    /// Nodes cut off from the control plane (a partition): their registration lapses after
    /// [`LEASE_TTL`] and comes back once they are joined again.
    pub cut_off: Mutex<HashMap<String, bool>>,
    /// Nodes whose lease was revoked (etcd expired it while they still run and are reachable):
    /// their registration goes at once and comes back when this is cleared.
    pub revoked: Mutex<HashMap<String, bool>>,
    /// When each node last lost its registration (`None`: registered).
    pub unregistered_since: Mutex<HashMap<String, Option<Duration>>>,
    /// Each decode node's reservation table (replaced when the node restarts).
    pub tables: Mutex<HashMap<String, Arc<Mutex<Table>>>>,
    /// Reservations freed because they expired unclaimed.
    pub expired: Mutex<u64>,
}

impl World {
    /// Records a violation.
    pub fn violation(&self, what: String) {
        self.violations
            .lock()
            .unwrap()
            .push(format!("t={:?}: {what}", now()));
    }

    pub(super) fn check_lease(&self, node: &str, call: &str) {
        if let Some(Some(since)) = self.unregistered_since.lock().unwrap().get(node)
            && now() > *since + LEASE_GRACE
        {
            self.violation(format!(
                "{call} reached {node}, whose registration lapsed at {since:?}: routed to a node without a live lease"
            ));
        }
    }

    /// Blocks reserved or used on `node` now.
    pub fn held_blocks(&self, node: &str) -> u32 {
        self.tables
            .lock()
            .unwrap()
            .get(node)
            .map_or(0, |t| t.lock().unwrap().used)
    }
}

pub(super) fn status(code: Code, message: &str, kind: &'static str, retry_safe: bool) -> Status {
    let mut s = Status::new(code, message);
    let md = s.metadata_mut();
    md.insert("tandem-error-kind", kind.parse().expect("ascii"));
    md.insert(
        "tandem-retry-safe",
        if retry_safe { "true" } else { "false" }
            .parse()
            .expect("ascii"),
    );
    s
}

/// Keeps `node` registered while it is not cut off, as a node's lease keep-alive would: a cut
/// lets the registration lapse after [`LEASE_TTL`]; joined again, it registers at once.
pub(super) async fn hold_registration(
    world: Arc<World>,
    discovery: MemoryDiscovery,
    info: NodeInfo,
) {
    let node = info.node_id.clone();
    let mut registration = None;
    let mut cut_since: Option<Duration> = None;
    loop {
        let cut = world
            .cut_off
            .lock()
            .unwrap()
            .get(&node)
            .copied()
            .unwrap_or(false);
        cut_since = if cut { cut_since.or(Some(now())) } else { None };
        let revoked = world
            .revoked
            .lock()
            .unwrap()
            .get(&node)
            .copied()
            .unwrap_or(false);
        let lapsed = revoked || cut_since.is_some_and(|since| now() >= since + LEASE_TTL);
        match (&registration, lapsed) {
            (None, false) => match discovery.register(info.clone()).await {
                Ok(r) => {
                    registration = Some(r);
                    world
                        .unregistered_since
                        .lock()
                        .unwrap()
                        .insert(node.clone(), None);
                }
                Err(e) => world.violation(format!("{node} could not register: {e}")),
            },
            (Some(_), true) => {
                // Dropping the handle removes the record (the lease expired).
                registration = None;
                world
                    .unregistered_since
                    .lock()
                    .unwrap()
                    .insert(node.clone(), Some(now()));
            }
            _ => {}
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// One reservation on a decode node.
#[derive(Debug)]
struct Held {
    epoch: u64,
    blocks: u32,
    expires: Duration,
    kv_ready: bool,
    claimed: bool,
}

/// A decode node's reservations and block accounting.
#[derive(Debug, Default)]
pub struct Table {
    held: HashMap<u64, Held>,
    /// Blocks reserved or used.
    pub used: u32,
    next_id: u64,
}

impl Table {
    fn free(&mut self, id: u64) -> bool {
        match self.held.remove(&id) {
            Some(h) => {
                self.used -= h.blocks;
                true
            }
            None => false,
        }
    }
}

struct DecodeNode {
    name: String,
    world: Arc<World>,
    table: Arc<Mutex<Table>>,
    kv: Arc<Notify>,
}

impl DecodeNode {
    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap()
    }
}

pub(super) type EventStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

/// The decode node's gRPC service.
#[derive(Clone)]
struct DecodeSvc(Arc<DecodeNode>);

impl std::ops::Deref for DecodeSvc {
    type Target = DecodeNode;
    fn deref(&self) -> &DecodeNode {
        &self.0
    }
}

#[tonic::async_trait]
impl Decode for DecodeSvc {
    async fn reserve(
        &self,
        request: Request<pb::ReserveRequest>,
    ) -> Result<Response<pb::ReserveResponse>, Status> {
        self.world.check_lease(&self.name, "Reserve");
        let r = request.into_inner();
        let blocks = (r.prompt_tokens + r.max_new_tokens).div_ceil(BLOCK_TOKENS);
        let mut t = self.lock();
        if t.used + blocks > CAPACITY_BLOCKS {
            return Err(status(
                Code::ResourceExhausted,
                "no free blocks",
                "out_of_blocks",
                true,
            ));
        }
        t.next_id += 1;
        let id = t.next_id;
        t.used += blocks;
        t.held.insert(
            id,
            Held {
                epoch: 1,
                blocks,
                expires: now() + RESERVATION_TTL,
                kv_ready: false,
                claimed: false,
            },
        );
        Ok(Response::new(pb::ReserveResponse {
            target: Some(pb::KvTarget {
                decode_node_id: self.name.clone(),
                kv_address: format!("{}:{KV_PORT}", self.name),
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
        let r = request.into_inner();
        let mut t = self.lock();
        let ours = t
            .held
            .get(&r.reservation_id)
            .is_some_and(|h| h.epoch == r.epoch && !h.claimed);
        let released = ours && t.free(r.reservation_id);
        Ok(Response::new(pb::ReleaseResponse { released }))
    }

    type DecodeStream = EventStream<pb::DecodeResponse>;

    async fn decode(
        &self,
        request: Request<pb::DecodeRequest>,
    ) -> Result<Response<Self::DecodeStream>, Status> {
        let r = request.into_inner();
        let id = r.reservation_id;
        let expires = {
            let mut t = self.lock();
            match t.held.get_mut(&id) {
                Some(h) if h.epoch == r.epoch && !h.claimed => {
                    h.claimed = true;
                    h.expires
                }
                _ => {
                    return Err(status(
                        Code::NotFound,
                        "unknown or expired reservation",
                        "unknown_reservation",
                        true,
                    ));
                }
            }
        };
        let (tx, rx) = mpsc::channel(4);
        let node = Arc::clone(&self.0);
        tokio::spawn(async move {
            // The KV must land before the reservation would have expired.
            loop {
                let notified = node.kv.notified();
                if node.lock().held.get(&id).is_some_and(|h| h.kv_ready) {
                    break;
                }
                let left = expires.saturating_sub(now());
                if left.is_zero() || tokio::time::timeout(left, notified).await.is_err() {
                    node.lock().free(id);
                    let _ = tx
                        .send(Err(status(
                            Code::DataLoss,
                            "KV never arrived",
                            "incomplete_kv",
                            true,
                        )))
                        .await;
                    return;
                }
            }
            let prompt = r.prompt_token_ids.len();
            let max_tokens = r.sampling.map_or(1, |s| s.max_tokens).max(1);
            for i in 0..max_tokens as usize {
                let id_i = if i == 0 {
                    r.first_token_id
                } else {
                    next_token(prompt + i)
                };
                tokio::time::sleep(TOKEN_TIME).await;
                let batch = pb::DecodeResponse {
                    event: Some(pb::decode_response::Event::Tokens(pb::TokenBatch {
                        token_ids: vec![id_i],
                        text: format!("t{id_i} "),
                        logprobs: Vec::new(),
                    })),
                };
                if tx.send(Ok(batch)).await.is_err() {
                    node.lock().free(id); // the caller went away
                    return;
                }
            }
            node.lock().free(id);
            let _ = tx
                .send(Ok(pb::DecodeResponse {
                    event: Some(pb::decode_response::Event::Final(pb::DecodeFinal {
                        finish_reason: pb::FinishReason::Length as i32,
                        usage: Some(pb::Usage {
                            prompt_tokens: prompt as u32,
                            cached_prompt_tokens: 0,
                            completion_tokens: max_tokens,
                        }),
                        node_seconds: 0.0,
                    })),
                }))
                .await;
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// Frees reservations that expired unclaimed, and checks none lived past a sweep late.
async fn sweep(node: Arc<DecodeNode>) {
    loop {
        tokio::time::sleep(SWEEP).await;
        let t_now = now();
        let mut t = node.lock();
        let expired: Vec<(u64, Duration)> = t
            .held
            .iter()
            .filter(|(_, h)| !h.claimed && t_now >= h.expires)
            .map(|(&id, h)| (id, h.expires))
            .collect();
        for (id, expires) in expired {
            if t_now > expires + SWEEP * 2 {
                node.world.violation(format!(
                    "{}: reservation {id} outlived its expiry ({expires:?})",
                    node.name
                ));
            }
            t.free(id);
            *node.world.expired.lock().unwrap() += 1;
        }
    }
}

/// The KV link: a push is the reservation id and epoch (16 bytes); the answer one byte (1:
/// landed, 0: refused: unknown, expired or already claimed by a failed attempt).
async fn kv_link(node: Arc<DecodeNode>) -> std::io::Result<()> {
    let listener = turmoil::net::TcpListener::bind(("0.0.0.0", KV_PORT)).await?;
    loop {
        let (mut s, _) = listener.accept().await?;
        let node = Arc::clone(&node);
        tokio::spawn(async move {
            let mut buf = [0u8; 16];
            if s.read_exact(&mut buf).await.is_err() {
                return;
            }
            let id = u64::from_le_bytes(buf[..8].try_into().unwrap());
            let epoch = u64::from_le_bytes(buf[8..].try_into().unwrap());
            let ok = {
                let mut t = node.lock();
                match t.held.get_mut(&id) {
                    Some(h) if h.epoch == epoch && now() < h.expires => {
                        h.kv_ready = true;
                        true
                    }
                    _ => false,
                }
            };
            node.kv.notify_waiters();
            let _ = s.write_all(&[u8::from(ok)]).await;
        });
    }
}

/// A decode node's software (run again from scratch when the host restarts).
pub async fn decode_main(
    name: String,
    world: Arc<World>,
    discovery: MemoryDiscovery,
) -> turmoil::Result {
    let table = Arc::new(Mutex::new(Table::default()));
    world
        .tables
        .lock()
        .unwrap()
        .insert(name.clone(), Arc::clone(&table));
    let node = Arc::new(DecodeNode {
        name: name.clone(),
        world: Arc::clone(&world),
        table,
        kv: Arc::new(Notify::new()),
    });
    let listener = turmoil::net::TcpListener::bind(("0.0.0.0", GRPC_PORT)).await?;
    tokio::spawn(sweep(Arc::clone(&node)));
    tokio::spawn(kv_link(Arc::clone(&node)));
    let info = NodeInfo::new(
        &name,
        Role::Decode,
        format!("http://{name}:{GRPC_PORT}"),
        layout(),
        u64::from(CAPACITY_BLOCKS),
    )
    .with_kv_transfer_addr(format!("{name}:{KV_PORT}"));
    tokio::spawn(hold_registration(Arc::clone(&world), discovery, info));
    tonic::transport::Server::builder()
        .add_service(DecodeServer::new(DecodeSvc(node)))
        .serve_with_incoming(incoming(listener))
        .await?;
    Ok(())
}
