//! Routing and admission against fake nodes: the bounded queue, membership changes taking
//! effect without restart, draining, load-report routing and the in-flight fallback.

use crate::common;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::fakes::{expected_output, start_decode, start_prefill};
use common::{
    MemoryCluster, collect, generate, grpc_request, http, init_tracing, options, prompt_tokens,
};
use tandem_cluster::{LoadSignals, Role};

#[tokio::test]
async fn a_full_queue_answers_429_and_resource_exhausted_at_once_then_recovers() {
    init_tracing();
    let mut cluster = MemoryCluster::new();
    let p = start_prefill("p0").await;
    let d = start_decode("d0").await;
    cluster.register(p.info()).await;
    cluster.register(d.info()).await;
    let mut opts = options();
    opts.admission.max_in_flight = 1;
    opts.admission.max_queued = 0;
    let router = cluster.router(opts).await;

    // One request holds the only slot: the decode node stops after its first batch.
    d.behaviour.hold_after_batches.store(1, Ordering::SeqCst);
    let mut client = router.grpc().await;
    let held = client
        .generate(grpc_request("hold me", 4))
        .await
        .expect("admitted")
        .into_inner();

    let refused = http(
        router.http_addr,
        "POST",
        "/v1/completions",
        Some(r#"{"prompt": "me too", "max_tokens": 2}"#),
        None,
    )
    .await;
    assert_eq!(refused.status, 429, "{}", refused.body);
    assert_eq!(refused.json()["error"]["type"], "rate_limit_error");
    assert!(refused.header("retry-after").is_some());
    let status = client
        .generate(grpc_request("me too", 2))
        .await
        .unwrap_err();
    assert_eq!(
        status.code(),
        tonic::Code::ResourceExhausted,
        "{}",
        status.message()
    );
    assert_eq!(router.router.stats().overloaded, 2);

    d.behaviour.hold_after_batches.store(-1, Ordering::SeqCst);
    d.behaviour.resume.notify_one();
    let out = collect(held).await.expect("the held request finishes");
    assert_eq!(out.ids, expected_output(prompt_tokens("hold me"), 4).0);
    let again = generate(&router, "me too", 2)
        .await
        .expect("the slot is free again");
    assert!(again.last.is_some());
}

#[tokio::test]
async fn a_decode_node_joining_after_start_gets_the_next_request() {
    init_tracing();
    let mut cluster = MemoryCluster::new();
    let p = start_prefill("p0").await;
    let d0 = start_decode("d0").await;
    cluster.register(p.info()).await;
    cluster.register(d0.info()).await;
    let router = cluster.router(options()).await;
    // d0 keeps one request in flight, so the least-loaded choice is any node that joins.
    d0.behaviour.hold_after_batches.store(1, Ordering::SeqCst);
    let mut client = router.grpc().await;
    let _held = client
        .generate(grpc_request("busy", 4))
        .await
        .unwrap()
        .into_inner();

    let d1 = start_decode("d1").await;
    cluster.register(d1.info()).await;
    let out = generate(&router, "new node please", 3)
        .await
        .expect("served");
    assert_eq!(
        d1.behaviour.decode_calls.load(Ordering::SeqCst),
        1,
        "the new node got the request"
    );
    assert_eq!(
        out.ids,
        expected_output(prompt_tokens("new node please"), 3).0
    );
}

#[tokio::test]
async fn removed_and_draining_nodes_get_no_new_traffic() {
    init_tracing();
    let mut cluster = MemoryCluster::new();
    let p = start_prefill("p0").await;
    let d0 = start_decode("d0").await;
    let d1 = start_decode("d1").await;
    cluster.register(p.info()).await;
    cluster.register(d0.info()).await;
    cluster.register(d1.info()).await;
    let router = cluster.router(options()).await;

    // d0 drains: everything goes to d1 although d0 sorts first.
    cluster.registrations["d0"]
        .set_draining(true)
        .await
        .unwrap();
    for _ in 0..3 {
        generate(&router, "hello", 2).await.expect("served by d1");
    }
    assert_eq!(d0.behaviour.reserve_calls.load(Ordering::SeqCst), 0);
    assert_eq!(d1.behaviour.reserve_calls.load(Ordering::SeqCst), 3);

    // d0 is back, d1 leaves: everything goes to d0, even while d0 is busy.
    cluster.registrations["d0"]
        .set_draining(false)
        .await
        .unwrap();
    cluster.deregister("d1").await;
    d0.behaviour.hold_after_batches.store(1, Ordering::SeqCst);
    let mut client = router.grpc().await;
    let _held = client
        .generate(grpc_request("busy", 4))
        .await
        .unwrap()
        .into_inner();
    d0.behaviour.hold_after_batches.store(-1, Ordering::SeqCst);
    for _ in 0..3 {
        generate(&router, "hello", 2).await.expect("served by d0");
    }
    assert_eq!(
        d1.behaviour.reserve_calls.load(Ordering::SeqCst),
        3,
        "no traffic after leaving"
    );
    assert_eq!(d0.behaviour.reserve_calls.load(Ordering::SeqCst), 4);

    // Nothing accepting work: 503 / UNAVAILABLE, naming the role.
    cluster.registrations["d0"]
        .set_draining(true)
        .await
        .unwrap();
    let response = http(
        router.http_addr,
        "POST",
        "/v1/completions",
        Some(r#"{"prompt": "anyone?"}"#),
        None,
    )
    .await;
    assert_eq!(response.status, 503, "{}", response.body);
    assert!(
        response.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("decode")
    );
    let status = generate(&router, "anyone?", 2).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unavailable);
}

#[tokio::test]
async fn stale_load_reports_switch_routing_to_in_flight_counts_and_back() {
    init_tracing();
    let mut cluster = MemoryCluster::new();
    let p = start_prefill("p0").await;
    let d0 = start_decode("d0").await;
    let d1 = start_decode("d1").await;
    for info in [p.info(), d0.info(), d1.info()] {
        cluster.register(info).await;
    }
    let loads = cluster.loads.clone();
    let fresh = Duration::ZERO;
    let stale = Duration::from_secs(3600);
    loads.set(Role::Prefill, "p0", fresh, |_| {});
    loads.set(Role::Decode, "d0", fresh, |r| {
        r.running = 5;
        r.free_blocks = 100;
    });
    loads.set(Role::Decode, "d1", fresh, |r| r.free_blocks = 900);
    let router = cluster.router(options()).await;
    let calls = |n: &common::fakes::FakeNode<common::fakes::DecodeBehaviour>| {
        n.behaviour.reserve_calls.load(Ordering::SeqCst)
    };

    // Fresh reports: d1 runs nothing, so it wins although d0 sorts first.
    generate(&router, "by load", 2).await.unwrap();
    assert_eq!((calls(&d0), calls(&d1)), (0, 1));
    let stats = router.router.stats();
    assert_eq!(
        (stats.decode.load_picks, stats.decode.fallback_picks),
        (1, 0)
    );
    assert_eq!(stats.decode.fallback_entered, 0);

    // d1's report goes stale: the router uses its own counts (all idle: lowest id), says so once.
    loads.set(Role::Decode, "d1", stale, |r| r.free_blocks = 900);
    generate(&router, "fallback", 2).await.unwrap();
    generate(&router, "fallback", 2).await.unwrap();
    assert_eq!((calls(&d0), calls(&d1)), (2, 1));
    let stats = router.router.stats();
    assert_eq!(
        stats.decode.fallback_entered, 1,
        "entering the fallback is counted once"
    );
    assert_eq!(stats.decode.fallback_picks, 2);
    assert_eq!(
        stats.prefill.fallback_entered, 0,
        "prefill reports are still fresh"
    );
    // The same counts are exported on /metrics.
    let metrics = common::http(router.http_addr, "GET", "/metrics", None, None).await;
    assert_eq!(metrics.status, 200);
    for line in [
        "tandem_router_load_fallback_entered_total{role=\"decode\"} 1",
        "tandem_router_load_fallback_entered_total{role=\"prefill\"} 0",
        "tandem_router_routing_picks_total{role=\"decode\",source=\"fallback\"} 2",
        "tandem_router_nodes{role=\"decode\"} 2",
    ] {
        assert!(
            metrics.body.lines().any(|l| l == line),
            "missing {line:?} in:\n{}",
            metrics.body
        );
    }

    // Reports resume: routing by load again.
    loads.set(Role::Decode, "d1", fresh, |r| r.free_blocks = 900);
    generate(&router, "by load again", 2).await.unwrap();
    assert_eq!(calls(&d1), 2);
    let stats = router.router.stats();
    assert_eq!(
        (stats.decode.load_picks, stats.decode.fallback_entered),
        (2, 1)
    );
}

#[tokio::test]
async fn a_burst_between_two_reports_spreads_over_the_nodes() {
    init_tracing();
    let mut cluster = MemoryCluster::new();
    let p = start_prefill("p0").await;
    let d0 = start_decode("d0").await;
    let d1 = start_decode("d1").await;
    for info in [p.info(), d0.info(), d1.info()] {
        cluster.register(info).await;
    }
    cluster
        .loads
        .set(Role::Prefill, "p0", Duration::ZERO, |_| {});
    for id in ["d0", "d1"] {
        cluster.loads.set(Role::Decode, id, Duration::ZERO, |_| {});
    }
    let router = cluster.router(options()).await;
    for d in [&d0, &d1] {
        d.behaviour.hold_after_batches.store(1, Ordering::SeqCst);
    }
    // Both reports say "idle"; without counting its own dispatches the router would send both
    // requests to d0.
    let mut client = router.grpc().await;
    let _a = client
        .generate(grpc_request("first", 4))
        .await
        .unwrap()
        .into_inner();
    let _b = client
        .generate(grpc_request("second", 4))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(d0.behaviour.reserve_calls.load(Ordering::SeqCst), 1);
    assert_eq!(d1.behaviour.reserve_calls.load(Ordering::SeqCst), 1);
    assert_eq!(router.router.stats().decode.load_picks, 2);
    assert_eq!(
        router.router.in_flight_by_node(Role::Decode),
        vec![("d0".to_string(), 1), ("d1".to_string(), 1)]
    );
}

/// A gRPC request of `ids` (token ids, so the test knows the router's exact prompt).
fn token_request(ids: &[u32], max_tokens: u32) -> tandem_proto::v1::GenerateRequest {
    let mut request = grpc_request("unused", max_tokens);
    request.input = Some(tandem_proto::v1::generate_request::Input::TokenIds(
        tandem_proto::v1::TokenIds { ids: ids.to_vec() },
    ));
    request
}

#[tokio::test]
async fn prefix_aware_routing_sends_a_prompt_where_its_prefix_is_cached_until_a_gap() {
    init_tracing();
    let mut cluster = MemoryCluster::new();
    let p0 = start_prefill("p0").await;
    let p1 = start_prefill("p1").await;
    let d = start_decode("d0").await;
    for info in [p0.info(), p1.info(), d.info()] {
        cluster.register(info).await;
    }
    for id in ["p0", "p1"] {
        cluster.loads.set(Role::Prefill, id, Duration::ZERO, |_| {});
    }
    cluster
        .loads
        .set(Role::Decode, "d0", Duration::ZERO, |_| {});
    let router = cluster.router(options()).await;
    let block = p1.info().layout.block_size_tokens as usize;
    let prompt: Vec<u32> = (0..(4 * block + 3) as u32).map(|i| 100 + i).collect();
    // p1 caches the prompt's first three blocks (a snapshot, as the node sends every 5 s).
    let hashes = tandem_kv_layout::prefix::prompt_block_hashes(&prompt, block);
    for b in tandem_cluster::KvEventBatch::snapshot("p1", block as u32, 0, &hashes[..3]) {
        cluster.loads.kv.publish_kv_events(&b).await.unwrap();
    }
    let index = router.router.prefix_index().unwrap().clone();
    let deadline = Instant::now() + Duration::from_secs(10);
    while index.counts().synced_nodes < 1 {
        assert!(
            Instant::now() < deadline,
            "the snapshot never reached the index"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut client = router.grpc().await;
    for _ in 0..3 {
        let out = collect(
            client
                .generate(token_request(&prompt, 2))
                .await
                .unwrap()
                .into_inner(),
        )
        .await;
        assert!(out.expect("completed").last.is_some(), "a final message");
    }
    assert_eq!(
        p1.behaviour.prefill_calls.load(Ordering::SeqCst),
        3,
        "every request went to the cache"
    );
    assert_eq!(p0.behaviour.prefill_calls.load(Ordering::SeqCst), 0);
    // A prompt that shares nothing goes by load: both idle, ties to the lower id.
    let other: Vec<u32> = prompt.iter().map(|t| t + 5000).collect();
    collect(
        client
            .generate(token_request(&other, 2))
            .await
            .unwrap()
            .into_inner(),
    )
    .await
    .expect("completed");
    assert_eq!(p0.behaviour.prefill_calls.load(Ordering::SeqCst), 1);
    // A lost batch (seq 1 never arrives): p1's set is no longer trusted.
    let late = tandem_cluster::KvEventBatch {
        node_id: "p1".into(),
        seq: 2,
        block_size_tokens: block as u32,
        body: tandem_cluster::KvEventBody::Delta {
            stored: vec![hashes[3]],
            removed: vec![],
        },
    };
    cluster.loads.kv.publish_kv_events(&late).await.unwrap();
    while index.counts().gaps < 1 {
        assert!(Instant::now() < deadline, "the gap was never seen");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    collect(
        client
            .generate(token_request(&prompt, 2))
            .await
            .unwrap()
            .into_inner(),
    )
    .await
    .expect("completed");
    assert_eq!(
        p0.behaviour.prefill_calls.load(Ordering::SeqCst),
        2,
        "after a gap the prompt counts as uncached everywhere"
    );
    let metrics = router.router.metrics().render();
    assert!(
        metrics.contains("tandem_router_kv_event_gaps_total 1"),
        "{metrics}"
    );
}

#[tokio::test]
async fn conditional_disaggregation_places_short_prompts_busy_and_absent_prefill_pools_on_the_decode_node()
{
    init_tracing();
    let mut cluster = MemoryCluster::new();
    let p = start_prefill("p0").await;
    let d = start_decode("d0").await;
    cluster.register(p.info()).await;
    cluster.register(d.info()).await;
    let loads = cluster.loads.clone();
    loads.set(Role::Prefill, "p0", Duration::ZERO, |_| {});
    loads.set(Role::Decode, "d0", Duration::ZERO, |_| {});
    let mut opts = options();
    opts.placement = tandem_router::routing::PlacementSettings {
        max_local_tokens: 8,
        busy_max_local_tokens: 64,
        ..Default::default()
    };
    let router = cluster.router(opts).await;
    let prefills = || {
        (
            p.behaviour.prefill_calls.load(Ordering::SeqCst),
            d.behaviour.prefill_here_calls.load(Ordering::SeqCst),
        )
    };
    let long = "a prompt of more than eight tokens, sent through the prefill node";
    let medium = "twenty or so tokens: short of the busy cap, over the short threshold";
    assert!(prompt_tokens("hi") <= 8 && prompt_tokens(long) > 8 && prompt_tokens(medium) <= 64);

    // Short: the decode node computes it, the prefill node sees nothing; same output.
    let out = generate(&router, "hi", 3).await.expect("served");
    assert_eq!(out.ids, expected_output(prompt_tokens("hi"), 3).0);
    assert_eq!(prefills(), (0, 1));
    // Longer, idle prefill node: through it.
    generate(&router, long, 3).await.expect("served");
    assert_eq!(prefills(), (1, 1));
    // The prefill node reports a queue far longer than the decode node's: the medium prompt
    // stays on the decode node.
    loads.set(Role::Prefill, "p0", Duration::ZERO, |r| r.pending_prompt_tokens = 10_000);
    generate(&router, medium, 3).await.expect("served");
    assert_eq!(prefills(), (1, 2));
    // A stale report is no evidence of a busy pool.
    loads.set(Role::Prefill, "p0", Duration::from_secs(3600), |r| {
        r.pending_prompt_tokens = 10_000
    });
    generate(&router, medium, 3).await.expect("served");
    assert_eq!(prefills(), (2, 2));

    // The prefill pool goes away: what the decode node may compute is still served there;
    // a prompt over the busy cap is refused as before (no prefill node).
    cluster.deregister("p0").await;
    let out = generate(&router, medium, 3).await.expect("served without a prefill node");
    assert_eq!(out.ids, expected_output(prompt_tokens(medium), 3).0);
    assert_eq!(prefills(), (2, 3));
    let too_long = "word ".repeat(80);
    assert!(prompt_tokens(&too_long) > 64);
    let refused = http(
        router.http_addr,
        "POST",
        "/v1/completions",
        Some(&format!(r#"{{"prompt": "{too_long}", "max_tokens": 3}}"#)),
        None,
    )
    .await;
    assert_eq!(refused.status, 503, "{}", refused.body);
    assert!(refused.body.contains("prefill"), "{}", refused.body);

    let metrics = http(router.http_addr, "GET", "/metrics", None, None).await.body;
    for (series, n) in [
        ("site=\"decode_node\",reason=\"short_prompt\"", 1),
        ("site=\"decode_node\",reason=\"prefill_busy\"", 1),
        ("site=\"decode_node\",reason=\"prefill_unavailable\"", 1),
        ("site=\"prefill_node\",reason=\"long_prompt\"", 2),
    ] {
        let line = format!("tandem_router_prefill_placements_total{{{series}}} {n}");
        assert!(metrics.contains(&line), "{line} in\n{metrics}");
    }
}


/// A decode node computing a prompt it took is busy, not hung: while it reports progress the
/// router waits past its stall clock (no retry, no cancelled stream); silent for as long, it is
/// called stalled and its stream is dropped.
#[tokio::test]
async fn a_decode_node_reporting_progress_on_a_prompt_it_computes_is_not_called_stalled() {
    init_tracing();
    let mut cluster = MemoryCluster::new();
    let d = start_decode("d0").await;
    cluster.register(d.info()).await;
    cluster.loads.set(Role::Decode, "d0", Duration::ZERO, |_| {});
    let mut opts = options();
    opts.stream_idle_timeout = Duration::from_millis(300);
    opts.max_attempts = 1;
    opts.placement = tandem_router::routing::PlacementSettings {
        max_local_tokens: 8,
        ..Default::default()
    };
    let router = cluster.router(opts).await;
    let b = &d.behaviour;
    // The prompt takes 1.2 s, four idle timeouts, on the decode node.
    b.compute_prompt_ms.store(1200, Ordering::SeqCst);
    b.progress_every_ms.store(100, Ordering::SeqCst);
    let out = generate(&router, "hi", 3).await.expect("served, progress kept it alive");
    assert_eq!(out.ids, expected_output(prompt_tokens("hi"), 3).0);
    assert_eq!(b.prefill_here_calls.load(Ordering::SeqCst), 1);
    assert_eq!(b.decode_calls.load(Ordering::SeqCst), 1, "no retry");
    assert_eq!(b.cancelled_streams.load(Ordering::SeqCst), 0);

    // The same node silent for as long: stalled after 300 ms, the stream dropped.
    b.progress_every_ms.store(0, Ordering::SeqCst);
    // (A stall is the only way this fails: the prompt would be done after 1.2 s.)
    let err = generate(&router, "hi", 3).await.expect_err("a silent node is stalled");
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
    assert!(err.message().contains("stalled"), "{err:?}");
    // The fake notices the dropped stream when its prompt is done.
    tokio::time::timeout(Duration::from_secs(5), async {
        while b.cancelled_streams.load(Ordering::SeqCst) == 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the stalled stream was dropped");
}
