//! The sending side's connections: one per (peer, layout), with a writer task (frames and
//! `writev` of slab bytes) and a reader task (routes replies to pushes).
//!
//! A push task never holds the connection's socket: it sends commands to the writer task over a
//! bounded channel (backpressure reaches the push when the socket is full) and receives its own
//! events (`BeginReply`, `Done`, `Abort`) from the reader task through a per-transfer route.
//! When the connection ends, the reader drops every route, so every push on it sees `PeerGone`.

use std::collections::HashMap;
use std::io::IoSlice;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use rkyv::util::AlignedVec;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::NetShared;
use crate::datapath::{self, PeerDataPath};
use crate::error::{Phase, TransferError};
use crate::fault::ChunkFaults;
use crate::metrics::{Live, LiveGuard};
use crate::pool::KvPool;
use crate::transport::PoolRegistration;
use crate::wire::{
    ArchivedMsg, DataMode, FrameReader, Hello, HelloReply, Msg, ReadError, WireError, encode_frame,
    frame_bytes, to_owned, write_frame,
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
    pub(super) frame: Msg,
    pub(super) pool: Arc<KvPool>,
    /// (source pool offset, length) in payload order.
    pub(super) ranges: Vec<(usize, usize)>,
    pub(super) faults: ChunkFaults,
}

/// How block bytes leave this connection.
pub(crate) enum SendPath {
    /// In the TCP stream.
    Inline,
    /// Over the transport's data path (the stream carries control frames only).
    DataPath(Box<dyn PeerDataPath>),
}

impl SendPath {
    pub(super) fn mode(&self) -> DataMode {
        match self {
            SendPath::Inline => DataMode::Inline,
            SendPath::DataPath(p) => p.mode(),
        }
    }

    /// How bytes travel, for reports and logs: `inline`, or the data path's label (`rma`,
    /// `rma-mapped` or `tag`: see [`PeerDataPath::label`]).
    pub(super) fn label(&self) -> &'static str {
        match self {
            SendPath::Inline => "inline",
            SendPath::DataPath(p) => p.label(),
        }
    }
}

/// What the reader task routes to a push.
pub(crate) enum Event {
    BeginReply(Option<WireError>),
    Done(Vec<u64>),
    Abort(WireError),
}

pub(super) struct ConnShared {
    pub(super) peer: String,
    pub(super) routes: Mutex<HashMap<u64, mpsc::Sender<Event>>>,
    pub(super) closed: CancellationToken,
}

impl ConnShared {
    pub(super) fn routes(&self) -> std::sync::MutexGuard<'_, HashMap<u64, mpsc::Sender<Event>>> {
        self.routes.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// One open connection to a receiver, shared by every push to it.
pub(crate) struct ClientConn {
    pub(super) shared: Arc<ConnShared>,
    pub(super) out: mpsc::Sender<WriterCmd>,
    pub(super) path: SendPath,
    pub(super) remote_blocks: u32,
    pub(super) next_transfer: AtomicU64,
    _live: LiveGuard,
}

impl Drop for ClientConn {
    fn drop(&mut self) {
        self.shared.closed.cancel();
    }
}

pub(super) struct RouteGuard<'a>(pub(super) &'a ConnShared, pub(super) u64);

impl Drop for RouteGuard<'_> {
    fn drop(&mut self) {
        self.0.routes().remove(&self.1);
    }
}

fn peer_gone(peer: &str, phase: Phase, e: &std::io::Error) -> TransferError {
    TransferError::PeerGone {
        peer: peer.to_string(),
        phase,
        reason: e.kind(),
    }
}

pub(super) async fn get_conn(
    net: &Arc<NetShared>,
    peer: &str,
    src: &PoolRegistration,
) -> Result<Arc<ClientConn>, TransferError> {
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
    // (and its gauge unit, data-path endpoint and tasks) goes once its last push lets go of it.
    let (weak_net, shared) = (Arc::downgrade(net), Arc::clone(&c.shared));
    tokio::spawn(async move {
        shared.closed.cancelled().await;
        if let Some(net) = weak_net.upgrade() {
            let mut conns = net.conns.lock().await;
            if conns
                .get(&key)
                .is_some_and(|c| Arc::ptr_eq(&c.shared, &shared))
            {
                conns.remove(&key);
            }
        }
    });
    Ok(c)
}

async fn connect(
    net: &Arc<NetShared>,
    peer: &str,
    src: &PoolRegistration,
) -> Result<ClientConn, TransferError> {
    let data_path = net.data_path();
    let layout = *src.pool().layout();
    let handshake = async {
        let stream = TcpStream::connect(peer)
            .await
            .map_err(|source| TransferError::Connect {
                peer: peer.to_string(),
                source,
            })?;
        stream
            .set_nodelay(true)
            .map_err(|e| peer_gone(peer, Phase::Connect, &e))?;
        let same_host = match (stream.local_addr(), stream.peer_addr()) {
            (Ok(l), Ok(p)) => p.ip().is_loopback() || l.ip() == p.ip(),
            _ => false,
        };
        let (rd, mut wr) = stream.into_split();
        let mut reader = FrameReader::new(rd);
        let device_uuid = data_path.map(|p| p.device_uuid()).unwrap_or_default();
        let hello = Msg::Hello(Hello::new(&layout, data_path.is_some(), device_uuid));
        let mut buf = AlignedVec::new();
        write_frame(&mut wr, &hello, &mut buf)
            .await
            .map_err(|e| peer_gone(peer, Phase::Connect, &e))?;
        let reply: HelloReply = match reader.next().await {
            Ok(ArchivedMsg::HelloReply(r)) => to_owned(r)?,
            Ok(_) => {
                return Err(TransferError::protocol(
                    "expected_hello_reply",
                    "another frame came first",
                ));
            }
            Err(ReadError::Io(e)) => return Err(peer_gone(peer, Phase::Connect, &e)),
            Err(ReadError::Invalid(e)) => return Err(e),
        };
        Ok((reader, wr, reply, same_host))
    };
    let timeout = net.config.connect_timeout;
    let (reader, wr, reply, same_host) =
        tokio::time::timeout(timeout, handshake)
            .await
            .map_err(|_| TransferError::DeadlineExceeded {
                phase: Phase::Connect,
                deadline: timeout,
            })??;
    let remote_blocks = match &reply {
        HelloReply::Accepted { pool_blocks, .. } => *pool_blocks,
        HelloReply::Refused(e) => return Err(e.clone().into_error(peer, Phase::Connect)),
    };
    let path = match datapath::open(data_path, peer, &reply, same_host).await? {
        None => SendPath::Inline,
        Some(p) => SendPath::DataPath(p),
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

async fn writer_task(
    mut wr: OwnedWriteHalf,
    mut rx: mpsc::Receiver<WriterCmd>,
    shared: Arc<ConnShared>,
) {
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
                tracing::warn!(
                    peer = shared.peer,
                    "fault injection: cutting the connection mid-chunk"
                );
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
async fn write_chunk(
    wr: &mut OwnedWriteHalf,
    c: &InlineChunk,
    buf: &mut AlignedVec,
) -> std::io::Result<bool> {
    encode_frame(&c.frame, buf)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string()))?;
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
        match c
            .faults
            .corrupt_at
            .filter(|&at| at >= offset && at < offset + take as u64)
        {
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
        let n = wr
            .write_vectored(&rest[..rest.len().min(MAX_IOVECS)])
            .await?;
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
            Ok(ArchivedMsg::BeginReply(r)) => {
                to_owned(&r.refusal).map(|e| (r.transfer_id.to_native(), Event::BeginReply(e)))
            }
            Ok(ArchivedMsg::Done(d)) => Ok((
                d.transfer_id.to_native(),
                Event::Done(d.block_checksums.iter().map(|c| c.to_native()).collect()),
            )),
            Ok(ArchivedMsg::Abort(a)) => {
                to_owned(&a.error).map(|e| (a.transfer_id.to_native(), Event::Abort(e)))
            }
            Ok(_) => Err(TransferError::protocol(
                "unexpected_frame",
                "receiver sent a sender-only frame",
            )),
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
