//! Running one drill: reference, load with the fault, accounting (see the crate docs).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::catalogue::{Drill, FaultStep, Trigger};
use crate::cluster::{ClusterHandle, NodeEndpoint};
use crate::error::DrillError;
use crate::probe::{node_busy, router_recoveries, settle};
use crate::report::Row;
use crate::workload::{Outcome, Progress, Workload};

/// How a drill is sized.
#[derive(Clone, Debug)]
pub struct DrillOptions {
    /// Requests started per second during the drill.
    pub rate_per_s: f64,
    /// Tokens per request.
    pub max_tokens: u32,
    /// Load before the fault is expected and after it ends, s.
    pub margin_s: f64,
}

impl Default for DrillOptions {
    fn default() -> Self {
        DrillOptions {
            rate_per_s: 1.0,
            max_tokens: 24,
            margin_s: 10.0,
        }
    }
}

/// Waits after the load before the leak check gives up on a node (reservations expire, a
/// thawed node catches up).
const SETTLE_EXTRA: Duration = Duration::from_secs(30);

/// Runs `drill` against `cluster` and stops the cluster afterwards (the row counts what it
/// left behind). Must be called outside `rt` (the fault's steps block this thread).
pub fn run_drill(
    cluster: &mut dyn ClusterHandle,
    rt: &tokio::runtime::Runtime,
    drill: &Drill,
    opts: &DrillOptions,
) -> Result<Row, DrillError> {
    let addr = cluster.http_addr();
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .expect("an HTTP client without TLS always builds");
    rt.block_on(async {
        http.get(format!("http://{addr}/health"))
            .send()
            .await?
            .error_for_status()
    })
    .map_err(|e| DrillError::Unreachable {
        addr: format!("http://{addr}/health"),
        reason: e.to_string(),
    })?;
    let nodes = cluster.nodes().map_err(|reason| DrillError::Unreachable {
        addr: "etcd (the node list)".into(),
        reason,
    })?;

    let duration_s = 2.0 * opts.margin_s + drill.fault_duration().as_secs_f64();
    let mut load = Workload::mixed(
        (duration_s * opts.rate_per_s).ceil() as usize,
        opts.rate_per_s,
        opts.max_tokens,
    );
    if let Some(after) = drill.hang_up_after {
        // Every other streaming request hangs up (streams are the even indices).
        load.hang_up = Some((|i| i % 4 == 0, after));
    }
    let reference = rt
        .block_on(load.reference(addr))
        .map_err(|(request, reason)| DrillError::Reference { request, reason })?;

    let router_metrics = format!("http://{addr}/metrics");
    let recoveries_before = rt.block_on(router_recoveries(&http, &router_metrics));
    let progress = Arc::new(Progress::default());
    let t0 = Instant::now();
    let task = rt.spawn({
        let (load, progress) = (load.clone(), progress.clone());
        async move { load.run(addr, progress).await }
    });
    let mut notes = Vec::new();
    if let Err(e) = wait_for_trigger(
        drill, &*cluster, &nodes, rt, &http, &progress, t0, opts, &mut notes,
    ) {
        task.abort();
        cluster.stop_and_list_leftovers();
        return Err(e);
    }
    let fault_at = t0.elapsed();
    for step in &drill.steps {
        let done = match *step {
            FaultStep::Signal(name, signal) => cluster
                .signal(name, signal)
                .map_err(|e| (format!("{} {name}", signal.name()), e)),
            FaultStep::Sleep(d) => {
                let until = Instant::now() + d;
                while Instant::now() < until && !cluster.interrupted() {
                    std::thread::sleep(Duration::from_millis(50));
                }
                Ok(())
            }
            FaultStep::Restart(name) => cluster
                .restart(name)
                .map_err(|e| (format!("restarting {name}"), e)),
            FaultStep::Revive(name) if cluster.running(name) => Ok(()),
            FaultStep::Revive(name) => {
                notes.push(format!("{name} exited during the fault; started again"));
                cluster
                    .restart(name)
                    .map_err(|e| (format!("restarting {name}"), e))
            }
            FaultStep::Partition(name) | FaultStep::Heal(name) => {
                let cut = matches!(step, FaultStep::Partition(_));
                cluster.partition(name, cut).map_err(|e| {
                    let what = if cut { "cutting off" } else { "healing" };
                    (format!("{what} {name}"), e)
                })
            }
            FaultStep::FillDisk(name) => cluster
                .fill_disk(name, true)
                .map(|bytes| {
                    notes.push(format!(
                        "{name}'s disk filled ({:.0} MiB written until it refused more)",
                        bytes as f64 / (1u64 << 20) as f64
                    ))
                })
                .map_err(|e| (format!("filling {name}'s disk"), e)),
            FaultStep::FreeDisk(name) => cluster
                .fill_disk(name, false)
                .map(|_| ())
                .map_err(|e| (format!("freeing {name}'s disk"), e)),
        };
        if cluster.interrupted() {
            task.abort();
            cluster.stop_and_list_leftovers();
            return Err(DrillError::Interrupted {
                drill: drill.name.into(),
            });
        }
        if let Err((action, reason)) = done {
            task.abort();
            cluster.stop_and_list_leftovers();
            return Err(DrillError::Fault {
                drill: drill.name.into(),
                action,
                reason,
            });
        }
    }
    let outcomes = rt.block_on(task).expect("the load task does not panic");

    let dead = drill.killed_for_good();
    let survivors: Vec<&NodeEndpoint> = nodes
        .iter()
        .filter(|n| !dead.contains(&n.name.as_str()))
        .collect();
    let (leaked, holders) = rt.block_on(settle(
        &http,
        &survivors,
        cluster.lease_ttl() + SETTLE_EXTRA,
    ));
    notes.extend(
        holders
            .into_iter()
            .map(|h| format!("still held after the load: {h}")),
    );
    let after = rt.block_on(router_recoveries(&http, &router_metrics));
    // A restarted router counts from zero again.
    let recovered = if after >= recoveries_before {
        after - recoveries_before
    } else {
        after
    };
    let left = cluster.stop_and_list_leftovers();
    let mut row = account(
        drill,
        &load,
        &reference,
        &outcomes,
        fault_at,
        leaked,
        left,
        cluster.lease_ttl(),
        notes,
    );
    row.router_recoveries = recovered;
    Ok(row)
}

/// Blocks until the drill's trigger holds.
#[allow(clippy::too_many_arguments)]
fn wait_for_trigger(
    drill: &Drill,
    cluster: &dyn ClusterHandle,
    nodes: &[NodeEndpoint],
    rt: &tokio::runtime::Runtime,
    http: &reqwest::Client,
    progress: &Progress,
    t0: Instant,
    opts: &DrillOptions,
    notes: &mut Vec<String>,
) -> Result<(), DrillError> {
    let limit = Duration::from_secs_f64(opts.margin_s * 3.0 + 30.0);
    let streamed = |n: u64| progress.events.load(Ordering::Relaxed) >= n;
    loop {
        match drill.trigger {
            Trigger::StreamedTokens(n) if streamed(n) => return Ok(()),
            Trigger::NodeBusy {
                node,
                min_tokens,
                fallback_tokens,
            } if streamed(min_tokens) => {
                let url = nodes
                    .iter()
                    .find(|n| n.name == node)
                    .map(|n| n.metrics_url.clone());
                let busy = match url {
                    Some(url) => rt.block_on(node_busy(http, &url)),
                    None => false,
                };
                if busy {
                    return Ok(());
                }
                if streamed(fallback_tokens) {
                    notes.push(format!(
                        "{node} was never seen busy; the fault came after {fallback_tokens} streamed tokens"
                    ));
                    return Ok(());
                }
            }
            _ => {}
        }
        if cluster.interrupted() {
            return Err(DrillError::Interrupted {
                drill: drill.name.into(),
            });
        }
        if t0.elapsed() > limit {
            return Err(DrillError::TriggerTimeout {
                drill: drill.name.into(),
                trigger: drill.trigger.describe(),
                waited_s: limit.as_secs(),
            });
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Turns the outcomes into the drill's row.
#[allow(clippy::too_many_arguments)]
fn account(
    drill: &Drill,
    load: &Workload,
    reference: &[String],
    outcomes: &[Outcome],
    fault_at: Duration,
    leaked: Option<u64>,
    left: Vec<String>,
    lease_ttl: Duration,
    mut notes: Vec<String>,
) -> Row {
    let (mut ok, mut failed, mut garbled, mut cancelled, mut retried) = (0, 0, 0, 0, 0);
    let mut stall = Duration::ZERO;
    let mut recovery: Option<Duration> = None;
    let mut errors: Vec<String> = Vec::new();
    let mut retry_reasons: Vec<String> = Vec::new();
    for o in outcomes {
        retried += o.retries;
        for r in &o.retry_reasons {
            if retry_reasons.len() < 2 && !retry_reasons.contains(r) {
                retry_reasons.push(r.clone());
            }
        }
        stall = stall.max(o.longest_stall);
        let expected = &reference[o.spec];
        match &o.result {
            Ok(text) if o.cancelled => {
                cancelled += 1;
                if !expected.starts_with(text.as_str()) {
                    garbled += 1;
                }
            }
            Ok(text) => {
                ok += 1;
                if text != expected {
                    garbled += 1;
                    if errors.len() < 3 {
                        errors.push(format!("garbled: {:?} instead of {:?}", text, expected));
                    }
                }
                if o.sent_at >= fault_at {
                    let r = o.done_at - fault_at;
                    recovery = Some(recovery.map_or(r, |x| x.min(r)));
                }
            }
            Err(e) => {
                failed += 1;
                if errors.len() < 3 && !errors.contains(e) {
                    errors.push(e.clone());
                }
            }
        }
    }
    debug_assert_eq!(ok + failed + cancelled, load.total);
    let ttl = lease_ttl.as_secs_f64();
    let recovery_s = recovery.map(|d| d.as_secs_f64());
    if failed > 0 {
        notes.push(format!("{failed} request(s) failed"));
    }
    notes.extend(errors);
    notes.extend(
        retry_reasons
            .into_iter()
            .map(|r| format!("a client retried after: {r}")),
    );
    match recovery_s {
        None => notes.push("no request sent after the fault was answered".into()),
        Some(r) if r > ttl => notes.push(format!(
            "recovery {r:.1} s is over the lease TTL ({ttl:.0} s)"
        )),
        _ => {}
    }
    match leaked {
        None => notes.push("a surviving node's KV accounting could not be read".into()),
        Some(b) if b > 0 => notes.push(format!("{b} KV block(s) still held after the load")),
        _ => {}
    }
    if !left.is_empty() {
        notes.push(format!("left running: {}", left.join(", ")));
    }
    let target_met = failed == 0
        && garbled == 0
        && leaked == Some(0)
        && left.is_empty()
        && recovery_s.is_some_and(|r| r <= ttl);
    Row {
        drill: drill.name.to_string(),
        sent: outcomes.len(),
        ok,
        failed,
        garbled,
        cancelled,
        retried,
        router_recoveries: 0,
        longest_stall_s: stall.as_secs_f64(),
        recovery_s,
        leaked_blocks: leaked,
        processes_left: left.len(),
        target_met,
        notes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalogue::DrillKind;

    fn outcome(
        spec: usize,
        sent_s: f64,
        done_s: f64,
        result: Result<&str, &str>,
        cancelled: bool,
    ) -> Outcome {
        Outcome {
            spec,
            sent_at: Duration::from_secs_f64(sent_s),
            done_at: Duration::from_secs_f64(done_s),
            result: result.map(str::to_string).map_err(str::to_string),
            cancelled,
            longest_stall: Duration::from_millis(300),
            retries: 0,
            retry_reasons: Vec::new(),
        }
    }

    #[test]
    fn every_request_lands_in_one_column_and_garbled_answers_miss_the_target() {
        let drill = Drill::of(DrillKind::DecodeKill);
        let mut load = Workload::mixed(4, 1.0, 8);
        load.distinct.truncate(2);
        let reference = vec!["a b c".to_string(), "x y z".to_string()];
        let outs = vec![
            outcome(0, 0.0, 1.0, Ok("a b c"), false),
            outcome(1, 1.0, 2.5, Ok("x y"), true),
            outcome(0, 2.0, 3.0, Ok("a b d"), false),
            outcome(1, 3.0, 9.0, Err("HTTP 500"), false),
        ];
        let ttl = Duration::from_secs(10);
        let row = account(
            &drill,
            &load,
            &reference,
            &outs,
            Duration::from_secs(2),
            Some(0),
            vec![],
            ttl,
            vec![],
        );
        assert_eq!(
            (row.sent, row.ok, row.failed, row.cancelled, row.garbled),
            (4, 2, 1, 1, 1)
        );
        assert_eq!(
            row.recovery_s,
            Some(1.0),
            "the first answer of a request sent after the fault"
        );
        assert!(!row.target_met);
        assert!(
            row.notes.iter().any(|n| n.contains("HTTP 500")),
            "{:?}",
            row.notes
        );

        let clean = vec![
            outcome(0, 0.0, 1.0, Ok("a b c"), false),
            outcome(1, 3.0, 4.0, Ok("x y z"), false),
        ];
        load.total = 2;
        let row = account(
            &drill,
            &load,
            &reference,
            &clean,
            Duration::from_secs(2),
            Some(0),
            vec![],
            ttl,
            vec![],
        );
        assert!(row.target_met, "{row:?}");
        let leak = account(
            &drill,
            &load,
            &reference,
            &clean,
            Duration::from_secs(2),
            Some(3),
            vec![],
            ttl,
            vec![],
        );
        assert!(!leak.target_met && leak.notes.iter().any(|n| n.contains("3 KV block")));
        let late = account(
            &drill,
            &load,
            &reference,
            &clean,
            Duration::from_secs(2),
            Some(0),
            vec!["nats 42".into()],
            ttl,
            vec![],
        );
        assert!(!late.target_met && late.processes_left == 1);
    }
}

#[cfg(test)]
mod handle_tests {
    use std::net::{SocketAddr, TcpListener};

    use super::*;
    use crate::cluster::Signal;

    /// A cluster whose router is gone: every fault fails, nothing is left behind.
    struct Gone {
        addr: SocketAddr,
    }

    impl ClusterHandle for Gone {
        fn http_addr(&self) -> std::net::SocketAddr {
            self.addr
        }
        fn nodes(&self) -> Result<Vec<NodeEndpoint>, String> {
            Ok(vec![])
        }
        fn lease_ttl(&self) -> Duration {
            Duration::from_secs(10)
        }
        fn signal(&mut self, name: &str, _: Signal) -> Result<(), String> {
            Err(format!("no process {name}"))
        }
        fn restart(&mut self, name: &str) -> Result<(), String> {
            Err(format!("no process {name}"))
        }
        fn running(&mut self, _: &str) -> bool {
            false
        }
        fn partition(&mut self, name: &str, _: bool) -> Result<(), String> {
            Err(format!("no process {name}"))
        }
        fn fill_disk(&mut self, name: &str, _: bool) -> Result<u64, String> {
            Err(format!("no process {name}"))
        }
        fn stop_and_list_leftovers(&mut self) -> Vec<String> {
            vec![]
        }
    }

    #[test]
    fn a_cluster_it_cannot_reach_fails_with_the_address_it_tried() {
        // A port nobody listens on: bind, note it, close.
        let addr = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .unwrap();
        let mut gone = Gone { addr };
        let drill = crate::Drill::by_name("decode-kill").unwrap();
        let err = run_drill(&mut gone, &rt, &drill, &DrillOptions::default()).unwrap_err();
        assert!(matches!(err, DrillError::Unreachable { .. }), "{err:?}");
        assert!(
            err.to_string().contains(&format!("http://{addr}/health")),
            "{err}"
        );
    }
}
