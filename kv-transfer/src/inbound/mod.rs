//! The receiving side: reservations a node expects blocks for, and the fail-closed checks every
//! transport runs before a byte is written and before a block is called ready.
//!
//! ```text
//!  decode node                      InboundRegistry (one per pool)          transport connection
//!  expect(Reservation) ──────────▶  entry {epoch, dst blocks, deadline}
//!                                   ◀── claim(Begin) ── fingerprint, reservation, epoch, expiry,
//!                                                      blocks checked; refusal sent back, no write
//!                                   ◀── verify_chunk ── xxh3 of every landed slab vs the sender's
//!  InboundTransfer resolves  ◀────  finish(result) ─── Ok only when every layer of every block
//!                                                      verified; Err otherwise
//! ```
//!
//! # Invariants
//! - A destination block belongs to at most one live reservation (checked at `expect`).
//! - A block is reported ready only after every layer's checksum matched; one mismatch fails the
//!   whole reservation (fail closed: the engine re-prefills, it never decodes garbled KV).
//! - When an [`InboundTransfer`] resolves, nothing of that transfer lands in its blocks any more:
//!   a transfer that is still writing is asked to abort and the result waits for the writer's
//!   confirmation (or the connection's end), bounded by `fence_timeout`; past that the
//!   connection is torn down and the result is [`TransferError::FenceTimeout`].
//! - Every entry holds a `live_reservations` gauge unit until it is removed, by whichever path.
//! - With a stall timeout, a claimed reservation whose transfer lands nothing for that long (a
//!   lost chunk, a sender that hangs mid-push) ends with `DeadlineExceeded` in phase `Data`, well
//!   before its TTL: the caller re-prefills instead of waiting out the whole reservation.
//!
//! # Costs
//! One mutex-protected table per pool, touched once per transfer and once per chunk; the checksum
//! pass reads each landed byte once (xxh3, memory speed), right after it lands.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use crate::error::TransferError;
use crate::metrics::{Live, LiveGuard, TransferMetrics};
use crate::pool::{BlockId, block_runs};
use crate::transport::PoolRegistration;
use crate::wire::{Begin, WireError};

mod session;
mod transfer;

pub(crate) use session::InboundSession;
pub use transfer::InboundTransfer;

/// How many ended reservations are remembered to tell "expired"/"stale epoch" from "unknown".
const TOMBSTONES: usize = 4096;

/// Blocks a receiver set aside for one request's KV.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reservation {
    /// The reservation's id (the decode node's choice).
    pub reservation_id: u64,
    /// Bumped whenever the id is reused; a write for another epoch is refused.
    pub epoch: u64,
    /// Destination block ids, in the order the sender will pair them with its source blocks.
    pub dst_blocks: Vec<BlockId>,
    /// How long the reservation waits for every layer of every block.
    pub ttl: Duration,
}

/// What arrived for a reservation, once every layer of every block verified.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InboundReport {
    /// The reservation.
    pub reservation_id: u64,
    /// Its epoch.
    pub epoch: u64,
    /// The request id the sender gave.
    pub request_id: u128,
    /// The sender's W3C `traceparent` for the transfer (empty: none).
    pub trace_context: String,
    /// The sender's source block ids, paired with `dst_blocks`.
    pub src_blocks: Vec<BlockId>,
    /// Destination block ids (as reserved).
    pub dst_blocks: Vec<BlockId>,
    /// Per-block checksum across layers, in `dst_blocks` order.
    pub block_checksums: Vec<u64>,
    /// Payload bytes verified.
    pub bytes: u64,
    /// The bytes landed in the receiver's device pool (CUDA IPC), not in the registered host
    /// pool: a node staging through that host pool must not copy it up over them.
    pub on_device: bool,
}

/// Lets the registry reach the connection that is filling a reservation.
pub(crate) trait AbortHook: Send + Sync {
    /// Ask the writer to stop (send it an `Abort`); must not block.
    fn request_abort(&self, transfer_id: u64, error: WireError);
    /// Tear the connection down (the writer did not confirm in time).
    fn kill(&self);
}

struct Claim {
    transfer_id: u64,
    hook: Arc<dyn AbortHook>,
    /// Set when the registry asked the writer to abort; the result the reservation resolves to.
    pending: Option<TransferError>,
}

/// When a reservation's transfer last made progress (claimed, a chunk verified), as ms since
/// the registry started plus one; 0 until it is claimed. Shared by the entry, the session that
/// writes it and the [`InboundTransfer`] that waits on it.
#[derive(Clone, Default)]
pub(crate) struct Progress(Arc<AtomicU64>);

impl Progress {
    fn touch(&self, since: Instant) {
        let ms = since.elapsed().as_millis() as u64 + 1;
        self.0.store(ms, Ordering::Relaxed);
    }

    /// The last progress, if the transfer was claimed.
    fn last(&self, since: Instant) -> Option<Instant> {
        match self.0.load(Ordering::Relaxed) {
            0 => None,
            ms => Some(since + Duration::from_millis(ms - 1)),
        }
    }
}

struct Entry {
    epoch: u64,
    dst_blocks: Arc<[BlockId]>,
    deadline: Instant,
    progress: Progress,
    claim: Option<Claim>,
    done_tx: Option<oneshot::Sender<Result<InboundReport, TransferError>>>,
    _live: LiveGuard,
}

#[derive(Clone, Copy)]
struct Tombstone {
    epoch: u64,
    expired: bool,
}

struct Table {
    entries: HashMap<u64, Entry>,
    reserved: Vec<bool>,
    tombstones: HashMap<u64, Tombstone>,
    tomb_order: VecDeque<u64>,
}

impl Table {
    fn remove(&mut self, reservation_id: u64, expired: bool) -> Option<Entry> {
        let e = self.entries.remove(&reservation_id)?;
        for &b in e.dst_blocks.iter() {
            self.reserved[b as usize] = false;
        }
        if self
            .tombstones
            .insert(
                reservation_id,
                Tombstone {
                    epoch: e.epoch,
                    expired,
                },
            )
            .is_none()
        {
            self.tomb_order.push_back(reservation_id);
            if self.tomb_order.len() > TOMBSTONES {
                let old = self.tomb_order.pop_front().expect("non-empty");
                self.tombstones.remove(&old);
            }
        }
        Some(e)
    }
}

struct Inner {
    registration: PoolRegistration,
    metrics: Arc<TransferMetrics>,
    fence_timeout: Duration,
    /// A claimed transfer that lands nothing for this long fails (`None`: only the TTL ends it).
    stall_timeout: Option<Duration>,
    /// The time base of every [`Progress`].
    started: Instant,
    table: Mutex<Table>,
}

/// The reservations one pool is waiting on. Cheap to clone; share it with the transport server.
#[derive(Clone)]
pub struct InboundRegistry {
    inner: Arc<Inner>,
}

enum AbortOutcome {
    /// The reservation was not being written: removed at once, with this error.
    Removed(TransferError),
    /// A writer holds it: asked to stop; wait for the session to finish.
    Fencing(Arc<dyn AbortHook>),
    /// It already finished (the result is in the channel).
    AlreadyDone,
}

impl InboundRegistry {
    /// A registry for a registered pool; `fence_timeout` bounds how long an abort waits for the
    /// writer's confirmation.
    pub fn new(registration: PoolRegistration, fence_timeout: Duration) -> Self {
        Self::with_stall_timeout(registration, fence_timeout, None)
    }

    /// Like [`InboundRegistry::new`]; besides, a claimed transfer that lands nothing for
    /// `stall_timeout` ends with [`TransferError::DeadlineExceeded`] (phase `Data`) instead of
    /// waiting for its reservation's TTL.
    pub fn with_stall_timeout(
        registration: PoolRegistration,
        fence_timeout: Duration,
        stall_timeout: Option<Duration>,
    ) -> Self {
        let blocks = registration.pool().num_blocks();
        let metrics = Arc::clone(registration.metrics());
        Self {
            inner: Arc::new(Inner {
                registration,
                metrics,
                fence_timeout,
                stall_timeout,
                started: Instant::now(),
                table: Mutex::new(Table {
                    entries: HashMap::new(),
                    reserved: vec![false; blocks],
                    tombstones: HashMap::new(),
                    tomb_order: VecDeque::new(),
                }),
            }),
        }
    }

    /// The registered pool that receives blocks.
    pub fn registration(&self) -> &PoolRegistration {
        &self.inner.registration
    }

    /// The pool's layout fingerprint.
    pub fn fingerprint(&self) -> u64 {
        self.inner.registration.pool().layout().fingerprint()
    }

    /// Reservations currently held.
    pub fn live_reservations(&self) -> usize {
        self.lock().entries.len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        // A panic while holding this lock leaves plain data behind; keep serving.
        self.inner.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts waiting for blocks into `r.dst_blocks`; the returned handle resolves when they all
    /// verified, or with the error that ended the wait.
    pub fn expect(&self, r: Reservation) -> Result<InboundTransfer, TransferError> {
        let pool = self.inner.registration.pool();
        if r.dst_blocks.is_empty() {
            return Err(TransferError::invalid("dst_blocks", "is empty"));
        }
        for &b in &r.dst_blocks {
            pool.check_block(b)?;
        }
        let mut t = self.lock();
        if t.entries.contains_key(&r.reservation_id) {
            return Err(TransferError::ReservationBusy {
                reservation_id: r.reservation_id,
            });
        }
        let mut seen = std::collections::HashSet::with_capacity(r.dst_blocks.len());
        for &b in &r.dst_blocks {
            if t.reserved[b as usize] || !seen.insert(b) {
                return Err(TransferError::invalid(
                    "dst_blocks",
                    format!("block {b} is already reserved"),
                ));
            }
        }
        for &b in &r.dst_blocks {
            t.reserved[b as usize] = true;
        }
        let (done_tx, rx) = oneshot::channel();
        let deadline = Instant::now() + r.ttl;
        let progress = Progress::default();
        t.entries.insert(
            r.reservation_id,
            Entry {
                epoch: r.epoch,
                dst_blocks: r.dst_blocks.into(),
                deadline,
                progress: progress.clone(),
                claim: None,
                done_tx: Some(done_tx),
                _live: self.inner.metrics.live_guard(Live::Reservations),
            },
        );
        Ok(InboundTransfer {
            registry: self.clone(),
            reservation_id: r.reservation_id,
            epoch: r.epoch,
            deadline: tokio::time::Instant::from_std(deadline),
            progress,
            rx: Some(rx),
        })
    }

    /// Checks a `Begin` and claims its reservation for one connection's transfer. Refusals are
    /// typed (and counted); nothing has been written when this returns an error.
    pub(crate) fn claim(
        &self,
        b: &Begin,
        hook: Arc<dyn AbortHook>,
    ) -> Result<InboundSession, TransferError> {
        let r = self.try_claim(b, hook);
        if let Err(e) = &r {
            self.inner.metrics.failed(e);
        }
        r
    }

    fn try_claim(
        &self,
        b: &Begin,
        hook: Arc<dyn AbortHook>,
    ) -> Result<InboundSession, TransferError> {
        let pool = self.inner.registration.pool();
        let local = pool.layout().fingerprint();
        if b.layout_fingerprint != local {
            return Err(TransferError::LayoutMismatch {
                local,
                remote: b.layout_fingerprint,
            });
        }
        let id = b.reservation_id;
        let mut t = self.lock();
        let Some(entry) = t.entries.get_mut(&id) else {
            return Err(match t.tombstones.get(&id) {
                Some(ts) if ts.epoch != b.epoch => TransferError::StaleEpoch {
                    reservation_id: id,
                    current: ts.epoch,
                    requested: b.epoch,
                },
                Some(ts) if ts.expired => TransferError::ReservationExpired { reservation_id: id },
                _ => TransferError::UnknownReservation { reservation_id: id },
            });
        };
        if entry.epoch != b.epoch {
            return Err(TransferError::StaleEpoch {
                reservation_id: id,
                current: entry.epoch,
                requested: b.epoch,
            });
        }
        if Instant::now() >= entry.deadline {
            return Err(TransferError::ReservationExpired { reservation_id: id });
        }
        if entry.claim.is_some() {
            return Err(TransferError::ReservationBusy { reservation_id: id });
        }
        if *entry.dst_blocks != *b.dst_blocks {
            return Err(TransferError::invalid(
                "dst_blocks",
                "differ from the reservation's blocks",
            ));
        }
        if b.src_blocks.len() != b.dst_blocks.len() {
            return Err(TransferError::invalid(
                "src_blocks",
                "length differs from dst_blocks",
            ));
        }
        let layers = pool.layout().num_layers as u32;
        if b.layer_start != 0 || b.layer_end != layers {
            return Err(TransferError::invalid(
                "layers",
                format!("{}..{} is not 0..{layers}", b.layer_start, b.layer_end),
            ));
        }
        entry.claim = Some(Claim {
            transfer_id: b.transfer_id,
            hook,
            pending: None,
        });
        entry.progress.touch(self.inner.started);
        let n = b.dst_blocks.len();
        Ok(InboundSession {
            registry: self.clone(),
            reservation_id: id,
            epoch: b.epoch,
            transfer_id: b.transfer_id,
            request_id: b.request_id,
            // A traceparent is 55 bytes; anything much longer is not one (ignored, not an error).
            trace_context: if b.trace_context.len() <= 256 {
                b.trace_context.clone()
            } else {
                String::new()
            },
            runs: block_runs(&b.src_blocks, &b.dst_blocks),
            src_blocks: b.src_blocks.clone(),
            dst_blocks: Arc::clone(&entry.dst_blocks),
            next_layer: 0,
            layers_verified: 0,
            num_layers: layers,
            slab_sums: vec![0; layers as usize * n],
            bytes: 0,
            on_device: false,
            finished: false,
            progress: entry.progress.clone(),
        })
    }

    fn request_abort(&self, id: u64, epoch: u64, err: TransferError) -> AbortOutcome {
        let mut t = self.lock();
        let Some(entry) = t.entries.get_mut(&id).filter(|e| e.epoch == epoch) else {
            return AbortOutcome::AlreadyDone;
        };
        match &mut entry.claim {
            None => {
                let expired = matches!(err, TransferError::ReservationExpired { .. });
                t.remove(id, expired);
                self.inner.metrics.inbound_finished(Err(&err));
                AbortOutcome::Removed(err)
            }
            Some(claim) => {
                if claim.pending.is_none() {
                    claim
                        .hook
                        .request_abort(claim.transfer_id, WireError::from_error(&err));
                    claim.pending = Some(err);
                }
                AbortOutcome::Fencing(Arc::clone(&claim.hook))
            }
        }
    }

    /// Removes an entry whose writer never confirmed an abort, even after its connection was torn
    /// down. Its blocks return to the table; the caller reports them suspect.
    fn force_remove(&self, id: u64, epoch: u64) {
        let mut t = self.lock();
        if t.entries.get(&id).is_some_and(|e| e.epoch == epoch) {
            t.remove(id, true);
        }
    }
}
