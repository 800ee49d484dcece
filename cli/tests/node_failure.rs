//! A node that cannot serve does not linger: when a decode node's engine thread panics (fault
//! injection, `--fault-engine-panic-after-steps`), the node deletes its etcd record and revokes
//! its lease at once (well before the lease would expire), exits non-zero, and the request it
//! was serving migrates to another decode node and completes. And the canary takes a frozen
//! (SIGSTOPped) decode node out of routing until it answers again. Real processes.

use crate::e2e;

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_canary_takes_a_frozen_decode_node_out_of_routing_and_back_when_it_recovers() {
    let mut c = Cluster::start("e2e-canary").await;
    c.node("decode", "d0", &[]);
    c.node("decode", "d1", &["--lease-ttl-secs", "60"]);
    c.node("prefill", "p0", &[]);
    c.router(&["--canary-interval-secs", "1", "--canary-timeout-ms", "1500"]);
    c.wait_ready(1, 2).await;
    let pair = |v: &serde_json::Value, d: &str| -> Option<bool> {
        v["canary"]["pair_results"]
            .as_array()?
            .iter()
            .find(|p| p["decode"] == d)
            .and_then(|p| p["passing"].as_bool())
    };
    let health = async |c: &Cluster| -> (u16, serde_json::Value) {
        let (s, body) = http(c.http, "GET", "/health?verbose=true", None).await.unwrap();
        (s, serde_json::from_str(&body).unwrap_or_default())
    };
    c.wait_for("both pairs to pass", Duration::from_secs(20), async |c| {
        let (_, v) = health(c).await;
        pair(&v, "d0") == Some(true) && pair(&v, "d1") == Some(true)
    })
    .await;

    let d1 = c.proc("d1").child.id() as i32;
    // SAFETY: kill(2) on a child of this test.
    unsafe { libc::kill(d1, libc::SIGSTOP) };
    c.wait_for("the canary to fail d1's pair", Duration::from_secs(30), async |c| {
        pair(&health(c).await.1, "d1") == Some(false)
    })
    .await;
    let (status, v) = health(&c).await;
    assert_eq!(status, 200, "d0's pair still passes: {v}");
    // d1 is out of routing: every request goes to d0 and succeeds at once.
    for _ in 0..4 {
        let t0 = Instant::now();
        let body = r#"{"prompt": "Hello there", "max_tokens": 4}"#;
        let (s, reply) = http(c.http, "POST", "/v1/completions", Some(body)).await.unwrap();
        assert_eq!(s, 200, "{reply}");
        assert!(t0.elapsed() < Duration::from_secs(5), "not routed to the frozen node");
    }
    // SAFETY: as above.
    unsafe { libc::kill(d1, libc::SIGCONT) };
    c.wait_for("d1's pair to pass again", Duration::from_secs(30), async |c| {
        pair(&health(c).await.1, "d1") == Some(true)
    })
    .await;
}

/// The in-process engine's greedy answer (what every path through the cluster must equal).
fn engine_text(prompt: &str, max_tokens: usize) -> String {
    use tandem_engine::{
        Engine, EngineConfig, Model, ModelSource, Priority, Request, SamplingParams, WeightDtype, loader,
    };
    let loaded = loader::load(&ModelSource::Path(e2e::harness::model()), WeightDtype::F32).unwrap();
    let mut e = Engine::new(Model::new(loaded.weights), loaded.tokenizer, EngineConfig::default()).unwrap();
    let prompt = e.tokenizer().unwrap().encode(prompt);
    let req = Request {
        id: 1,
        prompt,
        params: SamplingParams { ignore_eos: true, ..SamplingParams::greedy(max_tokens) },
        priority: Priority::Interactive,
    };
    e.generate(vec![req], |_| {}).unwrap().remove(0).text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupted_kv_block_is_refused_at_the_decode_node_and_the_request_is_re_prefilled() {
    let mut c = Cluster::start("e2e-kv-corrupt").await;
    c.node("decode", "d0", &[]);
    // Every push from p-bad has one payload byte flipped after it was checksummed (the
    // fault-injection build's `--kv-fault`). "p-bad" sorts first: the router's tie-break sends
    // it the first request.
    c.node("prefill", "p-bad", &["--kv-fault", "corrupt:100"]);
    c.node("prefill", "p-ok", &[]);
    // Short prompts would be computed by the decode node, with no KV to corrupt.
    c.router(&["--canary-interval-secs", "0", "--disaggregation", "always"]);
    c.wait_ready(2, 1).await;

    let prompt = "The history of the printing press begins";
    let want = engine_text(prompt, 16);
    let body = serde_json::json!({"prompt": prompt, "max_tokens": 16, "ignore_eos": true}).to_string();
    for i in 0..3 {
        let (status, reply) = http(c.http, "POST", "/v1/completions", Some(&body)).await.unwrap();
        assert_eq!(status, 200, "request {i}: {reply}\n{}", c.logs());
        let a = reply.find('{').unwrap();
        let v: serde_json::Value = serde_json::from_str(&reply[a..=reply.rfind('}').unwrap()]).unwrap();
        assert_eq!(v["choices"][0]["text"], want.as_str(), "request {i}: the clean KV's answer");
    }
    // The decode node refused the corrupted transfer (its own counter), the router re-prefilled
    // (its own counter), and nothing is held anywhere afterwards.
    let mismatches = c
        .node_metric(Role::Decode, "d0", "tandem_kv_transfer_checksum_mismatches_total")
        .await
        .expect("the decode node's checksum-mismatch counter");
    assert!(mismatches >= 1.0, "the corrupted block was refused at the decode node");
    let reprefills = c.metric("tandem_router_recoveries_total{kind=\"reprefill\"}").await.unwrap_or(0);
    assert!(reprefills >= 1, "the router re-prefilled after the refusal\n{}", c.logs());
    let generated = c
        .node_metric(Role::Decode, "d0", "tandem_node_generated_tokens_total")
        .await
        .unwrap();
    assert!(generated >= 3.0 * 15.0, "three answers decoded on d0 ({generated} tokens)");
    c.wait_all_blocks_free(&["d0", "p-bad", "p-ok"]).await;
}
