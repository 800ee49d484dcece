//! The planner's loop against the in-process twins of etcd and NATS (the real ones are
//! exercised by cluster/tests/scale.rs and cli/tests/scaling.rs).

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use tandem_cluster::{
    Discovery, Election, LoadReport, LoadSignals, MemoryDiscovery, MemoryElection, MemoryLoadSignals,
    MemoryScaleStore, NodeInfo, PoolBounds, Role, ScaleLimits, ScaleStore,
};
use tandem_kv_layout::{KvDtype, KvLayout};
use tandem_planner::{
    Actuator, MemoryDecisionSink, Observer, Planner, PlannerConfig, PlannerError, PlannerMemory,
    PlannerMetrics, StoreActuator,
};
use tokio_util::sync::CancellationToken;

struct Cluster {
    discovery: MemoryDiscovery,
    signals: MemoryLoadSignals,
    store: Arc<MemoryScaleStore>,
    _registrations: Vec<tandem_cluster::Registration>,
}

async fn cluster() -> Cluster {
    let discovery = MemoryDiscovery::new("plan").unwrap();
    let signals = MemoryLoadSignals::new("plan").unwrap();
    let store = Arc::new(MemoryScaleStore::default());
    store
        .set_limits(ScaleLimits {
            prefill: PoolBounds { min: 1, max: 4 },
            decode: PoolBounds { min: 1, max: 3 },
        })
        .await
        .unwrap();
    store.set_target(Role::Prefill, 1).await.unwrap();
    store.set_target(Role::Decode, 1).await.unwrap();
    let layout = KvLayout::new(30, 3, 64, 16, KvDtype::F16, 1).unwrap();
    let mut regs = Vec::new();
    for (id, role) in [("prefill-0", Role::Prefill), ("decode-0", Role::Decode)] {
        let info = NodeInfo::new(id, role, format!("http://127.0.0.1:1/{id}"), layout, 1024)
            .with_kv_transfer_addr("tcp://127.0.0.1:2");
        regs.push(discovery.register(info).await.unwrap());
    }
    Cluster {
        discovery,
        signals,
        store,
        _registrations: regs,
    }
}

/// prefill-0 reports `pending` prompt tokens at 1,000 tok/s; decode-0 is half full.
async fn report_backlog(c: &Cluster, pending: u64) {
    let mut p = LoadReport::idle("prefill-0", Role::Prefill, 1024);
    p.pending_prompt_tokens = pending;
    p.tokens_per_s = 1000.0;
    c.signals.publish(&p).await.unwrap();
    let mut d = LoadReport::idle("decode-0", Role::Decode, 1000);
    d.free_blocks = 500;
    c.signals.publish(&d).await.unwrap();
}

fn config() -> PlannerConfig {
    PlannerConfig {
        prefill_tokens_per_s: 1000.0,
        ttft_p90_slo_ms: 2000,
        interval_ms: 50,
        ..PlannerConfig::default()
    }
}

async fn planner(
    c: &Cluster,
    id: &str,
    dry_run: bool,
    actuator: Arc<dyn Actuator>,
    election: MemoryElection,
    sink: MemoryDecisionSink,
) -> Planner {
    Planner {
        id: id.into(),
        config: config(),
        dry_run,
        observer: Observer::connect(&c.discovery, &c.signals, c.store.clone(), Duration::from_secs(5))
            .await
            .unwrap(),
        actuator,
        election: Arc::new(election),
        sinks: vec![Arc::new(sink)],
        metrics: PlannerMetrics::default(),
    }
}

#[tokio::test]
async fn a_backlog_grows_prefill_to_its_max_and_a_dry_run_only_publishes() {
    let c = cluster().await;
    let store: Arc<dyn ScaleStore> = c.store.clone();
    let actuator = Arc::new(StoreActuator(store));
    let election = MemoryElection::default();

    // Subscriptions see reports sent after they start.
    let sink = MemoryDecisionSink::default();
    let dry = planner(&c, "dry", true, actuator.clone(), election.clone(), sink.clone()).await;
    report_backlog(&c, 6000).await;
    let records = dry.round(&mut PlannerMemory::default(), &mut Vec::new(), None).await;
    assert_eq!(records.len(), 1, "{records:?}");
    let r = &records[0];
    // 6,000 tokens at 1,000 tok/s per node in a 1 s window: 6 nodes, capped at max 4.
    assert_eq!((r.decision.pool, r.decision.from, r.decision.to), ("prefill", 1, 4));
    assert!(r.dry_run && !r.applied);
    assert_eq!(c.store.targets().await.unwrap().prefill, Some(1), "a dry run applied");
    let json = serde_json::to_value(r).unwrap();
    assert_eq!(json["inputs"]["demand"], 6000.0);
    assert!(json["reason"].as_str().unwrap().contains("6000 prompt tokens pending"));

    // A leader applies it.
    let sink = MemoryDecisionSink::default();
    let acting = planner(&c, "a", false, actuator, election.clone(), sink.clone()).await;
    let cancel = CancellationToken::new();
    let lead = election.campaign("a", &cancel).await.unwrap().unwrap();
    report_backlog(&c, 6000).await;
    let records = acting
        .round(&mut PlannerMemory::default(), &mut Vec::new(), Some(&lead))
        .await;
    assert!(records[0].applied);
    assert_eq!(c.store.targets().await.unwrap().prefill, Some(4));
    assert!(acting.metrics.render().contains("tandem_planner_decisions_total{pool=\"prefill\",direction=\"up\"} 1"));
}

#[tokio::test]
async fn of_two_planners_only_the_leader_acts_and_the_other_takes_over_when_it_stops() {
    let c = cluster().await;
    let store: Arc<dyn ScaleStore> = c.store.clone();
    let election = MemoryElection::default();
    let (sink_a, sink_b) = (MemoryDecisionSink::default(), MemoryDecisionSink::default());
    let a = planner(&c, "a", false, Arc::new(StoreActuator(store.clone())), election.clone(), sink_a.clone()).await;
    let b = planner(&c, "b", false, Arc::new(StoreActuator(store)), election.clone(), sink_b.clone()).await;
    let (stop_a, stop_b) = (CancellationToken::new(), CancellationToken::new());
    let ta = tokio::spawn(a.run(stop_a.clone()));
    tokio::time::sleep(Duration::from_millis(30)).await;
    let tb = tokio::spawn(b.run(stop_b.clone()));
    report_backlog(&c, 3000).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(c.store.targets().await.unwrap().prefill, Some(3));
    assert!(!sink_a.0.lock().unwrap().is_empty());
    assert!(sink_b.0.lock().unwrap().is_empty(), "the follower decided");

    // The leader stops (resigns); the follower is elected and acts on the next backlog.
    stop_a.cancel();
    ta.await.unwrap().unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(election.leader().await.unwrap().as_deref(), Some("b"));
    report_backlog(&c, 4000).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(c.store.targets().await.unwrap().prefill, Some(4));
    assert!(sink_b.0.lock().unwrap().iter().any(|r| r.applied && r.decision.to == 4));
    stop_b.cancel();
    tb.await.unwrap().unwrap();
}

/// Fails its first `failures` calls.
#[derive(Debug)]
struct Flaky {
    failures: AtomicU32,
    inner: StoreActuator,
}

#[async_trait]
impl Actuator for Flaky {
    fn name(&self) -> &'static str {
        "flaky"
    }
    async fn apply(&self, pool: Role, size: usize) -> Result<(), PlannerError> {
        if self.failures.load(Ordering::SeqCst) > 0 {
            self.failures.fetch_sub(1, Ordering::SeqCst);
            return Err(PlannerError::Executor {
                executor: "flaky",
                pool,
                size,
                reason: "refused".into(),
            });
        }
        self.inner.apply(pool, size).await
    }
}

#[tokio::test]
async fn an_executor_error_is_counted_and_retried_with_back_off_until_applied() {
    let c = cluster().await;
    let store: Arc<dyn ScaleStore> = c.store.clone();
    let flaky = Arc::new(Flaky {
        failures: AtomicU32::new(2),
        inner: StoreActuator(store),
    });
    let election = MemoryElection::default();
    let p = planner(&c, "a", false, flaky.clone(), election.clone(), MemoryDecisionSink::default()).await;
    let lead = election.campaign("a", &CancellationToken::new()).await.unwrap().unwrap();
    let (mut memory, mut retries) = (PlannerMemory::default(), Vec::new());
    report_backlog(&c, 2000).await;
    let r = p.round(&mut memory, &mut retries, Some(&lead)).await;
    assert!(!r[0].applied);
    assert_eq!(retries.len(), 1);
    // Not retried before its time; retried after (0.5 s, then 1 s).
    p.round(&mut memory, &mut retries, Some(&lead)).await;
    assert_eq!(flaky.failures.load(Ordering::SeqCst), 1);
    tokio::time::sleep(Duration::from_millis(550)).await;
    p.round(&mut memory, &mut retries, Some(&lead)).await;
    assert_eq!(flaky.failures.load(Ordering::SeqCst), 0);
    assert_eq!(c.store.targets().await.unwrap().prefill, Some(1));
    tokio::time::sleep(Duration::from_millis(1050)).await;
    p.round(&mut memory, &mut retries, Some(&lead)).await;
    assert_eq!(c.store.targets().await.unwrap().prefill, Some(2));
    assert!(retries.is_empty());
    assert!(p.metrics.render().contains("tandem_planner_executor_errors_total{pool=\"prefill\"} 2"));
}
