//! A persistent worker pool for fine-grained kernel parallelism.
//!
//! ```text
//!   caller ──publish job──► job slot (AtomicPtr) ──► generation += 1
//!     │                                                   │ workers spin on it (SPIN_BEFORE_PARK),
//!     │ claims tasks too                                  │ then park on a condvar
//!     ▼                                                   ▼
//!   next.fetch_add(1) ◄──────── each thread claims task indices until none are left
//!     │
//!   wait: done == n_tasks, then clear the slot, then wait: active == 0   (the job lives on the
//!   caller's stack, so no worker may still hold a pointer to it when `run` returns)
//! ```
//!
//! Decode issues ~20,000 parallel ops a second, so a dispatch must cost about a microsecond:
//! threads are created once, the caller participates, and idle workers spin on an atomic
//! generation counter before parking (a condvar wake per op would cost tens of microseconds).
//! The spin is bounded by time, not by iterations: an idle pool costs no CPU 100 µs after its
//! last job, whatever the CPU's `pause` costs.
//!
//! A shared job waits for its slowest task, so a worker that lost its core (another process
//! runs there) makes the job slower than the caller alone: [`helping`] times each shared job
//! against a caller-alone estimate and runs stretches of jobs on the caller alone while sharing
//! does not pay (`TANDEM_POOL_SHARING=always` turns that off).
//!
//! Invariants:
//! - Which thread runs a task never affects results: kernels split work by *outputs*, each task
//!   computes a fixed set of output elements with a fixed operation order.
//! - `run` returns only after every task has finished and no worker references the job.
//! - Nested or concurrent `run` calls (a task calling `run`, or two threads sharing a pool) do
//!   not deadlock: the inner/second caller runs its tasks inline on its own thread.
//! - A panicking task is caught on the worker and re-raised on the caller after the job ends.

use crate::KernelError;
use std::cell::Cell;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub mod helping;
use helping::Helping;
pub use helping::{PoolStats, Sharing};

/// How long an idle worker spins on the generation counter before it parks.
const SPIN_BEFORE_PARK: Duration = Duration::from_micros(100);
/// Spins between two reads of the clock while a worker waits.
const SPINS_PER_CLOCK_READ: u32 = 64;
/// Spin iterations a caller waits for workers before it starts yielding its core.
const WAIT_SPINS_BEFORE_YIELD: u32 = 2_000;

struct Job<'a> {
    f: &'a (dyn Fn(usize) + Sync),
    n_tasks: usize,
    next: AtomicUsize,
    done: AtomicUsize,
    panicked: AtomicBool,
}

impl Job<'_> {
    /// Claims and runs tasks until none are left; returns how many this thread ran.
    fn work(&self) -> usize {
        let mut ran = 0;
        loop {
            let i = self.next.fetch_add(1, SeqCst);
            if i >= self.n_tasks {
                return ran;
            }
            ran += 1;
            if catch_unwind(AssertUnwindSafe(|| (self.f)(i))).is_err() {
                self.panicked.store(true, SeqCst);
            }
            self.done.fetch_add(1, SeqCst);
        }
    }
}

struct Shared {
    generation: AtomicU64,
    job: AtomicPtr<Job<'static>>,
    active: AtomicUsize,
    sleepers: AtomicUsize,
    shutdown: AtomicBool,
    lock: Mutex<()>,
    wake: Condvar,
}

thread_local! {
    /// True while this thread is inside a job (as a worker or as the publishing caller).
    static IN_JOB: Cell<bool> = const { Cell::new(false) };
}

/// A fixed set of worker threads plus the calling thread.
pub struct WorkerPool {
    threads: usize,
    shared: Arc<Shared>,
    /// Held by the caller whose job is published; guards the sharing policy.
    publish: Mutex<Helping>,
    workers: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for WorkerPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerPool")
            .field("threads", &self.threads)
            .finish_non_exhaustive()
    }
}

impl WorkerPool {
    /// A pool of `threads` threads in all: `threads - 1` workers plus whichever thread calls
    /// `run`; jobs are shared adaptively ([`Sharing::Adaptive`]).
    pub fn new(threads: usize) -> Result<WorkerPool, KernelError> {
        WorkerPool::with_sharing(threads, Sharing::Adaptive)
    }

    /// A pool of `threads` threads that shares jobs as `sharing` says.
    pub fn with_sharing(threads: usize, sharing: Sharing) -> Result<WorkerPool, KernelError> {
        if threads == 0 {
            return Err(KernelError::ZeroThreads);
        }
        let shared = Arc::new(Shared {
            generation: AtomicU64::new(0),
            job: AtomicPtr::new(std::ptr::null_mut()),
            active: AtomicUsize::new(0),
            sleepers: AtomicUsize::new(0),
            shutdown: AtomicBool::new(false),
            lock: Mutex::new(()),
            wake: Condvar::new(),
        });
        let mut pool = WorkerPool {
            threads,
            shared,
            publish: Mutex::new(Helping::new(sharing)),
            workers: Vec::new(),
        };
        for index in 1..threads {
            let shared = Arc::clone(&pool.shared);
            let handle = std::thread::Builder::new()
                .name(format!("tandem-kernel-{index}"))
                .spawn(move || worker_loop(&shared))
                .map_err(|e| KernelError::SpawnFailed {
                    index,
                    reason: e.to_string(),
                })?;
            pool.workers.push(handle);
        }
        Ok(pool)
    }

    /// Threads that run tasks, the caller included.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// How many jobs were shared, and how many ran on the caller alone.
    pub fn stats(&self) -> PoolStats {
        self.publish
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .stats()
    }

    /// Runs `f(0), f(1), .., f(n_tasks - 1)`, spread over the pool; returns when all are done.
    /// Tasks may run in any order on any thread. Re-raises a task's panic.
    pub fn run(&self, n_tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        if n_tasks == 0 {
            return;
        }
        let inline = n_tasks == 1 || self.workers.is_empty() || IN_JOB.with(|c| c.get());
        let guard = if inline {
            None
        } else {
            self.publish.try_lock().ok()
        };
        let Some(mut helping) = guard else {
            (0..n_tasks).for_each(f);
            return;
        };
        if helping.run_alone() {
            (0..n_tasks).for_each(f);
            return;
        }
        let t0 = Instant::now();
        let job = Job {
            f,
            n_tasks,
            next: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
        };
        let sh = &*self.shared;
        // SAFETY (lifetime erasure): the pointer is cleared, and every worker that could have
        // loaded it has left (`active == 0`), before this function returns and `job` dies.
        let ptr = (&job as *const Job<'_>).cast::<Job<'static>>().cast_mut();
        sh.job.store(ptr, SeqCst);
        sh.generation.fetch_add(1, SeqCst);
        if sh.sleepers.load(SeqCst) > 0 {
            let _l = sh.lock.lock().unwrap_or_else(|p| p.into_inner());
            sh.wake.notify_all();
        }
        IN_JOB.with(|c| c.set(true));
        let caller_t0 = Instant::now();
        let caller_tasks = job.work();
        let caller_busy = caller_t0.elapsed();
        IN_JOB.with(|c| c.set(false));
        wait_until(|| job.done.load(SeqCst) >= n_tasks);
        let shared_ns = t0.elapsed().as_nanos() as u64;
        sh.job.store(std::ptr::null_mut(), SeqCst);
        wait_until(|| sh.active.load(SeqCst) == 0);
        let solo = helping::solo_estimate_ns(caller_busy.as_nanos() as u64, caller_tasks, n_tasks);
        helping.record_shared(shared_ns, solo);
        if job.panicked.load(SeqCst) {
            panic!("a kernel task panicked on a worker thread");
        }
    }

    /// Splits `0..len` into `n_tasks` contiguous, nearly equal ranges and runs `f(range)` on each.
    pub fn run_ranges(
        &self,
        len: usize,
        n_tasks: usize,
        f: &(dyn Fn(std::ops::Range<usize>) + Sync),
    ) {
        let n = n_tasks.clamp(1, len.max(1));
        self.run(n, &|t| f(split_range(len, n, t)));
    }
}

/// Spins until `ready()`, yielding the CPU after a short while: on an oversubscribed machine
/// the thread we wait for may need this core to finish its task.
fn wait_until(ready: impl Fn() -> bool) {
    let mut spins = 0u32;
    while !ready() {
        if spins < WAIT_SPINS_BEFORE_YIELD {
            spins += 1;
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
}

/// Range `t` of `0..len` split into `n` contiguous parts whose sizes differ by at most one.
pub fn split_range(len: usize, n: usize, t: usize) -> std::ops::Range<usize> {
    let (q, r) = (len / n, len % n);
    let start = t * q + t.min(r);
    start..start + q + usize::from(t < r)
}

fn worker_loop(sh: &Shared) {
    IN_JOB.with(|c| c.set(true));
    let mut seen = 0u64;
    loop {
        // Wait for a new generation: spin (for SPIN_BEFORE_PARK), then park.
        let (mut spins, started) = (0u32, Instant::now());
        while sh.generation.load(SeqCst) == seen && !sh.shutdown.load(SeqCst) {
            spins = spins.wrapping_add(1);
            if spins % SPINS_PER_CLOCK_READ != 0 || started.elapsed() < SPIN_BEFORE_PARK {
                std::hint::spin_loop();
            } else {
                let mut l = sh.lock.lock().unwrap_or_else(|p| p.into_inner());
                sh.sleepers.fetch_add(1, SeqCst);
                while sh.generation.load(SeqCst) == seen && !sh.shutdown.load(SeqCst) {
                    l = sh.wake.wait(l).unwrap_or_else(|p| p.into_inner());
                }
                sh.sleepers.fetch_sub(1, SeqCst);
            }
        }
        if sh.shutdown.load(SeqCst) {
            return;
        }
        sh.active.fetch_add(1, SeqCst);
        seen = sh.generation.load(SeqCst);
        let ptr = sh.job.load(SeqCst);
        if !ptr.is_null() {
            // SAFETY: the publisher keeps the job alive until `active` drops back to zero,
            // and it cleared `job` before waiting on `active`, so a non-null pointer loaded
            // after our increment is still alive.
            unsafe { (*ptr).work() };
        }
        sh.active.fetch_sub(1, SeqCst);
    }
}

impl Drop for WorkerPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, SeqCst);
        {
            let _l = self.shared.lock.lock().unwrap_or_else(|p| p.into_inner());
            self.shared.wake.notify_all();
        }
        for h in self.workers.drain(..) {
            let _ = h.join();
        }
    }
}

/// The process-wide pool the plain kernel entry points use: `TANDEM_THREADS` threads, else
/// the number of available cores; shared as `TANDEM_POOL_SHARING` says (`always` or
/// `adaptive`, the default; another value is named in a warning and the default used). Created
/// on first use.
pub fn global_pool() -> &'static WorkerPool {
    static POOL: OnceLock<WorkerPool> = OnceLock::new();
    POOL.get_or_init(|| {
        let n = std::env::var(crate::env::TANDEM_THREADS)
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .filter(|&n| n > 0)
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
        let sharing = match std::env::var(crate::env::TANDEM_POOL_SHARING) {
            Err(_) => Sharing::Adaptive,
            Ok(v) => Sharing::parse(&v).unwrap_or_else(|| {
                eprintln!(
                    "warning: {}={v:?} is neither `always` nor `adaptive`; using adaptive",
                    crate::env::TANDEM_POOL_SHARING
                );
                Sharing::Adaptive
            }),
        };
        WorkerPool::with_sharing(n, sharing)
            .or_else(|_| WorkerPool::new(1))
            .expect("a one-thread pool spawns no thread and cannot fail")
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    #[test]
    fn every_task_runs_exactly_once_for_many_jobs() {
        let pool = WorkerPool::new(3).unwrap();
        for n in [1usize, 2, 3, 7, 64, 1000] {
            let hits: Vec<AtomicU32> = (0..n).map(|_| AtomicU32::new(0)).collect();
            pool.run(n, &|i| {
                hits[i].fetch_add(1, SeqCst);
            });
            assert!(hits.iter().all(|h| h.load(SeqCst) == 1), "n = {n}");
        }
    }

    #[test]
    fn nested_run_executes_inline_without_deadlock() {
        let pool = WorkerPool::new(2).unwrap();
        let total = AtomicU32::new(0);
        pool.run(4, &|_| {
            pool.run(5, &|_| {
                total.fetch_add(1, SeqCst);
            });
        });
        assert_eq!(total.load(SeqCst), 20);
    }

    #[test]
    fn concurrent_callers_share_one_pool() {
        let pool = WorkerPool::new(2).unwrap();
        let total = AtomicU32::new(0);
        std::thread::scope(|s| {
            for _ in 0..3 {
                s.spawn(|| {
                    for _ in 0..200 {
                        pool.run(8, &|_| {
                            total.fetch_add(1, SeqCst);
                        });
                    }
                });
            }
        });
        assert_eq!(total.load(SeqCst), 3 * 200 * 8);
    }

    #[test]
    fn workers_wake_after_parking() {
        let pool = WorkerPool::new(2).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(50)); // long enough to park
        let total = AtomicU32::new(0);
        pool.run(100, &|_| {
            total.fetch_add(1, SeqCst);
        });
        assert_eq!(total.load(SeqCst), 100);
    }

    #[test]
    #[should_panic(expected = "kernel task panicked")]
    fn a_panicking_task_is_reraised_on_the_caller() {
        let pool = WorkerPool::new(2).unwrap();
        pool.run(64, &|i| {
            if i == 63 {
                // Make sure the worker, not only the caller, can hit it.
                panic!("boom");
            }
        });
    }

    /// A worker that stalls in every task it takes (its core taken) makes sharing slower than
    /// the caller alone: the adaptive pool then runs jobs on the caller alone, with the same
    /// results; an `always` pool keeps sharing.
    #[test]
    fn a_pool_whose_worker_stalls_runs_jobs_on_the_caller_alone_with_the_same_results() {
        for sharing in [Sharing::Adaptive, Sharing::Always] {
            let pool = WorkerPool::with_sharing(2, sharing).unwrap();
            let out: Vec<AtomicU32> = (0..4).map(|_| AtomicU32::new(0)).collect();
            for job in 0..300u32 {
                pool.run(4, &|i| {
                    let on_worker = std::thread::current()
                        .name()
                        .is_some_and(|n| n.starts_with("tandem-kernel"));
                    // 20 µs of work, so a woken worker claims tasks too; on the worker, 1 ms.
                    let t = std::time::Instant::now();
                    while t.elapsed() < std::time::Duration::from_micros(20) {
                        std::hint::spin_loop();
                    }
                    if on_worker {
                        std::thread::sleep(std::time::Duration::from_millis(1));
                    }
                    out[i].store(job * 10 + i as u32, SeqCst);
                });
                for (i, o) in out.iter().enumerate() {
                    assert_eq!(o.load(SeqCst), job * 10 + i as u32, "{sharing:?} job {job}");
                }
            }
            let s = pool.stats();
            assert_eq!(s.shared_jobs + s.solo_jobs, 300, "{sharing:?}: {s:?}");
            match sharing {
                Sharing::Adaptive => {
                    assert!(s.solo_stretches >= 1 && s.solo_jobs >= 200, "{s:?}")
                }
                Sharing::Always => assert_eq!(s.solo_jobs, 0, "{s:?}"),
            }
        }
    }

    #[test]
    fn split_range_covers_everything_once_and_evenly() {
        for len in [0usize, 1, 5, 18, 100] {
            for n in 1..7 {
                let parts: Vec<_> = (0..n).map(|t| split_range(len, n, t)).collect();
                assert_eq!(parts[0].start, 0);
                assert_eq!(parts[n - 1].end, len);
                for w in parts.windows(2) {
                    assert_eq!(w[0].end, w[1].start);
                }
                let sizes: Vec<usize> = parts.iter().map(|r| r.len()).collect();
                assert!(sizes.iter().max().unwrap() - sizes.iter().min().unwrap() <= 1);
            }
        }
    }
}
