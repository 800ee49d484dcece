//! Per-key rate limits held across routers: two routers over the same fake nodes, their
//! buckets in a real etcd (`cluster::testing`). Needs `etcd` installed.

use crate::common;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::fakes::{start_decode, start_prefill};
use common::{HttpResponse, MemoryCluster, RunningRouter, WAIT, http, init_tracing, options};
use tandem_cluster::testing::TestEtcd;
use tandem_cluster::{EtcdConfig, EtcdDiscovery, RateLimitStore};
use tandem_router::{ApiKeys, Stores};

const KEYS: &str = r#"
[[key]]
id = "tight"
key = "sk-tight"
requests_per_second = 2

[[key]]
id = "other"
key = "sk-other"
requests_per_second = 2

[[key]]
id = "single"
key = "sk-single"
max_concurrent_requests = 1

[[key]]
id = "tokens"
key = "sk-tokens"
tokens_per_minute = 60
"#;

struct Setup {
    etcd: TestEtcd,
    _cluster: MemoryCluster,
    nodes: Vec<Box<dyn std::any::Any>>,
    routers: Vec<RunningRouter>,
    dir: PathBuf,
}

impl Drop for Setup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Two routers sharing one etcd for their limits, over one fake prefill/decode pair.
async fn two_routers(keys: &str) -> Setup {
    init_tracing();
    let etcd = TestEtcd::start().await;
    let dir = std::env::temp_dir().join(format!(
        "tandem-limits-{}-{}",
        std::process::id(),
        etcd.endpoint().rsplit(':').next().unwrap_or("0")
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("keys.toml");
    std::fs::write(&file, keys).unwrap();
    let mut cluster = MemoryCluster::new();
    let p = start_prefill("p0").await;
    let d = start_decode("d0").await;
    cluster.register(p.info()).await;
    cluster.register(d.info()).await;
    let mut routers = Vec::new();
    for _ in 0..2 {
        let etcd_handle = EtcdDiscovery::connect(EtcdConfig::new(
            vec![etcd.endpoint()],
            "limits-test".to_string(),
        ))
        .await
        .expect("connect to etcd");
        let mut opts = options();
        opts.api_keys = ApiKeys::default().with_file(&file).expect("key file");
        let stores = Stores {
            usage: Arc::new(tandem_cluster::MemoryUsageStore::default()),
            limits: Arc::new(
                etcd_handle
                    .rate_limit_store()
                    .with_timeout(Duration::from_millis(500)),
            ),
        };
        routers.push(
            common::start_router_with(
                Arc::new(cluster.discovery.clone()),
                Arc::new(cluster.loads.clone()),
                opts,
                stores,
            )
            .await,
        );
    }
    Setup {
        etcd,
        _cluster: cluster,
        nodes: vec![Box::new(p), Box::new(d)],
        routers,
        dir,
    }
}

async fn complete(
    router: &RunningRouter,
    key: &str,
    prompt: &str,
    max_tokens: u32,
) -> HttpResponse {
    let body = format!(r#"{{"prompt": "{prompt}", "max_tokens": {max_tokens}}}"#);
    http(
        router.http_addr,
        "POST",
        "/v1/completions",
        Some(&body),
        Some(key),
    )
    .await
}

fn assert_rate_limited(r: &HttpResponse, kind: &str) {
    assert_eq!(r.status, 429, "{}", r.body);
    let error = &r.json()["error"];
    assert_eq!(error["code"], "rate_limit_exceeded", "{}", r.body);
    assert_eq!(error["type"], kind, "{}", r.body);
}

#[tokio::test]
async fn two_routers_share_one_keys_request_rate_and_leave_other_keys_alone() {
    let s = two_routers(KEYS).await;
    let started = Instant::now();
    let mut ok = 0;
    let mut refused = [0; 2];
    for i in 0..8 {
        let r = complete(&s.routers[i % 2], "sk-tight", "hello", 2).await;
        match r.status {
            200 => {
                ok += 1;
                assert_eq!(r.header("x-ratelimit-limit-requests"), Some("2"));
            }
            _ => {
                assert_rate_limited(&r, "requests");
                refused[i % 2] += 1;
                let retry: u64 = r.header("retry-after").unwrap().parse().unwrap();
                let retry_ms: u64 = r.header("retry-after-ms").unwrap().parse().unwrap();
                assert!(
                    retry >= 1 && retry_ms <= 500,
                    "retry {retry} s / {retry_ms} ms"
                );
                assert_eq!(r.header("x-ratelimit-remaining-requests"), Some("0"));
                assert!(r.header("x-ratelimit-reset-requests").is_some());
                let message = r.json()["error"]["message"].as_str().unwrap().to_string();
                assert!(
                    message.contains("`tight`") && message.contains("2 requests per second"),
                    "{message}"
                );
            }
        }
    }
    // The bucket holds 2 and refills at 2/s: what both routers admitted together is bounded
    // by that, not 2 each.
    let bound = 2 + (2.0 * started.elapsed().as_secs_f64()).ceil() as usize;
    assert!(
        ok >= 2 && ok <= bound,
        "{ok} admitted, at most {bound} allowed"
    );
    assert!(
        refused[0] > 0 && refused[1] > 0,
        "both routers refused: {refused:?}"
    );
    // Another key's limit is its own: nothing the first key did counts against it.
    let other = complete(&s.routers[1], "sk-other", "hello", 2).await;
    assert_eq!(other.status, 200, "{}", other.body);
    assert_eq!(other.header("x-ratelimit-remaining-requests"), Some("1"));
    let metrics = s.routers[0].router.metrics().render();
    assert!(
        metrics.contains(r#"tandem_router_rate_limited_total{key="tight",limit="requests"}"#),
        "{metrics}"
    );
    assert!(!metrics.contains(r#"key="other",limit"#), "{metrics}");
}

#[tokio::test]
async fn a_concurrency_limit_holds_across_routers_and_frees_when_the_request_ends() {
    let s = two_routers(KEYS).await;
    let decode = s.nodes[1]
        .downcast_ref::<common::fakes::FakeNode<common::fakes::DecodeBehaviour>>()
        .unwrap();
    decode
        .behaviour
        .hold_after_batches
        .store(1, Ordering::SeqCst);
    let addr = s.routers[0].http_addr;
    let running = tokio::spawn(async move {
        let body = r#"{"prompt": "hold me", "max_tokens": 4}"#;
        http(
            addr,
            "POST",
            "/v1/completions",
            Some(body),
            Some("sk-single"),
        )
        .await
    });
    common::wait_until(
        "the first request to hold",
        &decode.behaviour.holding,
        || decode.behaviour.held.load(Ordering::SeqCst) >= 1,
    )
    .await;
    decode
        .behaviour
        .hold_after_batches
        .store(-1, Ordering::SeqCst);
    let refused = complete(&s.routers[1], "sk-single", "hello", 2).await;
    assert_rate_limited(&refused, "concurrent_requests");
    assert_eq!(
        refused.header("x-ratelimit-limit-concurrent-requests"),
        Some("1")
    );
    // notify_one keeps a permit if the stream has not begun waiting yet.
    decode.behaviour.resume.notify_one();
    let first = running.await.unwrap();
    assert_eq!(first.status, 200, "{}", first.body);
    // The slot goes back when the request ends: the other router gets it.
    let deadline = Instant::now() + WAIT;
    loop {
        let r = complete(&s.routers[1], "sk-single", "hello", 2).await;
        if r.status == 200 {
            break;
        }
        assert_rate_limited(&r, "concurrent_requests");
        assert!(Instant::now() < deadline, "the slot never came back");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn tokens_per_minute_count_prompt_and_output_and_an_oversize_prompt_never_passes() {
    let s = two_routers(KEYS).await;
    let started = Instant::now();
    let mut spent = 0u64;
    let mut admitted = 0;
    let refusal = loop {
        let r = complete(&s.routers[admitted % 2], "sk-tokens", "count me", 8).await;
        if r.status != 200 {
            break r;
        }
        let usage = &r.json()["usage"];
        spent += usage["total_tokens"].as_u64().unwrap();
        admitted += 1;
        assert!(admitted < 20, "the tokens limit never refused");
    };
    assert_rate_limited(&refusal, "tokens");
    assert!(refusal.header("retry-after").is_some());
    // A request is admitted while the bucket covers its prompt; its output may overdraw by
    // at most its own max_tokens (one request in flight per router here), paid back before
    // that router's next grant; the bucket refills 1 token a second meanwhile.
    let refill = started.elapsed().as_secs_f64().ceil() as u64;
    let bound = 60 + 2 * 8 + refill;
    assert!(
        spent <= bound,
        "{spent} tokens admitted, at most {bound} allowed"
    );
    assert!(admitted >= 2, "{admitted}");
    let long = "word ".repeat(80);
    let never = complete(&s.routers[0], "sk-tokens", long.trim(), 1).await;
    assert_rate_limited(&never, "tokens");
    assert!(
        never.header("retry-after").is_none(),
        "a request over the limit can never pass"
    );
    let message = never.json()["error"]["message"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(message.contains("can never pass"), "{message}");
}

#[tokio::test]
async fn with_etcd_down_each_router_limits_alone_and_counts_it() {
    let mut s = two_routers(KEYS).await;
    s.etcd.stop();
    let r = &s.routers[0];
    let mut statuses = Vec::new();
    for _ in 0..4 {
        statuses.push(complete(r, "sk-tight", "hello", 2).await.status);
    }
    // Its own bucket at the key's full limit: 2 at once, then refused.
    assert_eq!(&statuses[..2], &[200, 200], "{statuses:?}");
    assert_eq!(statuses[3], 429, "{statuses:?}");
    let counts = r.router.rate_limiter().counts();
    assert!(counts.store_errors.load(Ordering::Relaxed) >= 1);
    assert!(counts.local_decisions.load(Ordering::Relaxed) >= 2);
    let metrics = r.router.metrics().render();
    assert!(
        metrics.contains("tandem_router_rate_limit_store_errors_total"),
        "{metrics}"
    );
}

#[tokio::test]
async fn the_key_file_reloads_on_change_and_a_broken_file_keeps_the_last_good_keys() {
    let s = two_routers(KEYS).await;
    let r = &s.routers[0];
    tokio::spawn(tandem_router::keys::watch_file(r.router.downgrade()));
    assert_eq!(complete(r, "sk-late", "hello", 2).await.status, 401);
    let file = s.dir.join("keys.toml");
    std::fs::write(
        &file,
        format!("{KEYS}\n[[key]]\nid = \"late\"\nkey = \"sk-late\"\nrequests_per_second = 50\n"),
    )
    .unwrap();
    let deadline = Instant::now() + WAIT;
    while complete(r, "sk-late", "hello", 2).await.status != 200 {
        assert!(Instant::now() < deadline, "the new key was never loaded");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    std::fs::write(&file, "[[key]\nid = \"broken\n").unwrap();
    let deadline = Instant::now() + WAIT;
    while !r
        .router
        .metrics()
        .render()
        .contains(r#"tandem_router_key_file_reloads_total{result="failed"} 1"#)
    {
        assert!(Instant::now() < deadline, "the broken file was never read");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let error = r.router.api_keys().reload().unwrap_err().to_string();
    assert!(error.contains("line 1"), "{error}");
    let still = complete(r, "sk-late", "hello", 2).await;
    assert_eq!(still.status, 200, "the last good keys stay: {}", still.body);
}

#[tokio::test]
async fn a_lease_is_spent_locally_and_given_back_when_idle() {
    let s = two_routers(
        "[[key]]\nid = \"fast\"\nkey = \"sk-fast\"\nrequests_per_second = 100\ntokens_per_minute = 6000\n",
    )
    .await;
    let r = &s.routers[0];
    let visits = || {
        r.router
            .rate_limiter()
            .counts()
            .store_visits
            .load(Ordering::Relaxed)
    };
    for _ in 0..20 {
        assert_eq!(complete(r, "sk-fast", "hello", 1).await.status, 200);
    }
    // Leases of 10 requests and 600 tokens: a few visits, not one per request.
    let used = visits();
    assert!(used <= 8, "{used} visits for 20 requests");
    // Idle, the unspent tokens go back to the shared record (refilling alone, 100 tokens a
    // second, could not bring it near full within the wait).
    let etcd = EtcdDiscovery::connect(EtcdConfig::new(
        vec![s.etcd.endpoint()],
        "limits-test".to_string(),
    ))
    .await
    .unwrap();
    let store = etcd.rate_limit_store();
    let limits = tandem_cluster::KeyLimits {
        requests_per_second: Some(100.0),
        tokens_per_minute: Some(6000),
        max_concurrent_requests: None,
    };
    let idle_from = Instant::now();
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let mut record = store
            .update("fast", &mut |current| current.unwrap_or_default())
            .await
            .unwrap();
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64;
        record.refill(&limits, now);
        if record.tokens >= 5900.0 {
            break;
        }
        assert!(
            idle_from.elapsed() < Duration::from_secs(4),
            "the lease never came back: {record:?}"
        );
    }
}

#[tokio::test]
async fn grpc_refuses_over_the_limit_with_resource_exhausted_and_retry_info() {
    use tonic_types::StatusExt;
    let s = two_routers(KEYS).await;
    let mut codes = Vec::new();
    let mut last = None;
    for i in 0..4 {
        let mut client = s.routers[i % 2].grpc().await;
        let mut request = tonic::Request::new(common::grpc_request("hello", 2));
        request
            .metadata_mut()
            .insert("authorization", "Bearer sk-tight".parse().unwrap());
        match client.generate(request).await {
            Ok(response) => {
                assert_eq!(
                    response
                        .metadata()
                        .get("x-ratelimit-limit-requests")
                        .and_then(|v| v.to_str().ok()),
                    Some("2")
                );
                codes.push(tonic::Code::Ok);
            }
            Err(status) => {
                codes.push(status.code());
                last = Some(status);
            }
        }
    }
    assert_eq!(codes[..2], [tonic::Code::Ok, tonic::Code::Ok], "{codes:?}");
    assert_eq!(codes[3], tonic::Code::ResourceExhausted, "{codes:?}");
    let status = last.unwrap();
    let details = status.get_error_details();
    let retry = details.retry_info().expect("RetryInfo");
    let delay = retry.retry_delay.expect("a retry delay");
    assert!(
        delay > Duration::ZERO && delay <= Duration::from_millis(500),
        "{delay:?}"
    );
    let quota = details.quota_failure().expect("QuotaFailure");
    assert_eq!(quota.violations[0].subject, "api_key:tight");
    assert!(status.metadata().get("retry-after").is_some());
}
