//! A node that cannot serve does not linger: when a decode node's engine thread panics (fault
//! injection, `--fault-engine-panic-after-steps`), the node deletes its etcd record and revokes
//! its lease at once (well before the lease would expire), exits non-zero, and the request it
//! was serving migrates to another decode node and completes. Real processes.

mod common;
mod e2e {
    pub mod harness;
}

use std::time::{Duration, Instant};

use e2e::harness::{Cluster, http};
use tandem_cluster::Role;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_node_whose_engine_panics_leaves_at_once_exits_non_zero_and_its_stream_migrates() {
    let mut c = Cluster::start("e2e-engine-panic").await;
    // A 30 s lease: leaving "at once" must not be the lease expiring. "d-bad" sorts first, so
    // the router's tie-break sends it the first request.
    c.node(
        "decode",
        "d-bad",
        &["--lease-ttl-secs", "30", "--fault-engine-panic-after-steps", "4"],
    );
    c.node("decode", "d-ok", &["--lease-ttl-secs", "30"]);
    c.node("prefill", "p0", &[]);
    // No canary: its probes would use up the faulty node's steps before the request does.
    c.router(&["--canary-interval-secs", "0"]);
    c.wait_ready(1, 2).await;
    c.proc("d-bad").name = "expect-exit-d-bad".into();

    let body = r#"{"prompt": "The history of the printing press begins", "max_tokens": 24, "ignore_eos": true}"#;
    let (status, reply) = http(c.http, "POST", "/v1/completions", Some(body)).await.unwrap();
    assert_eq!(status, 200, "the stream migrated to d-ok: {reply}\n{}", c.logs());
    assert!(reply.contains("\"completion_tokens\":24"), "{reply}");

    let t0 = Instant::now();
    let code = loop {
        if let Some(status) = c.proc("expect-exit-d-bad").child.try_wait().unwrap() {
            break status.code();
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "d-bad still running after its engine died\n{}",
            c.logs()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_ne!(code, Some(0), "exits non-zero");
    let log = c.proc("expect-exit-d-bad").log_text();
    assert!(log.contains("the node left the cluster"), "{log}");
    // Gone from membership at once (the lease had 30 s left).
    c.wait_for("d-bad to leave membership", Duration::from_secs(5), async |c| {
        c.registered(Role::Decode).await == ["d-ok"]
    })
    .await;
    assert!(t0.elapsed() < Duration::from_secs(25));
    let migrations = c
        .metric("tandem_router_recoveries_total{kind=\"migration\"}")
        .await
        .unwrap_or(0)
        + c.metric("tandem_router_recoveries_total{kind=\"retry\"}")
            .await
            .unwrap_or(0);
    assert!(migrations >= 1, "the request was moved off d-bad");
    // The survivor keeps serving.
    let (status, _) = http(c.http, "POST", "/v1/completions", Some(body)).await.unwrap();
    assert_eq!(status, 200);
}
