//! The receiving side of the stream protocol: accept loop, per-connection task, landing bytes.
//!
//! Each connection task owns the read half and runs one `select!` over: the next frame (the
//! reader is cancel-safe), the oldest tagged receive still landing, and its kill token. The
//! write half belongs to a writer task fed by a bounded channel, which is also how the
//! [`InboundRegistry`] reaches the connection to abort a transfer (expiry, cancel, bad checksum).
//!
//! Fence rule: a claimed session is finished only when its writer can no longer write into the
//! destination blocks: the sender confirmed (`AbortAck`), aborted itself after its own fence
//! (`Abort`), completed, or the connection is gone and every receive posted into those blocks
//! has been cancelled.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use rkyv::util::AlignedVec;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc};
use tokio_util::sync::CancellationToken;

use super::NetShared;
use crate::datapath::{self, Completion, Offer};
use crate::error::{FailureKind, Phase, TransferError};
use crate::inbound::{AbortHook, InboundRegistry, InboundSession};
use crate::metrics::Live;
use crate::wire::{
    Abort, ArchivedMsg, Begin, BeginReply, DataMode, FrameReader, Hello, HelloReply, Msg,
    PROTOCOL_VERSION, ReadError, WireError, to_owned, write_frame,
};

pub(crate) async fn serve(
    net: Arc<NetShared>,
    listener: TcpListener,
    registry: InboundRegistry,
    shutdown: CancellationToken,
) -> Result<(), TransferError> {
    let limit = Arc::new(Semaphore::new(net.config.max_connections));
    let mut conn_id = 0u32;
    loop {
        // Permit before accept: past the limit, connections wait in the kernel's backlog.
        let permit = tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            p = Arc::clone(&limit).acquire_owned() => p.expect("the semaphore is never closed"),
        };
        let (stream, addr) = tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    continue;
                }
            },
        };
        conn_id = (conn_id % 0xFFFF) + 1; // 16 bits, never 0: part of the data path's tags
        let (net, registry, kill) = (Arc::clone(&net), registry.clone(), shutdown.child_token());
        tokio::spawn(async move {
            let _permit = permit;
            handle(net, stream, addr.to_string(), registry, conn_id, kill).await;
        });
    }
}

struct ServerHook {
    out: mpsc::Sender<Msg>,
    kill: CancellationToken,
}

impl AbortHook for ServerHook {
    fn request_abort(&self, transfer_id: u64, error: WireError) {
        if self
            .out
            .try_send(Msg::Abort(Abort { transfer_id, error }))
            .is_err()
        {
            // Cannot even say it: the connection is stuck or gone, so end it.
            self.kill.cancel();
        }
    }

    fn kill(&self) {
        self.kill.cancel();
    }
}

/// Checks a sender's `Hello` (protocol version, layout) and answers its data-path request:
/// `Ok` carries the offer to send back (`None`: bytes stay in the stream).
fn check_hello(
    net: &NetShared,
    registry: &InboundRegistry,
    hello: &Hello,
) -> Result<Option<Offer>, TransferError> {
    if hello.protocol_version != PROTOCOL_VERSION {
        return Err(TransferError::protocol(
            "protocol_version",
            format!("peer speaks {}", hello.protocol_version),
        ));
    }
    let local = *registry.registration().pool().layout();
    let same = hello.layout.to_layout().is_some_and(|l| l == local)
        && hello.layout_fingerprint == local.fingerprint();
    if !same {
        return Err(TransferError::LayoutMismatch {
            local: local.fingerprint(),
            remote: hello.layout_fingerprint,
        });
    }
    datapath::answer_hello(net.data_path(), registry.registration(), hello)
}

async fn handle(
    net: Arc<NetShared>,
    stream: TcpStream,
    peer: String,
    registry: InboundRegistry,
    conn_id: u32,
    kill: CancellationToken,
) {
    let _live = net.metrics.live_guard(Live::Connections);
    let _ = stream.set_nodelay(true);
    let (rd, mut wr) = stream.into_split();
    let mut reader = FrameReader::new(rd);
    let hello: Hello = match tokio::time::timeout(net.config.connect_timeout, reader.next()).await {
        Ok(Ok(ArchivedMsg::Hello(h))) => match to_owned(h) {
            Ok(h) => h,
            Err(e) => return tracing::debug!(peer, error = %e, "bad hello"),
        },
        _ => return tracing::debug!(peer, "connection closed before a valid hello"),
    };
    let mut buf = AlignedVec::new();
    let offer = match check_hello(&net, &registry, &hello) {
        Ok(offer) => offer,
        Err(e) => {
            tracing::warn!(peer, error = %e, "refusing connection");
            net.metrics.failed(&e);
            let _ = write_frame(
                &mut wr,
                &Msg::HelloReply(HelloReply::Refused(WireError::from_error(&e))),
                &mut buf,
            )
            .await;
            return;
        }
    };
    let data_path_allowed = offer.is_some();
    let landing_device = if data_path_allowed {
        net.data_path().and_then(|p| p.landing_device())
    } else {
        None
    };
    let pool_blocks = registry.registration().pool().num_blocks() as u32;
    let reply = HelloReply::accepted(conn_id, pool_blocks, offer);
    if write_frame(&mut wr, &Msg::HelloReply(reply), &mut buf)
        .await
        .is_err()
    {
        return;
    }
    let (out, out_rx) = mpsc::channel(64);
    tokio::spawn(writer_task(wr, out_rx, kill.clone()));
    let hook: Arc<dyn AbortHook> = Arc::new(ServerHook {
        out: out.clone(),
        kill: kill.clone(),
    });
    let mut conn = ServerConn {
        net,
        registry,
        peer,
        conn_id,
        data_path_allowed,
        landing_device,
        mode: None,
        hook,
        out,
        kill,
        sessions: HashMap::new(),
        landing: VecDeque::new(),
        scratch: Vec::new(),
    };
    let end = conn.run(&mut reader).await;
    conn.teardown(end).await;
}

async fn writer_task(mut wr: OwnedWriteHalf, mut rx: mpsc::Receiver<Msg>, kill: CancellationToken) {
    let mut buf = AlignedVec::new();
    loop {
        let msg = tokio::select! {
            _ = kill.cancelled() => break,
            m = rx.recv() => match m { Some(m) => m, None => break },
        };
        if write_frame(&mut wr, &msg, &mut buf).await.is_err() {
            kill.cancel();
            break;
        }
    }
    let _ = tokio::io::AsyncWriteExt::shutdown(&mut wr).await;
}

/// A claimed transfer on this connection.
pub(super) struct Active {
    pub(super) session: InboundSession,
    /// Index of the next range posted on the data path (tag mode), in the sender's numbering.
    pub(super) tag_index: u64,
}

/// A chunk still landing or being verified, in arrival order.
pub(super) struct Landing {
    pub(super) transfer_id: u64,
    pub(super) layer_start: u32,
    pub(super) layer_end: u32,
    /// The sender's checksums.
    pub(super) checksums: Vec<u64>,
    /// Into scratch memory (a transfer being drained), not into destination blocks.
    pub(super) discard: bool,
    pub(super) done: LandingDone,
}

/// What a [`Landing`] waits for.
pub(super) enum LandingDone {
    /// Tagged receives into the destination slabs (hashed once they complete).
    Received(Completion),
    /// Bytes already landed; their checksums computed on a blocking thread, so the connection
    /// keeps reading the next chunk meanwhile.
    Hashed(tokio::task::JoinHandle<Result<Vec<u64>, TransferError>>),
}

impl LandingDone {
    /// Waits for it: `Some(checksums)` when already hashed.
    async fn wait(&mut self) -> Result<Option<Vec<u64>>, TransferError> {
        match self {
            LandingDone::Received(rx) => rx
                .await
                .unwrap_or(Err(TransferError::Shutdown))
                .map(|()| None),
            LandingDone::Hashed(job) => job.await.unwrap_or(Err(TransferError::Shutdown)).map(Some),
        }
    }
}

/// Why a connection's loop ended.
pub(super) enum End {
    /// Peer closed or reset, or the kill token fired.
    Gone(std::io::ErrorKind),
    /// The peer broke the protocol.
    Protocol(TransferError),
}

/// A decoded frame (owned, so the reader's buffer is free for the inline payload).
enum In {
    Begin(Begin),
    Chunk {
        transfer_id: u64,
        layer_start: u32,
        layer_end: u32,
        payload_bytes: u64,
        checksums: Vec<u64>,
    },
    Abort {
        transfer_id: u64,
        error: WireError,
    },
    AbortAck {
        transfer_id: u64,
    },
}

fn decode(m: &ArchivedMsg) -> Result<In, TransferError> {
    Ok(match m {
        ArchivedMsg::Begin(b) => In::Begin(to_owned(b)?),
        ArchivedMsg::Chunk(c) => In::Chunk {
            transfer_id: c.transfer_id.to_native(),
            layer_start: c.layer_start.to_native(),
            layer_end: c.layer_end.to_native(),
            payload_bytes: c.payload_bytes.to_native(),
            checksums: c.checksums.iter().map(|x| x.to_native()).collect(),
        },
        ArchivedMsg::Abort(a) => In::Abort {
            transfer_id: a.transfer_id.to_native(),
            error: to_owned(&a.error)?,
        },
        ArchivedMsg::AbortAck { transfer_id } => In::AbortAck {
            transfer_id: transfer_id.to_native(),
        },
        _ => {
            return Err(TransferError::protocol(
                "unexpected_frame",
                "sender sent a receiver-only frame",
            ));
        }
    })
}

pub(super) struct ServerConn {
    pub(super) net: Arc<NetShared>,
    pub(super) registry: InboundRegistry,
    pub(super) peer: String,
    pub(super) conn_id: u32,
    /// This connection's sender asked for the data path and was offered it: only then may its
    /// transfers use `Rma` or `Tag`.
    pub(super) data_path_allowed: bool,
    /// Where this connection's data-path bytes land when that is device memory (CUDA IPC):
    /// landed slabs are hashed there, and reports say `on_device`.
    pub(super) landing_device: Option<Arc<dyn crate::device::DeviceKv>>,
    /// The data mode of this connection's transfers (fixed by its first `Begin`).
    pub(super) mode: Option<DataMode>,
    pub(super) hook: Arc<dyn AbortHook>,
    pub(super) out: mpsc::Sender<Msg>,
    pub(super) kill: CancellationToken,
    pub(super) sessions: HashMap<u64, Active>,
    pub(super) landing: VecDeque<Landing>,
    pub(super) scratch: Vec<u8>,
}

impl ServerConn {
    async fn run(&mut self, reader: &mut FrameReader<OwnedReadHalf>) -> End {
        loop {
            let frame = tokio::select! {
                biased;
                _ = self.kill.cancelled() => return End::Gone(std::io::ErrorKind::ConnectionAborted),
                r = async { self.landing.front_mut().expect("guarded").done.wait().await }, if !self.landing.is_empty() => {
                    let l = self.landing.pop_front().expect("non-empty");
                    self.landed(l, r).await;
                    continue;
                }
                f = reader.next() => f,
            };
            let msg = match frame.map(decode) {
                Ok(Ok(m)) => m,
                Ok(Err(e)) | Err(ReadError::Invalid(e)) => return End::Protocol(e),
                Err(ReadError::Io(e)) => return End::Gone(e.kind()),
            };
            let step = match msg {
                In::Begin(b) => self.begin(b).await,
                In::Chunk {
                    transfer_id,
                    layer_start,
                    layer_end,
                    payload_bytes,
                    checksums,
                } => {
                    self.chunk(
                        reader,
                        transfer_id,
                        layer_start,
                        layer_end,
                        payload_bytes,
                        checksums,
                    )
                    .await
                }
                In::Abort { transfer_id, error } => {
                    let e = error.into_error(&self.peer, Phase::Data);
                    self.end_session(transfer_id, e).await;
                    Ok(())
                }
                In::AbortAck { transfer_id } => {
                    // The abort's own reason (pending in the registry) is what the reservation reports.
                    self.end_session(
                        transfer_id,
                        TransferError::Cancelled {
                            by: crate::Side::Peer,
                        },
                    )
                    .await;
                    Ok(())
                }
            };
            if let Err(end) = step {
                return end;
            }
        }
    }

    pub(super) async fn reply(&self, msg: Msg) -> Result<(), End> {
        self.out
            .send(msg)
            .await
            .map_err(|_| End::Gone(std::io::ErrorKind::BrokenPipe))
    }

    async fn begin(&mut self, b: Begin) -> Result<(), End> {
        let id = b.transfer_id;
        let mode_ok = match b.mode {
            DataMode::Inline => true,
            DataMode::Rma | DataMode::Tag => self.data_path_allowed,
        } && self.mode.is_none_or(|m| m == b.mode);
        if !mode_ok || self.sessions.contains_key(&id) {
            return Err(End::Protocol(TransferError::protocol(
                "begin",
                format!("transfer {id} mode {:?}", b.mode),
            )));
        }
        self.mode = Some(b.mode);
        match self.registry.claim(&b, Arc::clone(&self.hook)) {
            Ok(mut session) => {
                if b.mode == DataMode::Rma && self.landing_device.is_some() {
                    session.set_on_device();
                }
                self.sessions.insert(
                    id,
                    Active {
                        session,
                        tag_index: 0,
                    },
                );
                self.reply(Msg::BeginReply(BeginReply {
                    transfer_id: id,
                    refusal: None,
                }))
                .await
            }
            Err(e) => {
                tracing::debug!(peer = self.peer, reservation = b.reservation_id, error = %e, "refused transfer");
                let refusal = Some(WireError::from_error(&e));
                self.reply(Msg::BeginReply(BeginReply {
                    transfer_id: id,
                    refusal,
                }))
                .await
            }
        }
    }

    /// Finishes a session once its writer can no longer write (tag receives cancelled first).
    async fn end_session(&mut self, id: u64, e: TransferError) {
        self.release_landings(Some(id)).await;
        if let Some(a) = self.sessions.remove(&id) {
            let _ = a.session.finish(Err(e));
        }
    }

    /// Cancels tagged receives of one transfer (or all) and waits out everything still landing
    /// or being hashed for it: afterwards nothing touches its destination blocks.
    async fn release_landings(&mut self, id: Option<u64>) {
        if !self
            .landing
            .iter()
            .any(|l| id.is_none_or(|id| l.transfer_id == id))
        {
            return;
        }
        if let Some(path) = self.net.data_path() {
            path.cancel_recvs(self.conn_id, id);
        }
        let fence = self.net.config.fence_timeout;
        let mut keep = VecDeque::new();
        for mut l in self.landing.drain(..) {
            if id.is_none_or(|id| l.transfer_id == id) {
                if tokio::time::timeout(fence, l.done.wait()).await.is_err() {
                    tracing::error!(
                        peer = self.peer,
                        transfer = l.transfer_id,
                        "landing chunk did not finish in time"
                    );
                }
            } else {
                keep.push_back(l);
            }
        }
        self.landing = keep;
    }

    async fn teardown(mut self, end: End) {
        self.kill.cancel();
        self.release_landings(None).await;
        if let (Some(DataMode::Tag), Some(path)) = (self.mode, self.net.data_path()) {
            path.drain_unexpected(self.conn_id);
        }
        let peer = self.peer.clone();
        let reason = |end: &End| match end {
            End::Gone(kind) => TransferError::PeerGone {
                peer: peer.clone(),
                phase: Phase::Data,
                reason: *kind,
            },
            End::Protocol(e) => TransferError::protocol("peer", e.to_string()),
        };
        if let End::Protocol(e) = &end {
            tracing::warn!(peer, error = %e, "closing connection after a protocol violation");
            if e.kind() == FailureKind::Protocol {
                self.net.metrics.failed(e);
            }
        }
        for (_, a) in self.sessions.drain() {
            let _ = a.session.finish(Err(reason(&end)));
        }
    }
}
