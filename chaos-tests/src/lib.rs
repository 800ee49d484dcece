//! Failover drills: a bounded stream of real requests against a real cluster, one real fault in
//! the middle of it, and a count of what the clients and the nodes saw.
//!
//! A drill runs in three parts:
//! 1. **Reference.** Every distinct request of the workload (streamed and not, short and long
//!    prompts, greedy, a fixed number of tokens) runs once on the fault-free cluster; their
//!    outputs are what every later answer is compared with, token text by token text.
//! 2. **The drill.** The workload runs again, paced (an open loop: requests start on schedule
//!    whether or not earlier ones finished), and the drill's fault is injected once its trigger
//!    holds (streams in flight, a transfer under way): a process killed, stopped, restarted, cut
//!    off the network, its disk filled, or half the clients hanging up.
//! 3. **Accounting.** Once the load ends, every surviving node's own KV accounting must come back
//!    to zero blocks used or reserved (what stays is leaked), and after the cluster stops no
//!    process it started may still run.
//!
//! The result is one [`Row`]: sent, ok, failed, garbled (an answer that differs from the
//! reference), cancelled (by the drill's own clients), the longest stall a client saw, the time
//! until a request sent after the fault was served, leaked blocks, processes left behind, and
//! whether the drill met its target (0 lost, 0 garbled, 0 leaked, recovery within one lease TTL).
//!
//! Invariants: a drill never hides a failure (every request is counted exactly once, in exactly
//! one of ok, failed or cancelled); a fault it could not inject is an error, not a pass.
//!
//! The cluster sits behind [`ClusterHandle`], a small trait: `tandem drill` implements it over
//! the processes `tandem up` starts; anything else that can signal and restart processes by
//! name can run the same drills.

mod catalogue;
mod cluster;
mod error;
mod probe;
mod report;
mod run;
mod workload;

pub use catalogue::{Drill, DrillKind, FaultStep, Setup, Trigger};
pub use cluster::{ClusterHandle, NodeEndpoint, Signal};
pub use error::DrillError;
pub use probe::metric as scrape_metric;
pub use report::{Row, table};
pub use run::{DrillOptions, run_drill};
pub use workload::{Outcome, RequestSpec, Workload};
