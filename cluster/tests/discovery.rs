//! Membership behaviour, one body per behaviour, run against every implementation: a real
//! etcd (started per test, lease TTL 2 s) and the in-process registry.
//!
//! Each `client()` call stands for a separate process: for etcd it is a new connection.

use crate::common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use common::*;
use tandem_cluster::testing::TestEtcd;
use tandem_cluster::{
    ClusterError, Discovery, EtcdConfig, EtcdDiscovery, MemoryDiscovery, NodeView, Role,
};

/// One implementation under test.
#[async_trait]
trait Fixture: Send + Sync + 'static {
    /// A client of `cluster`, as another process would hold it.
    async fn client(&self, cluster: &str) -> Arc<dyn Discovery>;
    /// How long a dead holder's record may take to disappear.
    fn expiry_bound(&self) -> Duration;
}

struct EtcdFixture {
    etcd: TestEtcd,
}

#[async_trait]
impl Fixture for EtcdFixture {
    async fn client(&self, cluster: &str) -> Arc<dyn Discovery> {
        let config = EtcdConfig::new(vec![self.etcd.endpoint()], cluster).with_lease_ttl(TEST_TTL);
        Arc::new(EtcdDiscovery::connect(config).await.expect("etcd client"))
    }
    fn expiry_bound(&self) -> Duration {
        // etcd checks expiry on a 500 ms tick; one more second of slack for a busy machine.
        TEST_TTL + Duration::from_millis(1500)
    }
}

struct MemoryFixture {
    registries: Mutex<Vec<MemoryDiscovery>>,
}

#[async_trait]
impl Fixture for MemoryFixture {
    async fn client(&self, cluster: &str) -> Arc<dyn Discovery> {
        let mut registries = self.registries.lock().unwrap();
        if let Some(existing) = registries.iter().find(|r| r.cluster() == cluster) {
            return Arc::new(existing.clone());
        }
        let registry = MemoryDiscovery::new(cluster).unwrap();
        registries.push(registry.clone());
        Arc::new(registry)
    }
    fn expiry_bound(&self) -> Duration {
        // The record goes when the holder's runtime drops its tasks, which a shut-down runtime
        // does on its own threads: at once on an idle machine, later on a loaded one. The
        // contract is etcd's (gone within the lease TTL), so the bound is too.
        TEST_TTL + Duration::from_millis(1500)
    }
}

async fn etcd_fixture() -> EtcdFixture {
    init_tracing();
    EtcdFixture {
        etcd: TestEtcd::start().await,
    }
}

async fn memory_fixture() -> MemoryFixture {
    init_tracing();
    MemoryFixture {
        registries: Mutex::new(Vec::new()),
    }
}

const SOON: Duration = Duration::from_secs(1);

/// The behaviours; each takes the fixture and a cluster name.
mod behaviour {
    use super::*;

    pub async fn registered_node_is_listed_and_watched(fx: &dyn Fixture) {
        let cluster = cluster_name("listed");
        let node_side = fx.client(&cluster).await;
        let router_side = fx.client(&cluster).await;
        let info = node("p0", Role::Prefill);
        let registration = node_side.register(info.clone()).await.expect("register");
        assert_eq!(registration.node_id(), "p0");
        let listed = router_side.list(Role::Prefill).await.unwrap();
        assert_eq!(listed.get("p0"), Some(&info));
        assert!(router_side.list(Role::Decode).await.unwrap().is_empty());
        let view = router_side.watch(Role::Prefill).await.unwrap();
        assert_eq!(view.borrow().get("p0"), Some(&info));
    }

    pub async fn second_node_appears_in_a_watch_within_one_second(fx: &dyn Fixture) {
        let cluster = cluster_name("second");
        let router_side = fx.client(&cluster).await;
        let _first = fx
            .client(&cluster)
            .await
            .register(node("d0", Role::Decode))
            .await
            .unwrap();
        let mut view = router_side.watch(Role::Decode).await.unwrap();
        wait_for(&mut view, SOON, "first node in view", |v: &NodeView| {
            v.contains_key("d0")
        })
        .await;
        let joiner = fx.client(&cluster).await;
        let _second = joiner.register(node("d1", Role::Decode)).await.unwrap();
        let registered_at = Instant::now();
        wait_for(&mut view, SOON, "second node in view", |v: &NodeView| {
            v.contains_key("d1")
        })
        .await;
        eprintln!(
            "join visible {:?} after register returned",
            registered_at.elapsed()
        );
        assert_eq!(view.borrow().len(), 2);
    }

    pub async fn deregister_removes_the_node_at_once(fx: &dyn Fixture) {
        let cluster = cluster_name("deregister");
        let mut view = fx.client(&cluster).await.watch(Role::Decode).await.unwrap();
        let registration = fx
            .client(&cluster)
            .await
            .register(node("d0", Role::Decode))
            .await
            .unwrap();
        wait_for(&mut view, SOON, "node in view", |v: &NodeView| {
            v.contains_key("d0")
        })
        .await;
        let started = Instant::now();
        registration.deregister().await.expect("deregister");
        wait_for(
            &mut view,
            Duration::from_millis(500),
            "node gone",
            |v: &NodeView| v.is_empty(),
        )
        .await;
        eprintln!("deregister visible after {:?}", started.elapsed());
        assert!(
            fx.client(&cluster)
                .await
                .list(Role::Decode)
                .await
                .unwrap()
                .is_empty()
        );
    }

    pub async fn dropped_registration_disappears_within_the_lease_ttl(fx: &dyn Fixture) {
        let cluster = cluster_name("dropped");
        let mut view = fx.client(&cluster).await.watch(Role::Decode).await.unwrap();
        let registration = fx
            .client(&cluster)
            .await
            .register(node("d0", Role::Decode))
            .await
            .unwrap();
        wait_for(&mut view, SOON, "node in view", |v: &NodeView| {
            v.contains_key("d0")
        })
        .await;
        let dropped_at = Instant::now();
        drop(registration);
        wait_for(
            &mut view,
            fx.expiry_bound(),
            "dropped node gone",
            |v: &NodeView| v.is_empty(),
        )
        .await;
        eprintln!("dropped holder gone after {:?}", dropped_at.elapsed());
    }

    /// The holder's whole runtime dies (what a killed process looks like from inside): no
    /// handle is dropped politely, no deregister runs.
    pub async fn killed_holder_disappears_within_the_lease_ttl(fx: Arc<dyn Fixture>) {
        let cluster = cluster_name("killed");
        let mut view = fx
            .client(&cluster)
            .await
            .watch(Role::Prefill)
            .await
            .unwrap();
        let (registered_tx, registered_rx) = std::sync::mpsc::channel();
        let (kill_tx, kill_rx) = std::sync::mpsc::channel::<()>();
        let holder_fx = Arc::clone(&fx);
        let holder_cluster = cluster.clone();
        let holder = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async {
                let discovery = holder_fx.client(&holder_cluster).await;
                let registration = discovery.register(node("p0", Role::Prefill)).await.unwrap();
                tokio::spawn(async move {
                    let _held = (discovery, registration);
                    std::future::pending::<()>().await
                });
            });
            registered_tx.send(()).unwrap();
            kill_rx.recv().unwrap();
            runtime.shutdown_background();
        });
        within(Duration::from_secs(10), "holder registered", async {
            tokio::task::spawn_blocking(move || registered_rx.recv().unwrap())
                .await
                .unwrap()
        })
        .await;
        wait_for(&mut view, SOON, "node in view", |v: &NodeView| {
            v.contains_key("p0")
        })
        .await;
        let killed_at = Instant::now();
        kill_tx.send(()).unwrap();
        wait_for(
            &mut view,
            fx.expiry_bound(),
            "killed holder gone",
            |v: &NodeView| v.is_empty(),
        )
        .await;
        eprintln!("killed holder gone after {:?}", killed_at.elapsed());
        holder.join().unwrap();
    }

    pub async fn draining_flag_is_visible_in_the_watch(fx: &dyn Fixture) {
        let cluster = cluster_name("draining");
        let mut view = fx.client(&cluster).await.watch(Role::Decode).await.unwrap();
        let registration = fx
            .client(&cluster)
            .await
            .register(node("d0", Role::Decode))
            .await
            .unwrap();
        wait_for(&mut view, SOON, "node accepting work", |v: &NodeView| {
            v.get("d0").is_some_and(|n| n.accepts_work())
        })
        .await;
        registration.set_draining(true).await.expect("set draining");
        wait_for(&mut view, SOON, "node draining", |v: &NodeView| {
            v.get("d0").is_some_and(|n| n.draining)
        })
        .await;
        registration
            .set_draining(false)
            .await
            .expect("clear draining");
        wait_for(&mut view, SOON, "node back", |v: &NodeView| {
            v.get("d0").is_some_and(|n| !n.draining)
        })
        .await;
    }

    pub async fn node_with_a_different_layout_is_refused(fx: &dyn Fixture) {
        let cluster = cluster_name("mismatch");
        let discovery = fx.client(&cluster).await;
        let first = node_with_layout("p0", Role::Prefill, layout(1));
        let _registered = discovery.register(first.clone()).await.unwrap();
        for (id, role) in [("p1", Role::Prefill), ("d1", Role::Decode)] {
            let other = node_with_layout(id, role, layout(2));
            match fx.client(&cluster).await.register(other.clone()).await {
                Err(ClusterError::LayoutMismatch {
                    cluster: c,
                    node_id,
                    expected,
                    got,
                }) => {
                    assert_eq!((c.as_str(), node_id.as_str()), (cluster.as_str(), id));
                    assert_eq!(expected, first.layout_fingerprint);
                    assert_eq!(got, other.layout_fingerprint);
                }
                other => panic!("expected LayoutMismatch, got {other:?}"),
            }
            assert!(!discovery.list(role).await.unwrap().contains_key(id));
        }
        // A node with the cluster's layout is still welcome.
        discovery
            .register(node_with_layout("d2", Role::Decode, layout(1)))
            .await
            .unwrap();
    }

    pub async fn cluster_layout_changes_only_once_every_node_has_left(fx: &dyn Fixture) {
        let cluster = cluster_name("relayout");
        let discovery = fx.client(&cluster).await;
        let old = discovery
            .register(node_with_layout("p0", Role::Prefill, layout(1)))
            .await
            .unwrap();
        old.deregister().await.unwrap();
        let _new = discovery
            .register(node_with_layout("p1", Role::Prefill, layout(2)))
            .await
            .expect("an empty cluster takes a new layout");
        let refused = discovery
            .register(node_with_layout("d0", Role::Decode, layout(1)))
            .await;
        assert!(
            matches!(refused, Err(ClusterError::LayoutMismatch { .. })),
            "{refused:?}"
        );
    }

    pub async fn node_id_cannot_register_twice_in_one_role(fx: &dyn Fixture) {
        let cluster = cluster_name("twice");
        let discovery = fx.client(&cluster).await;
        let _first = discovery.register(node("n0", Role::Decode)).await.unwrap();
        let again = fx
            .client(&cluster)
            .await
            .register(node("n0", Role::Decode))
            .await;
        match again {
            Err(e @ ClusterError::NodeExists { .. }) => assert!(e.is_retryable()),
            other => panic!("expected NodeExists, got {other:?}"),
        }
        let _other_role = discovery
            .register(node("n0", Role::Prefill))
            .await
            .expect("other role");
    }

    pub async fn hostile_node_ids_round_trip_through_the_registry(fx: &dyn Fixture) {
        let cluster = cluster_name("hostile.*>/x");
        let discovery = fx.client(&cluster).await;
        let ids = ["a.b", "a/b", "*", ">", "%41", "n ø"];
        let mut held = Vec::new();
        for id in ids {
            held.push(discovery.register(node(id, Role::Decode)).await.unwrap());
        }
        let mut view = fx.client(&cluster).await.watch(Role::Decode).await.unwrap();
        let seen = wait_for(&mut view, SOON, "all ids", |v: &NodeView| {
            v.len() == ids.len()
        })
        .await;
        for id in ids {
            assert_eq!(seen.get(id).map(|n| n.node_id.as_str()), Some(id));
        }
    }

    pub async fn clusters_do_not_see_each_other(fx: &dyn Fixture) {
        let names = [
            cluster_name("iso"),
            cluster_name("iso/sub"),
            cluster_name("isox"),
        ];
        let mut held = Vec::new();
        for (i, name) in names.iter().enumerate() {
            let discovery = fx.client(name).await;
            held.push(
                discovery
                    .register(node(&format!("d{i}"), Role::Decode))
                    .await
                    .unwrap(),
            );
        }
        for (i, name) in names.iter().enumerate() {
            let listed = fx.client(name).await.list(Role::Decode).await.unwrap();
            assert_eq!(
                listed.keys().cloned().collect::<Vec<_>>(),
                vec![format!("d{i}")],
                "{name}"
            );
        }
    }
}

/// Instantiates every behaviour for one implementation.
macro_rules! discovery_suite {
    ($suite:ident, $fixture:path) => {
        mod $suite {
            use super::*;

            #[tokio::test]
            async fn registered_node_is_listed_and_watched() {
                behaviour::registered_node_is_listed_and_watched(&$fixture().await).await
            }
            #[tokio::test]
            async fn second_node_appears_in_a_watch_within_one_second() {
                behaviour::second_node_appears_in_a_watch_within_one_second(&$fixture().await).await
            }
            #[tokio::test]
            async fn deregister_removes_the_node_at_once() {
                behaviour::deregister_removes_the_node_at_once(&$fixture().await).await
            }
            #[tokio::test]
            async fn dropped_registration_disappears_within_the_lease_ttl() {
                behaviour::dropped_registration_disappears_within_the_lease_ttl(&$fixture().await)
                    .await
            }
            #[tokio::test]
            async fn killed_holder_disappears_within_the_lease_ttl() {
                behaviour::killed_holder_disappears_within_the_lease_ttl(Arc::new($fixture().await))
                    .await
            }
            #[tokio::test]
            async fn draining_flag_is_visible_in_the_watch() {
                behaviour::draining_flag_is_visible_in_the_watch(&$fixture().await).await
            }
            #[tokio::test]
            async fn node_with_a_different_layout_is_refused() {
                behaviour::node_with_a_different_layout_is_refused(&$fixture().await).await
            }
            #[tokio::test]
            async fn cluster_layout_changes_only_once_every_node_has_left() {
                behaviour::cluster_layout_changes_only_once_every_node_has_left(&$fixture().await)
                    .await
            }
            #[tokio::test]
            async fn node_id_cannot_register_twice_in_one_role() {
                behaviour::node_id_cannot_register_twice_in_one_role(&$fixture().await).await
            }
            #[tokio::test]
            async fn hostile_node_ids_round_trip_through_the_registry() {
                behaviour::hostile_node_ids_round_trip_through_the_registry(&$fixture().await).await
            }
            #[tokio::test]
            async fn clusters_do_not_see_each_other() {
                behaviour::clusters_do_not_see_each_other(&$fixture().await).await
            }
        }
    };
}

discovery_suite!(etcd, etcd_fixture);
discovery_suite!(memory, memory_fixture);
