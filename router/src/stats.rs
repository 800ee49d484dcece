//! Counters the router keeps about itself, readable in tests and (later) exported as metrics.
//! Only counts of things that happened: nothing here is estimated or simulated.
//!
//! Cost: relaxed atomic increments; [`RouterStats::snapshot`] reads each once.

use std::sync::atomic::{AtomicU64, Ordering};

use tandem_cluster::Role;

/// Per-role routing counters.
#[derive(Debug, Default)]
pub struct RoleStats {
    /// Choices made from fresh load reports.
    pub load_picks: AtomicU64,
    /// Choices made from the router's own in-flight counts (reports stale or absent).
    pub fallback_picks: AtomicU64,
    /// Times routing switched from load reports to the fallback.
    pub fallback_entered: AtomicU64,
}

/// Counters of one router.
#[derive(Debug, Default)]
pub struct RouterStats {
    /// Prefill-node routing.
    pub prefill: RoleStats,
    /// Decode-node routing.
    pub decode: RoleStats,
    /// Requests admitted (past validation and the queue).
    pub admitted: AtomicU64,
    /// Requests refused by the admission queue (full or timed out).
    pub overloaded: AtomicU64,
    /// Requests that ended with their final message.
    pub completed: AtomicU64,
    /// Admitted requests that ended with an error.
    pub failed: AtomicU64,
    /// Admitted requests whose client went away.
    pub cancelled: AtomicU64,
    /// Attempts repeated on another pair after a retry-safe failure.
    pub retries: AtomicU64,
    /// Of those, re-prefills after a corrupt KV transfer (DATA_LOSS).
    pub reprefills: AtomicU64,
    /// Of those, migrations: streams continued on another pair after output was sent.
    pub migrations: AtomicU64,
    /// Decode reservations refused (RESOURCE_EXHAUSTED) and tried elsewhere.
    pub reserve_refusals: AtomicU64,
    /// Release calls sent for reservations no Decode call completed.
    pub releases: AtomicU64,
    /// Reserve calls that got no answer (timed out, or the connection failed) after they were
    /// sent: the node may have granted blocks the router cannot name, which stay reserved until
    /// the node's reservation TTL frees them.
    pub reserve_unanswered: AtomicU64,
}

/// A plain copy of [`RouterStats`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StatsSnapshot {
    /// Prefill routing: (load picks, fallback picks, fallback entered).
    pub prefill: RoleSnapshot,
    /// Decode routing.
    pub decode: RoleSnapshot,
    /// See [`RouterStats::admitted`].
    pub admitted: u64,
    /// See [`RouterStats::overloaded`].
    pub overloaded: u64,
    /// See [`RouterStats::completed`].
    pub completed: u64,
    /// See [`RouterStats::failed`].
    pub failed: u64,
    /// See [`RouterStats::cancelled`].
    pub cancelled: u64,
    /// See [`RouterStats::retries`].
    pub retries: u64,
    /// See [`RouterStats::reprefills`].
    pub reprefills: u64,
    /// See [`RouterStats::migrations`].
    pub migrations: u64,
    /// See [`RouterStats::reserve_refusals`].
    pub reserve_refusals: u64,
    /// See [`RouterStats::releases`].
    pub releases: u64,
    /// See [`RouterStats::reserve_unanswered`].
    pub reserve_unanswered: u64,
}

/// A plain copy of [`RoleStats`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RoleSnapshot {
    /// See [`RoleStats::load_picks`].
    pub load_picks: u64,
    /// See [`RoleStats::fallback_picks`].
    pub fallback_picks: u64,
    /// See [`RoleStats::fallback_entered`].
    pub fallback_entered: u64,
}

/// Adds one to a counter.
pub(crate) fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

impl RoleStats {
    fn snapshot(&self) -> RoleSnapshot {
        RoleSnapshot {
            load_picks: self.load_picks.load(Ordering::Relaxed),
            fallback_picks: self.fallback_picks.load(Ordering::Relaxed),
            fallback_entered: self.fallback_entered.load(Ordering::Relaxed),
        }
    }
}

impl RouterStats {
    /// The counters of `role`.
    pub fn role(&self, role: Role) -> &RoleStats {
        match role {
            Role::Prefill => &self.prefill,
            Role::Decode => &self.decode,
        }
    }

    /// Reads every counter.
    pub fn snapshot(&self) -> StatsSnapshot {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        StatsSnapshot {
            prefill: self.prefill.snapshot(),
            decode: self.decode.snapshot(),
            admitted: get(&self.admitted),
            overloaded: get(&self.overloaded),
            completed: get(&self.completed),
            failed: get(&self.failed),
            cancelled: get(&self.cancelled),
            retries: get(&self.retries),
            reprefills: get(&self.reprefills),
            migrations: get(&self.migrations),
            reserve_refusals: get(&self.reserve_refusals),
            releases: get(&self.releases),
            reserve_unanswered: get(&self.reserve_unanswered),
        }
    }
}
