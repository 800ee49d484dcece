//! Failures in the pipeline against fake nodes: client disconnects cancel the node streams and
//! release the reservation; retry-safe failures before any output are retried on another pair
//! (a corrupt transfer is re-prefilled) and the client still gets the full answer; retries are
//! bounded and end in a clear error.

use crate::common;

use std::sync::atomic::Ordering;

use common::fakes::{expected_output, start_decode, start_prefill};
use common::{
    MemoryCluster, WAIT, generate, grpc_request, http, http_request_bytes, init_tracing, options,
    prompt_tokens, wait_until,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[tokio::test]
async fn a_client_leaving_before_the_first_token_cancels_prefill_and_releases_the_reservation() {
    init_tracing();
    let mut cluster = MemoryCluster::new();
    let p = start_prefill("p0").await;
    let d = start_decode("d0").await;
    cluster.register(p.info()).await;
    cluster.register(d.info()).await;
    let router = cluster.router(options()).await;
    p.behaviour.hold_before_first.store(1, Ordering::SeqCst);

    let mut client = router.grpc().await;
    let call = tokio::spawn(async move { client.generate(grpc_request("never mind", 4)).await });
    wait_until("prefill started", &p.behaviour.holding, || {
        p.behaviour.held.load(Ordering::SeqCst) == 1
    })
    .await;
    call.abort(); // the gRPC call is cancelled (HTTP/2 RST_STREAM)

    wait_until("prefill stream cancelled", &p.behaviour.changed, || {
        p.behaviour.cancelled_streams.load(Ordering::SeqCst) == 1
    })
    .await;
    wait_until("reservation released", &d.behaviour.changed, || {
        *d.behaviour.released.lock().unwrap() == [1]
    })
    .await;
    assert_eq!(
        d.behaviour.decode_calls.load(Ordering::SeqCst),
        0,
        "Decode never ran"
    );
    assert_eq!(
        router.router.admission().in_flight(),
        0,
        "the permit was returned"
    );
}

#[tokio::test]
async fn a_client_leaving_mid_stream_cancels_the_decode_stream() {
    init_tracing();
    let mut cluster = MemoryCluster::new();
    let p = start_prefill("p0").await;
    let d = start_decode("d0").await;
    cluster.register(p.info()).await;
    cluster.register(d.info()).await;
    let router = cluster.router(options()).await;
    d.behaviour.hold_after_batches.store(2, Ordering::SeqCst);

    // An SSE client reads the first tokens, then disconnects.
    let mut socket = tokio::net::TcpStream::connect(router.http_addr)
        .await
        .unwrap();
    let body = r#"{"prompt": "tell me a long story", "max_tokens": 20, "stream": true}"#;
    socket
        .write_all(&http_request_bytes(
            "POST",
            "/v1/completions",
            Some(body),
            None,
        ))
        .await
        .unwrap();
    let mut seen = String::new();
    let mut buf = [0u8; 4096];
    while seen.matches("\"text\":\"t").count() < 2 {
        let n = tokio::time::timeout(WAIT, socket.read(&mut buf))
            .await
            .expect("tokens arrive")
            .unwrap();
        assert!(n > 0, "closed early: {seen}");
        seen.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    wait_until("decode holding", &d.behaviour.holding, || {
        d.behaviour.held.load(Ordering::SeqCst) == 1
    })
    .await;
    drop(socket);

    wait_until("decode stream cancelled", &d.behaviour.changed, || {
        d.behaviour.cancelled_streams.load(Ordering::SeqCst) == 1
    })
    .await;
    assert_eq!(d.behaviour.completed_streams.load(Ordering::SeqCst), 0);
    // Release after a claimed reservation is harmless (idempotent, epoch-checked) and sent on
    // every path but a completed Decode.
    wait_until("reservation released", &d.behaviour.changed, || {
        *d.behaviour.released.lock().unwrap() == [1]
    })
    .await;
}

#[tokio::test]
async fn a_corrupt_transfer_is_re_prefilled_and_the_client_gets_the_full_answer() {
    init_tracing();
    let mut cluster = MemoryCluster::new();
    let p = start_prefill("p0").await;
    let d = start_decode("d0").await;
    cluster.register(p.info()).await;
    cluster.register(d.info()).await;
    let router = cluster.router(options()).await;
    d.behaviour.data_loss.store(1, Ordering::SeqCst);

    let out = generate(&router, "checksum please", 6)
        .await
        .expect("full answer");
    let (ids, text) = expected_output(prompt_tokens("checksum please"), 6);
    assert_eq!((out.ids, out.text), (ids, text));
    let last = out.last.expect("final message");
    assert_eq!(last.usage.unwrap().completion_tokens, 6);
    assert_eq!(
        p.behaviour.prefill_calls.load(Ordering::SeqCst),
        2,
        "prefilled twice"
    );
    assert_eq!(
        d.behaviour.reserve_calls.load(Ordering::SeqCst),
        2,
        "fresh reservation"
    );
    let stats = router.router.stats();
    assert_eq!(
        (stats.reprefills, stats.retries, stats.completed),
        (1, 1, 1)
    );
    wait_until(
        "the corrupt attempt's reservation released",
        &d.behaviour.changed,
        || *d.behaviour.released.lock().unwrap() == [1],
    )
    .await;
}

#[tokio::test]
async fn a_prefill_failure_before_any_token_retries_on_another_prefill_node() {
    init_tracing();
    let mut cluster = MemoryCluster::new();
    let p0 = start_prefill("p0").await;
    let p1 = start_prefill("p1").await;
    let d = start_decode("d0").await;
    for info in [p0.info(), p1.info(), d.info()] {
        cluster.register(info).await;
    }
    let router = cluster.router(options()).await;
    p0.behaviour.fail_before_first.store(1, Ordering::SeqCst);

    let out = generate(&router, "try again", 3)
        .await
        .expect("served by p1");
    assert_eq!(out.ids, expected_output(prompt_tokens("try again"), 3).0);
    assert_eq!(p0.behaviour.prefill_calls.load(Ordering::SeqCst), 1);
    assert_eq!(p1.behaviour.prefill_calls.load(Ordering::SeqCst), 1);
    wait_until("first reservation released", &d.behaviour.changed, || {
        *d.behaviour.released.lock().unwrap() == [1]
    })
    .await;
}

#[tokio::test]
async fn a_decode_node_without_free_blocks_is_skipped_and_none_free_is_429() {
    init_tracing();
    let mut cluster = MemoryCluster::new();
    let p = start_prefill("p0").await;
    let d0 = start_decode("d0").await;
    let d1 = start_decode("d1").await;
    for info in [p.info(), d0.info(), d1.info()] {
        cluster.register(info).await;
    }
    let router = cluster.router(options()).await;
    d0.behaviour.refuse_reserves.store(1, Ordering::SeqCst);
    generate(&router, "room?", 2).await.expect("served by d1");
    assert_eq!(d1.behaviour.decode_calls.load(Ordering::SeqCst), 1);
    assert_eq!(router.router.stats().reserve_refusals, 1);

    d0.behaviour.refuse_reserves.store(1, Ordering::SeqCst);
    d1.behaviour.refuse_reserves.store(1, Ordering::SeqCst);
    let response = http(
        router.http_addr,
        "POST",
        "/v1/completions",
        Some(r#"{"prompt": "room?", "max_tokens": 2}"#),
        None,
    )
    .await;
    assert_eq!(response.status, 429, "{}", response.body);
    assert!(
        response.body.contains("free KV blocks"),
        "{}",
        response.body
    );
}

#[tokio::test]
async fn retries_are_bounded_and_end_in_a_clear_unavailable_error() {
    init_tracing();
    let mut cluster = MemoryCluster::new();
    let p = start_prefill("p0").await;
    let d = start_decode("d0").await;
    cluster.register(p.info()).await;
    cluster.register(d.info()).await;
    let router = cluster.router(options()).await; // max_attempts 3
    p.behaviour.fail_before_first.store(100, Ordering::SeqCst);

    let status = generate(&router, "doomed", 2).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unavailable);
    assert!(
        status.message().contains("3 attempts"),
        "{}",
        status.message()
    );
    assert_eq!(p.behaviour.prefill_calls.load(Ordering::SeqCst), 3);
    wait_until("every reservation released", &d.behaviour.changed, || {
        d.behaviour.released.lock().unwrap().len() == 3
    })
    .await;
    let response = http(
        router.http_addr,
        "POST",
        "/v1/completions",
        Some(r#"{"prompt": "doomed", "max_tokens": 2, "stream": true}"#),
        None,
    )
    .await;
    assert_eq!(
        response.status, 503,
        "an early failure is a status, not a 200 stream"
    );
    assert_eq!(
        response.json()["error"]["type"],
        "service_unavailable_error"
    );
    let stats = router.router.stats();
    assert_eq!((stats.failed, stats.retries), (2, 4));
}

#[tokio::test]
async fn a_decode_node_lost_mid_stream_is_migrated_and_the_client_sees_one_unbroken_stream() {
    init_tracing();
    let mut cluster = MemoryCluster::new();
    let p = start_prefill("p0").await;
    let d0 = start_decode("d0").await;
    let d1 = start_decode("d1").await;
    for info in [p.info(), d0.info(), d1.info()] {
        cluster.register(info).await;
    }
    let router = cluster.router(options()).await;
    d0.behaviour.fail_after_batches.store(3, Ordering::SeqCst);

    let out = generate(&router, "a long answer", 10)
        .await
        .expect("one unbroken stream");
    let (ids, text) = expected_output(prompt_tokens("a long answer"), 10);
    assert_eq!((out.ids, out.text), (ids, text));
    let usage = out.last.expect("final").usage.unwrap();
    assert_eq!(
        (usage.prompt_tokens, usage.completion_tokens),
        (prompt_tokens("a long answer") as u32, 10)
    );
    assert_eq!(d0.behaviour.decode_calls.load(Ordering::SeqCst), 1);
    assert_eq!(
        d1.behaviour.decode_calls.load(Ordering::SeqCst),
        1,
        "continued on the other node"
    );
    assert_eq!(
        p.behaviour.prefill_calls.load(Ordering::SeqCst),
        2,
        "prompt + output re-prefilled"
    );
    assert_eq!(router.router.stats().migrations, 1);
}

#[tokio::test]
async fn a_stream_lost_with_no_attempts_left_ends_with_an_interrupted_error() {
    init_tracing();
    let mut cluster = MemoryCluster::new();
    let p = start_prefill("p0").await;
    let d = start_decode("d0").await;
    cluster.register(p.info()).await;
    cluster.register(d.info()).await;
    let mut opts = options();
    opts.max_attempts = 1;
    let router = cluster.router(opts).await;
    d.behaviour.fail_after_batches.store(2, Ordering::SeqCst);

    let mut client = router.grpc().await;
    let mut stream = client
        .generate(grpc_request("cut short", 6))
        .await
        .expect("started")
        .into_inner();
    let mut tokens = 0;
    let status = loop {
        match stream.message().await {
            Ok(Some(message)) => {
                if let Some(tandem_proto::v1::generate_response::Event::Delta(delta)) =
                    message.event
                {
                    tokens += delta.token_ids.len();
                }
            }
            Ok(None) => panic!("the stream ended without an error"),
            Err(status) => break status,
        }
    };
    assert_eq!(tokens, 2);
    assert_eq!(status.code(), tonic::Code::Unavailable);
    assert!(
        status.message().contains("interrupted after 2 tokens"),
        "{}",
        status.message()
    );
    assert_eq!(router.router.stats().failed, 1);
}
