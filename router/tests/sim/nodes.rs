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
//! - a Release names a reservation this node made (in this boot or an earlier one).
//!
//! The nodes also keep the [`Ledger`]: every reservation a decode node granted, what the router
//! did with it (claimed it with a Decode call, released it, and how many times) and how its
//! blocks were freed (released, its stream ended, expired unclaimed, lost in a crash). The
//! router's duties are judged from it after the load (`sim/mod.rs`), not from the node's own
//! expiry sweep, which only stands for what a real node does with a reservation nobody claims.
//! Each boot of a decode node numbers its reservations afresh under a new epoch (the boot
//! count), so a Release from before a crash can never free a reservation made after it.

use std::collections::{BTreeMap, HashMap};
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

/// How a decode node freed a reservation's blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Freed {
    /// The router's Release arrived while it was unclaimed.
    Released,
    /// The Decode stream that claimed it streamed every token: the router owes no Release.
    Finished,
    /// The Decode stream that claimed it ended early (its KV never came, or its caller went).
    StreamEnded,
    /// Nobody claimed or released it before its expiry: the node's sweep freed it.
    Expired,
    /// The node crashed with it (the blocks went with the process).
    Crashed,
}

/// One reservation's life, as its decode node saw it (kept after it is freed).
#[derive(Clone, Debug)]
pub struct Life {
    /// When the Reserve was granted.
    pub created: Duration,
    /// When it expires unless claimed.
    pub expires: Duration,
    /// When a Decode call claimed it (the router handed it on to a stream).
    pub claimed: Option<Duration>,
    /// When each Release for it arrived.
    pub releases: Vec<Duration>,
    /// Prefill nodes that were sent it as their KV target.
    pub prefills: Vec<String>,
    /// When and how the node freed its blocks (`None`: still held).
    pub freed: Option<(Duration, Freed)>,
}

/// Every reservation of a simulation, by (decode node, epoch, reservation id).
pub type Ledger = BTreeMap<(String, u64, u64), Life>;

/// What every host of one simulation shares (outside the simulated network: the test's
/// bookkeeping and the in-process control plane).
#[derive(Default)]
pub struct World {
    /// Invariant violations, as found.
    pub violations: Mutex<Vec<String>>,
    /// Nodes cut off from the control plane, with how many partitions cut each (overlapping
    /// faults compose): their registration lapses after [`LEASE_TTL`] and comes back once no
    /// partition holds them.
    pub cut_off: Mutex<HashMap<String, u32>>,
    /// Nodes whose lease is revoked (etcd expired it while they still run and are reachable),
    /// with how many revocations hold it: their registration goes at once and comes back when
    /// the last one ends.
    pub revoked: Mutex<HashMap<String, u32>>,
    /// When each node last lost its registration (`None`: registered).
    pub unregistered_since: Mutex<HashMap<String, Option<Duration>>>,
    /// Each decode node's reservation table (replaced when the node restarts).
    pub tables: Mutex<HashMap<String, Arc<Mutex<Table>>>>,
    /// Nodes down now (crashed, not yet restarted).
    pub crashed: Mutex<HashMap<String, bool>>,
    /// How many times each decode node has started (its reservations' epoch).
    pub boots: Mutex<HashMap<String, u64>>,
    /// Every reservation granted, and what became of it.
    pub ledger: Mutex<Ledger>,
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

    /// Blocks reserved or used on `node` now (none while it is down: they went with it).
    pub fn held_blocks(&self, node: &str) -> u32 {
        if self.is_crashed(node) {
            return 0;
        }
        self.tables
            .lock()
            .unwrap()
            .get(node)
            .map_or(0, |t| t.lock().unwrap().used)
    }

    fn is_crashed(&self, node: &str) -> bool {
        self.crashed
            .lock()
            .unwrap()
            .get(node)
            .copied()
            .unwrap_or(false)
    }

    /// `node` goes down at `t` (the driver's clock): every reservation it held is lost with it.
    pub fn crash(&self, node: &str, t: Duration) {
        self.crashed.lock().unwrap().insert(node.to_string(), true);
        for ((n, _, _), life) in self.ledger.lock().unwrap().iter_mut() {
            if n == node && life.freed.is_none() {
                life.freed = Some((t, Freed::Crashed));
            }
        }
    }

    /// `node` is up again (its software starts from scratch).
    pub fn restart(&self, node: &str) {
        self.crashed.lock().unwrap().insert(node.to_string(), false);
    }

    /// Releases the decode nodes received (for reservations they granted).
    pub fn releases_received(&self) -> u64 {
        self.ledger
            .lock()
            .unwrap()
            .values()
            .map(|life| life.releases.len() as u64)
            .sum()
    }

    /// Updates the life of reservation `id` of `node`'s boot `epoch`; `false` if none such was
    /// ever made.
    pub(super) fn with_life(
        &self,
        node: &str,
        epoch: u64,
        id: u64,
        f: impl FnOnce(&mut Life),
    ) -> bool {
        match self
            .ledger
            .lock()
            .unwrap()
            .get_mut(&(node.to_string(), epoch, id))
        {
            Some(life) => {
                f(life);
                true
            }
            None => false,
        }
    }
}

/// Whether `count` (a composed fault's depth) holds `node` now.
fn held_by(map: &Mutex<HashMap<String, u32>>, node: &str) -> bool {
    map.lock().unwrap().get(node).is_some_and(|&n| n > 0)
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
        let cut = held_by(&world.cut_off, &node);
        cut_since = if cut { cut_since.or(Some(now())) } else { None };
        let revoked = held_by(&world.revoked, &node);
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

/// One reservation on a decode node (its epoch is the node's boot).
#[derive(Debug)]
struct Held {
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

struct DecodeNode {
    name: String,
    /// This boot's number: the epoch of every reservation it grants.
    epoch: u64,
    world: Arc<World>,
    table: Arc<Mutex<Table>>,
    kv: Arc<Notify>,
}

impl DecodeNode {
    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap()
    }

    /// Frees reservation `id` of this boot (if the table still holds it) and records how.
    fn free(&self, t: &mut Table, id: u64, how: Freed) -> bool {
        let Some(h) = t.held.remove(&id) else {
            return false;
        };
        t.used -= h.blocks;
        let at = now();
        self.world
            .with_life(&self.name, self.epoch, id, |life| life.freed = Some((at, how)));
        true
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
        let (created, expires) = (now(), now() + RESERVATION_TTL);
        t.held.insert(
            id,
            Held {
                blocks,
                expires,
                kv_ready: false,
                claimed: false,
            },
        );
        self.world.ledger.lock().unwrap().insert(
            (self.name.clone(), self.epoch, id),
            Life {
                created,
                expires,
                claimed: None,
                releases: Vec::new(),
                prefills: Vec::new(),
                freed: None,
            },
        );
        Ok(Response::new(pb::ReserveResponse {
            target: Some(pb::KvTarget {
                decode_node_id: self.name.clone(),
                kv_address: format!("{}:{KV_PORT}", self.name),
                reservation_id: id,
                epoch: self.epoch,
                block_ids: (0..blocks).collect(),
                layout_fingerprint: layout().fingerprint(),
            }),
            // On the real clock, as a node's is: the router reads it against its own clock at
            // once (microseconds of real time later), so it finds the TTL the simulation runs.
            expires_at_unix_ms: (std::time::SystemTime::now() + RESERVATION_TTL)
                .duration_since(std::time::UNIX_EPOCH)
                .expect("after 1970")
                .as_millis() as u64,
        }))
    }

    async fn release(
        &self,
        request: Request<pb::ReleaseRequest>,
    ) -> Result<Response<pb::ReleaseResponse>, Status> {
        let r = request.into_inner();
        let at = now();
        // Recorded whatever the table says: a Release that arrives after the node freed the
        // blocks (claimed and streamed, expired, or from before a restart) still counts.
        let known = self
            .world
            .with_life(&self.name, r.epoch, r.reservation_id, |life| {
                life.releases.push(at)
            });
        if !known {
            self.world.violation(format!(
                "{}: Release of reservation {} epoch {}, which it never granted",
                self.name, r.reservation_id, r.epoch
            ));
        }
        let mut t = self.lock();
        let ours = r.epoch == self.epoch
            && t.held.get(&r.reservation_id).is_some_and(|h| !h.claimed);
        let released = ours && self.free(&mut t, r.reservation_id, Freed::Released);
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
                Some(h) if r.epoch == self.epoch && !h.claimed => {
                    h.claimed = true;
                    let at = now();
                    self.world
                        .with_life(&self.name, self.epoch, id, |life| life.claimed = Some(at));
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
                    node.free(&mut node.lock(), id, Freed::StreamEnded);
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
                    // The caller went away.
                    node.free(&mut node.lock(), id, Freed::StreamEnded);
                    return;
                }
            }
            node.free(&mut node.lock(), id, Freed::Finished);
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

/// Frees reservations that expired unclaimed, as a real decode node's sweep does. Whether the
/// router should have let them expire is judged from the [`Ledger`] after the load.
async fn sweep(node: Arc<DecodeNode>) {
    loop {
        tokio::time::sleep(SWEEP).await;
        let t_now = now();
        let mut t = node.lock();
        let expired: Vec<u64> = t
            .held
            .iter()
            .filter(|(_, h)| !h.claimed && t_now >= h.expires)
            .map(|(&id, _)| id)
            .collect();
        for id in expired {
            node.free(&mut t, id, Freed::Expired);
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
                    Some(h) if epoch == node.epoch && now() < h.expires => {
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
    world.restart(&name);
    let epoch = {
        let mut boots = world.boots.lock().unwrap();
        let boot = boots.entry(name.clone()).or_default();
        *boot += 1;
        *boot
    };
    let node = Arc::new(DecodeNode {
        name: name.clone(),
        epoch,
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
