//! What the people who run tandem see, on a real `tandem up` cluster (etcd, NATS, nodes,
//! router; each test its own, one at a time):
//! - traces: a request sent with a client `traceparent`, over HTTP and over gRPC, yields spans
//!   from the router, prefill and decode processes under that one trace id, each hop parented
//!   on the call that caused it, the KV receive linked to the push; the response carries the
//!   trace id; a malformed `traceparent` starts a new trace;
//! - a frozen decode node (SIGSTOP) mid-stream: the stream stalls for less than 10 s, migrates,
//!   finishes with the same tokens as an undisturbed run, and the trace shows the migration;
//! - Prometheus (`tandem up --prometheus`): every process is a target that is up, the TTFT
//!   histogram holds the requests' samples, the alert rules pass promtool and are loaded, and
//!   every metric the Grafana dashboard queries is one the live scrape returns.

use crate::common;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::client::{Reply, request};
use common::up::{SERIAL, Up, free_addr};
use tandem_telemetry::testing::{OtlpReceiver, ReceivedSpan};

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn repo() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

fn completion(http: SocketAddr, body: &str, headers: &[(&str, &str)]) -> Reply {
    request(http, "POST", "/v1/completions", headers, Some(body), |_| {})
}

/// The spans of trace `tid`, once every stage of a request has arrived (or after 20 s).
fn trace(rt: &tokio::runtime::Runtime, rx: &OtlpReceiver, tid: &str) -> Vec<ReceivedSpan> {
    let stages = [
        "router.request",
        "router.attempt",
        "router.reserve",
        "router.prefill",
        "router.decode",
        "decode.reserve",
        "prefill.request",
        "prefill.forward",
        "kv.push",
        "decode.request",
        "kv.receive",
        "decode.stream",
    ];
    let spans = rt.block_on(rx.wait_for(Duration::from_secs(20), |s| {
        stages
            .iter()
            .all(|st| s.iter().any(|x| x.trace_id == tid && x.name == *st))
    }));
    spans.into_iter().filter(|s| s.trace_id == tid).collect()
}

fn one<'a>(spans: &'a [ReceivedSpan], name: &str) -> &'a ReceivedSpan {
    let found: Vec<_> = spans.iter().filter(|s| s.name == name).collect();
    assert_eq!(found.len(), 1, "exactly one {name} span in {spans:#?}");
    found[0]
}

/// Every hop is parented on the call that caused it, in the process that ran it.
/// The hops of one disaggregated request: (span, parent span, service that records it). Shared
/// with the tracing-UI test (trace_ui.rs), which checks the same tree as Phoenix stores it.
pub const HOPS: [(&str, &str, &str); 11] = [
    ("router.attempt", "router.request", "tandem-router"),
    ("router.reserve", "router.attempt", "tandem-router"),
    ("router.prefill", "router.attempt", "tandem-router"),
    ("router.decode", "router.attempt", "tandem-router"),
    ("decode.reserve", "router.reserve", "tandem-decode"),
    ("prefill.request", "router.prefill", "tandem-prefill"),
    ("prefill.forward", "prefill.request", "tandem-prefill"),
    ("kv.push", "prefill.request", "tandem-prefill"),
    ("decode.request", "router.decode", "tandem-decode"),
    ("kv.receive", "decode.request", "tandem-decode"),
    ("decode.stream", "decode.request", "tandem-decode"),
];

fn assert_request_trace(spans: &[ReceivedSpan], client_span: &str, output_tokens: u32) {
    let req = one(spans, "router.request");
    assert_eq!(req.parent_span_id, client_span, "continues the caller's trace");
    assert_eq!(req.service, "tandem-router");
    assert!(req.attr("gen_ai.request.model").is_some(), "{req:?}");
    assert_eq!(
        req.attr("gen_ai.usage.output_tokens"),
        Some(output_tokens.to_string().as_str()),
        "{req:?}"
    );
    assert!(req.attr("gen_ai.usage.input_tokens").is_some(), "{req:?}");
    assert_eq!(req.attr("gen_ai.response.finish_reasons"), Some("length"));
    for (child, parent, service) in HOPS {
        let (c, p) = (one(spans, child), one(spans, parent));
        assert_eq!(c.parent_span_id, p.span_id, "{child} is a child of {parent}");
        assert_eq!(c.service, service, "{child} comes from {service}");
    }
    let (push, receive) = (one(spans, "kv.push"), one(spans, "kv.receive"));
    assert!(
        receive
            .links
            .contains(&(push.trace_id.clone(), push.span_id.clone())),
        "the receive side is linked to the push through the transfer descriptor: {receive:?}"
    );
    assert_eq!(receive.attr("tandem.kv.verified"), Some("true"));
    assert!(spans.iter().all(|s| !s.error), "a healthy request has no error span");
}

#[test]
fn traces_follow_a_request_through_router_prefill_and_decode_over_http_and_grpc() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let rt = runtime();
    let rx = rt.block_on(OtlpReceiver::start());
    let (grpc, http) = (free_addr(), free_addr());
    let endpoint = rx.grpc_endpoint();
    let mut up = Up::start_with(
        &grpc,
        &http,
        // Through a prefill node whatever the prompt's length: the trace crosses every hop.
        &[
            "--no-sample",
            "--otlp-endpoint",
            &endpoint,
            "--otlp-protocol",
            "grpc",
            "--disaggregation",
            "always",
        ],
    );
    up.wait_for_line("is serving", Duration::from_secs(180));
    let http: SocketAddr = http.parse().unwrap();

    // HTTP ingress, as an API gateway with its own trace.
    let (tid, sid) = ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7");
    let r = completion(
        http,
        r#"{"prompt": "The history of the printing press", "max_tokens": 8, "ignore_eos": true}"#,
        &[("traceparent", &format!("00-{tid}-{sid}-01"))],
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let back = r.header("traceparent").expect("the trace id goes back to the client");
    assert!(back.starts_with(&format!("00-{tid}-")), "{back}");
    assert_request_trace(&trace(&rt, &rx, tid), sid, 8);

    // gRPC ingress, trace context in the metadata.
    let (tid, sid) = ("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331");
    let back = rt.block_on(async {
        use tandem_proto::v1::inference_client::InferenceClient;
        use tandem_proto::v1::{GenerateRequest, SamplingParams, generate_request};
        let mut client = InferenceClient::connect(format!("http://{grpc}"))
            .await
            .unwrap();
        let mut call = tonic::Request::new(GenerateRequest {
            input: Some(generate_request::Input::Prompt("def quicksort(items):".into())),
            sampling: Some(SamplingParams {
                max_tokens: 6,
                ignore_eos: true,
                ..Default::default()
            }),
            ..Default::default()
        });
        call.metadata_mut()
            .insert("traceparent", format!("00-{tid}-{sid}-01").parse().unwrap());
        let response = client.generate(call).await.unwrap();
        let back = response
            .metadata()
            .get("traceparent")
            .expect("traceparent in the response metadata")
            .to_str()
            .unwrap()
            .to_string();
        let mut stream = response.into_inner();
        while stream.message().await.unwrap().is_some() {}
        back
    });
    assert!(back.starts_with(&format!("00-{tid}-")), "{back}");
    assert_request_trace(&trace(&rt, &rx, tid), sid, 6);

    // A malformed traceparent is never an error: the request starts a trace of its own.
    let r = completion(
        http,
        r#"{"prompt": "Hello", "max_tokens": 2}"#,
        &[("traceparent", "00-not-a-trace-01")],
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let fresh = r.header("traceparent").expect("a new trace");
    assert_eq!(fresh.len(), 55, "{fresh}");
    assert!(!fresh.contains("not-a-trace"));
}

/// The node stays frozen until the whole answer has arrived, so an answer at all means the
/// router moved the stream: no bound on how long the client waited is asserted (on a loaded
/// machine detection and the re-prefill take longer; the decode-stop drill reports the stall).
#[test]
fn a_frozen_decode_node_s_stream_migrates_unbroken_while_it_is_frozen_and_the_trace_shows_both_attempts() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let rt = runtime();
    let rx = rt.block_on(OtlpReceiver::start());
    let http_s = free_addr();
    let endpoint = rx.http_endpoint();
    let mut up = Up::start_with(
        &free_addr(),
        &http_s,
        &[
            "--no-sample",
            "--decode",
            "2",
            "--otlp-endpoint",
            &endpoint,
            "--otlp-protocol",
            "http/protobuf",
        ],
    );
    up.wait_for_line("is serving", Duration::from_secs(180));
    let http: SocketAddr = http_s.parse().unwrap();
    let pids = up.pids();
    // Long enough that the node cannot have generated (and written to its socket) the whole
    // stream by the time this client has read 10 events, even with the machine loaded: a node
    // frozen after finishing would leave nothing to migrate.
    let body = r#"{"prompt": "Ten facts about octopuses:\n1.", "max_tokens": 400, "ignore_eos": true,
                  "stream": true, "stream_options": {"include_usage": true}}"#;
    let (tid, sid) = ("5cf92f3577b34da6a3ce929d0e0e4799", "10f067aa0ba902b7");
    let mut stopped = None;
    let r = request(
        http,
        "POST",
        "/v1/completions",
        &[("traceparent", &format!("00-{tid}-{sid}-01"))],
        Some(body),
        |n| {
            if n == 10 && stopped.is_none() {
                // The decode node serving this stream, from the router's own counts.
                let m = request(http, "GET", "/metrics", &[], None, |_| {}).body;
                let busy = m
                    .lines()
                    .filter(|l| l.starts_with("tandem_router_in_flight{role=\"decode\""))
                    .find(|l| !l.ends_with(" 0"))
                    .and_then(|l| l.split("node=\"").nth(1))
                    .and_then(|l| l.split('"').next())
                    .expect("a decode node has the stream")
                    .to_string();
                let pid = pids.iter().find(|(n, _)| *n == busy).unwrap().1;
                // SAFETY: kill(2) on a child of the cluster under test.
                unsafe { libc::kill(pid, libc::SIGSTOP) };
                stopped = Some((busy, pid));
            }
        },
    );
    let (busy, pid) = stopped.expect("the stream reached 10 events");
    // SAFETY: as above; the node resumes (and finds its stream gone).
    unsafe { libc::kill(pid, libc::SIGCONT) };
    assert_eq!(r.status, 200);
    assert!(
        r.events.iter().all(|e| !e.contains("\"error\"")),
        "one unbroken stream: {:?}",
        r.events
    );
    eprintln!("the client's stream stalled {:?} while {busy} was frozen", r.longest_stall);
    let usage = r
        .events
        .iter()
        .find(|e| e.contains("\"usage\":{"))
        .expect("a usage chunk");
    assert!(usage.contains("\"completion_tokens\":400"), "{usage}");
    let text = |r: &Reply| -> String {
        r.events
            .iter()
            .filter_map(|e| serde_json::from_str::<serde_json::Value>(e).ok())
            .filter_map(|v| v["choices"][0]["text"].as_str().map(str::to_owned))
            .collect()
    };
    // The same request undisturbed: greedy, so the migrated stream must equal it.
    let calm = request(http, "POST", "/v1/completions", &[], Some(body), |_| {});
    assert_eq!(text(&r), text(&calm), "the migrated stream equals an undisturbed one");

    let spans = rt.block_on(rx.wait_for(Duration::from_secs(20), |s| {
        s.iter()
            .filter(|x| x.trace_id == tid && x.name == "router.attempt")
            .count()
            >= 2
            && s.iter().any(|x| x.trace_id == tid && x.name == "router.request")
    }));
    let spans: Vec<_> = spans.into_iter().filter(|s| s.trace_id == tid).collect();
    let attempts: Vec<_> = spans.iter().filter(|s| s.name == "router.attempt").collect();
    assert_eq!(attempts.len(), 2, "{spans:#?}");
    assert!(attempts.iter().any(|a| a.error), "the first attempt failed");
    assert!(
        attempts
            .iter()
            .any(|a| a.attr("tandem.reason") == Some("migration")),
        "{attempts:#?}"
    );
    let root = one(&spans, "router.request");
    assert_eq!(root.parent_span_id, sid);
    assert!(!root.error, "the request itself succeeded");
    assert!(
        spans
            .iter()
            .any(|s| s.name == "decode.request" && s.service == "tandem-decode"),
        "the surviving decode node's spans are in the trace"
    );
    let m = request(http, "GET", "/metrics", &[], None, |_| {}).body;
    assert!(
        m.lines()
            .any(|l| l.starts_with("tandem_router_recoveries_total{kind=\"migration\"}")
                && !l.ends_with(" 0")),
        "{m}"
    );
}

fn prom_get(addr: SocketAddr, path: &str) -> serde_json::Value {
    let r = request(addr, "GET", path, &[], None, |_| {});
    assert_eq!(r.status, 200, "{path}: {}", r.body);
    r.json()
}

#[test]
fn prometheus_scrapes_every_process_and_the_dashboard_queries_live_metrics() {
    // The rules first: promtool's syntax check and the unit tests beside them.
    let dir = repo().join("deploy/observability");
    for args in [
        vec!["check", "rules", "alerts.yml"],
        vec!["test", "rules", "alerts.test.yml"],
    ] {
        let out = Command::new("promtool")
            .args(&args)
            .current_dir(&dir)
            .output()
            .expect("promtool (Debian prometheus) is installed by scripts/setup.sh");
        assert!(
            out.status.success(),
            "promtool {args:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (http_s, prom_s) = (free_addr(), free_addr());
    let mut up = Up::start_with(
        &free_addr(),
        &http_s,
        &["--no-sample", "--prometheus", "--prometheus-addr", &prom_s],
    );
    up.wait_for_line("is serving", Duration::from_secs(180));
    let (http, prom): (SocketAddr, SocketAddr) = (http_s.parse().unwrap(), prom_s.parse().unwrap());
    for i in 0..3 {
        let r = completion(
            http,
            &format!(r#"{{"prompt": "Question {i}:", "max_tokens": 4}}"#),
            &[],
        );
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let (mut targets, mut ttft_count) = (serde_json::Value::Null, 0.0);
    while std::time::Instant::now() < deadline {
        targets = prom_get(prom, "/api/v1/targets");
        let q = prom_get(
            prom,
            "/api/v1/query?query=sum(tandem_router_time_to_first_token_seconds_count)",
        );
        ttft_count = q["data"]["result"][0]["value"][1]
            .as_str()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0);
        let active = targets["data"]["activeTargets"].as_array().unwrap();
        if active.len() == 3 && active.iter().all(|t| t["health"] == "up") && ttft_count >= 3.0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    let active = targets["data"]["activeTargets"].as_array().unwrap();
    let names: BTreeSet<&str> = active
        .iter()
        .filter_map(|t| t["labels"]["tandem_process"].as_str())
        .collect();
    assert_eq!(
        names,
        BTreeSet::from(["router", "prefill-0", "decode-0"]),
        "{targets}"
    );
    assert!(
        active.iter().all(|t| t["health"] == "up"),
        "every target is up: {targets}"
    );
    assert!(ttft_count >= 3.0, "TTFT samples of the 3 requests: {ttft_count}");

    let rules = prom_get(prom, "/api/v1/rules");
    let loaded = rules["data"]["groups"][0]["rules"].as_array().unwrap().len();
    assert_eq!(loaded, 6, "the alert rules are loaded: {rules}");

    // Every metric the dashboard queries is one a live scrape returns.
    let live = prom_get(prom, "/api/v1/label/__name__/values");
    let live: BTreeSet<&str> = live["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v.as_str())
        .collect();
    let dash: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("grafana-dashboard.json")).unwrap(),
    )
    .unwrap();
    let mut queried = BTreeSet::new();
    for panel in dash["panels"].as_array().unwrap() {
        for t in panel["targets"].as_array().unwrap() {
            let expr = t["expr"].as_str().unwrap();
            for word in expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
                if word.starts_with("tandem_") {
                    queried.insert(word.to_string());
                }
            }
        }
    }
    assert!(queried.len() >= 15, "{queried:?}");
    let missing: Vec<_> = queried.iter().filter(|m| !live.contains(m.as_str())).collect();
    assert!(missing.is_empty(), "the dashboard queries metrics no process exports: {missing:?}");
}
