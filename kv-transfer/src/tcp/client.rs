//! The sending side of the stream protocol: connections (with their reader and writer tasks)
//! and the per-push task that plans chunks, checksums them and moves them.
//!
//! A push task never holds the connection's socket: it sends commands to the writer task over a
//! bounded channel (backpressure reaches the push when the socket is full) and receives its own
//! events (`BeginReply`, `Done`, `Abort`) from the reader task through a per-transfer route.
//! When the connection ends, the reader drops every route, so every push on it sees `PeerGone`.

use std::collections::{HashMap, VecDeque};
use std::io::IoSlice;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use rkyv::util::AlignedVec;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use super::NetShared;
use crate::error::{Phase, TransferError};
use crate::fault::ChunkFaults;
use crate::metrics::{Live, LiveGuard};
use crate::checksum::slab_checksum;
use crate::pool::{KvPool, block_runs};
use crate::transport::{PoolRegistration, PushDriver, TransferReport, layers_per_chunk};
use crate::wire::{
    Abort, ArchivedMsg, Begin, Chunk, DataMode, FrameReader, Hello, HelloReply, Msg, PROTOCOL_VERSION, ReadError,
    WireError, WireLayout, encode_frame, frame_bytes, to_owned, write_frame,
};

/// Most `iovec`s handed to one `writev` (Linux allows 1024).
const MAX_IOVECS: usize = 512;

/// What the writer task is asked to put on the socket.
pub(crate) enum WriterCmd {
    /// A control frame.
    Frame(Msg),
    /// A `Chunk` frame followed by its slab bytes, read straight from the source pool.
    Chunk(InlineChunk),
}

pub(crate) struct InlineChunk {
    frame: Msg,
    pool: Arc<KvPool>,
    /// (source pool offset, length) in payload order.
    ranges: Vec<(usize, usize)>,
    faults: ChunkFaults,
}

/// How block bytes leave this connection.
pub(crate) enum SendPath {
    /// In the TCP stream.
    Inline,
    /// Over UCX (the stream carries control frames only).
    #[cfg(feature = "ucx")]
    Ucx(crate::ucx::UcxPeer),
}

impl SendPath {
    fn mode(&self) -> DataMode {
        match self {
            SendPath::Inline => DataMode::Inline,
            #[cfg(feature = "ucx")]
            SendPath::Ucx(p) => p.mode(),
        }
    }
}

/// What the reader task routes to a push.
pub(crate) enum Event {
    BeginReply(Option<WireError>),
    Done(Vec<u64>),
    Abort(WireError),
}

struct ConnShared {
    peer: String,
    routes: Mutex<HashMap<u64, mpsc::Sender<Event>>>,
    closed: CancellationToken,
}

impl ConnShared {
    fn routes(&self) -> std::sync::MutexGuard<'_, HashMap<u64, mpsc::Sender<Event>>> {
        self.routes.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// One open connection to a receiver, shared by every push to it.
pub(crate) struct ClientConn {
    shared: Arc<ConnShared>,
    out: mpsc::Sender<WriterCmd>,
    path: SendPath,
    remote_blocks: u32,
    next_transfer: AtomicU64,
    _live: LiveGuard,
}

impl Drop for ClientConn {
    fn drop(&mut self) {
        self.shared.closed.cancel();
    }
}

struct RouteGuard<'a>(&'a ConnShared, u64);

impl Drop for RouteGuard<'_> {
    fn drop(&mut self) {
        self.0.routes().remove(&self.1);
    }
}

fn peer_gone(peer: &str, phase: Phase, e: &std::io::Error) -> TransferError {
    TransferError::PeerGone { peer: peer.to_string(), phase, reason: e.kind() }
}

async fn get_conn(net: &Arc<NetShared>, peer: &str, src: &PoolRegistration) -> Result<Arc<ClientConn>, TransferError> {
    let key = (peer.to_string(), src.pool().layout().fingerprint());
    // Held across a connect: pushes wait for the one connection attempt rather than racing.
    let mut conns = net.conns.lock().await;
    if let Some(c) = conns.get(&key) {
        if !c.shared.closed.is_cancelled() {
            return Ok(Arc::clone(c));
        }
        conns.remove(&key);
    }
    let c = Arc::new(connect(net, peer, src).await?);
    conns.insert(key.clone(), Arc::clone(&c));
    // Evict the connection from the cache as soon as it closes, so a dead peer's connection
    // (and its gauge unit, UCX endpoint and tasks) goes once its last push lets go of it.
    let (weak_net, shared) = (Arc::downgrade(net), Arc::clone(&c.shared));
    tokio::spawn(async move {
        shared.closed.cancelled().await;
        if let Some(net) = weak_net.upgrade() {
            let mut conns = net.conns.lock().await;
            if conns.get(&key).is_some_and(|c| Arc::ptr_eq(&c.shared, &shared)) {
                conns.remove(&key);
            }
        }
    });
    Ok(c)
}

async fn connect(net: &Arc<NetShared>, peer: &str, src: &PoolRegistration) -> Result<ClientConn, TransferError> {
    #[cfg(feature = "ucx")]
    let wants_ucx = net.ucx.is_some();
    #[cfg(not(feature = "ucx"))]
    let wants_ucx = false;
    let layout = *src.pool().layout();
    let handshake = async {
        let stream = TcpStream::connect(peer)
            .await
            .map_err(|source| TransferError::Connect { peer: peer.to_string(), source })?;
        stream.set_nodelay(true).map_err(|e| peer_gone(peer, Phase::Connect, &e))?;
        let same_host = match (stream.local_addr(), stream.peer_addr()) {
            (Ok(l), Ok(p)) => p.ip().is_loopback() || l.ip() == p.ip(),
            _ => false,
        };
        let (rd, mut wr) = stream.into_split();
        let mut reader = FrameReader::new(rd);
        let hello = Msg::Hello(Hello {
            protocol_version: PROTOCOL_VERSION,
            layout: WireLayout::from(&layout),
            layout_fingerprint: layout.fingerprint(),
            wants_ucx,
        });
        let mut buf = AlignedVec::new();
        write_frame(&mut wr, &hello, &mut buf).await.map_err(|e| peer_gone(peer, Phase::Connect, &e))?;
        let reply: HelloReply = match reader.next().await {
            Ok(ArchivedMsg::HelloReply(r)) => to_owned(r)?,
            Ok(_) => return Err(TransferError::protocol("expected_hello_reply", "another frame came first")),
            Err(ReadError::Io(e)) => return Err(peer_gone(peer, Phase::Connect, &e)),
            Err(ReadError::Invalid(e)) => return Err(e),
        };
        Ok((reader, wr, reply, same_host))
    };
    let timeout = net.config.connect_timeout;
    let (reader, wr, reply, same_host) = tokio::time::timeout(timeout, handshake)
        .await
        .map_err(|_| TransferError::DeadlineExceeded { phase: Phase::Connect, deadline: timeout })??;
    let (remote_blocks, ucx, conn_id) = match reply {
        HelloReply::Accepted { pool_blocks, ucx, conn_id } => (pool_blocks, ucx, conn_id),
        HelloReply::Refused(e) => return Err(e.into_error(peer, Phase::Connect)),
    };
    #[cfg(not(feature = "ucx"))]
    let _ = (conn_id, same_host);
    let path = match (ucx, wants_ucx) {
        (None, false) => SendPath::Inline,
        #[cfg(feature = "ucx")]
        (Some(remote), true) => {
            let rt = net.ucx.as_ref().expect("wants_ucx implies a runtime");
            SendPath::Ucx(rt.connect(peer, &remote, conn_id, same_host).await?)
        }
        _ => return Err(TransferError::protocol("ucx_offer", "receiver answered a different data path")),
    };
    let shared = Arc::new(ConnShared {
        peer: peer.to_string(),
        routes: Mutex::new(HashMap::new()),
        closed: CancellationToken::new(),
    });
    let (out, out_rx) = mpsc::channel(4);
    tokio::spawn(writer_task(wr, out_rx, Arc::clone(&shared)));
    tokio::spawn(reader_task(reader, Arc::clone(&shared)));
    tracing::debug!(peer, mode = ?path.mode(), "connected");
    Ok(ClientConn {
        shared,
        out,
        path,
        remote_blocks,
        next_transfer: AtomicU64::new(1),
        _live: net.metrics.live_guard(Live::Connections),
    })
}

async fn writer_task(mut wr: OwnedWriteHalf, mut rx: mpsc::Receiver<WriterCmd>, shared: Arc<ConnShared>) {
    let mut buf = AlignedVec::new();
    loop {
        let cmd = tokio::select! {
            _ = shared.closed.cancelled() => break,
            cmd = rx.recv() => match cmd { Some(c) => c, None => break },
        };
        let result = match cmd {
            WriterCmd::Frame(msg) => write_frame(&mut wr, &msg, &mut buf).await.map(|_| false),
            WriterCmd::Chunk(c) => write_chunk(&mut wr, &c, &mut buf).await,
        };
        match result {
            Ok(false) => {}
            Ok(true) => {
                tracing::warn!(peer = shared.peer, "fault injection: cutting the connection mid-chunk");
                break;
            }
            Err(e) => {
                tracing::debug!(peer = shared.peer, error = %e, "write failed; closing the connection");
                break;
            }
        }
    }
    shared.closed.cancel();
    let _ = wr.shutdown().await;
}

/// Writes a chunk frame and its payload with `writev`; returns true if a cut fault ended it.
async fn write_chunk(wr: &mut OwnedWriteHalf, c: &InlineChunk, buf: &mut AlignedVec) -> std::io::Result<bool> {
    encode_frame(&c.frame, buf).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string()))?;
    let limit = c.faults.cut_at.unwrap_or(u64::MAX);
    let base = c.pool.as_ptr();
    // The complement of the byte a corrupt fault targets (found before any slice is borrowed).
    let mut flipped = [0u8; 1];
    if let Some(at) = c.faults.corrupt_at {
        let mut start = 0u64;
        for &(off, len) in &c.ranges {
            if at < start + len as u64 {
                // SAFETY: off + (at - start) lies inside this checked range of the pool.
                flipped[0] = !unsafe { *base.add(off + (at - start) as usize) };
                break;
            }
            start += len as u64;
        }
    }
    let mut parts: Vec<&[u8]> = Vec::with_capacity(c.ranges.len() + 3);
    parts.push(frame_bytes(buf));
    let mut offset = 0u64;
    for &(off, len) in &c.ranges {
        // SAFETY: (off, len) was computed from checked slab offsets of this pool, which the Arc
        // keeps alive; source slabs of an in-flight push are not written (pool contract).
        let bytes = unsafe { std::slice::from_raw_parts(base.add(off), len) };
        let take = limit.saturating_sub(offset).min(len as u64) as usize;
        let bytes = &bytes[..take];
        match c.faults.corrupt_at.filter(|&at| at >= offset && at < offset + take as u64) {
            Some(at) => {
                let k = (at - offset) as usize;
                parts.push(&bytes[..k]);
                parts.push(&flipped);
                parts.push(&bytes[k + 1..]);
            }
            None => parts.push(bytes),
        }
        offset += take as u64;
        if take < len {
            break;
        }
    }
    let mut slices: Vec<IoSlice<'_>> = parts.iter().map(|p| IoSlice::new(p)).collect();
    let mut rest: &mut [IoSlice<'_>] = &mut slices;
    while !rest.is_empty() {
        let n = wr.write_vectored(&rest[..rest.len().min(MAX_IOVECS)]).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        IoSlice::advance_slices(&mut rest, n);
    }
    Ok(c.faults.cut_at.is_some())
}

async fn reader_task(mut reader: FrameReader<OwnedReadHalf>, shared: Arc<ConnShared>) {
    loop {
        let msg = tokio::select! {
            _ = shared.closed.cancelled() => break,
            m = reader.next() => m,
        };
        let routed = match msg {
            Ok(ArchivedMsg::BeginReply(r)) => to_owned(&r.refusal).map(|e| (r.transfer_id.to_native(), Event::BeginReply(e))),
            Ok(ArchivedMsg::Done(d)) => Ok((
                d.transfer_id.to_native(),
                Event::Done(d.block_checksums.iter().map(|c| c.to_native()).collect()),
            )),
            Ok(ArchivedMsg::Abort(a)) => to_owned(&a.error).map(|e| (a.transfer_id.to_native(), Event::Abort(e))),
            Ok(_) => Err(TransferError::protocol("unexpected_frame", "receiver sent a sender-only frame")),
            Err(ReadError::Invalid(e)) => Err(e),
            Err(ReadError::Io(e)) => {
                tracing::debug!(peer = shared.peer, error = %e, "connection closed");
                break;
            }
        };
        match routed {
            Ok((id, ev)) => {
                let tx = shared.routes().get(&id).cloned();
                // A full or missing route means that push already ended; the event is moot.
                if let Some(tx) = tx {
                    let _ = tx.try_send(ev);
                }
            }
            Err(e) => {
                tracing::warn!(peer = shared.peer, error = %e, "closing connection after a bad frame");
                break;
            }
        }
    }
    shared.closed.cancel();
    shared.routes().clear();
}

/// Why the chunk loop stopped early.
enum Stop {
    /// This side failed or gave up: tell the receiver with `Abort`.
    Local(TransferError),
    /// The receiver aborted: confirm with `AbortAck` once nothing is in flight.
    Remote(TransferError),
}

pub(crate) async fn run_push(net: Arc<NetShared>, src: PoolRegistration, mut d: PushDriver) {
    let result = push(&net, &src, &mut d).await;
    if let Err(e) = &result {
        tracing::debug!(peer = d.req.peer, reservation = d.req.reservation_id, error = %e, "push failed");
    }
    d.finish(result);
}

async fn push(net: &Arc<NetShared>, src: &PoolRegistration, d: &mut PushDriver) -> Result<TransferReport, TransferError> {
    let peer = d.req.peer.clone();
    let conn = d.guard(Phase::Connect, get_conn(net, &peer, src)).await?;
    if let Some(b) = d.req.dst_blocks.iter().find(|&&b| b >= conn.remote_blocks) {
        return Err(TransferError::invalid("dst_blocks", format!("block {b} >= receiver's {} blocks", conn.remote_blocks)));
    }
    let id = conn.next_transfer.fetch_add(1, Ordering::Relaxed);
    let (tx, mut events) = mpsc::channel(8);
    conn.shared.routes().insert(id, tx);
    let _route = RouteGuard(&conn.shared, id);
    let layout = *src.pool().layout();
    let begin = Begin {
        transfer_id: id,
        request_id: d.req.request_id,
        reservation_id: d.req.reservation_id,
        epoch: d.req.epoch,
        layout_fingerprint: layout.fingerprint(),
        src_blocks: d.req.src_blocks.clone(),
        dst_blocks: d.req.dst_blocks.clone(),
        layer_start: 0,
        layer_end: layout.num_layers as u32,
        mode: conn.path.mode(),
    };
    send(d, &conn, WriterCmd::Frame(Msg::Begin(begin)), Phase::Begin).await?;
    let outcome = match next_event(d, &conn, &mut events, Phase::Begin).await {
        Ok(Event::BeginReply(None)) => send_chunks(net, src, d, &conn, id, &mut events).await,
        Ok(Event::BeginReply(Some(e)) | Event::Abort(e)) => return Err(e.into_error(&peer, Phase::Begin)),
        Ok(Event::Done(_)) => Err(Stop::Local(TransferError::protocol("early_done", "Done before any chunk"))),
        Err(e) => Err(Stop::Local(e)),
    };
    let bytes = match outcome {
        Ok(bytes) => bytes,
        Err(stop) => return Err(end_with(&conn, id, stop).await),
    };
    match next_event(d, &conn, &mut events, Phase::Completion).await {
        Ok(Event::Done(block_checksums)) => {
            let data_mode = match conn.path.mode() {
                DataMode::Inline => "inline",
                DataMode::Rma => "rma",
                DataMode::Tag => "tag",
            };
            Ok(TransferReport { bytes, elapsed: d.started.elapsed(), block_checksums, data_mode })
        }
        Ok(Event::Abort(e)) => Err(end_with(&conn, id, Stop::Remote(e.into_error(&peer, Phase::Completion))).await),
        Ok(Event::BeginReply(_)) => {
            Err(end_with(&conn, id, Stop::Local(TransferError::protocol("late_begin_reply", "after chunks"))).await)
        }
        Err(e) => Err(end_with(&conn, id, Stop::Local(e)).await),
    }
}

/// Tells the receiver how this transfer ended (best effort) and returns the error.
async fn end_with(conn: &ClientConn, id: u64, stop: Stop) -> TransferError {
    let (msg, err) = match stop {
        Stop::Local(e) => (Msg::Abort(Abort { transfer_id: id, error: WireError::from_error(&e) }), e),
        Stop::Remote(e) => (Msg::AbortAck { transfer_id: id }, e),
    };
    if !matches!(err, TransferError::PeerGone { .. }) {
        let _ = tokio::time::timeout(std::time::Duration::from_secs(1), conn.out.send(WriterCmd::Frame(msg))).await;
    }
    err
}

async fn send(d: &PushDriver, conn: &ClientConn, cmd: WriterCmd, phase: Phase) -> Result<(), TransferError> {
    let closed = || TransferError::PeerGone {
        peer: conn.shared.peer.clone(),
        phase,
        reason: std::io::ErrorKind::ConnectionReset,
    };
    d.guard(phase, async { conn.out.send(cmd).await.map_err(|_| closed()) }).await
}

async fn next_event(
    d: &PushDriver,
    conn: &ClientConn,
    events: &mut mpsc::Receiver<Event>,
    phase: Phase,
) -> Result<Event, TransferError> {
    let gone = || TransferError::PeerGone {
        peer: conn.shared.peer.clone(),
        phase,
        reason: std::io::ErrorKind::ConnectionReset,
    };
    d.guard(phase, async { events.recv().await.ok_or_else(gone) }).await
}

/// A chunk whose bytes are still moving over UCX.
struct InFlight {
    /// Sent once the bytes have landed (one-sided puts); `None` when already sent.
    header: Option<Msg>,
    done: oneshot::Receiver<Result<(), TransferError>>,
}

async fn send_chunks(
    net: &Arc<NetShared>,
    src: &PoolRegistration,
    d: &mut PushDriver,
    conn: &ClientConn,
    id: u64,
    events: &mut mpsc::Receiver<Event>,
) -> Result<u64, Stop> {
    let mut inflight: VecDeque<InFlight> = VecDeque::new();
    let result = send_chunks_inner(net, src, d, conn, id, events, &mut inflight).await;
    if result.is_err() {
        // Fence: nothing of this transfer may still be moving when we tell the receiver.
        for f in inflight.drain(..) {
            let _ = tokio::time::timeout(net.config.fence_timeout, f.done).await;
        }
    }
    result
}

fn on_event(peer: &str, ev: Option<Event>) -> Stop {
    match ev {
        Some(Event::Abort(e)) => Stop::Remote(e.into_error(peer, Phase::Data)),
        Some(_) => Stop::Local(TransferError::protocol("unexpected_event", "mid-transfer reply")),
        None => Stop::Local(TransferError::PeerGone {
            peer: peer.to_string(),
            phase: Phase::Data,
            reason: std::io::ErrorKind::ConnectionReset,
        }),
    }
}

#[allow(clippy::too_many_arguments)]
async fn send_chunks_inner(
    net: &Arc<NetShared>,
    src: &PoolRegistration,
    d: &mut PushDriver,
    conn: &ClientConn,
    id: u64,
    events: &mut mpsc::Receiver<Event>,
    inflight: &mut VecDeque<InFlight>,
) -> Result<u64, Stop> {
    let pool = Arc::clone(src.pool());
    let layout = *pool.layout();
    let (layers, slab, n) = (layout.num_layers as u32, layout.slab_bytes(), d.req.src_blocks.len());
    let runs = block_runs(&d.req.src_blocks, &d.req.dst_blocks);
    let per_chunk = layers_per_chunk(slab, n, net.config.max_chunk_bytes);
    let remote_blocks = conn.remote_blocks as usize;
    let peer = conn.shared.peer.clone();
    let (mut sent, mut seq, mut offset) = (0u32, 0u32, 0u64);
    #[cfg(feature = "ucx")]
    let mut tag_index = 0u64;
    while sent < layers {
        let ready = tokio::select! {
            biased;
            ev = events.recv() => return Err(on_event(&peer, ev)),
            r = d.next_ready(sent) => r.map_err(Stop::Local)?,
        };
        let end = ready.min(sent + per_chunk);
        let chunk_bytes = (end - sent) as u64 * (n * slab) as u64;
        let faults = d.req.faults.for_chunk(seq, offset, chunk_bytes);
        if let Some(delay) = faults.delay {
            tokio::select! {
                biased;
                ev = events.recv() => return Err(on_event(&peer, ev)),
                r = d.guard(Phase::Data, async { tokio::time::sleep(delay).await; Ok(()) }) => r.map_err(Stop::Local)?,
            }
        }
        if faults.drop {
            tokio::select! {
                biased;
                ev = events.recv() => return Err(on_event(&peer, ev)),
                r = d.guard(Phase::Data, std::future::pending::<Result<(), TransferError>>()) => r.map_err(Stop::Local)?,
            }
        }
        let mut checksums = Vec::with_capacity((end - sent) as usize * n);
        let mut ranges = Vec::with_capacity((end - sent) as usize * runs.len());
        for layer in sent..end {
            for &b in &d.req.src_blocks {
                // SAFETY: source slabs of a push are not written while it is in flight (pool contract).
                let bytes = unsafe { pool.slab(layer as usize, b) }.map_err(Stop::Local)?;
                checksums.push(slab_checksum(bytes));
            }
            for run in &runs {
                let s = layout.slab_offset(pool.num_blocks(), layer as usize, run.src_start as usize);
                let t = layout.slab_offset(remote_blocks, layer as usize, run.dst_start as usize);
                ranges.push((s, t, run.len as usize * slab));
            }
        }
        let header = Msg::Chunk(Chunk {
            transfer_id: id,
            seq,
            layer_start: sent,
            layer_end: end,
            payload_bytes: chunk_bytes,
            checksums,
        });
        match &conn.path {
            SendPath::Inline => {
                let ranges = ranges.iter().map(|&(s, _, len)| (s, len)).collect();
                let cmd = WriterCmd::Chunk(InlineChunk { frame: header, pool: Arc::clone(&pool), ranges, faults });
                send(d, conn, cmd, Phase::Data).await.map_err(Stop::Local)?;
                if faults.cut_at.is_some() {
                    return Err(Stop::Local(cut_error(&peer)));
                }
            }
            #[cfg(feature = "ucx")]
            SendPath::Ucx(ucx) => {
                let moving = ucx.send_chunk(id, tag_index, &pool, &ranges, faults).await.map_err(Stop::Local)?;
                tag_index += ranges.len() as u64;
                let header = match ucx.mode() {
                    DataMode::Tag => {
                        send(d, conn, WriterCmd::Frame(header), Phase::Data).await.map_err(Stop::Local)?;
                        None
                    }
                    _ => Some(header),
                };
                inflight.push_back(InFlight { header, done: moving });
                if faults.cut_at.is_some() {
                    conn.shared.closed.cancel();
                    ucx.close();
                    return Err(Stop::Local(cut_error(&peer)));
                }
            }
        }
        offset += chunk_bytes;
        seq += 1;
        sent = end;
        while inflight.len() >= net.config.chunks_in_flight {
            complete_front(net, d, conn, inflight).await?;
        }
    }
    while !inflight.is_empty() {
        complete_front(net, d, conn, inflight).await?;
    }
    Ok(offset)
}

fn cut_error(peer: &str) -> TransferError {
    TransferError::PeerGone { peer: peer.to_string(), phase: Phase::Data, reason: std::io::ErrorKind::ConnectionReset }
}

/// Waits for the oldest in-flight chunk's bytes to land, then sends its header if it has one.
async fn complete_front(
    net: &Arc<NetShared>,
    d: &PushDriver,
    conn: &ClientConn,
    inflight: &mut VecDeque<InFlight>,
) -> Result<(), Stop> {
    let front = inflight.front_mut().expect("called with a non-empty queue");
    // Not cut short by the deadline: a fence needs the bytes to have stopped moving anyway.
    let landed = tokio::time::timeout(net.config.fence_timeout.max(d.req.deadline), &mut front.done).await;
    let f = inflight.pop_front().expect("non-empty");
    match landed {
        Ok(Ok(Ok(()))) => {}
        Ok(Ok(Err(e))) => return Err(Stop::Local(e)),
        Ok(Err(_)) => return Err(Stop::Local(TransferError::Shutdown)),
        Err(_) => return Err(Stop::Local(cut_error(&conn.shared.peer))),
    }
    if let Some(h) = f.header {
        send(d, conn, WriterCmd::Frame(h), Phase::Data).await.map_err(Stop::Local)?;
    }
    Ok(())
}
