//! Per-key usage and cost on real processes: two routers share one cluster and one etcd
//! ledger; requests of two keys go through both; each response's usage equals what the ledger
//! added for it, the totals add across routers and survive a router restart, node-seconds are
//! counted for both pools and priced at the configured node-hour, non-admin keys see only
//! their own usage, an unknown key id is a 404, and `tandem usage` / `tandem cost` print it.

use crate::common;
use crate::e2e;

use std::net::SocketAddr;
use std::process::Command;
use std::time::{Duration, Instant};

use e2e::harness::{Cluster, model};

fn free() -> SocketAddr {
    tandem_cli::ports::free_loopback_addr().unwrap()
}

fn call(addr: SocketAddr, method: &str, path: &str, key: &str, body: Option<&str>) -> (u16, serde_json::Value) {
    let auth = format!("Bearer {key}");
    let r = common::client::request(addr, method, path, &[("Authorization", &auth)], body, |_| {});
    let v = if r.body.contains('{') { r.json() } else { serde_json::Value::Null };
    (r.status, v)
}

fn router_args(c: &Cluster, http: SocketAddr, keys: &str, cost: &str) -> Vec<String> {
    [
        "router",
        "--cluster",
        &c.name,
        "--etcd-endpoints",
        &c.etcd.endpoint(),
        "--nats-url",
        &c.nats.url(),
        "--model",
        &model().display().to_string(),
        "--grpc-addr",
        &free().to_string(),
        "--http-addr",
        &http.to_string(),
        "--api-keys-file",
        keys,
        "--cost-file",
        cost,
        // Every request through both pools (the test checks each pool's node-seconds).
        "--disaggregation",
        "always",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

async fn wait_healthy(addr: SocketAddr) {
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(60) {
        if e2e::harness::http(addr, "GET", "/health", None).await.is_ok_and(|r| r.0 == 200) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("router on {addr} never healthy");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_per_key_adds_across_routers_survives_a_restart_and_is_priced() {
    let mut c = Cluster::start("e2e-usage").await;
    let keys = c.dir.join("keys.toml");
    std::fs::write(
        &keys,
        "[[key]]\nid = \"team-a\"\nkey = \"sk-a\"\n\n[[key]]\nid = \"team-b\"\nkey = \"sk-b\"\n\n[[key]]\nid = \"ops\"\nkey = \"sk-ops\"\nadmin = true\n",
    )
    .unwrap();
    let cost = c.dir.join("cost.toml");
    std::fs::write(
        &cost,
        "[prefill]\ndepreciation = 2.0\npower = 1.6\n\n[decode]\ndepreciation = 1.0\noperations = 0.8\n",
    )
    .unwrap();
    let (keys, cost) = (keys.display().to_string(), cost.display().to_string());
    c.node("decode", "d0", &[]);
    c.node("prefill", "p0", &[]);
    let (ra, rb) = (free(), free());
    let a = router_args(&c, ra, &keys, &cost);
    c.spawn("router-a", a.clone());
    c.spawn("router-b", router_args(&c, rb, &keys, &cost));
    wait_healthy(ra).await;
    wait_healthy(rb).await;

    // team-a through both routers, team-b through B; a shared prefix so some input is cached.
    let mut expect = std::collections::BTreeMap::<&str, [u64; 4]>::new();
    for (router, key, id, prompt) in [
        (ra, "sk-a", "team-a", "The history of the printing press begins in"),
        (ra, "sk-a", "team-a", "The history of the printing press begins in Mainz, where"),
        (rb, "sk-b", "team-b", "def quicksort(items):"),
        (rb, "sk-a", "team-a", "Ten facts about octopuses:"),
    ] {
        let body = format!(r#"{{"prompt": "{prompt}", "max_tokens": 6, "ignore_eos": true}}"#);
        let (status, v) = call(router, "POST", "/v1/completions", key, Some(&body));
        assert_eq!(status, 200, "{v}");
        let u = &v["usage"];
        let e = expect.entry(id).or_default();
        e[0] += 1;
        e[1] += u["prompt_tokens"].as_u64().unwrap();
        e[2] += u["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
        e[3] += u["completion_tokens"].as_u64().unwrap();
    }

    // The ledger (read through router A) equals the sum of the responses' usage.
    let check = |v: &serde_json::Value, id: &str| {
        let t = &v["keys"][id];
        let e = expect[id];
        [
            t["requests"].as_u64().unwrap_or(0),
            t["input_tokens"].as_u64().unwrap_or(0),
            t["cached_input_tokens"].as_u64().unwrap_or(0),
            t["output_tokens"].as_u64().unwrap_or(0),
        ] == e
    };
    let t0 = Instant::now();
    let v = loop {
        let (status, v) = call(ra, "GET", "/v1/usage", "sk-ops", None);
        assert_eq!(status, 200, "{v}");
        if check(&v, "team-a") && check(&v, "team-b") {
            break v;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "ledger {v} != responses {expect:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    for id in ["team-a", "team-b"] {
        let t = &v["keys"][id];
        assert!(t["prefill_node_seconds"].as_f64().unwrap() > 0.0, "{t}");
        assert!(t["decode_node_seconds"].as_f64().unwrap() > 0.0, "{t}");
        let c = &t["cost"];
        assert!(c["usd_total"].as_f64().unwrap() > 0.0, "{c}");
        assert!(c["usd_per_million_input"].as_f64().unwrap() > 0.0, "{c}");
        assert!(c["usd_per_million_output"].as_f64().unwrap() > 0.0, "{c}");
        // $/1M output = decode node-seconds × $1.80/h / output tokens × 1e6.
        let want = t["decode_node_seconds"].as_f64().unwrap() / 3600.0 * 1.8
            / t["output_tokens"].as_f64().unwrap()
            * 1e6;
        assert!((c["usd_per_million_output"].as_f64().unwrap() - want).abs() < 1e-9 * want.max(1.0));
    }

    // Access: a key reads its own usage, not others'; unknown ids are 404s.
    assert_eq!(call(ra, "GET", "/v1/usage", "sk-a", None).0, 403);
    assert_eq!(call(ra, "GET", "/v1/usage/team-b", "sk-a", None).0, 403);
    // Router B sees router A's additions once A has flushed them to etcd (the ledger is
    // eventually consistent across routers: A's own view above includes what it has not
    // written yet).
    let t0 = Instant::now();
    loop {
        let (status, own) = call(rb, "GET", "/v1/usage/team-a", "sk-a", None);
        assert_eq!(status, 200, "{own}");
        if own["requests"].as_u64() == Some(3) {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "router B's view of team-a: {own}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(call(ra, "GET", "/v1/usage/team-zzz", "sk-ops", None).0, 404);
    assert_eq!(call(ra, "GET", "/v1/usage", "sk-wrong", None).0, 401);

    // Router A's own per-key counters (its two team-a requests).
    let m = common::client::request(ra, "GET", "/metrics", &[], None, |_| {}).body;
    assert!(
        m.lines().any(|l| l == "tandem_router_key_requests_total{key=\"team-a\"} 2"),
        "{m}"
    );

    // Restart router A: the totals survive (the ledger is in etcd).
    let pa = c.proc("router-a");
    // SAFETY: kill(2) on our own child; SIGTERM is the router's graceful stop.
    unsafe { libc::kill(pa.child.id() as i32, libc::SIGTERM) };
    let _ = pa.child.wait();
    pa.name = "expect-exit-router-a".into();
    c.spawn("router-a2", a);
    wait_healthy(ra).await;
    let (_, after) = call(ra, "GET", "/v1/usage", "sk-ops", None);
    assert!(check(&after, "team-a") && check(&after, "team-b"), "{after}");

    // The CLI reads the same.
    let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["usage", "--router", &ra.to_string(), "--api-key", "sk-ops"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.lines().any(|l| l.starts_with("team-a") && l.contains(" 3 ")), "{text}");
    let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["cost", "--router", &ra.to_string(), "--api-key", "sk-ops"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("$/1M output") && text.contains("team-b") && text.contains("prefill"), "{text}");
    let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["usage", "--router", &ra.to_string(), "--api-key", "sk-ops", "team-nope"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("404"), "{}", String::from_utf8_lossy(&out.stderr));
}
