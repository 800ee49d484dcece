//! Traces in a real tracing UI. Arize Phoenix (deploy/trace-ui/requirements.txt, installed by
//! `TANDEM_SETUP_PHOENIX=1 scripts/setup.sh` into `.tandem/phoenix`, or `$TANDEM_PHOENIX`)
//! receives a `tandem up` cluster's spans over OTLP/HTTP; Phoenix's own REST API then returns
//! one request's trace with every hop (router → prefill → KV push → decode), each from the
//! service that did it (`tandem.service`, since Phoenix keeps span attributes only) and parented
//! on the call that caused it. The test fails, never skips, when Phoenix is not installed.

use crate::common;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::client::request;
use common::up::{SERIAL, Up, free_addr};
use crate::observability::HOPS;

/// A `phoenix serve` of its own: loopback ports, a working directory (its SQLite database)
/// removed with it, no usage telemetry. Killed on drop.
struct Phoenix {
    child: Child,
    http: SocketAddr,
    dir: PathBuf,
}

impl Phoenix {
    fn start() -> Phoenix {
        let bin = std::env::var_os("TANDEM_PHOENIX").map(PathBuf::from).unwrap_or_else(|| {
            PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../.tandem/phoenix/bin/phoenix"))
        });
        assert!(
            bin.exists(),
            "Arize Phoenix is not installed at {} (TANDEM_SETUP_PHOENIX=1 scripts/setup.sh \
             installs it; scripts/test.sh does)",
            bin.display()
        );
        let http: SocketAddr = free_addr().parse().unwrap();
        let grpc: SocketAddr = free_addr().parse().unwrap();
        let dir = std::env::temp_dir().join(format!("tandem-phoenix-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let log = std::fs::File::create(dir.join("phoenix.log")).unwrap();
        let child = Command::new(&bin)
            .arg("serve")
            .env("PHOENIX_WORKING_DIR", &dir)
            .env("PHOENIX_HOST", "127.0.0.1")
            .env("PHOENIX_PORT", http.port().to_string())
            .env("PHOENIX_GRPC_PORT", grpc.port().to_string())
            .env("PHOENIX_TELEMETRY_ENABLED", "false")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", bin.display()));
        let mut phoenix = Phoenix { child, http, dir };
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            if let Some(status) = phoenix.child.try_wait().unwrap() {
                panic!("phoenix serve exited ({status}) before serving:\n{}", phoenix.log());
            }
            if std::net::TcpStream::connect(http).is_ok()
                && request(http, "GET", "/healthz", &[], None, |_| {}).status == 200
            {
                return phoenix;
            }
            assert!(
                Instant::now() < deadline,
                "phoenix serve did not answer /healthz within 120 s:\n{}",
                phoenix.log()
            );
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("phoenix.log")).unwrap_or_default()
    }

    /// The spans of `trace_id` in the default project, as Phoenix's REST API returns them.
    fn spans(&self, trace_id: &str) -> Vec<serde_json::Value> {
        let r = request(
            self.http,
            "GET",
            &format!("/v1/projects/default/spans?trace_id={trace_id}&limit=1000"),
            &[],
            None,
            |_| {},
        );
        match r.status {
            200 => r.json()["data"].as_array().cloned().unwrap_or_default(),
            // No span of the project has arrived yet.
            404 => Vec::new(),
            s => panic!("GET spans: {s} {}", r.body),
        }
    }
}

impl Drop for Phoenix {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[test]
fn phoenix_shows_a_request_trace_from_router_through_prefill_kv_push_and_decode() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let phoenix = Phoenix::start();
    let endpoint = format!("http://{}", phoenix.http);
    let (grpc, http) = (free_addr(), free_addr());
    let mut up = Up::start_with(
        &grpc,
        &http,
        &[
            "--no-sample",
            "--otlp-endpoint",
            &endpoint,
            "--otlp-protocol",
            "http/protobuf",
            // Through a prefill node whatever the prompt's length: the trace crosses every hop.
            "--disaggregation",
            "always",
        ],
    );
    up.wait_for_line("is serving", Duration::from_secs(180));

    let (tid, sid) = ("5c2e7d3a9b104f6e8a1d2c3b4a596877", "1a2b3c4d5e6f7081");
    let r = request(
        http.parse().unwrap(),
        "POST",
        "/v1/completions",
        &[("traceparent", &format!("00-{tid}-{sid}-01"))],
        Some(r#"{"prompt": "A short history of the telescope", "max_tokens": 6, "ignore_eos": true}"#),
        |_| {},
    );
    assert_eq!(r.status, 200, "{}", r.body);

    // Spans reach Phoenix in batches (each process flushes every 500 ms).
    let wanted = HOPS.len() + 1;
    let deadline = Instant::now() + Duration::from_secs(30);
    let spans = loop {
        let spans = phoenix.spans(tid);
        if spans.len() >= wanted || Instant::now() > deadline {
            break spans;
        }
        std::thread::sleep(Duration::from_millis(500));
    };
    let mut by_name: BTreeMap<&str, Vec<&serde_json::Value>> = BTreeMap::new();
    for s in &spans {
        by_name.entry(s["name"].as_str().unwrap_or("?")).or_default().push(s);
    }
    let one = |name: &str| -> &serde_json::Value {
        let found = by_name.get(name).map(Vec::as_slice).unwrap_or_default();
        assert_eq!(found.len(), 1, "exactly one {name} span in Phoenix's trace: {spans:#?}");
        found[0]
    };
    let span_id = |s: &serde_json::Value| s["context"]["span_id"].as_str().unwrap().to_string();
    let parent = |s: &serde_json::Value| s["parent_id"].as_str().map(str::to_string);
    let service = |s: &serde_json::Value| {
        s["attributes"]["tandem.service"]
            .as_str()
            .map(str::to_string)
    };

    let root = one("router.request");
    assert_eq!(parent(root).as_deref(), Some(sid), "continues the caller's trace: {root:#}");
    assert_eq!(service(root).as_deref(), Some("tandem-router"), "{root:#}");
    for (child, parent_name, svc) in HOPS {
        let (c, p) = (one(child), one(parent_name));
        assert_eq!(
            parent(c),
            Some(span_id(p)),
            "{child} is a child of {parent_name} in Phoenix: {c:#}"
        );
        assert_eq!(service(c).as_deref(), Some(svc), "{child} comes from {svc}: {c:#}");
        assert_eq!(c["context"]["trace_id"].as_str(), Some(tid), "{c:#}");
    }
    let receive = one("kv.receive");
    let verified = &receive["attributes"]["tandem.kv.verified"];
    assert!(
        verified == &serde_json::json!(true) || verified == &serde_json::json!("true"),
        "the pushed KV was verified on arrival: {receive:#}"
    );
    for s in &spans {
        assert_ne!(s["status_code"].as_str(), Some("ERROR"), "a healthy request: {s:#}");
    }
}
