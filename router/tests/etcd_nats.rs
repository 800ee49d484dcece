//! The router against the real control plane: fake nodes registered in a real etcd and
//! publishing load reports over a real NATS (`cluster::testing`). Needs `etcd` and
//! `nats-server` installed (the test fails with the install command otherwise).

use crate::common;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::fakes::{DecodeBehaviour, FakeNode, expected_output, start_decode, start_prefill};
use common::{RunningRouter, WAIT, generate, init_tracing, options, prompt_tokens, start_router};
use tandem_cluster::testing::{TestEtcd, TestNats};
use tandem_cluster::{
    Discovery, EtcdConfig, EtcdDiscovery, LoadPublisher, LoadReport, LoadSignals, NatsConfig,
    NatsLoadSignals, Registration,
};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

const CLUSTER: &str = "router-test";
const PERIOD: Duration = Duration::from_millis(100);

struct Published {
    registration: Registration,
    load: watch::Sender<LoadReport>,
    _publisher: LoadPublisher,
}

async fn register(
    discovery: &EtcdDiscovery,
    signals: &Arc<dyn LoadSignals>,
    info: tandem_cluster::NodeInfo,
    stop: &CancellationToken,
) -> Published {
    let (load, reports) = watch::channel(LoadReport::idle(&info.node_id, info.role, 1024));
    let publisher = LoadPublisher::spawn(Arc::clone(signals), reports, PERIOD, stop);
    let registration = discovery.register(info).await.expect("register in etcd");
    Published {
        registration,
        load,
        _publisher: publisher,
    }
}

/// Runs requests until `condition` holds (each must succeed), bounded by `limit`.
async fn serve_until(
    router: &RunningRouter,
    what: &str,
    limit: Duration,
    condition: impl Fn() -> bool,
) {
    let deadline = Instant::now() + limit;
    while !condition() {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        let out = generate(router, "keep serving", 2)
            .await
            .expect("requests keep succeeding");
        assert_eq!(out.ids, expected_output(prompt_tokens("keep serving"), 2).0);
    }
}

fn decode_calls(node: &FakeNode<DecodeBehaviour>) -> u32 {
    node.behaviour.decode_calls.load(Ordering::SeqCst)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_through_real_etcd_membership_and_nats_load_reports() {
    init_tracing();
    let etcd = TestEtcd::start().await;
    let mut nats = TestNats::start().await;
    let stop = CancellationToken::new();
    let etcd_config =
        EtcdConfig::new(vec![etcd.endpoint()], CLUSTER).with_lease_ttl(Duration::from_secs(2));
    let nodes_discovery = EtcdDiscovery::connect(etcd_config.clone()).await.unwrap();
    let nodes_signals: Arc<dyn LoadSignals> = Arc::new(
        NatsLoadSignals::connect(NatsConfig::new(nats.url(), CLUSTER))
            .await
            .unwrap(),
    );

    let p0 = start_prefill("p0").await;
    let d0 = start_decode("d0").await;
    let d1 = start_decode("d1").await;
    let _p0 = register(&nodes_discovery, &nodes_signals, p0.info(), &stop).await;
    let d0_pub = register(&nodes_discovery, &nodes_signals, d0.info(), &stop).await;
    let d1_pub = register(&nodes_discovery, &nodes_signals, d1.info(), &stop).await;

    let router_discovery: Arc<dyn Discovery> =
        Arc::new(EtcdDiscovery::connect(etcd_config).await.unwrap());
    let router_signals: Arc<dyn LoadSignals> = Arc::new(
        NatsLoadSignals::connect(NatsConfig::new(nats.url(), CLUSTER))
            .await
            .unwrap(),
    );
    let mut opts = options();
    opts.max_report_age = Duration::from_millis(500);
    let router = start_router(router_discovery, router_signals, opts).await;
    assert_eq!(router.router.available_nodes(), (1, 2));

    // Requests are served and, once reports arrive over NATS, routed by them.
    serve_until(&router, "routing by NATS load reports", WAIT, || {
        router.router.stats().decode.load_picks > 0
    })
    .await;

    // A decode node joining through etcd gets traffic within a second (the others report
    // themselves busy).
    for published in [&d0_pub, &d1_pub] {
        published.load.send_modify(|r| r.running = 10);
    }
    let d2 = start_decode("d2").await;
    let d2_pub = register(&nodes_discovery, &nodes_signals, d2.info(), &stop).await;
    let registered = Instant::now();
    serve_until(
        &router,
        "the new node receiving traffic",
        Duration::from_secs(1),
        || decode_calls(&d2) > 0,
    )
    .await;
    tracing::info!(elapsed = ?registered.elapsed(), "new decode node got its first request");

    // It leaves: no more traffic for it.
    d2_pub.registration.deregister().await.unwrap();
    tokio::time::timeout(WAIT, async {
        while router.router.available_nodes().1 != 2 {
            router.router.membership_changed().await;
        }
    })
    .await
    .expect("the router saw the node leave");
    let before = decode_calls(&d2);
    for _ in 0..3 {
        generate(&router, "after leaving", 2).await.unwrap();
    }
    assert_eq!(decode_calls(&d2), before);

    let health = common::http(router.http_addr, "GET", "/health", None, None).await;
    assert_eq!(
        health.json()["load_reports_connected"],
        true,
        "{}",
        health.body
    );
    assert_eq!(health.json()["cluster"], CLUSTER);

    // NATS stops: serving goes on, routing falls back to in-flight counts (counted, logged).
    nats.stop();
    serve_until(&router, "the fallback after NATS stopped", WAIT, || {
        router.router.stats().decode.fallback_entered > 0
    })
    .await;
    let health = common::http(router.http_addr, "GET", "/health", None, None).await;
    assert_eq!(
        health.status, 200,
        "nodes are still registered: {}",
        health.body
    );
    assert_eq!(
        health.json()["load_reports_connected"],
        false,
        "{}",
        health.body
    );
    // NATS returns: reports resume and routing uses them again.

    nats.restart().await;
    let picks = router.router.stats().decode.load_picks;
    serve_until(
        &router,
        "load reports resuming after NATS restarted",
        Duration::from_secs(30),
        || router.router.stats().decode.load_picks > picks,
    )
    .await;
    stop.cancel();
}
