//! Load-signal behaviour, one body per behaviour, run against a real NATS server (started per
//! test, stopped and restarted for outages) and the in-process bus (switched off and on).
//!
//! Each `signals()` call stands for a separate process: for NATS it is a new connection.

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use common::*;
use tandem_cluster::testing::TestNats;
use tandem_cluster::{
    DEFAULT_LOAD_PERIOD, LoadPublisher, LoadReport, LoadSignals, LoadSignalsStatus, LoadView,
    MemoryLoadSignals, NatsConfig, NatsLoadSignals, Role,
};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// One implementation under test.
#[async_trait]
trait Fixture: Send {
    /// A connection to the bus, as another process would hold it.
    async fn signals(&self) -> Arc<dyn LoadSignals>;
    /// Takes the bus away.
    async fn outage(&mut self);
    /// Brings it back.
    async fn recover(&mut self);
}

const CLUSTER: &str = "test-load";

struct NatsFixture {
    nats: TestNats,
}

#[async_trait]
impl Fixture for NatsFixture {
    async fn signals(&self) -> Arc<dyn LoadSignals> {
        let mut config = NatsConfig::new(self.nats.url(), CLUSTER);
        config.reconnect_delay_max = Duration::from_millis(500);
        let signals = NatsLoadSignals::connect(config).await.expect("nats client");
        let mut status = signals.status();
        wait_for(
            &mut status,
            Duration::from_secs(5),
            "NATS connected",
            |s: &LoadSignalsStatus| s.connected,
        )
        .await;
        Arc::new(signals)
    }
    async fn outage(&mut self) {
        self.nats.stop();
    }
    async fn recover(&mut self) {
        self.nats.restart().await;
    }
}

struct MemoryFixture {
    bus: MemoryLoadSignals,
}

#[async_trait]
impl Fixture for MemoryFixture {
    async fn signals(&self) -> Arc<dyn LoadSignals> {
        Arc::new(self.bus.clone())
    }
    async fn outage(&mut self) {
        self.bus.set_available(false);
    }
    async fn recover(&mut self) {
        self.bus.set_available(true);
    }
}

async fn nats_fixture() -> NatsFixture {
    init_tracing();
    NatsFixture {
        nats: TestNats::start().await,
    }
}

async fn memory_fixture() -> MemoryFixture {
    init_tracing();
    MemoryFixture {
        bus: MemoryLoadSignals::new(CLUSTER).unwrap(),
    }
}

/// A node's side: the report channel its engine writes, and the running publisher.
struct Node {
    reports: watch::Sender<LoadReport>,
    publisher: LoadPublisher,
    signals: Arc<dyn LoadSignals>,
}

async fn start_node(fx: &dyn Fixture, id: &str, role: Role, period: Duration) -> Node {
    let signals = fx.signals().await;
    let (reports, rx) = watch::channel(LoadReport::idle(id, role, 64));
    let publisher =
        LoadPublisher::spawn(Arc::clone(&signals), rx, period, &CancellationToken::new());
    Node {
        reports,
        publisher,
        signals,
    }
}

fn seq_of(view: &LoadView, id: &str) -> u64 {
    view.get(id).map_or(0, |r| r.report.seq)
}

mod behaviour {
    use super::*;

    pub async fn reports_arrive_several_times_a_second(fx: &mut dyn Fixture) {
        let router = fx.signals().await;
        let mut view = router.subscribe(Role::Decode).await.unwrap();
        let node = start_node(fx, "d0", Role::Decode, DEFAULT_LOAD_PERIOD).await;
        node.reports.send_modify(|r| {
            r.running = 3;
            r.free_blocks = 40;
        });
        let first = wait_for(
            &mut view,
            Duration::from_secs(2),
            "first report with the node's load",
            |v: &LoadView| v.get("d0").is_some_and(|r| r.report.running == 3),
        )
        .await;
        let (seq0, t0) = (seq_of(&first, "d0"), Instant::now());
        wait_for(
            &mut view,
            Duration::from_millis(1500),
            "four more reports",
            |v: &LoadView| seq_of(v, "d0") >= seq0 + 4,
        )
        .await;
        let rate = 4.0 / t0.elapsed().as_secs_f64();
        eprintln!("load reports at {rate:.1}/s (period {DEFAULT_LOAD_PERIOD:?})");
        let got = view.borrow()["d0"].clone();
        assert_eq!((got.report.free_blocks, got.report.total_blocks), (40, 64));
        assert!(got.report.sent_at_unix_ms > 0);
        assert!(got.is_fresh(Duration::from_millis(500)));
        assert!(node.signals.status().borrow().published >= 5);
        assert!(router.status().borrow().received >= 5);
    }

    pub async fn publisher_sends_the_latest_value_not_a_queue(fx: &mut dyn Fixture) {
        let router = fx.signals().await;
        let mut view = router.subscribe(Role::Prefill).await.unwrap();
        let node = start_node(fx, "p0", Role::Prefill, Duration::from_millis(100)).await;
        for queue_len in 1..=500 {
            node.reports.send_modify(|r| r.queue_len = queue_len);
        }
        let got = wait_for(
            &mut view,
            Duration::from_secs(2),
            "latest queue length",
            |v: &LoadView| v.get("p0").is_some_and(|r| r.report.queue_len == 500),
        )
        .await;
        assert!(
            seq_of(&got, "p0") < 20,
            "one report per period, not one per update: {got:?}"
        );
    }

    pub async fn subscribers_see_only_their_role(fx: &mut dyn Fixture) {
        let router = fx.signals().await;
        let mut decode_view = router.subscribe(Role::Decode).await.unwrap();
        let prefill_view = router.subscribe(Role::Prefill).await.unwrap();
        let _p = start_node(fx, "p0", Role::Prefill, Duration::from_millis(50)).await;
        let _d = start_node(fx, "d0", Role::Decode, Duration::from_millis(50)).await;
        wait_for(
            &mut decode_view,
            Duration::from_secs(2),
            "decode report",
            |v: &LoadView| v.contains_key("d0"),
        )
        .await;
        let mut prefill_view = prefill_view;
        wait_for(
            &mut prefill_view,
            Duration::from_secs(2),
            "prefill report",
            |v: &LoadView| v.contains_key("p0"),
        )
        .await;
        assert_eq!(decode_view.borrow().keys().collect::<Vec<_>>(), ["d0"]);
        assert_eq!(prefill_view.borrow().keys().collect::<Vec<_>>(), ["p0"]);
    }

    pub async fn outage_leaves_publisher_running_and_reports_stale_until_the_bus_returns(
        fx: &mut dyn Fixture,
    ) {
        let router = fx.signals().await;
        let mut view = router.subscribe(Role::Decode).await.unwrap();
        let node = start_node(fx, "d0", Role::Decode, Duration::from_millis(100)).await;
        wait_for(
            &mut view,
            Duration::from_secs(2),
            "first report",
            |v: &LoadView| v.contains_key("d0"),
        )
        .await;
        let mut node_status = node.signals.status();

        fx.outage().await;
        wait_for(
            &mut node_status,
            Duration::from_secs(5),
            "publisher side sees the outage",
            |s: &LoadSignalsStatus| !s.connected,
        )
        .await;
        let seq_before = seq_of(&view.borrow(), "d0");
        let failures_before = node.signals.status().borrow().publish_failures;
        // Let the last report age well past a few periods.
        tokio::time::sleep(Duration::from_millis(800)).await;
        let last = view.borrow()["d0"].clone();
        assert!(
            !last.is_fresh(Duration::from_millis(500)),
            "report must go stale: {last:?}"
        );
        assert!(
            seq_of(&view.borrow(), "d0") <= seq_before + 1,
            "nothing new during the outage"
        );
        assert!(
            node.publisher.is_running(),
            "the publisher survives the outage"
        );
        let status = node.signals.status().borrow().clone();
        assert!(
            status.publish_failures > failures_before,
            "failures are counted: {status:?}"
        );
        assert!(status.last_error.is_some());

        let recovered_at = Instant::now();
        fx.recover().await;
        let fresh = wait_for(
            &mut view,
            Duration::from_secs(10),
            "reports resume",
            |v: &LoadView| v.get("d0").is_some_and(|r| r.received_at > recovered_at),
        )
        .await;
        eprintln!(
            "reports resumed {:?} after the bus returned",
            recovered_at.elapsed()
        );
        assert!(fresh["d0"].report.seq > seq_before);
        wait_for(
            &mut node_status,
            Duration::from_secs(5),
            "publisher side reconnected",
            |s: &LoadSignalsStatus| s.connected,
        )
        .await;
    }

    pub async fn publisher_stops_when_its_report_source_is_dropped(fx: &mut dyn Fixture) {
        let node = start_node(fx, "d0", Role::Decode, Duration::from_millis(20)).await;
        let Node {
            reports, publisher, ..
        } = node;
        drop(reports);
        within(Duration::from_secs(2), "publisher stops", async {
            while publisher.is_running() {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
    }
}

macro_rules! load_suite {
    ($suite:ident, $fixture:path) => {
        mod $suite {
            use super::*;

            #[tokio::test]
            async fn reports_arrive_several_times_a_second() {
                behaviour::reports_arrive_several_times_a_second(&mut $fixture().await).await
            }
            #[tokio::test]
            async fn publisher_sends_the_latest_value_not_a_queue() {
                behaviour::publisher_sends_the_latest_value_not_a_queue(&mut $fixture().await).await
            }
            #[tokio::test]
            async fn subscribers_see_only_their_role() {
                behaviour::subscribers_see_only_their_role(&mut $fixture().await).await
            }
            #[tokio::test]
            async fn outage_leaves_publisher_running_and_reports_stale_until_the_bus_returns() {
                behaviour::outage_leaves_publisher_running_and_reports_stale_until_the_bus_returns(
                    &mut $fixture().await,
                )
                .await
            }
            #[tokio::test]
            async fn publisher_stops_when_its_report_source_is_dropped() {
                behaviour::publisher_stops_when_its_report_source_is_dropped(&mut $fixture().await)
                    .await
            }
        }
    };
}

load_suite!(nats, nats_fixture);
load_suite!(memory, memory_fixture);

/// A node may start before NATS does: it connects when the server appears, and a subscription
/// made while disconnected starts delivering then.
#[tokio::test]
async fn nats_client_started_before_the_server_connects_when_it_appears() {
    init_tracing();
    let mut nats = TestNats::start().await;
    nats.stop();
    let mut config = NatsConfig::new(nats.url(), CLUSTER);
    config.reconnect_delay_max = Duration::from_millis(300);
    let router = NatsLoadSignals::connect(config.clone())
        .await
        .expect("connect succeeds while down");
    assert!(!router.status().borrow().connected);
    let mut view = router
        .subscribe(Role::Decode)
        .await
        .expect("subscribe while down");
    let node_signals: Arc<dyn LoadSignals> =
        Arc::new(NatsLoadSignals::connect(config).await.unwrap());
    let (_reports, rx) = watch::channel(LoadReport::idle("d0", Role::Decode, 8));
    let publisher = LoadPublisher::spawn(
        node_signals,
        rx,
        Duration::from_millis(100),
        &CancellationToken::new(),
    );
    nats.restart().await;
    wait_for(
        &mut view,
        Duration::from_secs(10),
        "report after the server appeared",
        |v: &LoadView| v.contains_key("d0"),
    )
    .await;
    assert!(router.status().borrow().connected);
    publisher.stop().await;
}
