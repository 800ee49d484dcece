//! The seam between the drills and the cluster they break: a handle that can name, signal and
//! restart the cluster's processes.
//!
//! Process names follow `tandem up`: `etcd`, `nats`, `router`, `prefill-N`, `decode-N`. Every
//! call is made from the thread that owns the handle (the cluster's processes may tie their
//! parent-death signal to it), never from inside the drill's async runtime.

use std::net::SocketAddr;
use std::time::Duration;

/// A signal a drill sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Signal {
    /// `kill -9`: the process dies without a word.
    Kill,
    /// Polite stop: the process drains and leaves.
    Term,
    /// Freeze the process (a hang: it holds its sockets and leases but answers nothing).
    Stop,
    /// Thaw a stopped process.
    Cont,
    /// A fault-injection build's switch: turns a prefill node's KV-push fault on or off.
    Usr1,
}

impl Signal {
    /// The signal's usual name.
    pub fn name(self) -> &'static str {
        match self {
            Signal::Kill => "SIGKILL",
            Signal::Term => "SIGTERM",
            Signal::Stop => "SIGSTOP",
            Signal::Cont => "SIGCONT",
            Signal::Usr1 => "SIGUSR1",
        }
    }
}

/// A node's metrics endpoint (where its own KV accounting is read).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeEndpoint {
    /// The process name (`prefill-0`, `decode-1`, …).
    pub name: String,
    /// Its Prometheus `/metrics` URL.
    pub metrics_url: String,
}

/// A running cluster a drill may break.
pub trait ClusterHandle {
    /// The router's HTTP (OpenAI API) address.
    fn http_addr(&self) -> SocketAddr;
    /// The nodes and where their metrics are, as registered when the drill starts.
    fn nodes(&self) -> Result<Vec<NodeEndpoint>, String>;
    /// The nodes' lease TTL: the recovery target.
    fn lease_ttl(&self) -> Duration;
    /// Sends `signal` to the process named `name`.
    fn signal(&mut self, name: &str, signal: Signal) -> Result<(), String>;
    /// Starts the process named `name` again with its original command line (after it died or
    /// was killed), and waits until it listens again.
    fn restart(&mut self, name: &str) -> Result<(), String>;
    /// Whether the process named `name` runs.
    fn running(&mut self, name: &str) -> bool;
    /// Cuts the process named `name` off the network (`cut`) or joins it again. Only a process
    /// the cluster started in its own network namespace can be cut.
    fn partition(&mut self, name: &str, cut: bool) -> Result<(), String>;
    /// Fills the size-limited disk under `name`'s data until it refuses more (`full`; returns
    /// the bytes written) or removes what filled it.
    fn fill_disk(&mut self, name: &str, full: bool) -> Result<u64, String>;
    /// Whether the operator asked the drill to stop (SIGINT/SIGTERM): the drill ends at its next
    /// step and stops the cluster.
    fn interrupted(&self) -> bool {
        false
    }
    /// Stops the whole cluster and returns the pids it ever started that still run afterwards
    /// (`name pid`): what the drill left behind.
    fn stop_and_list_leftovers(&mut self) -> Vec<String>;
}
