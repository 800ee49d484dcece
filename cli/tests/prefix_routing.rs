//! Routing by cache on real processes: two prefill nodes publish their KV events over NATS,
//! the router indexes them, and requests sharing a long prefix all reuse one node's cache
//! (`usage.prompt_tokens_details.cached_tokens`), where round-robin would compute it twice.

use crate::e2e;

use std::time::Duration;

use e2e::harness::{Cluster, http};

async fn cached_tokens(c: &Cluster, prompt: &str) -> (u64, u64) {
    let body = serde_json::json!({"prompt": prompt, "max_tokens": 1}).to_string();
    let (status, reply) = http(c.http, "POST", "/v1/completions", Some(&body))
        .await
        .unwrap();
    assert_eq!(status, 200, "{reply}\n{}", c.logs());
    let v: serde_json::Value = serde_json::from_str(&reply).unwrap();
    (
        v["usage"]["prompt_tokens"].as_u64().unwrap(),
        v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_sharing_a_prefix_reuse_one_prefill_nodes_cache() {
    let mut c = Cluster::start("e2e-prefix").await;
    c.node("decode", "d0", &[]);
    c.node("prefill", "p0", &[]);
    c.node("prefill", "p1", &[]);
    c.router(&["--canary-interval-secs", "0"]);
    c.wait_ready(2, 1).await;
    // Both prefill nodes' caches known to the router (their first snapshot arrived).
    c.wait_for(
        "the router to index both prefill nodes",
        Duration::from_secs(30),
        async |c| c.metric("tandem_router_prefix_index_nodes ").await == Some(2),
    )
    .await;
    // Two system prompts, first asked at once: the second goes to the other node (the first
    // node has the first prompt pending), so each node caches one prefix.
    let systems = [
        "You are a careful assistant for a logistics company. ".repeat(12),
        "You answer questions about a city library's opening hours and loans. ".repeat(10),
    ];
    let ask = |s: usize, q: &str| format!("{}{q}", systems[s]);
    let (first, second) = (ask(0, "Where is parcel 17?"), ask(1, "Can I renew a loan?"));
    let (a, b) = tokio::join!(cached_tokens(&c, &first), cached_tokens(&c, &second));
    assert_eq!((a.1, b.1), (0, 0), "nothing cached yet");
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Later questions go where their prefix is: each reuses it. (Least-loaded would send
    // both to p0, idle ties going to the lower id; round-robin would alternate blindly.)
    let mut reused = Vec::new();
    for (s, q) in [
        (1, "When do you open on Sunday?"),
        (0, "When does the depot open?"),
        (1, "How many books may I borrow?"),
        (0, "Who signs for returns?"),
    ] {
        let (prompt, cached) = cached_tokens(&c, &ask(s, q)).await;
        reused.push((s, prompt, cached));
        // KV events reach the router within a batch window.
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    for (_, prompt, cached) in &reused {
        assert!(
            *cached * 10 >= *prompt * 7,
            "every later request reuses its prefix (at least 70% of its prompt): {reused:?}\n{}",
            c.logs()
        );
    }
    let batches = c
        .metric("tandem_router_kv_event_batches_total ")
        .await
        .unwrap_or(0);
    assert!(batches >= 2, "KV events arrived ({batches} batches)");
    assert_eq!(
        c.metric("tandem_router_kv_event_gaps_total ").await,
        Some(0)
    );
}
