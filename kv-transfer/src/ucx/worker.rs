//! The UCX progress thread: one per transport, owning the context, the worker and every UCX
//! object, driven by commands over a bounded channel.
//!
//! ```text
//!  tokio tasks ──Cmd (bounded sync channel) + Thread::unpark──▶ progress thread
//!       ▲                                                      │ ucp_*_nbx, ucp_worker_progress
//!       └────────── oneshot replies (batch done / failed) ◀────┘ request polling
//! ```
//!
//! UCX's worker is not thread-safe in the mode we create it (`UCS_THREAD_MODE_SINGLE`), so no
//! other thread ever calls into it. The loop spins on `ucp_worker_progress` while requests are
//! outstanding (and briefly after any activity), then parks: for [`BUSY_PARK`] at a time while
//! requests are still outstanding, for [`IDLE_PARK`] when nothing is (to keep serving UCX's own
//! incoming traffic); a new command unparks it at once. The context is created without
//! `UCP_FEATURE_WAKEUP` (see `ucp::Context::new`), so parking with a timeout, not
//! `ucp_worker_wait`, is how it sleeps.
//!
//! A batch (the puts of one chunk plus a flush, the tagged sends of one chunk, the receives of
//! one chunk) replies once, after every request in it has completed: an error in one request
//! still waits for the others, so "replied" always means "UCX no longer touches these buffers".
//!
//! `Progress::handle` only dispatches: each command is one named step (`map_pool`, `allocate`,
//! `connect`, `close_endpoint`, `put`, `tag_send`, `tag_recv`, `cancel_recvs`) that either
//! replies before returning or leaves exactly one batch behind for `poll` to reply to.

use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, TryRecvError};
use std::time::{Duration, Instant};

use super::runtime::{Cmd, Keep, Reply};
use super::ucp::{Context, Endpoint, MemHandle, Request, Started, Status, Worker};
use super::{PutOp, TagOp};
use crate::error::{Phase, TransferError};
use crate::pool::KvPool;
use tandem_ucx_sys as sys;

/// How long the thread keeps polling after the last sign of activity before it parks, with
/// nothing outstanding (a new command unparks it anyway).
const IDLE_SPIN: Duration = Duration::from_micros(50);
/// The same with requests in flight: their completion usually follows within microseconds, and
/// a wake-up costs more than that.
const BUSY_SPIN: Duration = Duration::from_millis(2);
/// Park length while requests are outstanding but quiet (a slow peer).
const BUSY_PARK: Duration = Duration::from_micros(100);
/// Park length with nothing outstanding.
const IDLE_PARK: Duration = Duration::from_millis(1);

/// How long a closed connection's stray tagged messages keep being discarded.
const DRAIN_FOR: Duration = Duration::from_secs(2);

struct Pending {
    req: Request,
    tag: u64,
}

enum Next {
    /// Reply when the requests complete.
    Reply,
    /// Then flush this endpoint, then reply.
    Flush(u64),
}

/// Requests issued for one command, replied to together.
struct Batch {
    /// When it was issued (its duration is traced on completion).
    started: Instant,
    /// Requests still in progress.
    pending: Vec<Pending>,
    /// What follows once `pending` is empty.
    next: Next,
    /// The first failure; the batch still waits for its other requests.
    error: Option<TransferError>,
    /// The memory the requests point into, alive until the reply.
    _keep: Keep,
    reply: Option<Reply<()>>,
}

struct Progress {
    /// Mapped regions; a registered heap pool is kept alive by its Arc, allocated ones by UCX.
    mems: HashMap<u64, (MemHandle, Option<Arc<KvPool>>)>,
    eps: HashMap<u64, Endpoint>,
    next_id: u64,
    batches: Vec<Batch>,
    closing: Vec<Request>,
    /// (tag, mask, until): prefixes whose unexpected messages are discarded.
    drains: Vec<(u64, u64, Instant)>,
    worker: Rc<Worker>,
    ctx: Rc<Context>,
}

fn request_error(s: Status, op: &'static str) -> TransferError {
    if s.is_peer_failure() {
        TransferError::PeerGone {
            peer: "ucx".into(),
            phase: Phase::Data,
            reason: std::io::ErrorKind::ConnectionReset,
        }
    } else {
        s.error(op)
    }
}

/// The progress thread's body: creates the context (with `tls` overriding `UCX_TLS`) and the
/// worker, reports the worker's address (or the setup error) on `ready`, then serves `rx` until
/// shutdown.
pub(super) fn run(
    tls: Option<String>,
    ready: std::sync::mpsc::Sender<Result<Vec<u8>, TransferError>>,
    rx: Receiver<Cmd>,
) {
    let setup = (|| {
        let ctx = Context::new(tls.as_deref())?;
        let worker = Worker::new(&ctx)?;
        let address = worker.address()?;
        Ok::<_, TransferError>((ctx, worker, address))
    })();
    match setup {
        Ok((ctx, worker, address)) => {
            let _ = ready.send(Ok(address));
            Progress::new(ctx, worker).run(rx);
        }
        Err(e) => {
            let _ = ready.send(Err(e));
        }
    }
}

impl Progress {
    fn new(ctx: Rc<Context>, worker: Rc<Worker>) -> Self {
        Self {
            mems: HashMap::new(),
            eps: HashMap::new(),
            next_id: 1,
            batches: Vec::new(),
            closing: Vec::new(),
            drains: Vec::new(),
            worker,
            ctx,
        }
    }

    fn run(mut self, rx: Receiver<Cmd>) {
        let mut last_activity = Instant::now();
        'outer: loop {
            loop {
                match rx.try_recv() {
                    Ok(Cmd::Shutdown) | Err(TryRecvError::Disconnected) => break 'outer,
                    Ok(cmd) => {
                        self.handle(cmd);
                        last_activity = Instant::now();
                    }
                    Err(TryRecvError::Empty) => break,
                }
            }
            let before = self.batches.len() + self.closing.len();
            let progressed = self.worker.progress();
            if !self.drains.is_empty() {
                self.drain();
            }
            self.poll();
            if progressed || self.batches.len() + self.closing.len() != before {
                last_activity = Instant::now();
                continue;
            }
            let busy = !self.batches.is_empty() || !self.closing.is_empty();
            let (spin, park) = if busy {
                (BUSY_SPIN, BUSY_PARK)
            } else {
                (IDLE_SPIN, IDLE_PARK)
            };
            if last_activity.elapsed() < spin {
                continue;
            }
            // A command sent meanwhile unparks at once (or makes this return immediately).
            std::thread::park_timeout(park);
        }
        self.shutdown();
    }

    /// Runs one command to its end or, for data commands, to an issued [`Batch`]: every command
    /// with a reply either replies here or leaves a batch that [`Progress::poll`] replies to.
    fn handle(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Map { pool, reply } => {
                let _ = reply.send(self.map_pool(pool));
            }
            Cmd::Alloc { len, reply } => {
                let _ = reply.send(self.allocate(len));
            }
            Cmd::Unmap { mem, guard } => {
                self.mems.remove(&mem);
                drop(guard);
            }
            Cmd::Connect {
                address,
                rkey,
                base,
                peer_failure,
                reply,
            } => {
                let _ = reply.send(self.connect(&address, &rkey, base, peer_failure));
            }
            Cmd::Close { ep } => self.close_endpoint(ep),
            Cmd::Put {
                ep,
                ops,
                keep,
                reply,
            } => self.put(ep, &ops, keep, reply),
            Cmd::TagSend {
                ep,
                ops,
                keep,
                reply,
            } => self.tag_send(ep, &ops, keep, reply),
            Cmd::TagRecv { ops, keep, reply } => self.tag_recv(&ops, keep, reply),
            Cmd::CancelRecvs { tag, mask } => self.cancel_recvs(tag, mask),
            Cmd::DrainUnexpected { tag, mask } => {
                // Messages still in flight land later: keep draining this prefix for a while.
                self.drains.push((tag, mask, Instant::now() + DRAIN_FOR));
                self.drain();
            }
            Cmd::Shutdown => unreachable!("handled by the loop"),
        }
    }

    /// Registers a heap pool with UCX and packs its remote key. The pool's Arc is stored next
    /// to the handle, so the memory outlives the mapping.
    fn map_pool(&mut self, pool: Arc<KvPool>) -> Result<(u64, Vec<u8>), TransferError> {
        // SAFETY: the pool's Arc is stored next to the handle and dropped after it.
        let memh = unsafe { MemHandle::map(&self.ctx, pool.as_ptr(), pool.len_bytes()) }?;
        let rkey = memh.pack_rkey()?;
        let id = self.id();
        self.mems.insert(id, (memh, Some(pool)));
        Ok((id, rkey))
    }

    /// Has UCX allocate and map `len` bytes; replies (mem id, address, rkey). The memory is
    /// at least `len` bytes and aligned to [`crate::pool::POOL_ALIGN_BYTES`], or this fails
    /// (and the handle, dropped here, frees it).
    fn allocate(&mut self, len: usize) -> Result<(u64, usize, Vec<u8>), TransferError> {
        let (memh, addr, got) = MemHandle::allocate(&self.ctx, len)?;
        if got < len || !(addr as usize).is_multiple_of(crate::pool::POOL_ALIGN_BYTES) {
            return Err(TransferError::invalid(
                "ucx_alloc",
                format!("got {got} bytes at {addr:p}"),
            ));
        }
        let rkey = memh.pack_rkey()?;
        let id = self.id();
        self.mems.insert(id, (memh, None));
        Ok((id, addr as usize, rkey))
    }

    /// Creates an endpoint to a remote worker and unpacks its pool's key; replies (endpoint
    /// id, `ucp_ep_print_info` text, local address of `base` if UCX maps the peer's pool).
    /// When no transport to the peer can detect peer failure, connects without asking for it
    /// (the TCP control connection then is what notices a dead peer).
    fn connect(
        &mut self,
        address: &[u8],
        rkey: &[u8],
        base: u64,
        peer_failure: bool,
    ) -> Result<(u64, String, Option<usize>), TransferError> {
        let mut ep = match Endpoint::connect(&self.worker, address, peer_failure) {
            Err(TransferError::Ucx { status, .. })
                if peer_failure && status == sys::UCS_ERR_UNREACHABLE as i32 =>
            {
                tracing::info!(
                    "no UCX transport to this peer detects peer failure; the control connection will"
                );
                Endpoint::connect(&self.worker, address, false)?
            }
            r => r?,
        };
        ep.unpack_rkey(rkey)?;
        let info = ep.info();
        let mapped = ep.rkey_ptr(base).map(|p| p as usize);
        let id = self.id();
        self.eps.insert(id, ep);
        Ok((id, info, mapped))
    }

    /// Forgets endpoint `ep` and starts closing it; a close still in progress is polled from
    /// `closing` until it completes. Unknown ids are ignored (closing twice is harmless).
    fn close_endpoint(&mut self, ep: u64) {
        if let Some(ep) = self.eps.remove(&ep) {
            match ep.close(false) {
                Ok(Started::Pending(r)) => self.closing.push(r),
                Ok(Started::Done) => {}
                Err(e) => tracing::debug!(error = %e, "endpoint close"),
            }
        }
    }

    /// Issues one chunk's puts on `ep`, to be flushed and replied to as one batch. Issuing
    /// stops at the first error; the batch still waits for the puts already started.
    fn put(&mut self, ep: u64, ops: &[PutOp], keep: Keep, reply: Reply<()>) {
        let mut b = Batch::new(Next::Flush(ep), keep, Some(reply));
        match self.eps.get(&ep) {
            None => b.error = Some(closed_ep()),
            Some(e) => {
                for op in ops {
                    // SAFETY: `keep` holds the source memory until this batch replies;
                    // `remote` was bounds-checked against the peer pool by the caller.
                    let r = unsafe { e.put(op.local as *const u8, op.len, op.remote) };
                    if !b.absorb(r, 0) {
                        break;
                    }
                }
            }
        }
        self.batches.push(b);
    }

    /// Issues one chunk's tagged sends on `ep` as one batch (same stopping rule as [`Self::put`]).
    fn tag_send(&mut self, ep: u64, ops: &[TagOp], keep: Keep, reply: Reply<()>) {
        let mut b = Batch::new(Next::Reply, keep, Some(reply));
        match self.eps.get(&ep) {
            None => b.error = Some(closed_ep()),
            Some(e) => {
                for op in ops {
                    // SAFETY: `keep` holds the memory until this batch replies.
                    let r = unsafe { e.tag_send(op.addr as *const u8, op.len, op.tag) };
                    if !b.absorb(r, op.tag) {
                        break;
                    }
                }
            }
        }
        self.batches.push(b);
    }

    /// Posts one chunk's tagged receives as one batch; each pending receive keeps its tag so
    /// [`Self::cancel_recvs`] can find it.
    fn tag_recv(&mut self, ops: &[TagOp], keep: Keep, reply: Reply<()>) {
        let mut b = Batch::new(Next::Reply, keep, Some(reply));
        for op in ops {
            // SAFETY: `keep` holds the memory until this batch replies; the caller owns
            // the destination range exclusively until then (a claimed reservation).
            let r = unsafe { self.worker.tag_recv(op.addr as *mut u8, op.len, op.tag) };
            if !b.absorb(r, op.tag) {
                break;
            }
        }
        self.batches.push(b);
    }

    /// Asks UCX to cancel every pending tagged request whose tag matches `tag` under `mask`;
    /// they complete (cancelled) through the usual polling, so their batches still reply.
    fn cancel_recvs(&self, tag: u64, mask: u64) {
        for b in &self.batches {
            for p in b
                .pending
                .iter()
                .filter(|p| p.tag != 0 && p.tag & mask == tag & mask)
            {
                self.worker.cancel(&p.req);
            }
        }
    }

    /// Receives and discards unexpected messages under every active drain prefix.
    fn drain(&mut self) {
        let now = Instant::now();
        self.drains.retain(|&(_, _, until)| until > now);
        for i in 0..self.drains.len() {
            let (tag, mask, _) = self.drains[i];
            loop {
                let mut sink = Vec::new();
                let Some(r) = self.worker.drain_unexpected(tag, mask, &mut sink) else {
                    break;
                };
                let mut b = Batch::new(Next::Reply, Box::new(sink), None);
                b.absorb(r, 0);
                if !b.pending.is_empty() {
                    self.batches.push(b);
                }
            }
        }
    }

    fn id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    /// Polls every batch; replies to those whose requests all completed.
    fn poll(&mut self) {
        self.closing.retain(|r| r.status().is_none());
        let mut i = 0;
        while i < self.batches.len() {
            let b = &mut self.batches[i];
            b.pending.retain(|p| match p.req.status() {
                None => true,
                Some(Ok(())) => false,
                Some(Err(s)) => {
                    b.error
                        .get_or_insert_with(|| request_error(s, "ucx request"));
                    false
                }
            });
            if !b.pending.is_empty() {
                i += 1;
                continue;
            }
            if let (Next::Flush(ep), None) = (&b.next, &b.error) {
                let ep = *ep;
                b.next = Next::Reply;
                match self.eps.get(&ep).map(|e| e.flush()) {
                    Some(r) => {
                        let b = &mut self.batches[i];
                        if b.absorb(r, 0) && !b.pending.is_empty() {
                            i += 1;
                            continue;
                        }
                    }
                    None => self.batches[i].error = Some(closed_ep()),
                }
            }
            let mut b = self.batches.swap_remove(i);
            tracing::trace!(elapsed = ?b.started.elapsed(), "UCX batch done");
            if let Some(reply) = b.reply.take() {
                let _ = reply.send(b.error.take().map_or(Ok(()), Err));
            }
        }
    }

    fn shutdown(mut self) {
        for b in &self.batches {
            for p in &b.pending {
                self.worker.cancel(&p.req);
            }
        }
        let eps: Vec<u64> = self.eps.keys().copied().collect();
        for ep in eps {
            self.close_endpoint(ep);
        }
        // Whatever tagged data nobody will receive now: take it out of the worker before it goes.
        self.drains = vec![(0, 0, Instant::now() + DRAIN_FOR)];
        let until = Instant::now() + Duration::from_secs(2);
        while (!self.batches.is_empty() || !self.closing.is_empty()) && Instant::now() < until {
            self.worker.progress();
            self.drain();
            self.poll();
        }
        self.drain();
        if !self.batches.is_empty() {
            tracing::error!(
                batches = self.batches.len(),
                "UCX requests still pending at shutdown; leaking them"
            );
            for b in &mut self.batches {
                std::mem::forget(std::mem::take(&mut b.pending));
            }
        }
        self.mems.clear();
    }
}

impl Batch {
    /// An empty batch, started now.
    fn new(next: Next, keep: Keep, reply: Option<Reply<()>>) -> Self {
        Self {
            started: Instant::now(),
            pending: Vec::new(),
            next,
            error: None,
            _keep: keep,
            reply,
        }
    }

    /// Takes an `*_nbx` outcome into the batch; false stops issuing more (an error happened).
    fn absorb(&mut self, r: Result<Started, TransferError>, tag: u64) -> bool {
        match r {
            Ok(Started::Done) => true,
            Ok(Started::Pending(req)) => {
                self.pending.push(Pending { req, tag });
                true
            }
            Err(e) => {
                self.error.get_or_insert(e);
                false
            }
        }
    }
}

fn closed_ep() -> TransferError {
    TransferError::PeerGone {
        peer: "ucx".into(),
        phase: Phase::Data,
        reason: std::io::ErrorKind::NotConnected,
    }
}
