//! The per-push task of the stream protocol: begin, plan chunks, checksum them, move them (in
//! the stream or over UCX), and end with `Done`, or with `Abort`/`AbortAck` after a fence.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use tokio::sync::{mpsc, oneshot};

use super::NetShared;
use super::conn::{ClientConn, Event, InlineChunk, RouteGuard, SendPath, WriterCmd, get_conn};
use crate::error::{Phase, TransferError};
use crate::pool::{KvPool, block_runs};
use crate::transport::{PoolRegistration, PushDriver, TransferReport, layers_per_chunk};
#[cfg(feature = "ucx")]
use crate::wire::DataMode;
use crate::wire::{Abort, Begin, Chunk, Msg, WireError};

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
    let (layers, slab, n) = (
        layout.num_layers as u32,
        layout.slab_bytes(),
        d.req.src_blocks.len(),
    );
    let runs = block_runs(&d.req.src_blocks, &d.req.dst_blocks);
    let per_chunk = layers_per_chunk(slab, n, layers as usize, net.config.max_chunk_bytes);
    #[cfg(feature = "ucx")]
    let streaming =
        (layers as usize * n * slab) as u64 >= net.config.streaming_store_min_transfer_bytes as u64;
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
        let mut ranges = Vec::with_capacity((end - sent) as usize * runs.len());
        for layer in sent..end {
            for run in &runs {
                let s =
                    layout.slab_offset(pool.num_blocks(), layer as usize, run.src_start as usize);
                let t = layout.slab_offset(remote_blocks, layer as usize, run.dst_start as usize);
                ranges.push((s, t, run.len as usize * slab));
            }
        }
        let chunk = |checksums| {
            Msg::Chunk(Chunk {
                transfer_id: id,
                seq,
                layer_start: sent,
                layer_end: end,
                payload_bytes: chunk_bytes,
                checksums,
            })
        };
        match &conn.path {
            SendPath::Inline => {
                let checksums =
                    source_checksums(&pool, &d.req.src_blocks, sent, end).map_err(Stop::Local)?;
                let ranges = ranges.iter().map(|&(s, _, len)| (s, len)).collect();
                let cmd = WriterCmd::Chunk(InlineChunk {
                    frame: chunk(checksums),
                    pool: Arc::clone(&pool),
                    ranges,
                    faults,
                });
                send(d, conn, cmd, Phase::Data).await.map_err(Stop::Local)?;
                if faults.cut_at.is_some() {
                    return Err(Stop::Local(cut_error(&peer)));
                }
            }
            #[cfg(feature = "ucx")]
            SendPath::Ucx(ucx) if ucx.mapped() => {
                // The peer's pool is mapped here: copy and hash in one pass, then commit.
                let checksums = ucx
                    .copy_chunk(&pool, ranges, slab, streaming, faults)
                    .await
                    .map_err(Stop::Local)?;
                if faults.cut_at.is_some() {
                    conn.shared.closed.cancel();
                    ucx.close();
                    return Err(Stop::Local(cut_error(&peer)));
                }
                send(d, conn, WriterCmd::Frame(chunk(checksums)), Phase::Data)
                    .await
                    .map_err(Stop::Local)?;
            }
            #[cfg(feature = "ucx")]
            SendPath::Ucx(ucx) => {
                let checksums =
                    source_checksums(&pool, &d.req.src_blocks, sent, end).map_err(Stop::Local)?;
                let moving = ucx
                    .send_chunk(id, tag_index, &pool, &ranges, faults)
                    .await
                    .map_err(Stop::Local)?;
                tag_index += ranges.len() as u64;
                let header = match ucx.mode() {
                    DataMode::Tag => {
                        send(d, conn, WriterCmd::Frame(chunk(checksums)), Phase::Data)
                            .await
                            .map_err(Stop::Local)?;
                        None
                    }
                    _ => Some(chunk(checksums)),
                };
                inflight.push_back(InFlight {
                    header,
                    done: moving,
                });
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
