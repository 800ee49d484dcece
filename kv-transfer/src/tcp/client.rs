//! The per-push task of the stream protocol: begin, plan chunks, checksum them, move them (in
//! the stream or over the connection's data path), and end with `Done`, or with
//! `Abort`/`AbortAck` after a fence.
//!
//! Every chunk takes the same steps: wait for its layers (a receiver event ends the push at any
//! wait), injected stalls, then one sender per data path: `send_inline` (frame + `writev`),
//! `copy_mapped` (fused copy and checksum into a mapped peer pool) or `start_moving` (puts or
//! tagged sends, finished later by `complete_front`). Invariant: when the chunk loop fails,
//! every chunk whose bytes may still be moving is in its `inflight` queue, and `send_chunks`
//! fences them all before the receiver is told (`Abort`/`AbortAck`).

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use tandem_kv_layout::KvLayout;
use tokio::sync::{mpsc, oneshot};

use super::NetShared;
use super::conn::{ClientConn, Event, InlineChunk, RouteGuard, SendPath, WriterCmd, get_conn};
use crate::datapath::PeerDataPath;
use crate::error::{Phase, TransferError};
use crate::fault::ChunkFaults;
use crate::pool::{BlockRun, KvPool, block_runs};
use crate::transport::{PoolRegistration, PushDriver, TransferReport, layers_per_chunk};
use crate::wire::{Abort, Begin, Chunk, DataMode, Msg, WireError};

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

async fn push(
    net: &Arc<NetShared>,
    src: &PoolRegistration,
    d: &mut PushDriver,
) -> Result<TransferReport, TransferError> {
    let peer = d.req.peer.clone();
    let conn = d.guard(Phase::Connect, get_conn(net, &peer, src)).await?;
    if let Some(b) = d.req.dst_blocks.iter().find(|&&b| b >= conn.remote_blocks) {
        return Err(TransferError::invalid(
            "dst_blocks",
            format!("block {b} >= receiver's {} blocks", conn.remote_blocks),
        ));
    }
    let id = conn.next_transfer.fetch_add(1, Ordering::Relaxed);
    let (tx, mut events) = mpsc::channel(8);
    conn.shared.routes().insert(id, tx);
    let _route = RouteGuard(&conn.shared, id);
    let layout = *src.pool().layout();
    let begin = Begin {
        transfer_id: id,
        request_id: d.req.request_id,
        trace_context: d.req.trace_context.clone(),
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
        Ok(Event::BeginReply(Some(e))) => return Err(e.into_error(&peer, Phase::Begin)),
        // Accepted, then aborted at once (expiry, cancel): the receiver waits for our ack.
        Ok(Event::Abort(e)) => Err(Stop::Remote(e.into_error(&peer, Phase::Begin))),
        Ok(Event::Done(_)) => Err(Stop::Local(TransferError::protocol(
            "early_done",
            "Done before any chunk",
        ))),
        Err(e) => Err(Stop::Local(e)),
    };
    let bytes = match outcome {
        Ok(bytes) => bytes,
        Err(stop) => return Err(end_with(&conn, id, stop).await),
    };
    match next_event(d, &conn, &mut events, Phase::Completion).await {
        Ok(Event::Done(block_checksums)) => {
            let data_mode = conn.path.label();
            Ok(TransferReport {
                bytes,
                elapsed: d.started.elapsed(),
                block_checksums,
                data_mode,
            })
        }
        Ok(Event::Abort(e)) => Err(end_with(
            &conn,
            id,
            Stop::Remote(e.into_error(&peer, Phase::Completion)),
        )
        .await),
        Ok(Event::BeginReply(_)) => Err(end_with(
            &conn,
            id,
            Stop::Local(TransferError::protocol("late_begin_reply", "after chunks")),
        )
        .await),
        Err(e) => Err(end_with(&conn, id, Stop::Local(e)).await),
    }
}

/// Tells the receiver how this transfer ended (best effort) and returns the error.
async fn end_with(conn: &ClientConn, id: u64, stop: Stop) -> TransferError {
    let (msg, err) = match stop {
        Stop::Local(e) => (
            Msg::Abort(Abort {
                transfer_id: id,
                error: WireError::from_error(&e),
            }),
            e,
        ),
        Stop::Remote(e) => (Msg::AbortAck { transfer_id: id }, e),
    };
    if !matches!(err, TransferError::PeerGone { .. }) {
        let _ = tokio::time::timeout(
            std::time::Duration::from_secs(1),
            conn.out.send(WriterCmd::Frame(msg)),
        )
        .await;
    }
    err
}

async fn send(
    d: &PushDriver,
    conn: &ClientConn,
    cmd: WriterCmd,
    phase: Phase,
) -> Result<(), TransferError> {
    let closed = || TransferError::PeerGone {
        peer: conn.shared.peer.clone(),
        phase,
        reason: std::io::ErrorKind::ConnectionReset,
    };
    d.guard(phase, async {
        conn.out.send(cmd).await.map_err(|_| closed())
    })
    .await
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
    d.guard(phase, async { events.recv().await.ok_or_else(gone) })
        .await
}

/// A chunk whose bytes are still moving over the data path.
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
        Some(_) => Stop::Local(TransferError::protocol(
            "unexpected_event",
            "mid-transfer reply",
        )),
        None => Stop::Local(TransferError::PeerGone {
            peer: peer.to_string(),
            phase: Phase::Data,
            reason: std::io::ErrorKind::ConnectionReset,
        }),
    }
}

/// Sends every chunk of transfer `id` as its layers become ready, keeping at most
/// `chunks_in_flight` chunks moving over the data path; returns the payload bytes sent. On
/// `Err`, chunks may still be moving (left in `inflight`): the caller fences them before telling
/// the receiver.
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
    let plan = ChunkPlan::new(net, src, d, conn);
    let peer = conn.shared.peer.clone();
    let (mut sent, mut seq, mut offset) = (0u32, 0u32, 0u64);
    let mut first_range = 0u64;
    while sent < plan.layers {
        let ready = unless_event(&peer, events, d.next_ready(sent)).await?;
        let end = ready.min(sent + plan.per_chunk);
        let bytes = plan.chunk_bytes(sent, end);
        let chunk = PlannedChunk {
            transfer_id: id,
            seq,
            start: sent,
            end,
            bytes,
            faults: d.req.faults.for_chunk(seq, offset, bytes),
            first_range,
        };
        stall_for_faults(d, &peer, events, &chunk.faults).await?;
        let ranges = plan.ranges(sent, end);
        match &conn.path {
            SendPath::Inline => send_inline(d, conn, &plan, &chunk, &ranges).await?,
            SendPath::DataPath(path) if path.mapped() => {
                copy_mapped(d, conn, path.as_ref(), &plan, &chunk, ranges).await?;
            }
            SendPath::DataPath(path) => {
                start_moving(d, conn, path.as_ref(), &plan, &chunk, &ranges, inflight).await?;
                first_range += ranges.len() as u64;
            }
        }
        offset += bytes;
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

/// The loop-invariant facts of one push: what it sends, in chunks of how many layers, and
/// where each slab lies in both pools.
struct ChunkPlan {
    pool: Arc<KvPool>,
    layout: KvLayout,
    /// Layers pushed (every layer of the layout).
    layers: u32,
    /// Bytes of one (layer, block) slab.
    slab: usize,
    /// Blocks pushed.
    blocks: usize,
    /// Source and destination block runs (contiguous in both pools).
    runs: Vec<BlockRun>,
    /// Most layers in one chunk (under `max_chunk_bytes`).
    per_chunk: u32,
    /// Large enough for non-temporal stores when copying into a mapped peer pool.
    streaming: bool,
    /// Blocks in the receiver's pool (its slab offsets depend on it).
    remote_blocks: usize,
}

impl ChunkPlan {
    fn new(net: &NetShared, src: &PoolRegistration, d: &PushDriver, conn: &ClientConn) -> Self {
        let pool = Arc::clone(src.pool());
        let layout = *pool.layout();
        let (layers, slab, blocks) = (
            layout.num_layers as u32,
            layout.slab_bytes(),
            d.req.src_blocks.len(),
        );
        Self {
            runs: block_runs(&d.req.src_blocks, &d.req.dst_blocks),
            per_chunk: layers_per_chunk(slab, blocks, layers as usize, net.config.max_chunk_bytes),
            streaming: (layers as usize * blocks * slab) as u64
                >= net.config.streaming_store_min_transfer_bytes as u64,
            remote_blocks: conn.remote_blocks as usize,
            pool,
            layout,
            layers,
            slab,
            blocks,
        }
    }

    /// Payload bytes of layers `start..end`.
    fn chunk_bytes(&self, start: u32, end: u32) -> u64 {
        (end - start) as u64 * (self.blocks * self.slab) as u64
    }

    /// `(source offset, destination offset, length)` of every run of layers `start..end`, in
    /// payload order (layer-major, then run). Offsets lie inside the pools: block ids were
    /// checked against both pools before the push began.
    fn ranges(&self, start: u32, end: u32) -> Vec<(usize, usize, usize)> {
        let mut ranges = Vec::with_capacity((end - start) as usize * self.runs.len());
        let (layout, local_blocks) = (&self.layout, self.pool.num_blocks());
        for layer in (start..end).map(|l| l as usize) {
            for run in &self.runs {
                let s = layout.slab_offset(local_blocks, layer, run.src_start as usize);
                let t = layout.slab_offset(self.remote_blocks, layer, run.dst_start as usize);
                ranges.push((s, t, run.len as usize * self.slab));
            }
        }
        ranges
    }
}

/// One chunk of a push: layers `start..end` of every block, and the faults injected into it.
struct PlannedChunk {
    transfer_id: u64,
    seq: u32,
    start: u32,
    end: u32,
    /// Payload bytes.
    bytes: u64,
    faults: ChunkFaults,
    /// Index of its first range among the transfer's ranges (numbers tagged sends).
    first_range: u64,
}

impl PlannedChunk {
    /// Its `Chunk` frame, carrying the sender's slab checksums.
    fn frame(&self, checksums: Vec<u64>) -> Msg {
        Msg::Chunk(Chunk {
            transfer_id: self.transfer_id,
            seq: self.seq,
            layer_start: self.start,
            layer_end: self.end,
            payload_bytes: self.bytes,
            checksums,
        })
    }
}

/// Runs `step` unless the receiver speaks first: mid-transfer, any event from it (checked
/// first) ends the push, and so does `step` failing.
async fn unless_event<T>(
    peer: &str,
    events: &mut mpsc::Receiver<Event>,
    step: impl Future<Output = Result<T, TransferError>>,
) -> Result<T, Stop> {
    tokio::select! {
        biased;
        ev = events.recv() => Err(on_event(peer, ev)),
        r = step => r.map_err(Stop::Local),
    }
}

/// Injected stalls, before any of a chunk's bytes move: a delay sleeps, a drop never sends (the
/// push then ends at its deadline, on cancel, or at the receiver's abort, which still ends it
/// at once).
async fn stall_for_faults(
    d: &PushDriver,
    peer: &str,
    events: &mut mpsc::Receiver<Event>,
    faults: &ChunkFaults,
) -> Result<(), Stop> {
    if let Some(delay) = faults.delay {
        let sleep = async {
            tokio::time::sleep(delay).await;
            Ok(())
        };
        unless_event(peer, events, d.guard(Phase::Data, sleep)).await?;
    }
    if faults.drop {
        let never = std::future::pending::<Result<(), TransferError>>();
        unless_event(peer, events, d.guard(Phase::Data, never)).await?;
    }
    Ok(())
}

/// Inline path: checksums the source slabs, then hands the writer task the `Chunk` frame and
/// the slab ranges to `writev` from the pool. A cut fault ends the push once the writer has
/// the (truncated) chunk.
async fn send_inline(
    d: &PushDriver,
    conn: &ClientConn,
    plan: &ChunkPlan,
    chunk: &PlannedChunk,
    ranges: &[(usize, usize, usize)],
) -> Result<(), Stop> {
    let checksums = source_checksums(&plan.pool, &d.req.src_blocks, chunk.start, chunk.end)
        .map_err(Stop::Local)?;
    let cmd = WriterCmd::Chunk(InlineChunk {
        frame: chunk.frame(checksums),
        pool: Arc::clone(&plan.pool),
        ranges: ranges.iter().map(|&(s, _, len)| (s, len)).collect(),
        faults: chunk.faults,
    });
    send(d, conn, cmd, Phase::Data).await.map_err(Stop::Local)?;
    if chunk.faults.cut_at.is_some() {
        return Err(Stop::Local(cut_error(&conn.shared.peer)));
    }
    Ok(())
}

/// Mapped path (the peer's pool is mapped here): copies and hashes the chunk in one pass, then
/// commits it with its `Chunk` frame. Nothing is left moving when this returns. A cut fault
/// closes the connection instead of committing.
async fn copy_mapped(
    d: &PushDriver,
    conn: &ClientConn,
    path: &dyn PeerDataPath,
    plan: &ChunkPlan,
    chunk: &PlannedChunk,
    ranges: Vec<(usize, usize, usize)>,
) -> Result<(), Stop> {
    let checksums = path
        .copy_chunk(&plan.pool, ranges, plan.slab, plan.streaming, chunk.faults)
        .await
        .map_err(Stop::Local)?;
    if chunk.faults.cut_at.is_some() {
        return Err(cut_connection(conn, path));
    }
    let frame = WriterCmd::Frame(chunk.frame(checksums));
    send(d, conn, frame, Phase::Data).await.map_err(Stop::Local)
}

/// Puts or tagged sends: checksums the source, starts the bytes moving and queues the chunk
/// in `inflight` (unless sending its frame fails). In tag mode the `Chunk` frame goes at once
/// (the receiver posts its receives on seeing it); after puts it waits until they have landed
/// (see [`complete_front`]). A cut fault closes the connection.
async fn start_moving(
    d: &PushDriver,
    conn: &ClientConn,
    path: &dyn PeerDataPath,
    plan: &ChunkPlan,
    chunk: &PlannedChunk,
    ranges: &[(usize, usize, usize)],
    inflight: &mut VecDeque<InFlight>,
) -> Result<(), Stop> {
    let checksums = source_checksums(&plan.pool, &d.req.src_blocks, chunk.start, chunk.end)
        .map_err(Stop::Local)?;
    let moving = path
        .send_chunk(
            chunk.transfer_id,
            chunk.first_range,
            &plan.pool,
            ranges,
            chunk.faults,
        )
        .await
        .map_err(Stop::Local)?;
    let header = match path.mode() {
        DataMode::Tag => {
            let frame = WriterCmd::Frame(chunk.frame(checksums));
            send(d, conn, frame, Phase::Data)
                .await
                .map_err(Stop::Local)?;
            None
        }
        _ => Some(chunk.frame(checksums)),
    };
    inflight.push_back(InFlight {
        header,
        done: moving,
    });
    if chunk.faults.cut_at.is_some() {
        return Err(cut_connection(conn, path));
    }
    Ok(())
}

/// A cut fault on the data path: the control connection and the path close as a dead peer's
/// would.
fn cut_connection(conn: &ClientConn, path: &dyn PeerDataPath) -> Stop {
    conn.shared.closed.cancel();
    path.close();
    Stop::Local(cut_error(&conn.shared.peer))
}

/// XXH3 of every source slab of layers `start..end`, layer-major (the `Chunk` order).
fn source_checksums(
    pool: &KvPool,
    blocks: &[u32],
    start: u32,
    end: u32,
) -> Result<Vec<u64>, TransferError> {
    // SAFETY: source slabs of a push are not written while it is in flight (pool contract).
    unsafe { pool.slab_checksums(start..end, blocks) }
}

fn cut_error(peer: &str) -> TransferError {
    TransferError::PeerGone {
        peer: peer.to_string(),
        phase: Phase::Data,
        reason: std::io::ErrorKind::ConnectionReset,
    }
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
    let landed = tokio::time::timeout(
        net.config.fence_timeout.max(d.req.deadline),
        &mut front.done,
    )
    .await;
    let f = inflight.pop_front().expect("non-empty");
    match landed {
        Ok(Ok(Ok(()))) => {}
        Ok(Ok(Err(e))) => return Err(Stop::Local(e)),
        Ok(Err(_)) => return Err(Stop::Local(TransferError::Shutdown)),
        Err(_) => return Err(Stop::Local(cut_error(&conn.shared.peer))),
    }
    if let Some(h) = f.header {
        send(d, conn, WriterCmd::Frame(h), Phase::Data)
            .await
            .map_err(Stop::Local)?;
    }
    Ok(())
}
