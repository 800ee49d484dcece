//! The engine actor: one dedicated OS thread owns the [`Engine`] (never a tokio worker: a step
//! is tens of milliseconds of CPU), driven by a bounded command channel.
//!
//! ```text
//!  EngineHandle::send/request ──Envelope<C> (bounded)──▶ ┌ engine thread ──────────────────────┐
//!                                                       │ loop:                                │
//!                                                       │   drain commands → Driver::on_command│
//!                                                       │   Driver::housekeeping (closed       │
//!                                                       │     streams → abort, flush output)   │
//!                                                       │   work?  Driver::step (one forward)  │
//!                                                       │   idle?  block on the channel        │
//!                                                       │   publish EngineSnapshot (watch)     │
//!                                                       └──────────────────────────────────────┘
//! ```
//!
//! Each role supplies a [`Driver`]: its command type and what to do with outputs. The loop
//! steps while there is work, honours [`Engine::wait_hint`] (the batching window) by waiting on
//! the channel for at most that long, and otherwise blocks on the channel. While a driver holds
//! output it could not deliver yet (a client's bounded stream was full), the loop polls every
//! [`UNDELIVERED_POLL`] instead of blocking. When idle it still wakes every [`IDLE_TICK`] so
//! load figures (tokens/s) decay to zero.
//!
//! The model is loaded *on* the thread (the builder closure runs there) and readiness is
//! reported through a oneshot, so the large buffers are created where they are used.
//!
//! Cost per loop iteration: a few non-blocking channel polls, the driver's housekeeping
//! (O(live requests)) and one snapshot (O(reserved + held blocks)); all small beside a step.

use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use prometheus_client::metrics::histogram::Histogram;
use tandem_engine::{Engine, EngineError, EngineStats};
use tokio::runtime::Handle;
use tokio::sync::mpsc::error::TryRecvError;
use tokio::sync::{mpsc, oneshot, watch};
use tokio_util::sync::CancellationToken;

use crate::error::NodeError;

/// How often the loop retries delivering held-back output while otherwise idle.
pub const UNDELIVERED_POLL: Duration = Duration::from_millis(2);
/// How often an idle engine thread wakes to refresh its snapshot.
pub const IDLE_TICK: Duration = Duration::from_millis(250);
/// Window over which tokens/s is measured.
const RATE_WINDOW: Duration = Duration::from_millis(500);

/// What a role does with the engine.
pub trait Driver: Send + 'static {
    /// The role's commands.
    type Command: Send + 'static;

    /// Handles one command (replies through the command's own oneshot, if any).
    fn on_command(&mut self, engine: &mut Engine, cmd: Self::Command);

    /// Runs one engine step and delivers its outputs; returns how many outputs it produced.
    fn step(&mut self, engine: &mut Engine) -> Result<usize, EngineError>;

    /// Called every loop iteration: abort requests whose client went away, retry delivery.
    fn housekeeping(&mut self, engine: &mut Engine);

    /// True while output waits for room in a client's stream.
    fn has_undelivered(&self) -> bool {
        false
    }

    /// A step failed: fail every live request (the engine state of a failed step is not to be
    /// trusted) and free what they hold.
    fn on_step_error(&mut self, engine: &mut Engine, error: &EngineError);

    /// The thread is stopping: end every live request (their clients see UNAVAILABLE) and free
    /// everything.
    fn shutdown(&mut self, engine: &mut Engine);
}

/// Shares `step` (one forward pass) among the requests of the engine's last step by the
/// tokens each computed in it, calling `add(request_id, seconds)` for each: the per-request
/// node time that cost accounting is built on.
pub fn share_step_time(engine: &Engine, step: Duration, mut add: impl FnMut(u64, f64)) {
    let parts = engine.last_step_tokens();
    let total: usize = parts.iter().map(|p| p.1).sum();
    if total == 0 {
        return;
    }
    let per_token = step.as_secs_f64() / total as f64;
    for &(id, tokens) in parts {
        add(id, per_token * tokens as f64);
    }
}

/// A point-in-time view of the engine, published after every loop iteration.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EngineSnapshot {
    /// Requests waiting for admission.
    pub waiting: usize,
    /// Prompt tokens not computed yet (waiting and in chunked prefill).
    pub pending_prompt_tokens: usize,
    /// The scheduler's batch cap (`max_num_seqs`).
    pub max_running: usize,
    /// Sequences running.
    pub running: usize,
    /// KV blocks free (cached prefix blocks count as free: they are evictable).
    pub free_blocks: usize,
    /// KV blocks in the pool.
    pub total_blocks: usize,
    /// Blocks held outside sequences: decode reservations, prefill blocks awaiting a push.
    pub reserved_or_held_blocks: usize,
    /// Prompt + generated tokens per second over the last window.
    pub tokens_per_s: f64,
    /// Outputs of the last step (0 when idle).
    pub batch_size: usize,
    /// Forward passes since start.
    pub steps: u64,
    /// Prompt tokens computed since start (prefix-cache hits excluded).
    pub prefill_tokens: u64,
    /// Tokens sampled since start.
    pub decode_tokens: u64,
    /// Preemptions by recompute since start.
    pub preemptions: u64,
    /// Structured outputs ended early because their grammar failed, since start.
    pub grammar_failures: u64,
    /// Prompt tokens one step may compute now (the scheduler's cap, or its whole step budget).
    pub prefill_token_cap: usize,
    /// `--device cuda`: KV bytes copied device → host mirror (prefill) since start.
    pub kv_staged_out_bytes: u64,
    /// `--device cuda`: KV bytes copied host mirror → device (decode) since start.
    pub kv_staged_in_bytes: u64,
    /// `--device cuda`: tokens picked on the device (only ids came back) since start.
    pub tokens_picked_on_device: u64,
    /// `--device cuda`: decode steps replayed from graphs since start.
    pub cuda_graph_replays: u64,
    /// `--device cuda`: graph captures that failed (each logged) since start.
    pub cuda_graph_fallbacks: u64,
}

impl EngineSnapshot {
    fn of(engine: &Engine, tokens_per_s: f64, batch_size: usize) -> Self {
        let s = engine.scheduler();
        let stats = engine.stats();
        EngineSnapshot {
            waiting: s.num_waiting(),
            pending_prompt_tokens: s.pending_prompt_tokens(),
            max_running: s.config().max_num_seqs,
            running: s.num_running(),
            free_blocks: s.blocks().num_free(),
            total_blocks: s.blocks().num_blocks(),
            reserved_or_held_blocks: engine.reserved_and_held_blocks().len(),
            tokens_per_s,
            batch_size,
            steps: stats.steps,
            prefill_tokens: stats.prefill_tokens,
            decode_tokens: stats.decode_tokens,
            preemptions: stats.preemptions,
            grammar_failures: stats.grammar_failures,
            prefill_token_cap: s.prefill_token_cap(),
            kv_staged_out_bytes: stats.kv_staged_out_bytes,
            kv_staged_in_bytes: stats.kv_staged_in_bytes,
            tokens_picked_on_device: stats.tokens_picked_on_device,
            cuda_graph_replays: stats.cuda_graph_replays,
            cuda_graph_fallbacks: stats.cuda_graph_fallbacks,
        }
    }

    /// True when nothing runs, waits or is held, and every block is free.
    pub fn is_quiescent(&self) -> bool {
        self.waiting == 0
            && self.running == 0
            && self.reserved_or_held_blocks == 0
            && self.free_blocks == self.total_blocks
    }
}

enum Envelope<C> {
    Command(C),
    Shutdown,
}

/// A cloneable handle on an engine thread.
pub struct EngineHandle<C> {
    tx: mpsc::Sender<Envelope<C>>,
    snapshot: watch::Receiver<EngineSnapshot>,
    thread: Arc<Mutex<Option<JoinHandle<()>>>>,
    died: CancellationToken,
}

impl<C> Clone for EngineHandle<C> {
    fn clone(&self) -> Self {
        EngineHandle {
            tx: self.tx.clone(),
            snapshot: self.snapshot.clone(),
            thread: Arc::clone(&self.thread),
            died: self.died.clone(),
        }
    }
}

/// What [`spawn_with`] may add to an engine thread.
#[derive(Debug, Default)]
pub struct SpawnOptions {
    /// Observes every step's duration (a node's `tandem_node_step_duration_seconds`).
    pub step_seconds: Option<Histogram>,
    /// Fault injection (drills and tests): the thread panics after this many steps.
    pub panic_after_steps: Option<u64>,
    /// Where the prefix cache's changes go (KV events), if the node publishes them.
    pub cache_events: Option<crate::kv_events::CacheEventSink>,
}

impl<C: Send + 'static> EngineHandle<C> {
    /// Queues a command, waiting for room; fails only when the thread has stopped.
    pub async fn send(&self, cmd: C) -> Result<(), NodeError> {
        self.tx
            .send(Envelope::Command(cmd))
            .await
            .map_err(|_| NodeError::EngineStopped)
    }

    /// Queues a command without waiting; gives it back when the queue is full or the thread
    /// stopped (for `Drop` impls, which cannot await).
    pub fn try_send(&self, cmd: C) -> Result<(), C> {
        self.tx
            .try_send(Envelope::Command(cmd))
            .map_err(|e| match e.into_inner() {
                Envelope::Command(c) => c,
                Envelope::Shutdown => unreachable!("only commands are sent here"),
            })
    }

    /// Queues a command from a `Drop` impl: at once if there is room, else from a task (the
    /// command must not be lost, e.g. a release of blocks). Must run inside a tokio runtime
    /// (never on the engine thread itself: its drops release directly); without one and with
    /// the channel full, the command is lost, and that is logged as the bug it is.
    pub fn send_from_drop(&self, cmd: C) {
        if let Err(cmd) = self.try_send(cmd) {
            let tx = self.tx.clone();
            match Handle::try_current() {
                Ok(rt) => {
                    rt.spawn(async move {
                        let _ = tx.send(Envelope::Command(cmd)).await;
                    });
                }
                // The engine is gone: what the command would free went with it.
                Err(_) if tx.is_closed() => {}
                Err(_) => tracing::error!(
                    "a command queued from a drop outside any runtime was lost (the engine's channel is full)"
                ),
            }
        }
    }

    /// Sends the command `make` builds around a reply channel and awaits the reply.
    pub async fn request<R>(
        &self,
        make: impl FnOnce(oneshot::Sender<R>) -> C,
    ) -> Result<R, NodeError> {
        let (reply, rx) = oneshot::channel();
        self.send(make(reply)).await?;
        rx.await.map_err(|_| NodeError::EngineStopped)
    }

    /// The latest snapshot (updated after every loop iteration). Do not hold a borrow of it
    /// (`borrow()`, the `Ref` that `wait_for` returns) across an await: the engine thread's next
    /// update waits for the borrow to end.
    pub fn snapshot(&self) -> watch::Receiver<EngineSnapshot> {
        self.snapshot.clone()
    }

    /// Resolves if the thread dies on its own (a panic in a step or in the driver), never after
    /// an orderly [`shutdown`](Self::shutdown). A node that sees this cannot serve: it leaves
    /// the cluster and exits non-zero.
    pub async fn died(&self) {
        self.died.cancelled().await
    }

    /// Whether the thread died on its own (see [`died`](Self::died)).
    pub fn has_died(&self) -> bool {
        self.died.is_cancelled()
    }

    /// Stops the thread (its driver ends every live request) and waits for it to exit.
    pub async fn shutdown(&self) {
        let _ = self.tx.send(Envelope::Shutdown).await;
        let thread = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(t) = thread {
            // Joining blocks; do it off the async workers.
            let _ = tokio::task::spawn_blocking(move || t.join()).await;
        }
    }
}

/// What a driver's builder gets: the runtime (to spawn tasks, start pushes) and a sender to its
/// own engine thread (for tasks that report back, e.g. "push done, release the blocks").
pub struct BuildContext<C> {
    /// The node's tokio runtime.
    pub runtime: Handle,
    /// A handle on the engine thread being built (its snapshot is not live until it runs).
    pub engine: EngineHandle<C>,
}

/// Starts an engine thread named `name`. `build` runs on the new thread (load the model there)
/// and returns the engine, its driver and a value handed back to the caller once ready.
/// `queue` bounds the command channel. Must be called inside a tokio runtime.
pub async fn spawn<D, R, F>(
    name: &str,
    queue: usize,
    build: F,
) -> Result<(EngineHandle<D::Command>, R), NodeError>
where
    D: Driver,
    R: Send + 'static,
    F: FnOnce(BuildContext<D::Command>) -> Result<(Engine, D, R), NodeError> + Send + 'static,
{
    spawn_with(name, queue, SpawnOptions::default(), build).await
}

/// [`spawn`] with [`SpawnOptions`] (step metrics, fault injection).
pub async fn spawn_with<D, R, F>(
    name: &str,
    queue: usize,
    options: SpawnOptions,
    build: F,
) -> Result<(EngineHandle<D::Command>, R), NodeError>
where
    D: Driver,
    R: Send + 'static,
    F: FnOnce(BuildContext<D::Command>) -> Result<(Engine, D, R), NodeError> + Send + 'static,
{
    let (tx, rx) = mpsc::channel(queue.max(1));
    let (snap_tx, snap_rx) = watch::channel(EngineSnapshot::default());
    let died = CancellationToken::new();
    let handle = EngineHandle {
        tx,
        snapshot: snap_rx,
        thread: Arc::new(Mutex::new(None)),
        died: died.clone(),
    };
    let ctx = BuildContext {
        runtime: Handle::current(),
        engine: handle.clone(),
    };
    let (ready_tx, ready_rx) = oneshot::channel();
    let thread = std::thread::Builder::new()
        .name(name.to_string())
        .spawn(move || {
            let runtime = ctx.runtime.clone();
            match build(ctx) {
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                }
                Ok((engine, driver, value)) => {
                    let _ = ready_tx.send(Ok(value));
                    if run_loop(engine, driver, rx, snap_tx, runtime, options) == Exit::Died {
                        died.cancel();
                    }
                }
            }
        })
        .map_err(NodeError::Thread)?;
    *handle.thread.lock().unwrap_or_else(|p| p.into_inner()) = Some(thread);
    let value = ready_rx.await.map_err(|_| NodeError::EngineStopped)??;
    Ok((handle, value))
}

/// Tokens/s over a sliding window of [`RATE_WINDOW`].
struct RateMeter {
    since: Instant,
    tokens_then: u64,
    rate: f64,
}

impl RateMeter {
    fn tokens(s: EngineStats) -> u64 {
        s.prefill_tokens + s.decode_tokens
    }

    fn update(&mut self, stats: EngineStats, now: Instant) -> f64 {
        let dt = now.duration_since(self.since);
        if dt >= RATE_WINDOW {
            let tokens = Self::tokens(stats);
            self.rate = (tokens - self.tokens_then) as f64 / dt.as_secs_f64();
            self.since = now;
            self.tokens_then = tokens;
        }
        self.rate
    }
}

fn run_loop<D: Driver>(
    mut engine: Engine,
    mut driver: D,
    mut rx: mpsc::Receiver<Envelope<D::Command>>,
    snap_tx: watch::Sender<EngineSnapshot>,
    runtime: Handle,
    options: SpawnOptions,
) -> Exit {
    let step_seconds = options.step_seconds;
    let mut cache_events = options.cache_events;
    if let Some(sink) = &mut cache_events {
        sink.start(&mut engine);
    }
    let mut steps_taken = 0u64;
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let mut meter = RateMeter {
            since: Instant::now(),
            tokens_then: RateMeter::tokens(engine.stats()),
            rate: 0.0,
        };
        let mut batch = 0usize;
        loop {
            loop {
                match rx.try_recv() {
                    Ok(Envelope::Command(c)) => driver.on_command(&mut engine, c),
                    Ok(Envelope::Shutdown) | Err(TryRecvError::Disconnected) => return,
                    Err(TryRecvError::Empty) => break,
                }
            }
            driver.housekeeping(&mut engine);
            let now = Instant::now();
            let wait = if engine.is_idle() {
                batch = 0;
                Some(if driver.has_undelivered() {
                    UNDELIVERED_POLL
                } else {
                    IDLE_TICK
                })
            } else {
                engine.wait_hint(now)
            };
            match wait {
                None => {
                    steps_taken += 1;
                    if options.panic_after_steps.is_some_and(|n| steps_taken > n) {
                        panic!("fault injection: engine panic after {steps_taken} steps");
                    }
                    let stepped = driver.step(&mut engine);
                    match stepped {
                        Ok(n) => {
                            batch = n;
                            if let Some(h) = &step_seconds {
                                h.observe(now.elapsed().as_secs_f64());
                            }
                        }
                        Err(e) => {
                            tracing::error!(error = %e, kind = e.error_type(), "engine step failed; failing its requests");
                            driver.on_step_error(&mut engine, &e);
                        }
                    }
                }
                Some(d) => {
                    publish(&snap_tx, &engine, meter.rate, batch);
                    match runtime.block_on(async { tokio::time::timeout(d, rx.recv()).await }) {
                        Ok(Some(Envelope::Command(c))) => driver.on_command(&mut engine, c),
                        Ok(Some(Envelope::Shutdown)) | Ok(None) => return,
                        Err(_elapsed) => {}
                    }
                }
            }
            let rate = meter.update(engine.stats(), Instant::now());
            publish(&snap_tx, &engine, rate, batch);
            if let Some(sink) = &mut cache_events {
                sink.tick(&mut engine);
            }
        }
    }));
    let exit = if result.is_err() {
        tracing::error!("the engine thread panicked; its requests end without a final message");
        Exit::Died
    } else {
        Exit::Orderly
    };
    driver.shutdown(&mut engine);
    publish(&snap_tx, &engine, 0.0, 0);
    exit
}

/// How the loop ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Exit {
    /// Shutdown was asked for (or every handle dropped).
    Orderly,
    /// A panic ended it.
    Died,
}

fn publish(tx: &watch::Sender<EngineSnapshot>, engine: &Engine, rate: f64, batch: usize) {
    let snap = EngineSnapshot::of(engine, rate, batch);
    tx.send_if_modified(|cur| {
        let changed = *cur != snap;
        if changed {
            *cur = snap;
        }
        changed
    });
}
