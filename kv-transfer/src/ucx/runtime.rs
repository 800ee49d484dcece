//! The handle side of a UCX progress thread: the commands it takes and [`UcxRuntime`], the
//! cloneable handle that sends them (the thread itself is in `worker`).

use std::sync::Arc;
use std::sync::mpsc::{SyncSender, TrySendError, sync_channel};
use std::thread::JoinHandle;

use tokio::sync::oneshot;

use super::{PutOp, TagOp};
use crate::error::TransferError;
use crate::metrics::LiveGuard;
use crate::pool::KvPool;

pub(crate) use crate::datapath::Keep;

pub(crate) type Reply<T> = oneshot::Sender<Result<T, TransferError>>;
/// A reply from a blocking caller (registration happens outside any runtime's async context).
pub(crate) type SyncReply<T> = std::sync::mpsc::Sender<Result<T, TransferError>>;

pub(crate) enum Cmd {
    Map {
        pool: Arc<KvPool>,
        reply: SyncReply<(u64, Vec<u8>)>,
    },
    /// Allocate and map `len` bytes: replies (mem id, address, rkey).
    Alloc {
        len: usize,
        reply: SyncReply<(u64, usize, Vec<u8>)>,
    },
    Unmap {
        mem: u64,
        guard: Option<LiveGuard>,
    },
    /// Replies (endpoint id, `ucp_ep_print_info` text, local address of `base` if mapped).
    Connect {
        address: Vec<u8>,
        rkey: Vec<u8>,
        base: u64,
        peer_failure: bool,
        reply: Reply<(u64, String, Option<usize>)>,
    },
    Close {
        ep: u64,
    },
    Put {
        ep: u64,
        ops: Vec<PutOp>,
        keep: Keep,
        reply: Reply<()>,
    },
    TagSend {
        ep: u64,
        ops: Vec<TagOp>,
        keep: Keep,
        reply: Reply<()>,
    },
    TagRecv {
        ops: Vec<TagOp>,
        keep: Keep,
        reply: Reply<()>,
    },
    CancelRecvs {
        tag: u64,
        mask: u64,
    },
    /// Receive-and-discard every unexpected message matching `tag` under `mask` (a dead
    /// connection's tagged data that no receive was posted for).
    DrainUnexpected {
        tag: u64,
        mask: u64,
    },
    Shutdown,
}

struct RtInner {
    tx: SyncSender<Cmd>,
    thread: std::thread::Thread,
    worker_address: Vec<u8>,
    join: std::sync::Mutex<Option<JoinHandle<()>>>,
}

impl Drop for RtInner {
    fn drop(&mut self) {
        let _ = self
            .tx
            .try_send(Cmd::Shutdown)
            .or_else(|_| self.tx.send(Cmd::Shutdown));
        self.thread.unpark();
        // The last handle can go on the progress thread itself (a pool whose memory UCX
        // allocated, dropped with a finished batch): it then exits after this command; joining
        // itself would deadlock.
        if std::thread::current().id() == self.thread.id() {
            return;
        }
        if let Some(t) = self.join.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = t.join();
        }
    }
}

/// Handle to a progress thread. Cheap to clone; the thread stops when the last clone drops.
#[derive(Clone)]
pub(crate) struct UcxRuntime {
    inner: Arc<RtInner>,
}

impl UcxRuntime {
    /// Starts the thread, creating the context (with `tls` overriding `UCX_TLS`) and worker on it.
    pub fn start(tls: Option<String>) -> Result<Self, TransferError> {
        let (tx, rx) = sync_channel::<Cmd>(256);
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("tandem-ucx-progress".into())
            .spawn(move || super::worker::run(tls, ready_tx, rx))
            .map_err(|source| TransferError::Io {
                op: "spawn UCX progress thread",
                source,
            })?;
        let worker_address = ready_rx.recv().map_err(|_| TransferError::Shutdown)??;
        Ok(Self {
            inner: Arc::new(RtInner {
                tx,
                thread: thread.thread().clone(),
                worker_address,
                join: std::sync::Mutex::new(Some(thread)),
            }),
        })
    }

    /// This worker's address.
    pub fn worker_address(&self) -> &[u8] {
        &self.inner.worker_address
    }

    /// Sends a command and wakes the thread.
    pub fn send(&self, cmd: Cmd) -> Result<(), TransferError> {
        if std::thread::current().id() == self.inner.thread.id() {
            // From the progress thread itself (a pool dropped with a finished batch): never block
            // on the queue only this thread drains.
            return match self.inner.tx.try_send(cmd) {
                Ok(()) => Ok(()),
                Err(TrySendError::Disconnected(_)) => Err(TransferError::Shutdown),
                Err(TrySendError::Full(cmd)) => {
                    let tx = self.inner.tx.clone();
                    std::thread::spawn(move || tx.send(cmd));
                    Ok(())
                }
            };
        }
        self.inner
            .tx
            .send(cmd)
            .map_err(|_| TransferError::Shutdown)?;
        self.inner.thread.unpark();
        Ok(())
    }

    /// Sends a command carrying a oneshot reply and returns the receiver (already failed if the
    /// thread is gone).
    pub fn request<T>(
        &self,
        make: impl FnOnce(Reply<T>) -> Cmd,
    ) -> oneshot::Receiver<Result<T, TransferError>> {
        let (tx, rx) = oneshot::channel();
        if let Err(e) = self.send(make(tx)) {
            let (tx, rx) = oneshot::channel();
            let _ = tx.send(Err(e));
            return rx;
        }
        rx
    }
}
