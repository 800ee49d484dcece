//! A node's life on real processes: it registers `warming`, runs its warm-up (a forward pass,
//! a KV self-check) and only then serves; `tandem drain` under load takes a node out with no
//! request lost or cut short, and the node exits 0 having left the cluster.

use crate::e2e;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

use e2e::harness::{Cluster, http};
use tandem_cluster::{Discovery, NodeState, Role};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_warms_up_before_it_serves_and_tandem_drain_under_load_loses_nothing() {
    let mut c = Cluster::start("e2e-lifecycle").await;
    let mut decode_view = c.discovery.watch(Role::Decode).await.unwrap();
    c.node("decode", "d0", &[]);
    c.node("decode", "d1", &[]);
    c.node("prefill", "p0", &[]);
    c.router(&[]);
    // Every state d0's record goes through, as etcd's watch delivers them.
    let mut seen = Vec::new();
    let t0 = std::time::Instant::now();
    while !seen.contains(&NodeState::Serving) && t0.elapsed() < Duration::from_secs(60) {
        if let Some(info) = decode_view.borrow_and_update().get("d0")
            && seen.last() != Some(&info.state) {
                seen.push(info.state);
            }
        let _ = tokio::time::timeout(Duration::from_millis(200), decode_view.changed()).await;
    }
    assert_eq!(seen.last(), Some(&NodeState::Serving), "{seen:?}");
    let log = c.proc("d0").log_text();
    let (registered, warm) = (
        log.find("registered in the cluster").expect("registered"),
        log.find("warm: KV self-check passed; serving")
            .expect("self-check ran"),
    );
    assert!(log.contains("warm: one real forward pass"), "{log}");
    assert!(
        registered < warm,
        "registered (warming) before the self-check let it serve"
    );
    c.wait_ready(1, 2).await;

    // Steady load: 4 clients, every request counted.
    let stop = Arc::new(AtomicBool::new(false));
    let (ok, failed) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
    let mut load = Vec::new();
    for k in 0..4 {
        let (addr, stop, ok, failed) = (c.http, stop.clone(), ok.clone(), failed.clone());
        load.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let body = format!(
                    r#"{{"prompt": "Client {k}: a short story about the sea", "max_tokens": 24, "ignore_eos": true}}"#
                );
                match http(addr, "POST", "/v1/completions", Some(&body)).await {
                    Ok((200, r)) if r.contains("\"completion_tokens\":24") => {
                        ok.fetch_add(1, Ordering::Relaxed);
                    }
                    other => {
                        eprintln!("request failed: {other:?}");
                        failed.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }));
    }
    c.wait_for(
        "traffic on both decode nodes",
        Duration::from_secs(30),
        async |c| {
            ok.load(Ordering::Relaxed) >= 8
                && c.metric("tandem_router_in_flight{role=\"decode\",node=\"d1\"}")
                    .await
                    .is_some()
        },
    )
    .await;

    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args([
            "drain",
            "d1",
            "--etcd-endpoints",
            &c.etcd.endpoint(),
            "--cluster",
            &c.name,
        ])
        .output()
        .await
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stdout}{stderr}\n{}", c.logs());
    assert!(stdout.contains("d1 drained and left"), "{stdout}");
    assert!(stderr.contains("asked decode node d1 to drain"), "{stderr}");
    // `tandem drain` polls the record every 200 ms and may miss the short `draining` state; the
    // node's own log says it drained (stopped taking work before finishing what it had).
    let d1 = c.proc("d1");
    assert!(
        d1.log_text()
            .contains("draining: no new work, finishing in-flight requests"),
        "{}",
        d1.log_text()
    );
    d1.name = "expect-exit-d1".into();
    let status = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            if let Some(s) = d1.child.try_wait().unwrap() {
                return s;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("d1 exits after draining");
    assert_eq!(status.code(), Some(0), "a drained node exits 0");
    assert_eq!(c.registered(Role::Decode).await, ["d0"]);

    // Keep the load a moment on the remaining node, then stop and count.
    let before = ok.load(Ordering::Relaxed);
    c.wait_for("more requests on d0", Duration::from_secs(30), async |_| {
        ok.load(Ordering::Relaxed) >= before + 4
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    for l in load {
        l.await.unwrap();
    }
    assert_eq!(
        failed.load(Ordering::Relaxed),
        0,
        "no request lost or cut short"
    );
    assert!(ok.load(Ordering::Relaxed) >= 12);
    let log = c.proc("expect-exit-d1").log_text();
    assert!(log.contains("drain requested"), "{log}");

    // Draining a node that does not exist is an error naming it.
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args([
            "drain",
            "d9",
            "--etcd-endpoints",
            &c.etcd.endpoint(),
            "--cluster",
            &c.name,
        ])
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no node `d9`"));
}
