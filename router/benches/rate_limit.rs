//! What a per-key rate limit adds to a request's admission, against a real etcd
//! (`cluster::testing`, needs `etcd` installed): every admission timed on its own, medians and
//! tails, beside the same admissions of a key without limits measured in the same run.
//!
//! `cargo bench -p tandem-router --bench rate_limit` (`TANDEM_BENCH_ADMISSIONS`, default 4000).

use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_cluster::testing::TestEtcd;
use tandem_cluster::{EtcdConfig, EtcdDiscovery, KeyLimits, LimitRecord, RateLimitStore};
use tandem_router::RateLimiter;
use tandem_router::ratelimit::STORE_TIMEOUT;

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn report(name: &str, mut samples: Vec<Duration>, baseline_p50: Option<Duration>) -> Duration {
    samples.sort();
    let p50 = percentile(&samples, 0.5);
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let added = baseline_p50.map_or(String::from("-"), |b| format!("{:.1}", us(p50) - us(b)));
    println!(
        "| {name} | {} | {:.1} | {:.1} | {:.1} | {added} |",
        samples.len(),
        us(p50),
        us(percentile(&samples, 0.9)),
        us(percentile(&samples, 0.99)),
    );
    p50
}

async fn admissions(limiter: &Arc<RateLimiter>, key: &str, limits: KeyLimits, n: usize) -> Vec<Duration> {
    let id: Arc<str> = Arc::from(key);
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        let permit = limiter.admit(&id, limits, 64).await.expect("within the limits");
        permit.spend_output(16);
        drop(permit);
        out.push(t.elapsed());
    }
    out
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let n: usize = std::env::var("TANDEM_BENCH_ADMISSIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4000);
    let etcd = TestEtcd::start().await;
    let connect = || async {
        EtcdDiscovery::connect(EtcdConfig::new(vec![etcd.endpoint()], "bench".to_string()))
            .await
            .expect("etcd")
            .rate_limit_store()
            .with_timeout(STORE_TIMEOUT)
    };
    let limiter = |store, name: &str| RateLimiter::new(Arc::new(store), name.to_string());
    let a = limiter(connect().await, "router-a");
    let b = limiter(connect().await, "router-b");
    // Generous limits (nothing is refused): the cost of holding them, not of refusals.
    let busy = KeyLimits {
        requests_per_second: Some(1e6),
        tokens_per_minute: Some(1_000_000_000),
        max_concurrent_requests: Some(1000),
    };
    println!("| admission | n | p50 µs | p90 µs | p99 µs | p50 added µs |");
    println!("|---|---|---|---|---|---|");
    let none = admissions(&a, "none", KeyLimits::default(), n).await;
    let base = report("key without limits (baseline)", none, None);
    let one = admissions(&a, "busy", busy, n).await;
    report("limited key, one router", one, Some(base));
    let (x, y) = tokio::join!(
        admissions(&a, "shared", busy, n / 2),
        admissions(&b, "shared", busy, n / 2)
    );
    report("limited key, two routers at once", [x, y].concat(), Some(base));
    // A key slower than 20 requests a second gets leases of one request: every admission
    // visits etcd. Timed here as the visit itself.
    let store = connect().await;
    let slow = KeyLimits {
        requests_per_second: Some(5.0),
        ..KeyLimits::default()
    };
    let mut visits = Vec::with_capacity(n / 10);
    for _ in 0..(n / 10).max(50) {
        let t = Instant::now();
        store
            .update("slow", &mut |current| {
                let mut r = current.unwrap_or_else(|| LimitRecord::full(&slow, 0));
                r.refill(&slow, u64::MAX / 2);
                r
            })
            .await
            .expect("etcd CAS");
        visits.push(t.elapsed());
    }
    report("one visit to the shared record (etcd CAS)", visits, Some(base));
    println!(
        "store visits: router a {}, router b {}",
        a.counts().store_visits.load(std::sync::atomic::Ordering::Relaxed),
        b.counts().store_visits.load(std::sync::atomic::Ordering::Relaxed)
    );
}
