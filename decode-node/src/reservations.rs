//! Reservations between `Reserve` and `Decode`: the engine's blocks, the inbound transfer that
//! fills the prompt's share of them, and the expiry that frees them if nobody claims them.
//!
//! ```text
//!  reserve ─▶ engine.reserve (prompt + max_new tokens) ─▶ registry.expect(prompt blocks, ttl)
//!          ─▶ table[id] ─── Decode claims it (take) ──────▶ the Decode task owns it
//!                      └── Release / expiry timer ─────▶ inbound.cancel().await (fence) ─▶ engine release
//! ```
//!
//! Invariants:
//! - Blocks go back to the engine only after the inbound transfer has resolved or been fenced
//!   (`InboundTransfer::cancel` returns once nothing more can land), so a late write never hits
//!   blocks another request owns.
//! - A reservation is owned by exactly one of: the table, a Decode task ([`Claimed`]), the
//!   engine (after `add_prefilled`). Whoever removes it from the table owns its release.
//! - Every reservation holds an in-flight unit until it is released or handed on, so a drain
//!   waits for reservations the router is still filling.
//! - Cancellation-safe: a Reserve or Release call whose caller goes away (its RPC cancelled: a
//!   router timed out on a frozen node) never strands blocks in the engine. Between asking the
//!   engine and entering the table an `Unentered` guard owns the engine's reservation (its
//!   drop queues the release behind the Reserve command, which the engine may not have run yet);
//!   a release runs in its own task, so the fence and the engine's release finish regardless.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tandem_kv_transfer::{InboundRegistry, InboundTransfer, Reservation};
use tandem_node::engine_thread::EngineHandle;
use tandem_node::{InFlightGuard, status};
use tonic::{Code, Status};

use crate::driver::Command;

/// An unclaimed reservation.
pub struct Pending {
    /// The transfer filling its prompt blocks.
    pub inbound: InboundTransfer,
    /// Epoch the caller must present.
    pub epoch: u64,
    /// Prompt tokens it was made for.
    pub prompt_tokens: usize,
    /// Output tokens it has room for.
    pub max_new_tokens: usize,
    /// The caller's request id (logs).
    pub label: String,
    /// Held until released or handed on.
    pub in_flight: InFlightGuard,
}

/// What `reserve` hands back.
pub struct Reserved {
    /// The reservation id.
    pub reservation_id: u64,
    /// Its epoch.
    pub epoch: u64,
    /// The blocks the prefill node fills (the prompt's).
    pub prompt_blocks: Vec<u32>,
    /// When it expires if unclaimed, Unix ms.
    pub expires_at_unix_ms: u64,
}

/// The table of unclaimed reservations. Cheap to clone.
#[derive(Clone)]
pub struct Reservations {
    table: Arc<Mutex<HashMap<u64, Pending>>>,
    registry: InboundRegistry,
    engine: EngineHandle<Command>,
    ttl: Duration,
    block_size: usize,
    epoch: u64,
    next_id: Arc<AtomicU64>,
}

impl Reservations {
    /// A table over `registry` (the KV receiver's) and `engine`; reservations live `ttl`, and
    /// carry `epoch` (this process's: a restarted node refuses writes meant for its past life).
    pub fn new(
        registry: InboundRegistry,
        engine: EngineHandle<Command>,
        ttl: Duration,
        block_size: usize,
        epoch: u64,
    ) -> Self {
        Reservations {
            table: Arc::default(),
            registry,
            engine,
            ttl,
            block_size,
            epoch,
            next_id: Arc::new(AtomicU64::new(1)),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Pending>> {
        // Plain data: a panic elsewhere leaves nothing half-updated that matters.
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Unclaimed reservations now.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// True when no reservation waits to be claimed.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Reserves blocks for `prompt_tokens + max_new_tokens` and expects the prompt's KV.
    pub async fn reserve(
        &self,
        label: String,
        prompt_tokens: usize,
        max_new_tokens: usize,
        in_flight: InFlightGuard,
    ) -> Result<Reserved, Status> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let tokens = prompt_tokens + max_new_tokens;
        let mut unentered = Unentered {
            reservation_id: id,
            engine: Some(self.engine.clone()),
        };
        let blocks = match self
            .engine
            .request(|reply| Command::Reserve {
                reservation_id: id,
                tokens,
                reply,
            })
            .await
        {
            Ok(Ok(blocks)) => blocks,
            Ok(Err(e)) => {
                unentered.disarm(); // the engine holds nothing for it
                return Err(status::engine_status(&e));
            }
            Err(_) => {
                unentered.disarm();
                return Err(status::unavailable("the decode engine has stopped"));
            }
        };
        let prompt_blocks = blocks[..prompt_tokens.div_ceil(self.block_size)].to_vec();
        let expect = Reservation {
            reservation_id: id,
            epoch: self.epoch,
            dst_blocks: prompt_blocks.clone(),
            ttl: self.ttl,
        };
        let inbound = match self.registry.expect(expect) {
            Ok(i) => i,
            Err(e) => {
                unentered.release_now();
                return Err(status::status(
                    Code::Internal,
                    format!("KV receiver refused the reservation: {e}"),
                    "inbound_refused",
                    false,
                ));
            }
        };
        let expires_at_unix_ms = (SystemTime::now() + self.ttl)
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        let pending = Pending {
            inbound,
            epoch: self.epoch,
            prompt_tokens,
            max_new_tokens,
            label,
            in_flight,
        };
        self.lock().insert(id, pending);
        unentered.disarm(); // the table owns it now
        let this = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep(this.ttl).await;
            let expired = this.lock().remove(&id);
            if let Some(p) = expired {
                tracing::info!(request = %p.label, reservation = id, "reservation expired unclaimed; blocks freed");
                this.release_fenced(id, p).await;
            }
        });
        Ok(Reserved {
            reservation_id: id,
            epoch: self.epoch,
            prompt_blocks,
            expires_at_unix_ms,
        })
    }

    /// Claims a reservation for a Decode call: NOT_FOUND if it is not (or no longer) held,
    /// FAILED_PRECONDITION on a wrong epoch (the reservation stays).
    pub fn claim(&self, reservation_id: u64, epoch: u64) -> Result<(Pending, Claimed), Status> {
        let mut t = self.lock();
        match t.get(&reservation_id) {
            None => Err(status::status(
                Code::NotFound,
                format!(
                    "reservation {reservation_id} is not held (expired, released or already claimed)"
                ),
                "unknown_reservation",
                true,
            )),
            Some(p) if p.epoch != epoch => Err(status::status(
                Code::FailedPrecondition,
                format!(
                    "reservation {reservation_id} has epoch {}, not {epoch}",
                    p.epoch
                ),
                "stale_epoch",
                true,
            )),
            Some(_) => {
                let p = t.remove(&reservation_id).expect("checked above");
                Ok((
                    p,
                    Claimed {
                        reservation_id,
                        engine: Some(self.engine.clone()),
                    },
                ))
            }
        }
    }

    /// Releases an unclaimed reservation (fenced); false if it is not held.
    pub async fn release(&self, reservation_id: u64, epoch: u64) -> bool {
        let p = {
            let mut t = self.lock();
            match t.get(&reservation_id) {
                Some(p) if p.epoch == epoch => t.remove(&reservation_id),
                _ => None,
            }
        };
        match p {
            Some(p) => {
                // Its own task: a caller that goes away mid-fence must not skip the release.
                let this = self.clone();
                let released =
                    tokio::spawn(async move { this.release_fenced(reservation_id, p).await });
                if let Err(e) = released.await {
                    tracing::error!(reservation = reservation_id, error = %e, "release task failed");
                }
                true
            }
            None => false,
        }
    }

    /// Stops the inbound transfer (waiting until nothing more can land), then frees the blocks.
    async fn release_fenced(&self, reservation_id: u64, p: Pending) {
        if let Err(e) = p.inbound.cancel().await {
            tracing::debug!(reservation = reservation_id, error = %e, "inbound transfer ended");
        }
        let _ = self
            .engine
            .send(Command::ReleaseReservation { reservation_id })
            .await;
        drop(p.in_flight);
    }
}

/// The engine's reservation while `reserve` has asked for it and not yet entered it in the
/// table. Dropped armed (the call was cancelled, or the receiver refused it), it queues the
/// release behind the Reserve command, so the engine frees the blocks whether or not it had
/// run the Reserve yet (a release of an id it never reserved is a no-op; ids are never reused).
struct Unentered {
    reservation_id: u64,
    engine: Option<EngineHandle<Command>>,
}

impl Unentered {
    fn disarm(&mut self) {
        self.engine = None;
    }

    /// Gives the reservation back now (the error path; no log: the caller reports the error).
    fn release_now(&mut self) {
        if let Some(engine) = self.engine.take() {
            engine.send_from_drop(Command::ReleaseReservation {
                reservation_id: self.reservation_id,
            });
        }
    }
}

impl Drop for Unentered {
    fn drop(&mut self) {
        if self.engine.is_some() {
            tracing::info!(
                reservation = self.reservation_id,
                "a Reserve call was cancelled before its reservation was entered; blocks given back"
            );
            self.release_now();
        }
    }
}

/// A reservation a Decode task owns: dropping it before [`Claimed::hand_over`] gives its blocks
/// back to the engine. Drop it only after the reservation's inbound transfer has resolved.
pub struct Claimed {
    reservation_id: u64,
    engine: Option<EngineHandle<Command>>,
}

impl Claimed {
    /// The engine owns the blocks now (a Start command carries them); nothing to release.
    pub fn hand_over(mut self) {
        self.engine = None;
    }
}

impl Drop for Claimed {
    fn drop(&mut self) {
        if let Some(engine) = self.engine.take() {
            engine.send_from_drop(Command::ReleaseReservation {
                reservation_id: self.reservation_id,
            });
        }
    }
}
