//! The one error type of the drills.

/// Why a drill could not run (a drill that ran and missed its target is a [`crate::Row`] with
/// `target_met: false`, not an error).
#[derive(Debug, thiserror::Error)]
pub enum DrillError {
    /// No drill by that name; the known ones are listed.
    #[error("no drill named `{name}`; the drills are: {known}")]
    UnknownDrill {
        /// The name asked for.
        name: String,
        /// Every drill's name, comma-separated.
        known: String,
    },
    /// The router did not answer at the address the drill tried.
    #[error("cannot reach the router at {addr}: {reason}")]
    Unreachable {
        /// The address tried.
        addr: String,
        /// What failed.
        reason: String,
    },
    /// The fault-free reference run failed: the cluster is not healthy to begin with.
    #[error("the fault-free reference run failed for request {request}: {reason}")]
    Reference {
        /// Which request.
        request: usize,
        /// Its error.
        reason: String,
    },
    /// The drill's trigger never held (no stream in flight, no transfer seen) in time.
    #[error("drill `{drill}`: its trigger ({trigger}) did not hold within {waited_s} s")]
    TriggerTimeout {
        /// The drill.
        drill: String,
        /// What it waited for.
        trigger: String,
        /// How long it waited.
        waited_s: u64,
    },
    /// The cluster could not do what the fault needs (signal, restart, a mount).
    #[error("drill `{drill}`: {action} failed: {reason}")]
    Fault {
        /// The drill.
        drill: String,
        /// What it tried (e.g. `SIGKILL decode-0`).
        action: String,
        /// Why it failed.
        reason: String,
    },
    /// SIGINT/SIGTERM arrived: the drill stopped its cluster and ended.
    #[error("drill `{drill}` interrupted; its cluster was stopped")]
    Interrupted {
        /// The drill.
        drill: String,
    },
    /// This machine does not allow the fault (e.g. network namespaces without root).
    #[error("drill `{drill}` cannot run here: {reason}")]
    NotPermitted {
        /// The drill.
        drill: String,
        /// What is missing.
        reason: String,
    },
}
