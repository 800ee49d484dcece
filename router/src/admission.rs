//! Admission at the edge: a bounded, priority-aware queue in front of a fixed
//! number of in-flight slots (fail fast instead of queueing without limit).
//!
//! ```text
//!  acquire(priority) ── slot free? ──yes──▶ Permit (RAII: dropping it frees the slot)
//!        │ no
//!        ├─ queue full (max_queued waiting) ──▶ Overloaded           (429 / RESOURCE_EXHAUSTED, at once)
//!        └─ wait in the class's FIFO ──▶ Permit handed over by a releasing Permit
//!                                    └─ the class's queue timeout passes ──▶ QueueTimeout (429)
//! ```
//!
//! # Invariants
//! - At most `max_in_flight` [`Permit`]s exist; at most `max_queued` requests wait.
//! - A released slot goes straight to the oldest batch waiter if it has waited `batch_aging`,
//!   else the oldest interactive waiter, else the oldest batch waiter, else back to the pool: a
//!   free slot never coexists with a waiter. Strict priority with aging: interactive requests
//!   go first, and a constant interactive load delays batch work by at most `batch_aging` per
//!   slot, never indefinitely.
//! - Each class waits at most its own timeout (`queue_timeout`, `batch_queue_timeout`).
//! - A waiter that gives up (timeout, client gone) leaves the queue at once (its guard removes
//!   it); a slot handed to a waiter that vanished in the same instant is passed on.
//!
//! Cost: one mutex per acquire/release, O(1) except removing a cancelled waiter (O(queue)).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use crate::error::RouterError;
use crate::request::Priority;

/// Limits of the admission queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AdmissionLimits {
    /// Requests running at once (each holds a [`Permit`] until its stream ends).
    pub max_in_flight: usize,
    /// Requests allowed to wait for a slot; one more is refused at once.
    pub max_queued: usize,
    /// How long an interactive request may wait for a slot.
    pub queue_timeout: Duration,
    /// How long a batch request may wait for a slot.
    pub batch_queue_timeout: Duration,
    /// A batch request that has waited this long takes the next free slot ahead of interactive
    /// waiters.
    pub batch_aging: Duration,
}

impl AdmissionLimits {
    /// How long a request of `priority` may wait.
    pub fn queue_timeout_of(&self, priority: Priority) -> Duration {
        match priority {
            Priority::Interactive => self.queue_timeout,
            Priority::Batch => self.batch_queue_timeout,
        }
    }
}

/// The admission queue. Clones share it.
#[derive(Clone, Debug)]
pub struct Admission {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    limits: AdmissionLimits,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    available: usize,
    /// FIFO per class: index 0 interactive, 1 batch.
    waiting: [VecDeque<Waiter>; 2],
    next_ticket: u64,
}

#[derive(Debug)]
struct Waiter {
    ticket: u64,
    since: Instant,
    slot: oneshot::Sender<Permit>,
}

fn class(priority: Priority) -> usize {
    match priority {
        Priority::Interactive => 0,
        Priority::Batch => 1,
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // Every critical section leaves the state consistent (single pushes/pops), so a
        // poisoned lock is still usable.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// One in-flight slot; dropping it hands the slot to the next waiter.
#[derive(Debug)]
pub struct Permit {
    shared: Option<Arc<Shared>>,
}

impl Drop for Permit {
    fn drop(&mut self) {
        if let Some(shared) = self.shared.take() {
            release(shared);
        }
    }
}

/// Hands a freed slot to the next live waiter, or returns it to the pool.
fn release(shared: Arc<Shared>) {
    loop {
        let waiter = {
            let mut state = shared.lock();
            let aging = shared.limits.batch_aging;
            let aged = state.waiting[1]
                .front()
                .is_some_and(|w| w.since.elapsed() >= aging);
            let next = if aged {
                state.waiting[1].pop_front()
            } else {
                state.waiting[0]
                    .pop_front()
                    .or_else(|| state.waiting[1].pop_front())
            };
            match next {
                Some(waiter) => waiter,
                None => {
                    state.available += 1;
                    return;
                }
            }
        };
        // Sent outside the lock: a permit that bounces (the waiter just left) is disarmed and
        // the loop offers the slot to the next waiter, so no Drop runs under the lock.
        match waiter.slot.send(Permit {
            shared: Some(Arc::clone(&shared)),
        }) {
            Ok(()) => return,
            Err(mut bounced) => {
                bounced.shared = None;
            }
        }
    }
}

/// Removes a waiter from its queue if it is still there (it gave up).
struct WaitGuard<'a> {
    shared: &'a Shared,
    class: usize,
    ticket: u64,
}

impl Drop for WaitGuard<'_> {
    fn drop(&mut self) {
        let mut state = self.shared.lock();
        let queue = &mut state.waiting[self.class];
        if let Some(i) = queue.iter().position(|w| w.ticket == self.ticket) {
            queue.remove(i);
        }
    }
}

impl Admission {
    /// A queue with `limits`.
    pub fn new(limits: AdmissionLimits) -> Self {
        Self {
            shared: Arc::new(Shared {
                limits,
                state: Mutex::new(State {
                    available: limits.max_in_flight,
                    waiting: [VecDeque::new(), VecDeque::new()],
                    next_ticket: 0,
                }),
            }),
        }
    }

    /// The limits.
    pub fn limits(&self) -> AdmissionLimits {
        self.shared.limits
    }

    /// Requests holding a slot now.
    pub fn in_flight(&self) -> usize {
        self.shared.limits.max_in_flight - self.shared.lock().available
    }

    /// Requests waiting for a slot now.
    pub fn queued(&self) -> usize {
        let state = self.shared.lock();
        state.waiting[0].len() + state.waiting[1].len()
    }

    /// Takes a slot, waiting in `priority`'s queue if none is free. Fails at once with
    /// [`RouterError::Overloaded`] when the queue is full, and with
    /// [`RouterError::QueueTimeout`] when the wait exceeds the limit.
    pub async fn acquire(&self, priority: Priority) -> Result<Permit, RouterError> {
        let limits = self.shared.limits;
        let class = class(priority);
        let (ticket, slot) = {
            let mut state = self.shared.lock();
            if state.available > 0 {
                state.available -= 1;
                return Ok(Permit {
                    shared: Some(Arc::clone(&self.shared)),
                });
            }
            if state.waiting[0].len() + state.waiting[1].len() >= limits.max_queued {
                return Err(RouterError::Overloaded {
                    max_in_flight: limits.max_in_flight,
                    max_queued: limits.max_queued,
                });
            }
            let ticket = state.next_ticket;
            state.next_ticket += 1;
            let (tx, rx) = oneshot::channel();
            state.waiting[class].push_back(Waiter {
                ticket,
                since: Instant::now(),
                slot: tx,
            });
            (ticket, rx)
        };
        let _guard = WaitGuard {
            shared: &self.shared,
            class,
            ticket,
        };
        let started = Instant::now();
        let limit = limits.queue_timeout_of(priority);
        match tokio::time::timeout(limit, slot).await {
            Ok(Ok(permit)) => Ok(permit),
            // The sender lives in the queue until popped and is always used when popped, so
            // this only happens if the queue itself is gone.
            Ok(Err(_)) => Err(RouterError::PipelineLost),
            Err(_) => Err(RouterError::QueueTimeout {
                priority,
                waited: started.elapsed(),
                limit,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn admission(in_flight: usize, queued: usize) -> Admission {
        Admission::new(AdmissionLimits {
            max_in_flight: in_flight,
            max_queued: queued,
            queue_timeout: Duration::from_secs(5),
            batch_queue_timeout: Duration::from_secs(5),
            batch_aging: Duration::from_secs(60),
        })
    }

    #[tokio::test]
    async fn a_full_queue_refuses_at_once_and_a_freed_slot_admits_the_waiter() {
        let a = admission(1, 1);
        let first = a.acquire(Priority::Interactive).await.unwrap();
        let waiter = tokio::spawn({
            let a = a.clone();
            async move { a.acquire(Priority::Interactive).await }
        });
        while a.queued() == 0 {
            tokio::task::yield_now().await;
        }
        let refused = a.acquire(Priority::Interactive).await.unwrap_err();
        assert!(matches!(
            refused,
            RouterError::Overloaded {
                max_in_flight: 1,
                max_queued: 1
            }
        ));
        drop(first);
        let second = tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("waiter admitted")
            .unwrap()
            .unwrap();
        assert_eq!((a.in_flight(), a.queued()), (1, 0));
        drop(second);
        assert_eq!(a.in_flight(), 0);
    }

    #[tokio::test]
    async fn interactive_waiters_are_admitted_before_older_batch_waiters() {
        let a = admission(1, 4);
        let held = a.acquire(Priority::Interactive).await.unwrap();
        let (order_tx, mut order_rx) = tokio::sync::mpsc::channel(4);
        let mut tasks = Vec::new();
        for (name, priority) in [
            ("batch", Priority::Batch),
            ("interactive", Priority::Interactive),
        ] {
            let task_admission = a.clone();
            let order_tx = order_tx.clone();
            let before = a.queued();
            tasks.push(tokio::spawn(async move {
                let permit = task_admission.acquire(priority).await.unwrap();
                order_tx.send(name).await.unwrap();
                drop(permit);
            }));
            while a.queued() == before {
                tokio::task::yield_now().await;
            }
        }
        drop(held);
        let first = tokio::time::timeout(Duration::from_secs(5), order_rx.recv())
            .await
            .unwrap();
        let second = tokio::time::timeout(Duration::from_secs(5), order_rx.recv())
            .await
            .unwrap();
        assert_eq!((first, second), (Some("interactive"), Some("batch")));
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(a.in_flight(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiter_that_times_out_leaves_the_queue_and_loses_no_slot() {
        let a = Admission::new(AdmissionLimits {
            max_in_flight: 1,
            max_queued: 1,
            queue_timeout: Duration::from_millis(100),
            batch_queue_timeout: Duration::from_millis(300),
            batch_aging: Duration::from_secs(60),
        });
        let held = a.acquire(Priority::Batch).await.unwrap();
        let t0 = tokio::time::Instant::now();
        let err = a.acquire(Priority::Batch).await.unwrap_err();
        assert!(
            matches!(err, RouterError::QueueTimeout { priority: Priority::Batch, limit, .. } if limit == Duration::from_millis(300)),
            "{err}"
        );
        assert_eq!(t0.elapsed(), Duration::from_millis(300), "the batch class's own timeout");
        assert!(err.to_string().contains("batch"), "{err}");
        let t1 = tokio::time::Instant::now();
        let err = a.acquire(Priority::Interactive).await.unwrap_err();
        assert!(matches!(err, RouterError::QueueTimeout { priority: Priority::Interactive, .. }), "{err}");
        assert_eq!(t1.elapsed(), Duration::from_millis(100));
        assert_eq!(a.queued(), 0);
        drop(held);
        let again = a.acquire(Priority::Batch).await.unwrap();
        assert_eq!(a.in_flight(), 1);
        drop(again);
    }

    #[tokio::test]
    async fn a_batch_waiter_past_its_aging_takes_the_slot_before_interactive_waiters() {
        let a = Admission::new(AdmissionLimits {
            max_in_flight: 1,
            max_queued: 4,
            queue_timeout: Duration::from_secs(5),
            batch_queue_timeout: Duration::from_secs(5),
            batch_aging: Duration::from_millis(50),
        });
        let held = a.acquire(Priority::Interactive).await.unwrap();
        let (order_tx, mut order_rx) = tokio::sync::mpsc::channel(4);
        let spawn = |name: &'static str, priority| {
            let (a, order_tx) = (a.clone(), order_tx.clone());
            tokio::spawn(async move {
                let permit = a.acquire(priority).await.unwrap();
                order_tx.send(name).await.unwrap();
                drop(permit);
            })
        };
        let batch = spawn("batch", Priority::Batch);
        while a.queued() < 1 {
            tokio::task::yield_now().await;
        }
        // The batch request ages while an interactive one arrives.
        tokio::time::sleep(Duration::from_millis(80)).await;
        let interactive = spawn("interactive", Priority::Interactive);
        while a.queued() < 2 {
            tokio::task::yield_now().await;
        }
        drop(held);
        let first = order_rx.recv().await;
        let second = order_rx.recv().await;
        assert_eq!((first, second), (Some("batch"), Some("interactive")));
        batch.await.unwrap();
        interactive.await.unwrap();
    }
}
