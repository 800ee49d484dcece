//! When the workers' help pays: the policy that lets a caller run its jobs alone.
//!
//! A job shared with the workers ends when its slowest task ends. When a worker has lost its
//! core (a client, a sidecar or another node's threads run on it), the caller waits for that
//! worker's claimed task, and a job takes longer shared than the caller would have taken alone.
//! So every shared job is timed and compared with an estimate of the caller alone (the time the
//! caller spent in its own tasks, scaled to all of them). Over a window of [`WINDOW_JOBS`]
//! shared jobs, if the shared time exceeds [`PAYS_BELOW`] of the solo estimate, the next
//! `stretch` jobs run on the caller alone; the stretch doubles, from [`FIRST_STRETCH_JOBS`] up to
//! [`MAX_STRETCH_JOBS`], while windows keep failing, and falls back to the first length when a
//! window pays. After each stretch one window is shared again, to see whether help pays now.
//!
//! Invariants:
//! - A decision changes only which thread runs a task, never what a task computes, so results
//!   are bit-for-bit the same shared or alone.
//! - The policy is a pure function of the timings it is given (no clock here): unit tests drive
//!   it with made-up ones.

/// Shared jobs per judgement.
pub const WINDOW_JOBS: u32 = 64;
/// Sharing pays when the shared jobs took less than this fraction of the caller-alone estimate.
pub const PAYS_BELOW: f64 = 0.9;
/// Jobs on the caller alone after the first window that did not pay.
pub const FIRST_STRETCH_JOBS: u32 = 256;
/// The longest stretch (a stretch doubles while windows keep failing).
pub const MAX_STRETCH_JOBS: u32 = 16_384;

/// How jobs are shared.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sharing {
    /// Every job with more than one task is offered to the workers.
    Always,
    /// Jobs go to the caller alone while the workers' help did not pay (see the module docs).
    Adaptive,
}

impl Sharing {
    /// Parses `always` or `adaptive` (the `TANDEM_POOL_SHARING` values).
    pub fn parse(s: &str) -> Option<Sharing> {
        match s.trim() {
            "always" => Some(Sharing::Always),
            "adaptive" => Some(Sharing::Adaptive),
            _ => None,
        }
    }
}

/// Counters of a pool's decisions.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Jobs offered to the workers.
    pub shared_jobs: u64,
    /// Jobs of more than one task that the caller ran alone because help did not pay.
    pub solo_jobs: u64,
    /// Windows after which a stretch on the caller alone began.
    pub solo_stretches: u64,
}

/// The policy's state (behind the pool's publish lock).
#[derive(Debug)]
pub struct Helping {
    sharing: Sharing,
    window_jobs: u32,
    window_shared_ns: u64,
    window_solo_ns: u64,
    solo_left: u32,
    stretch: u32,
    stats: PoolStats,
}

impl Helping {
    /// A fresh policy: share, and judge after the first window.
    pub fn new(sharing: Sharing) -> Helping {
        Helping {
            sharing,
            window_jobs: 0,
            window_shared_ns: 0,
            window_solo_ns: 0,
            solo_left: 0,
            stretch: FIRST_STRETCH_JOBS,
            stats: PoolStats::default(),
        }
    }

    /// True when the next job should run on the caller alone (and counts it as such).
    pub fn run_alone(&mut self) -> bool {
        if self.solo_left == 0 {
            return false;
        }
        self.solo_left -= 1;
        self.stats.solo_jobs += 1;
        true
    }

    /// Records a shared job: how long it took (`shared_ns`) and the caller-alone estimate for it
    /// (`solo_ns`; `None` when the caller ran none of its tasks, so there is nothing to scale).
    pub fn record_shared(&mut self, shared_ns: u64, solo_ns: Option<u64>) {
        self.stats.shared_jobs += 1;
        if self.sharing == Sharing::Always {
            return;
        }
        let Some(solo_ns) = solo_ns else { return };
        self.window_jobs += 1;
        self.window_shared_ns += shared_ns;
        self.window_solo_ns += solo_ns;
        if self.window_jobs < WINDOW_JOBS {
            return;
        }
        let pays = (self.window_shared_ns as f64) < PAYS_BELOW * self.window_solo_ns as f64;
        if pays {
            self.stretch = FIRST_STRETCH_JOBS;
        } else {
            self.solo_left = self.stretch;
            self.stretch = (self.stretch * 2).min(MAX_STRETCH_JOBS);
            self.stats.solo_stretches += 1;
        }
        self.window_jobs = 0;
        self.window_shared_ns = 0;
        self.window_solo_ns = 0;
    }

    /// The counters so far.
    pub fn stats(&self) -> PoolStats {
        self.stats
    }
}

/// The caller-alone estimate of a job: the caller's time in its `caller_tasks` tasks, scaled to
/// all `n_tasks`. `None` when the caller ran none.
pub fn solo_estimate_ns(caller_busy_ns: u64, caller_tasks: usize, n_tasks: usize) -> Option<u64> {
    (caller_tasks > 0)
        .then(|| (caller_busy_ns as u128 * n_tasks as u128 / caller_tasks as u128) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `jobs` shared jobs of these timings.
    fn feed(h: &mut Helping, jobs: u32, shared_ns: u64, solo_ns: u64) {
        for _ in 0..jobs {
            assert!(!h.run_alone(), "a window is being shared");
            h.record_shared(shared_ns, Some(solo_ns));
        }
    }

    fn drain_alone(h: &mut Helping) -> u32 {
        let mut n = 0;
        while h.run_alone() {
            n += 1;
        }
        n
    }

    #[test]
    fn help_that_pays_keeps_every_job_shared() {
        let mut h = Helping::new(Sharing::Adaptive);
        feed(&mut h, 10 * WINDOW_JOBS, 600, 1_000); // two threads, 1.67× faster
        assert_eq!(drain_alone(&mut h), 0);
        assert_eq!(h.stats().solo_stretches, 0);
        assert_eq!(h.stats().shared_jobs, 10 * WINDOW_JOBS as u64);
    }

    #[test]
    fn help_that_does_not_pay_sends_stretches_to_the_caller_doubling_to_the_cap() {
        let mut h = Helping::new(Sharing::Adaptive);
        let mut stretches = Vec::new();
        for _ in 0..10 {
            feed(&mut h, WINDOW_JOBS, 1_200, 1_000); // a preempted worker: slower than alone
            stretches.push(drain_alone(&mut h));
        }
        assert_eq!(&stretches[..3], &[256, 512, 1024]);
        assert_eq!(*stretches.last().unwrap(), MAX_STRETCH_JOBS);
        assert_eq!(h.stats().solo_stretches, 10);
        assert_eq!(
            h.stats().solo_jobs,
            stretches.iter().map(|&s| s as u64).sum::<u64>()
        );
    }

    #[test]
    fn a_window_that_pays_again_resets_the_stretch() {
        let mut h = Helping::new(Sharing::Adaptive);
        for _ in 0..3 {
            feed(&mut h, WINDOW_JOBS, 1_000, 1_000);
            drain_alone(&mut h);
        }
        feed(&mut h, WINDOW_JOBS, 500, 1_000); // the core is back
        assert_eq!(drain_alone(&mut h), 0);
        feed(&mut h, WINDOW_JOBS, 1_000, 1_000);
        assert_eq!(
            drain_alone(&mut h),
            FIRST_STRETCH_JOBS,
            "back to the first length"
        );
    }

    #[test]
    fn the_verdict_is_on_the_window_not_on_one_slow_job() {
        let mut h = Helping::new(Sharing::Adaptive);
        // One job in the window stalls 10× (a page fault, a preemption); the rest pay well.
        h.record_shared(10_000, Some(1_000));
        feed(&mut h, WINDOW_JOBS - 1, 500, 1_000);
        assert_eq!(drain_alone(&mut h), 0);
    }

    #[test]
    fn always_never_runs_alone_and_jobs_without_a_caller_share_are_not_judged() {
        let mut h = Helping::new(Sharing::Always);
        feed(&mut h, 4 * WINDOW_JOBS, 5_000, 1_000);
        assert_eq!(drain_alone(&mut h), 0);
        let mut h = Helping::new(Sharing::Adaptive);
        for _ in 0..4 * WINDOW_JOBS {
            h.record_shared(5_000, None);
        }
        assert_eq!(drain_alone(&mut h), 0, "no estimate, no verdict");
    }

    #[test]
    fn the_estimate_scales_the_caller_s_time_to_every_task() {
        assert_eq!(solo_estimate_ns(300, 3, 8), Some(800));
        assert_eq!(solo_estimate_ns(300, 0, 8), None);
        assert_eq!(Sharing::parse(" adaptive\n"), Some(Sharing::Adaptive));
        assert_eq!(Sharing::parse("sometimes"), None);
    }
}
