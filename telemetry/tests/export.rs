//! The trace pipeline against a real OTLP receiver: spans arrive over gRPC and over
//! HTTP/protobuf with their service name, parent links and attributes; a collector that
//! accepts connections and never answers does not slow the code that ends spans.

use std::time::{Duration, Instant};

use opentelemetry::trace::{Span as _, TraceContextExt, Tracer as _, TracerProvider as _};
use tandem_telemetry::TraceArgs;
use tandem_telemetry::testing::OtlpReceiver;
use tandem_telemetry::trace::{OtlpProtocol, provider};

async fn round_trip(protocol: OtlpProtocol) {
    let rx = OtlpReceiver::start().await;
    let endpoint = match protocol {
        OtlpProtocol::Grpc => rx.grpc_endpoint(),
        OtlpProtocol::HttpProtobuf => rx.http_endpoint(),
    };
    let args = TraceArgs {
        otlp_endpoint: Some(endpoint),
        otlp_protocol: protocol,
    };
    // Built outside the runtime's worker (the exporter brings its own runtime).
    let p = tokio::task::spawn_blocking(move || provider("tandem-test", &args).unwrap().unwrap())
        .await
        .unwrap();
    let t = p.tracer("test");
    let root = t.start("router.request");
    let cx = opentelemetry::Context::current_with_span(root);
    let mut child = t.start_with_context("router.prefill", &cx);
    child.set_attribute(opentelemetry::KeyValue::new("tandem.node_id", "prefill-0"));
    child.end();
    drop(cx);
    tokio::task::spawn_blocking(move || {
        p.force_flush().unwrap();
        p.shutdown().unwrap();
    })
    .await
    .unwrap();
    let spans = rx
        .wait_for(Duration::from_secs(10), |s| s.len() >= 2)
        .await;
    assert_eq!(spans.len(), 2, "{spans:?}");
    let root = spans.iter().find(|s| s.name == "router.request").unwrap();
    let child = spans.iter().find(|s| s.name == "router.prefill").unwrap();
    assert_eq!(root.service, "tandem-test");
    assert_eq!(child.trace_id, root.trace_id);
    assert_eq!(child.parent_span_id, root.span_id);
    assert_eq!(child.attr("tandem.node_id"), Some("prefill-0"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_reach_a_real_otlp_grpc_receiver() {
    round_trip(OtlpProtocol::Grpc).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_reach_a_real_otlp_http_protobuf_receiver() {
    round_trip(OtlpProtocol::HttpProtobuf).await;
}

#[test]
fn a_collector_that_never_answers_does_not_slow_ending_spans() {
    // Accepts TCP connections and never reads or answers: every export hangs until its
    // timeout (5 s). A pipeline that exported inline would take ≥ 5 s per span here.
    let blackhole = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let args = TraceArgs {
        otlp_endpoint: Some(format!("http://{}", blackhole.local_addr().unwrap())),
        otlp_protocol: OtlpProtocol::Grpc,
    };
    let p = provider("tandem-test", &args).unwrap().unwrap();
    let t = p.tracer("test");
    let n = 20_000;
    let t0 = Instant::now();
    for i in 0..n {
        let mut s = t.start("kv.push");
        s.set_attribute(opentelemetry::KeyValue::new("i", i as i64));
        s.end();
    }
    let took = t0.elapsed();
    // Bounded queue: spans beyond it are dropped, never waited for. 20,000 spans take a few
    // tens of milliseconds; the bound leaves room for a loaded CI machine.
    assert!(
        took < Duration::from_secs(3),
        "ending {n} spans took {took:?} with a collector that never answers"
    );
    drop(blackhole);
}
