//! Every drill: what it breaks, when, for how long, and what it proves.
//!
//! Durations are the full-length ones (a 20 s hang, a 30 s etcd outage); the short forms the test
//! suite runs scale them down ([`Drill::scaled`]) but inject the same fault at the same moment.

use std::time::Duration;

use crate::cluster::Signal;
use crate::error::DrillError;

/// The drills, by name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DrillKind {
    /// `kill -9` of a decode node while it streams.
    DecodeKill,
    /// `kill -9` of a prefill node while it computes and pushes KV.
    PrefillKill,
    /// A decode node frozen (SIGSTOP) for 20 s, then thawed.
    DecodeStop,
    /// etcd killed, restarted after 30 s.
    EtcdKill,
    /// etcd frozen for 30 s.
    EtcdStop,
    /// NATS killed and started again.
    NatsRestart,
    /// The router killed and started again (clients retry).
    RouterRestart,
    /// Half the streaming clients hang up mid-answer.
    DisconnectStorm,
    /// A decode node cut off the network (its own namespace, veth link down) for 20 s.
    Partition,
    /// etcd's data directory (a small tmpfs) filled for 30 s, then freed.
    EtcdDiskFull,
    /// For 20 s every KV push of one prefill node has a byte flipped after checksumming.
    KvCorrupt,
    /// For 20 s one prefill node's pushes lose their first chunk (they can only time out).
    KvDrop,
    /// For 20 s one prefill node's connections are cut 4 KiB into each push.
    KvCut,
    /// For 20 s one prefill node waits 1 s before every chunk it sends (a stalled link).
    KvDelay,
    /// For 20 s one prefill node waits 20 ms before every chunk (a slow link).
    KvSlow,
}

/// When the fault is injected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Trigger {
    /// Once this many streamed tokens have reached the clients (streams are in flight).
    StreamedTokens(u64),
    /// Once at least `min_tokens` have streamed and the named node has a sequence in its engine
    /// or a KV transfer live (read from its metrics every few milliseconds); at the latest
    /// after `fallback_tokens` (the row then says the node was never seen busy).
    NodeBusy {
        /// The node.
        node: &'static str,
        /// Streamed tokens first.
        min_tokens: u64,
        /// Inject anyway after this many.
        fallback_tokens: u64,
    },
}

impl Trigger {
    /// How the trigger reads in errors and tables.
    pub fn describe(&self) -> String {
        match self {
            Trigger::StreamedTokens(n) => format!("{n} streamed tokens"),
            Trigger::NodeBusy {
                node, min_tokens, ..
            } => {
                format!(
                    "{min_tokens} streamed tokens and {node} busy with a sequence or a transfer"
                )
            }
        }
    }
}

/// One step of a fault.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultStep {
    /// Send a signal to a process.
    Signal(&'static str, Signal),
    /// Wait (the fault lasts).
    Sleep(Duration),
    /// Start a process again with its original command line.
    Restart(&'static str),
    /// Start a process again if it has exited (a fault it may or may not survive).
    Revive(&'static str),
    /// Cut the process (started in its own network namespace) off the network.
    Partition(&'static str),
    /// Join it again.
    Heal(&'static str),
    /// Fill the size-limited disk under the process's data until it refuses more.
    FillDisk(&'static str),
    /// Remove what filled it.
    FreeDisk(&'static str),
}

/// What a drill needs of the cluster before it starts (both need root).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Setup {
    /// The named node runs in its own network namespace, joined by a veth pair.
    OwnNetns(&'static str),
    /// etcd's data directory is a tmpfs of this many MiB.
    SmallEtcdDisk {
        /// Its size.
        mib: u64,
    },
}

/// A drill: its fault, its trigger, and what it proves.
#[derive(Clone, Debug)]
pub struct Drill {
    /// Which drill.
    pub kind: DrillKind,
    /// Its name on the command line.
    pub name: &'static str,
    /// What passing it proves.
    pub proves: &'static str,
    /// When the fault starts.
    pub trigger: Trigger,
    /// The fault.
    pub steps: Vec<FaultStep>,
    /// Half the streaming clients hang up after this many tokens.
    pub hang_up_after: Option<u64>,
    /// The KV-push fault (`--kv-fault` syntax) the prefill nodes start with switched off;
    /// `SIGUSR1` switches it on and off (fault-injection builds only).
    pub kv_fault: Option<&'static str>,
    /// What the cluster must be started with.
    pub setup: Option<Setup>,
}

const ALL: [DrillKind; 15] = [
    DrillKind::DecodeKill,
    DrillKind::PrefillKill,
    DrillKind::DecodeStop,
    DrillKind::EtcdKill,
    DrillKind::EtcdStop,
    DrillKind::NatsRestart,
    DrillKind::RouterRestart,
    DrillKind::DisconnectStorm,
    DrillKind::Partition,
    DrillKind::EtcdDiskFull,
    DrillKind::KvCorrupt,
    DrillKind::KvDrop,
    DrillKind::KvCut,
    DrillKind::KvDelay,
    DrillKind::KvSlow,
];

impl Drill {
    /// Every drill, full length, in the order `--all` runs them.
    pub fn all() -> Vec<Drill> {
        ALL.iter().map(|&k| Drill::of(k)).collect()
    }

    /// The drill named `name`.
    pub fn by_name(name: &str) -> Result<Drill, DrillError> {
        Drill::all()
            .into_iter()
            .find(|d| d.name == name)
            .ok_or_else(|| DrillError::UnknownDrill {
                name: name.to_string(),
                known: Drill::all()
                    .iter()
                    .map(|d| d.name)
                    .collect::<Vec<_>>()
                    .join(", "),
            })
    }

    /// The full-length drill of `kind`.
    pub fn of(kind: DrillKind) -> Drill {
        use FaultStep::{
            FillDisk, FreeDisk, Heal, Partition, Restart, Revive, Signal as Send, Sleep,
        };
        use Signal::{Cont, Kill, Stop, Usr1};
        let s = Duration::from_secs;
        // A KV fault on prefill-0 for 20 s, once streams are flowing.
        let kv = |spec: &'static str| {
            (
                Trigger::StreamedTokens(10),
                vec![
                    Send("prefill-0", Usr1),
                    Sleep(s(20)),
                    Send("prefill-0", Usr1),
                ],
                None,
                Some(spec),
            )
        };
        let (name, proves, (trigger, steps, hang_up_after, kv_fault)) = match kind {
            DrillKind::DecodeKill => (
                "decode-kill",
                "a decode node that dies mid-stream (once it holds streams) loses no request: the router migrates each of its streams (re-prefill of prompt + tokens so far) to another decode node, and the client sees the same tokens",
                (
                    Trigger::NodeBusy {
                        node: "decode-0",
                        min_tokens: 30,
                        fallback_tokens: 300,
                    },
                    vec![Send("decode-0", Kill)],
                    None,
                    None,
                ),
            ),
            DrillKind::PrefillKill => (
                "prefill-kill",
                "a prefill node that dies while computing or pushing KV loses no request: the decode reservation is released and the prompt is prefilled again on another prefill node",
                (
                    Trigger::NodeBusy {
                        node: "prefill-0",
                        min_tokens: 0,
                        fallback_tokens: 200,
                    },
                    vec![Send("prefill-0", Kill)],
                    None,
                    None,
                ),
            ),
            DrillKind::DecodeStop => (
                "decode-stop",
                "a hung decode node (alive, holding its lease, answering nothing) is detected by its silence and its streams migrate; when it thaws it serves again without leaking blocks",
                (
                    Trigger::NodeBusy {
                        node: "decode-0",
                        min_tokens: 30,
                        fallback_tokens: 300,
                    },
                    vec![Send("decode-0", Stop), Sleep(s(20)), Send("decode-0", Cont)],
                    None,
                    None,
                ),
            ),
            DrillKind::EtcdKill => (
                "etcd-kill",
                "losing etcd for 30 s stops nothing: routers serve on their last view of the nodes, nodes keep serving, and every node registers again when etcd returns",
                (
                    Trigger::StreamedTokens(30),
                    vec![Send("etcd", Kill), Sleep(s(30)), Restart("etcd")],
                    None,
                    None,
                ),
            ),
            DrillKind::EtcdStop => (
                "etcd-stop",
                "an etcd that hangs for 30 s (connections open, no answers) stops nothing: calls to it time out instead of blocking the request path",
                (
                    Trigger::StreamedTokens(30),
                    vec![Send("etcd", Stop), Sleep(s(30)), Send("etcd", Cont)],
                    None,
                    None,
                ),
            ),
            DrillKind::NatsRestart => (
                "nats-restart",
                "losing NATS (the load signals) degrades routing to its fallback and nothing else; publishers reconnect when it returns",
                (
                    Trigger::StreamedTokens(30),
                    vec![Send("nats", Kill), Sleep(s(5)), Restart("nats")],
                    None,
                    None,
                ),
            ),
            DrillKind::RouterRestart => (
                "router-restart",
                "a router that crashes and restarts loses only the connections it held: clients that retry get the same answers, and the nodes release everything those streams held",
                (
                    Trigger::StreamedTokens(30),
                    vec![Send("router", Kill), Sleep(s(2)), Restart("router")],
                    None,
                    None,
                ),
            ),
            DrillKind::DisconnectStorm => (
                "disconnect-storm",
                "clients that hang up mid-stream (half of them at once) cancel their work end to end: every KV block they held on prefill and decode nodes is freed",
                (Trigger::StreamedTokens(10), vec![], Some(4), None),
            ),
            DrillKind::Partition => (
                "partition",
                "a decode node cut off the network for 20 s (alive, unreachable, unable to reach etcd or NATS) loses no request: its streams migrate, its lease expires and it leaves the routing view; healed, it registers again and releases what the cut streams held",
                (
                    Trigger::NodeBusy {
                        node: "decode-0",
                        min_tokens: 30,
                        fallback_tokens: 300,
                    },
                    vec![Partition("decode-0"), Sleep(s(20)), Heal("decode-0")],
                    None,
                    None,
                ),
            ),
            DrillKind::EtcdDiskFull => (
                "etcd-disk-full",
                "etcd's disk full for 30 s (writes refused, or etcd stopping) stops nothing: serving goes on from the routers' view, and once space is back etcd (restarted if it died) takes the nodes' registrations again",
                (
                    Trigger::StreamedTokens(30),
                    vec![
                        FillDisk("etcd"),
                        Sleep(s(30)),
                        FreeDisk("etcd"),
                        Revive("etcd"),
                    ],
                    None,
                    None,
                ),
            ),
            DrillKind::KvCorrupt => (
                "kv-corrupt",
                "a KV push damaged in flight is refused by the decode node's checksums (never decoded) and the request is prefilled again on another prefill node",
                kv("corrupt:100"),
            ),
            DrillKind::KvDrop => (
                "kv-drop",
                "a push that loses a chunk ends at its deadline (never decoded from partial KV), its reservation is freed, and the request is prefilled again elsewhere",
                kv("drop:0"),
            ),
            DrillKind::KvCut => (
                "kv-cut",
                "a connection cut mid-push is seen by both sides, everything it held is released, and the request is prefilled again elsewhere",
                kv("cut:4096"),
            ),
            DrillKind::KvDelay => (
                "kv-delay",
                "a stalled KV link (1 s before every chunk) delays its requests, within the push deadline, without losing or garbling any",
                kv("delay-ms:1000"),
            ),
            DrillKind::KvSlow => (
                "kv-slow",
                "a slow KV link (20 ms before every chunk) costs time to first token and nothing else",
                kv("delay-ms:20"),
            ),
        };
        let setup = match kind {
            DrillKind::Partition => Some(Setup::OwnNetns("decode-0")),
            // etcd's WAL preallocates 64 MiB segments: room for one, its database and a little.
            DrillKind::EtcdDiskFull => Some(Setup::SmallEtcdDisk { mib: 160 }),
            _ => None,
        };
        Drill {
            kind,
            name,
            proves,
            trigger,
            steps,
            hang_up_after,
            kv_fault,
            setup,
        }
    }

    /// The same drill with every wait multiplied by `factor` (the short forms use ~0.3).
    pub fn scaled(mut self, factor: f64) -> Drill {
        for step in &mut self.steps {
            if let FaultStep::Sleep(d) = step {
                *d = d.mul_f64(factor);
            }
        }
        self
    }

    /// How long the fault lasts (its waits).
    pub fn fault_duration(&self) -> Duration {
        self.steps
            .iter()
            .map(|s| match s {
                FaultStep::Sleep(d) => *d,
                _ => Duration::ZERO,
            })
            .sum()
    }

    /// The nodes the fault kills and never restarts (their accounting died with them).
    pub fn killed_for_good(&self) -> Vec<&'static str> {
        let mut out = Vec::new();
        for step in &self.steps {
            match step {
                FaultStep::Signal(name, Signal::Kill) => out.push(*name),
                FaultStep::Restart(name) => out.retain(|n| n != name),
                _ => {}
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_an_unknown_one_lists_them_all() {
        assert!(
            Drill::all()
                .iter()
                .filter(|d| d.kv_fault.is_some())
                .all(|d| d.name.starts_with("kv-"))
        );
        let all = Drill::all();
        let mut names: Vec<_> = all.iter().map(|d| d.name).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), all.len());
        let err = Drill::by_name("decode-explode").unwrap_err().to_string();
        for d in &all {
            assert!(err.contains(d.name), "{err}");
        }
        assert_eq!(
            Drill::by_name("etcd-kill").unwrap().kind,
            DrillKind::EtcdKill
        );
    }

    #[test]
    fn scaling_shortens_only_the_waits_and_restarts_undo_kills() {
        let d = Drill::of(DrillKind::EtcdKill);
        assert_eq!(d.fault_duration(), Duration::from_secs(30));
        assert!(d.killed_for_good().is_empty(), "etcd is restarted");
        let short = d.clone().scaled(0.25);
        assert_eq!(short.fault_duration(), Duration::from_millis(7500));
        assert_eq!(short.steps.len(), d.steps.len());
        assert_eq!(
            Drill::of(DrillKind::DecodeKill).killed_for_good(),
            ["decode-0"]
        );
    }
}
