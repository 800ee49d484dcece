//! [`InboundTransfer`]: the receiver's handle on one reservation, and the abort fence.

use std::future::{Future, IntoFuture};
use std::pin::Pin;

use tokio::sync::oneshot;

use super::{AbortOutcome, InboundRegistry, InboundReport, Progress};
use crate::error::{Phase, Side, TransferError};

/// A pending reservation: await it (it resolves when every layer of every block verified, or
/// with the error that ended it), or [`InboundTransfer::cancel`] it.
///
/// Dropping it unresolved cancels the reservation: its entry and gauge go at once if nobody was
/// writing, otherwise after the writer confirms the abort. Call `cancel().await` instead of
/// dropping when the blocks are about to be reused: it returns only once the fence holds.
pub struct InboundTransfer {
    pub(super) registry: InboundRegistry,
    pub(super) reservation_id: u64,
    pub(super) epoch: u64,
    pub(super) deadline: tokio::time::Instant,
    pub(super) progress: Progress,
    pub(super) rx: Option<oneshot::Receiver<Result<InboundReport, TransferError>>>,
}

impl InboundTransfer {
    /// The reservation this handle waits on.
    pub fn reservation_id(&self) -> u64 {
        self.reservation_id
    }

    /// Waits for the reservation to fill, expire, or (with a stall timeout) stop moving.
    pub async fn wait(mut self) -> Result<InboundReport, TransferError> {
        let stall = self.registry.inner.stall_timeout;
        let err = loop {
            let now = tokio::time::Instant::now();
            // Next look: the deadline, or when the transfer would have stalled (unclaimed: a
            // stall timeout from now, to look again).
            let mut wake = self.deadline;
            if let Some(stall) = stall {
                let last = self
                    .progress
                    .last(self.registry.inner.started)
                    .map(tokio::time::Instant::from_std);
                match last {
                    Some(last) if now >= last + stall => {
                        tracing::warn!(
                            reservation = self.reservation_id,
                            ?stall,
                            "KV push stalled: nothing landed for the stall timeout; ending it"
                        );
                        break TransferError::DeadlineExceeded {
                            phase: Phase::Data,
                            deadline: stall,
                        };
                    }
                    Some(last) => wake = wake.min(last + stall),
                    None => wake = wake.min(now + stall),
                }
            }
            if now >= self.deadline {
                break TransferError::ReservationExpired {
                    reservation_id: self.reservation_id,
                };
            }
            let rx = self
                .rx
                .as_mut()
                .expect("rx is only taken when a result was received");
            tokio::select! {
                r = rx => {
                    self.rx = None;
                    return r.unwrap_or(Err(TransferError::Shutdown));
                }
                _ = tokio::time::sleep_until(wake) => {}
            }
        };
        self.abort_and_fence(err).await
    }

    /// Cancels the reservation and returns once nothing more can land in its blocks. Returns
    /// `Ok` if it had already filled.
    pub async fn cancel(mut self) -> Result<InboundReport, TransferError> {
        self.abort_and_fence(TransferError::Cancelled { by: Side::Local })
            .await
    }

    /// Asks whoever fills the reservation to stop and waits for the fence. The receiver stays in
    /// `self` until a result arrives, so dropping this future midway still cancels (in `Drop`).
    async fn abort_and_fence(
        &mut self,
        err: TransferError,
    ) -> Result<InboundReport, TransferError> {
        let hook = match self
            .registry
            .request_abort(self.reservation_id, self.epoch, err)
        {
            AbortOutcome::Removed(e) => {
                self.rx = None;
                return Err(e);
            }
            AbortOutcome::AlreadyDone => None,
            AbortOutcome::Fencing(hook) => Some(hook),
        };
        let fence = self.registry.inner.fence_timeout;
        let rx = self
            .rx
            .as_mut()
            .expect("rx is only taken when a result was received");
        let result = match hook {
            None => Some(rx.await),
            Some(hook) => match tokio::time::timeout(fence, &mut *rx).await {
                Ok(r) => Some(r),
                Err(_) => {
                    tracing::warn!(
                        reservation = self.reservation_id,
                        ?fence,
                        "writer did not confirm abort; closing its connection"
                    );
                    hook.kill();
                    tokio::time::timeout(fence, rx).await.ok()
                }
            },
        };
        self.rx = None;
        match result {
            Some(r) => r.unwrap_or(Err(TransferError::Shutdown)),
            None => {
                self.registry.force_remove(self.reservation_id, self.epoch);
                Err(TransferError::FenceTimeout {
                    reservation_id: self.reservation_id,
                    waited: fence * 2,
                })
            }
        }
    }
}

impl IntoFuture for InboundTransfer {
    type Output = Result<InboundReport, TransferError>;
    type IntoFuture = Pin<Box<dyn Future<Output = Self::Output> + Send>>;

    fn into_future(self) -> Self::IntoFuture {
        Box::pin(self.wait())
    }
}

impl Drop for InboundTransfer {
    fn drop(&mut self) {
        if self.rx.is_some() {
            let err = TransferError::Cancelled { by: Side::Local };
            let _ = self
                .registry
                .request_abort(self.reservation_id, self.epoch, err);
        }
    }
}
